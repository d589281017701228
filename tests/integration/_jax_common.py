"""Shared by the JAX tests.

JAX never runs inside the main pytest process: once its backend is up, every later
``os.fork()`` (other tests fork on purpose) triggers JAX's "fork after threads" warning,
which ``filterwarnings = error`` turns into failures of unrelated tests — and forking a
process that runs JAX's threads can deadlock anyway. So the ``test_jax_*.py`` modules only
check that the JAX stack is installed and start fresh processes: the in-process cases live
in ``_jax_cases_*.py`` and run under a child pytest (:func:`run_cases`); the multi-process
and training tests start their own workers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).parent
JAX_STACK = ("jax", "orbax.checkpoint", "optax", "matplotlib")


def require(*modules: str) -> None:
    """Skip the calling test module when one of ``modules`` is not installed — or fail it
    under ``CI=true``, where a missing JAX stack means a broken CI image. Looks the
    modules up without importing them (see the module docstring)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package is missing or broken
            found = False
        if not found:
            missing.append(name)
    if not missing:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(
            f"{', '.join(missing)} not installed; CI=true needs the JAX tests to run: "
            "install the 'jax' and 'test' extras",
            pytrace=False,
        )
    pytest.skip(f"{', '.join(missing)} not installed", allow_module_level=True)


def run_cases(cases_file: str, devices: int = 1, timeout_s: float = 300) -> None:
    """Run the test cases in ``_jax_cases_*.py`` under a child pytest (same ini: warnings
    are errors) with ``devices`` CPU devices, and fail with its report if any case fails."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            str(HERE / cases_file),
        ],
        cwd=HERE.parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{cases_file} failed in its own process (exit {proc.returncode}):\n"
            f"{proc.stdout[-12000:]}{proc.stderr[-4000:]}",
            pytrace=False,
        )


def digest(batch: Any) -> str:
    """sha256 of a batch (dict of arrays or one array): keys, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    items = sorted(batch.items()) if isinstance(batch, dict) else [("", batch)]
    for k, v in items:
        a = np.ascontiguousarray(np.asarray(v))
        h.update(f"{k}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (for JAX's coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_jax_processes(
    worker: Path, num_processes: int, *args: str, timeout_s: float
) -> list[tuple[int, str]]:
    """Runs ``worker`` as one JAX job of ``num_processes`` processes on the CPU (4 devices in
    all), each given ``--port --process-id --num-processes`` before ``args``; each
    process's return code and output, in process order. Kills what is left on the way out."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // num_processes}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                "--port",
                str(port),
                "--process-id",
                str(i),
                "--num-processes",
                str(num_processes),
                *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(num_processes)
    ]
    out = []
    try:
        for proc in procs:
            log = proc.communicate(timeout=timeout_s)[0]
            out.append((proc.returncode, log))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # only the processes this call started
                proc.wait()
    return out
