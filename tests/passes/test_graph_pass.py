"""The pass's contract: uuid, counters, logging, idempotence, graph invariants, sub-graphs."""

from __future__ import annotations

import dataclasses
import logging
import operator

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from harness import OP, check, hook_enabled, inductor_without_codegen
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import cce_compile
from cce_compile import config
from cce_compile.passes.graph_pass import CCEGraphPass, pass_uuid, run_on_module, run_pass


def loss(x, w, y):
    return F.cross_entropy(F.linear(x, w).view(-1, w.shape[0]), y.view(-1))


def small_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, requires_grad=True)
    return x, w, torch.randint(0, 11, (2, 5), generator=gen)


def dynamo_graph(fn, args, dynamic=False):
    """The Dynamo graph of fn(*args) and the inputs it takes, in placeholder order."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=grab, dynamic=dynamic)(*args)
    return graphs[0]


def test_uuid_tracks_settings_and_is_stable():
    first = CCEGraphPass().uuid()
    assert first == pass_uuid() == CCEGraphPass().uuid()
    for change in (
        dict(mode="fast"),
        dict(escaping_logits="rewrite"),
        dict(memory_budget_mb=7),  # auto mode bakes lean or fast into the graph from it
        dict(disable=True),
    ):
        with config.override(**change):
            assert CCEGraphPass().uuid() != first, change
    with config.override(check_targets=True):  # read by the op at run time only
        assert CCEGraphPass().uuid() == first


# Every setting, with values that could change a rewrite of the graph below (V x D large
# enough that the budget decides between lean and fast in auto mode).
SETTING_VALUES = dict(
    auto_enable=[False, True],
    mode=["auto", "lean", "fast"],
    memory_fraction=[0.125, 1024.0],
    memory_budget_mb=[1, 4096],
    escaping_logits=["keep", "rewrite"],
    grad_filter=[None, 2.0**-12],
    skip_ignored=[True, False],
    check_targets=[False, True],
    disable=[False, True],
    trl=[True, False],
)


def test_every_setting_that_changes_the_rewrite_changes_the_uuid():
    assert set(SETTING_VALUES) == {f.name for f in dataclasses.fields(config.Settings)}

    def escaping(x, w, y):
        logits = F.linear(x, w)
        return F.cross_entropy(logits.view(-1, w.shape[0]), y.view(-1)), logits

    gen = torch.Generator().manual_seed(0)
    # 600 rows: a 1 MiB budget holds fewer fast rows than the floor, 4 GiB all of them.
    x = torch.randn(2, 300, 64, generator=gen, requires_grad=True)
    w = torch.randn(4096, 64, generator=gen, requires_grad=True)
    y = torch.randint(0, 4096, (2, 300), generator=gen)
    emitted = {}
    for name, values in SETTING_VALUES.items():
        for value in values:
            # Escaping logits rewritten unless that setting is the one tried: every other
            # setting then acts on a rewrite.
            base = {} if name == "escaping_logits" else dict(escaping_logits="rewrite")
            with config.override(**{**base, name: value}):
                gm, _ = dynamo_graph(escaping, (x, w, y))
                run_pass(gm.graph)
                emitted[(name, value)] = (gm.graph.python_code("self").src, pass_uuid())
    for name, values in SETTING_VALUES.items():
        codes = {emitted[(name, v)][0] for v in values}
        uuids = {emitted[(name, v)][1] for v in values}
        if len(codes) > 1:
            assert len(uuids) == len(values), f"{name} changes the rewrite but not the uuid"
    assert len({emitted[("memory_budget_mb", v)][0] for v in (1, 4096)}) == 2


def test_warm_cache_compiled_under_another_budget_is_not_replayed(monkeypatch):
    """Auto mode picks lean under a small budget and fast under a large one; a graph cached
    under one budget must not be replayed under the other."""
    from torch._inductor.utils import fresh_cache

    from cce_compile.op import dispatch

    modes = []
    real_forward = dispatch.forward
    monkeypatch.setattr(
        dispatch, "forward", lambda args: modes.append(args.mode) or real_forward(args)
    )
    gen = torch.Generator().manual_seed(0)
    # 600 rows: a 1 MiB budget holds fewer fast rows than the floor, 4 GiB all of them.
    x = torch.randn(2, 300, 64, generator=gen, requires_grad=True)
    w = torch.randn(4096, 64, generator=gen, requires_grad=True)
    y = torch.randint(0, 4096, (2, 300), generator=gen)
    with (
        fresh_cache(),
        hook_enabled(),
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        for budget in (1, 4096, 1):
            with config.override(mode="auto", memory_budget_mb=budget):
                torch._dynamo.reset()
                torch.compile(loss)(x, w, y).backward()
    assert modes == ["lean", "fast", "lean"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_float16_site_runs_lean_where_auto_would_take_fast(monkeypatch, dtype):
    """The pass decides a site's mode on its example values: float16 gradients keep lean
    (``policy.FLOAT16_FAST``: fast rounds them before the upstream gradient scales them, and a
    sum divided later overflowed in a compiled float16 model), where bf16's take fast."""
    from cce_compile.op import dispatch

    modes = []
    real_forward = dispatch.forward
    monkeypatch.setattr(
        dispatch, "forward", lambda args: modes.append(args.mode) or real_forward(args)
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 64, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(4096, 64, generator=gen).to(dtype).requires_grad_()
    y = torch.randint(0, 4096, (2, 300), generator=gen)
    with (
        hook_enabled(),
        inductor_without_codegen(),  # the mode decided is under test, not Inductor's code
        config.override(mode="auto", memory_budget_mb=4096),
    ):
        torch._dynamo.reset()
        torch.compile(loss)(x, w, y).backward()
    assert modes == ["lean" if dtype == torch.float16 else "fast"]


def test_idempotent_and_no_new_placeholders():
    x, w, y = small_inputs()
    gm, example_inputs = dynamo_graph(loss, (x, w, y))
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    first = run_pass(gm.graph)
    gm.recompile()
    torch.testing.assert_close(gm(*example_inputs)[0], loss(x, w, y), rtol=1e-5, atol=1e-6)
    code_after_first = gm.graph.python_code("self").src
    second = run_pass(gm.graph)
    assert [r.rewritten for r in first] == [True] and second == []
    assert gm.graph.python_code("self").src == code_after_first
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == placeholders


def test_emits_only_torch_ops_and_builtins_with_meta():
    gm, _ = dynamo_graph(loss, small_inputs(), dynamic=True)
    before = set(gm.graph.nodes)
    run_pass(gm.graph)
    new = [n for n in gm.graph.nodes if n not in before]
    assert new and any(n.target is OP for n in new)
    for node in new:
        assert isinstance(node.target, torch._ops.OpOverload) or node.target in (
            operator.getitem,
            operator.mul,
            operator.truediv,
        )
        assert "example_value" in node.meta and "val" in node.meta


def test_counters_and_debug_log_for_rejections(caplog, capsys):
    def returns_logits(x, w, y):
        logits = F.linear(x, w)
        return F.cross_entropy(logits.view(-1, 11), y.view(-1)), logits

    with (
        config.override(escaping_logits="keep"),
        caplog.at_level(logging.DEBUG, logger="cce_compile"),
    ):
        outcome = check(returns_logits, small_inputs(), backward_all=True)
    assert outcome.skipped == {"logits_escape": 1}
    assert any("logits_escape" in r.getMessage() for r in caplog.records)
    assert capsys.readouterr().out == ""  # counted and logged, never printed


def test_disable_setting_rewrites_nothing():
    with config.override(disable=True):
        outcome = check(loss, small_inputs())
    assert outcome.rewritten == 0 and outcome.skipped == {"disabled": 1}


def test_dynamic_shapes_one_compile_for_new_sizes():
    def call(batch, time, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, time, 8, generator=gen, requires_grad=True)
        w = torch.randn(11, 8, generator=gen, requires_grad=True)
        return x, w, torch.randint(0, 11, (batch, time), generator=gen)

    outcome = check(loss, call(2, 5, 0), dynamic=True, extra_calls=[call(3, 9, 1), call(4, 2, 2)])
    assert outcome.rewritten >= 1 and not outcome.recompiled


@pytest.mark.parametrize(
    ("sizes", "mode"),
    [("static", "lean"), ("dynamic", "fast"), ("dynamic-at-most-500", "lean")],
)
def test_a_symbolic_row_count_plans_the_mode_for_larger_calls(sizes, mode):
    """400 rows of a 4096-class head leave no room for fast's 1024-row floor in 1/5 of their
    logits (lean); a graph with symbolic sizes also runs larger calls, and is planned for 16x
    its example (fast fits there), but never for more rows than ``mark_dynamic`` allows."""
    from cce_compile.op.signature import FORWARD

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 400, 16, generator=gen, requires_grad=True)
    w = torch.randn(4096, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 4096, (1, 400), generator=gen)
    if sizes == "dynamic-at-most-500":
        torch._dynamo.mark_dynamic(x, 1, min=2, max=500)
        torch._dynamo.mark_dynamic(y, 1, min=2, max=500)
    gm, _ = dynamo_graph(loss, (x, w, y), dynamic=True if sizes == "dynamic" else None)
    run_pass(gm.graph)
    modes = [n.args[FORWARD.index("mode")] for n in gm.graph.nodes if n.target is OP]
    assert modes == [mode]


