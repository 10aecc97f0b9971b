"""A bad setting under ``backend="cce"`` ends the script with its own one-line message, raised
where the backend is looked up, not wrapped in Dynamo's BackendCompilerFailed (which buried it
under ~40 lines of Dynamo's frames and notes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch
import cce_compile

backend = {backend}
compiled = torch.compile(lambda x: x.sin(), backend=backend)
compiled(torch.randn(3))
"""


@pytest.mark.parametrize("backend", ['"cce"', "cce_compile.backend"], ids=["name", "function"])
def test_a_bad_setting_is_one_line_outside_dynamo(backend):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")} | {"CCE_MODE": "turbo"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(backend=backend)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert lines[-1] == (
        "cce_compile.config.SettingsError: CCE_MODE='turbo' is not one of auto, lean, fast "
        "(setting 'mode')"
    ), result.stderr
    # Raised before Dynamo traces anything, and without config.py's frames of reading the
    # environment at import.
    for noise in ("BackendCompilerFailed", "TORCHDYNAMO_VERBOSE", "eval_frame.py", "config.py"):
        assert noise not in result.stderr, result.stderr
