//! The opener side and the collection of a round's links (protocol in the `links` module doc).

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;

use super::hub::{Arrived, Expectation, Shared, write_link_frame};
use super::{
    Carrier, EstablishedLinks, HubError, LinkHub, LinkKind, LinkPeer, PART_PROTOCOL, Plan,
};
use crate::metrics::CountedLink;
use crate::p2p::{P2p, Transport};
use crate::reach::Path;
use crate::runner::Link;
use crate::transport;
use crate::wire::{self, Hello, LinkMessage, RejectReason};

/// Registers the round with `hub` ([`LinkHub::expect`]) and establishes its links
/// ([`Expectation::establish`]): opens the links this member opens, collects the others, all
/// within `timeout` (the plan in the `links` module docs). `members` is the group in member order (the
/// order [`crate::runner::run_round`] uses); `members[me]` must be this node. Errors only for
/// invalid arguments; links that could not be made are `None`, with their reason in
/// [`EstablishedLinks::errors`].
pub async fn establish_links(
    hub: &LinkHub,
    group_id: Bytes,
    members: &[LinkPeer],
    me: usize,
    timeout: Duration,
) -> Result<EstablishedLinks, HubError> {
    Ok(hub.expect(group_id, members, me)?.establish(timeout).await)
}

impl Expectation {
    /// Establishes the round's links within `timeout` and unregisters the round: opens the
    /// links we open (TLS if the peer has a data address, streams otherwise or if TLS fails;
    /// after a hole punch for two NATed members) and waits for the others, over either carrier.
    pub async fn establish(mut self, timeout: Duration) -> EstablishedLinks {
        let deadline = Instant::now() + timeout;
        let n = self.members.len();
        let me = self.me;
        let relay_data = self.members[me].relay_data;
        let to_open: Vec<(usize, Path)> = (0..n)
            .filter_map(|j| match self.plan[j] {
                Plan::Open(path) => Some((j, path)),
                _ => None,
            })
            .collect();
        let awaited = self
            .plan
            .iter()
            .filter(|p| matches!(p, Plan::Await(_)))
            .count();
        let hello = LinkMessage::Hello(Hello {
            group_id: self.group_id.clone(),
            from_index: me as u32,
            from_peer: self.shared.peer_id,
        });
        let shared = &*self.shared;
        let members = &self.members;
        let openers = futures::future::join_all(to_open.iter().map(|&(j, path)| {
            let peer = &members[j];
            let relay_ok = relay_data && peer.relay_data;
            open_link(shared, &hello, peer, path, relay_ok, deadline, timeout)
        }));
        let arrivals = &mut self.arrivals;
        let collect = async {
            let mut got = Vec::with_capacity(awaited);
            while got.len() < awaited {
                match tokio::time::timeout_at(deadline, arrivals.recv()).await {
                    Ok(Some(arrival)) => got.push(arrival),
                    Ok(None) | Err(_) => break,
                }
            }
            got
        };
        let (opened, arrived) = tokio::join!(openers, collect);

        let mut links: Vec<Option<Box<dyn Link>>> = (0..n).map(|_| None).collect();
        let mut kinds = vec![None; n];
        let mut errors: Vec<Option<HubError>> = vec![None; n];
        let mut reopened = 0;
        for a in arrived {
            match a {
                Arrived::Link(a) => {
                    kinds[a.from] = Some(a.kind);
                    links[a.from] = Some(a.link);
                }
                Arrived::GaveUp { from, error } => errors[from] = Some(error),
            }
        }
        for (&(j, _), outcome) in to_open.iter().zip(opened) {
            reopened += outcome.reopened;
            match outcome.result {
                Ok((link, kind)) => {
                    links[j] = Some(link);
                    kinds[j] = Some(kind);
                }
                Err(e) => errors[j] = Some(e),
            }
        }
        for i in 0..n {
            if links[i].is_some() || errors[i].is_some() {
                continue;
            }
            let peer = self.members[i].peer_id;
            errors[i] = match self.plan[i] {
                Plan::Idle => None,
                Plan::Unreachable => Some(HubError::NoPath {
                    peer,
                    detail: format!(
                        "{} and {} members cannot connect, and tensor data may not go through \
                         a relay",
                        self.members[me].reach, self.members[i].reach
                    ),
                }),
                Plan::Open(_) | Plan::Await(_) => Some(HubError::NoLink { peer, timeout }),
            };
        }
        // Remember the members behind NATs we could not link to (published with our next join,
        // so that group plans around the pair), and forget those we linked to.
        {
            let now = std::time::Instant::now();
            let mut unlinkable = self.shared.unlinkable();
            for (i, plan) in self.plan.iter().enumerate() {
                if !matches!(
                    plan,
                    Plan::Open(Path::HolePunch) | Plan::Await(Path::HolePunch)
                ) {
                    continue;
                }
                let peer = self.members[i].peer_id;
                if links[i].is_some() {
                    unlinkable.linked(&peer);
                } else {
                    tracing::info!(%peer, "no link with a member behind a NAT: remembered");
                    unlinkable.failed(peer, now);
                }
            }
        }
        let carriers: Vec<Option<Carrier>> =
            kinds.iter().map(|k| k.map(LinkKind::carrier)).collect();
        let metrics = self.shared.p2p.metrics();
        for (link, carrier) in links.iter_mut().zip(&carriers) {
            if let Some(carrier) = carrier
                && let Some(l) = link.take()
            {
                *link = Some(Box::new(CountedLink::new(
                    l,
                    metrics.link_counters(*carrier),
                )));
            }
        }
        for e in errors.iter().flatten() {
            tracing::info!(error = %e, "member not linked");
        }
        tracing::debug!(?kinds, reopened, "links established");
        EstablishedLinks {
            links,
            carriers,
            kinds,
            errors,
            reopened,
        }
    }
}

