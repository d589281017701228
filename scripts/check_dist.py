"""Checks what ``python -m build`` made against the source tree: the wheel holds exactly the
package's files (every file under zephon/ that git tracks or would track: modules, .pyi
stubs, py.typed, any data) plus one compiled module per ``native/X_module.c``; the sdist
holds those files, native/ whole and what builds the wheel from it; both carry the version
in pyproject.toml. Exit status 1, listing what is missing or extra, otherwise 0.

Usage: ``python scripts/check_dist.py DIST_DIR`` (from anywhere; it reads its own checkout).
"""

from __future__ import annotations

import glob
import importlib.machinery
import os
import subprocess
import sys
import tarfile
import tomllib
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Besides the package and native/, what the sdist needs to build the wheel.
SDIST_EXTRA = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE")


def tree_files(*dirs: str) -> set[str]:
    """Files under ``dirs`` that belong to the source: tracked or untracked-but-not-ignored
    (so no in-place .so, bytecode or caches), as git sees them; a walk without git."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *dirs],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        names = set(out.splitlines())
    except (OSError, subprocess.CalledProcessError):
        names = set()
        for d in dirs:
            for parent, subdirs, files in os.walk(os.path.join(ROOT, d)):
                subdirs[:] = [s for s in subdirs if s != "__pycache__"]
                rel = os.path.relpath(parent, ROOT)
                names.update(os.path.join(rel, f) for f in files if not f.endswith((".so", ".pyc")))
    return {n for n in names if os.path.isfile(os.path.join(ROOT, n))}


def extension_names() -> set[str]:
    """``zephon/_X<suffix>`` for every ``native/X_module.c``."""
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return {
        f"zephon/_{os.path.basename(c)[: -len('_module.c')]}{suffix}"
        for c in glob.glob(os.path.join(ROOT, "native", "*_module.c"))
    }


def _one(dist_dir: str, pattern: str) -> str:
    found = glob.glob(os.path.join(dist_dir, pattern))
    if len(found) != 1:
        sys.exit(f"check_dist: expected one {pattern} in {dist_dir}; found {found}")
    return found[0]


def main(dist_dir: str) -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    package = tree_files("zephon")
    problems: list[str] = []

    wheel = _one(dist_dir, f"zephon-{version}-*.whl")
    with zipfile.ZipFile(wheel) as z:
        in_wheel = {n for n in z.namelist() if not n.startswith(f"zephon-{version}.dist-info/")}
    want = package | extension_names()
    problems += [f"wheel lacks {n}" for n in sorted(want - in_wheel)]
    problems += [f"wheel has unexpected {n}" for n in sorted(in_wheel - want)]

    sdist = _one(dist_dir, f"zephon-{version}.tar.gz")
    top = f"zephon-{version}/"
    with tarfile.open(sdist) as t:
        in_sdist = {m.name[len(top) :] for m in t.getmembers() if m.isfile()}
    want_sdist = package | tree_files("native") | set(SDIST_EXTRA)
    problems += [f"sdist lacks {n}" for n in sorted(want_sdist - in_sdist)]
    problems += [f"sdist has build output {n}" for n in sorted(in_sdist) if n.endswith(".so")]

    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"check_dist: {os.path.basename(wheel)}: {len(package)} package files and "
        f"{len(extension_names())} compiled extensions; {os.path.basename(sdist)}: "
        f"{len(in_sdist)} files, native/ and the build files included"
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
