"""Weights at lower precision for the CPU: int8 weight-only (``load_model(quantization="int8")``,
``--quantization int8`` on every command that loads a model).

Each weight matrix ``W`` ``[d_out, d_in]`` is stored as int8 ``Q`` with one scale per output row
(symmetric, per channel, as torchao's int8 weight-only scheme and llama.cpp's q8_0 in blocks of
the whole row):

    s_o = bf16(max_i |W_oi| / 127),    Q_oi = clamp(round(W_oi / s_o), -127, 127)

so ``W ≈ s ⊙ Q`` with an error of at most ``s_o / 2`` per entry. A decode product ``x Wᵀ`` runs
as ``(bf16(x) Qᵀ) ⊙ s`` in PyTorch's own int8 weight-only kernel (``aten._weight_int8pack_mm``,
the CPU kernel gpt-fast uses), a prefill product as ``x (s ⊙ Q)ᵀ`` at the compute dtype
(:meth:`Int8Weight.matmul`), and its result is at the compute dtype: the norms, attention,
LoRA terms and KV caches stay at the compute dtype (fp32 by default on a CPU). A decode step reads
a quarter of fp32's weight bytes. The error against fp32 is measured in benchmarks/RESULTS.md
("Precision: error against fp32").

``quantization="int4"`` (an option, never a default) holds the projections as int4 weight-only in
groups of :data:`INT4_GROUP_SIZE` inputs, asymmetric (min / max per group, the convention of
PyTorch's int4 kernels and gpt-fast's int4 handler), and the LM head as int8 (as llama.cpp keeps
its output matrix above 4 bits: at int4 it alone moved SmolLM2's logits by 4 more):

    s_og = bf16((max_g W_o - min_g W_o) / 15),   z_og = bf16(min_g W_o + 8 s_og),
    Q_oi = clamp(round((W_oi - min_g W_o) / s_og), 0, 15),   W_oi ≈ (Q_oi - 8) s_og + z_og

a decode product in ``aten._weight_int4pack_mm_for_cpu`` (bf16 inputs and scales), a prefill
product over the dequantized weight; an eighth of fp32's weight bytes per decode step. Its error
against fp32 is in benchmarks/RESULTS.md, "Precision: error against fp32" (on 10 HotpotQA dev
episodes of SmolLM2 it moved the first turn's logits less than int8: 0.76 against 1.56 at most).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: the weight precisions ``load_model(quantization=...)`` accepts (None: the weights at ``dtype``)
QUANTIZATIONS = ("int8", "int4")
#: inputs per int4 group (each weight's ``d_in`` must be a multiple): llama.cpp's q4_0 block. On
#: SmolLM2-135M groups of 64 moved the first turn's logits by up to 10-12 (KL up to 1.2 nats), groups
#: of 32 with an int8 LM head by 1.0 (KL 0.011; docs/performance.md, "Precision on CPU")
INT4_GROUP_SIZE = 32
_QMAX = 127
#: rows up to which a product runs in the int8 kernel; more rows multiply the dequantized weight
INT8_KERNEL_MAX_ROWS = 128
_SCRATCH: dict[torch.device, torch.Tensor] = {}  # Int8Weight._scratch


@dataclass(frozen=True)
class Int8Weight:
    """A weight matrix as int8 ``qweight`` ``[d_out, d_in]`` and bf16 ``scales`` ``[d_out]``
    (module docstring: the formula). Built by :meth:`quantize`; used by
    :func:`precache.models.layers.linear` in place of a dense weight."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        """Per-output-row symmetric int8 of ``weight`` ``[d_out, d_in]`` (any float dtype). The
        scale is rounded to bf16 first, so :meth:`dequantize` is exactly what the kernel multiplies."""
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / _QMAX).clamp(min=torch.finfo(torch.bfloat16).tiny)
        scales = scales.to(torch.bfloat16)
        q = torch.round(w / scales.float()[:, None]).clamp(-_QMAX, _QMAX).to(torch.int8)
        return cls(q.contiguous(), scales.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """``s ⊙ Q`` ``[d_out, d_in]`` at ``dtype``: the weight this int8 weight stands for, computed
        in fp32 (in ``out``, an fp32 ``[d_out, d_in]`` tensor, when given) and then cast."""
        w = torch.empty(self.shape, dtype=torch.float32, device=self.qweight.device) if out is None else out
        w.copy_(self.qweight).mul_(self.scales.float()[:, None])
        return w if dtype == torch.float32 else w.to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for ``x`` ``[N, d_in]``: ``[N, d_out]`` at ``x``'s dtype. Up to
        :data:`INT8_KERNEL_MAX_ROWS` rows (decode, small batches) the product runs in bf16 with fp32
        accumulation in the int8 kernel (``aten._weight_int8pack_mm``), which reads a quarter of
        fp32's bytes; more rows (prefill) multiply :meth:`dequantize` at ``x``'s dtype, where the
        dense product is faster than the int8 kernel (a 512-row prefill: 11 against 14 ms for a
        3072 x 576 weight on 2 cores) and the weight is read once for all rows."""
        if x.shape[0] > INT8_KERNEL_MAX_ROWS:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype, out=self._scratch(x.device)))
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight, self.scales)
        return y.to(x.dtype)

    def _scratch(self, device: torch.device) -> torch.Tensor:
        """An fp32 ``[d_out, d_in]`` view of a buffer every weight reuses (valid until the next
        call), for :meth:`dequantize` in a prefill product: a fresh fp32 copy per product cost a
        prefill forward 160 ms of page faults here. Forwards run on one compute thread
        (:mod:`precache.compute`), one product at a time."""
        n = self.qweight.numel()
        buf = _SCRATCH.get(device)
        if buf is None or buf.numel() < n:
            buf = _SCRATCH[device] = torch.empty(n, dtype=torch.float32, device=device)
        return buf[:n].view(self.shape)

    def nbytes(self) -> int:
        """Bytes held: the int8 matrix and the scales."""
        return self.qweight.numel() + 2 * self.scales.numel()


