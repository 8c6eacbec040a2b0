//! The kernel source (`kernels.cu`) and its compilation by NVRTC to a CUBIN.
//!
//! cudarc's `compile_ptx` yields PTX only; a driver refuses PTX newer than itself
//! (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`), which is the usual case when NVRTC comes from a
//! recent PyTorch wheel and the driver is older. A CUBIN for the device's own architecture
//! needs no JIT, so this compiles through NVRTC's C API (cudarc's `result` and `sys` layers).

use std::ffi::{CStr, CString, c_char};

use cudarc::nvrtc::{result, sys};

use super::CudaError;

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

/// An NVRTC program, destroyed on drop.
struct Program {
    prog: sys::nvrtcProgram,
    _src: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed once.
        let _ = unsafe { result::destroy_program(self.prog) };
    }
}

fn text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compiles the kernels to a CUBIN for `arch` (`sm_90` for an H100, `sm_80` for an A100...).
/// Needs NVRTC only (no GPU). Fails with [`CudaError::NoNvrtc`] where NVRTC is missing and
/// with [`CudaError::Compile`] (NVRTC's log) where it rejects the source or the architecture.
pub fn compile_kernels(arch: &str) -> Result<Vec<u8>, CudaError> {
    if !super::nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    if !arch.starts_with("sm_") || !arch[3..].chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(CudaError::Compile(format!(
            "not a GPU architecture: {arch:?}"
        )));
    }
    let src = CString::new(SOURCE).map_err(|e| CudaError::Compile(e.to_string()))?;
    let name: &CStr = c"hivemesh_kernels.cu";
    let prog = Program {
        prog: result::create_program(&src, Some(name))
            .map_err(|e| CudaError::Compile(format!("{e:?}")))?,
        _src: src,
    };
    let options = [
        format!("--gpu-architecture={arch}"),
        "--fmad=false".to_owned(),
    ];
    // SAFETY: `prog` is a live program.
    if let Err(e) = unsafe { result::compile_program(prog.prog, &options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.prog) }
            .map_or_else(|_| String::new(), |l| text(&l));
        return Err(CudaError::Compile(format!("{e:?}: {log}")));
    }
    let mut size = 0usize;
    // SAFETY: a compiled program; `size` is written by NVRTC.
    unsafe { sys::nvrtcGetCUBINSize(prog.prog, &mut size) }
        .result()
        .map_err(|e| CudaError::Compile(format!("CUBIN size: {e:?}")))?;
    if size == 0 {
        return Err(CudaError::Compile(format!(
            "NVRTC produced no CUBIN for {arch} (it needs a real architecture, sm_XY)"
        )));
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the `size` bytes NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog.prog, image.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| CudaError::Compile(format!("CUBIN: {e:?}")))?;
    Ok(image)
}
