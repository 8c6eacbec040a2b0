//! The multi-process harness shared by `bench allreduce` and `bench steps`: the parent
//! re-executes this binary as worker processes and talks to them line by line (stdin down,
//! stdout up).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc as std_mpsc;

use anyhow::{Context, ensure};
use hivemesh::averager::node::{Node, NodeConfig};

/// Worker processes, killed if the harness returns early.
pub struct Workers {
    children: Vec<Child>,
    /// `(worker index, line)` from every worker's stdout; `"EOF"` once its stdout closes.
    pub lines: std_mpsc::Receiver<(usize, String)>,
}

impl Workers {
    /// Starts `n` workers: `hivemesh <subcommand> --index i <flag value>...` (the same flags
    /// for every worker).
    pub fn spawn(n: usize, subcommand: &str, flags: &[(&str, String)]) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the hivemesh binary")?;
        let (tx, lines) = std_mpsc::channel();
        let mut workers = Self {
            children: Vec::new(),
            lines,
        };
        for i in 0..n {
            let mut args = vec!["--index".to_owned(), i.to_string()];
            args.extend(flags.iter().flat_map(|(k, v)| [(*k).to_owned(), v.clone()]));
            let child = spawn_worker(&exe, subcommand, &args, tx.clone(), move |line| (i, line))?;
            workers.children.push(child);
        }
        Ok(workers)
    }

    /// Sends `line` to every worker.
    pub fn broadcast(&mut self, line: &str) -> anyhow::Result<()> {
        for c in &mut self.children {
            let stdin = c.stdin.as_mut().context("worker stdin")?;
            writeln!(stdin, "{line}")?;
            stdin.flush()?;
        }
        Ok(())
    }

    /// Sends `line` to the workers `to` returns true for.
    pub fn send_to(&mut self, to: impl Fn(usize) -> bool, line: &str) -> anyhow::Result<()> {
        for (i, c) in self.children.iter_mut().enumerate() {
            if to(i) {
                let stdin = c.stdin.as_mut().context("worker stdin")?;
                writeln!(stdin, "{line}")?;
                stdin.flush()?;
            }
        }
        Ok(())
    }

    /// Closes every worker's stdin and waits for all of them to exit successfully.
    pub fn finish(self) -> anyhow::Result<()> {
        self.finish_except(None)
    }

    /// Like [`Workers::finish`], except that worker `killed` must have died by SIGKILL.
    pub fn finish_except(mut self, killed: Option<usize>) -> anyhow::Result<()> {
        for c in &mut self.children {
            drop(c.stdin.take());
        }
        // Every worker is waited for, even after one failed (none is left running).
        let mut failure = None;
        for (i, mut c) in std::mem::take(&mut self.children).into_iter().enumerate() {
            let result = match c.wait() {
                Ok(status) if Some(i) == killed => {
                    use std::os::unix::process::ExitStatusExt;
                    if status.signal() == Some(9) {
                        Ok(())
                    } else {
                        Err(anyhow::anyhow!(
                            "worker {i} was to die by SIGKILL: {status}"
                        ))
                    }
                }
                Ok(status) if status.success() => Ok(()),
                Ok(status) => Err(anyhow::anyhow!("a worker failed: {status}")),
                Err(e) => Err(e.into()),
            };
            failure = failure.or(result.err());
        }
        failure.map_or(Ok(()), Err)
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `exe <subcommand> <args>` with piped stdin and stdout (stderr inherited); a thread
/// sends each stdout line through `tx`, tagged by `tag`, then `"EOF"`.
pub fn spawn_worker<T: Send + 'static>(
    exe: &std::path::Path,
    subcommand: &str,
    args: &[String],
    tx: std_mpsc::Sender<T>,
    tag: impl Fn(String) -> T + Send + 'static,
) -> anyhow::Result<Child> {
    let mut child = Command::new(exe)
        .arg(subcommand)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting a worker process")?;
    let stdout = child.stdout.take().context("worker stdout")?;
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(tag(line)).is_err() {
                break;
            }
        }
        let _ = tx.send(tag("EOF".to_owned()));
    });
    Ok(child)
}

