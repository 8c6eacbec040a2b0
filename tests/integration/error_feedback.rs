//! Sparse top-k rounds and error feedback in the deterministic simulator: the sparse reduction
//! is the dense reduction of the decoded contributions (exact with f32 replies, within the
//! stated bound with quantized ones), every peer ends with the same values, and each peer's
//! residual keeps exactly what it did not get applied (plus, at a reducer, its quantized
//! replies' error), also when a reducer dies mid-round; over rounds the group loses nothing
//! of the replies' quantization. Plus the bytes on the wire per peer (`--nocapture` prints
//! them).

use hivemesh::allreduce::{Outcome, PartResult, TensorDescriptor};
use hivemesh::compression::feedback::ErrorFeedback;
use hivemesh::compression::{Compression, SparseTopK};
use hivemesh::sim::{self, Fault, PeerStatus, SimConfig, SimPeer};
use hivemesh::tensor::{DType, Tensor};
use proptest::prelude::*;

fn desc(shape: &[usize]) -> TensorDescriptor {
    TensorDescriptor {
        shape: shape.to_vec(),
        dtype: DType::F32,
    }
}

fn sparse_cfg(peers: Vec<SimPeer>, codec: SparseTopK, part_size_bytes: usize) -> SimConfig {
    let mut cfg = SimConfig::new(peers, 7);
    cfg.round.compression = Compression::Sparse(codec);
    cfg.round.part_size_bytes = part_size_bytes;
    cfg
}

/// Part `g`'s result for a finished peer, as f32 values.
fn result(outcome: &Outcome, start: &[Tensor], g: usize) -> Vec<f32> {
    let mut out = vec![0.0; outcome.parts[g].len];
    outcome
        .result_into(g, start, &mut out)
        .expect("a sender's part");
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Raw inputs through a sparse round: each part's result, on every peer, is the weighted
    /// mean of the contributors' *decoded* contributions (`decode(encode(x))`), computed
    /// densely here: exactly (f32 rounding) with raw f32 replies, within
    /// `max_c / 2^(reply_bits−1)` per reply chunk of 2048 with quantized ones; and all peers
    /// hold the same bits.
    #[test]
    fn sparse_reduction_is_the_dense_reduction_of_the_decoded_contributions(
        n in 2usize..6,
        weights in proptest::collection::vec(prop_oneof![Just(0.0), 0.1f64..4.0], 6),
        density in 0.005f64..0.3,
        bits in 2u8..=4,
        reply_bits in prop_oneof![Just(32u8), 2u8..=8],
        log2 in 6u32..=11,
        seed in any::<u64>(),
    ) {
        let codec = SparseTopK::new(density, bits, 1 << log2)
            .unwrap()
            .with_reply_bits(reply_bits)
            .unwrap();
        let peers: Vec<SimPeer> = (0..n)
            .map(|i| SimPeer { weight: weights[i], ..SimPeer::node() })
            .collect();
        let mut cfg = sparse_cfg(peers, codec, 8192);
        cfg.seed = seed;
        let descriptors = [desc(&[5000]), desc(&[3, 7]), desc(&[])];
        let res = sim::run(&cfg, &descriptors).unwrap();
        prop_assert_eq!(res.finished(), n);
        let parts = res.partition.parts().to_vec();
        for (g, spec) in parts.iter().enumerate() {
            let decoded: Vec<Vec<f32>> = res.peers.iter().map(|p| {
                let mut x = vec![0.0; spec.len];
                p.tensors[spec.tensor].part(spec.range()).copy_to_f32(&mut x);
                let mut y = vec![0.0; spec.len];
                codec.roundtrip(&x, &mut y);
                y
            }).collect();
            let total: f64 = weights[..n].iter().sum();
            let mut first: Option<Vec<u32>> = None;
            for p in &res.peers {
                let outcome = p.outcome.as_ref().unwrap();
                let got = result(outcome, &p.tensors, g);
                if total == 0.0 {
                    prop_assert!(outcome.report.contributors(g).is_none());
                    continue;
                }
                prop_assert!(outcome.report.contributors(g).is_some());
                let want: Vec<f64> = (0..spec.len).map(|e| decoded.iter().zip(&weights[..n])
                    .map(|(d, w)| w * f64::from(d[e])).sum::<f64>() / total).collect();
                for (c, (gs, ws)) in got.chunks(2048).zip(want.chunks(2048)).enumerate() {
                    let bound = if reply_bits == 32 {
                        0.0
                    } else {
                        let max = ws.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                        (max / f64::from(1u32 << (reply_bits - 1))).max(2f64.powi(-150))
                    };
                    for (e, (v, w)) in gs.iter().zip(ws).enumerate() {
                        prop_assert!(
                            (f64::from(*v) - w).abs() <= bound * (1.0 + 1e-5) + 1e-5 * (1.0 + w.abs()),
                            "part {} [{}]: {} vs {}, bound {}", g, c * 2048 + e, v, w, bound);
                    }
                }
                let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                match &first {
                    None => first = Some(bits),
                    Some(f) => prop_assert!(f == &bits, "peers differ on part {}", g),
                }
            }
        }
    }
}

