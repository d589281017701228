"""Observability: a Prometheus endpoint, a flat dict for any logger, the bottleneck.

- ``Pipeline(metrics_port=PORT)`` or :func:`serve` — ``zephon_*`` metrics over HTTP
  (``prometheus_client``, the ``metrics`` extra; imported only here, when serving).
- :func:`scalars` — the same figures as one flat dict of numbers.
- :func:`record` — those figures appended to a file every second (JSON lines), for
  ``zephon report SERIES --out PNG``; ``zephon top URL`` shows the endpoint live.
- ``pipe.stats()["bottleneck"]`` — where the loader spends its time and what to turn
  (:mod:`zephon.metrics.observe`).

The metric list is in :mod:`zephon.metrics.families`.
"""

from zephon.metrics.exporter import MetricsServer, serve
from zephon.metrics.families import scalars
from zephon.metrics.series import Recorder, read_series, record

__all__ = ["MetricsServer", "Recorder", "read_series", "record", "scalars", "serve"]
