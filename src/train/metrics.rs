//! One peer's training metrics as they travel in the DHT, for monitors (`hivemesh monitor`): an
//! optional record beside the progress record, under the owned key `"{prefix}_metrics"`
//! ([`metrics_key`]) at the peer's owner subkey (hivemind's ALBERT example publishes
//! `{run_id}_metrics` the same way, unsigned). Nothing in training reads it: it says what the
//! progress record does not (the loss, how the peer is reached, how its averaging rounds go,
//! a display name), all of it the peer's own claim.
//!
//! ```text
//! metrics:   0x01 | epoch u64 | samples/s f64 | loss f64 | time f64 | target u64
//!                 | rounds_ok u32 | rounds_failed u32 | group u16 | reach u8 | mode u8
//!                 | flags u8 | name_len u8 | name (UTF-8, at most 64 bytes)
//! withdrawn: 0x00                                      (55 bytes + name; 1 byte)
//! ```
//!
//! Integers and floats are big-endian; `flags` bit 0 says a loss is reported (`loss` is 0
//! otherwise), the other bits must be 0. Decoding is strict: a wrong length, an unknown tag,
//! reach or mode, unknown flags, a loss, rate or time that is NaN or infinite, a negative rate,
//! a name that is not UTF-8 or longer than [`MAX_NAME_BYTES`] are typed [`MetricsError`]s.

use crate::reach::Reach;

/// Tag of a metrics record.
const TAG_METRICS: u8 = 1;
/// Tag of a withdrawn record (the peer left).
const TAG_WITHDRAWN: u8 = 0;
/// Length of a metrics record without its name.
pub const METRICS_HEADER_BYTES: usize = 55;
/// The longest name, in bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// `flags` bit: `loss` holds a loss.
const FLAG_LOSS: u8 = 1;

/// The DHT key of a run's metrics records: the [owned key](crate::dht::owned_key)
/// `"{prefix}_metrics"`.
pub fn metrics_key(prefix: &str) -> Vec<u8> {
    crate::dht::owned_key(format!("{prefix}_metrics"))
}

/// How a peer says others reach it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReachClaim {
    /// Not known (yet).
    #[default]
    Unknown,
    /// Others dial it directly.
    Public,
    /// Reachable by hole punching.
    HolePunched,
    /// Reachable through a relay only.
    Relayed,
}

impl ReachClaim {
    fn code(self) -> u8 {
        match self {
            Self::Unknown => 0,
            Self::Public => 1,
            Self::HolePunched => 2,
            Self::Relayed => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::Unknown,
            1 => Self::Public,
            2 => Self::HolePunched,
            3 => Self::Relayed,
            _ => return None,
        })
    }

    /// A short lowercase name (`unknown`, `public`, `hole-punched`, `relayed`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Public => "public",
            Self::HolePunched => "hole-punched",
            Self::Relayed => "relayed",
        }
    }

    /// What [`crate::p2p::Reachability`]'s `reach` says (`None`: not known yet).
    pub fn from_reach(reach: Option<Reach>) -> Self {
        match reach {
            None => Self::Unknown,
            Some(Reach::Public) => Self::Public,
            Some(Reach::Punchable) => Self::HolePunched,
            Some(Reach::Private) => Self::Relayed,
        }
    }

    /// Parses [`ReachClaim::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Unknown,
            Self::Public,
            Self::HolePunched,
            Self::Relayed,
        ]
        .into_iter()
        .find(|r| r.name() == name)
    }
}

/// How a peer averages (hivemind's modes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ModeClaim {
    /// Sends and reduces.
    #[default]
    Node,
    /// Sends only (cannot accept connections).
    Client,
    /// Reduces only (contributes no samples).
    Aux,
}

