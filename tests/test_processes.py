"""Tests of the processes section: helper commands with a tree-killing timeout, locating the
`claude` binary, and reading its version.

Helper commands (gate, oracle, git) may leave processes behind; a timeout must kill all of them,
not only the direct child, or a wedged check would hold the study's resources forever.  The
binary search order is a contract users rely on (an explicit configuration beats the environment,
which beats PATH, which beats the local install), so it is checked with fake executables on a
controlled PATH.
"""
from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

import pytest

import agentbench as ab
from conftest import pid_alive

pytestmark = pytest.mark.skipif(os.name != "posix", reason="uses /proc and POSIX sessions")

PLATFORM = ab.current_platform()


def wait_until(cond, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout}s")


def make_exe(path: Path, body: str) -> Path:
    """An executable shell script at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# ---- run_command ----------------------------------------------------------------------------------

SPAWNER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
open(sys.argv[1], "w").write(str(child.pid))
print("spawned", flush=True)
time.sleep(120)
"""


def test_timeout_kills_the_whole_tree(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    res = ab.run_command([sys.executable, "-c", SPAWNER, str(pidfile)], cwd=tmp_path, env=os.environ,
                         timeout_s=15.0, platform=PLATFORM)
    assert res.timed_out is True
    assert res.returncode is None
    # Output captured up to the kill is kept.  (The timeout leaves the spawner ample time to
    # start its grandchild first, even on a loaded machine.)
    assert "spawned" in res.stdout
    grandchild = int(pidfile.read_text())
    try:
        # The grandchild held no pipe of ours, so only the tree kill can have stopped it.
        wait_until(lambda: not pid_alive(grandchild), timeout=10, what="grandchild death")
    finally:
        if pid_alive(grandchild):
            os.kill(grandchild, 9)


def test_command_result_fields(tmp_path: Path) -> None:
    code = ("import os, sys; data = sys.stdin.read(); print('out:' + data); "
            "print('cwd:' + os.getcwd()); print('err-line', file=sys.stderr); "
            "print('env:' + os.environ.get('PROBE', '')); sys.exit(3)")
    argv = [sys.executable, "-c", code]
    res = ab.run_command(argv, cwd=tmp_path, env={**os.environ, "PROBE": "yes"}, timeout_s=60,
                         platform=PLATFORM, stdin_text="hello")
    assert isinstance(res, ab.CommandResult)
    assert res.argv == argv
    assert res.returncode == 3
    assert res.timed_out is False
    assert "out:hello" in res.stdout
    assert f"cwd:{tmp_path}" in res.stdout or f"cwd:{os.path.realpath(tmp_path)}" in res.stdout
    assert "env:yes" in res.stdout
    assert res.stderr.strip() == "err-line"
    assert isinstance(res.wall_s, float) and res.wall_s >= 0


def test_without_stdin_text_the_command_reads_eof(tmp_path: Path) -> None:
    # A helper must never wait on our terminal: stdin is /dev/null.
    res = ab.run_command([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"],
                         cwd=tmp_path, env=os.environ, timeout_s=60, platform=PLATFORM)
    assert res.returncode == 0 and res.stdout.strip() == "''"


def test_undecodable_output_is_replaced_not_fatal(tmp_path: Path) -> None:
    res = ab.run_command([sys.executable, "-c", "import sys; sys.stdout.buffer.write(b'a\\xffb')"],
                         cwd=tmp_path, env=os.environ, timeout_s=60, platform=PLATFORM)
    assert res.returncode == 0
    assert res.stdout == "a\ufffdb"


def test_a_command_that_cannot_start_is_reported_not_raised(tmp_path: Path) -> None:
    res = ab.run_command([str(tmp_path / "no-such-program")], cwd=tmp_path, env=os.environ,
                         timeout_s=10, platform=PLATFORM)
    assert res.returncode == 127
    assert res.timed_out is False
    assert "cannot start" in res.stderr


# ---- find_claude_binary -----------------------------------------------------------------------------

@pytest.fixture
def bins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Four different fake `claude` executables, one per place the search looks, and no local
    install unless a test says so."""
    out = {
        "config": make_exe(tmp_path / "cfg" / "claude-configured", "echo 1.0.0"),
        "env": make_exe(tmp_path / "envbin" / "claude-from-env", "echo 2.0.0"),
        "path": make_exe(tmp_path / "pathdir" / "claude", "echo 3.0.0"),
        "local": make_exe(tmp_path / "local" / "node_modules" / ".bin" / "claude", "echo 4.0.0"),
    }
    monkeypatch.setattr(ab, "local_claude_path", lambda: tmp_path / "no-local-install" / "claude")
    return out


def test_configured_binary_wins_over_everything(bins: dict[str, Path], monkeypatch) -> None:
    monkeypatch.setattr(ab, "local_claude_path", lambda: bins["local"])
    env = {"AGENTBENCH_CLAUDE_BIN": str(bins["env"]), "PATH": str(bins["path"].parent)}
    assert ab.find_claude_binary(str(bins["config"]), env) == (str(bins["config"]), "study config")


def test_env_beats_path(bins: dict[str, Path]) -> None:
    env = {"AGENTBENCH_CLAUDE_BIN": str(bins["env"]), "PATH": str(bins["path"].parent)}
    assert ab.find_claude_binary(None, env) == (str(bins["env"]), "AGENTBENCH_CLAUDE_BIN")


def test_path_is_searched_with_the_given_environment(bins: dict[str, Path], tmp_path: Path) -> None:
    # A non-executable `claude` earlier on PATH is skipped, as a shell would skip it.
    shadow = tmp_path / "shadow" / "claude"
    shadow.parent.mkdir()
    shadow.write_text("not executable\n")
    env = {"PATH": os.pathsep.join([str(shadow.parent), str(bins["path"].parent)])}
    assert ab.find_claude_binary(None, env) == (str(bins["path"]), "PATH")


def test_local_install_is_the_last_resort(bins: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"PATH": str(empty)}
    assert ab.find_claude_binary(None, env) == (None, "not found")
    monkeypatch.setattr(ab, "local_claude_path", lambda: bins["local"])
    assert ab.find_claude_binary(None, env) == (str(bins["local"]), "local install")


def test_a_configured_binary_that_is_missing_is_not_replaced_silently(bins: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    # The study named its binary: falling back to another one would measure a different program.
    env = {"AGENTBENCH_CLAUDE_BIN": str(bins["env"]), "PATH": str(bins["path"].parent)}
    path, how = ab.find_claude_binary(str(tmp_path / "gone" / "claude"), env)
    assert path is None and how == "study config"


# ---- claude_version ---------------------------------------------------------------------------------

def test_claude_version_reads_the_first_token(tmp_path: Path) -> None:
    exe = make_exe(tmp_path / "claude", 'if [ "$1" = "--version" ]; then echo "1.2.3 (Claude Code)"; '
                                        'else exit 9; fi')
    assert ab.claude_version(str(exe), PLATFORM) == "1.2.3"


def test_claude_version_of_a_failing_binary_is_none(tmp_path: Path) -> None:
    bad = make_exe(tmp_path / "claude-bad", 'echo "9.9.9 (Claude Code)"; exit 1')
    silent = make_exe(tmp_path / "claude-silent", "exit 0")
    assert ab.claude_version(str(bad), PLATFORM) is None
    assert ab.claude_version(str(silent), PLATFORM) is None


def test_claude_version_of_the_fake(fake_env: dict[str, str]) -> None:
    # The test double answers --version like the real binary ("<version> (Claude Code)").
    fake = fake_env["AGENTBENCH_CLAUDE_BIN"]
    assert ab.claude_version(fake, PLATFORM) == "0.0.0-fake"


def test_an_endless_writer_is_stopped_at_the_output_cap_and_its_tail_kept(tmp_path, monkeypatch):
    import sys as _sys
    monkeypatch.setattr(ab, "OUTPUT_CAP_BYTES", 1 << 20)
    res = ab.run_command([_sys.executable, "-c", "import sys\nwhile True: sys.stdout.write('x' * 4096 + '\\n')"],
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout_s=120, platform=ab.current_platform())
    assert res.output_capped is True and res.timed_out is False
    assert res.returncode is not None and res.returncode != 0
    assert 0 < len(res.stdout) <= ab.OUTPUT_TAIL_BYTES and res.stdout.rstrip("\n").endswith("x")
    assert "output passed" in res.stderr


def test_a_command_that_finishes_keeps_all_its_output_and_reads_its_stdin(tmp_path):
    import sys as _sys
    res = ab.run_command([_sys.executable, "-c", "import sys; print(sys.stdin.read().upper())"],
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, timeout_s=60, platform=ab.current_platform(),
                         stdin_text="hello")
    assert (res.returncode, res.stdout, res.output_capped) == (0, "HELLO\n", False)
