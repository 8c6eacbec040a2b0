//! The census: after a round's links are made and before its first round frame, members of a
//! round whose plan has hole-punched pairs tell each other which members they could not link
//! to, so that every member re-plans the round the same way (no span for a member that a
//! sender cannot reach) instead of losing a contributor and waiting for timeouts.
//!
//! # Statements
//!
//! Each member makes one [`CensusStatement`]: the members it could not link to, signed with
//! its identity key over [`signing_payload`] (a domain tag, the group id, its index and the
//! list), so that a statement can be passed on by anyone and changed by nobody: a member can
//! only speak for its own pairs, whoever carries its words. What member `k` states becomes the
//! pairs `(k, x)`, which [`crate::reach::honoured_cuts`] then bounds like any published claim.
//!
//! # Flooding ([`Flood`], sans-IO; [`exchange`] drives it over the links)
//!
//! A failed pair `(i, j)` is known at first to `i` and `j` only, and with several failed pairs
//! a member may be linked to neither end (e.g. `c` failed with both `a` and `b`, which failed
//! with each other). So the census runs in lockstep census rounds: in each round, on each link
//! still running, both ends send the statements they hold that have not crossed that link yet
//! (one frame per statement, then an end frame) and read the other end's. A statement a member
//! holds at the start of a round reaches all its linked neighbours by the end of it, so after
//! as many rounds as the link graph's diameter every member connected to the others holds every
//! statement; rounds are bounded by `n - 1` for a group of `n`. A link stops once the
//! statements that crossed it cover all `n` members (both ends then hold everything, and both
//! ends see the same frames, so both stop in the same round); a member stops when all its
//! links stopped. Usually that is two rounds: a public reducer, linked to everyone, holds every
//! statement after the first and hands them out in the second.
//!
//! # Hostile input
//!
//! Frames are bounded by the link frame limit (a statement names at most
//! [`MAX_CENSUS`] members); a batch holds at most `n` statements, each for a member in the
//! group that has not crossed the link yet; every new statement is verified against the
//! claimant's peer id (a copy of one already held is compared, not verified again). Any
//! violation drops the link (the runner fails it at once) and its statements are ignored. A
//! member that signs two different statements (equivocation) can make members hold different
//! ones (each keeps the first it saw): such a member could equally link to some members and
//! not to others; the round then falls back to bans and timeouts, as when a link fails
//! mid-round.

use std::time::Duration;

use bytes::Bytes;
use libp2p::PeerId;
use libp2p::identity::Keypair;

use crate::runner::Link;
use crate::wire::{self, CensusStatement, LinkMessage, MAX_CENSUS};

/// Prefix of every signed census payload.
pub const SIGNING_DOMAIN: &[u8] = b"hivemesh/census/v1\0";

/// The bytes a census statement's signature covers: [`SIGNING_DOMAIN`], then `u64be(len
/// group id) ‖ group id ‖ u32be(member) ‖ u32be(count) ‖ u32be(each unlinked index)`, so a
/// statement cannot be replayed in another group (round) or for another member.
pub fn signing_payload(group_id: &[u8], member: u32, unlinked: &[u32]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(SIGNING_DOMAIN.len() + 16 + group_id.len() + 4 * unlinked.len());
    out.extend_from_slice(SIGNING_DOMAIN);
    out.extend_from_slice(&(group_id.len() as u64).to_be_bytes());
    out.extend_from_slice(group_id);
    out.extend_from_slice(&member.to_be_bytes());
    out.extend_from_slice(&(unlinked.len() as u32).to_be_bytes());
    for x in unlinked {
        out.extend_from_slice(&x.to_be_bytes());
    }
    out
}

/// Why a census statement could not be made, or why a batch of statements was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CensusError {
    /// The keypair failed to sign, or signs with another length than Ed25519's.
    #[error("the census statement could not be signed: {0}")]
    Sign(String),
    /// A batch of more statements than the group has members.
    #[error("a census batch of more than {0} statements")]
    TooMany(usize),
    /// A statement of a member outside the group.
    #[error("a census statement of member {0}, outside the group")]
    NotMember(u32),
    /// A statement that already crossed this link (or came twice in one batch).
    #[error("member {0}'s census statement again on the same link")]
    Repeated(u32),
    /// A statement whose signature is not its member's.
    #[error("member {0}'s census statement has a bad signature")]
    BadSignature(u32),
}

