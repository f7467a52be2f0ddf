"""Command line: vLLM-spelled flags, an optional YAML config (--config; flags override it),
turned into `EngineArgs` and `ServerSettings`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.core.config import QUANTIZATIONS, SCHEDULING_POLICIES, parse_size
from engine.loop.engine_args import EngineArgs
from engine.worker.models.linear_kernel import KERNELS as LINEAR_KERNELS
from server.chat_output import TOOL_CALL_PARSERS
from server.metrics_compat import COMPAT_MODES
from server.reasoning import PARSERS as REASONING_PARSERS
from server.settings import ServerSettings

API_KEY_ENV = "PAGED_SERVE_API_KEY"

# Flags that go to EngineArgs (dest name == EngineArgs field name).
ENGINE_FLAGS = (
    "model", "served_model_name", "tokenizer", "dtype", "quantization", "linear_kernel", "fused_ops", "device", "load_format", "max_model_len",
    "block_size", "kv_cache_memory", "gpu_memory_utilization", "swap_space", "num_gpu_blocks_override",
    "enable_prefix_caching", "kv_allocation", "free_window_blocks", "max_num_seqs", "max_num_batched_tokens", "preemption_mode",
    "max_preemptions_per_request", "enable_chunked_prefill", "target_itl_ms", "target_ttft_ms", "scheduling_policy", "seed", "tensor_parallel_size",
    "pipeline_parallel_size", "pipeline_micro_batches",
)


# Limit flags given as sizes ('64KiB'); dest name == ServerSettings field name.
SIZE_FLAGS = ("max_request_body_bytes", "max_tool_schema_bytes", "max_total_tool_schema_bytes",
              "max_structured_output_bytes", "responses_store_max_bytes")


@dataclass(frozen=True)
class CliConfig:
    engine_args: EngineArgs
    settings: ServerSettings
    engine_factory: str | None  # "module:callable" replacing LLMEngine.from_engine_args (tests)


class _ListArchitectures(argparse.Action):
    """--list-architectures: print the registry and exit, as --help does."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from engine.worker.models.registry import describe_architectures

        sys.stdout.write(describe_architectures())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-serve",
        description="OpenAI-compatible LLM server built around PagedAttention.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="model: HF directory, GGUF file or hub-style name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--config", default=None, help="YAML file of flag values (flags given here override it)")
    p.add_argument("--list-architectures", action=_ListArchitectures,
                   help="print the model architectures served (a config.json's `architectures`) and exit")

    net = p.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every route but /health (env {API_KEY_ENV})")
    net.add_argument("--allowed-origins", default=None,
                     help='CORS origins: a JSON list (\'["*"]\') or comma-separated')
    net.add_argument("--metrics-public", action="store_true", default=False,
                     help="serve /metrics, /kv/blocks and /dashboard without the API key")
    net.add_argument("--metrics-compat", default=None, choices=list(COMPAT_MODES),
                     help="vllm: /metrics also exports the gauges, counters and histograms vLLM has under "
                          "vLLM's names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...), for "
                          "gateways and dashboards that read those")
    net.add_argument("--chat-template", default=None, help="Jinja chat template: a file path or the template itself")
    net.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                     help="split the model's <think>...</think> text off into message.reasoning_content "
                          "(delta.reasoning_content when streaming)")
    net.add_argument("--tool-call-parser", default="json", choices=list(TOOL_CALL_PARSERS),
                     help="how tool_choice 'auto' reads calls: 'json', the whole answer as one "
                          "{\"name\", \"arguments\"} object; 'hermes', each <tool_call>{...}</tool_call> "
                          "block (Qwen, Hermes, SmolLM3 templates)")
    net.add_argument("--generation-config", default="auto", metavar="auto|vllm|PATH",
                     help="sampling defaults for requests that leave them out: 'auto' takes the "
                          "model directory's generation_config.json (temperature, top_p, top_k, "
                          "min_p, repetition_penalty, max_new_tokens as max_tokens), 'vllm' none, "
                          "or a folder or file holding a generation_config.json")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    net.add_argument("--disable-uvicorn-access-log", action="store_true", default=False)
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM/SIGINT, seconds to let requests in flight finish before ending them")
    net.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)

    lim = p.add_argument_group("limits")
    lim.add_argument("--max-logprobs", type=int, default=20, help="most logprobs / top_logprobs per token")
    lim.add_argument("--max-n", type=int, default=16, help="most choices (n) per request")
    lim.add_argument("--max-best-of", type=int, default=16)
    lim.add_argument("--max-prompts-per-request", type=int, default=64)
    lim.add_argument("--max-prompt-tokens-per-request", type=_positive, default=262144,
                     help="most prompt tokens over all prompts of one /v1/completions request")
    lim.add_argument("--max-stop-sequences", type=int, default=16)
    lim.add_argument("--max-stop-str-len", type=_positive, default=256, help="most characters of one stop string")
    lim.add_argument("--max-stop-token-ids", type=_positive, default=256, help="most stop_token_ids per request")
    lim.add_argument("--max-logit-bias", type=_positive, default=1024, help="most logit_bias entries per request")
    lim.add_argument("--max-messages", type=_positive, default=2048, help="most messages per chat request")
    lim.add_argument("--max-messages-chars", type=_positive, default=1_000_000,
                     help="most characters of message content over all messages of one chat request")
    lim.add_argument("--max-tools", type=_positive, default=128, help="most tools per chat request")
    lim.add_argument("--max-tool-schema-bytes", default="64KiB",
                     help="largest tool: its function definition (name, description, parameters) as JSON")
    lim.add_argument("--max-total-tool-schema-bytes", default="1MiB",
                     help="largest sum of the tools' function definitions (as JSON) of one request")
    lim.add_argument("--max-guided-choices", type=_positive, default=1024,
                     help="most choices of one guided_choice / structured_outputs choice constraint")
    lim.add_argument("--max-structured-output-bytes", default="64KiB",
                     help="largest structured-output constraint: its JSON schema (as JSON), regex, grammar or choices")
    lim.add_argument("--max-json-depth", type=_positive, default=64,
                     help="deepest nesting of arrays and objects in a request body and in a tool's parameters")
    lim.add_argument("--max-tokens-limit", type=int, default=None, help="cap on max_tokens (default: the context)")
    lim.add_argument("--max-request-body-bytes", default="4MiB",
                     help="largest request body, e.g. 4MiB (a larger one is answered 413)")
    lim.add_argument("--max-queued-requests", type=int, default=None,
                     help="answer 429 (Retry-After) once this many requests wait (default: unbounded)")
    lim.add_argument("--responses-store", default=None, metavar="PATH",
                     help="keep /v1/responses' stored responses in this SQLite file across restarts "
                          "(default: in memory only)")
    lim.add_argument("--responses-store-max-count", type=_positive, default=1000,
                     help="most stored responses (/v1/responses store); the oldest go first")
    lim.add_argument("--responses-store-max-bytes", default="64MiB",
                     help="most bytes of stored responses (their JSON, all together); the oldest go first")
    lim.add_argument("--engine-stall-timeout", type=float, default=120.0,
                     help="seconds: when the engine has pending work but no step has finished for this long, "
                          "/health answers 503")

    eng = p.add_argument_group("engine")
    eng.add_argument("--model", dest="model", default=None, help="same as the positional MODEL")
    eng.add_argument("--served-model-name", default=None)
    eng.add_argument("--tokenizer", default=None,
                     help="a local HF directory or .gguf whose tokenizer to use instead of the model's own")
    eng.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                     help="auto: bfloat16 on a GPU; on a CPU bfloat16 where it is native and timed clearly faster "
                          "at start-up (logged), else float32 (HF fp32 equality)")
    eng.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                     help="weights kept quantized on a CPU: auto serves a GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / "
                          "Q8_0 / Q4_K / Q5_K / Q6_K tensors as stored (other types dequantized; an fp "
                          "checkpoint stays dense), none dequantizes everything (a GGUF once, into a cache), "
                          "q8_0 / q5_1 / q5_0 / q4_0 / q4_k quantize the other linear layers to that type at load")
    eng.add_argument("--linear-kernel", default="auto", choices=list(LINEAR_KERNELS),
                     help="CPU matmul kernel of the linear layers: torch's F.linear (MKL), oneDNN over "
                          "prepacked weights, panels (our AVX2 kernel over weights packed in 16-column panels), "
                          "or auto: whichever is fastest on this CPU (timed at start-up, logged)")
    eng.add_argument("--fused-ops", action=argparse.BooleanOptionalAction, default=True,
                     help="on a CPU, residual add + RMSNorm, rotary embedding and SiLU x up as compiled one-pass "
                          "ops, and with the panels (fp32) or oneDNN (fp32, bf16) linear kernel every decoder layer in one compiled call "
                          "per step (on by default; --no-fused-ops: torch's elementwise ops, layer by layer)")
    eng.add_argument("--device", default="auto")
    eng.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument("--kv-cache-memory", default=None,
                     help="KV pool size on CPU, e.g. 2GiB (default: max-num-seqs sequences of max-model-len "
                          "tokens, at most a quarter of the memory available after the weights; docs/using.md)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--swap-space", type=float, default=None,
                     help="CPU swap pool, GiB (default: a quarter of the KV pool on a CPU, none with "
                          "--preemption-mode recompute, 1 GiB with a GPU; docs/using.md)")
    eng.add_argument("--num-gpu-blocks-override", type=int, default=None, help=argparse.SUPPRESS)
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument("--kv-allocation", default="paged", choices=["paged", "reserve"])
    eng.add_argument("--free-window-blocks", action=argparse.BooleanOptionalAction, default=True,
                     help="give back the KV blocks that fall out of a sliding window (default on)")
    eng.add_argument("--max-num-seqs", type=int, default=64)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument("--preemption-mode", default="swap", choices=["swap", "recompute"])
    eng.add_argument("--max-preemptions-per-request", type=int, default=8)
    eng.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                     help="prefill long prompts over several steps, so --max-num-batched-tokens "
                          "(default 256 on a CPU, 2048 on a GPU; off: room for a whole prompt) "
                          "bounds each step (on by default)")
    eng.add_argument("--target-itl-ms", type=float, default=None,
                     help="with chunked prefill: cut other requests' prefill chunks so that a step with decodes "
                          "takes at most this long, as estimated from the recent steps (default 200 on a CPU, "
                          "off on a GPU; 0: off)")
    eng.add_argument("--target-ttft-ms", type=float, default=None,
                     help="with --scheduling-policy fcfs: requests that arrived longer ago than this, or a "
                          "prefill backlog the cut would clear only after it, lift --target-itl-ms (default "
                          "1000; 0: never)")
    eng.add_argument("--scheduling-policy", default="shortest-prompt", choices=list(SCHEDULING_POLICIES),
                     help="the order in which waiting requests come in: shortest-prompt (the default: fresh "
                          "requests with fewer prompt tokens first, and a short prompt before a long one's "
                          "remaining chunks; requests that have run come back first, and the oldest request "
                          "is never held back), or fcfs (by arrival)")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--tensor-parallel-size", type=int, default=1)
    eng.add_argument("--pipeline-parallel-size", type=int, default=1,
                     help="split the decoder layers into this many stages, one rank (x tensor-parallel size) each")
    eng.add_argument("--pipeline-micro-batches", type=int, default=None,
                     help="micro-batches per step, so that pipeline stages overlap (default: one per stage)")
    return p


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """Flag values from YAML (keys spelled as flags, with dashes or underscores)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest for a in parser._actions}
    values = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest in ("help", "config"):
            parser.error(f"--config {path}: unknown setting {key!r}")
        values[dest] = value
    return values


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _size(args: argparse.Namespace, name: str, parser: argparse.ArgumentParser) -> int:
    """A size flag's value in bytes ('4MiB', '65536'); a parser error if it is not one."""
    flag = "--" + name.replace("_", "-")
    try:
        size = parse_size(getattr(args, name))
    except ValueError as exc:
        parser.error(f"{flag}: {exc}")
    if size < 1:
        parser.error(f"{flag}: must be at least 1 byte")
    return size


