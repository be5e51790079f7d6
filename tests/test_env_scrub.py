"""The environment scrub: what a `claude` child and a check command inherit from the host.

The child environment is the host's minus a documented drop list (IDE/desktop session markers,
model/effort/cache overrides, the caller's virtualenv and uv settings), plus pinned variables
(DISABLE_AUTOUPDATER=1, the child marker).  Credentials reach `claude` only; gate and oracle
commands never see them.  Checked on the pure functions and end to end: through a real detached
supervisor and the fake `claude` (which logs what it saw), and through a real check command.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ab, run_main, wait_result, write_brief

SECRET = "sk-ant-test-DO-NOT-LEAK-0123456789"
PLAT = ab.current_platform()

CREDENTIALS = {
    "ANTHROPIC_API_KEY": SECRET,
    "ANTHROPIC_AUTH_TOKEN": SECRET + "-auth",
    "CLAUDE_CODE_OAUTH_TOKEN": SECRET + "-oauth",
    "GH_TOKEN": SECRET + "-gh",
    "AWS_SECRET_ACCESS_KEY": SECRET + "-aws",
    "MY_SERVICE_API_KEY": SECRET + "-svc",        # caught by the *_API_KEY pattern
    "DB_PASSWORD": SECRET + "-db",                 # caught by the *_PASSWORD pattern
}
DROPPED = {
    "CLAUDECODE": "1",
    "CLAUDE_CODE_ENTRYPOINT": "cli",
    "ANTHROPIC_MODEL": "claude-some-other-model",
    "CLAUDE_CODE_EFFORT_LEVEL": "max",
    "DISABLE_PROMPT_CACHING": "1",
    "CLAUDE_CODE_PROMPT_CACHE_TTL": "1h",
    "VSCODE_PID": "4242",
    "UV_PROJECT_ENVIRONMENT": "/somewhere/.venv",
    "PYTHONPATH": "/somewhere/else",
    "AGENTBENCH_STUDY": "/a/study",
}


def make_venv(root: Path) -> Path:
    """A directory that looks like a virtualenv (pyvenv.cfg next to bin/); returns bin/."""
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    return root / "bin"


def host_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    venv_bin = make_venv(tmp_path / "venv")
    plain = tmp_path / "plain-bin"
    plain.mkdir()
    env = {"HOME": str(tmp_path), "LANG": "C.UTF-8",
           "PATH": os.pathsep.join([str(venv_bin), str(plain), "/usr/bin"]),
           "VIRTUAL_ENV": str(tmp_path / "venv"),
           "ANTHROPIC_BASE_URL": "https://api.anthropic.com",
           "CLAUDE_CONFIG_DIR": str(tmp_path / "cfg"),
           **CREDENTIALS, **DROPPED}
    return env, venv_bin


# ---- the pure functions ---------------------------------------------------------------------------

def test_scrub_drops_the_documented_variables(tmp_path):
    host, venv_bin = host_env(tmp_path)
    snapshot = dict(host)
    env, report = ab.scrub_env(host, for_claude=True)
    assert host == snapshot, "the host mapping must not be modified"
    for key in list(DROPPED) + ["VIRTUAL_ENV"]:
        assert key not in env, key
        assert key in report["dropped"], key
    assert report["dropped"] == sorted(report["dropped"])
    # The venv's bin/ leaves PATH; everything else on PATH stays, in order.
    assert str(venv_bin) in report["dropped_path_entries"]
    assert env["PATH"].split(os.pathsep) == [str(tmp_path / "plain-bin"), "/usr/bin"]
    # Variables agentbench knows and passes deliberately survive.
    assert env["ANTHROPIC_BASE_URL"] == "https://api.anthropic.com"
    assert env["CLAUDE_CONFIG_DIR"] == str(tmp_path / "cfg")
    assert env["HOME"] == str(tmp_path) and env["LANG"] == "C.UTF-8"


def test_venv_path_entries_are_found_without_virtual_env(tmp_path):
    """A venv's bin/ on PATH is recognised by its pyvenv.cfg even when VIRTUAL_ENV is unset."""
    venv_bin = make_venv(tmp_path / "other-venv")
    nested = make_venv(tmp_path / "active") / "nested"
    nested.mkdir()
    host = {"PATH": os.pathsep.join(["/usr/bin", str(venv_bin), str(nested), "/bin"]),
            "VIRTUAL_ENV": str(tmp_path / "active")}
    env, report = ab.scrub_env(host, for_claude=False)
    assert env["PATH"].split(os.pathsep) == ["/usr/bin", "/bin"]
    assert sorted(report["dropped_path_entries"]) == sorted([str(venv_bin), str(nested)])


