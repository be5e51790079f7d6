"""The ledger tally (state/ledger_tally.json): where the report's metering pass resumes.

It is a cache of the pass over the append-only ledger up to a byte offset, so the metering it gives
must equal, float for float and key for key, one pass over the whole ledger: with no tally, a stale
one, a garbled or hostile one, a ledger that grew (also in pieces cut inside a line), one replaced
by another file, truncated, or ending in a torn line; and the report's bytes must not change."""
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
    line: dict = {"job_id": f"j{n:06d}", "kind": rng.choice(["executor", "reviewer", "ping"]),
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
            {"cost_metered_usd": True}, {"duration_s": -3}, {"duration_s": "long"},
            {"flags": "cost_mismatch"}, {"flags": {"cost_mismatch": 1}}, {"job_id": {"odd": [1]}},
            {"status": 7, "cache_verdict": ["x"]}, {"tokens": [1, 2]}]))
    text = json.dumps(line)
    if rng.random() < 0.05:
        text = "  " + text + " \r"   # whitespace around a line, as some writers leave it
    return text.encode() + b"\n"


def ledger_bytes(n: int, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    return b"".join(ledger_line(rng, i) for i in range(n))


def reference(path: Path) -> dict:
    """The metering of one pass over the whole ledger, as iter_jsonl reads it (the definition the
    tally must agree with)."""
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


def same(got: dict, want: dict) -> None:
    """Equal, with every float bit for bit and every key in the same order."""
    assert json.dumps(got) == json.dumps(want)
    assert got == want


@pytest.fixture
def paths(tmp_path) -> ab.StudyPaths:
    p = ab.StudyPaths(tmp_path / "study")
    p.state.mkdir(parents=True)
    return p


def tally(paths: ab.StudyPaths) -> dict:
    return json.loads(ab.ledger_tally_path(paths).read_text())


# -- The metering, whatever the tally -----------------------------------------------------------------

def test_a_missing_or_empty_ledger_meters_nothing_and_writes_no_tally(paths):
    same(ab.report_metering(paths), reference(paths.ledger))
    paths.ledger.write_bytes(b"")
    same(ab.report_metering(paths), reference(paths.ledger))
    assert not ab.ledger_tally_path(paths).exists()


def test_the_tally_gives_the_full_pass_and_is_resumed(paths):
    data = ledger_bytes(600)
    paths.ledger.write_bytes(data)
    want = reference(paths.ledger)
    assert want["cost_mismatch_jobs"] and len(want["models_metered"]) >= 3 and want["metered_jobs"]
    same(ab.report_metering(paths), want)             # builds the tally
    t = tally(paths)
    assert t["offset"] == len(data) and t["v"] == ab.LEDGER_TALLY_VERSION
    same(ab.report_metering(paths), want)             # from the tally alone
    # The tally is what the answer starts from: a figure changed in it (still a possible tally)
    # shows in the answer, so the pass did not read the ledger again.
    t["totals"]["requests"] += 5
    ab.ledger_tally_path(paths).write_text(json.dumps(t))
    assert ab.report_metering(paths)["requests"] == want["requests"] + 5


def test_a_ledger_that_grows_is_read_from_where_the_tally_left_off(paths):
    data = ledger_bytes(900, seed=2)
    cut = data.index(b"\n", len(data) // 3) + 1
    paths.ledger.write_bytes(data[:cut])
    ab.report_metering(paths)
    assert tally(paths)["offset"] == cut
    with open(paths.ledger, "ab") as fh:
        fh.write(data[cut:])
    same(ab.report_metering(paths), reference(paths.ledger))
    assert tally(paths)["offset"] == len(data)
    # ... and resuming gave what a pass from the first byte gives.
    ab.ledger_tally_path(paths).unlink()
    same(ab.report_metering(paths, write=False), reference(paths.ledger))


def test_a_ledger_growing_in_pieces_cut_anywhere_meters_as_one_pass(paths):
    """A writer's bytes arrive in pieces cut at random places, inside lines too: after every piece
    the metering equals one pass over what is there; the tally never ends inside a line."""
    data = ledger_bytes(400, seed=3)
    rng = random.Random(4)
    pos = 0
    paths.ledger.write_bytes(b"")
    while pos < len(data):
        step = rng.choice([1, 7, 50, 300, 2000, 9000])
        with open(paths.ledger, "ab") as fh:
            fh.write(data[pos:pos + step])
        pos += step
        same(ab.report_metering(paths), reference(paths.ledger))
        if ab.ledger_tally_path(paths).exists():
            offset = tally(paths)["offset"]
            assert data[offset - 1:offset] == b"\n" and offset <= pos
            assert offset == data.rindex(b"\n", 0, min(pos, len(data))) + 1


def test_a_torn_last_line_is_counted_but_not_tallied(paths):
    whole = json.dumps({"job_id": "last", "cost_metered_usd": 0.25, "requests": 3,
                        "models_metered": {"m": {"requests": 3, "cost_usd": 0.25}},
                        "flags": ["cost_mismatch"]}).encode()
    data = ledger_bytes(50, seed=5)
    paths.ledger.write_bytes(data + whole)             # complete JSON, but no newline yet
    got = ab.report_metering(paths)
    same(got, reference(paths.ledger))
    assert got["cost_mismatch_jobs"][-1] == "last"
    assert tally(paths)["offset"] == len(data)
    same(ab.report_metering(paths), reference(paths.ledger))   # not counted twice
    with open(paths.ledger, "ab") as fh:
        fh.write(b"\n")
    same(ab.report_metering(paths), reference(paths.ledger))
    assert tally(paths)["offset"] == len(data) + len(whole) + 1


def test_a_crash_cut_line_fenced_off_by_the_next_append_meters_as_one_pass(paths):
    data = ledger_bytes(80, seed=6)
    paths.ledger.write_bytes(data + b'{"job_id": "cut", "cost_metered_usd": 0.')
    same(ab.report_metering(paths), reference(paths.ledger))
    ab.append_jsonl(paths.ledger, {"job_id": "after", "cost_metered_usd": 0.5, "requests": 1,
                                   "flags": ["cost_mismatch"]})
    got = ab.report_metering(paths)
    same(got, reference(paths.ledger))
    assert got["cost_mismatch_jobs"][-1] == "after"


def test_a_replaced_ledger_is_read_from_its_first_byte(paths, tmp_path):
    paths.ledger.write_bytes(ledger_bytes(300, seed=7))
    ab.report_metering(paths)
    # Another file renamed into place, longer than the tally's offset.
    other = tmp_path / "other.jsonl"
    other.write_bytes(ledger_bytes(500, seed=8))
    os.replace(other, paths.ledger)
    same(ab.report_metering(paths), reference(paths.ledger))
    # The same bytes again under a new inode, then more: still right.
    copy_ = tmp_path / "copy.jsonl"
    copy_.write_bytes(paths.ledger.read_bytes() + ledger_bytes(20, seed=9))
    os.replace(copy_, paths.ledger)
    same(ab.report_metering(paths), reference(paths.ledger))


def test_a_truncated_or_rewritten_ledger_is_read_from_its_first_byte(paths):
    data = ledger_bytes(300, seed=10)
    paths.ledger.write_bytes(data)
    ab.report_metering(paths)
    with open(paths.ledger, "r+b") as fh:             # truncated in place (same inode)
        fh.truncate(len(data) // 2)
    same(ab.report_metering(paths), reference(paths.ledger))
    paths.ledger.write_bytes(data)
    ab.report_metering(paths)
    # Rewritten in place: fewer lines, then regrown past the tally's offset with other lines.
    with open(paths.ledger, "r+b") as fh:
        fh.truncate(0)
        fh.write(ledger_bytes(400, seed=11))
    assert paths.ledger.stat().st_size > tally(paths)["offset"]
    same(ab.report_metering(paths), reference(paths.ledger))
    # A byte changed just before the offset, or in the first window.
    for where in (tally(paths)["offset"] - 10, 5):
        raw = bytearray(paths.ledger.read_bytes())
        raw[where] = ord("7") if raw[where] != ord("7") else ord("8")
        with open(paths.ledger, "r+b") as fh:
            fh.write(bytes(raw))
        same(ab.report_metering(paths), reference(paths.ledger))


def test_a_non_finite_figure_leaves_no_tally_and_the_answer_stands(paths):
    data = ledger_bytes(40, seed=12) + b'{"job_id": "nan", "cost_metered_usd": NaN, "requests": 1}\n'
    paths.ledger.write_bytes(data)
    got = ab.report_metering(paths)
    assert json.dumps(got) == json.dumps(reference(paths.ledger))   # NaN != NaN: compare the text
    assert not ab.ledger_tally_path(paths).exists()


# -- A tally that is off in any way is ignored --------------------------------------------------------

def _breakages() -> list:
    """(name, change to a parsed tally) for every way a tally can be off."""
    def put(*keys_value):
        *keys, value = keys_value

        def change(t):
            d = t
            for k in keys[:-1]:
                d = d[k]
            d[keys[-1]] = value
            return t
        return change

    def drop(key):
        return lambda t: {k: v for k, v in t.items() if k != key}

    out = [("not an object", lambda t: [t]), ("a string", lambda t: "tally"), ("null", lambda t: None),
           ("another version", put("v", 2)), ("version as bool", put("v", True)),
           ("version as float", put("v", 1.0))]
    for key in ("v", "offset", "device", "inode", "head_sha256", "tail_sha256", "totals",
                "cost_mismatch_jobs"):
        out.append((f"no {key}", drop(key)))
    for key in ("offset", "device", "inode"):
        for bad in (-1, "12", 1.0, True, None, 2**64, 10**40, [1]):
            out.append((f"{key}={bad!r}", put(key, bad)))
    for key in ("head_sha256", "tail_sha256"):
        for bad in ("ab", "A" * 64, "g" * 64, 7, None):
            out.append((f"{key}={bad!r}", put(key, bad)))
    out += [
        ("totals not a dict", put("totals", [])), ("totals missing a key", lambda t: (
            t["totals"].pop("requests"), t)[1]),
        ("totals with another key", put("totals", "extra", 0)),
        ("a count as float", put("totals", "jobs", 3.0)), ("a negative count", put("totals", "requests", -1)),
        ("a count as bool", put("totals", "metered_jobs", True)),
        ("a sum as int", put("totals", "cost_usd", 1)), ("a sum as string", put("totals", "duration_s", "1")),
        ("a sum infinite", put("totals", "cost_metered_usd", float("inf"))),
        ("a sum NaN", put("totals", "cost_usd", float("nan"))),
        ("statuses not summing to jobs", put("totals", "statuses", "ok", 10**6)),
        ("verdicts not summing to jobs", put("totals", "cache_verdicts", {})),
        ("a token count negative", put("totals", "tokens", "input", -3)),
        ("a token key missing", lambda t: (t["totals"]["tokens"].pop("cache_read"), t)[1]),
        ("tokens not a dict", put("totals", "tokens", [0])),
        ("a model row odd", put("totals", "models_metered", "m", {"requests": 1})),
        ("a model row with a string", put("totals", "models_metered", "m", {"requests": 1, "cost_usd": "1"})),
        ("models not a dict", put("totals", "models_metered", [])),
        ("more metered jobs than jobs", lambda t: put("totals", "metered_jobs", t["totals"]["jobs"] + 1)(t)),
        ("more jobs than the offset holds", lambda t: put("offset", t["totals"]["jobs"] * 3 - 1)(t)),
        ("mismatched not a list", put("cost_mismatch_jobs", {"a": 1})),
        ("more mismatched than jobs", lambda t: put("cost_mismatch_jobs", [1] * (t["totals"]["jobs"] + 1))(t)),
        ("an offset past the ledger", lambda t: put("offset", t["offset"] + 10**6)(t)),
        ("an offset inside a line", lambda t: put("offset", t["offset"] - 3)(t)),
        ("another device", lambda t: put("device", t["device"] + 1)(t)),
        ("another inode", lambda t: put("inode", t["inode"] + 1)(t)),
        ("another head digest", put("head_sha256", "0" * 64)),
        ("another tail digest", put("tail_sha256", "f" * 64)),
    ]
    return out


BREAKAGES = _breakages()


@pytest.mark.parametrize("name,change", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_a_broken_tally_is_ignored_and_rebuilt(paths, name, change):
    paths.ledger.write_bytes(ledger_bytes(120, seed=13))
    want = reference(paths.ledger)
    ab.report_metering(paths)
    good = tally(paths)
    broken = change(copy.deepcopy(good))
    ab.ledger_tally_path(paths).write_text(json.dumps(broken))
    same(ab.report_metering(paths), want)
    assert tally(paths) == good                      # rebuilt from the first byte


@pytest.mark.parametrize("content", [b"", b"\x00\xff", b"{", b"[]", b"1e999999", b'{"v": 1}' * 3,
                                     b"[" * 100000 + b"]" * 100000])
def test_a_garbled_tally_file_is_ignored(paths, content):
    paths.ledger.write_bytes(ledger_bytes(60, seed=14))
    ab.ledger_tally_path(paths).write_bytes(content)
    same(ab.report_metering(paths), reference(paths.ledger))
    assert tally(paths)["offset"] == paths.ledger.stat().st_size


def test_a_tally_behind_a_link_or_too_large_is_not_read(paths, tmp_path, monkeypatch):
    paths.ledger.write_bytes(ledger_bytes(60, seed=15))
    want = reference(paths.ledger)
    ab.report_metering(paths)
    good = tally(paths)
    good["totals"]["requests"] += 1                  # would show, were it read
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(good))
    ab.ledger_tally_path(paths).unlink()
    os.symlink(outside, ab.ledger_tally_path(paths))
    same(ab.report_metering(paths, write=False), want)
    ab.ledger_tally_path(paths).unlink()
    ab.ledger_tally_path(paths).write_text(json.dumps(good))
    monkeypatch.setattr(ab, "LEDGER_TALLY_MAX_BYTES", 100)
    same(ab.report_metering(paths, write=False), want)


# -- The pure decisions, by table ---------------------------------------------------------------------

@pytest.mark.parametrize("offset,head,tail", [
    (0, (0, 0), (0, 0)), (1, (0, 1), (0, 1)), (4096, (0, 4096), (0, 4096)), (4097, (0, 4096), (1, 4096)),
    (10000, (0, 4096), (5904, 4096))])
def test_the_windows_a_tally_digests(offset, head, tail):
    assert ab.ledger_tally_windows(offset) == (head, tail)


def _tally_at(offset: int, head: bytes, tail: bytes, device: int = 5, inode: int = 9) -> ab.LedgerTally:
    return ab.LedgerTally(offset=offset, device=device, inode=inode, head_sha256=ab.sha256_bytes(head),
                          tail_sha256=ab.sha256_bytes(tail), totals=ab.usage_empty(), mismatched=[])


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
    t = _tally_at(3, b"{}\n", b"{}\n")
    assert ab.ledger_tally_fits(t, device, inode, size, head, tail) is fits, case


def test_a_tally_never_fits_inside_a_line():
    t = _tally_at(3, b'{"a', b'{"a')
    assert not ab.ledger_tally_fits(t, 5, 9, 10, b'{"a', b'{"a')
    empty = _tally_at(0, b"", b"")
    assert ab.ledger_tally_fits(empty, 5, 9, 0, b"", b"")


def test_ledger_tally_of_checks_every_field(paths):
    paths.ledger.write_bytes(ledger_bytes(120, seed=16))
    ab.report_metering(paths)
    good = tally(paths)
    got = ab.ledger_tally_of(good)
    assert isinstance(got, ab.LedgerTally) and got.offset == good["offset"] and got.totals == good["totals"]
    for name, change in BREAKAGES:
        if name.startswith(("another ", "an offset past", "an offset inside")):
            continue   # well-formed: only the ledger can tell (ledger_tally_fits)
        assert ab.ledger_tally_of(change(copy.deepcopy(good))) is None, name


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

def test_without_write_no_tally_is_written(paths):
    paths.ledger.write_bytes(ledger_bytes(30, seed=17))
    same(ab.report_metering(paths, write=False), reference(paths.ledger))
    assert not ab.ledger_tally_path(paths).exists()


def test_a_tally_that_cannot_be_written_still_meters(paths, monkeypatch):
    """A read-only or full study (a directory in the tally's place fails every read and write,
    whoever runs the test; a full disk is a write that raises ENOSPC)."""
    paths.ledger.write_bytes(ledger_bytes(30, seed=18))
    want = reference(paths.ledger)
    ab.ledger_tally_path(paths).mkdir()
    same(ab.report_metering(paths), want)
    ab.ledger_tally_path(paths).rmdir()

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ab, "write_text_atomic", full)
    same(ab.report_metering(paths), want)
    assert not ab.ledger_tally_path(paths).exists()


# -- The report through the command -------------------------------------------------------------------

def report_cli(root: Path, fmt: str, out: Path) -> bytes:
    with contextlib.redirect_stdout(io.StringIO()):
        assert ab.main(["report", "--study", str(root), "--format", fmt, "--out", str(out)]) == 0
    return out.read_bytes()


def test_the_report_is_the_same_bytes_with_and_without_the_tally(tmp_path):
    paths = make_study(tmp_path / "study", runs=144)
    data = ledger_bytes(700, seed=19)
    half = data.index(b"\n", len(data) // 2) + 1
    paths.ledger.write_bytes(data[:half] + b'{"job_id": "torn", "cost_')
    for fmt in ("json", "md", "html"):
        fresh = report_cli(paths.root, fmt, tmp_path / f"fresh.{fmt}")         # writes the tally
        assert ab.ledger_tally_path(paths).exists()
        again = report_cli(paths.root, fmt, tmp_path / f"again.{fmt}")          # reads it
        assert fresh == again
        ab.ledger_tally_path(paths).unlink()
    paths.ledger.write_bytes(data)                     # grown; the torn line completed otherwise
    report_cli(paths.root, "json", tmp_path / "warm-up.json")
    with open(paths.ledger, "ab") as fh:
        fh.write(ledger_bytes(100, seed=20))
    resumed = report_cli(paths.root, "json", tmp_path / "resumed.json")
    ab.ledger_tally_path(paths).unlink()
    full = report_cli(paths.root, "json", tmp_path / "full.json")
    assert resumed == full
    assert json.loads(full)["metering"] == reference(paths.ledger)   # the report sorts its keys


def test_a_report_inside_a_supervised_session_writes_no_tally(tmp_path, monkeypatch):
    paths = make_study(tmp_path / "study", runs=36)
    paths.ledger.write_bytes(ledger_bytes(50, seed=21))
    monkeypatch.setenv("AGENTBENCH_CHILD", "1")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert ab.main(["report", "--study", str(paths.root)]) == 0
    got = json.loads(buf.getvalue())
    assert got["metering"] == reference(paths.ledger)
    assert not ab.ledger_tally_path(paths).exists()