/// What one opener got.
struct Opened {
    result: Result<(Box<dyn Link>, LinkKind), HubError>,
    reopened: usize,
}

/// How a stream link with `peer` is carried: from the connections we have to it. A direct
/// connection wins over a relayed one (after a hole punch the relayed one is being closed, and
/// streams are opened only once the direct one exists), a punched one over another.
pub(super) async fn stream_kind(p2p: &P2p, peer: libp2p::PeerId) -> LinkKind {
    let paths = p2p.connection_paths(peer).await.unwrap_or_default();
    paths
        .iter()
        .filter(|p| !p.relayed)
        .max_by_key(|p| p.punched)
        .or_else(|| paths.first())
        .map_or(LinkKind::Stream(Transport::Other), |p| {
            LinkKind::of_stream(*p)
        })
}

type Attempt<'a> = BoxFuture<'a, (Carrier, Result<Box<dyn Link>, HubError>)>;

/// Opens the link to `peer` over `path`: for a hole-punch path a direct connection first
/// (through the relay if the punch fails and `relay_ok`), then attempts on the chosen carrier,
/// re-opened on silence or failure, retried on "not yet"; the first Ack wins. Ends by
/// `deadline`.
async fn open_link(
    shared: &Shared,
    hello: &LinkMessage,
    peer: &LinkPeer,
    path: Path,
    relay_ok: bool,
    deadline: Instant,
    timeout: Duration,
) -> Opened {
    // Punched TLS first: its simultaneous open needs only signalling, which the relayed
    // connection carries, so it does not wait for DCUtR (whose TCP punch dies of a reset on
    // routers that answer, and whose QUIC punch cannot work there while the other router's
    // own entry for our first datagram holds the port: docs/architecture.md).
    if path == Path::HolePunch
        && shared.config.punched_tls
        && shared.identity.is_some()
        && shared.p2p.reachability().port_preserving
        && !shared.punch_failed_recently(&peer.peer_id)
    {
        match punched_tls(shared, hello, peer).await {
            Ok(link) => {
                tracing::debug!(peer = %peer.peer_id, "punched TLS link opened");
                return Opened {
                    result: Ok((link, LinkKind::PunchedTls)),
                    reopened: 0,
                };
            }
            Err(error) => {
                shared.punch_failed(peer.peer_id);
                tracing::info!(peer = %peer.peer_id, %error, "no punched TLS link: a stream instead");
            }
        }
    }
    if path == Path::HolePunch {
        let punch = shared
            .config
            .punch_timeout
            .min(deadline.saturating_duration_since(Instant::now()));
        match shared
            .p2p
            .connect_direct(peer.peer_id, peer.relay_addrs.clone(), punch)
            .await
        {
            Ok(conn) => {
                tracing::debug!(peer = %peer.peer_id, ?conn, "direct connection for the link");
            }
            Err(error) if relay_ok => {
                tracing::info!(peer = %peer.peer_id, %error, "hole punch failed: relaying the link");
            }
            Err(error) => {
                give_up(shared, hello, peer).await;
                return Opened {
                    result: Err(HubError::NoPath {
                        peer: peer.peer_id,
                        detail: error.to_string(),
                    }),
                    reopened: 0,
                };
            }
        }
    }
    let mut opened = open_attempts(shared, hello, peer, deadline, timeout).await;
    if let Ok((_, LinkKind::Relayed)) = &opened.result
        && !relay_ok
    {
        give_up(shared, hello, peer).await;
        opened.result = Err(HubError::NoPath {
            peer: peer.peer_id,
            detail: "the only connection runs through a relay, which is not allowed for tensor \
                     data"
                .into(),
        });
    }
    opened
}

