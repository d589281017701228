"""Zephon: a data loader for JAX that checkpoints at any step and resumes exactly.

``import zephon`` never imports JAX; ``zephon.jax`` does.
"""

from zephon import metrics
from zephon.checkpoint import load, save
from zephon.chunks import SamplePointer, WorkChunk
from zephon.errors import (
    AggregationError,
    CheckpointError,
    ContractViolation,
    DataStallWarning,
    DroppedRecordsWarning,
    LengthIndexError,
    PipelineClosedError,
    PipelineEndedError,
    RingError,
    ShmError,
    TransferError,
    WorkerError,
    ZephonError,
)
from zephon.operators import Operator, OpTraits
from zephon.pipeline.pipeline import Pipeline
from zephon.records import (
    BatchRecord,
    Contributor,
    FlushSentinel,
    Record,
    SampleCursor,
    Tombstone,
)
from zephon.runners.ray_options import RayWorkers
from zephon.sources import (
    ArrayRecordSource,
    ArraySource,
    HFSource,
    JsonlSource,
    ParquetSource,
    TarShardSource,
    TokenFileSource,
)
from zephon.tokenizers.adapters import HFTokenizer, SentencePieceTokenizer
from zephon.tokenizers.base import ByteTokenizer
from zephon.work_sources import (
    MixtureChange,
    Schedule,
    StaticMixtureWorkSource,
    WorkSource,
    build_length_index,
    open_length_index,
)

__version__ = "0.1.0"

__all__ = [
    "AggregationError",
    "ArrayRecordSource",
    "ArraySource",
    "BatchRecord",
    "ByteTokenizer",
    "CheckpointError",
    "ContractViolation",
    "Contributor",
    "DataStallWarning",
    "DroppedRecordsWarning",
    "FlushSentinel",
    "HFSource",
    "HFTokenizer",
    "JsonlSource",
    "LengthIndexError",
    "MixtureChange",
    "OpTraits",
    "Operator",
    "ParquetSource",
    "Pipeline",
    "PipelineClosedError",
    "PipelineEndedError",
    "RayWorkers",
    "Record",
    "RingError",
    "SampleCursor",
    "Schedule",
    "SamplePointer",
    "SentencePieceTokenizer",
    "ShmError",
    "StaticMixtureWorkSource",
    "TarShardSource",
    "TokenFileSource",
    "Tombstone",
    "TransferError",
    "WorkChunk",
    "WorkSource",
    "WorkerError",
    "ZephonError",
    "__version__",
    "build_length_index",
    "load",
    "metrics",
    "open_length_index",
    "save",
]
