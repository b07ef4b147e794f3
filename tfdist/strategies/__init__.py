"""Strategies: short classes that combine the comm, sharding, placement and cluster layers."""

from tfdist.strategies.factory import make_strategy, register, strategy_names
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy  # issue 3

__all__ = ["MirroredStrategy", "make_strategy", "register", "strategy_names"]
__all__.append("MultiWorkerMirroredStrategy")  # issue 3
