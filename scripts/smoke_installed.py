"""Checks an installed Zephon from outside the source tree (run it from a temp dir, with the
interpreter it was installed for): it is imported from there, not from a checkout; its version
is the distribution's; the C extensions are the compiled ones (``--expect native``) or all
absent so that the pure-Python twins run (``--expect python``); and a tiny pipeline runs,
checkpoints and resumes exactly, in this process and over a worker process's ring.

``scripts/test-wheel`` runs it in a fresh venv with the wheel installed; tests/package runs it
over a wheel built without a C compiler. Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.metadata
import os
import sys
import tempfile
from typing import Any

#: The C extensions built from native/ (``native/X_module.c`` -> ``zephon._X``).
EXTENSIONS = ("_pack", "_permute", "_ring", "_state", "_tokens", "_track")


def _fail(message: str) -> None:
    print(f"smoke_installed: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def _pipeline(workers: int) -> Any:
    import zephon as zp

    docs = [f"document {i}: " + "lorem ipsum " * (i % 9 + 1) for i in range(96)]
    src = zp.StaticMixtureWorkSource(
        datasets={"a": zp.ArraySource(docs[:64]), "b": zp.ArraySource(docs[64:])},
        weights={"a": 0.75, "b": 0.25},
        seed=0,
        chunk_size=8,
    )
    return (
        zp.Pipeline(src, canonical_replicas=2, flush_every_k_chunks=2, workers=workers)
        .fetch()
        .tokenize(zp.ByteTokenizer())
        .split(max_len=48)
        .pack(seq_len=48, num_bins=4)
        .shuffle(buffer_size=8)
        .batch(4)
    )


def _batches(pipe: Any, n: int) -> list[bytes]:
    return [b"".join(v.tobytes() for _, v in sorted(next(pipe).items())) for _ in range(n)]


def _tiny_run(workers: int, tmp: str) -> None:
    """12 batches uninterrupted == 5 batches, a checkpoint file, a new pipeline restored from
    it, 7 more."""
    import zephon as zp

    path = os.path.join(tmp, f"loader-{workers}.zph")
    with _pipeline(workers) as pipe:
        ref = _batches(pipe, 12)
    with _pipeline(workers) as pipe:
        head = _batches(pipe, 5)
        zp.save(path, pipe.checkpoint())
    with _pipeline(workers) as pipe:
        pipe.restore(zp.load(path))
        tail = _batches(pipe, 7)
    if head + tail != ref:
        _fail(f"the tiny pipeline (workers={workers}) did not resume exactly")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect", choices=("native", "python"), required=True)
    parser.add_argument(
        "--under",
        default=sys.prefix,
        help="the directory zephon must be imported from (default: this interpreter's prefix)",
    )
    args = parser.parse_args()
    if os.environ.get("ZEPHON_PURE_PYTHON"):
        _fail("ZEPHON_PURE_PYTHON is set: unset it, this checks what was installed")

    import zephon

    package = os.path.dirname(os.path.realpath(zephon.__file__))
    under = os.path.realpath(args.under)
    if os.path.commonpath([package, under]) != under:
        _fail(f"zephon was imported from {package}, not from under {under} (a checkout?)")
    if "jax" in sys.modules:
        _fail("import zephon imported jax")
    dist_version = importlib.metadata.version("zephon")
    if zephon.__version__ != dist_version:
        _fail(f"zephon.__version__ is {zephon.__version__!r}; the distribution's {dist_version!r}")

    from zephon import _native
    from zephon.shm import ring

    loaded = {name: _native.load(name) for name in EXTENSIONS}
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    if args.expect == "native":
        missing = [name for name, mod in loaded.items() if mod is None]
        if missing:
            _fail(f"C extensions not importable: {', '.join(missing)}")
        for name, mod in loaded.items():
            where = os.path.realpath(mod.__file__ or "")
            if not where.endswith(suffixes) or os.path.dirname(where) != package:
                _fail(f"zephon.{name} is {where}, not a compiled extension in {package}")
    else:
        present = [name for name, mod in loaded.items() if mod is not None]
        built = [f for f in os.listdir(package) if f.endswith(suffixes)]
        if present or built:
            _fail(f"expected no C extensions; found {', '.join(present + built)}")
    if ring.IMPLEMENTATION != args.expect:
        _fail(f"the ring's implementation is {ring.IMPLEMENTATION!r}, not {args.expect!r}")

    with tempfile.TemporaryDirectory(prefix="zephon-smoke-") as tmp:
        for workers in (0, 1):
            _tiny_run(workers, tmp)
    print(
        f"smoke_installed: zephon {zephon.__version__} from {package}: {args.expect} "
        f"({len(EXTENSIONS)} extensions {'compiled' if args.expect == 'native' else 'absent'}); "
        "a tiny pipeline resumed exactly with workers=0 and 1"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
