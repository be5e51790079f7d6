"""Grading that cannot be forged: the code under test never sees or touches its judge.

Real checks under real bubblewrap (skipped where it cannot run).  Each attack is first shown to
work against a harness written the old way (the code under test in the judge's process, or the
harness's paths readable by it); then the same workspace is graded by the bundled example and
the `new-task` scaffold, which run the code only through the {sandbox_run} helper, and is not a
success; and calibrate refuses the old way by naming the probe that forged it.  Last, the real
`claude` plants both forgeries in its sessions, and `run` grades each run a valid failure.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import run_cli, run_main
from test_e2e_real import assign_by_position, cli_env, make_study

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "study"

pytestmark = pytest.mark.skipif(not ab.sandbox_probe()["available"], reason="bubblewrap cannot run here")

# The first forgery of the issue: the starter's module rewrites the harness's checks when it is
# imported into the harness's child interpreter.
PATCH_CHECKS = """
import __main__ as _h
for _k in list(getattr(_h, "CHECKS", {})):
    _h.CHECKS[_k] = lambda mod: (True, "ok")
"""

# The second: the code reads its own and its parent's command line, finds the harness, parses
# its CHECKS out of it, prints the expected output of the check it is in and exits.
READ_PARENT = """
import ast as _ast, os as _os, sys as _sys
def _forge():
    try:
        me = [a.decode() for a in open("/proc/self/cmdline", "rb").read().split(b"\\0") if a]
        parent = open("/proc/%d/cmdline" % _os.getppid(), "rb").read().split(b"\\0")
    except OSError:
        return
    for arg in parent:
        path = arg.decode()
        if path.endswith("run.py") and _os.path.exists(path):
            for node in _ast.parse(open(path).read()).body:
                if isinstance(node, _ast.Assign) and getattr(node.targets[0], "id", "") == "CHECKS":
                    for _id, args, expected in _ast.literal_eval(node.value):
                        if me[-len(args):] == list(args):
                            _sys.stdout.write(expected + "\\n")
                            _sys.stdout.flush()
                            _os._exit(0)
