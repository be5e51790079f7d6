"""Errors and output: one error type with a machine-readable code, one boundary that prints."""
from __future__ import annotations

import ast
import re

import pytest

from conftest import AGENTBENCH, ab, run_main

CODE_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def _raises_of_the_error_type() -> list[ast.Call]:
    """Every construction of the error type (raised at once or returned to be raised)."""
    tree = ast.parse(AGENTBENCH.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "AgentbenchError"]


def test_every_refusal_in_the_source_names_its_code():
    calls = _raises_of_the_error_type()
    assert len(calls) > 100
    missing = [c.lineno for c in calls if not any(k.arg == "code" for k in c.keywords)]
    assert missing == [], f"AgentbenchError(...) without code= at lines {missing}"
    # A refusal builder passes its `code` parameter on; every call of the builder names a constant.
    builders = {"_arm_refusal": 3}
    tree = ast.parse(AGENTBENCH.read_text(encoding="utf-8"))
    inside = {n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in builders
              for n in ast.walk(f) if isinstance(n, ast.Call)}
    for c in calls:
        code = next(k.value for k in c.keywords if k.arg == "code")
        if c.lineno in inside and isinstance(code, ast.Name) and code.id == "code":
            continue
        assert isinstance(code, ast.Constant) and CODE_RE.match(code.value), c.lineno
    # A factory of checks (`_arm_one_of`) passes on the code its caller names, a constant.
    factories = {"_arm_one_of": 1}
    passed_on = {n.lineno for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in factories
                 for n in ast.walk(f) if isinstance(n, ast.Call)}
    positions = {**builders, **factories}
    built = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) in positions]
    assert built and any(c.func.id in factories for c in built)
    for c in built:
        pos = positions[c.func.id]
        code = c.args[pos] if len(c.args) > pos else next(k.value for k in c.keywords if k.arg == "code")
        if c.lineno in passed_on and isinstance(code, ast.Name) and code.id == "code":
            continue
        choices = [code.body, code.orelse] if isinstance(code, ast.IfExp) else [code]
        assert all(isinstance(x, ast.Constant) and CODE_RE.match(x.value) for x in choices), c.lineno


def test_the_code_is_in_the_payload_and_the_one_line_form_leaves_it_out():
    exc = ab.AgentbenchError("no such run", code="no_such_run", run="r1", hint="see list")
    assert exc.code == "no_such_run" and exc.exit_code == 2
    assert exc.payload == {"error": "no such run", "code": "no_such_run", "run": "r1", "hint": "see list"}
    assert exc.one_line() == 'no such run {"hint": "see list", "run": "r1"}'


@pytest.mark.parametrize("argv, code", [
    (["nope"], "unknown_command"),
    (["init", "--study", "{tmp}/s", "--parallel", "abc"], "bad_arguments"),
    (["list", "--study", "{tmp}/missing"], "not_a_study"),
])
def test_refusals_answer_one_object_with_their_code(tmp_path, argv, code):
    rc, out = run_main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert rc == 2 and out["code"] == code and out["error"]


def test_a_bug_becomes_an_internal_error_with_its_own_code(monkeypatch, tmp_path):
    def boom(argv, ctx):
        raise ZeroDivisionError("boom")
    monkeypatch.setattr(ab, "dispatch", boom)
    rc, out = run_main(["where"])
    assert rc == 2 and out["code"] == "internal_error" and out["type"] == "ZeroDivisionError"
