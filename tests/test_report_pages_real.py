"""The report of a rehearsed study (REAL `claude` against the scripted model on loopback): an
honest arm with a feedback cycle and a review (D), one that games the public tests (A), one that
reads the hidden tests (B), one that does nothing (C).  The report's behaviour figures are checked
against the run records, the differential-exclusion note is in every format, and the HTML
directory parses, links only to pages that exist, and shows each run's own tool calls."""
from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse

import pytest

from conftest import run_cli
from test_e2e_real import assign_by_position, cli_env, make_study, records

BEHAVIOURS = {"A": "game_tests", "B": "peek_oracle", "C": "idle", "D": "solve"}


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory, real_claude) -> dict:
    base = tmp_path_factory.mktemp("report-pages")
    study = make_study(base / "study", real_claude)
    by_arm = {r["arm"]: r["run_id"] for r in assign_by_position(study, 1)}
    scratch = base / "scratch"
    args = ["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1", "--parallel", "2"]
    for arm, how in BEHAVIOURS.items():
        args += ["--behaviour", f"{by_arm[arm]}={how}"]
    code, out, err = run_cli(args, cli_env(), timeout=420)
    assert code == 0, (out, err[-3000:])
    return {"scratch": scratch, "by_arm": by_arm, "runs": records(scratch), "base": base}


def report(scratch: Path, fmt: str, *extra: str) -> dict:
    code, out, err = run_cli(["report", "--study", str(scratch), "--format", fmt, *extra], cli_env())
    assert code == 0, (out, err[-2000:])
    return out


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.tools, self.open = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("href", "src"):
            if a.get(key):
                self.links.append(a[key])
        if "data-tool" in a:
            self.tools.append(a["data-tool"])


def test_every_format_names_the_flagged_runs_per_arm(rehearsed):
    runs, by_arm = rehearsed["runs"], rehearsed["by_arm"]
    rep = report(rehearsed["scratch"], "json")
    for arm in BEHAVIOURS:
        mine = [r for r in runs.values() if r["arm"] == arm]
        flagged = [r for r in mine if r["audit"]["findings"]]
        st = rep["behaviour"][arm]
        assert st["flagged"] == len(flagged) and st["runs"] == len(mine)
        assert st["flagged_successes"] == sum(1 for r in flagged if r["evaluation"]["success"])
        assert sum(st["findings_by_group"].values()) == sum(len(r["audit"]["findings"]) for r in mine)
        assert sorted(f["run_id"] for f in st["flagged_runs"]) == sorted(r["run_id"] for r in flagged)
    assert rep["behaviour"]["A"]["runs_by_group"].get("edited_tests") == 1
    assert rep["behaviour"]["B"]["runs_by_group"].get("reads_oracle") == 1
    assert rep["behaviour"]["B"]["flagged_successes"] == 1     # peeking still passes: called out
    assert rep["behaviour"]["D"]["flagged"] == 0 and rep["behaviour"]["C"]["flagged"] == 0
    md = report(rehearsed["scratch"], "md")["markdown"]
    assert f"| {by_arm['A']} | " in md and "edited public tests or checks x1" in md
    assert f"| {by_arm['B']} | " in md and "hidden tests or reference x1" in md
    assert f"arm B: 1 success(es) come from flagged runs ({by_arm['B']})" in md


def test_the_idle_arm_is_a_valid_failure_and_raises_no_exclusion_note(rehearsed):
    """A session that answers without a tool call is the agent's own failure: no exclusion label
    (a failing agent cannot choose to be left out), so no differential-exclusion warning names it."""
    idle = rehearsed["runs"][rehearsed["by_arm"]["C"]]
    assert idle["outcome"] == "failure" and idle["validity"] == "valid", (idle["outcome"], idle["validity"])
    assert not idle["audit"].get("tool_calls")              # set up: it did nothing
    rep = report(rehearsed["scratch"], "json")
    assert not rep["exclusions"]["per_arm"].get("C", {}).get("all_excluded")
    assert "C" not in rep["exclusions"]["biased_arms"]
    md = report(rehearsed["scratch"], "md")["markdown"]
    assert "C (1 of 1 excluded" not in md and not any("C (1 of 1 excluded" in w for w in rep["warnings"])


def test_the_html_directory_parses_links_resolve_and_pages_show_their_tool_calls(rehearsed):
    site = rehearsed["base"] / "site"
    out = report(rehearsed["scratch"], "html", "--out", str(site) + "/")
    assert out["run_pages"] == 4 and Path(out["index"]) == site / "index.html"
    pages = [site / "index.html", *sorted((site / "runs").glob("*.html"))]
    assert len(pages) == 5
    linked = set()
    for page in pages:
        p = Page()
        p.feed(page.read_text(encoding="utf-8"))
        p.close()
        for href in p.links:
            u = urlparse(href)
            assert not u.scheme and not u.netloc, (page, href)      # offline: no external asset
            target = (page.parent / u.path).resolve()
            assert target.is_file(), (page, href)
            linked.add(target)
    assert {q.resolve() for q in pages[1:]} <= linked                # the index reaches every run page
    for arm, rid in rehearsed["by_arm"].items():
        page = (site / "runs" / f"{rid}.html").read_text(encoding="utf-8")
        p = Page()
        p.feed(page)
        rec = rehearsed["runs"][rid]
        calls = []
        for j in rec["jobs"]:
            job = json.loads((rehearsed["scratch"] / "state" / "jobs" / j["job_id"] / "job.json").read_text())
            for line in (Path(job["raw_dir"]) / "stream.jsonl").read_text().splitlines():
                ev = json.loads(line)
                if ev.get("type") == "assistant":
                    calls += [b["name"] for b in ev["message"]["content"] if b.get("type") == "tool_use"]
        assert p.tools == calls and (calls or arm == "C"), (arm, p.tools, calls)
    d = (site / "runs" / f"{rehearsed['by_arm']['D']}.html").read_text(encoding="utf-8")
    assert "gate_feedback" in d and "Review 1:" in d and "gate-01-cycle.json" in d
    assert "changed: roman.py" in d            # the diff against the starter
    a = (site / "runs" / f"{rehearsed['by_arm']['A']}.html").read_text(encoding="utf-8")
    assert "changed: tests/test_roman.py" in a and "edited_public_tests" in a


def test_the_index_opens_in_headless_chromium(rehearsed):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if not browser:
        pytest.skip("chromium is not installed (optional: apt-get install chromium)")
    site = rehearsed["base"] / "site-chromium"
    report(rehearsed["scratch"], "html", "--out", str(site) + "/")
    res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                          (site / "index.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Every run: task x arm" in res.stdout and "runs/" in res.stdout
    run_page = site / "runs" / f"{rehearsed['by_arm']['D']}.html"
    res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", run_page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert 'data-tool="Write"' in res.stdout and "Review 1:" in res.stdout


def test_a_run_page_says_when_the_task_bundle_changed_since_the_run(rehearsed):
    cfg = json.loads((rehearsed["scratch"] / "study.json").read_text())
    task_md = Path(cfg["tasks"]) / "roman" / "public" / "TASK.md"
    if not task_md.is_absolute():
        task_md = rehearsed["scratch"] / task_md
    before = task_md.read_text()
    try:
        task_md.write_text(before + "\nAn edit after the runs.\n")
        site = rehearsed["base"] / "site-edited"
        report(rehearsed["scratch"], "html", "--out", str(site) + "/")
        page = (site / "runs" / f"{rehearsed['by_arm']['D']}.html").read_text(encoding="utf-8")
        assert "the task bundle changed since this run" in page
    finally:
        task_md.write_text(before)
