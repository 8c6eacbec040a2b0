//! The order of a device tensor's staging operations, as data: what [`super::Staging`]
//! enqueues on which stream, and which events order it. Pure, so the ordering is tested
//! without a GPU: `tests` below runs every plan through a happens-before model of CUDA
//! streams and events and checks that no two accesses to one buffer, one of them a write, are
//! unordered, with the training loop's own kernels between any two operations.
//!
//! The rules the plans follow (see the `cuda` module docs for the protocol):
//! * The snapshot is one operation *on the training stream* (a device copy or cast), so it is
//!   one point in the training loop's order; the event after it ([`Mark::Copied`]) is what
//!   the PCIe stream's copy to the host waits for. Before it, the training stream waits for
//!   any earlier transfer of the device buffer still in flight (an abandoned round's).
//! * An upload waits (on the PCIe stream) for the previous apply kernel, which reads the
//!   device buffer it overwrites; and (on the host) for the previous upload, which reads the
//!   pinned deltas it rewrites.
//! * The apply kernel is enqueued once the host saw the upload complete: the training stream
//!   never waits for PCIe transfers of deltas.
//! * Buffers are freed only after every event that still orders work on them.

/// Where an operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Lane {
    /// The tensor's training stream.
    Training,
    /// The device's PCIe stream (transfers to and from pinned memory).
    Pcie,
    /// The calling host thread (a wait here blocks it).
    Host,
}

/// The events a staging keeps, one of each, re-recorded every round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Mark {
    /// After the snapshot's device copy, on the training stream.
    Copied,
    /// After the snapshot's copy to the host, on the PCIe stream.
    Snapped,
    /// After the deltas' upload, on the PCIe stream.
    Uploaded,
    /// After the apply kernel, on the training stream.
    Applied,
}

/// Every mark, in the order a retirement waits for them.
pub(crate) const MARKS: [Mark; 4] = [Mark::Copied, Mark::Snapped, Mark::Uploaded, Mark::Applied];

/// One step of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// `Lane` waits for the mark's last recording (a stream: on the device; the host: blocks).
    Wait(Lane, Mark),
    /// Records the mark on a stream.
    Record(Lane, Mark),
    /// Training stream: the tensor copied (or cast) into the device buffer.
    SnapshotCopy,
    /// PCIe stream: the device buffer into pinned snapshot buffer `n`.
    Download(usize),
    /// Host: the deltas from pinned snapshot `n` (the round's start) into the pinned deltas.
    FillDeltas(usize),
    /// PCIe stream: the pinned deltas into the device buffer.
    Upload,
    /// Training stream: `tensor += alpha · deltas` from the device buffer.
    Apply,
}

/// Which marks have a recording whose completion nobody has seen yet (a wait on them may be
/// needed). A host wait clears its mark: the work before it is complete.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Pending {
    copied: bool,
    snapped: bool,
    uploaded: bool,
    applied: bool,
}

impl Pending {
    fn slot(&mut self, m: Mark) -> &mut bool {
        match m {
            Mark::Copied => &mut self.copied,
            Mark::Snapped => &mut self.snapped,
            Mark::Uploaded => &mut self.uploaded,
            Mark::Applied => &mut self.applied,
        }
    }

    /// Whether `m` has a recording not yet seen complete.
    pub(crate) fn is_pending(&self, m: Mark) -> bool {
        match m {
            Mark::Copied => self.copied,
            Mark::Snapped => self.snapped,
            Mark::Uploaded => self.uploaded,
            Mark::Applied => self.applied,
        }
    }

    /// What executing `op` changes.
    fn after(&mut self, op: Op) {
        match op {
            Op::Record(_, m) => *self.slot(m) = true,
            Op::Wait(Lane::Host, m) => *self.slot(m) = false,
            _ => {}
        }
    }
}

/// A plan builder: `op` appends, tracking what is pending.
struct Builder<'a> {
    pending: &'a mut Pending,
    ops: Vec<Op>,
}

impl Builder<'_> {
    fn op(&mut self, op: Op) {
        self.pending.after(op);
        self.ops.push(op);
    }

    /// `lane` waits for `m` if it is pending.
    fn wait(&mut self, lane: Lane, m: Mark) {
        if self.pending.is_pending(m) {
            self.op(Op::Wait(lane, m));
        }
    }
}

