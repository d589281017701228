"""The metrics endpoint (``Pipeline(metrics_port=)``, ``zp.metrics.serve``) scraped over
HTTP during a run with worker processes, against ``stats()`` and against counts made here
from the batches; ``stats()["bottleneck"]`` naming a slow stage in one worker.

Under ``CI=true`` a missing prometheus_client fails (the conftest turns skips into
failures)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
import warnings

import numpy as np
import pytest

import zephon as zp
from zephon.demo.pipelines import lm_chain

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.processes]

A, B = ord("a") + 3, ord("b") + 3  # ByteTokenizer ids


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "rank")))] = (
                s.value
            )
    return out


def _lm(workers: int, **kw) -> zp.Pipeline:
    rng = np.random.default_rng(0)
    docs_a = ["a" * int(n) for n in rng.integers(5, 120, 300)]
    docs_b = ["b" * int(n) for n in rng.integers(5, 40, 300)]
    src = zp.StaticMixtureWorkSource(
        {"a": zp.ArraySource(docs_a), "b": zp.ArraySource(docs_b)},
        weights={"a": 0.7, "b": 0.3},
        seed=1,
        chunk_size=8,
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=workers, **kw)
    return lm_chain(
        pipe, seq_len=64, batch_size=4, tokenizer=zp.ByteTokenizer(add_eos=False), num_bins=4
    )


def test_the_endpoint_during_a_run_with_2_workers_says_what_stats_and_the_batches_say():
    n = 60
    counted = {"a": 0, "b": 0}
    with _lm(workers=2, metrics_port=0) as pipe:
        for _ in range(n):
            batch = next(pipe)
            tokens = batch["tokens"]
            counted["a"] += int(np.count_nonzero(tokens == A))
            counted["b"] += int(np.count_nonzero(tokens == B))
        pipe.checkpoint()
        server = pipe._metrics
        assert server.addr == "127.0.0.1" and server.port > 0
        got = _scrape(server.url)  # the workers are running: this is mid-run
        st = pipe.stats()
        assert all(w["alive"] for w in st["workers"])

    def val(name, **labels):
        return got[(name, tuple(sorted(labels.items())))]

    assert val("zephon_batches_delivered_total") == n == st["batches_delivered"]
    assert val("zephon_step") == n
    for comp in ("a", "b"):
        assert val("zephon_tokens_delivered_total", component=comp) == counted[comp]
        assert st["mixture"][comp]["tokens"] == counted[comp]
        m = st["mixture"][comp]
        assert val("zephon_mixture_target_ratio", component=comp) == pytest.approx(m["target"])
        assert val("zephon_mixture_token_ratio", component=comp) == pytest.approx(
            counted[comp] / sum(counted.values()), abs=1e-6
        )
        # of the delivered batches: both read at the last delivery
        assert 0 < val("zephon_documents_delivered_total", component=comp) == m["documents"]
    assert st["mixture"]["a"]["target"] == pytest.approx(0.7)
    # busy time: per worker and stage, as stats() says (both read at the last delivery)
    for place in st["busy"]:
        worker = str(place["worker"])
        assert val("zephon_worker_busy_seconds_total", worker=worker) == pytest.approx(
            place["seconds"]
        )
        for stage, seconds in place["stages"].items():
            assert val(
                "zephon_stage_busy_seconds_total", worker=worker, stage=stage
            ) == pytest.approx(seconds)
    assert {p["worker"] for p in st["busy"]} == {0, 1}
    for op in st["operators"]:
        assert val("zephon_stage_records_in_total", stage=op["name"]) == op["records_in"]
        assert val("zephon_stage_records_out_total", stage=op["name"]) == op["records_out"]
    (batch,) = [o for o in st["operators"] if o["name"] == "batch"]
    assert batch["records_out"] >= n
    # the consumer's wait: one observation a call after the first
    assert val("zephon_next_wait_seconds_count") == n - 1
    assert val("zephon_next_wait_seconds_bucket", le="+Inf") == n - 1
    assert val("zephon_next_wait_seconds_sum") == pytest.approx(st["next_wait_s"], abs=1e-5)
    # rings, lanes, checkpoints
    for w in ("0", "1"):
        assert 0 <= val("zephon_ring_filled_slots", worker=w) <= val("zephon_ring_slots", worker=w)
        assert val("zephon_ring_slots", worker=w) == 16
        assert val("zephon_worker_up", worker=w) == 1
        assert val("zephon_inflight_chunks", worker=w) >= 1
    assert val("zephon_lanes") == 4
    assert val("zephon_replayed_chunks") == 0
    assert val("zephon_checkpoint_seconds_count") == 1 == st["checkpoints"]
    assert val("zephon_checkpoint_bytes") == st["checkpoint_bytes"] > 0
    assert val("zephon_checkpoint_last_seconds") == pytest.approx(st["checkpoint_s"])
    b = st["bottleneck"]
    assert val("zephon_bottleneck_info", where=b["where"], stage=b["stage"]) == 1
    # closed: nothing listens on the port any more
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.connect(("127.0.0.1", server.port))


def test_scalars_are_the_endpoints_figures_and_a_restore_counts_its_replayed_chunks():
    with _lm(workers=0, prefetch=0) as pipe:
        assert zp.metrics.scalars(pipe) == {}  # nothing before the first next()
        for _ in range(10):
            next(pipe)
        state = pipe.checkpoint()
    with _lm(workers=0, prefetch=0) as pipe, zp.metrics.serve(pipe) as server:
        pipe.restore(state)
        for _ in range(5):
            next(pipe)
        flat = zp.metrics.scalars(pipe)
        got = _scrape(server.url)
        st = pipe.stats()
    assert st["replayed_chunks"] > 0
    assert flat["zephon_replayed_chunks"] == st["replayed_chunks"]
    assert flat["zephon_batches_delivered_total"] == 5 and flat["zephon_step"] == 15
    for (name, labels), value in got.items():
        if name.endswith("_created") or name.endswith("_bucket"):
            continue
        key = name + "".join(f"/{k}={v}" for k, v in _ordered(flat, name, labels))
        if "ratio" in name or name.startswith("zephon_bottleneck"):
            continue  # moves with the clock
        assert flat[key] == pytest.approx(value), key


def _ordered(flat, name, labels):
    """The labels in the order scalars() wrote them (found among its keys)."""
    for key in flat:
        parts = key.split("/")
        if parts[0] == name and sorted(p.split("=", 1)[0] for p in parts[1:]) == [
            k for k, _ in labels
        ]:
            want = dict(labels)
            if all(want.get(p.split("=", 1)[0]) == p.split("=", 1)[1] for p in parts[1:]):
                return [tuple(p.split("=", 1)) for p in parts[1:]]
    return list(labels)


def _slow_in_worker_1(x):
    import multiprocess

    if multiprocess.current_process().name == "zephon-worker-1":
        time.sleep(0.012)
    return x


def test_a_slow_map_in_one_worker_is_named_the_bottleneck_and_in_the_stall_warning():
    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(100_000))], seed=0, chunk_size=4)
    pipe = (
        zp.Pipeline(src, canonical_replicas=4, workers=2, metrics_port=0)
        .fetch()
        .map(_slow_in_worker_1)
        .batch(4)
    )
    with pipe, pytest.warns(zp.DataStallWarning, match=r"The bottleneck: map in worker 1") as w:
        for step in range(1, 641):
            next(pipe)
            time.sleep(0.02)  # the training step
            if step >= 64 and len(w):  # warned (a loaded machine may take longer to)
                break
        got = _scrape(pipe._metrics.url)
        st = pipe.stats()
    b = st["bottleneck"]
    assert (b["where"], b["worker"], b["stage"]) == ("worker 1", 1, "map"), b
    assert b["stalled"] and b["busy_fraction"] > 0.5
    assert "map(parallelism=)" in b["knob"]
    assert got[("zephon_bottleneck_info", (("stage", "map"), ("where", "worker 1")))] == 1
    busy = {p["worker"]: p for p in st["busy"]}
    assert busy[1]["stages"]["map"] > 5 * busy[0]["stages"]["map"]
    assert len(w) == 1 and "map(parallelism=)" in str(w[0].message)


def test_import_zephon_leaves_prometheus_client_and_matplotlib_alone():
    code = (
        "import sys, zephon, zephon.cli.main; "
        "bad = {'prometheus_client', 'matplotlib'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_metrics_port_is_checked_and_a_taken_port_is_named():
    src = zp.StaticMixtureWorkSource([zp.ArraySource(np.arange(100))], seed=0, chunk_size=4)
    with pytest.raises(ValueError, match=r"metrics_port must be None .* got -1"):
        zp.Pipeline(src, metrics_port=-1)
    with pytest.raises(ValueError, match=r"metrics_port"):
        zp.Pipeline(src, metrics_port=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pipe = zp.Pipeline(src, canonical_replicas=1, metrics_port=port).fetch().batch(2)
        assert pipe.metrics_port == port
        with warnings.catch_warnings(), pytest.raises(OSError, match=r"metrics_port"):
            next(pipe)
        pipe.close()


def _keep(x):
    return x % 3 != 0


def test_mixture_shares_are_of_the_delivered_documents_counted_here_from_the_batches():
    # Component b's documents are 10_000 + i: a row says its component. A filter drops a
    # third of each; 2 workers and the prefetch pump run ahead of the consumer, so the
    # documents dealt to lanes are many more than the ones delivered.
    src = zp.StaticMixtureWorkSource(
        {"a": zp.ArraySource(np.arange(5_000)), "b": zp.ArraySource(np.arange(10_000, 15_000))},
        weights={"a": 0.8, "b": 0.2},
        seed=3,
        chunk_size=8,
    )
    pipe = zp.Pipeline(src, canonical_replicas=4, workers=2, prefetch=8, metrics_port=0)
    counted = {"a": 0, "b": 0}
    with pipe.fetch().filter(_keep).batch(4) as pipe:
        for _ in range(50):
            for x in next(pipe):
                counted["a" if x < 10_000 else "b"] += 1
        got = _scrape(pipe._metrics.url)
        st = pipe.stats()
    dealt = sum(t.source.positions[c] for t in pipe._engine.trackers.values() for c in (0, 1))
    assert sum(counted.values()) == 200 < dealt
    for comp in ("a", "b"):
        m = st["mixture"][comp]
        share = counted[comp] / 200
        assert m["documents"] == counted[comp] == m["tokens"]  # samples: a token each
        assert m["document_share"] == pytest.approx(share, abs=1e-6)
        assert m["token_share"] == pytest.approx(share, abs=1e-6)
        labels = (("component", comp),)
        assert got[("zephon_documents_delivered_total", labels)] == counted[comp]
        assert got[("zephon_mixture_document_ratio", labels)] == pytest.approx(share, abs=1e-6)
