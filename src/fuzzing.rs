//! Entry points of the fuzz targets in `fuzz/` (cargo-fuzz, libFuzzer), one per decoder of
//! bytes that come from the network. Each takes arbitrary bytes and must return without
//! panicking, hanging or allocating beyond the decoder's limits; where the format has an
//! encoder, a decoded message must also survive `encode -> decode -> encode` unchanged (the
//! decoder accepts exactly what it can represent).
//!
//! The same functions replay the committed corpora (`fuzz/corpus/<target>/`) in
//! `tests/integration/fuzz_corpora.rs`, so `cargo test` keeps every input the fuzzer ever kept, crashes
//! that were fixed included (`fuzz/corpus/<target>/regression-*`).
//!
//! Not part of the library's API: hidden from the docs, and only the fuzz targets and that
//! test call it.

use std::time::{Duration, SystemTime};

use bytes::{Bytes, BytesMut};

use crate::compression::CompressionType;
use crate::dht::{DhtPolicy, DhtTime, DhtValue, ValidationLimits};
use crate::p2p::RecordPolicy as _;
use crate::tensor::DType;

/// One fuzz target's entry point.
pub type Target = fn(&[u8]);

/// The targets, by name: `fuzz/fuzz_targets/<name>.rs` calls the function of the same name,
/// and `fuzz/corpus/<name>/` holds its corpus.
pub const TARGETS: &[(&str, Target)] = &[
    ("link_frame", link_frame),
    ("round_frames", round_frames),
    ("matchmaking", matchmaking),
    ("state", state),
    ("dht_value", dht_value),
    ("dht_record", dht_record),
    ("codec", codec),
    ("sparse_codec", sparse_codec),
    ("record_layer", record_layer),
];

/// A fixed "now" for the DHT targets, so that a corpus input means the same on every run:
/// 2027-01-15, in seconds since the Unix epoch.
const NOW_SECS: f64 = 1_800_000_000.0;

/// Splits `data` into a prefix of `data[0] % modulo` bytes and the rest (after that byte).
fn split_prefix(data: &[u8], modulo: usize) -> (&[u8], &[u8]) {
    match data.split_first() {
        None => (&[], &[]),
        Some((&n, rest)) => rest.split_at((n as usize % modulo).min(rest.len())),
    }
}

/// A link frame body ([`crate::wire::decode_link_frame`]), and the same bytes read as a stream
/// of length-prefixed frames ([`crate::wire::read_link_frame`], which stops at its limit).
pub fn link_frame(data: &[u8]) {
    use crate::wire::{decode_link_frame, encode_link_frame, read_link_frame};
    if let Ok(message) = decode_link_frame(Bytes::copy_from_slice(data)) {
        let mut first = BytesMut::new();
        encode_link_frame(&message, &mut first);
        let body = strip_prefix(&first);
        let again =
            decode_link_frame(Bytes::copy_from_slice(body)).expect("an encoded link frame decodes");
        let mut second = BytesMut::new();
        encode_link_frame(&again, &mut second);
        assert_eq!(first, second, "link frame changed in a round trip");
    }
    let mut stream = data;
    for _ in 0..64 {
        if stream.is_empty() {
            break;
        }
        // A slice never waits: every read completes on the first poll.
        if futures::executor::block_on(read_link_frame(&mut stream)).is_err() {
            break;
        }
    }
}

/// The body after a length-delimited encoding's varint prefix.
fn strip_prefix(encoded: &[u8]) -> &[u8] {
    let mut rest = encoded;
    let len = prost::encoding::decode_varint(&mut rest).expect("our own prefix");
    assert_eq!(len as usize, rest.len(), "prefix and body agree");
    rest
}

/// A byte stream of round frames ([`crate::wire::FrameDecoder`]) fed in chunks whose size the
/// second byte chooses (the first chooses the frame limit); every decoded frame round-trips.
pub fn round_frames(data: &[u8]) {
    use crate::wire::{FrameDecoder, decode_frame, encode_frame};
    let [flags, chunk, stream @ ..] = data else {
        return;
    };
    let chunk = usize::from(*chunk).max(1);
    // A small frame limit too, so that the limit is reached by inputs of fuzzing size.
    let decoder = FrameDecoder::new(if flags & 1 == 1 {
        4096
    } else {
        crate::wire::DEFAULT_MAX_FRAME_BYTES
    });
    let mut buf = BytesMut::new();
    'feed: for piece in stream.chunks(chunk) {
        buf.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(frame)) => {
                    let mut first = BytesMut::new();
                    encode_frame(&frame, &mut first);
                    let again = decode_frame(Bytes::copy_from_slice(strip_prefix(&first)))
                        .expect("an encoded round frame decodes");
                    let mut second = BytesMut::new();
                    encode_frame(&again, &mut second);
                    assert_eq!(first, second, "round frame changed in a round trip");
                }
                Ok(None) => break,
                Err(_) => break 'feed,
            }
        }
    }
}

