"""Lanes on Ray actors spread over several nodes: a simulated cluster
(``ray.cluster_utils.Cluster``, every node a set of local processes on 127.0.0.1). A node
lost while iterating moves its actors' lanes; a node added while running (what Ray's
autoscaler does) places the actors still waiting for resources (those not placed at the
start, replacements of lost ones), which then take lanes. Each run is compared batch by
batch with ``workers=0``.

One cluster per module: a head node without CPUs (the driver's: actors never go there)
and worker nodes of 1 CPU each (one actor each), added and removed by the tests.
"""

from __future__ import annotations

import os
import time

import pytest

import zephon as zp
from tests.integration.corpus import lm_pipeline
from zephon.testing import assert_same_batches, roundtrip, take

pytestmark = pytest.mark.ray

SEED = 31
#: Ray's node health checks, fast: a removed node is declared dead in about a second.
_FAST_HEALTH = {
    "health_check_period_ms": 200,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
}


class _Nodes:
    """The module's simulated cluster: ``ensure(n)`` leaves ``n`` worker nodes of 1 CPU."""

    def __init__(self, ray) -> None:
        from ray.cluster_utils import Cluster

        from zephon.runners.ray_options import LOOPBACK_IP

        self.ray = ray
        self.ip = LOOPBACK_IP
        with _loopback_home():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "node_ip_address": self.ip,
                    "include_dashboard": False,
                    "object_store_memory": 80 << 20,
                    "_system_config": _FAST_HEALTH,
                },
            )
            ray.init(address=self.cluster.address, log_to_driver=False, configure_logging=False)

    def add(self):
        with _loopback_home():
            return self.cluster.add_node(
                num_cpus=1, node_ip_address=self.ip, object_store_memory=80 << 20
            )

    def ensure(self, n: int) -> None:
        while len(self.cluster.worker_nodes) > n:
            self.remove(next(iter(self.cluster.worker_nodes)))
        while len(self.cluster.worker_nodes) < n:
            self.add()
        self.cluster.wait_for_nodes()

    def remove(self, node) -> None:
        self.cluster.remove_node(node, allow_graceful=False)

    def node_of(self, node_id: str):
        (node,) = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        return node

    def shutdown(self) -> None:
        self.ray.shutdown()
        self.cluster.shutdown()


class _loopback_home:
    """Ray's loopback settings (see zephon.runners.ray_options) while nodes start."""

    def __enter__(self):
        from zephon.runners.ray_options import LOOPBACK_ENV, ray_home

        os.environ.update(LOOPBACK_ENV)
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
        self.old = os.environ.get("HOME")
        os.environ["HOME"] = ray_home()

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("HOME", None)
        else:
            os.environ["HOME"] = self.old


@pytest.fixture(scope="module")
def nodes():
    ray = pytest.importorskip("ray", reason="the ray extra (pip install zephon[ray])")
    if ray.is_initialized():
        ray.shutdown()
    cluster = _Nodes(ray)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _stats(pipe) -> dict:
    return pipe.stats()["ray"]


def _take_while_pending(pipe, cap_s: float = 60.0) -> list:
    """Batches, slowly, until no actor of ``pipe`` is waiting to be placed or to start."""
    got = []
    deadline = time.monotonic() + cap_s
    while _stats(pipe)["pending_actors"] and time.monotonic() < deadline:
        got += take(pipe, 1)
        time.sleep(0.005)
    return got


def _take_until(pipe, counter: str, value: int = 1, cap_s: float = 60.0) -> list:
    """Batches, slowly (a few milliseconds apart: the change waited for is Ray's, not the
    pipeline's), until ``stats()["ray"][counter]`` is ``value``; at most ``cap_s``."""
    got = []
    deadline = time.monotonic() + cap_s
    while _stats(pipe)[counter] < value and time.monotonic() < deadline:
        got += take(pipe, 1)
        time.sleep(0.005)
    assert _stats(pipe)[counter] == value, _stats(pipe)
    return got


