"""``hivemesh.DiLoCoOptimizer`` (issue 30): every outer update against an in-process
reference, a late joiner in lockstep, a peer SIGKILLed mid-run, and convergence with a lossy
codec close to fp32 DiLoCo. Peers run as threads of this process (each with its own DHT node),
except for the kill test (processes of ``diloco_peer.py``)."""

import json
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

import hivemesh  # noqa: E402
from hivemesh.compression import (  # noqa: E402
    BlockwiseQuantization,
    ErrorFeedbackTopK,
    Float16Compression,
    NoCompression,
)

import collab_peer  # noqa: E402
import diloco_peer  # noqa: E402
from polling import wait_for  # noqa: E402
from test_optimizer import HERE, Swarm  # noqa: E402

H, BATCH = 5, 8  # inner steps per outer step, samples per inner step


def run_threads(targets):
    """Runs the callables in threads; re-raises the first exception one of them raised."""
    errors = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a peer thread did not finish"
    if errors:
        raise errors[0]


class Peers:
    """DiLoCo peers in this process, each with its own DHT node."""

    def __init__(self, make_dht, run_id, **kwargs):
        self.make_dht, self.run_id, self.kwargs = make_dht, run_id, kwargs
        self.opts, self.models = [], []

    def add(self, model=None):
        model = collab_peer.make_model() if model is None else model
        opt = diloco_peer.make_optimizer(self.make_dht(), model, self.run_id,
                                         num_inner_steps=H, batch_size=BATCH, **self.kwargs)
        self.opts.append(opt)
        self.models.append(model)
        return len(self.opts) - 1

    def trainer(self, index, epochs, **kwargs):
        return lambda: diloco_peer.train(self.opts[index], self.models[index], index, epochs,
                                         **kwargs)

    def shutdown(self):
        for opt in self.opts:
            opt.shutdown()


def assert_close(a, b, what, tol=1e-5):
    for x, y in zip(a, b):
        err = (x - y).abs().max().item()
        assert err <= tol, f"{what}: {err}"


def assert_lockstep(states, what=""):
    """The outer parameters and momentum (``outer_state`` dicts) of every peer equal the
    first's (1e-6)."""
    for s in states[1:]:
        for key in ("params", "momentum"):
            for a, b in zip(states[0][key], s[key]):
                assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6, (key, what)


def count_reloads(opt):
    """Wraps ``opt.load_state_from_peers``; returns the list of epochs it was called at."""
    reloads, load = [], opt.load_state_from_peers

    def counting_load(**kwargs):
        reloads.append(opt.local_epoch)
        return load(**kwargs)

    opt.load_state_from_peers = counting_load
    return reloads


# --- every outer update against a reference -----------------------------------------------


def record_outer_steps(opt, log):
    """Wraps ``opt``'s outer update: logs, per outer step, the peer's own pseudo-gradient and
    weight (as last loaded into the round), the averaged pseudo-gradient, and the outer
    parameters and momentum before and after."""
    load, apply = opt._load_pseudo_gradient_into_averager_, opt._apply_outer_step
    own = {}

    def momentum():
        return [opt.outer_optimizer.state[p]["momentum_buffer"].clone()
                for p in opt.outer_parameters]

    def loading():
        load()
        with opt.grad_averager.get_tensors() as buffers:
            own["delta"] = [b.clone() for b in buffers]
        own["weight"] = min(1.0, opt._samples / opt.samples_per_epoch)
        own["inner_steps"] = opt._inner_steps_total

    def applying(group_size, began, launched=None):
        entry = dict(own, group_size=group_size,
                     averaged=[p.grad.clone() for p in opt.outer_parameters],
                     before=[p.detach().clone() for p in opt.outer_parameters],
                     momentum_before=momentum(),
                     model_before=[p.detach().clone() for p in opt.main_parameters],
                     launched=None if launched is None else [p.clone() for p in launched])
        apply(group_size, began, launched=launched)
        entry.update(epoch=opt.local_epoch,
                     after=[p.detach().clone() for p in opt.outer_parameters],
                     momentum_after=momentum(),
                     model=[p.detach().clone() for p in opt.main_parameters])
        log.append(entry)

    opt._load_pseudo_gradient_into_averager_ = loading
    opt._apply_outer_step = applying


