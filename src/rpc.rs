//! Remote procedure calls between nodes: a node serves named methods
//! ([`Rpc::serve`], `Node::serve`) and calls them on other peers ([`Rpc::call`], `Node::call`).
//!
//! # Protocol (`/hivemesh/rpc/1`)
//!
//! One libp2p stream per call (yamux or QUIC multiplex them over the peers' connection):
//!
//! 1. The caller writes one length-delimited `Request { method, payload, timeout_ms }`
//!    (`proto/hivemesh/rpc.proto`).
//! 2. The server, once it has taken the stream (a slot is free, see below), writes one marker
//!    byte ([`TAKEN`]); then it reads the request, runs the handler under the caller's timeout
//!    (capped by [`RpcConfig::max_handler_time`]) and writes one length-delimited `Response`:
//!    the handler's bytes, or an error with a code (unknown method, handler error, too large,
//!    busy, bad request, timeout: the handler ran past the caller's timeout and was dropped).
//!    Then it closes the stream.
//!
//! The marker makes retries safe: libp2p-stream may drop an inbound stream that arrives while
//! its queue is full, before any server code saw it. A stream that ends before the marker was
//! never taken, so the handler never ran, and the caller opens another (up to
//! [`OPEN_ATTEMPTS`], within the call's timeout). A stream that ends after the marker but
//! before the answer is [`RpcError::PeerGone`]: the handler may have run.
//!
//! # Bounds
//!
//! Everything a remote peer sends is bounded: the request's size ([`RpcConfig::max_request_bytes`],
//! checked from its length prefix before anything is buffered), what is read of a request for a
//! method the server does not serve (its length prefix and method name, which comes first in
//! every request: the server answers `UNKNOWN_METHOD` before reading, or allocating for, the
//! payload, issue 29, item 8), the time to send it
//! ([`RpcConfig::read_timeout`]), and the calls held at once: [`RpcConfig::max_inbound`] in
//! all, [`RpcConfig::max_inbound_per_peer`] per peer (a `crate::shares` pool), so one peer
//! flooding a node with calls leaves the rest of the slots to others. A call over either bound
//! is answered `BUSY` (from a small pool of its own; past that the stream is dropped). The
//! caller bounds the answer ([`RpcConfig::max_response_bytes`]) and the whole call (its
//! `timeout`). Handlers run as tokio tasks owned by the server: [`Rpc::shutdown`] and dropping
//! the last handle abort them.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt as _;
use futures::future::BoxFuture;
use libp2p::PeerId;
use prost::Message as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::p2p::{InboundStreams, P2p, P2pError, P2pStream};
use crate::shares::Shares;
use crate::wire::{DelimitedError, read_delimited};

/// Generated prost types (network boundary only).
#[allow(missing_docs, clippy::all)]
mod proto {
    include!(concat!(env!("OUT_DIR"), "/hivemesh.rpc.v1.rs"));
}

/// The protocol of RPC streams.
pub const RPC_PROTOCOL: &str = "/hivemesh/rpc/1";
/// The byte a server writes once it has taken a stream.
pub const TAKEN: u8 = 0x52;
/// Streams a call opens at most when streams end before the server took them.
pub const OPEN_ATTEMPTS: usize = 5;
/// Longest method name (bytes).
pub const MAX_METHOD_BYTES: usize = 128;
/// Longest error message a server sends (bytes; longer ones are cut).
const MAX_ERROR_MESSAGE_BYTES: usize = 1024;
/// `BUSY` answers being written at once; streams past that are dropped.
const MAX_BUSY_ANSWERS: usize = 16;
/// How long writing an answer may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Limits of a node's RPC server and calls.
#[derive(Clone, Debug)]
pub struct RpcConfig {
    /// Largest request (method, payload and framing) a server takes and a caller sends.
    pub max_request_bytes: usize,
    /// Largest response a caller takes and a server sends.
    pub max_response_bytes: usize,
    /// Calls a server runs at once, from all peers.
    pub max_inbound: usize,
    /// Calls a server runs at once for one peer.
    pub max_inbound_per_peer: usize,
    /// How long a caller has to send its request once the server took the stream.
    pub read_timeout: Duration,
    /// Longest a handler runs, whatever timeout the caller asked for.
    pub max_handler_time: Duration,
    /// Accepted streams waiting for the server loop.
    pub stream_queue: usize,
}

