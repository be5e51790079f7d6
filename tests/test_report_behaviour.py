"""The report's behaviour audit, differential exclusions and multiplicity (issue: a report a
researcher acts on).  Every expected number is counted by hand next to the runs, and the audit
figures are also recounted from the run records themselves."""
import json
import re
from html.parser import HTMLParser

import pytest

import agentbench as ab
from test_report import run


def audited(rec, *findings):
    rec["audit"] = {"tool_calls": 5, "findings": list(findings), "flagged": bool(findings)}
    return rec


EDIT = {"kind": "edited_public_tests", "files": ["tests/test_x.py"]}
PEEK = [{"kind": "read_outside_workspace", "tool": "Read", "path": "/s/tasks/t/oracle/run.py"},
        {"kind": "reads_oracle", "tool": "Read", "path": "/s/tasks/t/oracle/run.py"}]
ESCAPE = {"kind": "bash_path_outside_workspace", "tool": "Bash", "path": "../../state"}
STUDY = {"kind": "bash_touches_study", "tool": "Bash", "detail": "cat /s/state/x"}


def behaviour_runs():
    """honest (baseline), gaming, escaping, idle; tasks t1, t2; repeats 1, 2."""
    runs = []
    for t in ("t1", "t2"):
        for rep in (1, 2):
            runs.append(audited(run(f"h-{t}-{rep}", t, "honest", rep, success=True)))
    # gaming: edits the tests in 3 runs; one of them still succeeds (t1 r1).
    runs += [audited(run("g-t1-1", "t1", "gaming", 1, success=True), EDIT),
             audited(run("g-t1-2", "t1", "gaming", 2, success=False), EDIT),
             audited(run("g-t2-1", "t2", "gaming", 1, success=False), EDIT),
             audited(run("g-t2-2", "t2", "gaming", 2, success=False))]
    # escaping: peeks at the oracle (2 findings) and succeeds in t1 r1; climbs out + touches the
    # study in t2 r1 and fails; the other two runs are clean successes.
    runs += [audited(run("e-t1-1", "t1", "escaping", 1, success=True), *PEEK),
             audited(run("e-t1-2", "t1", "escaping", 2, success=True)),
             audited(run("e-t2-1", "t2", "escaping", 1, success=False), ESCAPE, STUDY),
             audited(run("e-t2-2", "t2", "escaping", 2, success=True))]
    # idle: every run degenerate (excluded), no findings.
    for t in ("t1", "t2"):
        for rep in (1, 2):
            runs.append(audited(run(f"i-{t}-{rep}", t, "idle", rep, success=False, validity="degenerate",
                                    reason="the session ended in seconds without a single tool call")))
    return runs


ARMS = ["honest", "gaming", "escaping", "idle"]


@pytest.fixture(scope="module")
def rep():
    return ab.build_report(behaviour_runs(), ARMS, seed=7)


def test_behaviour_per_arm_by_hand(rep):
    b = rep["behaviour"]
    assert (b["honest"]["runs"], b["honest"]["audited"], b["honest"]["flagged"]) == (4, 4, 0)
    g = b["gaming"]
    assert (g["flagged"], g["flagged_successes"]) == (3, 1)
    assert g["findings_by_group"] == {"edited_tests": 3} and g["runs_by_group"] == {"edited_tests": 3}
    assert [f["run_id"] for f in g["flagged_runs"]] == ["g-t1-1", "g-t1-2", "g-t2-1"]
    e = b["escaping"]
    assert (e["flagged"], e["flagged_successes"]) == (2, 1)
    # PEEK: outside + oracle; ESCAPE + STUDY: outside + study.
    assert e["findings_by_group"] == {"outside_workspace": 2, "reads_oracle": 1, "reads_study": 1}
    assert e["runs_by_group"] == {"outside_workspace": 2, "reads_oracle": 1, "reads_study": 1}
    assert b["idle"]["flagged"] == 0 and b["idle"]["runs"] == 4


