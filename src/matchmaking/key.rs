//! Group keys: [`GroupKey`] (`"{prefix}.0b{bits}"`), the [`KeyManager`] that rotates the bits
//! after every assembled group (hivemind's `GroupKeyManager`), and the Moshpit [`Grid`].

use std::fmt;
use std::str::FromStr;

use super::{Group, PeerId};

/// Longest accepted prefix, in bytes.
pub const MAX_PREFIX_BYTES: usize = 128;
/// Most group bits a key may hold.
pub const MAX_GROUP_BITS: usize = 64;
/// Longest accepted group key, in bytes (`prefix` + `".0b"` + bits, with room to spare).
pub const MAX_GROUP_KEY_BYTES: usize = 256;

/// A malformed key, bit string or grid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The prefix is empty.
    #[error("empty prefix")]
    EmptyPrefix,
    /// The prefix contains a `.` (it would make keys ambiguous).
    #[error("prefix '{0}' contains '.'")]
    DotInPrefix(String),
    /// The prefix is longer than [`MAX_PREFIX_BYTES`].
    #[error("prefix of {0} bytes (at most {MAX_PREFIX_BYTES})")]
    PrefixTooLong(usize),
    /// The bits contain something other than `0` and `1`.
    #[error("group bits '{0}' are not a string of 0 and 1")]
    BadBits(String),
    /// More than [`MAX_GROUP_BITS`] bits.
    #[error("{0} group bits (at most {MAX_GROUP_BITS})")]
    TooManyBits(usize),
    /// A key without the `".0b"` separator.
    #[error("'{0}' is not of the form '{{prefix}}.0b{{bits}}'")]
    Malformed(String),
    /// A grid with a side below 2, no dimensions, or more cells than fit the key bits.
    #[error(
        "grid {side}^{dims} is not usable (side >= 2, dims >= 1, at most {MAX_GROUP_BITS} key bits)"
    )]
    BadGrid {
        /// Peers per dimension.
        side: usize,
        /// Dimensions.
        dims: usize,
    },
    /// Coordinates that do not fit the grid.
    #[error("coordinates {coords:?} do not fit a {side}^{dims} grid")]
    BadCoords {
        /// The coordinates given.
        coords: Vec<usize>,
        /// Peers per dimension.
        side: usize,
        /// Dimensions.
        dims: usize,
    },
}

/// The DHT key of a matchmaking bucket: `"{prefix}.0b{bits}"` (hivemind's format; the prefix
/// holds no `.`, the bits are `0`/`1`, possibly none). Peers under the same key look for a group
/// together.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupKey {
    key: String,
    prefix_len: usize,
}

fn check_prefix(prefix: &str) -> Result<(), KeyError> {
    if prefix.is_empty() {
        return Err(KeyError::EmptyPrefix);
    }
    if prefix.len() > MAX_PREFIX_BYTES {
        return Err(KeyError::PrefixTooLong(prefix.len()));
    }
    if prefix.contains('.') {
        return Err(KeyError::DotInPrefix(prefix.to_owned()));
    }
    Ok(())
}

fn check_bits(bits: &str) -> Result<(), KeyError> {
    if !bits.bytes().all(|b| b == b'0' || b == b'1') {
        return Err(KeyError::BadBits(bits.to_owned()));
    }
    if bits.len() > MAX_GROUP_BITS {
        return Err(KeyError::TooManyBits(bits.len()));
    }
    Ok(())
}

impl GroupKey {
    /// The key for `prefix` and `bits`.
    pub fn new(prefix: &str, bits: &str) -> Result<Self, KeyError> {
        check_prefix(prefix)?;
        check_bits(bits)?;
        Ok(Self {
            key: format!("{prefix}.0b{bits}"),
            prefix_len: prefix.len(),
        })
    }

    /// Parses `"{prefix}.0b{bits}"`.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (prefix, bits) = s
            .split_once(".0b")
            .ok_or_else(|| KeyError::Malformed(s.chars().take(64).collect()))?;
        Self::new(prefix, bits)
    }

    /// The prefix (the averager's namespace).
    pub fn prefix(&self) -> &str {
        &self.key[..self.prefix_len]
    }

    /// The group bits.
    pub fn bits(&self) -> &str {
        &self.key[self.prefix_len + 3..]
    }

    /// The whole key.
    pub fn as_str(&self) -> &str {
        &self.key
    }

    /// The key as DHT key bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.key.as_bytes()
    }
}

impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

