//! TLS 1.3 over TCP with libp2p-tls certificates: identity, verifier, dialer, listener, stream.
//!
//! The protocol is described in the parent module ([`crate::transport`]). Implementation notes:
//!
//! * rustls cannot load a libp2p-tls certificate through `with_single_cert` /
//!   `with_client_auth_cert`: webpki rejects its critical libp2p extension
//!   (`UnsupportedCriticalExtension`). The key therefore goes in through resolvers that always
//!   return it ([`OwnCert`]), as libp2p-tls does internally.
//! * One verifier type ([`PeerVerifier`]) implements both `ServerCertVerifier` and
//!   `ClientCertVerifier` with `libp2p::tls::certificate::parse` (validity period,
//!   self-signature, libp2p extension signature); as a server verifier it additionally pins the
//!   expected PeerId. A mismatch travels out of rustls as a [`PeerMismatch`] inside
//!   `CertificateError::Other` and becomes [`TlsError::UnexpectedPeer`].
//! * In TLS 1.3 the client finishes its handshake before the server has checked the client's
//!   certificate. A server that rejects the client therefore shows up on the client's first
//!   read, not in [`connect`].

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use libp2p::PeerId;
use libp2p::identity::Keypair;
use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::tls13::OkmBlock;
use rustls::crypto::{CryptoProvider, aws_lc_rs};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{NoServerSessionStorage, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, KeyLog, OtherError,
    ServerConfig, SignatureScheme, SupportedCipherSuite,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// ALPN protocol id of the data plane without key updates: what older peers offer and
/// accept. A connection negotiates it or [`ALPN_KEY_UPDATE`]; anything else is refused.
pub const ALPN: &[u8] = b"hivemesh-data/1";

/// ALPN protocol id of the data plane with TLS 1.3 key updates (RFC 8446 §4.6.3): both ends
/// offer it first, so two current peers agree on it and an older one picks [`ALPN`]. Only
/// after agreeing on it does either end send a KeyUpdate (older peers end the stream at any
/// handshake record).
pub const ALPN_KEY_UPDATE: &[u8] = b"hivemesh-data/2";

/// What both ends offer, in order of preference.
fn alpn_protocols() -> Vec<Vec<u8>> {
    vec![ALPN_KEY_UPDATE.to_vec(), ALPN.to_vec()]
}

/// Capacity of a stream's receive buffer (the socket is read into it, records are opened out
/// of it).
pub const READ_BUFFER: usize = 1024 * 1024;

use super::record::{Direction, HandshakeIo, Receiver, Sender, handshake};

/// Errors of the data plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The certificate or the TLS configuration could not be built from the keypair.
    #[error("cannot build the data-plane TLS identity: {0}")]
    Identity(String),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {detail}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        detail: String,
    },
    /// Accepting a TCP connection failed (for example: out of file descriptors). The listener
    /// is still usable.
    #[error("accepting a data connection failed: {0}")]
    Accept(String),
    /// No client connected before the accept deadline.
    #[error("no data connection arrived within {0:?}")]
    AcceptTimeout(Duration),
    /// The TCP connection could not be established.
    #[error("cannot connect to {addr}: {detail}")]
    Connect {
        /// The address.
        addr: SocketAddr,
        /// Why.
        detail: String,
    },
    /// The TCP connection was not established within the timeout.
    #[error("no TCP connection to {addr} within {timeout:?}")]
    ConnectTimeout {
        /// The address.
        addr: SocketAddr,
        /// The timeout.
        timeout: Duration,
    },
    /// The TCP connection was up but the TLS handshake did not finish within the timeout.
    #[error("TLS handshake with {addr} did not finish within {timeout:?}")]
    HandshakeTimeout {
        /// The remote address.
        addr: SocketAddr,
        /// The timeout.
        timeout: Duration,
    },
    /// The TLS handshake failed: not TLS, an invalid or missing certificate, no common cipher
    /// suite or ALPN, an alert from the peer, the connection closed early.
    #[error("TLS handshake with {addr} failed: {detail}")]
    Handshake {
        /// The remote address.
        addr: SocketAddr,
        /// Why.
        detail: String,
    },
    /// The server proved an identity other than the PeerId the client expected.
    #[error("{addr}: {mismatch}")]
    UnexpectedPeer {
        /// The remote address.
        addr: SocketAddr,
        /// Who was expected and who answered (boxed: a PeerId is 80 bytes).
        mismatch: Box<PeerMismatch>,
    },
}

/// The server's certificate proves another PeerId than the one the client dialled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("peer is {actual}, expected {expected}")]
pub struct PeerMismatch {
    /// The PeerId the client asked for.
    pub expected: PeerId,
    /// The PeerId the server's certificate proves.
    pub actual: PeerId,
}

/// The cipher suites offered, in order of preference: AES-128-GCM (about 0.2 CPU·s/GB with
/// AES-NI), then CHACHA20-POLY1305 (about 1 CPU·s/GB, but faster than AES without AES-NI).
fn provider() -> CryptoProvider {
    let mut provider = aws_lc_rs::default_provider();
    provider.cipher_suites = vec![
        aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256,
        aws_lc_rs::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    provider
}

/// One peer's data-plane TLS identity: a libp2p-tls certificate for its keypair and the server
/// configuration built from it. Cheap to clone; build it once per process.
#[derive(Clone)]
pub struct DataIdentity {
    peer_id: PeerId,
    provider: Arc<CryptoProvider>,
    own: Arc<OwnCert>,
    server: Arc<ServerConfig>,
}

impl fmt::Debug for DataIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataIdentity")
            .field("peer_id", &self.peer_id)
            .finish_non_exhaustive()
    }
}