/// Tells `peer` that we cannot open our link to it ([`LinkMessage::GiveUp`], on a stream that
/// runs wherever the swarm reaches it: through its relay after a failed punch), so that it
/// stops waiting for the link at once. Best effort, bounded by `hello_timeout`.
async fn give_up(shared: &Shared, hello: &LinkMessage, peer: &LinkPeer) {
    let LinkMessage::Hello(h) = hello else {
        return;
    };
    let config = &shared.config;
    let sent = tokio::time::timeout(config.hello_timeout, async {
        let mut stream = shared
            .p2p
            .open_stream(peer.peer_id, PART_PROTOCOL, config.connect_timeout)
            .await
            .map_err(|e| e.to_string())?;
        write_link_frame(&mut stream, &LinkMessage::GiveUp(h.clone()))
            .await
            .map_err(|e| e.to_string())?;
        tokio::io::AsyncWriteExt::shutdown(&mut stream)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    match sent {
        Ok(Ok(())) => tracing::debug!(peer = %peer.peer_id, "gave up the link"),
        Ok(Err(e)) => {
            tracing::debug!(peer = %peer.peer_id, error = %e, "could not give up the link")
        }
        Err(_) => tracing::debug!(peer = %peer.peer_id, "could not give up the link in time"),
    }
}

/// Our endpoint for a simultaneous open from local `port`, as our NAT maps it: the IP peers
/// observe our connections from (IPv4), the port kept (a punchable NAT preserves ports).
pub(super) fn mapped_endpoint(p2p: &P2p, port: u16) -> Option<std::net::SocketAddr> {
    let r = p2p.reachability();
    r.observed.iter().rev().find_map(|a| {
        a.iter().find_map(|p| match p {
            libp2p::multiaddr::Protocol::Ip4(ip) => Some(std::net::SocketAddr::from((ip, port))),
            _ => None,
        })
    })
}

/// The opener's side of a punched TLS link: over a stream on whatever connection we have to the
/// peer (the relayed one before any hole punch; the signalling is a few bytes), a
/// [`LinkMessage::Punch`] with our endpoint, the acceptor's endpoint back, the simultaneous
/// open, the TLS client handshake (the server must be the member), then the Hello over TLS.
/// Everything under `punch_connect_timeout` plus the usual connect and Hello bounds.
async fn punched_tls(
    shared: &Shared,
    hello: &LinkMessage,
    peer: &LinkPeer,
) -> Result<Box<dyn Link>, HubError> {
    let config = &shared.config;
    let peer_id = peer.peer_id;
    let failed = |detail: String| HubError::NoPath {
        peer: peer_id,
        detail,
    };
    let (Some(identity), LinkMessage::Hello(h)) = (&shared.identity, hello) else {
        return Err(failed("no TLS identity".into()));
    };
    let socket = transport::PunchSocket::bind().map_err(|e| failed(e.to_string()))?;
    let ours = mapped_endpoint(&shared.p2p, socket.port())
        .ok_or_else(|| failed("no observed address to punch from".into()))?;
    // The stream may land on a relayed connection that is being closed (the punch just made
    // the direct one): such an open fails at once, and the next one finds the direct one.
    let mut opened = Err(HubError::NoPath {
        peer: peer_id,
        detail: "no stream".into(),
    });
    for _ in 0..3 {
        opened = shared
            .p2p
            .open_stream(peer_id, PART_PROTOCOL, config.connect_timeout)
            .await
            .map_err(HubError::from);
        if opened.is_ok() {
            break;
        }
        tokio::time::sleep(config.retry_delay).await;
    }
    let mut stream = opened?;
    let exchange = async {
        write_link_frame(
            &mut stream,
            &LinkMessage::Punch {
                hello: h.clone(),
                endpoint: ours,
            },
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
        match wire::read_link_frame(&mut stream).await {
            Ok(LinkMessage::PunchAnswer(theirs)) => Ok(theirs),
            Ok(LinkMessage::Reject(r)) => Err(HubError::Rejected {
                peer: peer_id,
                carrier: Carrier::Stream,
                reason: r.reason,
                detail: r.detail,
            }),
            Ok(_) => Err(HubError::Unexpected {
                peer: peer_id,
                carrier: Carrier::Stream,
            }),
            Err(error) => Err(HubError::Frame {
                peer: peer_id,
                carrier: Carrier::Stream,
                error,
            }),
        }
    };
    let theirs = tokio::time::timeout(config.hello_timeout, exchange)
        .await
        .map_err(|_| failed("no answer to the punch request".into()))??;
    let deadline = Instant::now() + config.punch_connect_timeout;
    let tcp = socket
        .connect(theirs, deadline)
        .await
        .map_err(|e| failed(e.to_string()))?;
    drop(stream);
    let mut link: Box<dyn Link> =
        Box::new(transport::connect_over(identity, tcp, peer_id, config.connect_timeout).await?);
    let answer = tokio::time::timeout(config.hello_timeout, async {
        write_link_frame(&mut link, hello)
            .await
            .map_err(|e| failed(e.to_string()))?;
        wire::read_link_frame(&mut link)
            .await
            .map_err(|error| HubError::Frame {
                peer: peer_id,
                carrier: Carrier::Tls,
                error,
            })
    })
    .await
    .map_err(|_| failed("no answer to the Hello".into()))??;
    match answer {
        LinkMessage::Ack => Ok(link),
        LinkMessage::Reject(r) => Err(HubError::Rejected {
            peer: peer_id,
            carrier: Carrier::Tls,
            reason: r.reason,
            detail: r.detail,
        }),
        _ => Err(HubError::Unexpected {
            peer: peer_id,
            carrier: Carrier::Tls,
        }),
    }
}

/// The attempts of [`open_link`].
async fn open_attempts(
    shared: &Shared,
    hello: &LinkMessage,
    peer: &LinkPeer,
    deadline: Instant,
    timeout: Duration,
) -> Opened {
    let config = &shared.config;
    let max_delay = config.retry_delay * 16;
    let mut use_tls = peer.data_addr.is_some() && shared.identity.is_some();
    let mut attempts: FuturesUnordered<Attempt<'_>> = FuturesUnordered::new();
    let launch = |carrier: Carrier| -> Attempt<'_> {
        Box::pin(async move { (carrier, attempt(shared, carrier, peer, hello).await) })
    };
    let carrier = |use_tls: bool| {
        if use_tls {
            Carrier::Tls
        } else {
            Carrier::Stream
        }
    };

    attempts.push(launch(carrier(use_tls)));
    let mut counted = 1; // attempts bounded by max_attempts
    let mut reopened = 0;
    let mut delay = config.retry_delay;
    // When to launch the next attempt: after ack_timeout of silence, or a delay after a failure.
    let mut next_at = Some(Instant::now() + config.ack_timeout);
    // Whether the next launch is a "not yet" retry (not counted against max_attempts).
    let mut not_yet = false;
    let mut last_error = None;
    loop {
        tokio::select! {
            biased;
            Some((carrier_used, result)) = attempts.next(), if !attempts.is_empty() => {
                let error = match result {
                    Ok(link) => {
                        let kind = match carrier_used {
                            Carrier::Tls => LinkKind::Tls,
                            Carrier::Stream => stream_kind(&shared.p2p, peer.peer_id).await,
                        };
                        tracing::debug!(peer = %peer.peer_id, %kind, "link opened");
                        return Opened { result: Ok((link, kind)), reopened };
                    }
                    Err(e) => e,
                };
                tracing::debug!(%error, "link attempt failed");
                match &error {
                    HubError::Rejected {
                        reason: RejectReason::UnknownGroup | RejectReason::NotInSwarm,
                        ..
                    } => {
                        // Not yet registered there (or, in a private swarm, not yet known as a
                        // member there: it is once the round registers): retry on the same
                        // carrier.
                        not_yet = true;
                        next_at = Some(Instant::now() + delay);
                        delay = (delay * 2).min(max_delay);
                    }
                    HubError::Rejected { reason: RejectReason::Duplicate, .. } => {
                        // Another attempt of ours was accepted: its Ack is on its way, unless
                        // that attempt has failed since (then the pair is lost).
                        if attempts.is_empty() {
                            return Opened { result: Err(error), reopened };
                        }
                    }
                    HubError::Rejected { .. } => return Opened { result: Err(error), reopened },
                    _ => {
                        if carrier_used == Carrier::Tls {
                            // The fast path is broken for this pair: fall back at once.
                            use_tls = false;
                            next_at = Some(Instant::now());
                        } else if attempts.is_empty() {
                            next_at = Some(Instant::now() + delay);
                            delay = (delay * 2).min(max_delay);
                        }
                    }
                }
                last_error = Some(error);
            }
            () = sleep_until(next_at), if next_at.is_some() => {
                if !not_yet && counted >= config.max_attempts {
                    next_at = None;
                } else {
                    if !not_yet {
                        counted += 1;
                        reopened += 1;
                        if !attempts.is_empty() {
                            // Silence on TLS: the next attempts use the fallback.
                            use_tls = false;
                        }
                    }
                    not_yet = false;
                    attempts.push(launch(carrier(use_tls)));
                    next_at = Some(Instant::now() + config.ack_timeout);
                }
            }
            () = tokio::time::sleep_until(deadline) => break,
        }
        if attempts.is_empty() && next_at.is_none() {
            break;
        }
    }
    let error = last_error.unwrap_or(HubError::NoLink {
        peer: peer.peer_id,
        timeout,
    });
    Opened {
        result: Err(error),
        reopened,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One attempt: connect on `carrier`, send the Hello, wait for the answer (bounded by the
/// caller's deadline; the caller opens another attempt on silence).
async fn attempt(
    shared: &Shared,
    carrier: Carrier,
    peer: &LinkPeer,
    hello: &LinkMessage,
) -> Result<Box<dyn Link>, HubError> {
    let config = &shared.config;
    let peer_id = peer.peer_id;
    let mut link: Box<dyn Link> = match (carrier, &shared.identity, peer.data_addr) {
        (Carrier::Tls, Some(identity), Some(addr)) => {
            Box::new(transport::connect(identity, addr, peer_id, config.connect_timeout).await?)
        }
        _ => Box::new(
            shared
                .p2p
                .open_stream(peer_id, PART_PROTOCOL, config.connect_timeout)
                .await?,
        ),
    };
    let write_error = |detail: String| HubError::Write {
        peer: peer_id,
        carrier,
        detail,
    };
    tokio::time::timeout(config.connect_timeout, write_link_frame(&mut link, hello))
        .await
        .map_err(|_| write_error(format!("timed out after {:?}", config.connect_timeout)))?
        .map_err(|e| write_error(e.to_string()))?;
    match wire::read_link_frame(&mut link).await {
        Ok(LinkMessage::Ack) => Ok(link),
        Ok(LinkMessage::Reject(r)) => Err(HubError::Rejected {
            peer: peer_id,
            carrier,
            reason: r.reason,
            detail: r.detail,
        }),
        Ok(
            LinkMessage::Hello(_)
            | LinkMessage::Punch { .. }
            | LinkMessage::PunchAnswer(_)
            | LinkMessage::GiveUp(_)
            | LinkMessage::Census(_),
        ) => Err(HubError::Unexpected {
            peer: peer_id,
            carrier,
        }),
        Err(error) => Err(HubError::Frame {
            peer: peer_id,
            carrier,
            error,
        }),
    }
}
