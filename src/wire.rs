//! Wire encoding of round messages: prost types from `proto/hivemesh/averaging.proto`,
//! length-delimited framing with a maximum frame size, and validated conversion into the
//! domain types of [`crate::allreduce`].
//!
//! Prost types stay in [`proto`]; everything past [`decode_frame`] / [`FrameDecoder`] sees only
//! [`Frame`]s whose enums, sizes and fields were checked ("parse, don't validate"). A frame
//! whose declared length exceeds the limit is rejected from its length prefix alone, and a frame
//! under the limit grows the buffer only as its bytes arrive, so a peer claiming a 4 GiB frame
//! costs the receiver nothing.
//!
//! Link setup frames ([`LinkMessage`]: Hello, Ack, Reject; see [`crate::links`]) are framed the
//! same way with their own, small, limit ([`MAX_LINK_FRAME_BYTES`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use libp2p::PeerId;
use prost::Message as _;

use crate::allreduce::{AbortReason, AveragedMessage, Message, PartMessage, PeerSet, Role};
use crate::compression::CompressionType;
use crate::tensor::DType;

/// Generated prost types (do not use outside the network boundary).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/hivemesh.averaging.v1.rs"));
}

/// Default maximum encoded frame size: 16 MiB (parts default to 512 KiB).
pub const DEFAULT_MAX_FRAME_BYTES: usize = 16 << 20;
/// Longest accepted group id.
pub const MAX_GROUP_ID_BYTES: usize = 64;
/// Most contributor words in a reply (64 peers each): groups of up to 4096 peers.
pub const MAX_CONTRIBUTOR_WORDS: usize = 64;
/// Largest accepted link setup frame ([`LinkMessage`]).
pub const MAX_LINK_FRAME_BYTES: usize = 1024;
/// Longest [`Reject::detail`] sent (longer details are cut at a character boundary).
pub const MAX_REJECT_DETAIL_BYTES: usize = 256;

/// A malformed or oversized frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The length prefix announces more than the limit.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// The length prefix is not a valid varint.
    #[error("bad length prefix")]
    BadLength,
    /// The bytes are not a valid protobuf message.
    #[error("undecodable frame: {0}")]
    Decode(String),
    /// A required field is missing.
    #[error("frame lacks {0}")]
    Missing(&'static str),
    /// An enum field has a value we do not know.
    #[error("unknown {field} value {value}")]
    UnknownEnum {
        /// Field name.
        field: &'static str,
        /// Value received.
        value: i32,
    },
    /// The group id is empty or too long.
    #[error("group id of {0} bytes (must be 1..={MAX_GROUP_ID_BYTES})")]
    GroupId(usize),
    /// A member set (a reply's contributors, a chain notice's failed members) is too large.
    #[error("member set of {0} words (at most {MAX_CONTRIBUTOR_WORDS})")]
    Contributors(usize),
    /// A peer id field does not hold a valid peer id.
    #[error("invalid peer id: {0}")]
    PeerId(String),
    /// An endpoint is not `ip:port` with a specified IP and a port other than 0.
    #[error("invalid endpoint {0:?}")]
    Endpoint(String),
    /// A census naming more members than [`MAX_CENSUS`].
    #[error("a census of {0} members (at most {MAX_CENSUS})")]
    Census(usize),
    /// A census statement whose signature is not [`CENSUS_SIGNATURE_BYTES`] long, or an end
    /// of a census round that carries a statement's fields.
    #[error("a malformed census frame")]
    CensusFrame,
}

/// A validated frame: which round, and what.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// The group (round) id.
    pub group_id: Bytes,
    /// The message.
    pub message: Message,
}

fn compression_to_wire(c: CompressionType) -> proto::CompressionType {
    match c {
        CompressionType::None => proto::CompressionType::CompressionNone,
        CompressionType::Float16 => proto::CompressionType::CompressionFloat16,
        CompressionType::Quantile8Bit => proto::CompressionType::CompressionQuantile8bit,
        CompressionType::Uniform8Bit => proto::CompressionType::CompressionUniform8bit,
        CompressionType::Blockwise8Bit => proto::CompressionType::CompressionBlockwise8bit,
        CompressionType::BFloat16 => proto::CompressionType::CompressionBfloat16,
        CompressionType::SparseTopK => proto::CompressionType::CompressionSparseTopk,
    }
}

fn dtype_to_wire(d: DType) -> proto::DType {
    match d {
        DType::F32 => proto::DType::DtypeFloat32,
        DType::F16 => proto::DType::DtypeFloat16,
        DType::BF16 => proto::DType::DtypeBfloat16,
    }
}

fn tensor_part(
    part: u32,
    codec: CompressionType,
    dtype: DType,
    payload: &Bytes,
) -> proto::TensorPart {
    proto::TensorPart {
        part_index: part,
        compression: compression_to_wire(codec) as i32,
        dtype: dtype_to_wire(dtype) as i32,
        payload: payload.clone(),
    }
}

