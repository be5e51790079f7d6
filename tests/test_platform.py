"""Tests of the platform seam: path rules of both OSes, process identity and trees on real POSIX
processes, the Windows logic through replaced OS calls, detached launches and no-replace renames."""

from __future__ import annotations

import base64
import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import agentbench as ab

IS_POSIX = os.name == "posix" and os.path.isdir("/proc/self")
posix_only = pytest.mark.skipif(not IS_POSIX, reason="needs a POSIX system with /proc")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05):
    """Poll until predicate() is truthy; return its value (fails the test at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(interval)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.fixture
def posix() -> "ab.PosixPlatform":
    return ab.PosixPlatform()


@pytest.fixture
def reaped():
    """Popen objects to kill and reap whatever a test leaves behind."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


# --------------------------------------------------------------------------------------------------
# ProcId
# --------------------------------------------------------------------------------------------------


def test_procid_is_frozen_and_hashable():
    p = ab.ProcId(1, 2.0)
    with pytest.raises(Exception):
        p.pid = 3  # type: ignore[misc]
    assert {p, ab.ProcId(1, 2.0)} == {p}


# --------------------------------------------------------------------------------------------------
# Windows path rules (pure logic, any host)
# --------------------------------------------------------------------------------------------------

WIN = ab.WindowsPlatform(env={"USERPROFILE": "C:\\Users\\me"})
WIN_CWD = "C:\\work\\study"


@pytest.mark.parametrize("raw, expected", [
    ("C:\\x\\y", "C:\\x\\y"),
    ("c:\\x\\y", "C:\\x\\y"),
    ("c:/x/y", "C:\\x\\y"),
    ("C:/x/y/", "C:\\x\\y"),
    ("C:\\x\\\\y", "C:\\x\\y"),
    ("G:/", "G:\\"),
    ("g:\\", "G:\\"),
    ("C:\\", "C:\\"),
    ("C:\\a\\.\\b\\..\\c", "C:\\a\\c"),
    ("C:\\a\\..\\..\\..\\b", "C:\\b"),
    ("C:\\Mixed Case\\Some Dir", "C:\\Mixed Case\\Some Dir"),
    ("\\\\server\\share\\x\\y", "\\\\server\\share\\x\\y"),
    ("//server/share/x/../y", "\\\\server\\share\\y"),
    ("\\\\server\\share", "\\\\server\\share"),
    ("\\\\server\\share\\..\\..", "\\\\server\\share"),
    ("/g/x/y", "G:\\x\\y"),
    ("/g", "G:\\"),
    ("/c/", "C:\\"),
    ("/d/a/../b", "D:\\b"),
    ("/cygdrive/e/data", "E:\\data"),
    ("\\\\?\\C:\\long\\path", "C:\\long\\path"),
    ("\\\\?\\UNC\\srv\\sh\\x", "\\\\srv\\sh\\x"),
    ("rel\\a", "C:\\work\\study\\rel\\a"),
    ("rel/a/./b", "C:\\work\\study\\rel\\a\\b"),
    (".", "C:\\work\\study"),
    ("..\\up", "C:\\work\\up"),
    ("~", "C:\\Users\\me"),
    ("~\\docs", "C:\\Users\\me\\docs"),
    ("~/docs/x", "C:\\Users\\me\\docs\\x"),
])
def test_windows_normalize_accepts(raw, expected):
    assert WIN.normalize_path(raw, cwd=WIN_CWD) == expected


@pytest.mark.parametrize("raw, needle", [
    ("/mnt/c/Users/x", "WSL"),
    ("/mnt/d", "WSL"),
    ("C:foo", "drive-relative"),
    ("c:", "drive-relative"),
    ("\\foo\\bar", "without a drive"),
    ("/tmp/x", "without a drive"),
    ("\\\\server", "UNC"),
    ("\\\\server\\", "UNC"),
    ("\\\\.\\pipe\\x", "device"),
    ("\\\\?\\Volume{x}\\a", "device"),
    ("C:\\a<b", "characters"),
    ("C:\\a\\b:stream", "characters"),
    ("C:\\a?", "characters"),
    ("", "empty"),
    ("   ", "empty"),
])
def test_windows_normalize_refuses(raw, needle):
    with pytest.raises(ab.AgentbenchError) as exc:
        WIN.normalize_path(raw, cwd=WIN_CWD)
    assert needle in exc.value.payload["error"]


