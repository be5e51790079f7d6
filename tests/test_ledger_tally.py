"""Ledger tallies (state/ledger_tallies/*.json): where the report's metering and `usage` resume.

A tally is a cache of a pass over the append-only ledger up to a byte offset, so what it gives must
equal, float for float and key for key, one pass over the whole ledger: with no tally, a stale one,
a garbled or hostile one, a ledger that grew (also in pieces cut inside a line), one replaced by
another file, truncated, or ending in a torn line; and the report's and usage's bytes must not
change."""
from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import os
import random
from pathlib import Path

import pytest

from conftest import ab
from test_runs_summary import make_study


# -- A ledger of many shapes -------------------------------------------------------------------------

MODELS = ["claude-opus-4-5", "claude-haiku-4-5", "claude-sonnet-4-5"]


def ledger_line(rng: random.Random, n: int) -> bytes:
    """One ledger line: metered or not, estimated, flagged cost_mismatch, with side models, or
    carrying hostile numbers; now and then not an object at all, blank, or not JSON."""
    kind = rng.random()
    if kind < 0.03:
        return rng.choice([b"[1, 2]", b"42", b"null", b'"text"', b"", b"   ", b"\xff\xfe garbage",
                           b'{"job_id": "torn", "tok', b"\t{}\r"]) + b"\n"
    job_id = rng.choice([f"j{n:06d}"] * 20 + [f"j{n // 2:06d}", 7, "7", None])   # duplicates, odd ids
    line: dict = {"job_id": job_id, "kind": rng.choice(["executor", "reviewer", "ping"]),
                  "arm": rng.choice("ABC"), "task": f"t{rng.randrange(20):03d}",
                  "status": rng.choice(["ok", "ok", "ok", "error", "timeout"]),
                  "cost_delta_usd": round(rng.random() * 3, rng.choice([2, 4, 9])),
                  "tokens": {"input": rng.randrange(10**5), "output": rng.randrange(10**4),
                             "cache_creation": rng.randrange(10**4), "cache_read": rng.randrange(10**6),
                             "cache_creation_1h": rng.randrange(100)},
                  "duration_s": rng.random() * 600, "cache_verdict": rng.choice(["warm", "cold", None]),
                  "models_used": [MODELS[0]]}
    if rng.random() < 0.1:
        line["estimated"] = True
    if rng.random() < 0.7:   # metered by the gateway, side models now and then
        models = {MODELS[0]: {"requests": rng.randrange(1, 40), "cost_usd": rng.random() * 2}}
        for side in MODELS[1:]:
            if rng.random() < 0.3:
                models[side] = {"requests": rng.randrange(1, 5), "cost_usd": rng.random() / 7}
        line["models_metered"] = models
        line["cost_metered_usd"] = sum(m["cost_usd"] for m in models.values())
        line["requests"] = sum(m["requests"] for m in models.values())
        if rng.random() < 0.15:
            line["flags"] = ["cost_mismatch"] + (["other"] if rng.random() < 0.5 else [])
    if rng.random() < 0.08:   # hostile numbers: each is checked before it reaches a sum
        line.update(rng.choice([
            {"tokens": {"input": -5, "output": 1e30, "cache_read": "9", "odd": True}},
            {"cost_delta_usd": -1.0}, {"cost_delta_usd": 1e12}, {"cost_delta_usd": "0.5"},
            {"requests": 2**70, "cost_metered_usd": 0.5},
            {"models_metered": {"x": {"requests": -1, "cost_usd": "x"}, "y": "bad"}, "cost_metered_usd": 1},
            {"cost_metered_usd": True}, {"cost_metered_usd": float("nan")}, {"cost_metered_usd": float("-inf")},
            {"cost_metered_usd": 10**400}, {"cost_metered_usd": "0.5"}, {"duration_s": -3}, {"duration_s": "long"},
            {"flags": "cost_mismatch"}, {"flags": {"cost_mismatch": 1}}, {"job_id": {"odd": [1]}},
            {"status": 7, "cache_verdict": ["x"]}, {"tokens": [1, 2]}]))
    text = json.dumps(line)
    if rng.random() < 0.05:
        text = "  " + text + " \r"   # whitespace around a line, as some writers leave it
    return text.encode() + b"\n"


