"""benchmarks/long_context_decode.py runs end to end on a small case (the real default model)."""

from __future__ import annotations

import re

from benchmarks.long_context_decode import main


def test_long_context_decode_runs_a_small_case(capsys):
    assert main(["--seqs", "2", "--prompt-len", "48", "--max-tokens", "4", "--kv-cache-memory", "64MiB"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"2 sequences, contexts 48-52: ([0-9.]+) output tok/s \(([0-9.]+) s\)", line)
    assert m is not None, line
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
