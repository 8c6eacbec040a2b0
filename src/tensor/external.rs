//! Tensors over memory that someone else owns: the elements of a PyTorch tensor or a numpy
//! array, shared with the averager instead of copied, so that after a step the caller's own
//! objects hold the average.
//!
//! An [`External`] is a pointer, a dtype and a shape, plus an *owner*: any value that keeps
//! the memory alive (the Python bindings hand in a reference to the tensor's storage). The
//! averager reads and writes such a tensor exactly as it does an owned one, under its tensor
//! lock; a clone is an owned copy, so a round's snapshot never aliases the caller's memory.
//!
//! Memory that its owner may free or move behind the tensor's back (PyTorch's
//! `storage.resize_(0)`, `tensor.resize_()`, `tensor.set_()`) comes with a [`MovableMemory`]
//! ([`Tensor::from_movable_external`]): the averager reads or writes such tensors only inside
//! [`with_memory_checked`], which asks every owner whether the memory is still where the
//! tensor points, holds it there (the Python bindings: with the GIL held) for the access, and
//! refuses with [`TensorError::MemoryMoved`] otherwise, touching nothing.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use half::{bf16, f16};

use super::{DType, PartView, PartViewMut, Tensor, TensorError};

/// Elements of a tensor in memory that the tensor does not own (see the module docs).
pub struct External {
    ptr: NonNull<u8>,
    dtype: DType,
    shape: Vec<usize>,
    numel: usize,
    /// Set when the owner's memory can move: checked before each access.
    movable: Option<Arc<dyn MovableMemory>>,
    _owner: Box<dyn Any + Send + Sync>,
}

/// An owner whose memory may be freed or moved while the tensor lives (see the module docs).
pub trait MovableMemory: Send + Sync + 'static {
    /// Calls `access` once if the `nbytes` bytes at `ptr` are still the owner's memory,
    /// keeping them in place until it returns; otherwise returns why not, without calling it.
    fn pinned(&self, ptr: *const u8, nbytes: usize, access: &mut dyn FnMut())
    -> Result<(), String>;
}

/// Runs `access` on `tensors` once every [movable](MovableMemory) external tensor among them
/// has been found in place and is held there (the memory checks nest, in order); fails with
/// [`TensorError::MemoryMoved`] (and runs nothing) when one moved. Tensors without such an
/// owner are not checked.
pub fn with_memory_checked<R>(
    tensors: &mut [Tensor],
    access: impl FnOnce(&mut [Tensor]) -> R,
) -> Result<R, TensorError> {
    type Pin = (usize, Arc<dyn MovableMemory>, usize, usize);
    let pins: Vec<Pin> = tensors
        .iter()
        .enumerate()
        .filter_map(|(i, t)| match t {
            Tensor::External(e) => e.movable.clone().map(|m| {
                let nbytes = e.numel * e.dtype.size_bytes();
                (i, m, e.ptr.as_ptr() as usize, nbytes)
            }),
            _ => None,
        })
        .collect();
    fn nest(pins: &[Pin], access: &mut dyn FnMut()) -> Result<(), TensorError> {
        let Some(((index, memory, ptr, nbytes), rest)) = pins.split_first() else {
            access();
            return Ok(());
        };
        let mut inner = Ok(());
        memory
            .pinned(*ptr as *const u8, *nbytes, &mut || {
                inner = nest(rest, access)
            })
            .map_err(|why| TensorError::MemoryMoved { index: *index, why })?;
        inner
    }
    let mut access = Some(access);
    let mut out = None;
    nest(&pins, &mut || {
        if let Some(f) = access.take() {
            out = Some(f(&mut *tensors));
        }
    })?;
    out.ok_or_else(|| TensorError::MemoryMoved {
        index: 0,
        why: "a memory check neither ran the access nor refused it".into(),
    })
}

// SAFETY: an `External` is a unique handle to its elements (the contract of
// `Tensor::from_external`): it hands out `&[T]` only through `&self` and `&mut [T]` only
// through `&mut self`, so Rust's aliasing rules hold as they do for a `Vec`, and the owner
// that keeps the memory alive is itself `Send + Sync`.
unsafe impl Send for External {}
// SAFETY: see `Send`; shared access only reads.
unsafe impl Sync for External {}

