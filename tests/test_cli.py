"""The CLI's output contract and its refusals.

Every call prints exactly one JSON object on stdout (also for help, usage errors and internal
errors); exit 2 means a usage error or a refusal; a refused command writes nothing; calls from
inside a supervised session (AGENTBENCH_CHILD=1) may read but never launch, kill or change state.
Tested both in-process (``main([...])``) and as real processes (``python3 agentbench.py ...``).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AGENTBENCH, ab, ledger, run_main, wait_result, write_brief


# ---- helpers -------------------------------------------------------------------------------------

def tree_snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under `root`: relative path -> content hash ('dir' for dirs).

    Two equal snapshots mean nothing was created, removed or rewritten with new content.
    """
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        out[rel.as_posix()] = "dir"
        for fn in filenames:
            out[(rel / fn).as_posix()] = hashlib.sha256((Path(dirpath) / fn).read_bytes()).hexdigest()
    return out


def strict_cli(args: list[str], env: dict[str, str], timeout: float = 60) -> tuple[int, dict, str]:
    """A real process; stdout must be exactly one newline-terminated JSON object, nothing else."""
    proc = subprocess.run([sys.executable, str(AGENTBENCH), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.stdout.endswith("\n"), proc.stdout
    assert proc.stdout.count("\n") == 1, f"more than one stdout line: {proc.stdout!r}"
    obj = json.loads(proc.stdout)
    assert isinstance(obj, dict)
    return proc.returncode, obj, proc.stderr


def add_arms(study: Path) -> None:
    """Give a bare study two arms (so that `report` has something to describe)."""
    cfg = json.loads((study / "study.json").read_text())
    cfg["arms"] = {"A": {}, "B": {}}
    (study / "study.json").write_text(json.dumps(cfg))


def missing_binary_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """An environment whose configured claude binary does not exist."""
    out = dict(env)
    out["AGENTBENCH_CLAUDE_BIN"] = str(tmp_path / "no-such-dir" / "claude")
    return out


# ---- one JSON object: help, where, version --------------------------------------------------------

def test_top_level_help_in_process():
    for argv in ([], ["--help"], ["-h"], ["help"]):
        code, obj = run_main(argv)
        assert code == 0
        assert isinstance(obj["help"], str) and obj["help"]
        names = [c["name"] for c in obj["commands"]]
        for expected in ("where", "init", "spawn", "wait", "list", "kill", "usage", "report", "run"):
            assert expected in names
        # Internal commands are not advertised.
        assert not any(n.startswith("_") for n in names)


def test_top_level_help_real_process(fake_env):
    code, obj, _ = strict_cli(["--help"], fake_env)
    assert code == 0
    assert "commands" in obj and "help" in obj


@pytest.mark.parametrize("cmd", ["spawn", "init", "wait", "where", "kill"])
def test_command_help_lists_its_options(cmd, fake_env):
    code, obj = run_main([cmd, "--help"])
    assert code == 0
    assert obj["command"] == cmd
    flags = {f for o in obj["options"] for f in o["flags"]}
    assert "--study" in flags
    assert obj["mutating"] == ab.COMMANDS[cmd].mutating
    # `help CMD` answers the same object.
    code2, obj2 = run_main(["help", cmd])
    assert code2 == 0 and obj2 == obj


def test_command_help_real_process_does_not_need_valid_args(fake_env):
    # --help wins over missing required arguments: still one object, exit 0.
    code, obj, _ = strict_cli(["spawn", "--help"], fake_env)
    assert code == 0 and obj["command"] == "spawn"
    code, obj, _ = strict_cli(["init", "-h"], fake_env)
    assert code == 0 and obj["command"] == "init"
    assert any(o["flags"] == ["--study"] and o["required"] for o in obj["options"])


def test_where_in_process(fake_env):
    code, obj = run_main(["where"])
    assert code == 0
    assert obj["claude"]["path"] == fake_env["AGENTBENCH_CLAUDE_BIN"]
    assert obj["claude"]["found_by"] == "AGENTBENCH_CLAUDE_BIN"
    assert obj["claude"]["version"] == "0.0.0-fake"
    assert obj["python"]["executable"]
    assert obj["platform"]["seam"] in ("posix", "windows")
    assert isinstance(obj["warnings"], list)
    assert "env_scrub" in obj and "dropped" in obj["env_scrub"]


def test_where_real_process(fake_env):
    code, obj, _ = strict_cli(["where"], fake_env)
    assert code == 0
    assert obj["claude"]["version"] == "0.0.0-fake"
    assert obj["agentbench"] == ab.VERSION


def test_version_is_one_object(fake_env):
    code, obj = run_main(["--version"])
    assert code == 0 and obj["version"] == ab.VERSION


# ---- usage errors ---------------------------------------------------------------------------------

def test_unknown_command_in_process():
    code, obj = run_main(["frobnicate", "--study", "x"])
    assert code == 2
    assert obj["error"] == "unknown command"
    assert obj["command"] == "frobnicate"
    assert "spawn" in obj["commands"]
    assert "hint" in obj


def test_unknown_command_real_process(fake_env):
    code, obj, _ = strict_cli(["frobnicate"], fake_env)
    assert code == 2
    assert obj["error"] == "unknown command" and obj["command"] == "frobnicate"


@pytest.mark.parametrize("argv, needle", [
    (["list", "--bogus-flag"], "--bogus-flag"),
    (["init"], "--study"),                                  # a required flag is missing
    (["wait", "--all", "--timeout", "soon"], "soon"),      # a bad value for a typed flag
    (["init", "--study", "s", "--parallel", "many"], "many"),
])
def test_bad_flag_in_process(argv, needle, fake_env):
    code, obj = run_main(argv)
    assert code == 2
    assert obj["error"] == "bad arguments"
    assert needle in obj["detail"]
    assert obj["command"] == argv[0]


def test_bad_flag_real_process(fake_env):
    code, obj, _ = strict_cli(["where", "--no-such-flag"], fake_env)
    assert code == 2
    assert obj["error"] == "bad arguments" and "--no-such-flag" in obj["detail"]


def test_not_a_study_is_refused(tmp_path, fake_env):
    code, obj = run_main(["list", "--study", str(tmp_path / "nowhere")])
    assert code == 2
    assert "study" in obj["error"] and "hint" in obj
    assert not (tmp_path / "nowhere").exists()


def test_no_study_given_is_refused(tmp_path, fake_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, obj = run_main(["list"])
    assert code == 2 and obj["error"] == "no study given"


def test_study_from_environment_and_cwd(study, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTBENCH_STUDY", str(study))
    code, obj = run_main(["list"])
    assert code == 0 and obj["active"] == 0
    monkeypatch.delenv("AGENTBENCH_STUDY")
    monkeypatch.chdir(study)
    code, obj = run_main(["list"])
    assert code == 0 and "jobs" in obj


@pytest.mark.parametrize("value", ["nan", "-1", "571", "inf"])
def test_wait_refuses_a_timeout_out_of_range(study, value):
    # NaN compares false with every bound: it must be refused, not turned into an endless wait.
    code, obj = run_main(["wait", "--study", str(study), "--all", f"--timeout={value}"])
    assert code == 2
    if value in ("nan", "inf"):
        # Not a finite number: refused by the argument parser itself.
        assert obj["error"] == "bad arguments" and "finite" in obj["detail"]
    else:
        assert obj["error"] == "timeout out of range"


# ---- internal errors ------------------------------------------------------------------------------

def test_internal_error_is_one_json_object(study, monkeypatch):
    def boom(ctx, args):
        raise RuntimeError("kaboom from a handler")
    monkeypatch.setattr(ab.COMMANDS["list"], "handler", boom)
    code, obj = run_main(["list", "--study", str(study)])
    assert code == 2
    assert obj["error"] == "internal error"
    assert obj["type"] == "RuntimeError"
    assert obj["detail"] == "kaboom from a handler"


def test_internal_error_in_argument_setup_is_one_json_object(monkeypatch):
    class BrokenOptions:
        def __iter__(self):
            raise KeyError("broken parser")
    monkeypatch.setattr(ab.COMMANDS["usage"], "args", BrokenOptions())
    code, obj = run_main(["usage"])
    assert code == 2
    assert obj["error"] == "internal error" and obj["type"] == "KeyError"


def test_keyboard_interrupt_is_one_json_object(study, monkeypatch):
    def interrupted(ctx, args):
        raise KeyboardInterrupt
    monkeypatch.setattr(ab.COMMANDS["list"], "handler", interrupted)
    code, obj = run_main(["list", "--study", str(study)])
    assert code == 2 and obj["error"] == "interrupted"


# ---- the claude binary is missing -----------------------------------------------------------------

def test_where_reports_a_missing_binary(tmp_path, fake_env):
    env = missing_binary_env(fake_env, tmp_path)
    code, obj = run_main(["where"], env=env)
    # Nothing usable: exit 2, "ok": false and the reasons, with the whole report still given.
    assert code == 2 and obj["ok"] is False and obj["reasons"]
    assert obj["claude"]["path"] is None
    assert obj["claude"]["version"] is None
    assert any("claude binary not found" in w for w in obj["warnings"])


def test_where_reports_a_missing_binary_when_nothing_is_on_path(tmp_path, fake_env, monkeypatch):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {k: v for k, v in fake_env.items() if k != "AGENTBENCH_CLAUDE_BIN"}
    env["PATH"] = str(empty)
    # The local install location must not exist either, whatever this machine holds.
    monkeypatch.setattr(ab, "local_claude_path", lambda: tmp_path / "no-local" / "claude")
    code, obj = run_main(["where"], env=env)
    assert code == 2 and obj["ok"] is False
    assert obj["claude"]["path"] is None and obj["claude"]["found_by"] == "not found"
    assert any("claude binary not found" in w for w in obj["warnings"])


def test_where_reports_a_missing_binary_real_process(tmp_path, fake_env):
    code, obj, _ = strict_cli(["where"], missing_binary_env(fake_env, tmp_path))
    assert code == 2 and obj["ok"] is False and obj["claude"]["path"] is None
    assert obj["warnings"]


def test_spawn_refuses_without_binary_and_writes_nothing(study, tmp_path, fake_env):
    brief = write_brief(tmp_path, "hello")
    before = tree_snapshot(study / "state")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief],
                         env=missing_binary_env(fake_env, tmp_path))
    assert code == 2
    assert obj["error"] == "the claude binary was not found"
    assert "hint" in obj
    after = tree_snapshot(study / "state")
    after.pop("last_call", None)   # orchestrator activity marker, not study state
    assert after == {k: v for k, v in before.items() if k != "last_call"}


def test_train_refuses_without_binary_and_writes_nothing(study, tmp_path, fake_env):
    brief = write_brief(tmp_path, "learn the starter")
    before = tree_snapshot(study / "state")
    code, obj, _ = strict_cli(["train", "--study", str(study), "--base", "b1", "--brief", brief],
                              missing_binary_env(fake_env, tmp_path))
    assert code == 2
    assert obj["error"] == "the claude binary was not found" and "hint" in obj
    after = tree_snapshot(study / "state")
    after.pop("last_call", None)
    assert after == {k: v for k, v in before.items() if k != "last_call"}


# ---- refusals write nothing -----------------------------------------------------------------------

def test_spawn_with_missing_brief_creates_no_job(study, tmp_path):
    before = tree_snapshot(study / "state")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", str(tmp_path / "nope.txt")])
    assert code == 2
    assert obj["error"] == "brief file not found"
    assert not (study / "state" / "jobs").exists() or not os.listdir(study / "state" / "jobs")
    after = tree_snapshot(study / "state")
    after.pop("last_call", None)
    assert after == {k: v for k, v in before.items() if k != "last_call"}


def test_spawn_with_empty_brief_creates_no_job(study, tmp_path):
    brief = write_brief(tmp_path, "  \n\n")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief])
    assert code == 2 and obj["error"] == "brief file is empty"
    assert not (study / "state" / "jobs").exists() or not os.listdir(study / "state" / "jobs")
    assert not (study / "state" / "workspaces").exists() or not os.listdir(study / "state" / "workspaces")