impl FromStr for GroupKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Keeps one averager's group bits across steps (hivemind's `GroupKeyManager`).
///
/// The bits keep their length forever. After every assembled group each member calls
/// [`KeyManager::update_on_group_assembled`]: the group id seeds a draw of distinct bucket
/// indices, one per member position ([`next_bits`]), so members that just averaged together
/// move to different buckets and the next groups mix other peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyManager {
    prefix: String,
    bits: String,
    target_group_size: Option<usize>,
}

impl KeyManager {
    /// A manager for `prefix` starting at `initial_bits` (hivemind's `initial_group_bits`,
    /// default `""`), for groups of `target_group_size` (`None`: any size).
    pub fn new(
        prefix: &str,
        initial_bits: &str,
        target_group_size: Option<usize>,
    ) -> Result<Self, KeyError> {
        check_prefix(prefix)?;
        check_bits(initial_bits)?;
        Ok(Self {
            prefix: prefix.to_owned(),
            bits: initial_bits.to_owned(),
            target_group_size,
        })
    }

    /// The key to look for a group under now.
    pub fn key(&self) -> GroupKey {
        GroupKey {
            key: format!("{}.0b{}", self.prefix, self.bits),
            prefix_len: self.prefix.len(),
        }
    }

    /// The current bits.
    pub fn bits(&self) -> &str {
        &self.bits
    }

    /// Replaces the bits (hivemind's `set_group_bits`; the length may change).
    pub fn set_bits(&mut self, bits: &str) -> Result<(), KeyError> {
        check_bits(bits)?;
        self.bits = bits.to_owned();
        Ok(())
    }

    /// Rotates the bits after `group` was assembled (the same on every member, see
    /// [`next_bits`]).
    pub fn update_on_group_assembled(&mut self, group: &Group) {
        self.bits = next_bits(
            &self.bits,
            &group.group_id,
            group.me,
            group.members.len(),
            self.target_group_size,
        );
    }
}

/// FNV-1a, 64 bit: a fixed, portable hash (every member must compute the same value).
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// splitmix64: a fixed, portable stream of pseudo-random words.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Bits needed to write every index below `n` (0 for `n <= 1`).
fn bits_for(n: usize) -> usize {
    if n <= 1 {
        0
    } else {
        (usize::BITS - (n - 1).leading_zeros()) as usize
    }
}

/// The bits a member at `position` of a group of `group_size` with id `group_id` moves to
/// (hivemind's `update_key_on_group_assembled`).
///
/// `num_buckets` = `target_group_size` (or the next power of two of the group size without a
/// target; never fewer than the group size, where hivemind would raise); the group id seeds a
/// draw of `group_size` distinct bucket indices (partial Fisher-Yates over splitmix64 seeded by
/// FNV-1a of the id: a fixed algorithm, not `rand`'s, whose streams may change between
/// versions, because every member must draw the same); this member's index, written in
/// `ceil(log2(num_buckets))` bits, is appended and the oldest bits dropped so the length stays.
/// Empty bits stay empty.
pub fn next_bits(
    bits: &str,
    group_id: &[u8],
    position: usize,
    group_size: usize,
    target_group_size: Option<usize>,
) -> String {
    if bits.is_empty() || group_size == 0 {
        return bits.to_owned();
    }
    let num_buckets = target_group_size
        .unwrap_or_else(|| group_size.next_power_of_two())
        .max(group_size);
    let position = position.min(group_size - 1);
    let mut state = fnv1a64(group_id);
    let mut pool: Vec<usize> = (0..num_buckets).collect();
    for i in 0..=position {
        let j = i + (splitmix64(&mut state) % (num_buckets - i) as u64) as usize;
        pool.swap(i, j);
    }
    let idx = pool[position];
    let nbits = bits_for(num_buckets);
    let new = if nbits == 0 {
        String::new()
    } else {
        format!("{idx:0nbits$b}")
    };
    let combined = format!("{bits}{new}");
    combined[combined.len() - bits.len()..].to_owned()
}

/// A Moshpit grid: peers sit in a `side^dims` grid; in round `t` every peer groups with the
/// peers that share all its coordinates but the one of dimension `t mod dims`.
///
/// With full groups (one per line of the grid, `side` peers each) and exact averaging inside
/// groups, after `dims` consecutive rounds every peer holds the exact global mean: round `d`
/// averages along dimension `d`, and averaging along every dimension in turn is the mean over
/// the whole grid. The key of a group names the dimension and the other coordinates, so
/// different lines (and different rounds' dimensions) never share a key. All members must agree
/// on the round number (e.g. the training step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    side: usize,
    dims: usize,
}

