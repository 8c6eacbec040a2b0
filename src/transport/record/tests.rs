//! The record layer against RFC 8446 §5: records, alerts, limits, over real sockets.

use super::*;
use tokio::io::AsyncReadExt as _;

fn direction() -> Direction {
    let secrets = ConnectionTrafficSecrets::Chacha20Poly1305 {
        key: rustls::crypto::cipher::AeadKey::from([9u8; 32]),
        iv: rustls::crypto::cipher::Iv::from([3u8; 12]),
    };
    Direction::new(0, secrets).expect("key")
}

/// A socket pair and a receiver on one end keyed like `direction()`.
async fn sockets() -> (TcpStream, TcpStream) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
    (a.expect("connect"), b.expect("accept").0)
}

/// Sends `records` (plaintext, content type) sealed with `direction()`.
async fn send(tcp: &mut TcpStream, records: &[(&[u8], u8)]) {
    let mut sender = Sender::new(direction());
    for (plaintext, content_type) in records {
        sender.seal(plaintext, *content_type).expect("seal");
    }
    std::future::poll_fn(|cx| sender.poll_drain(tcp, cx))
        .await
        .expect("send");
}

async fn read_all(tcp: TcpStream) -> (Vec<u8>, io::Result<usize>) {
    let buf = vec![0u8; 2 * MAX_RECORD];
    let mut stream = Pair {
        tcp,
        rx: Receiver::new(direction(), buf, 0, 0, 4 * MAX_RECORD),
    };
    let mut got = Vec::new();
    let result = stream.read_to_end(&mut got).await;
    (got, result)
}

struct Pair {
    tcp: TcpStream,
    rx: Receiver,
}

impl AsyncRead for Pair {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.rx.poll_read(&mut this.tcp, cx, buf)
    }
}

#[tokio::test]
async fn a_flood_of_empty_records_is_an_error() {
    let (mut a, b) = sockets().await;
    let mut records = vec![(&b"x"[..], APPLICATION_DATA)];
    records.extend(std::iter::repeat_n((&b""[..], APPLICATION_DATA), 40));
    send(&mut a, &records).await;
    let (got, result) = read_all(b).await;
    assert_eq!(got, b"x");
    assert_eq!(
        result.expect_err("flood").kind(),
        io::ErrorKind::InvalidData
    );
}

#[tokio::test]
async fn an_empty_record_and_close_notify_of_any_level_are_accepted() {
    let (mut a, b) = sockets().await;
    // An empty record (below the limit), data, then close_notify at level 2 (fatal).
    send(
        &mut a,
        &[
            (b"", APPLICATION_DATA),
            (b"data", APPLICATION_DATA),
            (&[2, 0], ALERT),
        ],
    )
    .await;
    let (got, result) = read_all(b).await;
    assert_eq!(got, b"data");
    assert_eq!(result.expect("close_notify of level 2 ends the stream"), 4);
}

#[tokio::test]
async fn other_alerts_and_content_types_are_errors() {
    for (record, kind) in [
        ((&[2u8, 40][..], ALERT), io::ErrorKind::ConnectionAborted),
        ((&[1u8, 0, 0, 0][..], 22), io::ErrorKind::InvalidData),
    ] {
        let (mut a, b) = sockets().await;
        send(&mut a, &[(b"ok", APPLICATION_DATA), record]).await;
        let (got, result) = read_all(b).await;
        assert_eq!(got, b"ok");
        assert_eq!(result.expect_err("refused").kind(), kind);
    }
}