def test_scrub_pins_the_child_marker_and_the_updater(tmp_path):
    host = {"PATH": "/usr/bin", "DISABLE_AUTOUPDATER": "0", "AGENTBENCH_CHILD": "0"}
    for for_claude in (True, False):
        env, report = ab.scrub_env(host, for_claude=for_claude, binary="/opt/claude")
        assert env["DISABLE_AUTOUPDATER"] == "1"
        assert env["AGENTBENCH_CHILD"] == "1"
        assert env["AGENTBENCH_CLAUDE_BIN"] == "/opt/claude"
        assert {"DISABLE_AUTOUPDATER", "AGENTBENCH_CHILD"} <= set(report["pinned"])


def test_extra_cannot_unpin_the_child_marker():
    """A study's own `env` (applied as `extra`) may add variables but not lift the pins:
    without the marker an agent under test could launch or kill sessions."""
    env, _ = ab.scrub_env({"PATH": "/usr/bin"}, for_claude=True,
                          extra={"AGENTBENCH_CHILD": "0", "DISABLE_AUTOUPDATER": "0",
                                 "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"})
    assert env["AGENTBENCH_CHILD"] == "1" and env["DISABLE_AUTOUPDATER"] == "1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"


def test_unknown_claude_and_anthropic_variables_are_reported(tmp_path):
    host = {"PATH": "/usr/bin", "CLAUDE_SOMETHING_NEW": "x", "ANTHROPIC_FUTURE_FLAG": "y",
            "ANTHROPIC_BASE_URL": "https://api.anthropic.com", "CLAUDE_CONFIG_DIR": "/c",
            "ANTHROPIC_API_KEY": SECRET, "CLAUDECODE": "1", "UNRELATED": "z"}
    env, report = ab.scrub_env(host, for_claude=True)
    assert report["unknown_claude_vars"] == ["ANTHROPIC_FUTURE_FLAG", "CLAUDE_SOMETHING_NEW"]
    # Reported, not silently dropped (the user decides); credentials and known names are not "unknown".
    assert env["CLAUDE_SOMETHING_NEW"] == "x" and env["UNRELATED"] == "z"


def test_credentials_pass_only_to_claude(tmp_path):
    host, _ = host_env(tmp_path)
    claude_env, claude_report = ab.scrub_env(host, for_claude=True)
    check_env, check_report = ab.scrub_env(host, for_claude=False)
    for key, value in CREDENTIALS.items():
        assert claude_env[key] == value, key
        assert key not in check_env, key
    assert claude_report["credentials_passed"] is True and check_report["credentials_passed"] is False
    assert sorted(CREDENTIALS) == [k for k in claude_report["credentials"] if k in CREDENTIALS]
    assert not any(SECRET in v for v in check_env.values())
    # The report names variables, never their values.
    assert SECRET not in json.dumps(claude_report) and SECRET not in json.dumps(check_report)


def test_check_env_has_no_credentials(tmp_path):
    host, _ = host_env(tmp_path)
    host["AGENTBENCH_CLAUDE_BIN"] = "/opt/claude"
    env, report = ab.check_env(host)
    assert not [k for k in env if ab.is_credential_var(k)]
    assert not any(SECRET in v for v in env.values())
    assert "AGENTBENCH_CLAUDE_BIN" not in env
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["AGENTBENCH_CHILD"] == "1"
    assert report["credentials_passed"] is False


@pytest.mark.parametrize("name, is_cred", [
    ("ANTHROPIC_API_KEY", True), ("OPENAI_API_KEY", True), ("GITHUB_TOKEN", True),
    ("SOME_SECRET", True), ("AWS_SECRET_ACCESS_KEY", True), ("PGPASSWORD", False),
    ("DB_PASSWORD", True), ("PATH", False), ("ANTHROPIC_BASE_URL", False), ("TOKENIZERS_PARALLELISM", False),
    ("ANTHROPIC_CUSTOM_HEADERS", True),   # can carry an auth header: claude only, never a check
])
def test_is_credential_var(name, is_cred):
    assert ab.is_credential_var(name) is is_cred


