#!/usr/bin/env python3
"""Hidden tests for the ``cli`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE [--receipt-fd FD]

The workspace is copied to a private temporary directory first, so nothing the checks do can
write into the directory that was passed in. Every check starts the tool from that copy in
subprocesses with a timeout, each check with its own fresh data directory, so a tool that hangs
or crashes costs that one check and nothing else.

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
    """Runs ``todo.py`` from the workspace copy against one data directory."""

    def __init__(self, script, data_dir):
        self.script = script
        self.data_dir = data_dir
        self.data_file = os.path.join(data_dir, "todo.json")
        # No inherited PYTHON* settings (a PYTHONPATH could shadow the tool's own modules);
        # UTF-8 I/O so the result does not depend on the host's locale.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        self.env.update(PYTHONIOENCODING="utf-8", PYTHONDONTWRITEBYTECODE="1")

    def run(self, *args, use_file=True):
        cmd = [sys.executable, "-X", "utf8", self.script]
        if use_file:
            cmd += ["--file", self.data_file]
        cmd += list(args)
        try:
            return subprocess.run(cmd, cwd=self.data_dir, env=self.env, capture_output=True,
                                  stdin=subprocess.DEVNULL, text=True, encoding="utf-8",
                                  errors="replace", timeout=CALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"todo {' '.join(args)} did not finish in {CALL_TIMEOUT_S} s")

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

def _run_check(check_id, script, scratch):
    data_dir = tempfile.mkdtemp(prefix=f"{check_id}-", dir=scratch)
    try:
        detail = CHECKS[check_id](Tool(script, data_dir))
        return {"id": check_id, "passed": True, "detail": detail}
    except CheckFailed as exc:
        return {"id": check_id, "passed": False, "detail": str(exc)[:300]}
    except Exception as exc:  # e.g. a data file the tool wrote that is not JSON
        return {"id": check_id, "passed": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}



def _not_dumpable():
    """Linux: make this process non-dumpable, so that no other process of the same user (the code
    under test, run by a child of this one) can open its descriptors through /proc or take them
    with pidfd_getfd.  Elsewhere, or if refused, nothing happens."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0
    except (OSError, AttributeError):
        pass


def main(argv):
    receipt_fd = None
    if len(argv) == 4 and argv[2] == "--receipt-fd":
        # agentbench's receipt channel: a socket that only this parent writes to.  It is made
        # non-inheritable at once, so no child (and no code under test) is handed it.
        receipt_fd = int(argv[3])
        os.set_inheritable(receipt_fd, False)
        _not_dumpable()
        argv = argv[:2]
    if len(argv) != 2:
        print("usage: run.py WORKSPACE [--receipt-fd FD]", file=sys.stderr)
        return 2
    workspace = os.path.abspath(argv[1])
    if not os.path.isdir(workspace):
        print(f"run.py: not a directory: {workspace}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="oracle-cli-") as tmp:
        copy_dir = os.path.join(tmp, "workspace")
        try:
            shutil.copytree(workspace, copy_dir, symlinks=True,
                            ignore=shutil.ignore_patterns(".git", "__pycache__"))
        except (OSError, shutil.Error) as exc:
            print(f"run.py: cannot copy the workspace: {exc}", file=sys.stderr)
            return 2
        script = os.path.join(copy_dir, "todo.py")
        scratch = os.path.join(tmp, "data")
        os.mkdir(scratch)
        # Checks are independent (each has its own data directory), so they run side by side;
        # map() keeps the receipt in CHECKS order.
        with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
            checks = list(pool.map(lambda check_id: _run_check(check_id, script, scratch),
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
