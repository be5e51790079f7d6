"""Shared fixtures: the product module, in-process and subprocess runners, fake and real `claude`.

Two tiers of tests use these: in-process calls of ``main([...])`` with the JSON parsed, and real
processes (``python3 agentbench.py ...``, detached supervisors, the real `claude` binary).
"""
from __future__ import annotations

import contextlib
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
# Appended, not prepended: a PYTHONPATH entry given on purpose still wins.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import agentbench as ab  # noqa: E402

FAKE_CLAUDE = TESTS / "fake_claude.py"
AGENTBENCH = ROOT / "agentbench.py"


def pytest_configure(config: pytest.Config) -> None:
    """Run the whole session with a scratch, empty HOME.

    The real `claude` snapshots a login shell when a session starts, so the developer's dotfiles
    would run inside every end-to-end test: slow ones (a version manager's start-up hook waiting
    on its own lock) make the suite crawl, and a test that kills a session mid-snapshot could leave
    that hook's lock behind on the developer's machine.  Nothing in the product reads HOME except
    through `claude`; git identities are passed explicitly.
    """
    home = tempfile.mkdtemp(prefix="agentbench-tests-home-")
    config._agentbench_home = (os.environ.get("HOME"), home)  # type: ignore[attr-defined]
    os.environ["HOME"] = home


def pytest_unconfigure(config: pytest.Config) -> None:
    saved = getattr(config, "_agentbench_home", None)
    if saved is None:
        return
    old, home = saved
    if old is None:
        os.environ.pop("HOME", None)
    else:
        os.environ["HOME"] = old
    shutil.rmtree(home, ignore_errors=True)


def run_main(args: list[str], env: dict[str, str] | None = None) -> tuple[int, dict]:
    """Call main() in-process; return (exit code, the one JSON object it printed)."""
    out = io.StringIO()
    old_env = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out):
            code = ab.main(args)
    finally:
        if env is not None:
            os.environ.clear()
            os.environ.update(old_env)
    text = out.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line on stdout, got: {text!r}"
    return code, json.loads(lines[0])


def init_real_study(root: Path, real_claude: str, server_url: str, config_dir: Path, monkeypatch,
                    *extra: str, parallel: int = 4, offline: bool = True) -> None:
    """`init` a study whose sessions run the real binary against a scripted model at `server_url`
    (offline: a dummy key and the offline marker; else the caller's key is carried upstream), with
    the caller's environment made fit for it.  `extra`: more init flags."""
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    monkeypatch.delenv("AGENTBENCH_CHILD", raising=False)
    monkeypatch.setenv("AGENTBENCH_HEARTBEAT_S", "0.5")
    env = ["--env", f"ANTHROPIC_BASE_URL={server_url}"]
    if offline:
        env += ["--env", "ANTHROPIC_API_KEY=offline-test-key"]
    env += ["--env", f"CLAUDE_CONFIG_DIR={config_dir}", "--env", "CLAUDE_CODE_MAX_RETRIES=0"]
    if offline:
        env += ["--env", "AGENTBENCH_OFFLINE=1"]
    code, obj = run_main(["init", "--study", str(root), "--binary", real_claude, "--parallel", str(parallel),
                          *env, *extra])
    assert code == 0, obj


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 120,
            cwd: str | None = None) -> tuple[int, dict, str]:
    """Run `python3 agentbench.py ...` as a real process; return (code, object, stderr)."""
    proc = subprocess.run([sys.executable, str(AGENTBENCH), *args], capture_output=True, text=True,
                          env=env if env is not None else os.environ.copy(), timeout=timeout, cwd=cwd)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line, got stdout={proc.stdout!r} stderr={proc.stderr[-2000:]!r}"
    return proc.returncode, json.loads(lines[0]), proc.stderr


def real_claude_binary() -> str | None:
    """The real `claude` for end-to-end tests: $AGENTBENCH_REAL_CLAUDE, PATH, or the local install."""
    for cand in (os.environ.get("AGENTBENCH_REAL_CLAUDE"), shutil.which("claude"),
                 str(ab.local_claude_path())):
        if cand and os.path.isfile(cand):
            return cand
    return None


@pytest.fixture(scope="session")
def real_claude() -> str:
    """The real binary; skipped locally when absent, but a failure in CI (CI must install it)."""
    binary = real_claude_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("the real claude binary is not installed; .ci/run must install it")
        pytest.skip("the real claude binary is not installed (npm i -g @anthropic-ai/claude-code)")
    return binary


