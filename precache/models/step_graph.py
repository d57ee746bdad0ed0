"""A decode step captured whole: one ``torch.compile`` graph from the embedding to the logits, on a
CPU (issue 34; the CPU counterpart of vLLM's and nano-vllm's CUDA graphs).

A decode step of ``B`` one-token rows runs 30 layers of small products, attention over each row's
view of the block pool and the LR terms; run eagerly, each of its thousands of operators pays
torch's per-operator cost: SmolLM2's eager step reads 0.63 of the machine's read bandwidth, the
compiled one 0.85 (benchmarks/RESULTS.md, "Compiled decode step"). :class:`DecodeGraph` traces the whole step once per model and
LoRA layout, once for one row and once for any larger batch (the batch size and the key count
as dynamic dimensions: a growing context or a changing batch never recompiles), and inductor
compiles it with a C++ wrapper (``cpp_wrapper``: no Python between kernels); compiled
graphs are cached on disk (:func:`inductor_cache_dir`), so only the first start pays the compile.

What the graph computes, for every row ``b`` and layer ``l`` (the eager forward's maths,
:class:`~precache.models.llama.LlamaModel`, and :mod:`precache.cache.attention.segments`'):

- ``h = RMSNorm(x)``, ``q, k, v = h W_qkv (+ b)``, each projection plus the row's LoRA delta
  ``s (h A) B`` taken from stacked adapters by the row's index (punica's BGMV as two batched
  products; index 0 is the base model);
- the row's new entries: base ``RoPE(k)``, ``v`` and full ``RoPE(k + s h A^k B^k)``,
  ``v + s h A^v B^v``, and the LR rows ``h A_a`` of every agent's columns;
- keys ``K = Kb[slots] + lr_on RoPE(s Lk B^k)`` at each key's position, the row's own key taken
  from what the step just computed (the pool is written after the graph, so no input is mutated
  inside it), scores over the valid keys (and the layer's sliding window), ``P Vb + s (P Lv) B^v``;
- o product, MLP (each with the row's LoRA), residuals, the final RMSNorm and the LM head.

The pool is read, never written, inside the graph: writing it in place made inductor copy the whole
pool every step (a 4-layer probe: 22 ms against 5.4 ms without). The returned entries go into the
pool right after it (:meth:`~precache.models.contract.DecodeStep.write`), one indexed copy per pool
tensor for all layers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.fx.experimental._config as shapes_config
import torch.nn.functional as F

from precache.models.contract import DecodeStep, DecodeStepInputs, DecodeStepOutputs
from precache.models.layers import rms_norm, split_product
from precache.models.quant import Int4Weight, Int8Weight
from precache.models.rope import RotaryEmbedding
from precache.models.step_attention import as_stored, attend
from precache.terminal import progress

logger = logging.getLogger(__name__)

#: inductor's options for the step: the kernels called from generated C++ rather than Python
#: (``cpp_wrapper``); every cast to a lower precision rounded as eager rounds it
#: (``emulate_precision_casts``: inductor otherwise keeps fp32 through a cast to bf16 and back, so
#: a row's own new entries would skip the rounding a bf16 pool gives them). Not ``freezing``: it folds the weights into the graph as prepacked constants,
#: which inductor then never caches on disk (every start compiled for 77 s); SmolLM2 decodes as
#: fast without it (26-28 ms a step either way on a 2-core AVX512 machine, benchmarks/RESULTS.md)
INDUCTOR_OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True}

#: graphs of the step one process may hold (one per row count, method layout and adapter layout)
RECOMPILE_LIMIT = 64


def check_compile(device, quantization: str | None = None) -> None:
    """Refuse a compiled decode step where it does not run, naming why.

    Raises:
        ValueError: ``device`` is not the CPU (CUDA runs the triton backend eager).
    """
    if torch.device(device or "cpu").type != "cpu":
        raise ValueError(f"compile (the compiled decode step) runs on the CPU only, not on {device}")


def inductor_cache_dir() -> Path:
    """Where inductor keeps compiled graphs: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else
    ``$PRECACHE_HOME/inductor`` (default ``~/.cache/precache/inductor``), so a second start
    reuses the first one's kernels."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and chosen != default_cache_dir():  # torch writes its default there on first use
        return Path(chosen)
    home = Path(os.environ.get("PRECACHE_HOME", Path.home() / ".cache" / "precache"))
    path = home / "inductor"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path


