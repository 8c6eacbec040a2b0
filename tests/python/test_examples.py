"""The Python examples, run as a user runs them: `examples/python/train.py` must converge
(it exits non-zero otherwise) and `bench_steps.py` must print its result line with every step
verified."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python"


def run(script: str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_train_converges_like_single_process_training():
    out = run("train.py")
    m = re.search(r"final: peers_loss=(\S+) baseline_loss=(\S+) ratio=(\S+)", out)
    assert m, out
    peers, baseline, ratio = map(float, m.groups())
    # The script checks its tolerance itself (exit code); this guards the line others read.
    assert peers > 0 and baseline > 0 and ratio == pytest.approx(peers / baseline, rel=1e-2)


def test_bench_steps_prints_its_line_with_every_step_ok():
    out = run("bench_steps.py", "--peers", "4", "--group-size", "2", "--rounds", "2",
              "--mib", "1", "--min-matchmaking-time", "1")
    m = re.search(
        r"^hivemesh_py_steps peers=4 group=2 ok=(\d+) total=(\d+) median_step_s=(\S+)$",
        out, re.M)
    assert m, out
    ok, total, median = int(m[1]), int(m[2]), float(m[3])
    assert ok == total == 8
    assert median > 0


def test_collaborative_quickstart_trains_every_peer_to_the_final_epoch():
    out = run("collaborative.py", "--peers", "2", "--epochs", "3", "--late-epoch", "1",
              "--target-batch-size", "512", "--matchmaking-time", "1")
    m = re.search(r"^final: backend=hivemesh mode=synchronous peers=(\d+) epochs=3 wall_s=\S+ "
                  r"loss=(\S+) baseline_loss=(\S+)$", out, re.M)
    assert m, out
    peers, loss, baseline = int(m[1]), float(m[2]), float(m[3])
    assert peers == 3, "two peers and the late joiner"  # the script exits 1 otherwise
    # One step per epoch on the epoch's samples, as one process would take.
    assert loss <= 1.1 * baseline, (loss, baseline)


def test_diloco_trains_every_peer_to_the_final_outer_step_in_lockstep():
    out = run("diloco.py", "--peers", "2", "--epochs", "3", "--inner-steps", "10",
              "--matchmaking-time", "0.5")
    losses = [float(x) for x in re.findall(r"^peer \d: epoch 3 loss (\S+)$", out, re.M)]
    assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], abs=2e-4), out  # lockstep
    m = re.search(r"^final: peers=2 epochs=3 inner_steps=10 codec=none outer_rounds=3 "
                  r"data_parallel_rounds=30 loss=(\S+) baseline_loss=(\S+) wall_s=\S+$", out, re.M)
    assert m, out
    # The script checks 1.5x itself (exit code); 30 data-parallel rounds against 3 outer ones.
    assert float(m[1]) <= 1.5 * float(m[2])
