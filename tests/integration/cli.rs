//! The `hivemesh` binary, run as a separate process: output contract and argument errors.
//!
//! Every wait on a child process here ends ([`procs::LIMIT`]), every child is killed and reaped
//! if its test fails first, and every pipe is drained, so a stuck or chatty child fails its test
//! instead of hanging the run.

use std::process::Command;

mod procs {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
    use std::sync::mpsc::{self, RecvTimeoutError};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    /// The most one wait takes before it fails the test: far beyond what any of these commands
    /// needs on a loaded 2-core machine; only a hung child reaches it.
    pub const LIMIT: Duration = Duration::from_secs(300);

    /// A running child with piped stdio. Its stdout arrives line by line through a thread, its
    /// stderr is drained by another (a full pipe cannot block it). Killed and reaped on drop.
    pub struct Proc {
        child: Child,
        lines: mpsc::Receiver<String>,
        /// stderr, line by line, as the drain thread reads it.
        err_lines: mpsc::Receiver<String>,
        stderr: Option<JoinHandle<String>>,
    }

    impl Proc {
        pub fn spawn(cmd: &mut Command) -> Self {
            let mut child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("{cmd:?} starts: {e}"));
            let stdout = child.stdout.take().expect("piped stdout");
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            });
            let err = child.stderr.take().expect("piped stderr");
            let (err_tx, err_lines) = mpsc::channel();
            let stderr = std::thread::spawn(move || {
                let mut all = String::new();
                let mut err = BufReader::new(err);
                let mut line = Vec::new();
                while matches!(err.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                    let text = String::from_utf8_lossy(&line).into_owned();
                    all.push_str(&text);
                    let _ = err_tx.send(text);
                    line.clear();
                }
                all
            });
            Self {
                child,
                lines,
                err_lines,
                stderr: Some(stderr),
            }
        }

        /// The first stderr line (from the start) that contains `needle`; fails the test if
        /// none comes within [`LIMIT`] or the process closes stderr first.
        pub fn stderr_line_with(&mut self, needle: &str) -> String {
            let deadline = Instant::now() + LIMIT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match self.err_lines.recv_timeout(left) {
                    Ok(line) if line.contains(needle) => return line.trim_end().to_owned(),
                    Ok(_) => {}
                    Err(RecvTimeoutError::Timeout) => {
                        panic!("no stderr line with {needle:?} within {LIMIT:?}")
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        panic!("stderr closed without a line with {needle:?}")
                    }
                }
            }
        }

        pub fn id(&self) -> u32 {
            self.child.id()
        }

        pub fn stdin(&mut self) -> &mut ChildStdin {
            self.child.stdin.as_mut().expect("piped stdin")
        }

        /// The next stdout line; fails the test if none comes within [`LIMIT`].
        pub fn next_line(&mut self) -> String {
            match self.lines.recv_timeout(LIMIT) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => panic!("no output within {LIMIT:?}"),
                Err(RecvTimeoutError::Disconnected) => {
                    let status = self.wait();
                    panic!("the process ended ({status}) without another line")
                }
            }
        }

        /// Sends `signal` (a `kill` name: `INT`, `KILL`, ...).
        pub fn signal(&self, signal: &str) {
            let ok = Command::new("kill")
                .args([&format!("-{signal}"), &self.id().to_string()])
                .status()
                .expect("kill runs")
                .success();
            assert!(ok, "kill -{signal} {}", self.id());
        }

        /// Waits for the child to exit; fails the test after [`LIMIT`] (the drop kills it).
        pub fn wait(&mut self) -> ExitStatus {
            let deadline = Instant::now() + LIMIT;
            loop {
                if let Some(status) = self.child.try_wait().expect("try_wait") {
                    return status;
                }
                assert!(
                    Instant::now() < deadline,
                    "the process did not exit within {LIMIT:?}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }

        /// Waits for the child to exit: its status, the stdout lines not read yet, its stderr.
        pub fn finish(mut self) -> (ExitStatus, String, String) {
            let status = self.wait();
            let mut stdout = String::new();
            loop {
                match self.lines.recv_timeout(LIMIT) {
                    Ok(line) => {
                        stdout.push_str(&line);
                        stdout.push('\n');
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => panic!("stdout stayed open after exit"),
                }
            }
            let stderr = self
                .stderr
                .take()
                .map(|h| h.join().unwrap_or_default())
                .unwrap_or_default();
            (status, stdout, stderr)
        }
    }

    impl Drop for Proc {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Runs `cmd` to the end (stdin closed): exit code (`None`: killed by a signal), stdout,
    /// stderr.
    pub fn output(cmd: &mut Command) -> (Option<i32>, String, String) {
        let mut p = Proc::spawn(cmd);
        drop(p.child.stdin.take());
        let (status, stdout, stderr) = p.finish();
        (status.code(), stdout, stderr)
    }
}

fn hivemesh(args: &[&str]) -> (bool, String, String) {
    let (code, stdout, stderr) = hivemesh_code(args);
    (code == Some(0), stdout, stderr)
}

/// Runs the binary; returns its exit code (`None`: killed by a signal), stdout and stderr.
fn hivemesh_code(args: &[&str]) -> (Option<i32>, String, String) {
    procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args(args))
}

/// The `key=value` fields of `line` after its first word, which must be `word`.
fn key_values<'a>(line: &'a str, word: &str) -> Vec<(&'a str, &'a str)> {
    let mut fields = line.split(' ');
    assert_eq!(fields.next(), Some(word), "{line}");
    fields
        .map(|f| {
            f.split_once('=')
                .unwrap_or_else(|| panic!("'{f}' is not key=value in: {line}"))
        })
        .collect()
}

/// Parses the last line `sim peers=N ok=K max_abs_err=E`.
fn summary(stdout: &str) -> (usize, usize, f64) {
    let last = stdout.lines().last().expect("some output");
    let fields: Vec<&str> = last.split(' ').collect();
    assert_eq!(fields.len(), 4, "summary line: {last}");
    assert_eq!(fields[0], "sim");
    let value = |i: usize, key: &str| {
        fields[i]
            .strip_prefix(key)
            .unwrap_or_else(|| panic!("{key} in {last}"))
            .to_owned()
    };
    (
        value(1, "peers=").parse().unwrap(),
        value(2, "ok=").parse().unwrap(),
        value(3, "max_abs_err=").parse().unwrap(),
    )
}

#[test]
fn sim_prints_one_line_per_peer_and_the_summary() {
    let (ok, stdout, stderr) = hivemesh(&["sim", "--peers", "8", "--mib", "1"]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout.lines().count(), 9, "{stdout}");
    let (peers, finished, err) = summary(&stdout);
    assert_eq!((peers, finished), (8, 8));
    assert!(err < 1e-5, "{stdout}");
}

#[test]
fn sim_survives_each_fault() {
    for (fault, expect_ok) in [
        ("fail-sending@0", 8),
        ("slow-reducing@1", 8),
        ("fail-before@2", 7),
        ("cancel@3", 7),
    ] {
        let (ok, stdout, stderr) = hivemesh(&[
            "sim", "--peers", "8", "--mib", "1", "--fault", fault, "--seed", "9",
        ]);
        assert!(ok, "{fault}: {stderr}");
        let (_, finished, err) = summary(&stdout);
        assert_eq!(finished, expect_ok, "{fault}: {stdout}");
        assert!(err < 1e-5, "{fault}: {stdout}");
    }
}

#[test]
fn sim_with_clients_aux_and_compression() {
    let (ok, stdout, stderr) = hivemesh(&[
        "sim",
        "--peers",
        "6",
        "--mib",
        "0.5",
        "--clients",
        "2",
        "--aux",
        "1",
        "--compression",
        "float16",
        "--part-bytes",
        "65536",
    ]);
    assert!(ok, "{stderr}");
    let (_, finished, err) = summary(&stdout);
    assert_eq!(finished, 6, "{stdout}");
    // float16 error on values around 1-2: well under 1e-2, above exact.
    assert!(err > 0.0 && err < 1e-2, "{stdout}");
    assert!(stdout.contains("mode=aux") && stdout.contains("mode=client"));
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    for (args, needle) in [
        (vec!["sim", "--peers", "0"], "--peers must be at least 1"),
        (
            vec!["sim", "--fault", "explode@1"],
            "unknown fault 'explode'",
        ),
        (vec!["sim", "--fault", "fail-before"], "KIND@PEER"),
        (
            vec!["sim", "--peers", "2", "--fault", "cancel@5"],
            "there are 2 peers",
        ),
        (
            vec!["sim", "--compression", "zip"],
            "unknown compression 'zip'",
        ),
        (vec!["sim", "--mib=-1"], "--mib must be between 0 and 4096"),
        (
            vec!["sim", "--part-bytes", "0"],
            "--part-bytes must be at least 1",
        ),
        (
            vec!["sim", "--peers", "2", "--clients", "3"],
            "exceed --peers",
        ),
        (vec!["frobnicate"], "unrecognized subcommand"),
        (
            vec!["bench", "allreduce", "--device", "tpu"],
            "invalid value 'tpu'",
        ),
    ]
    .into_iter()
    .chain(no_gpu_bench())
    {
        let (ok, _, stderr) = hivemesh(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// A GPU bench where it cannot run says what is missing: the `cuda` feature, or (in a build
/// with it) a device. Nothing to check on a machine with a GPU and the feature.
fn no_gpu_bench() -> Option<(Vec<&'static str>, &'static str)> {
    let args = vec![
        "bench",
        "allreduce",
        "--device",
        "cuda",
        "--peers",
        "2",
        "--mib",
        "1",
    ];
    #[cfg(feature = "cuda")]
    return hivemesh::cuda::device_count()
        .is_err()
        .then_some((args, "--device cuda: no CUDA device here"));
    #[cfg(not(feature = "cuda"))]
    Some((args, "built with the cuda feature"))
}

/// `HIVEMESH_TIMELINE` makes the demo write a Chrome trace-event file: valid JSON, closed,
/// with every node's matchmaking, linking, round and apply spans for each round, and for each
/// part a member sent, the matching receive and handling on the other side's lane.
#[test]
fn the_demo_writes_a_timeline() {
    let dir = std::env::temp_dir().join(format!("hivemesh-timeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("trace-{pid}.json");
    let (code, stdout, stderr) = procs::output(
        std::process::Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .args([
                "demo",
                "--peers",
                "4",
                "--group-size",
                "2",
                "--size",
                "1000",
                "--quiet",
            ])
            .env("HIVEMESH_TIMELINE", &path),
    );
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one file per process, {{pid}} replaced");
    let name = files[0].file_name().into_string().unwrap();
    assert!(
        !name.contains("{pid}") && name.starts_with("trace-"),
        "{name}"
    );
    let text = std::fs::read_to_string(files[0].path()).unwrap();
    let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON array");
    let lanes: std::collections::HashMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            let tid = e["tid"].as_u64().unwrap();
            (tid, e["args"]["name"].as_str().unwrap().to_owned())
        })
        .collect();
    let spans: Vec<(String, String)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            assert!(
                e["ts"].as_f64().is_some() && e["dur"].as_f64().unwrap() >= 0.0,
                "{e}"
            );
            let lane = lanes[&e["tid"].as_u64().unwrap()].clone();
            (lane, e["name"].as_str().unwrap().to_owned())
        })
        .collect();
    // Two rounds (one per grid dimension) on each of the four nodes.
    for step in ["matchmaking", "linking", "round", "apply"] {
        let per_node = spans
            .iter()
            .filter(|(lane, name)| name == step && !lane.contains('↔'))
            .fold(
                std::collections::HashMap::<&str, usize>::new(),
                |mut m, (lane, _)| {
                    *m.entry(lane.as_str()).or_default() += 1;
                    m
                },
            );
        assert_eq!(per_node.len(), 4, "{step}: {per_node:?}");
        assert!(per_node.values().all(|&n| n == 2), "{step}: {per_node:?}");
    }
    // Lanes are "node A ↔ member i B": a part A sent to B shows up on B's lane for A as
    // received and handled.
    let mut checked = 0;
    for (lane, name) in &spans {
        let Some(part) = name.strip_prefix("send part ") else {
            continue;
        };
        let (a, rest) = lane
            .strip_prefix("node ")
            .unwrap()
            .split_once(" ↔ member ")
            .unwrap();
        let b = rest.rsplit(' ').next().unwrap();
        let back = |what: &str| {
            spans.iter().any(|(l, n)| {
                l.starts_with(&format!("node {b} ↔ "))
                    && l.ends_with(&format!(" {a}"))
                    && n == &format!("{what} part {part}")
            })
        };
        assert!(back("receive"), "{lane}: {name} never received");
        assert!(back("handle"), "{lane}: {name} never handled");
        // And the average came back: sent on B's lane for A, received and handled on A's.
        let sent_back = spans.iter().any(|(l, n)| {
            l.starts_with(&format!("node {b} ↔ "))
                && l.ends_with(&format!(" {a}"))
                && n == &format!("send average {part}")
        });
        let got_back = |what: &str| {
            spans
                .iter()
                .any(|(l, n)| l == lane && n == &format!("{what} average {part}"))
        };
        assert!(
            sent_back && got_back("receive") && got_back("handle"),
            "{lane}: {name}"
        );
        checked += 1;
    }
    // 1,000 values are one part, reduced by one member of each pair: in each of the two
    // rounds, the other member of each of the two pairs sends it.
    assert_eq!(checked, 4, "parts sent");
    let _ = std::fs::remove_dir_all(&dir);
}

mod dht {
    use super::procs::{self, Proc};
    use std::process::Command;

    /// Starts `hivemesh dht` and returns it with its first printed address (it prints once it
    /// is listening and, with --initial-peer, connected).
    pub(super) fn start(args: &[&str]) -> (Proc, String) {
        let mut child = Proc::spawn(
            Command::new(env!("CARGO_BIN_EXE_hivemesh"))
                .arg("dht")
                .args(args),
        );
        let line = child.next_line();
        (child, line.trim().to_owned())
    }

    /// Ctrl-C: whether it then exits cleanly (within [`procs::LIMIT`]).
    pub(super) fn interrupt(child: &mut Proc) -> bool {
        child.signal("INT");
        child.wait().success()
    }

    #[test]
    fn second_node_joins_the_first_and_both_stop_on_ctrl_c() {
        let (mut first, addr) = start(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
        assert!(
            addr.starts_with("/ip4/127.0.0.1/tcp/") && addr.contains("/p2p/12D3"),
            "{addr}"
        );
        let key = std::env::temp_dir().join(format!("hivemesh-cli-{}.key", std::process::id()));
        let _ = std::fs::remove_file(&key);
        let id = key.to_str().unwrap();
        let args = [
            "--listen",
            "/ip4/127.0.0.1/udp/0/quic-v1",
            "--initial-peer",
            &addr,
            "--identity",
            id,
        ];
        let (mut second, addr2) = start(&args);
        assert!(addr2.contains("/quic-v1/p2p/"), "{addr2}");
        assert!(interrupt(&mut second), "clean exit on Ctrl-C");
        // Restarted with the same identity file: same peer id.
        let (mut again, addr3) = start(&args);
        let peer = |a: &str| a.rsplit('/').next().unwrap().to_owned();
        assert_eq!(peer(&addr2), peer(&addr3));
        assert!(interrupt(&mut again));
        assert!(interrupt(&mut first));
        let _ = std::fs::remove_file(&key);
    }

    /// SIGTERM (what `docker stop` and service managers send) stops a DHT node as cleanly as
    /// Ctrl-C: exit status 0 after "shutting down".
    #[test]
    fn sigterm_stops_a_dht_node_cleanly() {
        let (node, addr) = start(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
        assert!(addr.contains("/p2p/"), "{addr}");
        node.signal("TERM");
        let (status, _, stderr) = node.finish();
        assert!(status.success(), "{status}: {stderr}");
        assert!(stderr.contains("shutting down"), "{stderr}");
    }

    /// `--metrics ADDR` serves Prometheus text at `/metrics`: the swarm's gauges move when a
    /// second node joins, other paths get 404, and the node still stops cleanly.
    #[test]
    fn dht_node_serves_metrics() {
        let (mut node, addr) = start(&[
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--metrics",
            "127.0.0.1:0",
        ]);
        let line = node.stderr_line_with("metrics at http://");
        let url = line.rsplit(' ').next().unwrap();
        let host = url
            .strip_prefix("http://")
            .and_then(|u| u.strip_suffix("/metrics"))
            .unwrap_or_else(|| panic!("{line}"))
            .to_owned();
        let get = |path: &str| {
            use std::io::{Read as _, Write as _};
            let mut s = std::net::TcpStream::connect(&host).unwrap();
            s.set_read_timeout(Some(procs::LIMIT)).unwrap();
            write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answer
        };
        let before = get("/metrics");
        assert!(before.starts_with("HTTP/1.1 200 OK"), "{before}");
        assert!(
            before.contains("\nhivemesh_connected_peers 0\n"),
            "{before}"
        );
        assert!(before.contains("\nhivemesh_dht_records "), "{before}");
        assert!(
            before.contains("\nhivemesh_rounds_total{result=\"ok\"} 0\n"),
            "{before}"
        );
        assert!(before.trim_end().ends_with("# EOF"), "{before}");
        assert!(get("/").starts_with("HTTP/1.1 404"));

        let (mut second, _) = start(&["--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peer", &addr]);
        // The second node is connected once it prints its address; the gauge follows at the
        // first node's next event, so scrape until it shows (bounded by the limit).
        let deadline = std::time::Instant::now() + procs::LIMIT;
        loop {
            let now = get("/metrics");
            if now.contains("\nhivemesh_connected_peers 1\n") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{now}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(interrupt(&mut second));
        assert!(interrupt(&mut node));
    }

    /// `hivemesh swarm-key` writes a key (owner-only, never over an existing file); a DHT node
    /// run with it takes a member holding the same key and refuses one without it, which exits
    /// with an error naming the cause; a missing key file is a clear error.
    #[test]
    fn private_swarm_from_the_cli() {
        let dir = std::env::temp_dir().join(format!("hivemesh-cli-psk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("swarm.key");
        let key_arg = key.to_str().unwrap();
        let (code, stdout, stderr) = procs::output(
            Command::new(env!("CARGO_BIN_EXE_hivemesh")).args(["swarm-key", key_arg]),
        );
        assert_eq!(code, Some(0), "{stdout}{stderr}");
        assert!(stdout.contains("fingerprint"), "{stdout}");
        let text = std::fs::read_to_string(&key).unwrap();
        assert!(
            text.starts_with("/key/swarm/psk/1.0.0/\n/base16/\n"),
            "{text}"
        );
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&key).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let (code, _, stderr) = procs::output(
            Command::new(env!("CARGO_BIN_EXE_hivemesh")).args(["swarm-key", key_arg]),
        );
        assert_ne!(code, Some(0));
        assert!(stderr.contains("exists"), "{stderr}");
        assert_eq!(
            std::fs::read_to_string(&key).unwrap(),
            text,
            "not overwritten"
        );

        let (mut first, addr) =
            start(&["--listen", "/ip4/127.0.0.1/tcp/0", "--swarm-key", key_arg]);
        let (mut member, _) = start(&[
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--initial-peer",
            &addr,
            "--swarm-key",
            key_arg,
        ]);
        let (code, stdout, stderr) =
            procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
                "dht",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--initial-peer",
                &addr,
            ]));
        assert_eq!(code, Some(1), "{stdout}{stderr}");
        assert!(stdout.is_empty(), "an outsider prints no address: {stdout}");
        assert!(stderr.contains("every initial peer failed"), "{stderr}");
        assert!(interrupt(&mut member));
        assert!(interrupt(&mut first));

        let (code, _, stderr) = procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
            "dht",
            "--swarm-key",
            dir.join("missing.key").to_str().unwrap(),
        ]));
        assert_ne!(code, Some(0));
        assert!(stderr.contains("swarm key file"), "{stderr}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `--max-memory-mib`: a node over its limit (1 MiB: any process is) refuses the next peer,
    /// whose start then fails; the same peer joins a node without the flag.
    #[test]
    fn a_node_over_its_memory_limit_takes_no_peers() {
        let join = |addr: &str| {
            procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
                "dht",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--initial-peer",
                addr,
            ]))
        };
        let (mut limited, addr) =
            start(&["--listen", "/ip4/127.0.0.1/tcp/0", "--max-memory-mib", "1"]);
        let (code, stdout, stderr) = join(&addr);
        assert_eq!(code, Some(1), "{stdout}{stderr}");
        assert!(stderr.contains("every initial peer failed"), "{stderr}");
        assert!(interrupt(&mut limited));
        let (mut open, addr) = start(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
        let (mut member, _) = start(&["--listen", "/ip4/127.0.0.1/tcp/0", "--initial-peer", &addr]);
        assert!(interrupt(&mut member));
        assert!(interrupt(&mut open));
    }

    /// `hivemesh monitor` beside a DHT node: prints its page's URL, serves the page, its
    /// script and `/api/state` (an empty run: no peers yet), and stops on Ctrl-C.
    #[test]
    fn monitor_serves_its_page_and_json_then_stops_on_ctrl_c() {
        let (mut node, addr) = start(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
        let mut monitor = Proc::spawn(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
            "monitor",
            "--initial-peer",
            &addr,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--http",
            "127.0.0.1:0",
            "--run-id",
            "cli_run",
            "--refresh",
            "0.2",
        ]));
        let url = monitor.next_line();
        let host = url
            .trim()
            .strip_prefix("http://")
            .and_then(|u| u.strip_suffix('/'))
            .unwrap_or_else(|| panic!("{url}"))
            .to_owned();
        let get = |path: &str| {
            use std::io::{Read as _, Write as _};
            let mut s = std::net::TcpStream::connect(&host).unwrap();
            s.set_read_timeout(Some(procs::LIMIT)).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answer
        };
        let page = get("/");
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(page.contains("<title>hivemesh monitor</title>"), "{page}");
        assert!(
            page.to_ascii_lowercase()
                .contains("content-security-policy: default-src 'none'")
        );
        assert!(get("/app.js").contains("textContent"));
        let deadline = std::time::Instant::now() + procs::LIMIT;
        let json = loop {
            let answer = get("/api/state");
            let body = answer
                .split("\r\n\r\n")
                .nth(1)
                .unwrap_or_default()
                .to_owned();
            let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if json["fetches"].as_u64().is_some_and(|n| n > 0) {
                break json;
            }
            assert!(std::time::Instant::now() < deadline, "{answer}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert_eq!(json["run_id"], "cli_run");
        assert_eq!(json["peers"], serde_json::json!([]));
        assert_eq!(json["global"]["num_peers"], 0);
        assert!(get("/nope").starts_with("HTTP/1.1 404"));
        assert!(interrupt(&mut monitor));
        assert!(interrupt(&mut node));
    }

    /// Bad `hivemesh monitor` flags fail at once, saying what is wrong.
    #[test]
    fn bad_monitor_flags_fail_clearly() {
        let peer = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEyoppNCUx8Yx66oV9fJnriXwCcXwDDUA2kj6vnc6iDEp";
        for (args, needle) in [
            (vec!["monitor"], "--initial-peer <MADDR>"),
            (
                vec!["monitor", "--initial-peer", "nonsense"],
                "invalid value 'nonsense'",
            ),
            (
                vec!["monitor", "--initial-peer", peer, "--http", "localhost"],
                "invalid value 'localhost' for '--http <ADDR>'",
            ),
            (
                vec!["monitor", "--initial-peer", peer, "--refresh", "0"],
                "--refresh must be between",
            ),
            (
                vec!["monitor", "--initial-peer", peer, "--run-id", ""],
                "--run-id must not be empty",
            ),
            (
                vec!["monitor", "--initial-peer", peer, "--max-peers", "0"],
                "--max-peers and --history must be at least 1",
            ),
            (
                vec![
                    "monitor",
                    "--initial-peer",
                    peer,
                    "--target-batch-size",
                    "0",
                ],
                "--target-batch-size must be at least 1",
            ),
            (
                vec![
                    "monitor",
                    "--initial-peer",
                    "/ip4/127.0.0.1/tcp/9",
                    "--http",
                    "127.0.0.1:0",
                ],
                "must end with /p2p/<peer id>",
            ),
        ] {
            let (code, _, stderr) =
                procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args(&args));
            assert_ne!(code, Some(0), "{args:?} should fail");
            assert!(stderr.contains(needle), "{args:?}: {stderr}");
        }
    }

    #[test]
    fn bad_initial_peer_is_an_error() {
        let (code, _, stderr) = procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
            "dht",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--initial-peer",
            "/ip4/127.0.0.1/tcp/9",
        ]));
        assert_ne!(code, Some(0));
        assert!(stderr.contains("must end with /p2p/<peer id>"), "{stderr}");
    }
}

