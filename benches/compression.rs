//! Encode and decode throughput of every codec on 4 Mi f32 values (16 MiB of N(0, 1) data).
//!
//! Throughput is reported against the f32 input size, so the GB/s figures of different codecs
//! compare directly. Run with `cargo bench --bench compression`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hivemesh::compression::CompressionType;
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

fn codecs(c: &mut Criterion) {
    let x = randn(N, 42);
    let mut group = c.benchmark_group("compression");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes((N * 4) as u64));
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

criterion_group!(benches, codecs);
criterion_main!(benches);
