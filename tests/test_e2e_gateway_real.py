"""The metering gateway with the REAL `claude` binary against the scripted model (its upstream).

A session's own tools look for the real credential (its environment, the environment of every
process above it, the supervisor's included) and try the gateway with a wrong token; a scripted
session is metered exactly at the study's prices and agrees with the binary's own figure, unless
the study prices the model differently (then `cost_mismatch`); an endless tool loop under a run
budget ends on the gateway's refusal, within the budget.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import init_real_study, ledger, run_main, wait_result, write_brief

pytestmark = pytest.mark.real_claude

SECRET = "sk-ant-api03-GATEWAY-E2E-DO-NOT-LEAK-7f3a9c"
TOOLS = "Bash,Read,Write"


@pytest.fixture
def gw_study(tmp_path, real_claude, server, monkeypatch):
    """A study whose sessions reach the scripted model through their gateway, with a recognisable
    fake real key in the caller's environment (not offline: the key is carried upstream)."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    root = tmp_path / "study"
    config_dir = tmp_path / "claude-config"
    # Unsandboxed: the gateway must keep the credential from a session that can see its
    # supervisor and every ancestor (a sandbox hides them).
    init_real_study(root, real_claude, server.url, config_dir, monkeypatch,
                    "--tools", TOOLS, "--allowed-tools", TOOLS, "--sandbox", "none", offline=False)
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(config_dir))
    return root


def set_study(study: Path, **changes) -> None:
    cfg = json.loads((study / "study.json").read_text())
    cfg.update(changes)
    (study / "study.json").write_text(json.dumps(cfg, indent=1))


def gateway_records(study: Path, job_id: str) -> list[dict]:
    path = study / "state" / "jobs" / job_id / "gateway.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# The agent's own hunt: its environment, every ancestor's environment and command line (the
# supervisor's among them), and a request to its gateway with a token of its own making.
HUNT = (
    "env > env.txt; p=$$; : > ancestors.txt; "
    "while [ \"$p\" -gt 1 ]; do echo \"== $p\" >> ancestors.txt; "
    "tr '\\0' '\\n' < /proc/$p/environ >> ancestors.txt 2>/dev/null; "
    "tr '\\0' ' ' < /proc/$p/cmdline >> ancestors.txt 2>/dev/null; echo >> ancestors.txt; "
    "p=$(awk '{print $4}' /proc/$p/stat); done; "
    "python3 -c \"import os,urllib.request as u\n"
    "r=u.Request(os.environ['ANTHROPIC_BASE_URL']+'/v1/messages',data=b'{}',headers={'x-api-key':'guess'})\n"
    "try: u.urlopen(r); print(200)\n"
    "except Exception as e: print(getattr(e,'code',e))\" > wrong_token.txt; "
    # ... and a request of its own, with the token it holds, for a model of its choosing.
    "python3 -c \"import os,json,urllib.request as u\n"
    "b=json.dumps({'model':'claude-haiku-4-5','max_tokens':50,'messages':[{'role':'user','content':'hi'}]}).encode()\n"
    "r=u.Request(os.environ['ANTHROPIC_BASE_URL']+'/v1/messages',data=b,headers={'x-api-key':os.environ['ANTHROPIC_API_KEY'],"
    "'content-type':'application/json','anthropic-version':'2023-06-01'})\n"
    "print(u.urlopen(r).status)\" > own_request.txt"
)


