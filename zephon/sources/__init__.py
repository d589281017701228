"""Random-access datasets: anything with ``len(ds)`` and ``ds[i]``, optionally a faster
batched ``ds.read(indices)``."""

from zephon.sources.array import ArraySource
from zephon.sources.array_record import ArrayRecordSource
from zephon.sources.hf import HFSource
from zephon.sources.jsonl import JsonlSource
from zephon.sources.parquet import ParquetSource
from zephon.sources.tar_shard import TarShardSource
from zephon.sources.token_file import TokenFileSource

__all__ = [
    "ArrayRecordSource",
    "ArraySource",
    "HFSource",
    "JsonlSource",
    "ParquetSource",
    "TarShardSource",
    "TokenFileSource",
]
