//! Admitting new members into a formed group, at an operation boundary.
//!
//! Every current member calls [`Group::admit`] at the same point of its sequence of
//! operations (it is a collective). Member 0, the leader, publishes an invitation in the DHT
//! (key `"{prefix}.group"`, its own owner subkey: the group's base id, its members and its
//! contact addresses) once every other member has stored an endorsement of it (a barrier
//! between the two; `invitation.rs`: how a newcomer tells a group's invitation from a
//! stranger's), and the leader serves the RPC
//! method `hivemesh.group.join.<base>` for the admission window. A newcomer
//! ([`crate::Averager::join_group`]) reads the invitations, takes the endorsed one with the
//! most members, calls its leader with what it brings (its [`MemberInfo`]: reach, addresses)
//! and waits. The leader refuses a caller that is already a member, asks twice, or is refused
//! by the group's authorizer ([`Group::with_authorizer`]). When the first request arrives (or
//! the window passes) the leader stops serving, appends the newcomers to the membership and
//! broadcasts it to the members over the group (a [`Begin`] of matchmaking, whose decoding
//! checks every field and refuses a peer named twice, carried as bytes); it answers every
//! newcomer with the same membership, which the newcomer checks extends the one it was
//! invited to. Then every member and newcomer link: newcomers to everyone, old members
//! only to newcomers (old members "send" but do not "reduce" in the link plan, so the plan
//! leaves their links to each other alone: those are kept). The group moves to the new
//! membership's prefix, as after [`Group::shrink`].
//!
//! A newcomer whose links fail is still a member: the first operation fails it by name, and
//! [`Group::shrink`] removes it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use libp2p::PeerId;
use sha2::Digest;
use tokio::sync::{mpsc, oneshot};

use super::invitation::{self, Invitation};
use super::{Group, GroupConfig, GroupError};
use crate::averager::{add_addresses, from_mm, link_peer, to_mm};
use crate::compression::{Compression, CompressionType};
use crate::matchmaking::wire::{decode, encode};
use crate::matchmaking::{self, Begin, GroupMember, MemberInfo, Message, Reply, ReplyBody};
use crate::tensor::{DType, Tensor};

/// What a group formed through matchmaking knows about itself, needed to admit members.
#[derive(Clone, Debug)]
pub struct Formation {
    /// The matchmaking group id.
    pub group_id: Bytes,
    /// The averager prefix it was formed under (the invitation's DHT key).
    pub name: String,
    /// What each member (original index) brought.
    pub infos: Vec<MemberInfo>,
}

/// Decides who may join a group ([`Group::with_authorizer`]): called by the leader with each
/// peer that asks and what it brings; `false` refuses it.
pub type Authorizer = Arc<dyn Fn(&PeerId, &MemberInfo) -> bool + Send + Sync>;

/// Join requests waiting for the leader's admission (at most this many per window).
const MAX_NEWCOMERS: usize = 16;

fn invitation_key(name: &str) -> Vec<u8> {
    crate::dht::owned_key(format!("{name}.group").as_bytes())
}

fn method(base: &[u8]) -> String {
    let hex: String = base.iter().map(|b| format!("{b:02x}")).collect();
    format!("hivemesh.group.join.{hex}")
}

/// The link id of the admission of `members` into the group of `base`.
fn link_id(base: &[u8], members: &[GroupMember]) -> Bytes {
    let mut h = sha2::Sha256::new();
    h.update(base);
    h.update(b"admit");
    for m in members {
        h.update(m.peer.as_bytes());
    }
    Bytes::copy_from_slice(&h.finalize()[..16])
}

/// A membership list as matchmaking's validated `Begin`.
fn encode_members(group_id: &Bytes, members: Vec<GroupMember>) -> Vec<u8> {
    encode(&Message::Reply(Reply {
        request_id: 0,
        body: ReplyBody::Begin(Begin {
            group_id: group_id.clone(),
            members,
        }),
    }))
}

fn decode_members(bytes: &[u8]) -> Result<Begin, String> {
    match decode(bytes).map_err(|e| e.to_string())? {
        Message::Reply(Reply {
            body: ReplyBody::Begin(begin),
            ..
        }) => Ok(begin),
        other => Err(format!("expected a membership, got {other:?}")),
    }
}

fn to_libp2p(peer: &matchmaking::PeerId) -> Result<PeerId, String> {
    from_mm(peer).ok_or_else(|| "a member id is not a libp2p peer id".to_owned())
}