def test_the_session_holds_no_credential_and_a_wrong_token_gets_401(tmp_path, gw_study, server):
    server.capture_bodies = True
    server.add_script("hunt", {"steps": [
        {"text": "Looking around.", "tool_uses": [{"name": "Bash", "input": {"command": HUNT}}]},
        {"text": "Done."}]})
    code, sp = run_main(["spawn", "--study", str(gw_study),
                         "--brief", write_brief(tmp_path, "Look. [agentbench-script:hunt]")])
    assert code == 0, sp
    ws = Path(sp["cwd"])
    res = wait_result(gw_study, sp["job_id"], timeout=120)
    assert res["status"] == "ok", res
    env_txt = (ws / "env.txt").read_text()
    ancestors = (ws / "ancestors.txt").read_text()
    assert "ANTHROPIC_BASE_URL=http://127.0.0.1:" in env_txt and "ANTHROPIC_API_KEY=abgw-" in env_txt
    assert "_supervise" in ancestors                      # the walk did reach the supervisor
    for text in (env_txt, ancestors):
        assert SECRET not in text
    assert (ws / "wrong_token.txt").read_text().strip() == "401"
    # Its own request went through its gateway: metered at that model's price, and flagged.
    assert (ws / "own_request.txt").read_text().strip() == "200"
    assert "claude-haiku-4-5" in res["usage"]["models_metered"] and "other_models_metered" in res["flags"]
    # Nothing the study keeps holds it either (raw logs, gateway records, job files).
    for path in (gw_study / "state").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    # ...but the upstream got it, in place of the job token.
    seen = [{k.lower(): v for k, v in e["headers"].items()} for e in server.requests_log if e.get("headers")]
    assert seen and all(h.get("x-api-key") == SECRET for h in seen)
    recs = gateway_records(gw_study, sp["job_id"])
    assert any(r["status"] == 401 and r.get("refused") == "token" for r in recs)


