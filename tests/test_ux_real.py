"""A partial rehearsal with the REAL `claude` against the scripted model: `rehearse --task --arm
--limit` runs just those runs, end to end, and is not recorded as the study's rehearsal; its report
is pre-registered (the rehearsal fixes its plan before its runs) and opens with the verdict."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from test_e2e_real import cli_env, make_study

pytestmark = pytest.mark.real_claude


def test_a_partial_rehearsal_runs_only_what_it_names(tmp_path: Path, real_claude: str) -> None:
    study = make_study(tmp_path / "study", real_claude, arms=("A", "B", "C"))
    scratch = tmp_path / "scratch"
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--arm", "A", "--arm", "B",
                              "--limit", "2", "--repeats", "3"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    assert out["ok"] is True and out["partial"] is True and out["runs"] == 2, out
    assert out["selection"]["arms"] == ["A", "B"] and out["selection"]["limit"] == 2
    assert out["next"].startswith("python3 agentbench.py rehearse ")     # not `run`: the part proves nothing
    assert not (study / "state" / "rehearsal.json").exists()
    runs = [json.loads(p.read_text()) for p in sorted((scratch / "state" / "runs").glob("r*.json"))]
    assert len(runs) == 2 and {r["arm"] for r in runs} <= {"A", "B"}
    assert all(r["status"] == "finished" and r["outcome"] == "success" for r in runs), runs
    progress = [ln for ln in err.splitlines() if " run_started " in ln]
    assert progress and all("task=" in ln and "arm=" in ln and "=None" not in ln for ln in progress), progress
    code, md, err = run_cli(["report", "--study", str(scratch), "--format", "md"], cli_env())
    assert code == 0, (md, err[-2000:])
    head = md["markdown"].split("\n|")[0]
    assert "## Verdict" in head and "Pre-registered analysis" in md["markdown"], md["markdown"][:1500]
    # A behaviour that names a run outside the part is refused before anything is written.
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(tmp_path / "s2"), "--limit", "1",
                              "--behaviour", "r0002=idle"], cli_env())
    assert code == 2 and out["code"] == "unknown_run" and not (tmp_path / "s2").exists(), out
