"""A tiny end-to-end run of the demo on CPU: the pass rewrites the loss, the runs agree."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch
from harness import inductor_without_codegen

from cce_compile import config as cce_config
from cce_compile.demo.__main__ import main


# Every run's compiles stop before Inductor's code generation (tests/harness.py): the demo's
# runs, timing and report are under test here, not Inductor's C++ for its models (built for
# the GPT runs until the C++ of a tied head's fused step came from test_models.py's Inductor
# test: 14 builds, ~28 s of CPU, cold).
@pytest.mark.parametrize(
    "arch, mode, control",
    [("gpt", None, False), ("gla", None, True), ("gpt", "lean", False)],
    ids=["gpt", "gla-control", "gpt-lean"],  # lean: 1 thread
)
def test_demo_end_to_end(arch, mode, control, tmp_path, capsys, monkeypatch):
    from cce_compile.demo import train

    # Dynamo would reuse an earlier test's graph for the same code and backend (its guards do
    # not see the mode), and the pass would not run again.
    torch._dynamo.reset()
    settings_before = cce_config.get()
    threads_before = torch.get_num_threads()
    order = []
    train_step = train._Run.train_step

    def recorded(run, i, x, y):
        order.append((i, run.name))
        return train_step(run, i, x, y)

    monkeypatch.setattr(train._Run, "train_step", recorded)
    with inductor_without_codegen():
        code = _run_demo(arch, mode, control, tmp_path)
    assert code == 0
    assert cce_config.get() is settings_before  # --mode is scoped to the demo
    assert torch.get_num_threads() == threads_before  # and so is --threads
    printed = capsys.readouterr().out
    if mode == "lean":
        assert "torch's threads: 1." in " ".join(printed.split())
    assert "sites rewritten by the pass" in printed
    assert "side by side" in printed and "compiles on its first step" in printed
    # CPU: no row that only a GPU measures, and nothing that reads n/a.
    assert "n/a" not in printed and "max batch" not in printed and "share of" not in printed
    assert "median of 2 blocks of 2 steps" in printed  # 6 steps, 2 of them warm-up
    assert "Exactness, step 0" in printed
    assert ("Control, torch.compile against itself" in printed) == control
    picture = tmp_path / "out" / f"demo_{arch}.svg"
    assert f"Picture: {picture}" in printed
    # Interleaved: both runs every step, the order swapped each step; the control first.
    names = ["control"] if control else []
    for i in range(6):
        pair = ["torch.compile", "cce_compile"]
        assert [name for step, name in order if step == i] == names + pair[:: 1 - 2 * (i % 2)]
    result = json.loads((tmp_path / "out" / f"demo_{arch}.json").read_text())
    baseline, fused = result["runs"]
    assert result["meta"]["settings"]["mode"] == (mode or settings_before.mode)
    assert baseline["rewritten_sites"] == 0 and fused["rewritten_sites"] >= 1
    assert len(baseline["losses"]) == len(fused["losses"]) == 6
    assert len(baseline["step_seconds"]) == len(fused["step_seconds"]) == 6
    assert len(result["speed"]["block_ratios"]) == 2 and result["speed"]["median"] > 0
    # Measured on the CPU too (one step's allocations), the same way for both runs.
    assert baseline["peak_memory_gb"] > 0 and fused["peak_memory_gb"] > 0
    diff = max(abs(a - b) for a, b in zip(baseline["losses"], fused["losses"]))
    assert diff < 1e-3, diff  # same seed, same data, same math (float32 on CPU)
    # Step 0: same weights, same batch: equal to rounding.
    zero = result["step_zero"]
    assert zero["loss_difference"] <= 4 * zero["loss_ulp"] and zero["grad_difference"] < 1e-5
    _check_picture(picture, result, control)
    if control:
        assert result["control"]["rewritten_sites"] == 0
        assert len(result["control"]["weight_distance"]) == 6
        assert 0 < result["control_step_zero"]["grad_difference"] < 1e-4


def _check_picture(picture, result, control) -> None:
    """The SVG parses, and its curves and speed title are this run's (tests/demo/test_figure.py
    checks the drawing itself)."""
    root = ET.parse(picture).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    panels = {g.get("id"): g for g in root.iter(f"{ns}g") if g.get("id")}
    assert {"losses", "distance", "speed"} <= set(panels)
    curves = {p.get("data-label"): p.get("d") for p in panels["losses"].iter(f"{ns}path")}
    assert set(curves) == {"torch.compile", "cce_compile"}
    assert all(d.count("M") == 1 and d.count("L") == 5 for d in curves.values())  # 6 steps
    distance = [e for e in panels["distance"].iter() if e.get("class") == "series"]
    assert len(distance) == (4 if control else 2)
    speed = result["speed"]
    q1, q3 = speed["quartiles"]
    title = f"cce_compile: {speed['median']:.2f}x (quartiles {q1:.2f}-{q3:.2f}x)"
    assert title in [t.text for t in panels["speed"].iter(f"{ns}text")]


def _run_demo(arch, mode, control, tmp_path) -> int:
    """The demo's main() at the tests' tiny sizes (6 steps on 300 kB of corpus)."""
    return main(
        [
            *(["--mode", mode] if mode else []),
            *(["--control"] if control else []),
            *(["--threads", "1"] if mode == "lean" else []),
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
    # The search's compiles are under test, not Inductor's code for them (the end-to-end
    # GPT runs above build it).
    with inductor_without_codegen():
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


def test_rows_nothing_measured_are_left_out():
    from cce_compile.demo.report import table
    from cce_compile.demo.train import RunResult

    def run(name, max_batch=None):
        result = RunResult(name, [3.0, 2.0], 1000.0, 10.0, 1.0)
        result.max_batch = max_batch
        return result

    text = table(run("torch.compile"), run("cce_compile"), None)
    assert "n/a" not in text and "max batch" not in text and "share of" not in text
    assert "tokens/s (median step)" in text and "peak memory (GiB)" in text
    text = table(run("torch.compile", 8), run("cce_compile"), None)  # one run measured it
    assert "max batch that fits" in text and "n/a" in text


def test_speed_pairs_blocks_of_both_orders():
    from types import SimpleNamespace

    from cce_compile.demo.train import _speed

    cfg = SimpleNamespace(device="cpu")
    # Two warm-up steps (compilation), then blocks of two; the 7th timed step makes no block.
    baseline = SimpleNamespace(cfg=cfg, seconds=[9.0, 3.0, 1.0, 1.0, 2.0, 2.0, 1.0, 3.0, 5.0])
    fused = SimpleNamespace(cfg=cfg, seconds=[1.0, 1.0, 0.5, 0.5, 2.0, 2.0, 4.0, 4.0, 1.0])
    speed = _speed(baseline, fused, [1.0, 3.0])
    assert speed.block_ratios == [2.0, 1.0, 0.5]
    assert speed.median == 1.0 and speed.quartiles == (0.75, 1.5)
    assert speed.load == (1.0, 3.0)
    short = SimpleNamespace(cfg=cfg, seconds=[1.0, 1.0, 1.0])
    assert _speed(short, short, []) is None


def _comparison(fused_gap, control_gap=None, fused_distance=1e-3, control_distance=1e-3):
    from cce_compile.demo.train import Comparison, RunResult, StepZero

    def run(name, gap, distance):
        losses = [10.0 + gap * (i / 9) for i in range(10)]
        return RunResult(name, losses, 1.0, 1.0, None, weight_distance=[distance] * 10)

    zero = StepZero(9.5e-7, 9.5e-7, 5e-7, "wte.weight", 1e-6)
    return Comparison(
        run("torch.compile", 0.0, 0.0),
        run("cce_compile", fused_gap, fused_distance),
        None,
        zero,
        control=None if control_gap is None else run("control", control_gap, control_distance),
        control_step_zero=None if control_gap is None else zero,
    )


def test_exactness_verdicts():
    from cce_compile.demo.report import exactness_text

    def text(*args, **kwargs):
        return " ".join(exactness_text(_comparison(*args, **kwargs)).split())

    assert "agree to float32 rounding at every step" in text(1e-6)
    assert "--control trains torch.compile against itself" in text(2e-2)
    alike = text(2e-2, 1e-2, fused_distance=2e-3, control_distance=1e-3)
    assert "drift apart alike" in alike and "chaos, not a difference in the math" in alike
    apart = text(2e-2, 1e-6, fused_distance=1e-2, control_distance=1e-6)
    assert "look for a difference in the math" in apart
    assert "Both pairs agree to float32 rounding" in text(1e-6, 1e-6)


def test_diverged_runs_are_said_to_have_diverged_not_compared():
    """Losses that go NaN make every later difference NaN: the text says where each run stopped
    being finite, and gives no verdict on the math."""
    from cce_compile.demo.report import exactness_text

    runs = _comparison(2e-2, 1e-2)
    for run in (runs.baseline, runs.fused, runs.control):
        run.losses[4:] = [math.nan] * 6
    runs.fused.losses[3] = math.inf
    text = " ".join(exactness_text(runs).split())
    assert "training diverged" in text and "not compared further" in text
    assert "torch.compile: from step 4; cce_compile: from step 3; control: from step 4" in text
    assert "math" not in text and "nan" not in text
