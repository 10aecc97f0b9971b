"""The pass's log under torch's logging controls: ``TORCH_LOGS=cce`` (in code
``set_logs(modules={"cce": ...})``) tells every site, ``+cce`` adds the rewritten graph, and
tlparse gets structured artifacts."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.nn.functional as F
from harness import check

from cce_compile import config

B, T, D, V = 2, 5, 8, 11
ROOT = pathlib.Path(__file__).resolve().parents[2]


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=gen, requires_grad=True)
    w = torch.randn(V, D, generator=gen, requires_grad=True)
    return x, w, torch.randint(0, V, (B, T), generator=gen)


def two_sites(x, w, y):
    """One site fused, one left alone (its logits feed an accuracy in the graph)."""
    fused = F.cross_entropy(F.linear(x, w).view(-1, V), y.view(-1))
    logits = F.linear(x * 2, w)
    accuracy = (logits.argmax(-1) == y).float().mean()
    return fused + F.cross_entropy(logits.view(-1, V), y.view(-1)), accuracy


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def torch_logs():
    """``set_logs(modules=levels)`` for the test, returning what the cce_compile logger then
    logs; the logger as it was afterwards (set_logs gives registered loggers torch's own
    handler and stops their propagation)."""
    logger = logging.getLogger("cce_compile")
    saved = logger.level, logger.propagate, list(logger.handlers)
    records = _Records()

    def set_logs(**levels) -> list[logging.LogRecord]:
        torch._logging.set_logs(modules=levels)
        logger.addHandler(records)
        return records.records

    yield set_logs
    torch._logging.set_logs()
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def test_set_logs_cce_tells_every_site_rewritten_or_not(torch_logs):
    records = torch_logs(cce=logging.INFO)
    check(two_sites, inputs(), backward_all=True)
    told = [r.getMessage() for r in records]
    assert any(m.startswith("cce_compile: fused the cross-entropy at") for m in told), told
    assert any("alone (logits_escape)" in m for m in told), told
    assert not any("the graph after the rewrite" in m for m in told)  # DEBUG only


def test_set_logs_plus_cce_adds_the_rewritten_graph(torch_logs):
    records = torch_logs(cce=logging.DEBUG)
    check(two_sites, inputs(), backward_all=True)
    (graph,) = [r.getMessage() for r in records if "the graph after the rewrite" in r.getMessage()]
    assert "torch.ops.cce.linear_cross_entropy.default" in graph


def test_tlparse_artifacts_hold_the_sites_and_the_rewritten_graph():
    from torch._logging._internal import trace_log

    records = _Records()
    trace_log.addHandler(records)
    try:
        check(two_sites, inputs(), backward_all=True)
    finally:
        trace_log.removeHandler(records)
    artifacts = {
        r.metadata["artifact"]["name"]: r.payload
        for r in records.records
        if "artifact" in getattr(r, "metadata", {})
    }
    assert '"reason": "logits_escape"' in artifacts["cce_compile_sites"]
    assert '"rewritten": true' in artifacts["cce_compile_sites"]
    assert "torch.ops.cce.linear_cross_entropy" in artifacts["cce_compile_rewritten_graph"]


# Run with `python -S`: the repository's .pth as site-packages' copy of it runs at start-up
# (site.addsitedir), then the environment's packages on sys.path without their .pth files.
SCRIPT = """
import site, sys
site.addsitedir(sys.argv[1])
sys.path.extend(sys.argv[2:])
assert "torch" not in sys.modules, "start-up must not import torch"
import torch, torch.nn.functional as F
from cce_compile.passes.graph_pass import run_on_module

def pass_only(gm, example_inputs):  # the pass, then eager: no Inductor compile to wait for
    run_on_module(gm)
    return gm.forward

x, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
y = torch.randint(0, 11, (2, 5))
step = lambda x, w, y: F.cross_entropy(F.linear(x, w).view(-1, 11), y.view(-1))
torch.compile(step, backend=pass_only)(x, w, y).backward()
"""


def test_torch_logs_in_the_environment_at_start_up():
    """torch reads TORCH_LOGS when it is imported and refuses names it does not know: the
    start-up hook (its .pth runs when TORCH_LOGS names cce) registers cce before."""
    packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CCE_") and k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-S", "-c", SCRIPT, str(ROOT), *packages],
        env=env | {"TORCH_LOGS": "+cce"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cce_compile: fused the cross-entropy at" in run.stderr, run.stderr[-3000:]
    assert "the graph after the rewrite" in run.stderr


def test_the_pass_registers_its_log_name():
    from torch._logging._internal import log_registry

    import cce_compile.passes.graph_pass  # noqa: F401

    assert log_registry.log_alias_to_log_qnames["cce"] == ["cce_compile"]
    assert config.torch_logs_names_cce({"TORCH_LOGS": "dynamo, +cce"})
    assert not config.torch_logs_names_cce({"TORCH_LOGS": "cce_compile"})
