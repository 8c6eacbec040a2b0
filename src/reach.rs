//! Who can reach whom: a peer's reachability class, how a node finds its own from what other
//! peers observe, and (for a group) the path of each link, which side opens it and which
//! members may reduce. Pure logic, no I/O: the p2p layer feeds [`Observations`], matchmaking
//! carries every member's [`Reach`] in its `MemberInfo`, and load balancing and the link layer
//! call [`path`], [`opener`] and [`reducers`], so every member of a group derives the same plan.
//!
//! # Classes
//!
//! * [`Reach::Public`]: others can dial it (a public address, a LAN, loopback). Also what a
//!   peer says while it knows nothing better, so swarms on one machine or one LAN behave as
//!   they always did.
//! * [`Reach::Punchable`]: behind a NAT whose mapping of a local port does not depend on the
//!   destination (the same external address for every peer, "endpoint-independent", as
//!   port-preserving home routers do). It dials public peers itself; two such peers connect
//!   directly by hole punching (DCUtR: both dial at once, each NAT sees an outgoing packet first).
//! * [`Reach::Private`]: behind a NAT that maps every connection anew (symmetric: a hole punch
//!   cannot predict the port), or behind a NAT not classified yet. It dials public peers; anyone
//!   else reaches it only through a relay.
//!
//! # Finding one's class ([`classify`])
//!
//! Every peer tells us, in identify, the address it sees our connection coming from. For the
//! connections we dial from our listening port (libp2p dials with port reuse):
//!
//! * an observed IP that is one of our own: no NAT in between. Public, unless dial-back tests
//!   (AutoNAT) of our own addresses failed at least [`FIREWALL_FAILURES`] times and none
//!   worked: then a firewall drops unsolicited connections, which a hole punch passes
//!   (Punchable). One failure could be a server's glitch, and AutoNAT never tests an address
//!   twice;
//! * another IP: a NAT. If every peer sees the same external port, the mapping is endpoint
//!   independent: Punchable once two peers at different IPs agree, or at once when the port is
//!   our own (the NAT kept it: port-preserving routers map endpoint-independently). Different
//!   ports for different peers: symmetric, Private. One observation of a changed port is not
//!   enough to tell: Private until a second one comes.
//! * a confirmed dial-back (AutoNAT) makes any peer Public: e.g. a port forwarded by hand.
//!
//! **Observers vote.** What a peer says it saw is its claim, and one peer may lie. Each
//! observing IP has one vote (its newest observation; peers sharing an IP share it), and each
//! conclusion above needs a strict majority of the votes: "our own IP" must be what most
//! observers saw; for each local port, most of its observers must have seen one and the same
//! external address (else the NAT is symmetric); the NAT kept our port if most observers saw
//! it kept. A lone observer decides alone (there is nobody else to ask); with three or more,
//! one liar changes nothing. Sybils at many IPs can still outvote the honest observers:
//! dial-backs (AutoNAT) are the stronger evidence, and a confirmed one wins.
//!
//! # A group's plan
//!
//! [`path`] says how two members connect: directly when one of them is public (the other one
//! dials), by hole punching when both are punchable, through a relay when both allow tensor data
//! over relays, else not at all. A member may reduce only if every member that sends data can
//! connect to it ([`reducers`]); load balancing gives the others nothing to reduce, and a group in
//! which nobody may reduce fails at once with a clear error instead of running into timeouts.
//!
//! Classes say what should work, not what did: two punchable members whose punch failed (routers
//! that refuse a punch's first packets, networks that cannot reach each other) cannot link
//! either. A node remembers such peers and names them when it joins a group; the pairs the
//! group honours ([`honoured_cuts`], bounded against lying members) are [`Cuts`], and
//! [`reducers_with`] gives a span to nobody whom a sender cannot link to, so the next round
//! with that pair is planned around it.

use std::net::IpAddr;

/// How other peers can open connections to a peer (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reach {
    /// Others can dial it directly. The default while nothing else is known.
    #[default]
    Public,
    /// Behind an endpoint-independent NAT: reachable by hole punching.
    Punchable,
    /// Behind a NAT nobody can dial through: reachable only through a relay.
    Private,
}

