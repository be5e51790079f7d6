#!/usr/bin/env python3
"""Hidden tests for the ``cli`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE --sandbox-run HELPER [--receipt-fd FD]

The tool never runs in this process, nor where it could see this file: every check's calls of the
tool (their arguments, never the expected values) go in one batch to a small driver that
agentbench's inner sandbox runs (HELPER is the {sandbox_run} helper) in a fresh directory holding
a copy of the workspace (tool/).  The inner sandbox sees that directory and nothing else: not
this file, not the receipt channel, not this process's arguments.  There each check gets an empty
data directory of its own, and its calls run one after the other, each with a time limit; only
each call's exit status, output and data file come back, and they are compared with the expected
values here.  A tool that hangs or crashes costs that one check.

The JSON receipt is written, from this parent process only, to the receipt channel FD (when
given) and as the last stdout line:
    {"passed": bool, "score": float, "checks": [{"id", "passed", "detail"}],
     "tests_passed": int, "tests_total": int}
Exit status is 0 whether or not the checks pass; 2 only when the oracle itself cannot run.
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile

# Per tool call. A check stops at its first hung call.
CALL_TIMEOUT_S = 20
# Every check together (one after the other); it must fit in the task's oracle timeout (300 s).
BATCH_TIMEOUT_S = 240


class CheckFailed(Exception):
    """A check's expectation did not hold; the message is the receipt's detail."""


class Call:
    """What one call of the tool did: its exit status, stdout and stderr, and the data file
    (todo.json in its working directory) after it: `exists`, and `file`, its bytes."""

    def __init__(self, args, answer):
        self.args = args
        self.exit, self.stdout, self.stderr = answer["exit"], answer["stdout"], answer["stderr"]
        self.exists = answer["exists"]
        self.file = None if answer["file"] is None else base64.b64decode(answer["file"])

    def __str__(self):
        return "todo " + " ".join(self.args)


def expect(condition, detail):
    if not condition:
        raise CheckFailed(detail)


def ok(*calls):
    """Each call exited 0."""
    for call in calls:
        expect(call.exit == 0, f"{call} exited {call.exit}: {call.stderr.strip()[-200:]}")


def lines(call):
    ok(call)
    return call.stdout.splitlines()


def list_json(call):
    ok(call)
    try:
        return json.loads(call.stdout)
    except ValueError:
        raise CheckFailed(f"list --json stdout is not one JSON document: {call.stdout[:200]!r}")


def expect_typed_items(items, expected):
    """Exact equality, with the types the task names (True == 1 in Python, so check types)."""
    expect(items == expected, f"list --json gave {items!r}, expected {expected!r}")
    for item in items:
        expect(type(item["id"]) is int and type(item["text"]) is str
               and type(item["done"]) is bool, f"wrong value types in {item!r}")


# ---- checks: the tool's calls, and what they must have done ----------------------------------
# @check(*calls): each call is the tool's arguments, run in order in a fresh data directory with
# `--file todo.json` first (file_option=False: without it); `data`: the data file's text before
# the first call.  The function gets one Call per call; it raises CheckFailed to fail, and
# returns the receipt's detail.

CHECKS = {}


def check(*calls, file_option=True, data=None):
    def register(judge):
        CHECKS[judge.__name__] = ([list(args) for args in calls], file_option, data, judge)
        return judge
    return register


@check(["add", "buy", "milk"], ["add", "call mum"], ["list"])
def add_and_list_unchanged(add, add2, listed):
    expect(lines(add) == ["added 1: buy milk"], "add output changed")
    ok(add2)
    got = lines(listed)
    expect(got == ["[ ] 1 buy milk", "[ ] 2 call mum"], f"plain list output changed: {got!r}")
    return "add and plain list behave as before"


@check(["add", "default place"], file_option=False)
def default_file(add):
    expect(add.exit == 0, f"add without --file exited {add.exit}")
    expect(add.exists, "without --file the data is not in ./todo.json")
    return "default file is ./todo.json"


@check(["list"], ["list", "--json"])
def list_never_creates_file(listed, listed_json):
    expect(lines(listed) == [], "plain list on a missing file printed something")
    expect(list_json(listed_json) == [], "list --json on a missing file did not print []")
    expect(not listed_json.exists, "list created the data file")
    return "missing file lists as empty and stays missing"


@check(["add", "a"], ["add", "b"], ["add", "c"], ["done", "2"], ["list"], ["add", "d"], ["list"])
def done_marks_and_persists(add_a, add_b, add_c, done, listed, add_d, listed_again):
    ok(add_a, add_b, add_c, done)
    got = lines(listed)
    expect(got == ["[ ] 1 a", "[x] 2 b", "[ ] 3 c"], f"list after done 2: {got!r}")
    data = json.loads(done.file)
    expect(data.get("next_id") == 4, f"next_id changed: {data.get('next_id')!r}")
    expect([item.get("done") for item in data.get("items", [])] == [False, True, False],
           f"stored done flags wrong: {data.get('items')!r}")
    ok(add_d)
    expect(lines(listed_again)[-1] == "[ ] 4 d", "add after done did not get id 4")
    return "done is shown and stored; other items and ids untouched"


@check(["add", "a"], ["done", "1"], ["done", "1"], ["list"])
def done_is_idempotent(add, done, done_again, listed):
    ok(add, done, done_again)
    expect(done.file is not None, "after done 1 there is no data file to read")
    expect(done_again.file == done.file, "a second done changed the file")
    expect(lines(listed) == ["[x] 1 a"], "list after two dones is wrong")
    return "second done exits 0 and changes nothing"


@check(["add", "a"], ["done", "7"])
def done_unknown_id(add, done):
    ok(add)
    expect(done.exit == 1, f"done 7 (unknown) exited {done.exit}, expected 1")
    expect("7" in done.stderr, f"the error does not name the id: {done.stderr.strip()!r}")
    expect("Traceback" not in done.stderr, "done 7 printed a traceback")
    expect(add.file is not None, "after add there is no data file to read")
    expect(done.file == add.file, "done 7 (unknown) rewrote the file")
    return "unknown id: exit 1, message names it, file untouched"


@check(["done", "1"])
def done_missing_file(done):
    expect(done.exit == 1, f"done 1 without a file exited {done.exit}, expected 1")
    expect("Traceback" not in done.stderr, "done 1 without a file printed a traceback")
    expect(not done.exists, "done 1 without a file created the file")
    return "missing file: exit 1, file not created"


@check(["add", "a"], ["done", "abc"])
def done_bad_id(add, done):
    ok(add)
    expect(done.exit == 2, f"done abc exited {done.exit}, expected 2 (usage)")
    expect(add.file is not None, "after add there is no data file to read")
    expect(done.file == add.file, "done abc changed the file")
    return "non-integer id is a usage error"


@check(["add", "buy milk"], ["add", "call mum"], ["add", "file taxes"], ["done", "2"], ["list", "--json"])
def list_json_shape(*calls):
    ok(*calls[:-1])
    expect_typed_items(list_json(calls[-1]), [
        {"id": 1, "text": "buy milk", "done": False},
        {"id": 2, "text": "call mum", "done": True},
        {"id": 3, "text": "file taxes", "done": False},
    ])
    return "exact objects, id order, typed values, nothing else on stdout"


UNICODE_TEXT = 'café \u2615 \u6771\u4eac "quoted" back\\slash'


@check(["add", UNICODE_TEXT], ["list", "--json"])
def list_json_unicode(add, listed):
    ok(add)
    expect_typed_items(list_json(listed), [{"id": 1, "text": UNICODE_TEXT, "done": False}])
    return "non-ASCII text, quotes and backslashes survive the JSON output"


# A file written by an older version of the tool: gaps in the ids, items out of id order.
@check(["list", "--json"], ["done", "5"], ["add", "six"], ["list", "--json"],
       data=json.dumps({"next_id": 6, "items": [{"id": 5, "text": "five", "done": False},
                                                 {"id": 3, "text": "three", "done": True}]}))
def existing_file(listed, done, add, listed_again):
    expect_typed_items(list_json(listed), [{"id": 3, "text": "three", "done": True},
                                           {"id": 5, "text": "five", "done": False}])
    ok(done, add)
    expect_typed_items(list_json(listed_again), [{"id": 3, "text": "three", "done": True},
                                                 {"id": 5, "text": "five", "done": True},
                                                 {"id": 6, "text": "six", "done": False}])
    return "existing files: id order, done and add keep working"


# ---- harness ---------------------------------------------------------------------------------
# The tool never runs in this process: the calls of every check go, as data on stdin, to DRIVER,
# run once by agentbench's inner sandbox (the {sandbox_run} helper) in a fresh directory holding
# the workspace's copy as tool/; only what each call did comes back (in the file RESULTS of that
# directory), and it is compared with the expected values here.

RESULTS = ".oracle-results.json"
# Checks run one after the other, each in a data directory of its own; a call's output files live
# in the private /tmp.  The driver is the inner sandbox's pid 1: nothing the tool starts can stop
# it, or read or write its memory (it is not dumpable), and it ends all such processes before the
# next check; once the last is gone it writes the results to a file it makes anew (whatever a call
# left at that name, a link out of the directory say, is removed first).  A call sees what the
# driver holds (every check's calls and data, which check it is in): never an expected value.
# Each call is a process of its own, forked from the driver, which starts the interpreter once:
# the child does what `python -X utf8 tool/todo.py ARGS` would (its argv, path, working directory,
# stdin, `__main__`, exit status, the traceback of an exception, its atexit calls and threads), not
# paying an interpreter's start and teardown per call (33 calls a grading).  The modules the driver
# loaded stay loaded, as the interpreter's own start modules would, unless the tool's directory
# holds a file of the same name (one of them may import it): then the child drops them all and
# imports afresh, from that directory first.
DRIVER = r"""
import sys
STARTUP = set(sys.modules)
import atexit, base64, builtins, json, os, signal, stat, tempfile, time, types
import argparse, locale   # loaded once here: the tool's imports, and its first parse's
signal.signal(signal.SIGINT, signal.SIG_DFL)   # as pid 1, no other process can signal this one
if sys.platform == "linux":   # nor read or write its memory or descriptors (/proc/1/mem, /proc/1/fd)
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE: 0 (a forked call inherits it)
req = json.loads(sys.stdin.read())
TOOL = os.path.abspath(os.path.join("tool", "todo.py"))

