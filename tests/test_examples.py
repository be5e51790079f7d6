"""Checks of the bundled example study, the prompt templates and the default preamble.

Everything here runs the bundle the way agentbench does, but with plain subprocess calls and
without importing agentbench: the bundle is a contract of its own (task.json placeholders, gate
run with cwd = workspace, oracle receipt on the last stdout line), and it must hold even while
the tool is being changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "examples" / "study"
TASKS_DIR = STUDY / "tasks"
TEMPLATES = ROOT / "templates"
TASK_IDS = ["bugfix", "cli", "roman"]

GATE_CMD = ["{python}", "-m", "unittest", "discover", "-s", "{gate}", "-t", "{gate}"]
ORACLE_CMD = ["{python}", "{oracle}/run.py", "{workspace}", "--sandbox-run", "{sandbox_run}",
              "--receipt-fd", "{receipt_fd}"]

# The {sandbox_run} helper's contract (agentbench's own runs the command in its inner sandbox):
# --dir DIR [--timeout S] [--env K=V]... -- COMMAND; the command runs in DIR with stdin passed on,
# its output and exit status come back as the helper's own, 124 when it timed out.  This stand-in
# keeps the contract without the isolation, so the bundle is checked without agentbench.
SANDBOX_RUN_STANDIN = r"""
import os, subprocess, sys
args = sys.argv[1:]
sep = args.index("--")
opts, cmd = args[:sep], args[sep + 1:]
kv = dict(zip(opts[0::2], opts[1::2]))
env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
env.update(PYTHONIOENCODING="utf-8", PYTHONDONTWRITEBYTECODE="1")
try:
    proc = subprocess.run(cmd, cwd=kv["--dir"], env=env, stdin=sys.stdin, capture_output=True,
                          timeout=float(kv.get("--timeout", 60)))
except subprocess.TimeoutExpired:
    sys.exit(124)
