#!/usr/bin/env python3
"""Hidden tests for the ``roman`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE --sandbox-run HELPER [--receipt-fd FD]

The code under test never runs in this process: every check's calls (function names and
arguments, never the expected values) go in one batch to a small driver that agentbench's inner
sandbox runs in a fresh copy of the workspace (HELPER is the {sandbox_run} helper).  The inner
sandbox sees that copy and nothing else: not this file, not the receipt channel, not this
process's arguments.  There each check's calls run in a process of their own (a fresh import of
the module, a time limit of its own), so a check that hangs or crashes costs that check only.
The results come back as data and are compared with the expected values here, so code that
patches its interpreter, prints a receipt or reads its parent's command line forges nothing.

The JSON receipt is written, from this process only, to the receipt channel FD (when given) and
as the last stdout line:
    {"passed": bool, "score": float, "checks": [{"id", "passed", "detail"}],
     "tests_passed": int, "tests_total": int}
Exit status is 0 whether or not the checks pass; 2 only when the oracle itself cannot run.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

MODULE = "roman"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20


# ---- reference values, built independently of any implementation under test ----------------

def _canonical(n):
    """Canonical numeral by decimal digit: the shape every 1..3999 numeral is made of."""
    thousands = ["", "M", "MM", "MMM"]
    hundreds = ["", "C", "CC", "CCC", "CD", "D", "DC", "DCC", "DCCC", "CM"]
    tens = ["", "X", "XX", "XXX", "XL", "L", "LX", "LXX", "LXXX", "XC"]
    ones = ["", "I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX"]
    return thousands[n // 1000] + hundreds[n // 100 % 10] + tens[n // 10 % 10] + ones[n % 10]


KNOWN = [(1, "I"), (2, "II"), (4, "IV"), (5, "V"), (9, "IX"), (10, "X"), (14, "XIV"),
         (40, "XL"), (44, "XLIV"), (49, "XLIX"), (90, "XC"), (99, "XCIX"), (400, "CD"),
         (444, "CDXLIV"), (900, "CM"), (999, "CMXCIX"), (1994, "MCMXCIV"), (2024, "MMXXIV"),
         (3888, "MMMDCCCLXXXVIII"), (3999, "MMMCMXCIX")]


# ---- checks: each returns (calls, judge) ---------------------------------------------------------
# calls: the (function name, args) to call; judge(results) -> (passed, detail), given one result
# per call (the value returned, or a Raised).  The calls of every check run in one batch.

def _expect_value_error(name, values):
    """Every value must make the function raise exactly ValueError."""
    def judge(got):
        for value, result in zip(values, got):
            if not isinstance(result, Raised):
                return False, f"{name}({value!r}) returned {result!r} instead of raising ValueError"
            if not result.value_error:  # the spec names ValueError and no other type
                return False, f"{name}({value!r}) raised {result.name}, not ValueError"
        return True, f"{len(values)} invalid inputs rejected"
    return [(name, (value,)) for value in values], judge


def _expect_values(name, cases, detail):
    """cases: (argument, expected): name(argument) must equal expected, of the same type."""
    def judge(got):
        for (arg, expected), result in zip(cases, got):
            if isinstance(result, Raised) or result != expected or type(result) is not type(expected):
                return False, f"{name}({arg!r}) == {result!r}, expected {expected!r}"
        return True, detail
    return [(name, (arg,)) for arg, _ in cases], judge


def check_to_roman_known():
    return _expect_values("to_roman", KNOWN, f"{len(KNOWN)} known values")


def check_from_roman_known():
    return _expect_values("from_roman", [(s, n) for n, s in KNOWN], f"{len(KNOWN)} known values")


def check_to_roman_full_range():
    return _expect_values("to_roman", [(n, _canonical(n)) for n in range(1, 4000)], "1..3999 canonical")


def check_round_trip():
    return _expect_values("from_roman", [(_canonical(n), n) for n in range(1, 4000)],
                          "from_roman inverts every canonical numeral in 1..3999")


def check_to_roman_out_of_range():
    return _expect_value_error("to_roman", [0, -1, -3999, 4000, 10**6])


def check_to_roman_wrong_types():
    return _expect_value_error("to_roman", [3.0, 2.5, "5", "V", None, True, False, [1]])


def check_from_roman_non_canonical():
    return _expect_value_error("from_roman", [
        "IIII", "VX", "VV", "LL", "DD", "MMMM", "IC", "IL", "XD", "XM", "VL", "IIV", "XIIX",
        "IXI", "CMC", "XCX", "IVI", "MCMC", "CCCC", "XXXX", "DCD", "LXL"])


def check_from_roman_bad_characters():
    return _expect_value_error("from_roman", [
        "", " ", "X ", " X", "X\n", "xiv", "Xiv", "mcm", "A", "1", "X1", "X-I", "\u216b"])


def check_from_roman_wrong_types():
    return _expect_value_error("from_roman", [None, 5, 1.0, b"X", ["X"]])


CHECKS = {
    "to_roman_known": check_to_roman_known,
    "from_roman_known": check_from_roman_known,
    "to_roman_full_range": check_to_roman_full_range,
    "round_trip_full_range": check_round_trip,
    "to_roman_out_of_range": check_to_roman_out_of_range,
    "to_roman_wrong_types": check_to_roman_wrong_types,
    "from_roman_non_canonical": check_from_roman_non_canonical,
    "from_roman_bad_characters": check_from_roman_bad_characters,
    "from_roman_wrong_types": check_from_roman_wrong_types,
}


# ---- harness ---------------------------------------------------------------------------------
# The code under test never runs in this process, nor in any process that can see this file: the
# calls of every check go, as data on stdin, to DRIVER, run once by agentbench's inner sandbox (the
# {sandbox_run} helper) in a fresh copy of the workspace; only the calls' results come back (in
# the file RESULTS of that copy), and they are compared with the expected values here.

RESULTS = ".oracle-results.json"
# Values cross the boundary tagged with their type, so that a tuple is not a list and True is
# not 1; only these plain types are rebuilt, anything else arrives as its repr.
CODEC = r'''
def enc(v):
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return [t.__name__, v]
    if t is bytes:
        return ["bytes", list(v)]
    if t in (list, tuple):
        return [t.__name__, [enc(x) for x in v]]
    if t is dict:
        return ["dict", [[enc(k), enc(x)] for k, x in v.items()]]
    return ["repr", repr(v)[:200]]

def dec(v):
    tag, x = v
    if tag in ("NoneType", "bool", "int", "float", "str"):
        return x
    if tag == "bytes":
        return bytes(x)
    if tag in ("list", "tuple"):
        return (list if tag == "list" else tuple)(dec(y) for y in x)
    if tag == "dict":
        return {dec(k): dec(y) for k, y in x}
    return Unrepresentable(x)
'''

# Each check's calls run in a child process of their own, forked from the driver before the
# module is imported: a fresh import per check, its output thrown away, and a check that hangs is
# killed after its time limit (the others go on).  Its answer comes back on a pipe, one line.
# The driver is the inner sandbox's pid 1: nothing a check starts can stop it or reach its memory
# (it is not dumpable), and it ends all such processes before the next check; once the last is
# gone it writes the results to a file it makes anew (whatever a check left at the name removed).
DRIVER = CODEC + r'''
import importlib, json, os, select, signal, sys, time
class Unrepresentable(str):
    pass

def call_all(module, calls):
    try:
        mod = importlib.import_module(module)
    except BaseException as exc:
        return {"import_error": (type(exc).__name__ + ": " + str(exc))[:300]}
    results = []
    for name, args in calls:
        try:
            results.append({"value": enc(getattr(mod, name)(*dec(args)))})
        except BaseException as exc:
            results.append({"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                            "message": str(exc)[:200]})
    return {"results": results}

def run_check(module, calls, timeout):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        try:
            data = json.dumps(call_all(module, calls)).encode() + b"\n"
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [b""], time.monotonic() + timeout
    while not chunks[-1].endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            chunks = [b'{"timed_out": true}']
            break
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return {"failed": "the check's process ended without results"}

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

signal.signal(signal.SIGINT, signal.SIG_DFL)   # as pid 1, no other process can signal this one
if sys.platform == "linux":   # nor read or write its memory or descriptors (/proc/1/mem, /proc/1/fd)
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE: 0 (a forked check inherits it)
req = json.loads(sys.stdin.read())
sys.path.insert(0, ".")
answers = []
for calls in req["checks"]:
    answers.append(run_check(req["module"], calls, req["timeout"]))
    end_the_rest()
try:   # what a check left at the name
    os.unlink(req["results"])
except FileNotFoundError:
    pass
with open(os.open(req["results"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w", encoding="utf-8") as fh:
    json.dump(answers, fh)
'''


class Unrepresentable(str):
    """A result of a type the codec does not rebuild (its repr): equal to no expected value."""

    def __eq__(self, other):
        return False

    __hash__ = str.__hash__


_codec = {"Unrepresentable": Unrepresentable}
exec(CODEC, _codec)
enc, dec = _codec["enc"], _codec["dec"]


class Raised:
    """A call that raised: the exception's type name, and whether it is a ValueError."""

    def __init__(self, name, value_error, message):
        self.name, self.value_error, self.message = name, value_error, message

    def __repr__(self):
        return f"<raised {self.name}: {self.message}>"


