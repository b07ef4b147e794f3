"""ZeRO: who owns optimizer, gradient and (stage 3, `zero.fsdp`) parameter state across data-parallel replicas.

Users turn it on with `zero_stage=` on a strategy; what they call here:

- `engine_of(optimizer)`: the ZeRO engine behind an optimizer built in a tfdist scope (None for plain Keras);
- `memory_report(strategy, model)` / `MemoryReport`, `zero_formula(...)`: bytes per replica, measured and as
  the formula says;
- `gathered_state(optimizer)`: a context in which the sharded optimizer state reads as whole variables;
- `configure_stage3(strategy, unit_bytes=..., ...)`: how stage 3 groups layers into units, before the first `fit`;
- `register_elementwise(optimizer_class)`: declare a custom optimizer element-wise, so it can be sharded.

Example:
    >>> strategy = tfdist.MirroredStrategy(zero_stage=2)
    >>> with strategy.scope():
    ...     model = tfdist.models.cnn()
    ...     model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    >>> model.fit(data.train, epochs=1)
    >>> tfdist.zero.engine_of(model.optimizer).stage
    2
"""

from __future__ import annotations

from tfdist.lazy import exports

# public name -> the module that defines it, imported on first use
_LAZY = {
    "engine_of": "tfdist.zero.attach",
    "gathered_state": "tfdist.zero.attach",
    "configure_stage3": "tfdist.zero.attach",
    "memory_report": "tfdist.zero.memory",
    "MemoryReport": "tfdist.zero.memory",
    "zero_formula": "tfdist.zero.memory",
    "register_elementwise": "tfdist.zero.config",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = exports(__name__, _LAZY)
