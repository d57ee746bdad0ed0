"""Train one LoRA adapter per role (plan, action, reflect) on gold trajectories of a benchmark.

Each training sequence is a gold trajectory (HotpotQA: :mod:`precache.agents.gold`; ScienceQA:
:mod:`precache.agents.scienceqa_tools`) over a TRAIN question of the benchmark,
tokenized piece by piece with ``add_special_tokens=False`` exactly as the loop appends and
generates it. A role's adapter is trained with the loss on that role's own pieces only
(labels are -100 everywhere else). HF transformers + PEFT on the base checkpoint; adapters are
saved in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from precache.agents import prompt
from precache.agents.benchmark import HOTPOTQA, Benchmark
from precache.models.loader import embedded_checkpoint
from precache.terminal import progress

logger = logging.getLogger(__name__)

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_SETS = {
    "qv": ("q_proj", "v_proj"),
    "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
IGNORE_INDEX = -100


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one adapter set (all three roles share them)."""

    targets: str = "qv"
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.05
    steps: int = 60
    batch_size: int = 4
    lr: float = 1.5e-3
    warmup_steps: int = 5
    seed: int = 0
    max_tokens: int = 512
    #: dtype the adapter file stores (trained in fp32): ``float32`` or ``bfloat16`` (half the bytes)
    save_dtype: str = "float32"


#: the dtypes an adapter set may be stored in
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a :data:`SAVE_DTYPES` name. Raises ValueError naming the known ones."""
    if name not in SAVE_DTYPES:
        raise ValueError(f"unknown adapter dtype {name!r} (choose from {', '.join(SAVE_DTYPES)})")
    return SAVE_DTYPES[name]


def store_adapter_as(folder: str | Path, dtype: str) -> Path:
    """Rewrite ``folder/adapter_model.safetensors`` with every floating tensor in ``dtype`` (one of
    :data:`SAVE_DTYPES`), keeping names and metadata; returns the file. PEFT and
    :func:`precache.load_adapter` read a bf16 file back as fp32 holding the rounded values.

    Raises:
        ValueError: ``dtype`` is not one of :data:`SAVE_DTYPES`.
    """
    torch_dtype = save_dtype_of(dtype)
    file = Path(folder) / "adapter_model.safetensors"
    with safe_open(str(file), "pt") as stored:
        metadata = stored.metadata()
        tensors = {k: stored.get_tensor(k) for k in stored.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    cast = {k: t.to(torch_dtype) if t.is_floating_point() else t for k, t in tensors.items()}
    save_file(cast, str(file), metadata=metadata)
    return file


def tokenize_pieces(tokenizer, pieces: list[prompt.Piece], role: str) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` for one trajectory, loss on ``role``'s pieces only.

    Each piece is tokenized separately (``add_special_tokens=False``) and concatenated. The
    sequence is cut after the last labelled token, since nothing later affects the loss.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    for piece in pieces:
        ids = tokenizer(piece.text, add_special_tokens=False).input_ids
        input_ids += ids
        labels += ids if piece.role == role else [IGNORE_INDEX] * len(ids)
    last = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=-1)
    return input_ids[: last + 1], labels[: last + 1]


def _examples(
    tokenizer, role: str, epoch_seed: int, max_tokens: int, benchmark: Benchmark
) -> list[tuple[list[int], list[int]]]:
    trajectories = benchmark.gold_trajectories(benchmark.load_questions("train"), seed=epoch_seed)
    examples = [tokenize_pieces(tokenizer, pieces, role) for pieces in trajectories]
    return [(ids[:max_tokens], labels[:max_tokens]) for ids, labels in examples if ids]


def _length_bucketed_batches(examples: list, batch_size: int, rng: random.Random) -> list[list]:
    """Shuffle, sort within windows of 8 batches by length (less padding), shuffle the batches."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    window = batch_size * 8
    batches = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: len(examples[i][0]))
        batches += [
            [examples[i] for i in chunk[j : j + batch_size]] for j in range(0, len(chunk), batch_size)
        ]
    rng.shuffle(batches)
    return batches


def _collate(batch: list, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: ``input_ids``, ``attention_mask``, ``labels`` [B, T]."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, labs) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(labs)] = torch.tensor(labs)
        mask[row, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _batches_forever(tokenizer, role: str, config: TrainConfig, benchmark: Benchmark):
    rng = random.Random(config.seed)
    epoch = 0
    while True:  # fresh gold trajectories each epoch: other negatives and thought templates
        examples = _examples(tokenizer, role, config.seed * 1000 + epoch, config.max_tokens, benchmark)
        yield from _length_bucketed_batches(examples, config.batch_size, rng)
        epoch += 1


def _lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak learning rate."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_role(
    base_path: Path, role: str, config: TrainConfig, out_dir: Path, benchmark: Benchmark = HOTPOTQA
) -> list[float]:
    """Train and save the adapter of one role under ``out_dir`` on ``benchmark``'s train split;
    returns the loss per step."""
    from peft import LoraConfig, get_peft_model  # heavy: loaded only when training runs

    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(TARGET_SETS[config.targets]),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, config))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = _batches_forever(tokenizer, role, config, benchmark)
    losses: list[float] = []
    with progress(config.steps, f"{config.targets}/{role}") as advance:
        for step in range(config.steps):
            loss = model(**_collate(next(batches), pad_id)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if step % 10 == 0 or step == config.steps - 1:
                logger.info("%s/%s step %d loss %.4f", config.targets, role, step, losses[-1])
            advance()
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    model.save_pretrained(out_dir, save_embedding_layers=False)
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
    if config.save_dtype != "float32":
        store_adapter_as(out_dir, config.save_dtype)
    return losses


def train_adapters(
    out_dir: str | Path,
    targets: str = "qv",
    steps: int = 60,
    seed: int = 0,
    roles: tuple[str, ...] = prompt.ROLES,
    benchmark: Benchmark = HOTPOTQA,
    save_dtype: str = "float32",
) -> Path:
    """Train the plan / action / reflect adapters of one set into ``out_dir/<role>/`` on the
    gold trajectories of ``benchmark``'s train split.

    ``targets``: ``"qv"`` (q_proj, v_proj) or ``"all"`` (the seven projections); rank 8,
    alpha 16. Trained in fp32, stored in ``save_dtype`` (:data:`SAVE_DTYPES`; the committed
    ``all`` sets are bf16, to keep the checkout small). Writes ``out_dir/TRAINING.json`` (config,
    seconds and loss curve per role).

    Raises:
        ValueError: unknown ``targets`` or ``save_dtype``.
    """
    if targets not in TARGET_SETS:
        raise ValueError(f"unknown adapter set {targets!r} (choose from {', '.join(TARGET_SETS)})")
    save_dtype_of(save_dtype)  # refused before any training
    config = TrainConfig(targets=targets, steps=steps, seed=seed, save_dtype=save_dtype)
    out = Path(out_dir)
    base_path = embedded_checkpoint()
    report: dict = {"config": asdict(config), "base_model": BASE_MODEL_ID, "roles": {}}
    if benchmark is not HOTPOTQA:
        report["benchmark"] = benchmark.name
    for role in roles:
        start = time.perf_counter()
        losses = train_role(base_path, role, config, out / role, benchmark)
        report["roles"][role] = {
            "seconds": round(time.perf_counter() - start, 1),
            "loss_first": round(losses[0], 4),
            "loss_last10_mean": round(sum(losses[-10:]) / len(losses[-10:]), 4),
            "losses": [round(x, 4) for x in losses],
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "TRAINING.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        logger.info("saved %s adapter to %s", role, out / role)
    return out
