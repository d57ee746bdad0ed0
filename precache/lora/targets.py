"""Which modules of a Llama-family model an ``adapter_config.json`` puts LoRA on, and with what
rank and scaling: PEFT's matching rules (``check_target_module_exists`` and ``get_pattern_key`` in
``peft/tuners/tuners_utils.py`` and ``peft/utils/other.py``, peft 0.21), written for our module names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelShape(Protocol):
    """What loading an adapter reads of the base model's architecture
    (:class:`precache.models.config.ModelConfig` is one; ``lora`` sits below ``models`` and never
    imports it): ``name`` (the checkpoint's HF name or path, compared with the adapter's
    ``base_model_name_or_path``), ``num_layers``, ``qk_norm`` (Qwen3's per-head q/k RMSNorm, two
    more module names per layer) and ``projection_shape(proj)`` ``(d_in, d_out)`` of a projection
    of :data:`PROJECTIONS` in one decoder layer."""

    @property
    def name(self) -> str: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def qk_norm(self) -> bool: ...

    def projection_shape(self, proj: str) -> tuple[int, int]: ...


def module_names(config: ModelShape) -> list[str]:
    """Every module name of the HF ``*ForCausalLM`` model (``model.named_modules()``), the names
    PEFT matches ``target_modules`` and the patterns against."""
    names = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        names += [layer, f"{layer}.self_attn", f"{layer}.mlp", f"{layer}.mlp.act_fn"]
        names += [f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"]
        if config.qk_norm:
            names += [f"{layer}.self_attn.q_norm", f"{layer}.self_attn.k_norm"]
        names += [projection_module(i, p) for p in PROJECTIONS]
    return names


def projection_module(layer: int, proj: str) -> str:
    """HF module name of projection ``proj`` of decoder layer ``layer``."""
    block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{block}.{proj}"


def _matches_names(spec: str | Iterable[str], name: str) -> bool:
    """PEFT's rule for ``target_modules`` / ``exclude_modules``: a string is a regex over the whole
    name; a list matches a name exactly or as its ``.ITEM`` suffix."""
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return name in spec or any(name.endswith(f".{item}") for item in spec)


def _layer_index(name: str, layers_pattern: list[str] | None) -> int | None:
    """The first numbered segment of ``name`` (after ``PATTERN.`` when ``layers_pattern`` is set)."""
    if not layers_pattern:
        found = re.match(r".*?\.[^.]*\.(\d+)\.", name)
    else:
        found = None
        for pattern in layers_pattern:
            found = re.match(rf"(?:^|.*?\.){pattern}\.(\d+)\.", name)
            if found:
                break
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class LoraOptions:
    """The options of one ``adapter_config.json`` that decide which modules get LoRA and with what
    rank and scaling (null fields already read as PEFT's defaults)."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | frozenset[str]
    exclude_modules: str | frozenset[str] | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]
    bias: str
    lora_bias: bool

    def targets(self, name: str) -> bool:
        """Whether PEFT puts a LoRA layer on module ``name`` (``check_target_module_exists``)."""
        if self.exclude_modules and _matches_names(self.exclude_modules, name):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            return True
        found = any(name.endswith(f".{t}") for t in self.target_modules)
        if found and self.layers_to_transform:
            index = _layer_index(name, list(self.layers_pattern) if self.layers_pattern else None)
            return index is not None and index in self.layers_to_transform
        return found

    def rank(self, name: str) -> int:
        """Rank of module ``name``: ``rank_pattern``'s first matching key, else ``r``."""
        return _pattern_value(self.rank_pattern, name, self.r)

    def rank_source(self, name: str) -> str:
        """The field that sets the rank of module ``name``: ``rank_pattern`` or ``r``."""
        return "rank_pattern" if _pattern_value(self.rank_pattern, name, None) is not None else "r"

    def alpha(self, name: str) -> float:
        return _pattern_value(self.alpha_pattern, name, self.lora_alpha)

    def scaling(self, name: str | None = None) -> float:
        """``alpha / r`` of module ``name``, or from ``r`` and ``lora_alpha`` when ``name`` is None
        (``alpha / sqrt(r)`` with rsLoRA; Kalajdzievski 2023)."""
        r = self.r if name is None else self.rank(name)
        alpha = self.lora_alpha if name is None else self.alpha(name)
        return alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(pattern: tuple[tuple[str, float], ...], name: str, default):
    """PEFT's ``get_pattern_key``: the first key (in file order) whose regex matches the end of
    ``name`` at a ``.`` boundary."""
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default
