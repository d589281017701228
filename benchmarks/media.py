"""Image loading at the machine's speed: JPEG decode + random resized crop to 224 + flip +
batch 64 with 2 workers, against the physical bound and against Grain and torch.

Every arm runs the same two functions on the same JPEG bytes: :func:`decode` (Zephon's
``decode_image``, Pillow) and :func:`crop_and_flip` (a random resized crop, scale 0.25-1
and aspect 3/4-4/3, resized bilinear to 224x224 with Pillow, then a random horizontal
flip). The arms:

* ``bound``: two processes doing nothing but decode + crop in a loop over their half of
  the images: what two cores can do at most (no batching, no transport);
* ``zephon``: ``TarShardSource -> decode_image -> random_map(crop_and_flip) -> batch(64)``,
  ``workers=2``; ``zephon_zero_copy`` the same with ``zero_copy=True`` (batches are views
  of the worker's shared-memory ring slot: written once, by ``batch``, never copied);
* ``grain``: ``MapDataset.source(the same TarShardSource).map(decode).random_map(crop)
  .repeat().to_iter_dataset().batch(64).mp_prefetch(num_workers=2)`` (Grain 0.2.18);
* ``torch``: ``DataLoader(batch_size=64, num_workers=2)`` over a ``Dataset`` doing the same.

Reported: images/s (steady state, after the first batch), the parent's CPU seconds per
batch, the summed PSS of the parent and its descendants at steady state (in the first
round, before the parent imports Grain and torch), and the ratios
that the goals are about: zephon/bound (goal >= 0.9), zephon/grain (>= 1.3), zephon/torch
(>= 1.2). The arms run in turn, ``--repeats`` rounds of each (3), 60 batches each (a
window past the first pass over the ring's slots); the figures are medians and each ratio
the median of its rounds' (the bound alone moves by 10-20% between runs on a shared VM).

    python -m benchmarks.media [--quick] [--images N] [--batches N] [--repeats N]
                               [--no-grain] [--no-torch]
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import signal
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import zephon as zp
from benchmarks.harness.cpu import descendant_pids
from benchmarks.harness.results import write_results
from benchmarks.harness.tables import print_table
from zephon.operators.decode_image import DecodeImage

CROP = 224
BATCH = 64
WORKERS = 2
IMAGE_WH = (400, 300)
_DECODER = DecodeImage("jpg")


def decode(raw: bytes) -> np.ndarray:
    """JPEG bytes to uint8 HWC RGB, as ``decode_image`` does."""
    return _DECODER.decode(raw)


def crop_and_flip(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random resized crop to CROP x CROP (bilinear) and a random horizontal flip."""
    from PIL import Image

    h, w = image.shape[:2]
    area = h * w * rng.uniform(0.25, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw = int(min(w, max(8, round(np.sqrt(area * aspect)))))
    ch = int(min(h, max(8, round(np.sqrt(area / aspect)))))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    out = Image.fromarray(image).resize(
        (CROP, CROP), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch)
    )
    array = np.asarray(out)
    if rng.random() < 0.5:
        array = array[:, ::-1]
    return np.ascontiguousarray(array)


