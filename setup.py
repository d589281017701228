"""Builds the native parts (native/): the shared-memory ring as ``zephon._ring``, the work
sources' Feistel permutation as ``zephon._permute``, pack's placement as ``zephon._pack``, the
tracker's count of delivered pieces as ``zephon._track``, the structural check of decoded
checkpoint states as ``zephon._state`` and a token file's documents copied out as
``zephon._tokens`` (the one built against numpy's C API: it makes the documents' arrays).

Everything else about the package lives in pyproject.toml.
"""

import numpy
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "zephon._ring",
            sources=["native/ring.c", "native/ring_module.c"],
            include_dirs=["native"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._pack",
            sources=["native/pack_module.c"],
            depends=["native/span.h"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._track",
            sources=["native/track_module.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._state",
            sources=["native/state_module.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._permute",
            sources=["native/permute_module.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._tokens",
            sources=["native/tokens_module.c"],
            depends=["native/span.h"],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
    ]
)