impl ModeClaim {
    fn code(self) -> u8 {
        match self {
            Self::Node => 0,
            Self::Client => 1,
            Self::Aux => 2,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            0 => Self::Node,
            1 => Self::Client,
            2 => Self::Aux,
            _ => return None,
        })
    }

    /// A short lowercase name (`node`, `client`, `aux`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Client => "client",
            Self::Aux => "aux",
        }
    }

    /// Parses [`ModeClaim::name`].
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Node, Self::Client, Self::Aux]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// One peer's metrics (see the [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerMetrics {
    /// Its epoch (hivemind's ALBERT example calls it `step`).
    pub epoch: u64,
    /// Its throughput (finite, non-negative).
    pub samples_per_second: f64,
    /// Its latest training loss, if it reports one (finite).
    pub loss: Option<f64>,
    /// When it reported this (DHT time, seconds since the UNIX epoch; finite).
    pub time: f64,
    /// The run's target batch size as it knows it (0: not said).
    pub target_batch_size: u64,
    /// Averaging rounds it finished.
    pub rounds_ok: u32,
    /// Averaging rounds that failed for it.
    pub rounds_failed: u32,
    /// The size of the group of its last averaging round (0: none yet).
    pub last_group_size: u16,
    /// How others reach it.
    pub reach: ReachClaim,
    /// How it averages.
    pub mode: ModeClaim,
    /// A display name (a volunteer's nickname), at most [`MAX_NAME_BYTES`] bytes.
    pub name: String,
}

/// What a peer's entry under the metrics key holds.
#[derive(Clone, Debug, PartialEq)]
pub enum MetricsRecord {
    /// The peer's metrics.
    Metrics(PeerMetrics),
    /// The peer has left.
    Withdrawn,
}

/// A malformed metrics record.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The record holds no bytes.
    #[error("empty metrics record")]
    Empty,
    /// The first byte is no known tag.
    #[error("unknown metrics record tag {0}")]
    UnknownTag(u8),
    /// The record's length does not match its tag and name length.
    #[error("metrics record of {len} bytes, expected {expected}")]
    Length {
        /// Its length.
        len: usize,
        /// The length its header announces.
        expected: usize,
    },
    /// `samples_per_second` is NaN, infinite or negative.
    #[error("samples per second {0} is not a finite non-negative number")]
    BadRate(f64),
    /// The loss is NaN or infinite.
    #[error("loss {0} is not finite")]
    BadLoss(f64),
    /// `time` is NaN or infinite.
    #[error("report time {0} is not finite")]
    BadTime(f64),
    /// Unknown flag bits are set, or a loss without its flag.
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    /// The reach code is unknown.
    #[error("unknown reach code {0}")]
    UnknownReach(u8),
    /// The mode code is unknown.
    #[error("unknown mode code {0}")]
    UnknownMode(u8),
    /// The name is longer than [`MAX_NAME_BYTES`].
    #[error("name of {0} bytes, at most {MAX_NAME_BYTES} allowed")]
    NameTooLong(usize),
    /// The name is not UTF-8.
    #[error("name is not UTF-8")]
    NameNotUtf8,
    /// The report time lies further ahead of the reader's clock than clocks may differ.
    #[error("report time {time} is {ahead:.1} s ahead of this peer's clock")]
    FromTheFuture {
        /// The claimed time.
        time: f64,
        /// How far past the reader's clock.
        ahead: f64,
    },
}

impl PeerMetrics {
    /// Checks what a peer could not have produced honestly (the decoder's checks on the
    /// values): a rate, loss or time that is not finite, a negative rate, a name too long.
    pub fn check(&self) -> Result<(), MetricsError> {
        let r = self.samples_per_second;
        if !(r.is_finite() && r >= 0.0) {
            return Err(MetricsError::BadRate(r));
        }
        if let Some(loss) = self.loss
            && !loss.is_finite()
        {
            return Err(MetricsError::BadLoss(loss));
        }
        if !self.time.is_finite() {
            return Err(MetricsError::BadTime(self.time));
        }
        if self.name.len() > MAX_NAME_BYTES {
            return Err(MetricsError::NameTooLong(self.name.len()));
        }
        Ok(())
    }
}

impl MetricsRecord {
    /// The record's bytes; fails for values [`PeerMetrics::check`] refuses.
    pub fn encode(&self) -> Result<Vec<u8>, MetricsError> {
        let m = match self {
            MetricsRecord::Withdrawn => return Ok(vec![TAG_WITHDRAWN]),
            MetricsRecord::Metrics(m) => m,
        };
        m.check()?;
        let mut out = Vec::with_capacity(METRICS_HEADER_BYTES + m.name.len());
        out.push(TAG_METRICS);
        out.extend_from_slice(&m.epoch.to_be_bytes());
        out.extend_from_slice(&m.samples_per_second.to_be_bytes());
        out.extend_from_slice(&m.loss.unwrap_or(0.0).to_be_bytes());
        out.extend_from_slice(&m.time.to_be_bytes());
        out.extend_from_slice(&m.target_batch_size.to_be_bytes());
        out.extend_from_slice(&m.rounds_ok.to_be_bytes());
        out.extend_from_slice(&m.rounds_failed.to_be_bytes());
        out.extend_from_slice(&m.last_group_size.to_be_bytes());
        out.push(m.reach.code());
        out.push(m.mode.code());
        out.push(if m.loss.is_some() { FLAG_LOSS } else { 0 });
        // `check` bounds the name at 64 bytes.
        out.push(m.name.len() as u8);
        out.extend_from_slice(m.name.as_bytes());
        Ok(out)
    }

