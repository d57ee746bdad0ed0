"""PEFT LoRA adapters: loading, validation and the low-rank maths.

For projection p of layer l, an adapter holds ``A`` ``[d_in, r]`` and ``B`` ``[r, d_out]`` (PEFT
stores their transposes: ``lora_A.weight`` ``[r, d_in]``, ``lora_B.weight`` ``[d_out, r]``) and
applies ``y = x W + s (x A) B`` with ``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA
(Hu et al. 2021, eq. 3; Kalajdzievski 2023).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from precache.errors import AdapterError
from precache.models.config import ModelConfig

logger = logging.getLogger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
#: adapter_config.json options we refuse when set to anything but these neutral values
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
}


@dataclass
class LoRAAdapter:
    """One loaded adapter. ``weights[(layer, proj)] = (A [d_in, r], B [r, d_out])``."""

    name: str
    rank: int
    alpha: float
    scaling: float
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    path: str = ""

    def has(self, layer: int, proj: str) -> bool:
        return (layer, proj) in self.weights

    def down(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """LR projection ``x A``: ``[n, d_in] -> [n, r]``."""
        return x @ self.weights[(layer, proj)][0]

    def up(self, z: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """Scaled up-projection ``s z B``: ``[n, r] -> [n, d_out]``."""
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
        return LoRAAdapter(self.name, self.rank, self.alpha, self.scaling, self.targets, weights, self.path)


def _read_config(folder: Path) -> dict:
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{cfg_file} is missing: not a PEFT adapter folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{cfg_file}: field 'peft_type' is {cfg['peft_type']!r}; only LORA is supported")
    for key, neutral in _UNSUPPORTED.items():
        value = cfg.get(key, neutral)
        if value != neutral and not (neutral is None and not value):
            raise AdapterError(f"{cfg_file}: field '{key}' = {value!r} is not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), int | float) or cfg[key] <= 0:
            raise AdapterError(f"{cfg_file}: field '{key}' must be a positive number, got {cfg.get(key)!r}")
    return cfg


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


def load_adapter(path: str | Path, model_config: ModelConfig, name: str | None = None) -> LoRAAdapter:
    """Load a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises:
        AdapterError: missing or malformed file, an unsupported option (DoRA, bias, rank_pattern,
            modules_to_save, ...), a target outside the seven Llama projections, or weights whose
            shapes do not fit ``model_config``. The message names the file and the field.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {folder} does not exist")
    cfg = _read_config(folder)
    _check_base_model(cfg, folder, model_config)
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _read_weights(folder)
    file = folder / "adapter_model.safetensors"
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"{file}: tensor '{key}' is not a LoRA A/B weight of a Llama projection")
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS:
            raise AdapterError(f"{file}: tensor '{key}' targets '{proj}', not one of {PROJECTIONS}")
        if layer >= model_config.num_layers:
            raise AdapterError(
                f"{file}: tensor '{key}' names layer {layer}, the model has {model_config.num_layers}"
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    weights = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{file}: layer {layer} {proj} has lora_{''.join(ab)} but not both A and B")
        d_in, d_out = model_config.projection_shape(proj)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, d_in) or tuple(b.shape) != (d_out, rank):
            raise AdapterError(
                f"{file}: layer {layer} {proj} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"rank {rank} ('r' in adapter_config.json) on this model needs ({rank}, {d_in}) and ({d_out}, {rank})"
            )
        weights[(layer, proj)] = (a.T.contiguous(), b.T.contiguous())
    if not weights:
        raise AdapterError(f"{file} holds no LoRA weights")
    targets = frozenset(proj for _, proj in weights)
    return LoRAAdapter(name or folder.name, rank, alpha, scaling, targets, weights, str(folder))
