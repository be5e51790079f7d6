"""A new user's first hour: scaffold two tasks, init, calibrate, assign, rehearse, report, each
step naming the next; then the usual mistakes, each refused with its cause; output for a person
at a terminal (help text, indentation) and one JSON object for a program; flags named in hints
exist; the report's per-arm table on a 1280 px screen."""
from __future__ import annotations

import http.server
import json
import os
import pty
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import AGENTBENCH, ROOT, ab, chromium_layout, run_cli

CREDENTIAL_VARS = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN", "ANTHROPIC_BASE_URL",
                   "ANTHROPIC_CUSTOM_HEADERS")


def user_env(binary: str | None = None, **extra: str) -> dict[str, str]:
    """A user's shell: no study, no credential, not offline (the fake-binary fixtures set that)."""
    env = {k: v for k, v in os.environ.items()
           if k not in CREDENTIAL_VARS and k not in ("AGENTBENCH_STUDY", "AGENTBENCH_CHILD", "AGENTBENCH_OFFLINE")}
    if binary:
        env["AGENTBENCH_CLAUDE_BIN"] = binary
    env.update(extra)
    return env


def next_command(obj: dict) -> list[str]:
    """The answer's `next`: a command line of agentbench whose command and flags exist."""
    argv = shlex.split(obj["next"])
    assert argv[:2] == ["python3", "agentbench.py"], obj["next"]
    assert argv[2] in ab.COMMANDS, obj["next"]
    flags = {o for a in ab.build_parser(ab.COMMANDS[argv[2]])._actions for o in a.option_strings}
    assert {a for a in argv[3:] if a.startswith("--")} <= flags, obj["next"]
    return argv[2:]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the first hour, with the real binary ---------------------------------------------------------

def readme_first_study() -> list[list[str]]:
    """The first command block of the README's "Your first study", one argv per line."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Your first study\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.split("#", 1)[0].strip()]


@pytest.fixture(scope="module")
def first_hour(tmp_path_factory, real_claude) -> dict:
    """The README's first study, its commands run as written in a fresh copy of the project."""
    base = tmp_path_factory.mktemp("first-hour")
    for part in ("agentbench.py", "preamble.md"):
        shutil.copy2(ROOT / part, base / part)
    for part in ("templates", "examples"):
        shutil.copytree(ROOT / part, base / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = user_env(real_claude)
    steps: list[tuple[list[str], int, dict]] = []
    for argv in readme_first_study():
        assert argv[:2] == ["python3", "agentbench.py"], argv
        proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, env=env,
                              cwd=str(base), timeout=900)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        assert len(lines) == 1, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
        steps.append((argv[2:], proc.returncode, json.loads(lines[0])))
        assert proc.returncode == 0, (argv, lines[0][:3000], proc.stderr[-3000:])
    def name(argv: list[str]) -> str:
        return argv[0] + (" cli" if "--kind" in argv else " fix" if argv[0] == "new-task" else "")
    return {"study": base / "mystudy", "steps": {name(a): (c, o) for a, c, o in steps},
            "env": env, "base": base, "argvs": [a for a, _, _ in steps]}


def test_every_step_of_the_first_hour_exits_0_and_names_the_next(first_hour):
    assert [a[0] for a in first_hour["argvs"]] == ["new-task", "new-task", "init", "calibrate", "assign",
                                                    "rehearse", "report"]
    steps = first_hour["steps"]
    expected = {"new-task fix": "init", "new-task cli": "init", "init": "calibrate", "calibrate": "assign",
                "assign": "rehearse", "rehearse": "run", "report": "report"}
    for name, (code, obj) in steps.items():
        assert code == 0 and next_command(obj)[0] == expected[name], (name, obj.get("next"))
    study = first_hour["study"]
    assert json.loads((study / "study.json").read_text())["arms"] == {"baseline": {}}
    cal = steps["calibrate"][1]
    assert cal["ok"] and set(cal["tasks"]) == {"fix-mean", "greet"}
    assert all(t["starter_oracle_score"] < 1 for t in cal["tasks"].values())
    rehearsal = steps["rehearse"][1]
    assert rehearsal["ok"] and rehearsal["costs_simulated"] and "simulated" in rehearsal["cost_note"]
    assert all(a["cost_simulated"] for a in rehearsal["arms"].values())
    # the runs were graded through the receipt channel, protected
    runs = [json.loads(p.read_text()) for p in (Path(rehearsal["scratch"]) / "state" / "runs").glob("*.json")]
    assert runs and all(r["outcome"] == "success" for r in runs)
    assert all(r["evaluation"]["receipt"]["channel"] == "fd" and r["evaluation"]["receipt"]["protected"]
               for r in runs)
    # `report` on the study itself: its only results are the rehearsal's, and it says where
    report = steps["report"][1]
    assert report["next"] == rehearsal["report_command"]
    assert report["next"].startswith("python3 agentbench.py report --study ")
    assert any("rehearsal" in w and rehearsal["scratch"] in w for w in report["warnings"])


