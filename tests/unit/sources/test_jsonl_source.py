from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.sources import JsonlSource

RECORDS = [{"id": i, "text": f"record {i}", "tags": ["a"] * (i % 3)} for i in range(12)]


def write_lines(path, lines, newline="\n", trailing=True):
    path.write_bytes((newline.join(lines) + (newline if trailing else "")).encode())
    return path


def dumps(records):
    return [json.dumps(r) for r in records]


def test_one_file(tmp_path, check_source):
    check_source(JsonlSource(write_lines(tmp_path / "a.jsonl", dumps(RECORDS))), RECORDS)


def test_several_files_including_empty_ones(tmp_path, check_source):
    paths = [
        write_lines(tmp_path / "a.jsonl", dumps(RECORDS[:5])),
        write_lines(tmp_path / "empty.jsonl", [], trailing=False),
        write_lines(tmp_path / "blank.jsonl", ["", "  ", ""]),
        str(write_lines(tmp_path / "b.jsonl", dumps(RECORDS[5:]))),
    ]
    ds = JsonlSource(paths)
    check_source(ds, RECORDS)
    assert repr(ds).endswith("a.jsonl', ... 4 files], field=None, on_error='raise', len=12)")


def test_blank_lines_are_not_records(tmp_path, check_source):
    lines = ["", *dumps(RECORDS[:3]), "", "", " \t ", *dumps(RECORDS[3:]), "", ""]
    check_source(JsonlSource(write_lines(tmp_path / "a.jsonl", lines)), RECORDS)


def test_crlf_line_endings(tmp_path, check_source):
    lines = [*dumps(RECORDS[:4]), "", *dumps(RECORDS[4:])]
    check_source(JsonlSource(write_lines(tmp_path / "a.jsonl", lines, newline="\r\n")), RECORDS)


def test_no_trailing_newline(tmp_path, check_source):
    path = write_lines(tmp_path / "a.jsonl", dumps(RECORDS), trailing=False)
    check_source(JsonlSource(path), RECORDS)


def test_scalars_and_arrays_are_records(tmp_path, check_source):
    records = [1, "two", [3], None, {"four": 4}]
    check_source(JsonlSource(write_lines(tmp_path / "a.jsonl", dumps(records))), records)


def test_field(tmp_path, check_source):
    ds = JsonlSource(write_lines(tmp_path / "a.jsonl", dumps(RECORDS)), field="text")
    check_source(ds, [r["text"] for r in RECORDS])


def test_missing_field_names_field_file_and_line(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", ['{"text": "x"}', "", '{"other": 1}', "[1, 2]"])
    ds = JsonlSource(path, field="text")
    with pytest.raises(
        KeyError,
        match=re.escape(
            f"field 'text' is missing from the record at {path}:3 (found keys ['other'])"
        ),
    ):
        ds[1]
    with pytest.raises(KeyError, match=re.escape(f"{path}:4 (found a list, not an object)")):
        ds.read([0, 2])


def test_bad_json_raises_on_access_with_path_and_line(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", ['{"a": 1}', "", "{not json", '{"a": 2}'])
    ds = JsonlSource(path)
    assert len(ds) == 3
    assert ds.read([0, 2]) == [{"a": 1}, {"a": 2}]
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{path}:3 is not valid JSON (Expecting property name enclosed in double quotes at column 2); fix the line or pass on_error='skip'"
        ),
    ):
        ds[1]


def test_invalid_utf8_is_bad_json(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n"\xff\xfe"\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2 is not valid JSON")):
        JsonlSource(path)[1]


def test_skip_leaves_bad_lines_out(tmp_path, check_source, caplog):
    lines = [*dumps(RECORDS[:2]), "{bad", "", *dumps(RECORDS[2:6]), "[1,", *dumps(RECORDS[6:])]
    path = write_lines(tmp_path / "a.jsonl", lines, newline="\r\n", trailing=False)
    with caplog.at_level(logging.WARNING, logger="zephon.sources.jsonl"):
        ds = JsonlSource(path, on_error="skip")
    check_source(ds, RECORDS)
    assert f"skipped 2 line(s) of {path} that are not valid JSON (first: line 3)" in caplog.text


def test_bad_on_error(tmp_path):
    with pytest.raises(
        ValueError, match=re.escape("on_error must be one of ('raise', 'skip'); got 'ignore'")
    ):
        JsonlSource(write_lines(tmp_path / "a.jsonl", ["1"]), on_error="ignore")  # type: ignore[arg-type]


def test_empty_path_list():
    with pytest.raises(ValueError, match="paths is empty"):
        JsonlSource([])


def test_fsspec_url(check_source):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    url = f"memory://zephon-test-{uuid.uuid4().hex}/a.jsonl"
    fs.pipe(url, ("\n".join(dumps(RECORDS)) + "\n").encode())
    try:
        check_source(JsonlSource(url), RECORDS)
    finally:
        fs.rm(url)


def test_fsspec_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ImportError, match=re.escape("pip install zephon[fsspec]")):
        JsonlSource("s3://bucket/a.jsonl")


LINE = st.sampled_from(["", " ", "\r", " \t\r", "1", '{"k": "v"}', " [1, 2] ", '"\\n"'])


@settings(max_examples=150, deadline=None)
@given(lines=st.lists(LINE, max_size=12), trailing=st.booleans(), block_bytes=st.integers(1, 9))
def test_block_scan_matches_reading_line_by_line(tmp_path_factory, lines, trailing, block_bytes):
    # Tiny blocks put line breaks, CRLF pairs and blank lines across block edges.
    path = write_lines(tmp_path_factory.mktemp("scan") / "a.jsonl", lines, trailing=trailing)
    with mock.patch("zephon.sources.jsonl._BLOCK_BYTES", block_bytes):
        ds = JsonlSource(path)
    assert ds.read(range(len(ds))) == [json.loads(line) for line in lines if line.strip()]
