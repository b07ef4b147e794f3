"""Where layers run: stage plans, balancing, micro-batch pipelining."""

from tfdist.placement.balance import block_partition, measure_layer_times
from tfdist.placement.plan import LayerInfo, StagePlan, describe_model, make_plan

__all__ = ["LayerInfo", "StagePlan", "block_partition", "describe_model", "make_plan", "measure_layer_times"]