impl From<&Frame> for proto::RoundFrame {
    fn from(f: &Frame) -> Self {
        use proto::round_frame::Body;
        let body = match &f.message {
            Message::Part(p) => Body::Part(proto::Part {
                tensor: Some(tensor_part(p.part, p.codec, p.dtype, &p.payload)),
                weight: p.weight,
            }),
            Message::Averaged(a) => Body::Averaged(proto::AveragedPart {
                delta: Some(tensor_part(a.part, a.codec, a.dtype, &a.payload)),
                contributors: a.contributors.words().to_vec(),
            }),
            Message::Abort { role, reason } => Body::Abort(proto::Abort {
                role: match role {
                    Role::Sender => proto::Role::Sender,
                    Role::Reducer => proto::Role::Reducer,
                } as i32,
                reason: match reason {
                    AbortReason::Cancelled => proto::AbortReason::AbortCancelled,
                    AbortReason::Banned => proto::AbortReason::AbortBanned,
                    AbortReason::Internal => proto::AbortReason::AbortInternal,
                } as i32,
            }),
            Message::Notice { failed } => Body::Notice(proto::ChainNotice {
                failed: failed.words().to_vec(),
            }),
        };
        Self {
            group_id: f.group_id.clone(),
            body: Some(body),
        }
    }
}

fn parse_tensor(
    t: Option<proto::TensorPart>,
) -> Result<(u32, CompressionType, DType, Bytes), WireError> {
    let t = t.ok_or(WireError::Missing("tensor part"))?;
    let codec = CompressionType::from_code(t.compression as u32)
        .filter(|_| t.compression >= 0)
        .ok_or(WireError::UnknownEnum {
            field: "compression",
            value: t.compression,
        })?;
    let dtype = DType::from_code(t.dtype as u32)
        .filter(|_| t.dtype >= 0)
        .ok_or(WireError::UnknownEnum {
            field: "dtype",
            value: t.dtype,
        })?;
    Ok((t.part_index, codec, dtype, t.payload))
}

impl TryFrom<proto::RoundFrame> for Frame {
    type Error = WireError;

    fn try_from(f: proto::RoundFrame) -> Result<Self, Self::Error> {
        use proto::round_frame::Body;
        if f.group_id.is_empty() || f.group_id.len() > MAX_GROUP_ID_BYTES {
            return Err(WireError::GroupId(f.group_id.len()));
        }
        let message = match f.body.ok_or(WireError::Missing("body"))? {
            Body::Part(p) => {
                let (part, codec, dtype, payload) = parse_tensor(p.tensor)?;
                Message::Part(PartMessage {
                    part,
                    weight: p.weight,
                    codec,
                    dtype,
                    payload,
                })
            }
            Body::Averaged(a) => {
                let (part, codec, dtype, payload) = parse_tensor(a.delta)?;
                if a.contributors.len() > MAX_CONTRIBUTOR_WORDS {
                    return Err(WireError::Contributors(a.contributors.len()));
                }
                Message::Averaged(AveragedMessage {
                    part,
                    codec,
                    dtype,
                    contributors: PeerSet::from_words(a.contributors),
                    payload,
                    finite: None,
                })
            }
            Body::Abort(a) => Message::Abort {
                role: match proto::Role::try_from(a.role) {
                    Ok(proto::Role::Sender) => Role::Sender,
                    Ok(proto::Role::Reducer) => Role::Reducer,
                    Err(_) => {
                        return Err(WireError::UnknownEnum {
                            field: "role",
                            value: a.role,
                        });
                    }
                },
                reason: match proto::AbortReason::try_from(a.reason) {
                    Ok(proto::AbortReason::AbortCancelled) => AbortReason::Cancelled,
                    Ok(proto::AbortReason::AbortBanned) => AbortReason::Banned,
                    Ok(proto::AbortReason::AbortInternal) => AbortReason::Internal,
                    Err(_) => {
                        return Err(WireError::UnknownEnum {
                            field: "abort reason",
                            value: a.reason,
                        });
                    }
                },
            },
            Body::Notice(n) => {
                if n.failed.len() > MAX_CONTRIBUTOR_WORDS {
                    return Err(WireError::Contributors(n.failed.len()));
                }
                Message::Notice {
                    failed: PeerSet::from_words(n.failed),
                }
            }
        };
        Ok(Self {
            group_id: f.group_id,
            message,
        })
    }
}

/// A link setup message (see [`crate::links`]): the first frame on a new link and its answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkMessage {
    /// Opener → acceptor: which round this link is for and who opens it.
    Hello(Hello),
    /// Acceptor → opener: the link is handed to the round; round frames may follow.
    Ack,
    /// Acceptor → opener: refused; the acceptor closes the link.
    Reject(Reject),
    /// Opener → acceptor, instead of a Hello: open a direct TCP connection by a simultaneous
    /// open, from `endpoint` (the opener's, as its NAT maps it), for a TLS link.
    Punch {
        /// The Hello the TLS link will carry.
        hello: Hello,
        /// The opener's endpoint.
        endpoint: std::net::SocketAddr,
    },
    /// Acceptor → opener: the acceptor's endpoint for the simultaneous open.
    PunchAnswer(std::net::SocketAddr),
    /// Opener → acceptor, instead of a Hello: the opener cannot make this link (its hole punch
    /// failed), so the acceptor stops waiting for it.
    GiveUp(Hello),
    /// Both ways on every link of a round with hole-punched pairs, before round frames, in
    /// census rounds ([`crate::links::census`]): a member's signed statement, or `None` for the
    /// end of this census round's statements on the link.
    Census(Option<CensusStatement>),
}

