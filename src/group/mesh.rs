//! A group's long-lived links: one reader and one writer task per member, kept across
//! operations, and the router that hands each frame to the operation it belongs to.
//!
//! Every frame names its operation in the round frame's group id ([`OpId`]): the group's
//! prefix (a random base and a digest of the current membership), then either a collective's
//! sequence number or a point-to-point message's (source, destination, sequence). A reader
//! decodes a frame (size-checked, within its link's byte budget, as the round runner does) and
//! asks the [`Router`]: a frame of an open operation goes to that operation's compute loop; a
//! frame of a finished one (a member still sending after our side ended) is dropped; a frame
//! of an operation not yet opened here (a faster member) waits in the router, still counted in
//! its link's budget, so a member running ahead cannot make us buffer more than that budget.
//! What a held frame retains is what it is charged: its bytes are copied out of the reader's
//! staging buffer (a small frame is otherwise a slice that keeps the whole 64 KiB buffer
//! alive: tiny held frames between large dropped ones pinned ~64 KiB per ~40 bytes of budget),
//! and every frame is charged [`FRAME_OVERHEAD`] beyond its bytes for the bookkeeping around
//! it, which also bounds how many frames a link's budget can hold. Held frames are indexed by
//! prefix and operation, so opening an operation or looking for a waiting message costs no
//! scan of everything held.
//! The same holds for frames under an unknown prefix: a member that finished a membership
//! change (shrink, admit) before us already sends under the next one; when we change, frames
//! of the new prefix are used and any others dropped. Frames under a prefix we left are
//! dropped at once; an unparseable operation id or a message naming another source fails the
//! link.
//!
//! A link that fails (read error, malformed frame, write timeout) stays failed for the group's
//! life: every open operation is told at once, and every later one starts with it failed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;

use super::GroupConfig;
use crate::allreduce::Message;
use crate::buffers::BufferPool;
use crate::compression::CompressionType;
use crate::runner::{Inbound, Link, LinkError, Outbox, QueuedBytes};
use crate::tensor::{DType, ops};
use crate::wire::{self, Frame, FrameDecoder};

/// Bytes of the group prefix: a 16-byte base and an 8-byte membership digest.
pub(crate) const PREFIX_BYTES: usize = 24;

/// Bytes a frame is charged in its link's budget beyond its own: what holding it costs around
/// its bytes (its entry in the router's index, the message's fields), so that a link's budget
/// also bounds the number of frames it holds.
pub(crate) const FRAME_OVERHEAD: usize = 512;

/// What an operation id names. (Ordered collectives first, by sequence number: the router's
/// index relies on it.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum OpId {
    /// The `seq`-th collective of the current membership.
    Collective(u64),
    /// The `seq`-th message from member `src` to member `dst` (original indices).
    Message {
        /// Sender.
        src: u16,
        /// Receiver.
        dst: u16,
        /// Sequence number of this pair.
        seq: u64,
    },
}

impl OpId {
    /// The frame group id of this operation under `prefix`.
    pub(crate) fn encode(self, prefix: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(PREFIX_BYTES + 13);
        out.extend_from_slice(prefix);
        match self {
            Self::Collective(seq) => {
                out.push(b'c');
                out.extend_from_slice(&seq.to_be_bytes());
            }
            Self::Message { src, dst, seq } => {
                out.push(b'p');
                out.extend_from_slice(&src.to_be_bytes());
                out.extend_from_slice(&dst.to_be_bytes());
                out.extend_from_slice(&seq.to_be_bytes());
            }
        }
        Bytes::from(out)
    }

    /// Parses the part of a group id after the prefix.
    pub(crate) fn decode(rest: &[u8]) -> Option<Self> {
        match rest {
            [b'c', seq @ ..] => Some(Self::Collective(u64::from_be_bytes(seq.try_into().ok()?))),
            [b'p', a, b, c, d, seq @ ..] => Some(Self::Message {
                src: u16::from_be_bytes([*a, *b]),
                dst: u16::from_be_bytes([*c, *d]),
                seq: u64::from_be_bytes(seq.try_into().ok()?),
            }),
            _ => None,
        }
    }
}

