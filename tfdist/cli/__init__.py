"""The `tfdist` command: train, bench, and the commands later layers add."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

# TensorFlow's C++ start-up chatter (oneDNN, CPU features) is noise on a command line; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.cli import bench, build_horovod, launch, plan, train
from tfdist.cli import cluster as cluster_command

# Each command module has add_parser(subparsers) and run(args) -> int.
COMMANDS = [train, launch, bench, plan, cluster_command, build_horovod]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfdist", description="Distributed Keras 3 training on TensorFlow.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tfdist.errors import TfdistError  # after parsing: `tfdist --help` stays fast (no TF import)

    try:
        return args.run(args) or 0
    except TfdistError as err:
        print(f"tfdist {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
