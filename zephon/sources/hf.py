"""Random access over a local Hugging Face ``datasets.Dataset``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from zephon.sources._fs import PathArg, check_index
from zephon.sources.identity import items_sample, sample_positions, short_digest


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "HFSource needs the `datasets` package; install it with `pip install zephon[hf]`"
        ) from e
    return datasets


class HFSource:
    """Random access by row index over a Hugging Face ``datasets.Dataset``.

    ``ds[i]`` returns ``dataset[i]`` (a dict of column values in the dataset's format,
    Python values by default) or just ``dataset[i][field]``; ``read(indices)`` gathers
    the rows in one ``dataset[indices]`` call, several times faster than row by row or
    ``dataset.select(indices)``.

    A dataset loaded from disk (``load_from_disk``, :meth:`from_disk`, or the cache that
    ``load_dataset`` writes) is memory-mapped and pickles by file path, so worker
    processes open the same files. A dataset built in memory (``Dataset.from_dict``)
    reaches the workers as one copy of its Arrow buffers in shared memory; saving it with
    ``save_to_disk`` and using :meth:`from_disk` avoids even that copy.

    Args:
        dataset: a ``datasets.Dataset`` (one split, not a ``DatasetDict``; not streaming).
        field: if given, ``ds[i]`` returns just this column's value and only it is read.
    """

    def __init__(self, dataset: Any, field: str | None = None) -> None:
        datasets = _import_datasets()
        _check_is_dataset(datasets, dataset)
        self._columns: list[str] = list(dataset.column_names)
        self._field = field
        self._path: str | None = None
        if field is not None:
            # A custom transform (set_transform) may produce fields that are not columns,
            # and may need other columns to do it: leave such a dataset whole.
            custom = dataset.format.get("type") == "custom"
            if not custom and field not in self._columns:
                raise ValueError(
                    f"HFSource: field {field!r} is not a column of the dataset; its columns are "
                    f"{self._columns}; pass one of them or field=None for whole rows"
                )
            if not custom:
                # Decoding one column instead of every column of the row.
                dataset = dataset.select_columns([field])
        self._dataset = dataset

    @classmethod
    def from_disk(
        cls, path: PathArg, field: str | None = None, split: str | None = None
    ) -> HFSource:
        """A source over a dataset written by ``save_to_disk``, memory-mapped.

        Args:
            path: the directory given to ``save_to_disk``. An fsspec URL works too:
                ``datasets`` copies it to a local temporary directory and maps that, so
                worker processes must run on the same machine.
            field: as for :class:`HFSource`.
            split: the split to read when `path` holds a ``DatasetDict``.
        """
        datasets = _import_datasets()
        where = os.fspath(path)
        try:
            loaded = datasets.load_from_disk(where, keep_in_memory=False)
        except FileNotFoundError as e:
            raise FileNotFoundError(
                f"HFSource.from_disk: {where} holds no saved dataset ({e}); write one with "
                "Dataset.save_to_disk(path)"
            ) from e
        if isinstance(loaded, datasets.DatasetDict):
            if split is None or split not in loaded:
                got = "no split" if split is None else f"split={split!r}"
                raise ValueError(
                    f"HFSource.from_disk: {where} holds a DatasetDict with splits "
                    f"{sorted(loaded)}; got {got}; pass split= one of them"
                )
            loaded = loaded[split]
        elif split is not None:
            raise ValueError(
                f"HFSource.from_disk: {where} holds a single Dataset, not a DatasetDict; "
                f"got split={split!r}; drop split"
            )
        source = cls(loaded, field=field)
        source._path = where
        return source

    @property
    def dataset(self) -> Any:
        """The dataset that reads go to (narrowed to `field`'s column when one is given)."""
        return self._dataset

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index: int) -> Any:
        i = check_index("HFSource", index, len(self._dataset))
        row = self._dataset[i]
        return row if self._field is None else self._pick(row, i)

    def read(self, indices: Sequence[int]) -> list[Any]:
        """Rows at `indices`, in that order, gathered in one ``dataset[indices]`` call."""
        n = len(self._dataset)
        checked = [check_index("HFSource", i, n) for i in indices]
        if not checked:
            return []
        batch = self._dataset[checked]
        if not isinstance(batch, Mapping):
            # Formats such as "pandas" or "arrow" return a frame or table for a batch;
            # rows one at a time keep read() equal to indexing.
            return [self[i] for i in checked]
        if self._field is not None:
            if self._field not in batch:
                self._pick(batch, checked[0])  # raises the error that names the fix
            return list(batch[self._field])
        keys = list(batch)
        if not keys:
            return [{} for _ in checked]
        return [
            dict(zip(keys, values, strict=True)) for values in zip(*batch.values(), strict=True)
        ]

    def content_identity(self) -> dict[str, Any]:
        """What the source holds, for the pipeline fingerprint: a digest of the features
        (column types) and of up to 64 sampled rows as :meth:`read` returns them, and the
        field. Not the path: a copied dataset still matches."""
        rows = self.read(sample_positions(len(self._dataset)))
        return {
            "kind": "hf",
            "features": short_digest(repr(self._dataset.features)),
            "sample": items_sample(rows),
            "field": self._field,
        }

    def __repr__(self) -> str:
        where = f"path={self._path!r}" if self._path is not None else f"columns={self._columns}"
        return f"HFSource({where}, field={self._field!r}, len={len(self)})"

    def _pick(self, row: Any, i: int) -> Any:
        try:
            return row[self._field]
        except (KeyError, TypeError) as e:
            found = f"fields {sorted(row)}" if isinstance(row, Mapping) else type(row).__name__
            raise KeyError(
                f"HFSource: row {i} has no field {self._field!r} (found {found}); the dataset's "
                "transform or format leaves it out: pass another field or field=None"
            ) from e


def _check_is_dataset(datasets: Any, dataset: Any) -> None:
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(
            f"HFSource takes one split, not a DatasetDict; pass dataset[split] with split one "
            f"of {sorted(dataset)}"
        )
    if isinstance(dataset, datasets.IterableDataset | datasets.IterableDatasetDict):
        raise TypeError(
            "HFSource needs random access; a streaming IterableDataset has none: load it "
            "without streaming=True, or save it with save_to_disk and use HFSource.from_disk"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"HFSource takes a datasets.Dataset; got {type(dataset).__name__}; use "
            "HFSource.from_disk(path) for a directory written by save_to_disk"
        )
