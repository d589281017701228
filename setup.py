"""Builds the native parts (native/): the shared-memory ring as ``zephon._ring`` and the
work sources' Feistel permutation as ``zephon._permute``, and the drop phase of a restore's
replay by length as ``zephon._pack``.

Everything else about the package lives in pyproject.toml.
"""

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
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
        Extension(
            "zephon._permute",
            sources=["native/permute_module.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        ),
    ]
)
