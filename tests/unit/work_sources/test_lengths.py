"""Token lengths for token weights: from the sources that know them, or from a length index
(``zephon lengths``): built once, resumable, refused once stale."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import zephon as zp
from zephon.cli.main import main
from zephon.errors import LengthIndexError
from zephon.work_sources.lengths import (
    PARTIAL,
    _writable,
    default_index_path,
    index_locations,
    resolve_lengths,
)


def write_jsonl(path, texts) -> None:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


TEXTS = [("word " * (1 + i % 13)).strip() for i in range(2500)]


# ------------------------------------------------------------- sources that know them


def test_token_file_source_gives_its_offsets(tmp_path) -> None:
    tokens = np.array([5, 6, 0, 7, 0, 8, 9, 9, 0], dtype=np.uint16)
    path = tmp_path / "t.bin"
    tokens.tofile(path)
    ds = zp.TokenFileSource(path, eos_id=0)
    lengths = resolve_lengths("t", 0, ds, None)
    assert lengths.offsets and [lengths.at(i) for i in range(len(ds))] == [3, 2, 4]
    assert lengths.total() == 9
    src = zp.StaticMixtureWorkSource([ds], weight_unit="tokens", chunk_size=5)
    chunk = src.next_chunk()
    assert src.tokens_dealt == (sum(len(ds[i]["tokens"]) for i in chunk.indices.tolist()),)


def test_array_source_of_token_arrays_and_of_dicts() -> None:
    arrays = zp.ArraySource([np.arange(n) for n in (3, 1, 4)])
    assert resolve_lengths("x", 0, arrays, None).array.tolist() == [3, 1, 4]
    dicts = zp.ArraySource([{"tokens": np.arange(n)} for n in (2, 5)])
    assert resolve_lengths("x", 0, dicts, None).array.tolist() == [2, 5]
    rows = zp.ArraySource(np.zeros((4, 7), dtype=np.int32))
    assert resolve_lengths("x", 0, rows, None).array.tolist() == [7] * 4


def test_parquet_length_column(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "bb", "ccc"], "n": [1, 2, 3]}), path, row_group_size=2)
    ds = zp.ParquetSource(path, field="text")
    src = zp.StaticMixtureWorkSource({"p": ds}, weight_unit="tokens", lengths={"p": "n"})
    assert src.token_lengths[0].array.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="has no column 'missing'"):
        zp.StaticMixtureWorkSource({"p": ds}, weight_unit="tokens", lengths={"p": "missing"})


@pytest.mark.parametrize(
    ("dataset", "spec", "error", "message"),
    [
        (
            zp.ArraySource(["some text"]),
            None,
            ValueError,
            r"dataset 'web' \(component 0\) cannot give its token lengths: ArraySource item 0 "
            r"is a str, not token ids",
        ),
        (
            ["plain", "list"],
            None,
            ValueError,
            r"weight_unit='tokens' needs the token count of every sample, and dataset 'web' "
            r"\(component 0, list\) does not know them; build a length index with `zephon "
            r"lengths DATA --tokenizer ...`",
        ),
        (["a", "b"], [1, 2, 3], ValueError, r"has 3 entries but the dataset has 2 samples"),
        (["a", "b"], [1, -2], ValueError, r"sample 1 has a negative length -2"),
        (["a", "b"], [1.5, 2.0], TypeError, r"must be a 1-D array of ints; got float64"),
        (["a", "b"], "n", TypeError, r"name a column \('n'\), but a list has no columns"),
        (
            ["a", "b"],
            3,
            TypeError,
            r"must be None \(the dataset's own\), a column name or an array",
        ),
    ],
)
def test_lengths_errors_name_the_dataset_and_the_fix(dataset, spec, error, message) -> None:
    with pytest.raises(error, match=message):
        zp.StaticMixtureWorkSource(
            {"web": dataset}, weight_unit="tokens", lengths=None if spec is None else {"web": spec}
        )


def test_lengths_keys_must_name_datasets() -> None:
    with pytest.raises(ValueError, match=r"lengths names unknown datasets \['nope'\]"):
        zp.StaticMixtureWorkSource({"a": [1]}, lengths={"nope": [1]})
    with pytest.raises(ValueError, match="got lengths for 1 datasets, there are 2"):
        zp.StaticMixtureWorkSource([[1], [2]], lengths=[[1]])


def test_lengths_are_only_asked_for_when_needed() -> None:
    src = zp.StaticMixtureWorkSource(
        {"text": ["x", "y"], "unused": ["z"]}, {"text": 1, "unused": 0}
    )
    assert src.token_lengths == (None, None)
    assert "token_lengths" not in src.config() and "weight_unit" not in src.config()
    # A zero-weight dataset needs none, even with token weights.
    tok = zp.StaticMixtureWorkSource(
        {"a": zp.ArraySource([np.arange(3)]), "unused": ["text"]},
        {"a": 1, "unused": 0},
        weight_unit="tokens",
    )
    assert tok.token_lengths[1] is None and tok.config()["weight_unit"] == "tokens"


# ----------------------------------------------------------------- the length index


def test_build_open_and_use_a_length_index(tmp_path) -> None:
    path = tmp_path / "web.jsonl"
    write_jsonl(path, TEXTS)
    web = zp.JsonlSource(path, field="text")
    tok = zp.ByteTokenizer()
    target = zp.build_length_index(web, tok, progress=False)
    assert target == default_index_path(web, tok)
    assert target.startswith(str(path) + ".lengths-") and target.endswith(".zlen")
    counts = zp.open_length_index(web, tok)
    assert isinstance(counts, np.memmap) and counts.dtype == np.dtype("<u4")
    assert counts.tolist() == [len(tok.encode(t)) for t in TEXTS]
    src = zp.StaticMixtureWorkSource(
        {"web": web}, weight_unit="tokens", lengths={"web": counts}, chunk_size=10
    )
    chunk = src.next_chunk()
    assert src.tokens_dealt[0] == sum(len(tok.encode(TEXTS[i])) for i in chunk.indices.tolist())
    # built again: up to date, left alone
    mtime = os.path.getmtime(target)
    assert zp.build_length_index(web, tok, progress=False) == target
    assert os.path.getmtime(target) == mtime


def test_an_index_of_data_in_a_bucket_goes_to_the_cache_directory(tmp_path, monkeypatch) -> None:
    import fsspec

    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    with fsspec.open("memory://lengths-test/web.jsonl", "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:300]))
    web = zp.JsonlSource("memory://lengths-test/web.jsonl", field="text")
    tok = zp.ByteTokenizer()
    (only,) = index_locations(web, tok)  # nothing is ever written to a bucket
    assert only.startswith(str(tmp_path / "cache" / "lengths")) and only.endswith(".zlen")
    with pytest.raises(LengthIndexError, match=rf"no length index at {only}"):
        zp.open_length_index(web, tok)
    assert zp.build_length_index(web, tok, progress=False) == only
    assert zp.open_length_index(web, tok).tolist() == [len(tok.encode(t)) for t in TEXTS[:300]]


def test_where_the_data_directory_cannot_be_written_the_index_goes_to_the_next_place(
    tmp_path,
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory would have to be")
    places = [str(blocked / "web.zlen"), str(tmp_path / "cache" / "web.zlen")]
    assert _writable(places) == places[1]
    with pytest.raises(OSError, match=r"no place to write the length index.*ZEPHON_CACHE_DIR"):
        _writable(places[:1])


class Interrupting:
    """A dataset that raises KeyboardInterrupt once ``stop`` samples have been read."""

    def __init__(self, ds, stop: int) -> None:
        self.ds, self.stop, self.reads = ds, stop, 0

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        if i >= self.stop:
            raise KeyboardInterrupt
        self.reads += 1
        return self.ds[i]

    def content_identity(self):
        return self.ds.content_identity()


def test_an_interrupted_build_resumes_where_it_stopped(tmp_path) -> None:
    path = tmp_path / "web.jsonl"
    write_jsonl(path, TEXTS)
    web = zp.JsonlSource(path, field="text")
    tok = zp.ByteTokenizer()
    target = str(tmp_path / "web.zlen")
    interrupted = Interrupting(web, 1500)
    with pytest.raises(KeyboardInterrupt):
        zp.build_length_index(interrupted, tok, target, progress=False, block=500)
    assert not os.path.exists(target) and os.path.exists(target + PARTIAL)
    with pytest.raises(LengthIndexError, match="an interrupted build left its .partial"):
        zp.open_length_index(web, tok, target)
    resumed = Interrupting(web, len(TEXTS))
    zp.build_length_index(resumed, tok, target, progress=False, block=500)
    assert resumed.reads == len(TEXTS) - 1500  # only what was not counted yet
    assert not os.path.exists(target + PARTIAL)
    assert zp.open_length_index(web, tok, target).tolist() == [len(tok.encode(t)) for t in TEXTS]


def test_a_stale_index_is_an_error_naming_both(tmp_path) -> None:
    path = tmp_path / "web.jsonl"
    write_jsonl(path, TEXTS)
    web = zp.JsonlSource(path, field="text")
    tok = zp.ByteTokenizer()
    target = zp.build_length_index(web, tok, progress=False)
    write_jsonl(path, TEXTS + ["one more"])
    changed = zp.JsonlSource(path, field="text")
    with pytest.raises(LengthIndexError) as e:
        zp.open_length_index(changed, tok, target)
    text = str(e.value)
    assert text.startswith(f"length index {target} does not match dataset JsonlSource({path}) (")
    assert "2500 samples then, 2501 now" in text and "content identity bytes" in text
    assert (
        f"rebuild it with `zephon lengths {path} --field text --tokenizer byte` (or in Python: "
        "zp.build_length_index(dataset, tokenizer))"
    ) in text
    # another tokenizer is another index (its own file), and a mismatch when forced
    with pytest.raises(LengthIndexError, match="no length index at .*lengths-"):
        zp.open_length_index(web, zp.ByteTokenizer(add_eos=False))
    write_jsonl(path, TEXTS)
    with pytest.raises(LengthIndexError, match=r"tokenizer ByteTokenizer\(add_eos=True\) then"):
        zp.open_length_index(zp.JsonlSource(path, field="text"), _Other(), target)
    # the rebuild replaces the stale one
    write_jsonl(path, TEXTS + ["one more"])
    zp.build_length_index(
        changed := zp.JsonlSource(path, field="text"), tok, target, progress=False
    )
    assert len(zp.open_length_index(changed, tok, target)) == 2501


def test_index_errors_name_the_tokenizer_in_use_and_a_few_of_many_shards(tmp_path) -> None:
    paths = [tmp_path / f"web-{i:05d}.jsonl" for i in range(41)]
    for p in paths:
        write_jsonl(p, TEXTS[:2])
    web = zp.JsonlSource(paths, field="text")
    with pytest.raises(LengthIndexError) as e:
        zp.open_length_index(web, zp.ByteTokenizer())
    text = str(e.value)
    assert text.endswith(
        f"; build it with `zephon lengths {paths[0]} {paths[1]} {paths[2]} … and 38 more "
        "--field text --tokenizer byte` (or in Python: zp.build_length_index(dataset, "
        "tokenizer))"
    )
    # not 41 paths (the length without the temporary directory, which pytest-xdist lengthens)
    assert str(paths[3]) not in text and len(text.replace(str(tmp_path), "<tmp>")) < 600
    # A tokenizer the command cannot make (not its default settings): the Python call.
    with pytest.raises(LengthIndexError) as e:
        zp.open_length_index(web, zp.ByteTokenizer(add_eos=False))
    assert str(e.value).endswith(
        "; build it in Python with zp.build_length_index(dataset, tokenizer) (`zephon lengths` "
        "builds only a JsonlSource or ParquetSource of text under 'byte' or a tokenizer file "
        "with its default settings)"
    )
    target = zp.build_length_index(web, zp.ByteTokenizer(), progress=False)
    with pytest.raises(LengthIndexError) as e:  # stale: the dataset named by a few shards too
        zp.open_length_index(zp.JsonlSource(paths[:40], field="text"), zp.ByteTokenizer(), target)
    text = str(e.value)
    assert (
        f"does not match dataset JsonlSource({paths[0]}, {paths[1]}, {paths[2]}, … and 37 more)"
        in text
    )
    assert str(paths[3]) not in text


class _Other:
    def encode(self, text):
        return np.zeros(1, np.int32)

    def __repr__(self) -> str:
        return "Other()"


def test_a_corrupt_index_is_an_error(tmp_path) -> None:
    path = tmp_path / "web.jsonl"
    write_jsonl(path, TEXTS[:10])
    web = zp.JsonlSource(path, field="text")
    target = zp.build_length_index(web, zp.ByteTokenizer(), progress=False)
    with open(target, "r+b") as f:
        f.write(b"NOTMAGIC")
    with pytest.raises(LengthIndexError, match="is not a Zephon length index"):
        zp.open_length_index(web, zp.ByteTokenizer(), target)
    assert issubclass(LengthIndexError, ValueError)


def test_cli_builds_the_index_with_a_progress_bar(tmp_path, capsys) -> None:
    path = tmp_path / "web.jsonl"
    write_jsonl(path, TEXTS)
    assert main(["lengths", str(path), "--field", "text", "--tokenizer", "byte"]) == 0
    captured = capsys.readouterr()
    web = zp.JsonlSource(path, field="text")
    target = default_index_path(web, zp.ByteTokenizer())
    total = sum(len(t) + 1 for t in TEXTS)
    assert captured.out.startswith(f"{target}: 2,500 samples, {total:,} tokens (mean ")
    assert "doc/s" in captured.err or "2500/2500" in captured.err  # tqdm's bar
    assert zp.open_length_index(web, zp.ByteTokenizer()).sum() == total
    assert main(["lengths", str(path), "--tokenizer", "nope"]) == 2
    assert "--tokenizer must be 'byte'" in capsys.readouterr().err
