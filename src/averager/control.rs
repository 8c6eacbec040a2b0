//! Matchmaking messages between peers: one libp2p stream per message.
//!
//! Protocol `/hivemesh/mm/1/<prefix>` (one protocol per averaging prefix, so several averagers
//! can share a node). The sender opens a stream, writes one length-delimited
//! [`matchmaking::wire`] message and waits for a one-byte acknowledgement, which the receiver
//! writes once the message is queued for its matchmaker. No acknowledgement within
//! `ack_timeout`, or a stream reset at once (libp2p-stream 0.5.0-alpha drops inbound streams
//! that arrive together, see `crate::links`), means "re-send", up to [`SEND_ATTEMPTS`] times
//! with a short doubling pause (20 ms, 40 ms, ...); a peer that never
//! acknowledges is reported unreachable, which the matchmaker treats like a peer that left.
//! The matchmaking protocol tolerates a message delivered twice (requests carry ids and are
//! answered once).
//!
//! The receiving side reads each stream in its own task, at most [`MAX_INBOUND`] at once and
//! [`MAX_INBOUND_PER_PEER`] from one peer (more are dropped: their senders re-send; a peer that
//! holds its whole share cannot keep others' messages out), each under a timeout and with the message size
//! checked from its length prefix before anything is buffered.

use std::time::Duration;

use bytes::BytesMut;
use libp2p::PeerId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::matchmaking::{self, Message};
use crate::p2p::{InboundStreams, P2p, P2pStream};
use crate::shares::Shares;
use crate::wire::FrameDecoder;

/// Attempts per message before the peer counts as unreachable.
pub const SEND_ATTEMPTS: usize = 5;
/// Pause after the first failed attempt; doubles after each further one.
const RETRY_DELAY: Duration = Duration::from_millis(20);
/// Inbound message streams read at once.
pub const MAX_INBOUND: usize = 64;
/// Inbound message streams read at once from one peer: a peer holding them all leaves the
/// other 56 to everyone else.
pub const MAX_INBOUND_PER_PEER: usize = 8;
const ACK: u8 = 0x06;

/// Why a message could not be delivered (logged; the matchmaker sees "unreachable").
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Opening a stream failed.
    #[error("opening a stream: {0}")]
    Open(String),
    /// Writing or reading the stream failed.
    #[error("i/o: {0}")]
    Io(String),
    /// No acknowledgement in time.
    #[error("no acknowledgement within {0:?}")]
    NoAck(Duration),
}

/// The protocol name for `prefix`.
pub fn protocol(prefix: &str) -> String {
    format!("/hivemesh/mm/1/{prefix}")
}

