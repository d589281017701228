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


def describe_callable(fn: Any) -> str:
    """``module.qualname#digest`` for functions; the type's name plus repr otherwise."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    if code is None:
        return f"{type(fn).__module__}.{type(fn).__qualname__}:{fn!r}"
    h = hashlib.sha256()
    _code_digest(code, h)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
    return f"{name}#{h.hexdigest()[:16]}"
