"""The metering gateway, in process: its pure metering and reservation rules (tables), and the
server itself between an HTTP client and a loopback upstream (a recording stub, or the scripted
model): the job token, the credential swap, byte-for-byte streaming, metering, refusals, TLS."""
from __future__ import annotations

import http.client
import http.server
import io
import json
import shutil
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ab, run_main

PLAT = ab.current_platform()
REAL_KEY = "sk-ant-gateway-test-REAL-0123456789"
PRICES = {"claude-test": [2.0, 10.0, 2.5, 4.0, 0.2]}


def sse(*events: tuple[str, dict]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "model": "claude-test", "usage": {
        "input_tokens": 100, "output_tokens": 1, "cache_read_input_tokens": 1000,
        "cache_creation_input_tokens": 300,
        "cache_creation": {"ephemeral_5m_input_tokens": 200, "ephemeral_1h_input_tokens": 100}}}})
DELTA = ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "message_delta in a text"}})
END = ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                         "usage": {"output_tokens": 50}})
STOP = ("message_stop", {"type": "message_stop"})
#: 100 in at 2, 50 out at 10, 200 5m writes at 2.5, 100 1h writes at 4, 1000 reads at 0.2 ($/Mtok)
EXPECTED_COST = round((100 * 2.0 + 50 * 10.0 + 200 * 2.5 + 100 * 4.0 + 1000 * 0.2) / 1e6, 6)


# ---- pure rules ------------------------------------------------------------------------------------

def test_sse_meter_reads_usage_split_across_chunks():
    data = sse(START, DELTA, END, STOP)
    for size in (1, 7, 64, len(data)):
        m = ab.SseMeter()
        for i in range(0, len(data), size):
            m.feed(data[i:i + size])
        tokens = ab.tokens_from_usage(m.usage)
        assert tokens == {"input": 100, "output": 50, "cache_creation": 300, "cache_creation_1h": 100,
                          "cache_creation_5m": 200, "cache_read": 1000}, size
        assert m.model == "claude-test" and not m.bad and m.error is None
        assert ab.estimate_cost_usd(tokens, m.model, PRICES) == EXPECTED_COST


@pytest.mark.parametrize("events, tokens_out, bad, error", [
    ([START, STOP], 1, False, None),                                    # cut before message_delta
    ([START, ("message_delta", {"type": "message_delta", "usage": {"output_tokens": -5}}), STOP], 1, True, None),
    ([START, ("message_delta", {"type": "message_delta", "usage": {"output_tokens": "9"}}), STOP], 1, True, None),
    ([START, ("message_delta", {"type": "message_delta", "usage": {"output_tokens": True}}), STOP], 1, True, None),
    ([START, ("error", {"type": "error", "error": {"type": "overloaded_error"}})], 1, False, "overloaded_error"),
])
def test_sse_meter_table(events, tokens_out, bad, error):
    m = ab.SseMeter()
    m.feed(sse(*events))
    assert ab.tokens_from_usage(m.usage)["output"] == tokens_out
    assert m.bad is bad and m.error == error


def test_sse_meter_survives_garbage():
    m = ab.SseMeter()
    m.feed(b"data: {not json message_start\n\ndata: [1,2]\n\n\xff\xfe\n")
    assert m.usage == {} and m.bad


@pytest.mark.parametrize("body, usage, model, bad", [
    (json.dumps({"model": "claude-test", "usage": {"input_tokens": 5, "output_tokens": 7}}).encode(),
     {"input_tokens": 5, "output_tokens": 7}, "claude-test", False),
    (b"not json", {}, None, True),
    (b"[]", {}, None, True),
    (json.dumps({"usage": {"input_tokens": 1.5}}).encode(), {}, None, True),
])
def test_message_meter_table(body, usage, model, bad):
    assert ab.message_meter(body) == (usage, model, bad)


@pytest.mark.parametrize("input_tokens, max_tokens, expected", [
    (0, 0, 0.0),
    (1000, 0, round(1000 * 4.0 / 1e6, 6)),        # input at the dearest input-side price (1h write)
    (0, 1000, round(1000 * 10.0 / 1e6, 6)),
    (1001, 1000, round((1001 * 4.0 + 1000 * 10.0) / 1e6, 6)),
])
def test_worst_case_usd(input_tokens, max_tokens, expected):
    assert ab.worst_case_usd(input_tokens, max_tokens, "claude-test", PRICES) == expected


def _msg(*content, **top) -> dict:
    return {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": list(content)}],
            **top}


IMG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
TXT = {"type": "text", "text": "hello"}


