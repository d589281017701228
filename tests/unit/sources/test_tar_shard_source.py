"""TarShardSource: WebDataset tar shards by member offsets from a cached index."""

from __future__ import annotations

import io
import pickle
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from zephon.sources import TarShardSource
from zephon.sources.tar_shard import SKIP_KINDS, split_name


def member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1_700_000_000
    return info, data


def write_shard(
    path: Path, samples: list[tuple[str, dict[str, bytes]]], fmt: int = tarfile.GNU_FORMAT
) -> Path:
    """A shard as WebDataset's TarWriter lays it out: each sample's members together."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for key, members in samples:
            for ext, data in members.items():
                info, data = member(f"{key}.{ext}", data)
                tar.addfile(info, io.BytesIO(data))
    return path


def samples(n: int, start: int = 0) -> list[tuple[str, dict[str, bytes]]]:
    return [
        (f"{i:06d}", {"jpg": bytes([i % 256]) * (100 + 37 * i), "json": b'{"i": %d}' % i})
        for i in range(start, start + n)
    ]


def expected(path: Path, items: list[tuple[str, dict[str, bytes]]]) -> list[dict[str, Any]]:
    return [{"__key__": key, "__url__": str(path), **m} for key, m in items]


def skipped(**counts: int) -> dict[str, int]:
    return {kind: counts.get(kind, 0) for kind in SKIP_KINDS}


def test_one_shard(tmp_path, check_source):
    path = write_shard(tmp_path / "a.tar", samples(12))
    ds = TarShardSource(path)
    check_source(ds, expected(path, samples(12)))
    assert list(ds.keys()) == [f"{i:06d}" for i in range(12)]
    assert repr(ds) == f"TarShardSource(paths=['{path}'], members=None, on_error='raise', len=12)"


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_formats_long_names_and_folders(tmp_path, check_source, fmt):
    long_key = "deep/" * 12 + "k" * 40  # over 100 bytes: a GNU long name, pax path or prefix
    if fmt == tarfile.USTAR_FORMAT:
        long_key = "deep/" * 20 + "k" * 40
    items = [(long_key, {"txt": b"long"}), ("dir/sub/x", {"txt": b"x", "cls": b"3"})]
    path = write_shard(tmp_path / "a.tar", items, fmt)
    check_source(TarShardSource(path), expected(path, items))


def test_several_shards_and_globs(tmp_path, check_source):
    a = write_shard(tmp_path / "train-0000.tar", samples(5))
    write_shard(tmp_path / "train-0001.tar", [])
    b = write_shard(tmp_path / "train-0002.tar", samples(7, start=5))
    c = write_shard(tmp_path / "other.tar", samples(2, start=12))
    ds = TarShardSource([str(tmp_path / "train-*.tar"), c])
    check_source(
        ds, expected(a, samples(5)) + expected(b, samples(7, start=5)) + expected(c, samples(2, 12))
    )
    assert "... 4 files]" in repr(ds)


def test_grouping_follows_webdataset(tmp_path, check_source):
    """Key: up to the first dot of the base name; extensions lower-cased; consecutive
    members of one key make a sample; metadata, names without a dot, directories and
    links are left out."""
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in [
            ("__index__", b"meta"),
            ("a.JPG", b"A"),
            ("a.seg.png", b"S"),
            ("README", b"no dot"),
            ("b.txt", b"B"),
            ("a.txt", b"A again"),  # not consecutive: another sample with key "a"
        ]:
            info, data = member(name, data)
            tar.addfile(info, io.BytesIO(data))
        folder = tarfile.TarInfo("c.dir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("b.lnk")
        link.type = tarfile.SYMTYPE
        link.linkname = "b.txt"
        tar.addfile(link)
    check_source(
        TarShardSource(path),
        expected(
            path,
            [
                ("a", {"jpg": b"A", "seg.png": b"S"}),
                ("b", {"txt": b"B"}),
                ("a", {"txt": b"A again"}),
            ],
        ),
    )


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("000123.jpg", ("000123", "jpg")),
        ("a/b/c.seg.PNG", ("a/b/c", "seg.png")),
        ("a.b/c.jpg", ("a.b/c", "jpg")),
        ("noext", None),
        ("__key__.json", ("__key__", "json")),  # not metadata: WebDataset keeps it
        ("__meta__", None),
        ("x.", ("x", "")),
    ],
)
def test_split_name_is_webdatasets(name, parts):
    assert split_name(name) == parts


def test_members_reads_only_those(tmp_path, check_source):
    path = write_shard(tmp_path / "a.tar", samples(6))
    ds = TarShardSource(path, members=["json"])
    check_source(
        ds, [{"__key__": k, "__url__": str(path), "json": m["json"]} for k, m in samples(6)]
    )


def test_missing_member_raises_naming_shard_key_and_member(tmp_path):
    items = samples(4)
    del items[2][1]["jpg"]
    path = write_shard(tmp_path / "a.tar", items)
    ds = TarShardSource(path, members=("jpg", "json"))
    assert len(ds) == 4
    assert ds[1]["jpg"] == items[1][1]["jpg"]
    with pytest.raises(
        KeyError,
        match=re.escape(
            f"sample '000002' of {path} has no member 'jpg' (000002.jpg; found ['json'])"
        ),
    ):
        ds.read([0, 2])


def test_missing_member_skipped(tmp_path, check_source):
    items = samples(5)
    del items[1][1]["jpg"]
    del items[3][1]["json"]
    path = write_shard(tmp_path / "a.tar", items)
    with pytest.warns(UserWarning, match=r"skipped 2 of 5 samples of .*a.tar: 2 without a member"):
        ds = TarShardSource(path, members=("jpg", "json"), on_error="skip")
    check_source(ds, expected(path, [items[0], items[2], items[4]]))
    assert ds.skipped_records() == skipped(missing_member=2)


def truncated(tmp_path: Path, cut_inside: str) -> tuple[Path, int]:
    """A shard cut inside the data of the member named ``cut_inside``."""
    full = write_shard(tmp_path / "full.tar", samples(6))
    with tarfile.open(full) as tar:
        info = tar.getmember(cut_inside)
        cut = info.offset_data + info.size // 2
    path = tmp_path / "cut.tar"
    path.write_bytes(full.read_bytes()[:cut])
    return path, cut


def test_truncated_shard_raises_naming_shard_key_and_member(tmp_path):
    path, cut = truncated(tmp_path, "000004.jpg")
    size = 100 + 37 * 4
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"TarShardSource: {path}: the file ends inside member '000004.jpg' (sample "
            f"'000004') at byte {cut}, {size - size // 2} of its {size} bytes missing; the "
            "shard is truncated; re-write the shard, or pass on_error='skip'"
        ),
    ):
        TarShardSource(path)


def test_truncated_shard_skipped_keeps_the_samples_before(tmp_path, check_source):
    path, _ = truncated(tmp_path, "000004.jpg")
    with pytest.warns(
        UserWarning,
        match=r"skipped 1 of 5 samples of .*cut.tar: the file ends inside member '000004.jpg'",
    ):
        ds = TarShardSource(path, on_error="skip")
    check_source(ds, expected(path, samples(4)))
    assert ds.skipped_records() == skipped(truncated=1)


def test_truncated_inside_a_header(tmp_path):
    full = write_shard(tmp_path / "full.tar", samples(3))
    with tarfile.open(full) as tar:
        header_at = tar.getmember("000001.json").offset
    path = tmp_path / "cut.tar"
    path.write_bytes(full.read_bytes()[: header_at + 100])
    with pytest.raises(
        ValueError,
        match=r"ends inside the tar header at byte \d+ after member '000001.jpg' \(sample '000001' may lack members\)",
    ):
        TarShardSource(path)
    with pytest.warns(UserWarning, match="skipped 1 of 2 samples"):
        assert list(TarShardSource(path, on_error="skip").keys()) == ["000000"]


def test_corrupt_header(tmp_path):
    path = write_shard(tmp_path / "a.tar", samples(4))
    with tarfile.open(path) as tar:
        header_at = tar.getmember("000002.jpg").offset
    raw = bytearray(path.read_bytes())
    raw[header_at + 3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"the tar header at byte {header_at} after member '000001.json' is corrupt (bad "
            "checksum); nothing after it can be read and sample '000001' may lack members"
        ),
    ):
        TarShardSource(path)
    with pytest.warns(UserWarning, match="skipped 1 of 2 samples"):
        ds = TarShardSource(path, on_error="skip")
    assert list(ds.keys()) == ["000000"] and ds.skipped_records() == skipped(corrupt=1)


def test_not_a_tar(tmp_path):
    path = tmp_path / "a.tar"
    path.write_bytes(b"hello world, not a tar file" * 40)
    with pytest.raises(ValueError, match=r"the tar header at byte 0 at its start is corrupt"):
        TarShardSource(path)


def test_a_compressed_shard_is_named(tmp_path):
    path = tmp_path / "a.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info, data = member("a.txt", b"x" * 600)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"a.tar.gz: the file is gzip-compressed; random access"):
        TarShardSource(path)


def test_duplicate_member(tmp_path):
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tar:
        for name in ["a.txt", "a.txt", "b.txt"]:
            info, data = member(name, name.encode())
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"sample 'a' has the member 'txt' twice"):
        TarShardSource(path)
    with pytest.warns(UserWarning, match="skipped 1 of 2"):
        ds = TarShardSource(path, on_error="skip")
    assert list(ds.keys()) == ["b"] and ds.skipped_records() == skipped(duplicate_member=1)


def test_index_is_built_once_and_cached(tmp_path, monkeypatch):
    path = write_shard(tmp_path / "a.tar", samples(8))
    first = TarShardSource(path)
    assert first._index.built == 1
    assert list(tmp_path.glob(".a.tar.*.zephon-idx"))  # the sidecar cache
    second = TarShardSource(path)
    assert second._index.built == 0 and second.read([7, 0]) == first.read([7, 0])
    clone = pickle.loads(pickle.dumps(second))  # what a worker receives
    assert clone[3] == first[3] and clone._index.built == 0
    # The shard changes: its size and mtime no longer match, so the index is rebuilt.
    write_shard(path, samples(9))
    assert len(TarShardSource(path)) == 9


def test_fsspec_urls(tmp_path, check_source):
    fsspec = pytest.importorskip("fsspec")
    items = samples(5)
    data = write_shard(tmp_path / "a.tar", items).read_bytes()
    fs = fsspec.filesystem("memory")
    fs.pipe("/zephon-tar-test/s-0.tar", data)
    fs.pipe("/zephon-tar-test/s-1.tar", data)
    try:
        ds = TarShardSource("memory://zephon-tar-test/s-*.tar")
        urls = [p.replace(":///", "://") for p in ds._paths]
        assert urls == ["memory://zephon-tar-test/s-0.tar", "memory://zephon-tar-test/s-1.tar"]
        check_source(ds, [{**e, "__url__": p} for p in ds._paths for e in expected(Path(p), items)])
    finally:
        fs.rm("/zephon-tar-test", recursive=True)


def test_content_identity(tmp_path):
    a = write_shard(tmp_path / "a.tar", samples(4))
    (tmp_path / "copy").mkdir()
    b = write_shard(tmp_path / "copy" / "b.tar", samples(4))
    ia, ib = TarShardSource(a).content_identity(), TarShardSource(b).content_identity()
    assert ia == ib and ia["kind"] == "tar" and ia["files"] == 1  # not the paths
    assert TarShardSource(a, members=["jpg"]).content_identity() != ia
    write_shard(b, samples(5))
    assert TarShardSource(b).content_identity()["sample"] != ia["sample"]


def test_arguments_are_checked(tmp_path):
    path = write_shard(tmp_path / "a.tar", samples(1))
    with pytest.raises(ValueError, match="on_error must be one of"):
        TarShardSource(path, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="members must be a non-empty sequence"):
        TarShardSource(path, members=[])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        TarShardSource(str(tmp_path / "none-*.tar"))
