//! NVRTC, loaded by hivemesh itself: which library, which version, which architectures.
//!
//! cudarc's loader tries the unversioned `libnvrtc.so` first, so where a CUDA 13 toolkit's
//! unversioned library is on the path NVRTC 13 wins, even beside a CUDA 12 driver (its CUBINs
//! do not load there) or a Volta GPU (NVRTC 13 has no `sm_70`). So hivemesh opens NVRTC
//! itself, once per process ([`nvrtc`]):
//!
//! 1. `HIVEMESH_NVRTC` (a file name or path), if set, is the only candidate.
//! 2. Otherwise the versioned names first ([`library_candidates`]): the driver's own major
//!    version (`libnvrtc.so.13` beside a CUDA 13 driver), then older majors, newest first;
//!    without a driver, NVRTC 12 first (what CI and the kernel tests use). The unversioned
//!    `libnvrtc.so` comes last.
//! 3. A library that opens is asked its version and refused if it is newer than the driver
//!    ([`version_fits_driver`]): its CUBINs would not load. The next candidate is tried.
//!
//! The loaded library's version and supported architectures (`nvrtcGetSupportedArchs`) are
//! reported ([`NvrtcInfo`]), in errors and by `bench allreduce --device cuda`, and decide what
//! the kernels are compiled for ([`target_archs`], [`device_target`]).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::fmt;
use std::sync::OnceLock;

use libloading::Library;

use super::CudaError;

/// The environment variable naming the NVRTC library to load (a file name or a path).
pub const NVRTC_ENV: &str = "HIVEMESH_NVRTC";

/// NVRTC major versions hivemesh knows, newest first.
const KNOWN_MAJORS: [u32; 3] = [13, 12, 11];

/// The major version tried first where no driver says which (NVRTC 12: what CI installs and
/// what every architecture from Volta to Hopper compiles with).
const DEFAULT_MAJOR: u32 = 12;

/// The architectures hivemesh compiles its kernels for when asked for all of them (V100, T4,
/// A100, RTX 30xx, L4/RTX 40xx, H100/H200, B200, RTX 50xx), as `sm_XY` numbers (`10·X + Y`).
pub const ARCHITECTURES: [u32; 8] = [70, 75, 80, 86, 89, 90, 100, 120];

/// The library names to try, in order: `forced` alone where given (`HIVEMESH_NVRTC`);
/// otherwise the versioned names, the driver's major version first (`driver_major`, from
/// `cuDriverGetVersion`) then older ones, newest first (NVRTC 12 first without a driver), and
/// the unversioned name last.
pub fn library_candidates(driver_major: Option<u32>, forced: Option<&str>) -> Vec<String> {
    if let Some(forced) = forced {
        return vec![forced.to_owned()];
    }
    let mut majors: Vec<u32> = match driver_major {
        Some(d) => {
            let mut m = vec![d];
            m.extend(KNOWN_MAJORS.iter().copied().filter(|&k| k < d));
            m
        }
        None => {
            let mut m = vec![DEFAULT_MAJOR];
            m.extend(KNOWN_MAJORS.iter().copied().filter(|&k| k != DEFAULT_MAJOR));
            m
        }
    };
    majors.dedup();
    let mut names: Vec<String> = majors
        .into_iter()
        .map(|m| format!("libnvrtc.so.{m}"))
        .collect();
    names.push("libnvrtc.so".to_owned());
    names
}

/// Whether NVRTC `nvrtc` (major, minor) makes CUBINs the driver (`driver`, as
/// `cuDriverGetVersion` numbers it: 12080 for 12.8) loads: a newer major does not. `None`
/// (no driver here) accepts any version: the kernels can only be compiled, not run.
pub fn version_fits_driver(nvrtc: (u32, u32), driver: Option<u32>) -> Result<(), String> {
    match driver {
        Some(d) if nvrtc.0 > d / 1000 => Err(format!(
            "NVRTC {}.{} is newer than the driver (CUDA {}.{}): its kernels would not load",
            nvrtc.0,
            nvrtc.1,
            d / 1000,
            d % 1000 / 10
        )),
        _ => Ok(()),
    }
}

/// Of [`ARCHITECTURES`], those `supported` (NVRTC's `nvrtcGetSupportedArchs`) lists.
pub fn target_archs(supported: &[u32]) -> Vec<u32> {
    ARCHITECTURES
        .iter()
        .copied()
        .filter(|a| supported.contains(a))
        .collect()
}

