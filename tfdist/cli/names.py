"""The names the command line accepts, as plain tuples: argparse checks them before TensorFlow is imported.

The tables they mirror live in modules that import TensorFlow (tfdist.strategies.factory, tfdist.data);
tests/test_cli_fast.py checks that these tuples equal them.
"""

from __future__ import annotations

__all__ = ["DATASET_NAMES", "STRATEGY_NAMES"]

# tfdist.strategies.strategy_names(): "default" (TensorFlow's own) and the keys of factory.CLASSES.
STRATEGY_NAMES = ("default", "horovod", "mirrored", "multiworker", "placement", "ps")
# tfdist.data.DATASET_NAMES
DATASET_NAMES = ("mnist", "digits")
