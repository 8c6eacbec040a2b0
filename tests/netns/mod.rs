//! A test bed of network namespaces: "hosts" on a private internet, some behind home-router
//! NATs, running real processes. For NAT-traversal tests and WAN benchmarks on one Linux machine.
//!
//! Include it with `mod netns;` from a test, or with
//! `#[path = "../tests/netns/mod.rs"] mod netns;` from a bench.
//!
//! # Topology
//!
//! ```text
//!         <bed>-internet: bridge br0, no address, 10.77.0.0/16
//!        +---------------+------------------+-----------------------+
//!     p1 |            p2 |               p3 |                    p4 | (bridge ports)
//!   eth0 |          eth0 |              wan |                   wan |
//! +------+-----+  +------+-----+    +-------+------------+  +-------+------------+
//! | <bed>-a    |  | <bed>-b    |    | <bed>-cone-rt      |  | <bed>-sym-rt       |
//! | public     |  | public     |    | wan 10.77.0.13     |  | wan 10.77.0.14     |
//! | 10.77.0.11 |  | 10.77.0.12 |    | MASQUERADE         |  | MASQUERADE         |
//! +------------+  +------------+    | (port-preserving)  |  | --random-fully     |
//!                                   | drops unsolicited  |  | drops unsolicited  |
//!                                   +-------+------------+  +-------+------------+
//!                                       lan | 192.168.1.1       lan | 192.168.2.1
//!                                      eth0 | 192.168.1.2      eth0 | 192.168.2.2
//!                                   +-------+------------+  +-------+------------+
//!                                   | <bed>-cone         |  | <bed>-sym          |
//!                                   | home host          |  | home host          |
//!                                   | default via .1     |  | default via .1     |
//!                                   +--------------------+  +--------------------+
//! ```
//!
//! - The internet is a bridge in a namespace of its own, with no address and no route anywhere.
//!   Public hosts and home routers are on-link there, in 10.77.0.0/16, and have no default route:
//!   nothing can leave the bed, and public hosts have no route to any home LAN.
//! - A home router forwards (`net.ipv4.ip_forward=1`) and masquerades what leaves its WAN link;
//!   its filter table accepts from the WAN only packets of connections opened from inside
//!   (`ESTABLISHED,RELATED`) and drops the rest, both to the LAN (`FORWARD`) and to itself
//!   (`INPUT`), like a home router without port forwarding ([`Unsolicited::Drop`]). Many real
//!   routers drop only what they would forward and let their own kernel answer the rest: a
//!   reset for a TCP SYN, an ICMP port-unreachable for UDP ([`Unsolicited::Answer`],
//!   [`Testbed::home_with`]). No hairpinning: a home host cannot reach its own router's WAN
//!   address. [`Testbed::separate`] cuts two homes off from each other (a pair no hole punch
//!   can ever join); [`Testbed::symmetric_towards`] makes one home's router symmetric towards
//!   another home only (a pair whose routers defeat every punch, though both look punchable).
//! - [`Nat::PortPreserving`] is plain `MASQUERADE`: Linux keeps the source port when the mapped
//!   tuple is free, so the mapping is endpoint-independent in practice (hole punching can work).
//!   [`Nat::Symmetric`] is `MASQUERADE --random-fully`: a random public port per connection.
//! - Every interface is created directly inside the bed's namespaces (`ip -n A link add X type
//!   veth peer name Y netns B`), never in the host's own namespace, so interface names are short
//!   and fixed (`eth0`, `wan`, `lan`, `br0`, `p<N>`) and cannot collide with anything outside.
//!   IPv6 is off in every bed namespace (no link-local chatter; addresses are IPv4 only), and
//!   only routers forward (a new namespace would copy `ip_forward` from the host's).
//!
//! # Life cycle
//!
//! [`Testbed::new`] returns `None`, after printing `skipped: <reason>` to stderr, when the bed
//! cannot be built (not root, no `ip`, no `iptables`, namespaces or NAT unavailable); a test then
//! returns early. With `HIVEMESH_NETNS_REQUIRED=1` in the environment it panics instead, so a CI
//! job that must run these tests cannot silently skip them.
//!
//! Namespaces are named `hmtb-<pid>-<bed>-<tag>-<host>`. One bed exists at a time per process
//! (a process-wide mutex, held by the [`Testbed`]), because tests run on several threads. On
//! drop, even while a test panics, the bed kills every process in its namespaces and deletes
//! them. [`Testbed::new`] also removes what a crashed or killed earlier run left behind (names
//! whose pid is no longer alive). Processes started with [`Testbed::spawn`] also get `SIGKILL`
//! when the thread that started them ends (`PR_SET_PDEATHSIG`), so a test binary killed with
//! Ctrl-C does not leave them running.

