"""Performance mechanics (issue 13), tested for behaviour, never for timings: lazy imports, the
cached-bytecode launcher, the running cost estimate, the exact tails by recurrence, paging."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import agentbench as ab
from conftest import AGENTBENCH


def wait_for(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# ---- start-up ------------------------------------------------------------------------------------

def test_lazy_modules_load_on_first_use_and_keep_their_names() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import agentbench as ab; "
            "print(int('difflib' in sys.modules and type(sys.modules['difflib']).__name__ == '_LazyModule')); "
            "print(ab.difflib.get_close_matches('wrkspace', ['workspace'])[0]); "
            "print(ab.http.server.BaseHTTPRequestHandler.__name__, ab.urllib.parse.quote('a b')); "
            "print(ab.statistics.NormalDist().cdf(0.0), ab.html.escape('<'), ab.pyplatform.system() != '')")
    out = subprocess.run([sys.executable, "-c", code, str(AGENTBENCH.parent)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.splitlines()
    assert out == ["1", "workspace", "BaseHTTPRequestHandler a%20b", "0.5 &lt; True"]


def test_lazy_module_returns_a_module_imported_already() -> None:
    assert ab.lazy_module("json") is json


def test_the_launcher_imports_the_file_as_a_module_and_caches_its_bytecode(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}   # agentbench's own cache is kept anyway
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), str(cache), ["--version"])
    for _ in range(2):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["version"] == ab.VERSION
    assert [p.name for p in cache.rglob("*.pyc")] == [f"agentbench.{sys.implementation.cache_tag}.pyc"]


def test_the_launcher_falls_back_to_compiling_when_the_cache_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), str(blocker / "cache"), ["--version"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["version"] == ab.VERSION
    argv = ab.launcher_argv(sys.executable, str(AGENTBENCH.resolve()), None, ["no-such-command"])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and "error" in json.loads(res.stdout)


def test_the_bytecode_cache_lives_in_the_study_state_and_only_there(tmp_path: Path) -> None:
    assert ab.bytecode_cache_dir(str(tmp_path)) is None              # not a study: no cache dir made
    assert not (tmp_path / ab.STATE_DIR).exists()
    (tmp_path / ab.STATE_DIR).mkdir()
    got = ab.bytecode_cache_dir(str(tmp_path))
    assert got == str(tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR) and Path(got).is_dir()
    (tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR).rmdir()
    (tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR).write_text("in the way")
    assert ab.bytecode_cache_dir(str(tmp_path)) is None


def test_a_detached_child_runs_from_the_study_bytecode_cache(tmp_path: Path) -> None:
    (tmp_path / ab.STATE_DIR).mkdir()
    log = tmp_path / "child.log"
    pid = ab.detach_agentbench(ab.current_platform(), ["--version"], cwd=str(tmp_path),
                               env=dict(os.environ), log_path=str(log))
    assert pid > 0
    wait_for(lambda: log.exists() and log.read_text().strip().endswith("}"))
    assert json.loads(log.read_text().strip().splitlines()[-1])["version"] == ab.VERSION
    cache = tmp_path / ab.STATE_DIR / ab.BYTECODE_CACHE_DIR
    wait_for(lambda: any(cache.rglob("agentbench.*.pyc")))