@dataclass(frozen=True)
class Int4Weight:
    """A weight matrix ``[d_out, d_in]`` as int4 in groups of :data:`INT4_GROUP_SIZE` inputs
    (module docstring: the formula): ``packed`` (``aten._convert_weight_to_int4pack_for_cpu``'s
    layout, ``[d_out, d_in / 2]`` uint8) for the decode kernel, ``qweight`` ``[d_out, d_in]`` (uint8,
    0..15) for the prefill product, ``scales_and_zeros`` ``[d_in / group, d_out, 2]`` (bf16).
    Built by :meth:`quantize`; used by :func:`precache.models.layers.linear` in place of a dense
    weight."""

    packed: torch.Tensor
    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
        """Group-wise asymmetric int4 of ``weight`` ``[d_out, d_in]`` (any float dtype); scales
        and zeros are rounded to bf16 first, so ``dequantize()`` is what the kernel multiplies.

        Raises:
            ValueError: ``d_in`` is not a multiple of ``group_size``.
        """
        d_out, d_in = weight.shape
        if d_in % group_size:
            raise ValueError(f"int4 needs d_in a multiple of {group_size}; a {d_out} x {d_in} weight is not")
        w = weight.detach().float().view(d_out, d_in // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        zeros = (low + 8 * scales.float()).to(torch.bfloat16)
        # the codes against the rounded scale and zero: (Q - 8) s + z nearest to W
        q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None] + 8).clamp(0, 15)
        q = q.to(torch.int32).view(d_out, d_in)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        return cls(packed, q.to(torch.uint8), scales_and_zeros, group_size)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(Q - 8) s + z`` ``[d_out, d_in]`` at ``dtype``: the weight this int4 weight stands for."""
        d_out, d_in = self.shape
        q = self.qweight.float().view(d_out, d_in // self.group_size, self.group_size)
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [d_out, groups, 2]
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).view(d_out, d_in).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for ``x`` ``[N, d_in]``: ``[N, d_out]`` at ``x``'s dtype. Up to
        :data:`INT8_KERNEL_MAX_ROWS` rows in the int4 kernel with bf16 inputs (its fp32 path measured
        10-30x slower here); more rows multiply ``dequantize()`` at ``x``'s dtype."""
        if x.shape[0] > INT8_KERNEL_MAX_ROWS:
            return torch.nn.functional.linear(x, self.dequantize(x.dtype))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros
        )
        return y.to(x.dtype)

    def nbytes(self) -> int:
        """Bytes a decode product reads: the packed codes and the scales and zeros (the unpacked
        codes, for prefill, are held beside them)."""
        return self.packed.numel() + 2 * self.scales_and_zeros.numel()


#: the weight types :func:`precache.models.layers.linear` multiplies with their own kernel
QUANTIZED_WEIGHTS = (Int8Weight, Int4Weight)


def quantize_weight(weight: torch.Tensor, quantization: str, lm_head: bool = False):
    """``weight`` as ``quantization``'s weight type (``"int8"``: :class:`Int8Weight`,
    ``"int4"``: :class:`Int4Weight`, except the LM head (``lm_head``), int8 under both)."""
    if quantization == "int8" or lm_head:
        return Int8Weight.quantize(weight)
    return Int4Weight.quantize(weight)


def check_quantizable(shapes: list[tuple[str, torch.Size]], quantization: str) -> None:
    """Refuse ``quantization`` of weights whose shape its kernel cannot take, naming the first.

    Raises:
        ValueError: int4 and a weight ``(label, [d_out, d_in])`` whose ``d_in`` is not a multiple
            of :data:`INT4_GROUP_SIZE`.
    """
    if quantization != "int4":
        return
    for label, (d_out, d_in) in shapes:
        if d_in % INT4_GROUP_SIZE:
            raise ValueError(
                f"int4 needs every projection's d_in a multiple of {INT4_GROUP_SIZE}; {label} is "
                f"{d_out} x {d_in} (use int8)"
            )


def check_quantization(quantization: str | None, device: str | None) -> None:
    """Refuse a ``quantization`` precache does not run (on ``device``), naming it.

    Raises:
        ValueError: not one of :data:`QUANTIZATIONS`, or int8 / int4 off the CPU (their kernels here are the
            CPU one).
    """
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r}: precache runs {', '.join(QUANTIZATIONS)} only")
    if torch.device(device or "cpu").type != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only, not on {device}")


#: ``kv_cache_dtype`` names (``load_model``, ``Engine``, ``--kv-cache-dtype``), and the dtype each stands for ("auto": the model's)
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_kv_cache_dtype(value: str | torch.dtype | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``kv_cache_dtype`` ``value``: None or ``"auto"`` is ``model_dtype``; a
    name of :data:`KV_CACHE_DTYPES` or one of those torch dtypes is itself.

    Raises:
        ValueError: any other value (vLLM's ``fp8`` caches among them), naming the choices.
    """
    if value is None or value == "auto":
        return model_dtype
    if isinstance(value, torch.dtype) and value in KV_CACHE_DTYPES.values():
        return value
    if isinstance(value, str) and value in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[value]
    raise ValueError(
        f"kv_cache_dtype {value!r} is not supported (supported: auto, {', '.join(KV_CACHE_DTYPES)})"
    )
