"""Grading values: a receipt is believed only when coherent; a grader that fails is no verdict.

Before: a receipt score of NaN, Infinity or `true` counted as 1.0, a receipt's `passed` was
believed whatever the exit code, and an oracle that crashed or timed out was scored as the agent's
failure.  Here: receipt_verdict() by table, run_check() with real failing oracles, and a whole
run (fake claude) whose oracle crashes, labelled an infrastructure failure.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
from conftest import run_main
from test_experiment import make_task, manifest_of, run_record, tiny_study, write_json

R = {"passed": True, "score": 0.5}


@pytest.mark.parametrize("receipt, code, timed_out, which, required, passed, score, error", [
    # coherent receipts
    ({"passed": True, "score": 0.5}, 0, False, "oracle", False, True, 0.5, False),
    ({"passed": True}, 0, False, "oracle", False, True, 1.0, False),
    ({"passed": False, "score": 0.25}, 0, False, "oracle", False, False, 0.25, False),
    ({"passed": False}, 1, False, "gate", False, False, 0.0, False),
    # incoherent receipts are refused
    ({"passed": True, "score": float("nan")}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": True, "score": float("inf")}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": True, "score": True}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": True, "score": 1.5}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": True, "score": -0.1}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": "yes"}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": 1}, 0, False, "oracle", False, False, 0.0, True),
    ({"passed": True, "score": 1.0}, 1, False, "oracle", False, False, 0.0, True),   # exit disagrees
    ({"passed": True, "score": 1.0}, 2, False, "gate", False, False, 0.0, True),
    # no valid verdict at all
    ({"passed": True}, 0, True, "oracle", False, False, 0.0, True),                 # timed out
    (None, -9, False, "oracle", False, False, 0.0, True),                           # killed by a signal
    (None, None, False, "oracle", False, False, 0.0, True),                         # never exited
    (None, 127, False, "gate", False, False, 0.0, True),                            # could not run
    (None, 3, False, "oracle", False, False, 0.0, True),                            # oracle crashed
    (None, 0, False, "oracle", True, False, 0.0, True),                             # receipt required
    # the exit-code convention without a receipt
    (None, 0, False, "oracle", False, True, 1.0, False),
    (None, 1, False, "oracle", False, False, 0.0, False),
    (None, 2, False, "gate", False, False, 0.0, False),   # a gate's own failure code (pytest collection)
])
def test_receipt_verdict_table(receipt: Any, code: Any, timed_out: bool, which: str, required: bool,
                               passed: bool, score: float, error: bool) -> None:
    v = ab.receipt_verdict(receipt, code, timed_out, which=which, required=required)
    assert (v["passed"], v["score"], bool(v["grader_error"])) == (passed, score, error), v
    json.dumps(v, allow_nan=False)


def test_receipt_counts_are_checked() -> None:
    v = ab.receipt_verdict({"passed": False, "tests_passed": float("nan"), "tests_total": -3}, 0, False)
    assert v["tests_passed"] is None and v["tests_total"] is None
    v = ab.receipt_verdict({"passed": False, "tests_passed": 2, "tests_total": 4}, 0, False)
    assert (v["tests_passed"], v["tests_total"]) == (2, 4)


def test_a_nan_score_line_is_refused_through_parse_receipt() -> None:
    r = ab.parse_receipt('{"passed": true, "score": NaN}\n', 0, False)
    assert r["receipt"] == "refused" and r["passed"] is False and r["grader_error"]


# ---- real checks ----------------------------------------------------------------------------------

ORACLES = {
    "crash": "import sys\nsys.exit(3)\n",
    "signal": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "hang": "import time\ntime.sleep(60)\n",
    "nan": "print('{\"passed\": true, \"score\": NaN}')\n",
    "liar": "print('{\"passed\": true, \"score\": 1.0}')\nraise SystemExit(1)\n",
}


def oracle_task(tmp_path: Path, body: str, **oracle: Any) -> ab.Task:
    root = make_task(tmp_path / "tasks", "t")
    (root / "oracle" / "run.py").write_text(body)
    spec = json.loads((root / "task.json").read_text())
    spec["oracle"].update({"timeout_s": 2, **oracle})
    write_json(root / "task.json", spec)
    return ab.load_task(root)


@pytest.mark.parametrize("kind", sorted(ORACLES))
def test_an_oracle_that_gives_no_valid_verdict_is_a_grader_error(tmp_path: Path, kind: str, fake_env) -> None:
    task = oracle_task(tmp_path, ORACLES[kind])
    study = tmp_path / "study"
    study.mkdir()
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    rec = ab.run_check(ab.StudyPaths(study), ab.current_platform(), task, "oracle", str(ws), fake_env)
    assert rec["grader_error"], rec
    assert rec["success"] is False and rec["passed"] is False


def test_a_required_receipt_that_is_missing_is_a_grader_error(tmp_path: Path, fake_env) -> None:
    task = oracle_task(tmp_path, "print('all fine')\n", receipt="json")
    study = tmp_path / "study"
    study.mkdir()
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    rec = ab.run_check(ab.StudyPaths(study), ab.current_platform(), task, "oracle", str(ws), fake_env)
    assert rec["receipt"] == "missing" and rec["grader_error"]


@pytest.mark.parametrize("value", [True, 1e308, 0, -5, "60"])
def test_a_check_timeout_out_of_bounds_is_refused_by_name(tmp_path: Path, value: Any) -> None:
    root = make_task(tmp_path / "tasks", "t")
    spec = json.loads((root / "task.json").read_text())
    spec["gate"]["timeout_s"] = value
    write_json(root / "task.json", spec)
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.load_task(root)
    assert "timeout_s" in exc.value.payload["error"]


def test_a_run_whose_oracle_crashes_is_an_infrastructure_failure_not_the_agents(tmp_path: Path,
                                                                                 fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    (study / "tasks" / "tiny" / "oracle" / "run.py").write_text("import sys\nsys.exit(3)\n")
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    rid = manifest_of(study)["runs"][0]["run_id"]
    code, out = run_main(["run", "--study", str(study), "--run", rid, "--force"])
    assert code == 0, out
    rec = run_record(study, rid)
    assert rec["validity"] == "infrastructure_failure", rec
    assert rec["outcome"] == "grader_error" and rec["failure_reason"] == "grader_error"
    assert rec["validity_reason"].startswith("grader_error")
    assert rec["evaluation"]["grader_error"]


def test_special_files_in_the_workspace_neither_hang_nor_break_grading(tmp_path):
    """A FIFO, a link to an endless device and a link to a directory: recorded, never opened."""
    import threading
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("x = 1\n")
    os.mkfifo(ws / "pipe")
    (ws / "zero").symlink_to("/dev/zero")
    (ws / "up").symlink_to("..")
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(ab.artifact_manifest(ws)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the manifest blocked on a special file"
    files = got["files"]
    assert files["pipe"]["sha256"] == "special:fifo"
    assert files["zero"]["sha256"].startswith("symlink:") and files["up"]["sha256"].startswith("symlink:")
    assert files["a.py"]["sha256"] == ab.sha256_file(ws / "a.py")
    # The oracle's copy leaves the FIFO out instead of failing on it.
    copy = tmp_path / "copy"
    ab.safe_copy_tree(ws, copy, ab.DEFAULT_COPY_CAPS)
    assert sorted(p.name for p in copy.iterdir()) == ["a.py", "up", "zero"]


# ---- oracle strength and probes: the pure parts ------------------------------------------------

MUTANT_SOURCE = '''"""doc"""
def f(xs, n):
    """f's doc"""
    total = 0
    for x in xs:
        if x > n and x != 3:
            total += 1
    return total