#![allow(dead_code)] // each test binary (or bench) uses a part of it

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

/// Prefix of every namespace a bed creates; followed by `<pid>-`.
const PREFIX: &str = "hmtb-";
/// Where `ip netns` keeps its namespace handles.
const NETNS_DIR: &str = "/var/run/netns";
/// The internet's subnet: 10.77.0.0/16.
const INTERNET_NET: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 0);
const INTERNET_PREFIX: u8 = 16;
/// Set (to anything but `0`) to make [`Testbed::new`] panic where it would skip.
const REQUIRE_ENV: &str = "HIVEMESH_NETNS_REQUIRED";

/// One bed at a time per process.
static BED_LOCK: Mutex<()> = Mutex::new(());
static NEXT_BED: AtomicUsize = AtomicUsize::new(0);

/// The kind of NAT a home router applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Nat {
    /// `MASQUERADE`: keeps the source port when it can (endpoint-independent mapping).
    PortPreserving,
    /// `MASQUERADE --random-fully`: a new random public port for every connection.
    Symmetric,
}

/// What a home router does with an unsolicited packet from the WAN (one that belongs to no
/// connection opened from inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unsolicited {
    /// Dropped silently, both on the way to the LAN (`FORWARD`) and to the router itself
    /// (`INPUT`): the sender hears nothing.
    Drop,
    /// Dropped only on the way to the LAN (`FORWARD`). The router's own kernel answers what is
    /// addressed to it: a TCP SYN to an unmapped port with a reset, a UDP datagram with an ICMP
    /// port-unreachable, as many real routers do. A hole punch's first packet, arriving before
    /// the other side's own packet made the mapping, is then refused instead of lost.
    Answer,
}

/// A host of the bed: a network namespace with one address.
#[derive(Clone, Debug)]
pub struct Host {
    name: String,
    ns: String,
    ip: Ipv4Addr,
    router: Option<Router>,
    /// Both ends of the link [`Testbed::rate_limit`] shapes: (namespace, device).
    uplink: [(String, String); 2],
}

#[derive(Clone, Debug)]
struct Router {
    ns: String,
    wan_ip: Ipv4Addr,
    nat: Nat,
    unsolicited: Unsolicited,
}

impl Host {
    /// The name given to [`Testbed::public_host`] or [`Testbed::home`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host's network namespace (for `ip netns exec`).
    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// The host's own address: on the internet for a public host, on the LAN for a home host.
    pub fn ip(&self) -> IpAddr {
        IpAddr::V4(self.ip)
    }

    /// The address others see this host's connections come from: its own for a public host,
    /// the router's WAN address for a home host.
    pub fn public_ip(&self) -> IpAddr {
        IpAddr::V4(self.router.as_ref().map_or(self.ip, |r| r.wan_ip))
    }

    /// The home router's WAN address (`None` for a public host).
    pub fn router_ip(&self) -> Option<IpAddr> {
        self.router.as_ref().map(|r| IpAddr::V4(r.wan_ip))
    }

    /// The home router's namespace (`None` for a public host).
    pub fn router_namespace(&self) -> Option<&str> {
        self.router.as_ref().map(|r| r.ns.as_str())
    }

    /// The home router's NAT (`None` for a public host).
    pub fn nat(&self) -> Option<Nat> {
        self.router.as_ref().map(|r| r.nat)
    }