def test_spawn_with_bad_label_or_fault_creates_no_job(study, tmp_path):
    brief = write_brief(tmp_path, "hello")
    for extra, err in ((["--label", "../escape"], "invalid label name"),
                       (["--fault", "explode:now"], "unknown fault"),
                       (["--max-budget-usd", "-1"], "max_budget_usd must be a non-negative number")):
        code, obj = run_main(["spawn", "--study", str(study), "--brief", brief, *extra])
        assert code == 2, obj
        assert obj["error"] == err
    assert not (study / "state" / "jobs").exists() or not os.listdir(study / "state" / "jobs")
    assert not (study / "state" / "workspaces").exists() or not os.listdir(study / "state" / "workspaces")


def test_spawn_at_the_parallel_cap_writes_nothing(tmp_path, fake_env):
    root = tmp_path / "capped"
    assert run_main(["init", "--study", str(root), "--parallel", "1"])[0] == 0
    hang = write_brief(tmp_path, "FAKE: hang\n")
    code, first = run_main(["spawn", "--study", str(root), "--brief", hang])
    assert code == 0, first
    try:
        before = tree_snapshot(root / "state" / "jobs")
        ws_before = sorted(os.listdir(root / "state" / "workspaces"))
        code, obj = run_main(["spawn", "--study", str(root), "--brief", hang])
        assert code == 2
        assert obj["error"] == "parallel cap reached" and obj["cap"] == 1
        assert sorted(os.listdir(root / "state" / "workspaces")) == ws_before
        after = tree_snapshot(root / "state" / "jobs")
        # The running job's own files change (heartbeat); no new job appears.
        assert {k.split("/")[0] for k in after} == {k.split("/")[0] for k in before}
    finally:
        code, killed = run_main(["kill", "--study", str(root), "--job", first["job_id"]])
        assert code == 0 and killed["clean"], killed


