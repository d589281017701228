"""Work sources: per-lane deterministic streams of work chunks, and the permutation they use."""

from zephon.work_sources.base import LaneShardable, RandomAccessDataset, WorkSource
from zephon.work_sources.permutation import mix64, permute
from zephon.work_sources.static_mixture import StaticMixtureWorkSource

__all__ = [
    "LaneShardable",
    "RandomAccessDataset",
    "StaticMixtureWorkSource",
    "WorkSource",
    "mix64",
    "permute",
]
