"""What a compiled plan runs: the head that turns a chunk into records, and the steps.

``zephon.compile`` decides the plan; these are its parts. A step is one operator or a stage
that stands for several (:class:`~zephon.stages.split_pack.SplitPack` for ``[tokenize ->]
split -> pack``); the chain runner runs the steps in order without knowing which is which.
"""

from zephon.stages.base import ReplayView, Step
from zephon.stages.read import ChunkRecords, ReadChunks
from zephon.stages.split_pack import SplitPack

__all__ = ["ChunkRecords", "ReadChunks", "ReplayView", "SplitPack", "Step"]
