"""Every adapter refusal: the exception type and a message that names the problem."""

from __future__ import annotations

import json
import logging
import shutil

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


@pytest.mark.parametrize(
    "field,value",
    [("use_dora", True), ("bias", "all"), ("rank_pattern", {"q_proj": 2}), ("modules_to_save", ["lm_head"])],
)
def test_unsupported_options(setup, tmp_path, field, value):
    folder = _copy(setup[2], tmp_path / "x")
    _edit_config(folder, **{field: value})
    with pytest.raises(AdapterError, match=f"field '{field}'.*not supported"):
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