# ---- init -----------------------------------------------------------------------------------------

def test_init_creates_then_is_idempotent(tmp_path, fake_env):
    root = tmp_path / "s"
    code, obj = run_main(["init", "--study", str(root), "--model", "claude-sonnet-4-5",
                          "--effort", "low", "--parallel", "3", "--usd-per-run", "2.5"])
    assert code == 0 and obj["created"] is True
    cfg = json.loads((root / "study.json").read_text())
    assert cfg["model"] == "claude-sonnet-4-5" and cfg["effort"] == "low" and cfg["parallel"] == 3
    assert cfg["budget"]["usd_per_run"] == 2.5
    assert (root / "state" / "registry.json").is_file()
    before = (root / "study.json").read_bytes()
    # The same call again: nothing changes.
    code, obj = run_main(["init", "--study", str(root), "--model", "claude-sonnet-4-5",
                          "--effort", "low", "--parallel", "3", "--usd-per-run", "2.5"])
    assert code == 0 and obj["created"] is False and obj["changed"] == []
    assert (root / "study.json").read_bytes() == before
    # No flags at all: nothing changes either.
    code, obj = run_main(["init", "--study", str(root)])
    assert code == 0 and obj["changed"] == []
    assert (root / "study.json").read_bytes() == before


def test_init_rerun_keeps_omitted_values(tmp_path, fake_env):
    root = tmp_path / "s"
    assert run_main(["init", "--study", str(root), "--model", "claude-sonnet-4-5", "--effort", "medium",
                     "--permission-mode", "acceptEdits", "--tools", "Read,Bash", "--study-usd", "7"])[0] == 0
    code, obj = run_main(["init", "--study", str(root), "--parallel", "6", "--max-turns", "9"])
    assert code == 0
    assert sorted(obj["changed"]) == ["budget.max_turns", "parallel"]
    cfg = json.loads((root / "study.json").read_text())
    assert cfg["model"] == "claude-sonnet-4-5"
    assert cfg["effort"] == "medium"
    assert cfg["permission_mode"] == "acceptEdits"
    assert cfg["tools"] == "Read,Bash"
    assert cfg["parallel"] == 6
    assert cfg["budget"]["study_usd"] == 7 and cfg["budget"]["max_turns"] == 9
    # Keys the user added by hand survive a re-run too.
    cfg["arms"] = {"A": {}}
    (root / "study.json").write_text(json.dumps(cfg))
    assert run_main(["init", "--study", str(root), "--effort", "high"])[0] == 0
    cfg2 = json.loads((root / "study.json").read_text())
    assert cfg2["arms"] == {"A": {}} and cfg2["effort"] == "high" and cfg2["model"] == "claude-sonnet-4-5"