    /// What the home router does with unsolicited packets (`None` for a public host).
    pub fn unsolicited(&self) -> Option<Unsolicited> {
        self.router.as_ref().map(|r| r.unsolicited)
    }

    /// Runs `f` on a thread inside this host's namespace and returns its result; sockets `f`
    /// creates belong to the host (and stay usable from any thread afterwards).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_namespace(&self.ns, f)
    }
}

/// Runs `f` on a new thread that has joined network namespace `ns` (`setns`); a panic in `f`
/// is resumed on the caller's thread.
pub fn in_namespace<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    let path = Path::new(NETNS_DIR).join(ns);
    thread::scope(|s| {
        let worker = s.spawn(move || {
            let file =
                File::open(&path).unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
            // SAFETY: setns on a valid descriptor; it only changes this thread's namespace.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "setns {}: {}",
                path.display(),
                io::Error::last_os_error()
            );
            f()
        });
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// A set of namespaces forming an internet with public hosts and NATed homes.
///
/// Dropping it kills every process in its namespaces and deletes them.
pub struct Testbed {
    /// `hmtb-<pid>-<n>-<tag>`: the prefix of all its namespace names.
    id: String,
    internet: String,
    /// Created namespaces, in creation order (deleted in reverse).
    namespaces: Vec<String>,
    names: HashSet<String>,
    /// Bridge ports (and internet addresses) handed out so far.
    ports: u32,
    homes: u32,
    /// Declared last: released after `Drop::drop` has cleaned up.
    _guard: MutexGuard<'static, ()>,
}

impl fmt::Debug for Testbed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Testbed")
            .field("id", &self.id)
            .field("namespaces", &self.namespaces)
            .finish()
    }
}

impl Testbed {
    /// Builds an empty internet (the bridge namespace), or returns `None` after printing
    /// `skipped: <reason>` when this machine cannot host a bed. `tag` (letters, digits, `-`)
    /// names the bed in namespace names and messages. Blocks while another bed of this process
    /// exists.
    pub fn new(tag: &str) -> Option<Testbed> {
        let tag = sanitize(tag);
        if let Err(reason) = preflight() {
            return skip(&tag, &reason);
        }
        let guard = BED_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        remove_leftovers();
        let id = format!(
            "{PREFIX}{}-{}-{tag}",
            std::process::id(),
            NEXT_BED.fetch_add(1, Ordering::Relaxed)
        );
        let mut bed = Testbed {
            internet: format!("{id}-internet"),
            id,
            namespaces: Vec::new(),
            names: HashSet::new(),
            ports: 0,
            homes: 0,
            _guard: guard,
        };
        match bed.build_internet() {
            Ok(()) => Some(bed),
            // Dropping the bed removes whatever part was built.
            Err(reason) => skip(&tag, &reason),
        }
    }

    fn build_internet(&mut self) -> Result<(), String> {
        let inet = self.internet.clone();
        self.add_namespace(&inet)?;
        ip(&["-n", &inet, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &inet, "link", "set", "br0", "up"])?;
        // Homes need NAT; check it works here before a test relies on it.
        netns_exec(&inet, "iptables", &["-t", "nat", "-L", "POSTROUTING", "-n"])
            .map_err(|e| format!("iptables cannot use the nat table in a namespace: {e}"))?;
        Ok(())
    }

    /// The prefix of this bed's namespace names.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The bed's namespaces, the internet's included.
    pub fn namespaces(&self) -> &[String] {
        &self.namespaces
    }

    /// A host on the internet: namespace `<bed>-<name>` with `eth0` on the bridge, the next
    /// free address of 10.77.0.0/16 and loopback up.
    pub fn public_host(&mut self, name: &str) -> Host {
        let (name, ns) = self.claim(name);
        must(self.add_namespace(&ns));
        let (port, addr) = self.attach(&ns, "eth0");
        up(&ns, "lo");
        Host {
            name,
            uplink: [(ns.clone(), "eth0".into()), (self.internet.clone(), port)],
            ns,
            ip: addr,
            router: None,
        }
    }

