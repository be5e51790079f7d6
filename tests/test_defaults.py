"""The defaults a user relies on: each has one home (a named constant) and is the value used."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import ab, run_main


def _task_without_limits(root: Path) -> Path:
    """A task whose gate and oracle give no timeout_s and whose oracle gives no threshold."""
    t = root / "plain"
    for sub in ("public", "gate", "oracle", "reference"):
        (t / sub).mkdir(parents=True)
    (t / "public" / "TASK.md").write_text("Nothing to do.\n")
    (t / "reference" / "DONE.md").write_text("done\n")
    (t / "gate" / "ok.py").write_text("print('ok')\n")
    (t / "oracle" / "ok.py").write_text("print('ok')\n")
    (t / "task.json").write_text(json.dumps({
        "id": "plain", "title": "plain",
        "gate": {"cmd": ["{python}", "{gate}/ok.py"]},
        "oracle": {"cmd": ["{python}", "{oracle}/ok.py"]}}))
    return t


@pytest.mark.parametrize("which, expected", [("gate", ab.DEFAULT_GATE_TIMEOUT_S),
                                             ("oracle", ab.DEFAULT_ORACLE_TIMEOUT_S)])
def test_a_check_without_timeout_runs_with_the_default_it_was_validated_against(tmp_path, monkeypatch,
                                                                                which, expected):
    task = ab.load_task(_task_without_limits(tmp_path / "tasks"))
    seen: list[float] = []
    real = ab.run_command

    def spy(argv, **kw):
        seen.append(kw["timeout_s"])
        return real(argv, **kw)

    monkeypatch.setattr(ab, "run_command", spy)
    ws = tmp_path / "ws"
    ws.mkdir()
    rec = ab.run_check(ab.StudyPaths(tmp_path / "study"), ab.select_platform(), task, which, str(ws),
                       {"PATH": "/usr/bin:/bin"})
    assert rec["passed"] is True
    assert seen == [expected]
    assert ab.check_default_timeout_s(which) == expected


def test_the_oracle_timeout_default_is_the_documented_300_s():
    assert ab.DEFAULT_ORACLE_TIMEOUT_S == 300.0 and ab.DEFAULT_GATE_TIMEOUT_S == 120.0


def test_an_oracle_without_threshold_uses_the_default_pass_mark(tmp_path):
    task = ab.load_task(_task_without_limits(tmp_path / "tasks"))
    assert task.threshold == ab.DEFAULT_ORACLE_THRESHOLD == 0.9


LAUNCH = {"max_minutes": 60, "stall_after_s": 300, "orphan_after_s": 0,
          "budget": {"usd_per_run": 5.0, "wall_s": 3600, "max_turns": 200}}


@pytest.mark.parametrize("launch_changes, overrides, expected", [
    # Nothing given: the study's own limits; max_minutes bounds the session within budget.wall_s.
    ({}, {}, {"wall_s": 3600.0, "stall_after_s": 300, "orphan_after_s": 0, "max_budget_usd": 5.0, "max_turns": 200}),
    ({"max_minutes": 10}, {}, {"wall_s": 600.0}),
    ({"budget": {"usd_per_run": 2.0, "wall_s": 120, "max_turns": 7}}, {},
     {"wall_s": 120.0, "max_budget_usd": 2.0, "max_turns": 7}),
    # No budget.wall_s: the per-session cap alone.
    ({"budget": {"usd_per_run": 1.0, "wall_s": None, "max_turns": 3}}, {}, {"wall_s": 3600.0}),
    # A caller's value wins, including a falsy 0 (orphan watchdog off).
    ({"orphan_after_s": 900}, {"orphan_after_s": 0}, {"orphan_after_s": 0}),
    ({}, {"wall_s": 42.0, "max_budget_usd": 0.25, "max_turns": 1, "stall_after_s": 9},
     {"wall_s": 42.0, "max_budget_usd": 0.25, "max_turns": 1, "stall_after_s": 9}),
    ({}, {"extra": {"interrupt_after_tool_uses": 2}}, {"interrupt_after_tool_uses": 2}),
])
def test_session_limits_fill_what_the_caller_leaves_out_from_the_study(launch_changes, overrides, expected):
    launch = {**LAUNCH, **launch_changes}
    got = ab.session_limits(launch, **overrides)
    assert {k: got[k] for k in expected} == expected
    assert set(got) >= {"wall_s", "stall_after_s", "orphan_after_s", "max_budget_usd", "max_turns"}


def test_a_ping_is_one_short_turn_outside_every_budget():
    got = ab.session_limits(LAUNCH, **ab.PING_LIMITS)
    assert got == {"wall_s": 300, "max_turns": 1, "max_budget_usd": 2.0, "stall_after_s": 120, "orphan_after_s": 0}
    ab.check_job_limits(got)


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_defaults_table() -> list[tuple[str, str, list[str]]]:
    """(key, documented default, init flags) for each row of the README's table of study keys."""
    text = README.read_text(encoding="utf-8")
    table = text.split("| key | default | `init` flag | what it sets |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.strip().split("\n")[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], cells[1], re.findall(r"`(--[a-z-]+)", cells[2])))
    return rows


def help_defaults(command: str) -> dict[str, object]:
    code, out = run_main([command, "--help"])
    assert code == 0
    return {flag: opt["default"] for opt in out["options"] for flag in opt["flags"]}


def test_the_readme_table_of_study_keys_tells_the_defaults_a_new_study_gets():
    rows = readme_defaults_table()
    assert len(rows) >= 20
    seen = set()
    for keys, documented, _ in rows:
        for key in re.findall(r"`([a-z_.]+)`", keys):
            where, _, sub = key.partition(".")
            if where == "budget":
                value = ab.DEFAULT_BUDGET[sub]
            elif key in ab.DEFAULT_LAUNCH and ab.DEFAULT_LAUNCH[key] is not None and "," not in keys:
                value = ab.DEFAULT_LAUNCH[key]
            else:
                continue
            first = documented.replace("`", "").split(" ")[0].rstrip(",")
            assert first == str(value), f"README says {key} defaults to {documented!r}; the code: {value!r}"
            seen.add(key)
    assert {"model", "effort", "parallel", "max_minutes", "executor", "budget.usd_per_run",
            "budget.study_usd"} <= seen


def test_every_init_flag_the_readme_names_exists():
    flags = set(help_defaults("init"))
    named = {f for _, _, fl in readme_defaults_table() for f in fl}
    assert named and named <= flags, f"README names init flags that do not exist: {sorted(named - flags)}"


def test_a_new_study_writes_out_the_documented_defaults(tmp_path, fake_env):
    code, _ = run_main(["init", "--study", str(tmp_path / "s")])
    assert code == 0
    cfg = json.loads((tmp_path / "s" / "study.json").read_text())
    for key in ("model", "effort", "permission_mode", "tools", "parallel", "max_minutes"):
        assert cfg[key] == ab.DEFAULT_LAUNCH[key]
    assert cfg["budget"] == ab.DEFAULT_BUDGET


@pytest.mark.parametrize("command, flag, constant, readme", [
    ("wait", "--timeout", "WAIT_DEFAULT_S", "(default 540"),
    ("list", "--limit", "LIST_LIMIT_DEFAULT", "`--limit` (default 200)"),
    ("assign", "--power-base", "POWER_BASE_DEFAULT", "`--power-base P`, default 0.5"),
])
def test_a_flag_defaults_to_its_named_constant_and_the_readme_says_so(command, flag, constant, readme):
    value = getattr(ab, constant)
    assert help_defaults(command)[flag] == value
    assert readme in README.read_text(encoding="utf-8")
    assert readme.rstrip(")").endswith(f"{value:g}")


def test_a_slurm_job_asks_for_its_wall_time_plus_the_default_margin():
    argv = ab.sbatch_argv("j1", "s.sh", output="o", chdir=".", slurm={}, wall_s=60)
    minutes = int(ab.SLURM_TIME_MARGIN_DEFAULT_S // 60) + 1
    assert f"--time={minutes}" in argv and ab.SLURM_TIME_MARGIN_DEFAULT_S == 600.0
    guide = README.parent / "docs" / "GUIDE.md"      # the Slurm settings are documented there
    assert "`time_margin_s` (default 600)" in guide.read_text(encoding="utf-8")


def test_training_an_unknown_task_is_refused_by_name_even_when_the_study_has_none(tmp_path, fake_env):
    study = tmp_path / "s"
    (study / "tasks").mkdir(parents=True)
    assert run_main(["init", "--study", str(study)])[0] == 0
    code, out = run_main(["train", "--study", str(study), "--task", "nope"])
    assert code == 2 and out["code"] == "unknown_task" and out["tasks"] == ["nope"]


def test_the_readme_explains_every_oracle_probe_and_no_other():
    """The README's table of probes (what each forgery is, what a forged one says of the harness)
    names exactly the probes calibrate runs."""
    text = README.read_text(encoding="utf-8")
    table = text.split("| probe | the forgery | forged means the harness |", 1)[1].split("\n\n", 1)[0]
    named = [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")]
    assert named == list(ab.ORACLE_PROBES)
