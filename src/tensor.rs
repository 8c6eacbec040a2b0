//! Tensors: a shape, a dtype (f32, f16, bf16) and a contiguous CPU buffer on ndarray.
//!
//! The all-reduce never looks at shapes: it flattens every tensor (a no-copy view, since a
//! [`Tensor`] is always kept in standard row-major layout) and cuts the flat data into parts.
//! [`PartView`] is such a borrowed run of elements in the tensor's own dtype; [`ops`] holds the
//! few numeric kernels the reducer needs, behind the [`ops::ReduceKernel`] trait that a GPU
//! kernel can implement as well.

pub mod dlpack;
mod external;
pub mod ops;

pub use external::{External, MovableMemory, with_memory_checked};

use half::{bf16, f16};
use ndarray::{ArrayD, IxDyn};

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// Stable lower-case name, as used on the wire and in the schema hash.
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::BF16 => "bfloat16",
        }
    }

    /// Parses [`DType::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "float32" => Some(Self::F32),
            "float16" => Some(Self::F16),
            "bfloat16" => Some(Self::BF16),
            _ => None,
        }
    }

    /// Wire code (see `proto/hivemesh/averaging.proto`).
    pub const fn code(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::BF16 => 2,
        }
    }

    /// Inverse of [`DType::code`].
    pub const fn from_code(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::F32),
            1 => Some(Self::F16),
            2 => Some(Self::BF16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors from building or combining tensors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TensorError {
    /// The number of values does not match the product of the shape.
    #[error("shape {shape:?} needs {expected} values, got {actual}")]
    ShapeMismatch {
        /// Requested shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements supplied.
        actual: usize,
    },
    /// Two tensors that must agree in dtype or length do not.
    #[error("tensor mismatch: {0}")]
    Mismatch(String),
    /// An external tensor's memory was freed or moved by its owner
    /// ([`MovableMemory`]); nothing was read or written.
    #[error("tensor {index}'s memory changed under the averager: {why}")]
    MemoryMoved {
        /// The tensor's position in the list checked.
        index: usize,
        /// What the owner found.
        why: String,
    },
}

/// A dense tensor in standard (row-major, contiguous) layout.
///
/// Cloning copies the elements, also for an [`External`] tensor (the copy owns them).
/// Equality compares dtype, shape and elements, whoever holds them.
#[derive(Debug)]
pub enum Tensor {
    /// f32 elements.
    F32(ArrayD<f32>),
    /// f16 elements.
    F16(ArrayD<f16>),
    /// bf16 elements.
    BF16(ArrayD<bf16>),
    /// Elements in memory the tensor does not own, such as a PyTorch tensor's storage shared
    /// with Python ([`Tensor::from_external`]).
    External(External),
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        match self {
            Self::F32(a) => Self::F32(a.clone()),
            Self::F16(a) => Self::F16(a.clone()),
            Self::BF16(a) => Self::BF16(a.clone()),
            Self::External(e) => e.to_owned_tensor(),
        }
    }
}

impl PartialEq for Tensor {
    fn eq(&self, other: &Self) -> bool {
        self.dtype() == other.dtype()
            && self.shape() == other.shape()
            && self.flat() == other.flat()
    }
}

/// Makes an array's layout standard, copying only when it is not.
fn standard<T: Clone>(a: ArrayD<T>) -> ArrayD<T> {
    if a.is_standard_layout() {
        a
    } else {
        a.as_standard_layout().into_owned()
    }
}

/// The number of elements of `shape`, where they fit in memory as `dtype` (no overflow, at
/// most `isize::MAX` bytes: what a slice over them needs).
pub fn addressable_numel(shape: &[usize], dtype: DType) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|n| {
            n.checked_mul(dtype.size_bytes())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
}

