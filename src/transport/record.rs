//! The TLS 1.3 record layer of an established [`super::DataStream`], done by us instead of
//! rustls once the handshake is over, so that the bulk bytes are never copied in user space.
//!
//! # Why
//!
//! rustls' buffered connection copies every byte once on the way out (plaintext into a record
//! buffer, then encrypted in place) and twice on the way in (socket buffer into its deframer
//! buffer, then decrypted plaintext out to the caller), and it reads at most one 16 KiB record
//! per syscall. On the 2-core test machine those memmoves were about a fifth of an all-reduce
//! round's CPU. Here:
//!
//! * **sending** seals each record straight from the caller's slice into the send buffer
//!   (plaintext in, ciphertext out, the inner content-type byte and the tag appended) and
//!   writes the buffer with large `write` calls;
//! * **receiving** reads the socket into one large buffer and opens each record straight into
//!   the caller's buffer. Only a record the caller has no room for (the tail of a frame) goes
//!   through a 16 KiB staging buffer.
//!
//! The AEAD is aws-lc's (out of place, as above) or, for AES-128-GCM on x86-64 CPUs with VAES
//! but no AVX-512, ring's faster VAES code, which works in place on a copy made in the send
//! buffer or the caller's buffer (the [`aead`] module says why and how it chooses).
//!
//! This is what kernel TLS does with the same secrets; kTLS is not available on the machines
//! we run on (`setsockopt(TCP_ULP, "tls")` fails), so the record layer lives here.
//!
//! # Protocol (RFC 8446 §5), as far as it is used
//!
//! * The handshake runs in rustls, over [`HandshakeIo`], which hands rustls the socket's bytes
//!   one record at a time: when rustls reports the handshake complete it holds no byte of a
//!   later record, and the bytes already read from the socket move, unparsed, into the record
//!   layer. The traffic secrets and sequence numbers then come from rustls'
//!   `dangerous_extract_secrets` (the kTLS hand-over API).
//! * Every record is `TLSCiphertext`: outer type application_data (23), legacy version 0x0303,
//!   a length of at most 2^14 + 256, then the AEAD output over `TLSInnerPlaintext` (content,
//!   one content-type byte, optional zero padding), with the 5-byte header as associated data
//!   and the per-record nonce `iv XOR seq` (the 64-bit sequence number, big-endian, in the
//!   last 8 bytes of the 12-byte iv).
//! * Content types accepted after the handshake: application data, and the close_notify
//!   alert, which is the end of the stream. Any other alert, handshake messages (key updates,
//!   tickets: hivemesh peers send neither, servers are configured with no tickets) and
//!   anything that fails to authenticate end the stream with an error; so does the socket
//!   closing without close_notify (a truncation is an error, not an end).
//! * No key update: each direction stops with an error after [`SEQUENCE_LIMIT`] records
//!   (2^24 full records, 256 GiB, well inside AES-GCM's confidentiality limit); links live
//!   for one round.

use std::io;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll, ready};

use rustls::ConnectionTrafficSecrets;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::buffers::BufferPool;

mod aead;

pub(crate) use aead::{AesGcm, Algorithm};
use aead::{Key, NONCE_LEN, TAG};

/// Bytes of a record header.
const HEADER: usize = 5;
/// The largest plaintext of one record (2^14).
const MAX_PLAINTEXT: usize = 1 << 14;
/// The largest `TLSCiphertext.length` a peer may send (2^14 + 256).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// The largest record on the wire.
const MAX_RECORD: usize = HEADER + MAX_CIPHERTEXT;
/// Record sealing overhead: header, content-type byte, tag.
const OVERHEAD: usize = HEADER + 1 + TAG;

const APPLICATION_DATA: u8 = 23;
const ALERT: u8 = 21;
const LEGACY_VERSION: [u8; 2] = [3, 3];
/// close_notify: level warning (1), description 0.
const CLOSE_NOTIFY: [u8; 2] = [1, 0];

/// Records per direction before the stream refuses to go on (no key update).
pub const SEQUENCE_LIMIT: u64 = 1 << 24;

/// Capacity of the send buffer: records are sealed into it and written from it.
pub const WRITE_BUFFER: usize = 1024 * 1024;

