"""A tiny end-to-end run of the demo on CPU: the pass rewrites the loss, the runs agree."""

from __future__ import annotations

import json

import pytest
import torch

from cce_compile import config as cce_config
from cce_compile.demo.__main__ import main


@pytest.mark.parametrize(
    "arch, mode", [("gpt", None), ("gla", None), ("gpt", "lean")], ids=["gpt", "gla", "gpt-lean"]
)
def test_demo_end_to_end(arch, mode, tmp_path, capsys):
    # Dynamo would reuse an earlier test's graph for the same code and backend (its guards do
    # not see the mode), and the pass would not run again.
    torch._dynamo.reset()
    settings_before = cce_config.get()
    code = main(
        [
            *(["--mode", mode] if mode else []),
            "--arch",
            arch,
            "--device",
            "cpu",
            "--vocab",
            "2048",
            "--dim",
            "32",
            "--layers",
            "1",
            "--heads",
            "2",
            "--context",
            "64",
            "--batch",
            "4",
            "--steps",
            "6",
            "--corpus-bytes",
            "300000",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    assert cce_config.get() is settings_before  # --mode is scoped to the demo
    printed = capsys.readouterr().out
    assert "sites rewritten by the pass" in printed
    result = json.loads((tmp_path / "out" / f"demo_{arch}.json").read_text())
    baseline, fused = result["runs"]
    assert result["meta"]["settings"]["mode"] == (mode or settings_before.mode)
    assert baseline["rewritten_sites"] == 0 and fused["rewritten_sites"] >= 1
    assert len(baseline["losses"]) == len(fused["losses"]) == 6
    diff = max(abs(a - b) for a, b in zip(baseline["losses"], fused["losses"]))
    assert diff < 1e-3, diff  # same seed, same data, same math (float32 on CPU)
    assert (tmp_path / "out" / f"demo_{arch}.png").exists()


def test_max_batch_search_doubles_then_bisects():
    from cce_compile.demo.models import ModelConfig
    from cce_compile.demo.train import RunConfig, max_batch

    torch._dynamo.reset()
    cfg = RunConfig(
        arch="gpt",
        model=ModelConfig(vocab=64, dim=16, layers=1, heads=2, context=8),
        batch=2,
        steps=1,
    )
    tried = []
    best, rate = max_batch(cfg, False, 2, limit=8, report=lambda b, r: tried.append((b, r)))
    # Nothing runs out of memory on the CPU: 2, 4 and 8 fit; 16 is past the limit, so the
    # search stops there without a bisection step.
    assert [b for b, _ in tried] == [2, 4, 8]
    assert all(r is not None and r > 0 for _, r in tried)
    assert best == 8 and rate == tried[-1][1]