/// What the kernels are compiled to for one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelTarget {
    /// A CUBIN for `sm_N`: runs on the device as it is (same major, minor at least `N`'s).
    Cubin(u32),
    /// PTX for `compute_N`, which the driver compiles for the device when loading it: for a
    /// device newer than every architecture NVRTC knows (its driver is newer than NVRTC, so
    /// it accepts NVRTC's PTX).
    Ptx(u32),
}

/// What to compile for a device of compute capability `cc` (`10·major + minor`) with an NVRTC
/// that supports `supported`: a CUBIN for the device's own architecture; else for the newest
/// supported one of the same major below it (binary compatible); else PTX for the newest
/// supported architecture below the device; an error where NVRTC supports nothing at or below
/// the device (a GPU older than this NVRTC supports: NVRTC 13 has no Volta).
pub fn device_target(cc: u32, supported: &[u32]) -> Result<KernelTarget, String> {
    if supported.contains(&cc) {
        return Ok(KernelTarget::Cubin(cc));
    }
    let below = |same_major: bool| {
        supported
            .iter()
            .copied()
            .filter(|&a| a < cc && (!same_major || a / 10 == cc / 10))
            .max()
    };
    if let Some(a) = below(true) {
        return Ok(KernelTarget::Cubin(a));
    }
    if let Some(a) = below(false) {
        return Ok(KernelTarget::Ptx(a));
    }
    Err(format!(
        "this NVRTC compiles for sm_{} to sm_{}, not for this device (sm_{cc}); install \
         NVRTC 12 (`pip install nvidia-cuda-nvrtc-cu12`) and point {NVRTC_ENV} at its \
         libnvrtc.so.12",
        supported.iter().min().copied().unwrap_or(0),
        supported.iter().max().copied().unwrap_or(0),
    ))
}

/// The NVRTC library hivemesh loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// The name it was opened by (`libnvrtc.so.12`, or `HIVEMESH_NVRTC`'s value).
    pub name: String,
    /// The file it was loaded from, where the loader says.
    pub path: Option<String>,
    /// `(major, minor)`.
    pub version: (u32, u32),
    /// The real architectures it compiles for, as `sm_XY` numbers, ascending.
    pub archs: Vec<u32>,
}

impl fmt::Display for NvrtcInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NVRTC {}.{} ({})",
            self.version.0,
            self.version.1,
            self.path.as_deref().unwrap_or(&self.name)
        )
    }
}

/// `nvrtcProgram`.
pub(crate) type Program = *mut c_void;
type Status = c_int;

/// The NVRTC entry points hivemesh calls.
pub(crate) struct Api {
    pub(crate) create: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> Status,
    pub(crate) compile: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> Status,
    pub(crate) log_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    pub(crate) log: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    pub(crate) cubin_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    pub(crate) cubin: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    pub(crate) ptx_size: unsafe extern "C" fn(Program, *mut usize) -> Status,
    pub(crate) ptx: unsafe extern "C" fn(Program, *mut c_char) -> Status,
    pub(crate) destroy: unsafe extern "C" fn(*mut Program) -> Status,
    error_string: unsafe extern "C" fn(Status) -> *const c_char,
}

/// The loaded library: its entry points and what it is.
pub(crate) struct Nvrtc {
    pub(crate) api: Api,
    pub(crate) info: NvrtcInfo,
    _lib: Library,
}

impl Nvrtc {
    /// `Ok` for NVRTC_SUCCESS, else the status's name (`nvrtcGetErrorString`) for `what`.
    pub(crate) fn check(&self, status: Status, what: &str) -> Result<(), String> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: returns a static string for any status.
        let s = unsafe { (self.api.error_string)(status) };
        let name = if s.is_null() {
            format!("status {status}")
        } else {
            // SAFETY: a NUL-terminated static string.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(format!("{what}: {name}"))
    }
}

/// Looks up `name` in `lib` as a function pointer of type `F`.
///
/// # Safety
///
/// `F` must be the symbol's real type.
unsafe fn symbol<F: Copy>(lib: &Library, name: &str) -> Result<F, String> {
    // SAFETY: the caller's promise about `F`.
    unsafe { lib.get::<F>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| format!("{name}: {e}"))
}