/// A matchmaking message ([`crate::matchmaking::wire::decode`]).
pub fn matchmaking(data: &[u8]) {
    use crate::matchmaking::wire::{decode, encode};
    if let Ok(message) = decode(data) {
        let first = encode(&message);
        let again = decode(&first).expect("an encoded matchmaking message decodes");
        assert_eq!(first, encode(&again), "matchmaking message changed");
    }
}

/// A state-sharing request and response ([`crate::averager::state::wire`]) and a donor's DHT
/// announcement ([`crate::averager::state::Announcement::decode`]).
pub fn state(data: &[u8]) {
    use crate::averager::state::Announcement;
    use crate::averager::state::wire::{
        decode_request, decode_response, encode_request, encode_response,
    };
    if let Ok(request) = decode_request(Bytes::copy_from_slice(data)) {
        let first = encode_request(&request);
        let again = decode_request(Bytes::from(first.clone())).expect("request decodes");
        assert_eq!(first, encode_request(&again), "state request changed");
    }
    if let Ok(response) = decode_response(Bytes::copy_from_slice(data)) {
        let first = encode_response(&response);
        let again = decode_response(Bytes::from(first.clone())).expect("response decodes");
        assert_eq!(first, encode_response(&again), "state response changed");
    }
    if let Some(announcement) = Announcement::decode(data) {
        let first = announcement.encode();
        let again = Announcement::decode(&first).expect("an announcement decodes");
        assert_eq!(first, again.encode(), "announcement changed");
    }
}

/// A DHT value as a replica answers it: decoded under the limits, validated under a key (the
/// first bytes of the input) at a fixed time, and read the way [`crate::dht::Dht::get`]
/// reads an answer.
pub fn dht_value(data: &[u8]) {
    let (key, value) = split_prefix(data, 48);
    let limits = ValidationLimits::default();
    let now = DhtTime::from_secs(NOW_SECS).expect("finite");
    if let Ok(decoded) = DhtValue::from_bytes(value, &limits) {
        let first = decoded.to_bytes();
        let again = DhtValue::from_bytes(&first, &limits).expect("an encoded value decodes");
        assert_eq!(first, again.to_bytes(), "DHT value changed in a round trip");
        let _ = decoded.validate(key, now, &limits);
    }
    if let Ok(Some(read)) = crate::dht::read_answer(key, value, now, &limits, None, None) {
        // What a reader keeps is valid by its own checks.
        read.validate(key, now, &limits)
            .expect("an answer read is valid");
    }
    let _ = crate::dht::decode_addrs(value);
}

/// A DHT write as a replica's record store receives it: the input is a key, the stored value
/// and the incoming one; a merge that is accepted must decode and validate.
pub fn dht_record(data: &[u8]) {
    let (key, rest) = split_prefix(data, 48);
    let (existing, incoming) = split_prefix(rest, 256);
    let policy = DhtPolicy::default();
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs_f64(NOW_SECS);
    let existing = (!existing.is_empty()).then_some(existing);
    if let Ok((merged, _)) = policy.merge(key, existing, incoming, None, now) {
        let limits = &policy.limits;
        let value = DhtValue::from_bytes(&merged, limits).expect("a merged value decodes");
        value
            .validate(key, DhtTime::from_secs(NOW_SECS).expect("finite"), limits)
            .expect("a merged value is valid");
    }
}

/// A part payload under every codec and element type, into outputs of several lengths; then
/// the same bytes read as elements of that type (any bits: finite, infinite, NaN) encoded by
/// the codec and decoded again (`codec_roundtrip`).
pub fn codec(data: &[u8]) {
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    let kinds = CompressionType::ALL;
    let kind = kinds[usize::from(selector) % kinds.len()];
    let dtype = [DType::F32, DType::F16, DType::BF16][usize::from(selector / 8) % 3];
    let mut out = vec![0.0f32; payload.len() + 1];
    for n in [
        0,
        1,
        payload.len() / 4,
        payload.len() / 2,
        payload.len() + 1,
    ] {
        let _ = kind.codec().decode(payload, dtype, &mut out[..n]);
    }
    codec_roundtrip(kind, dtype, payload);
}