def test_activation_checkpointing_subgraph():
    def checkpointed(x, w, y):
        return torch.utils.checkpoint.checkpoint(loss, x, w, y, use_reentrant=False)

    outcome = check(checkpointed, small_inputs())
    assert outcome.rewritten == 1 and outcome.has_op


def test_symbolic_softcap_and_smoothing_under_dynamic():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cap = 5.0
            self.smoothing = 0.1
            self.proj = torch.nn.Linear(8, 11, bias=False)

        def forward(self, x, y):
            logits = torch.tanh(self.proj(x) / self.cap) * self.cap
            return F.cross_entropy(logits.view(-1, 11), y.view(-1), label_smoothing=self.smoothing)

    torch.manual_seed(0)
    x, _, y = small_inputs()
    outcome = check(Head(), (x, y), dynamic=True)
    # The tensorified floats make Dynamo restart its analysis once, running the pass on each
    # attempt: the graph it keeps (the last) carries the op, and the count is taken back for
    # the abandoned attempt's graph (it never runs).
    assert outcome.rewritten == 1 and len(outcome.graphs) >= 1
    assert OP in [n.target for n in outcome.graphs[-1].graph.nodes]


def test_float_scale_that_changes_per_call_is_told_once(caplog):
    """Dynamo specialises a float the op takes as a constant: each value recompiles, so the
    user is told once (the results stay exact: checked against eager)."""
    x, w, y = small_inputs()

    def scaled(x, w, y, scale):
        return F.cross_entropy(F.linear(x, w).view(-1, 11) * scale, y.view(-1))

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(scaled, backend=cce_compile.backend)
    with inductor_without_codegen(), caplog.at_level(logging.WARNING, logger="cce_compile"):
        for scale in (1.0, 1.5, 2.0):
            got = compiled(x, w, y, scale)
            torch.testing.assert_close(got, scaled(x, w, y, scale))
    told = [r.getMessage() for r in caplog.records if "symbolic" in r.getMessage()]
    assert len(told) == 1 and "logit scale" in told[0], told
    assert counters["cce_compile"]["rewritten"] >= 2  # the op ran for the recompiled values


