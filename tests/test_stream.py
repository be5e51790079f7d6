"""Pure tests of the stream and usage rules: StreamState, usage_record, classify_session,
cache_verdict, the launch argv and its fingerprint, transcript directory names.

Every event here is written by hand in the shape `claude` 2.1.x prints (stream-json), so each test
states exactly which fact of the stream it pins: one API message split over several `assistant`
events, more than one `result`, cumulative totals over resume and fork, API errors that end
`success` with `is_error: true`, and so on.  No process is started.
"""
from __future__ import annotations

import dataclasses

import json
from typing import Any

import pytest

import agentbench as ab

OPUS = "claude-opus-4-5"
#: Ledger dollars are rounded to 6 decimals: half a micro-dollar is the most that can move.
MICRO_USD = 5.01e-7


# ---- event builders -----------------------------------------------------------------------------

def usage(inp: int = 0, out: int = 0, cc: int = 0, cr: int = 0, cc1h: int = 0) -> dict[str, Any]:
    """An API usage block with the 1h/5m split of the cache creation."""
    return {"input_tokens": inp, "output_tokens": out, "cache_creation_input_tokens": cc,
            "cache_read_input_tokens": cr,
            "cache_creation": {"ephemeral_1h_input_tokens": cc1h,
                               "ephemeral_5m_input_tokens": cc - cc1h}}


