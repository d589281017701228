"""The pipeline fingerprint: the digest a checkpoint must match (:func:`pipeline_fingerprints`),
its part map (what a mismatch names, :func:`fingerprint_parts`, :func:`describe_differences`)
and stable descriptions of user callables for both.

``repr`` of a lambda contains its address, which changes every run; the fingerprint must
not. We describe a function by where it lives and a hash of its bytecode and constants
(recursing into nested code objects), which is stable across processes and runs.
"""

from __future__ import annotations

import hashlib
import json
import types
from collections.abc import Sequence
from typing import Any

import msgpack


def _code_digest(code: types.CodeType, h: Any) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _code_digest(const, h)
        else:
            h.update(repr(const).encode())


_PLAIN = (int, float, str, bytes, bool, type(None))


def _value(v: Any) -> str:
    """Plain values by value (they change results); anything else by type only, because
    its repr may carry a memory address that differs on every run."""
    if isinstance(v, _PLAIN):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{_value(k)}:{_value(x)}" for k, x in v.items()) + "}"
    if hasattr(v, "dtype") and getattr(v, "shape", None) == ():
        return f"{v.dtype}:{v!r}"
    if callable(v) and hasattr(v, "__code__"):
        return describe_callable(v)
    return f"<{type(v).__module__}.{type(v).__qualname__}>"


def describe_callable(fn: Any) -> str:
    """``module.qualname#digest`` for functions, the digest covering bytecode, constants,
    defaults and captured plain values; the type's name plus repr otherwise."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}:{fn!r}"
    h = hashlib.sha256()
    _code_digest(code, h)
    h.update(_value(getattr(target, "__defaults__", None)).encode())
    h.update(_value(getattr(target, "__kwdefaults__", None)).encode())
    for cell in getattr(target, "__closure__", None) or ():
        try:
            h.update(_value(cell.cell_contents).encode())
        except ValueError:  # an empty cell
            h.update(b"<empty>")
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
    return f"{name}#{h.hexdigest()[:16]}"


# ------------------------------------------------------------------ the fingerprint


def pipeline_fingerprints(
    source: Any, canonical_replicas: int, flush_every_k_chunks: int, ops: Sequence[Any]
) -> tuple[str, dict[str, str], str]:
    """(fingerprint, parts, legacy fingerprint) of a pipeline definition: a hash of the work
    source's config (with every dataset's content identity), the operators and their
    parameters, ``canonical_replicas`` and the flush cadence; the same part by part (see
    :func:`fingerprint_parts`); and what checkpoints without a part map hold (the hash
    without content identities)."""
    config = source.config() if callable(getattr(source, "config", None)) else repr(type(source))
    legacy_config = (
        {k: v for k, v in config.items() if k != "identities"}
        if isinstance(config, dict)
        else config
    )
    descriptions = [op.fingerprint() for op in ops]
    k = flush_every_k_chunks
    return (
        _digest(config, canonical_replicas, k, descriptions),
        fingerprint_parts(config, canonical_replicas, k, ops),
        _digest(legacy_config, canonical_replicas, k, descriptions),
    )


def _digest(config: Any, canonical_replicas: int, k: int, ops: list[str]) -> str:
    desc = {
        "source": config,
        "canonical_replicas": canonical_replicas,
        "flush_every_k_chunks": k,
        "ops": ops,
    }
    return hashlib.sha256(msgpack.packb(desc, use_bin_type=True, default=repr)).hexdigest()


# ------------------------------------------------------------------ fingerprint parts
#
# Beside the overall fingerprint a checkpoint carries a small flat map ``part -> text``, so
# that a mismatch can say which part differs. Parts are ``canonical_replicas``,
# ``flush_every_k_chunks``, ``source.<key>`` (the work source's config), ``components``
# and ``component.<c>.<property>`` (``name``, ``length``, ``weight``,
# ``identity.<key>``), ``ops`` and ``op.<i>`` (the operator's name) and
# ``op.<i>.<parameter>``. A text longer than ``PART_TEXT_CHARS`` is stored as its start,
# ``…#`` and 16 hex digits of its sha256, so the map stays small whatever the values.
#
# A mixture of more than ``COLUMNS_ABOVE`` components keeps its component parts as columns,
# one part per property holding a JSON list of every component's text
# (``component.name``, ``component.length``, ``component.weight``), and each component's
# content identity as one 8-hex-digit digest of its ``identity.<key>`` texts
# (``component.identity.digest``): the keys cost more than the values otherwise, and the
# identities' own digests are what does not compress. The overall fingerprint still
# covers every identity in full; the map only has to say which component differs, and in
# what (:func:`expand_parts` gives it back as ``component.<c>.identity.digest``). Names,
# lengths and weights are kept whole: restoring into an edited mixture matches components
# by name and tells a reweighted one from one whose data changed.

PART_TEXT_CHARS = 48
#: More components than this: their parts are stored as columns (see above).
COLUMNS_ABOVE = 64
#: Hex digits of a component's identity digest in a columnar part map (4 bytes).
IDENTITY_DIGEST_HEX = 8
_KEPT_CHARS = PART_TEXT_CHARS - 18
_PER_COMPONENT = {
    "names": "name",
    "lengths": "length",
    "weights": "weight",
    "identities": "identity",
}
_MAX_REPORTED = 8  # differences named in one message; the rest are counted


def short_text(text: str) -> str:
    """``text`` itself when short, else its start, ``…#`` and a digest of all of it."""
    if len(text) <= PART_TEXT_CHARS:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[:_KEPT_CHARS]}…#{digest}"


