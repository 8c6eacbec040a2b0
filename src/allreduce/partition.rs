//! Tensors -> parts -> contiguous spans of parts per peer.
//!
//! Every tensor is flattened (no copy) and cut into runs of at most `part_size_values`
//! elements, where `part_size_values = part_size_bytes / (element size × codec ratio)`, so that a
//! compressed part is about `part_size_bytes` on the wire. Parts never cross tensor boundaries;
//! an empty tensor still yields one empty part (so every tensor has at least one part and
//! assembly is uniform), and a scalar is one element.
//!
//! Peers own contiguous ranges of the concatenated flat data, sized by their fractions:
//! `pivots[i] = floor(cumsum(fractions)[i] / sum(fractions) · T)`, `pivots[last] = T`. Each part
//! goes to the peer whose range overlaps it most (first such peer on ties), so every peer gets a
//! contiguous, ordered span of parts. A peer with fraction 0 never gets a part, not even an
//! empty one (hivemind can hand an empty part at a pivot to such a peer; we give it to the next
//! peer with a positive fraction instead). All members of a group compute the same partition
//! from the same tensor descriptors, fractions, part size and compression.

use std::ops::Range;

use crate::compression::Compression;
use crate::tensor::{DType, Tensor};

/// Default part size: 512 KiB on the wire, as in hivemind.
pub const DEFAULT_PART_SIZE_BYTES: usize = 1 << 19;

/// Shape and dtype of one tensor (all a peer needs to agree on a partition).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorDescriptor {
    /// Shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
}

impl TensorDescriptor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The descriptor of `tensor`.
    pub fn of(tensor: &Tensor) -> Self {
        Self {
            shape: tensor.shape().to_vec(),
            dtype: tensor.dtype(),
        }
    }
}

/// One part: a run of elements of one flattened tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartSpec {
    /// Index of the tensor.
    pub tensor: usize,
    /// First element within the flattened tensor.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
}

impl PartSpec {
    /// The element range within the flattened tensor.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// Why a partition cannot be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PartitionError {
    /// A fraction is negative, NaN or infinite.
    #[error("peer fraction {0} is not a finite non-negative number")]
    BadFraction(f64),
    /// Every fraction is zero (nobody would reduce anything).
    #[error("all peer fractions are zero")]
    AllZero,
    /// There are no peers.
    #[error("no peers to partition among")]
    NoPeers,
    /// `part_size_bytes` is zero.
    #[error("part size must be at least one byte")]
    ZeroPartSize,
}

/// The parts of a set of tensors and which peer reduces which parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    parts: Vec<PartSpec>,
    spans: Vec<Range<usize>>,
    tensor_parts: Vec<Range<usize>>,
    total_elements: usize,
}

impl Partition {
    /// Partitions `tensors` among peers with `fractions` (one per peer, any positive scale).
    pub fn new(
        tensors: &[TensorDescriptor],
        fractions: &[f64],
        part_size_bytes: usize,
        compression: &Compression,
    ) -> Result<Self, PartitionError> {
        if fractions.is_empty() {
            return Err(PartitionError::NoPeers);
        }
        if part_size_bytes == 0 {
            return Err(PartitionError::ZeroPartSize);
        }
        if let Some(&bad) = fractions.iter().find(|f| !f.is_finite() || **f < 0.0) {
            return Err(PartitionError::BadFraction(bad));
        }
        let sum: f64 = fractions.iter().sum();
        if sum <= 0.0 {
            return Err(PartitionError::AllZero);
        }

        // Cut tensors into parts.
        let mut parts = Vec::new();
        let mut tensor_parts = Vec::with_capacity(tensors.len());
        for (t, desc) in tensors.iter().enumerate() {
            let numel = desc.numel();
            let codec = compression.codec_for(numel);
            let bytes_per_value =
                desc.dtype.size_bytes() as f64 * codec.compression_ratio(desc.dtype);
            let per_part = ((part_size_bytes as f64 / bytes_per_value) as usize).max(1);
            let first = parts.len();
            if numel == 0 {
                parts.push(PartSpec {
                    tensor: t,
                    offset: 0,
                    len: 0,
                });
            } else {
                let mut offset = 0;
                while offset < numel {
                    let len = per_part.min(numel - offset);
                    parts.push(PartSpec {
                        tensor: t,
                        offset,
                        len,
                    });
                    offset += len;
                }
            }
            tensor_parts.push(first..parts.len());
        }
        let total: usize = tensors.iter().map(TensorDescriptor::numel).sum();

        // Flat element ranges owned by each peer.
        let mut pivots = Vec::with_capacity(fractions.len());
        let mut acc = 0.0;
        for f in fractions {
            acc += f;
            pivots.push(((acc / sum) * total as f64) as usize);
        }
        *pivots.last_mut().expect("fractions is not empty") = total;
        let start_of = |p: usize| {
            if p == 0 {
                0
            } else {
                pivots[p - 1].min(pivots[p])
            }
        };
        let positive: Vec<bool> = fractions.iter().map(|&f| f > 0.0).collect();
        let last_positive = positive
            .iter()
            .rposition(|&p| p)
            .expect("sum > 0 so some fraction is positive");

        // Assign parts to peers; owners never decrease along the parts.
        let mut owners = Vec::with_capacity(parts.len());
        let mut position = 0usize;
        let mut cur = 0usize;
        for part in &parts {
            let (start, end) = (position, position + part.len);
            // First positive peer whose range ends after `start`.
            while cur < last_positive && (!positive[cur] || pivots[cur] <= start) {
                cur += 1;
            }
            let owner = if part.len == 0 {
                cur
            } else {
                let mut best = cur;
                let mut best_overlap = 0usize;
                let mut p = cur;
                while p < fractions.len() && start_of(p) < end {
                    if positive[p] {
                        let overlap = end.min(pivots[p]).saturating_sub(start.max(start_of(p)));
                        if overlap > best_overlap {
                            best = p;
                            best_overlap = overlap;
                        }
                    }
                    p += 1;
                }
                best
            };
            owners.push(owner);
            position = end;
        }

        let mut spans = vec![0..0; fractions.len()];
        let mut i = 0;
        for (p, span) in spans.iter_mut().enumerate() {
            let first = i;
            while i < owners.len() && owners[i] == p {
                i += 1;
            }
            *span = first..i;
        }
        debug_assert_eq!(i, owners.len(), "owners are non-decreasing");

        Ok(Self {
            parts,
            spans,
            tensor_parts,
            total_elements: total,
        })
    }

