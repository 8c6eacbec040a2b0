"""Training with the model on a GPU, as the people hivemesh is for do: ``hivemesh.Optimizer``
and ``DiLoCoOptimizer`` over CUDA parameters, two peers as threads of this process. Skipped
without a CUDA device (and an extension built with the ``cuda`` feature); with
``HIVEMESH_GPU_REQUIRED`` set, a missing GPU fails them (``tools/gpu-check.sh run`` sets it)."""

import copy
from functools import partial

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import hivemesh  # noqa: E402

import collab_peer  # noqa: E402
import diloco_peer  # noqa: E402
from test_averaging import _cuda_or_skip  # noqa: E402
from test_diloco import assert_lockstep, run_threads  # noqa: E402

EPOCHS = 3


def train_on_cuda(opt, model, index, epochs):
    """Steps ``opt`` on CUDA batches of the collab task until its ``local_epoch`` is
    ``epochs``."""
    gen = torch.Generator().manual_seed(1000 + index)
    for _ in range(2000):
        if opt.local_epoch >= epochs:
            return
        x, y = collab_peer.teacher_batch(gen, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.cuda()), y.cuda()).backward()
        opt.step()
    raise AssertionError(f"peer {index} stuck at epoch {opt.local_epoch}")


def cpu_loss(model):
    return collab_peer.eval_loss(copy.deepcopy(model).cpu())


def check_models(models, initial_loss):
    for i, m in enumerate(models):
        for p in m.parameters():
            assert p.is_cuda, f"peer {i}: a parameter left the device"
            assert torch.isfinite(p).all(), f"peer {i}: non-finite parameters"
        assert cpu_loss(m) < initial_loss, f"peer {i} did not learn"


def test_optimizer_trains_cuda_parameters(make_dht):
    _cuda_or_skip()
    models = [collab_peer.make_model().cuda() for _ in range(2)]
    initial = cpu_loss(models[0])
    opts = [
        hivemesh.Optimizer(
            dht=make_dht(), run_id="cuda_optimizer", target_batch_size=32,
            batch_size_per_step=8, params=m.parameters(),
            optimizer=partial(torch.optim.SGD, lr=0.2), matchmaking_time=0.5,
            averaging_timeout=30.0, verbose=True,
            tracker_opts=diloco_peer.TRACKER_OPTS)
        for m in models
    ]
    try:
        run_threads([lambda i=i: train_on_cuda(opts[i], models[i], i, EPOCHS) for i in range(2)])
        check_models(models, initial)
        assert all(o.local_epoch >= EPOCHS for o in opts)
    finally:
        for o in opts:
            o.shutdown()


def test_diloco_trains_cuda_parameters_in_lockstep(make_dht):
    _cuda_or_skip()
    models = [collab_peer.make_model().cuda() for _ in range(2)]
    initial = cpu_loss(models[0])
    opts = [diloco_peer.make_optimizer(make_dht(), m, "cuda_diloco") for m in models]
    try:
        run_threads([lambda i=i: train_on_cuda(opts[i], models[i], i, EPOCHS) for i in range(2)])
        check_models(models, initial)
        assert [o.local_epoch for o in opts] == [EPOCHS, EPOCHS]
        assert_lockstep([diloco_peer.outer_state(o) for o in opts], "cuda")
        # Blocking DiLoCo: each peer's model is its outer parameters after the last step.
        for o, m in zip(opts, models):
            for outer, p in zip(o.outer_parameters, m.parameters()):
                assert torch.allclose(outer.detach().cpu(), p.detach().cpu(), atol=1e-6)
    finally:
        for o in opts:
            o.shutdown()