class _Weights(torch.nn.Module):
    """The model's weights as module parameters and buffers (the same storage, no copy), which
    dynamo lifts as inputs of the graph. Int8 and int4 weights keep their codes and scales."""

    def __init__(self, model):
        super().__init__()
        self.names: dict[tuple[int, str], str] = {}
        #: each tensor's kind by name ("dense", "int8", "int4"; norms, biases and the embedding
        #: "dense"), read by the step's branches: a dict lookup is one cheap guard for dynamo,
        #: where ``hasattr`` on the module was a Python guard per name on every call (422 of
        #: them: 1.3-1.5 ms of a 25 ms step spent before the graph ran)
        self.kinds: dict[str, str] = {}
        #: fp32 products split over the threads as one batched product, as the eager forward's
        #: ``linear`` does: MKL runs a few-row product on one thread, which on an AMD EPYC made the
        #: compiled fp32 step 0.76x the eager one (benchmarks/RESULTS.md)
        self.parts = torch.get_num_threads()
        self._add("embed", model.embed)
        self._add("norm", model.norm)
        self._add_weight("lm_head", model.lm_head)
        for i, w in enumerate(model.layers):
            for key, t in w.items():
                if t is not None:
                    self._add_weight(f"l{i}_{key}", t)

    def _add(self, name: str, t: torch.Tensor) -> None:
        self.kinds[name] = "dense"
        if t.is_floating_point():
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        else:
            self.register_buffer(name, t, persistent=False)

    def _add_weight(self, name: str, t) -> None:
        if isinstance(t, Int8Weight):
            self._add(name + "_q", t.qweight)
            self._add(name + "_s", t.scales)
            self.kinds[name] = "int8"
        elif isinstance(t, Int4Weight):
            self._add(name + "_q4", t.packed)
            self._add(name + "_sz", t.scales_and_zeros)
            self.kinds[name] = "int4"
            self.int4_group = t.group_size
        else:
            self._add(name, t)

    def linear(self, x: torch.Tensor, name: str, bias: str | None = None) -> torch.Tensor:
        """``x W^T (+ b)`` of the weight ``name``, dense or int8 / int4 weight-only."""
        kind = self.kinds[name]
        if kind == "int8":
            q, s = getattr(self, name + "_q"), getattr(self, name + "_s")
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, s).to(x.dtype)
        elif kind == "int4":
            q, sz = getattr(self, name + "_q4"), getattr(self, name + "_sz")
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), q, self.int4_group, sz)
            y = y.to(x.dtype)
        else:
            weight = getattr(self, name)
            if self.parts > 1 and weight.dtype == torch.float32 and weight.shape[0] % self.parts == 0:
                y = split_product(x, weight, None, self.parts)
            else:
                y = F.linear(x, weight)
        if bias is not None and bias in self.kinds:
            y = y + getattr(self, bias)
        return y


def _lora(x: torch.Tensor, stack, layer: int, index: torch.Tensor) -> torch.Tensor | None:
    """Each row's ``s (x A) B`` ``[B, d_out]`` from the stacks by the rows' adapter ``index``."""
    if stack is None:
        return None
    a, b = stack
    return torch.bmm(torch.bmm(x.unsqueeze(1), a[index, layer]), b[index, layer]).squeeze(1)


