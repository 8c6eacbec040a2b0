//! The operations of a [`Group`] (see the [module docs](super)): the butterfly for
//! all-reduce, plans of the exchange machine for the others, and `shrink`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use libp2p::PeerId;

use super::chain::{Chain, ChainConfig};
use super::exchange::{Plan, Received};
use super::mesh::OpId;
use super::{FailedMember, Group, GroupError, Partial, ReduceOp};
use crate::allreduce::{Butterfly, Member, Mode, RoundConfig, RoundError, TensorDescriptor};
use crate::compression::{Compression, CompressionType};
use crate::tensor::{DType, Tensor};

impl Group {
    /// All-reduce `tensors` with `op` over the current members (every member passes tensors
    /// of the same shapes and dtypes); returns the result.
    pub async fn all_reduce(
        &mut self,
        op: ReduceOp,
        tensors: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, GroupError> {
        const OP: &str = "all_reduce";
        let id = self.next_collective();
        let members = self.live.clone();
        let me = self.me();
        let mut cfg = RoundConfig::new(
            vec![
                Member {
                    mode: Mode::Node,
                    fraction: 1.0,
                };
                members.len()
            ],
            me,
        );
        cfg.part_size_bytes = self.cfg.part_size_bytes;
        cfg.compression = self.cfg.compression.clone();
        cfg.sender_timeout = self.cfg.sender_timeout;
        cfg.reducer_timeout = self.cfg.reducer_timeout;
        cfg.round_timeout = Some(self.cfg.op_timeout);
        cfg.aggregator = op.aggregator();
        let invalid = |e: RoundError| GroupError::Invalid {
            op: OP,
            detail: e.to_string(),
        };
        self.size_pool(tensors.iter().map(Tensor::size_bytes).sum());
        let machine = Butterfly::with_pool(cfg, tensors, Instant::now(), self.pool.clone())
            .map_err(invalid)?;
        let (machine, failed) = self.drive(OP, id, &members, machine).await?;
        let (start, outcome) = machine.into_outcome().map_err(|e| GroupError::Internal {
            op: OP,
            detail: e.to_string(),
        })?;
        let mut result = start;
        outcome
            .apply_in_place(&mut result)
            .map_err(|e| GroupError::Internal {
                op: OP,
                detail: e.to_string(),
            })?;
        if failed.is_empty() {
            outcome.recycle(&self.pool);
            return Ok(result);
        }
        Err(GroupError::Failed {
            op: OP,
            failed,
            partial: Box::new(Partial::AllReduce {
                tensors: result,
                report: outcome.report,
            }),
        })
    }

    /// Every member's `tensors` (same shapes and dtypes on every member), in member order.
    pub async fn all_gather(
        &mut self,
        tensors: Vec<Tensor>,
    ) -> Result<Vec<Vec<Tensor>>, GroupError> {
        const OP: &str = "all_gather";
        let id = self.next_collective();
        let members = self.live.clone();
        let n = members.len();
        let me = self.me();
        let descriptors: Arc<[TensorDescriptor]> =
            tensors.iter().map(TensorDescriptor::of).collect();
        let shared = Arc::new(tensors);
        let plan = Plan {
            sends: (0..n).map(|d| (d != me).then(|| shared.clone())).collect(),
            expects: (0..n)
                .map(|s| (s != me).then(|| descriptors.clone()))
                .collect(),
        };
        let compression = self.cfg.compression.clone();
        let (received, failed) = self.exchange(OP, id, members, plan, compression).await?;
        let mine = Arc::try_unwrap(shared).unwrap_or_else(|s| (*s).clone());
        let mut gathered = to_tensors(OP, received)?;
        gathered[me] = Some(mine);
        if failed.is_empty() && gathered.iter().all(Option::is_some) {
            return Ok(gathered.into_iter().flatten().collect());
        }
        Err(GroupError::Failed {
            op: OP,
            failed,
            partial: Box::new(Partial::Gathered(gathered)),
        })
    }

    /// Member `root`'s `tensors` on every member (the others pass tensors of the shapes and
    /// dtypes to expect; their values are not used: the result is received into them).
    ///
    /// A pipelined chain (see `chain`): the root streams its parts to the next member, and
    /// every member forwards each part to the one after it as it decodes it, so every uplink
    /// carries the data once and the broadcast takes about one transfer of it whatever the
    /// group's size. No part is copied out to be sent (the root's parts are views of its
    /// tensors, the others forward the bytes they received) and the parts are decoded
    /// straight into the tensors a member passed (so when the operation fails, a member's
    /// tensors, shared memory included, may hold part of the root's values). A failure
    /// anywhere in the chain reaches every member, each naming the failed member.
    pub async fn broadcast(
        &mut self,
        root: usize,
        tensors: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, GroupError> {
        let compression = self.cfg.compression.clone();
        self.broadcast_with(root, tensors, compression).await
    }

    /// [`Group::broadcast`] with the given codec.
    pub(super) async fn broadcast_with(
        &mut self,
        root: usize,
        tensors: Vec<Tensor>,
        compression: Compression,
    ) -> Result<Vec<Tensor>, GroupError> {
        const OP: &str = "broadcast";
        self.check_member(OP, root)?;
        let id = self.next_collective();
        let members = self.live.clone();
        let cfg = ChainConfig {
            members: members.len(),
            me: self.me(),
            root,
            part_size_bytes: self.cfg.part_size_bytes,
            compression,
            sender_timeout: self.cfg.sender_timeout,
            op_timeout: Some(self.cfg.op_timeout),
        };
        let machine = Chain::new(cfg, tensors, Instant::now(), self.pool.clone()).map_err(|e| {
            GroupError::Invalid {
                op: OP,
                detail: e.to_string(),
            }
        })?;
        let (machine, failed) = self.drive(OP, id, &members, machine).await?;
        finish(OP, failed, machine.into_tensors(), |_| Partial::Nothing)
    }

    /// Reduce-scatter: `inputs[j]` goes to member `j` (one tensor per member, the same shape
    /// and dtype on every member for a given `j`); returns the reduction with `op` of every
    /// member's `inputs[me]`.
    pub async fn reduce_scatter(
        &mut self,
        op: ReduceOp,
        mut inputs: Vec<Tensor>,
    ) -> Result<Tensor, GroupError> {
        const OP: &str = "reduce_scatter";
        let n = self.live.len();
        if inputs.len() != n {
            return Err(GroupError::Invalid {
                op: OP,
                detail: format!("{} inputs for a group of {n}", inputs.len()),
            });
        }
        let id = self.next_collective();
        let members = self.live.clone();
        let me = self.me();
        let own = std::mem::replace(&mut inputs[me], Tensor::zeros(&[0], DType::F32));
        let descriptor: Arc<[TensorDescriptor]> = vec![TensorDescriptor::of(&own)].into();
        let plan = Plan {
            sends: inputs
                .into_iter()
                .enumerate()
                .map(|(d, t)| (d != me).then(|| Arc::new(vec![t])))
                .collect(),
            expects: (0..n)
                .map(|s| (s != me).then(|| descriptor.clone()))
                .collect(),
        };
        let compression = self.cfg.compression.clone();
        let (received, failed) = self.exchange(OP, id, members, plan, compression).await?;
        // The reduction runs on a blocking thread, as a round's does, not on the runtime. An
        // f32 input is reduced into in place; the received buffers go back to the pool.
        let pool = self.pool.clone();
        let reduced = tokio::task::spawn_blocking(move || {
            let shape = own.shape().to_vec();
            let dtype = own.dtype();
            let mut acc = into_f32_vec(own);
            let mut contributors = vec![me];
            for (s, values) in received.values.into_iter().enumerate() {
                if let Some(values) = values {
                    for (i, v) in values.into_iter().enumerate() {
                        if i == 0 {
                            op.fold(&mut acc, &v);
                        }
                        pool.put_f32(v);
                    }
                    contributors.push(s);
                }
            }
            contributors.sort_unstable();
            if op == ReduceOp::Mean {
                let k = contributors.len() as f32;
                acc.iter_mut().for_each(|v| *v /= k);
            }
            let tensor = match dtype {
                DType::F32 => Tensor::from_f32(&shape, acc),
                other => {
                    let t = Tensor::from_f32_as(&shape, &acc, other);
                    pool.put_f32(acc);
                    t
                }
            };
            tensor
                .map(|tensor| (tensor, contributors))
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        let (tensor, contributors) =
            reduced.map_err(|detail| GroupError::Internal { op: OP, detail })?;
        finish(OP, failed, tensor, |tensor| Partial::Reduced {
            tensor,
            contributors,
        })
    }

    /// Waits until every member has reached its barrier.
    pub async fn barrier(&mut self) -> Result<(), GroupError> {
        const OP: &str = "barrier";
        let id = self.next_collective();
        let members = self.live.clone();
        let n = members.len();
        let me = self.me();
        let empty = Arc::new(vec![Tensor::zeros(&[0], DType::F32)]);
        let descriptors: Arc<[TensorDescriptor]> = vec![TensorDescriptor::of(&empty[0])].into();
        let plan = Plan {
            sends: (0..n).map(|d| (d != me).then(|| empty.clone())).collect(),
            expects: (0..n)
                .map(|s| (s != me).then(|| descriptors.clone()))
                .collect(),
        };
        let (received, failed) = self
            .exchange(
                OP,
                id,
                members,
                plan,
                Compression::Fixed(CompressionType::None),
            )
            .await?;
        let arrived: Vec<usize> = (0..n)
            .filter(|&s| s == me || received.values[s].is_some())
            .collect();
        finish(OP, failed, (), |()| Partial::Arrived(arrived))
    }

    /// Sends `tensors` to member `to`, which receives them with [`Group::recv`] or
    /// [`Group::recv_any`]. Returns once they are handed to the link (like a buffered send):
    /// the receiver's side reports their arrival.
    pub async fn send(&mut self, to: usize, tensors: Vec<Tensor>) -> Result<(), GroupError> {
        const OP: &str = "send";
        let dst = self.check_member(OP, to)?;
        if dst == self.me {
            return Err(GroupError::Invalid {
                op: OP,
                detail: "a member cannot send to itself".into(),
            });
        }
        let id = OpId::Message {
            src: self.me as u16,
            dst: dst as u16,
            seq: self.send_seq[dst],
        };
        self.send_seq[dst] += 1;
        let plan = Plan {
            sends: vec![None, Some(Arc::new(tensors))],
            expects: vec![None, None],
        };
        let compression = self.cfg.compression.clone();
        let (_, failed) = self
            .exchange(OP, id, vec![self.me, dst], plan, compression)
            .await?;
        finish(OP, failed, (), |()| Partial::Nothing)
    }

    /// Receives the next tensors member `from` sent us, of the shapes and dtypes of `like`.
    pub async fn recv(
        &mut self,
        from: usize,
        like: &[TensorDescriptor],
    ) -> Result<Vec<Tensor>, GroupError> {
        const OP: &str = "recv";
        let src = self.check_member(OP, from)?;
        if src == self.me {
            return Err(GroupError::Invalid {
                op: OP,
                detail: "a member cannot receive from itself".into(),
            });
        }
        let id = OpId::Message {
            src: src as u16,
            dst: self.me as u16,
            seq: self.recv_seq[src],
        };
        self.recv_seq[src] += 1;
        let plan = Plan {
            sends: vec![None, None],
            expects: vec![Some(like.to_vec().into()), None],
        };
        let compression = self.cfg.compression.clone();
        let (received, failed) = self
            .exchange(OP, id, vec![src, self.me], plan, compression)
            .await?;
        let mut gathered = to_tensors(OP, received)?;
        match gathered[0].take() {
            Some(t) if failed.is_empty() => Ok(t),
            _ => Err(GroupError::Failed {
                op: OP,
                failed,
                partial: Box::new(Partial::Nothing),
            }),
        }
    }

    /// Receives the next message from whichever member sends first (waiting at most
    /// `op_timeout`); returns the sender's index and its tensors.
    pub async fn recv_any(
        &mut self,
        like: &[TensorDescriptor],
    ) -> Result<(usize, Vec<Tensor>), GroupError> {
        let arrivals = self.mesh().arrivals();
        let deadline = crate::rpc::deadline_after(self.cfg.op_timeout);
        loop {
            let notified = arrivals.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(from) = self.mesh().pending_message().and_then(|s| self.local(s)) {
                return Ok((from, self.recv(from, like).await?));
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(GroupError::Timeout(self.cfg.op_timeout));
            }
        }
    }

    /// Removes the members that failed since the last change (see the [module docs](super)):
    /// every survivor calls it; returns the removed members' peer ids.
    pub async fn shrink(&mut self) -> Result<Vec<PeerId>, GroupError> {
        const OP: &str = "shrink";
        let n_all = self.peers.len();
        let mut suspects = self.suspects.clone();
        suspects.extend(self.mesh().failed());
        suspects.remove(&self.me);
        let candidates: Vec<usize> = self
            .live
            .iter()
            .copied()
            .filter(|m| !suspects.contains(m))
            .collect();
        let mut mask = vec![0.0f32; n_all];
        for &s in &suspects {
            mask[s] = 1.0;
        }
        let mask = Arc::new(vec![Tensor::from_f32(&[n_all], mask).map_err(|e| {
            GroupError::Internal {
                op: OP,
                detail: e.to_string(),
            }
        })?]);
        let descriptors: Arc<[TensorDescriptor]> = vec![TensorDescriptor::of(&mask[0])].into();
        let k = candidates.len();
        let me = candidates
            .iter()
            .position(|&m| m == self.me)
            .ok_or(GroupError::Expelled)?;
        let plan = Plan {
            sends: (0..k).map(|d| (d != me).then(|| mask.clone())).collect(),
            expects: (0..k)
                .map(|s| (s != me).then(|| descriptors.clone()))
                .collect(),
        };
        let id = self.next_collective();
        let (received, _) = self
            .exchange(
                OP,
                id,
                candidates.clone(),
                plan,
                Compression::Fixed(CompressionType::None),
            )
            .await?;
        let masks: Vec<Option<Vec<usize>>> = received
            .values
            .iter()
            .map(|values| {
                values.as_ref().map(|v| {
                    v[0].iter()
                        .enumerate()
                        .filter(|(_, x)| **x != 0.0)
                        .map(|(i, _)| i)
                        .collect()
                })
            })
            .collect();
        let removed = removed_by_shrink(&candidates, me, &suspects, &masks);
        if removed.contains(&self.me) {
            return Err(GroupError::Expelled);
        }
        let gone: Vec<PeerId> = self
            .live
            .iter()
            .filter(|m| removed.contains(m))
            .map(|&m| self.peers[m])
            .collect();
        self.live.retain(|m| !removed.contains(m));
        self.renumber();
        Ok(gone)
    }
}

/// Whom a shrink removes (original indices), as every survivor computes it from the same
/// exchange: `candidates` took part (original indices; `me` is this member's position among
/// them), `suspects` are this member's own, `masks[s]` are the members candidate `s` names
/// (`None`: it did not answer).
///
/// A member that did not answer is removed (each survivor sees that for itself). A member
/// named by others is removed on the word of two of them, or of every other member that took
/// part (in a pair, the one witness there is): a single liar removes nobody but, at most,
/// itself (issue 29, attack 3; before, the union of everyone's accusations was removed).
fn removed_by_shrink(
    candidates: &[usize],
    me: usize,
    suspects: &BTreeSet<usize>,
    masks: &[Option<Vec<usize>>],
) -> BTreeSet<usize> {
    let mut removed = BTreeSet::new();
    let mut accusers: std::collections::BTreeMap<usize, BTreeSet<usize>> = Default::default();
    for &s in suspects {
        accusers.entry(s).or_default().insert(candidates[me]);
    }
    for (s, mask) in masks.iter().enumerate() {
        match mask {
            Some(named) => {
                for &m in named {
                    accusers.entry(m).or_default().insert(candidates[s]);
                }
            }
            None if s != me => {
                removed.insert(candidates[s]);
            }
            None => {}
        }
    }
    for (m, by) in accusers {
        let witnesses = candidates.iter().filter(|&&c| c != m).count();
        if by.len() >= 2.min(witnesses) {
            removed.insert(m);
        }
    }
    removed
}

/// Per source, its received values as tensors of the declared shapes and dtypes.
fn to_tensors(
    op: &'static str,
    received: Received,
) -> Result<Vec<Option<Vec<Tensor>>>, GroupError> {
    received
        .values
        .into_iter()
        .zip(received.descriptors)
        .map(|(values, descriptors)| {
            let (Some(values), Some(descriptors)) = (values, descriptors) else {
                return Ok(None);
            };
            values
                .into_iter()
                .zip(descriptors.iter())
                .map(|(v, d)| match d.dtype {
                    DType::F32 => Tensor::from_f32(&d.shape, v),
                    other => Tensor::from_f32_as(&d.shape, &v, other),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
                .map_err(|e| GroupError::Internal {
                    op,
                    detail: e.to_string(),
                })
        })
        .collect()
}

fn finish<T>(
    op: &'static str,
    failed: Vec<FailedMember>,
    value: T,
    partial: impl FnOnce(T) -> Partial,
) -> Result<T, GroupError> {
    if failed.is_empty() {
        Ok(value)
    } else {
        Err(GroupError::Failed {
            op,
            failed,
            partial: Box::new(partial(value)),
        })
    }
}

/// `t`'s values as an f32 vector: an f32 tensor's own storage (no copy), else converted.
fn into_f32_vec(t: Tensor) -> Vec<f32> {
    let numel = t.numel();
    match t {
        Tensor::F32(a) => match a.into_raw_vec_and_offset() {
            (v, Some(0) | None) if v.len() == numel => v,
            (v, offset) => {
                // A view into a larger allocation (not made by this crate's constructors).
                let start = offset.unwrap_or(0);
                v[start..start + numel].to_vec()
            }
        },
        other => other.to_f32_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[usize]) -> BTreeSet<usize> {
        v.iter().copied().collect()
    }

    /// Issue 29, attack 3: one member naming every other member as failed (a forged
    /// accusation, or a forged chain notice repeated by nobody) removes nobody, in every
    /// member's view, its own included. Before, the union of the accusations removed everyone
    /// it named (and every honest member found itself expelled).
    #[test]
    fn one_accuser_removes_nobody() {
        let candidates = [0, 1, 2, 3];
        let mut masks = vec![Some(Vec::new()); 4];
        masks[3] = Some(vec![0, 1, 2]);
        for me in 0..4 {
            let mut seen = masks.clone();
            seen[me] = None;
            let mine = if me == 3 { set(&[0, 1, 2]) } else { set(&[]) };
            assert_eq!(
                removed_by_shrink(&candidates, me, &mine, &seen),
                set(&[]),
                "member {me}'s view"
            );
        }
    }

    /// Members that really failed are still removed: one that does not answer the shrink, one
    /// named by two witnesses, and in a pair the one the other names (it is every witness
    /// there is).
    #[test]
    fn failed_members_are_removed() {
        // Member 4 died (silent), members 0 and 1 both saw member 3 misbehave.
        let candidates = [0, 1, 2, 3, 4];
        let masks = vec![
            None,
            Some(vec![3]),
            Some(Vec::new()),
            Some(Vec::new()),
            None,
        ];
        assert_eq!(
            removed_by_shrink(&candidates, 0, &set(&[3]), &masks),
            set(&[3, 4])
        );
        // Member 2 of a group of three suspects member 1, which the others no longer reach:
        // the shrink runs among 0 and 2, and both name it.
        let masks = vec![Some(vec![1]), None];
        assert_eq!(removed_by_shrink(&[0, 2], 1, &set(&[1]), &masks), set(&[1]));
        // A pair: the one witness there is suffices.
        let masks = vec![None, Some(vec![0])];
        assert_eq!(removed_by_shrink(&[0, 1], 0, &set(&[]), &masks), set(&[0]));
        assert_eq!(removed_by_shrink(&[0], 0, &set(&[1]), &[None]), set(&[1]));
    }
}