mod bench {
    use super::procs::{self, Proc};
    use std::io::Write;
    use std::process::Command;

    /// Runs a small `bench allreduce` over `transport` and checks its one line.
    fn bench_line(transport: &str) {
        let (code, stdout, stderr) = procs::output(
            Command::new(env!("CARGO_BIN_EXE_hivemesh"))
                .args(["bench", "allreduce", "--peers", "3", "--mib", "2"])
                .args(["--rounds", "2", "--transport", transport]),
        );
        assert_eq!(code, Some(0), "{transport}: {stdout}{stderr}");
        let line = stdout.lines().last().unwrap();
        let keys: Vec<&str> = line
            .split(' ')
            .map(|f| f.split('=').next().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "hivemesh",
                "world",
                "mib",
                "median_s",
                "algbw_gbs",
                "busbw_gbs"
            ],
            "{line}"
        );
        assert!(
            line.starts_with("hivemesh world=3 mib=2 median_s="),
            "{line}"
        );
        let busbw: f64 = line.rsplit('=').next().unwrap().parse().unwrap();
        assert!(busbw > 0.0);
    }

    /// The default carrier: direct TLS links (the workers check every link is TLS and every
    /// result against the exact mean; a failed check fails the bench).
    #[test]
    fn allreduce_bench_prints_its_line() {
        bench_line("tcp");
    }

    /// The fallback carrier, `/hivemesh/part/1` libp2p streams, over QUIC and over TCP.
    #[test]
    fn allreduce_bench_over_libp2p_streams() {
        bench_line("quic");
        bench_line("stream");
    }

    #[test]
    fn unknown_transport_is_refused_clearly() {
        let (code, _, stderr) = procs::output(Command::new(env!("CARGO_BIN_EXE_hivemesh")).args([
            "bench",
            "allreduce",
            "--transport",
            "carrier-pigeon",
        ]));
        assert_ne!(code, Some(0));
        assert!(
            stderr.contains("possible values: tcp, quic, stream"),
            "{stderr}"
        );
    }

    /// 4 worker processes; one is SIGKILLed as soon as its first round starts. The others
    /// finish that round (within their timeouts) with values equal to the weighted mean over
    /// exactly the peers their reports name, and no part left local: the dead reducer's span
    /// was re-reduced by a stand-in, every part of it over exactly the three survivors (a part
    /// of its span can never name it, so three contributors are the survivors).
    #[test]
    fn sigkill_mid_round_leaves_correct_partial_averages() {
        let n = 4;
        let mut workers: Vec<Proc> = (0..n)
            .map(|i| {
                Proc::spawn(
                    Command::new(env!("CARGO_BIN_EXE_hivemesh"))
                        .args(["bench-worker", "--index", &i.to_string(), "--peers", "4"])
                        .args(["--mib", "24", "--rounds", "1", "--part-bytes", "65536"]),
                )
            })
            .collect();
        let roster: Vec<String> = workers
            .iter_mut()
            .map(|w| {
                let line = w.next_line();
                let rest = line.strip_prefix("READY ").unwrap().to_owned();
                rest.replace(' ', "@")
            })
            .collect();
        let roster = format!("ROSTER {}\n", roster.join(" "));
        for w in &mut workers {
            let stdin = w.stdin();
            stdin.write_all(roster.as_bytes()).unwrap();
            stdin.flush().unwrap();
        }
        // Every worker links, then all are told to go (the bench's timing barrier).
        for (i, w) in workers.iter_mut().enumerate() {
            assert_eq!(w.next_line(), "LINKED 0", "worker {i}");
        }
        for w in &mut workers {
            let stdin = w.stdin();
            stdin.write_all(b"GO\n").unwrap();
            stdin.flush().unwrap();
        }
        // Kill worker 3 the moment its round starts.
        assert_eq!(workers[3].next_line(), "START 0");
        workers[3].signal("KILL");
        for (i, w) in workers.iter_mut().enumerate().take(3) {
            assert_eq!(w.next_line(), "START 0");
            let round = w.next_line();
            assert!(round.starts_with("ROUND 0 "), "worker {i}: {round}");
        }
        for (i, w) in workers.iter_mut().enumerate().take(3) {
            let stdin = w.stdin();
            stdin.write_all(b"CHECK\n").unwrap();
            stdin.flush().unwrap();
            let checked = w.next_line();
            let f: Vec<&str> = checked.split(' ').collect();
            assert_eq!(f[0], "CHECKED", "worker {i}: {checked}");
            let err_report: f32 = f[2].parse().unwrap();
            assert!(err_report < 1e-5, "worker {i}: {checked}");
            assert_eq!(f[4], "0", "worker {i}: parts left local: {checked}");
            assert_eq!(f[5], "3", "worker {i}: fewest contributors: {checked}");
        }
    }
}

