"""`StepCost`: how long a step takes for what it runs, learnt from the steps the engine has run,
so that the scheduler can size prefill chunks to a step-time target.

The step-time target (`target_itl_ms`, with chunked prefill): every step's decodes wait for its
prefill chunks, so a long chunk is a long gap between tokens for every running stream. Once a
step holds decodes, the chunks of the other requests are cut so that the step's estimated time
stays within the target, with at least a block of prefill per step (`StepPlan.prefill_budget`).
Exempt: the oldest request (the scheduler's liveness argument is untouched). No cap either when
the decodes alone take half the target or more (at 64 streams on a 2-core CPU): it would spread
each prompt over many steps for gaps that stay near the decodes' own time. Under fcfs also any
request that arrived more than `target_ttft_ms` ago, and every chunk while the prompts waiting
to be prefilled are more than capped steps would clear within `target_ttft_ms`: a cap would only
move the queue's wait into TTFT. Under shortest-prompt neither (engine/sched/step_plan.py says why).

The model is linear in what a step computes:

    seconds = a + b * decode_rows + c * prefill_tokens + d * context_tokens / 1000

(`context_tokens`: the KV tokens the step's sequences attend to), with b >= c: a decode row
runs every layer for one token, as a prefill token does, and the LM head and the sampler besides.
It is fitted as `a + c * tokens + e * decode_rows + d * context_tokens / 1000` (tokens: decode
rows + prefill tokens; e = b - c) with every slope >= 0.
NOTE: steps of about the same size (the budget's, or the cap's own: decode rows + prefill tokens
the same in each) cannot tell b from c. Fitted freely, a 64-stream run's steps gave b = 0 (a row
costing nothing, the context slope and a negative intercept making up for it), and a step of
decodes alone came out at a fraction of its time. It is fitted by least squares over the recent
steps, each weighted by `decay ** age`, so it follows a machine whose speed
changes (another process, a longer context) within a few dozen steps. Until the fit has seen
enough of both kinds of work it answers None and the scheduler does not cap anything; the server
trains it before its first request (engine/loop/step_calibration.py).

Work per step: `observe` is O(1) (16 multiply-adds into the running sums); `prefill_tokens_within`
solves a 4 x 4 system (a few microseconds of Python; up to three more, smaller, when a slope
comes out negative), once per step that asks.
"""

from __future__ import annotations

_FEATURES = 4


class StepCost:
    def __init__(self, decay: float = 0.97, min_steps: int = 8) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.min_steps = min_steps  # steps with prefill, and steps with decodes, before answering
        self._xtx = [[0.0] * _FEATURES for _ in range(_FEATURES)]
        self._xty = [0.0] * _FEATURES
        self.prefill_steps = 0
        self.decode_steps = 0
        self._coef: list[float] | None = None  # the fit, solved lazily after each observation
        self._stale = True

    def observe(self, decode_rows: int, prefill_tokens: int, context_tokens: int, seconds: float) -> None:
        """One step's work and how long it took (the whole engine step: schedule, forward,
        sample, book-keeping, which is what the streams wait for between tokens)."""
        if seconds <= 0.0 or decode_rows + prefill_tokens <= 0:
            return
        x = (1.0, float(decode_rows + prefill_tokens), float(decode_rows), context_tokens / 1000.0)
        keep = self.decay
        for i in range(_FEATURES):
            row, xi = self._xtx[i], x[i]
            for j in range(_FEATURES):
                row[j] = row[j] * keep + xi * x[j]
            self._xty[i] = self._xty[i] * keep + xi * seconds
        self.prefill_steps += prefill_tokens > 0
        self.decode_steps += decode_rows > 0
        self._stale = True

    def coefficients(self) -> list[float] | None:
        """(a, b, c, d) in seconds, or None while the fit is not trustworthy: too few steps of
        either kind, or a per-token prefill cost that is not positive."""
        if self.prefill_steps < self.min_steps or self.decode_steps < self.min_steps:
            return None
        if self._stale:
            fit = _solve_nonnegative(self._xtx, self._xty)  # (a, c, e = b - c, d)
            self._coef = None if fit is None else [fit[0], fit[1] + fit[2], fit[1], fit[3]]
            self._stale = False
        coef = self._coef
        if coef is None or coef[2] <= 0.0:
            return None
        return coef

    def predict(self, decode_rows: int, prefill_tokens: int, context_tokens: int) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, d = coef
        return a + b * decode_rows + c * prefill_tokens + d * context_tokens / 1000.0

    def prefill_tokens_within(self, seconds: float, decode_rows: int, context_tokens: int) -> int | None:
        """How many prefill tokens a step that already runs `decode_rows` decodes (attending to
        `context_tokens`) can add and still take at most `seconds`; 0 when the decodes alone
        take that long; None while the fit is not trustworthy."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, d = coef
        left = seconds - (a + b * decode_rows + d * context_tokens / 1000.0)
        return max(0, int(left / c))


def _solve_nonnegative(xtx: list[list[float]], xty: list[float]) -> list[float] | None:
    """The fit with no negative per-unit cost: a slope the unconstrained fit makes negative
    (NOTE: decode rows and context grow together in most steps, so the two can trade places,
    a row 'costing' less than nothing while context costs double) is held at 0 and the rest
    refitted, the most negative first, until none is."""
    active = list(range(_FEATURES))
    while True:
        sub = _solve([[xtx[i][j] for j in active] for i in active], [xty[i] for i in active])
        if sub is None:
            return None
        coef = [0.0] * _FEATURES
        for i, value in zip(active, sub):
            coef[i] = value
        worst = min(active[1:], key=lambda i: coef[i], default=None)  # never the intercept
        if worst is None or coef[worst] >= 0.0:
            return coef
        active.remove(worst)


def _solve(xtx: list[list[float]], xty: list[float]) -> list[float] | None:
    """Ridge-regularised normal equations by Gaussian elimination with partial pivoting;
    None if singular. NOTE: a small ridge on the slopes keeps the fit defined when a feature
    has not varied yet (every step at the same batch size, say); it barely moves a fit that
    the data determine."""
    n = len(xty)
    scale = max(xtx[0][0], 1e-12)
    m = [row[:] + [xty[i]] for i, row in enumerate(xtx)]
    for i in range(1, n):
        m[i][i] = m[i][i] * (1.0 + 1e-6) + 1e-9 * scale
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    coef = [0.0] * n
    for i in range(n - 1, -1, -1):
        coef[i] = (m[i][n] - sum(m[i][k] * coef[k] for k in range(i + 1, n))) / m[i][i]
    return coef
