"""Tar shards on object storage, through both S3 servers (moto's and SeaweedFS's): read like
the local shards, indexed once into the cache directory (never into the bucket), decoded in
worker processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import zephon as zp
from tests.integration.test_media import encode, picture, write_shard
from tests.s3_server import SERVERS, s3_server
from zephon.testing import assert_same_batches, take

pytestmark = pytest.mark.processes

BUCKET = "zephon-media"


@pytest.fixture(scope="module", params=SERVERS)
def s3(request):
    with s3_server(BUCKET, request.param) as server:
        yield server


def test_shards_in_a_bucket_read_and_decode_like_local_ones(
    s3, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("ZEPHON_CACHE_DIR", str(tmp_path / "cache"))
    local = tmp_path / "local"
    local.mkdir()
    client = s3.client()
    for s in range(2):
        samples = [
            (f"{s}-{i:03d}", {"png": encode(picture(i), "PNG"), "txt": b"%d" % i}) for i in range(6)
        ]
        path = write_shard(local / f"shard-{s}.tar", samples)
        client.put_object(Bucket=BUCKET, Key=f"shards/{path.name}", Body=path.read_bytes())
    opts = s3.storage_options
    remote = zp.TarShardSource(f"s3://{BUCKET}/shards/shard-*.tar", storage_options=opts)
    here = zp.TarShardSource(str(local / "shard-*.tar"))
    assert len(remote) == len(here) == 12 and remote._index.built == 2
    for got, want in zip(remote.read([11, 0, 5, 5]), here.read([11, 0, 5, 5]), strict=True):
        assert {k: v for k, v in got.items() if k != "__url__"} == {
            k: v for k, v in want.items() if k != "__url__"
        }
    assert remote.content_identity() == here.content_identity()
    again = zp.TarShardSource(f"s3://{BUCKET}/shards/shard-*.tar", storage_options=opts)
    assert again._index.built == 0  # the cache directory's index, no second scan
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert not [k for k in keys if k.endswith(".zephon-idx")]

    def build(ds: zp.TarShardSource, workers: int) -> zp.Pipeline:
        src = zp.StaticMixtureWorkSource([ds], seed=1, chunk_size=3, num_epochs=1)
        pipe = zp.Pipeline(
            src, canonical_replicas=2, workers=workers, worker_start_method="forkserver"
        )
        pipe = pipe.fetch().decode_image("png", to="image")
        return pipe.map(lambda d: {"image": d["image"][:28, :32], "key": d["__key__"]}).batch(3)

    with build(here, 0) as pipe:
        expected = take(pipe)
    with build(again, 2) as pipe:
        got = take(pipe)
    assert_same_batches(expected, got)
    assert expected and all(b["image"].dtype == np.uint8 for b in expected)
