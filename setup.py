"""Builds the native parts (native/): the shared-memory ring as ``zephon._ring``, the work
sources' Feistel permutation as ``zephon._permute``, pack's placement as ``zephon._pack``, the
tracker's count of delivered pieces as ``zephon._track``, the structural check of decoded
checkpoint states as ``zephon._state`` and a token file's documents copied out as
``zephon._tokens`` (the one built against numpy's C API: it makes the documents' arrays).

Each has a pure-Python twin (``zephon._native.load`` picks one at import). An install with no
working C toolchain (no compiler, one that cannot run, or no Python headers), or with
``ZEPHON_NO_NATIVE=1``, installs the twins alone and says so in one line. A compiler that works
builds with ``-Wall -Wextra -Werror`` and fails loudly on an error in our C, naming the way out.

Everything else about the package lives in pyproject.toml.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

#: Set to 1 to install without building the C extensions (the pure-Python twins only).
NO_NATIVE_ENV = "ZEPHON_NO_NATIVE"
TWINS = "installing the pure-Python twins, which are slower"
STRICT = ["-std=c11", "-Wall", "-Wextra", "-Werror"]
#: What a working toolchain must compile and link before the extensions are tried.
PROBE_C = "#include <Python.h>\nint zephon_probe(void) { return PY_MAJOR_VERSION; }\n"


def _gist(text: str) -> str:
    """The compiler's first error line (gcc's "fatal error: Python.h: No such file or
    directory"), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[0 if errors else -1]


class BuildNative(build_ext):
    """build_ext that falls back to the pure-Python twins when no C toolchain works."""

    def build_extensions(self) -> None:
        if os.environ.get(NO_NATIVE_ENV) == "1":
            self._skip(f"{NO_NATIVE_ENV}=1: not building the C extensions; {TWINS}")
            return
        problem = self._toolchain_problem()
        if problem is not None:
            self._skip(f"could not build the C extensions ({problem}); {TWINS}")
            return
        if any(ext.name == "zephon._tokens" for ext in self.extensions):
            import numpy  # a build requirement; only the numpy-aware extension needs it

            for ext in self.extensions:
                if ext.name == "zephon._tokens":
                    ext.include_dirs.append(numpy.get_include())
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as e:
            # The toolchain compiled and linked the probe, so this is our C (or a new warning
            # under -Werror): fail, as CI must, but name the way to install without it.
            raise CCompilerError(
                f"zephon: the C extension {ext.name} did not build with a working compiler (its "
                f"messages are above: an error in native/, or a warning under -Werror); set "
                f"{NO_NATIVE_ENV}=1 to install the pure-Python twins instead"
            ) from e

    def _skip(self, notice: str) -> None:
        print(f"zephon: {notice}", file=sys.stderr, flush=True)
        self.extensions = []  # nothing to copy in place or to list as outputs

    def _toolchain_problem(self) -> str | None:
        """None when the compiler compiles and links a file that includes Python.h; else why
        not, in a few words (the compiler's own output is kept off the console)."""
        command = getattr(self.compiler, "compiler_so", None) or ["the C compiler"]
        exe = command[0]
        with tempfile.TemporaryDirectory(prefix="zephon-probe-") as tmp:
            src = os.path.join(tmp, "probe.c")
            with open(src, "w") as f:
                f.write(PROBE_C)
            log = os.path.join(tmp, "log")
            try:
                with _quiet(log):
                    objects = self.compiler.compile([src], output_dir=tmp)
                    self.compiler.link_shared_object(objects, os.path.join(tmp, "probe.so"))
            except (CCompilerError, ExecError, PlatformError, OSError):
                if shutil.which(exe) is None:
                    return f"no C compiler: {exe} not found"
                with open(log, errors="replace") as f:  # less the commands echoed
                    said = _gist("\n".join(line for line in f if not line.startswith(exe)))
                return f"{exe} cannot build a file that includes Python.h" + (
                    f": {said}" if said else ""
                )
        return None


@contextlib.contextmanager
def _quiet(path: str) -> Iterator[None]:
    """This process's stdout and stderr (so the compiler's, which it inherits) go to ``path``
    for the duration of the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(fd)
        for target, fd_saved in zip((1, 2), saved, strict=True):
            os.dup2(fd_saved, target)
            os.close(fd_saved)


setup(
    cmdclass={"build_ext": BuildNative},
    ext_modules=[
        Extension(
            "zephon._ring",
            sources=["native/ring.c", "native/ring_module.c"],
            depends=["native/ring.h"],
            include_dirs=["native"],
            extra_compile_args=["-O2", *STRICT],
        ),
        Extension(
            "zephon._pack",
            sources=["native/pack_module.c"],
            depends=["native/span.h"],
            extra_compile_args=["-O3", *STRICT],
        ),
        Extension(
            "zephon._track",
            sources=["native/track_module.c"],
            extra_compile_args=["-O2", *STRICT],
        ),
        Extension(
            "zephon._state",
            sources=["native/state_module.c"],
            extra_compile_args=["-O2", *STRICT],
        ),
        Extension(
            "zephon._permute",
            sources=["native/permute_module.c"],
            extra_compile_args=["-O2", *STRICT],
        ),
        Extension(
            "zephon._tokens",
            sources=["native/tokens_module.c"],
            depends=["native/span.h"],
            extra_compile_args=["-O3", *STRICT],
        ),
    ],
)