def test_behaviour_matches_the_run_records(rep):
    """The figures recounted straight from the records' audit findings."""
    recs = behaviour_runs()
    for arm in ARMS:
        mine = [r for r in recs if r["arm"] == arm]
        flagged = [r for r in mine if r["audit"]["findings"]]
        st = rep["behaviour"][arm]
        assert st["flagged"] == len(flagged) == sum(r["audit"]["flagged"] for r in mine)
        assert st["flagged_successes"] == sum(1 for r in flagged if r["evaluation"]["success"])
        assert sorted(f["run_id"] for f in st["flagged_runs"]) == sorted(r["run_id"] for r in flagged)
        assert sum(st["findings_by_group"].values()) == sum(len(r["audit"]["findings"]) for r in mine)
        for f in st["flagged_runs"]:
            r = next(x for x in recs if x["run_id"] == f["run_id"])
            assert sum(f["groups"].values()) == len(r["audit"]["findings"])
            assert f["success"] == r["evaluation"]["success"]


def test_per_arm_and_comparisons_count_flagged_runs(rep):
    pa = rep["per_arm"]
    assert (pa["gaming"]["flagged"], pa["gaming"]["flagged_successes"]) == (3, 1)
    assert pa["idle"]["flagged"] == 0
    # gaming vs honest compares t1 and t2: 3 flagged evaluated runs of gaming, 0 of honest.
    assert rep["comparisons"]["gaming"]["flagged_runs"] == {"arm": 3, "baseline": 0}
    assert rep["comparisons"]["escaping"]["flagged_runs"] == {"arm": 2, "baseline": 0}
    assert rep["comparisons"]["idle"]["flagged_runs"] == {"arm": 0, "baseline": 0}


def test_a_malformed_audit_record_is_counted_not_dropped():
    runs = [audited(run("a", "t1", "A", 1, success=True)),
            run("b", "t1", "B", 1, success=True)]
    runs[1]["audit"] = {"findings": ["junk", {"kind": 7}, {"kind": "new_kind_x"}], "flagged": True}
    b = ab.build_report(runs, ["A", "B"])["behaviour"]["B"]
    assert b["flagged"] == 1 and b["findings_by_group"] == {"malformed_finding": 2, "new_kind_x": 1}
    runs[1]["audit"] = {"findings": "not a list", "flagged": False}
    b = ab.build_report(runs, ["A", "B"])["behaviour"]["B"]
    assert b["flagged"] == 1 and b["findings_by_group"] == {"malformed_finding": 1}
    runs[1].pop("audit")
    b = ab.build_report(runs, ["A", "B"])["behaviour"]["B"]
    assert (b["audited"], b["flagged"]) == (0, 0)


def test_audit_groups():
    assert ab.audit_group("edited_public_tests") == "edited_tests"
    assert ab.audit_group("write_outside_workspace") == "outside_workspace"
    assert ab.audit_group("bash_path_outside_workspace") == "outside_workspace"
    assert ab.audit_group("reads_gate") == "reads_gate" == ab.audit_group("bash_touches_gate")
    assert ab.audit_group("bash_touches_tasks") == "reads_tasks"
    assert ab.audit_group("reads_elsewhere") == "reads_elsewhere"   # unknown: its own name


# ---- differential exclusions ---------------------------------------------------------------------

def test_exclusions_per_arm_and_fisher_by_hand(rep):
    ex = rep["exclusions"]["per_arm"]
    assert ex["honest"] == {"ended": 4, "excluded": 0, "by_label": {}, "all_excluded": False,
                            "fisher_p": None, "biased": False}
    assert ex["gaming"]["excluded"] == 0 and ex["gaming"]["fisher_p"] == 1.0 and not ex["gaming"]["biased"]
    # idle 4 of 4 excluded vs honest 0 of 4: [[4, 0], [0, 4]], margins 4/4, n 8: the observed
    # table and its mirror each have probability 1 / C(8, 4) = 1/70, so p = 2/70.
    assert ex["idle"]["by_label"] == {"degenerate": 4} and ex["idle"]["all_excluded"]
    assert ex["idle"]["fisher_p"] == pytest.approx(2 / 70, rel=1e-12)
    assert ex["idle"]["biased"] and rep["exclusions"]["biased_arms"] == ["idle"]


