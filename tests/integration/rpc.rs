//! RPC between real nodes on loopback (`Node::serve`, `Node::call`, `/hivemesh/rpc/1`): answers,
//! every typed error, per-peer shares of the server's call slots, and hostile callers.

use crate::swarm;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hivemesh::rpc::{RPC_PROTOCOL, RpcConfig, RpcError, TAKEN};
use swarm::Swarm;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{Semaphore, watch};

/// Far beyond what any call here needs on a loaded machine: only a hang reaches it.
const T: Duration = Duration::from_secs(60);

/// `n` nodes that know each other's addresses (calls need them; a node that joined a moment
/// ago may not be in the others' routing tables yet).
async fn swarm_with(n: usize, rpc: RpcConfig) -> Swarm {
    let swarm = Swarm::start_with(n, |_, c| c.rpc = rpc.clone()).await;
    swarm.introduce().await;
    swarm
}

/// Says `true` when dropped: held by a handler that never finishes, it tells that the server
/// dropped (abandoned) the handler.
struct Abandoned(Arc<watch::Sender<bool>>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_answer_and_fail_with_typed_errors() {
    let swarm = swarm_with(
        2,
        RpcConfig {
            max_request_bytes: 64 << 10,
            max_response_bytes: 64 << 10,
            ..RpcConfig::default()
        },
    )
    .await;
    let (client, server) = (&swarm.nodes[0], &swarm.nodes[1]);
    let server_id = swarm.peer(1);
    let client_id = swarm.peer(0);
    server
        .serve("echo", move |caller, payload: Bytes| async move {
            assert_eq!(caller, client_id, "the handler is told who calls");
            let mut out = payload.to_vec();
            out.reverse();
            Ok(Bytes::from(out))
        })
        .unwrap();
    server
        .serve("fail", |_, _| async { Err("no such luck".to_owned()) })
        .unwrap();
    server
        .serve("panic", |_, _| async { panic!("handler bug") })
        .unwrap();
    server
        .serve("huge", |_, _| async { Ok(Bytes::from(vec![7u8; 1 << 20])) })
        .unwrap();
    let (flag, mut abandoned) = watch::channel(false);
    let flag = Arc::new(flag);
    server
        .serve("slow", move |_, _| {
            let guard = Abandoned(flag.clone());
            async move {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                std::mem::forget(guard);
                Ok(Bytes::new())
            }
        })
        .unwrap();
    assert_eq!(
        server.serve("echo", |_, _| async { Ok(Bytes::new()) }),
        Err(RpcError::AlreadyServed("echo".into()))
    );
    assert_eq!(
        server.serve("", |_, _| async { Ok(Bytes::new()) }),
        Err(RpcError::BadMethodName(0))
    );

    // Answers, odd sizes included (empty, one byte, a few KiB).
    for len in [0usize, 1, 4099] {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
        let got = client.call(server_id, "echo", &payload, T).await.unwrap();
        let mut want = payload.clone();
        want.reverse();
        assert_eq!(got.as_ref(), want.as_slice(), "{len} bytes");
    }
    assert_eq!(
        client.call(server_id, "nothing", b"x", T).await,
        Err(RpcError::UnknownMethod {
            method: "nothing".into(),
            peer: server_id
        })
    );
    assert_eq!(
        client.call(server_id, "fail", b"", T).await,
        Err(RpcError::Handler {
            method: "fail".into(),
            peer: server_id,
            message: "no such luck".into()
        })
    );
    match client.call(server_id, "panic", b"", T).await {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("panicked")),
        other => panic!("{other:?}"),
    }
    // A request over our own limit is refused before anything is sent.
    match client
        .call(server_id, "echo", &vec![0u8; 65 << 10], T)
        .await
    {
        Err(RpcError::Oversized {
            what: "request", ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // The server's answer over its limit becomes a handler error; over ours, Oversized.
    match client.call(server_id, "huge", b"", T).await {
        Err(RpcError::Handler { message, .. }) => assert!(message.contains("exceeds"), "{message}"),
        other => panic!("{other:?}"),
    }
    // Timeout: the caller gives up, and the server drops the handler at the caller's timeout.
    let short = Duration::from_millis(300);
    assert_eq!(
        client.call(server_id, "slow", b"", short).await,
        Err(RpcError::Timeout {
            method: "slow".into(),
            peer: server_id,
            timeout: short
        })
    );
    tokio::time::timeout(T, abandoned.wait_for(|&dropped| dropped))
        .await
        .expect("the server dropped the handler")
        .unwrap();
    // Unserved: unknown from now on.
    assert!(server.rpc().unserve("echo"));
    assert!(matches!(
        client.call(server_id, "echo", b"x", T).await,
        Err(RpcError::UnknownMethod { .. })
    ));
    // A peer that is gone.
    let swarm::Swarm { bootstrap, nodes } = swarm;
    let mut nodes = nodes.into_iter();
    let (client, server) = (nodes.next().unwrap(), nodes.next().unwrap());
    server.shutdown().await;
    match client.call(server_id, "fail", b"", T).await {
        Err(RpcError::PeerGone { peer, .. }) => assert_eq!(peer, server_id),
        other => panic!("{other:?}"),
    }
    client.shutdown().await;
    bootstrap.shutdown().await;
}

/// A request over the server's limit is refused by the server with its sizes; an answer over
/// the caller's limit is refused by the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_of_the_other_side_are_typed_errors() {
    let swarm = Swarm::start_with(2, |i, c| {
        // Node 0 calls with generous limits; node 1 serves with small ones, and vice versa
        // for answers.
        c.rpc = if i == 0 {
            RpcConfig {
                max_request_bytes: 1 << 20,
                max_response_bytes: 16 << 10,
                ..RpcConfig::default()
            }
        } else {
            RpcConfig {
                max_request_bytes: 16 << 10,
                max_response_bytes: 1 << 20,
                ..RpcConfig::default()
            }
        };
    })
    .await;
    swarm.introduce().await;
    let server_id = swarm.peer(1);
    swarm.nodes[1]
        .serve("size", |_, p: Bytes| async move {
            Ok(Bytes::from(vec![1u8; p.len()]))
        })
        .unwrap();
    let client = &swarm.nodes[0];
    match client
        .call(server_id, "size", &vec![0u8; 100 << 10], T)
        .await
    {
        Err(RpcError::Oversized {
            what: "request",
            len,
            max,
        }) => {
            assert!(len > 100 << 10, "{len}");
            assert_eq!(max, 16 << 10);
        }
        other => panic!("{other:?}"),
    }
    // 15 KiB in (under the server's limit), 15 KiB back: fits.
    let got = client
        .call(server_id, "size", &vec![0u8; 15 << 10], T)
        .await;
    assert_eq!(got.unwrap().len(), 15 << 10);
    // Node 0 takes answers of up to 16 KiB; node 1 sends 20 KiB (its own limit is 1 MiB).
    swarm.nodes[1]
        .serve("give", |_, _| async {
            Ok(Bytes::from(vec![2u8; 20 << 10]))
        })
        .unwrap();
    match client.call(server_id, "give", b"", T).await {
        Err(RpcError::Oversized {
            what: "response",
            max,
            ..
        }) => assert_eq!(max, 16 << 10),
        other => panic!("{other:?}"),
    }
    swarm.shutdown(Vec::new()).await;
}

/// Per-peer shares of the server's call slots: with a pool of four and a share of two, a
/// peer holding two calls gets `Busy` for a third while another peer's call still runs; with
/// the share equal to the pool (no per-peer share), the first peer's four held calls leave
/// the other peer `Busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_holding_its_share_of_calls_leaves_room_for_others() {
    for per_peer in [2usize, 4] {
        let swarm = swarm_with(
            3,
            RpcConfig {
                max_inbound: 4,
                max_inbound_per_peer: per_peer,
                ..RpcConfig::default()
            },
        )
        .await;
        let server_id = swarm.peer(0);
        let release = Arc::new(Semaphore::new(0));
        let (entered_tx, mut entered) = watch::channel(0usize);
        let entered_tx = Arc::new(entered_tx);
        let gate = release.clone();
        swarm.nodes[0]
            .serve("hold", move |_, _| {
                let gate = gate.clone();
                let entered = entered_tx.clone();
                async move {
                    entered.send_modify(|n| *n += 1);
                    let _permit = gate.acquire().await.map_err(|e| e.to_string())?;
                    Ok(Bytes::from_static(b"held"))
                }
            })
            .unwrap();
        swarm.nodes[0]
            .serve("quick", |_, _| async { Ok(Bytes::from_static(b"quick")) })
            .unwrap();
        let greedy = swarm.nodes[1].rpc().clone();
        let mut held = Vec::new();
        for i in 0..per_peer {
            let rpc = greedy.clone();
            held.push(tokio::spawn(async move {
                rpc.call(server_id, "hold", b"", T).await
            }));
            tokio::time::timeout(T, entered.wait_for(|&n| n == i + 1))
                .await
                .expect("the call reached its handler")
                .unwrap();
        }
        // Its next call is refused: its share (or the whole pool) is taken.
        assert_eq!(
            greedy.call(server_id, "quick", b"", T).await,
            Err(RpcError::Busy { peer: server_id })
        );
        let honest = swarm.nodes[2].call(server_id, "quick", b"", T).await;
        if per_peer < 4 {
            assert_eq!(honest.unwrap().as_ref(), b"quick", "a share leaves room");
        } else {
            assert_eq!(
                honest,
                Err(RpcError::Busy { peer: server_id }),
                "without a share one peer takes every slot"
            );
        }
        release.add_permits(per_peer);
        for h in held {
            assert_eq!(h.await.unwrap().unwrap().as_ref(), b"held");
        }
        // The slots are back.
        assert_eq!(
            swarm.nodes[2]
                .call(server_id, "quick", b"", T)
                .await
                .unwrap()
                .as_ref(),
            b"quick"
        );
        swarm.shutdown(Vec::new()).await;
    }
}

/// Hostile callers: garbage, a length prefix far over the limit, a request that never comes
/// and a stream closed at once. Each gets the marker and a refusal, or times out, and the
/// server goes on answering honest calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_callers_get_refusals_and_hold_nothing() {
    let swarm = swarm_with(
        2,
        RpcConfig {
            max_inbound: 4,
            max_inbound_per_peer: 2,
            read_timeout: Duration::from_secs(1),
            ..RpcConfig::default()
        },
    )
    .await;
    let server_id = swarm.peer(1);
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    swarm.nodes[1]
        .serve("ping", move |_, _| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Ok(Bytes::from_static(b"pong")) }
        })
        .unwrap();
    let p2p = swarm.nodes[0].dht().p2p().clone();
    let raw = |bytes: Vec<u8>| {
        let p2p = p2p.clone();
        async move {
            let mut s = p2p.open_stream(server_id, RPC_PROTOCOL, T).await.unwrap();
            s.write_all(&bytes).await.unwrap();
            s.shutdown().await.unwrap();
            let mut answer = Vec::new();
            tokio::time::timeout(T, s.read_to_end(&mut answer))
                .await
                .expect("answered or closed")
                .unwrap();
            answer
        }
    };
    // Garbage that is not a protobuf request, in a well-formed frame: marker + BadRequest.
    let mut garbage = vec![5u8];
    garbage.extend_from_slice(&[0xff; 5]);
    let answer = raw(garbage).await;
    assert_eq!(answer.first(), Some(&TAKEN));
    assert!(answer.len() > 2, "an error answer follows: {answer:?}");
    // A length prefix claiming 1 TiB: refused from the prefix alone.
    let mut huge = Vec::new();
    prost::encoding::encode_varint(1 << 40, &mut huge);
    let answer = raw(huge).await;
    assert_eq!(answer.first(), Some(&TAKEN));
    assert!(
        String::from_utf8_lossy(&answer).contains("exceeds"),
        "{answer:?}"
    );
    // An empty stream (closed at once).
    let answer = raw(Vec::new()).await;
    assert_eq!(answer.first(), Some(&TAKEN));
    // Requests that never come: two streams held open, the peer's whole share. They are
    // dropped at the read timeout, after which the same peer's calls go through again.
    let mut silent = Vec::new();
    for _ in 0..2 {
        let mut s = p2p.open_stream(server_id, RPC_PROTOCOL, T).await.unwrap();
        // Sends the protocol negotiation, which a lazy open holds until the first flush.
        s.flush().await.unwrap();
        let mut marker = [0u8; 1];
        tokio::time::timeout(T, s.read_exact(&mut marker))
            .await
            .expect("the server took the stream")
            .unwrap();
        assert_eq!(marker[0], TAKEN);
        silent.push(s);
    }
    // The server closes them at its read timeout, with no answer.
    for s in &mut silent {
        let mut rest = Vec::new();
        tokio::time::timeout(T, s.read_to_end(&mut rest))
            .await
            .expect("the server closed the silent stream")
            .unwrap();
        assert!(
            rest.is_empty(),
            "no answer to a request that never came: {rest:?}"
        );
    }
    // Their share is given back as their tasks end, a moment after the close.
    let deadline = tokio::time::Instant::now() + T;
    let answer = loop {
        match swarm.nodes[0].call(server_id, "ping", b"", T).await {
            Err(RpcError::Busy { .. }) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the share never came back"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other,
        }
    };
    assert_eq!(answer.unwrap().as_ref(), b"pong");
    // A well-formed request written by hand is served like any call.
    let answer = raw(hivemesh::rpc::encode_request("ping", b"", T)).await;
    assert_eq!(answer.first(), Some(&TAKEN));
    assert!(String::from_utf8_lossy(&answer).contains("pong"));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    swarm.shutdown(Vec::new()).await;
}