def run_tool(args):   # the tool's run in this process, as the interpreter runs a script: its exit status
    tool_dir = os.path.dirname(TOOL)
    local = {name.split(".")[0] for name in os.listdir(tool_dir)}
    if local & {name.split(".")[0] for name in sys.modules.keys() - STARTUP}:
        for name in sys.modules.keys() - STARTUP:
            del sys.modules[name]
    sys.argv = ["../tool/todo.py", *args]
    sys.path.insert(0, tool_dir)
    path = os.path.join(os.getcwd(), sys.argv[0])   # the interpreter's name of it: __file__, tracebacks
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    try:
        with open(path, "rb") as fh:
            source = fh.read()
        exec(compile(source, path, "exec"), vars(main))
        code = 0
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:
        tb = exc.__traceback__   # the tool's frames only, as the interpreter prints them
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading = sys.modules.get("threading")
    for thread in threading.enumerate() if threading else ():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code or 0

def child(args, data_dir, out, err):   # in the forked process: never returns
    code = 1
    try:
        os.setsid()
        os.chdir(data_dir)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((null, 0), (out.fileno(), 1), (err.fileno(), 2)):
            os.dup2(fd, to)
        os.closerange(3, 1 << 16)   # only what a new process gets: stdin, stdout and stderr
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = run_tool(args)
    finally:
        os._exit(code & 0xFF)

