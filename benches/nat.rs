//! Step times of 4 peers on rate-limited links, on the network-namespace test bed
//! (`tests/netns`): every host's line is limited with `tbf` (both directions), and each peer
//! runs the two-terminal example (`examples/join.rs`) in groups of 4. Needs root, `ip`, `tc`
//! and `iptables`; prints `skipped: ...` otherwise.
//!
//! ```sh
//! cargo build --release --example join && cargo bench --bench nat
//! cargo bench --bench nat -- --scenario cone --mbit 100 --mib 16 --rounds 6 --repeat 3
//! ```
//!
//! Scenarios: `public` (4 public peers), `cone` (2 public, 2 behind port-preserving NATs: the
//! NATed pair hole-punches), `symmetric` (2 public, 2 behind symmetric NATs: clients), `all`
//! (the default: the three in turn), and `pair` (2 peers behind port-preserving NATs, a group
//! of 2: every byte crosses the hole-punched link). `--mbit 0` leaves the links unlimited;
//! `--no-punched-tls` makes the punched links libp2p streams on the hole-punched connection
//! instead of TLS over a simultaneous-open TCP connection (the default).
//!
//! WAN scenarios (issue 32; not in `all`, `--scenario wan` runs the three): `asymmetric` (4
//! public peers on home lines: `--mbit` down, a fifth of it up), `slow` (4 public peers, the
//! last one's line 4x slower both ways), `eight` (8 public peers). Their bound is the plan's:
//! the step time of the best shares for the lines' rates under the butterfly's traffic model
//! (`hivemesh::matchmaking::rate_shares`: each member's uplink and downlink carry
//! `s·(1 − f) + (S − s)·f` tensors for share `f` among `S` senders), times the tensor's bytes.
//!
//! Each prints, per repetition,
//! `hivemesh_nat scenario=S peers=P mib=M link_mbit=L median_step_s=T bound_s=B punches_ok=K
//! punches_failed=F cpu_s=C`: T is the median over rounds 2.. of the slowest peer's step time
//! (round 1 includes joining), B the time the busiest uplink needs for its bytes at the link
//! rate (in a butterfly all-reduce of N peers each reducer's uplink carries (N-1)/N of a tensor
//! as parts and as many averages; with two clients the two public reducers carry more; 0 when
//! unlimited), K and F the hole punches of all peers, C the CPU time of all peers (user +
//! system, from /proc when they exit).

#[path = "../tests/netns/mod.rs"]
mod netns;

use std::path::{Path, PathBuf};
use std::time::Duration;

use netns::{Host, Nat, Testbed};

struct Options {
    scenarios: Vec<&'static str>,
    mbit: u32,
    mib: usize,
    rounds: usize,
    repeat: usize,
    stream_punched: bool,
}

fn options() -> Options {
    let mut o = Options {
        scenarios: vec!["public", "cone", "symmetric"],
        mbit: 100,
        mib: 16,
        rounds: 6,
        repeat: 1,
        stream_punched: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = || args.get(i + 1).cloned().unwrap_or_default();
        let number = |name: &str| -> usize {
            value()
                .parse()
                .unwrap_or_else(|_| panic!("{name} needs a number"))
        };
        match args[i].as_str() {
            "--scenario" => {
                o.scenarios = match value().as_str() {
                    "public" => vec!["public"],
                    "cone" => vec!["cone"],
                    "symmetric" => vec!["symmetric"],
                    "pair" => vec!["pair"],
                    "all" => vec!["public", "cone", "symmetric"],
                    "asymmetric" => vec!["asymmetric"],
                    "slow" => vec!["slow"],
                    "eight" => vec!["eight"],
                    "wan" => vec!["asymmetric", "slow", "eight"],
                    other => panic!(
                        "unknown scenario {other:?} (public, cone, symmetric, all, pair, \
                         asymmetric, slow, eight, wan)"
                    ),
                }
            }
            "--mbit" => o.mbit = number("--mbit") as u32,
            "--mib" => o.mib = number("--mib"),
            "--rounds" => o.rounds = number("--rounds").max(2),
            "--repeat" => o.repeat = number("--repeat").max(1),
            "--no-punched-tls" => {
                o.stream_punched = true;
                i += 1;
                continue;
            }
            // `cargo bench` passes `--bench`; anything else is ours.
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other:?}"),
        }
        i += 2;
    }
    o
}

