//! PyTorch CUDA tensors as hivemesh device tensors, through DLPack (the `cuda` feature).
//!
//! `tensor.detach().__dlpack__(stream=S)` with `S` the tensor's device's current stream (as
//! DLPack numbers it: 1 for the legacy default stream, else the `cudaStream_t`), so PyTorch
//! makes its pending work visible on `S`; the capsule's `DLManagedTensor` is taken over
//! (the capsule renamed `used_dltensor`, as the protocol asks) and checked by
//! [`hivemesh::tensor::dlpack::import`]; the averager then orders all its work on `S`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use hivemesh::cuda::cudarc::driver::sys::CUstream;
use hivemesh::cuda::{CudaDevice, DeviceTensor};
use hivemesh::tensor::dlpack::{self, Device};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

/// One opened device per index, shared by every tensor on it.
fn device(index: usize) -> Result<Arc<CudaDevice>, String> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let mut devices = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(d) = devices.get(&index) {
        return Ok(d.clone());
    }
    let d = CudaDevice::open(index).map_err(|e| format!("CUDA device {index}: {e}"))?;
    devices.insert(index, d.clone());
    Ok(d)
}

/// A CUDA `torch.Tensor` as a [`DeviceTensor`] over its memory (shared, not copied).
pub fn device_tensor(obj: &Bound<'_, PyAny>) -> Result<DeviceTensor, String> {
    let py = obj.py();
    let e = |e: PyErr| e.to_string();
    let index: usize = obj
        .getattr("device")
        .and_then(|d| d.getattr("index"))
        .and_then(|i| i.extract::<Option<usize>>())
        .map_err(e)?
        .unwrap_or(0);
    let stream: usize = py
        .import("torch")
        .and_then(|t| t.getattr("cuda"))
        .and_then(|c| c.call_method1("current_stream", (index,)))
        .and_then(|s| s.getattr("cuda_stream"))
        .and_then(|s| s.extract())
        .map_err(e)?;
    let kwargs = PyDict::new(py);
    // DLPack's numbering: 0 is not allowed, 1 is the legacy default stream.
    kwargs
        .set_item("stream", if stream == 0 { 1 } else { stream })
        .map_err(e)?;
    let capsule = obj
        .call_method0("detach")
        .and_then(|d| d.call_method("__dlpack__", (), Some(&kwargs)))
        .map_err(e)?;
    let capsule = capsule
        .cast_into::<PyCapsule>()
        .map_err(|_| "__dlpack__ did not return a capsule".to_owned())?;
    let managed = capsule.pointer_checked(Some(c"dltensor")).map_err(|_| {
        "__dlpack__ returned a capsule that is not an unused \"dltensor\"".to_owned()
    })?;
    // SAFETY: a live capsule; renaming it hands the DLManagedTensor's ownership to us (its
    // destructor then leaves it alone), as the DLPack protocol prescribes for consumers.
    if unsafe { pyo3::ffi::PyCapsule_SetName(capsule.as_ptr(), c"used_dltensor".as_ptr()) } != 0 {
        return Err(PyErr::fetch(py).to_string());
    }
    // SAFETY: the capsule's DLManagedTensor, whose ownership we just took.
    let imported = unsafe { dlpack::import(managed.as_ptr().cast()) }.map_err(|e| e.to_string())?;
    if imported.device != Device::Cuda(index) {
        return Err(format!(
            "DLPack says the tensor is on {:?}, torch says cuda:{index}",
            imported.device
        ));
    }
    let dev = device(index)?;
    // SAFETY: torch's current stream of this device, in its primary context (the one
    // `CudaDevice::open` retains); PyTorch keeps its streams alive for the process.
    let stream = unsafe { dev.context().wrap_borrowed_stream(stream as CUstream) };
    let (address, shape, dtype) = (imported.address, imported.shape.clone(), imported.dtype);
    // SAFETY: `address` is the first of `shape`'s elements of `dtype`, contiguous, in this
    // device's memory (checked by `import` and above); the managed tensor (and the tensor
    // object, for good measure) keep it alive; the training loop orders its work on `stream`.
    unsafe {
        DeviceTensor::from_raw(
            &dev,
            &stream,
            address as u64,
            &shape,
            dtype,
            (imported.owner, obj.clone().unbind()),
        )
    }
    .map_err(|e| e.to_string())
}
