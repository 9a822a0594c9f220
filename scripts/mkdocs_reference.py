"""MkDocs hook: the API reference lists every name of ``sgrld.__all__``, read at build time.

``docs/reference.md`` holds the marker ``<!-- sgrld.__all__ -->``; this hook replaces it by one
mkdocstrings block per public name, each at the object's defining module (``sgrld.optim.SGLD``
for ``sgrld.SGLD``), so a name added to ``__all__`` is documented without editing a page, and a
name whose docstring mkdocstrings cannot render fails the strict build. The public names below
the package that the guides use (:data:`MORE`) follow under their own heading. Each block is
followed by the example of ``examples/api/`` whose first line names it (run by
``tests/test_docs.py``); a name without one has an ``Examples:`` section in its docstring.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from typing import Any

MARKER = "<!-- sgrld.__all__ -->"

#: public names below the package, as the guides and the README import them
MORE = (
    "sgrld.models.BayesianModel",
    "sgrld.models.potential",
    "sgrld.chains.chain_batches",
    "sgrld.evaluation.ChainEnsemble",
    "sgrld.evaluation.evaluate_chains",
    "sgrld.integrations.huggingface.TrainerWatch",
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "api"


def _defined_at(obj: Any, fallback: str) -> str:
    if inspect.ismodule(obj):
        return str(obj.__name__)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return f"{obj.__module__}.{obj.__qualname__}"
    return fallback  # a constant of the package itself (__version__)


def public_names() -> list[tuple[str, str]]:
    """``(name, where mkdocstrings finds it)`` for every name in ``sgrld.__all__``, in order."""
    import sgrld

    names = sorted(sgrld.__all__, key=lambda n: (n.startswith("_"), n.lower()))
    return [(name, _defined_at(getattr(sgrld, name), f"sgrld.{name}")) for name in names]


def more_names() -> list[tuple[str, str]]:
    """``(public path, where mkdocstrings finds it)`` for every name of :data:`MORE`."""
    found = []
    for public in MORE:
        module, _, name = public.rpartition(".")
        found.append((public, _defined_at(getattr(importlib.import_module(module), name), public)))
    return found


def examples() -> dict[str, Path]:
    """``public path -> example file``: each file's first line names what it is an example of."""
    out: dict[str, Path] = {}
    for path in sorted(EXAMPLES.glob("*.py")):
        first = path.read_text(encoding="utf-8").split("\n\n", 1)[0]
        for name in re.findall(r"\bsgrld(?:\.\w+)+", first):
            out.setdefault(name, path)
    return out


def _block(public: str, path: str, example: Path | None) -> str:
    block = f"::: {path}\n    options:\n      heading: {public}\n"
    if example is not None:
        code = example.read_text(encoding="utf-8").strip()
        block += (
            f"\n**Example** (`examples/api/{example.name}`, run by the tests):\n\n"
            f"```python\n{code}\n```\n"
        )
    return block


def reference_markdown() -> str:
    """The blocks that replace :data:`MARKER`."""
    found = examples()
    blocks = [_block(f"sgrld.{n}", p, found.get(f"sgrld.{n}")) for n, p in public_names()]
    blocks.append(
        "## Below the package\n\nNames of `sgrld`'s modules that the guides and the README "
        "import (`from sgrld.models import BayesianModel, potential`).\n"
    )
    blocks += [_block(public, p, found.get(public)) for public, p in more_names()]
    return "\n".join(blocks)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Fill the reference page's marker (other pages pass through unchanged)."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference_markdown())
