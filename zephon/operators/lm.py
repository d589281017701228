"""Language-model layouts: ``lm_targets`` (next-token targets on packed rows) and
``trim_or_pad`` (the non-packed path: every row cut or padded to one length).

Both work on the last axis of their features, so they may run before ``batch`` (one row
per record) or after it (a batch of rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from zephon._args import positive_int
from zephon.operators.base import Operator, OpTraits, Output, check_fits
from zephon.records import Record

#: Output names per naming scheme: (inputs, targets, segment ids suffix, positions suffix).
_NAMES = {
    "zephon": ("_segment_ids", "_positions"),
    "maxtext": ("_segmentation", "_position"),
}


class LmTargets(Operator):
    """Next-token layout on packed rows (see :meth:`zephon.Pipeline.lm_targets`)."""

    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "lm_targets"

    def __init__(
        self, feature: str = "tokens", ignore_id: int = -100, names: str = "zephon"
    ) -> None:
        if not isinstance(feature, str) or not feature:
            raise ValueError(f"lm_targets(feature=...) must be a feature name; got {feature!r}")
        if names not in _NAMES:
            raise ValueError(
                f"lm_targets(names=...) must be one of {sorted(_NAMES)}; got {names!r}"
            )
        if not isinstance(ignore_id, (int, np.integer)) or isinstance(ignore_id, bool):
            raise ValueError(f"lm_targets(ignore_id=...) must be an int; got {ignore_id!r}")
        self.feature = feature
        self.ignore_id = int(ignore_id)
        self.names = names
        seg, pos = _NAMES[names]
        self.out_names = (
            "inputs",
            "targets",
            "inputs" + seg,
            "inputs" + pos,
            "targets" + seg,
            "targets" + pos,
        )
        self._checked: set[np.dtype] = set()

    @property
    def pad_values(self) -> dict[str, int]:
        """What a padding row holds per output feature (``batch(pad_last=True)`` reads it)."""
        return {"targets": self.ignore_id}

    def _layout(self, data: Any) -> dict[str, Any]:
        f = self.feature
        if not isinstance(data, dict):
            raise TypeError(
                f"lm_targets needs records that are dicts of features; got {type(data).__name__}"
            )
        seg_name, pos_name = f + "_segment_ids", f + "_positions"
        if f not in data or seg_name not in data or pos_name not in data:
            raise KeyError(
                f"lm_targets(feature={f!r}) needs {f!r}, {seg_name!r} and {pos_name!r} in each "
                f"record (fields: {sorted(data)}): put .pack(...) or .trim_or_pad(...) before "
                "it, or name the packed feature with feature=..."
            )
        tokens = np.asarray(data[f])
        seg = np.asarray(data[seg_name])
        if tokens.dtype not in self._checked:
            check_fits(
                f"lm_targets(ignore_id={self.ignore_id!r})", "targets", self.ignore_id, tokens.dtype
            )
            self._checked.add(tokens.dtype)
        # targets[i] = tokens[i + 1] where token i + 1 is of the same segment; ignore_id at a
        # segment's last token (its next token starts another document, or is padding), on
        # padding, and at the row's end (what follows is in no row of this one).
        same = np.zeros(seg.shape, dtype=bool)
        np.logical_and(seg[..., 1:] == seg[..., :-1], seg[..., :-1] != 0, out=same[..., :-1])
        targets = np.full(tokens.shape, self.ignore_id, dtype=tokens.dtype)
        np.copyto(targets[..., :-1], tokens[..., 1:], where=same[..., :-1])
        target_seg = np.where(same, seg, 0).astype(seg.dtype, copy=False)
        names = self.out_names
        out = {k: v for k, v in data.items() if k not in (f, seg_name, pos_name)}
        clash = [n for n in names if n in out]
        if clash:
            raise ValueError(
                f"lm_targets: the record already has {clash}; rename them (map) or drop them "
                "before lm_targets, which writes those names"
            )
        pos = data[pos_name]
        out[names[0]] = tokens
        out[names[1]] = targets
        out[names[2]] = seg
        out[names[3]] = pos
        out[names[4]] = target_seg
        out[names[5]] = pos
        return out

    def process(self, record: Record) -> Iterable[Output]:
        return (record.replace(self._layout(record.data)),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        layout = self._layout
        return [r.replace(layout(r.data)) for r in records]

    def fresh(self) -> Operator:
        return LmTargets(self.feature, self.ignore_id, self.names)

    def __repr__(self) -> str:
        return (
            f"LmTargets(feature={self.feature!r}, ignore_id={self.ignore_id}, names={self.names!r})"
        )


class TrimOrPad(Operator):
    """Every per-token feature cut or padded to ``max_len`` (see
    :meth:`zephon.Pipeline.trim_or_pad`)."""

    traits = OpTraits(preserves_cursor_order=True, stateful=False)
    name = "trim_or_pad"

    def __init__(
        self,
        max_len: int,
        pad_values: Mapping[str, Any] | None = None,
        feature: str = "tokens",
    ) -> None:
        max_len = positive_int("trim_or_pad(max_len=...)", max_len)
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise TypeError(
                "trim_or_pad(pad_values=...) must be a dict of feature name to pad value "
                f"(e.g. {{'targets': -100}}); got {type(pad_values).__name__}"
            )
        self.max_len = max_len
        self.pad_values = dict(pad_values or {})
        self.feature = feature
        self._checked: set[tuple[str, np.dtype]] = set()

    def _row(self, record: Record) -> Record:
        data = record.data
        f = self.feature
        if not isinstance(data, dict) or f not in data:
            fields = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise KeyError(
                f"trim_or_pad(feature={f!r}) needs {f!r} in each record (got {fields}); "
                "tokenize first, or name the per-token feature with feature=..."
            )
        n = len(data[f])
        keep = min(n, self.max_len)
        m = self.max_len
        out: dict[str, Any] = {}
        for k, v in data.items():
            a = v if type(v) is np.ndarray else None
            if a is None or a.ndim != 1 or len(a) != n:
                out[k] = v  # not per-token: kept as it is
                continue
            pad = self.pad_values.get(k, 0)
            if (k, a.dtype) not in self._checked:
                check_fits(f"trim_or_pad(pad_values={{{k!r}: {pad!r}}})", k, pad, a.dtype)
                self._checked.add((k, a.dtype))
            row = np.empty(m, dtype=a.dtype)
            row[:keep] = a[:keep]
            row[keep:] = pad
            out[k] = row
        seg = np.zeros(m, dtype=np.int32)
        seg[:keep] = 1
        pos = np.zeros(m, dtype=np.int32)
        pos[:keep] = np.arange(keep, dtype=np.int32)
        out[f + "_segment_ids"] = seg
        out[f + "_positions"] = pos
        out[f + "_mask"] = seg.astype(bool)
        mix = record.component_tokens
        if len(mix) == 1 and keep != n:
            ((component, _),) = mix.items()
            mix = {component: keep}
        return Record(out, record.lane, record.contributors, mix)

    def process(self, record: Record) -> Iterable[Output]:
        return (self._row(record),)

    def process_batch(self, records: list[Record]) -> list[Output]:
        row = self._row
        return [row(r) for r in records]

    def fresh(self) -> Operator:
        return TrimOrPad(self.max_len, self.pad_values, self.feature)

    def __repr__(self) -> str:
        return (
            f"TrimOrPad(max_len={self.max_len}, pad_values={dict(sorted(self.pad_values.items()))!r}, "
            f"feature={self.feature!r})"
        )