    /// Decodes and checks a record.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetricsError> {
        let (&tag, _) = bytes.split_first().ok_or(MetricsError::Empty)?;
        let expected = match tag {
            TAG_WITHDRAWN => 1,
            TAG_METRICS if bytes.len() >= METRICS_HEADER_BYTES => {
                METRICS_HEADER_BYTES + usize::from(bytes[METRICS_HEADER_BYTES - 1])
            }
            TAG_METRICS => METRICS_HEADER_BYTES,
            other => return Err(MetricsError::UnknownTag(other)),
        };
        if bytes.len() != expected {
            return Err(MetricsError::Length {
                len: bytes.len(),
                expected,
            });
        }
        if tag == TAG_WITHDRAWN {
            return Ok(MetricsRecord::Withdrawn);
        }
        let mut at = 1;
        let mut take = |n: usize| {
            let field = &bytes[at..at + n];
            at += n;
            field
        };
        let u64_at = |b: &[u8]| u64::from_be_bytes(b.try_into().unwrap_or([0; 8]));
        let epoch = u64_at(take(8));
        let samples_per_second = f64::from_bits(u64_at(take(8)));
        let loss = f64::from_bits(u64_at(take(8)));
        let time = f64::from_bits(u64_at(take(8)));
        let target_batch_size = u64_at(take(8));
        let rounds_ok = u32::from_be_bytes(take(4).try_into().unwrap_or([0; 4]));
        let rounds_failed = u32::from_be_bytes(take(4).try_into().unwrap_or([0; 4]));
        let last_group_size = u16::from_be_bytes(take(2).try_into().unwrap_or([0; 2]));
        let reach_code = take(1)[0];
        let mode_code = take(1)[0];
        let flags = take(1)[0];
        let name_len = usize::from(take(1)[0]);
        let name = take(name_len);
        if flags & !FLAG_LOSS != 0 || (flags & FLAG_LOSS == 0 && loss.to_bits() != 0) {
            return Err(MetricsError::UnknownFlags(flags));
        }
        if name_len > MAX_NAME_BYTES {
            return Err(MetricsError::NameTooLong(name_len));
        }
        let m = PeerMetrics {
            epoch,
            samples_per_second,
            loss: (flags & FLAG_LOSS != 0).then_some(loss),
            time,
            target_batch_size,
            rounds_ok,
            rounds_failed,
            last_group_size,
            reach: ReachClaim::from_code(reach_code)
                .ok_or(MetricsError::UnknownReach(reach_code))?,
            mode: ModeClaim::from_code(mode_code).ok_or(MetricsError::UnknownMode(mode_code))?,
            name: std::str::from_utf8(name)
                .map_err(|_| MetricsError::NameNotUtf8)?
                .to_owned(),
        };
        m.check()?;
        Ok(MetricsRecord::Metrics(m))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> PeerMetrics {
        PeerMetrics {
            epoch: 7,
            samples_per_second: 123.5,
            loss: Some(2.25),
            time: 1.7e9,
            target_batch_size: 4096,
            rounds_ok: 5,
            rounds_failed: 1,
            last_group_size: 3,
            reach: ReachClaim::HolePunched,
            mode: ModeClaim::Client,
            name: "ada <b>".into(),
        }
    }

    #[test]
    fn records_round_trip() {
        for record in [
            MetricsRecord::Metrics(sample()),
            MetricsRecord::Metrics(PeerMetrics {
                loss: None,
                name: String::new(),
                ..sample()
            }),
            MetricsRecord::Withdrawn,
        ] {
            let bytes = record.encode().unwrap();
            assert_eq!(MetricsRecord::decode(&bytes).unwrap(), record);
        }
        let bytes = MetricsRecord::Metrics(sample()).encode().unwrap();
        assert_eq!(bytes.len(), METRICS_HEADER_BYTES + 7);
    }

