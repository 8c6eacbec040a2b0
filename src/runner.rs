//! Runs one butterfly round ([`crate::allreduce::Butterfly`]) over real byte streams.
//!
//! # Shape
//!
//! The caller hands in one bidirectional byte stream ("link") per other group member, in group
//! order, already authenticated (a TLS data connection or a libp2p stream): the runner never
//! dials. Each link carries length-delimited [`crate::wire`] frames both ways (parts one way,
//! averaged parts the other, aborts either way).
//!
//! * One **reader task** per link decodes frames (size-checked before buffering) and forwards
//!   them to the compute thread over one bounded channel. A frame for another group, an
//!   oversized or malformed frame, or the stream ending fails that link: the peer is banned as a
//!   sender and failed as a reducer for this round, and the round goes on.
//! * One **writer task** per link encodes and writes frames, each write under a timeout, from a
//!   bounded per-link queue; the compute thread only hands a link a message while its queue has
//!   room, which is how backpressure reaches the state machine (`poll_transmit`'s `ready`).
//!   Where [`RoundConfig::pace_links`] paces a link ([`crate::allreduce::pacing`]),
//!   its writer releases parts and averages in slices at the link's pace.
//! * The **compute thread** (a blocking task) owns the state machine: decoding, reduction and
//!   encoding happen there, never on the network tasks. It sleeps until the next message, the
//!   next protocol deadline, a writer freeing room, or cancellation.
//!
//! When the round is over the writers flush and close their write halves, readers are stopped,
//! and the outcome is returned. Every task is owned and joined (or aborted) before returning.
//! Dropping the round's future (a step's deadline does) aborts the link tasks, which closes the
//! links, and tells the compute thread to stop at its next wake-up: nothing outlives the round.

use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinSet;

use crate::allreduce::pacing::{PACE_SLICE_BYTES, Pacer};
use crate::allreduce::{
    Butterfly, Message, Outcome, RoundConfig, RoundError, RoundEvent, Violation,
};
use crate::buffers::BufferPool;
use crate::compression::CompressionType;
use crate::tensor::{DType, Tensor, ops};
use crate::timeline;
use crate::wire::{self, Frame, FrameDecoder, WireError};

pub mod traffic;
pub use traffic::Traffic;

/// A bidirectional byte stream to one group member.
pub trait Link: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Link for T {}

/// Runner parameters.
#[derive(Clone, Debug)]
pub struct RunnerConfig {
    /// Largest accepted frame.
    pub max_frame_bytes: usize,
    /// Bound on one frame write (a peer that stops reading fails its link).
    pub write_timeout: Duration,
    /// Messages queued per link (beyond the state machine's own window).
    pub link_queue: usize,
    /// Messages queued from all readers to the compute thread.
    pub inbound_queue: usize,
    /// Bytes of frames read from one link and queued for the compute thread at most (at least
    /// one frame of `max_frame_bytes`): a member sending faster than the round consumes makes
    /// its reader wait, not the node buffer.
    pub max_queued_bytes_per_link: usize,
    /// Bound on flushing and closing links after the round.
    pub close_timeout: Duration,
    /// Buffers for payloads, frames and the reduction; keep one config (one pool) across
    /// rounds so that later rounds reuse the first one's memory.
    pub pool: BufferPool,
    /// Timeline lane of each member's link ([`crate::timeline`]): with them, every frame sent,
    /// received and handled is a span on its member's lane. `None`: no per-frame spans.
    pub lanes: Option<Arc<[String]>>,
    /// Where the link tasks count the round's bytes and busy time ([`Traffic`]: the measured
    /// rates a peer publishes). `None`: not measured.
    pub traffic: Option<Arc<Traffic>>,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            max_frame_bytes: wire::DEFAULT_MAX_FRAME_BYTES,
            write_timeout: Duration::from_secs(30),
            link_queue: 8,
            inbound_queue: 64,
            max_queued_bytes_per_link: 2 * wire::DEFAULT_MAX_FRAME_BYTES,
            close_timeout: Duration::from_secs(5),
            pool: BufferPool::default(),
            lanes: None,
            traffic: None,
        }
    }
}

/// Why a round could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RunnerError {
    /// The round's parameters are invalid, or it was cancelled.
    #[error(transparent)]
    Round(#[from] RoundError),
    /// `links` does not have one entry per group member.
    #[error("{links} links for a group of {members}")]
    LinkCount {
        /// Links given.
        links: usize,
        /// Group size.
        members: usize,
    },
    /// Every link closed before the round could finish, with no deadline left to wait for.
    #[error("all links closed before the round finished")]
    Stalled,
    /// The compute thread panicked or was cancelled by the runtime.
    #[error("compute thread failed: {0}")]
    Internal(String),
}

/// Why a link failed (logged; the state machine sees a link failure).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkError {
    /// A malformed or oversized frame.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A frame for another group.
    #[error("frame for another group")]
    ForeignGroup,
    /// The stream ended.
    #[error("link closed")]
    Closed,
    /// Reading or writing failed.
    #[error("i/o: {0}")]
    Io(String),
    /// A write did not complete in time.
    #[error("write timed out")]
    WriteTimeout,
}

