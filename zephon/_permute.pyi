from collections.abc import Sequence

from typing_extensions import Buffer

def permute_into(
    positions: Buffer, out: Buffer, n: int, half_bits: int, round_keys: Sequence[int], /
) -> None: ...
