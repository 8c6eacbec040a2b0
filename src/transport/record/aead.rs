//! The record layer's AEAD: one key of a negotiated TLS 1.3 suite, sealing and opening whole
//! records, on the implementation that is fastest on this CPU.
//!
//! # Two implementations of the same cipher (decision)
//!
//! AES-GCM is most of a data link's CPU (44 % of an all-reduce round's, `perf` of `bench
//! allreduce` on a 2-core AMD EPYC VM). aws-lc (through aws-lc-rs, the provider rustls runs the
//! handshake with) has two x86-64 AES-GCM codes: a VAES code written for AVX-512, and the
//! older AES-NI code (`aesni_gcm`, 128-bit registers). On a CPU with VAES but without AVX-512,
//! which is AMD's Zen 3 and Intel's client cores since Alder Lake, the machines many
//! volunteers run, it falls back to the AES-NI code. ring (already in the tree through libp2p)
//! carries BoringSSL's VAES code for 256-bit registers (`aes-gcm-avx2`). On such a CPU (the
//! 2-core EPYC VM, `cargo run --release --example aead_throughput`): on records in cache ring
//! seals at 5.4 GB/s and opens at 6.0 against aws-lc's 3.2 and 3.7, its in-place copy
//! included; on data streamed from memory both run at the memory's pace (3.2-3.5). In the
//! all-reduce, where a record is sealed from a tensor and opened from the socket buffer the
//! kernel just filled, ring gives 9 % more busbw (`bench allreduce --peers 4 --mib 64`,
//! alternated with `HIVEMESH_AES_GCM`, 4 runs each: 0.279-0.312 against 0.262-0.291). So:
//!
//! * **aws-lc** for ChaCha20-Poly1305, AES-256-GCM, and AES-128-GCM everywhere but the next
//!   case. It seals out of place (plaintext in, ciphertext out: no copy) and opens out of place
//!   into the reader's buffer.
//! * **ring** for AES-128-GCM on x86-64 CPUs with VAES, VPCLMULQDQ and AVX2 but not the
//!   AVX-512 set aws-lc's VAES code needs (F, DQ, BW, VL). Its interface works in place: the
//!   plaintext is copied into the send buffer and sealed there; a record is copied into the
//!   reader's buffer and opened there. The copies touch data that is in L1 right after (a
//!   record is at most 16 KiB), which is what the faster cipher more than pays for.
//!
//! Both compute the same function (RFC 5116's AEAD_AES_128_GCM with RFC 8446's nonces and
//! associated data): a record sealed by one opens with the other, byte for byte the same
//! (`record::tests`). `HIVEMESH_AES_GCM=aws-lc` or `=ring` overrides the choice, for
//! measurements; any other value is ignored with a warning.

use std::sync::LazyLock;

use aws_lc_rs::aead as awslc;
use ring::aead as ring_aead;

/// Bytes of an AEAD nonce (every suite of TLS 1.3).
pub(crate) const NONCE_LEN: usize = 12;
/// Bytes of an AEAD tag (every suite of TLS 1.3).
pub(crate) const TAG: usize = 16;

/// The AEAD algorithms a TLS 1.3 connection may have negotiated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Algorithm {
    /// TLS_AES_128_GCM_SHA256's.
    Aes128Gcm,
    /// TLS_AES_256_GCM_SHA384's.
    Aes256Gcm,
    /// TLS_CHACHA20_POLY1305_SHA256's.
    Chacha20Poly1305,
}

impl Algorithm {
    /// Bytes of its key.
    pub(crate) fn key_len(self) -> usize {
        match self {
            Self::Aes128Gcm => 16,
            Self::Aes256Gcm | Self::Chacha20Poly1305 => 32,
        }
    }
}

/// Which code runs AES-128-GCM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AesGcm {
    /// aws-lc's (out of place).
    AwsLc,
    /// ring's (in place, after a copy).
    Ring,
}

impl AesGcm {
    /// The faster one on this CPU, or the one `HIVEMESH_AES_GCM` names (see the module docs).
    pub(crate) fn for_this_machine() -> Self {
        static CHOICE: LazyLock<AesGcm> = LazyLock::new(|| {
            let detected = AesGcm::detect();
            match std::env::var("HIVEMESH_AES_GCM") {
                Ok(v) if v == "aws-lc" => AesGcm::AwsLc,
                Ok(v) if v == "ring" => AesGcm::Ring,
                Ok(v) => {
                    tracing::warn!(
                        value = %v,
                        chosen = ?detected,
                        "HIVEMESH_AES_GCM is neither aws-lc nor ring: ignored"
                    );
                    detected
                }
                Err(_) => detected,
            }
        });
        *CHOICE
    }

