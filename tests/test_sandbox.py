"""The sandbox (bubblewrap) and the receipt channel: pure decisions by tables, then checks run
in-process under bubblewrap (skipped, with the reason, where it cannot run).

What is proved: the decision table of the `sandbox` setting, the mount table's order and what it
leaves out, the tool directories given back, the study setting's shape check, a launch refused
(exit 2, nothing written) when bubblewrap is required but missing, `where`'s report, the receipt
channel's rules; and, with bubblewrap, that a check sees nothing of the study, the tasks or the
home, and that a graded solution that writes into `state/` or forges a passing receipt is not
scored a pass and changes nothing outside its copy.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import agentbench as ab
from conftest import ROOT, run_main, write_brief

EXAMPLES = ROOT / "examples" / "study"
PROBE = ab.sandbox_probe()
#: The account's own home (not $HOME, which the test session points elsewhere).
ACCOUNT_HOME = (ab.real_homes({}) or [""])[0]
needs_bwrap = pytest.mark.skipif(not PROBE["available"], reason=f"bubblewrap cannot run here: {PROBE['reason']}")


# ---- decisions and builders (pure) ----------------------------------------------------------------

@pytest.mark.parametrize("mode, available, kind", [
    ("none", True, "none"), ("none", False, "none"),
    ("auto", True, "bwrap"), ("auto", False, "none"),
    ("bwrap", True, "bwrap"), ("bwrap", False, "refuse"),
])
def test_sandbox_decision_table(mode, available, kind):
    assert ab.sandbox_decision(mode, available) == kind


def test_mount_table_binds_only_what_is_listed_then_hides_then_binds_back():
    plan = ab.SandboxPlan(links=(("/bin", "usr/bin"),),
                          base=("/usr", "/etc", "/usr/lib/node", "/srv", "/srv/study/.venv", "/"),
                          hide=("/home/u", "/srv/study", "/srv/study/state", "/tmp/x/tasks", "/", "/etc/ssh"),
                          mask=("/etc/shadow", "/opt/elsewhere/secret"),
                          ro=("/srv/study/state/pristine/t/gate",), rw=("/srv/study/runs/r1/workspace", "/home/u/.claude"),
                          cwd="/srv/study/runs/r1/workspace")
    assert ab.sandbox_mounts(plan) == [
        # every tmpfs sized: /tmp at the default, a hiding one at a token size
        # /dev's shm is a private tmpfs sized like /tmp (bubblewrap's /dev itself is unsized)
        ("--dev", "/dev"), ("--size", str(ab.SANDBOX_TMP_MB * 2 ** 20), "--tmpfs", "/dev/shm"),
        ("--proc", "/proc"), ("--size", str(ab.SANDBOX_TMP_MB * 2 ** 20), "--tmpfs", "/tmp"),
        ("--symlink", "usr/bin", "/bin"),
        # the base, outer directories only ("/" never: the root is bubblewrap's own, empty)
        ("--ro-bind", "/usr", "/usr"), ("--ro-bind", "/etc", "/etc"), ("--ro-bind", "/srv", "/srv"),
        # a hide only where a base directory holds it, outer first; "/" never
        ("--size", str(ab.SANDBOX_HIDE_BYTES), "--tmpfs", "/etc/ssh"),
        ("--size", str(ab.SANDBOX_HIDE_BYTES), "--tmpfs", "/srv/study"),
        ("--ro-bind", "/dev/null", "/etc/shadow"),   # /opt/elsewhere/secret: in no base, no mask
        # a base directory a hide covered comes back
        ("--ro-bind", "/srv/study/.venv", "/srv/study/.venv"),
        ("--ro-bind", "/srv/study/state/pristine/t/gate", "/srv/study/state/pristine/t/gate"),
        ("--bind", "/srv/study/runs/r1/workspace", "/srv/study/runs/r1/workspace"),
        ("--bind", "/home/u/.claude", "/home/u/.claude"),
        ("--remount-ro", "/dev"), ("--remount-ro", "/"),   # /dev and the sandbox's own root, last
    ]
    # inside a read-write bind: other sessions' transcripts hidden, this session's own kept
    inner = ab.dataclasses.replace(plan, inner_hide=("/home/u/.claude/projects",), tmp_mb=16,
                                   inner_rw=("/home/u/.claude/projects/-srv-study-runs-r1-workspace",),
                                   sockets=(("/tmp/abgw-1/gateway.sock", ab.SANDBOX_GATEWAY_SOCKET),))
    assert ab.sandbox_mounts(inner)[-6:-2] == [
        ("--bind", "/home/u/.claude", "/home/u/.claude"),
        ("--size", str(16 * 2 ** 20), "--tmpfs", "/home/u/.claude/projects"),
        ("--bind", "/home/u/.claude/projects/-srv-study-runs-r1-workspace",
         "/home/u/.claude/projects/-srv-study-runs-r1-workspace"),
        ("--bind", "/tmp/abgw-1/gateway.sock", ab.SANDBOX_GATEWAY_SOCKET)]
    argv = ab.sandbox_argv("/usr/bin/bwrap", plan, ["claude", "-p"], seccomp=7)
    assert argv[0] == "/usr/bin/bwrap" and argv[-3:] == ["--", "claude", "-p"]
    for opt in ("--unshare-pid", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-net"):
        assert opt in argv
    assert argv[argv.index("--cap-drop") + 1] == "ALL" and argv[argv.index("--seccomp") + 1] == "7"
    assert argv[argv.index("--chdir") + 1] == "/srv/study/runs/r1/workspace"
    assert ("--ro-bind", "/", "/") not in list(zip(argv, argv[1:], argv[2:]))
    opened = ab.sandbox_argv("/usr/bin/bwrap", ab.dataclasses.replace(plan, network="open"), ["x"])
    assert "--unshare-net" not in opened and "--seccomp" not in opened
    with pytest.raises(ValueError):
        ab.sandbox_argv("/usr/bin/bwrap", ab.dataclasses.replace(plan, network="some"), ["x"])


@pytest.mark.parametrize("binaries, prefixes, path, homes, keep_out, want", [
    # an npm package: the binary's dir and the package dir above it (a bin/ dir)
    (["/usr/lib/node_modules/pkg/bin/claude"], [], [], ["/root"], [],
     ["/usr/lib/node_modules/pkg/bin", "/usr/lib/node_modules/pkg"]),
    # a version manager in the home: its top-level directory, never the home itself
    ([], ["/root/.pyenv/versions/3.11"], ["/root/.pyenv/shims", "/root", "/usr/bin", "/root/.cargo/bin"], ["/root"],
     [], ["/root/.pyenv/versions/3.11", "/root/.pyenv", "/usr/bin", "/root/.cargo"]),
    (["/bin/x"], [], [], [], [], ["/bin"]),
    # a native binary in a versions directory: that directory only
    (["/root/.local/share/claude/versions/2.1.3"], [], [], ["/root"], [], ["/root/.local/share/claude/versions"]),
    # a PATH entry holding the study or the workspace is left out, "/" never given
    ([], [], ["/srv", "/srv/tools/bin", "/"], [], ["/srv/study"], ["/srv/tools/bin"]),
])
def test_tool_dirs_table(binaries, prefixes, path, homes, keep_out, want):
    assert ab.tool_dirs(binaries, prefixes, path, homes, keep_out=keep_out) == want


@pytest.mark.parametrize("arch, audit, nrs", [
    ("x86_64", 0xC000003E, [101, 310, 311, 438, 312, 298]),
    ("aarch64", 0xC00000B7, [117, 270, 271, 438, 272, 241]),
])
def test_seccomp_program_table(arch, audit, nrs):
    prog = ab.seccomp_program(arch)
    ins = [ab.struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    assert ins[0] == (0x20, 0, 0, 4) and ins[1] == (0x15, 1, 0, audit) and ins[2] == (0x06, 0, 0, 0x80000000)
    assert ins[3] == (0x20, 0, 0, 0)
    assert ins[-2] == (0x06, 0, 0, 0x7FFF0000) and ins[-1] == (0x06, 0, 0, 0x00050001)   # allow, EPERM

    def run(nr: int) -> int:   # a tiny interpreter of the program for one call of the host's arch
        pc, acc = 0, 0
        while True:
            code, jt, jf, k = ins[pc]
            if code == 0x20:
                acc = audit if k == 4 else nr
                pc += 1
            elif code == 0x06:
                return k
            else:
                hit = acc == k if code == 0x15 else acc >= k
                pc += 1 + (jt if hit else jf)
    assert [run(n) for n in nrs] == [0x00050001] * 6
    assert run(0) == run(59) == run(1000) == 0x7FFF0000
    if arch == "x86_64":
        assert run(0x40000000 + 101) == 0x00050001   # an x32 entry does not slip past


@pytest.mark.parametrize("machine, arch", [("x86_64", "x86_64"), ("amd64", "x86_64"), ("aarch64", "aarch64"),
                                           ("arm64", "aarch64"), ("armv7l", None), ("riscv64", None)])
def test_seccomp_arch_table(machine, arch):
    assert ab.seccomp_arch(machine) == arch


@pytest.mark.parametrize("open_arms, arm, gateway, task, network", [
    ([], "A", "on", None, "gateway"), (["B"], "A", "on", None, "gateway"), (["A"], "A", "on", None, "open"),
    ([], "A", "off", None, "open"), ([], None, "on", None, "gateway"), (["A"], None, "on", None, "gateway"),
    ([], "A", "on", "t1", "open"),
])
def test_session_network_table(open_arms, arm, gateway, task, network):
    got, why = ab.session_network(open_arms, arm, gateway, task)
    assert got == network and (why is None) == (network == "gateway")
    assert task is None or "task t1" in why


@pytest.mark.parametrize("data, line, problem", [
    (b'{"passed": true}\n', '{"passed": true}', None),
    (b"\n\n{}\n", "{}", None),
    (b"", None, "no receipt on the receipt channel"),
    (b'{"passed": true}\n{"passed": false}\n', None, "2 receipts on the receipt channel"),
    (b"x" * (ab.RECEIPT_MAX_BYTES + 1), None, "more than"),
])
def test_receipt_channel_line_table(data, line, problem):
    got_line, got_problem = ab.receipt_channel_line(data)
    assert got_line == line
    assert (got_problem is None) if problem is None else got_problem.startswith(problem)


PASS = ab.parse_receipt('{"passed": true, "score": 1.0}', 0, False)
FAIL = ab.parse_receipt('{"passed": false, "score": 0.25}', 0, False)
NOT_JSON = ab.parse_receipt("", 0, False)


@pytest.mark.parametrize("rec, problem, code, passed, score, why", [
    (PASS, None, 0, True, 1.0, None),
    (FAIL, None, 0, False, 0.25, None),
    (FAIL, None, 1, False, 0.25, None),         # a failing receipt may come with any exit status
    (PASS, None, -9, False, 0.0, "the receipt says passed but the check exited -9"),
    (PASS, "2 receipts", 0, False, 0.0, "2 receipts"),
    (NOT_JSON, None, 0, False, 0.0, "the receipt channel's line is not a JSON receipt with a passed field"),
])
def test_receipt_channel_verdict_table(rec, problem, code, passed, score, why):
    got = ab.receipt_channel_verdict(rec, problem, code)
    assert (got["passed"], got["score"], got.get("receipt_problem")) == (passed, score, why)
    assert got["receipt_channel"] == "fd" and got["receipt_protected"] is True


@pytest.mark.parametrize("workdir, active, why", [
    ("/c/w/.check-a", [], None),
    ("/c/w", ["/c/w"], None),                                    # the same directory twice: no path to swap
    ("/c/w/.check-b", ["/c/w/.check-a"], None),                  # siblings
    ("/c/w/.check-ab", ["/c/w/.check-a"], None),                 # a shared prefix is not nesting
    ("/c/w/.check-a/sub", ["/c/w/.check-a"], "nested"),          # the running code could swap sub for a link
    ("/c/w", ["/c/w/.check-a"], "nested"),                       # and this one's code could swap .check-a
    ("/c/other", [], "under the check's working directory"),
    ("/c/wx", [], "under the check's working directory"),
])
def test_inner_dir_refusal_table(workdir, active, why):
    got = ab.inner_dir_refusal(workdir, "/c/w", active)
    assert (got is None) if why is None else (why in got), got


@pytest.mark.parametrize("records, sandboxed, kinds", [
    ([{"kind": "bwrap"}, {"kind": "bwrap"}], True, ["bwrap"]),
    ([{"kind": "bwrap"}, {"kind": "none", "reason": "bwrap is not on PATH"}], False, ["bwrap", "none"]),
    ([{"kind": "bwrap"}, None], False, ["bwrap", "unknown"]),
    ([], False, []),
])
def test_sandbox_summary_table(records, sandboxed, kinds):
    got = ab.sandbox_summary(records)
    assert (got["sandboxed"], got["kinds"]) == (sandboxed, kinds)


@pytest.mark.parametrize("value, ok", [("auto", True), ("bwrap", True), ("none", True), ("docker", False),
                                       (True, False), ("", False)])
def test_study_shape_checks_the_sandbox_key(value, ok):
    cfg = {"arms": {"A": {}}, "sandbox": value}
    if ok:
        ab.check_study_shape(cfg)
    else:
        with pytest.raises(ab.AgentbenchError) as err:
            ab.check_study_shape(cfg)
        assert "sandbox" in err.value.payload["error"]


def test_resolve_without_bwrap_on_path(monkeypatch):
    env = {"PATH": "/nonexistent-dir"}
    auto = ab.resolve_sandbox("auto", env)
    assert auto["kind"] == "none" and "not on PATH" in auto["reason"]
    assert ab.resolve_sandbox("none", env)["kind"] == "none"
    with pytest.raises(ab.AgentbenchError) as err:
        ab.resolve_sandbox("bwrap", env)
    assert err.value.exit_code == 2 and "bubblewrap" in err.value.payload["hint"]


def test_probe_is_cached_once_per_process():
    if not PROBE["binary"]:
        pytest.skip(PROBE["reason"])
    assert PROBE["binary"] in ab._SANDBOX_PROBES
    assert ab.sandbox_probe() == PROBE


# ---- the CLI: refusal and where ------------------------------------------------------------------

def _set(study: Path, **keys) -> None:
    cfg = json.loads((study / "study.json").read_text())
    cfg.update(keys)
    (study / "study.json").write_text(json.dumps(cfg))


def test_required_sandbox_missing_refuses_the_launch_and_writes_nothing(study, tmp_path, monkeypatch):
    _set(study, sandbox="bwrap")
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "hello")])
    assert code == 2, out
    assert "bubblewrap" in out["error"] and out["refusal"] == "sandbox" and "hint" in out
    assert not (study / "state" / "jobs").exists() or not any((study / "state" / "jobs").iterdir())
    code, where = run_main(["where", "--study", str(study)])
    # Nothing is on this PATH, not even claude: `where` says it is not ok (exit 2), and why.
    assert code == 2 and where["ok"] is False
    assert where["sandbox"]["demanded"] is True and where["sandbox"]["here"] == "refuse"
    assert where["sandbox"]["available"] is False and "not on PATH" in where["sandbox"]["reason"]
    assert any("requires sandbox bwrap" in w for w in where["warnings"])


def test_where_reports_auto_unsandboxed_and_slurm(study, tmp_path, monkeypatch):
    _set(study, sandbox="auto")
    # A PATH with the interpreter (the fake claude's shebang needs it) and no bubblewrap.
    bare = tmp_path / "python-only"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(bare))
    code, where = run_main(["where", "--study", str(study)])
    assert code == 0 and where["sandbox"]["here"] == "none" and where["sandbox"]["study_mode"] == "auto"
    assert any("unsandboxed" in w for w in where["warnings"])
    _set(study, sandbox="bwrap", executor="slurm")
    code, where = run_main(["where", "--study", str(study)])
    assert code == 0 and where["sandbox"]["demanded"] is True and where["sandbox"]["decided_on"] == "each compute node"
    assert any("compute nodes" in w for w in where["warnings"])


@needs_bwrap
def test_where_says_what_a_sandbox_sees_and_an_unknown_machine_has_no_filter(study, monkeypatch):
    _set(study, sandbox="bwrap", network_open_arms=[])
    code, where = run_main(["where", "--study", str(study)])
    assert code == 0, where
    view = where["sandbox"]["view"]
    assert "/usr" in view["system_read_only"] and "/etc" in view["system_read_only"]
    assert "/" not in view["system_read_only"] + view["tools_read_only"]
    assert all(p.startswith("/etc/") for p in view["etc_masked"])
    if os.path.exists("/etc/shadow"):
        assert "/etc/shadow" in view["etc_masked"]
    assert view["seccomp"]["denied"] == list(ab.SECCOMP_DENIED) and "check" in view["network"]
    assert where["sandbox"]["network_open_arms"] == []
    monkeypatch.setattr(ab, "seccomp_here", lambda: {"arch": None, "machine": "armv7l", "denied": [],
                                                     "reason": "no system call table for the machine 'armv7l'"})
    code, where = run_main(["where", "--study", str(study)])
    assert code == 0 and where["sandbox"]["view"]["seccomp"]["arch"] is None
    assert any("without the seccomp filter" in w and "armv7l" in w for w in where["warnings"]), where["warnings"]
    rec = ab.sandbox_record({"mode": "bwrap", "kind": "bwrap"}, "none")
    assert rec["seccomp"] is None and "armv7l" in rec["seccomp_reason"]   # recorded in every job and check
    summary = ab.sandbox_summary([rec, rec])
    assert summary["sandboxed"] and summary["unfiltered"] == [rec["seccomp_reason"]]
    census = ab._rpt_census([ab.run_facts({"run_id": "r1", "status": "finished", "sandbox": summary})])
    notes = ab._rpt_population_notes(census, [], False)
    assert any("without the seccomp filter" in n and "armv7l" in n for n in notes), notes


# ---- checks under bubblewrap ----------------------------------------------------------------------

def _example_study(tmp_path: Path, mode: str) -> tuple[ab.StudyPaths, dict]:
    root = tmp_path / "study"
    shutil.copytree(EXAMPLES, root)
    _set(root, sandbox=mode)
    paths = ab.StudyPaths(root)
    paths.state.mkdir(parents=True, exist_ok=True)
    paths.ledger.write_text('{"job_id": "j000001"}\n')
    return paths, ab.load_tasks(paths, ab.load_study_config(paths))


def _digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text(errors="replace") for p in sorted(path.rglob("*")) if p.is_file()}


@needs_bwrap
def test_a_check_sees_nothing_of_the_study_tasks_or_home(tmp_path):
    paths, tasks = _example_study(tmp_path, "bwrap")
    task = tasks["roman"]
    spy = ("import json, os, sys\n"
           "def ls(p):\n"
           "    try: return sorted(os.listdir(p))\n"
           "    except OSError as e: return str(e)\n"
           f"print(json.dumps({{'study': ls({str(paths.root)!r}), 'state': ls({str(paths.state)!r}),"
           f" 'tasks': ls({str(task.root.parent)!r}), 'home': ls(os.path.expanduser('~')),"
           f" 'account_home': ls({ACCOUNT_HOME!r}), 'gate': ls(sys.argv[1]), 'proc': [p for p in os.listdir('/proc') if p.isdigit()]}}))\n")
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    (ws / "spy.py").write_text(spy)
    spec = dict(task.gate, cmd=["{python}", "spy.py", "{gate}"])
    t = ab.dataclasses.replace(task, gate=spec)
    rec = ab.run_check(paths, ab.current_platform(), t, "gate", str(ws), os.environ)
    assert rec["exit_code"] == 0, rec["stderr_tail"]
    seen = json.loads(rec["stdout_tail"].strip().splitlines()[-1])
    # The study shows only the way to the pristine gate copy bound back; its ledger, registry,
    # runs and the hidden tests are not there.
    assert seen["study"] == ["state"] and seen["state"] == ["pristine"], seen
    assert seen["tasks"] != [] and not isinstance(seen["tasks"], list), seen
    assert seen["gate"] == ["test_roman.py"]
    # the homes: nothing but the tool directories that Python and PATH need
    assert isinstance(seen["home"], str) or seen["home"] == [], seen
    tools = set(ab.tool_dirs([], [os.path.realpath(sys.prefix)], os.environ.get("PATH", "").split(os.pathsep),
                             [ACCOUNT_HOME]))
    assert isinstance(seen["account_home"], str) or {f"{ACCOUNT_HOME}/{n}" for n in seen["account_home"]} <= tools, seen
    assert seen["proc"] == ["1", "2"], seen   # its own pid namespace: bwrap's init and the check
    assert rec["sandbox"]["kind"] == "bwrap"


HOSTILE = '''
import json, os, signal
STATE = {state!r}
LEDGER = {ledger!r}
for target in (os.path.join(STATE, "hacked"), LEDGER):
    try:
        with open(target, "a") as fh:
            fh.write("{{}}\\n")
    except OSError:
        pass
receipt = json.dumps({{"passed": True, "score": 1.0, "checks": [], "tests_passed": 9, "tests_total": 9}})
ppid = os.getppid()
try:
    fds = os.listdir(f"/proc/{{ppid}}/fd")
except OSError:
    fds = []
for fd in fds:
    try:
        with open(f"/proc/{{ppid}}/fd/{{fd}}", "w") as fh:
            fh.write(receipt + "\\n")
    except OSError:
        pass
if {kill}:
    os.kill(ppid, signal.SIGKILL)

def to_roman(n):
    raise NotImplementedError

def from_roman(s):
    raise NotImplementedError
'''


@needs_bwrap
@pytest.mark.parametrize("kill", [True, False], ids=["forge-and-kill-the-harness", "forge-beside-the-harness"])
def test_a_hostile_solution_is_not_scored_a_pass_and_changes_nothing(tmp_path, kill):
    paths, tasks = _example_study(tmp_path, "bwrap")
    task = tasks["roman"]
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    (ws / "roman.py").write_text(HOSTILE.format(state=str(paths.state), ledger=str(paths.ledger), kill=kill))
    ab.pristine_copy(paths, task, "gate"), ab.pristine_copy(paths, task, "oracle")
    before_state, before_ws = _digest(paths.state), _digest(ws)
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), os.environ)
    assert rec["passed"] is False and rec["success"] is False and rec["score"] < 1.0, rec
    assert rec["receipt_channel"] == "fd" and rec["sandbox"]["kind"] == "bwrap"
    assert _digest(paths.state) == before_state
    assert _digest(ws) == before_ws   # the oracle graded a copy
    # The example gate (unittest, in-process, its receipt the exit status or the last stdout line)
    # is public feedback, not the score: it can be talked into a pass, and is recorded as such.
    gate = ab.run_check(paths, ab.current_platform(), task, "gate", str(ws), os.environ)
    assert gate["receipt_protected"] is False and gate["sandbox"]["kind"] == "bwrap"
    assert _digest(paths.state) == before_state


@needs_bwrap
def test_the_reference_passes_sandboxed_with_a_protected_receipt(tmp_path):
    paths, tasks = _example_study(tmp_path, "bwrap")
    task = tasks["roman"]
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    ab.copy_tree(task.reference, ws)
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), os.environ)
    assert rec["passed"] and rec["success"] and rec["score"] == 1.0, rec
    assert (rec["receipt_channel"], rec["receipt_protected"], rec.get("receipt_problem")) == ("fd", True, None)


def test_an_old_stdout_receipt_still_works_but_is_recorded_unprotected(tmp_path):
    paths, tasks = _example_study(tmp_path, "none")
    task = tasks["roman"]
    old = dict(task.oracle, cmd=["{python}", "{oracle}/run.py", "{workspace}", "--sandbox-run", "{sandbox_run}"])
    t = ab.dataclasses.replace(task, oracle=old)
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    ab.copy_tree(task.reference, ws)
    rec = ab.run_check(paths, ab.current_platform(), t, "oracle", str(ws), os.environ)
    assert rec["passed"] and (rec["receipt_channel"], rec["receipt_protected"]) == ("stdout", False)
    assert rec["sandbox"]["kind"] == "none"
    # Without bubblewrap the helper still runs the code (unsandboxed), and the record says so.
    assert rec["inner_sandbox"]["kind"] == "none" and rec["inner_sandbox"]["runs"] > 0


# The code under test reopens its harness's receipt channel through /proc (a pipe would allow
# it: read and write), leaves a grandchild blocked reading it, and swaps the honest line for a
# passing one.  A socket cannot be reopened that way, and the example harness is not dumpable.
SWAPPER = r'''
import json, os
def _attack():
    ppid = os.getppid()
    try:
        cmd = open(f"/proc/{ppid}/cmdline", "rb").read().split(b"\0")
        fd = int(cmd[cmd.index(b"--receipt-fd") + 1])
        os.close(os.open(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".claimed"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        p = os.open(f"/proc/{ppid}/fd/{fd}", os.O_RDWR)
    except Exception:
        return
    if os.fork() == 0:
        os.setsid()
        n = os.open(os.devnull, os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(n, i)
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(p, 65536)
            if not chunk:
                break
            data += chunk
        forged = {"passed": True, "score": 1.0, "checks": [], "tests_passed": 9, "tests_total": 9}
        os.write(p, (json.dumps(forged) + "\n").encode())
        os._exit(0)
    os.close(p)
_attack()
def to_roman(n):
    raise NotImplementedError
def from_roman(s):
    raise NotImplementedError
'''


@pytest.mark.parametrize("mode", [pytest.param("bwrap", marks=needs_bwrap), "none"])
def test_code_under_test_cannot_swap_the_receipt_on_the_channel(tmp_path, mode):
    paths, tasks = _example_study(tmp_path, mode)
    task = tasks["roman"]
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    (ws / "roman.py").write_text(SWAPPER)
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), dict(os.environ))
    assert rec["receipt_channel"] == "fd" and rec["receipt_protected"] is True
    assert (rec["passed"], rec["success"]) == (False, False), rec
    assert rec["sandbox"]["kind"] == mode


def test_the_bundled_example_study_is_hidden_from_every_sandbox(tmp_path):
    """Its references and hidden tests are those of any study copied from it (the demo's)."""
    (tmp_path / "s").mkdir()
    assert ab._real(ab.HERE / "examples") in ab.study_hidden_dirs(tmp_path / "s")


@pytest.mark.parametrize("env, cfg, mode", [
    ({}, {}, ab.SANDBOX_DEFAULT),
    ({"AGENTBENCH_SANDBOX_DEFAULT": ""}, {}, ab.SANDBOX_DEFAULT),
    ({"AGENTBENCH_SANDBOX_DEFAULT": "none"}, {}, "none"),
    ({"AGENTBENCH_SANDBOX_DEFAULT": "bwrap"}, {}, "bwrap"),
    ({"AGENTBENCH_SANDBOX_DEFAULT": "none"}, {"sandbox": "bwrap"}, "bwrap"),   # the study's key wins
    ({}, {"sandbox": "none"}, "none"),
])
def test_the_sandbox_mode_comes_from_the_study_then_the_given_environment(env, cfg, mode):
    assert ab.sandbox_mode_of(cfg, env) == mode
    if "sandbox" not in cfg:
        assert ab.sandbox_default(env) == mode


def test_a_bad_sandbox_default_in_the_given_environment_is_refused():
    with pytest.raises(ab.AgentbenchError) as info:
        ab.sandbox_default({"AGENTBENCH_SANDBOX_DEFAULT": "chroot"})
    assert info.value.code == "bad_sandbox_default" and info.value.payload["value"] == "chroot"
    with pytest.raises(ab.AgentbenchError) as info:
        ab.sandbox_mode_of({"sandbox": "chroot"}, {})
    assert info.value.code == "bad_sandbox_mode"


@pytest.mark.parametrize("long_dir", [False, True], ids=["in-the-job-dir", "path-too-long-so-under-tmp"])
def test_the_gateway_also_answers_on_its_unix_socket_and_removes_it(tmp_path, long_dir):
    near = tmp_path / ("d" * 120 if long_dir else "job")
    near.mkdir()
    gw = ab.MeteringGateway(upstream="http://127.0.0.1:9", creds={}, prices=None, record_path=tmp_path / "g.jsonl")
    gw.start()
    try:
        path = gw.listen_unix(near)
        assert (os.path.dirname(path) == str(near)) is (not long_dir)
        assert len(os.fsencode(path)) <= ab.GATEWAY_SOCKET_MAX_PATH
        import socket
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nx-api-key: guess\r\n\r\n{}")
            assert s.recv(64).startswith(b"HTTP/1.1 401"), "a wrong token is refused here too"
    finally:
        gw.stop(wait_s=0)
    assert not os.path.exists(path) and (near.is_dir() and (long_dir or list(near.iterdir()) == []))
    if long_dir:
        assert not os.path.exists(os.path.dirname(path))


@pytest.mark.parametrize("path, why", [
    ("/s/arm/system.md", None),
    ("/s/tasks/t/public/notes.md", None),                 # a task's public part may be shown
    ("/s/tasks/t/public", None),
    ("/s/tasks/t/oracle/run.py", "hidden"),
    ("/s/tasks/t/reference", "hidden"),
    ("/s/tasks/t", "hidden"),
    ("/s/tasks", "tasks directory"),
    ("/s/state/registry.json", "state/"),
    ("/s/runs/r1/workspace", "runs/"),
    ("/s", "state/"),                                     # the study itself holds all of it
    ("/elsewhere/x", "outside the study"),
    ("/root/.ssh", "outside the study"),
    ("/s/stateful/x", None),                              # a prefix is not a parent
])
def test_the_view_rule(path, why):
    got = ab.view_refusal(path, study="/s", tasks="/s/tasks")
    assert (got is None) if why is None else (got is not None and why in got), got


#: Names that steer a loader, a shell or an interpreter when a program starts with them.
STEERING_NAMES = ("LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "GCONV_PATH", "PYTHONSTARTUP", "PYTHONPATH",
                  "PYTHONHOME", "BASH_ENV", "ENV", "NODE_OPTIONS", "PERL5OPT", "RUBYOPT", "PATH", "IFS")


def test_no_name_of_a_sessions_env_reaches_bubblewrap_and_every_one_reaches_the_session(tmp_path):
    env = {name: f"/tmp/evil-{name.lower()}" for name in STEERING_NAMES}
    argv, outer, fd = ab.session_sandbox(
        "/usr/bin/bwrap", ["claude", "-p"], {**env, "CLAUDE_CONFIG_DIR": str(tmp_path / "cfg")},
        cwd=str(tmp_path), hidden=[], private_home=str(tmp_path / "home"),
        project_dir=str(tmp_path / "cfg" / "projects" / "p"), tools_env={"PATH": "/usr/bin:/bin"},
        network="open", outer_extra={"AGENTBENCH_JOB_MARK": "m"})
    try:
        inside = dict(kv.split(b"=", 1) for kv in os.pread(fd, 1 << 20, 0).split(b"\0") if kv)
    finally:
        os.close(fd)
    assert outer == {**ab.SANDBOX_OUTER_ENV, "AGENTBENCH_JOB_MARK": "m"}
    assert not any(v.startswith("/tmp/evil-") for v in argv)          # no value became an argument
    for name in STEERING_NAMES:                                        # all of them are the session's
        assert inside[name.encode()] == env[name].encode()
