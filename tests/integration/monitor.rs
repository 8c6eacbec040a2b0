//! `hivemesh monitor` on a real swarm over loopback: four training peers publish progress and
//! metrics (one of them names itself with HTML and a script), a monitor node serves the page.
//! Checked: the JSON endpoint against the peers' actual state, and, in headless Chromium driven
//! through chromedriver (WebDriver), what a person sees: the peer count, every peer's row, the
//! epoch advancing, charts with points, the hostile name rendered as text with no script run,
//! and a peer that leaves shown as gone. A screenshot lands in `target/tmp/`.
//!
//! Without chromium and chromedriver the browser half prints `skipped: ...`, unless
//! `HIVEMESH_BROWSER_REQUIRED=1` (CI), where it fails.

use crate::common;

use common::dht_node;

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hivemesh::dht::{Dht, DhtTime};
use hivemesh::monitor::{MonitorConfig, MonitorNode, MonitorOptions, progress_prefix};
use hivemesh::train::{
    MetricsConfig, MetricsPublisher, ModeClaim, PeerMetrics, ProgressConfig, ProgressTracker,
    ReachClaim,
};
use serde_json::{Value, json};

/// The most any wait here takes: far beyond what it needs on a loaded 2-core machine.
const LIMIT: Duration = Duration::from_secs(120);
const RUN: &str = "monitor_test";
const TARGET: u64 = 120;
/// A name holding HTML and scripts: it must show as this very text.
const HOSTILE: &str = "<script>__pwned=1</script><img src=x onerror=__pwned=2>";

/// Polls `check` every 50 ms until it returns `Some` or [`LIMIT`] passes.
fn eventually<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(v) = check() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One HTTP/1.1 request over a fresh connection; the status and the body.
fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).expect("connects");
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(body.as_bytes()).unwrap();
    // Read the head, then as much body as it announces (chromedriver keeps connections open).
    let mut raw = Vec::new();
    let mut buf = [0u8; 16384];
    let head_end = |raw: &[u8]| raw.windows(4).position(|w| w == b"\r\n\r\n");
    let complete = |raw: &[u8]| {
        let Some(split) = head_end(raw) else {
            return false;
        };
        let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
        let body = &raw[split + 4..];
        if let Some(len) = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|l| l.trim().parse::<usize>().ok())
        {
            return body.len() >= len;
        }
        head.contains("transfer-encoding: chunked") && body.ends_with(b"0\r\n\r\n")
    };
    while !complete(&raw) {
        let n = stream.read(&mut buf).expect("reads the answer");
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
    }
    let split = head_end(&raw).expect("a complete head");
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head[9..12].parse().expect("a status code");
    let mut body = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let line = raw
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("chunk size");
        let size = std::str::from_utf8(&raw[..line])
            .unwrap()
            .split(';')
            .next()
            .unwrap();
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&raw[line + 2..line + 2 + size]);
        raw = &raw[line + 4 + size..];
    }
}

fn state(addr: SocketAddr) -> Value {
    let (status, body) = http(addr, "GET", "/api/state", None);
    assert_eq!(status, 200);
    serde_json::from_slice(&body).expect("JSON")
}