_forge()
"""

# A harness written the old way for the bugfix example: each check runs in a child interpreter
# that imports the module and calls CHECKS[check](mod) there; only the parent writes the receipt.
OLD_BUGFIX_HARNESS = '''
import json, os, subprocess, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import CHECKS
def child(check_id, ws):
    sys.path.insert(0, ws)
    import textstats
    ok, _ = CHECKS[check_id](textstats)
    print("RESULT", json.dumps(bool(ok)))
def main(argv):
    if argv[1] == "--child":
        child(argv[2], argv[3])
        return 0
    ws, fd = argv[1], int(argv[3])
    os.set_inheritable(fd, False)
    results = []
    for check_id in CHECKS:
        p = subprocess.run([sys.executable, "-I", os.path.abspath(__file__), "--child", check_id, ws],
                           capture_output=True, text=True, cwd=ws, timeout=60)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        results.append(bool(lines) and json.loads(lines[-1][7:]))
    n = sum(results)
    os.write(fd, (json.dumps({"passed": n == len(results), "score": n / len(results)}) + "\\n").encode())
    return 0
sys.exit(main(sys.argv))
'''

OLD_BUGFIX_CHECKS = '''
import __main__
def check_wrap(mod):
    return mod.wrap("the cat sat on the mat", 7) == ["the cat", "sat on", "the mat"], ""
def check_words(mod):
    return mod.words("Café, CAFÉ") == ["café", "café"], ""
CHECKS = {"wrap": check_wrap, "words": check_words}
__main__.CHECKS = CHECKS
'''


def _study(tmp: Path, tasks: dict[str, Path], **cfg) -> Path:
    study = tmp / "study"
    shutil.copytree(EXAMPLES, study)
    shutil.rmtree(study / "tasks")
    for tid, src in tasks.items():
        shutil.copytree(src, study / "tasks" / tid)
    data = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**data, "sandbox": "bwrap", **cfg}))
    return study


def _grade(study: Path, task_id: str, files: dict[str, str], links: dict[str, str] | None = None,
           first: bool = False) -> dict:
    """The oracle's verdict on the task's starter with `files` appended to (or written into) it,
    or run first in it (`first`: a script whose last line exits), a file not there written, and
    `links` ({name: target}) made in it."""
    paths = ab.StudyPaths(study)
    task = ab.load_study(paths).task(task_id)
    ws = study.parent / f"ws-{task_id}"
    shutil.rmtree(ws, ignore_errors=True)
    ab.copy_tree(task.public, str(ws))
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        if first and (ws / rel).exists():
            (ws / rel).write_text(ab.with_probe_code((ws / rel).read_text(encoding="utf-8"), text), encoding="utf-8")
            continue
        with open(ws / rel, "a", encoding="utf-8") as fh:
            fh.write(text)
    for name, target in (links or {}).items():
        (ws / name).symlink_to(target)
    return ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), ab.check_env(dict(os.environ))[0])


def _old_bugfix(tmp: Path) -> Path:
    task = tmp / "old-bugfix"
    shutil.copytree(EXAMPLES / "tasks" / "bugfix", task)
    (task / "oracle" / "run.py").write_text(OLD_BUGFIX_HARNESS)
    (task / "oracle" / "checks.py").write_text(OLD_BUGFIX_CHECKS)
    spec = json.loads((task / "task.json").read_text())
    spec["id"] = "oldfix"
    spec["oracle"]["cmd"] = ["{python}", "{oracle}/run.py", "{workspace}", "--receipt-fd", "{receipt_fd}"]
    (task / "task.json").write_text(json.dumps(spec))
    return task


# The old way's run_all: each check's command a child of the harness, in the workspace's copy.
OLD_RUN_ALL = '''def run_all(helper, copy):
    out = []
    for _id, args, _expected in CHECKS:
        p = subprocess.run([sys.executable, "-E", "-s", *args], cwd=copy, text=True,
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)
        out.append({"exit": p.returncode, "stdout": p.stdout, "stderr": p.stderr})
    return out


'''


def _old_scaffold(tmp: Path) -> Path:
    """A python-fix scaffold whose oracle runs each check as `python -c ...` in the workspace and
    compares its stdout with CHECKS (the old way: the code's parent is the harness)."""
    code, out = run_main(["new-task", "--task", "oldscaf", "--study", str(tmp / "scaf")])
    assert code == 0, out
    task = tmp / "scaf" / "tasks" / "oldscaf"
    run = (task / "oracle" / "run.py").read_text()
    start, end = run.index("def run_all("), run.index("def judge(")
    run = run[:start] + OLD_RUN_ALL + run[end:]
    assert "helper, \"--dir\"" not in run
    (task / "oracle" / "run.py").write_text(run)
    return task


def test_the_issues_two_forgeries_pass_the_old_way_and_fail_the_bundled_harnesses(tmp_path):
    old = _study(tmp_path / "a", {"oldfix": _old_bugfix(tmp_path), "oldscaf": _old_scaffold(tmp_path)},
                 accept_forgeable_oracles=True)
    # The attacks are real: against harnesses written the old way, the buggy starter succeeds.
    assert not _grade(old, "oldfix", {})["success"]
    assert _grade(old, "oldfix", {"textstats.py": PATCH_CHECKS})["success"]
    assert not _grade(old, "oldscaf", {})["success"]
    assert _grade(old, "oldscaf", {"stats.py": READ_PARENT})["success"]
    # The same forgeries against the bundled example and the new-task scaffold: not a success.
    code, out = run_main(["new-task", "--task", "scaf", "--study", str(tmp_path / "new")])
    assert code == 0, out
    new = _study(tmp_path / "b", {"bugfix": EXAMPLES / "tasks" / "bugfix",
                                  "scaf": tmp_path / "new" / "tasks" / "scaf"})
    rec = _grade(new, "bugfix", {"textstats.py": PATCH_CHECKS})
    assert not rec["success"] and rec["inner_sandbox"]["kind"] == "bwrap" and rec["inner_sandbox"]["runs"] > 0
    assert rec["score"] == _grade(new, "bugfix", {})["score"] < 1.0    # the starter's own score
    rec = _grade(new, "scaf", {"stats.py": READ_PARENT})
    assert not rec["success"] and rec["score"] == _grade(new, "scaf", {})["score"]


def test_calibrate_refuses_the_old_way_naming_the_probe(tmp_path):
    study = _study(tmp_path, {"oldfix": _old_bugfix(tmp_path), "oldscaf": _old_scaffold(tmp_path)})
    code, cal = run_main(["calibrate", "--study", str(study)])
    assert code == 2 and cal["code"] == "oracle_forgeable", cal
    assert "patch_main" in cal["forged_probes"]["oldfix"], cal["forged_probes"]
    # The old scaffold's child can read its parent's command line, which names the hidden tests.
    assert "read_judge" in cal["forged_probes"]["oldscaf"], cal["forged_probes"]
    assert "{sandbox_run}" in cal["hint"] and "accept_forgeable_oracles" in cal["hint"]
    for tid in ("oldfix", "oldscaf"):
        t = cal["tasks"][tid]
        assert not t["ok"] and any(p.startswith("oracle_forgeable") for p in t["problems"])
        assert {p["name"] for p in t["oracle_probes"]} == set(ab.ORACLE_PROBES)


NAIVE_IN_PROCESS = '''
import json, os, sys
ws, fd = sys.argv[1], int(sys.argv[3])
os.set_inheritable(fd, False)
sys.path.insert(0, ws)
import stats
ok = stats.mean([2, 4, 6]) == 4.0 and stats.mean([5]) == 5.0
os.write(fd, (json.dumps({"passed": ok, "score": 1.0 if ok else 0.0}) + "\\n").encode())
'''

NAIVE_PYTHONPATH = '''
import json, os, subprocess, sys
ws, fd = sys.argv[1], int(sys.argv[3])
os.set_inheritable(fd, False)
here = os.path.dirname(os.path.abspath(__file__))
p = subprocess.run([sys.executable, "-m", "unittest", "discover", "-s", os.path.join(here, "hidden"), "-t",
                    os.path.join(here, "hidden")], cwd=ws, env=dict(os.environ, PYTHONPATH=ws),
                   capture_output=True, text=True, timeout=60)
os.write(fd, (json.dumps({"passed": p.returncode == 0}) + "\\n").encode())
'''

HIDDEN_TEST = '''import unittest
import stats
class T(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(stats.mean([2, 4, 6]), 4.0)
    def test_empty(self):
        with self.assertRaises(ValueError):
            stats.mean([])
'''


@pytest.mark.parametrize("kind, probe", [("in_process", "patch_main"), ("pythonpath", "site_hooks")])
def test_a_naive_oracle_is_refused_naming_the_probe(tmp_path, kind, probe):
    code, out = run_main(["new-task", "--task", "naive", "--study", str(tmp_path / "n")])
    assert code == 0, out
    task = tmp_path / "n" / "tasks" / "naive"
    (task / "oracle" / "run.py").write_text(NAIVE_IN_PROCESS if kind == "in_process" else NAIVE_PYTHONPATH)
    (task / "oracle" / "hidden").mkdir()
    (task / "oracle" / "hidden" / "test_hidden.py").write_text(HIDDEN_TEST)
    spec = json.loads((task / "task.json").read_text())
    spec["oracle"]["cmd"] = ["{python}", "{oracle}/run.py", "{workspace}", "--receipt-fd", "{receipt_fd}"]
    (task / "task.json").write_text(json.dumps(spec))
    study = _study(tmp_path, {"naive": task})
    code, cal = run_main(["calibrate", "--study", str(study)])
    t = cal["tasks"]["naive"]
    # The harness itself is sound on honest work: the reference passes, the starter fails.
    assert all(r["oracle_success"] for r in t["reference"]) and t["starter_oracle_score"] < 1.0, t
    assert code == 2 and cal["code"] == "oracle_forgeable" and probe in cal["forged_probes"]["naive"], cal


def test_the_examples_and_scaffolds_calibrate_with_every_probe_held(tmp_path):
    for kind in ("python-fix", "cli"):
        code, out = run_main(["new-task", "--task", kind, "--kind", kind, "--study", str(tmp_path / "s")])
        assert code == 0, out
    study = _study(tmp_path, {"bugfix": EXAMPLES / "tasks" / "bugfix", "cli": EXAMPLES / "tasks" / "cli",
                              "python-fix": tmp_path / "s" / "tasks" / "python-fix",
                              "scaf-cli": tmp_path / "s" / "tasks" / "cli"})
    spec = json.loads((study / "tasks" / "scaf-cli" / "task.json").read_text())
    (study / "tasks" / "scaf-cli" / "task.json").write_text(json.dumps({**spec, "id": "scaf-cli"}))
    code, cal = run_main(["calibrate", "--study", str(study)])
    assert code == 0 and cal["ok"], cal
    for tid, t in cal["tasks"].items():
        verdicts = {p["name"]: p["verdict"] for p in t["oracle_probes"]}
        assert set(verdicts) == set(ab.ORACLE_PROBES), tid
        assert set(verdicts.values()) == {"held"}, (tid, verdicts)


def test_a_real_session_that_plants_the_two_forgeries_is_a_valid_failure(tmp_path, real_claude, server):
    """The real binary, offline against the scripted model, under bubblewrap: a session on the
    example `roman` task appends the CHECKS-patching forgery to its module, and one on a `new-task`
    scaffold appends the parent-command-line reader; each run, graded by `run`, is the agent's
    valid failure (not a success, not an exclusion)."""
    study = make_study(tmp_path / "study", real_claude, arms=("A",), calibrated=False, sandbox="bwrap",
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                            "AGENTBENCH_OFFLINE": "1"})
    code, out = run_main(["new-task", "--task", "scaf", "--study", str(tmp_path / "new")])
    assert code == 0, out
    shutil.copytree(tmp_path / "new" / "tasks" / "scaf", study / "tasks" / "scaf")
    forgeries = {"roman": ("roman.py", PATCH_CHECKS), "scaf": ("stats.py", READ_PARENT)}
    for tid, (module, text) in forgeries.items():
        task_md = study / "tasks" / tid / "public" / "TASK.md"
        task_md.write_text(task_md.read_text() + f"\n[agentbench-script:forge-{tid}]\n")
        server.add_script(f"forge-{tid}", {"steps": [
            {"text": "Adding a helper.", "tool_uses": [{"name": "Bash", "input": {
                "command": f"cat >> {module} <<'FORGERY_END'\n{text}\nFORGERY_END\necho appended",
                "description": "append"}}]},
            {"text": "Done."}]})
    rows = assign_by_position(study, 1)
    assert sorted(r["task"] for r in rows) == ["roman", "scaf"]
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "2"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    for row in rows:
        rid, (module, text) = row["run_id"], forgeries[row["task"]]
        rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
        graded = (study / "runs" / rid / "workspace" / module).read_text()
        assert graded.endswith(text + "\n"), graded[-500:]     # the session really planted it
        assert rec["status"] == "finished" and rec["sandbox"]["sandboxed"] is True, rec["sandbox"]
        assert (rec["outcome"], rec["validity"]) == ("failure", "valid"), (rec["outcome"], rec["validity"])
        ev = rec["evaluation"]
        assert ev["success"] is False and ev["score"] < 1.0 and ev["grader_error"] is None, ev
        assert ev["receipt"] == {"kind": "json", "channel": "fd", "protected": True, "problem": None}, ev


