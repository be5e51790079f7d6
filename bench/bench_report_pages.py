#!/usr/bin/env python3
"""Run pages against transcript size: a session of 50 tool calls vs one of 5,000 (large results).

Builds, in memory, raw stream-json lines of one session with N tool calls (each with a 20 KB
result and some assistant text), then times parsing them into a timeline (stream_timeline) and
rendering the run page (render_run_page), and the size of the page written.  The page keeps at
most PAGE_ITEMS_PER_SESSION entries with each result trimmed, so its size and render time stay
flat while the parse grows with the stream.  Prints one JSON object: median seconds and page
bytes for each size and the ratio large/small, measured in the same run.

    python3 bench/bench_report_pages.py [--small 50] [--large 5000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import agentbench as ab  # noqa: E402


def stream_lines(n: int) -> list[str]:
    out = [json.dumps({"type": "system", "subtype": "init", "session_id": "s"})]
    for i in range(n):
        out.append(json.dumps({"type": "assistant", "message": {"id": f"m{i}", "content": [
            {"type": "text", "text": f"Step {i}: looking at the file. " * 20}]}}))
        out.append(json.dumps({"type": "assistant", "message": {"id": f"m{i}", "content": [
            {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {"command": f"cat file{i}.py"}}]}}))
        out.append(json.dumps({"type": "user", "message": {"content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": "x = 1  # <tag> & more\n" * 1000}]}}))
    out.append(json.dumps({"type": "result", "subtype": "success", "total_cost_usd": 1.0, "num_turns": n}))
    return out


def page_for(lines: list[str]) -> str:
    tl = ab.stream_timeline(lines)
    session = {"job_id": "j000001", "role": "executor", "status": "ok", "reason": None, "cost_usd": 1.0,
               "duration_s": 60.0, "tokens": {}, "prompt": ("Do the task.", 0), "timeline": tl,
               "stream_found": True}
    rec = {"run_id": "r0001", "task": "t", "arm": "A", "repeat": 1, "status": "finished", "outcome": "success",
           "validity": "valid", "evaluation": {"success": True, "score": 1.0}, "audit": {"findings": []}}
    return ab.render_run_page({"run": rec, "sessions": [session], "receipts": [],
                               "diff": {"available": False, "why": "-", "files": []}})


def measure(n: int, repeat: int) -> dict:
    lines = stream_lines(n)
    times, size = [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        page = page_for(lines)
        times.append(time.perf_counter() - t0)
        size = len(page.encode())
    return {"tool_calls": n, "stream_bytes": sum(len(x) + 1 for x in lines), "seconds": statistics.median(times),
            "page_bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", type=int, default=50)
    ap.add_argument("--large", type=int, default=5000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    small, large = measure(a.small, a.repeat), measure(a.large, a.repeat)
    print(json.dumps({"small": small, "large": large,
                      "ratio": {k: large[k] / small[k] for k in ("stream_bytes", "seconds", "page_bytes")}},
                     indent=1))


if __name__ == "__main__":
    main()
