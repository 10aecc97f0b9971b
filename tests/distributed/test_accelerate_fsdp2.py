"""accelerate's FSDP2 preparation of a compiled Hugging Face model, as the Trainer's
``torch_compile=True`` runs it (compile, then ``fsdp2_prepare_model``), on two gloo ranks.

accelerate 1.15 carves ``[final norm, lm_head]`` into an FSDP2 unit of their own, whose hooks
break the graph between the head and the loss: unfused (``logits_from_graph_input``). With the
pass enabled, ``integrations/accelerate_fsdp2.py`` keeps the head in the root unit: fused, and
each rank's loss and every gathered gradient equal one process's eager, unsharded run.

accelerate runs FSDP only on accelerators (on a CPU its launcher gives DDP), so the test calls
the function ``Accelerator.prepare`` calls, ``accelerate.accelerator.fsdp2_prepare_model``, with
the plugin the launcher's ``--use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy
TRANSFORMER_BASED_WRAP`` flags make.
"""

from __future__ import annotations

import copy
import traceback
import types

import launcher
import pytest
import torch
from oracle import COMPILED_VS_EAGER_RTOL, rel_error

from cce_compile.passes.report_types import FSDP2_FIX

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB = 97
RTOL = COMPILED_VS_EAGER_RTOL[torch.float32]


def _model(tied: bool):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _cce_eager(gm, example_inputs):
    """cce_compile's pass, then the graph as it is (CPU test time: no AOTAutograd, no
    Inductor; the op's autograd formula gives the backward)."""
    from cce_compile.passes.graph_pass import run_on_module

    run_on_module(gm)
    return gm.forward


def _prepare(model, rank: int):
    """accelerate's FSDP2 preparation, as ``Accelerator.prepare`` calls it."""
    import accelerate.accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
    )
    accelerator = types.SimpleNamespace(
        state=types.SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=None,
        mixed_precision="no",
        is_main_process=rank == 0,
        device=torch.device("cpu"),
    )
    return accelerate.accelerator.fsdp2_prepare_model(accelerator, model)


def _run(case: str, rank: int, world: int) -> dict:
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import cce_compile
    from cce_compile.integrations import accelerate_fsdp2

    cce_compile.enable()
    if case == "accelerate_layout":  # accelerate's own unit for the head: the failure
        accelerate_fsdp2.uninstall()
    reference = _model(tied=case == "tied")
    model = copy.deepcopy(reference)
    if case != "uncompiled":
        model = torch.compile(model, backend=_cce_eager)
    model = _prepare(model, rank)
    inner = getattr(model, "_orig_mod", model)
    layout = {
        "lm_head_own_unit": isinstance(inner.lm_head, FSDPModule),
        "norm_own_unit": isinstance(inner.model.norm, FSDPModule),
        "getters_restored": "get_output_embeddings" not in vars(inner),
    }
    if case == "accelerate_layout":  # what the pass says of a loss whose logits come in
        layout["advice"] = _advice_on_logits_from_graph_input()
    if case in ("uncompiled", "accelerate_layout"):  # the layout is what they check
        return dict(layout=layout)

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2 * world, 8), generator=gen) for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()
    errors: dict[str, float] = {}
    for tokens in batches:
        local = tokens.chunk(world)[rank]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        # One process, eagerly: FSDP averages the ranks' gradients.
        parts = [reference(input_ids=t, labels=t).loss for t in tokens.chunk(world)]
        (sum(parts) / world).backward()
        errors["loss"] = max(errors.get("loss", 0.0), rel_error(loss, parts[rank].detach()))
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        errors[f"grad_{name}"] = rel_error(grad, q.grad)
    return dict(layout=layout, errors=errors, fused=dict(counters["cce_compile"]))


def _advice_on_logits_from_graph_input() -> str:
    """The fix the pass gives for a cross-entropy whose logits are a graph input."""
    import torch.nn.functional as F

    import cce_compile

    logits, labels = torch.randn(4, VOCAB), torch.randint(0, VOCAB, (4,))
    report = cce_compile.explain(lambda z, y: F.cross_entropy(z, y), logits, labels)
    (site,) = report.sites
    return site.advice


def _worker(rank: int, world: int, cases: list[str]) -> dict:
    results = {}
    for case in cases:  # "accelerate_layout" uninstalls the integration: it comes last
        try:
            results[case] = _run(case, rank, world)
        except Exception:  # noqa: BLE001
            results[case] = dict(error=traceback.format_exc())
    return results


# case -> (lm_head in its own unit, what the pass reports)
CASES = {
    "untied": (False, {"rewritten": 1}),
    "tied": (False, {"rewritten": 1}),
    "uncompiled": (True, None),
    # accelerate's own layout (the integration uninstalled): unfused, as the module says
    # (measured: {'skipped:logits_from_graph_input': 1}); not run here, for time
    "accelerate_layout": (True, None),
}


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return launcher.run(_worker, 2, list(CASES))


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_fsdp2_head_and_loss(world2, case):
    own_unit, fused = CASES[case]
    for rank, per_rank in enumerate(world2):
        got = per_rank[case]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        if fused is not None:
            assert got["fused"] == fused, (case, got["fused"])
        layout = got["layout"]
        assert layout["lm_head_own_unit"] == own_unit, (case, layout)
        # accelerate still carves the final norm (tied: the embedding stays with the head)
        assert layout["norm_own_unit"] and layout["getters_restored"], (case, layout)
        if case == "accelerate_layout":  # the refusal names the head's own unit and the fix
            assert layout["advice"] == FSDP2_FIX, layout["advice"]
        if fused is None:
            continue
        for label, err in got["errors"].items():
            assert err <= RTOL, f"rank {rank}: {label} relative error {err:.3e} > {RTOL:.1e}"


def test_graph_break_fix_without_fsdp2_names_no_fsdp2():
    """In a process that shards nothing, the usual fix (the FSDP2 one is for FSDP2 runs)."""
    advice = _advice_on_logits_from_graph_input()
    assert advice.startswith("remove the graph break") and "FSDP2" not in advice, advice
