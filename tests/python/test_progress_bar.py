"""The optimizer's progress bar (hivemesh.optim.progress_bar): what it shows, when it draws,
that log lines never land on its line, and that ``Optimizer(verbose=True)`` draws it on a
terminal and not into a pipe."""

import io
import logging
import sys
from functools import partial

import pytest

torch = pytest.importorskip("torch")

import hivemesh  # noqa: E402
from hivemesh.optim.progress_bar import EpochProgressBar, ProgressSnapshot, render  # noqa: E402
from hivemesh.utils import get_logger  # noqa: E402


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def snapshot(**kw):
    base = dict(epoch=3, samples=1536, target=4096, peers=4, clients=1,
                samples_per_second=512.0, eta_seconds=5.0)
    base.update(kw)
    return ProgressSnapshot(**base)


def test_render_shows_the_epoch_the_samples_the_peers_the_pace_and_the_last_round():
    line = render(snapshot(round_peers=4, round_seconds=0.42))
    assert line.startswith("epoch 3 [#######.............] 1,536/4,096 samples")
    assert "4 peers (1 client)" in line
    assert "512 samples/s" in line
    assert "ETA 5.0 s" in line
    assert "last round: 4 peers in 0.42 s" in line
    # A full epoch, an unknown ETA, a peer alone, no round yet.
    line = render(snapshot(samples=9000, eta_seconds=float("inf"), peers=1, clients=0,
                           samples_per_second=0.0))
    assert "[####################] 9,000/4,096" in line
    assert "ETA ?" in line and "1 peer |" in line and "? samples/s" in line
    assert "last round" not in line and "client" not in line


def test_the_bar_draws_at_most_every_interval_and_keeps_each_finished_epoch():
    out, clock = Terminal(), Clock()
    bar = EpochProgressBar(min_interval=0.5, stream=lambda: out, clock=clock)
    assert bar.update(snapshot(samples=100))
    clock.now = 0.2
    assert not bar.update(snapshot(samples=200))  # too soon
    assert bar.update(snapshot(samples=200), force=True)
    clock.now = 0.3
    assert bar.update(snapshot(epoch=4, samples=0))  # a new epoch draws at once
    clock.now = 0.9
    assert bar.update(snapshot(epoch=4, samples=300))
    text = out.getvalue()
    assert text.count("\r") == 4
    # The finished epoch's last line stays; the new epoch's bars overwrite each other.
    lines = text.split("\n")
    assert len(lines) == 2
    assert lines[0].rsplit("\r", 1)[-1].startswith("epoch 3 [") and "200/4,096" in lines[0]
    assert lines[1].rsplit("\r", 1)[-1].startswith("epoch 4 [") and "300/4,096" in lines[1]


def test_nothing_is_drawn_where_the_stream_is_not_a_terminal():
    out = io.StringIO()
    bar = EpochProgressBar(stream=lambda: out)
    assert not bar.active()
    assert not bar.update(snapshot(), force=True)
    assert out.getvalue() == ""
    forced = EpochProgressBar(enabled=True, stream=lambda: out)
    assert forced.update(snapshot())
    assert out.getvalue().startswith("\repoch 3 [")


def test_a_log_line_ends_the_bar_line_first(monkeypatch):
    out = Terminal()
    bar = EpochProgressBar(stream=lambda: out)
    assert bar.update(snapshot())
    # hivemesh's handler writes to the stderr it was made with: point it at the terminal.
    logger = get_logger("hivemesh.test_progress_bar")
    handler = logging.getLogger("hivemesh").handlers[0]
    monkeypatch.setattr(handler, "stream", out)
    logger.warning("a message")
    text = out.getvalue()
    bar_line, log_line = text.split("\n")[:2]
    assert bar_line.startswith("\repoch 3 [")
    assert "a message" in log_line and "\r" not in log_line
    # The next update draws again at once, on a fresh line.
    assert bar.update(snapshot(samples=1600))
    assert out.getvalue().endswith(render(snapshot(samples=1600)))


def _train_two_epochs(make_dht, **opt_kwargs):
    model = torch.nn.Linear(4, 1)
    opt = hivemesh.Optimizer(
        dht=make_dht(), run_id="bar", target_batch_size=8, batch_size_per_step=4,
        params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
        matchmaking_time=1.0, averaging_timeout=10.0,
        tracker_opts=dict(min_refresh_period=0.05, max_refresh_period=0.2,
                          default_refresh_period=0.1), **opt_kwargs)
    try:
        gen = torch.Generator().manual_seed(1)
        while opt.local_epoch < 2:
            opt.zero_grad()
            model(torch.randn(4, 4, generator=gen)).pow(2).mean().backward()
            opt.step()
    finally:
        opt.shutdown()
    return opt


def test_a_verbose_optimizer_draws_its_bar_on_a_terminal_only(make_dht, monkeypatch):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    opt = _train_two_epochs(make_dht, verbose=True)
    assert opt.progress_bar.draws >= 2
    text = terminal.getvalue()
    assert "\repoch 0 [" in text and "\repoch 1 [" in text and "/8 samples" in text
    assert text.endswith("\n")  # shutdown ended the line

    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    opt = _train_two_epochs(make_dht, verbose=True)
    assert opt.progress_bar.draws == 0 and "\r" not in pipe.getvalue()

    # Not verbose: no bar, even on a terminal (unless asked for).
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert _train_two_epochs(make_dht).progress_bar.draws == 0
    assert _train_two_epochs(make_dht, progress_bar=True).progress_bar.draws >= 2
