"""A griffe extension for the API reference: Sphinx roles in docstrings as code spans.

Zephon's docstrings name other objects the Sphinx way (:class:`~zephon.Schedule`), which
Markdown would show as written. Each role becomes a code span of the name (the last dotted
part with ``~``, as Sphinx shows it): ``Schedule``. Links are left to the text around them,
so the reference never depends on which objects another page renders.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`<]+?)`")


def plain(text: str) -> str:
    """``text`` with every Sphinx role turned into a code span of the name it shows."""

    def span(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    return ROLE.sub(span, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
