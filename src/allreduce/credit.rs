//! Receiver-side pacing of clients (issue 32): a reducer reads a client's parts only a few
//! ahead of the node senders' parts.
//!
//! A client reduces nothing, so nothing waits on its downlink; it sends its parts as fast as
//! TCP lets it. A node sender's parts to a reducer are windowed, and other members' averages
//! wait on them (its own reduction waits on this reducer's parts, this reducer's on its). On a
//! reducer's downlink TCP shares the line about equally among the flows, so two clients ahead
//! of one node take two thirds of it while the node's parts, the ones every completion waits
//! on, arrive last (architecture notes, "Why two symmetric-NAT clients stay near 60 % of
//! their bound").
//!
//! The reducer grants each client **credit**: it reads the client's next part only while the
//! client has delivered fewer than `frontier + credit` parts of its span, where the frontier
//! is the fewest parts any still active node sender delivered. Beyond that it leaves the
//! client's bytes unread (the runner stops reading that link, so TCP's flow control holds the
//! client back), and the line's share goes to the node. No message on the wire: a client of
//! any version is paced. [`client_admitted`] is the rule as a pure function.

/// Default credit, in parts, a reducer grants a client beyond the node senders' frontier.
pub const DEFAULT_CLIENT_CREDIT_PARTS: usize = 2;

/// The frontier: the fewest parts any node sender still sending delivered, or `None` where no
/// node sender is still sending (then nothing paces the clients).
pub fn frontier(node_received: impl IntoIterator<Item = usize>) -> Option<usize> {
    node_received.into_iter().min()
}

/// Whether a reducer reads the next part of a client that delivered `received` parts, with the
/// node senders at `frontier` ([`frontier`]) and `credit` parts of credit: `received <
/// frontier + credit` (at least one part ahead: a credit of 0 counts as 1). Without a frontier
/// every part is admitted.
pub fn client_admitted(received: usize, frontier: Option<usize>, credit: usize) -> bool {
    frontier.is_none_or(|f| received < f.saturating_add(credit.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A client is admitted exactly while it is fewer than `credit` parts ahead of the
        /// slowest node, and never held back once it is behind that node.
        #[test]
        fn clients_stay_within_their_credit(
            received in 0usize..1000,
            nodes in proptest::collection::vec(0usize..1000, 0..6),
            credit in 0usize..32,
        ) {
            let f = frontier(nodes.iter().copied());
            let admitted = client_admitted(received, f, credit);
            match f {
                None => prop_assert!(admitted),
                Some(f) => {
                    prop_assert_eq!(f, *nodes.iter().min().unwrap());
                    prop_assert_eq!(admitted, received < f + credit.max(1));
                    if received <= f {
                        prop_assert!(admitted, "a client level with the nodes is read");
                    }
                }
            }
        }

        /// More node progress or more credit never holds a client back that was admitted.
        #[test]
        fn credit_is_monotone(
            received in 0usize..1000,
            f in 0usize..1000,
            more in 0usize..100,
            credit in 0usize..32,
        ) {
            if client_admitted(received, Some(f), credit) {
                prop_assert!(client_admitted(received, Some(f + more), credit));
                prop_assert!(client_admitted(received, Some(f), credit + more));
            }
        }
    }

    #[test]
    fn the_slowest_node_paces() {
        assert_eq!(frontier([5, 3, 9]), Some(3));
        assert_eq!(frontier([]), None);
        assert!(client_admitted(4, Some(3), 2));
        assert!(!client_admitted(5, Some(3), 2));
        assert!(client_admitted(3, Some(3), 0));
        assert!(!client_admitted(4, Some(3), 0));
        assert!(client_admitted(usize::MAX - 1, Some(usize::MAX), 2));
        assert!(client_admitted(1_000, None, 0));
    }
}