def test_windows_wsl_refusal_hints_the_windows_path():
    with pytest.raises(ab.AgentbenchError) as exc:
        WIN.normalize_path("/mnt/c/Users/me/study")
    assert exc.value.payload["hint"].endswith("C:\\Users\\me\\study")


def test_windows_drive_relative_refusal_hints_an_absolute_path():
    with pytest.raises(ab.AgentbenchError) as exc:
        WIN.normalize_path("d:work")
    assert "D:\\work" in exc.value.payload["hint"]


def test_windows_relative_path_needs_a_windows_cwd():
    # A relative path is resolved against the cwd, which must itself be a Windows path.
    with pytest.raises(ab.AgentbenchError):
        WIN.normalize_path("x", cwd="/home/me")


def test_windows_home_falls_back_to_homedrive_homepath():
    w = ab.WindowsPlatform(env={"HOMEDRIVE": "D:", "HOMEPATH": "\\Users\\u"})
    assert w.normalize_path("~\\a") == "D:\\Users\\u\\a"
    with pytest.raises(ab.AgentbenchError):
        ab.WindowsPlatform(env={}).normalize_path("~")


# --------------------------------------------------------------------------------------------------
# POSIX path rules
# --------------------------------------------------------------------------------------------------


def test_posix_normalize(monkeypatch, posix):
    monkeypatch.setenv("HOME", "/home/me")
    assert posix.normalize_path("~/x/../y") == "/home/me/y"
    assert posix.normalize_path("~") == "/home/me"
    assert posix.normalize_path("/a/./b//c/../d/") == "/a/b/d"
    assert posix.normalize_path("rel/./x", cwd="/base/dir") == "/base/dir/rel/x"
    assert posix.normalize_path("../x", cwd="/base/dir") == "/base/x"
    assert posix.normalize_path("/mnt/c/Users") == "/mnt/c/Users"  # fine under WSL
    assert posix.normalize_path("/") == "/"


@posix_only
def test_posix_normalize_does_not_resolve_symlinks(tmp_path, posix):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert posix.normalize_path(str(tmp_path / "link" / "x")) == str(tmp_path / "link" / "x")


@posix_only
def test_posix_normalize_relative_defaults_to_cwd(tmp_path, monkeypatch, posix):
    monkeypatch.chdir(tmp_path)
    assert posix.normalize_path("a/b") == os.path.join(os.getcwd(), "a", "b")


@pytest.mark.parametrize("raw", ["", "  ", "a\0b", "C:\\Users\\x", "d:/data"])
def test_posix_normalize_refuses(raw, posix):
    with pytest.raises(ab.AgentbenchError):
        posix.normalize_path(raw)


# --------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------


def test_select_platform_override_and_default():
    assert isinstance(ab.select_platform({"AGENTBENCH_PLATFORM": "windows"}), ab.WindowsPlatform)
    assert isinstance(ab.select_platform({"AGENTBENCH_PLATFORM": "posix"}), ab.PosixPlatform)
    assert ab.select_platform({"AGENTBENCH_PLATFORM": "Windows "}).name == "windows"
    native = ab.select_platform({})
    assert native.name == ("windows" if os.name == "nt" else "posix")
    with pytest.raises(ab.AgentbenchError):
        ab.select_platform({"AGENTBENCH_PLATFORM": "beos"})


def test_current_platform_is_chosen_once():
    assert ab.current_platform() is ab.current_platform()
    assert isinstance(ab.current_platform(), ab.Platform)


def test_windows_platform_constructible_without_ctypes_calls():
    w = ab.WindowsPlatform()
    assert w.name == "windows"
    assert w.helper_popen_kwargs() == {"creationflags": 0x08000000}
    assert ab.PosixPlatform().helper_popen_kwargs() == {}


# --------------------------------------------------------------------------------------------------
# tree logic on a synthetic table (pure)
# --------------------------------------------------------------------------------------------------


def info(ppid, ctime, pgid=None, sid=None):
    return ab._ProcInfo(ppid, ctime, pgid, sid)


def test_descendants_reject_child_older_than_parent():
    # pid 100 is the root; 103 carries a stale ppid 100 from an earlier holder of that pid.
    table = {100: (1, 1000.0), 101: (100, 1001.0), 102: (101, 1002.0),
             103: (100, 900.0), 104: (103, 950.0), 105: (102, 1001.5)}
    got = ab.PosixPlatform().descendants(ab.ProcId(100, 1000.0), table)
    # 105 claims 102 as parent but predates it: a stale link as well.
    assert got == [ab.ProcId(101, 1001.0), ab.ProcId(102, 1002.0)]


