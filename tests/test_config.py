"""Settings: environment parsing, validation, scoped overrides that restore."""

from __future__ import annotations

import pytest

from cce_compile import config


def test_defaults_without_environment():
    settings = config.from_environ({})
    assert settings == config.Settings()
    assert settings.mode == "auto" and not settings.auto_enable


def test_every_variable_is_read():
    settings = config.from_environ(
        {
            "CCE_COMPILE": "1",
            "CCE_MODE": "Fast",
            "CCE_MEMORY_BUDGET_MB": "64",
            "CCE_ESCAPING_LOGITS": "rewrite",
            "CCE_CHECK_TARGETS": "true",
            "CCE_DISABLE": "on",
        }
    )
    assert settings == config.Settings(
        auto_enable=True,
        mode="fast",
        memory_budget_mb=64,
        escaping_logits="rewrite",
        check_targets=True,
        disable=True,
    )


@pytest.mark.parametrize(
    "environ, name",
    [
        ({"CCE_MODE": "turbo"}, "mode"),
        ({"CCE_COMPILE": "maybe"}, "CCE_COMPILE"),
        ({"CCE_MEMORY_BUDGET_MB": "lots"}, "CCE_MEMORY_BUDGET_MB"),
        ({"CCE_MEMORY_BUDGET_MB": "0"}, "memory_budget_mb"),
        ({"CCE_ESCAPING_LOGITS": "maybe"}, "escaping_logits"),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v),
)
def test_bad_values_name_the_variable(environ, name):
    with pytest.raises(ValueError, match=name):
        config.from_environ(environ)


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
    assert base.rewrite_key() != config.Settings(memory_budget_mb=5).rewrite_key()
    assert base.rewrite_key() == config.Settings(check_targets=True).rewrite_key()


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
