"""Checks of benchmark options shared by the `tfdist bench` modules (light: no TensorFlow import)."""

from __future__ import annotations

import argparse

__all__ = ["require_at_least"]


def require_at_least(args: argparse.Namespace, **minimums: float) -> None:
    """Raises a ConfigError naming the first option below its minimum, e.g.
    `require_at_least(args, rounds=1, batch_size=1)` -> "--batch-size must be >= 1, got 0."."""
    from tfdist.errors import ConfigError

    for name, least in minimums.items():
        value = getattr(args, name)
        if value < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}, got {value}.")