def test_descendants_of_dead_root_use_alive_until_and_occupant():
    root = ab.ProcId(200, 2000.0)
    orphans = {201: (200, 2001.0), 202: (201, 2003.0), 209: (200, 2100.0)}
    w = ab.WindowsPlatform()
    # Root gone, nothing holds pid 200: without alive_until both direct orphans qualify.
    assert {p.pid for p in w.descendants(root, dict(orphans))} == {201, 202, 209}
    # Known to be alive until 2010: 209 appeared later, so it is not the root's.
    assert {p.pid for p in w.descendants(root, dict(orphans), alive_until=2010.0)} == {201, 202}
    # pid 200 reused by a process born at 2050: its child 209 is not the root's.
    reused = {**orphans, 200: (5, 2050.0)}
    assert {p.pid for p in w.descendants(root, reused)} == {201, 202}
    # A dead root of unknown age: nothing can be attributed.
    assert w.descendants(ab.ProcId(200, None), dict(orphans)) == []


def test_tree_snapshot_session_members(monkeypatch):
    plat = ab.PosixPlatform()
    scan = {
        50: info(1, 100.0, 50, 50),       # the root, a session leader
        51: info(50, 101.0, 50, 50),      # its child
        60: info(1, 102.0, 50, 50),       # orphan re-parented to init, same session
        61: info(60, 103.0, 61, 50),      # its child in its own group
        70: info(1, 99.0, 70, 70),        # unrelated
        80: info(1, 300.0, 80, 80),       # unrelated, new session
    }
    monkeypatch.setattr(plat, "_scan", lambda: dict(scan))
    root = ab.ProcId(50, 100.0)
    assert [p.pid for p in plat.tree_snapshot([root])] == [50, 51]
    assert [p.pid for p in plat.tree_snapshot([root], session_ids=[50])] == [50, 51, 60, 61]

    # Dead root: members found through the session, bounded by the root's start.
    dead = {k: v for k, v in scan.items() if k != 50}
    monkeypatch.setattr(plat, "_scan", lambda: dict(dead))
    assert [p.pid for p in plat.tree_snapshot([root], session_ids=[50], alive_until=110.0)] == [
        51, 60, 61]
    # A session whose members all appeared after the root was last seen may be a reused id.
    late = {81: info(1, 500.0, 50, 50)}
    monkeypatch.setattr(plat, "_scan", lambda: dict(late))
    assert plat.tree_snapshot([root], session_ids=[50], alive_until=110.0) == []
    # ...but while an older member is left, the session is provably the root's.
    mixed = {60: info(1, 102.0, 50, 50), 81: info(1, 500.0, 50, 50)}
    monkeypatch.setattr(plat, "_scan", lambda: dict(mixed))
    assert [p.pid for p in plat.tree_snapshot([root], session_ids=[50], alive_until=110.0)] == [
        60, 81]


# --------------------------------------------------------------------------------------------------
# real POSIX processes
# --------------------------------------------------------------------------------------------------


@posix_only
def test_ctime_of_self_is_stable(posix):
    first = posix.process_ctime(os.getpid())
    assert first is not None
    assert posix.process_ctime(os.getpid()) == first
    # A fresh instance (another btime read) agrees within the tolerance.
    assert abs(ab.PosixPlatform().process_ctime(os.getpid()) - first) <= posix.ctime_tolerance_s
    assert first <= time.time()
    me = posix.proc_id(os.getpid())
    assert me == ab.ProcId(os.getpid(), first) and posix.is_alive(me)


def test_posix_without_proc_fails_loudly(tmp_path):
    plat = ab.PosixPlatform(proc_root=str(tmp_path))
    with pytest.raises(ab.AgentbenchError):
        plat.process_ctime(os.getpid())
    with pytest.raises(ab.AgentbenchError):
        plat.process_table()
    assert plat.normalize_path("/a/../b") == "/b"  # pure logic still works


@posix_only
def test_child_ctime_is_after_parent_and_table_lists_it(posix, reaped):
    child = subprocess.Popen(py("import time; time.sleep(30)"))
    reaped.append(child)
    ct = wait_for(lambda: posix.process_ctime(child.pid))
    assert ct >= posix.process_ctime(os.getpid())
    table = posix.process_table()
    assert table[child.pid] == (os.getpid(), ct)
    assert ab.ProcId(child.pid, ct) in posix.descendants(posix.proc_id(os.getpid()))


