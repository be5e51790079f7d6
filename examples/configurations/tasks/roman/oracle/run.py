#!/usr/bin/env python3
"""Hidden tests for the ``roman`` task. This directory is never copied into the agent's workspace.

Usage: python run.py WORKSPACE [--receipt-fd FD]

The workspace is copied to a private temporary directory first, so nothing the checks do can
write into the directory that was passed in. Every check then runs in its own isolated child
interpreter (``-I``: no PYTHON* variables, no user site, no script dir on sys.path), so code that
hangs, calls sys.exit or crashes costs that one check and nothing else.

The JSON receipt is written, from this parent process only, to the receipt channel FD (when
given) and as the last stdout line:
    {"passed": bool, "score": float, "checks": [{"id", "passed", "detail"}],
     "tests_passed": int, "tests_total": int}
Exit status is 0 whether or not the checks pass; 2 only when the oracle itself cannot run.
"""
import concurrent.futures
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile

MODULE = "roman"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20
WORKERS = 4
MARKER = "ORACLE-RESULT"


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


def _expect_value_error(func, values):
    """Return (passed, detail): every value must make func raise exactly ValueError."""
    for value in values:
        try:
            result = func(value)
        except ValueError:
            continue
        except Exception as exc:  # the spec names ValueError and no other type
            return False, f"{func.__name__}({value!r}) raised {type(exc).__name__}, not ValueError"
        return False, f"{func.__name__}({value!r}) returned {result!r} instead of raising ValueError"
    return True, f"{len(values)} invalid inputs rejected"


# ---- checks: each takes the imported module and returns (passed, detail) --------------------

def check_to_roman_known(mod):
    for n, expected in KNOWN:
        got = mod.to_roman(n)
        if got != expected:
            return False, f"to_roman({n}) == {got!r}, expected {expected!r}"
    return True, f"{len(KNOWN)} known values"


def check_from_roman_known(mod):
    for expected, s in KNOWN:
        got = mod.from_roman(s)
        if got != expected:
            return False, f"from_roman({s!r}) == {got!r}, expected {expected}"
    return True, f"{len(KNOWN)} known values"


def check_to_roman_full_range(mod):
    for n in range(1, 4000):
        got = mod.to_roman(n)
        if got != _canonical(n):
            return False, f"to_roman({n}) == {got!r}, expected {_canonical(n)!r}"
    return True, "1..3999 canonical"


def check_round_trip(mod):
    for n in range(1, 4000):
        got = mod.from_roman(_canonical(n))
        if got != n:
            return False, f"from_roman({_canonical(n)!r}) == {got!r}, expected {n}"
    return True, "from_roman inverts every canonical numeral in 1..3999"


def check_to_roman_out_of_range(mod):
    return _expect_value_error(mod.to_roman, [0, -1, -3999, 4000, 10**6])


def check_to_roman_wrong_types(mod):
    return _expect_value_error(mod.to_roman, [3.0, 2.5, "5", "V", None, True, False, [1]])


def check_from_roman_non_canonical(mod):
    return _expect_value_error(mod.from_roman, [
        "IIII", "VX", "VV", "LL", "DD", "MMMM", "IC", "IL", "XD", "XM", "VL", "IIV", "XIIX",
        "IXI", "CMC", "XCX", "IVI", "MCMC", "CCCC", "XXXX", "DCD", "LXL"])


def check_from_roman_bad_characters(mod):
    return _expect_value_error(mod.from_roman, [
        "", " ", "X ", " X", "X\n", "xiv", "Xiv", "mcm", "A", "1", "X1", "X-I", "\u216b"])


def check_from_roman_wrong_types(mod):
    return _expect_value_error(mod.from_roman, [None, 5, 1.0, b"X", ["X"]])


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

def _child(check_id, copy_dir):
    """Run one check against the module in copy_dir; report on fd 1 with the parent's nonce.

    The nonce arrives on stdin and is read before the code under test is imported, so that code
    cannot print a result line that the parent would believe.
    """
    nonce = sys.stdin.readline().strip()
    sys.stdin = open(os.devnull)
    sys.dont_write_bytecode = True
    os.chdir(copy_dir)
    sys.path.insert(0, copy_dir)
    try:
        import importlib
        mod = importlib.import_module(MODULE)
        passed, detail = CHECKS[check_id](mod)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: report, do not die
        passed, detail = False, f"{type(exc).__name__}: {exc}"
    try:
        sys.stdout.flush()
    except Exception:
        pass
    line = json.dumps({"nonce": nonce, "passed": bool(passed), "detail": str(detail)[:300]})
    os.write(1, f"\n{MARKER} {line}\n".encode("ascii"))
    os._exit(0)


def _run_check(check_id, copy_dir):
    nonce = secrets.token_hex(16)
    cmd = [sys.executable, "-I", "-B", os.path.abspath(__file__), "--child", check_id, copy_dir]
    try:
        proc = subprocess.run(cmd, input=nonce + "\n", capture_output=True, text=True,
                              encoding="utf-8", errors="replace", cwd=copy_dir,
                              timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"id": check_id, "passed": False, "detail": f"timed out after {CHECK_TIMEOUT_S} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER + " "):
            try:
                result = json.loads(line[len(MARKER) + 1:])
            except ValueError:
                continue
            if result.get("nonce") == nonce:
                return {"id": check_id, "passed": bool(result["passed"]),
                        "detail": result["detail"]}
    tail = (proc.stderr or "").strip()[-300:]
    return {"id": check_id, "passed": False,
            "detail": f"no result from check (exit {proc.returncode}): {tail}"}



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
    if len(argv) == 4 and argv[1] == "--child":
        _child(argv[2], argv[3])
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
    with tempfile.TemporaryDirectory(prefix="oracle-roman-") as tmp:
        copy_dir = os.path.join(tmp, "workspace")
        try:
            shutil.copytree(workspace, copy_dir, symlinks=True,
                            ignore=shutil.ignore_patterns(".git", "__pycache__"))
        except (OSError, shutil.Error) as exc:
            print(f"run.py: cannot copy the workspace: {exc}", file=sys.stderr)
            return 2
        # Each check is its own child process, so they run side by side; map() keeps the
        # receipt in CHECKS order.
        with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
            checks = list(pool.map(lambda check_id: _run_check(check_id, copy_dir),
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