/// A training peer: progress tracker, metrics publisher, and a loop reporting a batch every
/// 50 ms until told to stop.
struct Peer {
    dht: Dht,
    tracker: Arc<ProgressTracker>,
    metrics: Arc<MetricsPublisher>,
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

async fn peer(initial: Vec<libp2p::Multiaddr>, name: &str, mode: ModeClaim) -> Peer {
    let dht = dht_node(initial, false).await;
    let mut cfg = ProgressConfig::new(TARGET);
    cfg.client_mode = mode == ModeClaim::Client;
    cfg.min_refresh_period = Duration::from_millis(100);
    cfg.max_refresh_period = Duration::from_millis(500);
    cfg.default_refresh_period = Duration::from_millis(200);
    cfg.request_timeout = Duration::from_secs(10);
    // The optimizer's layout: the tracker's prefix is "{run_id}_progress".
    let prefix = progress_prefix(RUN);
    let tracker = Arc::new(
        ProgressTracker::new(dht.clone(), &prefix, cfg)
            .await
            .unwrap(),
    );
    tracker.start();
    let config = MetricsConfig {
        min_period: Duration::from_millis(100),
        ..MetricsConfig::default()
    };
    let metrics = Arc::new(MetricsPublisher::start(dht.clone(), RUN, config).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (t, m, s, name) = (
        tracker.clone(),
        metrics.clone(),
        stop.clone(),
        name.to_owned(),
    );
    let task = tokio::spawn(async move {
        let (mut epoch, mut samples, mut rounds) = (0u64, 0u64, 0u32);
        while !s.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(50)).await;
            samples += 4;
            t.report_local_progress(epoch, samples, true);
            if t.ready_to_update_epoch() {
                let _paused = t.pause_updates();
                epoch = t.update_epoch(Some(t.global_epoch().max(epoch + 1)));
                samples = 0;
                rounds += 1;
            }
            let report = PeerMetrics {
                epoch,
                samples_per_second: t.local_progress().samples_per_second,
                loss: Some(2.0 / (1.0 + epoch as f64)),
                time: DhtTime::now().as_secs(),
                target_batch_size: TARGET,
                rounds_ok: rounds,
                rounds_failed: 0,
                last_group_size: 3,
                reach: ReachClaim::Public,
                mode,
                name: name.clone(),
            };
            m.report(report).expect("valid metrics");
        }
    });
    Peer {
        dht,
        tracker,
        metrics,
        stop,
        task: Some(task),
    }
}

impl Peer {
    fn id(&self) -> String {
        self.dht.p2p().peer_id().to_base58()
    }

    /// Stops training; the records stay published.
    async fn pause(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }

    /// Leaves: both records withdrawn.
    async fn leave(mut self) {
        self.pause().await;
        self.tracker
            .shutdown(Duration::from_secs(10))
            .await
            .unwrap();
        self.metrics
            .shutdown(Duration::from_secs(10))
            .await
            .unwrap();
    }
}

/// chromedriver and a WebDriver session of headless Chromium; both end on drop.
struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
}

/// Where chromedriver and chromium are, or why the browser half cannot run.
fn find_browser() -> Result<(PathBuf, PathBuf), String> {
    let on_path = |name: &str| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
    };
    let driver = on_path("chromedriver").ok_or("no chromedriver on PATH")?;
    let chromium = [PathBuf::from("/usr/lib/chromium/chromium")]
        .into_iter()
        .find(|p| p.is_file())
        .or_else(|| on_path("chromium"))
        .ok_or("no chromium")?;
    Ok((driver, chromium))
}

