"""Work sources: per-lane deterministic streams of work chunks, and the permutation they use."""

from zephon.work_sources.base import LaneShardable, RandomAccessDataset, WorkSource
from zephon.work_sources.lengths import build_length_index, open_length_index
from zephon.work_sources.mixture_change import MixtureChange
from zephon.work_sources.permutation import mix64, permute
from zephon.work_sources.schedule import Schedule
from zephon.work_sources.static_mixture import StaticMixtureWorkSource

__all__ = [
    "LaneShardable",
    "MixtureChange",
    "RandomAccessDataset",
    "Schedule",
    "StaticMixtureWorkSource",
    "WorkSource",
    "build_length_index",
    "mix64",
    "open_length_index",
    "permute",
]
