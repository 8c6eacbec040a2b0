//! Peers on a test bed of network namespaces: public hosts on a private internet and hosts
//! behind home-router NATs (see `tests/netns`). These tests need root, `ip` and `iptables`;
//! elsewhere they print `skipped: <reason>` and pass.
//!
//! The first tests check the bed itself with plain sockets; the swarm tests run the real
//! `hivemesh` binary and the `join` example inside the namespaces.

use crate::netns;

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use netns::{Host, Nat, Testbed, Unsolicited};
use socket2::{Domain, SockAddr, Socket, Type};

/// A TCP listener on `host` (all its addresses, `port` 0: any); `accept` times out after 5 s.
fn listen(host: &Host, port: u16) -> Socket {
    host.run(|| {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.set_reuse_address(true).unwrap();
        let addr: SocketAddr = ([0, 0, 0, 0], port).into();
        socket.bind(&addr.into()).unwrap();
        socket.listen(16).unwrap();
        // Linux honours SO_RCVTIMEO in accept(2): no accept can block forever.
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        socket
    })
}

fn local_port(socket: &Socket) -> u16 {
    socket.local_addr().unwrap().as_socket().unwrap().port()
}

/// Accepts one connection; returns it and the address it came from.
fn accept(listener: &Socket) -> (Socket, SocketAddr) {
    let (conn, from) = listener.accept().expect("a connection within 5 s");
    (conn, from.as_socket().unwrap())
}

/// Connects from `host` to `to` within `timeout`, from local port `from_port` if given (bound
/// with SO_REUSEADDR and SO_REUSEPORT, so several connections can share it).
fn connect(
    host: &Host,
    from_port: Option<u16>,
    to: SocketAddr,
    timeout: Duration,
) -> io::Result<Socket> {
    host.run(|| {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        if let Some(port) = from_port {
            socket.set_reuse_address(true)?;
            socket.set_reuse_port(true)?;
            socket.bind(&SocketAddr::from(([0, 0, 0, 0], port)).into())?;
        }
        socket.connect_timeout(&SockAddr::from(to), timeout)?;
        Ok(socket)
    })
}

/// A local port for two sockets: bound once (with reuse flags) to let the kernel pick it.
fn free_port(host: &Host) -> (Socket, u16) {
    host.run(|| {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.set_reuse_address(true).unwrap();
        socket.set_reuse_port(true).unwrap();
        socket
            .bind(&SocketAddr::from(([0, 0, 0, 0], 0)).into())
            .unwrap();
        let port = local_port(&socket);
        (socket, port)
    })
}

#[test]
fn namespaces_behave_like_home_routers() {
    let sysctl = |key: &str| std::fs::read_to_string(format!("/proc/sys/{key}")).unwrap();
    let ipv6_off = "net/ipv6/conf/all/disable_ipv6";
    let forward = "net/ipv4/ip_forward";
    let outside = (sysctl(ipv6_off), sysctl(forward));
    let Some(mut bed) = Testbed::new("home-routers") else {
        return;
    };
    let a = bed.public_host("a");
    let b = bed.public_host("b");
    let cone = bed.home("cone", Nat::PortPreserving);
    let sym = bed.home("sym", Nat::Symmetric);
    assert_ne!(cone.router_ip(), sym.router_ip());
    assert_eq!(a.public_ip(), a.ip());
    assert_eq!(cone.public_ip(), cone.router_ip().unwrap());
    // The bed's settings land in its namespaces, not in the test's own.
    assert_eq!((sysctl(ipv6_off), sysctl(forward)), outside);
    assert_eq!(
        a.run(|| (sysctl(ipv6_off), sysctl(forward))),
        ("1\n".into(), "0\n".into())
    );
    let router = cone.router_namespace().unwrap();
    assert_eq!(netns::in_namespace(router, || sysctl(forward)), "1\n");

    let at_a = listen(&a, 5000);
    let at_b = listen(&b, 5000);
    let to_a = SocketAddr::new(a.ip(), 5000);
    let to_b = SocketAddr::new(b.ip(), 5000);
    let ok = Duration::from_secs(5);
    let dropped = Duration::from_millis(1500);

    // Public hosts reach each other directly.
    let _ab = connect(&b, None, to_a, ok).expect("public b reaches public a");
    let (_, from) = accept(&at_a);
    assert_eq!(from.ip(), b.ip());

    for home in [&cone, &sym] {
        let nat = home.nat().unwrap();
        let wan = home.router_ip().unwrap();
        assert_ne!(home.ip(), wan);

        // Outgoing connections work and come from the router's WAN address.
        let _out = connect(home, None, to_a, ok)
            .unwrap_or_else(|e| panic!("{nat:?}: the home host reaches a public host: {e}"));
        let (_, from) = accept(&at_a);
        assert_eq!(
            from.ip(),
            wan,
            "{nat:?}: seen from the router's WAN address"
        );

        // Nothing comes in unsolicited: not to the WAN address on a port the home host
        // listens on (dropped, so the connect times out instead of being refused), and not
        // to its LAN address (no route).
        let at_home = listen(home, 6000);
        let unsolicited = connect(&a, None, SocketAddr::new(wan, 6000), dropped);
        match unsolicited {
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{nat:?}: {e}"),
            Ok(_) => panic!("{nat:?}: a public host connected to the router unsolicited"),
        }
        let direct = connect(&a, None, SocketAddr::new(home.ip(), 6000), dropped);
        assert!(
            direct.is_err(),
            "{nat:?}: a public host reached a LAN address"
        );
        drop(at_home);

        // Two connections from one local port to two public hosts: the same public port
        // (the local one) behind the port-preserving NAT, two different ones behind the
        // symmetric NAT (random ports: equal by chance once in about 60 000 runs).
        let (_holder, port) = free_port(home);
        let _one = connect(home, Some(port), to_a, ok).expect("first connection");
        let _two = connect(home, Some(port), to_b, ok).expect("second connection");
        let (_, seen_a) = accept(&at_a);
        let (_, seen_b) = accept(&at_b);
        assert_eq!((seen_a.ip(), seen_b.ip()), (wan, wan));
        match nat {
            Nat::PortPreserving => {
                assert_eq!((seen_a.port(), seen_b.port()), (port, port), "{nat:?}");
            }
            Nat::Symmetric => assert_ne!(seen_a.port(), seen_b.port(), "{nat:?}"),
        }
    }
}

