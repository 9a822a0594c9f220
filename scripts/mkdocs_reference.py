"""MkDocs hook: the API reference lists every name of ``sgrld.__all__``, read at build time.

``docs/reference.md`` holds the marker ``<!-- sgrld.__all__ -->``; this hook replaces it by one
mkdocstrings block per public name, each at the object's defining module (``sgrld.optim.SGLD``
for ``sgrld.SGLD``), so a name added to ``__all__`` is documented without editing a page, and a
name whose docstring mkdocstrings cannot render fails the strict build.
"""

from __future__ import annotations

import inspect
from typing import Any

MARKER = "<!-- sgrld.__all__ -->"


def public_names() -> list[tuple[str, str]]:
    """``(name, where mkdocstrings finds it)`` for every name in ``sgrld.__all__``, in order."""
    import sgrld

    found = []
    for name in sorted(sgrld.__all__, key=lambda n: (n.startswith("_"), n.lower())):
        obj = getattr(sgrld, name)
        if inspect.ismodule(obj):
            path = obj.__name__
        elif inspect.isclass(obj) or inspect.isroutine(obj):
            path = f"{obj.__module__}.{obj.__qualname__}"
        else:  # a constant of the package itself (__version__)
            path = f"sgrld.{name}"
        found.append((name, path))
    return found


def reference_markdown() -> str:
    """The blocks that replace :data:`MARKER`."""
    blocks = []
    for name, path in public_names():
        blocks.append(f"::: {path}\n    options:\n      heading: sgrld.{name}\n")
    return "\n".join(blocks)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Fill the reference page's marker (other pages pass through unchanged)."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference_markdown())