impl Reach {
    /// A short lowercase name (`public`, `punchable`, `private`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Public => "public",
            Self::Punchable => "punchable",
            Self::Private => "private",
        }
    }
}

impl std::fmt::Display for Reach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a link between two peers is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// One side dials the other's address.
    Direct,
    /// Both are behind NATs: a direct connection made by hole punching.
    HolePunch,
    /// Through a relay (both allow tensor data over relays).
    Relay,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Direct => "direct",
            Self::HolePunch => "hole-punch",
            Self::Relay => "relay",
        })
    }
}

/// A member as the planner sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peer {
    /// How others reach it.
    pub reach: Reach,
    /// It allows tensor data through relays.
    pub relay_data: bool,
}

/// How `a` and `b` connect, or `None` if they cannot.
pub fn path(a: Peer, b: Peer) -> Option<Path> {
    match (a.reach, b.reach) {
        (Reach::Public, _) | (_, Reach::Public) => Some(Path::Direct),
        (Reach::Punchable, Reach::Punchable) => Some(Path::HolePunch),
        _ if a.relay_data && b.relay_data => Some(Path::Relay),
        _ => None,
    }
}

/// Which of members `a` and `b` (indices into `members`, `a != b`) opens their link: the one
/// that can dial when only the other is public, else the lower index.
pub fn opener(members: &[Peer], a: usize, b: usize) -> usize {
    let (lo, hi) = (a.min(b), a.max(b));
    match (members[lo].reach, members[hi].reach) {
        (Reach::Public, Reach::Public) => lo,
        (Reach::Public, _) => hi,
        (_, Reach::Public) => lo,
        _ => lo,
    }
}

/// Which members may reduce: `may_reduce[i]` (its mode reduces at all) and every other member
/// `j` with `sends[j]` can connect to it ([`path`]).
pub fn reducers(members: &[Peer], may_reduce: &[bool], sends: &[bool]) -> Vec<bool> {
    (0..members.len())
        .map(|i| {
            may_reduce[i]
                && (0..members.len())
                    .all(|j| j == i || !sends[j] || path(members[i], members[j]).is_some())
        })
        .collect()
}

/// Most peers a member may name as ones it could not link to
/// ([`crate::matchmaking::MemberInfo::unlinkable`]); more are refused on the wire.
pub const MAX_UNLINKABLE: usize = 8;

/// Pairs of members (indices) that cannot link although [`path`] says they could: a hole punch
/// between them failed. Symmetric.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cuts {
    pairs: Vec<(usize, usize)>,
}

impl Cuts {
    /// No cut pair.
    pub fn none() -> Self {
        Self::default()
    }

    /// Marks `a` and `b` as unable to link (nothing for `a == b`).
    pub fn cut(&mut self, a: usize, b: usize) {
        let pair = (a.min(b), a.max(b));
        if a != b && !self.pairs.contains(&pair) {
            self.pairs.push(pair);
        }
    }

    /// Whether `a` and `b` cannot link.
    pub fn contains(&self, a: usize, b: usize) -> bool {
        self.pairs.contains(&(a.min(b), a.max(b)))
    }

    /// The cut pairs, lower index first, in the order they were cut.
    pub fn pairs(&self) -> &[(usize, usize)] {
        &self.pairs
    }

