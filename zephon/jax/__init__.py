"""JAX integration: global ``jax.Array`` batches with device prefetch, and the loader's
state in Orbax checkpoints.

``import zephon`` never imports this package; this package imports JAX, and Orbax only
when one of its names is first used (``pip install 'zephon[jax]'`` installs both).
"""

from __future__ import annotations

from typing import Any

from zephon.jax.arrays import GlobalBatches, global_batches

__all__ = [
    "CheckpointRestore",
    "CheckpointSave",
    "GlobalBatches",
    "LoaderCheckpointHandler",
    "global_batches",
]

_ORBAX_NAMES = ("CheckpointRestore", "CheckpointSave", "LoaderCheckpointHandler")


def __getattr__(name: str) -> Any:
    if name in _ORBAX_NAMES:
        try:
            from zephon.jax import orbax as _orbax
        except ImportError as e:
            raise ImportError(
                f"zephon.jax.{name} needs orbax-checkpoint: pip install 'zephon[jax]'"
            ) from e
        return getattr(_orbax, name)
    raise AttributeError(f"module 'zephon.jax' has no attribute {name!r}")
