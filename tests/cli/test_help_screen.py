"""The first screen a user reads, ``skyrl --help``, and a command's options: no type label on a
flag (it takes no value), and a command summary that reads as one sentence."""

from __future__ import annotations

import re


def test_flags_carry_no_type_label(skyrl):
    for args in (("--help",), ("rl", "--help"), ("doctor", "--help")):
        result = skyrl(*args)
        assert result.code == 0, result
        assert "<bool>" not in result.out, args
    assert re.search(r"--version\s+Print the version", skyrl("--help").out)


def test_the_doctor_summary_is_one_sentence(skyrl):
    out = skyrl("--help").out
    row = next(line for line in out.splitlines() if "doctor" in line)
    assert "Pre-flight checks of this machine" in row
    assert "against the\n" not in out  # the docstring's own line breaks no longer reach the screen