/// Member `member`'s statement that it could not link to `unlinked` (at most [`MAX_CENSUS`]
/// are kept), signed by `keypair` for group `group_id`.
pub fn sign(
    keypair: &Keypair,
    group_id: &[u8],
    member: u32,
    unlinked: &[u32],
) -> Result<CensusStatement, CensusError> {
    let unlinked: Vec<u32> = unlinked.iter().take(MAX_CENSUS).copied().collect();
    let signature = keypair
        .sign(&signing_payload(group_id, member, &unlinked))
        .map_err(|e| CensusError::Sign(e.to_string()))?;
    if signature.len() != wire::CENSUS_SIGNATURE_BYTES {
        return Err(CensusError::Sign(format!(
            "a signature of {} bytes",
            signature.len()
        )));
    }
    Ok(CensusStatement {
        member,
        unlinked,
        signature: Bytes::from(signature),
    })
}

/// Whether `statement` is signed by `peer` (the peer id must embed its public key, as Ed25519
/// ids do) for group `group_id`.
pub fn verify(peer: &PeerId, group_id: &[u8], statement: &CensusStatement) -> bool {
    crate::dht::embedded_public_key(peer).is_some_and(|key| {
        key.verify(
            &signing_payload(group_id, statement.member, &statement.unlinked),
            &statement.signature,
        )
    })
}

/// The statements to send in one census round, per member (`None`: no running link to it).
pub type Batches = Vec<Option<Vec<CensusStatement>>>;

/// One member's side of the census flood (sans-IO; see the module docs). Drive it in census
/// rounds: [`Flood::start_round`] gives the statements to send on each running link, every
/// batch heard goes to [`Flood::receive`] (or the link to [`Flood::drop_link`]), then
/// [`Flood::end_round`]; until `start_round` returns `None`.
#[derive(Clone, Debug)]
pub struct Flood {
    me: usize,
    /// The statements held, by member.
    known: Vec<Option<CensusStatement>>,
    /// Per member: `None` without a running link; else which members' statements crossed the
    /// link so far (either way).
    links: Vec<Option<Vec<bool>>>,
    /// Per member: the members whose statements we send on that link this round.
    sending: Vec<Vec<usize>>,
    /// Links dropped because of what came on them (or did not).
    dropped: Vec<usize>,
    rounds: usize,
}

impl Flood {
    /// Member `me` of a group of `n` (`own` is its statement) with a link to each member `j`
    /// where `linked[j]`.
    pub fn new(n: usize, me: usize, own: CensusStatement, linked: &[bool]) -> Self {
        let mut known = vec![None; n];
        if me < n {
            known[me] = Some(own);
        }
        let links = (0..n)
            .map(|j| (j != me && linked.get(j) == Some(&true)).then(|| vec![false; n]))
            .collect();
        Self {
            me,
            known,
            links,
            sending: vec![Vec::new(); n],
            dropped: Vec::new(),
            rounds: 0,
        }
    }

    /// Most census rounds for a group of `n`: the longest path between two members.
    pub fn max_rounds(n: usize) -> usize {
        n.saturating_sub(1)
    }

    /// Starts a census round: for each member, the statements to send on our link to it
    /// (`None` where no link runs; an empty batch still runs, its end frame says "nothing
    /// new"). `None` once the census is over.
    pub fn start_round(&mut self) -> Option<Batches> {
        if self.rounds >= Self::max_rounds(self.known.len())
            || self.links.iter().all(Option::is_none)
        {
            return None;
        }
        self.rounds += 1;
        let mut out = Vec::with_capacity(self.links.len());
        for (j, link) in self.links.iter().enumerate() {
            self.sending[j].clear();
            let Some(crossed) = link else {
                out.push(None);
                continue;
            };
            let mut batch = Vec::new();
            for (k, statement) in self.known.iter().enumerate() {
                if let Some(statement) = statement.as_ref().filter(|_| !crossed[k]) {
                    self.sending[j].push(k);
                    batch.push(statement.clone());
                }
            }
            out.push(Some(batch));
        }
        Some(out)
    }

