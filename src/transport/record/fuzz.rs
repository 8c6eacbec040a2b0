//! The record layer under arbitrary input (the fuzz target and its corpus replay).

use super::*;

/// The record layer's receiving side under arbitrary input, for `fuzz/` and its corpus
/// replay ([`crate::fuzzing::record_layer`]).
///
/// The input is a program: each op seals a record with a fixed key (application data with
/// padding, an empty record, an alert, another content type), injects raw bytes, or corrupts
/// a byte of the last record; the rest of the input chooses the read sizes. A model of
/// RFC 8446 §5 as this layer applies it says what the reader must deliver and how the stream
/// must end; once the stream holds an injected or corrupted byte, only "a prefix of what was
/// sealed, then an error" is checked (a forgery cannot authenticate).
pub(crate) fn fuzz_record_layer(data: &[u8]) {
    /// How the model says the stream ends.
    #[derive(Debug, PartialEq)]
    enum End {
        CloseNotify,
        Error,
        Truncated,
    }

    let secrets = || ConnectionTrafficSecrets::Chacha20Poly1305 {
        key: rustls::crypto::cipher::AeadKey::from([7u8; 32]),
        iv: rustls::crypto::cipher::Iv::from([5u8; 12]),
    };
    let mut sealer = Direction::new(0, secrets()).expect("fixed key");
    let mut wire: Vec<u8> = Vec::new();
    // The wire without the corruptions (flips may cancel out: compared at the end).
    let mut pristine: Vec<u8> = Vec::new();
    let mut sealed: Vec<u8> = Vec::new(); // every application-data byte sealed, in order
    let mut model: Vec<u8> = Vec::new(); // what the reader must deliver while `clean`
    let mut model_end: Option<End> = None;
    // Raw bytes were injected before the model's stream ended.
    let mut injected = false;
    // Where the record that ends the model's stream ends: bytes after it are never read.
    let mut ended_at: Option<usize> = None;
    let mut empties = 0u32;
    let mut last_record = 0..0;
    let mut input = data.iter().copied();
    let mut next = || input.next();
    let mut seal = |wire: &mut Vec<u8>, content: &[u8], content_type: u8, padding: usize| {
        let inner = content.len() + 1 + padding;
        let head = header(inner + TAG);
        // TLSInnerPlaintext: the content, its type, zero padding; sealed as all but its last
        // byte followed by that byte (the type, or the padding's last zero).
        let mut body = content.to_vec();
        body.push(content_type);
        body.resize(inner, 0);
        let last = body.pop().expect("at least the content type");
        let nonce = sealer.next_nonce().expect("few records");
        let start = wire.len();
        wire.extend_from_slice(&head);
        wire.resize(start + HEADER + inner + TAG, 0);
        sealer
            .key
            .seal(nonce, &head, &body, last, &mut wire[start + HEADER..])
            .expect("seal");
        start..wire.len()
    };
    let mut ops = 0;
    while let Some(op) = next() {
        ops += 1;
        if ops > 64 || wire.len() > 1 << 20 {
            break;
        }
        let before_end = model_end.is_none();
        match op % 7 {
            0 | 1 => {
                // Application data: a length, a fill byte, padding.
                let len = (usize::from(next().unwrap_or(0)) << 6 | usize::from(op >> 3))
                    .min(MAX_PLAINTEXT);
                let fill = next().unwrap_or(1);
                let padding = usize::from(next().unwrap_or(0) % 4) * 7;
                let padding = padding.min(MAX_PLAINTEXT + 1 - (len + 1).min(MAX_PLAINTEXT + 1));
                let content: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
                last_record = seal(&mut wire, &content, APPLICATION_DATA, padding);
                sealed.extend_from_slice(&content);
                if before_end {
                    if content.is_empty() {
                        empties += 1;
                        if empties > MAX_EMPTY_RECORDS {
                            model_end = Some(End::Error);
                        }
                    } else {
                        empties = 0;
                        model.extend_from_slice(&content);
                    }
                }
            }
            2 => {
                // An alert: close_notify when its description is 0.
                let level = next().unwrap_or(1);
                let description = next().unwrap_or(0) % 3;
                last_record = seal(&mut wire, &[level, description], ALERT, 0);
                if before_end {
                    model_end = Some(if description == 0 {
                        End::CloseNotify
                    } else {
                        End::Error
                    });
                }
            }
            3 => {
                // Another content type (handshake, change_cipher_spec, unknown; never 0).
                let content_type = match next().unwrap_or(22) {
                    0 | APPLICATION_DATA | ALERT => 22,
                    t => t,
                };
                last_record = seal(&mut wire, b"\x01\x00\x00\x00", content_type, 0);
                if before_end {
                    model_end = Some(End::Error);
                }
            }
            4 => {
                // Raw bytes, not sealed.
                let n = usize::from(next().unwrap_or(0) % 24);
                for _ in 0..n {
                    wire.push(next().unwrap_or(0));
                }
                if n > 0 && before_end {
                    injected = true;
                }
            }
            5 => {
                // Corrupt one byte of the last record.
                let at = usize::from(next().unwrap_or(0)) << 4 | usize::from(op >> 4);
                let flip = next().unwrap_or(1).max(1);
                if !last_record.is_empty() {
                    let i = last_record.start + at % last_record.len();
                    wire[i] ^= flip;
                }
            }
            _ => {
                // A header that is not TLS 1.3 application data, or a length out of range.
                let length = if op & 0x80 == 0 {
                    MAX_CIPHERTEXT as u16
                } else {
                    3
                };
                let [hi, lo] = length.to_be_bytes();
                wire.extend_from_slice(&[APPLICATION_DATA, 3, 3, hi, lo]);
                wire.resize(wire.len() + usize::from(length), 0);
                if before_end {
                    model_end = Some(End::Error);
                }
            }
        }
        if op % 7 != 5 {
            pristine.extend_from_slice(&wire[pristine.len()..]);
        }
        if model_end.is_some() && ended_at.is_none() {
            ended_at = Some(wire.len());
        }
    }
    let read_up_to = ended_at.unwrap_or(wire.len());
    let clean = !injected && wire[..read_up_to] == pristine[..read_up_to];
    let model_end = model_end.unwrap_or(End::Truncated);

    // Read it back in chunks; the read sizes come from a generator seeded by the input.
    let seed = data.iter().fold(0x9e37_79b9_7f4a_7c15u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    // xorshift64: sizes in 1..=bound.
    let sizes = |mut state: u64| {
        state |= 1;
        move |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize + 1
        }
    };
    let mut random = sizes(seed);
    struct Chunked<'a, F> {
        wire: &'a [u8],
        sizes: F,
    }
    impl<F: FnMut(usize) -> usize + Unpin> AsyncRead for Chunked<'_, F> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            let n = (self.sizes)(3 * MAX_RECORD)
                .min(buf.remaining())
                .min(self.wire.len());
            let (now, rest) = self.wire.split_at(n);
            buf.put_slice(now);
            self.wire = rest;
            Poll::Ready(Ok(()))
        }
    }
    let mut socket = Chunked {
        wire: &wire,
        sizes: sizes(seed.rotate_left(32)),
    };
    let mut rx = Receiver::new(
        Direction::new(0, secrets()).expect("fixed key"),
        Vec::new(),
        0,
        0,
        0,
    );
    let waker = futures::task::noop_waker();
    let mut cx = Context::from_waker(&waker);
    let mut delivered = Vec::new();
    let mut out = vec![0u8; 3 * MAX_PLAINTEXT];
    let end = loop {
        let size = random(out.len());
        let mut read = ReadBuf::new(&mut out[..size]);
        match rx.poll_read(&mut socket, &mut cx, &mut read) {
            Poll::Ready(Ok(())) if read.filled().is_empty() => break End::CloseNotify,
            Poll::Ready(Ok(())) => delivered.extend_from_slice(read.filled()),
            Poll::Ready(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                break End::Truncated;
            }
            Poll::Ready(Err(_)) => break End::Error,
            Poll::Pending => unreachable!("the in-memory socket never waits"),
        }
    };
    assert!(
        sealed.starts_with(&delivered),
        "the reader delivered bytes that were never sealed"
    );
    if clean {
        assert_eq!(delivered, model, "delivered bytes differ from the model");
        assert_eq!(end, model_end, "the stream ended unlike the model");
    } else {
        assert_ne!(end, End::CloseNotify, "a tampered stream ended cleanly");
    }
}