'''


@pytest.mark.parametrize("kind, index, present, absent", [
    ("compare", 0, "x <= n", "x > n"), ("compare", 1, "x == 3", "x != 3"),
    ("boolop", 0, "x > n or x != 3", " and "), ("constant", 0, "total = 1", "total = 0"),
    ("constant", 1, "total += 2", "total += 1"), ("constant", 2, "x != 4", "x != 3"),
    ("return_none", 0, "return", "return total"), ("drop", 0, "    pass\n    for x", "total = 0"),
])
def test_each_mutant_changes_one_thing(kind, index, present, absent) -> None:
    assert (kind, index) in ab.mutation_sites(MUTANT_SOURCE)
    out = ab.mutate(MUTANT_SOURCE, kind, index)
    assert out is not None and present in out and absent not in out and absent in MUTANT_SOURCE, out
    compile(out, "<mutant>", "exec")


def test_no_mutant_drops_a_docstring_and_every_site_applies() -> None:
    sites = ab.mutation_sites(MUTANT_SOURCE)
    # f's body: docstring, total = 0, for, return -> three droppable; the for's body has one statement
    assert [i for k, i in sites if k == "drop"] == [0, 1, 2]
    assert all(ab.mutate(MUTANT_SOURCE, k, i) for k, i in sites)
    assert ab.mutation_sites("def broken(:\n") == []


def test_probe_code_goes_after_future_imports() -> None:
    src = '"""doc"""\nfrom __future__ import annotations\nX = 1\n'
    out = ab.with_probe_code(src, "PROBE = 1")
    assert out.index("from __future__") < out.index("PROBE = 1") < out.index("X = 1")
    compile(out, "<probe>", "exec")
    assert ab.with_probe_code("X = (\n", "P = 1").startswith("P = 1")


@pytest.mark.parametrize("rel, target", [("stats.py", True), ("pkg/mod.py", True), ("tests/test_a.py", False),
                                         ("test_a.py", False), ("conftest.py", False), ("a_test.py", False),
                                         ("README.md", False), ("test/helper.py", False)])
def test_which_files_carry_a_probe(rel, target) -> None:
    assert ab._probe_target(rel) is target


def test_the_report_facts_name_accepted_forgeries_and_each_tasks_mutant_share() -> None:
    cal = {"a": {"forgeable_accepted": True, "oracle_forged": ["exit_at_import"],
                 "oracle_strength": {"measured": True, "caught": 3, "mutants": 4}},
           "b": {"forgeable_accepted": False, "oracle_forged": [],
                 "oracle_strength": {"measured": False, "reason": "the reference is not a Python overlay"}},
           "junk": "x"}
    facts = ab.grading_facts(cal)
    assert facts["forgeable_accepted"] == {"a": ["exit_at_import"]}
    assert "a 3/4" in facts["strength_text"] and "b not measured (the reference is not a Python overlay)" \
        in facts["strength_text"]
    assert ab.grading_facts({}) == {"forgeable_accepted": {}, "strength_text":
                                    "oracle strength was not measured (no calibration on record)"}


@pytest.mark.parametrize("gate_passes_starter", [True, False])
def test_the_gate_is_probed_only_when_it_fails_the_untouched_starter(tmp_path, monkeypatch, gate_passes_starter):
    """A gate the starter passes proves nothing by a forgery: its probes are not run at all, and
    say `not_applicable`; one the starter fails is probed with every gate probe (here each
    forgery passes that gate, so each is `forged`), beside every oracle probe (each held here)."""
    import shutil
    study = tmp_path / "study"
    shutil.copytree(Path(ab.__file__).resolve().parent / "examples" / "study", study)
    paths = ab.StudyPaths(study)
    task = ab.load_study(paths).task("roman")
    ran: list[tuple[str, str]] = []

    def fake_check(paths, platform, task, which, ws, env, timeout_s=None):
        ran.append((which, os.path.basename(ws)))
        passed = which == "gate" and (gate_passes_starter or not ws.endswith("starter"))
        return {"passed": passed, "success": False, "score": 1.0 if passed else 0.0, "sandbox": {"kind": "bwrap"}}
    monkeypatch.setattr(ab, "run_check", fake_check)
    got = ab.run_oracle_probes(paths, ab.current_platform(), task, {}, str(tmp_path / "probes"))
    assert {p["name"]: p["verdict"] for p in got["oracle"]} == {n: "held" for n in ab.ORACLE_PROBES}
    gate_runs = sorted(w for which, w in ran if which == "gate")
    if gate_passes_starter:
        assert gate_runs == ["probe-gate-starter"]
        assert [(p["name"], p["verdict"]) for p in got["gate"]] == [(n, "not_applicable") for n in ab.GATE_PROBES]
    else:
        assert gate_runs == sorted(["probe-gate-starter"] + [f"probe-gate-{n}" for n in ab.GATE_PROBES])
        assert [(p["name"], p["verdict"]) for p in got["gate"]] == [(n, "forged") for n in ab.GATE_PROBES]
