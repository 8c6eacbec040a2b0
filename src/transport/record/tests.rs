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

/// An AES-128-GCM direction (the suite hivemesh peers negotiate) at sequence number `seq`,
/// on the code `code`; the same key and iv every time.
fn aes(code: AesGcm, seq: u64) -> Direction {
    Direction::from_parts(Algorithm::Aes128Gcm, &[0x5a; 16], [0x17; 12], seq, code).expect("key")
}

/// A record `plaintext` of `content_type` sealed at sequence number `seq` with `code`.
fn sealed(code: AesGcm, seq: u64, plaintext: &[u8], content_type: u8) -> Vec<u8> {
    let mut dir = aes(code, seq);
    let nonce = dir.next_nonce().expect("nonce");
    let head = header(plaintext.len() + 1 + TAG);
    let mut record = head.to_vec();
    record.resize(HEADER + plaintext.len() + 1 + TAG, 0);
    dir.key
        .seal(nonce, &head, plaintext, content_type, &mut record[HEADER..])
        .expect("seal");
    record
}

/// Opens `record` (sealed at `seq`) with `code`: the inner plaintext, or `None` when it does
/// not authenticate.
fn opened(code: AesGcm, seq: u64, record: &[u8]) -> Option<Vec<u8>> {
    let mut dir = aes(code, seq);
    let nonce = dir.next_nonce().expect("nonce");
    let (head, body) = record.split_at(HEADER);
    let (ciphertext, tag) = body.split_at(body.len() - TAG);
    let mut out = vec![0xee; ciphertext.len()];
    dir.key
        .open(nonce, head, ciphertext, tag, &mut out)
        .ok()
        .map(|()| out)
}

/// aws-lc's and ring's AES-128-GCM are one function: the same record bytes from either, each
/// opens the other's, and neither opens a record with any bit of its header (the associated
/// data), ciphertext or tag flipped, or under another sequence number.
#[test]
fn both_aes_gcm_codes_seal_the_same_records_and_open_each_others() {
    for len in [0usize, 1, 15, 16, 17, 255, 4096, 12_345, MAX_PLAINTEXT] {
        let plaintext: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        let seq = len as u64 * 3 + 1;
        let by_aws = sealed(AesGcm::AwsLc, seq, &plaintext, APPLICATION_DATA);
        let by_ring = sealed(AesGcm::Ring, seq, &plaintext, APPLICATION_DATA);
        assert_eq!(by_aws, by_ring, "{len} bytes");
        let mut inner = plaintext.clone();
        inner.push(APPLICATION_DATA);
        for code in [AesGcm::AwsLc, AesGcm::Ring] {
            assert_eq!(
                opened(code, seq, &by_aws).as_ref(),
                Some(&inner),
                "{code:?}, {len} bytes"
            );
            assert_eq!(
                opened(code, seq + 1, &by_aws),
                None,
                "{code:?}: another sequence number"
            );
            for at in [
                0,
                3,
                HEADER,
                HEADER + len / 2,
                by_aws.len() - TAG,
                by_aws.len() - 1,
            ] {
                let mut bad = by_aws.clone();
                bad[at] ^= 0x10;
                assert_eq!(
                    opened(code, seq, &bad),
                    None,
                    "{code:?}, {len} bytes, bit at {at}"
                );
            }
        }
    }
}

/// Writes `data` through `sender` as a stream's writes do, then close_notify.
async fn write_and_close(sender: &mut Sender, tcp: &mut TcpStream, data: &[u8]) {
    let mut rest = data;
    while !rest.is_empty() {
        let n = std::future::poll_fn(|cx| {
            sender.poll_write_vectored(tcp, cx, &[io::IoSlice::new(rest)])
        })
        .await
        .expect("write");
        rest = &rest[n..];
    }
    std::future::poll_fn(|cx| sender.poll_shutdown(tcp, cx))
        .await
        .expect("close");
}

/// A stream sealed with one AES-GCM code is read with the other, in reads smaller and larger
/// than a record (the staged path and the direct one), and ends at close_notify.
#[tokio::test]
async fn a_stream_sealed_by_one_aes_gcm_code_reads_with_the_other() {
    let data: Vec<u8> = (0..(3 * MAX_PLAINTEXT + 4321))
        .map(|i| (i % 251) as u8)
        .collect();
    for (send_code, read_code) in [(AesGcm::Ring, AesGcm::AwsLc), (AesGcm::AwsLc, AesGcm::Ring)] {
        for read_size in [1000, 64 * 1024] {
            let (mut a, b) = sockets().await;
            let mut sender = Sender::new(aes(send_code, 0));
            write_and_close(&mut sender, &mut a, &data).await;
            let rx = Receiver::new(
                aes(read_code, 0),
                vec![0u8; 2 * MAX_RECORD],
                0,
                0,
                4 * MAX_RECORD,
            );
            let mut stream = Pair { tcp: b, rx };
            let mut got = Vec::new();
            let mut chunk = vec![0u8; read_size];
            loop {
                let n = stream.read(&mut chunk).await.expect("read");
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&chunk[..n]);
            }
            assert!(
                got == data,
                "{send_code:?} -> {read_code:?}, reads of {read_size}"
            );
        }
    }
}