/// A TCP simultaneous open from `a`'s port `pa` to `b`'s, and back, at once (both through their
/// routers, as the punched TLS link does it) with [`hivemesh::transport::PunchSocket`], which
/// retries on a reset; `Ok` if both ends connected within `within`.
fn simultaneous_open(
    a: &Host,
    b: &Host,
    within: Duration,
    stagger: Duration,
) -> Result<(), String> {
    let open = |from: &Host,
                to: &Host,
                socket: hivemesh::transport::PunchSocket,
                port: u16,
                late: Duration| {
        let to = SocketAddr::new(to.public_ip(), port);
        from.run(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let deadline = tokio::time::Instant::now() + within;
                tokio::time::sleep(late).await;
                socket.connect(to, deadline).await
            })
            .map(drop)
            .map_err(|e| e.to_string())
        })
    };
    let sa = a.run(|| hivemesh::transport::PunchSocket::bind().unwrap());
    let sb = b.run(|| hivemesh::transport::PunchSocket::bind().unwrap());
    let (pa, pb) = (sa.port(), sb.port());
    std::thread::scope(|s| {
        let one = s.spawn(|| open(a, b, sa, pb, Duration::ZERO));
        let two = open(b, a, sb, pa, stagger);
        let one = one.join().unwrap();
        one.and(two)
    })
}

/// Routers that answer unsolicited packets: a SYN to an unmapped port is reset, a UDP datagram
/// gets an ICMP port-unreachable (both seen by the sender at once, where the silent routers
/// make it wait). A TCP simultaneous open between two such homes still works (the first SYN
/// is refused, the retry crosses the other's), and never between two homes the bed separated.
#[test]
fn answering_routers_refuse_unsolicited_packets() {
    let Some(mut bed) = Testbed::new("answering") else {
        return;
    };
    let a = bed.public_host("a");
    let h0 = bed.home_with("h0", Nat::PortPreserving, Unsolicited::Answer);
    let h1 = bed.home_with("h1", Nat::PortPreserving, Unsolicited::Answer);
    let s0 = bed.home_with("s0", Nat::PortPreserving, Unsolicited::Answer);
    let s1 = bed.home_with("s1", Nat::PortPreserving, Unsolicited::Answer);
    bed.separate(&s0, &s1);
    let y0 = bed.home_with("y0", Nat::PortPreserving, Unsolicited::Answer);
    let y1 = bed.home_with("y1", Nat::PortPreserving, Unsolicited::Answer);
    bed.symmetric_towards(&y0, &y1);
    assert_eq!(h0.unsolicited(), Some(Unsolicited::Answer));
    let wan = h0.router_ip().unwrap();
    let _at_home = listen(&h0, 6000);
    let refused = connect(&a, None, SocketAddr::new(wan, 6000), Duration::from_secs(5));
    match refused {
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}"),
        Ok(_) => panic!("a public host connected to the router unsolicited"),
    }
    let icmp = a.run(|| {
        let udp = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        udp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        udp.connect(SocketAddr::new(wan, 6001)).unwrap();
        udp.send(b"hello").unwrap();
        // A connected UDP socket reports the ICMP error on its next receive.
        udp.recv(&mut [0; 16]).unwrap_err()
    });
    assert_eq!(icmp.kind(), io::ErrorKind::ConnectionRefused, "{icmp}");
    // Outgoing connections still work.
    let at_a = listen(&a, 5000);
    connect(
        &h0,
        None,
        SocketAddr::new(a.ip(), 5000),
        Duration::from_secs(5),
    )
    .unwrap();
    accept(&at_a);

    // Generous: the two sides cross after 0.1-5 s of retries (docs/architecture.md).
    let within = Duration::from_secs(30);
    simultaneous_open(&h0, &h1, within, Duration::ZERO)
        .expect("a simultaneous open between answering routers");
    // The two sides learn each other's endpoint a relay round trip apart: one starts late.
    simultaneous_open(&h0, &h1, within, Duration::from_millis(50))
        .expect("a staggered simultaneous open between answering routers");
    let never = simultaneous_open(&s0, &s1, Duration::from_secs(2), Duration::ZERO);
    assert!(never.is_err());
    // A router symmetric towards one home only: from one local port, the public host sees the
    // port kept, the other home's router (whose own kernel accepts, it answers unsolicited
    // packets) a random one; so a simultaneous open between the two never meets.
    let (_bound, port) = free_port(&y0);
    connect(
        &y0,
        Some(port),
        SocketAddr::new(a.ip(), 5000),
        Duration::from_secs(5),
    )
    .unwrap();
    assert_eq!(accept(&at_a).1.port(), port, "kept towards the public host");
    let at_y1_router = netns::in_namespace(y1.router_namespace().unwrap(), || {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket.set_reuse_address(true).unwrap();
        socket
            .bind(&SocketAddr::from(([0, 0, 0, 0], 5001)).into())
            .unwrap();
        socket.listen(4).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        socket
    });
    let y1_wan = y1.router_ip().unwrap();
    connect(
        &y0,
        Some(port),
        SocketAddr::new(y1_wan, 5001),
        Duration::from_secs(5),
    )
    .unwrap();
    let (_conn, from) = accept(&at_y1_router);
    assert_eq!(from.ip(), y0.router_ip().unwrap());
    assert_ne!(from.port(), port, "a random port towards the other home");
    let never = simultaneous_open(&y0, &y1, Duration::from_secs(2), Duration::ZERO);
    assert!(never.is_err());
    // Separated homes still reach the public internet.
    connect(
        &s0,
        None,
        SocketAddr::new(a.ip(), 5000),
        Duration::from_secs(5),
    )
    .unwrap();
}