impl Default for RpcConfig {
    fn default() -> Self {
        Self {
            max_request_bytes: 16 << 20,
            max_response_bytes: 16 << 20,
            max_inbound: 64,
            max_inbound_per_peer: 8,
            read_timeout: Duration::from_secs(10),
            max_handler_time: Duration::from_secs(300),
            stream_queue: 64,
        }
    }
}

/// Why a call failed, or a method could not be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// No answer within the call's timeout.
    #[error("{method} on {peer}: no answer within {timeout:?}")]
    Timeout {
        /// The method.
        method: Box<str>,
        /// The peer.
        peer: PeerId,
        /// The call's timeout.
        timeout: Duration,
    },
    /// The peer serves no such method.
    #[error("{peer} serves no method {method:?}")]
    UnknownMethod {
        /// The method.
        method: Box<str>,
        /// The peer.
        peer: PeerId,
    },
    /// The peer could not be reached, or the stream ended before the answer (the handler
    /// may have run).
    #[error("{peer} is gone: {detail}")]
    PeerGone {
        /// The peer.
        peer: PeerId,
        /// What failed.
        detail: String,
    },
    /// A request or response over its limit.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    Oversized {
        /// `"request"` or `"response"`.
        what: &'static str,
        /// Its size (for a response, as announced).
        len: u64,
        /// The limit (ours, or for a request the server's when it refused it).
        max: usize,
    },
    /// The peer holds as many calls (from us, or in all) as it takes.
    #[error("{peer} is busy with other calls")]
    Busy {
        /// The peer.
        peer: PeerId,
    },
    /// The handler returned an error.
    #[error("{method} on {peer} failed: {message}")]
    Handler {
        /// The method.
        method: Box<str>,
        /// The peer.
        peer: PeerId,
        /// The handler's message.
        message: String,
    },
    /// The peer answered something that is not a valid answer.
    #[error("{peer} broke the protocol: {detail}")]
    Protocol {
        /// The peer.
        peer: PeerId,
        /// What was wrong.
        detail: String,
    },
    /// The method name is empty or longer than [`MAX_METHOD_BYTES`].
    #[error("method name must be 1..={MAX_METHOD_BYTES} bytes, not {0}")]
    BadMethodName(usize),
    /// [`Rpc::serve`] for a name already served.
    #[error("method {0:?} is already served")]
    AlreadyServed(String),
    /// The RPC server could not start.
    #[error(transparent)]
    P2p(#[from] P2pError),
}

/// What a handler returns: the answer's bytes, or an error message for the caller.
pub type HandlerResult = Result<Bytes, String>;

type Handler = Arc<dyn Fn(PeerId, Bytes) -> BoxFuture<'static, HandlerResult> + Send + Sync>;

/// A node's RPC endpoint (see the module docs). Cheap to clone; the server stops when
/// [`Rpc::shutdown`] is called or the last clone is dropped.
#[derive(Clone)]
pub struct Rpc {
    shared: Arc<Shared>,
    server: Arc<ServerTask>,
}

struct Shared {
    p2p: P2p,
    config: RpcConfig,
    handlers: RwLock<HashMap<String, Handler>>,
}

/// The server loop's task, aborted with the last handle.
struct ServerTask(Mutex<Option<tokio::task::JoinHandle<()>>>);

impl Drop for ServerTask {
    fn drop(&mut self) {
        if let Some(task) = self.0.lock().unwrap_or_else(PoisonError::into_inner).take() {
            task.abort();
        }
    }
}

impl std::fmt::Debug for Rpc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rpc")
            .field("methods", &self.methods())
            .finish_non_exhaustive()
    }
}