/// An open operation: its id, where its frames go, and member index translation.
struct Route {
    id: OpId,
    tx: mpsc::Sender<Inbound>,
    /// Original member index -> index in the operation.
    local: Arc<[Option<usize>]>,
}

/// A frame that arrived before its operation opened here.
struct Early {
    from: usize,
    /// Order of arrival among held frames.
    arrival: u64,
    message: Message,
    queued: QueuedBytes,
}

/// Held frames of one prefix, by operation (each operation's in order of arrival).
type HeldOps = BTreeMap<OpId, VecDeque<Early>>;

/// Frames held for operations not open yet (module docs).
#[derive(Default)]
struct Held {
    /// Under the current prefix.
    current: HeldOps,
    /// Under other prefixes (from members that finished a membership change first).
    next: HashMap<Bytes, HeldOps>,
    arrivals: u64,
}

impl Held {
    #[cfg(test)]
    fn len(&self) -> usize {
        let count = |ops: &HeldOps| ops.values().map(VecDeque::len).sum::<usize>();
        count(&self.current) + self.next.values().map(count).sum::<usize>()
    }
}

/// `message` with its payload in an allocation of its own when it may be a slice of a
/// reader's staging buffer (larger frames are read into a buffer of their own size).
fn unshared(mut message: Message) -> Message {
    let payload = match &mut message {
        Message::Part(p) => &mut p.payload,
        Message::Averaged(a) => &mut a.payload,
        Message::Abort { .. } | Message::Notice { .. } => return message,
    };
    if payload.len() <= crate::runner::STAGING_BYTES {
        *payload = Bytes::copy_from_slice(payload);
    }
    message
}

/// Where frames go (see the module docs).
pub(crate) struct Router {
    me: usize,
    prefix: Bytes,
    old_prefixes: Vec<Bytes>,
    routes: Vec<Route>,
    early: Held,
    /// Collectives opened so far under the current prefix.
    next_collective: u64,
    /// Per source: messages from it received (opened) so far.
    next_message: Vec<u64>,
    failed: Vec<Option<LinkError>>,
}

/// What a reader does with a frame.
enum Routed {
    Deliver(mpsc::Sender<Inbound>, Inbound),
    Kept,
    Dropped,
}

impl Router {
    /// See [`Mesh::set_prefix`].
    fn change_prefix(&mut self, prefix: Bytes) {
        let old = std::mem::replace(&mut self.prefix, prefix);
        self.old_prefixes.push(old);
        self.next_collective = 0;
        self.next_message.iter_mut().for_each(|n| *n = 0);
        // Frames that came early under the new prefix stay; the rest can never be used.
        self.early.current = self.early.next.remove(&self.prefix).unwrap_or_default();
        self.early.next.clear();
    }

