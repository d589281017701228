"""Checkpoint files (msgpack + zstd, written atomically), the pipeline state they hold, and
the multi-rank checkpoint rounds over a shared store (:mod:`~zephon.checkpoint.rounds`)."""

from zephon.checkpoint.io import dumps, load, loads, save

__all__ = ["dumps", "load", "loads", "save"]
