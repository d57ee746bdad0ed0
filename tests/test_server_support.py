"""Helpers of the server tests: a character-level tokenizer with a chat template that fits the tiny
model's 96-token vocabulary, and a live server over the tiny model (uvicorn in a thread)."""

from __future__ import annotations

import contextlib
import copy
import time

import openai
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import precache
from precache.server import LiveServer, ServerConfig, create_app

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # <|im_end|> = 2 = the tiny config's EOS
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;!?'-()\"#$%&*+/<=>@[]\\^_`~"
CHAT_TEMPLATE = (
    "{% if hint is defined %}<|im_start|>system\n{{ hint }}<|im_end|>\n{% endif %}"
    "{% for d in documents or [] %}<|im_start|>doc\n{{ d['text'] }}<|im_end|>\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BASE = "tiny-base"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (96 ids: every id of the tiny model decodes to text), ChatML specials, a ChatML chat template."""
    vocab = {t: i for i, t in enumerate([*SPECIALS, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_with_tokenizer(model):
    """The tiny model (weights shared, not copied) with :func:`char_tokenizer`."""
    out = copy.copy(model)
    out.tokenizer = char_tokenizer()
    return out


def tiny_engine(tiny, method: str) -> precache.Engine:
    model, dirs, _ = tiny
    return precache.Engine(tiny_with_tokenizer(model), adapters=dirs, method=method)


@contextlib.contextmanager
def live(engine, **config):
    """``(server, client)``: the API over ``engine`` on a free loopback port and an OpenAI client."""
    app = create_app(engine, ServerConfig(**{"model_name": BASE, **config}))
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        try:
            yield server, client
        finally:
            client.close()


def wait_idle(server, timeout_s: float = 10.0) -> list[tuple[list[int], bool]]:
    """Wait until no request runs (post-turn passes included); return ``(trajectory, busy)`` of
    every session."""
    scheduler = server.app.state.loop
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sum(scheduler.call(lambda pool: scheduler.load()).result(10)):
            return scheduler.call(
                lambda pool: [(list(e.session.token_ids), e.busy) for e in pool.entries.values()]
            ).result(10)
        time.sleep(0.02)
    raise AssertionError("requests still running")


def check_all_sessions(server) -> int:
    """Once idle, run the cache integrity check on every cached session (on the scheduler thread);
    return how many there are."""
    wait_idle(server)
    scheduler = server.app.state.loop

    def check(pool):
        for entry in pool.entries.values():
            entry.session.check()
        return len(pool)

    return scheduler.call(check).result(timeout=30)


def test_char_tokenizer_round_trips_and_renders_chatml():
    tok = char_tokenizer()
    text = "Hi there!\nHow are you?"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(tok) == 96 and len(ids) == len(text) and tok.decode(ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "ok"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(chat, add_special_tokens=False)[:2] == [
        1,
        SPECIALS.index("<unk>") + 3 + CHARS.index("u"),
    ]
