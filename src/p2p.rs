//! The libp2p layer: the only module that touches libp2p types beyond `PeerId`, `Multiaddr` and
//! `Keypair`.
//!
//! # Shape
//!
//! One task (the *event loop*, `swarm.rs`) owns the [`libp2p::Swarm`]: TCP (noise + yamux) and
//! QUIC transports, DNS, identify, ping and Kademlia. Everything else talks to it through a
//! cloneable [`P2p`] handle that sends commands over a bounded channel, each
//! with a oneshot reply; every wait on a reply is under a timeout. When the last handle is
//! dropped (or [`P2p::shutdown`] is called) the event loop closes its listeners and ends.
//!
//! # Kademlia records
//!
//! libp2p-kad keeps one record per key and overwrites on every put. hivemesh values are
//! dictionaries whose entries come from many peers, so the event loop runs Kademlia with
//! `StoreInserts::FilterBoth`: every inbound PUT is handed to a [`RecordPolicy`], which
//! validates it and merges it with the stored value; local puts are merged the same way
//! before they are replicated. GETs return every replica's value, for the caller to merge.
//! The policy (value format, merge rules, limits) lives in [`crate::dht`]; this layer only moves
//! bytes. Kademlia's defaults (16 KiB messages, 65 KiB values) are raised deliberately:
//! [`P2pConfig::max_record_bytes`] bounds stored values and the packet size follows from it.
//!
//! Peers that cannot accept connections set [`P2pConfig::client_mode`]: their Kademlia runs in
//! client mode (they query but are never added to others' routing tables). Everyone else is
//! forced to server mode: on loopback and LANs nothing would confirm an external address.
//!
//! # Streams
//!
//! The swarm also runs the `libp2p-stream` behaviour (0.5.0-alpha, the version that builds with
//! libp2p 0.57.1): [`P2p::open_stream`] opens an outbound stream for a protocol to a peer
//! (dialing it first if needed, everything under one timeout) and [`P2p::accept_streams`]
//! registers a protocol and returns its inbound streams through a bounded queue. Both hand out
//! [`P2pStream`]s, which are tokio byte streams, so no libp2p type leaves this module beyond
//! `PeerId`, `Multiaddr` and `Keypair`.
//!
//! libp2p-stream 0.5.0-alpha hands inbound streams over through a channel with a single slot
//! and *drops* a stream that arrives while the slot is occupied (the opener sees its stream
//! reset or never answered). [`InboundStreams`] drains that slot from a dedicated task into a
//! bounded queue, which makes drops rare but cannot rule them out; protocols on top must detect
//! a silent stream and re-open it (`crate::links` does, with its Hello/Ack).

mod identity;
mod swarm;

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::StreamExt as _;
use libp2p::{Multiaddr, PeerId, identity::Keypair};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt as _};

pub use identity::load_or_create as load_or_create_identity;

/// Kademlia protocol name of hivemesh DHTs.
pub const KAD_PROTOCOL: &str = "/hivemesh/kad/1.0.0";
/// Identify protocol version string.
pub const IDENTIFY_PROTOCOL: &str = "/hivemesh/id/1.0.0";
/// Default bound on a stored record value.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1 << 20;
/// Default timeout of DHT queries and of waits on the event loop.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time to reach at least one initial peer.
pub const DEFAULT_BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(15);
/// Capacity of the command channel from handles to the event loop.
pub const COMMAND_BUFFER: usize = 64;

