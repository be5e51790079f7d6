"""Task environments, the pure parts: a task's `environment` checked, the container plans of a
session and a check, the runtime's argv built from them, the seccomp profile, and the study's
container settings.  No container runtime is needed (tests/test_containers_real.py runs them)."""
from __future__ import annotations

import json
import types
import shutil
from pathlib import Path

import pytest

from conftest import AGENTBENCH, ab


@pytest.mark.parametrize("spec, ok", [
    ({"image": "localhost/base:1"}, True),
    ({"dockerfile": "environment/Dockerfile"}, True),
    ({"dockerfile": "Dockerfile", "workdir": "/workspace/app"}, True),
    ({"image": "a", "dockerfile": "b"}, False),            # exactly one
    ({}, False),
    ({"image": "x", "network": "open"}, True),             # the task opens its sessions' network
    ({"image": "x", "network": "none"}, True),
    ({"image": "x", "network": "public"}, False),          # not one of none, open
    ({"image": "x", "ports": [80]}, False),                # unknown key
    ({"dockerfile": "/etc/Dockerfile"}, False),            # absolute
    ({"dockerfile": "../other/Dockerfile"}, False),        # outside the task
    ({"image": "bad name with spaces"}, False),
    ({"image": "x", "workdir": "app"}, False),             # relative workdir
    ({"image": "x", "workdir": "/"}, False),
    ({"image": "x", "workdir": "/usr"}, False),            # a system directory itself
    ({"image": "x", "workdir": "/run/agentbench/x"}, False),   # agentbench's own paths
    ("localhost/base:1", False),
])
def test_environment_spec_table(spec, ok):
    assert (ab.environment_problem(spec) is None) is ok


def _plan(**kw) -> ab.ContainerPlan:
    base = dict(runtime="/usr/bin/podman", kind="podman", image="localhost/img:1", name="agentbench-x",
                workdir="/app", seccomp="/s/seccomp.json")
    return ab.ContainerPlan(**{**base, **kw})