/// What the link tasks hand the compute thread.
#[derive(Debug)]
pub(crate) enum Inbound {
    Message {
        from: usize,
        message: Message,
        /// The frame's bytes in its link's budget, given back when the message is handled.
        _queued: QueuedBytes,
    },
    Failed {
        from: usize,
        error: LinkError,
    },
    Writable,
    /// A pending tensor is readable now, or (`Err`) it will never be ([`PendingTensors`]).
    Ready(Result<usize, String>),
    /// The round's future was dropped (only the compute loop makes this one).
    Abandoned,
}

/// Tensors of a round that are not readable when it starts: their values are still being
/// written (a device tensor's snapshot on its way to pinned host memory: the `cuda` feature).
/// The round starts without them: none of their parts is sent, and this peer's contribution
/// to the parts of them it reduces is not read, until `ready` yields their index
/// ([`crate::allreduce::Butterfly::with_pending`]). An `Err` from `ready` (the copy failed),
/// or `ready` closing with tensors still pending, cancels the round.
#[derive(Debug)]
pub struct PendingTensors {
    /// Indices (into the round's tensors) of the pending tensors.
    pub indices: Vec<usize>,
    /// Yields each pending tensor's index once it is readable.
    pub ready: mpsc::Receiver<Result<usize, String>>,
}

/// Runs one round: `links[i]` connects to member `i` (`None` for ourselves; `None` for another
/// member means we cannot reach it, which fails it at once). Returns our start values and the
/// outcome. Dropping the future aborts the round without telling peers; use
/// [`run_round_cancellable`] to cancel cleanly.
pub async fn run_round(
    cfg: RoundConfig,
    group_id: Bytes,
    tensors: Vec<Tensor>,
    links: Vec<Option<Box<dyn Link>>>,
    runner: RunnerConfig,
) -> Result<(Vec<Tensor>, Outcome), RunnerError> {
    let (_keep, cancel) = watch::channel(false);
    run_round_cancellable(cfg, group_id, tensors, links, runner, cancel).await
}

/// Like [`run_round`]; setting `cancel` to `true` cancels the round: peers get aborts and the
/// result is [`RoundError::Cancelled`].
pub async fn run_round_cancellable(
    cfg: RoundConfig,
    group_id: Bytes,
    tensors: Vec<Tensor>,
    links: Vec<Option<Box<dyn Link>>>,
    runner: RunnerConfig,
    cancel: watch::Receiver<bool>,
) -> Result<(Vec<Tensor>, Outcome), RunnerError> {
    run_round_pending(cfg, group_id, tensors, None, links, runner, cancel).await
}

/// Like [`run_round_cancellable`], with some tensors not yet readable when the round starts
/// (see [`PendingTensors`]).
pub async fn run_round_pending(
    cfg: RoundConfig,
    group_id: Bytes,
    tensors: Vec<Tensor>,
    pending: Option<PendingTensors>,
    links: Vec<Option<Box<dyn Link>>>,
    runner: RunnerConfig,
    cancel: watch::Receiver<bool>,
) -> Result<(Vec<Tensor>, Outcome), RunnerError> {
    use tracing::Instrument;
    let span = tracing::info_span!("round", group = %hex(&group_id), me = cfg.me);
    let mut cancel = cancel;
    async move {
        let n = cfg.members.len();
        if links.len() != n {
            return Err(RunnerError::LinkCount {
                links: links.len(),
                members: n,
            });
        }
        let me = cfg.me;
        let indices = pending.as_ref().map_or(&[][..], |p| &p.indices[..]);
        let paces = if cfg.pace_links {
            crate::allreduce::pacing::link_paces(&cfg.members, &cfg.rates, me)
        } else {
            vec![None; n]
        };
        if paces.iter().any(Option::is_some) {
            let mbit: Vec<String> = paces
                .iter()
                .map(|p| p.map_or("-".to_owned(), |p| format!("{:.1}", p * 8e-6)))
                .collect();
            tracing::debug!(mbit = %mbit.join(","), "pacing the links");
        }
        let machine =
            Butterfly::with_pending(cfg, tensors, indices, Instant::now(), runner.pool.clone())?;

        let (in_tx, mut in_rx) = mpsc::channel(runner.inbound_queue);
        let mut writers: Vec<Option<mpsc::Sender<Message>>> = (0..n).map(|_| None).collect();
        // Owned: dropping this future (the round abandoned) aborts them, closing the links.
        let mut tasks = JoinSet::new();
        let mut readers = JoinSet::new();
        let mut unreachable = Vec::new();
        for (peer, link) in links.into_iter().enumerate() {
            let Some(link) = link else {
                if peer != me {
                    unreachable.push(peer);
                }
                continue;
            };
            let (read, write) = tokio::io::split(link);
            let (tx, rx) = mpsc::channel(runner.link_queue);
            writers[peer] = Some(tx);
            let lane = runner.lanes.as_ref().and_then(|l| l.get(peer).cloned());
            readers.spawn(read_link(
                LinkEnd {
                    peer,
                    pace: None,
                    lane: lane.clone(),
                    traffic: runner.traffic.clone(),
                },
                read,
                group_id.clone(),
                in_tx.clone(),
                runner.max_frame_bytes,
                link_budget(runner.max_queued_bytes_per_link, runner.max_frame_bytes),
                runner.pool.clone(),
            ));
            tasks.spawn(write_link(
                LinkEnd {
                    peer,
                    pace: paces[peer],
                    lane,
                    traffic: runner.traffic.clone(),
                },
                write,
                rx,
                group_id.clone(),
                in_tx.clone(),
                runner.write_timeout,
                runner.close_timeout,
            ));
        }
        if let Some(PendingTensors { mut ready, .. }) = pending {
            // Readiness reaches the compute thread as the links' messages do.
            // Among the readers: aborted once the round is over.
            let to_compute = in_tx.clone();
            readers.spawn(async move {
                while let Some(r) = ready.recv().await {
                    if to_compute.send(Inbound::Ready(r)).await.is_err() {
                        return;
                    }
                }
                let closed = Err("the pending tensors' source closed".to_owned());
                let _ = to_compute.send(Inbound::Ready(closed)).await;
            });
        }
        drop(in_tx);

        // Held here until the compute thread is joined: if this future is dropped first, the
        // thread sees the channel close and returns instead of running to the round's deadlines.
        let (_abandon_guard, mut abandoned) = oneshot::channel::<()>();
        let handle = tokio::runtime::Handle::current();
        let span = tracing::Span::current();
        let lanes = runner.lanes.clone();
        let compute = tokio::task::spawn_blocking(move || {
            let _entered = span.enter();
            let mut machine = machine;
            for peer in unreachable {
                machine.handle_link_failed(Instant::now(), peer, None);
            }
            let result = compute_loop(
                &handle,
                &mut machine,
                &mut writers,
                &mut in_rx,
                &mut cancel,
                &mut abandoned,
                lanes.as_deref(),
                &mut Vec::new(),
            );
            drop(writers); // closes the link queues: writers flush and close
            result.map(|()| machine)
        });
        let machine = compute
            .await
            .map_err(|e| RunnerError::Internal(e.to_string()))?;
        // Writers end by themselves once their queue is closed (each step under a timeout).
        while tasks.join_next().await.is_some() {}
        readers.shutdown().await;
        Ok(machine?.into_outcome()?)
    }
    .instrument(span)
    .await
}