impl Browser {
    fn start(driver: PathBuf, chromium: PathBuf) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut browser = Self {
            driver,
            addr,
            session: String::new(),
        };
        eventually("chromedriver to listen", || {
            let stream = TcpStream::connect(addr).ok()?;
            drop(stream);
            let (_, body) = http(addr, "GET", "/status", None);
            let status: Value = serde_json::from_slice(&body).ok()?;
            (status["value"]["ready"] == true).then_some(())
        });
        let caps = json!({"capabilities": {"alwaysMatch": {"goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1100"],
        }}}});
        let session = browser.call("POST", "/session", Some(&caps));
        browser.session = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("a session: {session}"))
            .to_owned();
        browser
    }

    /// One WebDriver command: its `value`.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let (status, body) = http(self.addr, method, path, body);
        let answer: Value = serde_json::from_slice(&body).expect("WebDriver answers JSON");
        assert_eq!(status, 200, "{method} {path}: {answer}");
        answer["value"].clone()
    }

    fn session(&self, command: &str) -> String {
        format!("/session/{}/{command}", self.session)
    }

    fn open(&self, url: &str) {
        self.call("POST", &self.session("url"), Some(&json!({"url": url})));
    }

    /// Runs `script` (a function body) in the page: what it returns.
    fn eval(&self, script: &str) -> Value {
        let body = json!({"script": script, "args": []});
        self.call("POST", &self.session("execute/sync"), Some(&body))
    }

    fn screenshot(&self, path: &std::path::Path) {
        use base64::Engine as _;
        let png = self.call("GET", &self.session("screenshot"), None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64"))
            .expect("valid base64");
        std::fs::write(path, png).expect("screenshot written");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = http(
                self.addr,
                "DELETE",
                &format!("/session/{}", self.session),
                None,
            );
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// The text of the page element `id`.
fn text_of(browser: &Browser, id: &str) -> String {
    let v = browser.eval(&format!(
        "const e = document.getElementById({id:?}); return e ? e.textContent : null;"
    ));
    v.as_str().unwrap_or_default().to_owned()
}

/// The page's peer table: `(peer id, class, name cell's text)` per row.
fn rows(browser: &Browser) -> Vec<(String, String, String)> {
    let v = browser.eval(
        "return [...document.querySelectorAll('#peer-table tbody tr')].map(r => \
         [r.getAttribute('data-peer'), r.className, r.children[1].textContent]);",
    );
    v.as_array()
        .map(|rows| {
            rows.iter()
                .map(|r| {
                    let s = |i: usize| r[i].as_str().unwrap_or_default().to_owned();
                    (s(0), s(1), s(2))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_monitor_shows_a_live_swarm_in_json_and_in_a_browser() {
    let browser_parts = match find_browser() {
        Ok(parts) => Some(parts),
        Err(why) if std::env::var("HIVEMESH_BROWSER_REQUIRED").as_deref() == Ok("1") => {
            panic!(
                "HIVEMESH_BROWSER_REQUIRED=1 but {why} (apt-get install chromium chromium-driver)"
            )
        }
        Err(why) => {
            println!("skipped: the browser half ({why}; apt-get install chromium chromium-driver)");
            None
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (boot, mut peers, monitor) = rt.block_on(async {
        let boot = dht_node(vec![], false).await;
        let addrs = boot.p2p().listen_addrs().await.unwrap();
        let mut peers = Vec::new();
        for (name, mode) in [
            ("ada", ModeClaim::Node),
            ("grace", ModeClaim::Node),
            (HOSTILE, ModeClaim::Node),
            ("edsger", ModeClaim::Client),
        ] {
            peers.push(peer(addrs.clone(), name, mode).await);
        }
        let monitor = MonitorNode::start(MonitorOptions {
            initial_peers: addrs,
            run_id: RUN.into(),
            http: ([127, 0, 0, 1], 0).into(),
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
            swarm_key: None,
            config: MonitorConfig {
                refresh_period: Duration::from_millis(200),
                ..MonitorConfig::default()
            },
        })
        .await
        .expect("the monitor starts");
        (boot, peers, monitor)
    });
    let url = monitor.url();
    let addr: SocketAddr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let ids: Vec<String> = peers.iter().map(Peer::id).collect();

    // JSON: every peer with its metrics (name, mode, target), while the epoch advances.
    let first = eventually("every peer in /api/state", || {
        let s = state(addr);
        let mut shown: Vec<&str> = s["peers"]
            .as_array()?
            .iter()
            .filter(|p| p["status"] == "live" && !p["loss"].is_null())
            .filter_map(|p| p["peer_id"].as_str())
            .collect();
        shown.sort_unstable();
        let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
        want.sort_unstable();
        (shown == want && s["global"]["num_peers"] == 4).then_some(s)
    });
    assert_eq!(first["run_id"], RUN);
    assert_eq!(first["global"]["num_clients"], 1);
    assert_eq!(first["global"]["target_batch_size"], TARGET);
    let hostile = first["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["peer_id"] == ids[2].as_str())
        .unwrap();
    assert_eq!(hostile["name"], HOSTILE);
    let client = first["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["peer_id"] == ids[3].as_str())
        .unwrap();
    assert_eq!(
        (&client["mode"], &client["reach"]),
        (&json!("client"), &json!("client"))
    );
    let epoch0 = first["global"]["epoch"].as_u64().unwrap();
    eventually("the global epoch to advance in /api/state", || {
        (state(addr)["global"]["epoch"].as_u64()? >= epoch0 + 2).then_some(())
    });

    // The page, as a person sees it.
    let mut browser = browser_parts.map(|(driver, chromium)| {
        let b = Browser::start(driver, chromium);
        b.open(&url);
        b
    });
    if let Some(b) = &browser {
        eventually("four live rows on the page", || {
            let rows = rows(b);
            let live = rows.iter().filter(|r| r.1 == "live").count();
            (live == 4 && text_of(b, "peers") == "4").then_some(())
        });
        let shown: Vec<String> = rows(b).into_iter().map(|r| r.0).collect();
        for id in &ids {
            assert!(shown.contains(id), "no row for {id}: {shown:?}");
        }
        let hostile_row = rows(b).into_iter().find(|r| r.0 == ids[2]).unwrap();
        assert_eq!(hostile_row.2, HOSTILE, "the hostile name shows as text");
        let injected = b.eval(
            "return [window.__pwned === undefined, \
             document.querySelectorAll('#peer-table img, #peer-table script').length];",
        );
        assert_eq!(
            injected,
            json!([true, 0]),
            "no element or script from a name"
        );
        let epoch: u64 = text_of(b, "epoch").parse().expect("an epoch on the page");
        eventually("the page's epoch to advance", || {
            let now: u64 = text_of(b, "epoch").parse().ok()?;
            (now > epoch).then_some(())
        });
        eventually("charts with points", || {
            let points = b.eval(
                "return ['chart-rate', 'chart-peers', 'chart-loss'].map(id => \
                 Number(document.getElementById(id).getAttribute('data-points') || 0));",
            );
            let points: Vec<u64> = serde_json::from_value(points).ok()?;
            points.iter().all(|n| *n >= 3).then_some(())
        });
    }

    // The JSON against the peers' actual state, once they stop training.
    rt.block_on(async {
        for p in &mut peers {
            p.pause().await;
        }
    });
    let epochs: Vec<u64> = peers
        .iter()
        .map(|p| p.tracker.local_progress().epoch)
        .collect();
    // The global epoch by the progress core's rule lies within the epochs of the peers that
    // are not clients (the fourth is one).
    let (lo, hi) = (
        epochs[..3].iter().min().copied(),
        epochs.iter().max().copied(),
    );
    eventually("/api/state to match the peers' state", || {
        let s = state(addr);
        let all = s["peers"].as_array()?;
        let matches = ids.iter().zip(&epochs).all(|(id, epoch)| {
            all.iter()
                .any(|p| p["peer_id"] == id.as_str() && p["epoch"] == *epoch)
        });
        let global = s["global"]["epoch"].as_u64();
        (matches && global >= lo && global <= hi && s["global"]["num_peers"] == 4).then_some(())
    });

    // A peer leaves: shown as gone, in the JSON and on the page.
    let leaving = peers.remove(0);
    rt.block_on(leaving.leave());
    eventually("the peer that left to be gone in /api/state", || {
        let s = state(addr);
        let gone = s["peers"]
            .as_array()?
            .iter()
            .any(|p| p["peer_id"] == ids[0].as_str() && p["status"] == "gone");
        (gone && s["global"]["num_peers"] == 3).then_some(())
    });
    if let Some(b) = &browser {
        eventually("the row of the peer that left to say gone", || {
            let rows = rows(b);
            let gone = rows.iter().any(|r| r.0 == ids[0] && r.1 == "gone");
            (gone && text_of(b, "peers") == "3").then_some(())
        });
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("monitor-browser.png");
        b.screenshot(&path);
        println!("screenshot: {}", path.display());
    }
    drop(browser.take());

    rt.block_on(async {
        monitor.shutdown().await.unwrap();
        for p in peers {
            p.leave().await;
        }
        drop(boot);
    });
}
