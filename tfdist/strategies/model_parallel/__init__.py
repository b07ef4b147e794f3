"""tfdist.ModelParallelStrategy: a ("batch", "model") or ("batch", "stage", "model") mesh, in one process
(`strategy`), across processes over TF collectives or Horovod (`tfdist.tensor_parallel.processes`,
`horovod_processes`), with ZeRO on the batch axis (`zero`)."""

from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy

__all__ = ["ModelParallelStrategy"]
