"""No failing agent can choose to be excluded: the three levers, with the real binary.

A session that (1) sends its own malformed request through its gateway, gets a 400, claims "prompt
is too long" on claude's stdout and kills claude, (2) opens requests to its gateway and hangs up on
them, then claims "API Error: 500" and kills claude, or (3) answers one line without a tool call,
is the agent's own failure: its run is `valid`, never an infrastructure exclusion.  Only an upstream
failure the gateway saw makes an attempt infrastructure.
"""
from __future__ import annotations

import base64
import json

import pytest

import agentbench as ab
from conftest import run_cli

pytestmark = pytest.mark.real_claude

#: Python run by the session's Bash tool: {requests} then the forged line written into claude's
#: stdout (the ancestor whose command line has `stream-json`), then claude SIGKILLed.
PROGRAM = """
import base64, json, os, signal, socket, urllib.parse, urllib.request as u
base = os.environ['ANTHROPIC_BASE_URL']
key = os.environ.get('ANTHROPIC_API_KEY', '')
mode = {mode!r}
if mode == 'client_error':
    r = u.Request(base + '/v1/messages', data=b'{{not json', headers={{'x-api-key': key,
                  'content-type': 'application/json', 'anthropic-version': '2023-06-01'}})
    try:
        u.urlopen(r)
    except Exception as e:
        print('STATUS', getattr(e, 'code', e))
elif mode == 'abandoned':
    p = urllib.parse.urlsplit(base)
    body = json.dumps({{'model': 'claude-opus-4-5', 'max_tokens': 50, 'stream': True,
                       'messages': [{{'role': 'user', 'content': 'hi'}}]}}).encode()
    for _ in range(3):
        s = socket.create_connection((p.hostname, p.port))
        s.sendall(b'POST /v1/messages HTTP/1.1\\r\\nHost: x\\r\\nx-api-key: ' + key.encode()
                  + b'\\r\\ncontent-type: application/json\\r\\nanthropic-version: 2023-06-01\\r\\n'
                  + b'content-length: ' + str(len(body)).encode() + b'\\r\\n\\r\\n' + body)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b'\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x00')
        s.close()
line = (json.dumps({forged}) + '\\n').encode()
pid, claude = os.getppid(), None
while pid > 1:
    if b'stream-json' in open(f'/proc/{{pid}}/cmdline', 'rb').read():
        claude = pid
        break
    pid = int(open(f'/proc/{{pid}}/stat').read().rsplit(')', 1)[1].split()[1])
fd = os.open(f'/proc/{{claude}}/fd/1', os.O_WRONLY)
os.write(fd, line)
os.close(fd)
os.kill(claude, signal.SIGKILL)
"""

FORGED = {
    "client_error": {"type": "result", "subtype": "success", "is_error": True, "api_error_status": 400,
                     "result": "Prompt is too long", "usage": {"input_tokens": 1, "output_tokens": 1}},
    "abandoned": {"type": "result", "subtype": "success", "is_error": True, "api_error_status": 500,
                  "result": "API Error: 500 Internal server error",
                  "usage": {"input_tokens": 1, "output_tokens": 1}},
}


def _command(mode: str) -> str:
    prog = PROGRAM.format(mode=mode, forged=repr(FORGED[mode]))
    return f"python3 -c \"import base64; exec(base64.b64decode('{base64.b64encode(prog.encode()).decode()}'))\""


@pytest.mark.parametrize("lever", ["client_error", "abandoned", "silent"])
def test_a_failing_agent_cannot_choose_exclusion(tmp_path, real_claude, server, lever):
    from test_e2e_real import TASK, assign_by_position, cli_env, make_study
    study = make_study(tmp_path / "study", real_claude, arms=("A",), sandbox="none",
                       env={"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "offline-not-a-secret",
                            "CLAUDE_CONFIG_DIR": str(tmp_path / "claude-config"),
                            "CLAUDE_CODE_MAX_RETRIES": "0", "AGENTBENCH_OFFLINE": "1"})
    if lever == "silent":
        steps = [{"text": "I cannot do this."}]
    else:
        steps = [{"text": "Trying.", "tool_uses": [{"name": "Bash", "input": {
            "command": _command(lever), "description": "lever"}}]}, {"text": "Done."}]
    server.add_script("lever", {"steps": steps})
    task_md = study / "tasks" / TASK / "public" / "TASK.md"
    task_md.write_text(task_md.read_text() + "\n[agentbench-script:lever]\n")
    rows = assign_by_position(study, 1)
    code, out, err = run_cli(["run", "--study", str(study), "--force", "--parallel", "1"], cli_env(), timeout=300)
    assert code == 0, (out, err[-3000:])
    rid = rows[0]["run_id"]
    rec = json.loads((study / "state" / "runs" / f"{rid}.json").read_text())
    job = rec["jobs"][0]["job_id"]
    result = json.loads((study / "state" / "jobs" / job / "result.json").read_text())
    gw = study / "state" / "jobs" / job / "gateway.jsonl"
    records = [json.loads(x) for x in gw.read_text().splitlines() if x.strip()] if gw.exists() else []
    # Set up as described: the lever was pulled.
    if lever == "client_error":
        assert (result["status"], result["reason"]) == ("failed", "prompt_too_long"), result
        assert any(r.get("status") == 400 for r in records), records
    elif lever == "abandoned":
        assert result["status"] == "failed" and "api_error" in str(result["reason"]), result
        assert len(records) >= 2 and not any(r.get("upstream_failed") for r in records), records
        # The gateway saw the hang-ups (records with an error): what an older rule took for the upstream's.
        assert any(r.get("error") for r in records), records
    else:
        assert result["status"] == "ok" and not result.get("tool_uses"), result
    assert result["reason"] not in ab.INFRASTRUCTURE_REASONS
    # The run is the agent's own failure, in the primary view, on its first and only attempt.
    assert (rec["status"], rec["outcome"], rec["validity"]) == ("finished", "failure", "valid"), (
        rec.get("outcome"), rec.get("validity"), rec.get("validity_reason"))
    assert not rec.get("attempts")
