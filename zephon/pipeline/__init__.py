"""The user's object and its halves: :class:`~zephon.pipeline.pipeline.Pipeline` (building
it, :mod:`~zephon.pipeline.building`; its checked options, :mod:`~zephon.pipeline.options`;
starting it, :mod:`~zephon.pipeline.running`; restoring it,
:mod:`~zephon.pipeline.restoring`) and the engine that runs a rank's lanes
(:mod:`~zephon.pipeline.engine`).
"""

from zephon.pipeline.pipeline import Pipeline

__all__ = ["Pipeline"]
