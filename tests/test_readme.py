"""The README's promises: its quick start runs as pasted, its links lead somewhere, and the
examples it points to answer --help without running."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _clean_env(tmp_path: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # cold, as for a newcomer
    return env


def quick_start() -> str:
    section = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_quick_start_runs_as_pasted(tmp_path):
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start())
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 rewritten" in result.stdout and "REWRITTEN" in result.stdout, result.stdout


def test_the_readme_links_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert links and all((REPO / link).exists() for link in links), links
    for page in (REPO / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).exists(), (page.name, link)


EXAMPLES = sorted(p.name for p in (REPO / "examples").iterdir() if p.suffix in (".py", ".sh"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_answers_help_without_running(name, tmp_path):
    path = REPO / "examples" / name
    command = ["bash", str(path)] if name.endswith(".sh") else [sys.executable, str(path)]
    # -X importtime lists every module imported: --help must come before torch is.
    flags = [] if name.endswith(".sh") else ["-X", "importtime"]
    result = subprocess.run(
        command[:1] + flags + command[1:] + ["--help"],
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "no usage printed"
    if not name.endswith(".sh"):
        assert result.stdout.startswith("usage:"), result.stdout
        assert not re.search(r"\| +torch$", result.stderr, re.M), "--help imported torch"
