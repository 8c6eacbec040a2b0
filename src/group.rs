//! Groups that last: collectives over one matched group, with its links kept across
//! operations.
//!
//! # Forming a group
//!
//! [`crate::Averager::form_group`] finds a group through the same DHT matchmaking as a step
//! (the averager's prefix, group size and keys: several averagers with different prefixes on
//! one node are several independent groups, Horovod's process sets, sharing the node's swarm
//! and link hub) and links every member to every other (TLS data links, or libp2p streams
//! where those cannot be made). The [`Group`] then keeps the ordered membership and the links
//! until it is closed or dropped: no matchmaking and no linking per operation.
//!
//! # Operations
//!
//! Every operation runs on every current member, in the same order on each (like
//! torch.distributed), except `send`/`recv`, which involve two members:
//!
//! * [`Group::all_reduce`] with a [`ReduceOp`]: the butterfly ([`crate::allreduce`]) over the
//!   group's links, with the group's compression, sender/reducer timeouts and part size;
//! * [`Group::all_gather`], [`Group::reduce_scatter`], [`Group::barrier`], [`Group::send`],
//!   [`Group::recv`], [`Group::recv_any`]: direct exchanges (`exchange`): each flow is cut
//!   into parts, encoded with the group's codec, streamed under backpressure and checked part
//!   by part on arrival;
//! * [`Group::broadcast`]: a pipelined chain from the root (`chain`), whose members forward
//!   each part as they decode it, cut and checked the same way.
//!
//! Codec and reduction work runs on a blocking compute thread, never on the link tasks (the
//! same compute loop as a round, [`crate::runner`]). Frames of an operation carry its id (see
//! `mesh`): a member that runs ahead has its frames held for the operation, within its
//! link's byte budget.
//!
//! # Failures
//!
//! A member that dies, stalls past `sender_timeout` (or `reducer_timeout` as an all-reduce
//! reducer), or sends a bad part ends the operation for the others with
//! [`GroupError::Failed`], which names every failed member and carries what was completed
//! ([`Partial`]). The group does not change by itself: the caller decides, and every
//! survivor calls [`Group::shrink`], which exchanges each survivor's list of the members it
//! saw fail (not those it only heard of) and removes those named by two survivors, or by
//! every other survivor where fewer than two remain (and anyone who does not answer): one
//! lying member cannot expel the others. Later operations run over the
//! smaller membership, under a new operation-id prefix, so frames of the old membership are
//! dropped. Shrinking is not consensus: survivors that saw different failures during the
//! shrink itself end up with different memberships, their next operation fails by timeouts,
//! and another shrink settles it.
//!
//! # Admission
//!
//! New members join at an operation boundary: every member calls [`Group::admit`], the
//! newcomer [`crate::Averager::join_group`] (the protocol is in `admit`'s module docs: an
//! invitation in the DHT, an RPC to the leader, the new membership broadcast over the group,
//! links to the newcomers only).

mod admit;
mod chain;
mod exchange;
mod invitation;
mod mesh;
mod ops;

pub(crate) use admit::join;
pub use admit::{Authorizer, Formation};

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use libp2p::PeerId;
use sha2::Digest;
use tokio::sync::{oneshot, watch};

use crate::allreduce::{Aggregator, RoundReport};
use crate::buffers::BufferPool;
use crate::compression::Compression;
use crate::links::LinkKind;
use crate::runner::{Link, Machine, RunnerError};
use crate::tensor::Tensor;

use exchange::{Exchange, ExchangeConfig, Plan, Received};
use mesh::{Mesh, OpId, OpenOp, PREFIX_BYTES};

/// How an all-reduce or reduce-scatter combines the members' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean (every member weighs the same).
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl ReduceOp {
    fn aggregator(self) -> Aggregator {
        match self {
            Self::Sum => Aggregator::Sum,
            Self::Mean => Aggregator::Mean,
            Self::Max => Aggregator::Max,
            Self::Min => Aggregator::Min,
        }
    }

    fn fold(self, acc: &mut [f32], x: &[f32]) {
        match self {
            Self::Sum | Self::Mean => acc.iter_mut().zip(x).for_each(|(a, b)| *a += b),
            Self::Max => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.max(*b)),
            Self::Min => acc.iter_mut().zip(x).for_each(|(a, b)| *a = a.min(*b)),
        }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sum" => Ok(Self::Sum),
            "mean" => Ok(Self::Mean),
            "max" => Ok(Self::Max),
            "min" => Ok(Self::Min),
            other => Err(format!(
                "unknown reduce op '{other}' (sum, mean, max or min)"
            )),
        }
    }
}