def test_where_reports_the_scrub_without_values(tmp_path, fake_env):
    env = dict(fake_env, ANTHROPIC_API_KEY=SECRET, CLAUDE_SOMETHING_NEW="1", CLAUDECODE="1",
               ANTHROPIC_BASE_URL="http://127.0.0.1:1")
    code, obj = run_main(["where"], env=env)
    assert code == 0
    scrub = obj["env_scrub"]
    assert "CLAUDE_SOMETHING_NEW" in scrub["unknown_claude_vars"]
    assert "CLAUDECODE" in scrub["dropped"]
    assert "ANTHROPIC_API_KEY" in scrub["credentials"]
    assert "VIRTUAL_ENV" in scrub["drop_exact"] and "UV_" in scrub["drop_prefixes"]
    assert scrub["pinned_values"]["DISABLE_AUTOUPDATER"] == "1"
    assert any("CLAUDE_SOMETHING_NEW" in w for w in obj["warnings"])
    assert any("ANTHROPIC_BASE_URL" in w for w in obj["warnings"])
    assert SECRET not in json.dumps(obj)
    # What claude itself would get: its gateway's URL and token, the key withheld.
    ce = obj["claude_env"]
    assert ce["gateway"] == "on" and "ANTHROPIC_API_KEY" in ce["credentials_withheld"]
    assert "ANTHROPIC_BASE_URL" in ce["passed"] and "CLAUDE_SOMETHING_NEW" in ce["withheld"]


# ---- end to end: what the fake claude saw ----------------------------------------------------------

def study_env(study: Path, env: dict) -> None:
    """Give the study its own `env` (the one way, besides the allow-list, a variable reaches claude)."""
    cfg = json.loads((study / "study.json").read_text())
    cfg["env"] = env
    (study / "study.json").write_text(json.dumps(cfg))


def test_claude_child_sees_the_scrubbed_environment(study, tmp_path, monkeypatch):
    log = tmp_path / "fake-claude.log"
    venv_bin = make_venv(tmp_path / "venv")
    study_env(study, {"FAKE_CLAUDE_LOG": str(log)})
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    monkeypatch.setenv("SOME_UNRELATED_SETTING", "x")
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / "venv"))
    monkeypatch.setenv("PATH", str(venv_bin) + os.pathsep + os.environ["PATH"])
    for key, value in DROPPED.items():
        if key not in ("PYTHONPATH", "AGENTBENCH_STUDY"):   # the test process itself needs neither
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("DISABLE_AUTOUPDATER", "0")
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "FAKE: text=ok\n")])
    assert code == 0, out
    res = wait_result(study, out["job_id"])
    assert res["status"] == "ok", res
    entries = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    calls = [e for e in entries if "--version" not in e["argv"]]
    assert len(calls) == 1
    seen = calls[0]["env"]
    names = set(calls[0]["env_names"])
    assert seen["AGENTBENCH_CHILD"] == "1"
    assert seen["DISABLE_AUTOUPDATER"] == "1"
    assert seen["ANTHROPIC_API_KEY"] is True          # present: the job's gateway token, not SECRET
    assert seen["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")   # its gateway
    assert "SOME_UNRELATED_SETTING" not in names       # an allow-list, not a drop-list
    assert seen["VIRTUAL_ENV"] is None and seen["CLAUDECODE"] is None
    assert str(venv_bin) not in seen["PATH"].split(os.pathsep)
    for key in DROPPED:
        assert key not in names, key


def test_offline_jobs_get_no_real_credentials(study, tmp_path, monkeypatch):
    """A job marked offline (rehearsal against the scripted model) gets only its own dummy key."""
    log = tmp_path / "fake-claude.log"
    study_env(study, {"AGENTBENCH_OFFLINE": "1", "FAKE_CLAUDE_LOG": str(log)})
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    monkeypatch.setenv("CLAUDE_CODE_OAUTH_TOKEN", SECRET)
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "FAKE: text=ok\n")])
    assert code == 0, out
    assert wait_result(study, out["job_id"])["status"] == "ok"
    call = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()][-1]
    assert call["env"]["ANTHROPIC_API_KEY"] is True    # the gateway's job token only
    assert call["env"]["ANTHROPIC_BASE_URL"].startswith("http://127.0.0.1:")
    assert "CLAUDE_CODE_OAUTH_TOKEN" not in call["env_names"]
    assert call["env"]["AGENTBENCH_CHILD"] == "1"


# ---- end to end: what a check command saw -----------------------------------------------------------

SHOW_ENV = '''import json, os, sys
dump = {"env": dict(os.environ), "cwd": os.getcwd()}
if len(sys.argv) > 1:
    with open(sys.argv[1], "a") as fh:
        fh.write(json.dumps(dump) + "\\n")
print(json.dumps(dump))
print(json.dumps({"passed": True, "score": 1.0, "checks": []}))
'''


