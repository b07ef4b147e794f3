"""Output paths of a command: checked before any work starts, and never a lost result when a write fails."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from tfdist.errors import ConfigError

__all__ = ["check_output_path", "write_or_rescue"]


def check_output_path(path: str | None, parameter: str, *, directory: bool = False) -> None:
    """ConfigError naming `parameter` when `path` (a file, or a directory with `directory=True`) cannot be
    written: a parent that is a regular file, a file where a directory is wanted (or the reverse), or a
    parent directory this process may not write into. Missing parent directories are fine (they are made).

    Example:
        >>> check_output_path("/etc/passwd/model.keras", "--save")
        Traceback (most recent call last):
        tfdist.errors.ConfigError: --save /etc/passwd/model.keras: /etc/passwd is a file, not a directory ...
    """
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.exists(full):
        if directory and not os.path.isdir(full):
            raise ConfigError(f"{parameter} {path}: it is a file, but a directory is needed. Pick another path.")
        if not directory and os.path.isdir(full):
            raise ConfigError(f"{parameter} {path}: it is a directory, but a file is needed. Name a file in it.")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{parameter} {path}: {parent} is a file, not a directory, so nothing can be written "
                          "below it. Pick a path in a directory.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{parameter} {path}: this process may not write in {parent}. Pick a writable path.")


def write_or_rescue(path: str, write: Callable[[str], None], what: str) -> str:
    """Calls `write(path)`; if that fails with an OSError, writes to a fresh temporary directory instead and
    says where on stderr, so a finished training is never lost to an output error. Returns the path written.
    """
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        write(path)
        return path
    except OSError as err:
        rescue = os.path.join(tempfile.mkdtemp(prefix="tfdist-rescued-"), os.path.basename(path) or "output")
        write(rescue)
        print(f"tfdist: could not write {what} to {path} ({err.strerror or err}); wrote it to {rescue} instead",
              file=sys.stderr, flush=True)
        return rescue
