"""One-token forwards with each layer's dense work compiled, on a CPU (``load_model(...,
compile_decode=True)``, ``--compile-decode``; issue 22).

A single-stream decode step runs one token through 30 layers of small products and about 85
eager operators a layer, each paying torch's per-operator cost (benchmarks/RESULTS.md, "A second
CPU: AVX2 only"). For a forward of one token, :class:`DecodeBlocks` runs two blocks of every layer
through ``torch.compile`` (inductor's C++ backend):

- before attention: the input RMSNorm, the fused q/k/v product (+ bias), the q LoRA
  ``s ((h A) B + b)``, the q RMSNorm (Qwen3) and RoPE of q;
- after attention: the o product (+ bias), the residual, the post-attention RMSNorm, gate/up,
  ``act(gate) * up``, down, the residual.

Inductor turns each one-row product (the weight viewed as ``T`` slices of output rows, one
batched product, as :func:`precache.models.llama.linear`) into a vectorised reduction fused with
the work around it; the final RMSNorm and the LM head run compiled too. The KV-cache writes and
attention stay with the attention backend. The maths is the eager forward's, operation for
operation; results differ by float rounding only (``tests/test_compiled.py``).

A layer falls back to the eager blocks when the row's adapter adapts o_proj or an MLP projection
there (their LoRA terms stay eager), so every adapter runs, and forwards of more than one token
(prefill, batched decode) run eager. ``LlamaModel.compile_decode`` compiles at load (a one-token
forward of the base model, seconds); an adapter's q LoRA compiles one more variant of the first
block at its first one-token forward (once per rank and bias layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from precache.models.contract import LayerInput
from precache.models.llama import rms_norm, split_product
from precache.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from precache.lora.adapter import LoRAAdapter

#: projections whose LoRA terms the compiled blocks leave to the eager path
_EAGER_LORA = ("o_proj", "gate_proj", "up_proj", "down_proj")


def check_compile_decode(device, quantization: str | None) -> None:
    """Refuse ``compile_decode`` where it does not run, naming why.

    Raises:
        ValueError: ``device`` is not the CPU, or the weights are quantized (the blocks multiply
            dense weights).
    """
    if torch.device(device or "cpu").type != "cpu":
        raise ValueError(f"compile_decode runs on the CPU only, not on {device}")
    if quantization is not None:
        raise ValueError(f"compile_decode multiplies dense weights, not {quantization} ones")


class DecodeBlocks:
    """The compiled pre- and post-attention blocks of one model (module docstring). ``parts``:
    the output slices of each product, the torch threads when it is built."""

    def __init__(self, model):
        c = model.config
        self.model = model
        self.parts = max(1, torch.get_num_threads())
        self._scalings: dict[float, torch.Tensor] = {}
        sizes, heads, dim, eps = [c.q_size, c.kv_size, c.kv_size], c.num_heads, c.head_dim, c.rms_norm_eps
        inter, act, parts = c.intermediate_size, model.act, self.parts

        def product(x, w, bias):
            return split_product(x, w, bias, parts if w.shape[0] % parts == 0 else 1)

        def pre(x, norm, qkv, qkv_bias, q_norm, a, b, lora_bias, scaling, cos, sin):
            h = rms_norm(x, norm, eps)
            q, k, v = product(h, qkv, qkv_bias).split(sizes, dim=-1)
            if a is not None:
                delta = (h @ a) @ b
                q = q + (delta if lora_bias is None else delta + lora_bias) * scaling
            q = q.reshape(-1, heads, dim)
            if q_norm is not None:
                q = rms_norm(q, q_norm, eps)
            return h, RotaryEmbedding.apply(q, cos, sin), k, v

        def post(x, attn, o, o_bias, norm, gate_up, gate_up_bias, down, down_bias):
            x = x + product(attn, o, o_bias)
            gate, up = product(rms_norm(x, norm, eps), gate_up, gate_up_bias).split([inter, inter], dim=-1)
            return x + product(act(gate) * up, down, down_bias)

        def head(x, norm, lm_head):
            return product(rms_norm(x, norm, eps), lm_head, None).float()

        self._pre = torch.compile(pre, dynamic=False)
        self._post = torch.compile(post, dynamic=False)
        self._head = torch.compile(head, dynamic=False)

    @staticmethod
    def covers(layer: int, adapter: LoRAAdapter | None) -> bool:
        """Whether ``layer`` runs compiled for a row with ``adapter`` (no LoRA on o_proj or the MLP)."""
        return adapter is None or not any(adapter.has(layer, proj) for proj in _EAGER_LORA)

    def attention_input(self, x, layer: int, adapter: LoRAAdapter | None, cos, sin) -> LayerInput:
        """The layer's :class:`LayerInput` for one token ``x`` ``[1, hidden]`` (eager:
        ``LlamaModel._attention_input``)."""
        model, w = self.model, self.model.layers[layer]
        a = b = lora_bias = None
        scaling = 1.0
        if adapter is not None and adapter.has(layer, "q_proj"):
            a, b = adapter.weights[(layer, "q_proj")]
            lora_bias = adapter.biases.get((layer, "q_proj"))
            scaling = adapter.scaling
        if scaling not in self._scalings:  # a tensor input: one graph for every value
            self._scalings[scaling] = torch.tensor(scaling, dtype=x.dtype)
        scaling = self._scalings[scaling]
        h, q, k_lin, v_lin = self._pre(
            x, w["input_norm"], w["qkv"], w["qkv_bias"], w["q_norm"], a, b, lora_bias, scaling, cos, sin
        )
        return LayerInput(layer, h, q, cos, sin, model, k_lin, v_lin)

    def after_attention(self, x, attn, layer: int) -> torch.Tensor:
        """``x`` after the layer's o product, MLP and residuals (eager: the forward's loop body)."""
        w = self.model.layers[layer]
        return self._post(
            x,
            attn,
            w["o_proj"],
            w["o_proj_bias"],
            w["post_norm"],
            w["gate_up"],
            w["gate_up_bias"],
            w["down_proj"],
            w["down_proj_bias"],
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[1, vocab]`` of one token ``x`` ``[1, hidden]``: the final RMSNorm and the
        LM head (eager: the end of ``LlamaModel.forward``)."""
        return self._head(x, self.model.norm, self.model.lm_head)
