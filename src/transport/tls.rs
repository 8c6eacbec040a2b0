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
use rustls::crypto::{CryptoProvider, aws_lc_rs};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{NoServerSessionStorage, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, OtherError,
    ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, BufReader, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// ALPN protocol id of the data plane; both sides require it.
pub const ALPN: &[u8] = b"hivemesh-data/1";

/// Capacity of the read buffer under TLS (one per stream).
pub const READ_BUFFER: usize = 256 * 1024;

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
        server.alpn_protocols = vec![ALPN.to_vec()];
        // Our order (AES first), whatever the client prefers.
        server.ignore_client_order = true;
        // Every connection runs a full handshake with both certificates verified.
        server.send_tls13_tickets = 0;
        server.session_storage = Arc::new(NoServerSessionStorage {});
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
        client.alpn_protocols = vec![ALPN.to_vec()];
        client.resumption = rustls::client::Resumption::disabled();
        client.enable_sni = false;
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
        tcp.set_nodelay(true).map_err(|e| TlsError::Connect {
            addr,
            detail: format!("cannot set TCP_NODELAY: {e}"),
        })?;
        let io = BufReader::with_capacity(READ_BUFFER, tcp);
        let server_name = ServerName::IpAddress(addr.ip().into());
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(server_name, io)
            .await
            .map_err(|e| handshake_error(addr, &e))?;
        DataStream::new(tls.into(), addr)
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
    acceptor: tokio_rustls::TlsAcceptor,
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
            acceptor: tokio_rustls::TlsAcceptor::from(identity.server_config()),
            local_addr,
        })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits for one client and runs its handshake, both under `timeout` (one deadline).
    /// Returns the client's authenticated PeerId and the stream; the caller decides whether
    /// that peer is welcome (drop the stream to reject it).
    ///
    /// An error concerns only the connection it names; the next call works as before. Several
    /// tasks may call this concurrently on one listener: each gets its own connection.
    pub async fn accept(&self, timeout: Duration) -> Result<(PeerId, DataStream), TlsError> {
        let mut remote = None;
        let attempt = tokio::time::timeout(timeout, async {
            let (tcp, addr) = self
                .listener
                .accept()
                .await
                .map_err(|e| TlsError::Accept(e.to_string()))?;
            remote = Some(addr);
            tcp.set_nodelay(true).map_err(|e| TlsError::Handshake {
                addr,
                detail: format!("cannot set TCP_NODELAY: {e}"),
            })?;
            let io = BufReader::with_capacity(READ_BUFFER, tcp);
            let tls = self
                .acceptor
                .accept(io)
                .await
                .map_err(|e| handshake_error(addr, &e))?;
            DataStream::new(tls.into(), addr)
        })
        .await;
        match attempt {
            Ok(result) => result.map(|stream| (stream.peer_id, stream)),
            Err(_) => Err(match remote {
                Some(addr) => TlsError::HandshakeTimeout { addr, timeout },
                None => TlsError::AcceptTimeout(timeout),
            }),
        }
    }
}

/// An established, authenticated data connection: TLS 1.3 over TCP, reads buffered
/// ([`READ_BUFFER`]). Use it as any tokio byte stream; `tokio::io::split` gives independent
/// read and write halves. Shutting down the write side sends TLS `close_notify`, which the
/// peer reads as end of stream.
pub struct DataStream {
    inner: tokio_rustls::TlsStream<BufReader<TcpStream>>,
    peer_id: PeerId,
    peer_addr: SocketAddr,
    cipher_suite: &'static str,
}

impl fmt::Debug for DataStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataStream")
            .field("peer_id", &self.peer_id)
            .field("peer_addr", &self.peer_addr)
            .field("cipher_suite", &self.cipher_suite)
            .finish_non_exhaustive()
    }
}

impl DataStream {
    /// Checks what the finished handshake negotiated and wraps the stream.
    fn new(
        inner: tokio_rustls::TlsStream<BufReader<TcpStream>>,
        peer_addr: SocketAddr,
    ) -> Result<Self, TlsError> {
        let refuse = |detail: String| TlsError::Handshake {
            addr: peer_addr,
            detail,
        };
        let (_, conn) = inner.get_ref();
        if conn.alpn_protocol() != Some(ALPN) {
            return Err(refuse(format!(
                "the peer did not negotiate ALPN {:?}",
                String::from_utf8_lossy(ALPN)
            )));
        }
        let cert = match conn.peer_certificates() {
            Some([cert]) => cert,
            _ => return Err(refuse("the peer presented no single certificate".into())),
        };
        let peer_id = libp2p::tls::certificate::parse(cert)
            .map_err(|e| refuse(format!("peer certificate: {e}")))?
            .peer_id();
        let cipher_suite = conn
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str())
            .unwrap_or("unknown");
        Ok(Self {
            inner,
            peer_id,
            peer_addr,
            cipher_suite,
        })
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
}

impl AsyncRead for DataStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for DataStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
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
    //! `tests/tls_link.rs`.

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

    #[tokio::test]
    async fn client_without_certificate_is_refused() {
        let (server_id, client_id) = (identity(), identity());
        let server = listener(&server_id).await;
        let config = custom_client(
            &client_id,
            server_id.peer_id(),
            provider(),
            vec![ALPN.to_vec()],
            false,
        );
        let (accepted, client) = attempt(&server, config, server_id.peer_id()).await;
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
        served.read_to_end(&mut got).await.expect("read");
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
