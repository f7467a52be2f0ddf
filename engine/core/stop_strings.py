"""Stop strings, matched as the text grows: each step costs time linear in the new text.

A request's stop strings get a KMP failure table each, once (`StopStrings`); each sequence keeps
one matched length per stop string (its state), advanced over every new piece of text. The state
also says how much of the text's end could still grow into a stop string (`held`), which a
streamed sequence holds back. The first stop string to complete ends the text (the longest of
those completing at the same character), wherever the text was split into deltas.
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP: fail[i] is the length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopStrings:
    """One request's stop strings (non-empty), with their failure tables."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(stops)
        self._tables = [(s, len(s), _failure(s)) for s in self.stops]

    def start(self) -> list[int]:
        """The state of a sequence that has no text yet."""
        return [0] * len(self.stops)

    def feed(self, state: list[int], text: str, report: bool = True) -> tuple[int, str] | None:
        """Advance `state` (in place) over `text`. With `report`, stop at the first character
        that completes a stop string and return (its index in `text` + 1, that stop string);
        None if none completes. Without `report` (a stop may not end the text yet: min_tokens),
        completed matches are passed over."""
        tables = self._tables
        for i, c in enumerate(text):
            hit = None
            for k, (stop, n, fail) in enumerate(tables):
                j = state[k]
                while j and stop[j] != c:
                    j = fail[j - 1]
                if stop[j] == c:
                    j += 1
                if j == n:
                    if report and (hit is None or n > len(hit)):
                        hit = stop
                    j = fail[j - 1]
                state[k] = j
            if hit is not None:
                return i + 1, hit
        return None

    @staticmethod
    def held(state: list[int]) -> int:
        """How many characters at the end of the text could still be the start of a stop string."""
        return max(state, default=0)
