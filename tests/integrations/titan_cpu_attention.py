"""Test-only torchtitan 0.3 override: FlexAttention on CPU through a dense mask + SDPA.

torchtitan's language models use FlexAttention (or varlen, CUDA only); PyTorch's FlexAttention
has no CPU backward ("FlexAttention does not support backward on CPU"). This override keeps
FlexAttention's config type (so the model still builds its document-causal BlockMask) and
evaluates the BlockMask's mask_mod densely, then runs scaled_dot_product_attention: the same
attention, slowly, with a backward on CPU. Activate with
``--override.imports titan_cpu_attention.cpu_flex_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torchtitan.config import override
from torchtitan.models.common.attention import FlexAttention


class DenseMaskAttention(FlexAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(
        self,
        q_BLNH,
        k_BLNH,
        v_BLNH,
        *,
        attention_masks,
        score_mod=None,
        scale=None,
        enable_gqa=False,
        out_transform=None,
        **kwargs,
    ):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("DenseMaskAttention: score_mod / out_transform")
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        b, _, lq, _ = q.shape
        mask = create_mask(attention_masks.mask_mod, b, None, lq, k.shape[2], device=q.device)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


@override(
    target=FlexAttention.Config,
    exact=True,
    description="CPU test: FlexAttention as dense-masked SDPA",
)
def cpu_flex_attention(cfg: FlexAttention.Config) -> DenseMaskAttention.Config:
    return DenseMaskAttention.Config(
        block_size=cfg.block_size, kernel_options=dict(cfg.kernel_options)
    )
