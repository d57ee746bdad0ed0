"""DroidSpeak-style layer recomputation (Liu et al., "DroidSpeak: KV Cache Sharing for Cross-LLM
Communication and Multi-LLM Serving", arXiv 2411.02820, NSDI 2026), as a baseline on the shared cache.

The paper's rule: models fine-tuned from one base reuse each other's KV cache except at a few
"critical" layers, where reuse hurts quality most; those are found once by an offline profile per
model pair, grouped into a contiguous range (fewer transitions between reused and recomputed
layers), and recomputed for the reused tokens, starting from the hidden states ("E cache") at the
range's input. Here, per turn of agent c over ``n`` reused tokens of the shared cache
(:mod:`precache.methods.selective`): the reused tokens run with c's adapter through layers
``0 .. last`` and write c's K/V at layers ``first .. last`` only; the other layers keep the reused
entries. We keep no hidden-state cache, so the recompute also runs layers ``0 .. first - 1``
(attending to the reused entries there) and counts them: ``n (last + 1)`` token-layers per turn.
With the range ``(0, L - 1)`` this is the agent's own forward: NonShared for that turn.

The range comes from ``layers``, else from the profile stored with the adapters
(``droidspeak.json`` in the folder that holds every adapter's folder, written by
:func:`save_profile` or ``precache adapters profile-droidspeak``, which calibrates on a
benchmark's text: :mod:`precache.agents.calibration`), else from :func:`profile` run once at
construction on seeded random calibration tokens (logged).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from precache.cache.rowplan import Recompute
from precache.methods.selective import SelectiveRecompute, check_layer_range
from precache.models.contract import LayerInput, Row

logger = logging.getLogger(__name__)

PROFILE_FILE = "droidspeak.json"


class DroidSpeak(SelectiveRecompute):
    """``layers``: the critical range ``(first, last)``, inclusive (None: the stored or computed
    profile's).

    Raises:
        ValueError: ``layers`` outside the model, or a stored profile made for another model or
            adapter set (it names the file).
    """

    name = "droidspeak"

    def __init__(self, model, adapters, pool, layers: tuple[int, int] | None = None, **options):
        super().__init__(model, adapters, pool, **options)
        num_layers = model.config.num_layers
        self.layers_given = layers is not None
        if layers is None:
            stored = profile_path(self.adapters)
            if stored is not None and stored.is_file():
                layers = read_profile(stored, model, self.adapters)["layers"]
            else:
                logger.warning(
                    "droidspeak: no %s next to the adapters; profiling on random tokens now (store one with "
                    "`precache adapters profile-droidspeak`)",
                    PROFILE_FILE,
                )
                layers = profile(model, self.adapters)["layers"]
        self.layers = None if layers is None else check_layer_range(layers, num_layers)

    def adapters_changed(self) -> None:
        """The profiled range belongs to the adapter set: a new set is profiled again (on seeded
        random tokens, logged), unless the range was given."""
        if self.layers_given:
            return
        logger.warning("droidspeak: the adapter set changed; profiling it again on random tokens")
        layers = profile(self.model, self.adapters)["layers"] if self.adapters else None
        self.layers = None if layers is None else check_layer_range(layers, self.model.config.num_layers)

    def recompute(self, state, agent, n):
        if self.layers is None:  # no adapter: every entry is the base model's own
            return None
        first, last = self.layers
        return Recompute(self.model.config.num_layers, first_write=first, last_layer=last)


# -- the one-off profile ------------------------------------------------------------------------


class _PrefixAttention:
    """Causal attention of rows that all run the same tokens at positions ``[P, P + T)``, row i
    over its own materialised prefix K/V ``prefixes[i][layer] = (K, V)`` ``[P, Hkv, D]`` (None: no
    prefix) and its own adapted K/V. With ``record``: keeps each layer's adapted K/V of the batch."""

    def __init__(self, rows: list[Row], prefixes, record=False):
        self.rows, self.prefixes, self.kv = rows, prefixes, [] if record else None

    def attend(self, x: LayerInput) -> torch.Tensor:
        out = torch.empty(x.q.shape[0], x.q.shape[1] * x.q.shape[2], dtype=x.q.dtype, device=x.q.device)
        window = x.model.config.window(x.layer)
        for row, prefix in zip(self.rows, self.prefixes, strict=True):
            k, v = x.adapted_kv(row.slice, row.adapter)
            if self.kv is not None:
                self.kv.append((k, v))
            n_prefix = 0
            if prefix is not None:
                pk, pv = prefix[x.layer]
                n_prefix = pk.shape[0]
                k, v = torch.cat([pk, k]), torch.cat([pv, v])
            T = row.end - row.start
            keys, queries = torch.arange(n_prefix + T)[None, :], n_prefix + torch.arange(T)[:, None]
            mask = keys <= queries  # [T, P + T]
            if window is not None:
                mask &= keys > queries - window
            q, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (x.q[row.slice], k, v))
            o = F.scaled_dot_product_attention(q, kh, vh, attn_mask=mask.to(q.device), enable_gqa=True)
            out[row.slice] = o[0].transpose(0, 1).reshape(T, -1)
        return out