def wait(pid, timeout):   # the call's exit status, or None once its time limit passed
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.002)

def call(args, data_dir):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(args, data_dir, out, err)
        code = wait(pid, req["timeout"])
        try:
            os.killpg(pid, signal.SIGKILL)   # whatever the call left running
        except OSError:
            pass
        if code is None:
            os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        answer = {"exit": code, "stdout": out.read(1 << 20).decode("utf-8", "replace"),
                  "stderr": err.read(1 << 20).decode("utf-8", "replace")}
    path = os.path.join(data_dir, "todo.json")
    answer["exists"], answer["file"] = os.path.lexists(path), None
    try:   # a regular file only: a FIFO left at the name is opened without waiting, and not read
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            if stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                answer["file"] = base64.b64encode(fh.read(1 << 20)).decode()
    except OSError:
        pass
    return answer

def end_the_rest():   # as the inner sandbox's pid 1: end and reap what a check left running
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:   # none was left
            pass
        try:
            while True:
                os.waitpid(-1, 0)
        except ChildProcessError:
            pass

def run_check(spec):
    data_dir = tempfile.mkdtemp(dir=".")
    if spec["data"] is not None:
        with open(os.path.join(data_dir, "todo.json"), "w", encoding="utf-8") as fh:
            fh.write(spec["data"])
    answers = []
    for args in spec["calls"]:
        answers.append(call(args, data_dir))
        if answers[-1]["exit"] is None:
            break
    end_the_rest()
    return answers

