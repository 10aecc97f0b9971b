"""cce_compile.backend: the pass, then Inductor with torch.compile's mode and options."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from harness import check

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


def test_explain_reports_sites_and_fixes():
    def two_sites(x, w, b, y):
        logits = F.linear(x, w)
        escaped = F.cross_entropy(logits.view(-1, 11), y.view(-1))
        fused = loss(x, w, b, y)
        return escaped + fused, logits

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


CACHE_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    from torch._dynamo.utils import counters
    import cce_compile, cce_compile.torch_path as torch_path

    calls = []
    real = torch_path.forward
    torch_path.forward = lambda *a, **k: calls.append(1) or real(*a, **k)

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
    script = tmp_path / "cached.py"
    script.write_text(CACHE_SCRIPT)
    runs = [
        subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    first, second = (run.stdout.split() for run in runs)
    assert first[first.index("HITS") + 1] == "0"
    assert int(second[second.index("HITS") + 1]) >= 1  # served from the cache ...
    assert int(second[second.index("OP_CALLS") + 1]) >= 1  # ... and still runs the op
