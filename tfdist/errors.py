"""Exceptions tfdist raises for bad input: each names the parameter, what came, and the fix."""


class TfdistError(Exception):
    """Base class of every error tfdist raises on purpose."""


class ConfigError(TfdistError, ValueError):
    """A parameter has a value tfdist cannot use (the message names it and says what would work)."""


class InitOrderError(TfdistError, RuntimeError):
    """Something must happen before TensorFlow initialises its devices, and it did not."""


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
