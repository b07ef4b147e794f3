"""Exceptions tfdist raises for bad input: each names the parameter, what came, and the fix."""


class TfdistError(Exception):
    """Base class of every error tfdist raises on purpose."""


class ConfigError(TfdistError, ValueError):
    """A parameter has a value tfdist cannot use (the message names it and says what would work)."""


class InitOrderError(TfdistError, RuntimeError):
    """Something must happen before TensorFlow initialises its devices, and it did not."""