def _opts(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize("kind, network, userns_flag, ro_tmpfs_flag", [
    ("podman", "none", True, True),
    ("podman", "open", True, True),
    ("docker", "none", False, False),     # docker: the daemon's user namespace; no podman-only flag
])
def test_container_argv_table(kind, network, userns_flag, ro_tmpfs_flag):
    plan = _plan(kind=kind, network=network, binds=(("/h/ws", "/app", False), ("/h/gate", "/h/gate", True)),
                 env_set=(("HOME", "/run/agentbench/home"),), env_pass=("ANTHROPIC_AUTH_TOKEN",),
                 flags=("--security-opt=label=disable",))
    argv = ab.container_argv(plan, ["python3", "-c", "print(1)"])
    assert argv[:2] == ["/usr/bin/podman", "run"]
    for opt in ("--rm", "--pull=never", "--cap-drop=all", "--security-opt=no-new-privileges", "--read-only",
                "--user=0:0"):
        assert opt in argv
    assert ("--network=none" in argv) is (network == "none") and ("--network=host" in argv) is (network == "open")
    assert "--security-opt=seccomp=/s/seccomp.json" in argv
    assert any(a.startswith("--uidmap=0:") for a in argv) is userns_flag
    assert ("--read-only-tmpfs=false" in argv) is ro_tmpfs_flag
    assert _opts(argv, "--mount") == ["type=bind,src=/h/ws,dst=/app", "type=bind,src=/h/gate,dst=/h/gate,ro"]
    # every writable tmpfs has a size
    tmpfs = _opts(argv, "--tmpfs")
    assert tmpfs and all(",size=" in t for t in tmpfs) and any(t.startswith("/tmp:") for t in tmpfs)
    # a passed variable is named, never valued; a fixed path is written out
    assert _opts(argv, "--env") == ["HOME=/run/agentbench/home", "ANTHROPIC_AUTH_TOKEN"]
    # the study's flags come before the image, then the command
    i = argv.index("localhost/img:1")
    assert argv[i - 1] == "--security-opt=label=disable" and argv[i + 1:] == ["python3", "-c", "print(1)"]
    assert _opts(argv, "--workdir") == ["/app"] and _opts(argv, "--name") == ["agentbench-x"]


def test_container_argv_refuses_unknown_kinds_and_networks():
    with pytest.raises(ValueError):
        ab.container_argv(_plan(kind="lxc"), ["true"])
    with pytest.raises(ValueError):
        ab.container_argv(_plan(network="gateway"), ["true"])


def test_session_plan_binds_claude_read_only_and_passes_only_names():
    env = {"PATH": "/host/bin", "HOME": "/root", "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
           "ANTHROPIC_AUTH_TOKEN": "job-token-VALUE", "CLAUDE_CONFIG_DIR": "/host/cfg", "LANG": "C.UTF-8",
           "AGENTBENCH_CLAUDE_BIN": "/usr/bin/claude"}
    plan = ab.container_session_plan(_plan(), workspace="/h/ws", private_home="/h/job/home",
                                     project_dir="/h/cfg/projects/-h-ws", project_name="-app",
                                     claude="/opt/claude.exe", ro=["/h/job/system_prompt.md"],
                                     gateway_socket="/h/job/gateway.sock", env=env)
    assert plan.interactive and plan.network == "none"
    binds = {dst: (src, ro) for src, dst, ro in plan.binds}
    assert binds[ab.CONTAINER_CLAUDE] == ("/opt/claude.exe", True)
    assert binds["/app"] == ("/h/ws", False)
    assert binds[ab.CONTAINER_HOME] == ("/h/job/home", False)
    assert binds[ab.CONTAINER_CONFIG + "/projects/-app"] == ("/h/cfg/projects/-h-ws", False)
    assert binds["/h/job/system_prompt.md"] == ("/h/job/system_prompt.md", True)
    assert binds[ab.SANDBOX_GATEWAY_SOCKET] == ("/h/job/gateway.sock", False)
    # host paths never become the container's PATH, HOME or config dir
    assert set(plan.env_pass) == {"ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN"}
    # anything else by value: the runtime itself never starts with a session's variable
    assert dict(plan.env_set)["LANG"] == env["LANG"]
    assert dict(plan.env_set)["HOME"] == ab.CONTAINER_HOME and dict(plan.env_set)["CLAUDE_CONFIG_DIR"] == ab.CONTAINER_CONFIG
    argv = ab.container_argv(plan, ["python3"])
    assert "job-token-VALUE" not in " ".join(argv)
    # the config dir is a sized tmpfs: only this session's project directory is bound into it
    assert (ab.CONTAINER_CONFIG, 256) in plan.tmpfs


def test_session_plan_without_a_gateway_socket_keeps_the_arms_network():
    plan = ab.container_session_plan(_plan(network="open"), workspace="/w", private_home="/h", project_dir="/p",
                                     project_name="-app", claude="/c", ro=[], gateway_socket=None, env={})
    assert plan.network == "open" and not any(d == ab.SANDBOX_GATEWAY_SOCKET for _, d, _ in plan.binds)


def test_check_plan_table():
    rows = ab.container_rows({"workdir": "/app", "ro": {"/tests": "tests"}, "scratch": ["/logs/verifier"]},
                             workspace="/h/copy", base="/h/gate")
    plan = ab.container_check_plan(_plan(network="open"), workspace="/h/copy", ro=["/h/gate"], rows=rows,
                                   receipt=True)
    assert plan.network == "none" and plan.preserve_fds == 1 and not plan.interactive and not plan.env_pass
    binds = {dst: (src, ro) for src, dst, ro in plan.binds}
    assert binds == {"/app": ("/h/copy", False), "/h/gate": ("/h/gate", True), "/tests": ("/h/gate/tests", True)}
    assert ("/logs/verifier", 256) in plan.tmpfs
    argv = ab.container_argv(plan, ["python3", "run.py"])
    assert "--preserve-fds=1" in argv and "-i" not in argv
    assert ab.container_check_plan(_plan(), workspace="/w", ro=[]).preserve_fds == 0


@pytest.mark.parametrize("arch", sorted(ab.SECCOMP_ARCHES))
def test_seccomp_profile_denies_what_the_bwrap_filter_denies(arch):
    prof = ab.container_seccomp_profile(arch)
    assert prof["defaultAction"] == "SCMP_ACT_ALLOW" and len(prof["architectures"]) == 1
    denied = [n for rule in prof["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" for n in rule["names"]]
    assert set(denied) == set(ab.SECCOMP_DENIED) and all(r["errnoRet"] == 1 for r in prof["syscalls"])


def test_the_shim_ends_with_claude_as_its_child():
    compile(ab.CONTAINER_EXEC_SHIM, "<shim>", "exec")
    assert ab.CONTAINER_EXEC_SHIM.startswith(ab.SANDBOX_EXEC_SHIM.rsplit("\n", 1)[0])
    assert "os.fork()" in ab.CONTAINER_EXEC_SHIM.split("lis.close()")[1]


def test_the_shim_runs_its_command_as_a_child_and_exits_with_its_status():
    """Run here as a session's container runs it (no socket, no environment descriptor)."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-I", "-S", "-c", ab.CONTAINER_EXEC_SHIM, "-", ab.CONTAINER_SHIM_NO_ENV_FD,
                          sys.executable, "-c", "import os; print(os.getppid() != 1); raise SystemExit(3)"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3 and res.stdout.strip() == "True", (res.stdout, res.stderr)


@pytest.mark.parametrize("key, value, ok", [
    ("container_runtime", "podman", True), ("container_runtime", "docker", True),
    ("container_runtime", "lxc", False), ("container_runtime", 3, False),
    ("container_flags", ["--security-opt=label=disable"], True), ("container_flags", "--x", False),
    ("container_flags", ["not-an-option"], False),
])
def test_study_container_settings(key, value, ok):
    cfg = {"arms": {"A": {}}, key: value}
    if ok:
        ab.check_study_shape(cfg)
    else:
        with pytest.raises(ab.AgentbenchError) as err:
            ab.check_study_shape(cfg)
        assert err.value.payload["key"] == key and err.value.exit_code == 2


def test_a_task_with_a_bad_environment_is_refused_by_name(tmp_path):
    root = tmp_path / "tasks" / "roman"
    shutil.copytree(AGENTBENCH.parent / "examples" / "study" / "tasks" / "roman", root)
    spec = json.loads((root / "task.json").read_text())
    spec["environment"] = {"dockerfile": "environment/Dockerfile"}   # no such file
    (root / "task.json").write_text(json.dumps(spec))
    with pytest.raises(ab.AgentbenchError) as err:
        ab.load_task(root)
    assert err.value.payload["code"] == "task_environment_invalid" and err.value.payload["task"] == "roman"
    (root / "environment").mkdir()
    (root / "environment" / "Dockerfile").write_text("FROM localhost/base\n")
    assert ab.load_task(root).environment["source"] == "dockerfile"


def test_a_dockerfiles_image_is_tagged_by_its_context(tmp_path):
    root = tmp_path / "t"
    (root / "environment").mkdir(parents=True)
    (root / "environment" / "Dockerfile").write_text("FROM localhost/base\n")
    one = ab.task_environment_info("t", root, {"dockerfile": "environment/Dockerfile"})
    assert one["image"] == ab.built_image_tag(one["sha256"]) and one["workdir"] == "/app"
    (root / "environment" / "setup.sh").write_text("echo\n")   # the context changed: another image
    two = ab.task_environment_info("t", root, {"dockerfile": "environment/Dockerfile"})
    assert two["sha256"] != one["sha256"] and two["image"] != one["image"]
    named = ab.task_environment_info("t", root, {"image": "localhost/x:1", "workdir": "/srv/app"})
    assert named == {"source": "image", "image": "localhost/x:1", "sha256": None, "workdir": "/srv/app",
                     "network": "none"}


@pytest.mark.parametrize("records, sandboxed", [
    ([{"kind": "container"}, {"kind": "bwrap"}], True),
    ([{"kind": "container"}, {"kind": "none"}], False),
])
def test_a_run_in_its_container_counts_as_sandboxed(records, sandboxed):
    assert ab.sandbox_summary(records)["sandboxed"] is sandboxed


# -- Harbor tasks at schema 1.4 --------------------------------------------------------------------

def harbor_task(root: Path, *, toml_extra: str = "", from_image: str = "python:3.12-slim") -> Path:
    """A Harbor task directory (schema 1.4) whose image makes a tool (`stamp`) the tests and the
    solution use, with the 1.4 fields agentbench must carry over or list."""
    for sub in ("environment/src", "tests", "solution"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "instruction.md").write_text("# Stamp\n\nWrite the output of `stamp` into /app/out.txt.\n")
    (root / "environment" / "Dockerfile").write_text(
        f"FROM {from_image}\n"
        "RUN printf '#!/bin/sh\\necho stamped-in-the-image\\n' > /usr/local/bin/stamp && chmod 755 /usr/local/bin/stamp\n"
        "ENV STAMP_MODE=plain\nWORKDIR /app\nCOPY src/notes.txt /app/notes.txt\nCOPY src/notes.txt /opt/notes.txt\n"
        "USER 1000\n")
    (root / "environment" / "src" / "notes.txt").write_text("starter\n")
    (root / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        'if [ "$(cat /app/out.txt 2>/dev/null)" = "$(stamp)" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n')
    (root / "solution" / "solve.sh").write_text("#!/bin/bash\nstamp > /app/out.txt\n")
    (root / "task.toml").write_text(
        'schema_version = "1.4"\n' + toml_extra +
        '[verifier]\ntimeout_sec = 60\nenvironment_mode = "separate"\nnetwork_mode = "public"\n'
        '[agent]\ntimeout_sec = 60\n'
        '[environment]\nworkdir = "/app"\nnetwork_mode = "no-network"\nhealthcheck = "true"\nskills_dir = "/skills"\n'
        '[environment.mcp_servers.files]\ncommand = "mcp-files"\n')
    return root


@pytest.mark.parametrize("text, mapping, want, done", [
    ("FROM python:3.12-slim\nRUN x\n", {"python:3.12-slim": "localhost/b:1"}, "FROM localhost/b:1\nRUN x\n",
     ["python:3.12-slim=localhost/b:1"]),
    ("FROM --platform=linux/amd64 python:3 AS build\n", {"python:3": "l/p"},
     "FROM --platform=linux/amd64 l/p AS build\n", ["python:3=l/p"]),
    ("FROM debian\n", {"python:3": "l/p"}, "FROM debian\n", []),
    ("RUN echo FROM python:3\n", {"python:3": "l/p"}, "RUN echo FROM python:3\n", []),
])
def test_map_base_images_table(text, mapping, want, done):
    assert ab.map_base_images(text, mapping) == (want, done)


@pytest.mark.parametrize("cfg, refused", [
    ({"schema_version": "1.4"}, []),
    ({"steps": [{"name": "a"}, {"name": "b"}]}, ["multi-step"]),
    ({"os": "windows"}, ["windows"]),
    ({"environment": {"os": "linux"}}, []),
])
def test_harbor_schema_problems_table(cfg, refused):
    got = ab.harbor_schema_problems(cfg)
    assert len(got) == len(refused) and all(r in g for r, g in zip(refused, got))


def test_a_harbor_tasks_dockerfile_becomes_its_environment_and_every_other_field_is_listed(tmp_path):
    src = harbor_task(tmp_path / "src" / "stamp", toml_extra='artifacts = ["/app/out.txt"]\n')
    out = ab.import_harbor_tasks([src], tmp_path / "tasks", "container", {"python:3.12-slim": "localhost/base:1"})
    got = out["imported"][0]
    bundle = tmp_path / "tasks" / "stamp"
    spec = json.loads((bundle / "task.json").read_text())
    assert spec["environment"] == {"dockerfile": "environment/Dockerfile", "workdir": "/app"} == got["environment"]
    docker = (bundle / "environment" / "Dockerfile").read_text()
    assert docker.startswith("FROM localhost/base:1\n") and "stamp" in docker
    assert got["base_images_mapped"] == ["python:3.12-slim=localhost/base:1"]
    assert (bundle / "public" / "notes.txt").read_text() == "starter\n"
    lost = spec["not_carried_over"]
    assert lost == got["not_carried_over"]
    text = " | ".join(lost)
    # the image carries FROM, RUN, ENV and files copied elsewhere; these it cannot
    for name in ("USER", "mcp_servers", "healthcheck", "skills_dir", "network", "artifacts"):
        assert name in text, (name, lost)
    for carried in ("RUN", "ENV", "base image", "/opt/notes.txt"):
        assert carried not in text, (carried, lost)
    assert spec["harbor"]["verifier_environment_mode"] == "separate" and spec["harbor"]["schema_version"] == "1.4"
    # what maps is said: no network for the agent but its gateway, the separate verifier
    assert spec["harbor"]["carried_over"] == got["carried_over"] and len(got["carried_over"]) == 3, got
    assert "[agent] network no-network" in got["carried_over"][0] and "separate" in got["carried_over"][-1]
    assert "[verifier] network public" in text and "network" not in spec["environment"]
    assert ab.load_task(bundle).environment["source"] == "dockerfile"
    # a public network for the agent opens its sessions' (in its image only): said in task.json
    (src / "task.toml").write_text((src / "task.toml").read_text().replace('"no-network"', '"public"'))
    opened = ab.import_harbor_tasks([src], tmp_path / "open-tasks", "container")["imported"][0]
    assert opened["environment"]["network"] == "open" and "[agent] network public" in opened["carried_over"][0]
    assert ab.load_task(tmp_path / "open-tasks" / "stamp").environment["network"] == "open"
    # the same task for the host's tools lists what only the image gave
    host = ab.import_harbor_tasks([src], tmp_path / "host-tasks")["imported"][0]
    assert any("RUN" in x for x in host["not_carried_over"]) and host["environment"] is None
    assert "environment" not in json.loads((tmp_path / "host-tasks" / "stamp" / "task.json").read_text())


def test_a_shared_verifier_is_listed_and_a_multi_step_task_is_refused_by_name(tmp_path):
    shared = harbor_task(tmp_path / "src" / "shared")
    toml = (shared / "task.toml").read_text().replace('environment_mode = "separate"', 'environment_mode = "shared"')
    (shared / "task.toml").write_text(toml)
    got = ab.import_harbor_tasks([shared], tmp_path / "tasks", "container")["imported"][0]
    assert any("environment_mode = 'shared'" in x for x in got["not_carried_over"])
    steps = harbor_task(tmp_path / "src" / "steps", toml_extra='[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n')
    with pytest.raises(ab.AgentbenchError) as err:
        ab.import_harbor_tasks([steps], tmp_path / "tasks2", "container")
    assert "multi-step" in " ".join(err.value.payload["refused"][str(steps)])
    assert not (tmp_path / "tasks2" / "steps").exists()


def test_a_forking_arm_with_a_task_in_a_container_is_refused_by_name(tmp_path):
    root = tmp_path / "tasks" / "roman"
    shutil.copytree(AGENTBENCH.parent / "examples" / "study" / "tasks" / "roman", root)
    plain = ab.load_task(root)
    spec = json.loads((root / "task.json").read_text())
    spec["environment"] = {"image": "localhost/x:1"}
    (root / "task.json").write_text(json.dumps(spec))
    boxed = ab.load_task(root)

    class A:   # the two fields the refusal reads
        def __init__(self, name, fork):
            self.name, self.fork_base = name, fork
    arms = {"A": A("A", False), "F": A("F", True)}
    ab.refuse_forks_in_containers({"roman": plain}, arms)
    ab.refuse_forks_in_containers({"roman": boxed}, {"A": arms["A"]})
    with pytest.raises(ab.AgentbenchError) as err:
        ab.refuse_forks_in_containers({"roman": boxed}, arms)
    assert err.value.payload["code"] == "fork_base_with_environment" and err.value.payload["arms"] == ["F"]


def test_an_inner_run_of_a_containerized_check_is_a_fresh_container_that_sees_only_its_copy():
    """{sandbox_run} in a check's container: the judged code runs in a container of its own, of
    the same image and rules, with nothing of the judge: no oracle, helper, socket or descriptor."""
    check = ab.container_check_plan(
        ab.ContainerPlan(runtime="podman", kind="podman", image="localhost/env:1", name="c", workdir="/app",
                         seccomp="/s/seccomp.json", flags=("--log-level=error",)),
        workspace="/host/copy", ro=["/host/oracle"], receipt=True,
        rows=[("ro-bind", "/host/inner/sandbox_run.py", ab.CONTAINER_INNER_HELPER),
              ("bind", "/host/inner/s", ab.CONTAINER_INNER_SOCKET)])
    plan = ab.container_inner_plan(ab.dataclasses.replace(check, name="inner-1", lifetime_s=50),
                                   workdir="/host/copy/.check-1", env={"HOME": "/tmp", "K": "v"})
    argv = ab.container_argv(plan, ["python3", "-c", "pass"])
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
    assert mounts == ["type=bind,src=/host/copy/.check-1,dst=/app"], argv
    assert not any("/host/oracle" in a or "sandbox_run" in a for a in argv)
    assert "--network=none" in argv and "-i" in argv and not any(a.startswith("--preserve-fds") for a in argv)
    assert {"--security-opt=seccomp=/s/seccomp.json", "--uidmap=0:0:1", "--cap-drop=all", "--read-only"} <= set(argv)
    tmpfs = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert tmpfs == [f"{d}:rw,nosuid,nodev,size={mb}m" for d, mb in ab.CONTAINER_INNER_TMPFS_MB]
    assert {"HOME=/tmp", "K=v"} <= set(argv) and argv[-4:] == ["localhost/env:1", "python3", "-c", "pass"]
    assert argv[argv.index("--name") + 1] == "inner-1" and argv[argv.index("--workdir") + 1] == "/app"
    # the runtime ends it even when agentbench is gone (podman; docker has no such option)
    assert "--timeout=50" in argv and "--timeout=50" not in ab.container_argv(
        ab.dataclasses.replace(plan, kind="docker", runtime="docker"), ["true"])


@pytest.mark.parametrize("d, want", [
    ("/app", "/h/ws"), ("/app/.check-1", "/h/ws/.check-1"), ("/app/a/../b", "/h/ws/b"),
    ("/app/../etc", "/app/../etc"), ("/etc", "/etc"), ("/application", "/application"), ("rel", "rel"), (3, 3),
])
def test_an_inner_runs_dir_inside_the_container_maps_to_the_host_copy(d, want):
    assert ab.container_inner_dir(d, "/app", "/h/ws") == want


def test_where_shows_each_tasks_image_and_its_sessions_network_without_a_runtime(tmp_path):
    root = tmp_path / "study"
    shutil.copytree(AGENTBENCH.parent / "examples" / "study", root,
                    ignore=shutil.ignore_patterns("state", "runs", "rehearsal*", "__pycache__"))
    spec = json.loads((root / "tasks" / "roman" / "task.json").read_text())
    spec["environment"] = {"image": "localhost/x:1", "network": "open"}
    (root / "tasks" / "roman" / "task.json").write_text(json.dumps(spec))
    paths = ab.StudyPaths(root)
    warnings: list[str] = []
    got = ab.where_containers(types.SimpleNamespace(env={"PATH": str(tmp_path)}), paths,
                              ab.load_study_config(paths), warnings)
    assert got["available"] is False and "podman is not on PATH" in warnings[0]
    assert got["tasks"] == {"roman": {"source": "image", "image": "localhost/x:1", "sha256": None, "workdir": "/app",
                                      "network": "open", "present": None}}


def test_a_checks_container_is_removed_without_waiting_for_a_stop_a_sessions_with_it(tmp_path):
    """A check's or inner run's first process may ignore the stop signal (pid 1 without a
    handler): podman is told to kill at once, and a monitor left by a client killed while it was
    starting the container is ended by the container's name; a session's shim forwards the stop
    to claude."""
    import os
    import sys
    calls = tmp_path / "calls"
    fake = tmp_path / "podman"
    fake.write_text(f"#!{sys.executable}\nimport sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    "sys.exit(1 if sys.argv[1] == 'container' else 0)\n")
    fake.chmod(0o755)
    # a monitor left by a client killed while it started the container: ended by the name
    import subprocess
    conmon = tmp_path / "conmon"
    conmon.symlink_to(sys.executable)
    left = subprocess.Popen([str(conmon), "-c", "import time; time.sleep(60)", "-n", "c1"])
    other = subprocess.Popen([str(conmon), "-c", "import time; time.sleep(60)", "-n", "c10"])
    try:
        assert ab.current_platform().argv_processes("conmon", ["-n", "c1"])[0].pid == left.pid
        assert ab.container_remove(str(fake), "c1", os.environ, at_once=True)
        assert left.wait(timeout=30) != 0 and other.poll() is None
        assert ab.container_remove(str(fake), "s1", os.environ)
    finally:
        for p in (left, other):
            p.kill()
            p.wait()
    assert calls.read_text().splitlines() == ["rm -f -t 0 c1", "container inspect c1", "rm -f s1",
                                              "container inspect s1"]
