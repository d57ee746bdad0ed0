"""PEFT LoRA adapters: loading and the low-rank maths.

For projection p of layer l, an adapter holds ``A`` ``[d_in, r]`` and ``B`` ``[r, d_out]`` (PEFT
stores their transposes: ``lora_A.weight`` ``[r, d_in]``, ``lora_B.weight`` ``[d_out, r]``) and
applies ``y = x W + s (x A) B`` with ``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA
(Hu et al. 2021, eq. 3; Kalajdzievski 2023).

Per-module ranks and alphas (``rank_pattern`` / ``alpha_pattern``) keep one LR width and one
scaling per adapter, which the sharing methods and the block pool rely on: every module's ``A`` and
``B`` are zero-padded to the adapter's largest rank (the padded columns of ``x A`` are exactly 0
and meet zero rows of ``B``), and a module whose scaling ``s_m`` differs from the adapter's ``s``
(from ``r`` and ``lora_alpha``) has ``s_m / s`` folded into its ``B``, so that ``s (x A) B`` is
``s_m (x A_m) B_m``. Which ``adapter_config.json`` fields are honoured and which are refused:
:mod:`precache.lora.peft_config`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from precache.errors import AdapterError
from precache.lora.peft_config import (
    PROJECTIONS,
    LoraOptions,
    parse_options,
    projection_module,
    read_config,
    targeted_projections,
)
from precache.models.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["PROJECTIONS", "LoRAAdapter", "load_adapter"]

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoRAAdapter:
    """One loaded adapter. ``weights[(layer, proj)] = (A [d_in, rank], B [rank, d_out])``.

    ``rank`` is the LR width (the largest module rank; lower-rank modules are zero-padded to it),
    ``scaling`` the one scaling ``s`` applied to every module (per-module scalings are folded into
    ``B``), ``ranks[(layer, proj)]`` each module's own rank as PEFT has it.
    """

    name: str
    rank: int
    alpha: float
    scaling: float
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    path: str = ""
    ranks: dict[tuple[int, str], int] = field(default_factory=dict, repr=False)

    def has(self, layer: int, proj: str) -> bool:
        return (layer, proj) in self.weights

    def down(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """LR projection ``x A``: ``[n, d_in] -> [n, rank]``."""
        return x @ self.weights[(layer, proj)][0]

    def up(self, z: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """Scaled up-projection ``s z B``: ``[n, rank] -> [n, d_out]``."""
        return (z @ self.weights[(layer, proj)][1]) * self.scaling

    def delta(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """``s (x A) B``: ``[n, d_in] -> [n, d_out]``."""
        return self.up(self.down(x, layer, proj), layer, proj)

    def nbytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values()
        )

    def to(self, dtype: torch.dtype, device=None) -> LoRAAdapter:
        weights = {
            k: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for k, (a, b) in self.weights.items()
        }
        return LoRAAdapter(
            self.name, self.rank, self.alpha, self.scaling, self.targets, weights, self.path, self.ranks
        )


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{file} is missing (only safetensors adapters are supported)")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise AdapterError(f"{file} is not a readable safetensors file: {exc}") from exc


def _check_base_model(cfg: dict, folder: Path, model_config: ModelConfig) -> None:
    named = str(cfg.get("base_model_name_or_path") or "")
    ours = model_config.name
    if named and ours and Path(named).name.lower() != Path(ours).name.lower():
        logger.warning(
            "adapter %s was trained for base model '%s', but the loaded model is '%s'", folder, named, ours
        )


def _refuse_tensor(file: Path, key: str, options: LoraOptions) -> AdapterError:
    """The error for a tensor that is not a LoRA A/B weight, naming the config option behind it."""
    if key.endswith(".bias"):
        if ".lora_B." in key:
            return AdapterError(
                f"{file}: tensor '{key}' is a LoRA B bias (lora_bias); not supported: precache loads "
                "plain lora_A / lora_B weights"
            )
        return AdapterError(
            f"{file}: tensor '{key}' is a base-model bias trained with bias = '{options.bias}'; not "
            "supported: an adapter-specific base bias (on k/v it would break the shared base cache); "
            "supported: bias 'none', or 'all' / 'lora_only' when the file holds no bias tensor"
        )
    for what, option in (
        ("modules_to_save", "modules_to_save"),
        ("lora_embedding_", "target_modules (LoRA on embed_tokens)"),
        ("lm_head", "target_modules (LoRA on lm_head)"),
        ("embed_tokens", "target_modules (LoRA on embed_tokens)"),
        ("trainable_tokens", "trainable_token_indices"),
        ("lora_magnitude_vector", "use_dora"),
    ):
        if what in key:
            return AdapterError(f"{file}: tensor '{key}' comes from {option}, which is not supported")
    return AdapterError(f"{file}: tensor '{key}' is not a LoRA A/B weight of a Llama projection")


def _collect_pairs(
    tensors: dict[str, torch.Tensor], file: Path, options: LoraOptions, model_config: ModelConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _refuse_tensor(file, key, options)
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS:
            raise AdapterError(f"{file}: tensor '{key}' targets '{proj}', not one of {PROJECTIONS}")
        if layer >= model_config.num_layers:
            raise AdapterError(
                f"{file}: tensor '{key}' names layer {layer}, the model has {model_config.num_layers}"
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    return pairs


def _check_targets(pairs: dict, targeted: set[tuple[int, str]], file: Path) -> None:
    """The file's modules are exactly those its config targets (PEFT would drop the others)."""
    fields = "target_modules / exclude_modules / layers_to_transform"
    extra, missing = sorted(pairs.keys() - targeted), sorted(targeted - pairs.keys())
    if extra:
        module = projection_module(*extra[0])
        raise AdapterError(
            f"{file}: holds weights for {module}, which adapter_config.json does not target ({fields})"
        )
    if missing:
        module = projection_module(*missing[0])
        raise AdapterError(
            f"{file}: has no weights for {module}, which adapter_config.json targets ({fields})"
        )


