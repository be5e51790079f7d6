"""Task environments, the pure parts: a task's `environment` checked, the container plans of a
session and a check, the runtime's argv built from them, the seccomp profile, and the study's
container settings.  No container runtime is needed (tests/test_containers_real.py runs them)."""
from __future__ import annotations

import json
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
    ({"image": "x", "network": "open"}, False),            # unknown key
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
    for opt in ("--rm", "--pull=never", "--cap-drop=all", "--security-opt=no-new-privileges", "--read-only"):
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
    assert named == {"source": "image", "image": "localhost/x:1", "sha256": None, "workdir": "/srv/app"}


@pytest.mark.parametrize("records, sandboxed", [
    ([{"kind": "container"}, {"kind": "bwrap"}], True),
    ([{"kind": "container"}, {"kind": "none"}], False),
])
def test_a_run_in_its_container_counts_as_sandboxed(records, sandboxed):
    assert ab.sandbox_summary(records)["sandboxed"] is sandboxed
