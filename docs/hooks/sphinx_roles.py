"""Griffe extension for the API reference: the package's docstrings use Sphinx roles
(``:func:`row_norm```, ``:class:`~equiopt.maps.Factored```) and RST literal-block markers
(``::``); mkdocstrings renders Markdown. Each role becomes a code span linked to the
object it names (found the way Python would find the name from the docstring's scope:
the object, its class, its module, the enclosing packages, then absolute), through an
optional autoref, so a name that is not rendered anywhere in the site (a private helper,
an external class) stays plain code and never breaks ``mkdocs build --strict``.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):`([^`]+)`")
LITERAL_BLOCK = re.compile(r"(\S)::[ \t]*$", re.M)  # "text::" -> "text:"
BARE_LITERAL = re.compile(r"^([ \t]*)::[ \t]*$", re.M)  # a line of "::" alone -> empty


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.root = pkg
        seen: set[int] = set()
        self._walk(pkg, seen)

    def _walk(self, obj: griffe.Object, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            obj.docstring.value = self._convert(obj.docstring.value, obj)
        for member in list(obj.members.values()):
            if not member.is_alias:
                self._walk(member, seen)

    def _lookup(self, path: str) -> griffe.Object | griffe.Alias | None:
        root = self.root.path
        if path == root:
            return self.root
        if not path.startswith(root + "."):
            return None
        try:
            return self.root[path[len(root) + 1 :]]
        except Exception:  # KeyError, alias resolution errors: not ours to link
            return None

    def _candidates(self, name: str, obj: griffe.Object) -> list[str]:
        module = obj if obj.is_module else obj.module
        if name.startswith("."):
            dots = len(name) - len(name.lstrip("."))
            base = module if module.is_init_module else module.parent
            for _ in range(dots - 1):
                base = base.parent if base is not None and base.parent is not None else base
            return [f"{base.path}.{name.lstrip('.')}"] if base is not None else []
        scopes = []
        scope: griffe.Object | None = obj
        while scope is not None:
            scopes.append(scope.path)
            scope = scope.parent
        return [f"{s}.{name}" for s in scopes] + [name]

    def _resolve(self, name: str, obj: griffe.Object) -> str | None:
        for path in self._candidates(name, obj):
            found = self._lookup(path)
            if found is not None:
                try:
                    return found.canonical_path
                except Exception:
                    return found.path
        return None

    def _role(self, match: re.Match[str], obj: griffe.Object) -> str:
        text = match.group(1).strip()
        short = text.startswith("~")
        name = text.lstrip("~")
        if "<" in name and name.endswith(">"):  # :func:`title <target>`
            title, name = name[:-1].split("<", 1)
            title = title.strip()
        else:
            title = name.rsplit(".", 1)[-1] if short else name.lstrip(".")
        target = name.strip().removesuffix("()")
        code = f"<code>{html.escape(title)}</code>"
        path = self._resolve(target, obj)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    def _convert(self, text: str, obj: griffe.Object) -> str:
        text = ROLE.sub(lambda m: self._role(m, obj), text)
        text = BARE_LITERAL.sub("", text)
        return LITERAL_BLOCK.sub(r"\1:", text)
