//! Hand-driven tests of one or two [`Matchmaker`]s: every leader-side check, deferral, the
//! follower's waits, assembly and failure.

use std::time::Duration;

use bytes::Bytes;
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::dht::{DhtValue, merge_all};

const SCHEMA: &[u8] = &[7; 20];

fn t(s: f64) -> DhtTime {
    DhtTime::from_secs(1.7e9 + s).unwrap()
}

fn pid(s: &str) -> PeerId {
    PeerId::from_bytes(s.as_bytes().to_vec()).unwrap()
}

fn key() -> GroupKey {
    GroupKey::parse("p.0b01").unwrap()
}

fn cfg(target: Option<usize>) -> Config {
    let mut c = Config::new(Bytes::from_static(SCHEMA));
    c.target_group_size = target;
    c.min_matchmaking_time = Duration::from_secs(2);
    c.request_timeout = Duration::from_millis(500);
    c.dht_refresh_interval = Duration::from_millis(200);
    c
}

fn machine(
    me: &str,
    mode: Mode,
    config: Config,
    now: DhtTime,
    deadline: Option<f64>,
) -> Matchmaker {
    let mut step = Step::new(key(), MemberInfo::new(mode));
    step.deadline = deadline.map(t);
    Matchmaker::new(pid(me), config, step, now, &mut StdRng::seed_from_u64(1)).unwrap()
}

#[derive(Debug, Default)]
struct Out {
    tx: Vec<Transmit>,
    dht: Vec<DhtRequest>,
    events: Vec<Event>,
}

fn drain(m: &mut Matchmaker) -> Out {
    let mut o = Out::default();
    while let Some(x) = m.poll_transmit() {
        o.tx.push(x);
    }
    while let Some(x) = m.poll_dht() {
        o.dht.push(x);
    }
    while let Some(x) = m.poll_event() {
        o.events.push(x);
    }
    o
}

fn replies(o: &Out) -> Vec<(PeerId, u64, ReplyBody)> {
    o.tx.iter()
        .filter_map(|x| match &x.message {
            Message::Reply(r) => Some((x.to.clone(), r.request_id, r.body.clone())),
            _ => None,
        })
        .collect()
}

fn joins(o: &Out) -> Vec<(PeerId, JoinRequest)> {
    o.tx.iter()
        .filter_map(|x| match &x.message {
            Message::Join(j) => Some((x.to.clone(), j.clone())),
            _ => None,
        })
        .collect()
}