impl fmt::Debug for External {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("External")
            .field("ptr", &self.ptr)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl External {
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// The address of the first element.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub(super) fn view(&self) -> PartView<'_> {
        let (p, n) = (self.ptr.as_ptr(), self.numel);
        // SAFETY: `from_external`'s contract: `n` initialized, aligned elements of `dtype`,
        // valid while `self` lives; `&self` excludes writers through this handle.
        unsafe {
            match self.dtype {
                DType::F32 => PartView::F32(std::slice::from_raw_parts(p.cast::<f32>(), n)),
                DType::F16 => PartView::F16(std::slice::from_raw_parts(p.cast::<f16>(), n)),
                DType::BF16 => PartView::BF16(std::slice::from_raw_parts(p.cast::<bf16>(), n)),
            }
        }
    }

    pub(super) fn view_mut(&mut self) -> PartViewMut<'_> {
        let (p, n) = (self.ptr.as_ptr(), self.numel);
        // SAFETY: as in `view`; `&mut self` makes this the only access through the handle.
        unsafe {
            match self.dtype {
                DType::F32 => PartViewMut::F32(std::slice::from_raw_parts_mut(p.cast::<f32>(), n)),
                DType::F16 => PartViewMut::F16(std::slice::from_raw_parts_mut(p.cast::<f16>(), n)),
                DType::BF16 => {
                    PartViewMut::BF16(std::slice::from_raw_parts_mut(p.cast::<bf16>(), n))
                }
            }
        }
    }

    /// An owned tensor with a copy of the elements.
    pub(super) fn to_owned_tensor(&self) -> Tensor {
        let dim = ndarray::IxDyn(&self.shape);
        // The shape's product is `numel` (checked at construction), so these cannot fail.
        let t = match self.view() {
            PartView::F32(s) => ndarray::ArrayD::from_shape_vec(dim, s.to_vec()).map(Tensor::F32),
            PartView::F16(s) => ndarray::ArrayD::from_shape_vec(dim, s.to_vec()).map(Tensor::F16),
            PartView::BF16(s) => ndarray::ArrayD::from_shape_vec(dim, s.to_vec()).map(Tensor::BF16),
        };
        t.unwrap_or_else(|e| unreachable!("shape checked at construction: {e}"))
    }
}

impl Tensor {
    /// A tensor over `shape.iter().product()` elements of `dtype` at `ptr`, which it reads and
    /// writes in place (row-major) but does not own: `owner` is kept until the tensor is
    /// dropped and must keep the memory alive. Cloning the tensor copies the elements.
    ///
    /// Fails if `ptr` is null or not aligned for `dtype` (a zero-element tensor may have any
    /// pointer).
    ///
    /// # Safety
    ///
    /// For as long as the returned tensor lives: the memory at `ptr` holds that many
    /// initialized elements of `dtype`, contiguous, stays allocated (that is what `owner` is
    /// for), and is not read or written by anyone else while the tensor is being read or
    /// written; the caller provides that exclusion (the averager reads and writes its
    /// tensors only under [`crate::averager::Averager::tensors`]'s lock, so other code must
    /// take the same lock).
    pub unsafe fn from_external(
        shape: &[usize],
        dtype: DType,
        ptr: *mut u8,
        owner: impl Any + Send + Sync,
    ) -> Result<Self, TensorError> {
        let numel = super::addressable_numel(shape, dtype)
            .ok_or_else(|| TensorError::Mismatch(format!("shape {shape:?} is too large")))?;
        let align = match dtype {
            DType::F32 => std::mem::align_of::<f32>(),
            DType::F16 => std::mem::align_of::<f16>(),
            DType::BF16 => std::mem::align_of::<bf16>(),
        };
        let ptr = if numel == 0 {
            // No element is ever read: any well-aligned non-null pointer will do.
            NonNull::<f32>::dangling().cast::<u8>()
        } else {
            let p = NonNull::new(ptr)
                .ok_or_else(|| TensorError::Mismatch("null pointer for external tensor".into()))?;
            if !(p.as_ptr() as usize).is_multiple_of(align) {
                return Err(TensorError::Mismatch(format!(
                    "external {dtype} data at {p:?} is not {align}-byte aligned"
                )));
            }
            p
        };
        Ok(Self::External(External {
            ptr,
            dtype,
            shape: shape.to_vec(),
            numel,
            movable: None,
            _owner: Box::new(owner),
        }))
    }