def chromium_layout(page: Path, script: str, tmp_path: Path, *, height: int) -> Any:
    """A headless Chromium 1280 px wide: a screenshot of `page` (checked to exist), then `page` laid
    out again with `script`, JavaScript that leaves a JSON value in `document.title`; that value.
    Skipped where no Chromium is installed (.ci/run installs it)."""
    chromium = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             f"--window-size=1280,{height}", f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "screenshot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=180)
    assert shot.exists() and shot.stat().st_size > 1000
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", f"<script>{script}</script></body>"),
                     encoding="utf-8")
    proc = subprocess.run([chromium, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True,
                          timeout=180)
    title = re.search(r"<title>(.*?)</title>", proc.stdout, re.S)
    assert title, proc.stderr[-2000:]
    return json.loads(html.unescape(title.group(1)))


@pytest.fixture(scope="session")
def demo_answer(tmp_path_factory, real_claude):
    """The README's first command, run once for the whole session in a user's shell (no study, no
    credential, not offline): `demo --repeats 1`, as (exit code, answer, stderr).  The demo's own
    test and the report's screenshot test read the same demo; neither changes it."""
    dropped = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN", "ANTHROPIC_BASE_URL",
               "AGENTBENCH_STUDY", "AGENTBENCH_CHILD", "AGENTBENCH_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["AGENTBENCH_CLAUDE_BIN"] = real_claude
    where = tmp_path_factory.mktemp("demo") / "demo"
    return run_cli(["demo", "--dir", str(where), "--repeats", "1"], env=env, timeout=900)


@pytest.fixture(scope="session")
def real_slurm(tmp_path_factory):
    """A private one-node Slurm cluster (tests/slurm_cluster.py) for the whole session; skipped
    locally where Slurm cannot run, but a failure in CI (.ci/run installs slurm-wlm and munge)."""
    from slurm_cluster import PrivateSlurmCluster, slurm_available
    reason = slurm_available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install slurm-wlm and munge; see .ci/run ({reason})")
        pytest.skip(reason)
    with PrivateSlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def fake_env(tmp_path, monkeypatch) -> dict[str, str]:
    """An environment whose `claude` is the fake, with its transcripts in a temp config dir."""
    env = os.environ.copy()
    env.pop("AGENTBENCH_STUDY", None)
    env.pop("AGENTBENCH_CHILD", None)
    env["AGENTBENCH_CLAUDE_BIN"] = str(FAKE_CLAUDE)
    env["CLAUDE_CONFIG_DIR"] = str(tmp_path / "claude-config")
    env["AGENTBENCH_HEARTBEAT_S"] = "0.5"
    # The fake's test hooks (its log, pid files of the children it leaves) live outside its
    # workspace and its pids are compared with the host's: fake-binary tests run unsandboxed.
    # The real binary's tests keep the default (auto: bubblewrap where it runs).
    env["AGENTBENCH_SANDBOX_DEFAULT"] = "none"
    # The fake reaches no model API: launches need no credential and `run` asks no upstream.
    env["AGENTBENCH_OFFLINE"] = "1"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AGENTBENCH_STUDY", raising=False)
    monkeypatch.delenv("AGENTBENCH_CHILD", raising=False)
    return env


@pytest.fixture
def study(tmp_path, fake_env) -> Path:
    """A bare study (launch config only) that uses the fake claude."""
    root = tmp_path / "study"
    code, obj = run_main(["init", "--study", str(root), "--parallel", "4"])
    assert code == 0, obj
    return root


def write_brief(tmp_path: Path, text: str, name: str | None = None) -> str:
    p = tmp_path / (name or f"brief-{time.monotonic_ns()}.txt")
    p.write_text(text, encoding="utf-8")
    return str(p)


def wait_result(study: Path, job_id: str, timeout: float = 30) -> dict:
    """Poll a job's result file (without delivering it through `wait`)."""
    path = study / "state" / "jobs" / job_id / "result.json"
    active = study / "state" / "active" / job_id
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Final = the result exists and finalisation completed (ledger line, markers).
        if path.exists() and not active.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout}s")


def ledger(study: Path) -> list[dict]:
    p = study / "state" / "ledger.jsonl"
    if not p.exists():
        return []
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


@pytest.fixture
def server():
    """A scripted model on loopback for one test (scripts added with server.add_script)."""
    srv = ab.ScriptedModelServer()
    srv.start()
    yield srv
    srv.stop()