/// Parameters of a group's operations.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// Longest wait for a member's next part.
    pub sender_timeout: Duration,
    /// All-reduce: longest wait for a reducer's next reply (larger than `sender_timeout`).
    pub reducer_timeout: Duration,
    /// Bound on one whole operation (and on `recv_any`'s wait).
    pub op_timeout: Duration,
    /// Target encoded part size.
    pub part_size_bytes: usize,
    /// Codec for tensor data (barriers and shrinks always go uncompressed).
    pub compression: Compression,
    /// Largest frame accepted from a member.
    pub max_frame_bytes: usize,
    /// Bound on one frame write.
    pub write_timeout: Duration,
    /// Frames queued per link.
    pub link_queue: usize,
    /// Messages queued to an operation's compute thread.
    pub inbound_queue: usize,
    /// Bytes read from one link and not yet used (by an operation, or held for one that has
    /// not started here) at most.
    pub max_queued_bytes_per_link: usize,
    /// Bound on flushing and closing each link when the group closes.
    pub close_timeout: Duration,
}

impl Default for GroupConfig {
    fn default() -> Self {
        let runner = crate::runner::RunnerConfig::default();
        Self {
            sender_timeout: crate::allreduce::DEFAULT_SENDER_TIMEOUT,
            reducer_timeout: crate::allreduce::DEFAULT_REDUCER_TIMEOUT,
            op_timeout: Duration::from_secs(120),
            part_size_bytes: crate::allreduce::DEFAULT_PART_SIZE_BYTES,
            compression: Compression::default(),
            max_frame_bytes: runner.max_frame_bytes,
            write_timeout: runner.write_timeout,
            link_queue: runner.link_queue,
            inbound_queue: runner.inbound_queue,
            max_queued_bytes_per_link: runner.max_queued_bytes_per_link,
            close_timeout: runner.close_timeout,
        }
    }
}

/// A member an operation gave up on.
#[derive(Clone, Debug, PartialEq)]
pub struct FailedMember {
    /// Its index in the group when the operation ran.
    pub index: usize,
    /// Its peer id.
    pub peer: PeerId,
    /// Why (timeout, link failure, bad part, abort).
    pub reason: String,
}

/// What an operation completed before it failed.
#[derive(Clone, Debug)]
pub enum Partial {
    /// Nothing to report.
    Nothing,
    /// All-reduce: the tensors (parts whose reducer failed keep this member's values) and,
    /// part by part, whose values each part combines.
    AllReduce {
        /// The result as far as it got.
        tensors: Vec<Tensor>,
        /// Contributors per part.
        report: RoundReport,
    },
    /// All-gather, recv: per member, its tensors if they arrived complete.
    Gathered(Vec<Option<Vec<Tensor>>>),
    /// Reduce-scatter: the reduction over the members in `contributors` only.
    Reduced {
        /// The partial reduction.
        tensor: Tensor,
        /// Member indices whose values it combines.
        contributors: Vec<usize>,
    },
    /// Barrier: the members that arrived.
    Arrived(Vec<usize>),
}

/// Why a group operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GroupError {
    /// Members failed during the operation; `partial` holds what completed.
    #[error("{op}: {} failed ({})", plural(failed.len()), describe(failed))]
    Failed {
        /// The operation.
        op: &'static str,
        /// Who failed and why.
        failed: Vec<FailedMember>,
        /// What completed.
        partial: Box<Partial>,
    },
    /// The arguments do not fit the group (sizes, member indices, shapes).
    #[error("{op}: {detail}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// `recv_any` found no message within `op_timeout`.
    #[error("recv_any: no message within {0:?}")]
    Timeout(Duration),
    /// The other members removed this one (see [`Group::shrink`]).
    #[error("this member was removed from the group")]
    Expelled,
    /// The operation could not run (its compute thread failed, or it was abandoned).
    #[error("{op}: {detail}")]
    Internal {
        /// The operation.
        op: &'static str,
        /// What happened.
        detail: String,
    },
}

fn plural(n: usize) -> String {
    if n == 1 {
        "1 member".into()
    } else {
        format!("{n} members")
    }
}

