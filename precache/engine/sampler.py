"""Next-token sampling from logits: logit bias, min_tokens, repetition / frequency / presence
penalties, then greedy or temperature, min-p, top-k and top-p (nucleus, Holtzman et al. 2020),
in vLLM's order (:class:`~precache.config.SamplingParams` states each rule); and the
log-probabilities a turn returns."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from precache.config import SamplingParams


def shape_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: Collection[int],
) -> torch.Tensor:
    """Steps 1-4 of :class:`SamplingParams` on ``logits`` ``[vocab]`` (fp32; a new tensor, the input
    is not changed). ``stop_ids``: the token ids masked while fewer than ``params.min_tokens``
    tokens are out (the turn's stop tokens)."""
    out = logits.clone()
    vocab, dev = out.shape[-1], out.device
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long, device=dev)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype, device=dev))
    if len(output_ids) < params.min_tokens and stop_ids:
        masked = sorted(i for i in stop_ids if 0 <= i < vocab)
        out[torch.tensor(masked, dtype=torch.long, device=dev)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=dev)
        if seen.numel():
            s = out[seen]
            out[seen] = torch.where(s > 0, s / params.repetition_penalty, s * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(
            torch.tensor(list(output_ids), dtype=torch.long, device=dev), minlength=vocab
        )[:vocab]
        counts = counts.to(out.dtype)
        out -= counts * params.frequency_penalty + (counts > 0).to(out.dtype) * params.presence_penalty
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick a token id from shaped logits ``[vocab]`` (fp32; :func:`shape_logits` ran): step 5 of
    :class:`SamplingParams`."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the token that crosses top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if generator is not None and generator.device != probs.device:  # a seeded CPU generator
        probs = probs.cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_id: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``(log p(token_id), [(id, log p), ...] of the ``top`` most likely ids, most likely first)``
    from raw logits ``[vocab]`` (natural log of the softmax)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = []
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        best = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return float(logp[token_id]), best