/// A sans-IO protocol the compute loop drives: the butterfly, or a group's
/// [`crate::group`] exchange.
pub(crate) trait Machine {
    /// The next message for a destination `ready` accepts.
    fn poll_transmit(
        &mut self,
        now: Instant,
        ready: impl FnMut(usize) -> bool,
    ) -> Option<crate::allreduce::Transmit>;
    /// The next event.
    fn poll_event(&mut self) -> Option<RoundEvent>;
    /// When `handle_timeout` is due next.
    fn poll_timeout(&self) -> Option<Instant>;
    /// A message from member `from`.
    fn handle_message(
        &mut self,
        now: Instant,
        from: usize,
        message: Message,
    ) -> Result<(), RoundError>;
    /// Member `peer`'s link died.
    fn handle_link_failed(&mut self, now: Instant, peer: usize);
    /// Pending tensor `tensor` is readable now ([`PendingTensors`]).
    fn handle_ready(&mut self, _tensor: usize) {}
    /// Whether some tensor is still pending.
    fn has_pending(&self) -> bool {
        false
    }
    /// Time passed.
    fn handle_timeout(&mut self, now: Instant);
    /// Cancel: abort to every peer.
    fn cancel(&mut self, now: Instant);
    /// Done.
    fn is_finished(&self) -> bool;
    /// Cancelled.
    fn is_cancelled(&self) -> bool;
    /// Nothing left to send.
    fn is_drained(&self) -> bool;
}

impl Machine for Butterfly {
    fn poll_transmit(
        &mut self,
        now: Instant,
        ready: impl FnMut(usize) -> bool,
    ) -> Option<crate::allreduce::Transmit> {
        Butterfly::poll_transmit(self, now, ready)
    }
    fn poll_event(&mut self) -> Option<RoundEvent> {
        Butterfly::poll_event(self)
    }
    fn poll_timeout(&self) -> Option<Instant> {
        Butterfly::poll_timeout(self)
    }
    fn handle_message(
        &mut self,
        now: Instant,
        from: usize,
        message: Message,
    ) -> Result<(), RoundError> {
        Butterfly::handle_message(self, now, from, message)
    }
    fn handle_link_failed(&mut self, now: Instant, peer: usize) {
        Butterfly::handle_link_failed(self, now, peer, None)
    }
    fn handle_ready(&mut self, tensor: usize) {
        Butterfly::mark_ready(self, tensor)
    }
    fn has_pending(&self) -> bool {
        Butterfly::has_pending(self)
    }
    fn handle_timeout(&mut self, now: Instant) {
        Butterfly::handle_timeout(self, now)
    }
    fn cancel(&mut self, now: Instant) {
        Butterfly::cancel(self, now)
    }
    fn is_finished(&self) -> bool {
        Butterfly::is_finished(self)
    }
    fn is_cancelled(&self) -> bool {
        Butterfly::is_cancelled(self)
    }
    fn is_drained(&self) -> bool {
        Butterfly::is_drained(self)
    }
}

