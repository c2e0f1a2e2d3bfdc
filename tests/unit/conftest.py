"""Fixtures shared by the unit tests of tools and agents: a character tokenizer for the ``lookup``
task's calls (and ``_`` in tool names), and vLLM's pythonic tool parser on it, built once per run
(importing vLLM's parsers takes torch with it: ~9 s)."""

from __future__ import annotations

import pytest

TOOL_ALPHABET = 'abcdefghijklmnopqrstuvwxyz0123456789?[]()=",; _'  # the lookup task's, plus "_"


@pytest.fixture(scope="session")
def tok():
    from backends.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer(TOOL_ALPHABET)


@pytest.fixture(scope="session")
def parser(tok):
    from backends.rollout.tools import ToolCallParser

    return ToolCallParser("pythonic", tok)