@posix_only
def test_no_such_process(posix, reaped):
    gone = subprocess.Popen(py("pass"))
    gone.wait()
    assert posix.process_ctime(gone.pid) is None
    assert posix.proc_id(gone.pid) is None
    assert not posix.is_alive(ab.ProcId(gone.pid, 1.0))
    assert posix.kill_tree([ab.ProcId(gone.pid, 1.0)], grace_s=0) == []  # nothing to kill, no error


@posix_only
def test_zombie_counts_as_dead(posix, reaped):
    child = subprocess.Popen(py("pass"))
    reaped.append(child)
    ident = wait_for(lambda: posix.proc_id(child.pid))
    # Not reaped yet: it is a zombie, which still has a creation time but is not alive.
    wait_for(lambda: not posix.is_alive(ident))
    assert posix.proc_id(child.pid) == ident
    assert child.pid not in posix.process_table()


@posix_only
@pytest.mark.parametrize("use_pidfd", [True, False])
def test_reused_pid_is_never_signalled(posix, reaped, monkeypatch, use_pidfd):
    if not use_pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    child = subprocess.Popen(py("import time; time.sleep(30)"))
    reaped.append(child)
    real = wait_for(lambda: posix.proc_id(child.pid))
    impostor = ab.ProcId(child.pid, real.ctime - 60.0)  # same pid, an earlier process
    assert not posix.is_alive(impostor)
    assert posix.kill_tree([impostor], grace_s=0.1) == []
    time.sleep(0.2)
    assert child.poll() is None and posix.is_alive(real)
    assert posix.kill_tree([real], grace_s=5) == []
    assert child.wait(timeout=10) == -15


TREE_SCRIPT = """
import os, signal, subprocess, sys, time
sleeper = "import time; time.sleep(60)"
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
parent_of_one = ("import subprocess, sys, time; "
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                 "time.sleep(60)")
subprocess.Popen([sys.executable, "-c", stubborn])                            # same group
subprocess.Popen([sys.executable, "-c", parent_of_one], preexec_fn=os.setpgrp)  # own group
time.sleep(60)
"""


@posix_only
def test_kill_tree_kills_a_real_tree(posix, reaped):
    root_proc = subprocess.Popen([sys.executable, "-c", TREE_SCRIPT])
    reaped.append(root_proc)
    root = wait_for(lambda: posix.proc_id(root_proc.pid))
    # root + stubborn grandchild + group-leader grandchild + its child
    tree = wait_for(lambda: (lambda t: t if len(t) == 4 else None)(posix.tree_snapshot([root])))
    assert tree[0] == root
    table = posix._scan()
    groups = {table[p.pid].pgid for p in tree}
    assert len(groups) == 2  # the caller's group and the grandchild's own one
    assert posix.kill_tree([root], grace_s=0.3) == []
    assert not any(posix.is_alive(p) for p in tree)
    assert root_proc.wait(timeout=10) == -15  # the root got the graceful signal
    assert posix.is_alive(posix.proc_id(os.getpid()))  # and we are untouched


ORPHAN_SCRIPT = """
import os, subprocess, sys, time
mid = ("import subprocess, sys; "
       "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
       "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
       "print(p.pid, flush=True)")
out = subprocess.run([sys.executable, "-c", mid], capture_output=True, text=True).stdout
open(sys.argv[1] + ".tmp", "w").write(out.strip())
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


@posix_only
def test_session_hint_finds_reparented_orphans(posix, reaped, tmp_path):
    pid_file = tmp_path / "orphan.pid"
    root_proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(pid_file)],
                                 start_new_session=True)
    reaped.append(root_proc)
    root = wait_for(lambda: posix.proc_id(root_proc.pid))
    orphan_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text()))
    orphan = wait_for(lambda: posix.proc_id(orphan_pid))
    assert posix.process_table()[orphan_pid][0] != root.pid  # re-parented away from the root
    assert orphan not in posix.tree_snapshot([root])
    assert orphan in posix.tree_snapshot([root], session_ids=[root.pid])
    assert posix.kill_tree([root], session_ids=[root.pid], grace_s=0.5) == []
    assert not posix.is_alive(orphan) and not posix.is_alive(root)


@posix_only
def test_kill_tree_with_nothing_alive_returns_empty(posix):
    assert posix.kill_tree([], grace_s=0.1) == []
    assert posix.kill_tree([ab.ProcId(2**22 + 7, 1.0)], grace_s=0.1) == []


SWEEP_OWN_SESSION = """
import os, subprocess, sys
import agentbench as ab
plat = ab.current_platform()
kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
me = plat.proc_id(os.getpid())
target = None
while target is None:
    target = plat.proc_id(kid.pid)