mod demo {
    use super::{hivemesh, hivemesh_code, key_values};

    /// Checks the stdout of `hivemesh demo`: one `round r: max_dev=E` line per round, then
    /// exactly `demo peers=P rounds=R max_dev=E`. Returns the final deviation.
    fn check_output(stdout: &str, peers: usize, rounds: usize) -> f64 {
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), rounds + 1, "{stdout}");
        for (r, line) in lines[..rounds].iter().enumerate() {
            let dev = line
                .strip_prefix(&format!("round {}: max_dev=", r + 1))
                .unwrap_or_else(|| panic!("round line: {line}"));
            let dev: f64 = dev.parse().unwrap();
            assert!(dev.is_finite() && dev >= 0.0, "{line}");
        }
        let summary = lines[rounds];
        let fields = key_values(summary, "demo");
        let keys: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["peers", "rounds", "max_dev"], "{summary}");
        assert_eq!(fields[0].1, peers.to_string(), "{summary}");
        assert_eq!(fields[1].1, rounds.to_string(), "{summary}");
        let max_dev: f64 = fields[2].1.parse().unwrap();
        // The summary repeats the last round's deviation.
        assert!(lines[rounds - 1].ends_with(&format!("max_dev={}", fields[2].1)));
        max_dev
    }

    /// The README's main command: 16 peers on a 4x4 grid reach the exact mean in 2 rounds.
    #[test]
    fn demo_defaults_reach_the_global_mean() {
        let (ok, stdout, stderr) = hivemesh(&["demo", "--size", "20000"]);
        assert!(ok, "{stdout}{stderr}");
        let max_dev = check_output(&stdout, 16, 2);
        assert!(max_dev < 1e-5, "{stdout}");
    }

    #[test]
    fn demo_flags_change_peers_group_size_and_rounds() {
        let args = [
            "demo",
            "--peers",
            "8",
            "--group-size",
            "2",
            "--rounds",
            "4",
            "--size",
            "1000",
            "--quiet",
        ];
        let (ok, stdout, stderr) = hivemesh(&args);
        assert!(ok, "{stdout}{stderr}");
        // 8 = 2^3: three rounds give the exact mean, a fourth keeps it.
        let max_dev = check_output(&stdout, 8, 4);
        assert!(max_dev < 1e-5, "{stdout}");
    }

    #[test]
    fn bad_demo_flags_fail_with_exit_code_1() {
        for (args, needle) in [
            (
                vec!["demo", "--peers", "15", "--group-size", "4"],
                "--peers 15 is not a power of --group-size 4",
            ),
            (
                vec!["demo", "--group-size", "1"],
                "--group-size must be between 2 and 64",
            ),
            (
                vec!["demo", "--rounds", "0"],
                "--rounds must be between 1 and 100",
            ),
            (vec!["demo", "--size", "0"], "--size must be between"),
        ] {
            let (code, stdout, stderr) = hivemesh_code(&args);
            assert_eq!(code, Some(1), "{args:?}: {stdout}{stderr}");
            assert!(stderr.contains(needle), "{args:?}: {stderr}");
            assert!(stdout.is_empty(), "{args:?}: {stdout}");
        }
    }
}