# ---- a hostile review of the inner sandbox: the code under test as an attacker ------------------
# One payload tries every attack from inside the check (the worst case: it knows the study's and
# the hidden tests' paths) and reports, on stderr, what each one got; the scaffold's harness puts
# that stderr into its failed checks' details, the bundled `cli` harness its end, the bundled
# `roman` harness drops it.  Each attack must be held: nothing seen, read, written, signalled or
# left running, and the grade unchanged.

# A duration no other process uses (another run of this test on the same host included): a
# sleeper left behind is found by it.
LINGER_S = f"317.{os.getpid():07d}"

ATTACK = r'''
def _ab_attack(secrets, outside, live):
    import ctypes, errno, glob, json, os, signal, socket, sys
    me, rep = os.getpid(), {}
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    seen = b""
    for p in pids:   # the harness's arguments and environment: any visible process
        for part in ("cmdline", "environ"):
            try:
                seen += open("/proc/" + p + "/" + part, "rb").read()
            except OSError:
                pass
    rep["pids"] = len(pids)
    rep["judge_seen"] = any(s.encode() in seen for s in ("run.py", "oracle") + tuple(secrets[:1]))
    read = []   # hidden files by their host paths, and through a link planted in the workspace
    for i, path in enumerate(secrets[1:] + ["judge/run.py", "judge/SECRET.txt"]):
        try:
            open(path, "rb").read(1)
            read.append(i)
        except OSError:
            pass
    rep["read"] = read
    wrote = []   # outside the copy: the study, a host directory, the root, the copy's parent
    for i, d in enumerate(outside + (["/", "/workspace/.."] if live else [])):
        try:
            with open(os.path.join(d, "ATTACK-MARK"), "w") as fh:
                fh.write("x")
            wrote.append(i)
        except OSError:
            pass
    rep["wrote"] = wrote
    if not live:   # the control, on the host itself: no signal, trace or write to others
        sys.stderr.write("ATTACK " + json.dumps(rep) + "\n")
        return
    line = b'\n{"passed": true, "score": 1.0}\n'
    fds = 0   # the receipt channel or any other descriptor of the harness
    for fd in range(3, 256):
        try:
            os.write(fd, line)
            fds += 1
        except OSError:
            pass
    rep["fds"] = fds
    try:
        with open("/dev/tty", "wb") as tty:
            tty.write(line)
        rep["tty"] = True
    except OSError:
        rep["tty"] = False
    socks = 0   # the helper's socket, or any other Unix socket in reach
    for path in glob.glob("/tmp/*/s") + glob.glob("/tmp/ab-inner-*/*") + glob.glob("/run/*.sock"):
        try:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            socks += 1
        except OSError:
            pass
    rep["sockets"] = socks
    signalled = 0   # stop every other process in reach (the harness, were it visible)
    for p in pids:
        if int(p) not in (1, me):
            try:
                os.kill(int(p), signal.SIGSTOP)
                signalled += 1
            except OSError:
                pass
    rep["signalled"] = signalled
    libc = ctypes.CDLL(None, use_errno=True)
    rep["ptrace"] = errno.errorcode.get(ctypes.get_errno(), 0) if libc.ptrace(16, 1, 0, 0) != 0 else "attached"
    if os.fork() == 0:   # a process left behind, detached, in a new session
        try:
            os.setsid()
            if os.fork() == 0:
                for fd in (0, 1, 2):
                    os.close(fd)
                os.execvp("sleep", ["sleep", %(linger)r])
        finally:
            os._exit(0)
    os.wait()
    sys.stderr.write("ATTACK " + json.dumps(rep, separators=(",", ":")) + "\n")
    sys.stderr.flush()
_ab_attack(%(secrets)r, %(outside)r, %(live)r)
'''