def reference_outer_step(before, momentum, grad):
    """The outer optimizer's step on fresh copies: ``(parameters, momentum)`` after it."""
    params = [p.clone().requires_grad_(True) for p in before]
    ref = diloco_peer.make_outer(params)
    for p, m, g in zip(params, momentum, grad):
        p.grad = g.clone()
        ref.state[p]["momentum_buffer"] = m.clone()
    ref.step()
    return ([p.detach() for p in params],
            [ref.state[p]["momentum_buffer"] for p in params])


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_every_outer_step_is_the_outer_optimizer_on_the_mean_pseudo_gradient(make_dht, overlap):
    peers, epochs = Peers(make_dht, f"diloco_reference_{overlap}",
                          overlap_communication=overlap), 4
    logs = [[] for _ in range(3)]
    try:
        for i in range(3):
            peers.add()
            record_outer_steps(peers.opts[i], logs[i])
        run_threads([peers.trainer(i, epochs) for i in range(3)])
    finally:
        peers.shutdown()

    for epoch in range(1, epochs + 1):
        entries = [e for log in logs for e in log if e["epoch"] == epoch]
        assert len(entries) == 3 and all(e["group_size"] == 3 for e in entries), \
            (epoch, [e["group_size"] for e in entries])
        total = sum(e["weight"] for e in entries)
        mean = [sum(e["weight"] * e["delta"][k] for e in entries) / total
                for k in range(len(entries[0]["delta"]))]
        first = entries[0]
        # Not a trivial update: the pseudo-gradients differ between peers.
        assert (first["delta"][0] - entries[1]["delta"][0]).abs().max() > 1e-4
        params, momentum = reference_outer_step(first["before"], first["momentum_before"], mean)
        for e in entries:
            # Every epoch is H inner steps, also those taken while a round was in flight.
            assert e["inner_steps"] == epoch * H, (epoch, e["inner_steps"])
            assert_close(e["averaged"], mean, f"epoch {epoch}: averaged pseudo-gradient")
            assert_close(e["before"], first["before"], f"epoch {epoch}: outer params before")
            assert_close(e["after"], params, f"epoch {epoch}: outer params after")
            assert_close(e["momentum_after"], momentum, f"epoch {epoch}: outer momentum after")
            if not overlap:
                assert e["launched"] is None
                assert_close(e["model"], params, f"epoch {epoch}: the model after the outer step")
                continue
            # Overlapped: the model went on from where the round was launched; it restarts at
            # the new outer parameters plus its progress since the launch (at least the inner
            # step of the call that took the round's outcome).
            progress = [b - a for a, b in zip(e["launched"], e["model_before"])]
            assert max(d.abs().max().item() for d in progress) > 1e-6, epoch
            assert_close(e["delta"], [o - a for o, a in zip(e["before"], e["launched"])],
                         f"epoch {epoch}: the pseudo-gradient is the launch's")
            assert_close(e["model"], [p + d for p, d in zip(params, progress)],
                         f"epoch {epoch}: the model after the overlapped outer step")
        if epoch > 1:
            previous = [e for log in logs for e in log if e["epoch"] == epoch - 1][0]
            assert_close(first["before"], previous["after"], f"epoch {epoch}: continuity")


# --- a late joiner --------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_late_joiner_loads_the_outer_state_and_ends_in_lockstep(make_dht, overlap):
    peers, epochs = Peers(make_dht, f"diloco_late_{overlap}", overlap_communication=overlap), 5
    started = threading.Event()
    try:
        for _ in range(2):
            peers.add()
        torch.manual_seed(7)
        late = peers.add(torch.nn.Sequential(  # another initialization: it must load
            torch.nn.Linear(collab_peer.FEATURES, collab_peer.HIDDEN), torch.nn.Tanh(),
            torch.nn.Linear(collab_peer.HIDDEN, 1)))

        def first(epoch):
            if epoch == 2:
                started.set()

        def joiner():
            assert started.wait(120), "the swarm never reached epoch 2"
            peers.trainer(late, epochs)()

        run_threads([peers.trainer(0, epochs, on_epoch=first), peers.trainer(1, epochs),
                     joiner])
        states = [diloco_peer.outer_state(opt) for opt in peers.opts]
        assert peers.opts[late].local_epoch == epochs
    finally:
        peers.shutdown()
    assert_lockstep(states)


