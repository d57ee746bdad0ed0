"""The server over the embedded SmolLM2-135M-Instruct and its committed ``plan`` adapter: the real
chat template, greedy answers equal to the offline engine, and cross-adapter reuse of a chat."""

from __future__ import annotations

import pytest

import precache
from precache.resources import adapter_set
from tests.test_server_support import live

pytestmark = pytest.mark.slow

PLAN = adapter_set("qv", ["plan"])["plan"]


@pytest.fixture(scope="module")
def smol():
    return precache.load_model()  # the qv adapters are committed: a missing one is a failure


def test_chat_on_smollm2_equals_offline_and_reuses_the_plan_turn_for_the_base_model(smol):
    engine = precache.Engine(smol, adapters={"plan": PLAN}, method="prelrshared")
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    with live(engine, model_name="smol") as (_, client):
        first = client.chat.completions.create(model="plan", messages=messages, max_tokens=6, temperature=0)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And of Italy?"},
        ]
        second = client.chat.completions.create(model="smol", messages=messages, max_tokens=4, temperature=0)
    ids = smol.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    offline = engine.session()
    offline.append(ids)
    want = offline.generate(agent="plan", max_new_tokens=6, temperature=0.0)
    assert first.choices[0].message.content == want.text  # the OpenAI rule: no EOS text
    # the base model's request found the plan adapter's trajectory: its prompt, at least, was cached
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.session_id == first.session_id