/// Most member indices a [`CensusStatement`] carries.
pub const MAX_CENSUS: usize = 64;
/// The length of a census statement's signature (Ed25519).
pub const CENSUS_SIGNATURE_BYTES: usize = 64;

/// One member's census statement: the members it could not link to in this round, signed by
/// it ([`crate::links::census::sign`]), so that any member can pass it on and nobody can
/// change it or speak for another member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CensusStatement {
    /// The member (group index) whose statement this is.
    pub member: u32,
    /// The member indices it could not link to (at most [`MAX_CENSUS`]).
    pub unlinked: Vec<u32>,
    /// Its signature ([`CENSUS_SIGNATURE_BYTES`]) over
    /// [`crate::links::census::signing_payload`].
    pub signature: Bytes,
}

/// The first frame on a new link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The group (round) id, 1..=[`MAX_GROUP_ID_BYTES`] bytes.
    pub group_id: Bytes,
    /// The opener's index in the group's member order.
    pub from_index: u32,
    /// The opener's peer id (checked against the one the connection authenticated).
    pub from_peer: PeerId,
}

/// A refused link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reject {
    /// Why.
    pub reason: RejectReason,
    /// Detail for logs (at most [`MAX_REJECT_DETAIL_BYTES`] are sent).
    pub detail: String,
}

/// Why an acceptor refused a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// No round with this group id waits for links at the acceptor (yet).
    UnknownGroup,
    /// The claimed member index does not hold the sender's peer id.
    NotMember,
    /// The peer id in the Hello is not the one the connection authenticated.
    IdentityMismatch,
    /// This member does not open links to the acceptor ([`crate::reach::opener`]).
    WrongDirection,
    /// This pair is linked already.
    Duplicate,
    /// The link runs through a relay, which the two members do not both allow for tensor data.
    RelayNotAllowed,
    /// The acceptor cannot take part in a simultaneous open ([`LinkMessage::Punch`]).
    NoPunch,
    /// The acceptor runs a private swarm and does not know the opener as one of its members
    /// (yet): refused right after the TLS handshake ([`crate::p2p::SwarmKey`]).
    NotInSwarm,
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::UnknownGroup => "unknown group",
            Self::NotMember => "not a member",
            Self::IdentityMismatch => "identity mismatch",
            Self::WrongDirection => "wrong direction",
            Self::Duplicate => "duplicate link",
            Self::RelayNotAllowed => "tensor data through a relay is not allowed",
            Self::NoPunch => "no simultaneous open here",
            Self::NotInSwarm => "not known as a member of this private swarm",
        })
    }
}

impl From<RejectReason> for proto::RejectReason {
    fn from(r: RejectReason) -> Self {
        match r {
            RejectReason::UnknownGroup => Self::RejectUnknownGroup,
            RejectReason::NotMember => Self::RejectNotMember,
            RejectReason::IdentityMismatch => Self::RejectIdentityMismatch,
            RejectReason::WrongDirection => Self::RejectWrongDirection,
            RejectReason::Duplicate => Self::RejectDuplicate,
            RejectReason::RelayNotAllowed => Self::RejectRelayNotAllowed,
            RejectReason::NoPunch => Self::RejectNoPunch,
            RejectReason::NotInSwarm => Self::RejectNotInSwarm,
        }
    }
}

impl From<&LinkMessage> for proto::LinkFrame {
    fn from(m: &LinkMessage) -> Self {
        use proto::link_frame::Body;
        let hello = |h: &Hello| proto::Hello {
            group_id: h.group_id.clone(),
            from_index: h.from_index,
            from_peer: Bytes::from(h.from_peer.to_bytes()),
        };
        let body = match m {
            LinkMessage::Hello(h) => Body::Hello(hello(h)),
            LinkMessage::Punch { hello: h, endpoint } => Body::Punch(proto::Punch {
                hello: Some(hello(h)),
                endpoint: endpoint.to_string(),
            }),
            LinkMessage::PunchAnswer(endpoint) => Body::PunchAnswer(proto::PunchAnswer {
                endpoint: endpoint.to_string(),
            }),
            LinkMessage::GiveUp(h) => Body::GiveUp(proto::GiveUp {
                hello: Some(hello(h)),
            }),
            LinkMessage::Census(None) => Body::Census(proto::Census {
                end: true,
                ..Default::default()
            }),
            LinkMessage::Census(Some(s)) => Body::Census(proto::Census {
                unlinked: s.unlinked.iter().take(MAX_CENSUS).copied().collect(),
                member: s.member,
                signature: s.signature.clone(),
                end: false,
            }),
            LinkMessage::Ack => Body::Ack(proto::Ack {}),
            LinkMessage::Reject(r) => {
                let mut cut = r.detail.len().min(MAX_REJECT_DETAIL_BYTES);
                while !r.detail.is_char_boundary(cut) {
                    cut -= 1;
                }
                Body::Reject(proto::Reject {
                    reason: proto::RejectReason::from(r.reason) as i32,
                    detail: r.detail[..cut].to_owned(),
                })
            }
        };
        Self { body: Some(body) }
    }
}