fn describe(failed: &[FailedMember]) -> String {
    failed
        .iter()
        .map(|f| format!("member {} {}: {}", f.index, f.peer, f.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A formed group and its links (see the [module docs](self)).
pub struct Group {
    base: [u8; 16],
    peers: Vec<PeerId>,
    kinds: Vec<Option<LinkKind>>,
    /// Original indices of the current members, in order.
    live: Vec<usize>,
    /// Our original index.
    me: usize,
    mesh: Option<Mesh>,
    cfg: GroupConfig,
    seq: u64,
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
    /// Members (original indices) that failed an operation since the last shrink.
    suspects: BTreeSet<usize>,
    pool: BufferPool,
    /// What `pool` retains at most.
    pool_bytes: usize,
    /// What matchmaking said about the group ([`Group::admit`] needs it).
    formation: Option<Formation>,
    /// Who may join while this member leads ([`Group::with_authorizer`]).
    authorizer: Option<Authorizer>,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("size", &self.live.len())
            .field("me", &self.me())
            .finish_non_exhaustive()
    }
}

fn prefix(base: &[u8; 16], peers: &[PeerId], live: &[usize]) -> Bytes {
    let mut h = sha2::Sha256::new();
    for &m in live {
        h.update(peers[m].to_bytes());
    }
    let digest = h.finalize();
    let mut p = Vec::with_capacity(PREFIX_BYTES);
    p.extend_from_slice(base);
    p.extend_from_slice(&digest[..PREFIX_BYTES - 16]);
    Bytes::from(p)
}

impl Group {
    /// A group over established links: `links[i]` to member `i` (`None` for `me`; `None`
    /// for another member means no link, and every operation fails that member).
    pub fn new(
        group_id: &[u8],
        peers: Vec<PeerId>,
        me: usize,
        links: Vec<Option<Box<dyn Link>>>,
        kinds: Vec<Option<LinkKind>>,
        cfg: GroupConfig,
    ) -> Result<Self, GroupError> {
        let n = peers.len();
        if me >= n || links.len() != n || kinds.len() != n || n > usize::from(u16::MAX) {
            return Err(GroupError::Invalid {
                op: "group",
                detail: format!(
                    "member {me} of {n} with {} links and {} kinds",
                    links.len(),
                    kinds.len()
                ),
            });
        }
        let digest = sha2::Sha256::digest(group_id);
        let mut base = [0u8; 16];
        base.copy_from_slice(&digest[..16]);
        let live: Vec<usize> = (0..n).collect();
        let pool = BufferPool::default();
        let lanes = (0..n).map(|i| lane(&peers, me, i)).collect();
        let mesh = Mesh::start(links, me, prefix(&base, &peers, &live), &cfg, &pool, lanes);
        Ok(Self {
            base,
            peers,
            kinds,
            live,
            me,
            mesh: Some(mesh),
            cfg,
            seq: 0,
            send_seq: vec![0; n],
            recv_seq: vec![0; n],
            suspects: BTreeSet::new(),
            pool,
            pool_bytes: crate::buffers::DEFAULT_RETAIN_BYTES,
            formation: None,
            authorizer: None,
        })
    }

    /// Number of current members.
    pub fn size(&self) -> usize {
        self.live.len()
    }

    /// Our index among the current members.
    pub fn me(&self) -> usize {
        self.local(self.me).unwrap_or(usize::MAX)
    }

    /// The current members' peer ids, in the group's order.
    pub fn members(&self) -> Vec<PeerId> {
        self.live.iter().map(|&m| self.peers[m]).collect()
    }

    /// How we are linked to each current member (`None` for ourselves and for members we
    /// have no link to).
    pub fn links(&self) -> Vec<Option<LinkKind>> {
        self.live.iter().map(|&m| self.kinds[m]).collect()
    }

    /// The group's parameters.
    pub fn config(&self) -> &GroupConfig {
        &self.cfg
    }

    fn local(&self, original: usize) -> Option<usize> {
        self.live.iter().position(|&m| m == original)
    }

    fn mesh(&self) -> &Mesh {
        self.mesh.as_ref().expect("the mesh lives until close")
    }

    /// Makes the pool retain enough for operations on `bytes` of tensors (encoded parts,
    /// received frames and reductions of one operation), so that the next one reuses them.
    fn size_pool(&mut self, bytes: usize) {
        let want = 2 * bytes + crate::buffers::DEFAULT_RETAIN_BYTES;
        if want > self.pool_bytes {
            self.pool = BufferPool::new(want);
            self.pool_bytes = want;
        }
    }

    fn next_collective(&mut self) -> OpId {
        let id = OpId::Collective(self.seq);
        self.seq += 1;
        id
    }

    fn check_member(&self, op: &'static str, index: usize) -> Result<usize, GroupError> {
        self.live.get(index).copied().ok_or(GroupError::Invalid {
            op,
            detail: format!("member {index} of a group of {}", self.live.len()),
        })
    }

    /// Runs `machine` for operation `id` over `members` (original indices) on a compute
    /// thread; returns it and the members it failed (original indices).
    async fn drive<M: Machine + Send + 'static>(
        &mut self,
        op: &'static str,
        id: OpId,
        members: &[usize],
        machine: M,
    ) -> Result<(M, Vec<FailedMember>), GroupError> {
        let started = std::time::Instant::now();
        let open: OpenOp = self.mesh().open(id, members);
        let lanes = self.mesh().lanes_of(members);
        let (_abandon_guard, mut abandoned) = oneshot::channel::<()>();
        let (_keep, mut cancel) = watch::channel(false);
        let handle = tokio::runtime::Handle::current();
        let joined = tokio::task::spawn_blocking(move || {
            let mut open = open;
            let mut machine = machine;
            let result = crate::runner::drive(
                &handle,
                &mut machine,
                &mut open.outboxes,
                &mut open.inbound,
                &mut cancel,
                &mut abandoned,
                lanes.as_deref(),
            );
            drop(open);
            result.map(|failures| (machine, failures))
        })
        .await
        .map_err(|e| GroupError::Internal {
            op,
            detail: e.to_string(),
        })?;
        let (machine, failures) = joined.map_err(|e: RunnerError| GroupError::Internal {
            op,
            detail: e.to_string(),
        })?;
        let mut failed: Vec<FailedMember> = Vec::new();
        for crate::runner::Failure {
            peer: local,
            reason,
            hearsay,
        } in failures
        {
            let original = members[local];
            // What another member only reports is no suspicion of ours: a shrink weighs each
            // member's own (`ops::removed_by_shrink`), and a liar's notice repeated by those
            // who heard it would count as several witnesses.
            if !hearsay {
                self.suspects.insert(original);
            }
            if let Some(f) = failed.iter_mut().find(|f| f.peer == self.peers[original]) {
                f.reason = format!("{}; {reason}", f.reason);
            } else {
                failed.push(FailedMember {
                    index: self.local(original).unwrap_or(local),
                    peer: self.peers[original],
                    reason,
                });
            }
        }
        crate::timeline::span(
            "group",
            || {
                format!(
                    "node {} group",
                    crate::averager::short_id(&self.peers[self.me])
                )
            },
            || op.to_owned(),
            started,
            || vec![("members", members.len().to_string())],
        );
        Ok((machine, failed))
    }

    fn exchange_config(
        &self,
        members: usize,
        me: usize,
        compression: Compression,
    ) -> ExchangeConfig {
        ExchangeConfig {
            members,
            me,
            part_size_bytes: self.cfg.part_size_bytes,
            compression,
            sender_timeout: self.cfg.sender_timeout,
            op_timeout: Some(self.cfg.op_timeout),
        }
    }

    async fn exchange(
        &mut self,
        op: &'static str,
        id: OpId,
        members: Vec<usize>,
        plan: Plan,
        compression: Compression,
    ) -> Result<(Received, Vec<FailedMember>), GroupError> {
        let me = members
            .iter()
            .position(|&m| m == self.me)
            .ok_or(GroupError::Expelled)?;
        let cfg = self.exchange_config(members.len(), me, compression);
        let machine = Exchange::new(cfg, plan, Instant::now(), self.pool.clone()).map_err(|e| {
            GroupError::Invalid {
                op,
                detail: e.to_string(),
            }
        })?;
        let (machine, failed) = self.drive(op, id, &members, machine).await?;
        let received = machine.into_received().map_err(|e| GroupError::Internal {
            op,
            detail: e.to_string(),
        })?;
        Ok((received, failed))
    }

    /// After a membership change: the new membership's prefix, collectives and messages
    /// counted from 0 (messages not received by then are dropped), no suspects.
    fn renumber(&mut self) {
        self.suspects.clear();
        self.seq = 0;
        self.send_seq.iter_mut().for_each(|n| *n = 0);
        self.recv_seq.iter_mut().for_each(|n| *n = 0);
        let prefix = prefix(&self.base, &self.peers, &self.live);
        self.mesh().set_prefix(prefix);
    }

    /// Closes the links (flushing what is queued) and ends the group.
    pub async fn close(mut self) {
        if let Some(mesh) = self.mesh.take() {
            mesh.close().await;
        }
    }
}

/// The timeline lane of our link to member `i` (when the timeline is on).
fn lane(peers: &[PeerId], me: usize, i: usize) -> Option<String> {
    (crate::timeline::enabled() && i != me).then(|| {
        format!(
            "node {} ↔ group member {} {}",
            crate::averager::short_id(&peers[me]),
            i,
            crate::averager::short_id(&peers[i])
        )
    })
}

impl Drop for Group {
    fn drop(&mut self) {
        // The mesh's tasks are aborted with their JoinSets; nothing else to do.
        let _ = self.mesh.take();
    }
}