/// Errors of the p2p layer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum P2pError {
    /// The identity file cannot be read, parsed or written.
    #[error("identity file {path}: {detail}")]
    Identity {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// Building the transport failed.
    #[error("cannot build the swarm: {0}")]
    Build(String),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {detail}")]
    Listen {
        /// The address.
        addr: Multiaddr,
        /// Why.
        detail: String,
    },
    /// An initial peer address lacks its `/p2p/<peer id>` suffix.
    #[error("initial peer {0} must end with /p2p/<peer id>")]
    BadInitialPeer(Multiaddr),
    /// None of the initial peers could be reached in time.
    #[error("failed to connect to any initial peer within {0:?}")]
    Bootstrap(Duration),
    /// Dialing failed.
    #[error("cannot dial {addr}: {detail}")]
    Dial {
        /// The address.
        addr: Multiaddr,
        /// Why.
        detail: String,
    },
    /// A record was rejected by the local policy.
    #[error("record rejected: {0}")]
    Rejected(String),
    /// A DHT query failed.
    #[error("dht query failed: {0}")]
    Query(String),
    /// The event loop did not answer in time.
    #[error("the p2p event loop did not answer within {0:?}")]
    Timeout(Duration),
    /// The event loop has shut down.
    #[error("the p2p node has shut down")]
    Shutdown,
    /// A stream protocol name is not valid (it must start with `/`).
    #[error("invalid stream protocol {0:?}")]
    BadProtocol(String),
    /// Inbound streams of this protocol are already being accepted on this node.
    #[error("inbound streams of {0} are already being accepted")]
    AlreadyAccepting(String),
    /// Opening a stream failed: no connection, the peer does not speak the protocol, or the
    /// negotiation failed.
    #[error("cannot open a stream to {peer}: {detail}")]
    OpenStream {
        /// The peer.
        peer: PeerId,
        /// Why (naming the protocol).
        detail: String,
    },
    /// Opening a stream (including dialing the peer) took longer than the timeout.
    #[error("no stream to {peer} within {timeout:?}")]
    OpenStreamTimeout {
        /// The peer.
        peer: PeerId,
        /// The timeout.
        timeout: Duration,
    },
}

/// How stored DHT values are validated and merged; implemented by [`crate::dht`].
pub trait RecordPolicy: Send + 'static {
    /// Validates `incoming` (written by `source`, `None` for local writes) and merges it with
    /// the `existing` stored value. Returns the value to store and its wall-clock expiration
    /// (the latest of its entries), or a reason to reject the write.
    fn merge(
        &self,
        key: &[u8],
        existing: Option<&[u8]>,
        incoming: &[u8],
        source: Option<PeerId>,
        now: SystemTime,
    ) -> Result<(Vec<u8>, SystemTime), String>;
}

/// Configuration of a p2p node.
#[derive(Clone, Debug)]
pub struct P2pConfig {
    /// Addresses to listen on. Default: TCP and QUIC on all interfaces, random ports.
    pub listen: Vec<Multiaddr>,
    /// Peers to join through, each ending with `/p2p/<peer id>`.
    pub initial_peers: Vec<Multiaddr>,
    /// Run Kademlia in client mode (for peers that cannot accept connections).
    pub client_mode: bool,
    /// Bound on a stored record value (Kademlia packets get this plus 64 KiB).
    pub max_record_bytes: usize,
    /// Timeout of DHT queries and of waits on the event loop.
    pub request_timeout: Duration,
    /// Time to reach at least one initial peer before [`P2p::spawn`] fails.
    pub bootstrap_timeout: Duration,
    /// Close connections idle for this long.
    pub idle_connection_timeout: Duration,
}

impl Default for P2pConfig {
    fn default() -> Self {
        Self {
            listen: vec![
                "/ip4/0.0.0.0/tcp/0".parse().expect("valid multiaddr"),
                "/ip4/0.0.0.0/udp/0/quic-v1"
                    .parse()
                    .expect("valid multiaddr"),
            ],
            initial_peers: Vec::new(),
            client_mode: false,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            bootstrap_timeout: DEFAULT_BOOTSTRAP_TIMEOUT,
            idle_connection_timeout: Duration::from_secs(60),
        }
    }
}

impl P2pConfig {
    /// Listening on loopback TCP only (tests, local demos).
    pub fn loopback() -> Self {
        Self {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().expect("valid multiaddr")],
            ..Self::default()
        }
    }
}

/// A cloneable handle to a running p2p node. The node shuts down when the last handle is
/// dropped or [`P2p::shutdown`] is called.
#[derive(Clone)]
pub struct P2p {
    commands: mpsc::Sender<swarm::Command>,
    peer_id: PeerId,
    request_timeout: Duration,
    streams: libp2p_stream::Control,
}

