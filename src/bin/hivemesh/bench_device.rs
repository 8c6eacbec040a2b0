//! `bench allreduce --device cuda`: the worker's tensor lives on the GPU (device 0); each round
//! snapshots it to pinned host memory, runs the round on the host copy and applies the result
//! on the device (`hivemesh::cuda::Staging`), as an averager does for a device tensor.
//!
//! Per round a worker reports, besides the round time (snapshot + round + apply): the staging
//! copy's throughput (snapshot bytes over the time from starting the snapshot to having it on
//! the host), the time the training stream was held (its wait for the snapshot's device-side
//! copy plus the apply kernel, timed by `Staging` with events around the two) and the apply
//! kernel's time. Once, before the rounds: the device's plain pinned copy rates.

/// The bench's device: on the CPU, or CUDA device 0.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host tensors.
    Cpu,
    /// A tensor on CUDA device 0 (needs a build with `--features cuda`).
    Cuda,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

/// What one device round measured.
pub struct DeviceTimes {
    pub staging_s: f64,
    pub blocked_ms: f64,
    pub apply_ms: f64,
}

#[cfg(feature = "cuda")]
mod imp {
    use std::time::Instant;

    use anyhow::Context;
    use hivemesh::allreduce::Outcome;
    use hivemesh::compression::Compression;
    use hivemesh::cuda::{CudaDevice, DeviceTensor, Staging};
    use hivemesh::tensor::Tensor;

    /// A worker's device tensor and its staging.
    pub struct Gpu {
        tensor: DeviceTensor,
        staging: Staging,
        /// `(device to host, host to device)` plain copy rates, GB/s.
        pub copy_rates: (f64, f64),
    }

    impl Gpu {
        pub fn open(host: &Tensor, compression: &Compression) -> anyhow::Result<Self> {
            super::check_device()?;
            let dev = CudaDevice::open(0).context("--device cuda")?;
            let stream = dev.new_stream()?;
            let tensor = DeviceTensor::from_host(&dev, &stream, host)?;
            let copy_rates = dev.measure_copy_rates(tensor.size_bytes())?;
            let mut staging = Staging::new(tensor.clone(), compression)?;
            staging.set_timing(true);
            Ok(Self {
                staging,
                tensor,
                copy_rates,
            })
        }

        /// Starts and finishes the snapshot: the round's host tensor, and the staging time.
        pub fn snapshot(&mut self) -> anyhow::Result<(Tensor, f64)> {
            let started = Instant::now();
            self.staging.begin_snapshot()?;
            let snapshot = self.staging.finish_snapshot()?;
            Ok((snapshot, started.elapsed().as_secs_f64()))
        }

        /// Applies the round's result on the device; the round's device times.
        pub fn apply(
            &mut self,
            outcome: &Outcome,
            start: &Tensor,
            staging_s: f64,
        ) -> anyhow::Result<super::DeviceTimes> {
            self.staging.apply(outcome, 0, start, 1.0)?;
            // Events around the training stream's wait and the kernel (Staging's own).
            let (held_ms, apply_ms) = self
                .staging
                .stream_times_ms()?
                .context("staging timing is off")?;
            Ok(super::DeviceTimes {
                staging_s,
                blocked_ms: held_ms + apply_ms,
                apply_ms,
            })
        }

        /// The device tensor's values now.
        pub fn values(&self) -> anyhow::Result<Vec<f32>> {
            Ok(self.tensor.to_host()?.to_f32_vec())
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use hivemesh::allreduce::Outcome;
    use hivemesh::compression::Compression;
    use hivemesh::tensor::Tensor;

    /// No device without the `cuda` feature: never constructed.
    pub enum Gpu {}

    impl Gpu {
        pub fn open(_: &Tensor, _: &Compression) -> anyhow::Result<Self> {
            anyhow::bail!(super::NO_CUDA)
        }

        pub fn snapshot(&mut self) -> anyhow::Result<(Tensor, f64)> {
            match *self {}
        }

        pub fn apply(
            &mut self,
            _: &Outcome,
            _: &Tensor,
            _: f64,
        ) -> anyhow::Result<super::DeviceTimes> {
            match *self {}
        }

        pub fn values(&self) -> anyhow::Result<Vec<f32>> {
            match *self {}
        }
    }
}

pub use imp::Gpu;

/// Bytes of an f32 tensor's snapshot of `elements` under `compression` (16-bit words under a
/// 16-bit codec: [`hivemesh::cuda::snapshot_dtype`]).
#[cfg(feature = "cuda")]
pub fn snapshot_bytes(elements: usize, compression: &hivemesh::compression::Compression) -> usize {
    let dtype = hivemesh::cuda::snapshot_dtype(hivemesh::tensor::DType::F32, elements, compression);
    elements * dtype.size_bytes()
}

/// Without the `cuda` feature there is no device run to size (`--device cuda` is refused).
#[cfg(not(feature = "cuda"))]
pub fn snapshot_bytes(elements: usize, _: &hivemesh::compression::Compression) -> usize {
    elements * 4
}

/// `Ok` where a CUDA device can be used; else the error, naming the driver's result where
/// the driver library loads but fails.
#[cfg(feature = "cuda")]
pub fn check_device() -> anyhow::Result<()> {
    hivemesh::cuda::device_count()
        .map(drop)
        .map_err(|e| anyhow::anyhow!("--device cuda: no CUDA device here ({e})"))
}

/// What the `hivemesh_device` line says about NVRTC: `nvrtc=MAJOR.MINOR nvrtc_lib=PATH` (the
/// library the workers compile their kernels with, found as they find it), or why none.
#[cfg(feature = "cuda")]
pub fn nvrtc_summary() -> String {
    match hivemesh::cuda::nvrtc_info() {
        Ok(n) => format!(
            "nvrtc={}.{} nvrtc_lib={}",
            n.version.0,
            n.version.1,
            n.path.as_deref().unwrap_or(&n.name)
        ),
        Err(e) => format!("nvrtc=none ({e})"),
    }
}

/// Without the `cuda` feature there is no NVRTC to name (and `--device cuda` is refused).
#[cfg(not(feature = "cuda"))]
pub fn nvrtc_summary() -> String {
    "nvrtc=none (built without the cuda feature)".to_owned()
}

/// The error for `--device cuda` in a build without the `cuda` feature.
pub const NO_CUDA: &str = "--device cuda needs hivemesh built with the cuda feature \
                           (cargo build --release --features cuda)";

impl Gpu {
    /// `(device to host, host to device)` plain copy rates in GB/s.
    pub fn rates(&self) -> (f64, f64) {
        #[cfg(feature = "cuda")]
        return self.copy_rates;
        #[cfg(not(feature = "cuda"))]
        match *self {}
    }
}
