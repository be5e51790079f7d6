"""The defaults a user relies on: each has one home (a named constant) and is the value used."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ab


def _task_without_limits(root: Path) -> Path:
    """A task whose gate and oracle give no timeout_s and whose oracle gives no threshold."""
    t = root / "plain"
    for sub in ("public", "gate", "oracle", "reference"):
        (t / sub).mkdir(parents=True)
    (t / "public" / "TASK.md").write_text("Nothing to do.\n")
    (t / "reference" / "DONE.md").write_text("done\n")
    (t / "gate" / "ok.py").write_text("print('ok')\n")
    (t / "oracle" / "ok.py").write_text("print('ok')\n")
    (t / "task.json").write_text(json.dumps({
        "id": "plain", "title": "plain",
        "gate": {"cmd": ["{python}", "{gate}/ok.py"]},
        "oracle": {"cmd": ["{python}", "{oracle}/ok.py"]}}))
    return t


@pytest.mark.parametrize("which, expected", [("gate", ab.DEFAULT_GATE_TIMEOUT_S),
                                             ("oracle", ab.DEFAULT_ORACLE_TIMEOUT_S)])
def test_a_check_without_timeout_runs_with_the_default_it_was_validated_against(tmp_path, monkeypatch,
                                                                                which, expected):
    task = ab.load_task(_task_without_limits(tmp_path / "tasks"))
    seen: list[float] = []
    real = ab.run_command

    def spy(argv, **kw):
        seen.append(kw["timeout_s"])
        return real(argv, **kw)

    monkeypatch.setattr(ab, "run_command", spy)
    ws = tmp_path / "ws"
    ws.mkdir()
    rec = ab.run_check(ab.StudyPaths(tmp_path / "study"), ab.select_platform(), task, which, str(ws),
                       {"PATH": "/usr/bin:/bin"})
    assert rec["passed"] is True
    assert seen == [expected]
    assert ab.check_default_timeout_s(which) == expected


def test_the_oracle_timeout_default_is_the_documented_300_s():
    assert ab.DEFAULT_ORACLE_TIMEOUT_S == 300.0 and ab.DEFAULT_GATE_TIMEOUT_S == 120.0


def test_an_oracle_without_threshold_uses_the_default_pass_mark(tmp_path):
    task = ab.load_task(_task_without_limits(tmp_path / "tasks"))
    assert task.threshold == ab.DEFAULT_ORACLE_THRESHOLD == 0.9
