"""Tests of the offline scripted model: request→step logic in-process, the HTTP surface with a
stdlib client, and end-to-end runs of the REAL `claude` binary against it on loopback.

The binary is found via $AGENTBENCH_CLAUDE_BIN, else `claude` on PATH.  Without it the
end-to-end tests skip, except under CI (env CI set), where a missing binary is a failure.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

import agentbench as ab
from conftest import run_main

MARK = "[agentbench-script:{}]"
CALL_TIMEOUT_S = 90  # bound for every claude subprocess (killed on expiry)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _user(text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def _assistant(text: str = "x") -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _tool_result(text: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": text}]}


def _body(messages: list, *, stream: bool = True, tools: bool = True, model: str = "claude-opus-4-5") -> dict:
    body = {"model": model, "max_tokens": 100, "stream": stream,
            "system": [{"type": "text", "text": "system prompt " * 50, "cache_control": {"type": "ephemeral"}}],
            "messages": messages}
    if tools:
        body["tools"] = [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]
    return body


def _post(server: "ab.ScriptedModelServer", path: str, body: dict | bytes, timeout: float = 10):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"content-type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response, payload


def _sse_events(payload: bytes) -> list[tuple[str, str]]:
    """(event name, raw data) pairs of an SSE body."""
    events = []
    for chunk in payload.decode("utf-8", "replace").split("\n\n"):
        name, data = None, None
        for line in chunk.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
        if name or data:
            events.append((name, data))
    return events


# ---------------------------------------------------------------------------------------------
# request → step logic (pure)
# ---------------------------------------------------------------------------------------------
def test_no_marker_selects_nothing():
    assert ab.select_script_step([_user("hello")]) == (None, 0)
    assert ab.select_script_step([]) == (None, 0)


def test_step_counts_assistant_responses_after_first_marker():
    msgs = [_user("go " + MARK.format("a")), _assistant(), _tool_result("out"), _assistant(), _tool_result("o")]
    assert ab.select_script_step(msgs) == ("a", 2)
    # A resumed session: new prompt without a marker continues the same script.
    msgs += [_assistant("done"), _user("continue please")]
    assert ab.select_script_step(msgs) == ("a", 3)
    # Same marker again in a continue prompt: still counted from the FIRST occurrence.
    assert ab.select_script_step(msgs + [_assistant(), _user("again " + MARK.format("a"))]) == ("a", 4)


def test_last_marker_wins_and_fork_starts_at_step_zero():
    base = [_user(MARK.format("base")), _assistant(), _tool_result("x"), _assistant("end")]
    fork = base + [_user("fork " + MARK.format("fork"))]
    assert ab.select_script_step(fork) == ("fork", 0)
    assert ab.select_script_step(fork + [_assistant(), _tool_result("y")]) == ("fork", 1)


def test_marker_in_tool_result_or_assistant_text_is_ignored():
    msgs = [_user(MARK.format("a")), _assistant("I will print " + MARK.format("evil")),
            _tool_result("file says " + MARK.format("evil"))]
    assert ab.select_script_step(msgs) == ("a", 1)


def test_consecutive_assistant_messages_count_once():
    msgs = [_user(MARK.format("a")), _assistant("part 1"), _assistant("part 2"), _tool_result("r")]
    assert ab.select_script_step(msgs) == ("a", 1)


def test_string_content_user_message_carries_marker():
    assert ab.select_script_step([{"role": "user", "content": "x " + MARK.format("s1")}]) == ("s1", 0)


def test_validate_script_rejects_bad_shapes():
    with pytest.raises(ab.AgentbenchError):
        ab.validate_script({"steps": "nope"})
    with pytest.raises(ab.AgentbenchError):
        ab.validate_script({"steps": [{"fault": "teapot"}]})
    with pytest.raises(ab.AgentbenchError):
        ab.validate_script({"steps": [{"tool_uses": [{"input": {}}]}]})
    with pytest.raises(ab.AgentbenchError):
        ab.validate_script({"steps": [{"usage": {"input_tokens": -1}}]})
    with pytest.raises(ab.AgentbenchError):
        ab.validate_script({"steps": [{"usage": {"input_tokenz": 5}}]})
    assert ab.validate_script({"steps": [{"text": "ok"}]})["steps"][0]["text"] == "ok"


def test_add_script_refuses_path_like_ids():
    srv = ab.ScriptedModelServer()
    with pytest.raises(ab.AgentbenchError):
        srv.add_script("../x", {"steps": []})


def test_plan_side_exhausted_loop_and_unknown():
    srv = ab.ScriptedModelServer()
    srv.add_script("two", {"steps": [{"tool_uses": [{"name": "Bash", "input": {"command": "ls"}}]},
                                     {"text": "bye"}]})
    srv.add_script("loop", {"steps": [{"text": "first"},
                                      {"tool_uses": [{"name": "Bash", "input": {"command": "true"}}],
                                       "loop": True}]})
    side = srv.plan(_body([_user("no marker")]))
    assert side["kind"] == "side" and side["stop_reason"] == "end_turn"
    # A marker but no tools (e.g. a summary request quoting the prompt) is a side request too.
    assert srv.plan(_body([_user(MARK.format("two"))], tools=False))["kind"] == "side"
    first = srv.plan(_body([_user(MARK.format("two"))]))
    assert first["kind"] == "step" and first["stop_reason"] == "tool_use"
    assert first["content"][0]["type"] == "tool_use" and first["content"][0]["input"] == {"command": "ls"}
    second = srv.plan(_body([_user(MARK.format("two")), _assistant(), _tool_result("r")]))
    assert second["stop_reason"] == "end_turn" and second["content"] == [{"type": "text", "text": "bye"}]
    done = srv.plan(_body([_user(MARK.format("two"))] + [_assistant(), _tool_result("r")] * 2))
    assert done["kind"] == "exhausted" and done["stop_reason"] == "end_turn"
    deep = srv.plan(_body([_user(MARK.format("loop"))] + [_assistant(), _tool_result("r")] * 7))
    assert deep["kind"] == "step" and deep["stop_reason"] == "tool_use"
    assert srv.plan(_body([_user(MARK.format("nosuch"))]))["kind"] == "unknown_script"


def test_fault_times_limits_fault_to_first_attempts():
    srv = ab.ScriptedModelServer()
    srv.add_script("f", {"steps": [{"fault": "429", "fault_times": 2, "text": "ok"}]})
    body = _body([_user(MARK.format("f"))])
    faults = [srv.plan(body, session="s1")["fault"] for _ in range(3)]
    assert faults == ["429", "429", None]
    # Another session has its own attempt counter.
    assert srv.plan(body, session="s2")["fault"] == "429"
    srv.add_script("always", {"steps": [{"fault": "529"}]})
    always = _body([_user(MARK.format("always"))])
    assert all(srv.plan(always, session="s1")["fault"] == "529" for _ in range(4))


def test_usage_cache_model_reads_previous_prefix():
    srv = ab.ScriptedModelServer()
    srv.add_script("a", {"steps": [{"text": "one"}, {"text": "two"}]})
    first_body = _body([_user(MARK.format("a") + " task " * 40)])
    first = srv.usage_for(first_body, srv.plan(first_body))
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] > 0
    # The next request repeats the prefix (the client moves the cache_control marker forward).
    msgs = [{"role": "user", "content": [{"type": "text", "text": MARK.format("a") + " task " * 40}]},
            _assistant("one"), {"role": "user", "content": [{"type": "text", "text": "more",
                                                             "cache_control": {"type": "ephemeral"}}]}]
    second_body = _body(msgs)
    second = srv.usage_for(second_body, srv.plan(second_body))
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"]
    assert second["cache_creation_input_tokens"] < first["cache_creation_input_tokens"]
    split = second["cache_creation"]
    assert split["ephemeral_5m_input_tokens"] + split["ephemeral_1h_input_tokens"] == \
        second["cache_creation_input_tokens"]


def test_usage_one_hour_ttl_goes_to_1h_split():
    srv = ab.ScriptedModelServer()
    body = _body([{"role": "user", "content": [{"type": "text", "text": "x" * 400,
                                                "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    usage = srv.usage_for(body, srv.plan(body))
    assert usage["cache_creation"]["ephemeral_1h_input_tokens"] == usage["cache_creation_input_tokens"] > 0
    assert usage["cache_creation"]["ephemeral_5m_input_tokens"] == 0


def test_prompt_cache_entries_expire_their_ttl_after_their_last_use():
    now = [1000.0]
    cache = ab._PromptCache(clock=lambda: now[0])

    def ask(ttl: str | None = None) -> dict:
        marker = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
        return cache.usage_for(_body([{"role": "user", "content": [
            {"type": "text", "text": "a long shared prefix " * 40, "cache_control": marker}]}]))

    first = ask()
    assert first["cache_read_input_tokens"] == 0 and first["cache_creation_input_tokens"] > 0
    size = first["cache_creation_input_tokens"]
    now[0] += 299                                    # within 5 minutes: read, and refreshed
    assert (ask()["cache_read_input_tokens"], ask()["cache_creation_input_tokens"]) == (size, 0)
    now[0] += 299                                    # 598 s after the write, 299 s after the read
    assert ask()["cache_read_input_tokens"] == size
    now[0] += 301                                    # left alone for more than 5 minutes: cold
    cold = ask()
    assert (cold["cache_read_input_tokens"], cold["cache_creation_input_tokens"]) == (0, size)
    # A 1-hour entry outlives five minutes, and a later 5-minute use does not cut it short.
    ask("1h")
    now[0] += 301 + 300                              # past any 5m life (the 1h write was later)
    assert ask()["cache_read_input_tokens"] == size  # read (the 1h life holds), refreshed 5m
    now[0] += 3600 - 601 - 1                         # just inside the hour of the 1h write
    assert ask()["cache_read_input_tokens"] == size
    now[0] += 3601
    assert ask()["cache_read_input_tokens"] == 0


def test_prompt_cache_ttl_scale_and_its_refusals():
    now = [0.0]
    cache = ab._PromptCache(ttl_scale=0.01, clock=lambda: now[0])  # 5m -> 3 s
    body = _body([{"role": "user", "content": [{"type": "text", "text": "p " * 200,
                                                "cache_control": {"type": "ephemeral"}}]}])
    cache.usage_for(body)
    now[0] += 2.9
    assert cache.usage_for(body)["cache_read_input_tokens"] > 0
    now[0] += 3.1
    assert cache.usage_for(body)["cache_read_input_tokens"] == 0
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ab._PromptCache(ttl_scale=bad)
    code, out = run_main(["serve-model", "--scripts", "x", "--cache-ttl-scale", "0"])
    assert code == 2 and "cache-ttl-scale" in out["error"]


def test_usage_overrides_replace_estimates():
    srv = ab.ScriptedModelServer()
    srv.add_script("big", {"steps": [{"text": "x", "usage": {"input_tokens": 123456, "output_tokens": 7,
                                                             "cache_creation_input_tokens": 50}}]})
    body = _body([_user(MARK.format("big"))])
    usage = srv.usage_for(body, srv.plan(body))
    assert usage["input_tokens"] == 123456 and usage["output_tokens"] == 7
    assert usage["cache_creation_input_tokens"] == 50
    assert usage["cache_creation"]["ephemeral_5m_input_tokens"] == 50


# ---------------------------------------------------------------------------------------------
# HTTP surface (stdlib client, no binary)
# ---------------------------------------------------------------------------------------------
def test_streaming_answer_shape(server):
    server.add_script("s", {"model": "claude-reported-1", "steps": [
        {"text": "Writing now.",
         "tool_uses": [{"name": "Write", "input": {"file_path": "a.txt", "content": "hi\n"}}]}]})
    response, payload = _post(server, "/v1/messages?beta=true", _body([_user(MARK.format("s"))]))
    assert response.status == 200 and response.getheader("content-type") == "text/event-stream"
    events = _sse_events(payload)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = json.loads(events[0][1])["message"]
    assert start["model"] == "claude-reported-1"
    assert set(start["usage"]) >= {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                                   "cache_read_input_tokens", "cache_creation"}
    datas = [json.loads(data) for _, data in events]
    json_parts = [d["delta"]["partial_json"] for d in datas
                  if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta"]
    assert len(json_parts) >= 2
    assert json.loads("".join(json_parts)) == {"file_path": "a.txt", "content": "hi\n"}
    text = "".join(d["delta"]["text"] for d in datas
                   if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta")
    assert text == "Writing now."
    delta = next(d for d in datas if d["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] >= 1
    assert server.requests_log[-1]["script"] == "s" and server.requests_log[-1]["step"] == 0


def test_non_streaming_count_tokens_and_other_paths(server):
    server.add_script("s", {"steps": [{"text": "hello"}]})
    response, payload = _post(server, "/v1/messages", _body([_user(MARK.format("s"))], stream=False))
    message = json.loads(payload)
    assert response.status == 200 and message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "hello"}] and message["stop_reason"] == "end_turn"
    response, payload = _post(server, "/v1/messages/count_tokens?beta=true", _body([_user("x" * 400)]))
    assert response.status == 200 and json.loads(payload)["input_tokens"] > 100
    response, payload = _post(server, "/v1/other", {})
    assert response.status == 404 and json.loads(payload)["type"] == "error"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("HEAD", "/api/hello")
    assert conn.getresponse().status == 200
    conn.close()
    response, payload = _post(server, "/v1/messages", b"not json")
    assert response.status == 400


def test_unknown_script_is_a_loud_400(server):
    response, payload = _post(server, "/v1/messages", _body([_user(MARK.format("missing"))]))
    assert response.status == 400 and "missing" in json.loads(payload)["error"]["message"]


def test_scripts_dir_is_read_on_demand(tmp_path):
    srv = ab.ScriptedModelServer(tmp_path)
    srv.start()
    try:
        body = _body([_user(MARK.format("late"))], stream=False)
        response, payload = _post(srv, "/v1/messages", body)
        assert response.status == 400 and "no file" in json.loads(payload)["error"]["message"]
        # A file that does not parse: the answer says why.
        (tmp_path / "late.json").write_text('{"steps": [')
        response, payload = _post(srv, "/v1/messages", body)
        assert response.status == 400 and "Expecting" in json.loads(payload)["error"]["message"]
        (tmp_path / "late.json").write_text(json.dumps({"steps": [{"text": "from file"}]}))
        response, payload = _post(srv, "/v1/messages", body)
        assert json.loads(payload)["content"][0]["text"] == "from file"
    finally:
        srv.stop()


@pytest.mark.parametrize("fault,status,kind", [("429", 429, "rate_limit_error"), ("529", 529, "overloaded_error"),
                                               ("500", 500, "api_error"),
                                               ("prompt_too_long", 400, "invalid_request_error")])
def test_http_error_faults(server, fault, status, kind):
    server.add_script("f", {"steps": [{"fault": fault}]})
    response, payload = _post(server, "/v1/messages", _body([_user(MARK.format("f"))]))
    error = json.loads(payload)
    assert response.status == status and error["type"] == "error" and error["error"]["type"] == kind
    if fault in ("429", "529"):
        assert response.getheader("retry-after")
    if fault == "prompt_too_long":
        assert "prompt is too long:" in error["error"]["message"] and "maximum" in error["error"]["message"]


def test_cut_and_malformed_streams(server):
    server.add_script("cut", {"steps": [{"fault": "cut", "text": "never complete"}]})
    server.add_script("bad", {"steps": [{"fault": "malformed"}]})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("POST", "/v1/messages", body=json.dumps(_body([_user(MARK.format("cut"))])))
    response = conn.getresponse()
    try:
        payload = response.read()
    except http.client.IncompleteRead as exc:
        payload = exc.partial
    conn.close()
    assert b"message_start" in payload and b"message_stop" not in payload
    _, payload = _post(server, "/v1/messages", _body([_user(MARK.format("bad"))]))
    datas = [data for _, data in _sse_events(payload) if data is not None]
    assert datas
    for data in datas:
        with pytest.raises(ValueError):
            json.loads(data)


def test_hang_is_released_by_stop():
    srv = ab.ScriptedModelServer()
    srv.add_script("h", {"steps": [{"fault": "hang"}]})
    srv.start()
    outcome: dict = {}

    def client() -> None:
        try:
            outcome["response"] = _post(srv, "/v1/messages", _body([_user(MARK.format("h"))]), timeout=30)
        except Exception as exc:  # the connection is dropped: that is the expected end
            outcome["error"] = exc

    worker = threading.Thread(target=client, daemon=True)
    worker.start()
    for _ in range(400):  # wait (bounded) until the server has taken the request
        if any(entry.get("fault") == "hang" for entry in list(srv.requests_log)):
            break
        worker.join(0.05)
    assert any(entry.get("fault") == "hang" for entry in srv.requests_log)
    worker.join(0.5)
    assert worker.is_alive()  # no answer while the server runs
    stopper = threading.Thread(target=srv.stop, daemon=True)
    stopper.start()
    stopper.join(20)
    worker.join(20)
    assert not stopper.is_alive() and not worker.is_alive()
    assert "error" in outcome  # never a real answer


def test_run_scripted_model_server_cli_entry(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"steps": [{"text": "via entry"}]}))
    code = ("import json, sys, agentbench as ab\n"
            "ab.run_scripted_model_server(0, sys.argv[1],\n"
            "    lambda info: (print(json.dumps(info)), sys.stdout.flush()))\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(ab.__file__)))
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["url"] == f"http://127.0.0.1:{info['port']}" and info["port"] > 0
        srv_client = ab.ScriptedModelServer()
        srv_client.port = info["port"]  # reuse the helper's port field for _post
        response, payload = _post(srv_client, "/v1/messages", _body([_user(MARK.format("s"))], stream=False))
        assert json.loads(payload)["content"][0]["text"] == "via entry"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# end to end with the real binary
# ---------------------------------------------------------------------------------------------
def _claude_bin() -> str | None:
    """$AGENTBENCH_CLAUDE_BIN, $AGENTBENCH_REAL_CLAUDE, `claude` on PATH, or the product's own
    idea of a local install (when it has one)."""
    local = getattr(ab, "local_claude_path", None)
    candidates = [os.environ.get("AGENTBENCH_CLAUDE_BIN"), os.environ.get("AGENTBENCH_REAL_CLAUDE"),
                  shutil.which("claude"), str(local()) if callable(local) else None]
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="module")
def claude_bin() -> str:
    path = _claude_bin()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but the claude binary is missing (set AGENTBENCH_CLAUDE_BIN or put claude on PATH)")
        pytest.skip("claude binary not found: set AGENTBENCH_CLAUDE_BIN or put `claude` on PATH")
    return path


@pytest.fixture(scope="module")
def live_server():
    srv = ab.ScriptedModelServer()
    srv.start()
    yield srv
    srv.stop()


class Call:
    """One finished claude -p call: exit code, parsed events, stderr."""

    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.events = []
        for line in stdout.splitlines():
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass
        self.stderr = stderr

    @property
    def result(self) -> dict:
        results = [e for e in self.events if e.get("type") == "result"]
        assert results, f"no result event; stderr={self.stderr[-2000:]!r}"
        return results[-1]


def _run_claude(binary: str, url: str, home: Path, workspace: Path, prompt: str, args: list[str],
                env_extra: dict | None = None) -> Call:
    (home / "config").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "CLAUDE_")) and k not in ("API_TIMEOUT_MS", "DISABLE_TELEMETRY")}
    env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy",
                "CLAUDE_CONFIG_DIR": str(home / "config"), "HOME": str(home),
                "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_MAX_RETRIES": "0"})
    env.update(env_extra or {})
    argv = [binary, "-p", "--output-format", "stream-json", "--verbose", "--model", "claude-opus-4-5",
            "--permission-mode", "dontAsk", "--tools", "Bash,Read,Edit,Write,Glob,Grep",
            "--allowedTools", "Bash,Read,Edit,Write,Glob,Grep", "--strict-mcp-config",
            "--mcp-config", '{"mcpServers":{}}', *args]
    proc = subprocess.Popen(argv, cwd=workspace, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(prompt, timeout=CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"claude did not finish within {CALL_TIMEOUT_S}s; stderr={err[-2000:]!r}")
    return Call(proc.returncode, out, err)


def _parallel(jobs: dict) -> dict:
    """Run {name: zero-arg callable} in threads; return {name: value} (re-raise the first error)."""
    results: dict = {}

    def runner(name, job):
        try:
            results[name] = job()
        except BaseException as exc:  # re-raised in the main thread below
            results[name] = exc

    threads = [threading.Thread(target=runner, args=item) for item in jobs.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return results


def _munged(path: Path) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in str(path))


@pytest.mark.real_claude
def test_real_session_write_bash_then_fork(claude_bin, live_server, tmp_path):
    live_server.add_script("e2e-base", {"steps": [
        {"text": "Creating files.", "tool_uses": [
            {"name": "Write", "input": {"file_path": "hello.txt", "content": "hello\n"}},
            {"name": "Bash", "input": {"command": "cat hello.txt > side_effect.txt", "description": "copy"}}]},
        {"text": "Base done."}]})
    live_server.add_script("e2e-fork", {"steps": [
        {"tool_uses": [{"name": "Bash", "input": {"command": "echo forked > fork.txt"}}]},
        {"text": "Fork done."}]})
    ws = tmp_path / "ws"
    ws.mkdir()
    base_id = str(uuid.uuid4())
    base = _run_claude(claude_bin, live_server.url, tmp_path, ws, "Build it " + MARK.format("e2e-base"),
                       ["--session-id", base_id])
    assert base.returncode == 0, base.stderr
    assert base.result["subtype"] == "success" and base.result["is_error"] is False
    assert base.result["result"] == "Base done."
    # One response arrives as several assistant events sharing a message id (notes §4).
    assert len({e["message"]["id"] for e in base.events if e.get("type") == "assistant"}) == 2
    assert (ws / "hello.txt").read_text() == "hello\n"
    assert (ws / "side_effect.txt").read_text() == "hello\n"
    transcript = tmp_path / "config" / "projects" / _munged(ws.resolve()) / f"{base_id}.jsonl"
    assert transcript.is_file()
    usage = base.result["usage"]
    assert usage["cache_creation_input_tokens"] > 0 and usage["cache_read_input_tokens"] > 0

    fork_id = str(uuid.uuid4())
    fork = _run_claude(claude_bin, live_server.url, tmp_path, ws, "Now this " + MARK.format("e2e-fork"),
                       ["--resume", base_id, "--fork-session", "--session-id", fork_id])
    assert fork.returncode == 0, fork.stderr
    assert fork.result["subtype"] == "success" and fork.result["result"] == "Fork done."
    assert fork.result["session_id"] == fork_id
    assert (ws / "fork.txt").read_text() == "forked\n"
    # The fork reads the base conversation from the (modelled) prompt cache ...
    first_fork_assistant = next(e for e in fork.events if e.get("type") == "assistant")
    assert first_fork_assistant["message"]["usage"]["cache_read_input_tokens"] >= usage["cache_creation_input_tokens"]
    # ... and its total cost is cumulative over the lineage (notes §6).
    assert fork.result["total_cost_usd"] > base.result["total_cost_usd"]
    fork_steps = [(e["script"], e["step"]) for e in live_server.requests_log if e.get("session") == fork_id]
    assert fork_steps == [("e2e-fork", 0), ("e2e-fork", 1)]


@pytest.mark.real_claude
def test_real_concurrent_sessions_do_not_cross(claude_bin, live_server, tmp_path):
    for name in ("left", "right"):
        live_server.add_script(f"cc-{name}", {"steps": [
            {"tool_uses": [{"name": "Bash", "input": {"command": f"echo {name} > {name}.txt"}}]},
            {"tool_uses": [{"name": "Bash", "input": {"command": f"echo {name} >> {name}.txt"}}]},
            {"text": f"{name} finished"}]})

    def job(name):
        ws = tmp_path / name
        ws.mkdir()
        return ws, _run_claude(claude_bin, live_server.url, tmp_path / f"home-{name}", ws,
                               "go " + MARK.format(f"cc-{name}"), ["--session-id", str(uuid.uuid4())])

    results = _parallel({name: (lambda n=name: job(n)) for name in ("left", "right")})
    for name, (ws, call) in results.items():
        assert call.returncode == 0, call.stderr
        assert call.result["result"] == f"{name} finished"
        assert sorted(p.name for p in ws.iterdir()) == [f"{name}.txt"]
        assert (ws / f"{name}.txt").read_text() == f"{name}\n{name}\n"


@pytest.mark.real_claude
def test_real_faults_budget_and_max_turns(claude_bin, live_server, tmp_path):
    live_server.add_script("rf-429", {"steps": [{"fault": "429", "text": "never"}]})
    live_server.add_script("rf-529", {"steps": [{"fault": "529", "text": "never"}]})
    live_server.add_script("rf-ptl", {"steps": [{"fault": "prompt_too_long", "text": "never"}]})
    live_server.add_script("rf-cut", {"steps": [{"fault": "cut", "text": "never"}]})
    live_server.add_script("rf-hang", {"steps": [{"fault": "hang", "text": "never"}]})
    live_server.add_script("rf-cut-once", {"steps": [{"fault": "cut", "fault_times": 1, "text": "recovered"}]})
    live_server.add_script("rf-budget", {"steps": [
        {"tool_uses": [{"name": "Bash", "input": {"command": "echo ran > budget.txt"}}],
         "usage": {"input_tokens": 2_000_000, "output_tokens": 50_000}},
        {"text": "unreachable"}]})
    live_server.add_script("rf-loop", {"steps": [
        {"tool_uses": [{"name": "Bash", "input": {"command": "echo x >> loop.txt"}}], "loop": True}]})
    cases = {
        "rf-429": ([], {}), "rf-529": ([], {}), "rf-ptl": ([], {}), "rf-cut": ([], {}),
        "rf-hang": ([], {"API_TIMEOUT_MS": "4000"}), "rf-cut-once": ([], {}),
        "rf-budget": (["--max-budget-usd", "0.0001"], {}), "rf-loop": (["--max-turns", "2"], {}),
    }

    def job(name):
        args, env_extra = cases[name]
        ws = tmp_path / name
        ws.mkdir()
        call = _run_claude(claude_bin, live_server.url, tmp_path / f"home-{name}", ws, "go " + MARK.format(name),
                           ["--session-id", str(uuid.uuid4()), *args], env_extra)
        return ws, call

    results = _parallel({name: (lambda n=name: job(n)) for name in cases})

    def check_api_error(name, status, terminal):
        ws, call = results[name]
        result = call.result
        assert call.returncode == 1, (name, call.stderr)
        assert result["is_error"] is True and result["subtype"] == "success", (name, result)
        assert result["api_error_status"] == status and result["terminal_reason"] == terminal, (name, result)
        synthetic = [e for e in call.events if e.get("type") == "assistant"]
        assert synthetic and synthetic[-1]["message"]["model"] == "<synthetic>"
        return result

    assert check_api_error("rf-429", 429, "api_error")["api_error_type"] == "rate_limit_error"
    assert check_api_error("rf-529", 529, "api_error")["api_error_type"] == "overloaded_error"
    assert check_api_error("rf-ptl", 400, "prompt_too_long")["result"].startswith("Prompt is too long")
    assert "API Error" in check_api_error("rf-cut", None, "api_error")["result"]
    assert "timed out" in check_api_error("rf-hang", None, "api_error")["result"]

    _, recovered = results["rf-cut-once"]
    assert recovered.returncode == 0 and recovered.result["result"] == "recovered"

    ws, budget = results["rf-budget"]
    assert budget.returncode == 1
    assert budget.result["subtype"] == "error_max_budget_usd" and budget.result["is_error"] is True
    assert budget.result["terminal_reason"] == "budget_exhausted"
    assert budget.result["total_cost_usd"] > 1.0  # priced by the binary from our usage figures
    assert not (ws / "budget.txt").exists()  # the budget stop came before the step's tool ran

    ws, loop = results["rf-loop"]
    assert loop.returncode == 1
    assert loop.result["subtype"] == "error_max_turns" and loop.result["terminal_reason"] == "max_turns"
    assert (ws / "loop.txt").read_text() == "x\nx\n"