/// Where the compute loop puts a member's outgoing messages: a round's per-link queue, or a
/// group's long-lived link writer with the operation's id.
pub(crate) trait Outbox {
    /// Whether a message fits now.
    fn has_room(&self) -> bool;
    /// Queues a message ([`Outbox::has_room`] was checked).
    fn push(&self, message: Message);
}

impl Outbox for mpsc::Sender<Message> {
    fn has_room(&self) -> bool {
        self.capacity() > 0
    }
    fn push(&self, message: Message) {
        // Room was checked just before and only the compute thread sends.
        let _ = self.try_send(message);
    }
}

/// A member an operation gave up on, as the compute loop saw it.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The member (index in the operation).
    pub(crate) peer: usize,
    /// Why.
    pub(crate) reason: String,
    /// Only heard of from another member (a chain neighbour's notice), not seen here.
    pub(crate) hearsay: bool,
}

/// Drives `machine` to its end on the calling (blocking) thread: see [`compute_loop`].
/// Returns the members it banned or failed, with why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn drive<M: Machine, O: Outbox>(
    handle: &tokio::runtime::Handle,
    machine: &mut M,
    writers: &mut [Option<O>],
    inbound: &mut mpsc::Receiver<Inbound>,
    cancel: &mut watch::Receiver<bool>,
    abandoned: &mut oneshot::Receiver<()>,
    lanes: Option<&[String]>,
) -> Result<Vec<Failure>, RunnerError> {
    let mut failures = Vec::new();
    compute_loop(
        handle,
        machine,
        writers,
        inbound,
        cancel,
        abandoned,
        lanes,
        &mut failures,
    )?;
    Ok(failures)
}

#[allow(clippy::too_many_arguments)]
fn compute_loop<M: Machine, O: Outbox>(
    handle: &tokio::runtime::Handle,
    machine: &mut M,
    writers: &mut [Option<O>],
    inbound: &mut mpsc::Receiver<Inbound>,
    cancel: &mut watch::Receiver<bool>,
    abandoned: &mut oneshot::Receiver<()>,
    lanes: Option<&[String]>,
    failures: &mut Vec<Failure>,
) -> Result<(), RunnerError> {
    let mut inbound_open = true;
    let mut cancel_open = true;
    loop {
        let now = Instant::now();
        while let Some(t) =
            machine.poll_transmit(now, |to| writers[to].as_ref().is_some_and(|w| w.has_room()))
        {
            if let Some(w) = &writers[t.to] {
                w.push(t.message);
            }
        }
        while let Some(ev) = machine.poll_event() {
            match ev {
                RoundEvent::Banned { peer, reason } => {
                    tracing::info!(peer, %reason, "banned sender");
                    failures.push(Failure {
                        peer,
                        reason: reason.to_string(),
                        hearsay: matches!(reason, Violation::ReportedFailed { .. }),
                    });
                }
                RoundEvent::ReducerFailed { peer, reason } => {
                    tracing::info!(peer, %reason, "reducer failed");
                    failures.push(Failure {
                        peer,
                        reason: format!("as reducer: {reason}"),
                        hearsay: false,
                    });
                }
                RoundEvent::Rejected { peer, reason } => {
                    tracing::debug!(peer, %reason, "rejected message")
                }
                RoundEvent::Finished => tracing::debug!("round finished"),
            }
        }
        if machine.is_finished() || (machine.is_cancelled() && machine.is_drained()) {
            return Ok(());
        }
        let deadline = machine.poll_timeout();
        if !inbound_open && deadline.is_none() {
            return Err(RunnerError::Stalled);
        }
        let event = handle.block_on(async {
            let sleep = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // Nobody waits for this round any more (the receiver is polled only here, and
                // the round ends right after it completes).
                _ = &mut *abandoned => Some(Some(Inbound::Abandoned)),
                ev = inbound.recv(), if inbound_open => Some(ev),
                changed = cancel.changed(), if cancel_open => {
                    if changed.is_err() {
                        // The cancel sender is gone: "never cancelled" from now on.
                        cancel_open = false;
                    }
                    None
                }
                () = sleep => Some(Some(Inbound::Writable)),
            }
        });
        let now = Instant::now();
        match event {
            None => {
                if *cancel.borrow() {
                    machine.cancel(now);
                }
            }
            Some(None) => inbound_open = false,
            Some(Some(Inbound::Message { from, message, .. })) => {
                match lanes.and_then(|l| l.get(from)) {
                    None => machine.handle_message(now, from, message)?,
                    Some(lane) => {
                        // A part's reduction runs inside the handling of its last
                        // contribution, an average's application inside its own.
                        let what = describe(&message);
                        let started = std::time::Instant::now();
                        let handled = machine.handle_message(now, from, message);
                        timeline::span(
                            "handle",
                            || lane.clone(),
                            || format!("handle {what}"),
                            started,
                            Vec::new,
                        );
                        handled?;
                    }
                }
            }
            Some(Some(Inbound::Failed { from, error })) => {
                tracing::info!(peer = from, %error, "link failed");
                machine.handle_link_failed(now, from);
            }
            Some(Some(Inbound::Writable)) => {}
            Some(Some(Inbound::Ready(Ok(tensor)))) => machine.handle_ready(tensor),
            Some(Some(Inbound::Ready(Err(error)))) => {
                if machine.has_pending() {
                    tracing::warn!(%error, "a pending tensor will not be ready: cancelling");
                    machine.cancel(now);
                }
            }
            Some(Some(Inbound::Abandoned)) => {
                return Err(RunnerError::Round(RoundError::Cancelled));
            }
        }
        machine.handle_timeout(Instant::now());
    }
}

