//! A compact set of peer indices within a group.

/// A set of peer indices (positions in the group order), as a bitset.
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct PeerSet {
    words: Vec<u64>,
}

impl PeerSet {
    /// The empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Builds a set from indices.
    pub fn from_indices(indices: impl IntoIterator<Item = usize>) -> Self {
        let mut s = Self::new();
        for i in indices {
            s.insert(i);
        }
        s
    }

    /// Builds a set from its wire words (trailing zero words are dropped).
    pub fn from_words(mut words: Vec<u64>) -> Self {
        while words.last() == Some(&0) {
            words.pop();
        }
        Self { words }
    }

    /// The wire words (64 members per word, least significant bit first).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Adds `i`; returns whether it was new.
    pub fn insert(&mut self, i: usize) -> bool {
        let (w, b) = (i / 64, i % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        let new = self.words[w] & (1 << b) == 0;
        self.words[w] |= 1 << b;
        new
    }

    /// Whether `i` is a member.
    pub fn contains(&self, i: usize) -> bool {
        self.words
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The largest member plus one (0 if empty).
    pub fn bound(&self) -> usize {
        self.words
            .iter()
            .rposition(|&w| w != 0)
            .map_or(0, |i| i * 64 + 64 - self.words[i].leading_zeros() as usize)
    }

    /// Members in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    None
                } else {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    Some(wi * 64 + b)
                }
            })
        })
    }
}

impl std::fmt::Debug for PeerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basics() {
        let mut s = PeerSet::new();
        assert!(s.is_empty());
        assert!(s.insert(3));
        assert!(!s.insert(3));
        s.insert(64);
        s.insert(130);
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 64, 130]);
        assert_eq!(s.len(), 3);
        assert_eq!(s.bound(), 131);
        assert!(s.contains(64) && !s.contains(65) && !s.contains(100_000));
        assert_eq!(PeerSet::from_words(s.words().to_vec()), s);
        assert_eq!(
            PeerSet::from_words(vec![1, 0, 0]),
            PeerSet::from_indices([0])
        );
    }
}
