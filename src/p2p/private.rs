//! Private swarms: only peers holding the swarm's pre-shared key connect.
//!
//! # How
//!
//! * **The libp2p swarm** runs its TCP connections through libp2p's private-network layer
//!   ([`libp2p::pnet`], the format and protocol of go-libp2p and IPFS private networks): each
//!   side sends a random 24-byte nonce, and every later byte is XSalsa20-encrypted under the
//!   pre-shared key and the sender's nonce, below the noise handshake. A peer without the key
//!   (or with another) garbles its noise handshake, which fails: it can neither join the DHT nor
//!   reach the matchmaking, state or stream protocols. pnet authenticates nothing by itself;
//!   what it keeps out is everyone whose noise handshake it turns into noise.
//! * **QUIC** cannot carry the layer (its handshake is TLS inside UDP packets), so a private
//!   swarm listens and dials on TCP only; QUIC listen addresses in the configuration are left
//!   out with a warning.
//! * **Relayed connections** go over a connection to a relay, which is itself a swarm member:
//!   an outsider cannot reach the relay, so it cannot reach anyone through it.
//! * **The TLS data plane** (the link hub's own TCP listener, outside libp2p) is gated by an
//!   allowlist ([`SwarmPeers`]): peers this node has had a libp2p connection with (each one
//!   went through the key), and the members of rounds registered with the hub (learned from a
//!   leader over such a connection). Any other peer that completes a TLS handshake is refused
//!   at once with [`crate::wire::RejectReason::NotInSwarm`], before it can send a Hello or hold
//!   a pending link. A member that links before its round is registered here and before any
//!   libp2p connection between the two is refused the same way and retries, as for an unknown
//!   group. Before that, before any TLS handshake runs (the ClientHello names no peer), the
//!   TCP connection's source address is checked: it must be one a swarm peer has had a libp2p
//!   connection from (the allowlist also remembers those addresses, keyed as
//!   [`super::inbound::AddrKey`]: the IPv4 address or the IPv6 /64), or the data address of a
//!   member of a round registered here. Any other connection is closed before a ServerHello;
//!   its opener falls back to a libp2p stream (through the key), after which its address is
//!   known.
//!
//! The key file is the go-libp2p / IPFS `swarm.key` format: `/key/swarm/psk/1.0.0/`, `/base16/`
//! and 64 hex digits, one per line ([`SwarmKey::generate`] writes one).

use std::collections::{HashSet, VecDeque};
use std::net::IpAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use libp2p::pnet::PreSharedKey;
use libp2p::{Multiaddr, PeerId};

use super::inbound::AddrKey;
/// A private swarm's pre-shared key (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SwarmKey(PreSharedKey);

impl std::fmt::Debug for SwarmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key itself never goes into logs: its fingerprint names it.
        write!(f, "SwarmKey(fingerprint {})", self.0.fingerprint())
    }
}

/// Why a swarm key could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SwarmKeyError {
    /// The file could not be read.
    #[error("swarm key file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The text is not a swarm key.
    #[error("not a swarm key (expected /key/swarm/psk/1.0.0/, /base16/ and 64 hex digits): {0}")]
    Parse(String),
}

impl SwarmKey {
    /// A key from its 32 bytes.
    pub fn new(bytes: [u8; 32]) -> Self {
        Self(PreSharedKey::new(bytes))
    }

    /// A new random key.
    pub fn generate() -> Self {
        Self::new(rand::random())
    }

    /// Parses the key file format.
    pub fn parse(text: &str) -> Result<Self, SwarmKeyError> {
        text.trim()
            .parse::<PreSharedKey>()
            .map(Self)
            .map_err(|e| SwarmKeyError::Parse(e.to_string()))
    }

