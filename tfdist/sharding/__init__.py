"""Who owns optimizer and gradient state: ZeRO stages, offload, checkpoint resharding."""

from tfdist.comm.shard_collectives import LocalCollectives, ShardCollectives
from tfdist.sharding.attach import (building_optimizers, cross_process_engine, engine_of, gathered_state,
                                    register_strategy)
from tfdist.sharding.config import SUPPORTED_STAGES, ZeroConfig, check_options, register_elementwise
from tfdist.sharding.layout import FlatLayout
from tfdist.sharding.memory import MemoryReport, memory_report, zero_formula
from tfdist.sharding.slot_shards import SlotShards
from tfdist.sharding.zero import ZeroEngine

__all__ = ["FlatLayout", "LocalCollectives", "MemoryReport", "SUPPORTED_STAGES", "ShardCollectives", "SlotShards",
           "ZeroConfig", "ZeroEngine", "building_optimizers", "check_options", "cross_process_engine", "engine_of",
           "gathered_state", "memory_report", "register_elementwise", "register_strategy", "zero_formula"]