def assistant(mid: str, u: dict[str, Any], *, model: str = OPUS,
              content: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    ev = {"type": "assistant", "session_id": "s1", "parent_tool_use_id": None,
          "message": {"id": mid, "model": model, "role": "assistant", "usage": u,
                      "content": content if content is not None else [{"type": "text", "text": "hi"}]}}
    ev.update(extra)
    return json.dumps(ev)


def model_row(inp: int, out: int, cost: float, cr: int = 0, cc: int = 0) -> dict[str, Any]:
    return {"inputTokens": inp, "outputTokens": out, "cacheReadInputTokens": cr,
            "cacheCreationInputTokens": cc, "costUSD": cost, "contextWindow": 200000}


def result(**fields: Any) -> dict[str, Any]:
    ev = {"type": "result", "subtype": "success", "is_error": False, "num_turns": 1,
          "session_id": "s1", "result": "Done.", "terminal_reason": "completed",
          "api_error_status": None}
    ev.update(fields)
    return ev


def fed(*lines: str | bytes) -> ab.StreamState:
    st = ab.StreamState()
    for line in lines:
        st.feed(line)
    return st


INIT = json.dumps({"type": "system", "subtype": "init", "session_id": "s1", "model": OPUS,
                   "tools": ["Bash"], "permissionMode": "dontAsk", "claude_code_version": "2.1.332"})


# ---- StreamState --------------------------------------------------------------------------------

def test_split_assistant_events_count_one_message_with_the_max_of_the_snapshots() -> None:
    # One API response arrives as 3 events sharing message.id; each carries a usage snapshot and
    # the output count grows.  The message counts once, each field at its maximum.
    st = fed(INIT,
             assistant("msg_1", usage(100, 1, 40, 10), content=[{"type": "text", "text": "a"}]),
             assistant("msg_1", usage(100, 7, 40, 10), content=[{"type": "tool_use", "name": "Bash",
                                                                  "input": {"command": "ls"}}]),
             assistant("msg_1", usage(100, 3, 40, 10), content=[{"type": "text", "text": "b"}]),
             assistant("msg_2", usage(5, 2, 0, 150)))
    assert st.message_order == ["msg_1", "msg_2"]
    assert st.messages["msg_1"]["tokens"]["output"] == 7
    tokens = st.message_tokens()
    assert tokens["input"] == 105          # 100 counted once, not three times
    assert tokens["output"] == 9
    assert tokens["cache_creation"] == 40
    assert tokens["cache_read"] == 160
    assert st.tool_uses == 1
    assert st.tool_calls == [{"name": "Bash", "input": {"command": "ls"}}]
    # The cache verdict looks at the first message of the call, as first seen.
    assert st.first_assistant_usage is not None and st.first_assistant_usage["cache_read"] == 10
    assert st.init is not None and st.session_id == "s1"


def test_double_result_last_one_wins() -> None:
    first = result(total_cost_usd=0.01, result="(interim)")
    last = result(total_cost_usd=0.03, result="final")
    st = fed(INIT, json.dumps(first), assistant("m", usage(1, 1)), json.dumps(last))
    assert len(st.results) == 2
    assert st.result is not None and st.result["result"] == "final"
    assert st.result["total_cost_usd"] == 0.03


def test_malformed_lines_and_unknown_types_are_counted_and_skipped() -> None:
    st = ab.StreamState()
    assert st.feed("this line is not JSON {") is None
    assert st.feed('{"type":"assistant","message":{"id":"m1","content":[{"type":"te') is None
    assert st.feed("[1, 2, 3]") is None           # JSON, but not an event object
    assert st.feed("   ") is None                  # blank lines are not counted at all
    unknown = st.feed('{"type": "fake_unknown_event", "subtype": "x"}')
    assert unknown == {"type": "fake_unknown_event", "subtype": "x"}
    # Bytes are accepted (the supervisor feeds raw pipe lines), undecodable bytes replaced.
    st.feed(assistant("m2", usage(10, 2)).encode() + b"\n")
    st.feed(b"\xff\xfe not utf-8")
    assert st.bad_lines == 4
    assert st.unknown_types == 1
    assert st.lines == 6
    assert st.message_order == ["m2"]
    assert st.result is None


def test_synthetic_model_is_not_a_model_used() -> None:
    err = assistant("a3c1", usage(), model="<synthetic>",
                    content=[{"type": "text", "text": "API Error: Request rejected (429)"}],
                    is_api_error_message=True, api_error_status=429)
    st = fed(INIT, assistant("m1", usage(1, 1), model="claude-sonnet-4-5"), err)
    assert st.models == ["claude-sonnet-4-5"]
    assert "<synthetic>" not in st.models


# ---- usage_record -------------------------------------------------------------------------------

def test_tokens_from_the_result_usage_with_the_1h_5m_split() -> None:
    res = result(usage=usage(inp=1000, out=5, cc=200, cr=300, cc1h=150), total_cost_usd=0.0070875,
                 modelUsage={OPUS: model_row(1000, 5, 0.0070875, cr=300, cc=200)})
    # The per-event snapshots disagree with the result on purpose: the result is the truth.
    st = fed(INIT, assistant("m", usage(1000, 1, 200, 300, 150)), json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.0, prior_model_usage=None, requested_model=OPUS)
    assert rec["tokens"] == {"input": 1000, "output": 5, "cache_creation": 200,
                             "cache_creation_1h": 150, "cache_creation_5m": 50, "cache_read": 300}
    assert rec["estimated"] is False
    # The ledger keeps dollars to the micro-dollar (6 decimals); the reported total is kept as is.
    assert rec["cost_delta_usd"] == pytest.approx(0.0070875, abs=MICRO_USD)
    assert rec["cost_total_usd"] == 0.0070875
    assert rec["models_used"] == [OPUS]
    assert rec["flags"] == []


def test_cache_creation_without_a_split_counts_as_5m() -> None:
    t = ab.tokens_from_usage({"input_tokens": 1, "cache_creation_input_tokens": 80})
    assert t["cache_creation"] == 80 and t["cache_creation_5m"] == 80 and t["cache_creation_1h"] == 0


def test_models_used_are_the_model_usage_keys_that_grew() -> None:
    # A resumed session: the cumulative modelUsage still holds the haiku row of an earlier call,
    # unchanged; only opus grew in this call.
    prior = {OPUS: model_row(1000, 100, 0.5), "claude-haiku-4-5": model_row(50, 5, 0.001)}
    now = {OPUS: model_row(1400, 160, 0.8), "claude-haiku-4-5": model_row(50, 5, 0.001)}
    res = result(usage=usage(400, 60), total_cost_usd=0.801, modelUsage=now)
    st = fed(INIT, json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.501, prior_model_usage=prior, requested_model=OPUS)
    assert rec["models_used"] == [OPUS]
    assert rec["cost_delta_usd"] == pytest.approx(0.3)
    assert "usage_mismatch" not in rec["flags"]
    assert rec["model_usage"] == now


def test_model_usage_since_last_result_wins_over_the_computed_delta() -> None:
    # Without the prior modelUsage every cumulative key looks new; the binary's own per-call
    # delta says only haiku was used in this call.
    cumulative = {OPUS: model_row(1000, 100, 0.5), "claude-haiku-4-5": model_row(40, 4, 0.001)}
    since = {"claude-haiku-4-5": model_row(40, 4, 0.001)}
    res = result(usage=usage(40, 4), total_cost_usd=0.501, modelUsage=cumulative,
                 model_usage_since_last_result=since)
    st = fed(json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.5, prior_model_usage=None, requested_model=OPUS)
    assert rec["models_used"] == ["claude-haiku-4-5"]
    assert rec["flags"] == []


@pytest.mark.parametrize("case", ["resume", "fork"])
def test_cost_delta_is_taken_against_the_prior_cumulative_total(case: str) -> None:
    # NOTES §6: 0.0913 (base) -> 0.0986 (resume); a fork of it reports 0.1140.  The prior of a
    # resume is the session's own last total; the prior of a fork is its base's total.
    prior_total, reported = (0.0913, 0.0986) if case == "resume" else (0.0986, 0.1140)
    prior_mu = {OPUS: model_row(9000, 900, prior_total)}
    res = result(usage=usage(300, 20), total_cost_usd=reported,
                 modelUsage={OPUS: model_row(9300, 920, reported)})
    st = fed(json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=prior_total, prior_model_usage=prior_mu,
                          requested_model=OPUS)
    assert rec["cost_delta_usd"] == pytest.approx(reported - prior_total, abs=1e-6)
    assert rec["cost_total_usd"] == pytest.approx(reported)
    assert rec["estimated"] is False
    assert rec["flags"] == []


def test_a_total_that_goes_down_is_flagged_and_taken_as_this_calls_cost() -> None:
    res = result(usage=usage(10, 10), total_cost_usd=0.02, modelUsage={OPUS: model_row(10, 10, 0.02)})
    st = fed(json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.5, prior_model_usage={}, requested_model=OPUS)
    assert "total_decreased" in rec["flags"]
    assert rec["cost_delta_usd"] == pytest.approx(0.02)


def test_usage_that_disagrees_with_the_model_usage_delta_is_flagged() -> None:
    # usage says 100 input tokens; modelUsage grew by 5000 (a span mismatch): flag, don't fix.
    res = result(usage=usage(100, 10), total_cost_usd=0.1,
                 modelUsage={OPUS: model_row(5000, 10, 0.1)})
    st = fed(json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.0, prior_model_usage={}, requested_model=OPUS)
    assert "usage_mismatch" in rec["flags"]
    # ...and the agreeing case is not flagged.
    res_ok = result(usage=usage(5000, 10), total_cost_usd=0.1,
                    modelUsage={OPUS: model_row(5000, 10, 0.1)})
    rec_ok = ab.usage_record(res_ok, fed(json.dumps(res_ok)), prior_cost=0.0, prior_model_usage={},
                             requested_model=OPUS)
    assert "usage_mismatch" not in rec_ok["flags"]


def test_without_a_result_the_cost_is_estimated_from_per_message_usage_at_list_prices() -> None:
    # Prices per MTok (PRICES_PER_MTOK): opus-4-5 in 5, out 25, write 5m 6.25, write 1h 10,
    # read 0.5; haiku-4-5 in 1, out 5.  By hand:
    #   msg_a (opus, split in two events, the max counts): 1000 in, 5 out, 300 read, 50 5m, 150 1h
    #         = 5000 + 125 + 150 + 312.5 + 1500 = 7087.5 micro-USD  (NOTES §5: $0.0070875)
    #   msg_b (haiku): 2000 in, 100 out = 2000 + 500 = 2500 micro-USD
    #   msg_c (no model reported: priced as the requested opus): 400 in = 2000 micro-USD
    assert ab.PRICES_PER_MTOK[OPUS] == (5.0, 25.0, 6.25, 10.0, 0.50)
    assert ab.PRICES_PER_MTOK["claude-haiku-4-5"][:2] == (1.0, 5.0)
    st = fed(INIT,
             assistant("msg_a", usage(1000, 1, 200, 300, 150)),
             assistant("msg_a", usage(1000, 5, 200, 300, 150)),
             assistant("msg_b", usage(2000, 100), model="claude-haiku-4-5"),
             assistant("msg_c", usage(400, 0), model=""))
    rec = ab.usage_record(None, st, prior_cost=0.25, prior_model_usage={"x": {}}, requested_model=OPUS)
    assert rec["estimated"] is True
    assert rec["cost_total_usd"] is None
    assert rec["cost_delta_usd"] == pytest.approx(0.0070875 + 0.0025 + 0.002, abs=MICRO_USD)
    assert rec["tokens"]["input"] == 3400
    assert rec["tokens"]["output"] == 105
    assert rec["models_used"] == [OPUS, "claude-haiku-4-5"]


def test_a_result_without_a_total_is_estimated_and_flagged() -> None:
    res = result(usage=usage(1000, 0))
    st = fed(assistant("m", usage(1000, 0)), json.dumps(res))
    rec = ab.usage_record(st.result, st, prior_cost=0.0, prior_model_usage=None, requested_model=OPUS)
    assert rec["estimated"] is True
    assert "no_total_cost" in rec["flags"]
    assert rec["cost_delta_usd"] == pytest.approx(0.005)


# ---- classify_session ---------------------------------------------------------------------------

def api_error_result(status: int | None, error_type: str | None, terminal: str, text: str) -> dict[str, Any]:
    """The shape of NOTES §7: subtype success, is_error true, num_turns 1, the error text."""
    ev = result(is_error=True, num_turns=1, api_error_status=status, terminal_reason=terminal,
                result=text, stop_reason="stop_sequence")
    if error_type is not None:
        ev["api_error_type"] = error_type
    return ev


API_ERROR_CASES = [
    ("429", api_error_result(429, "rate_limit_error", "api_error",
                             "API Error: Request rejected (429) · Number of request tokens has "
                             "exceeded your per-minute rate limit"), "usage_limit"),
    ("529", api_error_result(529, "overloaded_error", "api_error",
                             "API Error: 529 Overloaded. This is a server-side issue, usually "
                             "temporary — try again in a moment."), "overloaded"),
    ("500", api_error_result(500, "api_error", "api_error",
                             "API Error: 500 Internal server error. This is a server-side issue, "
                             "usually temporary — try again in a moment."), "api_error"),
    ("prompt_too_long", api_error_result(400, "invalid_request_error", "prompt_too_long",
                                         "Prompt is too long · the request is ~250000 tokens "
                                         "(limit 200000)"), "prompt_too_long"),
    ("timeout", api_error_result(None, None, "api_error",
                                 "Request timed out. Check your network connection or set "
                                 "API_TIMEOUT_MS above 5000."), "api_error"),
    ("stream_truncated", api_error_result(None, None, "api_error",
                                          "API Error: API returned an empty or malformed response "
                                          "(HTTP 200) — stream_truncated"), "api_error"),
]


@pytest.mark.parametrize("exit_code", [1, 0])
@pytest.mark.parametrize("name,res,reason", API_ERROR_CASES, ids=[c[0] for c in API_ERROR_CASES])
def test_api_errors_are_classified_by_the_result_not_the_exit_code(name: str, res: dict[str, Any],
                                                                   reason: str, exit_code: int) -> None:
    # The real binary exits 1 for these; an older one exited 0.  Either way the session failed.
    assert ab.classify_session(res, exit_code) == ("failed", reason)


def test_success_is_ok() -> None:
    assert ab.classify_session(result(), 0) == ("ok", None)


def test_is_error_with_exit_0_is_not_ok() -> None:
    res = result(is_error=True, result="something went wrong")
    status, reason = ab.classify_session(res, 0)
    assert status == "failed"
    assert reason == "is_error"


def test_max_turns_and_budget_results() -> None:
    max_turns = {"type": "result", "subtype": "error_max_turns", "is_error": True, "num_turns": 3,
                 "terminal_reason": "max_turns", "errors": ["Reached maximum number of turns (2)"],
                 "api_error_status": None}
    budget = {"type": "result", "subtype": "error_max_budget_usd", "is_error": True, "num_turns": 1,
              "terminal_reason": "budget_exhausted", "errors": ["Reached maximum budget ($0.0001)"],
              "api_error_status": None, "total_cost_usd": 0.0125}
    assert ab.classify_session(max_turns, 1) == ("failed", "max_turns")
    assert ab.classify_session(budget, 1) == ("failed", "budget")


def test_no_result_is_a_failure_whatever_the_exit_code() -> None:
    assert ab.classify_session(None, 0) == ("failed", "no_result")
    assert ab.classify_session(None, None) == ("failed", "no_result")
    assert ab.classify_session(None, 3) == ("failed", "exit_code")
    assert ab.classify_session(None, -9) == ("failed", "exit_code")


# ---- cache verdict --------------------------------------------------------------------------------

@pytest.mark.parametrize("read,base,verdict", [
    (900, 1000, "hit"),        # exactly 90 %
    (1000, 1000, "hit"),
    (899, 1000, "partial"),
    (1, 1000, "partial"),
    (0, 1000, "miss"),
    (500, 0, "cold"),          # no base context: a fresh start
    (500, None, "cold"),
])
def test_cache_verdict_thresholds(read: int, base: int | None, verdict: str) -> None:
    first = ab.tokens_from_usage(usage(inp=3, cr=read))
    assert ab.cache_verdict(first, base) == verdict


def test_cache_verdict_without_any_message_is_none() -> None:
    assert ab.cache_verdict(None, 1000) is None


# ---- launch argv ----------------------------------------------------------------------------------

LAUNCH = ab.LaunchSpec(root="/study", model=OPUS, effort="high", permission_mode="dontAsk",
                       tools="Bash,Read,Edit,Write,Glob,Grep", allowed_tools="Bash,Read,Edit",
                       disallowed_tools="Bash(rm *)")


def argv(**kw: Any) -> list[str]:
    args: dict[str, Any] = dict(session_id=None, resume=None, fork=False, mcp_config="/j/mcp.json",
                                system_prompt_file="/j/system_prompt.md", max_budget_usd=None,
                                max_turns=None)
    args.update(kw)
    return ab.build_claude_argv("/bin/claude", LAUNCH, **args)


def flag_value(a: list[str], flag: str) -> str:
    assert a.count(flag) == 1, (flag, a)
    return a[a.index(flag) + 1]


def test_fresh_argv_carries_every_flag() -> None:
    a = argv(session_id="11111111-1111-1111-1111-111111111111", max_budget_usd=2.5, max_turns=40)
    assert a[:5] == ["/bin/claude", "-p", "--output-format", "stream-json", "--verbose"]
    assert flag_value(a, "--model") == OPUS
    assert flag_value(a, "--effort") == "high"
    assert flag_value(a, "--permission-mode") == "dontAsk"
    assert flag_value(a, "--tools") == "Bash,Read,Edit,Write,Glob,Grep"
    assert flag_value(a, "--allowedTools") == "Bash,Read,Edit"
    assert flag_value(a, "--disallowedTools") == "Bash(rm *)"
    assert "--strict-mcp-config" in a
    assert flag_value(a, "--mcp-config") == "/j/mcp.json"
    assert flag_value(a, "--append-system-prompt-file") == "/j/system_prompt.md"
    assert flag_value(a, "--session-id") == "11111111-1111-1111-1111-111111111111"
    assert float(flag_value(a, "--max-budget-usd")) == 2.5
    assert flag_value(a, "--max-turns") == "40"
    assert "--resume" not in a and "--fork-session" not in a


def test_fork_argv_resumes_the_base_into_a_new_session_id() -> None:
    a = argv(session_id="22222222-2222-2222-2222-222222222222", resume="base-sid", fork=True)
    assert flag_value(a, "--resume") == "base-sid"
    assert "--fork-session" in a
    assert flag_value(a, "--session-id") == "22222222-2222-2222-2222-222222222222"
    # The launch flags are repeated in full: a resume does not inherit them.
    assert flag_value(a, "--model") == OPUS and flag_value(a, "--tools") == LAUNCH.tools


def test_plain_resume_has_no_session_id_and_no_fork() -> None:
    # The real binary refuses --session-id with --resume unless --fork-session is given.
    a = argv(session_id="sid-1", resume="sid-1", fork=False)
    assert flag_value(a, "--resume") == "sid-1"
    assert "--session-id" not in a
    assert "--fork-session" not in a
    assert flag_value(a, "--model") == OPUS


def test_empty_disallowed_tools_and_effort_are_left_out() -> None:
    launch = dataclasses.replace(LAUNCH, disallowed_tools="", effort=None)
    a = ab.build_claude_argv("claude", launch, session_id="s", resume=None, fork=False,
                             mcp_config="m", system_prompt_file="p", max_budget_usd=None, max_turns=None)
    assert "--disallowedTools" not in a and "--effort" not in a
    assert "--max-budget-usd" not in a and "--max-turns" not in a


def test_argv_fingerprint_is_stable_across_per_call_values() -> None:
    one = argv(session_id="aaaa", mcp_config="/j1/mcp.json", system_prompt_file="/j1/sp.md",
               max_budget_usd=5.0, max_turns=200)
    two = ab.build_claude_argv("/other/claude", LAUNCH, session_id="bbbb", resume=None, fork=False,
                               mcp_config="/j2/mcp.json", system_prompt_file="/j2/sp.md",
                               max_budget_usd=1.25, max_turns=200)
    assert ab.argv_fingerprint(one) == ab.argv_fingerprint(two)
    forks = [argv(session_id=s, resume=r, fork=True) for s, r in (("n1", "b1"), ("n2", "b2"))]
    assert ab.argv_fingerprint(forks[0]) == ab.argv_fingerprint(forks[1])
    # A configuration change is a different fingerprint.
    other_model = ab.build_claude_argv("/bin/claude", dataclasses.replace(LAUNCH, model="claude-sonnet-4-5"),
                                       session_id="aaaa", resume=None, fork=False,
                                       mcp_config="/j1/mcp.json", system_prompt_file="/j1/sp.md",
                                       max_budget_usd=5.0, max_turns=200)
    assert ab.argv_fingerprint(one) != ab.argv_fingerprint(other_model)
    assert ab.argv_fingerprint(one) != ab.argv_fingerprint(forks[0])


# ---- transcripts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cwd,name", [
    ("/tmp/p2-pw_otg7j/ws", "-tmp-p2-pw-otg7j-ws"),       # NOTES §6
    ("/home/a.b/my work/x", "-home-a-b-my-work-x"),
    ("C:\\Users\\Ann\\ws", "C--Users-Ann-ws"),
])
def test_transcript_dir_name(cwd: str, name: str) -> None:
    assert ab.transcript_dir_name(cwd) == name


