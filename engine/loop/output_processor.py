"""From sampled tokens to what a request reports: text, logprobs, stops and `RequestOutput`s.

`OutputProcessor` owns the per-token bookkeeping that follows sampling (append the token, its
logprob entry, incremental detokenization, stop tokens and stop strings, the length limit) and
builds each step's `RequestOutput` from a request's sequences, in the request's `OutputKind`.
It decides nothing about scheduling and touches no tensors; the engine calls it from its own
thread. Per step and sequence its work is linear in what is new (a delta output slices only
the new text and tokens; stop strings advance a matcher over the new text).
"""

from __future__ import annotations

from engine.core.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.core.step import SampleResult
from engine.core.stop_strings import StopStrings
from engine.loop.tokenizer import IncrementalDetokenizer, decode_token
from engine.sample.sampler import needs_scores
from engine.sample.structured_output import (
    MAX_STEP_MASK_S,
    ConstraintTooComplex,
    ConstraintUnsatisfiable,
)


class OutputProcessor:
    """Settings only (tokenizer, EOS, context length); all state lives on the sequences."""

    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int):
        self.tokenizer = tokenizer  # None with dummy weights: no text, logprobs without decoded tokens
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len

    # ---------------------------------------------------------------- tokens
    def attach_detokenizer(self, seq: Sequence, group: SequenceGroup) -> None:
        """Give `seq` its own incremental detokenizer (a no-op without a tokenizer)."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                group.prompt_token_ids,
                skip_special_tokens=group.params.skip_special_tokens,
                spaces_between_special_tokens=group.params.spaces_between_special_tokens,
            )

    def decode(self, token_id: int) -> str | None:
        """One token's text, None without a tokenizer."""
        return decode_token(self.tokenizer, token_id) if self.tokenizer is not None else None

    def logprob_entry(self, result: SampleResult) -> dict[int, Logprob]:
        """The per-token logprobs entry for a scored token: the token first (its own rank), then
        its top alternatives by rank (a token already listed keeps its first entry)."""
        t = result.token_id
        entry = {t: Logprob(result.logprob, result.rank, self.decode(t))}
        for rank, (tid, lp) in enumerate(result.top_logprobs or [], start=1):
            entry.setdefault(tid, Logprob(lp, rank, self.decode(tid)))
        return entry

    def append(self, seq: Sequence, group: SequenceGroup, sample: SampleResult) -> None:
        """Append a sampled token to `seq`: its logprobs (if asked for), cumulative logprob and
        text; then finish the sequence (status, stop_reason, flushed text) on EOS, a stop token
        id, a stop string, a completed structured output, max_tokens or the end of the context.
        Raises ConstraintUnsatisfiable when the sequence's grammar rejects the token."""
        p = group.params
        t = sample.token_id
        seq.output_token_ids.append(t)
        if sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
        if seq.grammar is not None and seq.grammar.slow_mask_s is not None:
            raise ConstraintTooComplex(
                f"the structured-output constraint is too complex: a token mask took "
                f"{seq.grammar.slow_mask_s * 1e3:.0f} ms (the limit is {MAX_STEP_MASK_S * 1e3:.0f} ms); simplify it.")
        if seq.grammar is not None and not seq.grammar.accept(t):
            raise ConstraintUnsatisfiable(
                "the structured-output constraint cannot be met with this model's vocabulary: "
                + (seq.grammar.error or "").split("\n")[0])
        if p.logprobs is not None:
            seq.output_logprobs.append(self.logprob_entry(sample))
        n_out = len(seq.output_token_ids)
        can_stop = n_out >= p.min_tokens
        is_eos = t == self.eos_token_id and not p.ignore_eos
        if can_stop and (is_eos or t in group.stop_token_set):
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if is_eos else t
            if seq.detokenizer is not None:
                seq.append_text(seq.detokenizer.flush())
            return
        if seq.detokenizer is not None:
            delta = seq.detokenizer.step(t)
            seq.append_text(delta)
            if group.stop_strings is not None and delta:
                self.check_stop_strings(seq, group, delta, can_stop)
                if seq.status.is_finished:
                    return
        if seq.grammar is not None and seq.grammar.is_complete:
            seq.status = SequenceStatus.FINISHED_STOPPED  # the output is complete: nothing may follow
            if seq.detokenizer is not None:
                seq.append_text(seq.detokenizer.flush())
            return
        if n_out >= group.params.max_tokens or len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH
            if seq.detokenizer is not None:
                seq.append_text(seq.detokenizer.flush())

    @staticmethod
    def check_stop_strings(seq: Sequence, group: SequenceGroup, delta: str, can_stop: bool) -> None:
        """Advance the sequence's stop-string matcher over the `delta` just appended to its text;
        on a match (once `can_stop`), cut the text there (keeping the stop string if asked) and
        finish."""
        hit = group.stop_strings.feed(seq.stop_state, delta, report=can_stop)
        if hit is None:
            return
        end_in_delta, stop = hit
        end = seq.text_len - len(delta) + end_in_delta
        keep = group.params.include_stop_str_in_output
        seq.output_text = seq.output_text[: end if keep else end - len(stop)]
        seq.status = SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = stop

    # ---------------------------------------------------------------- outputs
    def output(self, group: SequenceGroup) -> RequestOutput | None:
        """The request's output this step in its `OutputKind`; None when there is nothing to
        report (FINAL_ONLY before the end, a DELTA with nothing new); never None for a
        finished request. best_of > n and beam search return no choices until they are
        finished (the best are not known before)."""
        kind = group.output_kind
        p = group.params
        if kind is OutputKind.DELTA and p.best_of == 1 and not p.use_beam_search:
            # NOTE: the common streaming request, at every step: its one choice's delta.
            choice = self._choice(group.seqs[0], 0, kind, p.logprobs is not None, needs_scores(p))
            if choice is None:
                return None if not group.is_finished else self.request_output(group, [], kind)
            return self.request_output(group, [choice], kind)
        if kind is OutputKind.FINAL_ONLY and not group.is_finished:
            return None
        if p.use_beam_search:
            return self.request_output(group, beam_search_outputs(self.tokenizer, group), kind)
        if p.best_of > p.n:
            if not group.is_finished:
                return None if kind is not OutputKind.CUMULATIVE else self.request_output(group, [], kind)
            best = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
            want = p.logprobs is not None
            return self.request_output(group, [self._choice(s, i, kind, want, True) for i, s in enumerate(best)],
                                       kind)
        want, scored = p.logprobs is not None, needs_scores(p)
        choices = [self._choice(s, s.index, kind, want, scored) for s in group.seqs]
        if kind is OutputKind.DELTA:
            choices = [c for c in choices if c is not None]
            if not choices and not group.is_finished:
                return None
        return self.request_output(group, choices, kind)

    def _choice(self, seq: Sequence, index: int, kind: OutputKind, want_logprobs: bool,
                scored: bool) -> CompletionOutput | None:
        """One choice: everything so far, or (DELTA) what is new since the last output of it
        (None when nothing is: no text, no tokens, not newly finished). `scored`: its
        cumulative logprob is known (else reported as None, as vLLM does)."""
        logprobs = seq.output_logprobs if want_logprobs else None
        status = seq.status
        # NOTE: without stop strings nothing is held (no call: this runs at every step)
        end = seq.text_len - (self.held(seq) if seq.stop_state is not None else 0)
        cumulative = seq.cumulative_logprob if scored else None
        if kind is not OutputKind.DELTA:
            return CompletionOutput(index, seq.output_text[:end], list(seq.output_token_ids), cumulative,
                                    list(logprobs) if logprobs is not None else None,
                                    status.finish_reason, seq.stop_reason)
        if seq.delta_sent_finished:
            return None
        sent_chars, sent_tokens = seq.delta_sent
        finished = status.is_finished
        tokens = seq.output_token_ids
        n = len(tokens)
        if end <= sent_chars and n == sent_tokens and not finished:
            return None
        seq.delta_sent = (max(end, sent_chars), n)
        seq.delta_sent_finished = finished
        return CompletionOutput(index, seq.text_slice(sent_chars, end), tokens[sent_tokens:],
                                cumulative, logprobs[sent_tokens:] if logprobs is not None else None,
                                status.finish_reason, seq.stop_reason)

    @staticmethod
    def request_output(group: SequenceGroup, outs: list[CompletionOutput],
                       kind: OutputKind = OutputKind.CUMULATIVE) -> RequestOutput:
        # NOTE: positional (RequestOutput's field order): built for every request at every step
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, group.is_finished,
                             group.prompt_logprobs, group.num_cached_tokens, group.metrics, group.error,
                             group.invalid_request, kind is OutputKind.DELTA)

    @staticmethod
    def held(seq: Sequence) -> int:
        """While running, the tail of the text that could still grow into a stop string: a
        streaming client never sees text that a stop string later removes."""
        if seq.status.is_finished or seq.stop_state is None:
            return 0
        return StopStrings.held(seq.stop_state)

    @staticmethod
    def visible_text(seq: Sequence) -> str:
        """The sequence's text less the held tail (`held`)."""
        return seq.output_text[: seq.text_len - OutputProcessor.held(seq)]