impl Grid {
    /// A grid of `side^dims` cells (`side >= 2`, `dims >= 1`, and the key bits, `ceil(log2
    /// dims) + (dims - 1) * ceil(log2 side)`, at most [`MAX_GROUP_BITS`]).
    pub fn new(side: usize, dims: usize) -> Result<Self, KeyError> {
        let bad = KeyError::BadGrid { side, dims };
        if side < 2 || dims == 0 {
            return Err(bad);
        }
        let key_bits = bits_for(dims) + (dims - 1) * bits_for(side);
        let cells = (0..dims).try_fold(1usize, |acc, _| acc.checked_mul(side));
        if key_bits > MAX_GROUP_BITS || cells.is_none() {
            return Err(bad);
        }
        Ok(Self { side, dims })
    }

    /// Peers per dimension.
    pub fn side(&self) -> usize {
        self.side
    }

    /// Number of dimensions.
    pub fn dims(&self) -> usize {
        self.dims
    }

    /// Number of cells, `side^dims`.
    pub fn cells(&self) -> usize {
        self.side.pow(self.dims as u32)
    }

    /// The coordinates of cell `index` (base-`side` digits, dimension 0 first), taken modulo
    /// the number of cells.
    pub fn coords_of_index(&self, index: usize) -> Vec<usize> {
        let mut rest = index % self.cells();
        (0..self.dims)
            .map(|_| {
                let c = rest % self.side;
                rest /= self.side;
                c
            })
            .collect()
    }

    /// The coordinates of `peer`, from a fixed hash of its id (FNV-1a). Peers placed by hash
    /// are spread only statistically: cells may hold several peers or none, so groups vary in
    /// size; place peers by index where the swarm can agree on one.
    pub fn coords_of_peer(&self, peer: &PeerId) -> Vec<usize> {
        self.coords_of_index((fnv1a64(peer.as_bytes()) % self.cells() as u64) as usize)
    }

    /// The dimension that round `round` averages along.
    pub fn dimension(&self, round: u64) -> usize {
        (round % self.dims as u64) as usize
    }

