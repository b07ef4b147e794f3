"""`tfdist launch`: run a training command as N local worker processes (TF_CONFIG or Horovod/Gloo)."""

from __future__ import annotations

import argparse
import signal
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run a command as N local workers",
        description="Start N local processes of COMMAND with a per-rank environment (TF_CONFIG on free loopback "
                    "ports for --backend tf). Output lines are prefixed with the rank; when one worker fails the "
                    "others are stopped, and the first non-zero exit code is returned.",
        epilog="example: tfdist launch -n 2 -- tfdist train --strategy multiworker --epochs 3")
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of worker processes")
    p.add_argument("--devices-per-worker", type=int, default=1,
                   help="local devices per worker (logical CPUs on a machine without GPUs; default 1)")
    p.add_argument("--backend", default="tf", help="tf (TF_CONFIG, default) or horovod (Gloo rendezvous)")
    p.add_argument("--timeout", type=float, default=None, help="stop the whole job after this many seconds")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run in every worker")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tfdist.cluster.launcher import launch
    from tfdist.errors import ConfigError

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ConfigError("no command given; usage: tfdist launch -n 2 -- python train.py")

    def stop(signum, frame):  # a SIGTERM to the launcher stops the workers too (via the cleanup in launch)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        return launch(cmd, args.num_workers, devices_per_worker=args.devices_per_worker, backend=args.backend,
                      timeout_s=args.timeout)
    except KeyboardInterrupt:
        print("[launch] interrupted; workers stopped", file=sys.stderr)
        return 130