/// A frame's bytes held in its link's budget ([`RunnerConfig::max_queued_bytes_per_link`]).
pub(crate) struct QueuedBytes(pub(crate) OwnedSemaphorePermit);

impl std::fmt::Debug for QueuedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QueuedBytes({})", self.0.num_permits())
    }
}

/// One link's budget of queued bytes: `max_queued` permits, at least one frame's worth.
pub(crate) fn link_budget(max_queued: usize, max_frame_bytes: usize) -> Arc<Semaphore> {
    let permits = max_queued.max(max_frame_bytes).max(1);
    Arc::new(Semaphore::new(
        permits.min(u32::MAX as usize).min(Semaphore::MAX_PERMITS),
    ))
}

/// Frames up to this size are read through the link's small staging buffer; larger ones go
/// straight into a pooled buffer of their own size (one copy out of the TLS layer, no
/// reallocation as the frame grows).
pub(crate) const STAGING_BYTES: usize = 64 << 10;

/// The most a frame's announced length makes the reader reserve ahead of the bytes actually
/// arriving: a peer announcing a 16 MiB frame and sending nothing costs at most this much.
const MAX_RESERVE_AHEAD: usize = 4 << 20;

/// Which member a link task serves, and its timeline lane.
struct LinkEnd {
    peer: usize,
    /// Bytes per second at which this link's parts and averages are written, if paced
    /// ([`crate::allreduce::pacing`]; writers only).
    pace: Option<f64>,
    lane: Option<String>,
    /// Where this link's transfers are counted, if anywhere.
    traffic: Option<Arc<Traffic>>,
}

async fn read_link(
    LinkEnd {
        peer,
        lane,
        traffic,
        pace: _,
    }: LinkEnd,
    mut read: impl AsyncRead + Unpin,
    group_id: Bytes,
    tx: mpsc::Sender<Inbound>,
    max_frame_bytes: usize,
    budget: Arc<Semaphore>,
    pool: BufferPool,
) {
    let decoder = FrameDecoder::new(max_frame_bytes);
    let mut staging = BytesMut::with_capacity(STAGING_BYTES);
    let mut head_at = None;
    let error = loop {
        let timed = (lane.is_some() || traffic.is_some()).then_some(&mut head_at);
        let body = match next_frame(&decoder, &mut read, &mut staging, &pool, timed).await {
            Ok(body) => body,
            Err(e) => break e,
        };
        if let (Some(traffic), Some(started)) = (&traffic, head_at) {
            traffic.received(peer, body.len() as u64, started, std::time::Instant::now());
        }
        // Nothing more is read from this link until the frames queued from it fit the budget
        // with this one (the budget holds at least one frame of the largest size).
        let cost = u32::try_from(body.len().max(1)).unwrap_or(u32::MAX);
        let Ok(queued) = budget.clone().acquire_many_owned(cost).await else {
            return;
        };
        let Frame {
            group_id: g,
            message,
        } = match wire::decode_frame(body) {
            Ok(frame) => frame,
            Err(e) => break LinkError::Wire(e),
        };
        if g != group_id {
            break LinkError::ForeignGroup;
        }
        if let (Some(lane), Some(started)) = (&lane, head_at.take()) {
            let what = describe(&message);
            let bytes = message.payload_len();
            timeline::span(
                "receive",
                || lane.clone(),
                || format!("receive {what}"),
                started,
                || vec![("payload_bytes", bytes.to_string())],
            );
        }
        let mut message = message;
        if let Message::Averaged(m) = &mut message
            && m.codec == CompressionType::None
            && m.dtype == DType::F32
        {
            // Checked here, right after the frame's bytes were decrypted into memory and are
            // still in this core's cache; the compute thread would read them back from RAM.
            m.finite = Some(ops::all_finite_le(&m.payload));
        }
        if tx
            .send(Inbound::Message {
                from: peer,
                message,
                _queued: QueuedBytes(queued),
            })
            .await
            .is_err()
        {
            return; // the round is over
        }
    };
    let _ = tx.send(Inbound::Failed { from: peer, error }).await;
}