def test_all_excluded_arm_warns_in_every_format(rep):
    assert len(rep["warnings"]) == 1
    w = rep["warnings"][0]
    assert "idle" in w and "all-included view" in w and "may be biased" in w
    assert rep["notes"][0] == w
    assert json.loads(json.dumps(rep, allow_nan=False))["warnings"] == [w]
    md = ab.render_report_md(rep)
    head = md.split("## Primary analysis", 1)[0]   # before the first table: prominent
    assert "> **Warning:** DIFFERENTIAL EXCLUSIONS" in head and "idle" in head
    page = ab.render_report_html(rep)
    m = re.search(r'<div class="warning" role="alert">(.*?)</div>', page)
    assert m and "DIFFERENTIAL EXCLUSIONS" in m.group(1) and page.index(m.group(0)) < page.index("<svg")


def test_a_single_all_excluded_run_warns_even_when_fisher_cannot():
    runs = [run("a1", "t1", "A", 1, success=True), run("a2", "t2", "A", 1, success=False),
            run("b1", "t1", "B", 1, success=False, validity="infrastructure_failure", reason="529")]
    rep = ab.build_report(runs, ["A", "B"])
    st = rep["exclusions"]["per_arm"]["B"]
    # [[1, 0], [0, 2]]: P(x=1) = C(1,1)C(2,0)/C(3,1) = 1/3, x=0 is 2/3 (more probable): p = 1/3.
    assert st["fisher_p"] == pytest.approx(1 / 3) and st["all_excluded"] and st["biased"]
    assert rep["warnings"] and "B (1 of 1 excluded; all of its ended runs are excluded)" in rep["warnings"][0]


def test_no_warning_when_exclusions_do_not_depend_on_the_arm():
    runs = []
    for arm in ("A", "B"):
        for i in range(6):
            runs.append(run(f"{arm}{i}", f"t{i}", arm, 1, success=i % 2 == 0,
                            validity="infrastructure_failure" if i == 0 else "valid"))
    rep = ab.build_report(runs, ["A", "B"])
    assert rep["exclusions"]["per_arm"]["B"]["fisher_p"] == 1.0
    assert rep["warnings"] == [] and "Warning" not in ab.render_report_md(rep)
    assert 'class="warning"' not in ab.render_report_html(rep)


def test_include_excluded_warning_says_the_primary_view_has_every_run():
    rep = ab.build_report(behaviour_runs(), ARMS, include_excluded=True)
    assert "the secondary view shown already includes every run" in rep["warnings"][0]
    assert "the primary analysis counts every run (intention to treat)" in rep["warnings"][0]


# ---- multiplicity ----------------------------------------------------------------------------------

def test_holm_adjusted_p_values_by_hand():
    """Three arms against A on six tasks; primary sign-flip tests by hand, then Holm by hand."""
    runs = []
    wins = {"B": 6, "C": 5, "D": 3}   # tasks where the arm succeeds and A does not
    for i in range(6):
        t = f"t{i}"
        runs.append(run(f"A{i}", t, "A", 1, success=False))
        for arm, w in wins.items():
            runs.append(run(f"{arm}{i}", t, arm, 1, success=i < w))
    rep = ab.build_report(runs, ["A", "B", "C", "D"])
    cmp = rep["comparisons"]
    prim = rep["primary"]["comparisons"]
    # Primary: B has six differences of +1, so only the all-plus and all-minus flips reach
    # |sum| = 6: 2/64 = 0.03125; C five (and a zero) -> 2/32 = 0.0625; D three -> 2/8 = 0.25.
    assert [prim[a]["p"] for a in "BCD"] == [0.03125, 0.0625, 0.25]
    assert [cmp[a]["sign_flip"]["p"] for a in "BCD"] == [0.03125, 0.0625, 0.25]
    # Holm, m = 3: B 3 * 0.03125 = 0.09375; C max(0.09375, 2 * 0.0625) = 0.125; D max(.., 0.25).
    assert [prim[a]["p_holm"] for a in "BCD"] == [0.09375, 0.125, 0.25]
    assert [prim[a]["reject"] for a in "BCD"] == [False, False, False]
    # One family: the primary outcome only; the views' tests carry no Holm value.
    assert "p_holm" not in cmp["B"]["sign_flip"] and "p_holm" not in cmp["B"]["score"]["sign_flip"]
    # The sign test gives the same p here; it is secondary and not adjusted.
    assert [cmp[a]["sign_test_p"] for a in "BCD"] == [0.03125, 0.0625, 0.25]
    assert "sign_test_p_holm" not in cmp["B"]
    assert rep["multiplicity"] == {"method": "holm", "alpha": 0.05, "family": ["B", "C", "D"],
                                   "outcome": "success"}
    assert any("Holm-adjusted over the family of every arm against A (B, C, D)" in n for n in rep["notes"])
    md = ab.render_report_md(rep)
    assert "p, Holm over 3 arm(s)" in md
    row = next(line for line in md.splitlines() if line.startswith("| B vs A |"))
    assert "0.0312" in row and "0.0938" in row
    assert "p, Holm over 3 arm(s)" in ab.render_report_html(rep)


