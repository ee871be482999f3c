"""mkdocs hook: the settings table of the optimizer, read from :data:`equiopt.optim.fields.FIELDS`.

A page that holds the line ``<!-- fields-table -->`` gets the table there, so the docs show
exactly the names, rules and defaults the engine and the recipe schema use.
"""

from __future__ import annotations

MARKER = "<!-- fields-table -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from equiopt.optim.fields import fields_table

    return markdown.replace(MARKER, fields_table())
