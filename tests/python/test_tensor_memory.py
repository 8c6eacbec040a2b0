"""Issue 29, attack 7: ordinary PyTorch code frees or moves an averaged tensor's memory
(``storage.resize_(0)``, as FSDP does; ``tensor.resize_()``; ``tensor.set_()``). The averager
checks the memory (the tensor's data pointer and shape, inside its storage's bytes) before
every read or write, and a step that finds it changed fails with a clear
``hivemesh.AveragingError``, reading and writing nothing of it. A write a script makes during
a step (before the step applies its result) is kept: the step adds ``average - snapshot``."""

import pytest

import hivemesh

torch = pytest.importorskip("torch")

# Generous: the suite runs on a loaded 2-core CI machine; nothing here asserts speed.
STEP_TIMEOUT = 120.0

# Ways ordinary PyTorch code frees or moves the memory of an 8-element float32 tensor.
CHANGES = {
    # FSDP frees a flat parameter's storage like this between uses.
    "storage_resize_0": lambda t: t.untyped_storage().resize_(0),
    # Grows the storage: a new allocation; the old one is freed.
    "tensor_resize_bigger": lambda t: t.resize_(1 << 20),
    # Same shape, another storage.
    "tensor_set_": lambda t: t.set_(torch.zeros(8)),
}


def pair(make_dht, tensors, gate=False):
    """Two averagers that form one group; with ``gate``, the first one's steps stop before
    applying their result until the test releases them (a test-only hook)."""
    out = []
    for i, ts in enumerate(tensors):
        averager = hivemesh.DecentralizedAverager(
            ts, make_dht(), prefix="memory", target_group_size=2, min_group_size=2,
            min_matchmaking_time=2.0, request_timeout=10.0, start=False)
        if gate and i == 0:
            averager._args["_apply_gate"] = True
        averager.run_in_background()
        out.append(averager)
    return out


def shutdown(averagers):
    for a in averagers:
        a.shutdown()


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_memory_changed_before_a_step_fails_it(make_dht, change):
    ours, theirs = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    averagers = pair(make_dht, [[ours], [theirs]])
    try:
        CHANGES[change](ours)
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        with pytest.raises(hivemesh.AveragingError,
                           match="tensor 0's memory changed under the averager"):
            controls[0].result(timeout=STEP_TIMEOUT)
    finally:
        shutdown(averagers)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_memory_changed_during_a_step_fails_its_apply(make_dht, change):
    ours, theirs = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    averagers = pair(make_dht, [[ours], [theirs]], gate=True)
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert averagers[0]._averager._apply_gate_reached(STEP_TIMEOUT), \
            "the first peer's round ends"
        # The round is over and its snapshot taken; the memory goes away before the apply.
        CHANGES[change](ours)
        averagers[0]._averager._apply_gate_release()
        with pytest.raises(hivemesh.AveragingError,
                           match="tensor 0's memory changed under the averager"):
            controls[0].result(timeout=STEP_TIMEOUT)
        # The other peer's round was complete: it holds the mean.
        assert controls[1].result(timeout=STEP_TIMEOUT) is not None
        assert torch.equal(theirs, torch.arange(8, dtype=torch.float32) / 2)
    finally:
        shutdown(averagers)


def test_a_write_during_a_step_is_kept(make_dht):
    ours, theirs = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    mean = torch.arange(8, dtype=torch.float32) / 2
    averagers = pair(make_dht, [[ours], [theirs]], gate=True)
    try:
        controls = [a.step(wait=False, timeout=STEP_TIMEOUT) for a in averagers]
        assert averagers[0]._averager._apply_gate_reached(STEP_TIMEOUT)
        # A training step lands between the snapshot and the apply (under the lock, as
        # documented).
        with averagers[0].get_tensors() as locked:
            locked[0].add_(1.0)
        averagers[0]._averager._apply_gate_release()
        assert all(c.result(timeout=STEP_TIMEOUT) is not None for c in controls)
        assert torch.equal(ours, mean + 1), "the write is kept on top of the average"
        assert torch.equal(theirs, mean)
    finally:
        shutdown(averagers)
