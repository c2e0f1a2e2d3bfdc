"""MkDocs hook: the "Recipe keys" page gets its tables from the schema at build time
(``skyrl_cli.recipe.reference``), so the reference is never written or updated by hand."""

from __future__ import annotations

MARKER = "<!-- recipe-keys -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from skyrl_cli.recipe.reference import markdown_reference

    return markdown.replace(MARKER, markdown_reference())
