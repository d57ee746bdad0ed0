"""The Llama family: Llama, Mistral, Qwen2 and Qwen3, one forward over a flattened, mixed-adapter
batch, registered under the four HF ``model_type`` s (:data:`~precache.models.family.MODEL_REGISTRY`).

Their differences are :class:`~precache.models.config.ModelConfig` fields, decided here
(:meth:`LlamaModel.config_fields`): Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm, Llama's
``mlp_bias``, Mistral's sliding window on every layer and Qwen2/Qwen3's per layer. The layers are the
shared ones (:mod:`precache.models.layers`).

The model owns no cache. Each layer hands its attention input to a :class:`LayerAttention`
(a sharing method's cache plan, or :class:`~precache.models.dense.DenseAttention` for a cache-free
pass), which decides which cache entries to write from which hidden states and which view each row
attends to (DESIGN.md, "The sharing methods"). Adding a sharing method therefore never touches
this file.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.activations import ACT2FN

from precache.errors import ContextLengthError
from precache.models.config import ModelConfig, sliding_window, windows_by_layer_type
from precache.models.contract import LayerAttention, LayerInput, Row
from precache.models.family import MODEL_REGISTRY
from precache.models.layers import adapter_groups, add_lora, cat_biases, linear, rms_norm
from precache.models.quant import check_quantizable, check_quantization, quantize_weight
from precache.models.rope import RotaryEmbedding, context_length
from precache.models.step_graph import DecodeGraph, check_compile


class LlamaModel:
    """Weights plus forward. Built by :func:`precache.load_model` from an HF state dict.

    q/k/v and gate/up weights are concatenated once, so a layer runs four matmuls instead of
    seven (decode on a CPU is dominated by per-op overhead). ``max_context`` (default
    ``max_position_embeddings``) sizes the RoPE tables; RoPE extends past the trained length as
    it does in HF, with the quality loss that implies. With ``dynamic`` or ``longrope`` RoPE the
    context stops where HF's frequencies stop being static
    (:func:`~precache.models.rope.static_position_limit`).

    Raises:
        ModelLoadError: ``max_context`` is past the static range of a dynamic / longrope RoPE.

    Attributes: ``config`` (:class:`ModelConfig`), ``hf_config``, ``tokenizer``, ``rope``,
    ``dtype`` (the compute dtype), ``quantization`` (None, ``"int8"`` or ``"int4"``: :meth:`quantize`),
    ``device``, ``path`` (checkpoint folder), ``max_context`` (tokens), ``generation_config`` (``transformers.GenerationConfig`` or None: its ``eos_token_id`` s stop
    turns).
    """

    @classmethod
    def config_fields(cls, hf_config: Any, model_type: str) -> dict[str, Any]:
        """The :class:`ModelConfig` fields that differ between the four families, as transformers'
        modeling code reads them: q/k/v biases (Qwen2 always, Llama / Qwen3 with
        ``attention_bias``), Qwen3's q/k norm, Llama's ``mlp_bias``, and the sliding windows
        (Llama: none; Mistral: ``sliding_window`` on every layer, its modeling ignores
        ``layer_types``; Qwen2 / Qwen3: by ``layer_types``).

        Raises:
            ModelLoadError: a bad ``sliding_window`` or ``layer_types``
                (:func:`~precache.models.config.windows_by_layer_type`).
        """
        n = hf_config.num_hidden_layers
        if model_type == "llama":
            windows: tuple[int | None, ...] = (None,) * n
        elif model_type == "mistral":
            windows = (sliding_window(hf_config),) * n
        else:
            windows = windows_by_layer_type(hf_config)
        return {
            "attention_bias": model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            "qk_norm": model_type == "qwen3",
            "mlp_bias": model_type == "llama" and bool(getattr(hf_config, "mlp_bias", False)),
            "layer_windows": windows,
        }

    def __init__(
        self,
        config: ModelConfig,
        hf_config,
        state: dict[str, torch.Tensor],
        tokenizer=None,
        path="",
        max_context: int | None = None,
    ):
        self.config, self.hf_config, self.tokenizer, self.path = config, hf_config, tokenizer, str(path)
        self.generation_config = None  # set by model_from_hf
        self.embed = state["model.embed_tokens.weight"]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.norm = state["model.norm.weight"]
        self.lm_head = (
            state.get("lm_head.weight", self.embed) if not config.tie_word_embeddings else self.embed
        )
        self.layers = [self._layer_weights(state, i) for i in range(config.num_layers)]
        self.max_context = context_length(hf_config, config.max_position_embeddings, max_context)
        self.act = ACT2FN[config.hidden_act]
        self.rope = RotaryEmbedding(hf_config, config.head_dim, self.max_context, self.dtype, self.device)
        self.quantization: str | None = None  # "int8" / "int4" after quantize()
        self.decode_graph = None  # precache.models.step_graph.DecodeGraph after compile()
        #: engines' default block-pool dtype (None: ``dtype``; precache.models.quant.resolve_kv_cache_dtype)
        self.kv_cache_dtype: str | torch.dtype | None = None

    def _layer_weights(self, state: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        p, c = f"model.layers.{i}.", self.config
        get = state.get
        attn = {
            proj: (state[f"{p}self_attn.{proj}.weight"], get(f"{p}self_attn.{proj}.bias"))
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        sizes, inter = [c.q_size, c.kv_size, c.kv_size], c.intermediate_size
        wq, wk, wv = (attn[x][0] for x in ("q_proj", "k_proj", "v_proj"))
        return {
            "input_norm": state[p + "input_layernorm.weight"],
            "post_norm": state[p + "post_attention_layernorm.weight"],
            "q_norm": get(p + "self_attn.q_norm.weight"),
            "k_norm": get(p + "self_attn.k_norm.weight"),
            "qkv": torch.cat([wq, wk, wv]),
            "qkv_bias": cat_biases(
                *(attn[x][1] for x in ("q_proj", "k_proj", "v_proj")), sizes=sizes, like=wq
            ),
            "o_proj": attn["o_proj"][0],
            "o_proj_bias": attn["o_proj"][1],
            "gate_up": torch.cat([state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]]),
            "gate_up_bias": cat_biases(
                get(f"{p}mlp.gate_proj.bias"), get(f"{p}mlp.up_proj.bias"), sizes=[inter, inter], like=wq
            ),
            "down_proj": state[f"{p}mlp.down_proj.weight"],
            "down_proj_bias": get(f"{p}mlp.down_proj.bias"),
        }

    #: the weight matrices :meth:`quantize` stores at lower precision (norms, biases and the
    #: embedding lookup stay at the compute dtype)
    QUANTIZED = ("qkv", "o_proj", "gate_up", "down_proj")

    def quantize(self, quantization: str) -> None:
        """Hold every projection and the LM head as ``quantization`` (``"int8"``: int8 weight-only;
        ``"int4"``: the projections int4 weight-only in groups and the LM head int8;
        :mod:`precache.models.quant`); the embedding lookup, norms, biases, LoRA adapters and the
        KV caches stay at ``self.dtype``. A tied LM head gets a quantized copy of the embedding.

        Raises:
            ValueError: an unknown ``quantization``, the weights are not on the CPU, the model is
                already quantized otherwise, or (int4) a weight's ``d_in`` is not a multiple of
                the group size.
        """
        check_quantization(quantization, str(self.device))
        if self.quantization not in (None, quantization):
            raise ValueError(f"the model is already quantized as {self.quantization}, not {quantization}")
        if self.quantization == quantization:
            return
        weights = [
            (f"layers.{i}.{name}", w, name) for i, w in enumerate(self.layers) for name in self.QUANTIZED
        ]
        check_quantizable([(label, w[name].shape) for label, w, name in weights], quantization)
        for _, w, name in weights:
            w[name] = quantize_weight(w[name], quantization)
        self.lm_head = quantize_weight(self.lm_head, quantization, lm_head=True)
        self.quantization = quantization

    def compile(self, compiled: bool = True) -> None:
        """Run decode steps as one captured graph (:mod:`precache.models.step_graph`): the engine's
        one-token batches then run through :attr:`decode_graph`, compiled by inductor at each new
        LoRA layout's first step (``compiled=False``: the same step traced eagerly, for tests).

        Raises:
            ValueError: the model is not on the CPU.
        """
        check_compile(str(self.device))
        self.decode_graph = DecodeGraph(self, compiled)

    def finish_kv(self, layer: int, k_lin, v_lin, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K after k-norm and RoPE, V)`` ``[n, n_kv_heads, head_dim]`` from linear projections."""
        c, w = self.config, self.layers[layer]
        k = k_lin.reshape(-1, c.num_kv_heads, c.head_dim)
        if w["k_norm"] is not None:
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
        return RotaryEmbedding.apply(k, cos, sin), v_lin.reshape(-1, c.num_kv_heads, c.head_dim)

    def qkv(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adapter-free linear projections ``h W (+ b)`` of attention inputs ``h`` ``[n, hidden]``
        at ``layer``, from the fused q/k/v weight: ``q_lin`` ``[n, n_heads * head_dim]``,
        ``k_lin`` / ``v_lin`` ``[n, n_kv_heads * head_dim]`` (:meth:`finish_kv` turns the last
        two into cache entries)."""
        c, w = self.config, self.layers[layer]
        return linear(h, w["qkv"], w["qkv_bias"]).split([c.q_size, c.kv_size, c.kv_size], dim=-1)

    def _attention_input(self, x, i, groups, cos, sin) -> LayerInput:
        c, w = self.config, self.layers[i]
        h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
        q_lin, k_lin, v_lin = self.qkv(i, h)  # [N, q], [N, kv], [N, kv]
        q = add_lora(q_lin, h, groups, i, "q_proj").view(-1, c.num_heads, c.head_dim)
        if w["q_norm"] is not None:
            q = rms_norm(q, w["q_norm"], c.rms_norm_eps)
        return LayerInput(i, h, RotaryEmbedding.apply(q, cos, sin), cos, sin, self, k_lin, v_lin)

    def _mlp(self, x, i, groups) -> torch.Tensor:
        c, w = self.config, self.layers[i]
        h = rms_norm(x, w["post_norm"], c.rms_norm_eps)
        gate_up = linear(h, w["gate_up"], w["gate_up_bias"])
        gate, up = gate_up.split([c.intermediate_size, c.intermediate_size], dim=-1)
        gated = self.act(add_lora(gate, h, groups, i, "gate_proj")) * add_lora(up, h, groups, i, "up_proj")
        return add_lora(linear(gated, w["down_proj"], w["down_proj_bias"]), gated, groups, i, "down_proj")

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: list[Row],
        attention: LayerAttention,
        logits_at: list[int] | None = None,
    ) -> torch.Tensor:
        """Run the flattened batch and return logits ``[len(logits_at), vocab]`` (fp32).

        ``input_ids`` and ``positions`` are ``[N]``; ``rows`` cut them into sequences, each with its
        own adapter. ``logits_at`` indexes the tokens whose next-token logits are wanted (default:
        the last token of each row). When ``attention`` narrows the batch at a layer boundary
        (:class:`~precache.models.contract.Narrowing`), only the kept tokens run the later layers;
        ``logits_at`` then indexes the narrowed batch (a narrowing never moves a wanted token).

        Raises:
            ContextLengthError: a position is past ``max_context`` (checked when ``positions`` is on
                the host).
        """
        c = self.config
        # checked for host positions only: reading a device tensor's maximum would sync every
        # forward (cache.plan.run_plans checks its batches on the host before the copy)
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.max_context:
            raise ContextLengthError(
                f"position {int(positions.max())} is past the context length {self.max_context}"
            )
        x = self.embed[input_ids]  # [N, hidden]
        cos, sin = self.rope.tables(positions)
        narrow = getattr(attention, "narrow", None)  # selective recomputation (contract.Narrowing)
        groups = adapter_groups(rows, x.device)
        for i, w in enumerate(self.layers):
            attn = attention.attend(self._attention_input(x, i, groups, cos, sin))  # [N, Hq * D]
            x = x + add_lora(linear(attn, w["o_proj"], w["o_proj_bias"]), attn, groups, i, "o_proj")
            x = x + self._mlp(x, i, groups)
            cut = narrow(i) if narrow is not None else None
            if cut is not None:
                x, cos, sin, rows = x[cut.keep], cos[cut.keep], sin[cut.keep], cut.rows
                groups = adapter_groups(rows, x.device)
        if logits_at is None:
            logits_at = [row.end - 1 for row in rows]
        last = rms_norm(x[logits_at], self.norm, c.rms_norm_eps)
        return linear(last, self.lm_head).float()


# the HF families this forward implements (their differences are ModelConfig fields: config_fields)
for _model_type in ("llama", "mistral", "qwen2", "qwen3"):
    MODEL_REGISTRY.register(_model_type, LlamaModel)