class CheckFailed(Exception):
    """The check cannot judge the code (it crashed, hung or gave no results)."""


def _results(answer, n_calls):
    """One check's answer from the driver: its n_calls results (the value, or a Raised)."""
    if answer.get("timed_out"):
        raise CheckFailed(f"timed out after {CHECK_TIMEOUT_S} s")
    if "import_error" in answer:
        raise CheckFailed(f"importing {MODULE} failed: {str(answer['import_error'])[:250]}")
    if "failed" in answer:
        raise CheckFailed(str(answer["failed"]))
    results = answer["results"]
    if not isinstance(results, list) or len(results) != n_calls:
        raise CheckFailed("wrong number of results")
    return [dec(r["value"]) if "value" in r else
            Raised(str(r["raised"]), r.get("value_error") is True, str(r["message"])) for r in results]


def run_all(helper, copy_dir, calls_per_check):
    """Every check's calls in one run of DRIVER in the inner sandbox: one answer per check
    (see _results)."""
    request = json.dumps({"module": MODULE, "timeout": CHECK_TIMEOUT_S, "results": RESULTS,
                          "checks": [[[name, enc(tuple(args))] for name, args in calls]
                                     for calls in calls_per_check]})
    timeout = CHECK_TIMEOUT_S * len(calls_per_check) + 10
    cmd = [sys.executable, helper, "--dir", copy_dir, "--timeout", str(timeout), "--",
           sys.executable, "-I", "-B", "-X", "utf8", "-c", DRIVER]
    try:
        proc = subprocess.run(cmd, input=request, capture_output=True, text=True, encoding="utf-8",
                              errors="replace", timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        return [{"failed": f"the checks did not finish in {timeout} s"}] * len(calls_per_check)
    answers = None
    if proc.returncode == 0:   # the driver wrote its results file, and exited
        try:
            with open(os.path.join(copy_dir, RESULTS), encoding="utf-8") as fh:
                answers = json.load(fh)
        except (OSError, ValueError):
            pass
    if isinstance(answers, list) and len(answers) == len(calls_per_check):
        return answers
    why = f"no results (exit {proc.returncode}): {(proc.stderr or '').strip()[-300:]}"
    return [{"failed": why}] * len(calls_per_check)


def _fresh_copy(workspace, names):
    """A private copy of the workspace's entries `names`, in a new directory under it (the inner
    sandbox only runs in directories under the working directory)."""
    dst = tempfile.mkdtemp(prefix=".check-", dir=workspace)
    for name in names:
        src = os.path.join(workspace, name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, os.path.join(dst, name), symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, os.path.join(dst, name), follow_symlinks=False)
    return dst


def run_checks(helper, workspace):
    """Every check of CHECKS, judged here on the results of one batch: the receipt's checks."""
    planned = {check_id: check() for check_id, check in CHECKS.items()}    # (calls, judge)
    copy_dir = _fresh_copy(workspace, sorted(os.listdir(workspace)))
    try:
        answers = run_all(helper, copy_dir, [calls for calls, _ in planned.values()])
    finally:
        shutil.rmtree(copy_dir, ignore_errors=True)
    checks = []
    for (check_id, (calls, judge)), answer in zip(planned.items(), answers):
        try:
            passed, detail = judge(_results(answer, len(calls)))
        except CheckFailed as exc:
            passed, detail = False, str(exc)
        except Exception as exc:   # results of an unexpected shape: the check fails, the harness goes on
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        checks.append({"id": check_id, "passed": bool(passed), "detail": str(detail)[:300]})
    return checks


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
