//! GPU tensors (the `cuda` feature): an averager averages tensors that live on a CUDA device
//! in place, and the training loop's stream runs only two short device-side operations of
//! hivemesh's per step.
//!
//! # A round, for one device tensor
//!
//! Two streams take part: the *training stream* the tensor was handed over with (the one the
//! training loop launches its kernels on), and the device's *PCIe stream*, hivemesh's own, for
//! transfers to and from the host. What is enqueued where, and which event orders it, is a
//! plan ([`plan`](self) module `plan`, tested against a happens-before model without a GPU).
//!
//! 1. **Snapshot** ([`Staging::begin_snapshot`], as soon as the group is known, before the
//!    links are made): one operation *on the training stream* copies the tensor into a device
//!    buffer of the averager's (for an f32 tensor whose codec is `float16` or `bfloat16`, a
//!    cast kernel writes the codec's 16-bit words instead, rounded and saturated as the codec
//!    does, so that the round moves half the bytes across PCIe too), and an event is recorded
//!    after it. Being one operation in the training stream's order, the snapshot is one point
//!    of it, whichever thread enqueues it: the training loop's kernels enqueued before it are
//!    in it, those enqueued after it are not. The PCIe stream waits for that event and copies
//!    the buffer into pinned host memory, overlapped with linking to the group; the training
//!    stream never waits for PCIe.
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
//!    stream uploads it into the device buffer, after the previous apply kernel (which read
//!    that buffer) is done, and the host waits for the upload (off the runtime's threads);
//!    then one kernel on the training stream, `tensor += alpha · delta`, computed in f32 and
//!    rounded once to the tensor's dtype. Updates the training loop made to the tensor while
//!    the round ran are kept: the delta rule.
//!
//! hivemesh never synchronizes the training stream: per step it enqueues one device copy (or
//! cast) and one kernel per tensor on it; `step()` returns once the kernel is enqueued, and
//! the training loop's next kernels run after it, in stream order. (The training stream waits
//! on an event of the PCIe stream only where a round was abandoned with a transfer of the
//! device buffer still in flight.) A round that fails applies nothing, so the device tensor
//! is unchanged. The ordering is against *that one stream*: work the training loop enqueues
//! on other streams must be ordered against it by the caller (see the README's Python
//! section).
//!
//! Calls made on the caller's thread (opening a device, making tensors and staging, waits)
//! restore the thread's current CUDA context afterwards, and so do the drops of hivemesh's
//! CUDA objects: PyTorch takes its current device from it.
//!
//! # Memory
//!
//! Per device tensor, the averager keeps one device buffer (the larger of the snapshot, which
//! is the tensor's size or half of an f32 tensor's under a 16-bit codec, and the deltas) and
//! pinned host buffers for the snapshot (one, or two alternating where a round still holds
//! last round's when the next snapshot starts) and the deltas, allocated when the averager
//! starts (or, the second snapshot buffer, once) and reused, so a device without room fails
//! then, not in the middle of training. Freeing CUDA memory synchronizes the device, so it
//! happens on a thread of hivemesh's, the device's *reaper*, never on the thread that drops
//! the last handle (`memory` module).
//!
//! # Kernels
//!
//! `kernels.cu` is compiled at run time by NVRTC for the device's own architecture, to a
//! CUBIN (not PTX, which a driver older than the NVRTC library refuses; PTX only for a device
//! newer than every architecture the NVRTC knows: [`device_target`]). NVRTC is not part of
//! the driver: it comes with the CUDA toolkit and as the `nvidia-cuda-nvrtc-cu12` wheel. hivemesh
//! loads it itself ([`nvrtc_info`] says which it loaded, [`NVRTC_ENV`] names one): versioned
//! names first, the driver's major version first, and never an NVRTC newer than the driver
//! (its CUBINs would not load). [`CudaDevice::open`] says what is missing. Both libraries are
//! loaded when first used, so a build with the `cuda` feature runs on machines without
//! either; [`device_count`] tells whether a GPU can be used, and only a missing driver
//! library means "no GPU" (any other driver error is reported with its `CUresult`). The
//! device computes exactly what the host rule does (same roundings, no fused multiply-add),
//! bit for bit except for NaN payloads.