    /// Whether no pair is cut.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// How `members[a]` and `members[b]` connect given `cuts`: [`path`], unless the pair is cut.
pub fn path_between(members: &[Peer], cuts: &Cuts, a: usize, b: usize) -> Option<Path> {
    if cuts.contains(a, b) {
        None
    } else {
        path(members[a], members[b])
    }
}

/// [`reducers`] with `cuts`: a member reduces only if every other member that sends can
/// link to it.
pub fn reducers_with(
    members: &[Peer],
    cuts: &Cuts,
    may_reduce: &[bool],
    sends: &[bool],
) -> Vec<bool> {
    (0..members.len())
        .map(|i| {
            may_reduce[i]
                && (0..members.len())
                    .all(|j| j == i || !sends[j] || path_between(members, cuts, i, j).is_some())
        })
        .collect()
}

/// Which of the members' claims to honour: `claims` are `(claimant, other)` pairs, "the
/// claimant could not link to the other". What a member publishes is hostile input, so:
///
/// * only a pair that needs a hole punch or a relay is cut (both members behind NATs): a public
///   member is dialled directly, and a claim cannot take its span away;
/// * a claim names the claimant itself (the caller maps what a member says to pairs with it),
///   so a member can cost only its own pairs: at most [`MAX_UNLINKABLE`] of them;
/// * if the cuts would leave nobody to reduce where somebody could without them, the claims
///   of the member that made the most (the highest index on a tie) are dropped, and so on: a
///   member claiming it links to nobody cannot stall a group that would average without it.
///
/// Every member computes this from the same group, so all agree.
pub fn honoured_cuts(
    members: &[Peer],
    claims: &[(usize, usize)],
    may_reduce: &[bool],
    sends: &[bool],
) -> Cuts {
    let n = members.len();
    let nated = |i: usize| i < n && members[i].reach != Reach::Public;
    let mut kept: Vec<(usize, usize)> = claims
        .iter()
        .copied()
        .filter(|&(a, b)| a != b && nated(a) && nated(b))
        .collect();
    let anyone = reducers(members, may_reduce, sends).iter().any(|&r| r);
    loop {
        let mut cuts = Cuts::none();
        for &(a, b) in &kept {
            cuts.cut(a, b);
        }
        if !anyone
            || reducers_with(members, &cuts, may_reduce, sends)
                .iter()
                .any(|&r| r)
        {
            return cuts;
        }
        let mut count = vec![0usize; n];
        for &(a, _) in &kept {
            count[a] += 1;
        }
        let Some(worst) = (0..n).max_by_key(|&i| count[i]) else {
            return Cuts::none();
        };
        kept.retain(|&(a, _)| a != worst);
    }
}

/// How long a node remembers a peer it could not link to ([`Unlinkable`]).
pub const UNLINKABLE_FOR: std::time::Duration = std::time::Duration::from_secs(600);
/// Most peers an [`Unlinkable`] remembers (the oldest are forgotten first).
pub const MAX_REMEMBERED: usize = 64;

/// The peers a node could not link to lately (sans-IO: the caller passes the time). Bounded
/// ([`MAX_REMEMBERED`]) and expiring ([`UNLINKABLE_FOR`]); what it publishes is the newest
/// [`MAX_UNLINKABLE`].
#[derive(Clone, Debug)]
pub struct Unlinkable<P> {
    failed: Vec<(P, std::time::Instant)>,
}

impl<P> Default for Unlinkable<P> {
    fn default() -> Self {
        Self { failed: Vec::new() }
    }
}

impl<P: PartialEq + Clone> Unlinkable<P> {
    /// A link with `peer` could not be made at `now`.
    pub fn failed(&mut self, peer: P, now: std::time::Instant) {
        self.failed.retain(|(p, _)| *p != peer);
        if self.failed.len() >= MAX_REMEMBERED {
            self.failed.remove(0);
        }
        self.failed.push((peer, now));
    }

    /// A link with `peer` was made: it is linkable again.
    pub fn linked(&mut self, peer: &P) {
        self.failed.retain(|(p, _)| p != peer);
    }

    /// Whether a link with `peer` failed less than [`UNLINKABLE_FOR`] before `now`.
    pub fn contains(&self, peer: &P, now: std::time::Instant) -> bool {
        self.failed
            .iter()
            .any(|(p, at)| p == peer && now.saturating_duration_since(*at) < UNLINKABLE_FOR)
    }

    /// The peers to publish at `now`: those that failed less than [`UNLINKABLE_FOR`] ago, the
    /// newest first, at most [`MAX_UNLINKABLE`]. Forgets the expired ones.
    pub fn recent(&mut self, now: std::time::Instant) -> Vec<P> {
        self.failed
            .retain(|(_, at)| now.saturating_duration_since(*at) < UNLINKABLE_FOR);
        self.failed
            .iter()
            .rev()
            .take(MAX_UNLINKABLE)
            .map(|(p, _)| p.clone())
            .collect()
    }
}

/// What peers observed of our outbound connections (identify's observed addresses), and
/// what dial-back tests (AutoNAT) said; input of [`classify`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observations {
    /// Our own addresses (the IPs we listen on).
    pub own_ips: Vec<IpAddr>,
    /// For each connection we dialed from our listening port: the remote peer's IP, the local
    /// port we dialed from, and the address the remote peer saw us at.
    pub seen: Vec<Seen>,
    /// A dial-back test reached us at some address.
    pub confirmed: bool,
    /// Dial-back tests that failed at one of our own addresses.
    pub dial_back_failures: u32,
}