sys.stdout.buffer.write(proc.stdout)
sys.stderr.buffer.write(proc.stderr)
sys.exit(proc.returncode)
"""

# The variables the controller provides to each template: always all of them, never others.
TEMPLATE_VARS = {
    "task_prompt.md": {"task_id", "task_title", "task_text", "workspace", "check_hint"},
    "gate_feedback.md": {"cycle", "cycles_left", "failed_checks", "gate_output"},
    "review_prompt.md": {"task_title", "task_text", "work_dir", "review_path", "changed_files"},
    "reviewer_system.md": set(),
    "review_feedback.md": {"findings", "summary"},
    "resume.md": {"reason"},
    "train_base.md": {"task_title", "task_text", "notes_path"},
}


# ---- helpers ---------------------------------------------------------------------------------

def load_task(task_id: str) -> dict:
    return json.loads((TASKS_DIR / task_id / "task.json").read_text(encoding="utf-8"))


def fill(cmd: list[str], **places: str) -> list[str]:
    """Substitute {python}/{gate}/{oracle}/{workspace} inside every argument (as study.json commands do)."""
    places.setdefault("python", sys.executable)
    out = []
    for arg in cmd:
        for name, value in places.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


def child_env() -> dict:
    # No bytecode files, so that workspaces compare clean before and after a run.
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1")


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 per file below path (relative names), to prove a directory was not written."""
    return {p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def make_workspace(task_id: str, dest: Path, overlay: str | None = None) -> Path:
    """public/ copied to dest, then the named overlay (reference/ or partial/) copied over it."""
    task_dir = TASKS_DIR / task_id
    shutil.copytree(task_dir / "public", dest)
    if overlay:
        shutil.copytree(task_dir / overlay, dest, dirs_exist_ok=True)
    return dest


def run_gate(task_id: str, workspace: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    task = load_task(task_id)
    gate_copy = tmp_path / "gate-copy"
    if not gate_copy.exists():
        shutil.copytree(TASKS_DIR / task_id / "gate", gate_copy)
    return subprocess.run(fill(task["gate"]["cmd"], gate=str(gate_copy)), cwd=workspace,
                          capture_output=True, text=True, env=child_env(),
                          timeout=task["gate"]["timeout_s"])


def check_receipt(receipt: dict) -> None:
    """The receipt shape a check prints, internally consistent."""
    assert isinstance(receipt["passed"], bool)
    assert isinstance(receipt["score"], (int, float)) and 0.0 <= receipt["score"] <= 1.0
    assert isinstance(receipt["tests_passed"], int) and isinstance(receipt["tests_total"], int)
    assert 0 <= receipt["tests_passed"] <= receipt["tests_total"]
    checks = receipt["checks"]
    assert isinstance(checks, list) and len(checks) == receipt["tests_total"] > 0
    for check in checks:
        assert set(check) >= {"id", "passed", "detail"}
        assert isinstance(check["id"], str) and isinstance(check["passed"], bool)
        assert isinstance(check["detail"], str)
    assert len({check["id"] for check in checks}) == len(checks)
    assert sum(check["passed"] for check in checks) == receipt["tests_passed"]
    assert receipt["passed"] == (receipt["tests_passed"] == receipt["tests_total"])


def run_oracle(task_id: str, workspace: Path, tmp_path: Path) -> dict:
    """Run the oracle on a throw-away copy of workspace; return its validated receipt."""
    task = load_task(task_id)
    oracle_copy = tmp_path / "oracle-copy"
    if not oracle_copy.exists():
        shutil.copytree(TASKS_DIR / task_id / "oracle", oracle_copy)
    helper = tmp_path / "sandbox_run.py"
    helper.write_text(SANDBOX_RUN_STANDIN, encoding="utf-8")
    throwaway = tmp_path / f"oracle-ws-{workspace.name}"
    shutil.copytree(workspace, throwaway)
    before = tree_digest(throwaway)
    # The receipt channel: the write end of a pipe, named by {receipt_fd}, that only the oracle's
    # own process writes its one receipt line to.
    rfd, wfd = os.pipe()
    try:
        proc = subprocess.run(fill(task["oracle"]["cmd"], oracle=str(oracle_copy),
                                   workspace=str(throwaway), receipt_fd=str(wfd),
                                   sandbox_run=str(helper)),
                              cwd=throwaway, capture_output=True, text=True, env=child_env(),
                              timeout=task["oracle"]["timeout_s"], pass_fds=(wfd,))
        os.close(wfd)
        wfd = -1
        with os.fdopen(rfd, "rb") as fh:
            rfd = -1
            channel = fh.read().decode("utf-8").splitlines()
    finally:
        for fd in (rfd, wfd):
            if fd >= 0:
                os.close(fd)
    assert proc.returncode == 0, proc.stderr
    # The oracle works on a copy of its own: the workspace it is given stays as it was.
    assert tree_digest(throwaway) == before
    receipt = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(channel) == 1 and json.loads(channel[0]) == receipt, channel
    check_receipt(receipt)
    return receipt


def template_identifiers(text: str) -> set[str]:
    """Names a string.Template uses ($name / ${name}); fails on a stray '$'.

    Template.get_identifiers() exists only from Python 3.11, so the pattern is read directly.
    """
    names = set()
    for match in string.Template.pattern.finditer(text):
        assert match.group("invalid") is None, f"stray '$' at offset {match.start()}"
        name = match.group("named") or match.group("braced")
        if name:
            names.add(name)
    return names


# ---- study.json and arms ---------------------------------------------------------------------

def test_study_json_has_the_fixed_keys():
    study = json.loads((STUDY / "study.json").read_text(encoding="utf-8"))
    assert set(study) >= {"tasks", "model", "effort", "permission_mode", "tools", "arms",
                          "budget", "repeats", "seed"}
    assert (STUDY / study["tasks"]).is_dir()
    assert study["model"] == "claude-opus-4-5"
    assert study["permission_mode"] == "dontAsk"
    assert study["tools"].split(",") == ["Bash", "Read", "Edit", "Write", "Glob", "Grep"]
    assert set(study["budget"]) == {"usd_per_run", "wall_s", "max_turns", "study_usd"}
    assert all(isinstance(v, (int, float)) and v > 0 for v in study["budget"].values())
    assert isinstance(study["repeats"], int) and study["repeats"] >= 1
    assert isinstance(study["seed"], int)
    arms = study["arms"]
    assert sorted(arms) == ["A", "B", "C", "D"]
    assert "gate_cycles" not in arms["A"] and "review" not in arms["A"]
    assert "gate_cycles" not in arms["B"] and "review" not in arms["B"]
    assert arms["C"]["gate_cycles"] == 3 and "review" not in arms["C"]
    assert arms["D"]["gate_cycles"] == 3 and arms["D"]["review"] is True


def test_arm_preambles_exist_and_are_real_texts():
    study = json.loads((STUDY / "study.json").read_text(encoding="utf-8"))
    for name, arm in study["arms"].items():
        text = (STUDY / arm["preamble"]).read_text(encoding="utf-8")
        words = len(text.split())
        if name == "A":
            assert 5 <= words <= 60, "the baseline stays short and neutral"
        else:
            assert 150 <= words <= 400, f"arm {name}: {words} words"
    c_text = (STUDY / study["arms"]["C"]["preamble"]).read_text(encoding="utf-8").lower()
    d_text = (STUDY / study["arms"]["D"]["preamble"]).read_text(encoding="utf-8").lower()
    assert "controller" in c_text and "reviewer" in d_text


# ---- tasks -----------------------------------------------------------------------------------

def test_the_bundle_holds_the_three_tasks():
    assert sorted(p.name for p in TASKS_DIR.iterdir() if p.is_dir()) == TASK_IDS


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_task_json_and_layout(task_id):
    task_dir = TASKS_DIR / task_id
    task = load_task(task_id)
    assert task["id"] == task_id and task["title"]
    assert task["gate"]["cmd"] == GATE_CMD and task["gate"]["timeout_s"] > 0
    assert task["oracle"]["cmd"] == ORACLE_CMD and task["oracle"]["timeout_s"] > 0
    assert 0.0 < task["oracle"]["threshold"] <= 1.0
    for sub in ("public", "gate", "oracle", "reference", "partial"):
        assert (task_dir / sub).is_dir(), sub
    assert (task_dir / "public" / "TASK.md").is_file()
    assert (task_dir / "oracle" / "run.py").is_file()
    # Overlays carry solution files only: a solution never rewrites the public tests.
    for overlay in ("reference", "partial"):
        names = {p.relative_to(task_dir / overlay).parts[0]
                 for p in (task_dir / overlay).rglob("*") if p.is_file()}
        assert names and "tests" not in names and "TASK.md" not in names


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_public_tests_are_the_gate_tests(task_id):
    task_dir = TASKS_DIR / task_id
    gate = tree_digest(task_dir / "gate")
    assert gate and gate == tree_digest(task_dir / "public" / "tests")


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_starter_fails_the_oracle(task_id, tmp_path):
    workspace = make_workspace(task_id, tmp_path / "starter")
    receipt = run_oracle(task_id, workspace, tmp_path)
    assert receipt["score"] < load_task(task_id)["oracle"]["threshold"]
    assert receipt["passed"] is False


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_starter_plus_partial_fails_the_gate(task_id, tmp_path):
    workspace = make_workspace(task_id, tmp_path / "partial", overlay="partial")
    proc = run_gate(task_id, workspace, tmp_path)
    assert proc.returncode != 0
    assert "FAILED" in proc.stderr  # tests ran and failed, rather than crashing the runner
    # The partial solution is incomplete, not a solution: the oracle rejects it too.
    receipt = run_oracle(task_id, workspace, tmp_path)
    assert receipt["score"] < load_task(task_id)["oracle"]["threshold"]


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_starter_plus_reference_passes_gate_and_oracle(task_id, tmp_path):
    workspace = make_workspace(task_id, tmp_path / "reference", overlay="reference")
    proc = run_gate(task_id, workspace, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK" in proc.stderr
    receipt = run_oracle(task_id, workspace, tmp_path)
    assert receipt["passed"] is True
    assert receipt["score"] >= load_task(task_id)["oracle"]["threshold"]
    assert receipt["score"] == 1.0


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_oracle_refuses_a_missing_workspace(task_id, tmp_path):
    proc = subprocess.run([sys.executable, str(TASKS_DIR / task_id / "oracle" / "run.py"),
                           str(tmp_path / "does-not-exist")],
                          capture_output=True, text=True, env=child_env(), timeout=60)
    assert proc.returncode != 0
    assert proc.stdout == ""


# The cli harness's driver runs each call of the tool in a process forked from itself (it starts
# the interpreter once per grading, not once per call).  Each variant of the tool below, run by the
# driver, must do what `python -X utf8 ../tool/todo.py ARGS` does in the same data directory: exit
# status, stdout, the data file, the last line of stderr, and whether a traceback was printed.
_REF = (TASKS_DIR / "cli" / "reference" / "todo.py").read_text(encoding="utf-8")
_HEAD = "import argparse\n"
CLI_VARIANTS = {
    "reference": (_REF, {}),
    "raises": (_REF.replace(_HEAD, _HEAD + "import sys\nif 'done' in sys.argv: raise ValueError('boom')\n"), {}),
    "exit_message": (_REF.replace(_HEAD, _HEAD + "import sys\nif 'list' in sys.argv: sys.exit('bye')\n"), {}),
    "exit_300": (_REF.replace(_HEAD, _HEAD + "import sys\nsys.exit(300)\n"), {}),
    "os_exit": (_REF.replace(_HEAD, _HEAD + "import os\nos._exit(7)\n"), {}),
    "atexit": (_REF.replace(_HEAD, _HEAD + "import atexit\natexit.register(print, 'at exit')\n"), {}),
    "thread": (_REF.replace(_HEAD, _HEAD + "import threading, time\nthreading.Thread(target=lambda: "
                            "(time.sleep(0.05), print('thread done'))).start()\n"), {}),
    "stdin": (_REF.replace(_HEAD, _HEAD + "import sys\nprint(repr(sys.stdin.read()))\n"), {}),
    "syntax_error": (_REF + "\n def broken(:\n", {}),
    "names": (_REF.replace(_HEAD, _HEAD + "import os, sys\nprint(sys.argv[0], os.path.relpath(__file__), "
                           "__file__ == os.path.join(os.getcwd(), sys.argv[0]), __name__, "
                           "os.path.basename(sys.path[0]), sys.flags.utf8_mode, sys.stdout.encoding)\n"), {}),
    "shadows_json": (_REF, {"json.py": "raise SystemExit('the json.py of the workspace')\n"}),
}


def _load_cli_harness():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cli_oracle_run", TASKS_DIR / "cli" / "oracle" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _by_the_interpreter(run_dir: Path, spec: dict) -> list[dict]:
    """What each call of one check does, each run as `python -X utf8 ../tool/todo.py ARGS`."""
    data_dir = Path(run_dir) / "direct"
    shutil.rmtree(data_dir, ignore_errors=True)
    data_dir.mkdir()
    if spec["data"] is not None:
        (data_dir / "todo.json").write_text(spec["data"], encoding="utf-8")
    answers = []
    for args in spec["calls"]:
        proc = subprocess.run([sys.executable, "-X", "utf8", "../tool/todo.py", *args], cwd=data_dir,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=60, env=child_env())
        path = data_dir / "todo.json"
        answers.append({"exit": proc.returncode, "stdout": proc.stdout.decode("utf-8", "replace"),
                        "stderr": proc.stderr.decode("utf-8", "replace"), "exists": os.path.lexists(path),
                        "file": path.read_bytes() if path.exists() else None})
    return answers


@pytest.mark.parametrize("variant", sorted(CLI_VARIANTS))
def test_the_cli_drivers_forked_calls_do_what_the_interpreter_does(variant, tmp_path):
    import base64
    harness = _load_cli_harness()
    source, extra = CLI_VARIANTS[variant]
    (tmp_path / "tool").mkdir()
    for name, text in {"todo.py": source, **extra}.items():
        (tmp_path / "tool" / name).write_text(text, encoding="utf-8")
    chosen = ("add_and_list_unchanged", "done_unknown_id", "existing_file")
    specs = [{"calls": [(["--file", "todo.json"] if file_option else []) + args for args in calls], "data": data}
             for name, (calls, file_option, data, _) in harness.CHECKS.items() if name in chosen]
    request = json.dumps({"timeout": 20, "results": "results.json", "checks": specs})
    proc = subprocess.run([sys.executable, "-I", "-B", "-X", "utf8", "-c", harness.DRIVER], input=request,
                          text=True, capture_output=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    forked = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert len(forked) == len(specs) == len(chosen)
    for spec, got in zip(specs, forked):
        want = _by_the_interpreter(tmp_path, spec)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            g_file = None if g["file"] is None else base64.b64decode(g["file"])
            assert (g["exit"], g["stdout"], g["exists"], g_file) == (w["exit"], w["stdout"], w["exists"], w["file"])
            assert g["stderr"].strip().splitlines()[-1:] == w["stderr"].strip().splitlines()[-1:]
            assert ("Traceback" in g["stderr"]) == ("Traceback" in w["stderr"])
    if variant == "names":   # the check itself can see a difference when there is one
        assert "../tool/todo.py ../tool/todo.py True __main__ tool 1 utf-8" in forked[0][0]["stdout"]


# ---- templates and preamble ------------------------------------------------------------------

def test_template_set_is_complete():
    assert {p.name for p in TEMPLATES.glob("*.md")} == set(TEMPLATE_VARS)


@pytest.mark.parametrize("name", sorted(TEMPLATE_VARS))
def test_template_renders_with_exactly_its_variables(name):
    text = (TEMPLATES / name).read_text(encoding="utf-8")
    expected = TEMPLATE_VARS[name]
    assert template_identifiers(text) == expected
    values = {var: f"<<{var}>>" for var in expected}
    rendered = string.Template(text).substitute(values)
    for var in expected:
        assert f"<<{var}>>" in rendered
    assert len(rendered.split()) >= 30, "a real prompt, not a placeholder"


def test_review_prompt_states_the_review_json_shape():
    text = (TEMPLATES / "review_prompt.md").read_text(encoding="utf-8")
    for token in ('"verdict"', '"accept"', '"revise"', '"findings"', '"severity"', '"blocker"',
                  '"major"', '"minor"', '"file"', '"detail"', '"summary"'):
        assert token in text, token


def test_preamble_length_and_content():
    text = (ROOT / "preamble.md").read_text(encoding="utf-8")
    assert 100 <= len(text.split()) <= 250
    lowered = text.lower()
    assert "non-interactive" in lowered and "current directory" in lowered
    assert "summary" in lowered