def test_comment_keys_are_free_and_init_repairs_a_wrong_value(tmp_path, fake_env):
    root = tmp_path / "s"
    assert run_main(["init", "--study", str(root)])[0] == 0
    cfg = {**json.loads((root / "study.json").read_text()), "_comment": "pilot study", "max_minutes": "60"}
    (root / "study.json").write_text(json.dumps(cfg))
    assert run_main(["assign", "--study", str(root)])[1]["error"] == "max_minutes must be a positive number"
    code, obj = run_main(["init", "--study", str(root), "--max-minutes", "45"])
    assert code == 0 and obj["changed"] == ["max_minutes"], obj
    fixed = json.loads((root / "study.json").read_text())
    assert fixed["max_minutes"] == 45 and fixed["_comment"] == "pilot study"


def test_init_help_explains_every_option():
    code, obj = run_main(["init", "--help"])
    assert code == 0
    assert [o["flags"] for o in obj["options"] if not o.get("help")] == []


def test_init_keeps_the_order_of_arms_and_so_the_baseline(tmp_path, fake_env):
    root = tmp_path / "s"
    assert run_main(["init", "--study", str(root)])[0] == 0
    cfg = json.loads((root / "study.json").read_text())
    cfg["arms"] = {"plain": {}, "gated": {"gate_cycles": 2}}      # "plain" is the baseline
    (root / "study.json").write_text(json.dumps(cfg))
    code, obj = run_main(["init", "--study", str(root), "--orphan-after-s", "600"])
    assert code == 0 and obj["changed"] == ["orphan_after_s"]
    assert list(json.loads((root / "study.json").read_text())["arms"]) == ["plain", "gated"]


