//! GPU tensors (the `cuda` feature): an averager averages tensors that live on a CUDA device
//! in place, and the training loop's stream waits only for two short device-side operations.
//!
//! # A round, for one device tensor
//!
//! Three streams take part: the *training stream* the tensor was handed over with (the one the
//! training loop launches its kernels on), and two of the device's own, hivemesh's: the *copy
//! stream* for device-side copies and the *PCIe stream* for transfers to and from the host.
//!
//! 1. **Snapshot** ([`Staging::begin_snapshot`], as soon as the group is known, before the
//!    links are made): the copy stream waits for an event recorded on the training stream,
//!    then copies the tensor into a device buffer of the averager's (for an f32 tensor whose
//!    codec is `float16` or `bfloat16`, a cast kernel writes the codec's 16-bit words instead,
//!    rounded and saturated as the codec does, so that the round moves half the bytes across
//!    PCIe too). The training stream waits for that copy, and only for it: the training
//!    loop's later kernels cannot change the values being snapshotted, and no transfer holds
//!    them up. The PCIe stream then copies the buffer into pinned host memory, overlapped
//!    with linking to the group.
//! 2. **Round**: the pinned memory is the round's snapshot of the tensor, without a further
//!    copy; the all-reduce runs on the CPU as for host tensors. An averager's round starts
//!    once the links are made, whether or not the host copy is complete
//!    ([`Staging::pending_snapshot`]): a blocking thread waits for each device tensor's copy
//!    ([`SnapshotCopy::wait`], a blocking-sync event) in turn and tells the round, which
//!    sends none of a tensor's parts and reads none of its values before then
//!    ([`crate::runner::PendingTensors`]). So parts go out as soon as their tensor is on the
//!    host. ([`Staging::finish_snapshot`] waits first, for code that runs rounds itself.)
//! 3. **Apply** ([`Staging::upload`], [`Staging::launch_apply`]): the host computes
//!    `average − snapshot` per element (zero where a part stayed local) into a second pinned
//!    buffer ([`delta_dtype`]: bf16 where the snapshot is bf16, f32 otherwise), the PCIe
//!    stream uploads it into the device buffer and the host waits for the upload (off the
//!    runtime's threads); then one kernel on the training stream, `tensor += alpha · delta`,
//!    computed in f32 and rounded once to the tensor's dtype. Updates the training loop made
//!    to the tensor while the round ran are kept: the delta rule.
//!
//! hivemesh never synchronizes the training stream: it makes the stream *wait on an event*
//! for the snapshot's device-side copy (a device-memory copy or cast, no PCIe), and enqueues
//! the apply kernel on it once the deltas are on the device; `step()` returns once the kernel
//! is enqueued, and the training loop's next kernels run after it, in stream order. So the
//! training stream is held for one device copy and one kernel per tensor and step. A round
//! that fails applies nothing, so the device tensor is unchanged.
//!
//! Calls made on the caller's thread (opening a device, making tensors and staging) restore
//! the thread's current CUDA context afterwards: PyTorch takes its current device from it.
//!
//! # Memory
//!
//! Per device tensor, the averager keeps one device buffer (the larger of the snapshot, which
//! is the tensor's size or half of an f32 tensor's under a 16-bit codec, and the deltas) and
//! two pinned host buffers (snapshot and deltas), allocated when the averager starts and
//! reused, so a device without room fails then, not in the middle of training.
//!
//! # Kernels
//!
//! `kernels.cu` is compiled at run time by NVRTC for the device's own architecture, to a
//! CUBIN (not PTX, which a driver older than the NVRTC library refuses). NVRTC is not part of
//! the driver: it comes with the CUDA toolkit and as the `nvidia-cuda-nvrtc-cu12` wheel
//! (which PyTorch's CUDA 12 wheels depend on; with a CUDA 13 PyTorch install it beside). The
//! `cuda-12080` build of cudarc looks for `libnvrtc.so.12` (or `libnvrtc.so`), so NVRTC 12
//! is what is found; a CUBIN from it runs on any newer driver. [`CudaDevice::open`] says what
//! is missing. Both libraries are loaded when first used, so a build with the `cuda` feature
//! runs on machines without either, and [`driver_present`] tells whether a GPU can be used.
//! The device computes exactly what the host rule does (same roundings, no fused
//! multiply-add), bit for bit except for NaN payloads.

