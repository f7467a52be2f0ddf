"""From sampled tokens to what a request reports: text, logprobs, stops and `RequestOutput`s.

`OutputProcessor` owns the per-token bookkeeping that follows sampling (append the token, its
logprob entry, incremental detokenization, stop tokens and stop strings, the length limit) and
builds each step's `RequestOutput` from a request's sequences. It decides nothing about
scheduling and touches no tensors; the engine calls it from its own thread.
"""

from __future__ import annotations

from engine.beam_search import beam_search_outputs
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampler import SampleResult
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.structured_output import ConstraintUnsatisfiable
from engine.tokenizer import IncrementalDetokenizer, decode_token


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
        seq.cumulative_logprob += sample.logprob
        if seq.grammar is not None and not seq.grammar.accept(t):
            raise ConstraintUnsatisfiable(
                "the structured-output constraint cannot be met with this model's vocabulary: "
                + (seq.grammar.error or "").split("\n")[0])
        if p.logprobs is not None:
            seq.output_logprobs.append(self.logprob_entry(sample))
        n_out = len(seq.output_token_ids)
        can_stop = n_out >= p.min_tokens
        is_eos = t == self.eos_token_id and not p.ignore_eos
        if can_stop and (is_eos or t in p.stop_token_ids):
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if is_eos else t
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()
            return
        if seq.detokenizer is not None:
            delta = seq.detokenizer.step(t)
            seq.output_text += delta
            if can_stop and p.stop and delta:
                self.check_stop_strings(seq, p, len(delta))
                if seq.status.is_finished:
                    return
        if seq.grammar is not None and seq.grammar.is_complete:
            seq.status = SequenceStatus.FINISHED_STOPPED  # the output is complete: nothing may follow
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()
            return
        if n_out >= group.max_tokens or len(seq) >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH
            if seq.detokenizer is not None:
                seq.output_text += seq.detokenizer.flush()

    @staticmethod
    def check_stop_strings(seq: Sequence, p: SamplingParams, new_chars: int) -> None:
        """Look for a stop string in the text that the last `new_chars` characters could have
        completed; on a match, cut the text there (keeping the stop string if asked) and finish."""
        text = seq.output_text
        longest = max(len(s) for s in p.stop)
        region_start = max(0, len(text) - new_chars - longest + 1)
        best = None
        for stop in p.stop:
            i = text.find(stop, region_start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            seq.output_text = text[: i + len(stop)] if p.include_stop_str_in_output else text[:i]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = stop

    # ---------------------------------------------------------------- outputs
    def output(self, group: SequenceGroup) -> RequestOutput:
        """The request's cumulative output now. best_of > n and beam search return no choices
        until they are finished (the best are not known before)."""
        p = group.params
        if p.use_beam_search:
            return self.request_output(group, beam_search_outputs(self.tokenizer, group))
        seqs = group.seqs
        if group.is_finished and p.best_of > p.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: p.n]
        elif p.best_of > p.n:
            seqs = []  # best_of: nothing is returned until the best are known
        outs = [
            CompletionOutput(
                index=i if p.best_of > p.n else s.index,
                text=self.visible_text(s, p),
                token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob,
                logprobs=list(s.output_logprobs) if p.logprobs is not None else None,
                finish_reason=s.status.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(seqs)
        ]
        return self.request_output(group, outs)

    @staticmethod
    def request_output(group: SequenceGroup, outs: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.is_finished,
            prompt_logprobs=group.prompt_logprobs,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
            error=group.error,
            invalid_request=group.invalid_request,
        )

    @staticmethod
    def visible_text(seq: Sequence, p: SamplingParams) -> str:
        """While running, hold back a tail that could still grow into a stop string, so a
        streaming client never sees text that a stop string later removes."""
        text = seq.output_text
        if seq.status.is_finished or not p.stop:
            return text
        hold = 0
        for stop in p.stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return text[: len(text) - hold]
