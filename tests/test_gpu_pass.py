"""GPU: the pass with the Triton kernels behind it, and torch.compile's mode="max-autotune"."""

from __future__ import annotations

import contextlib

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


def _head_loss(hidden, classifier, targets):
    logits = torch.nn.functional.linear(hidden, classifier)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _direct_loss(hidden, classifier, targets):
    import cce_compile

    return cce_compile.linear_cross_entropy(hidden, classifier, targets)


@pytest.mark.parametrize("route", ["backend", "hook", "direct"])
def test_reduce_overhead_cuda_graphs(route):
    """mode="reduce-overhead" records CUDA graphs around the op. The pass leaves compaction off
    there (a captured graph cannot size its work by the targets' values); a direct call
    compacts outside capture and computes every row inside it. Each step, with its own number
    of ignored targets, matches eager; the pass's graphs are not denied CUDA graphs."""
    from harness import hook_enabled
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn, backend = {
        "backend": (_head_loss, "cce"),
        "hook": (_head_loss, "inductor"),
        "direct": (_direct_loss, "inductor"),
    }[route]
    context = hook_enabled() if route == "hook" else contextlib.nullcontext()
    with context:
        compiled = torch.compile(fn, backend=backend, mode="reduce-overhead")
        gen = torch.Generator(device="cuda").manual_seed(0)
        for step, ignored in enumerate([0.1, 0.5, 0.0, 0.9, 0.3]):
            hidden = torch.randn(4, 96, 64, device="cuda", generator=gen, requires_grad=True)
            classifier = torch.randn(1000, 64, device="cuda", generator=gen, requires_grad=True)
            targets = torch.randint(0, 1000, (4, 96), device="cuda", generator=gen)
            mask = torch.rand(4, 96, device="cuda", generator=gen) < ignored
            targets = torch.where(mask, -100, targets)
            loss = compiled(hidden, classifier, targets)
            grads = torch.autograd.grad(loss, [hidden, classifier])
            h64, c64 = (t.detach().double().requires_grad_() for t in (hidden, classifier))
            logits = torch.nn.functional.linear(h64, c64).flatten(0, 1)
            want = torch.nn.functional.cross_entropy(logits, targets.flatten())
            want_grads = torch.autograd.grad(want, [h64, c64])
            assert torch.allclose(loss.double(), want, rtol=1e-4), (step, loss, want)
            for g, w in zip(grads, want_grads):
                assert (g.double() - w).norm() <= 1e-4 * w.norm(), step
            torch.compiler.cudagraph_mark_step_begin()
    ops = counters["cce_compile"].get("rewritten", 0)
    if route != "direct":
        assert ops == 1
        assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    print(route, "cudagraph skips:", counters["inductor"].get("cudagraph_skips", 0))
