"""Incremental detokenization and the stop rule: emoji and CJK split across SmolLM2's byte-level
tokens never come out as U+FFFD; ``Session.generate``, ``Session.stream`` and the server return the
same text; stop strings are never returned, nor streamed in part (the OpenAI rule).

The engine tests script the sampled ids (``precache.engine.decoding.sample`` replaced) on a tiny random
model with SmolLM2's vocabulary, so the text is known: only the tokenizer is real (no weights load).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import precache
from precache.engine.detokenize import REPLACEMENT, IncrementalDetokenizer, StopStrings
from precache.models import model_from_hf
from tests.tiny import tiny_hf_config

TEXTS = ["Hi 😀 日本語 café", "👩‍💻 中文字符 🎉🎉 naïve", "한국어 テスト ✓ done"]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from precache.models.loader import embedded_checkpoint

    return AutoTokenizer.from_pretrained(embedded_checkpoint())  # the tokenizer files only


def _split_characters(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # some character spans several tokens
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_never_emits_a_partial_character(smol_tokenizer, text):
    tok = smol_tokenizer
    ids = _split_characters(tok, text)
    d = IncrementalDetokenizer(lambda x: tok.decode(x))
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)
    assert sum(1 for p in pieces[:-1] if p == "") >= 1  # bytes were held back somewhere


def test_incremental_detokenizer_flushes_truly_invalid_bytes(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("😀", add_special_tokens=False)[:1]  # the first bytes of the emoji only
    d = IncrementalDetokenizer(lambda x: tok.decode(x))
    assert d.push(ids[0]) == "" and d.flush() == tok.decode(ids) and REPLACEMENT in tok.decode(ids)


def _feed_all(stops, include, pieces):
    s = StopStrings(stops, include)
    sent, matched = [], None
    for piece in pieces:
        out, matched = s.feed(piece)
        sent.append(out)
        if matched:
            break
    if matched is None:
        sent.append(s.flush())
    return sent, matched, s.cut


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_at_the_first_stop_for_every_split_of_the_text(include):
    text = "abc END xyz STOP"
    for cuts in itertools.combinations(range(1, len(text)), 3):  # every way into four pieces
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        sent, matched, cut = _feed_all(["STOP", "END"], include, pieces)
        assert matched == "END"
        assert "".join(sent) == ("abc END" if include else "abc ")
        # never a chunk that starts the stop string before it completes
        released = ""
        for chunk in sent[:-1]:
            released += chunk
            assert "E" not in released
        assert "".join(sent) + cut == text[: len("".join(sent) + cut)]


def test_stop_strings_hold_back_only_a_possible_stop_prefix():
    s = StopStrings(["</a>"])
    assert s.feed("x <") == ("x ", None)  # "<" may start "</a>"
    assert s.feed("/b") == ("</b", None)  # it did not
    assert s.feed("</") == ("", None)
    assert s.feed("a>tail") == ("", "</a>") and s.cut == "</a>tail"
    assert StopStrings([]).feed("anything") == ("anything", None)


# -- the engine and the server over scripted ids ---------------------------------------------
@pytest.fixture(scope="module")
def smol_vocab_engine(smol_tokenizer):
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config("llama")
    cfg.vocab_size = len(smol_tokenizer)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model = model_from_hf(hf, tokenizer=smol_tokenizer)
    return precache.Engine(model, method="prelrshared")


@pytest.fixture
def scripted(monkeypatch):
    """``script(ids)``: from now on every turn samples ``ids`` in order (each turn restarts them)."""
    state = {"ids": []}

    def fake_sample(logits, params, generator=None):
        turn_out = state["turn"]
        return state["ids"][len(turn_out.out)] if len(turn_out.out) < len(state["ids"]) else state["ids"][-1]

    from precache.engine import decoding
    from precache.engine import request as turn_module

    original_sample = turn_module.Request.sample

    def advance(self, logits):
        state["turn"] = self
        return original_sample(self, logits)

    monkeypatch.setattr(decoding, "sample", fake_sample)
    monkeypatch.setattr(turn_module.Request, "sample", advance)

    def script(ids):
        state["ids"] = list(ids)

    return script


@pytest.mark.parametrize("text", TEXTS)
def test_generate_and_stream_return_the_same_whole_characters(
    smol_vocab_engine, smol_tokenizer, scripted, text
):
    engine, tok = smol_vocab_engine, smol_tokenizer
    ids = _split_characters(tok, text)
    scripted(ids)
    s = engine.session()
    s.append("Say it:")
    n = len(ids)
    turn = s.generate(max_new_tokens=n, ignore_eos=True)
    assert turn.token_ids == ids and turn.text == text and turn.stop_reason == "length"
    s2 = engine.session()
    s2.append("Say it:")
    chunks = list(s2.stream(max_new_tokens=n, ignore_eos=True))
    assert [c.token_id for c in chunks] == ids
    assert "".join(c.text for c in chunks) == text == s2.last_turn.text
    assert not any(REPLACEMENT in c.text for c in chunks)


def test_stop_string_inside_a_multi_token_character_run(smol_vocab_engine, smol_tokenizer, scripted):
    engine, tok = smol_vocab_engine, smol_tokenizer
    text = "前 日本語 後ろ"
    ids = _split_characters(tok, text)
    scripted(ids)
    s = engine.session()
    s.append("Go:")
    turn = s.generate(max_new_tokens=len(ids), ignore_eos=True, stop=["本語"])
    assert turn.text == "前 日" and turn.matched_stop == "本語" and turn.stop_reason == "stop"
    assert (turn.text + turn.trimmed).startswith("前 日本語")
    s2 = engine.session()
    s2.append("Go:")
    chunks = [c.text for c in s2.stream(max_new_tokens=len(ids), ignore_eos=True, stop=["本語"])]
    assert "".join(chunks) == "前 日" and not any("本" in c for c in chunks)


def test_eos_text_is_not_returned_and_include_keeps_it(smol_vocab_engine, smol_tokenizer, scripted):
    engine, tok = smol_vocab_engine, smol_tokenizer
    eos = tok.eos_token_id
    ids = tok.encode("ok 😀", add_special_tokens=False)
    scripted([*ids, eos])
    s = engine.session()
    s.append("Go:")
    turn = s.generate(max_new_tokens=20)
    assert turn.token_ids == [*ids, eos] and turn.stop_reason == "eos" and turn.text == "ok 😀"
    turn = s.generate(max_new_tokens=20, stop_token_ids=[ids[0]])
    assert turn.token_ids == ids[:1] and turn.text == "" and turn.matched_stop == ids[0]
    turn = s.generate(max_new_tokens=20, stop_token_ids=[ids[0]], include_stop_str_in_output=True)
    assert turn.text == tok.decode(ids[:1])
    turn = s.generate(max_new_tokens=20, skip_special_tokens=False, include_stop_str_in_output=True)
    assert turn.text == "ok 😀" + tok.eos_token


def test_server_text_equals_the_library_streamed_or_not(smol_vocab_engine, smol_tokenizer, scripted):
    from tests.test_server_support import live

    engine, tok = smol_vocab_engine, smol_tokenizer
    text = TEXTS[1]
    ids = _split_characters(tok, text)
    scripted([*ids, tok.eos_token_id])
    s = engine.session()
    s.append(tok.encode("Repeat:", add_special_tokens=False))
    want = s.generate(max_new_tokens=40, temperature=0.0)
    assert want.text == text
    with live(engine) as (_, client):
        got = client.completions.create(model="tiny-base", prompt="Repeat:", max_tokens=40, temperature=0)
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
        stream = client.completions.create(
            model="tiny-base", prompt="Repeat:", max_tokens=40, temperature=0, stream=True
        )
        pieces = [c.choices[0].text for c in stream if c.choices]
        assert "".join(pieces) == want.text and not any(REPLACEMENT in p for p in pieces)


def test_the_agent_loop_keeps_its_trajectory_under_the_stop_rule(tmp_path, monkeypatch):
    """The loop's stop strings ("[", "]") are no longer in ``turn.text``: its pieces
    (``text + trimmed``) still spell the whole trajectory and the parsers still read the action.
    A tiny model with a 1024-token context and the one-character-per-token tokenizer."""
    from transformers import AutoModelForCausalLM

    from precache.agents.data import get_question
    from precache.agents.loop import run_episode
    from precache.engine import decoding
    from precache.engine import request as turn_module
    from tests.test_server_support import char_tokenizer
    from tests.tiny import save_random_adapter

    cfg = tiny_hf_config("llama")
    cfg.max_position_embeddings = 1024
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    dirs = {
        a: save_random_adapter(hf, tmp_path / a, seed=i) for i, a in enumerate(("plan", "action", "reflect"))
    }
    engine = precache.Engine(
        model_from_hf(hf, tokenizer=char_tokenizer()), adapters=dirs, method="prelrshared"
    )
    script = {"plan": "Thought: go\nAction: Finish[", "action": "Badr Hari]", "reflect": "Reflect[right]"}
    original_sample = turn_module.Request.sample
    current = {}

    def advance(self, logits):
        current["turn"] = self
        return original_sample(self, logits)

    def fake_sample(logits, params, generator=None):
        t = current["turn"]
        return engine.encode(script[t.agent])[len(t.out)]

    monkeypatch.setattr(decoding, "sample", fake_sample)
    monkeypatch.setattr(turn_module.Request, "sample", advance)
    session = engine.session()
    episode = run_episode(session, get_question("5a832c3455429954d2e2ec41"), max_new_tokens=40)
    assert episode.stop_reason == "reflect_right" and episode.answer == "Badr Hari" and episode.em == 1.0
    assert [t.text for t in episode.turns] == ["Thought: go\nAction: Finish", "Badr Hari", "Reflect[right"]
    assert {t.matched_stop for t in episode.turns} == {"[", "]"}
    assert episode.trajectory == engine.decode(session.token_ids)


@pytest.mark.parametrize("text", ["😊", "naïve café", "日本語", "a 😊 b"])
def test_token_bytes_join_back_into_the_text_where_single_tokens_decode_to_u_fffd(smol_tokenizer, text):
    from precache.engine.detokenize import token_bytes

    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    pieces = [token_bytes(smol_tokenizer, i) for i in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    if text == "😊":  # a 4-byte character split across byte-level tokens
        assert len(ids) > 1 and all(smol_tokenizer.decode([i]) == REPLACEMENT for i in ids)