impl TryFrom<proto::LinkFrame> for LinkMessage {
    type Error = WireError;

    fn try_from(f: proto::LinkFrame) -> Result<Self, Self::Error> {
        use proto::link_frame::Body;
        let hello = |h: proto::Hello| -> Result<Hello, WireError> {
            if h.group_id.is_empty() || h.group_id.len() > MAX_GROUP_ID_BYTES {
                return Err(WireError::GroupId(h.group_id.len()));
            }
            let from_peer =
                PeerId::from_bytes(&h.from_peer).map_err(|e| WireError::PeerId(e.to_string()))?;
            Ok(Hello {
                group_id: h.group_id,
                from_index: h.from_index,
                from_peer,
            })
        };
        let endpoint = |e: &str| -> Result<std::net::SocketAddr, WireError> {
            match e.parse::<std::net::SocketAddr>() {
                Ok(a) if a.port() != 0 && !a.ip().is_unspecified() => Ok(a),
                _ => Err(WireError::Endpoint(e.chars().take(64).collect())),
            }
        };
        Ok(match f.body.ok_or(WireError::Missing("body"))? {
            Body::Hello(h) => LinkMessage::Hello(hello(h)?),
            Body::Punch(p) => LinkMessage::Punch {
                hello: hello(p.hello.ok_or(WireError::Missing("hello"))?)?,
                endpoint: endpoint(&p.endpoint)?,
            },
            Body::PunchAnswer(a) => LinkMessage::PunchAnswer(endpoint(&a.endpoint)?),
            Body::GiveUp(g) => {
                LinkMessage::GiveUp(hello(g.hello.ok_or(WireError::Missing("hello"))?)?)
            }
            Body::Census(c) => {
                if c.unlinked.len() > MAX_CENSUS {
                    return Err(WireError::Census(c.unlinked.len()));
                }
                if c.end {
                    if !c.unlinked.is_empty() || c.member != 0 || !c.signature.is_empty() {
                        return Err(WireError::CensusFrame);
                    }
                    LinkMessage::Census(None)
                } else {
                    if c.signature.len() != CENSUS_SIGNATURE_BYTES {
                        return Err(WireError::CensusFrame);
                    }
                    LinkMessage::Census(Some(CensusStatement {
                        member: c.member,
                        unlinked: c.unlinked,
                        signature: c.signature,
                    }))
                }
            }
            Body::Ack(proto::Ack {}) => LinkMessage::Ack,
            Body::Reject(r) => {
                let reason = match proto::RejectReason::try_from(r.reason) {
                    Ok(proto::RejectReason::RejectUnknownGroup) => RejectReason::UnknownGroup,
                    Ok(proto::RejectReason::RejectNotMember) => RejectReason::NotMember,
                    Ok(proto::RejectReason::RejectIdentityMismatch) => {
                        RejectReason::IdentityMismatch
                    }
                    Ok(proto::RejectReason::RejectWrongDirection) => RejectReason::WrongDirection,
                    Ok(proto::RejectReason::RejectDuplicate) => RejectReason::Duplicate,
                    Ok(proto::RejectReason::RejectRelayNotAllowed) => RejectReason::RelayNotAllowed,
                    Ok(proto::RejectReason::RejectNoPunch) => RejectReason::NoPunch,
                    Ok(proto::RejectReason::RejectNotInSwarm) => RejectReason::NotInSwarm,
                    Ok(proto::RejectReason::RejectUnspecified) | Err(_) => {
                        return Err(WireError::UnknownEnum {
                            field: "reject reason",
                            value: r.reason,
                        });
                    }
                };
                LinkMessage::Reject(Reject {
                    reason,
                    detail: r.detail,
                })
            }
        })
    }
}

/// Appends `message`, length-delimited, to `out`.
pub fn encode_link_frame(message: &LinkMessage, out: &mut BytesMut) {
    let msg = proto::LinkFrame::from(message);
    out.reserve(msg.encoded_len() + 10);
    msg.encode_length_delimited(out)
        .expect("BytesMut grows as needed, so encoding cannot run out of space");
}

/// Decodes one link frame body (without length prefix).
pub fn decode_link_frame(body: Bytes) -> Result<LinkMessage, WireError> {
    let msg = proto::LinkFrame::decode(body).map_err(|e| WireError::Decode(e.to_string()))?;
    LinkMessage::try_from(msg)
}