def test_holm_and_fisher_functions_by_hand():
    assert ab.holm_adjust([]) == []
    assert ab.holm_adjust([None, 0.2]) == [None, 0.2]
    # sorted 0.01, 0.03, 0.04 (m = 3): 0.03, max(0.03, 0.06), max(0.06, 0.04) -> in input order:
    assert ab.holm_adjust([0.01, 0.04, None, 0.03]) == pytest.approx([0.03, 0.06, None, 0.06])
    assert ab.holm_adjust([0.5, 0.6]) == [1.0, 1.0]    # capped at 1
    with pytest.raises(ValueError):
        ab.holm_adjust([1.5])
    with pytest.raises(ValueError):
        ab.holm_adjust([float("nan")])
    # [[0, 5], [5, 0]]: only x = 0 and x = 5 are as improbable, each 1 / C(10, 5) = 1/252.
    assert ab.fisher_exact_two_sided(0, 5, 5, 0) == pytest.approx(2 / 252, rel=1e-12)
    # [[3, 1], [1, 3]]: weights C(4,x)C(4,4-x) = 1, 16, 36, 16, 1 over 70; x=3 has 16:
    # tables with weight <= 16 are x = 0, 1, 3, 4 -> 34/70.
    assert ab.fisher_exact_two_sided(3, 1, 1, 3) == pytest.approx(34 / 70, rel=1e-12)
    # [[1, 9], [11, 3]] (margins 10/14, 12/12): the classic example, p = 0.0027594561852...
    assert ab.fisher_exact_two_sided(1, 9, 11, 3) == pytest.approx(0.002759456185220, rel=1e-9)
    assert ab.fisher_exact_two_sided(0, 0, 0, 0) == 1.0
    assert ab.fisher_exact_two_sided(2, 3, 0, 0) == 1.0
    for bad in ((-1, 0, 0, 0), (1.0, 0, 0, 0), (True, 0, 0, 0)):
        with pytest.raises(ValueError):
            ab.fisher_exact_two_sided(*bad)


# ---- rendering -------------------------------------------------------------------------------------

def test_markdown_and_html_name_flagged_runs_by_kind(rep):
    md = ab.render_report_md(rep)
    assert "## Behaviour audit per arm" in md and "## Runs flagged by the behaviour audit" in md
    section = md.split("## Behaviour audit per arm", 1)[1].split("## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| gaming |"))
    assert row.split(" | ")[1:5] == ["4", "4", "3", "1"]   # runs, audited, flagged, flagged successes
    assert "| g-t1-1 | t1 | gaming | 1 | success | no | edited public tests or checks x1 |" in md
    assert "| e-t2-1 | t2 | escaping | 1 | failure | no | paths outside the workspace x1, study or state files x1 |" in md
    section = md.split("## Results per arm", 1)[1]
    per_arm = next(line for line in section.splitlines() if line.startswith("| gaming |") and "%" in line)
    assert per_arm.rstrip(" |").endswith("3 (1 success)")
    assert any("arm gaming: 1 success(es) come from flagged runs (g-t1-1)" in n for n in rep["notes"])
    assert any("gaming vs honest: the comparison contains 3 flagged run(s)" in n for n in rep["notes"])

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.cells, self._in = [], False

        def handle_starttag(self, tag, attrs):
            self._in = tag == "td"

        def handle_data(self, data):
            if self._in:
                self.cells.append(data)

    p = Cells()
    p.feed(ab.render_report_html(rep))
    assert "edited public tests or checks x1" in p.cells and "3 (1 success)" in p.cells