    /// The group key of the peer at `coords` in round `round`: the bits are the dimension
    /// `round mod dims` (in `ceil(log2 dims)` bits) followed by every other coordinate, in
    /// dimension order (in `ceil(log2 side)` bits each).
    pub fn key(&self, prefix: &str, coords: &[usize], round: u64) -> Result<GroupKey, KeyError> {
        if coords.len() != self.dims || coords.iter().any(|&c| c >= self.side) {
            return Err(KeyError::BadCoords {
                coords: coords.to_vec(),
                side: self.side,
                dims: self.dims,
            });
        }
        let dim = self.dimension(round);
        let (dbits, cbits) = (bits_for(self.dims), bits_for(self.side));
        let mut bits = String::with_capacity(MAX_GROUP_BITS);
        if dbits > 0 {
            bits.push_str(&format!("{dim:0dbits$b}"));
        }
        for (d, &c) in coords.iter().enumerate() {
            if d != dim {
                bits.push_str(&format!("{c:0cbits$b}"));
            }
        }
        GroupKey::new(prefix, &bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[test]
    fn keys_parse_and_print() {
        let k = GroupKey::new("test_averaging", "10110").unwrap();
        assert_eq!(k.as_str(), "test_averaging.0b10110");
        assert_eq!(k.prefix(), "test_averaging");
        assert_eq!(k.bits(), "10110");
        assert_eq!(GroupKey::parse("test_averaging.0b10110").unwrap(), k);
        let empty = GroupKey::parse("p.0b").unwrap();
        assert_eq!(empty.bits(), "");
        assert_eq!(empty.to_string(), "p.0b");
        assert_eq!(
            GroupKey::parse("a.b.0b1"),
            Err(KeyError::DotInPrefix("a.b".into()))
        );
        assert_eq!(GroupKey::parse(".0b1"), Err(KeyError::EmptyPrefix));
        assert!(matches!(
            GroupKey::parse("p.0b012"),
            Err(KeyError::BadBits(_))
        ));
        assert!(matches!(
            GroupKey::parse("nonsense"),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(
            GroupKey::new("p", &"1".repeat(65)),
            Err(KeyError::TooManyBits(65))
        ));
        assert!(matches!(
            GroupKey::new(&"p".repeat(200), ""),
            Err(KeyError::PrefixTooLong(200))
        ));
    }

    #[test]
    fn next_bits_keeps_length_and_separates_members() {
        // Target 2, as hivemind's test_allreduce_grid: two members get different last bits.
        for seed in 0u8..50 {
            let id = [seed; 20];
            let a = next_bits("0110", &id, 0, 2, Some(2));
            let b = next_bits("0110", &id, 1, 2, Some(2));
            assert_eq!(a.len(), 4);
            assert_eq!(&a[..3], "110");
            assert_eq!(&b[..3], "110");
            assert_ne!(a, b, "members of one group must move to different buckets");
        }
        assert_eq!(next_bits("", b"g", 0, 4, Some(4)), "");
        // A group larger than the target still gets distinct buckets (hivemind would raise).
        let all: BTreeSet<String> = (0..5)
            .map(|p| next_bits("000", b"g", p, 5, Some(4)))
            .collect();
        assert_eq!(all.len(), 5);
    }

    #[test]
    fn key_manager_rotates_deterministically() {
        let mut m = KeyManager::new("mygroup", "0000", Some(4)).unwrap();
        assert_eq!(m.key().as_str(), "mygroup.0b0000");
        m.set_bits("00101011101010").unwrap();
        assert_eq!(m.bits(), "00101011101010");
        assert!(m.set_bits("2").is_err());
        assert!(KeyManager::new("a.b", "", None).is_err());
    }

    #[test]
    fn grid_keys_name_the_line() {
        let g = Grid::new(4, 3).unwrap();
        assert_eq!(g.cells(), 64);
        assert_eq!(g.coords_of_index(0), vec![0, 0, 0]);
        assert_eq!(g.coords_of_index(1), vec![1, 0, 0]);
        assert_eq!(g.coords_of_index(4 * 4 * 3 + 4 * 2 + 1), vec![1, 2, 3]);
        // Round 0 averages along dimension 0: key = dim 00, then coords 1 and 2.
        let k = g.key("grid", &[1, 2, 3], 0).unwrap();
        assert_eq!(k.bits(), "00".to_owned() + "10" + "11");
        // Round 4 averages along dimension 1: dim 01, then coords 0 and 2.
        assert_eq!(g.key("grid", &[1, 2, 3], 4).unwrap().bits(), "010111");
        assert!(g.key("grid", &[4, 0, 0], 0).is_err());
        assert!(g.key("grid", &[0, 0], 0).is_err());
        assert!(Grid::new(1, 3).is_err());
        assert!(Grid::new(2, 0).is_err());
        assert!(Grid::new(1 << 20, 8).is_err());
        // One dimension: everybody in one group.
        let line = Grid::new(8, 1).unwrap();
        assert_eq!(line.key("p", &[5], 3).unwrap().bits(), "");
        let peer = PeerId::from_bytes(b"some peer".to_vec()).unwrap();
        assert!(g.coords_of_peer(&peer).iter().all(|&c| c < 4));
    }

    #[test]
    fn grid_rounds_partition_into_lines() {
        let g = Grid::new(4, 3).unwrap();
        for round in 0..3 {
            let mut buckets: BTreeMap<GroupKey, Vec<usize>> = BTreeMap::new();
            for i in 0..64 {
                buckets
                    .entry(g.key("p", &g.coords_of_index(i), round).unwrap())
                    .or_default()
                    .push(i);
            }
            assert_eq!(buckets.len(), 16);
            let dim = g.dimension(round);
            for members in buckets.values() {
                assert_eq!(members.len(), 4);
                // Members differ exactly in the round's dimension.
                let coords: Vec<_> = members.iter().map(|&i| g.coords_of_index(i)).collect();
                for c in &coords {
                    for d in 0..3 {
                        if d != dim {
                            assert_eq!(c[d], coords[0][d]);
                        }
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn next_bits_gives_distinct_buckets(
            id in proptest::collection::vec(any::<u8>(), 1..32),
            size in 1usize..16,
            extra in 0usize..16,
            len in 1usize..12,
        ) {
            let target = size + extra;
            let bits = "1".repeat(len);
            let nbits = bits_for(target);
            let new: Vec<String> = (0..size).map(|p| next_bits(&bits, &id, p, size, Some(target))).collect();
            for b in &new {
                prop_assert_eq!(b.len(), len);
            }
            // When the key keeps all of the new bits, members land in distinct buckets.
            if len >= nbits {
                let distinct: BTreeSet<&String> = new.iter().collect();
                prop_assert_eq!(distinct.len(), size);
            }
        }

        #[test]
        fn parse_never_panics(s in ".{0,80}") {
            let _ = GroupKey::parse(&s);
        }
    }
}
