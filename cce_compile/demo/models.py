"""Two small language models in plain PyTorch, each with the usual ``lm_head`` + cross-entropy.

``GPT`` is nanoGPT's shape (pre-norm attention blocks, tied embeddings, the loss computed in
``forward``). ``GLA`` swaps attention for gated linear attention: per head a matrix state
S_t = exp(g_t) S_{t-1} + k_t^T v_t read by q_t, computed chunkwise (quadratic only inside a
chunk of c tokens, plus a (T/c)^2 matmul that carries the state across chunks), so the sequence
mixing is far cheaper than attention's O(T^2 d) and the loss layer is a larger share of the
step: the family the CCE proposal in the seeds argues gains the most.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass
class ModelConfig:
    vocab: int
    dim: int = 256
    layers: int = 4
    heads: int = 4
    context: int = 256
    chunk: int = 64  # GLA's chunk length
    norm_eps: float = 1e-5  # GLA's per-head output norm (fla's GatedLinearAttention's norm_eps)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class GatedLinearAttention(nn.Module):
    """Scalar-gated linear attention per head, chunkwise-parallel.

    Every chunk is computed at once: attention inside each chunk, plus the state carried in
    from earlier chunks, which is a decay-weighted sum of their (k^T v) updates. The gate is a
    scalar per head, so that sum is one (chunks x chunks) matmul, and there is no Python loop
    for torch.compile to unroll (the loop took ~100 s to compile at context 1024).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.chunk, self.norm_eps = cfg.heads, cfg.chunk, cfg.norm_eps
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.gate = nn.Linear(cfg.dim, cfg.heads, bias=True)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h, c = self.heads, self.chunk
        if t % c:
            raise ValueError(f"sequence length {t} must be a multiple of the chunk {c}")
        n = t // c
        q, k, v = self.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)  # (b, h, t, e)
        q = q * (d // h) ** -0.5
        log_gate = F.logsigmoid(self.gate(x)).transpose(1, 2) / 16  # (b, h, t), decay near 1
        q, k, v = (z.reshape(b, h, n, c, -1) for z in (q, k, v))
        decay = log_gate.reshape(b, h, n, c).cumsum(-1)  # log decay since the chunk's start
        last = decay[..., -1]  # (b, h, n): log decay across each whole chunk
        # Exponents are masked to -inf before exp(): the masked-out ones may be large, and
        # exp() there would give inf * 0 = NaN in the backward.
        causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
        within = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf"))
        intra = ((q @ k.transpose(-1, -2)) * within.exp()) @ v
        # Chunk j's update to the state, decayed to the end of chunk j: (b, h, n, e, e).
        update = (k * (last[..., None] - decay).exp()[..., None]).transpose(-1, -2) @ v
        # The state entering chunk i: sum over j < i of update_j decayed across chunks j+1..i-1.
        ends = last.cumsum(-1)  # (b, h, n): log decay from the start to the end of chunk i
        earlier = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)
        across = ((ends - last)[..., :, None] - ends[..., None, :]).masked_fill(
            ~earlier, float("-inf")
        )
        state = (across.exp().to(update.dtype) @ update.flatten(-2)).view_as(update)
        inter = (q * decay.exp()[..., None]) @ state
        # Per-head RMS norm of the output, as in the GLA paper: the state's scale drifts with
        # the gates, and without the norm training spikes at the end of the warm-up. Its eps is
        # explicit, as in fla's GLA layer: the default, the dtype's machine epsilon (1.2e-7 in
        # float32), made the model change with its dtype, and it was as large as the mean
        # square of some outputs at position 0 at initialisation (down to 5e-8: a product of
        # three small projections). Dividing by their near-zero RMS amplified rounding: float32
        # gradients 2e-5 off float64's (GPT's: 3e-7), and training drifted from any
        # rounding-sized change within ten steps (cce_compile against torch.compile, or
        # torch.compile against itself).
        y = F.rms_norm(intra + inter, (d // h,), eps=self.norm_eps).reshape(b, h, t, d // h)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mixer: type[nn.Module]):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.mix = mixer(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim)

    def forward(self, x):
        x = x + self.mix(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LanguageModel(nn.Module):
    """Embeddings, blocks, final norm, tied ``lm_head``; ``forward(idx, targets)`` -> loss."""

    mixer: type[nn.Module] = CausalSelfAttention

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.context, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, self.mixer) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def hidden(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def forward(self, idx, targets):
        logits = self.lm_head(self.hidden(idx))
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1
        )

    def null_loss(self, idx, targets):
        """The same step without the loss layer: what the rest of the model costs."""
        return self.hidden(idx).float().square().mean()


class GPT(LanguageModel):
    mixer = CausalSelfAttention


class GLA(LanguageModel):
    mixer = GatedLinearAttention


ARCHITECTURES = {"gpt": GPT, "gla": GLA}


def build(arch: str, cfg: ModelConfig) -> LanguageModel:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    return ARCHITECTURES[arch](cfg)
