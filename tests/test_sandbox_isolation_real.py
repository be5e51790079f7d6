"""The sandbox's file view, network and system-call filter, tried from inside (skipped, with the
reason, where bubblewrap cannot run).

What is proved: a check and a session (the real binary, offline against the scripted model
through its gateway) cannot read another directory of the host (a second checkout of the example
study outside the study, this source tree) nor /etc's secrets; cannot connect to a loopback
listener of the host (a listener standing in for another run, and the scripted model itself);
two sessions of one study cannot reach each other; a check has no network at all; each denied
system call fails inside with EPERM where, unfiltered, it fails otherwise (so the filter, not the
host's settings, refuses it); and a study that opens the network for an arm gets it, recorded in
the run and said in the report.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import ROOT, init_real_study, run_cli, run_main, wait_result, write_brief

PROBE = ab.sandbox_probe()
SECCOMP = ab.seccomp_here()
pytestmark = [pytest.mark.skipif(os.name != "posix", reason="bubblewrap is Linux-only"),
              pytest.mark.skipif(not PROBE["available"], reason=f"bubblewrap cannot run here: {PROBE['reason']}")]

#: What each denied call gives without the filter, for the harmless arguments the probe uses:
#: ptrace/kcmp on a pid that does not exist (ESRCH), process_vm_* with flags 1 (EINVAL),
#: pidfd_getfd on descriptor -1 (EBADF), perf_event_open with a NULL attribute (EFAULT), add_key
#: and request_key with a NULL type (EFAULT), keyctl with an operation that does not exist.
UNFILTERED = {"ptrace": {"ESRCH", "EPERM"}, "process_vm_readv": {"EINVAL"}, "process_vm_writev": {"EINVAL"},
              "pidfd_getfd": {"EBADF"}, "kcmp": {"ESRCH", "EINVAL", "EPERM"},
              "perf_event_open": {"EFAULT", "EACCES", "ENOENT", "ENODEV", "EPERM"},
              "add_key": {"EFAULT"}, "request_key": {"EFAULT"}, "keyctl": {"EOPNOTSUPP", "ENOTSUP"}}

#: The probe run inside: reads files, connects to loopback ports (sending a marker), makes each
#: denied call; its arguments and its answer are files in its working directory.
PROBE_PY = r'''
import ctypes, errno, json, os, socket, sys
args = json.load(open("probe_args.json"))
out = {"read": {}, "connect": {}, "syscalls": {}}
def err(e):
    return "ERR " + errno.errorcode.get(e.errno or 0, type(e).__name__)
for p in args["read"]:
    try:
        with open(p, "rb") as fh:
            out["read"][p] = fh.read(300).decode("utf-8", "replace")
    except OSError as e:
        out["read"][p] = err(e)
for port in args["connect"]:
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"LEAK " + args["marker"].encode())
        out["connect"][str(port)] = "connected"
    except OSError as e:
        out["connect"][str(port)] = err(e)
    finally:
        s.close()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
calls = {"ptrace": (16, 0x3FFFFFF0, 0, 0, 0, 0), "process_vm_readv": (os.getpid(), 0, 0, 0, 0, 1),
         "process_vm_writev": (os.getpid(), 0, 0, 0, 0, 1), "pidfd_getfd": (-1, 0, 0, 0, 0, 0),
         "kcmp": (0x3FFFFFF0, 0x3FFFFFF0, 0, 0, 0, 0), "perf_event_open": (0, 0, -1, -1, 0, 0),
         "add_key": (0, 0, 0, 0, 0, 0), "request_key": (0, 0, 0, 0, 0, 0), "keyctl": (0x7FFF, 0, 0, 0, 0, 0)}
for name, nr in args["syscalls"].items():
    ctypes.set_errno(0)
    rc = libc.syscall(L(nr), *[L(a) for a in calls[name]])
    out["syscalls"][name] = "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
with open("probe_out.json", "w") as fh:
    json.dump(out, fh)
print("PROBED")
'''


class Listener:
    """A loopback TCP listener of the host: what any connection sends is kept."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                try:
                    while chunk := conn.recv(65536):
                        data += chunk
                except OSError:
                    pass
                self.received.append(data)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def listener():
    lis = Listener()
    yield lis
    lis.close()


@pytest.fixture
def other_checkout():
    """A second copy of the example study's task files outside the study and outside /tmp (a
    sandbox's /tmp is its own anyway), with a token in its oracle."""
    base = "/var/tmp" if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="ab-other-checkout-", dir=base))
    oracle = root / "examples" / "study" / "tasks" / "roman" / "oracle"
    oracle.mkdir(parents=True)
    token = f"OTHER-CHECKOUT-{os.urandom(6).hex()}"
    (oracle / "run.py").write_text(f"# {token}\n")
    yield oracle / "run.py", token
    shutil.rmtree(root, ignore_errors=True)


def _probe_args(ws: Path, reads: list[str], ports: list[int], marker: str) -> None:
    numbers = ab.SECCOMP_ARCHES[SECCOMP["arch"]][1] if SECCOMP["arch"] else {}
    (ws / "probe.py").write_text(PROBE_PY)
    (ws / "probe_args.json").write_text(json.dumps({"read": reads, "connect": ports, "marker": marker,
                                                    "syscalls": numbers}))


