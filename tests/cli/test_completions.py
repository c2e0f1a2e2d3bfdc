"""Shell completions: the committed scripts are current, and completion answers from `skyrl`."""

from __future__ import annotations

import pytest

from skyrl_cli.commands.completions import FILES, completion_script

from .conftest import REPO, run_console_script


@pytest.mark.parametrize("shell", sorted(FILES))
def test_committed_completion_scripts_are_current(shell):
    committed = REPO / "completions" / FILES[shell]
    assert committed.exists(), "run: python -m skyrl_cli.commands.completions --write completions/"
    assert committed.read_text() == completion_script(shell), (
        f"{committed} is stale; run: python -m skyrl_cli.commands.completions --write completions/"
    )


@pytest.mark.parametrize("shell", sorted(FILES))
def test_completions_command_prints_the_script(skyrl, shell):
    result = skyrl("completions", shell)
    assert result.code == 0 and result.out == completion_script(shell)


def test_unknown_shell(skyrl):
    result = skyrl("completions", "tcsh")
    assert result.code == 2 and result.err == "error: unknown shell 'tcsh'; choose one of bash, zsh, fish\n"


def test_bash_completion_answers_subcommands():
    result = run_console_script(
        env={"_SKYRL_COMPLETE": "complete_bash", "COMP_WORDS": "skyrl recipes v", "COMP_CWORD": "2"}
    )
    assert result.code == 0
    assert result.out.split() == ["validate"]
