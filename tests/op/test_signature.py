"""op/signature.py: the ops' argument and output lists are the one source of their schemas and
of every call's packing."""

from __future__ import annotations

import pytest
import torch

import cce_compile  # noqa: F401  (registers torch.ops.cce)
from cce_compile.distributed import signature as vocab_parallel
from cce_compile.loss_math import LossSpec
from cce_compile.op.signature import BACKWARD, BACKWARD_RETURNS, FORWARD, FORWARD_RETURNS


@pytest.mark.parametrize(
    "op, arguments, returns",
    [
        ("linear_cross_entropy", FORWARD, FORWARD_RETURNS),
        ("linear_cross_entropy_backward", BACKWARD, BACKWARD_RETURNS),
        ("vocab_parallel_cross_entropy", vocab_parallel.FORWARD, vocab_parallel.FORWARD_RETURNS),
    ],
    ids=["forward", "backward", "vocab-parallel"],
)
def test_registered_schemas_are_the_signatures(op, arguments, returns):
    import cce_compile.distributed  # noqa: F401  (registers the vocabulary-parallel op)

    schema = getattr(torch.ops.cce, op).default._schema
    assert [a.name for a in schema.arguments] == list(arguments.names)
    assert len(schema.returns) == len(returns.names)


def test_outputs_are_packed_and_read_by_name():
    values = {name: torch.tensor(float(i)) for i, name in enumerate(FORWARD_RETURNS.names)}
    packed = FORWARD_RETURNS.pack(**values)
    assert [float(v) for v in packed] == list(range(len(values)))
    out = FORWARD_RETURNS.unpack(packed)
    assert float(out.lse) == FORWARD_RETURNS.index("lse") == 1
    missing = dict(values)
    del missing["argmax"]
    with pytest.raises(TypeError, match="argmax"):
        FORWARD_RETURNS.pack(**missing)


def test_a_loss_spec_fills_the_loss_options():
    spec = LossSpec(ignore_index=7, reduction="sum", softcap=30.0, shift=1)
    built = FORWARD.bind(
        FORWARD.build(
            hidden=None,
            classifier=None,
            targets=None,
            bias=None,
            class_weights=None,
            spec=spec,
            lse_all_rows=False,
            mode="lean",
            grad_hidden=True,
            grad_classifier=True,
            grad_bias=False,
            implementation_version=0,
        )
    )
    assert built.spec() == spec and built.ignore_index == 7
    with pytest.raises(TypeError, match="unknown"):
        FORWARD.build(spec=spec, not_an_argument=1)