impl Rpc {
    /// Starts serving `/hivemesh/rpc/1` on `p2p` (with no methods yet).
    pub fn start(p2p: P2p, config: RpcConfig) -> Result<Self, RpcError> {
        let streams = p2p.accept_streams(RPC_PROTOCOL, config.stream_queue)?;
        let shared = Arc::new(Shared {
            p2p,
            config,
            handlers: RwLock::new(HashMap::new()),
        });
        let task = tokio::spawn(serve_streams(Arc::clone(&shared), streams));
        Ok(Self {
            shared,
            server: Arc::new(ServerTask(Mutex::new(Some(task)))),
        })
    }

    /// Serves `method`: every call runs `handler(caller, payload)` as a task of its own and
    /// answers with what it returns (an `Err` reaches the caller as [`RpcError::Handler`]; a
    /// panic as a handler error too).
    pub fn serve<F, Fut>(&self, method: &str, handler: F) -> Result<(), RpcError>
    where
        F: Fn(PeerId, Bytes) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        check_method(method)?;
        let mut handlers = self
            .shared
            .handlers
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if handlers.contains_key(method) {
            return Err(RpcError::AlreadyServed(method.to_owned()));
        }
        let handler: Handler = Arc::new(move |peer, payload| handler(peer, payload).boxed());
        handlers.insert(method.to_owned(), handler);
        Ok(())
    }

    /// Stops serving `method` (calls already running finish). Whether it was served.
    pub fn unserve(&self, method: &str) -> bool {
        self.shared
            .handlers
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(method)
            .is_some()
    }

    /// The methods served, sorted.
    pub fn methods(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .shared
            .handlers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Calls `method` on `peer` with `payload`; the whole call (dialing included) runs under
    /// `timeout`. The peer's addresses must be known (a connection, Kademlia, or
    /// [`P2p::add_peer_addresses`]).
    pub async fn call(
        &self,
        peer: PeerId,
        method: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Bytes, RpcError> {
        check_method(method)?;
        let config = &self.shared.config;
        let request = request(method, payload, timeout);
        let len = request.encoded_len();
        if len > config.max_request_bytes {
            return Err(RpcError::Oversized {
                what: "request",
                len: len as u64,
                max: config.max_request_bytes,
            });
        }
        let body = request.encode_length_delimited_to_vec();
        let deadline = deadline_after(timeout);
        let timed_out = || RpcError::Timeout {
            method: method.into(),
            peer,
            timeout,
        };
        let mut last = None;
        for attempt in 0..OPEN_ATTEMPTS {
            if attempt > 0 {
                // A stream dropped before the server took it: a moment for the queue to drain.
                let pause = Duration::from_millis(10 << attempt.min(5));
                if tokio::time::timeout_at(deadline, tokio::time::sleep(pause))
                    .await
                    .is_err()
                {
                    return Err(timed_out());
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = match self.shared.p2p.open_stream(peer, RPC_PROTOCOL, left).await {
                Ok(s) => s,
                Err(P2pError::OpenStreamTimeout { .. }) => return Err(timed_out()),
                Err(e) => {
                    return Err(RpcError::PeerGone {
                        peer,
                        detail: e.to_string(),
                    });
                }
            };
            let exchange = exchange(stream, &body, config.max_response_bytes);
            match tokio::time::timeout_at(deadline, exchange).await {
                Err(_) => return Err(timed_out()),
                Ok(Err(Exchange::NotTaken(detail))) => last = Some(detail),
                Ok(Err(Exchange::Failed(detail))) => {
                    return Err(RpcError::PeerGone { peer, detail });
                }
                Ok(Err(Exchange::TooLarge { len, max })) => {
                    return Err(RpcError::Oversized {
                        what: "response",
                        len,
                        max,
                    });
                }
                Ok(Err(Exchange::Malformed(detail))) => {
                    return Err(RpcError::Protocol { peer, detail });
                }
                Ok(Ok(response)) => return answer(response, peer, method, timeout),
            }
        }
        Err(RpcError::PeerGone {
            peer,
            detail: format!(
                "{OPEN_ATTEMPTS} streams ended before the peer took them (last: {})",
                last.unwrap_or_default()
            ),
        })
    }

    /// Stops the server (aborting handlers that still run) and waits for it.
    pub async fn shutdown(self) {
        let task = self
            .server
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }
}

fn check_method(method: &str) -> Result<(), RpcError> {
    if method.is_empty() || method.len() > MAX_METHOD_BYTES {
        return Err(RpcError::BadMethodName(method.len()));
    }
    Ok(())
}

/// How one stream's exchange failed.
enum Exchange {
    /// The stream ended before the server's marker: the server never saw it.
    NotTaken(String),
    /// The stream failed after the marker.
    Failed(String),
    /// The response's length prefix is over our limit.
    TooLarge { len: u64, max: usize },
    /// The response is not one.
    Malformed(String),
}

/// Writes the request (length-delimited already) while waiting for the marker and the
/// response: a server that answers without reading the request (`BUSY`) is heard even if the
/// write cannot finish.
async fn exchange(
    stream: P2pStream,
    request: &[u8],
    max_response: usize,
) -> Result<proto::Response, Exchange> {
    let (mut read, mut write) = tokio::io::split(stream);
    let send = async {
        write.write_all(request).await?;
        write.flush().await?;
        Ok::<_, std::io::Error>(write)
    };
    let receive = async {
        let mut marker = [0u8; 1];
        match read.read(&mut marker).await {
            Ok(1) if marker[0] == TAKEN => {}
            Ok(1) => return Err(Exchange::Malformed(format!("marker {:#04x}", marker[0]))),
            Ok(_) => return Err(Exchange::NotTaken("stream ended".into())),
            Err(e) => return Err(Exchange::NotTaken(e.to_string())),
        }
        let body = match read_delimited(&mut read, max_response).await {
            Ok(Some(body)) => body,
            Ok(None) => return Err(Exchange::Failed("stream ended before the answer".into())),
            Err(DelimitedError::TooLarge { len, max }) => {
                return Err(Exchange::TooLarge { len, max });
            }
            Err(DelimitedError::Io(e)) => return Err(Exchange::Failed(e)),
            Err(DelimitedError::Truncated) => {
                return Err(Exchange::Failed("stream ended inside the answer".into()));
            }
            Err(e) => return Err(Exchange::Malformed(e.to_string())),
        };
        proto::Response::decode(body).map_err(|e| Exchange::Malformed(e.to_string()))
    };
    tokio::pin!(send, receive);
    let mut sent = false;
    loop {
        tokio::select! {
            written = &mut send, if !sent => {
                sent = true;
                if let Err(e) = written {
                    // Reset before the server took it, or refused while we wrote: what the
                    // read side gets says which.
                    tracing::trace!(error = %e, "rpc request not fully written");
                }
            }
            received = &mut receive => return received,
        }
    }
}

/// A response as the caller's result.
fn answer(
    response: proto::Response,
    peer: PeerId,
    method: &str,
    timeout: Duration,
) -> Result<Bytes, RpcError> {
    use proto::response::Result as R;
    let malformed = |detail: &str| RpcError::Protocol {
        peer,
        detail: detail.to_owned(),
    };
    match response.result {
        Some(R::Ok(bytes)) => Ok(bytes),
        None => Err(malformed("an answer with neither a result nor an error")),
        Some(R::Error(e)) => Err(match proto::Code::try_from(e.code) {
            Ok(proto::Code::UnknownMethod) => RpcError::UnknownMethod {
                method: method.into(),
                peer,
            },
            Ok(proto::Code::Handler) => RpcError::Handler {
                method: method.into(),
                peer,
                message: e.message,
            },
            Ok(proto::Code::TooLarge) => RpcError::Oversized {
                what: "request",
                len: e.len,
                max: usize::try_from(e.max).unwrap_or(usize::MAX),
            },
            Ok(proto::Code::Busy) => RpcError::Busy { peer },
            Ok(proto::Code::Timeout) => RpcError::Timeout {
                method: method.into(),
                peer,
                timeout,
            },
            Ok(proto::Code::BadRequest) => RpcError::Protocol {
                peer,
                detail: format!("the peer found our request malformed: {}", e.message),
            },
            Ok(proto::Code::Unspecified) | Err(_) => {
                malformed(&format!("unknown error code {}: {}", e.code, e.message))
            }
        }),
    }
}

/// The server loop: takes each stream under the shares, answers it in a task of its own.
async fn serve_streams(shared: Arc<Shared>, mut streams: InboundStreams) {
    let config = &shared.config;
    let shares: Shares<PeerId> = Shares::new(config.max_inbound, config.max_inbound_per_peer);
    let busy_answers = Arc::new(Semaphore::new(MAX_BUSY_ANSWERS));
    let mut calls = JoinSet::new();
    loop {
        tokio::select! {
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
            next = streams.next() => {
                let Some((peer, stream)) = next else { break };
                match shares.try_take(peer) {
                    Ok(share) => {
                        let shared = Arc::clone(&shared);
                        calls.spawn(async move {
                            let _share = share;
                            if let Err(e) = serve_call(&shared, peer, stream).await {
                                tracing::debug!(%peer, error = %e, "rpc call failed");
                            }
                        });
                    }
                    Err(refused) => {
                        tracing::debug!(%peer, %refused, "rpc call refused: busy");
                        if let Ok(permit) = busy_answers.clone().try_acquire_owned() {
                            calls.spawn(async move {
                                let _permit = permit;
                                let _ = refuse_busy(stream).await;
                            });
                        }
                    }
                }
            }
        }
    }
    calls.shutdown().await;
}

/// Marks a stream taken and answers `BUSY` without reading the request. Answers are encoded
/// length-delimited ([`error_response`], [`serve_call`]), so they are written as they are.
async fn refuse_busy(mut stream: P2pStream) -> std::io::Result<()> {
    let answer = error_response(proto::Code::Busy, "busy");
    tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&[TAKEN]).await?;
        stream.write_all(&answer).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

fn error_response(code: proto::Code, message: &str) -> Vec<u8> {
    sized_error(code, message, 0, 0)
}

/// An error answer with the sizes of a `TOO_LARGE`.
fn sized_error(code: proto::Code, message: &str, len: u64, max: usize) -> Vec<u8> {
    let mut end = message.len().min(MAX_ERROR_MESSAGE_BYTES);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    proto::Response {
        result: Some(proto::response::Result::Error(proto::Error {
            code: code as i32,
            message: message[..end].to_owned(),
            len,
            max: max as u64,
        })),
    }
    .encode_length_delimited_to_vec()
}

/// Why serving one call ended early (for the log).
#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("no request within {0:?}")]
    ReadTimeout(Duration),
    #[error("no answer written within {WRITE_TIMEOUT:?}")]
    WriteTimeout,
    #[error("handler of {method} ran past {limit:?}")]
    HandlerTimeout { method: String, limit: Duration },
}

/// One call: marker, request, handler, answer.
async fn serve_call(
    shared: &Shared,
    peer: PeerId,
    mut stream: P2pStream,
) -> Result<(), ServeError> {
    let config = &shared.config;
    stream.write_all(&[TAKEN]).await?;
    stream.flush().await?;
    let served = |method: &str| {
        shared
            .handlers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(method)
    };
    let read = read_request(&mut stream, config.max_request_bytes, served);
    let request = match tokio::time::timeout(config.read_timeout, read).await {
        Err(_) => return Err(ServeError::ReadTimeout(config.read_timeout)),
        Ok(Ok(RequestRead::Request(request))) => Ok(request),
        Ok(Ok(RequestRead::Nothing)) => Err("no request".to_owned()),
        Ok(Ok(RequestRead::Bad(detail))) => Err(detail),
        Ok(Ok(RequestRead::TooLarge { len, max })) => {
            let message = format!("request of {len} bytes exceeds the limit of {max}");
            let answer = sized_error(proto::Code::TooLarge, &message, len, max);
            return write_answer(&mut stream, answer).await;
        }
        Ok(Ok(RequestRead::Unknown(method))) => {
            let message = format!("no method {method:?}");
            let answer = error_response(proto::Code::UnknownMethod, &message);
            return write_answer(&mut stream, answer).await;
        }
        Ok(Err(e)) => Err(e.to_string()),
    };
    let request = match request {
        Ok(r) => r,
        Err(detail) => {
            return write_answer(
                &mut stream,
                error_response(proto::Code::BadRequest, &detail),
            )
            .await;
        }
    };
    let handler = shared
        .handlers
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&request.method)
        .cloned();
    let Some(handler) = handler else {
        let message = format!("no method {:?}", request.method);
        return write_answer(
            &mut stream,
            error_response(proto::Code::UnknownMethod, &message),
        )
        .await;
    };
    let limit = Duration::from_millis(request.timeout_ms).min(config.max_handler_time);
    let run = std::panic::AssertUnwindSafe(handler(peer, request.payload)).catch_unwind();
    let result = match tokio::time::timeout(limit, run).await {
        Err(_) => {
            // The caller has given up by now (or does at once): say so, for its log, in case
            // our clock ran ahead of its.
            let message = format!("handler ran past {limit:?}");
            let _ = write_answer(&mut stream, error_response(proto::Code::Timeout, &message)).await;
            return Err(ServeError::HandlerTimeout {
                method: request.method,
                limit,
            });
        }
        Ok(Err(_panic)) => Err("the handler panicked".to_owned()),
        Ok(Ok(result)) => result,
    };
    let answer = match result {
        Ok(bytes) => {
            let response = proto::Response {
                result: Some(proto::response::Result::Ok(bytes)),
            };
            let len = response.encoded_len();
            if len > config.max_response_bytes {
                let message = format!(
                    "answer of {len} bytes exceeds the server's limit of {}",
                    config.max_response_bytes
                );
                error_response(proto::Code::Handler, &message)
            } else {
                response.encode_length_delimited_to_vec()
            }
        }
        Err(message) => error_response(proto::Code::Handler, &message),
    };
    write_answer(&mut stream, answer).await
}

/// What [`read_request`] found.
#[derive(Debug)]
enum RequestRead {
    /// The stream ended before a request began.
    Nothing,
    /// A request for a served method, read in full.
    Request(proto::Request),
    /// A request for a method not served: nothing past its name was read.
    Unknown(String),
    /// The length prefix is over the limit: nothing past it was read.
    TooLarge { len: u64, max: usize },
    /// Malformed (what is wrong).
    Bad(String),
}

/// The protobuf key of `Request.method` (field 1, length-delimited).
const METHOD_KEY: u64 = (1 << 3) | 2;

/// Reads one length-delimited request in two steps (module docs, "Bounds"): its length prefix
/// (at most `max`) and the method's name, which must come first as it does in every request a
/// caller encodes; only if `served` says the method is served is the rest read, as it arrives
/// (nothing is allocated ahead of the bytes), and the whole decoded. A request for an unknown
/// method costs the server its head, however long its declared body.
async fn read_request<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    served: impl Fn(&str) -> bool,
) -> std::io::Result<RequestRead> {
    let bad = |what: &str| Ok(RequestRead::Bad(what.to_owned()));
    let mut prefix = Vec::new();
    let len = match read_varint(r, &mut prefix, 10).await? {
        Varint::Ended if prefix.is_empty() => return Ok(RequestRead::Nothing),
        Varint::Ended => return bad("stream ended inside the length prefix"),
        Varint::TooLong => return bad("length prefix longer than 10 bytes"),
        Varint::Value(len) => len,
    };
    if len > u64::try_from(max).unwrap_or(u64::MAX) {
        return Ok(RequestRead::TooLarge { len, max });
    }
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    let mut body = Vec::new();
    match read_varint(r, &mut body, len).await? {
        Varint::Value(METHOD_KEY) => {}
        Varint::Value(_) => return bad("a request must begin with its method"),
        Varint::Ended | Varint::TooLong => return bad("request ended inside its head"),
    }
    let left = len - body.len();
    let name_len = match read_varint(r, &mut body, left).await? {
        Varint::Value(n) => usize::try_from(n).unwrap_or(usize::MAX),
        Varint::Ended | Varint::TooLong => return bad("request ended inside its head"),
    };
    if name_len == 0 || name_len > MAX_METHOD_BYTES || name_len > len - body.len() {
        return bad(&format!(
            "method name of {name_len} bytes (1..={MAX_METHOD_BYTES} within the request)"
        ));
    }
    let start = body.len();
    body.resize(start + name_len, 0);
    if let Err(e) = r.read_exact(&mut body[start..]).await {
        return if e.kind() == std::io::ErrorKind::UnexpectedEof {
            bad("stream ended inside the method name")
        } else {
            Err(e)
        };
    }
    let Ok(method) = std::str::from_utf8(&body[start..]) else {
        return bad("method name is not UTF-8");
    };
    if !served(method) {
        return Ok(RequestRead::Unknown(method.to_owned()));
    }
    let rest = len - body.len();
    (&mut *r)
        .take(u64::try_from(rest).unwrap_or(u64::MAX))
        .read_to_end(&mut body)
        .await?;
    if body.len() < len {
        return bad("stream ended inside the request");
    }
    match proto::Request::decode(&body[..]) {
        Ok(request) => Ok(RequestRead::Request(request)),
        Err(e) => bad(&e.to_string()),
    }
}

