"""Every honoured ``adapter_config.json`` option: adapters built and saved by PEFT itself (random
non-zero A and B), loaded by precache, against HF + PEFT as the oracle in every sharing method, and
against the DESIGN.md facts (tests/test_methods.py's brute-force references) over a multi-agent
trajectory."""

from __future__ import annotations

import copy
import json
import re
import shutil
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from precache.lora.adapter import load_adapter
from precache.methods import METHODS
from precache.models import dense_logits
from tests.test_methods import check_turn_against_reference
from tests.tiny import AGENTS, ALL_PROJ, SCRIPT, make_engine, peft_logits, run_script, tiny_model

TOL = 1e-4
IDS = [5, 17, 3, 42, 8, 11, 29, 60, 2, 71, 33, 14]


def save_peft_adapter(hf, path, seed: int = 1, scale: float = 0.3, **options):
    """Save an adapter made by ``get_peft_model(LoraConfig(**options))`` with random A and B."""
    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(hf), config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(scale * torch.randn_like(p))
    peft_model.save_pretrained(str(path))
    return path


def peft_ranks(hf, folder) -> dict[tuple[int, str], tuple[int, float]]:
    """``(r, scaling)`` PEFT gives each LoRA module of the adapter in ``folder``."""
    model = PeftModel.from_pretrained(copy.deepcopy(hf), str(folder))
    out = {}
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.\w+\.(\w+_proj)$", name)
        if m and hasattr(module, "r") and "default" in module.r:
            out[(int(m.group(1)), m.group(2))] = (module.r["default"], module.scaling["default"])
    return out


def edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def assert_every_method_matches_peft(model, hf, folder, oracle_folder=None):
    """The first turn of one agent on a fresh trajectory is exact in every method (DESIGN.md fact
    2): its logits at the last prompt token equal PEFT's and its greedy tokens are PEFT's."""
    ref = peft_logits(hf, oracle_folder or folder, IDS)
    ours = dense_logits(model, [IDS], [load_adapter(folder, model.config)])[0]
    assert (ours - ref).abs().max() <= TOL
    greedy = list(IDS)
    for _ in range(3):
        greedy.append(int(peft_logits(hf, oracle_folder or folder, greedy)[-1].argmax()))
    for method in METHODS:
        engine = make_engine(model, {"plan": folder}, method)
        s = engine.session()
        s.append(IDS)
        turn = s.generate(agent="plan", max_new_tokens=3, temperature=0.0)
        assert (turn.first_logits - ref[-1]).abs().max() <= TOL, method
        assert turn.token_ids == greedy[len(IDS) :], method


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0, num_layers=3)


RANK_PATTERNS = {
    "plan": dict(
        r=4,
        lora_alpha=8,
        rank_pattern={"k_proj": 2, "model.layers.1.self_attn.v_proj": 6, r"mlp\.(gate|up)_proj": 3},
        alpha_pattern={"q_proj": 3, "layers.0.mlp.down_proj": 16},
    ),
    # a key matches a whole ".name" suffix of the module name, never a part ("proj", "layers.2", "...q")
    "action": dict(
        r=8,
        lora_alpha=16,
        rank_pattern={"v_proj": 2, "o_proj": 5, "proj": 3, "layers.2": 7, "model.layers.1.self_attn.q": 6},
        alpha_pattern={"k_proj": 4, "_proj": 1},
    ),
    "reflect": dict(r=2, lora_alpha=4, use_rslora=True, rank_pattern={"^model.layers.2.self_attn.k_proj": 7}),
}


@pytest.fixture(scope="module")
def patterned(llama, tmp_path_factory):
    """Three agents whose adapters have per-module ranks and alphas on every projection."""
    _, hf = llama
    root = tmp_path_factory.mktemp("patterned")
    return {
        a: save_peft_adapter(hf, root / a, seed=i + 3, target_modules=ALL_PROJ, **RANK_PATTERNS[a])
        for i, a in enumerate(AGENTS)
    }


@pytest.mark.parametrize("agent", AGENTS)
def test_rank_and_alpha_pattern_match_peft_module_by_module(llama, patterned, agent):
    """Each module's rank and scaling are PEFT's (its pattern-key matching rule), the LR width is the
    largest rank, and the padded, rescaled weights give PEFT's delta exactly."""
    model, hf = llama
    adapter = load_adapter(patterned[agent], model.config)
    theirs = peft_ranks(hf, patterned[agent])
    assert adapter.ranks == {key: r for key, (r, _) in theirs.items()}
    assert len(set(adapter.ranks.values())) > 1
    assert adapter.rank == max(adapter.ranks.values())
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), str(patterned[agent]))
    for (layer, proj), (_, scaling) in theirs.items():
        a, b = adapter.weights[(layer, proj)]
        assert a.shape[1] == b.shape[0] == adapter.rank
        module = peft_model.base_model.model.model.layers[layer]
        lin = getattr(module.self_attn if hasattr(module.self_attn, proj) else module.mlp, proj)
        xin = torch.randn(5, a.shape[0])
        expected = lin.lora_B["default"](lin.lora_A["default"](xin)) * scaling
        assert (adapter.delta(xin, layer, proj) - expected).abs().max() <= 1e-5 * expected.abs().max(), (
            (adapter.delta(xin, layer, proj) - expected).abs().max()
        )


