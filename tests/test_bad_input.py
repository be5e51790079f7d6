"""One test per class of bad input: exit 2, one JSON object naming the problem, and the study tree
byte-identical before and after (a refusal writes nothing).

Classes: out-of-bounds flags (--max-turns, --parallel, --wall-s, --limit, --repeats), unknown
--arm/--task filters, a registry of another version, a check timeout that is not a number of
seconds, a refused spawn's workspace directory, a read-only study (spawn, assign, init,
calibrate) and a full disk (spawn) on a small tmpfs, and `where` with no usable claude.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

import agentbench as ab
from conftest import run_main, write_brief
from test_cli import tree_snapshot
from test_experiment import make_task, manifest_of, tiny_study, write_json


def snapshot(root: Path) -> dict[str, str]:
    """The tree, less state/last_call: the empty marker of orchestrator activity that every call
    touches by contract (the orphan watchdog), refused or not."""
    return {k: v for k, v in tree_snapshot(root).items() if k != "state/last_call"}


def refused(argv: list[str], root: Path, *, names: str) -> dict:
    """Run argv; it must exit 2 with an object naming `names`, the tree under `root` unchanged."""
    before = snapshot(root)
    code, obj = run_main(argv)
    assert code == 2, obj
    assert names in json.dumps(obj), (names, obj)
    assert snapshot(root) == before, "a refusal wrote something"
    return obj


# ---- flags out of bounds --------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [
    ("--max-turns", "0"), ("--max-turns", "-3"), ("--max-turns", "10000000"),
    ("--wall-s", "0"), ("--wall-s", "-1"), ("--wall-s", "1e12"),
])
def test_spawn_flags_out_of_bounds_are_refused_by_name(study: Path, tmp_path: Path, flag: str, value: str) -> None:
    b = write_brief(tmp_path, "hello")
    refused(["spawn", "--study", str(study), "--brief", b, flag, value], study, names=flag)
    # No empty state/workspaces/ either (the tree comparison covers it; said for the reader).
    assert not (study / "state" / "workspaces").exists()


def test_list_limit_below_zero_is_refused(study: Path) -> None:
    refused(["list", "--study", str(study), "--limit", "-1"], study, names="--limit")


@pytest.fixture
def assigned(tmp_path: Path, fake_env) -> Path:
    study = tiny_study(tmp_path / "s")
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0, out
    return study


@pytest.mark.parametrize("argv, names", [
    (["run", "--parallel", "0"], "--parallel"),
    (["run", "--arm", "Z"], "Z"),
    (["run", "--task", "nope"], "nope"),
])
def test_run_selection_and_bounds_are_refused_by_name(assigned: Path, argv: list[str], names: str) -> None:
    obj = refused([argv[0], "--study", str(assigned), *argv[1:], "--force"], assigned, names=names)
    assert obj["error"] != "no runs selected"


@pytest.mark.parametrize("repeats", ["0", "1000000000000", "1e12"])
def test_assign_repeats_out_of_bounds_is_refused(tmp_path: Path, fake_env, repeats: str) -> None:
    study = tiny_study(tmp_path / "s")
    refused(["assign", "--study", str(study), "--force", "--repeats", repeats], study, names="--repeats")


def test_a_registry_of_another_version_is_refused(study: Path, tmp_path: Path) -> None:
    reg = study / "state" / "registry.json"
    reg.parent.mkdir(parents=True, exist_ok=True)
    reg.write_text(json.dumps({"version": 99, "next_job": 1, "counts": {}, "spent_usd": 0.0}))
    refused(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "hello")], study, names="version")


@pytest.mark.parametrize("value", [True, 1e308])
def test_a_gate_timeout_that_is_not_seconds_is_refused_by_calibrate(tmp_path: Path, fake_env, value) -> None:
    study = tiny_study(tmp_path / "s")
    spec = json.loads((study / "tasks" / "tiny" / "task.json").read_text())
    spec["gate"]["timeout_s"] = value
    write_json(study / "tasks" / "tiny" / "task.json", spec)
    refused(["calibrate", "--study", str(study)], study, names="timeout_s")


# ---- where ------------------------------------------------------------------------------------------

def test_where_without_a_usable_claude_exits_2_with_reasons(tmp_path: Path, fake_env) -> None:
    fake = tmp_path / "claude"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    env = {**fake_env, "AGENTBENCH_CLAUDE_BIN": str(fake)}
    code, obj = run_main(["where"], env=env)
    assert code == 2 and obj["ok"] is False
    assert any("--version" in r for r in obj["reasons"])


# ---- read-only study and full disk (a small tmpfs) ---------------------------------------------------

def _can_mount() -> str | None:
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        return "mounting a tmpfs needs root on Linux"
    return None


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_ro(where: Path) -> None:
    res = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot remount read-only: {res.stderr.strip()}")


def fill(where: Path) -> None:
    """Fill the file system to the last byte (a file per step until the write fails)."""
    i = 0
    while True:
        try:
            with open(where / f"filler{i}", "wb") as fh:
                fh.write(b"\0" * (64 * 1024))
        except OSError:
            break
        i += 1
    with contextlib.suppress(OSError):
        with open(where / "filler-last", "wb") as fh:
            while True:
                fh.write(b"\0" * 512)
                fh.flush()


@pytest.mark.skipif(_can_mount() is not None, reason=str(_can_mount()))
@pytest.mark.parametrize("command", ["spawn", "assign", "init", "calibrate"])
def test_a_read_only_study_is_refused_clearly_and_left_as_it_was(tmp_path: Path, fake_env, command: str) -> None:
    with tmpfs(tmp_path / f"ro-{uuid.uuid4().hex[:6]}", "8m") as mnt:
        study = tiny_study(mnt / "s")
        code, out = run_main(["init", "--study", str(study)])
        assert code == 0, out
        remount_ro(mnt)
        argv = {"spawn": ["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "hello")],
                "assign": ["assign", "--study", str(study), "--force"],
                "init": ["init", "--study", str(study), "--parallel", "3"],
                "calibrate": ["calibrate", "--study", str(study)]}[command]
        obj = refused(argv, study, names="")
        assert obj["error"] != "internal error", obj
        assert "cannot be written" in obj["error"] or "read-only" in json.dumps(obj).lower(), obj


@pytest.mark.skipif(_can_mount() is not None, reason=str(_can_mount()))
def test_spawn_on_a_full_disk_is_refused_and_leaves_no_lock_counter_or_ghost(tmp_path: Path, fake_env) -> None:
    with tmpfs(tmp_path / f"full-{uuid.uuid4().hex[:6]}", "2m") as mnt:
        study = tiny_study(mnt / "s")
        code, out = run_main(["init", "--study", str(study)])
        assert code == 0, out
        b = write_brief(tmp_path, "hello")
        fill(mnt)
        obj = refused(["spawn", "--study", str(study), "--brief", b], study, names="")
        assert obj["error"] != "internal error", obj
        assert not (study / "state" / "registry.lock").exists()


# ---- task bundles with symlinks ----------------------------------------------------------------------

@pytest.mark.parametrize("part, target", [
    ("public", "../oracle/run.py"), ("public", "/etc/hostname"), ("gate", "../oracle/run.py"),
    ("reference", "../oracle/run.py"),
])
def test_calibrate_refuses_a_bundle_with_symlinks(tmp_path: Path, fake_env, part: str, target: str) -> None:
    study = tiny_study(tmp_path / "s")
    link = study / "tasks" / "tiny" / part / "helper.py"
    link.symlink_to(target)
    obj = refused(["calibrate", "--study", str(study)], study, names=f"{part}/helper.py")
    assert obj["error"] == "the task bundle holds symlinks"


def test_the_workspace_copy_refuses_a_bundle_with_symlinks(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    (study / "tasks" / "tiny" / "public" / "helper.py").symlink_to("../oracle/run.py")
    task = ab.load_task(study / "tasks" / "tiny")
    paths = ab.StudyPaths(study)
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.prepare_workspace(paths, ab.current_platform(), task, paths.run_dir("r0001"))
    assert exc.value.payload["links"] == ["public/helper.py"]
    assert not paths.run_dir("r0001").exists()


def test_the_audit_flags_a_workspace_file_equal_to_an_oracle_file(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    oracle = study / "tasks" / "tiny" / "oracle" / "run.py"
    oracle.write_text(oracle.read_text() + "# the hidden grader, long enough to be no coincidence\n" * 2)
    task = ab.load_task(study / "tasks" / "tiny")
    ws = tmp_path / "ws"
    ab.copy_tree(task.public, ws)
    shutil.copy(oracle, ws / "helper.py")
    (ws / "__init__.py").write_text("")
    found = ab.hidden_file_copies(task, ab.artifact_manifest(ws), "oracle")
    assert found == [{"file": "helper.py", "equals": "oracle/run.py"}]
    (ws / "helper.py").unlink()
    assert ab.hidden_file_copies(task, ab.artifact_manifest(ws), "oracle") == []


# ---- study.json and task.json values the first reader refuses ----------------------------------------

def _edit_study(study: Path, **changes: object) -> None:
    cfg = json.loads((study / "study.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    write_json(study / "study.json", cfg)


@pytest.mark.parametrize("command", ["calibrate", "assign"])
@pytest.mark.parametrize("changes, names", [
    ({"repeats": 10 ** 30}, '"key": "repeats"'),
    ({"repeats": 1001}, '"key": "repeats"'),
    ({"budget": {"max_turns": 0}}, '"key": "max_turns"'),
    ({"budget": {"max_turns": 2.5}}, '"key": "max_turns"'),
    ({"model": "opus"}, '"key": "model"'),
    ({"model": "sonnet[1m]"}, '"key": "model"'),
    ({"effort": "ultra"}, '"key": "effort"'),
    ({"permission_mode": "yolo"}, '"key": "permission_mode"'),
    ({"arms": {"CON": {}}}, '"key": "arms.CON"'),
    ({"arms": {"A": {}, "null": {}}}, '"key": "arms.null"'),
    ({"arms": {"all": {}}}, '"key": "arms.all"'),
    ({"arms": {"nul.txt": {}}}, '"key": "arms.nul.txt"'),
    ({"env": {"X": "a\nb"}}, '"key": "env"'),
    ({"arms": {"A": {"env": {"X": "a\rb"}}}}, '"key": "env"'),
])
def test_a_bad_study_value_is_refused_by_the_first_command_that_reads_it(
        tmp_path: Path, fake_env, command: str, changes: dict, names: str) -> None:
    study = tiny_study(tmp_path / "s")
    _edit_study(study, **changes)
    argv = [command, "--study", str(study)] + (["--force"] if command == "assign" else [])
    obj = refused(argv, study, names=names)
    assert obj["file"] == "study.json", obj
    assert not (study / "state" / "manifests").exists()


def test_the_bounds_of_a_study_value_are_the_flags_bounds(tmp_path: Path, fake_env) -> None:
    """The largest repeats study.json may hold is the largest --repeats takes: both are accepted."""
    study = tiny_study(tmp_path / "s", repeats=ab.REPEATS_MAX, budget={"max_turns": ab.MAX_TURNS_MAX})
    ab.check_study_shape(json.loads((study / "study.json").read_text()))
    assert ab.FLAG_INT_BOUNDS["repeats"][1] == ab.REPEATS_MAX
    assert ab.FLAG_INT_BOUNDS["max_turns"][1] == ab.MAX_TURNS_MAX


@pytest.mark.parametrize("name, ok", [("A", True), ("baseline", True), ("con2", True), ("CON", False),
                                      ("Nul", False), ("com1", False), ("lpt9.x", False), ("null", False),
                                      ("None", False), ("ALL", False), ("true", False), ("../x", False)])
def test_arm_names_table(name: str, ok: bool) -> None:
    assert (ab.arm_name_problem(name) is None) is ok


def test_init_env_with_a_newline_is_refused_and_nothing_written(tmp_path: Path, fake_env) -> None:
    root = tmp_path / "fresh"
    code, obj = run_main(["init", "--study", str(root), "--env", "X=line1\nline2"])
    assert code == 2 and obj["code"] == "bad_env" and obj["key"] == "env", obj
    assert not root.exists()
    study = tiny_study(tmp_path / "s")
    refused(["init", "--study", str(study), "--env", "X=a\x00b"], study, names="--env")


def test_a_task_directory_without_task_json_is_refused_not_dropped(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s", tasks=("one", "two"))
    (study / "tasks" / "two" / "task.json").unlink()
    obj = refused(["assign", "--study", str(study), "--force"], study, names="two")
    assert obj["code"] == "task_json_missing" and obj["file"] == "task.json", obj
    # A directory whose name starts with _ (or a cache) is kept there unused, on purpose.
    (study / "tasks" / "two").rename(study / "tasks" / "_two")
    (study / "tasks" / "__pycache__").mkdir()
    code, out = run_main(["assign", "--study", str(study), "--force"])
    assert code == 0 and out["tasks"] == 1, out


def test_a_task_json_that_is_a_directory_is_refused_by_name(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    (study / "tasks" / "tiny" / "task.json").unlink()
    (study / "tasks" / "tiny" / "task.json").mkdir()
    obj = refused(["calibrate", "--study", str(study)], study, names="task.json")
    assert obj["code"] == "json_file_is_directory", obj


def test_unknown_task_json_keys_are_refused_like_study_json_s(tmp_path: Path, fake_env) -> None:
    study = tiny_study(tmp_path / "s")
    spec = json.loads((study / "tasks" / "tiny" / "task.json").read_text())
    write_json(study / "tasks" / "tiny" / "task.json", {**spec, "_note": "free", "treshold": 0.5})
    obj = refused(["calibrate", "--study", str(study)], study, names="treshold")
    assert obj["code"] == "task_json_unknown_keys" and obj["file"] == "task.json", obj
    assert obj["key"] == "treshold", obj


@pytest.mark.parametrize("flag", ["--behaviour", "--fault"])
def test_rehearse_refuses_a_run_the_rehearsal_does_not_have_before_writing(tmp_path: Path, fake_env,
                                                                            flag: str) -> None:
    study = tiny_study(tmp_path / "s")
    value = "r9999=solve" if flag == "--behaviour" else "r9999=interrupt:after_tool_uses=1"
    obj = refused(["rehearse", "--study", str(study), "--force", "--dir", str(study / "reh"), flag, value],
                  study, names="r9999")
    assert obj["code"] == "unknown_run", obj
    obj = refused(["rehearse", "--study", str(study), "--force", "--dir", str(study / "reh"),
                   "--limit", "1", "--behaviour", "r0002=solve"], study, names="r0002")
