"""Which lanes a rank owns.

Lanes are dealt to data-parallel groups as contiguous blocks of ``canonical_replicas``;
model-parallel peers in one DP group read the same lanes. Defaults come from
``jax.process_index()/process_count()`` when ``jax.distributed`` is initialised, else
from ``torch.distributed.get_rank()/get_world_size()`` when a default process group is,
else a single rank (neither library is imported here; we only look at one the program
already imported).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from zephon._args import positive_int


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    canonical_replicas: int

    @property
    def lanes(self) -> list[int]:
        per = self.canonical_replicas // self.dp_size
        return list(range(self.dp_rank * per, (self.dp_rank + 1) * per))


def _jax_process() -> tuple[int, int] | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import distributed  # the public API has no "is initialised" query

        if distributed.global_state.client is None:
            return None
        return int(jax.process_index()), int(jax.process_count())
    except Exception:  # noqa: BLE001 - any JAX version skew means "not initialised"
        return None


def _torch_process() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - a torch without distributed support: not initialised
        return None


def launcher_process() -> tuple[int, int] | None:
    """``(rank, world_size)`` of an initialised ``jax.distributed`` or, failing that,
    ``torch.distributed`` default process group; None without either."""
    return _jax_process() or _torch_process()


def resolve_topology(
    canonical_replicas: int,
    rank: int | None = None,
    world_size: int | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
) -> Topology:
    canonical_replicas = positive_int("canonical_replicas", canonical_replicas)
    if rank is None or world_size is None:
        jp = launcher_process()
        if rank is None:
            rank = jp[0] if jp else 0
        if world_size is None:
            world_size = jp[1] if jp else 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size; got rank={rank}, world_size={world_size}")
    dp_rank = rank if dp_rank is None else dp_rank
    dp_size = world_size if dp_size is None else dp_size
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size; got dp_rank={dp_rank}, dp_size={dp_size}")
    if canonical_replicas % dp_size:
        raise ValueError(
            f"canonical_replicas={canonical_replicas} is not divisible by dp_size={dp_size}; "
            "every data-parallel group needs the same number of lanes — pick canonical_replicas "
            f"as a multiple of {dp_size}"
        )
    return Topology(rank, world_size, dp_rank, dp_size, canonical_replicas)
