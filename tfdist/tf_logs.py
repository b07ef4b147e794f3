"""TensorFlow's start-up lines: TF_CPP_MIN_LOG_LEVEL, applied also to the lines TensorFlow writes before its own
logging is set up. Quiet by default in the `tfdist` command and in notebooks.

TensorFlow's C++ start-up messages (oneDNN, CPU features) go through absl before absl's logging is
initialised, and those lines reach stderr whatever TF_CPP_MIN_LOG_LEVEL says. `quiet_tensorflow_import()`
makes the first `import tensorflow` of the process (wherever a command does it, if it does) run with stderr
captured; afterwards every captured line is written back except the absl lines below TF_CPP_MIN_LOG_LEVEL and
absl's "before InitializeLog" banner. With the variable unset or 0 (`tfdist --verbose`) nothing is hidden.

In a notebook (an IPython kernel), `import tfdist` before TensorFlow does the same with TF_CPP_MIN_LOG_LEVEL=2
unless the variable is set: a notebook's cells then store the outputs, not TensorFlow's start-up lines. Set
TF_CPP_MIN_LOG_LEVEL=0 before `import tfdist` to see them.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile

__all__ = ["kept_lines", "log_level", "quiet_in_notebooks", "quiet_tensorflow_import"]

# absl's prefix: severity letter, MMDD, time, thread id, file:line]
_ABSL_LINE = re.compile(r"^([IWE])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [^ \]]+:\d+\] ")
_ABSL_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_SEVERITY = {"I": 0, "W": 1, "E": 2}


def log_level() -> int:
    """TF_CPP_MIN_LOG_LEVEL as a number (0 when unset or not a number): 1 hides INFO, 2 also WARNING, 3 ERROR."""
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


def kept_lines(text: str, level: int) -> str:
    """`text` without the absl lines whose severity is below `level` (and without absl's banner if level >= 1).

    Example:
        >>> kept_lines("I0000 00:00:1.5   7 port.cc:153] oneDNN custom operations are on.\\nmine\\n", 2)
        'mine\\n'
    """
    if level < 1:
        return text
    kept = []
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == _ABSL_BANNER:
            continue
        match = _ABSL_LINE.match(line)
        if match and _SEVERITY[match.group(1)] < level:
            continue
        kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def _filtered_stderr(level: int):
    """Captures file descriptor 2 (C++ and Python writes alike) and writes back kept_lines(…, level) at the end,
    also when the body raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            sys.stderr.write(kept_lines(capture.read().decode(errors="replace"), level))
            sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
    """Runs the real loader of the `tensorflow` package inside _filtered_stderr."""

    def __init__(self, loader, level: int, python_logger: bool = False):
        self._loader, self._level, self._python_logger = loader, level, python_logger

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self._loader  # TensorFlow sees its own loader
        with _filtered_stderr(self._level):
            self._loader.exec_module(module)
        if self._python_logger:
            # In an interactive kernel TensorFlow's Python logger prints INFO to stdout ("Using MirroredStrategy
            # with devices ..."): the same level for it (get_logger creates it now, so nothing resets it later).
            module.get_logger().setLevel({1: "WARNING"}.get(self._level, "ERROR"))


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` through the other finders, once, and hands it a _QuietLoader."""

    def __init__(self, level: int, python_logger: bool = False):
        self._level, self._python_logger = level, python_logger

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensorflow":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one import only; the lookup below must not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _QuietLoader(spec.loader, self._level, self._python_logger)
        return spec


def quiet_tensorflow_import(python_logger: bool = False) -> None:
    """From now on, the first `import tensorflow` of this process hides the start-up lines below
    TF_CPP_MIN_LOG_LEVEL (and, with `python_logger`, sets TensorFlow's Python logger to the same level).
    Nothing to do when TensorFlow is already imported or the level is 0."""
    level = log_level()
    if level < 1 or "tensorflow" in sys.modules or any(isinstance(f, _QuietFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _QuietFinder(level, python_logger))


def quiet_in_notebooks() -> None:
    """In an IPython kernel, before TensorFlow starts: TF_CPP_MIN_LOG_LEVEL=2 unless set, and the first
    `import tensorflow` keeps its start-up lines below that level out of the cells' outputs, and its Python
    logger's INFO lines too."""
    if "ipykernel" not in sys.modules or "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    quiet_tensorflow_import(python_logger=True)
