"""Request fields -> `SamplingParams`, with the checks that belong to the server: its own limits
(--max-n, --max-logprobs, --max-tokens-limit, stop and logit_bias sizes, ids of the vocabulary
in logit_bias and stop_token_ids) and what the HTTP API adds (streaming, echo, tools). Each
setting's own range and the combinations the engine refuses (best_of >= n, the seed, beam
search's rules) are `SamplingParams`' alone: its `RequestError` names the field, and becomes the
400. Called by the admission pipeline (server/admission.py), not by the routes.
"""

from __future__ import annotations

from engine.core.request_error import RequestError
from engine.core.sampling_params import SamplingParams
from server.errors import bad_request, from_request_error
from server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from server.settings import ServerSettings
from server.structured import guided_decoding
from server.tools import ToolPlan


def _common_checks(req: _SamplingFields, settings: ServerSettings, vocab_size: int | None,
                   defaults: dict) -> dict:
    n = 1 if req.n is None else req.n
    if n > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n}, got {n}.", param="n")
    if req.best_of is not None:
        if req.best_of > settings.max_best_of:
            raise bad_request(f"best_of must be at most {settings.max_best_of}, got {req.best_of}.",
                              param="best_of")
        if req.stream and req.best_of != n:
            raise bad_request("best_of must equal n when streaming.", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true.", param="stream_options")
    top_k = req.top_k if req.top_k is not None else defaults.get("top_k")
    if top_k is not None and vocab_size is not None and top_k >= vocab_size:
        top_k = -1  # the whole vocabulary: no top-k restriction
    stop = _stop_strings(req, settings)
    logit_bias = _logit_bias(req, settings, vocab_size)
    stop_token_ids = _stop_token_ids(req, settings, vocab_size)
    kwargs = dict(
        n=n,
        best_of=req.best_of,
        stop=stop,
        seed=req.seed,
        logit_bias=logit_bias,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop_token_ids=stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )
    guided = guided_decoding(req, settings)
    if guided is not None:
        kwargs["guided_decoding"] = guided
    if req.use_beam_search:
        if req.stream:
            raise bad_request("use_beam_search does not support streaming.", param="stream")
        # NOTE: beam search is greedy: temperature 0 unless the request says otherwise (then
        # SamplingParams refuses it), whatever the model's generation defaults say.
        temperature = 0.0 if req.temperature is None else req.temperature
        kwargs.update(use_beam_search=True, length_penalty=req.length_penalty,
                      early_stopping=req.early_stopping, temperature=temperature)
    optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=top_k, min_p=req.min_p,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                    repetition_penalty=req.repetition_penalty)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    # The model's generation defaults (--generation-config) fill the fields the request left out.
    for k, v in defaults.items():
        if k != "max_tokens":
            kwargs.setdefault(k, v)
    return kwargs


def _stop_strings(req: _SamplingFields, settings: ServerSettings) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > settings.max_stop_sequences:
        raise bad_request(f"stop may hold at most {settings.max_stop_sequences} sequences, got {len(stop)}.",
                          param="stop")
    longest = max(map(len, stop), default=0)
    if longest > settings.max_stop_str_len:
        raise bad_request(f"each stop sequence may be at most {settings.max_stop_str_len} characters long, "
                          f"got one of {longest}.", param="stop")
    return stop


def _logit_bias(req: _SamplingFields, settings: ServerSettings, vocab_size: int | None) -> dict[int, float]:
    """logit_bias with token-id keys: each key a decimal token id in the vocabulary."""
    given = req.logit_bias or {}
    if len(given) > settings.max_logit_bias:
        raise bad_request(f"logit_bias may hold at most {settings.max_logit_bias} entries, got {len(given)}.",
                          param="logit_bias")
    logit_bias: dict[int, float] = {}
    for key, value in given.items():
        # NOTE: int() would also take " 5", "1_0" and non-ASCII digits; a key is a token id in digits.
        if not (key.isascii() and key.isdigit()):
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}.", param="logit_bias")
        # NOTE: the length test first: int() of a long key costs time quadratic in its digits.
        token_id = int(key) if len(key) <= 20 else None
        if token_id is None or (vocab_size is not None and token_id >= vocab_size):
            raise bad_request(f"logit_bias token id {_short(key)} is out of the vocabulary (size {vocab_size}).",
                              param="logit_bias")
        logit_bias[token_id] = value
    return logit_bias


def _stop_token_ids(req: _SamplingFields, settings: ServerSettings, vocab_size: int | None) -> list[int]:
    """The request's stop_token_ids, each in the vocabulary, without repeats (first order kept)."""
    given = req.stop_token_ids or []
    if len(given) > settings.max_stop_token_ids:
        raise bad_request(f"stop_token_ids may hold at most {settings.max_stop_token_ids} token ids, "
                          f"got {len(given)}.", param="stop_token_ids")
    for token_id in given:
        if vocab_size is not None and not 0 <= token_id < vocab_size:
            raise bad_request(f"stop_token_ids: token id {_short(token_id)} is out of the vocabulary "
                              f"(size {vocab_size}).", param="stop_token_ids")
    return list(dict.fromkeys(given))


