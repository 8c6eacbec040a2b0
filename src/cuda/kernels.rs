//! The kernel source (`kernels.cu`) and its compilation by NVRTC to a CUBIN.
//!
//! A driver refuses PTX newer than itself (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), the usual
//! case when NVRTC comes from a recent PyTorch wheel and the driver is older; a CUBIN for the
//! device's own architecture needs no JIT. So a device gets a CUBIN
//! ([`super::nvrtc::device_target`]), and PTX only where it is newer than every architecture
//! NVRTC knows (its driver then takes NVRTC's PTX). Compiled through NVRTC's C API as
//! hivemesh loads it ([`super::nvrtc`]).

use std::ffi::{CStr, CString, c_char, c_int};

use super::CudaError;
use super::nvrtc::{self, KernelTarget, Nvrtc};

/// The kernels' CUDA C source.
const SOURCE: &str = include_str!("kernels.cu");

/// The names of the kernels, as `kernels.cu` spells them.
#[derive(Clone, Copy, Debug)]
pub struct KernelNames {
    /// f32 → f16 words (the Float16 codec's conversion, saturating).
    pub cast_f16: &'static str,
    /// f32 → bf16 words.
    pub cast_bf16: &'static str,
    /// `apply[tensor dtype][delta dtype]` with dtypes in the order f32, f16, bf16.
    pub apply: [[&'static str; 3]; 3],
}

/// The kernels' names.
pub fn kernel_names() -> KernelNames {
    KernelNames {
        cast_f16: "hm_cast_f32_f16",
        cast_bf16: "hm_cast_f32_bf16",
        apply: [
            ["hm_apply_f32_f32", "hm_apply_f32_f16", "hm_apply_f32_bf16"],
            ["hm_apply_f16_f32", "hm_apply_f16_f16", "hm_apply_f16_bf16"],
            [
                "hm_apply_bf16_f32",
                "hm_apply_bf16_f16",
                "hm_apply_bf16_bf16",
            ],
        ],
    }
}

/// What [`compile_kernels`] made.
#[derive(Clone, Debug)]
pub enum KernelImage {
    /// A CUBIN (an ELF image) for one real architecture.
    Cubin(Vec<u8>),
    /// PTX text, for the driver to compile when loading it.
    Ptx(String),
}

/// An NVRTC program, destroyed on drop.
struct Program<'a> {
    nvrtc: &'a Nvrtc,
    prog: nvrtc::Program,
}

impl Drop for Program<'_> {
    fn drop(&mut self) {
        // SAFETY: created by `nvrtcCreateProgram`, destroyed once.
        let _ = unsafe { (self.nvrtc.api.destroy)(&mut self.prog) };
    }
}

impl Program<'_> {
    /// NVRTC's log for the program (empty where it has none).
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program; `size` is written.
        if unsafe { (self.nvrtc.api.log_size)(self.prog, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut raw = vec![0u8; size];
        // SAFETY: `raw` holds the `size` bytes NVRTC asked for.
        if unsafe { (self.nvrtc.api.log)(self.prog, raw.as_mut_ptr().cast::<c_char>()) } != 0 {
            return String::new();
        }
        text(&raw)
    }

    /// One of NVRTC's outputs (`size`, then the bytes).
    fn output(
        &self,
        size_fn: unsafe extern "C" fn(nvrtc::Program, *mut usize) -> c_int,
        get_fn: unsafe extern "C" fn(nvrtc::Program, *mut c_char) -> c_int,
        what: &str,
    ) -> Result<Vec<u8>, String> {
        let mut size = 0usize;
        // SAFETY: a compiled program; `size` is written.
        self.nvrtc
            .check(unsafe { size_fn(self.prog, &mut size) }, what)?;
        let mut out = vec![0u8; size];
        if size > 0 {
            // SAFETY: `out` holds the `size` bytes NVRTC reported.
            self.nvrtc
                .check(unsafe { get_fn(self.prog, out.as_mut_ptr().cast()) }, what)?;
        }
        Ok(out)
    }
}

/// The bytes up to the first NUL, as text.
fn text(raw: &[u8]) -> String {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// Compiles the kernels for `target` with the NVRTC hivemesh loads ([`super::nvrtc_info`]):
/// a CUBIN for `sm_N`, or PTX for `compute_N`. Needs NVRTC only (no GPU). Fails with
/// [`CudaError::NoNvrtc`] where no usable NVRTC is here and with [`CudaError::Compile`]
/// (naming the NVRTC version, with its log) where it rejects the source or the architecture.
pub fn compile_kernels(target: KernelTarget) -> Result<KernelImage, CudaError> {
    let nvrtc = nvrtc::nvrtc()?;
    let fail = |what: String| CudaError::Compile(format!("{}, {target:?}: {what}", nvrtc.info));
    let option = match target {
        KernelTarget::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        KernelTarget::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
    };
    let src = CString::new(SOURCE).map_err(|e| fail(e.to_string()))?;
    let name: &CStr = c"hivemesh_kernels.cu";
    let mut prog = Program {
        nvrtc,
        prog: std::ptr::null_mut(),
    };
    // SAFETY: NUL-terminated source and name, no headers; `prog.prog` is written.
    let created = unsafe {
        (nvrtc.api.create)(
            &mut prog.prog,
            src.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if let Err(e) = nvrtc.check(created, "nvrtcCreateProgram") {
        prog.prog = std::ptr::null_mut();
        return Err(fail(e));
    }
    let options = [
        CString::new(option).map_err(|e| fail(e.to_string()))?,
        c"--fmad=false".to_owned(),
    ];
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and `pointers.len()` NUL-terminated options.
    let compiled =
        unsafe { (nvrtc.api.compile)(prog.prog, pointers.len() as c_int, pointers.as_ptr()) };
    if let Err(e) = nvrtc.check(compiled, "nvrtcCompileProgram") {
        return Err(fail(format!("{e}: {}", prog.log())));
    }
    match target {
        KernelTarget::Cubin(a) => {
            let image = prog
                .output(nvrtc.api.cubin_size, nvrtc.api.cubin, "nvrtcGetCUBIN")
                .map_err(fail)?;
            if image.is_empty() {
                return Err(fail(format!("no CUBIN for sm_{a}")));
            }
            Ok(KernelImage::Cubin(image))
        }
        KernelTarget::Ptx(_) => {
            let ptx = prog
                .output(nvrtc.api.ptx_size, nvrtc.api.ptx, "nvrtcGetPTX")
                .map_err(fail)?;
            Ok(KernelImage::Ptx(text(&ptx)))
        }
    }
}