# --- a failed round ------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_failed_round_never_raises_and_the_peer_stays_in_lockstep(make_dht, overlap):
    peers, epochs = Peers(make_dht, f"diloco_failed_round_{overlap}",
                          overlap_communication=overlap), 4
    injected = []
    try:
        for _ in range(3):
            peers.add()
        opt = peers.opts[2]
        step, reloads = opt.grad_averager.step, count_reloads(opt)

        def failing_step(*args, **kwargs):
            if opt.local_epoch == 2 and not injected:
                injected.append(True)
                raise hivemesh.AveragingError("injected: the group's all-reduce failed")
            return step(*args, **kwargs)

        opt.grad_averager.step = failing_step
        run_threads([peers.trainer(i, epochs) for i in range(3)])
        states = [diloco_peer.outer_state(o) for o in peers.opts]
    finally:
        peers.shutdown()
    # The peer retried the round (in time for the others' group) or, once they had moved
    # on without it, reloaded their state: in lockstep either way.
    assert injected
    assert_lockstep(states, reloads)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_peer_that_missed_the_group_stops_looking_and_reloads(make_dht, overlap):
    # Peer 2 starts looking for epoch 2's group only once the others have moved on without
    # it. It must stop looking (its round's timeout is 10 minutes) and load their state.
    peers, epochs = Peers(make_dht, f"diloco_missed_{overlap}", averaging_timeout=600.0,
                          overlap_communication=overlap), 4
    try:
        for _ in range(3):
            peers.add()
        opt = peers.opts[2]
        step, reloads = opt.grad_averager.step, count_reloads(opt)

        def late_step(*args, **kwargs):
            if opt.local_epoch == 2 and not reloads:
                wait_for(lambda: peers.opts[0].local_epoch >= 3, what="the others' epoch 3")
            return step(*args, **kwargs)

        opt.grad_averager.step = late_step
        run_threads([peers.trainer(i, epochs) for i in range(3)])
        states = [diloco_peer.outer_state(o) for o in peers.opts]
    finally:
        peers.shutdown()
    assert reloads and reloads[0] == 2, reloads
    assert_lockstep(states)


# --- a stalled peer ------------------------------------------------------------------------


def test_a_stalled_peer_holds_the_others_back_at_most_timeout_waiting_for_peers(make_dht):
    # Peer 2 stops stepping after epoch 1 but stays up: its progress record lives on, so the
    # others see a peer that never finishes its share; they wait timeout_waiting_for_peers
    # at each outer step, then average without it.
    peers, epochs = Peers(make_dht, "diloco_stalled", timeout_waiting_for_peers=1.0), 4
    try:
        for _ in range(3):
            peers.add()
        run_threads([peers.trainer(0, epochs), peers.trainer(1, epochs), peers.trainer(2, 1)])
        states = [diloco_peer.outer_state(opt) for opt in peers.opts[:2]]
        assert [opt.local_epoch for opt in peers.opts] == [epochs, epochs, 1]
        assert peers.opts[0].last_outer_step["group_size"] == 2
    finally:
        peers.shutdown()
    assert_lockstep(states)


# --- a peer killed mid-run ------------------------------------------------------------------


