//! Encode and decode throughput of every codec on 4 Mi f32 values (16 MiB of N(0, 1) data).
//!
//! Throughput is reported against the f32 input size, so the GB/s figures of different codecs
//! compare directly. Also a sparse reducer's quantized reply (an average over the union of
//! the positions received, here a quarter of the values non-zero): encoded then decoded to get
//! its own result (`reply/encode+decode`, before session 35) beside the fused encoder that
//! writes the decoded values as it encodes (`reply/encode_decoded`). Run with
//! `cargo bench --bench compression`.

use std::hint::black_box;
use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use hivemesh::compression::CompressionType;
use hivemesh::compression::sparse::{SparseTopK, decode_sparse};
use hivemesh::tensor::{DType, PartView};

const N: usize = 4 << 20;

/// Seeded N(0, 1) values (SplitMix64 + Box–Muller).
fn randn(n: usize, mut state: u64) -> Vec<f32> {
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let r = (-2.0 * (1.0 - next()).ln()).sqrt();
        let t = std::f64::consts::TAU * next();
        v.push((r * t.cos()) as f32);
        v.push((r * t.sin()) as f32);
    }
    v.truncate(n);
    v
}

/// A benchmark group with this file's settings, its throughput counted in f32 input bytes.
fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes((N * 4) as u64));
    group
}

fn codecs(c: &mut Criterion) {
    let x = randn(N, 42);
    let mut group = group(c, "compression");
    for kind in CompressionType::ALL {
        let codec = kind.codec();
        let name = format!("{kind:?}");
        let mut payload = Vec::with_capacity(N * 4 + 4096);
        group.bench_function(format!("{name}/encode"), |b| {
            b.iter(|| {
                payload.clear();
                codec.encode(black_box(PartView::F32(&x)), &mut payload);
                black_box(payload.len())
            })
        });
        let dtype = codec.wire_dtype(DType::F32);
        let mut out = vec![0.0f32; N];
        group.bench_function(format!("{name}/decode"), |b| {
            b.iter(|| {
                codec
                    .decode(black_box(&payload), dtype, &mut out)
                    .expect("own payload decodes");
                black_box(out[N - 1])
            })
        });
    }
    group.finish();
}

fn replies(c: &mut Criterion) {
    let mut x = randn(N, 7);
    for (i, v) in x.iter_mut().enumerate() {
        if i % 4 != 0 {
            *v = 0.0;
        }
    }
    let codec = SparseTopK::DEFAULT
        .with_reply_bits(2)
        .expect("2-bit replies");
    let mut group = group(c, "sparse_reply_2bit");
    let mut payload = Vec::with_capacity(N);
    let mut decoded = vec![0.0f32; N];
    group.bench_function("reply/encode+decode", |b| {
        b.iter(|| {
            payload.clear();
            codec.encode_reply(black_box(&x), &mut payload);
            decode_sparse(&payload, DType::F32, &mut decoded).expect("own reply decodes");
            black_box(decoded[N - 1])
        })
    });
    group.bench_function("reply/encode_decoded", |b| {
        b.iter(|| {
            payload.clear();
            assert!(codec.encode_reply_decoded(black_box(&x), &mut payload, &mut decoded));
            black_box(decoded[N - 1])
        })
    });
    group.finish();
}

criterion_group!(benches, codecs, replies);
criterion_main!(benches);