def test_transcript_path_follows_claude_config_dir(tmp_path) -> None:
    env = {"CLAUDE_CONFIG_DIR": str(tmp_path / "cfg")}
    p = ab.transcript_path(env, "/w/x", "sid")
    assert p == tmp_path / "cfg" / "projects" / "-w-x" / "sid.jsonl"


# ---- the binary's own per-call figure, study price overrides, exact model match ----------------

def _result(total, since_cost, model="claude-opus-4-5"):
    return {"type": "result", "subtype": "success", "is_error": False, "total_cost_usd": total,
            "usage": {"input_tokens": 10, "output_tokens": 5},
            "modelUsage": {model: {"inputTokens": 10, "outputTokens": 5, "costUSD": total}},
            "model_usage_since_last_result": {model: {"inputTokens": 10, "outputTokens": 5, "costUSD": since_cost}}}


def test_per_call_cost_wins_over_a_stale_prior():
    st = ab.StreamState()
    res = _result(total=0.30, since_cost=0.05)
    st.feed(json.dumps(res))
    # A prior of 0 (session record not yet written) would make the delta the whole session (0.30).
    rec = ab.usage_record(res, st, prior_cost=0.0, prior_model_usage=None, requested_model="claude-opus-4-5")
    assert rec["cost_delta_usd"] == pytest.approx(0.05)
    assert "prior_mismatch" in rec["flags"]
    # With the right prior both agree and nothing is flagged.
    rec = ab.usage_record(res, st, prior_cost=0.25, prior_model_usage=None, requested_model="claude-opus-4-5")
    assert rec["cost_delta_usd"] == pytest.approx(0.05) and "prior_mismatch" not in rec["flags"]


