//! A group's invitation in the DHT and how a newcomer picks one (sans-IO).
//!
//! Every member of a group that admits stores an entry under the owned key
//! `"{prefix}.group"`, in its own owner subkey (signed by it, so nobody can write one in its
//! name): the leader (member 0) an **invitation**, naming the group's base id, its current
//! members in order (itself first) and its contact addresses; every other member an
//! **endorsement** naming the base id. Anyone can write entries under the key, so a newcomer
//! trusts no single one (before: it took the first owner entry in subkey order, and a peer id
//! ground to sort first, about 256 tries, received every newcomer's join and decided its
//! membership):
//!
//! * an invitation counts only if its author is the first member it names, it names nobody
//!   twice, and every member it names endorses the same base id: a group of `n` members
//!   shows `n` signatures;
//! * of the invitations that count, the newcomer takes the one with the most members (ties:
//!   the smallest leader id), so a fake group needs more identities than the real one has
//!   members;
//! * after the join, the leader's answer must extend exactly the membership the invitation
//!   named ([`extends`]).
//!
//! What this does not stop: an attacker with more identities than the group has members
//! presenting a larger fake group under the same prefix (nothing in an open swarm tells the
//! two apart). A prefix is a rendezvous, not an identity; a group that must keep strangers
//! out decides who may join on the leader's side ([`super::Group::with_authorizer`]).

use std::collections::{HashMap, HashSet};

use libp2p::{Multiaddr, PeerId};

/// Marks an invitation.
const INVITATION: u8 = b'I';
/// Marks an endorsement.
const ENDORSEMENT: u8 = b'E';

/// An invitation that counts (module docs): whom to ask, and what it promised.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Invitation {
    /// The group's base id.
    pub base: [u8; 16],
    /// The current members, the leader first.
    pub members: Vec<PeerId>,
    /// The leader's contact addresses.
    pub addrs: Vec<Multiaddr>,
}

impl Invitation {
    /// The group's leader.
    pub fn leader(&self) -> PeerId {
        self.members[0]
    }
}

/// The leader's entry: `base | 'I' | count (u16 BE) | (length (u8), peer id)* | addresses`.
pub(crate) fn invitation_value(
    base: &[u8; 16],
    members: &[PeerId],
    addrs: &[Multiaddr],
) -> Vec<u8> {
    let mut out = base.to_vec();
    out.push(INVITATION);
    let count = u16::try_from(members.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&count.to_be_bytes());
    for m in members.iter().take(usize::from(count)) {
        let bytes = m.to_bytes();
        out.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(&bytes);
    }
    crate::dht::encode_addrs(addrs, &mut out);
    out
}

/// Another member's entry: `base | 'E'`.
pub(crate) fn endorsement_value(base: &[u8; 16]) -> Vec<u8> {
    let mut out = base.to_vec();
    out.push(ENDORSEMENT);
    out
}

enum Entry {
    Invitation(Invitation),
    Endorsement([u8; 16]),
}

fn parse(value: &[u8]) -> Option<Entry> {
    let (base, rest) = value.split_first_chunk::<16>()?;
    let (&kind, mut rest) = rest.split_first()?;
    match kind {
        ENDORSEMENT if rest.is_empty() => Some(Entry::Endorsement(*base)),
        INVITATION => {
            let (count, tail) = rest.split_first_chunk::<2>()?;
            let count = usize::from(u16::from_be_bytes(*count));
            if count == 0 || count > crate::matchmaking::MAX_GROUP_SIZE {
                return None;
            }
            rest = tail;
            let mut members = Vec::with_capacity(count);
            for _ in 0..count {
                let (&len, tail) = rest.split_first()?;
                let (peer, tail) = tail.split_at_checked(usize::from(len))?;
                members.push(PeerId::from_bytes(peer).ok()?);
                rest = tail;
            }
            Some(Entry::Invitation(Invitation {
                base: *base,
                members,
                addrs: crate::dht::decode_addrs(rest)?,
            }))
        }
        _ => None,
    }
}

/// The invitation a newcomer takes among the owner entries `(author, value)` under the key,
/// if any counts (module docs).
pub(crate) fn choose<'a>(
    entries: impl IntoIterator<Item = (PeerId, &'a [u8])>,
) -> Option<Invitation> {
    let mut endorsed: HashMap<[u8; 16], HashSet<PeerId>> = HashMap::new();
    let mut invitations = Vec::new();
    for (author, value) in entries {
        match parse(value) {
            Some(Entry::Endorsement(base)) => {
                endorsed.entry(base).or_default().insert(author);
            }
            Some(Entry::Invitation(inv)) if inv.leader() == author => invitations.push(inv),
            _ => {}
        }
    }
    invitations
        .into_iter()
        .filter(|inv| {
            let mut seen = HashSet::with_capacity(inv.members.len());
            let empty = HashSet::new();
            let endorsers = endorsed.get(&inv.base).unwrap_or(&empty);
            inv.members.iter().all(|m| seen.insert(*m))
                && inv.members[1..].iter().all(|m| endorsers.contains(m))
        })
        .max_by(|a, b| {
            a.members
                .len()
                .cmp(&b.members.len())
                .then_with(|| b.leader().to_bytes().cmp(&a.leader().to_bytes()))
        })
}