impl std::fmt::Debug for P2p {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2p")
            .field("peer_id", &self.peer_id)
            .field("request_timeout", &self.request_timeout)
            .finish_non_exhaustive()
    }
}

impl P2p {
    /// Starts a node: listens, dials the initial peers, waits until at least one of them is
    /// connected (if any were given), and bootstraps Kademlia. Must be called inside a tokio
    /// runtime. Cancel-safe: dropping the future before it resolves drops the node.
    pub async fn spawn(
        config: P2pConfig,
        keypair: Keypair,
        policy: Box<dyn RecordPolicy>,
    ) -> Result<(Self, tokio::task::JoinHandle<()>), P2pError> {
        let peer_id = keypair.public().to_peer_id();
        let mut initial = Vec::with_capacity(config.initial_peers.len());
        for addr in &config.initial_peers {
            let id = addr
                .iter()
                .find_map(|p| match p {
                    libp2p::multiaddr::Protocol::P2p(id) => Some(id),
                    _ => None,
                })
                .ok_or_else(|| P2pError::BadInitialPeer(addr.clone()))?;
            initial.push((id, addr.clone()));
        }
        let (tx, rx) = mpsc::channel(COMMAND_BUFFER);
        let event_loop = swarm::EventLoop::new(&config, keypair, policy, rx, &initial)?;
        let streams = event_loop.stream_control();
        let task = tokio::spawn(event_loop.run());
        let p2p = Self {
            commands: tx,
            peer_id,
            request_timeout: config.request_timeout,
            streams,
        };
        if !initial.is_empty() {
            let connected = tokio::time::timeout(
                config.bootstrap_timeout,
                p2p.call_untimed(|reply| swarm::Command::WaitConnected { reply }),
            )
            .await;
            match connected {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e)) | Err(e)) => return Err(e),
                Err(_) => return Err(P2pError::Bootstrap(config.bootstrap_timeout)),
            }
            p2p.call(|reply| swarm::Command::Bootstrap { reply })
                .await?;
        }
        Ok((p2p, task))
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The addresses others can dial, each ending with `/p2p/<peer id>` (waits until every
    /// listener has reported its address).
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, P2pError> {
        self.call(|reply| swarm::Command::ListenAddrs { reply })
            .await
    }

    /// Peers with an open connection.
    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, P2pError> {
        self.call(|reply| swarm::Command::ConnectedPeers { reply })
            .await
    }

    /// Merges `value` into the local record under `key` (through the policy) and replicates the
    /// merged record to the closest peers. Returns how many remote peers stored it.
    pub async fn put_record(&self, key: Vec<u8>, value: Vec<u8>) -> Result<usize, P2pError> {
        self.call(|reply| swarm::Command::Put { key, value, reply })
            .await?
    }

    /// Every value found for `key`: the local one first (if any), then each replica's answer.
    pub async fn get_record(&self, key: Vec<u8>) -> Result<Vec<Vec<u8>>, P2pError> {
        self.call(|reply| swarm::Command::Get { key, reply })
            .await?
    }

    /// Tells the node where `peer` can be reached (added to Kademlia's routing table and
    /// announced to every behaviour), so that dials by peer id, as [`P2p::open_stream`] makes,
    /// find it.
    pub async fn add_peer_addresses(
        &self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    ) -> Result<(), P2pError> {
        self.call(|reply| swarm::Command::AddAddresses { peer, addrs, reply })
            .await
    }

    /// Opens an outbound stream for `protocol` to `peer`, dialing the peer first if it is not
    /// connected (by peer id: its addresses must be known, from Kademlia or
    /// [`P2p::add_peer_addresses`]). Dialing, opening and protocol negotiation together run
    /// under `timeout`.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: &str,
        timeout: Duration,
    ) -> Result<P2pStream, P2pError> {
        let proto = stream_protocol(protocol)?;
        let open = async {
            self.call_untimed(|reply| swarm::Command::Connect { peer, reply })
                .await??;
            // Each open uses its own clone: a Control opens one stream at a time.
            let mut control = self.streams.clone();
            control
                .open_stream(peer, proto)
                .await
                .map_err(|e| P2pError::OpenStream {
                    peer,
                    detail: format!("{protocol}: {e}"),
                })
        };
        let stream = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| P2pError::OpenStreamTimeout { peer, timeout })??;
        Ok(P2pStream::new(peer, stream))
    }

    /// Starts accepting inbound streams of `protocol`: peers can open such streams from now on
    /// until the returned [`InboundStreams`] is dropped. At most `queue` accepted streams wait
    /// to be taken; while the queue is full further streams are dropped (their openers see a
    /// reset). Only one acceptor per protocol and node.
    pub fn accept_streams(&self, protocol: &str, queue: usize) -> Result<InboundStreams, P2pError> {
        let proto = stream_protocol(protocol)?;
        let mut control = self.streams.clone();
        let mut incoming = control
            .accept(proto)
            .map_err(|_| P2pError::AlreadyAccepting(protocol.to_owned()))?;
        let (tx, rx) = mpsc::channel(queue.max(1));
        // Drain libp2p-stream's single slot as fast as we can (see the module doc).
        let pump = tokio::spawn(async move {
            while let Some((peer, stream)) = incoming.next().await {
                if tx.send((peer, P2pStream::new(peer, stream))).await.is_err() {
                    break;
                }
            }
        });
        Ok(InboundStreams { rx, pump })
    }

    /// Stops the node: closes listeners and connections, ends the event loop.
    pub async fn shutdown(self) -> Result<(), P2pError> {
        self.call(|reply| swarm::Command::Shutdown { reply }).await
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> swarm::Command,
    ) -> Result<T, P2pError> {
        // Queries have their own Kademlia timeout; leave them room before giving up here.
        let limit = self.request_timeout + Duration::from_secs(5);
        tokio::time::timeout(limit, self.call_untimed(make))
            .await
            .map_err(|_| P2pError::Timeout(limit))?
    }

    async fn call_untimed<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> swarm::Command,
    ) -> Result<T, P2pError> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(make(tx))
            .await
            .map_err(|_| P2pError::Shutdown)?;
        rx.await.map_err(|_| P2pError::Shutdown)
    }
}

