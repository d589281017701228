"""Zephon's exception tree.

Every concrete error also inherits the builtin a caller would naturally catch, so
``except ValueError`` keeps working for bad checkpoints and ``except RuntimeError``
for broken operator contracts.
"""

from __future__ import annotations


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose."""


class CheckpointError(ZephonError, ValueError):
    """A checkpoint cannot be written, read or restored (corrupt, truncated, wrong
    format version, fingerprint mismatch, replay target lost, ...)."""


class ContractViolation(ZephonError, RuntimeError):
    """An operator broke the operator contract (e.g. pending data after a reset flush)."""


class WorkerError(ZephonError, RuntimeError):
    """A worker process failed: crashed, was killed, hung, or raised."""


class PipelineClosedError(ZephonError, RuntimeError):
    """The pipeline was closed: it yields nothing more (build a new one to go on)."""


class PipelineEndedError(ZephonError, RuntimeError):
    """A loop over a pipeline that has reached the end of its data: there is no second pass
    (build a new pipeline, or give the work source ``num_epochs``). ``next()`` after the end
    raises ``StopIteration``, as any iterator does."""


class ShmError(ZephonError, OSError):
    """Shared memory could not be created, mapped or used."""


class TransferError(ZephonError, TypeError):
    """A dataset or an operator cannot be sent to the worker processes (it cannot be
    pickled); the message names the mixture component or the operator, and the fix."""


class RingError(ZephonError, RuntimeError):
    """The shared-memory ring is in a state it cannot recover from (bad header, closed)."""


class AggregationError(ZephonError, RuntimeError):
    """A multi-rank checkpoint round failed (timeout, missing ranks, leader failure)."""


class LengthIndexError(ZephonError, ValueError):
    """A length index (``zephon lengths``) is missing, unfinished, corrupt, or no longer
    matches its dataset or tokenizer."""


class DataStallWarning(UserWarning):
    """The training loop waits for data in ``next()`` more than 10% of its time: the loader
    is the bottleneck (the message names the knobs). Issued once per run."""


class DroppedRecordsWarning(UserWarning):
    """A finite pipeline ended and ``batch(drop_last=True)`` (the default) dropped the lanes'
    last partial batches: the message says how many records, and the options that keep
    them (``drop_last=False``, ``pad_last=True``). Issued once, at the end, and only when
    records were dropped."""
