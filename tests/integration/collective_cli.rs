//! `hivemesh bench collective` as a user runs it: real processes, every op, every result
//! verified by the workers; and a member SIGKILLed mid-operation for each op.

use std::process::Command;

const OPS: [&str; 4] = ["all-reduce", "all-gather", "broadcast", "reduce-scatter"];

fn hivemesh(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
        .args(args)
        .output()
        .expect("running hivemesh");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn every_op_prints_its_line_with_verified_results() {
    for op in OPS {
        let (code, stdout, stderr) = hivemesh(&[
            "bench",
            "collective",
            "--op",
            op,
            "--peers",
            "3",
            "--mib",
            "3",
            "--rounds",
            "1",
        ]);
        // The workers check every result; a wrong one fails the command.
        assert_eq!(code, Some(0), "{op}: {stdout}{stderr}");
        let line = stdout.lines().last().expect("one line");
        let keys: Vec<&str> = line
            .split(' ')
            .map(|f| f.split('=').next().unwrap())
            .collect();
        assert_eq!(
            keys,
            [
                "hivemesh_collective",
                "op",
                "world",
                "mib",
                "median_s",
                "algbw_gbs",
                "busbw_gbs"
            ],
            "{line}"
        );
        assert!(
            line.starts_with(&format!(
                "hivemesh_collective op={op} world=3 mib=3 median_s="
            )),
            "{line}"
        );
        let busbw: f64 = line.rsplit('=').next().unwrap().parse().unwrap();
        assert!(busbw > 0.0 && busbw.is_finite(), "{line}");
    }
}

/// For each op, member 2 of 4 kills itself with SIGKILL once it has written 1 MiB of the
/// operation (so mid-operation, however the machine schedules it). The bench fails unless
/// every survivor ends that operation with an error naming exactly member 2, the survivors
/// shrink the group to 3, and the operation then runs again among them with every result
/// checked.
#[test]
fn a_member_sigkilled_mid_operation_is_named_and_the_rest_go_on() {
    for op in OPS {
        let (code, stdout, stderr) = hivemesh(&[
            "bench",
            "collective",
            "--op",
            op,
            "--peers",
            "4",
            "--mib",
            "16",
            "--part-bytes",
            "65536",
            "--kill-member",
            "2",
        ]);
        assert_eq!(code, Some(0), "{op}: {stdout}{stderr}");
        assert_eq!(
            stdout.lines().last(),
            Some(
                format!(
                    "hivemesh_collective_kill op={op} world=4 killed=2 named_by=3 shrunk_to=3 after=ok"
                )
                .as_str()
            ),
            "{op}: {stderr}"
        );
    }
}

#[test]
fn bad_arguments_are_refused_clearly() {
    let (code, _, stderr) = hivemesh(&["bench", "collective", "--op", "all-to-all"]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("possible values: all-reduce, all-gather, broadcast, reduce-scatter"),
        "{stderr}"
    );
    let (code, _, stderr) = hivemesh(&["bench", "collective", "--op", "broadcast", "--peers", "0"]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("--peers must be between 1 and 64"),
        "{stderr}"
    );
}

/// With `HIVEMESH_TIMELINE`, every member process of a group writes its operations and, per
/// other member, every part it sent, received and handled.
#[test]
fn group_operations_write_a_timeline_per_member() {
    let dir = std::env::temp_dir().join(format!("hivemesh-group-timeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
        .args([
            "bench",
            "collective",
            "--op",
            "all-gather",
            "--peers",
            "3",
            "--mib",
            "3",
        ])
        .args(["--rounds", "1", "--part-bytes", "65536"])
        .env("HIVEMESH_TIMELINE", dir.join("trace-{pid}.json"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(
        files.len(),
        4,
        "one file per process: the parent and 3 workers"
    );
    let mut members = 0;
    for file in files {
        let text = std::fs::read_to_string(file.path()).unwrap();
        let events: Vec<serde_json::Value> = serde_json::from_str(&text).expect("a JSON array");
        if !events.iter().any(|e| e["ph"] == "X") {
            continue; // the parent: no operations
        }
        members += 1;
        let lanes: std::collections::HashMap<u64, String> = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let spans: Vec<(String, String)> = events
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| {
                let lane = lanes[&e["tid"].as_u64().unwrap()].clone();
                (lane, e["name"].as_str().unwrap().to_owned())
            })
            .collect();
        // Two all-gathers (warm-up and the timed round), each an operation span.
        let ops = spans.iter().filter(|(_, n)| n == "all_gather").count();
        assert_eq!(ops, 2, "{spans:?}");
        // Two other members, each with its own lane of parts sent, received and handled.
        let member_lanes: std::collections::HashSet<&String> = spans
            .iter()
            .filter(|(l, _)| l.contains("↔ group member"))
            .map(|(l, _)| l)
            .collect();
        assert_eq!(member_lanes.len(), 2, "{member_lanes:?}");
        for lane in member_lanes {
            for what in ["send part", "receive part", "handle part"] {
                assert!(
                    spans.iter().any(|(l, n)| l == lane && n.starts_with(what)),
                    "{lane}: no '{what}' span"
                );
            }
        }
    }
    assert_eq!(members, 3, "every worker wrote its operations");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `HIVEMESH_PERF_CTL` (perf's control FIFO; a plain file here) is told `enable` before each
/// timed round and `disable` after it, never around the warm-up; a path that cannot be opened,
/// or a FIFO that no perf reads, is an error before any worker starts.
#[test]
fn the_perf_control_file_brackets_every_timed_round() {
    let dir = std::env::temp_dir().join(format!("hivemesh-perf-ctl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let ctl = dir.join("ctl");
    for (args, want) in [
        (
            &["collective", "--op", "all-gather", "--rounds", "2"][..],
            "enable\ndisable\nenable\ndisable\n",
        ),
        (&["allreduce", "--rounds", "1"][..], "enable\ndisable\n"),
    ] {
        std::fs::write(&ctl, b"").expect("control file");
        let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .arg("bench")
            .args(args)
            .args(["--peers", "2", "--mib", "1"])
            .env("HIVEMESH_PERF_CTL", &ctl)
            .output()
            .expect("running hivemesh");
        assert!(out.status.success(), "{args:?}: {out:?}");
        let told = std::fs::read_to_string(&ctl).expect("control file");
        assert_eq!(told, want, "{args:?}");
    }
    // A bench whose control file cannot be opened fails with a message naming it.
    let refused = |ctl: &std::path::Path, why: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_hivemesh"))
            .args([
                "bench",
                "allreduce",
                "--peers",
                "2",
                "--mib",
                "1",
                "--rounds",
                "1",
            ])
            .env("HIVEMESH_PERF_CTL", ctl)
            .output()
            .expect("running hivemesh");
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(why), "{stderr}");
    };
    refused(&dir.join("missing/ctl"), "HIVEMESH_PERF_CTL");
    // A FIFO nobody reads (no perf): an error after the open's timeout, not a hang.
    let fifo = dir.join("fifo");
    let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a file.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0, "mkfifo");
    refused(&fifo, "nobody opened it for reading");
    std::fs::remove_dir_all(&dir).expect("clean up");
}
