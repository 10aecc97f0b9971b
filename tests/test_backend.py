"""cce_compile.backend: the pass, then Inductor with torch.compile's mode and options."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import torch
import torch.nn.functional as F
from fresh_process import run_in_forks
from harness import check, inductor_without_codegen

import cce_compile


def loss(x, w, b, y):
    logits = torch.tanh(F.linear(x, w, b).float() / 9.0) * 9.0
    return F.cross_entropy(logits.view(-1, w.shape[0]), y.view(-1), label_smoothing=0.1)


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(11, 8, generator=gen, requires_grad=True)
    b = torch.randn(11, generator=gen, requires_grad=True)
    return x, w, b, torch.randint(0, 11, (2, 5), generator=gen)


def test_inductor_backend_matches_eager():
    outcome = check(loss, small_inputs(), backend="cce")
    assert outcome.rewritten == 1 and outcome.has_op


def test_mode_and_options_are_passed_to_inductor():
    outcome = check(loss, small_inputs(), backend="cce", mode="max-autotune-no-cudagraphs")
    assert outcome.rewritten == 1
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend=cce_compile.backend, options={"no_such_option": 1})
    with pytest.raises(Exception, match="no_such_option"):
        compiled(*small_inputs())


def test_dynamic_inductor_single_compile():
    def call(batch, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, 5, 8, generator=gen, requires_grad=True)
        w = torch.randn(11, 8, generator=gen, requires_grad=True)
        b = torch.randn(11, generator=gen, requires_grad=True)
        return x, w, b, torch.randint(0, 11, (batch, 5), generator=gen)

    outcome = check(loss, call(2, 0), backend="cce", dynamic=True, extra_calls=[call(6, 1)])
    assert outcome.rewritten >= 1 and not outcome.recompiled


def test_backend_registered_by_name():
    assert "cce" in torch._dynamo.list_backends(exclude_tags=())


def test_importing_the_backend_module_keeps_the_function():
    import importlib

    importlib.import_module("cce_compile.compile_backend")
    assert callable(cce_compile.backend) and cce_compile.backend.__name__ == "backend"
    from importlib.metadata import entry_points

    (point,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "cce"]
    assert point.load() is cce_compile.backend


def test_explain_reports_sites_and_fixes():
    def two_sites(x, w, b, y):
        logits = F.linear(x, w)
        escaped = F.cross_entropy(logits.view(-1, 11), y.view(-1))
        fused = loss(x, w, b, y)
        return escaped + fused, logits

    with cce_compile.config.override(escaping_logits="keep"):  # the default fuses both
        report = cce_compile.explain(two_sites, *small_inputs())
    assert len(report.sites) == 2 and len(report.rewritten) == 1
    text = str(report)
    assert "REWRITTEN" in text and "logits_escape" in text and "fix:" in text
    assert report.saved_bytes == 10 * 11 * (4 + 4)


def test_explain_with_the_pass_disabled_reports_the_match_as_kept():
    with cce_compile.config.override(disable=True):
        report = cce_compile.explain(loss, *small_inputs())
    (site,) = report.sites
    assert not site.rewritten and site.reason == "disabled" and site.rows == 10
    assert "fix: unset CCE_DISABLE" in str(report) and report.saved_bytes == 0


# What a fresh Python that compiles imports first (~6 s of CPU): the scripts that need a fresh
# Python run as forks of one that imported these (fresh_process.run_in_forks).
COMPILER = ("torch", "torch._dynamo", "torch._inductor.compile_fx")
CACHE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch._dynamo.utils import counters
    import cce_compile, cce_compile.implementations.torch_path as torch_path

    calls = []
    real = torch_path.fast_forward, torch_path.logit_stats
    torch_path.fast_forward = lambda *a, **k: calls.append(1) or real[0](*a, **k)
    torch_path.logit_stats = lambda *a, **k: calls.append(1) or real[1](*a, **k)

    def loss(x, w, y):
        return F.cross_entropy(F.linear(x, w).view(-1, 11), y.view(-1))

    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    out = torch.compile(loss, backend=cce_compile.backend)(x, w, y)
    torch.testing.assert_close(out, loss(x, w, y))
    hits = counters["inductor"]["fxgraph_cache_hit"]
    hits += counters["aot_autograd"]["autograd_cache_hit"]
    print("HITS", hits, "OP_CALLS", len(calls))
    """
)


