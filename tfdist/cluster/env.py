"""The launcher table, re-exported: it lives in `tfdist.comm.launch_env` (the bottom layer, which
`tfdist.comm.init()` reads too). These are the same objects; import from either place."""

from tfdist.comm.launch_env import (LAUNCHERS, LOCAL_DEVICES_ENV, RANK_ENV, ROLE_ENV, Launcher, launched_by,
                                    launcher_of, local_device_count, srun_step_tasks)

__all__ = ["LAUNCHERS", "LOCAL_DEVICES_ENV", "RANK_ENV", "ROLE_ENV", "Launcher", "launched_by", "launcher_of",
           "local_device_count", "srun_step_tasks"]
