//! Which donor's state a newcomer installs: the caller's trust, not the donor's word.
//!
//! A donor announces its own priority, so by priority alone a sybil announcing `1e300` and
//! serving zeros (or NaNs) wins every download. [`Trust`] lets the caller decide instead:
//!
//! * **An allowlist** ([`Trust::allow`]): only these peers are asked at all (a team's own
//!   machines, say).
//! * **Agreement** ([`Trust::min_agreeing`]): a state is downloaded only once at least this many
//!   donors, asked in priority order, serve the same content hash (SHA-256 over the whole
//!   state, [`super::wire::content_hash`]). One peer, whatever it announces, then needs
//!   `min_agreeing - 1` accomplices with byte-identical states; the newcomer keeps asking further
//!   donors (batches of [`super::StateConfig::max_donors`]) until a hash is agreed or the
//!   candidates run out ([`super::DonorError::Unconfirmed`]). Donors hold byte-identical states
//!   right after they averaged in one group and before they train on (the usual case for a
//!   swarm's stable donors); the default, 1, trusts the best-priority answer, as hivemind does.
//!
//!   **What it counts, precisely: distinct peer ids** (one answer per announced donor), and
//!   nothing else: not addresses, not machines, not stake. Peer ids cost nothing to make, so
//!   `min_agreeing = k` stops a wrong state served by **fewer than `k` identities** (one lying
//!   or broken donor, a donor whose state diverged, a handful of uncoordinated bad peers), and
//!   a lone identity's priority claim. It does **not** stop `k` sybils run by one attacker that
//!   serve byte-identical states (zeros, say) and announce top priorities: they agree, and
//!   their state is installed (`tests/integration/state_sharing.rs::sybils_that_agree_satisfy_min_agreeing`
//!   pins this down, and that two such sybils fall short of `min_agreeing = 3`). Against an
//!   attacker with many identities only the allowlist helps (or a `k` above what the attacker
//!   can run, which honest donors must then also reach).
//! * **Finite values, always**: a state holding a NaN or an infinity is never installed or
//!   returned; its donors are skipped ([`super::DonorError::NonFinite`]) and the next content
//!   hash is tried.

use std::collections::HashSet;

use libp2p::PeerId;

use crate::allreduce::TensorDescriptor;
use crate::tensor::DType;

/// The newcomer's trust in donors (module docs). The default trusts any donor's best-priority
/// answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trust {
    /// Only these peers may serve the state (`None`: any peer).
    pub allow: Option<HashSet<PeerId>>,
    /// Distinct donors (peer ids) that must serve one content hash before it is downloaded
    /// (at least 1). Sybils serving identical states count as distinct donors (module docs).
    pub min_agreeing: usize,
}

impl Default for Trust {
    fn default() -> Self {
        Self {
            allow: None,
            min_agreeing: 1,
        }
    }
}

impl Trust {
    /// Whether `peer` may be asked.
    pub fn allows(&self, peer: &PeerId) -> bool {
        self.allow.as_ref().is_none_or(|a| a.contains(peer))
    }

    /// The first content hash, in the order given (priority order), that at least
    /// [`min_agreeing`](Self::min_agreeing) of `hashes` share.
    pub fn agreed<'a, H: Eq + 'a>(
        &self,
        hashes: impl Iterator<Item = &'a H> + Clone,
    ) -> Option<&'a H> {
        let need = self.min_agreeing.max(1);
        hashes
            .clone()
            .find(|h| hashes.clone().filter(|o| o == h).count() >= need)
    }
}

/// Whether every value of a downloaded state (`tensors` laid out one after another in `data`,
/// little-endian) is finite.
pub(super) fn all_finite(data: &[u8], tensors: &[TensorDescriptor]) -> bool {
    let mut offset = 0;
    for t in tensors {
        let len = t.shape.iter().product::<usize>() * t.dtype.size_bytes();
        let Some(bytes) = data.get(offset..offset + len) else {
            return false;
        };
        offset += len;
        let finite = match t.dtype {
            DType::F32 => crate::tensor::ops::all_finite_le(bytes),
            DType::F16 => halves_finite(bytes, 0x7c00),
            DType::BF16 => halves_finite(bytes, 0x7f80),
        };
        if !finite {
            return false;
        }
    }
    true
}

/// 16-bit floats: finite unless every bit of the exponent (`exp`) is set.
fn halves_finite(bytes: &[u8], exp: u16) -> bool {
    bytes
        .as_chunks::<2>()
        .0
        .iter()
        .all(|c| u16::from_le_bytes(*c) & exp != exp)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn agreement_picks_the_first_hash_enough_donors_share() {
        let one = Trust::default();
        let two = Trust {
            min_agreeing: 2,
            ..Trust::default()
        };
        let hashes = [1, 2, 2, 3, 1];
        assert_eq!(one.agreed(hashes.iter()), Some(&1));
        // 1 comes first in priority order and is also served twice.
        assert_eq!(two.agreed(hashes.iter()), Some(&1));
        assert_eq!(two.agreed([9, 2, 2].iter()), Some(&2));
        assert_eq!(two.agreed([9, 2, 3].iter()), None);
        assert_eq!(one.agreed(std::iter::empty::<&u8>()), None);
        let zero = Trust {
            min_agreeing: 0,
            ..Trust::default()
        };
        assert_eq!(zero.agreed([4].iter()), Some(&4));
    }

    #[test]
    fn the_allowlist_admits_only_its_peers() {
        let a = PeerId::random();
        let b = PeerId::random();
        assert!(Trust::default().allows(&a));
        let only_a = Trust {
            allow: Some([a].into()),
            ..Trust::default()
        };
        assert!(only_a.allows(&a));
        assert!(!only_a.allows(&b));
    }

    #[test]
    fn non_finite_values_of_every_dtype_are_found() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let descs = vec![
                TensorDescriptor {
                    shape: vec![3],
                    dtype,
                },
                TensorDescriptor {
                    shape: vec![2, 2],
                    dtype,
                },
            ];
            let mut values = [1.0f32, -2.5, 0.0, 1e-3, 7.0, -0.0, 65000.0];
            let bytes = |v: &[f32]| -> Vec<u8> {
                let mut out = Vec::new();
                for (d, part) in descs.iter().zip([&v[..3], &v[3..]]) {
                    let t = Tensor::from_f32_as(&d.shape, part, dtype).unwrap();
                    out.extend_from_slice(t.flat().as_bytes());
                }
                out
            };
            assert!(all_finite(&bytes(&values), &descs), "{dtype:?}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for i in 0..values.len() {
                    let saved = values[i];
                    values[i] = bad;
                    assert!(
                        !all_finite(&bytes(&values), &descs),
                        "{dtype:?} {bad} at {i}"
                    );
                    values[i] = saved;
                }
            }
            // Too few bytes for the description: not a state.
            assert!(!all_finite(&bytes(&values)[1..], &descs));
        }
    }
}
