"""``hivemesh.optim``: collaborative training over hivemesh, with hivemind 1.1.12's classes
and names (needs PyTorch).

* :class:`Optimizer` wraps a torch optimizer: peers sharing a ``run_id`` train as one, each
  epoch ending when the swarm has processed ``target_batch_size`` samples
  (:mod:`hivemesh.optim.optimizer`);
* :class:`ProgressTracker` follows the swarm's progress through the DHT
  (:mod:`hivemesh.optim.progress_tracker`, over the Rust core ``hivemesh::train``);
* :class:`TrainingStateAverager` keeps parameters, optimizer and scheduler in sync and serves
  them to newcomers (:mod:`hivemesh.optim.state_averager`);
* :class:`GradientAverager` accumulates gradients and averages them weighted by samples
  (:mod:`hivemesh.optim.grad_averager`);
* :class:`DiLoCoOptimizer` trains with DiLoCo: local inner steps, and every
  ``num_inner_steps`` an outer step on the swarm's averaged pseudo-gradient
  (:mod:`hivemesh.optim.diloco`);
* :class:`GradScaler` is loss scaling for mixed precision (:mod:`hivemesh.optim.grad_scaler`).
"""

from hivemesh.optim.diloco import AllReduceStrategy, DiLoCoOptimizer
from hivemesh.optim.grad_averager import GradientAverager
from hivemesh.optim.grad_scaler import GradScaler
from hivemesh.optim.optimizer import Optimizer
from hivemesh.optim.progress_tracker import ProgressTracker
from hivemesh.optim.state_averager import TrainingStateAverager

__all__ = ["Optimizer", "DiLoCoOptimizer", "AllReduceStrategy", "GradScaler", "GradientAverager",
           "ProgressTracker", "TrainingStateAverager"]
