"""Settings: environment parsing, validation, scoped overrides that restore."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from cce_compile import config


def test_defaults_without_environment():
    settings = config.from_environ({})
    assert settings == config.Settings()
    assert settings.mode == "auto" and not settings.auto_enable
    # Whole-model compile (the HF Trainer's torch_compile=True) fuses with no setting.
    assert settings.escaping_logits == "drop"


def test_every_variable_is_read():
    settings = config.from_environ(
        {
            "CCE_COMPILE": "1",
            "CCE_MODE": "Fast",
            "CCE_MEMORY_BUDGET_MB": "64",
            "CCE_MEMORY_FRACTION": "0.25",
            "CCE_GRAD_FILTER": "0.000244140625",
            "CCE_ESCAPING_LOGITS": "rewrite",
            "CCE_CHECK_TARGETS": "true",
            "CCE_DISABLE": "on",
        }
    )
    assert settings == config.Settings(
        auto_enable=True,
        mode="fast",
        memory_budget_mb=64,
        memory_fraction=0.25,
        grad_filter=2.0**-12,
        escaping_logits="rewrite",
        check_targets=True,
        disable=True,
    )


@pytest.mark.parametrize(
    "environ, allowed",
    [
        ({"CCE_MODE": "turbo"}, "auto, lean, fast"),
        ({"CCE_COMPILE": "maybe"}, "0, 1"),
        ({"CCE_MEMORY_BUDGET_MB": "lots"}, "integer"),
        ({"CCE_MEMORY_BUDGET_MB": "0"}, "integer >= 1"),
        ({"CCE_ESCAPING_LOGITS": "maybe"}, "keep, rewrite, drop"),
        ({"CCE_MEMORY_FRACTION": "lots"}, "a number"),
        ({"CCE_MEMORY_FRACTION": "0"}, "(0, 1024]"),
        ({"CCE_GRAD_FILTER": "1.5"}, "[0, 1)"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_bad_values_are_one_line_naming_the_variable_and_allowed_values(environ, allowed):
    with pytest.raises(config.SettingsError) as raised:
        config.from_environ(environ)
    ((variable, value),) = environ.items()
    message = str(raised.value)
    assert message.startswith(f"{variable}=") and value in message
    assert allowed in message and "\n" not in message


def _python(code: str, **environ: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")} | environ
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("compile_variable", [{}, {"CCE_COMPILE": "1"}], ids=["off", "on"])
def test_start_up_hook_is_silent_on_a_bad_value(compile_variable):
    """Said only where the value is used: by CCE_COMPILE=1's hook at the first torch.compile."""
    result = _python("print(1)", CCE_MODE="turbo", **compile_variable)
    assert result.returncode == 0 and result.stdout == "1\n" and result.stderr == ""


STOPS_AT_COMPILE = """
import torch
print("imported")
try:
    torch.compile(lambda x: x.sin())
except Exception:
    print("compiled without the pass")
print("compiled")
"""


@pytest.mark.parametrize(
    ("environ", "line"),
    [
        ({"CCE_COMPILE": "1", "CCE_MODE": "turbo"}, "CCE_MODE='turbo' is not one of"),
        ({"CCE_COMPILE": "maybe"}, "CCE_COMPILE='maybe' is not one of"),
    ],
)
def test_a_bad_value_under_cce_compile_stops_the_first_torch_compile(environ, line):
    """`import torch` runs; its first torch.compile ends the program with one line naming the
    variable (exit 1), and an `except Exception` around it cannot turn it into an unfused run."""
    result = _python(STOPS_AT_COMPILE, **environ)
    assert result.returncode == 1 and result.stdout == "imported\n", result.stderr
    assert result.stderr.startswith(f"cce_compile: {line}"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_bad_value_raises_when_the_settings_are_used():
    code = (
        "from cce_compile import config\n"
        "try:\n    config.get()\nexcept config.SettingsError as e:\n    print(e)"
    )
    result = _python(code, CCE_MODE="turbo")
    assert result.returncode == 0 and result.stdout.startswith("CCE_MODE='turbo' is not one of")


def test_override_restores_even_on_error():
    before = config.get()
    with pytest.raises(RuntimeError):
        with config.override(mode="lean", memory_budget_mb=3):
            assert config.get().mode == "lean" and config.get().memory_budget_mb == 3
            raise RuntimeError
    assert config.get() == before


def test_rewrite_key_tracks_what_changes_the_rewrite():
    base = config.Settings()
    assert base.rewrite_key() != config.Settings(mode="fast").rewrite_key()
    assert base.rewrite_key() != config.Settings(escaping_logits="rewrite").rewrite_key()
    assert base.rewrite_key() != config.Settings(escaping_logits="keep").rewrite_key()
    assert base.rewrite_key() != config.Settings(memory_budget_mb=5).rewrite_key()
    assert base.rewrite_key() == config.Settings(check_targets=True).rewrite_key()


@pytest.mark.parametrize(
    "change",
    [
        dict(grad_filter="x"),
        dict(disable="false"),  # a truthy string: would have turned the pass off
        dict(check_targets=1),
        dict(memory_budget_mb=True),
        dict(memory_fraction=True),
    ],
    ids=lambda c: "-".join(f"{k}={v!r}" for k, v in c.items()),
)
def test_a_setting_of_the_wrong_type_names_the_setting(change):
    (name,) = change
    with pytest.raises(config.SettingsError, match=config._env(name)):
        with config.override(**change):
            pass


def test_an_empty_variable_counts_as_unset():
    empty = {f.metadata["env"]: " " for f in dataclasses.fields(config.Settings)}
    assert config.from_environ(empty) == config.Settings()


def test_only_config_reads_the_environment():
    import pathlib
    import re

    package = pathlib.Path(config.__file__).parent
    readers = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if re.search(r"os\.environ|getenv", p.read_text()) and p.name != "config.py"
    ]
    assert readers == []


def test_config_imports_nothing_of_the_package():
    """Everyone imports config; it imports none of them (no arrow back up the layers)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(config.__file__).read_text())
    relative = [
        node.module or "."
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    absolute = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if (getattr(node, "module", None) or alias.name).startswith("cce_compile")
    ]
    assert relative == [] and absolute == []
