"""``adapter_config.json`` of a PEFT LoRA adapter: every ``LoraConfig`` field honoured or refused.

Each field of ``peft.LoraConfig`` (peft 0.21) is decided here; a field set to ``null`` reads as
PEFT's default (PEFT itself fails on a null ``r``, ``lora_alpha``, ``rank_pattern``,
``alpha_pattern`` or ``bias``; we refuse a null ``r`` / ``lora_alpha`` and read the others as
their defaults, which is what they mean).

Honoured exactly as PEFT applies them (``peft/tuners/lora``, ``peft/tuners/tuners_utils.py``):
  ``r``, ``lora_alpha``, ``use_rslora`` (scaling ``alpha / r`` or ``alpha / sqrt(r)``),
  ``rank_pattern`` / ``alpha_pattern`` (per-module rank and alpha: the first key, in file order,
  that matches the module name as the regex ``(.*\\.)?(KEY)$``), ``target_modules`` (a list: a
  module name or a ``.NAME`` suffix; a string: a regex over the whole module name; ``all-linear``:
  the seven projections; ``null``: PEFT's default for Llama-family models, ``q_proj`` and
  ``v_proj``), ``exclude_modules`` (same rules), ``layers_to_transform`` / ``layers_pattern``
  (LoRA only on the listed layer indices), ``bias`` (``"none"``; ``"all"`` / ``"lora_only"`` only
  mark base biases trainable, so they are accepted when the adapter file holds no bias tensor:
  see :mod:`precache.lora.adapter`), ``lora_bias`` (a bias ``b`` on LoRA B, added as ``s b``) on
  q_proj, o_proj and the MLP (refused on k_proj / v_proj, whose LoRA part the sharing methods keep
  as an LR cache with no place for a bias), ``fan_in_fan_out`` (PEFT resets it to false on
  ``nn.Linear`` layers, as every Llama projection is).
Accepted, as they do not change the loaded adapter's forward: ``task_type``, ``peft_type``
  (``LORA``), ``auto_mapping``, ``peft_version``, ``base_model_name_or_path`` (a warning when it
  differs from the loaded model), ``revision``, ``inference_mode``, ``lora_dropout`` (identity at
  inference), ``init_lora_weights`` when true, false, ``gaussian``, ``eva``, ``orthogonal``,
  ``mica`` or ``lora_ga`` (initialisation only: the saved weights replace it), ``loftq_config``,
  ``eva_config``, ``corda_config``, ``lora_ga_config`` (initialisation only), ``megatron_core``
  (names a module, used only with ``megatron_config``), ``qalora_group_size`` (used only with
  ``use_qalora``), ``ensure_weight_tying`` (acts only on embedding targets, which are refused),
  ``runtime_config`` (never saved).
Refused by name: ``init_lora_weights`` = ``pissa*`` / ``olora`` / ``corda`` / ``loftq`` (PEFT
  recomputes them when loading and rewrites the base weights; save the adapter with
  ``path_initial_model_for_weight_conversion`` to get a plain LoRA), ``use_dora``,
  ``modules_to_save``, ``trainable_token_indices``, ``target_parameters``, ``layer_replication``,
  ``megatron_config``, ``use_qalora``, ``alora_invocation_tokens``, ``velora_config``,
  ``kasa_config``, ``monteclora_config``, ``use_bdlora``, ``arrow_config``; LoRA on
  ``embed_tokens``, ``lm_head`` or any module but the seven projections (``target_modules``); and
  any field peft 0.21 does not know, unless it is null, false or empty.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from precache.errors import AdapterError
from precache.lora.targets import PROJECTIONS, LoraOptions, ModelShape, module_names, projection_module

#: PEFT's default ``target_modules`` for llama, mistral, qwen2 and qwen3
#: (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``)
DEFAULT_TARGETS = ("q_proj", "v_proj")
SUPPORTED = "plain LoRA (lora_A / lora_B) on " + ", ".join(PROJECTIONS)

#: options that change the forward and that we do not implement: the values that mean "off"
#: (PEFT turns a variant on by truthiness, and a ``*_config`` dict, even ``{}``, builds a config)
REFUSED: dict[str, tuple] = {
    "use_dora": (False,),
    "modules_to_save": ([],),
    "trainable_token_indices": ([], {}),
    "target_parameters": ([],),
    "layer_replication": ([],),
    "megatron_config": ({},),
    "use_qalora": (False,),
    "alora_invocation_tokens": ([],),
    "velora_config": (),
    "kasa_config": (),
    "monteclora_config": (),
    "use_bdlora": (),
    "arrow_config": (),
}
#: fields that do not change the loaded adapter's forward (see the module docstring)
INERT = frozenset(
    {
        "task_type",
        "peft_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "lora_dropout",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_core",
        "qalora_group_size",
        "ensure_weight_tying",
        "runtime_config",
        "fan_in_fan_out",
        "init_lora_weights",
    }
)
HONOURED = frozenset(
    {
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "bias",
        "lora_bias",
    }
)
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica", "lora_ga")
_BIAS_VALUES = ("none", "all", "lora_only")


def read_config(folder: Path) -> dict:
    """``adapter_config.json`` of ``folder`` as a dict.

    Raises:
        AdapterError: the file is missing, not JSON, or not a JSON object.
    """
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"{cfg_file} is missing: not a PEFT adapter folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_file} must hold a JSON object")
    return cfg


def _refuse(cfg_file: Path, key: str, value, why: str) -> AdapterError:
    return AdapterError(f"{cfg_file}: field '{key}' = {value!r} is not supported: {why}")


def _check_fields(cfg: dict, cfg_file: Path) -> None:
    peft_type = cfg.get("peft_type") or "LORA"
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{cfg_file}: field 'peft_type' is {peft_type!r}; only LORA is supported")
    for key, off in REFUSED.items():
        value = cfg.get(key)
        if value is not None and not any(type(value) is type(o) and value == o for o in off):
            raise _refuse(cfg_file, key, value, f"precache loads {SUPPORTED}")
    init = cfg.get("init_lora_weights")
    if init is not None and init not in _PLAIN_INITS:
        raise _refuse(
            cfg_file,
            "init_lora_weights",
            init,
            "PEFT re-runs this initialisation when loading and rewrites the base weights; save the "
            "adapter with path_initial_model_for_weight_conversion to get a plain LoRA "
            f"(supported: {', '.join(map(str, _PLAIN_INITS))})",
        )
    bias = cfg.get("bias") or "none"
    if bias not in _BIAS_VALUES:
        raise _refuse(cfg_file, "bias", bias, f"PEFT's values are {', '.join(_BIAS_VALUES)}")
    for key, value in cfg.items():
        known = key in REFUSED or key in INERT or key in HONOURED
        if not known and value not in (None, False, [], {}, ""):
            raise _refuse(cfg_file, key, value, "a LoraConfig option precache does not know (peft 0.21)")


def _positive(cfg_file: Path, key: str, value, integer: bool = False):
    kind = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise AdapterError(f"{cfg_file}: field '{key}' must be {what}, got {value!r}")
    return value


def _pattern(cfg: dict, cfg_file: Path, key: str, integer: bool) -> tuple:
    pattern = cfg.get(key) or {}
    if not isinstance(pattern, dict):
        raise AdapterError(
            f"{cfg_file}: field '{key}' must map module-name patterns to values, got {pattern!r}"
        )
    for name, value in pattern.items():
        _positive(cfg_file, f"{key}[{name!r}]", value, integer)
        try:
            re.compile(name)
        except re.error as exc:
            raise AdapterError(f"{cfg_file}: field '{key}' key {name!r} is not a valid regex: {exc}") from exc
    return tuple(pattern.items())


def _module_spec(cfg: dict, cfg_file: Path, key: str):
    value = cfg.get(key)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return frozenset(value)
    raise AdapterError(f"{cfg_file}: field '{key}' must be a string or a list of strings, got {value!r}")


def parse_options(cfg: dict, cfg_file: Path) -> LoraOptions:
    """Validate every field of ``cfg`` (see the module docstring) and return the LoRA options.

    Raises:
        AdapterError: a refused option, a malformed value, ``r`` or ``lora_alpha`` not positive;
            the message names the field and says what is supported.
    """
    _check_fields(cfg, cfg_file)
    r = _positive(cfg_file, "r", cfg.get("r"), integer=True)
    alpha = float(_positive(cfg_file, "lora_alpha", cfg.get("lora_alpha")))
    targets = _module_spec(cfg, cfg_file, "target_modules")
    if targets is None:
        targets = frozenset(DEFAULT_TARGETS)
    elif isinstance(targets, str) and targets.lower() == "all-linear":
        targets = frozenset(PROJECTIONS)
    layers = cfg.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(isinstance(i, int) for i in layers)):
        raise AdapterError(f"{cfg_file}: field 'layers_to_transform' must be an integer or a list of them")
    layers_pattern = cfg.get("layers_pattern") or None
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]
    if isinstance(targets, str) and (layers is not None or layers_pattern is not None):
        key = "layers_to_transform" if layers is not None else "layers_pattern"
        raise _refuse(cfg_file, key, cfg[key], "PEFT does not allow it with a regex 'target_modules'")
    if layers_pattern and layers is None:
        raise _refuse(cfg_file, "layers_pattern", layers_pattern, "PEFT needs 'layers_to_transform' with it")
    return LoraOptions(
        r=r,
        lora_alpha=alpha,
        use_rslora=bool(cfg.get("use_rslora")),
        target_modules=targets,
        exclude_modules=_module_spec(cfg, cfg_file, "exclude_modules"),
        layers_to_transform=tuple(layers) if layers else None,
        layers_pattern=tuple(layers_pattern) if layers_pattern else None,
        rank_pattern=_pattern(cfg, cfg_file, "rank_pattern", integer=True),
        alpha_pattern=_pattern(cfg, cfg_file, "alpha_pattern", integer=False),
        bias=cfg.get("bias") or "none",
        lora_bias=bool(cfg.get("lora_bias")),
    )


def targeted_projections(options: LoraOptions, config: ModelShape, cfg_file: Path) -> set[tuple[int, str]]:
    """``(layer, proj)`` of every module PEFT would put a LoRA layer on, for this model.

    Raises:
        AdapterError: ``target_modules`` matches a module that is not one of the seven projections
            (``embed_tokens``, ``lm_head``, a norm, ...), or matches nothing.
    """
    targeted = {name for name in module_names(config) if options.targets(name)}
    projections = {projection_module(i, p): (i, p) for i in range(config.num_layers) for p in PROJECTIONS}
    others = sorted(targeted - projections.keys())
    spec = options.target_modules
    shown = spec if isinstance(spec, str) else sorted(spec)
    if others:
        raise _refuse(
            cfg_file,
            "target_modules",
            shown,
            f"it puts LoRA on {others[0]}"
            + (f" and {len(others) - 1} more" if len(others) > 1 else "")
            + f"; precache loads {SUPPORTED}",
        )
    if not targeted:
        raise AdapterError(f"{cfg_file}: field 'target_modules' = {shown!r} matches no module of this model")
    return {projections[name] for name in targeted}
