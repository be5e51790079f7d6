"""Task environments end to end: the real `claude` binary, offline against the scripted model, in a
container of the task's image (podman; skipped, with the reason, where no runtime or base image is
here, and a failure under CI, whose .ci/run installs podman and builds the base image).

What is proved: a Harbor task (schema 1.4) whose reference and hidden tests need a tool only its
image has (made by its Dockerfile, FROM an image mapped to the base) imports with its
environment, calibrates and rehearses in its container, beside a task without an environment
(bubblewrap), as one study with one report; `rehearse` refuses an image that cannot run a session
before anything runs; a session's Bash sees the image's files, not the host's or the study's,
reaches nothing but its gateway, and leaves no process (a `setsid` child included) and no
container behind; the hidden tests are never in it; the sandbox tests' hostile solutions fail
when graded in the container.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ab, run_cli
from test_e2e_real import TASK, assign_by_position, cli_env, make_study, records

BASE_IMAGE = os.environ.get("AGENTBENCH_BASE_IMAGE", "localhost/agentbench-base-py:bookworm")
SLEEP_S = "427.75"   # a duration no other process uses: the setsid sleep is found by it
ENV_TASK = "envtool"
#: What the image's own tool prints: nothing on the host has it.
TOOL_OUTPUT = "made-by-the-image-7f3a"


def _runtime_or_skip() -> str:
    probe = ab.container_probe("podman", os.environ)
    why = None
    if not probe["available"]:
        why = f"podman cannot run here: {probe['reason']}"
    elif not ab.container_image_exists(probe["binary"], BASE_IMAGE, os.environ):
        why = f"the base image {BASE_IMAGE} is missing (.ci/run builds it with mmdebstrap)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install podman and the base image; see .ci/run ({why})")
        pytest.skip(why)
    return str(probe["binary"])


@pytest.fixture(scope="module")
def podman() -> str:
    return _runtime_or_skip()


def add_env_task(tasks: Path) -> Path:
    """A task whose image has a tool the host lacks (`envtool`, made by its Dockerfile): the
    reference runs it, the gate and the hidden tests compare against it."""
    root = tasks / ENV_TASK
    for sub in ("public", "gate", "oracle", "reference", "environment"):
        (root / sub).mkdir(parents=True)
    assert shutil.which("envtool") is None
    (root / "environment" / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\n"
        f"RUN printf '#!/bin/sh\\necho {TOOL_OUTPUT}\\n' > /usr/local/bin/envtool && chmod 755 /usr/local/bin/envtool\n")
    (root / "public" / "TASK.md").write_text("Write the output of the command `envtool` into answer.txt.\n")
    (root / "reference" / "solve.sh").write_text("envtool > answer.txt\n")
    (root / "gate" / "check.sh").write_text('test -f answer.txt && test "$(cat answer.txt)" = "$(envtool)"\n')
    (root / "oracle" / "run.py").write_text(
        "import json, os, subprocess, sys\n"
        "ws, fd = sys.argv[1], int(sys.argv[2])\n"
        "want = subprocess.run(['envtool'], capture_output=True, text=True).stdout.strip()\n"
        "try:\n    got = open(os.path.join(ws, 'answer.txt')).read().strip()\nexcept OSError:\n    got = None\n"
        "ok = bool(want) and got == want\n"
        "os.write(fd, (json.dumps({'passed': ok, 'score': 1.0 if ok else 0.0}) + '\\n').encode())\n")
    (root / "task.json").write_text(json.dumps({
        "id": ENV_TASK, "title": "A tool of the image",
        "environment": {"dockerfile": "environment/Dockerfile", "workdir": "/app"},
        "gate": {"cmd": ["sh", "{gate}/check.sh"], "timeout_s": 60},
        "oracle": {"cmd": ["{python}", "{oracle}/run.py", "{workspace}", "{receipt_fd}"], "timeout_s": 60,
                   "threshold": 1.0},
        "reference": {"cmd": ["sh", "{reference}/solve.sh"], "timeout_s": 60}}))
    return root


def test_a_study_mixing_a_harbor_task_in_its_image_and_a_bwrap_task_rehearses_as_one(tmp_path, real_claude, podman):
    """A Harbor task (schema 1.4) whose Dockerfile, FROM an image this host has not (mapped to the
    base), makes a tool its tests and its solution need and the host lacks, imported with its
    environment, beside the example task under bubblewrap: calibrated and rehearsed as one study."""
    from test_containers import harbor_task
    assert shutil.which("stamp") is None
    src = harbor_task(tmp_path / "harbor" / ENV_TASK)
    study = make_study(tmp_path / "study", real_claude, arms=("A",), calibrated=False, sandbox="bwrap")
    code, out, err = run_cli(["import-tasks", "--from", "harbor", str(src), "--tasks", str(study / "tasks"),
                              "--environment", "container", "--base-image", f"python:3.12-slim={BASE_IMAGE}"],
                             cli_env(), timeout=120)
    assert code == 0 and out["imported"][0]["environment"]["dockerfile"] == "environment/Dockerfile", (out, err)
    code, out, err = run_cli(["calibrate", "--study", str(study)], cli_env(), timeout=600)
    assert code == 0, (out, err[-3000:])
    assert out["tasks"][ENV_TASK]["ok"] and out["tasks"][TASK]["ok"], out
    assert out["tasks"][ENV_TASK]["environment"]["sha256"] and "environment" not in out["tasks"][TASK]
    scratch = tmp_path / "scratch"
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1",
                              "--parallel", "2"], cli_env(), timeout=600)
    assert code == 0, (out, err[-3000:])
    # every image was built and started (the pinned claude ran in it) before any session
    assert out["environments"][ENV_TASK]["claude_inside"] == ab.CLAUDE_CODE_PINNED, out["environments"]
    assert set(out["environments"]) == {ENV_TASK}
    runs = records(scratch)
    by_task = {r["task"]: r for r in runs.values()}
    assert set(by_task) == {TASK, ENV_TASK} and all(r["outcome"] == "success" for r in runs.values()), runs
    env_run, host_run = by_task[ENV_TASK], by_task[TASK]
    assert env_run["environment"]["runtime"] == "podman" and env_run["environment"]["sha256"]
    assert env_run["environment"]["image"] == ab.built_image_tag(env_run["environment"]["sha256"])
    # the image id pins what ran (the tag names the build context; its FROM image may move)
    assert env_run["environment"]["image_id"] == out["environments"][ENV_TASK]["image_id"]
    assert ab.container_image_id(podman, env_run["environment"]["image"], os.environ) == env_run["environment"]["image_id"]
    assert "environment" not in host_run
    assert env_run["sandbox"]["kinds"] == ["container"] and env_run["sandbox"]["sandboxed"]
    assert host_run["sandbox"]["kinds"] == ["bwrap"] and host_run["sandbox"]["sandboxed"]
    # the image's tool graded the run: the harness's protected receipt came from the container
    assert env_run["evaluation"]["receipt"]["channel"] == "fd" and env_run["evaluation"]["score"] == 1.0
    code, rep, err = run_cli(["report", "--study", str(scratch), "--format", "json"], cli_env(), timeout=120)
    assert code == 0, (rep, err[-2000:])
    assert not any("not sandboxed" in n for n in rep.get("notes") or [])
    # `where` names the runtime, its version and the task's image and hash; `assign` fixes them
    code, out, err = run_cli(["where", "--study", str(study)], cli_env(), timeout=120)
    ctr = out["containers"]
    assert ctr["runtime"] == "podman" and ctr["version"] and set(ctr["tasks"]) == {ENV_TASK}, ctr
    assert ctr["tasks"][ENV_TASK]["sha256"] == env_run["environment"]["sha256"] and ctr["tasks"][ENV_TASK]["present"]
    assign_by_position(study, 1)
    manifest = json.loads((study / "state" / "manifests" / "main.json").read_text())
    assert manifest["environments"] == {ENV_TASK: {"image": env_run["environment"]["image"],
                                                   "sha256": env_run["environment"]["sha256"], "workdir": "/app"}}


def test_rehearse_refuses_an_image_that_cannot_run_a_session_before_anything_runs(tmp_path, real_claude, podman):
    study = make_study(tmp_path / "study", real_claude, arms=("A",), calibrated=False)
    root = add_env_task(study / "tasks")
    df = root / "environment" / "Dockerfile"
    # python3 gone from the image: the session's relay (its PID 1) cannot start there
    df.write_text(df.read_text() + "RUN rm -f /usr/bin/python3*\n")
    scratch = tmp_path / "scratch"
    code, out, err = run_cli(["rehearse", "--study", str(study), "--dir", str(scratch), "--repeats", "1",
                              "--force"], cli_env(), timeout=600)
    assert code == 2 and out["code"] == "container_image_unusable" and out["task"] == ENV_TASK, (out, err[-2000:])
    assert "python3" in out["reason"] or "exited" in out["reason"]
    assert not (scratch / "state" / "runs").exists()


def _sleepers() -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd[:2] == [b"sleep", SLEEP_S.encode()]:
                out.append(int(p.name))
    return out


def test_a_session_in_its_container_sees_the_image_reaches_only_its_gateway_and_leaves_nothing(
        tmp_path, real_claude, server, podman):
    study = make_study(tmp_path / "study", real_claude, arms=("A",), calibrated=False,
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                            "AGENTBENCH_OFFLINE": "1"})
    shutil.rmtree(study / "tasks" / TASK)
    root = add_env_task(study / "tasks")
    code, out, err = run_cli(["calibrate", "--study", str(study)], cli_env(), timeout=600)
    assert code == 0, (out, err[-3000:])
    # Secrets where a session must not reach: the host, the study's state, the hidden tests,
    # another run's workspace (each readable here, outside).
    tokens = {}
    for where in (tmp_path / "host-only", study / "state", root / "oracle", study / "runs" / "r9999" / "workspace"):
        tok = f"SECRET-{len(tokens)}-{os.urandom(6).hex()}"
        where.mkdir(parents=True, exist_ok=True)
        (where / "planted-secret.txt").write_text(tok + "\n")
        tokens[str(where)] = tok
    assert all(Path(w, "planted-secret.txt").read_text().strip() == t for w, t in tokens.items())
    # A listener of the host's loopback standing in for anything else on this machine; it works
    # from here (the attack is set up), and must receive nothing from the session.
    import socket
    host_lis = socket.socket()
    host_lis.bind(("127.0.0.1", 0))
    host_lis.listen(8)
    host_lis.settimeout(5)
    port = host_lis.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        host_lis.accept()[0].close()
    (root / "public" / "TASK.md").write_text((root / "public" / "TASK.md").read_text()
                                             + "\n[agentbench-script:probe]\n")
    grab = " ".join(f"{w}/planted-secret.txt" for w in tokens)
    probe = (f"envtool; cat {grab} 2>&1; cat /etc/os-release | head -1; pwd; "
             "echo PIDS $(ls /proc | grep -c '^[0-9]'); "
             f"python3 -c \"import socket; s=socket.socket(); s.settimeout(3); print('HOSTPORT', s.connect_ex(('127.0.0.1', {port})))\"; "
             "python3 -c \"import socket; s=socket.socket(); s.settimeout(3); print('OUTSIDE', s.connect_ex(('1.1.1.1', 80)))\"; "
             f"setsid sleep {SLEEP_S} > /dev/null 2>&1 < /dev/null & echo started")
    server.add_script("probe", {"steps": [
        {"text": "Looking around.", "tool_uses": [{"name": "Bash", "input": {"command": probe, "description": "look"}}]},
        {"text": "Done."}]})
    rows = assign_by_position(study, 1)
    before = _sleepers()
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    rid = rows[0]["run_id"]
    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    job = rec["jobs"][0]["job_id"]
    result = json.loads((study / "state" / "jobs" / job / "result.json").read_text())
    assert result["status"] == "ok" and result["sandbox"]["kind"] == "container", result
    assert result["sandbox"]["network"] == "gateway" and result["sandbox"]["user_namespace"] == "own"
    stream = (study / "runs" / rid / "raw" / "01-executor" / "stream.jsonl").read_text()
    text = json.dumps([c for ln in stream.splitlines() if ln.strip() for c in
                       ((json.loads(ln).get("message") or {}).get("content") or [])
                       if isinstance(c, dict) and c.get("type") == "tool_result"])
    assert TOOL_OUTPUT in text, text          # the image's tool: the session runs in the image
    assert "/app" in text and "Debian" in text
    for where, tok in tokens.items():
        assert tok not in text, f"the session read the planted secret in {where}"
    # the host's listener got nothing (a connect that succeeds inside can only have met a
    # listener of the container's own loopback, such as its relay, on the same number)
    assert "HOSTPORT" in text
    host_lis.settimeout(0.5)
    with pytest.raises(socket.timeout):
        host_lis.accept()
    host_lis.close()
    assert "OUTSIDE 0" not in text and "OUTSIDE" in text
    assert int(text.split("PIDS ")[1].split("\\n")[0]) <= 12, text    # its own pid namespace
    assert "started" in text
    # its transcript (written in the container's config dir) was collected
    collected = list((study / "runs" / rid / "transcripts").glob(f"{job}-*.jsonl"))
    assert len(collected) == 1 and result["session_id"] in collected[0].read_text()
    # nothing outlives it: the setsid sleep died with the container, which is gone
    deadline = time.monotonic() + 30
    while [p for p in _sleepers() if p not in before] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in _sleepers() if p not in before]
    name = result["sandbox"]["container"]
    assert name == ab.container_name("session", ab.job_mark(ab.StudyPaths(study), job))
    gone = subprocess.run([podman, "container", "inspect", name], capture_output=True)
    assert gone.returncode != 0, gone.stdout[:500]


def _container_example(tmp_path: Path) -> tuple:
    """The example study with `roman` run in a container of the base image (sandbox bwrap for
    everything else): (paths, task)."""
    root = tmp_path / "study"
    shutil.copytree(Path(ab.__file__).parent / "examples" / "study", root,
                    ignore=shutil.ignore_patterns("state", "runs", "rehearsal*", "__pycache__"))
    spec = json.loads((root / "tasks" / "roman" / "task.json").read_text())
    spec["environment"] = {"image": BASE_IMAGE}
    (root / "tasks" / "roman" / "task.json").write_text(json.dumps(spec))
    paths = ab.StudyPaths(root)
    paths.state.mkdir(parents=True, exist_ok=True)
    paths.ledger.write_text('{"job_id": "j000001"}\n')
    return paths, ab.load_tasks(paths, ab.load_study_config(paths))["roman"]


def _digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): p.read_text(errors="replace") for p in sorted(path.rglob("*")) if p.is_file()}


def test_the_sandbox_attacks_on_a_check_fail_in_its_container_too(tmp_path, podman):
    """test_sandbox's hostile solutions, graded in the task's container: a forged receipt on
    every descriptor of the harness (then the harness killed), and a swap of the receipt."""
    from test_sandbox import HOSTILE, SWAPPER
    paths, task = _container_example(tmp_path)
    # the reference passes in the same container: the attacks are what fail, not the container
    good = tmp_path / "good"
    ab.copy_tree(task.public, good)
    ab.copy_tree(task.reference, good)
    ok = ab.run_check(paths, ab.current_platform(), task, "oracle", str(good), os.environ)
    assert ok["success"] and ok["receipt_protected"] and ok["sandbox"]["kind"] == "container", ok
    for attack in (HOSTILE.format(state=str(paths.state), ledger=str(paths.ledger), kill=True), SWAPPER):
        ws = tmp_path / f"ws-{len(attack)}"
        ab.copy_tree(task.public, ws)
        (ws / "roman.py").write_text(attack)
        before_state, before_ws = _digest(paths.state), _digest(ws)
        rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(ws), os.environ)
        assert rec["passed"] is False and rec["success"] is False and rec["score"] < 1.0, rec
        assert rec["receipt_channel"] == "fd" and rec["sandbox"]["kind"] == "container"
        assert _digest(paths.state) == before_state
        assert _digest(ws) == before_ws   # the oracle graded a copy


def test_every_forgery_probe_holds_against_a_task_in_its_container(tmp_path, podman):
    """Calibrate's forgery probes against the example harness graded in the task's container: the
    judged code runs through {sandbox_run} in a fresh container of its own, so it cannot patch,
    read or write its judge (read_judge, which reads the hidden files, held too)."""
    paths, task = _container_example(tmp_path)
    probes = ab.run_oracle_probes(paths, ab.current_platform(), task, os.environ, str(tmp_path))["oracle"]
    assert {p["name"]: p["verdict"] for p in probes} == {name: "held" for name in ab.ORACLE_PROBES}, probes


#: Run by {sandbox_run} from a containerized check: what the judged code can see of its judge.
SPY = r"""
import json, os, sys
def links():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink("/proc/self/fd/" + fd))
        except OSError:
            pass
    return out
