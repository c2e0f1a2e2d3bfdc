"""Errors the CLI turns into one-line messages and exit codes (in ``skyrl_cli.app`` only)."""

from __future__ import annotations


class SkyrlError(Exception):
    """An expected failure: printed as one line, exit code ``exit_code``, no traceback."""

    exit_code = 1
    prefix = "error: "  # put before each line of the message


class UsageError(SkyrlError):
    """Bad input from the user (a flag, a file, a key)."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe with one or more problems, each already formatted as ``file:line: key.path: message``."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class LaunchError(SkyrlError):
    """A process of the plan failed to start, died, or a stage failed."""

    exit_code = 1


class RunInterrupted(SkyrlError):
    """A run stopped by a signal (``skyrl_cli.launch.interrupts``). The message is the run's last
    line, printed as is (no "error:" prefix); exit code 128 + the signal number (130 for SIGINT)."""

    prefix = ""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