impl DataIdentity {
    /// Generates a fresh certificate (ECDSA P-256, carrying the libp2p extension signed by
    /// `keypair`) and builds the server configuration.
    pub fn new(keypair: &Keypair) -> Result<Self, TlsError> {
        let (cert, key) = libp2p::tls::certificate::generate(keypair)
            .map_err(|e| TlsError::Identity(format!("certificate generation: {e}")))?;
        let provider = Arc::new(provider());
        let signing_key = provider
            .key_provider
            .load_private_key(key)
            .map_err(|e| TlsError::Identity(format!("certificate key: {e}")))?;
        let own = Arc::new(OwnCert(Arc::new(CertifiedKey::new(
            vec![cert],
            signing_key,
        ))));
        let mut server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Identity(format!("server config: {e}")))?
            .with_client_cert_verifier(Arc::new(PeerVerifier { expected: None }))
            .with_cert_resolver(Arc::clone(&own) as Arc<dyn ResolvesServerCert>);
        server.alpn_protocols = alpn_protocols();
        // Our order (AES first), whatever the client prefers.
        server.ignore_client_order = true;
        // Every connection runs a full handshake with both certificates verified.
        server.send_tls13_tickets = 0;
        server.session_storage = Arc::new(NoServerSessionStorage {});
        // The record layer takes over after the handshake (`super::record`).
        server.enable_secret_extraction = true;
        Ok(Self {
            peer_id: keypair.public().to_peer_id(),
            provider,
            own,
            server: Arc::new(server),
        })
    }

    /// The PeerId this identity proves.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The server configuration (client authentication mandatory, any valid libp2p
    /// certificate accepted; the caller checks the PeerId returned by the handshake).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server)
    }

    /// A client configuration that only completes a handshake with `expected`.
    pub fn client_config(&self, expected: PeerId) -> Result<Arc<ClientConfig>, TlsError> {
        let mut client = ClientConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Identity(format!("client config: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier {
                expected: Some(expected),
            }))
            .with_client_cert_resolver(Arc::clone(&self.own) as Arc<dyn ResolvesClientCert>);
        client.alpn_protocols = alpn_protocols();
        client.resumption = rustls::client::Resumption::disabled();
        client.enable_sni = false;
        client.enable_secret_extraction = true;
        Ok(Arc::new(client))
    }
}

/// Dials `addr` and runs the TLS handshake, both under `timeout`. Fails with
/// [`TlsError::UnexpectedPeer`] unless the server proves the identity `expected`.
pub async fn connect(
    identity: &DataIdentity,
    addr: SocketAddr,
    expected: PeerId,
    timeout: Duration,
) -> Result<DataStream, TlsError> {
    let config = identity.client_config(expected)?;
    connect_with(config, addr, expected, timeout).await
}

/// Runs the client side of the TLS handshake, under `timeout`, on a TCP connection that is
/// already up (one made by a simultaneous open, [`super::PunchSocket`]). Fails with
/// [`TlsError::UnexpectedPeer`] unless the server proves the identity `expected`.
pub async fn connect_over(
    identity: &DataIdentity,
    tcp: TcpStream,
    expected: PeerId,
    timeout: Duration,
) -> Result<DataStream, TlsError> {
    let config = identity.client_config(expected)?;
    let addr = tcp.peer_addr().map_err(|e| TlsError::Connect {
        addr: SocketAddr::from(([0, 0, 0, 0], 0)),
        detail: e.to_string(),
    })?;
    let stream = tokio::time::timeout(timeout, async {
        super::socket::tune(&tcp).map_err(|e| TlsError::Connect {
            addr,
            detail: format!("cannot set the socket's options: {e}"),
        })?;
        let server_name = ServerName::IpAddress(addr.ip().into());
        DataStream::establish(tcp, Role::Client(config, server_name), addr).await
    })
    .await
    .map_err(|_| TlsError::HandshakeTimeout { addr, timeout })??;
    if stream.peer_id != expected {
        return Err(TlsError::UnexpectedPeer {
            addr,
            mismatch: Box::new(PeerMismatch {
                expected,
                actual: stream.peer_id,
            }),
        });
    }
    Ok(stream)
}

/// [`connect`] with a given client configuration (tests use it to misbehave).
async fn connect_with(
    config: Arc<ClientConfig>,
    addr: SocketAddr,
    expected: PeerId,
    timeout: Duration,
) -> Result<DataStream, TlsError> {
    let mut connected = false;
    let attempt = tokio::time::timeout(timeout, async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| TlsError::Connect {
                addr,
                detail: e.to_string(),
            })?;
        connected = true;
        super::socket::tune(&tcp).map_err(|e| TlsError::Connect {
            addr,
            detail: format!("cannot set the socket's options: {e}"),
        })?;
        let server_name = ServerName::IpAddress(addr.ip().into());
        DataStream::establish(tcp, Role::Client(config, server_name), addr).await
    })
    .await;
    let stream = match attempt {
        Ok(result) => result?,
        Err(_) if connected => return Err(TlsError::HandshakeTimeout { addr, timeout }),
        Err(_) => return Err(TlsError::ConnectTimeout { addr, timeout }),
    };
    // The verifier already pinned the PeerId; check again on what the connection reports.
    if stream.peer_id != expected {
        return Err(TlsError::UnexpectedPeer {
            addr,
            mismatch: Box::new(PeerMismatch {
                expected,
                actual: stream.peer_id,
            }),
        });
    }
    Ok(stream)
}

/// A TCP listener whose connections are authenticated data streams.
pub struct DataListener {
    listener: TcpListener,
    config: Arc<ServerConfig>,
    local_addr: SocketAddr,
}

impl fmt::Debug for DataListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataListener")
            .field("local_addr", &self.local_addr)
            .finish_non_exhaustive()
    }
}

