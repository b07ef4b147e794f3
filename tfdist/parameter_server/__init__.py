"""Asynchronous training with parameter servers: Keras `fit`/`evaluate`/`predict` through TF's
ClusterCoordinator (`coordinated`), per-worker input (`per_worker_data`), variables sharded over the servers
and embedding lookups that read only their rows (`sharded_embedding`). `tfdist.ParameterServerStrategy` is the
public front."""