def ledger_bytes(n: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    return b"".join(ledger_line(rng, i) for i in range(n))


def reference_metering(path: Path) -> dict:
    """The metering of one pass over the whole ledger, as iter_jsonl reads it (the definition a
    resumed pass must agree with)."""
    counts: dict = {}
    totals, mismatched = ab.usage_empty(), []
    for line in ab.iter_jsonl(path, counts):
        ab.usage_add(totals, ab.usage_figures(line))
        if isinstance(line.get("flags"), list) and "cost_mismatch" in line["flags"]:
            mismatched.append(line.get("job_id"))
    t = ab.usage_finish(totals)
    return {"cost_metered_usd": t["cost_metered_usd"], "cost_reported_usd": t["cost_usd"],
            "metered_jobs": t["metered_jobs"], "requests": t["requests"],
            "models_metered": t["models_metered"], "cost_mismatch_jobs": mismatched}


def reference_usage(path: Path, by: str) -> tuple:
    """`usage` of one pass over the whole ledger, one line per job id (its definition)."""
    counts: dict = {}
    agg = ab.aggregate_usage(ab.iter_ledger_once_per_job(path, counts), by=by)
    return agg, counts["lines"], counts["torn"]


def _usage(by: str):
    return lambda paths, write=True: ab.usage_of_ledger(paths, by, write=write)


#: (tally name, the pass resumed, the pass over the whole ledger)
PASSES = [("metering", ab.report_metering, reference_metering)] + [
    (f"usage_by_{by}", _usage(by), lambda path, by=by: reference_usage(path, by)) for by in ab.USAGE_GROUPINGS]
PASS_IDS = [p[0] for p in PASSES]


def same(got, want) -> None:
    """Equal, with every float bit for bit and every key in the same order."""
    assert json.dumps(got) == json.dumps(want)
    assert got == want


@pytest.fixture
def paths(tmp_path) -> ab.StudyPaths:
    p = ab.StudyPaths(tmp_path / "study")
    p.state.mkdir(parents=True)
    return p


def tally(paths: ab.StudyPaths, name: str = "metering") -> dict:
    return json.loads(ab.ledger_tally_path(paths, name).read_text())


def check(paths: ab.StudyPaths, name: str, run, ref, write: bool = True) -> None:
    same(run(paths, write=write), ref(paths.ledger))
    if ab.ledger_tally_path(paths, name).is_file():
        offset = tally(paths, name)["offset"]
        assert offset == 0 or paths.ledger.read_bytes()[offset - 1:offset] == b"\n"


# -- What a pass gives, whatever its tally -----------------------------------------------------------

@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_missing_or_empty_ledger_gives_nothing_and_writes_no_tally(paths, name, run, ref):
    check(paths, name, run, ref)
    paths.ledger.write_bytes(b"")
    check(paths, name, run, ref)
    assert not ab.ledger_tally_path(paths, name).exists()


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_ledger_that_grows_is_read_from_where_the_tally_left_off(paths, name, run, ref):
    data = ledger_bytes(900, seed=2)
    cut = data.index(b"\n", len(data) // 3) + 1
    paths.ledger.write_bytes(data[:cut])
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == cut
    with open(paths.ledger, "ab") as fh:
        fh.write(data[cut:])
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == len(data)
    check(paths, name, run, ref)                           # from the tally alone
    # ... and resuming gave what a pass from the first byte gives.
    ab.ledger_tally_path(paths, name).unlink()
    check(paths, name, run, ref, write=False)


def test_the_tally_is_what_the_pass_starts_from(paths):
    """A figure changed in a tally (still a possible tally) shows in the answer: the pass did not
    read the ledger again."""
    paths.ledger.write_bytes(ledger_bytes(600))
    want = reference_metering(paths.ledger)
    assert want["cost_mismatch_jobs"] and len(want["models_metered"]) >= 3 and want["metered_jobs"]
    same(ab.report_metering(paths), want)
    t = tally(paths)
    assert t["v"] == ab.LEDGER_TALLY_VERSION and t["pass"] == "metering"
    t["state"]["totals"]["requests"] += 5
    ab.ledger_tally_path(paths, "metering").write_text(json.dumps(t))
    assert ab.report_metering(paths)["requests"] == want["requests"] + 5
    agg, lines, torn = ab.usage_of_ledger(paths, "arm")
    t = tally(paths, "usage_by_arm")
    t["state"]["torn"] += 1
    t["state"]["totals"]["requests"] += 2
    ab.ledger_tally_path(paths, "usage_by_arm").write_text(json.dumps(t))
    agg2, lines2, torn2 = ab.usage_of_ledger(paths, "arm")
    assert (torn2, lines2, agg2["totals"]["requests"]) == (torn + 1, lines, agg["totals"]["requests"] + 2)


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_ledger_growing_in_pieces_cut_anywhere_gives_one_pass(paths, name, run, ref):
    """A writer's bytes arrive in pieces cut at random places, inside lines too: after every piece
    the pass equals one pass over what is there; the tally never ends inside a line."""
    data = ledger_bytes(400, seed=3)
    rng = random.Random(4)
    pos = 0
    paths.ledger.write_bytes(b"")
    while pos < len(data):
        step = rng.choice([1, 7, 50, 300, 2000, 9000])
        with open(paths.ledger, "ab") as fh:
            fh.write(data[pos:pos + step])
        pos += step
        check(paths, name, run, ref)
        if ab.ledger_tally_path(paths, name).exists():
            assert tally(paths, name)["offset"] == data.rindex(b"\n", 0, min(pos, len(data))) + 1


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_torn_last_line_is_counted_but_not_tallied(paths, name, run, ref):
    whole = json.dumps({"job_id": "last", "kind": "executor", "cost_metered_usd": 0.25, "requests": 3,
                        "models_metered": {"m": {"requests": 3, "cost_usd": 0.25}},
                        "flags": ["cost_mismatch"]}).encode()
    data = ledger_bytes(50, seed=5)
    paths.ledger.write_bytes(data + whole)             # complete JSON, but no newline yet
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == len(data)
    check(paths, name, run, ref)                       # not counted twice
    with open(paths.ledger, "ab") as fh:
        fh.write(b"\n")
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == len(data) + len(whole) + 1
    if name == "metering":
        assert ab.report_metering(paths)["cost_mismatch_jobs"][-1] == "last"


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_crash_cut_line_fenced_off_by_the_next_append_gives_one_pass(paths, name, run, ref):
    data = ledger_bytes(80, seed=6)
    paths.ledger.write_bytes(data + b'{"job_id": "cut", "cost_metered_usd": 0.')
    check(paths, name, run, ref)
    ab.append_jsonl(paths.ledger, {"job_id": "after", "cost_metered_usd": 0.5, "requests": 1,
                                   "flags": ["cost_mismatch"]})
    check(paths, name, run, ref)


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_replaced_ledger_is_read_from_its_first_byte(paths, tmp_path, name, run, ref):
    paths.ledger.write_bytes(ledger_bytes(300, seed=7))
    check(paths, name, run, ref)
    other = tmp_path / "other.jsonl"                   # another file renamed into place, longer
    other.write_bytes(ledger_bytes(500, seed=8))
    os.replace(other, paths.ledger)
    check(paths, name, run, ref)
    copy_ = tmp_path / "copy.jsonl"                    # the same bytes and more, a new inode
    copy_.write_bytes(paths.ledger.read_bytes() + ledger_bytes(20, seed=9))
    os.replace(copy_, paths.ledger)
    check(paths, name, run, ref)


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_truncated_or_rewritten_ledger_is_read_from_its_first_byte(paths, name, run, ref):
    data = ledger_bytes(300, seed=10)
    paths.ledger.write_bytes(data)
    check(paths, name, run, ref)
    with open(paths.ledger, "r+b") as fh:             # truncated in place (same inode)
        fh.truncate(len(data) // 2)
    check(paths, name, run, ref)
    paths.ledger.write_bytes(data)
    check(paths, name, run, ref)
    # Rewritten in place: fewer lines, then regrown past the tally's offset with other lines.
    with open(paths.ledger, "r+b") as fh:
        fh.truncate(0)
        fh.write(ledger_bytes(400, seed=11))
    assert paths.ledger.stat().st_size > tally(paths, name)["offset"]
    check(paths, name, run, ref)
    # A byte changed just before the offset, or in the first window.
    for where in (tally(paths, name)["offset"] - 10, 5):
        raw = bytearray(paths.ledger.read_bytes())
        raw[where] = ord("7") if raw[where] != ord("7") else ord("8")
        with open(paths.ledger, "r+b") as fh:
            fh.write(bytes(raw))
        check(paths, name, run, ref)


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_metered_figure_that_is_no_finite_number_is_not_metered(paths, name, run, ref):
    """NaN, an infinity or an int too large for a float: the line counts as not metered, and the
    answer is valid JSON (it used to be NaN, or an OverflowError)."""
    lines = [{"job_id": f"h{i}", "cost_metered_usd": v, "requests": 3} for i, v in
             enumerate([float("nan"), float("inf"), 10**400, 0.5])]
    paths.ledger.write_bytes(ledger_bytes(40, seed=12) + "".join(json.dumps(x) + "\n" for x in lines).encode())
    got = run(paths)
    same(got, ref(paths.ledger))
    json.dumps(got, allow_nan=False)
    assert tally(paths, name)["offset"] == paths.ledger.stat().st_size
    if name == "metering":
        ab.ledger_tally_path(paths, name).unlink()
        before = ab.report_metering(paths, write=False)
        paths.ledger.write_bytes(paths.ledger.read_bytes()[:-len(json.dumps(lines[-1])) - 1])
        assert ab.report_metering(paths, write=False)["metered_jobs"] == before["metered_jobs"] - 1


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_a_sum_beyond_a_float_leaves_no_tally_and_the_answer_stands(paths, name, run, ref):
    big = [{"job_id": f"b{i}", "kind": "executor", "cost_metered_usd": 1.5e308, "requests": 1} for i in range(2)]
    paths.ledger.write_bytes(ledger_bytes(40, seed=12) + "".join(json.dumps(x) + "\n" for x in big).encode())
    got = run(paths)
    assert json.dumps(got) == json.dumps(ref(paths.ledger))   # an infinity: compare the text
    assert "Infinity" in json.dumps(got)
    assert not ab.ledger_tally_path(paths, name).exists()


# -- A tally that is off in any way is ignored (and rebuilt) ------------------------------------------

def put(*keys_value):
    """A change that sets t[k1][k2]... = value."""
    *keys, value = keys_value

    def change(t):
        d = t
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value(t) if callable(value) else value
        return t
    return change


def drop(*keys):
    def change(t):
        d = t
        for k in keys[:-1]:
            d = d[k]
        d.pop(keys[-1])
        return t
    return change


#: Changes to a tally's frame that ledger_tally_of refuses.
FRAME_BREAKAGES = [("not an object", lambda t: [t]), ("a string", lambda t: "tally"), ("null", lambda t: None),
                   ("another version", put("v", 2)), ("version as bool", put("v", True)),
                   ("version as float", put("v", 1.0)), ("another pass", put("pass", "other")),
                   ("pass not a string", put("pass", 1))]
FRAME_BREAKAGES += [(f"no {k}", drop(k)) for k in ("v", "pass", "offset", "device", "inode", "head_sha256",
                                                   "tail_sha256", "state")]
FRAME_BREAKAGES += [(f"{k}={bad!r}", put(k, bad)) for k in ("offset", "device", "inode")
                    for bad in (-1, "12", 1.0, True, None, 2**64, 10**40, [1])]
FRAME_BREAKAGES += [(f"{k}={bad!r}", put(k, bad)) for k in ("head_sha256", "tail_sha256")
                    for bad in ("ab", "A" * 64, "g" * 64, 7, None)]

#: Well-formed frames that do not fit the ledger (ledger_mark_fits refuses them).
MARK_BREAKAGES = [
    ("an offset past the ledger", put("offset", lambda t: t["offset"] + 10**6)),
    ("an offset inside a line", put("offset", lambda t: t["offset"] - 3)),
    ("another device", put("device", lambda t: t["device"] + 1)),
    ("another inode", put("inode", lambda t: t["inode"] + 1)),
    ("another head digest", put("head_sha256", "0" * 64)),
    ("another tail digest", put("tail_sha256", "f" * 64)),
]


def accumulator_breakages(*at: str) -> list:
    """Changes to the accumulator at t["state"][at...] that usage_accumulator_ok refuses."""
    k = ("state", *at)
    return [
        ("not a dict", put(*k, [])), ("a key missing", drop(*k, "requests")),
        ("another key", put(*k, "extra", 0)),
        ("a count as float", put(*k, "jobs", 3.0)), ("a negative count", put(*k, "requests", -1)),
        ("a count as bool", put(*k, "metered_jobs", True)),
        ("a sum as int", put(*k, "cost_usd", 1)), ("a sum as string", put(*k, "duration_s", "1")),
        ("a sum infinite", put(*k, "cost_metered_usd", float("inf"))),
        ("a sum NaN", put(*k, "cost_usd", float("nan"))),
        ("statuses not summing to jobs", put(*k, "statuses", "ok", 10**6)),
        ("verdicts not summing to jobs", put(*k, "cache_verdicts", {})),
        ("a token count negative", put(*k, "tokens", "input", -3)),
        ("a token key missing", drop(*k, "tokens", "cache_read")),
        ("tokens not a dict", put(*k, "tokens", [0])),
        ("a model row odd", put(*k, "models_metered", "m", {"requests": 1})),
        ("a model row with a string", put(*k, "models_metered", "m", {"requests": 1, "cost_usd": "1"})),
        ("models not a dict", put(*k, "models_metered", [])),
        ("more metered jobs than jobs", put(*k, "metered_jobs", lambda t: t["state"]["totals"]["jobs"] + 1)),
    ]


#: Changes to a metering state that metering_state_of refuses.
METERING_BREAKAGES = [(f"totals: {n}", c) for n, c in accumulator_breakages("totals")] + [
    ("state not a dict", put("state", [])), ("state with another key", put("state", "x", 1)),
    ("no mismatched", drop("state", "cost_mismatch_jobs")),
    ("mismatched not a list", put("state", "cost_mismatch_jobs", {"a": 1})),
    ("more mismatched than jobs",
     put("state", "cost_mismatch_jobs", lambda t: [1] * (t["state"]["totals"]["jobs"] + 1))),
    ("more jobs than the offset holds", put("offset", lambda t: t["state"]["totals"]["jobs"] * 3 - 1)),
]


def _first_group(t: dict) -> str:
    return next(iter(t["state"]["groups"]))


#: Changes to a usage state that usage_state_of refuses.
USAGE_BREAKAGES = [(f"totals: {n}", c) for n, c in accumulator_breakages("totals")] + [
    ("state not a dict", put("state", None)), ("state with another key", put("state", "x", 1)),
    ("no seen", drop("state", "seen")), ("seen not a list", put("state", "seen", {"a": 1})),
    ("seen with a number", put("state", "seen", lambda t: t["state"]["seen"][:-1] + [7])),
    ("seen twice", put("state", "seen", lambda t: t["state"]["seen"][:-1] + t["state"]["seen"][:1])),
    ("fewer seen than lines", put("state", "seen", lambda t: t["state"]["seen"][:-1])),
    ("lines not matching", put("state", "lines", lambda t: t["state"]["lines"] + 1)),
    ("lines as float", put("state", "lines", lambda t: float(t["state"]["lines"]))),
    ("torn negative", put("state", "torn", -1)), ("torn as string", put("state", "torn", "1")),
    ("torn beyond the offset", put("state", "torn", 10**9)),
    ("groups not a dict", put("state", "groups", [])),
    ("groups not adding up to the jobs", put("state", "groups", {})),
    ("a group broken", lambda t: put("state", "groups", _first_group(t), "jobs", -1)(t)),
]


def _pass_breakages() -> list:
    """Every breakage for the metering and for one grouping of usage (the groupings share their
    state and its check)."""
    out = []
    for name, run, ref in PASSES[:2]:
        state = METERING_BREAKAGES if name == "metering" else USAGE_BREAKAGES
        for what, change in FRAME_BREAKAGES + MARK_BREAKAGES + state:
            out.append(pytest.param(name, run, ref, change, id=f"{name}: {what}"))
    return out


@pytest.mark.parametrize("name,run,ref,change", _pass_breakages())
def test_a_broken_tally_is_ignored_and_rebuilt(paths, name, run, ref, change):
    paths.ledger.write_bytes(ledger_bytes(120, seed=13))
    run(paths)
    good = tally(paths, name)
    ab.ledger_tally_path(paths, name).write_text(json.dumps(change(copy.deepcopy(good))))
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == good["offset"]       # rebuilt from the first byte
    if name == "metering":
        assert tally(paths, name) == good


@pytest.mark.parametrize("content", [b"", b"\x00\xff", b"{", b"[]", b"1e999999", b'{"v": 1}' * 3,
                                     b"[" * 100000 + b"]" * 100000])
@pytest.mark.parametrize("name,run,ref", PASSES[:2], ids=PASS_IDS[:2])
def test_a_garbled_tally_file_is_ignored(paths, name, run, ref, content):
    paths.ledger.write_bytes(ledger_bytes(60, seed=14))
    ab.ledger_tally_path(paths, name).parent.mkdir()
    ab.ledger_tally_path(paths, name).write_bytes(content)
    check(paths, name, run, ref)
    assert tally(paths, name)["offset"] == paths.ledger.stat().st_size


def test_a_tally_of_one_pass_is_not_read_by_another(paths):
    paths.ledger.write_bytes(ledger_bytes(60, seed=22))
    ab.usage_of_ledger(paths, "kind")
    ab.report_metering(paths)
    for a, b in (("usage_by_kind", "usage_by_arm"), ("metering", "usage_by_task"), ("usage_by_kind", "metering")):
        ab.ledger_tally_path(paths, b).write_bytes(ab.ledger_tally_path(paths, a).read_bytes())
    same(ab.usage_of_ledger(paths, "arm"), reference_usage(paths.ledger, "arm"))
    same(ab.usage_of_ledger(paths, "task"), reference_usage(paths.ledger, "task"))
    same(ab.report_metering(paths), reference_metering(paths.ledger))


def test_a_tally_behind_a_link_or_too_large_is_not_read(paths, tmp_path, monkeypatch):
    paths.ledger.write_bytes(ledger_bytes(60, seed=15))
    want = reference_metering(paths.ledger)
    ab.report_metering(paths)
    good = tally(paths)
    good["state"]["totals"]["requests"] += 1          # would show, were it read
    f = ab.ledger_tally_path(paths, "metering")
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(good))
    f.unlink()
    os.symlink(outside, f)
    same(ab.report_metering(paths, write=False), want)
    f.unlink()
    f.write_text(json.dumps(good))
    monkeypatch.setattr(ab, "LEDGER_TALLY_MAX_BYTES", 100)
    same(ab.report_metering(paths, write=False), want)


# -- The pure decisions, by table ---------------------------------------------------------------------

@pytest.mark.parametrize("offset,head,tail", [
    (0, (0, 0), (0, 0)), (1, (0, 1), (0, 1)), (4096, (0, 4096), (0, 4096)), (4097, (0, 4096), (1, 4096)),
    (10000, (0, 4096), (5904, 4096))])
def test_the_windows_a_tally_digests(offset, head, tail):
    assert ab.ledger_tally_windows(offset) == (head, tail)


def _mark_at(offset: int, head: bytes, tail: bytes, device: int = 5, inode: int = 9) -> ab.LedgerMark:
    return ab.LedgerMark(offset=offset, device=device, inode=inode, head_sha256=ab.sha256_bytes(head),
                         tail_sha256=ab.sha256_bytes(tail))


@pytest.mark.parametrize("case,device,inode,size,head,tail,fits", [
    ("the same bytes", 5, 9, 200, b"{}\n", b"{}\n", True),
    ("grown", 5, 9, 10**9, b"{}\n", b"{}\n", True),
    ("another device", 6, 9, 200, b"{}\n", b"{}\n", False),
    ("another inode", 5, 8, 200, b"{}\n", b"{}\n", False),
    ("truncated below the offset", 5, 9, 2, b"{}\n", b"{}\n", False),
    ("other first bytes", 5, 9, 200, b"[]\n", b"{}\n", False),
    ("other last bytes", 5, 9, 200, b"{}\n", b"[]\n", False),
])
def test_whether_a_tally_fits_its_ledger(case, device, inode, size, head, tail, fits):
    assert ab.ledger_mark_fits(_mark_at(3, b"{}\n", b"{}\n"), device, inode, size, head, tail) is fits, case


def test_a_tally_never_fits_inside_a_line():
    assert not ab.ledger_mark_fits(_mark_at(3, b'{"a', b'{"a'), 5, 9, 10, b'{"a', b'{"a')
    assert ab.ledger_mark_fits(_mark_at(0, b"", b""), 5, 9, 0, b"", b"")


@pytest.mark.parametrize("name,run,ref", PASSES, ids=PASS_IDS)
def test_each_part_of_a_tally_is_checked(paths, name, run, ref):
    """The frame by ledger_tally_of, the state by the pass's own check: every breakage is refused
    by the one that owns it, and the good tally is accepted by both."""
    paths.ledger.write_bytes(ledger_bytes(120, seed=16))
    run(paths)
    good = tally(paths, name)
    mark, state = ab.ledger_tally_of(good, name)
    assert mark == ab.LedgerMark(good["offset"], good["device"], good["inode"], good["head_sha256"],
                                 good["tail_sha256"])
    load = ab.metering_state_of if name == "metering" else ab.usage_state_of
    assert load(state, mark.offset) is not None
    for what, change in FRAME_BREAKAGES:
        assert ab.ledger_tally_of(change(copy.deepcopy(good)), name) is None, what
    for what, change in METERING_BREAKAGES if name == "metering" else USAGE_BREAKAGES:
        t = change(copy.deepcopy(good))
        got = ab.ledger_tally_of(t, name)
        assert got is None or load(got[1], got[0].offset) is None, what


@pytest.mark.parametrize("acc,ok", [
    (ab.usage_empty(), True), ({}, False), (None, False), ([], False),
    ({**ab.usage_empty(), "jobs": 1}, False),                                    # statuses do not add up
    ({**ab.usage_empty(), "jobs": 1, "statuses": {"ok": 1}, "cache_verdicts": {"warm": 1}}, True),
    ({**ab.usage_empty(), "models_metered": {"m": {"requests": 2, "cost_usd": 0.5}}}, True),
    ({**ab.usage_empty(), "models_metered": {"m": {"requests": 2.0, "cost_usd": 0.5}}}, False),
    ({**ab.usage_empty(), "tokens": {**ab.usage_empty()["tokens"], "odd": 4}}, True),
    ({**ab.usage_empty(), "cost_usd": -0.5}, True),                              # usage_add can make it
])
def test_usage_accumulator_ok(acc, ok):
    assert ab.usage_accumulator_ok(acc) is ok


# -- Never written where it must not be; a write that fails is no failure -----------------------------

@pytest.mark.parametrize("name,run,ref", PASSES[:2], ids=PASS_IDS[:2])
def test_without_write_no_tally_is_written(paths, name, run, ref):
    paths.ledger.write_bytes(ledger_bytes(30, seed=17))
    check(paths, name, run, ref, write=False)
    assert not ab.ledger_tally_path(paths, name).exists()


@pytest.mark.parametrize("name,run,ref", PASSES[:2], ids=PASS_IDS[:2])
def test_a_tally_that_cannot_be_written_still_gives_the_answer(paths, monkeypatch, name, run, ref):
    """A read-only or full study (a directory in the tally's place fails every read and write,
    whoever runs the test; a full disk is a write that raises ENOSPC)."""
    paths.ledger.write_bytes(ledger_bytes(30, seed=18))
    ab.ledger_tally_path(paths, name).mkdir(parents=True)
    check(paths, name, run, ref)
    ab.ledger_tally_path(paths, name).rmdir()

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ab, "write_text_atomic", full)
    check(paths, name, run, ref)
    assert not ab.ledger_tally_path(paths, name).exists()


# -- The commands -------------------------------------------------------------------------------------

def report_cli(root: Path, fmt: str, out: Path) -> bytes:
    with contextlib.redirect_stdout(io.StringIO()):
        assert ab.main(["report", "--study", str(root), "--format", fmt, "--out", str(out)]) == 0
    return out.read_bytes()


def cli(*argv: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert ab.main(list(argv)) == 0
    return buf.getvalue()


def test_the_report_is_the_same_bytes_with_and_without_the_tally(tmp_path):
    paths = make_study(tmp_path / "study", runs=144)
    data = ledger_bytes(700, seed=19)
    half = data.index(b"\n", len(data) // 2) + 1
    paths.ledger.write_bytes(data[:half] + b'{"job_id": "torn", "cost_')
    tally_file = ab.ledger_tally_path(paths, "metering")
    for fmt in ("json", "md", "html"):
        fresh = report_cli(paths.root, fmt, tmp_path / f"fresh.{fmt}")         # writes the tally
        assert tally_file.exists()
        again = report_cli(paths.root, fmt, tmp_path / f"again.{fmt}")          # reads it
        assert fresh == again
        tally_file.unlink()
    paths.ledger.write_bytes(data)                     # grown; the torn line completed otherwise
    report_cli(paths.root, "json", tmp_path / "warm-up.json")
    with open(paths.ledger, "ab") as fh:
        fh.write(ledger_bytes(100, seed=20))
    resumed = report_cli(paths.root, "json", tmp_path / "resumed.json")
    tally_file.unlink()
    full = report_cli(paths.root, "json", tmp_path / "full.json")
    assert resumed == full
    assert json.loads(full)["metering"] == reference_metering(paths.ledger)   # the report sorts keys


def test_usage_is_the_same_bytes_with_and_without_its_tallies(tmp_path):
    paths = make_study(tmp_path / "study", runs=36)
    data = ledger_bytes(700, seed=23)
    half = data.index(b"\n", len(data) // 2) + 1
    paths.ledger.write_bytes(data[:half])
    root = str(paths.root)
    for by in ab.USAGE_GROUPINGS:
        for fmt in ("json", "md"):
            fresh = cli("usage", "--study", root, "--by", by, "--format", fmt)
            assert ab.ledger_tally_path(paths, f"usage_by_{by}").exists()
            assert cli("usage", "--study", root, "--by", by, "--format", fmt) == fresh
    paths.ledger.write_bytes(data)
    for by in ab.USAGE_GROUPINGS:
        resumed = cli("usage", "--study", root, "--by", by, "--format", "md")
        ab.ledger_tally_path(paths, f"usage_by_{by}").unlink()
        assert cli("usage", "--study", root, "--by", by, "--format", "md") == resumed
        got = json.loads(resumed)
        agg, lines, torn = reference_usage(paths.ledger, by)
        assert (got["usage"], got["ledger_lines"], got["torn_lines"]) == (agg, lines, torn)


def test_inside_a_supervised_session_no_tally_is_written(tmp_path, monkeypatch):
    paths = make_study(tmp_path / "study", runs=36)
    paths.ledger.write_bytes(ledger_bytes(50, seed=21))
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    got = json.loads(cli("report", "--study", str(paths.root)))
    assert got["metering"] == reference_metering(paths.ledger)
    got = json.loads(cli("usage", "--study", str(paths.root), "--by", "arm"))
    assert got["usage"] == reference_usage(paths.ledger, "arm")[0]
    assert not (paths.state / ab.LEDGER_TALLY_DIR).exists()


# -- Real sessions: the ledger the supervisors and gateways write --------------------------------------

@pytest.mark.real_claude
def test_real_sessions_are_metered_and_used_from_where_the_tallies_left_off(tmp_path, real_claude, server,
                                                                            monkeypatch):
    """The real binary against the scripted model, through its gateway: after each session the
    report's metering and `usage` (resumed from their tallies) equal one pass over the ledger."""
    from conftest import init_real_study, run_main, wait_result, write_brief
    root, config_dir = tmp_path / "study", tmp_path / "claude-config"
    init_real_study(root, real_claude, server.url, config_dir, monkeypatch)
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(config_dir))
    paths = ab.StudyPaths(root)
    usage = {"input_tokens": 1200, "output_tokens": 345, "cache_read_input_tokens": 4000}
    offsets = []
    for n in (1, 2):
        server.add_script(f"paid{n}", {"steps": [
            {"text": "Step one.", "usage": usage, "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]},
            {"text": "Done.", "usage": usage}]})
        code, sp = run_main(["spawn", "--study", str(root), "--label", f"s{n}", "--brief",
                             write_brief(tmp_path, f"Pay. [agentbench-script:paid{n}]", name=f"b{n}")])
        assert code == 0, sp
        assert wait_result(root, sp["job_id"], timeout=120)["status"] == "ok"
        code, rep = run_main(["report", "--study", str(root)])
        assert code == 0, rep
        assert rep["metering"] == reference_metering(paths.ledger)
        assert rep["metering"]["metered_jobs"] == n and rep["metering"]["requests"] >= 2 * n
        code, us = run_main(["usage", "--study", str(root), "--by", "model"])
        assert code == 0, us
        assert (us["usage"], us["ledger_lines"], us["torn_lines"]) == reference_usage(paths.ledger, "model")
        assert us["ledger_lines"] == n
        size = paths.ledger.stat().st_size
        assert tally(paths)["offset"] == tally(paths, "usage_by_model")["offset"] == size
        offsets.append(size)
    assert offsets[0] < offsets[1]
