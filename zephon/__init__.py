"""Zephon: a data loader for JAX that checkpoints at any step and resumes exactly.

``import zephon`` never imports JAX; ``zephon.jax`` does.
"""

from zephon.checkpoint import load, save
from zephon.chunks import SamplePointer, WorkChunk
from zephon.errors import (
    AggregationError,
    CheckpointError,
    ContractViolation,
    PipelineClosedError,
    RingError,
    ShmError,
    TransferError,
    WorkerError,
    ZephonError,
)
from zephon.operators import Operator, OpTraits
from zephon.pipeline import Pipeline
from zephon.records import (
    BatchRecord,
    Contributor,
    FlushSentinel,
    Record,
    SampleCursor,
    Tombstone,
)
from zephon.sources import ArraySource, HFSource, JsonlSource, ParquetSource, TokenFileSource
from zephon.tokenizer_adapters import HFTokenizer, SentencePieceTokenizer
from zephon.tokenizers import ByteTokenizer
from zephon.work_sources import StaticMixtureWorkSource, WorkSource

__version__ = "0.1.0"

__all__ = [
    "AggregationError",
    "ArraySource",
    "BatchRecord",
    "ByteTokenizer",
    "CheckpointError",
    "ContractViolation",
    "Contributor",
    "FlushSentinel",
    "HFSource",
    "HFTokenizer",
    "JsonlSource",
    "OpTraits",
    "Operator",
    "ParquetSource",
    "Pipeline",
    "PipelineClosedError",
    "Record",
    "RingError",
    "SampleCursor",
    "SamplePointer",
    "SentencePieceTokenizer",
    "ShmError",
    "StaticMixtureWorkSource",
    "TokenFileSource",
    "Tombstone",
    "TransferError",
    "WorkChunk",
    "WorkSource",
    "WorkerError",
    "ZephonError",
    "__version__",
    "load",
    "save",
]
