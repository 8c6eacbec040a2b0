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