/// The file a loaded symbol lives in.
fn loaded_from(addr: *const c_void) -> Option<String> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `addr` is a function in a loaded library; `info` is written by dladdr.
    if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name, NUL-terminated, valid while the library is loaded.
    Some(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// Opens `name` and reads what it is; `Err` says why it cannot be used.
fn open(name: &str, driver: Option<u32>) -> Result<Nvrtc, String> {
    // SAFETY: loading NVRTC runs its initialisers only.
    let lib = unsafe { Library::new(name) }.map_err(|e| match std::error::Error::source(&e) {
        Some(why) => format!("{e}: {why}"),
        None => e.to_string(),
    })?;
    type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> Status;
    type CountFn = unsafe extern "C" fn(*mut c_int) -> Status;
    // SAFETY (every lookup): the types are NVRTC's C prototypes (nvrtc.h).
    let version: VersionFn = unsafe { symbol(&lib, "nvrtcVersion") }?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two ints written.
    if unsafe { version(&mut major, &mut minor) } != 0 {
        return Err("nvrtcVersion failed".to_owned());
    }
    let v = (
        u32::try_from(major).unwrap_or(0),
        u32::try_from(minor).unwrap_or(0),
    );
    version_fits_driver(v, driver)?;
    let num_archs: CountFn = unsafe { symbol(&lib, "nvrtcGetNumSupportedArchs") }?;
    let archs_fn: CountFn = unsafe { symbol(&lib, "nvrtcGetSupportedArchs") }?;
    let mut n = 0;
    // SAFETY: one int written.
    if unsafe { num_archs(&mut n) } != 0 || !(1..=1024).contains(&n) {
        return Err(format!("nvrtcGetNumSupportedArchs said {n}"));
    }
    let mut raw = vec![0 as c_int; n as usize];
    // SAFETY: `n` ints written, as nvrtcGetNumSupportedArchs said.
    if unsafe { archs_fn(raw.as_mut_ptr()) } != 0 {
        return Err("nvrtcGetSupportedArchs failed".to_owned());
    }
    let mut archs: Vec<u32> = raw
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect();
    archs.sort_unstable();
    archs.dedup();
    let api = Api {
        create: unsafe { symbol(&lib, "nvrtcCreateProgram") }?,
        compile: unsafe { symbol(&lib, "nvrtcCompileProgram") }?,
        log_size: unsafe { symbol(&lib, "nvrtcGetProgramLogSize") }?,
        log: unsafe { symbol(&lib, "nvrtcGetProgramLog") }?,
        cubin_size: unsafe { symbol(&lib, "nvrtcGetCUBINSize") }?,
        cubin: unsafe { symbol(&lib, "nvrtcGetCUBIN") }?,
        ptx_size: unsafe { symbol(&lib, "nvrtcGetPTXSize") }?,
        ptx: unsafe { symbol(&lib, "nvrtcGetPTX") }?,
        destroy: unsafe { symbol(&lib, "nvrtcDestroyProgram") }?,
        error_string: unsafe { symbol(&lib, "nvrtcGetErrorString") }?,
    };
    let path = loaded_from(version as *const c_void);
    Ok(Nvrtc {
        api,
        info: NvrtcInfo {
            name: name.to_owned(),
            path,
            version: v,
            archs,
        },
        _lib: lib,
    })
}

/// The driver's CUDA version (`cuDriverGetVersion`, e.g. 12080), where a driver is here.
fn driver_version() -> Option<u32> {
    if !super::driver_present() {
        return None;
    }
    let mut v = 0;
    // SAFETY: one int written; needs no cuInit.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
    (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS)
        .then(|| u32::try_from(v).ok())
        .flatten()
}

/// NVRTC, loaded on first use as the module docs say; the error lists every candidate and
/// why it was not used.
pub(crate) fn nvrtc() -> Result<&'static Nvrtc, CudaError> {
    static NVRTC: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let forced = std::env::var(NVRTC_ENV).ok().filter(|s| !s.is_empty());
            let driver = driver_version();
            let mut tried = Vec::new();
            for name in library_candidates(driver.map(|d| d / 1000), forced.as_deref()) {
                match open(&name, driver) {
                    Ok(n) => return Ok(n),
                    Err(e) => tried.push(format!("{name}: {e}")),
                }
            }
            Err(tried.join("; "))
        })
        .as_ref()
        .map_err(|why| CudaError::NoNvrtc(why.clone()))
}