/// Sends `bytes` over `to` (then closes it); returns how long the receiver `from` took to read
/// them all.
fn timed_transfer(mut to: Socket, mut from: Socket, bytes: usize) -> Duration {
    from.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    std::thread::scope(|s| {
        s.spawn(move || {
            to.write_all(&vec![7u8; bytes]).unwrap();
            to.shutdown(Shutdown::Write).unwrap();
        });
        let started = Instant::now();
        let mut got = Vec::with_capacity(bytes);
        from.read_to_end(&mut got).unwrap();
        assert_eq!(got.len(), bytes);
        started.elapsed()
    })
}

/// `rate_limit` shapes a home's line in both directions: 2.5 MB at 20 Mbit/s take about 1 s
/// each way (a 256 KiB burst goes through at once), where the unshaped link takes milliseconds.
#[test]
fn rate_limit_caps_both_directions() {
    let Some(mut bed) = Testbed::new("rate-limit") else {
        return;
    };
    let a = bed.public_host("a");
    let home = bed.home("home", Nat::PortPreserving);
    bed.rate_limit(&home, 20);
    let at_a = listen(&a, 5000);
    let bytes = 2_500_000;
    let least = Duration::from_secs_f64((bytes - 256 * 1024) as f64 * 8.0 / 20e6 * 0.9);
    for upload in [true, false] {
        let out = connect(
            &home,
            None,
            SocketAddr::new(a.ip(), 5000),
            Duration::from_secs(5),
        )
        .expect("the home host reaches a");
        let (inn, _) = accept(&at_a);
        let took = if upload {
            timed_transfer(out, inn, bytes)
        } else {
            timed_transfer(inn, out, bytes)
        };
        assert!(took >= least, "upload={upload}: {took:?} < {least:?}");
    }
}

/// The `hivemesh` binary and, if built, an example next to it (`target/<profile>/examples/`).
/// `cargo test` builds the examples; `cargo test --test integration` alone does not (run `cargo build
/// --example join` first): then the test is skipped with a note, except in CI (`CI` set), where
/// a missing example fails.
fn example(name: &str) -> Option<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_hivemesh"));
    let path = bin.parent()?.join("examples").join(name);
    if path.exists() {
        return Some(path);
    }
    let note = format!(
        "{} is not built (`cargo test` or `cargo build --example {name}` builds it)",
        path.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{note}");
    eprintln!("skipped: {note}");
    None
}

fn hivemesh() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_hivemesh"))
}

/// The value after `mean=` in a `join` line.
fn mean_of(line: &str) -> f64 {
    let m = line
        .split("mean=")
        .nth(1)
        .unwrap_or_else(|| panic!("no mean in '{line}'"));
    m.split(' ').next().unwrap().parse().unwrap()
}