mod steps {
    use super::{hivemesh, hivemesh_code, key_values};

    /// 4 processes, groups of 2, 2 steps each: every step succeeds (`total` counts steps,
    /// peers × rounds).
    #[test]
    fn steps_bench_prints_its_line_with_every_step_ok() {
        let (ok, stdout, stderr) = hivemesh(&[
            "bench",
            "steps",
            "--peers",
            "4",
            "--group-size",
            "2",
            "--rounds",
            "2",
            "--mib",
            "1",
        ]);
        assert!(ok, "{stdout}{stderr}");
        assert_eq!(stdout.lines().count(), 1, "{stdout}");
        let line = stdout.lines().next().unwrap();
        let fields = key_values(line, "hivemesh_steps");
        let keys: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            ["peers", "group", "ok", "total", "median_step_s"],
            "{line}"
        );
        assert!(
            line.starts_with("hivemesh_steps peers=4 group=2 ok=8 total=8 median_step_s="),
            "{line}"
        );
        let median: f64 = fields[4].1.parse().unwrap();
        assert!(median > 0.0 && median.is_finite(), "{line}");
    }

    #[test]
    fn bad_steps_flags_fail_clearly() {
        for (args, needle) in [
            (
                vec!["bench", "steps", "--peers", "4", "--group-size", "5"],
                "--group-size must be between 2 and --peers",
            ),
            (
                vec!["bench", "steps", "--mib", "0"],
                "--mib must be between",
            ),
        ] {
            let (code, _, stderr) = hivemesh_code(&args);
            assert_eq!(code, Some(1), "{args:?}: {stderr}");
            assert!(stderr.contains(needle), "{args:?}: {stderr}");
        }
    }
}

