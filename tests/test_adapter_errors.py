"""Every adapter refusal: the exception type and a message that names the problem."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import warnings

import pytest

import precache
from precache.errors import AdapterError, UnknownAdapterError, UnknownMethodError
from precache.lora.adapter import load_adapter
from tests.tiny import save_random_adapter, tiny_hf_model, tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ours, hf = tiny_model("llama")
    good = save_random_adapter(hf, tmp_path_factory.mktemp("a") / "good", targets=("q_proj", "v_proj"), r=4)
    return ours, hf, good


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def test_missing_folder(setup, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        load_adapter(tmp_path / "nope", setup[0].config)


def test_missing_config_file(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        load_adapter(folder, setup[0].config)


def test_missing_weights_file(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        load_adapter(folder, setup[0].config)


def test_malformed_config_json(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json is not valid JSON"):
        load_adapter(folder, setup[0].config)


def test_malformed_weights_file(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    (folder / "adapter_model.safetensors").write_bytes(b"garbage bytes")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter(folder, setup[0].config)


# every LoraConfig option that changes the forward and that precache does not implement
REFUSED = [
    ("use_dora", True),
    ("modules_to_save", ["lm_head"]),
    ("trainable_token_indices", [1, 2]),
    ("target_parameters", ["mlp.experts.down_proj"]),
    ("layer_replication", [[0, 1], [0, 2]]),
    ("megatron_config", {"num_layers": 2}),
    ("use_qalora", True),
    ("alora_invocation_tokens", [5, 6]),
    ("velora_config", {}),
    ("kasa_config", {}),
    ("monteclora_config", {}),
    ("use_bdlora", {}),
    ("arrow_config", {"top_k": 2}),
    ("init_lora_weights", "pissa"),
    ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"),
    ("init_lora_weights", "corda"),
    ("init_lora_weights", "loftq"),
    ("target_modules", ["q_proj", "v_proj", "embed_tokens"]),
    ("target_modules", ["q_proj", "v_proj", "lm_head"]),
    ("target_modules", ["q_proj", "v_proj", "input_layernorm"]),
    ("bias", "everything"),
    ("lora_new_option", 3),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_refused_options_name_the_field_and_what_is_supported(setup, tmp_path, field, value):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, **{field: value})
    with pytest.raises(
        AdapterError, match=f"field '{field}' = .* is not supported: .*(supported|PEFT|precache)"
    ):
        load_adapter(folder, setup[0].config)


@pytest.mark.parametrize("field", ["r", "lora_alpha"])
def test_null_rank_or_alpha_is_refused(setup, tmp_path, field):
    """PEFT fails on these nulls too; every other null reads as PEFT's default."""
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, **{field: None})
    with pytest.raises(AdapterError, match=f"field '{field}' must be a positive"):
        load_adapter(folder, setup[0].config)


def _peft_folder(hf, path, **options):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **options))
    model.save_pretrained(str(path))
    return path