def test_recording_collects_reports_of_a_real_compile():
    from cce_compile.passes.report import recording

    with recording() as reports:
        outcome = check(loss, small_inputs(), backend="cce")
    assert outcome.rewritten == 1
    assert [r.rewritten for r in reports] == [True]
    assert reports[0].rows == 10 and reports[0].vocab == 11


def test_emitted_arguments_resolve_nodes_inside_slices():
    """Both emitters (plain and tensor-parallel) evaluate new nodes on example values: a row
    slice with symbolic bounds holds nodes, which must be resolved too."""
    from cce_compile.passes import predicates

    graph = torch.fx.Graph()
    start, stop = graph.placeholder("start"), graph.placeholder("stop")
    start.meta["example_value"], stop.meta["example_value"] = 1, 4
    resolved = predicates.example_args(((slice(None), slice(start, stop)), [stop]))
    assert resolved == ((slice(None), slice(1, 4)), [4])


@pytest.mark.parametrize("skip", [True, False], ids=["skipping", "not-skipping"])
@pytest.mark.parametrize(
    "ignore_index", [2**32 + 5, 2**40, -(2**40), 5], ids=["2^32+5", "2^40", "-2^40", "in-range-5"]
)
def test_int32_targets_ignore_the_rows_pytorch_ignores(ignore_index, skip):
    """F.cross_entropy compares targets with ignore_index as int64: one int32 cannot hold
    ignores no row, though int32 targets wrap it (2**32 + 5 -> 5, +-2**40 -> 0)."""

    def int32_loss(x, w, y):
        logits = F.linear(x, w).view(-1, w.shape[0])
        return F.cross_entropy(logits, y.view(-1), ignore_index=ignore_index, reduction="sum")

    x, w, y = small_inputs(seed=3)
    y[:, ::2] = ignore_index % 2**32  # int32's wrap-around of it: what must still count
    y = y.to(torch.int32)
    graphs = []

    def backend(gm, example_inputs):  # the pass, then AOTAutograd without Inductor (fast)
        run_on_module(gm)
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    with config.override(skip_ignored=skip):
        got = torch.compile(int32_loss, backend=backend, fullgraph=True)(x, w, y)
    assert OP in [n.target for gm in graphs for n in gm.graph.nodes]  # eager refuses int32
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    want = int32_loss(x64, w64, y.long())
    assert_close("loss", got, want, LOSS_RTOL[torch.float32])
    for name, g, e in zip(
        ("x", "w"), torch.autograd.grad(got, (x, w)), torch.autograd.grad(want, (x64, w64))
    ):
        assert_close(f"grad {name}", g, e, GRAD_RTOL[torch.float32])