    /// All parts, in order.
    pub fn parts(&self) -> &[PartSpec] {
        &self.parts
    }

    /// Part `index`.
    pub fn part(&self, index: usize) -> &PartSpec {
        &self.parts[index]
    }

    /// Number of parts.
    pub fn num_parts(&self) -> usize {
        self.parts.len()
    }

    /// Number of peers.
    pub fn num_peers(&self) -> usize {
        self.spans.len()
    }

    /// The (global) part indices reduced by `peer`.
    pub fn span(&self, peer: usize) -> Range<usize> {
        self.spans[peer].clone()
    }

    /// The peer that reduces part `index`.
    pub fn owner(&self, index: usize) -> Option<usize> {
        self.spans.iter().position(|s| s.contains(&index))
    }

    /// The part indices of tensor `tensor`.
    pub fn tensor_parts(&self, tensor: usize) -> Range<usize> {
        self.tensor_parts[tensor].clone()
    }

    /// Total number of elements over all tensors.
    pub fn total_elements(&self) -> usize {
        self.total_elements
    }

    /// Number of elements reduced by `peer`.
    pub fn span_elements(&self, peer: usize) -> usize {
        self.parts[self.span(peer)].iter().map(|p| p.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compression::CompressionType;
    use proptest::prelude::*;

    fn desc(shape: &[usize]) -> TensorDescriptor {
        TensorDescriptor {
            shape: shape.to_vec(),
            dtype: DType::F32,
        }
    }

    /// Round trip as in hivemind's `test_partitioning`: every part is read from the inputs,
    /// transformed and written back at its place; the outputs must equal the transform of the
    /// inputs.
    fn check_round_trip(shapes: &[Vec<usize>], fractions: &[f64], part_size_bytes: usize) {
        let descs: Vec<_> = shapes.iter().map(|s| desc(s)).collect();
        let tensors: Vec<Tensor> = descs
            .iter()
            .enumerate()
            .map(|(t, d)| {
                let n = d.numel();
                Tensor::from_f32(
                    &d.shape,
                    (0..n).map(|i| (i + 7 * t) as f32 * 0.01).collect(),
                )
                .unwrap()
            })
            .collect();
        let p =
            Partition::new(&descs, fractions, part_size_bytes, &Compression::default()).unwrap();
        // Spans tile the parts in order.
        let mut next = 0;
        for peer in 0..fractions.len() {
            let s = p.span(peer);
            assert_eq!(s.start, next, "spans are contiguous");
            next = s.end;
            if fractions[peer] == 0.0 {
                assert!(s.is_empty(), "zero fraction => no parts, got {s:?}");
            }
        }
        assert_eq!(next, p.num_parts());
        let mut outputs: Vec<Vec<f32>> = descs.iter().map(|d| vec![f32::NAN; d.numel()]).collect();
        for peer in 0..fractions.len() {
            for g in p.span(peer) {
                let spec = p.part(g);
                assert!(spec.len as f64 * 4.0 <= part_size_bytes.max(4) as f64);
                let input = tensors[spec.tensor].part(spec.range());
                for (k, i) in spec.range().enumerate() {
                    outputs[spec.tensor][i] = input.get_f32(k).sin();
                }
            }
        }
        for (t, out) in tensors.iter().zip(&outputs) {
            let want: Vec<f32> = t.to_f32_vec().iter().map(|v| v.sin()).collect();
            assert_eq!(out, &want);
        }
        for t in 0..descs.len() {
            let r = p.tensor_parts(t);
            assert!(!r.is_empty(), "every tensor has at least one part");
            assert_eq!(
                p.parts()[r].iter().map(|s| s.len).sum::<usize>(),
                descs[t].numel()
            );
        }
    }

    #[test]
    fn partitioning_like_hivemind() {
        let pool: Vec<Vec<usize>> = vec![
            vec![3000, 128],
            vec![128],
            vec![1, 1, 1, 1, 1, 1, 8],
            vec![1, 0],
            vec![0],
            vec![],
            vec![65536],
            vec![512, 204],
            vec![1020],
            vec![4096],
        ];
        let fractions: [&[f64]; 4] = [
            &[1.0, 1.0],
            &[0.333, 0.1667, 0.5003],
            &[1.0, 0.0],
            &[0.0, 0.4, 0.6, 0.0],
        ];
        for &part_size in &[31337usize, 1 << 20, 10_000_000_000] {
            for fr in fractions {
                for k in [1usize, 3, 5] {
                    for start in [0usize, 3, 6] {
                        let shapes: Vec<_> = (0..k)
                            .map(|i| pool[(start + i * 3) % pool.len()].clone())
                            .collect();
                        check_round_trip(&shapes, fr, part_size);
                    }
                }
            }
        }
    }

    #[test]
    fn partitioning_edge_cases() {
        let sets: [&[&[usize]]; 3] = [&[&[0]], &[&[0], &[0], &[1]], &[&[0], &[999], &[0], &[0]]];
        let fractions: [&[f64]; 5] = [
            &[0.33, 0.44, 0.23],
            &[0.5, 0.5],
            &[0.1, 0.0, 0.9],
            &[1.0],
            &[0.1; 9],
        ];
        for set in sets {
            let shapes: Vec<Vec<usize>> = set.iter().map(|s| s.to_vec()).collect();
            for fr in fractions {
                check_round_trip(&shapes, fr, 16);
            }
        }
    }

    #[test]
    fn zero_fraction_peer_gets_no_empty_part() {
        // hivemind hands the empty first tensor to peer 0 here; we must not.
        let p = Partition::new(
            &[desc(&[0]), desc(&[10])],
            &[0.0, 1.0],
            16,
            &Compression::default(),
        )
        .unwrap();
        assert!(p.span(0).is_empty());
        assert_eq!(p.span(1), 0..p.num_parts());
    }

    #[test]
    fn part_sizes_follow_compression() {
        let d = [desc(&[1 << 20])];
        let none = Partition::new(&d, &[1.0], 1 << 19, &Compression::default()).unwrap();
        assert_eq!(none.part(0).len, 131072);
        let f16 = Partition::new(
            &d,
            &[1.0],
            1 << 19,
            &Compression::Fixed(CompressionType::Float16),
        )
        .unwrap();
        assert_eq!(f16.part(0).len, 262144);
        let u8 = Partition::new(
            &d,
            &[1.0],
            1 << 19,
            &Compression::Fixed(CompressionType::Uniform8Bit),
        )
        .unwrap();
        assert_eq!(u8.part(0).len, 524288);
    }

    #[test]
    fn rejects_bad_fractions() {
        let d = [desc(&[4])];
        let c = Compression::default();
        assert_eq!(
            Partition::new(&d, &[], 16, &c),
            Err(PartitionError::NoPeers)
        );
        assert_eq!(
            Partition::new(&d, &[0.0, 0.0], 16, &c),
            Err(PartitionError::AllZero)
        );
        assert!(matches!(
            Partition::new(&d, &[f64::NAN], 16, &c),
            Err(PartitionError::BadFraction(_))
        ));
        assert_eq!(
            Partition::new(&d, &[1.0], 0, &c),
            Err(PartitionError::ZeroPartSize)
        );
    }

    proptest! {
        #[test]
        fn spans_are_contiguous_and_proportional(
            sizes in proptest::collection::vec(0usize..3000, 1..6),
            fractions in proptest::collection::vec(prop_oneof![Just(0.0), 0.01f64..10.0], 1..10),
            part_size in 4usize..5000,
        ) {
            prop_assume!(fractions.iter().sum::<f64>() > 0.0);
            let shapes: Vec<Vec<usize>> = sizes.iter().map(|&n| vec![n]).collect();
            check_round_trip(&shapes, &fractions, part_size);
            // A peer's share deviates from its ideal by less than one part on each side.
            let descs: Vec<_> = shapes.iter().map(|s| desc(s)).collect();
            let p = Partition::new(&descs, &fractions, part_size, &Compression::default()).unwrap();
            let total: usize = sizes.iter().sum();
            let sum: f64 = fractions.iter().sum();
            let max_part = p.parts().iter().map(|s| s.len).max().unwrap_or(0);
            for (peer, f) in fractions.iter().enumerate() {
                let ideal = f / sum * total as f64;
                let got = p.span_elements(peer) as f64;
                prop_assert!((got - ideal).abs() <= 2.0 * max_part as f64 + 1.0,
                    "peer {} got {} ideal {}", peer, got, ideal);
            }
        }
    }
}
