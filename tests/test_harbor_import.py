"""import-tasks --from harbor: the Dockerfile and task.toml read as tables (what carries over,
what is listed as lost), refusals by name with nothing written, the bundle's shape, and (with
bubblewrap) calibration of the three Harbor-format tasks in tests/harbor_tasks: a Python fix and a
CLI calibrate, the one whose image installs a package this host lacks fails with the reason."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ab, run_main

HARBOR = Path(__file__).parent / "harbor_tasks"
GOOD = ("fix-mean", "word-freq-cli")
NEEDS_IMAGE = "figlet-banner"


@pytest.mark.parametrize("dockerfile, files, workdir, starter, lost_words", [
    ("FROM python:3.12\nWORKDIR /app\nCOPY app/ /app/\n", ["Dockerfile", "app/a.py", "app/d/b.txt"], None,
     {"app/a.py": "a.py", "app/d/b.txt": "d/b.txt"}, ["python:3.12"]),
    ("FROM x\nWORKDIR /srv/w\nCOPY one.py ./\nCOPY two.py /srv/w/renamed.py\nCOPY three.py /etc/x\n",
     ["Dockerfile", "one.py", "two.py", "three.py"], None,
     {"one.py": "one.py", "two.py": "renamed.py"}, ["outside the workdir"]),
    ("FROM x\nRUN apt-get install -y \\\n    jq\nENV A=1\nCOPY --from=build /out /app\nCOPY . /app\n",
     ["Dockerfile", "m.py", ".dockerignore"], None, {"m.py": "m.py"},
     ["RUN apt-get install -y jq", "ENV A=1", "another image"]),
    ("FROM x\nWORKDIR /code\n", ["Dockerfile", "data.csv"], "/app", {"data.csv": "data.csv"}, []),
    (None, ["data/x.txt"], None, {"data/x.txt": "data/x.txt"}, []),
    ("FROM x\nWORKDIR /app\nCOPY *.py /app/\nCOPY missing.txt /app/\n", ["a.py", "b.py", "c.txt"], None,
     {"a.py": "a.py", "b.py": "b.py"}, ["missing.txt"]),
])
def test_environment_plan(dockerfile, files, workdir, starter, lost_words):
    plan = ab.harbor_environment_plan(dockerfile, files, workdir)
    assert plan["files"] == starter
    lost = " | ".join(plan["not_carried_over"])
    for word in lost_words:
        assert word in lost, (word, lost)
    assert plan["workdir"] == (workdir or ("/srv/w" if "srv" in (dockerfile or "") else
                                           "/code" if "/code" in (dockerfile or "") else "/app"))


@pytest.mark.parametrize("cfg, words", [
    ({}, []),
    ({"environment": {"gpus": 2, "allow_internet": True, "docker_image": "ghcr.io/x/y:1", "memory_mb": 4096}},
     ["accelerators", "[agent] network public", "[verifier] network public", "ghcr.io/x/y:1", "memory_mb"]),
    ({"verifier": {"env": {"K": "v"}}, "agent": {"user": "agent"}}, ["[verifier] env", "[agent] user"]),
    ({"environment": {"healthcheck": {"command": "true"}, "skills_dir": "/s", "mcp_servers": [{"name": "m"}],
                      "build_timeout_sec": 600}},
     ["healthcheck: a readiness command", "skills_dir: skills", "mcp_servers: MCP servers", "build_timeout_sec"]),
    # every key the import does not read is listed by name, at any level
    ({"shiny": 1, "environment": {"sidecars": 2}, "verifier": {"retries": 3}},
     ["shiny (not read", "[environment] sidecars (not read", "[verifier] retries (not read"]),
    ({"environment": {"network_mode": "no-network"}, "verifier": {"environment_mode": "separate"}}, []),
])
def test_config_losses(cfg, words):
    lost = " | ".join(ab.harbor_config_losses(cfg))
    assert all(w in lost for w in words) and (lost == "") == (not words), lost


@pytest.mark.parametrize("cfg, in_image, net, carried, lost", [
    ({}, True, "none", [], []),
    ({"environment": {"network_mode": "no-network"}}, True, "none",
     ["[agent] network no-network", "[verifier] network no-network", "[solution] network no-network"], []),
    # public for the agent opens the sessions' network only in the task's image; checks never get one
    ({"environment": {"network_mode": "public"}}, True, "open", ["[agent] network public"],
     ["[verifier] network public", "[solution] network public"]),
    ({"environment": {"allow_internet": True}}, False, "none", [],
     ["[agent] network public", "[verifier] network public", "[solution] network public"]),
    ({"environment": {"network_mode": "no-network"}, "agent": {"network_mode": "allowlist"},
      "verifier": {"network_mode": "public"}}, True, "none", ["[solution] network no-network"],
     ["[agent] network allowlist", "[verifier] network public"]),
    ({"environment": {"network_mode": "bridge"}}, True, "none", [], ["'bridge' (unknown"] * 3),
])
def test_harbor_network_modes_map_or_are_listed(cfg, in_image, net, carried, lost):
    got_net, got_carried, got_lost = ab.harbor_network(cfg, in_image)
    assert got_net == net and len(got_carried) == len(carried) and len(got_lost) == len(lost), (got_carried, got_lost)
    assert all(c in g for c, g in zip(carried, got_carried)) and all(x in g for x, g in zip(lost, got_lost))


@pytest.mark.parametrize("spec, ok", [
    ({"workdir": "/app", "ro": {"/tests": "tests"}, "scratch": ["/logs/verifier"]}, True),
    ({"workdir": "/usr/app"}, False), ({"workdir": "/"}, False), ({"workdir": "app"}, False),
    ({"workdir": "/app/../etc"}, False), ({"workdir": "/app", "ro": {"/t": "../x"}}, False),
    ({"workdir": "/app", "ro": {"/app": "x"}}, False), ({"workdir": "/app", "extra": 1}, False),
    ({"workdir": "/a b"}, False), ({"workdir": "/tmp/x"}, False), ("nope", False),
])
def test_container_spec_problem(spec, ok):
    assert (ab.container_spec_problem(spec) is None) == ok


def test_container_mounts_go_into_the_sandboxs_own_root():
    # The root is bubblewrap's own, empty one (nothing of the host unless bound), so a container's
    # top-level paths are made in it; it is made read-only last.
    plan = ab.SandboxPlan(links=(("/bin", "usr/bin"),), base=("/usr",), rw=("/w",), cwd="/app",
                          container=tuple(ab.container_rows(
                              {"workdir": "/app", "ro": {"/tests": "tests"}, "scratch": ["/logs/verifier"]},
                              workspace="/w", base="/o")))
    rows = ab.sandbox_mounts(plan)
    assert ("--symlink", "usr/bin", "/bin") in rows and ("--ro-bind", "/usr", "/usr") in rows
    assert ("--ro-bind", "/", "/") not in rows and ("--tmpfs", "/") not in rows
    # a scratch path is a tmpfs sized like /tmp (no tmpfs is unsized); /dev and the root read-only last
    assert rows[-5:] == [("--bind", "/w", "/app"), ("--ro-bind", "/o/tests", "/tests"),
                         ("--size", str(ab.SANDBOX_TMP_MB * 2 ** 20), "--tmpfs", "/logs/verifier"),
                         ("--remount-ro", "/dev"), ("--remount-ro", "/")]


def _copy_tasks(tmp_path: Path, names) -> list[str]:
    out = []
    for n in names:
        shutil.copytree(HARBOR / n, tmp_path / "src" / n)
        out.append(str(tmp_path / "src" / n))
    return out


def test_import_writes_bundles_and_lists_what_is_lost(tmp_path):
    dirs = _copy_tasks(tmp_path, [*GOOD, NEEDS_IMAGE])
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    assert code == 0, out
    got = {t["task"]: t for t in out["imported"]}
    assert sorted(got) == sorted([*GOOD, NEEDS_IMAGE])
    assert got["fix-mean"]["starter_files"] == ["stats.py"] and got["fix-mean"]["oracle_timeout_s"] == 120
    assert got["word-freq-cli"]["starter_files"] == ["README.txt", "wordfreq.py"]
    lost = " | ".join(got[NEEDS_IMAGE]["not_carried_over"])
    assert "pyfiglet" in lost and "accelerators" in lost and "[agent] network public" in lost
    for name in got:
        task = ab.load_task(tmp_path / "tasks" / name)   # a bundle agentbench loads
        spec = json.loads((tmp_path / "tasks" / name / "task.json").read_text())
        assert spec["not_carried_over"] == got[name]["not_carried_over"]
        assert task.reference_spec["container"]["ro"] == {"/solution": "solution"}
        assert task.oracle["container"]["workdir"] == "/app" and "{receipt_fd}" in task.oracle["cmd"]
        assert (task.public / "TASK.md").read_text().startswith("> Imported from a Harbor task")
    assert (tmp_path / "tasks" / "fix-mean" / "public" / "stats.py").read_text() == \
        (HARBOR / "fix-mean" / "environment" / "app" / "stats.py").read_text()
    assert not any(p.name.startswith(".import-") for p in (tmp_path / "tasks").iterdir())


@pytest.mark.parametrize("breakage, problem", [
    (lambda d: (d / "tests" / "test.sh").unlink(), "lacks tests/test.sh"),
    (lambda d: (d / "instruction.md").unlink(), "lacks instruction.md"),
    (lambda d: shutil.rmtree(d / "solution"), "lacks solution/solve.sh"),
    (lambda d: (d / "environment" / "evil").symlink_to("/etc/passwd"), "is a link"),
    (lambda d: (d / "task.toml").write_text("[verifier]\ntimeout_sec = -5\n"), "timeout_sec"),
    (lambda d: (d / "task.toml").write_text("[environment]\nworkdir = '/usr/lib'\n"), "system directory"),
    (lambda d: (d / "environment" / "docker-compose.yaml").write_text("services: {}\n"), "compose"),
])
def test_a_bad_task_refuses_the_whole_call_by_name(tmp_path, breakage, problem):
    dirs = _copy_tasks(tmp_path, GOOD)
    breakage(Path(dirs[1]))
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    assert code == 2 and out["code"] == "harbor_task_refused", out
    assert list(out["refused"]) == [dirs[1]] and problem in " ".join(out["refused"][dirs[1]])
    assert not (tmp_path / "tasks").exists()   # nothing written, not even the good one


def test_invalid_toml_and_taken_ids_are_refused(tmp_path):
    dirs = _copy_tasks(tmp_path, GOOD[:1])
    (Path(dirs[0]) / "task.toml").write_text("this is = = not toml")
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "t")])
    assert code == 2 and out["code"] == "harbor_task_toml_invalid"
    dirs2 = _copy_tasks(tmp_path / "b", GOOD[1:])
    (tmp_path / "t" / GOOD[1]).mkdir(parents=True)
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs2, "--tasks", str(tmp_path / "t")])
    assert code == 2 and "exists already" in " ".join(out["refused"][dirs2[0]])


def _study_with(tmp_path: Path, tasks: Path) -> Path:
    study = tmp_path / "study"
    (study / "arms").mkdir(parents=True)
    (study / "arms" / "A.md").write_text("Work carefully.\n")
    (study / "arms" / "C.md").write_text("Check your work.\n")
    (study / "study.json").write_text(json.dumps({
        "tasks": str(tasks), "model": "claude-opus-4-5", "effort": "high", "permission_mode": "dontAsk",
        "tools": "Bash,Read,Edit,Write,Glob,Grep",
        "arms": {"A": {"preamble": "arms/A.md"}, "C": {"preamble": "arms/C.md", "gate_cycles": 2}},
        "budget": {"usd_per_run": 5.0, "wall_s": 1800, "max_turns": 60, "study_usd": 100.0}}))
    code, out = run_main(["init", "--study", str(study)])
    assert code == 0, out
    return study


def test_calibration_of_the_three_harbor_tasks(tmp_path):
    if not ab.sandbox_probe()["available"]:
        pytest.skip("bubblewrap cannot run here: the container paths of Harbor tests cannot be given")
    dirs = _copy_tasks(tmp_path, [*GOOD, NEEDS_IMAGE])
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    assert code == 0
    study = _study_with(tmp_path, tmp_path / "tasks")
    code, cal = run_main(["calibrate", "--study", str(study)])
    # fix-mean's verifier runs pytest in the process that imports the code under test and reads
    # its exit status: a solution that exits 0 at import forges a pass, and calibrate says so.
    assert code == 2 and cal["code"] == "oracle_forgeable", cal
    assert "exit_at_import" in cal["forged_probes"]["fix-mean"], cal["forged_probes"]
    probes = {p["name"]: p["verdict"] for p in cal["tasks"]["fix-mean"]["oracle_probes"]}
    assert set(probes) == set(ab.ORACLE_PROBES) and probes["exit_at_import"] == "forged"
    assert "{sandbox_run}" in cal["hint"]
    # Accepted by the study: the rest of calibration as before, the acceptance recorded.
    cfg = json.loads((study / "study.json").read_text())
    (study / "study.json").write_text(json.dumps({**cfg, "accept_forgeable_oracles": True}))
    code, cal = run_main(["calibrate", "--study", str(study)])
    # One task fails: calibrate exits 2 naming it, with every task's result in the answer.
    assert code == 2 and cal["code"] == "calibration_failed" and cal["failed"] == [NEEDS_IMAGE], cal
    assert cal["uncalibrated"] == [NEEDS_IMAGE]
    assert cal["tasks"]["fix-mean"]["forgeable_accepted"] is True
    # ... and every report names it, and says the Harbor references' strength was not measured.
    code, rep = run_main(["report", "--study", str(study), "--format", "json"])
    assert code == 0 and any("fix-mean" in w and "accept_forgeable_oracles" in w for w in rep["warnings"]), rep
    assert "fix-mean not measured" in rep["methods"]["oracle_strength"], rep["methods"]
    for name in GOOD:
        t = cal["tasks"][name]
        assert t["ok"] and t["starter_oracle_score"] < 1.0, t
        assert [r["oracle_score"] for r in t["reference"]] == [1.0] * ab.CALIBRATION_ATTEMPTS_DEFAULT
    bad = cal["tasks"][NEEDS_IMAGE]
    text = " | ".join(bad["problems"])
    assert not bad["ok"] and "pyfiglet" in text and "this host lacks what its environment gave it" in text


def test_a_container_check_without_bubblewrap_is_a_clear_grader_error(tmp_path):
    dirs = _copy_tasks(tmp_path, GOOD[:1])
    run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    study = _study_with(tmp_path, tmp_path / "tasks")
    cfg = json.loads((study / "study.json").read_text())
    cfg["sandbox"] = "none"
    (study / "study.json").write_text(json.dumps(cfg))
    code, cal = run_main(["calibrate", "--study", str(study)])
    t = cal["tasks"][GOOD[0]]
    assert not t["ok"] and "only the bubblewrap sandbox gives" in " ".join(t["problems"])


def test_without_tomllib_the_refusal_says_which_python(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tomllib", None)   # as on Python 3.10
    dirs = _copy_tasks(tmp_path, GOOD[:1])
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "t")])
    assert code == 2 and out["code"] == "toml_reader_missing" and "3.11" in out["hint"]
    assert not (tmp_path / "t").exists()


def test_a_hostile_task_copies_no_host_file_and_fills_nothing(tmp_path):
    """Links in the parts the check does not walk (.git, __pycache__): to a host file and to
    /dev/zero.  Followed, the first copies the host file into the study, the second fills the disk."""
    dirs = _copy_tasks(tmp_path, GOOD[:1])
    task = Path(dirs[0])
    host_secret = tmp_path / "host-secret.txt"
    token = "HOST-SECRET-" + __import__("os").urandom(6).hex()
    host_secret.write_text(token)
    (task / "tests" / ".git").mkdir()
    (task / "tests" / ".git" / "config").symlink_to(host_secret)
    (task / "solution" / "__pycache__").mkdir()
    (task / "solution" / "__pycache__" / "solve.cpython-311.pyc").symlink_to("/dev/zero")
    # the attack is set up: a copy that follows links takes the host's file (and /dev/zero, endless)
    probe = tmp_path / "probe"
    shutil.copytree(task / "tests", probe, ignore=shutil.ignore_patterns("__pycache__"))
    assert (probe / ".git" / "config").read_text() == token and not (probe / ".git" / "config").is_symlink()
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    assert code == 0, out
    bundle = tmp_path / "tasks" / GOOD[0]
    total = 0
    for p in bundle.rglob("*"):
        assert not p.is_symlink(), p
        if p.is_file():
            total += p.stat().st_size
            assert token not in p.read_text(errors="replace"), p
    assert not (bundle / "oracle" / "tests" / ".git").exists()
    assert not (bundle / "reference" / "solution" / "__pycache__").exists()
    assert total < 2 ** 20


def test_a_task_deeper_than_the_copy_rules_is_refused_by_name_and_nothing_is_written(tmp_path):
    """A tree the plan's walk accepts but the copy rules do not (deeper than COPY_MAX_DEPTH):
    refused as the task's fault, naming its directory, and no bundle nor staging is left."""
    dirs = _copy_tasks(tmp_path, GOOD[:1])
    deep = Path(dirs[0]) / "tests"
    for _ in range(ab.COPY_MAX_DEPTH + 5):
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "x.txt").write_text("x")
    # the attack is set up: the plan itself finds nothing wrong with the directory
    assert ab.plan_harbor_task(Path(dirs[0]), "host", None)["problems"] == []
    code, out = run_main(["import-tasks", "--from", "harbor", *dirs, "--tasks", str(tmp_path / "tasks")])
    assert code == 2 and out["code"] == "harbor_task_refused", out
    assert "nested_too_deep" in out["refused"][dirs[0]][0], out
    assert list((tmp_path / "tasks").iterdir()) == []
