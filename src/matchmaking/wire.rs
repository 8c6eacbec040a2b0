//! Wire encoding of matchmaking [`Message`]s: prost types from
//! `proto/hivemesh/matchmaking.proto`, translated at this boundary ("parse, don't validate").
//!
//! [`decode`] checks the length before decoding and every field after: peer ids, schema hash,
//! group key and id, addresses and gathered bytes within their limits, a finite expiration, a
//! finite non-negative bandwidth, known enum values, the fields each reply code needs. Anything
//! else is a typed [`WireError`]; nothing panics on arbitrary bytes. The shell frames messages
//! itself (e.g. length-delimited on a libp2p stream, with [`MAX_MESSAGE_BYTES`] as the limit).

use bytes::Bytes;
use prost::Message as _;

use super::{
    Begin, DhtTime, GroupKey, GroupMember, JoinRequest, MAX_ADDR_BYTES, MAX_ADDRS,
    MAX_GATHERED_BYTES, MAX_GROUP_SIZE, MAX_SCHEMA_HASH_BYTES, MemberInfo, Message, Mode, PeerId,
    RejectReason, Reply, ReplyBody,
};
use crate::proto_guard::{self, Field, Kind};
use crate::reach::{MAX_UNLINKABLE, Reach};
use crate::wire::MAX_GROUP_ID_BYTES;

/// Generated prost types (do not use outside this boundary).
#[allow(missing_docs, clippy::all)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/hivemesh.matchmaking.v1.rs"));
}