/// Reads exactly one length-delimited link frame from `read`, never a byte more (the bytes
/// after it belong to whoever reads the link next). The length prefix is checked against
/// [`MAX_LINK_FRAME_BYTES`] before the body is read. Callers bound the wait.
pub async fn read_link_frame(
    read: &mut (impl tokio::io::AsyncRead + Unpin),
) -> Result<LinkMessage, LinkReadError> {
    use tokio::io::AsyncReadExt as _;
    let mut len: u64 = 0;
    let mut i = 0;
    loop {
        let byte = read.read_u8().await?;
        len |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            break;
        }
        i += 1;
        if i == 10 {
            return Err(WireError::BadLength.into());
        }
    }
    if len > MAX_LINK_FRAME_BYTES as u64 {
        return Err(WireError::TooLarge {
            len,
            max: MAX_LINK_FRAME_BYTES,
        }
        .into());
    }
    let mut body = vec![0u8; len as usize];
    read.read_exact(&mut body).await?;
    Ok(decode_link_frame(Bytes::from(body))?)
}

/// Why [`read_link_frame`] got no frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkReadError {
    /// The frame is malformed or oversized.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The stream ended or failed before a whole frame arrived.
    #[error("i/o: {0}")]
    Io(String),
}

impl From<std::io::Error> for LinkReadError {
    fn from(e: std::io::Error) -> Self {
        Self::Io(e.to_string())
    }
}

/// Appends `frame`, length-delimited, to `out`.
pub fn encode_frame(frame: &Frame, out: &mut BytesMut) {
    let msg = proto::RoundFrame::from(frame);
    out.reserve(msg.encoded_len() + 10);
    msg.encode_length_delimited(out)
        .expect("BytesMut grows as needed, so encoding cannot run out of space");
}

/// Encodes `frame`, length-delimited, as a small `head` (appended) followed by the payload
/// bytes (returned, not copied): writing `head` and then the payload puts exactly one frame on
/// the stream, without copying the payload into a frame buffer. Empty for aborts.
///
/// The payload field is emitted last, after the fields that follow it in the schema (weight,
/// contributors): protobuf readers accept fields in any order, and prost merges them the same
/// way, so [`decode_frame`] gives back the same [`Frame`] as for [`encode_frame`]'s bytes.
pub fn encode_frame_split(frame: &Frame, head: &mut BytesMut) -> Bytes {
    use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
    let (tensor, payload, outer_tag, outer_rest): (proto::TensorPart, Bytes, u32, Vec<u8>) =
        match &frame.message {
            Message::Part(p) => {
                let rest = proto::Part {
                    tensor: None,
                    weight: p.weight,
                };
                (
                    tensor_part(p.part, p.codec, p.dtype, &Bytes::new()),
                    p.payload.clone(),
                    2,
                    rest.encode_to_vec(),
                )
            }
            Message::Averaged(a) => {
                let rest = proto::AveragedPart {
                    delta: None,
                    contributors: a.contributors.words().to_vec(),
                };
                (
                    tensor_part(a.part, a.codec, a.dtype, &Bytes::new()),
                    a.payload.clone(),
                    3,
                    rest.encode_to_vec(),
                )
            }
            Message::Abort { .. } | Message::Notice { .. } => {
                encode_frame(frame, head);
                return Bytes::new();
            }
        };
    let payload_field = if payload.is_empty() {
        0
    } else {
        key_len(4) + encoded_len_varint(payload.len() as u64) + payload.len()
    };
    let tensor_len = tensor.encoded_len() + payload_field;
    let inner_len =
        outer_rest.len() + key_len(1) + encoded_len_varint(tensor_len as u64) + tensor_len;
    let envelope = proto::RoundFrame {
        group_id: frame.group_id.clone(),
        body: None,
    };
    let frame_len = envelope.encoded_len()
        + key_len(outer_tag)
        + encoded_len_varint(inner_len as u64)
        + inner_len;
    head.reserve(frame_len - payload.len() + 10);
    encode_varint(frame_len as u64, head);
    envelope
        .encode(head)
        .expect("BytesMut grows as needed, so encoding cannot run out of space");
    encode_key(outer_tag, WireType::LengthDelimited, head);
    encode_varint(inner_len as u64, head);
    head.put_slice(&outer_rest);
    encode_key(1, WireType::LengthDelimited, head);
    encode_varint(tensor_len as u64, head);
    tensor
        .encode(head)
        .expect("BytesMut grows as needed, so encoding cannot run out of space");
    if !payload.is_empty() {
        encode_key(4, WireType::LengthDelimited, head);
        encode_varint(payload.len() as u64, head);
    }
    payload
}

/// Decodes one frame body (without length prefix).
pub fn decode_frame(body: Bytes) -> Result<Frame, WireError> {
    let msg = proto::RoundFrame::decode(body).map_err(|e| WireError::Decode(e.to_string()))?;
    Frame::try_from(msg)
}

/// Incremental decoder of length-delimited frames from a byte stream.
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame_bytes: usize,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_FRAME_BYTES)
    }
}

impl FrameDecoder {
    /// A decoder that rejects frames longer than `max_frame_bytes`.
    pub fn new(max_frame_bytes: usize) -> Self {
        Self { max_frame_bytes }
    }