@pytest.mark.parametrize("change, error, named", [
    ({"arms": {"A": {"review": "no"}}}, "an arm's review must be true or false", "A"),
    ({"arms": {"A": {"gate_cycle": 2}}}, "an arm has unknown keys", ["gate_cycle"]),
    ({"arms": {"A": {"gate_cycles": True}}}, "gate_cycles must be an integer 0..50", "A"),
    ({"arms": {"A": {"fork_base": 1}}}, "an arm's fork_base must be true or false", "A"),
    ({"repeat": 3}, "study.json has unknown keys", ["repeat"]),
    ({"tasks": 5}, "tasks must be a string", "tasks"),
    ({"repeats": "two"}, "repeats must be an integer in 1..1000", "repeats"),
    ({"seed": "abc"}, "seed must be an integer", "seed"),
    ({"budget": {"usd_per_rn": 1}}, "study.json: budget has unknown keys", ["usd_per_rn"]),
    ({"budget": [1]}, "budget must be an object", "budget"),
    ({"snapshot_seconds": 5}, "snapshot_seconds must be a list of positive numbers of seconds", "snapshot_seconds"),
    ({"snapshot_seconds": [60, -1]}, "snapshot_seconds must be a list of positive numbers of seconds", "snapshot_seconds"),
    ({"env": {"X": 1}}, "env must be an object of variable names to one-line string values", "env"),
    ({"budget": {"wall_s": "abc"}}, "budget values must be finite non-negative numbers", "wall_s"),
    ({"budget": {"study_usd": "x"}}, "budget values must be finite non-negative numbers", "study_usd"),
    ({"max_minutes": 0}, "max_minutes must be a positive number", "max_minutes"),
    ({"prices": []}, "prices must map a model prefix to [input, output, cache write 5m, cache write 1h, "
                     "cache read] USD per million tokens", None),
])
def test_a_misshapen_study_json_is_refused_by_name(tmp_path, fake_env, change, error, named):
    """A wrong type or a misspelt key would otherwise change the experiment silently (or crash a
    supervisor later): every command that reads the study refuses it, naming the key."""
    root = tmp_path / "s"
    assert run_main(["init", "--study", str(root)])[0] == 0
    cfg = {**json.loads((root / "study.json").read_text()), "arms": {"A": {}}, **change}
    (root / "study.json").write_text(json.dumps(cfg))
    before = (root / "study.json").read_bytes()
    for argv in (["calibrate", "--study", str(root)], ["assign", "--study", str(root)],
                 ["init", "--study", str(root), "--parallel", "2"]):
        code, obj = run_main(argv)
        assert code == 2 and obj["error"] == error, (argv, obj)
        assert named is None or named in (obj.get("arm"), obj.get("key"), obj.get("keys")), obj
    assert (root / "study.json").read_bytes() == before      # init wrote nothing
    code, where = run_main(["where", "--study", str(root)])
    assert code == 0 and any(w.startswith("study: " + error) for w in where["warnings"]), where["warnings"]