/// Failed dial-backs of our own addresses (and none that worked) that make a node without a
/// NAT count as firewalled ([`Reach::Punchable`]).
pub const FIREWALL_FAILURES: u32 = 2;

/// One observation of our address by a remote peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seen {
    /// The observing peer's IP.
    pub remote: IpAddr,
    /// The local port our connection to it came from.
    pub local_port: u16,
    /// The IP it saw.
    pub ip: IpAddr,
    /// The port it saw.
    pub port: u16,
}

/// Most observations [`Observations::add`] keeps (the newest ones).
pub const MAX_OBSERVATIONS: usize = 32;

impl Observations {
    /// Records an observation, keeping at most [`MAX_OBSERVATIONS`] (one per remote IP and
    /// local port: a newer one replaces the older).
    pub fn add(&mut self, seen: Seen) {
        self.seen
            .retain(|s| !(s.remote == seen.remote && s.local_port == seen.local_port));
        if self.seen.len() == MAX_OBSERVATIONS {
            self.seen.remove(0);
        }
        self.seen.push(seen);
    }
}

/// This node's class from what peers observed (module docs), or `None` while nothing was
/// observed and nothing confirmed.
///
/// Each observing IP has one vote, its newest observation, and a class needs a strict majority
/// of the voters ("Observers vote" in the module docs): one peer that lies in identify cannot
/// make a node public, symmetric or port-preserving against the others' word.
pub fn classify(obs: &Observations) -> Option<Reach> {
    if obs.confirmed {
        return Some(Reach::Public);
    }
    // The newest observation of each remote IP (`seen` is in arrival order).
    let mut votes: Vec<&Seen> = Vec::new();
    for s in &obs.seen {
        match votes.iter_mut().find(|v| v.remote == s.remote) {
            Some(v) => *v = s,
            None => votes.push(s),
        }
    }
    if votes.is_empty() {
        return None;
    }
    let own = votes.iter().filter(|v| obs.own_ips.contains(&v.ip)).count();
    if 2 * own > votes.len() {
        return Some(if obs.dial_back_failures >= FIREWALL_FAILURES {
            Reach::Punchable
        } else {
            Reach::Public
        });
    }
    // Behind a NAT (as most observers say). Does its mapping depend on the destination? For
    // each local port, a strict majority of its observers must have seen one and the same
    // external address; and the NAT kept our port if a strict majority saw it kept.
    let nat: Vec<&Seen> = votes
        .into_iter()
        .filter(|v| !obs.own_ips.contains(&v.ip))
        .collect();
    let consistent = nat.iter().all(|s| {
        let same_port: Vec<&&Seen> = nat
            .iter()
            .filter(|t| t.local_port == s.local_port)
            .collect();
        let view = |u: &Seen| (u.ip, u.port);
        same_port.iter().any(|u| {
            let agreeing = same_port.iter().filter(|t| view(t) == view(u)).count();
            2 * agreeing > same_port.len()
        })
    });
    let preserved = 2 * nat.iter().filter(|s| s.port == s.local_port).count() > nat.len();
    Some(if consistent && (preserved || nat.len() >= 2) {
        Reach::Punchable
    } else {
        Reach::Private
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn seen(remote: &str, local_port: u16, at: &str, port: u16) -> Seen {
        Seen {
            remote: ip(remote),
            local_port,
            ip: ip(at),
            port,
        }
    }

    fn peer(reach: Reach) -> Peer {
        Peer {
            reach,
            relay_data: false,
        }
    }

    #[test]
    fn classes_from_observations() {
        let mut obs = Observations {
            own_ips: vec![ip("192.168.1.2")],
            ..Observations::default()
        };
        assert_eq!(classify(&obs), None);
        // A port-preserving NAT: our port, another IP.
        obs.add(seen("10.0.0.1", 4001, "10.0.0.9", 4001));
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        // A second peer sees the same: still punchable.
        obs.add(seen("10.0.0.2", 4001, "10.0.0.9", 4001));
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        // A third sees another port for the same local port: outvoted, still punchable.
        obs.add(seen("10.0.0.3", 4001, "10.0.0.9", 5555));
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        // A fourth sees yet another: no view holds a majority any more: symmetric.
        obs.add(seen("10.0.0.4", 4001, "10.0.0.9", 5556));
        assert_eq!(classify(&obs), Some(Reach::Private));
        // A dial-back that worked overrides everything.
        obs.confirmed = true;
        assert_eq!(classify(&obs), Some(Reach::Public));
    }

    #[test]
    fn a_changed_port_needs_a_second_opinion() {
        let mut obs = Observations::default();
        obs.add(seen("10.0.0.1", 4001, "10.0.0.9", 31000));
        assert_eq!(classify(&obs), Some(Reach::Private));
        // The same mapping seen from another IP: endpoint independent after all.
        obs.add(seen("10.0.0.2", 4001, "10.0.0.9", 31000));
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        // A second peer at the same IP is no second opinion.
        let mut obs = Observations::default();
        obs.add(seen("10.0.0.1", 4001, "10.0.0.9", 31000));
        obs.add(seen("10.0.0.1", 4002, "10.0.0.9", 31001));
        assert_eq!(classify(&obs), Some(Reach::Private));
    }

    /// Issue 29, attack 4: one peer's identify answer set this node's class. Three honest
    /// observers agree on a port-preserving mapping; one liar claims each other conclusion in
    /// turn, and none of them takes.
    #[test]
    fn one_lying_observer_cannot_change_the_class() {
        let honest = || {
            let mut obs = Observations {
                own_ips: vec![ip("192.168.1.2")],
                ..Observations::default()
            };
            for r in ["10.0.0.1", "10.0.0.2", "10.0.0.3"] {
                obs.add(seen(r, 4001, "10.0.0.9", 4001));
            }
            obs
        };
        assert_eq!(classify(&honest()), Some(Reach::Punchable));
        for lie in [
            seen("10.6.6.6", 4001, "192.168.1.2", 4001), // "you are at your own IP": public
            seen("10.6.6.6", 4001, "10.0.0.9", 31337),   // "another port": symmetric
        ] {
            let mut obs = honest();
            obs.add(lie);
            assert_eq!(classify(&obs), Some(Reach::Punchable), "{lie:?}");
        }
        // Against an honest symmetric NAT (every observer sees another port), one liar
        // claiming a kept port makes it neither consistent nor port-preserving.
        let mut obs = Observations::default();
        for (i, r) in ["10.0.0.1", "10.0.0.2", "10.0.0.3"].into_iter().enumerate() {
            obs.add(seen(r, 4001, "10.0.0.9", 31000 + i as u16));
        }
        obs.add(seen("10.6.6.6", 4001, "10.0.0.9", 4001));
        assert_eq!(classify(&obs), Some(Reach::Private));
        // The same liar's newest word replaces its older one: still one vote.
        let mut obs = honest();
        for port in [5000, 5001, 5002] {
            obs.add(seen("10.6.6.6", port, "192.168.1.2", port));
        }
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        // A majority of observers at our own IP: public.
        let mut obs = honest();
        for r in ["10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"] {
            obs.add(seen(r, 4001, "192.168.1.2", 4001));
        }
        assert_eq!(classify(&obs), Some(Reach::Public));
    }

    #[test]
    fn own_address_is_public_unless_dial_back_failed() {
        let mut obs = Observations {
            own_ips: vec![ip("127.0.0.1")],
            ..Observations::default()
        };
        obs.add(seen("127.0.0.1", 4001, "127.0.0.1", 4001));
        assert_eq!(classify(&obs), Some(Reach::Public));
        obs.dial_back_failures = 1;
        assert_eq!(
            classify(&obs),
            Some(Reach::Public),
            "one failure may be a glitch"
        );
        obs.dial_back_failures = FIREWALL_FAILURES;
        assert_eq!(classify(&obs), Some(Reach::Punchable));
        obs.confirmed = true;
        assert_eq!(classify(&obs), Some(Reach::Public));
    }

    #[test]
    fn observations_are_bounded_and_replaced() {
        let mut obs = Observations::default();
        for i in 0..100u16 {
            obs.add(seen("10.0.0.1", 1000 + i, "10.0.0.9", 1000 + i));
        }
        assert_eq!(obs.seen.len(), MAX_OBSERVATIONS);
        obs.add(seen("10.0.0.1", 1099, "10.0.0.9", 7));
        assert_eq!(obs.seen.len(), MAX_OBSERVATIONS);
        assert_eq!(obs.seen.last().unwrap().port, 7);
    }

    #[test]
    fn paths_and_openers() {
        use Reach::*;
        let m = [peer(Public), peer(Punchable), peer(Private), peer(Public)];
        assert_eq!(path(m[0], m[2]), Some(Path::Direct));
        assert_eq!(path(m[1], m[1]), Some(Path::HolePunch));
        assert_eq!(path(m[1], m[2]), None);
        assert_eq!(path(m[2], m[2]), None);
        let relay = Peer {
            reach: Private,
            relay_data: true,
        };
        assert_eq!(path(relay, relay), Some(Path::Relay));
        assert_eq!(path(relay, m[2]), None);
        // Two public members: the lower index opens.
        assert_eq!(opener(&m, 3, 0), 0);
        // A public and a NATed one: the NATed one dials.
        assert_eq!(opener(&m, 0, 2), 2);
        assert_eq!(opener(&m, 1, 3), 1);
        // Two NATed ones: the lower index.
        assert_eq!(opener(&m, 2, 1), 1);
    }

    #[test]
    fn who_may_reduce() {
        use Reach::*;
        // Two public, two punchable: everyone.
        let m = [peer(Public), peer(Public), peer(Punchable), peer(Punchable)];
        assert_eq!(reducers(&m, &[true; 4], &[true; 4]), vec![true; 4]);
        // A symmetric NAT among them: only the public ones can be reached by everyone.
        let m = [peer(Public), peer(Punchable), peer(Private), peer(Public)];
        assert_eq!(
            reducers(&m, &[true; 4], &[true; 4]),
            vec![true, false, false, true]
        );
        // Unless the punchable one need not hear from the private one (an aux peer sends nothing).
        assert_eq!(
            reducers(&m, &[true; 4], &[true, true, false, true]),
            vec![true, true, false, true]
        );
        // Nobody public and one private: nobody.
        let m = [peer(Punchable), peer(Private)];
        assert_eq!(reducers(&m, &[true; 2], &[true; 2]), vec![false, false]);
    }

    #[test]
    fn unlinkable_peers_are_bounded_and_expire() {
        let t0 = std::time::Instant::now();
        let at = |s: u64| t0 + std::time::Duration::from_secs(s);
        let mut u = Unlinkable::default();
        u.failed(1u32, at(0));
        u.failed(2, at(10));
        assert!(u.contains(&1, at(599)));
        assert_eq!(u.recent(at(20)), vec![2, 1]);
        // Ten minutes after the failure it is forgotten.
        assert!(!u.contains(&1, at(600)));
        assert_eq!(u.recent(at(605)), vec![2]);
        // A link made clears it; a new failure renews it.
        u.linked(&2);
        assert!(u.recent(at(606)).is_empty());
        u.failed(2, at(700));
        u.failed(2, at(800));
        assert!(u.contains(&2, at(1399)));
        // At most MAX_UNLINKABLE published (the newest), MAX_REMEMBERED remembered.
        for p in 0..1000 {
            u.failed(p, at(900));
        }
        assert_eq!(u.failed.len(), MAX_REMEMBERED);
        let published = u.recent(at(900));
        assert_eq!(published.len(), MAX_UNLINKABLE);
        assert_eq!(published[0], 999);
    }

    #[test]
    fn a_cut_pair_reduces_nothing_and_the_others_carry_the_group() {
        use Reach::*;
        let m = [peer(Public), peer(Public), peer(Punchable), peer(Punchable)];
        let all = [true; 4];
        // Member 2 says it could not link to member 3 (and 3 says nothing).
        let cuts = honoured_cuts(&m, &[(2, 3)], &all, &all);
        assert!(cuts.contains(3, 2));
        assert_eq!(path_between(&m, &cuts, 2, 3), None);
        assert_eq!(path_between(&m, &cuts, 2, 0), Some(Path::Direct));
        assert_eq!(
            reducers_with(&m, &cuts, &all, &all),
            vec![true, true, false, false]
        );
        // A claim against a public member is not honoured: it is dialled directly.
        let cuts = honoured_cuts(&m, &[(2, 0), (3, 1)], &all, &all);
        assert!(cuts.is_empty());
        // Only punchable members: a liar that names everyone cannot leave the group without a
        // reducer; its claims go, the honest one stays.
        let m = [peer(Punchable); 4];
        let lies = [(0, 1), (0, 2), (0, 3), (2, 3)];
        let cuts = honoured_cuts(&m, &lies, &all, &all);
        assert_eq!(cuts.pairs(), &[(2, 3)]);
        assert_eq!(
            reducers_with(&m, &cuts, &all, &all),
            vec![true, true, false, false]
        );
    }

    fn any_reach() -> impl Strategy<Value = Reach> {
        prop_oneof![
            Just(Reach::Public),
            Just(Reach::Punchable),
            Just(Reach::Private)
        ]
    }

    proptest! {
        /// Paths are symmetric, openers agree from both ends, and a reducer can be reached by
        /// every sender.
        #[test]
        fn plans_are_consistent(
            reach in prop::collection::vec((any_reach(), any::<bool>(), any::<bool>()), 1..8)
        ) {
            let m: Vec<Peer> = reach.iter().map(|&(reach, relay_data, _)| Peer { reach, relay_data }).collect();
            let sends: Vec<bool> = reach.iter().map(|r| r.2).collect();
            let red = reducers(&m, &vec![true; m.len()], &sends);
            for a in 0..m.len() {
                for b in 0..m.len() {
                    prop_assert_eq!(path(m[a], m[b]), path(m[b], m[a]));
                    if a != b {
                        let o = opener(&m, a, b);
                        prop_assert!(o == a || o == b);
                        prop_assert_eq!(o, opener(&m, b, a));
                        // A public member opens only to another public one (a NATed peer
                        // cannot be dialed; it dials).
                        if m[o].reach == Reach::Public {
                            prop_assert_eq!(m[a.max(b) + a.min(b) - o].reach, Reach::Public);
                        }
                        if red[a] && sends[b] {
                            prop_assert!(path(m[a], m[b]).is_some());
                        }
                    }
                }
            }
            // A public member that may reduce always can.
            for i in 0..m.len() {
                if m[i].reach == Reach::Public {
                    prop_assert!(red[i]);
                }
            }
        }

        /// Whatever members claim: only claimed pairs of two NATed members are cut, public
        /// reducers keep their spans, a group that had a reducer keeps one, and a reducer can
        /// link to every sender.
        #[test]
        fn claims_are_bounded(
            reach in prop::collection::vec((any_reach(), any::<bool>(), any::<bool>()), 1..8),
            claims in prop::collection::vec((0usize..10, 0usize..10), 0..30),
        ) {
            let m: Vec<Peer> = reach.iter().map(|&(reach, relay_data, _)| Peer { reach, relay_data }).collect();
            let sends: Vec<bool> = reach.iter().map(|r| r.2).collect();
            let may = vec![true; m.len()];
            let cuts = honoured_cuts(&m, &claims, &may, &sends);
            for &(a, b) in cuts.pairs() {
                prop_assert!(claims.contains(&(a, b)) || claims.contains(&(b, a)));
                prop_assert!(m[a].reach != Reach::Public && m[b].reach != Reach::Public);
            }
            let before = reducers(&m, &may, &sends);
            let after = reducers_with(&m, &cuts, &may, &sends);
            if before.iter().any(|&r| r) {
                prop_assert!(after.iter().any(|&r| r));
            }
            for i in 0..m.len() {
                prop_assert!(!after[i] || before[i]);
                if m[i].reach == Reach::Public {
                    prop_assert!(after[i]);
                }
                for j in 0..m.len() {
                    if after[i] && sends[j] && i != j {
                        prop_assert!(path_between(&m, &cuts, i, j).is_some());
                    }
                }
            }
        }
    }
}
