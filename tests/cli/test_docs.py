"""README promises that tests can hold it to."""

from __future__ import annotations

import re

from skyrl_cli.recipe.registry import builtin_recipes

from .conftest import REPO

README = (REPO / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["scripts/quickstart.sh", "scripts/test.sh"]
    for command in commands:
        assert (REPO / command).stat().st_mode & 0o111, f"{command} is not executable"
    assert (REPO / ".ci" / "run").stat().st_mode & 0o111


def test_the_recipes_page_shows_every_recipes_subcommand_and_builtin_recipe():
    page = (REPO / "docs" / "recipes.md").read_text()
    for sub in ("ls", "show", "cp", "validate", "schema"):
        assert f"skyrl recipes {sub}" in page
    for recipe in builtin_recipes():
        assert f"| `{recipe.name}` |" in page
        assert f"`{recipe.name}`" in README  # the front page names each one


def test_the_readme_is_a_front_page_that_links_into_the_docs():
    assert len(README.splitlines()) <= 150
    links = re.findall(r"\]\((docs/[\w./-]+?)(?:#[\w-]+)?\)", README)
    assert len(set(links)) >= 12
    for link in links:
        assert (REPO / link).is_file(), link
    nav = (REPO / "mkdocs.yml").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        assert page.name in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_changelog_has_an_unreleased_section():
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()