def call_parameters(text: str, positional: tuple[str, ...] = ()) -> dict[str, str]:
    """The arguments of a description written as a call: ``"Pack(seq_len=16, num_bins=2)"``
    -> ``{"seq_len": "16", "num_bins": "2"}``. Positional arguments take the names in
    ``positional``, then ``arg1``, ``arg2``, ...; a text that is not a call is one part,
    ``{"definition": text}``."""
    open_at = text.find("(")
    if open_at <= 0 or not text.endswith(")") or not text[:open_at].isidentifier():
        return {"definition": text}
    args: list[str] = []
    depth, quote, start, i = 0, "", open_at + 1, open_at + 1
    inner_end = len(text) - 1
    while i < inner_end:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i])
            start = i + 1
        i += 1
    if depth != 0 or quote:
        return {"definition": text}
    args.append(text[start:inner_end])
    params: dict[str, str] = {}
    n_positional = 0
    for arg in (a.strip() for a in args):
        if not arg:
            continue
        key, eq, value = arg.partition("=")
        if eq and key.strip().isidentifier() and not value.startswith("="):
            params[key.strip()] = value.strip()
        else:
            name = (
                positional[n_positional]
                if n_positional < len(positional)
                else f"arg{n_positional + 1}"
            )
            params[name] = arg
            n_positional += 1
    return params


def fingerprint_parts(
    source_config: Any, canonical_replicas: int, flush_every_k_chunks: int, ops: Any
) -> dict[str, str]:
    """The part map of a pipeline definition (see the comment above)."""
    parts = {
        "canonical_replicas": str(canonical_replicas),
        "flush_every_k_chunks": str(flush_every_k_chunks),
    }
    if isinstance(source_config, dict):
        names = source_config.get("names")
        if isinstance(names, list):
            parts["components"] = str(len(names))
        columns = isinstance(names, list) and len(names) > COLUMNS_ABOVE
        for key, value in source_config.items():
            prop = _PER_COMPONENT.get(key)
            if prop is None or not isinstance(value, list):
                parts[f"source.{key}"] = short_text(repr(value))
                continue
            texts = [_item_texts(prop, item) for item in value]
            if not columns:
                for c, item_texts in enumerate(texts):
                    for k, text in item_texts.items():
                        parts[f"component.{c}.{k}"] = text
            elif prop == "identity" or any(len(t) != 1 or prop not in t for t in texts):
                parts[f"component.{prop}.digest"] = "".join(_digest_hex(t) for t in texts)
            else:
                parts[f"component.{prop}"] = json.dumps([t[prop] for t in texts])
    else:
        parts["source"] = short_text(str(source_config))
    parts["ops"] = str(len(ops))
    for i, op in enumerate(ops):
        parts[f"op.{i}"] = short_text(str(op.name))
        for key, text in op.fingerprint_parts().items():
            parts[f"op.{i}.{key}"] = short_text(str(text))
    return parts


def _item_texts(prop: str, item: Any) -> dict[str, str]:
    """One component's parts of ``prop`` (without the ``component.<c>.`` prefix)."""
    if isinstance(item, dict):
        return {f"{prop}.{k}": short_text(repr(v)) for k, v in item.items()}
    return {prop: short_text(repr(item))}


def _digest_hex(texts: dict[str, str]) -> str:
    """The digest that stands for one component's parts ``texts`` in a column."""
    joined = "\n".join(f"{k}={texts[k]}" for k in sorted(texts))
    h = hashlib.sha256(joined.encode("utf-8", "surrogatepass")).hexdigest()
    return h[:IDENTITY_DIGEST_HEX]


def _column_texts(prop: str, text: str) -> list[str] | None:
    """The per-component texts of column ``prop``: a digest column is a string of
    :data:`IDENTITY_DIGEST_HEX` hex digits per component (each text is the digest's
    repr), any other a JSON list of texts; None for a malformed column."""
    if prop.endswith(".digest"):
        n = IDENTITY_DIGEST_HEX
        if len(text) % n or any(ch not in "0123456789abcdef" for ch in text):
            return None
        return [repr(text[i : i + n]) for i in range(0, len(text), n)]
    try:
        values = json.loads(text)
    except ValueError:
        return None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        return None
    return values


def _column(key: str) -> str | None:
    """The property a columnar part holds (``component.name`` -> ``name``), else None."""
    if not key.startswith("component."):
        return None
    prop = key[len("component.") :]
    return None if not prop or prop.split(".", 1)[0].isdigit() else prop


