"""Interop, fast part: the hostile-input readers (bounded, never through a link, garbage
tolerated), the stream -> chains model with sub-agent side chains, the ATIF and Inspect builders as
tables, and the export command's refusals.  The real consumers check a crafted side-chain session
when the interop venv is there (tests/interop_consumers.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import ab, run_main
from interop_consumers import interop_venv, invalid_trajectories, read_inspect_logs, run_in_venv


def ev(kind: str, content, parent=None, mid=None, **kw) -> dict:
    msg = {"content": content}
    if mid:
        msg["id"] = mid
    return {"type": kind, "message": msg, "parent_tool_use_id": parent, **kw}


SIDE_CHAIN_STREAM = [
    {"type": "system", "subtype": "init", "model": "claude-opus-4-5", "session_id": "s1"},
    ev("assistant", [{"type": "text", "text": "I will delegate."}], mid="m1"),
    ev("assistant", [{"type": "tool_use", "id": "task1", "name": "Task", "input": {"prompt": "look"}}], mid="m1"),
    ev("user", "look around", parent="task1"),
    ev("assistant", [{"type": "tool_use", "id": "sub-read", "name": "Read", "input": {"file_path": "a"}}],
       parent="task1", mid="m2"),
    ev("user", [{"type": "tool_result", "tool_use_id": "sub-read", "content": "hello"}], parent="task1"),
    ev("assistant", [{"type": "text", "text": "found hello"}], parent="task1", mid="m3"),
    ev("user", [{"type": "tool_result", "tool_use_id": "task1", "content": [{"type": "text", "text": "hello"}]}]),
    ev("assistant", [{"type": "thinking", "thinking": "ok"}, {"type": "text", "text": "Done."}], mid="m4"),
    {"type": "result", "subtype": "success", "is_error": False, "result": "Done.",
     "usage": {"input_tokens": 10, "output_tokens": 20, "cache_read_input_tokens": 5}},
]


def _lines(events) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in events)


def test_stream_events_skip_garbage_and_overlong_lines():
    data = (b'{"type": "assistant"}\nnot json\n[1, 2]\n\n' + b'{"x": "' + b"a" * (ab.INTEROP_LINE_MAX_BYTES + 1)
            + b'"}\n{"type": "result"}\n\xff\xfe\n')
    events, garbage = ab.stream_events(data)
    assert [e["type"] for e in events] == ["assistant", "result"]
    assert garbage == 4


def test_read_file_bounded_never_follows_a_link_and_caps(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_bytes(b"x" * 1000)
    link = tmp_path / "stream.jsonl"
    link.symlink_to(real)
    assert ab.read_file_bounded(link)[0] is None and "link" in ab.read_file_bounded(link)[1]
    data, problem = ab.read_file_bounded(real, cap=100)
    assert len(data) == 100 and "cut at 100" in problem
    assert ab.read_file_bounded(tmp_path / "missing") == (None, "missing")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert ab.read_file_bounded(fifo) == (None, "not a regular file")   # returns at once, never blocks


def test_session_items_merge_one_message_and_keep_side_chains_apart():
    s = ab.session_items(SIDE_CHAIN_STREAM)
    main, side = s["chains"][""], s["chains"]["task1"]
    assert s["model"] == "claude-opus-4-5" and s["result"]["usage"]["output"] == 20
    assert [i["type"] for i in main] == ["assistant", "tool_results", "assistant"]
    assert main[0]["text"] == "I will delegate." and main[0]["tool_calls"][0]["id"] == "task1"
    assert main[2]["thinking"] == "ok" and main[2]["text"] == "Done."
    assert [i["type"] for i in side] == ["user", "assistant", "tool_results", "assistant"]


def test_hostile_values_are_cut_and_checked():
    huge = "z" * (ab.INTEROP_TEXT_MAX_CHARS * 2)
    s = ab.session_items([ev("assistant", [{"type": "text", "text": huge},
                                           {"type": "tool_use", "id": "i" * 5000, "name": None,
                                            "input": {"k": huge}}, "junk", {"type": 7}], mid="m"),
                          ev("user", [{"type": "tool_result", "tool_use_id": 12, "content": {"a": 1}}]),
                          {"type": "assistant", "message": "not an object"}, {"type": "weird"}])
    a = s["chains"][""][0]
    assert len(a["text"]) < ab.INTEROP_TEXT_MAX_CHARS + 200 and "left out by agentbench" in a["text"]
    call = a["tool_calls"][0]
    assert len(call["id"]) < 300 and call["name"] == "unknown" and set(call["input"]) == {"truncated"}
    assert s["chains"][""][1]["results"][0]["tool_use_id"] is None


def _source(events, **kw) -> "ab.SessionSource":
    base = dict(job_id="j000001", run_id="r0001", role="executor", session_id="s1", prompt="Fix it.",
                system_prompt="Be careful.", session=ab.session_items(events), garbage_lines=0, problems=(),
                ledger={"job_id": "j000001", "cost_metered_usd": 0.25, "cost_delta_usd": 0.3,
                        "claude_version": "2.1.332",
                        "tokens": {"input": 1, "output": 2, "cache_creation": 3, "cache_read": 4}},
                claude_version="2.1.332", model="claude-opus-4-5")
    base.update(kw)
    return ab.SessionSource(**base)


def test_atif_trajectory_embeds_side_chains_and_refers_to_them():
    t = ab.atif_trajectory(_source(SIDE_CHAIN_STREAM), version=ab.ATIF_VERSION)
    assert [s["source"] for s in t["steps"]] == ["system", "user", "agent", "agent"]
    assert [s["step_id"] for s in t["steps"]] == [1, 2, 3, 4]
    call_step = t["steps"][2]
    result = call_step["observation"]["results"][0]
    assert result["source_call_id"] == "task1"
    ref = result["subagent_trajectory_ref"][0]["trajectory_id"]
    sub = t["subagent_trajectories"][0]
    assert sub["trajectory_id"] == ref and [s["source"] for s in sub["steps"]] == ["user", "agent", "agent"]
    assert t["steps"][3]["reasoning_content"] == "ok"
    assert t["final_metrics"] == {"total_prompt_tokens": 8, "total_completion_tokens": 2,
                                  "total_cached_tokens": 4, "total_steps": 4, "total_cost_usd": 0.25}


def test_atif_trajectory_of_an_empty_or_garbage_session_is_still_one_step():
    t = ab.atif_trajectory(_source([], prompt=None, system_prompt=None, ledger=None, garbage_lines=3,
                                   problems=("stream.jsonl: not read (a link)",)), version=ab.ATIF_VERSION)
    assert len(t["steps"]) == 1 and "3 stream lines" in t["notes"] and "a link" in t["notes"]
    assert "total_cost_usd" not in t["final_metrics"]


def test_crafted_trajectories_pass_harbors_validator(tmp_path):
    venv = interop_venv()
    paths = []
    for i, src in enumerate([_source(SIDE_CHAIN_STREAM), _source([], prompt=None, system_prompt=None),
                             _source([ev("user", [{"type": "tool_result", "tool_use_id": "x", "content": "?"}]),
                                      ev("assistant", [{"type": "tool_use", "id": "c", "name": "Bash",
                                                        "input": {"command": "ls"}}])])]):
        p = tmp_path / f"t{i}.json"
        p.write_text(json.dumps(ab.atif_trajectory(src, version=ab.ATIF_VERSION, continued_from="../x.json")))
        paths.append(str(p))
    assert invalid_trajectories(venv, paths) == {}


@pytest.mark.parametrize("runs, expected", [
    ([{"run_id": "r1", "arm": "A", "task": "t", "repeat": 1, "split": "main"},
      {"run_id": "r2", "arm": "A", "task": "t", "repeat": 2, "split": "main"}],
     {"r1": ("t", 1), "r2": ("t", 2)}),
    ([{"run_id": "r1", "arm": "A", "task": "t", "repeat": 1, "split": "main"},
      {"run_id": "r2", "arm": "A", "task": "t", "repeat": 1, "split": "pilot"}],
     {"r1": ("t.main", 1), "r2": ("t.pilot", 1)}),
    ([{"run_id": "r1", "arm": "A", "task": "t", "repeat": "x", "split": "main"}], {"r1": ("t", 1)}),
])
def test_inspect_sample_ids(runs, expected):
    assert ab.inspect_sample_ids(runs) == expected


@pytest.mark.parametrize("statuses, status, complete", [
    (["finished", "error"], "success", True),
    (["finished", "interrupted"], "started", False),     # an older version's word: not final, run again
    (["finished", "running"], "started", False),
    ([], "started", False),
])
def test_study_status(statuses, status, complete):
    got = ab.study_status([{"status": s} for s in statuses])
    assert (got["inspect_status"], got["complete"]) == (status, complete)


def test_model_usage_prefers_the_gateways_metering():
    lines = [{"models_metered": {"m1": {"cost_usd": 0.5, "tokens": {"input": 1, "output": 2}}},
              "cost_delta_usd": 9.0},
             {"models_used": ["m2"], "cost_delta_usd": 0.25, "tokens": {"output": 5}},
             {"models_used": ["m2"], "cost_delta_usd": float("nan"), "tokens": {"output": -3}}, None]
    u = ab.model_usage_of(lines, "anthropic/x")
    assert u["anthropic/m1"]["total_cost"] == 0.5 and u["anthropic/m1"]["total_tokens"] == 3
    assert u["anthropic/m2"]["total_cost"] == 0.25 and u["anthropic/m2"]["output_tokens"] == 5


def test_export_refuses_an_out_that_is_a_file_or_inside_the_study(study, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    code, out = run_main(["export", "--study", str(study), "--format", "inspect", "--out", str(f)])
    assert code == 2 and out["code"] == "export_out_not_a_directory"
    code, out = run_main(["export", "--study", str(study), "--format", "atif",
                          "--out", str(study / "state" / "x")])
    assert code == 2 and out["code"] == "export_out_inside_study"
    assert not (study / "state" / "x").exists()
    code, out = run_main(["export", "--study", str(study), "--format", "xlsx", "--out", str(tmp_path / "o")])
    assert code == 2 and out["code"] == "bad_arguments" and not (tmp_path / "o").exists()


def _with_arms(study: Path) -> Path:
    cfg = json.loads((study / "study.json").read_text())
    cfg["arms"] = {"A": {}, "C": {"gate_cycles": 2}}
    (study / "study.json").write_text(json.dumps(cfg))
    return study


def test_export_of_a_study_without_runs_is_empty_but_valid(study, tmp_path):
    _with_arms(study)
    code, out = run_main(["export", "--study", str(study), "--format", "atif", "--out", str(tmp_path / "a")])
    assert code == 0 and out["trajectories"] == 0
    code, out = run_main(["export", "--study", str(study), "--format", "inspect", "--out", str(tmp_path / "i")])
    assert code == 0 and out["status"] == "started"
    assert [(log["arm"], log["samples"]) for log in out["logs"]] == [("A", 0), ("C", 0)]


def _fake_job(study: Path, job_id: str, raw_dir: str, stream: bytes | None) -> None:
    jd = study / "state" / "jobs" / job_id
    jd.mkdir(parents=True)
    (jd / "job.json").write_text(json.dumps({"job_id": job_id, "raw_dir": raw_dir, "session_id": "s-1",
                                             "model": "claude-opus-4-5", "meta": {"role": "executor"}}))
    (jd / "prompt.txt").write_text("Do it.")
    if stream is not None:
        Path(raw_dir).mkdir(parents=True, exist_ok=True)
        (Path(raw_dir) / "stream.jsonl").write_bytes(stream)


def test_atif_export_reads_no_stream_outside_the_study(study, tmp_path):
    outside = tmp_path / "elsewhere"
    _fake_job(study, "j000001", str(outside), _lines(SIDE_CHAIN_STREAM))
    _fake_job(study, "j000002", str(study / "runs" / "x" / "raw" / "01"), b"garbage\n" + _lines(SIDE_CHAIN_STREAM))
    code, out = run_main(["export", "--study", str(study), "--format", "atif", "--out", str(tmp_path / "o")])
    assert code == 0 and out["trajectories"] == 2
    first = json.loads((tmp_path / "o" / "_sessions" / "j000001" / "trajectory.json").read_text())
    assert "not inside the study" in first["notes"] and len(first["steps"]) == 1   # the prompt only
    second = json.loads((tmp_path / "o" / "_sessions" / "j000002" / "trajectory.json").read_text())
    assert "1 stream lines" in second["notes"] and second["subagent_trajectories"]


def test_an_empty_study_exports_logs_inspect_ai_reads(study, tmp_path):
    venv = interop_venv()
    _with_arms(study)
    code, out = run_main(["export", "--study", str(study), "--format", "inspect", "--out", str(tmp_path / "i")])
    assert code == 0
    logs = read_inspect_logs(venv, [str(p) for p in sorted((tmp_path / "i").glob("*.eval"))])
    assert [(log["task"], log["status"], log["samples"]) for log in logs] == [("A", "started", []),
                                                                              ("C", "started", [])]


def _strictly_read(data: bytes):
    """A strict reader's view: UTF-8 decoded with errors='strict', then JSON with no surrogate
    code point in any string (orjson and pydantic-core refuse a lone one, even escaped)."""
    obj = json.loads(data.decode("utf-8", errors="strict"))

    def walk(x):
        if isinstance(x, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in x):
                raise ValueError(f"a surrogate in {x[:200]!r}")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(obj)
    return obj


@pytest.mark.parametrize("text, want", [
    ("plain", "plain"),
    ("a\ud800b", "a\ufffdb"),                     # lone high surrogate
    ("\udc00x", "\ufffdx"),                       # lone low surrogate
    ("\ud83d\ude00", "\U0001F600"),               # a pair as two code points: the character
    ("\udcff", "\ufffd"),                         # a non-UTF-8 byte as surrogateescape keeps it
])
def test_strict_unicode_table(text, want):
    assert ab.strict_unicode({text: [text, (text,)]}) == {want: [want, [want]]}


def test_every_export_reads_with_a_strict_reader_whatever_the_model_wrote(study, tmp_path):
    hostile = [ev("assistant", [{"type": "text", "text": "lone \ud800 and \udfff end"},
                                {"type": "tool_use", "id": "c\udc80", "name": "Bash",
                                 "input": {"command": "echo \ud800"}}], mid="m1"),
               {"type": "result", "subtype": "success", "is_error": False, "result": "x\ud800"}]
    raw = _lines(hostile) + b'{"type": "assistant", "message": {"content": [{"type": "text", "text": "\xff\xfe"}]}}\n'
    assert b"\\ud800" in raw                     # the attack: a lone surrogate, escaped, in the stream
    with pytest.raises(ValueError):              # what a strict reader does with it unrepaired
        _strictly_read(json.dumps({"t": "a\ud800"}).encode())
    _fake_job(study, "j000001", str(study / "runs" / "x" / "raw" / "01"), raw)
    code, out = run_main(["export", "--study", str(study), "--format", "atif", "--out", str(tmp_path / "o")])
    assert code == 0 and out["trajectories"] == 1
    traj = _strictly_read((tmp_path / "o" / "_sessions" / "j000001" / "trajectory.json").read_bytes())
    assert "lone \ufffd and \ufffd end" in json.dumps(traj, ensure_ascii=False)
    # Inspect: the zip's every member, from samples carrying the same text
    sample = {"id": "t", "epoch": 1, "input": "a\ud800", "messages": [{"role": "assistant", "content": "\udc00"}],
              "scores": {}, "metadata": {"k\ud800": "v"}, "model_usage": {}}
    path = tmp_path / "x.eval"
    ab.write_eval_zip(path, {"eval": {"task": "A\ud800"}, "stats": {"model_usage": {}}}, [sample])
    with ab.zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert len(names) == 3
        for name in names:
            _strictly_read(zf.read(name))


PYDANTIC_READ = """
import sys, zipfile, pydantic_core
for path in sys.argv[1:]:
    if path.endswith(".eval"):
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                pydantic_core.from_json(zf.read(name))
    else:
        pydantic_core.from_json(open(path, "rb").read())
print("read")
"""


def test_exports_read_with_pydantic_core(study, tmp_path):
    """pydantic-core (inspect-ai's and harbor's parser) refuses a lone surrogate even escaped."""
    venv = interop_venv()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"t": "a\ud800"}))
    assert "read" not in run_in_venv(venv, PYDANTIC_READ, str(bad)).stdout       # the attack
    _fake_job(study, "j000001", str(study / "runs" / "x" / "raw" / "01"),
              _lines([ev("assistant", [{"type": "text", "text": "lone \ud800"}], mid="m1")]))
    code, out = run_main(["export", "--study", str(study), "--format", "atif", "--out", str(tmp_path / "o")])
    assert code == 0
    ab.write_eval_zip(tmp_path / "x.eval", {"eval": {"task": "A\ud800"}, "stats": {"model_usage": {}}},
                      [{"id": "t", "epoch": 1, "input": "\udc00", "messages": [], "scores": {}, "metadata": {},
                        "model_usage": {}}])
    done = run_in_venv(venv, PYDANTIC_READ, str(tmp_path / "o" / "_sessions" / "j000001" / "trajectory.json"),
                       str(tmp_path / "x.eval"))
    assert done.returncode == 0 and done.stdout.strip() == "read", done.stderr[-2000:]
