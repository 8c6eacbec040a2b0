"""ErrorFeedbackTopK through DecentralizedAverager: every peer ends each step with the same
values, the steps send only a few values, and each averager's residual carries what it did not
send into its next steps (nothing is lost)."""

import numpy as np
import pytest

import hivemesh
from hivemesh.compression import ErrorFeedbackTopK, NoCompression, SizeAdaptiveCompression

# Generous: the suite runs on a loaded 2-core CI machine; nothing here asserts speed.
STEP_TIMEOUT = 120.0


def test_error_feedback_topk_arguments():
    c = ErrorFeedbackTopK(density=0.05, bits=3, chunk=256)
    assert c == ErrorFeedbackTopK(0.05, 3, 256) != ErrorFeedbackTopK(0.05, 4, 256)
    assert "density=0.05" in repr(c) and "reply_bits=8" in repr(c)
    assert c != ErrorFeedbackTopK(0.05, 3, 256, reply_bits=32)
    assert ErrorFeedbackTopK(reply_bits=32)._spec() == "topk:0.02:2:2048:32"
    for bad in [dict(density=0.0), dict(density=1.5), dict(bits=1), dict(bits=9),
                dict(chunk=100), dict(chunk=32), dict(reply_bits=1), dict(reply_bits=9),
                dict(reply_bits=16), dict(reply_bits=8.0)]:
        with pytest.raises(ValueError):
            ErrorFeedbackTopK(**bad)
    with pytest.raises(TypeError):
        SizeAdaptiveCompression(1000, NoCompression(), c)


@pytest.mark.parametrize("reply_bits", [8, 32])
def test_error_feedback_topk_rounds(make_dht, reply_bits):
    """Identical values, sparse averages, and Σ results + mean residual = mean Σ inputs: with
    quantized replies (8 bits) that holds because each reducer keeps its replies' error."""
    rng = np.random.default_rng(0)
    n, size, density = 3, 6000, 0.05
    codec = ErrorFeedbackTopK(density=density, bits=3, chunk=256, reply_bits=reply_bits)
    shapes = [(size,), (4, 5)]
    tensors = [[np.zeros(s, dtype=np.float32) for s in shapes] for _ in range(n)]
    averagers = []
    for ts in tensors:
        averagers.append(hivemesh.DecentralizedAverager(
            ts, make_dht(), prefix=f"ef{reply_bits}", target_group_size=n, min_group_size=n,
            min_matchmaking_time=2.0, request_timeout=10.0, compression=codec, start=True))
    try:
        assert averagers[0].error_feedback_residuals()[0].shape == (size,)
        assert all(not r.any() for r in averagers[0].error_feedback_residuals())
        sum_inputs = [[np.zeros(s, dtype=np.float64) for s in shapes] for _ in range(n)]
        sum_results = [np.zeros(s, dtype=np.float64) for s in shapes]
        for step in range(4):
            # Three steps with fresh inputs, then one with none: the residuals alone go out.
            for i in range(n):
                for k, s in enumerate(shapes):
                    x = (rng.standard_normal(s).astype(np.float32) if step < 3
                         else np.zeros(s, dtype=np.float32))
                    tensors[i][k][...] = x
                    sum_inputs[i][k] += x
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
            for i, c in enumerate(controls):
                assert c.result(timeout=STEP_TIMEOUT) is not None, f"peer {i}, step {step}"
            for k in range(len(shapes)):
                for i in range(1, n):
                    assert np.array_equal(tensors[i][k], tensors[0][k]), (step, i, k)
                sum_results[k] += tensors[0][k]
            # Sparse: about n * density of the values are non-zero in the average.
            sent = np.count_nonzero(tensors[0][0])
            assert 0 < sent <= n * density * size * 1.1, (step, sent)
            residuals = [a.error_feedback_residuals() for a in averagers]
            for k in range(len(shapes)):
                # Σ results + mean residual = mean Σ inputs (the mean of what was applied
                # is what every peer holds).
                mean_residual = sum(r[k] for r in residuals).reshape(shapes[k]) / n
                mean_inputs = sum(s[k] for s in sum_inputs) / n
                np.testing.assert_allclose(sum_results[k] + mean_residual, mean_inputs,
                                           atol=1e-4, err_msg=f"step {step}, tensor {k}")
            # The residuals carry over: most of each step's input was not sent.
            assert all(np.abs(r[0]).sum() > 0.5 * np.abs(tensors[0][0]).sum() for r in residuals)
    finally:
        for a in averagers:
            a.shutdown()