fn stream_protocol(protocol: &str) -> Result<libp2p::StreamProtocol, P2pError> {
    libp2p::StreamProtocol::try_from_owned(protocol.to_owned())
        .map_err(|_| P2pError::BadProtocol(protocol.to_owned()))
}

/// Inbound streams of one protocol ([`P2p::accept_streams`]), in arrival order. Dropping it
/// stops accepting: the protocol is no longer offered to peers.
#[derive(Debug)]
pub struct InboundStreams {
    rx: mpsc::Receiver<(PeerId, P2pStream)>,
    pump: tokio::task::JoinHandle<()>,
}

impl InboundStreams {
    /// The next inbound stream and the (authenticated) peer that opened it; `None` once the
    /// node has shut down.
    pub async fn next(&mut self) -> Option<(PeerId, P2pStream)> {
        self.rx.recv().await
    }
}

impl Drop for InboundStreams {
    fn drop(&mut self) {
        self.pump.abort();
    }
}

/// A libp2p stream (a yamux substream on a noise-encrypted connection, or a QUIC stream) as a
/// tokio byte stream. Shutting down the write side closes it for writing; the peer reads end of
/// stream. Drive it from spawned tasks (see `../shared/reference/dataplane.md` §5.4).
pub struct P2pStream {
    inner: Compat<libp2p::Stream>,
    peer: PeerId,
}

impl std::fmt::Debug for P2pStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pStream")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl P2pStream {
    fn new(peer: PeerId, stream: libp2p::Stream) -> Self {
        Self {
            inner: stream.compat(),
            peer,
        }
    }

    /// The peer at the other end (authenticated by the connection's security handshake).
    pub fn peer_id(&self) -> PeerId {
        self.peer
    }
}

impl AsyncRead for P2pStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for P2pStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
