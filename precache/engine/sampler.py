"""Next-token sampling from logits: greedy, temperature, top-k and top-p (nucleus, Holtzman et al. 2020)."""

from __future__ import annotations

import torch

from precache.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick a token id from ``logits`` ``[vocab]`` (fp32)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_scores, dim=-1) > params.top_p  # keep the token that crosses top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
