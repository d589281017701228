"""moto's S3 server on 127.0.0.1 for the object-storage tests (server mode, no mock objects):
one bucket, stopped at the end. Under ``CI=true`` a missing package or a server that cannot
start fails the tests instead of skipping them."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest


def need(module: str) -> Any:
    """``module``, or a skip (a failure under ``CI=true``) naming it."""
    try:
        return pytest.importorskip(module)
    except pytest.skip.Exception:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: the object-storage tests need {module}; install .[test]")
        raise


@contextlib.contextmanager
def s3_server(bucket: str) -> Iterator[Any]:
    """A running moto S3 server (:class:`benchmarks.s3_local.S3Server`) with ``bucket``."""
    need("s3fs")
    need("moto.server")
    from benchmarks.s3_local import S3Server

    try:
        server = S3Server()
    except Exception as e:  # noqa: BLE001 - whatever kept it from starting
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and the moto S3 server could not start: {e}")
        pytest.skip(f"the moto S3 server could not start: {e}")
    try:
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        server.close()
