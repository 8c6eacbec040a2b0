//! [`Staging`]: one device tensor's buffers and events, and the snapshot and apply of a round
//! (the `cuda` module docs describe the protocol). What is enqueued where, and which event
//! orders it, comes from [`super::plan`]; this executes those plans with the driver.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, PushKernelArg, result};

use super::memory::{DeviceAlloc, PinnedAlloc, Pool, Retired};
use super::plan::{self, Lane, Mark, Op, Pending};
use super::{
    CudaError, DeviceTensor, RestoreContext, delta_dtype, dtype_index, fill_deltas, launch_config,
    snapshot_dtype,
};
use crate::compression::Compression;
use crate::tensor::{DType, Tensor, TensorError};

/// Most pinned snapshot buffers per tensor: one, a second where a round still holds the first
/// when the next snapshot starts, a third for a round abandoned while another ran.
const SNAPSHOT_BUFFERS: usize = 3;

/// A snapshot's copy to pinned host memory, in flight ([`Staging::pending_snapshot`]).
#[derive(Debug)]
pub struct SnapshotCopy {
    event: Arc<CudaEvent>,
}

impl SnapshotCopy {
    /// Waits (blocking) until the copy is complete: the snapshot tensor may be read then.
    pub fn wait(&self) -> Result<(), CudaError> {
        let _restore = RestoreContext::save();
        self.event.synchronize()?;
        Ok(())
    }
}

/// A round's outcome to apply ([`Staging::upload`]).
struct Deltas<'a> {
    outcome: &'a crate::allreduce::Outcome,
    index: usize,
    start: &'a Tensor,
}

/// What a device tensor's rounds need (see the module docs): the device buffer, the pinned
/// snapshot and delta buffers, and the events ordering their reuse. An averager keeps one per
/// device tensor; code that runs rounds itself (the `bench allreduce --device cuda` workers)
/// uses it directly: [`Staging::begin_snapshot`], [`Staging::finish_snapshot`], the round on
/// the returned host tensor, [`Staging::apply`].
///
/// Its buffers are allocated when it is made and reused every round; dropping it hands them
/// to the device's reaper thread, which frees them once the work still using them is done
/// (the dropping thread makes no CUDA call).
pub struct Staging {
    tensor: DeviceTensor,
    snapshot_dtype: DType,
    delta_dtype: DType,
    /// Holds the snapshot on the device, then the deltas.
    device_buf: DeviceAlloc,
    /// The pinned snapshot buffers; one is shared with the round's snapshot tensor while a
    /// round runs.
    host_snapshots: Pool<PinnedAlloc>,
    /// The pool buffer of the last snapshot.
    current: usize,
    host_delta: PinnedAlloc,
    /// The last recording of each mark (`plan::MARKS` order); `Snapped` is shared with a
    /// round's [`SnapshotCopy`] while the round waits for it.
    marks: [Option<Arc<CudaEvent>>; 4],
    /// Which marks may still be incomplete.
    pending: Pending,
    /// Timing events on the training stream around the snapshot's part of it and around the
    /// apply kernel ([`Staging::set_timing`]).
    timing: bool,
    held: Option<(Arc<CudaEvent>, Arc<CudaEvent>)>,
    kernel: Option<(Arc<CudaEvent>, Arc<CudaEvent>)>,
    /// Whether the last upload left deltas for [`Staging::launch_apply`].
    ready_to_apply: bool,
}

fn mark_index(m: Mark) -> usize {
    match m {
        Mark::Copied => 0,
        Mark::Snapped => 1,
        Mark::Uploaded => 2,
        Mark::Applied => 3,
    }
}