    /// The batch `statements` came on our link to member `from` this round. `verify(k,
    /// statement)` checks a new statement's signature against member `k`. A batch that breaks
    /// a rule (see the module docs) drops the link and none of it is kept.
    pub fn receive(
        &mut self,
        from: usize,
        statements: Vec<CensusStatement>,
        mut verify: impl FnMut(usize, &CensusStatement) -> bool,
    ) -> Result<(), CensusError> {
        let n = self.known.len();
        let Some(crossed) = self.links.get(from).and_then(Option::as_ref) else {
            return Ok(());
        };
        let checked = (|| {
            if statements.len() > n {
                return Err(CensusError::TooMany(n));
            }
            let mut seen = crossed.clone();
            for s in &statements {
                let k = s.member as usize;
                if k >= n {
                    return Err(CensusError::NotMember(s.member));
                }
                // Both ends may send the same member's statement in one round (each held it
                // already); one that crossed in an earlier round, or twice now, is a violation.
                if seen[k] {
                    return Err(CensusError::Repeated(s.member));
                }
                seen[k] = true;
                if self.known[k].as_ref() != Some(s) && !verify(k, s) {
                    return Err(CensusError::BadSignature(s.member));
                }
            }
            Ok(())
        })();
        if let Err(e) = checked {
            self.drop_link(from);
            return Err(e);
        }
        let crossed = self.links[from].as_mut().expect("checked above");
        for s in statements {
            let k = s.member as usize;
            crossed[k] = true;
            // The first statement held of a member stays (see "Hostile input").
            self.known[k].get_or_insert(s);
        }
        Ok(())
    }

    /// Nothing (or nothing valid) came on our link to `member` this round: the link is dropped.
    pub fn drop_link(&mut self, member: usize) {
        if let Some(link) = self.links.get_mut(member)
            && link.take().is_some()
        {
            self.dropped.push(member);
        }
    }

    /// Ends the census round: what we sent crossed the links, and a link whose crossed
    /// statements cover the whole group stops.
    pub fn end_round(&mut self) {
        for (j, link) in self.links.iter_mut().enumerate() {
            if let Some(crossed) = link {
                for &k in &self.sending[j] {
                    crossed[k] = true;
                }
                if crossed.iter().all(|&c| c) {
                    *link = None;
                }
            }
            self.sending[j].clear();
        }
    }

    /// Census rounds started so far.
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    /// The members whose links were dropped during the census, in order.
    pub fn dropped(&self) -> &[usize] {
        &self.dropped
    }

    /// The members whose statements we hold.
    pub fn heard(&self) -> Vec<usize> {
        (0..self.known.len())
            .filter(|&k| self.known[k].is_some())
            .collect()
    }

    /// The failed pairs the statements held name: `(k, x)` for each `x` in member `k`'s
    /// statement; indices outside the group and self-pairs are dropped.
    pub fn failed_pairs(&self) -> Vec<(usize, usize)> {
        let n = self.known.len();
        let mut pairs = Vec::new();
        for (k, statement) in self.known.iter().enumerate() {
            for &x in statement
                .iter()
                .flat_map(|s| s.unlinked.iter().take(MAX_CENSUS))
            {
                let x = x as usize;
                if x < n && x != k && !pairs.contains(&(k, x)) {
                    pairs.push((k, x));
                }
            }
        }
        pairs
    }

    /// Our own index.
    pub fn me(&self) -> usize {
        self.me
    }
}

/// Whether a round of `members` runs a census: some pair with traffic links by hole punching
/// (every member derives the same answer from the same group).
pub fn needs_census(members: &[super::LinkPeer]) -> bool {
    (0..members.len()).any(|me| {
        super::plan(members, me)
            .iter()
            .any(|p| matches!(p, super::Plan::Open(crate::reach::Path::HolePunch)))
    })
}

