"""What an arm, a task or a session provides never steers agentbench's own processes on the host,
and sandboxes share no writable state: the real `claude` binary, offline against the scripted
model, under bubblewrap (skipped, with the reason, where bubblewrap cannot run).

Each attack is first shown to work where it is not stopped (the control), then tried:
* an arm's `env` names a preload library (LD_PRELOAD), a Python start-up module (PYTHONPATH with
  a sitecustomize) and a PATH whose first entry is the task's hidden reference; the study's root
  holds a `json.py`.  No host process loads any of them (bubblewrap, the supervisor and the first
  program in the sandbox start with their own environment, isolated), the reference is not
  bound, and the arm's variables still reach the session inside.
* the same session fills its `/tmp` and `/dev/shm`, writes into `/dev`, then fills its HOME past
  `workspace_mb`: `/tmp` and `/dev/shm` are full at the cap, `/dev` is read-only, and the HOME's
  growth ends the session as the agent's failure.
* a key written to the kernel keyring: the host can, a sandbox cannot add nor read one.
* the oracle's copy of a workspace: made inside the oracle's own sandbox on a tmpfs of its own,
  sized by the copy caps (never on a disk a session's free-space reading could show).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ab, run_cli
from test_e2e_real import TASK, assign_by_position, cli_env, make_study

PROBE = ab.sandbox_probe()
pytestmark = [pytest.mark.skipif(os.name != "posix", reason="bubblewrap is Linux-only"),
              pytest.mark.skipif(not PROBE["available"], reason=f"bubblewrap cannot run here: {PROBE['reason']}")]

PRELOAD_C = r'''
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark(void) {
    FILE *f = fopen(MARKER, "a");
    if (f) { fprintf(f, "loaded\n"); fclose(f); }
}
'''


def _build_preload(where: Path, marker: Path) -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = where / "mark.c"
    src.write_text(PRELOAD_C)
    lib = where / "libmark.so"
    done = subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(lib), str(src)],
                          capture_output=True, text=True, timeout=120)
    return lib if done.returncode == 0 else None


def _tool_results(stream: Path) -> str:
    got = []
    for ln in stream.read_text().splitlines():
        msg = json.loads(ln).get("message") if ln.strip() else None
        for c in (msg or {}).get("content") or []:
            if isinstance(c, dict) and c.get("type") == "tool_result":
                got.append(json.dumps(c.get("content")))
    return "\n".join(got)


def test_an_arms_env_and_study_files_steer_no_host_process_and_every_writable_place_is_capped(
        tmp_path, real_claude, server):
    markers = tmp_path / "host-markers"      # under the host's /tmp: a sandbox's /tmp is its own
    markers.mkdir()
    lib = _build_preload(tmp_path, markers / "preload")
    if lib is None:
        pytest.skip("no C compiler here to build the preload library")
    pydir = tmp_path / "pystart"
    pydir.mkdir()
    (pydir / "sitecustomize.py").write_text(f"open({str(markers / 'pythonpath')!r}, 'a').write('loaded\\n')\n")
    study = make_study(tmp_path / "study", real_claude, arms=("A",), sandbox="bwrap", workspace_mb=16,
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
                            "CLAUDE_CODE_MAX_RETRIES": "0", "AGENTBENCH_OFFLINE": "1"})
    ref = study / "tasks" / TASK / "reference"
    starter = set((study / "tasks" / TASK / "public" / "roman.py").read_text().splitlines())
    needle = max((ln.strip() for ln in (ref / "roman.py").read_text().splitlines() if ln not in starter), key=len)
    (study / "json.py").write_text(f"open({str(markers / 'json')!r}, 'a').write('loaded\\n')\n"
                                   "from importlib import import_module as _m\n")
    arm_path = f"{ref}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    data = json.loads((study / "study.json").read_text())
    data["arms"]["A"]["env"] = {"LD_PRELOAD": str(lib), "PYTHONPATH": str(pydir), "PATH": arm_path,
                                "ARM_MARK": "reached-inside"}
    (study / "study.json").write_text(json.dumps(data, indent=1))

    # The control: each of them does steer a program that starts with it.
    subprocess.run(["/bin/true"], env={"LD_PRELOAD": str(lib)}, check=True, timeout=30)
    subprocess.run([sys.executable, "-c", "pass"], env={"PYTHONPATH": str(pydir)}, check=True, timeout=30)
    subprocess.run([sys.executable, "-c", "import json"], cwd=study, check=True, timeout=30)
    assert sorted(p.name for p in markers.iterdir()) == ["json", "preload", "pythonpath"]
    assert str(ref) in ab.host_tool_dirs(None, {"PATH": arm_path}, [])   # a PATH entry made a bind
    for p in markers.iterdir():
        p.unlink()
    # bubblewrap's own /dev is an unsized tmpfs (half the host's memory) that anyone inside may write
    plain = subprocess.run([PROBE["binary"], "--ro-bind", "/", "/", "--dev", "/dev", "--", "/bin/sh", "-c",
                            "head -c 20000000 /dev/zero > /dev/fill && head -c 20000000 /dev/zero > /dev/shm/fill"
                            " && echo wrote"], capture_output=True, text=True, timeout=60)
    assert plain.stdout.strip() == "wrote", plain.stderr

    task_md = study / "tasks" / TASK / "public" / "TASK.md"
    task_md.write_text(task_md.read_text() + "\n[agentbench-script:steer]\n")
    server.add_script("steer", {"steps": [
        {"text": "Looking.", "tool_uses": [{"name": "Bash", "input": {"description": "look", "command": (
            f"echo MARK=$ARM_MARK; cat {ref}/roman.py 2>&1 | head -50; ls {ref} 2>&1; "
            "dd if=/dev/zero of=/tmp/fill bs=1M count=64 2>&1 | tail -2; "
            "echo TMPSIZE $(df -k /tmp | tail -1); "
            "dd if=/dev/zero of=/dev/shm/fill bs=1M count=64 2>&1 | tail -2; "
            "echo SHMSIZE $(df -k /dev/shm | tail -1); echo DEVFILL; "
            "dd if=/dev/zero of=/dev/fill bs=1M count=1 2>&1 | tail -1")}}]},
        {"text": "Growing.", "tool_uses": [{"name": "Bash", "input": {"description": "grow", "timeout": 300000,
            "command": "head -c 40000000 /dev/zero > $HOME/fill; sleep 100"}}]},
        {"text": "Done."}]})
    rid = assign_by_position(study, 1)[0]["run_id"]
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    job = rec["jobs"][0]["job_id"]
    res = json.loads((study / "state" / "jobs" / job / "result.json").read_text())
    assert res["sandbox"]["kind"] == "bwrap"
    # HOME is counted by the live cap: the session is ended, the agent's failure
    assert (res["status"], res["reason"]) == ("failed", "workspace_over_cap"), res
    assert rec["outcome"] == "workspace_unusable" and rec["validity"] == "valid", rec
    seen = _tool_results(study / "runs" / rid / "raw" / "01-executor" / "stream.jsonl")
    assert "MARK=reached-inside" in seen                    # the arm's env is the session's, inside
    assert needle not in seen and "No such file" in seen    # its PATH bound nothing
    assert "No space left on device" in seen                # /tmp is capped at workspace_mb
    assert f" {16 * 1024} " in seen.split("TMPSIZE", 1)[1].split("\\n")[0]
    # /dev/shm is sized like /tmp and /dev itself is read-only
    assert f" {16 * 1024} " in seen.split("SHMSIZE", 1)[1].split("\\n")[0]
    assert "Read-only file system" in seen.split("DEVFILL", 1)[1]
    assert list(markers.iterdir()) == []                    # nothing loaded on the host


KEY_PY = r'''
import ctypes, errno, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
nr = json.loads(sys.argv[1])
def call(name, *a):
    ctypes.set_errno(0)
    rc = libc.syscall(L(nr[name]), *a)
    return rc if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
buf = ctypes.create_string_buffer(256)
out = {"add": call("add_key", b"user", b"ab-inside", b"from-inside", L(11), L(-4)),
       "read": call("keyctl", L(11), L(int(sys.argv[2])), buf, L(256))}
print(json.dumps(out))
'''


@pytest.mark.skipif(ab.seccomp_here()["arch"] is None, reason=str(ab.seccomp_here()["reason"]))
def test_the_kernel_keyring_is_shared_with_no_sandbox(tmp_path):
    numbers = ab.SECCOMP_ARCHES[ab.seccomp_here()["arch"]][1]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    token = f"KEY-{os.urandom(6).hex()}".encode()
    serial = libc.syscall(ctypes.c_long(numbers["add_key"]), b"user", b"ab-host", token, ctypes.c_long(len(token)),
                          ctypes.c_long(-4))   # KEY_SPEC_USER_KEYRING
    if serial < 0:
        pytest.skip(f"the host's keyring cannot be written here ({errno.errorcode.get(ctypes.get_errno())})")
    try:
        buf = ctypes.create_string_buffer(256)
        got = libc.syscall(ctypes.c_long(numbers["keyctl"]), ctypes.c_long(11), ctypes.c_long(serial), buf,
                           ctypes.c_long(256))                                          # KEYCTL_READ
        assert got == len(token) and buf.raw[:got] == token   # the control: the keyring works here
        ws = tmp_path / "ws"
        ws.mkdir()
        fd = ab.seccomp_fd()
        argv = ab.check_sandbox(PROBE["binary"], [sys.executable, "-I", "-c", KEY_PY, json.dumps(numbers),
                                                  str(serial)],
                                {"PATH": "/usr/bin:/bin"}, cwd=str(ws), hidden=[], ro=[], seccomp=fd)
        try:
            done = subprocess.run(argv, env=ab.SANDBOX_OUTER_ENV, capture_output=True, text=True, timeout=60,
                                  pass_fds=(fd,))
        finally:
            os.close(fd)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"add": "EPERM", "read": "EPERM"}
    finally:
        libc.syscall(ctypes.c_long(numbers["keyctl"]), ctypes.c_long(3), ctypes.c_long(serial))   # KEYCTL_REVOKE


ORACLE_PROBE = r'''
import json, os, sys
ws = sys.argv[1]
here = os.path.realpath(ws)
mounts = [ln.split() for ln in open("/proc/self/mounts")]
fs = max((m for m in mounts if here == m[1] or here.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]))
st = os.statvfs(here)
listing = sorted(os.listdir(ws))
ok = open(os.path.join(ws, "sol.py")).read().strip() == "VALUE = 42"
print(json.dumps({"passed": ok, "score": 1.0 if ok else 0.0, "fs": fs[2], "mnt": fs[1], "size": st.f_blocks * st.f_frsize,
                  "listing": listing, "link": os.readlink(os.path.join(ws, "zero")) if "zero" in listing else None}))
'''


def test_the_oracles_copy_is_made_inside_its_sandbox_on_its_own_sized_tmpfs(tmp_path):
    """Free space of a file system a session sees carried the oracle's text: its copy now lies on
    a tmpfs only that check has, sized by the copy caps; links stay links, a FIFO is left out, a
    workspace past the caps is the agent's (UnusableTree)."""
    from test_experiment import tiny_study
    study = tiny_study(tmp_path / "s", sandbox="bwrap", copy_total_mb=2)
    (study / "tasks" / "tiny" / "oracle" / "run.py").write_text(ORACLE_PROBE)
    # a harness that runs the inner sandbox ({sandbox_run}) gets its copy outside: this one does not
    tj = study / "tasks" / "tiny" / "task.json"
    spec = json.loads(tj.read_text())
    spec["oracle"]["cmd"] = [a for a in spec["oracle"]["cmd"] if a != "{sandbox_run}"]
    tj.write_text(json.dumps(spec))
    paths = ab.StudyPaths(study)
    task = ab.load_tasks(paths, json.loads((study / "study.json").read_text()))["tiny"]
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "sol.py").write_text("VALUE = 42\n")
    (ws / "zero").symlink_to("/dev/zero")
    os.mkfifo(ws / "fifo")
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), dict(os.environ))
    assert rec["passed"] and rec["sandbox"]["kind"] == "bwrap", rec
    seen = json.loads(rec["stdout_tail"].strip().splitlines()[-1])
    assert seen["mnt"] == ab.SANDBOX_COPY_DIR and seen["fs"] == "tmpfs", seen
    assert seen["size"] == 2 * 2 ** 20 + ab.SANDBOX_TMP_MB * 2 ** 20, seen
    assert seen["listing"] == ["sol.py", "zero"] and seen["link"] == "/dev/zero", seen
    (ws / "big.bin").write_bytes(os.urandom(3 * 2 ** 20))       # past copy_total_mb
    with pytest.raises(ab.UnusableTree) as exc:
        ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), dict(os.environ))
    assert exc.value.why in ("copy_over_cap", "file_over_cap"), exc.value.why