mod delta;
mod kernels;
mod memory;
mod nvrtc;
mod plan;
mod probe;
mod staging;

use std::any::Any;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUevent_flags, CUresult};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DriverError, LaunchConfig, result,
};

use crate::compression::{Compression, CompressionType};
use crate::tensor::{DType, Tensor, TensorError};
use memory::{CudaReaper, DeviceAlloc, PinnedAlloc};

/// The cudarc this module is built on (its streams and contexts appear in the API).
pub use cudarc;
pub use delta::apply_reference;
pub(crate) use delta::fill_deltas;
pub use kernels::{KernelImage, compile_kernels, kernel_names};
pub use nvrtc::{
    ARCHITECTURES, KernelTarget, NVRTC_ENV, NvrtcInfo, device_target, library_candidates,
    nvrtc_info, target_archs, version_fits_driver,
};
pub use probe::{
    GPU_REQUIRED_ENV, classify_probe, device_count, gpu_test_gate, gpu_test_gate_here,
};
pub use staging::{SnapshotCopy, Staging};

/// Errors from the GPU path.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The CUDA driver library (`libcuda.so`) could not be loaded: no NVIDIA driver here.
    #[error("no CUDA driver: libcuda could not be loaded (is an NVIDIA driver installed?)")]
    NoDriver,
    /// The driver library loaded but the driver cannot be used: `call` returned `result`
    /// (a toolkit's stub `libcuda.so` on the library path, a driver that does not match its
    /// kernel module, no device visible).
    #[error(
        "the CUDA driver cannot be used: {call} returned {result:?} ({code}); a stub \
         libcuda.so on the library path, a driver/kernel-module mismatch or hidden devices?",
        code = *result as u32
    )]
    DriverInit {
        /// The driver call that failed.
        call: &'static str,
        /// What it returned.
        result: CUresult,
    },
    /// No usable NVRTC (which compiles hivemesh's kernels): each candidate and why not.
    #[error(
        "no usable NVRTC ({0}); install the CUDA toolkit, or `pip install \
         nvidia-cuda-nvrtc-cu12` and add its nvidia/cuda_nvrtc/lib to LD_LIBRARY_PATH (or set \
         HIVEMESH_NVRTC to its libnvrtc.so.12)"
    )]
    NoNvrtc(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0:?}")]
    Driver(#[from] DriverError),
    /// NVRTC failed to compile the kernels, or the device cannot run what it compiles (the
    /// message names the NVRTC version, with its log).
    #[error("compiling the kernels: {0}")]
    Compile(String),
    /// The thread that frees CUDA memory could not be started.
    #[error("starting the thread that frees CUDA memory: {0}")]
    Reaper(std::io::Error),
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

/// Whether a usable NVRTC can be loaded (needed to compile the kernels; [`nvrtc_info`] says
/// which, or why none).
pub fn nvrtc_present() -> bool {
    nvrtc_info().is_ok()
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

/// One GPU: its context, hivemesh's PCIe stream, the compiled kernels and the thread that
/// frees memory. Open it once and share the `Arc` between the tensors on it.
pub struct CudaDevice {
    parts: Restoring<DeviceParts>,
}

/// What a [`CudaDevice`] holds (dropped with the caller's context restored).
struct DeviceParts {
    ctx: Arc<CudaContext>,
    /// Transfers between pinned host memory and the device (the training stream never waits
    /// for them).
    pcie: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    cast_f16: CudaFunction,
    cast_bf16: CudaFunction,
    /// `[tensor dtype][delta dtype]`.
    apply: [[CudaFunction; 3]; 3],
    /// What the kernels were compiled to, by which NVRTC.
    target: KernelTarget,
    nvrtc: NvrtcInfo,
    /// Frees hivemesh's device and pinned memory off the data path.
    reaper: Arc<CudaReaper>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.parts.ctx.ordinal())
            .field("target", &self.parts.target)
            .field("nvrtc", &self.parts.nvrtc.to_string())
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Opens device `ordinal` (its primary context), makes the PCIe stream and compiles the
    /// kernels for the device's architecture with the NVRTC [`nvrtc_info`] names. Fails with
    /// [`CudaError::NoDriver`] or [`CudaError::NoNvrtc`] where a library is missing, instead
    /// of panicking, and with [`CudaError::Compile`] (naming the NVRTC version) where NVRTC
    /// cannot compile for the device.
    pub fn open(ordinal: usize) -> Result<Arc<Self>, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let nvrtc = nvrtc_info()?;
        let _restore = RestoreContext::save();
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let cc = u32::try_from(major * 10 + minor).unwrap_or(0);
        let target = device_target(cc, &nvrtc.archs)
            .map_err(|e| CudaError::Compile(format!("{nvrtc}: {e}")))?;
        let image = match compile_kernels(target)? {
            KernelImage::Cubin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes),
            KernelImage::Ptx(text) => cudarc::nvrtc::Ptx::from_src(text),
        };
        let module = ctx
            .load_module(image)
            .map_err(|e| CudaError::Compile(format!("{nvrtc}, {target:?}: loading: {e:?}")))?;
        let f = |name: &str| module.load_function(name);
        let names = kernel_names();
        let row = |r: [&str; 3]| -> Result<[CudaFunction; 3], DriverError> {
            Ok([f(r[0])?, f(r[1])?, f(r[2])?])
        };
        let apply = [
            row(names.apply[0])?,
            row(names.apply[1])?,
            row(names.apply[2])?,
        ];
        Ok(Arc::new(Self {
            parts: Restoring::new(DeviceParts {
                pcie: ctx.new_stream()?,
                cast_f16: f(names.cast_f16)?,
                cast_bf16: f(names.cast_bf16)?,
                apply,
                _module: module,
                target,
                nvrtc,
                reaper: memory::start_reaper(ordinal)?,
                ctx,
            }),
        }))
    }

    /// The device's context (for making streams and buffers of one's own with cudarc).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.parts.ctx
    }

    /// What the kernels were compiled to.
    pub fn kernel_target(&self) -> KernelTarget {
        self.parts.target
    }

    /// The NVRTC that compiled them.
    pub fn nvrtc(&self) -> &NvrtcInfo {
        &self.parts.nvrtc
    }

    /// A new stream on the device (e.g. for a training loop written in Rust).
    pub fn new_stream(&self) -> Result<Arc<CudaStream>, CudaError> {
        let _restore = RestoreContext::save();
        Ok(self.parts.ctx.new_stream()?)
    }

    /// The device's plain copy rates between pinned host memory and device memory for
    /// `bytes` (best of three copies each, timed with events on the PCIe stream), in GB/s:
    /// `(device to host, host to device)`. What the staging copies are compared against.
    pub fn measure_copy_rates(&self, bytes: usize) -> Result<(f64, f64), CudaError> {
        let _restore = RestoreContext::save();
        let bytes = bytes.max(1);
        let device = DeviceAlloc::new(&self.parts.ctx, &self.parts.reaper, bytes)?;
        let mut host = PinnedAlloc::new(&self.parts.ctx, &self.parts.reaper, bytes)?;
        let timed = || {
            self.parts
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        };
        let (mut d2h, mut h2d) = (0.0f64, 0.0f64);
        for _ in 0..3 {
            for upload in [false, true] {
                let (a, b) = (timed()?, timed()?);
                a.record(&self.parts.pcie)?;
                let slice = &mut host.as_mut_slice()[..bytes];
                // SAFETY: both buffers hold `bytes` bytes and outlive the copy, which is
                // waited for (elapsed_ms synchronizes `b`) before the next one.
                unsafe {
                    if upload {
                        result::memcpy_htod_async(device.ptr, &*slice, self.parts.pcie.cu_stream())
                    } else {
                        result::memcpy_dtoh_async(slice, device.ptr, self.parts.pcie.cu_stream())
                    }
                }?;
                b.record(&self.parts.pcie)?;
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
            .parts
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))?)
    }
}

