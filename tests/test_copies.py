"""Copies and reads of what a session left behind, outside the sandbox (the pure and file-level
parts; the attacks with the real binary are in test_e2e_copies_real.py).

Every copy or read agentbench makes of a workspace, a snapshot, a review directory or a transcript
keeps links as links (or drops them), never follows one; skips FIFOs, sockets and devices; keeps a
sparse file sparse; stops at its caps; and a tree it cannot take within these rules raises
UnusableTree (code `workspace_unusable`), which a run records as the agent's failure."""
from __future__ import annotations

import json
import os
import threading
import types
from pathlib import Path

import pytest

import agentbench as ab

pytestmark = pytest.mark.skipif(os.name != "posix", reason="links, FIFOs and sparse files as on POSIX")

REFERENCE = "def to_roman(n):\n    return 'the reference solution, never to be read by the agent'\n" * 8
MB = 2 ** 20


def in_thread(fn, timeout: float = 60.0):
    """Run fn in a thread; fail (instead of hanging the suite) if it blocks on a special file."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the copy or read blocked (a FIFO or an endless device was opened)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.fixture
def hostile(tmp_path: Path) -> dict[str, Path]:
    """A study-like layout: tasks/t/reference (hidden) and a workspace full of traps."""
    ref = tmp_path / "study" / "tasks" / "t" / "reference"
    ref.mkdir(parents=True)
    (ref / "roman.py").write_text(REFERENCE)
    ws = tmp_path / "study" / "runs" / "r1" / "workspace"
    (ws / "pkg").mkdir(parents=True)
    (ws / "roman.py").write_text("def to_roman(n):\n    raise NotImplementedError\n")
    (ws / "pkg" / "mod.py").write_text("X = 1\n")
    (ws / "rel_ref").symlink_to("../../../tasks/t/reference")        # the link, relative
    (ws / "abs_ref").symlink_to(ref)                                  # and absolute
    (ws / "abs_ref_file.py").symlink_to(ref / "roman.py")
    (ws / "pkg" / "inside.py").symlink_to("mod.py")                   # a link that stays inside
    (ws / "zero").symlink_to("/dev/zero")
    os.mkfifo(ws / "pipe")
    with open(ws / "sparse.bin", "wb") as fh:
        fh.truncate(64 * MB)
        fh.seek(10 * MB)
        fh.write(b"data in the middle")
    (ws / ".git").mkdir()
    (ws / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return {"ws": ws, "ref": ref, "root": tmp_path}


def regular_files_with(root: Path, needle: str) -> list[Path]:
    """Regular files under root (links not followed) whose bytes contain needle."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for fn in filenames:
            p = Path(dirpath) / fn
            if p.is_symlink() or not p.is_file():
                continue
            if needle.encode() in p.read_bytes():
                found.append(p)
    return found


# ---- the copy: links, special files, sparse files ---------------------------------------------------

def test_a_link_to_the_reference_stays_a_link_and_a_reviewer_copy_drops_it(hostile):
    ws, root = hostile["ws"], hostile["root"]
    keep = root / "snapshot"
    got = in_thread(lambda: ab.safe_copy_tree(ws, keep, ab.DEFAULT_COPY_CAPS))
    for name in ("rel_ref", "abs_ref", "abs_ref_file.py", "zero"):
        assert (keep / name).is_symlink(), name
    assert os.readlink(keep / "rel_ref") == "../../../tasks/t/reference"
    assert not (keep / "pipe").exists() and not (keep / ".git").exists()
    assert got["skipped_special"] == ["pipe"] and got["links"] == 5
    # The reviewer's copy: links out of the work are dropped, the one inside kept.
    review = root / "review" / "work"
    got = in_thread(lambda: ab.safe_copy_tree(ws, review, ab.DEFAULT_COPY_CAPS, links="inside"))
    assert sorted(got["dropped_links"]) == ["abs_ref", "abs_ref_file.py", "rel_ref", "zero"]
    assert (review / "pkg" / "inside.py").is_symlink()
    for name in ("rel_ref", "abs_ref", "abs_ref_file.py", "zero"):
        assert not os.path.lexists(review / name), name
    # Whatever a reader of either copy opens, the reference's text is in no regular file.
    marker = "never to be read by the agent"
    assert regular_files_with(keep, marker) == [] and regular_files_with(review, marker) == []