/// Bytes as a tensor of their values (what the group's broadcast carries).
fn bytes_tensor(bytes: &[u8]) -> Tensor {
    let values: Vec<f32> = bytes.iter().map(|&b| f32::from(b)).collect();
    Tensor::from_f32(&[values.len()], values).expect("a 1-D shape of the values' length")
}

fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, String> {
    t.to_f32_vec()
        .into_iter()
        .map(|v| {
            (v.fract() == 0.0 && (0.0..=255.0).contains(&v))
                .then_some(v as u8)
                .ok_or_else(|| format!("{v} is not a byte"))
        })
        .collect()
}

/// A join request waiting for the admission: who, what it brings, where the answer goes.
type Request = (PeerId, MemberInfo, oneshot::Sender<Bytes>);

impl Group {
    /// Attaches what matchmaking said about the group ([`Group::admit`] needs it).
    pub fn with_formation(mut self, formation: Formation) -> Self {
        self.formation = Some(formation);
        self
    }

    /// Lets `authorize` decide who [`Group::admit`] admits while this member leads the group
    /// (without one, the leader admits whoever asks first within the window). Every member may
    /// set one: after a [`Group::shrink`] another member may lead.
    pub fn with_authorizer(mut self, authorize: Authorizer) -> Self {
        self.authorizer = Some(authorize);
        self
    }

    /// Admits the members that ask to join within `window` (see the module docs): every
    /// current member calls it at the same point; `node` is this member's node (its DHT,
    /// RPC and link hub). Returns the admitted members' peer ids (none if nobody asked).
    pub async fn admit(
        &mut self,
        node: &crate::Node,
        window: Duration,
    ) -> Result<Vec<PeerId>, GroupError> {
        const OP: &str = "admit";
        let invalid = |detail: String| GroupError::Invalid { op: OP, detail };
        let formation = self
            .formation
            .clone()
            .ok_or_else(|| invalid("the group was not formed through matchmaking".into()))?;
        let leader = self.me() == 0;
        let mut requests: Vec<Request> = Vec::new();
        let mut begin_bytes = Vec::new();
        if !leader {
            self.endorse(node, &formation.name, window).await;
        }
        // The leader publishes its invitation once every member has endorsed it: a newcomer
        // that finds the invitation finds its endorsements too (and does not settle for a
        // stranger's smaller group while they are on their way).
        self.barrier().await?;
        if leader {
            requests = self.collect_requests(node, &formation, window).await?;
            let mut members: Vec<GroupMember> = self
                .live
                .iter()
                .map(|&m| GroupMember {
                    peer: to_mm(&self.peers[m]),
                    info: formation.infos[m].clone(),
                })
                .collect();
            members.extend(requests.iter().map(|(peer, info, _)| GroupMember {
                peer: to_mm(peer),
                info: info.clone(),
            }));
            begin_bytes = encode_members(&formation.group_id, members);
        }
        // Every member learns the new membership from the leader: its length, then its bytes
        // (uncompressed: a lossy codec would change them).
        let lossless = Compression::Fixed(CompressionType::None);
        let len = u32::try_from(begin_bytes.len())
            .unwrap_or(u32::MAX)
            .to_le_bytes();
        let got = self
            .broadcast_with(0, vec![bytes_tensor(&len)], lossless.clone())
            .await?;
        let len = tensor_bytes(&got[0]).map_err(invalid)?;
        let len = u32::from_le_bytes(len.try_into().map_err(|_| invalid("bad length".into()))?);
        if len as usize > matchmaking::wire::MAX_MESSAGE_BYTES {
            return Err(invalid(format!("a membership of {len} bytes")));
        }
        let like = if leader {
            bytes_tensor(&begin_bytes)
        } else {
            Tensor::zeros(&[len as usize], DType::F32)
        };
        let got = self.broadcast_with(0, vec![like], lossless).await?;
        let begin = decode_members(&tensor_bytes(&got[0]).map_err(invalid)?).map_err(invalid)?;
        let old = self.live.len();
        let same_start = begin.members.len() >= old
            && begin.members[..old]
                .iter()
                .zip(&self.live)
                .all(|(m, &o)| to_libp2p(&m.peer).ok() == Some(self.peers[o]));
        if !same_start || begin.group_id != formation.group_id {
            return Err(invalid(
                "the leader's membership does not extend ours".into(),
            ));
        }
        if begin.members.len() == old {
            return Ok(Vec::new());
        }
        let answer = Bytes::from(encode_members(&begin.group_id, begin.members.clone()));
        for (_, _, tx) in requests {
            let _ = tx.send(answer.clone());
        }
        self.link_newcomers(node, &begin, old).await
    }

