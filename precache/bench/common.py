"""Helpers every benchmark command shares: method lists, the HF baseline model, special ids."""

from __future__ import annotations

from precache.errors import UnknownMethodError


def methods_with_reference(text: str) -> list[str]:
    """Method names from a comma-separated list, NonShared (the reference) first and always.

    Raises:
        UnknownMethodError: a name is not a method.
    """
    from precache.methods import METHODS

    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise UnknownMethodError(f"unknown method(s) {', '.join(unknown)} (methods: {', '.join(METHODS)})")
    return ["nonshared", *(m for m in names if m != "nonshared")]  # the reference always runs


def hf_model_of(model):
    """The HF model the baseline wraps, loaded from ``model``'s checkpoint (no tensors shared)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()


def special_ids(model) -> list[int]:
    """Token ids a random benchmark stream leaves out (the tokenizer's special tokens)."""
    return list(getattr(model.tokenizer, "all_special_ids", []) or [])