@pytest.mark.parametrize("agent", AGENTS)
def test_rank_and_alpha_pattern_equal_peft_in_every_method(llama, patterned, agent):
    model, hf = llama
    assert_every_method_matches_peft(model, hf, patterned[agent])


@pytest.mark.parametrize("method", METHODS)
def test_rank_pattern_adapters_keep_the_design_facts(llama, patterned, method):
    """Fact 2 and fact 4 (tests/test_methods.py's brute-force references) with three agents whose
    adapters have per-module ranks."""
    model, _ = llama
    engine = make_engine(model, patterned, method)
    _, turns = run_script(engine, on_turn=check_turn_against_reference(method))
    assert [len(t.token_ids) for t in turns] == [n for w, n in SCRIPT if w != "append"]


def test_rank_pattern_nonshared_equals_peft_over_a_trajectory(llama, patterned):
    """NonShared is each agent's own forward: every turn equals PEFT over the whole prefix."""
    model, hf = llama

    def on_turn(s, agent):
        n_before = len(s.token_ids)

        def after(turn):
            ref = peft_logits(hf, patterned[agent], s.token_ids[:n_before])[-1]
            assert (turn.first_logits - ref).abs().max() <= TOL

        return after

    run_script(make_engine(model, patterned, "nonshared"), on_turn=on_turn)