/// Reads the next frame body. Small frames are split off `staging`; a large one is read into
/// a pooled buffer of its length (reserving at most [`MAX_RESERVE_AHEAD`] before its bytes
/// arrive), which goes back to the pool once its payload is consumed.
pub(crate) async fn next_frame(
    decoder: &FrameDecoder,
    read: &mut (impl AsyncRead + Unpin),
    staging: &mut BytesMut,
    pool: &BufferPool,
    head_at: Option<&mut Option<std::time::Instant>>,
) -> Result<Bytes, LinkError> {
    let (prefix, len) = loop {
        if let Some(header) = decoder.peek_len(staging)? {
            if let Some(at) = head_at {
                *at = Some(std::time::Instant::now());
            }
            break header;
        }
        // Only as much as a frame's head: a large body is read into its own buffer below.
        fill(read, staging, HEAD_READ).await?;
    };
    if prefix + len <= staging.len() || len <= STAGING_BYTES {
        while staging.len() < prefix + len {
            staging.reserve(prefix + len - staging.len());
            fill(read, staging, usize::MAX).await?;
        }
        staging.advance(prefix);
        return Ok(staging.split_to(len).freeze());
    }
    staging.advance(prefix);
    // An initialized buffer (reused without zeroing), grown at most MAX_RESERVE_AHEAD ahead
    // of the bytes that arrived.
    let mut body = pool.take_filled(len.min(MAX_RESERVE_AHEAD).max(staging.len()));
    let mut filled = staging.len();
    body[..filled].copy_from_slice(staging);
    staging.clear();
    while filled < len {
        if filled == body.len() {
            let grown = (filled + MAX_RESERVE_AHEAD).min(len);
            body.reserve_exact(grown - body.len());
            body.resize(grown, 0);
        }
        match read.read(&mut body[filled..]).await {
            Ok(0) => return Err(LinkError::Closed),
            Ok(n) => filled += n,
            Err(e) => return Err(LinkError::Io(e.to_string())),
        }
    }
    Ok(pool.freeze(body))
}

/// Bytes read while looking for a frame's length: enough for its head (length prefix, group
/// id, message fields), little of a large payload.
const HEAD_READ: usize = 64;

/// Reads more bytes into `staging` (keeping room for a read of useful size), at most `max`.
async fn fill(
    read: &mut (impl AsyncRead + Unpin),
    staging: &mut BytesMut,
    max: usize,
) -> Result<(), LinkError> {
    if staging.capacity() - staging.len() < 4 << 10 {
        staging.reserve(STAGING_BYTES);
    }
    match read.read_buf(&mut (&mut *staging).limit(max)).await {
        Ok(0) => Err(LinkError::Closed),
        Ok(_) => Ok(()),
        Err(e) => Err(LinkError::Io(e.to_string())),
    }
}

async fn write_link(
    LinkEnd {
        peer,
        pace,
        lane,
        traffic,
    }: LinkEnd,
    mut write: impl AsyncWrite + Unpin,
    mut rx: mpsc::Receiver<Message>,
    group_id: Bytes,
    events: mpsc::Sender<Inbound>,
    write_timeout: Duration,
    close_timeout: Duration,
) {
    let mut head = BytesMut::new();
    let mut pacer = pace.map(Pacer::new);
    while let Some(message) = rx.recv().await {
        let traced = lane.as_ref().map(|_| {
            (
                describe(&message),
                message.payload_len(),
                std::time::Instant::now(),
            )
        });
        // The compute thread hands this link a message only while its queue has room. If the
        // queue was full, it may be waiting for room, which this receive just made: wake it.
        // Otherwise it saw room at its last look and needs no wake-up (one saved per frame:
        // a futex wake and a context switch). A push racing with this check can only make it
        // wake needlessly: the queue is then full again, and the next receive wakes it.
        if rx.len() + 1 >= rx.max_capacity() {
            // Dropped if the inbound queue is full: the compute thread is awake then anyway.
            let _ = events.try_send(Inbound::Writable);
        }
        // Nothing else queued: flush, so that a buffering carrier does not sit on the frame's
        // tail while the peer waits for it.
        let idle = rx.is_empty();
        let frame = Frame {
            group_id: group_id.clone(),
            message,
        };
        let paced = match (&mut pacer, &frame.message) {
            (Some(pacer), Message::Part(_) | Message::Averaged(_)) => Some(pacer),
            _ => None,
        };
        let error = if let Some(pacer) = paced {
            // Counted slice by slice (the waits between them are not busy time).
            write_frame_paced(
                &mut write,
                &mut head,
                &frame,
                pacer,
                traffic.as_deref().map(|t| (t, peer)),
                write_timeout,
            )
            .await
            .err()
        } else {
            let writing = std::time::Instant::now();
            let error = write_frame(&mut write, &mut head, &frame, idle, write_timeout)
                .await
                .err();
            if let Some(traffic) = &traffic {
                let bytes = head.len() + frame.message.payload_len();
                traffic.sent(peer, bytes as u64, writing, std::time::Instant::now());
            }
            error
        };
        if let Some(error) = error {
            let _ = events.send(Inbound::Failed { from: peer, error }).await;
            return;
        }
        if let (Some(lane), Some((what, bytes, started))) = (&lane, traced) {
            timeline::span(
                "send",
                || lane.clone(),
                || format!("send {what}"),
                started,
                || vec![("payload_bytes", bytes.to_string())],
            );
        }
    }
    let _ = tokio::time::timeout(close_timeout, async {
        let _ = write.flush().await;
        let _ = write.shutdown().await;
    })
    .await;
}

