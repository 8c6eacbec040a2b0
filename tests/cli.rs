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
