"""How fast does copying an array out of a shared mapping run, by placement?

Not a test (not collected, asserts nothing): a measurement behind the choice of
PAYLOAD_PHASE in native/ring.h. Run: python tests/unit/shm/bench_aliasing.py

Table 1 copies from a page-aligned source plus an offset into fresh numpy
arrays, as ``Message`` copy-out does. Table 2 pins the distance
(dst - src) mod 4096 with a preallocated destination, which is what 4 KiB
aliasing depends on: a copy whose destination sits a few dozen bytes past its
source (mod 4096) can run several times slower on some CPUs/memcpy variants.
"""

from __future__ import annotations

import mmap
import time

import numpy as np

SIZES = [192 * 1024, 1 << 20, 4 << 20]
SOURCE_OFFSETS = [0, 16, 64, 1024, 2048, 4032]
DISTANCES = [0, 16, 32, 48, 64, 128, 2048, 4064, 4080]


def rate(copy, nbytes: int) -> float:
    reps = max(20, int(2e9 // nbytes) // 10)
    copy()
    start = time.perf_counter()
    for _ in range(reps):
        copy()
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def main() -> None:
    mm = mmap.mmap(-1, 64 << 20)
    source = np.frombuffer(mm, np.uint8)
    source[:] = 7
    print("fresh destination (np.array(view)): GB/s by source offset mod 4096")
    print("nbytes".rjust(10) + "".join(f"{o:>9}" for o in SOURCE_OFFSETS))
    for nbytes in SIZES:
        row = [
            rate(lambda o=o, n=nbytes: np.array(source[4096 + o : 4096 + o + n]), nbytes)
            for o in SOURCE_OFFSETS
        ]
        print(f"{nbytes:>10}" + "".join(f"{r:9.1f}" for r in row))

    print("\npreallocated destination: GB/s by (dst - src) mod 4096")
    print("nbytes".rjust(10) + "".join(f"{d:>9}" for d in DISTANCES))
    dest = np.empty(32 << 20, np.uint8)
    dest[:] = 0
    src_start = 8192 + 2048
    src_addr = source.ctypes.data + src_start
    for nbytes in SIZES:
        row = []
        for distance in DISTANCES:
            d = (src_addr + distance - dest.ctypes.data) % 4096 + 8192
            src, dst = source[src_start : src_start + nbytes], dest[d : d + nbytes]
            assert (dst.ctypes.data - src.ctypes.data) % 4096 == distance
            row.append(rate(lambda s=src, t=dst: np.copyto(t, s), nbytes))
        print(f"{nbytes:>10}" + "".join(f"{r:9.1f}" for r in row))


if __name__ == "__main__":
    main()