/// Writes one frame like [`write_frame`], in slices of [`PACE_SLICE_BYTES`] released by
/// `pacer`, each flushed and counted in `traffic`; the whole frame, waits included, within
/// `timeout` (a pace too slow for it, such as one from an absurd declared rate, fails the
/// link as a peer that stops reading does).
async fn write_frame_paced(
    write: &mut (impl AsyncWrite + Unpin),
    head: &mut BytesMut,
    frame: &Frame,
    pacer: &mut Pacer,
    traffic: Option<(&Traffic, usize)>,
    timeout: Duration,
) -> Result<(), LinkError> {
    head.clear();
    let payload = wire::encode_frame_split(frame, head);
    let mut bytes = Buf::chain(&head[..], payload);
    let write_slices = async {
        while bytes.has_remaining() {
            let n = bytes.remaining().min(PACE_SLICE_BYTES);
            let now = Instant::now();
            let at = pacer.reserve(now, n);
            if at > now {
                tokio::time::sleep_until(at.into()).await;
            }
            // Flushed slice by slice: a buffering carrier must not gather them into a burst.
            write.write_all_buf(&mut (&mut bytes).take(n)).await?;
            write.flush().await?;
            if let Some((traffic, flow)) = traffic {
                // The slice moves over its time in the schedule, or until its write returned
                // if that was later (the line, not the pace, held it): a write into a socket
                // with room returns at once, and counting only that instant would measure
                // memory, not the line (`traffic`'s module docs).
                let end = Instant::now();
                let until = pacer.scheduled_until().unwrap_or(end).max(end);
                traffic.sent(flow, n as u64, at.min(end), until);
            }
        }
        Ok(())
    };
    within(timeout, write_slices).await
}

/// Writes one frame (its payload from the message's own buffer, after a small head encoded
/// into `head`), flushing when `flush`, within `timeout`.
pub(crate) async fn write_frame(
    write: &mut (impl AsyncWrite + Unpin),
    head: &mut BytesMut,
    frame: &Frame,
    flush: bool,
    timeout: Duration,
) -> Result<(), LinkError> {
    head.clear();
    let payload = wire::encode_frame_split(frame, head);
    let mut bytes = Buf::chain(&head[..], payload);
    let write_all = async {
        write.write_all_buf(&mut bytes).await?;
        if flush {
            write.flush().await?;
        }
        Ok(())
    };
    within(timeout, write_all).await
}

/// A link write within `timeout`, its failures as [`LinkError`]s.
async fn within(
    timeout: Duration,
    write: impl std::future::Future<Output = std::io::Result<()>>,
) -> Result<(), LinkError> {
    match tokio::time::timeout(timeout, write).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(LinkError::Io(e.to_string())),
        Err(_) => Err(LinkError::WriteTimeout),
    }
}

/// A message as a timeline span names it.
pub(crate) fn describe(message: &Message) -> String {
    match message {
        Message::Part(p) => format!("part {}", p.part),
        Message::Averaged(a) => format!("average {}", a.part),
        Message::Abort { role, reason } => format!("abort {role:?} {reason:?}"),
        Message::Notice { failed } => format!("notice {failed:?}"),
    }
}

