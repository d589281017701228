"""Installing Zephon without a C compiler: setup.py's build_ext notices that no toolchain
works (no compiler on PATH, one that fails on everything) or that ``ZEPHON_NO_NATIVE=1``
asks for none, says so in one line, and the wheel holds the pure-Python twins alone, which
import and run a pipeline; with a working compiler, an error in our C still fails the build,
naming the way out.

Each wheel is built as a user's ``pip install`` would from the sdist: ``python -m build``
(isolated build environments, build requirements from the package index) in a copy of the
unpacked sdist, its output outside the repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build", reason="python -m build (scripts/test installs it)")

ROOT = Path(__file__).resolve().parents[2]
TWINS = "installing the pure-Python twins, which are slower"
#: The environment a build or the smoke run starts from: none of the variables that would
#: choose for it, and not the suite's PYTHONPATH (which holds the checkout).
CLEARED = ("CC", "LDSHARED", "CFLAGS", "PYTHONPATH", "ZEPHON_NO_NATIVE", "ZEPHON_PURE_PYTHON")
TIMEOUT_S = 300


def _env(**changes: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(changes)
    return env


def _run(cmd: list[str | Path], **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs
    )


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """The unpacked sdist of this checkout."""
    out = tmp_path_factory.mktemp("sdist")
    done = _run([sys.executable, "-m", "build", "--sdist", "--outdir", out, ROOT], env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    (tarball,) = out.glob("zephon-*.tar.gz")
    with tarfile.open(tarball) as t:
        t.extractall(out, filter="data")
    (unpacked,) = (p for p in out.iterdir() if p.is_dir())
    return unpacked


def _build_wheel(
    sdist: Path, tmp_path: Path, env: dict[str, str], broken: str | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``python -m build --wheel`` in a fresh copy of the sdist (``broken``: a file under it
    given a C error first); the result and the dir the wheel goes to."""
    src = tmp_path / "src"
    shutil.copytree(sdist, src)
    if broken is not None:
        with open(src / broken, "a") as f:
            f.write("\n#error deliberately broken by tests/package\n")
    out = tmp_path / "dist"
    done = _run([sys.executable, "-m", "build", "--wheel", "--outdir", out, src], env=env)
    return done, out


def _notices(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("zephon:")]


def _wheel_without_extensions(done: subprocess.CompletedProcess[str], out: Path) -> Path:
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("zephon-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert not [n for n in names if n.endswith(".so")], names
    assert "zephon/py.typed" in names and "zephon/pipeline/pipeline.py" in names
    return wheel


def test_no_compiler_on_path_installs_the_twins_which_run(sdist, tmp_path):
    nothing = tmp_path / "empty-bin"  # PATH: no gcc, no cc (python runs by its full path)
    nothing.mkdir()
    done, out = _build_wheel(sdist, tmp_path, _env(PATH=str(nothing)))
    assert _notices(done) == [
        f"zephon: could not build the C extensions (no C compiler: gcc not found); {TWINS}"
    ], done.stdout + done.stderr
    wheel = _wheel_without_extensions(done, out)

    # Installed as a user would, in a fresh venv (not this one: its editable install finds
    # the checkout's in-place extensions), and run from a directory that holds no zephon.
    venv, cwd = tmp_path / "venv", tmp_path / "cwd"
    cwd.mkdir()
    made = _run([sys.executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv / "bin" / "python"
    install = _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", wheel], env=_env()
    )
    assert install.returncode == 0, install.stdout + install.stderr
    smoke = _run(
        [python, "-I", ROOT / "scripts" / "smoke_installed.py", "--expect", "python"],
        env=_env(),
        cwd=cwd,
    )
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "python (6 extensions absent)" in smoke.stdout


def test_a_compiler_that_cannot_build_anything_installs_the_twins(sdist, tmp_path):
    done, out = _build_wheel(sdist, tmp_path, _env(CC="/bin/false"))
    assert _notices(done) == [
        "zephon: could not build the C extensions (/bin/false cannot build a file that "
        f"includes Python.h); {TWINS}"
    ], done.stdout + done.stderr
    _wheel_without_extensions(done, out)


def test_zephon_no_native_installs_the_twins_without_trying(sdist, tmp_path):
    done, out = _build_wheel(sdist, tmp_path, _env(ZEPHON_NO_NATIVE="1"))
    assert _notices(done) == [
        f"zephon: ZEPHON_NO_NATIVE=1: not building the C extensions; {TWINS}"
    ], done.stdout + done.stderr
    _wheel_without_extensions(done, out)


def test_an_error_in_our_c_fails_the_build_with_a_working_compiler(sdist, tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc, the compiler the extensions are built with")
    done, out = _build_wheel(sdist, tmp_path, _env(), broken="native/ring.c")
    said = done.stdout + done.stderr
    assert done.returncode != 0, said
    assert "#error deliberately broken by tests/package" in said
    assert (
        "zephon: the C extension zephon._ring did not build with a working compiler (its "
        "messages are above: an error in native/, or a warning under -Werror); set "
        "ZEPHON_NO_NATIVE=1 to install the pure-Python twins instead"
    ) in said
    assert TWINS not in said  # no quiet fallback
    assert not list(out.glob("*.whl"))
