"""An operator's error says where in the stream it was raised, and a worker's error is
raised again in the parent as Python would show it (issue 33, item 6): its type kept where
it can be rebuilt, its message and the worker's traceback over real lines, the worker, the
operator, the lane and the sample named. (With real worker processes: in
tests/integration/test_workers_faults.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest

import zephon as zp
from zephon.runners import faults
from zephon.runners.chain import WHERE


class BadRecordError(Exception):
    """A user's own error type, importable in the parent."""


class TwoArgsError(Exception):
    """Rebuilt without its constructor: the message goes in as it is."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")


class MadeOfTwoError(Exception):
    """Its ``__new__`` takes two arguments: rebuilt without it too."""

    def __new__(cls, key: str, why: str) -> MadeOfTwoError:
        return super().__new__(cls, key, why)


def lookup(x: np.int64) -> dict[str, np.ndarray]:
    if int(x) == 42:
        return {"a": 1}["tokens"]  # type: ignore[return-value]
    return {"x": np.full(3, x)}


def _pipe(fn, parallelism: int = 1) -> zp.Pipeline:
    src = zp.StaticMixtureWorkSource(
        [zp.ArraySource(np.arange(100, dtype=np.int64))], seed=0, chunk_size=8, num_epochs=1
    )
    pipe = zp.Pipeline(src, canonical_replicas=2).fetch().map(fn, parallelism=parallelism)
    return pipe.batch(3)


POINTER = "at sample SamplePointer(component=0, index=42) (record cursor: chunk "


@pytest.mark.parametrize("parallelism", [1, 3], ids=["in_line", "threads"])
def test_an_operator_error_in_process_keeps_its_type_and_notes_where(parallelism: int) -> None:
    with _pipe(lookup, parallelism) as pipe, pytest.raises(KeyError) as info:
        for _ in pipe:
            pass
    err = info.value
    assert type(err) is KeyError and err.args == ("tokens",)
    (note,) = err.__notes__
    assert note.startswith("[zephon] raised in Map(fn=lookup, parallelism=")
    assert re.search(r" on lane \d+, ", note) and POINTER in note, note
    assert getattr(err, WHERE) in note


def _reported(e: BaseException) -> dict:
    try:
        raise e
    except BaseException as raised:  # noqa: BLE001 - as the worker reports it
        return faults.error_message(raised)


def _with_where(e: BaseException, where: str) -> BaseException:
    setattr(e, WHERE, where)
    e.add_note(f"[zephon] raised in {where}")
    return e


def test_a_workers_key_error_is_a_key_error_over_real_lines() -> None:
    where = (
        "Map(fn=lookup, parallelism=1) on lane 1, at sample SamplePointer(component=0, index=42)"
    )
    msg = _reported(_with_where(KeyError("tokens"), where))
    err = faults.rebuild_error(3, 1234, msg)
    assert isinstance(err, KeyError) and isinstance(err, zp.WorkerError)
    text = str(err)
    # KeyError's own str() would quote the whole text, newlines as "\n" on one line
    assert "\\n" not in text and text.count("\n") > 4, text
    lines = text.splitlines()
    assert lines[0] == "'tokens'"  # the message, as Python shows a KeyError's
    assert lines[2] == f"[worker 3 (pid 1234) raised KeyError in {where}; its traceback:]"
    assert lines[3] == "Traceback (most recent call last):"
    assert lines[-1] == "KeyError: 'tokens'"
    assert where not in "\n".join(lines[3:]), "the place is said once, not again as a note"
    with pytest.raises(KeyError):
        raise err


@pytest.mark.parametrize(
    ("error", "cls", "first"),
    [
        (BadRecordError("record 7 is empty"), BadRecordError, "record 7 is empty"),
        (TwoArgsError("k", "why"), TwoArgsError, "k: why"),
        (MadeOfTwoError("k", "why"), MadeOfTwoError, "('k', 'why')"),
        (FileNotFoundError(2, "gone"), FileNotFoundError, "[Errno 2] gone"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"), UnicodeDecodeError, "'utf-8' codec"),
    ],
)
def test_a_workers_error_of_a_class_the_parent_has_keeps_its_class(
    error: BaseException, cls: type, first: str
) -> None:
    err = faults.rebuild_error(0, 1, _reported(error))
    assert isinstance(err, cls) and isinstance(err, zp.WorkerError)
    assert str(err).startswith(first), str(err)
    header = f"\n\n[worker 0 (pid 1) raised {type(error).__name__}; its traceback:]\nTraceback"
    assert header in str(err)
    again = faults.rebuild_error(1, 2, _reported(error))
    assert type(again) is type(err), "one class per original type"


@pytest.mark.parametrize(
    ("error", "name"),
    [
        # raised out of next(), a StopIteration would end the caller's loop without a word
        (StopIteration(3), "StopIteration"),
        (StopAsyncIteration(), "StopAsyncIteration"),
    ],
)
def test_a_workers_error_whose_class_cannot_be_rebuilt_is_a_worker_error_naming_it(
    error: BaseException, name: str
) -> None:
    err = faults.rebuild_error(0, 1, _reported(error))
    assert type(err) is zp.WorkerError and not isinstance(err, StopIteration)
    assert str(err).startswith(f"{name}: "), str(err)
    assert f"[worker 0 (pid 1) raised {name}; its traceback:]\nTraceback" in str(err)


def test_a_class_the_parent_has_not_imported_is_not_imported_for_an_error() -> None:
    msg = _reported(ValueError("x"))
    msg.update(module="a_module_nobody_imported", qualname="Oops", type="Oops")
    err = faults.rebuild_error(0, 1, msg)
    assert type(err) is zp.WorkerError and str(err).startswith("Oops: x")


@pytest.mark.parametrize(
    ("method", "booted", "says"),
    [
        ("spawn", False, "it is still importing your main module"),
        ("forkserver", False, "it is still importing your main module"),
        ("spawn", True, "it is still loading its configuration"),
        ("fork", False, "it never began to run Zephon's code"),
    ],
)
def test_a_worker_that_never_reached_its_loop_is_told_from_a_hung_one(
    method: str, booted: bool, says: str
) -> None:
    err = faults.never_reached_loop(2, None, [1, 3], 5.0, method, booted)
    msg = str(err)
    assert msg.startswith(
        "worker 2 (pid None, lanes [1, 3]) never reached its loop within worker_timeout_s=5 s: "
    )
    assert says in msg
    guard = "under `if __name__ == '__main__':`" in msg
    assert guard == (not booted and method != "fork"), msg
    assert "hung" not in msg
    assert "hung or stopped" in str(faults.hung(2, None, [1, 3], 5.0))
