//! TCP simultaneous open: how two peers behind NATs make a direct TCP connection for the data
//! plane ([`PunchSocket`]).
//!
//! Each peer binds a fresh local port (no listener on it), learns the other's endpoint as its
//! NAT maps it (over the hole-punched libp2p connection, see `crate::links`), and both connect
//! to each other at once. A NAT that maps a local port to the same external port for every
//! destination (the port-preserving routers of [`crate::reach::Reach::Punchable`] peers) lets
//! the other side's SYN in once its own SYN went out; the two SYNs cross and both sockets
//! connect (RFC 9293's simultaneous open), or one side's retransmitted SYN meets the other's
//! socket still connecting. A SYN that arrives before the other side's socket exists is answered
//! with a reset (or dropped by its NAT), so connecting is retried on the same port until the
//! deadline. With no listener on the port, a connection can form only this way: neither side
//! ever mistakes it for an accepted client.
//!
//! **Routers that answer.** Many home routers answer a SYN to an unmapped port themselves, with a
//! reset, instead of dropping it. Then every SYN that arrives before the other side's SYN left
//! its router is refused, and the reset also closes the sender's own mapping, so the other
//! side's SYN is refused in turn. Both sides retrying after the same fixed pause stay in step,
//! each SYN arriving while the other side pauses (measured on the namespace bed: not one of
//! 150 retries in 3 s crossed). So a reset is retried at once, after a random pause of at most
//! [`RETRY_JITTER`]: each side sends about one SYN per round trip, out of step with the other,
//! and two SYNs soon cross in flight (both routers then hold a mapping and let the other in).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// Longest wait on one connect attempt before trying again (the kernel retransmits the SYN
/// after 1 s; a fresh attempt sends one at once).
const ATTEMPT: Duration = Duration::from_millis(500);
/// Longest random pause after an attempt that failed at once (a reset): short, so that a SYN
/// follows about every round trip, and random, so that the two sides do not stay in step.
pub const RETRY_JITTER: Duration = Duration::from_millis(2);

/// A bound local port for a simultaneous open.
#[derive(Debug)]
pub struct PunchSocket {
    socket: Option<TcpSocket>,
    local: SocketAddr,
}

fn socket_for(local: SocketAddr) -> io::Result<TcpSocket> {
    let socket = if local.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    #[cfg(unix)]
    socket.set_reuseport(true)?;
    socket.bind(local)?;
    Ok(socket)
}

impl PunchSocket {
    /// Binds a fresh port on all IPv4 interfaces.
    pub fn bind() -> io::Result<Self> {
        let socket = socket_for(SocketAddr::from(([0, 0, 0, 0], 0)))?;
        let local = socket.local_addr()?;
        Ok(Self {
            socket: Some(socket),
            local,
        })
    }

    /// The bound local port.
    pub fn port(&self) -> u16 {
        self.local.port()
    }

    /// Connects to `remote` from the bound port, trying again until `deadline` (the other side
    /// does the same towards us).
    pub async fn connect(mut self, remote: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
        let mut last = io::Error::new(io::ErrorKind::TimedOut, "no attempt before the deadline");
        while Instant::now() < deadline {
            let socket = match self.socket.take() {
                Some(s) => s,
                None => socket_for(self.local)?,
            };
            let until = deadline.min(Instant::now() + ATTEMPT);
            match tokio::time::timeout_at(until, socket.connect(remote)).await {
                Ok(Ok(stream)) => return Ok(stream),
                Ok(Err(e)) => {
                    last = e;
                    let pause = RETRY_JITTER.mul_f64(rand::random::<f64>());
                    let left = deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(pause.min(left)).await;
                }
                Err(_) => {
                    last = io::Error::new(io::ErrorKind::TimedOut, "connect attempt timed out");
                }
            }
        }
        Err(io::Error::new(
            last.kind(),
            format!("no simultaneous open with {remote}: {last}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket connects to a listener (the simultaneous open itself, both sides connecting
    /// through port-preserving NATs, runs in `tests/integration/nat.rs`: on loopback nothing drops the
    /// early SYN, and the reset comes back before the other side's SYN can cross it).
    #[tokio::test]
    async fn connects_from_its_bound_port() {
        let a = PunchSocket::bind().unwrap();
        let from = a.port();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = listener.local_addr().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let (connected, accepted) = tokio::join!(a.connect(to, deadline), listener.accept());
        let (mut connected, (mut accepted, seen)) = (connected.unwrap(), accepted.unwrap());
        assert_eq!(seen.port(), from);
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        connected.write_all(b"ping").await.unwrap();
        let mut buf = [0; 4];
        accepted.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
    }

    /// Nobody on the other side: refused attempts are retried from the same port (binding it
    /// again works: the error is the refusal, not an address in use) until the deadline.
    #[tokio::test]
    async fn no_peer_fails_by_the_deadline() {
        let a = PunchSocket::bind().unwrap();
        let nobody = PunchSocket::bind().unwrap();
        let port = nobody.port();
        drop(nobody);
        let deadline = Instant::now() + Duration::from_millis(300);
        let r = a
            .connect(SocketAddr::from(([127, 0, 0, 1], port)), deadline)
            .await;
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::ConnectionRefused);
    }
}
