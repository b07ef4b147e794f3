"""Strategies: short classes that combine the comm, sharding, placement and cluster layers."""

from tfdist.strategies.factory import make_strategy, register, strategy_names
from tfdist.strategies.horovod import HorovodStrategy  # Horovod itself is imported only when one is built
from tfdist.strategies.layer_placement import LayerPlacementStrategy
from tfdist.strategies.mirrored import MirroredStrategy
from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy
from tfdist.strategies.parameter_server import ParameterServerStrategy

__all__ = ["HorovodStrategy", "LayerPlacementStrategy", "MirroredStrategy", "ModelParallelStrategy",
           "MultiWorkerMirroredStrategy",
           "ParameterServerStrategy", "make_strategy", "register", "strategy_names"]