@pytest.mark.parametrize("flags, error", [
    (["--model", "opus"], "model must be a full model id, not an alias"),
    (["--model", "sonnet"], "model must be a full model id, not an alias"),
    (["--model", "Opus"], "model must be a full model id, not an alias"),
    (["--model", "gpt-4"], "model must be a full model id, not an alias"),
    (["--effort", "extreme"], "unknown effort"),
    (["--permission-mode", "yolo"], "unknown permission mode"),
    (["--parallel", "0"], "parallel must be an integer >= 1"),
    (["--executor", "cloud"], "executor must be local or slurm"),
    (["--usd-per-run", "-3"], "budget values must be finite non-negative numbers"),
])
def test_init_refusals_write_nothing(tmp_path, fake_env, flags, error):
    fresh = tmp_path / "fresh"
    code, obj = run_main(["init", "--study", str(fresh), *flags])
    assert code == 2
    assert obj["error"] == error
    assert not fresh.exists(), "a refused init must not create the study directory"

    existing = tmp_path / "existing"
    assert run_main(["init", "--study", str(existing), "--model", "claude-opus-4-5"])[0] == 0
    before = tree_snapshot(existing)
    code, obj = run_main(["init", "--study", str(existing), *flags])
    assert code == 2 and obj["error"] == error
    after = tree_snapshot(existing)
    after.pop("state/last_call", None)
    before.pop("state/last_call", None)
    assert after == before


def test_init_refuses_alias_real_process(tmp_path, fake_env):
    fresh = tmp_path / "fresh"
    code, obj, _ = strict_cli(["init", "--study", str(fresh), "--model", "sonnet"], fake_env)
    assert code == 2 and "alias" in obj["error"] and obj["model"] == "sonnet"
    assert not fresh.exists()