def beam_search_outputs(tokenizer, group: SequenceGroup) -> list[CompletionOutput]:
    """No choices while the search runs (or when it failed or was aborted); once done, the n
    best hypotheses by score, index 0 the best."""
    state = group.beam_state
    if state is None or not state.done:
        return []
    p = group.params
    outs = []
    for i, hyp in enumerate(state.hypotheses[: p.n]):
        if hyp.text is None:
            hyp.text = _decode(tokenizer, group, hyp.token_ids)
        outs.append(
            CompletionOutput(
                index=i,
                text=hyp.text,
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cumulative_logprob,
                logprobs=list(hyp.logprobs) if hyp.logprobs is not None else None,
                finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason,
            )
        )
    return outs


def _decode(tokenizer, group: SequenceGroup, token_ids: list[int]) -> str:
    """The hypothesis's text exactly as a streamed sequence would have it ("" without a tokenizer)."""
    if tokenizer is None:
        return ""
    p = group.params
    detok = IncrementalDetokenizer(
        tokenizer,
        group.prompt_token_ids,
        skip_special_tokens=p.skip_special_tokens,
        spaces_between_special_tokens=p.spaces_between_special_tokens,
    )
    text = "".join(detok.step(t) for t in token_ids)
    return text + detok.flush()
