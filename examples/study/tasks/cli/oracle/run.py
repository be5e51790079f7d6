#!/usr/bin/env python3
"""Hidden tests for the ``cli`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE --sandbox-run HELPER [--receipt-fd FD]

The tool never runs in this process, nor where it could see this file: each check gets a fresh
directory holding a copy of the workspace (tool/) and an empty data directory (data/), and every
call of the tool runs there in agentbench's inner sandbox (HELPER is the {sandbox_run} helper),
which sees that directory and nothing else: not this file, not the receipt channel, not this
process's arguments.  Only the tool's exit status, output and data file come back, and they are
compared with the expected values here.  A tool that hangs or crashes costs that one check.

The JSON receipt is written, from this parent process only, to the receipt channel FD (when
given) and as the last stdout line:
    {"passed": bool, "score": float, "checks": [{"id", "passed", "detail"}],
     "tests_passed": int, "tests_total": int}
Exit status is 0 whether or not the checks pass; 2 only when the oracle itself cannot run.
"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Per tool call. A check stops at its first hung call, so every check hanging still fits in the
# task's oracle timeout (300 s).
CALL_TIMEOUT_S = 20
WORKERS = 4


class CheckFailed(Exception):
    """A check's expectation did not hold; the message is the receipt's detail."""


class Tool:
    """Runs ``todo.py`` from a copy of the workspace (CHECK_DIR/tool) in the inner sandbox, with
    CHECK_DIR/data as its working directory."""

    def __init__(self, helper, check_dir):
        self.helper = helper
        self.check_dir = check_dir
        self.data_dir = os.path.join(check_dir, "data")
        self.data_file = os.path.join(self.data_dir, "todo.json")

    def run(self, *args, use_file=True):
        # Paths relative to the check directory: inside, it is the working directory.
        tool_args = ["--file", "todo.json"] if use_file else []
        cmd = [sys.executable, self.helper, "--dir", self.check_dir, "--timeout", str(CALL_TIMEOUT_S),
               "--", "/bin/sh", "-c", 'cd data && exec "$0" -X utf8 ../tool/todo.py "$@"',
               sys.executable, *tool_args, *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, text=True,
                                  encoding="utf-8", errors="replace", timeout=CALL_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            proc = None
        if proc is None or proc.returncode == 124:
            raise CheckFailed(f"todo {' '.join(args)} did not finish in {CALL_TIMEOUT_S} s")
        return proc

    def ok(self, *args):
        """Run and require exit status 0; return the process."""
        proc = self.run(*args)
        if proc.returncode != 0:
            raise CheckFailed(f"todo {' '.join(args)} exited {proc.returncode}: "
                              f"{proc.stderr.strip()[-200:]}")
        return proc

    def lines(self, *args):
        return self.ok(*args).stdout.splitlines()

    def list_json(self):
        out = self.ok("list", "--json").stdout
        try:
            return json.loads(out)
        except ValueError:
            raise CheckFailed(f"list --json stdout is not one JSON document: {out[:200]!r}")

    def file_bytes(self):
        try:
            with open(self.data_file, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None


def expect(condition, detail):
    if not condition:
        raise CheckFailed(detail)


def expect_typed_items(items, expected):
    """Exact equality, with the types the task names (True == 1 in Python, so check types)."""
    expect(items == expected, f"list --json gave {items!r}, expected {expected!r}")
    for item in items:
        expect(type(item["id"]) is int and type(item["text"]) is str
               and type(item["done"]) is bool, f"wrong value types in {item!r}")


# ---- checks: each takes a Tool on a fresh data directory; raise CheckFailed to fail ----------

def check_add_and_list_unchanged(tool):
    expect(tool.lines("add", "buy", "milk") == ["added 1: buy milk"], "add output changed")
    tool.ok("add", "call mum")
    got = tool.lines("list")
    expect(got == ["[ ] 1 buy milk", "[ ] 2 call mum"], f"plain list output changed: {got!r}")
    return "add and plain list behave as before"


def check_default_file(tool):
    proc = tool.run("add", "default place", use_file=False)
    expect(proc.returncode == 0, f"add without --file exited {proc.returncode}")
    expect(os.path.exists(tool.data_file), "without --file the data is not in ./todo.json")
    return "default file is ./todo.json"


def check_list_never_creates_file(tool):
    expect(tool.lines("list") == [], "plain list on a missing file printed something")
    expect(tool.list_json() == [], "list --json on a missing file did not print []")
    expect(not os.path.exists(tool.data_file), "list created the data file")
    return "missing file lists as empty and stays missing"


def check_done_marks_and_persists(tool):
    for text in ("a", "b", "c"):
        tool.ok("add", text)
    tool.ok("done", "2")
    got = tool.lines("list")
    expect(got == ["[ ] 1 a", "[x] 2 b", "[ ] 3 c"], f"list after done 2: {got!r}")
    with open(tool.data_file, encoding="utf-8") as fh:
        data = json.load(fh)
    expect(data.get("next_id") == 4, f"next_id changed: {data.get('next_id')!r}")
    expect([item.get("done") for item in data.get("items", [])] == [False, True, False],
           f"stored done flags wrong: {data.get('items')!r}")
    tool.ok("add", "d")
    expect(tool.lines("list")[-1] == "[ ] 4 d", "add after done did not get id 4")
    return "done is shown and stored; other items and ids untouched"


def check_done_is_idempotent(tool):
    tool.ok("add", "a")
    tool.ok("done", "1")
    before = tool.file_bytes()
    tool.ok("done", "1")
    expect(tool.file_bytes() == before, "a second done changed the file")
    expect(tool.lines("list") == ["[x] 1 a"], "list after two dones is wrong")
    return "second done exits 0 and changes nothing"


def check_done_unknown_id(tool):
    tool.ok("add", "a")
    before = tool.file_bytes()
    proc = tool.run("done", "7")
    expect(proc.returncode == 1, f"done 7 (unknown) exited {proc.returncode}, expected 1")
    expect("7" in proc.stderr, f"the error does not name the id: {proc.stderr.strip()!r}")
    expect("Traceback" not in proc.stderr, "done 7 printed a traceback")
    expect(tool.file_bytes() == before, "done 7 (unknown) rewrote the file")
    return "unknown id: exit 1, message names it, file untouched"


def check_done_missing_file(tool):
    proc = tool.run("done", "1")
    expect(proc.returncode == 1, f"done 1 without a file exited {proc.returncode}, expected 1")
    expect("Traceback" not in proc.stderr, "done 1 without a file printed a traceback")
    expect(not os.path.exists(tool.data_file), "done 1 without a file created the file")
    return "missing file: exit 1, file not created"


def check_done_bad_id(tool):
    tool.ok("add", "a")
    before = tool.file_bytes()
    proc = tool.run("done", "abc")
    expect(proc.returncode == 2, f"done abc exited {proc.returncode}, expected 2 (usage)")
    expect(tool.file_bytes() == before, "done abc changed the file")
    return "non-integer id is a usage error"


def check_list_json_shape(tool):
    for text in ("buy milk", "call mum", "file taxes"):
        tool.ok("add", text)
    tool.ok("done", "2")
    expect_typed_items(tool.list_json(), [
        {"id": 1, "text": "buy milk", "done": False},
        {"id": 2, "text": "call mum", "done": True},
        {"id": 3, "text": "file taxes", "done": False},
    ])
    return "exact objects, id order, typed values, nothing else on stdout"


def check_list_json_unicode(tool):
    text = 'café \u2615 \u6771\u4eac "quoted" back\\slash'
    tool.ok("add", text)
    expect_typed_items(tool.list_json(), [{"id": 1, "text": text, "done": False}])
    return "non-ASCII text, quotes and backslashes survive the JSON output"


def check_existing_file(tool):
    # A file written by an older version of the tool: gaps in the ids, items out of id order.
    data = {"next_id": 6, "items": [{"id": 5, "text": "five", "done": False},
                                    {"id": 3, "text": "three", "done": True}]}
    with open(tool.data_file, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    expect_typed_items(tool.list_json(), [{"id": 3, "text": "three", "done": True},
                                          {"id": 5, "text": "five", "done": False}])
    tool.ok("done", "5")
    tool.ok("add", "six")
    expect_typed_items(tool.list_json(), [{"id": 3, "text": "three", "done": True},
                                          {"id": 5, "text": "five", "done": True},
                                          {"id": 6, "text": "six", "done": False}])
    return "existing files: id order, done and add keep working"


CHECKS = {
    "add_and_list_unchanged": check_add_and_list_unchanged,
    "default_file": check_default_file,
    "list_never_creates_file": check_list_never_creates_file,
    "done_marks_and_persists": check_done_marks_and_persists,
    "done_is_idempotent": check_done_is_idempotent,
    "done_unknown_id": check_done_unknown_id,
    "done_missing_file": check_done_missing_file,
    "done_bad_id": check_done_bad_id,
    "list_json_shape": check_list_json_shape,
    "list_json_unicode": check_list_json_unicode,
    "existing_file": check_existing_file,
}


# ---- harness ---------------------------------------------------------------------------------

def _fresh_check_dir(workspace, names):
    """A new directory under the workspace (the inner sandbox runs only in directories under the
    working directory; a random name, so nothing inside learns which check it is) holding a copy
    of the workspace's entries `names` as tool/ and an empty data/."""
    check_dir = tempfile.mkdtemp(prefix=".check-", dir=workspace)
    tool = os.path.join(check_dir, "tool")
    os.mkdir(tool)
    for name in names:
        src = os.path.join(workspace, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, os.path.join(tool, name), symlinks=True,
                            ignore=shutil.ignore_patterns(".git", "__pycache__"))
        else:
            shutil.copy2(src, os.path.join(tool, name), follow_symlinks=False)
    os.mkdir(os.path.join(check_dir, "data"))
    return check_dir


