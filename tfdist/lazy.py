"""A package's public names, each imported from its module on first use: importing the package starts no
TensorFlow, so `tfdist --help`, the launcher and the cluster layer stay light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["exports"]


def exports(package: str, table: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose public names map to the modules that define them (a
    submodule's own name maps to itself). Use: `__getattr__, __dir__ = exports(__name__, {"init": "pkg.api"})`."""

    def __getattr__(name: str):
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if module.__name__ == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