fn main() {
    let o = options();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_hivemesh"));
    let join = bin
        .parent()
        .map(|d| d.join("examples").join("join"))
        .filter(|p| p.exists());
    let Some(join) = join else {
        eprintln!(
            "skipped: the join example is not built (`cargo build --release --example join`)"
        );
        return;
    };
    for scenario in &o.scenarios {
        for _ in 0..o.repeat {
            let Some(mut bed) = Testbed::new(&format!("bench-{scenario}")) else {
                return;
            };
            run(&mut bed, &bin, &join, scenario, &o);
        }
    }
}

fn run(bed: &mut Testbed, bin: &Path, join: &Path, scenario: &str, o: &Options) {
    let boot = bed.public_host("boot");
    let nat = match scenario {
        "cone" | "pair" => Some(Nat::PortPreserving),
        "symmetric" => Some(Nat::Symmetric),
        _ => None,
    };
    let mut hosts: Vec<Host> = if scenario == "pair" {
        Vec::new()
    } else {
        vec![bed.public_host("pub0"), bed.public_host("pub1")]
    };
    // Beyond the two public peers (none for a pair): 2 more, or 6 for `eight`.
    let more = if scenario == "eight" { 6 } else { 2 };
    for i in 0..more {
        hosts.push(match nat {
            Some(nat) => bed.home(&format!("nat{i}"), nat),
            None => bed.public_host(&format!("pub{}", i + 2)),
        });
    }
    // Per host: (up, down) Mbit/s.
    let lines: Vec<(u32, u32)> = (0..hosts.len())
        .map(|i| match scenario {
            "asymmetric" => ((o.mbit / 5).max(1), o.mbit),
            "slow" if i == hosts.len() - 1 => ((o.mbit / 4).max(1), (o.mbit / 4).max(1)),
            _ => (o.mbit, o.mbit),
        })
        .collect();
    if o.mbit > 0 {
        for (h, &(up, down)) in hosts.iter().zip(&lines) {
            bed.rate_limit_each(h, up, down);
        }
    }
    let group = hosts.len().to_string();
    let listen = format!("/ip4/{}/tcp/4001", boot.ip());
    let mut dht = bed.spawn(&boot, bin, ["dht", "--listen", &listen]);
    let addr = dht
        .wait_line(|l| l.contains("/p2p/"), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the DHT node prints its address: {e}"));
    let size = (o.mib << 20) / 4;
    let timeout = 120;
    let mut procs: Vec<_> = hosts
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let mut args = vec![
                "--initial-peer".to_owned(),
                addr.clone(),
                "--host".to_owned(),
                h.ip().to_string(),
                "--group-size".to_owned(),
                group.clone(),
                "--min-group-size".to_owned(),
                group.clone(),
                "--rounds".to_owned(),
                o.rounds.to_string(),
                "--size".to_owned(),
                size.to_string(),
                "--timeout".to_owned(),
                timeout.to_string(),
                "--seed".to_owned(),
                (i + 1).to_string(),
            ];
            if o.stream_punched {
                args.push("--no-punched-tls".to_owned());
            }
            bed.spawn(h, join, args)
        })
        .collect();
    // Per round, the slowest peer's step time.
    let mut slowest = vec![0.0f64; o.rounds];
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut cpu = 0.0;
    for p in &mut procs {
        let limit = Duration::from_secs((timeout * o.rounds as u64) + 60);
        // CPU time of the peer, read just before it exits (its last lines are the NAT summary).
        p.wait_line(|l| l.starts_with(&format!("round {}:", o.rounds)), limit)
            .unwrap_or_else(|e| panic!("{e}"));
        cpu += cpu_seconds(p.pid());
        let status = p.wait_with_timeout(limit).unwrap_or_else(|e| panic!("{e}"));
        let transcript = p.transcript();
        assert!(status.success(), "{status}\n{transcript}");
        for line in p.stdout().to_vec() {
            let Some(rest) = line.strip_prefix("round ") else {
                continue;
            };
            let (round, rest) = rest.split_once(':').unwrap_or(("", ""));
            let round: usize = round.parse().unwrap_or(0);
            let secs = rest
                .rsplit_once('(')
                .and_then(|(_, t)| t.strip_suffix(" s)"))
                .and_then(|t| t.parse::<f64>().ok());
            match (round.checked_sub(1), secs) {
                (Some(r), Some(secs)) if r < o.rounds => slowest[r] = slowest[r].max(secs),
                _ => panic!("unexpected round line {line:?}\n{transcript}"),
            }
        }
        for line in p.stderr().to_vec() {
            if let Some(rest) = line.strip_prefix("nat: ") {
                for field in rest.split_whitespace() {
                    match field.split_once('=') {
                        Some(("punches_ok", n)) => ok += n.parse::<u64>().unwrap_or(0),
                        Some(("punches_failed", n)) => failed += n.parse::<u64>().unwrap_or(0),
                        _ => {}
                    }
                }
            }
        }
    }
    dht.interrupt().ok();
    let _ = dht.wait_with_timeout(Duration::from_secs(15));
    let mut steady: Vec<f64> = slowest[1..].to_vec();
    steady.sort_by(f64::total_cmp);
    let median = steady[steady.len() / 2];
    let tensor_bits = (o.mib << 20) as f64 * 8.0;
    let link = f64::from(o.mbit) * 1e6;
    // Bytes through the busiest uplink: with 4 reducers each sends 3/4 of its tensor and the
    // averages of its quarter to 3 others (1.5 tensors); with 2 client senders the 2 public
    // reducers each send half a tensor to the other and averages of their half to 3 (2
    // tensors); a pair sends half a tensor and the averages of its half (1 tensor).
    let busiest = match scenario {
        "symmetric" => 2.0,
        "pair" => 1.0,
        _ => 1.5,
    };
    let bound = if o.mbit == 0 {
        0.0
    } else if matches!(scenario, "asymmetric" | "slow" | "eight") {
        plan_bound(&lines, (o.mib << 20) as f64)
    } else {
        busiest * tensor_bits / link
    };
    println!(
        "hivemesh_nat scenario={scenario}{} peers={} mib={} link_mbit={} median_step_s={median:.3} bound_s={bound:.3} punches_ok={ok} punches_failed={failed} cpu_s={cpu:.2}",
        if o.stream_punched {
            "+punched-streams"
        } else {
            ""
        },
        hosts.len(),
        o.mib,
        o.mbit
    );
    eprintln!("  slowest step per round: {slowest:.3?}");
}

/// The step time of the best shares for `lines` ((up, down) Mbit/s per public peer, all
/// nodes) for a tensor of `bytes` (module docs).
fn plan_bound(lines: &[(u32, u32)], bytes: f64) -> f64 {
    use hivemesh::matchmaking::rate_shares::{RatedPeer, rate_shares};
    let bytes_per_s = |mbit: u32| f64::from(mbit) * 1e6 / 8.0;
    let peers: Vec<RatedPeer> = lines
        .iter()
        .map(|&(up, down)| RatedPeer {
            sender: true,
            may_reduce: true,
            up: bytes_per_s(up),
            down: bytes_per_s(down),
        })
        .collect();
    rate_shares(&peers).map_or(0.0, |r| r.level * bytes)
}

/// User + system CPU seconds of process `pid` so far (`/proc/<pid>/stat`, fields 14 and 15).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the name: state is field 3, so utime (14) and stime (15) are at 11 and 12.
    (ticks(11) + ticks(12)) / 100.0
}
