"""The admission pipeline: an API request's fields -> the engine requests to start, validated.

`admit` is the one function every generating route calls (completions and chat today; a
/v1/responses or /v1/messages route would build the same `PromptSource` and call it too). In order:

1. sampling settings (server/sampling.py: the server's limits, then `SamplingParams`, which
   checks each setting's range);
2. the prompt's shape and the server's prompt limits (how many prompts, how many tokens in all);
3. tokenization and chat templates on the input processor's worker threads;
4. engine admission per prompt (engine/core/admission.py: not empty, ids in the vocabulary, room in
   the context, the final max_tokens), also off the event loop;
5. each constrained prompt's grammar, compiled and started off the engine thread.

Every refusal is an `OpenAIError` 400 naming the field at fault (`param`) and OpenAI's `code`
where it has one. What needs the KV pool's size is still checked by the engine when the request
is added (engine/loop/request_checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.core.admission import EngineRequest, admit as admit_prompt, check_not_empty
from engine.core.request_error import RequestError
from engine.core.sampling_params import SamplingParams
from server.context import ServerContext
from server.errors import bad_request, from_request_error
from server.input_processor import Prompt
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.sampling import chat_params, completion_params, max_tokens_defaulted
from server.structured import constraint_param
from server.tools import ToolPlan


@dataclass(frozen=True)
class PromptSource:
    """What a route read as its prompt: completion prompts, or chat messages (not both)."""

    prompts: list[str | list[int]] | None = None  # each a text or token ids (completions)
    messages: list[dict] | None = None  # chat-template messages (chat)
    plan: ToolPlan | None = None  # the chat request's tool plan (server/tools.py)
    template_kwargs: dict | None = None  # the chat request's chat_template_kwargs
    continue_final: bool = False  # the prompt continues the final assistant message (a prefill)
    echo: bool = False  # the text of token-id prompts is wanted back

    @property
    def param(self) -> str:
        """The request field that holds the prompt, as errors name it."""
        return "messages" if self.messages is not None else "prompt"


@dataclass(frozen=True)
class Admitted:
    params: SamplingParams  # the request's settings, as asked (each engine request has its final max_tokens)
    requests: list[EngineRequest]  # one per prompt, in order, ready for `AsyncEngine.add_admitted`


async def admit(ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest, source: PromptSource) -> Admitted:
    """The engine requests for `req`, validated (see the module docstring); raises OpenAIError."""
    settings, param = ctx.settings, source.param
    if isinstance(req, ChatCompletionRequest):
        params = chat_params(req, settings, ctx.vocab_size, source.plan, ctx.generation_defaults)
        prompts = [await ctx.inputs.chat_prompt(source.messages, source.plan, source.template_kwargs,
                                                source.continue_final)]
    else:
        params = completion_params(req, settings, ctx.vocab_size, ctx.generation_defaults)
        texts = _check_prompts(source.prompts, settings.max_prompts_per_request)
        prompts = await ctx.inputs.completion_prompts(texts)
    _check_total(prompts, settings.max_prompt_tokens_per_request, param)
    defaulted = max_tokens_defaulted(req)

    def engine_requests() -> list[EngineRequest]:
        requests = [admit_prompt(p.token_ids, params, ctx.admission_limits, defaulted=defaulted, param=param,
                                 text=p.text) for p in prompts]
        if source.echo:  # NOTE: decoded once admitted: every id is in the vocabulary
            requests = [r if r.text is not None else replace(r, text=ctx.inputs.prompt_text(r.token_ids))
                        for r in requests]
        return requests

    try:
        requests = await ctx.inputs.off_loop(engine_requests)
    except RequestError as exc:
        raise from_request_error(exc, param) from None
    tool_call = source.plan is not None and source.plan.guided is not None \
        and params.guided_decoding is source.plan.guided
    requests = await ctx.inputs.with_grammars(requests, params.guided_decoding,
                                              "tools" if tool_call else constraint_param(req),
                                              source.plan if tool_call else None)
    return Admitted(params, requests)


def _check_prompts(prompts: list[str | list[int]], max_prompts: int) -> list[str | list[int]]:
    """At most `max_prompts`, none empty (a text is checked here, before tokenizing: the
    tokenizer may add a BOS token to an empty one)."""
    if len(prompts) > max_prompts:
        raise bad_request(f"At most {max_prompts} prompts per request, got {len(prompts)}.", param="prompt")
    try:
        for p in prompts:
            check_not_empty(p, "prompt")
    except RequestError as exc:
        raise from_request_error(exc) from None
    return prompts


def _check_total(prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
    """--max-prompt-tokens-per-request over all the request's prompts."""
    total = sum(len(p.token_ids) for p in prompts)
    if max_tokens is not None and total > max_tokens:
        raise bad_request(f"{param} holds {total} tokens in all, more than this server accepts in one request "
                          f"({max_tokens}, --max-prompt-tokens-per-request).", param=param)