def make_env_task(tasks_root: Path, dump_file: Path | None = None) -> Path:
    """A task bundle whose gate and oracle print (and optionally append to a file) their env."""
    root = tasks_root / "envtask"
    for sub in ("public", "gate", "oracle", "reference"):
        (root / sub).mkdir(parents=True)
    (root / "public" / "TASK.md").write_text("Nothing to do.\n")
    (root / "reference" / "DONE.md").write_text("done\n")
    (root / "gate" / "show_env.py").write_text(SHOW_ENV)
    (root / "oracle" / "show_env.py").write_text(SHOW_ENV)
    extra = [str(dump_file)] if dump_file else []
    (root / "task.json").write_text(json.dumps({
        "id": "envtask", "title": "env",
        "gate": {"cmd": ["{python}", "{gate}/show_env.py", *extra], "timeout_s": 60},
        "oracle": {"cmd": ["{python}", "{oracle}/show_env.py", *extra], "timeout_s": 60, "threshold": 1.0}}))
    return root


@pytest.mark.parametrize("which", ["gate", "oracle"])
def test_check_commands_never_see_credentials(tmp_path, which):
    task = ab.load_task(make_env_task(tmp_path / "tasks"))
    paths = ab.StudyPaths(tmp_path / "study")
    ws = tmp_path / "ws"
    ws.mkdir()
    host, _ = host_env(tmp_path)
    host["PATH"] = os.environ["PATH"]
    rec = ab.run_check(paths, PLAT, task, which, str(ws), host)
    assert rec["passed"] is True and rec["receipt"] == "json", rec
    dump = json.loads(rec["stdout_tail"].splitlines()[0])
    seen = dump["env"]
    for key in CREDENTIALS:
        assert key not in seen, key
    assert not any(SECRET in v for v in seen.values())
    assert "AGENTBENCH_CLAUDE_BIN" not in seen
    assert seen.get("AGENTBENCH_CHILD") == "1"
    for key in DROPPED:
        assert key not in seen, key
    if which == "gate":
        assert Path(dump["cwd"]).resolve() == ws.resolve()
    else:   # the oracle runs on a throw-away copy, never in the workspace itself
        assert Path(dump["cwd"]).resolve() != ws.resolve()


def test_calibrate_runs_checks_without_credentials(tmp_path, fake_env):
    """Through the CLI: `calibrate` runs gate and oracle with the caller's environment scrubbed."""
    dump_file = tmp_path / "check-env.jsonl"
    root = tmp_path / "study"
    assert run_main(["init", "--study", str(root), "--tasks", "tasks"])[0] == 0
    make_env_task(root / "tasks", dump_file)
    cfg = json.loads((root / "study.json").read_text())
    cfg["arms"] = {"A": {}}
    (root / "study.json").write_text(json.dumps(cfg))
    env = dict(fake_env, **CREDENTIALS)
    code, obj = run_main(["calibrate", "--study", str(root)], env=env)
    # the task exists to dump its environment, not to pass: calibrate ran its checks either way
    assert code == 0 or obj["code"] == "calibration_failed", obj
    dumps = [json.loads(ln) for ln in dump_file.read_text().splitlines() if ln.strip()]
    assert len(dumps) >= 3                             # starter oracle + reference gate/oracle runs
    for d in dumps:
        assert not [k for k in d["env"] if k in CREDENTIALS]
        assert not any(SECRET in v for v in d["env"].values())


# ---- claude's own environment: an allow-list ----------------------------------------------------------

GATEWAY_VARS = {"ANTHROPIC_BASE_URL": "http://127.0.0.1:9", "ANTHROPIC_API_KEY": "abgw-job-token"}


