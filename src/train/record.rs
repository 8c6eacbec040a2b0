//! One peer's progress record as it travels in the DHT: a fixed-size binary encoding, decoded
//! with typed errors (never a panic) since every byte of it is another peer's claim.
//!
//! ```text
//! progress:  0x01 | epoch u64 | samples u64 | samples/s f64 | time f64 | flags u8   (34 bytes)
//! withdrawn: 0x00                                                                   (1 byte)
//! ```
//!
//! Integers and floats are big-endian; `flags` bit 0 is client mode, the other bits must be 0.
//! The peer a record belongs to is not in it: it is the owner subkey the record is signed
//! under (see [`crate::dht`]), so nobody can publish a record in another peer's name.

/// Tag of a progress record.
const TAG_PROGRESS: u8 = 1;
/// Tag of a withdrawn record (the peer left: hivemind's `None` value).
const TAG_WITHDRAWN: u8 = 0;
/// Length of an encoded progress record.
pub const PROGRESS_RECORD_BYTES: usize = 34;
/// `flags` bit: the peer is in client mode.
const FLAG_CLIENT: u8 = 1;

/// One peer's training progress (hivemind's `LocalTrainingProgress`, less the peer id, which is
/// the owner subkey the record is published under).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalProgress {
    /// The peer's epoch.
    pub epoch: u64,
    /// Samples it accumulated toward the next epoch.
    pub samples_accumulated: u64,
    /// Its recent throughput (samples per second; finite, non-negative).
    pub samples_per_second: f64,
    /// When it reported this (DHT time, seconds since the UNIX epoch; finite).
    pub time: f64,
    /// Whether it is a client (clients do not count toward the global epoch).
    pub client_mode: bool,
}

/// What a peer's entry under the progress key holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ProgressRecord {
    /// The peer's progress.
    Progress(LocalProgress),
    /// The peer has left (written at shutdown, superseding its last progress).
    Withdrawn,
}

/// A malformed progress record.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The record holds no bytes.
    #[error("empty progress record")]
    Empty,
    /// The first byte is no known tag.
    #[error("unknown progress record tag {0}")]
    UnknownTag(u8),
    /// The record's length does not match its tag.
    #[error("progress record of {len} bytes, expected {expected}")]
    Length {
        /// Its length.
        len: usize,
        /// The tag's length.
        expected: usize,
    },
    /// `samples_per_second` is NaN, infinite or negative.
    #[error("samples per second {0} is not a finite non-negative number")]
    BadRate(f64),
    /// `time` is NaN or infinite.
    #[error("report time {0} is not finite")]
    BadTime(f64),
    /// Flag bits other than client mode are set.
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    /// The report time lies further ahead of the reader's clock than clocks may differ.
    #[error("report time {time} is {ahead:.1} s ahead of this peer's clock")]
    FromTheFuture {
        /// The claimed time.
        time: f64,
        /// How far past the reader's clock.
        ahead: f64,
    },
}

impl LocalProgress {
    /// Checks the fields a peer could not have produced honestly: a rate that is not a finite
    /// non-negative number, a time that is not finite.
    pub fn check(&self) -> Result<(), RecordError> {
        let r = self.samples_per_second;
        if !(r.is_finite() && r >= 0.0) {
            return Err(RecordError::BadRate(r));
        }
        if !self.time.is_finite() {
            return Err(RecordError::BadTime(self.time));
        }
        Ok(())
    }
}

impl ProgressRecord {
    /// The record's bytes.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ProgressRecord::Withdrawn => vec![TAG_WITHDRAWN],
            ProgressRecord::Progress(p) => {
                let mut out = Vec::with_capacity(PROGRESS_RECORD_BYTES);
                out.push(TAG_PROGRESS);
                out.extend_from_slice(&p.epoch.to_be_bytes());
                out.extend_from_slice(&p.samples_accumulated.to_be_bytes());
                out.extend_from_slice(&p.samples_per_second.to_be_bytes());
                out.extend_from_slice(&p.time.to_be_bytes());
                out.push(if p.client_mode { FLAG_CLIENT } else { 0 });
                out
            }
        }
    }

    /// Decodes and checks a record ([`LocalProgress::check`]).
    pub fn decode(bytes: &[u8]) -> Result<Self, RecordError> {
        let (&tag, rest) = bytes.split_first().ok_or(RecordError::Empty)?;
        let expected = match tag {
            TAG_WITHDRAWN => 1,
            TAG_PROGRESS => PROGRESS_RECORD_BYTES,
            other => return Err(RecordError::UnknownTag(other)),
        };
        if bytes.len() != expected {
            return Err(RecordError::Length {
                len: bytes.len(),
                expected,
            });
        }
        if tag == TAG_WITHDRAWN {
            return Ok(ProgressRecord::Withdrawn);
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&rest[i * 8..(i + 1) * 8]);
            w
        };
        let flags = rest[32];
        if flags & !FLAG_CLIENT != 0 {
            return Err(RecordError::UnknownFlags(flags));
        }
        let p = LocalProgress {
            epoch: u64::from_be_bytes(word(0)),
            samples_accumulated: u64::from_be_bytes(word(1)),
            samples_per_second: f64::from_be_bytes(word(2)),
            time: f64::from_be_bytes(word(3)),
            client_mode: flags & FLAG_CLIENT != 0,
        };
        p.check()?;
        Ok(ProgressRecord::Progress(p))
    }
}
