"""The kernel chooser (engine/worker/models/kernel_chooser.py) with fake kernels on a fake clock: the
margin rule (decisions counted, nothing timed for real), interleaved repetitions and medians,
and the cache: a second choice reuses the first without running or timing anything, a corrupt
or foreign file is ignored with a warning and measured again, another key measures again."""

from __future__ import annotations

import json
import logging

import pytest

from engine.worker.models.kernel_chooser import KernelChooser, Workload, cpu_identity, decide


class FakeClock:
    """Time advances only when a fake kernel runs; counts how often it is read."""

    def __init__(self):
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


class FakeKernels:
    """Candidates whose runs take scripted seconds on `clock`: costs[name][group] is a number,
    or a list of per-run costs (cycled). Records the order of runs and the inputs each got."""

    def __init__(self, clock: FakeClock, costs: dict):
        self.clock, self.costs = clock, costs
        self.runs: list[tuple[str, str]] = []
        self.setups = 0

    def candidates(self) -> dict:
        return {name: self._make(name) for name in self.costs}

    def _make(self, name):
        def setup(inputs):
            self.setups += 1
            group = inputs["group"]
            cost = self.costs[name][group]
            costs = cost if isinstance(cost, list) else [cost]

            def run():
                n = sum(1 for r in self.runs if r == (name, group))
                self.runs.append((name, group))
                self.clock.now += costs[n % len(costs)]
            return run
        return setup


def workloads(*groups: str) -> list[Workload]:
    return [Workload(g, (lambda g=g: {"group": g}), flops=1e9) for g in groups]


def chooser(tmp_path, clock, **kw) -> KernelChooser:
    return KernelChooser("test", tmp_path / "choices", clock=clock, **kw)


KEY = {"cpu": {"model": "fake"}, "shapes": [[8, 8, 1]], "dtype": "float32"}


@pytest.mark.parametrize("speedup, want", [(1.05, "a"), (1.09, "a"), (1.12, "b"), (2.0, "b"), (0.5, "a")])
def test_a_challenger_must_beat_the_incumbent_by_the_margin(speedup, want):
    seconds = {"16 rows": {"a": 1.0, "b": 1.0 / speedup}}
    assert decide(seconds, prefer=("a", "b"), margin=0.10)[0] == want


def test_the_incumbent_is_the_first_preferred_candidate_that_ran():
    seconds = {"g": {"torch": 1.0, "panels": 0.95}}  # onednn absent (it cannot run here)
    chosen, incumbent, speedups = decide(seconds, prefer=("onednn", "panels", "torch"))
    assert (chosen, incumbent) == ("panels", "panels") and speedups["panels"] == 1.0
    assert decide({"g": {"x": 1.0, "y": 0.5}}, prefer=())[1] == "x"  # no preference: the first given


def test_the_speedup_is_the_geometric_mean_over_the_groups_and_the_best_challenger_wins():
    # b: 2x at decode sizes, 0.55x at prefill sizes -> 1.05x overall: not enough
    seconds = {"16 rows": {"a": 1.0, "b": 0.5, "c": 0.8}, "128 rows": {"a": 1.0, "b": 1 / 0.55, "c": 0.8}}
    chosen, _, speedups = decide(seconds, prefer=("a",))
    assert speedups["b"] == pytest.approx((2 * 0.55) ** 0.5)
    assert chosen == "c"  # 1.25x on both


def test_measuring_interleaves_the_candidates_and_takes_medians(tmp_path):
    clock = FakeClock()
    # b's runs: mostly 0.5 s, but 4 of its 9 timed repetitions take 5 s (a busy machine)
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": [0.5, 0.5, 5.0, 0.5, 5.0, 0.5, 5.0, 0.5, 5.0, 0.5]},
                                  "c": {"g": 2.0}})
    choice = chooser(tmp_path, clock, repeats=9).choose(KEY, kernels.candidates(), workloads("g"), prefer=("a",))
    assert choice.measured and choice.name == "b" and choice.seconds["g"]["b"] == 0.5
    assert choice.seconds["g"]["a"] == 1.0 and choice.rates["g"]["a"] == pytest.approx(1.0)  # 1 GFLOP in 1 s
    names = [name for name, _ in kernels.runs]
    assert names[:3] == ["a", "b", "c"]  # the untimed warm-up
    timed = names[3:]
    assert len(timed) == 27 and all(sorted(timed[i:i + 3]) == ["a", "b", "c"] for i in range(0, 27, 3))
    assert timed[0:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"]  # rotated starts
    assert clock.reads == 2 * 27 and kernels.setups == 3


def test_workload_weights_add_up_per_group(tmp_path):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"x": 1.0, "y": 1.0}, "b": {"x": 0.1, "y": 2.0}})
    loads = [Workload("g", lambda: {"group": "x"}, weight=1), Workload("g", lambda: {"group": "y"}, weight=30)]
    choice = chooser(tmp_path, clock, repeats=3).choose(KEY, kernels.candidates(), loads, prefer=("a",))
    assert choice.seconds["g"] == {"a": 31.0, "b": pytest.approx(60.1)} and choice.name == "a"