def _run(model, ids: list[int], pos0: int, adapter, prefixes: list, record=False):
    """``(log-probabilities [len(prefixes), T, vocab], K/V per layer or None)``: one row per prefix."""
    T = len(ids)
    rows = [Row(i * T, (i + 1) * T, adapter) for i in range(len(prefixes))]
    attention = _PrefixAttention(rows, prefixes, record)
    logits = model.forward(
        torch.tensor(ids * len(rows), device=model.device),
        torch.arange(pos0, pos0 + T, device=model.device).repeat(len(rows)),
        rows,
        attention,
        logits_at=list(range(T * len(rows))),
    )
    return torch.log_softmax(logits, -1).view(len(rows), T, -1), attention.kv


def profile(
    model,
    adapters: dict,
    n_critical: int | None = None,
    calibration: list[list[int]] | None = None,
    seed: int = 0,
    calibration_name: str | None = None,
) -> dict:
    """The per-layer reuse error and the critical range (DroidSpeak's offline profile).

    ``calibration``: token id sequences (a benchmark's text, as
    :func:`precache.agents.calibration.calibration` makes them; default: 4 seeded random sequences
    of 96 tokens). For every sequence, every reader c and author j != c: the first 3/4 of the
    tokens are the reused prefix; the error of layer l is the mean KL(p_c || p_c,l) over the last
    quarter's next-token distributions, where p_c reads c's own K/V at every layer and p_c,l reads
    j's at layer l only. ``layers`` is the contiguous
    window of ``n_critical`` layers (default ``ceil(L / 3)``) with the largest summed error.

    With a single adapter the pair is that adapter and the base model (a turn with ``agent=None``
    reads the adapter's entries); with none, no cache entry can deviate: zero errors and
    ``layers`` None (nothing to recompute).

    Returns ``{"num_layers", "adapters", "layer_errors": [L floats, nats], "layers": [first, last] | None,
    "calibration"}``, the last saying what the sequences were: ``calibration_name`` (e.g.
    ``"scienceqa train[:4], at most 128 tokens each"``), else ``"random: 4 x 96 tokens, seed S"``
    or ``"N given sequences"``.

    Raises:
        ValueError: ``n_critical`` outside ``1..L``.
    """
    num_layers = model.config.num_layers
    n_critical = math.ceil(num_layers / 3) if n_critical is None else n_critical
    if not 1 <= n_critical <= num_layers:
        raise ValueError(f"n_critical must be in 1..{num_layers}, got {n_critical!r}")
    names = sorted(adapters)
    if calibration_name is None:
        calibration_name = (
            f"random: 4 x 96 tokens, seed {seed}"
            if calibration is None
            else f"{len(calibration)} given sequences"
        )
    if not adapters:
        return {
            "num_layers": num_layers,
            "adapters": [],
            "layer_errors": [0.0] * num_layers,
            "layers": None,
            "calibration": calibration_name,
        }
    agents = dict(adapters) if len(adapters) > 1 else {**adapters, None: None}  # None: the base model
    if calibration is None:
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        calibration = [torch.randint(0, vocab, (96,), generator=gen).tolist() for _ in range(4)]
    errors = torch.zeros(num_layers, dtype=torch.float64)
    count = 0
    for ids in calibration:
        split = len(ids) * 3 // 4
        prefix_ids, query = ids[:split], ids[split:]
        own = {a: _run(model, prefix_ids, 0, ad, [None], record=True)[1] for a, ad in agents.items()}
        for c, reader in agents.items():
            for j in agents:
                if j == c:
                    continue
                # row 0 reads c's own K/V everywhere; row 1 + l reads j's at layer l only
                mixed = [
                    [own[j][i] if i == layer else own[c][i] for i in range(num_layers)]
                    for layer in range(num_layers)
                ]
                logp, _ = _run(model, query, split, reader, [own[c], *mixed])
                ref = logp[0]
                errors += (ref.exp() * (ref - logp[1:])).sum(-1).mean(-1).double()
                count += 1
    errors /= count
    sums = [float(errors[a : a + n_critical].sum()) for a in range(num_layers - n_critical + 1)]
    first = max(range(len(sums)), key=sums.__getitem__)
    return {
        "num_layers": num_layers,
        "adapters": names,
        "layer_errors": [round(float(e), 8) for e in errors],
        "layers": [first, first + n_critical - 1],
        "calibration": calibration_name,
    }