/// `payload` read as little-endian elements of `dtype`, encoded by `kind`'s codec and decoded:
/// encoding never panics and its decode succeeds with the same count, within the codec's
/// stated bound (`crate::compression`'s table): raw values bit for bit, f16 and bf16 within
/// their relative bounds, blockwise 8-bit within `absmax · (0.9/128 + 2^-20)` per block; the
/// other 8-bit and sparse codecs give finite values. Non-finite input: the 16-bit and raw
/// codecs keep NaN as NaN; the others give finite values or [`CodecError::NonFinite`].
///
/// [`CodecError::NonFinite`]: crate::compression::CodecError::NonFinite
fn codec_roundtrip(kind: CompressionType, dtype: DType, payload: &[u8]) {
    use crate::compression::CodecError;
    use crate::tensor::PartView;
    use half::{bf16, f16};
    let words = || {
        payload
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
    };
    let (f16s, bf16s): (Vec<f16>, Vec<bf16>) = match dtype {
        DType::F16 => (words().map(f16::from_bits).collect(), Vec::new()),
        DType::BF16 => (Vec::new(), words().map(bf16::from_bits).collect()),
        DType::F32 => (Vec::new(), Vec::new()),
    };
    let f32s: Vec<f32> = match dtype {
        DType::F32 => payload
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => f16s.iter().map(|v| v.to_f32()).collect(),
        DType::BF16 => bf16s.iter().map(|v| v.to_f32()).collect(),
    };
    let view = match dtype {
        DType::F32 => PartView::F32(&f32s),
        DType::F16 => PartView::F16(&f16s),
        DType::BF16 => PartView::BF16(&bf16s),
    };
    let codec = kind.codec();
    let mut encoded = Vec::new();
    codec.encode(view, &mut encoded);
    let mut back = vec![0.0f32; f32s.len()];
    let decoded = codec.decode(&encoded, codec.wire_dtype(dtype), &mut back);
    let finite = f32s.iter().all(|v| v.is_finite());
    match kind {
        CompressionType::None | CompressionType::Float16 | CompressionType::BFloat16 => {
            decoded.expect("a 16-bit or raw encoding decodes");
            for (&a, &b) in f32s.iter().zip(&back) {
                assert_eq!(a.is_nan(), b.is_nan(), "{kind:?}: {a} -> {b}");
                if a.is_finite() {
                    let err = (f64::from(a) - f64::from(b)).abs();
                    let ok = match kind {
                        CompressionType::None => a.to_bits() == b.to_bits(),
                        CompressionType::Float16 if a.abs() > 65504.0 => b == 65504f32.copysign(a),
                        CompressionType::Float16 => {
                            err <= (f64::from(a.abs()) * 2f64.powi(-11)).max(2f64.powi(-25))
                        }
                        // Beyond bf16's largest finite value, round to nearest gives infinity.
                        _ if b.is_infinite() => {
                            b.signum() == a.signum() && a.abs() >= bf16::MAX.to_f32()
                        }
                        _ if a.abs() >= f32::MIN_POSITIVE => {
                            err <= f64::from(a.abs()) * 2f64.powi(-8)
                        }
                        _ => err <= 2f64.powi(-134),
                    };
                    assert!(ok, "{kind:?}: {a} -> {b} is outside the codec's bound");
                }
            }
        }
        _ => match decoded {
            Ok(()) => {
                assert!(
                    back.iter().all(|v| v.is_finite()),
                    "{kind:?} decoded a non-finite value"
                );
                if kind == CompressionType::Blockwise8Bit {
                    let block = crate::compression::BLOCKWISE_BLOCK;
                    for (x, d) in f32s.chunks(block).zip(back.chunks(block)) {
                        let absmax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let bound = f64::from(absmax) * (0.9 / 128.0 + 2f64.powi(-20));
                        for (&a, &b) in x.iter().zip(d) {
                            let err = (f64::from(a) - f64::from(b)).abs();
                            assert!(err <= bound, "blockwise: {a} -> {b}, absmax {absmax}");
                        }
                    }
                }
            }
            Err(CodecError::NonFinite { .. }) if !finite => {}
            Err(e) => panic!("{kind:?}: encoding {} values gave {e}", f32s.len()),
        },
    }
}

