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
//!   layer. The traffic keys, ivs and sequence numbers then come from rustls'
//!   `dangerous_extract_secrets` (the kTLS hand-over API).
//! * Every record is `TLSCiphertext`: outer type application_data (23), legacy version 0x0303,
//!   a length of at most 2^14 + 256, then the AEAD output over `TLSInnerPlaintext` (content,
//!   one content-type byte, optional zero padding), with the 5-byte header as associated data
//!   and the per-record nonce `iv XOR seq` (the 64-bit sequence number, big-endian, in the
//!   last 8 bytes of the 12-byte iv).
//! * Content types accepted after the handshake: application data, the close_notify alert,
//!   which is the end of the stream, and (once agreed, below) handshake records holding
//!   exactly one KeyUpdate. Any other alert, any other handshake message (tickets: hivemesh
//!   servers are configured with none), a KeyUpdate from a peer that did not agree to them
//!   and anything that fails to authenticate end the stream with an error
//!   ([`KeyUpdateError`] for what concerns key updates); so does the socket closing without
//!   close_notify (a truncation is an error, not an end).
//!
//! # Key updates (RFC 8446 §4.6.3, §7.2)
//!
//! A key may protect at most [`SEQUENCE_LIMIT`] records (2^24 full records, 256 GiB, well
//! inside AES-GCM's confidentiality limit of 2^24.5); a direction that reaches it ends with
//! [`KeyUpdateError::LimitReached`]. Lasting groups keep links for many collectives, so:
//!
//! * **Agreement first.** Peers before key updates end the stream at any handshake record, so
//!   neither end sends one unless both agreed in the handshake: current peers offer the ALPN
//!   `hivemesh-data/2` before `hivemesh-data/1`, and a connection that negotiated `/2` has key
//!   updates (`super::tls`). With an older peer (`/1`) nothing changes: no KeyUpdate is ever
//!   sent, a received one is an error, and each direction ends at the limit with a message
//!   that says why.
//! * **The secrets.** rustls hands over keys, not the traffic secrets a key update derives
//!   from; each connection catches its two application traffic secrets through rustls' key
//!   log interface on a copy of its configuration (kept in `OkmBlock`s, zeroed on drop), and
//!   the hand-over checks that each secret derives exactly the key and iv rustls extracted.
//! * **Sending.** A sender moves on after [`KEY_UPDATE_AT`] records under one key (half the
//!   limit): before its next application data it seals a KeyUpdate (`update_not_requested`)
//!   under the old key, then derives `secret' = HKDF-Expand-Label(secret, "traffic upd", "",
//!   Hash.length)` with the suite's HKDF, the key and iv from `secret'` (labels "key" and
//!   "iv"), and starts again at sequence number 0. It sends a KeyUpdate too, on its next
//!   write, when the peer's KeyUpdate asked for one (`update_requested`, what rustls'
//!   `refresh_traffic_keys` sends); it never asks for one itself: each end updates its own
//!   direction.
//! * **Receiving.** A handshake record after agreement must be exactly one KeyUpdate
//!   (`[24, 0, 0, 1, r]`, `r` 0 or 1, [`KeyUpdateError::Malformed`],
//!   [`KeyUpdateError::InvalidRequest`]); the receiver moves to the next secret the same way
//!   and opens every later record under it. Records without content (empty ones and key
//!   updates) are bounded in a row, as rustls bounds them.

use std::io;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll, ready};

use rustls::ConnectionTrafficSecrets;
use rustls::crypto::tls13::{Hkdf, OkmBlock};
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
/// Handshake records after the handshake carry only KeyUpdate here.
const HANDSHAKE: u8 = 22;
/// HandshakeType key_update.
const KEY_UPDATE: u8 = 24;
/// Bytes of a KeyUpdate message: type, 24-bit length (1), request_update.
const KEY_UPDATE_LEN: usize = 5;
const LEGACY_VERSION: [u8; 2] = [3, 3];
/// close_notify: level warning (1), description 0.
const CLOSE_NOTIFY: [u8; 2] = [1, 0];