fn gets(o: &Out) -> Vec<u64> {
    o.dht
        .iter()
        .filter_map(|d| match d {
            DhtRequest::Get { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

fn request(id: u64, expiration: DhtTime) -> JoinRequest {
    JoinRequest {
        request_id: id,
        schema_hash: Bytes::from_static(SCHEMA),
        expiration,
        group_key: key(),
        info: MemberInfo::new(Mode::Node),
    }
}

fn join(m: &mut Matchmaker, now: DhtTime, from: &str, req: JoinRequest) -> Out {
    m.handle_message(now, pid(from), Message::Join(req));
    drain(m)
}

fn reply(m: &mut Matchmaker, now: DhtTime, from: &str, request_id: u64, body: ReplyBody) -> Out {
    m.handle_message(now, pid(from), Message::Reply(Reply { request_id, body }));
    drain(m)
}

/// A DHT value declaring `peers`.
fn declared(peers: &[(&str, DhtTime)]) -> DhtValue {
    merge_all(
        peers
            .iter()
            .map(|(p, e)| DhtValue::subkey(declaration_subkey(&pid(p)), DECLARED_VALUE, *e)),
    )
    .unwrap()
}

fn rejected(o: &Out) -> RejectReason {
    match replies(o).as_slice() {
        [(_, _, ReplyBody::Rejected(r))] => r.clone(),
        other => panic!("expected one rejection, got {other:?}"),
    }
}

#[test]
fn declares_reads_and_leaves() {
    let mut m = machine("m", Mode::Node, cfg(None), t(0.0), None);
    let o = drain(&mut m);
    assert_eq!(
        o.dht,
        vec![
            DhtRequest::Store {
                key: key(),
                subkey: declaration_subkey(&pid("m")),
                value: Bytes::from_static(DECLARED_VALUE),
                expiration: t(2.0),
            },
            DhtRequest::Get { id: 0, key: key() },
        ]
    );
    assert_eq!(m.declared_expiration(), Some(t(2.0)));
    // The read is outstanding: the next wake-up is its timeout.
    assert_eq!(m.poll_timeout(), Some(t(0.5)));
    m.handle_dht_get(t(0.1), 0, None);
    assert_eq!(m.poll_timeout(), Some(t(0.2)), "next refresh");
    m.cancel(t(0.3));
    let o = drain(&mut m);
    assert_eq!(
        o.dht,
        vec![DhtRequest::Store {
            key: key(),
            subkey: declaration_subkey(&pid("m")),
            value: Bytes::from_static(LEFT_VALUE),
            expiration: t(2.0).next_up(),
        }]
    );
    assert_eq!(o.events, vec![Event::Failed(MatchmakingError::Cancelled)]);
    assert!(m.is_finished());
    assert_eq!(m.poll_timeout(), None);
}

#[test]
fn leader_checks_in_hivemind_order() {
    let now = t(0.5);
    let mut l = machine("m", Mode::Node, cfg(Some(4)), t(0.0), None);
    drain(&mut l);
    let later = t(3.0);

    let mut r = request(1, later);
    r.schema_hash = Bytes::new();
    assert_eq!(
        rejected(&join(&mut l, now, "x", r)),
        RejectReason::ProtocolViolation
    );
    let mut r = request(1, later);
    r.info.gathered = Bytes::from(vec![0; MAX_GATHERED_BYTES + 1]);
    assert_eq!(
        rejected(&join(&mut l, now, "x", r)),
        RejectReason::ProtocolViolation
    );
    let mut r = request(1, later);
    r.schema_hash = Bytes::from_static(&[8; 20]);
    assert_eq!(
        rejected(&join(&mut l, now, "x", r)),
        RejectReason::BadSchemaHash
    );
    let mut r = request(1, later);
    r.group_key = GroupKey::parse("p.0b10").unwrap();
    assert_eq!(
        rejected(&join(&mut l, now, "x", r)),
        RejectReason::BadGroupKey
    );
    // Priority: the leader must be strictly better, by expiration then by peer id.
    assert_eq!(
        rejected(&join(&mut l, now, "x", request(1, t(1.0)))),
        RejectReason::BadExpirationTime
    );
    assert_eq!(
        rejected(&join(&mut l, now, "a", request(1, t(2.0)))),
        RejectReason::BadExpirationTime,
        "equal expiration, smaller id: the follower is the better leader"
    );
    let o = join(&mut l, now, "z", request(2, t(2.0)));
    assert_eq!(replies(&o), vec![(pid("z"), 2, ReplyBody::Accepted)]);
    assert_eq!(
        rejected(&join(&mut l, now, "z", request(3, later))),
        RejectReason::DuplicatePeerId
    );
    assert_eq!(
        rejected(&join(&mut l, now, "m", request(3, later))),
        RejectReason::DuplicatePeerId
    );

    // A client cannot lead.
    let mut c = machine("c", Mode::Client, cfg(Some(4)), t(0.0), None);
    assert!(
        drain(&mut c)
            .dht
            .iter()
            .all(|d| matches!(d, DhtRequest::Get { .. }))
    );
    assert_eq!(c.declared_expiration(), None);
    assert_eq!(
        rejected(&join(&mut c, now, "x", request(1, later))),
        RejectReason::ProtocolViolation
    );

    // Full: an aux leader with an aux follower cannot close (nobody contributes values).
    let mut a = machine("m", Mode::Aux, cfg(Some(2)), t(0.0), None);
    drain(&mut a);
    let mut r = request(1, later);
    r.info.mode = Mode::Aux;
    assert_eq!(
        replies(&join(&mut a, now, "x", r)),
        vec![(pid("x"), 1, ReplyBody::Accepted)]
    );
    assert_eq!(
        rejected(&join(&mut a, now, "y", request(2, later))),
        RejectReason::GroupIsFull
    );

    // Not a leader: accepted by someone else.
    let mut l = machine("m", Mode::Node, cfg(Some(4)), t(0.0), None);
    drain(&mut l);
    l.handle_dht_get(t(0.1), 0, Some(declared(&[("b", t(1.0))])));
    let o = drain(&mut l);
    let [(to, req)] = joins(&o).try_into().unwrap();
    assert_eq!(to, pid("b"));
    assert_eq!(req.expiration, t(2.0));
    let o = reply(&mut l, t(0.2), "b", req.request_id, ReplyBody::Accepted);
    assert!(o.tx.is_empty());
    assert_eq!(
        rejected(&join(&mut l, now, "x", request(1, later))),
        RejectReason::NotALeader {
            suggested_leader: Some(pid("b"))
        }
    );

    // Not looking: after the group closed.
    let mut l = machine("m", Mode::Node, cfg(Some(2)), t(0.0), None);
    drain(&mut l);
    let o = join(&mut l, now, "x", request(1, later));
    assert!(matches!(replies(&o)[1].2, ReplyBody::Begin(_)));
    assert!(matches!(o.events[..], [Event::Assembled(_)]));
    assert_eq!(
        rejected(&join(&mut l, now, "y", request(2, later))),
        RejectReason::NotLookingForGroup
    );
}

#[test]
fn full_group_begins_with_shuffled_members_and_shared_id() {
    let mut l = machine("m", Mode::Node, cfg(Some(3)), t(0.0), None);
    drain(&mut l);
    join(&mut l, t(0.1), "x", request(11, t(3.0)));
    let o = join(&mut l, t(0.2), "y", request(12, t(3.0)));
    let r = replies(&o);
    assert_eq!(r[0], (pid("y"), 12, ReplyBody::Accepted));
    let (ReplyBody::Begin(bx), ReplyBody::Begin(by)) = (&r[1].2, &r[2].2) else {
        panic!("{r:?}")
    };
    assert_eq!(
        (&r[1].0, r[1].1, &r[2].0, r[2].1),
        (&pid("x"), 11, &pid("y"), 12)
    );
    assert_eq!(bx, by);
    assert_eq!(bx.group_id.len(), GROUP_ID_BYTES);
    let [Event::Assembled(g)] = o.events.as_slice() else {
        panic!("{:?}", o.events)
    };
    assert_eq!(g.group_id, bx.group_id);
    assert_eq!(g.members, bx.members);
    assert_eq!(g.members[g.me].peer, pid("m"));
    assert_eq!(g.leader, pid("m"));
    let mut ids: Vec<PeerId> = g.peer_ids().cloned().collect();
    ids.sort();
    assert_eq!(ids, vec![pid("m"), pid("x"), pid("y")]);
    // The leave record follows the group.
    assert!(o.dht.iter().any(|d| matches!(d,
        DhtRequest::Store { value, expiration, .. }
            if value.as_ref() == LEFT_VALUE && *expiration == t(2.0).next_up())));
}

#[test]
fn expiration_closes_a_big_enough_group_or_disbands_and_redeclares() {
    // Enough (min 2): at the leader's expiration the group of 2 begins.
    let mut l = machine("m", Mode::Node, cfg(None), t(0.0), None);
    drain(&mut l);
    join(&mut l, t(0.1), "x", request(1, t(3.0)));
    l.handle_dht_get(t(0.1), 0, None);
    drain(&mut l);
    assert!(l.poll_timeout().unwrap() <= t(2.0));
    let mut now = t(0.1);
    while !l.is_finished() {
        now = l.poll_timeout().unwrap();
        l.handle_timeout(now);
    }
    assert_eq!(now, t(2.0));
    let o = drain(&mut l);
    assert!(matches!(&replies(&o)[..], [(_, 1, ReplyBody::Begin(b))] if b.members.len() == 2));

    // Too few (min 3): disband, re-declare later.
    let mut c = cfg(None);
    c.min_group_size = 3;
    let mut l = machine("m", Mode::Node, c, t(0.0), None);
    drain(&mut l);
    join(&mut l, t(0.1), "x", request(1, t(3.0)));
    l.handle_dht_get(t(0.1), 0, None);
    drain(&mut l);
    l.handle_timeout(t(2.0));
    let o = drain(&mut l);
    assert_eq!(
        replies(&o),
        vec![(
            pid("x"),
            1,
            ReplyBody::Disbanded {
                suggested_leader: None
            }
        )]
    );
    assert!(o.dht.iter().any(|d| matches!(d,
        DhtRequest::Store { value, expiration, .. }
            if value.as_ref() == DECLARED_VALUE && *expiration == t(4.0))));
    assert!(!l.is_finished());
}

/// A scheduled time changed while looking (a step's owner moving it) sets the expiration of
/// the next declaration; the one already made stands.
#[test]
fn a_changed_scheduled_time_moves_the_next_declaration() {
    for (moved, redeclared) in [(None, 4.0), (Some(5.0), 5.0), (Some(0.5), 4.0)] {
        let mut c = cfg(None);
        c.min_group_size = 3;
        let mut l = machine("m", Mode::Node, c, t(0.0), None);
        drain(&mut l);
        assert_eq!(l.declared_expiration(), Some(t(2.0)));
        if let Some(at) = moved {
            l.set_scheduled_time(t(at));
        }
        assert_eq!(
            l.declared_expiration(),
            Some(t(2.0)),
            "the declaration stands"
        );
        join(&mut l, t(0.1), "x", request(1, t(3.0)));
        l.handle_dht_get(t(0.1), 0, None);
        drain(&mut l);
        l.handle_timeout(t(2.0));
        let o = drain(&mut l);
        assert!(
            o.dht.iter().any(|d| matches!(d,
                DhtRequest::Store { expiration, .. } if *expiration == t(redeclared))),
            "{moved:?}: {:?}",
            o.dht
        );
    }
}

#[test]
fn deadline_fails_with_no_group() {
    let mut m = machine("m", Mode::Node, cfg(Some(4)), t(0.0), Some(3.0));
    let mut now = t(0.0);
    let mut all = drain(&mut m);
    while let Some(next) = m.poll_timeout() {
        assert!(next > now, "timeouts lie in the future");
        now = next;
        m.handle_timeout(now);
        // Answer reads with an empty key.
        let o = drain(&mut m);
        for id in gets(&o) {
            m.handle_dht_get(now, id, None);
        }
        all.events.extend(o.events);
        all.dht.extend(o.dht);
    }
    assert_eq!(now, t(3.0));
    assert_eq!(
        all.events,
        vec![Event::Failed(MatchmakingError::NoGroup {
            deadline: t(3.0)
        })]
    );
    // Declarations never reach past the deadline: 2.0, then 3.0 (capped), then left.
    let stores: Vec<(Bytes, DhtTime)> = all
        .dht
        .iter()
        .filter_map(|d| match d {
            DhtRequest::Store {
                value, expiration, ..
            } => Some((value.clone(), *expiration)),
            _ => None,
        })
        .collect();
    assert_eq!(
        stores,
        vec![
            (Bytes::from_static(DECLARED_VALUE), t(2.0)),
            (Bytes::from_static(DECLARED_VALUE), t(3.0)),
            (Bytes::from_static(LEFT_VALUE), t(3.0).next_up()),
        ]
    );
    // A deadline already passed fails at once, without declaring.
    let mut m = machine("m", Mode::Node, cfg(None), t(5.0), Some(4.0));
    let o = drain(&mut m);
    assert!(o.dht.is_empty());
    assert!(matches!(
        o.events[..],
        [Event::Failed(MatchmakingError::NoGroup { .. })]
    ));
}

/// `m` asks `b` (better); returns m and its request.
fn follower_of_b(target: Option<usize>) -> (Matchmaker, JoinRequest) {
    let mut m = machine("m", Mode::Node, cfg(target), t(0.0), Some(10.0));
    drain(&mut m);
    m.handle_dht_get(t(0.1), 0, Some(declared(&[("b", t(1.5)), ("z", t(9.0))])));
    let o = drain(&mut m);
    let [(to, req)] = joins(&o).try_into().unwrap();
    assert_eq!(to, pid("b"), "asks the better candidate only");
    (m, req)
}

#[test]
fn requests_are_deferred_while_the_own_request_is_open() {
    // b rejects m: the deferred request is then accepted.
    let (mut m, req) = follower_of_b(Some(4));
    let o = join(&mut m, t(0.2), "x", request(5, t(3.0)));
    assert!(o.tx.is_empty(), "deferred, not answered");
    // A second request from the same peer while deferred is a duplicate.
    assert_eq!(
        rejected(&join(&mut m, t(0.2), "x", request(6, t(3.0)))),
        RejectReason::DuplicatePeerId
    );
    // Checks that do not depend on the outcome are answered at once.
    assert_eq!(
        rejected(&join(&mut m, t(0.2), "y", request(7, t(1.0)))),
        RejectReason::BadExpirationTime
    );
    let o = reply(
        &mut m,
        t(0.3),
        "b",
        req.request_id,
        ReplyBody::Rejected(RejectReason::GroupIsFull),
    );
    assert_eq!(replies(&o), vec![(pid("x"), 5, ReplyBody::Accepted)]);

    // b accepts m: the deferred request learns who leads.
    let (mut m, req) = follower_of_b(Some(4));
    join(&mut m, t(0.2), "x", request(5, t(3.0)));
    let o = reply(&mut m, t(0.3), "b", req.request_id, ReplyBody::Accepted);
    assert_eq!(
        replies(&o),
        vec![(
            pid("x"),
            5,
            ReplyBody::Rejected(RejectReason::NotALeader {
                suggested_leader: Some(pid("b"))
            })
        )]
    );

    // The queue of deferred requests is bounded.
    let (mut m, _) = follower_of_b(None);
    for i in 0..MAX_GROUP_SIZE {
        let o = join(&mut m, t(0.2), &format!("x{i}"), request(i as u64, t(3.0)));
        assert!(o.tx.is_empty());
    }
    assert_eq!(
        rejected(&join(&mut m, t(0.2), "y", request(9, t(3.0)))),
        RejectReason::GroupIsFull
    );

    // A deferred follower that leaves is forgotten.
    let (mut m, req) = follower_of_b(Some(4));
    join(&mut m, t(0.2), "x", request(5, t(3.0)));
    m.handle_message(t(0.25), pid("x"), Message::Leave { request_id: 5 });
    let o = reply(
        &mut m,
        t(0.3),
        "b",
        req.request_id,
        ReplyBody::Rejected(RejectReason::GroupIsFull),
    );
    assert!(replies(&o).is_empty());
}

#[test]
fn a_leader_accepted_elsewhere_redirects_its_followers() {
    let mut m = machine("m", Mode::Node, cfg(Some(4)), t(0.0), None);
    drain(&mut m);
    join(&mut m, t(0.05), "x", request(5, t(3.0)));
    m.handle_dht_get(t(0.1), 0, Some(declared(&[("b", t(1.5))])));
    let [(_, req)] = joins(&drain(&mut m)).try_into().unwrap();
    let o = reply(&mut m, t(0.2), "b", req.request_id, ReplyBody::Accepted);
    assert_eq!(
        replies(&o),
        vec![(
            pid("x"),
            5,
            ReplyBody::Disbanded {
                suggested_leader: Some(pid("b"))
            }
        )]
    );
    // x, disbanded with a suggestion, asks b directly.
    let (mut x, xreq) = follower_of_b(Some(4));
    let o = reply(
        &mut x,
        t(0.3),
        "b",
        xreq.request_id,
        ReplyBody::Disbanded {
            suggested_leader: Some(pid("c")),
        },
    );
    assert_eq!(joins(&o)[0].0, pid("c"));
}

#[test]
fn accepted_follower_waits_for_begin_then_resumes() {
    let (mut m, req) = follower_of_b(Some(4));
    reply(&mut m, t(0.2), "b", req.request_id, ReplyBody::Accepted);
    // Paused: no re-declaration at its expiration (2.0); it waits until 2.0 + 0.5.
    assert_eq!(m.poll_timeout(), Some(t(2.5)));
    m.handle_timeout(t(2.4));
    assert!(drain(&mut m).tx.is_empty(), "still waiting for Begin");
    m.handle_timeout(t(2.5));
    let o = drain(&mut m);
    assert!(o.tx.iter().any(|x| x.to == pid("b")
        && x.message
            == Message::Leave {
                request_id: req.request_id
            }));
    assert!(o.dht.iter().any(|d| matches!(d,
        DhtRequest::Store { value, expiration, .. }
            if value.as_ref() == DECLARED_VALUE && *expiration == t(4.5))));
    assert!(!m.is_finished());
    // A late Begin for the abandoned request is honoured.
    let begin = Begin {
        group_id: Bytes::from_static(&[3; 20]),
        members: vec![
            GroupMember {
                peer: pid("b"),
                info: MemberInfo::new(Mode::Node),
            },
            GroupMember {
                peer: pid("m"),
                info: MemberInfo::new(Mode::Node),
            },
        ],
    };
    let o = reply(
        &mut m,
        t(2.6),
        "b",
        req.request_id,
        ReplyBody::Begin(begin.clone()),
    );
    let [Event::Assembled(g)] = o.events.as_slice() else {
        panic!("{:?}", o.events)
    };
    assert_eq!(
        (g.me, &g.leader, &g.group_id),
        (1, &pid("b"), &begin.group_id)
    );
    // A reply for a request never made is ignored.
    let (mut m, _) = follower_of_b(Some(4));
    let o = reply(&mut m, t(0.2), "b", 999, ReplyBody::Begin(begin));
    assert!(o.events.is_empty());
    assert!(!m.is_finished());
}

#[test]
fn malformed_begins_are_refused() {
    let me = || GroupMember {
        peer: pid("m"),
        info: MemberInfo::new(Mode::Node),
    };
    let b = || GroupMember {
        peer: pid("b"),
        info: MemberInfo::new(Mode::Node),
    };
    let id = Bytes::from_static(&[3; 20]);
    let bad = [
        Begin {
            group_id: id.clone(),
            members: vec![b()],
        },
        Begin {
            group_id: id.clone(),
            members: vec![me()],
        },
        Begin {
            group_id: id.clone(),
            members: vec![b(), me(), me()],
        },
        Begin {
            group_id: Bytes::new(),
            members: vec![b(), me()],
        },
        Begin {
            group_id: id.clone(),
            members: vec![
                b(),
                GroupMember {
                    peer: pid("m"),
                    info: MemberInfo::new(Mode::Aux),
                },
            ],
        },
    ];
    for begin in bad {
        let (mut m, req) = follower_of_b(Some(4));
        reply(&mut m, t(0.2), "b", req.request_id, ReplyBody::Accepted);
        let o = reply(
            &mut m,
            t(0.3),
            "b",
            req.request_id,
            ReplyBody::Begin(begin.clone()),
        );
        assert!(o.events.is_empty(), "{begin:?}");
        assert!(
            o.tx.iter()
                .any(|x| matches!(x.message, Message::Leave { .. }))
        );
        assert!(!m.is_finished());
    }
    // A group where nobody contributes values (all aux) is refused too.
    let mut m = machine("m", Mode::Aux, cfg(Some(4)), t(0.0), None);
    drain(&mut m);
    m.handle_dht_get(t(0.1), 0, Some(declared(&[("b", t(1.5))])));
    let [(_, req)] = joins(&drain(&mut m)).try_into().unwrap();
    let aux = |p: &str| GroupMember {
        peer: pid(p),
        info: MemberInfo::new(Mode::Aux),
    };
    let o = reply(
        &mut m,
        t(0.2),
        "b",
        req.request_id,
        ReplyBody::Begin(Begin {
            group_id: id.clone(),
            members: vec![aux("b"), aux("m")],
        }),
    );
    assert!(o.events.is_empty());
    // A Begin before Accepted (reordered) is fine.
    let (mut m, req) = follower_of_b(Some(4));
    let o = reply(
        &mut m,
        t(0.3),
        "b",
        req.request_id,
        ReplyBody::Begin(Begin {
            group_id: id,
            members: vec![me(), b()],
        }),
    );
    assert!(matches!(o.events[..], [Event::Assembled(_)]));
}

/// Two peers with stale views of each other each ask the other at once (hivemind deadlocks
/// here until `request_timeout`); they form their group at once instead, whether their
/// expirations differ or tie (a shared scheduled time), where only the peer id orders them.
#[test]
fn crossed_requests_resolve_without_waiting() {
    for scheduled in [None, Some(t(3.0))] {
        let start = |me: &str, now: DhtTime| {
            let mut step = Step::new(key(), MemberInfo::new(Mode::Node));
            step.scheduled_time = scheduled;
            let mut rng = StdRng::seed_from_u64(1);
            Matchmaker::new(pid(me), cfg(Some(2)), step, now, &mut rng).unwrap()
        };
        let mut a = start("a", t(0.0));
        let mut b = start("b", t(0.1));
        drain(&mut a);
        drain(&mut b);
        // Each sees a stale, earlier declaration of the other.
        a.handle_dht_get(t(0.2), 0, Some(declared(&[("b", t(1.0))])));
        b.handle_dht_get(t(0.2), 0, Some(declared(&[("a", t(1.0))])));
        let [(_, ra)] = joins(&drain(&mut a)).try_into().unwrap();
        let [(_, rb)] = joins(&drain(&mut b)).try_into().unwrap();
        if scheduled.is_some() {
            assert_eq!(ra.expiration, rb.expiration, "tied priorities");
        }
        // Deliver both requests, then ping-pong every message until quiet; all at t = 0.2.
        let now = t(0.2);
        a.handle_message(now, pid("b"), Message::Join(rb));
        b.handle_message(now, pid("a"), Message::Join(ra));
        for _ in 0..10 {
            for (from, to) in [("a", "b"), ("b", "a")] {
                let (src, dst) = if from == "a" {
                    (&mut a, &mut b)
                } else {
                    (&mut b, &mut a)
                };
                while let Some(x) = src.poll_transmit() {
                    assert_eq!(x.to, pid(to));
                    dst.handle_message(now, pid(from), x.message);
                }
            }
        }
        let ea = drain(&mut a).events;
        let eb = drain(&mut b).events;
        let (Some(Event::Assembled(ga)), Some(Event::Assembled(gb))) = (ea.first(), eb.first())
        else {
            panic!("{scheduled:?}: {ea:?} {eb:?}")
        };
        assert_eq!(ga.group_id, gb.group_id);
        assert_eq!(
            ga.leader,
            pid("a"),
            "a declared first or has the smaller id"
        );
    }
}

#[test]
fn unreachable_leader_is_skipped_and_gone_followers_dropped() {
    let (mut m, _) = follower_of_b(Some(4));
    m.handle_unreachable(t(0.2), &pid("b"));
    let o = drain(&mut m);
    // z is worse than m: nobody left to ask, so it reads the DHT again.
    assert!(joins(&o).is_empty());
    assert_eq!(gets(&o).len(), 1);

    let mut l = machine("m", Mode::Node, cfg(None), t(0.0), None);
    drain(&mut l);
    join(&mut l, t(0.1), "x", request(1, t(3.0)));
    l.handle_unreachable(t(0.2), &pid("x"));
    l.handle_dht_get(t(0.2), 0, None);
    let mut now = t(0.2);
    while now < t(2.0) {
        now = l.poll_timeout().unwrap();
        l.handle_timeout(now);
        let o = drain(&mut l);
        for id in gets(&o) {
            l.handle_dht_get(now, id, None);
        }
        assert!(
            replies(&o).is_empty(),
            "x is gone: nobody to begin or disband"
        );
    }
    assert!(!l.is_finished());
}

#[test]
fn bad_configs_are_refused() {
    let step = Step::new(key(), MemberInfo::new(Mode::Node));
    let new = |c: Config, s: Step| {
        Matchmaker::new(pid("m"), c, s, t(0.0), &mut StdRng::seed_from_u64(0)).map(|_| ())
    };
    let mut c = cfg(Some(2));
    c.min_group_size = 3;
    assert!(matches!(
        new(c, step.clone()),
        Err(ConfigError::GroupSizes { .. })
    ));
    let mut c = cfg(None);
    c.min_group_size = 0;
    assert!(matches!(
        new(c, step.clone()),
        Err(ConfigError::GroupSizes { .. })
    ));
    let mut c = cfg(None);
    c.schema_hash = Bytes::new();
    assert!(matches!(
        new(c, step.clone()),
        Err(ConfigError::SchemaHash(0))
    ));
    let mut c = cfg(None);
    c.request_timeout = Duration::ZERO;
    assert!(matches!(
        new(c, step.clone()),
        Err(ConfigError::ZeroDuration(_))
    ));
    let mut s = step;
    s.info.bandwidth = Some(f64::NAN);
    assert!(matches!(
        new(cfg(None), s),
        Err(ConfigError::Info(InfoError::Bandwidth(_)))
    ));
}

mod hostile {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Input {
        Join {
            from: u8,
            exp: f64,
            schema_ok: bool,
            key_ok: bool,
            mode: u8,
        },
        /// A reply to the machine's latest join request (or a made-up id).
        Reply {
            to_latest: bool,
            body: u8,
            members: Vec<u8>,
        },
        Leave {
            from: u8,
            id: u64,
        },
        Dht {
            peers: Vec<(u8, f64)>,
        },
        Unreachable {
            peer: u8,
        },
        Advance {
            dt: f64,
        },
        Cancel,
    }

    fn input() -> impl Strategy<Value = Input> {
        prop_oneof![
            (0u8..6, -1.0f64..12.0, any::<bool>(), any::<bool>(), 0u8..3).prop_map(
                |(from, exp, schema_ok, key_ok, mode)| Input::Join {
                    from,
                    exp,
                    schema_ok,
                    key_ok,
                    mode
                }
            ),
            (
                any::<bool>(),
                0u8..6,
                proptest::collection::vec(0u8..7, 0..5)
            )
                .prop_map(|(to_latest, body, members)| Input::Reply {
                    to_latest,
                    body,
                    members
                }),
            (0u8..6, 0u64..4).prop_map(|(from, id)| Input::Leave { from, id }),
            proptest::collection::vec((0u8..7, -1.0f64..12.0), 0..6)
                .prop_map(|peers| Input::Dht { peers }),
            (0u8..6).prop_map(|peer| Input::Unreachable { peer }),
            (0.0f64..3.0).prop_map(|dt| Input::Advance { dt }),
            Just(Input::Cancel),
        ]
    }

    /// Peer 6 is the machine itself.
    fn name(i: u8) -> String {
        if i >= 6 { "me".into() } else { format!("p{i}") }
    }

    proptest! {
        /// Whatever arrives in whatever order: no panic, every wake-up lies after `now`, at
        /// most one terminal event and nothing after it, every group contains this peer.
        #[test]
        fn random_inputs_keep_the_invariants(
            mode in 0u8..3,
            target in prop_oneof![Just(None), (1usize..5).prop_map(Some)],
            deadline in prop_oneof![Just(None), (0.5f64..10.0).prop_map(Some)],
            inputs in proptest::collection::vec(input(), 0..60),
        ) {
            let mode = [Mode::Node, Mode::Client, Mode::Aux][mode as usize];
            let mut c = cfg(target);
            c.min_group_size = 1;
            let mut step = Step::new(key(), MemberInfo::new(mode));
            step.deadline = deadline.map(t);
            let mut m = Matchmaker::new(pid("me"), c, step, t(0.0), &mut StdRng::seed_from_u64(3))
                .unwrap();
            let mut now = t(0.0);
            let mut latest: Option<(PeerId, u64)> = None;
            let mut terminal = 0;
            for inp in inputs {
                match inp {
                    Input::Join { from, exp, schema_ok, key_ok, mode } => {
                        let mut r = request(1, t(exp));
                        if !schema_ok { r.schema_hash = Bytes::from_static(&[1]); }
                        if !key_ok { r.group_key = GroupKey::parse("q.0b").unwrap(); }
                        r.info.mode = [Mode::Node, Mode::Client, Mode::Aux][mode as usize];
                        m.handle_message(now, pid(&name(from)), Message::Join(r));
                    }
                    Input::Reply { to_latest, body, members } => {
                        let (from, id) = match (&latest, to_latest) {
                            (Some((p, id)), true) => (p.clone(), *id),
                            _ => (pid("p0"), 77),
                        };
                        let members = members.iter().map(|&i| GroupMember {
                            peer: pid(&name(i)),
                            info: MemberInfo::new(if i == 6 { mode } else { Mode::Node }),
                        }).collect();
                        let body = match body {
                            0 => ReplyBody::Accepted,
                            1 => ReplyBody::Begin(Begin { group_id: Bytes::from_static(b"g"), members }),
                            2 => ReplyBody::Rejected(RejectReason::GroupIsFull),
                            3 => ReplyBody::Disbanded { suggested_leader: Some(pid("p5")) },
                            4 => ReplyBody::Disbanded { suggested_leader: Some(pid("me")) },
                            _ => ReplyBody::Rejected(RejectReason::NotALeader { suggested_leader: None }),
                        };
                        m.handle_message(now, from, Message::Reply(Reply { request_id: id, body }));
                    }
                    Input::Leave { from, id } => {
                        m.handle_message(now, pid(&name(from)), Message::Leave { request_id: id });
                    }
                    Input::Dht { peers } => {
                        let v = merge_all(peers.iter().map(|&(p, e)| {
                            DhtValue::subkey(declaration_subkey(&pid(&name(p))), DECLARED_VALUE, t(e))
                        }));
                        m.handle_dht_get(now, 0, v);
                    }
                    Input::Unreachable { peer } => m.handle_unreachable(now, &pid(&name(peer))),
                    Input::Advance { dt } => {
                        now = now.saturating_add(Duration::from_secs_f64(dt));
                        if let Some(next) = m.poll_timeout() && next <= now {
                            now = next;
                        }
                        m.handle_timeout(now);
                    }
                    Input::Cancel => m.cancel(now),
                }
                if let Some(next) = m.poll_timeout() {
                    prop_assert!(next > now, "wake-up {next} not after {now}");
                }
                let o = drain(&mut m);
                for (to, j) in joins(&o) {
                    prop_assert!(to != pid("me"));
                    latest = Some((to, j.request_id));
                }
                for e in o.events {
                    terminal += 1;
                    if let Event::Assembled(g) = e {
                        prop_assert_eq!(&g.members[g.me].peer, &pid("me"));
                        prop_assert!(g.members.iter().any(|x| x.info.mode.is_sender()));
                    }
                }
                prop_assert!(terminal <= 1);
                prop_assert_eq!(terminal == 1, m.is_finished());
            }
        }
    }
}

/// A client that reads the key a moment before the leaders declare (every peer pre-schedules
/// the round at about the same time) reads it again within the leaders' wait, not a
/// `dht_refresh_interval` later: by default that is as long as the wait
/// (`min_matchmaking_time`), so the group closed before the client's second read and the
/// client, whom nobody can find, averaged alone (`test_optimizer_swarm`'s client, a few runs
/// in a hundred).
#[test]
fn a_client_that_read_before_the_leaders_declared_reads_again_in_time() {
    let mut c = cfg(None);
    c.min_matchmaking_time = Duration::from_secs(1);
    c.dht_refresh_interval = Duration::from_secs(1);
    let latency = 0.1; // of a DHT read
    let mut client = machine("c", Mode::Client, c.clone(), t(0.0), Some(30.0));
    assert_eq!(gets(&drain(&mut client)), vec![0]);
    // The leader declares (until t(1.05)) while the client's read is on its way.
    let mut leader = machine("b", Mode::Node, c, t(0.05), Some(30.0));
    drain(&mut leader);
    let on_dht = declared(&[("b", t(1.05))]);
    client.handle_dht_get(t(latency), 0, None);
    let mut o = drain(&mut client);
    let mut reads = 0;
    // The client's reads until it asks someone (each answered `latency` later).
    let req = loop {
        if let [(to, req)] = joins(&o).as_slice() {
            assert_eq!(*to, pid("b"));
            break req.clone();
        }
        let wake = client
            .poll_timeout()
            .expect("the client waits for its next read");
        assert!(wake < t(30.0), "the client never read again");
        client.handle_timeout(wake);
        let [id] = gets(&drain(&mut client))[..] else {
            panic!("no read at {wake:?}")
        };
        reads += 1;
        let answered = wake.saturating_add(Duration::from_secs_f64(latency));
        let value = on_dht.clone().without_expired(answered);
        client.handle_dht_get(answered, id, value);
        o = drain(&mut client);
    };
    assert_eq!(reads, 1, "one more read found the leader");
    let o = join(&mut leader, t(0.3), "c", req.clone());
    assert_eq!(
        replies(&o),
        vec![(pid("c"), req.request_id, ReplyBody::Accepted)]
    );
    // The leader's declaration expires: it closes the group with the client in it.
    leader.handle_timeout(t(1.05));
    let o = drain(&mut leader);
    let [Event::Assembled(g)] = o.events.as_slice() else {
        panic!("{:?}", o.events)
    };
    let mut ids: Vec<PeerId> = g.peer_ids().cloned().collect();
    ids.sort();
    assert_eq!(ids, vec![pid("b"), pid("c")]);
}

#[test]
fn a_clients_quick_rereads_back_off_to_the_refresh_interval() {
    use super::machine::client_reread_wait;
    let r = Duration::from_secs(1);
    let waits: Vec<_> = (1..=6).map(|n| client_reread_wait(r, n)).collect();
    assert_eq!(
        waits,
        [125, 250, 500, 1000, 1000, 1000].map(Duration::from_millis)
    );
    // A node declares, so others find it: it keeps reading every `dht_refresh_interval`.
    let mut c = cfg(None);
    c.dht_refresh_interval = Duration::from_secs(1);
    let mut m = machine("m", Mode::Node, c, t(0.0), None);
    drain(&mut m);
    m.handle_dht_get(t(0.1), 0, None);
    assert_eq!(m.poll_timeout(), Some(t(1.0)));
}