def test_the_rehearsal_report_it_names_works_and_says_the_costs_are_simulated(first_hour):
    argv = next_command(first_hour["steps"]["report"][1])
    code, obj, err = run_cli(argv, first_hour["env"], cwd=str(first_hour["base"]))
    assert code == 0, (obj, err[-2000:])
    assert "Cost/run (simulated)" in obj["markdown"] and "simulated: a rehearsal, nothing billed" in obj["markdown"]
    assert "Changes against the baseline" in obj["markdown"] and "the baseline: no preamble" in obj["markdown"]


def test_run_without_a_credential_is_refused_before_anything_starts(first_hour):
    study = first_hour["study"]
    before = sorted(p.name for p in (study / "state").iterdir())
    code, obj, _ = run_cli(["run", "--study", str(study)], first_hour["env"])
    assert code == 2 and obj["code"] == "no_credential" and "ANTHROPIC_API_KEY" in obj["hint"], obj
    assert sorted(p.name for p in (study / "state").iterdir()) == before
    assert not (study / "runs").exists()


def test_run_with_an_unreachable_upstream_fails_fast_with_the_reason(first_hour):
    study = first_hour["study"]
    env = {**first_hour["env"], "ANTHROPIC_API_KEY": "sk-ant-not-a-real-key",
           "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{closed_port()}"}
    code, obj, _ = run_cli(["run", "--study", str(study)], env, timeout=60)
    assert code == 2 and obj["code"] == "upstream_unreachable", obj
    assert "could not be reached" in obj["error"] and "127.0.0.1" in obj["url"]
    assert not (study / "runs").exists()


class _Rejecting(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).seen.append((self.path, self.headers.get("x-api-key")))
        body = json.dumps({"type": "error", "error": {"type": "authentication_error",
                                                      "message": "invalid x-api-key"}}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_run_and_where_with_a_rejected_key_say_so(first_hour):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rejecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**first_hour["env"], "ANTHROPIC_API_KEY": "sk-ant-rejected",
               "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}"}
        code, obj, _ = run_cli(["run", "--study", str(first_hour["study"])], env, timeout=60)
        assert code == 2 and obj["code"] == "credential_rejected" and "invalid x-api-key" in obj["error"], obj
        code, obj, _ = run_cli(["where", "--check-api"], env, timeout=60)
        assert code == 2 and obj["ok"] is False and obj["code"] == "credential_rejected", obj
        assert obj["credentials"] == ["ANTHROPIC_API_KEY"]
        assert _Rejecting.seen[0] == ("/v1/messages/count_tokens", "sk-ant-rejected")
    finally:
        server.shutdown()


# ---- mistakes, each refused with its cause (no model needed) --------------------------------------

def scaffolded(tmp_path: Path, name: str = "t1") -> Path:
    study = tmp_path / "study"
    for argv in (["new-task", "--study", str(study), "--task", name], ["init", "--study", str(study)]):
        code, obj, err = run_cli(argv, user_env())
        assert code == 0, (obj, err)
    return study