def is_columnar(parts: dict[str, str]) -> bool:
    """Whether a part map keeps its component parts as columns."""
    return any(_column(k) is not None for k in parts)


def expand_parts(parts: dict[str, str]) -> dict[str, str]:
    """A part map with its component columns (if any) back as ``component.<c>.<property>``
    parts, in place of the columns; any other map as it is. A column that is not a JSON
    list of texts (or of digests) is left as it was (a malformed map: what differs is then
    named by key)."""
    if not is_columnar(parts):
        return parts
    out: dict[str, str] = {}
    for key, text in parts.items():
        prop = _column(key)
        values = None if prop is None else _column_texts(prop, text)
        if values is None:
            out[key] = text
            continue
        for c, value in enumerate(values):
            out[f"component.{c}.{prop}"] = value
    return out


def _digested(parts: dict[str, str]) -> dict[str, str]:
    """A flat part map with each component's identity parts as the one digest that a
    columnar map keeps, so that the two compare."""
    identities: dict[str, dict[str, str]] = {}
    out: dict[str, str] = {}
    for key, text in parts.items():
        head, dot, rest = key.partition(".")
        c, _, prop = rest.partition(".")
        if head == "component" and dot and c.isdigit() and prop.split(".", 1)[0] == "identity":
            if c not in identities:
                identities[c] = {}
                out[f"component.{c}.identity.digest"] = ""  # keeps the component's place
            identities[c][prop] = text
            continue
        out[key] = text
    for c, texts in identities.items():
        out[f"component.{c}.identity.digest"] = repr(_digest_hex(texts))
    return out


def comparable_parts(
    saved: dict[str, str], mine: dict[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Two part maps in one form, component by component: columns expanded, and a flat
    map's identities digested when the other map kept only digests."""
    columns = is_columnar(saved), is_columnar(mine)
    saved, mine = expand_parts(saved), expand_parts(mine)
    if columns[0] and not columns[1]:
        mine = _digested(mine)
    elif columns[1] and not columns[0]:
        saved = _digested(saved)
    return saved, mine


def _op_names(parts: dict[str, str]) -> str:
    n = int(parts["ops"]) if parts.get("ops", "").isdigit() else 0
    return ", ".join(parts.get(f"op.{i}", "?") for i in range(n))


def _component_names(parts: dict[str, str]) -> str:
    n = int(parts["components"]) if parts.get("components", "").isdigit() else 0
    return ", ".join(parts.get(f"component.{c}.name", "?") for c in range(n))


def _label(key: str, mine: dict[str, str], saved: dict[str, str]) -> str:
    if key == "flush_every_k_chunks":
        return "flush_every_k_chunks (the flush cadence)"
    head, _, rest = key.partition(".")
    if head == "source" and rest:
        return f"work source {rest}"
    if head == "component" and rest:
        c, _, prop = rest.partition(".")
        if prop == "name":
            return f"component {c} name"
        name = mine.get(f"component.{c}.name") or saved.get(f"component.{c}.name", "?")
        if prop.startswith("identity."):
            return f"component {c} ({name}) content identity {prop[len('identity.') :]}"
        return f"component {c} ({name}) {prop}"
    if head == "op" and rest:
        i, _, param = rest.partition(".")
        if not param:
            return f"operator {i}"
        return f"operator {i} ({mine.get(f'op.{i}', '?')}) parameter {param}"
    return key


def describe_differences(
    saved: dict[str, str],
    mine: dict[str, str],
    theirs: str = "the checkpoint",
    ours: str = "this pipeline",
) -> list[str]:
    """What differs between a checkpoint's part map and this pipeline's, in words, most
    telling first; ``[]`` when the maps agree. ``theirs`` and ``ours`` name the two sides."""
    saved, mine = comparable_parts(saved, mine)
    out: list[str] = []
    skip: list[str] = []
    if saved.get("ops") != mine.get("ops"):
        out.append(
            f"{theirs} has {saved.get('ops', '?')} operators ({_op_names(saved)}), {ours} has "
            f"{mine.get('ops', '?')} ({_op_names(mine)})"
        )
        skip.append("op.")
    if saved.get("components") != mine.get("components"):
        out.append(
            f"{theirs} has {saved.get('components', '?')} components "
            f"({_component_names(saved)}), {ours} has {mine.get('components', '?')} "
            f"({_component_names(mine)})"
        )
        skip.append("component.")
    keys = list(mine) + [k for k in saved if k not in mine]
    for key in keys:
        if key in ("ops", "components") or any(key.startswith(p) for p in skip):
            continue
        a, b = saved.get(key), mine.get(key)
        if a == b:
            continue
        out.append(
            f"{_label(key, mine, saved)}: {theirs} has {a if a is not None else '(nothing)'}, "
            f"{ours} has {b if b is not None else '(nothing)'}"
        )
        if key.startswith("op.") and key.count(".") == 1:
            skip.append(key + ".")  # another operator here: its parameters say nothing more
    if len(out) > _MAX_REPORTED:
        out = [*out[:_MAX_REPORTED], f"and {len(out) - _MAX_REPORTED} more"]
    return out