    /// The leader's side: invitation, RPC method, requests until the first one (and those
    /// queued with it) or the window's end.
    async fn collect_requests(
        &self,
        node: &crate::Node,
        formation: &Formation,
        window: Duration,
    ) -> Result<Vec<Request>, GroupError> {
        let method = method(&self.base);
        let (tx, mut rx) = mpsc::channel::<Request>(MAX_NEWCOMERS);
        let answer_wait = window.saturating_add(self.cfg.op_timeout);
        let members: Vec<PeerId> = self.live.iter().map(|&m| self.peers[m]).collect();
        let member_set: Arc<HashSet<PeerId>> = Arc::new(members.iter().copied().collect());
        let authorizer = self.authorizer.clone();
        node.serve(&method, move |caller, payload| {
            let tx = tx.clone();
            let member_set = member_set.clone();
            let authorizer = authorizer.clone();
            async move {
                let begin = decode_members(&payload)?;
                let [me] = begin.members.as_slice() else {
                    return Err("a join request names one member".into());
                };
                if to_libp2p(&me.peer).ok() != Some(caller) {
                    return Err("a join request must name its caller".into());
                }
                if member_set.contains(&caller) {
                    return Err("already a member".into());
                }
                if authorizer.is_some_and(|a| !a(&caller, &me.info)) {
                    return Err("not authorized to join this group".into());
                }
                let (answer, answered) = oneshot::channel();
                tx.try_send((caller, me.info.clone(), answer))
                    .map_err(|_| "the group admits no more members now")?;
                match tokio::time::timeout(answer_wait, answered).await {
                    Ok(Ok(bytes)) => Ok(bytes),
                    _ => Err("not admitted".into()),
                }
            }
        })
        .map_err(|e| GroupError::Internal {
            op: "admit",
            detail: e.to_string(),
        })?;
        let addrs = crate::averager::contact_addrs(node.dht().p2p()).await;
        let value = invitation::invitation_value(&self.base, &members, &addrs);
        store_entry(node, &formation.name, &value, window).await;
        let mut requests: Vec<Request> = Vec::new();
        if let Ok(Some(first)) = tokio::time::timeout(window, rx.recv()).await {
            requests.push(first);
            while let Ok(more) = rx.try_recv() {
                // One place per peer: a second request of the same peer gets "not admitted"
                // (its answer is dropped).
                if !requests.iter().any(|(p, _, _)| *p == more.0) {
                    requests.push(more);
                }
            }
        }
        node.rpc().unserve(&method);
        // Requests that raced the unserve get "not admitted" when their answer is dropped.
        while let Ok(late) = rx.try_recv() {
            drop(late);
        }
        Ok(requests)
    }

    /// A member's endorsement of its leader's invitation (`invitation.rs`).
    async fn endorse(&self, node: &crate::Node, name: &str, window: Duration) {
        store_entry(
            node,
            name,
            &invitation::endorsement_value(&self.base),
            window,
        )
        .await;
    }

    /// Links old members to newcomers (and newcomers to each other) and moves to the new
    /// membership.
    async fn link_newcomers(
        &mut self,
        node: &crate::Node,
        begin: &Begin,
        old: usize,
    ) -> Result<Vec<PeerId>, GroupError> {
        let internal = |detail: String| GroupError::Internal {
            op: "admit",
            detail,
        };
        let peers: Vec<PeerId> = begin
            .members
            .iter()
            .map(|m| to_libp2p(&m.peer))
            .collect::<Result<_, _>>()
            .map_err(internal)?;
        let me = self.me();
        let link_peers: Vec<_> = begin
            .members
            .iter()
            .zip(&peers)
            .enumerate()
            .map(|(i, (m, &p))| link_peer(p, &m.info, true, i >= old))
            .collect();
        for (m, &p) in begin.members.iter().zip(&peers).skip(old) {
            add_addresses(node.dht().p2p(), p, &m.info).await;
        }
        let expectation = node
            .hub()
            .expect(link_id(&self.base, &begin.members), &link_peers, me)
            .map_err(|e| internal(e.to_string()))?;
        let mut established = expectation.establish(self.cfg.op_timeout).await;
        let formation = self.formation.as_mut().expect("checked by admit");
        for (k, m) in begin.members.iter().enumerate().skip(old) {
            let original = self.peers.len();
            self.peers.push(peers[k]);
            self.kinds.push(established.kinds[k]);
            self.send_seq.push(0);
            self.recv_seq.push(0);
            formation.infos.push(m.info.clone());
            let lane = super::lane(&self.peers, self.me, original);
            self.mesh
                .as_mut()
                .expect("the mesh lives until close")
                .add_member(established.links[k].take(), lane);
            self.live.push(original);
        }
        self.renumber();
        Ok(peers[old..].to_vec())
    }
}