def test_no_chain_of_links_leads_out_of_a_reviewer_copy(tmp_path):
    """`l -> .` stays in; `esc -> l/x/../..` looks inside as text (l/x/.. is l, l/.. is .) but the
    kernel resolves `l` first and climbs out of the tree.  Only links without `..` are kept."""
    ws = tmp_path / "ws"
    (ws / "x").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("outside the work\n")
    (ws / "l").symlink_to(".")
    (ws / "esc").symlink_to("l/x/../..")
    (ws / "up").symlink_to("x/../..")
    (ws / "ok").symlink_to("x")
    assert (ws / "esc" / "secret.txt").read_text() == "outside the work\n"   # the trap is real
    work = tmp_path / "review" / "work"
    got = ab.safe_copy_tree(ws, work, ab.DEFAULT_COPY_CAPS, links="inside")
    assert sorted(got["dropped_links"]) == ["esc", "up"]
    assert (work / "l").is_symlink() and (work / "ok").is_symlink()
    for dirpath, dirnames, filenames in os.walk(work, followlinks=True):
        assert len(Path(dirpath).relative_to(work).parts) < 5, "a loop or a way out"
        assert "secret.txt" not in filenames
        dirnames[:] = [d for d in dirnames if d != "l"]       # l -> . is a loop by design


def test_the_oracles_throw_away_copy_keeps_links_as_links(hostile, tmp_path):
    """run_check's copy goes through the same primitive: a link in the workspace to the reference
    is a link in the copy, never the reference's files."""
    ws = hostile["ws"]
    (ws / "pipe").unlink()
    copy = tmp_path / "oracle-copy"
    in_thread(lambda: ab.safe_copy_tree(ws, copy, ab.DEFAULT_COPY_CAPS))
    assert (copy / "abs_ref").is_symlink() and (copy / "rel_ref").is_symlink()
    assert regular_files_with(copy, "never to be read by the agent") == []


def test_a_sparse_file_stays_sparse(hostile, tmp_path):
    ws = hostile["ws"]
    dst = tmp_path / "copy"
    got = in_thread(lambda: ab.safe_copy_tree(ws, dst, ab.DEFAULT_COPY_CAPS))
    st = os.stat(dst / "sparse.bin")
    assert st.st_size == 64 * MB and got["sparse_files"] == 1
    assert st.st_blocks * 512 < 2 * MB, "the sparse file became real blocks"
    data = (dst / "sparse.bin").read_bytes()
    assert data[10 * MB:10 * MB + 18] == b"data in the middle" and data[:10 * MB].count(0) == 10 * MB