def test_metered_cost_is_the_scripted_usage_at_the_study_prices(tmp_path, gw_study, server):
    usage = {"input_tokens": 1200, "output_tokens": 345, "cache_read_input_tokens": 4000,
             "cache_creation_input_tokens": 600, "ephemeral_5m_input_tokens": 600}
    server.add_script("paid", {"steps": [
        {"text": "Step one.", "usage": usage, "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
        {"text": "Done.", "usage": usage}]})
    code, sp = run_main(["spawn", "--study", str(gw_study),
                         "--brief", write_brief(tmp_path, "Pay. [agentbench-script:paid]")])
    assert code == 0, sp
    res = wait_result(gw_study, sp["job_id"], timeout=120)
    assert res["status"] == "ok", res
    recs = [r for r in gateway_records(gw_study, sp["job_id"]) if r["kind"] == "messages"]
    scripted = [r for r in recs if r["tokens"]["input"] == 1200]
    assert len(scripted) == 2
    one = ab.estimate_cost_usd({"input": 1200, "output": 345, "cache_read": 4000, "cache_creation": 600,
                                "cache_creation_5m": 600}, "claude-opus-4-5")
    assert all(r["cost_usd"] == one for r in scripted)
    u = res["usage"]
    assert u["cost_metered_usd"] == round(sum(r["cost_usd"] for r in recs), 6)
    assert u["requests"] == len(recs) and "claude-opus-4-5" in u["models_metered"]
    assert not ab.cost_mismatch(u["cost_metered_usd"], u["cost_delta_usd"]), u
    assert "cost_mismatch" not in res["flags"]
    line = next(ln for ln in ledger(gw_study) if ln["job_id"] == sp["job_id"])
    assert line["cost_metered_usd"] == u["cost_metered_usd"] and line["requests"] == len(recs)
    code, us = run_main(["usage", "--study", str(gw_study)])
    assert code == 0 and us["usage"]["totals"]["cost_metered_usd"] == pytest.approx(u["cost_metered_usd"])
    assert us["usage"]["totals"]["cost_usd"] == pytest.approx(u["cost_delta_usd"])

    # The same session priced differently by the study than by the binary: flagged.
    set_study(gw_study, prices={"claude-opus-4-5": [50.0, 250.0, 62.5, 100.0, 5.0]})
    server.add_script("paid2", {"steps": [{"text": "Done.", "usage": usage}]})
    code, sp2 = run_main(["spawn", "--study", str(gw_study), "--max-budget-usd", "50",
                          "--brief", write_brief(tmp_path, "Pay. [agentbench-script:paid2]")])
    assert code == 0, sp2
    res2 = wait_result(gw_study, sp2["job_id"], timeout=120)
    assert res2["status"] == "ok" and "cost_mismatch" in res2["flags"], res2
    set_study(gw_study, arms={"A": {}})   # a report needs an arm; these sessions belong to no run
    code, rep = run_main(["report", "--study", str(gw_study)])
    assert code == 0, rep
    assert rep["metering"]["cost_mismatch_jobs"] == [sp2["job_id"]]
    assert rep["metering"]["models_metered"]["claude-opus-4-5"]["requests"] == u["requests"] + res2["usage"]["requests"]
    assert res2["usage"]["cost_metered_usd"] > 5 * res2["usage"]["cost_delta_usd"]


def test_an_endless_tool_loop_ends_on_the_gateways_refusal_within_the_budget(tmp_path, gw_study, server):
    big = {"input_tokens": 1000, "output_tokens": 4000}
    server.add_script("loop", {"steps": [
        {"text": "Working.", "usage": big, "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
        {"text": "Still working.", "usage": big, "loop": True,
         "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]}]})
    budget = 2.0
    code, sp = run_main(["spawn", "--study", str(gw_study), "--max-budget-usd", str(budget),
                         "--brief", write_brief(tmp_path, "Loop. [agentbench-script:loop]")])
    assert code == 0, sp
    res = wait_result(gw_study, sp["job_id"], timeout=240)
    assert (res["status"], res["reason"]) == ("failed", "budget"), res
    assert res["gateway_refusal"]["limit"] == "usd_per_run"
    u = res["usage"]
    assert 0 < u["cost_metered_usd"] <= budget
    recs = gateway_records(gw_study, sp["job_id"])
    assert sum(1 for r in recs if r.get("status") == 200) >= 3       # it did loop before the refusal
    assert not any(r.get("reservation_exceeded") for r in recs)
    lines = [ln for ln in ledger(gw_study) if ln["job_id"] == sp["job_id"]]
    assert len(lines) == 1 and lines[0]["cost_metered_usd"] == u["cost_metered_usd"]
    # The study's spend (what its cap is checked against) counts the metered figure.
    assert ab.read_registry(ab.StudyPaths(gw_study))["spent_usd"] == pytest.approx(u["cost_metered_usd"])
    # Its live reservation file goes once its ledger line is written (just after the result).
    live = gw_study / "state" / "gateway" / f"{sp['job_id']}.json"
    deadline = time.monotonic() + 60
    while live.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not live.exists()


def test_four_parallel_loops_never_spend_more_than_the_study_cap(tmp_path, gw_study, server):
    cap = 1.5
    cfg = json.loads((gw_study / "study.json").read_text())
    cfg["budget"] = {**(cfg.get("budget") or {}), "study_usd": cap}
    # A smaller max_tokens makes a request's worst case small enough for several to fit.
    cfg["env"] = {**cfg["env"], "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4000"}
    (gw_study / "study.json").write_text(json.dumps(cfg, indent=1))
    step = {"text": "Working.", "usage": {"input_tokens": 1000, "output_tokens": 2000},
            "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]}
    jobs = []
    for i in range(4):
        server.add_script(f"par{i}", {"steps": [step, dict(step, loop=True)]})
        code, sp = run_main(["spawn", "--study", str(gw_study), "--max-budget-usd", "1.0", "--label", f"p{i}",
                             "--brief", write_brief(tmp_path, f"Loop. [agentbench-script:par{i}]")])
        assert code == 0, sp
        jobs.append(sp["job_id"])
    res = [wait_result(gw_study, j, timeout=300) for j in jobs]
    total = sum(r["usage"]["cost_metered_usd"] for r in res)
    assert total <= cap, [r["usage"]["cost_metered_usd"] for r in res]
    assert all((r["status"], r["reason"]) == ("failed", "budget") for r in res), [(r["status"], r["reason"]) for r in res]
    limits = [r["gateway_refusal"]["limit"] for r in res]
    assert "study_usd" in limits, limits                       # the study's cap stopped some of them
    for r, job in zip(res, jobs):
        # The job's first refusal is its gateway_refusal; a session whose requests overlap can be
        # refused again, by the other cap, and the binary's last words may name either.
        refused = [g["refusal"]["limit"] for g in gateway_records(gw_study, job) if isinstance(g.get("refusal"), dict)]
        assert r["gateway_refusal"]["limit"] in refused, (refused, r["gateway_refusal"])
        assert "budget exhausted" in r["result_text"] and any(limit in r["result_text"] for limit in refused)
    assert ab.read_registry(ab.StudyPaths(gw_study))["spent_usd"] == pytest.approx(total)
    assert len(ledger(gw_study)) == 4


# A request of the agent's own making with a server-side tool (web search): its cost is not
# bounded by its body, so the gateway refuses it by name.
SEARCH = (
    "python3 -c \"import os,json,urllib.request as u,urllib.error as e\n"
    "b=json.dumps({'model':'claude-opus-4-5','max_tokens':50,'messages':[{'role':'user','content':'hi'}],"
    "'tools':[{'type':'web_search_20250305','name':'web_search','max_uses':50}]}).encode()\n"
    "r=u.Request(os.environ['ANTHROPIC_BASE_URL']+'/v1/messages',data=b,headers={'x-api-key':os.environ['ANTHROPIC_API_KEY'],"
    "'content-type':'application/json','anthropic-version':'2023-06-01'})\n"
    "try: print(u.urlopen(r).status)\n"
    "except e.HTTPError as x: print(x.code, x.read().decode())\" > search.txt"
)


def test_a_server_side_tool_request_from_inside_the_session_is_refused_by_name(tmp_path, gw_study, server):
    server.add_script("search", {"steps": [
        {"text": "Searching.", "tool_uses": [{"name": "Bash", "input": {"command": SEARCH}}]},
        {"text": "Done."}]})
    code, sp = run_main(["spawn", "--study", str(gw_study),
                         "--brief", write_brief(tmp_path, "Search. [agentbench-script:search]")])
    assert code == 0, sp
    res = wait_result(gw_study, sp["job_id"], timeout=120)
    assert res["status"] == "ok", res                     # a refused request is no budget end
    got = (Path(sp["cwd"]) / "search.txt").read_text()
    assert got.startswith("400") and "server_tool:web_search_20250305" in got, got
    recs = gateway_records(gw_study, sp["job_id"])
    assert [r["unbounded"] for r in recs if r.get("refused") == "unbounded"] == [["server_tool:web_search_20250305"]]
    assert not any("web_search" in (e.get("body") or b"").decode(errors="replace") for e in server.requests_log)


def test_an_answer_billed_past_its_bound_is_cut_and_the_session_ends_budget(tmp_path, gw_study, server):
    """The scripted model as an upstream that overbills: 2M input tokens on an ordinary request.
    The gateway cuts the answer at its first event, refuses the binary's retries, and the
    supervisor ends the session `budget` at once (it does not wait for the binary to give up)."""
    server.capture_bodies = True
    server.add_script("overbill", {"steps": [
        {"text": "Working.", "usage": {"input_tokens": 2_000_000, "output_tokens": 1},
         "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
        {"text": "Done."}]})
    code, sp = run_main(["spawn", "--study", str(gw_study), "--max-budget-usd", "5",
                         "--brief", write_brief(tmp_path, "Go. [agentbench-script:overbill]")])
    assert code == 0, sp
    res = wait_result(gw_study, sp["job_id"], timeout=180)
    assert (res["status"], res["reason"]) == ("failed", "budget"), res
    assert res["gateway_refusal"]["limit"] == "reservation_exceeded"
    recs = [r for r in gateway_records(gw_study, sp["job_id"]) if r["kind"] == "messages"]
    cut = [r for r in recs if r.get("cut")]
    assert cut and all(r["reservation_exceeded"] for r in cut)
    # Nothing was forwarded after the cut: every later request was refused.
    after = recs[recs.index(cut[0]) + 1:]
    assert all(r.get("refused") == "reservation_exceeded" for r in after if not r.get("cut"))


# The agent's own attack: 16 requests at once with its job token, max_tokens 1, each a body of
# ~20 KB that names a script billing it the most its bound allows (every byte a 1-hour cache write).
ATTACK_BODY = {"model": "claude-opus-4-5", "max_tokens": 1, "stream": False,
               "tools": [{"name": "noop", "description": "x", "input_schema": {"type": "object"}}],
               "messages": [{"role": "user", "content": "[agentbench-script:bill] " + "x" * 20000}]}
ATTACK = (
    "python3 - <<'PY'\n"
    "import os, json, threading, urllib.request as u, urllib.error as e\n"
    f"b = json.dumps({ATTACK_BODY!r}).encode()\n"
    "out, go = [], threading.Barrier(16)\n"
    "def one():\n"
    "    r = u.Request(os.environ['ANTHROPIC_BASE_URL'] + '/v1/messages', data=b, headers={\n"
    "        'x-api-key': os.environ['ANTHROPIC_API_KEY'], 'content-type': 'application/json',\n"
    "        'anthropic-version': '2023-06-01'})\n"
    "    go.wait()\n"
    "    try: out.append(u.urlopen(r).status)\n"
    "    except e.HTTPError as x: out.append(x.code)\n"
    "ts = [threading.Thread(target=one) for _ in range(16)]\n"
    "[t.start() for t in ts]; [t.join() for t in ts]\n"
    "open('attack.txt', 'w').write(json.dumps(sorted(out)))\n"
    "PY"
)


def test_sixteen_requests_at_once_from_inside_a_session_stay_within_the_run_budget(tmp_path, gw_study, server):
    body = json.dumps(ATTACK_BODY).encode()
    n_in = len(body) + ab.GATEWAY_OVERHEAD_TOKENS                    # the gateway's bound, billed in full
    server.add_script("bill", {"steps": [{"text": "ok", "usage": {
        "input_tokens": 0, "output_tokens": 1, "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": n_in, "ephemeral_1h_input_tokens": n_in}}]})
    server.add_script("attack", {"steps": [
        {"text": "Attacking.", "tool_uses": [{"name": "Bash", "input": {"command": ATTACK}}]},
        {"text": "Done."}]})
    budget = 2.0
    code, sp = run_main(["spawn", "--study", str(gw_study), "--max-budget-usd", str(budget),
                         "--brief", write_brief(tmp_path, "Go. [agentbench-script:attack]")])
    assert code == 0, sp
    res = wait_result(gw_study, sp["job_id"], timeout=240)
    statuses = json.loads((Path(sp["cwd"]) / "attack.txt").read_text())
    recs = [r for r in gateway_records(gw_study, sp["job_id"]) if r["kind"] == "messages"]
    attack = [r for r in recs if r.get("body_bytes") == len(body)]
    one = ab.worst_case_usd(n_in, 1, "claude-opus-4-5", None)
    ok = [r for r in attack if r["status"] == 200]
    assert len(attack) == 16 and statuses.count(200) == len(ok) and statuses.count(400) == 16 - len(ok)
    assert all(r["cost_usd"] == r["reserved_usd"] == one for r in ok)     # each billed its whole bound
    assert 1 <= len(ok) < 16 and {r["refused"] for r in attack if r["status"] == 400} == {"usd_per_run"}
    u = res["usage"]
    assert u["cost_metered_usd"] <= budget, u
    assert not any(r.get("reservation_exceeded") for r in recs)
    assert (res["status"], res["reason"]) == ("failed", "budget"), res    # the next turn no longer fit