    /// The length prefix at the front of `buf`: `Ok(Some((prefix_len, body_len)))`, or
    /// `Ok(None)` if the prefix itself is still incomplete. Errors for a malformed prefix or a
    /// body over the limit, judged from the prefix alone.
    pub fn peek_len(&self, buf: &[u8]) -> Result<Option<(usize, usize)>, WireError> {
        let mut peek = buf;
        let len = match prost::encoding::decode_varint(&mut peek) {
            Ok(len) => len,
            // A varint is at most 10 bytes; fewer than that may just be incomplete.
            Err(_) if buf.len() < 10 && !buf.iter().take(10).any(|b| b & 0x80 == 0) => {
                return Ok(None);
            }
            Err(_) => return Err(WireError::BadLength),
        };
        if len > self.max_frame_bytes as u64 {
            return Err(WireError::TooLarge {
                len,
                max: self.max_frame_bytes,
            });
        }
        Ok(Some((buf.len() - peek.len(), len as usize)))
    }

    /// Takes one complete frame off the front of `buf`, if there is one. `Ok(None)` means
    /// "need more bytes"; an error means the stream is broken and must be dropped.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Frame>, WireError> {
        let Some((prefix, len)) = self.peek_len(buf)? else {
            return Ok(None);
        };
        if buf.len() < prefix + len {
            // Grow with the bytes that actually arrive, not with what the prefix promises.
            buf.reserve((prefix + len - buf.len()).min(64 << 10));
            return Ok(None);
        }
        buf.advance(prefix);
        let body = buf.split_to(len).freeze();
        decode_frame(body).map(Some)
    }
}

/// Writes a varint length prefix for a frame of `len` bytes (for writers that stream the body).
pub fn put_length_prefix(len: usize, out: &mut impl BufMut) {
    prost::encoding::encode_varint(len as u64, out);
}

/// Why [`read_delimited`] got no message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DelimitedError {
    /// The message is longer than the limit (judged from its length prefix).
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Limit.
        max: usize,
    },
    /// The length prefix is not a valid varint.
    #[error("malformed length prefix")]
    BadLength,
    /// The stream ended inside a message.
    #[error("stream closed mid-message")]
    Truncated,
    /// Bytes followed the message where the protocol allows none (one request, one answer).
    #[error("bytes beyond the message before its answer")]
    Trailing,
    /// Reading the stream failed.
    #[error("i/o: {0}")]
    Io(String),
}

/// Reads one length-delimited message of at most `max` bytes for request/answer protocols
/// (state sharing, RPC): `Ok(None)` if the stream ends cleanly before a message begins. The
/// limit is checked from the length prefix, before anything is buffered, and the buffer grows
/// with the bytes that actually arrive. Nobody writes a second message before reading the
/// answer to the first, so bytes beyond this one are an error ([`DelimitedError::Trailing`]).
pub async fn read_delimited<R: tokio::io::AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
) -> Result<Option<Bytes>, DelimitedError> {
    use tokio::io::AsyncReadExt as _;
    let decoder = FrameDecoder::new(max);
    let mut buf = BytesMut::with_capacity(64);
    let io = |e: std::io::Error| DelimitedError::Io(e.to_string());
    loop {
        let peeked = decoder.peek_len(&buf).map_err(|e| match e {
            WireError::TooLarge { len, max } => DelimitedError::TooLarge { len, max },
            _ => DelimitedError::BadLength,
        })?;
        if let Some((prefix, len)) = peeked {
            while buf.len() < prefix + len {
                buf.reserve((prefix + len - buf.len()).min(256 << 10));
                if r.read_buf(&mut buf).await.map_err(io)? == 0 {
                    return Err(DelimitedError::Truncated);
                }
            }
            if buf.len() > prefix + len {
                return Err(DelimitedError::Trailing);
            }
            return Ok(Some(buf.split_off(prefix).freeze()));
        }
        if r.read_buf(&mut buf).await.map_err(io)? == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(DelimitedError::Truncated)
            };
        }
    }
}

