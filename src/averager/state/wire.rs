//! Wire encoding of the state-sharing protocol: prost types from `proto/hivemesh/state.proto`,
//! translated at this boundary ("parse, don't validate"), and the length-delimited framing on a
//! stream.
//!
//! [`decode_request`] and [`decode_response`] check the length before decoding and every field
//! after: session and schema-hash lengths, known dtypes, at most [`MAX_TENSORS`] tensors of at
//! most [`MAX_DIMS`] dimensions whose sizes add up (without overflow) to `total_bytes`, a chunk
//! size within [`MIN_CHUNK_BYTES`]`..=`[`MAX_CHUNK_BYTES`], exactly one 32-byte hash per chunk,
//! user metadata within [`MAX_METADATA_BYTES`], and a content hash equal to the one recomputed
//! from all of that ([`content_hash`]). A decoded [`Metadata`] is therefore self-consistent;
//! whether it is *ours* (same schema) is the newcomer's check. Anything else is a typed
//! [`WireError`]; nothing panics on arbitrary bytes.

use bytes::Bytes;
use prost::Message as _;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::allreduce::TensorDescriptor;
use crate::proto_guard::{self, Field, Kind};
use crate::tensor::DType;

/// Generated prost types (do not use outside this boundary).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/hivemesh.state.v1.rs"));
}

/// Largest accepted request frame.
pub const MAX_REQUEST_BYTES: usize = 1024;
/// Largest accepted response frame (a metadata answer: tensors, chunk hashes, user metadata).
pub const MAX_RESPONSE_BYTES: usize = 32 << 20;
/// Longest session id.
pub const MAX_SESSION_BYTES: usize = 64;
/// Longest schema hash.
pub const MAX_SCHEMA_HASH_BYTES: usize = crate::matchmaking::MAX_SCHEMA_HASH_BYTES;
/// Most tensors in a state.
pub const MAX_TENSORS: usize = 1 << 16;
/// Most dimensions of one tensor.
pub const MAX_DIMS: usize = 32;
/// Largest user metadata shared with the tensors.
pub const MAX_METADATA_BYTES: usize = 1 << 20;
/// Smallest chunk size a donor may use.
pub const MIN_CHUNK_BYTES: u64 = 1 << 10;
/// Largest chunk size a donor may use.
pub const MAX_CHUNK_BYTES: u64 = 8 << 20;
/// Bytes of one SHA-256 hash.
pub const HASH_BYTES: usize = 32;

/// A malformed, oversized or out-of-limits frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The frame is longer than the limit (judged from its length prefix).
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// The length prefix is not a valid varint.
    #[error("malformed length prefix")]
    BadLength,
    /// The stream ended inside a frame.
    #[error("stream closed mid-frame")]
    Truncated,
    /// Reading or writing the stream failed.
    #[error("i/o: {0}")]
    Io(String),
    /// Not a valid protobuf message.
    #[error("undecodable message: {0}")]
    Decode(String),
    /// A required field is missing.
    #[error("message lacks {0}")]
    Missing(&'static str),
    /// A field outside its limits, or fields that contradict each other.
    #[error("{field} is invalid: {reason}")]
    Invalid {
        /// Field name.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> WireError {
    WireError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// Newcomer → donor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Snapshot the state and describe it (opens a session).
    Metadata,
    /// One chunk of a session's snapshot.
    Chunk {
        /// The session (from [`Metadata::session`]).
        session: Bytes,
        /// Chunk index.
        index: u64,
    },
    /// The newcomer is done with the session (no answer).
    Release {
        /// The session.
        session: Bytes,
    },
}

/// Why a donor refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The donor does not share its state (now).
    NotSharing,
    /// The donor holds as many sessions as it allows.
    Busy,
    /// No such session for this newcomer (expired, replaced or released).
    UnknownSession,
    /// The request names a chunk outside the snapshot.
    BadRequest,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::NotSharing => "not sharing",
            Self::Busy => "busy",
            Self::UnknownSession => "unknown session",
            Self::BadRequest => "bad request",
        })
    }
}