@pytest.mark.slow
def test_graph_cache_hit_after_restart_still_runs_the_op(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    # Two fresh programs, one after the other, forked from one Python that imported the compiler
    # and compiled nothing.
    runs = run_in_forks([CACHE_SCRIPT] * 2, env, preload=COMPILER, timeout=600)
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (run.stdout.split() for run in runs)
    assert first[first.index("HITS") + 1] == "0"
    assert int(second[second.index("HITS") + 1]) >= 1  # served from the cache ...
    assert int(second[second.index("OP_CALLS") + 1]) >= 1  # ... and still runs the op


def _returns_logits(x, w, b, y):
    logits = F.linear(x, w)
    return F.cross_entropy(logits.view(-1, 11), y.view(-1)), logits


def test_explain_counts_only_memory_really_saved():
    x, w, b, y = small_inputs()
    with cce_compile.config.override(escaping_logits="rewrite"):
        kept = cce_compile.explain(_returns_logits, x, w, b, y)
    with cce_compile.config.override(escaping_logits="drop"):
        dropped = cce_compile.explain(_returns_logits, x, w, b, y)
    assert kept.saved_bytes == 10 * 11 * 4  # the logits stay: only the log-probabilities go
    assert "kept for their other users" in str(kept)
    assert dropped.saved_bytes == 10 * 11 * (4 + 4)  # logits and log-probabilities
    assert "'meta' tensor" in str(dropped)


def test_explain_points_at_the_users_frame():
    report = cce_compile.explain(loss, *small_inputs())
    assert "test_backend.py" in report.sites[0].location
    assert report.sites[0].location.endswith("in loss")


def _head_then_break(x, w, b, y):
    logits = F.linear(x, w)
    torch._dynamo.graph_break()
    return F.cross_entropy(logits.view(-1, 11), y.view(-1))


def test_explain_says_where_the_graph_break_is_and_what_removes_it():
    report = cce_compile.explain(_head_then_break, *small_inputs())
    (site,) = report.sites
    assert site.reason == "logits_from_graph_input"
    assert "graph_break()" in site.detail and "test_backend.py" in site.detail
    assert "Remove the `torch._dynamo.graph_break()` call" in site.advice
    assert "graph break at" in str(report)


def _head_then_print(x, w, b, y):
    logits = F.linear(x, w)
    print("step")  # noqa: T201  (a user's print between head and loss)
    return F.cross_entropy(logits.view(-1, 11), y.view(-1))


def test_explain_names_the_setting_that_removes_a_print_break(capsys):
    report = cce_compile.explain(_head_then_print, *small_inputs())
    (site,) = report.sites
    assert site.reason == "logits_from_graph_input"
    assert "reorderable_logging_functions" in site.advice, site.advice


@pytest.mark.skipif(not hasattr(torch._dynamo, "skip_frame"), reason="torch without skip_frame")
def test_explain_reports_frames_dynamo_skipped():
    def skipped(x, w, b, y):
        torch._dynamo.skip_frame()
        return loss(x, w, b, y)

    report = cce_compile.explain(skipped, *small_inputs())
    # The skipped frame runs eagerly; the loss it calls is a frame of its own, compiled.
    assert len(report.sites) == 1 and len(report.skipped_frames) == 1
    assert "skipped" in report.skipped_frames[0] and "without compiling" in str(report)


def test_watch_says_when_the_pass_never_ran():
    torch._dynamo.reset()
    with cce_compile.watch() as report:
        torch.compile(loss, backend="aot_eager")(*small_inputs()).backward()
    assert report.graphs == 0 and report.unseen_graphs >= 1
    assert "the pass did not run" in str(report) and "enable()" in str(report)


class _NormedHead(torch.nn.Module):
    """A float in the graph (LayerNorm's eps) makes Dynamo restart its analysis under
    dynamic=True, running the backend once per attempt."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 11, bias=False)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.norm(x)).view(-1, 11), y.view(-1))


def test_watch_and_counters_take_back_an_abandoned_compile_attempt():
    from torch._dynamo.utils import counters

    x, _, _, y = small_inputs()
    torch._dynamo.reset()
    counters.clear()
    # The attempts end before Inductor's code generation (its C++ for the norm: test_models.py)
    with inductor_without_codegen(), cce_compile.watch() as report:
        torch.compile(_NormedHead(), backend="cce", dynamic=True)(x, y).backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert (len(report.sites), report.graphs, len(report.rewritten)) == (1, 1, 1), str(report)
    assert dict(counters["cce_compile"]) == {"rewritten": 1}


def test_watch_counts_a_graph_once_with_the_backend_and_enable():
    torch._dynamo.reset()
    cce_compile.enable()
    try:
        with cce_compile.watch() as report:
            torch.compile(loss, backend="cce")(*small_inputs()).backward()
    finally:
        cce_compile.disable()
    assert (len(report.sites), report.graphs) == (1, 1), str(report)


def test_watch_reports_the_rewrite_on_a_warm_cache(tmp_path, monkeypatch):
    # A private cache, warmed by the first compile; the second is served from it.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    from torch._dynamo.utils import counters

    reports = []
    with (
        torch._inductor.config.patch(fx_graph_cache=True),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        for _ in range(2):
            torch._dynamo.reset()
            counters.clear()
            with cce_compile.watch() as report:
                torch.compile(loss, backend="cce")(*small_inputs()).backward()
            reports.append(report)
    hits = (
        counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    )
    assert hits >= 1  # the second compile was a cache hit ...
    assert [len(r.rewritten) for r in reports] == [1, 1]  # ... and the report still says so
    assert counters["cce_compile"]["rewritten"] == 1


# Each route ends the program with the setting's own line and nothing else: for the backend
# (by name or as the function) it is raised where the backend is looked up, not wrapped in
# Dynamo's BackendCompilerFailed, which buried it under ~40 lines of Dynamo's frames and notes.
ROUTES = {
    # backend="cce" with no import of cce_compile: Dynamo's registry loads the entry point.
    "name": 'torch.compile(lambda x: x.sin(), backend="cce")(torch.randn(3))',
    "function": "import cce_compile\n"
    "torch.compile(lambda x: x.sin(), backend=cce_compile.backend)(torch.randn(3))",
    "enable": "import cce_compile; cce_compile.enable()",
    "op": "import cce_compile; cce_compile.linear_cross_entropy(x, w, y)",
    "compiled op": "import cce_compile\n"
    "torch.compile(lambda *a: cce_compile.linear_cross_entropy(*a))(x, w, y)",
}


BAD_SETTING = {"CCE_MODE": "turbo"}
ROUTE_SETUP = "import torch\nx, w, y = torch.randn(4, 8), torch.randn(11, 8), torch.arange(4)\n"
# The bad setting caught where enable() raises it, then an unrelated error nothing catches.
CAUGHT_THEN_OTHER_ERROR = textwrap.dedent(
    """
    import cce_compile
    try:
        cce_compile.enable()
    except ValueError as error:  # a SettingsError is still a ValueError to catch
        print(error)
    raise KeyError('unrelated')
    """
)


@pytest.fixture(scope="module")
def bad_setting_runs() -> dict[str, subprocess.CompletedProcess]:
    """Each route's script, and CAUGHT_THEN_OTHER_ERROR, as a fresh Python under CCE_MODE=turbo
    runs it: forks of one Python that imported the COMPILER (what the compiling routes import;
    each fork then takes 2-4 s of CPU, its exit included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_")} | BAD_SETTING
    names = [*ROUTES, "caught then other error"]
    scripts = [ROUTE_SETUP + code for code in ROUTES.values()] + [CAUGHT_THEN_OTHER_ERROR]
    return dict(zip(names, run_in_forks(scripts, env, preload=COMPILER, timeout=300)))


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_bad_environment_setting_ends_the_program_in_one_line_on_every_route(
    route, bad_setting_runs
):
    result = bad_setting_runs[route]
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "cce_compile.config.SettingsError: CCE_MODE='turbo' is not one of auto, lean, fast "
        "(setting 'mode')"
    ], result.stderr


def test_other_errors_keep_their_traceback_under_a_bad_setting(bad_setting_runs):
    """The bad setting, caught where it is raised, then an unrelated error that nothing
    catches."""
    result = bad_setting_runs["caught then other error"]
    assert result.stdout.startswith("CCE_MODE='turbo'"), result.stderr
    assert result.returncode == 1 and result.stderr.startswith("Traceback"), result.stderr
    assert result.stderr.splitlines()[-1] == "KeyError: 'unrelated'"
