"""tokenize and ByteTokenizer: ByT5 byte ids, EOS, fields, helpful errors."""

from __future__ import annotations

import numpy as np
import pytest

import zephon as zp
from zephon.chunks import SamplePointer
from zephon.operators.tokenize import Tokenize
from zephon.records import Contributor, Record
from zephon.testing import assert_resumes_exactly, take
from zephon.tokenizers.base import BYTE_OFFSET, EOS_ID


def _record(data: object, comp: int = 1) -> Record:
    return Record(data, 0, [Contributor(4, 2, 0, True)], {comp: 1})


# ------------------------------------------------------------------ ByteTokenizer


def test_byte_tokenizer_ids_are_bytes_plus_three_then_eos() -> None:
    tok = zp.ByteTokenizer()
    ids = tok.encode("abc")
    assert ids.dtype == np.int32
    assert ids.tolist() == [97 + 3, 98 + 3, 99 + 3, 1]
    assert (BYTE_OFFSET, EOS_ID) == (3, 1)
    assert tok.vocab_size == 259
    assert zp.ByteTokenizer(add_eos=False).encode("abc").tolist() == [100, 101, 102]
    assert tok.encode("").tolist() == [1]


def test_byte_tokenizer_multibyte_text() -> None:
    tok = zp.ByteTokenizer()
    # é = c3 a9, € = e2 82 ac, 😀 = f0 9f 98 80
    assert tok.encode("é").tolist() == [0xC3 + 3, 0xA9 + 3, 1]
    assert tok.encode("a€").tolist() == [97 + 3, 0xE2 + 3, 0x82 + 3, 0xAC + 3, 1]
    assert tok.encode("😀").tolist() == [0xF0 + 3, 0x9F + 3, 0x98 + 3, 0x80 + 3, 1]
    for text in ("é€😀 mixed ascii", "日本語"):
        assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_bytes_input() -> None:
    tok = zp.ByteTokenizer()
    assert tok.encode(b"\x00\x01\xff").tolist() == [3, 4, 258, 1]
    assert tok.encode(bytearray(b"A")).tolist() == [68, 1]
    assert tok.encode(memoryview(b"AB")).tolist() == [68, 69, 1]


def test_byte_tokenizer_rejects_other_types() -> None:
    with pytest.raises(TypeError, match=r"ByteTokenizer.encode takes str or bytes; got int"):
        zp.ByteTokenizer().encode(5)


# ------------------------------------------------------------------ Tokenize operator


def test_tokenize_string_record() -> None:
    op = Tokenize(zp.ByteTokenizer())
    (out,) = op.process(_record("hé"))
    assert set(out.data) == {"tokens"}
    assert out.data["tokens"].dtype == np.int32
    assert out.data["tokens"].tolist() == [104 + 3, 0xC3 + 3, 0xA9 + 3, 1]
    # Identity is kept; the record's mixture weight becomes its token count.
    assert out.contributors == [Contributor(4, 2, 0, True)] and out.lane == 0
    assert out.component_tokens == {1: 4}


def test_tokenize_dict_with_field_and_default_text_field() -> None:
    (out,) = Tokenize(zp.ByteTokenizer(), field="body").process(_record({"body": "ab", "id": 3}))
    assert out.data["tokens"].tolist() == [100, 101, 1]
    (out,) = Tokenize(zp.ByteTokenizer()).process(_record({"text": "z"}))
    assert out.data["tokens"].tolist() == [122 + 3, 1]


def test_tokenize_keeps_the_other_fields_and_replaces_the_text_one() -> None:
    sample = {"id": 3, "body": "ab", "loss_weight": 0.5, "mask": np.array([1, 0])}
    (out,) = Tokenize(zp.ByteTokenizer(), field="body").process(_record(sample))
    assert list(out.data) == ["tokens", "id", "loss_weight", "mask"]
    assert out.data["tokens"].tolist() == [100, 101, 1]
    assert out.data["id"] == 3 and out.data["loss_weight"] == 0.5
    assert out.data["mask"] is sample["mask"]
    # A stale "tokens" field is replaced, never kept beside the new one.
    (out,) = Tokenize(zp.ByteTokenizer()).process_batch(
        [_record({"text": "z", "tokens": np.zeros(9)})]
    )
    assert set(out.data) == {"tokens"} and out.data["tokens"].tolist() == [125, 1]


def test_tokenize_missing_field_names_the_fix() -> None:
    op = Tokenize(zp.ByteTokenizer(), field="body")
    with pytest.raises(
        KeyError, match=r"no field 'body' \(fields: \['id', 'text'\]\).*field=\.\.\."
    ):
        op.process_batch([_record({"text": "x", "id": 1})])
    with pytest.raises(KeyError, match=r"no field 'text'.*field="):
        Tokenize(zp.ByteTokenizer()).process(_record({"body": "x"}))