def test_an_8g_sparse_file_is_refused_and_no_real_blocks_are_written(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    with open(ws / "big", "wb") as fh:
        fh.truncate(8 * 2 ** 30)
    dst = tmp_path / "copy"
    with pytest.raises(ab.UnusableTree) as err:
        ab.safe_copy_tree(ws, dst, ab.DEFAULT_COPY_CAPS)
    assert err.value.code == "workspace_unusable" and err.value.why == "file_over_cap"
    assert not (dst / "big").exists()
    # Under caps that allow it, it is copied as the hole it is.
    dst2 = tmp_path / "copy2"
    ab.safe_copy_tree(ws, dst2, ab.CopyCaps(16 * 2 ** 30, 16 * 2 ** 30))
    st = os.stat(dst2 / "big")
    assert st.st_size == 8 * 2 ** 30 and st.st_blocks * 512 < MB
    # The live cap measures real blocks: the hole costs nothing.
    assert ab.tree_usage(ws, 10 * MB) < MB


def test_a_link_to_dev_zero_over_a_transcript_is_not_followed(tmp_path):
    src = tmp_path / "projects" / "p" / "s.jsonl"
    src.parent.mkdir(parents=True)
    src.symlink_to("/dev/zero")
    dst = tmp_path / "out" / "s.jsonl"
    with pytest.raises(ab.UnusableTree) as err:
        in_thread(lambda: ab.safe_copy_file(src, dst, 10 * MB))
    assert err.value.why == "not_a_regular_file" and not dst.exists()
    # A FIFO in its place is not opened for a blocking read either.
    src.unlink()
    os.mkfifo(src)
    with pytest.raises(ab.UnusableTree):
        in_thread(lambda: ab.safe_copy_file(src, dst, 10 * MB))
    # A real transcript over the cap is refused; under it, copied.
    src.unlink()
    src.write_bytes(b"x" * 2048)
    with pytest.raises(ab.UnusableTree) as err:
        ab.safe_copy_file(src, dst, 1024)
    assert err.value.why == "file_over_cap"
    assert ab.safe_copy_file(src, dst, 4096) == 2048 and dst.read_bytes() == b"x" * 2048


def test_reads_never_follow_links_nor_open_fifos(hostile):
    ws = hostile["ws"]
    assert in_thread(lambda: ab.read_capped(ws / "zero", 1024)) is None
    assert in_thread(lambda: ab.read_capped(ws / "pipe", 1024)) is None
    assert in_thread(lambda: ab.read_capped(ws / "abs_ref_file.py", 10 * MB)) is None
    assert ab.read_capped(ws / "roman.py", 1024).startswith(b"def to_roman")
    with pytest.raises(ab.UnusableTree):
        ab.read_capped(ws / "roman.py", 10)
    assert in_thread(lambda: ab.read_head(ws / "zero", 1024)) is None
    assert in_thread(lambda: ab.read_head(ws / "pipe", 1024)) is None
    assert in_thread(lambda: ab.read_head(ws / "abs_ref_file.py", 1024)) is None
    whole = ab.read_capped(ws / "roman.py", 10 * MB)
    assert ab.read_head(ws / "roman.py", 10) == (whole[:10], True)          # its head, said cut
    assert ab.read_head(ws / "roman.py", len(whole)) == (whole, False)
    assert ab.sha256_regular(ws / "zero") is None and ab.sha256_regular(ws / "pipe") is None


def test_the_artifact_manifest_never_hashes_through_a_link(hostile):
    files = in_thread(lambda: ab.artifact_manifest(hostile["ws"]))["files"]
    assert files["zero"]["sha256"].startswith("symlink:") and files["pipe"]["sha256"] == "special:fifo"
    assert files["abs_ref_file.py"]["sha256"].startswith("symlink:")
    ref_digest = ab.sha256_bytes(REFERENCE.encode())
    assert ref_digest not in {f["sha256"] for f in files.values()}


# ---- caps -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("caps, why", [
    (ab.CopyCaps(1000, 10 ** 9), "file_over_cap"),
    (ab.CopyCaps(10 ** 9, 2500), "copy_over_cap"),
    (ab.CopyCaps(10 ** 9, 10 ** 9, entries=3), "too_many_entries"),
])
def test_copies_stop_at_their_caps(tmp_path, caps, why):
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(5):
        (ws / f"f{i}").write_bytes(b"y" * (1500 if i == 0 else 600))
    with pytest.raises(ab.UnusableTree) as err:
        ab.safe_copy_tree(ws, tmp_path / "copy", caps)
    assert err.value.why == why and err.value.payload["code"] == "workspace_unusable"
    with pytest.raises(ab.UnusableTree) as err:
        ab.tree_entries(ws, caps)
    assert err.value.why == why