def test_lost_node_moves_its_lanes_and_its_replacement_joins_on_a_new_node(nodes):
    nodes.ensure(2)
    kw = {"seed": SEED, "num_epochs": None}
    with lm_pipeline(workers=zp.RayWorkers(2), **kw) as p:
        got = take(p, 4)
        got += _take_while_pending(p)  # an actor slow to start (a loaded machine) joins
        actors = _stats(p)["actors"]
        # one actor a node: each asks for 1 CPU, each node has 1
        assert len({a["node"] for a in actors}) == 2, actors
        lost = nodes.node_of(actors[0]["node"])
        joins = _stats(p)["joins"]  # 1 if an actor was slow to start
        nodes.remove(lost)
        got += _take_until(p, "lane_moves")
        got += _take_until(p, "replacements")  # asked for 0.2 s after the death
        stats = _stats(p)
        # an actor is asked for in place of the lost one: no room for it until a node
        # is added (Ray's autoscaler would add one for its resource request)
        assert stats["pending_actors"] == 1 and stats["replacements"] == 1, stats
        assert [a["alive"] for a in stats["actors"]] == [False, True]
        assert sorted(stats["actors"][1]["lanes"]) == [0, 1, 2, 3]
        nodes.add()
        got += _take_until(p, "joins", joins + 1)
        got += take(p, 4)
        stats, state, cut = _checkpoint_and_go_on(p, got)
    assert stats["lane_moves"] == 1 and stats["pending_actors"] == 0, stats
    assert stats["joins"] == joins + 1, stats
    # the replacement took 2 of the 4 lanes (a lane that straggled on it while it warmed
    # up may have been run again and kept by the other actor since: speculation)
    assert [a["alive"] for a in stats["actors"]] == [False, True, True]
    assert sorted(stats["actors"][1]["lanes"] + stats["actors"][2]["lanes"]) == [0, 1, 2, 3]
    assert len({a["node"] for a in stats["actors"]}) == 3
    _same_as_in_process(kw, got, state, cut, "the loss of a node")


def _checkpoint_and_go_on(p, got: list) -> tuple[dict, dict, int]:
    """The pipeline's stats and checkpoint after ``got``, where it was taken (``cut``),
    then 6 batches more onto ``got``."""
    stats = _stats(p)
    state = roundtrip(p.checkpoint())
    cut = len(got)
    got += take(p, 6)
    return stats, state, cut


def _same_as_in_process(kw: dict, got: list, state: dict, cut: int, what: str) -> None:
    """``got`` is what ``workers=0`` gives, and ``state`` (taken after ``got[:cut]``)
    restores in process to the 6 batches after it."""
    with lm_pipeline(**kw) as p:
        ref = take(p, len(got))
    assert_same_batches(ref, got, f"across {what}")
    with lm_pipeline(**kw) as q:
        q.restore(state)
        assert_same_batches(ref[cut:], take(q, 6), f"restored after {what}")


def test_actors_placed_later_join_and_take_lanes(nodes):
    """One node of 1 CPU, RayWorkers(2): the pipeline starts with the actor that fits; the
    other waits for resources and takes lanes once a node is added (as Ray's autoscaler
    would add it)."""
    nodes.ensure(1)  # the node the previous test left
    kw = {"seed": SEED + 1, "num_epochs": None}
    with lm_pipeline(workers=zp.RayWorkers(2), **kw) as p:
        got = take(p, 5)
        stats = _stats(p)
        assert stats["pending_actors"] == 1 and stats["joins"] == 0, stats
        assert [sorted(a["lanes"]) for a in stats["actors"]] == [[0, 1, 2, 3]]
        p.resize_workers(1)  # the pending actor goes first
        got += take(p, 3)
        assert _stats(p)["pending_actors"] == 0 and _stats(p)["resizes"] == 1
        p.resize_workers(2)  # asked for again: pending until placed
        got += take(p, 3)
        assert _stats(p)["pending_actors"] == 1 and _stats(p)["resizes"] == 2
        nodes.add()
        got += _take_until(p, "joins")
        got += take(p, 6)
        stats, state, cut = _checkpoint_and_go_on(p, got)
    assert stats["pending_actors"] == 0 and stats["joins"] == 1, stats
    assert sorted(stats["actors"][0]["lanes"] + stats["actors"][1]["lanes"]) == [0, 1, 2, 3]
    assert len({a["node"] for a in stats["actors"]}) == 2 and stats["lane_moves"] == 0
    _same_as_in_process(kw, got, state, cut, "an actor joining while running")


def test_every_socket_of_every_node_is_on_loopback(nodes):
    from tests.integration.test_ray_workers import _loopback_violations

    nodes.ensure(2)
    with lm_pipeline(seed=SEED, workers=zp.RayWorkers(2)) as p:  # actors up and talking
        take(p, 3)
        _take_while_pending(p)
        seen, bad = _loopback_violations()
    assert len({a["node"] for a in _stats(p)["actors"]}) == 2
    assert seen, "no Ray process or socket found"
    assert not bad, f"Ray sockets off loopback (pid, inode) -> (local, remote): {bad}"
