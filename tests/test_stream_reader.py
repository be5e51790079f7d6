"""The supervisor's stream reader: its fast path records exactly what the full path recorded.

The reader takes what claude's stdout pipe holds in one read, copies it to the raw file as it came,
and feeds the whole lines in it to StreamState under one hold of the lock; a line starting with `{`
is scanned by the JSON scanner directly (json.loads's own, without its per-call detour), usage in
the common shape is read without the per-count checks, and the running cost estimate prices a
message when a poll asks for it rather than at every event.  None of this may change a recorded
figure or flag: every test here feeds the same hostile lines through the fast path and through the
code it replaced (ReferenceStreamState below, each line through json.loads, each count through
count_from) and compares what each keeps, down to the job's final record.
"""
from __future__ import annotations

import io
import json
import math
import os
import random
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import agentbench as ab
from conftest import run_main

PLATFORM = ab.current_platform()
MODEL = "claude-opus-4-5"


# ---- the reference: the full path, as it was ------------------------------------------------------

def reference_tokens_from_usage(u: Mapping[str, Any] | None, anomalies: list[dict[str, Any]] | None = None,
                      where: str = "usage") -> dict[str, int]:
    """API-style usage (input_tokens, ...) to the ledger's token dict, 1h/5m split included.

    Every count goes through ab.count_from(): a hostile value (1e400, NaN, -5, true) counts 0 and is
    described in `anomalies`."""
    if type(u) is not dict:   # (a plain dict is a Mapping: the ABC check only for the rest)
        if u is not None and not isinstance(u, Mapping):
            ab.note_anomaly(anomalies, where, u, "not an object")
        u = u if isinstance(u, Mapping) else {}
    cc = u.get("cache_creation")
    if type(cc) is not dict:
        cc = cc if isinstance(cc, Mapping) else {}

    def num(x: Any, key: str) -> int:
        if x is None or (type(x) is int and 0 <= x <= ab.MAX_TOKEN_COUNT):   # the common cases, at once
            return x or 0
        return ab.count_from(x, anomalies=anomalies, where=f"{where}.{key}")
    total_cc = num(u.get("cache_creation_input_tokens"), "cache_creation_input_tokens")
    h1 = num(cc.get("ephemeral_1h_input_tokens"), "cache_creation.ephemeral_1h_input_tokens")
    m5 = num(cc.get("ephemeral_5m_input_tokens"), "cache_creation.ephemeral_5m_input_tokens")
    if total_cc and not (h1 or m5):
        m5 = total_cc
    return {"input": num(u.get("input_tokens"), "input_tokens"),
            "output": num(u.get("output_tokens"), "output_tokens"),
            "cache_creation": total_cc, "cache_creation_1h": h1, "cache_creation_5m": m5,
            "cache_read": num(u.get("cache_read_input_tokens"), "cache_read_input_tokens")}


