//! The data plane on loopback: PeerId authentication both ways, bulk integrity, the negotiated
//! suite, and a listener that survives wrong peers, garbage and silent clients.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hivemesh::transport::{DataIdentity, DataListener, DataStream, TlsError, connect};
use libp2p::identity::Keypair;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Timeout of operations that should succeed.
const T: Duration = Duration::from_secs(10);

fn identity() -> DataIdentity {
    DataIdentity::new(&Keypair::generate_ed25519()).expect("identity")
}

async fn listen(identity: &DataIdentity) -> DataListener {
    DataListener::bind(identity, "127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("bind")
}

/// Deterministic pseudo-random bytes (splitmix64).
fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// One good client against `listener`: both sides must authenticate each other.
async fn good_pair(
    listener: &DataListener,
    server: &DataIdentity,
    client: &DataIdentity,
) -> (DataStream, DataStream) {
    let (accepted, connected) = tokio::join!(
        listener.accept(T),
        connect(client, listener.local_addr(), server.peer_id(), T)
    );
    let (peer, served) = accepted.expect("accepted");
    let connected = connected.expect("connected");
    assert_eq!(peer, client.peer_id());
    assert_eq!(served.peer_id(), client.peer_id());
    assert_eq!(connected.peer_id(), server.peer_id());
    (served, connected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_peers_authenticate_both_ways_and_echo_8_mib() {
    let (server_id, client_id) = (identity(), identity());
    let listener = listen(&server_id).await;
    let addr = listener.local_addr();
    let expected_client = client_id.peer_id();
    let echo = tokio::spawn(async move {
        let (peer, stream) = listener.accept(T).await.expect("accept");
        assert_eq!(peer, expected_client);
        let (mut rx, mut tx) = tokio::io::split(stream);
        let n = tokio::io::copy(&mut rx, &mut tx).await.expect("echo");
        tx.shutdown().await.expect("close");
        n
    });

    let stream = connect(&client_id, addr, server_id.peer_id(), T)
        .await
        .expect("connect");
    assert_eq!(stream.peer_id(), server_id.peer_id());
    assert_eq!(stream.peer_addr(), addr);
    let data = bytes(8 << 20, 1);
    let (mut rx, mut tx) = tokio::io::split(stream);
    let send = async {
        for chunk in data.chunks(1 << 20) {
            tx.write_all(chunk).await?;
        }
        tx.shutdown().await
    };
    let receive = async {
        let mut got = Vec::with_capacity(data.len());
        rx.read_to_end(&mut got).await.map(|_| got)
    };
    let (sent, got) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(send, receive)
    })
    .await
    .expect("echo within 60 s");
    sent.expect("send");
    let got = got.expect("receive");
    assert_eq!(got.len(), data.len());
    assert!(got == data, "echoed bytes differ");
    let echoed = tokio::time::timeout(T, echo)
        .await
        .expect("echo task ends")
        .expect("echo task");
    assert_eq!(echoed, data.len() as u64);
}

#[tokio::test]
async fn negotiates_tls13_aes_128_gcm() {
    let (server_id, client_id) = (identity(), identity());
    let listener = listen(&server_id).await;
    let (served, connected) = good_pair(&listener, &server_id, &client_id).await;
    assert_eq!(served.cipher_suite(), "TLS13_AES_128_GCM_SHA256");
    assert_eq!(connected.cipher_suite(), "TLS13_AES_128_GCM_SHA256");
}

#[tokio::test]
async fn client_expecting_another_peer_is_rejected_and_listener_keeps_serving() {
    let (server_id, client_id, stranger) = (identity(), identity(), identity());
    let listener = listen(&server_id).await;
    let addr = listener.local_addr();
    let (accepted, connected) = tokio::join!(
        listener.accept(T),
        connect(&client_id, addr, stranger.peer_id(), T)
    );
    match connected {
        Err(TlsError::UnexpectedPeer { addr: at, mismatch }) => {
            assert_eq!(at, addr);
            assert_eq!(mismatch.expected, stranger.peer_id());
            assert_eq!(mismatch.actual, server_id.peer_id());
        }
        other => panic!("expected UnexpectedPeer, got {other:?}"),
    }
    // The server learns of it through the client's alert.
    assert!(
        matches!(accepted, Err(TlsError::Handshake { .. })),
        "{accepted:?}"
    );
    good_pair(&listener, &server_id, &client_id).await;
}

#[tokio::test]
async fn garbage_bytes_are_refused_and_listener_keeps_serving() {
    let (server_id, client_id) = (identity(), identity());
    let listener = listen(&server_id).await;
    let addr = listener.local_addr();
    let mut tls_header_then_junk = vec![0x16, 0x03, 0x01, 0x00, 0x40];
    tls_header_then_junk.extend(bytes(0x40, 3));
    let payloads = [
        bytes(64 << 10, 2),
        b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        tls_header_then_junk,
    ];
    for (i, payload) in payloads.iter().enumerate() {
        for close_after in [false, true] {
            let garbage = async {
                let mut tcp = TcpStream::connect(addr).await.expect("tcp connect");
                // The server may reset the connection before it has read everything.
                let _ = tcp.write_all(payload).await;
                if close_after {
                    let _ = tcp.shutdown().await;
                }
                tcp // kept open until the server has answered
            };
            let (accepted, tcp) = tokio::join!(listener.accept(T), garbage);
            assert!(
                matches!(accepted, Err(TlsError::Handshake { .. })),
                "payload {i}, close {close_after}: {accepted:?}"
            );
            drop(tcp);
        }
    }
    good_pair(&listener, &server_id, &client_id).await;
}

#[tokio::test]
async fn silent_client_times_out_and_listener_keeps_serving() {
    let (server_id, client_id) = (identity(), identity());
    let listener = listen(&server_id).await;
    let short = Duration::from_millis(300);

    // Nobody there: the wait for a connection times out.
    assert_eq!(
        listener.accept(short).await.err(),
        Some(TlsError::AcceptTimeout(short))
    );

    // Connected but silent: the handshake times out.
    let silent = TcpStream::connect(listener.local_addr())
        .await
        .expect("tcp connect");
    let silent_addr = silent.local_addr().expect("local addr");
    assert_eq!(
        listener.accept(short).await.err(),
        Some(TlsError::HandshakeTimeout {
            addr: silent_addr,
            timeout: short
        })
    );
    good_pair(&listener, &server_id, &client_id).await;
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_accepts_do_not_wait_for_a_silent_client() {
    let (server_id, client_id) = (identity(), identity());
    let listener = Arc::new(listen(&server_id).await);
    let addr = listener.local_addr();
    // Far beyond the test's life: were the good client's handshake queued behind the silent
    // one, it would not be served before the silent accept ends, which happens only when the
    // test drops the silent connection below.
    let patience = Duration::from_secs(3600);
    let silent = TcpStream::connect(addr).await.expect("tcp connect");
    let accepts: Vec<_> = (0..2)
        .map(|_| {
            let listener = Arc::clone(&listener);
            tokio::spawn(async move { listener.accept(patience).await })
        })
        .collect();

    let stream = connect(
        &client_id,
        addr,
        server_id.peer_id(),
        Duration::from_secs(120),
    )
    .await
    .expect("the good client is served while the silent one holds its accept");
    assert_eq!(stream.peer_id(), server_id.peer_id());
    let (first, _, mut rest) = futures::future::select_all(accepts).await;
    let (peer, _) = first
        .expect("accept task")
        .expect("the first accept to end serves the good client");
    assert_eq!(peer, client_id.peer_id());
    let silent_accept = rest.pop().expect("the other accept");
    assert!(
        !silent_accept.is_finished(),
        "the silent client's accept still waits"
    );
    drop(silent);
    let ended = tokio::time::timeout(Duration::from_secs(60), silent_accept)
        .await
        .expect("the silent accept ends once its connection closes")
        .expect("accept task");
    assert!(ended.is_err(), "{ended:?}");
}

#[tokio::test]
async fn connect_failures_are_typed() {
    let client_id = identity();
    let someone = identity().peer_id();

    // Nothing listens: refused.
    let closed: SocketAddr = {
        let probe = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        probe.local_addr().expect("addr")
    };
    let refused = connect(&client_id, closed, someone, T).await;
    assert!(
        matches!(refused, Err(TlsError::Connect { addr, .. }) if addr == closed),
        "{refused:?}"
    );

    // A TCP listener that never speaks TLS: the handshake times out.
    let mute = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mute_addr = mute.local_addr().expect("addr");
    let short = Duration::from_millis(300);
    assert_eq!(
        connect(&client_id, mute_addr, someone, short).await.err(),
        Some(TlsError::HandshakeTimeout {
            addr: mute_addr,
            timeout: short
        })
    );
    drop(mute);
}
