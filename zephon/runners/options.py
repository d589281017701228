"""What the worker processes run by: the pipeline's options that the process executor and
each worker read, under the public names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: ``ring_slot_bytes=None``: the slots rings start with, and the most a worker may grow
#: them to (a batch above it is an error that quotes both sizes).
AUTO_FIRST_SLOT_BYTES = 1 << 20
AUTO_MAX_SLOT_BYTES = 1 << 30


@dataclass(frozen=True)
class WorkerOptions:
    """The pipeline's options that the worker processes run by: the parent's side here,
    and each worker's (it gets them in its :class:`~zephon.runners.worker.WorkerConfig`).
    Each keeps the name and meaning of the :class:`~zephon.Pipeline` argument, checked by
    :func:`zephon.pipeline.options.checked_options`; what is derived from them says so.
    """

    workers: int
    output: str
    ring_slots: int
    ring_slot_bytes: int | None
    zero_copy: bool
    worker_timeout_s: float
    worker_start_method: str

    @classmethod
    def of(cls, options: Any) -> WorkerOptions:
        """These options of ``options`` (the pipeline's, or anything with these names)."""
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})

    @property
    def first_slot_bytes(self) -> int:
        """Derived: the bytes of a slot of each worker's first ring (``ring_slot_bytes``,
        or :data:`AUTO_FIRST_SLOT_BYTES` where the slots are sized from the batches)."""
        return AUTO_FIRST_SLOT_BYTES if self.ring_slot_bytes is None else self.ring_slot_bytes
