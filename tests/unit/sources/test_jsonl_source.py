from __future__ import annotations

import json
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


def test_skip_leaves_bad_lines_out(tmp_path, check_source):
    lines = [*dumps(RECORDS[:2]), "{bad", "", *dumps(RECORDS[2:6]), "[1,", *dumps(RECORDS[6:])]
    path = write_lines(tmp_path / "a.jsonl", lines, newline="\r\n", trailing=False)
    with pytest.warns(UserWarning) as warned:
        ds = JsonlSource(path, on_error="skip")
    check_source(ds, RECORDS)
    assert [str(w.message) for w in warned] == [
        f"JsonlSource: skipped 2 of 14 records of {path}: 2 not valid JSON (first: line 3); "
        "on_error='raise' reports each one"
    ]
    assert warned[0].filename == __file__  # it points at the caller's line
    assert ds.skipped_records() == {
        "invalid_json": 2,
        "undecodable": 0,
        "missing_field": 0,
        "wrong_type": 0,
    }


def test_skip_covers_every_per_record_failure_and_warns_once_per_file(tmp_path):
    good = [{"text": f"t{i}"} for i in range(6)]
    a = tmp_path / "a.jsonl"
    a.write_bytes(
        b"\n".join(
            [
                json.dumps(good[0]).encode(),
                b"{not json",  # line 2: invalid JSON
                b'{"text": "\xff\xfe"}',  # line 3: not UTF-8
                b'{"other": 1}',  # line 4: no field
                b"[1, 2]",  # line 5: not an object, so no field
                b'{"text": 7}',  # line 6: the field of another type
                json.dumps(good[1]).encode(),
                b'{"text": null}',  # line 8: another type again
                json.dumps(good[2]).encode(),
            ]
        )
        + b"\n"
    )
    b = write_lines(tmp_path / "b.jsonl", dumps(good[3:]))  # clean: no warning for it
    c = write_lines(tmp_path / "c.jsonl", ['{"text": 1}', *dumps(good[:1])])
    with pytest.warns(UserWarning) as warned:
        ds = JsonlSource([a, b, c], field="text", field_type=str, on_error="skip")
    assert [str(w.message) for w in warned] == [
        f"JsonlSource: skipped 6 of 9 records of {a} (field 'text' of type str): 1 not valid "
        "JSON (first: line 2), 1 not UTF-8 (first: line 3), 2 without the field (first: line "
        "4), 2 with a field of another type (first: line 6); on_error='raise' reports each one",
        f"JsonlSource: skipped 1 of 2 records of {c} (field 'text' of type str): 1 with a "
        "field of another type (first: line 1); on_error='raise' reports each one",
    ]
    assert ds.read(range(len(ds))) == ["t0", "t1", "t2", "t3", "t4", "t5", "t0"]
    assert ds.skipped_records() == {
        "invalid_json": 1,
        "undecodable": 1,
        "missing_field": 2,
        "wrong_type": 3,
    }
    with pytest.warns(UserWarning, match=r"skipped 4 of 9 records"):
        # Without field_type, a value of any type is a record; without field, any object.
        assert JsonlSource(a, field="text", on_error="skip").skipped_records()["wrong_type"] == 0
    with pytest.warns(UserWarning, match=r"skipped 2 of 9"):
        assert len(JsonlSource(a, on_error="skip")) == 7


def test_raise_mode_names_a_field_of_the_wrong_type(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", ['{"text": "ok"}', '{"text": 7}'])
    ds = JsonlSource(path, field="text", field_type=str)
    assert ds[0] == "ok"
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"field 'text' of the record at {path}:2 is a int (7), not str; fix the record or "
            "pass on_error='skip'"
        ),
    ):
        ds[1]
    assert JsonlSource(path, field="text", field_type=(str, int)).read([0, 1]) == ["ok", 7]
    with pytest.raises(ValueError, match=r"field_type=str needs a field; pass field= too"):
        JsonlSource(path, field_type=str)
    with pytest.raises(
        TypeError, match=r"field_type must be a type or a tuple of types; got 'str'"
    ):
        JsonlSource(path, field="text", field_type="str")  # type: ignore[arg-type]


def test_pipeline_stats_report_skipped_records_per_component(tmp_path):
    import zephon as zp

    path = write_lines(tmp_path / "a.jsonl", ['{"text": "a"}', '{"x": 1}', "{bad", '{"text": "b"}'])
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 records"):
        web = JsonlSource(path, field="text", on_error="skip")
    src = zp.StaticMixtureWorkSource({"web": web, "mem": zp.ArraySource(["c", "d"])}, chunk_size=2)
    with zp.Pipeline(src, canonical_replicas=1).fetch().batch(2) as pipe:
        next(pipe)
        assert pipe.stats()["skipped_records"] == {
            "web": {"invalid_json": 1, "undecodable": 0, "missing_field": 1, "wrong_type": 0}
        }


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