    /// [`Tensor::from_external`] over memory that `owner` may free or move: the tensor is
    /// read and written only inside [`with_memory_checked`], which asks `owner` first.
    ///
    /// # Safety
    ///
    /// As for [`Tensor::from_external`], except that the memory need stay allocated and
    /// unshared only while `owner`'s [`MovableMemory::pinned`] runs its access (it must
    /// refuse when the memory moved), and every access goes through [`with_memory_checked`].
    pub unsafe fn from_movable_external(
        shape: &[usize],
        dtype: DType,
        ptr: *mut u8,
        owner: Arc<dyn MovableMemory>,
    ) -> Result<Self, TensorError> {
        // SAFETY: the caller's contract, narrowed to the checked accesses.
        let mut t = unsafe { Self::from_external(shape, dtype, ptr, owner.clone())? };
        if let Self::External(e) = &mut t {
            e.movable = Some(owner);
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Counts drops, to show the owner lives exactly as long as the tensor.
    struct Owner(Arc<AtomicUsize>);

    impl Drop for Owner {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn writes_land_in_the_callers_memory_and_clones_are_copies() {
        let mut memory = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let dropped = Arc::new(AtomicUsize::new(0));
        // SAFETY: `memory` outlives `t` and nothing else touches it meanwhile.
        let mut t = unsafe {
            Tensor::from_external(
                &[2, 3],
                DType::F32,
                memory.as_mut_ptr().cast(),
                Owner(dropped.clone()),
            )
        }
        .unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.numel(), 6);
        assert_eq!(
            t,
            Tensor::from_f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap()
        );
        let copy = t.clone();
        assert!(matches!(copy, Tensor::F32(_)), "a clone owns its elements");
        t.add_scaled_f32(1, &[10.0, 10.0], 0.5).unwrap();
        let average: Vec<u8> = [7.0f32, 7.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        t.add_average(4, &average, copy.part(4..6), 1.0).unwrap();
        drop(t);
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            1,
            "the owner is dropped with the tensor"
        );
        assert_eq!(memory, vec![1.0, 7.0, 8.0, 4.0, 7.0, 7.0]);
        assert_eq!(copy.to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn half_precision_elements_are_shared_too() {
        let mut memory = vec![bf16::from_f32(1.0); 3];
        // SAFETY: `memory` outlives `t` and nothing else touches it meanwhile.
        let mut t =
            unsafe { Tensor::from_external(&[3], DType::BF16, memory.as_mut_ptr().cast(), ()) }
                .unwrap();
        t.add_scaled_f32(0, &[1.0, 2.0, 3.0], 1.0).unwrap();
        drop(t);
        assert_eq!(
            memory.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            [2.0, 3.0, 4.0]
        );
    }

    /// Memory that can be marked as moved: then it refuses every access.
    #[derive(Default)]
    struct Moving {
        moved: std::sync::atomic::AtomicBool,
    }

    impl MovableMemory for Moving {
        fn pinned(
            &self,
            _ptr: *const u8,
            _nbytes: usize,
            access: &mut dyn FnMut(),
        ) -> Result<(), String> {
            if self.moved.load(Ordering::SeqCst) {
                return Err("moved".into());
            }
            access();
            Ok(())
        }
    }

    #[test]
    fn moved_memory_is_refused_before_any_access() {
        let mut memory = vec![1.0f32; 4];
        let owner = Arc::new(Moving::default());
        // SAFETY: `memory` outlives the tensors and nothing else touches it meanwhile.
        let shared = unsafe {
            Tensor::from_movable_external(
                &[4],
                DType::F32,
                memory.as_mut_ptr().cast(),
                owner.clone(),
            )
        }
        .unwrap();
        let mut tensors = vec![Tensor::from_f32(&[1], vec![0.0]).unwrap(), shared];
        let added = with_memory_checked(&mut tensors, |t| {
            t[1].add_scaled_f32(0, &[1.0; 4], 1.0).unwrap();
            "added"
        });
        assert_eq!(added, Ok("added"));
        owner.moved.store(true, Ordering::SeqCst);
        let mut ran = false;
        let refused = with_memory_checked(&mut tensors, |_| ran = true);
        assert!(!ran, "nothing runs once the memory moved");
        assert_eq!(
            refused,
            Err(TensorError::MemoryMoved {
                index: 1,
                why: "moved".into()
            })
        );
        drop(tensors);
        assert_eq!(memory, vec![2.0; 4], "only the checked access wrote");
    }

    #[test]
    fn bad_pointers_and_shapes_are_refused() {
        let mut memory = vec![0u8; 16];
        let base = memory.as_mut_ptr();
        // SAFETY: each call fails before any element could be touched.
        unsafe {
            assert!(Tensor::from_external(&[2], DType::F32, std::ptr::null_mut(), ()).is_err());
            let odd = base.add(usize::from((base as usize).is_multiple_of(2)));
            assert!(Tensor::from_external(&[2], DType::F16, odd, ()).is_err());
            assert!(Tensor::from_external(&[usize::MAX, 2], DType::F32, base, ()).is_err());
            let empty = Tensor::from_external(&[0, 4], DType::F32, std::ptr::null_mut(), ());
            assert_eq!(empty.unwrap().numel(), 0);
        }
    }
}