fn checked_shape(shape: &[usize], len: usize) -> Result<(), TensorError> {
    let expected = shape.iter().product::<usize>();
    if expected == len {
        Ok(())
    } else {
        Err(TensorError::ShapeMismatch {
            shape: shape.to_vec(),
            expected,
            actual: len,
        })
    }
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Self {
        let dim = IxDyn(shape);
        match dtype {
            DType::F32 => Self::F32(ArrayD::zeros(dim)),
            DType::F16 => Self::F16(ArrayD::from_elem(dim, f16::ZERO)),
            DType::BF16 => Self::BF16(ArrayD::from_elem(dim, bf16::ZERO)),
        }
    }

    /// A tensor of `dtype` from its raw row-major little-endian bytes (what
    /// [`PartView::as_bytes`] of [`Tensor::flat`] gives), e.g. a state received from a peer.
    pub fn from_le_bytes(shape: &[usize], dtype: DType, bytes: &[u8]) -> Result<Self, TensorError> {
        let numel = addressable_numel(shape, dtype).ok_or_else(|| {
            TensorError::Mismatch(format!("shape {shape:?} of {} is too large", dtype.name()))
        })?;
        if numel * dtype.size_bytes() != bytes.len() {
            return Err(TensorError::Mismatch(format!(
                "{} bytes for shape {shape:?} of {}",
                bytes.len(),
                dtype.name()
            )));
        }
        let mut t = Self::zeros(shape, dtype);
        match t.flat_mut() {
            PartViewMut::F32(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
            PartViewMut::F16(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
            PartViewMut::BF16(s) => bytemuck::cast_slice_mut::<_, u8>(s).copy_from_slice(bytes),
        }
        Ok(t)
    }

    /// An f32 tensor from row-major values.
    pub fn from_f32(shape: &[usize], values: Vec<f32>) -> Result<Self, TensorError> {
        checked_shape(shape, values.len())?;
        ArrayD::from_shape_vec(IxDyn(shape), values)
            .map(Self::F32)
            .map_err(|e| TensorError::Mismatch(e.to_string()))
    }

    /// A tensor of `dtype` from row-major f32 values (rounded to nearest for f16/bf16).
    pub fn from_f32_as(shape: &[usize], values: &[f32], dtype: DType) -> Result<Self, TensorError> {
        checked_shape(shape, values.len())?;
        let dim = IxDyn(shape);
        let t = match dtype {
            DType::F32 => ArrayD::from_shape_vec(dim, values.to_vec()).map(Self::F32),
            DType::F16 => {
                ArrayD::from_shape_vec(dim, values.iter().map(|&v| f16::from_f32(v)).collect())
                    .map(Self::F16)
            }
            DType::BF16 => {
                ArrayD::from_shape_vec(dim, values.iter().map(|&v| bf16::from_f32(v)).collect())
                    .map(Self::BF16)
            }
        };
        t.map_err(|e| TensorError::Mismatch(e.to_string()))
    }

    /// Wraps an f32 ndarray (copied only if it is not in standard layout).
    pub fn from_array_f32(a: ArrayD<f32>) -> Self {
        Self::F32(standard(a))
    }

    /// Wraps an f16 ndarray (copied only if it is not in standard layout).
    pub fn from_array_f16(a: ArrayD<f16>) -> Self {
        Self::F16(standard(a))
    }

    /// Wraps a bf16 ndarray (copied only if it is not in standard layout).
    pub fn from_array_bf16(a: ArrayD<bf16>) -> Self {
        Self::BF16(standard(a))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Self::F32(_) => DType::F32,
            Self::F16(_) => DType::F16,
            Self::BF16(_) => DType::BF16,
            Self::External(e) => e.dtype(),
        }
    }

    /// The shape (empty for a scalar).
    pub fn shape(&self) -> &[usize] {
        match self {
            Self::F32(a) => a.shape(),
            Self::F16(a) => a.shape(),
            Self::BF16(a) => a.shape(),
            Self::External(e) => e.shape(),
        }
    }

    /// Number of elements (1 for a scalar, 0 if any dimension is 0).
    pub fn numel(&self) -> usize {
        match self {
            Self::F32(a) => a.len(),
            Self::F16(a) => a.len(),
            Self::BF16(a) => a.len(),
            Self::External(e) => e.numel(),
        }
    }

    /// Size of the data in bytes.
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype().size_bytes()
    }

    /// The flattened data, without copying.
    pub fn flat(&self) -> PartView<'_> {
        // Invariant: every constructor keeps standard layout, so `as_slice` always succeeds.
        match self {
            Self::F32(a) => PartView::F32(a.as_slice().expect("tensor kept in standard layout")),
            Self::F16(a) => PartView::F16(a.as_slice().expect("tensor kept in standard layout")),
            Self::BF16(a) => PartView::BF16(a.as_slice().expect("tensor kept in standard layout")),
            Self::External(e) => e.view(),
        }
    }

    /// The flattened data, mutable, without copying.
    pub fn flat_mut(&mut self) -> PartViewMut<'_> {
        match self {
            Self::F32(a) => {
                PartViewMut::F32(a.as_slice_mut().expect("tensor kept in standard layout"))
            }
            Self::F16(a) => {
                PartViewMut::F16(a.as_slice_mut().expect("tensor kept in standard layout"))
            }
            Self::BF16(a) => {
                PartViewMut::BF16(a.as_slice_mut().expect("tensor kept in standard layout"))
            }
            Self::External(e) => e.view_mut(),
        }
    }

    /// Elements `range` of the flattened data, without copying. Panics if out of bounds.
    pub fn part(&self, range: std::ops::Range<usize>) -> PartView<'_> {
        self.flat().slice(range)
    }

    /// All elements converted to f32, row-major.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let flat = self.flat();
        let mut out = vec![0.0; flat.len()];
        flat.copy_to_f32(&mut out);
        out
    }

    /// `self[range] += alpha * delta` on the flattened data (computed in f32, rounded once).
    pub fn add_scaled_f32(
        &mut self,
        offset: usize,
        delta: &[f32],
        alpha: f32,
    ) -> Result<(), TensorError> {
        let n = self.numel();
        if offset + delta.len() > n {
            return Err(TensorError::Mismatch(format!(
                "delta of {} at offset {offset} exceeds {n} elements",
                delta.len()
            )));
        }
        let range = offset..offset + delta.len();
        match self.flat_mut() {
            PartViewMut::F32(x) => ops::add_scaled(&mut x[range], delta, alpha),
            PartViewMut::F16(x) => {
                for (v, &d) in x[range].iter_mut().zip(delta) {
                    *v = f16::from_f32(v.to_f32() + alpha * d);
                }
            }
            PartViewMut::BF16(x) => {
                for (v, &d) in x[range].iter_mut().zip(delta) {
                    *v = bf16::from_f32(v.to_f32() + alpha * d);
                }
            }
        }
        Ok(())
    }
}

