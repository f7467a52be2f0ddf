"""The synchronous engine: requests in, one `step()` at a time, `RequestOutput`s out.

step() = schedule -> run the model -> sample -> append tokens, detokenize, check stops
(engine/loop/output_processor.py) -> free what finished -> report. Not thread-safe: one thread owns
it (see async_engine.py).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from cuda_ext import ops
from engine.core.admission import AdmissionLimits, EngineRequest, admit
from engine.core.config import EngineConfig
from engine.core.outputs import OutputKind, RequestOutput
from engine.core.sampling_params import SamplingParams, derive_seed
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.step import SampleResult, SchedulerOutput, StepInput
from engine.kv import kv_view
from engine.kv.block_manager import BlockManager
from engine.loop.engine_args import EngineArgs
from engine.loop.output_processor import OutputProcessor
from engine.loop.request_checks import check_fits
from engine.loop.stats import StatsCollector
from engine.loop.tokenizer import apply_chat_template, load_tokenizer
from engine.sample import prompt_logprobs
from engine.sample.beam_search import BeamContext, beam_search_step
from engine.sample.sampler import Sampler, SamplingRow
from engine.sample.structured_output import (
    ConstraintUnsatisfiable,
    GrammarState,
    StructuredOutputCompiler,
    apply_grammar_masks,
)
from engine.sched.scheduler import Scheduler
from engine.worker.executor import create_executor
from engine.worker.cache_engine import kv_layout_for

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, chat_template: str | None = None):
        t0 = time.perf_counter()
        self.config = config
        self.model_config = config.model
        mc, cc = config.model, config.cache
        if mc.tokenizer is not None or mc.load_format != "dummy":
            self.tokenizer = load_tokenizer(mc.tokenizer or mc.path, chat_template)
        else:
            self.tokenizer = None
        self.chat_template = chat_template
        # NOTE: build or load the compiled ops now, not on the first request (the first build
        # takes ~10-40 s); the backend in use is logged.
        ops.backend()
        layout = kv_layout_for(mc, cc)  # (the executor's runners lay their pools out the same)
        if len(layout.groups) > 1 and config.tensor_parallel_size > 1:
            raise ValueError("tensor parallelism with sliding-window KV layer groups (a hybrid model) is not "
                             "supported yet: pass --no-free-window-blocks")
        if len(layout.groups) > 1 and config.pipeline_parallel_size > 1:
            # NOTE: a stage's runner would lay out its own layers' groups, not the block manager's
            raise ValueError("pipeline parallelism with sliding-window KV layer groups (a hybrid model) is not "
                             "supported yet: pass --no-free-window-blocks")
        self.executor = create_executor(config)  # the model, on this process or on N (tensor parallel)
        try:
            num_device, num_cpu = self.executor.num_blocks()
            # NOTE: a sequence holds a table in each KV layer group: max_model_len takes that many
            max_len_blocks = len(layout.groups) * -(-mc.max_model_len // cc.block_size)
            if num_device < max_len_blocks:
                raise ValueError(
                    f"the KV cache holds {num_device * cc.block_size} tokens ({num_device} blocks), fewer than "
                    f"max_model_len={mc.max_model_len}: raise the KV cache memory or lower max_model_len"
                )
            self.cache = self.executor.init_cache(num_device, num_cpu)
        except BaseException:
            self.executor.shutdown()  # NOTE: a failed start leaves no worker or process group behind
            raise
        self.block_manager = BlockManager(
            num_device,
            num_cpu,
            cc.block_size,
            enable_prefix_caching=cc.enable_prefix_caching,
            reserve_tokens=mc.max_model_len if cc.kv_allocation == "reserve" else None,
            windows=layout.windows,
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler()
        self.requests: dict[str, SequenceGroup] = {}
        self.eos_token_id = getattr(mc.hf_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0]
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_id, mc.max_model_len)
        self.structured_outputs = StructuredOutputCompiler(self.tokenizer, mc.hf_config.vocab_size)
        self._reset_totals()
        self._beam_context = BeamContext(
            adjusted_logits=lambda raw, group, seqs: self.sampler.adjusted_logits(
                raw, [self._row(seq, group) for seq in seqs]),
            logprob_entry=self.output_processor.logprob_entry, eos_token_id=self.eos_token_id)
        self.last_step_empty = False
        self.newly_scheduled: list[str] = []
        logger.info(
            "KV cache: %d device blocks of %d tokens (%.2f GiB, %s), %d swap blocks (%.2f GiB); "
            "up to %d concurrent requests of max_model_len=%d; engine ready in %.1f s",
            num_device,
            cc.block_size,
            num_device * self.cache.bytes_per_block / 1024**3,
            cc.kv_allocation,
            num_cpu,
            num_cpu * self.cache.bytes_per_block / 1024**3,
            num_device // max_len_blocks,
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
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        prompt_text: str | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """Queue a request of token ids (tokenizing is the caller's: the server's input
        processor, or `engine.LLM`); its outputs come in `output_kind` (engine/core/outputs.py).
        `prompt_text`: the prompt's text, if known (it is reported back). `grammar`: its
        structured-output constraint already started (`StructuredOutputCompiler.prepare`, off
        this thread), else it is started here. Raises ValueError (a `RequestError` for the
        user's fault: engine/core/admission.py, engine/loop/request_checks.py) for a prompt or width that
        cannot run, or a duplicate id; nothing is left behind."""
        if isinstance(prompt_token_ids, str):
            raise TypeError("LLMEngine.add_request takes token ids; tokenize first (engine.LLM takes text)")
        request = admit(prompt_token_ids, params, self.admission_limits, text=prompt_text, grammar=grammar)
        self.add_admitted(request_id, request, arrival_time, output_kind)

    @property
    def admission_limits(self) -> AdmissionLimits:
        """The model's limits on a prompt (engine/core/admission.py), for callers that admit requests
        themselves (the server, off this thread)."""
        return AdmissionLimits(self.model_config.hf_config.vocab_size, self.model_config.max_model_len)

    def add_admitted(self, request_id: str, request: EngineRequest, arrival_time: float | None = None,
                     output_kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        """Queue a request that passed `admit` (against `admission_limits`): only what needs
        this engine's pool and widths is checked here (engine/loop/request_checks.py). Raises as
        `add_request` does."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_fits(request, self.config, self.block_manager)
        params = request.params
        group = SequenceGroup(request_id, request.text, request.token_ids, params, arrival_time)
        group.output_kind = output_kind
        if params.guided_decoding is not None:
            group.seqs[0].grammar = request.grammar or self.structured_outputs.start(params.guided_decoding)
        self.output_processor.attach_detokenizer(group.seqs[0], group)
        self.requests[request_id] = group
        self.scheduler.add(group)

    def abort_request(self, request_id: str) -> None:
        """Finish the request as aborted and free its blocks now; unknown ids are ignored."""
        group = self.requests.pop(request_id, None)
        if group is not None:
            self.scheduler.abort(request_id)
            group.metrics.finished_time = time.monotonic()
            group.metrics.finish_reason = "abort"

    def _reset_totals(self) -> None:
        self.stats = StatsCollector(self.scheduler, self.block_manager, self.cache.bytes_per_block)
        self.last_stats = self.stats.snapshot(SchedulerOutput())

    def reset(self) -> None:
        """Forget every request run so far: a fresh KV pool (no prefix-cache entries, blocks
        handed out from id 0 again), no preemption counts or KV events, totals at 0. Only with
        no request left (engine/loop/step_calibration.py runs its requests, then this)."""
        if self.requests or self.has_unfinished_requests():
            raise RuntimeError("LLMEngine.reset with requests in flight")
        self.scheduler.reset()
        self._reset_totals()

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
        """Schedule, run the model, sample, let the scheduler update its books, report."""
        started = time.perf_counter()
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
        prompt_logprobs.assign(sched, step_input, step_output.prompt_scores, self._fail)
        forks: list[tuple[Sequence, Sequence]] = []
        dropped: list[Sequence] = []
        self._process_samples(sched, step_output.logits, now, forks, dropped)
        work = _step_work(sched) if self.scheduler.step_cost is not None else None
        self.scheduler.update_from_output(sched, forks, dropped)
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
            if output is not None:  # NOTE: never None for a finished request
                outputs.append(output)
                if output.finished:
                    self.requests.pop(group.request_id, None)
                    self.stats.finish(group, now)
        self.last_stats = self.stats.snapshot(sched)
        if work is not None:
            self.scheduler.step_cost.observe(*work, time.perf_counter() - started)
        return outputs

    def _process_samples(self, sched: SchedulerOutput, logits: torch.Tensor, now: float,
                         forks: list[tuple[Sequence, Sequence]], dropped: list[Sequence]) -> None:
        """Sample every scheduled sequence that samples this step and apply the tokens (the
        output processor); new samples and beams go to `forks`, dropped beams to `dropped`,
        for the scheduler's books. A request with best_of > 1 forks after its prompt step: its
        samples share the prompt's blocks and each draws its first token from its own generator."""
        # (request, sequence, the samples forked from it this step or None): one entry per
        # sampling sequence, its rows in order (the sequence's, then its new samples')
        work: list[tuple[SequenceGroup, Sequence, list[Sequence] | None]] = []
        beams: dict[str, tuple[SequenceGroup, list[tuple[Sequence, int]]]] = {}
        # NOTE: one pass over the step builds the rows, their logits rows and the grammar masks:
        # this runs for every sequence at every step.
        rows: list[SamplingRow] = []
        index: list[int] = []  # the logits row of each entry of `rows`
        grammars: list[tuple[int, object]] = []
        in_order = True  # index == [0, 1, 2, ...]
        for i, s in enumerate(sched.scheduled):
            if not s.samples:
                continue  # a prefill chunk short of the prompt's end: its logits row is ignored
            group = s.group
            if group.error is not None:
                continue  # failed earlier in this step (its prompt logprobs): no sample
            if group.params.use_beam_search:
                beams.setdefault(group.request_id, (group, []))[1].append((s.seq, i))
                continue
            children = None
            if not group.forked:
                children = self._fork(s.seq, group, group.params.best_of - 1, forks)
                group.forked = True
            work.append((group, s.seq, children))
            for seq in (s.seq,) if children is None else (s.seq, *children):
                row = seq.sampling_row  # NOTE: once set, valid for good (see _row)
                rows.append(row if row is not None else self._row(seq, group))
                if seq.grammar is not None:
                    grammars.append((len(index), seq.grammar))
                in_order = in_order and i == len(index)
                index.append(i)
        for group, seq_rows in beams.values():
            self._beam_step(group, seq_rows, logits, now, forks, dropped)
        if not rows:
            return
        # NOTE: when every row samples once, in order (the common decode step), and no grammar
        # masks them (in place: the model's logits are read-only), the rows need no gather.
        if grammars or not in_order or len(index) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(index, device=logits.device))
        apply_grammar_masks(logits, grammars)
        samples = self._sample(logits, rows)
        k = 0
        progress, append = self.stats.progress, self._append
        for group, seq, children in work:
            try:
                if children is None:  # NOTE: the common case: one sample
                    sample = samples[k]
                    k += 1
                    if sample is None:
                        raise RuntimeError("sampling failed for this request")
                    append(seq, group, sample)
                    progress(group, 1, now)
                    continue
                seqs = [seq, *children]
                chunk = samples[k : k + len(seqs)]
                k += len(seqs)
                if None in chunk:
                    raise RuntimeError("sampling failed for this request")
                for seq, sample in zip(seqs, chunk):
                    append(seq, group, sample)
                progress(group, len(seqs), now)
            except Exception as e:  # one request's failure must not take the others down
                self._fail(group, e)

    def _beam_step(self, group, seq_rows, logits, now, forks, dropped) -> None:
        """Beam search for one request: engine/sample/beam_search.py decides which beams live on and
        returns the decision; its forks and drops go to the scheduler's books."""
        try:
            decision = beam_search_step(self._beam_context, group, seq_rows, logits)
            forks.extend(decision.forks)
            dropped.extend(decision.dropped)
            self.stats.progress(group, decision.num_new_tokens, now)
        except Exception as e:
            self._fail(group, e)

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
        if len(seq.output_token_ids) >= p.min_tokens:
            # NOTE: the same row at every step from here on (it holds the live token lists).
            row = seq.sampling_row
            if row is None:
                row = seq.sampling_row = SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator)
            return row
        masked = group.stop_token_set  # min_tokens not reached: no stop yet
        if self.eos_token_id is not None and not p.ignore_eos:
            masked = masked | {self.eos_token_id}
        return SamplingRow(p, seq.prompt_token_ids, seq.output_token_ids, seq.generator, masked)

    def _fork(self, parent: Sequence, group: SequenceGroup, count: int,
              forks: list[tuple[Sequence, Sequence]]) -> list[Sequence]:
        """`count` samples forked from `parent` (each with its own generator); their blocks are
        shared in the scheduler's `update_from_output` (listed in `forks`)."""
        children = []
        for i in range(1, count + 1):
            seed = group.params.seed
            gen = random.Random(derive_seed(seed, i)) if seed is not None else None
            child = parent.fork(i, gen)
            self.output_processor.attach_detokenizer(child, group)
            group.seqs.append(child)
            forks.append((parent, child))
            children.append(child)
        return children

    def _append(self, seq: Sequence, group: SequenceGroup, sample: SampleResult) -> None:
        # NOTE: kept as an engine method so that a subclass can inject a per-request failure
        # here (tests/server/faulty_engine.py); the work is the output processor's.
        self.output_processor.append(seq, group, sample)

    # ---------------------------------------------------------------- views
    def cache_info(self) -> dict[str, str]:
        cc, usage = self.config.cache, self.block_manager.usage()
        return {
            "block_size": str(cc.block_size),
            "num_gpu_blocks": str(usage.num_device_blocks),
            "num_cpu_blocks": str(usage.num_cpu_blocks),
            "cache_dtype": str(self.model_config.dtype).removeprefix("torch."),
            "preemption_mode": self.config.scheduler.preemption_mode,
            "kv_allocation": cc.kv_allocation,
            "enable_prefix_caching": str(cc.enable_prefix_caching),
        }

    def block_map(self) -> dict:
        return kv_view.block_map(self.scheduler, self.last_stats)

    def request_blocks(self, request_id: str) -> dict | None:
        return kv_view.request_tables(self.scheduler, request_id)


def _step_work(sched: SchedulerOutput) -> tuple[int, int, int]:
    """(decode rows, prefill tokens, context tokens attended) of a step, before the scheduler
    advances its sequences: what `StepCost` is fitted to."""
    decodes = prefill = context = 0
    for s in sched.scheduled:
        if s.is_prefill:
            prefill += s.num_tokens
        else:
            decodes += 1
        context += s.context_tokens
    return decodes, prefill, context