results = [run_check(spec) for spec in req["checks"]]
try:   # what a call left at the name
    os.unlink(req["results"])
except FileNotFoundError:
    pass
with open(os.open(req["results"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w", encoding="utf-8") as fh:
    json.dump(results, fh)
"""


def run_all(helper, run_dir, specs):
    """Every check's calls in one run of DRIVER in the inner sandbox: per check, the answers of
    its calls (one per call, fewer when one timed out), or a CheckFailed saying why none came."""
    request = json.dumps({"timeout": CALL_TIMEOUT_S, "results": RESULTS, "checks": specs})
    cmd = [sys.executable, helper, "--dir", run_dir, "--timeout", str(BATCH_TIMEOUT_S), "--",
           sys.executable, "-I", "-B", "-X", "utf8", "-c", DRIVER]
    try:
        proc = subprocess.run(cmd, input=request, capture_output=True, text=True, encoding="utf-8",
                              errors="replace", timeout=BATCH_TIMEOUT_S + 30)
    except subprocess.TimeoutExpired:
        return [CheckFailed(f"the checks did not finish in {BATCH_TIMEOUT_S} s")] * len(specs)
    results = None
    if proc.returncode == 0:   # the driver wrote its results file, and exited
        try:
            with open(os.path.join(run_dir, RESULTS), encoding="utf-8") as fh:
                results = json.load(fh)
        except (OSError, ValueError):
            pass
    if isinstance(results, list) and len(results) == len(specs):
        return results
    why = f"the checks gave no results (exit {proc.returncode}): {(proc.stderr or '').strip()[-300:]}"
    return [CheckFailed(why)] * len(specs)


def _fresh_run_dir(workspace, names):
    """A new directory under the workspace (the inner sandbox runs only in directories under the
    working directory) holding a copy of the workspace's entries `names` as tool/."""
    run_dir = tempfile.mkdtemp(prefix=".check-", dir=workspace)
    tool = os.path.join(run_dir, "tool")
    os.mkdir(tool)
    for name in names:
        src = os.path.join(workspace, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, os.path.join(tool, name), symlinks=True,
                            ignore=shutil.ignore_patterns(".git", "__pycache__"))
        else:
            shutil.copy2(src, os.path.join(tool, name), follow_symlinks=False)
    return run_dir


def _judge(check_id, calls, judge, answers):
    try:
        if isinstance(answers, CheckFailed):
            raise answers
        if answers and answers[-1]["exit"] is None:   # the driver stops a check at its hung call
            raise CheckFailed(f"todo {' '.join(calls[len(answers) - 1])} did not finish in {CALL_TIMEOUT_S} s")
        expect(len(answers) == len(calls), "the driver gave a wrong number of answers")
        detail = judge(*[Call(args, a) for args, a in zip(calls, answers)])
        return {"id": check_id, "passed": True, "detail": detail}
    except CheckFailed as exc:
        return {"id": check_id, "passed": False, "detail": str(exc)[:300]}
    except Exception as exc:  # e.g. a data file the tool wrote that is not JSON
        return {"id": check_id, "passed": False, "detail": f"{type(exc).__name__}: {exc}"[:300]}


def run_checks(helper, workspace):
    """Every check of CHECKS, judged here on what one batch of calls did: the receipt's checks."""
    names = [n for n in sorted(os.listdir(workspace)) if n not in (".git", "__pycache__")]
    specs = [{"calls": [(["--file", "todo.json"] if file_option else []) + args for args in calls],
              "data": data} for calls, file_option, data, _ in CHECKS.values()]
    run_dir = _fresh_run_dir(workspace, names)
    try:
        results = run_all(helper, run_dir, specs)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return [_judge(check_id, calls, judge, answers)
            for (check_id, (calls, _, _, judge)), answers in zip(CHECKS.items(), results)]


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
    checks = run_checks(opts["--sandbox-run"], workspace)
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