procs = {}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            procs[pid] = open("/proc/%s/cmdline" % pid, "rb").read().decode("utf-8", "replace").replace("\0", " ")
        except OSError:
            pass
try:
    judge = open(sys.argv[1]).read()
except OSError as exc:
    judge = "unreadable: %s" % exc
net = [ln.split(":")[0].strip() for ln in open("/proc/net/dev").read().splitlines()[2:]]
st = os.statvfs("/tmp")
print(json.dumps({"judge": judge[:200], "procs": procs, "fds": links(), "net": net, "cwd": os.getcwd(),
                  "files": sorted(os.listdir(".")), "tmp_mb": st.f_blocks * st.f_frsize >> 20,
                  "run": sorted(os.listdir("/run")) if os.path.isdir("/run") else []}))
"""


def test_the_judged_code_sees_nothing_of_its_judge_in_a_containerized_check(tmp_path, podman):
    """A harness in a task's container runs the judged code through {sandbox_run}: it runs in a
    fresh container that cannot read the harness's file nor see its processes, descriptors
    (the receipt channel), helper or socket, and has no network and a private sized /tmp; one
    past its time cap is stopped, its container removed."""
    root = tmp_path / "tasks" / "spy"
    for sub in ("public", "gate", "oracle"):
        (root / sub).mkdir(parents=True)
    (root / "public" / "TASK.md").write_text("Nothing to do.\n")
    (root / "public" / "spy.py").write_text(SPY)
    (root / "oracle" / "run.py").write_text(
        "import json, os, shutil, subprocess, sys, tempfile\n"
        "ws, helper, fd = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
        "copy = tempfile.mkdtemp(dir=ws)\n"
        "shutil.copy(os.path.join(ws, 'spy.py'), copy)\n"
        "p = subprocess.run([sys.executable, helper, '--dir', copy, '--timeout', '60', '--', 'python3', 'spy.py',"
        " os.path.abspath(__file__)], capture_output=True, text=True)\n"
        "print('SPY', p.returncode, p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:])\n"
        f"p = subprocess.run([sys.executable, helper, '--dir', copy, '--timeout', '1', '--', 'sleep', '{SLEEP_S}'])\n"
        "print('SLEPT', p.returncode)\n"
        "os.write(fd, b'{\"passed\": true}\\n')\n")
    (root / "task.json").write_text(json.dumps({
        "id": "spy", "title": "spy", "environment": {"image": BASE_IMAGE},
        "gate": {"cmd": ["true"]},
        "oracle": {"cmd": ["{python}", "{oracle}/run.py", "{workspace}", "{sandbox_run}", "{receipt_fd}"],
                   "timeout_s": 120, "threshold": 1.0}}))
    paths = ab.StudyPaths(tmp_path)
    paths.state.mkdir(parents=True, exist_ok=True)
    task = ab.load_task(root)
    rec = ab.run_check(paths, ab.current_platform(), task, "oracle", str(root / "public"), os.environ)
    assert rec["success"] and rec["inner_sandbox"] == {"kind": "container", "runs": 2}, rec
    # a run past its time cap: 124, and its container is gone with everything in it
    assert f"SLEPT {ab.INNER_TIMED_OUT_EXIT}" in rec["stdout_tail"], rec["stdout_tail"]
    ps = subprocess.run([podman, "ps", "-a", "--format", "{{.Names}} {{.Command}}"], capture_output=True, text=True)
    assert ps.returncode == 0 and SLEEP_S not in ps.stdout, ps.stdout
    code, seen = rec["stdout_tail"].split("SPY ", 1)[1].splitlines()[0].split(" ", 1)
    assert code == "0", rec["stdout_tail"]
    seen = json.loads(seen)
    assert seen["judge"].startswith("unreadable"), seen["judge"]          # the harness's own file
    # its own pid namespace: no process of the harness's, itself the only one
    assert list(seen["procs"]) == ["1"] and seen["procs"]["1"].startswith("python3 spy.py"), seen["procs"]
    assert not [f for f in seen["fds"] if f.startswith("socket:")], seen["fds"]   # no receipt channel
    assert seen["net"] == ["lo"] and seen["cwd"] == "/app" and seen["files"] == ["spy.py"]
    assert seen["tmp_mb"] == ab.INNER_TMP_MB and "agentbench" not in seen["run"]


def test_a_session_whose_supervisor_died_is_killed_with_its_container(tmp_path, real_claude, server, podman):
    """The supervisor and the container's monitor are killed outright mid-session (no sweep, no
    clean-up of the runtime's own): `kill` still ends the session's processes and removes its
    container by the name its runtime record gives."""
    import signal
    study = make_study(tmp_path / "study", real_claude, arms=("A",), calibrated=False,
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                            "AGENTBENCH_OFFLINE": "1"})
    shutil.rmtree(study / "tasks" / TASK)
    task = ab.load_task(add_env_task(study / "tasks"))
    server.add_script("hang", {"steps": [
        {"text": "Waiting.", "tool_uses": [{"name": "Bash", "input": {"command": f"echo waiting; sleep {SLEEP_S}; echo done",
                                                                        "timeout": 600000}}]},
        {"text": "Done."}]})
    paths = ab.StudyPaths(study)
    cfg = ab.load_study_config(paths)
    host = ab.Host(ab.current_platform(), cli_env())
    ws = tmp_path / "ws"
    ws.mkdir()
    req = ab.JobRequest(kind="executor", prompt="Go. [agentbench-script:hang]", cwd=str(ws),
                        limits=ab.launch_limits(ab.launch_config(cfg), ab.LaunchFlags()),
                        container=ab.ensure_task_image(task, cfg, cli_env()))
    before = set(_sleepers())
    job = ab.start_job(host, paths, req, cfg=cfg)["job_id"]
    deadline = time.monotonic() + 120
    while not [p for p in _sleepers() if p not in before] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert [p for p in _sleepers() if p not in before], "the session's sleep never started"
    runtime = json.loads(paths.runtime_file(job).read_text())
    name = runtime["sandbox"]["container"]
    assert name == ab.container_name("session", ab.job_mark(paths, job))
    conmon = subprocess.run([podman, "container", "inspect", "--format", "{{.State.ConmonPid}}", name],
                            capture_output=True, text=True)
    assert conmon.returncode == 0 and int(conmon.stdout.strip()) > 0, conmon
    # the supervisor and the runtime's monitor of the container both gone: nobody cleans up but kill
    os.kill(runtime["supervisor"]["pid"], signal.SIGKILL)
    os.kill(int(conmon.stdout.strip()), signal.SIGKILL)
    code, out, err = run_cli(["kill", "--study", str(study), "--job", job], cli_env(), timeout=180)
    assert code == 0 and out["jobs"][0]["status"] == "killed" and out["clean"], (out, err[-2000:])
    deadline = time.monotonic() + 30
    while [p for p in _sleepers() if p not in before] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in _sleepers() if p not in before]
    assert subprocess.run([podman, "container", "inspect", name], capture_output=True).returncode != 0
