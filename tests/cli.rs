//! The `hivemesh` binary, run as a separate process: output contract and argument errors.

use std::process::Command;

fn hivemesh(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
        .args(args)
        .output()
        .expect("the hivemesh binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
    ] {
        let (ok, _, stderr) = hivemesh(&args);
        assert!(!ok, "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

mod dht {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Command, Stdio};

    /// Starts `hivemesh dht` and returns it with its first printed address.
    fn start(args: &[&str]) -> (Child, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .arg("dht")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("hivemesh dht starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        // Blocks until the node prints its first address (it does so once it is listening and,
        // with --initial-peer, connected).
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("reads an address");
        (child, line.trim().to_owned())
    }

    fn interrupt(child: &mut Child) -> bool {
        let status = Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        child.wait().expect("child exits").success()
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

    #[test]
    fn bad_initial_peer_is_an_error() {
        let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .args([
                "dht",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--initial-peer",
                "/ip4/127.0.0.1/tcp/9",
            ])
            .output()
            .unwrap();
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("must end with /p2p/<peer id>"));
    }
}

mod bench {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, ChildStdout, Command, Stdio};

    /// Runs a small `bench allreduce` over `transport` and checks its one line.
    fn bench_line(transport: &str) {
        let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .args(["bench", "allreduce", "--peers", "3", "--mib", "2"])
            .args(["--rounds", "2", "--transport", transport])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{transport}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
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
        let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .args(["bench", "allreduce", "--transport", "carrier-pigeon"])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("possible values: tcp, quic, stream"),
            "{stderr}"
        );
    }

    struct Worker {
        child: Child,
        lines: std::io::Lines<BufReader<ChildStdout>>,
    }

    impl Worker {
        fn next_line(&mut self) -> String {
            self.lines
                .next()
                .expect("worker output")
                .expect("utf-8 line")
        }
    }

    impl Drop for Worker {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// 4 worker processes; one is SIGKILLed as soon as its first round starts. The others
    /// finish that round (within their timeouts) with values equal to the weighted mean over
    /// exactly the peers their reports name.
    #[test]
    fn sigkill_mid_round_leaves_correct_partial_averages() {
        let n = 4;
        let mut workers: Vec<Worker> = (0..n)
            .map(|i| {
                let mut child = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
                    .args(["bench-worker", "--index", &i.to_string(), "--peers", "4"])
                    .args(["--mib", "24", "--rounds", "1", "--part-bytes", "65536"])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap();
                let lines = BufReader::new(child.stdout.take().unwrap()).lines();
                Worker { child, lines }
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
            let stdin = w.child.stdin.as_mut().unwrap();
            stdin.write_all(roster.as_bytes()).unwrap();
            stdin.flush().unwrap();
        }
        // Kill worker 3 the moment its round starts.
        assert_eq!(workers[3].next_line(), "START 0");
        let pid = workers[3].child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-KILL", &pid])
                .status()
                .unwrap()
                .success()
        );
        for (i, w) in workers.iter_mut().enumerate().take(3) {
            assert_eq!(w.next_line(), "START 0");
            let round = w.next_line();
            assert!(round.starts_with("ROUND 0 "), "worker {i}: {round}");
        }
        for (i, w) in workers.iter_mut().enumerate().take(3) {
            let stdin = w.child.stdin.as_mut().unwrap();
            stdin.write_all(b"CHECK\n").unwrap();
            stdin.flush().unwrap();
            let checked = w.next_line();
            let f: Vec<&str> = checked.split(' ').collect();
            assert_eq!(f[0], "CHECKED", "worker {i}: {checked}");
            let err_report: f32 = f[2].parse().unwrap();
            assert!(err_report < 1e-5, "worker {i}: {checked}");
        }
    }
}