impl Staging {
    /// Staging for `tensor` under `compression`, its buffers allocated now (so that a full
    /// device fails here, not in the middle of training).
    pub fn new(tensor: DeviceTensor, compression: &Compression) -> Result<Self, CudaError> {
        let _restore = RestoreContext::save();
        let snapshot_dtype = snapshot_dtype(tensor.dtype(), tensor.numel(), compression);
        let delta_dtype = delta_dtype(snapshot_dtype);
        let n = tensor.numel();
        let dev = tensor.device().clone();
        let snap_bytes = n * snapshot_dtype.size_bytes();
        let delta_bytes = n * delta_dtype.size_bytes();
        Ok(Self {
            device_buf: DeviceAlloc::new(
                &dev.parts.ctx,
                &dev.parts.reaper,
                snap_bytes.max(delta_bytes),
            )?,
            host_snapshots: Pool::new(
                PinnedAlloc::new(&dev.parts.ctx, &dev.parts.reaper, snap_bytes)?,
                SNAPSHOT_BUFFERS,
            ),
            current: 0,
            host_delta: PinnedAlloc::new(&dev.parts.ctx, &dev.parts.reaper, delta_bytes)?,
            snapshot_dtype,
            delta_dtype,
            tensor,
            marks: Default::default(),
            pending: Pending::default(),
            timing: false,
            held: None,
            kernel: None,
            ready_to_apply: false,
        })
    }

