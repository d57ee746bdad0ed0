"""The field policy of the OpenAI-compatible server: vLLM's request fields that precache ignores
(they cannot change the output) or refuses (a 400 naming the field unless it holds its no-op
value). Every other field is honoured (:mod:`precache.server.protocol`); a field in neither list
and not honoured is unknown, also a 400. docs/server.md, "Request fields", lists them all.
"""

from __future__ import annotations

# Fields that cannot change the output: accepted, logged at DEBUG, otherwise unused.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
    | {"include_reasoning"}  # no reasoning parser: the text is never split into reasoning and content
)

# Fields vLLM accepts that precache refuses unless they hold their no-op value: name -> (no-op
# values, why). A value in the first tuple changes nothing and is accepted.
REFUSED: dict[str, tuple[tuple, str]] = {
    "prompt_logprobs": (
        (None,),
        "prompt log-probabilities are not computed (only the last prompt position's logits are)",
    ),
    "use_beam_search": ((False, None), "beam search is not supported"),
    "length_penalty": ((1.0, None), "length_penalty applies to beam search, which is not supported"),
    "truncate_prompt_tokens": ((None,), "prompt truncation is not supported: send a shorter prompt"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported"),
    "bad_words": ((None, []), "bad_words is not supported"),
    "guided_decoding_backend": (
        (None, "guidance", "llguidance"),
        "the structured-output backend is llguidance",
    ),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((None,), "structural tags are not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "priority": ((0, None), "priority scheduling is not supported (requests run in arrival order)"),
    "kv_transfer_params": ((None,), "disaggregated serving (kv_transfer_params) is not supported"),
    "vllm_xargs": ((None,), "vllm_xargs is not supported"),
    "mm_processor_kwargs": ((None,), "multimodal inputs are not supported"),
    "media_io_kwargs": ((None,), "multimodal inputs are not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported: send text or token ids"),
    "suffix": ((None,), "suffix (insertion) is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "chat_template": (
        (None,),
        "a custom chat template is refused for safety: the model's own template is used",
    ),
    "chat_template_content_format": ((None, "auto", "string"), "content parts are joined into a string"),
}
