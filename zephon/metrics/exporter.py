"""The Prometheus endpoint: one collector that reads the pipeline's figures at scrape time.

Worker processes need no endpoint of their own and no ``PROMETHEUS_MULTIPROC_DIR``: every
figure the workers make (their operators' counters) already reaches the parent with the
batches they send (see :mod:`zephon.runners.chain`), and the rest lives in the parent. So
one collector in the parent, registered in a registry of its own, answers each scrape
from the pipeline as it is then (:func:`zephon.metrics.families.families`); nothing is
counted on the data path for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from zephon.metrics.families import Family, families


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "zephon's metrics endpoint needs prometheus_client: pip install 'zephon[metrics]' "
            "(or prometheus-client); zp.metrics.scalars(pipe) needs nothing"
        ) from e
    return prometheus_client


class PipelineCollector:
    """A ``prometheus_client`` collector over one pipeline (held weakly: the endpoint does
    not keep a dropped pipeline alive)."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = weakref.ref(pipe)

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on the pipeline (workers, components)

    def collect(self) -> Iterator[Any]:
        pipe = self._pipe()
        if pipe is None:
            return
        for f in families(pipe):
            yield _to_prometheus(f)


def _to_prometheus(f: Family) -> Any:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        SummaryMetricFamily,
    )

    names = list(f.samples[0][0]) if f.samples else ["rank"]
    m: Any
    if f.kind == "counter":
        m = CounterMetricFamily(f.name, f.help, labels=names)
        for labels, v in f.samples:
            m.add_metric(list(labels.values()), float(v))
    elif f.kind == "gauge":
        m = GaugeMetricFamily(f.name, f.help, labels=names)
        for labels, v in f.samples:
            m.add_metric(list(labels.values()), float(v))
    elif f.kind == "summary":
        m = SummaryMetricFamily(f.name, f.help, labels=names)
        for labels, (count, total) in f.samples:
            m.add_metric(list(labels.values()), count_value=count, sum_value=total)
    else:
        m = HistogramMetricFamily(f.name, f.help, labels=names)
        for labels, (bounds, counts, total) in f.samples:
            buckets, acc = [], 0
            for bound, n in zip([*map(repr, map(float, bounds)), "+Inf"], counts, strict=True):
                acc += n
                buckets.append((bound, acc))
            m.add_metric(list(labels.values()), buckets, float(total))
    return m


class MetricsServer:
    """A running endpoint: ``url`` to scrape (``/metrics``), ``port`` the one bound (the
    free one picked for port 0); :meth:`close` stops it and frees the port."""

    def __init__(self, httpd: Any, thread: Any, addr: str) -> None:
        self._httpd, self._thread = httpd, thread
        self.addr = addr
        self.port: int = httpd.server_port
        self.url = f"http://{addr}:{self.port}/metrics"

    def close(self) -> None:
        """Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url!r})"


def serve(pipe: Any, port: int = 0, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve ``pipe``'s metrics (``zephon_*``) over HTTP on ``addr:port`` (port 0: any free
    one; read it from ``.port``) until ``.close()``. ``Pipeline(metrics_port=PORT)`` does
    this from the first ``next()`` to ``close()``. Bound to 127.0.0.1 unless told: give
    ``addr="0.0.0.0"`` for a scraper on another host.

    Raises:
        ImportError: ``prometheus_client`` is not installed.
        OSError: the port cannot be bound (in use, or privileged).
    """
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(PipelineCollector(pipe))
    try:
        httpd, thread = prom.start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(
            e.errno,
            f"zephon metrics: cannot listen on {addr}:{port} ({e.strerror or e}): give "
            "Pipeline(metrics_port=) or zp.metrics.serve(port=) another port, or 0 for any "
            "free one",
        ) from e
    return MetricsServer(httpd, thread, addr)
