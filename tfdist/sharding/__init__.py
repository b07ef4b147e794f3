"""Who owns optimizer and gradient state: ZeRO stages, offload, checkpoint resharding."""

from tfdist.sharding.checkpoint import gathered_state
from tfdist.sharding.collectives import LocalCollectives, ShardCollectives
from tfdist.sharding.layout import FlatLayout
from tfdist.sharding.memory import MemoryReport, zero_formula
from tfdist.sharding.slot_shards import SlotShards
from tfdist.sharding.zero import SUPPORTED_STAGES, ZeroConfig, register_elementwise

__all__ = ["FlatLayout", "LocalCollectives", "MemoryReport", "SUPPORTED_STAGES", "ShardCollectives", "SlotShards",
           "ZeroConfig", "gathered_state", "register_elementwise", "zero_formula"]
