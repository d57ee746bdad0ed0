"""The generic registry: one normalisation, aliases, typed errors that list the valid names; and
the registries built on it (sharing methods, model families, benchmarks) with their CLI choices."""

from __future__ import annotations

import pytest

from precache.agents.benchmark import BENCHMARKS, HOTPOTQA, UnknownBenchmarkError
from precache.cli import build_parser
from precache.errors import ModelLoadError, UnknownMethodError
from precache.methods import METHOD_REGISTRY, METHODS, make_method
from precache.models import MODEL_REGISTRY, LlamaModel
from precache.registry import Registry, normalise


class ShapeError(ValueError):
    pass


@pytest.fixture
def shapes() -> Registry[int]:
    registry: Registry[int] = Registry("shape", ShapeError)
    registry.register("square", 4)
    registry.register("Tri_Angle", 3, aliases=("triangle",))
    return registry


def test_names_are_normalised_once(shapes):
    assert normalise("  ReBaseShared_LP ") == "rebaseshared-lp"
    assert shapes.names == ("square", "Tri_Angle") and shapes.choices == ("square", "Tri_Angle", "triangle")
    for spelling in ("Tri_Angle", "tri-angle", "TRI_ANGLE", "triangle", " Triangle "):
        assert spelling in shapes and shapes[spelling] == 3 and shapes.canonical(spelling) == "Tri_Angle"
    assert shapes.get("circle") is None and shapes.get("circle", 0) == 0 and "circle" not in shapes
    assert list(shapes) == ["square", "Tri_Angle"] and len(shapes) == 2
    assert shapes.items() == [("square", 4), ("Tri_Angle", 3)] and shapes.values() == [4, 3]


def test_unknown_names_raise_the_kinds_error_listing_the_valid_ones(shapes):
    with pytest.raises(ShapeError, match=r"^unknown shape 'circle' \(shapes: square, Tri_Angle\)$"):
        shapes["circle"]
    with pytest.raises(ShapeError, match=r"^unknown shape\(s\) circle, oval \(shapes: square, Tri_Angle\)$"):
        shapes.canonical_many(["square", "circle", "oval"])
    assert shapes.canonical_many(["SQUARE", "triangle"]) == ["square", "Tri_Angle"]


def test_registering_a_name_again_replaces_it(shapes):
    shapes["SQUARE"] = 5
    assert shapes["square"] == 5 and shapes.names == ("SQUARE", "Tri_Angle")


def test_the_methods_are_built_through_their_registry(tiny):
    model, _, _ = tiny
    assert METHOD_REGISTRY.names == METHODS and len(METHODS) == 11
    assert make_method("ReBaseShared", model, {}).name == "rebaseshared-lp"
    assert make_method("ReBaseOwnShared", model, {}).name == "rebaseownshared-lp"
    assert make_method("rebaseshared_db", model, {}).name == "rebaseshared-db"
    with pytest.raises(UnknownMethodError, match="unknown sharing method 'prelr' .methods: nonshared,"):
        make_method("prelr", model, {})


def test_model_families_and_benchmarks():
    assert MODEL_REGISTRY.names == ("llama", "mistral", "qwen2", "qwen3")
    assert all(MODEL_REGISTRY[name] is LlamaModel for name in MODEL_REGISTRY)
    with pytest.raises(ModelLoadError, match=r"unknown model_type 'gpt2' \(model_types: llama, mistral"):
        MODEL_REGISTRY["gpt2"]
    assert BENCHMARKS["HotpotQA"] is HOTPOTQA and BENCHMARKS.names == ("hotpotqa", "scienceqa")
    with pytest.raises(UnknownBenchmarkError, match=r"\(benchmarks: hotpotqa, scienceqa\)"):
        BENCHMARKS["gsm8k"]


def test_cli_choices_come_from_the_registries(capsys):
    parser = build_parser()
    for name in METHOD_REGISTRY.choices:
        assert parser.parse_args(["serve", "--method", name]).method == name
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--method", "bogus"])
    err = capsys.readouterr().err
    assert "invalid choice: 'bogus'" in err and all(name in err for name in METHOD_REGISTRY.choices)
    for name in BENCHMARKS.names:
        assert parser.parse_args(["adapters", "profile-droidspeak", "--benchmark", name]).benchmark == name