    #[test]
    fn malformed_records_are_typed_errors() {
        let good = MetricsRecord::Metrics(sample()).encode().unwrap();
        let set = |at: usize, b: &[u8]| {
            let mut v = good.clone();
            v[at..at + b.len()].copy_from_slice(b);
            v
        };
        let cases: Vec<(Vec<u8>, MetricsError)> = vec![
            (vec![], MetricsError::Empty),
            (vec![9], MetricsError::UnknownTag(9)),
            (
                vec![0, 0],
                MetricsError::Length {
                    len: 2,
                    expected: 1,
                },
            ),
            (
                good[..20].to_vec(),
                MetricsError::Length {
                    len: 20,
                    expected: METRICS_HEADER_BYTES,
                },
            ),
            (
                good[..good.len() - 1].to_vec(),
                MetricsError::Length {
                    len: good.len() - 1,
                    expected: good.len(),
                },
            ),
            (
                set(9, &f64::NAN.to_be_bytes()),
                MetricsError::BadRate(f64::NAN),
            ),
            (
                set(9, &(-1.0f64).to_be_bytes()),
                MetricsError::BadRate(-1.0),
            ),
            (
                set(17, &f64::INFINITY.to_be_bytes()),
                MetricsError::BadLoss(f64::INFINITY),
            ),
            (
                set(25, &f64::NEG_INFINITY.to_be_bytes()),
                MetricsError::BadTime(f64::NEG_INFINITY),
            ),
            (set(51, &[4]), MetricsError::UnknownReach(4)),
            (set(52, &[3]), MetricsError::UnknownMode(3)),
            (set(53, &[2]), MetricsError::UnknownFlags(2)),
            (set(53, &[0]), MetricsError::UnknownFlags(0)),
            (set(55, &[0xff]), MetricsError::NameNotUtf8),
        ];
        for (bytes, want) in cases {
            let got = MetricsRecord::decode(&bytes).unwrap_err();
            // NaN != NaN: compare the messages.
            assert_eq!(got.to_string(), want.to_string(), "{bytes:?}");
        }
        let mut long = good[..METRICS_HEADER_BYTES].to_vec();
        long[METRICS_HEADER_BYTES - 1] = 65;
        long.extend(std::iter::repeat_n(b'a', 65));
        assert_eq!(
            MetricsRecord::decode(&long),
            Err(MetricsError::NameTooLong(65))
        );
        let too_long = PeerMetrics {
            name: "é".repeat(33),
            ..sample()
        };
        assert_eq!(
            MetricsRecord::Metrics(too_long).encode(),
            Err(MetricsError::NameTooLong(66))
        );
    }

    #[test]
    fn names_parse_back() {
        for r in [
            ReachClaim::Unknown,
            ReachClaim::Public,
            ReachClaim::HolePunched,
            ReachClaim::Relayed,
        ] {
            assert_eq!(ReachClaim::from_name(r.name()), Some(r));
        }
        for m in [ModeClaim::Node, ModeClaim::Client, ModeClaim::Aux] {
            assert_eq!(ModeClaim::from_name(m.name()), Some(m));
        }
        assert_eq!(ReachClaim::from_name("<script>"), None);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
            if let Ok(MetricsRecord::Metrics(m)) = MetricsRecord::decode(&bytes) {
                prop_assert!(m.check().is_ok());
                prop_assert_eq!(MetricsRecord::Metrics(m).encode().unwrap(), bytes);
            }
        }

        #[test]
        fn valid_metrics_round_trip(
            epoch: u64, rate in 0.0f64..1e12, loss in proptest::option::of(-1e6f64..1e6),
            name in "\\PC{0,16}", ok: u32, failed: u32, group: u16,
        ) {
            let m = PeerMetrics { epoch, samples_per_second: rate, loss, name, rounds_ok: ok,
                rounds_failed: failed, last_group_size: group, ..sample() };
            let record = MetricsRecord::Metrics(m);
            let bytes = record.encode().unwrap();
            prop_assert_eq!(MetricsRecord::decode(&bytes).unwrap(), record);
        }
    }
}