    /// A home: router namespace `<bed>-<name>-rt` (`wan` on the bridge with the next free
    /// internet address, `lan` 192.168.N.1/24) and the home host `<bed>-<name>` (`eth0`
    /// 192.168.N.2/24, default route via the router), N = 1, 2, ... per home. The router
    /// forwards, masquerades per `nat`, and drops unsolicited packets from the WAN silently
    /// ([`Unsolicited::Drop`]; [`Testbed::home_with`] chooses).
    pub fn home(&mut self, name: &str, nat: Nat) -> Host {
        self.home_with(name, nat, Unsolicited::Drop)
    }

    /// A home as [`Testbed::home`] makes it, whose router treats unsolicited packets from the
    /// WAN as `unsolicited` says.
    pub fn home_with(&mut self, name: &str, nat: Nat, unsolicited: Unsolicited) -> Host {
        let (name, ns) = self.claim(name);
        let (_, rt) = self.claim(&format!("{name}-rt"));
        self.homes += 1;
        let n = self.homes;
        assert!(n <= 254, "at most 254 homes per bed");
        must(self.add_namespace(&rt));
        must(self.add_namespace(&ns));
        let (port, wan_ip) = self.attach(&rt, "wan");
        let lan_ip = Ipv4Addr::new(192, 168, n as u8, 1);
        let host_ip = Ipv4Addr::new(192, 168, n as u8, 2);
        must(ip(&[
            "-n", &rt, "link", "add", "lan", "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]));
        must(ip(&[
            "-n",
            &rt,
            "addr",
            "add",
            &format!("{lan_ip}/24"),
            "dev",
            "lan",
        ]));
        up(&rt, "lan");
        up(&rt, "lo");
        must(ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{host_ip}/24"),
            "dev",
            "eth0",
        ]));
        up(&ns, "eth0");
        up(&ns, "lo");
        must(ip(&[
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &lan_ip.to_string(),
        ]));
        must(sysctls(&rt, &[("net/ipv4/ip_forward", "1")]));
        let mut masquerade = vec!["-t", "nat", "-A", "POSTROUTING", "-o", "wan"];
        masquerade.extend(["-j", "MASQUERADE"]);
        if nat == Nat::Symmetric {
            masquerade.push("--random-fully");
        }
        must(netns_exec(&rt, "iptables", &masquerade));
        let chains: &[&str] = match unsolicited {
            Unsolicited::Drop => &["FORWARD", "INPUT"],
            Unsolicited::Answer => &["FORWARD"],
        };
        for &chain in chains {
            let established = [
                "-A",
                chain,
                "-i",
                "wan",
                "-m",
                "state",
                "--state",
                "ESTABLISHED,RELATED",
                "-j",
                "ACCEPT",
            ];
            must(netns_exec(&rt, "iptables", &established));
            must(netns_exec(
                &rt,
                "iptables",
                &["-A", chain, "-i", "wan", "-j", "DROP"],
            ));
        }
        Host {
            name,
            uplink: [(rt.clone(), "wan".into()), (self.internet.clone(), port)],
            ns,
            ip: host_ip,
            router: Some(Router {
                ns: rt,
                wan_ip,
                nat,
                unsolicited,
            }),
        }
    }

    /// Cuts the internet between two homes: each router drops what its LAN sends to the other
    /// router's WAN address. No packet from one ever makes a mapping in its NAT for the other,
    /// so what the other sends is unsolicited (dropped or answered, per the router): a hole
    /// punch between the two can never work, while both still reach everyone else (relays
    /// included). A pair that looks punchable and is not.
    pub fn separate(&self, a: &Host, b: &Host) {
        let (Some(ra), Some(rb)) = (&a.router, &b.router) else {
            panic!(
                "separate: {} and {} must both be home hosts",
                a.name, b.name
            );
        };
        for (r, other) in [(ra, rb.wan_ip), (rb, ra.wan_ip)] {
            let other = other.to_string();
            let out = ["-I", "FORWARD", "-o", "wan", "-d", &other, "-j", "DROP"];
            must(netns_exec(&r.ns, "iptables", &out));
        }
    }

    /// Makes `host`'s router map connections to `other`'s router like a symmetric NAT (a new
    /// random public port per connection: `MASQUERADE --random-fully` for that destination
    /// only), while it keeps ports towards everyone else. Observers on the internet still see
    /// a port-preserving NAT (the host classifies itself as punchable), but every packet of a
    /// hole punch towards `other` leaves from a port that `other` did not aim at: with `other`
    /// answering unsolicited packets ([`Unsolicited::Answer`]) the punch's packets are reset or
    /// refused on both sides, every time. A pair whose routers make punching impossible.
    pub fn symmetric_towards(&self, host: &Host, other: &Host) {
        let (Some(r), Some(o)) = (&host.router, &other.router) else {
            panic!(
                "symmetric_towards: {} and {} must both be home hosts",
                host.name, other.name
            );
        };
        let other = o.wan_ip.to_string();
        let rule = [
            "-t",
            "nat",
            "-I",
            "POSTROUTING",
            "1",
            "-o",
            "wan",
            "-d",
            &other,
            "-j",
            "MASQUERADE",
            "--random-fully",
        ];
        must(netns_exec(&r.ns, "iptables", &rule));
    }

    /// Limits `host`'s link to `mbit` Mbit/s in each direction: `tbf rate <mbit>mbit burst
    /// 256kb latency 100ms` on the egress of both ends of the link. For a public host that is
    /// its `eth0` and the bridge port; for a home host it is the router's WAN link (the home's
    /// line to its ISP); the LAN stays unlimited. Calling it again replaces the limit.
    pub fn rate_limit(&self, host: &Host, mbit: u32) {
        self.rate_limit_each(host, mbit, mbit);
    }

    /// Like [`Testbed::rate_limit`] with a different rate per direction: `up_mbit` from the
    /// host (its end's egress), `down_mbit` to it (the internet end's egress): a home line.
    pub fn rate_limit_each(&self, host: &Host, up_mbit: u32, down_mbit: u32) {
        assert!(
            up_mbit > 0 && down_mbit > 0,
            "rate_limit: rates must be positive"
        );
        for ((ns, dev), mbit) in host.uplink.iter().zip([up_mbit, down_mbit]) {
            let rate = format!("{mbit}mbit");
            must(run(Command::new("tc").args([
                "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst",
                "256kb", "latency", "100ms",
            ])));
        }
    }

    /// Starts `program args...` inside `host`'s namespace (`ip netns exec`, which execs the
    /// program: the child's pid is the program's). Stdin is null (see
    /// [`Testbed::spawn_with_stdin`]); stdout and stderr are
    /// collected line by line (see [`Proc`]). The process gets `SIGKILL` when the [`Proc`] is
    /// dropped, when the bed is dropped, or when the thread that called `spawn` ends
    /// (`PR_SET_PDEATHSIG`): keep it on the test's thread. `SIGINT` is reset to its default in
    /// the child, so [`Proc::interrupt`] acts like Ctrl-C however the test was started.
    pub fn spawn<I, S>(&self, host: &Host, program: &Path, args: I) -> Proc
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.start(host, program, args, false)
    }