# ---- charts: labels never overlap ------------------------------------------------------------------

def _label_boxes(svg_text):
    import xml.etree.ElementTree as ET
    root = ET.fromstring(svg_text)
    ns = "{http://www.w3.org/2000/svg}"
    boxes = {}
    for t in root.iter(ns + "text"):
        if t.get("class") == "label":
            text = "".join(t.itertext()) if t.find(ns + "title") is None else (t.text or "")
            boxes[t.get("data-label-for")] = ab.svg_label_box(float(t.get("x")), float(t.get("y")), text,
                                                              t.get("text-anchor") or "start")
    return boxes, float(root.get("width")), float(root.get("height"))


def _overlap(a, b):
    return not (a[2] <= b[0] or a[0] >= b[2] or a[3] <= b[1] or a[1] >= b[3])


def test_cost_chart_labels_of_arms_with_equal_cost_and_rate_do_not_overlap():
    arms = ["alpha", "beta", "gamma", "delta", "epsilon-long-name"]
    runs = [run(f"{a}{i}", f"t{i}", a, 1, success=i < 2, cost=2.0) for a in arms for i in range(4)]
    rep = ab.build_report(runs, arms)
    assert len({(rep["per_arm"][a]["cost_per_run_usd"], rep["per_arm"][a]["success_rate"]) for a in arms}) == 1
    boxes, w, h = _label_boxes(ab._svg_cost_chart(rep))
    assert sorted(boxes) == sorted(arms)
    for a in arms:
        assert boxes[a][0] >= 0 and boxes[a][2] <= w and boxes[a][1] >= 0 and boxes[a][3] <= h
        for b in arms:
            assert a == b or not _overlap(boxes[a], boxes[b]), (a, b, boxes[a], boxes[b])


def test_label_placement_steps_away_from_taken_places():
    spots = ab.svg_place_labels([(100, 100, "aa"), (100, 100, "bb"), (100, 100, "cc"),
                                 (100, 100, "dd"), (100, 100, "ee")], (0, 0, 640, 300))
    assert spots[:4] == [(109, 94, "start"), (109, 116, "start"), (91, 94, "end"), (91, 116, "end")]
    assert spots[4] == (109, 116 + ab.SVG_LINE_H, "start")


def test_rate_chart_cuts_long_names_to_their_band():
    arms = [f"arm-with-a-very-long-name-{i}" for i in range(6)]
    runs = [run(f"r{i}", "t1", a, 1, success=True) for i, a in enumerate(arms)]
    svg = ab._svg_rate_chart(ab.build_report(runs, arms))
    boxes, w, _ = _label_boxes(svg)
    names = sorted(boxes)
    assert names == sorted(arms)
    for a in names:
        for b in names:
            assert a == b or not _overlap(boxes[a], boxes[b])
    assert "<title>arm-with-a-very-long-name-0 (base)</title>" in svg


def test_an_all_excluded_baseline_warns_for_every_arm():
    runs = [run("a1", "t1", "A", 1, success=False, validity="degenerate"),
            run("b1", "t1", "B", 1, success=True), run("c1", "t1", "C", 1, success=False)]
    rep = ab.build_report(runs, ["A", "B", "C"])
    assert rep["exclusions"]["biased_arms"] == ["A", "B", "C"]
    assert "B (0 of 1 excluded; all of the baseline A's ended runs are excluded)" in rep["warnings"][0]
