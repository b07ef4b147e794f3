"""Who owns optimizer, gradient and (stage 3) parameter state: ZeRO stages, offload, checkpoint resharding."""

from tfdist.comm.shard_collectives import LocalCollectives, ShardCollectives
from tfdist.sharding.attach import (building_optimizers, configure_stage3, cross_process_engine, engine_of,
                                    gathered_state, register_engine, register_strategy)
from tfdist.sharding.config import (SUPPORTED_STAGES, ZeroConfig, check_options, check_stage3_options,
                                    check_unit_bytes, register_elementwise)
from tfdist.sharding.fsdp_param import FsdpParam
from tfdist.sharding.fsdp_unit import FsdpUnit
from tfdist.sharding.grouped import GroupedZeroEngine
from tfdist.sharding.grouped_zero3 import GroupedZero3Engine
from tfdist.sharding.layout import FlatLayout
from tfdist.sharding.memory import MemoryReport, memory_report, zero_formula
from tfdist.sharding.slot_shards import SlotShards
from tfdist.sharding.zero import ZeroEngine
from tfdist.sharding.zero3 import Zero3Engine
from tfdist.sharding.zero3_layout import ParamShardLayout

__all__ = ["FlatLayout", "FsdpParam", "FsdpUnit", "GroupedZero3Engine", "GroupedZeroEngine", "LocalCollectives", "MemoryReport",
           "ParamShardLayout", "SUPPORTED_STAGES", "ShardCollectives", "SlotShards", "Zero3Engine", "ZeroConfig",
           "ZeroEngine", "building_optimizers", "check_options", "check_stage3_options", "check_unit_bytes",
           "configure_stage3", "cross_process_engine", "engine_of", "gathered_state", "memory_report",
           "register_elementwise", "register_engine", "register_strategy", "zero_formula"]