/// Records one key may protect: a direction refuses to seal or open more under one key
/// (2^24 full records, 256 GiB, well inside AES-GCM's confidentiality limit of 2^24.5).
pub const SEQUENCE_LIMIT: u64 = 1 << 24;

/// A sender whose peer agreed to key updates moves to its next traffic secret after this
/// many records under one key: half the limit, so a receiver never sees the limit reached
/// by a conforming peer.
pub const KEY_UPDATE_AT: u64 = SEQUENCE_LIMIT / 2;

/// A key update the peer sent that cannot be followed, or a direction at its sequence limit:
/// the typed error inside the `io::Error` a read or write returns (`get_ref()` and
/// `downcast_ref`). The stream is unusable after any of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyUpdateError {
    /// A handshake record (a key update) from a peer that did not agree to key updates in
    /// the handshake (ALPN `hivemesh-data/1`).
    #[error("the peer sent a TLS handshake record but did not agree to key updates")]
    NotAgreed,
    /// A handshake record after the handshake that is not exactly one KeyUpdate message.
    #[error(
        "a TLS handshake record after the handshake must hold exactly one KeyUpdate (got {len} bytes starting with type {msg_type})"
    )]
    Malformed {
        /// Bytes of content in the record.
        len: usize,
        /// Its first byte (the handshake type), 0 when empty.
        msg_type: u8,
    },
    /// A KeyUpdate whose `request_update` is neither 0 nor 1 (RFC 8446 §4.6.3).
    #[error("KeyUpdate with request_update {0} (only 0 and 1 exist)")]
    InvalidRequest(u8),
    /// A direction reached [`SEQUENCE_LIMIT`] records under one key.
    #[error(
        "TLS record sequence limit reached under one key: {}",
        if *.agreed {
            "the peer did not update its keys in time"
        } else {
            "the peer does not support key updates (ALPN hivemesh-data/1); open a new connection"
        }
    )]
    LimitReached {
        /// Both ends had agreed to key updates.
        agreed: bool,
    },
}

impl From<KeyUpdateError> for io::Error {
    fn from(e: KeyUpdateError) -> Self {
        let kind = match e {
            KeyUpdateError::LimitReached { .. } => io::ErrorKind::Other,
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e)
    }
}

/// Capacity of the send buffer: records are sealed into it and written from it.
pub const WRITE_BUFFER: usize = 1024 * 1024;

/// Send and receive buffers of closed connections, kept for the next ones. A round opens fresh
/// connections, and a fresh 1 MiB buffer costs 256 page faults (zeroing included) the first
/// time it is written; they held only ciphertext, and every byte is written before it is read.
/// Bounded to 16 MiB.
static SPARE_BUFFERS: LazyLock<BufferPool> = LazyLock::new(|| BufferPool::new(16 << 20));

/// One direction's key, iv and sequence number; with key updates agreed, its traffic
/// secret too.
pub(crate) struct Direction {
    key: Key,
    iv: [u8; NONCE_LEN],
    seq: u64,
    algorithm: Algorithm,
    aes_gcm: AesGcm,
    /// Records one key may protect ([`SEQUENCE_LIMIT`]; lower in tests).
    limit: u64,
    /// Present when both ends agreed to key updates.
    updates: Option<Updates>,
}

/// What a direction needs to move to its next key (RFC 8446 §7.2).
struct Updates {
    /// The current application traffic secret (zeroed on drop by `OkmBlock`).
    secret: OkmBlock,
    /// The negotiated suite's HKDF.
    hkdf: &'static dyn Hkdf,
    /// Key updates done.
    done: u64,
}

impl Direction {
    /// The key for one direction of a connection, from rustls' extracted secrets, on this
    /// machine's faster AES-GCM code ([`AesGcm::for_this_machine`]).
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> io::Result<Self> {
        let (algorithm, key, iv) = parts(&secrets)?;
        Self::from_parts(algorithm, key, iv, seq, AesGcm::for_this_machine())
    }

