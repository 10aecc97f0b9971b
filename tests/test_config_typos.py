"""Settings that would otherwise be accepted and do nothing (found by adversarial tests, d415d77):
the start-up hook's setting changed in code, and a misspelt variable name."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from fresh_process import INDUCTOR_WITHOUT_CODEGEN

from cce_compile import config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_auto_enable_set_in_code_says_it_installs_nothing_and_points_to_enable(caplog):
    """CCE_COMPILE is read by the start-up hook when the interpreter starts: setting it in
    code changes nothing, and the user is told what does work."""
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        with config.override(auto_enable=True):
            pass
    (record,) = caplog.records
    assert "installs nothing: call cce_compile.enable()" in record.getMessage()


def test_a_mistyped_keyword_in_code_is_named_with_the_setting_it_resembles():
    """config.override / update with a name that is no setting: a SettingsError naming it and
    the setting it resembles (it was Settings' own TypeError), and the settings unchanged."""
    before = config.get()
    with pytest.raises(config.SettingsError, match="'mdoe' is not a .*did you mean 'mode'"):
        with config.override(mdoe="fast"):
            pass
    with pytest.raises(config.SettingsError, match="'colour' is not a cce_compile setting"):
        config.update(colour="blue")
    assert config.get() == before


def test_mistyped_variables_are_named_with_the_setting_they_resemble():
    environ = {"CCE_COMPIL": "1", "CCE_MDOE": "fast", "CCE_SKIP_IGNORE": "0", "CCE_MODE": "lean"}
    environ["CCE_VERSION"] = "17"  # (another tool's CCE_* name: not ours to judge)
    assert config.mistyped_variables(environ) == [
        ("CCE_COMPIL", "CCE_COMPILE"),
        ("CCE_MDOE", "CCE_MODE"),
        ("CCE_SKIP_IGNORE", "CCE_SKIP_IGNORED"),
    ]


def test_a_mistyped_variable_is_said_once_as_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        config._warn_mistyped({"CCE_COMPIL": "1"})
    (record,) = caplog.records
    assert "CCE_COMPIL is not a setting (did you mean CCE_COMPILE?)" in record.getMessage()


# Inductor up to its code generation (fresh_process.py): whether the pass ran is under test.
SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch._dynamo.utils import counters
    # (Inductor without code generation)
    x = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    y = torch.randint(0, 9, (8,))
    torch.compile(lambda x, w, y: F.cross_entropy(F.linear(x, w), y))(x, w, y).backward()
    print("REWRITTEN", counters["cce_compile"]["rewritten"])
    """
).replace("# (Inductor without code generation)\n", INDUCTOR_WITHOUT_CODEGEN)


@pytest.mark.slow
def test_a_script_that_never_imports_cce_compile_is_told_of_a_mistyped_compile_variable(
    tmp_path,
):
    """CCE_COMPIL=1 (for CCE_COMPILE=1) on a plain torch.compile script: the pass stays off,
    as the variable is not ours, and the start-up hook says so on stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")}
    env["CCE_COMPIL"] = "1"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "REWRITTEN 0" in run.stdout
    assert "CCE_COMPIL is not a setting (did you mean CCE_COMPILE?)" in run.stderr
