//! DLPack: importing a tensor another framework owns (PyTorch's `__dlpack__`), shared, not
//! copied.
//!
//! A producer hands over a `DLManagedTensor` (the C structs below, as `dlpack.h` defines them
//! for the unversioned protocol): a data pointer with a byte offset, the device, the shape and
//! strides, the dtype, and a deleter the consumer calls exactly once when it no longer needs
//! the memory. [`import`] takes ownership of such a tensor, checks everything hivemesh relies
//! on (a dtype it averages, one lane, a compact row-major layout, sizes without overflow, an
//! aligned, non-null pointer), and returns an [`Imported`] whose drop calls the deleter, on
//! success and on every rejection alike.
//!
//! The Python bindings use it for CUDA tensors (`--features cuda`): the averager then holds
//! the GPU memory itself (`cuda::DeviceTensor`).

use std::ffi::c_void;
use std::ptr::NonNull;

use super::DType;

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDevice {
    /// `DLDeviceType`: 1 CPU, 2 CUDA, 3 CUDA host (pinned), 13 CUDA managed, ...
    pub device_type: i32,
    /// The device's index.
    pub device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DLDataType {
    /// `DLDataTypeCode`: 0 int, 1 uint, 2 float, 4 bfloat, ...
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for a scalar element).
    pub lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The allocation's address (the first element is at `data + byte_offset`).
    pub data: *mut c_void,
    /// Where the memory is.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// `ndim` strides in elements, or null for compact row-major.
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context (for its deleter).
    pub manager_ctx: *mut c_void,
    /// Called once by the consumer when done (may be null: nothing to free).
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `kDLCPU`.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDA`.
pub const DEVICE_CUDA: i32 = 2;

/// Why a DLPack tensor was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DlpackError {
    /// A null `DLManagedTensor`.
    #[error("a null DLPack tensor")]
    Null,
    /// A dtype hivemesh does not average.
    #[error(
        "dtype code {code} with {bits} bits and {lanes} lanes; supported: float32, float16, bfloat16"
    )]
    DType {
        /// `DLDataType::code`.
        code: u8,
        /// `DLDataType::bits`.
        bits: u8,
        /// `DLDataType::lanes`.
        lanes: u16,
    },
    /// A shape that is negative, too large or of too many dimensions.
    #[error("bad shape: {0}")]
    Shape(String),
    /// Strides other than compact row-major.
    #[error("not contiguous (strides {0:?}); pass tensor.contiguous() and keep that tensor")]
    NotContiguous(Vec<i64>),
    /// A null or misaligned first element.
    #[error("the first element's address {0:#x} is null or misaligned")]
    Address(usize),
}

/// Most dimensions accepted (PyTorch's own limit is 64).
const MAX_DIMS: i32 = 64;

/// Owns a `DLManagedTensor`: calls its deleter once, on drop.
#[derive(Debug)]
pub struct Managed(NonNull<DLManagedTensor>);

// SAFETY: the managed tensor is only read (through `&self`) and deleted once (on drop); DLPack
// producers' deleters may be called from any thread (PyTorch's frees a C++ object).
unsafe impl Send for Managed {}
// SAFETY: see `Send`.
unsafe impl Sync for Managed {}

impl Drop for Managed {
    fn drop(&mut self) {
        let p = self.0.as_ptr();
        // SAFETY: `import`'s contract: a live managed tensor we own; deleted exactly once.
        unsafe {
            if let Some(deleter) = (*p).deleter {
                deleter(p);
            }
        }
    }
}

/// Where an imported tensor's memory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by index.
    Cuda(usize),
    /// Any other DLPack device type (refused by every user of it here).
    Other(i32),
}

/// A checked DLPack tensor (see the module docs); dropping it releases the producer's memory.
#[derive(Debug)]
pub struct Imported {
    /// Where the memory is.
    pub device: Device,
    /// The first element's address (`data + byte_offset`).
    pub address: usize,
    /// The shape.
    pub shape: Vec<usize>,
    /// The element type.
    pub dtype: DType,
    /// Keeps the memory alive; releases it on drop.
    pub owner: Managed,
}

/// Takes ownership of `managed` and checks it (see the module docs). On an error the deleter
/// has been called.
///
/// # Safety
///
/// `managed` is null or a live `DLManagedTensor` whose ownership the caller hands over (for a
/// PyTorch capsule: taken out of a capsule named `"dltensor"`, which the caller then renames
/// `"used_dltensor"`), with `ndim` readable sizes and, where not null, strides.
pub unsafe fn import(managed: *mut DLManagedTensor) -> Result<Imported, DlpackError> {
    let owner = Managed(NonNull::new(managed).ok_or(DlpackError::Null)?);
    // SAFETY: live and owned (the contract); only read here.
    let t = unsafe { &(*managed).dl_tensor };
    let dtype = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (2, 32, 1) => DType::F32,
        (2, 16, 1) => DType::F16,
        (4, 16, 1) => DType::BF16,
        (code, bits, lanes) => return Err(DlpackError::DType { code, bits, lanes }),
    };
    if !(0..=MAX_DIMS).contains(&t.ndim) {
        return Err(DlpackError::Shape(format!("{} dimensions", t.ndim)));
    }
    let ndim = t.ndim as usize;
    if ndim > 0 && t.shape.is_null() {
        return Err(DlpackError::Shape("a null shape".into()));
    }
    let raw_shape: &[i64] = if ndim == 0 {
        &[]
    } else {
        // SAFETY: `ndim` sizes at `shape` (the contract).
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }
    };
    let shape: Vec<usize> = raw_shape
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| DlpackError::Shape(format!("{raw_shape:?}")))?;
    let numel = super::addressable_numel(&shape, dtype)
        .ok_or_else(|| DlpackError::Shape(format!("{shape:?} is too large")))?;
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: `ndim` strides at `strides` (the contract).
        let strides = unsafe { std::slice::from_raw_parts(t.strides, ndim) };
        let mut expected: i64 = 1;
        for (&size, &stride) in shape.iter().zip(strides).rev() {
            // A dimension of size 1 may have any stride; in an empty tensor nothing is read.
            if size > 1 && stride != expected && numel > 0 {
                return Err(DlpackError::NotContiguous(strides.to_vec()));
            }
            expected = expected.saturating_mul(size as i64);
        }
    }
    let address = (t.data as usize)
        .checked_add(usize::try_from(t.byte_offset).unwrap_or(usize::MAX))
        .ok_or(DlpackError::Address(usize::MAX))?;
    if numel > 0 && (t.data.is_null() || !address.is_multiple_of(dtype.size_bytes())) {
        return Err(DlpackError::Address(address));
    }
    let device = match t.device.device_type {
        DEVICE_CPU => Device::Cpu,
        DEVICE_CUDA => Device::Cuda(usize::try_from(t.device.device_id).unwrap_or(usize::MAX)),
        other => Device::Other(other),
    };
    Ok(Imported {
        device,
        address,
        shape,
        dtype,
        owner,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// What a producer keeps per exported tensor: the struct, its shape and strides, and a
    /// counter of deleter calls.
    struct Producer {
        managed: DLManagedTensor,
        shape: Vec<i64>,
        strides: Option<Vec<i64>>,
        deleted: &'static AtomicUsize,
    }

    unsafe extern "C" fn delete(p: *mut DLManagedTensor) {
        // SAFETY: `manager_ctx` is the boxed Producer `export` leaked.
        let producer = unsafe { Box::from_raw((*p).manager_ctx.cast::<Producer>()) };
        producer.deleted.fetch_add(1, Ordering::SeqCst);
    }

    /// A managed tensor over `data` the way a producer exports one.
    fn export(
        data: *mut c_void,
        code: u8,
        bits: u8,
        shape: &[i64],
        strides: Option<&[i64]>,
        byte_offset: u64,
        deleted: &'static AtomicUsize,
    ) -> *mut DLManagedTensor {
        let mut p = Box::new(Producer {
            managed: DLManagedTensor {
                dl_tensor: DLTensor {
                    data,
                    device: DLDevice {
                        device_type: DEVICE_CUDA,
                        device_id: 1,
                    },
                    ndim: shape.len() as i32,
                    dtype: DLDataType {
                        code,
                        bits,
                        lanes: 1,
                    },
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete),
            },
            shape: shape.to_vec(),
            strides: strides.map(<[i64]>::to_vec),
            deleted,
        });
        p.managed.dl_tensor.shape = p.shape.as_mut_ptr();
        if let Some(s) = p.strides.as_mut() {
            p.managed.dl_tensor.strides = s.as_mut_ptr();
        }
        let raw = Box::into_raw(p);
        // SAFETY: just allocated; the deleter frees it through `manager_ctx`.
        unsafe {
            (*raw).managed.manager_ctx = raw.cast();
            &raw mut (*raw).managed
        }
    }

    #[test]
    fn a_good_tensor_is_imported_and_released_once() {
        static DELETED: AtomicUsize = AtomicUsize::new(0);
        let mut buf = vec![0f32; 64];
        let base = buf.as_mut_ptr().cast::<c_void>();
        for (code, bits, dtype) in [
            (2, 32, DType::F32),
            (2, 16, DType::F16),
            (4, 16, DType::BF16),
        ] {
            let before = DELETED.load(Ordering::SeqCst);
            // Row-major strides given explicitly, a size-1 dimension with an odd stride, and
            // an offset of one f32.
            let m = export(base, code, bits, &[2, 1, 3], Some(&[3, 99, 1]), 4, &DELETED);
            // SAFETY: a live managed tensor handed over.
            let t = unsafe { import(m) }.unwrap();
            assert_eq!((t.dtype, t.shape.clone()), (dtype, vec![2, 1, 3]));
            assert_eq!(t.device, Device::Cuda(1));
            assert_eq!(t.address, base as usize + 4);
            assert_eq!(
                DELETED.load(Ordering::SeqCst),
                before,
                "deleted while in use"
            );
            drop(t);
            assert_eq!(DELETED.load(Ordering::SeqCst), before + 1);
        }
        // A scalar (no dimensions, null shape) and an empty tensor (a null pointer is fine).
        let m = export(base, 2, 32, &[], None, 0, &DELETED);
        // SAFETY: as above.
        assert_eq!(unsafe { import(m) }.unwrap().shape, Vec::<usize>::new());
        let m = export(
            std::ptr::null_mut(),
            2,
            32,
            &[0, 5],
            Some(&[7, 7]),
            0,
            &DELETED,
        );
        // SAFETY: as above.
        assert_eq!(unsafe { import(m) }.unwrap().shape, vec![0, 5]);
    }

    #[test]
    fn bad_tensors_are_refused_and_still_released() {
        static DELETED: AtomicUsize = AtomicUsize::new(0);
        let mut buf = vec![0f32; 64];
        let base = buf.as_mut_ptr().cast::<c_void>();
        type Case = (*mut DLManagedTensor, fn(&DlpackError) -> bool);
        let cases: Vec<Case> = vec![
            (export(base, 0, 32, &[4], None, 0, &DELETED), |e| {
                matches!(e, DlpackError::DType { .. })
            }),
            (export(base, 2, 64, &[4], None, 0, &DELETED), |e| {
                matches!(e, DlpackError::DType { .. })
            }),
            (export(base, 2, 32, &[-1], None, 0, &DELETED), |e| {
                matches!(e, DlpackError::Shape(_))
            }),
            (
                export(base, 2, 32, &[1 << 40, 1 << 40], None, 0, &DELETED),
                |e| matches!(e, DlpackError::Shape(_)),
            ),
            // Transposed, and every other element.
            (
                export(base, 2, 32, &[2, 3], Some(&[1, 2]), 0, &DELETED),
                |e| matches!(e, DlpackError::NotContiguous(_)),
            ),
            (export(base, 2, 32, &[4], Some(&[2]), 0, &DELETED), |e| {
                matches!(e, DlpackError::NotContiguous(_))
            }),
            // Misaligned for f32, and null with elements.
            (export(base, 2, 32, &[4], None, 2, &DELETED), |e| {
                matches!(e, DlpackError::Address(_))
            }),
            (
                export(std::ptr::null_mut(), 2, 16, &[4], None, 0, &DELETED),
                |e| matches!(e, DlpackError::Address(_)),
            ),
        ];
        let n = cases.len();
        for (i, (m, expected)) in cases.into_iter().enumerate() {
            // SAFETY: live managed tensors handed over.
            let e = unsafe { import(m) }.unwrap_err();
            assert!(expected(&e), "case {i}: {e}");
        }
        assert_eq!(
            DELETED.load(Ordering::SeqCst),
            n,
            "every refused tensor was released"
        );
        // SAFETY: null is allowed.
        assert_eq!(
            unsafe { import(std::ptr::null_mut()) }.unwrap_err(),
            DlpackError::Null
        );
    }
}