    /// Records timing events on the training stream from now on (for benchmarks; see
    /// [`Staging::stream_times_ms`]).
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on;
    }

    /// With timing on, what the training stream spent in the last round, in milliseconds:
    /// `(the snapshot's part: its waits for earlier transfers, if any, and the device-side
    /// copy; the apply kernel)` (waits for both). Measured with events around them on the
    /// training stream, so on a busy training stream the first is an upper bound (it
    /// includes the stream's own work enqueued before that had not finished).
    pub fn stream_times_ms(&self) -> Result<Option<(f64, f64)>, CudaError> {
        let ms = |pair: &Option<(Arc<CudaEvent>, Arc<CudaEvent>)>| -> Result<f64, CudaError> {
            Ok(match pair {
                Some((a, b)) => f64::from(a.elapsed_ms(b)?),
                None => 0.0,
            })
        };
        if !self.timing {
            return Ok(None);
        }
        let _restore = RestoreContext::save();
        Ok(Some((ms(&self.held)?, ms(&self.kernel)?)))
    }

    fn timed(stream: &CudaStream) -> Result<Arc<CudaEvent>, CudaError> {
        Ok(Arc::new(
            stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        ))
    }

    fn stream(&self, lane: Lane) -> &Arc<CudaStream> {
        match lane {
            Lane::Training => self.tensor.stream(),
            Lane::Pcie | Lane::Host => &self.tensor.device().parts.pcie,
        }
    }

    fn mark(&self, m: Mark) -> Result<&Arc<CudaEvent>, CudaError> {
        self.marks[mark_index(m)]
            .as_ref()
            .ok_or_else(|| TensorError::Mismatch(format!("no {m:?} event recorded")).into())
    }

    /// Executes a plan's operations in order.
    fn run(
        &mut self,
        ops: &[Op],
        deltas: Option<&Deltas<'_>>,
        alpha: f32,
    ) -> Result<(), CudaError> {
        for &op in ops {
            self.execute(op, deltas, alpha)?;
        }
        Ok(())
    }

    fn execute(
        &mut self,
        op: Op,
        deltas: Option<&Deltas<'_>>,
        alpha: f32,
    ) -> Result<(), CudaError> {
        let t = &self.tensor;
        let dev = t.device();
        let n = t.numel();
        let buf = self.device_buf.ptr;
        match op {
            Op::Wait(Lane::Host, m) => {
                if let Some(e) = self.marks[mark_index(m)].take() {
                    e.synchronize()?;
                }
            }
            Op::Wait(lane, m) => self.stream(lane).wait(self.mark(m)?)?,
            Op::Record(lane, m) => {
                // The host waits for these two: no spinning.
                let flags = match m {
                    Mark::Snapped | Mark::Uploaded => CUevent_flags::CU_EVENT_BLOCKING_SYNC,
                    Mark::Copied | Mark::Applied => CUevent_flags::CU_EVENT_DISABLE_TIMING,
                };
                let event = dev.parts.ctx.new_event(Some(flags))?;
                event.record(self.stream(lane))?;
                self.marks[mark_index(m)] = Some(Arc::new(event));
            }
            Op::SnapshotCopy => {
                let stream = t.stream();
                if self.snapshot_dtype == t.dtype() {
                    // SAFETY: both buffers hold the snapshot's bytes; ordered on the training
                    // stream (the plan made it wait for earlier transfers of `buf`).
                    unsafe {
                        result::memcpy_dtod_async(
                            buf,
                            t.device_ptr(),
                            n * self.snapshot_dtype.size_bytes(),
                            stream.cu_stream(),
                        )
                    }?;
                } else {
                    let cast = if self.snapshot_dtype == DType::F16 {
                        &dev.parts.cast_f16
                    } else {
                        &dev.parts.cast_bf16
                    };
                    let (src, n64) = (t.device_ptr(), n as u64);
                    let mut launch = stream.launch_builder(cast);
                    launch.arg(&src).arg(&buf).arg(&n64);
                    // SAFETY: `hm_cast_f32_*(const float*, u16*, u64)`: `n` f32 in, `n` u16 out.
                    unsafe { launch.launch(launch_config(n)) }?;
                }
            }
            Op::Download(i) => {
                let bytes = n * self.snapshot_dtype.size_bytes();
                let pcie = dev.parts.pcie.clone();
                let host = self
                    .host_snapshots
                    .get_mut(i)
                    .ok_or_else(|| TensorError::Mismatch("snapshot buffer in use".into()))?;
                // SAFETY: `host` holds `bytes` bytes, and nobody else holds it (the pool gave
                // it out free); it stays allocated and untouched until `Snapped` completes
                // (pending_snapshot's caller waits for it; later plans order after it).
                unsafe {
                    result::memcpy_dtoh_async(
                        &mut host.as_mut_slice()[..bytes],
                        buf,
                        pcie.cu_stream(),
                    )
                }?;
            }
            Op::FillDeltas(_) => {
                let d = deltas.ok_or_else(|| TensorError::Mismatch("no round to apply".into()))?;
                let bytes = n * self.delta_dtype.size_bytes();
                fill_deltas(
                    d.outcome,
                    d.index,
                    d.start,
                    self.delta_dtype,
                    &mut self.host_delta.as_mut_slice()[..bytes],
                )
                .map_err(|e| TensorError::Mismatch(e.to_string()))?;
            }
            Op::Upload => {
                let bytes = n * self.delta_dtype.size_bytes();
                let host = &self.host_delta.as_mut_slice()[..bytes];
                // SAFETY: the device buffer holds at least `bytes`; the plan ordered this after
                // the snapshot's copy out of it and after the last apply kernel that read it;
                // the host buffer is not written again before `Uploaded` completes (the next
                // upload's plan waits for it).
                unsafe { result::memcpy_htod_async(buf, host, dev.parts.pcie.cu_stream()) }?;
            }
            Op::Apply => {
                let f = &dev.parts.apply[dtype_index(t.dtype())][dtype_index(self.delta_dtype)];
                let (ptr, n64) = (t.device_ptr(), n as u64);
                let mut launch = t.stream().launch_builder(f);
                launch.arg(&ptr).arg(&buf).arg(&alpha).arg(&n64);
                // SAFETY: `hm_apply_T_D(T*, const D*, float, u64)` over `numel` elements of
                // both; the deltas are in `buf` (the host saw the upload complete).
                unsafe { launch.launch(launch_config(n)) }?;
            }
        }
        Ok(())
    }

    /// Starts the snapshot (step 1 of the module docs): one copy (or cast) on the training
    /// stream into the device buffer, then its copy to pinned memory on the PCIe stream;
    /// [`Staging::finish_snapshot`] waits for it. Fails where every pinned snapshot buffer is
    /// still held by a round.
    pub fn begin_snapshot(&mut self) -> Result<(), CudaError> {
        let dev = self.tensor.device().clone();
        let n = self.tensor.numel();
        dev.parts.ctx.bind_to_thread()?;
        let snap_bytes = n * self.snapshot_dtype.size_bytes();
        self.current = self
            .host_snapshots
            .pick(|| PinnedAlloc::new(&dev.parts.ctx, &dev.parts.reaper, snap_bytes))?
            .ok_or_else(|| {
                TensorError::Mismatch(format!(
                    "all {SNAPSHOT_BUFFERS} snapshot buffers are still held by rounds"
                ))
            })?;
        let ops = plan::snapshot(&mut self.pending, self.current, n > 0);
        // The training stream's part: its waits (if any) and the copy, up to `Copied`.
        let split = ops
            .iter()
            .position(|op| *op == Op::Record(Lane::Training, Mark::Copied))
            .map_or(ops.len(), |i| i + 1);
        let before = self
            .timing
            .then(|| Self::timed(self.tensor.stream()))
            .transpose()?;
        self.run(&ops[..split], None, 0.0)?;
        if let Some(before) = before {
            self.held = Some((before, Self::timed(self.tensor.stream())?));
        }
        self.run(&ops[split..], None, 0.0)
    }

    /// The snapshot [`Staging::begin_snapshot`] started, as a host tensor over the pinned
    /// memory (no copy), in the snapshot dtype, *without* waiting for its copy to the host;
    /// and that copy, to wait for. A round can start with it at once and send its parts once
    /// the copy is done ([`crate::runner::PendingTensors`]).
    ///
    /// # Safety
    ///
    /// The tensor's values must not be read before [`SnapshotCopy::wait`] (or
    /// [`Staging::wait_snapshot`]) returned `Ok`: until then the copy writes them.
    pub unsafe fn pending_snapshot(&self) -> Result<(Tensor, SnapshotCopy), CudaError> {
        let snapped = self.marks[mark_index(Mark::Snapped)]
            .clone()
            .filter(|_| self.pending.is_pending(Mark::Snapped))
            .ok_or_else(|| TensorError::Mismatch("no snapshot was started".into()))?;
        let host = self.host_snapshots.get(self.current).clone();
        let ptr = host.ptr;
        // SAFETY: the pinned buffer will hold the snapshot's elements once `snapped`
        // completes, which the caller waits for before reading them; aligned (page-locked
        // allocations are page aligned), kept alive by `host`; nothing else writes it while
        // the tensor lives (the pool gives out only buffers nobody else holds).
        let tensor =
            unsafe { Tensor::from_external(self.tensor.shape(), self.snapshot_dtype, ptr, host) }?;
        Ok((tensor, SnapshotCopy { event: snapped }))
    }

    /// Waits (blocking) for the snapshot's copy to the host; the snapshot is then complete.
    /// Without a snapshot in flight, returns at once.
    pub fn wait_snapshot(&mut self) -> Result<(), CudaError> {
        let _restore = RestoreContext::save();
        let ops = plan::wait_snapshot(&mut self.pending);
        self.run(&ops, None, 0.0)
    }

    /// Waits for the snapshot's host copy and returns it as a host tensor over the pinned
    /// memory (no copy), in the snapshot dtype.
    pub fn finish_snapshot(&mut self) -> Result<Tensor, CudaError> {
        // SAFETY: the tensor is returned only after the copy completed (below).
        let (tensor, _) = unsafe { self.pending_snapshot() }?;
        self.wait_snapshot()?;
        Ok(tensor)
    }

    /// Applies a round's result to the device tensor (step 3 of the module docs):
    /// [`Staging::upload`], then [`Staging::launch_apply`] (which waits for the upload).
    pub fn apply(
        &mut self,
        outcome: &crate::allreduce::Outcome,
        index: usize,
        start: &Tensor,
        alpha: f32,
    ) -> Result<(), CudaError> {
        if self.upload(outcome, index, start)? {
            self.launch_apply(alpha)?;
        }
        Ok(())
    }

    /// The host half of the apply: computes `outcome`'s deltas for round tensor `index`
    /// against `start` (the snapshot the round started from) into pinned memory and starts
    /// their upload on the PCIe stream, ordered after the previous apply kernel (which reads
    /// the device buffer). Blocks while the snapshot's or the previous upload's copy is in
    /// flight. Returns whether there is anything to apply (an aux peer's outcome has nothing).
    pub fn upload(
        &mut self,
        outcome: &crate::allreduce::Outcome,
        index: usize,
        start: &Tensor,
    ) -> Result<bool, CudaError> {
        self.ready_to_apply = false;
        if outcome.results.is_none() || self.tensor.numel() == 0 {
            return Ok(false);
        }
        let _restore = RestoreContext::save();
        self.tensor.device().parts.ctx.bind_to_thread()?;
        let ops = plan::upload(&mut self.pending, self.current);
        let deltas = Deltas {
            outcome,
            index,
            start,
        };
        self.run(&ops, Some(&deltas), 0.0)?;
        self.ready_to_apply = true;
        Ok(true)
    }

    /// Waits (blocking) for [`Staging::upload`]'s copy, then enqueues the apply kernel on
    /// the training stream: the training stream never waits for the upload, it only runs the
    /// kernel. Does nothing when the last upload had nothing to apply.
    pub fn launch_apply(&mut self, alpha: f32) -> Result<(), CudaError> {
        if !std::mem::take(&mut self.ready_to_apply) {
            // Nothing was uploaded (an aux peer's or an empty tensor's round).
            return Ok(());
        }
        let _restore = RestoreContext::save();
        self.tensor.device().parts.ctx.bind_to_thread()?;
        let ops = plan::apply(&mut self.pending);
        let kernel = ops
            .iter()
            .position(|op| *op == Op::Apply)
            .unwrap_or(ops.len());
        self.run(&ops[..kernel], None, alpha)?;
        let before = self
            .timing
            .then(|| Self::timed(self.tensor.stream()))
            .transpose()?;
        self.run(&ops[kernel..], None, alpha)?;
        if let Some(before) = before {
            self.kernel = Some((before, Self::timed(self.tensor.stream())?));
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The reaper waits for the events still ordering work on the buffers, then (the
        // buffers' own drops, queued after this) frees them: no CUDA call on this thread.
        let mut after = Vec::new();
        for op in plan::retire(&mut self.pending) {
            if let Op::Wait(Lane::Host, m) = op
                && let Some(e) = self.marks[mark_index(m)].take()
            {
                after.push(e);
            }
        }
        // Events with nothing left to wait for are only destroyed, on the reaper too.
        after.extend(self.marks.iter_mut().filter_map(Option::take));
        for (a, b) in [self.held.take(), self.kernel.take()].into_iter().flatten() {
            after.extend([a, b]);
        }
        let dev = self.tensor.device();
        dev.parts.reaper.retire(Retired {
            ctx: dev.parts.ctx.clone(),
            after,
            memory: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::super::{CudaDevice, apply_reference, gpu_test_gate_here};
    use super::*;
    use crate::allreduce::{Outcome, PartResult, PartSpec};
    use crate::compression::CompressionType;

    /// Device 0, or `None` (after saying so) where there is no driver library; any other
    /// driver error, or no GPU with `HIVEMESH_GPU_REQUIRED`, fails.
    fn gpu() -> Option<Arc<CudaDevice>> {
        match gpu_test_gate_here() {
            Ok(true) => Some(CudaDevice::open(0).expect("opening device 0")),
            Ok(false) => {
                println!("skipped: no CUDA driver here");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 20011) as f32 / 997.0 - 10.0)
            .collect()
    }

    /// [`values`] with, for f32 tensors, values past f16's range (the codec saturates), f16
    /// subnormals and a bf16 tie.
    fn inputs(n: usize, seed: u32, dtype: DType) -> Vec<f32> {
        let mut v = values(n, seed);
        if dtype == DType::F32 {
            v[0] = 1.0e6;
            v[1] = -7.0e4;
            v[2] = 1.0e-6;
            v[3] = f32::from_bits(0x3F80_8000);
        }
        v
    }

    /// The snapshot leaves the device as the codec would encode it (bit for bit), and a write
    /// the training loop makes between snapshot and apply survives the apply, which matches
    /// the host rule bit for bit; twice, so reused buffers are exercised.
    #[test]
    fn snapshot_casts_like_the_codec_and_training_writes_survive_the_apply() {
        let Some(dev) = gpu() else {
            return;
        };
        let stream = dev.new_stream().unwrap();
        let n = 70_001;
        for (compression, dtype) in [
            (CompressionType::None, DType::F32),
            (CompressionType::Float16, DType::F32),
            (CompressionType::BFloat16, DType::F32),
            (CompressionType::None, DType::F16),
            (CompressionType::Float16, DType::F16),
            (CompressionType::None, DType::BF16),
            (CompressionType::Uniform8Bit, DType::F32),
        ] {
            let what = format!("{compression:?}/{dtype}");
            let compression = Compression::Fixed(compression);
            let x = Tensor::from_f32_as(&[n], &inputs(n, 1, dtype), dtype).unwrap();
            let t = DeviceTensor::from_host(&dev, &stream, &x).unwrap();
            let mut staging = Staging::new(t.clone(), &compression).unwrap();
            staging.set_timing(true);
            let mut current = x.clone();
            for round in 0..2u32 {
                staging.begin_snapshot().unwrap();
                let snap = staging.finish_snapshot().unwrap();
                let sd = snapshot_dtype(dtype, n, &compression);
                assert_eq!(snap.dtype(), sd, "{what}");
                if sd == dtype {
                    assert_eq!(snap, current, "{what} round {round}: snapshot");
                } else {
                    // The codec's own encoding of the f32 values is the snapshot's bytes.
                    let mut encoded = Vec::new();
                    compression
                        .codec_for(n)
                        .encode(current.flat(), &mut encoded);
                    assert_eq!(snap.flat().as_bytes(), &encoded[..], "{what}: cast bits");
                }
                // The training loop moves on after the snapshot.
                let moved: Vec<f32> = current.to_f32_vec().iter().map(|v| v + 1.0).collect();
                current = Tensor::from_f32_as(&[n], &moved, dtype).unwrap();
                t.copy_from_host(&current).unwrap();
                let avg: Vec<u8> = values(n, 9 + round)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let outcome = Outcome {
                    results: Some(vec![PartResult::Average(Bytes::from(avg))]),
                    parts: vec![PartSpec {
                        tensor: 0,
                        offset: 0,
                        len: n,
                    }],
                    report: Default::default(),
                    reply_feedback: Vec::new(),
                };
                staging.apply(&outcome, 0, &snap, 0.75).unwrap();
                let dd = delta_dtype(sd);
                // With timing on, both pairs of events were recorded and can be read.
                assert!(staging.stream_times_ms().unwrap().is_some(), "{what}");
                let mut deltas = vec![0u8; n * dd.size_bytes()];
                fill_deltas(&outcome, 0, &snap, dd, &mut deltas).unwrap();
                apply_reference(&mut current, &deltas, dd, 0.75);
                drop(snap);
                if round == 1 {
                    staging.set_timing(false);
                    assert_eq!(
                        staging.stream_times_ms().unwrap(),
                        None,
                        "{what}: timing off"
                    );
                }
                let got = t.to_host().unwrap();
                let (g, e) = (got.to_f32_vec(), current.to_f32_vec());
                for i in 0..n {
                    assert_eq!(
                        g[i].to_bits(),
                        e[i].to_bits(),
                        "{what} round {round} element {i}: {} vs {}",
                        g[i],
                        e[i]
                    );
                }
            }
        }
    }
}