mod chaos {
    use super::{hivemesh, hivemesh_code, key_values};

    /// 4 processes step in a loop while one is SIGKILLed and replaced after every 3 finished
    /// steps (replacements load state): a majority of the steps average and check out, every
    /// finished step matches the mean of the inputs its report names, a failed step leaves
    /// its tensors, none hangs, and the kills did happen (stderr's summary).
    #[test]
    fn chaos_bench_kills_and_replaces_workers_and_every_step_checks_out() {
        let (ok, stdout, stderr) = hivemesh(&[
            "bench",
            "chaos",
            "--peers",
            "4",
            "--rounds",
            "6",
            "--kill-every",
            "3",
            "--size",
            "20000",
        ]);
        assert!(ok, "{stdout}{stderr}");
        let line = stdout.lines().last().expect("the summary line");
        let fields = key_values(line, "hivemesh_chaos");
        let keys: Vec<&str> = fields.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            ["peers", "rounds", "ok", "wrong", "hung", "max_rss_mb"],
            "{line}"
        );
        let value = |k: &str| -> f64 {
            fields
                .iter()
                .find(|(f, _)| *f == k)
                .unwrap()
                .1
                .parse()
                .unwrap()
        };
        assert_eq!(value("wrong"), 0.0, "{line}");
        assert_eq!(value("hung"), 0.0, "{line}");
        // A majority of the 24 steps averaged with someone and checked out (the bench itself
        // fails otherwise); a failed step left its tensors as they were (else it is wrong).
        assert!(value("ok") >= 13.0, "{line}");
        assert!(value("max_rss_mb") > 0.0, "{line}");
        let kills: usize = stderr
            .lines()
            .filter(|l| l.starts_with("chaos: "))
            .find_map(|l| l.split(" kills").next()?.rsplit(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("no kill count in: {stderr}"));
        assert!(kills >= 7, "24 steps, a kill every 3: {stderr}");
    }

