"""``torch.library.opcheck`` of the vocabulary-parallel op in both modes: its schema, its fake
kernel against the real one (every output's shape and dtype, fast mode's buffers included) and
its autograd registration, on a one-rank gloo group in this process (its collectives are then
trivial: what is checked is the op's outputs, not the combining, which test_vocab_parallel
checks on 2 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from strategies import build_case
from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

import cce_compile
from cce_compile.distributed import ops
from cce_compile.distributed.signature import FORWARD
from cce_compile.loss_math import LossSpec

# As for the single-device op (tests/op/test_custom_ops.py): fast mode's buffers are its
# autograd formula's, scaled in place by the backward; no caller returns them from a graph.
_FAST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.fixture(scope="module")
def group_name(tmp_path_factory) -> str:
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("reduce_hidden_grad", [True, False], ids=["op_reduces", "caller_reduces"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_opcheck(group_name, mode, dtype, reduce_hidden_grad):
    case = build_case(
        leading=(2, 5), dim=8, vocab=11, dtype=dtype, bias=True, ignored_fraction=0.4, shift=1
    )
    spec = LossSpec(**{k: v for k, v in case.options().items() if k != "class_weights"})
    args = FORWARD.build(
        hidden=case.hidden.requires_grad_(),
        classifier=case.classifier.requires_grad_(),
        targets=case.targets,
        bias=case.bias.requires_grad_(),
        class_weights=None,
        spec=spec,
        vocab_start=0,
        vocab_size=11,
        group_name=group_name,
        reduce_hidden_grad=reduce_hidden_grad,
        lse_all_rows=False,
        mode=mode,
        grad_hidden=True,
        grad_classifier=True,
        grad_bias=True,
        implementation_version=ops.IMPLEMENTATION_VERSION,
        skip_ignored=True,
    )
    utils = _FAST_UTILS if mode == "fast" else DEFAULT_TEST_UTILS
    with cce_compile.config.override(skip_ignored=True):
        torch.library.opcheck(torch.ops.cce.vocab_parallel_cross_entropy, args, test_utils=utils)