/// The NVRTC hivemesh uses (loading it if need be): its version, file and architectures.
pub fn nvrtc_info() -> Result<NvrtcInfo, CudaError> {
    nvrtc().map(|n| n.info.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versioned_names_come_first_matching_the_driver() {
        let names = |d, f| library_candidates(d, f);
        // A CUDA 13 driver: NVRTC 13, then 12 and 11, the unversioned name last.
        assert_eq!(
            names(Some(13), None),
            [
                "libnvrtc.so.13",
                "libnvrtc.so.12",
                "libnvrtc.so.11",
                "libnvrtc.so"
            ]
        );
        // A CUDA 12 driver never tries NVRTC 13 by its name.
        assert_eq!(
            names(Some(12), None),
            ["libnvrtc.so.12", "libnvrtc.so.11", "libnvrtc.so"]
        );
        // A driver newer than every NVRTC known here still tries its own major first.
        assert_eq!(
            names(Some(14), None)[..2],
            ["libnvrtc.so.14", "libnvrtc.so.13"]
        );
        // No driver: NVRTC 12 first.
        assert_eq!(
            names(None, None),
            [
                "libnvrtc.so.12",
                "libnvrtc.so.13",
                "libnvrtc.so.11",
                "libnvrtc.so"
            ]
        );
        // HIVEMESH_NVRTC is the only candidate.
        assert_eq!(
            names(Some(13), Some("/x/libnvrtc.so.12")),
            ["/x/libnvrtc.so.12"]
        );
        // The unversioned name is always last (where cudarc put it first).
        for d in [None, Some(11), Some(12), Some(13)] {
            assert_eq!(names(d, None).last().unwrap(), "libnvrtc.so");
        }
    }

    #[test]
    fn an_nvrtc_newer_than_the_driver_is_refused() {
        assert!(version_fits_driver((12, 9), Some(12080)).is_ok());
        assert!(version_fits_driver((12, 9), Some(13000)).is_ok());
        assert!(version_fits_driver((13, 0), Some(13000)).is_ok());
        let e = version_fits_driver((13, 0), Some(12080)).unwrap_err();
        assert!(e.contains("NVRTC 13.0") && e.contains("CUDA 12.8"), "{e}");
        assert!(version_fits_driver((13, 0), None).is_ok());
    }

    /// `nvrtcGetSupportedArchs` of NVRTC 12.9 and 13.5, as the libraries of the
    /// `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvrtc` 13.5 wheels report them.
    const NVRTC_12_9: [u32; 19] = [
        50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121,
    ];
    const NVRTC_13_5: [u32; 13] = [75, 80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121];

    #[test]
    fn the_architecture_list_follows_the_loaded_nvrtc() {
        assert_eq!(
            target_archs(&NVRTC_12_9),
            [70, 75, 80, 86, 89, 90, 100, 120]
        );
        // NVRTC 13 has no Volta.
        assert_eq!(target_archs(&NVRTC_13_5), [75, 80, 86, 89, 90, 100, 120]);
        // NVRTC 11.8 knows up to Hopper.
        assert_eq!(
            target_archs(&[
                35, 37, 50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90
            ]),
            [70, 75, 80, 86, 89, 90]
        );
        assert!(target_archs(&[]).is_empty());
    }

    #[test]
    fn a_device_gets_a_cubin_it_can_run_or_ptx_or_a_clear_error() {
        use KernelTarget::{Cubin, Ptx};
        // H100 and V100 with NVRTC 12: their own CUBINs.
        assert_eq!(device_target(90, &NVRTC_12_9), Ok(Cubin(90)));
        assert_eq!(device_target(70, &NVRTC_12_9), Ok(Cubin(70)));
        // sm_89 with an NVRTC that stops at sm_87: a CUBIN of the same major runs.
        assert_eq!(device_target(89, &[75, 80, 86, 87]), Ok(Cubin(87)));
        // A device newer than NVRTC: PTX for the newest architecture below it.
        assert_eq!(device_target(120, &[70, 75, 80, 86, 89, 90]), Ok(Ptx(90)));
        // A V100 with NVRTC 13: nothing runs there.
        let e = device_target(70, &NVRTC_13_5).unwrap_err();
        assert!(e.contains("sm_70") && e.contains("NVRTC 12"), "{e}");
    }
}
