//! The data plane: direct, encrypted, PeerId-authenticated byte streams between group members.
//!
//! libp2p carries the control plane (DHT, group formation, metadata). The bulk bytes of a round
//! (tensor parts and averages, framed by [`crate::wire`]) go over a separate connection per peer
//! pair, because libp2p streams in 0.57 cost 2.5–3× more CPU per byte (ChaCha20 and 16 KiB yamux
//! frames; `../shared/reference/dataplane.md` §0 and §5). This module is that connection.
//!
//! # Protocol
//!
//! A [`DataStream`] is **TLS 1.3 over one plain TCP connection**, with nothing in between:
//!
//! 1. Each peer advertises its data-plane `host:port` next to its PeerId on the control plane.
//!    The dialer ([`connect`]) knows the PeerId it wants; the listener ([`DataListener`]) learns
//!    who dialled from the handshake.
//! 2. Both sides present a **libp2p-tls certificate** (`libp2p::tls::certificate::generate`):
//!    a self-signed ECDSA P-256 certificate whose critical libp2p extension carries the host's
//!    public key and its signature over the certificate key. Verifying it proves the peer holds
//!    the libp2p identity key; the PeerId is derived from that key. No CA, no server names.
//! 3. Client authentication is **mandatory**. The client aborts unless the server's PeerId is
//!    the expected one ([`TlsError::UnexpectedPeer`]); the server accepts any valid libp2p
//!    certificate and hands the authenticated client PeerId to the caller, which decides
//!    whether that peer belongs to its group.
//! 4. Only TLS 1.3; cipher suites **AES-128-GCM first**, CHACHA20-POLY1305 as the fallback for
//!    peers that do not offer AES (both from the aws-lc-rs provider, chosen explicitly rather
//!    than through a process-wide default). The server imposes its own order, so two hivemesh
//!    peers always get AES-128-GCM. Key exchange is the provider's default (X25519MLKEM768
//!    first).
//! 5. ALPN is [`ALPN_KEY_UPDATE`] (`hivemesh-data/2`: TLS 1.3 key updates, offered first) or
//!    [`ALPN`] (`hivemesh-data/1`: without, what older peers speak) and both sides require one
//!    of them, so the port cannot be confused with a libp2p listener or any other TLS service.
//!    No session tickets, no resumption, no early data: every connection runs the full
//!    handshake and both certificates are verified every time.
//!
//! After the handshake the stream is a plain byte pipe ([`tokio::io::AsyncRead`] +
//! [`tokio::io::AsyncWrite`]); framing is the caller's business. Sockets have `TCP_NODELAY`.
//! rustls runs the handshake only: then the record layer (`src/transport/record.rs`, standard TLS 1.3
//! records, keys handed over by rustls' `dangerous_extract_secrets`, as for kernel TLS; key
//! updates where both ends agreed to them, see the record module's docs) seals
//! each record straight from the caller's bytes into a 1 MiB send buffer and opens each
//! record straight from a [`READ_BUFFER`] (1 MiB) receive buffer into the caller's buffer,
//! so no byte is copied in user space on either side. Writes are buffered: flush before
//! waiting for an answer.
//!
//! # Costs (2-core test machine, loopback)
//!
//! `examples/tls_throughput.rs` measures one stream in one process; dataplane.md §1 measured
//! 0.5 CPU·s per GB for both ends with stock tokio-rustls on an AMD Zen 5 machine. On the
//! Intel machine these notes were written on, stock tokio-rustls cost 0.85 CPU·s/GB (plain
//! TCP 0.32); the record layer here removes its three memmoves per byte (see
//! `docs/architecture.md`, "The data plane's record layer"). The first handshake in a process
//! takes 20–50 ms (aws-lc seeds its DRBG), later ones about 0.5 ms.
//!
//! # Bounds and timeouts
//!
//! [`connect`] runs TCP connect and handshake under one timeout; [`DataListener::accept`] waits
//! for a connection under the timeout, then gives its handshake the whole timeout again, from
//! the moment it arrived (so a client arriving just before the wait ends is not cut short).
//! Bytes that are not a TLS record header are refused at once. A client that fails its
//! handshake, sends garbage or stays silent costs its own `accept` call an error and nothing
//! more: the listener keeps serving. `accept` takes `&self`, so several tasks may accept
//! concurrently (share the listener in an `Arc`) and a slow handshake then holds up only the
//! task running it; or [`DataListener::accept_tcp`] hands each client over as a [`Handshake`]
//! to run in a task of its own (what the link hub does, with a bound on how many run at
//! once). Memory per stream: the receive buffer, the send buffer and one record of
//! staging (about 2 MiB; a connection still in its handshake holds 33 KiB).

mod punch;
mod record;
mod socket;
mod tls;

pub use punch::PunchSocket;
pub(crate) use record::fuzz_record_layer;
pub use record::{KEY_UPDATE_AT, KeyUpdateError, SEQUENCE_LIMIT};
pub use tls::{
    ALPN, ALPN_KEY_UPDATE, DataIdentity, DataListener, DataStream, Handshake, PeerMismatch,
    READ_BUFFER, TlsError, connect, connect_over,
};