def _run_check(check_id, helper, workspace, names):
    check_dir = None
    try:
        check_dir = _fresh_check_dir(workspace, names)
        detail = CHECKS[check_id](Tool(helper, check_dir))
        return {"id": check_id, "passed": True, "detail": detail}
    except CheckFailed as exc:
        return {"id": check_id, "passed": False, "detail": str(exc)[:300]}
    except Exception as exc:  # e.g. a data file the tool wrote that is not JSON
        return {"id": check_id, "passed": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        if check_dir:
            shutil.rmtree(check_dir, ignore_errors=True)



def _not_dumpable():
    """Linux: make this process non-dumpable, so that no other process of the same user can take
    its descriptors (through /proc or pidfd_getfd) where no sandbox stands between them."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def main(argv):
    usage = "usage: run.py WORKSPACE --sandbox-run HELPER [--receipt-fd FD]"
    opts = dict(zip(argv[2::2], argv[3::2]))
    if len(argv) < 4 or len(argv) % 2 or set(opts) - {"--sandbox-run", "--receipt-fd"} \
            or "--sandbox-run" not in opts:
        print(usage, file=sys.stderr)
        return 2
    receipt_fd = None
    if "--receipt-fd" in opts:
        # agentbench's receipt channel: only this process writes it; no child is handed it.
        receipt_fd = int(opts["--receipt-fd"])
        os.set_inheritable(receipt_fd, False)
        _not_dumpable()
    workspace = os.path.abspath(argv[1])
    if not os.path.isdir(workspace):
        print(f"run.py: not a directory: {workspace}", file=sys.stderr)
        return 2
    names = [n for n in sorted(os.listdir(workspace)) if n not in (".git", "__pycache__")]
    # Checks are independent (each has its own directory), so they run side by side; map() keeps
    # the receipt in CHECKS order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
        checks = list(pool.map(lambda check_id: _run_check(check_id, opts["--sandbox-run"], workspace, names),
                               CHECKS))
    passed = sum(1 for check in checks if check["passed"])
    receipt = {"passed": passed == len(checks), "score": round(passed / len(checks), 4),
               "checks": checks, "tests_passed": passed, "tests_total": len(checks)}
    line = json.dumps(receipt)
    print(line)
    if receipt_fd is not None:
        os.write(receipt_fd, (line + "\n").encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
