"""Choosing one of several interchangeable kernels by timing them, once per machine and model.

A caller hands `KernelChooser.choose` named candidates (callables), the workloads to time them
on, a preference order and a cache key (whatever decides the answer: the CPU, the shapes, the
dtype, ...). The chooser then

* reuses the choice recorded under that key in ``<cache dir>/kernel_choices/`` (no timing at
  all), or
* times every candidate on every workload, interleaved (A B C, B C A, C A B, ...: all of them
  under the same background load, none always first), keeps each one's median, and takes the
  incumbent (the first candidate of the preference order) unless another is faster by more
  than `margin`; then records the choice under the key.

Nothing here knows what the candidates are: the linear layers' kernels
(engine/worker/models/linear_kernel.py) are one caller, and quantized kernels can join the same
contest later by adding their names to a caller's candidates and preference order (the key
holds the candidates' names, so a new candidate re-measures).

A cache file that cannot be read, or does not describe this key and these candidates, is
ignored with a warning and measured again (then overwritten); one that cannot be written is
only logged (the next start measures again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# NOTE: a challenger must be at least 10% faster than the incumbent (geometric mean over the
# workload groups) to replace it. On the shared 2-core EPYC VMs this was written on, one
# kernel's rate moved by 15-50% from one start to the next and two kernels' min-of-3 rates
# crossed over (14 starts: 10 onednn, 4 panels, then 150-200 tok/s from the same benchmark);
# interleaved medians move their *ratio* much less, but a few percent either way is still
# noise, and a kernel under 10% faster on the linear layers (60-75% of a CPU step) is under
# ~7% of a step: not worth a choice that flips between starts.
DEFAULT_MARGIN = 0.10
# Timed repetitions per candidate and workload (after one untimed warm-up): the median of 9
# shrugs off up to 4 slow repetitions (a preempted thread on a busy machine).
DEFAULT_REPEATS = 9
CACHE_FORMAT = 1


@dataclass(frozen=True)
class Workload:
    """One piece of work every candidate is timed on.

    `make_inputs()` builds what the candidates share (weights, activations), once per workload;
    each candidate, called with those inputs, returns a zero-argument run (its own setup, e.g.
    packing, happens in that call and is not timed). A candidate's time for a `group` is the sum
    over the group's workloads of `weight` x its median run time (e.g. weight = how many layers
    have this shape). `flops` (per run) only turns the figures into GFLOP/s for the log."""

    group: str
    make_inputs: Callable[[], Any]
    weight: float = 1.0
    flops: float = 0.0


@dataclass(frozen=True)
class Choice:
    """What `KernelChooser.choose` decided. `seconds`: group -> candidate -> weighted median
    seconds (as measured then, for a reused choice); `speedups`: candidate -> its speed over the
    incumbent's (geometric mean over the groups)."""

    name: str
    measured: bool  # False: reused from `path`
    incumbent: str
    seconds: dict[str, dict[str, float]]
    speedups: dict[str, float]
    rates: dict[str, dict[str, float]] = field(default_factory=dict)  # GFLOP/s, where flops were given
    path: Path | None = None
    when: str = ""

    def describe(self, margin: float = DEFAULT_MARGIN) -> str:
        """One line for the start-up log: measured or reused, the figures, and why this one."""
        figures = "; ".join(
            f"{group}: " + ", ".join(
                f"{name} {self.rates[group][name]:.0f} GFLOP/s" if group in self.rates
                else f"{name} {secs * 1e3:.2f} ms" for name, secs in times.items())
            for group, times in self.seconds.items())
        if self.name == self.incumbent:
            others = [f"{n} {s:.2f}x" for n, s in self.speedups.items() if n != self.incumbent]
            why = (f"kept {self.incumbent}, the default, as no other was more than {margin:.0%} faster"
                   + (f" ({', '.join(others)})" if others else ""))
        else:
            why = f"{self.name} {self.speedups[self.name]:.2f}x {self.incumbent}, the default"
        source = "measured" if self.measured else f"reused the choice measured {self.when} ({self.path})"
        return f"{source}: {figures}; {why}"


def decide(seconds: Mapping[str, Mapping[str, float]], prefer: Sequence[str],
           margin: float = DEFAULT_MARGIN) -> tuple[str, str, dict[str, float]]:
    """(chosen, incumbent, speedups) from group -> candidate -> seconds: the incumbent is the
    first of `prefer` that was timed (else the first timed); a challenger replaces it only when
    its speedup (the geometric mean over the groups of the incumbent's time / its time) exceeds
    1 + `margin`, and the largest such speedup wins. Pure: no timing, no files."""
    names = list(next(iter(seconds.values())))
    incumbent = next((p for p in prefer if p in names), names[0])
    speedups = {}
    for name in names:
        logs = [math.log(times[incumbent] / max(times[name], 1e-12)) for times in seconds.values()]
        speedups[name] = math.exp(sum(logs) / len(logs))
    best = max(names, key=lambda n: speedups[n])
    chosen = best if speedups[best] > 1 + margin else incumbent
    return chosen, incumbent, speedups