/// Per-peer state of a multi-round error-feedback run.
struct Peer {
    feedback: ErrorFeedback,
    sum_inputs: Vec<Vec<f64>>,
    sum_applied: Vec<Vec<f64>>,
    /// The reply feedback committed (what the peer's quantized replies left out, scaled).
    sum_feedback: Vec<Vec<f64>>,
}

impl Peer {
    /// `n` peers with zero residuals and sums.
    fn group(
        n: usize,
        codec: SparseTopK,
        part_size: usize,
        descriptors: &[TensorDescriptor],
    ) -> Vec<Self> {
        let zeros: Vec<Vec<f64>> = descriptors.iter().map(|d| vec![0.0; d.numel()]).collect();
        (0..n)
            .map(|_| Self {
                feedback: ErrorFeedback::new(codec, part_size, descriptors),
                sum_inputs: zeros.clone(),
                sum_applied: zeros.clone(),
                sum_feedback: zeros.clone(),
            })
            .collect()
    }
}

impl Peer {
    /// One round of `peers` in the simulator: their fresh inputs, what error feedback prepared
    /// of them (`sent`), and the run (every peer finished).
    fn round(
        peers: &[Peer],
        cfg: &SimConfig,
        round: u64,
        descriptors: &[TensorDescriptor],
    ) -> (Vec<Vec<Tensor>>, Vec<Vec<Tensor>>, sim::SimResult) {
        let xs: Vec<Vec<Tensor>> = (0..peers.len())
            .map(|p| inputs(round, p, descriptors))
            .collect();
        let sent: Vec<Vec<Tensor>> = peers
            .iter()
            .zip(&xs)
            .map(|(p, x)| p.feedback.prepare(x).unwrap())
            .collect();
        let res = sim::run_with_tensors(cfg, sent.clone()).unwrap();
        assert_eq!(res.finished(), peers.len(), "round {round}");
        (xs, sent, res)
    }
}

/// 2-bit parts at `density` in chunks of `chunk`, replies of `reply_bits`.
fn quantized(density: f64, chunk: usize, reply_bits: u8) -> SparseTopK {
    SparseTopK::new(density, 2, chunk)
        .unwrap()
        .with_reply_bits(reply_bits)
        .unwrap()
}

fn inputs(round: u64, peer: usize, descriptors: &[TensorDescriptor]) -> Vec<Tensor> {
    sim::make_tensors(descriptors, 1000 + round, peer).unwrap()
}

