//! Node metrics for the people who run nodes, in the Prometheus/OpenMetrics text format.
//!
//! Every node has one [`Metrics`] registry ([`crate::p2p::P2p::metrics`]); the subsystems
//! update it as they work and [`serve`] answers `GET /metrics` with its text. What is there
//! (all names start with `hivemesh_`):
//!
//! | metric | kind | labels | from |
//! |---|---|---|---|
//! | `connected_peers`, `connections` | gauge | | the swarm |
//! | `dht_records`, `dht_record_bytes`, `dht_local_records` | gauge | | the DHT store |
//! | `dht_records_evicted_total`, `dht_records_refused_total` | counter | | the DHT store |
//! | `dht_writes_total` | counter | `replicas`: `looked_up`, `known` | this node's DHT writes: after a closest-peers lookup, or to the peers the last one found |
//! | `dht_write_bytes_total` | counter | | record bytes this node's DHT writes sent, summed over the replicas written to |
//! | `relay_circuits`, `relay_reservations` | gauge | | the relay server (if this node relays) |
//! | `relayed_addresses` | gauge | | our own relay reservations (behind a NAT) |
//! | `hole_punches_total` | counter | `result`: `ok`, `failed` | hole punching |
//! | `rounds_total` | counter | `result`: `ok`, `failed`, `cancelled` | the averagers' rounds |
//! | `round_seconds` | histogram | | rounds that finished, links to report |
//! | `link_bytes_total` | counter | `carrier`: `tls`, `stream`; `direction`: `sent`, `received` | round links |
//! | `inbound_links_total` | counter | `result`: `accepted`, `refused`, `failed`, ... | the link hub |
//!
//! Applications may register their own metrics beside these ([`Metrics::register`]).
//!
//! The HTTP side ([`serve`]) is written here rather than taken from an HTTP crate: it answers one
//! route with one body, closes each connection after its answer, and bounds what it reads
//! (8 KiB of request head within 5 s) and how many connections it holds at once. The request
//! head is parsed by a pure function ([`parse_request`]); hyper and its stack would add some
//! thirty crates to every build for this.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinSet;

use crate::links::Carrier;

/// Labels of `link_bytes_total`.
type LinkLabels = [(&'static str, &'static str); 2];
/// A single `result` label.
type ResultLabel = [(&'static str, &'static str); 1];

/// How a round ended, for `rounds_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundResult {
    /// The round finished and its result was applied (some parts may average fewer peers).
    Ok,
    /// The round failed (links, protocol, its deadline).
    Failed,
    /// The round was cancelled.
    Cancelled,
}