def _plus(y: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return y if delta is None else y + delta


class _Step(torch.nn.Module):
    """The step's maths over :class:`_Weights` (module docstring); traced by :class:`DecodeGraph`."""

    def __init__(self, model):
        super().__init__()
        self.w = _Weights(model)
        c = model.config
        self.config, self.act = c, model.act
        self.register_buffer("cos", model.rope.cos, persistent=False)
        self.register_buffer("sin", model.rope.sin, persistent=False)
        self.windows = tuple(c.layer_windows)

    def forward(self, inp: DecodeStepInputs, pool_k, pool_v, pool_lr) -> DecodeStepOutputs:
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        B, L = inp.slots.shape
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        G, inter = Hq // Hkv, c.intermediate_size
        stacks, idx = inp.stacks, inp.adapter
        x = w.embed[inp.token_ids]  # [B, hidden]
        cos, sin = self.cos[inp.positions], self.sin[inp.positions]  # [B, D]
        key_cos, key_sin = self.cos[inp.key_positions], self.sin[inp.key_positions]  # [B, L, D]
        self_full = inp.self_full[:, None, None]
        scale = 1.0 / math.sqrt(D)
        out_kb, out_vb, out_kf, out_vf, out_lr = [], [], [], [], []
        for i in range(c.num_layers):
            p = f"l{i}_"
            h = rms_norm(x, getattr(w, p + "input_norm"), eps)
            q, k, v = w.linear(h, p + "qkv", p + "qkv_bias").split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = _plus(q, _lora(h, stacks.get("q_proj"), i, idx)).view(B, Hq, D)
            k_full = _plus(k, _lora(h, stacks.get("k_proj"), i, idx)).view(B, Hkv, D)
            v_full = _plus(v, _lora(h, stacks.get("v_proj"), i, idx)).view(B, Hkv, D)
            k, v = k.view(B, Hkv, D), v.view(B, Hkv, D)
            if p + "q_norm" in w.kinds:
                q = rms_norm(q, getattr(w, p + "q_norm"), eps)
            if p + "k_norm" in w.kinds:
                k, k_full = (
                    rms_norm(k, getattr(w, p + "k_norm"), eps),
                    rms_norm(k_full, getattr(w, p + "k_norm"), eps),
                )
            q, k, k_full = (
                RotaryEmbedding.apply(q, cos, sin),
                RotaryEmbedding.apply(k, cos, sin),
                RotaryEmbedding.apply(k_full, cos, sin),
            )
            out_kb.append(k), out_vb.append(v), out_kf.append(k_full), out_vf.append(v_full)
            # the row's own new entry in place of its unwritten slot, rounded as the pool will hold
            # it (a kv_cache_dtype other than the model's: as_stored)
            own_k = as_stored(torch.where(self_full, k_full, k), pool_k)
            own_v = as_stored(torch.where(self_full, v_full, v), pool_v)
            new_lr = None
            if inp.lr_down is not None:
                new_lr = h @ inp.lr_down[i]  # [B, C]
                out_lr.append(new_lr)
            visible = inp.key_valid
            if self.windows[i] is not None:
                visible = visible & (inp.key_positions > inp.positions[:, None] - self.windows[i])
            qh = (q * scale).view(B, Hkv, G, D)
            # a barrier that makes inductor store the queries once: read by a single sum over the
            # keys (the gathered layout), their RoPE and scale were otherwise recomputed for every
            # key inside the score loop (3.4 ms a layer at 16 rows of 300 keys, 0.6 stored)
            qh = qh.as_strided(qh.shape, qh.stride())
            pools = (pool_k, pool_v, pool_lr)
            attn = attend(inp, i, qh, (own_k, own_v, new_lr), pools, visible, (key_cos, key_sin))
            attn = attn.reshape(B, Hq * D)
            x = x + _plus(
                w.linear(attn, p + "o_proj", p + "o_proj_bias"), _lora(attn, stacks.get("o_proj"), i, idx)
            )
            h = rms_norm(x, getattr(w, p + "post_norm"), eps)
            gate, up = w.linear(h, p + "gate_up", p + "gate_up_bias").split([inter, inter], dim=-1)
            gate = _plus(gate, _lora(h, stacks.get("gate_proj"), i, idx))
            up = _plus(up, _lora(h, stacks.get("up_proj"), i, idx))
            gated = self.act(gate) * up
            x = x + _plus(
                w.linear(gated, p + "down_proj", p + "down_proj_bias"),
                _lora(gated, stacks.get("down_proj"), i, idx),
            )
        logits = w.linear(rms_norm(x, w.norm, eps), "lm_head").float()
        lr_out = torch.stack(out_lr) if out_lr else None
        return DecodeStepOutputs(
            logits, torch.stack(out_kb), torch.stack(out_vb), torch.stack(out_kf), torch.stack(out_vf), lr_out
        )


class DecodeGraph:
    """The model's decode step as one compiled graph (module docstring).

    ``model``: a :class:`~precache.models.llama.LlamaModel` on the CPU (fp32, bf16 or int8
    weights). :meth:`__call__` runs a step; the first call of a new LoRA layout (which projections
    the loaded adapters adapt, their largest rank, whether the step reads LR caches) traces and
    compiles once for one row and once for any larger batch; the key count is dynamic.
    ``compiled=False`` runs the same module eager (the tests' mid-point between the eager forward
    and the graph)."""

    def __init__(self, model, compiled: bool = True):
        self.module = _Step(model).eval()
        self.compiled = compiled
        self._variants: set[tuple] = set()  # graphs compiled (or loaded from the disk cache) so far
        if compiled:
            inductor_cache_dir()
            self._fn = torch.compile(self.module, dynamic=False)
        else:
            self._fn = self.module

    @torch.no_grad()
    def __call__(self, step: DecodeStep) -> torch.Tensor:
        """Run one step (the pool read only, in its ``kv_cache_dtype``, widened as it is read), then
        write its new entries into the pool (:meth:`DecodeStep.write`); return its logits ``[B, vocab]``."""
        out = self._run(step.inputs, *step.reads)
        step.write(out)
        return out.logits

    def _run(self, inputs: DecodeStepInputs, pool_k, pool_v, pool_lr) -> DecodeStepOutputs:
        if not self.compiled:
            return self._fn(inputs, pool_k, pool_v, pool_lr)
        per_key = (inputs.slots, inputs.key_positions, inputs.key_valid, inputs.is_self, inputs.lr_on)
        for t in per_key:
            torch._dynamo.mark_dynamic(t, 1)  # the key count varies every step: one graph for all
        if inputs.slots.shape[0] > 1:  # one graph for every batch of 2 rows or more
            per_row = (inputs.token_ids, inputs.positions, inputs.adapter, inputs.self_full, inputs.lr_cols)
            for t in (*per_row, inputs.lr_adapter, *per_key):
                torch._dynamo.mark_dynamic(t, 0)
        if inputs.window:  # the runs of pool rows the window reads grow with the context
            for t in (*pool_k, *pool_v, *pool_lr):
                torch._dynamo.mark_dynamic(t, 1)
        for a, b in inputs.stacks.values():  # adapters loaded at run time add rows, not graphs
            torch._dynamo.mark_dynamic(a, 0)
            torch._dynamo.mark_dynamic(b, 0)
        variant = _variant(inputs, pool_lr)
        if variant in self._variants:
            with _configured():
                return self._fn(inputs, pool_k, pool_v, pool_lr)
        rows = "2 rows or more" if variant[0] > 1 else "1 row"
        if inputs.window:
            rows += f", keys in {len(pool_k)} run{'s' if len(pool_k) > 1 else ''} of the pool"
        t0 = time.perf_counter()
        what = f"compiling the decode step for {rows} (cached under {inductor_cache_dir()})"
        # a line before the wait as well as the bar: where stderr is no terminal (a log file, a
        # notebook) the bar is not drawn, and a cold compile takes minutes
        logger.info(what)
        with (
            progress(1, what),
            _configured(),
            warnings.catch_warnings(),
        ):
            # torch's own deprecation notice from inside inductor's lowering, not the caller's
            warnings.filterwarnings("ignore", message=r"`torch\._prims_common\.check` is deprecated")
            out = self._fn(inputs, pool_k, pool_v, pool_lr)
        self._variants.add(variant)
        logger.info("decode step for %s compiled in %.1f s", rows, time.perf_counter() - t0)
        return out


@contextlib.contextmanager
def _configured():
    """Inductor's and dynamo's settings for the step, set in the calling thread: their config is
    per thread and the step runs on the compute thread (precache.compute), where torch.compile's
    own options were not applied. Every graph of every model in the process counts against one
    frame's recompile limit (8 by default), past which dynamo would run the step eagerly without a
    word: :data:`RECOMPILE_LIMIT`.

    Sizes that happen to be equal when a graph is traced are not taken for one symbol
    (``use_duck_shape`` off): with it, a window run's storage offset equal to the pool's layer
    stride in the first trajectory became a guard, and the next trajectory, whose run starts
    elsewhere, compiled the step again (minutes cold) in the middle of serving."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    with (
        inductor_config.patch(INDUCTOR_OPTIONS),
        torch._dynamo.config.patch(recompile_limit=limit),
        shapes_config.patch(use_duck_shape=False),
    ):
        yield


def _variant(inputs: DecodeStepInputs, pool_lr) -> tuple:
    """What makes dynamo trace a new graph: one row or more, the LoRA layout, the LR widths."""
    layout = tuple(sorted((p, tuple(a.shape[1:]), tuple(b.shape[1:])) for p, (a, b) in inputs.stacks.items()))
    lr_down = None if inputs.lr_down is None else tuple(inputs.lr_down.shape)
    runs = len(pool_lr) if inputs.window else 0
    lr_width = tuple((pool_lr[0] if inputs.window else pool_lr).shape[2:])
    return (min(inputs.slots.shape[0], 2), runs, layout, inputs.lr_cols.shape[1], lr_down, lr_width)