impl Tensor {
    /// Overwrites `self[offset..]` with little-endian f32 `values` (rounded once for f16 and
    /// bf16).
    pub fn set_from_le(&mut self, offset: usize, values: &[u8]) -> Result<(), TensorError> {
        let n = self.numel();
        let len = values.len() / 4;
        if !values.len().is_multiple_of(4) || offset.checked_add(len).is_none_or(|end| end > n) {
            return Err(TensorError::Mismatch(format!(
                "{} bytes of values at offset {offset} of {n} elements",
                values.len()
            )));
        }
        let range = offset..offset + len;
        let le = values
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| f32::from_le_bytes(*b));
        match self.flat_mut() {
            PartViewMut::F32(x) => ops::copy_from_le(&mut x[range], values),
            PartViewMut::F16(x) => {
                for (v, f) in x[range].iter_mut().zip(le) {
                    *v = f16::from_f32(f);
                }
            }
            PartViewMut::BF16(x) => {
                for (v, f) in x[range].iter_mut().zip(le) {
                    *v = bf16::from_f32(f);
                }
            }
        }
        Ok(())
    }
}

impl Tensor {
    /// `self[offset..] += alpha · (average − start)` on the flattened data, for an `average`
    /// given as little-endian f32 bytes and the `start` values it is the average of this
    /// peer's contribution against (computed in f32, rounded once): the delta rule.
    pub fn add_average(
        &mut self,
        offset: usize,
        average: &[u8],
        start: PartView<'_>,
        alpha: f32,
    ) -> Result<(), TensorError> {
        let n = self.numel();
        let len = start.len();
        if Some(average.len()) != len.checked_mul(4)
            || offset.checked_add(len).is_none_or(|end| end > n)
        {
            return Err(TensorError::Mismatch(format!(
                "an average of {} bytes for {len} start values at offset {offset} of {n} elements",
                average.len()
            )));
        }
        let range = offset..offset + len;
        match (self.flat_mut(), start) {
            (PartViewMut::F32(x), PartView::F32(s)) => {
                ops::add_average_le(&mut x[range], average, s, alpha);
            }
            (target, start) => {
                let mut from = vec![0.0f32; len];
                start.copy_to_f32(&mut from);
                let mut delta = vec![0.0f32; len];
                ops::copy_from_le(&mut delta, average);
                ops::sub_assign(&mut delta, &from);
                match target {
                    PartViewMut::F32(x) => ops::add_scaled(&mut x[range], &delta, alpha),
                    PartViewMut::F16(x) => {
                        for (v, &d) in x[range].iter_mut().zip(&delta) {
                            *v = f16::from_f32(v.to_f32() + alpha * d);
                        }
                    }
                    PartViewMut::BF16(x) => {
                        for (v, &d) in x[range].iter_mut().zip(&delta) {
                            *v = bf16::from_f32(v.to_f32() + alpha * d);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A borrowed run of elements of one tensor, in the tensor's dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PartView<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
}

impl<'a> PartView<'a> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(s) => s.len(),
            Self::F16(s) => s.len(),
            Self::BF16(s) => s.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            Self::F32(_) => DType::F32,
            Self::F16(_) => DType::F16,
            Self::BF16(_) => DType::BF16,
        }
    }

    /// A sub-range, without copying. Panics if out of bounds.
    pub fn slice(&self, range: std::ops::Range<usize>) -> PartView<'a> {
        match *self {
            Self::F32(s) => Self::F32(&s[range]),
            Self::F16(s) => Self::F16(&s[range]),
            Self::BF16(s) => Self::BF16(&s[range]),
        }
    }

    /// Element `i` as f32.
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            Self::F32(s) => s[i],
            Self::F16(s) => s[i].to_f32(),
            Self::BF16(s) => s[i].to_f32(),
        }
    }