def test_init_refuses_a_corrupt_study_json(tmp_path, fake_env):
    root = tmp_path / "s"
    root.mkdir()
    (root / "study.json").write_text("{not json")
    code, obj = run_main(["init", "--study", str(root), "--parallel", "2"])
    assert code == 2 and obj["error"] == "file is not valid JSON"
    assert (root / "study.json").read_text() == "{not json"


# ---- the child marker -----------------------------------------------------------------------------

def _child_refusal_cases(study: Path, tmp_path: Path) -> dict[str, list[str]]:
    brief = write_brief(tmp_path, "hello from inside")
    s = str(study)
    return {
        "init": ["init", "--study", s, "--parallel", "9"],
        "train": ["train", "--study", s, "--base", "b", "--brief", brief],
        "spawn": ["spawn", "--study", s, "--brief", brief],
        "continue": ["continue", "--study", s, "--job", "j000001", "--brief", brief],
        "kill": ["kill", "--study", s, "--job", "j000001"],
        "calibrate": ["calibrate", "--study", s],
        "new-task": ["new-task", "--study", s, "--task", "t1"],
        "assign": ["assign", "--study", s],
        "gate": ["gate", "--study", s, "--run", "r0001"],
        "review": ["review", "--study", s, "--run", "r0001"],
        "evaluate": ["evaluate", "--study", s, "--all"],
        "run": ["run", "--study", s],
        "rehearse": ["rehearse", "--study", s],
        "demo": ["demo", "--dir", str(tmp_path / "demo")],
        "tick": ["tick", "--study", s],
        "expire": ["expire", "--study", s, "--base", "b"],
        "_drive": ["_drive", "--study", s],
        "_supervise": ["_supervise", "--study", s, "--job", "j000001"],
        "export": ["export", "--study", s, "--format", "atif", "--out", str(tmp_path / "exported")],
        "import-tasks": ["import-tasks", "--from", "harbor", str(tmp_path), "--tasks", str(tmp_path / "imported")],
    }


def test_every_mutating_command_is_covered_by_the_child_refusal_test(study, tmp_path):
    mutating = {name for name, c in ab.COMMANDS.items() if c.mutating}
    assert mutating == set(_child_refusal_cases(study, tmp_path))


@pytest.mark.parametrize("name", ["init", "train", "spawn", "continue", "kill", "calibrate", "new-task",
                                  "assign",
                                  "gate", "review", "evaluate", "run", "rehearse", "demo", "tick",
                                  "expire", "export", "import-tasks", "_drive", "_supervise"])
def test_child_marker_refuses_mutating_commands(name, study, tmp_path, monkeypatch):
    argv = _child_refusal_cases(study, tmp_path)[name]
    before = tree_snapshot(study)
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    code, obj = run_main(argv)
    assert code == 2
    assert obj["error"] == "refused inside a supervised session"
    assert obj["command"] == name
    assert tree_snapshot(study) == before
    assert not (tmp_path / "demo").exists()


def test_child_marker_refusal_real_process(study, tmp_path, fake_env):
    env = dict(fake_env, AGENTBENCH_CHILD="1")
    brief = write_brief(tmp_path, "hello")
    before = tree_snapshot(study)
    code, obj, _ = strict_cli(["spawn", "--study", str(study), "--brief", brief], env)
    assert code == 2 and obj["error"] == "refused inside a supervised session"
    assert tree_snapshot(study) == before


def test_child_marker_allows_read_only_commands(study, tmp_path, monkeypatch):
    add_arms(study)
    s = str(study)
    before = tree_snapshot(study)
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    for argv in (["where", "--study", s], ["list", "--study", s], ["usage", "--study", s],
                 ["usage", "--study", s, "--format", "md"], ["report", "--study", s],
                 ["report", "--study", s, "--format", "md"], ["wait", "--study", s, "--all", "--timeout", "0"]):
        code, obj = run_main(argv)
        assert code == 0, (argv, obj)
        assert "error" not in obj
    # Read-only calls from inside a session neither write nor count as orchestrator activity.
    assert tree_snapshot(study) == before
    assert not (study / "state" / "last_call").exists()