/// Send and receive buffers of closed connections, kept for the next ones. A round opens fresh
/// connections, and a fresh 1 MiB buffer costs 256 page faults (zeroing included) the first
/// time it is written; they held only ciphertext, and every byte is written before it is read.
/// Bounded to 16 MiB.
static SPARE_BUFFERS: LazyLock<BufferPool> = LazyLock::new(|| BufferPool::new(16 << 20));

/// One direction's key, iv and sequence number.
pub(crate) struct Direction {
    key: Key,
    iv: [u8; NONCE_LEN],
    seq: u64,
}

impl Direction {
    /// The key for one direction of a connection, from rustls' extracted secrets, on this
    /// machine's faster AES-GCM code ([`AesGcm::for_this_machine`]).
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> io::Result<Self> {
        let (algorithm, key, iv) = match secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (Algorithm::Aes128Gcm, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (Algorithm::Aes256Gcm, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
                (Algorithm::Chacha20Poly1305, key, iv)
            }
            _ => {
                return Err(invalid(
                    "negotiated an AEAD the record layer does not implement",
                ));
            }
        };
        let iv: [u8; NONCE_LEN] = iv
            .as_ref()
            .try_into()
            .map_err(|_| invalid("traffic iv of the wrong length"))?;
        Self::from_parts(algorithm, key.as_ref(), iv, seq, AesGcm::for_this_machine())
    }

    /// A direction of `algorithm` with `key` and `iv`, at sequence number `seq`; AES-128-GCM
    /// on the code `aes_gcm` names.
    pub(crate) fn from_parts(
        algorithm: Algorithm,
        key: &[u8],
        iv: [u8; NONCE_LEN],
        seq: u64,
        aes_gcm: AesGcm,
    ) -> io::Result<Self> {
        let key = Key::new(algorithm, key, aes_gcm)
            .map_err(|_| invalid("traffic key of the wrong length"))?;
        Ok(Self {
            key,
            iv,
            seq: seq_checked(seq)?,
        })
    }

    /// The next record's nonce (`iv XOR seq`); counts the record.
    pub(crate) fn next_nonce(&mut self) -> io::Result<[u8; NONCE_LEN]> {
        let seq = seq_checked(self.seq)?;
        self.seq += 1;
        let mut nonce = self.iv;
        for (n, s) in nonce[NONCE_LEN - 8..].iter_mut().zip(seq.to_be_bytes()) {
            *n ^= s;
        }
        Ok(nonce)
    }
}

fn seq_checked(seq: u64) -> io::Result<u64> {
    if seq >= SEQUENCE_LIMIT {
        Err(io::Error::other(
            "TLS record sequence limit reached (no key update): open a new connection",
        ))
    } else {
        Ok(seq)
    }
}

fn invalid(message: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.to_owned())
}

fn header(length: usize) -> [u8; HEADER] {
    let [hi, lo] = (length as u16).to_be_bytes();
    [
        APPLICATION_DATA,
        LEGACY_VERSION[0],
        LEGACY_VERSION[1],
        hi,
        lo,
    ]
}

/// The first error a half of the stream hit: every later call on that half reports it again
/// (a record stream that failed once cannot be resynchronised).
#[derive(Default)]
struct StickyError(Option<(io::ErrorKind, String)>);

impl StickyError {
    /// The recorded error, if any.
    fn check(&self) -> io::Result<()> {
        match &self.0 {
            Some((kind, message)) => Err(io::Error::new(*kind, message.clone())),
            None => Ok(()),
        }
    }

    /// Records `e` (unless an earlier error is recorded) and hands it back unchanged.
    fn record(&mut self, e: io::Error) -> io::Error {
        self.0.get_or_insert_with(|| (e.kind(), e.to_string()));
        e
    }
}

/// The sending half: seals records into a buffer and writes it to the socket.
pub(crate) struct Sender {
    dir: Direction,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    close_sealed: bool,
    error: StickyError,
}

impl Sender {
    /// A sender whose buffer is taken at its first write: an accepted connection costs no
    /// send buffer until it answers its peer's Hello.
    pub(crate) fn new(dir: Direction) -> Self {
        Self {
            dir,
            buf: Vec::new(),
            start: 0,
            end: 0,
            close_sealed: false,
            error: StickyError::default(),
        }
    }