def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """Photo-like JPEGs (smooth shapes plus grain), quality 90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = IMAGE_WH
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for _ in range(n):
        fx, fy, phase = rng.uniform(0.005, 0.05, 3)
        base = np.stack(
            [
                128 + 100 * np.sin(x * fx + phase),
                128 + 100 * np.cos(y * fy + phase * 2),
                128 + 100 * np.sin((x + y) * (fx + fy) / 2),
            ],
            -1,
        )
        noisy = base + rng.normal(0, 12, base.shape)
        buf = io.BytesIO()
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def write_shards(folder: Path, jpegs: list[bytes], per_shard: int = 128) -> list[str]:
    paths = []
    for s in range(0, len(jpegs), per_shard):
        path = folder / f"images-{s // per_shard:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(s, min(s + per_shard, len(jpegs))):
                info = tarfile.TarInfo(f"{i:08d}.jpg")
                info.size = len(jpegs[i])
                tar.addfile(info, io.BytesIO(jpegs[i]))
        paths.append(str(path))
    return paths


def summed_pss_bytes() -> int:
    from benchmarks.worker_memory import pss_bytes

    return sum(pss_bytes(pid) for pid in [os.getpid(), *descendant_pids()])


def measure(batches: Iterator[Any], n: int) -> dict[str, float]:
    """Images/s over ``n`` batches after the first, the parent's CPU per batch, and the
    summed PSS half-way."""
    next(batches)  # start-up out of the window
    pss = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(n):
        next(batches)
        if k == n // 2:
            pss = summed_pss_bytes()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "images_per_s": n * BATCH / wall,
        "parent_cpu_ms_per_batch": cpu / n * 1e3,
        "pss_mib": pss / 2**20,
    }


# ---------------------------------------------------------------------- the arms
def _bound_worker(jpegs: list[bytes], rounds: int, start: Any, out: Any) -> None:
    rng = np.random.default_rng(os.getpid())
    start.wait()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for raw in jpegs:
            crop_and_flip(decode(raw), rng)
    out.put((t0, time.perf_counter()))


def run_bound(jpegs: list[bytes], images: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("fork")
    rounds = max(1, -(-images // len(jpegs)))
    start, out = ctx.Barrier(WORKERS), ctx.Queue()
    halves = [jpegs[i::WORKERS] for i in range(WORKERS)]
    procs = [ctx.Process(target=_bound_worker, args=(h, rounds, start, out)) for h in halves]
    for p in procs:
        p.start()
    spans = [out.get() for _ in procs]
    for p in procs:
        p.join()
    wall = max(s[1] for s in spans) - min(s[0] for s in spans)
    return {
        "images_per_s": rounds * len(jpegs) / wall,
        "parent_cpu_ms_per_batch": float("nan"),
        "pss_mib": float("nan"),
    }


def _zephon_crop(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    return {"image": crop_and_flip(sample["image"], rng)}


def run_zephon(paths: list[str], n: int, zero_copy: bool = False) -> dict[str, float]:
    src = zp.StaticMixtureWorkSource([zp.TarShardSource(paths)], seed=0, chunk_size=16)
    pipe = (
        zp.Pipeline(src, canonical_replicas=WORKERS, workers=WORKERS, seed=0, zero_copy=zero_copy)
        .fetch()
        .decode_image("jpg", to="image")
        .random_map(_zephon_crop)
        .batch(BATCH)
    )
    with pipe:
        return measure(iter(pipe), n)


def _grain_decode(sample: dict[str, Any]) -> np.ndarray:
    return decode(sample["jpg"])


def run_grain(paths: list[str], n: int) -> dict[str, float]:
    from benchmarks.grain_baseline import _grain

    grain = _grain()
    ds = grain.MapDataset.source(zp.TarShardSource(paths)).seed(0).shuffle()
    ds = ds.map(_grain_decode).random_map(crop_and_flip).repeat()
    it_ds = ds.to_iter_dataset().batch(BATCH, drop_remainder=True)
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=WORKERS))
    it = iter(it_ds)
    try:
        return measure(it, n)
    finally:
        close = getattr(it, "close", None) or getattr(it, "__del__", None)
        if close is not None:
            close()


class _TorchImages:
    def __init__(self, paths: list[str]) -> None:
        self.source = zp.TarShardSource(paths)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng(i)
        return crop_and_flip(decode(self.source[i]["jpg"]), rng)


def _stack(items: list[np.ndarray]) -> np.ndarray:
    return np.stack(items)


def run_torch(paths: list[str], n: int) -> dict[str, float]:
    import torch.utils.data as tud

    loader: tud.DataLoader[np.ndarray] = tud.DataLoader(
        _TorchImages(paths),  # type: ignore[arg-type]
        batch_size=BATCH,
        shuffle=True,
        num_workers=WORKERS,
        collate_fn=_stack,
        persistent_workers=True,
        drop_last=True,
    )

    def forever() -> Generator[np.ndarray, None, None]:
        while True:
            yield from loader

    batches = forever()
    try:
        return measure(batches, n)
    finally:
        batches.close()
        workers = getattr(loader, "_iterator", None)  # persistent workers: stop them now
        if workers is not None:
            workers._shutdown_workers()


def _settle(name: str, before: set[int], timeout_s: float = 10.0) -> None:
    """Waits until the processes arm ``name`` started are gone, so that the next arm
    neither shares the cores with them nor counts their memory; ends those still there
    after ``timeout_s`` (Grain's prefetch processes outlive a closed iterator)."""
    deadline = time.monotonic() + timeout_s
    while (left := set(descendant_pids()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        print(f"  {name}: ended {len(left)} process(es) still running {timeout_s:.0f} s after it")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--images", type=int, default=None, help="distinct JPEGs in the shards")
    ap.add_argument("--batches", type=int, default=None, help="batches measured per arm")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of every arm, in turn")
    ap.add_argument("--no-grain", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--results", default="bench_results")
    args = ap.parse_args(argv)
    images = args.images or (128 if args.quick else 512)
    batches = args.batches or (3 if args.quick else 60)
    repeats = args.repeats or (1 if args.quick else 3)
    jpegs = make_jpegs(images)
    arms: dict[str, Callable[[], dict[str, float]]] = {}
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="zephon-media-") as folder:
        paths = write_shards(Path(folder), jpegs)
        arms["bound"] = lambda: run_bound(jpegs, batches * BATCH)
        arms["zephon"] = lambda: run_zephon(paths, batches)
        arms["zephon_zero_copy"] = lambda: run_zephon(paths, batches, zero_copy=True)
        if not args.no_grain:
            arms["grain"] = lambda: run_grain(paths, batches)
        if not args.no_torch:
            arms["torch"] = lambda: run_torch(paths, batches)
        before = set(descendant_pids())  # (e.g. multiprocessing's resource tracker)
        for _ in range(repeats):  # every arm once a round: the machine's drift hits all
            for name, arm in list(arms.items()):
                try:
                    got = arm()
                except ImportError as e:
                    print(f"{name}: not run ({e})")
                    del arms[name]
                    runs.pop(name, None)
                    continue
                runs.setdefault(name, []).append(got)
                _settle(name, before)
    zs = [r["images_per_s"] for r in runs["zephon"]]
    # zephon/arm in each round
    ratios = {
        name: [z / r["images_per_s"] for z, r in zip(zs, rs, strict=True)]
        for name, rs in runs.items()
    }

    def median(name: str, key: str) -> float:
        return float(np.median([r[key] for r in runs[name]]))

    rows = [
        {
            "arm": name,
            "images_per_s": round(median(name, "images_per_s"), 1),
            "zephon_ratio": round(float(np.median(ratios[name])), 3),
            "ratio_range": f"{min(ratios[name]):.2f}-{max(ratios[name]):.2f}",
            "parent_cpu_ms_per_batch": round(median(name, "parent_cpu_ms_per_batch"), 2),
            # the first round's: later, the parent holds what the other arms imported
            "pss_mib": round(runs[name][0]["pss_mib"], 1),
        }
        for name in runs
    ]
    print_table(
        rows,
        [
            "arm",
            "images_per_s",
            "zephon_ratio",
            "ratio_range",
            "parent_cpu_ms_per_batch",
            "pss_mib",
        ],
    )
    goals = {"bound": 0.9, "grain": 1.3, "torch": 1.2}
    for name, goal in goals.items():
        if name in runs:
            got = float(np.median(ratios[name]))
            print(f"zephon / {name}: {got:.2f}, the median of {repeats} rounds (goal >= {goal})")
    write_results(
        "media",
        rows,
        args.results,
        extra={
            "images": images,
            "batches": batches,
            "repeats": repeats,
            "crop": CROP,
            "batch": BATCH,
            "workers": WORKERS,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
