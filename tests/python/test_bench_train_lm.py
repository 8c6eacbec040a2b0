"""``benches/train_lm.py`` cannot rot: its data split, model, report arithmetic, and one tiny
configuration (DiLoCo with error-feedback top-k, two peers as threads on loopback, no network
namespaces) run here in seconds."""

import argparse
import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from polling import wait_for  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "benches" / "train_lm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_lm", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_are_sorted_split_by_file_and_skip_tests(bench, tmp_path):
    for rel in ["b.py", "a.py", "pkg/c.py", "pkg/notes.txt", "test/t.py", "pkg/tests/u.py",
                "site-packages/x.py", "idlelib/idle_test/v.py", "idlelib/w.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    root, files = bench.stdlib_files(str(tmp_path))
    assert root == str(tmp_path)
    assert files == ["a.py", "b.py", "idlelib/w.py", "pkg/c.py"]
    many = [f"f{i:02}.py" for i in range(30)]
    train, val = bench.split_files(many)
    assert val == ["f07.py", "f17.py", "f27.py"]
    assert sorted(train + val) == many and not set(train) & set(val)
    text = bench.load_text(root, ["a.py", "b.py"])
    assert bytes(text.tolist()) == b"# a.py\n\0# b.py\n"


def test_the_real_stdlib_has_a_held_out_split(bench):
    root, files = bench.stdlib_files()
    train, val = bench.split_files(files)
    assert len(files) > 100 and len(val) == len([i for i in range(len(files)) if i % 10 == 7])
    assert all("/test/" not in f and not f.startswith("test/") for f in files)


def test_model_size_and_causality(bench):
    args = bench.parser().parse_args([])
    model = bench.make_model(args)
    assert sum(p.numel() for p in model.parameters()) == 1_073_792
    small = bench.CharLM(dim=32, layers=1, heads=2, ctx=16)
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = small(x), small(y)
    assert torch.equal(a[:, :10], b[:, :10]) and not torch.equal(a[:, 10:], b[:, 10:])


def test_outer_settings_default_per_config(bench):
    args = bench.parser().parse_args([])
    assert bench.outer_settings(args, "diloco") == (0.7, 0.9)
    assert bench.outer_settings(args, "diloco_ef") == (1.0, 0.0)
    args = bench.parser().parse_args(["--outer-lr", "0.4", "--outer-momentum", "0.5"])
    assert bench.outer_settings(args, "diloco_ef") == (0.4, 0.5)
    assert bench.outer_settings(args, "diloco") == (0.4, 0.5)


def _run(evals, steps, rank=0, tx0=100, tx_end=None):
    return {"rank": rank, "steps": steps, "tx0": tx0, "evals": evals, "error": None,
            "t_end": evals[-1]["t"], "tx_end": tx_end or evals[-1]["tx"]}


def test_target_time_and_bytes_come_from_the_first_evaluation_at_the_target(bench):
    settings = {"steps": 20, "batch": 4, "peers": 2}
    ev = lambda step, t, tx, loss=None: dict(step=step, samples=step * 8, t=t, tx=tx,  # noqa
                                             **({} if loss is None else {"loss": loss}))
    dp = {"config": "dp", "rate": 0, "load": [1, 1, 1], "settings": settings, "peers": [
        _run([ev(0, 0, 100, 5.0), ev(10, 5, 1100, 2.1), ev(20, 9, 2100, 2.0)], 20),
        _run([ev(0, 0, 100), ev(10, 5, 1300), ev(20, 9, 2500)], 20, rank=1)]}
    other = {"config": "diloco_ef", "rate": 20, "load": [1, 1, 1], "settings": settings,
             "peers": [_run([ev(0, 0, 100, 5.0), ev(10, 3, 110, 2.03), ev(20, 6, 120, 2.01)], 20),
                       _run([ev(0, 0, 100), ev(10, 3, 112), ev(20, 6, 130)], 20, rank=1)]}
    target = 2.0 * 1.02
    ref = bench.summarize(dp, target)
    assert ref["loss_fixed"] == 2.0 and ref["t_target"] == 9 and ref["bytes_target"] == 2200
    s = bench.summarize(other, target)
    assert s["t_target"] == 3 and s["bytes_target"] == 11 and s["bytes"] == 25
    assert s["loss_fixed"] == 2.01 and s["samples_target"] == 80
    text = bench.table([dp, other], 0.02)
    assert "target loss: 2.0400" in text and "| 200x less |" in text, text
    # A target from the reference's loss earlier in its run (10 steps: 2.1 x 1.02).
    text = bench.table([dp, other], 0.02, target_steps=10)
    assert "target loss: 2.1420" in text and "reference bytes/peer to target: 0.001 MB" in text
    assert "| 100x less |" in text, text


def test_diloco_with_error_feedback_in_process(bench, tmp_path):
    """Two peers (threads) train the tiny model with DiLoCo and ErrorFeedbackTopK: both end
    the last outer step in lockstep (equal parameters, though they drew different batches)
    and the validation loss falls."""
    pytest.importorskip("hivemesh")
    args = bench.parser().parse_args(
        ["--peers", "2", "--steps", "6", "--inner-steps", "3", "--dim", "32", "--layers", "1",
         "--heads", "2", "--ctx", "32", "--batch", "4", "--val-windows", "8", "--lr", "3e-3",
         "--matchmaking-time", "0.5", "--density", "0.05", "--bits", "4", "--chunk", "256"])
    args = argparse.Namespace(**vars(args), config="diloco_ef", ip="127.0.0.1", iface="lo",
                              master="127.0.0.1", port=0)
    results = {}

    def peer(rank):
        results[rank] = bench.run_peer(args, rank, str(tmp_path))

    threads = [threading.Thread(target=peer, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: all((tmp_path / f"ready{r}").exists() for r in range(2)) or
             not all(t.is_alive() for t in threads), "both peers ready")
    bench.write_file(str(tmp_path / "go"), repr(__import__("time").time()))
    for t in threads:
        t.join(timeout=300)
    assert set(results) == {0, 1}, "a peer did not finish"
    for r in (0, 1):
        assert results[r]["error"] is None and results[r]["steps"] == 6
        assert results[r]["epoch"] == 2
        assert json.loads(json.dumps(results[r]))  # what the driver writes is JSON
    assert results[0]["params_sha256"] == results[1]["params_sha256"]
    losses = [e["loss"] for e in results[0]["evals"]]
    assert [e["step"] for e in results[0]["evals"]] == [0, 3, 6]
    assert losses[-1] < losses[0] - 0.1, losses
    assert os.path.exists(tmp_path / "result0.json")
