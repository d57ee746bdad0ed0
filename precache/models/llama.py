"""Our own Llama-family forward (Llama, Mistral, Qwen2, Qwen3) over a flattened, mixed-adapter batch.

The model owns no cache. Each layer hands its attention input to a :class:`LayerAttention`
(a sharing method's cache plan, or :class:`DenseAttention` for a cache-free pass), which decides
which cache entries to write from which hidden states and which view each row attends to
(DESIGN.md, "The sharing methods"). Adding a sharing method therefore never touches this file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from precache.errors import ContextLengthError, ModelLoadError
from precache.models.config import MODEL_REGISTRY, ModelConfig
from precache.models.contract import LayerAttention, LayerInput, Row
from precache.models.quant import QUANTIZED_WEIGHTS, check_quantizable, check_quantization, quantize_weight
from precache.models.rope import RotaryEmbedding, static_position_limit

if TYPE_CHECKING:
    from precache.lora.adapter import LoRAAdapter

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in fp32 like HF Llama: ``[..., d] -> [..., d]``."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


#: rows up to which :func:`linear` splits a CPU product over the threads: decode steps and small
#: batches (a 3,000-token prefill measured 5-8% slower split, where MKL's own matrix product
#: already runs on every thread)
SPLIT_LINEAR_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` (``x`` ``[N, d_in]``, ``weight`` ``[d_out, d_in]`` -> ``[N, d_out]``), split over
    the torch threads on a CPU at fp32.

    MKL runs a matrix-vector product (decode: a few rows) on one thread, so a decode step streamed
    its weights at one core's bandwidth (12 GB/s here, benchmarks/RESULTS.md "Issue 22"). Viewing
    ``weight`` as ``T`` slices of ``d_out / T`` output rows (no copy) and multiplying them as one
    batched product spreads the slices over the ``T`` threads; each output is the same dot product
    over ``d_in``, equal to ``F.linear``'s up to float rounding (relative error below 1e-6,
    ``tests/test_forward.py``). Other devices, dtypes (bf16 already runs on every thread),
    and more than :data:`SPLIT_LINEAR_MAX_ROWS` rows keep ``F.linear``. An
    :class:`~precache.models.quant.Int8Weight` or ``Int4Weight`` runs its own kernel.
    """
    if isinstance(weight, QUANTIZED_WEIGHTS):  # int8 / int4 weight-only (precache.models.quant)
        y = weight.matmul(x)
        return y if bias is None else y.add_(bias)
    parts = torch.get_num_threads()
    n_out = weight.shape[0]
    if (
        parts < 2
        or x.dim() != 2
        or x.shape[0] > SPLIT_LINEAR_MAX_ROWS
        or n_out % parts
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return F.linear(x, weight, bias)
    return split_product(x, weight, bias, parts)


def split_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int
) -> torch.Tensor:
    """``x Wᵀ (+ bias)`` as one batched product over ``parts`` slices of ``weight``'s output rows
    (``weight.shape[0]`` divisible by ``parts``): :func:`linear`'s CPU path, and the products of
    the compiled decode step (:mod:`precache.models.step_graph`)."""
    n, d_in = x.shape
    n_out = weight.shape[0]
    y = torch.bmm(
        x.unsqueeze(0).expand(parts, n, d_in), weight.view(parts, n_out // parts, d_in).transpose(1, 2)
    )
    y = y.transpose(0, 1).reshape(n, n_out)
    return y if bias is None else y.add_(bias)


@dataclass(frozen=True)
class AdapterGroups:
    """A forward's rows grouped by adapter, built once per forward (:func:`adapter_groups`):
    ``groups`` holds ``(adapter, tokens)`` per distinct adapter, ``tokens`` a slice when its rows
    are adjacent in the batch, else an index tensor ``[n]`` on the batch's device."""

    groups: tuple[tuple[LoRAAdapter, slice | torch.Tensor], ...]


def adapter_groups(rows: list[Row], device) -> AdapterGroups:
    """Group ``rows`` by adapter (base rows, ``adapter=None``, get no group)."""
    by_adapter: dict[int, tuple[LoRAAdapter, list[Row]]] = {}
    for row in rows:
        if row.adapter is not None and row.end > row.start:
            by_adapter.setdefault(id(row.adapter), (row.adapter, []))[1].append(row)
    groups = []
    for adapter, members in by_adapter.values():
        if all(a.end == b.start for a, b in zip(members, members[1:], strict=False)):
            groups.append((adapter, slice(members[0].start, members[-1].end)))
        else:
            idx = torch.cat([torch.arange(r.start, r.end) for r in members]).to(device)
            groups.append((adapter, idx))
    return AdapterGroups(tuple(groups))


def add_lora(y: torch.Tensor, x: torch.Tensor, rows: AdapterGroups, layer: int, proj: str) -> torch.Tensor:
    """Add each row's LoRA delta ``s (x A) B`` to ``y`` in place, one product pair per adapter over
    all its rows (a decode step of 16 rows ran 16 pairs per projection, issue 22). ``x``
    ``[N, d_in]``, ``y`` ``[N, d_out]``."""
    for adapter, tokens in rows.groups:
        if not adapter.has(layer, proj):
            continue
        if isinstance(tokens, slice):
            y[tokens] += adapter.delta(x[tokens], layer, proj)
        else:
            y.index_add_(0, tokens, adapter.delta(x.index_select(0, tokens), layer, proj))
    return y


def _cat_bias(*biases: torch.Tensor | None, sizes: list[int], like: torch.Tensor) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else like.new_zeros(n) for b, n in zip(biases, sizes, strict=True)])