mod delta;
mod kernels;

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig,
    PushKernelArg, result,
};

use crate::compression::{Compression, CompressionType};
use crate::tensor::{DType, Tensor, TensorError};

/// The cudarc this module is built on (its streams and contexts appear in the API).
pub use cudarc;
pub use delta::apply_reference;
pub(crate) use delta::fill_deltas;
pub use kernels::{compile_kernels, kernel_names};

/// Errors from the GPU path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver here.
    #[error("no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed?)")]
    NoDriver,
    /// NVRTC (`libnvrtc.so`), which compiles hivemesh's kernels, could not be loaded.
    #[error(
        "no NVRTC: libnvrtc could not be loaded; install the CUDA toolkit, or \
         `pip install nvidia-cuda-nvrtc-cu12` and add its nvidia/cuda_nvrtc/lib to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0:?}")]
    Driver(#[from] DriverError),
    /// NVRTC failed to compile the kernels (the log says why).
    #[error("compiling the kernels: {0}")]
    Compile(String),
    /// A tensor does not fit the request (dtype, shape, device).
    #[error(transparent)]
    Tensor(#[from] TensorError),
}

/// Whether the CUDA driver library can be loaded (without it nothing here can run; checking
/// first avoids cudarc's panic on a missing library).
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Whether the NVRTC library can be loaded (needed to compile the kernels).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Number of CUDA devices (0 without a driver).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

/// Threads per block of every kernel launch.
const THREADS: u32 = 256;
/// Most blocks of a launch (the kernels loop over the rest: grid-stride).
const MAX_BLOCKS: u64 = 4096;

fn launch_config(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(u64::from(THREADS)).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn dtype_index(d: DType) -> usize {
    match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 2,
    }
}

/// One GPU: its context, hivemesh's copy stream and the compiled kernels. Open it once and
/// share the `Arc` between the tensors on it.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    /// Device-side copies and casts of snapshots (short: the training stream waits for them).
    copy: Arc<CudaStream>,
    /// Transfers between pinned host memory and the device (the training stream never waits
    /// for them).
    pcie: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    cast_f16: CudaFunction,
    cast_bf16: CudaFunction,
    /// `[tensor dtype][delta dtype]`.
    apply: [[CudaFunction; 3]; 3],
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` (its primary context), makes the copy stream and compiles the
    /// kernels for the device's architecture. Fails with [`CudaError::NoDriver`] or
    /// [`CudaError::NoNvrtc`] where a library is missing, instead of panicking.
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        let _restore = RestoreContext::save();
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let image = compile_kernels(&format!("sm_{major}{minor}"))?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image))?;
        let f = |name: &str| module.load_function(name);
        let names = kernel_names();
        let apply = [
            [
                f(names.apply[0][0])?,
                f(names.apply[0][1])?,
                f(names.apply[0][2])?,
            ],
            [
                f(names.apply[1][0])?,
                f(names.apply[1][1])?,
                f(names.apply[1][2])?,
            ],
            [
                f(names.apply[2][0])?,
                f(names.apply[2][1])?,
                f(names.apply[2][2])?,
            ],
        ];
        Ok(Arc::new(Self {
            copy: ctx.new_stream()?,
            pcie: ctx.new_stream()?,
            cast_f16: f(names.cast_f16)?,
            cast_bf16: f(names.cast_bf16)?,
            apply,
            _module: module,
            ctx,
        }))
    }

    /// The device's context (for making streams and buffers of one's own with cudarc).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A new stream on the device (e.g. for a training loop written in Rust).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        Ok(self.ctx.new_stream()?)
    }

    /// The device's plain copy rates between pinned host memory and device memory for
    /// `bytes` (best of three copies each, timed with events on the PCIe stream), in GB/s:
    /// `(device to host, host to device)`. What the staging copies are compared against.
    pub fn measure_copy_rates(&self, bytes: usize) -> Result<(f64, f64), CudaError> {
        let _restore = RestoreContext::save();
        let bytes = bytes.max(1);
        let device = DeviceAlloc::new(&self.ctx, bytes)?;
        let mut host = PinnedAlloc::new(&self.ctx, bytes)?;
        let timed = || self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
        let (mut d2h, mut h2d) = (0.0f64, 0.0f64);
        for _ in 0..3 {
            for upload in [false, true] {
                let (a, b) = (timed()?, timed()?);
                a.record(&self.pcie)?;
                let slice = &mut host.as_mut_slice()[..bytes];
                // SAFETY: both buffers hold `bytes` bytes and outlive the copy, which is
                // waited for (elapsed_ms synchronizes `b`) before the next one.
                unsafe {
                    if upload {
                        result::memcpy_htod_async(device.ptr, &*slice, self.pcie.cu_stream())
                    } else {
                        result::memcpy_dtoh_async(slice, device.ptr, self.pcie.cu_stream())
                    }
                }?;
                b.record(&self.pcie)?;
                let ms = f64::from(a.elapsed_ms(&b)?).max(1e-6);
                let gbs = bytes as f64 / (ms / 1e3) / 1e9;
                if upload {
                    h2d = h2d.max(gbs);
                } else {
                    d2h = d2h.max(gbs);
                }
            }
        }
        Ok((d2h, h2d))
    }

    /// An event the host can wait on without spinning.
    fn blocking_event(&self) -> Result<CudaEvent, CudaError> {
        // (The flags are an enum in cudarc, so timing stays enabled: a cost only at record.)
        Ok(self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))?)
    }
}

/// Device memory hivemesh allocated (freed on drop).
struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    ptr: CUdeviceptr,
}

impl DeviceAlloc {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain allocation of `bytes.max(1)` bytes in the bound context.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
        })
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_sync` above, freed once. A `Staging` waits for its
            // streams before its buffers go; a tensor's own memory goes with its last handle
            // (cuMemFree waits for the device to finish with it).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locked host memory (freed on drop), for asynchronous copies.
struct PinnedAlloc {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain memory; who reads or writes it is governed by `&`/`&mut` as for a `Vec`.
unsafe impl Send for PinnedAlloc {}
// SAFETY: see `Send`.
unsafe impl Sync for PinnedAlloc {}

impl PinnedAlloc {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, CudaError> {
        ctx.bind_to_thread()?;
        // SAFETY: a plain page-locked allocation in the bound context.
        let ptr = unsafe { result::malloc_host(bytes.max(4), 0) }?.cast::<u8>();
        Ok(Self {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `bytes` bytes allocated above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedAlloc {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host`, freed once, no copy in flight (callers
            // wait for their copies before dropping).
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// A tensor in GPU memory: a device pointer, dtype and shape, and the *training stream* whose
/// order every access follows (see the module docs). Cloning shares the memory (a handle,
/// like an `Arc`).
#[derive(Clone)]
pub struct DeviceTensor {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    ptr: CUdeviceptr,
    dtype: DType,
    shape: Vec<usize>,
    numel: usize,
    /// Keeps the memory alive: hivemesh's own allocation, or the caller's owner.
    _owner: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for DeviceTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceTensor")
            .field("device", &self.inner.device.ctx.ordinal())
            .field("dtype", &self.inner.dtype)
            .field("shape", &self.inner.shape)
            .finish_non_exhaustive()
    }
}

fn numel_of(shape: &[usize], dtype: DType) -> Result<usize, TensorError> {
    crate::tensor::addressable_numel(shape, dtype)
        .ok_or_else(|| TensorError::Mismatch(format!("shape {shape:?} is too large")))
}

impl DeviceTensor {
    /// A tensor of zeros in memory hivemesh allocates on `device`, used in `stream`'s order.
    pub fn zeros(
        device: &Arc<CudaDevice>,
        stream: &Arc<CudaStream>,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Self, CudaError> {
        let t = Self::uninit(device, stream, shape, dtype)?;
        let _restore = RestoreContext::save();
        device.ctx.bind_to_thread()?;
        // SAFETY: the allocation holds `size_bytes`; the memset is ordered on `stream`.
        unsafe { result::memset_d8_async(t.inner.ptr, 0, t.size_bytes(), stream.cu_stream()) }?;
        Ok(t)
    }

    /// Fresh device memory for `shape` × `dtype`, not yet written.
    fn uninit(
        device: &Arc<CudaDevice>,
        stream: &Arc<CudaStream>,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Self, CudaError> {
        let numel = numel_of(shape, dtype)?;
        let _restore = RestoreContext::save();
        let alloc = DeviceAlloc::new(&device.ctx, numel * dtype.size_bytes())?;
        let ptr = alloc.ptr;
        Ok(Self::wrap(device, stream, ptr, shape, dtype, numel, alloc))
    }

    /// A device copy of a host tensor, in `stream`'s order (returns once `host` was read).
    pub fn from_host(
        device: &Arc<CudaDevice>,
        stream: &Arc<CudaStream>,
        host: &Tensor,
    ) -> Result<Self, CudaError> {
        // Every byte is written by the copy: no zeroing first.
        let t = Self::uninit(device, stream, host.shape(), host.dtype())?;
        t.copy_from_host(host)?;
        Ok(t)
    }

    /// A device tensor over memory someone else owns (a PyTorch tensor's storage, a cudarc
    /// `CudaSlice`), kept alive by `owner`.
    ///
    /// # Safety
    ///
    /// `ptr` is device memory in `device`'s context holding `shape`'s product of contiguous
    /// elements of `dtype`, valid while `owner` lives; `stream` belongs to that context, and
    /// every other user of the memory orders its work against `stream` (the training loop
    /// does, by using that stream).
    pub unsafe fn from_raw(
        device: &Arc<CudaDevice>,
        stream: &Arc<CudaStream>,
        ptr: CUdeviceptr,
        shape: &[usize],
        dtype: DType,
        owner: impl Any + Send + Sync,
    ) -> Result<Self, CudaError> {
        let numel = numel_of(shape, dtype)?;
        if numel > 0 && (ptr == 0 || !ptr.is_multiple_of(dtype.size_bytes() as u64)) {
            return Err(TensorError::Mismatch(format!(
                "device pointer {ptr:#x} is null or not aligned for {dtype}"
            ))
            .into());
        }
        Ok(Self::wrap(device, stream, ptr, shape, dtype, numel, owner))
    }

    fn wrap(
        device: &Arc<CudaDevice>,
        stream: &Arc<CudaStream>,
        ptr: CUdeviceptr,
        shape: &[usize],
        dtype: DType,
        numel: usize,
        owner: impl Any + Send + Sync,
    ) -> Self {
        Self {
            inner: Arc::new(DeviceInner {
                device: device.clone(),
                stream: stream.clone(),
                ptr,
                dtype,
                shape: shape.to_vec(),
                numel,
                _owner: Box::new(owner),
            }),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.inner.numel
    }

    /// Bytes of the elements.
    pub fn size_bytes(&self) -> usize {
        self.inner.numel * self.inner.dtype.size_bytes()
    }

    /// The device memory's address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.inner.ptr
    }

    /// The training stream whose order the tensor follows.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The device the tensor is on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.inner.device
    }

    /// A host copy of the values as of everything enqueued on the training stream so far
    /// (waits for that work and the copy; the training stream itself is not blocked).
    pub fn to_host(&self) -> Result<Tensor, CudaError> {
        let dev = &self.inner.device;
        let mut out = Tensor::zeros(&self.inner.shape, self.inner.dtype);
        if self.numel() == 0 {
            return Ok(out);
        }
        let _restore = RestoreContext::save();
        let ready = self.inner.stream.record_event(None)?;
        dev.pcie.wait(&ready)?;
        let bytes = host_bytes_mut(&mut out);
        // SAFETY: `bytes` is the tensor's `size_bytes` bytes; the copy is waited for below,
        // before `out` can move.
        unsafe { result::memcpy_dtoh_async(bytes, self.inner.ptr, dev.pcie.cu_stream()) }?;
        let done = dev.blocking_event()?;
        done.record(&dev.pcie)?;
        done.synchronize()?;
        Ok(out)
    }

    /// Overwrites the values with a host tensor's (same dtype and shape), in the training
    /// stream's order; returns once `host` was read.
    pub fn copy_from_host(&self, host: &Tensor) -> Result<(), CudaError> {
        if host.dtype() != self.dtype() || host.shape() != self.shape() {
            return Err(TensorError::Mismatch(format!(
                "host {} {:?} into device {} {:?}",
                host.dtype(),
                host.shape(),
                self.dtype(),
                self.shape()
            ))
            .into());
        }
        if self.numel() == 0 {
            return Ok(());
        }
        let _restore = RestoreContext::save();
        self.inner.device.ctx.bind_to_thread()?;
        let stream = &self.inner.stream;
        // SAFETY: the destination holds `size_bytes` bytes; from pageable memory the call
        // returns once the source was staged, and the event below makes sure it was consumed.
        unsafe {
            result::memcpy_htod_async(self.inner.ptr, host.flat().as_bytes(), stream.cu_stream())
        }?;
        let done = self.inner.device.blocking_event()?;
        done.record(stream)?;
        done.synchronize()?;
        Ok(())
    }
}

/// A host tensor's elements as bytes, writable (the tensor owns them).
fn host_bytes_mut(t: &mut Tensor) -> &mut [u8] {
    use crate::tensor::PartViewMut;
    match t.flat_mut() {
        PartViewMut::F32(s) => bytemuck::cast_slice_mut(s),
        PartViewMut::F16(s) => bytemuck::cast_slice_mut(s),
        PartViewMut::BF16(s) => bytemuck::cast_slice_mut(s),
    }
}

/// The dtype an f32 tensor leaves the device in under `compression`: the codec's 16-bit type
/// for `float16` and `bfloat16` (cast on the device), its own dtype otherwise.
pub fn snapshot_dtype(dtype: DType, numel: usize, compression: &Compression) -> DType {
    if dtype != DType::F32 {
        return dtype;
    }
    match compression.codec_for(numel).kind() {
        CompressionType::Float16 => DType::F16,
        CompressionType::BFloat16 => DType::BF16,
        _ => DType::F32,
    }
}

/// The dtype of a round's deltas: bf16 where the snapshot is bf16 (a bf16 tensor, or the
/// bfloat16 codec: the values were rounded to that precision anyway, and bf16 has f32's
/// range), f32 otherwise. Not f16: `average − snapshot` of two values within f16's range can
/// exceed it.
pub fn delta_dtype(snapshot: DType) -> DType {
    if snapshot == DType::BF16 {
        DType::BF16
    } else {
        DType::F32
    }
}

/// Restores the calling thread's current CUDA context when dropped: cudarc binds its context
/// to the thread it is called on, and PyTorch takes its current device from that.
struct RestoreContext(Option<cudarc::driver::sys::CUcontext>);

impl RestoreContext {
    fn save() -> Self {
        Self(result::ctx::get_current().ok().flatten())
    }
}

impl Drop for RestoreContext {
    fn drop(&mut self) {
        let ctx = self.0.unwrap_or(std::ptr::null_mut());
        // SAFETY: the context that was current (or none) when `save` ran, still alive: a
        // primary context is retained by whoever made it current.
        let _ = unsafe { result::ctx::set_current(ctx) };
    }
}

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

/// What a device tensor's rounds need (see the module docs): the device buffer, the pinned
/// snapshot and delta buffers, and the events ordering their reuse. An averager keeps one per
/// device tensor; code that runs rounds itself (the `bench allreduce --device cuda` workers)
/// uses it directly: [`Staging::begin_snapshot`], [`Staging::finish_snapshot`], the round on
/// the returned host tensor, [`Staging::apply`].
pub struct Staging {
    tensor: DeviceTensor,
    snapshot_dtype: DType,
    delta_dtype: DType,
    /// Holds the snapshot on the device, then the deltas.
    device_buf: DeviceAlloc,
    /// Shared with the round's snapshot tensor while a round runs.
    host_snapshot: Arc<PinnedAlloc>,
    host_delta: PinnedAlloc,
    /// Recorded on the PCIe stream after the snapshot's host copy (shared with a round's
    /// [`SnapshotCopy`] while the round waits for it).
    snapped: Option<Arc<CudaEvent>>,
    /// Recorded on the PCIe stream after the deltas' upload.
    uploaded: Option<CudaEvent>,
    /// Recorded on the training stream after the last apply kernel (it reads `device_buf`).
    applied: Option<CudaEvent>,
    /// Timing events on the training stream around its wait for the snapshot and around the
    /// apply kernel ([`Staging::set_timing`]).
    timing: bool,
    held: Option<(CudaEvent, CudaEvent)>,
    kernel: Option<(CudaEvent, CudaEvent)>,
}

impl Staging {
    /// Staging for `tensor` under `compression`, its buffers allocated now (so that a full
    /// device fails here, not in the middle of training).
    pub fn new(tensor: DeviceTensor, compression: &Compression) -> Result<Self, CudaError> {
        let _restore = RestoreContext::save();
        let snapshot_dtype = snapshot_dtype(tensor.dtype(), tensor.numel(), compression);
        let delta_dtype = delta_dtype(snapshot_dtype);
        let n = tensor.numel();
        let ctx = &tensor.inner.device.ctx;
        let snap_bytes = n * snapshot_dtype.size_bytes();
        let delta_bytes = n * delta_dtype.size_bytes();
        Ok(Self {
            device_buf: DeviceAlloc::new(ctx, snap_bytes.max(delta_bytes))?,
            host_snapshot: Arc::new(PinnedAlloc::new(ctx, snap_bytes)?),
            host_delta: PinnedAlloc::new(ctx, delta_bytes)?,
            snapshot_dtype,
            delta_dtype,
            tensor,
            snapped: None,
            uploaded: None,
            applied: None,
            timing: false,
            held: None,
            kernel: None,
        })
    }

    /// Records timing events on the training stream from now on (for benchmarks; see
    /// [`Staging::stream_times_ms`]).
    pub fn set_timing(&mut self, on: bool) {
        self.timing = on;
    }

    /// With timing on, what the training stream spent in the last round, in milliseconds:
    /// `(waiting for the snapshot's device-side copy, running the apply kernel)` (waits for
    /// both). Measured with events around the wait and the kernel, so on a busy training
    /// stream the first is an upper bound of the hold (it includes the stream's own work
    /// enqueued before the wait that had not finished).
    pub fn stream_times_ms(&self) -> Result<Option<(f64, f64)>, CudaError> {
        let ms = |pair: &Option<(CudaEvent, CudaEvent)>| -> Result<f64, CudaError> {
            Ok(match pair {
                Some((a, b)) => f64::from(a.elapsed_ms(b)?),
                None => 0.0,
            })
        };
        if !self.timing {
            return Ok(None);
        }
        Ok(Some((ms(&self.held)?, ms(&self.kernel)?)))
    }

    fn timed(stream: &CudaStream) -> Result<CudaEvent, CudaError> {
        Ok(stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Starts the snapshot (step 1 of the module docs); [`Staging::finish_snapshot`] waits
    /// for it.
    pub fn begin_snapshot(&mut self) -> Result<(), CudaError> {
        let t = &self.tensor.inner;
        let dev = &t.device;
        let n = t.numel;
        dev.ctx.bind_to_thread()?;
        let snap_bytes = n * self.snapshot_dtype.size_bytes();
        // The pinned snapshot is reused unless a round still holds it (then a fresh one).
        if Arc::strong_count(&self.host_snapshot) > 1 {
            self.host_snapshot = Arc::new(PinnedAlloc::new(&dev.ctx, snap_bytes)?);
        }
        let buf = self.device_buf.ptr;
        // The copy stream waits for the training loop's work so far, for the last apply
        // kernel to have read the device buffer, and for any transfer of it still in flight
        // (a round that stopped before finishing its snapshot or applying its upload).
        dev.copy.wait(&t.stream.record_event(None)?)?;
        for pending in [&self.applied, &self.uploaded].into_iter().flatten() {
            dev.copy.wait(pending)?;
        }
        if let Some(snapped) = &self.snapped {
            dev.copy.wait(snapped)?;
        }
        self.uploaded = None;
        if n > 0 {
            if self.snapshot_dtype == t.dtype {
                // SAFETY: both buffers hold `snap_bytes` bytes; ordered on the copy stream.
                unsafe { result::memcpy_dtod_async(buf, t.ptr, snap_bytes, dev.copy.cu_stream()) }?;
            } else {
                let cast = if self.snapshot_dtype == DType::F16 {
                    &dev.cast_f16
                } else {
                    &dev.cast_bf16
                };
                let n64 = n as u64;
                let mut launch = dev.copy.launch_builder(cast);
                launch.arg(&t.ptr).arg(&buf).arg(&n64);
                // SAFETY: `hm_cast_f32_*(const float*, u16*, u64)`: `n` f32 in, `n` u16 out.
                unsafe { launch.launch(launch_config(n)) }?;
            }
        }
        // The training stream waits for the device-side copy only; the host copy runs on the
        // PCIe stream, so no tensor's transfer holds the training stream up.
        let copied = dev.copy.record_event(None)?;
        let before = self.timing.then(|| Self::timed(&t.stream)).transpose()?;
        t.stream.wait(&copied)?;
        if let Some(before) = before {
            self.held = Some((before, Self::timed(&t.stream)?));
        }
        dev.pcie.wait(&copied)?;
        if n > 0 {
            let host = Arc::get_mut(&mut self.host_snapshot)
                .ok_or_else(|| TensorError::Mismatch("snapshot buffer in use".into()))?;
            // SAFETY: `host` holds `snap_bytes` bytes and stays allocated and untouched until
            // `snapped` completes (finish_snapshot waits for it before handing it out, and the
            // next begin_snapshot orders its copies after it).
            unsafe {
                result::memcpy_dtoh_async(
                    &mut host.as_mut_slice()[..snap_bytes],
                    buf,
                    dev.pcie.cu_stream(),
                )
            }?;
        }
        let snapped = dev.blocking_event()?;
        snapped.record(&dev.pcie)?;
        self.snapped = Some(Arc::new(snapped));
        Ok(())
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
        let snapped = self
            .snapped
            .clone()
            .ok_or_else(|| TensorError::Mismatch("no snapshot was started".into()))?;
        let host = self.host_snapshot.clone();
        let ptr = host.ptr;
        // SAFETY: the pinned buffer will hold the snapshot's elements once `snapped`
        // completes, which the caller waits for before reading them; aligned (page-locked
        // allocations are page aligned), kept alive by `host`; nothing else writes it while
        // the tensor lives (begin_snapshot takes a fresh buffer then).
        let tensor =
            unsafe { Tensor::from_external(self.tensor.shape(), self.snapshot_dtype, ptr, host) }?;
        Ok((tensor, SnapshotCopy { event: snapped }))
    }

    /// Waits for the snapshot's copy to the host (blocking); the snapshot is then complete and
    /// the next apply may upload. Without a snapshot in flight, returns at once.
    pub fn wait_snapshot(&mut self) -> Result<(), CudaError> {
        if let Some(snapped) = self.snapped.take() {
            let _restore = RestoreContext::save();
            snapped.synchronize()?;
        }
        Ok(())
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
    /// their upload on the PCIe stream. Returns whether there is anything to apply (an aux
    /// peer's outcome has nothing).
    pub fn upload(
        &mut self,
        outcome: &crate::allreduce::Outcome,
        index: usize,
        start: &Tensor,
    ) -> Result<bool, CudaError> {
        let t = &self.tensor.inner;
        let dev = &t.device;
        let n = t.numel;
        self.uploaded = None;
        if outcome.results.is_none() || n == 0 {
            return Ok(false);
        }
        if self.snapped.is_some() {
            return Err(TensorError::Mismatch("upload before the snapshot finished".into()).into());
        }
        dev.ctx.bind_to_thread()?;
        let delta_bytes = n * self.delta_dtype.size_bytes();
        let host = &mut self.host_delta.as_mut_slice()[..delta_bytes];
        fill_deltas(outcome, index, start, self.delta_dtype, host)
            .map_err(|e| TensorError::Mismatch(e.to_string()))?;
        // SAFETY: the device buffer holds at least `delta_bytes`, and its snapshot was read
        // (finish_snapshot waited for the host copy); the host buffer is not written again
        // before `uploaded` completes (launch_apply waits for it, and the next upload follows
        // the next snapshot, which the copy stream orders after it).
        unsafe { result::memcpy_htod_async(self.device_buf.ptr, &*host, dev.pcie.cu_stream()) }?;
        let uploaded = dev.blocking_event()?;
        uploaded.record(&dev.pcie)?;
        self.uploaded = Some(uploaded);
        Ok(true)
    }

    /// Waits (blocking) for [`Staging::upload`]'s copy, then enqueues the apply kernel on
    /// the training stream: the training stream never waits for the upload, it only runs the
    /// kernel. Does nothing when the last upload had nothing to apply.
    pub fn launch_apply(&mut self, alpha: f32) -> Result<(), CudaError> {
        let Some(uploaded) = self.uploaded.take() else {
            // Nothing was uploaded (an aux peer's or an empty tensor's round).
            return Ok(());
        };
        uploaded.synchronize()?;
        let t = &self.tensor.inner;
        let dev = &t.device;
        let buf = self.device_buf.ptr;
        let f = &dev.apply[dtype_index(t.dtype)][dtype_index(self.delta_dtype)];
        let n64 = t.numel as u64;
        let before = self.timing.then(|| Self::timed(&t.stream)).transpose()?;
        let mut launch = t.stream.launch_builder(f);
        launch.arg(&t.ptr).arg(&buf).arg(&alpha).arg(&n64);
        // SAFETY: `hm_apply_T_D(T*, const D*, float, u64)` over `numel` elements of both; the
        // deltas are in `buf` (the upload completed above).
        unsafe { launch.launch(launch_config(t.numel)) }?;
        if let Some(before) = before {
            self.kernel = Some((before, Self::timed(&t.stream)?));
        }
        let applied = dev.ctx.new_event(None)?;
        applied.record(&t.stream)?;
        self.applied = Some(applied);
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The buffers are freed only after the work that uses them.
        let dev = &self.tensor.inner.device;
        let _ = dev.copy.synchronize();
        let _ = dev.pcie.synchronize();
        if let Some(applied) = &self.applied {
            let _ = applied.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::allreduce::{Outcome, PartResult, PartSpec};

    /// Device 0, or `None` (after saying so) without a GPU; `HIVEMESH_GPU_REQUIRED` makes a
    /// missing GPU a failure.
    fn gpu() -> Option<Arc<CudaDevice>> {
        if device_count() == 0 {
            assert!(
                std::env::var_os("HIVEMESH_GPU_REQUIRED").is_none(),
                "a GPU is required (HIVEMESH_GPU_REQUIRED) but none was found"
            );
            println!("skipped: no CUDA device here");
            return None;
        }
        Some(CudaDevice::open(0).expect("opening device 0"))
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