def test_child_marker_refuses_writing_a_report_file(study, monkeypatch):
    add_arms(study)
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    code, obj = run_main(["report", "--study", str(study), "--format", "html"])
    assert code == 2 and "refused" in obj["error"]
    assert not (study / "report.html").exists()


def test_report_json_out_writes_the_same_report(study, tmp_path, monkeypatch):
    add_arms(study)
    out = tmp_path / "r" / "report.json"
    out.parent.mkdir()
    code, obj = run_main(["report", "--study", str(study), "--format", "json", "--out", str(out)])
    assert code == 0 and obj["path"] == str(out)
    assert json.loads(out.read_text()) == {k: v for k, v in obj.items() if k != "path"}
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    code, obj = run_main(["report", "--study", str(study), "--format", "json", "--out", str(tmp_path / "x.json")])
    assert code == 2 and "refused" in obj["error"] and not (tmp_path / "x.json").exists()


def test_child_wait_does_not_consume_delivery(study, tmp_path, monkeypatch):
    brief = write_brief(tmp_path, "FAKE: text=hi\n")
    code, out = run_main(["spawn", "--study", str(study), "--brief", brief])
    assert code == 0, out
    job = out["job_id"]
    wait_result(study, job)
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    code, obj = run_main(["wait", "--study", str(study), "--job", job, "--timeout", "10"])
    assert code == 0 and obj["met"] is True
    assert obj["jobs"][0]["delivered_now"] is False
    monkeypatch.delenv("AGENTBENCH_CHILD")
    code, obj = run_main(["wait", "--study", str(study), "--job", job, "--timeout", "10"])
    assert code == 0 and obj["jobs"][0]["delivered_now"] is True
    code, obj = run_main(["wait", "--study", str(study), "--job", job, "--timeout", "10"])
    assert code == 0 and obj["jobs"][0]["delivered_now"] is False
    assert [r["job_id"] for r in ledger(study)] == [job]


def test_spawn_when_the_supervisor_cannot_start_finalises_the_job(study, tmp_path, monkeypatch):
    """A registered job whose supervisor fails to start is finalised `launch_error` at once,
    not left active (holding a parallel slot) until a later reap notices."""
    def cannot_start(*a, **k):
        raise ab.AgentbenchError("cannot start detached process", detail="simulated failure")
    monkeypatch.setattr(ab, "detach_agentbench", cannot_start)
    brief = write_brief(tmp_path, "hello")
    code, obj = run_main(["spawn", "--study", str(study), "--brief", brief])
    assert code == 0, obj
    assert obj["status"] == "failed" and obj["reason"] == "launch_error"
    res = json.loads((study / "state" / "jobs" / obj["job_id"] / "result.json").read_text())
    assert res["reason"] == "launch_error" and "simulated failure" in res["detail"]
    assert not (study / "state" / "active" / obj["job_id"]).exists()
    assert [r["job_id"] for r in ledger(study)] == [obj["job_id"]]


def test_train_refused_at_the_cap_leaves_no_base_behind(tmp_path, fake_env):
    root = tmp_path / "capped"
    assert run_main(["init", "--study", str(root), "--parallel", "1"])[0] == 0
    code, first = run_main(["spawn", "--study", str(root), "--brief", write_brief(tmp_path, "FAKE: hang\n")])
    assert code == 0, first
    try:
        code, obj = run_main(["train", "--study", str(root), "--base", "b1",
                              "--brief", write_brief(tmp_path, "learn")])
        assert code == 2 and obj["error"] == "parallel cap reached"
        assert not (root / "state" / "bases" / "b1.json").exists()
        assert not (root / "state" / "bases" / "b1" / "workspace").exists()
    finally:
        code, killed = run_main(["kill", "--study", str(root), "--job", first["job_id"]])
        assert code == 0 and killed["clean"], killed
