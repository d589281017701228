"""JAX integration: global ``jax.Array`` batches with device prefetch, and the loader's
state in Orbax checkpoints (the v0 ``CheckpointManager`` args and the v1 checkpointable).

``import zephon`` never imports this package; this package imports JAX, and Orbax only
when one of its names is first used (``pip install 'zephon[jax]'`` installs both).
"""

from __future__ import annotations

from typing import Any

from zephon.jax.arrays import GlobalBatches, global_batches

__all__ = [
    "CheckpointRestore",
    "CheckpointSave",
    "Checkpointable",
    "GlobalBatches",
    "LoaderCheckpointHandler",
    "global_batches",
]

#: name -> the module of zephon.jax that defines it (each imports Orbax)
_ORBAX_NAMES = {
    "CheckpointRestore": "orbax",
    "CheckpointSave": "orbax",
    "LoaderCheckpointHandler": "orbax",
    "Checkpointable": "orbax_v1",
}


def __getattr__(name: str) -> Any:
    module = _ORBAX_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon.jax' has no attribute {name!r}")
    import importlib

    try:
        mod = importlib.import_module(f"zephon.jax.{module}")
    except ImportError as e:
        needs = (
            "orbax-checkpoint with its v1 API (tested with 0.12.8)"
            if module == "orbax_v1"
            else "orbax-checkpoint"
        )
        raise ImportError(
            f"zephon.jax.{name} needs {needs}: pip install 'zephon[jax]' ({e})"
        ) from e
    return getattr(mod, name)