# As a supervisor does after its session's main process ended: sweep the whole own session.
survivors = plat.kill_tree([target], session_ids=[os.getsid(0)], grace_s=0.5)
kid.wait(timeout=10)
print(len(survivors), plat.is_alive(me), kid.returncode)
"""


@posix_only
def test_kill_tree_sweeping_own_session_spares_the_caller(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(ab.__file__)))
    env.pop("AGENTBENCH_PLATFORM", None)
    done = subprocess.run([sys.executable, "-c", SWEEP_OWN_SESSION], env=env, capture_output=True,
                          text=True, timeout=30, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True", "-15"]


DETACH_PARENT = """
import os, sys
import agentbench as ab
child = ("import os, sys, time; print(os.environ.get('AB_MARK'), os.getcwd(), flush=True); "
         "time.sleep(30)")
env = dict(os.environ, AB_MARK="m42")
print(ab.current_platform().detach_argv_popen([sys.executable, "-c", child], cwd=sys.argv[1],
                                              env=env, log_path=sys.argv[2]))
"""


@posix_only
def test_detach_survives_its_parent_in_a_new_session(posix, tmp_path):
    log = tmp_path / "sup.log"
    log.write_text("old line\n")
    workdir = tmp_path / "wd"
    workdir.mkdir()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(ab.__file__)))
    env.pop("AGENTBENCH_PLATFORM", None)
    parent = subprocess.run([sys.executable, "-c", DETACH_PARENT, str(workdir), str(log)],
                            env=env, capture_output=True, text=True, timeout=30)
    assert parent.returncode == 0, parent.stderr
    pid = int(parent.stdout.strip())
    child = wait_for(lambda: posix.proc_id(pid))
    try:
        assert posix.is_alive(child)  # its parent has exited
        assert os.getsid(pid) == pid != os.getsid(0)
        assert os.getpgid(pid) == pid
        lines = wait_for(lambda: (lambda t: t if len(t) >= 2 else None)(
            log.read_text().splitlines()))
        assert lines[0] == "old line"  # appended, not truncated
        assert lines[1] == f"m42 {workdir}"
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    finally:
        assert posix.kill_tree([child], grace_s=0.5) == []


def test_detach_failure_is_an_agentbench_error(posix, tmp_path):
    with pytest.raises(ab.AgentbenchError):
        posix.detach_argv_popen([str(tmp_path / "no-such-binary")], str(tmp_path), dict(os.environ),
                                str(tmp_path / "log"))


# --------------------------------------------------------------------------------------------------
# rename_no_replace
# --------------------------------------------------------------------------------------------------


@pytest.fixture(params=["native", "link-fallback"])
def renamer(request, monkeypatch):
    plat = ab.PosixPlatform()
    if request.param == "link-fallback":
        plat._renameat2 = False  # as on systems without renameat2
    return plat


@posix_only
def test_rename_no_replace(renamer, tmp_path):
    src, dst = tmp_path / "lock", tmp_path / "lock.stale"
    src.write_text("A")
    dst.write_text("B")
    assert renamer.rename_no_replace(str(src), str(dst)) is False
    assert src.read_text() == "A" and dst.read_text() == "B"
    dst.unlink()
    assert renamer.rename_no_replace(str(src), str(dst)) is True
    assert not src.exists() and dst.read_text() == "A"
    assert renamer.rename_no_replace(str(src), str(tmp_path / "other")) is False  # src gone
    assert not (tmp_path / "other").exists()


@posix_only
def test_rename_no_replace_race_has_one_winner(renamer, tmp_path):
    for round_no in range(20):
        src = tmp_path / f"lock{round_no}"
        src.write_text("x")
        results: list[bool] = []
        barrier = threading.Barrier(4)

        def go(i: int) -> None:
            barrier.wait()
            results.append(renamer.rename_no_replace(str(src), str(tmp_path / f"b{round_no}.{i}")))

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == [False, False, False, True]
        assert not src.exists()
        assert len(list(tmp_path.glob(f"b{round_no}.*"))) == 1


# --------------------------------------------------------------------------------------------------
# Windows through replaced OS calls
# --------------------------------------------------------------------------------------------------


class FakeWindows:
    """A tiny process model behind WindowsPlatform's OS-call methods. A handle pins the process
    it was opened on (pid + creation time), as a real handle does."""

    def __init__(self, procs: dict[int, tuple[int, float]]):
        self.procs = {pid: {"ppid": pp, "ctime": ct, "alive": True}
                      for pid, (pp, ct) in procs.items()}
        self.terminated: list[int] = []
        self.helpers: list[list[str]] = []
        self.stubborn: set[int] = set()

    def install(self, w: "ab.WindowsPlatform", monkeypatch) -> None:
        monkeypatch.setattr(w, "_open_process", self.open_process)
        monkeypatch.setattr(w, "_close_handle", lambda h: None)
        monkeypatch.setattr(w, "_get_process_times", lambda h: h[1])
        monkeypatch.setattr(w, "_handle_running", self.running)
        monkeypatch.setattr(w, "_terminate_handle", self.terminate)
        monkeypatch.setattr(w, "_toolhelp_snapshot", self.snapshot)
        monkeypatch.setattr(w, "_run_helper", self.run_helper)

    def open_process(self, pid, access):
        p = self.procs.get(pid)
        return None if p is None or not p["alive"] else (pid, p["ctime"])

    def running(self, h):
        p = self.procs.get(h[0])
        return bool(p and p["alive"] and p["ctime"] == h[1])

    def terminate(self, h, code=1):
        if h[0] in self.stubborn:
            return False
        assert self.running(h)
        self.procs[h[0]]["alive"] = False
        self.terminated.append(h[0])
        return True

    def snapshot(self):
        return [(pid, p["ppid"]) for pid, p in self.procs.items() if p["alive"]]

    def run_helper(self, cmd, timeout_s=120.0):
        self.helpers.append(list(cmd))
        if cmd[:4] == ["taskkill", "/T", "/F", "/PID"]:
            # Like the real tool: follows ppid links only, no creation-time check.
            stack = [int(cmd[4])]
            while stack:
                pid = stack.pop()
                if pid in self.procs and self.procs[pid]["alive"]:
                    self.procs[pid]["alive"] = False
                    stack.extend(c for c, p in self.procs.items() if p["ppid"] == pid)
            return subprocess.CompletedProcess(cmd, 0, "SUCCESS", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")


TREE = {4: (0, 1.0), 100: (4, 1000.0), 101: (100, 1001.0), 102: (101, 1002.0),
        103: (100, 1003.0)}


@pytest.fixture
def fakewin(monkeypatch):
    def make(procs):
        w = ab.WindowsPlatform(env={})
        fake = FakeWindows(procs)
        fake.install(w, monkeypatch)
        return w, fake
    return make


def test_windows_process_table_and_identity(fakewin):
    w, fake = fakewin(dict(TREE))
    assert w.process_table() == {pid: v for pid, v in TREE.items()}
    assert w.proc_id(101) == ab.ProcId(101, 1001.0)
    assert w.proc_id(999) is None
    assert w.is_alive(ab.ProcId(101, 1001.0))
    assert not w.is_alive(ab.ProcId(101, 1500.0))
    assert [p.pid for p in w.descendants(ab.ProcId(100, 1000.0))] == [101, 103, 102]


def test_windows_wrong_identity_is_never_terminated(fakewin):
    w, fake = fakewin(dict(TREE))
    assert not w._terminate_verified(ab.ProcId(101, 999.0))
    assert w.kill_tree([ab.ProcId(100, 5.0)], grace_s=0) == []
    assert fake.terminated == [] and fake.helpers == []
    w._terminate_verified(ab.ProcId(101, 1001.0))
    assert fake.terminated == [101]


def test_windows_kill_tree_uses_taskkill_then_verifies(fakewin):
    w, fake = fakewin(dict(TREE))
    assert w.kill_tree([ab.ProcId(100, 1000.0)], grace_s=0) == []
    assert fake.helpers == [["taskkill", "/T", "/F", "/PID", "100"]]
    assert [pid for pid, p in fake.procs.items() if p["alive"]] == [4]


def test_windows_kill_tree_skips_taskkill_when_a_stale_ppid_stranger_hangs_below(fakewin):
    procs = dict(TREE)
    procs[150] = (100, 500.0)  # older than the root: its ppid points at an earlier pid-100
    w, fake = fakewin(procs)
    assert w.kill_tree([ab.ProcId(100, 1000.0)], grace_s=0) == []
    assert fake.helpers == []  # taskkill /T would have killed the stranger
    assert sorted(fake.terminated) == [100, 101, 102, 103]
    assert fake.procs[150]["alive"]


def test_windows_kill_tree_sweeps_orphans_of_a_dead_root(fakewin):
    procs = {4: (0, 1.0), 201: (200, 2001.0), 202: (201, 2002.0), 300: (4, 100.0)}
    w, fake = fakewin(procs)
    survivors = w.kill_tree([ab.ProcId(200, 2000.0)], grace_s=0, alive_until=2010.0)
    assert survivors == []
    assert sorted(fake.terminated) == [201, 202] and fake.procs[300]["alive"]


def test_windows_kill_tree_reports_survivors(fakewin):
    w, fake = fakewin(dict(TREE))
    fake.stubborn.add(102)
    w.kill_rounds = 1
    fake.procs[102]["ppid"] = 4  # not reachable by taskkill either
    fake.procs[102]["ctime"] = 1002.0
    w._run_helper = lambda cmd, timeout_s=0: subprocess.CompletedProcess(cmd, 0, "", "")
    survivors = w.kill_tree([ab.ProcId(100, 1000.0), ab.ProcId(102, 1002.0)], grace_s=0)
    assert survivors == [ab.ProcId(102, 1002.0)]


def test_windows_run_helper_hides_the_console(monkeypatch):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen.update(kwargs)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    ab.WindowsPlatform()._run_helper(["taskkill", "/?"])
    assert seen["creationflags"] == 0x08000000
    assert seen["stdin"] == subprocess.DEVNULL


def test_filetime_conversion():
    assert ab._filetime_to_epoch(116444736000000000) == 0.0
    assert ab._filetime_to_epoch(116444736000000000 + 15_000_000) == 1.5


def decoded_script(cmd: list[str]) -> str:
    assert cmd[0].lower() == "powershell.exe"
    assert "-NoProfile" in cmd and "-NonInteractive" in cmd
    return base64.b64decode(cmd[cmd.index("-EncodedCommand") + 1]).decode("utf-16-le")


def ps_literal(script: str, name: str) -> str:
    m = re.search(name + r" = '((?:[^']|'')*)'", script)
    assert m, script
    return m.group(1).replace("''", "'")


def test_build_cim_create_command():
    argv = ["C:\\Program Files\\Python\\python.exe", "C:\\my study\\agentbench.py", "_supervise",
            'say "hi"', "it's", "a\u2019b", "trailing\\"]
    cwd = "C:\\Users\\o'neil\\study"
    script = decoded_script(ab.build_cim_create_command(argv, cwd))
    assert "Win32_ProcessStartup" in script and "ShowWindow = [uint16]0" in script
    assert "Invoke-CimMethod" in script and "-ClassName Win32_Process " in script
    assert "-MethodName Create" in script and "ProcessStartupInformation = $startup" in script
    # The curly quote is doubled as well (PowerShell treats it as a single quote).
    assert "a\u2019\u2019b" in script
    cmdline = ps_literal(script, "CommandLine").replace("\u2019\u2019", "\u2019")
    assert cmdline == subprocess.list2cmdline(argv)
    assert ps_literal(script, "CurrentDirectory") == cwd


def test_build_cim_create_command_refuses_empty_and_huge():
    with pytest.raises(ab.AgentbenchError):
        ab.build_cim_create_command([], "C:\\")
    with pytest.raises(ab.AgentbenchError):
        ab.build_cim_create_command(["x" * 20000], "C:\\")


def test_windows_detach_parses_the_process_id(fakewin):
    w, fake = fakewin({})
    argv, cwd = ["C:\\py\\python.exe", "agentbench.py", "_supervise"], "C:\\s"
    out = "AGENTBENCH_CIM ReturnValue=0 ProcessId=4242\r\n"
    reply = subprocess.CompletedProcess([], 0, out, "")
    w._run_helper = lambda cmd, timeout_s=0: (fake.helpers.append(cmd), reply)[1]
    assert w.detach_argv_popen(argv, cwd, {}, "C:\\s\\log") == 4242
    assert fake.helpers == [ab.build_cim_create_command(argv, cwd)]


@pytest.mark.parametrize("reply", [
    subprocess.CompletedProcess([], 0, "AGENTBENCH_CIM ReturnValue=9 ProcessId=\r\n", ""),
    subprocess.CompletedProcess([], 1, "", "Invoke-CimMethod : Access denied"),
    subprocess.CompletedProcess([], 0, "garbage", ""),
])
def test_windows_detach_failure(reply):
    w = ab.WindowsPlatform(env={})
    w._run_helper = lambda cmd, timeout_s=0: reply
    with pytest.raises(ab.AgentbenchError) as exc:
        w.detach_argv_popen(["C:\\py.exe"], "C:\\", {}, "C:\\log")
    assert exc.value.payload["error"] == "detached launch through CIM failed"


def test_detach_env_file_round_trip(tmp_path):
    log = str(tmp_path / "sup.log")
    env = {"PATH": "C:\\bin", "ANTHROPIC_API_KEY": "k"}
    assert ab.PosixPlatform().detach_env_file(env, log) is None
    path = ab.WindowsPlatform().detach_env_file(env, log)
    assert path == log + ".env.json"
    if os.name == "posix":
        assert os.stat(path).st_mode & 0o077 == 0  # owner-only
    # Written again (a stale file from an earlier launch is replaced).
    assert ab.WindowsPlatform().detach_env_file(env, log) == path
    assert ab.read_detach_env_file(path) == env
    assert not os.path.exists(path)
    with pytest.raises(ab.AgentbenchError):
        ab.read_detach_env_file(path)


class _Fn:
    """A callable that accepts argtypes/restype assignments, like a ctypes function."""

    def __init__(self, impl):
        self.impl = impl

    def __call__(self, *args):
        return self.impl(*args)


class FakeKernel32:
    """Stands in for ctypes.WinDLL("kernel32") so the ctypes glue itself runs on any host.
    Process 500 and 501 exist (creation time = pid seconds after the epoch)."""

    def __init__(self):
        self.closed: list[int] = []
        self.rows = [(0, 0), (4, 0), (500, 4), (501, 500)]
        self.cursor = 0
        for name in ("OpenProcess", "CloseHandle", "GetProcessTimes", "WaitForSingleObject",
                     "TerminateProcess", "CreateToolhelp32Snapshot", "Process32FirstW",
                     "Process32NextW"):
            setattr(self, name, _Fn(getattr(self, "_" + name)))

    def _OpenProcess(self, access, inherit, pid):
        return 1000 + pid if pid in (500, 501) else None

    def _CloseHandle(self, handle):
        self.closed.append(handle)
        return 1

    def _GetProcessTimes(self, handle, created, exited, kernel, user):
        ticks = 116444736000000000 + (handle - 1000) * 10_000_000
        created._obj.dwLowDateTime = ticks & 0xFFFFFFFF  # byref() keeps the target in _obj
        created._obj.dwHighDateTime = ticks >> 32
        return 1

    def _WaitForSingleObject(self, handle, ms):
        return 0x102  # WAIT_TIMEOUT: still running

    def _TerminateProcess(self, handle, code):
        return 1

    def _CreateToolhelp32Snapshot(self, flags, pid):
        self.cursor = 0
        return 77

    def _Process32FirstW(self, snap, entry_ref):
        return self._Process32NextW(snap, entry_ref)

    def _Process32NextW(self, snap, entry_ref):
        if self.cursor >= len(self.rows):
            return 0
        entry = entry_ref._obj
        assert entry.dwSize == ctypes.sizeof(entry)
        entry.th32ProcessID, entry.th32ParentProcessID = self.rows[self.cursor]
        self.cursor += 1
        return 1


def test_windows_ctypes_glue_runs_against_a_fake_kernel32(monkeypatch):
    fake = FakeKernel32()
    monkeypatch.setattr(ctypes, "WinDLL", lambda name, use_last_error=False: fake, raising=False)
    w = ab.WindowsPlatform(env={})
    assert w.process_ctime(500) == 500.0
    assert w.process_ctime(9) is None
    assert w.process_table() == {4: (0, None), 500: (4, 500.0), 501: (500, 501.0)}
    assert w.is_alive(ab.ProcId(501, 501.0)) and not w.is_alive(ab.ProcId(501, 7.0))
    w._terminate_verified(ab.ProcId(501, 501.0))
    assert 77 in fake.closed  # the snapshot handle is released
    assert fake.closed.count(1501) >= 3  # and every process handle


def test_select_platform_hands_its_environment_to_the_windows_platform():
    w = ab.select_platform({"AGENTBENCH_PLATFORM": "windows", "USERPROFILE": "C:\\Users\\given"})
    assert w.normalize_path("~\\a") == "C:\\Users\\given\\a"