/// The first 8 bytes of `bytes` in hex (group ids in logs and timelines).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allreduce::PartMessage;
    use crate::compression::CompressionType;

    /// A frame carrying one uncompressed part of `payload`.
    fn part_frame(payload: Vec<u8>) -> wire::Frame {
        wire::Frame {
            group_id: Bytes::from_static(b"paced"),
            message: Message::Part(PartMessage {
                part: 0,
                weight: 1.0,
                codec: CompressionType::None,
                dtype: DType::F32,
                payload: Bytes::from(payload),
            }),
        }
    }

    /// A paced frame leaves in slices no faster than the pacer's rate (a floor its waits
    /// guarantee), every byte as the unpaced writer writes it, each slice counted as sent.
    #[tokio::test]
    async fn a_paced_frame_is_written_in_slices_at_its_rate() {
        const PAYLOAD: usize = 10 * PACE_SLICE_BYTES;
        const RATE: f64 = 4e6; // bytes per second
        let frame = part_frame((0..PAYLOAD).map(|i| i as u8).collect());
        // What the unpaced writer puts on a link for the same frame.
        let timeout = Duration::from_secs(30);
        let mut head = BytesMut::new();
        let (mut w, mut r) = tokio::io::duplex(1 << 20);
        write_frame(&mut w, &mut head, &frame, true, timeout)
            .await
            .unwrap();
        drop(w);
        let mut expected = Vec::new();
        r.read_to_end(&mut expected).await.unwrap();
        let len = expected.len();
        assert!(len > PAYLOAD && len < PAYLOAD + PACE_SLICE_BYTES);

        let (mut write, mut read) = tokio::io::duplex(2 * len);
        let traffic = Traffic::default();
        let mut pacer = Pacer::new(RATE);
        let start = tokio::time::Instant::now();
        write_frame_paced(
            &mut write,
            &mut head,
            &frame,
            &mut pacer,
            Some((&traffic, 0)),
            timeout,
        )
        .await
        .unwrap();
        let took = start.elapsed();
        // 11 slices: the first at once, each later one a slice's time after the one before
        // (less the slack a late wake-up may catch up on).
        let slices = len.div_ceil(PACE_SLICE_BYTES);
        assert_eq!(slices, 11);
        let spacing = Duration::from_secs_f64(PACE_SLICE_BYTES as f64 / RATE);
        let floor = spacing * (slices as u32 - 1) - crate::allreduce::pacing::PACE_SLACK;
        assert!(took >= floor, "{took:?} < {floor:?}");
        assert_eq!(traffic.bytes().0, len as u64);
        let mut got = vec![0u8; len];
        read.read_exact(&mut got).await.unwrap();
        assert!(got == expected, "the paced bytes differ");
    }

    /// A paced flow measures its pace, not the speed of the writes: into a link with room for
    /// the whole frame every write returns at once, and the slices' times in the schedule are
    /// what the line was busy for.
    #[tokio::test]
    async fn a_paced_flow_measures_its_pace() {
        const PAYLOAD: usize = 1 << 20;
        const RATE: f64 = 64e6; // bytes per second: the frame takes about 16 ms
        let frame = part_frame(vec![7u8; PAYLOAD]);
        let (mut write, mut read) = tokio::io::duplex(2 * PAYLOAD);
        let traffic = Traffic::default();
        write_frame_paced(
            &mut write,
            &mut BytesMut::new(),
            &frame,
            &mut Pacer::new(RATE),
            Some((&traffic, 1)),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        let now = Instant::now();
        traffic.received(0, 1 << 20, now, now + Duration::from_secs(1));
        let up = traffic.rates().unwrap().up;
        // At most the pace (the schedule's slack aside); a late runtime only makes it slower.
        assert!(up <= RATE * 1.01, "{up} > {RATE}");
        assert!(up >= RATE / 4.0, "{up} < {RATE} / 4");
        let mut got = vec![0u8; traffic.bytes().0 as usize];
        read.read_exact(&mut got).await.unwrap();
    }

    /// A pace too slow for the frame timeout (a member's absurd declared rate) fails the
    /// write with a timeout once its first slice is out, instead of waiting for days.
    #[tokio::test]
    async fn a_frame_paced_too_slowly_times_out() {
        let frame = part_frame(vec![1u8; 2 * PACE_SLICE_BYTES]);
        let (mut write, mut read) = tokio::io::duplex(4 * PACE_SLICE_BYTES);
        let traffic = Traffic::default();
        let result = write_frame_paced(
            &mut write,
            &mut BytesMut::new(),
            &frame,
            &mut Pacer::new(1e-300),
            Some((&traffic, 0)),
            Duration::from_millis(200),
        )
        .await;
        assert!(matches!(result, Err(LinkError::WriteTimeout)), "{result:?}");
        assert_eq!(traffic.bytes().0, PACE_SLICE_BYTES as u64);
        let mut first = vec![0u8; PACE_SLICE_BYTES];
        read.read_exact(&mut first).await.unwrap();
    }

    /// A member that sends frames faster than the round takes them is read only as far as its
    /// link's budget: with room for two 1 MiB frames, two are queued and the reader waits;
    /// each message the round takes lets one more in, and every frame arrives in the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_link_queues_no_more_than_its_budget() {
        const FRAME: usize = 1 << 20;
        const FRAMES: usize = 10;
        let group = Bytes::from_static(b"budget");
        let mut bytes = BytesMut::new();
        for part in 0..FRAMES as u32 {
            let frame = wire::Frame {
                group_id: group.clone(),
                message: Message::Part(PartMessage {
                    part,
                    weight: 1.0,
                    codec: CompressionType::None,
                    dtype: DType::F32,
                    payload: Bytes::from(vec![0u8; FRAME - 64]),
                }),
            };
            wire::encode_frame(&frame, &mut bytes);
        }
        // Everything is available to read at once: only the budget can hold the reader back.
        let (mut sender, receiver) = tokio::io::duplex(bytes.len() + 1);
        sender.write_all(&bytes).await.unwrap();
        let (tx, mut rx) = mpsc::channel(64);
        let budget = link_budget(2 * FRAME, FRAME);
        let reader = tokio::spawn(read_link(
            LinkEnd {
                peer: 0,
                pace: None,
                lane: None,
                traffic: None,
            },
            receiver,
            group,
            tx,
            FRAME,
            budget.clone(),
            BufferPool::default(),
        ));
        let mut taken = 0;
        while taken < FRAMES {
            if FRAMES - taken >= 2 {
                tokio::time::timeout(Duration::from_secs(60), async {
                    while rx.len() < 2 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                })
                .await
                .expect("the reader queues what fits");
                // Two frames of about 1 MiB each fill the 2 MiB budget: a third would not fit.
                assert_eq!(rx.len(), 2, "after {taken} taken");
                assert!(budget.available_permits() < FRAME, "after {taken} taken");
            }
            match rx.recv().await.expect("a frame") {
                Inbound::Message {
                    message: Message::Part(p),
                    ..
                } => assert_eq!(p.part as usize, taken),
                other => panic!("{other:?}"),
            }
            taken += 1;
        }
        drop(sender);
        // The link closes: the reader reports it and ends.
        assert!(matches!(
            rx.recv().await,
            Some(Inbound::Failed {
                error: LinkError::Closed,
                ..
            })
        ));
        reader.await.unwrap();
        assert_eq!(
            budget.available_permits(),
            2 * FRAME,
            "every byte given back"
        );
    }
}
