"""The synchronous engine: requests in, one `step()` at a time, `RequestOutput`s out.

step() = schedule -> run the model -> sample -> append tokens, detokenize, check stops
(engine/output_processor.py) -> free what finished -> report. Not thread-safe: one thread owns
it (see async_engine.py).
"""

from __future__ import annotations

import logging
import time

import torch

from cuda_ext import ops
from engine import prompt_logprobs
from engine.block_manager import BlockManager
from engine.config import EngineArgs, EngineConfig
from engine.metrics import EngineStats
from engine.executor import create_executor
from engine.model_runner import StepInput
from engine.output_processor import OutputProcessor
from engine.outputs import OutputKind, RequestOutput
from engine.sampler import Sampler, SampleResult, SamplingRow
from engine.sampling_params import SamplingParams, derive_seed
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.structured_output import (
    ConstraintUnsatisfiable,
    GrammarState,
    StructuredOutputCompiler,
    apply_grammar_masks,
)
from engine.tokenizer import apply_chat_template, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None):
        t0 = time.perf_counter()
        self.config = config
        self.model_config = config.model
        mc, cc = config.model, config.cache
        self.tokenizer = load_tokenizer(mc.path, chat_template) if mc.load_format != "dummy" else None
        self.chat_template = chat_template
        # NOTE: build or load the compiled ops now, not on the first request (the first build
        # takes ~10-40 s); the backend in use is logged.
        ops.backend()
        self.executor = create_executor(config)  # the model, on this process or on N (tensor parallel)
        num_gpu, num_cpu = self.executor.num_blocks()
        max_len_blocks = -(-mc.max_model_len // cc.block_size)
        if num_gpu < max_len_blocks:
            raise ValueError(
                f"the KV cache holds {num_gpu * cc.block_size} tokens ({num_gpu} blocks), fewer than "
                f"max_model_len={mc.max_model_len}: raise the KV cache memory or lower max_model_len"
            )
        self.cache = self.executor.init_cache(num_gpu, num_cpu)
        self.block_manager = BlockManager(
            num_gpu,
            num_cpu,
            cc.block_size,
            enable_prefix_caching=cc.enable_prefix_caching,
            reserve_tokens=mc.max_model_len if cc.kv_allocation == "reserve" else None,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler()
        self.requests: dict[str, SequenceGroup] = {}
        self.eos_token_id = getattr(mc.hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0]
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_id, mc.max_model_len)
        self.structured_outputs = StructuredOutputCompiler(self.tokenizer, mc.hf_config.vocab_size)
        self._counters = {"prompt": 0, "generation": 0, "success": {}}
        self.last_step_empty = False
        self.newly_scheduled: list[str] = []
        self.last_stats = self._stats(SchedulerOutput(), [], [])
        logger.info(
            "KV cache: %d device blocks of %d tokens (%.2f GiB, %s), %d swap blocks; "
            "up to %d concurrent requests of max_model_len=%d; engine ready in %.1f s",
            num_gpu,
            cc.block_size,
            num_gpu * self.cache.bytes_per_block / 1024**3,
            cc.kv_allocation,
            num_cpu,
            num_gpu // max_len_blocks,
            mc.max_model_len,
            time.perf_counter() - t0,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, chat_template: str | None = None) -> "LLMEngine":
        return cls(args.create_engine_config(), chat_template=chat_template)

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        prompt_text: str | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """Queue a request; its outputs come in `output_kind` (engine/outputs.py). `grammar`:
        its structured-output constraint already started (`StructuredOutputCompiler.prepare`,
        off this thread), else it is started here. Raises ValueError (a user error) for an
        empty, out-of-vocabulary or too long prompt, a request wider than the scheduler
        allows, or a duplicate id."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (dummy weights): send token ids")
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        else:  # token ids, tokenized by the caller (`prompt_text`: their text, if known)
            text, token_ids = prompt_text, list(prompt)
        self._validate(token_ids, params)
        group = SequenceGroup(request_id, text, token_ids, params, arrival_time)
        group.max_tokens = self._max_tokens(len(token_ids), params)
        group.output_kind = output_kind
        if params.guided_decoding is not None:
            group.seqs[0].grammar = grammar or self.structured_outputs.start(params.guided_decoding)
        self.output_processor.attach_detokenizer(group.seqs[0], group)
        self.requests[request_id] = group
        self.scheduler.add(group)

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.model_config.max_model_len - prompt_len
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("The prompt must not be empty.")
        vocab = self.model_config.hf_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"Prompt token ids must be in [0, {vocab}).")
        max_len = self.model_config.max_model_len
        n_out = params.max_tokens if params.max_tokens is not None else 1
        if len(token_ids) + n_out > max_len:
            raise ValueError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{len(token_ids) + n_out} tokens ({len(token_ids)} in the messages, {n_out} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        sc = self.config.scheduler
        too_long = len(token_ids) > sc.max_num_batched_tokens
        if sc.enable_chunked_prefill and params.prompt_logprobs is not None and too_long:
            raise ValueError(
                f"prompt_logprobs needs the whole prompt in one step: at most max_num_batched_tokens="
                f"{sc.max_num_batched_tokens} prompt tokens with chunked prefill, got {len(token_ids)}."
            )
        bm = self.block_manager
        needed = bm.num_blocks_for(max(len(token_ids), bm.reserve_tokens or 0))
        if needed > bm.gpu.num_blocks:
            raise ValueError(
                f"The prompt needs {needed} KV blocks but the whole KV cache has {bm.gpu.num_blocks}; "
                "it can never be scheduled."
            )
        self._validate_width(len(token_ids), params)

    def _validate_width(self, prompt_len: int, params: SamplingParams) -> None:
        """The scheduler's admission contract (engine/scheduler.py): at most max_num_seqs
        sequences per request, and beams (which run together) that fit the pool together."""
        sc, bm = self.config.scheduler, self.block_manager
        width = params.best_of
        field = "best_of" if params.best_of != params.n else "n"
        if width > sc.max_num_seqs:
            raise ValueError(
                f"{field} must be at most {sc.max_num_seqs} (the server's max_num_seqs: the most sequences one "
                f"request may run at once), got {width}."
            )
        if params.use_beam_search:
            length = max(prompt_len + self._max_tokens(prompt_len, params), bm.reserve_tokens or 0)
            needed = width * bm.num_blocks_for(length)
            if needed > bm.gpu.num_blocks:
                raise ValueError(
                    f"{field} {width} is too wide for beam search over {length} tokens (prompt and max_tokens): "
                    f"the beams may need {needed} KV blocks of {bm.block_size} tokens, and the whole KV cache has "
                    f"{bm.gpu.num_blocks}. Lower the beam width or max_tokens."
                )

    def abort_request(self, request_id: str) -> None:
        """Finish the request as aborted and free its blocks now; unknown ids are ignored."""
        group = self.requests.pop(request_id, None)
        if group is not None:
            self.scheduler.abort(request_id)
            group.metrics.finished_time = time.monotonic()
            group.metrics.finish_reason = "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_health(self) -> None:
        """Raise (executor.WorkerDiedError, `fatal`) if steps can no longer run: a dead worker."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step afterwards."""
        self.executor.shutdown()

    def chat_prompt(self, messages: list[dict], chat_template: str | None = None) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights)")
        return apply_chat_template(self.tokenizer, messages, chat_template=chat_template or self.chat_template)

    # ---------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        # NOTE: with work pending, an empty step means nothing could run (the async loop backs
        # off and its watchdog counts no progress).
        self.last_step_empty = sched.is_empty
        scheduled_at = time.monotonic()
        self.newly_scheduled = []  # requests scheduled for the first time this step (left the queue)
        for s in sched.scheduled:
            if s.group.metrics.first_scheduled_time is None:
                s.group.metrics.first_scheduled_time = scheduled_at
                self.newly_scheduled.append(s.group.request_id)
        step_input = StepInput.from_scheduler_output(sched, prompt_logprobs.wanted(sched))
        step_output = self.executor.execute(step_input)
        now = time.monotonic()
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_tokens
            if s.is_prefill:
                # NOTE: blocks of a prefill that may run in parts get their prefix-cache hashes
                # once computed (Scheduler._allocate, register=False); before any fork shares them.
                self.block_manager.register_full_blocks(s.seq, s.group.params.cache_salt)
        prompt_logprobs.assign(sched, step_input, step_output.prompt_scores, self.output_processor.logprob_entry,
                               self._fail)
        ttfts, itls = self._process_samples(sched, step_output.logits, now)
        self.scheduler.free_finished()
        # A request whose only work this step was a prefill chunk short of its prompt's end has
        # nothing new to report.
        touched = {id(s.group): s.group for s in sched.scheduled if s.samples or s.group.is_finished}
        # requests the scheduler dropped (they can never run) are finished too, with their error
        for group in self.scheduler.dropped:
            touched.setdefault(id(group), group)
        self.scheduler.dropped.clear()
        outputs = []
        for group in touched.values():
            output = self.output_processor.output(group)
            if output is not None:
                outputs.append(output)
            if group.is_finished:
                self._finish(group, now)
        self.last_stats = self._stats(sched, ttfts, itls, [g.metrics for g in touched.values() if g.is_finished])
        return outputs

    def _process_samples(self, sched: SchedulerOutput, logits: torch.Tensor, now: float):
        # A request with best_of > 1 forks after its prompt step: its samples share the prompt's
        # blocks and each draws its first token from its own generator.
        work: list[tuple[SequenceGroup, list[Sequence], int]] = []  # group, seqs, logits row
        beams: dict[str, tuple[SequenceGroup, list[tuple[Sequence, int]]]] = {}
        ttfts: list[float] = []
        itls: list[float] = []
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue  # a prefill chunk short of the prompt's end: its logits row is ignored
            if s.group.error is not None:
                continue  # failed earlier in this step (its prompt logprobs): no sample
            if s.group.params.use_beam_search:
                beams.setdefault(s.group.request_id, (s.group, []))[1].append((s.seq, i))
                continue
            seqs = [s.seq]
            if not s.group.forked:
                seqs += self._fork(s.seq, s.group, s.group.params.best_of - 1)
                s.group.forked = True
            work.append((s.group, seqs, i))
        for group, seq_rows in beams.values():
            self._beam_step(group, seq_rows, logits, now, ttfts, itls)
        rows = [self._row(seq, group) for group, seqs, _ in work for seq in seqs]
        if not rows:
            return ttfts, itls
        index = torch.tensor([i for _, seqs, i in work for _ in seqs], device=logits.device)
        logits = logits.index_select(0, index)
        flat = [seq for _, seqs, _ in work for seq in seqs]
        apply_grammar_masks(logits, [(k, seq.grammar) for k, seq in enumerate(flat) if seq.grammar is not None])
        samples = self._sample(logits, rows)
        k = 0
        for group, seqs, _ in work:
            chunk = samples[k : k + len(seqs)]
            k += len(seqs)
            try:
                if any(r is None for r in chunk):
                    raise RuntimeError("sampling failed for this request")
                for seq, sample in zip(seqs, chunk):
                    self._append(seq, group, sample)
                self._record_progress(group, len(seqs), now, ttfts, itls)
            except Exception as e:  # one request's failure must not take the others down
                self._fail(group, e)
        return ttfts, itls

    def _beam_step(self, group, seq_rows, logits, now, ttfts, itls) -> None:
        """Beam search for one request (engine/beam_search.py decides which beams live on)."""
        from engine.beam_search import beam_search_step

        try:
            n = beam_search_step(self, group, seq_rows, logits)
            self._record_progress(group, n, now, ttfts, itls)
        except Exception as e:
            self._fail(group, e)

    def _record_progress(self, group, num_new_tokens, now, ttfts, itls) -> None:
        """Latency and token accounting after a request got `num_new_tokens` tokens this step;
        registers newly filled blocks for prefix caching."""
        m = group.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            ttfts.append(now - m.arrival_time)
            # NOTE: counted at the first sample, not at a prefill step: a chunked prompt may be
            # preempted (and swapped) before its last chunk.
            self._counters["prompt"] += len(group.prompt_token_ids)
        else:
            itls.append(now - m.last_token_time)
            m.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        m.num_generation_tokens += num_new_tokens
        self._counters["generation"] += num_new_tokens
        for seq in group.seqs:
            if seq.status == SequenceStatus.RUNNING and seq.seq_id in self.block_manager.tables:
                self.block_manager.register_full_blocks(seq, group.params.cache_salt)

    def _fail(self, group: SequenceGroup, e: Exception) -> None:
        """One request's failure must not take the others down: it ends aborted, with the error."""
        if isinstance(e, ConstraintUnsatisfiable):  # the request's own fault: the server says 400
            logger.warning("request %s failed: %s", group.request_id, e)
            group.error, group.invalid_request = str(e), True
        else:
            logger.exception("request %s failed while processing its sample", group.request_id)
            group.error = f"{type(e).__name__}: {e}"
        for seq in group.unfinished_seqs:
            seq.status = SequenceStatus.FINISHED_ABORTED

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult | None]:
        try:
            return self.sampler(logits, rows)
        except Exception:
            logger.exception("batched sampling failed; sampling row by row to isolate the request")
        out: list[SampleResult | None] = []
        for i, row in enumerate(rows):
            try:
                out.extend(self.sampler(logits[i : i + 1], [row]))
            except Exception:
                out.append(None)
        return out

    def _row(self, seq: Sequence, group: SequenceGroup) -> SamplingRow:
        p = group.params
        masked: frozenset[int] = frozenset()
        if len(seq.output_token_ids) < p.min_tokens:
            masked = group.stop_token_set
            if self.eos_token_id is not None and not p.ignore_eos:
                masked = masked | {self.eos_token_id}
        return SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator, masked)

    def _fork(self, parent: Sequence, group: SequenceGroup, count: int) -> list[Sequence]:
        children = []
        for i in range(1, count + 1):
            seed = group.params.seed
            gen = torch.Generator().manual_seed(derive_seed(seed, i)) if seed is not None else None
            child = parent.fork(i, gen)
            self.output_processor.attach_detokenizer(child, group)
            self.block_manager.fork(parent, child)
            group.seqs.append(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, group: SequenceGroup, sample: SampleResult) -> None:
        # NOTE: kept as an engine method so that a subclass can inject a per-request failure
        # here (tests/server/faulty_engine.py); the work is the output processor's.
        self.output_processor.append(seq, group, sample)

    def _finish(self, group: SequenceGroup, now: float) -> None:
        self.requests.pop(group.request_id, None)
        m = group.metrics
        m.finished_time = now
        statuses = {s.status for s in group.seqs}
        if SequenceStatus.FINISHED_ABORTED in statuses or group.error is not None:
            m.finish_reason = "abort"  # the metrics' label; clients never see it
        else:
            m.finish_reason = "stop" if SequenceStatus.FINISHED_STOPPED in statuses else "length"
        self._counters["success"][m.finish_reason] = self._counters["success"].get(m.finish_reason, 0) + 1

    # ---------------------------------------------------------------- views
    def _stats(self, sched: SchedulerOutput, ttfts, itls, finished=()) -> EngineStats:
        bm = self.block_manager
        u = bm.usage()
        total_slots = filled = 0
        for group in self.scheduler.running:
            for seq in group.seqs_with_status(SequenceStatus.RUNNING):
                total_slots += len(bm.tables.get(seq.seq_id, ())) * bm.block_size
                filled += min(len(seq), len(bm.tables.get(seq.seq_id, ())) * bm.block_size)
        per_block = self.cache.bytes_per_block
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_gpu_blocks=bm.gpu.num_blocks,
            num_free_gpu_blocks=bm.gpu.num_free,
            num_cpu_blocks=bm.cpu.num_blocks,
            num_free_cpu_blocks=bm.cpu.num_free,
            kv_cache_usage=u["gpu_used"] / max(bm.gpu.num_blocks, 1),
            cpu_cache_usage=u["cpu_used"] / max(bm.cpu.num_blocks, 1),
            kv_internal_fragmentation=(total_slots - filled) / total_slots if total_slots else 0.0,
            num_shared_blocks=u["shared_blocks"],
            num_blocks_saved_by_sharing=u["saved_by_sharing"],
            num_preemptions_total=dict(self.scheduler.num_preemptions),
            prompt_tokens_total=self._counters["prompt"],
            generation_tokens_total=self._counters["generation"],
            prefix_cache_queries_total=bm.prefix_queries,
            prefix_cache_hits_total=bm.prefix_hits,
            swap_in_bytes_total=self.scheduler.swapped_blocks["in"] * per_block,
            swap_out_bytes_total=self.scheduler.swapped_blocks["out"] * per_block,
            request_success_total=dict(self._counters["success"]),
            iteration_tokens=sched.num_batched_tokens,
            finished_requests=list(finished),
            time_to_first_tokens=list(ttfts),
            inter_token_latencies=list(itls),
        )

    def cache_info(self) -> dict[str, str]:
        cc = self.config.cache
        return {
            "block_size": str(cc.block_size),
            "num_gpu_blocks": str(self.block_manager.gpu.num_blocks),
            "num_cpu_blocks": str(self.block_manager.cpu.num_blocks),
            "cache_dtype": str(self.model_config.dtype).removeprefix("torch."),
            "preemption_mode": self.config.scheduler.preemption_mode,
            "kv_allocation": cc.kv_allocation,
            "enable_prefix_caching": str(cc.enable_prefix_caching),
        }

    def block_map(self) -> dict:
        states, refs, cpu = self.block_manager.block_states()
        s = self.last_stats
        return {
            "block_size": self.block_manager.block_size,
            "num_blocks": len(states),
            "num_cpu_blocks": len(cpu),
            "blocks": states,
            "ref_counts": refs,
            "cpu_blocks": cpu,
            "usage": s.kv_cache_usage,
            "fragmentation": s.kv_internal_fragmentation,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_swapped": s.num_swapped,
        }
