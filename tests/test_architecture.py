"""The file's shape, checked from its code: bottom-up definitions, one home per section, a map
that tells the truth, and no `ctx: Any` below the CLI.

Run ``python3 tests/test_architecture.py`` to rewrite the module docstring's section map after
sections move or grow.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "agentbench.py"
BANNER = "# " + "=" * 98
MAP_START = "Sections, strictly bottom-up:"


def sections(text: str) -> list[tuple[str, int, int]]:
    """(title, first line, last line) of every full-width banner's section, in order; a section
    starts at its opening banner and ends on the line before the next one."""
    lines = text.split("\n")
    starts = [(i + 1, lines[i + 1][2:].strip()) for i in range(len(lines) - 2)
              if lines[i] == BANNER and lines[i + 2] == BANNER]
    out = []
    for k, (line, title) in enumerate(starts):
        end = starts[k + 1][0] - 1 if k + 1 < len(starts) else len(lines)
        out.append((title, line, end))
    return out


def section_map(text: str) -> str:
    """The sections' titles, one a line, in file order (titles, not line numbers: a map that every
    commit would rewrite is a map nobody trusts)."""
    return "\n".join(f"    {t}" for t, _, _ in sections(text))


def top_level_names(tree: ast.Module) -> dict[str, int]:
    defined: dict[str, int] = {}
    for node in tree.body:
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        for n in names:
            defined.setdefault(n, node.lineno)
    return defined


def _bound_inside(node: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            out.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            out.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in n.names)
    return out


def _loads_outside_annotations(node: ast.AST) -> list[ast.Name]:
    skip: set[int] = set()
    for n in ast.walk(node):
        ann = []
        if isinstance(n, ast.arg) and n.annotation:
            ann.append(n.annotation)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns:
            ann.append(n.returns)
        if isinstance(n, ast.AnnAssign):
            ann.append(n.annotation)
        for a in ann:
            skip.update(id(x) for x in ast.walk(a))
    return [n for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in skip]


def forward_uses(text: str) -> list[tuple[int, str, str, int]]:
    """(line, definition, name it uses, where that name is defined) for every top-level definition
    that uses a module-level name defined further down (annotations, being strings, do not count)."""
    tree = ast.parse(text)
    defined = top_level_names(tree)
    bad = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                                 ast.AnnAssign)):
            continue
        own = {getattr(node, "name", "")}
        local = (_bound_inside(node)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else set())
        for use in _loads_outside_annotations(node):
            at = defined.get(use.id)
            if at and at > node.lineno and use.id not in own and use.id not in local:
                bad.append((node.lineno, getattr(node, "name", "<assignment>"), use.id, at))
    return sorted(set(bad))


def test_no_definition_uses_a_later_one():
    assert forward_uses(SOURCE.read_text(encoding="utf-8")) == []


def test_the_checker_catches_a_forward_use():
    src = "def a():\n    return b()\n\n\ndef b():\n    return 1\n\n\ndef c():\n    b = 2\n    return b\n"
    assert forward_uses(src) == [(1, "a", "b", 5)]


def test_nothing_below_the_cli_takes_an_untyped_ctx():
    text = SOURCE.read_text(encoding="utf-8")
    cli = next(line for title, line, _ in sections(text) if title.startswith("The CLI"))
    offenders = [i + 1 for i, line in enumerate(text.split("\n")[:cli])
                 if re.search(r"\bctx: Any\b", line)]
    assert offenders == []


def _section_of(secs: list[tuple[str, int, int]], line: int) -> str:
    return next((t for t, a, b in secs if a <= line <= b), "")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(text: str) -> list[tuple[int, str, str, str]]:
    """(line, private name, its section, the section using it) for every use of a module-level
    `_name`, or of a class's `_member` through something other than `self`/`cls`, from a section
    other than the one that defines it."""
    tree = ast.parse(text)
    secs = sections(text)
    defined = {n: _section_of(secs, line) for n, line in top_level_names(tree).items() if _private(n)}
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        home = _section_of(secs, node.lineno)
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(n.name):
                members.setdefault(n.name, set()).add(home)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _private(n.attr):
                members.setdefault(n.attr, set()).add(home)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name) and _private(t.id):
                        members.setdefault(t.id, set()).add(home)
    bad = []
    for node in tree.body:
        here = _section_of(secs, node.lineno)
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id in defined and defined[n.id] != here:
                bad.append((n.lineno, n.id, defined[n.id], here))
            elif (isinstance(n, ast.Attribute) and _private(n.attr) and n.attr in members
                  and here not in members[n.attr]
                  and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
                bad.append((n.lineno, "." + n.attr, "/".join(sorted(members[n.attr])), here))
    return sorted(set(bad))


def test_no_section_reaches_into_another_sections_private_names():
    bad = private_reaches(SOURCE.read_text(encoding="utf-8"))
    assert bad == [], "give these a public name or move them home: " + "; ".join(
        f"line {line}: {name} of {home!r} used in {used!r}" for line, name, home, used in bad)


def test_the_checker_catches_a_private_reach():
    banner = "# " + "=" * 98
    src = "\n".join([banner, "# A", banner, "# owns a", "# and so on", "def _helper():", "    return 1",
                     "class K:", "    def _inner(self):", "        return self._inner", "",
                     banner, "# B", banner, "# owns b", "# and so on",
                     "def user(k):", "    return _helper() + k._inner()", ""])
    assert [(name, home, used) for _, name, home, used in private_reaches(src)] == [
        ("._inner", "A", "B"), ("_helper", "A", "B")]


def test_the_module_docstring_maps_every_section_by_title():
    text = SOURCE.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(text), clean=False) or ""
    assert MAP_START in doc, "the module docstring has no section map"
    got = doc.split(MAP_START, 1)[1].strip("\n").split("\n\n")[0].rstrip()
    assert got == section_map(text), "run `python3 tests/test_architecture.py` to rewrite the map"


def test_every_section_banner_says_what_it_owns():
    text = SOURCE.read_text(encoding="utf-8")
    lines = text.split("\n")
    for title, line, _ in sections(text):
        below = lines[line + 2:line + 4]   # the two lines after the closing banner
        assert all(b.startswith("# ") and len(b) > 10 for b in below), f"section {title!r} has no description"


#: No line of agentbench.py, from its first line to its last, is longer than this.
MAX_LINE = 110
#: How a line above the first banner (the script header, the module docstring) is named.
HEAD_TITLE = "(the file's head)"


def long_lines(text: str, limit: int = MAX_LINE) -> list[str]:
    """'<section> line <n>: <length> characters' for every line of `text` over `limit`, named by
    the section it is in (HEAD_TITLE above the first banner)."""
    lines = text.split("\n")
    titles = [HEAD_TITLE] * len(lines)
    for title, first, last in sections(text):
        titles[first - 1:last] = [title] * (last - first + 1)
    return [f"{titles[n - 1]} line {n}: {len(line)} characters"
            for n, line in enumerate(lines, start=1) if len(line) > limit]


def test_no_line_of_the_file_is_over_110_characters():
    too_long = long_lines(SOURCE.read_text(encoding="utf-8"))
    assert too_long == [], "wrap these lines:\n" + "\n".join(too_long)


def test_the_line_checker_names_the_section_and_line():
    src = "\n".join([BANNER, "# Alpha", BANNER, "# owns a", "x = 1", "y = '" + "z" * 120 + "'",
                     BANNER, "# Beta", BANNER, "# owns b", "w = '" + "z" * 120 + "'"])
    assert long_lines(src) == ["Alpha line 6: 126 characters", "Beta line 11: 126 characters"]
    assert long_lines(src, limit=126) == []
    headed = "\n".join(["# " + "d" * 112, "x = 1", src])
    assert long_lines(headed) == [f"{HEAD_TITLE} line 1: 114 characters",
                                  "Alpha line 8: 126 characters", "Beta line 13: 126 characters"]


def test_no_top_level_name_is_defined_twice():
    """A second definition silently replaces the first (two branches each adding a helper of the
    same name merge without a conflict): every top-level function and class has one home."""
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    twice = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{node.name} (lines {seen[node.name]} and {node.lineno})")
            seen.setdefault(node.name, node.lineno)
    assert twice == [], "defined twice: " + "; ".join(twice)


def rewrite_map() -> None:
    text = SOURCE.read_text(encoding="utf-8")
    head, rest = text.split(MAP_START, 1)
    body, tail = rest.lstrip("\n").split("\n\n", 1)
    body = section_map(text)
    SOURCE.write_text(head + MAP_START + "\n" + body + "\n\n" + tail, encoding="utf-8")


if __name__ == "__main__":
    rewrite_map()
    sys.exit(0)
