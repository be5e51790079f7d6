"""What a newcomer meets after the first commands: `assign` warning of a design that cannot reach
significance (or lacks power at the planned difference), naming the tasks or repeats that would."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import agentbench as ab
from conftest import chromium_layout, run_main
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


# ---- show, compare, export --format csv: through main() on a study whose runs are recorded ------------

def finished_study(root: Path, fake_env, *, win: float = 1.0, split: str = "main",
                   tasks: tuple[str, ...] = ("t1", "t2", "t3", "t4", "t5", "t6"),
                   arms: dict | None = None) -> Path:
    """A study of two arms A (baseline) and B over `tasks`, two repeats, every run recorded as
    finished: A succeeds on even repeats, B on every repeat of the first `win` share of tasks."""
    study = root if (root / "study.json").exists() else tiny_study(
        root, tasks=tasks, arms=arms or {"A": {}, "B": {}}, repeats=2)
    code, out = run_main(["assign", "--study", str(study), "--force", "--split", split])
    assert code == 0, out
    cut = round(win * len(tasks))
    for m in json.loads((study / "state" / "manifests" / f"{split}.json").read_text())["runs"]:
        rec = json.loads((study / "state" / "runs" / f"{m['run_id']}.json").read_text())
        ok = (m["repeat"] % 2 == 0) if m["arm"] == "A" else sorted(tasks).index(m["task"]) < cut
        checks = [{"id": "value", "passed": ok, "detail": "ok" if ok else "expected 42, got 0"}]
        rec.update(status="finished", outcome="success" if ok else "failure", validity="valid",
                   cost_usd=0.25, wall_s=12.0, gate_cycles=0,
                   jobs=[{"job_id": f"j{m['run_id']}", "role": "executor", "status": "ok", "cost_usd": 0.25}],
                   evaluation={"success": ok, "score": 1.0 if ok else 0.0, "passed": ok,
                               "tests_passed": int(ok), "tests_total": 1, "checks": checks})
        (study / "state" / "runs" / f"{m['run_id']}.json").write_text(json.dumps(rec))
    return study


def test_show_gives_one_run_s_summary_with_its_failed_checks(tmp_path: Path, fake_env) -> None:
    study = finished_study(tmp_path / "s", fake_env)
    manifest = json.loads((study / "state" / "manifests" / "main.json").read_text())["runs"]
    failing = next(m for m in manifest if m["arm"] == "A" and m["repeat"] == 1)
    code, out = run_main(["show", "--study", str(study), "--run", failing["run_id"]])
    assert code == 0, out
    assert (out["run_id"], out["task"], out["arm"], out["outcome"]) == (failing["run_id"], failing["task"], "A",
                                                                        "failure")
    assert out["success"] is False and out["tests"] == "0/1" and out["cost_usd"] == 0.25
    assert out["failed_checks"] == [{"id": "value", "detail": "expected 42, got 0"}]
    assert out["sessions"][0]["role"] == "executor"
    # A run retried after an attempt that ended outside the agent: its earlier attempt is named.
    rec = json.loads((study / "state" / "runs" / f"{failing['run_id']}.json").read_text())
    rec.update(attempt=2, attempts=[{"attempt": 1, "reason": "upstream_failed", "cost_usd": 0.5, "jobs": []}])
    (study / "state" / "runs" / f"{failing['run_id']}.json").write_text(json.dumps(rec))
    code, out = run_main(["show", "--study", str(study), "--run", failing["run_id"]])
    assert out["attempt"] == 2 and out["earlier_attempts"] == [{"attempt": 1, "reason": "upstream_failed",
                                                                 "cost_usd": 0.5}], out
    assert out["cost_all_attempts_usd"] == 0.75
    code, out = run_main(["show", "--study", str(study), "--run", "r9999"])
    assert code == 2 and out["code"] == "no_such_run", out
    code, out = run_main(["show", "--study", str(study), "--run", "../x"])
    assert code == 2, out


def test_export_csv_has_one_row_a_run_agreeing_with_the_records(tmp_path: Path, fake_env) -> None:
    import csv
    study = finished_study(tmp_path / "s", fake_env)
    code, out = run_main(["export", "--study", str(study), "--format", "csv", "--out", str(tmp_path / "x")])
    assert code == 0, out
    rows = list(csv.DictReader((tmp_path / "x" / "runs.csv").open()))
    records = {p.stem: json.loads(p.read_text()) for p in (study / "state" / "runs").glob("r*.json")}
    assert out["runs"] == len(rows) == len(records) == 24
    for row in rows:
        rec = records[row["run_id"]]
        assert (row["task"], row["arm"], int(row["repeat"])) == (rec["task"], rec["arm"], rec["repeat"])
        assert row["success"] == ("true" if rec["evaluation"]["success"] else "false")
        assert float(row["cost_usd"]) == rec["cost_usd"]


def test_csv_cells_never_start_a_formula() -> None:
    assert [ab.csv_cell(v) for v in ("=cmd()", "+1", "-x", "@A", "plain", None, True, 3, 0.5)] == \
        ["'=cmd()", "'+1", "'-x", "'@A", "plain", "", "true", "3", "0.5"]


def test_compare_sets_two_studies_side_by_side(tmp_path: Path, fake_env) -> None:
    one = finished_study(tmp_path / "one", fake_env, win=1.0)
    two = finished_study(tmp_path / "two", fake_env, win=0.5)
    code, out = run_main(["compare", "--study", str(one), "--study", str(two)])
    assert code == 0, out
    assert out["baseline"] == "A" and out["arms"] == ["A", "B"] and out["studies"] == [str(one), str(two)]
    for study in (one, two):
        code, rep = run_main(["report", "--study", str(study)])
        assert out["per_arm"]["B"][str(study)]["success_rate"] == rep["per_arm"]["B"]["success_rate"]
        prim = rep["primary"]["comparisons"]["B"]
        assert out["comparisons"]["B"][str(study)]["p_holm"] == prim["p_holm"]
        assert out["comparisons"]["B"][str(study)]["ci"] == prim["ci"]
        assert out["comparisons"]["B"][str(study)]["estimate"] == prim["estimate"]
    assert out["per_arm"]["B"][str(one)]["success_rate"] == 1.0
    assert out["per_arm"]["B"][str(two)]["success_rate"] == 0.5
    # Studies of other arms are refused by name; one study alone too.
    other = tiny_study(tmp_path / "other", tasks=("t1", "t2", "t3", "t4", "t5", "t6"), arms={"A": {}, "C": {}})
    code, out = run_main(["compare", "--study", str(one), "--study", str(other)])
    assert code == 2 and out["code"] == "compare_studies_differ" and out["key"] == "arms", out
    code, out = run_main(["compare", "--study", str(one)])
    assert code == 2 and out["code"] == "compare_needs_two_studies", out


# ---- progress on stderr ------------------------------------------------------------------------------

def test_progress_names_task_arm_spend_and_runs_left_and_counts_on_after_a_resume(
        tmp_path: Path, fake_env, capsys) -> None:
    study = tiny_study(tmp_path / "s", arms={"A": {}, "B": {}}, repeats=2)
    assert run_main(["calibrate", "--study", str(study)])[0] == 0
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0 and out["runs"] == 4, out
    code, out = run_main(["run", "--study", str(study), "--force", "--run", "r0001"])
    assert code == 0, out
    first = json.loads((study / "state" / "runs" / "r0001.json").read_text())
    assert first["status"] in ab.RUN_FINAL, first["status"]
    capsys.readouterr()
    code, out = run_main(["run", "--study", str(study), "--force"])   # the rest: a resumed study
    assert code == 0, out
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("agentbench: [")]
    assert lines, "no progress line"
    assert lines[0].startswith("agentbench: [1/4] "), lines[0]     # counts on from the run already ended
    assert lines[-1].startswith("agentbench: [4/4] ") and "0 runs left" in lines[-1], lines[-1]
    started = [ln for ln in lines if " run_started " in ln]
    assert started and all("task=tiny" in ln and " arm=" in ln and " attempt=1" in ln for ln in started), started
    assert not any("=None" in ln for ln in lines), lines
    assert all(" | spent $" in ln for ln in lines)
    # The spend so far includes the first call's run.
    assert f"spent ${first['cost_usd']:.2f}" in lines[0], (first["cost_usd"], lines[0])


@pytest.mark.parametrize("done, total, spent, here, elapsed, expect", [
    (0, 4, 0.0, 0, 0.0, " | spent $0.00 | 4 runs left"),
    (3, 4, 1.5, 2, 60.0, " | spent $1.50 | 1 run left | about 30 s left"),
    (4, 4, 2.0, 4, 60.0, " | spent $2.00 | 0 runs left"),
    (10, 40, 0.25, 5, 300.0, " | spent $0.25 | 30 runs left | about 30.0 min left"),
])
def test_progress_tail_table(done, total, spent, here, elapsed, expect) -> None:
    assert ab.progress_tail(done, total, spent, here, elapsed) == expect


# ---- batches apart ---------------------------------------------------------------------------------

def test_a_pilot_split_is_reported_on_its_own_and_never_pooled(tmp_path: Path, fake_env) -> None:
    study = finished_study(tmp_path / "s", fake_env, win=1.0)              # main: B always succeeds
    finished_study(study, fake_env, win=0.0, split="pilot")                # pilot: B always fails
    code, main = run_main(["report", "--study", str(study)])
    assert code == 0, main
    assert main["split"] == {"reported": "main", "left_out": {"pilot": 24}}, main["split"]
    assert main["per_arm"]["B"]["runs"] == 12 and main["per_arm"]["B"]["success_rate"] == 1.0
    assert main["analysis"]["pre_registered"] is True and main["analysis"]["source"] == "manifest of split main"
    assert any("split pilot (24)" in n and "--split pilot" in n for n in main["notes"]), main["notes"]
    code, pilot = run_main(["report", "--study", str(study), "--split", "pilot"])
    assert code == 0, pilot
    assert pilot["split"] == {"reported": "pilot", "left_out": {"main": 24}}
    assert pilot["per_arm"]["B"]["runs"] == 12 and pilot["per_arm"]["B"]["success_rate"] == 0.0
    assert pilot["analysis"]["source"] == "manifest of split pilot"
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    assert "Pre-registered analysis" in md["markdown"] and "Not pre-registered" not in md["markdown"]
    code, out = run_main(["report", "--study", str(study), "--split", "nope"])
    assert code == 2 and out["code"] == "unknown_split" and out["splits"] == ["main", "pilot"], out


@pytest.mark.parametrize("splits, manifests, asked, expect", [
    ([], [], None, "main"), (["main", None], ["main"], None, "main"), (["pilot"], ["pilot"], None, "pilot"),
    (["a", "b"], [], None, None), (["main"], ["main", "pilot"], "pilot", "pilot"),
])
def test_split_of_report_table(splits, manifests, asked, expect) -> None:
    assert ab.split_of_report(splits, manifests, asked) == expect


def test_right_after_assign_the_report_is_pre_registered(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2"), arms={"A": {}, "B": {}})
    assert run_main(["assign", "--study", str(study), "--force"])[0] == 0
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    assert code == 0 and "Pre-registered analysis" in md["markdown"], md
    assert "not pre-registered" not in md["markdown"].lower()


# ---- the Inspect export: each arm's own model and settings, the report's headline ---------------------

def test_inspect_export_names_each_arm_s_model_and_settings_and_states_the_report_s_figures(
        tmp_path: Path, fake_env) -> None:
    import zipfile
    sonnet = "claude-sonnet-4-5-20250929"
    study = finished_study(tmp_path / "s", fake_env,
                           arms={"A": {}, "B": {"model": sonnet, "effort": "low", "env": {"FLAG": "1"}}})
    # One of A's runs failed for the infrastructure: the primary view leaves it out; a plain mean
    # over every sample would not.
    rid = next(p.stem for p in sorted((study / "state" / "runs").glob("r*.json"))
               if json.loads(p.read_text())["arm"] == "A" and json.loads(p.read_text())["evaluation"]["success"])
    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    rec.update(status="error", outcome="error", validity="infrastructure_failure", evaluation=None)
    (study / "state" / "runs" / f"{rid}.json").write_text(json.dumps(rec))
    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0, rep
    code, out = run_main(["export", "--study", str(study), "--format", "inspect", "--out", str(tmp_path / "i")])
    assert code == 0, out
    headers = {}
    for f in (tmp_path / "i").glob("*.eval"):
        h = json.loads(zipfile.ZipFile(f).read("header.json"))
        headers[h["eval"]["task"]] = h
    assert headers["A"]["eval"]["model"] == "anthropic/claude-opus-4-5"
    assert headers["B"]["eval"]["model"] == f"anthropic/{sonnet}"
    meta = headers["B"]["eval"]["metadata"]["agentbench"]["arm"]
    assert meta["model"] == sonnet and meta["settings"]["model"] == sonnet
    assert meta["settings"]["effort"] == "low" and meta["settings"]["env"] == {"FLAG": "1"}
    assert {"workspace_overlay", "mcp"} <= set(meta["settings"]), sorted(meta["settings"])
    for arm in ("A", "B"):
        scores = {sc["name"]: sc for sc in headers[arm]["results"]["scores"]}
        # The log states figures to 6 decimals (as inspect-ai does).
        assert scores["success"]["metrics"]["mean"]["value"] == round(rep["per_arm"][arm]["success_rate"], 6)
        assert scores["hidden_tests"]["metrics"]["mean"]["value"] == round(rep["per_arm"][arm]["mean_score"], 6)
        assert scores["success"]["scored_samples"] == rep["per_arm"][arm]["evaluated"]
    # A's headline is 5 of 11, not 5 of 12 (the infrastructure failure is not a failure of the agent).
    assert rep["per_arm"]["A"]["success_rate"] == pytest.approx(5 / 11)


# ---- the verdict first --------------------------------------------------------------------------------

def test_the_verdict_is_one_line_per_comparison_from_the_report_s_figures(tmp_path: Path, fake_env) -> None:
    study = finished_study(tmp_path / "s", fake_env, win=1.0)   # B always, A half the time: +50 points
    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0, rep
    c = rep["primary"]["comparisons"]["B"]
    [line] = rep["verdict"]
    assert line.startswith(f"B vs A: success {c['estimate'] * 100:+.1f} points "
                           f"[{c['ci'][0] * 100:+.1f}, {c['ci'][1] * 100:+.1f}], ")
    assert f"p {ab.fmt_num(c['p'], 3)}, Holm p {ab.fmt_num(c['p_holm'], 3)}" in line
    assert c["reject"] is True and line.endswith("significant at alpha 0.05"), line
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    text = md["markdown"]
    first_table = min(i for i, ln in enumerate(text.splitlines()) if ln.startswith("|"))
    verdict_at = text.splitlines().index("## Verdict")
    assert verdict_at < first_table and text.splitlines()[verdict_at + 2] == f"- {line}"
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(tmp_path / "r.html")])
    page = (tmp_path / "r.html").read_text()
    assert page.index('<section class="verdict">') < min(page.index("<table"), page.index("<svg"))
    assert "significant at alpha 0.05" in page[:page.index("<table")]


def test_a_verdict_that_is_not_significant_says_what_more_data_would_take(tmp_path: Path, fake_env) -> None:
    study = finished_study(tmp_path / "s", fake_env, win=1.0, tasks=("t1", "t2", "t3"))
    code, rep = run_main(["report", "--study", str(study)])
    [line] = rep["verdict"]
    need = ab.min_tasks_for_significance(0.05)
    assert "not significant" in line and f"with 3 task(s) no test can reach p <= 0.05: use at least {need} tasks" \
        in line, line


def test_the_planner_s_words_for_more_data_table() -> None:
    enough = {"tasks_compared": 12, "mean_diff": 0.1}
    got = ab.verdict_more_data(enough, 0.05, 1, 0.5, 2.0)
    plan = ab.paired_power_repeats(0.5, 0.1, 12, 0.05, tau=ab.POWER_DEFAULT_TAU)
    assert (f"about {plan['repeats']} repeats per task (now about 2)" in got) or "add tasks" in got, got
    assert "no difference seen" in ab.verdict_more_data({"tasks_compared": 12, "mean_diff": 0.0}, 0.05, 1, 0.5, 2)
    assert "use at least" in ab.verdict_more_data({"tasks_compared": 2, "mean_diff": 0.5}, 0.05, 3, 0.5, 2)


def test_report_md_at_a_terminal_is_one_screen_and_full_gives_the_rest(tmp_path: Path, fake_env) -> None:
    """A real process at a pseudo-terminal: the Markdown, not JSON; one screen by default."""
    import pty
    import subprocess
    import sys
    study = finished_study(tmp_path / "s", fake_env, win=1.0)

    def at_terminal(*extra: str) -> str:
        leader, follower = pty.openpty()
        proc = subprocess.Popen([sys.executable, str(ab.HERE / "agentbench.py"), "report", "--study", str(study),
                                 "--format", "md", *extra], stdout=follower, stderr=subprocess.DEVNULL,
                                stdin=subprocess.DEVNULL, env=fake_env)
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        proc.wait(timeout=60)
        os.close(leader)
        return b"".join(chunks).decode().replace("\r\n", "\n")

    short = at_terminal()
    assert short.lstrip().startswith("# ") and "the verdict" in short, short[:300]
    assert "- B vs A: success +50.0 points" in short and len(short.splitlines()) <= 40, short
    assert "--full" in short
    full = at_terminal("--full")
    assert "## Verdict" in full and len(full.splitlines()) > len(short.splitlines()) + 10


def test_a_study_of_one_arm_still_gets_a_verdict_line(tmp_path: Path, fake_env) -> None:
    """The scaffolded first study has one arm: its report still opens with what it found."""
    study = finished_study(tmp_path / "s", fake_env, arms={"A": {}})
    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0 and rep["comparisons"] == {}, rep
    assert rep["verdict"] == [f"A alone: success {ab.fmt_pct(0.5)} over 12 evaluated run(s); nothing compared "
                              "(add an arm to study.json to compare it with this baseline)"]
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    assert f"- {rep['verdict'][0]}" in md["markdown"].split("\n|")[0]


def test_the_html_report_opens_with_the_verdict_in_the_first_screen_at_1280_px(tmp_path: Path, fake_env) -> None:
    """Headless Chromium at 1280 x 900: the verdict section is laid out inside the first screen,
    above every chart and table, no wider than the window; and the screenshot is taken."""
    study = finished_study(tmp_path / "s", fake_env, win=1.0)
    page = tmp_path / "report.html"
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(page)])
    assert code == 0, out
    got = chromium_layout(page, "var v=document.querySelector('section.verdict').getBoundingClientRect();"
                                "var firsts=[...document.querySelectorAll('svg,table')].map(e=>e.getBoundingClientRect().top);"
                                "var li=[...document.querySelectorAll('section.verdict li')].map(e=>e.textContent);"
                                "document.title=JSON.stringify({top:v.top,bottom:v.bottom,right:v.right,"
                                "first_chart:Math.min(...firsts),lines:li});", tmp_path, height=900)
    assert 0 <= got["top"] < got["bottom"] <= 900, got       # wholly inside the first screen
    assert got["right"] <= 1280 and got["bottom"] <= got["first_chart"], got
    code, rep = run_main(["report", "--study", str(study)])
    assert got["lines"] == rep["verdict"], got