/// The two-terminal example across hosts: a DHT node on one public host and a `join` peer on
/// each of three others find each other and average in groups of 3, twice.
#[test]
fn public_hosts_average_through_a_dht_node() {
    let Some(join) = example("join") else {
        return;
    };
    let Some(mut bed) = Testbed::new("dht-average") else {
        return;
    };
    let boot = bed.public_host("boot");
    let peers: Vec<Host> = (0..3)
        .map(|i| bed.public_host(&format!("peer{i}")))
        .collect();

    let listen = format!("/ip4/{}/tcp/4001", boot.ip());
    let mut dht = bed.spawn(&boot, &hivemesh(), ["dht", "--listen", &listen]);
    let addr = dht
        .wait_line(|l| l.contains("/p2p/"), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the DHT node prints its address: {e}"));
    assert!(addr.starts_with(&format!("{listen}/p2p/12D3")), "{addr}");

    let mut joins: Vec<_> = peers
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let ip = host.ip().to_string();
            let seed = i.to_string();
            let dump = dump_prefix(host.name());
            let dump = dump.to_str().unwrap();
            let args = [
                "--dump",
                dump,
                "--initial-peer",
                &addr,
                "--host",
                &ip,
                "--group-size",
                "3",
                "--min-group-size",
                "3",
                "--rounds",
                "2",
                "--size",
                "1000",
                "--timeout",
                "60",
                "--seed",
                &seed,
            ];
            bed.spawn(host, &join, args)
        })
        .collect();
    // Two rounds of at most 60 s each, plus start-up and shutdown.
    for p in &mut joins {
        let status = p
            .wait_with_timeout(Duration::from_secs(150))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(status.success(), "{status}\n{}", p.transcript());
    }
    dht.interrupt().unwrap();
    let status = dht.wait_with_timeout(Duration::from_secs(15)).unwrap();
    assert!(
        status.success(),
        "the DHT node stops cleanly on Ctrl-C: {status}\n{}",
        dht.transcript()
    );

    let mut initial = Vec::new();
    let mut finals = Vec::new();
    for p in &mut joins {
        let text = p.transcript();
        let lines = p.stdout().to_vec();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[0].starts_with("peer 12D3") && lines[0].contains(" joined;"),
            "{text}"
        );
        initial.push(mean_of(&lines[0]));
        for (r, line) in lines[1..].iter().enumerate() {
            assert!(
                line.starts_with(&format!("round {}: group=3 mean=", r + 1)),
                "{text}"
            );
        }
        finals.push(mean_of(&lines[2]));
    }
    let global = initial.iter().sum::<f64>() / 3.0;
    for m in &finals {
        assert!((m - finals[0]).abs() < 1e-3, "final means {finals:?}");
        // Printed with 4 decimals: the inputs' rounding adds up to 1e-4.
        assert!(
            (m - global).abs() < 2e-4,
            "final means {finals:?}, the mean of all: {global}"
        );
    }
    let names: Vec<&str> = peers.iter().map(Host::name).collect();
    assert_every_element_is_the_mean(&names);
}

/// A process outliving its bed is killed with it, and the bed's namespaces are gone after drop;
/// `ip netns exec` execs the program (the child's pid is the program's).
#[test]
fn a_dropped_bed_leaves_no_namespace_or_process() {
    let Some(mut bed) = Testbed::new("cleanup") else {
        return;
    };
    let host = bed.public_host("h");
    let listen = format!("/ip4/{}/tcp/4001", host.ip());
    let mut dht = bed.spawn(&host, &hivemesh(), ["dht", "--listen", &listen]);
    dht.wait_line(|l| l.contains("/p2p/"), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    let exe = std::fs::read_link(format!("/proc/{}/exe", dht.pid())).unwrap();
    assert_eq!(
        exe,
        hivemesh().canonicalize().unwrap(),
        "ip netns exec execs the program"
    );
    let names = bed.namespaces().to_vec();
    assert_eq!(names.len(), 2, "{names:?}");
    drop(bed);
    let status = dht
        .wait_with_timeout(Duration::from_secs(10))
        .expect("the bed killed its process");
    assert!(!status.success());
    let list = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    for ns in &names {
        assert!(
            !list
                .lines()
                .any(|l| l.split_whitespace().next() == Some(ns)),
            "{ns} is still there: {list}"
        );
    }
}

/// One `join` process of a NAT scenario, once it exited.
struct PeerRun {
    name: String,
    nated: bool,
    stdout: Vec<String>,
    stderr: Vec<String>,
    transcript: String,
}

impl PeerRun {
    /// The stderr detail lines of the rounds (`round R: mode=... links=...`), in order.
    fn details(&self) -> Vec<&str> {
        self.stderr
            .iter()
            .filter(|l| l.starts_with("round ") && l.contains(" mode="))
            .map(String::as_str)
            .collect()
    }

    /// The hole punches this peer's node made and failed (its `nat:` line at exit).
    fn punches(&self) -> (u64, u64) {
        let line = self
            .stderr
            .iter()
            .find(|l| l.starts_with("nat: "))
            .unwrap_or_else(|| panic!("{}: no nat: line\n{}", self.name, self.transcript));
        let count = |key| Self::field(line, key).parse::<u64>().unwrap();
        (count("punches_ok"), count("punches_failed"))
    }

    /// Each round's step time in seconds (the `(S s)` of its stdout line).
    fn round_secs(&self) -> Vec<f64> {
        self.stdout[1..]
            .iter()
            .map(|l| {
                let t = l.rsplit('(').next().unwrap();
                t.trim_end_matches(" s)").parse().unwrap()
            })
            .collect()
    }

    /// `key=value` from a detail line.
    fn field<'a>(line: &'a str, key: &str) -> &'a str {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}= in {line}"))
    }
}

