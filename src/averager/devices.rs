//! An averager's tensors in GPU memory (the `cuda` feature; see the `cuda` module for the
//! protocol of one round on the device).
//!
//! An averager takes a mix of host and device tensors ([`AveragedTensor`]); their order is the
//! round's tensor order, the same for every peer, so a peer averaging on a GPU and one
//! averaging host tensors of the same shapes and dtypes form groups together. The host tensors
//! stay behind the averager's lock ([`super::Averager::tensors`] holds them, in order); the
//! device tensors need no lock: every access to them is ordered on their training stream.
//!
//! A step starts the device snapshots as soon as its group is known ([`Devices::begin`]),
//! before linking; the round starts once the links are made, on the host snapshots and the
//! device tensors' pinned copies, each device tensor's parts held back until its copy is on
//! the host ([`Devices::start_round`]); the host tensors get the delta rule on the CPU, the
//! device ones on their device ([`Devices::apply_devices`]), after every copy is complete
//! ([`Devices::wait_snapshots`]).

use super::AveragerError;
use crate::allreduce::{Outcome, TensorDescriptor};
use crate::compression::Compression;
use crate::runner::PendingTensors;
use crate::tensor::Tensor;

/// A tensor an averager averages: in host memory or, with the `cuda` feature, on a GPU.
#[derive(Debug)]
#[non_exhaustive]
pub enum AveragedTensor {
    /// In host memory (owned or shared with the caller).
    Host(Tensor),
    /// In GPU memory, updated in its training stream's order.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::DeviceTensor),
}

impl From<Tensor> for AveragedTensor {
    fn from(t: Tensor) -> Self {
        Self::Host(t)
    }
}

#[cfg(feature = "cuda")]
impl From<crate::cuda::DeviceTensor> for AveragedTensor {
    fn from(t: crate::cuda::DeviceTensor) -> Self {
        Self::Device(t)
    }
}

impl AveragedTensor {
    /// Shape and dtype.
    pub fn descriptor(&self) -> TensorDescriptor {
        match self {
            Self::Host(t) => TensorDescriptor::of(t),
            #[cfg(feature = "cuda")]
            Self::Device(t) => TensorDescriptor {
                shape: t.shape().to_vec(),
                dtype: t.dtype(),
            },
        }
    }
}

/// The round's tensors from the host ones (in order) and the device ones, which go to the
/// ascending positions `device_at`; `None` unless every position is filled exactly once.
/// (Unused without device tensors, i.e. without the `cuda` feature, but for its test.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn interleave<T>(host: Vec<T>, device: Vec<T>, device_at: &[usize]) -> Option<Vec<T>> {
    if device.len() != device_at.len() {
        return None;
    }
    let total = host.len() + device.len();
    let mut host = host.into_iter();
    let mut device = device.into_iter();
    let mut next_device = device_at.iter().copied().peekable();
    let mut merged = Vec::with_capacity(total);
    for i in 0..total {
        let t = if next_device.peek() == Some(&i) {
            next_device.next();
            device.next()
        } else {
            host.next()
        };
        merged.push(t?);
    }
    // Every device position was inside the round (none left over).
    next_device.next().is_none().then_some(merged)
}

/// The device tensors of an averager and where they sit in the round's order.
pub(crate) struct Devices {
    /// Round index of each host tensor, ascending.
    host_index: Vec<usize>,
    /// Round index and staging of each device tensor.
    #[cfg(feature = "cuda")]
    slots: Vec<(usize, std::sync::Mutex<crate::cuda::Staging>)>,
}

#[cfg(feature = "cuda")]
fn staging(
    slot: &std::sync::Mutex<crate::cuda::Staging>,
) -> std::sync::MutexGuard<'_, crate::cuda::Staging> {
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(feature = "cuda")]
fn device_error(e: impl std::fmt::Display) -> AveragerError {
    AveragerError::Round(format!("device tensor: {e}"))
}

impl Devices {
    /// Splits an averager's tensors into the host ones (in order) and the device ones.
    pub(crate) fn split(
        tensors: Vec<AveragedTensor>,
        compression: &Compression,
    ) -> Result<(Vec<Tensor>, Vec<TensorDescriptor>, Self), AveragerError> {
        let _ = compression;
        let descriptors = tensors.iter().map(AveragedTensor::descriptor).collect();
        let mut host = Vec::new();
        let mut devices = Self {
            host_index: Vec::new(),
            #[cfg(feature = "cuda")]
            slots: Vec::new(),
        };
        for (i, t) in tensors.into_iter().enumerate() {
            match t {
                AveragedTensor::Host(t) => {
                    devices.host_index.push(i);
                    host.push(t);
                }
                #[cfg(feature = "cuda")]
                AveragedTensor::Device(t) => {
                    // The device buffers are allocated now: a full device fails the start.
                    let staging = crate::cuda::Staging::new(t, compression)
                        .map_err(|e| AveragerError::Config(format!("device tensor {i}: {e}")))?;
                    devices.slots.push((i, std::sync::Mutex::new(staging)));
                }
            }
        }
        Ok((host, descriptors, devices))
    }

    /// Whether there is any device tensor.
    pub(crate) fn is_empty(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.slots.is_empty();
        #[cfg(not(feature = "cuda"))]
        true
    }

