//! Throughput of one data-plane stream (TLS 1.3, AES-128-GCM, PeerId-authenticated) between
//! two tasks of one process on loopback.
//!
//! Usage: `cargo run --release --example tls_throughput [-- MIB [REPS [plain]]]`
//!
//! Each rep sends MIB MiB (default 256; 5 reps by default) from the client to the server in
//! 1 MiB writes; the server reads everything and answers with one byte. The time runs from
//! the first write to that byte. Prints MB/s (1 MB = 1e6 B) per rep, the mean and the best.
//! `plain` runs the same transfer over a bare `TcpStream` (no TLS) as a baseline for the
//! machine. Both tasks share one tokio runtime with 2 workers, so on a 2-core machine sender
//! and receiver compete for the CPU (`../shared/reference/dataplane.md` measured 3-4 GB/s
//! between two processes).

use std::time::{Duration, Instant};

use hivemesh::transport::{DataIdentity, DataListener, connect};
use libp2p::identity::Keypair;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const CHUNK: usize = 1 << 20;
const TIMEOUT: Duration = Duration::from_secs(30);

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let reps: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(5);
    let plain = match args.next().as_deref() {
        None => false,
        Some("plain") => true,
        Some(other) => anyhow::bail!("unknown mode {other:?} (expected `plain`)"),
    };
    anyhow::ensure!(mib > 0 && reps > 0, "MIB and REPS must be positive");
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            let run = async {
                if plain {
                    let (server, client) = plain_pair().await?;
                    transfer(server, client, mib, reps).await
                } else {
                    let (server, client) = tls_pair().await?;
                    transfer(server, client, mib, reps).await
                }
            };
            tokio::time::timeout(Duration::from_secs(600), run)
                .await
                .map_err(|_| anyhow::anyhow!("benchmark did not finish within 600 s"))?
        })
}

/// An authenticated data-plane connection: (server side, client side).
async fn tls_pair() -> anyhow::Result<(
    hivemesh::transport::DataStream,
    hivemesh::transport::DataStream,
)> {
    let server_id = DataIdentity::new(&Keypair::generate_ed25519())?;
    let client_id = DataIdentity::new(&Keypair::generate_ed25519())?;
    let listener = DataListener::bind(&server_id, "127.0.0.1:0".parse()?).await?;
    let start = Instant::now();
    let (accepted, connected) = tokio::join!(
        listener.accept(TIMEOUT),
        connect(
            &client_id,
            listener.local_addr(),
            server_id.peer_id(),
            TIMEOUT
        )
    );
    let (_, server) = accepted?;
    let client = connected?;
    println!(
        "tls: handshake {:.1} ms (first in process), suite {}",
        start.elapsed().as_secs_f64() * 1e3,
        client.cipher_suite()
    );
    Ok((server, client))
}

/// A bare TCP connection with `TCP_NODELAY`: (server side, client side).
async fn plain_pair() -> anyhow::Result<(TcpStream, TcpStream)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let (accepted, connected) = tokio::join!(
        tokio::time::timeout(TIMEOUT, listener.accept()),
        tokio::time::timeout(TIMEOUT, TcpStream::connect(listener.local_addr()?))
    );
    let (server, _) = accepted??;
    let client = connected??;
    server.set_nodelay(true)?;
    client.set_nodelay(true)?;
    println!("plain TCP (no TLS)");
    Ok((server, client))
}

async fn transfer<S>(mut server: S, mut client: S, mib: usize, reps: usize) -> anyhow::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let total = mib
        .checked_mul(CHUNK)
        .ok_or_else(|| anyhow::anyhow!("MIB too large"))?;
    // Both ends run in spawned tasks (dataplane.md §5.4: not on the block_on thread).
    let receiver = tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        for _ in 0..reps {
            let mut left = total;
            while left > 0 {
                let n = server.read(&mut buf[..left.min(CHUNK)]).await?;
                anyhow::ensure!(n > 0, "stream ended early");
                left -= n;
            }
            server.write_all(&[1]).await?;
        }
        anyhow::Ok(())
    });
    let sender = tokio::spawn(async move {
        let chunk = vec![0xa5u8; CHUNK];
        let mut rates = Vec::with_capacity(reps);
        for rep in 0..reps {
            let start = Instant::now();
            for _ in 0..mib {
                client.write_all(&chunk).await?;
            }
            client.flush().await?;
            let mut ack = [0u8; 1];
            client.read_exact(&mut ack).await?;
            let secs = start.elapsed().as_secs_f64();
            let rate = total as f64 / secs / 1e6;
            println!(
                "rep {rep}: {mib} MiB in {:.1} ms = {rate:.0} MB/s",
                secs * 1e3
            );
            rates.push(rate);
        }
        anyhow::Ok(rates)
    });
    let rates = sender.await??;
    receiver.await??;
    let mean = rates.iter().sum::<f64>() / rates.len() as f64;
    let best = rates.iter().copied().fold(0.0, f64::max);
    println!("mean {mean:.0} MB/s, best {best:.0} MB/s ({reps} reps of {mib} MiB, 1 MiB writes)");
    Ok(())
}