    fn route(
        &mut self,
        from: usize,
        frame: Frame,
        queued: QueuedBytes,
    ) -> Result<Routed, LinkError> {
        let g = &frame.group_id;
        if g.len() < PREFIX_BYTES {
            return Err(LinkError::ForeignGroup);
        }
        let prefix = g.slice(..PREFIX_BYTES);
        if self.old_prefixes.contains(&prefix) {
            return Ok(Routed::Dropped); // from before a membership change
        }
        let id = OpId::decode(&g[PREFIX_BYTES..]).ok_or(LinkError::ForeignGroup)?;
        if prefix != self.prefix {
            // A member that finished a membership change (shrink, admit) before us already
            // runs the next operation: held, within the link's budget, until we change too
            // (then frames of any other prefix are dropped).
            if let OpId::Message { src, dst, .. } = id
                && !((usize::from(src) == from && usize::from(dst) == self.me)
                    || (usize::from(src) == self.me && usize::from(dst) == from))
            {
                return Err(LinkError::ForeignGroup);
            }
            return Ok(self.hold(from, prefix, id, frame.message, queued));
        }
        let old = match id {
            OpId::Collective(seq) => seq < self.next_collective,
            // A message to us from the link's member, or that member's abort of one we sent.
            OpId::Message { src, dst, seq }
                if usize::from(src) == from && usize::from(dst) == self.me =>
            {
                seq < self.next_message[from]
            }
            OpId::Message { src, dst, .. }
                if usize::from(src) == self.me && usize::from(dst) == from =>
            {
                !self.routes.iter().any(|r| r.id == id)
            }
            // Forged or misdirected.
            OpId::Message { .. } => return Err(LinkError::ForeignGroup),
        };
        if let Some(route) = self.routes.iter().find(|r| r.id == id) {
            let Some(local) = route.local.get(from).copied().flatten() else {
                return Ok(Routed::Dropped);
            };
            return Ok(Routed::Deliver(
                route.tx.clone(),
                Inbound::Message {
                    from: local,
                    message: frame.message,
                    _queued: queued,
                },
            ));
        }
        if old {
            return Ok(Routed::Dropped);
        }
        Ok(self.hold(from, prefix, id, frame.message, queued))
    }

    /// Keeps a frame for an operation not open yet.
    fn hold(
        &mut self,
        from: usize,
        prefix: Bytes,
        id: OpId,
        message: Message,
        queued: QueuedBytes,
    ) -> Routed {
        let arrival = self.early.arrivals;
        self.early.arrivals += 1;
        let early = Early {
            from,
            arrival,
            message: unshared(message),
            queued,
        };
        let ops = if prefix == self.prefix {
            &mut self.early.current
        } else {
            // Copied: a slice would keep the reader's buffer alive.
            self.early
                .next
                .entry(Bytes::copy_from_slice(&prefix))
                .or_default()
        };
        ops.entry(id).or_default().push_back(early);
        Routed::Kept
    }
}

/// A group's links (see the module docs).
pub(crate) struct Mesh {
    writers: Vec<Option<mpsc::Sender<Frame>>>,
    router: Arc<Mutex<Router>>,
    arrivals: Arc<Notify>,
    writer_tasks: JoinSet<()>,
    reader_tasks: JoinSet<()>,
    cfg: GroupConfig,
    pool: BufferPool,
    /// Timeline lane of each member's link (when the timeline is on).
    lanes: Vec<Option<String>>,
    /// Each link's byte budget (what its reader has read and not yet used or dropped).
    budgets: Vec<Option<Arc<Semaphore>>>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field(
                "links",
                &self.writers.iter().filter(|w| w.is_some()).count(),
            )
            .finish_non_exhaustive()
    }
}

/// A writer of one link, with the id of the operation its messages belong to.
pub(crate) struct OpOutbox {
    tx: mpsc::Sender<Frame>,
    id: Bytes,
}

impl Outbox for OpOutbox {
    fn has_room(&self) -> bool {
        self.tx.capacity() > 0
    }
    fn push(&self, message: Message) {
        let _ = self.tx.try_send(Frame {
            group_id: self.id.clone(),
            message,
        });
    }
}

/// An open operation's inbound queue; closing it (drop) ends its route.
pub(crate) struct OpenOp {
    pub inbound: mpsc::Receiver<Inbound>,
    pub outboxes: Vec<Option<OpOutbox>>,
    router: Arc<Mutex<Router>>,
    id: OpId,
}

impl Drop for OpenOp {
    fn drop(&mut self) {
        lock(&self.router).routes.retain(|r| r.id != self.id);
    }
}

fn lock(router: &Mutex<Router>) -> MutexGuard<'_, Router> {
    // The router's state stays consistent across a panic elsewhere (each method finishes its
    // update before anything can panic), so a poisoned lock is used as is.
    router.lock().unwrap_or_else(|e| e.into_inner())
}

