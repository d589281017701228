"""A loader state as named files, the one layout of every framework checkpoint adapter:
Orbax's v0 handler and v1 checkpointable (:mod:`zephon.jax.orbax`,
:mod:`zephon.jax.orbax_v1`) write the files into their item directory, and
:mod:`zephon.torch` writes them as ``torch.distributed.checkpoint`` entries (one uint8
tensor per file). Each file is bytes of :func:`zephon.checkpoint.io.dumps` (msgpack +
zstd with a checksummed header, never pickle).

* ``loader.zph``: a state merged across ranks (a checkpoint round's leader), or the state
  of a job of one rank. Over ``SHARD_LANES`` lanes it holds an index instead (the state
  without its lanes, and per shard its lane range and sha256), and the lanes are in
  ``loader-lanes-<first>-<last>.zph`` shards, so that a restoring rank reads the index
  and only the shards of its own lanes.
* ``process_<i>-of-<n>.zph``: rank ``i``'s own state (no aggregation), or its share of a
  round's merged state when every host writes. A restore merges the ranks' states
  (:func:`~zephon.checkpoint.state.merge_states`), so a job of any size restores them.

:func:`files_to_write` says what one rank writes; :func:`files_to_read` which files a
restoring rank needs (from their names alone, for readers that must ask for entries before
reading any, as ``torch.distributed.checkpoint`` does); :func:`read_state` reads them back
into the state to restore. Neither touches storage: a :class:`Files` does
(:class:`DirectoryFiles`, :class:`MemoryFiles`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from zephon.checkpoint.io import dumps, loads
from zephon.checkpoint.state import merge_states
from zephon.errors import CheckpointError
from zephon.tracking.schema import LANE

__all__ = [
    "INDEX_FORMAT",
    "MERGED_FILE",
    "SHARD_LANES",
    "DirectoryFiles",
    "Files",
    "MemoryFiles",
    "files_to_read",
    "files_to_write",
    "merged_files",
    "process_file",
    "read_state",
]

MERGED_FILE = "loader.zph"
#: merged states with more lanes than this are written as an index plus lane shards
SHARD_LANES = 256
INDEX_FORMAT = "zephon.loader-index"
SHARD_FORMAT = "zephon.loader-shard"
_PROCESS_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.zph$")
_SHARD_FILE = re.compile(r"^loader-lanes-(\d+)-(\d+)\.zph$")


def process_file(rank: int, world_size: int) -> str:
    return f"process_{rank}-of-{world_size}.zph"


def shard_file(first_lane: int, last_lane: int) -> str:
    return f"loader-lanes-{first_lane:06d}-{last_lane:06d}.zph"


# ---------------------------------------------------------------------------------- writing


def files_to_write(
    state: dict[str, Any], *, primary_host: int | None = 0, is_primary: bool = True
) -> dict[str, bytes]:
    """The files this rank writes for ``state`` (from its ``checkpoint()``), in the order to
    write them (each lane shard before the index naming it).

    Args:
        state: this rank's checkpoint: its own state, the merged state of a round (rank
            0), or its share of one (any other rank).
        primary_host: Orbax's primary host; ``None``: every host writes (host-local storage,
            or a store where every rank writes its own entries, as
            ``torch.distributed.checkpoint``). A merged state is then written by the rank
            that holds it (rank 0) and each share as that rank's process file.
        is_primary: whether this process is the primary host.

    Raises:
        CheckpointError: the primary host holds only a share of the merged state (it is
            not the round's leader, rank 0).
    """
    topo = state.get("topology", {})
    share = state.get("share")
    if isinstance(share, dict):  # a follower of the round: rank 0 writes the merged state
        if primary_host is None:
            return {process_file(int(share["rank"]), int(share["world_size"])): dumps(state)}
        if is_primary:
            raise CheckpointError(
                f"Orbax's primary host (process {primary_host}) holds only rank "
                f"{share['rank']}'s share of the merged loader state; rank 0, the "
                "checkpoint round's leader, holds all of it. Use "
                "MultiprocessingOptions(primary_host=0) (the default), or None"
            )
        return {}
    if topo.get("merged") or int(topo.get("world_size", 1)) == 1:
        return merged_files(state) if is_primary or primary_host is None else {}
    return {process_file(int(topo["rank"]), int(topo["world_size"])): dumps(state)}


def merged_files(state: dict[str, Any]) -> dict[str, bytes]:
    """``loader.zph``: the state itself, or (over ``SHARD_LANES`` lanes) the lane shards
    followed by the index naming them."""
    lanes = sorted(state.get("lanes") or [], key=lambda ls: int(ls[LANE]))
    if len(lanes) <= SHARD_LANES:
        return {MERGED_FILE: dumps(state)}
    header = {k: v for k, v in state.items() if k != "lanes"}
    out: dict[str, bytes] = {}
    shards = []
    for start in range(0, len(lanes), SHARD_LANES):
        block = lanes[start : start + SHARD_LANES]
        first, last = int(block[0][LANE]), int(block[-1][LANE])
        name = shard_file(first, last)
        blob = dumps({"format": SHARD_FORMAT, "lanes": block})
        out[name] = blob
        shards.append(
            {
                "file": name,
                "first_lane": first,
                "last_lane": last,
                "count": len(block),
                "sha256": hashlib.sha256(blob).hexdigest(),
            }
        )
    out[MERGED_FILE] = dumps(
        {"format": INDEX_FORMAT, "version": 1, "header": header, "shards": shards}
    )
    return out


# ---------------------------------------------------------------------------------- reading


class Files(Protocol):
    """Named blobs a loader state was written to."""

    def names(self) -> list[str]: ...

    def read(self, name: str) -> bytes | memoryview:
        """The blob; ``FileNotFoundError`` when there is none of that name."""
        ...

    def where(self, name: str | None = None) -> str:
        """Where the blob (or, for None, the files) is, for messages."""
        ...


class DirectoryFiles:
    """The files in a directory: a ``pathlib.Path``, an ``etils.epath.Path`` or anything
    else with ``/``, ``iterdir()`` and ``read_bytes()``."""

    def __init__(self, directory: Any) -> None:
        self.directory = directory

    def names(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir())

    def read(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()

    def where(self, name: str | None = None) -> str:
        return str(self.directory if name is None else self.directory / name)


class MemoryFiles:
    """Blobs held in memory, by name; ``label`` names their place in messages."""

    def __init__(self, blobs: Mapping[str, bytes | memoryview], label: str) -> None:
        self.blobs = blobs
        self.label = label

    def names(self) -> list[str]:
        return sorted(self.blobs)

    def read(self, name: str) -> bytes | memoryview:
        try:
            return self.blobs[name]
        except KeyError:
            raise FileNotFoundError(name) from None

    def where(self, name: str | None = None) -> str:
        return self.label if name is None else f"{self.label}{name}"


def files_to_read(names: Iterable[str], lanes: Iterable[int] | None = None) -> list[str]:
    """Of the files ``names``, those :func:`read_state` reads for a rank owning ``lanes``
    (None: all lanes): ``loader.zph`` and the lane shards holding those lanes, or, without a
    ``loader.zph``, every process file."""
    names = sorted(set(names))
    if MERGED_FILE in names:
        wanted = None if lanes is None else [int(x) for x in lanes]
        out = [MERGED_FILE]
        for name in names:
            m = _SHARD_FILE.match(name)
            if m and (wanted is None or any(int(m[1]) <= lane <= int(m[2]) for lane in wanted)):
                out.append(name)
        return out
    return [name for name in names if _PROCESS_FILE.match(name)]


def read_state(files: Files, lanes: Iterable[int] | None = None) -> dict[str, Any]:
    """The loader state in ``files``, merged across ranks.

    Args:
        files: where the state was written.
        lanes: the lanes the restoring rank owns: of a sharded ``loader.zph`` only the
            shards holding them are read; of process files, those present are enough when
            they hold every one of these lanes (None: all lanes, all files).

    Raises:
        CheckpointError: no loader state there, files of different world sizes, a missing
            rank, or a corrupt or mismatched file (named).
    """
    wanted = None if lanes is None else sorted({int(x) for x in lanes})
    names = files.names()
    if MERGED_FILE in names:
        state = _load(files, MERGED_FILE)
        if state.get("format") == INDEX_FORMAT:
            return _read_shards(files, state, wanted)
        return state
    found: dict[int, set[int]] = {}
    for name in names:
        m = _PROCESS_FILE.match(name)
        if m:
            found.setdefault(int(m[2]), set()).add(int(m[1]))
    if not found:
        raise CheckpointError(
            f"{files.where()}: no Zephon loader state ({MERGED_FILE} or "
            "process_<i>-of-<n>.zph); was it saved with a Zephon checkpoint adapter "
            "(zephon.jax.CheckpointSave, zephon.jax.Checkpointable, zephon.torch.Loader)?"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{files.where()}: loader files from different world sizes {sorted(found)}; the "
            "checkpoint mixes two jobs"
        )
    ((n, ranks),) = found.items()
    missing = sorted(set(range(n)) - ranks)
    if wanted is not None and missing:
        # Enough if the ranks present hold our lanes: shares written by every host
        # (primary_host=None), or each rank's own state read back by that rank.
        present = [_load(files, process_file(r, n)) for r in sorted(ranks)]
        held = {int(ls[LANE]): ls for st in present for ls in st["lanes"]}
        if all(lane in held for lane in wanted):
            if all(isinstance(st.get("share"), dict) for st in present):
                return {**present[0], "lanes": [held[lane] for lane in wanted]}
            if not any(isinstance(st.get("share"), dict) for st in present):
                return merge_states(present)
    if missing:
        raise CheckpointError(
            f"{files.where()}: loader state of ranks {missing} of {n} is missing "
            f"({process_file(missing[0], n)}, ...); every process must see every rank's "
            "file to restore (use shared storage, or aggregate_dir=/aggregate_store= on the "
            "pipeline)"
        )
    return merge_states([_load(files, process_file(r, n)) for r in range(n)])


def _read_shards(files: Files, index: dict[str, Any], wanted: list[int] | None) -> dict[str, Any]:
    keep = None if wanted is None else set(wanted)
    out: list[Any] = []
    for shard in index["shards"]:
        first, last = int(shard["first_lane"]), int(shard["last_lane"])
        if keep is not None and not any(first <= lane <= last for lane in keep):
            continue
        where = files.where(shard["file"])
        try:
            blob = files.read(shard["file"])
        except FileNotFoundError as e:
            raise CheckpointError(
                f"{where}: lane shard named by {MERGED_FILE} is missing; the checkpoint is "
                "incomplete"
            ) from e
        if hashlib.sha256(blob).hexdigest() != shard["sha256"]:
            raise CheckpointError(
                f"{where}: sha256 differs from the one {MERGED_FILE} records for it; the "
                "shard belongs to another save or is corrupt"
            )
        try:
            block = loads(blob)["lanes"]
        except (CheckpointError, KeyError) as e:
            raise CheckpointError(f"{where}: {e}") from e
        out.extend(ls for ls in block if keep is None or int(ls[LANE]) in keep)
    return {**index["header"], "lanes": out}


def _load(files: Files, name: str) -> dict[str, Any]:
    try:
        return loads(files.read(name))
    except CheckpointError as e:
        raise CheckpointError(f"{files.where(name)}: {e}") from e
