"""Strategies: short classes that combine the comm, sharding, placement and cluster layers."""

from tfdist.strategies.factory import make_strategy, register, strategy_names
from tfdist.strategies.mirrored import MirroredStrategy

__all__ = ["MirroredStrategy", "make_strategy", "register", "strategy_names"]
