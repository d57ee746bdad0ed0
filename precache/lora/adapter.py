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
from precache.lora.peft_config import parse_options, read_config, targeted_projections
from precache.lora.targets import PROJECTIONS, LoraOptions, ModelShape, projection_module

logger = logging.getLogger(__name__)

__all__ = ["PROJECTIONS", "LoRAAdapter", "load_adapter"]

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.(weight|bias)$")
#: a LoRA B bias on k / v would need a bias term in every split cache view: not implemented
_NO_LORA_BIAS = ("k_proj", "v_proj")


@dataclass
class LoRAAdapter:
    """One loaded adapter. ``weights[(layer, proj)] = (A [d_in, rank], B [rank, d_out])``.

    ``rank`` is the LR width (the largest module rank; lower-rank modules are zero-padded to it),
    ``scaling`` the one scaling ``s`` applied to every module (per-module scalings are folded into
    ``B``), ``ranks[(layer, proj)]`` each module's own rank as PEFT has it, ``biases[(layer, proj)]``
    the LoRA B bias ``b`` ``[d_out]`` of ``lora_bias`` adapters (never on k_proj / v_proj), which
    :meth:`delta` adds as ``s b``.
    """

    name: str
    rank: int
    alpha: float
    scaling: float
    targets: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    path: str = ""
    ranks: dict[tuple[int, str], int] = field(default_factory=dict, repr=False)
    biases: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, repr=False)
    _up_stacks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def has(self, layer: int, proj: str) -> bool:
        return (layer, proj) in self.weights

    def down(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """LR projection ``x A``: ``[n, d_in] -> [n, rank]``."""
        return x @ self.weights[(layer, proj)][0]

    def up(self, z: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """Scaled up-projection ``s z B``: ``[n, rank] -> [n, d_out]``."""
        return (z @ self.weights[(layer, proj)][1]) * self.scaling

    def delta(self, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """``s ((x A) B + b)``: ``[n, d_in] -> [n, d_out]`` (``b`` = 0 without ``lora_bias``)."""
        out = self.up(self.down(x, layer, proj), layer, proj)
        bias = self.biases.get((layer, proj))
        return out if bias is None else out + bias * self.scaling

    def nbytes(self) -> int:
        tensors = [t for ab in self.weights.values() for t in ab] + list(self.biases.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def up_stack(self, proj: str, num_layers: int, num_kv_heads: int) -> torch.Tensor:
        """``s B`` of ``proj`` at every layer, by KV head: ``[num_layers, num_kv_heads, rank, head_dim]``
        (zeros at layers without a LoRA on ``proj``), what a fused attention kernel adds to the
        base keys or values (``Vb + s (P Lv) B``; DESIGN.md, Notation). Built once per adapter."""
        key = (proj, num_layers, num_kv_heads)
        if key not in self._up_stacks:
            a, b = next(iter(self.weights.values()))
            d_out = next((w[1].shape[1] for (_, p), w in self.weights.items() if p == proj), num_kv_heads)
            out = torch.zeros(num_layers, self.rank, d_out, dtype=b.dtype, device=b.device)
            for layer in range(num_layers):
                if self.has(layer, proj):
                    out[layer] = self.weights[(layer, proj)][1] * self.scaling
            head_dim = d_out // num_kv_heads
            self._up_stacks[key] = out.view(num_layers, self.rank, num_kv_heads, head_dim).transpose(1, 2)
        return self._up_stacks[key]

    def to(self, dtype: torch.dtype, device=None) -> LoRAAdapter:
        weights = {
            k: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for k, (a, b) in self.weights.items()
        }
        biases = {k: b.to(device=device, dtype=dtype) for k, b in self.biases.items()}
        return LoRAAdapter(
            self.name,
            self.rank,
            self.alpha,
            self.scaling,
            self.targets,
            weights,
            self.path,
            self.ranks,
            biases,
        )


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise AdapterError(f"{file} is missing (only safetensors adapters are supported)")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise AdapterError(f"{file} is not a readable safetensors file: {exc}") from exc
    # half-precision weights are read as fp32, as PEFT's autocast_adapter_dtype does; the engine
    # then casts every adapter to the model's dtype
    return {k: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for k, t in tensors.items()}


def _check_base_model(cfg: dict, folder: Path, model_config: ModelShape) -> None:
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
    tensors: dict[str, torch.Tensor], file: Path, options: LoraOptions, model_config: ModelShape
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise _refuse_tensor(file, key, options)
        layer, proj, which = int(m.group(1)), m.group(2), m.group(3)
        if m.group(4) == "bias":
            _check_lora_bias(file, key, which, proj, options)
            which = "bias"
        if proj not in PROJECTIONS:
            raise AdapterError(f"{file}: tensor '{key}' targets '{proj}', not one of {PROJECTIONS}")
        if layer >= model_config.num_layers:
            raise AdapterError(
                f"{file}: tensor '{key}' names layer {layer}, the model has {model_config.num_layers}"
            )
        pairs.setdefault((layer, proj), {})[which] = tensor
    return pairs


def _check_lora_bias(file: Path, key: str, which: str, proj: str, options: LoraOptions) -> None:
    if which == "A" or not options.lora_bias:
        raise AdapterError(
            f"{file}: tensor '{key}' is a LoRA bias, but adapter_config.json has lora_bias false (PEFT would "
            "not load it)"
        )
    if proj in _NO_LORA_BIAS:
        raise AdapterError(
            f"{file}: field 'lora_bias' = True is not supported on {proj} (tensor '{key}'): the sharing "
            "methods split K/V into base + LR parts with no place for an adapter bias; supported: lora_bias "
            "on q_proj, o_proj, gate_proj, up_proj, down_proj"
        )


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


def load_adapter(path: str | Path, model_config: ModelShape, name: str | None = None) -> LoRAAdapter:
    """Load a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``)
    for the base model whose architecture is ``model_config`` (its ``model.config``).

    Weights stored in fp16 or bf16 are returned in fp32 (PEFT's ``autocast_adapter_dtype``);
    :class:`~precache.engine.Engine` casts each adapter to the model's dtype.

    Raises:
        AdapterError: missing or malformed file, an option we do not honour (DoRA, lora_bias on
            k_proj / v_proj, modules_to_save, LoRA on embed_tokens / lm_head, ...: :mod:`precache.lora.peft_config`),
            bias tensors, weights for modules the config does not target (or none for one it does),
            or weights whose shapes do not fit ``model_config`` and the module's rank, or non-finite
            weights (NaN, inf). The message names the file and the field.
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
    weights, biases = {}, {}
    for (layer, proj), tensors in sorted(pairs.items()):
        for kind, tensor in tensors.items():  # a NaN or inf weight would poison every shared cache entry
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise AdapterError(
                    f"{file}: layer {layer} {proj} lora_{kind} has non-finite values (NaN or inf)"
                )
        ratio = options.scaling(projection_module(layer, proj)) / scaling
        a, b = _module_weights(tensors, layer, proj, options, model_config, file)
        weights[(layer, proj)] = (_pad_rank(a, width, dim=1), _pad_rank(_rescale(b, ratio), width, dim=0))
        if "bias" in tensors:
            biases[(layer, proj)] = _rescale(tensors["bias"], ratio)
    targets = frozenset(proj for _, proj in weights)
    name = name or folder.name
    return LoRAAdapter(name, width, options.lora_alpha, scaling, targets, weights, str(folder), ranks, biases)


def _module_weights(
    tensors: dict[str, torch.Tensor],
    layer: int,
    proj: str,
    options: LoraOptions,
    model_config: ModelShape,
    file: Path,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [d_in, r], B [r, d_out])`` of one module, checked against its rank and the model."""
    module = projection_module(layer, proj)
    if not {"A", "B"} <= tensors.keys():
        raise AdapterError(
            f"{file}: layer {layer} {proj} has lora_{''.join(k for k in tensors if k in ('A', 'B'))} but not both A and B"
        )
    if options.lora_bias and "bias" not in tensors:
        raise AdapterError(
            f"{file}: layer {layer} {proj} has no lora_B bias, but adapter_config.json has lora_bias"
        )
    r, (d_in, d_out) = options.rank(module), model_config.projection_shape(proj)
    a, b = tensors["A"], tensors["B"]
    if tuple(a.shape) != (r, d_in) or tuple(b.shape) != (d_out, r):
        raise AdapterError(
            f"{file}: layer {layer} {proj} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
            f"rank {r} ('{options.rank_source(module)}' in adapter_config.json) on this model needs "
            f"({r}, {d_in}) and ({d_out}, {r})"
        )
    if "bias" in tensors and tuple(tensors["bias"].shape) != (d_out,):
        raise AdapterError(
            f"{file}: layer {layer} {proj} has a lora_B bias of shape {tuple(tensors['bias'].shape)}, not ({d_out},)"
        )
    return a.T, b.T


def _rescale(t: torch.Tensor, ratio: float) -> torch.Tensor:
    """``ratio * t`` (a module's scaling over the adapter's), computed in fp32."""
    return t if ratio == 1.0 else (t.float() * ratio).to(t.dtype)


def _pad_rank(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad the rank dimension ``dim`` of ``A [d_in, r]`` (1) or ``B [r, d_out]`` (0) to ``width``."""
    pad = (0, width - t.shape[1]) if dim == 1 else (0, 0, 0, width - t.shape[0])
    return torch.nn.functional.pad(t, pad).contiguous()