class KernelChooser:
    """Times candidates and remembers the answer per key (see the module docstring).

    `kind` names the contest (the cache file's prefix: ``linear``, ...); `cache_dir` is where
    choices are kept (None: nowhere, every call measures); `clock` is what times a run (tests
    count its calls)."""

    def __init__(self, kind: str, cache_dir: Path | None, margin: float = DEFAULT_MARGIN,
                 repeats: int = DEFAULT_REPEATS, clock: Callable[[], float] = time.perf_counter):
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        self.kind = kind
        self.cache_dir = cache_dir
        self.margin = margin
        self.repeats = repeats
        self.clock = clock

    def path(self, key: Mapping) -> Path | None:
        """The file that holds the choice for `key` (a digest of it names the file)."""
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:20]
        return self.cache_dir / f"{self.kind}-{digest}.json"

    def choose(self, key: Mapping, candidates: Mapping[str, Callable[[Any], Callable[[], object]]],
               workloads: Sequence[Workload], prefer: Sequence[str] = ()) -> Choice:
        """The choice for `key` among `candidates` (name -> callable(inputs) -> run): reused from
        the cache when it holds one for this key and these names, else measured on `workloads`
        and recorded. `key` must be JSON-serialisable; the candidates' names join it."""
        if not candidates or not workloads:
            raise ValueError("choose needs at least one candidate and one workload")
        full_key = {"kind": self.kind, "candidates": sorted(candidates), "margin": self.margin,
                    "repeats": self.repeats, **key}
        path = self.path(full_key)
        cached = self._load(path, full_key, candidates) if path is not None else None
        if cached is not None:
            return cached
        seconds = self._measure(candidates, workloads)
        name, incumbent, speedups = decide(seconds, prefer, self.margin)
        rates = _rates(workloads, seconds)
        when = time.strftime("%Y-%m-%d %H:%M:%S")
        if path is not None:
            self._store(path, {"format": CACHE_FORMAT, "key": full_key, "choice": name, "incumbent": incumbent,
                               "seconds": seconds, "speedups": speedups, "rates": rates, "when": when})
        return Choice(name, True, incumbent, seconds, speedups, rates, path, when)

    def _measure(self, candidates, workloads) -> dict[str, dict[str, float]]:
        names = list(candidates)
        seconds: dict[str, dict[str, float]] = {}
        for w in workloads:
            inputs = w.make_inputs()
            runs = [candidates[name](inputs) for name in names]
            for run in runs:  # warm-up: first-touch page faults, lazy initialisation
                run()
            samples: list[list[float]] = [[] for _ in names]
            for r in range(self.repeats):
                # NOTE: each repetition starts with the next candidate, so that none is always the
                # one right after the warm-up or right after the biggest one.
                for j in range(len(names)):
                    i = (r + j) % len(names)
                    t0 = self.clock()
                    runs[i]()
                    samples[i].append(self.clock() - t0)
            group = seconds.setdefault(w.group, dict.fromkeys(names, 0.0))
            for name, times in zip(names, samples):
                group[name] += w.weight * statistics.median(times)
            del runs, inputs  # NOTE: one workload's buffers at a time (big weights, packed copies)
        return seconds

    def _load(self, path: Path, key: dict, candidates: Mapping) -> Choice | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            logger.warning("ignoring the %s kernel choice in %s (unreadable: %s); measuring again", self.kind, path, e)
            return None
        try:
            if data["format"] != CACHE_FORMAT or data["key"] != json.loads(_canonical(key)):
                raise ValueError("it is for another key")
            name = data["choice"]
            if name not in candidates:
                raise ValueError(f"its choice {name!r} is not a candidate")
            choice = Choice(name, False, str(data["incumbent"]),
                            {g: {n: float(s) for n, s in t.items()} for g, t in data["seconds"].items()},
                            {n: float(s) for n, s in data["speedups"].items()},
                            {g: {n: float(s) for n, s in t.items()} for g, t in data.get("rates", {}).items()},
                            path, str(data.get("when", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            logger.warning("ignoring the %s kernel choice in %s (%s); measuring again", self.kind, path, e)
            return None
        return choice

    def _store(self, path: Path, data: dict) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # NOTE: written aside and renamed, so that a process starting meanwhile (another
            # replica, a tensor-parallel rank) reads the old file or the new one, never half.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            logger.warning("could not record the %s kernel choice in %s (%s); the next start measures again",
                           self.kind, path, e)


def cpu_identity() -> dict[str, str]:
    """This CPU's model name and a digest of its ISA flags (from /proc/cpuinfo; the platform's
    processor name where that cannot be read): what a kernel's speed depends on besides the
    kernel, so part of a choice's key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {"model": platform.processor() or platform.machine(), "isa": ""}

    def field_of(name: str) -> str:
        return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith(name)), "")

    # NOTE: ARM kernels say "Features" where x86 says "flags", and may have no "model name".
    flags = " ".join(sorted((field_of("flags") or field_of("Features")).split()))
    return {"model": field_of("model name") or field_of("CPU part") or platform.machine(),
            "isa": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def _canonical(key: Mapping) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _rates(workloads: Sequence[Workload], seconds: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """group -> candidate -> GFLOP/s, for the groups whose workloads all give their flops."""
    flops: dict[str, float] = {}
    for w in workloads:
        flops[w.group] = flops.get(w.group, 0.0) + w.weight * w.flops if w.flops > 0 else math.nan
    return {g: {n: flops[g] / max(s, 1e-12) / 1e9 for n, s in times.items()}
            for g, times in seconds.items() if not math.isnan(flops.get(g, math.nan))}
