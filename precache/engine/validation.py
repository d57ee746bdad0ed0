"""The checks of a turn request, in one place: a library call (:meth:`Session.submit
<precache.engine.session.Session.submit>`, ``generate``, ``teacher_force``), a request as its turn
opens, and the OpenAI server's handlers (before anything is queued) all run these.

Each raises a typed error of :mod:`precache.errors` whose ``param`` names the request field at
fault; the server turns it into a 400 with that ``error.param`` (:mod:`precache.server.errors`).
"""

from __future__ import annotations

from precache.config import SamplingParams
from precache.errors import ContextLengthError, EmptyRequestError, InvalidParameterError, UnknownAdapterError


def check_adapter(adapters, agent: str | None) -> None:
    """``agent`` is None (the base model) or one of the loaded ``adapters`` (names).

    Raises:
        UnknownAdapterError: it is not loaded (the message lists the loaded ones).
    """
    if agent is not None and agent not in adapters:
        loaded = ", ".join(adapters) or "none"
        raise UnknownAdapterError(f"adapter '{agent}' is not loaded (loaded: {loaded})")


def check_room(n_tokens: int, max_context: int, reserve: int = 0, param: str = "max_new_tokens") -> None:
    """A prompt of ``n_tokens`` tokens leaves room for one new token within ``max_context``
    tokens, and for ``reserve`` new tokens when asked (vLLM's refusal of a prompt plus
    ``max_tokens`` past the context length, never clamped; a teacher-forced turn's tokens).

    Raises:
        EmptyRequestError: no prompt token (``param="prompt"``).
        ContextLengthError: the prompt fills the context (``param="prompt"``), or the prompt plus
            ``reserve`` tokens passes it (``param``: the field that asked for them).
    """
    if not n_tokens:
        raise EmptyRequestError("the trajectory is empty: the prompt has no tokens", param="prompt")
    if n_tokens >= max_context:
        raise ContextLengthError(
            f"this model's maximum context length is {max_context} tokens; the prompt has {n_tokens} "
            f"tokens, which leaves no room to generate",
            param="prompt",
        )
    if n_tokens + reserve > max_context:
        raise ContextLengthError(
            f"this model's maximum context length is {max_context} tokens; you requested "
            f"{n_tokens + reserve} tokens ({n_tokens} in the prompt, {reserve} in the completion): "
            f"reduce the prompt or {param}",
            param=param,
        )


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """``stop_token_ids`` and ``logit_bias``'s ids lie in ``[0, vocab_size)``.

    Raises:
        InvalidParameterError: with ``param`` the field (the message starts with it).
    """
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidParameterError(
                f"{name}: token ids must be in [0, {vocab_size}), got {bad[:5]}", param=name
            )


def params_from_options(options: dict) -> SamplingParams:
    """:class:`SamplingParams` from the library's keyword arguments
    (:class:`~precache.config.SamplingOptions`: ``stop`` as a string or a list, ``stop_token_ids``
    as any iterable, ``logit_bias`` as ``{token id: bias}``).

    Raises:
        EmptyRequestError, ValueError: a field out of range (the message names it).
    """
    options = dict(options)
    if "stop" in options:
        stop = options["stop"]
        options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if "stop_token_ids" in options:
        options["stop_token_ids"] = tuple(int(t) for t in options["stop_token_ids"] or ())
    if isinstance(options.get("logit_bias"), dict):
        options["logit_bias"] = tuple((int(t), float(b)) for t, b in options["logit_bias"].items())
    return SamplingParams(**options)
