"""Sampling features of the library (SamplingParams -> sampler -> turn) against HF transformers:
logit_bias, min_tokens, repetition / frequency / presence penalties and log-probabilities, first
on raw logits (HF ``LogitsProcessor`` classes as the oracle), then whole greedy turns against HF
``generate`` on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

import precache
from precache.config import SamplingParams
from precache.engine.sampler import sample, shape_logits, token_logprobs
from tests.tiny import tiny_model

VOCAB = 96


class OpenAIPenalties(LogitsProcessor):
    """The OpenAI frequency / presence formula over the generated tokens, written out per token."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids.tolist()):
            out = ids[self.prompt_len :]
            for token in set(out):
                c = out.count(token)
                scores[row, token] -= c * self.frequency + self.presence
        return scores


def _hf(processors, prompt, out, logits):
    ids = torch.tensor([prompt + out])
    scores = logits[None].clone()
    for p in processors:
        scores = p(ids, scores)
    return scores[0]


def test_each_logits_step_equals_the_hf_processor():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=gen) * 3
    prompt, out = [5, 9, 9, 40, 7], [9, 12, 12, 12, 60]
    cases = [
        (dict(repetition_penalty=1.7), [RepetitionPenaltyLogitsProcessor(1.7)]),
        (dict(repetition_penalty=0.6), [RepetitionPenaltyLogitsProcessor(0.6)]),
        (
            dict(min_tokens=8, stop_token_ids=(3, 70)),
            [MinNewTokensLengthLogitsProcessor(len(prompt), 8, [3, 70])],
        ),
        (dict(min_tokens=5, stop_token_ids=(3,)), []),  # 5 tokens out: no longer masked
        (
            dict(logit_bias=((4, 5.0), (60, -100.0))),
            [SequenceBiasLogitsProcessor([[[4], 5.0], [[60], -100.0]])],
        ),
        (dict(frequency_penalty=0.8, presence_penalty=-0.5), [OpenAIPenalties(len(prompt), 0.8, -0.5)]),
        (
            dict(logit_bias=((9, 2.0),), repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=1.1),
            [
                SequenceBiasLogitsProcessor([[[9], 2.0]]),
                RepetitionPenaltyLogitsProcessor(1.3),
                OpenAIPenalties(len(prompt), 0.4, 1.1),
            ],
        ),
    ]
    for fields, processors in cases:
        params = SamplingParams(max_new_tokens=10, **fields)
        got = shape_logits(logits, params, prompt, out, set(params.stop_token_ids))
        want = _hf(processors, prompt, out, logits)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), fields
        assert torch.allclose(got[~torch.isinf(got)], want[~torch.isinf(want)], atol=1e-6), fields


def test_token_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    lp, top = token_logprobs(logits, 17, 4)
    ref = torch.log_softmax(logits.double(), -1)
    assert abs(lp - ref[17].item()) < 1e-6
    values, ids = torch.topk(ref, 4)
    assert [i for i, _ in top] == ids.tolist()
    assert max(abs(v - w) for (_, v), w in zip(top, values.tolist(), strict=True)) < 1e-6


def test_bad_fields_are_refused_by_name():
    for field, value in [
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("logit_bias", ((1, 200.0),)),
        ("min_tokens", 99),
        ("stop", ("",)),  # vLLM refuses an empty stop string
        ("stop", ("end", "")),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_new_tokens=10, **{field: value})


def test_a_temperature_below_vllms_epsilon_is_greedy_and_never_overflows():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 30
    for t in (1e-300, 1e-6):
        params = SamplingParams(max_new_tokens=1, temperature=t)
        assert params.greedy and sample(logits, params) == int(torch.argmax(logits))
    assert not SamplingParams(max_new_tokens=1, temperature=1e-5).greedy  # vLLM's _SAMPLING_EPS


@pytest.fixture(scope="module")
def pair():
    model, hf = tiny_model("llama", seed=4)
    return precache.Engine(model, method="prelrshared"), hf


PROMPT = [5, 17, 33, 60, 61, 62, 40, 41, 17, 17]


def _hf_generate(hf, n, processors=(), **kwargs):
    ids = torch.tensor([PROMPT])
    out = hf.generate(
        ids,
        max_new_tokens=n,
        do_sample=False,
        logits_processor=LogitsProcessorList(processors),
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(PROMPT) :].tolist()


def _ours(engine, n, **kwargs):
    s = engine.session()
    s.append(PROMPT)
    return s.generate(max_new_tokens=n, temperature=0.0, **kwargs)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(logit_bias={7: 6.0, 8: 5.5}), dict(sequence_bias=[[[7], 6.0], [[8], 5.5]])),
        (
            dict(frequency_penalty=1.5, presence_penalty=0.7),
            dict(processors=[OpenAIPenalties(len(PROMPT), 1.5, 0.7)]),
        ),
    ],
)
def test_greedy_turn_with_a_logits_step_equals_hf_generate(pair, ours, theirs):
    engine, hf = pair
    plain = _ours(engine, 12, ignore_eos=True).token_ids
    turn = _ours(engine, 12, ignore_eos=True, **ours)
    processors = theirs.pop("processors", ())
    want = _hf_generate(hf, 12, processors, eos_token_id=None, **theirs)
    assert turn.token_ids == want
    assert turn.token_ids != plain  # the step changed the answer: the comparison means something


def test_min_tokens_masks_the_stop_tokens_as_hf_min_new_tokens(pair):
    engine, hf = pair
    plain = _ours(engine, 12, ignore_eos=True).token_ids
    stops = sorted({plain[0], plain[1]})  # the greedy answer would stop at once
    assert _ours(engine, 12, ignore_eos=True, stop_token_ids=stops).new_tokens == 1
    turn = _ours(engine, 12, ignore_eos=True, stop_token_ids=stops, min_tokens=4)
    want = _hf_generate(hf, 12, eos_token_id=stops, min_new_tokens=4)
    want = want[: next((i + 1 for i, t in enumerate(want) if t in stops), len(want))]
    assert turn.token_ids == want and len(want) > 4
    assert turn.stop_reason in ("stop", "length")
    assert turn.matched_stop == (want[-1] if want[-1] in stops else None)


def test_logprobs_equal_hf_raw_logits(pair):
    engine, hf = pair
    turn = _ours(engine, 6, ignore_eos=True, logprobs=5, repetition_penalty=1.5)
    out = hf.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=6,
        do_sample=False,
        repetition_penalty=1.5,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out.sequences[0, len(PROMPT) :].tolist() == turn.token_ids
    assert [e.token_id for e in turn.logprobs] == turn.token_ids
    for entry, raw in zip(turn.logprobs, out.logits, strict=True):  # raw: before the penalty
        ref = torch.log_softmax(raw[0].double(), -1)
        assert abs(entry.logprob - ref[entry.token_id].item()) < 1e-4
        values, ids = torch.topk(ref, 5)
        assert [i for i, _ in entry.top] == ids.tolist()
        assert max(abs(v - w) for (_, v), w in zip(entry.top, values.tolist(), strict=True)) < 1e-4


def test_the_keyword_options_name_every_sampling_field():
    from dataclasses import fields

    from precache.config import SamplingOptions, SamplingParams

    assert set(SamplingOptions.__annotations__) == {f.name for f in fields(SamplingParams)}