    /// Takes the send buffer if this is the first write.
    fn take_buffer(&mut self) {
        if self.buf.is_empty() {
            self.buf = SPARE_BUFFERS.take_filled(WRITE_BUFFER);
        }
    }

    /// Bytes of buffer this sender holds.
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Seals one record of `plaintext` (at most [`MAX_PLAINTEXT`] bytes, room checked by the
    /// caller) after the pending bytes.
    fn seal(&mut self, plaintext: &[u8], content_type: u8) -> io::Result<()> {
        self.take_buffer();
        debug_assert!(plaintext.len() <= MAX_PLAINTEXT);
        debug_assert!(self.buf.len() - self.end >= plaintext.len() + OVERHEAD);
        let nonce = self.dir.next_nonce()?;
        let head = header(plaintext.len() + 1 + TAG);
        let record = &mut self.buf[self.end..self.end + plaintext.len() + OVERHEAD];
        record[..HEADER].copy_from_slice(&head);
        self.dir
            .key
            .seal(nonce, &head, plaintext, content_type, &mut record[HEADER..])
            .map_err(|_| io::Error::other("sealing a TLS record failed"))?;
        self.end += plaintext.len() + OVERHEAD;
        Ok(())
    }

    /// Writes pending records until the buffer is empty (`Ready`) or the socket is full
    /// (`Pending`, waker registered).
    fn poll_drain(&mut self, tcp: &mut TcpStream, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.start < self.end {
            match Pin::new(&mut *tcp).poll_write(cx, &self.buf[self.start..self.end]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(self.error.record(io::ErrorKind::WriteZero.into())));
                }
                Poll::Ready(Ok(n)) => self.start += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(self.error.record(e))),
                Poll::Pending => return Poll::Pending,
            }
        }
        self.start = 0;
        self.end = 0;
        Poll::Ready(Ok(()))
    }

    /// Plaintext bytes that can be sealed after the pending ones. When the tail is short and
    /// little is pending, the pending bytes move to the front first (a large pending run is
    /// left in place: the socket will drain it).
    fn room(&mut self) -> usize {
        if self.buf.len() - self.end < OVERHEAD + MAX_PLAINTEXT
            && self.start > 0
            && self.end - self.start <= self.buf.len() / 4
        {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        (self.buf.len() - self.end).saturating_sub(OVERHEAD)
    }

    pub(crate) fn poll_write_vectored(
        &mut self,
        tcp: &mut TcpStream,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.error.check()?;
        if self.close_sealed {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "write after shutdown",
            )));
        }
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        self.take_buffer();
        // Make room first; a full socket with a full buffer is the only reason to wait.
        let drained = self.poll_drain(tcp, cx)?;
        let mut consumed = 0;
        'fill: for slice in bufs {
            let mut rest: &[u8] = slice;
            while !rest.is_empty() {
                let room = self.room();
                if room == 0 {
                    break 'fill;
                }
                let take = rest.len().min(MAX_PLAINTEXT).min(room);
                if let Err(e) = self.seal(&rest[..take], APPLICATION_DATA) {
                    // Reported now, or on the next call when some bytes were accepted.
                    let e = self.error.record(e);
                    if consumed == 0 {
                        return Poll::Ready(Err(e));
                    }
                    break 'fill;
                }
                consumed += take;
                rest = &rest[take..];
            }
        }
        if consumed == 0 {
            debug_assert!(drained.is_pending());
            return Poll::Pending;
        }
        // Send now what was just sealed; what the socket does not take yet goes out on the
        // next write or flush (an error is reported then: these bytes were accepted).
        let _ = self.poll_drain(tcp, cx);
        Poll::Ready(Ok(consumed))
    }

    pub(crate) fn poll_flush(
        &mut self,
        tcp: &mut TcpStream,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        self.error.check()?;
        ready!(self.poll_drain(tcp, cx))?;
        Pin::new(tcp).poll_flush(cx)
    }

    /// Sends close_notify (once), flushes, and shuts the socket's write side.
    pub(crate) fn poll_shutdown(
        &mut self,
        tcp: &mut TcpStream,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        self.error.check()?;
        if !self.close_sealed {
            self.take_buffer();
            if self.room() < CLOSE_NOTIFY.len() {
                ready!(self.poll_drain(tcp, cx))?;
            }
            if let Err(e) = self.seal(&CLOSE_NOTIFY, ALERT) {
                return Poll::Ready(Err(self.error.record(e)));
            }
            self.close_sealed = true;
        }
        ready!(self.poll_drain(tcp, cx))?;
        Pin::new(tcp).poll_shutdown(cx)
    }
}