/// The HKDF of TLS_AES_128_GCM_SHA256 (SHA-256), as rustls' aws-lc-rs provider has it.
fn sha256_hkdf() -> &'static dyn Hkdf {
    rustls::crypto::aws_lc_rs::cipher_suite::TLS13_AES_128_GCM_SHA256
        .tls13()
        .expect("a TLS 1.3 suite")
        .hkdf_provider
}

/// An AES-128-GCM direction with key updates, keyed from a fixed traffic secret.
fn updating() -> Direction {
    Direction::from_secret(
        Algorithm::Aes128Gcm,
        OkmBlock::new(&[0x42; 32]),
        sha256_hkdf(),
        AesGcm::AwsLc,
    )
    .expect("key")
}

/// Reads `tcp` to its end with a receiver on `dir`.
async fn read_all_with(dir: Direction, tcp: TcpStream) -> (Vec<u8>, io::Result<usize>) {
    let mut stream = Pair {
        tcp,
        rx: Receiver::new(dir, vec![0u8; 2 * MAX_RECORD], 0, 0, 4 * MAX_RECORD),
    };
    let mut got = Vec::new();
    let result = stream.read_to_end(&mut got).await;
    (got, result)
}

/// Seals `records` (plaintext, content type) with `sender` and sends them.
async fn send_with(sender: &mut Sender, tcp: &mut TcpStream, records: &[(&[u8], u8)]) {
    for (plaintext, content_type) in records {
        sender.seal(plaintext, *content_type).expect("seal");
    }
    std::future::poll_fn(|cx| sender.poll_drain(tcp, cx))
        .await
        .expect("send");
}

/// A socket carrying `records` (plaintext, content type) sealed with [`updating`], its other
/// end closed after them (without close_notify: a reader that lets a record pass fails
/// differently instead of waiting).
async fn sealed_stream(records: &[(&[u8], u8)]) -> TcpStream {
    let (mut a, b) = sockets().await;
    let mut sender = Sender::new(updating());
    send_with(&mut sender, &mut a, records).await;
    b
}

/// The key update error inside a read error, if it is one.
fn key_update_error(e: &io::Error) -> Option<&KeyUpdateError> {
    e.get_ref().and_then(|e| e.downcast_ref::<KeyUpdateError>())
}

/// Writes go through a sender whose key updates every 4 records (limit 8): a receiver on the
/// same secret follows every update and reads every byte; the two agree on the count.
#[tokio::test]
async fn a_sender_updates_its_key_and_the_receiver_follows() {
    let data: Vec<u8> = (0..(40 * MAX_PLAINTEXT + 99))
        .map(|i| (i % 253) as u8)
        .collect();
    let (mut a, b) = sockets().await;
    let mut sender = Sender::new(updating());
    sender.set_limits(8, 4);
    let writer = async {
        write_and_close(&mut sender, &mut a, &data).await;
        sender.key_updates()
    };
    let mut rx_dir = updating();
    rx_dir.set_limit(8);
    let reader = async {
        let mut stream = Pair {
            tcp: b,
            rx: Receiver::new(rx_dir, vec![0u8; 2 * MAX_RECORD], 0, 0, 4 * MAX_RECORD),
        };
        let mut got = Vec::new();
        stream.read_to_end(&mut got).await.expect("read");
        (got, stream.rx.key_updates())
    };
    let (sent, (got, followed)) = tokio::join!(writer, reader);
    assert!(got == data);
    // 41 records at 4 per key.
    assert!(sent >= 10, "{sent} key updates");
    assert_eq!(followed, sent);
}