/// Four peers, three rounds (3-bit replies); in the second, peer 1 reduces for three replies
/// per sender and then aborts them (a reducer that dies). After every round, for every peer:
/// `Σ applied + residual = Σ inputs + Σ reply feedback` (f32 rounding only), where `applied`
/// is what its report says a reducer averaged of it and the reply feedback what its own
/// quantized replies left out (scaled); the parts the dead reducer dropped stayed whole in the
/// residual; averages are the means of what peers sent, within the replies' bound.
#[test]
fn residuals_stay_exact_when_a_reducer_dies() {
    // 3-bit replies, coarse (at this density the union's values mostly come from one peer and
    // are exact on the reply's grid: `quantized_replies_lose_nothing_over_rounds` is where the
    // feedback is large).
    let codec = quantized(0.03, 512, 3);
    let descriptors = [desc(&[24_000]), desc(&[100])];
    // 1024 elements per part: about 6 parts per span.
    let part_size = 4096;
    let mut peers = Peer::group(4, codec, part_size, &descriptors);
    let mut dropped_parts = 0;
    for round in 0..3u64 {
        let mut sim_peers = vec![SimPeer::node(); 4];
        if round == 1 {
            sim_peers[1].fault = Some(Fault::FailReducing);
        }
        let mut cfg = sparse_cfg(sim_peers, codec, part_size);
        // Dropped parts are what this test is about: without stand-ins the dying reducer's
        // span keeps local values (with them, issue 32, it is re-reduced and nothing drops).
        cfg.round.stand_ins = false;
        let (xs, sent, res) = Peer::round(&peers, &cfg, round, &descriptors);
        // What every peer holds is the mean of what its contributors sent (`sent`), within
        // the 3-bit replies' bound (max / 2^2; the largest value sent bounds every chunk's).
        let largest = sent
            .iter()
            .flatten()
            .flat_map(|t| t.to_f32_vec())
            .fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            res.max_abs_err() <= largest / 4.0 + 1e-5,
            "round {round}: {} (largest {largest})",
            res.max_abs_err()
        );
        for (i, (peer, pr)) in peers.iter_mut().zip(res.peers).enumerate() {
            assert!(matches!(pr.status, PeerStatus::Finished(_)));
            let mut outcome = pr.outcome.unwrap();
            let before = peer.feedback.residuals().to_vec();
            let applied: Vec<bool> = outcome
                .results
                .as_ref()
                .unwrap()
                .iter()
                .map(|r| !matches!(r, PartResult::Local))
                .collect();
            for (g, spec) in outcome.parts.iter().enumerate() {
                // A part is applied exactly when the report names this peer for it.
                let named = outcome
                    .report
                    .contributors(g)
                    .is_some_and(|c| c.contains(i));
                assert_eq!(named, applied[g], "round {round} peer {i} part {g}");
                if applied[g] {
                    let y = sent[i][spec.tensor].to_f32_vec();
                    for (a, v) in peer.sum_applied[spec.tensor][spec.range()]
                        .iter_mut()
                        .zip(&y[spec.range()])
                    {
                        *a += f64::from(*v);
                    }
                } else {
                    dropped_parts += 1;
                }
            }
            for (g, e) in &outcome.reply_feedback {
                let spec = outcome.parts[*g];
                assert!(applied[*g], "feedback for a part that stayed local");
                for (a, v) in peer.sum_feedback[spec.tensor][spec.range()]
                    .iter_mut()
                    .zip(e)
                {
                    *a += f64::from(*v);
                }
            }
            peer.feedback
                .commit(&xs[i], &sent[i], &mut outcome, 1.0)
                .unwrap();
            for (t, x) in xs[i].iter().enumerate() {
                let x = x.to_f32_vec();
                for (s, v) in peer.sum_inputs[t].iter_mut().zip(&x) {
                    *s += f64::from(*v);
                }
                let r = &peer.feedback.residuals()[t];
                for e in 0..x.len() {
                    let lhs = peer.sum_applied[t][e] + f64::from(r[e]);
                    let rhs = peer.sum_inputs[t][e] + peer.sum_feedback[t][e];
                    assert!(
                        (lhs - rhs).abs() <= 1e-5 * (1.0 + rhs.abs()),
                        "round {round} peer {i} t{t}[{e}]: {lhs} vs {rhs}"
                    );
                }
            }
            // Dropped parts: the residual took the whole corrected input, and the result
            // applies nothing there (0 − input under the delta rule).
            for (g, spec) in outcome.parts.iter().enumerate() {
                if applied[g] {
                    continue;
                }
                let x = xs[i][spec.tensor].to_f32_vec();
                let r = &peer.feedback.residuals()[spec.tensor];
                for e in spec.range() {
                    assert_eq!(r[e], x[e] + before[spec.tensor][e]);
                }
                assert_eq!(result(&outcome, &xs[i], g), vec![0.0; spec.len]);
            }
        }
        if round != 1 {
            assert_eq!(dropped_parts, 0, "no fault, nothing dropped");
        }
        if round == 1 {
            assert!(dropped_parts > 0, "the dying reducer dropped parts");
        }
        dropped_parts = 0;
    }
}