def _nest(root: Path, levels: int, name: str) -> None:
    """Directories nested `levels` deep, made by descriptor (the path may pass PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.close(os.open("leaf.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@pytest.mark.parametrize("levels, name, why", [
    (25, "d" * 200, "path_too_long"),     # past PATH_MAX (4096) in bytes
    (200, "d", "nested_too_deep"),        # short names, too many levels
])
def test_a_tree_nested_past_path_max_is_unusable(tmp_path, levels, name, why):
    ws = tmp_path / "ws"
    ws.mkdir()
    _nest(ws, levels, name)
    with pytest.raises(ab.UnusableTree) as err:
        in_thread(lambda: ab.safe_copy_tree(ws, tmp_path / "copy", ab.DEFAULT_COPY_CAPS))
    assert err.value.why == why
    with pytest.raises(ab.UnusableTree) as err:
        ab.tree_entries(ws)
    assert err.value.why == why
    # The live cap cannot be evaded by hiding data where its walk would not reach.
    assert ab.tree_usage(ws, 10 * MB) > 10 * MB


def test_the_copy_caps_are_study_settings_with_validation():
    launch = ab.launch_config({})
    assert ab.copy_caps(launch) == ab.DEFAULT_COPY_CAPS
    assert ab.copy_caps(ab.launch_config({"copy_file_mb": 1, "copy_total_mb": 2})) == ab.CopyCaps(MB, 2 * MB)
    limits = ab.session_limits(ab.launch_config({"workspace_mb": 3}))
    assert limits["workspace_max_bytes"] == 3 * MB and limits["copy_file_bytes"] == 256 * MB
    for bad in (0, -1, "10", True, float("inf"), 10 ** 8):
        with pytest.raises(ab.AgentbenchError) as err:
            ab.check_study_shape({"copy_file_mb": bad})
        assert err.value.code == "bad_setting_type"
    ab.check_study_shape({"copy_file_mb": 0.5, "copy_total_mb": 4096, "workspace_mb": 100})


# ---- names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, shown", [
    (b"plain.py", "plain.py"),
    (b"caf\xc3\xa9.py", "caf\u00e9.py"),                  # valid UTF-8 is shown as it is
    (b"bad\xff.py", "bad\\xff.py"),                        # an undecodable byte
    (b"a\nb\x1b[31m", "a\\x0ab\\x1b[31m"),                # controls: a newline, an escape sequence
    (b"back\\slash", "back\\\\slash"),                     # doubled, so escapes stay distinct
    ("rtl\u202eyp.exe".encode(), "rtl\\u202eyp.exe"),      # a bidi override
])
def test_shown_name_escapes_what_cannot_be_shown(raw, shown):
    assert ab.shown_name(os.fsdecode(raw)) == shown
    shown.encode("utf-8")


def test_odd_names_are_copied_and_shown_escaped_in_the_manifest(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    for raw in (b"bad\xff.py", b"ctl\x01\x07.txt", b"bad\\xff.py"):
        (ws / os.fsdecode(raw)).write_text("x")
    files = ab.artifact_manifest(ws)["files"]
    assert sorted(files) == ["bad\\\\xff.py", "bad\\xff.py", "ctl\\x01\\x07.txt"]
    json.dumps(files, ensure_ascii=False).encode("utf-8")
    got = ab.safe_copy_tree(ws, tmp_path / "copy", ab.DEFAULT_COPY_CAPS)
    assert got["files"] == 3 and os.path.exists(tmp_path / "copy" / os.fsdecode(b"bad\xff.py"))


# ---- outcome and the live cap -----------------------------------------------------------------------

def test_an_unusable_workspace_is_the_agents_valid_failure():
    v = ab.classify_run(stop="workspace_unusable:file_over_cap", first_session={"status": "ok"},
                        tool_uses=3, success=False)
    assert v == ab.RunVerdict("workspace_unusable", "valid", None, "workspace_unusable:file_over_cap")
    # Not moved out of the primary view by a grader error either.
    v = ab.classify_run(stop="workspace_unusable:path_too_long", first_session=None, tool_uses=0,
                        success=False, grader_error="timed out")
    assert v.outcome == "workspace_unusable" and v.validity == "valid"


def test_the_live_cap_measures_real_blocks_and_ends_the_session(tmp_path):
    study = tmp_path / "study"
    (study / "state").mkdir(parents=True)
    (study / "study.json").write_text("{}")     # a study (events are never written into a removed one)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "blob").write_bytes(os.urandom(3 * MB))
    (ws / "link").symlink_to("/usr")         # not followed: /usr is not counted
    with open(ws / "hole", "wb") as fh:
        fh.truncate(2 ** 30)
    sup = types.SimpleNamespace(limits={"workspace_max_bytes": 2 * MB}, workspace_next_measure=None,
                                WORKSPACE_MEASURE_S=3.0, job={"cwd": str(ws)}, flags=set(),
                                paths=ab.StudyPaths(study), job_id="j000001", _measured=[])
    assert ab.Supervisor._workspace_over_cap(sup) is True and "workspace_over_cap" in sup.flags
    events = [json.loads(x) for x in (study / "state" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "workspace_over_cap" and events[-1]["cap"] == 2 * MB
    # Not measured again on the next poll: once per WORKSPACE_MEASURE_S at most.
    assert sup.workspace_next_measure is not None
    assert ab.Supervisor._workspace_over_cap(sup) is False
    sup.workspace_next_measure, sup.limits = None, {"workspace_max_bytes": 5 * MB}
    assert ab.Supervisor._workspace_over_cap(sup) is False     # 3 MB of blocks; the hole is free
    # The session's HOME and transcript folder count with the workspace: 3 MB there and 3 MB in
    # the workspace are over a 5 MB cap.
    home = tmp_path / "home"
    home.mkdir()
    (home / "blob").write_bytes(os.urandom(3 * MB))
    sup.workspace_next_measure, sup._measured = None, [str(home), str(tmp_path / "no-transcripts-yet")]
    assert ab.Supervisor._workspace_over_cap(sup) is True


@pytest.mark.parametrize("plant", ["link_to_zero", "fifo", "too_big", "link_to_good"])
def test_a_review_json_that_is_not_a_plain_small_file_is_an_invalid_review(tmp_path, plant):
    study = tmp_path / "study"
    rdir = study / "runs" / "r1" / "review" / "01"
    rdir.mkdir(parents=True)
    good = tmp_path / "elsewhere.json"
    good.write_text(json.dumps({"verdict": "accept", "findings": [], "summary": "fine"}))
    target = rdir / "review.json"
    if plant == "link_to_zero":
        target.symlink_to("/dev/zero")
    elif plant == "fifo":
        os.mkfifo(target)
    elif plant == "too_big":
        target.write_text(json.dumps({"verdict": "accept", "findings": [], "summary": "x" * ab.REVIEW_MAX_BYTES}))
    else:
        target.symlink_to(good)          # a valid review, but reached through a link
    fake = types.SimpleNamespace(paths=ab.StudyPaths(study), run_id="r1", rec={},
                                 _save=lambda: None, _event=lambda *a, **k: None)
    got = in_thread(lambda: ab.RunPipeline.collect_review(fake, 1, "ok"))
    assert got["valid"] is False and fake.rec["review_verdicts"] == ["invalid"]


def test_one_runs_page_that_cannot_be_built_never_stops_the_others(tmp_path, monkeypatch):
    from test_experiment import copy_example
    from test_report import run
    study = copy_example(tmp_path / "s", tasks=("roman",), arms=("A", "B"))
    runs = [run("r1", "roman", "A", 1, success=False), run("r2", "roman", "B", 1, success=True)]
    real = ab.collect_run_page

    def collect(paths, rec, starter):
        if rec["run_id"] == "r1":
            raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")
        return real(paths, rec, starter)

    monkeypatch.setattr(ab, "collect_run_page", collect)
    rep = ab.build_report(runs, ["A", "B"])
    out = ab.write_report_pages(ab.StudyPaths(study), rep, runs, tmp_path / "site")
    assert out["run_pages"] == 2 and out["run_pages_partial"] == ["r1"]
    page = (tmp_path / "site" / "runs" / "r1.html").read_text(encoding="utf-8")
    assert "could not be read in full" in page
    assert "r2" in (tmp_path / "site" / "runs" / "r2.html").read_text(encoding="utf-8")


def test_a_run_pages_stream_read_never_follows_a_link_to_an_endless_device(tmp_path, monkeypatch):
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo.jsonl")
    assert in_thread(lambda: ab._page_read_stream(tmp_path / "zero.jsonl")) == []
    assert in_thread(lambda: ab._page_read_stream(tmp_path / "fifo.jsonl")) == []
    monkeypatch.setattr(ab, "PAGE_STREAM_BYTES", 10)
    (tmp_path / "s.jsonl").write_bytes(b"1234\n5678\n90ab\n")
    assert ab._page_read_stream(tmp_path / "s.jsonl") == [b"1234\n", b"5678\n"]
    (tmp_path / "s.jsonl").write_bytes(b"1234\n567890ab\n")
    assert ab._page_read_stream(tmp_path / "s.jsonl") == [b"1234\n"]       # the cut line is dropped


def test_a_workspace_replaced_by_a_link_is_never_entered(hostile, tmp_path):
    ws = tmp_path / "ws"
    ws.symlink_to(hostile["ref"])
    for call in (lambda: ab.safe_copy_tree(ws, tmp_path / "copy", ab.DEFAULT_COPY_CAPS),
                 lambda: ab.artifact_manifest(ws)):
        with pytest.raises(ab.UnusableTree) as err:
            call()
        assert err.value.why == "not_a_directory"
    assert not (tmp_path / "copy").exists()


def test_a_copy_keeps_modes_and_times_but_never_setuid(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    f = ws / "run.sh"
    f.write_text("#!/bin/sh\necho hi\n")
    os.chmod(f, 0o4755)
    os.utime(f, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    ab.safe_copy_tree(ws, tmp_path / "copy", ab.DEFAULT_COPY_CAPS)
    st = os.stat(tmp_path / "copy" / "run.sh")
    assert st.st_mode & 0o7777 == 0o755 and st.st_mtime_ns == 1_000_000_000_000_000_000