impl Mesh {
    /// Starts the link tasks: `links[i]` to member `i` (original index; `None` for `me` and
    /// for members we have no link to, which start failed).
    pub(crate) fn start(
        links: Vec<Option<Box<dyn Link>>>,
        me: usize,
        prefix: Bytes,
        cfg: &GroupConfig,
        pool: &BufferPool,
        lanes: Vec<Option<String>>,
    ) -> Self {
        let n = links.len();
        let failed = (0..n)
            .map(|i| (i != me && links[i].is_none()).then_some(LinkError::Closed))
            .collect();
        let router = Arc::new(Mutex::new(Router {
            me,
            prefix,
            old_prefixes: Vec::new(),
            routes: Vec::new(),
            early: Held::default(),
            next_collective: 0,
            next_message: vec![0; n],
            failed,
        }));
        let arrivals = Arc::new(Notify::new());
        let mut mesh = Self {
            writers: Vec::with_capacity(n),
            router,
            arrivals,
            writer_tasks: JoinSet::new(),
            reader_tasks: JoinSet::new(),
            cfg: cfg.clone(),
            pool: pool.clone(),
            lanes,
            budgets: Vec::with_capacity(n),
        };
        for link in links {
            mesh.spawn(link);
        }
        mesh
    }

    /// The timeline lanes of `members` (original indices), when the timeline is on.
    pub(crate) fn lanes_of(&self, members: &[usize]) -> Option<Arc<[String]>> {
        crate::timeline::enabled().then(|| {
            members
                .iter()
                .map(|&m| self.lanes.get(m).cloned().flatten().unwrap_or_default())
                .collect()
        })
    }

    /// Starts the tasks of the next member's link (`None`: no link).
    fn spawn(&mut self, link: Option<Box<dyn Link>>) {
        let peer = self.writers.len();
        let Some(link) = link else {
            self.writers.push(None);
            self.budgets.push(None);
            return;
        };
        let cfg = &self.cfg;
        let lane = self.lanes.get(peer).cloned().flatten();
        let (read, write) = tokio::io::split(link);
        let (tx, rx) = mpsc::channel(cfg.link_queue.max(1));
        self.writers.push(Some(tx));
        let budget = crate::runner::link_budget(
            cfg.max_queued_bytes_per_link,
            cfg.max_frame_bytes + FRAME_OVERHEAD,
        );
        self.budgets.push(Some(budget.clone()));
        self.reader_tasks.spawn(read_loop(
            peer,
            lane.clone(),
            read,
            self.router.clone(),
            self.arrivals.clone(),
            cfg.max_frame_bytes,
            budget,
            self.pool.clone(),
        ));
        self.writer_tasks.spawn(write_loop(
            peer,
            lane,
            write,
            rx,
            self.router.clone(),
            cfg.write_timeout,
            cfg.close_timeout,
        ));
    }

    /// Adds a member (the next original index) with its link (`None`: none, so it starts
    /// failed).
    pub(crate) fn add_member(&mut self, link: Option<Box<dyn Link>>, lane: Option<String>) {
        self.lanes.push(lane);
        {
            let mut r = lock(&self.router);
            r.failed.push(link.is_none().then_some(LinkError::Closed));
            r.next_message.push(0);
        }
        self.spawn(link);
    }

    /// Members whose link has failed (original indices).
    pub(crate) fn failed(&self) -> Vec<usize> {
        let r = lock(&self.router);
        (0..r.failed.len())
            .filter(|&i| r.failed[i].is_some())
            .collect()
    }