/// A snapshot's description (see `proto/hivemesh/state.proto`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Metadata {
    /// Names the snapshot in chunk requests.
    pub session: Bytes,
    /// The donor averager's schema hash.
    pub schema_hash: Bytes,
    /// Shapes and dtypes of the tensors, in order.
    pub tensors: Vec<TensorDescriptor>,
    /// Length of the concatenated raw tensor data.
    pub total_bytes: u64,
    /// Chunk size of this snapshot.
    pub chunk_bytes: u64,
    /// SHA-256 of every chunk, concatenated.
    pub chunk_hashes: Bytes,
    /// [`content_hash`] of all the above but the session, and of `metadata`.
    pub content_hash: [u8; HASH_BYTES],
    /// Opaque user metadata shared with the tensors.
    pub metadata: Bytes,
}

impl Metadata {
    /// Number of chunks.
    pub fn chunks(&self) -> u64 {
        chunk_count(self.total_bytes, self.chunk_bytes)
    }

    /// The byte range of chunk `index` within the concatenated data (`None` past the end).
    pub fn chunk_range(&self, index: u64) -> Option<std::ops::Range<u64>> {
        (index < self.chunks()).then(|| {
            let start = index * self.chunk_bytes;
            start..(start + self.chunk_bytes).min(self.total_bytes)
        })
    }

    /// The expected SHA-256 of chunk `index` (`None` past the end).
    pub fn chunk_hash(&self, index: u64) -> Option<&[u8]> {
        let i = usize::try_from(index).ok()?;
        self.chunk_hashes
            .get(i.checked_mul(HASH_BYTES)?..(i + 1).checked_mul(HASH_BYTES)?)
    }
}

/// Donor → newcomer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Response {
    /// Answer to [`Request::Metadata`].
    Metadata(Metadata),
    /// Answer to [`Request::Chunk`].
    Chunk {
        /// The chunk's index.
        index: u64,
        /// Its bytes.
        data: Bytes,
    },
    /// The request was refused.
    Refused(Refusal),
}

/// `ceil(total / chunk)` (0 for an empty state; `chunk` must be non-zero).
pub fn chunk_count(total: u64, chunk: u64) -> u64 {
    total.div_ceil(chunk.max(1))
}

/// The SHA-256 of one chunk.
pub fn chunk_hash(data: &[u8]) -> [u8; HASH_BYTES] {
    Sha256::digest(data).into()
}

/// The content hash of a state: SHA-256 over a domain tag, the schema hash, every tensor's
/// shape and dtype, the total and chunk sizes, the chunk hashes and the user metadata, each
/// length-prefixed. Two snapshots with equal content hashes serve the same bytes chunk by chunk.
pub fn content_hash(
    schema_hash: &[u8],
    tensors: &[TensorDescriptor],
    total_bytes: u64,
    chunk_bytes: u64,
    chunk_hashes: &[u8],
    metadata: &[u8],
) -> [u8; HASH_BYTES] {
    let mut h = Sha256::new();
    h.update(b"hivemesh/state/v1\0");
    h.update((schema_hash.len() as u64).to_le_bytes());
    h.update(schema_hash);
    h.update((tensors.len() as u64).to_le_bytes());
    for t in tensors {
        h.update((t.shape.len() as u64).to_le_bytes());
        for &d in &t.shape {
            h.update((d as u64).to_le_bytes());
        }
        h.update(t.dtype.code().to_le_bytes());
    }
    h.update(total_bytes.to_le_bytes());
    h.update(chunk_bytes.to_le_bytes());
    h.update((chunk_hashes.len() as u64).to_le_bytes());
    h.update(chunk_hashes);
    h.update((metadata.len() as u64).to_le_bytes());
    h.update(metadata);
    h.finalize().into()
}