def test_a_second_choice_reuses_the_first_without_running_or_timing_anything(tmp_path, caplog):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"16 rows": 1.0}, "b": {"16 rows": 0.5}})
    first = chooser(tmp_path, clock, repeats=3).choose(KEY, kernels.candidates(), workloads("16 rows"), ("a",))
    assert first.measured and first.name == "b" and first.path.exists()
    runs, reads, setups = len(kernels.runs), clock.reads, kernels.setups

    again = chooser(tmp_path, clock, repeats=3)  # a fresh process would build a fresh chooser
    second = again.choose(KEY, kernels.candidates(), workloads("16 rows"), ("a",))
    assert (len(kernels.runs), clock.reads, kernels.setups) == (runs, reads, setups)  # nothing ran or was timed
    assert not second.measured and second.name == "b" and second.path == first.path
    assert second.seconds == first.seconds and second.speedups == first.speedups
    assert second.describe().startswith("reused the choice measured") and "GFLOP/s" in second.describe()
    assert first.describe().startswith("measured: 16 rows: a 1 GFLOP/s, b 2 GFLOP/s; b 2.00x a")


@pytest.mark.parametrize("content", ["{not json", "", '{"format": 1}', '[1, 2]', "\udcff"])
def test_a_corrupt_cache_file_is_ignored_with_a_warning_and_measured_again(tmp_path, caplog, content):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": 0.5}})
    c = chooser(tmp_path, clock, repeats=3)
    path = c.path({"kind": "test", "candidates": ["a", "b"], "margin": c.margin, "repeats": c.repeats, **KEY})
    path.parent.mkdir(parents=True)
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING):
        choice = c.choose(KEY, kernels.candidates(), workloads("g"), ("a",))
    assert choice.measured and choice.name == "b" and choice.path == path
    assert any("ignoring the test kernel choice" in r.getMessage() and "measuring again" in r.getMessage()
               for r in caplog.records)
    assert json.loads(path.read_text())["choice"] == "b"  # overwritten with a good one
    runs = len(kernels.runs)
    assert not c.choose(KEY, kernels.candidates(), workloads("g"), ("a",)).measured and len(kernels.runs) == runs


def test_a_file_naming_a_kernel_that_is_not_a_candidate_is_measured_again(tmp_path, caplog):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": 0.5}})
    c = chooser(tmp_path, clock, repeats=3)
    path = c.choose(KEY, kernels.candidates(), workloads("g"), ("a",)).path
    data = json.loads(path.read_text())
    data["choice"] = "gone"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        assert c.choose(KEY, kernels.candidates(), workloads("g"), ("a",)).measured
    assert "'gone' is not a candidate" in caplog.text


def test_another_key_or_another_set_of_candidates_measures_again(tmp_path):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": 0.5}, "q4": {"g": 0.1}})
    c = chooser(tmp_path, clock, repeats=3)
    two = {n: f for n, f in kernels.candidates().items() if n != "q4"}
    assert c.choose(KEY, two, workloads("g"), ("a",)).measured
    assert not c.choose(KEY, two, workloads("g"), ("a",)).measured
    assert c.choose({**KEY, "dtype": "bfloat16"}, two, workloads("g"), ("a",)).measured
    assert c.choose({**KEY, "cpu": {"model": "other"}}, two, workloads("g"), ("a",)).measured
    # a new candidate (a quantized kernel, say) joins: measured again, and it can win
    joined = c.choose(KEY, kernels.candidates(), workloads("g"), ("a",))
    assert joined.measured and joined.name == "q4"
    assert len(list((tmp_path / "choices").glob("test-*.json"))) == 4


def test_an_unwritable_cache_is_only_logged(tmp_path, caplog):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": 0.5}})
    (tmp_path / "choices").write_text("a file where the directory should be")
    with caplog.at_level(logging.WARNING):
        choice = chooser(tmp_path, clock, repeats=3).choose(KEY, kernels.candidates(), workloads("g"), ("a",))
    assert choice.name == "b" and "could not record the test kernel choice" in caplog.text


def test_no_cache_dir_measures_every_time(tmp_path):
    clock = FakeClock()
    kernels = FakeKernels(clock, {"a": {"g": 1.0}, "b": {"g": 0.5}})
    c = KernelChooser("test", None, clock=clock, repeats=3)
    assert c.choose(KEY, kernels.candidates(), workloads("g")).measured
    assert c.choose(KEY, kernels.candidates(), workloads("g")).measured


def test_cpu_identity_names_the_model_and_digests_the_flags():
    ident = cpu_identity()
    assert set(ident) == {"model", "isa"} and ident["model"]