def load_adapter(path: str | Path, model_config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    """Load a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        AdapterError: missing or malformed file, an option we do not honour (DoRA, lora_bias,
            modules_to_save, LoRA on embed_tokens / lm_head, ...: :mod:`precache.lora.peft_config`),
            bias tensors, weights for modules the config does not target (or none for one it does),
            or weights whose shapes do not fit ``model_config`` and the module's rank. The message
            names the file and the field.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    cfg = read_config(folder)
    cfg_file = folder / "adapter_config.json"
    options = parse_options(cfg, cfg_file)
    _check_base_model(cfg, folder, model_config)
    targeted = targeted_projections(options, model_config, cfg_file)
    file = folder / "adapter_model.safetensors"
    pairs = _collect_pairs(_read_weights(folder), file, options, model_config)
    if not pairs:
        raise AdapterError(f"{file} holds no LoRA weights")
    _check_targets(pairs, targeted, file)
    ranks = {key: options.rank(projection_module(*key)) for key in pairs}
    width, scaling = max(ranks.values()), options.scaling()
    weights = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{file}: layer {layer} {proj} has lora_{''.join(ab)} but not both A and B")
        module, r = projection_module(layer, proj), ranks[(layer, proj)]
        d_in, d_out = model_config.projection_shape(proj)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, d_in) or tuple(b.shape) != (d_out, r):
            source = f"'{options.rank_source(module)}'"
            raise AdapterError(
                f"{file}: layer {layer} {proj} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {r} ({source} in adapter_config.json) on this model needs ({r}, {d_in}) and ({d_out}, {r})"
            )
        a, b = a.T, b.T
        ratio = options.scaling(module) / scaling
        if ratio != 1.0:
            b = (b.float() * ratio).to(b.dtype)
        if r < width:
            a = torch.nn.functional.pad(a, (0, width - r))
            b = torch.nn.functional.pad(b, (0, 0, 0, width - r))
        weights[(layer, proj)] = (a.contiguous(), b.contiguous())
    targets = frozenset(proj for _, proj in weights)
    return LoRAAdapter(
        name or folder.name, width, options.lora_alpha, scaling, targets, weights, str(folder), ranks
    )