/// How long the census waits for the statements of the members linked to us
/// ([`exchange`]): a link timeout and a grace of up to [`CENSUS_GRACE`] (at most another link
/// timeout). A member sends its statement only when its own linking ends, which may take the
/// whole link timeout (a pair behind NATs that cannot punch waits for it), and members begin
/// linking at slightly different moments (matchmaking tells them one after another). Waiting
/// exactly a link timeout made a member that linked at once drop the pair's statements that
/// were a few milliseconds late, and the round fell back to bans and timeouts
/// (`tests/integration/nat.rs`'s never-punching pairs, 5 runs of 6 on a 2-core machine).
pub fn wait(link_timeout: Duration) -> Duration {
    link_timeout + CENSUS_GRACE.min(link_timeout)
}

/// The most the census waits past a link timeout ([`wait`]).
pub const CENSUS_GRACE: Duration = Duration::from_secs(2);

/// Runs `flood` over `links` (indexed by member, as [`Flood::new`] was told) until it is over,
/// all within `timeout`; `verify` as for [`Flood::receive`]. In each census round, on every
/// running link, our batch is written while the other end's is read (so neither end's writes
/// wait on the other's reads). A link whose batch does not come in time, is malformed or breaks
/// a rule is dropped from `flood` and closed here (`links[j]` becomes `None`), so its other end
/// stops waiting at once; the caller treats it as a failed link ([`Flood::dropped`]).
pub async fn exchange(
    links: &mut [Option<Box<dyn Link>>],
    flood: &mut Flood,
    mut verify: impl FnMut(usize, &CensusStatement) -> bool,
    timeout: Duration,
) {
    let deadline = tokio::time::Instant::now() + timeout;
    let n = links.len();
    while let Some(batches) = flood.start_round() {
        let heard = futures::future::join_all(links.iter_mut().zip(batches).map(
            |(link, batch)| async move {
                let batch = batch?;
                let Some(link) = link.as_mut() else {
                    return Some(Err(()));
                };
                let mut out = bytes::BytesMut::new();
                for statement in batch {
                    wire::encode_link_frame(&LinkMessage::Census(Some(statement)), &mut out);
                }
                wire::encode_link_frame(&LinkMessage::Census(None), &mut out);
                let (mut read, mut write) = tokio::io::split(&mut **link);
                let write = async {
                    use tokio::io::AsyncWriteExt as _;
                    write.write_all(&out).await.ok()?;
                    write.flush().await.ok()
                };
                let read = async {
                    let mut heard = Vec::new();
                    // At most `n` statements, then the end frame: a longer batch is refused.
                    loop {
                        match wire::read_link_frame(&mut read).await {
                            Ok(LinkMessage::Census(Some(s))) if heard.len() < n => heard.push(s),
                            Ok(LinkMessage::Census(None)) => return Some(heard),
                            _ => return None,
                        }
                    }
                };
                let both = async { tokio::join!(write, read) };
                match tokio::time::timeout_at(deadline, both).await {
                    Ok((Some(()), Some(heard))) => Some(Ok(heard)),
                    _ => Some(Err(())),
                }
            },
        ))
        .await;
        for (j, heard) in heard.into_iter().enumerate() {
            let dropped = match heard {
                None => false,
                Some(Ok(batch)) => flood.receive(j, batch, &mut verify).is_err(),
                Some(Err(())) => {
                    flood.drop_link(j);
                    true
                }
            };
            if dropped {
                links[j] = None;
            }
        }
        flood.end_round();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::links::{LinkPeer, Plan};
    use crate::reach::{self, Reach};

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
    fn a_statement_verifies_only_as_signed() {
        let key = Keypair::generate_ed25519();
        let peer = key.public().to_peer_id();
        let s = sign(&key, b"g1", 2, &[0, 3]).unwrap();
        assert!(verify(&peer, b"g1", &s));
        // Another signer, another group, another member, another list.
        assert!(!verify(&PeerId::random(), b"g1", &s));
        assert!(!verify(&peer, b"g2", &s));
        let moved = CensusStatement {
            member: 1,
            ..s.clone()
        };
        assert!(!verify(&peer, b"g1", &moved));
        let changed = CensusStatement {
            unlinked: vec![0],
            ..s.clone()
        };
        assert!(!verify(&peer, b"g1", &changed));
        // At most MAX_CENSUS members are stated.
        let long: Vec<u32> = (0..100).collect();
        assert_eq!(
            sign(&key, b"g1", 0, &long).unwrap().unlinked.len(),
            MAX_CENSUS
        );
    }

    /// A group of `n` members (reach and whether each reduces) with signing keys.
    struct Group {
        members: Vec<LinkPeer>,
        keys: Vec<Keypair>,
    }

    impl Group {
        fn new(spec: &[(Reach, bool)]) -> Self {
            let keys: Vec<Keypair> = spec.iter().map(|_| Keypair::generate_ed25519()).collect();
            let members = spec
                .iter()
                .zip(&keys)
                .map(|(&(reach, reduces), key)| LinkPeer {
                    reach,
                    reduces,
                    ..LinkPeer::public(key.public().to_peer_id(), None)
                })
                .collect();
            Self { members, keys }
        }

        /// Pairs with traffic that link by hole punching.
        fn punched_pairs(&self) -> Vec<(usize, usize)> {
            let n = self.members.len();
            let mut pairs = Vec::new();
            for i in 0..n {
                for (j, p) in super::super::plan(&self.members, i).iter().enumerate() {
                    if i < j
                        && matches!(
                            p,
                            Plan::Open(reach::Path::HolePunch)
                                | Plan::Await(reach::Path::HolePunch)
                        )
                    {
                        pairs.push((i, j));
                    }
                }
            }
            pairs
        }

        /// Whether `i` and `j` have a link once the pairs in `failed` failed.
        fn linked(&self, failed: &[(usize, usize)], i: usize, j: usize) -> bool {
            let planned = matches!(
                super::super::plan(&self.members, i)[j],
                Plan::Open(_) | Plan::Await(_)
            );
            planned && !failed.contains(&(i.min(j), i.max(j)))
        }

        /// Runs every member's flood in lockstep (`rounds`: at most this many census rounds)
        /// and returns the floods and whether every view was complete after one round.
        fn flood(&self, failed: &[(usize, usize)], rounds: usize) -> (Vec<Flood>, bool) {
            let n = self.members.len();
            let group_id = b"group";
            let mut floods: Vec<Flood> = (0..n)
                .map(|i| {
                    let mine: Vec<u32> = (0..n)
                        .filter(|&j| failed.contains(&(i.min(j), i.max(j))))
                        .map(|j| j as u32)
                        .collect();
                    let own = sign(&self.keys[i], group_id, i as u32, &mine).unwrap();
                    let linked: Vec<bool> = (0..n)
                        .map(|j| j != i && self.linked(failed, i, j))
                        .collect();
                    Flood::new(n, i, own, &linked)
                })
                .collect();
            let mut whole_after_one = true;
            for round in 0..rounds {
                let out: Vec<Option<Batches>> = floods.iter_mut().map(Flood::start_round).collect();
                if out.iter().all(Option::is_none) {
                    break;
                }
                for i in 0..n {
                    for j in 0..n {
                        let batch = out[i].as_ref().and_then(|b| b[j].clone());
                        let back = out[j].as_ref().and_then(|b| b[i].as_ref());
                        // Both ends of a link run the same census rounds.
                        assert_eq!(batch.is_some(), back.is_some(), "{i}-{j} in round {round}");
                        if let Some(batch) = batch {
                            let peers: Vec<PeerId> =
                                self.members.iter().map(|m| m.peer_id).collect();
                            floods[j]
                                .receive(i, batch, |k, s| verify(&peers[k], group_id, s))
                                .unwrap();
                        }
                    }
                }
                for f in &mut floods {
                    f.end_round();
                }
                if round == 0 {
                    whole_after_one = floods.iter().all(|f| f.heard().len() == n);
                }
            }
            (floods, whole_after_one)
        }
    }

    /// A tiny deterministic generator for the simulator's cases.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n
        }
    }

    /// Groups of 4 to 8 members (public or punchable, nodes or clients, at least one public
    /// node) with two or three failed punched pairs: every member ends the census holding every
    /// statement, so all know every failed pair and re-plan the same cuts and reducers. In some
    /// cases a member is linked to neither end of a failed pair (one census round, as before
    /// the flood, would leave views apart: checked below).
    #[test]
    fn with_several_failed_pairs_every_member_replans_identically() {
        let mut rng = Lcg(27);
        let (mut cases, mut needed_forwarding) = (0, 0);
        while cases < 120 {
            let n = 4 + rng.below(5);
            let mut spec: Vec<(Reach, bool)> = (0..n)
                .map(|_| {
                    let reach = if rng.below(3) == 0 {
                        Reach::Public
                    } else {
                        Reach::Punchable
                    };
                    (reach, rng.below(5) != 0)
                })
                .collect();
            spec[rng.below(n)] = (Reach::Public, true);
            let group = Group::new(&spec);
            let mut candidates = group.punched_pairs();
            let want = 2 + cases % 2;
            if candidates.len() < want {
                continue;
            }
            let mut failed = Vec::new();
            for _ in 0..want {
                failed.push(candidates.remove(rng.below(candidates.len())));
            }
            cases += 1;
            let (floods, whole_after_one) = group.flood(&failed, usize::MAX);
            needed_forwarding += usize::from(!whole_after_one);
            let truth: std::collections::BTreeSet<(usize, usize)> =
                failed.iter().flat_map(|&(a, b)| [(a, b), (b, a)]).collect();
            let peers: Vec<reach::Peer> = group.members.iter().map(LinkPeer::plan).collect();
            let may_reduce: Vec<bool> = group.members.iter().map(|m| m.reduces).collect();
            let sends = vec![true; n];
            let plans: Vec<(reach::Cuts, Vec<bool>)> = floods
                .iter()
                .map(|f| {
                    assert!(f.dropped().is_empty());
                    assert!(f.rounds() <= Flood::max_rounds(n));
                    let view: std::collections::BTreeSet<_> =
                        f.failed_pairs().into_iter().collect();
                    assert_eq!(
                        view,
                        truth,
                        "member {} of {spec:?}, failed {failed:?}",
                        f.me()
                    );
                    let cuts = reach::honoured_cuts(&peers, &f.failed_pairs(), &may_reduce, &sends);
                    let reducers = reach::reducers_with(&peers, &cuts, &may_reduce, &sends);
                    (cuts, reducers)
                })
                .collect();
            let (cuts, reducers) = &plans[0];
            for (cuts_i, reducers_i) in &plans {
                let sorted = |c: &reach::Cuts| {
                    let mut p = c.pairs().to_vec();
                    p.sort_unstable();
                    p
                };
                assert_eq!(sorted(cuts_i), sorted(cuts));
                assert_eq!(reducers_i, reducers);
            }
            // Every failed pair is cut (both ends are behind NATs), so no reducer keeps a
            // sender it cannot reach.
            assert_eq!(cuts.pairs().len(), failed.len());
        }
        assert!(needed_forwarding > 0, "no case needed forwarding");
    }

    /// All punchable, every pair but one among three members failed: the three are linked only
    /// to the fourth. One census round leaves each of them without the others' pair; two give
    /// everyone all three.
    #[test]
    fn members_linked_to_neither_end_learn_of_the_pair() {
        let group = Group::new(&[(Reach::Punchable, true); 4]);
        let failed = [(0, 1), (0, 2), (1, 2)];
        let (floods, whole_after_one) = group.flood(&failed, 1);
        assert!(!whole_after_one);
        assert!(!floods[2].failed_pairs().contains(&(0, 1)));
        let (floods, _) = group.flood(&failed, usize::MAX);
        for f in &floods {
            assert_eq!(f.failed_pairs().len(), 6, "member {}", f.me());
            assert_eq!(f.rounds(), 2);
        }
    }

    /// What a member passes on is checked: a statement in another member's name signed by the
    /// forwarder, a bad signature, one from outside the group, one that already crossed the
    /// link, too many: the link is dropped and nothing of the batch is kept.
    #[test]
    fn hostile_batches_drop_the_link_and_are_not_kept() {
        let group = Group::new(&[
            (Reach::Public, true),
            (Reach::Punchable, true),
            (Reach::Punchable, true),
        ]);
        let peers: Vec<PeerId> = group.members.iter().map(|m| m.peer_id).collect();
        let gid = b"g";
        let own = sign(&group.keys[0], gid, 0, &[]).unwrap();
        let fresh = || Flood::new(3, 0, own.clone(), &[false, true, true]);
        let check = |k: usize, s: &CensusStatement| verify(&peers[k], gid, s);
        // Member 1 forges member 2's statement (signed with its own key).
        let forged = sign(&group.keys[1], gid, 2, &[1]).unwrap();
        let honest1 = sign(&group.keys[1], gid, 1, &[]).unwrap();
        let mut bad_sig = honest1.clone();
        bad_sig.signature = Bytes::from(vec![0; 64]);
        let outside = CensusStatement {
            member: 7,
            ..honest1.clone()
        };
        let cases: Vec<(Vec<CensusStatement>, CensusError)> = vec![
            (vec![honest1.clone(), forged], CensusError::BadSignature(2)),
            (vec![bad_sig], CensusError::BadSignature(1)),
            (vec![outside], CensusError::NotMember(7)),
            (
                vec![honest1.clone(), honest1.clone()],
                CensusError::Repeated(1),
            ),
            (vec![honest1.clone(); 4], CensusError::TooMany(3)),
        ];
        for (batch, error) in cases {
            let mut f = fresh();
            f.start_round().unwrap();
            assert_eq!(f.receive(1, batch, check), Err(error.clone()));
            assert_eq!(f.dropped(), &[1], "{error}");
            assert_eq!(f.heard(), vec![0], "{error}");
            f.end_round();
            // The dropped link sends nothing more.
            let next = f.start_round().unwrap();
            assert!(next[1].is_none() && next[2].is_some());
        }
        // A statement that crossed the link in an earlier round is refused too.
        let mut f = fresh();
        f.start_round().unwrap();
        f.receive(1, vec![honest1.clone()], check).unwrap();
        f.end_round();
        f.start_round().unwrap();
        assert_eq!(
            f.receive(1, vec![honest1], check),
            Err(CensusError::Repeated(1))
        );
    }

    fn pipe() -> (Box<dyn Link>, Box<dyn Link>) {
        let (a, b) = tokio::io::duplex(64 << 10);
        (Box::new(a), Box::new(b))
    }

    /// Three members in a line over byte pipes (0 and 2 failed to link; 1 is linked to both):
    /// [`exchange`] gives all three both statements. A silent peer is dropped at the deadline
    /// and its link closed.
    #[tokio::test]
    async fn the_exchange_floods_over_links() {
        let keys: Vec<Keypair> = (0..3).map(|_| Keypair::generate_ed25519()).collect();
        let peers: Vec<PeerId> = keys.iter().map(|k| k.public().to_peer_id()).collect();
        let (a1, b0) = pipe();
        let (b2, c1) = pipe();
        let mut links = [
            vec![None, Some(a1), None],
            vec![Some(b0), None, Some(b2)],
            vec![None, Some(c1), None],
        ];
        let unlinked: [&[u32]; 3] = [&[2], &[], &[0]];
        let mut floods: Vec<Flood> = (0..3)
            .map(|i| {
                let own = sign(&keys[i], b"g", i as u32, unlinked[i]).unwrap();
                let linked: Vec<bool> = links[i].iter().map(Option::is_some).collect();
                Flood::new(3, i, own, &linked)
            })
            .collect();
        let t = Duration::from_secs(30);
        let check = |k: usize, s: &CensusStatement| verify(&peers[k], b"g", s);
        let [l0, l1, l2] = &mut links;
        let [f0, f1, f2] = &mut floods[..] else {
            unreachable!()
        };
        tokio::join!(
            exchange(l0, f0, check, t),
            exchange(l1, f1, check, t),
            exchange(l2, f2, check, t)
        );
        for f in &floods {
            let mut pairs = f.failed_pairs();
            pairs.sort_unstable();
            assert_eq!(pairs, vec![(0, 2), (2, 0)], "member {}", f.me());
            assert!(f.dropped().is_empty());
        }
        // A silent peer: nothing heard before the deadline; the link is dropped and closed.
        let (a, _b) = pipe();
        let mut silent: Vec<Option<Box<dyn Link>>> = vec![None, Some(a)];
        let own = sign(&keys[0], b"g", 0, &[]).unwrap();
        let mut f = Flood::new(2, 0, own, &[false, true]);
        exchange(&mut silent, &mut f, check, Duration::from_millis(50)).await;
        assert_eq!(f.dropped(), &[1]);
        assert!(silent[1].is_none());
    }
}