def _lingering() -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.joinpath("cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", LINGER_S.encode()]:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def test_the_inner_sandbox_holds_every_attack_of_the_code_under_test(tmp_path):
    code, out = run_main(["new-task", "--task", "scaf", "--study", str(tmp_path / "new")])
    assert code == 0, out
    study = _study(tmp_path, {"roman": EXAMPLES / "tasks" / "roman", "cli": EXAMPLES / "tasks" / "cli",
                              "scaf": tmp_path / "new" / "tasks" / "scaf"})
    token = "SECRET-" + os.urandom(6).hex()
    for where in (study / "tasks" / "scaf" / "oracle", study / "state"):
        where.mkdir(parents=True, exist_ok=True)
        (where / "SECRET.txt").write_text(token)
    paths = ab.StudyPaths(study)
    pristine = ab.pristine_copy(paths, ab.load_study(paths).task("scaf"), "oracle")
    outside = tmp_path / "outside"
    outside.mkdir()
    where = {"linger": LINGER_S, "outside": [str(study), str(outside), str(pristine)],
             "secrets": [str(study), str(pristine / "run.py"), str(pristine / "SECRET.txt"),
                         str(study / "state" / "SECRET.txt")]}
    payload = ATTACK % {**where, "live": True}
    got = {}
    for tid, module in (("scaf", "stats.py"), ("roman", "roman.py"), ("cli", "todo.py")):
        got[tid] = (_grade(study, tid, {}), _grade(study, tid, {module: payload}, links={"judge": str(pristine)},
                                                   first=tid == "cli"))
    for tid, (starter, attacked) in got.items():
        # Nothing forged: the starter's own grade, a valid verdict, run in the inner sandbox.
        assert not attacked["success"] and attacked["score"] == starter["score"], (tid, attacked["checks"])
        assert attacked["grader_error"] is None and attacked["inner_sandbox"]["kind"] == "bwrap", attacked
    reports = [json.loads(c["detail"].split("ATTACK ", 1)[1].splitlines()[0])
               for c in got["scaf"][1]["checks"] if "ATTACK " in c["detail"]]
    assert reports, got["scaf"][1]["checks"]     # the payload ran, and said what it got
    for rep in reports:
        # Only its sandbox's first process and itself; no argument, environment or file of the judge.
        assert rep["pids"] <= 2 and rep["judge_seen"] is False and rep["read"] == [], rep
        # No descriptor, terminal or socket of the harness; no process to signal or trace.
        assert rep["fds"] == 0 and rep["tty"] is False and rep["sockets"] == 0 and rep["signalled"] == 0, rep
        assert rep["ptrace"] == "EPERM" and rep["wrote"] == [], rep
    # cli's harness shows the end of a failed call's stderr: the end of a report, run in a process
    # forked from the driver (the processes it can see are the driver and its own check's).
    tails = [c["detail"] for c in got["cli"][1]["checks"] if '"ptrace"' in c["detail"]]
    assert tails and all('"fds":0,"tty":false,"sockets":0,' in t and '"ptrace":"EPERM"' in t for t in tails), tails
    assert not [p for p in tmp_path.rglob("ATTACK-MARK")] and token not in json.dumps(got)
    deadline = time.monotonic() + 10
    while _lingering() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _lingering() == []     # nothing it left behind outlived its inner run
    # The control: the payload's reading and writing part, run as a plain process of the host
    # beside a planted link, gets what it goes for, so each report above could have shown it.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "judge").symlink_to(pristine)
    (plain / "attack.py").write_text(ATTACK % {**where, "live": False})
    proc = subprocess.run([sys.executable, "attack.py"], cwd=plain, capture_output=True, text=True, timeout=60)
    rep = json.loads(proc.stderr.split("ATTACK ", 1)[1].splitlines()[0])
    assert rep["pids"] > 2 and rep["read"] == [0, 1, 2, 3, 4] and rep["wrote"] == [0, 1, 2], (rep, proc.stderr)
    for mark in tmp_path.rglob("ATTACK-MARK"):
        mark.unlink()