fn build(pending: &mut Pending, f: impl FnOnce(&mut Builder<'_>)) -> Vec<Op> {
    let mut b = Builder {
        pending,
        ops: Vec::new(),
    };
    f(&mut b);
    b.ops
}

/// Starting a snapshot into pinned buffer `host` (`copy`: whether there is anything to copy,
/// i.e. the tensor is not empty).
pub(crate) fn snapshot(pending: &mut Pending, host: usize, copy: bool) -> Vec<Op> {
    build(pending, |b| {
        // The device buffer may still be read by an abandoned round's copy to the host, or
        // written by its upload. (The last apply kernel is on this very stream.)
        b.wait(Lane::Training, Mark::Snapped);
        b.wait(Lane::Training, Mark::Uploaded);
        if copy {
            b.op(Op::SnapshotCopy);
        }
        b.op(Op::Record(Lane::Training, Mark::Copied));
        b.op(Op::Wait(Lane::Pcie, Mark::Copied));
        if copy {
            b.op(Op::Download(host));
        }
        b.op(Op::Record(Lane::Pcie, Mark::Snapped));
    })
}

/// Waiting for the snapshot's copy to the host.
pub(crate) fn wait_snapshot(pending: &mut Pending) -> Vec<Op> {
    build(pending, |b| b.wait(Lane::Host, Mark::Snapped))
}

/// Computing the deltas from pinned snapshot `host` and uploading them.
pub(crate) fn upload(pending: &mut Pending, host: usize) -> Vec<Op> {
    build(pending, |b| {
        // The deltas are computed from the complete snapshot, into pinned memory the previous
        // upload no longer reads.
        b.wait(Lane::Host, Mark::Snapped);
        b.wait(Lane::Host, Mark::Uploaded);
        b.op(Op::FillDeltas(host));
        // The previous apply kernel reads the device buffer this overwrites.
        b.wait(Lane::Pcie, Mark::Applied);
        b.op(Op::Upload);
        b.op(Op::Record(Lane::Pcie, Mark::Uploaded));
    })
}

/// Enqueueing the apply kernel for the last upload.
pub(crate) fn apply(pending: &mut Pending) -> Vec<Op> {
    build(pending, |b| {
        b.wait(Lane::Host, Mark::Uploaded);
        b.op(Op::Apply);
        b.op(Op::Record(Lane::Training, Mark::Applied));
    })
}

/// What must complete before the buffers are freed: the host waits for every pending mark.
pub(crate) fn retire(pending: &mut Pending) -> Vec<Op> {
    build(pending, |b| {
        for m in MARKS {
            b.wait(Lane::Host, m);
        }
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// What an operation touches.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    enum Buf {
        Tensor,
        Device,
        HostSnapshot(usize),
        HostDelta,
    }

    /// An issued operation: a plan's, the training loop's own kernel, or the free at the end.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Issued {
        Plan(Op),
        /// A training-loop kernel on the training stream that updates the tensor.
        TrainingKernel,
        /// The host frees every buffer.
        Free,
        /// The earlier plans' snapshot copy: on a stream of hivemesh's (modelled as the PCIe
        /// stream), reading the tensor and writing the device buffer.
        OtherStreamSnapshotCopy,
    }

    impl Issued {
        fn lane(self) -> Lane {
            match self {
                Self::Plan(Op::Wait(l, _) | Op::Record(l, _)) => l,
                Self::Plan(Op::SnapshotCopy | Op::Apply) | Self::TrainingKernel => Lane::Training,
                Self::Plan(Op::Download(_) | Op::Upload) | Self::OtherStreamSnapshotCopy => {
                    Lane::Pcie
                }
                Self::Plan(Op::FillDeltas(_)) | Self::Free => Lane::Host,
            }
        }

        /// `(buffer, writes)` accesses.
        fn accesses(self, buffers: &[Buf]) -> Vec<(Buf, bool)> {
            match self {
                Self::Plan(Op::SnapshotCopy) | Self::OtherStreamSnapshotCopy => {
                    vec![(Buf::Tensor, false), (Buf::Device, true)]
                }
                Self::Plan(Op::Download(n)) => {
                    vec![(Buf::Device, false), (Buf::HostSnapshot(n), true)]
                }
                Self::Plan(Op::FillDeltas(n)) => {
                    vec![(Buf::HostSnapshot(n), false), (Buf::HostDelta, true)]
                }
                Self::Plan(Op::Upload) => vec![(Buf::HostDelta, false), (Buf::Device, true)],
                Self::Plan(Op::Apply) => vec![(Buf::Device, false), (Buf::Tensor, true)],
                Self::TrainingKernel => vec![(Buf::Tensor, true)],
                Self::Free => buffers
                    .iter()
                    .filter(|b| **b != Buf::Tensor)
                    .map(|b| (*b, true))
                    .collect(),
                Self::Plan(Op::Wait(..) | Op::Record(..)) => vec![],
            }
        }
    }

    /// The happens-before model: streams run their operations in issue order; a recording
    /// captures everything before it on its stream; a stream wait orders the stream's later
    /// operations after the last recording issued before it; host operations (and host waits)
    /// complete before anything issued after them. Returns the first unordered conflicting
    /// pair of accesses.
    fn first_race(issued: &[Issued]) -> Option<(usize, usize, Buf)> {
        let n = issued.len();
        // before[j] = the operations that happen before j (direct edges).
        let mut edges: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut last_on: HashMap<Lane, usize> = HashMap::new();
        let mut last_record: HashMap<Mark, usize> = HashMap::new();
        let mut host_done: Option<usize> = None;
        for (j, op) in issued.iter().enumerate() {
            let lane = op.lane();
            if let Some(&p) = last_on.get(&lane) {
                edges[j].push(p);
            }
            if let Some(h) = host_done {
                edges[j].push(h);
            }
            match op {
                Issued::Plan(Op::Wait(_, m)) => {
                    let r = *last_record
                        .get(m)
                        .expect("a wait for a mark never recorded");
                    edges[j].push(r);
                }
                Issued::Plan(Op::Record(_, m)) => {
                    last_record.insert(*m, j);
                }
                _ => {}
            }
            if lane == Lane::Host {
                host_done = Some(j);
            }
            last_on.insert(lane, j);
        }
        // Reachability (the lists are short).
        let mut reach: Vec<Vec<bool>> = vec![vec![false; n]; n];
        for j in 0..n {
            for &i in &edges[j].clone() {
                reach[j][i] = true;
                for k in 0..n {
                    if reach[i][k] {
                        reach[j][k] = true;
                    }
                }
            }
        }
        let buffers = [
            Buf::Tensor,
            Buf::Device,
            Buf::HostSnapshot(0),
            Buf::HostSnapshot(1),
            Buf::HostDelta,
        ];
        for j in 0..n {
            for i in 0..j {
                for (bj, wj) in issued[j].accesses(&buffers) {
                    for (bi, wi) in issued[i].accesses(&buffers) {
                        if bi == bj && (wi || wj) && !reach[j][i] {
                            return Some((i, j, bi));
                        }
                    }
                }
            }
        }
        None
    }

    /// A staging's calls, as a user of `Staging` makes them.
    #[derive(Clone, Copy, Debug)]
    enum Call {
        Snapshot(usize),
        WaitSnapshot,
        Upload(usize),
        Apply,
    }

    /// The operations `calls` issue (then the retirement and the free), with a training
    /// kernel before, between and after all of them.
    fn issue(calls: &[Call]) -> Vec<Issued> {
        let mut pending = Pending::default();
        let mut out = vec![Issued::TrainingKernel];
        let push = |ops: Vec<Op>, out: &mut Vec<Issued>| {
            for op in ops {
                out.push(Issued::Plan(op));
                out.push(Issued::TrainingKernel);
            }
        };
        for call in calls {
            let ops = match *call {
                Call::Snapshot(h) => snapshot(&mut pending, h, true),
                Call::WaitSnapshot => wait_snapshot(&mut pending),
                Call::Upload(h) => upload(&mut pending, h),
                Call::Apply => apply(&mut pending),
            };
            push(ops, &mut out);
        }
        push(retire(&mut pending), &mut out);
        out.push(Issued::Free);
        out
    }

    fn assert_ordered(calls: &[Call]) {
        let issued = issue(calls);
        if let Some((i, j, b)) = first_race(&issued) {
            panic!(
                "{calls:?}: {:?} (#{i}) and {:?} (#{j}) race on {b:?}\n{issued:?}",
                issued[i], issued[j]
            );
        }
    }

    use Call::{Apply, Snapshot, Upload, WaitSnapshot};

    #[test]
    fn rounds_are_ordered_against_the_training_loop_and_each_other() {
        // Rounds as an averager runs them, the pinned buffer alternating or not.
        let round = |h| [Snapshot(h), WaitSnapshot, Upload(h), Apply];
        for second in [0, 1] {
            assert_ordered(&[round(0), round(second)].concat());
        }
        // Two applies for one snapshot (a retry): the second upload follows the first kernel.
        assert_ordered(&[&round(0)[..], &[Upload(0), Apply]].concat());
        // Upload without waiting for the snapshot first: the plan waits.
        assert_ordered(&[Snapshot(0), Upload(0), Apply]);
        // Two uploads in a row (the first never applied), then an apply.
        assert_ordered(&[Snapshot(0), WaitSnapshot, Upload(0), Upload(0), Apply]);
        // Abandoned rounds: a snapshot never waited for, an upload never applied, then the
        // next round; and a staging dropped at any point.
        assert_ordered(&[Snapshot(0), Snapshot(1), WaitSnapshot, Upload(1), Apply]);
        assert_ordered(&[
            Snapshot(0),
            WaitSnapshot,
            Upload(0),
            Snapshot(1),
            WaitSnapshot,
        ]);
        let full = [Snapshot(0), WaitSnapshot, Upload(0), Apply, Snapshot(1)];
        for k in 0..=full.len() {
            assert_ordered(&full[..k]);
        }
    }

    /// The model finds the races the review found in the earlier plans, so the checks above
    /// can fail.
    #[test]
    fn the_model_catches_the_earlier_plans_races() {
        // Issue 33 item 3: the snapshot copied on a stream of hivemesh's that waited for an
        // event recorded on the training stream: a training kernel issued between the record
        // and the wait races with the copy on the tensor.
        let race = first_race(&[
            Issued::Plan(Op::Record(Lane::Training, Mark::Copied)),
            Issued::TrainingKernel,
            Issued::Plan(Op::Wait(Lane::Pcie, Mark::Copied)),
            Issued::OtherStreamSnapshotCopy,
        ]);
        assert_eq!(race.map(|r| r.2), Some(Buf::Tensor));
        // The copy on the training stream itself, training kernels before and after it: no race.
        assert_eq!(
            first_race(&[
                Issued::TrainingKernel,
                Issued::Plan(Op::SnapshotCopy),
                Issued::TrainingKernel,
                Issued::Plan(Op::Record(Lane::Training, Mark::Copied)),
                Issued::Plan(Op::Wait(Lane::Pcie, Mark::Copied)),
                Issued::Plan(Op::Download(0)),
            ]),
            None
        );

        // Issue 33 item 4: an upload not ordered after the previous apply kernel races with
        // it on the device buffer.
        let mut pending = Pending::default();
        let mut ops: Vec<Issued> = Vec::new();
        for plan in [
            snapshot(&mut pending, 0, true),
            wait_snapshot(&mut pending),
            upload(&mut pending, 0),
            apply(&mut pending),
        ] {
            ops.extend(plan.into_iter().map(Issued::Plan));
        }
        let mut second = upload(&mut pending, 0);
        assert!(second.contains(&Op::Wait(Lane::Pcie, Mark::Applied)));
        second.retain(|op| *op != Op::Wait(Lane::Pcie, Mark::Applied));
        ops.extend(second.into_iter().map(Issued::Plan));
        let race = first_race(&ops).expect("the unordered upload races");
        assert_eq!(race.2, Buf::Device);
        assert_eq!(ops[race.0], Issued::Plan(Op::Apply));

        // A free not preceded by the retirement's waits races with the transfers.
        let mut pending = Pending::default();
        let mut ops: Vec<Issued> = snapshot(&mut pending, 0, true)
            .into_iter()
            .map(Issued::Plan)
            .collect();
        ops.push(Issued::Free);
        assert!(first_race(&ops).is_some());
    }

    #[test]
    fn waits_appear_only_for_pending_marks_and_host_waits_clear_them() {
        let mut p = Pending::default();
        // A first snapshot waits for nothing of the staging's.
        assert!(
            !snapshot(&mut p, 0, true)
                .iter()
                .any(|op| matches!(op, Op::Wait(Lane::Training, _)))
        );
        assert!(p.is_pending(Mark::Snapped) && p.is_pending(Mark::Copied));
        assert_eq!(wait_snapshot(&mut p), [Op::Wait(Lane::Host, Mark::Snapped)]);
        assert!(!p.is_pending(Mark::Snapped));
        assert_eq!(wait_snapshot(&mut p), []);
        // An empty tensor copies nothing but still records its marks.
        let mut e = Pending::default();
        let ops = snapshot(&mut e, 0, false);
        assert!(!ops.contains(&Op::SnapshotCopy) && !ops.contains(&Op::Download(0)));
        assert!(ops.contains(&Op::Record(Lane::Pcie, Mark::Snapped)));
        // Retirement waits for everything pending, then nothing is.
        let _ = upload(&mut p, 0);
        let _ = apply(&mut p);
        let r = retire(&mut p);
        assert!(r.iter().all(|op| matches!(op, Op::Wait(Lane::Host, _))));
        assert_eq!(p, Pending::default());
    }
}