/// Writes one length-delimited message (the counterpart of [`read_delimited`]) and flushes.
pub async fn write_delimited<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    body: &[u8],
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt as _;
    let mut frame = BytesMut::with_capacity(body.len() + 10);
    put_length_prefix(body.len(), &mut frame);
    frame.extend_from_slice(body);
    w.write_all(&frame).await?;
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_frames() -> Vec<Frame> {
        let g = Bytes::from_static(b"group-1");
        vec![
            Frame {
                group_id: g.clone(),
                message: Message::Part(PartMessage {
                    part: 7,
                    weight: 0.5,
                    codec: CompressionType::Uniform8Bit,
                    dtype: DType::F32,
                    payload: Bytes::from(vec![1u8, 2, 3]),
                }),
            },
            Frame {
                group_id: g.clone(),
                message: Message::Averaged(AveragedMessage {
                    part: 0,
                    codec: CompressionType::None,
                    dtype: DType::BF16,
                    contributors: PeerSet::from_indices([0, 3, 70]),
                    payload: Bytes::new(),
                    finite: None,
                }),
            },
            Frame {
                group_id: g.clone(),
                message: Message::Abort {
                    role: Role::Reducer,
                    reason: AbortReason::Banned,
                },
            },
            Frame {
                group_id: g.clone(),
                message: Message::Notice {
                    failed: PeerSet::from_indices([2, 65]),
                },
            },
            Frame {
                group_id: g,
                message: Message::Notice {
                    failed: PeerSet::default(),
                },
            },
        ]
    }

    #[test]
    fn round_trip_through_a_stream() {
        let mut buf = BytesMut::new();
        for f in sample_frames() {
            encode_frame(&f, &mut buf);
        }
        let dec = FrameDecoder::default();
        let mut out = Vec::new();
        // Feed byte by byte: partial input is never an error.
        let all = buf.freeze();
        let mut stream = BytesMut::new();
        for b in all.iter() {
            stream.put_u8(*b);
            while let Some(f) = dec.decode(&mut stream).unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out, sample_frames());
        assert!(stream.is_empty());
    }

    #[test]
    fn split_encoding_decodes_to_the_same_frames() {
        let mut frames = sample_frames();
        frames.push(Frame {
            group_id: Bytes::from(vec![9u8; MAX_GROUP_ID_BYTES]),
            message: Message::Part(PartMessage {
                part: 100_000,
                weight: 0.0,
                codec: CompressionType::None,
                dtype: DType::F16,
                payload: Bytes::from((0..300_000u32).map(|i| i as u8).collect::<Vec<_>>()),
            }),
        });
        let mut stream = BytesMut::new();
        for f in &frames {
            let mut head = BytesMut::new();
            let payload = encode_frame_split(f, &mut head);
            let mut whole = BytesMut::new();
            encode_frame(f, &mut whole);
            assert_eq!(
                head.len() + payload.len(),
                whole.len(),
                "same length as encode_frame"
            );
            stream.extend_from_slice(&head);
            stream.extend_from_slice(&payload);
        }
        let dec = FrameDecoder::default();
        let mut out = Vec::new();
        while let Some(f) = dec.decode(&mut stream).unwrap() {
            out.push(f);
        }
        assert_eq!(out, frames);
        assert!(stream.is_empty());
    }

    #[test]
    fn oversized_frame_rejected_from_its_prefix() {
        let mut buf = BytesMut::new();
        put_length_prefix(4 << 30, &mut buf);
        assert_eq!(
            FrameDecoder::new(1 << 20).decode(&mut buf),
            Err(WireError::TooLarge {
                len: 4 << 30,
                max: 1 << 20
            })
        );
        let mut bad = BytesMut::from(&[0xffu8; 11][..]);
        assert_eq!(
            FrameDecoder::default().decode(&mut bad),
            Err(WireError::BadLength)
        );
    }

    #[test]
    fn invalid_fields_are_typed_errors() {
        let mut f = proto::RoundFrame::from(&sample_frames()[0]);
        f.group_id = Bytes::new();
        assert_eq!(Frame::try_from(f), Err(WireError::GroupId(0)));
        let mut f = proto::RoundFrame::from(&sample_frames()[0]);
        if let Some(proto::round_frame::Body::Part(p)) = f.body.as_mut() {
            p.tensor.as_mut().unwrap().compression = 1;
        }
        assert!(matches!(
            Frame::try_from(f),
            Err(WireError::UnknownEnum {
                field: "compression",
                value: 1
            })
        ));
        let mut f = proto::RoundFrame::from(&sample_frames()[1]);
        if let Some(proto::round_frame::Body::Averaged(a)) = f.body.as_mut() {
            a.contributors = vec![1; MAX_CONTRIBUTOR_WORDS + 1];
        }
        assert!(matches!(
            Frame::try_from(f),
            Err(WireError::Contributors(_))
        ));
        let f = proto::RoundFrame {
            group_id: Bytes::from_static(b"g"),
            body: Some(proto::round_frame::Body::Notice(proto::ChainNotice {
                failed: vec![1; MAX_CONTRIBUTOR_WORDS + 1],
            })),
        };
        assert_eq!(
            Frame::try_from(f),
            Err(WireError::Contributors(MAX_CONTRIBUTOR_WORDS + 1))
        );
        let f = proto::RoundFrame {
            group_id: Bytes::from_static(b"g"),
            body: None,
        };
        assert_eq!(Frame::try_from(f), Err(WireError::Missing("body")));
    }

    fn hello() -> LinkMessage {
        LinkMessage::Hello(Hello {
            group_id: Bytes::from_static(b"group-1"),
            from_index: 3,
            from_peer: PeerId::random(),
        })
    }

    #[tokio::test]
    async fn link_frames_round_trip_and_reads_stop_at_the_frame() {
        let messages = [
            hello(),
            LinkMessage::Ack,
            LinkMessage::Reject(Reject {
                reason: RejectReason::Duplicate,
                detail: "x".into(),
            }),
            LinkMessage::Census(Some(CensusStatement {
                member: 2,
                unlinked: vec![0, 3, 7],
                signature: Bytes::from(vec![9; CENSUS_SIGNATURE_BYTES]),
            })),
            LinkMessage::Census(Some(CensusStatement {
                member: 0,
                unlinked: Vec::new(),
                signature: Bytes::from(vec![1; CENSUS_SIGNATURE_BYTES]),
            })),
            LinkMessage::Census(None),
        ];
        let mut buf = BytesMut::new();
        for m in &messages {
            encode_link_frame(m, &mut buf);
        }
        buf.extend_from_slice(b"rest");
        let mut read = &buf[..];
        for m in &messages {
            assert_eq!(&read_link_frame(&mut read).await.unwrap(), m);
        }
        assert_eq!(read, b"rest");
        // A long detail is cut at a character boundary.
        let long = LinkMessage::Reject(Reject {
            reason: RejectReason::NotMember,
            detail: "é".repeat(MAX_REJECT_DETAIL_BYTES),
        });
        let mut buf = BytesMut::new();
        encode_link_frame(&long, &mut buf);
        let LinkMessage::Reject(r) = read_link_frame(&mut &buf[..]).await.unwrap() else {
            panic!("not a reject")
        };
        assert_eq!(r.detail.len(), MAX_REJECT_DETAIL_BYTES);
    }

    #[tokio::test]
    async fn bad_link_frames_are_typed_errors() {
        let mut huge = BytesMut::new();
        put_length_prefix(4 << 30, &mut huge);
        assert_eq!(
            read_link_frame(&mut &huge[..]).await,
            Err(LinkReadError::Wire(WireError::TooLarge {
                len: 4 << 30,
                max: MAX_LINK_FRAME_BYTES
            }))
        );
        assert_eq!(
            read_link_frame(&mut &[0xffu8; 10][..]).await,
            Err(LinkReadError::Wire(WireError::BadLength))
        );
        assert!(matches!(
            read_link_frame(&mut &[5u8, 1, 2][..]).await,
            Err(LinkReadError::Io(_))
        ));
        // A round frame is not a link frame.
        let mut round = BytesMut::new();
        encode_frame(&sample_frames()[2], &mut round);
        assert!(matches!(
            read_link_frame(&mut &round[..]).await,
            Err(LinkReadError::Wire(_))
        ));
        let bad_peer = proto::LinkFrame {
            body: Some(proto::link_frame::Body::Hello(proto::Hello {
                group_id: Bytes::from_static(b"g"),
                from_index: 0,
                from_peer: Bytes::from_static(b"not a peer id"),
            })),
        };
        assert!(matches!(
            LinkMessage::try_from(bad_peer),
            Err(WireError::PeerId(_))
        ));
        // A census naming more members than allowed (it fits the frame), a give-up without its
        // Hello.
        let census = |c: proto::Census| {
            LinkMessage::try_from(proto::LinkFrame {
                body: Some(proto::link_frame::Body::Census(c)),
            })
        };
        let signature = Bytes::from(vec![1; CENSUS_SIGNATURE_BYTES]);
        assert_eq!(
            census(proto::Census {
                unlinked: vec![1; MAX_CENSUS + 1],
                signature: signature.clone(),
                ..Default::default()
            }),
            Err(WireError::Census(MAX_CENSUS + 1))
        );
        // The largest statement fits a link frame.
        let largest = proto::LinkFrame {
            body: Some(proto::link_frame::Body::Census(proto::Census {
                unlinked: vec![u32::MAX; MAX_CENSUS],
                member: u32::MAX,
                signature: signature.clone(),
                end: false,
            })),
        };
        assert!(largest.encoded_len() <= MAX_LINK_FRAME_BYTES);
        // A signature of another length; an end that carries a statement's fields.
        for c in [
            proto::Census {
                signature: Bytes::from(vec![1; CENSUS_SIGNATURE_BYTES - 1]),
                ..Default::default()
            },
            proto::Census::default(),
            proto::Census {
                end: true,
                member: 1,
                ..Default::default()
            },
            proto::Census {
                end: true,
                signature,
                ..Default::default()
            },
            proto::Census {
                end: true,
                unlinked: vec![0],
                ..Default::default()
            },
        ] {
            assert_eq!(census(c), Err(WireError::CensusFrame));
        }
        let give_up = proto::LinkFrame {
            body: Some(proto::link_frame::Body::GiveUp(proto::GiveUp {
                hello: None,
            })),
        };
        assert_eq!(
            LinkMessage::try_from(give_up),
            Err(WireError::Missing("hello"))
        );
        let no_reason = proto::LinkFrame {
            body: Some(proto::link_frame::Body::Reject(proto::Reject {
                reason: 0,
                detail: String::new(),
            })),
        };
        assert!(matches!(
            LinkMessage::try_from(no_reason),
            Err(WireError::UnknownEnum { .. })
        ));
        let empty_group = proto::LinkFrame::from(&hello());
        let mut empty_group = empty_group;
        if let Some(proto::link_frame::Body::Hello(h)) = empty_group.body.as_mut() {
            h.group_id = Bytes::new();
        }
        assert_eq!(
            LinkMessage::try_from(empty_group),
            Err(WireError::GroupId(0))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = BytesMut::from(&data[..]);
            let dec = FrameDecoder::new(1 << 16);
            for _ in 0..8 {
                match dec.decode(&mut buf) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
            let _ = decode_frame(Bytes::from(data.clone()));
            let _ = decode_link_frame(Bytes::from(data));
        }
    }
}
