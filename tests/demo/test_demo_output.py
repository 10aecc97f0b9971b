"""What the demo prints besides its results: a --help whose examples keep their lines, and no
profiler chatter from the CPU memory measurement."""

from __future__ import annotations

import sys

import pytest
import torch

from cce_compile.demo.__main__ import build_parser, parse
from cce_compile.demo.train import step_peak_bytes


def test_help_keeps_one_example_per_line(capsys):
    with pytest.raises(SystemExit):
        parse(["--help"])
    lines = capsys.readouterr().out.splitlines()
    examples = [line for line in lines if line.startswith("python -m cce_compile.demo ")]
    assert len(examples) == 3 and any("--arch gla" in line for line in examples), lines


def test_every_option_is_described(capsys):
    options = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 18
    for action in options:
        assert action.help and len(action.help) > 15, action.option_strings


def test_memory_profile_drops_kineto_lines_and_keeps_the_rest(capfd):
    """Kineto writes 'USDT: ... profiler_start' / 'profiler_stop' to descriptor 2 on every
    profile; what the step itself writes there still comes through."""
    x = torch.randn(64, requires_grad=True)

    def step():
        (x * 2).sum().backward()
        print("the step's own warning", file=sys.stderr)

    assert step_peak_bytes(step) > 0
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err, err
    assert "the step's own warning" in err


def test_the_cpu_note_points_to_a_readme_section():
    """The note under the CPU table names a README section for the GPU figures: one that is
    there."""
    import pathlib
    import re

    from cce_compile.demo.report import CPU_NOTE

    (section,) = re.findall(r'README\.md, "([^"]+)"', CPU_NOTE)
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    headings = re.findall(r"^#+ (.+)$", readme.read_text(), flags=re.MULTILINE)
    assert section in headings, (section, headings)
