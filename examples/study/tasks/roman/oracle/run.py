#!/usr/bin/env python3
"""Hidden tests for the ``roman`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE --sandbox-run HELPER [--receipt-fd FD]

The code under test never runs in this process: each check sends its calls (function names and
arguments, never the expected values) to a small driver that agentbench's inner sandbox runs in a
fresh copy of the workspace (HELPER is the {sandbox_run} helper).  The inner sandbox sees that
copy and nothing else: not this file, not the receipt channel, not this process's arguments.
The results come back as data and are compared with the expected values here, so code that
patches its interpreter, prints a receipt or reads its parent's command line forges nothing.

The JSON receipt is written, from this process only, to the receipt channel FD (when given) and
as the last stdout line:
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

MODULE = "roman"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20
WORKERS = 4


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


def _expect_value_error(run, name, values):
    """Return (passed, detail): every value must make the function raise exactly ValueError."""
    for value, result in zip(values, run([(name, (value,)) for value in values])):
        if not isinstance(result, Raised):
            return False, f"{name}({value!r}) returned {result!r} instead of raising ValueError"
        if not result.value_error:  # the spec names ValueError and no other type
            return False, f"{name}({value!r}) raised {result.name}, not ValueError"
    return True, f"{len(values)} invalid inputs rejected"


# ---- checks: each takes run(calls) and returns (passed, detail) ---------------------------------

def _expect_values(run, name, cases):
    """cases: (argument, expected): name(argument) must equal expected, of the same type."""
    for (arg, expected), got in zip(cases, run([(name, (arg,)) for arg, _ in cases])):
        if isinstance(got, Raised) or got != expected or type(got) is not type(expected):
            return False, f"{name}({arg!r}) == {got!r}, expected {expected!r}"
    return True, None


def check_to_roman_known(run):
    ok, detail = _expect_values(run, "to_roman", KNOWN)
    return ok, detail or f"{len(KNOWN)} known values"


def check_from_roman_known(run):
    ok, detail = _expect_values(run, "from_roman", [(s, n) for n, s in KNOWN])
    return ok, detail or f"{len(KNOWN)} known values"


def check_to_roman_full_range(run):
    ok, detail = _expect_values(run, "to_roman", [(n, _canonical(n)) for n in range(1, 4000)])
    return ok, detail or "1..3999 canonical"


def check_round_trip(run):
    ok, detail = _expect_values(run, "from_roman", [(_canonical(n), n) for n in range(1, 4000)])
    return ok, detail or "from_roman inverts every canonical numeral in 1..3999"


def check_to_roman_out_of_range(run):
    return _expect_value_error(run, "to_roman", [0, -1, -3999, 4000, 10**6])


def check_to_roman_wrong_types(run):
    return _expect_value_error(run, "to_roman", [3.0, 2.5, "5", "V", None, True, False, [1]])


def check_from_roman_non_canonical(run):
    return _expect_value_error(run, "from_roman", [
        "IIII", "VX", "VV", "LL", "DD", "MMMM", "IC", "IL", "XD", "XM", "VL", "IIV", "XIIX",
        "IXI", "CMC", "XCX", "IVI", "MCMC", "CCCC", "XXXX", "DCD", "LXL"])


def check_from_roman_bad_characters(run):
    return _expect_value_error(run, "from_roman", [
        "", " ", "X ", " X", "X\n", "xiv", "Xiv", "mcm", "A", "1", "X1", "X-I", "\u216b"])


def check_from_roman_wrong_types(run):
    return _expect_value_error(run, "from_roman", [None, 5, 1.0, b"X", ["X"]])


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
# The code under test never runs in this process, nor in any process that can see this file: each
# check's calls go, as data on stdin, to DRIVER, run by agentbench's inner sandbox (the
# {sandbox_run} helper) in a fresh copy of the workspace; only the calls' results come back, and
# they are compared with the expected values here.

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

DRIVER = CODEC + r'''
import json, sys
class Unrepresentable(str):
    pass
req = json.loads(sys.stdin.read())
sys.path.insert(0, ".")
results = []
try:
    import importlib
    mod = importlib.import_module(req["module"])
except BaseException as exc:
    results = {"import_error": (type(exc).__name__ + ": " + str(exc))[:300]}
else:
    for name, args in req["calls"]:
        try:
            results.append({"value": enc(getattr(mod, name)(*dec(args)))})
        except BaseException as exc:
            results.append({"raised": type(exc).__name__, "value_error": isinstance(exc, ValueError),
                            "message": str(exc)[:200]})
sys.stdout.flush()
print("\n" + json.dumps({"results": results}))
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
    """The check cannot judge the code (it crashed, hung or printed no results)."""


def make_runner(helper, copy_dir):
    """run(calls) -> one result per (function name, args) call: the value, or a Raised."""

    def run(calls):
        stdin = json.dumps({"module": MODULE, "calls": [[name, enc(tuple(args))] for name, args in calls]})
        cmd = [sys.executable, helper, "--dir", copy_dir, "--timeout", str(CHECK_TIMEOUT_S), "--",
               sys.executable, "-I", "-B", "-X", "utf8", "-c", DRIVER]
        try:
            proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, encoding="utf-8",
                                  errors="replace", timeout=CHECK_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"timed out after {CHECK_TIMEOUT_S} s")
        if proc.returncode == 124:
            raise CheckFailed(f"timed out after {CHECK_TIMEOUT_S} s")
        for line in reversed(proc.stdout.splitlines()):
            try:
                answer = json.loads(line)
                results = answer["results"]
                if isinstance(results, dict):
                    raise CheckFailed(f"importing {MODULE} failed: {str(results.get('import_error'))[:250]}")
                if not isinstance(results, list) or len(results) != len(calls):
                    raise ValueError("wrong number of results")
                out = []
                for r in results:
                    if "value" in r:
                        out.append(dec(r["value"]))
                    else:
                        out.append(Raised(str(r["raised"]), r.get("value_error") is True, str(r["message"])))
                return out
            except CheckFailed:
                raise
            except Exception:
                continue
        tail = (proc.stderr or "").strip()[-300:]
        raise CheckFailed(f"no results (exit {proc.returncode}): {tail}")

    return run


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


def _run_check(check_id, helper, workspace, names):
    copy_dir = None
    try:
        copy_dir = _fresh_copy(workspace, names)
        passed, detail = CHECKS[check_id](make_runner(helper, copy_dir))
    except CheckFailed as exc:
        passed, detail = False, str(exc)
    except Exception as exc:   # results of an unexpected shape: the check fails, the harness goes on
        passed, detail = False, f"{type(exc).__name__}: {exc}"
    finally:
        if copy_dir:
            shutil.rmtree(copy_dir, ignore_errors=True)
    return {"id": check_id, "passed": bool(passed), "detail": str(detail)[:300]}


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
    names = sorted(os.listdir(workspace))
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
