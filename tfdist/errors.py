"""Exceptions tfdist raises for bad input: each names the parameter, what came, and the fix.

Errors about a situation at run time (a lost worker, a peer that never starts, a port in use, TensorFlow started too
early) end with `troubleshooting(anchor)`, which points at the entry of docs/troubleshooting.md that explains them.
"""

TROUBLESHOOTING_PAGE = "docs/troubleshooting.md"


class TfdistError(Exception):
    """Base class of every error tfdist raises on purpose."""

    # Exception's own constructor, not ValueError's or RuntimeError's: AutoGraph re-raises an error from a user's
    # converted function (a custom loop's step) as its own type only when the type takes its message this way;
    # otherwise the user gets a StagingError and `except ConfigError` misses it.
    __init__ = Exception.__init__


class ConfigError(TfdistError, ValueError):
    """A parameter has a value tfdist cannot use (the message names it and says what would work)."""


class InitOrderError(TfdistError, RuntimeError):
    """Something must happen before TensorFlow initialises its devices, and it did not."""


def troubleshooting(anchor: str) -> str:
    """The end of a runtime error's message: where docs/troubleshooting.md explains it (`anchor` is the entry's
    heading as GitHub makes it an anchor).

    Example:
        >>> troubleshooting("a-worker-was-lost")
        ' See docs/troubleshooting.md#a-worker-was-lost.'
    """
    return f" See {TROUBLESHOOTING_PAGE}#{anchor}."


def check_seconds(value, name: str) -> float:
    """`value` as float seconds, or a ConfigError naming `name` unless it is a number > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}.")
    return float(value)


def import_extra(module: str, extra: str, purpose: str):
    """Imports `module`, or raises a ConfigError saying which pip extra of tfdist brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{purpose} needs {module.split('.')[0]!r}, which is not installed: "
                          f"pip install 'tfdist[{extra}]' (from a clone: pip install -e '.[cpu,{extra}]').") from err