def reference_json_object(raw: str | bytes) -> Any:
    """What the full path made of one stripped line: the object, or None (a bad line)."""
    try:
        ev = json.loads(raw)
    except UnicodeDecodeError:
        try:
            ev = json.loads(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
        except ValueError:
            return None
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


class ReferenceStreamState:
    """StreamState as it was before the reader's fast path (each line through json.loads, each
    revision re-priced at once): the oracle the fast path is compared with."""

    KNOWN_TYPES = frozenset({"system", "assistant", "user", "result", "stream_event", "rate_limit_event"})

    def __init__(self) -> None:
        self.init: dict[str, Any] | None = None
        self.messages: dict[str, dict[str, Any]] = {}
        self.message_order: list[str] = []
        self.tool_uses = 0
        self.tool_results = 0
        self.prices: Mapping[str, Sequence[float]] | None = None
        self.tool_calls: list[dict[str, Any]] = []
        self.models: list[str] = []
        self.results: list[dict[str, Any]] = []
        self.bad_lines = 0
        self.unknown_types = 0
        self.lines = 0
        self.session_id: str | None = None
        self.session_ids: list[str] = []     # every distinct session id the stream named (bounded)
        self.first_assistant_usage: dict[str, int] | None = None
        self.last_text = ""
        # The running cost estimate (see estimated_cost): micro-USD per message and their sum, at
        # the (fallback model, prices) they were priced with.
        self._cost_key: tuple[Any, ...] | None = None
        self._cost_micro: dict[str, int | None] = {}
        self._cost_total_micro: int | None = 0
        self.anomalies: list[dict[str, Any]] = []

    def feed(self, raw: str | bytes) -> dict[str, Any] | None:
        try:
            return self._feed(raw)
        except Exception as exc:  # the contract: feeding never raises, whatever the line holds
            self.bad_lines += 1
            ab.note_anomaly(self.anomalies, "stream", type(exc).__name__, "event could not be digested")
            return None

    def _feed(self, raw: str | bytes) -> dict[str, Any] | None:
        raw = raw.strip()
        if not raw:
            return None
        self.lines += 1
        ev = reference_json_object(raw)
        if ev is None:
            self.bad_lines += 1
            return None
        kind = ev.get("type")
        if kind not in self.KNOWN_TYPES:
            self.unknown_types += 1
            return ev
        if ev.get("session_id"):
            sid = str(ev["session_id"])[:200]
            self.session_id = self.session_id or sid
            if sid not in self.session_ids and len(self.session_ids) < 20:
                self.session_ids.append(sid)
        if kind == "system" and ev.get("subtype") == "init":
            self.init = ev
        elif kind == "assistant":
            self._assistant(ev)
        elif kind == "result":
            self.results.append(ev)
        elif kind == "user":
            message = ev.get("message")
            content = (message or {}).get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                self.tool_results += sum(1 for b in content
                                         if isinstance(b, dict) and b.get("type") == "tool_result")
        return ev

    def _assistant(self, ev: Mapping[str, Any]) -> None:
        msg = ev.get("message") or {}
        if not isinstance(msg, dict):
            return
        mid = str(msg.get("id") or f"anon-{len(self.message_order)}")
        usage = reference_tokens_from_usage(msg.get("usage"), self.anomalies, "assistant.usage")
        if mid not in self.messages:
            self.message_order.append(mid)
            self.messages[mid] = {"model": msg.get("model"), "tokens": usage}
            if self.first_assistant_usage is None and ev.get("parent_tool_use_id") is None:
                self.first_assistant_usage = usage
        else:
            old = self.messages[mid]["tokens"]
            self.messages[mid]["tokens"] = {k: max(old.get(k, 0), usage.get(k, 0)) for k in ab.TOKEN_KEYS}
        model = msg.get("model")
        if model and model != "<synthetic>" and model not in self.models:
            self.models.append(str(model))
        # Per-event output counts are an early snapshot (the final count only reaches the result
        # event).  No floor is guessed from the content's length: a 10 MB text line would be
        # estimated at tens of dollars and stop a session that reported cents.
        content = msg.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self.tool_uses += 1
                if len(self.tool_calls) < 2000:
                    self.tool_calls.append({"name": block.get("name"), "input": block.get("input")})
            elif isinstance(block, dict) and block.get("type") == "text":
                self.last_text = str(block.get("text") or "")[-2000:]
        self._reprice(mid)

    @property
    def result(self) -> dict[str, Any] | None:
        return self.results[-1] if self.results else None

    def message_tokens(self) -> dict[str, int]:
        total = {k: 0 for k in ab.TOKEN_KEYS}
        for mid in self.message_order:
            total = ab.add_tokens(total, self.messages[mid]["tokens"])
        return total

    def _message_cost_micro(self, mid: str, fallback_model: str | None) -> int | None:
        """One message's list-price cost in whole micro-USD (estimate_cost_usd rounds to 1e-6);
        None when it is not finite (token counts beyond any float)."""
        m = self.messages[mid]
        cost = ab.estimate_cost_usd(m["tokens"], m.get("model") or fallback_model, self.prices)
        return round(cost * 1e6) if math.isfinite(cost * 1e6) else None

    def _reprice(self, mid: str) -> None:
        """Keep the running total current after message `mid` was added or revised."""
        if self._cost_key is None:
            return
        old = self._cost_micro.get(mid, 0)
        new = self._message_cost_micro(mid, self._cost_key[0])
        self._cost_micro[mid] = new
        self._cost_total_micro = (None if old is None or new is None or self._cost_total_micro is None
                                  else self._cost_total_micro + new - old)

    def estimated_cost(self, fallback_model: str | None) -> float:
        """List-price cost of the messages seen (study `prices` overrides included).

        The sum of each message's cost rounded to 1e-6, kept as a running total: the first call
        (and a call with another fallback model or other prices) prices every message; from then
        on a message is re-priced only when it arrives or its tokens are revised, so a supervisor
        polling this stays linear in the session's length.  Whole micro-USD are summed, so the
        total does not drift whatever the order of revisions."""
        key = (fallback_model, json.dumps(self.prices, sort_keys=True, default=str))
        if self._cost_key != key or self._cost_total_micro is None:
            self._cost_key = key
            self._cost_micro = {mid: self._message_cost_micro(mid, fallback_model)
                                for mid in self.message_order}
            parts = list(self._cost_micro.values())
            self._cost_total_micro = None if None in parts else sum(parts)  # type: ignore[arg-type]
        if self._cost_total_micro is None:   # a non-finite part: the float sum, as it always was
            return round(sum(ab.estimate_cost_usd(self.messages[mid]["tokens"],
                                               self.messages[mid].get("model") or fallback_model, self.prices)
                             for mid in self.message_order), 6)
        return self._cost_total_micro / 1e6


# ---- the corpus ------------------------------------------------------------------------------------

SID = "3f1c9a2e-8b7d-4c11-9e0f-0a1b2c3d4e5f"


def _line(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def realistic(sid: str) -> list[bytes]:
    """Lines shaped as the real binary's: init, one message split over a text and a tool_use event,
    the tool's result, a synthetic API-error message, and the result."""
    usage = {"input_tokens": 1000, "cache_creation_input_tokens": 12078, "cache_read_input_tokens": 0,
             "cache_creation": {"ephemeral_5m_input_tokens": 12078, "ephemeral_1h_input_tokens": 0},
             "output_tokens": 1}
    mu = {MODEL: {"inputTokens": 1000, "outputTokens": 20, "cacheReadInputTokens": 0,
                  "cacheCreationInputTokens": 12078, "costUSD": 0.1304875}}
    msg = {"id": "msg_b5ed", "type": "message", "role": "assistant", "model": MODEL, "stop_reason": None,
           "usage": usage, "context_management": None}
    return [_line({"type": "system", "subtype": "init", "cwd": "/w", "session_id": sid, "tools": ["Bash", "Read"],
                   "mcp_servers": [], "model": MODEL, "permissionMode": "dontAsk", "apiKeySource": "ANTHROPIC_API_KEY",
                   "claude_code_version": "2.1.332", "output_style": "default", "agents": ["claude"],
                   "skills": [], "plugins": [{"name": "p", "path": "builtin"}]}),
            _line({"type": "assistant", "message": {**msg, "content": [{"type": "text", "text": "Working."}]},
                   "parent_tool_use_id": None, "session_id": sid, "uuid": "u1"}),
            _line({"type": "assistant", "message": {**msg, "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "true"}}]},
                "parent_tool_use_id": None, "session_id": sid, "uuid": "u2"}),
            _line({"type": "user", "message": {"role": "user", "content": [
                {"tool_use_id": "toolu_1", "type": "tool_result", "content": "(no output)", "is_error": False}]},
                "parent_tool_use_id": None, "session_id": sid, "tool_use_result": {"stdout": ""}}),
            _line({"type": "assistant", "message": {"id": "0fe0", "model": "<synthetic>", "role": "assistant",
                                                    "usage": {**usage, "server_tool_use": {"web_search_requests": 0},
                                                              "service_tier": None, "output_tokens": 0},
                                                    "content": [{"type": "text", "text": "API Error: 400 x"}]},
                   "parent_tool_use_id": None, "session_id": sid, "is_api_error_message": True}),
            _line({"type": "result", "subtype": "success", "is_error": False, "session_id": sid,
                   "total_cost_usd": 0.1304875, "num_turns": 2, "result": "done",
                   "usage": {**usage, "output_tokens": 20}, "modelUsage": mu,
                   "model_usage_since_last_result": mu})]


def _asst(mid: Any, usage: Any = None, **more: Any) -> bytes:
    return _line({"type": "assistant", "message": {"id": mid, "model": MODEL, "usage": usage, **more}})


HOSTILE: list[bytes] = [
    # not events at all
    b"", b"   ", b"\r", b"\t \x0b\x0c", b"not json {", b"[1, 2, 3]", b"null", b"42", b'"a string"', b"{", b"{}",
    b"{ }", b"}", b'{"type":"user"', b'{"type":"user"} x', b'{"type":"user"}{"type":"user"}',
    b'{"type":"user"}\x0b', b'\t {"type":"user"} \r', b'{"type":"user"}\x1c', b"{\x00\"type\":\"user\"}",
    # shapes of message and type
    b'{"type":"assistant"}', b'{"type":"assistant","message":"x"}', b'{"type":"assistant","message":[]}',
    b'{"type":"assistant","message":0}', b'{"type":"assistant","message":null}', b'{"type":"assistant","message":""}',
    b'{"type":[1]}', b'{"type":{"a":1}}', b'{"type":null}', b'{"type":5}', b'{"subtype":"init"}',
    b'{"type":"fake_unknown_event","session_id":"unknown-types-name-no-id"}',
    # escapes that a byte check would read wrongly
    b'{"typ\\u0065":"assistant","message":{"id":"esc1","usage":{"input_tok\\u0065ns":7}}}',
    b'{"type":"\\u0061ssistant","session_id":"\\u0022quoted\\u0022","message":{"id":"m\\u0022x",'
    b'"model":"claude-opus-4-5","usage":{"input_tokens":3}}}',
    b'{"type":"assistant","message":{"id":"txt","content":[{"type":"text","text":"{\\"usage\\":{\\"input_tokens'
    b'\\":999},\\"type\\":\\"result\\"}"}]}}',
    # session ids in odd places and of odd types
    b'{"type":"user","session_id":"other-session","message":{"content":[{"type":"tool_result","session_id":"n"}]}}',
    b'{"type":"stream_event","session_id":12,"event":{"type":"message_start","message":{"id":"m9",'
    b'"usage":{"input_tokens":99999}}}}',
    b'{"type":"rate_limit_event","session_id":["a"]}', b'{"type":"result","session_id":true}',
    b'{"type":"result","session_id":{"a":1},"subtype":"success","total_cost_usd":1e308,"usage":{"input_tokens":-1}}',
    b'{"type":"result","session_id":"../../study","is_error":true,"api_error_status":529,'
    b'"result":"API Error: 529 overloaded","total_cost_usd":NaN}',
    b'{"type":"result","session_id":"","total_cost_usd":Infinity,"usage":{"output_tokens":1e400}}',
    b'{"type":"system","subtype":"init","session_id":"' + b"x" * 300 + b'","model":"claude-other-1"}',
    # hostile numbers, in and around usage
    _asst("u1", None).replace(b"null", b'{"input_tokens":1e308,"output_tokens":-1,"cache_read_input_tokens":NaN,'
                                       b'"cache_creation_input_tokens":true}'),
    _asst("u2", {"input_tokens": 10 ** 11 + 1, "output_tokens": 10 ** 11}),
    _asst("u3", None).replace(b"null", b'{"input_tokens":' + b"9" * 400 + b"}"),
    _asst("u4", None).replace(b"null", b'{"input_tokens":-0,"output_tokens":0.0,"cache_read_input_tokens":1.5,'
                                       b'"cache_creation_input_tokens":"5"}'),
    _asst("u5", {"cache_creation_input_tokens": 40,
                 "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}),
    _asst("u6", {"cache_creation_input_tokens": 40,
                 "cache_creation": {"ephemeral_1h_input_tokens": 30, "ephemeral_5m_input_tokens": 10}}),
    _asst("u7", {"cache_creation_input_tokens": 40, "cache_creation": [1, 2]}),
    _asst("u8", {"cache_creation": {"ephemeral_1h_input_tokens": -5, "ephemeral_5m_input_tokens": None}}),
    _asst("u9", [1]), _asst("u10", 5), _asst("u11", "x"), _asst("u12", {"input_tokens": None, "output_tokens": False}),
    _asst("u13", {"input_tokens": True, "output_tokens": 3, "cache_creation": {"ephemeral_5m_input_tokens": 2.0}}),
    _asst("u14", {"input_tokens": 7, "cache_creation": "x", "usage": {"input_tokens": 10 ** 9}}),
    _asst("u15", {"input_tokens": -(2 ** 70), "output_tokens": 2 ** 70}),
    # revisions of one message: bigger, equal, smaller, hostile and repeated (its anomaly each time)
    _asst("rev", {"input_tokens": 5, "output_tokens": 1}), _asst("rev", {"input_tokens": 5, "output_tokens": 1}),
    _asst("rev", {"input_tokens": 3, "output_tokens": 9}), _asst("rev", {"input_tokens": 3, "output_tokens": 9}),
    _asst("rev", {"input_tokens": 4, "output_tokens": -9}), _asst("rev", {"input_tokens": 4, "output_tokens": -9}),
    _asst("u1", {"input_tokens": 2}), _asst("rev", {"input_tokens": 3, "output_tokens": 9}),
    # message ids: not strings, empty, absent
    _asst(5, {"input_tokens": 1}), _asst("5", {"input_tokens": 2}), _asst([1], {"input_tokens": 3}),
    _asst("", {"input_tokens": 4}), _asst(None, {"input_tokens": 5}), _asst(0, {"input_tokens": 6}),
    _line({"type": "assistant", "message": {"usage": {"input_tokens": 8}}}),
    # models
    _line({"type": "assistant", "message": {"id": "s1", "model": "<synthetic>", "usage": {"output_tokens": 1}}}),
    _line({"type": "assistant", "message": {"id": "s2", "model": "", "usage": {"output_tokens": 1}}}),
    _line({"type": "assistant", "message": {"id": "s3", "model": "claude-other-1", "usage": {"input_tokens": 10 ** 6}}}),
    _line({"type": "assistant", "message": {"id": "s4", "model": None, "usage": {"input_tokens": 10 ** 6}}}),
    _line({"type": "assistant", "parent_tool_use_id": "toolu_x",
           "message": {"id": "s5", "model": "claude-haiku-4-5", "usage": {"input_tokens": 10}}}),
    # content blocks
    _line({"type": "assistant", "message": {"id": "c1", "content": [
        {"type": "tool_use", "name": "Bash", "input": {"command": "ls"}}, "text", 5, None,
        {"type": "text", "text": 5}, {"type": "text", "text": None}, {"type": "text", "text": "é" * 3000},
        {"type": "tool_use"}, {"type": ["tool_use"]}]}}),
    _line({"type": "assistant", "message": {"id": "c2", "content": {"type": "tool_use"}}}),
    _line({"type": "assistant", "message": {"id": "c3", "content": [{"type": "tool_use", "name": f"t{i}"}
                                                                     for i in range(2100)]}}),
    _line({"type": "user", "message": {"content": [{"type": "tool_result"}, {"type": "text"}, 7,
                                                   {"type": "tool_result", "is_error": True}]}}),
    _line({"type": "user", "message": {"content": 7}}), _line({"type": "user", "message": [1]}),
    _line({"type": "user", "message": None}),
    # duplicate keys (the last wins, as json.loads reads them)
    b'{"type":"user","type":"assistant","message":{"id":"dup","usage":{"input_tokens":1,"input_tokens":2}}}',
    # encodings json.loads detects, bytes that are not UTF-8, surrogates
    b'\xef\xbb\xbf{"type":"result","session_id":"bom"}',
    '{"type":"result","session_id":"utf16"}'.encode("utf-16-le"),
    '{"type":"result","session_id":"utf16be"}'.encode("utf-16-be"),
    '{"type":"result","session_id":"utf32"}'.encode("utf-32"),
    '{"type":"result","session_id":"utf16-bom"}'.encode("utf-16"),
    b'{"type":"assistant","message":{"id":"\xff\xfe bad","model":"claude-opus-4-5\xc3","usage":{"input_tokens":4}}}',
    b'{"type":"assistant","message":{"id":"\xed\xa0\x80 surrogate","usage":{"input_tokens":4}}}',
    b'{"type":"user","session_id":"\\ud800 lone","message":{"content":"\\udfff"}}',
    b'{"type":"user","session_id":"\xc0\xaf overlong"}',
    # very long lines, deep nesting
    _asst("long", {"input_tokens": 1}, content=[{"type": "text", "text": "w" * 2_000_000}]),
    b"x" * 1_000_000, b'{"a":' * 30000 + b"1" + b"}" * 30000, b"[" * 30000 + b"]" * 30000,
    b'{"type":"user","x":' + b"[" * 30000 + b"]" * 30000 + b"}",
]


def corpus(sid: str = SID) -> list[bytes]:
    real = realistic(sid)
    return real[:3] + HOSTILE[:40] + real[3:] + HOSTILE[40:] + real[-1:]


def test_the_corpus_has_no_newline_inside_a_line() -> None:
    assert all(b"\n" not in ln for ln in corpus())


def snapshot(st: Any) -> dict[str, str]:
    """Everything a StreamState keeps that reaches a record, each part as a comparable text."""
    keep = {k: getattr(st, k) for k in ("init", "messages", "message_order", "tool_uses", "tool_results",
                                        "tool_calls", "models", "results", "bad_lines", "unknown_types",
                                        "lines", "session_id", "session_ids", "first_assistant_usage",
                                        "last_text", "anomalies")}
    keep["result"] = st.result
    keep["message_tokens"] = st.message_tokens()
    keep["estimated"] = [st.estimated_cost(m) for m in (MODEL, "claude-haiku-4-5", None, MODEL)]
    prices, st.prices = st.prices, {"claude": [1.0, 2.0, 3.0, 4.0, 0.5], "claude-haiku": [0.25, 1, 1, 1, 0.1]}
    keep["estimated_at_study_prices"] = st.estimated_cost(MODEL)
    st.prices = prices
    keep["usage_with_result"] = ab.usage_record(st.result, st, prior_cost=0.05, prior_model_usage=None,
                                                requested_model=MODEL)
    keep["usage_without_result"] = ab.usage_record(None, st, prior_cost=0.0, prior_model_usage=None,
                                                   requested_model=MODEL)
    return {k: json.dumps(v, sort_keys=True, default=repr) for k, v in keep.items()}


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    """The parts of two snapshots that differ, each shown short (a diff of megabytes is no help)."""
    return [f"{k}: {a.get(k, '')[:300]!r} != {b.get(k, '')[:300]!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def reference_of(lines: list[bytes] | list[str]) -> ReferenceStreamState:
    ref = ReferenceStreamState()
    for ln in lines:
        ref.feed(ln)
    return ref


# ---- the line parse --------------------------------------------------------------------------------

def test_a_line_is_read_as_json_loads_reads_it() -> None:
    """Every corpus line, as bytes and as text: the same object (or the same refusal, or the same
    exception) from json_object_line as from json.loads."""
    def outcome(parse: Any, raw: Any) -> str:
        try:
            return json.dumps(parse(raw), sort_keys=True)
        except RecursionError:
            return "RecursionError"
    checked = 0
    for ln in corpus():
        for raw in (ln.strip(), ln.decode("utf-8", "replace").strip(), ln.decode("latin-1").strip()):
            if raw:
                got, want = outcome(ab.json_object_line, raw), outcome(reference_json_object, raw)
                assert got == want, (raw[:200], got[:200], want[:200])
                checked += 1
    assert checked >= 3 * (len(corpus()) - 4)   # all but the blank lines


@pytest.mark.parametrize("usage", [
    None, 5, "x", [1], {}, {"input_tokens": 3}, {"input_tokens": 10 ** 11}, {"input_tokens": 10 ** 11 + 1},
    {"input_tokens": 2 ** 40, "output_tokens": 2 ** 40 - 1}, {"input_tokens": -1}, {"input_tokens": -(2 ** 80)},
    {"input_tokens": True}, {"input_tokens": 1.0}, {"input_tokens": float("nan")}, {"input_tokens": None},
    {"cache_creation_input_tokens": 9}, {"cache_creation_input_tokens": 9, "cache_creation": {}},
    {"cache_creation_input_tokens": 9, "cache_creation": {"ephemeral_1h_input_tokens": 9}},
    {"cache_creation_input_tokens": 9, "cache_creation": {"ephemeral_5m_input_tokens": 0,
                                                          "ephemeral_1h_input_tokens": 0}},
    {"cache_creation_input_tokens": 9, "cache_creation": None}, {"cache_creation": [1]},
    {"cache_creation": {"ephemeral_1h_input_tokens": -3}}, {"cache_creation": {"ephemeral_5m_input_tokens": 1e400}},
    {"input_tokens": 1, "output_tokens": 2, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 4,
     "cache_creation": {"ephemeral_5m_input_tokens": 1, "ephemeral_1h_input_tokens": 3}, "service_tier": "x"},
])
def test_usage_in_the_common_shape_is_read_as_the_checked_path_reads_it(usage: Any) -> None:
    fast: list[dict[str, Any]] = []
    full: list[dict[str, Any]] = []
    assert ab.tokens_from_usage(usage, fast, "u") == reference_tokens_from_usage(usage, full, "u")
    assert fast == full


# ---- the state ---------------------------------------------------------------------------------------

def test_the_fast_path_keeps_what_the_full_path_kept() -> None:
    lines = corpus()
    want = snapshot(reference_of(lines))
    one = ab.StreamState()
    for ln in lines:
        one.feed(ln)
    block = ab.StreamState()
    block.feed_lines(lines)
    text = [ln.decode("utf-8", "replace") for ln in lines]
    assert differing(snapshot(one), want) == []
    assert differing(snapshot(block), want) == []
    as_text = ab.StreamState()
    as_text.feed_lines(text)
    assert differing(snapshot(as_text), snapshot(reference_of(text))) == []


@pytest.mark.parametrize("seed", range(4))
def test_the_running_estimate_between_polls_is_the_full_paths_estimate(seed: int) -> None:
    """Lines in a shuffled order and in blocks of any size, a poll (an estimate) after each block:
    every estimate is the reference's (which re-priced at every event), and so is the end."""
    rng = random.Random(seed)
    lines = corpus()
    rng.shuffle(lines)
    fast, ref = ab.StreamState(), ReferenceStreamState()
    i = 0
    while i < len(lines):
        n = rng.choice([1, 1, 2, 5, 17, 60])
        fast.feed_lines(lines[i:i + n])
        for ln in lines[i:i + n]:
            ref.feed(ln)
        i += n
        fallback = rng.choice([MODEL, MODEL, "claude-haiku-4-5"])
        assert fast.estimated_cost(fallback) == ref.estimated_cost(fallback)
    assert differing(snapshot(fast), snapshot(ref)) == []


def test_a_message_model_that_is_not_a_string_is_noted_and_priced_at_the_fallback() -> None:
    """A model that is not a string used to stop the running estimate with an exception (a poll of
    a budgeted session then failed its supervisor).  Now it is an anomaly; the message is priced at
    the fallback model and the model is reported as the text it was, as before."""
    st = ab.StreamState()
    st.estimated_cost(MODEL)
    for model in (5, ["claude"], {"a": 1}):
        st.feed(_line({"type": "assistant", "message": {"id": f"m{model!s}", "model": model,
                                                          "usage": {"input_tokens": 10 ** 6}}}))
    assert st.bad_lines == 0
    assert st.estimated_cost(MODEL) == 3 * ab.estimate_cost_usd({"input": 10 ** 6}, MODEL)
    assert [a["where"] for a in st.anomalies] == ["assistant.message.model"] * 3
    assert st.models == ["5", "['claude']", "{'a': 1}"]


# ---- the reader: a pipe read as it comes ------------------------------------------------------------

def _study(tmp_path: Path) -> ab.StudyPaths:
    study = tmp_path / "s"
    assert run_main(["init", "--study", str(study)])[0] == 0
    return ab.StudyPaths(study)


def _supervisor(paths: ab.StudyPaths, limits: dict[str, Any] | None = None) -> ab.Supervisor:
    job = ab.create_job(paths, PLATFORM, ab.JobRequest(kind="executor", prompt="p", cwd=str(paths.root),
                                                       limits=limits or {}, system_prompt="s"),
                        ab.study_launch_spec(paths.root, {}),
                        launch=ab.launch_config(ab.load_study_config(paths)), binary="claude")
    return ab.Supervisor(paths, job["job_id"], PLATFORM)


def stream_bytes(sid: str) -> bytes:
    """The corpus as claude's stdout: LF and CRLF endings, a last line without its newline."""
    lines = corpus(sid)
    return (b"\n".join(ln + (b"\r" if i % 7 == 3 else b"") for i, ln in enumerate(lines))
            + b'\n{"type":"result","session_id":"the-last-line-has-no-newline"}')


def read_through_pipe(sup: ab.Supervisor, data: bytes, raw: Path, seed: int, poll: bool = False) -> None:
    """sup._reader on a pipe that a writer fills in pieces of random sizes (one byte to megabytes,
    so lines are cut anywhere, inside a UTF-8 character too); `poll`: _check runs meanwhile."""
    rng = random.Random(seed)
    r, w = os.pipe()

    def writer() -> None:
        with os.fdopen(w, "wb", buffering=0) as fh:
            i = 0
            while i < len(data):
                n = rng.choice([1, 2, 7, 100, 4096, 65536, 70000, 2_500_000])
                fh.write(data[i:i + n])
                i += n
    feeder = threading.Thread(target=writer, daemon=True)
    feeder.start()
    reader = threading.Thread(target=sup._reader, args=(os.fdopen(r, "rb"), raw), daemon=True)
    reader.start()
    while reader.is_alive():
        if poll:
            sup._check(None, None)
        reader.join(0.01)
    feeder.join(60)
    assert not feeder.is_alive()


@pytest.mark.parametrize("seed", range(3))
def test_the_reader_keeps_what_the_line_by_line_reader_kept_and_copies_every_byte(tmp_path: Path,
                                                                                 seed: int) -> None:
    paths = _study(tmp_path)
    sup = _supervisor(paths, {"max_budget_usd": 1000.0})   # a budget: every poll prices the messages
    data = stream_bytes(SID)
    raw = tmp_path / "raw.jsonl"
    read_through_pipe(sup, data, raw, seed, poll=True)
    assert raw.read_bytes() == data
    want = reference_of(list(io.BytesIO(data)))             # the old reader: readline by readline
    assert differing(snapshot(sup.state), snapshot(want)) == []
    assert "raw_copy_failed" not in sup.flags


def test_a_line_longer_than_many_reads_is_fed_once_whole(tmp_path: Path) -> None:
    paths = _study(tmp_path)
    sup = _supervisor(paths)
    big = _asst("big", {"input_tokens": 7}, content=[{"type": "text", "text": "y" * 5_000_000}])
    data = b"\n" + big + b"\n" + big[:-1]                    # a whole one, then one cut at the stream's end
    read_through_pipe(sup, data, tmp_path / "raw.jsonl", seed=9)
    assert (sup.state.lines, sup.state.bad_lines, sup.state.message_order) == (2, 1, ["big"])
    assert sup.state.last_text == "y" * 2000


# ---- the record: what the job's result says ---------------------------------------------------------

def _record(paths: ab.StudyPaths, sup: ab.Supervisor) -> dict[str, Any]:
    sup._finish(0, [])
    res = json.loads(paths.result_file(sup.job_id).read_text())
    text = json.dumps(res, sort_keys=True).replace(sup.job["session_id"], "<assigned>").replace(sup.job_id, "<job>")
    res = json.loads(text)
    for key in ("duration_s", "finished_at", "created_at", "started_at", "finished_ts", "raw_dir"):
        res.pop(key, None)
    return res


def test_the_final_record_is_the_full_paths_record(tmp_path: Path) -> None:
    """Two jobs, one stream (the corpus, with each job's own session id): one read by the reader,
    one fed line by line to the reference.  Their result records agree in every field."""
    paths = _study(tmp_path)
    fast, full = _supervisor(paths), _supervisor(paths)
    read_through_pipe(fast, stream_bytes(fast.job["session_id"]), tmp_path / "raw.jsonl", seed=3)
    full.state = ReferenceStreamState()  # type: ignore[assignment]
    for ln in io.BytesIO(stream_bytes(full.job["session_id"])):
        full.state.feed(ln)
    a, b = _record(paths, fast), _record(paths, full)
    assert {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)} == {}
    assert "session_id_mismatch" in a["flags"] and "unparseable_lines" in a["flags"]
    assert a["session_id"] == "<assigned>" and len(a["stream_session_ids"]) > 5


def test_without_a_budget_a_poll_prices_nothing_and_with_one_the_backstop_still_stops(tmp_path: Path) -> None:
    paths = _study(tmp_path)
    line = _asst("m1", {"input_tokens": 10 ** 6})           # $5 at list price
    free = _supervisor(paths)
    free.state.feed(line)
    free._check(None, None)
    assert free.end is None and free.state._cost_key is None
    capped = _supervisor(paths, {"max_budget_usd": 1.0})
    capped.state.feed(line)
    capped._check(None, None)
    assert capped.end == ("failed", "budget")


def test_whole_micro_usd_is_the_two_roundings_it_replaces() -> None:
    """Ties and near-ties (where the division's rounding decides), large and absurd figures, and
    random ones: the one-rounding answer is the two-rounding answer every time."""
    def two_roundings(micro: float) -> int | None:
        cost = round(micro / 1e6, 6) * 1e6
        return round(cost) if math.isfinite(cost) else None
    rng = random.Random(5)
    values = [0.0, 0.5, 1.5, 2.5, 1e6 + 0.5, 2.0 ** 49 + 0.5, 2.0 ** 50, 2.0 ** 50 - 0.5, 2.0 ** 60, 1e300,
              float("inf"), float("nan"), -0.0, -1.0, -2.5, 1e-300, 5e-324]
    for _ in range(20000):
        k = rng.choice([rng.randrange(10), rng.randrange(10 ** 6), rng.randrange(2 ** 50)])
        half = k + 0.5
        values += [half, math.nextafter(half, 0), math.nextafter(half, math.inf), k + rng.random(),
                   rng.random() * 10 ** rng.randrange(16)]
    for x in values:
        assert ab.whole_micro_usd(x) == two_roundings(x), x


@pytest.mark.parametrize("seed", range(6))
def test_the_running_estimate_answers_as_the_reference_does(seed: int) -> None:
    """The running estimate (each message priced once, a revised one again) against the reference's,
    and the budget comparison the supervisor makes with it at limits far below, just below, at, just
    above and far above it, between blocks of random messages (revised, of several models or none,
    with and without a cache-write split) and the hostile corpus."""
    rng = random.Random(seed)
    lines = corpus()
    for i in range(400):
        usage = {"input_tokens": rng.randrange(10 ** rng.randrange(1, 8)), "output_tokens": rng.randrange(5000),
                 "cache_read_input_tokens": rng.randrange(10 ** 6), "cache_creation_input_tokens": rng.randrange(9999)}
        if rng.random() < 0.5:
            usage["cache_creation"] = {"ephemeral_1h_input_tokens": rng.randrange(99),
                                       "ephemeral_5m_input_tokens": rng.randrange(99)}
        lines.append(_line({"type": "assistant", "message": {
            "id": f"r{rng.randrange(150)}", "usage": usage,
            "model": rng.choice([MODEL, "claude-haiku-4-5", "claude-sonnet-4-5", None, "unknown-model"])}}))
    rng.shuffle(lines)
    fast, ref = ab.StreamState(), ReferenceStreamState()
    if seed % 2:
        fast.prices = ref.prices = {"claude-haiku": [0.5, 2.5, 0.625, 1.0, 0.05]}
    checks = 0
    for i in range(0, len(lines), 23):
        fast.feed_lines(lines[i:i + 23])
        for ln in lines[i:i + 23]:
            ref.feed(ln)
        fallback = rng.choice([MODEL, "claude-haiku-4-5"])
        est = ref.estimated_cost(fallback)
        for limit in (0.0, est / 3, math.nextafter(est, 0), est, math.nextafter(est, math.inf), est + 1e-6,
                      est * 1.01 + 0.01, est * 3 + 1, 1e9):
            assert (fast.estimated_cost(fallback) > limit) is (est > limit), (est, limit)
            checks += 1
        assert fast.estimated_cost(fallback) == est
    assert checks > 100


def test_every_message_is_rounded_up_in_the_estimate() -> None:
    """Each message's cost rounds up (3 cache-write tokens at 6.25 a million: 18.75 micro-USD,
    rounded to 19): the estimate exceeds the plain token sum by 500 micro-USD over 2,000 messages,
    as the reference's does."""
    fast, ref = ab.StreamState(), ReferenceStreamState()
    for i in range(2000):
        ln = _asst(f"m{i}", {"cache_creation_input_tokens": 3})
        fast.feed(ln)
        ref.feed(ln)
    est = ref.estimated_cost(MODEL)
    plain = 2000 * 3 * ab.price_for(MODEL)[2] / 1e6
    assert est - plain > 0.0004
    assert fast.estimated_cost(MODEL) == est


def test_a_usage_nested_as_deep_as_the_parse_allows_twice_is_read_as_before() -> None:
    """The same usage, nested as deep as the full path still parses, in three events of one
    message: the fast path (which compares each with the last to skip a repeated snapshot) keeps
    what the full path kept at every depth up to that limit."""
    def line(depth: int) -> bytes:
        return (b'{"type":"assistant","message":{"id":"deep","usage":{"input_tokens":3,"x":'
                + b"[" * depth + b"]" * depth + b"}}}")
    lo, hi = 1, 100000      # the deepest usage this stack parses through json.loads (the scanner
    while lo < hi:          # called directly parses a few levels more: one frame less per level)
        mid = (lo + hi + 1) // 2
        ok = reference_of([line(mid)]).bad_lines == 0   # (at the depth of the comparison below)
        lo, hi = (mid, hi) if ok else (lo, mid - 1)
    for depth in range(max(1, lo - 12), lo + 1):
        lines = [line(depth), line(depth), line(depth)]
        fast = ab.StreamState()
        fast.feed_lines(lines)
        assert differing(snapshot(fast), snapshot(reference_of(lines))) == [], depth