    /// [`Direction::new`] with key updates: `secret` is this direction's application traffic
    /// secret and `hkdf` the negotiated suite's. Fails unless `secret` derives the key and iv
    /// rustls extracted (a secret of the other direction, or of another connection, is
    /// refused).
    pub(crate) fn with_updates(
        seq: u64,
        secrets: ConnectionTrafficSecrets,
        secret: OkmBlock,
        hkdf: &'static dyn Hkdf,
    ) -> io::Result<Self> {
        let (algorithm, key, iv) = parts(&secrets)?;
        let (derived_key, derived_iv) = traffic_key(hkdf, &secret, algorithm)?;
        if derived_key.as_ref() != key || derived_iv != iv {
            return Err(invalid(
                "the traffic secret does not derive the handshake's traffic keys",
            ));
        }
        let mut dir = Self::from_parts(algorithm, key, iv, seq, AesGcm::for_this_machine())?;
        dir.updates = Some(Updates {
            secret,
            hkdf,
            done: 0,
        });
        Ok(dir)
    }

    /// A direction at sequence number 0 keyed from the application traffic secret `secret`
    /// (`hkdf`: its suite's), with key updates; AES-128-GCM on the code `aes_gcm` names.
    #[cfg(test)]
    pub(crate) fn from_secret(
        algorithm: Algorithm,
        secret: OkmBlock,
        hkdf: &'static dyn Hkdf,
        aes_gcm: AesGcm,
    ) -> io::Result<Self> {
        let (key, iv) = traffic_key(hkdf, &secret, algorithm)?;
        let mut dir = Self::from_parts(algorithm, key.as_ref(), iv, 0, aes_gcm)?;
        dir.updates = Some(Updates {
            secret,
            hkdf,
            done: 0,
        });
        Ok(dir)
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
        let mut dir = Self {
            key,
            iv,
            seq,
            algorithm,
            aes_gcm,
            limit: SEQUENCE_LIMIT,
            updates: None,
        };
        dir.seq = dir.seq_checked(seq)?;
        Ok(dir)
    }

    /// Both ends agreed to key updates.
    pub(crate) fn updates_agreed(&self) -> bool {
        self.updates.is_some()
    }

    /// Key updates this direction has made.
    pub(crate) fn updates_done(&self) -> u64 {
        self.updates.as_ref().map_or(0, |u| u.done)
    }

    /// Moves to the next traffic secret (RFC 8446 §7.2: `HKDF-Expand-Label(secret,
    /// "traffic upd", "", Hash.length)`), its key and iv, sequence number 0.
    fn update(&mut self) -> io::Result<()> {
        let (algorithm, aes_gcm) = (self.algorithm, self.aes_gcm);
        let updates = self.updates.as_mut().ok_or(KeyUpdateError::NotAgreed)?;
        let next = expand_label_block(updates.hkdf, &updates.secret, b"traffic upd")?;
        let (key, iv) = traffic_key(updates.hkdf, &next, algorithm)?;
        self.key = Key::new(algorithm, key.as_ref(), aes_gcm)
            .map_err(|_| invalid("traffic key of the wrong length"))?;
        self.iv = iv;
        self.seq = 0;
        updates.secret = next;
        updates.done += 1;
        Ok(())
    }

    /// The next record's nonce (`iv XOR seq`); counts the record.
    pub(crate) fn next_nonce(&mut self) -> io::Result<[u8; NONCE_LEN]> {
        let seq = self.seq_checked(self.seq)?;
        self.seq += 1;
        let mut nonce = self.iv;
        for (n, s) in nonce[NONCE_LEN - 8..].iter_mut().zip(seq.to_be_bytes()) {
            *n ^= s;
        }
        Ok(nonce)
    }

    fn seq_checked(&self, seq: u64) -> io::Result<u64> {
        if seq >= self.limit {
            Err(KeyUpdateError::LimitReached {
                agreed: self.updates.is_some(),
            }
            .into())
        } else {
            Ok(seq)
        }
    }