/// A tensor in GPU memory: a device pointer, dtype and shape, and the *training stream* whose
/// order every access follows (see the module docs). Cloning shares the memory (a handle,
/// like an `Arc`).
#[derive(Clone)]
pub struct DeviceTensor {
    inner: Arc<Restoring<DeviceInner>>,
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
            .field("device", &self.inner.device.parts.ctx.ordinal())
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
        device.parts.ctx.bind_to_thread()?;
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
        let alloc = DeviceAlloc::new(
            &device.parts.ctx,
            &device.parts.reaper,
            numel * dtype.size_bytes(),
        )?;
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
            inner: Arc::new(Restoring::new(DeviceInner {
                device: device.clone(),
                stream: stream.clone(),
                ptr,
                dtype,
                shape: shape.to_vec(),
                numel,
                _owner: Box::new(owner),
            })),
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
        dev.parts.pcie.wait(&ready)?;
        let bytes = host_bytes_mut(&mut out);
        // SAFETY: `bytes` is the tensor's `size_bytes` bytes; the copy is waited for below,
        // before `out` can move.
        unsafe { result::memcpy_dtoh_async(bytes, self.inner.ptr, dev.parts.pcie.cu_stream()) }?;
        let done = dev.blocking_event()?;
        done.record(&dev.parts.pcie)?;
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
        self.inner.device.parts.ctx.bind_to_thread()?;
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

/// Saving and restoring the calling thread's current context, around something that binds
/// another one.
trait ContextGuard {
    /// Saves the thread's current context; dropping the guard makes it current again.
    fn save() -> Self;
}

/// Restores the calling thread's current CUDA context when dropped: cudarc binds its context
/// to the thread it is called on, and PyTorch takes its current device from that.
struct RestoreContext(Option<cudarc::driver::sys::CUcontext>);

impl RestoreContext {
    fn save() -> Self {
        <Self as ContextGuard>::save()
    }
}

impl ContextGuard for RestoreContext {
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

/// A `T` whose drop runs with the dropping thread's current context saved and restored:
/// cudarc binds its context when it destroys a stream, event or module, or releases a
/// context, and a drop of a tensor or device may happen on the training thread.
struct Restoring<T, G: ContextGuard = RestoreContext> {
    value: ManuallyDrop<T>,
    _guard: std::marker::PhantomData<fn() -> G>,
}

impl<T, G: ContextGuard> Restoring<T, G> {
    fn new(value: T) -> Self {
        Self {
            value: ManuallyDrop::new(value),
            _guard: std::marker::PhantomData,
        }
    }
}

impl<T, G: ContextGuard> Deref for Restoring<T, G> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T, G: ContextGuard> Drop for Restoring<T, G> {
    fn drop(&mut self) {
        let _guard = G::save();
        // SAFETY: dropped once, here; never used again.
        unsafe { ManuallyDrop::drop(&mut self.value) };
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    thread_local! {
        /// A stand-in for the driver's per-thread current context.
        static CURRENT: Cell<u32> = const { Cell::new(0) };
    }

    struct FakeGuard(u32);

    impl ContextGuard for FakeGuard {
        fn save() -> Self {
            Self(CURRENT.get())
        }
    }

    impl Drop for FakeGuard {
        fn drop(&mut self) {
            CURRENT.set(self.0);
        }
    }

    /// Binds context 7, as cudarc's drops bind theirs, and says what was current when it ran.
    struct Binds<'a>(&'a Cell<Option<u32>>);

    impl Drop for Binds<'_> {
        fn drop(&mut self) {
            self.0.set(Some(CURRENT.get()));
            CURRENT.set(7);
        }
    }

    #[test]
    fn a_drop_puts_the_threads_context_back() {
        let seen = Cell::new(None);
        CURRENT.set(3);
        drop(Restoring::<_, FakeGuard>::new(Binds(&seen)));
        // The value was dropped (under the guard), and the thread's context is 3 again.
        assert_eq!(seen.get(), Some(3));
        assert_eq!(CURRENT.get(), 3);
        // Without the wrapper the binding leaks, which is what the wrapper is for.
        drop(Binds(&seen));
        assert_eq!(CURRENT.get(), 7);
    }
}
