//! Peers on a test bed of network namespaces: public hosts on a private internet and hosts
//! behind home-router NATs (see `tests/netns`). These tests need root, `ip` and `iptables`;
//! elsewhere they print `skipped: <reason>` and pass.
//!
//! The first tests check the bed itself with plain sockets; the swarm tests run the real
//! `hivemesh` binary and the `join` example inside the namespaces.

mod netns;

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use netns::{Host, Nat, Testbed};
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
/// `cargo test` builds the examples; `cargo test --test nat` alone does not (run `cargo build
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
            let args = [
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
