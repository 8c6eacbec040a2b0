"""hivemind's test_averaging.py scenarios through hivemesh's Python API, plus what the
bindings promise: shared tensors, the GIL released during a step, Ctrl-C, bad arguments."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import hivemesh
from polling import wait_for
from hivemesh.compression import (
    BFloat16Compression,
    BlockwiseQuantization,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)

if os.environ.get("HIVEMESH_GPU_REQUIRED"):
    # A GPU run needs torch: without it, this file must fail (the CUDA test with it), never
    # be skipped as a whole by importorskip.
    import torch
else:
    torch = pytest.importorskip("torch")

# Generous: the suite runs on a loaded 2-core CI machine; nothing here asserts speed.
STEP_TIMEOUT = 120.0


def averagers_for(make_dht, tensors_per_peer, modes=None, **kwargs):
    """One DHT and averager per peer (mode "node", "client" or "aux"), all in one group."""
    modes = modes or ["node"] * len(tensors_per_peer)
    out = []
    for tensors, mode in zip(tensors_per_peer, modes):
        dht = make_dht()
        args = dict(prefix="mygroup", target_group_size=len(tensors_per_peer),
                    min_group_size=len(tensors_per_peer), min_matchmaking_time=2.0,
                    request_timeout=10.0)
        args.update(kwargs)
        out.append(hivemesh.DecentralizedAverager(
            tensors, dht, client_mode=(mode == "client"), auxiliary=(mode == "aux"),
            start=True, **args))
    return out


def shutdown(averagers):
    for a in averagers:
        a.shutdown()


@pytest.mark.parametrize("n_clients,n_aux", [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (0, 2)])
def test_allreduce_once(make_dht, n_clients, n_aux):
    torch.manual_seed(0)
    n_peers = 4
    modes = ["client"] * n_clients + ["aux"] * n_aux
    modes += ["node"] * (n_peers - len(modes))
    tensors = [[torch.randn(3), torch.randn(5, 7), torch.randn(2, 2)] for _ in range(n_peers)]
    originals = [[t.clone() for t in ts] for ts in tensors]
    senders = [i for i, m in enumerate(modes) if m != "aux"]
    reference = [sum(originals[i][k] for i in senders) / len(senders) for k in range(3)]
    averagers = averagers_for(make_dht, tensors, modes)
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        results = [c.result(timeout=STEP_TIMEOUT) for c in controls]
        for i, (a, result) in enumerate(zip(averagers, results)):
            assert result is not None, f"peer {i} ({modes[i]}) found no group"
            assert set(result) == {b.peer_id for b in averagers}, f"peer {i}"
            assert a.mode.name.lower() == modes[i]
        # A finished step answers a zero timeout with its result, every time (the wait used
        # to race its own first poll and raise TimeoutError).
        for c, result in zip(controls, results):
            assert c.done()
            for _ in range(50):
                assert c.result(timeout=0) == result
        for i, mode in enumerate(modes):
            for k in range(3):
                if mode == "aux":
                    assert torch.equal(tensors[i][k], originals[i][k]), "aux keeps its tensors"
                else:
                    assert torch.allclose(tensors[i][k], reference[k], atol=1e-5), (i, k)
    finally:
        shutdown(averagers)


def test_allreduce_weighted_numpy(make_dht):
    rng = np.random.default_rng(1)
    weights = [0.5, 1.0, 2.0, 4.0]
    tensors = [[rng.standard_normal((17,)).astype(np.float32)] for _ in weights]
    originals = [t[0].copy() for t in tensors]
    reference = sum(w * x for w, x in zip(weights, originals)) / sum(weights)
    averagers = averagers_for(make_dht, tensors)
    try:
        controls = [a.step(wait=False, weight=w, timeout=STEP_TIMEOUT)
                    for a, w in zip(averagers, weights)]
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        for i, ts in enumerate(tensors):
            np.testing.assert_allclose(ts[0], reference, rtol=1e-5, atol=1e-5, err_msg=str(i))
    finally:
        shutdown(averagers)


def test_gather_and_half_precision(make_dht):
    """gather data reaches every member; float16/bfloat16 tensors average within their
    precision, with a lossy codec on the wire."""
    torch.manual_seed(2)
    tensors = [[torch.randn(64).half(), torch.randn(8, 8).bfloat16()] for _ in range(3)]
    reference = [sum(ts[k].float() for ts in tensors) / 3 for k in range(2)]
    averagers = averagers_for(make_dht, tensors, compression=Float16Compression())
    try:
        controls = [a.step(wait=False, gather=dict(batch_size=123 + i, foo="bar"),
                           timeout=STEP_TIMEOUT)
                    for i, a in enumerate(averagers)]
        for c in controls:
            gathered = c.result(timeout=STEP_TIMEOUT)
            assert len(gathered) == 3
            for i, a in enumerate(averagers):
                assert gathered[a.peer_id] == dict(batch_size=123 + i, foo="bar")
        for ts in tensors:
            assert ts[0].dtype == torch.float16 and ts[1].dtype == torch.bfloat16
            assert torch.allclose(ts[0].float(), reference[0], atol=1e-2)
            assert torch.allclose(ts[1].float(), reference[1], atol=5e-2)
    finally:
        shutdown(averagers)


# Each codec's stated bound (src/compression.rs): relative for the float codecs (of the largest
# input magnitude here), a mean squared error for the 8-bit ones on N(0, 1) inputs. A peer's
# result carries its own codec error and that of the group's encoded parts: at most 3 codings.
CODEC_BOUNDS = {
    "none": (NoCompression(), "max", 2.0 ** -20),  # float32 rounding of the delta rule
    "float16": (Float16Compression(), "max", 3 * 2.0 ** -11),
    "bfloat16": (BFloat16Compression(), "max", 3 * 2.0 ** -8),
    "uniform8": (Uniform8BitQuantization(), "mse", 3 * 8e-4),
    "quantile8": (Quantile8BitQuantization(), "mse", 3 * 8e-4),
    "blockwise8": (BlockwiseQuantization(), "mse", 3 * 8e-4),
}


@pytest.mark.parametrize("name", list(CODEC_BOUNDS))
def test_every_codec_crosses_real_links_within_its_bound(make_dht, name):
    """Each codec (hivemind's codes 0, 2-6) over real links between two peers: every peer ends
    within the codec's bound of the exact mean, and a lossy codec really ran (further from it
    than float32's rounding)."""
    codec, kind, bound = CODEC_BOUNDS[name]
    torch.manual_seed(11)
    tensors = [[torch.randn(8192)] for _ in range(2)]
    exact = (tensors[0][0] + tensors[1][0]).double() / 2
    scale = max(t[0].abs().max().item() for t in tensors)
    averagers = averagers_for(make_dht, tensors, compression=codec, prefix=f"codec_{name}")
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        for i, ts in enumerate(tensors):
            err = ts[0].double() - exact
            if kind == "max":
                assert err.abs().max().item() <= bound * scale + 1e-7, (i, err.abs().max())
            else:
                assert (err ** 2).mean().item() <= bound, (i, (err ** 2).mean())
            if name != "none":
                # Beyond float32's rounding (2^-23 of the scale): the values went through
                # the codec.
                assert err.abs().max().item() > 1e-5 * scale, f"{name} did not run for peer {i}"
    finally:
        shutdown(averagers)


def test_tensors_are_shared_not_copied(make_dht):
    ours = [torch.zeros(10), torch.full((4,), 2.0)]
    theirs = [torch.ones(10), torch.full((4,), 4.0)]
    averagers = averagers_for(make_dht, [ours, theirs])
    ptrs = [t.data_ptr() for t in ours]
    try:
        with averagers[0].get_tensors() as locked:
            assert locked is averagers[0]._tensors
            assert all(a is b for a, b in zip(locked, ours))
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        assert torch.equal(ours[0], torch.full((10,), 0.5))
        assert torch.equal(ours[1], torch.full((4,), 3.0))
        assert [t.data_ptr() for t in ours] == ptrs
        with averagers[0].get_tensors() as locked:
            assert torch.equal(locked[0], torch.full((10,), 0.5))
    finally:
        shutdown(averagers)


def test_trigger_holds_the_allreduce(make_dht):
    tensors = [[torch.full((5,), float(i))] for i in range(2)]
    averagers = averagers_for(make_dht, tensors)
    stage = hivemesh.AveragingStage
    try:
        controls = [a.step(wait=False, require_trigger=True, timeout=STEP_TIMEOUT)
                    for a in averagers]
        # Matchmaking ends; without a trigger no step goes past it.
        wait_for(lambda: all(c.stage == stage.AWAITING_TRIGGER for c in controls),
                  "both steps to await their triggers")
        controls[0].trigger()
        # The first peer's all-reduce begins and cannot end: the second peer holds the round.
        wait_for(lambda: controls[0].stage == stage.RUNNING_ALLREDUCE, "the first all-reduce")
        assert controls[1].stage == stage.AWAITING_TRIGGER
        assert not controls[0].done() and not controls[1].done()
        for i, ts in enumerate(tensors):
            assert torch.equal(ts[0], torch.full((5,), float(i)))
        controls[1].trigger()
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        for ts in tensors:
            assert torch.equal(ts[0], torch.full((5,), 0.5))
    finally:
        shutdown(averagers)


def test_cancel_leaves_the_tensors(make_dht):
    t = torch.arange(6, dtype=torch.float32)
    (averager,) = averagers_for(make_dht, [[t]], min_group_size=2, target_group_size=2)
    try:
        control = averager.step(wait=False)
        assert control.cancel()
        with pytest.raises(concurrent.futures.CancelledError):
            control.result(timeout=STEP_TIMEOUT)
        assert control.done() and control.cancelled()
        assert not control.cancel(), "a finished step cannot be cancelled"
        assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    finally:
        averager.shutdown()


def test_too_few_peers_return_none(make_dht):
    t = torch.ones(3)
    (averager,) = averagers_for(make_dht, [[t]], min_group_size=2, target_group_size=2,
                                min_matchmaking_time=0.5)
    try:
        assert averager.step(timeout=3.0) is None
        assert torch.equal(t, torch.ones(3))
    finally:
        averager.shutdown()


def _runs_inside(call):
    """Whether another Python thread runs while ``call()`` is inside native code.

    With a switch interval far longer than the test, the main thread keeps the GIL until it
    gives it up itself: a thread woken just before ``call()`` can run before ``call()``
    returns only if ``call()`` releases the GIL. The thread records whether the main thread
    was still inside ``call()`` when it first ran, then ends (releasing the GIL)."""
    inside = [False]
    saw = []
    go = threading.Event()

    def observe():
        go.wait()
        saw.append(inside[0])

    thread = threading.Thread(target=observe)
    thread.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        go.set()  # the observer is runnable from here on, but the GIL stays with this thread
        inside[0] = True
        call()
        inside[0] = False
    finally:
        sys.setswitchinterval(interval)
        thread.join(timeout=60)
    assert saw, "the observer never ran"
    return saw[0]


def test_the_gil_is_released_during_a_step(make_dht):
    """Python threads run while step() waits (here: for peers that never come), through the
    blocking call and through a control's result()."""
    t = torch.ones(3)
    (averager,) = averagers_for(make_dht, [[t]], min_group_size=2, target_group_size=2,
                                min_matchmaking_time=0.5)
    try:
        assert _runs_inside(lambda: averager.step(timeout=3.0)), \
            "no Python thread ran while the blocking step() waited"
        control = averager.step(wait=False, timeout=3.0)
        assert _runs_inside(lambda: control.result(timeout=STEP_TIMEOUT)), \
            "no Python thread ran while result() waited"
        assert control.done()
    finally:
        averager.shutdown()


def test_load_state_from_peers(make_dht):
    donor_tensors = [torch.randn(3), torch.arange(5, dtype=torch.float32),
                     torch.randn(2, 2).bfloat16()]
    newcomer_tensors = [torch.zeros(3), torch.zeros(5), torch.zeros(2, 2).bfloat16()]
    donor, newcomer = averagers_for(make_dht, [donor_tensors, newcomer_tensors],
                                    prefix="demo-run")
    try:
        assert donor.state_metadata is None
        donor.state_metadata = {"epoch": 7, "lr": 0.25, "tags": ["a", "b"]}
        future = newcomer.load_state_from_peers(wait=False, timeout=STEP_TIMEOUT)
        assert isinstance(future, concurrent.futures.Future)
        got = future.result(timeout=STEP_TIMEOUT)
        assert got is not None
        metadata, tensors = got
        assert metadata == {"epoch": 7, "lr": 0.25, "tags": ["a", "b"]}
        assert [t.dtype for t in tensors] == [t.dtype for t in donor_tensors]
        assert all(torch.equal(a, b) for a, b in zip(tensors, donor_tensors))
        assert all(torch.equal(t, torch.zeros_like(t)) for t in newcomer_tensors), \
            "load_state_from_peers returns the state; it does not overwrite the tensors"
        donor.state_metadata = b"epoch=7"
        assert donor.state_metadata == b"epoch=7"
        metadata, _ = newcomer.load_state_from_peers(timeout=STEP_TIMEOUT)
        assert metadata == b"epoch=7"
        with pytest.raises(ValueError, match="timeout"):
            newcomer.load_state_from_peers(timeout=0)
        with pytest.raises(TypeError, match="state_metadata"):
            donor.state_metadata = {"not json": object()}
        donor.allow_state_sharing = False
        newcomer.allow_state_sharing = False
        assert newcomer.load_state_from_peers() is None
    finally:
        shutdown([donor, newcomer])


def test_load_state_trusts_what_the_caller_says(make_dht):
    donor_tensors = [torch.randn(4)]
    donor = hivemesh.DecentralizedAverager(donor_tensors, make_dht(), prefix="trust-run",
                                           start=True)
    stranger = make_dht().peer_id
    newcomers = []
    try:
        def newcomer(**kwargs):
            a = hivemesh.DecentralizedAverager(
                [torch.zeros(4)], make_dht(), prefix="trust-run", start=True,
                allow_state_sharing=False, **kwargs)
            newcomers.append(a)
            return a

        trusting = newcomer(state_trusted_peers=[donor.peer_id])
        metadata, tensors = trusting.load_state_from_peers(timeout=STEP_TIMEOUT)
        assert torch.equal(tensors[0], donor_tensors[0])
        # A donor outside the allowlist is never asked.
        assert newcomer(state_trusted_peers=[stranger]).load_state_from_peers(
            timeout=STEP_TIMEOUT) is None
        # One donor cannot confirm its own state.
        with pytest.raises(hivemesh.StateError, match="1 donor.*2 required"):
            newcomer(state_min_agreeing=2).load_state_from_peers(timeout=STEP_TIMEOUT)
        with pytest.raises(ValueError, match="state_trusted_peers"):
            newcomer(state_trusted_peers=["not a peer id"])
        with pytest.raises(ValueError, match="state_min_agreeing"):
            newcomer(state_min_agreeing=0)
    finally:
        shutdown(newcomers + [donor])


@pytest.mark.parametrize(
    "tensor,error",
    [
        (lambda: torch.ones(4, 4).t(), "not contiguous"),
        (lambda: torch.ones(3, dtype=torch.int64), "dtype"),
        (lambda: np.ones((4, 4), dtype=np.float32)[:, ::2], "not C-contiguous"),
        (lambda: np.ones(3, dtype=np.float64), "dtype"),
        (lambda: [1.0, 2.0], "torch.Tensor or numpy.ndarray"),
        # A device other than the CPU and CUDA is refused, naming what can be averaged.
        (lambda: torch.ones(3, device="meta"), "a meta tensor; only CPU"),
    ],
)
def test_bad_tensors_are_refused(make_dht, tensor, error):
    dht = make_dht()
    with pytest.raises(TypeError, match=error):
        hivemesh.DecentralizedAverager([tensor()], dht, prefix="bad", start=True)


def test_bad_arguments_are_refused(make_dht):
    dht = make_dht()
    t = [torch.ones(2)]
    with pytest.raises(ValueError):
        hivemesh.DecentralizedAverager(t, dht, prefix="", start=True)
    with pytest.raises(ValueError):
        hivemesh.DecentralizedAverager(t, dht, prefix="x", target_group_size=1)
    with pytest.raises(ValueError):
        hivemesh.DecentralizedAverager(t, dht, prefix="x", initial_group_bits="012")
    with pytest.raises(TypeError):
        hivemesh.DecentralizedAverager(t, dht, prefix="x", no_such_argument=1)
    with pytest.raises(ValueError):
        hivemesh.DecentralizedAverager(t, dht, prefix="x", request_timeout=-1.0)
    with pytest.raises(ValueError):
        hivemesh.DecentralizedAverager([], dht, prefix="x")
    with pytest.raises(TypeError):
        hivemesh.DecentralizedAverager(t, dht, prefix="x", compression="fp16")
    averager = hivemesh.DecentralizedAverager(t, dht, prefix="x", start=True)
    try:
        with pytest.raises(TypeError):
            averager.step(gather=object())
        with pytest.raises(ValueError):
            averager.step(weight=-1.0)
    finally:
        averager.shutdown()


CTRL_C_CHILD = textwrap.dedent(
    """
    import signal, sys, torch, hivemesh
    # A test run started in the background (`pytest ... &` from a script) ignores SIGINT, the
    # child inherits that, and Python then installs no KeyboardInterrupt handler: Ctrl-C as a
    # terminal sends it needs the default handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dht = hivemesh.DHT(initial_peers=sys.argv[1:], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    t = torch.arange(4, dtype=torch.float32)
    averager = hivemesh.DecentralizedAverager([t], dht, prefix="alone", min_group_size=2,
                                              target_group_size=2, start=True)
    try:
        # Inside the try: the parent's SIGINT may land as soon as this line is out.
        print("stepping", flush=True)
        averager.step()  # nobody else: waits until interrupted
        print("step returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted", "unchanged" if torch.equal(t, torch.arange(4.0)) else "changed",
              flush=True)
    averager.shutdown()
    dht.shutdown()
    """
)


def test_ctrl_c_interrupts_a_step(bootstrap):
    child = subprocess.Popen([sys.executable, "-c", CTRL_C_CHILD, *bootstrap],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "stepping"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=STEP_TIMEOUT)
    finally:
        child.kill()
    assert out.strip() == "interrupted unchanged", err
    assert child.returncode == 0, err


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_forked_child_cannot_use_the_parents_dht_but_the_parent_can(make_dht):
    dht = make_dht()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what happened through the pipe, then leave at once
        try:
            try:
                dht.get("key")
                verdict = b"used"
            except hivemesh.ShutdownError:
                child = hivemesh.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                verdict = b"refused, own dht " + child.peer_id.to_base58().encode()
                child.shutdown()
            os.write(w, verdict)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as pipe:
        verdict = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert verdict.startswith(b"refused, own dht "), verdict
    assert dht.store("key", b"value", hivemesh.get_dht_time() + 60)
    assert dht.get("key").value == b"value"


def test_centered_clip_resists_a_huge_peer(make_dht):
    """One of four peers sends 1e6 everywhere (finite: nobody bans it). With
    ``centered_clip_tau`` every honest peer ends within tau * 1/3 (the bound at CenteredClip's
    fixed point) of the honest peers' mean; the mean itself would be pulled by 250000."""
    torch.manual_seed(3)
    tensors = [[torch.randn(16) + i * 0.1] for i in range(3)] + [[torch.full((16,), 1e6)]]
    honest_mean = sum(t[0].clone() for t in tensors[:3]) / 3
    tau = 20.0
    averagers = averagers_for(make_dht, tensors, centered_clip_tau=tau)
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        # The honest peers end with the same aggregate (their inputs differ by 0.1 and more: a
        # step that averaged nothing fails here), within the bound of the honest mean. (The
        # huge peer gets it too, up to float32's resolution at 1e6: it adds the change to 1e6.)
        for i in range(1, 3):
            assert torch.allclose(tensors[i][0], tensors[0][0], rtol=0, atol=1e-5), i
        for i in range(3):
            distance = torch.linalg.vector_norm(tensors[i][0] - honest_mean).item()
            assert distance <= tau / 3 * 1.01, (i, distance)
    finally:
        shutdown(averagers)
    with pytest.raises(ValueError, match="centered_clip_tau"):
        averagers_for(make_dht, [[torch.zeros(2)], [torch.zeros(2)]], centered_clip_tau=0.0)


def _cuda_or_skip():
    missing = None
    if not hivemesh.CUDA:
        missing = "the extension was built without the cuda feature"
    elif not torch.cuda.is_available():
        missing = "no CUDA device here"
    if missing:
        if os.environ.get("HIVEMESH_GPU_REQUIRED"):
            pytest.fail(f"a GPU is required (HIVEMESH_GPU_REQUIRED): {missing}")
        pytest.skip(missing)


def test_cuda_tensors_average_on_the_device(make_dht):
    """Three peers, one with CUDA tensors (DLPack, shared), one mixing CUDA and CPU tensors,
    one on the CPU: every tensor ends at the mean, the CUDA ones in place on the device, for
    float32 and bfloat16."""
    _cuda_or_skip()
    torch.manual_seed(1)
    for dtype, atol in [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]:
        cpu = [[torch.randn(1000, 3).to(dtype), torch.randn(7).to(dtype)] for _ in range(3)]
        reference = [sum(ts[k].float() for ts in cpu) / 3 for k in range(2)]
        placed = [
            [t.cuda() for t in cpu[0]],
            [cpu[1][0].cuda(), cpu[1][1].clone()],
            [t.clone() for t in cpu[2]],
        ]
        pointers = [t.data_ptr() for t in placed[0]]
        # A prefix may not contain '.' (``torch.float32`` does).
        averagers = averagers_for(make_dht, placed, prefix=f"cuda-{str(dtype).split('.')[-1]}")
        try:
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
            for c in controls:
                assert c.result(timeout=STEP_TIMEOUT) is not None
            torch.cuda.synchronize()
            for p, ts in enumerate(placed):
                for k, t in enumerate(ts):
                    assert torch.allclose(t.float().cpu(), reference[k], atol=atol), (dtype, p, k)
            # Shared, not copied: the very same device memory holds the mean.
            assert [t.data_ptr() for t in placed[0]] == pointers
            assert not averagers[0].allow_state_sharing
        finally:
            shutdown(averagers)


def test_weight_set_after_scheduling_is_the_one_used(make_dht):
    """hivemind's GradientAverager schedules a step, then sets its weight; a peer tagging
    along sets 0: the other peer's values come out exactly (whole numbers: exact in float32).
    After the all-reduce began a change warns and does nothing."""
    torch.manual_seed(3)
    values = [torch.randint(-50, 50, (17,)).float() for _ in range(2)]
    tensors = [[v.clone()] for v in values]
    averagers = averagers_for(make_dht, tensors)
    try:
        lagging = averagers[1].step(wait=False, require_trigger=True, timeout=STEP_TIMEOUT)
        other = averagers[0].step(wait=False, timeout=STEP_TIMEOUT)
        assert lagging.weight == 1.0
        assert other.scheduled_time is not None, "hivemind's default: now + matchmaking time"
        lagging.weight = 0
        assert lagging.weight == 0.0
        with pytest.raises(ValueError, match="weight"):
            lagging.weight = float("nan")
        when = hivemesh.get_dht_time() + 1.0
        lagging.scheduled_time = when
        assert lagging.scheduled_time == pytest.approx(when)
        lagging.allow_allreduce()
        assert other.result(timeout=STEP_TIMEOUT) is not None
        assert lagging.result(timeout=STEP_TIMEOUT) is not None
        for i in range(2):
            assert torch.equal(tensors[i][0], values[0]), f"peer {i}"
        with pytest.warns(RuntimeWarning, match="no effect"):
            lagging.weight = 5.0
        assert lagging.weight == 0.0, "the weight the all-reduce used"
        with pytest.warns(RuntimeWarning, match="no effect"):
            lagging.scheduled_time = when + 10
    finally:
        shutdown(averagers)


class ServingTrainingState(hivemesh.DecentralizedAverager):
    """hivemind's TrainingStateAverager serves more than it averages: parameters, optimizer
    statistics and extra tensors, with ``{"epoch": ...}``."""

    extras = None

    def get_current_state(self):
        with self.get_tensors() as tensors:
            params = [t.clone() for t in tensors]
        return {"epoch": 5, "group_bits": self.get_group_bits()}, params + self.extras


def test_get_current_state_override_is_what_newcomers_load(make_dht):
    torch.manual_seed(4)
    extras = [torch.randn(3, 4, 2), torch.randn(7).bfloat16(), torch.tensor(12.0),
              torch.randn(2, 5).half(), torch.zeros(0, 3)]
    donor_tensors = [torch.randn(6)]
    ServingTrainingState.extras = extras
    donor = ServingTrainingState(donor_tensors, make_dht(), prefix="served", start=True,
                                 initial_group_bits="01")
    newcomer = hivemesh.DecentralizedAverager([torch.zeros(6)], make_dht(), prefix="served",
                                              start=True, allow_state_sharing=False)
    try:
        metadata, tensors = newcomer.load_state_from_peers(timeout=STEP_TIMEOUT)
        assert metadata == {"epoch": 5, "group_bits": "01"}
        want = donor_tensors + extras
        assert [t.dtype for t in tensors] == [t.dtype for t in want]
        assert [t.shape for t in tensors] == [t.shape for t in want]
        assert all(torch.equal(a, b) for a, b in zip(tensors, want))
        # An override that fails: the newcomer is refused, so no peer serves.
        ServingTrainingState.extras = [torch.ones(2, dtype=torch.int64)]
        assert newcomer.load_state_from_peers(timeout=STEP_TIMEOUT) is None
    finally:
        shutdown([donor, newcomer])


def test_group_bits_matchmaking_kwargs_and_hivemind_exceptions(make_dht):
    from hivemesh.averaging.allreduce import AllreduceException
    from hivemesh.averaging.matchmaking import MatchmakingException

    averager = hivemesh.DecentralizedAverager([torch.zeros(2)], make_dht(), prefix="bits",
                                              initial_group_bits="011", min_group_size=2,
                                              target_group_size=4, start=True)
    try:
        assert averager.get_group_bits() == "011"
        averager.set_group_bits("10")
        assert averager.get_group_bits() == "10"
        assert averager.get_group_bits(wait=False).result() == "10"
        with pytest.raises(ValueError, match="0s and 1s"):
            averager.set_group_bits("012")
        assert averager.matchmaking_kwargs["prefix"] == "bits"
        assert averager.matchmaking_kwargs["min_matchmaking_time"] == 5.0
        assert averager.matchmaking_kwargs["target_group_size"] == 4
    finally:
        averager.shutdown()
    assert MatchmakingException is hivemesh.MatchmakingError
    assert issubclass(AllreduceException, hivemesh.AveragingError)
    assert issubclass(MatchmakingException, hivemesh.AveragingError)


def test_a_failed_allreduce_raises_allreduce_exception():
    """A step whose round failed raises hivemind's AllreduceException (an AveragingError, so
    existing except clauses still catch it); one that found no group returns None."""
    from hivemesh.averaging.allreduce import AllreduceException
    from hivemesh.averaging.control import StepControl

    class Finished:
        def __init__(self, error):
            self.error = error

        def wait(self, timeout=None):
            return True

        def outcome(self):
            raise self.error

    with pytest.raises(AllreduceException, match="the round broke") as raised:
        StepControl(Finished(hivemesh.AveragingError("all-reduce: the round broke"))).result()
    assert isinstance(raised.value, hivemesh.AveragingError)
    assert StepControl(Finished(hivemesh.MatchmakingError("no group"))).result() is None
    with pytest.raises(hivemesh.ShutdownError):
        StepControl(Finished(hivemesh.ShutdownError("gone"))).result()


def test_adaptive_timeouts_reach_the_core_and_average(make_dht):
    """``adaptive_timeouts``: ``True`` (the default bounds) averages like the fixed timeouts;
    bounds the core refuses (min above max, a factor below 1) and malformed values are a
    ``ValueError`` at construction, not a failed round later."""
    torch.manual_seed(5)
    tensors = [[torch.randn(64)] for _ in range(2)]
    mean = (tensors[0][0] + tensors[1][0]) / 2
    averagers = averagers_for(make_dht, tensors, adaptive_timeouts=True)
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        for t in tensors:
            assert torch.allclose(t[0], mean, rtol=0, atol=1e-6)
    finally:
        shutdown(averagers)
    for bad in [(5.0, 1.0, 3.0), (1.0, 60.0, 0.5), (0.0, 60.0, 3.0), "fast", (1.0, 2.0)]:
        with pytest.raises(ValueError, match="adaptive_timeouts"):
            hivemesh.DecentralizedAverager([torch.zeros(2)], make_dht(), prefix="bad",
                                           start=True, adaptive_timeouts=bad)