/// Forged and malformed key updates: each is an error of its kind after the data before it,
/// never a panic; so is a record under the old key after a KeyUpdate, and a flood of them.
#[tokio::test]
async fn forged_and_malformed_key_updates_are_errors() {
    let cases: [(&str, &[u8], Option<KeyUpdateError>); 6] = [
        (
            "update_requested 2",
            &[KEY_UPDATE, 0, 0, 1, 2],
            Some(KeyUpdateError::InvalidRequest(2)),
        ),
        (
            "short",
            &[KEY_UPDATE, 0, 0, 1],
            Some(KeyUpdateError::Malformed {
                len: 4,
                msg_type: KEY_UPDATE,
            }),
        ),
        (
            "length 2",
            &[KEY_UPDATE, 0, 0, 2, 0, 0],
            Some(KeyUpdateError::Malformed {
                len: 6,
                msg_type: KEY_UPDATE,
            }),
        ),
        (
            "two in one record",
            &[KEY_UPDATE, 0, 0, 1, 0, KEY_UPDATE, 0, 0, 1, 0],
            Some(KeyUpdateError::Malformed {
                len: 10,
                msg_type: KEY_UPDATE,
            }),
        ),
        (
            "a session ticket",
            &[4, 0, 0, 1, 0],
            Some(KeyUpdateError::Malformed {
                len: 5,
                msg_type: 4,
            }),
        ),
        (
            "empty",
            &[],
            Some(KeyUpdateError::Malformed {
                len: 0,
                msg_type: 0,
            }),
        ),
    ];
    for (name, content, expected) in cases {
        let b = sealed_stream(&[(b"ok", APPLICATION_DATA), (content, HANDSHAKE)]).await;
        let (got, result) = read_all_with(updating(), b).await;
        assert_eq!(got, b"ok", "{name}");
        let e = result.expect_err(name);
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{name}");
        assert_eq!(key_update_error(&e), expected.as_ref(), "{name}: {e}");
    }

    // A valid KeyUpdate to a receiver that did not agree to them.
    let b = sealed_stream(&[
        (b"ok", APPLICATION_DATA),
        (&[KEY_UPDATE, 0, 0, 1, 0], HANDSHAKE),
    ])
    .await;
    // The same key, without the agreement.
    let mut no_updates = updating();
    no_updates.updates = None;
    let (got, result) = read_all_with(no_updates, b).await;
    assert_eq!(got, b"ok");
    let e = result.expect_err("not agreed");
    assert_eq!(
        key_update_error(&e),
        Some(&KeyUpdateError::NotAgreed),
        "{e}"
    );

    // A KeyUpdate, then a record still under the old key: it cannot authenticate.
    let b = sealed_stream(&[
        (b"ok", APPLICATION_DATA),
        (&[KEY_UPDATE, 0, 0, 1, 0], HANDSHAKE),
        (b"old key", APPLICATION_DATA),
    ])
    .await;
    let (got, result) = read_all_with(updating(), b).await;
    assert_eq!(got, b"ok");
    let e = result.expect_err("old key");
    assert_eq!(e.kind(), io::ErrorKind::InvalidData);
    assert_eq!(key_update_error(&e), None, "{e}");

    // Key updates in a row, each under the key before it, bounded like empty records.
    let (mut a, b) = sockets().await;
    let mut sender = Sender::new(updating());
    send_with(&mut sender, &mut a, &[(b"ok", APPLICATION_DATA)]).await;
    sender.take_buffer();
    for _ in 0..MAX_EMPTY_RECORDS + 1 {
        sender.seal_key_update().expect("key update");
    }
    std::future::poll_fn(|cx| sender.poll_drain(&mut a, cx))
        .await
        .expect("send");
    drop(a);
    let (got, result) = read_all_with(updating(), b).await;
    assert_eq!(got, b"ok");
    let e = result.expect_err("a flood of key updates");
    assert!(e.to_string().contains("without content"), "{e}");
}

/// A KeyUpdate asking for ours (rustls' `refresh_traffic_keys`) is remembered for the
/// sender, once.
#[tokio::test]
async fn a_requested_key_update_is_passed_to_the_sender() {
    let (mut a, b) = sockets().await;
    let mut sender = Sender::new(updating());
    send_with(
        &mut sender,
        &mut a,
        &[(&[KEY_UPDATE, 0, 0, 1, 1], HANDSHAKE)],
    )
    .await;
    sender.dir.update().expect("next key");
    send_with(&mut sender, &mut a, &[(b"after", APPLICATION_DATA)]).await;
    drop(a);
    let mut stream = Pair {
        tcp: b,
        rx: Receiver::new(updating(), vec![0u8; 2 * MAX_RECORD], 0, 0, 4 * MAX_RECORD),
    };
    let mut got = [0u8; 5];
    stream.read_exact(&mut got).await.expect("read");
    assert_eq!(&got, b"after");
    assert!(stream.rx.take_update_request());
    assert!(!stream.rx.take_update_request());
    assert_eq!(stream.rx.key_updates(), 1);
}
