#!/usr/bin/env python3
"""The metering gateway's added latency: per request and per streamed event, against a direct
connection to the scripted model, both measured in the same run.

A scripted model serves two scripts: a short answer (a handful of SSE events) and a long one (a
few hundred tool-use blocks, over a thousand events, each written and flushed on its own).  Each
is requested R times directly and R times through a MeteringGateway with a live reservation
budget (its study-wide lock and reservation file included), alternating.  Prints one JSON object:
median seconds per request direct and through the gateway, the added milliseconds per request,
and the added milliseconds per event of the long stream.

    python3 bench/bench_gateway.py [--repeat 40]
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agentbench as ab  # noqa: E402


def request(url: str, body: bytes, key: str) -> tuple[float, int]:
    """One streamed Messages request on a fresh connection: (seconds, SSE events received)."""
    host, port = url.rsplit("/", 1)[1].split(":")
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/messages", body=body,
                 headers={"content-type": "application/json", "x-api-key": key})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    elapsed = time.perf_counter() - t0
    assert resp.status == 200, (resp.status, data[:300])
    return elapsed, data.count(b"\ndata: ") + data.startswith(b"data: ")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    srv = ab.ScriptedModelServer()
    srv.start()
    with tempfile.TemporaryDirectory() as tmp:
        paths = ab.StudyPaths(Path(tmp) / "study")
        paths.state.mkdir(parents=True)
        budget = ab.GatewayBudget(paths, ab.current_platform(), "j000001", run_cap=1e9, study_cap=1e9)
        gw = ab.MeteringGateway(upstream=srv.url, creds={"ANTHROPIC_API_KEY": "bench"}, prices=None,
                                record_path=Path(tmp) / "gateway.jsonl", budget=budget)
        gw.start()
        try:
            many = [{"name": "Bash", "input": {"command": f"echo {i}"}} for i in range(300)]
            out: dict = {"repeat": args.repeat}
            for name, step in (("short", {"text": "ok"}), ("long", {"text": "working", "tool_uses": many})):
                srv.add_script(name, {"steps": [dict(step, loop=True)]})
                # max_tokens covers the long answer's output (the gateway cuts an answer billed past
                # its bound, and the scripted model does not stop at max_tokens).
                body = json.dumps({"model": "claude-opus-4-5", "max_tokens": 32000, "stream": True,
                                   "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                                   "messages": [{"role": "user", "content": f"go [agentbench-script:{name}]"}]}).encode()
                direct, via, events = [], [], 0
                for _ in range(args.repeat):
                    t, events = request(srv.url, body, "bench")
                    direct.append(t)
                    t, ev_gw = request(gw.url, body, gw.token)
                    assert ev_gw == events, (ev_gw, events)
                    via.append(t)
                d, g = statistics.median(direct), statistics.median(via)
                out[name] = {"events": events, "direct_s": round(d, 6), "gateway_s": round(g, 6),
                             "ratio": round(g / d, 3), "added_ms_per_request": round((g - d) * 1000, 3)}
                if name == "long":
                    out[name]["added_ms_per_event"] = round((g - d) * 1000 / max(events, 1), 4)
            out["targets"] = {"added_ms_per_request": 5.0, "added_ms_per_event": 0.2}
        finally:
            gw.stop()
            srv.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
