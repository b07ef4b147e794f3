"""`tfdist launch`: run a training command as N local worker processes (TF_CONFIG or Horovod/Gloo), or as a
parameter-server job (chief, N workers, K parameter servers) with --ps K."""

from __future__ import annotations

import argparse
import signal
import sys

ALL_REDUCE_RULES = """\
Start N local processes of COMMAND with a per-rank environment (TF_CONFIG on free loopback ports for
--backend tf, a Gloo rendezvous for --backend horovod). Output lines are prefixed with the rank; when
one worker fails the others are stopped (a worker found stopped by SIGSTOP is named too), and the first
non-zero exit code is returned.

restarts (--max-restarts R, all-reduce jobs; default 0):
  when a worker fails, the others are stopped and all N workers start again, at most R times per job,
  with a fresh TF_CONFIG / Gloo rendezvous and TFDIST_RESTART_COUNT=1..R; the program resumes from its
  own checkpoint (tfdist.training.BackupAndRestore). The job ends with the last round's code.
"""
PS_RULES = """\
parameter-server jobs (--ps K, --backend tf only):
  starts 1 chief + N workers + K parameter servers, each with TF_CONFIG (jobs chief, worker, ps),
  TFDIST_ROLE (chief/worker/ps) and TFDIST_RANK (chief 0, workers 1..N, parameter servers N+1..N+K);
  output lines are prefixed [chief], [worker i], [ps j].
  - the job's exit code is the chief's; when the chief exits (any code) the workers and parameter
    servers are stopped (their TF servers never end by themselves): that is not a failure;
  - a worker that fails does not stop the job (the chief reschedules its steps); it is restarted with
    the same TF_CONFIG, so it rejoins, at most --max-restarts times per worker, after 1, 2, 4 ... s
    (at most 30 s) (a worker that exits with code 0 is not restarted);
  - a parameter server that ends is reported and not restarted; the chief decides how the job ends;
  - --timeout stops everything and returns 124, as for any job.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run a command as N local workers (or a parameter-server job with --ps)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=ALL_REDUCE_RULES + "\n" + PS_RULES,
        epilog="examples:\n  tfdist launch -n 2 -- tfdist train --strategy multiworker --epochs 3\n"
               "  tfdist launch -n 2 --max-restarts 3 -- tfdist train --strategy multiworker --backup-dir ckpt\n"
               "  tfdist launch -n 2 --ps 1 -- tfdist train --strategy ps --steps-per-epoch 50\n"
               "  tfdist launch --nnodes 2 --node-rank 0 --master 10.0.0.1:29400 -n 4 -- python train.py  # node 0\n"
               "  tfdist launch --nnodes 2 --node-rank 1 --master 10.0.0.1:29400 -n 4 -- python train.py  # node 1")
    p.add_argument("-n", "--num-workers", type=int, required=True, help="number of worker processes")
    p.add_argument("--devices-per-worker", type=int, default=1,
                   help="local devices per worker (logical CPUs on a machine without GPUs; default 1)")
    p.add_argument("--backend", default="tf", choices=("tf", "horovod"),
                   help="tf (TF_CONFIG, default) or horovod (Gloo rendezvous)")
    p.add_argument("--ps", type=int, default=None, metavar="K",
                   help="K >= 1 parameter servers: run a parameter-server job (chief + N workers + K ps; see above)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="R",
                   help="restart all workers when one fails, at most R times (default 0: the job fails); with --ps: "
                        "restart a failed worker at most R times (default 3; 0: never)")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop the whole job after this many seconds (with --nnodes, its waits for the other nodes too)")
    p.add_argument("--network", choices=("private", "host"), default="private",
                   help="private (default): --backend tf jobs run in a network namespace with loopback only, so "
                        "their unauthenticated TF servers are reachable from the job alone; host: this machine's "
                        "network (see docs/security.md)")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="run each worker on an emulated node whose link runs at RATE (e.g. 1gbit, 10gbit; "
                        "network namespaces + tc, root only; --backend tf or horovod)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="machines in the job (default 1); run the same command on each with its --node-rank")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="this machine's index, 0..N-1")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="with --nnodes: an address of node 0 that every node reaches (not loopback across machines) "
                        "and a free port, where the nodes' launchers meet; IPv6 in brackets: [fd00::1]:29400")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, metavar="S",
                   help="seconds to wait for every node at each (re)start (default 300; --timeout ends the wait "
                        "when it comes first)")
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
        return launch(cmd, args.num_workers, ps=args.ps, max_restarts=args.max_restarts, network=args.network,
                      link_rate=args.link_rate, nnodes=args.nnodes, node_rank=args.node_rank, master=args.master,
                      rdzv_timeout_s=args.rdzv_timeout,
                      devices_per_worker=args.devices_per_worker, backend=args.backend, timeout_s=args.timeout)
    except KeyboardInterrupt:
        print("[launch] interrupted; workers stopped", file=sys.stderr)
        return 130