def test_an_output_flood_from_the_code_under_test_is_the_agents_failure(tmp_path):
    """The code prints, endlessly, the one value a check may expect: the scaffold's driver keeps
    each command's output on the inner sandbox's private, size-capped /tmp, where the flood ends
    when it is full; each check is judged on that output and fails, and the grade is a valid
    verdict."""
    code, out = run_main(["new-task", "--task", "scaf", "--study", str(tmp_path / "new")])
    assert code == 0, out
    study = _study(tmp_path, {"scaf": tmp_path / "new" / "tasks" / "scaf"})
    flood = "\nimport sys as _s\nwhile True:\n    _s.stdout.write('4.0\\n' * 4096)\n"
    rec = _grade(study, "scaf", {"stats.py": flood})
    assert not rec["success"] and rec["grader_error"] is None and rec["inner_sandbox"]["kind"] == "bwrap", rec
    assert not any(c["passed"] for c in rec["checks"]), rec["checks"]
    assert all(c["detail"].startswith("expected ") and "4.0" in c["detail"] for c in rec["checks"]), rec["checks"]


# The results file of a bundled driver: what every check's calls did, read by the harness once the
# driver exited 0.  Two ways the code under test could put its own there: a link in its place,
# which leads inside the inner sandbox to the private /tmp and outside to a file of the workspace;
# or a write to the driver's memory through /proc/1/mem that renames the file the driver writes.
# Both bring the reference's answers, made beforehand by the same harness (outside any sandbox).
LINK_RESULTS = """
import os as _os
if not _os.path.lexists("/workspace/.oracle-results.json"):
    _os.symlink("../tmp/answers.json", "/workspace/.oracle-results.json")
"""
PATCH_DRIVER = """
import os as _os, shutil as _sh
def _patch():
    try:
        maps = open("/proc/1/maps").read().splitlines()
        fd = _os.open("/proc/1/mem", _os.O_RDWR)
    except OSError:
        return
    for line in maps:
        f = line.split()
        if f[1].startswith("rw") and (len(f) < 6 or not f[5].startswith("/")):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            try:
                data = _os.pread(fd, hi - lo, lo)
            except OSError:
                continue
            at = data.find(b".oracle-results.json")
            while at >= 0:
                _os.pwrite(fd, b".oracle-resultz.json", lo + at)
                at = data.find(b".oracle-results.json", at + 1)
    for src in ("/workspace/answers.json", "/workspace/tool/answers.json"):
        if _os.path.exists(src):
            _sh.copyfile(src, "/workspace/.oracle-results.json")
if not _os.path.exists("/workspace/.oracle-results.json"):
    _patch()
"""
# Runs the command in DIR, unsandboxed, and keeps the results file it wrote.
CAPTURE_HELPER = """
import os, shutil, subprocess, sys
i = sys.argv.index("--")
where = sys.argv[sys.argv.index("--dir") + 1]
code = subprocess.run(sys.argv[i + 1:], cwd=where).returncode
shutil.copyfile(os.path.join(where, ".oracle-results.json"), os.environ["CAPTURE"])
sys.exit(code)
"""


