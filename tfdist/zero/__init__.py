"""Who owns optimizer, gradient and (stage 3) parameter state: ZeRO stages, offload, checkpoint resharding."""

from tfdist.zero.attach import (
                                    building_optimizers,
                                    configure_stage3,
                                    cross_process_engine,
                                    engine_of,
                                    gathered_state,
                                    register_engine,
                                    register_strategy,
)
from tfdist.zero.collectives import LocalCollectives, ShardCollectives
from tfdist.zero.config import (
                                    SUPPORTED_STAGES,
                                    ZeroConfig,
                                    check_options,
                                    check_stage3_options,
                                    check_unit_bytes,
                                    register_elementwise,
)
from tfdist.zero.engine import ZeroEngine
from tfdist.zero.flat_layout import FlatLayout
from tfdist.zero.fsdp.engine import Zero3Engine
from tfdist.zero.fsdp.layout import ParamShardLayout
from tfdist.zero.fsdp.mesh_engine import GroupedZero3Engine
from tfdist.zero.fsdp.param import FsdpParam
from tfdist.zero.fsdp.unit import FsdpUnit
from tfdist.zero.memory import MemoryReport, memory_report, zero_formula
from tfdist.zero.mesh_engine import GroupedZeroEngine
from tfdist.zero.owned_slots import SlotShards

__all__ = ["FlatLayout", "FsdpParam", "FsdpUnit", "GroupedZero3Engine", "GroupedZeroEngine", "LocalCollectives", "MemoryReport",
           "ParamShardLayout", "SUPPORTED_STAGES", "ShardCollectives", "SlotShards", "Zero3Engine", "ZeroConfig",
           "ZeroEngine", "building_optimizers", "check_options", "check_stage3_options", "check_unit_bytes",
           "configure_stage3", "cross_process_engine", "engine_of", "gathered_state", "memory_report",
           "register_elementwise", "register_engine", "register_strategy", "zero_formula"]
