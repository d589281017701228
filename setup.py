"""Builds the native shared-memory ring (native/) as ``zephon._ring``.

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
        )
    ]
)
