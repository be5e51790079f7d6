"""Run pages (report --format html --out DIR/): the pure parts by hand, and hostile text.

The end-to-end check against a rehearsed study is in test_report_pages_real.py."""
import json
import os
from html.parser import HTMLParser
from pathlib import Path

import pytest

import agentbench as ab
from test_report import run

HOSTILE = '</pre><script>alert("x")</script><a href="http://evil.example/">x</a>'


def line(obj):
    return json.dumps(obj) + "\n"


def stream(*events):
    return [line(e) for e in events]


def assistant(*blocks, mid="m1"):
    return {"type": "assistant", "message": {"id": mid, "content": list(blocks)}}


def tool_result(tid, content, is_error=False):
    return {"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": tid,
                                                     "content": content, "is_error": is_error}]}}


class Tags(HTMLParser):
    """Every start tag with its attributes, and the text, of a page."""
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(page):
    p = Tags()
    p.feed(page)
    p.close()
    return p


def test_stream_timeline_pairs_results_with_calls_and_counts_junk():
    lines = stream(
        {"type": "system", "subtype": "init", "session_id": "s"},
        assistant({"type": "text", "text": "Reading."}),
        assistant({"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls -la\necho hi"}}),
        assistant({"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls -la\necho hi"}}),
        tool_result("t1", [{"type": "text", "text": "a\nb"}]),
        assistant({"type": "tool_use", "id": "t2", "name": "Read", "input": {"file_path": "x.py"}}),
        tool_result("t2", "boom", is_error=True),
        tool_result("nope", "orphan result"),
        {"type": "result", "subtype": "success", "total_cost_usd": 0.5, "num_turns": 3,
         "duration_ms": 1500, "result": "done"},
    ) + ["not json\n", "[1, 2]\n", "\n"]
    tl = ab.stream_timeline(lines)
    assert (tl["lines"], tl["bad_lines"], tl["omitted"]) == (11, 2, 0)
    kinds = [i["kind"] for i in tl["items"]]
    assert kinds == ["text", "tool", "tool", "result"]     # the repeated t1 block is shown once
    t1, t2 = tl["items"][1], tl["items"][2]
    assert t1["input"] == "command: ls -la\necho hi" and t1["result"] == "a\nb" and not t1["is_error"]
    assert t2["result"] == "boom" and t2["is_error"] is True
    assert tl["items"][3] == {"kind": "result", "subtype": "success", "cost_usd": 0.5, "turns": 3,
                              "duration_s": 1.5, "text": "done", "cut": 0}
    assert ab._page_tool_summary(t1) == "Bash: ls -la"


def test_stream_timeline_trims_and_caps(monkeypatch):
    big = "x" * (ab.PAGE_RESULT_CHARS + 10)
    tl = ab.stream_timeline(stream(
        assistant({"type": "tool_use", "id": "t", "name": "Read", "input": {"file_path": "f"}}),
        tool_result("t", big)))
    assert len(tl["items"][0]["result"]) == ab.PAGE_RESULT_CHARS and tl["items"][0]["result_cut"] == 10
    monkeypatch.setattr(ab, "PAGE_ITEMS_PER_SESSION", 3)
    tl = ab.stream_timeline(stream(*[assistant({"type": "text", "text": str(i)}) for i in range(5)]))
    assert len(tl["items"]) == 3 and tl["omitted"] == 2


