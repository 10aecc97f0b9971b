"""Log-probs and entropy as TRL 1.16, verl and OpenRLHF write them (the forms catalogued in
docs/graph_forms.md's RL section), for the pass's RL tests: test_rl_forms.py, test_rl_fuzz.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def trl_log_probs(logits, index):
    """TRL's selective_log_softmax: float32 gathers minus a per-row loop of logsumexps; 2-byte
    logits loop over rows of log_softmax + gather, then stack."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=index)
        row_lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return (picked - row_lse.unsqueeze(-1)).squeeze(-1)
    rows = [F.log_softmax(r, dim=-1).gather(dim=-1, index=i) for r, i in zip(logits, index)]
    return torch.stack(rows).squeeze(-1)


def trl_entropy(logits, chunk_size=5):
    """TRL's entropy_from_logits: chunks of rows (the last one shorter), then cat."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        log_p = F.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(log_p) * log_p).sum(-1))
    return torch.cat(parts, dim=0).reshape(logits.shape[:-1])


def verl_log_probs(logits, labels):
    """verl's logprobs_from_logits_v2: the same two branches, squeezed per row."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = []
    for row, row_labels in zip(logits, labels):
        log_p = F.log_softmax(row, dim=-1)
        rows.append(log_p.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def verl_entropy(logits):
    """verl's and OpenRLHF's entropy: logsumexp minus the expected logit."""
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)
