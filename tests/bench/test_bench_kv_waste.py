"""The KV-waste simulation: repeatable per seed, and it tells the seed article's story."""

import json

import pytest

from benchmarks import kv_waste

SEEDS = list(range(20))


def test_same_seed_same_result_and_seeds_differ():
    assert kv_waste.simulate(7) == kv_waste.simulate(7)
    assert kv_waste.simulate(7) != kv_waste.simulate(8)


def test_accounting_of_one_run():
    r = kv_waste.simulate(0)
    assert r.reserved_tokens == 1000 * 4096
    assert r.used_tokens <= r.paged_tokens < r.used_tokens + 1000 * 16
    assert r.paged_tokens % 16 == 0
    assert r.concurrency_gain == pytest.approx(r.reserved_tokens / r.paged_tokens)


@pytest.mark.parametrize("seed", SEEDS)
def test_numbers_match_the_seed_article(seed):
    # Article: reservation wastes 60-80% (its run: 84.2%), paging under 4% (1.1%), 6.3x.
    r = kv_waste.simulate(seed)
    assert 0.80 < r.reserve_waste < 0.88
    assert r.paged_waste < 0.02
    assert 5.0 < r.concurrency_gain < 7.5


def test_spread_over_seeds():
    s = kv_waste.simulate_many(SEEDS)["summary"]
    assert s["reserve_waste"]["mean"] == pytest.approx(0.84, abs=0.01)
    assert s["paged_waste"]["mean"] == pytest.approx(0.011, abs=0.002)
    assert s["concurrency_gain"]["mean"] == pytest.approx(6.2, abs=0.3)
    assert s["concurrency_gain"]["min"] <= s["concurrency_gain"]["mean"] <= s["concurrency_gain"]["max"]


def test_cli_writes_json_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "w.json", tmp_path / "w.png"
    assert kv_waste.main(["--seeds", "3", "--json", str(out_json), "--plot", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    assert report["params"]["seeds"] == [0, 1, 2]
    assert len(report["runs"]) == 3
    assert out_png.read_bytes().startswith(b"\x89PNG")
    assert "reserve (contiguous) waste" in capsys.readouterr().out
