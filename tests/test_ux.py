"""What a newcomer meets after the first commands: `assign` warning of a design that cannot reach
significance (or lacks power at the planned difference), naming the tasks or repeats that would."""
from __future__ import annotations

from pathlib import Path

import pytest

import agentbench as ab
from conftest import run_main
from test_experiment import tiny_study


def test_assign_warns_when_no_comparison_can_ever_be_significant(tmp_path: Path, fake_env) -> None:
    """Two tasks and five arms (the scaffolded first study grown by hand): never significant."""
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2"), arms={k: {} for k in "ABCDE"})
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    need = ab.min_tasks_for_significance(ab.REPORT_ALPHA / 4)
    assert need > 2 and ab.sign_test_min_p(need) <= ab.REPORT_ALPHA / 4 < ab.sign_test_min_p(need - 1)
    [warning] = [w for w in out["warnings"] if "never reach significance" in w]
    assert f"use at least {need} tasks" in warning and "fewer arms" in warning, warning


def test_assign_says_nothing_of_a_design_that_can_be_significant(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s", tasks=tuple(f"t{i}" for i in range(6)), arms={"A": {}, "B": {}})
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0 and out["warnings"] == [], out


def test_assign_warns_of_low_simulated_power_at_the_planned_difference(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s", tasks=tuple(f"t{i}" for i in range(8)), arms={"A": {}, "B": {}})
    code, out = run_main(["assign", "--study", str(study), "--force", "--power-delta", "0.3", "--repeats", "1"])
    assert code == 0, out
    need = out["power"]["repeats"]
    assert need and need > 1, out["power"]
    at_one = {c["repeats"]: c["power"] for c in out["power"]["simulation"]["power_by_repeats"]}[1]
    assert at_one < 0.8
    [warning] = [w for w in out["warnings"] if "simulated power" in w]
    assert f"{at_one:.2f}" in warning and f"assign --repeats {need}" in warning, warning
    # At the repeats the planner asks for, no such warning.
    code, out = run_main(["assign", "--study", str(study), "--force", "--reassign", "--power-delta", "0.3",
                          "--repeats", str(need)])
    assert code == 0 and not [w for w in out["warnings"] if "simulated power" in w], out["warnings"]


@pytest.mark.parametrize("n_tasks, arms, power, expect", [
    (5, ["A"], None, []),                                     # one arm: nothing to compare
    (5, ["A", "B"], None, ["never reach significance"]),      # 2^-4 = 0.0625 > 0.05
    (6, ["A", "B"], None, []),
    (6, ["A", "B", "C"], None, ["never reach significance"]),   # 2^-5 > 0.05 / 2
    (7, ["A", "B", "C"], None, []),
    (20, ["A", "B"], {"repeats": None, "max_repeats": 1000, "delta": 0.1, "power": 0.8, "min_tasks": 40},
     ["add tasks (the normal approximation says at least 40)"]),
    (20, ["A", "B"], {"repeats": 3, "delta": 0.2, "power": 0.8, "simulation": {"power_by_repeats": []}},
     ["3 repeats reach it"]),
    (20, ["A", "B"], {"repeats": 2, "delta": 0.2, "power": 0.8}, []),
])
def test_design_warnings_table(n_tasks, arms, power, expect) -> None:
    got = ab.design_warnings(n_tasks, arms, 2, power)
    assert len(got) == len(expect) and all(e in g for e, g in zip(expect, got)), got