/// Sends `message` to `peer`, retrying silent attempts (see the module docs).
pub async fn send(
    p2p: &P2p,
    peer: PeerId,
    protocol: &str,
    message: &Message,
    ack_timeout: Duration,
) -> Result<(), ControlError> {
    let body = matchmaking::wire::encode(message);
    let mut frame = BytesMut::with_capacity(body.len() + 10);
    crate::wire::put_length_prefix(body.len(), &mut frame);
    frame.extend_from_slice(&body);
    let mut last = ControlError::NoAck(ack_timeout);
    let mut delay = RETRY_DELAY;
    for attempt in 0..SEND_ATTEMPTS {
        if attempt > 0 {
            // A dropped stream is usually reset at once; give the peer's inbound queue a
            // moment before the next attempt.
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
        match send_once(p2p, peer, protocol, &frame, ack_timeout).await {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(last)
}

async fn send_once(
    p2p: &P2p,
    peer: PeerId,
    protocol: &str,
    frame: &[u8],
    ack_timeout: Duration,
) -> Result<(), ControlError> {
    let mut stream = p2p
        .open_stream(peer, protocol, ack_timeout)
        .await
        .map_err(|e| ControlError::Open(e.to_string()))?;
    let exchange = async {
        stream.write_all(frame).await?;
        stream.flush().await?;
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).await?;
        let _ = stream.shutdown().await;
        std::io::Result::Ok(ack[0])
    };
    match tokio::time::timeout(ack_timeout, exchange).await {
        Ok(Ok(ACK)) => Ok(()),
        Ok(Ok(other)) => Err(ControlError::Io(format!(
            "bad acknowledgement byte {other}"
        ))),
        Ok(Err(e)) => Err(ControlError::Io(e.to_string())),
        Err(_) => Err(ControlError::NoAck(ack_timeout)),
    }
}

/// Serves inbound message streams: decodes each message and hands `(sender, message)` to
/// `inbox`, acknowledging only what was queued. Runs until the node shuts down or `inbox`
/// closes.
pub async fn serve(
    inbound: InboundStreams,
    inbox: mpsc::Sender<(PeerId, Message)>,
    read_timeout: Duration,
) {
    let shares = Shares::new(MAX_INBOUND, MAX_INBOUND_PER_PEER);
    serve_with(inbound, inbox, read_timeout, shares).await;
}

/// [`serve`] with other bounds (tests).
async fn serve_with(
    inbound: InboundStreams,
    inbox: mpsc::Sender<(PeerId, Message)>,
    read_timeout: Duration,
    shares: Shares<PeerId>,
) {
    inbound
        .serve_each(shares, "matchmaking", |peer, stream| {
            // Nobody reads what the streams carry any more: stop.
            if inbox.is_closed() {
                return None;
            }
            let tx = inbox.clone();
            Some(async move {
                if let Err(e) = receive(peer, stream, &tx, read_timeout).await {
                    tracing::debug!(%peer, error = %e, "bad matchmaking message");
                }
            })
        })
        .await;
}

async fn receive(
    peer: PeerId,
    mut stream: P2pStream,
    inbox: &mpsc::Sender<(PeerId, Message)>,
    read_timeout: Duration,
) -> Result<(), String> {
    let decoder = FrameDecoder::new(matchmaking::wire::MAX_MESSAGE_BYTES);
    let read = async {
        let mut buf = BytesMut::with_capacity(1024);
        loop {
            if let Some((prefix, len)) = decoder.peek_len(&buf).map_err(|e| e.to_string())? {
                while buf.len() < prefix + len {
                    buf.reserve((prefix + len - buf.len()).min(64 << 10));
                    if stream.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
                        return Err("stream closed mid-message".to_owned());
                    }
                }
                return Ok(buf.split_off(prefix).split_to(len).freeze());
            }
            if stream.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
                return Err("stream closed before a message".to_owned());
            }
        }
    };
    let body = tokio::time::timeout(read_timeout, read)
        .await
        .map_err(|_| format!("no message within {read_timeout:?}"))??;
    let message = matchmaking::wire::decode(&body).map_err(|e| e.to_string())?;
    tokio::time::timeout(read_timeout, inbox.send((peer, message)))
        .await
        .map_err(|_| "averager inbox full".to_owned())?
        .map_err(|_| "averager gone".to_owned())?;
    let _ = tokio::time::timeout(read_timeout, async {
        stream.write_all(&[ACK]).await?;
        stream.shutdown().await
    })
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::p2p::P2pConfig;
    use libp2p::identity::Keypair;

    async fn spawn_node() -> P2p {
        let (p2p, _task) = P2p::spawn(
            P2pConfig::loopback(),
            Keypair::generate_ed25519(),
            Box::new(crate::dht::DhtPolicy::default()),
        )
        .await
        .expect("node starts");
        p2p
    }

    fn a_message() -> Message {
        // Any message will do: the test is about getting it through, not about its content.
        Message::Leave { request_id: 3 }
    }

    /// One peer opens `total` streams and sends nothing on them. With no per-peer share (the
    /// share equal to the pool, as before) it holds every slot and an honest peer's message
    /// is dropped on every attempt; with a share of half the pool the honest message is
    /// delivered and acknowledged.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_holding_its_share_cannot_keep_messages_out() {
        const TOTAL: usize = 4;
        for per_peer in [TOTAL, TOTAL / 2] {
            let server = spawn_node().await;
            let addrs = server.listen_addrs().await.unwrap();
            let proto = protocol("shares");
            let inbound = server.accept_streams(&proto, 64).unwrap();
            let (tx, mut inbox) = mpsc::channel(8);
            let shares = Shares::new(TOTAL, per_peer);
            let serving = tokio::spawn(serve_with(
                inbound,
                tx,
                Duration::from_secs(120),
                shares.clone(),
            ));
            let (hostile, honest) = (spawn_node().await, spawn_node().await);
            for p in [&hostile, &honest] {
                p.add_peer_addresses(server.peer_id(), addrs.clone())
                    .await
                    .unwrap();
            }
            // One stream at a time until the server holds as many as it will take: streams
            // opened together may be dropped by libp2p-stream itself (see `crate::links`),
            // and ones past the hostile peer's share are dropped by the server; only those it
            // holds matter.
            let expected = per_peer.min(TOTAL);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            let mut held = Vec::new();
            while shares.in_use() < expected {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the server never held {expected} hostile streams"
                );
                if let Ok(mut s) = hostile
                    .open_stream(server.peer_id(), &proto, Duration::from_secs(30))
                    .await
                {
                    // Half a length prefix: the server reads and waits for the rest.
                    let _ = s.write_all(&[0x80]).await;
                    let _ = s.flush().await;
                    held.push(s);
                }
                let taken = held.len().min(expected);
                for _ in 0..100 {
                    if shares.in_use() >= taken {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            let sent = send(
                &honest,
                server.peer_id(),
                &proto,
                &a_message(),
                Duration::from_secs(2),
            )
            .await;
            if per_peer == TOTAL {
                assert!(sent.is_err(), "without shares the pool was full");
                assert!(inbox.try_recv().is_err());
            } else {
                sent.expect("the honest message got a slot");
                let (from, _) = inbox.recv().await.unwrap();
                assert_eq!(from, honest.peer_id());
            }
            drop(held);
            serving.abort();
        }
    }
}
