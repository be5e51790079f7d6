#!/usr/bin/env python3
"""Hidden tests for the ``bugfix`` task. This directory is never copied into the agent's workspace.

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
import random
import shutil
import subprocess
import sys
import tempfile

MODULE = "textstats"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20


# ---- checks: each returns (calls, judge) ---------------------------------------------------------
# calls: the (function name, args) to call; judge(results) -> (passed, detail), given one result
# per call (the value returned, or a Raised).  The calls of every check run in one batch.

def _all_equal(cases):
    """cases: (label, function, args, expected). (passed, detail) at the first mismatch."""
    def judge(got):
        for (label, _, _, expected), value in zip(cases, got):
            if isinstance(value, Raised) or value != expected or type(value) is not type(expected):
                return False, f"{label}: got {value!r}, expected {expected!r}"
        return True, f"{len(cases)} case{'s' if len(cases) != 1 else ''} matched"
    return [(name, args) for _, name, args, _ in cases], judge


def _all_value_errors(cases):
    """cases: (label, function, args): each call must raise ValueError."""
    def judge(got):
        for (label, _, _), value in zip(cases, got):
            if not isinstance(value, Raised):
                return False, f"{label} returned {value!r} instead of raising ValueError"
            if not value.value_error:
                return False, f"{label} raised {value.name}, not ValueError"
        return True, f"{len(cases)} invalid input{'s' if len(cases) != 1 else ''} rejected"
    return [(name, args) for _, name, args in cases], judge


def _both(first, second, detail):
    """Two parts as one check: the first part's failure, else the second's, else `detail`."""
    (calls1, judge1), (calls2, judge2) = first, second
    def judge(got):
        for part, results in ((judge1, got[:len(calls1)]), (judge2, got[len(calls1):])):
            ok, why = part(results)
            if not ok:
                return ok, why
        return True, detail
    return calls1 + calls2, judge


def check_wrap_reported_case():
    return _all_equal([("wrap('the cat sat on the mat', 7)", "wrap", ("the cat sat on the mat", 7),
                        ["the cat", "sat on", "the mat"])])


def check_wrap_exact_fit():
    return _all_equal([
        ("wrap('aa bb cc', 5)", "wrap", ("aa bb cc", 5), ["aa bb", "cc"]),
        ("wrap('one two', 7)", "wrap", ("one two", 7), ["one two"]),
        ("wrap('a b c d', 3)", "wrap", ("a b c d", 3), ["a b", "c d"]),
        ("wrap('x y', 1)", "wrap", ("x y", 1), ["x", "y"]),
    ])


_VOCAB = ["a", "an", "to", "of", "the", "word", "wrap", "line", "greedy", "packing", "paragraph",
          "café", "naïve", "東京", "extraordinarily", "incomprehensibilities", "x", "it's"]


def check_wrap_properties():
    rng = random.Random(20261130)
    cases = []
    for trial in range(30):
        text = " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(1, 60)))
        cases += [(trial, text, width) for width in range(1, 41)]

    def judge(got):
        for (trial, text, width), lines in zip(cases, got):
            label = f"wrap(<text {trial}>, {width})"
            if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
                return False, f"{label} returned {lines!r}, not a list of strings"
            if " ".join(lines).split() != text.split():
                return False, f"{label} lost, added or reordered words"
            for i, line in enumerate(lines):
                if not line or line != line.strip() or "  " in line:
                    return False, f"{label}: malformed line {line!r}"
                if len(line) > width and " " in line:
                    return False, f"{label}: line {line!r} is longer than {width}"
                if i + 1 < len(lines) and len(line) + 1 + len(lines[i + 1].split()[0]) <= width:
                    return False, f"{label}: line {line!r} could take the next word (not greedy)"
        return True, "30 texts x widths 1..40: fit, greedy, every word kept"
    return [("wrap", (text, width)) for _, text, width in cases], judge


def check_wrap_edge_cases():
    return _both(_all_equal([
        ("wrap('', 10)", "wrap", ("", 10), []),
        ("wrap(' \\n\\t ', 10)", "wrap", (" \n\t ", 10), []),
        ("wrap('word', 1)", "wrap", ("word", 1), ["word"]),
        ("wrap('a\\tb\\nc', 80)", "wrap", ("a\tb\nc", 80), ["a b c"]),
    ]), _all_value_errors([(f"wrap('a b', {w})", "wrap", ("a b", w)) for w in (0, -3)]),
        "blank text, whitespace kinds, tiny and invalid widths")


def check_wrap_unicode():
    return _all_equal([
        ("wrap('café crème brûlée', 10)", "wrap", ("café crème brûlée", 10), ["café crème", "brûlée"]),
        ("wrap('東京 大阪 京都', 5)", "wrap", ("東京 大阪 京都", 5), ["東京 大阪", "京都"]),
    ])


def check_words_ascii():
    return _all_equal([
        ("words('Hello, World! hello-world 42nd')", "words", ("Hello, World! hello-world 42nd",),
         ["hello", "world", "hello", "world", "42nd"]),
        ("word_counts('The cat and the hat.')", "word_counts", ("The cat and the hat.",),
         {"the": 2, "cat": 1, "and": 1, "hat": 1}),
        ("words('')", "words", ("",), []),
    ])


def check_words_unicode_letters():
    return _all_equal([
        ("words('Café, CAFÉ und café!')", "words", ("Café, CAFÉ und café!",), ["café", "café", "und", "café"]),
        ("words('Привет, мир! ПРИВЕТ')", "words", ("Привет, мир! ПРИВЕТ",), ["привет", "мир", "привет"]),
        ("words('naïve façade')", "words", ("naïve façade",), ["naïve", "façade"]),
        ("words('東京 2024')", "words", ("東京 2024",), ["東京", "2024"]),
    ])


def check_words_casefold():
    return _all_equal([
        ("word_counts('Straße STRASSE strasse')", "word_counts", ("Straße STRASSE strasse",), {"strasse": 3}),
        ("words('MASSE Maße')", "words", ("MASSE Maße",), ["masse", "masse"]),
    ])


def check_words_separators():
    text = "snake_case rock'n'roll 'quoted' don''t end' tab\tnew\nline"
    return _all_equal([
        (f"words({text!r})", "words", (text,),
         ["snake", "case", "rock'n'roll", "quoted", "don", "t", "end", "tab", "new", "line"]),
    ])


def check_top_words_ranking():
    text = "b a c b a b d"
    return _both(_all_equal([
        ("top_words(text, 2)", "top_words", (text, 2), [("b", 3), ("a", 2)]),
        ("top_words(text, 10)", "top_words", (text, 10), [("b", 3), ("a", 2), ("c", 1), ("d", 1)]),
        ("top_words(text, 0)", "top_words", (text, 0), []),
        ("top_words('', 3)", "top_words", ("", 3), []),
    ]), _all_value_errors([("top_words(text, -1)", "top_words", (text, -1))]),
        "order, ties, short lists, n == 0, n < 0")


def check_top_words_unicode():
    return _all_equal([
        ("top_words('Ärger ärger ÄRGER bär Bär', 2)", "top_words", ("Ärger ärger ÄRGER bär Bär", 2),
         [("ärger", 3), ("bär", 2)]),
    ])


CHECKS = {
    "wrap_reported_case": check_wrap_reported_case,
    "wrap_exact_fit": check_wrap_exact_fit,
    "wrap_properties": check_wrap_properties,
    "wrap_edge_cases": check_wrap_edge_cases,
    "wrap_unicode": check_wrap_unicode,
    "words_ascii": check_words_ascii,
    "words_unicode_letters": check_words_unicode_letters,
    "words_casefold": check_words_casefold,
    "words_separators": check_words_separators,
    "top_words_ranking": check_top_words_ranking,
    "top_words_unicode": check_top_words_unicode,
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