/// Encodes a request (without the length prefix).
pub fn encode_request(request: &Request) -> Vec<u8> {
    use proto::state_request::Kind;
    let kind = match request {
        Request::Metadata => Kind::Metadata(proto::MetadataRequest {}),
        Request::Chunk { session, index } => Kind::Chunk(proto::ChunkRequest {
            session: session.clone(),
            index: *index,
        }),
        Request::Release { session } => Kind::Release(proto::ReleaseRequest {
            session: session.clone(),
        }),
    };
    proto::StateRequest { kind: Some(kind) }.encode_to_vec()
}

fn check_session(session: &Bytes) -> Result<(), WireError> {
    if session.is_empty() || session.len() > MAX_SESSION_BYTES {
        return Err(invalid(
            "session",
            format!("{} bytes (must be 1..={MAX_SESSION_BYTES})", session.len()),
        ));
    }
    Ok(())
}

/// Decodes and checks a request body.
pub fn decode_request(body: Bytes) -> Result<Request, WireError> {
    use proto::state_request::Kind;
    if body.len() > MAX_REQUEST_BYTES {
        return Err(WireError::TooLarge {
            len: body.len() as u64,
            max: MAX_REQUEST_BYTES,
        });
    }
    let message =
        proto::StateRequest::decode(body).map_err(|e| WireError::Decode(e.to_string()))?;
    match message.kind.ok_or(WireError::Missing("request kind"))? {
        Kind::Metadata(_) => Ok(Request::Metadata),
        Kind::Chunk(c) => {
            check_session(&c.session)?;
            Ok(Request::Chunk {
                session: c.session,
                index: c.index,
            })
        }
        Kind::Release(r) => {
            check_session(&r.session)?;
            Ok(Request::Release { session: r.session })
        }
    }
}

fn refusal_to_wire(r: Refusal) -> proto::RefuseReason {
    match r {
        Refusal::NotSharing => proto::RefuseReason::NotSharing,
        Refusal::Busy => proto::RefuseReason::Busy,
        Refusal::UnknownSession => proto::RefuseReason::UnknownSession,
        Refusal::BadRequest => proto::RefuseReason::BadRequest,
    }
}

/// Encodes a response (without the length prefix).
pub fn encode_response(response: &Response) -> Vec<u8> {
    use proto::state_response::Kind;
    let kind = match response {
        Response::Metadata(m) => Kind::Metadata(proto::StateMetadata {
            session: m.session.clone(),
            schema_hash: m.schema_hash.clone(),
            tensors: m
                .tensors
                .iter()
                .map(|t| proto::TensorInfo {
                    shape: t.shape.iter().map(|&d| d as u64).collect(),
                    dtype: t.dtype.code(),
                })
                .collect(),
            total_bytes: m.total_bytes,
            chunk_bytes: m.chunk_bytes,
            chunk_hashes: m.chunk_hashes.clone(),
            content_hash: Bytes::copy_from_slice(&m.content_hash),
            metadata: m.metadata.clone(),
        }),
        Response::Chunk { index, data } => Kind::Chunk(proto::Chunk {
            index: *index,
            data: data.clone(),
        }),
        Response::Refused(r) => Kind::Refused(proto::Refused {
            reason: refusal_to_wire(*r) as i32,
        }),
    };
    proto::StateResponse { kind: Some(kind) }.encode_to_vec()
}

/// What a response may hold, counted before decoding (`crate::proto_guard`): one kind; at
/// most [`MAX_TENSORS`] tensors with [`MAX_DIMS`] dimensions each, summed over the response.
const RESPONSE_SHAPE: [Field<'static>; 3] = {
    const TENSOR: [Field<'static>; 1] = [Field {
        number: 1,
        max: MAX_TENSORS * MAX_DIMS,
        slot: 2,
        kind: Kind::Varints,
    }];
    const METADATA: [Field<'static>; 1] = [Field {
        number: 3,
        max: MAX_TENSORS,
        slot: 1,
        kind: Kind::Message(&TENSOR),
    }];
    [
        Field {
            number: 1,
            max: 1,
            slot: 0,
            kind: Kind::Message(&METADATA),
        },
        Field {
            number: 2,
            max: 1,
            slot: 0,
            kind: Kind::Opaque,
        },
        Field {
            number: 3,
            max: 1,
            slot: 0,
            kind: Kind::Opaque,
        },
    ]
};