    #[test]
    fn bad_chaos_flags_fail_clearly() {
        let (code, _, stderr) =
            hivemesh_code(&["bench", "chaos", "--peers", "3", "--group-size", "4"]);
        assert_eq!(code, Some(1), "{stderr}");
        assert!(
            stderr.contains("--group-size must be between 2 and --peers"),
            "{stderr}"
        );
    }
}

/// The examples, run from `target/<profile>/examples/` next to the binary. `cargo test` builds
/// them; a run that did not (e.g. `cargo test --test integration`) fails these tests and says how to
/// build them, rather than passing without running anything.
mod examples {
    use super::procs::{self, Proc};
    use std::path::PathBuf;
    use std::process::Command;

    fn example(name: &str) -> PathBuf {
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_hivemesh"));
        let path = bin
            .parent()
            .expect("a bin directory")
            .join("examples")
            .join(name);
        assert!(
            path.exists(),
            "{} is not built: run `cargo test` (which builds the examples) or `cargo build --examples` first",
            path.display()
        );
        path
    }

    fn final_losses(stdout: &str) -> (f64, f64) {
        let loss = |prefix: &str| -> f64 {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no '{prefix}' line in {stdout}"));
            let value = line.split("loss=").nth(1).unwrap();
            value.split(' ').next().unwrap().parse().unwrap()
        };
        (loss("final: decentralized"), loss("final: baseline      "))
    }

