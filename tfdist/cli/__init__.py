"""The `tfdist` command: train, bench, and the commands later layers add.

Arguments are parsed and checked before TensorFlow is imported (seconds), so a bad name or number fails at
once; TensorFlow's C++ start-up and INFO lines are hidden unless `tfdist --verbose` or TF_CPP_MIN_LOG_LEVEL
says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from tfdist.cli import bench, build_horovod, launch, plan, train
from tfdist.cli import cluster as cluster_command

# Each command module has add_parser(subparsers) and run(args) -> int.
COMMANDS = [train, launch, bench, plan, cluster_command, build_horovod]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tfdist", description="Distributed Keras 3 training on TensorFlow.")
    parser.add_argument("--verbose", dest="tf_logs", action="store_true",
                        help="show TensorFlow's C++ start-up and INFO log lines (default: hidden, as with "
                             "TF_CPP_MIN_LOG_LEVEL=2, unless that variable is set); goes before the command")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # argparse exits 2 on a bad name or number: no TensorFlow yet
    if not args.tf_logs:
        # Quiet unless asked; the variable reaches TensorFlow here and in the processes a command starts.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist.tf_logs import quiet_tensorflow_import

    quiet_tensorflow_import()  # TensorFlow's lines from before its logging starts obey the variable too
    from tfdist.errors import TfdistError

    try:
        return args.run(args) or 0
    except TfdistError as err:
        print(f"tfdist {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
