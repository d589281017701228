"""The shared argument check: the same rule and message for every operator that takes a
count."""

import numpy as np
import pytest

import zephon as zp
from zephon._args import positive_int


@pytest.mark.parametrize("good", [1, 7, np.int64(3), np.uint8(2)])
def test_positive_ints_come_back_as_int(good):
    out = positive_int("x(n=...)", good)
    assert out == good and type(out) is int


@pytest.mark.parametrize("bad", [0, -1, True, False, np.bool_(True), 1.0, "2", None, np.float32(2)])
def test_anything_else_is_an_error_naming_the_argument(bad):
    with pytest.raises(ValueError) as e:
        positive_int("x(n=...)", bad)
    assert str(e.value) == f"x(n=...) must be a positive int; got {bad!r}"


def test_the_unit_is_named():
    with pytest.raises(ValueError, match=r"must be a positive int \(Hz\); got 0"):
        positive_int("decode_audio(sample_rate=...)", 0, "Hz")


@pytest.mark.parametrize(
    ("build", "what"),
    [
        (lambda p: p.split(max_len=True), r"split\(max_len=\.\.\.\)"),
        (lambda p: p.shuffle(buffer_size=True), r"shuffle\(buffer_size=\.\.\.\)"),
        (lambda p: p.ensure_mixture(buffer_size=True), r"ensure_mixture\(buffer_size=\.\.\.\)"),
    ],
)
def test_a_bool_is_not_a_count(build, what):
    """``True`` is an ``int`` to Python; these once took it as 1."""
    pipe = zp.Pipeline(zp.StaticMixtureWorkSource([zp.ArraySource([1, 2])], seed=0))
    with pytest.raises(ValueError, match=rf"{what} must be a positive int; got True"):
        build(pipe.fetch())


def test_a_numpy_count_is_taken():
    pipe = zp.Pipeline(zp.StaticMixtureWorkSource([zp.ArraySource([1, 2])], seed=0))
    pipe.fetch().shuffle(buffer_size=np.int64(4))