/// A [`SparseTopK`](crate::compression::SparseTopK) payload, decoded into the element count
/// its header declares (up to 2^16) and into other lengths: a decode that succeeds wrote only
/// finite values, and those survive the reply form (non-zeros as f32) exactly. The same bytes
/// read as f32 values go through the codec with parameters from the first byte: decoding what
/// it encodes succeeds, and encoding that again gives the same values (the idempotence error
/// feedback relies on).
pub fn sparse_codec(data: &[u8]) {
    use crate::compression::SparseTopK;
    use crate::compression::sparse::{REPLY_CHUNK_LOG2, decode_sparse, encode_nonzeros_f32};
    let Some((&selector, payload)) = data.split_first() else {
        return;
    };
    let declared = payload
        .get(2..10)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let declared = usize::try_from(declared.min(1 << 16)).unwrap_or(0);
    for n in [declared, declared + 1, payload.len()] {
        let mut out = vec![0.0f32; n];
        if decode_sparse(payload, DType::F32, &mut out).is_ok() {
            assert!(
                out.iter().all(|v| v.is_finite()),
                "decoded a non-finite value"
            );
            let mut reply = Vec::new();
            encode_nonzeros_f32(&out, REPLY_CHUNK_LOG2, &mut reply);
            let mut again = vec![0.0f32; n];
            decode_sparse(&reply, DType::F32, &mut again).expect("a reply decodes");
            assert_eq!(again, out, "the reply form changed values");
        }
    }
    let values: Vec<f32> = payload
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .filter(|v| v.is_finite())
        .collect();
    let density = f64::from(selector % 32 + 1) / 32.0;
    let bits = 2 + (selector / 32) % 7;
    let chunk = 64 << (selector % 3);
    let codec = SparseTopK::new(density, bits, chunk).expect("valid parameters");
    let mut once = vec![0.0f32; values.len()];
    codec.roundtrip(&values, &mut once);
    assert!(
        once.iter().all(|v| v.is_finite()),
        "finite input, finite output"
    );
    let mut twice = vec![0.0f32; values.len()];
    codec.roundtrip(&once, &mut twice);
    assert_eq!(
        once.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        twice.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "encoding decoded values changed them"
    );
    // A quantized reply of the values (as a reducer sends its average): it decodes, and every
    // value is within max_c / 2^(bits−1) of the input (2^−150 at the subnormal floor).
    let replier = codec.with_reply_bits(bits).expect("valid reply bits");
    let mut reply = Vec::new();
    replier.encode_reply(&values, &mut reply);
    let mut replied = vec![0.0f32; values.len()];
    decode_sparse(&reply, DType::F32, &mut replied).expect("a quantized reply decodes");
    let reply_chunk = 1usize << REPLY_CHUNK_LOG2;
    for (xs, ys) in values.chunks(reply_chunk).zip(replied.chunks(reply_chunk)) {
        let max = xs.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let bound = (max / f64::from(1u32 << (bits - 1))).max(2f64.powi(-150));
        for (x, y) in xs.iter().zip(ys) {
            assert!(
                (f64::from(*x) - f64::from(*y)).abs() <= bound * (1.0 + 1e-9),
                "reply value {y} for {x}, bound {bound}"
            );
        }
    }
}

/// The TLS record layer's receiving side ([`crate::transport`]'s record layer) over a stream
/// the input describes (sealed records, alerts, injected and corrupted bytes), read in
/// chunks the input chooses; what it delivers is checked against a model.
pub fn record_layer(data: &[u8]) {
    crate::transport::fuzz_record_layer(data);
}