class DiLoCoSwarm(Swarm):
    """Processes of diloco_peer.py (``Swarm``'s bookkeeping), started together."""

    def __init__(self, bootstrap, tmp_path, flags, run_id):
        super().__init__(bootstrap, tmp_path, flags, run_id)
        self.go_file = tmp_path / "go"

    def start(self, index, *extra):
        args = [sys.executable, str(HERE / "diloco_peer.py"), "--index", str(index),
                "--stop-file", str(self.stop_file), "--go-file", str(self.go_file),
                "--flags", json.dumps(self.flags), "--run-id", self.run_id, *extra]
        return self.spawn(index, args)


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_a_peer_killed_mid_run(bootstrap, tmp_path, overlap):
    # The dead peer's progress stays in the DHT for a while: the survivors wait for it at
    # most timeout_waiting_for_peers, then average without it.
    swarm = DiLoCoSwarm(bootstrap, tmp_path,
                        dict(timeout_waiting_for_peers=2.0, overlap_communication=overlap),
                        run_id=f"diloco_faults_{overlap}")
    epochs, survivors = 5, (0, 2)
    try:
        for i in range(3):
            swarm.start(i, "--epochs", str(epochs))
        swarm.wait(lambda: all(swarm.saw(i, "ready") for i in range(3)), "every peer ready")
        swarm.go_file.touch()
        swarm.wait(lambda: swarm.saw(0, "epoch 1"), "epoch 1")
        swarm.kill(1)  # mid-epoch: the others' step() must not raise (they exit 0)
        swarm.wait(lambda: all(swarm.result(i) for i in survivors), "the survivors' results")
        results = [swarm.result(i) for i in survivors]
    finally:
        swarm.close()
    for i, proc in swarm.procs.items():
        if i in survivors:
            assert proc.returncode == 0, (i, swarm.stderr_path(i).read_text()[-4000:])
    for r in results:
        assert r["local_epoch"] == epochs and r["global_epoch"] == epochs, r["index"]
    # The survivors averaged together (or reloaded from each other): in lockstep.
    assert_lockstep(results)


# --- lossy codecs ---------------------------------------------------------------------------


def two_peers(make_dht, run_id, epochs, **kwargs):
    """Two peers trained to ``epochs`` outer steps: ``(losses, outer states)``."""
    peers = Peers(make_dht, run_id, **kwargs)
    try:
        for _ in range(2):
            peers.add()
        run_threads([peers.trainer(i, epochs) for i in range(2)])
        return ([collab_peer.eval_loss(m) for m in peers.models],
                [diloco_peer.outer_state(opt) for opt in peers.opts])
    finally:
        peers.shutdown()


@pytest.fixture(scope="module")
def fp32_diloco_loss():
    """fp32 DiLoCo's loss after 6 outer steps (its own bootstrap node: module scope)."""
    boot = hivemesh.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    made = []

    def make_dht():
        dht = hivemesh.DHT(initial_peers=[str(a) for a in boot.get_visible_maddrs()],
                           host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        made.append(dht)
        return dht

    try:
        losses, _ = two_peers(make_dht, "diloco_fp32", 6, grad_compression=NoCompression())
    finally:
        for dht in made:
            dht.shutdown()
        boot.shutdown()
    assert losses[0] == losses[1]  # lossless: in lockstep
    return losses[0]


CODECS = {
    "float16": Float16Compression(),
    "blockwise8": BlockwiseQuantization(),
    # Sparse with error feedback, 30% of each chunk's values at 4 bits (chunks of 64 values:
    # the model is small). In this test's 6 outer steps sparser settings lag behind fp32
    # (density 0.1 at 4 bits ended at 2.2x fp32's loss, 0.25 at 2 bits at 1.25x): error
    # feedback delivers what it holds back only over later rounds.
    "topk_error_feedback": ErrorFeedbackTopK(density=0.3, bits=4, chunk=64),
}


@pytest.mark.parametrize("name", list(CODECS) + ["topk_error_feedback_overlapped"])
def test_diloco_with_a_lossy_codec_converges_like_fp32(make_dht, fp32_diloco_loss, name):
    initial = collab_peer.eval_loss(collab_peer.make_model())
    overlap = name.endswith("_overlapped")
    codec = CODECS[name.removesuffix("_overlapped")]
    losses, _ = two_peers(make_dht, f"diloco_{name}", 6, grad_compression=codec,
                          overlap_communication=overlap)
    loss = sum(losses) / len(losses)
    # Both trained (fp32 to under half the initial loss), and the codec costs at
    # most 10% of fp32 DiLoCo's loss.
    assert fp32_diloco_loss < 0.5 * initial, (fp32_diloco_loss, initial)
    assert loss <= 1.1 * fp32_diloco_loss, (name, loss, fp32_diloco_loss)


def test_average_state_every_puts_lossy_peers_back_in_lockstep(make_dht):
    # A lossy codec leaves each peer its own compression error; the lossless state round
    # after every outer step makes the outer state identical again.
    _, states = two_peers(make_dht, "diloco_resync", 3, grad_compression=BlockwiseQuantization(),
                          average_state_every=1, average_opt_statistics=("momentum_buffer",))
    assert_lockstep(states)