/// Starts `hivemesh dht` on `host` (port 4001, extra flags `extra`) and returns it with the
/// address it printed.
fn start_dht(bed: &Testbed, host: &Host, extra: &[&str]) -> (netns::Proc, String) {
    let listen = format!("/ip4/{}/tcp/4001", host.ip());
    let mut args = vec!["dht", "--listen", &listen];
    args.extend_from_slice(extra);
    let mut dht = bed.spawn(host, &hivemesh(), args);
    let addr = dht
        .wait_line(|l| l.contains("/p2p/"), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the DHT node prints its address: {e}"));
    (dht, addr)
}

/// A peer of a scenario: where it runs, whether it is behind a NAT, whom it joins through.
struct PeerSpec {
    host: Host,
    nated: bool,
    initial_peer: String,
}

/// Starts the `join` example for every peer: groups of exactly 4, `rounds` rounds, 10 000
/// values, 60 s per round, extra flags `extra`.
fn spawn_joins(
    bed: &Testbed,
    join: &std::path::Path,
    peers: &[PeerSpec],
    rounds: usize,
    extra: &[&str],
) -> Vec<netns::Proc> {
    let rounds = rounds.to_string();
    peers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ip = p.host.ip().to_string();
            let seed = (i + 1).to_string();
            let dump = dump_prefix(p.host.name());
            let dump = dump.to_str().unwrap().to_owned();
            let mut args = vec![
                "--dump",
                &dump,
                "--initial-peer",
                &p.initial_peer,
                "--host",
                &ip,
                "--group-size",
                "4",
                "--min-group-size",
                "4",
                "--rounds",
                &rounds,
                "--size",
                "10000",
                "--timeout",
                "60",
                "--seed",
                &seed,
            ];
            args.extend_from_slice(extra);
            let _ = std::fs::remove_file(format!("{dump}.final"));
            // Stdin piped: `--hold-after` waits for a line there.
            bed.spawn_with_stdin(&p.host, join, args)
        })
        .collect()
}

/// Where the `join` of the host `name` writes its vectors (`--dump`): one per test process and
/// host.
fn dump_prefix(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("hivemesh-nat-{}-{name}", std::process::id()))
}

/// The vector a `join` wrote to `{prefix}.{what}` (and the file removed).
fn read_dump(name: &str, what: &str) -> Vec<f32> {
    let mut path = dump_prefix(name).into_os_string();
    path.push(format!(".{what}"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{name}'s {what} vector: {e}"));
    let _ = std::fs::remove_file(&path);
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Every element of the final vector of each `join` named in `names` (`--dump`) is the mean of
/// that element over all their starting vectors (f32 rounding aside).
fn assert_every_element_is_the_mean(names: &[&str]) {
    let starts: Vec<Vec<f32>> = names.iter().map(|n| read_dump(n, "initial")).collect();
    let exact: Vec<f64> = (0..starts[0].len())
        .map(|i| starts.iter().map(|v| f64::from(v[i])).sum::<f64>() / starts.len() as f64)
        .collect();
    for name in names {
        let end = read_dump(name, "final");
        assert_eq!(end.len(), exact.len(), "{name}");
        let (worst, at) = end
            .iter()
            .zip(&exact)
            .map(|(a, b)| (f64::from(*a) - b).abs())
            .zip(0..)
            .fold((0.0, 0), |m, (d, i)| if d > m.0 { (d, i) } else { m });
        assert!(
            worst < 1e-4,
            "{name}: element {at} is {} where the exact mean is {}",
            end[at],
            exact[at]
        );
    }
}

/// Waits for every peer to exit (bounded by the rounds' timeouts), then fails with every
/// transcript unless all exited successfully.
fn collect_runs(procs: &mut [netns::Proc], peers: &[PeerSpec], rounds: usize) -> Vec<PeerRun> {
    let mut runs = Vec::new();
    let mut failed = Vec::new();
    for (p, spec) in procs.iter_mut().zip(peers) {
        let status = p.wait_with_timeout(Duration::from_secs(60 * rounds as u64 + 60));
        let name = spec.host.name().to_owned();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("{name}: {s}")),
            Err(e) => failed.push(format!("{name}: {e}")),
        }
        runs.push(PeerRun {
            name,
            nated: spec.nated,
            stdout: p.stdout().to_vec(),
            stderr: p.stderr().to_vec(),
            transcript: p.transcript(),
        });
    }
    let all: Vec<&str> = runs.iter().map(|r| r.transcript.as_str()).collect();
    assert!(failed.is_empty(), "{failed:?}\n{}", all.join("\n"));
    runs
}

/// The home routers of a scenario's two NATed peers.
#[derive(Clone, Copy, Debug)]
struct Homes {
    /// For messages: which router variant.
    name: &'static str,
    nat: Nat,
    unsolicited: Unsolicited,
    /// What lies between the two homes.
    between: Between,
}

/// What lies between a scenario's two homes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Between {
    /// The internet: a hole punch can meet.
    Open,
    /// Nothing: they cannot reach each other at all ([`Testbed::separate`]).
    Separated,
    /// The first home's router is symmetric towards the second's (and port-preserving towards
    /// everyone else, [`Testbed::symmetric_towards`]): both look punchable, no punch can meet.
    SymmetricTowards,
}

impl Homes {
    /// Today's bed: routers that drop unsolicited packets silently.
    fn silent(nat: Nat) -> Self {
        Self {
            name: "silent-drop",
            nat,
            unsolicited: Unsolicited::Drop,
            between: Between::Open,
        }
    }

    /// Port-preserving routers that answer unsolicited packets, with `between` between them.
    fn answering(name: &'static str, between: Between) -> Self {
        Self {
            name,
            nat: Nat::PortPreserving,
            unsolicited: Unsolicited::Answer,
            between,
        }
    }
}

