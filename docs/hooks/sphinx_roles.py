"""Griffe extension for the API page: Sphinx roles in docstrings become cross-references.

The package's docstrings use Sphinx's roles (``:class:`~selfextend.core.validate.ValidationError```,
``:meth:`make_room```), which ``help()`` and Sphinx read but mkdocstrings prints as they are. Each role
becomes an optional autoref: a link where the target is on the site, its name in code otherwise. A short
name is looked up from the documented object outwards (its members, its class, its module), as Sphinx does.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|exc|mod|data|obj|const):`(~?)([\w.]+)(?:\(\))?`")


def _target(obj: griffe.Object, name: str) -> str:
    """The full path ``name`` means in ``obj``'s docstring (``name`` itself when nothing holds it)."""
    head = name.split(".")[0]
    scope: griffe.Object | None = obj
    while scope is not None:
        member = scope.members.get(head)
        if member is not None:
            rest = name[len(head) :]
            return (member.target_path if member.is_alias else member.path) + rest
        scope = scope.parent
    return name


class SphinxRoles(griffe.Extension):
    """Rewrites each object's docstring once everything is loaded, so that short names resolve."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is None or ":`" not in obj.docstring.value:
            return

        def link(m: re.Match[str]) -> str:
            short, name = m.group(1), m.group(2)
            title = name.rsplit(".", 1)[-1] if short else name
            return f'<autoref identifier="{_target(obj, name)}" optional><code>{title}</code></autoref>'

        obj.docstring.value = ROLE.sub(link, obj.docstring.value)
