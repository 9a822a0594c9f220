"""Griffe extension for the site: the docstrings' Sphinx roles become cross-references.

The docstrings say ``:class:`Sampler``` or ``:func:`~sgrld.core.engine.body``` (what Sphinx and
an IDE read); Markdown shows that as text. At build time each role becomes an optional autorefs
link to the object's canonical path (``sgrld.core.sampler.Sampler``): a link where the object is
documented on the site, its name in code type where it is not (no docstring is edited).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`<>]+)`")


def target(obj: griffe.Object, name: str) -> str:
    """The canonical path of ``name`` as written in ``obj``'s docstring (relative names resolved
    in its scope, aliases followed); the name itself where none is found."""
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head) + (f".{rest}" if rest else "")
    except (griffe.NameResolutionError, ValueError):
        path = name
    try:
        found = obj.modules_collection.get_member(path)
        return str(found.final_target.path if found.is_alias else found.path)
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError, ValueError):
        return path


def link(obj: griffe.Object, match: re.Match[str]) -> str:
    tilde, name = match.groups()
    name = name.strip().removesuffix("()")
    shown = name.rsplit(".", 1)[-1] if tilde else name
    return (
        f'<autoref identifier="{html.escape(target(obj, name))}" optional>'
        f"<code>{html.escape(shown)}</code></autoref>"
    )


class SphinxRoles(griffe.Extension):
    """Rewrite every loaded object's docstring: roles to optional cross-references."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.is_alias or obj.docstring is None or ":" not in obj.docstring.value:
            return
        obj.docstring.value = ROLE.sub(lambda m: link(obj, m), obj.docstring.value)