def _unfiltered_errors(tmp_path: Path) -> dict[str, str]:
    """The probe's system calls outside any sandbox (the control)."""
    ws = tmp_path / "control"
    ws.mkdir()
    _probe_args(ws, [], [], "control")
    subprocess.run([sys.executable, "probe.py"], cwd=ws, check=True, capture_output=True, timeout=60)
    return json.loads((ws / "probe_out.json").read_text())["syscalls"]


def _assert_denied(syscalls: dict[str, str], control: dict[str, str]) -> None:
    assert set(syscalls) == set(ab.SECCOMP_DENIED), syscalls
    for name, got in syscalls.items():
        assert got == "EPERM", (name, got)
        assert control[name] in UNFILTERED[name], (name, control[name])
    # at least these give something else than EPERM unfiltered: the filter is what refused them
    assert {control[n] for n in ("process_vm_readv", "process_vm_writev", "pidfd_getfd")} != {"EPERM"}


def _secret_files() -> list[str]:
    return [p for p in ab.system_view()[3] if os.path.isfile(p)][:3]


# ---- checks ---------------------------------------------------------------------------------------

@pytest.mark.skipif(SECCOMP["arch"] is None, reason=str(SECCOMP["reason"]))
def test_a_check_reads_no_other_checkout_reaches_no_port_and_is_filtered(tmp_path, listener, other_checkout,
                                                                         server):
    stolen, token = other_checkout
    root = tmp_path / "study"
    shutil.copytree(ROOT / "examples" / "study", root, ignore=shutil.ignore_patterns("state", "runs"))
    cfg = json.loads((root / "study.json").read_text())
    cfg["sandbox"] = "bwrap"
    (root / "study.json").write_text(json.dumps(cfg))
    paths = ab.StudyPaths(root)
    paths.state.mkdir(parents=True, exist_ok=True)
    task = ab.load_tasks(paths, ab.load_study_config(paths))["roman"]
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    reads = [str(stolen), str(ROOT / "tests" / "conftest.py"), "/etc/hostname", *_secret_files()]
    _probe_args(ws, reads, [listener.port, server.port], "from-a-check")
    spec = dict(task.gate, cmd=["{python}", "probe.py"])
    rec = ab.run_check(paths, ab.current_platform(), ab.dataclasses.replace(task, gate=spec), "gate", str(ws),
                       os.environ)
    assert rec["exit_code"] == 0, rec["stderr_tail"]
    assert rec["sandbox"]["kind"] == "bwrap" and rec["sandbox"]["network"] == "none"
    assert rec["sandbox"]["seccomp"] == SECCOMP["arch"]
    out = json.loads((ws / "probe_out.json").read_text())
    assert out["read"][str(stolen)].startswith("ERR ENOENT"), out["read"]
    assert out["read"][str(ROOT / "tests" / "conftest.py")].startswith("ERR ENOENT"), out["read"]
    for secret in _secret_files():
        # masked by /dev/null, which a bind makes unopenable (no device nodes there)
        assert out["read"][secret] == "ERR EACCES", (secret, out["read"][secret])
    if os.path.isfile("/etc/hostname"):
        assert not out["read"]["/etc/hostname"].startswith("ERR")         # /etc itself is there
    assert token not in json.dumps(out)
    assert out["connect"] == {str(listener.port): "ERR ECONNREFUSED", str(server.port): "ERR ECONNREFUSED"}
    assert listener.received == []
    _assert_denied(out["syscalls"], _unfiltered_errors(tmp_path))


# ---- sessions (the real binary) -------------------------------------------------------------------

INSIDE_PORT = 47123   # a port in a session's own network namespace

LISTEN_PY = r'''
import os, socket, time
s = socket.socket()
s.bind(("127.0.0.1", %d))
s.listen(4)
s.settimeout(0.2)
open("ready", "w").close()
got = b""
deadline = time.monotonic() + 240
while not os.path.exists("done") and time.monotonic() < deadline:
    try:
        c, _ = s.accept()
    except OSError:
        continue
    c.settimeout(5)
    try:
        got += c.recv(65536)
    except OSError:
        pass
    c.close()
open("got.txt", "wb").write(got)
print("LISTENED", len(got))
''' % INSIDE_PORT


