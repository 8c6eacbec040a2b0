"""hivemesh: peer-to-peer decentralized averaging, with hivemind's averaging API.

A training loop that averages with hivemind switches by changing its imports::

    import hivemesh
    dht = hivemesh.DHT(initial_peers=[...], start=True)
    averager = hivemesh.DecentralizedAverager([param.data for param in model.parameters()],
                                              dht, prefix="my_run", target_group_size=4,
                                              start=True)
    averager.step()  # the parameters now hold the group's average

The tensors (PyTorch CPU tensors or numpy arrays; CUDA tensors where ``hivemesh.CUDA``, in an
extension built with the ``cuda`` feature) are shared with the Rust core, not copied.
"""

from hivemesh._hivemesh import (
    CUDA,
    AveragingError,
    DHTError,
    HivemeshError,
    MatchmakingError,
    ShutdownError,
    StateError,
    __version__,
    get_dht_time,
)
from hivemesh import compression
from hivemesh.averaging import AveragingMode, AveragingStage, DecentralizedAverager, StepControl
from hivemesh.dht import DHT, Multiaddr, PeerID, ValueWithExpiration

__all__ = [
    "CUDA",
    "DHT",
    "AveragingError",
    "AveragingMode",
    "AveragingStage",
    "DHTError",
    "DecentralizedAverager",
    "HivemeshError",
    "MatchmakingError",
    "Multiaddr",
    "PeerID",
    "ShutdownError",
    "StateError",
    "StepControl",
    "ValueWithExpiration",
    "__version__",
    "compression",
    "get_dht_time",
    "Optimizer",
    "GradScaler",
    "DiLoCoOptimizer",
]

# hivemind's top-level names from hivemesh.optim, imported when first used (they need PyTorch,
# which ``import hivemesh`` does not).
_OPTIM = {"Optimizer", "GradScaler", "TrainingStateAverager", "GradientAverager",
          "ProgressTracker", "DiLoCoOptimizer"}


def __getattr__(name: str):
    if name in _OPTIM:
        from hivemesh import optim

        return getattr(optim, name)
    raise AttributeError(f"module 'hivemesh' has no attribute {name!r}")
