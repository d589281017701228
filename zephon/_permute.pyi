from collections.abc import Sequence
from typing import Any

from typing_extensions import Buffer

def permute_into(
    positions: Buffer, out: Buffer, n: int, half_bits: int, round_keys: Sequence[int], /
) -> None: ...
def length_table(lengths: tuple[Any, ...], codes: Buffer, keys: Buffer, /) -> Any: ...
def mixture_rebuild(
    f64: Buffer,
    i64: Buffer,
    heaps: Buffer,
    table: Any,
    lane: int,
    num_lanes: int,
    seed: int,
    flags: int,
    vtime: float,
    /,
) -> tuple[int, int, float]: ...
def mixture_picks(
    f64: Buffer,
    i64: Buffer,
    heaps: Buffer,
    table: Any,
    out: Buffer,
    k: int,
    eligible: int,
    waiting: int,
    vtime: float,
    weight_sum: float,
    lane: int,
    num_lanes: int,
    seed: int,
    chunk_id: int,
    flags: int,
    /,
) -> tuple[int, int, int, float, float, int, int]: ...