    /// Converts into `out` (which must have the same length).
    pub fn copy_to_f32(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.len(), "copy_to_f32 length mismatch");
        match self {
            Self::F32(s) => out.copy_from_slice(s),
            Self::F16(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = v.to_f32();
                }
            }
            Self::BF16(s) => {
                for (o, v) in out.iter_mut().zip(s.iter()) {
                    *o = v.to_f32();
                }
            }
        }
    }

    /// The raw little-endian bytes of the elements (no copy).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            Self::F32(s) => bytemuck::cast_slice(s),
            Self::F16(s) => bytemuck::cast_slice(s),
            Self::BF16(s) => bytemuck::cast_slice(s),
        }
    }
}

/// A mutable borrowed run of elements of one tensor.
#[derive(Debug)]
pub enum PartViewMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_views() {
        let t = Tensor::from_f32(&[2, 3], (0..6).map(|v| v as f32).collect()).unwrap();
        assert_eq!(t.numel(), 6);
        assert_eq!(t.size_bytes(), 24);
        assert_eq!(t.part(2..4), PartView::F32(&[2.0, 3.0]));
        let s = Tensor::zeros(&[], DType::F16);
        assert_eq!(s.numel(), 1);
        let e = Tensor::zeros(&[1, 0], DType::BF16);
        assert_eq!(e.numel(), 0);
        assert!(e.flat().is_empty());
        assert!(matches!(
            Tensor::from_f32(&[2, 2], vec![1.0]),
            Err(TensorError::ShapeMismatch {
                expected: 4,
                actual: 1,
                ..
            })
        ));
    }

    #[test]
    fn non_standard_layout_is_made_contiguous() {
        let a = ndarray::Array2::from_shape_fn((3, 4), |(i, j)| (i * 4 + j) as f32)
            .reversed_axes()
            .into_dyn();
        let t = Tensor::from_array_f32(a.clone());
        assert_eq!(t.shape(), &[4, 3]);
        assert_eq!(t.flat().get_f32(1), a[[0, 1]]);
    }

    #[test]
    fn add_scaled_all_dtypes() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let mut t = Tensor::from_f32_as(&[4], &[1.0, 2.0, 3.0, 4.0], dtype).unwrap();
            t.add_scaled_f32(1, &[1.0, -1.0], 0.5).unwrap();
            assert_eq!(t.to_f32_vec(), vec![1.0, 2.5, 2.5, 4.0]);
            assert!(t.add_scaled_f32(3, &[1.0, 1.0], 1.0).is_err());
        }
        assert_eq!(DType::from_code(DType::BF16.code()), Some(DType::BF16));
        assert_eq!(DType::from_name("float16"), Some(DType::F16));
    }
}