/// What one opened record was.
enum Opened {
    /// Application data of this many bytes, opened into the caller's buffer.
    Direct(usize),
    /// Application data of this many bytes, opened into the staging buffer.
    Staged(usize),
    /// The close_notify alert: the end of the stream.
    CloseNotify,
    /// Any other alert.
    Alert,
    /// A handshake message or an unknown content type.
    Unexpected,
}

/// The receiving half: reads the socket into a large buffer and opens records into the
/// caller's buffer.
pub(crate) struct Receiver {
    dir: Direction,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// A record opened into here when the caller had no room for all of it.
    staged: Vec<u8>,
    staged_start: usize,
    staged_end: usize,
    /// Application-data records without content in a row (bounded: they cost CPU and
    /// deliver nothing).
    empty_records: u32,
    closed: bool,
    error: StickyError,
    /// The size `buf` grows to at the first bulk read ([`GROW_AT`]).
    capacity: usize,
}

impl Drop for Sender {
    fn drop(&mut self) {
        if self.buf.len() >= WRITE_BUFFER {
            SPARE_BUFFERS.put_bytes(std::mem::take(&mut self.buf));
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Only grown buffers go back: the pool is for the large ones.
        if self.buf.len() >= self.capacity && self.buf.len() > 2 * MAX_RECORD {
            SPARE_BUFFERS.put_bytes(std::mem::take(&mut self.buf));
        }
    }
}

/// A read asking for at least this many bytes grows a receiver's buffer to its capacity
/// (a bulk reader: a round's parts); smaller reads (a Hello, at most 1 KiB) leave it at
/// the two records the handshake used.
const GROW_AT: usize = MAX_PLAINTEXT;

/// Empty application-data records accepted in a row (rustls' limit too).
const MAX_EMPTY_RECORDS: u32 = 32;

impl Receiver {
    /// A receiver continuing after the handshake: `buf[start..end]` holds bytes already read
    /// from the socket (the start of the first record, or nothing).
    /// The buffer holds at least two records (the handshake's holds exactly that) and grows to
    /// `capacity` at the first read of at least [`GROW_AT`] bytes: an accepted connection
    /// costs little until a round reads from it in bulk.
    pub(crate) fn new(
        dir: Direction,
        buf: Vec<u8>,
        start: usize,
        end: usize,
        capacity: usize,
    ) -> Self {
        debug_assert!(start <= end && end <= buf.len());
        let (buf, start, end) = if buf.len() >= 2 * MAX_RECORD {
            (buf, start, end)
        } else {
            let mut small = vec![0; 2 * MAX_RECORD];
            small[..end - start].copy_from_slice(&buf[start..end]);
            (small, 0, end - start)
        };
        Self {
            capacity: capacity.max(buf.len()),
            dir,
            buf,
            start,
            end,
            staged: vec![0; MAX_CIPHERTEXT],
            staged_start: 0,
            staged_end: 0,
            empty_records: 0,
            closed: false,
            error: StickyError::default(),
        }
    }

    /// Bytes of buffer this receiver holds.
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buf.len() + self.staged.len()
    }

    /// Records an error; reports it now, or on the next read when this one already delivered
    /// bytes (a read that returns an error must not have filled any).
    fn fail_read(&mut self, delivered: bool, e: io::Error) -> Poll<io::Result<()>> {
        let e = self.error.record(e);
        Poll::Ready(if delivered { Ok(()) } else { Err(e) })
    }

