"""Strategies: short classes that combine the comm, sharding, placement and cluster layers."""

from tfdist.strategies.factory import make_strategy, register, strategy_names
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.layer_placement import LayerPlacementStrategy

__all__ = ["LayerPlacementStrategy", "MirroredStrategy", "make_strategy", "register", "strategy_names"]