    /// ring where it has VAES code and aws-lc has none (VAES without AVX-512), else aws-lc.
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let vaes = std::arch::is_x86_feature_detected!("vaes")
                && std::arch::is_x86_feature_detected!("vpclmulqdq")
                && std::arch::is_x86_feature_detected!("avx2");
            let avx512 = std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512dq")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl");
            if vaes && !avx512 {
                return Self::Ring;
            }
        }
        Self::AwsLc
    }
}

/// The key could not be made (a wrong length for its algorithm).
#[derive(Debug)]
pub(crate) struct KeyLength;

/// A record failed to seal (a length past the AEAD's limits) or to open (it does not
/// authenticate).
#[derive(Debug)]
pub(crate) struct Unspecified;

/// One direction's AEAD key.
pub(crate) enum Key {
    AwsLc(awslc::LessSafeKey),
    /// Boxed: ring keeps the key schedule and GHASH table inline (over 500 bytes).
    Ring(Box<ring_aead::LessSafeKey>),
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::AwsLc(_) => "Key(aws-lc)",
            Self::Ring(_) => "Key(ring)",
        })
    }
}

impl Key {
    /// A key of `algorithm`; AES-128-GCM on the code `aes_gcm` names.
    pub(crate) fn new(
        algorithm: Algorithm,
        key: &[u8],
        aes_gcm: AesGcm,
    ) -> Result<Self, KeyLength> {
        if algorithm == Algorithm::Aes128Gcm && aes_gcm == AesGcm::Ring {
            let key =
                ring_aead::UnboundKey::new(&ring_aead::AES_128_GCM, key).map_err(|_| KeyLength)?;
            return Ok(Self::Ring(Box::new(ring_aead::LessSafeKey::new(key))));
        }
        let algorithm = match algorithm {
            Algorithm::Aes128Gcm => &awslc::AES_128_GCM,
            Algorithm::Aes256Gcm => &awslc::AES_256_GCM,
            Algorithm::Chacha20Poly1305 => &awslc::CHACHA20_POLY1305,
        };
        let key = awslc::UnboundKey::new(algorithm, key).map_err(|_| KeyLength)?;
        Ok(Self::AwsLc(awslc::LessSafeKey::new(key)))
    }

    /// Seals `plaintext` followed by the byte `content_type` (a `TLSInnerPlaintext` without
    /// padding) into `out`, which is exactly `plaintext.len() + 1 + TAG` bytes: the
    /// ciphertext, then the tag.
    pub(crate) fn seal(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        plaintext: &[u8],
        content_type: u8,
        out: &mut [u8],
    ) -> Result<(), Unspecified> {
        let n = plaintext.len();
        if out.len() != n + 1 + TAG {
            return Err(Unspecified);
        }
        match self {
            Self::AwsLc(key) => {
                let (ciphertext, extra) = out.split_at_mut(n);
                key.seal_out_of_place_scatter(
                    awslc::Nonce::assume_unique_for_key(nonce),
                    awslc::Aad::from(aad),
                    plaintext,
                    ciphertext,
                    &[content_type],
                    extra,
                )
                .map_err(|_| Unspecified)
            }
            Self::Ring(key) => {
                let (body, tag_out) = out.split_at_mut(n + 1);
                body[..n].copy_from_slice(plaintext);
                body[n] = content_type;
                let tag = key
                    .seal_in_place_separate_tag(
                        ring_aead::Nonce::assume_unique_for_key(nonce),
                        ring_aead::Aad::from(aad),
                        body,
                    )
                    .map_err(|_| Unspecified)?;
                tag_out.copy_from_slice(tag.as_ref());
                Ok(())
            }
        }
    }

    /// Opens `ciphertext` with its `tag` into `out` (exactly `ciphertext.len()` bytes). On an
    /// error, `out` holds unspecified bytes.
    pub(crate) fn open(
        &self,
        nonce: [u8; NONCE_LEN],
        aad: &[u8],
        ciphertext: &[u8],
        tag: &[u8],
        out: &mut [u8],
    ) -> Result<(), Unspecified> {
        if out.len() != ciphertext.len() {
            return Err(Unspecified);
        }
        match self {
            Self::AwsLc(key) => key
                .open_separate_gather(
                    awslc::Nonce::assume_unique_for_key(nonce),
                    awslc::Aad::from(aad),
                    ciphertext,
                    tag,
                    out,
                )
                .map_err(|_| Unspecified),
            Self::Ring(key) => {
                let tag = ring_aead::Tag::try_from(tag).map_err(|_| Unspecified)?;
                out.copy_from_slice(ciphertext);
                key.open_in_place_separate_tag(
                    ring_aead::Nonce::assume_unique_for_key(nonce),
                    ring_aead::Aad::from(aad),
                    tag,
                    out,
                    0..,
                )
                .map(drop)
                .map_err(|_| Unspecified)
            }
        }
    }
}
