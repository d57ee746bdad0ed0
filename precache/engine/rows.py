"""Which rows a running request puts in a step: prefill chunking and decode.

A decoding request adds one token, a closed turn its post-turn pass (ReBaseShared LP's neutral
prefill); neither counts against the step's prefill budget. A prefilling request adds the next
chunk of its prompt, at most what is left of ``max_step_tokens`` (chunked prefill, as vLLM's).
"""

from __future__ import annotations

from precache.engine.request import Phase, Request


def prefill_take(request: Request, tokens_left: int | None) -> int | None:
    """Prompt tokens ``request`` prefills this step: None (its rows are not a prefill chunk, or
    the whole prompt when there is no budget), 0 (the budget is spent) or the chunk size."""
    if request.phase is not Phase.PREFILL or tokens_left is None:
        return None
    return max(0, min(tokens_left, request.prefill_left))
