"""tfdist.ModelParallelStrategy: a ("batch", "model") or ("batch", "stage", "model") mesh, in one process
(`strategy`), across processes over TF collectives (`processes`) or Horovod (`horovod`), with ZeRO on the
batch axis (`zero`)."""

from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy

__all__ = ["ModelParallelStrategy"]
