"""Tests of the fake `claude` executable (tests/fake_claude.py), run as a subprocess.

The supervisor tests trust this fake to behave like the real binary in the ways that matter
(stream shape, cumulative totals across resume and fork, transcripts, exit codes, failure modes),
so its own behaviour is pinned here.  Nothing waits on a clock: the one long-lived case (`hang`)
is read until its first line and then killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

FAKE = Path(__file__).resolve().parent / "fake_claude.py"
BASE_ARGS = ["-p", "--output-format", "stream-json", "--verbose", "--model", "claude-opus-4-5",
             "--permission-mode", "dontAsk", "--tools", "Bash,Read,Edit",
             "--allowedTools", "Bash,Read,Edit", "--strict-mcp-config",
             "--mcp-config", '{"mcpServers": {}}']


class Call:
    """One finished invocation of the fake: exit code, stdout lines, parsed events, stderr."""

    def __init__(self, proc: subprocess.CompletedProcess[bytes]):
        self.code = proc.returncode
        self.stdout = proc.stdout.decode("utf-8")
        self.stderr = proc.stderr.decode("utf-8")
        self.lines = [ln for ln in self.stdout.split("\n") if ln]
        self.events: list[dict[str, Any]] = []
        for ln in self.lines:
            try:
                self.events.append(json.loads(ln))
            except ValueError:
                pass

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == kind]

    @property
    def result(self) -> dict[str, Any]:
        return self.of_type("result")[-1]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = dict(os.environ)
    e["CLAUDE_CONFIG_DIR"] = str(tmp_path / "config")
    for k in ("FAKE_CLAUDE_LOG", "ANTHROPIC_API_KEY"):
        e.pop(k, None)
    return e


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    d = tmp_path / "work space.v1"  # non-alphanumerics, to check the transcript dir munging
    d.mkdir()
    return d


def fake_argv(*args: str) -> list[str]:
    # -S: the fake is standard-library only, and skipping site-packages start-up hooks keeps
    # the ~60 invocations of this file quick.  One test runs it through its shebang instead.
    return [sys.executable, "-S", str(FAKE), *args]


def run(env: dict[str, str], cwd: Path, prompt: str, *args: str, base: bool = True) -> Call:
    argv = fake_argv(*(BASE_ARGS if base else []), *args)
    proc = subprocess.run(argv, input=prompt.encode("utf-8"), capture_output=True, env=env,
                          cwd=str(cwd), timeout=60)
    return Call(proc)


def transcript(env: dict[str, str], cwd: Path, session_id: str) -> Path:
    munged = re.sub(r"[^A-Za-z0-9]", "-", str(cwd))
    return Path(env["CLAUDE_CONFIG_DIR"]) / "projects" / munged / f"{session_id}.jsonl"


def new_id() -> str:
    return str(uuid.uuid4())


# --------------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.name != "posix", reason="runs the file through its shebang")
def test_version_runs_as_an_executable(env: dict[str, str], ws: Path) -> None:
    assert os.access(FAKE, os.X_OK)
    assert FAKE.read_text(encoding="utf-8").startswith("#!/usr/bin/env python3\n")
    proc = subprocess.run([str(FAKE), "--version"], capture_output=True, env=env, cwd=str(ws),
                          timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.decode() == "0.0.0-fake (Claude Code)\n"


def test_unknown_flag_exits_1(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "hi", "--no-such-flag")
    assert call.code == 1
    assert "unknown option '--no-such-flag'" in call.stderr
    assert call.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["-p", "--output-format", "stream-json"], "requires --verbose"),
    (["-p", "--verbose"], "stream-json"),
    (["-p", "--output-format", "xml", "--verbose"], "Allowed choices"),
    (["--output-format", "stream-json", "--verbose"], "--print"),
])
def test_launch_mode_is_checked(env: dict[str, str], ws: Path, args: list[str],
                                message: str) -> None:
    call = run(env, ws, "hi", *args, base=False)
    assert call.code == 1
    assert message in call.stderr
    assert call.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--session-id", "not-a-uuid"], "Invalid session ID"),
    (["--append-system-prompt-file", "missing.md"], "Append system prompt file not found"),
    (["--mcp-config", "missing.json"], "MCP config file not found"),
    (["--max-turns", "many"], "must be a number"),
    (["--max-budget-usd", "0"], "greater than 0"),
    (["--model"], "argument missing"),
])
def test_bad_flag_values_exit_1(env: dict[str, str], ws: Path, args: list[str],
                                message: str) -> None:
    call = run(env, ws, "hi", *args)
    assert call.code == 1
    assert message in call.stderr


def test_flags_with_files_and_equals_form(env: dict[str, str], ws: Path, tmp_path: Path) -> None:
    sp = tmp_path / "system.md"
    sp.write_text("be brief", encoding="utf-8")
    mcp = tmp_path / "mcp.json"
    mcp.write_text('{"mcpServers": {}}', encoding="utf-8")
    call = run(env, ws, "hi", f"--append-system-prompt-file={sp}", "--mcp-config", str(mcp),
               "--effort", "high", "--max-turns", "5", "--max-budget-usd", "2.5")
    assert call.code == 0, call.stderr
    assert call.result["subtype"] == "success"


# --------------------------------------------------------------------------------------------------
# The stream
# --------------------------------------------------------------------------------------------------

def test_plain_call_stream_and_transcript(env: dict[str, str], ws: Path) -> None:
    sid = new_id()
    call = run(env, ws, "say hi\n", "--session-id", sid)
    assert call.code == 0, call.stderr
    assert len(call.events) == len(call.lines)  # every line is one JSON object
    init, last = call.events[0], call.events[-1]
    assert (init["type"], init["subtype"]) == ("system", "init")
    assert init["session_id"] == sid
    assert init["cwd"] == str(ws)
    assert init["tools"] == ["Bash", "Read", "Edit"]
    assert init["permissionMode"] == "dontAsk"
    assert init["model"] == "claude-opus-4-5"
    assert init["apiKeySource"] == "none"
    for key in ("plugins", "agents", "skills", "mcp_servers", "slash_commands"):
        assert init[key] == []
    assistant = call.of_type("assistant")
    assert len(assistant) == 1
    msg = assistant[0]["message"]
    assert msg["model"] == "claude-opus-4-5"
    assert msg["content"] == [{"type": "text", "text": "Done."}]
    assert last["type"] == "result"
    assert last["subtype"] == "success" and last["is_error"] is False
    assert last["result"] == "Done."
    assert last["session_id"] == sid
    assert last["total_cost_usd"] == pytest.approx(0.01)
    assert last["num_turns"] == 1
    assert last["terminal_reason"] == "completed"
    assert last["usage"]["input_tokens"] == msg["usage"]["input_tokens"]
    assert set(last["modelUsage"]) == {"claude-opus-4-5"}
    path = transcript(env, ws, sid)
    assert path.is_file()
    assert re.fullmatch(r"[A-Za-z0-9-]+", path.parent.name) and "work-space-v1" in path.parent.name
    lines = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()]
    assert [ln["type"] for ln in lines] == ["user", "assistant", "cost-state"]
    assert lines[0]["message"]["content"] == "say hi\n"
    assert lines[-1]["totalCostUSD"] == pytest.approx(0.01)


def test_tool_uses_split_and_tokens(env: dict[str, str], ws: Path) -> None:
    prompt = ("do it\nFAKE: tool_uses=2\nFAKE: split\nFAKE: tokens=300,90,60,3000\nFAKE: cc1h=15\n"
              "FAKE: cost=0.3\n")
    call = run(env, ws, prompt)
    assert call.code == 0, call.stderr
    assistant = call.of_type("assistant")
    ids = [e["message"]["id"] for e in assistant]
    assert len(assistant) == 9 and len(set(ids)) == 3  # 3 API responses, 3 events each
    assert all(len(e["message"]["content"]) == 1 for e in assistant)
    tool_uses = [b for e in assistant for b in e["message"]["content"] if b["type"] == "tool_use"]
    results = [b for e in call.of_type("user") for b in e["message"]["content"]]
    assert [t["input"]["command"] for t in tool_uses] == ["echo 0", "echo 1"]
    assert [r["tool_use_id"] for r in results] == [t["id"] for t in tool_uses]
    # Each tool_result follows its tool_use.
    order = [e["type"] for e in call.events[1:-1]]
    assert order == ["assistant"] * 3 + ["user"] + ["assistant"] * 3 + ["user"] + ["assistant"] * 3
    usage = call.result["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["cache_creation_input_tokens"],
            usage["cache_read_input_tokens"]) == (300, 90, 60, 3000)
    assert usage["cache_creation"] == {"ephemeral_1h_input_tokens": 15,
                                       "ephemeral_5m_input_tokens": 45}
    # Counting each message once gives the input side exactly; output is only an early snapshot.
    first_of_each = {e["message"]["id"]: e["message"]["usage"] for e in reversed(assistant)}
    assert sum(u["input_tokens"] for u in first_of_each.values()) == 300
    assert sum(u["cache_read_input_tokens"] for u in first_of_each.values()) == 3000
    assert sum(u["output_tokens"] for u in first_of_each.values()) < 90
    assert call.result["num_turns"] == 3
    assert call.result["total_cost_usd"] == pytest.approx(0.3)


# --------------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------------

def test_cumulative_totals_across_resume_and_fork(env: dict[str, str], ws: Path) -> None:
    base = new_id()
    first = run(env, ws, "FAKE: cost=0.25\nFAKE: tokens=10,20,30,40\n", "--session-id", base)
    assert first.result["total_cost_usd"] == pytest.approx(0.25)

    resumed = run(env, ws, "FAKE: cost=0.5\nFAKE: tokens=1,2,3,4\n", "--resume", base)
    assert resumed.code == 0, resumed.stderr
    res = resumed.result
    assert res["session_id"] == base
    assert res["total_cost_usd"] == pytest.approx(0.75)  # cumulative, like the real binary
    assert res["usage"]["input_tokens"] == 1  # per call
    assert res["modelUsage"]["claude-opus-4-5"]["inputTokens"] == 11  # cumulative
    assert res["model_usage_since_last_result"]["claude-opus-4-5"]["costUSD"] == pytest.approx(0.5)

    base_text = transcript(env, ws, base).read_text(encoding="utf-8")
    fork = new_id()
    forked = run(env, ws, "FAKE: cost=0.1\n", "--resume", base, "--fork-session",
                 "--session-id", fork)
    assert forked.code == 0, forked.stderr
    assert {e["session_id"] for e in forked.events} == {fork}
    assert forked.result["total_cost_usd"] == pytest.approx(0.85)
    assert transcript(env, ws, base).read_text(encoding="utf-8") == base_text  # base untouched
    assert transcript(env, ws, fork).is_file()

    again = run(env, ws, "FAKE: cost=0.05\n", "--resume", fork)
    assert again.result["total_cost_usd"] == pytest.approx(0.9)
    assert run(env, ws, "FAKE: cost=0.01\n", "--resume", base).result["total_cost_usd"] == \
        pytest.approx(0.76)


def test_fork_without_session_id_gets_a_new_id(env: dict[str, str], ws: Path) -> None:
    base = new_id()
    run(env, ws, "hi", "--session-id", base)
    forked = run(env, ws, "hi", "--resume", base, "--fork-session")
    sid = forked.result["session_id"]
    assert sid != base and transcript(env, ws, sid).is_file()


def test_resume_unknown_session(env: dict[str, str], ws: Path) -> None:
    sid = new_id()
    call = run(env, ws, "hi", "--resume", sid)
    assert call.code == 1
    assert len(call.events) == 1  # no init before it
    res = call.result
    assert res["subtype"] == "error_during_execution" and res["is_error"] is True
    assert res["num_turns"] == 0 and res["total_cost_usd"] == 0
    assert f"No conversation found with session ID: {sid}" in call.stderr


def test_session_id_rules(env: dict[str, str], ws: Path) -> None:
    sid = new_id()
    assert run(env, ws, "hi", "--session-id", sid).code == 0
    reuse = run(env, ws, "hi", "--session-id", sid)
    assert reuse.code == 1 and "already in use" in reuse.stderr and reuse.stdout == ""
    both = run(env, ws, "hi", "--resume", sid, "--session-id", new_id())
    assert both.code == 1 and "--fork-session" in both.stderr


def test_crash_saves_no_totals(env: dict[str, str], ws: Path) -> None:
    sid = new_id()
    run(env, ws, "FAKE: cost=0.2\n", "--session-id", sid)
    crashed = run(env, ws, "FAKE: crash\nFAKE: cost=5\n", "--resume", sid)
    assert crashed.code == 3
    assert [e["type"] for e in crashed.events] == ["system", "assistant"]
    assert crashed.of_type("result") == []
    after = run(env, ws, "FAKE: cost=0.1\n", "--resume", sid)
    assert after.result["total_cost_usd"] == pytest.approx(0.3)


# --------------------------------------------------------------------------------------------------
# Limits and errors
# --------------------------------------------------------------------------------------------------

def test_max_turns(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: tool_uses=5\n", "--max-turns", "2")
    assert call.code == 1
    res = call.result
    assert res["subtype"] == "error_max_turns" and res["is_error"] is True
    assert res["num_turns"] == 3 and res["terminal_reason"] == "max_turns"
    assert res["errors"] == ["Reached maximum number of turns (2)"]
    assert "result" not in res
    assert len(call.of_type("user")) == 2


def test_max_budget_counts_only_this_call(env: dict[str, str], ws: Path) -> None:
    sid = new_id()
    call = run(env, ws, "FAKE: tool_uses=5\nFAKE: cost=1\n", "--session-id", sid,
               "--max-budget-usd", "0.3")
    assert call.code == 1
    res = call.result
    assert res["subtype"] == "error_max_budget_usd" and res["terminal_reason"] == "budget_exhausted"
    assert res["errors"] == ["Reached maximum budget ($0.3)"]
    assert res["total_cost_usd"] >= 0.3  # the overshooting real spend
    # The stop comes right after a response, before its tool runs.
    assert call.events[-2]["type"] == "assistant"
    # A resumed call is measured against its own spend, not the restored total.
    cheap = run(env, ws, "FAKE: cost=0.01\n", "--resume", sid, "--max-budget-usd", "0.3")
    assert cheap.code == 0 and cheap.result["subtype"] == "success"
    forced = run(env, ws, "FAKE: budget_exceed\n", "--resume", sid)
    assert forced.code == 1 and forced.result["subtype"] == "error_max_budget_usd"


@pytest.mark.parametrize("kind, status, reason", [
    ("429", 429, "api_error"), ("529", 529, "api_error"), ("500", 500, "api_error"),
    ("prompt_too_long", 400, "prompt_too_long"), ("auth", 401, "api_error"),
])
def test_api_errors(env: dict[str, str], ws: Path, kind: str, status: int, reason: str) -> None:
    call = run(env, ws, f"FAKE: api_error={kind}\n")
    assert call.code == 1
    assert [e["type"] for e in call.events] == ["system", "assistant", "result"]
    msg = call.of_type("assistant")[0]
    assert msg["message"]["model"] == "<synthetic>" and msg["is_api_error_message"] is True
    assert msg["message"]["usage"]["output_tokens"] == 0
    res = call.result
    assert res["subtype"] == "success" and res["is_error"] is True
    assert res["api_error_status"] == status and res["terminal_reason"] == reason
    assert res["result"] == msg["message"]["content"][0]["text"]
    assert msg["api_error_status"] == status and msg["api_error_type"] == res["api_error_type"]
    assert res["total_cost_usd"] == 0


def test_is_error_with_exit_0(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: is_error_exit0\n")
    assert call.code == 0
    assert call.result["subtype"] == "success" and call.result["is_error"] is True
    assert run(env, ws, "FAKE: api_error=429\nFAKE: is_error_exit0\n").code == 0


def test_exit_code_and_turns_directives(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: exit=5\nFAKE: turns=7\n")
    assert call.code == 5
    assert call.result["subtype"] == "success" and call.result["is_error"] is False
    assert call.result["num_turns"] == 7


def test_sleep_delay_and_text(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: sleep=0.05\nFAKE: tool_delay=0.05\nFAKE: tool_uses=1\n"
                        "FAKE: text=All green.\n")
    assert call.code == 0
    assert call.result["result"] == "All green."
    assert len(call.of_type("user")) == 1


def test_permission_denial(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: deny=rm -rf build\nFAKE: tool_uses=1\n")
    assert call.code == 0 and call.result["subtype"] == "success"
    first = call.of_type("user")[0]["message"]["content"][0]
    assert first["is_error"] is True and "denied" in first["content"]
    assert call.result["permission_denials"] == [
        {"tool_name": "Bash", "tool_use_id": first["tool_use_id"],
         "tool_input": {"command": "rm -rf build"}}]
    assert call.result["num_turns"] == 3


def test_malformed_lines(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: malformed\n")
    assert call.code == 0
    assert len(call.lines) - len(call.events) == 2  # a non-JSON line and a truncated one
    types = [e["type"] for e in call.events]
    assert types[0] == "system" and types[-1] == "result"
    assert "fake_unknown_event" in types
    assert call.result["subtype"] == "success"


def test_double_result_last_holds_totals(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: double_result\nFAKE: tool_uses=1\nFAKE: cost=0.4\n")
    results = call.of_type("result")
    assert len(results) == 2
    assert [r["result_index"] for r in results] == [0, 1]
    assert results[0]["total_cost_usd"] < results[1]["total_cost_usd"] == pytest.approx(0.4)
    deltas = [r["model_usage_since_last_result"]["claude-opus-4-5"]["costUSD"] for r in results]
    assert sum(deltas) == pytest.approx(0.4)


def test_model_substitution_and_remap(env: dict[str, str], ws: Path) -> None:
    call = run(env, ws, "FAKE: model=claude-other-1\n")
    assert call.events[0]["model"] == "claude-opus-4-5"
    assert {e["message"]["model"] for e in call.of_type("assistant")} == {"claude-other-1"}
    # Like the real binary, modelUsage stays keyed by the requested model.
    assert set(call.result["modelUsage"]) == {"claude-opus-4-5"}
    remapped = run(env, ws, "FAKE: remap=claude-opus-5-5\n")
    assert remapped.events[0]["model"] == "claude-opus-5-5"
    assert set(remapped.result["modelUsage"]) == {"claude-opus-5-5"}


def test_bad_directive_exits_2(env: dict[str, str], ws: Path) -> None:
    assert run(env, ws, "FAKE: no_such_thing\n").code == 2
    assert run(env, ws, "FAKE: cost=cheap\n").code == 2


# --------------------------------------------------------------------------------------------------
# Side effects
# --------------------------------------------------------------------------------------------------

def test_write_stderr_and_tool(env: dict[str, str], ws: Path) -> None:
    prompt = ('FAKE: write=sub/notes.txt:line one\\nline two\nFAKE: stderr=something odd\n'
              'FAKE: tool=Read {"file_path": "/etc/hostname"}\n')
    call = run(env, ws, prompt)
    assert call.code == 0, call.stderr
    assert (ws / "sub" / "notes.txt").read_text(encoding="utf-8") == "line one\nline two"
    assert "something odd" in call.stderr
    uses = [b for e in call.of_type("assistant") for b in e["message"]["content"]
            if b["type"] == "tool_use"]
    assert uses[0]["name"] == "Read" and uses[0]["input"] == {"file_path": "/etc/hostname"}


def test_invocation_log(env: dict[str, str], ws: Path, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    env = dict(env, FAKE_CLAUDE_LOG=str(log), ANTHROPIC_API_KEY="sk-secret-value",
               AGENTBENCH_CHILD="1")
    sid = new_id()
    call = run(env, ws, "hello there\n", "--session-id", sid)
    assert call.events[0]["apiKeySource"] == "ANTHROPIC_API_KEY"
    run(env, ws, "hi", "--bogus")
    text = log.read_text(encoding="utf-8")
    assert "sk-secret-value" not in text
    recs = [json.loads(ln) for ln in text.splitlines()]
    assert len(recs) == 2
    rec = recs[0]
    assert rec["argv"][:4] == BASE_ARGS[:4] and rec["argv"][-2:] == ["--session-id", sid]
    assert rec["cwd"] == str(ws) and rec["prompt"] == "hello there\n"
    assert rec["session_id"] == sid and isinstance(rec["pid"], int)
    assert rec["env"]["ANTHROPIC_API_KEY"] is True
    assert rec["env"]["AGENTBENCH_CHILD"] == "1"
    assert "PATH" in rec["env"]
    assert "ANTHROPIC_API_KEY" in rec["env_names"] and "AGENTBENCH_CHILD" in rec["env_names"]
    assert recs[1]["argv"][-1] == "--bogus"


@pytest.mark.skipif(os.name != "posix", reason="POSIX sessions")
def test_child_survives_the_fake(env: dict[str, str], ws: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    call = run(env, ws, f"FAKE: child=60\nFAKE: child_pidfile={pidfile}\n")
    assert call.code == 0
    pid = int(pidfile.read_text(encoding="utf-8"))
    try:
        os.kill(pid, 0)  # still alive after the fake exited
        assert os.getsid(pid) == os.getsid(0)  # not detached into a session of its own
    finally:
        os.kill(pid, signal.SIGKILL)
    # Reap it if it happens to be ours; it is not (its parent was the fake), so ignore errors.
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def test_hang_prints_init_then_nothing(env: dict[str, str], ws: Path) -> None:
    proc = subprocess.Popen(fake_argv(*BASE_ARGS), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, cwd=str(ws))
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"FAKE: hang\n")
        proc.stdin.close()
        first = json.loads(proc.stdout.readline())
        assert first["type"] == "system" and first["subtype"] == "init"
        assert proc.poll() is None
    finally:
        proc.kill()
        rest = proc.stdout.read() if proc.stdout else b""
        proc.wait(timeout=30)
    assert rest == b""