    /// Lowers the records one key may protect (tests: thousands instead of millions).
    #[cfg(test)]
    pub(crate) fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }
}

/// The algorithm, key and iv of rustls' extracted secrets.
fn parts(secrets: &ConnectionTrafficSecrets) -> io::Result<(Algorithm, &[u8], [u8; NONCE_LEN])> {
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
    Ok((algorithm, key.as_ref(), iv))
}

/// HKDF-Expand-Label(`secret`, `label`, "", `out.len()`) (RFC 8446 §7.1).
fn expand_label(
    hkdf: &dyn Hkdf,
    secret: &OkmBlock,
    label: &[u8],
    out: &mut [u8],
) -> io::Result<()> {
    let length = u16::try_from(out.len())
        .map_err(|_| invalid("HKDF output too long"))?
        .to_be_bytes();
    let label_len = [u8::try_from(6 + label.len()).map_err(|_| invalid("HKDF label too long"))?];
    // HkdfLabel: uint16 length, opaque label<7..255> ("tls13 " + label), opaque context<0..255>.
    let info: [&[u8]; 5] = [&length, &label_len, b"tls13 ", label, &[0]];
    hkdf.expander_for_okm(secret)
        .expand_slice(&info, out)
        .map_err(|_| invalid("HKDF output too long"))
}

/// HKDF-Expand-Label with an output of the hash's length (a traffic secret).
fn expand_label_block(hkdf: &dyn Hkdf, secret: &OkmBlock, label: &[u8]) -> io::Result<OkmBlock> {
    let mut block = [0u8; OkmBlock::MAX_LEN];
    let len = secret.as_ref().len();
    let out = block
        .get_mut(..len)
        .ok_or_else(|| invalid("traffic secret too long"))?;
    expand_label(hkdf, secret, label, out)?;
    let next = OkmBlock::new(out);
    block.fill(0);
    Ok(next)
}