/// Whether `answered` (the membership the leader answered a join with) starts with exactly the
/// members `invitation` named and then names `me` among the newcomers.
pub(crate) fn extends(invitation: &Invitation, answered: &[PeerId], me: PeerId) -> bool {
    let k = invitation.members.len();
    answered.len() > k && answered[..k] == invitation.members[..] && answered[k..].contains(&me)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize) -> Vec<PeerId> {
        (0..n).map(|_| PeerId::random()).collect()
    }

    fn addr() -> Vec<Multiaddr> {
        vec!["/ip4/127.0.0.1/tcp/4001".parse().unwrap()]
    }

    /// The entries of a real group of `members` with base `base`.
    fn group(base: [u8; 16], members: &[PeerId]) -> Vec<(PeerId, Vec<u8>)> {
        let mut out = vec![(members[0], invitation_value(&base, members, &addr()))];
        out.extend(members[1..].iter().map(|&m| (m, endorsement_value(&base))));
        out
    }

    fn pick(entries: &[(PeerId, Vec<u8>)]) -> Option<Invitation> {
        choose(entries.iter().map(|(p, v)| (*p, v.as_slice())))
    }

    #[test]
    fn an_endorsed_invitation_round_trips() {
        let members = peers(3);
        let got = pick(&group([1; 16], &members)).expect("a valid invitation");
        assert_eq!(
            got,
            Invitation {
                base: [1; 16],
                members: members.clone(),
                addrs: addr()
            }
        );
        assert_eq!(got.leader(), members[0]);
    }

    /// Issue 29, attack 2 (eclipse): a lone peer (or one with a single accomplice) inviting to
    /// its own group, whatever its id's order, loses to the real group; an invitation some
    /// member does not endorse, one in another's name, or one naming a member twice counts
    /// for nothing.
    #[test]
    fn fake_invitations_do_not_count() {
        let real = peers(3);
        let mut entries = group([1; 16], &real);
        let liar = PeerId::random();
        let accomplice = PeerId::random();
        entries.extend(group([2; 16], &[liar, accomplice]));
        // Claims the real members without their endorsements of its base.
        let mut claimed = vec![liar];
        claimed.extend_from_slice(&real);
        entries.push((liar, invitation_value(&[3; 16], &claimed, &addr())));
        // Signed by the liar but naming a real member as leader.
        entries.push((liar, invitation_value(&[1; 16], &real, &addr())));
        // Names itself twice, with endorsements.
        entries.push((
            accomplice,
            invitation_value(&[4; 16], &[accomplice, accomplice, liar, liar], &addr()),
        ));
        entries.push((liar, endorsement_value(&[4; 16])));
        for order in [false, true] {
            if order {
                entries.reverse();
            }
            let got = pick(&entries).expect("the real group counts");
            assert_eq!(got.members, real);
            assert_eq!(got.base, [1; 16]);
        }
        // Without one endorsement the real group does not count; the fake pair then does.
        entries.retain(|(p, v)| !(*p == real[2] && v == &endorsement_value(&[1; 16])));
        assert_eq!(pick(&entries).unwrap().members, vec![liar, accomplice]);
    }

    #[test]
    fn malformed_values_are_ignored() {
        let p = PeerId::random();
        let good = invitation_value(&[5; 16], &[p], &addr());
        for bad in [
            Vec::new(),
            vec![0; 16],
            [&[0u8; 16][..], b"X"].concat(),
            [&[0u8; 16][..], b"E", b"trailing"].concat(),
            [&[0u8; 16][..], b"I", &[0, 0]].concat(),
            [&[0u8; 16][..], b"I", &[0, 2], &[3, 1, 2, 3]].concat(),
            good[..good.len() - 3].to_vec(),
        ] {
            assert_eq!(choose([(p, bad.as_slice())]), None, "{bad:?}");
        }
        assert!(choose([(p, good.as_slice())]).is_some());
    }

    #[test]
    fn the_answer_must_extend_the_invited_membership() {
        let members = peers(3);
        let inv = Invitation {
            base: [1; 16],
            members: members.clone(),
            addrs: Vec::new(),
        };
        let me = PeerId::random();
        let other = PeerId::random();
        let mut answered = members.clone();
        answered.push(me);
        assert!(extends(&inv, &answered, me));
        answered.insert(3, other);
        assert!(extends(&inv, &answered, me));
        assert!(!extends(&inv, &members, me));
        let mut swapped = answered.clone();
        swapped.swap(0, 1);
        assert!(!extends(&inv, &swapped, me));
        let mut replaced = members.clone();
        replaced[2] = other;
        replaced.push(me);
        assert!(!extends(&inv, &replaced, me));
        assert!(!extends(&inv, &[members.clone(), vec![other]].concat(), me));
    }
}
