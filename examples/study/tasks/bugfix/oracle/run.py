#!/usr/bin/env python3
"""Hidden tests for the ``bugfix`` task. This directory is never copied into the agent's workspace.

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
import random
import secrets
import shutil
import subprocess
import sys
import tempfile

MODULE = "textstats"
# Per check. Every check hanging must still fit in the task's oracle timeout (300 s).
CHECK_TIMEOUT_S = 20
WORKERS = 4
MARKER = "ORACLE-RESULT"


# ---- checks: each takes the imported module and returns (passed, detail) --------------------

def _expect(label, got, expected):
    """Return None when equal, else a one-line explanation."""
    if got != expected:
        return f"{label}: got {got!r}, expected {expected!r}"
    return None


def _all_equal(cases):
    """cases: (label, thunk, expected). Return (passed, detail) for the first mismatch."""
    for label, thunk, expected in cases:
        problem = _expect(label, thunk(), expected)
        if problem:
            return False, problem
    return True, f"{len(cases)} case{'s' if len(cases) != 1 else ''} matched"


def _expect_value_error(label, thunk):
    try:
        result = thunk()
    except ValueError:
        return None
    except Exception as exc:
        return f"{label} raised {type(exc).__name__}, not ValueError"
    return f"{label} returned {result!r} instead of raising ValueError"


def check_wrap_reported_case(mod):
    return _all_equal([("wrap('the cat sat on the mat', 7)",
                        lambda: mod.wrap("the cat sat on the mat", 7),
                        ["the cat", "sat on", "the mat"])])


def check_wrap_exact_fit(mod):
    return _all_equal([
        ("wrap('aa bb cc', 5)", lambda: mod.wrap("aa bb cc", 5), ["aa bb", "cc"]),
        ("wrap('one two', 7)", lambda: mod.wrap("one two", 7), ["one two"]),
        ("wrap('a b c d', 3)", lambda: mod.wrap("a b c d", 3), ["a b", "c d"]),
        ("wrap('x y', 1)", lambda: mod.wrap("x y", 1), ["x", "y"]),
    ])


_VOCAB = ["a", "an", "to", "of", "the", "word", "wrap", "line", "greedy", "packing", "paragraph",
          "café", "naïve", "東京", "extraordinarily", "incomprehensibilities", "x", "it's"]


def check_wrap_properties(mod):
    rng = random.Random(20261130)
    for trial in range(30):
        text = " ".join(rng.choice(_VOCAB) for _ in range(rng.randint(1, 60)))
        for width in range(1, 41):
            label = f"wrap(<text {trial}>, {width})"
            lines = mod.wrap(text, width)
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


def check_wrap_edge_cases(mod):
    ok, detail = _all_equal([
        ("wrap('', 10)", lambda: mod.wrap("", 10), []),
        ("wrap(' \\n\\t ', 10)", lambda: mod.wrap(" \n\t ", 10), []),
        ("wrap('word', 1)", lambda: mod.wrap("word", 1), ["word"]),
        ("wrap('a\\tb\\nc', 80)", lambda: mod.wrap("a\tb\nc", 80), ["a b c"]),
    ])
    if not ok:
        return ok, detail
    for width in (0, -3):
        problem = _expect_value_error(f"wrap('a b', {width})", lambda: mod.wrap("a b", width))
        if problem:
            return False, problem
    return True, "blank text, whitespace kinds, tiny and invalid widths"


def check_wrap_unicode(mod):
    return _all_equal([
        ("wrap('café crème brûlée', 10)", lambda: mod.wrap("café crème brûlée", 10),
         ["café crème", "brûlée"]),
        ("wrap('東京 大阪 京都', 5)", lambda: mod.wrap("東京 大阪 京都", 5), ["東京 大阪", "京都"]),
    ])


def check_words_ascii(mod):
    return _all_equal([
        ("words('Hello, World! hello-world 42nd')",
         lambda: mod.words("Hello, World! hello-world 42nd"),
         ["hello", "world", "hello", "world", "42nd"]),
        ("word_counts('The cat and the hat.')", lambda: mod.word_counts("The cat and the hat."),
         {"the": 2, "cat": 1, "and": 1, "hat": 1}),
        ("words('')", lambda: mod.words(""), []),
    ])


def check_words_unicode_letters(mod):
    return _all_equal([
        ("words('Café, CAFÉ und café!')", lambda: mod.words("Café, CAFÉ und café!"),
         ["café", "café", "und", "café"]),
        ("words('Привет, мир! ПРИВЕТ')", lambda: mod.words("Привет, мир! ПРИВЕТ"),
         ["привет", "мир", "привет"]),
        ("words('naïve façade')", lambda: mod.words("naïve façade"), ["naïve", "façade"]),
        ("words('東京 2024')", lambda: mod.words("東京 2024"), ["東京", "2024"]),
    ])


def check_words_casefold(mod):
    return _all_equal([
        ("word_counts('Straße STRASSE strasse')",
         lambda: mod.word_counts("Straße STRASSE strasse"), {"strasse": 3}),
        ("words('MASSE Maße')", lambda: mod.words("MASSE Maße"), ["masse", "masse"]),
    ])


def check_words_separators(mod):
    text = "snake_case rock'n'roll 'quoted' don''t end' tab\tnew\nline"
    return _all_equal([
        (f"words({text!r})", lambda: mod.words(text),
         ["snake", "case", "rock'n'roll", "quoted", "don", "t", "end", "tab", "new", "line"]),
    ])


def check_top_words_ranking(mod):
    text = "b a c b a b d"
    ok, detail = _all_equal([
        ("top_words(text, 2)", lambda: mod.top_words(text, 2), [("b", 3), ("a", 2)]),
        ("top_words(text, 10)", lambda: mod.top_words(text, 10),
         [("b", 3), ("a", 2), ("c", 1), ("d", 1)]),
        ("top_words(text, 0)", lambda: mod.top_words(text, 0), []),
        ("top_words('', 3)", lambda: mod.top_words("", 3), []),
    ])
    if not ok:
        return ok, detail
    problem = _expect_value_error("top_words(text, -1)", lambda: mod.top_words(text, -1))
    return (False, problem) if problem else (True, "order, ties, short lists, n == 0, n < 0")


def check_top_words_unicode(mod):
    return _all_equal([
        ("top_words('Ärger ärger ÄRGER bär Bär', 2)",
         lambda: mod.top_words("Ärger ärger ÄRGER bär Bär", 2), [("ärger", 3), ("bär", 2)]),
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
    with tempfile.TemporaryDirectory(prefix="oracle-bugfix-") as tmp:
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