/// Decodes and checks a response body (see the module docs for the checks).
pub fn decode_response(body: Bytes) -> Result<Response, WireError> {
    use proto::state_response::Kind;
    if body.len() > MAX_RESPONSE_BYTES {
        return Err(WireError::TooLarge {
            len: body.len() as u64,
            max: MAX_RESPONSE_BYTES,
        });
    }
    proto_guard::check(&body, &RESPONSE_SHAPE).map_err(|e| WireError::Decode(e.to_string()))?;
    let message =
        proto::StateResponse::decode(body).map_err(|e| WireError::Decode(e.to_string()))?;
    match message.kind.ok_or(WireError::Missing("response kind"))? {
        Kind::Metadata(m) => decode_metadata(m).map(Response::Metadata),
        Kind::Chunk(c) => Ok(Response::Chunk {
            index: c.index,
            data: c.data,
        }),
        Kind::Refused(r) => {
            let reason = match proto::RefuseReason::try_from(r.reason) {
                Ok(proto::RefuseReason::NotSharing) => Refusal::NotSharing,
                Ok(proto::RefuseReason::Busy) => Refusal::Busy,
                Ok(proto::RefuseReason::UnknownSession) => Refusal::UnknownSession,
                Ok(proto::RefuseReason::BadRequest) => Refusal::BadRequest,
                Ok(proto::RefuseReason::RefuseUnspecified) | Err(_) => {
                    return Err(invalid("refuse reason", format!("value {}", r.reason)));
                }
            };
            Ok(Response::Refused(reason))
        }
    }
}