/// Stores this member's entry under the invitation key for the admission window.
async fn store_entry(node: &crate::Node, name: &str, value: &[u8], window: Duration) {
    let dht = node.dht();
    let expiration = crate::dht::DhtTime::now().saturating_add(window);
    if let Err(e) = dht
        .store_unconfirmed(
            &invitation_key(name),
            Some(&dht.own_subkey()),
            value,
            expiration,
        )
        .await
    {
        tracing::info!(error = %e, "group invitation not stored");
    }
}

/// [`crate::Averager::join_group`]: the newcomer's side (see the module docs).
pub(crate) async fn join(
    node: &crate::Node,
    name: &str,
    info: MemberInfo,
    cfg: GroupConfig,
    timeout: Duration,
) -> Result<Group, GroupError> {
    const OP: &str = "join";
    let failed = |detail: String| GroupError::Internal { op: OP, detail };
    let deadline = crate::rpc::deadline_after(timeout);
    let dht = node.dht();
    let me = dht.p2p().peer_id();
    // The invitation: the endorsed one with the most members (retried until the deadline:
    // the members publish theirs when they reach their admission).
    let invitation: Invitation = loop {
        let found = dht
            .get(&invitation_key(name))
            .await
            .ok()
            .flatten()
            .and_then(|v| {
                invitation::choose(v.owner_entries().map(|(peer, e)| (peer, &e.value[..])))
            });
        if let Some(found) = found {
            let _ = dht
                .p2p()
                .add_peer_addresses(found.leader(), found.addrs.clone())
                .await;
            break found;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(GroupError::Timeout(timeout));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (leader, base) = (invitation.leader(), invitation.base);
    let request = encode_members(
        &Bytes::copy_from_slice(&base),
        vec![GroupMember {
            peer: to_mm(&me),
            info,
        }],
    );
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let answer = node
        .call(leader, &method(&base), &request, left)
        .await
        .map_err(|e| failed(format!("asking {leader} to join: {e}")))?;
    let begin = decode_members(&answer).map_err(failed)?;
    let peers: Vec<PeerId> = begin
        .members
        .iter()
        .map(|m| to_libp2p(&m.peer))
        .collect::<Result<_, _>>()
        .map_err(failed)?;
    if !invitation::extends(&invitation, &peers, me) {
        return Err(failed(format!(
            "{leader} answered with a membership that does not extend the one it invited to"
        )));
    }
    let index = peers
        .iter()
        .position(|p| *p == me)
        .ok_or_else(|| failed("the admission does not name us".into()))?;
    // Only our own links are made here: every other member is linked with us.
    let link_peers: Vec<_> = begin
        .members
        .iter()
        .zip(&peers)
        .map(|(m, &p)| link_peer(p, &m.info, true, true))
        .collect();
    for (i, (m, &p)) in begin.members.iter().zip(&peers).enumerate() {
        if i != index {
            add_addresses(dht.p2p(), p, &m.info).await;
        }
    }
    let expectation = node
        .hub()
        .expect(link_id(&base, &begin.members), &link_peers, index)
        .map_err(|e| failed(e.to_string()))?;
    let established = expectation.establish(cfg.op_timeout).await;
    let formation = Formation {
        group_id: begin.group_id.clone(),
        name: name.to_owned(),
        infos: begin.members.iter().map(|m| m.info.clone()).collect(),
    };
    let group = Group::new(
        &begin.group_id,
        peers,
        index,
        established.links,
        established.kinds,
        cfg,
    )?
    .with_formation(formation);
    Ok(group)
}
