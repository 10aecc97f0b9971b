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
    assert "compiling (the first step takes" in printed
    result = json.loads((tmp_path / "out" / f"demo_{arch}.json").read_text())
    baseline, fused = result["runs"]
    assert result["meta"]["settings"]["mode"] == (mode or settings_before.mode)
    assert baseline["rewritten_sites"] == 0 and fused["rewritten_sites"] >= 1
    assert len(baseline["losses"]) == len(fused["losses"]) == 6
    # Measured on the CPU too (one step's allocations), the same way for both runs.
    assert baseline["peak_memory_gb"] > 0 and fused["peak_memory_gb"] > 0
    diff = max(abs(a - b) for a, b in zip(baseline["losses"], fused["losses"]))
    assert diff < 1e-3, diff  # same seed, same data, same math (float32 on CPU)
    assert (tmp_path / "out" / f"demo_{arch}.png").exists()


def _tiny_run_config():
    from cce_compile.demo.models import ModelConfig
    from cce_compile.demo.train import RunConfig

    return RunConfig(
        arch="gpt",
        model=ModelConfig(vocab=64, dim=16, layers=1, heads=2, context=8),
        batch=2,
        steps=1,
    )


def test_max_batch_search_compiles_once():
    from torch._dynamo.utils import counters

    from cce_compile.demo.train import max_batch

    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    rewrites_before = counters["cce_compile"]["rewritten"]
    tried = []
    best, rate = max_batch(
        _tiny_run_config(), True, 2, limit=8, report=lambda b, r: tried.append((b, r))
    )
    # Nothing runs out of memory on the CPU: 2, 4 and 8 fit; 16 is past the limit, so the
    # search stops there without a bisection step.
    assert [b for b, _ in tried] == [2, 4, 8]
    assert all(r is not None and r > 0 for _, r in tried)
    assert best == 8 and rate == tried[-1][1]
    # One symbolic-batch graph for all sizes, rewritten once.
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert counters["cce_compile"]["rewritten"] - rewrites_before == 1


def test_max_batch_search_bisects_after_out_of_memory(monkeypatch):
    from cce_compile.demo import train

    def measure(model, cfg, use_cce, loss_fn, batch=None, **kwargs):
        if batch > 5:
            raise torch.OutOfMemoryError("test: too large")
        return 10.0, None

    monkeypatch.setattr(train, "_measure", measure)
    tried = []
    best, rate = train.max_batch(
        _tiny_run_config(), False, 2, limit=64, report=lambda b, r: tried.append((b, r))
    )
    assert [b for b, _ in tried] == [2, 4, 8, 6]  # doubling, then 4 + 4 / 2
    assert [r is None for _, r in tried] == [False, False, True, True]
    assert best == 4 and rate == 4 * 8 / 0.010


def test_step_peak_counts_what_a_step_holds_at_once():
    from cce_compile.demo.train import step_peak_bytes

    x = torch.randn(256, 256)

    def two_then_one():
        a = x @ x  # 256 KiB
        b = a @ x  # 256 KiB more while a lives
        del a, b

    assert step_peak_bytes(two_then_one) == 2 * 256 * 256 * 4


def test_table_reports_memory_saved_against_the_logits():
    from cce_compile.demo.report import table
    from cce_compile.demo.train import RunResult

    def run(name, peak):
        return RunResult(name, [3.0, 2.0], 1000.0, 10.0, peak)

    text = table(run("torch.compile", 6.0), run("cce_compile", 3.0), logits_mib=4096.0)
    assert "peak memory saved: 3,072 MiB (75% of it)" in text
    text = table(run("torch.compile", None), run("cce_compile", None), logits_mib=4096.0)
    assert "logits footprint (one step's N x V logits): 4,096 MiB" in text
    assert "saved" not in text