def _wait_for(pred, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.skipif(SECCOMP["arch"] is None, reason=str(SECCOMP["reason"]))
def test_two_sessions_reach_only_their_gateways_not_each_other_nor_the_host(
        tmp_path, real_claude, server, listener, other_checkout, monkeypatch):
    stolen, token = other_checkout
    study = tmp_path / "study"
    init_real_study(study, real_claude, server.url, tmp_path / "claude-config", monkeypatch,
                    "--sandbox", "bwrap", "--tools", "Bash", "--allowed-tools", "Bash")
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude-config"))
    bash = {"name": "Bash", "input": {"command": "python3 listen.py", "timeout": 300000}}
    server.add_script("listen", {"steps": [{"text": "Listening.", "tool_uses": [bash]}, {"text": "Done."}]})
    server.add_script("probe", {"steps": [
        {"text": "Probing.", "tool_uses": [{"name": "Bash", "input": {"command": "python3 probe.py"}}]},
        {"text": "Done."}]})
    first, second = tmp_path / "ws-first", tmp_path / "ws-second"
    first.mkdir()
    second.mkdir()
    (first / "listen.py").write_text(LISTEN_PY)
    reads = [str(stolen), str(ROOT / "tests" / "conftest.py"), str(study / "state" / "registry.json"),
             *_secret_files()]
    _probe_args(second, reads, [listener.port, server.port, INSIDE_PORT], "from-a-session")
    code, one = run_main(["spawn", "--study", str(study), "--workspace", str(first),
                          "--brief", write_brief(tmp_path, "Listen. [agentbench-script:listen]")])
    assert code == 0, one
    _wait_for(lambda: (first / "ready").exists(), "the first session's listener")
    # Not the host's loopback either: the first session's port is in its own namespace.
    with socket.socket() as s:
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.1", INSIDE_PORT)) != 0
    code, two = run_main(["spawn", "--study", str(study), "--workspace", str(second),
                          "--brief", write_brief(tmp_path, "Probe. [agentbench-script:probe]")])
    assert code == 0, two
    res2 = wait_result(study, two["job_id"], timeout=240)
    (first / "done").write_text("")
    res1 = wait_result(study, one["job_id"], timeout=240)
    assert res1["status"] == "ok" and res2["status"] == "ok", (res1, res2)
    out = json.loads((second / "probe_out.json").read_text())
    for path in reads[:3]:
        assert out["read"][path].startswith("ERR"), (path, out["read"][path])
    for secret in _secret_files():
        assert out["read"][secret] == "ERR EACCES", secret
    assert token not in json.dumps(out)
    assert set(out["connect"].values()) == {"ERR ECONNREFUSED"}, out["connect"]
    assert listener.received == [] and (first / "got.txt").read_bytes() == b""
    _assert_denied(out["syscalls"], _unfiltered_errors(tmp_path))
    # Both reached the model through their own gateways (the Unix socket, relayed inside).
    for res, job in ((res1, one["job_id"]), (res2, two["job_id"])):
        assert res["sandbox"]["network"] == "gateway" and res["sandbox"]["seccomp"] == SECCOMP["arch"], res
        recs = [json.loads(x) for x in (study / "state" / "jobs" / job / "gateway.jsonl").read_text().splitlines()]
        assert len(recs) >= 2 and all(r["status"] == 200 for r in recs), recs


def test_an_arm_the_study_opens_the_network_for_reaches_the_host_and_says_so(tmp_path, real_claude, server,
                                                                             listener):
    from test_e2e_real import TASK, assign_by_position, cli_env, make_study
    study = make_study(tmp_path / "study", real_claude, arms=("A",), sandbox="bwrap", network_open_arms=["A"],
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                            "AGENTBENCH_OFFLINE": "1"})
    task_md = study / "tasks" / TASK / "public" / "TASK.md"
    task_md.write_text(task_md.read_text() + "\n[agentbench-script:opener]\n")
    send = (f"python3 -c \"import socket; s=socket.create_connection(('127.0.0.1', {listener.port}), 5); "
            f"s.sendall(b'OPEN-ARM'); s.close(); print('SENT')\"")
    server.add_script("opener", {"steps": [
        {"text": "Calling out.", "tool_uses": [{"name": "Bash", "input": {"command": send}}]},
        {"text": "Done."}]})
    rows = assign_by_position(study, 1)
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    _wait_for(lambda: listener.received, "the open arm's connection", timeout=60)
    assert listener.received == [b"OPEN-ARM"]
    rec = json.loads((study / "state" / "runs" / f"{rows[0]['run_id']}.json").read_text())
    assert rec["sandbox"]["sandboxed"] and "open" in rec["sandbox"]["networks"], rec["sandbox"]
    assert "none" in rec["sandbox"]["networks"]   # its checks still had no network
    assert any("network_open_arms" in w for w in rec["sandbox"]["network_opened"]), rec["sandbox"]
    code, rep, err = run_cli(["report", "--study", str(study), "--format", "json"], cli_env(), timeout=120)
    assert code == 0, rep
    assert any("had the host's network" in n and "arm A" in n for n in rep["notes"]), rep["notes"]


def test_network_open_arms_must_name_the_studys_arms(tmp_path):
    from test_e2e_real import make_study
    study = make_study(tmp_path / "study", sys.executable, arms=("A",), calibrated=False,
                       network_open_arms=["Z"])
    code, out = run_main(["assign", "--study", str(study), "--repeats", "1", "--force"])
    assert code == 2 and out["code"] == "network_open_arm_unknown", out
    bad = make_study(tmp_path / "study2", sys.executable, arms=("A",), calibrated=False,
                     network_open_arms="A")
    code, out = run_main(["assign", "--study", str(bad), "--repeats", "1", "--force"])
    assert code == 2 and out["code"] == "bad_network_open_arms", out