def test_several_results_in_one_process_add_their_stretches():
    st = ab.StreamState()
    first, last = _result(total=0.12, since_cost=0.02), _result(total=0.15, since_cost=0.03)
    st.feed(json.dumps(first))
    st.feed(json.dumps(last))
    rec = ab.usage_record(st.result, st, prior_cost=0.10, prior_model_usage=None, requested_model="claude-opus-4-5")
    assert rec["cost_delta_usd"] == pytest.approx(0.05) and "prior_mismatch" not in rec["flags"]


def test_study_prices_override_the_builtin_table():
    tokens = {"input": 1_000_000, "output": 0, "cache_creation": 0, "cache_read": 0}
    assert ab.estimate_cost_usd(tokens, "claude-opus-4-5") == pytest.approx(5.0)
    # 1M input tokens at a study's own price of $2/MTok for a model family the table lacks.
    assert ab.estimate_cost_usd(tokens, "claude-newfamily-9", {"claude-newfamily": [2, 8, 2.5, 4, 0.2]}) == pytest.approx(2.0)
    assert ab.estimate_cost_usd(tokens, "claude-opus-4-5", {"claude-opus-4-5": [1, 1, 1, 1, 1]}) == pytest.approx(1.0)


@pytest.mark.parametrize("requested,reported,same", [
    ("claude-sonnet-4-5", "claude-sonnet-4-5", True),
    ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", True),
    ("claude-sonnet-4-5-20250929", "claude-sonnet-4-5", True),
    ("claude-sonnet-4-5", "claude-sonnet-4", False),     # a prefix is another model
    ("claude-sonnet-4", "claude-sonnet-4-5", False),
    ("claude-opus-4-5", "claude-opus-4-5-extra", False),
])
def test_model_matches_is_exact_up_to_a_date_suffix(requested, reported, same):
    assert ab.model_matches(requested, reported) is same


def test_a_shorter_study_price_prefix_still_wins_over_the_table():
    tokens = {"input": 1_000_000, "output": 0, "cache_creation": 0, "cache_read": 0}
    # The built-in table knows claude-opus-4-5 ($5/MTok input); the study prices the whole family.
    assert ab.estimate_cost_usd(tokens, "claude-opus-4-5", {"claude-opus": [3, 9, 3, 3, 0.3]}) == pytest.approx(3.0)
