"""Arms as whole Claude Code configurations: every arm setting's check (exit 2, arm and key named,
the study tree unchanged), the LaunchSpec an arm resolves to and its hash, the argv built from it,
and the pre-registration of each arm's launch in the manifest (`run` refuses a changed arm)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import agentbench as ab
from conftest import run_main
from test_bad_input import snapshot
from test_experiment import tiny_study, write_json

MCP = {"mcpServers": {"notes": {"command": "python3", "args": ["arm/mcp_server.py"]}}}


def arm_files(root: Path) -> None:
    """The files a full arm brings: an MCP config and its server, settings, agents, a plugin, an
    overlay and a system prompt."""
    (root / "arm" / "plugin" / ".claude-plugin").mkdir(parents=True)
    (root / "arm" / "overlay").mkdir(parents=True)
    write_json(root / "arm" / "mcp.json", MCP)
    (root / "arm" / "mcp_server.py").write_text("print('server')\n")
    write_json(root / "arm" / "settings.json", {"hooks": {}})
    write_json(root / "arm" / "agents.json", {"helper": {"description": "d", "prompt": "p"}})
    write_json(root / "arm" / "plugin" / ".claude-plugin" / "plugin.json", {"name": "p"})
    (root / "arm" / "overlay" / "CLAUDE.md").write_text("Use small commits.\n")
    (root / "arm" / "system.md").write_text("You are terse.\n")


FULL_ARM = {"model": "claude-sonnet-4-5-20250929", "effort": "medium", "fallback_model": "claude-haiku-4-5",
            "tools": "Bash,Read", "disallowed_tools": "WebFetch", "permission_mode": "acceptEdits",
            "env": {"ARM_FLAG": "1"}, "system_prompt": "arm/system.md", "mcp": "arm/mcp.json",
            "settings": "arm/settings.json", "agents": "arm/agents.json", "agent": "helper",
            "plugins": ["arm/plugin"],
            "workspace_overlay": "arm/overlay"}


@pytest.fixture
def armed(tmp_path: Path, fake_env) -> Path:
    root = tiny_study(tmp_path / "s", arms={"A": {}, "B": dict(FULL_ARM)}, env={"STUDY_VAR": "s"})
    arm_files(root)
    return root


def set_arm(root: Path, arm: str, **settings: object) -> None:
    cfg = json.loads((root / "study.json").read_text())
    cfg["arms"][arm] = {**cfg["arms"][arm], **settings}
    write_json(root / "study.json", cfg)


# ---- every bad setting --------------------------------------------------------------------------

BAD = [
    ({"modle": "x"}, "arm_unknown_keys", "modle"),
    ({"max_turns": 5}, "arm_sets_study_wide_limit", "max_turns"),
    ({"budget": {"usd_per_run": 1}}, "arm_sets_study_wide_limit", "budget"),
    ({"wall_s": 10}, "arm_sets_study_wide_limit", "wall_s"),
    ({"model": "sonnet"}, "arm_model_not_full_id", "model"),
    ({"model": 3}, "arm_model_not_full_id", "model"),
    ({"fallback_model": "claude-haiku-4-5,haiku"}, "arm_model_not_full_id", "fallback_model"),
    ({"effort": "huge"}, "arm_unknown_effort", "effort"),
    ({"permission_mode": "yolo"}, "arm_unknown_permission_mode", "permission_mode"),
    ({"tools": ["Bash"]}, "arm_tools_not_string", "tools"),
    ({"agent": "a helper"}, "arm_agent_not_name", "agent"),
    ({"allowed_tools": 1}, "arm_tools_not_string", "allowed_tools"),
    ({"disallowed_tools": None}, "arm_tools_not_string", "disallowed_tools"),
    ({"env": {"A B": "1"}}, "arm_env_not_strings", "env"),
    ({"env": {"X": 1}}, "arm_env_not_strings", "env"),
    ({"mcp": "/etc/passwd"}, "arm_file_outside_study", "mcp"),
    ({"settings": "../x.json"}, "arm_file_outside_study", "settings"),
    ({"plugins": "arm/plugin"}, "arm_file_outside_study", "plugins"),
    ({"agents": "arm/nope.json"}, "arm_file_missing", "agents"),
    ({"system_prompt": "arm/none.md"}, "arm_file_missing", "system_prompt"),
    ({"workspace_overlay": "arm/none"}, "arm_file_missing", "workspace_overlay"),
    ({"workspace_overlay": "arm/system.md"}, "arm_file_wrong_kind", "workspace_overlay"),
    ({"plugins": ["arm/system.md"]}, "arm_file_wrong_kind", "plugins"),
    ({"settings": "arm/bad.json"}, "arm_file_not_json", "settings"),
    ({"agents": "arm/list.json"}, "arm_file_not_json", "agents"),
    ({"mcp": "arm/bad.json"}, "arm_file_not_json", "mcp"),
    ({"mcp": "arm/settings.json"}, "arm_mcp_config_invalid", "mcp"),
    ({"settings": "arm/escape.json"}, "arm_file_outside_study", "settings"),
    # never shown to a session: a task's hidden files, the study's state and runs, whatever names them
    ({"system_prompt": "tasks/tiny/oracle/leak.md"}, "arm_file_not_showable", "system_prompt"),
    ({"mcp": "arm/leak_mcp.json"}, "arm_file_not_showable", "mcp"),
    ({"settings": "state/leak.json"}, "arm_file_not_showable", "settings"),
    ({"workspace_overlay": "runs/r9"}, "arm_file_not_showable", "workspace_overlay"),
    ({"plugins": ["tasks"]}, "arm_file_not_showable", "plugins"),
    # a link inside the study, outside the hidden parts, to a hidden test: the rule reads where it leads
    ({"system_prompt": "arm/link.md"}, "arm_file_not_showable", "system_prompt"),
    ({"mcp": "arm/link_mcp.json"}, "arm_file_not_showable", "mcp"),
    ({"plugins": ["arm/linkdir"]}, "arm_file_not_showable", "plugins"),
    # the transcript folder is made under it on the host and bound read-write into the session
    ({"env": {"CLAUDE_CONFIG_DIR": "state/cfg"}}, "arm_config_dir_refused", "env.CLAUDE_CONFIG_DIR"),
    ({"env": {"CLAUDE_CONFIG_DIR": "/usr/lib/cfg"}}, "arm_config_dir_refused", "env.CLAUDE_CONFIG_DIR"),
]


@pytest.mark.parametrize("setting, code, key", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
@pytest.mark.parametrize("command", ["assign", "rehearse"])
def test_every_bad_arm_setting_is_refused_by_arm_and_key_and_writes_nothing(
        armed: Path, tmp_path: Path, setting: dict, code: str, key: str, command: str) -> None:
    (armed / "arm" / "bad.json").write_text("{not json")
    (armed / "arm" / "list.json").write_text("[1, 2]")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (armed / "arm" / "escape.json").symlink_to(outside)
    for leak in ("tasks/tiny/oracle/leak.md", "state/leak.json", "runs/r9/leak.md"):
        (armed / leak).parent.mkdir(parents=True, exist_ok=True)
        (armed / leak).write_text("{}")
    (armed / "arm" / "link.md").symlink_to(armed / "tasks" / "tiny" / "oracle" / "leak.md")
    (armed / "arm" / "linkdir").symlink_to(armed / "tasks" / "tiny" / "oracle")
    write_json(armed / "arm" / "link_mcp.json", {"mcpServers": {"s": {"command": "python3", "args": ["arm/link.md"]}}})
    # an MCP server's argument naming a hidden test: it was bound into the sandbox as a study file
    write_json(armed / "arm" / "leak_mcp.json",
               {"mcpServers": {"s": {"command": "python3", "args": ["tasks/tiny/oracle/leak.md"]}}})
    set_arm(armed, "B", **setting)
    argv = {"assign": ["assign", "--study", str(armed), "--force"],
            "rehearse": ["rehearse", "--study", str(armed), "--dir", str(tmp_path / "reh")]}[command]
    before = snapshot(armed)
    rc, obj = run_main(argv)
    assert rc == 2, obj
    assert obj["code"] == code, obj
    assert obj["arm"] == "B" and obj["key"] == key, obj
    assert obj.get("hint"), obj
    assert snapshot(armed) == before, "a refusal wrote something"
    assert not (tmp_path / "reh").exists()


# ---- the launch an arm resolves to ----------------------------------------------------------------

def test_an_arm_launch_spec_overrides_the_study_and_hashes_every_file(armed: Path) -> None:
    study = ab.load_study(ab.StudyPaths(armed))
    a, b = study.arms["A"].launch, study.arms["B"].launch
    assert a.model == "claude-opus-4-5" and a.arm == "A" and a.files == () and a.mcp is None
    assert dict(a.env) == {"STUDY_VAR": "s"}
    assert b.model == FULL_ARM["model"] and b.effort == "medium" and b.permission_mode == "acceptEdits"
    assert b.tools == b.allowed_tools == "Bash,Read" and b.disallowed_tools == "WebFetch"
    assert dict(b.env) == {"STUDY_VAR": "s", "ARM_FLAG": "1"}
    files = dict(b.files)
    for rel in ("arm/mcp.json", "arm/mcp_server.py", "arm/settings.json", "arm/agents.json",
                "arm/system.md", "arm/plugin/.claude-plugin/plugin.json", "arm/overlay/CLAUDE.md"):
        assert files[rel] == ab.sha256_file(armed / rel), rel
    # The MCP server's script, named relative to the study, is made absolute and bound read-only.
    mcp = json.loads(b.mcp_json)
    server = str((armed / "arm" / "mcp_server.py").resolve())
    assert mcp["mcpServers"]["notes"]["args"] == [server]
    assert server in b.bind_ro and str((armed / "arm" / "settings.json").resolve()) in b.bind_ro
    # The hash: same settings and files, same hash; one byte of one file, another hash.
    again = ab.load_study(ab.StudyPaths(armed)).arms["B"].launch
    assert again.hash == b.hash and a.hash != b.hash
    (armed / "arm" / "mcp_server.py").write_text("print('changed')\n")
    assert ab.load_study(ab.StudyPaths(armed)).arms["B"].launch.hash != b.hash
    assert ab.LaunchSpec.from_record(b.record()) == b


def test_the_argv_carries_exactly_the_arm_settings(armed: Path) -> None:
    b = ab.load_study(ab.StudyPaths(armed)).arms["B"].launch
    argv = ab.build_claude_argv("claude", b, session_id="s", resume=None, fork=False, mcp_config="/j/mcp.json",
                                system_prompt_file="/j/sp.md", max_budget_usd=1.0, max_turns=5)

    def val(flag: str) -> str:
        assert argv.count(flag) == 1, (flag, argv)
        return argv[argv.index(flag) + 1]
    assert val("--model") == FULL_ARM["model"] and val("--effort") == "medium"
    assert val("--fallback-model") == "claude-haiku-4-5" and val("--permission-mode") == "acceptEdits"
    assert val("--tools") == "Bash,Read" and val("--disallowedTools") == "WebFetch"
    assert val("--system-prompt-file") == str(armed / "arm" / "system.md")
    assert val("--append-system-prompt-file") == "/j/sp.md"
    assert val("--settings") == str(armed / "arm" / "settings.json")
    assert val("--agents") == str(armed / "arm" / "agents.json") and val("--agent") == "helper"
    assert val("--plugin-dir") == str(armed / "arm" / "plugin")
    assert "--include-hook-events" in argv and "--strict-mcp-config" in argv
    plain = ab.build_claude_argv("claude", ab.load_study(ab.StudyPaths(armed)).arms["A"].launch,
                                 session_id="s", resume=None, fork=False, mcp_config="/j/mcp.json",
                                 system_prompt_file="/j/sp.md", max_budget_usd=1.0, max_turns=5)
    for flag in ("--fallback-model", "--system-prompt-file", "--settings", "--agents", "--agent", "--plugin-dir",
                 "--include-hook-events"):
        assert flag not in plain


# ---- pre-registered -----------------------------------------------------------------------------

def test_assign_registers_each_arm_and_run_refuses_an_arm_changed_after_it(armed: Path) -> None:
    code, out = run_main(["assign", "--study", str(armed), "--force"])
    assert code == 0, out
    manifest = json.loads((armed / "state" / "manifests" / "main.json").read_text())
    study = ab.load_study(ab.StudyPaths(armed))
    for name in ("A", "B"):
        assert manifest["arms"][name]["hash"] == study.arms[name].launch.hash
    assert manifest["arms"]["B"]["settings"]["model"] == FULL_ARM["model"]
    assert manifest["arms"]["B"]["files"]["arm/mcp_server.py"] == ab.sha256_file(armed / "arm" / "mcp_server.py")
    assert str(armed) not in json.dumps(manifest), "a manifest holds no path of this machine"
    # One byte of the MCP server's file: `run` (and `spawn --run`) refuse, naming the arm and file.
    (armed / "arm" / "mcp_server.py").write_text("print('edited after assign')\n")
    b_run = next(r["run_id"] for r in manifest["runs"] if r["arm"] == "B")
    for argv in (["run", "--study", str(armed), "--force"],
                 ["spawn", "--study", str(armed), "--run", b_run, "--force"]):
        before = snapshot(armed)
        code, out = run_main(argv)
        assert code == 2 and out["code"] == "arm_changed_after_assign", out
        assert out["arm"] == "B" and out["file"] == "arm/mcp_server.py", out
        assert snapshot(armed) == before
    # A changed setting is named too; restoring the arm lets `run` past the check.
    (armed / "arm" / "mcp_server.py").write_text("print('server')\n")
    set_arm(armed, "B", effort="high")
    code, out = run_main(["run", "--study", str(armed), "--force", "--arm", "B"])
    assert code == 2 and out["code"] == "arm_changed_after_assign" and out["settings"] == ["effort"], out
    # A's runs are not refused for B's change.
    a_runs = [r["run_id"] for r in manifest["runs"] if r["arm"] == "A"]
    ab.refuse_changed_arms(ab.load_study(ab.StudyPaths(armed)), a_runs)


# ---- bases follow the launch --------------------------------------------------------------------

def test_a_base_is_named_per_task_and_launch_and_refused_to_another_launch() -> None:
    study = ab.LaunchSpec(root="/s")
    other = ab.LaunchSpec(root="/s", arm="M", model="claude-sonnet-4-5-20250929")
    same = ab.LaunchSpec(root="/elsewhere", arm="A")
    assert ab.base_name_for("t1", same, study) == "t1"
    assert ab.base_name_for("t1", other, study) == "t1." + other.hash[:12]
    ab.refuse_base_launch({"name": "t1", "arm_hash": study.hash}, same)
    ab.refuse_base_launch({"name": "t1"}, other)            # a base from before launch hashes
    ab.refuse_base_launch({"name": "t1", "arm_hash": study.hash}, None)
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.refuse_base_launch({"name": "t1", "arm_hash": study.hash}, other)
    assert exc.value.payload["code"] == "base_launch_mismatch" and exc.value.payload["arm"] == "M"


# ---- comparisons across prices ------------------------------------------------------------------

def priced_run(rid: str, task: str, arm: str, success: bool, cost: float, model: str, effort: str) -> dict:
    from test_report import run
    rec = run(rid, task, arm, 1, success=success, cost=cost)
    rec["provenance"] = {"launch": {"model": model, "effort": effort}}
    return rec


def test_arms_of_different_models_are_compared_at_their_prices() -> None:
    runs = []
    for i, task in enumerate(("t1", "t2", "t3", "t4")):
        runs.append(priced_run(f"a{i}", task, "A", i < 2, 2.0, "claude-opus-4-5", "high"))
        runs.append(priced_run(f"s{i}", task, "S", i < 3, 0.5, "claude-sonnet-4-5-20250929", "medium"))
    rep = ab.build_report(runs, ["A", "S"])
    prices = rep["prices"]
    assert prices["per_arm"]["A"]["models"] == ["claude-opus-4-5"]
    assert prices["per_arm"]["S"]["efforts"] == ["medium"]
    assert prices["per_arm"]["A"]["cost_per_run_usd"] == pytest.approx(2.0)
    assert prices["per_arm"]["A"]["cost_per_success_usd"] == pytest.approx(4.0)
    assert prices["per_arm"]["S"]["cost_per_success_usd"] == pytest.approx(2.0 / 3)
    assert prices["per_arm"]["S"]["success_diff"] == pytest.approx(0.25)
    assert prices["per_arm"]["S"]["cost_per_run_diff_usd"] == pytest.approx(-1.5)
    assert "success_diff" not in prices["per_arm"]["A"]
    md = ab.render_report_md(rep)
    assert "Comparisons across prices" in md and "claude-sonnet-4-5-20250929" in md
    # Arms with one launch between them: no such section.
    same = [priced_run(r["run_id"], r["task"], r["arm"], bool(r["evaluation"]["success"]), r["cost_usd"],
                       "claude-opus-4-5", "high") for r in runs]
    assert ab.build_report(same, ["A", "S"])["prices"] is None
    assert "Comparisons across prices" not in ab.render_report_md(ab.build_report(same, ["A", "S"]))


def test_assign_power_delta_prices_each_arm_by_its_own_model(tmp_path: Path, fake_env) -> None:
    root = tiny_study(tmp_path / "s", tasks=("t1", "t2"),
                      arms={"A": {}, "H": {"model": "claude-haiku-4-5-20251001"}})
    code, out = run_main(["assign", "--study", str(root), "--force", "--power-delta", "0.3"])
    assert code == 0, out
    per_arm = out["power"]["plan"]["cost_at_repeats"]["per_arm"]
    assert per_arm["A"]["model"] == "claude-opus-4-5" and per_arm["H"]["model"] == "claude-haiku-4-5-20251001"
    assert per_arm["A"]["basis"] == per_arm["H"]["basis"] == "token_estimate"
    assert per_arm["H"]["cost_per_run_usd"] < per_arm["A"]["cost_per_run_usd"]


def test_every_arm_setting_is_in_the_readme_table() -> None:
    text = (Path(ab.__file__).resolve().parent / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| arm key |"):text.index("File settings are paths")]
    for key in ab.ARM_LAUNCH_KEYS:
        assert f"`{key}`" in table, key


# ---- keep-warm: the ping rule -------------------------------------------------------------------

FACTS = dict(pings_on=True, state="ready", cache="expiring", in_flight=False, active=True,
             pings_since_use=0, cap=11)


@pytest.mark.parametrize("change, want", [
    ({}, (True, "ping")),
    ({"pings_on": False}, (False, "pings_off")),
    ({"state": "training"}, (False, "state:training")),
    ({"state": "expired"}, (False, "state:expired")),
    ({"cache": "warm"}, (False, "state:warm")),
    ({"cache": "cold"}, (False, "state:cold")),
    ({"in_flight": True}, (False, "in_flight")),
    ({"active": False}, (False, "no_activity")),
    ({"pings_since_use": 10}, (True, "ping")),
    ({"pings_since_use": 11}, (False, "cap:11/11")),
    ({"cap": 0}, (False, "cap:0/0")),
    ({"pings_on": False, "cache": "cold", "active": False}, (False, "pings_off")),   # the first condition
])
def test_the_ping_rule(change: dict, want: tuple) -> None:
    assert ab.ping_decision(ab.PingFacts(**{**FACTS, **change})) == want


@pytest.mark.parametrize("age, state", [(0, "warm"), (239.9, "warm"), (240, "expiring"), (299.9, "expiring"),
                                        (300, "cold"), (1e9, "cold")])
def test_cache_state_by_age(age: float, state: str) -> None:
    assert ab.cache_state(age, 300.0, 60.0) == state


def test_the_break_even_count_of_pings() -> None:
    # A ping reads the prefix; going cold means writing it again (5-minute writes): 11 at today's
    # ratios (write 1.25x input, read 0.1x input).
    assert ab.ping_break_even(ab.price_for("claude-opus-4-5")) == 11
    assert ab.ping_break_even([5.0, 25.0, 6.25, 10.0, 0.5]) == 11
    assert ab.ping_break_even([1.0, 1.0, 1.0, 1.0, 0.0]) == 0          # a free read: never worth a ping
    assert ab.ping_break_even([1.0, 1.0, 0.1, 0.1, 0.1]) == 0


def test_each_arm_setting_is_declared_once_and_round_trips() -> None:
    """ARM_SETTINGS is the one place an arm launch setting is declared: its key is an arm key, its
    default is LaunchSpec's, its value survives the job record, and it reaches claude's argv (or
    is declared not to show in argv: env and the overlay reach the sandbox and the workspace)."""
    spec = ab.LaunchSpec(root="/s")
    job = {"mcp_config": "/j/mcp.json", "system_prompt_file": "/j/p.md"}
    for s in ab.ARM_SETTINGS:
        assert s.key in ab.ARM_KEYS and getattr(spec, s.key) == s.default
        assert s.from_view(s.to_view(s.default)) == s.default
        assert s.resolve in ("value", "env", "file", "mcp", "dirs", "overlay")
        assert (s.key in ab.DELIVERY_UNOBSERVABLE) == (not s.observable)
    values = {"model": "claude-x-1", "fallback_model": "claude-y-2", "effort": "low", "tools": "Bash",
              "allowed_tools": "Read", "disallowed_tools": "Edit", "permission_mode": "plan",
              "system_prompt": "sp.md", "mcp": "m.json", "settings": "s.json", "agents": "a.json",
              "agent": "rev", "plugins": ("p",), "env": (("A", "1"),), "workspace_overlay": "ov"}
    assert set(values) == set(ab.ARM_LAUNCH_KEYS)
    full = ab.LaunchSpec(root="/s", arm="A", **values)
    assert ab.LaunchSpec.from_record(full.record()) == full
    argv = ab.build_claude_argv("claude", full, session_id="x", resume=None, fork=False,
                                max_budget_usd=None, max_turns=None, **job)
    for key, value in values.items():
        # (mcp: the job's own copy of the arm's config, its paths made absolute)
        shown = job["mcp_config"] if key == "mcp" else value[0] if isinstance(value, tuple) else value
        if ab.ARM_SETTING[key].argv(full, value, job):
            assert any(shown in a for a in argv), key
        else:
            assert key in ("env", "workspace_overlay"), key


def test_an_arms_config_dir_in_another_studys_runs_is_refused(armed: Path, tmp_path: Path) -> None:
    """The transcript folder is made under CLAUDE_CONFIG_DIR and bound read-write: in another
    study's runs/ a session could add files to that study's run."""
    other = tmp_path / "other"
    (other / "runs" / "r1" / "workspace").mkdir(parents=True)
    write_json(other / "study.json", {"arms": {}})
    target = str(other / "runs" / "r1" / "workspace")
    # the attack is set up: the rule of this study alone lets it through (it lies outside it)
    assert ab.config_dir_refusal(target, study=str(armed.resolve()), tasks=str((armed / "tasks").resolve())) is None
    set_arm(armed, "B", env={"CLAUDE_CONFIG_DIR": target})
    before = snapshot(armed)
    rc, obj = run_main(["assign", "--study", str(armed), "--force"])
    assert rc == 2 and obj["code"] == "arm_config_dir_refused", obj
    assert obj["arm"] == "B" and "runs/" in obj["why"] and str(other) in obj["why"], obj
    assert snapshot(armed) == before
    # a folder of no study is still the experimenter's choice
    set_arm(armed, "B", env={"CLAUDE_CONFIG_DIR": str(tmp_path / "elsewhere")})
    rc, obj = run_main(["assign", "--study", str(armed), "--force"])
    assert rc == 0, obj