    /// Opens operation `id` over `members` (original indices, in the operation's order):
    /// frames for it that arrived early are queued first, then a failure note for each member
    /// whose link is down.
    pub(crate) fn open(&self, id: OpId, members: &[usize]) -> OpenOp {
        let n = self.writers.len();
        let mut local = vec![None; n];
        for (l, &m) in members.iter().enumerate() {
            local[m] = Some(l);
        }
        let local: Arc<[Option<usize>]> = local.into();
        let mut r = lock(&self.router);
        let prefix = r.prefix.clone();
        let early = r.early.current.remove(&id).unwrap_or_default();
        match id {
            OpId::Collective(seq) => {
                r.next_collective = r.next_collective.max(seq + 1);
                // Frames of collectives that were skipped here can never be used (collectives
                // sort first, by sequence number).
                let kept = r.early.current.split_off(&OpId::Collective(seq));
                r.early.current = kept;
            }
            OpId::Message { src, seq, .. } => {
                let src = usize::from(src);
                r.next_message[src] = r.next_message[src].max(seq + 1);
            }
        }
        let (tx, inbound) =
            mpsc::channel(self.cfg.inbound_queue.max(1) + early.len() + members.len());
        for e in early {
            if let Some(from) = local[e.from] {
                let _ = tx.try_send(Inbound::Message {
                    from,
                    message: e.message,
                    _queued: e.queued,
                });
            }
        }
        for (l, &m) in members.iter().enumerate() {
            if let Some(error) = &r.failed[m] {
                let _ = tx.try_send(Inbound::Failed {
                    from: l,
                    error: error.clone(),
                });
            }
        }
        r.routes.push(Route {
            id,
            tx,
            local: local.clone(),
        });
        drop(r);
        let group_id = id.encode(&prefix);
        let outboxes = members
            .iter()
            .map(|&m| {
                self.writers[m].as_ref().map(|tx| OpOutbox {
                    tx: tx.clone(),
                    id: group_id.clone(),
                })
            })
            .collect();
        OpenOp {
            inbound,
            outboxes,
            router: self.router.clone(),
            id,
        }
    }

    /// The source of the oldest message waiting for us that its sender sent next in order
    /// (original index), if any.
    pub(crate) fn pending_message(&self) -> Option<usize> {
        let r = lock(&self.router);
        let dst = u16::try_from(r.me).ok()?;
        (0..r.next_message.len())
            .filter_map(|src| {
                let id = OpId::Message {
                    src: u16::try_from(src).ok()?,
                    dst,
                    seq: r.next_message[src],
                };
                Some((r.early.current.get(&id)?.front()?.arrival, src))
            })
            .min()
            .map(|(_, src)| src)
    }

    /// Notified whenever a frame arrives early (e.g. a message nobody receives yet).
    pub(crate) fn arrivals(&self) -> Arc<Notify> {
        self.arrivals.clone()
    }

    /// Switches to a new membership's prefix: frames under the old one are dropped from now
    /// on (messages not received by then too), and collectives and messages are numbered
    /// from 0 again.
    pub(crate) fn set_prefix(&self, prefix: Bytes) {
        lock(&self.router).change_prefix(prefix);
    }

    /// Closes every link: writers flush what they hold (each within the close timeout), then
    /// readers stop.
    pub(crate) async fn close(mut self) {
        self.writers.clear();
        let close_timeout = self.cfg.close_timeout;
        let writers = async { while self.writer_tasks.join_next().await.is_some() {} };
        let _ = tokio::time::timeout(close_timeout * 2, writers).await;
        self.writer_tasks.shutdown().await;
        self.reader_tasks.shutdown().await;
    }
}