impl DataListener {
    /// Listens on `addr` (port 0 picks a free port; see [`DataListener::local_addr`]).
    pub async fn bind(identity: &DataIdentity, addr: SocketAddr) -> Result<Self, TlsError> {
        let bind_error = |e: io::Error| TlsError::Bind {
            addr,
            detail: e.to_string(),
        };
        let listener = TcpListener::bind(addr).await.map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        Ok(Self {
            listener,
            config: identity.server_config(),
            local_addr,
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits up to `timeout` for one client, then runs its handshake under `timeout` counted
    /// from its arrival (a client that arrives late still gets the whole time). Returns the
    /// client's authenticated PeerId and the stream; the caller decides whether that peer is
    /// welcome (drop the stream to reject it).
    ///
    /// An error concerns only the connection it names; the next call works as before. Several
    /// tasks may call this concurrently on one listener: each gets its own connection. A server
    /// that must not let one slow client hold up the next uses [`DataListener::accept_tcp`]
    /// and runs each [`Handshake`] in a task of its own.
    pub async fn accept(&self, timeout: Duration) -> Result<(PeerId, DataStream), TlsError> {
        let handshake = tokio::time::timeout(timeout, self.accept_tcp())
            .await
            .map_err(|_| TlsError::AcceptTimeout(timeout))??;
        handshake.run(timeout).await
    }

    /// Waits for one TCP client; its TLS handshake is left to the returned [`Handshake`].
    pub async fn accept_tcp(&self) -> Result<Handshake, TlsError> {
        let (tcp, addr) = self
            .listener
            .accept()
            .await
            .map_err(|e| TlsError::Accept(e.to_string()))?;
        Ok(Handshake {
            tcp,
            addr,
            config: Arc::clone(&self.config),
        })
    }
}

/// An accepted TCP client whose TLS handshake (server side) has not run yet
/// ([`DataListener::accept_tcp`]). Owns everything it needs: it can run in a task of its own.
#[derive(Debug)]
pub struct Handshake {
    tcp: TcpStream,
    addr: SocketAddr,
    config: Arc<rustls::ServerConfig>,
}

impl Handshake {
    /// The server side of a handshake on a TCP connection that no listener accepted (one made
    /// by a simultaneous open, [`super::PunchSocket`]).
    pub fn over(identity: &DataIdentity, tcp: TcpStream) -> Result<Self, TlsError> {
        let addr = tcp
            .peer_addr()
            .map_err(|e| TlsError::Accept(e.to_string()))?;
        Ok(Self {
            tcp,
            addr,
            config: identity.server_config(),
        })
    }

    /// The client's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs the handshake under `timeout`. Returns the client's authenticated PeerId and the
    /// stream.
    pub async fn run(self, timeout: Duration) -> Result<(PeerId, DataStream), TlsError> {
        let Self { tcp, addr, config } = self;
        let attempt = tokio::time::timeout(timeout, async {
            super::socket::tune(&tcp).map_err(|e| TlsError::Handshake {
                addr,
                detail: format!("cannot set the socket's options: {e}"),
            })?;
            DataStream::establish(tcp, Role::Server(config), addr).await
        })
        .await;
        match attempt {
            Ok(result) => result.map(|stream| (stream.peer_id, stream)),
            Err(_) => Err(TlsError::HandshakeTimeout { addr, timeout }),
        }
    }
}

/// An established, authenticated data connection: TLS 1.3 over TCP, its records sealed and
/// opened by our record layer (`record.rs`) after rustls ran the handshake. Use it as any tokio byte
/// stream; `tokio::io::split` gives independent read and write halves. Writes are buffered
/// (up to 1 MiB): flush before waiting for an answer. Shutting down
/// the write side sends TLS `close_notify`, which the peer reads as end of stream; a
/// connection that ends without it reads as an error.
pub struct DataStream {
    tcp: TcpStream,
    rx: Receiver,
    tx: Sender,
    peer_id: PeerId,
    peer_addr: SocketAddr,
    cipher_suite: &'static str,
    key_updates: bool,
}

impl fmt::Debug for DataStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataStream")
            .field("peer_id", &self.peer_id)
            .field("peer_addr", &self.peer_addr)
            .field("cipher_suite", &self.cipher_suite)
            .field("key_updates", &self.key_updates)
            .finish_non_exhaustive()
    }
}

impl DataStream {
    /// Runs the handshake of a fresh rustls connection in `role` over `tcp` and hands the
    /// result to the record layer.
    async fn establish(tcp: TcpStream, role: Role, addr: SocketAddr) -> Result<Self, TlsError> {
        // Each connection gets its own copy of the configuration, whose key log keeps this
        // connection's traffic secrets for key updates.
        let captured = Arc::new(TrafficSecrets::default());
        let conn: Result<rustls::Connection, rustls::Error> = match role {
            Role::Client(config, server_name) => {
                let mut config = ClientConfig::clone(&config);
                config.key_log = Arc::clone(&captured) as Arc<dyn KeyLog>;
                rustls::ClientConnection::new(Arc::new(config), server_name).map(Into::into)
            }
            Role::Server(config) => {
                let mut config = ServerConfig::clone(&config);
                config.key_log = Arc::clone(&captured) as Arc<dyn KeyLog>;
                rustls::ServerConnection::new(Arc::new(config)).map(Into::into)
            }
        };
        let mut conn = conn.map_err(|e| TlsError::Handshake {
            addr,
            detail: e.to_string(),
        })?;
        let mut io = HandshakeIo::new(tcp);
        handshake(&mut conn, &mut io)
            .await
            .map_err(|e| handshake_error(addr, &e))?;
        Self::new(io, conn, addr, &captured)
    }

    /// Checks what the finished handshake negotiated and hands the connection over to the
    /// record layer, with key updates when both ends agreed to them ([`ALPN_KEY_UPDATE`]).
    fn new(
        io: HandshakeIo,
        mut conn: rustls::Connection,
        peer_addr: SocketAddr,
        captured: &TrafficSecrets,
    ) -> Result<Self, TlsError> {
        let refuse = |detail: String| TlsError::Handshake {
            addr: peer_addr,
            detail,
        };
        let key_updates = match conn.alpn_protocol() {
            Some(p) if p == ALPN_KEY_UPDATE => true,
            Some(p) if p == ALPN => false,
            _ => {
                return Err(refuse(format!(
                    "the peer did not negotiate ALPN {:?} or {:?}",
                    String::from_utf8_lossy(ALPN_KEY_UPDATE),
                    String::from_utf8_lossy(ALPN)
                )));
            }
        };
        let cert = match conn.peer_certificates() {
            Some([cert]) => cert,
            _ => return Err(refuse("the peer presented no single certificate".into())),
        };
        let peer_id = libp2p::tls::certificate::parse(cert)
            .map_err(|e| refuse(format!("peer certificate: {e}")))?
            .peer_id();
        let suite = conn.negotiated_cipher_suite();
        let cipher_suite = suite.and_then(|s| s.suite().as_str()).unwrap_or("unknown");
        let Some(SupportedCipherSuite::Tls13(suite)) = suite else {
            return Err(refuse("no TLS 1.3 cipher suite negotiated".into()));
        };
        let is_client = matches!(conn, rustls::Connection::Client(_));
        // rustls must hold nothing the record layer would lose: no application data it
        // already decrypted, no unsent records, no part of a record.
        let state = conn
            .process_new_packets()
            .map_err(|e| refuse(e.to_string()))?;
        if state.plaintext_bytes_to_read() > 0 || conn.wants_write() {
            return Err(refuse("application data during the handshake".into()));
        }
        let (tcp, buf, start, end) = io.into_parts();
        let secrets = conn
            .dangerous_extract_secrets()
            .map_err(|e| refuse(format!("taking over the record layer: {e}")))?;
        let key_error = |e: io::Error| refuse(format!("traffic keys: {e}"));
        let (tx, rx) = if key_updates {
            let (client, server) = captured.take();
            let (Some(client), Some(server)) = (client, server) else {
                return Err(refuse(
                    "rustls did not hand over the traffic secrets".into(),
                ));
            };
            let (ours, theirs) = if is_client {
                (client, server)
            } else {
                (server, client)
            };
            let hkdf = suite.hkdf_provider;
            (
                Direction::with_updates(secrets.tx.0, secrets.tx.1, ours, hkdf)
                    .map_err(key_error)?,
                Direction::with_updates(secrets.rx.0, secrets.rx.1, theirs, hkdf)
                    .map_err(key_error)?,
            )
        } else {
            (
                Direction::new(secrets.tx.0, secrets.tx.1).map_err(key_error)?,
                Direction::new(secrets.rx.0, secrets.rx.1).map_err(key_error)?,
            )
        };
        Ok(Self {
            tcp,
            rx: Receiver::new(rx, buf, start, end, READ_BUFFER),
            tx: Sender::new(tx),
            peer_id,
            peer_addr,
            cipher_suite,
            key_updates,
        })
    }