def test_a_missing_oracle_file_fails_calibration_naming_the_cause(tmp_path):
    study = scaffolded(tmp_path)
    (study / "tasks" / "t1" / "oracle" / "run.py").unlink()
    code, obj, _ = run_cli(["calibrate", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "calibration_failed" and obj["failed"] == ["t1"], obj
    problems = " ".join(obj["tasks"]["t1"]["problems"])
    assert "no receipt on the receipt channel" in problems and "exit 2" in problems
    assert "can't open file" in problems and "run.py" in problems
    attempt = obj["tasks"]["t1"]["reference"][0]["oracle"]
    assert attempt["exit_code"] == 2 and "can't open file" in attempt["stderr_tail"]


def test_an_oracle_that_prints_garbage_fails_calibration_naming_the_cause(tmp_path):
    study = scaffolded(tmp_path)
    # The scaffold's oracle is given WORKSPACE --sandbox-run HELPER --receipt-fd FD.
    (study / "tasks" / "t1" / "oracle" / "run.py").write_text(
        "import os, sys\nos.write(int(sys.argv[5]), b'all good, trust me\\n')\n")
    code, obj, _ = run_cli(["calibrate", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "calibration_failed", obj
    assert any("not a JSON receipt" in p for p in obj["tasks"]["t1"]["problems"]), obj


def test_a_misspelt_study_key_gets_a_did_you_mean(tmp_path):
    study = scaffolded(tmp_path)
    cfg = json.loads((study / "study.json").read_text())
    cfg["repeets"] = 2
    (study / "study.json").write_text(json.dumps(cfg))
    code, obj, _ = run_cli(["calibrate", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "study_json_unknown_keys", obj
    assert obj["did_you_mean"] == {"repeets": "repeats"} and "did you mean `repeats`" in obj["hint"]


def test_a_study_without_tasks_names_the_folder_and_the_command_that_makes_one(tmp_path):
    study = tmp_path / "empty"
    assert run_cli(["init", "--study", str(study)], user_env())[0] == 0
    code, obj, _ = run_cli(["calibrate", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "tasks_directory_not_found", obj
    assert str(study / "tasks") in obj["error"] and "new-task" in obj["hint"]
    (study / "tasks").mkdir()
    code, obj, _ = run_cli(["calibrate", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "no_tasks_found" and "new-task" in obj["hint"], obj


def test_rehearse_before_calibrate_is_refused_by_name(tmp_path, real_claude):
    study = scaffolded(tmp_path)
    code, obj, _ = run_cli(["rehearse", "--study", str(study)], user_env(real_claude))
    assert code == 2 and obj["code"] == "tasks_not_calibrated" and obj["tasks"] == ["t1"], obj
    assert "calibrate" in obj["hint"]
    assert not (study / "rehearsals").exists()


def test_run_refusals_come_in_the_order_a_user_fixes_them(tmp_path):
    study = scaffolded(tmp_path)
    code, obj, _ = run_cli(["run", "--study", str(study)], user_env())
    assert code == 2 and "calibrate" in obj["hint"] and "not calibrated" in obj["problems"][0], obj
    assert run_cli(["calibrate", "--study", str(study)], user_env())[0] == 0
    code, obj, _ = run_cli(["run", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "no_runs_selected" and "assign" in obj["hint"], obj
    assert run_cli(["assign", "--study", str(study)], user_env())[0] == 0
    code, obj, _ = run_cli(["run", "--study", str(study)], user_env())
    assert code == 2 and obj["code"] == "unproven_configuration" and "rehearse" in obj["hint"], obj


def test_new_task_refuses_an_existing_task_and_a_bad_name_writing_nothing(tmp_path):
    study = scaffolded(tmp_path)
    before = sorted(str(p) for p in (study / "tasks").rglob("*"))
    for argv, code_name in ((["--task", "t1"], "task_already_exists"), (["--task", "../evil"], "invalid_name"),
                            (["--task", "ok", "--kind", "haskell"], "bad_arguments")):
        code, obj, _ = run_cli(["new-task", "--study", str(study), *argv], user_env())
        assert code == 2 and obj["code"] == code_name, obj
    assert sorted(str(p) for p in (study / "tasks").rglob("*")) == before


def test_where_on_a_missing_study_is_an_error_and_says_when_there_is_no_credential(tmp_path):
    code, obj, _ = run_cli(["where", "--study", str(tmp_path / "nonexistent")], user_env())
    assert code == 2 and obj["ok"] is False and obj["code"] == "not_a_study", obj
    code, obj, _ = run_cli(["where"], user_env())
    assert obj["credentials"] == [] and any("no credential" in w for w in obj["warnings"]), obj
    code, obj, _ = run_cli(["where", "--check-api"], user_env(ANTHROPIC_API_KEY="k",
                                                             ANTHROPIC_BASE_URL=f"http://127.0.0.1:{closed_port()}"))
    assert code == 2 and obj["code"] == "upstream_unreachable" and obj["api_check"]["ok"] is False, obj


def _gateway_statuses(tmp_path: Path, upstream: str, n: int) -> list[tuple[int, str]]:
    import http.client
    gw = ab.MeteringGateway(upstream=upstream, creds={"ANTHROPIC_API_KEY": "k"}, prices=None,
                            record_path=tmp_path / "gateway.jsonl", budget=None, default_model="claude-opus-4-5")
    gw.start()
    statuses = []
    try:
        for _ in range(n):
            host, port = gw.url.rsplit("/", 1)[1].split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/messages", body=b'{"model": "claude-opus-4-5", "max_tokens": 5}',
                         headers={"content-type": "application/json", "x-api-key": gw.token})
            resp = conn.getresponse()
            statuses.append((resp.status, json.loads(resp.read())["error"]["type"]))
            conn.close()
    finally:
        gw.stop()
    return statuses


def test_a_gateway_whose_upstream_keeps_failing_answers_a_final_error(tmp_path):
    """claude retries a 502 for minutes; after GATEWAY_UNREACHABLE_FINAL failures in a row the
    gateway answers 400 invalid_request_error, which ends the session at once."""
    statuses = _gateway_statuses(tmp_path, f"http://127.0.0.1:{closed_port()}", ab.GATEWAY_UNREACHABLE_FINAL + 1)
    assert statuses[0] == (502, "api_error")
    assert statuses[ab.GATEWAY_UNREACHABLE_FINAL - 1:] == [(400, "invalid_request_error")] * 2


def test_an_upstream_that_drops_connections_is_not_taken_for_a_dead_one(tmp_path):
    """Only a connection that cannot be made counts: an upstream that accepts and hangs up (as a
    session could provoke for one request) keeps getting the retryable 502."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def hang_up() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        statuses = _gateway_statuses(tmp_path, f"http://127.0.0.1:{listener.getsockname()[1]}", 3)
    finally:
        listener.close()
    assert statuses == [(502, "api_error")] * 3


# ---- output for a person and for a program ----------------------------------------------------------

def test_every_option_of_every_command_has_help_text():
    missing = [(c.name, a.option_strings) for c in ab.COMMANDS.values()
               for a in ab.build_parser(c)._actions
               if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert missing == []


def _on_a_pty(args: list[str]) -> str:
    """Run agentbench with its stdout on a pseudo-terminal; what it printed."""
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(AGENTBENCH), *args], stdout=sub, stderr=subprocess.DEVNULL,
                            env=user_env())
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:   # EIO: the other side closed
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(main)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_help_at_a_terminal_is_text_and_piped_is_one_json_object():
    text = _on_a_pty(["report", "--help"])
    assert text.startswith("usage: agentbench.py report") and "--format {json,md,html}" in text
    assert "--baseline" in text and not text.lstrip().startswith("{")
    top = _on_a_pty(["--help"])
    assert "new-task" in top and "commands:" in top
    for argv in (["report", "--help"], ["--help"]):
        proc = subprocess.run([sys.executable, str(AGENTBENCH), *argv], capture_output=True, text=True,
                              env=user_env(), timeout=60)
        lines = proc.stdout.splitlines()
        assert proc.returncode == 0 and len(lines) == 1 and "help" in json.loads(lines[0])


def test_an_answer_is_indented_at_a_terminal_and_one_line_otherwise(tmp_path):
    at_tty = _on_a_pty(["--version"])
    assert at_tty.startswith("{\n") and json.loads(at_tty)["version"] == ab.VERSION
    compact = _on_a_pty(["--version", "--compact"])
    assert compact.count("\n") == 1 and json.loads(compact)["version"] == ab.VERSION
    proc = subprocess.run([sys.executable, str(AGENTBENCH), "--version"], capture_output=True, text=True,
                          env=user_env(), timeout=60)
    assert proc.stdout.count("\n") == 1 and json.loads(proc.stdout)["version"] == ab.VERSION


def test_report_md_at_a_terminal_prints_the_markdown_and_piped_one_object(tmp_path):
    study = scaffolded(tmp_path)
    text = _on_a_pty(["report", "--study", str(study), "--format", "md"])
    assert text.startswith("# ") and "the verdict" in text and "--full" in text   # one screen
    text = _on_a_pty(["report", "--study", str(study), "--format", "md", "--full"])
    assert text.startswith("# ") and "## Results per arm" in text
    code, obj, _ = run_cli(["report", "--study", str(study), "--format", "md"], user_env())
    assert code == 0 and obj["markdown"].startswith("# ") and "markdown_for_terminal" not in obj


# ---- hints and notes name flags that exist ----------------------------------------------------------

def _flags() -> dict[str, set[str]]:
    return {c.name: {o for a in ab.build_parser(c)._actions for o in a.option_strings} | {"--compact"}
            for c in ab.COMMANDS.values()}


def unknown_flags(text: str) -> list[tuple[str, str]]:
    """Every `--flag` that follows a command name in `text` (a quoted command line) but that command
    does not take."""
    known = _flags()
    bad = []
    for m in re.finditer(r"(?:agentbench\.py |`)([a-z_][\w-]*)((?: [^`\"\n]*)?)", text):
        cmd, rest = m.group(1), m.group(2)
        if cmd in known:
            bad += [(cmd, f) for f in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest) if f not in known[cmd]]
    return bad


def test_every_command_line_quoted_in_the_code_and_the_readme_names_flags_that_exist():
    assert unknown_flags(AGENTBENCH.read_text(encoding="utf-8")) == []
    assert unknown_flags((ROOT / "README.md").read_text(encoding="utf-8")) == []
    assert unknown_flags("`assign --simulate 5`") == [("assign", "--simulate")]   # the check can fail


@pytest.mark.parametrize("n_tasks", [1, 3, 12])
def test_the_power_notes_name_flags_that_exist(n_tasks):
    plan = ab.paired_power_repeats(0.5, 0.2, n_tasks, tau=0.3 if n_tasks == 1 else 0.0)
    for note in plan["notes"]:
        assert "simulate >" not in note
        assert unknown_flags(note) == [], note


def test_assign_warns_when_the_recommended_cost_exceeds_the_study_cap():
    plan = {"study_budget_usd": 200.0, "repeats": 1, "cost_at_repeats": {"study_usd": 12.0},
            "cost_at_recommended_repeats": {"repeats": 20, "study_usd": 239.0}}
    (warning,) = ab.plan_warnings(plan)
    assert "$239.00" in warning and "$200.00" in warning and unknown_flags(warning) == []
    assert ab.plan_warnings({**plan, "cost_at_recommended_repeats": {"repeats": 2, "study_usd": 24.0}}) == []
    assert ab.plan_warnings({**plan, "study_budget_usd": None}) == []


# ---- the report on a 1280 px screen ----------------------------------------------------------------

def test_a_wide_table_is_split_so_every_part_fits():
    assert ab.column_chunks(8) == [list(range(8))]
    for n in range(2, 40):
        parts = ab.column_chunks(n)
        assert all(p[0] == 0 and len(p) <= ab.HTML_TABLE_MAX_COLUMNS for p in parts)
        assert sorted({i for p in parts for i in p}) == list(range(n))


def test_each_arm_says_what_it_changes_against_the_baseline():
    specs = {"A": {"preamble": "arms/A.md"}, "C": {"preamble": "arms/A.md", "gate_cycles": 3},
             "D": {"preamble": "arms/D.md", "gate_cycles": 3, "review": True}, "E": {"preamble": "arms/A.md"}}
    got = ab.changes_against_baseline(specs, "A")
    assert got["A"].startswith("the baseline: preamble arms/A.md")
    assert got["C"] == "3 gate feedback cycles"
    assert got["D"] == "preamble arms/D.md, 3 gate feedback cycles, a reviewer"
    assert got["E"] == "the same settings as the baseline"


def test_the_demo_report_shows_every_column_of_the_per_arm_table_at_1280_px(tmp_path, demo_answer):
    """A headless Chromium screenshot of the demo's report, 1280 px wide: every header of the
    per-arm table is drawn inside the window (checked in the DOM Chromium laid out), and the
    screenshot is taken."""
    code, demo, err = demo_answer
    assert code == 0, (demo, err[-3000:])
    # The layout: the right edge of every cell of the per-arm tables, as Chromium placed them.
    cells = chromium_layout(Path(demo["report"]["html"]),
                            "var h=[...document.querySelectorAll('h2')].find(e=>e.textContent=='Results per arm');"
                            "var out=[];for(var t=h.nextElementSibling;t&&t.tagName=='TABLE';t=t.nextElementSibling)"
                            "for(var c of t.querySelectorAll('th'))out.push([c.textContent,c.getBoundingClientRect().right]);"
                            "document.title=JSON.stringify(out);", tmp_path, height=2200)
    headers = {h for h, _ in cells}
    assert {"Arm", "Changes against the baseline", "Success rate", "Cost/run (simulated)", "Flagged by audit"} <= headers
    assert all(right <= 1280 for _, right in cells), cells


def test_assign_with_power_delta_warns_through_the_cli_when_the_plan_is_over_the_cap(tmp_path):
    study = scaffolded(tmp_path)
    assert run_cli(["init", "--study", str(study), "--study-usd", "0.01"], user_env())[0] == 0
    assert run_cli(["calibrate", "--study", str(study)], user_env())[0] == 0
    code, obj, _ = run_cli(["assign", "--study", str(study), "--power-delta", "0.3"], user_env())
    assert code == 0, obj
    assert obj["warnings"] and all("above its cap" in w and "$0.01" in w for w in obj["warnings"]), obj
    assert obj["power"]["simulation"]
    assert all(unknown_flags(n) == [] for n in obj["power"]["notes"] + obj["warnings"])
