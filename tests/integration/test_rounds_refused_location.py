"""Issue 33 item 5: a round over a location that refuses writes (read-only, or a
filesystem that is full) fails on every rank with an AggregationError that names the
location, at once, never after the round's budget; and the next round once the location
takes writes again works. Real filesystems: a tmpfs of the test's own (root may mount it),
else a directory without write permission (for a user that is not root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time

import pytest

from zephon.checkpoint.aggregate import Aggregator
from zephon.checkpoint.stores import DirectoryStore
from zephon.errors import AggregationError

pytestmark = pytest.mark.stores

N = 3


def _state(rank: int, step: int) -> dict:
    return {
        "topology": {"rank": rank, "world_size": N, "dp_size": N, "canonical_replicas": N},
        "lanes": [{"lane": rank, "at": step}],
        "step": step,
    }


def _merge(states: list[dict]) -> dict:
    return {"lanes": [ls for st in states for ls in st["lanes"]], "step": states[0]["step"]}


def _round(aggs: list[Aggregator], step: int) -> list:
    out: list = [None] * N

    def one(r: int) -> None:
        t = time.monotonic()
        try:
            out[r] = (aggs[r].round(_state(r, step)), time.monotonic() - t)
        except Exception as e:  # noqa: BLE001 - judged below
            out[r] = (e, time.monotonic() - t)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@contextlib.contextmanager
def _location(tmp_path):
    """(path, refuse(kind), accept()): a directory the test can make refuse writes."""
    path = tmp_path / "loc"
    path.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield path, mounted
    finally:
        if mounted:
            subprocess.run(["mount", "-o", "remount,rw", str(path)], capture_output=True)
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        else:
            os.chmod(path, 0o755)


def _aggs(path) -> list[Aggregator]:
    return [
        Aggregator(
            DirectoryStore(path, "job"),
            rank=r,
            world_size=N,
            timeout_s=30.0,
            expected_lanes=lambda r: [r],
            merge=_merge,
            lease_ttl_s=2.0,
            job_id="refused",
        )
        for r in range(N)
    ]


def _assert_every_rank_fails_naming(out: list, where: str, what: tuple[str, ...]) -> None:
    for r, (err, elapsed_s) in enumerate(out):
        assert isinstance(err, AggregationError), (r, err)
        assert str(err).startswith(f"[rank={r}] "), err
        assert where in str(err), err
        assert any(w in str(err) for w in what), err
        assert elapsed_s < 10.0, (r, elapsed_s, str(err))  # not the 30 s budget


def test_a_read_only_location_fails_every_rank_naming_it(tmp_path):
    with _location(tmp_path) as (path, mounted):
        DirectoryStore(path, "job")  # the namespace exists, as after an earlier job
        if mounted:
            assert subprocess.run(["mount", "-o", "remount,ro", str(path)]).returncode == 0
        else:
            os.chmod(path / "job", 0o555)
        aggs = _aggs(path)
        out = _round(aggs, 3)
        where = aggs[0].store.describe()
        _assert_every_rank_fails_naming(
            out, where, ("Read-only file system", "Permission denied", "refuses writes")
        )
        if mounted:
            assert subprocess.run(["mount", "-o", "remount,rw", str(path)]).returncode == 0
        else:
            os.chmod(path / "job", 0o755)
        out = _round(aggs, 6)  # the location takes writes again: the next round works
        assert all(isinstance(res, dict) for res, _ in out), out
        for a in aggs:
            a.close()


def test_a_full_location_fails_every_rank_naming_it_then_the_next_round_works(tmp_path):
    with _location(tmp_path) as (path, mounted):
        if not mounted:
            # (a user that is not root cannot make a filesystem of its own to fill; the
            # chaos harness and the unit tests' full-disk store cover this case there)
            assert os.geteuid() != 0
            return
        aggs = _aggs(path)
        assert all(isinstance(res, dict) for res, _ in _round(aggs, 3))  # a healthy round
        filler = path / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        out = _round(aggs, 6)
        _assert_every_rank_fails_naming(
            out,
            aggs[0].store.describe(),
            ("No space left on device", "refuses writes", "is it full"),
        )
        filler.unlink()
        out = _round(aggs, 9)
        assert all(isinstance(res, dict) for res, _ in out), out
        for a in aggs:
            a.close()