    /// Bytes of send and receive buffers the stream holds now. An accepted stream holds about
    /// 50 KiB (two records to receive into, one to open a record into) until its first write
    /// and its first bulk read, which grow them to 1 MiB each (the send buffer and
    /// [`READ_BUFFER`]): a peer that completes a handshake and sends only a Hello costs the
    /// node no more.
    pub fn buffer_bytes(&self) -> usize {
        self.rx.buffer_bytes() + self.tx.buffer_bytes()
    }

    /// The authenticated PeerId of the other end.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The other end's socket address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// The negotiated cipher suite, by its IANA name (`TLS13_AES_128_GCM_SHA256` between two
    /// hivemesh peers).
    pub fn cipher_suite(&self) -> &'static str {
        self.cipher_suite
    }

    /// Whether both ends agreed to TLS 1.3 key updates ([`ALPN_KEY_UPDATE`]). Without them
    /// each direction ends with an error after [`SEQUENCE_LIMIT`] records (256 GiB); with
    /// them a direction moves to its next key every [`KEY_UPDATE_AT`] records and never ends.
    ///
    /// [`SEQUENCE_LIMIT`]: super::SEQUENCE_LIMIT
    /// [`KEY_UPDATE_AT`]: super::KEY_UPDATE_AT
    pub fn key_updates_agreed(&self) -> bool {
        self.key_updates
    }

    /// Key updates so far: (sent, received).
    pub fn key_updates(&self) -> (u64, u64) {
        (self.tx.key_updates(), self.rx.key_updates())
    }

    /// Lowers the records one key may protect to `limit` in both directions and the sender's
    /// key update threshold to `update_at` (tests: thousands of records instead of millions).
    #[cfg(test)]
    pub(crate) fn set_record_limits(&mut self, limit: u64, update_at: u64) {
        self.tx.set_limits(limit, update_at);
        self.rx.set_limit(limit);
    }
}

/// Which end of the handshake a [`DataStream`] is, with its configuration.
enum Role {
    Client(Arc<ClientConfig>, ServerName<'static>),
    Server(Arc<ServerConfig>),
}

/// One connection's two application traffic secrets, caught through rustls' key log
/// interface (one instance per connection, in its own copy of the configuration): rustls
/// hands the record layer keys, not secrets, and a key update needs the secret. Kept in
/// `OkmBlock`s, which zero themselves on drop; nothing is logged anywhere.
#[derive(Default)]
struct TrafficSecrets(std::sync::Mutex<(Option<OkmBlock>, Option<OkmBlock>)>);

const CLIENT_TRAFFIC_SECRET: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_TRAFFIC_SECRET: &str = "SERVER_TRAFFIC_SECRET_0";

impl TrafficSecrets {
    /// The client's and the server's secrets, if rustls gave them.
    fn take(&self) -> (Option<OkmBlock>, Option<OkmBlock>) {
        let mut secrets = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (secrets.0.take(), secrets.1.take())
    }
}

impl fmt::Debug for TrafficSecrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TrafficSecrets(..)")
    }
}

impl KeyLog for TrafficSecrets {
    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        if secret.len() > OkmBlock::MAX_LEN {
            return;
        }
        let mut secrets = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match label {
            CLIENT_TRAFFIC_SECRET => secrets.0 = Some(OkmBlock::new(secret)),
            SERVER_TRAFFIC_SECRET => secrets.1 = Some(OkmBlock::new(secret)),
            _ => {}
        }
    }

    fn will_log(&self, label: &str) -> bool {
        matches!(label, CLIENT_TRAFFIC_SECRET | SERVER_TRAFFIC_SECRET)
    }
}

impl AsyncRead for DataStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = this.rx.poll_read(&mut this.tcp, cx, buf);
        if this.rx.take_update_request() {
            // The peer's KeyUpdate asked for ours: it goes before our next application data.
            this.tx.request_key_update();
        }
        polled
    }
}

impl AsyncWrite for DataStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.tx
            .poll_write_vectored(&mut this.tcp, cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.tx.poll_write_vectored(&mut this.tcp, cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.tx.poll_flush(&mut this.tcp, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.tx.poll_shutdown(&mut this.tcp, cx)
    }
}

/// Turns a failed handshake into a [`TlsError`], recognising our PeerId mismatch.
fn handshake_error(addr: SocketAddr, error: &io::Error) -> TlsError {
    let mismatch = error
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .and_then(|e| match e {
            rustls::Error::InvalidCertificate(CertificateError::Other(other)) => {
                other.0.downcast_ref::<PeerMismatch>()
            }
            _ => None,
        });
    match mismatch {
        Some(m) => TlsError::UnexpectedPeer {
            addr,
            mismatch: Box::new(m.clone()),
        },
        None => TlsError::Handshake {
            addr,
            detail: error.to_string(),
        },
    }
}

/// Our certificate and key, handed out for every handshake (both roles).
#[derive(Debug)]
struct OwnCert(Arc<CertifiedKey>);

impl ResolvesServerCert for OwnCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }
}