def test_workspace_diff_never_follows_a_link(tmp_path):
    starter, ws = tmp_path / "starter", tmp_path / "ws"
    for d in (starter, ws):
        (d / "pkg").mkdir(parents=True)
        (d / "same.txt").write_text("same\n")
    (starter / "pkg" / "mod.py").write_text("a = 1\n")
    (ws / "pkg" / "mod.py").write_text("a = 2\n")
    (starter / "gone.txt").write_text("bye\n")
    (ws / "new.bin").write_bytes(b"\0\1\2")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    os.symlink(secret, ws / "leak.txt")
    os.symlink(tmp_path, ws / "leakdir")
    os.mkfifo(ws / "pipe")                  # reading it would block: it is named, not read
    os.link(secret, ws / "hard.txt")        # another name for a file outside: not read
    (ws / ".git").mkdir()
    (ws / ".git" / "HEAD").write_text("ref\n")
    d = ab.workspace_diff(starter, ws)
    by = {f["path"]: f for f in d["files"]}
    assert sorted(by) == ["gone.txt", "hard.txt", "leak.txt", "leakdir", "new.bin", "pipe", "pkg/mod.py"]
    assert "not a regular file" in by["pipe"]["note"] and "hard link" in by["hard.txt"]["note"]
    assert by["pkg/mod.py"]["status"] == "changed" and "-a = 1\n+a = 2\n" in by["pkg/mod.py"]["diff"]
    assert by["gone.txt"]["status"] == "removed" and "-bye" in by["gone.txt"]["diff"]
    assert by["new.bin"]["note"] == "binary, 3 bytes" and by["new.bin"]["diff"] == ""
    assert "not followed" in by["leak.txt"]["note"] and by["leak.txt"]["diff"] == ""
    assert "not followed" in by["leakdir"]["note"]
    assert "TOP-SECRET" not in json.dumps(d)
    assert ab.workspace_diff(None, ws)["available"] is False
    assert ab.workspace_diff(starter, tmp_path / "missing")["available"] is False


def brief(side):
    return [(x["run_id"], x["success"]) for x in side]


def test_differing_tasks_by_hand():
    """Per comparison, the tasks whose success rates differ, by a table of cases: rates over each
    arm's own evaluated, non-excluded runs (no run is matched with another), sorted by the size of
    the difference then task, ties (equal rates) left out, one-sided tasks named apart."""
    runs = [
        # t1: A 1/2, B 0/3 (b3 excluded, left out), C 2/2 -> B -0.5, C +0.5
        run("a1", "t1", "A", 2, success=True), run("a2", "t1", "A", 1, success=False),
        run("b1", "t1", "B", 1, success=False), run("b2", "t1", "B", 2, success=False),
        run("b4", "t1", "B", 3, success=False),
        run("b3", "t1", "B", 4, success=True, validity="degenerate"),
        run("c1", "t1", "C", 1, success=True), run("c2", "t1", "C", 2, success=True),
        # t2: A 1/1, B 1/1 (a tie: left out), C 0/1 (-1.0); a4 not evaluated: left out
        run("a3", "t2", "A", 1, success=True), run("a4", "t2", "A", 2, status="error"),
        run("b5", "t2", "B", 1, success=True), run("c3", "t2", "C", 1, success=False),
        # t0: A 0/1, B 1/2 (+0.5, the same size as t1's -0.5: task name breaks the tie)
        run("a5", "t0", "A", 1, success=False),
        run("b6", "t0", "B", 2, success=True), run("b7", "t0", "B", 1, success=False),
        # t3: only B has an evaluated run; t4: only A; t5: B's only run is excluded
        run("b8", "t3", "B", 1, success=True), run("a6", "t4", "A", 1, success=True),
        run("a7", "t5", "A", 1, success=True), run("b9", "t5", "B", 1, success=False, validity="degenerate"),
        # an unevaluated task on both sides is neither compared nor one-sided
        run("a8", "t6", "A", 1, status="error"), run("b10", "t6", "B", 1, status="error"),
    ]
    out = ab.differing_tasks(runs, ["A", "B", "C"], "A")
    assert [(c["arm"], c["baseline"]) for c in out] == [("B", "A"), ("C", "A")]
    b, c = out
    assert [(t["task"], t["diff"]) for t in b["tasks"]] == [("t0", 0.5), ("t1", -0.5)]
    assert b["tasks_compared"] == 3 and b["one_sided"] == ["t3", "t4", "t5"]
    t0, t1 = b["tasks"]
    assert (t1["arm_successes"], t1["arm_evaluated"], t1["baseline_successes"], t1["baseline_evaluated"]) \
        == (0, 3, 1, 2)
    assert brief(t1["arm_runs"]) == [("b1", False), ("b2", False), ("b4", False)]   # b3 excluded
    assert brief(t1["baseline_runs"]) == [("a2", False), ("a1", True)]              # shown by repeat
    assert brief(t0["arm_runs"]) == [("b7", False), ("b6", True)]
    assert [(t["task"], t["diff"]) for t in c["tasks"]] == [("t2", -1.0), ("t1", 0.5)]
    assert brief(c["tasks"][0]["baseline_runs"]) == [("a3", True)]                  # a4 never graded
    assert c["tasks_compared"] == 2 and c["one_sided"] == ["t0", "t4", "t5"]
    # As the all-included view: b3 and b9 count, so t1 is B 1/4 vs A 1/2 and t5 is compared.
    b_all = ab.differing_tasks(runs, ["A", "B", "C"], "A", include_excluded=True)[0]
    assert [(t["task"], t["diff"]) for t in b_all["tasks"]] == [("t5", -1.0), ("t0", 0.5), ("t1", -0.25)]
    assert b_all["one_sided"] == ["t3", "t4"]
    # Only the baseline: nothing to compare.
    assert ab.differing_tasks(runs, ["A"], "A") == []


