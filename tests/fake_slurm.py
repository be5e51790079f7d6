#!/usr/bin/env python3
"""A fake Slurm (`sbatch`, `squeue`, `scancel`) for fast, deterministic tests (stdlib only).

Invoked as `fake_slurm.py sbatch ...`, `fake_slurm.py squeue ...` or `fake_slurm.py scancel ...`,
normally through the three small shell wrappers that `install()` writes into a directory put first
on PATH, so the code under test runs the commands by their usual names.  Every job runs on this
machine, at once, as `/bin/sh SCRIPT [ARGS...]` in a new session, started by a detached runner
process (`fake_slurm.py _job ID`).  Cancelling escalates with a detached helper
(`fake_slurm.py _kill ID`).  Both internal commands are not meant to be called by hand.

State lives in the directory named by $FAKE_SLURM_DIR (created when missing):

  jobs/<id>.json   one record per job, always replaced atomically (temp file + os.replace); every
                   read-modify-write holds jobs/<id>.lock (fcntl.flock)
  next_id          the id the next submission gets (ids start at 1000), guarded by next_id.lock
  calls.jsonl      one line {"cmd", "argv", "at"} per sbatch / squeue / scancel invocation, failed
                   ones included (the internal runner and kill helper are not logged)

Switches a test drops into that directory (plain files, their content is ignored unless noted):

  hold             jobs submitted while it exists stay PENDING (their record says "held": true)
  release-<id>     ... until this file appears; then the job starts
  down             squeue, scancel and sbatch fail as if the controller were unreachable (exit 1)
  sbatch_fail      sbatch fails (exit 1), printing the file's content after "sbatch: error: "
  purge-<id>       squeue and scancel no longer know the job (the controller forgot it)

Behaviours of real Slurm it keeps:

  * states PENDING -> RUNNING -> COMPLETED (exit 0) / FAILED (non-zero exit, or killed by a
    signal), and CANCELLED from PENDING or RUNNING by scancel; a cancelled pending job never runs;
  * `sbatch --parsable` prints `ID` (`ID;fakecluster` with FAKE_SLURM_CLUSTER_SUFFIX=1), otherwise
    `Submitted batch job ID`; the options --job-name/-J, --output/-o, --chdir/-D, --partition/-p,
    --time/-t, --ntasks/-n in both the `--opt=value` and the two-token forms (`-oFILE` too); %j, %x
    and %% in --output; relative --output resolved against --chdir, which defaults to the
    submitting directory; the job name defaults to the script's file name, the output to
    `slurm-<id>.out`; arguments after SCRIPT are passed to it; the script must exist, be non-empty
    and start with `#!`;
  * the job inherits sbatch's environment plus SLURM_JOB_ID, SLURM_JOBID, SLURM_JOB_NAME,
    SLURMD_NODENAME and SLURM_SUBMIT_DIR; stdout and stderr go to the output file (appended, or
    truncated first with --open-mode=truncate);
  * when the batch script ends, whatever it left running in its process group is killed;
  * scancel: SIGTERM to the job's processes, SIGKILL after KillWait seconds ($FAKE_SLURM_KILLWAIT,
    default 2.0) from a detached helper, so scancel returns at once; `--signal=SIG` / `-s SIG`
    only signals and keeps the state; as in real Slurm a signal other than KILL reaches the batch
    shell only with --batch (the shell alone) or --full (the shell and its children) -- without
    either it would go to job steps, which the fake never has, so nothing happens; --signal=KILL
    cancels like a plain scancel (state CANCELLED) but kills at once; signalling a pending job
    fails with "Job is pending execution";
  * squeue with --jobs lists jobs in any state; without it, only PENDING and RUNNING ones;
    `-o/--format` with %i %j %T %t %P %N %u %M %l %D %R %% and widths (`%.18i` right-aligned,
    `%8j` left-aligned, both truncating), a header unless -h/--noheader;
  * the error messages and exit codes of the real commands for an unknown job id, a job that has
    already ended, an unreachable controller, a missing or malformed script.

What it does not do: no nodes, partitions, accounts or QOS (they are recorded, never checked), no
accounting (no sacct), no time limits (--time is recorded only), no job steps or srun, no arrays or
dependencies, no --wait, --hold, --export or --wrap semantics (unknown options are recorded in the
job's "extra" list and otherwise ignored), no reading the script from stdin.  The script runs from
its path at start time (real sbatch copies it at submission) and always with /bin/sh, whatever its
`#!` line says.  A job that is killed by a signal records "signal" and exit_code 128 + signal.

Test helpers (import this module): install(), jobs(), calls(), wait_state(), cleanup().
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

# Kept lean on purpose (subprocess is imported only where a process is started): squeue is polled
# often and should answer quickly.

THIS = os.path.abspath(__file__)
FIRST_ID = 1000
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED")
ACTIVE_STATES = ("PENDING", "RUNNING")
COMPACT = {"PENDING": "PD", "RUNNING": "R", "COMPLETED": "CD", "FAILED": "F", "CANCELLED": "CA"}
CLUSTER = "fakecluster"
DEFAULT_PARTITION = "normal"
DEFAULT_KILLWAIT = 2.0
POLL_S = 0.05
CONTROLLER_DOWN = "Unable to contact slurm controller (connect failure)"
INVALID_ID = "Invalid job id specified"
ALREADY_DONE = "Job/step already completing or completed"
SQUEUE_DEFAULT_FORMAT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"

# sbatch options the fake interprets: option -> record key.
SBATCH_OPTS = {
    "--job-name": "name", "-J": "name",
    "--output": "output", "-o": "output",
    "--chdir": "chdir", "-D": "chdir",
    "--partition": "partition", "-p": "partition",
    "--time": "time", "-t": "time",
    "--ntasks": "ntasks", "-n": "ntasks",
    "--open-mode": "open_mode",
}
# Other real sbatch options that take a value: recorded in "extra", otherwise ignored.  Knowing
# them lets the two-token form (`--mem 4G`) be told apart from a switch followed by the script.
SBATCH_OTHER_LONG = {
    "--account", "--array", "--begin", "--clusters", "--comment", "--constraint",
    "--cpus-per-gpu", "--cpus-per-task", "--deadline", "--dependency", "--distribution", "--error",
    "--exclude", "--export", "--gpus", "--gpus-per-node", "--gpus-per-task", "--gres", "--input",
    "--licenses", "--mail-type", "--mail-user", "--mem", "--mem-per-cpu", "--mem-per-gpu",
    "--nice", "--nodefile", "--nodelist", "--nodes", "--ntasks-per-node", "--qos",
    "--reservation", "--signal", "--time-min", "--tmp", "--wckey",
}
SBATCH_OTHER_SHORT = {"-A", "-a", "-b", "-C", "-c", "-d", "-e", "-F", "-G", "-i", "-L", "-M",
                      "-m", "-N", "-q", "-S", "-w", "-x"}
SQUEUE_HEADERS = {"i": "JOBID", "j": "NAME", "T": "STATE", "t": "ST", "P": "PARTITION",
                  "N": "NODELIST", "u": "USER", "M": "TIME", "l": "TIME_LIMIT", "D": "NODES",
                  "R": "NODELIST(REASON)"}
FIELD_RE = re.compile(r"%(\.?)(\d*)([A-Za-z%])")


class SlurmError(Exception):
    """A user-facing failure: `message` goes to stderr as is, the command exits with `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code


# ---------------------------------------------------------------------------------------------
# State directory, locks, job records


def state_dir_from_env() -> str:
    d = os.environ.get("FAKE_SLURM_DIR")
    if not d:
        raise SlurmError("fake_slurm: FAKE_SLURM_DIR is not set", 2)
    d = os.path.abspath(d)
    os.makedirs(os.path.join(d, "jobs"), exist_ok=True)
    return d


@contextmanager
def flocked(path: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `path` (created if missing) for the block."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def job_path(d: str, jid: str) -> str:
    return os.path.join(d, "jobs", f"{jid}.json")


def job_lock(d: str, jid: str):
    return flocked(os.path.join(d, "jobs", f"{jid}.lock"))


def read_job(d: str, jid: str) -> dict[str, Any] | None:
    try:
        with open(job_path(d, jid), encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None


def write_job(d: str, job: dict[str, Any]) -> None:
    path = job_path(d, job["id"])
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(job, fh, indent=1, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)


def known_job(d: str, jid: str) -> dict[str, Any] | None:
    """The job as the controller sees it: None if it never existed or was purged."""
    if not jid.isdigit() or os.path.exists(os.path.join(d, f"purge-{jid}")):
        return None
    return read_job(d, jid)


def log_call(d: str, cmd: str, argv: list[str]) -> None:
    line = json.dumps({"cmd": cmd, "argv": argv, "at": time.time()}) + "\n"
    fd = os.open(os.path.join(d, "calls.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))  # one write per line: appends never interleave
    finally:
        os.close(fd)


def controller_down(d: str) -> bool:
    return os.path.exists(os.path.join(d, "down"))


def next_job_id(d: str) -> str:
    counter = os.path.join(d, "next_id")
    with flocked(counter + ".lock"):
        try:
            with open(counter, encoding="utf-8") as fh:
                jid = int(fh.read().strip() or FIRST_ID)
        except FileNotFoundError:
            jid = FIRST_ID
        tmp = f"{counter}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{jid + 1}\n")
        os.replace(tmp, counter)
    return str(jid)


def spawn_detached(args: list[str], env: dict[str, str], cwd: str) -> None:
    import subprocess
    subprocess.Popen([sys.executable, THIS, *args], stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, env=env, cwd=cwd)


def killpg_quiet(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# ---------------------------------------------------------------------------------------------
# sbatch


def parse_sbatch(args: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"parsable": False, "extra": []}

    def value_of(name: str, attached: str | None, i: int) -> tuple[str, int]:
        if attached is not None:
            return attached, i
        if i + 1 >= len(args):
            raise SlurmError(f"sbatch: option '{name}' requires an argument")
        return args[i + 1], i + 1

    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name == "--parsable":
                opts["parsable"] = True
            elif name in SBATCH_OPTS:
                opts[SBATCH_OPTS[name]], i = value_of(name, val if eq else None, i)
            elif name in SBATCH_OTHER_LONG and not eq:
                v, i = value_of(name, None, i)
                opts["extra"] += [a, v]
            else:
                opts["extra"].append(a)
        else:
            name, rest = a[:2], a[2:]
            if name in SBATCH_OPTS:
                opts[SBATCH_OPTS[name]], i = value_of(name, rest or None, i)
            elif name in SBATCH_OTHER_SHORT:
                v, i = value_of(name, rest or None, i)
                opts["extra"] += [name, v]
            else:
                opts["extra"].append(a)
        i += 1
    opts["script"] = args[i] if i < len(args) else None
    opts["script_args"] = args[i + 1:]
    return opts


def expand_output(pattern: str, jid: str, name: str) -> str:
    def sub(m: re.Match[str]) -> str:
        return {"j": jid, "x": name, "%": "%"}.get(m.group(1), m.group(0))
    return re.sub(r"%([jx%])", sub, pattern)


def check_script(path: str) -> None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        raise SlurmError(f"sbatch: error: Unable to open file {path}") from None
    if not head.strip():
        raise SlurmError("sbatch: error: Batch script is empty!")
    if not head.startswith(b"#!"):
        raise SlurmError("sbatch: error: This does not look like a batch script.  The first\n"
                         "sbatch: error: line must start with #! followed by the path to an"
                         " interpreter.\nsbatch: error: For instance: #!/bin/sh")


def cmd_sbatch(d: str, args: list[str]) -> int:
    fail = os.path.join(d, "sbatch_fail")
    if os.path.exists(fail):
        with open(fail, encoding="utf-8", errors="replace") as fh:
            text = fh.read().strip() or "Batch job submission failed"
        raise SlurmError("\n".join(f"sbatch: error: {ln}" for ln in text.splitlines()))
    if controller_down(d):
        raise SlurmError(f"sbatch: error: Batch job submission failed: {CONTROLLER_DOWN}")
    o = parse_sbatch(args)
    script = o["script"]
    if script is None:
        raise SlurmError("sbatch: error: fake_slurm needs a script path (a script on stdin and "
                         "--wrap are not supported)")
    check_script(script)
    ntasks = o.get("ntasks")
    if ntasks is not None and not (ntasks.isdigit() and int(ntasks) > 0):
        raise SlurmError(f'sbatch: error: Invalid numeric value "{ntasks}" for --ntasks.')
    open_mode = o.get("open_mode", "append")
    if open_mode not in ("append", "truncate"):
        raise SlurmError(f"sbatch: error: Invalid --open-mode argument: {open_mode}")

    submit_dir = os.getcwd()
    chdir = os.path.join(submit_dir, o["chdir"]) if o.get("chdir") else submit_dir
    chdir = os.path.normpath(chdir)
    name = o.get("name") or os.path.basename(script)
    jid = next_job_id(d)
    output = os.path.normpath(os.path.join(chdir, expand_output(o.get("output") or "slurm-%j.out",
                                                                jid, name)))
    job = {
        "id": jid, "name": name, "output": output, "chdir": chdir, "submit_dir": submit_dir,
        "partition": o.get("partition"), "time": o.get("time"),
        "ntasks": int(ntasks) if ntasks is not None else None, "open_mode": open_mode,
        "script": os.path.abspath(script), "script_args": o["script_args"], "extra": o["extra"],
        "held": os.path.exists(os.path.join(d, "hold")),
        "state": "PENDING", "submitted_at": time.time(),
    }
    with job_lock(d, jid):
        write_job(d, job)
    env = dict(os.environ)
    env["FAKE_SLURM_DIR"] = d
    spawn_detached(["_job", jid], env, d)
    if o["parsable"]:
        suffix = f";{CLUSTER}" if os.environ.get("FAKE_SLURM_CLUSTER_SUFFIX") == "1" else ""
        print(f"{jid}{suffix}")
    else:
        print(f"Submitted batch job {jid}")
    return 0


# ---------------------------------------------------------------------------------------------
# The runner: one detached process per job


def run_job(d: str, jid: str) -> None:
    try:
        _run_job(d, jid)
    except BaseException as exc:  # leave a trace instead of a job stuck in RUNNING
        with job_lock(d, jid):
            job = read_job(d, jid)
            if job is not None:
                job["runner_error"] = f"{type(exc).__name__}: {exc}"
                if job["state"] not in FINAL_STATES:
                    job.update(state="FAILED", exit_code=1, ended_at=time.time())
                write_job(d, job)
        raise


def _fail_start(d: str, job: dict[str, Any], reason: str) -> None:
    job.update(state="FAILED", exit_code=1, reason=reason, ended_at=time.time())
    write_job(d, job)


def _run_job(d: str, jid: str) -> None:
    import subprocess
    job = read_job(d, jid)
    if job is None:
        return
    if job.get("held"):
        release = os.path.join(d, f"release-{jid}")
        while True:
            job = read_job(d, jid)
            if job is None or job["state"] != "PENDING":  # cancelled, or the state dir is gone
                return
            if os.path.exists(release):
                break
            time.sleep(POLL_S)

    # Start under the job lock: scancel then sees either PENDING (and the job never starts) or
    # RUNNING with the pid already recorded.
    with job_lock(d, jid):
        job = read_job(d, jid)
        if job is None or job["state"] != "PENDING":
            return
        host = socket.gethostname()
        env = dict(os.environ)
        env.update(SLURM_JOB_ID=jid, SLURM_JOBID=jid, SLURM_JOB_NAME=job["name"],
                   SLURMD_NODENAME=host, SLURM_SUBMIT_DIR=job["submit_dir"])
        flags = os.O_WRONLY | os.O_CREAT
        flags |= os.O_TRUNC if job.get("open_mode") == "truncate" else os.O_APPEND
        try:
            out_fd = os.open(job["output"], flags, 0o644)
        except OSError as exc:
            _fail_start(d, job, f"cannot open output file: {exc}")
            return
        try:
            proc = subprocess.Popen(["/bin/sh", job["script"], *job["script_args"]],
                                    cwd=job["chdir"], env=env, stdin=subprocess.DEVNULL,
                                    stdout=out_fd, stderr=out_fd, start_new_session=True)
        except OSError as exc:
            _fail_start(d, job, f"cannot start the script: {exc}")
            return
        finally:
            os.close(out_fd)
        job.update(state="RUNNING", started_at=time.time(), node=host, pid=proc.pid)
        write_job(d, job)

    # Wait without reaping, so the exited leader still pins its process-group id while the
    # leftovers of the job are killed; then reap.
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    killpg_quiet(proc.pid, signal.SIGKILL)
    rc = proc.wait()

    with job_lock(d, jid):
        job = read_job(d, jid)
        if job is None:
            return
        job["ended_at"] = time.time()
        if rc >= 0:
            job["exit_code"] = rc
        else:
            job["signal"] = -rc
            job["exit_code"] = 128 - rc
        if job["state"] != "CANCELLED":
            job["state"] = "COMPLETED" if rc == 0 else "FAILED"
        write_job(d, job)


def run_kill_helper(d: str, jid: str, wait_s: float) -> None:
    """After KillWait, SIGKILL a cancelled job's process group unless the job already ended."""
    time.sleep(wait_s)
    with job_lock(d, jid):
        job = read_job(d, jid)
        if job is not None and job.get("pid") and "ended_at" not in job:
            killpg_quiet(job["pid"], signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# squeue


def parse_squeue(args: list[str]) -> dict[str, Any]:
    o: dict[str, Any] = {"header": True, "jobs": None, "format": None, "states": None}
    valued = {"-j": "jobs", "--jobs": "jobs", "--job": "jobs", "-o": "format",
              "--format": "format", "-t": "states", "--states": "states",
              "-u": None, "--user": None, "-M": None, "--clusters": None, "-p": None,
              "--partition": None, "-n": None, "--name": None}
    switches = {"-h", "--noheader", "--me", "-a", "--all", "-l", "--long"}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
        elif a.startswith("-") and len(a) > 2 and a[:2] in valued:
            name, eq, val = a[:2], "=", a[2:]
        else:
            name, eq, val = a, "", ""
        if name in ("-h", "--noheader"):
            o["header"] = False
        elif name in switches:
            pass
        elif name in valued:
            if not eq:
                if i + 1 >= len(args):
                    raise SlurmError(f"squeue: option '{name}' requires an argument")
                i += 1
                val = args[i]
            if valued[name]:
                o[valued[name]] = val
        else:
            raise SlurmError(f"squeue: unrecognized option '{a}'\n"
                             'Try "squeue --help" for more information')
        i += 1
    return o


def elapsed(job: dict[str, Any]) -> str:
    start = job.get("started_at")
    if not start:
        return "0:00"
    secs = int((job.get("ended_at") or time.time()) - start)
    days, rem = divmod(secs, 86400)
    hours, rem = divmod(rem, 3600)
    mins, secs = divmod(rem, 60)
    if days:
        return f"{days}-{hours:02d}:{mins:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{mins:02d}:{secs:02d}"
    return f"{mins}:{secs:02d}"


def field(job: dict[str, Any], letter: str) -> str:
    state = job["state"]
    if letter == "i":
        return job["id"]
    if letter == "j":
        return job["name"]
    if letter == "T":
        return state
    if letter == "t":
        return COMPACT.get(state, state)
    if letter == "P":
        return job.get("partition") or DEFAULT_PARTITION
    if letter == "N":
        return job.get("node") or ""
    if letter == "u":
        import getpass
        return getpass.getuser()
    if letter == "M":
        return elapsed(job)
    if letter == "l":
        return job.get("time") or "UNLIMITED"
    if letter == "D":
        return "1"
    if letter == "R":
        if state == "PENDING":
            return "(None)" if not job.get("held") else "(Resources)"
        return job.get("node") or ""
    return f"%{letter}"


def render(fmt: str, value_of) -> str:
    def sub(m: re.Match[str]) -> str:
        right, width, letter = m.group(1), m.group(2), m.group(3)
        if letter == "%":
            return "%"
        text = value_of(letter)
        if width:
            w = int(width)
            text = text[:w]
            text = text.rjust(w) if right else text.ljust(w)
        return text
    return FIELD_RE.sub(sub, fmt)


def cmd_squeue(d: str, args: list[str]) -> int:
    o = parse_squeue(args)
    if controller_down(d):
        raise SlurmError(f"squeue: error: {CONTROLLER_DOWN}\n"
                         f"slurm_load_jobs error: {CONTROLLER_DOWN}")
    if o["jobs"] is not None:
        ids = [j for j in o["jobs"].split(",") if j]
        selected = [job for job in (known_job(d, j) for j in ids) if job is not None]
        if not selected:
            raise SlurmError(f"slurm_load_jobs error: {INVALID_ID}")
    else:
        selected = [job for job in jobs(d).values()
                    if job["state"] in ACTIVE_STATES and known_job(d, job["id"]) is not None]
    if o["states"]:
        wanted = {s.strip().upper() for s in o["states"].split(",")}
        if "ALL" not in wanted:
            selected = [j for j in selected
                        if j["state"] in wanted or COMPACT.get(j["state"]) in wanted]
    selected.sort(key=lambda j: int(j["id"]))
    fmt = o["format"] or SQUEUE_DEFAULT_FORMAT
    lines = []
    if o["header"]:
        lines.append(render(fmt, lambda letter: SQUEUE_HEADERS.get(letter, letter.upper())))
    lines += [render(fmt, lambda letter, job=job: field(job, letter)) for job in selected]
    if lines:
        print("\n".join(lines))
    return 0


# ---------------------------------------------------------------------------------------------
# scancel


def parse_signal(text: str) -> int:
    t = text.strip().upper()
    if t.isdigit():
        num = int(t)
        if 0 < num < signal.NSIG:
            return num
    else:
        name = t if t.startswith("SIG") else f"SIG{t}"
        sig = getattr(signal, name, None)
        if isinstance(sig, signal.Signals):
            return int(sig)
    raise SlurmError(f"scancel: error: Invalid job signal: {text}")


def kill_wait() -> float:
    try:
        return max(0.0, float(os.environ.get("FAKE_SLURM_KILLWAIT", DEFAULT_KILLWAIT)))
    except ValueError:
        return DEFAULT_KILLWAIT


def cmd_scancel(d: str, args: list[str]) -> int:
    sig: int | None = None
    batch = full = False
    ids: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--signal="):
            sig = parse_signal(a.split("=", 1)[1])
        elif a in ("--signal", "-s"):
            if i + 1 >= len(args):
                raise SlurmError(f"scancel: option '{a}' requires an argument")
            i += 1
            sig = parse_signal(args[i])
        elif a.startswith("-s") and len(a) > 2:
            sig = parse_signal(a[2:])
        elif a in ("-b", "--batch"):
            batch = True
        elif a in ("-f", "--full"):
            full = True
        elif a in ("-Q", "--quiet", "-v", "--verbose"):
            pass
        elif a.startswith("-"):
            raise SlurmError(f"scancel: unrecognized option '{a}'\n"
                             'Try "scancel --help" for more information')
        else:
            ids.append(a)
        i += 1
    if not ids:
        raise SlurmError("scancel: error: No job identification provided")
    if controller_down(d):
        raise SlurmError("\n".join(f"scancel: error: Kill job error on job id {j}: "
                                   f"{CONTROLLER_DOWN}" for j in ids))
    code = 0
    for jid in ids:
        if known_job(d, jid) is None:
            print(f"scancel: error: Kill job error on job id {jid}: {INVALID_ID}", file=sys.stderr)
            code = 1
            continue
        with job_lock(d, jid):
            job = read_job(d, jid)
            assert job is not None
            if job["state"] in FINAL_STATES:
                print(f"scancel: error: Kill job error on job id {jid}: {ALREADY_DONE}",
                      file=sys.stderr)
                continue
            if sig is not None and sig != signal.SIGKILL:
                if job["state"] == "PENDING":
                    print(f"scancel: error: Kill job error on job id {jid}: "
                          "Job is pending execution", file=sys.stderr)
                    code = 1
                elif full:
                    killpg_quiet(job["pid"], sig)
                elif batch:
                    try:
                        os.kill(job["pid"], sig)
                    except (ProcessLookupError, PermissionError):
                        pass
                # else: the signal is meant for job steps, and the fake has none.
                continue
            # A plain cancel, or --signal=KILL, which real Slurm also treats as a cancel.
            job.update(state="CANCELLED", cancelled_at=time.time())
            if "pid" not in job:  # pending: it never starts
                job["ended_at"] = job["cancelled_at"]
            write_job(d, job)
            if "pid" not in job:
                continue
            if sig == signal.SIGKILL:
                killpg_quiet(job["pid"], signal.SIGKILL)
                continue
            killpg_quiet(job["pid"], signal.SIGCONT)
            killpg_quiet(job["pid"], signal.SIGTERM)
            spawn_detached(["_kill", jid, str(kill_wait())], dict(os.environ, FAKE_SLURM_DIR=d), d)
    return code


# ---------------------------------------------------------------------------------------------
# Helpers for tests


def install(bin_dir: "os.PathLike[str] | str",
            state_dir: "os.PathLike[str] | str") -> dict[str, str]:
    """Write `sbatch`, `squeue` and `scancel` wrappers into bin_dir; return the env changes.

    Apply the returned {"PATH", "FAKE_SLURM_DIR"} to the environment of the process under test.
    """
    import shlex
    bin_dir = os.fspath(bin_dir)
    state_dir = os.path.abspath(os.fspath(state_dir))
    os.makedirs(bin_dir, exist_ok=True)
    os.makedirs(os.path.join(state_dir, "jobs"), exist_ok=True)
    for cmd in ("sbatch", "squeue", "scancel"):
        path = os.path.join(bin_dir, cmd)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(THIS)} {cmd}"
                     ' "$@"\n')
        os.chmod(path, 0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
            "FAKE_SLURM_DIR": state_dir}


def jobs(state_dir: "os.PathLike[str] | str") -> dict[str, dict[str, Any]]:
    """Every job record, keyed by id (purged jobs included: purging only hides them from Slurm)."""
    folder = os.path.join(os.fspath(state_dir), "jobs")
    out: dict[str, dict[str, Any]] = {}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return out
    for name in sorted(names):
        if name.endswith(".json"):
            job = read_job(os.fspath(state_dir), name[:-5])
            if job is not None:
                out[job["id"]] = job
    return out


def calls(state_dir: "os.PathLike[str] | str", cmd: str | None = None) -> list[dict[str, Any]]:
    """The logged invocations in order, optionally only those of one command."""
    path = os.path.join(os.fspath(state_dir), "calls.jsonl")
    try:
        with open(path, encoding="utf-8") as fh:
            rows = [json.loads(ln) for ln in fh if ln.strip()]
    except FileNotFoundError:
        return []
    return [r for r in rows if cmd is None or r["cmd"] == cmd]


def wait_state(state_dir: "os.PathLike[str] | str", job_id: "str | int",
               states: "str | Iterable[str]", timeout: float = 20) -> dict[str, Any]:
    """Poll the job's record until its state is one of `states`; return the record."""
    wanted = {states} if isinstance(states, str) else set(states)
    d, jid = os.fspath(state_dir), str(job_id)
    deadline = time.monotonic() + timeout
    job = None
    while True:
        job = read_job(d, jid)
        if job is not None and job["state"] in wanted:
            return job
        if time.monotonic() >= deadline:
            raise AssertionError(f"job {jid} did not reach {sorted(wanted)} in {timeout}s; "
                                 f"last record: {job}")
        time.sleep(POLL_S)


def cleanup(state_dir: "os.PathLike[str] | str") -> None:
    """Stop everything still alive: cancel pending jobs, SIGKILL running jobs' process groups.

    For test teardown, so that no held runner or long script outlives the test.
    """
    d = os.path.abspath(os.fspath(state_dir))
    for jid in jobs(d):
        with job_lock(d, jid):
            job = read_job(d, jid)
            if job is None or job["state"] in FINAL_STATES:
                continue
            job.update(state="CANCELLED", cancelled_at=time.time())
            write_job(d, job)
            if job.get("pid") and "ended_at" not in job:
                killpg_quiet(job["pid"], signal.SIGKILL)


# ---------------------------------------------------------------------------------------------


COMMANDS = {"sbatch": cmd_sbatch, "squeue": cmd_squeue, "scancel": cmd_scancel}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in (*COMMANDS, "_job", "_kill"):
        print("usage: fake_slurm.py {sbatch|squeue|scancel} [ARGS...]", file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    try:
        d = state_dir_from_env()
        if cmd == "_job":
            run_job(d, args[0])
            return 0
        if cmd == "_kill":
            run_kill_helper(d, args[0], float(args[1]))
            return 0
        log_call(d, cmd, args)
        return COMMANDS[cmd](d, args)
    except SlurmError as exc:
        print(exc.message, file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