    /// Reads a key file.
    pub fn read(path: &Path) -> Result<Self, SwarmKeyError> {
        let text = std::fs::read_to_string(path).map_err(|source| SwarmKeyError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// The key file's text (`parse` reads it back).
    pub fn to_key_file(self) -> String {
        self.0.to_key_file()
    }

    /// A fingerprint that names the key without revealing it (for logs and operators).
    pub fn fingerprint(&self) -> String {
        self.0.fingerprint().to_string()
    }

    pub(super) fn psk(self) -> PreSharedKey {
        self.0
    }
}

/// Peers (and, apart, addresses) remembered by [`SwarmPeers`]; the oldest are forgotten first.
const MAX_SWARM_PEERS: usize = 65_536;

/// The peers this node has had a libp2p connection with in a private swarm (every one of them
/// went through the swarm key), and the addresses those connections came from (keyed as
/// an IPv4 address or an IPv6 /64), each bounded to the most recent 65,536.
#[derive(Clone, Debug, Default)]
pub struct SwarmPeers(Arc<Mutex<Remembered>>);

#[derive(Debug, Default)]
struct Remembered {
    peers: Bounded<PeerId>,
    addrs: Bounded<AddrKey>,
}

/// A set that forgets its oldest entries beyond [`MAX_SWARM_PEERS`].
#[derive(Debug)]
struct Bounded<T> {
    set: HashSet<T>,
    order: VecDeque<T>,
}

impl<T> Default for Bounded<T> {
    fn default() -> Self {
        Self {
            set: HashSet::new(),
            order: VecDeque::new(),
        }
    }
}

impl<T: std::hash::Hash + Eq + Clone> Bounded<T> {
    fn insert(&mut self, item: T) {
        if self.set.insert(item.clone()) {
            self.order.push_back(item);
            if self.order.len() > MAX_SWARM_PEERS
                && let Some(old) = self.order.pop_front()
            {
                self.set.remove(&old);
            }
        }
    }
}

impl SwarmPeers {
    /// Remembers `peer` (connected through the key) and the IP address of its connection at
    /// `remote` (a relayed connection has none of its own: only the peer is remembered).
    pub(super) fn insert(&self, peer: PeerId, remote: &Multiaddr) {
        let mut r = self.0.lock().expect("swarm peers lock");
        r.peers.insert(peer);
        let key = AddrKey::of(remote);
        if !matches!(key, AddrKey::Other(_)) {
            r.addrs.insert(key);
        }
    }

    /// Whether `peer` has had a libp2p connection with this node.
    pub fn contains(&self, peer: &PeerId) -> bool {
        self.0
            .lock()
            .expect("swarm peers lock")
            .peers
            .set
            .contains(peer)
    }

    /// Whether a peer has had a direct libp2p connection with this node from `ip` (from its
    /// /64 for an IPv6 address).
    pub fn knows_address(&self, ip: IpAddr) -> bool {
        self.0
            .lock()
            .expect("swarm peers lock")
            .addrs
            .set
            .contains(&AddrKey::of_ip(ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_files_round_trip_and_garbage_is_refused() {
        let key = SwarmKey::generate();
        assert_eq!(SwarmKey::parse(&key.to_key_file()).unwrap(), key);
        assert_ne!(SwarmKey::generate(), key);
        for bad in ["", "/key/swarm/psk/1.0.0/\n/base16/\nabcd", "hello"] {
            assert!(SwarmKey::parse(bad).is_err(), "{bad:?}");
        }
        assert!(!format!("{key:?}").contains(&key.to_key_file()[30..]));
    }

    #[test]
    fn swarm_peers_forget_the_oldest_beyond_the_bound() {
        let peers = SwarmPeers::default();
        let at: Multiaddr = "/p2p-circuit".parse().unwrap();
        let first = PeerId::random();
        peers.insert(first, &at);
        for _ in 0..MAX_SWARM_PEERS {
            peers.insert(PeerId::random(), &at);
        }
        assert!(!peers.contains(&first));
        let last = PeerId::random();
        peers.insert(last, &at);
        assert!(peers.contains(&last));
    }

    #[test]
    fn swarm_peers_remember_connection_addresses_by_ipv4_or_ipv6_net() {
        let peers = SwarmPeers::default();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(!peers.knows_address(ip("192.0.2.1")));
        peers.insert(
            PeerId::random(),
            &"/ip4/192.0.2.1/tcp/4001".parse().unwrap(),
        );
        peers.insert(
            PeerId::random(),
            &"/ip6/2001:db8:1:2::5/tcp/4001".parse().unwrap(),
        );
        // Relayed: no address of its own.
        peers.insert(
            PeerId::random(),
            &"/ip4/198.51.100.9/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit"
                .parse()
                .unwrap(),
        );
        assert!(peers.knows_address(ip("192.0.2.1")));
        assert!(peers.knows_address(ip("::ffff:192.0.2.1")));
        assert!(!peers.knows_address(ip("192.0.2.2")));
        assert!(peers.knows_address(ip("2001:db8:1:2:ffff::1")));
        assert!(!peers.knows_address(ip("2001:db8:1:3::5")));
        assert!(!peers.knows_address(ip("198.51.100.9")));
    }
}
