"""How bytes move between replicas: TF collectives and (optionally) Horovod."""

from tfdist.comm.tf_collectives import cross_device_ops_from

__all__ = ["cross_device_ops_from"]