@pytest.mark.parametrize(
    "options",
    [
        dict(target_modules=["q_proj", "k_proj", "v_proj"], layers_to_transform=[1]),
        dict(
            target_modules=["k_proj", "v_proj", "down_proj"], layers_to_transform=2, layers_pattern="layers"
        ),
        dict(
            target_modules=["q_proj", "k_proj", "v_proj"], exclude_modules=["model.layers.0.self_attn.k_proj"]
        ),
        dict(target_modules=r"model\.layers\.[02]\.self_attn\.(k|v)_proj"),
        dict(target_modules="all-linear", exclude_modules=r".*\.mlp\..*"),
        dict(target_modules=["v_proj", "k_proj"], bias="all"),
        dict(target_modules=["v_proj", "up_proj"], bias="lora_only"),
    ],
    ids=["layers", "layers_pattern", "exclude", "regex", "all-linear", "bias-all", "bias-lora_only"],
)
def test_target_selection_and_bias_equal_peft(llama, tmp_path, options):
    """target_modules, exclude_modules, layers_to_transform and bias on a model without biases."""
    model, hf = llama
    folder = save_peft_adapter(hf, tmp_path / "a", r=4, lora_alpha=8, **options)
    assert_every_method_matches_peft(model, hf, folder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_adapter_files_load_as_peft_loads_them(llama, tmp_path, dtype):
    """An adapter file stored in bf16 / fp16 (as committed sets and many hub adapters are) reads
    as fp32 holding the stored values, and every method equals PEFT on that same file."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from precache.agents.train import store_adapter_as

    model, hf = llama
    folder = save_peft_adapter(hf, tmp_path / "a", r=4, lora_alpha=8, target_modules=ALL_PROJ)
    file = folder / "adapter_model.safetensors"
    fp32 = load_file(str(file))
    if dtype is torch.bfloat16:  # what `adapters train --save-dtype bfloat16` writes
        assert store_adapter_as(folder, "bfloat16") == file
        with safe_open(str(file), "pt") as stored_file:
            assert stored_file.metadata() == {"format": "pt"}
    else:
        save_file({k: t.to(dtype) for k, t in fp32.items()}, str(file), metadata={"format": "pt"})
    stored = load_file(str(file))
    assert stored.keys() == fp32.keys() and all(t.dtype == dtype for t in stored.values())
    assert all(torch.equal(stored[k], t.to(dtype)) for k, t in fp32.items())
    with pytest.raises(ValueError, match="unknown adapter dtype 'int8'"):
        store_adapter_as(folder, "int8")
    adapter = load_adapter(folder, model.config)
    (a, b) = adapter.weights[(0, "q_proj")]
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(
        a.T[:4], stored["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].float()
    )
    assert_every_method_matches_peft(model, hf, folder)


def test_layers_to_transform_puts_lora_only_on_those_layers(llama, tmp_path):
    model, hf = llama
    folder = save_peft_adapter(
        hf, tmp_path / "a", r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 2]
    )
    adapter = load_adapter(folder, model.config)
    assert sorted(adapter.weights) == [(0, "q_proj"), (0, "v_proj"), (2, "q_proj"), (2, "v_proj")]


@pytest.mark.parametrize(
    "changes",
    [
        dict(fan_in_fan_out=True),
        dict(init_lora_weights="gaussian"),
        dict(init_lora_weights="eva"),
        dict(init_lora_weights="orthogonal"),
        dict(lora_dropout=0.3, inference_mode=False),
        dict(task_type="CAUSAL_LM", revision="main"),
        dict(modules_to_save=[], layers_to_transform=[]),
    ],
    ids=["fan_in_fan_out", "gaussian", "eva", "orthogonal", "dropout", "task_type", "empty-lists"],
)
def test_options_without_effect_at_inference_equal_peft(llama, tmp_path, changes):
    """Options PEFT loads without changing the forward: PEFT itself reads the edited config."""
    model, hf = llama
    base = save_peft_adapter(hf, tmp_path / "a", r=4, target_modules=["q_proj", "k_proj", "v_proj"])
    folder = edit_config(base, tmp_path / "b", **changes)
    assert_every_method_matches_peft(model, hf, folder)


def test_null_fields_read_as_peft_defaults(llama, tmp_path):
    """Every field but ``r`` and ``lora_alpha`` set to null: PEFT's defaults (``target_modules``
    null: q_proj and v_proj for Llama-family models), equal to the same adapter saved by PEFT."""
    model, hf = llama
    base = save_peft_adapter(hf, tmp_path / "a", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    cfg = json.loads((base / "adapter_config.json").read_text())
    nulls = {key: None for key in cfg if key not in ("r", "lora_alpha")}
    folder = edit_config(base, tmp_path / "null", **nulls)
    adapter = load_adapter(folder, model.config)
    assert adapter.targets == {"q_proj", "v_proj"} and adapter.scaling == 4.0
    assert_every_method_matches_peft(model, hf, folder, oracle_folder=base)


def test_null_fields_that_peft_accepts_load_equal_in_peft(llama, tmp_path):
    """The nulls PEFT itself loads (all but r, lora_alpha, lora_dropout, bias, rank_pattern,
    alpha_pattern, peft_type) give the same logits in PEFT and here."""
    model, hf = llama
    base = save_peft_adapter(hf, tmp_path / "a", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    cfg = json.loads((base / "adapter_config.json").read_text())
    peft_fails = {"r", "lora_alpha", "lora_dropout", "bias", "rank_pattern", "alpha_pattern", "peft_type"}
    folder = edit_config(base, tmp_path / "null", **{k: None for k in cfg if k not in peft_fails})
    assert_every_method_matches_peft(model, hf, folder)


def test_bias_lora_only_on_layers_without_bias_adds_nothing_on_qwen2(tmp_path):
    """Qwen2 has q/k/v biases, o_proj and the MLP none: bias='lora_only' on o/gate saves no bias
    tensor, so the adapter is plain LoRA, equal to PEFT (with bias tensors it is refused:
    tests/test_adapter_errors.py)."""
    model, hf = tiny_model("qwen2", seed=0, num_layers=2)
    folder = save_peft_adapter(
        hf, tmp_path / "a", r=4, target_modules=["o_proj", "gate_proj"], bias="lora_only"
    )
    assert_every_method_matches_peft(model, hf, folder)


def test_lora_bias_on_q_o_and_mlp_equals_peft(llama, tmp_path):
    """lora_bias: ``s ((x A) B + b)``, with a per-module scaling (alpha_pattern) folded into b too."""
    model, hf = llama
    folder = save_peft_adapter(
        hf,
        tmp_path / "a",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_bias=True,
        rank_pattern={"up_proj": 2},
        alpha_pattern={"o_proj": 20},
    )
    adapter = load_adapter(folder, model.config)
    assert len(adapter.biases) == 5 * model.config.num_layers
    assert_every_method_matches_peft(model, hf, folder)


def test_every_lora_config_field_of_the_installed_peft_is_decided():
    """Each ``peft.LoraConfig`` field is honoured, inert at inference, or refused by name (a new
    PEFT field fails here until it is decided)."""
    import dataclasses

    from precache.lora import peft_config

    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    decided = peft_config.HONOURED | peft_config.INERT | peft_config.REFUSED.keys()
    assert fields - decided == set()
    assert not peft_config.HONOURED & peft_config.INERT and not peft_config.INERT & peft_config.REFUSED.keys()