/// Marks `peer`'s link failed and tells every open operation.
async fn fail(router: &Mutex<Router>, peer: usize, error: LinkError) {
    let targets: Vec<(mpsc::Sender<Inbound>, usize)> = {
        let mut r = lock(router);
        if r.failed[peer].is_some() {
            return;
        }
        tracing::info!(peer, %error, "group link failed");
        r.failed[peer] = Some(error.clone());
        r.routes
            .iter()
            .filter_map(|route| Some((route.tx.clone(), route.local.get(peer).copied().flatten()?)))
            .collect()
    };
    for (tx, from) in targets {
        let _ = tx
            .send(Inbound::Failed {
                from,
                error: error.clone(),
            })
            .await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn read_loop(
    peer: usize,
    lane: Option<String>,
    mut read: impl AsyncRead + Unpin,
    router: Arc<Mutex<Router>>,
    arrivals: Arc<Notify>,
    max_frame_bytes: usize,
    budget: Arc<Semaphore>,
    pool: BufferPool,
) {
    let decoder = FrameDecoder::new(max_frame_bytes);
    let mut staging = BytesMut::with_capacity(64 << 10);
    let mut head_at = None;
    let error = loop {
        let timed = lane.as_ref().map(|_| &mut head_at);
        let body = match crate::runner::next_frame(&decoder, &mut read, &mut staging, &pool, timed)
            .await
        {
            Ok(body) => body,
            Err(e) => break e,
        };
        let cost = u32::try_from(body.len() + FRAME_OVERHEAD).unwrap_or(u32::MAX);
        let Ok(queued) = budget.clone().acquire_many_owned(cost).await else {
            return;
        };
        let mut frame = match wire::decode_frame(body) {
            Ok(frame) => frame,
            Err(e) => break LinkError::Wire(e),
        };
        if let (Some(lane), Some(started)) = (&lane, head_at.take()) {
            let what = crate::runner::describe(&frame.message);
            let bytes = frame.message.payload_len();
            crate::timeline::span(
                "receive",
                || lane.clone(),
                || format!("receive {what}"),
                started,
                || vec![("payload_bytes", bytes.to_string())],
            );
        }
        if let Message::Averaged(m) = &mut frame.message
            && m.codec == CompressionType::None
            && m.dtype == DType::F32
        {
            // Checked here, while the bytes are in this core's cache (as the round runner
            // does), not by the compute thread.
            m.finite = Some(ops::all_finite_le(&m.payload));
        }
        let routed = lock(&router).route(peer, frame, QueuedBytes(queued));
        match routed {
            Ok(Routed::Deliver(tx, inbound)) => {
                // A closed operation drops it.
                let _ = tx.send(inbound).await;
            }
            Ok(Routed::Kept) => arrivals.notify_waiters(),
            Ok(Routed::Dropped) => {}
            Err(e) => break e,
        }
    };
    fail(&router, peer, error).await;
}

async fn write_loop(
    peer: usize,
    lane: Option<String>,
    mut write: impl AsyncWrite + Unpin,
    mut rx: mpsc::Receiver<Frame>,
    router: Arc<Mutex<Router>>,
    write_timeout: Duration,
    close_timeout: Duration,
) {
    let mut head = BytesMut::new();
    while let Some(frame) = rx.recv().await {
        if rx.len() + 1 >= rx.max_capacity() {
            // The compute loop may be waiting for room on this link: wake the open operations.
            let routes: Vec<mpsc::Sender<Inbound>> =
                lock(&router).routes.iter().map(|r| r.tx.clone()).collect();
            for tx in routes {
                let _ = tx.try_send(Inbound::Writable);
            }
        }
        let idle = rx.is_empty();
        let started = std::time::Instant::now();
        let error = crate::runner::write_frame(&mut write, &mut head, &frame, idle, write_timeout)
            .await
            .err();
        if let (Some(lane), None) = (&lane, &error) {
            let what = crate::runner::describe(&frame.message);
            let bytes = frame.message.payload_len();
            crate::timeline::span(
                "send",
                || lane.clone(),
                || format!("send {what}"),
                started,
                || vec![("payload_bytes", bytes.to_string())],
            );
        }
        if let Some(error) = error {
            fail(&router, peer, error).await;
            return;
        }
    }
    let _ = tokio::time::timeout(close_timeout, async {
        let _ = write.flush().await;
        let _ = write.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(me: usize, n: usize, prefix: &[u8]) -> Router {
        Router {
            me,
            prefix: Bytes::copy_from_slice(prefix),
            old_prefixes: Vec::new(),
            routes: Vec::new(),
            early: Held::default(),
            next_collective: 0,
            next_message: vec![0; n],
            failed: vec![None; n],
        }
    }

    fn frame(prefix: &[u8], id: OpId) -> Frame {
        Frame {
            group_id: id.encode(prefix),
            message: Message::Abort {
                role: crate::allreduce::Role::Sender,
                reason: crate::allreduce::AbortReason::Cancelled,
            },
        }
    }

    fn permit() -> QueuedBytes {
        QueuedBytes(
            Arc::new(Semaphore::new(1))
                .try_acquire_owned()
                .expect("a free permit"),
        )
    }

    /// A member that finished a membership change first sends under the next prefix: its
    /// frames are held (not a link failure) and used once we change too; frames of a prefix we
    /// never take are dropped then, and frames of a prefix we left are dropped at once.
    #[test]
    fn frames_under_the_next_prefix_wait_for_the_change() {
        let (a, b, c) = (
            [1u8; PREFIX_BYTES],
            [2u8; PREFIX_BYTES],
            [3u8; PREFIX_BYTES],
        );
        let mut r = router(0, 3, &a);
        for (prefix, from) in [(&b, 1), (&c, 2)] {
            let routed = r.route(from, frame(prefix, OpId::Collective(0)), permit());
            assert!(matches!(routed, Ok(Routed::Kept)));
        }
        // A forged message under an unknown prefix still fails its link.
        let forged = OpId::Message {
            src: 2,
            dst: 0,
            seq: 0,
        };
        assert!(matches!(
            r.route(1, frame(&b, forged), permit()),
            Err(LinkError::ForeignGroup)
        ));
        // The change to `b`: its frame stays, `c`'s goes.
        r.change_prefix(Bytes::copy_from_slice(&b));
        assert_eq!(r.early.len(), 1);
        assert_eq!(r.early.current[&OpId::Collective(0)][0].from, 1);
        assert!(matches!(
            r.route(1, frame(&a, OpId::Collective(5)), permit()),
            Ok(Routed::Dropped)
        ));
    }

    /// A tiny part (payload of `payload` bytes) of operation `id`.
    fn part(prefix: &[u8], id: OpId, payload: usize) -> Frame {
        Frame {
            group_id: id.encode(prefix),
            message: Message::Part(crate::allreduce::PartMessage {
                part: 0,
                weight: 1.0,
                codec: CompressionType::None,
                dtype: DType::F32,
                payload: Bytes::from(vec![7u8; payload]),
            }),
        }
    }

    /// A reader's staging buffer that counts itself while alive.
    struct Staging(Vec<u8>, Arc<std::sync::atomic::AtomicUsize>);

    impl AsRef<[u8]> for Staging {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Drop for Staging {
        fn drop(&mut self) {
            self.1.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Issue 29, attack 1: a member alternates tiny frames that are always held (a collective
    /// that never opens) with ~60 KiB frames that are always dropped (under a prefix we left),
    /// so each 64 KiB staging buffer of the reader carries one held frame. Frames are sliced
    /// out of the buffer as the reader does; once the reader has moved on, no held frame may
    /// keep its buffer alive (before: every held frame pinned one, ~64 KiB per ~40 bytes of
    /// budget), and what is held is exactly the held frames' bytes.
    #[test]
    fn held_frames_keep_no_reader_buffer_alive() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (left, current) = ([1u8; PREFIX_BYTES], [2u8; PREFIX_BYTES]);
        let mut r = router(0, 2, &left);
        r.change_prefix(Bytes::copy_from_slice(&current));
        let live = Arc::new(AtomicUsize::new(0));
        let decoder = FrameDecoder::new(1 << 20);
        for _ in 0..64 {
            let mut bytes = BytesMut::new();
            wire::encode_frame(&part(&current, OpId::Collective(u64::MAX), 8), &mut bytes);
            wire::encode_frame(&part(&left, OpId::Collective(0), 60 << 10), &mut bytes);
            let mut buffer = bytes.to_vec();
            buffer.resize(64 << 10, 0);
            live.fetch_add(1, Ordering::Relaxed);
            let staging = Bytes::from_owner(Staging(buffer, live.clone()));
            let mut at = 0;
            for kept in [true, false] {
                let (head, len) = decoder.peek_len(&staging[at..]).unwrap().unwrap();
                let body = staging.slice(at + head..at + head + len);
                at += head + len;
                let frame = wire::decode_frame(body).unwrap();
                let routed = r.route(1, frame, permit()).unwrap();
                assert_eq!(matches!(routed, Routed::Kept), kept);
            }
        }
        assert_eq!(r.early.len(), 64);
        assert_eq!(
            live.load(Ordering::Relaxed),
            0,
            "held frames keep the reader's buffers alive"
        );
        // The held frames are still whole.
        let held = &r.early.current[&OpId::Collective(u64::MAX)];
        assert!(held.iter().all(|e| e.message.payload_len() == 8));
    }

    /// The count of held frames is bounded by the link's budget: a member sending nothing but
    /// tiny held frames gets its link read until the budget is spent (each frame charged its
    /// bytes and [`FRAME_OVERHEAD`]), then no further (before: charged its bytes alone, ~40 per
    /// frame, so a 64 KiB budget held over 1,000 of them, each with its bookkeeping).
    #[tokio::test]
    async fn a_links_budget_bounds_the_count_of_held_frames() {
        let cfg = GroupConfig {
            max_frame_bytes: 64 << 10,
            max_queued_bytes_per_link: 64 << 10,
            ..GroupConfig::default()
        };
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let prefix = [3u8; PREFIX_BYTES];
        let mesh = Mesh::start(
            vec![None, Some(Box::new(ours))],
            0,
            Bytes::copy_from_slice(&prefix),
            &cfg,
            &BufferPool::new(1 << 20),
            vec![None, None],
        );
        let mut bytes = BytesMut::new();
        for seq in 0..4000 {
            wire::encode_frame(&part(&prefix, OpId::Collective(seq + 1), 1), &mut bytes);
        }
        let body = bytes.len() / 4000;
        theirs.write_all(&bytes).await.unwrap();
        let budget = mesh.budgets[1].clone().unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        // Wait until the reader cannot take another frame.
        while budget.available_permits() >= body + FRAME_OVERHEAD {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the reader never spent its budget ({} held)",
                lock(&mesh.router).early.len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let total = cfg
            .max_queued_bytes_per_link
            .max(cfg.max_frame_bytes + FRAME_OVERHEAD);
        let held = lock(&mesh.router).early.len();
        assert!(
            held <= total / FRAME_OVERHEAD,
            "{held} frames held in a budget of {total} bytes"
        );
        mesh.close().await;
    }

    #[test]
    fn op_ids_round_trip() {
        let prefix = [7u8; PREFIX_BYTES];
        for id in [
            OpId::Collective(0),
            OpId::Collective(u64::MAX),
            OpId::Message {
                src: 3,
                dst: 1,
                seq: 9,
            },
        ] {
            let g = id.encode(&prefix);
            assert!(g.len() <= wire::MAX_GROUP_ID_BYTES);
            assert_eq!(&g[..PREFIX_BYTES], &prefix[..]);
            assert_eq!(OpId::decode(&g[PREFIX_BYTES..]), Some(id));
        }
        assert_eq!(OpId::decode(b"c123"), None);
        assert_eq!(OpId::decode(b"x"), None);
        assert_eq!(OpId::decode(b""), None);
    }
}