    /// Starts every device tensor's snapshot (enqueues copies; does not wait).
    pub(crate) fn begin(&self) -> Result<(), AveragerError> {
        #[cfg(feature = "cuda")]
        for (_, slot) in &self.slots {
            staging(slot).begin_snapshot().map_err(device_error)?;
        }
        Ok(())
    }

    /// The round's tensors, at once: the host `snapshot` with the device snapshots in their
    /// places, their copies to the host possibly still in flight, and (with device tensors)
    /// the [`PendingTensors`] that says when each is readable: a blocking thread waits for the
    /// copies in turn and sends each one's round index (or the error). The round must not
    /// read them before ([`crate::runner::run_round_pending`] does not), and the apply waits
    /// for all of them ([`Devices::wait_snapshots`]).
    pub(crate) fn start_round(
        &self,
        snapshot: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, Option<PendingTensors>), AveragerError> {
        if self.is_empty() {
            return Ok((snapshot, None));
        }
        #[cfg(feature = "cuda")]
        {
            let mut device = Vec::with_capacity(self.slots.len());
            let mut copies = Vec::with_capacity(self.slots.len());
            for (i, slot) in &self.slots {
                // SAFETY: the round reads a pending tensor only after its index arrives on
                // `ready`, which the waiter below sends once the copy is complete.
                let (tensor, copy) =
                    unsafe { staging(slot).pending_snapshot() }.map_err(device_error)?;
                device.push(tensor);
                copies.push((*i, copy));
            }
            let at: Vec<usize> = self.slots.iter().map(|(i, _)| *i).collect();
            let tensors = interleave(snapshot, device, &at).ok_or_else(|| {
                device_error("the host tensors were replaced by a different number of them")
            })?;
            let (tx, ready) = tokio::sync::mpsc::channel(copies.len().max(1));
            // Detached: it ends when the last copy is done (or one fails), or at the first copy
            // it finds the round gone; it touches nothing but the copies' events. (A copy that
            // never completes, a hung device, holds it: there is no timeout on an event.)
            drop(tokio::task::spawn_blocking(move || {
                for (i, copy) in copies {
                    if tx.is_closed() {
                        return; // the round is over: nobody waits for the rest
                    }
                    let r = copy.wait().map(|()| i).map_err(|e| e.to_string());
                    let failed = r.is_err();
                    if tx.blocking_send(r).is_err() || failed {
                        return;
                    }
                }
            }));
            Ok((tensors, Some(PendingTensors { indices: at, ready })))
        }
        #[cfg(not(feature = "cuda"))]
        Ok((snapshot, None))
    }

    /// Waits (blocking) for every device snapshot's copy to the host: before the apply reads
    /// the snapshots and reuses the device buffers.
    pub(crate) fn wait_snapshots(&self) -> Result<(), AveragerError> {
        #[cfg(feature = "cuda")]
        for (_, slot) in &self.slots {
            staging(slot).wait_snapshot().map_err(device_error)?;
        }
        Ok(())
    }

    /// The delta rule for a finished round's host tensors: `host` is the averager's host
    /// tensors (locked), `start` the round's tensors as it started (all of them, in round
    /// order).
    pub(crate) fn apply_host(
        &self,
        outcome: &Outcome,
        host: &mut [Tensor],
        start: &[Tensor],
        alpha: f32,
    ) -> Result<(), AveragerError> {
        outcome
            .apply_mapped(host, &self.host_index, start, alpha)
            .map_err(|e| AveragerError::Round(e.to_string()))
    }

    /// The delta rule for the device tensors: uploads every tensor's deltas, waits for the
    /// uploads, then enqueues the apply kernels. Blocking: run on a blocking thread.
    pub(crate) fn apply_devices(
        shared: &super::Shared,
        outcome: &Outcome,
        start: &[Tensor],
        alpha: f32,
    ) -> Result<(), AveragerError> {
        if shared.devices.is_empty() {
            return Ok(());
        }
        #[cfg(feature = "cuda")]
        {
            let mut any = false;
            for (i, slot) in &shared.devices.slots {
                let from = start
                    .get(*i)
                    .ok_or_else(|| device_error("the round returned fewer tensors"))?;
                any |= staging(slot)
                    .upload(outcome, *i, from)
                    .map_err(device_error)?;
            }
            if any {
                for (_, slot) in &shared.devices.slots {
                    staging(slot).launch_apply(alpha).map_err(device_error)?;
                }
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (outcome, start, alpha);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::interleave;

    #[test]
    fn device_snapshots_go_back_to_their_places() {
        let host = vec!["h0", "h1", "h2"];
        let device = vec!["d0", "d1"];
        assert_eq!(
            interleave(host.clone(), device.clone(), &[0, 3]),
            Some(vec!["d0", "h0", "h1", "d1", "h2"])
        );
        assert_eq!(
            interleave(host.clone(), device.clone(), &[3, 4]),
            Some(vec!["h0", "h1", "h2", "d0", "d1"])
        );
        assert_eq!(interleave(host.clone(), vec![], &[]), Some(host.clone()));
        // A position past the round, a count that does not match, positions out of order.
        assert_eq!(interleave(host.clone(), device.clone(), &[0, 5]), None);
        assert_eq!(interleave(host.clone(), device.clone(), &[0]), None);
        assert_eq!(interleave(vec!["h0"], device.clone(), &[1, 0]), None);
    }
}
