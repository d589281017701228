"""Observability: a Prometheus endpoint, a flat dict for any logger, the bottleneck.

- ``Pipeline(metrics_port=PORT)`` or :func:`serve` — ``zephon_*`` metrics over HTTP
  (``prometheus_client``, the ``metrics`` extra; imported only here, when serving).
- :func:`scalars` — the same figures as one flat dict of numbers.
- ``pipe.stats()["bottleneck"]`` — where the loader spends its time and what to turn
  (:mod:`zephon.metrics.observe`).

The metric list is in :mod:`zephon.metrics.families`.
"""

from zephon.metrics.exporter import MetricsServer, serve
from zephon.metrics.families import scalars

__all__ = ["MetricsServer", "scalars", "serve"]