/// A public bootstrap node (a relay), two public peers and two peers each behind its own home
/// router (`homes`), all running the two-terminal example in groups of 4 for `rounds` rounds
/// (extra `join` flags in `extra`). Returns every peer's output once all exited successfully.
fn four_peers_two_behind_nats(
    bed: &mut Testbed,
    join: &std::path::Path,
    homes: Homes,
    rounds: usize,
    extra: &[&str],
) -> Vec<PeerRun> {
    let boot = bed.public_host("boot");
    let (mut dht, addr) = start_dht(bed, &boot, &[]);
    let nat0 = bed.home_with("nat0", homes.nat, homes.unsolicited);
    let nat1 = bed.home_with("nat1", homes.nat, homes.unsolicited);
    match homes.between {
        Between::Open => {}
        Between::Separated => bed.separate(&nat0, &nat1),
        Between::SymmetricTowards => bed.symmetric_towards(&nat0, &nat1),
    }
    let peers = [
        (bed.public_host("pub0"), false),
        (bed.public_host("pub1"), false),
        (nat0, true),
        (nat1, true),
    ]
    .map(|(host, nated)| PeerSpec {
        host,
        nated,
        initial_peer: addr.clone(),
    });
    let mut procs = spawn_joins(bed, join, &peers, rounds, extra);
    let runs = collect_runs(&mut procs, &peers, rounds);
    dht.interrupt().unwrap();
    let status = dht.wait_with_timeout(Duration::from_secs(15)).unwrap();
    assert!(status.success(), "{status}\n{}", dht.transcript());
    runs
}

/// Every peer printed `rounds` rounds in a group of 4, every round's parts average all four
/// members and none kept local values, all four end on the same mean (the mean of their
/// starting means), and every element of every peer's final vector is the element-wise mean of
/// the four starting vectors.
fn assert_all_four_averaged(runs: &[PeerRun], rounds: usize) {
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    assert_every_element_is_the_mean(&names);
    let mut initial = Vec::new();
    let mut finals = Vec::new();
    for run in runs {
        let t = &run.transcript;
        assert_eq!(run.stdout.len(), rounds + 1, "{}:\n{t}", run.name);
        initial.push(mean_of(&run.stdout[0]));
        for (r, line) in run.stdout[1..].iter().enumerate() {
            assert!(
                line.starts_with(&format!("round {}: group=4 mean=", r + 1)),
                "{}:\n{t}",
                run.name
            );
        }
        finals.push(mean_of(&run.stdout[rounds]));
        let details = run.details();
        assert_eq!(details.len(), rounds, "{}:\n{t}", run.name);
        assert!(
            !run.stderr.iter().any(|l| l.contains("panicked")),
            "{}:\n{t}",
            run.name
        );
        for d in details {
            assert_eq!(
                PeerRun::field(d, "contributors"),
                "4..4",
                "{}: {d}",
                run.name
            );
            assert_eq!(PeerRun::field(d, "local_parts"), "0", "{}: {d}", run.name);
            // Nobody waited for a sender or a reducer until its timeout.
            assert_eq!(PeerRun::field(d, "banned"), "0", "{}: {d}", run.name);
            assert_eq!(
                PeerRun::field(d, "failed_reducers"),
                "0",
                "{}: {d}",
                run.name
            );
        }
    }
    let global = initial.iter().sum::<f64>() / initial.len() as f64;
    for m in &finals {
        assert!(
            (m - global).abs() < 2e-4,
            "final means {finals:?}, mean of all {global}"
        );
    }
}

/// Two peers behind port-preserving NATs that drop unsolicited inbound connections: they find
/// out they are punchable, reserve a slot on the bootstrap relay, and reduce like anyone; their
/// link to each other is TLS over a TCP connection that a simultaneous open made through both
/// NATs (or a stream on a hole-punched connection), never relayed; their links to the public peers are direct TLS,
/// opened by them.
#[test]
fn peers_behind_port_preserving_nats_reduce_over_hole_punched_links() {
    let Some(join) = example("join") else {
        return;
    };
    let Some(mut bed) = Testbed::new("nat-cone") else {
        return;
    };
    let homes = Homes::silent(Nat::PortPreserving);
    let runs = four_peers_two_behind_nats(&mut bed, &join, homes, 3, &[]);
    for run in &runs {
        eprintln!("--- {}\n{}", run.name, run.transcript);
    }
    report_punches(homes, &runs);
    assert_all_four_averaged(&runs, 3);
    for run in &runs {
        for d in run.details() {
            assert_eq!(PeerRun::field(d, "mode"), "node", "{}: {d}", run.name);
            let reach = if run.nated { "punchable" } else { "public" };
            assert_eq!(PeerRun::field(d, "reach"), reach, "{}: {d}", run.name);
            let links = PeerRun::field(d, "links");
            assert!(
                !links.contains("relayed") && !links.contains('-'),
                "{}: {d}",
                run.name
            );
            if run.nated {
                // Punched TLS, or (when its simultaneous open, tried first over the relayed
                // connection, did not cross in time) a stream on DCUtR's punched connection.
                assert!(
                    links.contains("tls/punched") || links.contains("punched/"),
                    "{}: {d}",
                    run.name
                );
            }
        }
    }
}

