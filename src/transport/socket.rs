//! Options of the data plane's TCP sockets.
//!
//! - `TCP_NODELAY`: frames go out as written (the record layer already writes whole records).
//! - `TCP_NOTSENT_LOWAT` ([`NOTSENT_LOWAT`], Linux): the socket takes more bytes only while
//!   fewer than that many wait unsent in it. Without it the kernel buffers up to its autotuned
//!   send buffer (4 MiB per socket by default) beyond what is in flight, so a write returns
//!   long before its bytes are on the line: a sender's measured upload rate
//!   ([`crate::runner::traffic`]) read 1-4 Gbit/s on a 25 Mbit/s line, the plan took a slow
//!   uplink for a fast one and paced its flows 3x over its line. With it, a write completes
//!   about when its bytes leave (within [`NOTSENT_LOWAT`]), and a frame queued later (an
//!   average after a run of parts) waits behind at most that much of this socket's bytes.
//!   What is in flight (the congestion window) is not limited, so throughput is not either.

use std::io;

use tokio::net::TcpStream;

/// The most bytes a data-plane socket holds unsent (module docs).
pub const NOTSENT_LOWAT: usize = 256 << 10;

/// Sets the data plane's options on `tcp`. Only `TCP_NODELAY` failing is an error; a kernel
/// without `TCP_NOTSENT_LOWAT` still moves the bytes, with coarser upload measurements.
pub(crate) fn tune(tcp: &TcpStream) -> io::Result<()> {
    tcp.set_nodelay(true)?;
    if let Err(e) = set_notsent_lowat(tcp, NOTSENT_LOWAT) {
        tracing::debug!(error = %e, "cannot set TCP_NOTSENT_LOWAT");
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn set_notsent_lowat(tcp: &TcpStream, bytes: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `fd` is an open socket owned by `tcp`, which outlives the call; the option's
    // value is a valid `c_int` whose size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_NOTSENT_LOWAT,
            std::ptr::from_ref(&value).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_notsent_lowat(_tcp: &TcpStream, _bytes: usize) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "TCP_NOTSENT_LOWAT is set on Linux only",
    ))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The option is set on a connected socket and reads back as set.
    #[tokio::test]
    async fn a_tuned_socket_holds_at_most_the_low_water_mark_unsent() {
        use std::os::fd::AsRawFd;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tcp, _accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let tcp = tcp.unwrap();
        tune(&tcp).unwrap();
        assert!(tcp.nodelay().unwrap());
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: as in `set_notsent_lowat`, with `value` and `len` writable.
        let rc = unsafe {
            libc::getsockopt(
                tcp.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                std::ptr::from_mut(&mut value).cast::<libc::c_void>(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        assert_eq!(value as usize, NOTSENT_LOWAT);
    }
}