    /// The training example converges like the single-process baseline, with async peers and
    /// with blocking ones.
    #[test]
    fn training_example_matches_the_baseline() {
        let training = example("training");
        for extra in [&[][..], &["--blocking", "--peers", "3"][..]] {
            let (code, stdout, stderr) = procs::output(Command::new(&training).args(extra));
            assert_eq!(code, Some(0), "{extra:?}: {stdout}{stderr}");
            let epochs = stdout.lines().filter(|l| l.starts_with("epoch ")).count();
            assert_eq!(epochs, 10, "{stdout}");
            let (loss, baseline) = final_losses(&stdout);
            assert!(loss <= 1.05 * baseline, "{extra:?}: {stdout}");
            let spread: f64 = stdout
                .lines()
                .find_map(|l| l.strip_prefix("final: max distance between peers' parameters = "))
                .unwrap_or_else(|| panic!("no distance line in {stdout}"))
                .parse()
                .unwrap();
            assert!(spread < 1e-4, "{stdout}");
        }
    }

    /// `--adaptive-timeouts` bounds are checked as the core checks them, before anything
    /// starts.
    #[test]
    fn join_example_refuses_adaptive_timeouts_the_core_would_not_take() {
        let join = example("join");
        for bad in ["5,1,3", "1,60,0.5", "0,60,3", "1,60", "fast"] {
            // The bad value comes first: clap stops at the first argument it cannot parse.
            let out = Command::new(&join)
                .args(["--adaptive-timeouts", bad])
                .args(["--initial-peer", "/ip4/127.0.0.1/tcp/1"])
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{bad}: {stderr}");
            assert!(stderr.contains("--adaptive-timeouts"), "{bad}: {stderr}");
        }
    }