/// Two peers behind symmetric NATs (a new public port per connection: hole punching cannot
/// work): they find out that nobody can dial them and take part as clients, without being
/// told; the public peers reduce everything, every round averages all four.
#[test]
fn peers_behind_symmetric_nats_average_as_clients() {
    let Some(join) = example("join") else {
        return;
    };
    let Some(mut bed) = Testbed::new("nat-sym") else {
        return;
    };
    let runs = four_peers_two_behind_nats(&mut bed, &join, Homes::silent(Nat::Symmetric), 3, &[]);
    for run in &runs {
        eprintln!("--- {}\n{}", run.name, run.transcript);
    }
    assert_all_four_averaged(&runs, 3);
    for run in &runs {
        for d in run.details() {
            let (mode, reach) = if run.nated {
                ("client", "private")
            } else {
                ("node", "public")
            };
            assert_eq!(PeerRun::field(d, "mode"), mode, "{}: {d}", run.name);
            assert_eq!(PeerRun::field(d, "reach"), reach, "{}: {d}", run.name);
            let links: Vec<&str> = PeerRun::field(d, "links").split(',').collect();
            assert!(!links.contains(&"relayed"), "{}: {d}", run.name);
            // Clients link to the two public reducers only; public peers to everyone.
            let linked = links.iter().filter(|l| **l == "tls").count();
            assert_eq!(linked, if run.nated { 2 } else { 3 }, "{}: {d}", run.name);
        }
    }
}

/// The relay a NATed peer reserved a slot on goes away mid-run: the peer reserves a slot on
/// another relay it meets (a second `hivemesh dht` node), and the rounds go on with everyone.
#[test]
fn a_nated_peer_whose_relay_goes_away_reserves_another_and_rounds_go_on() {
    let Some(join) = example("join") else {
        return;
    };
    let Some(mut bed) = Testbed::new("nat-relay") else {
        return;
    };
    const ROUNDS: usize = 6;
    let boot_host = bed.public_host("boot");
    let r1_host = bed.public_host("relay1");
    let r2_host = bed.public_host("relay2");
    // The bootstrap relays nothing: the NATed peers join through relay 1 and reserve there.
    let (mut boot, boot_addr) = start_dht(&bed, &boot_host, &["--no-relay"]);
    let (mut r1, r1_addr) = start_dht(&bed, &r1_host, &["--initial-peer", &boot_addr]);
    let (mut r2, r2_addr) = start_dht(&bed, &r2_host, &["--initial-peer", &boot_addr]);
    let relay_id = |addr: &str| addr.rsplit('/').next().unwrap().to_owned();
    let (r1_id, r2_id) = (relay_id(&r1_addr), relay_id(&r2_addr));
    let peers = [
        (bed.public_host("pub0"), false, &boot_addr),
        (bed.public_host("pub1"), false, &boot_addr),
        (bed.home("nat0", Nat::PortPreserving), true, &r1_addr),
        (bed.home("nat1", Nat::PortPreserving), true, &r1_addr),
    ]
    .map(|(host, nated, initial)| PeerSpec {
        host,
        nated,
        initial_peer: initial.clone(),
    });
    // Every peer stops after round 2 until released, so that relay 1 goes away between rounds
    // 2 and 3 however long rounds take.
    let mut procs = spawn_joins(&bed, &join, &peers, ROUNDS, &["--hold-after", "2"]);
    // All four have averaged twice (the NATed peers through relay 1, checked below) and wait:
    // take relay 1 away, then let them go on.
    for p in &mut procs {
        p.wait_line(|l| l == "held after round 2", Duration::from_secs(150))
            .unwrap_or_else(|e| panic!("two rounds: {e}\n{}", p.transcript()));
    }
    r1.kill().unwrap();
    r1.wait_with_timeout(Duration::from_secs(15)).unwrap();
    for p in &mut procs {
        p.send_line("go")
            .unwrap_or_else(|e| panic!("releasing: {e}\n{}", p.transcript()));
    }
    let mut runs = collect_runs(&mut procs, &peers, ROUNDS);
    for run in &mut runs {
        eprintln!("--- {}\n{}", run.name, run.transcript);
        // The hold line came right after round 2's; the rest is the usual output.
        let t = &run.transcript;
        let held = run.stdout.get(3).map(String::as_str);
        assert_eq!(held, Some("held after round 2"), "{}:\n{t}", run.name);
        run.stdout.remove(3);
    }
    assert_all_four_averaged(&runs, ROUNDS);
    for run in runs.iter().filter(|r| r.nated) {
        // Reachable through relay 1 first, through relay 2 after it went away.
        let relayed: Vec<&String> = run
            .stderr
            .iter()
            .filter(|l| l.starts_with("reachability: punchable relayed="))
            .collect();
        let t = &run.transcript;
        assert!(
            relayed.first().is_some_and(|l| l.contains(&r1_id)),
            "{}:\n{t}",
            run.name
        );
        assert!(
            relayed.last().is_some_and(|l| l.contains(&r2_id)),
            "{}:\n{t}",
            run.name
        );
    }
    for dht in [&mut boot, &mut r2] {
        dht.interrupt().unwrap();
        let status = dht.wait_with_timeout(Duration::from_secs(15)).unwrap();
        assert!(status.success(), "{status}\n{}", dht.transcript());
    }
}

/// The same with `--no-punched-tls`: the NATed pair's link is a libp2p stream on the
/// hole-punched connection (TCP or QUIC, whichever the punch made).
#[test]
fn peers_behind_port_preserving_nats_link_over_a_punched_stream() {
    let Some(join) = example("join") else {
        return;
    };
    let Some(mut bed) = Testbed::new("nat-ptls") else {
        return;
    };
    let runs = four_peers_two_behind_nats(
        &mut bed,
        &join,
        Homes::silent(Nat::PortPreserving),
        3,
        &["--no-punched-tls"],
    );
    for run in &runs {
        eprintln!("--- {}\n{}", run.name, run.transcript);
    }
    assert_all_four_averaged(&runs, 3);
    for run in runs.iter().filter(|r| r.nated) {
        for d in run.details() {
            let links: Vec<&str> = PeerRun::field(d, "links").split(',').collect();
            assert!(
                links.iter().any(|l| l.starts_with("punched/")),
                "{}: {d}",
                run.name
            );
            assert_eq!(
                links.iter().filter(|l| **l == "tls").count(),
                2,
                "{}: {d}",
                run.name
            );
        }
    }
}

