"""TF_CONFIG parsing, re-exported: it lives in `tfdist.comm.tf_config` (the bottom layer, which
`tfdist.comm.init()` reads too). These are the same objects; import from either place."""

from tfdist.comm.tf_config import (MULTI_WORKER_JOBS, PARAMETER_SERVER_JOBS, ClusterConfig, parse_tf_config,
                                   tf_config_from_env)

__all__ = ["MULTI_WORKER_JOBS", "PARAMETER_SERVER_JOBS", "ClusterConfig", "parse_tf_config", "tf_config_from_env"]
