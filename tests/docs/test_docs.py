"""The docs stay true: the site builds with ``mkdocs build --strict`` (a warning, a broken
link or anchor, or an API name that no longer resolves fails it), every ```python example in
README.md and docs/ runs, and the README stays within its size.

Each example runs as a script in a fresh interpreter whose working directory is an empty
temporary directory, so it must make its own data. An example may be left out only with a
visible reason, an HTML comment on the line right before its fence::

    <!-- no-run: needs an S3 endpoint and credentials -->

Those are counted and printed, and kept to a few (:data:`MAX_NO_RUN`).

mkdocs is imported, never skipped: without the ``docs`` tools (in the ``test`` extra) this
module fails to import.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import mkdocs  # noqa: F401 - the docs tools are part of the test extra: missing is a failure
import pytest
from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The README's budget: the promise, the commands, an example, the numbers, the map.
README_MAX_BYTES = 10_000
#: How many examples may be marked not to run.
MAX_NO_RUN = 4
#: One example's limit; the slowest (JAX and Orbax) take a few seconds.
EXAMPLE_TIMEOUT_S = 120
#: Pages the site must have (paths under the built site).
EXPECTED_PAGES = [
    "index.html",
    "getting-started/index.html",
    "concepts/index.html",
    "guides/multi-host/index.html",
    "guides/errors/index.html",
    "api/pipeline/index.html",
    "api/jax/index.html",
    "performance/index.html",
    "status/index.html",
    "changelog/index.html",
    "benchmarks/flush_tradeoff.png",
    "benchmarks/mixture_fidelity.png",
]

FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    no_run: str | None  # the reason, when marked not to run

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def examples_in(path: Path) -> list[Example]:
    """The ```python blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        opening = FENCE_OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{path}:{i + 1}: a ```python block that is never closed")
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marked = NO_RUN.match(before)
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
        ]
        found.append(
            Example(
                path,
                i + 1,
                textwrap.dedent("\n".join(body)) + "\n",
                marked["reason"].strip() if marked else None,
            )
        )
        i = end + 1
    return found


def all_examples() -> list[Example]:
    pages = [README, *sorted(DOCS.rglob("*.md"))]
    return [example for page in pages for example in examples_in(page)]


EXAMPLES = all_examples()
TO_RUN = [e for e in EXAMPLES if e.no_run is None]
#: An example that imports JAX is marked like the suite's JAX tests (the pure-Python pass of
#: scripts/test leaves those out).
PARAMS = [
    pytest.param(e, id=e.name, marks=[pytest.mark.jax] if "import jax" in e.code else [])
    for e in TO_RUN
]


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    missing = [page for page in EXPECTED_PAGES if not (site / page).is_file()]
    assert not missing, f"pages missing from the built site: {missing}"
    # The API reference is generated from the docstrings of the public names.
    api = (site / "api/pipeline/index.html").read_text(encoding="utf-8")
    for text in ("zephon.Pipeline", "canonical_replicas", "checkpoint", "restore"):
        assert text in api, f"the Pipeline API page does not mention {text!r}"


@pytest.mark.parametrize("example", PARAMS)
def test_example_runs(example: Example, tmp_path: Path) -> None:
    script = tmp_path / "example.py"  # a file, so that spawned workers can import __main__
    script.write_text(example.code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **os.environ,
        "ZEPHON_CACHE_DIR": str(tmp_path / "cache"),  # index caches never go to ~/.cache
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "Agg",
    }
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert proc.returncode == 0, (
        f"the example at {example.name} failed (exit status {proc.returncode}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )


def test_examples_left_out_are_few_and_say_why() -> None:
    left_out = [e for e in EXAMPLES if e.no_run is not None]
    print(f"\n{len(left_out)} of {len(EXAMPLES)} Python examples are not run:")
    for example in left_out:
        print(f"  {example.name}: {example.no_run}")
    assert TO_RUN, "no Python examples found in README.md and docs/"
    assert all(example.no_run for example in left_out), "a no-run mark without a reason"
    assert len(left_out) <= MAX_NO_RUN, (
        f"{len(left_out)} examples are marked not to run (at most {MAX_NO_RUN}): make them "
        "self-contained (their own small data, workers=0 or a few workers)"
    )


def test_readme_is_short_and_links_resolve() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size:,} bytes; the budget is {README_MAX_BYTES:,}"
    )
    text = README.read_text(encoding="utf-8")
    # What CI runs: the two commands stay exactly as they are.
    assert (
        "python3 -m venv .venv && .venv/bin/pip install '.[jax]' && .venv/bin/zephon demo" in text
    )
    assert "\nbash scripts/test\n" in text
    # GitHub renders the README, not mkdocs: its links into docs/ are checked here.
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        path = ROOT / file
        assert path.is_file(), f"README links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+\s+(.+?)\s*$", path.read_text(encoding="utf-8"), re.M)
            slugs = {slugify(h, "-") for h in headings}
            assert anchor in slugs, f"README links to {target}: no such heading in {file}"
