//! Whether this machine's GPUs can be used, and what a test that needs one does where they
//! cannot.
//!
//! Only one case means "no GPU here": the driver library (`libcuda`) cannot be loaded. Once it
//! loads, `cuInit` and `cuDeviceGetCount` must succeed and find a device; anything else (a
//! toolkit's stub `libcuda.so` on the library path: `CUDA_ERROR_STUB_LIBRARY`; a driver that
//! does not match its kernel module: `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`; devices hidden:
//! `CUDA_ERROR_NO_DEVICE`) is an error that names the driver's result, never a silent skip.

use cudarc::driver::sys::CUresult;

use super::CudaError;

/// How many devices the driver reports, from what the probe saw: whether the driver library
/// loaded, `cuInit`'s result and (when it succeeded) `cuDeviceGetCount`'s result and count.
/// `Err(CudaError::NoDriver)` only where the library did not load.
pub fn classify_probe(
    driver_library: bool,
    init: CUresult,
    count: Option<(CUresult, i32)>,
) -> Result<usize, CudaError> {
    if !driver_library {
        return Err(CudaError::NoDriver);
    }
    if init != CUresult::CUDA_SUCCESS {
        return Err(CudaError::DriverInit {
            call: "cuInit",
            result: init,
        });
    }
    match count {
        Some((CUresult::CUDA_SUCCESS, n)) if n > 0 => Ok(n as usize),
        Some((CUresult::CUDA_SUCCESS, _)) | None => Err(CudaError::DriverInit {
            call: "cuDeviceGetCount",
            result: CUresult::CUDA_ERROR_NO_DEVICE,
        }),
        Some((result, _)) => Err(CudaError::DriverInit {
            call: "cuDeviceGetCount",
            result,
        }),
    }
}

/// The number of CUDA devices: `Err(CudaError::NoDriver)` where the driver library cannot be
/// loaded (the only "no GPU here"), [`CudaError::DriverInit`] naming the driver's result
/// where it loads but cannot be used.
pub fn device_count() -> Result<usize, CudaError> {
    if !super::driver_present() {
        return classify_probe(false, CUresult::CUDA_SUCCESS, None);
    }
    // SAFETY: the library is present; cuInit may be called any number of times.
    let init = unsafe { cudarc::driver::sys::cuInit(0) };
    let count = (init == CUresult::CUDA_SUCCESS).then(|| {
        let mut n = 0;
        // SAFETY: one int written.
        (unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut n) }, n)
    });
    classify_probe(true, init, count)
}

/// The environment variable that makes a missing GPU a test failure.
pub const GPU_REQUIRED_ENV: &str = "HIVEMESH_GPU_REQUIRED";

/// What a test that needs a GPU does, given [`device_count`]'s answer and whether a GPU is
/// required (`HIVEMESH_GPU_REQUIRED`): `Ok(true)` runs it, `Ok(false)` skips it (only without
/// a driver library, and only where no GPU is required), `Err` fails it with the reason.
pub fn gpu_test_gate(probe: &Result<usize, CudaError>, required: bool) -> Result<bool, String> {
    match probe {
        Ok(_) => Ok(true),
        Err(CudaError::NoDriver) if !required => Ok(false),
        Err(e) if required => Err(format!(
            "a GPU is required ({GPU_REQUIRED_ENV}) but cannot be used: {e}"
        )),
        Err(e) => Err(format!(
            "the CUDA driver library loads but cannot be used (only a missing driver library \
             skips the GPU tests): {e}"
        )),
    }
}

/// [`gpu_test_gate`] for this machine and environment.
pub fn gpu_test_gate_here() -> Result<bool, String> {
    let required = std::env::var_os(GPU_REQUIRED_ENV).is_some_and(|v| !v.is_empty());
    gpu_test_gate(&device_count(), required)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: CUresult = CUresult::CUDA_SUCCESS;

    fn names(r: Result<usize, CudaError>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn only_a_missing_driver_library_means_no_gpu() {
        assert!(matches!(
            classify_probe(false, OK, None),
            Err(CudaError::NoDriver)
        ));
        assert_eq!(classify_probe(true, OK, Some((OK, 2))).unwrap(), 2);
        // A stub libcuda, a mismatched driver, hidden devices: errors naming the result.
        let stub = names(classify_probe(
            true,
            CUresult::CUDA_ERROR_STUB_LIBRARY,
            None,
        ));
        assert!(
            stub.contains("cuInit") && stub.contains("CUDA_ERROR_STUB_LIBRARY"),
            "{stub}"
        );
        let mismatch = names(classify_probe(
            true,
            CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
            None,
        ));
        assert!(
            mismatch.contains("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
            "{mismatch}"
        );
        let none = names(classify_probe(true, CUresult::CUDA_ERROR_NO_DEVICE, None));
        assert!(none.contains("CUDA_ERROR_NO_DEVICE"), "{none}");
        // cuInit succeeded, but the count failed or is zero.
        let count = names(classify_probe(
            true,
            OK,
            Some((CUresult::CUDA_ERROR_NOT_INITIALIZED, 0)),
        ));
        assert!(
            count.contains("cuDeviceGetCount") && count.contains("CUDA_ERROR_NOT_INITIALIZED"),
            "{count}"
        );
        assert!(matches!(
            classify_probe(true, OK, Some((OK, 0))),
            Err(CudaError::DriverInit { .. })
        ));
    }

    #[test]
    fn a_gpu_test_skips_only_without_a_driver_library_and_not_when_required() {
        let no_lib = classify_probe(false, OK, None);
        let stub = classify_probe(true, CUresult::CUDA_ERROR_STUB_LIBRARY, None);
        let two = classify_probe(true, OK, Some((OK, 2)));
        assert_eq!(gpu_test_gate(&two, false), Ok(true));
        assert_eq!(gpu_test_gate(&two, true), Ok(true));
        assert_eq!(gpu_test_gate(&no_lib, false), Ok(false));
        let e = gpu_test_gate(&no_lib, true).unwrap_err();
        assert!(
            e.contains(GPU_REQUIRED_ENV) && e.contains("no CUDA driver"),
            "{e}"
        );
        // A driver that loads but fails fails the test, required or not, naming the result.
        for required in [false, true] {
            let e = gpu_test_gate(&stub, required).unwrap_err();
            assert!(e.contains("CUDA_ERROR_STUB_LIBRARY"), "{e}");
        }
    }
}