def test_differing_tasks_agree_with_the_report():
    """The counts the pages list are the report's own per-task figures of its primary view."""
    from test_report import study_runs
    runs = study_runs()
    rep = ab.build_report(runs, ["A", "C", "D", "E"])
    for comp in ab.differing_tasks(runs, rep["arms"], rep["baseline"]):
        listed = {t["task"]: t for t in comp["tasks"]}
        per = {t["task"]: t for t in rep["comparisons"][comp["arm"]]["per_task"]}
        assert comp["tasks_compared"] == len(per)
        assert set(listed) == {k for k, t in per.items() if t["diff"] != 0}
        for k, t in listed.items():
            assert t["diff"] == pytest.approx(per[k]["diff"])
            assert (t["arm_evaluated"], t["baseline_evaluated"]) == (per[k]["arm_n"], per[k]["baseline_n"])


def test_page_file_names_are_safe_and_unique():
    names = ab.page_file_names(["r1", "../../etc/x", "a/b", "a_b", "A_B", ".."])
    assert names["r1"] == "r1.html"
    assert all("/" not in n and "\\" not in n and not n.startswith(".") for n in names.values())
    assert len({n.lower() for n in names.values()}) == 6


def hostile_page():
    rec = run(HOSTILE, "t<1>", "A<b>", 1, success=True)
    rec["audit"] = {"findings": [{"kind": "reads_oracle", "tool": "Read", "path": HOSTILE}], "flagged": True}
    rec["reviews"] = [{"n": 1, "verdict": HOSTILE, "summary": HOSTILE,
                       "findings": [{"severity": "major", "file": HOSTILE, "detail": HOSTILE}]}]
    rec["provenance"] = {"claude_version": HOSTILE}
    tl = ab.stream_timeline(stream(
        assistant({"type": "text", "text": HOSTILE}),
        assistant({"type": "tool_use", "id": "t", "name": HOSTILE, "input": {"command": HOSTILE}}),
        tool_result("t", HOSTILE * 100)))
    session = {"job_id": "j000001", "role": "executor", "status": "ok", "reason": None, "cost_usd": 0.1,
               "duration_s": 2.0, "tokens": {"input": 1, "output": 2}, "prompt": (HOSTILE, 0),
               "timeline": tl, "stream_found": True}
    diff = {"available": True, "cut": 0,
            "files": [{"path": HOSTILE, "status": "changed", "note": HOSTILE, "diff": HOSTILE}]}
    receipts = [{"file": "gate-01-cycle.json", "passed": False, "score": 0.0, "exit_code": 1,
                 "checks": [{"id": HOSTILE, "passed": False}], "output": (HOSTILE, 0)}]
    return {"run": rec, "sessions": [session], "receipts": receipts, "diff": diff}


