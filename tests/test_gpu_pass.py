"""GPU: the pass with the Triton kernels behind it, and torch.compile's mode="max-autotune"."""

from __future__ import annotations

import pytest
import torch
from harness import check

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def llama(vocab=4099):
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config).cuda()


def batch(vocab=4099, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 256), device="cuda", generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100
    return ids, labels


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_llama_step_with_kernels_fp32(mode):
    from cce_compile import config

    torch.manual_seed(0)
    model = llama()

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    with config.override(mode=mode):
        outcome = check(step, batch(), backend="cce", parameters=model.parameters())
    assert outcome.rewritten == 1 and outcome.has_op


def test_llama_bf16_autocast_max_autotune():
    """mode="max-autotune" (CUDA graphs, Inductor's select_algorithm path) around the op.
    Only ATen GEMM candidates: Triton GEMM autotuning of every projection takes minutes and
    tests Inductor, not the pass."""
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = llama()

    def step(ids, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=labels).loss

    with inductor_config.patch(max_autotune_gemm_backends="ATEN"):
        outcome = check(
            step,
            batch(),
            backend="cce",
            mode="max-autotune",
            dtype=torch.bfloat16,
            parameters=model.parameters(),
        )
    assert outcome.rewritten == 1 and outcome.has_op