/// Largest accepted encoded message: 4 MiB (a `Begin` at every limit is under 2.7 MiB).
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// A malformed, oversized or out-of-limits message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The encoded message is longer than [`MAX_MESSAGE_BYTES`].
    #[error("message of {0} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")]
    TooLarge(usize),
    /// Not a valid protobuf message.
    #[error("undecodable message: {0}")]
    Decode(String),
    /// A required field is missing.
    #[error("message lacks {0}")]
    Missing(&'static str),
    /// An enum value we do not know.
    #[error("unknown {field} value {value}")]
    UnknownEnum {
        /// Field name.
        field: &'static str,
        /// Value received.
        value: i32,
    },
    /// A field outside its limits.
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

fn mode_to_wire(m: Mode) -> proto::Mode {
    match m {
        Mode::Node => proto::Mode::Node,
        Mode::Client => proto::Mode::Client,
        Mode::Aux => proto::Mode::Aux,
    }
}

fn member_data(info: &MemberInfo) -> proto::MemberData {
    proto::MemberData {
        mode: mode_to_wire(info.mode) as i32,
        bandwidth: info.bandwidth,
        addrs: info.addrs.clone(),
        gathered: info.gathered.clone(),
        reach: match info.reach {
            Reach::Public => proto::Reach::Public,
            Reach::Punchable => proto::Reach::Punchable,
            Reach::Private => proto::Reach::Private,
        } as i32,
        relay_data: info.relay_data,
        unlinkable: info
            .unlinkable
            .iter()
            .map(|p| Bytes::copy_from_slice(p.as_bytes()))
            .collect(),
        measured_up: info.measured.map(|r| r.up),
        measured_down: info.measured.map(|r| r.down),
        stand_ins: info.stand_ins,
    }
}

fn parse_member_data(d: Option<proto::MemberData>) -> Result<MemberInfo, WireError> {
    let d = d.ok_or(WireError::Missing("member data"))?;
    let mode = match proto::Mode::try_from(d.mode) {
        Ok(proto::Mode::Node) => Mode::Node,
        Ok(proto::Mode::Client) => Mode::Client,
        Ok(proto::Mode::Aux) => Mode::Aux,
        Err(_) => {
            return Err(WireError::UnknownEnum {
                field: "mode",
                value: d.mode,
            });
        }
    };
    if let Some(b) = d.bandwidth
        && !(b.is_finite() && b >= 0.0)
    {
        return Err(invalid("bandwidth", format!("{b}")));
    }
    let measured = match (d.measured_up, d.measured_down) {
        (None, None) => None,
        (Some(up), Some(down)) => {
            if let Some(b) = [up, down]
                .into_iter()
                .find(|b| !(b.is_finite() && *b > 0.0))
            {
                return Err(invalid("measured", format!("{b}")));
            }
            Some(crate::allreduce::LinkRates { up, down })
        }
        _ => return Err(invalid("measured", "only one direction")),
    };
    let reach = match proto::Reach::try_from(d.reach) {
        Ok(proto::Reach::Public) => Reach::Public,
        Ok(proto::Reach::Punchable) => Reach::Punchable,
        Ok(proto::Reach::Private) => Reach::Private,
        Err(_) => {
            return Err(WireError::UnknownEnum {
                field: "reach",
                value: d.reach,
            });
        }
    };
    if d.addrs.len() > MAX_ADDRS {
        return Err(invalid("addrs", format!("{} addresses", d.addrs.len())));
    }
    if let Some(a) = d.addrs.iter().find(|a| a.len() > MAX_ADDR_BYTES) {
        return Err(invalid("addrs", format!("address of {} bytes", a.len())));
    }
    if d.gathered.len() > MAX_GATHERED_BYTES {
        return Err(invalid("gathered", format!("{} bytes", d.gathered.len())));
    }
    if d.unlinkable.len() > MAX_UNLINKABLE {
        return Err(invalid(
            "unlinkable",
            format!("{} peers", d.unlinkable.len()),
        ));
    }
    let unlinkable = d
        .unlinkable
        .into_iter()
        .map(|p| parse_peer("unlinkable", p))
        .collect::<Result<_, _>>()?;
    Ok(MemberInfo {
        mode,
        bandwidth: d.bandwidth,
        addrs: d.addrs,
        gathered: d.gathered,
        reach,
        relay_data: d.relay_data,
        unlinkable,
        measured,
        stand_ins: d.stand_ins,
    })
}

fn parse_peer(field: &'static str, bytes: Bytes) -> Result<PeerId, WireError> {
    let len = bytes.len();
    PeerId::from_bytes(bytes).ok_or_else(|| invalid(field, format!("peer id of {len} bytes")))
}

fn optional_peer(bytes: Bytes) -> Result<Option<PeerId>, WireError> {
    if bytes.is_empty() {
        Ok(None)
    } else {
        parse_peer("suggested leader", bytes).map(Some)
    }
}

fn reject_code(r: &RejectReason) -> proto::MessageCode {
    use proto::MessageCode as C;
    match r {
        RejectReason::NotLookingForGroup => C::NotLookingForGroup,
        RejectReason::ProtocolViolation => C::ProtocolViolation,
        RejectReason::BadSchemaHash => C::BadSchemaHash,
        RejectReason::BadGroupKey => C::BadGroupKey,
        RejectReason::NotDeclared => C::NotDeclared,
        RejectReason::BadExpirationTime => C::BadExpirationTime,
        RejectReason::NotALeader { .. } => C::NotALeader,
        RejectReason::DuplicatePeerId => C::DuplicatePeerId,
        RejectReason::GroupIsFull => C::GroupIsFull,
        RejectReason::Internal => C::InternalError,
    }
}

impl From<&Message> for proto::MatchmakingFrame {
    fn from(m: &Message) -> Self {
        use proto::matchmaking_frame::Body;
        let body = match m {
            Message::Join(j) => Body::JoinRequest(proto::JoinRequest {
                request_id: j.request_id,
                schema_hash: j.schema_hash.clone(),
                expiration: j.expiration.as_secs(),
                group_key: j.group_key.as_str().to_owned(),
                member: Some(member_data(&j.info)),
            }),
            Message::Reply(r) => {
                let mut msg = proto::MessageFromLeader {
                    request_id: r.request_id,
                    ..Default::default()
                };
                let code = match &r.body {
                    ReplyBody::Accepted => proto::MessageCode::Accepted,
                    ReplyBody::Begin(b) => {
                        msg.group_id = b.group_id.clone();
                        msg.members = b
                            .members
                            .iter()
                            .map(|m| proto::Member {
                                peer_id: m.peer.to_bytes(),
                                data: Some(member_data(&m.info)),
                            })
                            .collect();
                        proto::MessageCode::BeginAllreduce
                    }
                    ReplyBody::Rejected(reason) => {
                        if let RejectReason::NotALeader {
                            suggested_leader: Some(s),
                        } = reason
                        {
                            msg.suggested_leader = s.to_bytes();
                        }
                        reject_code(reason)
                    }
                    ReplyBody::Disbanded { suggested_leader } => {
                        if let Some(s) = suggested_leader {
                            msg.suggested_leader = s.to_bytes();
                        }
                        proto::MessageCode::GroupDisbanded
                    }
                };
                msg.code = code as i32;
                Body::FromLeader(msg)
            }
            Message::Leave { request_id } => Body::Leave(proto::Leave {
                request_id: *request_id,
            }),
        };
        Self { body: Some(body) }
    }
}

fn parse_reply(m: proto::MessageFromLeader) -> Result<Reply, WireError> {
    use proto::MessageCode as C;
    let code = C::try_from(m.code).map_err(|_| WireError::UnknownEnum {
        field: "code",
        value: m.code,
    })?;
    let body = match code {
        C::Accepted => ReplyBody::Accepted,
        C::BeginAllreduce => {
            if m.group_id.is_empty() || m.group_id.len() > MAX_GROUP_ID_BYTES {
                return Err(invalid(
                    "group id",
                    format!(
                        "{} bytes (must be 1..={MAX_GROUP_ID_BYTES})",
                        m.group_id.len()
                    ),
                ));
            }
            if m.members.is_empty() || m.members.len() > MAX_GROUP_SIZE {
                return Err(invalid(
                    "members",
                    format!("{} members (must be 1..={MAX_GROUP_SIZE})", m.members.len()),
                ));
            }
            let members = m
                .members
                .into_iter()
                .map(|mem| {
                    Ok(GroupMember {
                        peer: parse_peer("member peer id", mem.peer_id)?,
                        info: parse_member_data(mem.data)?,
                    })
                })
                .collect::<Result<Vec<_>, WireError>>()?;
            // A peer named twice would hold two places in the group: every member's plan
            // (one link per peer) fails on it.
            let mut seen = std::collections::HashSet::with_capacity(members.len());
            if let Some(twice) = members.iter().find(|m| !seen.insert(&m.peer)) {
                return Err(invalid(
                    "members",
                    format!("peer {:?} is named twice", twice.peer),
                ));
            }
            ReplyBody::Begin(Begin {
                group_id: m.group_id,
                members,
            })
        }
        C::GroupDisbanded => ReplyBody::Disbanded {
            suggested_leader: optional_peer(m.suggested_leader)?,
        },
        C::NotALeader => ReplyBody::Rejected(RejectReason::NotALeader {
            suggested_leader: optional_peer(m.suggested_leader)?,
        }),
        C::NotLookingForGroup => ReplyBody::Rejected(RejectReason::NotLookingForGroup),
        C::ProtocolViolation => ReplyBody::Rejected(RejectReason::ProtocolViolation),
        C::BadSchemaHash => ReplyBody::Rejected(RejectReason::BadSchemaHash),
        C::BadGroupKey => ReplyBody::Rejected(RejectReason::BadGroupKey),
        C::NotDeclared => ReplyBody::Rejected(RejectReason::NotDeclared),
        C::BadExpirationTime => ReplyBody::Rejected(RejectReason::BadExpirationTime),
        C::DuplicatePeerId => ReplyBody::Rejected(RejectReason::DuplicatePeerId),
        C::GroupIsFull => ReplyBody::Rejected(RejectReason::GroupIsFull),
        C::InternalError => ReplyBody::Rejected(RejectReason::Internal),
        C::NoCode => return Err(WireError::Missing("code")),
    };
    Ok(Reply {
        request_id: m.request_id,
        body,
    })
}

impl TryFrom<proto::MatchmakingFrame> for Message {
    type Error = WireError;

    fn try_from(f: proto::MatchmakingFrame) -> Result<Self, Self::Error> {
        use proto::matchmaking_frame::Body;
        Ok(match f.body.ok_or(WireError::Missing("body"))? {
            Body::JoinRequest(j) => {
                if j.schema_hash.len() > MAX_SCHEMA_HASH_BYTES {
                    return Err(invalid(
                        "schema hash",
                        format!("{} bytes", j.schema_hash.len()),
                    ));
                }
                let expiration = DhtTime::from_secs(j.expiration)
                    .ok_or_else(|| invalid("expiration", format!("{}", j.expiration)))?;
                let group_key = GroupKey::parse(&j.group_key)
                    .map_err(|e| invalid("group key", e.to_string()))?;
                Message::Join(JoinRequest {
                    request_id: j.request_id,
                    schema_hash: j.schema_hash,
                    expiration,
                    group_key,
                    info: parse_member_data(j.member)?,
                })
            }
            Body::FromLeader(m) => Message::Reply(parse_reply(m)?),
            Body::Leave(l) => Message::Leave {
                request_id: l.request_id,
            },
        })
    }
}

/// Encodes `message` (without a length prefix).
pub fn encode(message: &Message) -> Vec<u8> {
    proto::MatchmakingFrame::from(message).encode_to_vec()
}

/// What a frame may hold, counted before decoding (`crate::proto_guard`): one body; a reply
/// with at most [`MAX_GROUP_SIZE`] members, each with one `MemberData`; at most
/// [`MAX_ADDRS`] addresses and [`MAX_UNLINKABLE`] unlinkable peers per member, summed over
/// the frame.
const FRAME_SHAPE: [Field<'static>; 3] = {
    const MEMBER_DATA: [Field<'static>; 2] = [
        Field {
            number: 3,
            max: MAX_GROUP_SIZE * MAX_ADDRS,
            slot: 1,
            kind: Kind::Opaque,
        },
        Field {
            number: 7,
            max: MAX_GROUP_SIZE * MAX_UNLINKABLE,
            slot: 5,
            kind: Kind::Opaque,
        },
    ];
    const MEMBER: [Field<'static>; 1] = [Field {
        number: 2,
        max: MAX_GROUP_SIZE,
        slot: 2,
        kind: Kind::Message(&MEMBER_DATA),
    }];
    const JOIN: [Field<'static>; 1] = [Field {
        number: 5,
        max: 1,
        slot: 3,
        kind: Kind::Message(&MEMBER_DATA),
    }];
    const LEADER: [Field<'static>; 1] = [Field {
        number: 5,
        max: MAX_GROUP_SIZE,
        slot: 4,
        kind: Kind::Message(&MEMBER),
    }];
    [
        Field {
            number: 1,
            max: 1,
            slot: 0,
            kind: Kind::Message(&JOIN),
        },
        Field {
            number: 2,
            max: 1,
            slot: 0,
            kind: Kind::Message(&LEADER),
        },
        Field {
            number: 3,
            max: 1,
            slot: 0,
            kind: Kind::Opaque,
        },
    ]
};