/// Four peers with equal weights, five rounds of 3-bit replies (a coarse grid, so that their
/// error is large): every peer holds the same bits, and over the rounds the group loses
/// nothing: `Σ averages + mean residual = mean Σ inputs` (f32 rounding only), because each
/// reducer keeps `N ·` its replies' error in its residual. Without that reducer-side
/// feedback the identity is off by the replies' error (checked: it is large here).
#[test]
fn quantized_replies_lose_nothing_over_rounds() {
    let codec = quantized(0.05, 512, 3);
    let descriptors = [desc(&[20_000]), desc(&[100])];
    let part_size = 4096;
    let n = 4;
    let mut peers = Peer::group(n, codec, part_size, &descriptors);
    let mut sum_averages: Vec<Vec<f64>> =
        descriptors.iter().map(|d| vec![0.0; d.numel()]).collect();
    let mut reply_error = 0.0f64;
    for round in 0..5u64 {
        let cfg = sparse_cfg(vec![SimPeer::node(); n], codec, part_size);
        let (xs, sent, res) = Peer::round(&peers, &cfg, round, &descriptors);
        let outcomes: Vec<Outcome> = res.peers.into_iter().map(|p| p.outcome.unwrap()).collect();
        for (g, spec) in outcomes[0].parts.iter().enumerate() {
            let avg = result(&outcomes[0], &xs[0], g);
            for (i, o) in outcomes.iter().enumerate().skip(1) {
                let got = result(o, &xs[i], g);
                assert!(
                    got.iter()
                        .zip(&avg)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "round {round}: peer {i} differs on part {g}"
                );
            }
            for (e, (a, v)) in sum_averages[spec.tensor][spec.range()]
                .iter_mut()
                .zip(&avg)
                .enumerate()
            {
                *a += f64::from(*v);
                // What the exact mean of the sent values would have been.
                let mean: f64 = sent
                    .iter()
                    .map(|s| f64::from(s[spec.tensor].to_f32_vec()[spec.offset + e]))
                    .sum::<f64>()
                    / n as f64;
                reply_error = reply_error.max((mean - f64::from(*v)).abs());
            }
        }
        let with_feedback = outcomes
            .iter()
            .filter(|o| !o.reply_feedback.is_empty())
            .count();
        assert_eq!(
            with_feedback, n,
            "round {round}: every reducer keeps its replies' error"
        );
        for (i, mut outcome) in outcomes.into_iter().enumerate() {
            let peer = &mut peers[i];
            peer.feedback
                .commit(&xs[i], &sent[i], &mut outcome, 1.0)
                .unwrap();
            for (s, t) in peer.sum_inputs.iter_mut().zip(&xs[i]) {
                for (a, v) in s.iter_mut().zip(t.to_f32_vec()) {
                    *a += f64::from(v);
                }
            }
        }
        for (t, d) in descriptors.iter().enumerate() {
            for e in 0..d.numel() {
                let mean_residual: f64 = peers
                    .iter()
                    .map(|p| f64::from(p.feedback.residuals()[t][e]))
                    .sum::<f64>()
                    / n as f64;
                let mean_inputs: f64 =
                    peers.iter().map(|p| p.sum_inputs[t][e]).sum::<f64>() / n as f64;
                let lhs = sum_averages[t][e] + mean_residual;
                assert!(
                    (lhs - mean_inputs).abs() <= 1e-4 * (1.0 + mean_inputs.abs()),
                    "round {round} t{t}[{e}]: {lhs} vs {mean_inputs}"
                );
            }
        }
    }
    assert!(
        reply_error > 0.05,
        "the replies' error is visible: {reply_error}"
    );
}