/// A varint read by [`read_varint`].
enum Varint {
    Value(u64),
    /// The stream ended first.
    Ended,
    /// Longer than allowed (10 bytes, or what is left of the message).
    TooLong,
}

/// Reads one protobuf varint byte by byte (at most `limit` bytes, and 10), appending its bytes
/// to `out`.
async fn read_varint<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    out: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<Varint> {
    let mut value = 0u64;
    for i in 0..limit.min(10) {
        let mut byte = [0u8; 1];
        if r.read(&mut byte).await? == 0 {
            return Ok(Varint::Ended);
        }
        out.push(byte[0]);
        value |= u64::from(byte[0] & 0x7f) << (7 * i);
        if byte[0] & 0x80 == 0 {
            return Ok(Varint::Value(value));
        }
    }
    Ok(Varint::TooLong)
}

async fn write_answer(stream: &mut P2pStream, answer: Vec<u8>) -> Result<(), ServeError> {
    tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&answer).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| ServeError::WriteTimeout)??;
    Ok(())
}

/// `now + after`, or where that is past what an instant holds (a caller's `Duration::MAX`,
/// which panicked in `Instant + Duration`), a deadline about 30 years ahead: never, in effect.
pub(crate) fn deadline_after(after: Duration) -> Instant {
    const NEVER: Duration = Duration::from_secs(30 * 365 * 86_400);
    let now = Instant::now();
    now.checked_add(after.min(NEVER))
        .unwrap_or_else(|| now + Duration::from_secs(86_400))
}

/// A call's request.
fn request(method: &str, payload: &[u8], timeout: Duration) -> proto::Request {
    proto::Request {
        method: method.into(),
        payload: Bytes::copy_from_slice(payload),
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Encodes a request as a caller would, length-delimited (for tests of hostile callers).
#[doc(hidden)]
pub fn encode_request(method: &str, payload: &[u8], timeout: Duration) -> Vec<u8> {
    request(method, payload, timeout).encode_length_delimited_to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 29, item 8: a caller's `Duration::MAX` (or anything past what an instant holds)
    /// is a deadline far ahead, not a panic in `Instant + Duration`.
    #[test]
    fn deadlines_past_what_an_instant_holds_are_far_ahead() {
        let now = Instant::now();
        for after in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let deadline = deadline_after(after);
            assert!(
                deadline >= now + Duration::from_secs(365 * 86_400),
                "{after:?}"
            );
        }
        let soon = deadline_after(Duration::from_secs(5));
        assert!(soon >= now + Duration::from_secs(5));
        assert!(soon <= Instant::now() + Duration::from_secs(5));
    }
}
