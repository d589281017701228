"""Stable descriptions of user callables for the pipeline fingerprint.

``repr`` of a lambda contains its address, which changes every run; the fingerprint must
not. We describe a function by where it lives and a hash of its bytecode and constants
(recursing into nested code objects), which is stable across processes and runs.
"""

from __future__ import annotations

import hashlib
import types
from typing import Any


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
