"""HFTokenizer and SentencePieceTokenizer over tiny models trained here, never downloaded."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
import shutil
import sys

import numpy as np
import pytest

# Nothing here may reach a hub: these are read when the HF packages are first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import zephon as zp
from zephon.testing import assert_resumes_exactly
from zephon.tokenizers.adapters import HFTokenizer, SentencePieceTokenizer

CORPUS = [
    f"the {a} {b} fox number {i} jumps over the lazy dog"
    for i, (a, b) in enumerate(
        (a, b) for a in ("quick", "slow", "sly") for b in ("brown", "red", "grey", "white")
    )
] + ["hello world", "zephon resumes exactly", "café crème brûlée €5"]


def _hash12(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


# ------------------------------------------------------------------ models, trained here


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer.json with <pad>=0, </s>=1, <unk>=2."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "</s>", "<unk>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def wordlevel_json(tmp_path_factory) -> str:
    """A whitespace WordLevel tokenizer whose post-processor puts <bos> first."""
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    trainer = tk.trainers.WordLevelTrainer(
        special_tokens=["[UNK]", "<bos>", "<eos>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = tk.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    path = tmp_path_factory.mktemp("wordlevel") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _train_sentencepiece(path, **options) -> str:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=60,
        hard_vocab_limit=False,
        character_coverage=1.0,
        minloglevel=2,
        **{"pad_id": 0, "eos_id": 1, "unk_id": 2, "bos_id": 3, **options},
    )
    path.write_bytes(model.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    return _train_sentencepiece(tmp_path_factory.mktemp("sp") / "tiny.model")


# ------------------------------------------------------------------ HFTokenizer


def test_hf_round_trip_and_eos(bpe_json) -> None:
    tok = HFTokenizer(bpe_json)
    assert tok.eos_id == 1 and tok.vocab_size == 320
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids[-1] == 1 and (ids[:-1] > 2).all()
        assert tok.decode(ids) == text
    assert tok.encode("").tolist() == [1]
    plain = HFTokenizer(bpe_json, add_eos=False)
    assert plain.encode("hello world").tolist() == tok.encode("hello world")[:-1].tolist()
    # Matches the tokenizers package itself.
    raw = pytest.importorskip("tokenizers").Tokenizer.from_file(bpe_json)
    assert plain.encode("café crème").tolist() == raw.encode("café crème").ids


def test_hf_encode_batch_matches_encode(bpe_json, wordlevel_json) -> None:
    for tok in (HFTokenizer(bpe_json), HFTokenizer(wordlevel_json, eos_token="<eos>")):
        batch = tok.encode_batch(CORPUS)
        assert len(batch) == len(CORPUS)
        for text, ids in zip(CORPUS, batch, strict=True):
            assert ids.dtype == np.int32
            np.testing.assert_array_equal(ids, tok.encode(text))
        assert tok.encode_batch([]) == []


def test_hf_special_tokens_and_eos_choice(wordlevel_json) -> None:
    tok = HFTokenizer(wordlevel_json, eos_token="<eos>")
    ids = tok.encode("hello world")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 4  # <bos> hello world <eos>
    no_specials = HFTokenizer(wordlevel_json, eos_token=2, add_special_tokens=False)
    assert no_specials.encode("hello world").tolist() == ids[1:].tolist()
    assert tok.decode(ids) == "hello world"
    # No "</s>" in this vocabulary: fine without EOS.
    assert HFTokenizer(wordlevel_json, add_eos=False).eos_id is None


def test_hf_eos_errors(wordlevel_json, bpe_json) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(
            "tokenizer.json has no token '</s>' to use as EOS (its added tokens: "
            "['<bos>', '<eos>', '[UNK]']); pass eos_token= one of them or an id, or add_eos=False"
        ),
    ):
        HFTokenizer(wordlevel_json)
    with pytest.raises(ValueError, match=re.escape("eos_token id 320 is outside the vocabulary")):
        HFTokenizer(bpe_json, eos_token=320)
    with pytest.raises(TypeError, match=re.escape("eos_token must be a token's text or an id")):
        HFTokenizer(bpe_json, eos_token=1.0)  # type: ignore[arg-type]


def test_hf_input_types(bpe_json) -> None:
    tok = HFTokenizer(bpe_json)
    assert tok.encode("é".encode()).tolist() == tok.encode("é").tolist()
    with pytest.raises(TypeError, match=r"HFTokenizer.encode takes str or UTF-8 bytes; got int"):
        tok.encode(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes that are not UTF-8"):
        tok.encode_batch([b"\xff"])


def test_hf_bad_files(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    with pytest.raises(FileNotFoundError, match=r"HFTokenizer: no file at .*nothing is downloaded"):
        HFTokenizer(tmp_path / "missing.json")
    # A hub name is not a file, and nothing is fetched for it.
    with pytest.raises(FileNotFoundError, match=r"no file at 'gpt2'"):
        HFTokenizer("gpt2")
    with pytest.raises(FileNotFoundError, match=r"SentencePieceTokenizer: no file at 'sp.model'"):
        SentencePieceTokenizer("sp.model")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"bad.json' is not a tokenizers JSON file"):
        HFTokenizer(bad)


def test_hf_tokenizers_missing_names_the_extra(monkeypatch, tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=re.escape("pip install zephon[hf]")):
        HFTokenizer(tmp_path / "tokenizer.json")


# ------------------------------------------------------------------ SentencePieceTokenizer


def test_sp_round_trip_and_eos(sp_model) -> None:
    tok = SentencePieceTokenizer(sp_model)
    assert tok.eos_id == 1 and tok.bos_id is None and tok.vocab_size >= 40
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids[-1] == 1 and (ids[:-1] > 3).all()
        assert tok.decode(ids) == text
    assert tok.encode("").tolist() == [1]
    both = SentencePieceTokenizer(sp_model, add_bos=True, eos_token="</s>")
    ids = both.encode("hello world")
    assert (
        ids[0] == 3
        and ids[-1] == 1
        and ids[1:-1].tolist() == tok.encode("hello world")[:-1].tolist()
    )
    spm = pytest.importorskip("sentencepiece")
    raw = spm.SentencePieceProcessor(model_file=sp_model)
    assert SentencePieceTokenizer(sp_model, add_eos=False).encode("café").tolist() == raw.encode(
        "café", out_type=int
    )


def test_sp_encode_batch_matches_encode(sp_model) -> None:
    tok = SentencePieceTokenizer(sp_model, add_bos=True)
    batch = tok.encode_batch(CORPUS)
    for text, ids in zip(CORPUS, batch, strict=True):
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, tok.encode(text))
    assert tok.encode_batch([]) == []


def test_sp_eos_errors(tmp_path, sp_model) -> None:
    no_specials = _train_sentencepiece(tmp_path / "bare.model", eos_id=-1, bos_id=-1)
    with pytest.raises(
        ValueError, match=re.escape("bare.model has no EOS piece (trained with eos_id=-1)")
    ):
        SentencePieceTokenizer(no_specials)
    assert SentencePieceTokenizer(no_specials, add_eos=False).eos_id is None
    assert SentencePieceTokenizer(no_specials, eos_token=0).encode("a")[-1] == 0
    with pytest.raises(ValueError, match=re.escape("bare.model has no BOS piece")):
        SentencePieceTokenizer(no_specials, add_eos=False, add_bos=True)
    with pytest.raises(
        ValueError, match=re.escape("tiny.model has no piece '<eot>' to use as EOS")
    ):
        SentencePieceTokenizer(sp_model, eos_token="<eot>")
    assert SentencePieceTokenizer(sp_model, eos_token="<unk>").eos_id == 2
    with pytest.raises(ValueError, match=re.escape("eos_token id 999 is outside the vocabulary")):
        SentencePieceTokenizer(sp_model, eos_token=999)


def test_sp_bad_file_and_input(tmp_path, sp_model) -> None:
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=r"bad.model' is not a sentencepiece model"):
        SentencePieceTokenizer(bad)
    with pytest.raises(TypeError, match=r"SentencePieceTokenizer.encode takes str or UTF-8 bytes"):
        SentencePieceTokenizer(sp_model).encode(None)  # type: ignore[arg-type]


def test_sp_missing_names_the_extra(monkeypatch, tmp_path) -> None:
    (tmp_path / "tiny.model").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match=re.escape("pip install zephon[sentencepiece]")):
        SentencePieceTokenizer(tmp_path / "tiny.model")


# ------------------------------------------------------------------ both: pickling, repr


@pytest.fixture(params=["hf", "sp"])
def make(request, bpe_json, sp_model):
    if request.param == "hf":
        return bpe_json, HFTokenizer
    return sp_model, SentencePieceTokenizer


def test_repr_names_the_file_and_its_hash(make, tmp_path) -> None:
    path, cls = make
    tok = cls(path)
    name = os.path.basename(path)
    assert repr(tok).startswith(
        f"{cls.__name__}({name!r}, sha256={_hash12(path)!r}, add_eos=True, eos_id=1"
    )
    assert "0x" not in repr(tok)
    assert repr(cls(path)) == repr(tok)  # a second load
    # The same bytes elsewhere are the same tokenizer to the fingerprint; other settings are not.
    copy = tmp_path / name
    shutil.copy(path, copy)
    assert repr(cls(copy)) == repr(tok)
    assert repr(cls(path, add_eos=False)) != repr(tok)


def test_pickle_reloads_from_the_path(make, tmp_path) -> None:
    path, cls = make
    copy = tmp_path / os.path.basename(path)
    shutil.copy(path, copy)
    tok = cls(copy)
    blob = pickle.dumps(tok)
    assert len(blob) < 1024  # the path and settings, not the model
    clone = pickle.loads(blob)
    assert repr(clone) == repr(tok)
    for a, b in zip(clone.encode_batch(CORPUS), tok.encode_batch(CORPUS), strict=True):
        np.testing.assert_array_equal(a, b)
    dill = pytest.importorskip("dill")
    assert repr(dill.loads(dill.dumps(tok, recurse=True))) == repr(tok)
    # A changed file would tokenize differently: unpickling refuses it.
    with open(copy, "ab") as f:
        f.write(b" ")
    with pytest.raises(ValueError, match=r"changed since this tokenizer was built"):
        pickle.loads(blob)
    os.remove(copy)
    with pytest.raises(FileNotFoundError, match=r"unpickling needs .*, which is gone"):
        pickle.loads(blob)


# ------------------------------------------------------------------ in a pipeline


def _pipeline(tmp_path, tok) -> zp.Pipeline:
    datasets = pytest.importorskip("datasets")
    from zephon.sources.hf import HFSource

    path = tmp_path / "corpus"
    if not path.exists():
        datasets.Dataset.from_dict({"text": CORPUS, "id": list(range(len(CORPUS)))}).save_to_disk(
            str(path)
        )
    source = zp.StaticMixtureWorkSource(
        [HFSource.from_disk(path)], seed=5, chunk_size=4, num_epochs=1
    )
    return (
        zp.Pipeline(source, canonical_replicas=2)
        .fetch()
        .tokenize(tok, field="text")
        .split(8)
        .pack(12, num_bins=2)
        .batch(2)
    )


@pytest.mark.parametrize("kind", ["bpe", "wordlevel", "sp"])
def test_resumes_exactly_in_a_pipeline(kind, tmp_path, bpe_json, wordlevel_json, sp_model) -> None:
    tok = {
        "bpe": lambda: HFTokenizer(bpe_json),
        "wordlevel": lambda: HFTokenizer(wordlevel_json, eos_token="<eos>"),
        "sp": lambda: SentencePieceTokenizer(sp_model),
    }[kind]()
    ref = assert_resumes_exactly(lambda: _pipeline(tmp_path, tok))
    assert len(ref) >= 3 and ref[0]["tokens"].shape == (2, 12)
    tokens = np.concatenate([b["tokens"].ravel() for b in ref])
    assert tokens.max() < tok.vocab_size and (tokens == tok.eos_id).sum() >= 1


def test_fingerprint_follows_the_tokenizer_file(tmp_path, bpe_json, sp_model) -> None:
    a = _pipeline(tmp_path, HFTokenizer(bpe_json)).fingerprint()
    assert _pipeline(tmp_path, HFTokenizer(bpe_json)).fingerprint() == a
    assert _pipeline(tmp_path, SentencePieceTokenizer(sp_model)).fingerprint() != a