def _origins(value) -> tuple[str, ...]:
    if not value:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    value = str(value).strip()
    if value.startswith("["):
        return tuple(json.loads(value))
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def _generation_config(value: str) -> str:
    """'auto', 'vllm', or a path that exists (checked now rather than after the model loads)."""
    if value in ("auto", "vllm"):
        return value
    path = Path(value).expanduser()
    if not (path / "generation_config.json").is_file() and not path.is_file():
        raise SystemExit(f"--generation-config: {value!r} is neither 'auto', 'vllm', nor a folder or file "
                         "with a generation_config.json")
    return str(path)


def parse_args(argv: list[str] | None = None) -> CliConfig:
    parser = build_parser()
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        parser.set_defaults(**load_config_file(pre.config, parser))
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        args.model = args.model_tag
    engine_kwargs = {name: getattr(args, name) for name in ENGINE_FLAGS}
    sizes = {name: _size(args, name, parser) for name in SIZE_FLAGS}
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        allowed_origins=_origins(args.allowed_origins),
        chat_template=_chat_template(args.chat_template),
        generation_config=_generation_config(args.generation_config),
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        metrics_public=args.metrics_public,
        metrics_compat=args.metrics_compat,
        max_logprobs=args.max_logprobs,
        max_n=args.max_n,
        max_best_of=args.max_best_of,
        max_prompts_per_request=args.max_prompts_per_request,
        max_prompt_tokens_per_request=args.max_prompt_tokens_per_request,
        max_stop_sequences=args.max_stop_sequences,
        max_stop_str_len=args.max_stop_str_len,
        max_stop_token_ids=args.max_stop_token_ids,
        max_logit_bias=args.max_logit_bias,
        max_messages=args.max_messages,
        max_messages_chars=args.max_messages_chars,
        max_tools=args.max_tools,
        max_guided_choices=args.max_guided_choices,
        max_json_depth=args.max_json_depth,
        max_tokens_limit=args.max_tokens_limit,
        max_queued_requests=args.max_queued_requests,
        responses_store=args.responses_store,
        responses_store_max_count=args.responses_store_max_count,
        engine_stall_timeout=args.engine_stall_timeout,
        **sizes,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
    )
    return CliConfig(EngineArgs(**engine_kwargs), settings, args.engine_factory)