def test_tokenize_sample_pointer_names_fetch() -> None:
    op = Tokenize(zp.ByteTokenizer())
    with pytest.raises(TypeError, match=r"add \.fetch\(\) before \.tokenize\(\)"):
        op.process(_record(SamplePointer(0, 3)))


def test_tokenize_without_fetch_in_a_pipeline_names_fetch(h) -> None:
    pipe = h.make_pipeline([list(h.DOCS)], lanes=1).tokenize(zp.ByteTokenizer())
    with pytest.raises(TypeError, match=r"\.fetch\(\)"):
        take(pipe)


def test_tokenize_uses_encode_batch_when_present(h) -> None:
    calls: list[int] = []

    class Batched:
        def encode(self, text: str) -> list[int]:
            raise AssertionError("encode_batch should be used")

        def encode_batch(self, texts: list[str]) -> list[list[int]]:
            calls.append(len(texts))
            return [[len(t), 7] for t in texts]

        def __repr__(self) -> str:
            return "Batched()"

    pipe = h.make_pipeline([list(h.DOCS)], lanes=1, shuffle=False, chunk_size=8).fetch()
    out = take(pipe.tokenize(Batched()).map(lambda d: d["tokens"]))
    assert [o.tolist() for o in out] == [[len(d), 7] for d in h.DOCS]
    assert all(o.dtype == np.int32 for o in out)
    assert calls == [8] * 5  # one call per chunk


def test_tokenize_needs_an_encoder() -> None:
    with pytest.raises(TypeError, match=r"tokenize needs an object with encode\(text\); got int"):
        Tokenize(5)


def test_tokenize_in_pipeline_matches_the_tokenizer(h) -> None:
    tok = zp.ByteTokenizer()
    pipe = h.make_pipeline(
        [[{"text": d, "n": i} for i, d in enumerate(h.DOCS)]], lanes=1, shuffle=False
    )
    out = take(pipe.fetch().tokenize(tok, field="text", parallelism=2))
    assert len(out) == 40
    for d, o in zip(h.DOCS, out, strict=True):
        assert o["tokens"].tolist() == tok.encode(d).tolist()


def test_tokenize_resumes_exactly(h) -> None:
    docs = [{"text": d, "id": i} for i, d in enumerate(h.DOCS)]
    blobs = [d.encode() * 2 for d in h.DOCS[:20]]

    def build() -> zp.Pipeline:
        return (
            h.make_pipeline([docs, [{"text": b} for b in blobs]], weights=[2, 1])
            .fetch()
            .tokenize(zp.ByteTokenizer(), field="text")
            .map(h.pad_to(40))
            .batch(3)
        )

    ref = assert_resumes_exactly(build)
    assert len(ref) == 20 and ref[0].shape == (3, 40)


@pytest.mark.parametrize("add_eos", [True, False])
def test_byte_tokenizer_encode_batch_equals_encode(add_eos: bool) -> None:
    tok = zp.ByteTokenizer(add_eos=add_eos)
    # NUL bytes, empty texts, bytes and multi-byte text in one batch.
    texts = ["héllo", "", b"a\0b\0", "\0", "x" * 5000, bytearray(b"\xff\xfe"), ""]
    batch = tok.encode_batch(texts)
    assert len(batch) == len(texts)
    for text, got in zip(texts, batch, strict=True):
        want = tok.encode(text)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    assert [len(t) for t in tok.encode_batch(["abc"])] == [3 + add_eos]
    assert tok.encode_batch([]) == []


def test_byte_tokenizer_encode_batch_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="takes str or bytes; got int"):
        zp.ByteTokenizer().encode_batch(["ok", 3])


@pytest.mark.parametrize("add_eos", [True, False])
def test_byte_tokenizer_counts_what_encode_returns(add_eos: bool) -> None:
    tok = zp.ByteTokenizer(add_eos=add_eos)
    texts = [
        "héllo",
        "",
        b"a\0b\0",
        "\0",
        "x" * 5000,
        bytearray(b"\xff\xfe"),
        "€" * 7,
        memoryview(b"q"),
    ]
    assert tok.count_tokens(texts) == [len(tok.encode(t)) for t in texts]
    assert tok.count_tokens([]) == []
    with pytest.raises(TypeError, match="takes str or bytes; got int"):
        tok.count_tokens(["ok", 3])


def test_tokenize_texts_passes_plain_strings_and_unpacks_the_rest() -> None:
    op = Tokenize(zp.ByteTokenizer(), field="body")
    strings = ["a", "b"]
    assert op.texts(strings) is strings
    assert op.texts(["a", {"body": "b"}, b"c"]) == ["a", "b", b"c"]
    with pytest.raises(TypeError, match="add .fetch"):
        op.texts(["a", SamplePointer(0, 1)])