def _short(number: int | str) -> str:
    """A number for a message, shortened when it is very long."""
    text = str(number)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _check_messages(req: ChatCompletionRequest, settings: ServerSettings) -> None:
    """How many messages, and how much text in them (content, text parts, tool-call arguments)."""
    if len(req.messages) > settings.max_messages:
        raise bad_request(f"messages may hold at most {settings.max_messages} messages, got {len(req.messages)}.",
                          param="messages")
    chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content is not None:
            chars += sum(len(part.text or "") for part in content)
        for call in message.tool_calls or []:
            arguments = call.function.arguments
            chars += len(arguments) if isinstance(arguments, str) else 0
    if chars > settings.max_messages_chars:
        raise bad_request(f"messages may hold at most {settings.max_messages_chars} characters of content, "
                          f"got {chars}.", param="messages")


def _check_max_tokens(max_tokens: int | None, settings: ServerSettings, param: str) -> None:
    """--max-tokens-limit on an explicit max_tokens (its lower bound is SamplingParams')."""
    if max_tokens is None:
        return
    if settings.max_tokens_limit is not None and max_tokens > settings.max_tokens_limit:
        raise bad_request(f"{param} must be at most {settings.max_tokens_limit}, got {max_tokens}.", param=param)


def _default_max_tokens(default: int | None, settings: ServerSettings) -> int | None:
    """A request that does not set max_tokens gets `default` (None: the rest of the context),
    capped at --max-tokens-limit: the limit bounds every generation, asked for or not. The
    admission then caps it at each prompt's room in the context (`max_tokens_defaulted`)."""
    limit = settings.max_tokens_limit
    if limit is None:
        return default
    return limit if default is None else min(default, limit)


def max_tokens_defaulted(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request left its completion's length to the server (the model's
    max_new_tokens, OpenAI's 16, --max-tokens-limit): a default that admission caps at the
    context left after the prompt, where an explicit max_tokens that does not fit is a 400."""
    if isinstance(req, ChatCompletionRequest):
        return req.max_completion_tokens is None and req.max_tokens is None
    return "max_tokens" not in req.model_fields_set or req.max_tokens is None


def _build(kwargs: dict, renamed: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams(**kwargs), its RequestError a 400; `renamed`: engine field -> this API's
    name for it (chat's max_completion_tokens is the engine's max_tokens)."""
    try:
        return SamplingParams(**kwargs)
    except RequestError as exc:
        raise from_request_error(exc.renamed((renamed or {}).get(exc.param, exc.param))) from None


def completion_params(req: CompletionRequest, settings: ServerSettings, vocab_size: int | None,
                      defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the sampling defaults from --generation-config (server/generation_defaults.py)."""
    defaults = defaults or {}
    kwargs = _common_checks(req, settings, vocab_size, defaults)
    if req.suffix:
        raise bad_request("suffix is not supported.", param="suffix")
    max_tokens = req.max_tokens
    if "max_tokens" not in req.model_fields_set:  # the model's max_new_tokens, else OpenAI's 16
        max_tokens = _default_max_tokens(defaults.get("max_tokens", max_tokens), settings)
    elif max_tokens is None:
        max_tokens = _default_max_tokens(None, settings)
    _check_max_tokens(max_tokens, settings, "max_tokens")
    if req.logprobs is not None and req.logprobs > settings.max_logprobs:
        raise bad_request(f"logprobs must be at most {settings.max_logprobs}, got {req.logprobs}.", param="logprobs")
    kwargs.update(max_tokens=max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:
        kwargs["prompt_logprobs"] = req.logprobs
    if req.prompt_logprobs is not None:
        kwargs["prompt_logprobs"] = _prompt_logprobs(req, settings)
    return _build(kwargs)


def _prompt_logprobs(req: CompletionRequest, settings: ServerSettings) -> int:
    """The explicit prompt_logprobs field, capped like logprobs. The prompt's logprobs are
    answered inside the echoed choice's logprobs, so the field needs echo and logprobs (without
    them there is nowhere to put them: a 400 rather than a silently ignored field)."""
    n = req.prompt_logprobs
    if n > settings.max_logprobs:
        raise bad_request(f"prompt_logprobs must be at most {settings.max_logprobs}, got {n}.",
                          param="prompt_logprobs")
    if not req.echo or req.logprobs is None:
        raise bad_request("prompt_logprobs are returned with the echoed prompt: set echo=true and logprobs.",
                          param="prompt_logprobs")
    return n


def chat_params(req: ChatCompletionRequest, settings: ServerSettings, vocab_size: int | None,
                tools: ToolPlan | None = None, defaults: dict | None = None) -> SamplingParams:
    """`tools`: the request's checked tool plan (server/tools.py), whose constraint, if any,
    becomes the guided decoding. `defaults`: as `completion_params` takes them."""
    _check_messages(req, settings)
    defaults = defaults or {}
    kwargs = _common_checks(req, settings, vocab_size, defaults)
    if tools is not None and tools.mode != "none" and tools.functions:
        if "guided_decoding" in kwargs:
            fields = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
            other = next(f for f in fields if getattr(req, f, None) not in (None, {"type": "text"}))
            raise bad_request(f"tools cannot be combined with {other}: both constrain the answer "
                              "(use tool_choice \"none\" to keep the tools as a description only).", param=other)
        if tools.guided is not None:
            kwargs["guided_decoding"] = tools.guided
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = _default_max_tokens(defaults.get("max_tokens"), settings)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_max_tokens(max_tokens, settings, param)
    logprobs = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if req.top_logprobs < 0 or req.top_logprobs > settings.max_logprobs:
            raise bad_request(f"top_logprobs must be between 0 and {settings.max_logprobs}, got {req.top_logprobs}.",
                              param="top_logprobs")
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    kwargs.update(max_tokens=max_tokens, logprobs=logprobs)
    return _build(kwargs, {"max_tokens": param, "logprobs": "top_logprobs"})
