"""Which GPUs each process `tfdist launch` starts on this machine may see: its own, by CUDA_VISIBLE_DEVICES.

The launcher does not import TensorFlow: it reads the GPUs this machine shows it from CUDA_VISIBLE_DEVICES when
that is set (a scheduler may have given the launcher a subset), else from the NVIDIA device files. Worker i of n
with M devices each then sees GPUs i*M .. i*M+M-1 of that list and nothing else, and is told so
(TFDIST_OWN_DEVICES=1), so `tfdist.devices.process_devices` takes every GPU it sees. On a machine without GPUs
nothing is set and the workers split their CPU into M logical devices, as before.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from tfdist.comm.launch_env import LOCAL_RANK_ENV, LOCAL_SIZE_ENV, OWN_DEVICES_ENV
from tfdist.errors import ConfigError

__all__ = ["per_process_env", "visible_gpus"]

_DEVICE_FILE = re.compile(r"nvidia(\d+)$")


def visible_gpus(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> list[str]:
    """The GPUs this machine shows the launcher, as CUDA_VISIBLE_DEVICES entries ([] without GPUs).

    Example:
        >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "0,2,3"})
        ['0', '2', '3']
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        entries = []
        for entry in (e.strip() for e in env["CUDA_VISIBLE_DEVICES"].split(",")):
            if not entry or entry in ("-1", "NoDevFiles") or entry.startswith("-"):
                break  # CUDA stops at the first entry that names no device
            entries.append(entry)
        return entries
    # Device files carry the host's numbers (a container may show /dev/nvidia2 and /dev/nvidia3); CUDA numbers
    # what it is shown from 0.
    found = [p for p in (dev.iterdir() if dev.is_dir() else ()) if _DEVICE_FILE.match(p.name)]
    return [str(i) for i in range(len(found))]


def per_process_env(n: int, devices_per_worker: int, gpus: list[str]) -> list[dict[str, str]]:
    """What each of the `n` local workers adds to its environment: its local rank and size, and with GPUs its own
    `devices_per_worker` of them. ConfigError, before anything starts, when there are too few GPUs."""
    envs = [{LOCAL_RANK_ENV: str(i), LOCAL_SIZE_ENV: str(n)} for i in range(n)]
    if not gpus:
        return envs
    need = n * devices_per_worker
    if need > len(gpus):
        raise ConfigError(
            f"-n {n} --devices-per-worker {devices_per_worker} needs {need} GPUs, one set per worker, but this machine "
            f"shows {len(gpus)} (CUDA_VISIBLE_DEVICES or /dev/nvidia*: {','.join(gpus)}). Start fewer workers or "
            "give each fewer devices; to train on logical CPUs instead, set CUDA_VISIBLE_DEVICES= (empty).")
    for i, env in enumerate(envs):
        mine = gpus[i * devices_per_worker:(i + 1) * devices_per_worker]
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(mine), OWN_DEVICES_ENV: "1"})
    return envs
