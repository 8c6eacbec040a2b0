//! Peer addresses inside DHT values: one encoding for every value that tells readers where to
//! reach its writer (state-sharing announcements, matchmaking declarations, relay
//! announcements).
//!
//! An address list is a sequence of entries, each one length byte and a binary multiaddr of at
//! most [`MAX_ADDR_BYTES`] bytes, at most [`MAX_ADDRS`] entries; a trailing `/p2p/<id>` is
//! dropped on encoding (the entry's owner subkey names the peer). Decoding rejects anything
//! else, so a hostile writer cannot make a reader allocate more than the limits.

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;

/// Most addresses an address list carries.
pub const MAX_ADDRS: usize = 4;
/// Longest address in a list, in bytes (binary multiaddr).
pub const MAX_ADDR_BYTES: usize = 128;

/// Appends the address list of `addrs` to `out`: the first [`MAX_ADDRS`] of those that fit in
/// [`MAX_ADDR_BYTES`] once a trailing `/p2p/<id>` is dropped.
pub fn encode_addrs(addrs: &[Multiaddr], out: &mut Vec<u8>) {
    let addrs = addrs
        .iter()
        .map(|a| {
            let mut a = a.clone();
            if matches!(a.iter().last(), Some(Protocol::P2p(_))) {
                a.pop();
            }
            a
        })
        .filter(|a| !a.is_empty() && a.as_ref().len() <= MAX_ADDR_BYTES)
        .take(MAX_ADDRS);
    for a in addrs {
        out.push(a.as_ref().len() as u8);
        out.extend_from_slice(a.as_ref());
    }
}

/// Parses an address list ([`encode_addrs`]) that makes up all of `bytes`; `None` for anything
/// else (a malformed or oversized address, too many addresses, trailing bytes).
pub fn decode_addrs(mut bytes: &[u8]) -> Option<Vec<Multiaddr>> {
    let mut addrs = Vec::new();
    while let Some((&len, tail)) = bytes.split_first() {
        let len = usize::from(len);
        if len == 0 || len > MAX_ADDR_BYTES || addrs.len() == MAX_ADDRS {
            return None;
        }
        let (addr, tail) = tail.split_at_checked(len)?;
        addrs.push(Multiaddr::try_from(addr.to_vec()).ok()?);
        bytes = tail;
    }
    Some(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::PeerId;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_limits() {
        let tcp: Multiaddr = "/ip4/10.0.0.1/tcp/4001".parse().unwrap();
        let circuit: Multiaddr = format!(
            "/ip4/10.0.0.2/tcp/4001/p2p/{}/p2p-circuit",
            PeerId::random()
        )
        .parse()
        .unwrap();
        let mut out = Vec::new();
        encode_addrs(&[tcp.clone(), circuit.clone()], &mut out);
        assert_eq!(decode_addrs(&out), Some(vec![tcp.clone(), circuit]));
        // A trailing peer id is dropped, and only the first addresses are kept.
        let mut out = Vec::new();
        encode_addrs(
            &vec![tcp.clone().with(Protocol::P2p(PeerId::random())); 9],
            &mut out,
        );
        assert_eq!(decode_addrs(&out), Some(vec![tcp.clone(); MAX_ADDRS]));
        assert_eq!(decode_addrs(&[]), Some(vec![]));
        // Junk.
        assert_eq!(decode_addrs(&[0]), None);
        assert_eq!(decode_addrs(&[5, 1, 2]), None);
        assert_eq!(decode_addrs(&[200; 300]), None);
        let mut five = Vec::new();
        for _ in 0..5 {
            five.push(tcp.as_ref().len() as u8);
            five.extend_from_slice(tcp.as_ref());
        }
        assert_eq!(decode_addrs(&five), None);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
            if let Some(addrs) = decode_addrs(&bytes) {
                prop_assert!(addrs.len() <= MAX_ADDRS);
            }
        }
    }
}