    /// Like [`Testbed::spawn`], with stdin a pipe the test writes to with [`Proc::send_line`]
    /// (closed when the [`Proc`] is dropped).
    pub fn spawn_with_stdin<I, S>(&self, host: &Host, program: &Path, args: I) -> Proc
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.start(host, program, args, true)
    }

    fn start<I, S>(&self, host: &Host, program: &Path, args: I, piped_stdin: bool) -> Proc
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &host.ns])
            .arg(program)
            .args(args)
            .stdin(if piped_stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // SAFETY: prctl and signal are async-signal-safe and touch only the child.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(io::Error::last_os_error());
                }
                // A test run started in the background of a shell ignores SIGINT, and ignored
                // signals are inherited: give `interrupt` its Ctrl-C meaning back.
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let label = format!(
            "{}@{}",
            program.file_name().map_or_else(
                || program.display().to_string(),
                |n| n.to_string_lossy().into()
            ),
            host.name
        );
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("starting {label}: {e}"));
        Proc::new(label, child)
    }

    /// Reserves a host name (a home also takes `<name>-rt` for its router); returns it and its
    /// namespace name.
    fn claim(&mut self, name: &str) -> (String, String) {
        let name = sanitize(name);
        assert!(
            name != "internet" && self.names.insert(name.clone()),
            "host name '{name}' is taken in this bed"
        );
        (name.clone(), format!("{}-{name}", self.id))
    }

    fn add_namespace(&mut self, ns: &str) -> Result<(), String> {
        ip(&["netns", "add", ns])?;
        self.namespaces.push(ns.to_owned());
        // A new namespace copies IPv4 settings from the host's (devconf_inherit_init_net=0):
        // only routers forward, whatever the host does.
        sysctls(ns, &[("net/ipv4/ip_forward", "0")])?;
        // Missing when the kernel has no IPv6: nothing to turn off then.
        let _ = sysctls(
            ns,
            &[
                ("net/ipv6/conf/all/disable_ipv6", "1"),
                ("net/ipv6/conf/default/disable_ipv6", "1"),
            ],
        );
        Ok(())
    }

    /// A veth from `dev` in `ns` to a new bridge port, with the next internet address on `dev`.
    /// Returns the port's name and the address.
    fn attach(&mut self, ns: &str, dev: &str) -> (String, Ipv4Addr) {
        self.ports += 1;
        let index = 10 + self.ports;
        assert!(index < 65_000, "the internet is full");
        let port = format!("p{}", self.ports);
        let addr = Ipv4Addr::from(u32::from(INTERNET_NET) + index);
        let inet = &self.internet;
        must(ip(&[
            "-n", ns, "link", "add", dev, "type", "veth", "peer", "name", &port, "netns", inet,
        ]));
        must(ip(&["-n", inet, "link", "set", &port, "master", "br0"]));
        up(inet, &port);
        must(ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("{addr}/{INTERNET_PREFIX}"),
            "dev",
            dev,
        ]));
        up(ns, dev);
        (port, addr)
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            kill_all_in(ns);
        }
        for ns in self.namespaces.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("warning: deleting namespace {ns}: {e}");
            }
        }
    }
}