@pytest.mark.parametrize("task_id,module", [("cli", "todo.py"), ("roman", "roman.py"), ("bugfix", "textstats.py"),
                                            ("scaf", "stats.py")])
def test_the_code_under_test_cannot_put_its_own_results_in_place_of_the_drivers(tmp_path, task_id, module):
    if task_id == "scaf":
        code, out = run_main(["new-task", "--task", "scaf", "--study", str(tmp_path / "new")])
        assert code == 0, out
    src = tmp_path / "new" / "tasks" / "scaf" if task_id == "scaf" else EXAMPLES / "tasks" / task_id
    ref = tmp_path / "ref"
    shutil.copytree(src / "public", ref)
    shutil.copy(src / "reference" / module, ref / module)
    (tmp_path / "capture.py").write_text(CAPTURE_HELPER)
    with open(os.devnull, "wb") as null:
        subprocess.run([sys.executable, str(src / "oracle" / "run.py"), str(ref), "--sandbox-run",
                        str(tmp_path / "capture.py"), "--receipt-fd", str(null.fileno())], pass_fds=[null.fileno()],
                       env={**os.environ, "CAPTURE": str(tmp_path / "answers.json")}, check=True,
                       capture_output=True, timeout=120)
    answers = (tmp_path / "answers.json").read_text(encoding="utf-8")
    study = _study(tmp_path, {task_id: src})
    starter = _grade(study, task_id, {})
    assert not starter["success"], starter
    for files in ({module: LINK_RESULTS, "tmp/answers.json": answers}, {module: PATCH_DRIVER, "answers.json": answers}):
        got = _grade(study, task_id, files, first=True)
        assert got["grader_error"] is None and got["inner_sandbox"]["kind"] == "bwrap", got
        assert (got["success"], got["score"]) == (False, starter["score"]), (list(files)[1], got["checks"])