def test_a_run_page_escapes_everything_the_agent_wrote():
    page = ab.render_run_page(hostile_page())
    p = parse(page)
    assert not any(t == "script" for t, _ in p.tags)
    hrefs = [a.get("href") for t, a in p.tags if t == "a"]
    assert hrefs == ["../index.html"]
    text = "".join(p.text)
    assert HOSTILE in text                         # shown, as text
    assert [a["data-tool"] for t, a in p.tags if "data-tool" in a] == [HOSTILE]
    assert any(t == "details" for t, _ in p.tags)  # the long result is folded


def test_the_index_section_links_every_run_and_lists_the_tasks_where_arms_differ():
    runs = [run("a1", "t1", "A", 1, success=True), run("b1", "t1", "B", 1, success=False),
            run("b9", "t1", "B", 2, success=True),
            run("a2", "t2", "A", 1, success=True), run("b2", "t2", "B", 1, success=True)]
    runs[1]["audit"] = {"findings": [{"kind": "edited_public_tests", "files": ["t"]}], "flagged": True}
    rep = ab.build_report(runs, ["A", "B"])
    names = ab.page_file_names(r["run_id"] for r in runs)
    section = ab.render_run_index(rep, runs, names)
    page = ab.render_report_html(rep, extra=section)
    head = "Tasks where B and A differ (1 of 2 compared)"
    assert page.index("</svg>") < page.index(head) < page.index("Every run: task x arm") \
        < page.index("<h2>Results per arm")   # right after the charts, before the long tables
    assert "repeat" not in section.split("Every run")[0].lower()       # no run is matched by repeat
    hrefs = [a["href"] for t, a in parse(page).tags if t == "a"]
    assert sorted(set(hrefs)) == sorted(f"runs/{n}" for n in names.values())
    assert "b1</a> F!" in section and "a1</a> S" in section
    diff = section.split("Every run")[0]
    for rid in ("a1", "b1", "b9"):                  # every run of both sides of t1
        assert f'href="runs/{rid}.html"' in diff
    assert "b2" not in diff and "a2" not in diff    # t2: equal rates, not listed
    assert "<td>1/2</td><td>1/1</td><td>-0.50</td>" in diff


def test_the_index_section_escapes_task_and_arm_names():
    runs = [run("a1", HOSTILE, "A", 1, success=True), run("b1", HOSTILE, HOSTILE, 1, success=False),
            run("a2", "t-only-a", "A", 1, success=True)]
    rep = ab.build_report(runs, ["A", HOSTILE])
    section = ab.render_run_index(rep, runs, ab.page_file_names(r["run_id"] for r in runs))
    p = parse(section)
    assert not any(t == "script" for t, _ in p.tags)
    assert all(a["href"].startswith("runs/") for t, a in p.tags if t == "a")
    text = "".join(p.text)
    assert f"Tasks where {HOSTILE} and A differ" in text and "one side only (1): t-only-a." in text


def test_report_out_directory_only_for_html(tmp_path):
    from conftest import run_main
    from test_experiment import copy_example
    study = copy_example(tmp_path / "s", tasks=("roman",), arms=("A", "B"))
    target = tmp_path / "site"
    code, out = run_main(["report", "--study", str(study), "--format", "md", "--out", str(target) + "/"])
    assert code == 2 and "directory" in out["error"] and not target.exists()
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(target) + "/"])
    assert code == 0 and out["run_pages"] == 0 and (target / "index.html").is_file(), out
    single = tmp_path / "one.html"
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(single)])
    assert code == 0 and single.is_file() and out["path"] == str(single)
    code, out = run_main(["report", "--study", str(study), "--format", "html", "--out", str(target)])
    assert code == 0 and out["directory"] == str(target)      # an existing directory gets pages too