/// Which output stream a line came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stream {
    Stdout,
    Stderr,
}

/// A process running in a bed's namespace. Reader threads collect its stdout and stderr line
/// by line; every wait has a timeout. Killed (`SIGKILL`) and reaped on drop.
pub struct Proc {
    label: String,
    child: Child,
    /// The write end of its stdin, when spawned with [`Testbed::spawn_with_stdin`].
    stdin: Option<ChildStdin>,
    rx: Receiver<(Stream, String)>,
    stdout: Vec<String>,
    stderr: Vec<String>,
    /// Stdout lines already offered to `wait_line`'s predicate.
    scanned: usize,
    /// Both reader threads have finished (the pipes are closed).
    eof: bool,
    status: Option<ExitStatus>,
}

impl fmt::Debug for Proc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proc")
            .field("label", &self.label)
            .field("pid", &self.child.id())
            .field("status", &self.status)
            .finish()
    }
}

impl Proc {
    fn new(label: String, mut child: Child) -> Proc {
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        for (pipe, stream) in [
            (Box::new(stdout) as Box<dyn Read + Send>, Stream::Stdout),
            (Box::new(stderr), Stream::Stderr),
        ] {
            let tx = tx.clone();
            thread::spawn(move || {
                let mut reader = BufReader::new(pipe);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match reader.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            let line = String::from_utf8_lossy(&buf);
                            let line = line.trim_end_matches(['\n', '\r']).to_owned();
                            if tx.send((stream, line)).is_err() {
                                break;
                            }
                        }
                    }
                }
            });
        }
        Proc {
            label,
            child,
            stdin,
            rx,
            stdout: Vec::new(),
            stderr: Vec::new(),
            scanned: 0,
            eof: false,
            status: None,
        }
    }

    /// `program@host`, for messages.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The process id (of the program itself: `ip netns exec` execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the next stdout line (after those returned or passed over by earlier calls)
    /// that satisfies `pred`, and returns it. Fails with `TimedOut` after `timeout`, or with
    /// `UnexpectedEof` as soon as the process has closed its output without such a line; the
    /// error's message carries the output so far.
    pub fn wait_line(
        &mut self,
        mut pred: impl FnMut(&str) -> bool,
        timeout: Duration,
    ) -> io::Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            while self.scanned < self.stdout.len() {
                let line = &self.stdout[self.scanned];
                self.scanned += 1;
                if pred(line) {
                    return Ok(line.clone());
                }
            }
            if self.eof {
                return Err(self.error(io::ErrorKind::UnexpectedEof, "closed its output"));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => self.push(line),
                Err(RecvTimeoutError::Disconnected) => self.eof = true,
                Err(RecvTimeoutError::Timeout) => {
                    let what = format!("printed no matching line within {timeout:?}");
                    return Err(self.error(io::ErrorKind::TimedOut, &what));
                }
            }
        }
    }

    /// All stdout lines received so far.
    pub fn stdout(&mut self) -> &[String] {
        self.drain();
        &self.stdout
    }

    /// All stderr lines received so far.
    pub fn stderr(&mut self) -> &[String] {
        self.drain();
        &self.stderr
    }

    /// Everything received so far, labelled, for assertion messages.
    pub fn transcript(&mut self) -> String {
        self.drain();
        let mut text = format!("--- {} (pid {}) stdout:\n", self.label, self.child.id());
        for line in &self.stdout {
            text += line;
            text.push('\n');
        }
        text += "--- stderr:\n";
        for line in &self.stderr {
            text += line;
            text.push('\n');
        }
        text
    }

    /// Writes `line` and a newline to the process's stdin (see [`Testbed::spawn_with_stdin`]).
    /// Fails if its stdin is not a pipe or the process has closed it.
    pub fn send_line(&mut self, line: &str) -> io::Result<()> {
        let label = &self.label;
        let stdin = self.stdin.as_mut().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotConnected,
                format!("{label}: stdin is not piped"),
            )
        })?;
        stdin.write_all(format!("{line}\n").as_bytes())?;
        stdin.flush()
    }

    /// Sends `SIGINT` (Ctrl-C), unless the process has already been reaped.
    pub fn interrupt(&mut self) -> io::Result<()> {
        self.signal(libc::SIGINT)
    }

    /// Sends `SIGKILL`, unless the process has already been reaped.
    pub fn kill(&mut self) -> io::Result<()> {
        self.signal(libc::SIGKILL)
    }

    fn signal(&mut self, signal: libc::c_int) -> io::Result<()> {
        // A reaped pid may belong to someone else by now; an unreaped one cannot.
        if self.try_status()?.is_some() {
            return Ok(());
        }
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits pid_t");
        // SAFETY: plain kill(2) on our own unreaped child.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The exit status if the process has exited (reaping it), without waiting.
    pub fn try_status(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait()?;
        }
        Ok(self.status)
    }

    /// Waits up to `timeout` for the process to exit, collecting its output meanwhile, then for
    /// its output to end (within what is left of `timeout`). Fails with `TimedOut` if it is
    /// still running; it is then left running (drop kills it).
    pub fn wait_with_timeout(&mut self, timeout: Duration) -> io::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.try_status()? {
                break status;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let what = format!("is still running after {timeout:?}");
                return Err(self.error(io::ErrorKind::TimedOut, &what));
            }
            // Poll the exit at least every 20 ms; read output while waiting.
            let slice = left.min(Duration::from_millis(20));
            if self.eof {
                thread::sleep(slice);
            } else {
                match self.rx.recv_timeout(slice) {
                    Ok(line) => self.push(line),
                    Err(RecvTimeoutError::Disconnected) => self.eof = true,
                    Err(RecvTimeoutError::Timeout) => {}
                }
            }
        };
        // The pipes close when the process (and anything that inherited them) is gone.
        while !self.eof {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left.max(Duration::from_millis(100))) {
                Ok(line) => self.push(line),
                Err(RecvTimeoutError::Disconnected) => self.eof = true,
                Err(RecvTimeoutError::Timeout) => break,
            }
        }
        Ok(status)
    }

    fn push(&mut self, (stream, line): (Stream, String)) {
        match stream {
            Stream::Stdout => self.stdout.push(line),
            Stream::Stderr => self.stderr.push(line),
        }
    }

    fn drain(&mut self) {
        loop {
            match self.rx.try_recv() {
                Ok(line) => self.push(line),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.eof = true;
                    break;
                }
            }
        }
    }

    fn error(&mut self, kind: io::ErrorKind, what: &str) -> io::Error {
        let transcript = self.transcript();
        let text = format!("{} {what}\n{transcript}", self.label);
        io::Error::new(kind, text)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Checks what does not need the lock: root, `ip` and `iptables`.
fn preflight() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err(format!(
            "not root (euid {euid}); network namespaces need root"
        ));
    }
    for (tool, hint) in [
        ("ip", "install iproute2"),
        ("tc", "install iproute2"),
        ("iptables", "apt-get install iptables"),
    ] {
        run(Command::new(tool).arg("-V"))
            .map_err(|e| format!("`{tool}` is not usable ({hint}): {e}"))?;
    }
    Ok(())
}