    /// Opens the complete record at `start` into `out` (when it has room for the whole inner
    /// plaintext) or into the staging buffer.
    fn open_record(&mut self, length: usize, out: &mut ReadBuf<'_>) -> io::Result<Opened> {
        let head: [u8; HEADER] = self.buf[self.start..self.start + HEADER]
            .try_into()
            .expect("header length");
        let body = &self.buf[self.start + HEADER..self.start + HEADER + length];
        let (ciphertext, tag) = body.split_at(length - TAG);
        let nonce = self.dir.next_nonce()?;
        let direct = out.remaining() >= ciphertext.len();
        let target: &mut [u8] = if direct {
            &mut out.initialize_unfilled_to(ciphertext.len())[..ciphertext.len()]
        } else {
            &mut self.staged[..ciphertext.len()]
        };
        self.dir
            .key
            .open(nonce, &head, ciphertext, tag, target)
            .map_err(|_| invalid("TLS record failed to authenticate"))?;
        // TLSInnerPlaintext: content, content type, zero padding.
        let at = target
            .iter()
            .rposition(|&b| b != 0)
            .ok_or_else(|| invalid("TLS record without a content type"))?;
        let opened = match target[at] {
            APPLICATION_DATA if direct => Opened::Direct(at),
            APPLICATION_DATA => Opened::Staged(at),
            // TLS 1.3 ignores the alert level (RFC 8446 §6).
            ALERT if at == 2 && target[1] == CLOSE_NOTIFY[1] => Opened::CloseNotify,
            ALERT => Opened::Alert,
            _ => Opened::Unexpected,
        };
        self.start += HEADER + length;
        Ok(opened)
    }

    pub(crate) fn poll_read(
        &mut self,
        tcp: &mut (impl AsyncRead + Unpin),
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        let mut delivered = false;
        loop {
            if self.staged_start < self.staged_end {
                let n = out.remaining().min(self.staged_end - self.staged_start);
                out.put_slice(&self.staged[self.staged_start..self.staged_start + n]);
                self.staged_start += n;
                return Poll::Ready(Ok(()));
            }
            if self.closed {
                return Poll::Ready(Ok(()));
            }
            if let Err(e) = self.error.check() {
                return Poll::Ready(Err(e));
            }
            if delivered && out.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let buffered = self.end - self.start;
            if buffered >= HEADER {
                let h = &self.buf[self.start..self.start + HEADER];
                if h[0] != APPLICATION_DATA || h[1..3] != LEGACY_VERSION {
                    return self.fail_read(
                        delivered,
                        io::Error::new(io::ErrorKind::InvalidData, "not a TLS 1.3 record"),
                    );
                }
                let length = usize::from(u16::from_be_bytes([h[3], h[4]]));
                // The inner plaintext (content, type, padding) is at most 2^14 + 1 bytes.
                if !(TAG + 1..=MAX_PLAINTEXT + 1 + TAG).contains(&length) {
                    return self.fail_read(
                        delivered,
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            "TLS record length out of range",
                        ),
                    );
                }
                if delivered && out.remaining() < length - TAG {
                    // Leave the record for a read with room for it (no staging copy).
                    return Poll::Ready(Ok(()));
                }
                if buffered >= HEADER + length {
                    let opened = match self.open_record(length, out) {
                        Ok(opened) => opened,
                        Err(e) => return self.fail_read(delivered, e),
                    };
                    match opened {
                        Opened::Direct(0) | Opened::Staged(0) => {
                            self.empty_records += 1;
                            if self.empty_records > MAX_EMPTY_RECORDS {
                                return self.fail_read(
                                    delivered,
                                    io::Error::new(
                                        io::ErrorKind::InvalidData,
                                        "too many empty TLS records in a row",
                                    ),
                                );
                            }
                        }
                        Opened::Direct(content) => {
                            self.empty_records = 0;
                            out.advance(content);
                            delivered = true;
                        }
                        Opened::Staged(content) => {
                            self.empty_records = 0;
                            self.staged_start = 0;
                            self.staged_end = content;
                        }
                        Opened::CloseNotify => self.closed = true,
                        Opened::Alert => {
                            return self.fail_read(
                                delivered,
                                io::Error::new(
                                    io::ErrorKind::ConnectionAborted,
                                    "the peer sent a TLS alert",
                                ),
                            );
                        }
                        Opened::Unexpected => {
                            return self.fail_read(
                                delivered,
                                io::Error::new(
                                    io::ErrorKind::InvalidData,
                                    "unexpected TLS content type after the handshake",
                                ),
                            );
                        }
                    }
                    continue;
                }
            }
            if delivered {
                return Poll::Ready(Ok(()));
            }
            // Need more bytes: make sure the whole record fits after `start`, then read.
            if self.buf.len() < self.capacity && out.remaining() >= GROW_AT {
                let mut large = SPARE_BUFFERS.take_filled(self.capacity);
                large[..self.end - self.start].copy_from_slice(&self.buf[self.start..self.end]);
                self.end -= self.start;
                self.start = 0;
                self.buf = large;
            }
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
            } else if self.buf.len() - self.start < MAX_RECORD {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let mut read = ReadBuf::new(&mut self.buf[self.end..]);
            let polled = ready!(Pin::new(&mut *tcp).poll_read(cx, &mut read));
            let n = read.filled().len();
            if let Err(e) = polled {
                return Poll::Ready(Err(self.error.record(e)));
            }
            if n == 0 {
                return Poll::Ready(Err(self.error.record(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection without close_notify",
                ))));
            }
            self.end += n;
        }
    }
}