def _max_context(hf_config, config: ModelConfig, max_context: int | None) -> int:
    limit = static_position_limit(hf_config)
    if limit is None:
        return max_context or config.max_position_embeddings
    rope_type = hf_config.rope_parameters["rope_type"]
    if max_context is not None and max_context > limit:
        raise ModelLoadError(
            f"max_context={max_context} is past {limit}, where '{rope_type}' RoPE recomputes its "
            f"frequencies from the sequence length (rope_parameters.rope_type): keys in a KV cache "
            f"cannot follow; use max_context <= {limit}"
        )
    context = min(max_context or config.max_position_embeddings, limit)
    if context < (max_context or config.max_position_embeddings):
        logger.info("context capped at %d tokens: '%s' RoPE is static only up to there", context, rope_type)
    return context


class LlamaModel:
    """Weights plus forward. Built by :func:`precache.load_model` from an HF state dict.

    q/k/v and gate/up weights are concatenated once, so a layer runs four matmuls instead of
    seven (decode on a CPU is dominated by per-op overhead). ``max_context`` (default
    ``max_position_embeddings``) sizes the RoPE tables; RoPE extends past the trained length as
    it does in HF, with the quality loss that implies. With ``dynamic`` or ``longrope`` RoPE the
    context stops where HF's frequencies stop being static (:func:`static_position_limit`).

    Raises:
        ModelLoadError: ``max_context`` is past the static range of a dynamic / longrope RoPE.

    Attributes: ``config`` (:class:`ModelConfig`), ``hf_config``, ``tokenizer``, ``rope``,
    ``dtype`` (the compute dtype), ``quantization`` (None, or ``"int8"``: :meth:`quantize`), ``device``, ``path`` (checkpoint folder), ``max_context`` (tokens),
    ``generation_config`` (``transformers.GenerationConfig`` or None: its ``eos_token_id`` s stop
    turns).
    """

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
        self.max_context = _max_context(hf_config, config, max_context)
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
            "qkv_bias": _cat_bias(
                *(attn[x][1] for x in ("q_proj", "k_proj", "v_proj")), sizes=sizes, like=wq
            ),
            "o_proj": attn["o_proj"][0],
            "o_proj_bias": attn["o_proj"][1],
            "gate_up": torch.cat([state[f"{p}mlp.gate_proj.weight"], state[f"{p}mlp.up_proj.weight"]]),
            "gate_up_bias": _cat_bias(
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
        from precache.models.step_graph import DecodeGraph, check_compile  # it imports this module

        check_compile(str(self.device))
        self.decode_graph = DecodeGraph(self, compiled)

    def finish_kv(self, layer: int, k_lin, v_lin, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K after k-norm and RoPE, V)`` ``[n, n_kv_heads, head_dim]`` from linear projections."""
        c, w = self.config, self.layers[layer]
        k = k_lin.reshape(-1, c.num_kv_heads, c.head_dim)
        if w["k_norm"] is not None:
            k = rms_norm(k, w["k_norm"], c.rms_norm_eps)
        return RotaryEmbedding.apply(k, cos, sin), v_lin.reshape(-1, c.num_kv_heads, c.head_dim)

    def project_kv(self, layer: int, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Adapter-free ``(K after RoPE, V)`` ``[n, n_kv_heads, head_dim]`` of attention inputs ``h`` ``[n, hidden]``."""
        c, w = self.config, self.layers[layer]
        _, k_lin, v_lin = linear(h, w["qkv"], w["qkv_bias"]).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        return self.finish_kv(layer, k_lin, v_lin, cos, sin)

    def _attention_input(self, x, i, groups, cos, sin) -> LayerInput:
        c, w = self.config, self.layers[i]
        h = rms_norm(x, w["input_norm"], c.rms_norm_eps)
        qkv = linear(h, w["qkv"], w["qkv_bias"])  # [N, q + 2 kv]
        q_lin, k_lin, v_lin = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
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


class DenseAttention:
    """Cache-free causal self-attention of each row over its own adapted K/V.

    The reference full-sequence forward: no cache is read or written. A layer with a sliding
    window (``config.window(layer)``) masks key positions ``p <= t - window`` for query ``t``.
    """

    def __init__(self, rows: list[Row]):
        self.rows = rows

    def attend(self, x: LayerInput) -> torch.Tensor:
        out = torch.empty(x.q.shape[0], x.q.shape[1] * x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        window = x.model.config.window(x.layer)
        for row in self.rows:
            k, v = x.adapted_kv(row.slice, row.adapter)
            q = x.q[row.slice].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
            n = row.end - row.start
            mask = None
            if window is not None and n > window:
                pos = torch.arange(n, device=q.device)
                delta = pos[:, None] - pos[None, :]  # query minus key position
                mask = (delta >= 0) & (delta < window)  # [n, n]
            o = F.scaled_dot_product_attention(
                q,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            out[row.slice] = o[0].transpose(0, 1).reshape(n, -1)
        return out


def dense_logits(
    model: LlamaModel, sequences: list[list[int]], adapters: list | None = None
) -> list[torch.Tensor]:
    """Logits ``[len(seq), vocab]`` of every position of each sequence, all run as one mixed batch.

    ``adapters[i]`` is sequence i's adapter (None: base model). Positions start at 0 in each row.
    """
    adapters = adapters or [None] * len(sequences)
    rows, start = [], 0
    for seq, adapter in zip(sequences, adapters, strict=True):
        rows.append(Row(start, start + len(seq), adapter))
        start += len(seq)
    ids = torch.tensor([t for seq in sequences for t in seq], device=model.device)
    positions = torch.cat([torch.arange(len(seq), device=model.device) for seq in sequences])
    logits = model.forward(ids, positions, rows, DenseAttention(rows), logits_at=list(range(start)))
    return [logits[row.slice] for row in rows]


# the HF families this forward implements (their differences are ModelConfig fields)
MODEL_REGISTRY.register("llama", LlamaModel)
MODEL_REGISTRY.register("mistral", LlamaModel)
MODEL_REGISTRY.register("qwen2", LlamaModel)
MODEL_REGISTRY.register("qwen3", LlamaModel)
