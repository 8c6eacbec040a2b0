//! The census: after a round's links are made and before its first round frame, members of a
//! round whose plan has hole-punched pairs tell each other which members they could not link
//! to, so that every member re-plans the round the same way (no span for a member that a
//! sender cannot reach) instead of losing a contributor and waiting for timeouts.
//!
//! Every member sends one [`LinkMessage::Census`] on every link it has and reads one from
//! each, under a timeout. A failed pair `(i, j)` is known to `i` and `j` and, through their
//! censuses, to every member linked to either: with one failed pair, that is every member
//! (every sender links to every reducer, so a member linked to neither would need a second
//! failure). A member can only speak for its own links: what `k` reports becomes pairs
//! `(k, x)`, which [`crate::reach::honoured_cuts`] then bounds like any published claim.

use std::time::Duration;

use super::hub::write_link_frame;
use crate::runner::Link;
use crate::wire::{self, LinkMessage, MAX_CENSUS};

/// Whether a round of `members` runs a census: some pair with traffic links by hole punching
/// (every member derives the same answer from the same group).
pub fn needs_census(members: &[super::LinkPeer]) -> bool {
    (0..members.len()).any(|me| {
        super::plan(members, me)
            .iter()
            .any(|p| matches!(p, super::Plan::Open(crate::reach::Path::HolePunch)))
    })
}

/// Sends `unlinked` (the members we could not link to) on every link of `links` and reads each
/// peer's census, all within `timeout`. `heard[i]` is member `i`'s census, `None` where there is
/// no link or its census did not come (malformed, late, closed: the caller treats that link as
/// failed).
pub async fn exchange(
    links: &mut [Option<Box<dyn Link>>],
    unlinked: &[u32],
    timeout: Duration,
) -> Vec<Option<Vec<u32>>> {
    let message = LinkMessage::Census(unlinked.iter().take(MAX_CENSUS).copied().collect());
    let message = &message;
    futures::future::join_all(links.iter_mut().map(|link| async move {
        let link = link.as_mut()?;
        let heard = tokio::time::timeout(timeout, async {
            write_link_frame(link, message).await.ok()?;
            match wire::read_link_frame(link).await {
                Ok(LinkMessage::Census(theirs)) => Some(theirs),
                _ => None,
            }
        })
        .await;
        heard.ok().flatten()
    }))
    .await
}

/// The failed pairs a member knows after the census: `(me, j)` for each `j` in `mine`, and
/// `(k, x)` for each `x` that member `k` reported (`heard[k]`); indices outside the group of
/// `n` and self-pairs are dropped.
pub fn failed_pairs(
    me: usize,
    mine: &[u32],
    heard: &[Option<Vec<u32>>],
    n: usize,
) -> Vec<(usize, usize)> {
    let mut pairs: Vec<(usize, usize)> = mine
        .iter()
        .map(|&j| (me, j as usize))
        .filter(|&(a, b)| a != b && b < n)
        .collect();
    for (k, theirs) in heard.iter().enumerate().take(n) {
        for &x in theirs.iter().flatten().take(MAX_CENSUS) {
            let x = x as usize;
            if x < n && x != k && !pairs.contains(&(k, x)) {
                pairs.push((k, x));
            }
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::links::LinkPeer;
    use crate::reach::Reach;
    use libp2p::PeerId;

    fn member(reach: Reach) -> LinkPeer {
        LinkPeer {
            reach,
            ..LinkPeer::public(PeerId::random(), None)
        }
    }

    #[test]
    fn only_rounds_with_punched_pairs_take_a_census() {
        let public = [member(Reach::Public), member(Reach::Public)];
        assert!(!needs_census(&public));
        let mut m = vec![
            member(Reach::Public),
            member(Reach::Punchable),
            member(Reach::Punchable),
        ];
        assert!(needs_census(&m));
        // The two punchable members have no traffic (neither reduces): no punch, no census.
        m[1].reduces = false;
        m[2].reduces = false;
        assert!(!needs_census(&m));
    }

    #[test]
    fn pairs_from_what_was_heard() {
        let heard = vec![None, Some(vec![2, 1, 99]), Some(vec![1]), Some(Vec::new())];
        // Member 0 failed with 3; member 1 reports 2 (and itself, and an index out of range).
        assert_eq!(
            failed_pairs(0, &[3, 0], &heard, 4),
            vec![(0, 3), (1, 2), (2, 1)]
        );
    }

    /// Two ends exchange their census over a byte pipe; a peer that sends something else (or
    /// nothing) gives `None`.
    #[tokio::test]
    async fn censuses_cross_on_every_link() {
        let (a, b) = tokio::io::duplex(1024);
        let mut left: Vec<Option<Box<dyn Link>>> = vec![None, Some(Box::new(a))];
        let mut right: Vec<Option<Box<dyn Link>>> = vec![Some(Box::new(b)), None];
        let t = Duration::from_secs(30);
        let (l, r) = tokio::join!(exchange(&mut left, &[3], t), exchange(&mut right, &[], t));
        assert_eq!(l, vec![None, Some(vec![])]);
        assert_eq!(r, vec![Some(vec![3]), None]);
        // A silent peer: nothing heard within the timeout.
        let (a, _b) = tokio::io::duplex(1024);
        let mut silent: Vec<Option<Box<dyn Link>>> = vec![Some(Box::new(a))];
        let heard = exchange(&mut silent, &[], Duration::from_millis(50)).await;
        assert_eq!(heard, vec![None]);
    }
}