fn skip(tag: &str, reason: &str) -> Option<Testbed> {
    let required = std::env::var(REQUIRE_ENV).is_ok_and(|v| !v.is_empty() && v != "0");
    if required {
        panic!("test bed '{tag}' cannot be built and {REQUIRE_ENV} is set: {reason}");
    }
    eprintln!("skipped: {reason} (test bed '{tag}')");
    None
}

/// Deletes namespaces (killing their processes) left by earlier runs whose process is gone.
fn remove_leftovers() {
    let Ok(list) = run(Command::new("ip").args(["netns", "list"])) else {
        return;
    };
    for line in list.lines() {
        let Some(ns) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = ns
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            kill_all_in(ns);
            match ip(&["netns", "del", ns]) {
                Ok(()) => eprintln!("removed namespace {ns}, left by an earlier run"),
                Err(e) => eprintln!("warning: removing leftover namespace {ns}: {e}"),
            }
        }
    }
}

/// SIGKILLs every process in namespace `ns`.
fn kill_all_in(ns: &str) {
    let Ok(pids) = run(Command::new("ip").args(["netns", "pids", ns])) else {
        return;
    };
    for pid in pids
        .split_whitespace()
        .filter_map(|p| p.parse::<libc::pid_t>().ok())
    {
        // SAFETY: plain kill(2); a process that is gone already gives ESRCH.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// Writes `/proc/sys/<key>` = value inside namespace `ns` (net sysctls are per namespace).
fn sysctls(ns: &str, settings: &[(&str, &str)]) -> Result<(), String> {
    in_namespace(ns, || {
        for (key, value) in settings {
            std::fs::write(format!("/proc/sys/{key}"), value)
                .map_err(|e| format!("sysctl {key}={value} in {ns}: {e}"))?;
        }
        Ok(())
    })
}

fn up(ns: &str, dev: &str) {
    must(ip(&["-n", ns, "link", "set", dev, "up"]));
}

fn ip(args: &[&str]) -> Result<(), String> {
    run(Command::new("ip").args(args)).map(drop)
}

fn netns_exec(ns: &str, program: &str, args: &[&str]) -> Result<String, String> {
    run(Command::new("ip")
        .args(["netns", "exec", ns, program])
        .args(args))
}

/// Runs a setup command to completion; its stdout, or a message with its stderr.
fn run(command: &mut Command) -> Result<String, String> {
    let shown = format!("{command:?}");
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{shown}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{shown}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must<T>(result: Result<T, String>) -> T {
    result.unwrap_or_else(|e| panic!("test bed setup failed: {e}"))
}

/// Letters, digits and `-` (anything else becomes `-`), at most 24 characters.
fn sanitize(name: &str) -> String {
    let name: String = name
        .chars()
        .take(24)
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    assert!(!name.is_empty(), "an empty name");
    name
}