/// Decodes one message body (without a length prefix), checking its size first and its
/// counts of members and addresses before anything is built.
pub fn decode(body: &[u8]) -> Result<Message, WireError> {
    if body.len() > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLarge(body.len()));
    }
    proto_guard::check(body, &FRAME_SHAPE).map_err(|e| WireError::Decode(e.to_string()))?;
    let frame = proto::MatchmakingFrame::decode(Bytes::copy_from_slice(body))
        .map_err(|e| WireError::Decode(e.to_string()))?;
    Message::try_from(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn peer(s: &str) -> PeerId {
        PeerId::from_bytes(s.as_bytes().to_vec()).unwrap()
    }

    fn info() -> MemberInfo {
        MemberInfo {
            mode: Mode::Aux,
            bandwidth: Some(12.5),
            addrs: vec!["/ip4/127.0.0.1/tcp/4001".into()],
            gathered: Bytes::from_static(b"user bytes"),
            reach: crate::reach::Reach::Punchable,
            relay_data: true,
            unlinkable: vec![peer("cannot-link")],
            measured: Some(crate::allreduce::LinkRates {
                up: 2.5e6,
                down: 12.5e6,
            }),
            stand_ins: true,
        }
    }

    fn samples() -> Vec<Message> {
        let mut out = vec![
            Message::Join(JoinRequest {
                request_id: 7,
                schema_hash: Bytes::from_static(&[9; 20]),
                expiration: DhtTime::from_secs(1.7e9 + 0.25).unwrap(),
                group_key: GroupKey::parse("mygroup.0b0110").unwrap(),
                info: info(),
            }),
            Message::Leave { request_id: 3 },
            Message::Reply(Reply {
                request_id: 1,
                body: ReplyBody::Accepted,
            }),
            Message::Reply(Reply {
                request_id: 2,
                body: ReplyBody::Begin(Begin {
                    group_id: Bytes::from_static(&[1; 20]),
                    members: vec![
                        GroupMember {
                            peer: peer("a"),
                            info: info(),
                        },
                        GroupMember {
                            peer: peer("b"),
                            info: MemberInfo::new(Mode::Client),
                        },
                    ],
                }),
            }),
            Message::Reply(Reply {
                request_id: 4,
                body: ReplyBody::Disbanded {
                    suggested_leader: Some(peer("c")),
                },
            }),
            Message::Reply(Reply {
                request_id: 5,
                body: ReplyBody::Disbanded {
                    suggested_leader: None,
                },
            }),
        ];
        for reason in [
            RejectReason::NotLookingForGroup,
            RejectReason::ProtocolViolation,
            RejectReason::BadSchemaHash,
            RejectReason::BadGroupKey,
            RejectReason::NotDeclared,
            RejectReason::BadExpirationTime,
            RejectReason::NotALeader {
                suggested_leader: Some(peer("d")),
            },
            RejectReason::NotALeader {
                suggested_leader: None,
            },
            RejectReason::DuplicatePeerId,
            RejectReason::GroupIsFull,
            RejectReason::Internal,
        ] {
            out.push(Message::Reply(Reply {
                request_id: 6,
                body: ReplyBody::Rejected(reason),
            }));
        }
        out
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            assert_eq!(decode(&encode(&m)).unwrap(), m);
        }
    }

    /// Issue 29, attack 2: a membership naming one peer twice (two concurrent join requests
    /// of one peer, or a member asking to join its own group) is refused when decoded.
    #[test]
    fn a_membership_naming_a_peer_twice_is_refused() {
        let Message::Reply(Reply {
            body: ReplyBody::Begin(mut begin),
            ..
        }) = samples()[3].clone()
        else {
            panic!("sample 3 is a Begin");
        };
        begin.members[1].peer = peer("a");
        let twice = Message::Reply(Reply {
            request_id: 2,
            body: ReplyBody::Begin(begin),
        });
        assert!(matches!(
            decode(&encode(&twice)),
            Err(WireError::Invalid {
                field: "members",
                ..
            })
        ));
    }

    /// A declaration from a peer that predates measured rates (fields 8 and 9 absent)
    /// decodes, with the rates unknown; one with them round-trips them.
    #[test]
    fn measured_rates_are_optional_on_the_wire() {
        let mut frame = proto::MatchmakingFrame::from(&samples()[0]);
        let Some(proto::matchmaking_frame::Body::JoinRequest(j)) = frame.body.as_mut() else {
            panic!("sample 0 is a join request");
        };
        let member = j.member.as_mut().unwrap();
        assert_eq!(member.measured_up, Some(2.5e6));
        member.measured_up = None;
        member.measured_down = None;
        let Ok(Message::Join(old)) = Message::try_from(frame) else {
            panic!("an old declaration decodes");
        };
        assert_eq!(old.info.measured, None);
        let Ok(Message::Join(new)) = decode(&encode(&samples()[0])) else {
            panic!("round trip");
        };
        assert_eq!(new.info.measured, info().measured);
    }

    /// A declaration from a peer that predates stand-ins (field 10 absent) decodes as not
    /// understanding them, which turns them off for its group; a member that declares them
    /// round-trips the flag, and this version declares it.
    #[test]
    fn stand_ins_are_off_for_an_older_peer() {
        let mut frame = proto::MatchmakingFrame::from(&samples()[0]);
        let Some(proto::matchmaking_frame::Body::JoinRequest(j)) = frame.body.as_mut() else {
            panic!("sample 0 is a join request");
        };
        let member = j.member.as_mut().unwrap();
        assert!(member.stand_ins);
        member.stand_ins = false; // proto3: absent and false are the same bytes
        let Ok(Message::Join(old)) = Message::try_from(frame) else {
            panic!("an old declaration decodes");
        };
        assert!(!old.info.stand_ins);
        let Ok(Message::Join(new)) = decode(&encode(&samples()[0])) else {
            panic!("round trip");
        };
        assert!(new.info.stand_ins);
        // Declared by this version (see `MemberInfo::stand_ins`).
        assert!(MemberInfo::new(Mode::Node).stand_ins);
    }

    #[test]
    fn hostile_fields_are_typed_errors() {
        let join = |f: &dyn Fn(&mut proto::JoinRequest)| {
            let mut frame = proto::MatchmakingFrame::from(&samples()[0]);
            if let Some(proto::matchmaking_frame::Body::JoinRequest(j)) = frame.body.as_mut() {
                f(j);
            }
            Message::try_from(frame)
        };
        assert!(matches!(
            join(&|j| j.expiration = f64::NAN),
            Err(WireError::Invalid {
                field: "expiration",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.group_key = "a.b.0b1".into()),
            Err(WireError::Invalid {
                field: "group key",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.schema_hash = Bytes::from(vec![0; MAX_SCHEMA_HASH_BYTES + 1])),
            Err(WireError::Invalid {
                field: "schema hash",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().bandwidth = Some(-1.0)),
            Err(WireError::Invalid {
                field: "bandwidth",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().bandwidth = Some(f64::INFINITY)),
            Err(WireError::Invalid {
                field: "bandwidth",
                ..
            })
        ));
        for (up, down) in [
            (Some(-1.0), Some(1.0)),
            (Some(1.0), Some(f64::NAN)),
            (Some(0.0), Some(1.0)),
            (Some(1.0), None),
        ] {
            assert!(matches!(
                join(&|j| {
                    let m = j.member.as_mut().unwrap();
                    m.measured_up = up;
                    m.measured_down = down;
                }),
                Err(WireError::Invalid {
                    field: "measured",
                    ..
                })
            ));
        }
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().mode = 7),
            Err(WireError::UnknownEnum {
                field: "mode",
                value: 7
            })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().addrs = vec!["x".into(); MAX_ADDRS + 1]),
            Err(WireError::Invalid { field: "addrs", .. })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().addrs = vec!["x".repeat(MAX_ADDR_BYTES + 1)]),
            Err(WireError::Invalid { field: "addrs", .. })
        ));
        // A member naming more peers it cannot link to than allowed, or a malformed one.
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().unlinkable =
                vec![Bytes::from_static(b"p"); MAX_UNLINKABLE + 1]),
            Err(WireError::Invalid {
                field: "unlinkable",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().unlinkable = vec![Bytes::new()]),
            Err(WireError::Invalid {
                field: "unlinkable",
                ..
            })
        ));
        assert!(matches!(
            join(&|j| j.member.as_mut().unwrap().gathered =
                Bytes::from(vec![0; MAX_GATHERED_BYTES + 1])),
            Err(WireError::Invalid {
                field: "gathered",
                ..
            })
        ));
        assert_eq!(
            join(&|j| j.member = None),
            Err(WireError::Missing("member data"))
        );

        let reply = |f: &dyn Fn(&mut proto::MessageFromLeader)| {
            let mut frame = proto::MatchmakingFrame::from(&samples()[3]);
            if let Some(proto::matchmaking_frame::Body::FromLeader(m)) = frame.body.as_mut() {
                f(m);
            }
            Message::try_from(frame)
        };
        for code in [0, 1, 4, 5, 10, 16, 99, -1] {
            assert!(reply(&|m| m.code = code).is_err(), "code {code}");
        }
        assert!(matches!(
            reply(&|m| m.group_id = Bytes::new()),
            Err(WireError::Invalid {
                field: "group id",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| m.group_id = Bytes::from(vec![1; MAX_GROUP_ID_BYTES + 1])),
            Err(WireError::Invalid {
                field: "group id",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| m.members.clear()),
            Err(WireError::Invalid {
                field: "members",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| {
                let one = m.members[0].clone();
                m.members = vec![one; MAX_GROUP_SIZE + 1];
            }),
            Err(WireError::Invalid {
                field: "members",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| m.members[0].peer_id = Bytes::new()),
            Err(WireError::Invalid {
                field: "member peer id",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| m.members[1].peer_id = Bytes::from(vec![1; 200])),
            Err(WireError::Invalid {
                field: "member peer id",
                ..
            })
        ));
        assert!(matches!(
            reply(&|m| {
                m.code = proto::MessageCode::GroupDisbanded as i32;
                m.suggested_leader = Bytes::from(vec![1; 200]);
            }),
            Err(WireError::Invalid {
                field: "suggested leader",
                ..
            })
        ));
        assert_eq!(
            Message::try_from(proto::MatchmakingFrame { body: None }),
            Err(WireError::Missing("body"))
        );
        assert_eq!(
            decode(&vec![0u8; MAX_MESSAGE_BYTES + 1]),
            Err(WireError::TooLarge(MAX_MESSAGE_BYTES + 1))
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..1024)) {
            let _ = decode(&data);
        }

        #[test]
        fn mutated_messages_never_panic(
            which in 0usize..17,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        ) {
            let mut bytes = encode(&samples()[which % samples().len()]);
            for (pos, val) in flips {
                if !bytes.is_empty() {
                    let i = pos % bytes.len();
                    bytes[i] = val;
                }
            }
            if let Ok(m) = decode(&bytes) {
                // Whatever decodes re-encodes to something that decodes to the same message.
                prop_assert_eq!(decode(&encode(&m)).unwrap(), m);
            }
        }
    }
}