def test_claude_env_with_the_gateway_passes_only_the_allow_list(tmp_path):
    host, venv_bin = host_env(tmp_path)
    host["SOME_TOOL_SETTING"] = "1"
    env, report = ab.claude_env(host, extra={"STUDY_VAR": "s", "ANTHROPIC_AUTH_TOKEN": SECRET},
                                gateway=GATEWAY_VARS, binary="/bin/claude")
    assert SECRET not in json.dumps(env)
    assert env["ANTHROPIC_API_KEY"] == "abgw-job-token" and env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    for key in ("ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN", "GH_TOKEN", "AWS_SECRET_ACCESS_KEY",
                "SOME_TOOL_SETTING", "VIRTUAL_ENV", *DROPPED):
        assert key not in env, key
    assert env["STUDY_VAR"] == "s" and env["HOME"] == str(tmp_path) and env["LANG"] == "C.UTF-8"
    assert str(venv_bin) not in env["PATH"].split(os.pathsep)
    assert env["AGENTBENCH_CHILD"] == "1" and env["AGENTBENCH_CLAUDE_BIN"] == "/bin/claude"
    assert {"ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "GH_TOKEN"} <= set(report["credentials_withheld"])
    assert "SOME_TOOL_SETTING" in report["withheld"] and "HOME" in report["passed"]
    assert report["gateway"] == "on"


def test_claude_env_without_the_gateway_passes_the_credentials(tmp_path):
    host, _ = host_env(tmp_path)
    creds = {k: host.pop(k) for k in CREDENTIALS}
    host["CLAUDE_CODE_USE_BEDROCK"] = "1"
    host["AWS_REGION"] = "eu-west-1"
    env, report = ab.claude_env(host, extra=None, gateway=None, secret=creds)
    assert env["ANTHROPIC_API_KEY"] == SECRET and env["GH_TOKEN"] == SECRET + "-gh"
    assert env["CLAUDE_CODE_USE_BEDROCK"] == "1" and env["AWS_REGION"] == "eu-west-1"
    assert "ANTHROPIC_MODEL" not in env and "CLAUDECODE" not in env
    assert report["gateway"] == "off" and report["credentials_withheld"] == []


def test_gateway_refusal_without_a_credential_names_the_fix():
    err = ab.gateway_refusal({"CLAUDE_CODE_USE_BEDROCK": "0"}, "on")
    assert err is not None and err.payload["code"] == "no_credential" and err.payload["credentials"] == []
    assert "ANTHROPIC_API_KEY" in err.payload["hint"]
    assert ab.gateway_refusal({}, "off") is None


@pytest.mark.parametrize("env, mode, refused", [
    ({"ANTHROPIC_API_KEY": "k"}, "on", None),
    ({"CLAUDE_CODE_USE_BEDROCK": "1", "ANTHROPIC_API_KEY": "k"}, "on", "CLAUDE_CODE_USE_BEDROCK"),
    ({"CLAUDE_CODE_USE_VERTEX": "true"}, "on", "CLAUDE_CODE_USE_VERTEX"),
    ({"CLAUDE_CODE_USE_BEDROCK": "0", "ANTHROPIC_API_KEY": "k"}, "on", None),
    ({"CLAUDE_CODE_OAUTH_TOKEN": "t"}, "on", "CLAUDE_CODE_OAUTH_TOKEN"),
    ({"CLAUDE_CODE_OAUTH_TOKEN": "t", "ANTHROPIC_AUTH_TOKEN": "b"}, "on", None),
    ({"CLAUDE_CODE_USE_BEDROCK": "1", "CLAUDE_CODE_OAUTH_TOKEN": "t"}, "off", None),
])
def test_gateway_refusal(env, mode, refused):
    err = ab.gateway_refusal(env, mode)
    if refused is None:
        assert err is None
    else:
        assert err is not None and err.payload["variable"] == refused and '"gateway": "off"' in err.payload["hint"]


def test_a_bedrock_study_is_refused_at_launch_unless_the_gateway_is_off(study, tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTBENCH_OFFLINE", raising=False)   # a host that reaches a real API
    monkeypatch.setenv("CLAUDE_CODE_USE_BEDROCK", "1")
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "FAKE: text=ok\n")])
    assert code == 2 and out["refusal"] == "gateway" and "hint" in out, out
    assert not (study / "state" / "jobs").exists() or not list((study / "state" / "jobs").iterdir())
    study_env(study, {})
    cfg = json.loads((study / "study.json").read_text())
    cfg["gateway"] = "off"
    (study / "study.json").write_text(json.dumps(cfg))
    code, out = run_main(["spawn", "--study", str(study), "--brief", write_brief(tmp_path, "FAKE: text=ok\n")])
    assert code == 0, out
    assert wait_result(study, out["job_id"])["status"] == "ok"


def test_a_bad_gateway_setting_is_refused(study):
    cfg = json.loads((study / "study.json").read_text())
    cfg["gateway"] = "maybe"
    (study / "study.json").write_text(json.dumps(cfg))
    code, out = run_main(["where", "--study", str(study)])
    assert any("gateway" in w for w in out["warnings"]), out
    with pytest.raises(ab.AgentbenchError, match="gateway"):
        ab.check_study_shape(cfg)