/// The socket during the handshake, read one record at a time: rustls never sees a byte past
/// the record it is given, so when the handshake is complete every later byte is still here
/// for the record layer ([`HandshakeIo::into_parts`]).
pub(crate) struct HandshakeIo {
    tcp: TcpStream,
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl HandshakeIo {
    /// Two records of buffer: the handshake needs no more, and an unauthenticated client
    /// should cost little.
    pub(crate) fn new(tcp: TcpStream) -> Self {
        Self {
            tcp,
            buf: vec![0; 2 * MAX_RECORD],
            start: 0,
            end: 0,
        }
    }

    /// The socket, the buffer and the range of bytes in it not handed to rustls.
    pub(crate) fn into_parts(self) -> (TcpStream, Vec<u8>, usize, usize) {
        (self.tcp, self.buf, self.start, self.end)
    }

    /// Reads until `buf[start..]` holds `n` bytes.
    async fn fill(&mut self, n: usize) -> io::Result<()> {
        use tokio::io::AsyncReadExt as _;
        if self.buf.len() - self.start < n {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        while self.end - self.start < n {
            let read = self.tcp.read(&mut self.buf[self.end..]).await?;
            if read == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the connection closed during the TLS handshake",
                ));
            }
            self.end += read;
        }
        Ok(())
    }

    /// The next whole record (header included), taken off the buffer.
    async fn next_record(&mut self) -> io::Result<&[u8]> {
        self.fill(HEADER).await?;
        let h = &self.buf[self.start..self.start + HEADER];
        // Content types change_cipher_spec (20) to application_data (23), a legacy version of
        // 3.x, a length a TLS 1.3 peer may send: anything else is not TLS, refused before
        // waiting for a body that may never come.
        let length = usize::from(u16::from_be_bytes([h[3], h[4]]));
        if !(20..=APPLICATION_DATA).contains(&h[0]) || h[1] != 3 || length > MAX_CIPHERTEXT {
            return Err(invalid("not a TLS record"));
        }
        let n = HEADER + length;
        self.fill(n).await?;
        let record = &self.buf[self.start..self.start + n];
        self.start += n;
        Ok(record)
    }
}

/// Runs rustls' side of the handshake over `io` until it is complete and everything rustls
/// had to send is sent. An error carries the [`rustls::Error`] (as the `io::Error`'s inner
/// error) when rustls refused the peer; rustls' alert is sent first, as far as it goes.
pub(crate) async fn handshake(
    conn: &mut rustls::Connection,
    io: &mut HandshakeIo,
) -> io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let mut out = Vec::new();
    loop {
        while conn.wants_write() {
            out.clear();
            conn.write_tls(&mut out)?;
            io.tcp.write_all(&out).await?;
        }
        if !conn.is_handshaking() {
            return Ok(());
        }
        let mut record = io.next_record().await?;
        while !record.is_empty() {
            conn.read_tls(&mut record)?;
        }
        if let Err(e) = conn.process_new_packets() {
            // rustls queued an alert for the peer: send it, then fail.
            out.clear();
            if conn.write_tls(&mut out).is_ok() {
                let _ = io.tcp.write_all(&out).await;
            }
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
    }
}

mod fuzz;
pub(crate) use fuzz::fuzz_record_layer;

#[cfg(test)]
mod tests;