@pytest.mark.parametrize(
    "options,field",
    [
        (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules"),
        (dict(target_modules=["q_proj", "lm_head"]), "target_modules"),
        (
            dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
            "lora_bias' = True is not supported on v_proj",
        ),
        (dict(target_modules=["q_proj"], use_dora=True), "use_dora"),
    ],
    ids=["modules_to_save", "embed_tokens", "lm_head", "lora_bias", "use_dora"],
)
def test_peft_saved_adapters_with_refused_options_name_the_option(setup, tmp_path, options, field):
    """Adapters PEFT itself saved: the error names the config option, not a tensor."""
    folder = _peft_folder(setup[1], tmp_path / "a", **options)
    with pytest.raises(AdapterError, match=f"field '{field}"):
        load_adapter(folder, setup[0].config)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_bias_tensors_in_the_file_are_refused_by_name(tmp_path, bias):
    """On Qwen2 (q/k/v biases) bias='all' / 'lora_only' saves adapter-specific base biases."""
    ours, hf = tiny_model("qwen2")
    folder = _peft_folder(hf, tmp_path / "a", target_modules=["q_proj", "v_proj"], bias=bias)
    with pytest.raises(
        AdapterError, match=f"base-model bias trained with bias = '{bias}'.*supported: bias 'none'"
    ):
        load_adapter(folder, ours.config)


def test_rank_pattern_that_does_not_fit_the_weights(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, rank_pattern={"q_proj": 2})
    with pytest.raises(
        AdapterError, match=r"q_proj has lora_A \(4, 64\).*rank 2 \('rank_pattern' in adapter_config.json\)"
    ):
        load_adapter(folder, setup[0].config)


def test_lora_bias_flag_and_tensors_must_agree(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, lora_bias=True)
    with pytest.raises(
        AdapterError, match="q_proj has no lora_B bias, but adapter_config.json has lora_bias"
    ):
        load_adapter(folder, setup[0].config)
    biased = _peft_folder(setup[1], tmp_path / "b", target_modules=["q_proj"], lora_bias=True)
    _edit_config(biased, lora_bias=False)
    with pytest.raises(
        AdapterError, match="lora_B.bias' is a LoRA bias, but adapter_config.json has lora_bias false"
    ):
        load_adapter(biased, setup[0].config)


def test_overlapping_rank_pattern_keys_that_peft_cannot_reload(setup, tmp_path):
    """PEFT saves rank_pattern with sorted keys, so the first-matching key at load time can differ
    from the one at training time; PEFT then fails on the shapes, and so do we, naming the field."""
    folder = _peft_folder(
        setup[1],
        tmp_path / "a",
        r=4,
        target_modules=["v_proj"],
        rank_pattern={"v_proj": 2, "layers.1.self_attn.v_proj": 6},
    )
    with pytest.raises(AdapterError, match=r"layer 1 v_proj .* rank 6 \('rank_pattern'"):
        load_adapter(folder, setup[0].config)


@pytest.mark.parametrize(
    "changes,match",
    [
        (
            dict(target_modules=["q_proj"]),
            "holds weights for model.layers.0.self_attn.v_proj, which adapter_config.json does not target",
        ),
        (
            dict(target_modules="all-linear"),
            "has no weights for model.layers.0.mlp.down_proj, which adapter_config.json targets",
        ),
        (dict(layers_to_transform=[1]), "holds weights for model.layers.0.self_attn.q_proj"),
        (dict(exclude_modules=["v_proj"]), "holds weights for model.layers.0.self_attn.v_proj"),
        (dict(target_modules=".*nothing"), "field 'target_modules' = '.*nothing' matches no module"),
        (
            dict(target_modules="q_proj", layers_to_transform=[0]),
            "field 'layers_to_transform' = \\[0\\] is not supported",
        ),
        (dict(layers_pattern="layers"), "field 'layers_pattern' = \\['layers'\\] is not supported"),
    ],
    ids=[
        "extra-weights",
        "missing-weights",
        "layers",
        "exclude",
        "no-match",
        "regex-and-layers",
        "pattern-alone",
    ],
)
def test_config_targets_that_disagree_with_the_weights(setup, tmp_path, changes, match):
    """A file whose weights are not the modules its config targets (PEFT would drop or invent some)."""
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, **changes)
    with pytest.raises(AdapterError, match=match):
        load_adapter(folder, setup[0].config)


def test_rank_mismatch_between_config_and_weights(setup, tmp_path):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, r=8)
    with pytest.raises(AdapterError, match=r"rank 8 \('r' in adapter_config.json\)"):
        load_adapter(folder, setup[0].config)


def test_adapter_for_a_model_of_another_shape(setup, tmp_path):
    other = tiny_hf_model("llama")
    other_cfg = other.config
    other_cfg.hidden_size = 32
    other_cfg.intermediate_size = 48
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_config(other_cfg)
    folder = save_random_adapter(small, tmp_path / "small", targets=("q_proj",), r=4)
    with pytest.raises(AdapterError, match=r"q_proj has lora_A \(4, 32\)"):
        load_adapter(folder, setup[0].config)


def test_warns_when_trained_for_another_base_model(setup, tmp_path, caplog):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    cfg = setup[0].config
    import dataclasses

    named = dataclasses.replace(cfg, name="HuggingFaceTB/SmolLM2-135M-Instruct")
    with caplog.at_level(logging.WARNING):
        adapter = load_adapter(folder, named)
    assert adapter.rank == 4
    assert "Llama-3.1-8B" in caplog.text and "SmolLM2-135M-Instruct" in caplog.text


def test_unknown_adapter_name_at_generate(setup):
    ours, _, good = setup
    engine = precache.Engine(ours, adapters={"plan": good}, method="prelrshared")
    s = engine.session()
    s.append([1, 2, 3])
    with pytest.raises(UnknownAdapterError, match=r"adapter 'planner' is not loaded \(loaded: plan\)"):
        s.generate(agent="planner", max_new_tokens=2)


def test_unknown_method(setup):
    with pytest.raises(UnknownMethodError, match="unknown sharing method 'sharedall'.*prelrshared"):
        precache.Engine(setup[0], adapters={"plan": setup[2]}, method="sharedall")


def test_engine_reports_bad_adapter_folder(setup, tmp_path):
    with pytest.raises(AdapterError, match="missing"):
        precache.Engine(setup[0], adapters={"plan": tmp_path}, method="nonshared")


def test_split_methods_refuse_a_k_lora_under_qwen3_k_norm(tmp_path):
    ours, hf = tiny_model("qwen3")
    folder = save_random_adapter(hf, tmp_path / "k", targets=("k_proj", "v_proj"), r=4)
    for method in ("baseshared", "prelrshared", "rebaseshared-db"):
        with pytest.raises(AdapterError, match="adapter 'plan' has a k_proj LoRA.*k-norm of qwen3"):
            precache.Engine(ours, adapters={"plan": folder}, method=method)
    engine = precache.Engine(ours, adapters={"plan": folder}, method="nonshared")  # full caches: fine
    engine.eos_token_ids = frozenset()
    s = engine.session()
    s.append([1, 2, 3])
    assert len(s.generate(agent="plan", max_new_tokens=2).token_ids) == 2