impl RoundResult {
    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// A node's metrics (see the module docs). Cheap to clone: clones share the registry.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    registry: Mutex<Registry>,
    connected_peers: Gauge,
    connections: Gauge,
    dht_records: Gauge,
    dht_record_bytes: Gauge,
    dht_local_records: Gauge,
    dht_evicted: Counter,
    dht_refused: Counter,
    dht_writes: Family<[(&'static str, &'static str); 1], Counter>,
    dht_write_bytes: Counter,
    relay_circuits: Gauge,
    relay_reservations: Gauge,
    rounds: Family<ResultLabel, Counter>,
    round_seconds: Histogram,
    link_bytes: Family<LinkLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The byte counters of one carrier, handed to the links it carries ([`CountedLink`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct LinkCounters {
    sent: Counter,
    received: Counter,
}

impl Metrics {
    /// An empty registry with hivemesh's metrics, all at zero.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hivemesh");
        let inner = Inner {
            registry: Mutex::new(Registry::default()),
            connected_peers: Gauge::default(),
            connections: Gauge::default(),
            dht_records: Gauge::default(),
            dht_record_bytes: Gauge::default(),
            dht_local_records: Gauge::default(),
            dht_evicted: Counter::default(),
            dht_refused: Counter::default(),
            dht_writes: Family::default(),
            dht_write_bytes: Counter::default(),
            relay_circuits: Gauge::default(),
            relay_reservations: Gauge::default(),
            rounds: Family::default(),
            round_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            link_bytes: Family::default(),
        };
        let i = &inner;
        let gauges: [(&str, &str, &Gauge); 7] = [
            (
                "connected_peers",
                "Peers with an open connection",
                &i.connected_peers,
            ),
            ("connections", "Open connections", &i.connections),
            ("dht_records", "DHT records held", &i.dht_records),
            (
                "dht_record_bytes",
                "Bytes (keys and values) of the DHT records held",
                &i.dht_record_bytes,
            ),
            (
                "dht_local_records",
                "DHT records this node holds for itself",
                &i.dht_local_records,
            ),
            (
                "relay_circuits",
                "Circuits relayed by this node now",
                &i.relay_circuits,
            ),
            (
                "relay_reservations",
                "Relay reservations this node serves now",
                &i.relay_reservations,
            ),
        ];
        for (name, help, gauge) in gauges {
            registry.register(name, help, gauge.clone());
        }
        registry.register(
            "dht_records_evicted",
            "DHT records evicted to make room",
            i.dht_evicted.clone(),
        );
        registry.register(
            "dht_records_refused",
            "DHT records refused (the writer's share used up or the store full)",
            i.dht_refused.clone(),
        );
        registry.register(
            "dht_writes",
            "DHT writes of this node, by whether the key's closest peers were looked up first",
            i.dht_writes.clone(),
        );
        for replicas in ["looked_up", "known"] {
            let _ = i.dht_writes.get_or_create(&[("replicas", replicas)]);
        }
        registry.register(
            "dht_write_bytes",
            "Record bytes sent by this node's DHT writes, summed over the replicas written to",
            i.dht_write_bytes.clone(),
        );
        registry.register(
            "rounds",
            "Averaging rounds run, by how they ended",
            i.rounds.clone(),
        );
        registry.register(
            "round_seconds",
            "Duration of averaging rounds that finished, from linking to the report",
            i.round_seconds.clone(),
        );
        registry.register(
            "link_bytes",
            "Bytes moved over round links, by carrier and direction",
            i.link_bytes.clone(),
        );
        for result in ["ok", "failed", "cancelled"] {
            let _ = i.rounds.get_or_create(&[("result", result)]);
        }
        for carrier in [Carrier::Tls, Carrier::Stream] {
            let _ = inner.link_counters(carrier);
        }
        *inner
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = registry;
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Registers an application metric beside hivemesh's (its name gets the `hivemesh_`
    /// prefix), e.g. a training loss gauge.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry().register(name, help, metric);
    }

    /// Registers a collector, asked for its values at every scrape.
    pub(crate) fn register_collector(&self, collector: impl Collector) {
        self.registry().register_collector(Box::new(collector));
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.inner
            .registry
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The metrics in the OpenMetrics text format (what `GET /metrics` answers).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; a collector's error would end the text early,
        // which a scraper reports as a bad scrape.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry()) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }

    /// Counts one round.
    pub(crate) fn round_finished(&self, result: RoundResult, elapsed: Duration) {
        self.inner
            .rounds
            .get_or_create(&[("result", result.label())])
            .inc();
        if result == RoundResult::Ok {
            self.inner.round_seconds.observe(elapsed.as_secs_f64());
        }
    }

    /// The byte counters of links over `carrier`.
    pub(crate) fn link_counters(&self, carrier: Carrier) -> LinkCounters {
        self.inner.link_counters(carrier)
    }

    /// Sets the connection gauges.
    /// One DHT write of this node: after a lookup of the key's closest peers (`looked_up`), or
    /// to the peers the last lookup found.
    pub(crate) fn dht_write(&self, looked_up: bool) {
        let label = if looked_up { "looked_up" } else { "known" };
        self.inner
            .dht_writes
            .get_or_create(&[("replicas", label)])
            .inc();
    }

    /// A DHT write sent `bytes` of record to each of `replicas` peers.
    pub(crate) fn dht_write_sent(&self, bytes: usize, replicas: usize) {
        let total = bytes.saturating_mul(replicas);
        self.inner
            .dht_write_bytes
            .inc_by(u64::try_from(total).unwrap_or(u64::MAX));
    }

    pub(crate) fn set_connections(&self, peers: usize, connections: usize) {
        self.inner.connected_peers.set(gauge_value(peers));
        self.inner.connections.set(gauge_value(connections));
    }

    /// Sets the store gauges and counters from the store's usage.
    pub(crate) fn set_store(&self, usage: &crate::p2p::StoreUsage) {
        let i = &self.inner;
        i.dht_records.set(gauge_value(usage.records));
        i.dht_record_bytes.set(gauge_value(usage.bytes));
        i.dht_local_records.set(gauge_value(usage.local_records));
        raise_to(&i.dht_evicted, usage.evicted);
        raise_to(&i.dht_refused, usage.refused);
    }

    /// A relay circuit through this node opened (`+1`) or closed (`-1`).
    pub(crate) fn relay_circuits_add(&self, delta: i64) {
        self.inner.relay_circuits.inc_by(delta);
    }

    /// A relay reservation on this node was made (`+1`) or ended (`-1`).
    pub(crate) fn relay_reservations_add(&self, delta: i64) {
        self.inner.relay_reservations.inc_by(delta);
    }
}

impl Inner {
    fn link_counters(&self, carrier: Carrier) -> LinkCounters {
        let carrier = match carrier {
            Carrier::Tls => "tls",
            Carrier::Stream => "stream",
        };
        let get = |direction| {
            self.link_bytes
                .get_or_create(&[("carrier", carrier), ("direction", direction)])
                .clone()
        };
        LinkCounters {
            sent: get("sent"),
            received: get("received"),
        }
    }
}

fn gauge_value(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Moves a counter up to `value` (the store keeps its own running totals).
fn raise_to(counter: &Counter, value: u64) {
    let now = counter.get();
    if value > now {
        counter.inc_by(value - now);
    }
}

/// Counters read from a watched stats struct at each scrape.
pub(crate) struct WatchCollector<T> {
    stats: tokio::sync::watch::Receiver<T>,
    /// One counter family per entry, with a `result` label per reader.
    families: Vec<CounterFamily<T>>,
    gauges: Vec<GaugeOf<T>>,
}

/// One `result` label of a counter family and how to read its value from `T`.
pub(crate) type Reader<T> = (&'static str, fn(&T) -> u64);
/// A counter family read from `T`: name, help, readers.
type CounterFamily<T> = (&'static str, &'static str, Vec<Reader<T>>);
/// A gauge read from `T`: name, help, reader.
type GaugeOf<T> = (&'static str, &'static str, fn(&T) -> i64);

impl<T> std::fmt::Debug for WatchCollector<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchCollector").finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> WatchCollector<T> {
    /// A collector of nothing yet, reading `stats`.
    pub(crate) fn new(stats: tokio::sync::watch::Receiver<T>) -> Self {
        Self {
            stats,
            families: Vec::new(),
            gauges: Vec::new(),
        }
    }

    /// Adds a counter family with a `result` label per reader.
    pub(crate) fn counters(
        mut self,
        name: &'static str,
        help: &'static str,
        results: Vec<Reader<T>>,
    ) -> Self {
        self.families.push((name, help, results));
        self
    }

    /// Adds a gauge.
    pub(crate) fn gauge(
        mut self,
        name: &'static str,
        help: &'static str,
        f: fn(&T) -> i64,
    ) -> Self {
        self.gauges.push((name, help, f));
        self
    }
}

impl<T: Send + Sync + 'static> Collector for WatchCollector<T> {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.stats.borrow();
        for (name, help, results) in &self.families {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for (result, read) in results {
                let labels: ResultLabel = [("result", result)];
                ConstCounter::new(read(&stats)).encode(family.encode_family(&labels)?)?;
            }
        }
        for (name, help, read) in &self.gauges {
            let gauge = prometheus_client::metrics::gauge::ConstGauge::new(read(&stats));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// A link that counts the bytes it moves into its carrier's counters (`link_bytes_total`).
pub(crate) struct CountedLink {
    inner: Box<dyn crate::runner::Link>,
    counters: LinkCounters,
}

impl CountedLink {
    pub(crate) fn new(inner: Box<dyn crate::runner::Link>, counters: LinkCounters) -> Self {
        Self { inner, counters }
    }
}

impl AsyncRead for CountedLink {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        if read > 0 {
            self.counters.received.inc_by(read as u64);
        }
        polled
    }
}

impl AsyncWrite for CountedLink {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = polled {
            self.counters.sent.inc_by(n as u64);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = polled {
            self.counters.sent.inc_by(n as u64);
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The most bytes of request head the server reads.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// How long a client has to send its request head.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing the answer may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 16;

/// What a request head asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics` (or `HEAD`).
    Metrics {
        /// A `HEAD` request: headers only.
        head_only: bool,
    },
    /// Any other path.
    NotFound,
    /// A method other than GET and HEAD.
    MethodNotAllowed,
}

/// A request head that is not HTTP/1.x.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad HTTP request: {0}")]
pub struct BadRequest(&'static str);

/// Parses what a client sent so far: `Ok(None)` while the head (ending with an empty line) is
/// incomplete and shorter than [`MAX_REQUEST_HEAD`].
pub fn parse_request(buf: &[u8]) -> Result<Option<Route>, BadRequest> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n"));
    let Some(end) = end else {
        return if buf.len() >= MAX_REQUEST_HEAD {
            Err(BadRequest("request head too long"))
        } else {
            Ok(None)
        };
    };
    if end > MAX_REQUEST_HEAD {
        return Err(BadRequest("request head too long"));
    }
    let line_end = buf[..end].iter().position(|&b| b == b'\n').unwrap_or(end);
    let line = std::str::from_utf8(&buf[..line_end])
        .map_err(|_| BadRequest("request line is not UTF-8"))?
        .trim_end_matches('\r');
    let mut words = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(BadRequest("request line is not METHOD TARGET VERSION"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(BadRequest("not HTTP/1.x"));
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Ok(Some(Route::MethodNotAllowed)),
    };
    let path = target.split('?').next().unwrap_or_default();
    Ok(Some(if path == "/metrics" {
        Route::Metrics { head_only }
    } else {
        Route::NotFound
    }))
}

/// A running metrics endpoint ([`serve`]). Dropping it stops it too.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsServer {
    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, ends the connections being served and waits for the task.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `metrics` at `http://listen/metrics` (see the module docs for its bounds).
pub async fn serve(listen: SocketAddr, metrics: Metrics) -> std::io::Result<MetricsServer> {
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let (stop, mut stopped) = oneshot::channel();
    let task = tokio::spawn(async move {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let mut connections = JoinSet::new();
        loop {
            let permit = tokio::select! {
                _ = &mut stopped => break,
                permit = slots.clone().acquire_owned() => permit,
            };
            let Ok(permit) = permit else { break };
            tokio::select! {
                _ = &mut stopped => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let metrics = metrics.clone();
                        connections.spawn(async move {
                            if let Err(e) = answer(stream, &metrics).await {
                                tracing::debug!(%peer, error = %e, "metrics request failed");
                            }
                            drop(permit);
                        });
                    }
                    Err(e) => {
                        // E.g. out of file descriptors: wait a little instead of spinning.
                        tracing::warn!(error = %e, "metrics listener");
                        drop(permit);
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        connections.shutdown().await;
    });
    Ok(MetricsServer {
        addr,
        stop: Some(stop),
        task,
    })
}

/// Reads one request head and answers it.
async fn answer<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    metrics: &Metrics,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let route = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut chunk = [0u8; 1024];
        loop {
            match parse_request(&buf) {
                Ok(Some(route)) => return Ok(Ok(route)),
                Ok(None) => {}
                Err(e) => return Ok(Err(e)),
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
            }
            // At most MAX_REQUEST_HEAD + one chunk: parse_request refuses a longer head.
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let (status, content_type, body, head_only) = match route {
        Ok(Route::Metrics { head_only }) => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
            head_only,
        ),
        Ok(Route::NotFound) => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found: metrics are at /metrics\n".to_owned(),
            false,
        ),
        Ok(Route::MethodNotAllowed) => (
            "405 Method Not Allowed",
            "text/plain; charset=utf-8",
            "only GET and HEAD\n".to_owned(),
            false,
        ),
        Err(e) => (
            "400 Bad Request",
            "text/plain; charset=utf-8",
            format!("{e}\n"),
            false,
        ),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(&out).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads_are_routed() {
        let get = |s: &str| parse_request(s.as_bytes());
        assert_eq!(
            get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Ok(Some(Route::Metrics { head_only: false }))
        );
        assert_eq!(
            get("HEAD /metrics?x=1 HTTP/1.0\n\n"),
            Ok(Some(Route::Metrics { head_only: true }))
        );
        assert_eq!(get("GET / HTTP/1.1\r\n\r\n"), Ok(Some(Route::NotFound)));
        assert_eq!(
            get("POST /metrics HTTP/1.1\r\n\r\n"),
            Ok(Some(Route::MethodNotAllowed))
        );
        assert_eq!(get("GET /metrics HTTP/1.1\r\nHost: x\r\n"), Ok(None));
        assert!(get("GET /metrics\r\n\r\n").is_err());
        assert!(get("GET /metrics SPDY/3\r\n\r\n").is_err());
        assert!(get("\u{1}\u{2}\r\n\r\n").is_err());
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(MAX_REQUEST_HEAD));
        assert!(get(&long).is_err());
        assert!(parse_request(b"GET /\xff HTTP/1.1\r\n\r\n").is_err());
    }

    #[test]
    fn encoded_metrics_move_with_rounds_and_links() {
        let metrics = Metrics::new();
        let text = metrics.encode();
        assert!(
            text.contains("hivemesh_rounds_total{result=\"ok\"} 0\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"));
        metrics.round_finished(RoundResult::Ok, Duration::from_millis(300));
        metrics.round_finished(RoundResult::Failed, Duration::from_secs(1));
        let counters = metrics.link_counters(Carrier::Tls);
        counters.sent.inc_by(1000);
        metrics.set_connections(3, 4);
        let text = metrics.encode();
        assert!(
            text.contains("hivemesh_rounds_total{result=\"ok\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("hivemesh_rounds_total{result=\"failed\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("hivemesh_round_seconds_count 1\n"), "{text}");
        assert!(
            text.contains("hivemesh_link_bytes_total{carrier=\"tls\",direction=\"sent\"} 1000\n"),
            "{text}"
        );
        assert!(text.contains("hivemesh_connected_peers 3\n"), "{text}");
    }

    #[test]
    fn watched_stats_are_collected_at_each_scrape() {
        #[derive(Default)]
        struct Stats {
            a: u64,
            b: u64,
        }
        let (tx, rx) = tokio::sync::watch::channel(Stats::default());
        let metrics = Metrics::new();
        metrics.register_collector(
            WatchCollector::new(rx)
                .counters(
                    "things",
                    "Things",
                    vec![("a", |s: &Stats| s.a), ("b", |s: &Stats| s.b)],
                )
                .gauge("b_now", "B", |s: &Stats| s.b as i64),
        );
        tx.send_modify(|s| {
            s.a = 5;
            s.b = 7;
        });
        let text = metrics.encode();
        assert!(
            text.contains("hivemesh_things_total{result=\"a\"} 5\n"),
            "{text}"
        );
        assert!(
            text.contains("hivemesh_things_total{result=\"b\"} 7\n"),
            "{text}"
        );
        assert!(text.contains("hivemesh_b_now 7\n"), "{text}");
    }

    #[tokio::test]
    async fn the_server_answers_metrics_and_refuses_the_rest() {
        let metrics = Metrics::new();
        metrics.round_finished(RoundResult::Ok, Duration::from_millis(10));
        let server = serve(SocketAddr::from(([127, 0, 0, 1], 0)), metrics)
            .await
            .unwrap();
        let addr = server.local_addr();
        let ask = |request: Vec<u8>| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&request).await.unwrap();
            let mut answer = String::new();
            tokio::time::timeout(Duration::from_secs(60), s.read_to_string(&mut answer))
                .await
                .expect("answered in time")
                .unwrap();
            answer
        };
        let ok = ask(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("hivemesh_rounds_total{result=\"ok\"} 1\n"),
            "{ok}"
        );
        let length: usize = ok
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, ok.split_once("\r\n\r\n").unwrap().1.len());
        let missing = ask(b"GET /other HTTP/1.1\r\n\r\n".to_vec()).await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        // Exactly the limit, so that the server has read everything when it answers.
        let garbage = ask(vec![b'x'; MAX_REQUEST_HEAD]).await;
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
        server.shutdown().await;
    }
}