/// A multi-threaded runtime with `threads` workers (harness parents use 1, workers 2).
pub fn runtime(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
}

/// Checks a harness's group shape: 2..=64 peers, groups of 2..=peers.
pub fn validate_group(peers: usize, group_size: usize) -> anyhow::Result<()> {
    ensure!(
        (2..=64).contains(&peers),
        "--peers must be between 2 and 64"
    );
    ensure!(
        (2..=peers).contains(&group_size),
        "--group-size must be between 2 and --peers"
    );
    Ok(())
}

/// Starts the harness's bootstrap node (swarm and DHT on loopback, no data plane) on
/// `runtime`; returns it with the address workers join through.
pub fn start_bootstrap(
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<(Node, libp2p::Multiaddr)> {
    runtime.block_on(async {
        let node = Node::start(
            NodeConfig::loopback_bootstrap(),
            libp2p::identity::Keypair::generate_ed25519(),
        )
        .await?;
        let addr = node.join_address().await?;
        anyhow::Ok((node, addr))
    })
}

/// In a worker: the parent's lines on stdin, read by a thread into a bounded channel (ends
/// when the parent closes stdin).
pub fn stdin_lines() -> tokio::sync::mpsc::Receiver<String> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.blocking_send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// How long [`PerfControl::from_env`] waits for perf to open its end of the FIFO.
pub const PERF_CTL_OPEN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Profiles only the timed operations: with `HIVEMESH_PERF_CTL=PATH`, the path of the FIFO
/// given to `perf record --control=fifo:PATH` (started with `-D -1`, i.e. disabled), the
/// parent writes `enable` to it just before it says `GO` for a timed round and `disable` once
/// every worker has ended it, so setup, input generation and the checks stay out of the
/// profile. Without the variable it does nothing.
pub struct PerfControl {
    fifo: Option<std::fs::File>,
    on: bool,
}

impl PerfControl {
    /// Opens the FIFO named by `HIVEMESH_PERF_CTL`, if set. Opening a FIFO waits for its
    /// reader: with no perf reading it within [`PERF_CTL_OPEN_TIMEOUT`], this is an error
    /// instead of a bench that never starts.
    pub fn from_env() -> anyhow::Result<Self> {
        let Some(path) = std::env::var_os("HIVEMESH_PERF_CTL") else {
            return Ok(Self {
                fifo: None,
                on: false,
            });
        };
        let (tx, rx) = std_mpsc::sync_channel(1);
        let opening = path.clone();
        // A thread of its own: `open` on a FIFO blocks, with no timeout of its own. One that
        // never returns ends with the process.
        std::thread::spawn(move || {
            let _ = tx.send(std::fs::OpenOptions::new().write(true).open(&opening));
        });
        let fifo = rx
            .recv_timeout(PERF_CTL_OPEN_TIMEOUT)
            .map_err(|_| {
                anyhow::anyhow!(
                    "HIVEMESH_PERF_CTL {path:?}: nobody opened it for reading within {:?} \
                     (start the bench under `perf record --control=fifo:...`)",
                    PERF_CTL_OPEN_TIMEOUT
                )
            })?
            .with_context(|| format!("opening HIVEMESH_PERF_CTL {path:?}"))?;
        Ok(Self {
            fifo: Some(fifo),
            on: false,
        })
    }

    /// Turns recording on (`true`) or off; says so only when that changes it.
    pub fn set(&mut self, on: bool) -> anyhow::Result<()> {
        if let Some(fifo) = self.fifo.as_mut().filter(|_| on != self.on) {
            fifo.write_all(if on { b"enable\n" } else { b"disable\n" })
                .context("writing to HIVEMESH_PERF_CTL")?;
            self.on = on;
        }
        Ok(())
    }
}