/// Issue 29, item 8: a request for a method the server does not serve is refused from its
/// head (length prefix and method name), before its body is read or buffered. The request
/// here declares a body just under the limit (16 MiB) and never sends it, nor closes the
/// stream: the refusal arrives all the same. Before, the server waited for (and buffered) the
/// whole body, so the caller heard nothing until the server's read timeout (set far beyond
/// the wait here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_method_is_refused_before_its_body_is_read() {
    let config = RpcConfig {
        read_timeout: Duration::from_secs(600),
        ..RpcConfig::default()
    };
    let max = config.max_request_bytes;
    let swarm = swarm_with(2, config).await;
    let server_id = swarm.peer(1);
    swarm.nodes[1]
        .serve("ping", |_, _| async { Ok(Bytes::from_static(b"pong")) })
        .unwrap();
    let p2p = swarm.nodes[0].dht().p2p().clone();
    let mut s = p2p.open_stream(server_id, RPC_PROTOCOL, T).await.unwrap();
    let mut head = Vec::new();
    prost::encoding::encode_varint(u64::try_from(max - 1).unwrap(), &mut head);
    head.extend_from_slice(&[0x0a, 4]);
    head.extend_from_slice(b"nope");
    s.write_all(&head).await.unwrap();
    s.flush().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut answer))
        .await
        .expect("refused without the body")
        .unwrap();
    assert_eq!(answer.first(), Some(&TAKEN));
    assert!(
        String::from_utf8_lossy(&answer).contains("no method \"nope\""),
        "{answer:?}"
    );
    swarm.shutdown(Vec::new()).await;
}