/// Hand-made seeds for the targets, `(target, input)`: well-formed messages of every kind that
/// a fuzzer could not easily find alone (signed DHT writes above all). `fuzz/seed.sh` writes
/// them into the corpora; the corpus replay test runs them too.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use crate::allreduce::{AbortReason, AveragedMessage, Message, PartMessage, PeerSet, Role};
    use crate::averager::state::Announcement;
    use crate::averager::state::wire::{Request, encode_request};
    use crate::wire::{Frame, Hello, LinkMessage, encode_frame, encode_link_frame};

    let keypair = libp2p::identity::Keypair::ed25519_from_bytes([7u8; 32]).expect("32 bytes");
    let peer = keypair.public().to_peer_id();
    let mut seeds = Vec::new();

    for message in [
        LinkMessage::Hello(Hello {
            group_id: Bytes::from_static(b"group-1"),
            from_index: 2,
            from_peer: peer,
        }),
        LinkMessage::Ack,
        LinkMessage::GiveUp(Hello {
            group_id: Bytes::from_static(b"group-1"),
            from_index: 1,
            from_peer: peer,
        }),
        LinkMessage::Census(Some(
            crate::links::census::sign(&keypair, b"group-1", 1, &[0, 2])
                .expect("an Ed25519 key signs"),
        )),
        LinkMessage::Census(None),
    ] {
        let mut frame = BytesMut::new();
        encode_link_frame(&message, &mut frame);
        seeds.push(("link_frame", strip_prefix(&frame).to_vec()));
    }

    let group = Bytes::from_static(b"group-1");
    let mut stream = BytesMut::from(&[0u8, 7][..]);
    for message in [
        Message::Part(PartMessage {
            part: 3,
            weight: 1.0,
            codec: CompressionType::None,
            dtype: DType::F32,
            payload: Bytes::from(1.5f32.to_le_bytes().repeat(4)),
        }),
        Message::Averaged(AveragedMessage {
            part: 0,
            codec: CompressionType::Uniform8Bit,
            dtype: DType::F16,
            contributors: PeerSet::from_indices([0, 1, 5]),
            payload: Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8, 9]),
            finite: None,
        }),
        Message::Abort {
            role: Role::Reducer,
            reason: AbortReason::Banned,
        },
        Message::Notice {
            failed: PeerSet::from_indices([1, 3]),
        },
    ] {
        encode_frame(
            &Frame {
                group_id: group.clone(),
                message,
            },
            &mut stream,
        );
    }
    seeds.push(("round_frames", stream.to_vec()));

    seeds.push((
        "matchmaking",
        crate::matchmaking::wire::encode(&crate::matchmaking::Message::Leave { request_id: 42 }),
    ));

    for request in [
        Request::Metadata,
        Request::Chunk {
            session: Bytes::from_static(&[9; 16]),
            index: 3,
        },
        Request::Release {
            session: Bytes::from_static(&[9; 16]),
        },
    ] {
        seeds.push(("state", encode_request(&request)));
    }
    seeds.push((
        "state",
        Announcement::Sharing {
            priority: 2.5,
            addrs: vec!["/ip4/10.0.0.1/tcp/4001".parse().expect("multiaddr")],
        }
        .encode(),
    ));

    let key = b"run.0b1";
    let expiration = DhtTime::from_secs(NOW_SECS + 60.0).expect("finite");
    let owned = DhtValue::owned(
        key,
        &keypair,
        Bytes::from_static(b"\x01contact"),
        expiration,
    )
    .expect("ed25519 keys embed in their peer id");
    let mut with_key = vec![key.len() as u8];
    with_key.extend_from_slice(key);
    for value in [
        owned.clone(),
        DhtValue::plain(Bytes::from_static(b"plain"), expiration),
        DhtValue::subkey(
            Bytes::from_static(b"sub"),
            Bytes::from_static(b"v"),
            expiration,
        ),
    ] {
        let mut input = with_key.clone();
        input.extend_from_slice(&value.to_bytes());
        seeds.push(("dht_value", input.clone()));
        // dht_record: key, an empty stored value (length 0), the incoming value.
        let mut record = with_key.clone();
        record.push(0);
        record.extend_from_slice(&value.to_bytes());
        seeds.push(("dht_record", record));
    }

    for selector in 0..7u8 {
        let mut input = vec![selector];
        input.extend(1.25f32.to_le_bytes().repeat(8));
        seeds.push(("codec", input));
    }
    // Sparse payloads of a few shapes (quantized at 2 and 8 bits, a dense chunk, a reply).
    for (density, bits, chunk, n) in [(0.05, 2, 64, 300), (0.5, 8, 128, 200), (1.0, 4, 64, 64)] {
        let codec = crate::compression::SparseTopK::new(density, bits, chunk).expect("valid");
        let values: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut input = vec![7u8];
        codec.encode_f32(&values, &mut input);
        seeds.push(("sparse_codec", input));
    }
    let mut reply = vec![3u8];
    crate::compression::sparse::encode_nonzeros_f32(
        &[0.0, 1.5, 0.0, -2.0, 0.0, 0.0],
        6,
        &mut reply,
    );
    seeds.push(("sparse_codec", reply));
    // A quantized reply (8 bits, chunks of 2048, a short last chunk).
    let mut reply = vec![5u8];
    let average: Vec<f32> = (0..2100)
        .map(|i| {
            if i % 3 == 0 {
                (i as f32 - 1000.0) / 9.0
            } else {
                0.0
            }
        })
        .collect();
    crate::compression::SparseTopK::DEFAULT
        .with_reply_bits(8)
        .expect("valid")
        .encode_reply(&average, &mut reply);
    seeds.push(("sparse_codec", reply));

    // Data, an empty record, data with padding, close_notify; then a corrupted variant.
    seeds.push((
        "record_layer",
        vec![0, 3, 65, 1, 7, 0, 0, 1, 9, 16, 66, 2, 2, 1, 0],
    ));
    seeds.push(("record_layer", vec![8, 1, 65, 0, 5, 3, 9, 2, 1, 0]));
    seeds
}
