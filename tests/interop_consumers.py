"""The real consumers of agentbench's interop files, from the throwaway venv that .ci/run makes
(AGENTBENCH_INTEROP_VENV): inspect-ai's reader and viewer, harbor's ATIF trajectory validator.
Where the venv is missing the tests that need it skip with the reason; under CI they fail."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


def interop_venv() -> Path:
    """The venv's directory, checked usable; skip (fail under CI) with the reason when it is not."""
    raw = os.environ.get("AGENTBENCH_INTEROP_VENV")
    reason = None
    if not raw:
        reason = "AGENTBENCH_INTEROP_VENV is not set (.ci/run makes the interop venv and sets it)"
    else:
        venv = Path(raw)
        if not (venv / "bin" / "python").is_file():
            reason = f"no interpreter in the interop venv {venv}"
        elif not (venv / "harbor" / "harbor" / "utils" / "trajectory_validator.py").is_file():
            reason = f"the harbor wheel is not unpacked under {venv}/harbor"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return Path(raw)


def run_in_venv(venv: Path, code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(venv / "harbor")
    return subprocess.run([str(venv / "bin" / "python"), "-c", code, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


READ_LOGS = """
import json, sys
from inspect_ai.log import read_eval_log, list_eval_logs
out = []
for path in sys.argv[1:]:
    log = read_eval_log(path)
    out.append({"path": path, "status": log.status, "task": log.eval.task, "solver": log.eval.solver,
                "metadata": log.eval.metadata, "version": log.version,
                "cost": sum(u.total_cost or 0 for u in log.stats.model_usage.values()),
                "results": {s.name: {k: m.value for k, m in s.metrics.items()} for s in log.results.scores},
                "samples": [{"id": s.id, "epoch": s.epoch, "scores": {k: v.value for k, v in s.scores.items()},
                             "messages": len(s.messages), "roles": [m.role for m in s.messages],
                             "prompt_roles": [(m.metadata or {}).get("agentbench_role") for m in s.messages
                                              if m.role == "user"],
                             "metadata": s.metadata,
                             "cost": sum(u.total_cost or 0 for u in s.model_usage.values())}
                            for s in log.samples]})
print(json.dumps(out))
"""


def read_inspect_logs(venv: Path, paths: list[str]) -> list[dict]:
    proc = run_in_venv(venv, READ_LOGS, *paths)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


VALIDATE = """
import json, sys
from pathlib import Path
from harbor.utils.trajectory_validator import TrajectoryValidator
bad = {}
for path in sys.argv[1:]:
    v = TrajectoryValidator()
    if not v.validate(Path(path)):
        bad[path] = v.get_errors()
print(json.dumps(bad))
"""


def invalid_trajectories(venv: Path, paths: list[str]) -> dict:
    """path -> harbor's errors, for every trajectory the validator refuses (empty: all valid)."""
    proc = run_in_venv(venv, VALIDATE, *paths)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def validator_cli(venv: Path, path: str) -> subprocess.CompletedProcess:
    """`python -m harbor.utils.trajectory_validator FILE`, as a user runs it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(venv / "harbor")
    return subprocess.run([str(venv / "bin" / "python"), "-m", "harbor.utils.trajectory_validator", path],
                          capture_output=True, text=True, env=env, timeout=120)
