"""A request (`SequenceGroup`) and its sequences: one while the prompt is prefilled, then
`best_of` samples forked from it that share the prompt's KV blocks.

A `Sequence` holds its tokens, its status and its sampling state; what the KV cache holds of it
(tokens computed, block hashes) is the block manager's (`BlockManager.num_computed_tokens`)."""

from __future__ import annotations

import enum
import itertools
import random
import time
from bisect import bisect_left, bisect_right


from engine.core.beam_state import BeamState
from engine.core.outputs import Logprob, OutputKind, RequestMetrics
from engine.core.sampling_params import SamplingParams
from engine.core.stop_strings import StopStrings


class SequenceStatus(enum.IntEnum):
    """Ordered: every status past SWAPPED is finished."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or the end of the context
    FINISHED_ABORTED = 5  # the client went away, or the request failed

    @property
    def is_finished(self) -> bool:
        # NOTE: the module's constant, not SequenceStatus.SWAPPED: an enum member looked up on
        # its class costs ~150 ns in Python 3.11, and this runs for every sequence at every step.
        return self > _SWAPPED

    @property
    def finish_reason(self) -> str | None:
        """The one map from status to OpenAI's finish_reason: "stop" or "length", None while
        running and for an aborted sequence (a request that ends aborted reports an error, or
        nothing: its client has gone; metrics label it "abort")."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
}

_SWAPPED = SequenceStatus.SWAPPED
_seq_ids = itertools.count()
_group_numbers = itertools.count()  # admission order, breaks ties between equal arrival times


class Sequence:
    def __init__(self, prompt_token_ids: list[int], index: int = 0, generator=None):
        self.seq_id = next(_seq_ids)
        self.index = index  # which choice of the request this is
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, Logprob]] = []
        # The generated text as the pieces appended (`append_text`): a streamed delta slices
        # only its tail (`text_slice`), and `output_text` joins the pieces where the whole text
        # is wanted. NOTE: `str +=` on an attribute copies the whole text at every token.
        self._text: list[str] = []
        self._text_starts: list[int] = []  # offset of each piece
        self.text_len = 0
        self.text_joins = 0  # joins of the whole text (tests count them)
        self.stop_reason: str | int | None = None
        self.generator = generator  # a random.Random seeded for this sample, or None (engine/sample/sampler.py)
        self.detokenizer = None  # engine.loop.tokenizer.IncrementalDetokenizer, set by the engine
        self.grammar = None  # engine.sample.structured_output.GrammarState under structured outputs
        self.sampling_row = None  # the engine's SamplingRow for it, once min_tokens no longer masks
        self.stop_state: list[int] | None = None  # the request's StopStrings state, when it has stop strings
        # OutputKind.DELTA: how much of the (visible) text and of the tokens has been reported.
        self.delta_sent = (0, 0)
        self.delta_sent_finished = False

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n: end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def append_text(self, piece: str) -> None:
        if piece:
            self._text_starts.append(self.text_len)
            self._text.append(piece)
            self.text_len += len(piece)

    def text_slice(self, start: int, end: int) -> str:
        """output_text[start:end] (0 <= start, end <= text_len), joining only the pieces that
        hold it: for a delta, the last few."""
        if start >= end:
            return ""
        starts = self._text_starts
        i, j = bisect_right(starts, start) - 1, bisect_left(starts, end)  # pieces [i, j) hold it
        text = self._text[i] if j - i == 1 else "".join(self._text[i:j])
        return text[start - starts[i]: end - starts[i]]

    @property
    def output_text(self) -> str:
        parts = self._text
        if len(parts) > 1:
            self.text_joins += 1
            parts[:] = ["".join(parts)]
            self._text_starts[:] = [0]
        return parts[0] if parts else ""

    @output_text.setter
    def output_text(self, text: str) -> None:
        self._text, self._text_starts, self.text_len = ([text], [0], len(text)) if text else ([], [], 0)

    def fork(self, index: int, generator) -> "Sequence":
        """A new sequence with the same tokens and sampling state (the block manager's `fork`
        gives it the blocks)."""
        child = Sequence(self.prompt_token_ids, index, generator)
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        child.output_text = self.output_text
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.stop_state = list(self.stop_state) if self.stop_state is not None else None
        return child

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, status={self.status.name})"


class SequenceGroup:
    """One request. Starts with a single sequence; forks into best_of after its prompt step."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # The scheduler's priority: arrival, ties by creation order (who is the oldest, who is
        # preempted first; the admission order is the scheduling policy's, admission_order.py).
        self.priority = (self.arrival_time, next(_group_numbers))
        gen = random.Random(params.seed) if params.seed is not None else None
        self.seqs: list[Sequence] = [Sequence(prompt_token_ids, 0, gen)]
        self.metrics = RequestMetrics(arrival_time=self.arrival_time, num_prompt_tokens=len(prompt_token_ids))
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.forked = params.best_of == 1  # True once the prompt's samples exist
        self.error: str | None = None  # why the request failed inside the engine, if it did
        self.invalid_request = False  # that failure was the request's own fault (a 400, not a 500)
        # With params.prompt_logprobs: one entry per prompt token (None for the first), set once
        # every prompt token has one; until then `prompt_logprobs_so_far` gathers them chunk by
        # chunk as the lead sequence prefills the prompt (engine/sample/prompt_logprobs.py).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self.prompt_logprobs_so_far: list[dict[int, Logprob] | None] = [None]
        self.beam_state: BeamState | None = None  # once a beam search has started (engine/sample/beam_search.py)
        self.output_kind = OutputKind.CUMULATIVE  # what each RequestOutput holds (set by the engine)
        self.stop_token_set = frozenset(params.stop_token_ids)
        self.stop_strings = StopStrings(params.stop) if params.stop else None
        if self.stop_strings is not None:
            self.seqs[0].stop_state = self.stop_strings.start()

    @property
    def is_beam_search(self) -> bool:
        return self.params.use_beam_search

    @property
    def prompt_logprobs_pending(self) -> bool:
        """The request asked for prompt logprobs and some are still to be computed."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def cacheable_prompt_tokens(self) -> int | None:
        """How many leading tokens the prefix cache may serve: any (None) unless prompt logprobs
        are pending; then those before the last position already scored, since the row before
        each unscored position must be computed to score it."""
        if not self.prompt_logprobs_pending:
            return None
        return len(self.prompt_logprobs_so_far) - 1

    @property
    def num_seqs_reserved(self) -> int:
        """The most sequences this request can run at once from now on (what it holds of the
        scheduler's sequence budget): best_of before its first sample (samples and beams fork
        from the prompt's sequence), then its unfinished sequences."""
        started = self.beam_state is not None if self.params.use_beam_search else self.forked
        return len(self.unfinished_seqs) if started else self.params.best_of

    # NOTE: these run for every request at every step; statuses compare as ints (an IntEnum),
    # and the common one-sequence request takes no generator.
    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status == status]

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status <= _SWAPPED]

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status > _SWAPPED
        return all(s.status > _SWAPPED for s in seqs)

    def set_status(self, status: SequenceStatus) -> None:
        for s in self.unfinished_seqs:
            s.status = status

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, seqs={self.seqs})"