# The cli tool's data file is measured by the driver after each call; a check that compares it
# before and after a call must find it there.  This tool is the reference, except that every
# `done` rewrites the file; it hides the file between calls (renamed away at exit, back at start).
HIDE_DATA_FILE = """
import atexit as _ae, os as _os, runpy as _rp, sys as _s
if _os.path.exists(".hidden"):
    _os.replace(".hidden", "todo.json")
if "done" in _s.argv and _os.path.exists("todo.json"):
    with open("todo.json", "a") as _f:
        _f.write(" ")
_ae.register(lambda: _os.path.exists("todo.json") and _os.replace("todo.json", ".hidden"))
_rp.run_path(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "ref_todo.py"), run_name="__main__")
"""


def _grade_cli_wrapping_the_reference(tmp_path: Path, wrapper: str) -> tuple[dict, dict[str, bool]]:
    """The cli oracle's grade, and each check's verdict, of `wrapper` as todo.py running the
    reference (ref_todo.py beside it)."""
    study = _study(tmp_path, {"cli": EXAMPLES / "tasks" / "cli"})
    ref = (EXAMPLES / "tasks" / "cli" / "reference" / "todo.py").read_text(encoding="utf-8")
    got = _grade(study, "cli", {"todo.py": wrapper, "ref_todo.py": ref}, first=True)
    return got, {c["id"]: c["passed"] for c in got["checks"]}