fn decode_metadata(m: proto::StateMetadata) -> Result<Metadata, WireError> {
    check_session(&m.session)?;
    if m.schema_hash.is_empty() || m.schema_hash.len() > MAX_SCHEMA_HASH_BYTES {
        return Err(invalid(
            "schema_hash",
            format!(
                "{} bytes (must be 1..={MAX_SCHEMA_HASH_BYTES})",
                m.schema_hash.len()
            ),
        ));
    }
    if m.tensors.len() > MAX_TENSORS {
        return Err(invalid(
            "tensors",
            format!("{} tensors (at most {MAX_TENSORS})", m.tensors.len()),
        ));
    }
    let mut tensors = Vec::with_capacity(m.tensors.len());
    let mut total: u64 = 0;
    for t in &m.tensors {
        if t.shape.len() > MAX_DIMS {
            return Err(invalid(
                "tensors",
                format!("{} dimensions (at most {MAX_DIMS})", t.shape.len()),
            ));
        }
        let dtype = DType::from_code(t.dtype)
            .ok_or_else(|| invalid("dtype", format!("code {}", t.dtype)))?;
        let mut numel: u64 = 1;
        let mut shape = Vec::with_capacity(t.shape.len());
        for &d in &t.shape {
            numel = numel
                .checked_mul(d)
                .ok_or_else(|| invalid("tensors", "size overflows"))?;
            shape.push(usize::try_from(d).map_err(|_| invalid("tensors", "size overflows"))?);
        }
        let bytes = numel
            .checked_mul(dtype.size_bytes() as u64)
            .ok_or_else(|| invalid("tensors", "size overflows"))?;
        usize::try_from(bytes).map_err(|_| invalid("tensors", "size overflows"))?;
        total = total
            .checked_add(bytes)
            .ok_or_else(|| invalid("tensors", "size overflows"))?;
        tensors.push(TensorDescriptor { shape, dtype });
    }
    if usize::try_from(total).is_err() {
        return Err(invalid("tensors", "size overflows"));
    }
    if total != m.total_bytes {
        return Err(invalid(
            "total_bytes",
            format!("{} but the tensors hold {total}", m.total_bytes),
        ));
    }
    if !(MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(&m.chunk_bytes) {
        return Err(invalid(
            "chunk_bytes",
            format!(
                "{} (must be {MIN_CHUNK_BYTES}..={MAX_CHUNK_BYTES})",
                m.chunk_bytes
            ),
        ));
    }
    let chunks = chunk_count(total, m.chunk_bytes);
    if Some(m.chunk_hashes.len() as u64) != chunks.checked_mul(HASH_BYTES as u64) {
        return Err(invalid(
            "chunk_hashes",
            format!(
                "{} bytes for {chunks} chunks of {HASH_BYTES}",
                m.chunk_hashes.len()
            ),
        ));
    }
    if m.metadata.len() > MAX_METADATA_BYTES {
        return Err(invalid(
            "metadata",
            format!("{} bytes (at most {MAX_METADATA_BYTES})", m.metadata.len()),
        ));
    }
    let content: [u8; HASH_BYTES] = m
        .content_hash
        .as_ref()
        .try_into()
        .map_err(|_| invalid("content_hash", format!("{} bytes", m.content_hash.len())))?;
    let expected = content_hash(
        &m.schema_hash,
        &tensors,
        total,
        m.chunk_bytes,
        &m.chunk_hashes,
        &m.metadata,
    );
    if content != expected {
        return Err(invalid(
            "content_hash",
            "does not match the described state",
        ));
    }
    Ok(Metadata {
        session: m.session,
        schema_hash: m.schema_hash,
        tensors,
        total_bytes: total,
        chunk_bytes: m.chunk_bytes,
        chunk_hashes: m.chunk_hashes,
        content_hash: content,
        metadata: m.metadata,
    })
}

/// Writes one length-delimited frame and flushes.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), WireError> {
    crate::wire::write_delimited(w, body)
        .await
        .map_err(|e| WireError::Io(e.to_string()))
}

