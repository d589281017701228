"""What a checkpoint state may hold: plain msgpack values, checked on save and on load.

A state is a dict with str keys whose values are None, bool, int (64-bit), float, str,
bytes, list or dict, nested at most :data:`MAX_DEPTH` levels. Nothing else is allowed in
either direction, and nothing is pickled, so a state decoded from an untrusted file is only
data: it cannot run code, and it reads back as what was saved.

* Saving (:func:`check_writable`, before :func:`zephon.checkpoint.io.dumps` packs): reject
  what msgpack would silently change on the way back (a tuple becomes a list, an int key is
  refused on load), or fail on with a message that does not say where (a numpy scalar, an int
  over 64 bits, a cycle). The message names the value's place in the state and the fix.
* Loading (:func:`check_decoded`, after :func:`zephon.checkpoint.io.loads` unpacks): msgpack's
  ``strict_map_key`` still admits bytes keys, and a crafted file can nest deeper than any
  state does; both are corruption. A leader decodes one state per rank each round, so the
  quick check also runs in C (``zephon._state``, ``native/state_module.c``); ``_plain`` below
  is the same function, used when the extension is not built or ``ZEPHON_PURE_PYTHON=1``.
  The saving side's quick check (``_writable``) has its C twin there too.
  Ext types are refused while decoding: ``loads``'s ``max_ext_len=0`` refuses any with
  data (timestamps included), and :func:`reject_ext`, its ``ext_hook``, the empty ones.

Each side has a quick check that builds no paths and a slow one, run only when the quick one
says no, that finds the culprit and says where.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from zephon._native import load as load_native
from zephon.errors import CheckpointError

__all__ = ["MAX_DEPTH", "check_decoded", "check_writable", "reject_ext"]

# Checkpoint states are shallow (lanes -> chunks -> fields). A cap well under msgpack's own
# limits turns a reference cycle or a hostile payload into a clear error, not a crash.
MAX_DEPTH = 256
#: ``_plain`` and ``_writable`` in C (``native/state_module.c``): a leader checks every rank's
#: state it decodes, and every rank the state it encodes, each round.
_NATIVE = load_native("_state")
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1
_SCALAR_TYPES = frozenset({str, bytes, float, bool, type(None)})


# ----------------------------------------------------------------------------------- saving


def check_writable(state: object) -> None:
    """Check that ``state`` holds only checkpoint types, so that it reads back as written
    (a subclass of one, such as an IntEnum, passes and reads back as the type itself).

    Raises:
        CheckpointError: ``state`` is not a dict, or holds something the format cannot
            round-trip exactly (a tuple, a non-str key, a numpy scalar, an int over 64 bits,
            a cycle); the message names where, and the fix where there is one.
    """
    if not (_writable(state) if _NATIVE is None else _NATIVE.writable(state, MAX_DEPTH)):
        _check_writable(state)  # raises, saying where


def _writable(state: object) -> bool:
    """The quick check behind :func:`check_writable`: True when every key is a str and every
    value an exact checkpoint type (ints in msgpack's range, nothing nested deeper than
    :data:`MAX_DEPTH`). It builds no paths, so it is several times faster than
    :func:`_check_writable`, which runs only when this says False (to find the culprit, or
    to accept what only a subclass of a checkpoint type made look odd)."""
    if type(state) is not dict:
        return False
    scalars = _SCALAR_TYPES
    stack: list[tuple[Any, int]] = [(state, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        container, depth = pop()
        if depth >= MAX_DEPTH:
            return False
        depth += 1
        if type(container) is dict:
            for key in container:
                if type(key) is not str:
                    return False
            values = container.values()
        else:
            values = container
        for v in values:
            t = type(v)
            if t is dict or t is list:
                push((v, depth))
            elif t is int:
                if not _INT_MIN <= v <= _INT_MAX:
                    return False
            elif t not in scalars:
                return False
    return True


def _check_writable(state: object) -> None:
    """Reject what msgpack would silently change on the way back (tuple -> list, int keys
    that ``loads`` refuses) or fail on with a message that does not say where."""
    if not isinstance(state, dict):
        raise CheckpointError(f"a checkpoint state must be a dict; got {type(state).__name__}")
    for path, value in _walk(state):
        if len(path) > MAX_DEPTH:
            raise CheckpointError(
                f"cannot checkpoint {_where(path[:8])}…: nested deeper than {MAX_DEPTH} levels"
                " (a reference cycle?)"
            )
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"cannot checkpoint {_where(path)}: key {key!r} is"
                        f" {type(key).__name__}; checkpoint keys must be str"
                    )
        elif value is None or isinstance(value, bool | float | str | bytes | list):
            pass
        elif isinstance(value, int):
            if not _INT_MIN <= value <= _INT_MAX:
                raise CheckpointError(
                    f"cannot checkpoint {_where(path)}: int {value} is outside msgpack's range"
                    " [-2**63, 2**64 - 1]; store it as str or bytes"
                )
        else:
            kind = type(value)
            name = kind.__qualname__
            if kind.__module__ != "builtins":
                name = f"{kind.__module__}.{name}"
            raise CheckpointError(
                f"cannot checkpoint {_where(path)}: {name} is not a checkpoint type"
                f" (None, bool, int, float, str, bytes, list, dict){_FIX_HINTS.get(kind, '')}"
            )


# msgpack would turn these into another type on the way back, or cannot pack them.
_FIX_HINTS: dict[type, str] = {
    tuple: "; use a list",
    set: "; use a sorted list",
    frozenset: "; use a sorted list",
    bytearray: "; use bytes(...)",
    memoryview: "; use bytes(...)",
}


# ---------------------------------------------------------------------------------- loading


def check_decoded(state: dict[str, Any]) -> None:
    """Check the structure of a state msgpack decoded: every key a str, nothing nested
    deeper than :data:`MAX_DEPTH`. The values need no check: with ext types refused, all
    msgpack decodes is None, bool, int, float, str, bytes, list and dict.

    Raises:
        CheckpointError: ``corrupt: ...``, saying where.
    """
    if not (_plain(state) if _NATIVE is None else _NATIVE.plain(state, MAX_DEPTH)):
        _explain_keys(state)


def _plain(state: dict[str, Any]) -> bool:
    """Whether every key in ``state`` is a str and nothing nests deeper than :data:`MAX_DEPTH`
    (the quick check: it builds no paths, and looks only at containers). ``zephon._state``'s
    ``plain`` is the same function in C, used when built."""
    stack: list[tuple[Any, int]] = [(state, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        value, depth = pop()
        if depth >= MAX_DEPTH and value:  # its contents would lie too deep
            return False
        if type(value) is dict:
            for key in value:
                if type(key) is not str:
                    return False
            children: Iterable[Any] = value.values()
        else:
            children = value
        depth += 1
        for v in children:
            t = type(v)
            if t is dict or t is list:
                push((v, depth))
    return True


def _explain_keys(state: dict[str, Any]) -> None:
    """Raises the CheckpointError that says where :func:`_plain` failed."""
    for path, value in _walk(state):
        if len(path) > MAX_DEPTH:
            raise CheckpointError(
                f"corrupt: {_where(path[:8])}… is nested deeper than {MAX_DEPTH} levels"
            )
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise CheckpointError(
                        f"corrupt: {_where(path)} has key {key!r} of type"
                        f" {type(key).__name__}; checkpoint keys are str"
                    )
    raise CheckpointError("corrupt: malformed state")  # _plain and _walk disagree: unreachable


def reject_ext(code: int, data: bytes) -> object:
    """msgpack's ``ext_hook`` for checkpoints: a state holds no ext types, so any is
    corruption (the ValueError becomes ``loads``'s ``corrupt: msgpack ...`` error)."""
    raise ValueError(f"ext type {code} ({len(data)} bytes); checkpoints hold no ext types")


# ------------------------------------------------------------------------------ both sides


def _walk(state: dict[str, Any]) -> Iterator[tuple[tuple[object, ...], object]]:
    """Yield ``(path, value)`` for every value in ``state``, iteratively (no recursion limit).

    ``path`` is the keys and indexes leading to ``value``; :func:`_where` renders it. The walk
    does not descend below :data:`MAX_DEPTH`, so the caller sees the too-deep value and raises.
    """
    stack: list[tuple[tuple[object, ...], object]] = [((), state)]
    while stack:
        path, value = stack.pop()
        yield path, value
        if len(path) > MAX_DEPTH:
            continue
        if isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))


def _where(path: tuple[object, ...]) -> str:
    """``("lanes", 0, "cursor")`` -> ``state['lanes'][0]['cursor']``."""
    return "state" + "".join(f"[{k!r}]" for k in path)
