"""Checkpoint files (msgpack + zstd, atomic) and, later, multi-rank rounds."""

from zephon.checkpoint.io import dumps, load, loads, save

__all__ = ["dumps", "load", "loads", "save"]
