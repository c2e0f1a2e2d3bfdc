"""The tool-call parser a run's episodes use, from the recipe and the chat template."""

from __future__ import annotations

from backends.rollout.environments import ToolUse, declares_tools
from backends.rollout.tools import ToolCallParser, default_parser_name
from skyrl_contracts.episodes import turn_limit
from skyrl_contracts.errors import UsageError
from skyrl_contracts.schema import Recipe


def tool_use(recipe: Recipe, tokenizer, make_env=None):
    """How episodes run tool calls (``ToolUse``), or None when the environment declares no tools
    and the recipe names no parser. An agent run (``make_env`` None) gets the parser its calls'
    ``tools`` need, where the recipe or the chat template names one. Building the parser imports
    vLLM (several seconds), so only runs that parse tool calls build one."""
    rl = recipe.rl
    agent = make_env is None
    if not agent and rl.tool_parser is None and not declares_tools(make_env):
        return None
    if not agent and declares_tools(make_env) and turn_limit(recipe) < 2:
        raise UsageError("rl.max_turns: the environment offers tools, and a tool's answer needs a turn after the call")
    name = rl.tool_parser or default_parser_name(tokenizer.chat_template)
    if name is None and agent:
        return None  # an agent that sends tools gets a 400 naming rl.tool_parser
    if name is None:
        raise UsageError(
            "rl.tool_parser: the chat template's tool-call format is not one skyrl recognises; "
            "name vLLM's parser for the model (hermes, llama3_json, mistral, pythonic, ...)"
        )
    try:
        parser = ToolCallParser(name, tokenizer)
    except ValueError as exc:
        raise UsageError(f"rl.tool_parser: {exc}") from None
    return ToolUse(parser, rl.tool_timeout_s, end_on_error=rl.tool_errors == "end")