/// Prints a scenario's DCUtR hole punches (summed over its NATed peers, punches with public
/// peers included), the rounds in which the NATed pair had a punched link, and round times: the
/// numbers docs/architecture.md records per router variant.
fn report_punches(homes: Homes, runs: &[PeerRun]) {
    let (ok, failed) = runs
        .iter()
        .filter(|r| r.nated)
        .map(PeerRun::punches)
        .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
    let rounds: Vec<String> = runs
        .iter()
        .map(|r| format!("{}={:?}", r.name, r.round_secs()))
        .collect();
    // Rounds in which the NATed pair had a hole-punched link (seen from the first NATed peer).
    let nated = runs.iter().find(|r| r.nated).expect("a NATed peer");
    let pair_punched = nated
        .details()
        .iter()
        .filter(|d| PeerRun::field(d, "links").contains("punched"))
        .count();
    eprintln!(
        "punches variant={} dcutr_ok={ok} dcutr_failed={failed} pair_punched_rounds={pair_punched}/{} round_secs: {}",
        homes.name,
        nated.details().len(),
        rounds.join(" ")
    );
}

/// A scenario of one router variant: 2 public + 2 NATed peers in groups of 4, 3 rounds; every
/// round averages all four with no sender banned and no reducer failed (so none waited for a
/// timeout), all end on one mean; prints the punch counts and round times.
fn router_variant(homes: Homes, tag: &str) -> Option<Vec<PeerRun>> {
    let join = example("join")?;
    let mut bed = Testbed::new(tag)?;
    let runs = four_peers_two_behind_nats(&mut bed, &join, homes, 3, &[]);
    for run in &runs {
        eprintln!("--- {}\n{}", run.name, run.transcript);
    }
    report_punches(homes, &runs);
    assert_all_four_averaged(&runs, 3);
    Some(runs)
}

/// Home routers that answer unsolicited packets (a reset for a SYN, an ICMP port-unreachable for
/// UDP) instead of dropping them: a hole punch's first packets are refused, not lost. Every
/// round still averages all four peers, none waits for a timeout.
#[test]
fn peers_behind_answering_routers_average_whole_rounds() {
    let homes = Homes::answering("rst-icmp", Between::Open);
    let Some(runs) = router_variant(homes, "nat-rst") else {
        return;
    };
    for run in &runs {
        for d in run.details() {
            let reach = if run.nated { "punchable" } else { "public" };
            assert_eq!(PeerRun::field(d, "reach"), reach, "{}: {d}", run.name);
            assert!(
                !PeerRun::field(d, "links").contains("relayed"),
                "{}: {d}",
                run.name
            );
        }
    }
}

/// Two NATed peers that look punchable but can never reach each other (answering routers, the
/// internet between them cut): whatever the first round's punch does, every round averages
/// all four, none waits for a timeout, and after the first round the pair is planned without a
/// link between them (neither reduces; they send to the public reducers).
#[test]
fn a_pair_that_can_never_punch_averages_whole_rounds() {
    let homes = Homes::answering("never", Between::Separated);
    let Some(runs) = router_variant(homes, "nat-never") else {
        return;
    };
    assert_never_linked_after_the_first_round(&runs);
}

/// A pair that can never punch because of its routers: one is symmetric towards the other
/// (while port-preserving towards everyone else, so both classify as punchable), the other
/// answers unsolicited packets, so every punch packet is reset or refused. The same outcome as
/// with homes cut off from each other.
#[test]
fn a_pair_whose_routers_never_let_a_punch_meet_averages_whole_rounds() {
    let homes = Homes::answering("sym-rst", Between::SymmetricTowards);
    let Some(runs) = router_variant(homes, "nat-symrst") else {
        return;
    };
    for run in runs.iter().filter(|r| r.nated) {
        for d in run.details() {
            assert_eq!(PeerRun::field(d, "reach"), "punchable", "{}: {d}", run.name);
        }
    }
    assert_never_linked_after_the_first_round(&runs);
}

/// The NATed pair of a scenario never had a punched link, and after the first round each of
/// them linked to the two public peers only (the pair was planned without traffic).
fn assert_never_linked_after_the_first_round(runs: &[PeerRun]) {
    for run in runs.iter().filter(|r| r.nated) {
        // DCUtR may punch to the public peers (it runs on every relayed connection); never a
        // link between the two NATed peers.
        for d in run.details() {
            let links = PeerRun::field(d, "links");
            assert!(!links.contains("punched"), "{}: {d}", run.name);
        }
        for d in &run.details()[1..] {
            let links: Vec<&str> = PeerRun::field(d, "links").split(',').collect();
            // Linked to the two public peers only.
            assert_eq!(
                links.iter().filter(|l| **l == "tls").count(),
                2,
                "{}: {d}",
                run.name
            );
        }
    }
}
