"""Reach-in: AutoGraph's conversion rules (`tensorflow.python.autograph.core.config.CONVERSION_RULES`).

A `tf.function` rewrites the Python it calls, recursively, with AutoGraph, except code in the modules its rules
exempt: TensorFlow's, Keras', NumPy's. tfdist is library code of the same kind: its Python control flow runs on
static structure (devices, shards, layers, groups), never on tensor values, and Keras' `fit` already runs it
unconverted. Converted, it only costs time: a custom training loop's `strategy.run` inside a `tf.function` would
have AutoGraph parse, rewrite and compile every tfdist function the step reaches, at its first trace. The user's
own step and replica function are still converted, as under TensorFlow's strategies.
"""

from __future__ import annotations

from tensorflow.python.autograph.core import config
from tensorflow.python.autograph.core.config_lib import DoNotConvert

import tfdist._compat  # noqa: F401  (the version check first)

PACKAGE = "tfdist"


def exempt_tfdist() -> None:
    """Adds tfdist to the modules AutoGraph leaves as they are (once; read by AutoGraph at each conversion)."""
    if not any(isinstance(rule, DoNotConvert) and rule.matches(PACKAGE) for rule in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (DoNotConvert(PACKAGE), *config.CONVERSION_RULES)