/// Reads one length-delimited frame of at most `max` bytes: `Ok(None)` if the stream ends
/// cleanly before a frame begins ([`crate::wire::read_delimited`]: the limit is checked from
/// the length prefix; one request, one answer, so bytes after the frame are an error).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<Bytes>, WireError> {
    use crate::wire::DelimitedError as D;
    crate::wire::read_delimited(r, max)
        .await
        .map_err(|e| match e {
            D::TooLarge { len, max } => WireError::TooLarge { len, max },
            D::BadLength => WireError::BadLength,
            D::Truncated => WireError::Truncated,
            D::Trailing => invalid("frame", "bytes beyond the frame before its answer"),
            D::Io(e) => WireError::Io(e),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use proptest::prelude::*;
    use tokio::io::AsyncWriteExt as _;

    fn sample_metadata() -> Metadata {
        let tensors = vec![
            TensorDescriptor {
                shape: vec![3, 5],
                dtype: DType::F32,
            },
            TensorDescriptor {
                shape: vec![],
                dtype: DType::BF16,
            },
        ];
        let total = 3 * 5 * 4 + 2;
        let chunk_bytes = 1024;
        let chunk_hashes = Bytes::from(chunk_hash(&[7u8; 62]).to_vec());
        let schema = Bytes::from_static(b"schema");
        let metadata = Bytes::from_static(b"{x: 123}");
        Metadata {
            session: Bytes::from_static(b"s1"),
            content_hash: content_hash(
                &schema,
                &tensors,
                total,
                chunk_bytes,
                &chunk_hashes,
                &metadata,
            ),
            schema_hash: schema,
            tensors,
            total_bytes: total,
            chunk_bytes,
            chunk_hashes,
            metadata,
        }
    }

    #[test]
    fn round_trips() {
        for r in [
            Request::Metadata,
            Request::Chunk {
                session: Bytes::from_static(b"abc"),
                index: 9,
            },
            Request::Release {
                session: Bytes::from_static(b"abc"),
            },
        ] {
            assert_eq!(decode_request(encode_request(&r).into()).unwrap(), r);
        }
        for r in [
            Response::Metadata(sample_metadata()),
            Response::Chunk {
                index: 3,
                data: Bytes::from_static(b"data"),
            },
            Response::Refused(Refusal::Busy),
            Response::Refused(Refusal::NotSharing),
        ] {
            assert_eq!(decode_response(encode_response(&r).into()).unwrap(), r);
        }
        let m = sample_metadata();
        assert_eq!(m.chunks(), 1);
        assert_eq!(m.chunk_range(0), Some(0..62));
        assert_eq!(m.chunk_range(1), None);
        assert_eq!(m.chunk_hash(0).map(<[u8]>::len), Some(HASH_BYTES));
        assert_eq!(m.chunk_hash(1), None);
    }

    #[test]
    fn inconsistent_metadata_is_rejected() {
        let reencode = |f: &Mutation| {
            let mut m = sample_metadata();
            f(&mut m);
            decode_response(encode_response(&Response::Metadata(m)).into())
        };
        type Mutation = dyn Fn(&mut Metadata);
        let cases: [(&str, &Mutation); 8] = [
            ("total", &|m| m.total_bytes += 1),
            ("chunk size", &|m| m.chunk_bytes = 1),
            ("hash count", &|m| {
                m.chunk_hashes = Bytes::from(vec![0; 2 * HASH_BYTES])
            }),
            ("content hash", &|m| m.content_hash[0] ^= 1),
            ("chunk hash", &|m| {
                let mut h = m.chunk_hashes.to_vec();
                h[0] ^= 1;
                m.chunk_hashes = h.into();
            }),
            ("metadata", &|m| m.metadata = Bytes::from_static(b"other")),
            ("session", &|m| m.session = Bytes::new()),
            ("schema", &|m| m.schema_hash = Bytes::from(vec![1; 65])),
        ];
        for (what, f) in cases {
            assert!(
                matches!(reencode(f), Err(WireError::Invalid { .. })),
                "{what}"
            );
        }
        // A dtype code we do not know.
        let mut p = proto::StateMetadata {
            session: Bytes::from_static(b"s"),
            schema_hash: Bytes::from_static(b"h"),
            tensors: vec![proto::TensorInfo {
                shape: vec![u64::MAX, u64::MAX],
                dtype: 0,
            }],
            chunk_bytes: 1024,
            ..Default::default()
        };
        assert!(decode_metadata(p.clone()).is_err(), "size overflow");
        p.tensors[0].dtype = 9;
        assert!(decode_metadata(p).is_err(), "unknown dtype");
    }

    #[tokio::test]
    async fn frames_are_bounded_by_their_prefix() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, b"hello").await.unwrap();
        assert_eq!(
            read_frame(&mut b, 16).await.unwrap().as_deref(),
            Some(&b"hello"[..])
        );
        // A 4 GiB prefix is refused before anything is buffered.
        let mut prefix = BytesMut::new();
        crate::wire::put_length_prefix(4 << 30, &mut prefix);
        a.write_all(&prefix).await.unwrap();
        assert!(matches!(
            read_frame(&mut b, 1 << 20).await,
            Err(WireError::TooLarge { .. })
        ));
        // A clean end of stream before a frame is `None`; inside one, an error.
        drop(a);
        assert_eq!(read_frame(&mut b, 16).await.unwrap(), None);
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&[5, 1, 2]).await.unwrap();
        drop(a);
        assert_eq!(read_frame(&mut b, 16).await, Err(WireError::Truncated));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(Bytes::from(bytes.clone()));
            let _ = decode_response(Bytes::from(bytes));
        }
    }
}