/// The traffic key and iv of `secret` (RFC 8446 §7.3), the key as an `OkmBlock` (zeroed on
/// drop) of the algorithm's key length.
fn traffic_key(
    hkdf: &dyn Hkdf,
    secret: &OkmBlock,
    algorithm: Algorithm,
) -> io::Result<(OkmBlock, [u8; NONCE_LEN])> {
    let mut key = [0u8; 32];
    let key = &mut key[..algorithm.key_len()];
    expand_label(hkdf, secret, b"key", key)?;
    let block = OkmBlock::new(key);
    key.fill(0);
    let mut iv = [0u8; NONCE_LEN];
    expand_label(hkdf, secret, b"iv", &mut iv)?;
    Ok((block, iv))
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
/// (a record stream that failed once cannot be resynchronised), a [`KeyUpdateError`] as
/// itself.
#[derive(Default)]
struct StickyError(Option<(io::ErrorKind, String, Option<KeyUpdateError>)>);

impl StickyError {
    /// The recorded error, if any.
    fn check(&self) -> io::Result<()> {
        match &self.0 {
            Some((kind, _, Some(typed))) => Err(io::Error::new(*kind, typed.clone())),
            Some((kind, message, None)) => Err(io::Error::new(*kind, message.clone())),
            None => Ok(()),
        }
    }

    /// Records `e` (unless an earlier error is recorded) and hands it back unchanged.
    fn record(&mut self, e: io::Error) -> io::Error {
        self.0.get_or_insert_with(|| {
            let typed = e
                .get_ref()
                .and_then(|inner| inner.downcast_ref::<KeyUpdateError>())
                .cloned();
            (e.kind(), e.to_string(), typed)
        });
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
    /// Records under one key after which the next write starts with a key update (when
    /// agreed): [`KEY_UPDATE_AT`], lower in tests.
    update_at: u64,
    /// The peer's KeyUpdate asked for ours (`update_requested`): sent before the next
    /// application data.
    update_requested: bool,
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
            update_at: KEY_UPDATE_AT,
            update_requested: false,
        }
    }

    /// The peer asked for a key update: the next write starts with one (RFC 8446 §4.6.3:
    /// before the next application data). Ignored without agreement.
    pub(crate) fn request_key_update(&mut self) {
        self.update_requested = true;
    }

    /// Key updates sent.
    pub(crate) fn key_updates(&self) -> u64 {
        self.dir.updates_done()
    }

    /// Lowers the key's record limit and the key update threshold (tests).
    #[cfg(test)]
    pub(crate) fn set_limits(&mut self, limit: u64, update_at: u64) {
        self.dir.set_limit(limit);
        self.update_at = update_at;
    }

    /// Whether the next record must be a KeyUpdate: agreed, and the key has protected
    /// `update_at` records or the peer asked.
    fn key_update_due(&self) -> bool {
        self.dir.updates_agreed() && (self.dir.seq >= self.update_at || self.update_requested)
    }

    /// Seals a KeyUpdate (`update_not_requested`) under the current key and moves to the
    /// next (RFC 8446 §4.6.3); room checked by the caller.
    fn seal_key_update(&mut self) -> io::Result<()> {
        self.seal(&[KEY_UPDATE, 0, 0, 1, 0], HANDSHAKE)?;
        self.dir.update()?;
        self.update_requested = false;
        Ok(())
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
                if self.key_update_due() {
                    if self.room() < KEY_UPDATE_LEN {
                        break 'fill;
                    }
                    if let Err(e) = self.seal_key_update() {
                        let e = self.error.record(e);
                        if consumed == 0 {
                            return Poll::Ready(Err(e));
                        }
                        break 'fill;
                    }
                }
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
    /// A KeyUpdate (already followed: the direction has its next key); `true` when the peer
    /// asked for ours.
    KeyUpdate(bool),
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
    /// Records without content in a row, key updates included (bounded: they cost CPU and
    /// deliver nothing).
    empty_records: u32,
    /// The peer's last KeyUpdate asked for ours and the sender has not been told yet.
    update_requested: bool,
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
            update_requested: false,
            closed: false,
            error: StickyError::default(),
        }
    }

    /// Bytes of buffer this receiver holds.
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buf.len() + self.staged.len()
    }

    /// Whether a KeyUpdate asked for ours since the last call (the caller tells its sender:
    /// [`Sender::request_key_update`]).
    pub(crate) fn take_update_request(&mut self) -> bool {
        std::mem::take(&mut self.update_requested)
    }

    /// Key updates followed.
    pub(crate) fn key_updates(&self) -> u64 {
        self.dir.updates_done()
    }

    /// Lowers the key's record limit (tests).
    #[cfg(test)]
    pub(crate) fn set_limit(&mut self, limit: u64) {
        self.dir.set_limit(limit);
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
            HANDSHAKE => {
                let requested = key_update(&target[..at], self.dir.updates_agreed())?;
                // The records after this one are under the next key.
                self.dir.update()?;
                Opened::KeyUpdate(requested)
            }
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
                        Opened::Direct(0) | Opened::Staged(0) | Opened::KeyUpdate(_) => {
                            if let Opened::KeyUpdate(requested) = opened {
                                self.update_requested |= requested;
                            }
                            self.empty_records += 1;
                            if self.empty_records > MAX_EMPTY_RECORDS {
                                return self.fail_read(
                                    delivered,
                                    io::Error::new(
                                        io::ErrorKind::InvalidData,
                                        "too many TLS records without content (empty ones or key updates) in a row",
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

/// The content of a handshake record after the handshake, which must be exactly one
/// KeyUpdate from a peer that agreed to key updates: its `request_update` (RFC 8446 §4.6.3).
fn key_update(content: &[u8], agreed: bool) -> Result<bool, KeyUpdateError> {
    if !agreed {
        return Err(KeyUpdateError::NotAgreed);
    }
    match *content {
        [KEY_UPDATE, 0, 0, 1, request] => match request {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(KeyUpdateError::InvalidRequest(other)),
        },
        _ => Err(KeyUpdateError::Malformed {
            len: content.len(),
            msg_type: content.first().copied().unwrap_or(0),
        }),
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