impl ResolvesClientCert for OwnCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// Verifies libp2p-tls certificates (both roles); as a server verifier, pins `expected`.
#[derive(Debug)]
struct PeerVerifier {
    expected: Option<PeerId>,
}

/// Handshake signature schemes accepted from peers: those libp2p-tls can verify, without RSA
/// (hivemesh certificates are ECDSA P-256).
const VERIFY_SCHEMES: [SignatureScheme; 3] = [
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
];

/// Checks a presented chain: exactly one certificate, a valid libp2p-tls certificate.
fn verified_peer(
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
) -> Result<PeerId, rustls::Error> {
    if !intermediates.is_empty() {
        return Err(rustls::Error::General(
            "a libp2p-tls peer presents exactly one certificate".into(),
        ));
    }
    Ok(libp2p::tls::certificate::parse(end_entity)?.peer_id())
}

fn verify_tls13(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, rustls::Error> {
    libp2p::tls::certificate::parse(cert)?.verify_signature(
        dss.scheme,
        message,
        dss.signature(),
    )?;
    Ok(HandshakeSignatureValid::assertion())
}

fn no_tls12() -> rustls::Error {
    rustls::Error::General("TLS 1.2 is not supported".into())
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let actual = verified_peer(end_entity, intermediates)?;
        if let Some(expected) = self.expected
            && expected != actual
        {
            return Err(rustls::Error::InvalidCertificate(CertificateError::Other(
                OtherError(Arc::new(PeerMismatch { expected, actual })),
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        VERIFY_SCHEMES.to_vec()
    }
}

impl ClientCertVerifier for PeerVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        verified_peer(end_entity, intermediates)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Err(no_tls12())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        VERIFY_SCHEMES.to_vec()
    }
}

#[cfg(test)]
mod tests {
    //! Misbehaving clients built from the module's internals; the well-behaved paths are in
    //! `tests/integration/tls_link.rs`.

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const T: Duration = Duration::from_secs(10);

    fn identity() -> DataIdentity {
        DataIdentity::new(&Keypair::generate_ed25519()).expect("identity")
    }

    async fn listener(identity: &DataIdentity) -> DataListener {
        DataListener::bind(identity, "127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind")
    }

    /// A client configuration like ours, but with `provider`, `alpn` and optionally no
    /// client certificate.
    fn custom_client(
        identity: &DataIdentity,
        expected: PeerId,
        provider: CryptoProvider,
        alpn: Vec<Vec<u8>>,
        with_cert: bool,
    ) -> Arc<ClientConfig> {
        let builder = ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("tls13")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PeerVerifier {
                expected: Some(expected),
            }));
        let mut config = if with_cert {
            builder.with_client_cert_resolver(Arc::clone(&identity.own) as _)
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = alpn;
        config.enable_secret_extraction = true;
        Arc::new(config)
    }

    /// Server and client of one connection attempt, run concurrently.
    async fn attempt(
        server: &DataListener,
        config: Arc<ClientConfig>,
        expected: PeerId,
    ) -> (
        Result<(PeerId, DataStream), TlsError>,
        Result<DataStream, TlsError>,
    ) {
        tokio::join!(
            server.accept(T),
            connect_with(config, server.local_addr(), expected, T)
        )
    }

    /// Fresh identities, our server, and one attempt of a client like ours that offers only
    /// `alpn`, with or without a certificate: the identities and both ends' results.
    async fn attempt_custom(
        alpn: &[u8],
        with_cert: bool,
    ) -> (
        DataIdentity,
        DataIdentity,
        Result<(PeerId, DataStream), TlsError>,
        Result<DataStream, TlsError>,
    ) {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let config = custom_client(
            &client_id,
            server_id.peer_id(),
            provider(),
            vec![alpn.to_vec()],
            with_cert,
        );
        let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
        (server_id, client_id, accepted, client)
    }

    /// Completes a connection as the client saw it: a server that rejected our certificate
    /// only shows up when we read.
    async fn client_fails(client: Result<DataStream, TlsError>) -> bool {
        match client {
            Err(_) => true,
            Ok(mut stream) => {
                let mut byte = [0u8; 1];
                stream.read(&mut byte).await.is_err()
            }
        }
    }

    async fn pair() -> (DataStream, DataStream) {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let config = client_id
            .client_config(server_id.peer_id())
            .expect("config");
        let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
        (accepted.expect("accepted").1, client.expect("connected"))
    }

    #[tokio::test]
    async fn byte_wise_reads_and_small_writes_both_ways() {
        let (mut served, mut client) = pair().await;
        client.write_all(b"hello").await.expect("write");
        client.flush().await.expect("flush");
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(served.read_u8().await.expect("read"));
        }
        assert_eq!(got, b"hello");
        served.write_all(b"ack").await.expect("write");
        served.flush().await.expect("flush");
        let mut ack = [0u8; 3];
        client.read_exact(&mut ack).await.expect("read");
        assert_eq!(&ack, b"ack");
    }

    /// Buffers come after the Hello: an accepted stream holds two records' worth until it is
    /// read in bulk or written to, then its full buffers.
    #[tokio::test]
    async fn buffers_grow_at_the_first_bulk_read_and_write() {
        let (mut served, mut client) = pair().await;
        let small = served.buffer_bytes();
        assert!(small < 64 << 10, "{small} bytes before anything was read");
        client.write_all(&[7u8; 1000]).await.expect("write");
        client.write_all(&vec![9u8; 100_000]).await.expect("write");
        client.flush().await.expect("flush");
        // A Hello-sized read leaves the buffers as they are.
        let mut hello = [0u8; 1000];
        served.read_exact(&mut hello).await.expect("read");
        assert_eq!(hello, [7u8; 1000]);
        assert_eq!(served.buffer_bytes(), small);
        // A bulk read grows the receive buffer, a write takes the send buffer.
        let mut bulk = vec![0u8; 100_000];
        served.read_exact(&mut bulk).await.expect("read");
        assert!(bulk.iter().all(|b| *b == 9));
        let grown = served.buffer_bytes();
        assert!(grown >= READ_BUFFER, "{grown}");
        served.write_all(b"ack").await.expect("write");
        served.flush().await.expect("flush");
        assert!(served.buffer_bytes() >= grown + super::super::record::WRITE_BUFFER);
        let mut ack = [0u8; 3];
        client.read_exact(&mut ack).await.expect("read");
        assert_eq!(&ack, b"ack");
    }

    #[tokio::test]
    async fn an_answer_then_close_reaches_the_client() {
        let (mut served, mut client) = pair().await;
        client.write_all(b"hello").await.expect("write");
        let mut got = [0u8; 5];
        served.read_exact(&mut got).await.expect("read");
        served.write_all(b"no").await.expect("write");
        served.flush().await.expect("flush");
        served.shutdown().await.expect("shutdown");
        drop(served);
        let mut answer = Vec::new();
        tokio::time::timeout(T, client.read_to_end(&mut answer))
            .await
            .expect("no hang")
            .expect("read to end");
        assert_eq!(answer, b"no");
    }

    /// Writes of random sizes (empty ones, flushes and record-spanning ones included) read
    /// back with random buffer sizes, both directions at once: every byte arrives, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn random_writes_and_reads_round_trip() {
        use rand::{RngExt, SeedableRng, rngs::StdRng};
        let (served, client) = pair().await;
        let (mut served_rx, mut served_tx) = tokio::io::split(served);
        let (mut client_rx, mut client_tx) = tokio::io::split(client);
        let stream = |seed: u64| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..300_000u32)
                .map(|_| rng.random::<u8>())
                .collect::<Vec<u8>>()
        };
        async fn send(w: &mut (impl AsyncWriteExt + Unpin), data: &[u8], seed: u64) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut at = 0;
            while at < data.len() {
                let n = rng.random_range(0..40_000usize).min(data.len() - at);
                w.write_all(&data[at..at + n]).await.expect("write");
                if rng.random_bool(0.3) {
                    w.flush().await.expect("flush");
                }
                at += n;
            }
            w.shutdown().await.expect("shutdown");
        }
        async fn receive(r: &mut (impl AsyncReadExt + Unpin), seed: u64) -> Vec<u8> {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut got = Vec::new();
            loop {
                let mut buf = vec![0u8; rng.random_range(1..70_000usize)];
                let n = r.read(&mut buf).await.expect("read");
                if n == 0 {
                    return got;
                }
                got.extend_from_slice(&buf[..n]);
            }
        }
        let (up, down) = (stream(1), stream(2));
        let ((), (), got_up, got_down) = tokio::join!(
            send(&mut client_tx, &up, 3),
            send(&mut served_tx, &down, 4),
            receive(&mut served_rx, 5),
            receive(&mut client_rx, 6),
        );
        assert!(got_up == up, "client to server");
        assert!(got_down == down, "server to client");
    }

    /// A rustls client connection to `addr` that keeps its own record layer (no hand-over):
    /// the connection after the handshake, the socket, and bytes already read past it.
    async fn stock_client(
        config: Arc<ClientConfig>,
        addr: SocketAddr,
    ) -> (rustls::Connection, TcpStream, Vec<u8>) {
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let mut io = HandshakeIo::new(tcp);
        let mut conn: rustls::Connection =
            rustls::ClientConnection::new(config, ServerName::IpAddress(addr.ip().into()))
                .expect("client")
                .into();
        handshake(&mut conn, &mut io).await.expect("handshake");
        let (tcp, buf, start, end) = io.into_parts();
        (conn, tcp, buf[start..end].to_vec())
    }

    /// Sends everything rustls has queued (records, key updates).
    async fn flush_stock(conn: &mut rustls::Connection, tcp: &mut TcpStream) {
        let mut wire = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut wire).expect("records");
        }
        tcp.write_all(&wire).await.expect("send");
    }

    /// Reads through stock rustls (starting with `pending`, bytes already read) until it sees
    /// close_notify; returns the plaintext.
    async fn read_stock(
        conn: &mut rustls::Connection,
        tcp: &mut TcpStream,
        mut pending: Vec<u8>,
    ) -> Vec<u8> {
        use std::io::Read as _;
        let mut got = Vec::new();
        loop {
            let mut rd = &pending[..];
            while !rd.is_empty() {
                conn.read_tls(&mut rd).expect("read_tls");
                let state = conn
                    .process_new_packets()
                    .expect("our records (and key updates) are valid");
                let mut chunk = vec![0u8; state.plaintext_bytes_to_read()];
                conn.reader().read_exact(&mut chunk).expect("plaintext");
                got.extend_from_slice(&chunk);
                if state.peer_has_closed() {
                    return got;
                }
            }
            pending.resize(64 << 10, 0);
            let n = tcp.read(&mut pending).await.expect("read");
            assert!(n > 0, "closed before close_notify");
            pending.truncate(n);
        }
    }

    /// A stock rustls client (no record-layer hand-over) and our server: our records are
    /// standard TLS 1.3 records both ways, close_notify included.
    #[tokio::test]
    async fn records_interoperate_with_rustls() {
        use std::io::Write as _;
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let config = client_id
            .client_config(server_id.peer_id())
            .expect("config");
        let addr = server.local_addr();
        let client = async {
            let (mut conn, mut tcp, pending) = stock_client(config, addr).await;
            let up: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
            conn.set_buffer_limit(None);
            conn.writer().write_all(&up).expect("plaintext");
            flush_stock(&mut conn, &mut tcp).await;
            read_stock(&mut conn, &mut tcp, pending).await
        };
        let serve = async {
            let (_, mut stream) = server.accept(T).await.expect("accepted");
            let mut got = vec![0u8; 100_000];
            stream.read_exact(&mut got).await.expect("rustls records");
            assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
            stream.write_all(&vec![7u8; 50_000]).await.expect("write");
            stream.shutdown().await.expect("close_notify");
            stream
        };
        let (got, _stream) = tokio::time::timeout(T, async { tokio::join!(client, serve) })
            .await
            .expect("both ends finish");
        assert_eq!(got, vec![7u8; 50_000]);
    }

    /// Hostile bytes after a valid handshake, through a rustls client that then misbehaves on
    /// the raw socket: a flipped ciphertext bit, a replayed record, an oversized length, a
    /// truncated stream. Each is a read error on our side, never a panic or a hang.
    #[tokio::test]
    async fn tampered_records_are_errors() {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let addr = server.local_addr();
        let record = |conn: &mut rustls::Connection, data: &[u8]| {
            use std::io::Write as _;
            conn.writer().write_all(data).expect("plaintext");
            let mut wire = Vec::new();
            conn.write_tls(&mut wire).expect("record");
            wire
        };
        type Tamper = fn(Vec<u8>, Vec<u8>) -> Vec<u8>;
        let cases: [(&str, Tamper); 4] = [
            ("flipped bit", |mut a, _| {
                let last = a.len() - 20;
                a[last] ^= 1;
                a
            }),
            ("replayed record", |a, _| [a.clone(), a].concat()),
            ("oversized length", |_, _| vec![23, 3, 3, 0xff, 0xff]),
            ("reordered records", |a, b| [b, a].concat()),
        ];
        for (name, tamper) in cases {
            let config = client_id
                .client_config(server_id.peer_id())
                .expect("config");
            let client = async {
                let (mut conn, mut tcp, _) = stock_client(config, addr).await;
                let (a, b) = (record(&mut conn, b"first"), record(&mut conn, b"second"));
                tcp.write_all(&tamper(a, b)).await.expect("send");
                tcp
            };
            let serve = async {
                let (_, mut stream) = server.accept(T).await.expect("accepted");
                let mut got = Vec::new();
                let result = tokio::time::timeout(T, stream.read_to_end(&mut got)).await;
                // The error sticks: a later read reports it again, without touching the socket.
                let again = tokio::time::timeout(T, stream.read(&mut [0u8; 16])).await;
                (result.expect("no hang"), again.expect("no hang"))
            };
            let (tcp, (result, again)) = tokio::join!(client, serve);
            drop(tcp);
            let (Err(first), Err(second)) = (&result, &again) else {
                panic!("{name}: {result:?}, then {again:?}");
            };
            assert_eq!(
                (first.kind(), first.to_string()),
                (second.kind(), second.to_string()),
                "{name}"
            );
        }
        // A truncated stream: the client's socket closes without close_notify.
        let config = client_id
            .client_config(server_id.peer_id())
            .expect("config");
        let (accepted, client) = tokio::join!(server.accept(T), async {
            let mut stream = connect_with(config, addr, server_id.peer_id(), T)
                .await
                .expect("connect");
            stream.write_all(b"partial").await.expect("write");
            stream.flush().await.expect("flush");
            stream.tcp.shutdown().await.expect("tcp shutdown");
            stream
        });
        let (_, mut served) = accepted.expect("accepted");
        let mut got = Vec::new();
        let err = tokio::time::timeout(T, served.read_to_end(&mut got))
            .await
            .expect("no hang")
            .expect_err("truncation");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(got, b"partial");
        drop(client);
    }

    /// `len` bytes of a pattern that differs with `seed`.
    fn pattern(seed: u32, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(7).wrapping_add(seed) % 251) as u8)
            .collect()
    }

    /// Two current peers agree to key updates; with a key good for 64 records and an update
    /// every 16, 2 MiB each way at once (over 128 records per direction) goes through intact
    /// with several updates in each direction, each followed by the other end.
    #[tokio::test]
    async fn lasting_links_update_keys_in_both_directions() {
        let (mut served, mut client) = pair().await;
        assert!(served.key_updates_agreed() && client.key_updates_agreed());
        served.set_record_limits(64, 16);
        client.set_record_limits(64, 16);
        let (up, down) = (pattern(1, 2 << 20), pattern(2, 2 << 20));
        let (mut served_rx, mut served_tx) = tokio::io::split(served);
        let (mut client_rx, mut client_tx) = tokio::io::split(client);
        let mut got_up = vec![0u8; up.len()];
        let mut got_down = vec![0u8; down.len()];
        let (sent_up, sent_down, read_up, read_down) = tokio::time::timeout(T, async {
            tokio::join!(
                async {
                    client_tx.write_all(&up).await?;
                    client_tx.flush().await
                },
                async {
                    served_tx.write_all(&down).await?;
                    served_tx.flush().await
                },
                served_rx.read_exact(&mut got_up),
                client_rx.read_exact(&mut got_down),
            )
        })
        .await
        .expect("no hang");
        sent_up.expect("client writes");
        sent_down.expect("server writes");
        read_up.expect("server reads");
        read_down.expect("client reads");
        assert!(got_up == up, "client to server");
        assert!(got_down == down, "server to client");
        let (served, client) = (served_rx.unsplit(served_tx), client_rx.unsplit(client_tx));
        let (client_sent, client_got) = client.key_updates();
        let (served_sent, served_got) = served.key_updates();
        // 128 full records at 16 per key: 7 or 8 updates.
        assert!(client_sent >= 7, "client sent {client_sent} key updates");
        assert!(served_sent >= 7, "server sent {served_sent} key updates");
        assert_eq!(served_got, client_sent);
        assert_eq!(client_got, served_sent);
    }

    /// A peer that offers only `hivemesh-data/1` (an older one, on either side) gets no key
    /// update: the other end, past its update threshold, sends none (the older end would
    /// refuse it: our receiver without agreement does), and stops at the limit with an error
    /// that says why.
    #[tokio::test]
    async fn an_older_peer_never_receives_a_key_update() {
        let (server_id, client_id, accepted, client) = attempt_custom(ALPN, true).await;
        let (_, mut served) = accepted.expect("accepted");
        let mut client = client.expect("connected");
        assert!(!served.key_updates_agreed() && !client.key_updates_agreed());
        served.set_record_limits(64, 16);
        // 48 records' worth (a few more records where the send buffer's tail cuts one short):
        // past the threshold, within the limit.
        let data = pattern(3, 48 * 16384);
        let mut got = vec![0u8; data.len()];
        let (sent, read) = tokio::time::timeout(T, async {
            tokio::join!(
                async {
                    served.write_all(&data).await?;
                    served.flush().await
                },
                client.read_exact(&mut got)
            )
        })
        .await
        .expect("no hang");
        sent.expect("write");
        read.expect("no key update reached the older peer");
        assert!(got == data);
        assert_eq!(served.key_updates(), (0, 0));
        // Past 64 records the direction ends, and says why.
        let err = tokio::time::timeout(T, served.write_all(&data))
            .await
            .expect("no hang")
            .expect_err("the sequence limit");
        assert_eq!(
            err.get_ref()
                .and_then(|e| e.downcast_ref::<super::super::KeyUpdateError>()),
            Some(&super::super::KeyUpdateError::LimitReached { agreed: false }),
            "{err}"
        );
        assert!(
            err.to_string().contains("does not support key updates"),
            "{err}"
        );

        // An older server: a current client falls back to `hivemesh-data/1`.
        let mut old_config = ServerConfig::clone(&server_id.server_config());
        old_config.alpn_protocols = vec![ALPN.to_vec()];
        let tcp_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = tcp_listener.local_addr().expect("addr");
        let config = client_id
            .client_config(server_id.peer_id())
            .expect("config");
        let (accepted, client) = tokio::join!(
            async {
                let (tcp, addr) = tcp_listener.accept().await.expect("accept");
                Handshake {
                    tcp,
                    addr,
                    config: Arc::new(old_config),
                }
                .run(T)
                .await
            },
            connect_with(config, addr, server_id.peer_id(), T)
        );
        assert!(!accepted.expect("accepted").1.key_updates_agreed());
        assert!(!client.expect("connected").key_updates_agreed());
    }

    /// A stock rustls client (its own record layer) and our server agree to key updates;
    /// rustls' `refresh_traffic_keys` (a KeyUpdate asking for ours) is followed and answered,
    /// and rustls follows every KeyUpdate our server sends at its (lowered) threshold.
    #[tokio::test]
    async fn key_updates_interoperate_with_rustls() {
        use std::io::Write as _;
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let config = client_id
            .client_config(server_id.peer_id())
            .expect("config");
        let addr = server.local_addr();
        let (up, down) = (pattern(4, 100_000), pattern(5, 2 << 20));
        let client = async {
            let (mut conn, mut tcp, pending) = stock_client(config, addr).await;
            assert_eq!(conn.alpn_protocol(), Some(ALPN_KEY_UPDATE));
            conn.set_buffer_limit(None);
            conn.writer().write_all(&up[..50_000]).expect("plaintext");
            conn.refresh_traffic_keys().expect("key update");
            conn.writer().write_all(&up[50_000..]).expect("plaintext");
            flush_stock(&mut conn, &mut tcp).await;
            read_stock(&mut conn, &mut tcp, pending).await
        };
        let serve = async {
            let (_, mut stream) = server.accept(T).await.expect("accepted");
            assert!(stream.key_updates_agreed());
            stream.set_record_limits(64, 16);
            let mut got = vec![0u8; up.len()];
            stream.read_exact(&mut got).await.expect("rustls records");
            assert!(got == up, "rustls' records across its key update");
            stream.write_all(&down).await.expect("write");
            stream.shutdown().await.expect("close_notify");
            stream
        };
        let (got, stream) = tokio::time::timeout(T, async { tokio::join!(client, serve) })
            .await
            .expect("both ends finish");
        assert!(got == down, "our records across our key updates");
        let (sent, received) = stream.key_updates();
        assert_eq!(received, 1);
        // The answer to rustls' request, then one per 16 of 128 records.
        assert!(sent >= 8, "{sent} key updates sent");
    }

    #[test]
    fn a_direction_stops_at_the_sequence_limit() {
        let secrets = || rustls::ConnectionTrafficSecrets::Chacha20Poly1305 {
            key: rustls::crypto::cipher::AeadKey::from([7u8; 32]),
            iv: rustls::crypto::cipher::Iv::from([1u8; 12]),
        };
        assert!(Direction::new(super::super::record::SEQUENCE_LIMIT, secrets()).is_err());
        let mut dir =
            Direction::new(super::super::record::SEQUENCE_LIMIT - 1, secrets()).expect("key");
        assert!(dir.next_nonce().is_ok());
        assert!(dir.next_nonce().is_err());
    }

    #[tokio::test]
    async fn client_without_certificate_is_refused() {
        let (_, _, accepted, client) = attempt_custom(ALPN, false).await;
        assert!(
            matches!(accepted, Err(TlsError::Handshake { .. })),
            "{accepted:?}"
        );
        assert!(client_fails(client).await);
    }

    #[tokio::test]
    async fn other_alpn_is_refused() {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        for alpn in [vec![b"libp2p".to_vec()], vec![]] {
            let config = custom_client(
                &client_id,
                server_id.peer_id(),
                provider(),
                alpn.clone(),
                true,
            );
            let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
            assert!(
                matches!(accepted, Err(TlsError::Handshake { .. })),
                "alpn {alpn:?}: {accepted:?}"
            );
            assert!(
                matches!(client, Err(TlsError::Handshake { .. })),
                "alpn {alpn:?}: {client:?}"
            );
        }
        // The listener still serves a proper client.
        let (accepted, client) = attempt(
            &server,
            client_id
                .client_config(server_id.peer_id())
                .expect("config"),
            server_id.peer_id(),
        )
        .await;
        assert_eq!(accepted.expect("accepted").0, client_id.peer_id());
        assert_eq!(client.expect("connected").peer_id(), server_id.peer_id());
    }

    #[tokio::test]
    async fn chacha_only_client_gets_the_fallback_suite() {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let mut chacha = aws_lc_rs::default_provider();
        chacha.cipher_suites = vec![aws_lc_rs::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256];
        let config = custom_client(
            &client_id,
            server_id.peer_id(),
            chacha,
            vec![ALPN.to_vec()],
            true,
        );
        let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
        let (_, mut served) = accepted.expect("accepted");
        let mut client = client.expect("connected");
        assert_eq!(served.cipher_suite(), "TLS13_CHACHA20_POLY1305_SHA256");
        assert_eq!(client.cipher_suite(), "TLS13_CHACHA20_POLY1305_SHA256");
        client.write_all(b"ping").await.expect("write");
        client.shutdown().await.expect("shutdown");
        let mut got = Vec::new();
        tokio::time::timeout(T, served.read_to_end(&mut got))
            .await
            .expect("no hang")
            .expect("read");
        assert_eq!(got, b"ping");
    }

    #[tokio::test]
    async fn client_with_aes_256_only_finds_no_common_suite() {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let mut aes256 = aws_lc_rs::default_provider();
        aes256.cipher_suites = vec![aws_lc_rs::cipher_suite::TLS13_AES_256_GCM_SHA384];
        let config = custom_client(
            &client_id,
            server_id.peer_id(),
            aes256,
            vec![ALPN.to_vec()],
            true,
        );
        let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
        assert!(
            matches!(accepted, Err(TlsError::Handshake { .. })),
            "{accepted:?}"
        );
        assert!(
            matches!(client, Err(TlsError::Handshake { .. })),
            "{client:?}"
        );
    }
}
