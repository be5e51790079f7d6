"""Copies and reads outside the sandbox, end to end: the REAL `claude` binary, offline against the
scripted model, under bubblewrap and with `sandbox: none` (the rules hold without the sandbox).

The attacks, each as the issue reported it:
* the executor leaves links to the task's reference in its workspace (one with its path hidden in
  base64, one relative), a FIFO, a sparse file, a name that is not UTF-8, and replaces its own
  transcript by a link to /dev/zero; the reviewer then reads the links in its copy of the work.
  The reviewer's copy holds no link out and no byte of the reference; the transcript is not
  copied; the reviewer's own tool calls are audited; the report writes every run's page with the
  odd name escaped.
* an 8 GB sparse file, and directories nested past PATH_MAX: the run is the agent's valid failure
  `workspace_unusable`, graded as such, and no copy holds real blocks of its size.
* a workspace that outgrows `workspace_mb` while the session runs: the supervisor ends it.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import ab, run_cli
from test_e2e_real import TASK, assign_by_position, cli_env, make_study

pytestmark = pytest.mark.skipif(os.name != "posix", reason="links, FIFOs and sparse files as on POSIX")
PROBE = ab.sandbox_probe()
MODES = [pytest.param("bwrap", marks=pytest.mark.skipif(not PROBE["available"],
                                                         reason=f"bubblewrap cannot run here: {PROBE['reason']}")),
         "none"]


def study_for(tmp_path: Path, real_claude: str, server, mode: str, script: str, review: bool = False,
              **cfg) -> Path:
    study = make_study(tmp_path / "study", real_claude, arms=("A",), sandbox=mode,
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
                            "CLAUDE_CODE_MAX_RETRIES": "0", "AGENTBENCH_OFFLINE": "1"}, **cfg)
    if review:
        data = json.loads((study / "study.json").read_text())
        data["arms"]["A"]["review"] = True
        (study / "study.json").write_text(json.dumps(data, indent=1))
    task_md = study / "tasks" / TASK / "public" / "TASK.md"
    task_md.write_text(task_md.read_text() + f"\n[agentbench-script:{script}]\n")
    return study


def run_one(study: Path) -> tuple[str, dict]:
    rid = assign_by_position(study, 1)[0]["run_id"]
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    return rid, json.loads((study / "state" / "runs" / f"{rid}.json").read_text())


def real_bytes(root: Path) -> int:
    """Allocated bytes under root, links not followed (by descriptor: paths may pass PATH_MAX)."""
    total = 0
    for _, dirnames, filenames, dirfd in os.fwalk(root):
        for n in dirnames + filenames:
            total += os.stat(n, dir_fd=dirfd, follow_symlinks=False).st_blocks * 512
    return total


def regular_files_with(root: Path, needle: bytes) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if os.path.islink(p) or not os.path.isfile(p) or os.lstat(p).st_size > 50 * 2 ** 20:
                continue
            with open(p, "rb") as fh:
                if needle in fh.read():
                    out.append(p)
    return out


def tool_results(stream: Path) -> str:
    got = []
    for ln in stream.read_text().splitlines():
        msg = json.loads(ln).get("message") if ln.strip() else None
        for c in (msg or {}).get("content") or []:
            if isinstance(c, dict) and c.get("type") == "tool_result":
                got.append(c)
    return json.dumps(got)


@pytest.mark.parametrize("mode", MODES)
def test_links_to_the_reference_never_reach_the_reviewer_and_odd_names_do_not_stop_the_report(
        tmp_path, real_claude, server, mode):
    study = study_for(tmp_path, real_claude, server, mode, "attack", review=True)
    ref_dir = study / "tasks" / TASK / "reference"
    starter = set((study / "tasks" / TASK / "public" / "roman.py").read_text().splitlines())
    needle = max((ln.strip() for ln in (ref_dir / "roman.py").read_text().splitlines() if ln not in starter),
                 key=len)    # a line only the reference has
    assert len(needle) > 20
    hidden = base64.b64encode(str(ref_dir).encode()).decode()
    attack = (f"ln -s \"$(echo {hidden} | base64 -d)\" ref_b64; ln -s ../../../tasks/{TASK}/reference rel_ref; "
              "mkfifo pipe; truncate -s 100M sparse.bin; printf x > \"$(printf 'odd\\377\\001name.txt')\"; "
              "for f in \"$CLAUDE_CONFIG_DIR\"/projects/*/*.jsonl; do ln -sf /dev/zero \"$f\" && echo LINKED $f; done; "
              "ls -la")
    server.add_script("attack", {"steps": [
        {"text": "Setting up.", "tool_uses": [{"name": "Bash", "input": {"command": attack, "description": "x"}}]},
        {"text": "Done."}]})
    # The reviewer's prompt ends with its own marker (the last marker picks the script).
    (study / "templates").mkdir(exist_ok=True)
    (study / "templates" / "review_prompt.md").write_text(
        (ab.HERE / "templates" / "review_prompt.md").read_text() + "\n[agentbench-script:rev]\n")
    rid = assign_by_position(study, 1)[0]["run_id"]
    rdir = study / "runs" / rid / "review" / "01"
    work = rdir / "work"
    server.add_script("rev", {"steps": [
        {"text": "Reading the work.", "tool_uses": [
            {"name": "Read", "input": {"file_path": str(work / "rel_ref" / "roman.py")}},
            {"name": "Read", "input": {"file_path": str(work / "ref_b64" / "roman.py")}},
            {"name": "Bash", "input": {"command": f"ls -la {work}; cat {work}/rel_ref/roman.py "
                                                  f"{work}/ref_b64/roman.py {ref_dir}/roman.py 2>&1",
                                       "description": "look"}}]},
        {"text": "Writing the review.", "tool_uses": [{"name": "Write", "input": {
            "file_path": str(rdir / "review.json"),
            "content": json.dumps({"verdict": "revise", "summary": "Unfinished.", "findings": [
                {"severity": "blocker", "file": "roman.py", "detail": "not implemented"}]})}}]},
        {"text": "revise"}]})
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    assert rec["status"] == "finished" and rec["outcome"] == "failure" and rec["validity"] == "valid", rec
    assert [j["role"] for j in rec["jobs"]][:2] == ["executor", "reviewer"], rec["jobs"]
    assert rec["review_verdicts"] == ["revise"]
    # The reviewer's copy: the links out are gone, the FIFO skipped, the sparse file still a hole.
    for name in ("ref_b64", "rel_ref", "pipe"):
        assert not os.path.lexists(work / name), name
    assert os.lstat(work / "sparse.bin").st_blocks * 512 < 2 ** 20
    assert os.path.exists(work / os.fsdecode(b"odd\xff\x01name.txt"))
    # No byte of the reference in any regular file of the run, nor in what the reviewer's reads
    # of its copy returned (its direct `cat` of the reference is the audit's business below).
    assert regular_files_with(study / "runs" / rid, needle.encode()) == [] or mode == "none"
    assert regular_files_with(work, needle.encode()) == []
    rev_job = rec["jobs"][1]["job_id"]
    rev_stream = Path(json.loads((study / "state" / "jobs" / rev_job / "job.json").read_text())["raw_dir"])
    results = json.loads(tool_results(rev_stream / "stream.jsonl"))
    reads_of_copy = [r for r in results[:2]]
    assert len(reads_of_copy) == 2 and not any(needle in json.dumps(r) for r in reads_of_copy), reads_of_copy
    if mode == "bwrap":
        assert needle not in json.dumps(results)
    # The reviewer's tool calls are audited like the executor's.
    rev_findings = [f for f in rec["audit"]["findings"] if f.get("session") == "reviewer"]
    assert {"bash_touches_reference"} <= {f["kind"] for f in rev_findings}, rec["audit"]
    assert rec["audit"]["reviewer_tool_calls"] == 4
    # The transcript replaced by a link to /dev/zero is not followed: refused, nothing copied.
    exec_job = rec["jobs"][0]["job_id"]
    exec_results = tool_results(Path(json.loads((study / "state" / "jobs" / exec_job / "job.json")
                                                .read_text())["raw_dir"]) / "stream.jsonl")
    assert "LINKED" in exec_results, exec_results
    assert {"job_id": exec_job, "why": "not_a_regular_file"} in rec.get("transcripts_refused", []), rec
    assert not list((study / "runs" / rid / "transcripts").glob(f"{exec_job}-*"))
    assert real_bytes(study / "runs" / rid) < 50 * 2 ** 20
    # The manifest names the odd file escaped; the report writes every run's page in every format.
    assert "odd\\xff\\x01name.txt" in rec["artifacts"]["files"]
    for fmt in ("json", "md"):
        code, rep, err = run_cli(["report", "--study", str(study), "--format", fmt], cli_env())
        assert code == 0, (rep, err[-2000:])
    site = tmp_path / "site"
    code, rep, err = run_cli(["report", "--study", str(study), "--format", "html", "--out", f"{site}/"], cli_env())
    assert code == 0 and rep["run_pages"] == 1 and rep["run_pages_partial"] == [], (rep, err[-2000:])
    page = (site / "runs" / f"{rid}.html").read_bytes().decode("utf-8")
    assert "odd\\xff\\x01name.txt" in page


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack, why", [
    ("truncate -s 8G big.bin && ls -la big.bin", "file_over_cap"),
    ("python3 -c \"import os\nfor _ in range(25):\n    os.mkdir('d' * 200)\n    os.chdir('d' * 200)\n"
     "open('leaf.py', 'w').write('x = 1')\" && echo NESTED", "path_too_long"),
])
def test_a_workspace_past_the_caps_is_the_agents_valid_failure(tmp_path, real_claude, server, mode, attack, why):
    study = study_for(tmp_path, real_claude, server, mode, "big")
    server.add_script("big", {"steps": [
        {"text": "Making room.", "tool_uses": [{"name": "Bash", "input": {"command": attack, "description": "x"}}]},
        {"text": "Done."}]})
    rid, rec = run_one(study)
    assert rec["status"] == "finished", rec.get("error_detail")
    assert (rec["outcome"], rec["validity"]) == ("workspace_unusable", "valid"), rec
    # Nested past the limits, the live cap may end the session first (it counts such a tree as over,
    # so nothing hides below its walk): either way the same outcome.
    whys = {why} | ({"workspace_over_cap"} if why == "path_too_long" else set())
    assert rec["evaluation"]["success"] is False and rec["evaluation"]["workspace_unusable"] in whys, rec
    assert rec["failure_reason"] == f"workspace_unusable:{rec['evaluation']['workspace_unusable']}"
    # Nothing of its size was copied anywhere: the run directory (workspace included: the hole
    # costs nothing) and the host's temporary directory hold no real blocks of it.
    assert real_bytes(study / "runs" / rid) < 50 * 2 ** 20
    # Counted as a failure in the primary view.
    code, rep, err = run_cli(["report", "--study", str(study), "--format", "json"], cli_env())
    assert code == 0, err[-2000:]
    arm = rep["per_arm"]["A"]
    assert (arm["evaluated"], arm["successes"], arm["excluded"]) == (1, 0, 0), arm


@pytest.mark.parametrize("mode", MODES)
def test_a_workspace_that_outgrows_its_cap_ends_the_session(tmp_path, real_claude, server, mode):
    study = study_for(tmp_path, real_claude, server, mode, "grow", workspace_mb=1)
    server.add_script("grow", {"steps": [
        {"text": "Growing.", "tool_uses": [{"name": "Bash", "input": {
            "command": "head -c 3000000 /dev/urandom > blob.bin && sleep 100", "description": "x",
            "timeout": 300000}}]},
        {"text": "Done."}]})
    rid, rec = run_one(study)
    job = rec["jobs"][0]
    res = json.loads((study / "state" / "jobs" / job["job_id"] / "result.json").read_text())
    assert (res["status"], res["reason"]) == ("failed", "workspace_over_cap"), res
    assert (rec["outcome"], rec["validity"]) == ("workspace_unusable", "valid"), rec
    assert rec["failure_reason"] == "workspace_unusable:workspace_over_cap"
    events = [json.loads(x) for x in (study / "state" / "events.jsonl").read_text().splitlines() if x.strip()]
    over = [e for e in events if e["event"] == "workspace_over_cap"]
    assert over and over[0]["cap"] == 2 ** 20 and over[0]["bytes"] > 2 ** 20
    shutil.rmtree(study / "runs" / rid / "workspace", ignore_errors=True)
