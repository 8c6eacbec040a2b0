//! Core data-path benchmarks: reducer accumulation against a plain memcpy of the same bytes,
//! the reducer's full per-part path, partitioning, and one simulated round.
//!
//! Run: `cargo bench --bench core`. Criterion prints throughput in GiB/s of f32 input.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use hivemesh::allreduce::{Partition, PeerSet, Reducer, TensorDescriptor};
use hivemesh::compression::Compression;
use hivemesh::sim::{self, SimConfig, SimPeer};
use hivemesh::tensor::{DType, ops};

const N: usize = 4 << 20; // 4 Mi f32 = 16 MiB

fn data(seed: u32) -> Vec<f32> {
    (0..N as u32)
        .map(|i| ((i.wrapping_mul(2654435761) ^ seed) >> 8) as f32 / (1 << 24) as f32)
        .collect()
}

fn accumulate(c: &mut Criterion) {
    let mut g = c.benchmark_group("accumulate");
    g.sample_size(20).measurement_time(Duration::from_secs(3));
    g.throughput(Throughput::Bytes((N * 4) as u64));
    let x = data(1);
    let mut acc = data(2);
    g.bench_function("memcpy_16MiB", |b| {
        b.iter(|| acc.copy_from_slice(black_box(&x)));
    });
    g.bench_function("add_scaled_16MiB", |b| {
        b.iter(|| ops::add_scaled(&mut acc, black_box(&x), 0.5));
    });
    // The reducer's exact fallback accumulates in f64: 4 B in, 16 B touched.
    let mut acc64 = vec![0.0f64; N];
    g.bench_function("add_scaled_f64_acc_16MiB", |b| {
        b.iter(|| ops::add_scaled_f64(&mut acc64, black_box(&x), 0.5));
    });
    g.bench_function("scaled_sub_16MiB", |b| {
        let mut out = vec![0.0; N];
        b.iter(|| ops::scaled_sub(&mut out, black_box(&acc), 0.5, &x));
    });
    g.bench_function("all_finite_16MiB", |b| {
        b.iter(|| black_box(ops::all_finite(black_box(&x))));
    });
    // The reducer's one-pass mean over 4 contributions: 3 received (little-endian bytes at
    // an odd offset, as in a frame) and one local, per byte of input.
    let received: Vec<Vec<u8>> = (0..3)
        .map(|k| {
            let mut b = vec![0u8; 1];
            b.extend(data(10 + k).iter().flat_map(|v| v.to_le_bytes()));
            b
        })
        .collect();
    g.throughput(Throughput::Bytes((N * 4 * 4) as u64));
    g.bench_function("weighted_mean_4x16MiB", |b| {
        let mut out = vec![0.0; N];
        b.iter(|| {
            let mut inputs = vec![(ops::Source::F32(&x), 1.0)];
            inputs.extend(received.iter().map(|r| (ops::Source::Le(&r[1..]), 1.0)));
            let mut bad = [false; 4];
            black_box(ops::weighted_mean(&inputs, 0.25, &mut out, &mut bad))
        });
    });
    // The same with 8 contributions (two passes per block), per byte of input.
    g.throughput(Throughput::Bytes((N * 4 * 8) as u64));
    g.bench_function("weighted_mean_8x16MiB", |b| {
        let mut out = vec![0.0; N];
        b.iter(|| {
            let mut inputs = vec![(ops::Source::F32(&x), 1.0), (ops::Source::F32(&acc), 1.0)];
            for r in received.iter().chain(&received) {
                inputs.push((ops::Source::Le(&r[1..]), 1.0));
            }
            inputs.truncate(8);
            let mut bad = [false; 8];
            black_box(ops::weighted_mean(&inputs, 0.125, &mut out, &mut bad))
        });
    });
    g.throughput(Throughput::Bytes((N * 4) as u64));
    g.bench_function("all_finite_le_16MiB", |b| {
        b.iter(|| black_box(ops::all_finite_le(black_box(&received[0][1..]))));
    });
    // The reducer's whole per-part path (checks, pooled buffers, completion, average),
    // 4 senders x 32 parts of 128 Ki values, per byte of sender input.
    let parts = 32;
    let len = N / parts;
    g.throughput(Throughput::Bytes((N * 4 * 4) as u64));
    g.bench_function("reducer_4_senders_16MiB_each", |b| {
        b.iter(|| {
            let mut r = Reducer::new(0..parts, vec![len; parts], PeerSet::from_indices(0..4));
            for k in 0..parts {
                for s in 0..4 {
                    let mut buf = r.take_buffer(len);
                    buf.copy_from_slice(&x[k * len..(k + 1) * len]);
                    r.accumulate(s, k, buf, 1.0).unwrap();
                }
                let done = r.poll_completed().unwrap();
                if let Some(avg) = done.average {
                    r.recycle(avg);
                }
                for (_, input) in done.inputs {
                    r.recycle_input(input);
                }
            }
        });
    });
    g.finish();
}

fn partition(c: &mut Criterion) {
    let mut g = c.benchmark_group("partition");
    let tensors: Vec<TensorDescriptor> = (0..200)
        .map(|i| TensorDescriptor {
            shape: vec![1000 + 37 * i, 64],
            dtype: DType::F32,
        })
        .collect();
    let fractions: Vec<f64> = (0..16).map(|i| 1.0 + i as f64).collect();
    for part_size in [4096usize, 1 << 19] {
        g.bench_with_input(
            BenchmarkId::new("200_tensors_16_peers", part_size),
            &part_size,
            |b, &ps| {
                b.iter(|| {
                    Partition::new(&tensors, &fractions, ps, &Compression::default()).unwrap()
                });
            },
        );
    }
    g.finish();
}

fn round(c: &mut Criterion) {
    let mut g = c.benchmark_group("sim_round");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    let peers = 4;
    let cfg = SimConfig::new(vec![SimPeer::node(); peers], 1);
    let descs = [TensorDescriptor {
        shape: vec![N],
        dtype: DType::F32,
    }];
    // Bytes of peer data averaged per round (data generation included).
    g.throughput(Throughput::Bytes((N * 4 * peers) as u64));
    g.bench_function("4_peers_16MiB", |b| {
        b.iter(|| {
            let res = sim::run(&cfg, &descs).unwrap();
            assert_eq!(res.finished(), peers);
        });
    });
    g.finish();
}

criterion_group!(benches, accumulate, partition, round);
criterion_main!(benches);
