"""Looks at a study's results: each report of a study with runs still to come is logged in the
study as a look (a new one only when the counted runs changed), and with more than one look the
JSON, Markdown and HTML reports warn."""
from __future__ import annotations

import json
from pathlib import Path

import agentbench as ab
from conftest import run_main
from test_experiment import tiny_study


def _finish(study: Path, which) -> None:
    for m in json.loads((study / "state" / "manifests" / "main.json").read_text())["runs"]:
        if not which(m):
            continue
        path = study / "state" / "runs" / f"{m['run_id']}.json"
        rec = json.loads(path.read_text())
        ok = m["arm"] == "B" or m["repeat"] % 2 == 0
        rec.update(status="finished", outcome="success" if ok else "failure", validity="valid",
                   cost_usd=0.1, evaluation={"success": ok, "score": 1.0 if ok else 0.0})
        path.write_text(json.dumps(rec))


def test_reports_while_runs_are_to_come_are_logged_as_looks_and_warn_past_one(tmp_path, fake_env):
    study = tiny_study(tmp_path / "s", tasks=("t1", "t2", "t3", "t4"), arms={"A": {}, "B": {}}, repeats=2)
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    looks = study / "state" / "looks.jsonl"
    # Nothing ended: nothing seen, no look.
    code, rep = run_main(["report", "--study", str(study)])
    assert code == 0 and rep["looks"]["total"] == 0 and not looks.exists()
    _finish(study, lambda m: m["task"] in ("t1", "t2"))
    code, rep = run_main(["report", "--study", str(study)])
    assert rep["looks"] == {"interim": 1, "total": 1, "warning": None}
    assert not any(w.startswith("LOOKS") for w in rep["warnings"])
    [line] = [json.loads(x) for x in looks.read_text().splitlines()]
    assert line["counted"] == {"A": 4, "B": 4} and line["pending"] == 8
    # The same data again: no new look.
    code, rep = run_main(["report", "--study", str(study)])
    assert rep["looks"]["total"] == 1 and len(looks.read_text().splitlines()) == 1
    # More runs ended, some still to come: a second look, and every format warns.
    _finish(study, lambda m: m["task"] == "t3")
    code, rep = run_main(["report", "--study", str(study)])
    assert rep["looks"]["total"] == 2 and len(looks.read_text().splitlines()) == 2
    warning = next(w for w in rep["warnings"] if w.startswith("LOOKS"))
    assert "looked at 2 times" in warning
    code, md = run_main(["report", "--study", str(study), "--format", "md"])
    assert f"> **Warning:** {warning}" in md["markdown"]
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(tmp_path / "r.html")])
    assert "looked at 2 times" in (tmp_path / "r.html").read_text()
    # Every run ended: the final report is a look too, not logged (nothing is to come).
    _finish(study, lambda m: True)
    code, rep = run_main(["report", "--study", str(study)])
    assert rep["looks"]["total"] == 3 and len(looks.read_text().splitlines()) == 2
    assert rep["primary"]["pending_runs"] == 0


def test_looks_of_record_by_split_and_by_new_data():
    a = {"split": "main", "counted": {"A": 2}, "pending": 2, "p": {}}
    b = {"split": "main", "counted": {"A": 3}, "pending": 1, "p": {}}
    pilot = {"split": "pilot", "counted": {"A": 9}, "pending": 1, "p": {}}
    assert ab.looks_of_record([], None)["total"] == 0
    assert ab.looks_of_record([], a) == {"interim": 0, "new": True, "total": 1, "warning": None}
    assert ab.looks_of_record([a], a)["total"] == 1
    got = ab.looks_of_record([a, pilot], b)
    assert (got["interim"], got["new"], got["total"]) == (1, True, 2) and got["warning"].startswith("LOOKS")
    assert ab.look_of_report({"primary": {"per_arm": {"A": {"runs_counted": 0}}}}) is None