/// A round that never finishes for a peer (it cancels) leaves its residual as it was.
#[test]
fn a_failed_round_keeps_the_residual() {
    let codec = SparseTopK::new(0.02, 2, 2048).unwrap();
    let descriptors = [desc(&[10_000])];
    let mut fb = ErrorFeedback::new(codec, 1 << 19, &descriptors);
    let x = inputs(0, 0, &descriptors);
    let sent = fb.prepare(&x).unwrap();
    let cfg = sparse_cfg(vec![SimPeer::node(); 2], codec, 1 << 19);
    let mut res = sim::run_with_tensors(&cfg, vec![sent.clone(), sent.clone()]).unwrap();
    let mut outcome = res.peers[0].outcome.take().unwrap();
    fb.commit(&x, &sent, &mut outcome, 1.0).unwrap();
    let kept = fb.residuals().to_vec();
    let mut peers = vec![SimPeer::node(); 2];
    peers[0].fault = Some(Fault::Cancel);
    let cfg = sparse_cfg(peers, codec, 1 << 19);
    let next = fb.prepare(&inputs(1, 0, &descriptors)).unwrap();
    let res = sim::run_with_tensors(&cfg, vec![next.clone(), next]).unwrap();
    assert_eq!(res.peers[0].status, PeerStatus::Cancelled);
    // No outcome, no commit: the residual is what the last finished round left.
    assert_eq!(fb.residuals(), &kept[..]);
}

/// Payload bytes each peer puts on the wire in one round, dense f32 against sparse top-k
/// (2 % density, 2 bits; replies as raw f32 and at the default 8 bits), for 4 and 8 peers
/// over 2^20 values: sparse uploads stay within the stated formula, a peer's sent bytes do not
/// grow with the group beyond the union, and 8-bit replies cost less than f32 ones.
#[test]
fn bytes_on_the_wire_per_peer() {
    let numel = 1 << 20;
    let descriptors = [desc(&[numel])];
    for n in [4usize, 8] {
        let mut per_reply_bits = Vec::new();
        for reply_bits in [32u8, 8] {
            let codec = SparseTopK::DEFAULT.with_reply_bits(reply_bits).unwrap();
            let s = sparse_bytes(n, numel, codec, &descriptors);
            per_reply_bits.push(s);
        }
        assert!(
            per_reply_bits[1] < 0.6 * per_reply_bits[0],
            "8-bit replies {} vs f32 {}",
            per_reply_bits[1],
            per_reply_bits[0]
        );
    }
}

/// One round of `n` peers, dense and with `codec`: the mean payload bytes a peer sends with
/// `codec`, checked against the formulas (and printed beside the dense bytes).
fn sparse_bytes(
    n: usize,
    numel: usize,
    codec: SparseTopK,
    descriptors: &[TensorDescriptor],
) -> f64 {
    let xs: Vec<Vec<Tensor>> = (0..n)
        .map(|p| {
            let fb = ErrorFeedback::new(codec, 1 << 19, descriptors);
            fb.prepare(&inputs(0, p, descriptors)).unwrap()
        })
        .collect();
    let mut dense = SimConfig::new(vec![SimPeer::node(); n], 3);
    dense.round.compression = Compression::default();
    let dense = sim::run_with_tensors(&dense, xs.clone()).unwrap();
    let sparse =
        sim::run_with_tensors(&sparse_cfg(vec![SimPeer::node(); n], codec, 1 << 19), xs).unwrap();
    assert_eq!(sparse.finished(), n);
    let mean = |v: &[u64]| v.iter().sum::<u64>() as f64 / v.len() as f64;
    let (d, s) = (
        mean(&dense.payload_bytes_sent),
        mean(&sparse.payload_bytes_sent),
    );
    // Dense: (n−1)/n of the values out as parts, the same back as replies.
    let dense_formula = 2.0 * (n - 1) as f64 / n as f64 * numel as f64 * 4.0;
    assert!(
        (d - dense_formula).abs() < 0.01 * dense_formula,
        "{d} vs {dense_formula}"
    );
    // Sparse: parts ≤ (n−1)/n of the codec's size bound; replies ≤ the union of n senders'
    // entries (values + positions, at most reply bits + 12 each) over its span.
    let parts = (n - 1) as f64 / n as f64 * codec.max_encoded_len(numel) as f64;
    let union = (numel as f64 / n as f64).min(n as f64 * codec.density() * numel as f64 / n as f64);
    let replies = (n - 1) as f64 * union * (f64::from(codec.reply_bits()) + 12.0) / 8.0;
    assert!(s <= 1.05 * (parts + replies), "{s} > {}", parts + replies);
    println!(
        "peers {n}: dense f32 {d:.0} B/peer/round, sparse top-k 2% 2-bit, {}-bit replies \
             {s:.0} B/peer/round ({:.1}x less; parts ≤ {parts:.0}, replies ≤ {replies:.0})",
        codec.reply_bits(),
        d / s
    );
    s
}