def profile_path(adapters: dict) -> Path | None:
    """``droidspeak.json`` in the folder that holds every adapter's folder, or None (no common one)."""
    parents = {Path(ad.path).resolve().parent for ad in adapters.values() if ad.path}
    if len(parents) != 1 or len([ad for ad in adapters.values() if ad.path]) != len(adapters):
        return None
    return parents.pop() / PROFILE_FILE


def read_profile(path: Path, model, adapters: dict) -> dict:
    """The stored profile at ``path``, checked against the model and adapter set. ``calibration``
    is optional (profiles written before it was recorded have none).

    Raises:
        ValueError: the file is not a profile, or it was made for another layer count or adapter set.
    """
    try:
        data = json.loads(Path(path).read_text())
        layers = None if data["layers"] is None else [int(x) for x in data["layers"]]
        stored_layers, names = int(data["num_layers"]), sorted(data["adapters"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a DroidSpeak profile ({e})") from None
    if stored_layers != model.config.num_layers or names != sorted(adapters):
        raise ValueError(
            f"{path} profiles a {stored_layers}-layer model with adapters {', '.join(names)}; loaded: "
            f"{model.config.num_layers} layers, adapters {', '.join(sorted(adapters))} "
            f"(re-run `precache adapters profile-droidspeak`)"
        )
    if layers is not None:
        check_layer_range(layers, stored_layers)
    return data


def save_profile(model, adapters: dict, folder: str | Path | None = None, **options) -> Path:
    """Run :func:`profile` and write it as ``droidspeak.json`` into ``folder`` (default: the
    adapters' common folder, :func:`profile_path`). Returns the file.

    Raises:
        ValueError: no folder given and the adapters have no common one.
    """
    path = Path(folder) / PROFILE_FILE if folder is not None else profile_path(adapters)
    if path is None:
        raise ValueError("the adapters share no folder: give one to store the DroidSpeak profile in")
    path.write_text(json.dumps(profile(model, adapters, **options), indent=1) + "\n")
    return path


__all__ = ["PROFILE_FILE", "DroidSpeak", "profile", "profile_path", "read_profile", "save_profile"]
