"""An action or vocabulary mask written into the logits (``z.masked_fill_(ban, -inf)``,
``z[..., ban] = -inf``, ``torch.where(ban, -inf, z)``, ``z + mask``) is not a step the walk
takes, in place or out of place. The in-place write's fix said "make it out of place", which
then gave ``unsupported_op_in_chain`` with a generic fix. Each now names what fuses: the mask as
the head's bias, ``F.linear(h, W, bias)``, with Categorical's entropy (checked: it fuses, as
eager).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_rl_forms import OP, TEMPERATURE, V, compile_and_run, make_inputs

from cce_compile.passes import report_types
from cce_compile.passes.verdicts import MUTATION, UNSUPPORTED_OP

BANNED = torch.arange(V) % 5 == 0


def _categorical(z, ids):
    d = torch.distributions.Categorical(logits=z / TEMPERATURE)
    return d.log_prob(ids), d.entropy()


def masked_fill_in_place(x, w, ban, ids):
    z = F.linear(x, w)
    z.masked_fill_(ban, float("-inf"))
    return _categorical(z, ids)


def setitem_in_place(x, w, ban, ids):
    z = F.linear(x, w)
    z[..., ban] = float("-inf")
    return _categorical(z, ids)


def masked_fill_out_of_place(x, w, ban, ids):
    return _categorical(F.linear(x, w).masked_fill(ban, float("-inf")), ids)


def where_out_of_place(x, w, ban, ids):
    return _categorical(torch.where(ban, float("-inf"), F.linear(x, w)), ids)


def mask_as_bias(x, w, ban, ids):
    return _categorical(F.linear(x, w, torch.zeros(V).masked_fill(ban, float("-inf"))), ids)


def _inputs():
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=5)
    return x, w, BANNED, torch.where(BANNED[ids], 1, ids)


MASKS = {
    masked_fill_in_place: MUTATION,
    setitem_in_place: MUTATION,
    masked_fill_out_of_place: UNSUPPORTED_OP,
    where_out_of_place: UNSUPPORTED_OP,
}


@pytest.mark.parametrize("fn", MASKS, ids=lambda f: f.__name__)
def test_a_mask_written_into_the_logits_names_the_bias_as_its_fix(fn):
    args = _inputs()
    outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {f"skipped:{MASKS[fn]}": 1}, compiled.counts
    (report,) = compiled.reports
    assert report.advice == report_types.MASK_AS_BIAS_FIX, report.advice
    assert "make it out of place" not in report.advice
    for got, expected in zip(outputs, fn(*args), strict=True):
        torch.testing.assert_close(got, expected)


def test_an_added_vector_names_the_bias_beside_the_usual_fix():
    def added(x, w, ban, ids):
        return _categorical(F.linear(x, w) + torch.zeros(V).masked_fill(ban, float("-inf")), ids)

    _, compiled = compile_and_run(added, _inputs())
    assert compiled.counts == {f"skipped:{UNSUPPORTED_OP}": 1}, compiled.counts
    (report,) = compiled.reports
    assert "F.linear(h, W, b), which fuses" in report.advice, report.advice
    assert "LoRA" in report.advice, report.advice


def test_the_mask_as_the_heads_bias_fuses_as_eager():
    """The fix, followed."""
    args = _inputs()
    (log_probs, entropy), compiled = compile_and_run(mask_as_bias, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP) == 1
    want_log_probs, want_entropy = mask_as_bias(*args)
    torch.testing.assert_close(log_probs, want_log_probs)
    torch.testing.assert_close(entropy, want_entropy)
    got = torch.autograd.grad(log_probs.sum() + 0.5 * entropy.sum(), args[:2])
    want = torch.autograd.grad(want_log_probs.sum() + 0.5 * want_entropy.sum(), args[:2])
    for g, expected in zip(got, want, strict=True):
        torch.testing.assert_close(g, expected)
