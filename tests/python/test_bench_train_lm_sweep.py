"""``benches/train_lm_sweep.py`` simulates hivemesh's error-feedback rounds in one process: its
codec must be the averager's (checked against a real ``DecentralizedAverager`` with
``ErrorFeedbackTopK``), its outer round DiLoCo's, and its byte count the codec's layout."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

SWEEP = Path(__file__).resolve().parents[2] / "benches" / "train_lm_sweep.py"
STEP_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("train_lm_sweep", SWEEP)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_lm_sweep"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bits,reply_bits", [(2, 32), (3, 8), (2, 4)])
def test_roundtrip_and_residuals_are_the_averagers(sweep, make_dht, bits, reply_bits):
    """Two averagers, two steps: each step's average is the simulated reply of the mean of
    the simulated roundtrips of (input + residual) (the mean itself with f32 replies), and
    each residual is what the simulation keeps: its own ``z - y``, plus ``n`` times the
    reply's error on the tensors (one part each) it reduced."""
    hivemesh = pytest.importorskip("hivemesh")
    from hivemesh.compression import ErrorFeedbackTopK

    density, chunk, n = 0.05, 256, 2
    shapes = [(1000,), (4, 5)]  # a short last chunk; a tensor shorter than a chunk
    rng = np.random.default_rng(bits)
    tensors = [[np.zeros(s, dtype=np.float32) for s in shapes] for _ in range(n)]
    averagers = [hivemesh.DecentralizedAverager(
        ts, make_dht(), prefix=f"sim{bits}", target_group_size=n, min_group_size=n,
        min_matchmaking_time=2.0, request_timeout=10.0, start=True,
        compression=ErrorFeedbackTopK(density=density, bits=bits, chunk=chunk,
                                      reply_bits=reply_bits))
        for ts in tensors]
    replies = sweep.Outer([torch.zeros(s) for s in shapes], n, "topk", density, bits, chunk,
                          lr=1.0, momentum=0.0, reply_bits=reply_bits)
    residuals = [[np.zeros(s, dtype=np.float32) for s in shapes] for _ in range(n)]
    try:
        for step in range(2):
            sent = []
            for i in range(n):
                ys = []
                for k, s in enumerate(shapes):
                    # Chunk j scaled by 4^j: the chunks' steps differ by 2 octaves each, so a
                    # quantized reply of the mean (one reply chunk) is not exact (with steps
                    # that agree, 4 bits and up would be: 2 peers, 2-3 bit parts).
                    scale = 4.0 ** (np.arange(int(np.prod(s))).reshape(s) // chunk)
                    x = (rng.standard_normal(s) * scale).astype(np.float32) * (1 + 10 * k)
                    tensors[i][k][...] = x
                    z = x + residuals[i][k]
                    y = sweep.topk_roundtrip(torch.from_numpy(z), density, bits, chunk).numpy()
                    residuals[i][k] = z - y
                    ys.append(y)
                sent.append(ys)
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
            for c in controls:
                assert c.result(timeout=STEP_TIMEOUT) is not None
            means = [torch.from_numpy(sum(s[k] for s in sent) / n) for k in range(len(shapes))]
            replies.residuals = [[torch.zeros(s) for s in shapes] for _ in range(n)]
            applied = replies.replies(means, n)
            # What the simulation's reducers keep of the replies' error (n e per tensor).
            kept = [sum(r[k] for r in replies.residuals).numpy() for k in range(len(shapes))]
            for k in range(len(shapes)):
                expected = applied[k].numpy()
                assert np.count_nonzero(expected) > 0
                if reply_bits == 32:
                    assert np.array_equal(expected, means[k].numpy())
                for i in range(n):
                    np.testing.assert_allclose(tensors[i][k], expected, rtol=1e-6, atol=1e-7,
                                               err_msg=f"step {step}, peer {i}, tensor {k}")
            if reply_bits != 32:
                assert any(np.abs(kp).max() > 0 for kp in kept), "the replies' error shows"
            real = [[r.reshape(shapes[k]) for k, r in enumerate(a.error_feedback_residuals())]
                    for a in averagers]
            for k in range(len(shapes)):
                # Each tensor is one part, reduced by one of the peers: that peer's residual
                # is its z - y plus n e, the others' their z - y.
                extra = [real[i][k] - residuals[i][k] for i in range(n)]
                reducers = [i for i in range(n) if not np.allclose(extra[i], 0, atol=1e-6)]
                assert len(reducers) <= 1, (step, k, reducers)
                for i in range(n):
                    want = residuals[i][k] + (kept[k] if i in reducers else 0)
                    np.testing.assert_allclose(real[i][k], want, rtol=1e-6, atol=1e-6,
                                               err_msg=f"step {step}, peer {i}, tensor {k}")
                    residuals[i][k] = real[i][k].copy()
                if reply_bits == 32:
                    assert not reducers
                np.testing.assert_allclose(sum(extra), kept[k], rtol=1e-5, atol=1e-6)
    finally:
        for a in averagers:
            a.shutdown()


def test_roundtrip_keeps_k_per_chunk_on_a_power_of_two_grid(sweep):
    x = torch.tensor([0.1, -3.0, 0.2, 2.9, 0.7, -0.05, 1.6, 0.0] * 8)  # 64 values
    y = sweep.topk_roundtrip(x, density=12 / 64, bits=2, chunk=64)
    # The 12 largest: the eight -3.0 and the first four 2.9 (ties: lower positions first);
    # step 2 (3.0 <= 2 * 2): -3.0 -> -2 steps (half away from zero: 1.5 -> 2), 2.9 -> 1.45
    # -> 1 step.
    assert y.tolist() == [0, -4.0, 0, 2.0, 0, 0, 0, 0] * 4 + [0, -4.0, 0, 0, 0, 0, 0, 0] * 4
    # 8 bits: every kept value within step / 2 <= max / 2^(8 - 1) of its input.
    y8 = sweep.topk_roundtrip(x, density=1.0, bits=8, chunk=64)
    assert (y8 - x).abs().max() <= 3.0 / 2 ** 7
    # Values that round to 0 are dropped (2 bits: step 2, 0.7 < 1).
    y2 = sweep.topk_roundtrip(x, density=1.0, bits=2, chunk=64)
    assert set(y2.tolist()) == {0.0, -4.0, 2.0}


def test_part_bits_follow_the_layout(sweep):
    v = np.zeros(70, dtype=np.float32)  # chunks of 64 and 6
    v[[3, 10]] = 1.0
    # counts: 7 + 3 bits; chunk 0: mode 1, Rice m=2 (4 + gaps 3, 6 -> 0+1 + 2*3) = 11,
    # exponent 9, 2 values x 2 bits; chunk 1: nothing.
    assert sweep.part_bits(v, 64, 2) == 7 + 3 + 1 + 11 + 9 + 4
    assert sweep.part_bits(v, 64, 32) == 7 + 3 + 1 + 11 + 64  # raw f32: no exponent
    full = np.ones(64, dtype=np.float32)  # Rice 68 bits > bitmap 64
    assert sweep.part_bits(full, 64, 2) == 7 + 1 + 64 + 9 + 128
    assert sweep.tensor_bytes(v, 64, 2) == 10 + 5  # a header, 35 bits -> 5 bytes


def test_outer_round_is_diloco(sweep):
    torch.manual_seed(0)
    start = [torch.randn(3000), torch.randn(7, 9)]
    peers = [[p + torch.randn_like(p) for p in start] for _ in range(3)]
    fp32 = sweep.Outer(start, 3, "none", 0.01, 2, 256, lr=1.0, momentum=0.0)
    info = fp32.round(peers)
    for j in range(2):  # outer lr 1, no momentum: the outer step lands on the peers' mean
        torch.testing.assert_close(fp32.params[j], sum(p[j] for p in peers) / 3)
    assert info["bytes"] == 2 * 2 / 3 * (10 * 2 + 4 * (3000 + 63))


@pytest.mark.parametrize("reply_bits", [32, 8, 3])
def test_outer_round_keeps_what_was_not_sent(sweep, reply_bits):
    """Over 4 rounds: applied + mean residual = mean of the pseudo-gradients, also with
    quantized replies (each part's reducer keeps n times its reply's error)."""
    torch.manual_seed(0)
    start = [torch.randn(3000), torch.randn(7, 9)]
    ef = sweep.Outer(start, 3, "topk", 0.02, 2, 256, lr=1.0, momentum=0.0,
                     reply_bits=reply_bits)
    total = [torch.zeros_like(p) for p in start]
    for _ in range(4):
        before = [p.clone() for p in ef.params]
        moved = [[b - torch.randn_like(b) * 0.1 for b in before] for _ in range(3)]
        for j in range(2):
            total[j] += sum(before[j] - m[j] for m in moved) / 3
        info = ef.round(moved)
        assert 0 < info["nonzero"] <= 3 * 0.02 * 3063 * 1.5
        assert info["bytes"] < 0.1 * 2 * 2 / 3 * 4 * 3063
    for j in range(2):  # applied + mean residual = mean of all pseudo-gradients
        applied = start[j] - ef.params[j]
        mean_r = sum(r[j] for r in ef.residuals) / 3
        torch.testing.assert_close(applied + mean_r, total[j], rtol=1e-5, atol=1e-5)


def test_a_tiny_simulation_learns(sweep):
    args = sweep.parser().parse_args(
        ["--peers", "2", "--steps", "6", "--inner-steps", "3", "--dim", "32", "--layers", "1",
         "--heads", "2", "--ctx", "32", "--batch", "4", "--val-windows", "8", "--lr", "3e-3",
         "--density", "0.05", "--bits", "4", "--chunk", "256"])
    run = sweep.simulate(args, log=lambda s: None)
    assert [e["step"] for e in run["evals"]] == [0, 3, 6]
    assert run["evals"][-1]["loss"] < run["evals"][0]["loss"] - 0.1
    assert all(e["bytes"] > 0 for e in run["evals"][1:])
    text = sweep.report([run, dict(run, setting=dict(run["setting"], codec="none"))], [6])
    assert "(+0.0%)" in text, text