    /// The two-terminal example: a `hivemesh dht` node and three `join` processes that find
    /// each other through it and average their vectors to the mean of all three.
    #[test]
    fn join_example_averages_through_a_dht_node() {
        let join = example("join");
        let (mut dht, addr) = super::dht::start(&["--listen", "/ip4/127.0.0.1/tcp/0"]);
        let peers: Vec<Proc> = (0..3)
            .map(|i| {
                Proc::spawn(
                    Command::new(&join)
                        .args([
                            "--initial-peer",
                            &addr,
                            "--group-size",
                            "3",
                            "--rounds",
                            "2",
                        ])
                        .args(["--seed", &i.to_string(), "--timeout", "60"])
                        // One peer derives its timeouts from rates and gaps: it averages with
                        // the others all the same.
                        .args(if i == 0 {
                            &["--adaptive-timeouts", "1,60,3"][..]
                        } else {
                            &[][..]
                        }),
                )
            })
            .collect();
        let outputs: Vec<_> = peers.into_iter().map(Proc::finish).collect();
        assert!(super::dht::interrupt(&mut dht));
        let outputs: Vec<String> = outputs
            .into_iter()
            .map(|(status, stdout, stderr)| {
                assert!(status.success(), "{stdout}{stderr}");
                stdout
            })
            .collect();
        let mean_of = |line: &str| -> f64 {
            let m = line.split("mean=").nth(1).unwrap();
            m.split(' ').next().unwrap().parse().unwrap()
        };
        let initial: Vec<f64> = outputs
            .iter()
            .map(|o| {
                let first = o.lines().next().unwrap();
                assert!(first.starts_with("peer 12D3"), "{o}");
                mean_of(first)
            })
            .collect();
        let global = initial.iter().sum::<f64>() / 3.0;
        for o in &outputs {
            let rounds: Vec<&str> = o.lines().skip(1).collect();
            assert_eq!(rounds.len(), 2, "{o}");
            for (r, line) in rounds.iter().enumerate() {
                assert!(
                    line.starts_with(&format!("round {}: group=3 mean=", r + 1)),
                    "{o}"
                );
                // Printed with 4 decimals: the inputs' rounding adds up to 1e-4.
                assert!((mean_of(line) - global).abs() < 2e-4, "{o} vs {global}");
            }
        }
    }
}
