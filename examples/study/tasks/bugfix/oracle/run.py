#!/usr/bin/env python3
"""Hidden tests for the ``bugfix`` task. This directory is never copied into the agent's workspace.

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
import random
import shutil
import subprocess
import sys
import tempfile

MODULE = "textstats"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20
WORKERS = 4


# ---- checks: each takes run(calls) and returns (passed, detail) ---------------------------------

def _all_equal(run, cases):
    """cases: (label, function, args, expected). (passed, detail) at the first mismatch."""
    got = run([(name, args) for _, name, args, _ in cases])
    for (label, _, _, expected), value in zip(cases, got):
        if isinstance(value, Raised) or value != expected or type(value) is not type(expected):
            return False, f"{label}: got {value!r}, expected {expected!r}"
    return True, f"{len(cases)} case{'s' if len(cases) != 1 else ''} matched"


def _all_value_errors(run, cases):
    """cases: (label, function, args): each call must raise ValueError."""
    got = run([(name, args) for _, name, args in cases])
    for (label, _, _), value in zip(cases, got):
        if not isinstance(value, Raised):
            return False, f"{label} returned {value!r} instead of raising ValueError"
        if not value.value_error:
            return False, f"{label} raised {value.name}, not ValueError"
    return True, f"{len(cases)} invalid input{'s' if len(cases) != 1 else ''} rejected"


def check_wrap_reported_case(run):
    return _all_equal(run, [("wrap('the cat sat on the mat', 7)", "wrap", ("the cat sat on the mat", 7),
                             ["the cat", "sat on", "the mat"])])


def check_wrap_exact_fit(run):
    return _all_equal(run, [
        ("wrap('aa bb cc', 5)", "wrap", ("aa bb cc", 5), ["aa bb", "cc"]),
        ("wrap('one two', 7)", "wrap", ("one two", 7), ["one two"]),
        ("wrap('a b c d', 3)", "wrap", ("a b c d", 3), ["a b", "c d"]),
        ("wrap('x y', 1)", "wrap", ("x y", 1), ["x", "y"]),
    ])


_VOCAB = ["a", "an", "to", "of", "the", "word", "wrap", "line", "greedy", "packing", "paragraph",
          "café", "naïve", "東京", "extraordinarily", "incomprehensibilities", "x", "it's"]


def check_wrap_properties(run):
    rng = random.Random(20261130)
    cases = []
    for trial in range(30):
        text = " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(1, 60)))
        cases += [(trial, text, width) for width in range(1, 41)]
    got = run([("wrap", (text, width)) for _, text, width in cases])
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


def check_wrap_edge_cases(run):
    ok, detail = _all_equal(run, [
        ("wrap('', 10)", "wrap", ("", 10), []),
        ("wrap(' \\n\\t ', 10)", "wrap", (" \n\t ", 10), []),
        ("wrap('word', 1)", "wrap", ("word", 1), ["word"]),
        ("wrap('a\\tb\\nc', 80)", "wrap", ("a\tb\nc", 80), ["a b c"]),
    ])
    if not ok:
        return ok, detail
    ok, detail = _all_value_errors(run, [(f"wrap('a b', {w})", "wrap", ("a b", w)) for w in (0, -3)])
    return (True, "blank text, whitespace kinds, tiny and invalid widths") if ok else (ok, detail)


def check_wrap_unicode(run):
    return _all_equal(run, [
        ("wrap('café crème brûlée', 10)", "wrap", ("café crème brûlée", 10), ["café crème", "brûlée"]),
        ("wrap('東京 大阪 京都', 5)", "wrap", ("東京 大阪 京都", 5), ["東京 大阪", "京都"]),
    ])


def check_words_ascii(run):
    return _all_equal(run, [
        ("words('Hello, World! hello-world 42nd')", "words", ("Hello, World! hello-world 42nd",),
         ["hello", "world", "hello", "world", "42nd"]),
        ("word_counts('The cat and the hat.')", "word_counts", ("The cat and the hat.",),
         {"the": 2, "cat": 1, "and": 1, "hat": 1}),
        ("words('')", "words", ("",), []),
    ])


def check_words_unicode_letters(run):
    return _all_equal(run, [
        ("words('Café, CAFÉ und café!')", "words", ("Café, CAFÉ und café!",), ["café", "café", "und", "café"]),
        ("words('Привет, мир! ПРИВЕТ')", "words", ("Привет, мир! ПРИВЕТ",), ["привет", "мир", "привет"]),
        ("words('naïve façade')", "words", ("naïve façade",), ["naïve", "façade"]),
        ("words('東京 2024')", "words", ("東京 2024",), ["東京", "2024"]),
    ])


def check_words_casefold(run):
    return _all_equal(run, [
        ("word_counts('Straße STRASSE strasse')", "word_counts", ("Straße STRASSE strasse",), {"strasse": 3}),
        ("words('MASSE Maße')", "words", ("MASSE Maße",), ["masse", "masse"]),
    ])


def check_words_separators(run):
    text = "snake_case rock'n'roll 'quoted' don''t end' tab\tnew\nline"
    return _all_equal(run, [
        (f"words({text!r})", "words", (text,),
         ["snake", "case", "rock'n'roll", "quoted", "don", "t", "end", "tab", "new", "line"]),
    ])


def check_top_words_ranking(run):
    text = "b a c b a b d"
    ok, detail = _all_equal(run, [
        ("top_words(text, 2)", "top_words", (text, 2), [("b", 3), ("a", 2)]),
        ("top_words(text, 10)", "top_words", (text, 10), [("b", 3), ("a", 2), ("c", 1), ("d", 1)]),
        ("top_words(text, 0)", "top_words", (text, 0), []),
        ("top_words('', 3)", "top_words", ("", 3), []),
    ])
    if not ok:
        return ok, detail
    ok, detail = _all_value_errors(run, [("top_words(text, -1)", "top_words", (text, -1))])
    return (True, "order, ties, short lists, n == 0, n < 0") if ok else (ok, detail)


def check_top_words_unicode(run):
    return _all_equal(run, [
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
