"""The classifier gradient's accuracy under scaled-exponential designs, simulated on a CPU.

Before fast mode's slabs were built (a7ac54b) this asked: if a chunk keeps bf16 exp(z - m)
per tile of classes instead of float32 logits, and the missing factor exp(m - lse) is applied
afterwards, how far is d classifier from float64? Each form rounds where a GPU would (bf16
operands, float32 accumulation, one bf16 rounding of the result), against torch.compile's
(bf16 logits) and whole float32 rows (fast mode before slabs). The target's entry, p_t - 1, is
computed from its float32 logit in the scaled forms.

    python bench/scaled_exp_accuracy.py 4096 1024 16384      # N D V (bench/results/accuracy.md)
"""

from __future__ import annotations

import math
import sys

import torch

TILE = 256  # classes per tile of one offset
BF16 = torch.bfloat16


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def make_inputs(n: int, d: int, v: int, peaked: bool):
    """bench.py's inputs: hidden N(0, 1), classifier N(0, 1)/sqrt(D); peaked: the target
    holds ~97% of the softmax."""
    hidden, classifier = torch.randn(n, d), torch.randn(v, d) / d**0.5
    targets = torch.randint(0, v, (n,))
    if peaked:
        hidden = math.log(0.97 / 0.03 * v) * classifier[targets] + 0.1 * hidden
    return hidden.to(BF16), classifier.to(BF16), targets


def gradients(hidden, classifier, targets) -> dict[str, torch.Tensor]:
    """d classifier of the mean loss by each form, and the float64 reference."""
    n, v = hidden.shape[0], classifier.shape[0]
    h32, onehot = hidden.float(), torch.nn.functional.one_hot(targets, v).float()
    z64 = hidden.double() @ classifier.double().T
    out = {"reference": (torch.softmax(z64, 1) - onehot.double()).T @ hidden.double() / n}
    z16 = (h32 @ classifier.float().T).to(BF16).float()
    dz = ((torch.softmax(z16, 1) - onehot) / n).to(BF16).float()
    out["compile (bf16 logits)"] = (dz.T @ h32).to(BF16)
    z = h32 @ classifier.float().T
    dz = (torch.softmax(z, 1) - onehot).to(BF16).float()
    out["whole float32 rows"] = ((dz.T @ h32).to(BF16).float() / n).to(BF16)
    lse, rows = torch.logsumexp(z, 1), torch.arange(n)
    tiles = z.view(n, v // TILE, TILE)
    top = tiles.amax(2, keepdim=True)
    e = torch.exp(tiles - top).view(n, v)
    e[rows, targets] = 0  # the target's entry comes from its float32 logit
    e = e.to(BF16).float().view(n, v // TILE, TILE)
    target_part = torch.zeros(v, hidden.shape[1])
    p_target = torch.exp(z[rows, targets] - lse)
    target_part.index_add_(0, targets, (p_target - 1)[:, None] * h32)
    rescaled = (e * torch.exp(top - lse[:, None, None])).to(BF16).float().view(n, v)
    out["scaled exp, rescaled"] = (((rescaled.T @ h32) + target_part).to(BF16).float() / n).to(BF16)
    return out


def main(n: int, d: int, v: int) -> None:
    torch.manual_seed(0)
    for peaked in (False, True):
        grads = gradients(*make_inputs(n, d, v, peaked))
        ref = grads.pop("reference")
        errors = ", ".join(f"{name} {relative_error(g, ref):.3e}" for name, g in grads.items())
        print(f"{'peaked' if peaked else 'plain'}: {errors}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
