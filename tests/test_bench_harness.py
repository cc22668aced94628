"""The benchmark harness (benchmarks/_harness.py) recovers known ratios: arms with a known effect, a known
drift of the machine and known noise, and the stopping rule, holds and the table."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _harness as harness  # noqa: E402


class Arm:
    """A fake arm on a fake clock: each call is one run on a machine whose speed drifts linearly."""

    def __init__(self, clock: list, effect: float, drift: float = 0.0, noise: float = 0.0, seed: int = 0):
        self.clock, self.effect, self.drift, self.noise = clock, effect, drift, noise
        self.rng = random.Random(seed)

    def __call__(self) -> dict:
        self.clock[0] += 1
        slow = 1.0 + self.drift * self.clock[0]
        jitter = math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0
        return {"step_s": 0.1 * self.effect * slow * jitter, "other_s": 2.0 * slow}


def test_interval_of_equal_ratios_is_the_point():
    assert harness.interval([1.25] * 6) == pytest.approx((1.25, 1.25, 1.25))


def test_abba_cancels_a_linear_drift_and_the_aa_pairs_see_it():
    clock = [0]
    result = harness.compare("fake", baseline=Arm(clock, 1.0, drift=0.05), candidate=Arm(clock, 1.10, drift=0.05),
                             metric="step_s", target=1.2, bound="upper", min_pairs=8, max_pairs=8,
                             log=lambda _: None)
    assert result["pairs"] == 8
    # A linear drift inflates the first pair of a block and deflates the second: the mean stays at the effect.
    assert result["ci90"][0] <= 1.10 <= result["ci90"][1]
    assert result["ratio"] == pytest.approx(1.10, rel=0.01)
    # Same-arm runs three slots apart differ by the drift: the A/A noise shows it.
    assert result["aa_noise"] > 0.05
    assert result["holds"] is True
    # The other metric has no effect: its ratio is about 1.
    assert result["metrics"]["other_s"]["ratio"] == pytest.approx(1.0, abs=0.02)


def test_noise_widens_the_interval_and_the_true_effect_stays_inside():
    clock = [0]
    result = harness.compare("fake", baseline=Arm(clock, 1.0, noise=0.05, seed=1),
                             candidate=Arm(clock, 1.03, noise=0.05, seed=2), metric="step_s", target=1.02,
                             min_pairs=16, max_pairs=16, log=lambda _: None)
    lo, hi = result["ci90"]
    assert lo <= 1.03 <= hi
    assert hi - lo > 0.02  # 5% noise over 16 pairs cannot resolve a 1-point interval
    assert result["holds"] is False  # the upper bound is above the 1.02 target


def test_stops_at_the_half_width_once_the_minimum_ran():
    clock = [0]
    result = harness.compare("fake", baseline=Arm(clock, 1.0), candidate=Arm(clock, 0.5), metric="step_s",
                             target=0.6, bound="upper", min_pairs=8, max_pairs=40, log=lambda _: None)
    assert result["pairs"] == 8  # zero noise: the interval is a point after the minimum
    assert result["ci90"] == [0.5, 0.5] and result["aa_noise"] == 0.0


def test_holds_uses_the_bound_on_the_wrong_side():
    assert harness.holds([0.98, 1.019], 1.02, "upper")
    assert not harness.holds([0.98, 1.021], 1.02, "upper")
    assert harness.holds([1.6, 2.0], 1.5, "lower")
    assert not harness.holds([1.4, 2.0], 1.5, "lower")
    assert harness.exact("count", value=0.25, target=0.25)["holds"]
    assert not harness.exact("count", value=0.26, target=0.25)["holds"]
    with pytest.raises(ValueError):
        harness.holds([1, 1], 1, "sideways")


def test_emit_appends_and_the_table_lists_every_line(tmp_path, monkeypatch, capsys):
    results = tmp_path / "results.jsonl"
    monkeypatch.setenv(harness.RESULTS_ENV, str(results))
    harness.emit({"benchmark": "a", "ratio": 1.01, "ci90": [1.0, 1.02], "pairs": 8, "aa_noise": 0.01,
                  "target": 1.02, "bound": "upper", "holds": True})
    harness.emit(harness.exact("b", value=0.25, target=0.25))
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["benchmark"] for r in printed] == ["a", "b"]
    table = subprocess.run([sys.executable, str(REPO / "benchmarks" / "_harness.py"), "table", str(results)],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert table[0].split() == ["benchmark", "ratio", "ci90", "pairs", "aa_noise", "target", "holds"]
    assert table[1].split()[0] == "a" and table[1].split()[-1] == "true"
    assert table[2].split()[0] == "b" and "== 0.25" in table[2]