@pytest.mark.parametrize("req, extra_tokens, unbounded", [
    (_msg(TXT), 0, ()),
    (_msg(TXT, IMG), ab.GATEWAY_IMAGE_TOKENS, ()),                       # an image: a fixed allowance
    (_msg({"type": "tool_result", "tool_use_id": "t", "content": [IMG, IMG]}), 2 * ab.GATEWAY_IMAGE_TOKENS, ()),
    (_msg({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}), 0, ()),
    (_msg({"type": "document", "source": {"type": "content", "content": [TXT, IMG]}}),
     ab.GATEWAY_IMAGE_TOKENS, ()),
    (_msg({"type": "search_result", "source": "https://example.com/a", "title": "t", "content": [TXT]}), 0, ()),
    (_msg(TXT, tools=[{"name": "Bash", "input_schema": {"type": "object"}},
                      {"type": "custom", "name": "x", "input_schema": {"type": "object"}},
                      {"type": "bash_20250124", "name": "bash"}]), ab.GATEWAY_CLIENT_TOOL_TOKENS, ()),
    # what the body does not bound, by name
    (_msg(TXT, tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]), 0,
     ("server_tool:web_search_20250305",)),
    (_msg(TXT, tools=[{"type": "web_fetch_20250910", "name": "web_fetch"},
                      {"type": "code_execution_20250825", "name": "code_execution"}]), 0,
     ("server_tool:code_execution_20250825", "server_tool:web_fetch_20250910")),
    (_msg(TXT, tools=[{"type": "tool_search_tool_regex_20251119", "name": "tool_search"}]), 0,
     ("server_tool:tool_search_tool_regex_20251119",)),
    (_msg(TXT, tools=[{"type": "mcp_toolset", "mcp_server_name": "m"}]), 0, ("server_tool:mcp_toolset",)),
    (_msg(TXT, tools=[{"type": "something_new_2027", "name": "n"}]), 0, ("server_tool:something_new_2027",)),
    (_msg(TXT, mcp_servers=[{"type": "url", "url": "https://mcp.example.com", "name": "m"}]), 0,
     ("mcp_servers",)),
    (_msg(TXT, container="container_011"), 0, ("container",)),
    (_msg(TXT, speed="fast"), 0, ("speed:fast",)),
    (_msg(TXT, speed="standard"), 0, ()),
    (_msg({"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}),
     ab.GATEWAY_IMAGE_TOKENS, ("url_source",)),
    (_msg({"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}), 0,
     ("url_source",)),
    (_msg({"type": "document", "source": {"type": "file", "file_id": "file_011"}}), 0,
     ("file_id", "file_source")),
    (_msg({"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}), 0, ("pdf_document",)),
    (_msg({"type": "container_upload", "file_id": "file_1"}), 0, ("container_upload", "file_id")),
    (_msg({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}), ab.GATEWAY_IMAGE_TOKENS,
     ("file_id", "file_source")),                                          # found however deep
    ({"model": "claude-test", "max_tokens": 10, "system": [{"type": "text", "text": "s"}, IMG],
      "messages": []}, ab.GATEWAY_IMAGE_TOKENS, ()),
    # a tool call's input is data (the model's JSON), whatever keys it has
    (_msg({"type": "tool_use", "id": "t", "name": "fetch", "input": {
        "source": {"type": "url", "url": "https://example.com"}, "file_id": "f", "type": "container_upload"}}),
     0, ()),
])
def test_request_bound_table(req, extra_tokens, unbounded):
    body = json.dumps(req).encode()
    got = ab.request_bound(body, "default-model")
    assert got.unbounded == unbounded
    assert got.input_tokens == len(body) + ab.GATEWAY_OVERHEAD_TOKENS + extra_tokens
    assert (got.model, got.max_tokens) == ("claude-test", 10)


DEEP = b'{"messages": [' + b'{"content": [' * 5000 + b'{"type": "image", "source": {"type": "url"}}' + \
    b']}' * 5000 + b']}'


@pytest.mark.parametrize("body, model, max_tokens, stream, readable", [
    (b"", "default-model", ab.GATEWAY_DEFAULT_MAX_TOKENS, False, False),
    (b"not json", "default-model", ab.GATEWAY_DEFAULT_MAX_TOKENS, False, False),
    (b"[]", "default-model", ab.GATEWAY_DEFAULT_MAX_TOKENS, False, False),
    (DEEP, "default-model", ab.GATEWAY_DEFAULT_MAX_TOKENS, False, False),   # deeper than json.loads goes
    (json.dumps({"model": 5, "max_tokens": True, "stream": 1}).encode(), "default-model",
     ab.GATEWAY_DEFAULT_MAX_TOKENS, True, True),
    (json.dumps({"model": "m", "max_tokens": -3}).encode(), "m", ab.GATEWAY_DEFAULT_MAX_TOKENS, False, True),
    (json.dumps({"model": "m", "max_tokens": 7, "tools": "x", "messages": {"a": [1, None]}}).encode(), "m", 7,
     False, True),
])
def test_request_bound_of_odd_bodies(body, model, max_tokens, stream, readable):
    got = ab.request_bound(body, "default-model")
    assert (got.model, got.max_tokens, got.stream, got.unbounded) == (model, max_tokens, stream, ())
    assert got.readable is readable
    assert got.input_tokens == len(body) + ab.GATEWAY_OVERHEAD_TOKENS


def test_a_deeply_nested_body_is_walked_without_recursion():
    depth = 300    # within json's reach, beyond a comfortable recursion
    body = (b'{"messages": [' + b'{"type": "tool_result", "content": [' * depth
            + b'{"type": "image", "source": {"type": "url", "url": "u"}}' + b']}' * depth + b']}')
    got = ab.request_bound(body, None)
    assert got.readable and got.unbounded == ("url_source",)


@pytest.mark.parametrize("worst, run_cap, run_used, study_cap, study_used, limit", [
    (1.0, 5.0, 0.0, None, 0.0, None),
    (1.0, 5.0, 4.0, None, 0.0, None),              # exactly fits
    (1.0, 5.0, 4.5, None, 0.0, "usd_per_run"),
    (1.0, None, 100.0, None, 0.0, None),           # no caps at all
    (1.0, 5.0, 0.0, 10.0, 9.5, "study_usd"),
    (1.0, 5.0, 2.0, 10.0, 7.0, None),              # 7 + 2 + 1 = 10 fits
    (1.0, 5.0, 2.5, 10.0, 7.0, "study_usd"),
    (1.0, 0.5, 0.0, 10.0, 9.5, "usd_per_run"),     # the run's limit is named first
])
def test_reservation_refusal(worst, run_cap, run_used, study_cap, study_used, limit):
    got = ab.reservation_refusal(worst, run_cap=run_cap, run_used=run_used, study_cap=study_cap,
                                 study_used=study_used)
    assert (got or {}).get("limit") == limit


@pytest.mark.parametrize("metered, reported, flagged", [
    (1.0, 1.0, False), (1.0, 1.004, False), (1.0, 1.01, True), (0.0, 0.00005, False),
    (0.0, 0.001, True), (None, 1.0, False), (1.0, None, False),
])
def test_cost_mismatch(metered, reported, flagged):
    assert ab.cost_mismatch(metered, reported) is flagged


@pytest.mark.parametrize("usage, billed", [
    ({"cost_delta_usd": 2.0, "cost_metered_usd": 1.5, "requests": 3}, 1.5),
    ({"cost_delta_usd": 2.0, "cost_metered_usd": 0.0, "requests": 0}, 2.0),   # nothing went through it
    ({"cost_delta_usd": 2.0, "cost_metered_usd": None}, 2.0),
    ({"cost_delta_usd": 2.0}, 2.0),
    ({"cost_delta_usd": 2.0, "cost_metered_usd": float("nan"), "requests": 1}, 2.0),
    (None, 0.0),
])
def test_billed_cost_usd(usage, billed):
    assert ab.billed_cost_usd(usage) == billed


@pytest.mark.parametrize("creds, headers", [
    ({"ANTHROPIC_API_KEY": "k"}, [("x-api-key", "k")]),
    ({"ANTHROPIC_AUTH_TOKEN": "t"}, [("authorization", "Bearer t")]),
    ({"ANTHROPIC_API_KEY": "k", "ANTHROPIC_AUTH_TOKEN": "t"}, [("x-api-key", "k")]),
    ({"ANTHROPIC_CUSTOM_HEADERS": "X-Org: acme\nbad header\nX-Two:  2 "}, [("X-Org", "acme"), ("X-Two", "2")]),
    ({}, []),
])
def test_gateway_auth_headers(creds, headers):
    assert ab.gateway_auth_headers(creds) == headers


@pytest.mark.parametrize("headers, token, ok", [
    ({"x-api-key": "abc"}, "abc", True),
    ({"authorization": "Bearer abc"}, "abc", True),
    ({"authorization": "bearer abc"}, "abc", True),
    ({"x-api-key": "abd"}, "abc", False),
    ({"authorization": "Basic abc"}, "abc", False),
    ({}, "abc", False),
    ({"x-api-key": ""}, "", False),
])
def test_token_check(headers, token, ok):
    assert ab.token_matches(ab.presented_token(headers), token) is ok


@pytest.mark.parametrize("url, parts", [
    (None, ("https", "api.anthropic.com", 443, "")),
    ("http://127.0.0.1:8080", ("http", "127.0.0.1", 8080, "")),
    ("https://proxy.example/anthropic/", ("https", "proxy.example", 443, "/anthropic")),
])
def test_gateway_upstream(url, parts):
    assert ab.gateway_upstream(url) == parts


@pytest.mark.parametrize("url", ["ftp://x", "no-scheme", "http://", "http://h:99999"])
def test_gateway_upstream_refuses_bad_urls(url):
    with pytest.raises(ab.AgentbenchError):
        ab.gateway_upstream(url)


def test_summarize_metering_per_model():
    recs = [{"kind": "messages", "model": "a", "cost_usd": 0.5, "tokens": {"input": 1}},
            {"kind": "messages", "model": "b", "cost_usd": 0.25, "tokens": {"output": 2}},
            {"kind": "messages", "model": "a", "cost_usd": 0.125, "tokens": {"input": 3}},
            {"kind": "count_tokens", "cost_usd": 9.0}, {"kind": "other", "status": 401}]
    out = ab.summarize_metering(recs)
    assert out["cost_metered_usd"] == 0.875 and out["requests"] == 3
    assert out["models_metered"]["a"]["requests"] == 2 and out["models_metered"]["a"]["tokens"]["input"] == 4
    assert out["models_metered"]["b"]["cost_usd"] == 0.25


# ---- the server ------------------------------------------------------------------------------------

class Upstream:
    """A recording stub upstream: answers /v1/messages with fixed SSE bytes in several writes
    (or JSON when not streaming), count_tokens with JSON, anything else with 404."""

    def __init__(self, stream_body: bytes, tls: tuple[str, str] | None = None):
        self.stream_body = stream_body
        self.requests: list[dict] = []
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                up.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path.endswith("/count_tokens"):
                    return self._json(200, {"input_tokens": 42})
                req = json.loads(body or b"{}")
                if not req.get("stream"):
                    return self._json(200, {"id": "msg_2", "model": "claude-test",
                                            "usage": {"input_tokens": 10, "output_tokens": 20}})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("request-id", "req_stub_1")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                data = up.stream_body
                for i in range(0, len(data), 97):
                    part = data[i:i + 97]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def do_GET(self):
                up.requests.append({"path": self.path, "headers": dict(self.headers), "body": b""})
                self._json(404, {"type": "error", "error": {"type": "not_found_error"}})

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("request-id", "req_stub_2")
                self.end_headers()
                self.wfile.write(data)

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        scheme = "http"
        if tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.srv.socket = ctx.wrap_socket(self.srv.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def upstream():
    up = Upstream(sse(START, DELTA, END, STOP))
    yield up
    up.close()


def make_gateway(tmp_path: Path, upstream_url: str, budget=None, creds=None) -> ab.MeteringGateway:
    gw = ab.MeteringGateway(upstream=upstream_url, creds=creds if creds is not None else {"ANTHROPIC_API_KEY": REAL_KEY},
                            prices=PRICES, record_path=tmp_path / "gateway.jsonl", budget=budget,
                            default_model="claude-test")
    gw.start()
    return gw


def post(gw: ab.MeteringGateway, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes, dict]:
    host, port = gw.url.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    hdrs = {"content-type": "application/json", "x-api-key": gw.token} if headers is None else headers
    conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}


def records(tmp_path: Path, n: int = 1) -> list[dict]:
    """The gateway's records once there are at least n (a record is written after the answer's
    last byte, so the client can be a moment ahead of it)."""
    path = tmp_path / "gateway.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists():
            recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
            if len(recs) >= n:
                return recs
        time.sleep(0.01)
    raise AssertionError(f"fewer than {n} gateway records")


def test_a_request_without_the_job_token_gets_401_and_is_not_forwarded(tmp_path, upstream):
    gw = make_gateway(tmp_path, upstream.url)
    try:
        for headers in ({}, {"x-api-key": "abgw-other-job"}, {"authorization": "Bearer " + REAL_KEY},
                        {"x-api-key": gw.token + "x"}):
            status, data, _ = post(gw, "/v1/messages", {"model": "claude-test", "max_tokens": 10}, headers)
            assert status == 401 and json.loads(data)["error"]["type"] == "authentication_error"
        assert upstream.requests == []
        assert [r["status"] for r in records(tmp_path, 4)] == [401] * 4
    finally:
        gw.stop()


def test_a_stream_passes_byte_for_byte_with_the_credential_swapped_and_is_metered(tmp_path, upstream):
    gw = make_gateway(tmp_path, upstream.url)
    try:
        status, data, headers = post(gw, "/v1/messages?beta=true",
                                     {"model": "claude-test", "max_tokens": 100, "stream": True},
                                     {"x-api-key": gw.token, "anthropic-version": "2023-06-01",
                                      "content-type": "application/json"})
        assert status == 200 and data == upstream.stream_body
        assert headers["request-id"] == "req_stub_1" and "text/event-stream" in headers["content-type"]
        seen = upstream.requests[-1]["headers"]
        seen = {k.lower(): v for k, v in seen.items()}
        assert seen["x-api-key"] == REAL_KEY and seen["anthropic-version"] == "2023-06-01"
        assert gw.token not in json.dumps(seen) and upstream.requests[-1]["path"] == "/v1/messages?beta=true"
        rec = records(tmp_path)[-1]
        assert rec["cost_usd"] == EXPECTED_COST and rec["request_id"] == "req_stub_1"
        assert rec["tokens"]["cache_creation_1h"] == 100 and rec["tokens"]["output"] == 50
        assert rec["model"] == "claude-test" and rec["status"] == 200 and rec["chunks"] >= 1
        assert REAL_KEY not in (tmp_path / "gateway.jsonl").read_text()
        assert gw.summary()["cost_metered_usd"] == EXPECTED_COST
    finally:
        gw.stop()


def test_non_streamed_answers_and_count_tokens_are_forwarded_and_other_paths_refused(tmp_path, upstream):
    gw = make_gateway(tmp_path, upstream.url, creds={"ANTHROPIC_AUTH_TOKEN": REAL_KEY})
    try:
        status, data, _ = post(gw, "/v1/messages", {"model": "claude-test", "max_tokens": 100})
        assert status == 200 and json.loads(data)["usage"]["output_tokens"] == 20
        status, data, _ = post(gw, "/v1/messages/count_tokens", {"model": "claude-test"})
        assert status == 200 and json.loads(data) == {"input_tokens": 42}
        host, port = gw.url.rsplit("/", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v1/models", headers={"authorization": "Bearer " + gw.token})
        assert conn.getresponse().status == 403          # refused here, never sent upstream
        conn.close()
        assert len(upstream.requests) == 2
        assert all({k.lower(): v for k, v in r["headers"].items()}["authorization"] == "Bearer " + REAL_KEY
                   for r in upstream.requests)
        # (an answer is recorded after its last byte: the order of records may differ from the calls')
        recs = sorted(records(tmp_path, 3), key=lambda r: ["messages", "count_tokens", "other"].index(r["kind"]))
        assert [r["kind"] for r in recs] == ["messages", "count_tokens", "other"]
        assert recs[0]["cost_usd"] == round((10 * 2.0 + 20 * 10.0) / 1e6, 6)
        assert gw.summary()["requests"] == 1
    finally:
        gw.stop()


def test_a_request_that_does_not_fit_the_budget_is_refused_with_a_final_400(tmp_path, upstream):
    paths = ab.StudyPaths(tmp_path / "study")
    paths.state.mkdir(parents=True)
    # Worst case of one request: ~40 bytes of body at $4/Mtok + 100_000 output tokens at $10/Mtok = ~$1.
    budget = ab.GatewayBudget(paths, PLAT, "j000001", run_cap=1.5, study_cap=None)
    gw = make_gateway(tmp_path, upstream.url, budget=budget)
    try:
        body = {"model": "claude-test", "max_tokens": 100_000, "stream": True}
        assert post(gw, "/v1/messages", body)[0] == 200
        status, data, _ = post(gw, "/v1/messages", dict(body, max_tokens=200_000))
        err = json.loads(data)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and "budget" in err["message"]
        assert len(upstream.requests) == 1                # the refused request never went out
        assert gw.refusal["limit"] == "usd_per_run"
        # (the first answer is recorded after its last byte: possibly after the refusal)
        assert [r.get("refused") for r in records(tmp_path, 2)].count("usd_per_run") == 1
        assert budget.metered == EXPECTED_COST and budget.reserved == 0.0
        live = json.loads((paths.state / "gateway" / "j000001.json").read_text())
        assert live["metered_usd"] == EXPECTED_COST and live["reserved_usd"] == 0.0
    finally:
        gw.stop()


def test_the_study_cap_counts_the_ledger_and_every_live_job(tmp_path):
    paths = ab.StudyPaths(tmp_path / "study")
    paths.state.mkdir(parents=True)
    reg = ab.read_registry(paths)
    reg["spent_usd"] = 4.0
    ab.write_json_atomic(paths.registry, reg)
    a = ab.GatewayBudget(paths, PLAT, "j000001", run_cap=None, study_cap=10.0)
    b = ab.GatewayBudget(paths, PLAT, "j000002", run_cap=None, study_cap=10.0)
    assert a.reserve(3.0) is None                     # 4 + 3 = 7
    assert b.reserve(3.5)["limit"] == "study_usd"     # 4 + 3 + 3.5 > 10
    a.settle(3.0, 1.0)                                # a's answer cost 1: 4 + 1 = 5
    assert b.reserve(3.5) is None                     # 5 + 3.5 = 8.5
    assert ab.live_reservations_usd(paths, exclude="j000002") == 1.0
    # Once a job's ledger line is written the ledger counts it, not its reservation file.
    (paths.job_dir("j000001")).mkdir(parents=True)
    (paths.job_dir("j000001") / "ledgered").touch()
    assert ab.live_reservations_usd(paths, exclude="j000002") == 0.0
    a.discard()
    assert not a.file.exists()
    # A garbled or hostile reservation file cannot add a negative amount ...
    (paths.state / "gateway" / "j000009.json").write_text('{"metered_usd": -100, "reserved_usd": null}')
    assert ab.live_reservations_usd(paths) == 3.5
    # ... and an amount that is no believable number fails closed: it spends the cap.
    (paths.state / "gateway" / "j000009.json").write_text('{"metered_usd": "x", "reserved_usd": 1e400}')
    assert ab.live_reservations_usd(paths) == 3.5 + 2 * ab.MAX_USD_VALUE


def test_the_scripted_model_as_upstream_is_metered_at_the_study_prices(tmp_path, server):
    server.add_script("s1", {"steps": [{"text": "hi", "usage": {"input_tokens": 1234, "output_tokens": 567,
                                                                "cache_read_input_tokens": 89}}]})
    gw = make_gateway(tmp_path, server.url, creds={"ANTHROPIC_API_KEY": "rehearsal"})
    try:
        body = {"model": "claude-test", "max_tokens": 1000, "stream": True,
                "messages": [{"role": "user", "content": "go [agentbench-script:s1]"}],
                "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}
        status, data, _ = post(gw, "/v1/messages", body)
        assert status == 200 and b"message_stop" in data
        rec = records(tmp_path)[-1]
        assert rec["tokens"]["input"] == 1234 and rec["tokens"]["output"] == 567 and rec["tokens"]["cache_read"] == 89
        assert rec["cost_usd"] == round((1234 * 2.0 + 567 * 10.0 + 89 * 0.2) / 1e6, 6)
    finally:
        gw.stop()


def test_an_https_upstream_is_verified(tmp_path, monkeypatch):
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    up = Upstream(sse(START, END, STOP), tls=(str(cert), str(key)))
    try:
        gw = make_gateway(tmp_path, up.url)
        try:   # an unknown certificate: refused, nothing forwarded
            status, _, _ = post(gw, "/v1/messages", {"model": "claude-test", "max_tokens": 10, "stream": True})
            assert status == 502 and up.requests == []
        finally:
            gw.stop()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        gw = make_gateway(tmp_path, up.url)
        try:
            status, data, _ = post(gw, "/v1/messages", {"model": "claude-test", "max_tokens": 10, "stream": True})
            assert status == 200 and data == up.stream_body
        finally:
            gw.stop()
    finally:
        up.close()


@pytest.mark.skipif(sys.platform == "win32", reason="the dying holder here uses flock")
def test_the_reservation_lock_excludes_a_second_holder_and_frees_on_exit(tmp_path):
    lock = tmp_path / "lock"
    with PLAT.file_lock(lock):
        with pytest.raises(ab.AgentbenchError, match="lock timed out"):
            with PLAT.file_lock(lock, timeout_s=0.05):
                pass
    with PLAT.file_lock(lock, timeout_s=0.05):
        pass
    # A holder that dies frees it (the OS releases the lock with the process).
    child = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                              "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                              "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                              str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(ab.AgentbenchError):
            with PLAT.file_lock(lock, timeout_s=0.05):
                pass
    finally:
        child.kill()
        child.wait()
    with PLAT.file_lock(lock, timeout_s=10):
        pass


def test_gateway_proof_of_a_rehearsal():
    lines = [{"job_id": "j1", "status": "ok", "requests": 3, "cost_metered_usd": 0.5, "cost_delta_usd": 0.5, "flags": []},
             {"job_id": "j2", "status": "ok", "requests": 0, "cost_metered_usd": 0.0, "cost_delta_usd": 0.2, "flags": []},
             {"job_id": "j3", "status": "failed", "requests": 1, "cost_metered_usd": 0.1, "cost_delta_usd": 0.3,
              "flags": ["cost_mismatch"]},
             {"job_id": "j4", "status": "killed", "cost_delta_usd": 0.0}]
    proof = ab.gateway_proof(lines)
    assert proof["jobs"] == 4 and proof["metered_jobs"] == 2 and proof["requests"] == 4
    assert proof["cost_metered_usd"] == 0.6 and proof["cost_reported_usd"] == 1.0
    assert proof["mismatched"] == ["j3"] and proof["unmetered_ok"] == ["j2"]


def test_a_job_whose_supervisor_died_is_costed_from_its_gateway_log(tmp_path):
    paths = ab.StudyPaths(tmp_path / "study")
    jdir = paths.job_dir("j000003")
    (jdir / "raw").mkdir(parents=True)
    (jdir / "raw" / "stream.jsonl").write_text("")
    for cost in (0.25, 0.5):
        ab.append_jsonl(jdir / "gateway.jsonl", {"kind": "messages", "model": "claude-test", "cost_usd": cost,
                                                 "tokens": {"input": 10}})
    job = {"job_id": "j000003", "raw_dir": str(jdir / "raw"), "model": "claude-test", "prior": {}}
    usage, _ = ab._usage_from_raw(job, paths)
    assert usage["cost_metered_usd"] == 0.75 and usage["requests"] == 2
    assert ab.billed_cost_usd(usage) == 0.75


@pytest.mark.parametrize("method, raw, kind, forward, allowed", [
    ("POST", "/v1/messages", "messages", "/v1/messages", True),
    ("POST", "/v1/messages?beta=true", "messages", "/v1/messages?beta=true", True),
    ("POST", "/v1/messages/", "messages", "/v1/messages", True),
    ("POST", "//v1//messages", "messages", "/v1/messages", True),
    ("POST", "/v1/%6dessages", "messages", "/v1/messages", True),
    ("POST", "/v1/x/../messages", "messages", "/v1/messages", True),
    ("POST", "/v1/messages/count_tokens?beta=true", "count_tokens", "/v1/messages/count_tokens?beta=true", True),
    ("POST", "/v1/messages/batches", "other", "/v1/messages/batches", False),
    ("POST", "/v1/complete", "other", "/v1/complete", False),
    ("DELETE", "/v1/files/f1", "other", "/v1/files/f1", False),
    # Reads go nowhere either: files, batches and their results would be fetched with the real key.
    ("GET", "/v1/models", "other", "/v1/models", False),
    ("GET", "/v1/messages", "other", "/v1/messages", False),
    ("GET", "/v1/messages/count_tokens", "other", "/v1/messages/count_tokens", False),
    ("GET", "/v1/files/f1/content", "other", "/v1/files/f1/content", False),
])
def test_gateway_route(method, raw, kind, forward, allowed):
    assert ab.gateway_route(method, raw) == (kind, forward, allowed)


def test_a_spending_request_to_another_path_is_not_forwarded(tmp_path, upstream):
    gw = make_gateway(tmp_path, upstream.url)
    try:
        status, data, _ = post(gw, "/v1/messages/batches", {"requests": []})
        assert status == 403 and json.loads(data)["error"]["type"] == "permission_error"
        status, _, _ = post(gw, "//v1/messages", {"model": "claude-test", "max_tokens": 10, "stream": True})
        assert status == 200 and upstream.requests[-1]["path"] == "/v1/messages"
        assert len(upstream.requests) == 1
        recs = records(tmp_path, 2)
        assert recs[0]["refused"] == "path" and recs[1]["kind"] == "messages" and recs[1]["cost_usd"] == EXPECTED_COST
    finally:
        gw.stop()


# ---- the detached run driver holds no credential either -------------------------------------------

def test_a_detached_run_driver_gets_the_credentials_on_stdin_not_in_its_environment(tmp_path, fake_env,
                                                                                    monkeypatch):
    from test_experiment import tiny_study
    study = tiny_study(tmp_path / "s")
    assert run_main(["assign", "--study", str(study), "--force"])[0] == 0
    started: list[dict] = []

    def detached(platform, args, *, cwd, env, log_path, secret=None):
        started.append({"args": list(args), "env": dict(env), "secret": dict(secret or {})})
        return 4242
    monkeypatch.setattr(ab, "detach_agentbench", detached)
    monkeypatch.setenv("ANTHROPIC_API_KEY", REAL_KEY)
    code, out = run_main(["run", "--study", str(study), "--detach", "--force"])
    assert code == 0 and out["driver_pid"] == 4242, out
    (call,) = started
    assert call["args"][0] == "_drive"
    assert not any(ab.is_credential_var(k) for k in call["env"]) and REAL_KEY not in json.dumps(call["env"])
    assert call["secret"] == {"ANTHROPIC_API_KEY": REAL_KEY}


def test_credentials_handed_to_a_process_are_passed_on_to_its_supervisors(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.setattr(ab, "HANDED_CREDENTIALS", {"ANTHROPIC_API_KEY": REAL_KEY})
    assert ab.launch_credentials()["ANTHROPIC_API_KEY"] == REAL_KEY
    monkeypatch.setattr(ab.sys, "stdin", io.TextIOWrapper(io.BytesIO(json.dumps({"env": {"A": "1", "B": 2}}).encode())))
    assert ab.read_stdin_credentials() == {"A": "1"}


@pytest.mark.parametrize("reason, wire, expected", [
    ("usage_limit", [200, 429], True),
    ("usage_limit", [200, 200], False),         # a rate limit the wire never saw was written in
    ("auth", [401], True), ("auth", [403], True), ("auth", [200], False),
    ("usage_limit", [], True),                  # a gateway that carried no request: nothing to check
    ("usage_limit", None, False),               # no gateway: the claim cannot count
    ("api_error", [200], False), ("api_error", [200, 503], True), (None, [200], True),
])
def test_a_claimed_rate_limit_or_auth_failure_needs_the_wire(reason, wire, expected):
    records = None if wire is None else [{"kind": "messages", "status": st, "model": "m"} for st in wire]
    assert ab.claim_counts(ab.claim_corroboration(reason, records, "m")) is expected


@pytest.mark.parametrize("budget, code", [
    ({"unbounded_request_usd": 0.5}, None),
    ({"unbounded_request_usd": 0}, None),
    ({"unbounded_request_usd": -1}, "budget_values_finite_non_negative"),
    ({"unbounded_request_usd": "1"}, "budget_values_finite_non_negative"),
    ({"unbounded_request_usd": 6.0}, "unbounded_request_usd_above_run_budget"),      # default run: 5.0
    ({"unbounded_request_usd": 2.0, "usd_per_run": 1.0}, "unbounded_request_usd_above_run_budget"),
])
def test_the_unbounded_request_setting_is_checked(budget, code):
    if code is None:
        ab.check_study_shape({"budget": budget})
        return
    with pytest.raises(ab.AgentbenchError) as exc:
        ab.check_study_shape({"budget": budget})
    assert exc.value.code == code


# ---- spend that cannot race ------------------------------------------------------------------------

class Overbiller:
    """An upstream that bills every Messages request the most the gateway's bound allows (each
    body byte a 1-hour cache write, the API's overhead too, max_tokens of output: far more than a
    tokenizer would count), or `bill_input` tokens when set (beyond any bound).  Each request is
    held until `release` is set, so that a test can have them all in flight at once; `hold_after_start`
    holds a streamed answer after its message_start instead."""

    def __init__(self, bill_input: int | None = None, hold_after_start: bool = False, marked_only: bool = False):
        self.arrived: list[int] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        up = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                req = json.loads(body)
                with up.changed:
                    up.arrived.append(len(body))
                    up.changed.notify_all()
                if not hold_after_start:
                    up.release.wait(60)
                over = bill_input is not None and (not marked_only or b"OVERBILL" in body)
                n_in = bill_input if over else len(body) + ab.GATEWAY_OVERHEAD_TOKENS
                usage = {"input_tokens": 0, "output_tokens": 1, "cache_creation_input_tokens": n_in,
                         "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": n_in}}
                start = ("message_start", {"type": "message_start", "message": {
                    "id": "msg_o", "model": "claude-test", "usage": usage}})
                end = ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                         "usage": {"output_tokens": req["max_tokens"]}})
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for i, part in enumerate((sse(start), sse(DELTA, end), sse(STOP))):
                    if i == 1 and hold_after_start:
                        up.release.wait(60)
                    try:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.flush()
                    except OSError:
                        return
                self.wfile.write(b"0\r\n\r\n")

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.srv.shutdown()
        self.srv.server_close()


def study_paths(tmp_path: Path, spent: float = 0.0) -> ab.StudyPaths:
    paths = ab.StudyPaths(tmp_path / "study")
    paths.state.mkdir(parents=True)
    reg = ab.read_registry(paths)
    reg["spent_usd"] = spent
    ab.write_json_atomic(paths.registry, reg)
    return paths


def attack_body(pad: int) -> dict:
    """A streamed request with max_tokens 1 and `pad` bytes of text."""
    return {"model": "claude-test", "max_tokens": 1, "stream": True,
            "messages": [{"role": "user", "content": "x" * pad}]}


def send_at_once(gws: list, body: dict, n: int) -> list[int]:
    """n requests from n threads, spread over the gateways, all started together; their statuses."""
    statuses: list[int] = []
    errors: list[str] = []
    go = threading.Barrier(n)

    def one(i: int) -> None:
        go.wait(30)
        try:
            statuses.append(post(gws[i % len(gws)], "/v1/messages", body)[0])
        except (OSError, http.client.HTTPException) as exc:
            errors.append(repr(exc))
            statuses.append(-1)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return statuses, threads, errors


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_sixteen_requests_at_once_never_spend_past_the_run_cap(tmp_path):
    """The attack: 16 requests sent at once, max_tokens 1, against an upstream that bills each the
    most it can.  Every reservation is decided under one lock counting those in flight, and each
    bounds its bill: the first ones fit, the rest are refused, and once all are answered the
    metered spend is within the cap (the bound says within cap + one reservation)."""
    up = Overbiller()
    paths = study_paths(tmp_path)
    body = attack_body(20_000)
    data = json.dumps(body).encode()
    one = ab.worst_case_usd(ab.request_bound(data, None).input_tokens, 1, "claude-test", PRICES)
    # The old estimate (a third of the body's bytes, no overhead) would have reserved a third of
    # what this upstream bills: 16 of them fitted a cap that 5 of the real bills exceed.
    old = round((len(data) / 3) * 4.0 / 1e6 + 10.0 / 1e6, 6)
    assert one > 2.9 * old
    cap = 5.5 * one
    budget = ab.GatewayBudget(paths, PLAT, "j000001", run_cap=cap, study_cap=None)
    gw = make_gateway(tmp_path, up.url, budget=budget)
    try:
        statuses, threads, errors = send_at_once([gw], body, 16)
        # Ordered by events: the refused ones are answered at once; the others wait upstream.
        wait_until(lambda: len(up.arrived) + len(statuses) == 16, "every request forwarded or refused")
        assert len(up.arrived) == 5 and sorted(statuses) == [400] * 11, errors
        assert budget.reserved == pytest.approx(5 * one)
        up.release.set()
        for t in threads:
            t.join(60)
        assert sorted(statuses) == [200] * 5 + [400] * 11
        recs = records(tmp_path, 16)
        metered = sum(r["cost_usd"] for r in recs)
        assert metered == pytest.approx(5 * one) and metered <= cap
        assert all(r["cost_usd"] == r["reserved_usd"] for r in recs if r["status"] == 200)   # billed = bound
        assert not any(r.get("reservation_exceeded") for r in recs) and gw.cutoff is None
        assert {r.get("refused") for r in recs if r["status"] == 400} == {"usd_per_run"}
    finally:
        gw.stop()
        up.close()


def test_sixteen_requests_at_once_over_two_jobs_never_spend_past_the_study_cap(tmp_path):
    """The same attack spread over two live jobs of one study, with money already spent: each
    reservation counts the ledger, the other job's reservations in flight and its own."""
    up = Overbiller()
    paths = study_paths(tmp_path, spent=0.25)
    body = attack_body(20_000)
    one = ab.worst_case_usd(ab.request_bound(json.dumps(body).encode(), None).input_tokens, 1, "claude-test",
                            PRICES)
    cap = 0.25 + 6.5 * one
    gws = []
    for job in ("j000001", "j000002"):
        budget = ab.GatewayBudget(paths, PLAT, job, run_cap=100.0, study_cap=cap)
        gws.append(ab.MeteringGateway(upstream=up.url, creds={"ANTHROPIC_API_KEY": REAL_KEY}, prices=PRICES,
                                      record_path=tmp_path / f"{job}.jsonl", budget=budget,
                                      default_model="claude-test"))
        gws[-1].start()
    try:
        statuses, threads, errors = send_at_once(gws, body, 16)
        wait_until(lambda: len(up.arrived) + len(statuses) == 16, "every request forwarded or refused")
        assert len(up.arrived) == 6
        up.release.set()
        for t in threads:
            t.join(60)
        assert sorted(statuses) == [200] * 6 + [400] * 10
        # A record (and the settling of its reservation) follows the answer's last byte.
        wait_until(lambda: sum(len(g.records) for g in gws) == 16, "every request recorded")
        metered = sum(g.budget.metered for g in gws)
        assert metered == pytest.approx(6 * one) and 0.25 + metered <= cap
        assert all(g.refusal is None or g.refusal["limit"] == "study_usd" for g in gws)
    finally:
        for g in gws:
            g.stop()
        up.close()


def test_a_request_whose_cost_the_body_does_not_bound_is_refused_by_name_unless_the_study_states_it(tmp_path,
                                                                                                    upstream):
    paths = study_paths(tmp_path)
    gw = make_gateway(tmp_path, upstream.url, budget=ab.GatewayBudget(paths, PLAT, "j000001", run_cap=5.0,
                                                                      study_cap=None))
    search = {"model": "claude-test", "max_tokens": 10, "stream": True,
              "tools": [{"type": "web_search_20250305", "name": "web_search"}],
              "messages": [{"role": "user", "content": "search the web"}]}
    pdf_by_url = {"model": "claude-test", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "url", "url": "https://example.com/big.pdf"}}]}]}
    try:
        for body, name in ((search, "server_tool:web_search_20250305"), (pdf_by_url, "url_source")):
            status, data, _ = post(gw, "/v1/messages", body)
            err = json.loads(data)["error"]
            assert status == 400 and name in err["message"] and "unbounded_request_usd" in err["message"]
        assert upstream.requests == [] and gw.refusal is None and gw.cutoff is None
        recs = records(tmp_path, 2)
        assert [r["refused"] for r in recs] == ["unbounded", "unbounded"]
        # (A refusal is recorded after its answer's last byte: the two records may come in either order.)
        assert sorted(r["unbounded"][0] for r in recs) == ["server_tool:web_search_20250305", "url_source"]
        assert all(r["cost_usd"] == 0.0 for r in recs)
        # A body this gateway cannot read (here: nested deeper than its parser goes) is not forwarded.
        host, port = gw.url.rsplit("/", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/messages", body=DEEP, headers={"x-api-key": gw.token})
        assert conn.getresponse().status == 400
        conn.close()
        assert sorted(r["refused"] for r in records(tmp_path, 3)) == ["unbounded", "unbounded", "unreadable"]
        assert upstream.requests == []
    finally:
        gw.stop()
    # Allowed with a stated worst case: reserved on top of the bound, and forwarded.
    gw = make_gateway(tmp_path, upstream.url, budget=ab.GatewayBudget(paths, PLAT, "j000002", run_cap=5.0,
                                                                      study_cap=None))
    gw.unbounded_usd = 0.75
    try:
        assert post(gw, "/v1/messages", search)[0] == 200
        rec = records(tmp_path, 4)[-1]
        data = json.dumps(search).encode()
        bound = ab.worst_case_usd(ab.request_bound(data, None).input_tokens, 10, "claude-test", PRICES)
        assert rec["reserved_usd"] == round(bound + 0.75, 6) and rec["unbounded"] == ["server_tool:web_search_20250305"]
        assert len(upstream.requests) == 1
    finally:
        gw.stop()


def raw_post(gw: ab.MeteringGateway, body: dict, into: list[bytes] | None = None) -> bytes:
    """Everything the gateway sends back until it closes the connection (a cut answer is never
    completed, so a client library would only raise); `into` gets each part as it arrives."""
    import socket
    data = json.dumps(body).encode()
    host, port = gw.url.rsplit("/", 1)[1].split(":")
    into = [] if into is None else into
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-api-key: " + gw.token.encode()
                  + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
        while True:
            part = s.recv(65536)
            if not part:
                return b"".join(into)
            into.append(part)


def test_a_cap_reached_mid_answer_cuts_it_and_refuses_the_next(tmp_path):
    up = Overbiller()
    up.release.set()
    paths = study_paths(tmp_path)
    body = attack_body(1000)
    one = ab.worst_case_usd(ab.request_bound(json.dumps(body).encode(), None).input_tokens, 1, "claude-test",
                            PRICES)
    budget = ab.GatewayBudget(paths, PLAT, "j000001", run_cap=one, study_cap=None)   # room for exactly one
    gw = make_gateway(tmp_path, up.url, budget=budget)
    try:
        got = raw_post(gw, body)
        assert got.startswith(b"HTTP/1.1 200") and b"message_stop" not in got and not got.endswith(b"0\r\n\r\n")
        assert gw.cutoff["limit"] == "usd_per_run" and gw.refusal == gw.cutoff
        rec = records(tmp_path, 1)[0]
        assert rec["cut"] and rec["aborted"] and rec["cost_usd"] == one       # what was metered of it counts
        status, data, _ = post(gw, "/v1/messages", body)
        assert status == 400 and "answers were cut" in json.loads(data)["error"]["message"]
        assert len(up.arrived) == 1
    finally:
        gw.stop()
        up.close()


def test_an_answer_billed_past_its_reservation_is_cut_at_once_and_nothing_more_goes_out(tmp_path):
    """The original attack's upstream: 2M input tokens billed on a tiny body.  No bound can hold
    such a bill; the gateway sees it in the answer's first event, cuts the answer there (the
    upstream is still holding the rest) and refuses whatever comes next."""
    up = Overbiller(bill_input=2_000_000, hold_after_start=True)
    paths = study_paths(tmp_path)
    gw = make_gateway(tmp_path, up.url, budget=ab.GatewayBudget(paths, PLAT, "j000001", run_cap=1.0,
                                                                 study_cap=5.0))
    try:
        got = raw_post(gw, attack_body(10))     # returns while the upstream still holds the answer
        assert not up.release.is_set() and b"content_block_delta" not in got
        assert gw.cutoff["limit"] == "reservation_exceeded"
        rec = records(tmp_path, 1)[0]
        assert rec["cut"] and rec["reservation_exceeded"] and rec["cost_usd"] > rec["reserved_usd"]
        statuses = [post(gw, "/v1/messages", attack_body(10))[0] for _ in range(15)]
        assert statuses == [400] * 15 and len(up.arrived) == 1
        assert {r.get("refused") for r in records(tmp_path, 16)[1:]} == {"reservation_exceeded"}
    finally:
        gw.stop()
        up.close()


def test_a_cut_stops_an_idle_answer_too_and_charges_it_its_reservation(tmp_path):
    """Two answers live: one waits upstream after its first event (within its bound), the other is
    billed past its bound.  The cut ends the waiting one at once (its upstream connection is
    shut), and, its final usage never having come, it is charged its reservation."""
    up = Overbiller(bill_input=2_000_000, hold_after_start=True, marked_only=True)
    paths = study_paths(tmp_path)
    gw = make_gateway(tmp_path, up.url, budget=ab.GatewayBudget(paths, PLAT, "j000001", run_cap=2.0,
                                                                 study_cap=None))
    idle: list[bytes] = []
    t = threading.Thread(target=raw_post, args=(gw, dict(attack_body(1000), max_tokens=1000), idle))
    try:
        t.start()
        wait_until(lambda: b"message_start" in b"".join(idle), "the idle answer's first event relayed")
        raw_post(gw, dict(attack_body(10), messages=[{"role": "user", "content": "OVERBILL"}]))
        t.join(60)
        assert not t.is_alive() and not up.release.is_set()     # ended while its upstream still held it
        assert b"message_stop" not in b"".join(idle)
        recs = records(tmp_path, 2)
        waiting = next(r for r in recs if not r.get("reservation_exceeded"))
        assert waiting["cut"] and waiting["charged"] == "reservation" and waiting["cost_usd"] == waiting["reserved_usd"]
        assert gw.cutoff["limit"] == "reservation_exceeded"
    finally:
        up.release.set()
        t.join(60)
        gw.stop()
        up.close()


def test_the_study_cap_reached_by_another_session_mid_answer_cuts_it(tmp_path, monkeypatch):
    """While an answer streams, the study's spend grows elsewhere (a session that ran without the
    gateway is counted at its end): the answer's next usage event sees the cap reached."""
    monkeypatch.setattr(ab, "GATEWAY_STUDY_RECHECK_S", 0.0)   # re-read the study at every event
    up = Overbiller(hold_after_start=True)
    paths = study_paths(tmp_path)
    body = dict(attack_body(1000), max_tokens=1000)
    one = ab.worst_case_usd(ab.request_bound(json.dumps(body).encode(), None).input_tokens, 1000, "claude-test",
                            PRICES)
    gw = make_gateway(tmp_path, up.url, budget=ab.GatewayBudget(paths, PLAT, "j000001", run_cap=None,
                                                                 study_cap=2 * one))
    got: list[bytes] = []
    t = threading.Thread(target=raw_post, args=(gw, body, got))
    try:
        t.start()
        wait_until(lambda: b"message_start" in b"".join(got), "the answer's first event relayed")
        assert gw.cutoff is None
        reg = ab.read_registry(paths)
        reg["spent_usd"] = 2 * one
        ab.write_json_atomic(paths.registry, reg)
        up.release.set()
        t.join(60)
        assert b"message_stop" not in b"".join(got)
        assert gw.cutoff["limit"] == "study_usd" and records(tmp_path, 1)[0]["cut"]
        assert post(gw, "/v1/messages", body)[0] == 400
    finally:
        up.release.set()
        t.join(60)
        gw.stop()
        up.close()