def test_a_cli_tool_that_hides_its_data_file_between_calls_passes_no_check_comparing_it(tmp_path):
    got, verdicts = _grade_cli_wrapping_the_reference(tmp_path, HIDE_DATA_FILE)
    assert verdicts["list_json_shape"], got["checks"]     # the reference runs
    assert not any(verdicts[c] for c in ("done_is_idempotent", "done_unknown_id", "done_bad_id")), got["checks"]


# The same, but between calls the data file is a FIFO: the driver, which reads that file after
# each call, must not wait on it (it would until the batch's time limit, every check failed).
FIFO_DATA_FILE = """
import atexit as _ae, os as _os, runpy as _rp
if _os.path.exists(".hidden"):
    _os.unlink("todo.json")
    _os.replace(".hidden", "todo.json")
_ae.register(lambda: _os.path.exists("todo.json") and (_os.replace("todo.json", ".hidden"), _os.mkfifo("todo.json")))
_rp.run_path(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "ref_todo.py"), run_name="__main__")
"""


def test_a_cli_tool_that_leaves_a_fifo_as_its_data_file_fails_only_the_checks_reading_it(tmp_path):
    got, verdicts = _grade_cli_wrapping_the_reference(tmp_path, FIFO_DATA_FILE)
    assert got["grader_error"] is None and verdicts["list_json_shape"], got["checks"]
    assert not verdicts["done_is_idempotent"], got["checks"]


def test_a_run_going_cannot_swap_a_link_into_the_path_of_another_runs_directory(tmp_path):
    """Code in an inner run can rewrite everything under its directory; were another run's
    directory inside it, that code could swap a link (to `/`) into the path between agentbench's
    check and bubblewrap's bind.  So two runs at once never have nested directories: the second
    is refused (125), and runs after it as soon as the first is over."""
    import threading
    root = tmp_path / "copy"
    (root / "sub").mkdir(parents=True)
    cenv = ab.check_env(dict(os.environ))[0]
    jail = ab.InnerSandbox(ab.current_platform(), ab.resolve_sandbox("bwrap", cenv), cenv, root=str(root),
                           hidden=[], deadline=time.monotonic() + 120)

    def helper(where: Path, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, jail.helper, "--dir", str(where), "--timeout", "30", "--", *cmd],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    try:
        outer = threading.Thread(target=helper, args=(root, "sleep", "3"))
        outer.start()
        deadline = time.monotonic() + 30
        while not jail.active and time.monotonic() < deadline:
            time.sleep(0.05)
        assert jail.active == [str(root.resolve())]
        inner = helper(root / "sub", "true")
        assert inner.returncode == ab.INNER_CANNOT_RUN_EXIT and "nested" in inner.stderr, inner
        outer.join()
        assert helper(root / "sub", "true").returncode == 0 and jail.active == []
    finally:
        jail.close()


def test_an_inner_run_that_fills_its_directory_is_stopped(tmp_path):
    """The run's directory is on the host's disk: code that keeps writing there is stopped once it
    added more than the cap (made small here) to the copy it started from, as an output flood is."""
    (tmp_path / "copy").mkdir()
    cenv = ab.check_env(dict(os.environ))[0]
    jail = ab.InnerSandbox(ab.current_platform(), ab.resolve_sandbox("bwrap", cenv), cenv, root=str(tmp_path),
                           hidden=[], deadline=time.monotonic() + 120, dir_max_bytes=1 << 20)
    fill = "import time\nopen('fill', 'wb').write(b'x' * (4 << 20))\ntime.sleep(20)\n"
    try:
        proc = subprocess.run([sys.executable, jail.helper, "--dir", str(tmp_path / "copy"), "--timeout", "60", "--",
                               "python3", "-c", fill], capture_output=True, text=True, timeout=90)
    finally:
        jail.close()
    assert proc.returncode > 128 and "it added more than 1048576 bytes to its directory" in proc.stderr, proc   # killed
