# /// script
# requires-python = ">=3.10"
# dependencies = []
# ///
"""agentbench: controlled experiments on the headless Claude Code agent.

One file, standard library only.  Every command prints exactly one JSON object on stdout; progress
and diagnostics go to stderr.  Run ``python3 agentbench.py --help`` for the command list, and read
README.md for the study layout and the rules the supervisor enforces.

The file is organised in bannered sections, strictly bottom-up: a definition uses only what is
defined above it (tests/test_architecture.py checks this, and rewrites the map below).  Each
banner says what its section owns and what it must not do.

Sections, strictly bottom-up:
    Start-up: lazy imports and the cached-bytecode launcher
    Constants
    Errors and output
    Hostile numbers
    Fault points
    Platform seam
    Files, locks and the registry
    Records: the declared shapes of the job's and run's files
    Processes
    Executors: where a job's supervisor runs (local, Slurm)
    Env scrub
    The sandbox
    Stream and usage
    Study configuration
    The metering gateway
    Jobs: a session's record (create, launch, finalise, reap, kill)
    The supervisor process: one job's `claude` run to its end
    Sessions and bases: every launch (start, fork, continue)
    Tasks, arms and checks: a study's contents, loaded once
    Runs and the pipeline
    Runs by hand and the run driver's checks: the pipeline's public API
    Statistics
    The report: what each arm did
    Rendering: Markdown and HTML
    Run pages: the report as a directory
    Offline scripted model
    The scripted model: rehearsal of a study
    Reading at scale: the streamed ledger, paged listings, the paused collector
    Calibration and assignment: a study's tasks checked and its runs planned
    Interop: Inspect logs, ATIF trajectories, Harbor tasks
    The CLI and main

Where to look: the study's configuration (its keys, defaults, init's flags, the merge) is "Study
configuration"; Slurm and the local executor are "Executors" (submitting, asking, cancelling, what
a launch record means); job records, the reaper and kill (the pure `kill_step`) are "Jobs"; the
process that runs one `claude` is "The supervisor process"; a session's limits (`session_limits`)
and every launch are "Sessions and bases"; the gateway and the sandbox have their own sections; a
study loaded once is `Study` (`load_study`) in "Tasks, arms and checks"; how a run is classified
(`classify_run`) and the pipeline are "Runs and the pipeline"; the by-hand flow and `run`'s
refusals are "Runs by hand" (`spawn_run`, `gate_run`, `evaluate_runs`, `runs_can_start`...);
calibrate and assign are "Calibration and assignment"; the CLI only converts flags and calls them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import fnmatch
import gc
import importlib
import json
import math
import os
import posixpath
import random
import re
import shlex
import shutil
import signal
import stat
import string
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import NamedTuple, TypedDict
import base64
import errno
import select
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ==================================================================================================
# Start-up: lazy imports and the cached-bytecode launcher
# ==================================================================================================
# Owns what makes a process start fast: standard modules that only some commands need are bound
# here as lazy modules (loaded on first attribute use, so every later section may use them as if
# imported eagerly), and the argv by which agentbench starts its own detached children (supervisors,
# the run driver) so that they import this file as a module and run from a cached .pyc instead of
# compiling it afresh.  It must not read studies, the environment or flags: callers pass the paths.


class LazyModule:
    """A standard module bound now and imported when an attribute is first used; then every
    attribute is cached on this object.  Thread-safe (the import system's module locks make a
    second thread wait for the first import to finish), and never in sys.modules, so an ordinary
    `import x` elsewhere is unaffected.  A submodule is an attribute: `http.server`."""

    def __init__(self, name: str) -> None:
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str) -> Any:
        name = self.__dict__["_lazy_name"]
        module = importlib.import_module(name)
        try:
            value = getattr(module, attr)
        except AttributeError:
            if attr.startswith("__"):
                raise
            try:
                value = importlib.import_module(f"{name}.{attr}")
            except ModuleNotFoundError:
                raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_lazy_name']!r}>"


#: Needed by a few commands only (report, the scripted model, where, check-command typos).
difflib: Any = LazyModule("difflib")
hashlib: Any = LazyModule("hashlib")
html: Any = LazyModule("html")
http: Any = LazyModule("http")
pyplatform: Any = LazyModule("platform")
hmac: Any = LazyModule("hmac")
secrets: Any = LazyModule("secrets")
socket: Any = LazyModule("socket")
ssl: Any = LazyModule("ssl")
statistics: Any = LazyModule("statistics")
fractions: Any = LazyModule("fractions")
urllib: Any = LazyModule("urllib")
zipfile: Any = LazyModule("zipfile")

#: The program a child interpreter runs (with ``-c``): load this file's code object from its path,
#: cached under argv[2] when that is not empty (only this file's: the standard library keeps its
#: own caches), run it as module `agentbench` and exit with main(argv[3:]).
#: No double quotes and no newlines, so that it survives any platform's command-line quoting.
#: Python falls back by itself: a cache it cannot read or write is ignored and the file compiled.
LAUNCHER_CODE = ("import sys,importlib.util as u;s,c=sys.argv[1],sys.argv[2];"
                 "o=sys.pycache_prefix,sys.dont_write_bytecode;sys.pycache_prefix=c or o[0];"
                 "sys.dont_write_bytecode=o[1] and not c;"
                 "p=u.spec_from_file_location('agentbench',s);k=p.loader.get_code('agentbench');"
                 "sys.pycache_prefix,sys.dont_write_bytecode=o;m=u.module_from_spec(p);"
                 "sys.modules['agentbench']=m;"
                 "exec(k,m.__dict__);sys.exit(m.main(sys.argv[3:]))")


def launcher_argv(python: str, source: str, cache_dir: str | None, args: Sequence[str]) -> list[str]:
    """The argv that runs `agentbench <args>` from `source` with `python`, from cached bytecode
    kept under `cache_dir` (a directory agentbench owns; None: Python's default beside the source,
    if it may write there).  Pure: Python makes the directory when it first writes there."""
    return [python, "-c", LAUNCHER_CODE, source, cache_dir or "", *args]

# ==================================================================================================
# Constants
# ==================================================================================================
# The study-wide defaults a user relies on (launch, budget, limits, prices) and the file's fixed
# names.  Numbers that belong to one mechanism (the gateway's, the sandbox's, the report's) live in
# that mechanism's section.  Test-only overrides come from the environment (AGENTBENCH_*), read
# through env_float() so a bad value is an error, not a silent default.  Must not hold logic.

VERSION = "0.1.0"
#: The `claude` release this version of agentbench is tested against (npm @anthropic-ai/claude-code).
CLAUDE_CODE_PINNED = "2.1.332"
HERE = Path(__file__).resolve().parent

STUDY_FILE = "study.json"
STATE_DIR = "state"
#: `list` answers at most this many jobs and runs per call (--limit; --offset pages on).
LIST_LIMIT_DEFAULT = 200
#: Under a study's state dir: the bytecode cache of the supervisors and drivers it starts.
BYTECODE_CACHE_DIR = "pycache"
#: A supervisor copying claude's stream to its raw file flushes it on every poll, and within a
#: burst every this many lines.
RAW_FLUSH_LINES = 256
WAIT_DEFAULT_S = 540.0
WAIT_MAX_S = 570.0
LOCK_TIMEOUT_S = 60.0
#: A lock older than this is stale even when its holder looks alive (a hung holder must not wedge
#: the study forever); generous because finalisation is short and nothing holds the lock for long.
LOCK_STALE_S = 300.0

#: errno values of a write the file system refused (read-only, full, over quota, not permitted):
#: a clear refusal (exit 2), not an internal error.
WRITE_REFUSED_ERRNOS = frozenset(getattr(errno, name)
                                 for name in ("EROFS", "ENOSPC", "EDQUOT", "EACCES", "EPERM")
                                 if hasattr(errno, name))
#: The registry.json layout this version writes; a registry of another version is refused.
REGISTRY_VERSION = 1
JOB_FINAL_STATUSES = ("ok", "failed", "timeout", "killed", "lost")
JOB_STATUSES = ("created", "queued", "running") + JOB_FINAL_STATUSES
#: Model aliases are refused: a study must name the exact model it measures.
MODEL_ALIASES = ("opus", "sonnet", "haiku", "default", "opusplan", "best", "sonnet[1m]", "opus[1m]")
MODEL_ID_RE = re.compile(r"^claude-[a-z0-9][a-z0-9.\-]*[0-9][a-z0-9.\-]*$")

#: USD per million tokens: (input, output, cache write 5m, cache write 1h, cache read).  Used only
#: to estimate the cost of a session that was killed before it reported its own total.
PRICES_PER_MTOK: dict[str, tuple[float, float, float, float, float]] = {
    "claude-opus-4-5": (5.0, 25.0, 6.25, 10.0, 0.50),
    "claude-opus-4-6": (5.0, 25.0, 6.25, 10.0, 0.50),
    "claude-opus-4-1": (15.0, 75.0, 18.75, 30.0, 1.50),
    "claude-opus-4": (15.0, 75.0, 18.75, 30.0, 1.50),
    "claude-sonnet-4": (3.0, 15.0, 3.75, 6.0, 0.30),
    "claude-3-7-sonnet": (3.0, 15.0, 3.75, 6.0, 0.30),
    "claude-haiku-4-5": (1.0, 5.0, 1.25, 2.0, 0.10),
    "claude-3-5-haiku": (0.80, 4.0, 1.0, 1.6, 0.08),
}
DEFAULT_PRICE = (5.0, 25.0, 6.25, 10.0, 0.50)

#: The study setting `gateway`: "on" (the default) or "off" (claude gets the credentials itself).
GATEWAY_MODES = ("on", "off")
GATEWAY_DEFAULT = "on"
DEFAULT_TOOLS = "Bash,Read,Edit,Write,Glob,Grep"
DEFAULT_LAUNCH: dict[str, Any] = {
    "model": "claude-opus-4-5",
    "effort": "high",
    "permission_mode": "dontAsk",
    "tools": DEFAULT_TOOLS,
    "allowed_tools": DEFAULT_TOOLS,
    "disallowed_tools": "",
    "binary": None,
    "parallel": 4,
    "max_minutes": 60,
    "stall_after_s": 300,
    "orphan_after_s": 0,
    "executor": "local",
    "slurm": None,
    # Every copy or read agentbench makes of what a session left (workspaces, snapshots, review
    # copies, transcripts) stops at these caps, in MB: per file and per copy (apparent sizes); a
    # session whose workspace holds more than `workspace_mb` of real blocks is ended.
    "copy_file_mb": 256,
    "copy_total_mb": 1024,
    "workspace_mb": 1024,
}
#: Slurm job states in which a submitted supervisor is still queued, starting, running or being
#: cleaned up: the job is not lost while Slurm reports one of these (squeue's %T names).
SLURM_LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "SUSPENDED", "COMPLETING", "REQUEUED",
                               "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT",
                               "STOPPED", "RESV_DEL_HOLD", "POWER_UP_NODE"})
#: Keys of a study's `slurm` object.
SLURM_KEYS = ("partition", "sbatch_args", "python", "time_margin_s")
DEFAULT_BUDGET: dict[str, Any] = {"usd_per_run": 5.0, "wall_s": 3600, "max_turns": 200,
                                  "study_usd": 200.0, "min_remaining_usd": 0.05, "unbounded_request_usd": 0.0}
#: The supervisor's own budget backstop.  `claude` enforces --max-budget-usd itself, after the
#: request that crossed it; the supervisor stops a session whose list-price estimate passes the
#: budget by this factor plus this pad (an estimate, so only a clear overrun counts).
BUDGET_BACKSTOP_FACTOR = 1.25
BUDGET_BACKSTOP_PAD_USD = 0.01
#: The shortest wall limit a run's next session gets when its run has almost no wall time left.
MIN_SESSION_WALL_S = 5.0
#: A keep-warm ping of a base (`tick`): one short turn, outside every run's budget.  Its budget is
#: a ceiling, not its cost (mostly cache reads): the gateway reserves one token per byte of the
#: request, so a base of about 190 KB of context still fits at the dearest default price.
PING_LIMITS: dict[str, Any] = {"wall_s": 300, "max_turns": 1, "max_budget_usd": 2.0, "stall_after_s": 120,
                               "orphan_after_s": 0}
#: The rehearsal's training of a per-task base: a few scripted turns.
TRAIN_REHEARSAL_WALL_S = 600
TRAIN_REHEARSAL_STALL_AFTER_S = 300
#: A Slurm job asks for its wall limit plus this margin (start-up, finalisation) unless the
#: study's `slurm.time_margin_s` or its own sbatch_args say otherwise.
SLURM_TIME_MARGIN_DEFAULT_S = 600.0
#: `tick --every`: a base not pinged for this long is pinged.
TICK_EVERY_DEFAULT_S = 240.0
#: `assign --power-base`: the baseline success rate a power plan assumes.
POWER_BASE_DEFAULT = 0.5


# ==================================================================================================
# Errors and output
# ==================================================================================================
# One error type carries the exit code and the JSON payload (with a hint where the user can act).
# This section formats; only main() prints to stdout.  log() is the one stderr writer.
# Owns the error type (a machine-readable `code` on every refusal) and the output format.  Must not
# print to stdout or exit: callers raise, main() answers.

class AgentbenchError(Exception):
    """The one error type: a machine-readable code, exit code + JSON payload (+ optional hint).

    Raised anywhere below main(); main() prints ``payload`` as the command's one JSON object and
    returns ``exit_code``.  2 = usage error or refusal; 3 and 4 are used by `wait`.  ``code`` (also
    ``payload["code"]``) is what callers and tests tell errors apart by; the message is for people
    and may be reworded.
    """

    def __init__(self, message: str, *, code: str = "error", exit_code: int = 2, hint: str | None = None,
                 **fields: Any):
        super().__init__(message)
        self.code = code
        self.exit_code = exit_code
        self.payload: dict[str, Any] = {"error": message, "code": code, **fields}
        if hint:
            self.payload["hint"] = hint

    def one_line(self) -> str:
        """The message and the rest of the payload on one line (for a warning or a log)."""
        rest = {k: v for k, v in self.payload.items() if k not in ("error", "code")}
        return self.payload["error"] + (" " + json.dumps(rest, sort_keys=True, default=str) if rest else "")


def json_line(obj: Any) -> str:
    """The one serialisation of command output: compact, sorted keys, newline-terminated.  Text
    that cannot be UTF-8 (a lone surrogate: a file name's undecodable byte) is written as a JSON
    escape instead of failing the command."""
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj, sort_keys=True, ensure_ascii=True, default=str)
    return text + "\n"


_LOG_QUIET = False


def log(msg: str) -> None:
    """Progress and diagnostics: stderr only, never stdout (stdout carries exactly one object)."""
    if _LOG_QUIET:
        return
    try:
        sys.stderr.write(f"agentbench: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def utc_now() -> str:
    """An ISO-8601 UTC timestamp with milliseconds, for records humans read."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 16), b""):
            h.update(chunk)
    return h.hexdigest()


# -- environment overrides (test and tuning knobs) -------------------------------------------------

def env_float(name: str, default: float) -> float:
    """A finite float from the environment (test and tuning overrides), or `default` when unset."""
    # This process's own environment: a tuning knob is set where a process starts, and its
    # detached children (supervisors, the run driver) inherit it from there.
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise AgentbenchError(f"{name} must be a number", code="env_not_a_number", value=raw) from None
    if not math.isfinite(value):
        # A NaN compares false with every age and an infinity never passes: either would turn a
        # loss window or a poll interval into "always" or "never", silently.
        raise AgentbenchError(f"{name} must be a finite number", code="env_not_a_number", value=raw)
    return value


def lost_after_s() -> float:
    """Heartbeat age after which a job whose supervisor is dead is declared lost (SPEC: 120 s)."""
    return env_float("AGENTBENCH_LOST_AFTER_S", 120.0)


def heartbeat_s() -> float:
    """How often a supervisor refreshes its heartbeat (at most every 10 s by contract)."""
    return min(10.0, env_float("AGENTBENCH_HEARTBEAT_S", 2.0))


#: How many loss windows a job whose supervisor cannot be checked is given before its stale
#: heartbeat alone makes it lost.
UNKNOWN_LOSS_FACTOR = 10


def slurm_poll_s() -> float:
    """How long one process reuses a Slurm job state it read: a driver polling queued jobs must
    not hammer the controller with a squeue call per job per poll."""
    return env_float("AGENTBENCH_SLURM_POLL_S", 10.0)


# ==================================================================================================
# Hostile numbers
# ==================================================================================================
# Owns the checks every number from outside passes before it reaches a sum, a cap or a file: a
# stream event, a result, a receipt, a registry or ledger line.  Python's json module reads 1e400
# and Infinity as inf, NaN as nan, and 10**400 as an exact int; none of these may reach arithmetic.
# These helpers never raise on a value: what is not a finite number of the right type and range is
# rejected (None, or 0 for a count) and described in the caller's `anomalies` list, which the
# caller records (a result's `anomalies`).  Pure: no I/O, and no knowledge of where values come from.

#: Largest token count one usage field may carry (a million-token context times 100,000 turns).
MAX_TOKEN_COUNT = 10**11
#: Largest amount in USD one reported cost may carry; beyond it the figure is not believed.
MAX_USD_VALUE = 1e6
#: At most this many anomalies are kept per record (a hostile stream can repeat one forever).
MAX_ANOMALIES = 50
ANOMALY_VALUE_CHARS = 60


def note_anomaly(anomalies: list[dict[str, Any]] | None, where: str, value: Any, why: str) -> None:
    """Append one anomaly (where, a short repr of the value, why) unless the list is full."""
    if anomalies is None or len(anomalies) >= MAX_ANOMALIES:
        return
    try:
        shown = repr(value)
    except Exception:  # a repr of a foreign value must not raise here
        shown = f"<{type(value).__name__}>"
    if len(shown) > ANOMALY_VALUE_CHARS:
        shown = shown[:ANOMALY_VALUE_CHARS] + "..."
    anomalies.append({"where": where, "value": shown, "why": why})


def finite_number(value: Any, *, lo: float | None = None, hi: float | None = None,
                  anomalies: list[dict[str, Any]] | None = None, where: str = "") -> float | None:
    """`value` as a finite float within [lo, hi]; None (plus an anomaly) when it is a bool, not a
    number, not finite or out of range.  None in gives None out with no anomaly (an absent field)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        note_anomaly(anomalies, where, value, "not a number")
        return None
    if isinstance(value, int):
        # An exact int can be too large for a float: compare before converting.
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            note_anomaly(anomalies, where, value, "out of range")
            return None
        try:
            return float(value)
        except OverflowError:
            note_anomaly(anomalies, where, value, "out of range")
            return None
    if not math.isfinite(value):
        note_anomaly(anomalies, where, value, "not finite")
        return None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        note_anomaly(anomalies, where, value, "out of range")
        return None
    return float(value)


def count_from(value: Any, *, anomalies: list[dict[str, Any]] | None = None, where: str = "",
               hi: int = MAX_TOKEN_COUNT) -> int:
    """A token (or other) count: a whole number in [0, hi]; absent gives 0, anything else 0 plus
    an anomaly (a fractional count is truncated and flagged)."""
    if type(value) is int and 0 <= value <= hi:   # the common case, answered without a float
        return value
    f = finite_number(value, lo=0, hi=hi, anomalies=anomalies, where=where)
    if f is None:
        return 0
    if f != int(f):
        note_anomaly(anomalies, where, value, "not a whole number")
    return int(f)


def usd_from(value: Any, *, anomalies: list[dict[str, Any]] | None = None, where: str = "",
             hi: float = MAX_USD_VALUE) -> float | None:
    """An amount in USD: finite, in [0, hi]; None when absent or (plus an anomaly) not believable."""
    return finite_number(value, lo=0.0, hi=hi, anomalies=anomalies, where=where)


def spend_from(value: Any, *, anomalies: list[dict[str, Any]] | None = None, where: str = "") -> float:
    """An amount that is added to a spend a cap is held against: it fails closed.  Absent or
    negative counts 0 (an anomaly when negative); not a number, not finite or beyond belief counts
    MAX_USD_VALUE (an anomaly), so that a hostile figure spends the cap instead of vanishing."""
    if value is None:
        return 0.0
    got = finite_number(value, lo=0.0, hi=MAX_USD_VALUE)
    if got is not None:
        return got
    # (Compared, never converted: an integer too large for a float must not raise here.)
    bad = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value < 0
    note_anomaly(anomalies, where, value, "negative" if bad else "not a believable amount: counted in full")
    return 0.0 if bad else MAX_USD_VALUE


def json_safe(value: Any, *, anomalies: list[dict[str, Any]] | None = None, where: str = "") -> Any:
    """A copy of a JSON-ready value in which every non-finite float is None (each one an anomaly),
    so that the file it goes to stays valid JSON (json.dumps(allow_nan=False) accepts it)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        note_anomaly(anomalies, where, value, "not finite")
        return None
    if isinstance(value, dict):
        return {k: json_safe(v, anomalies=anomalies, where=f"{where}.{k}" if where else str(k))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, anomalies=anomalies, where=f"{where}[{i}]") for i, v in enumerate(value)]
    return value


# ==================================================================================================
# Fault points
# ==================================================================================================
# Owns the named points where the fault suite (tests/test_faults.py) makes a process fail on
# purpose: AGENTBENCH_FAULT_AT=POINT:ACTION (ACTION `kill`: SIGKILL this process; `raise`: an
# exception), with an optional third field N to act at the N-th pass only; AGENTBENCH_FAULT_LOG
# names a file that gets one line (the point's name) per fault acted on, so a suite counts what
# it did.  Unset (the normal case) a fault point does nothing.  Must not change behaviour in any
# other way; a malformed setting is ignored rather than fatal (it reaches supervisors through their
# environment).

FAULT_AT_ENV = "AGENTBENCH_FAULT_AT"
FAULT_LOG_ENV = "AGENTBENCH_FAULT_LOG"
_FAULT_PASSES: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """The exception a `raise` fault point throws."""


def fault_point(name: str) -> None:
    """Act on AGENTBENCH_FAULT_AT when it names this point (see the banner); else do nothing."""
    # This process's own environment: a fault is set where the process under test starts.
    spec = os.environ.get(FAULT_AT_ENV)
    if not spec:
        return
    point, _, rest = spec.partition(":")
    if point != name:
        return
    action, _, nth = rest.partition(":")
    _FAULT_PASSES[name] = _FAULT_PASSES.get(name, 0) + 1
    if nth.isdigit() and _FAULT_PASSES[name] != int(nth):
        return
    log_path = os.environ.get(FAULT_LOG_ENV)
    if log_path and action in ("kill", "raise"):
        with contextlib.suppress(OSError):
            fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{name}\n".encode())
            finally:
                os.close(fd)
    if action == "kill":
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
        time.sleep(5)  # the signal is asynchronous: never run on past the point
    elif action == "raise":
        raise InjectedFault(f"fault injected at {name}")


# ==================================================================================================
# Platform seam
# ==================================================================================================
# Every difference between operating systems lives here: path normalisation, process identity
# (pid + creation time), process tables and trees, signalling and tree kills, detached launches,
# no-replace renames and the flags every helper process needs. Nothing outside this section looks
# at os.name or sys.platform; it asks current_platform() instead. The Windows class imports ctypes
# lazily inside its methods, so it can be constructed (and its pure logic tested) on any OS, and
# every real OS call sits behind a small method that tests replace. This section never prints and
# never exits; failures it cannot absorb become AgentbenchError.


@dataclass(frozen=True)
class ProcId:
    """A process identity: pid plus creation time (epoch seconds).

    A bare pid is not an identity: pids are reused, and signalling a reused pid kills a stranger.
    Every stored pid is therefore a ProcId. ``ctime`` is None only when the creation time could not
    be read; such an identity degrades to pid-only matching, so callers should avoid storing it.
    """

    pid: int
    ctime: float | None

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in runtime files: ``{"pid": int, "ctime": float | null}``."""
        return {"pid": self.pid, "ctime": self.ctime}

    @classmethod
    def from_json(cls, obj: Any) -> "ProcId":
        """Read the form written by to_json (a ``[pid, ctime]`` pair is accepted too).

        A malformed value is refused with AgentbenchError rather than guessed at, because a wrong
        identity could later be signalled.
        """
        pid: Any
        ctime: Any
        if isinstance(obj, Mapping):
            pid, ctime = obj.get("pid"), obj.get("ctime")
        elif isinstance(obj, (list, tuple)) and len(obj) == 2:
            pid, ctime = obj
        else:
            raise AgentbenchError("malformed process identity", code="malformed_process_identity",
                                  value=repr(obj)[:200])
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise AgentbenchError("malformed process identity", code="malformed_process_identity",
                                  value=repr(obj)[:200])
        if ctime is not None:
            if isinstance(ctime, bool) or not isinstance(ctime, (int, float)):
                raise AgentbenchError("malformed process identity", code="malformed_process_identity",
                                      value=repr(obj)[:200])
            ctime = float(ctime)
        return cls(pid, ctime)


class _ProcInfo(NamedTuple):
    """One row of an internal process scan. Index 0/1 match process_table's (ppid, ctime)."""

    ppid: int
    ctime: float | None
    pgid: int | None  # POSIX only
    sid: int | None  # POSIX only


def read_detach_env_file(path: str, *, remove: bool = True) -> dict[str, str]:
    """Load the environment written by Platform.detach_env_file (the detached child calls this).

    The file holds the child's whole environment, credentials included, so it is removed as soon
    as it has been read unless ``remove`` is False.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise AgentbenchError("cannot read detach env file", code="cannot_read_detach_env_file",
                              path=path, detail=str(exc)) from exc
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise AgentbenchError("malformed detach env file", code="malformed_detach_env_file", path=path)
    if remove:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return dict(env)


class Platform:
    """Base of the seam. Generic algorithms (trees, snapshots, the tree-kill loop) live here,
    built on a few primitives each subclass provides (``_scan``, ``is_alive``,
    ``_signal_round``, ...). The method names are the contract the rest of the program calls."""

    name: str = "abstract"
    #: How far two reads of the same process's creation time may differ and still match.
    ctime_tolerance_s: float = 1.0
    #: Rounds of re-snapshot + hard kill after the graceful round of kill_tree.
    kill_rounds: int = 4

    # -- paths -------------------------------------------------------------------------------------

    def normalize_path(self, raw: str, *, cwd: str | None = None) -> str:
        """Absolute, normalised form of a user-supplied path, computed without touching the disk.

        Relative paths are taken against ``cwd`` (default: the current directory).
        """
        raise NotImplementedError

    # -- process identity --------------------------------------------------------------------------

    def hostname(self) -> str:
        """This machine's name: a pid identifies a process only on the host that recorded it."""
        return socket.gethostname()

    def is_local(self, record: Mapping[str, Any] | None) -> bool:
        """True when a recorded process (a dict with an optional `host`) ran on this host; records
        written before hosts were recorded count as local."""
        host = (record or {}).get("host")
        return host is None or host == self.hostname()

    def process_ctime(self, pid: int) -> float | None:
        """Creation time (epoch seconds) of process ``pid``; None if there is no such process."""
        raise NotImplementedError

    def proc_id(self, pid: int) -> ProcId | None:
        """The identity of the process now holding ``pid``, or None if there is none."""
        ctime = self.process_ctime(pid)
        if ctime is None:
            return None
        return ProcId(pid, ctime)

    def is_alive(self, p: ProcId) -> bool:
        """True when a running process holds ``p.pid`` AND it has ``p.ctime`` as creation time."""
        raise NotImplementedError

    def _same_ctime(self, actual: float | None, expected: float | None) -> bool:
        # An identity without a creation time can only be matched by pid (documented weakness).
        if expected is None:
            return True
        if actual is None:
            return False
        return abs(actual - expected) <= self.ctime_tolerance_s

    # -- process tables and trees ------------------------------------------------------------------

    def _scan(self) -> dict[int, _ProcInfo]:
        """Every running (non-zombie) process, pid -> _ProcInfo."""
        raise NotImplementedError

    def process_table(self) -> dict[int, tuple[int, float | None]]:
        """pid -> (ppid, creation time) of every running process."""
        return {pid: (info.ppid, info.ctime) for pid, info in self._scan().items()}

    @staticmethod
    def _children_index(table: Mapping[int, Sequence[Any]]) -> dict[int, list[int]]:
        kids: dict[int, list[int]] = {}
        for pid, row in table.items():
            kids.setdefault(row[0], []).append(pid)
        for lst in kids.values():
            lst.sort()
        return kids

    def descendants(
        self,
        root: ProcId,
        table: Mapping[int, Sequence[Any]] | None = None,
        alive_until: float | None = None,
    ) -> list[ProcId]:
        """Snapshot of the processes below ``root`` (root itself excluded), parents before children.

        A child counts only if it was created at or after its parent, which rejects a process whose
        stale ppid happens to equal a reused pid. If ``root`` is dead (or its pid now belongs to
        another process) its children are accepted only if created after the root started and
        before ``alive_until`` (when given) and before the pid's new occupant (when there is one).
        On POSIX a dead root's children have been re-parented, so nothing is found here; use
        tree_snapshot's ``session_ids`` for those.
        """
        if table is None:
            table = self.process_table()
        return self._descend(root, table, alive_until, self._children_index(table))

    def _descend(
        self,
        root: ProcId,
        table: Mapping[int, Sequence[Any]],
        alive_until: float | None,
        kids: Mapping[int, list[int]],
    ) -> list[ProcId]:
        row = table.get(root.pid)
        root_alive = row is not None and self._same_ctime(row[1], root.ctime)
        lower: float | None
        slack = 0.0
        until: float | None = None
        occupant: float | None = None
        if root_alive:
            # Compare against the table's own reading: within one scan the comparison is exact.
            lower = row[1] if row is not None else None
        else:
            if root.ctime is None:
                return []  # a dead root of unknown age: nothing can be told apart safely
            lower, slack, until = root.ctime, self.ctime_tolerance_s, alive_until
            if row is not None:
                if row[1] is None:
                    return []  # pid reused by a process of unknown age: refuse to guess
                occupant = row[1]

        def first_level_ok(ct: float | None) -> bool:
            if lower is None:
                return True
            if ct is None or ct < lower - slack:
                return False
            if until is not None and ct > until + slack:
                return False
            # Children of the pid's new occupant were created after it; the dead root's were not.
            if occupant is not None and ct >= occupant:
                return False
            return True

        out: list[ProcId] = []
        seen = {root.pid}
        frontier: list[int] = []
        for child in kids.get(root.pid, []):
            if child not in seen and first_level_ok(table[child][1]):
                seen.add(child)
                frontier.append(child)
                out.append(ProcId(child, table[child][1]))
        while frontier:
            nxt: list[int] = []
            for parent in frontier:
                pct = table[parent][1]
                for child in kids.get(parent, []):
                    if child in seen:
                        continue
                    cct = table[child][1]
                    if pct is not None and (cct is None or cct < pct):
                        continue
                    seen.add(child)
                    nxt.append(child)
                    out.append(ProcId(child, cct))
            frontier = nxt
        return out

    def tree_snapshot(
        self,
        roots: Sequence[ProcId],
        session_ids: Sequence[int] = (),
        alive_until: float | None = None,
    ) -> list[ProcId]:
        """The live roots, their descendants and (POSIX) the members of ``session_ids``.

        A session member counts if it was created at or after the earliest root started. When every
        root is dead and ``alive_until`` is given, members created after ``alive_until`` count only
        if the session still holds a member from the root's lifetime: a session id cannot be reused
        while the session has members, so such a session is provably still the root's. Session
        members' own descendants are included. Windows has no sessions here; ``session_ids`` is
        ignored there.
        """
        scan = self._scan()
        return self._snapshot(scan, [(r, alive_until) for r in roots], roots, alive_until,
                              session_ids, ())

    def _snapshot(
        self,
        scan: Mapping[int, _ProcInfo],
        walk_roots: Sequence[tuple[ProcId, float | None]],
        anchors: Sequence[ProcId],
        anchors_until: float | None,
        session_ids: Sequence[int],
        group_ids: Sequence[int],
    ) -> list[ProcId]:
        kids = self._children_index(scan)
        out: dict[int, ProcId] = {}

        def add(pid: int) -> None:
            if pid not in out:
                out[pid] = ProcId(pid, scan[pid].ctime)

        for root, until in walk_roots:
            info = scan.get(root.pid)
            if info is not None and self._same_ctime(info.ctime, root.ctime):
                add(root.pid)
            for d in self._descend(root, scan, until, kids):
                add(d.pid)

        if session_ids or group_ids:
            anchors_alive = any(
                r.pid in scan and self._same_ctime(scan[r.pid].ctime, r.ctime) for r in anchors
            )
            starts = [r.ctime for r in anchors if r.ctime is not None]
            lower = min(starts) - self.ctime_tolerance_s if starts else None
            upper = None if anchors_alive or anchors_until is None else (
                anchors_until + self.ctime_tolerance_s)
            for attr, wanted in (("sid", session_ids), ("pgid", group_ids)):
                for ident in wanted:
                    members = [
                        pid for pid, info in scan.items()
                        if getattr(info, attr) == ident
                        and (lower is None or (info.ctime is not None and info.ctime >= lower))
                    ]
                    if upper is not None and not any(
                        scan[m].ctime is not None and scan[m].ctime <= upper for m in members
                    ):
                        # Nobody from the root's lifetime left: the id may have been reused.
                        continue
                    for m in sorted(members):
                        add(m)
                        for d in self._descend(ProcId(m, scan[m].ctime), scan, None, kids):
                            add(d.pid)
        return list(out.values())

    # -- signalling --------------------------------------------------------------------------------

    def terminate(self, p: ProcId) -> None:
        """Ask ``p`` to stop (SIGTERM; TerminateProcess on Windows). Does nothing if ``p`` is not
        alive with that identity; never signals a reused pid."""
        raise NotImplementedError

    def kill(self, p: ProcId) -> None:
        """Stop ``p`` now (SIGKILL; TerminateProcess on Windows), with the same identity check."""
        raise NotImplementedError

    def _protected_pids(self, scan: Mapping[int, _ProcInfo]) -> set[int]:
        """This process and its ancestors: a tree kill never reaches them, whatever it is given."""
        protected = {0, 1, os.getpid()}
        pid = os.getpid()
        while pid in scan and scan[pid].ppid not in protected:
            pid = scan[pid].ppid
            protected.add(pid)
        return protected

    def _signal_round(self, targets: list[ProcId], scan: Mapping[int, _ProcInfo],
                      groups: set[int], roots: Sequence[ProcId], hard: bool, first: bool) -> None:
        raise NotImplementedError

    def _wait_dead(self, targets: Sequence[ProcId], timeout_s: float) -> None:
        deadline = time.monotonic() + max(0.0, timeout_s)
        pending = list(targets)
        while True:
            pending = [p for p in pending if self.is_alive(p)]
            if not pending or time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def kill_tree(
        self,
        roots: Sequence[ProcId],
        session_ids: Sequence[int] = (),
        grace_s: float = 2.0,
        alive_until: float | None = None,
    ) -> list[ProcId]:
        """Kill ``roots`` with their whole trees and return the survivors ([] means success).

        Snapshot first (so children orphaned by the kill are still known), a graceful round, up to
        ``grace_s`` of waiting, then rounds of re-snapshot + hard kill that also catch children
        spawned meanwhile, then a final verifying snapshot. ``session_ids`` and ``alive_until`` have
        the tree_snapshot meaning. This process and its ancestors are never signalled. On POSIX
        the process groups led by tree members are signalled as a whole as well.
        """
        roots = list(roots)
        known: dict[int, tuple[ProcId, float]] = {}  # pid -> (identity, last seen alive)
        groups: set[int] = set()

        def snapshot() -> tuple[list[ProcId], dict[int, _ProcInfo]]:
            scan = self._scan()
            now = time.time()
            walk = [(r, alive_until) for r in roots] + [(p, seen) for p, seen in known.values()]
            snap = self._snapshot(scan, walk, roots, alive_until, session_ids, sorted(groups))
            protected = self._protected_pids(scan)
            live = [p for p in snap if p.pid not in protected]
            for p in live:
                known[p.pid] = (p, now)
                info = scan.get(p.pid)
                if info is not None and info.pgid == p.pid:
                    groups.add(p.pid)
            return live, scan

        live, scan = snapshot()
        if not live:
            return []
        self._signal_round(live, scan, groups, roots, hard=False, first=True)
        self._wait_dead(live, grace_s)
        for _ in range(self.kill_rounds):
            live, scan = snapshot()
            if not live:
                return []
            self._signal_round(live, scan, groups, roots, hard=True, first=False)
            self._wait_dead(live, 1.0)
        live, _unused = snapshot()
        return live

    # -- launching and files -----------------------------------------------------------------------

    def helper_popen_kwargs(self) -> dict[str, Any]:
        """Extra subprocess kwargs for every helper process this program starts."""
        return {}

    def tree_popen_kwargs(self) -> dict[str, Any]:
        """Popen kwargs for a child whose whole tree must be killable later (its own group/session)."""
        return dict(self.helper_popen_kwargs())

    def _run_helper(self, cmd: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """Run a short helper command, capturing text output (tests replace this)."""
        return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s, check=False, **self.helper_popen_kwargs())

    def detach_env_file(self, env: Mapping[str, str], log_path: str) -> str | None:
        """Where the detached child must load its environment from, or None if the environment
        passed to detach_argv_popen reaches it directly. When a path is returned the caller adds
        ``--env-file PATH`` to the child's argv and the child calls read_detach_env_file(PATH)."""
        return None

    def detach_argv_popen(self, argv: Sequence[str], cwd: str, env: Mapping[str, str],
                          log_path: str, stdin_data: bytes | None = None) -> int:
        """Start ``argv`` fully detached (it survives its caller and a closed terminal); its pid.
        ``stdin_data`` (small) is written to the child's stdin, which is then closed."""
        raise NotImplementedError

    def rename_no_replace(self, src: str, dst: str) -> bool:
        """Atomically rename ``src`` to ``dst`` unless ``dst`` exists. False if ``dst`` exists or
        ``src`` is gone (someone else moved it first); used to break stale locks safely."""
        raise NotImplementedError

    def boot_id(self) -> str | None:
        """An identifier of the current boot, when the OS offers one."""
        return None

    def file_lock(self, path: str | os.PathLike[str], timeout_s: float = 60.0) -> Any:
        """A context manager holding an exclusive lock on ``path`` (created if missing), released
        on exit and by the OS when the holder dies (so it is never stale).  For short, frequent
        critical sections (the gateway's reservations) where a lock file's create, fsync and
        unlink would cost more than the work."""
        raise NotImplementedError

    @staticmethod
    def _poll_lock(try_lock: Callable[[], Any], busy: type[BaseException], timeout_s: float,
                   path: str | os.PathLike[str]) -> None:
        """Call `try_lock` (a non-blocking attempt that raises `busy` while another holds the
        lock) every millisecond until it succeeds; refuse (lock_timed_out) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                try_lock()
                return
            except busy:
                if time.monotonic() > deadline:
                    raise AgentbenchError("lock timed out", code="lock_timed_out", lock=str(path)) from None
                time.sleep(0.001)

    def become_subreaper(self) -> bool:
        """Make this process the adopter of its orphaned descendants (Linux: a child subreaper),
        so that a process that left its session and parent (nohup ... &, a double fork with
        setsid) is still found below it.  False where the OS offers none or refuses; never raises."""
        return False

    def reap_zombies(self, keep: Iterable[int] = ()) -> None:
        """Collect the exit status of this process's finished children (adopted orphans), except
        the pids in `keep` (a child whose status someone else waits for)."""
        return None

    def marked_processes(self, name: str, value: str) -> list[ProcId]:
        """Live processes whose environment holds `name=value` (a job's mark, inherited by every
        process of its session wherever it moved); [] where environments cannot be read."""
        return []


# -- POSIX -----------------------------------------------------------------------------------------


class _ProcStat(NamedTuple):
    ppid: int
    pgid: int
    sid: int
    state: str
    start_ticks: int


_WINDOWS_DRIVE_RE = re.compile(r"^[A-Za-z]:[\\/]")


class PosixPlatform(Platform):
    """Linux-style POSIX: creation times and the process table from /proc, detach via setsid,
    process-group kill plus per-pid sweep."""

    name = "posix"
    # /proc start times are 10 ms ticks added to btime, an integer that the kernel recomputes from
    # the wall clock (it can move by a second between reads, or more after a clock step).
    ctime_tolerance_s = 1.0

    def tree_popen_kwargs(self) -> dict[str, Any]:
        """A new session: a tree kill can then find every process the child left behind."""
        return {"start_new_session": True}

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc = proc_root
        self._btime: float | None = None
        self._hz: int | None = None
        self._renameat2: Any = None  # None = not probed yet, False = unavailable
        self._has_proc: bool | None = None
        # Detached children started by this process: kept referenced so that they are reaped by
        # poll() (no zombie piles up in a long-running caller) instead of being garbage-collected
        # while running (which warns).
        self._detached: list[subprocess.Popen] = []

    # -- paths -------------------------------------------------------------------------------------

    def normalize_path(self, raw: str, *, cwd: str | None = None) -> str:
        """expanduser + absolute + normpath, without resolving symlinks or touching the disk.
        A Windows drive path (``C:\\x``) is refused with a hint: it is never meant literally."""
        if not isinstance(raw, str) or not raw.strip() or "\0" in raw:
            raise AgentbenchError("empty or invalid path", code="empty_invalid_path", path=str(raw))
        if _WINDOWS_DRIVE_RE.match(raw):
            raise AgentbenchError(
                "Windows path given on a POSIX system", code="windows_path_given_posix_system", path=raw,
                hint="under WSL use /mnt/<drive>/..., e.g. /mnt/c/Users/...")
        path = posixpath.expanduser(raw)
        if not path.startswith("/"):
            path = posixpath.join(cwd if cwd is not None else os.getcwd(), path)
        return posixpath.normpath(path)

    # -- /proc -------------------------------------------------------------------------------------

    def _hz_value(self) -> int:
        if self._hz is None:
            try:
                self._hz = int(os.sysconf("SC_CLK_TCK"))
            except (ValueError, OSError, AttributeError):
                self._hz = 100
        return self._hz

    def _boot_time(self) -> float:
        # Read once per process: within one process every ctime then uses the same base, so
        # comparisons inside one scan are exact.
        if self._btime is None:
            btime = 0.0
            try:
                with open(os.path.join(self._proc, "stat"), encoding="ascii") as fh:
                    for line in fh:
                        if line.startswith("btime "):
                            btime = float(line.split()[1])
                            break
            except OSError:
                pass
            self._btime = btime
        return self._btime

    def _require_proc(self) -> None:
        # Without /proc every process would look dead (and every supervisor lost): fail loudly.
        if self._has_proc is None:
            self._has_proc = os.path.exists(os.path.join(self._proc, "self", "stat"))
        if not self._has_proc:
            raise AgentbenchError(
                "process inspection needs /proc", code="process_inspection_needs_proc", proc_root=self._proc,
                hint="this POSIX support reads /proc (Linux, WSL); other systems are not supported")

    def _read_stat(self, pid: int) -> _ProcStat | None:
        self._require_proc()
        try:
            with open(os.path.join(self._proc, str(pid), "stat"), "rb") as fh:
                data = fh.read().decode("ascii", "replace")
        except (OSError, ValueError):
            return None
        # The command name (field 2) is in parentheses and may itself hold spaces or ')'.
        _head, sep, rest = data.rpartition(")")
        if not sep:
            return None
        fields = rest.split()
        try:
            # fields[0] is field 3 (state); field n is fields[n - 3].
            return _ProcStat(ppid=int(fields[1]), pgid=int(fields[2]), sid=int(fields[3]),
                         state=fields[0], start_ticks=int(fields[19]))
        except (IndexError, ValueError):
            return None

    def _ctime_of(self, st: _ProcStat) -> float:
        return round(self._boot_time() + st.start_ticks / self._hz_value(), 3)

    def process_ctime(self, pid: int) -> float | None:
        st = self._read_stat(pid)
        return None if st is None else self._ctime_of(st)

    def is_alive(self, p: ProcId) -> bool:
        st = self._read_stat(p.pid)
        if st is None or st.state in ("Z", "X", "x"):
            return False  # a zombie has finished running; only its exit status remains
        return self._same_ctime(self._ctime_of(st), p.ctime)

    def _scan(self) -> dict[int, _ProcInfo]:
        self._require_proc()
        out: dict[int, _ProcInfo] = {}
        try:
            names = os.listdir(self._proc)
        except OSError:
            return out
        for name in names:
            if not name.isdigit():
                continue
            st = self._read_stat(int(name))
            if st is None or st.state in ("Z", "X", "x"):
                continue
            out[int(name)] = _ProcInfo(st.ppid, self._ctime_of(st), st.pgid, st.sid)
        return out

    #: prctl option number of PR_SET_CHILD_SUBREAPER (linux/prctl.h).
    PR_SET_CHILD_SUBREAPER = 36

    def become_subreaper(self) -> bool:
        if not sys.platform.startswith("linux"):
            return False
        try:
            import ctypes  # lazy: only a supervisor needs it
            libc = ctypes.CDLL(None, use_errno=True)
            return libc.prctl(self.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
        except (OSError, AttributeError, ImportError, ValueError):
            return False

    def marked_processes(self, name: str, value: str) -> list[ProcId]:
        needle = f"{name}={value}".encode()
        out: list[ProcId] = []
        try:
            pids = [int(n) for n in os.listdir(self._proc) if n.isdigit()]
        except OSError:
            return []
        for pid in pids:
            if pid == os.getpid():
                continue
            try:
                with open(os.path.join(self._proc, str(pid), "environ"), "rb") as fh:
                    env = fh.read()
            except OSError:
                continue   # gone, or not ours to read
            if needle in env.split(b"\0"):
                st = self._read_stat(pid)
                if st is not None and st.state not in ("Z", "X", "x"):
                    out.append(ProcId(pid, self._ctime_of(st)))
        return out

    def reap_zombies(self, keep: Iterable[int] = ()) -> None:
        keep_set = set(keep)
        me = os.getpid()
        try:
            scan = self._scan()
        except (OSError, AgentbenchError):
            return
        for pid, info in scan.items():
            if info.ppid == me and pid not in keep_set:
                st = self._read_stat(pid)
                if st is not None and st.state == "Z":
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)

    def boot_id(self) -> str | None:
        try:
            path = os.path.join(self._proc, "sys", "kernel", "random", "boot_id")
            with open(path, encoding="ascii") as fh:
                return fh.read().strip() or None
        except OSError:
            return None

    # -- signals -----------------------------------------------------------------------------------

    def _send(self, p: ProcId, sig: int) -> bool:
        """Signal ``p`` if it is alive with that identity; True if a signal was sent.

        Where pidfds exist the process is pinned before its identity is checked, so the pid cannot
        be reused between the check and the signal; elsewhere a tiny window remains.
        """
        if p.pid <= 1 or p.pid == os.getpid():
            return False
        pidfd = None
        if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
            try:
                pidfd = os.pidfd_open(p.pid)
            except ProcessLookupError:
                return False
            except OSError:
                pidfd = None  # kernel without pidfd support
        try:
            if not self.is_alive(p):
                return False
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(p.pid, sig)
            return True
        except ProcessLookupError:
            return False
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def _send_checked(self, p: ProcId, sig: int) -> None:
        try:
            self._send(p, sig)
        except PermissionError as exc:
            raise AgentbenchError("not allowed to signal process", code="not_allowed_signal_process",
                                  pid=p.pid,
                                  detail=str(exc)) from exc

    def terminate(self, p: ProcId) -> None:
        self._send_checked(p, signal.SIGTERM)

    def kill(self, p: ProcId) -> None:
        self._send_checked(p, signal.SIGKILL)

    def _signal_round(self, targets: list[ProcId], scan: Mapping[int, _ProcInfo],
                      groups: set[int], roots: Sequence[ProcId], hard: bool, first: bool) -> None:
        sig = signal.SIGKILL if hard else signal.SIGTERM
        own_group = os.getpgrp()
        # Signal a group only while a verified member of ours is in it: a process group's id
        # cannot be reused while the group has members, so it is still the group we saw.
        live_groups = sorted({
            scan[p.pid].pgid for p in targets
            if p.pid in scan and scan[p.pid].pgid in groups and scan[p.pid].pgid != own_group
        })
        for pgid in live_groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        for p in targets:
            try:
                self._send(p, sig)
            except OSError:
                pass  # not ours to signal: it will be reported as a survivor
            if not hard:
                # A stopped process would hold SIGTERM pending until continued.
                try:
                    self._send(p, signal.SIGCONT)
                except OSError:
                    pass

    # -- launching and files -----------------------------------------------------------------------

    def detach_argv_popen(self, argv: Sequence[str], cwd: str, env: Mapping[str, str],
                          log_path: str, stdin_data: bytes | None = None) -> int:
        """setsid'd child (new session: no controlling terminal, so no SIGHUP when the terminal
        closes; not in the caller's process group, so a Ctrl-C there does not reach it), stdin
        from /dev/null (or a pipe carrying ``stdin_data``, then closed), stdout+stderr appended to
        ``log_path``, no inherited descriptors."""
        try:
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    list(argv), cwd=cwd, env=dict(env),
                    stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            if stdin_data is not None:
                assert proc.stdin is not None
                with contextlib.suppress(OSError):
                    proc.stdin.write(stdin_data)
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        except OSError as exc:
            raise AgentbenchError("cannot start detached process", code="cannot_start_detached_process",
                                  argv=list(argv)[:3],
                                  detail=str(exc)) from exc
        self._detached = [p for p in self._detached if p.poll() is None]
        self._detached.append(proc)
        return proc.pid

    def _renameat2_fn(self) -> Any:
        if self._renameat2 is None:
            self._renameat2 = False
            try:
                import ctypes  # lazy: only needed for this one call
                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                               ctypes.c_uint]
                fn.restype = ctypes.c_int
                self._renameat2 = fn
            except (OSError, AttributeError, ImportError):
                self._renameat2 = False
        return self._renameat2

    @contextlib.contextmanager
    def file_lock(self, path: str | os.PathLike[str], timeout_s: float = 60.0) -> Iterator[None]:
        """flock(2), polled without blocking so that a wedged holder costs a timeout, not a hang."""
        import fcntl  # POSIX only
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._poll_lock(lambda: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB), BlockingIOError,
                            timeout_s, path)
            yield
        finally:
            os.close(fd)   # releases the lock

    def rename_no_replace(self, src: str, dst: str) -> bool:
        """renameat2(RENAME_NOREPLACE) where the kernel and filesystem have it (one atomic step);
        otherwise hard-link ``dst`` to ``src`` (fails if ``dst`` exists) and unlink ``src``."""
        fn = self._renameat2_fn()
        if fn:
            import ctypes
            at_fdcwd, rename_noreplace = -100, 1
            rc = fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace)
            if rc == 0:
                return True
            err = ctypes.get_errno()
            if err in (errno.EEXIST, errno.ENOENT):
                return False
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), src, None, dst)
            # else: this filesystem lacks the flag; fall through to link + unlink
        return self._rename_by_link(src, dst)

    @staticmethod
    def _rename_by_link(src: str, dst: str) -> bool:
        try:
            os.link(src, dst)
        except (FileExistsError, FileNotFoundError):
            return False
        try:
            s, d = os.lstat(src), os.lstat(dst)
            if (s.st_dev, s.st_ino) != (d.st_dev, d.st_ino):
                # src was replaced after we linked the old file: we did not win; undo our link.
                os.unlink(dst)
                return False
            os.unlink(src)
        except FileNotFoundError:
            # Someone else moved src first: undo our link so exactly one mover wins.
            try:
                os.unlink(dst)
            except FileNotFoundError:
                pass
            return False
        return True


# -- Windows ---------------------------------------------------------------------------------------

_CREATE_NO_WINDOW = 0x08000000
_PROCESS_TERMINATE = 0x0001
_PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
_SYNCHRONIZE = 0x00100000
_WAIT_TIMEOUT = 0x102
_FILETIME_EPOCH_OFFSET = 116444736000000000  # 100 ns ticks from 1601-01-01 to 1970-01-01
_PS_QUOTES = "'\u2018\u2019\u201a\u201b"  # PowerShell treats all of these as single quotes
_GITBASH_RE = re.compile(r"^/(?:cygdrive/)?([A-Za-z])(?:/(.*))?$", re.S)
_WSL_RE = re.compile(r"^/mnt/([A-Za-z])(?:/|$)")
_CIM_RESULT_RE = re.compile(r"AGENTBENCH_CIM ReturnValue=(\d+) ProcessId=(\d*)")


def _filetime_to_epoch(ticks: int) -> float:
    """Windows FILETIME (100 ns since 1601) to epoch seconds, rounded like POSIX ctimes."""
    return round((ticks - _FILETIME_EPOCH_OFFSET) / 1e7, 3)


def _ps_single_quote(text: str) -> str:
    """A PowerShell single-quoted literal: no expansion; each quote character is doubled."""
    return "'" + "".join(ch * 2 if ch in _PS_QUOTES else ch for ch in text) + "'"


def build_cim_create_command(argv: Sequence[str], cwd: str) -> list[str]:
    """The powershell argv that starts ``argv`` hidden and detached through CIM and prints
    ``AGENTBENCH_CIM ReturnValue=<n> ProcessId=<pid>``.

    Win32_Process.Create makes the WMI service the parent, so the child is outside the caller's
    console, process tree and job object, and survives them; Win32_ProcessStartup.ShowWindow = 0
    keeps its console hidden. The script goes through -EncodedCommand (UTF-16LE base64), so no
    quoting layer of powershell.exe's own command line applies; inside it, the command line and
    directory are single-quoted literals. The child's executable should be a full path, since it
    is resolved by the service, not by the caller's PATH.
    """
    if not argv:
        raise AgentbenchError("empty command for detached launch", code="empty_command_detached_launch")
    cmdline = subprocess.list2cmdline(list(argv))
    script = "\n".join([
        "$ErrorActionPreference = 'Stop'",
        # Built from the class schema so ShowWindow is typed as the method expects (uint16).
        "$class = Get-CimClass -Namespace root/cimv2 -ClassName Win32_ProcessStartup",
        "$startup = New-CimInstance -CimClass $class -ClientOnly"
        " -Property @{ShowWindow = [uint16]0}",
        "$result = Invoke-CimMethod -Namespace root/cimv2 -ClassName Win32_Process"
        " -MethodName Create -Arguments @{"
        f"CommandLine = {_ps_single_quote(cmdline)}; "
        f"CurrentDirectory = {_ps_single_quote(cwd)}; "
        "ProcessStartupInformation = $startup}",
        "Write-Output ('AGENTBENCH_CIM ReturnValue={0} ProcessId={1}'"
        " -f $result.ReturnValue, $result.ProcessId)",
    ])
    encoded = base64.b64encode(script.encode("utf-16-le")).decode("ascii")
    cmd = ["powershell.exe", "-NoLogo", "-NoProfile", "-NonInteractive",
           "-ExecutionPolicy", "Bypass", "-EncodedCommand", encoded]
    if len(subprocess.list2cmdline(cmd)) > 32000:  # CreateProcess limit is 32767 characters
        raise AgentbenchError("command line too long for a detached launch",
                              code="command_line_too_long_detached", length=len(cmdline))
    return cmd


class WindowsPlatform(Platform):
    """Windows: GetProcessTimes, Toolhelp snapshots, TerminateProcess, taskkill, hidden CIM
    detach. ctypes is loaded on first use, so this class is constructible on any OS."""

    name = "windows"
    # FILETIME creation times are exact and stable; only float rounding needs room.
    ctime_tolerance_s = 0.002

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        # None: the platform seam reads this process's own environment (its user's profile).
        self._env = os.environ if env is None else env
        self._k32: Any = None

    # -- paths -------------------------------------------------------------------------------------

    def normalize_path(self, raw: str, *, cwd: str | None = None) -> str:
        """Accepts ``C:\\x``, ``c:/x``, ``G:/``, UNC ``\\\\server\\share\\x`` (or with forward
        slashes), ``\\\\?\\`` long-path forms, Git Bash / Cygwin ``/g/x`` and ``/cygdrive/g/x``,
        ``~`` and paths relative to ``cwd``. Refuses WSL ``/mnt/c/...``, drive-relative ``C:foo``,
        rootless ``\\x`` or MSYS ``/tmp``-style paths, device paths and reserved characters.
        Returns backslashes, an upper-case drive letter and collapsed ``.``/``..``. Pure string
        logic, so it behaves the same on every host."""
        if not isinstance(raw, str) or not raw.strip() or "\0" in raw:
            raise AgentbenchError("empty or invalid path", code="empty_invalid_path", path=str(raw))
        path = raw
        if _WSL_RE.match(path):
            windows_form = path[5].upper() + ":\\" + path[7:].replace("/", "\\")
            raise AgentbenchError("WSL path given to Windows agentbench",
                                  code="wsl_path_given_windows_agentbench", path=raw,
                                  hint=f"use the Windows path, e.g. {windows_form}")
        m = _GITBASH_RE.match(path)
        if m:
            path = f"{m.group(1).upper()}:\\{m.group(2) or ''}"
        if path == "~" or path.startswith(("~/", "~\\")):
            home = self._env.get("USERPROFILE") or (
                (self._env.get("HOMEDRIVE", "") + self._env.get("HOMEPATH", "")) or None)
            if not home:
                raise AgentbenchError("cannot expand ~: no USERPROFILE", code="cannot_expand_no_userprofile",
                                      path=raw)
            path = home.rstrip("\\/") + "\\" + path[2:]
        path = path.replace("/", "\\")
        if path.startswith("\\\\?\\UNC\\"):
            path = "\\\\" + path[8:]
        elif path.startswith("\\\\?\\") and re.match(r"^[A-Za-z]:\\", path[4:]):
            path = path[4:]
        elif path.startswith(("\\\\?\\", "\\\\.\\")):
            raise AgentbenchError("device paths are not supported", code="device_paths_not_supported",
                                  path=raw)

        if path.startswith("\\\\"):
            parts = path[2:].split("\\")
            if len(parts) < 2 or not parts[0] or not parts[1]:
                raise AgentbenchError("UNC path needs a server and a share",
                                      code="unc_path_needs_server_share", path=raw,
                                      hint="e.g. \\\\server\\share\\dir")
            root, rest = f"\\\\{parts[0]}\\{parts[1]}", parts[2:]
        elif re.match(r"^[A-Za-z]:", path):
            if path[2:3] != "\\":
                raise AgentbenchError(
                    "drive-relative path refused", code="drive_relative_path_refused", path=raw,
                    hint=f"give an absolute path such as {path[0].upper()}:\\{path[2:]}")
            root, rest = path[0].upper() + ":", path[3:].split("\\")
        elif path.startswith("\\"):
            raise AgentbenchError(
                "path without a drive letter refused", code="path_without_drive_letter_refused", path=raw,
                hint="give the drive (C:\\...); from Git Bash, `cygpath -w PATH` prints it")
        else:
            base = self.normalize_path(cwd if cwd is not None else os.getcwd())
            return self.normalize_path(base.rstrip("\\") + "\\" + path)

        body = "\\".join(rest)
        if re.search(r'[<>"|?*:]', body):
            raise AgentbenchError("path holds characters Windows does not allow",
                                  code="path_holds_characters_windows_does", path=raw)
        out: list[str] = []
        for comp in rest:
            if comp in ("", "."):
                continue
            if comp == "..":
                if out:
                    out.pop()
                continue
            out.append(comp)
        if root.endswith(":"):
            return root + "\\" + "\\".join(out)
        return root + ("\\" + "\\".join(out) if out else "")

    # -- replaceable OS calls (ctypes, loaded lazily) ----------------------------------------------

    def _kernel32(self) -> Any:
        if self._k32 is None:
            import ctypes
            from ctypes import wintypes
            k = ctypes.WinDLL("kernel32", use_last_error=True)
            k.OpenProcess.argtypes = [wintypes.DWORD, wintypes.BOOL, wintypes.DWORD]
            k.OpenProcess.restype = wintypes.HANDLE
            k.CloseHandle.argtypes = [wintypes.HANDLE]
            k.CloseHandle.restype = wintypes.BOOL
            k.GetProcessTimes.argtypes = [wintypes.HANDLE] + [ctypes.POINTER(wintypes.FILETIME)] * 4
            k.GetProcessTimes.restype = wintypes.BOOL
            k.WaitForSingleObject.argtypes = [wintypes.HANDLE, wintypes.DWORD]
            k.WaitForSingleObject.restype = wintypes.DWORD
            k.TerminateProcess.argtypes = [wintypes.HANDLE, wintypes.UINT]
            k.TerminateProcess.restype = wintypes.BOOL
            k.CreateToolhelp32Snapshot.argtypes = [wintypes.DWORD, wintypes.DWORD]
            k.CreateToolhelp32Snapshot.restype = wintypes.HANDLE
            self._k32 = k
        return self._k32

    def _open_process(self, pid: int, access: int) -> Any:
        """A handle to ``pid`` with ``access`` rights, or None (no such process, or denied)."""
        if pid <= 0:
            return None
        handle = self._kernel32().OpenProcess(access, False, pid)
        return handle or None

    def _close_handle(self, handle: Any) -> None:
        self._kernel32().CloseHandle(handle)

    def _get_process_times(self, handle: Any) -> float | None:
        """Creation time (epoch seconds) of the process behind ``handle``."""
        from ctypes import byref, wintypes
        c, e, k, u = (wintypes.FILETIME() for _ in range(4))
        if not self._kernel32().GetProcessTimes(handle, byref(c), byref(e), byref(k), byref(u)):
            return None
        return _filetime_to_epoch((c.dwHighDateTime << 32) | c.dwLowDateTime)

    def _handle_running(self, handle: Any) -> bool:
        # The process object outlives the process while handles exist; it is signalled on exit.
        return self._kernel32().WaitForSingleObject(handle, 0) == _WAIT_TIMEOUT

    def _terminate_handle(self, handle: Any, exit_code: int = 1) -> bool:
        return bool(self._kernel32().TerminateProcess(handle, exit_code))

    def _toolhelp_snapshot(self) -> list[tuple[int, int]]:
        """(pid, ppid) of every process, from CreateToolhelp32Snapshot."""
        import ctypes
        from ctypes import wintypes

        class PROCESSENTRY32W(ctypes.Structure):
            _fields_ = [("dwSize", wintypes.DWORD), ("cntUsage", wintypes.DWORD),
                        ("th32ProcessID", wintypes.DWORD), ("th32DefaultHeapID", ctypes.c_size_t),
                        ("th32ModuleID", wintypes.DWORD), ("cntThreads", wintypes.DWORD),
                        ("th32ParentProcessID", wintypes.DWORD), ("pcPriClassBase", wintypes.LONG),
                        ("dwFlags", wintypes.DWORD), ("szExeFile", wintypes.WCHAR * 260)]

        k = self._kernel32()
        first, nxt = k.Process32FirstW, k.Process32NextW
        first.argtypes = nxt.argtypes = [wintypes.HANDLE, ctypes.POINTER(PROCESSENTRY32W)]
        first.restype = nxt.restype = wintypes.BOOL
        snap = k.CreateToolhelp32Snapshot(0x2, 0)  # TH32CS_SNAPPROCESS
        if not snap or snap == ctypes.c_void_p(-1).value:
            return []
        rows: list[tuple[int, int]] = []
        try:
            entry = PROCESSENTRY32W()
            entry.dwSize = ctypes.sizeof(PROCESSENTRY32W)
            ok = first(snap, ctypes.byref(entry))
            while ok:
                rows.append((int(entry.th32ProcessID), int(entry.th32ParentProcessID)))
                ok = nxt(snap, ctypes.byref(entry))
        finally:
            k.CloseHandle(snap)
        return rows

    # -- identity ----------------------------------------------------------------------------------

    def process_ctime(self, pid: int) -> float | None:
        handle = self._open_process(pid, _PROCESS_QUERY_LIMITED_INFORMATION)
        if handle is None:
            return None
        try:
            return self._get_process_times(handle)
        finally:
            self._close_handle(handle)

    def _verified_handle(self, p: ProcId, access: int) -> Any:
        """A handle on ``p`` if it is running with that identity, else None. The handle pins the
        process object, so whatever is done through it cannot reach a reused pid."""
        rights = access | _PROCESS_QUERY_LIMITED_INFORMATION | _SYNCHRONIZE
        handle = self._open_process(p.pid, rights)
        if handle is None:
            return None
        try:
            if self._handle_running(handle) and self._same_ctime(
                    self._get_process_times(handle), p.ctime):
                return handle
        except Exception:
            self._close_handle(handle)
            raise
        self._close_handle(handle)
        return None

    def is_alive(self, p: ProcId) -> bool:
        handle = self._verified_handle(p, 0)
        if handle is None:
            return False
        self._close_handle(handle)
        return True

    def _scan(self) -> dict[int, _ProcInfo]:
        out: dict[int, _ProcInfo] = {}
        for pid, ppid in self._toolhelp_snapshot():
            if pid == 0:
                continue  # the idle pseudo-process
            out[pid] = _ProcInfo(ppid, self.process_ctime(pid), None, None)
        return out

    # -- signals -----------------------------------------------------------------------------------

    def _terminate_verified(self, p: ProcId) -> bool:
        if p.pid == os.getpid():
            return False
        handle = self._verified_handle(p, _PROCESS_TERMINATE)
        if handle is None:
            return False
        try:
            return self._terminate_handle(handle, 1)
        finally:
            self._close_handle(handle)

    def terminate(self, p: ProcId) -> None:
        """Windows has no general graceful stop for console processes: TerminateProcess."""
        self._terminate_verified(p)

    def kill(self, p: ProcId) -> None:
        self._terminate_verified(p)

    def _taskkill_safe(self, root: ProcId, scan: Mapping[int, _ProcInfo]) -> bool:
        """taskkill /T follows ppid links without the creation-time guard; only use it when the
        unguarded tree equals the guarded one (no stale-ppid stranger below the root)."""
        info = scan.get(root.pid)
        if info is None or not self._same_ctime(info.ctime, root.ctime):
            return False
        kids = self._children_index(scan)
        guarded = {p.pid for p in self._descend(root, scan, None, kids)}
        stack, unguarded = [root.pid], set()
        while stack:
            for child in kids.get(stack.pop(), []):
                if child not in unguarded and child != root.pid:
                    unguarded.add(child)
                    stack.append(child)
        return unguarded == guarded

    def _signal_round(self, targets: list[ProcId], scan: Mapping[int, _ProcInfo],
                      groups: set[int], roots: Sequence[ProcId], hard: bool, first: bool) -> None:
        if first:
            for root in roots:
                if self._taskkill_safe(root, scan):
                    try:
                        self._run_helper(["taskkill", "/T", "/F", "/PID", str(root.pid)], 60.0)
                    except (OSError, subprocess.SubprocessError):
                        pass  # the per-pid sweep below still runs
        for p in targets:
            try:
                self._terminate_verified(p)
            except OSError:
                pass

    # -- launching and files -----------------------------------------------------------------------

    def helper_popen_kwargs(self) -> dict[str, Any]:
        """CREATE_NO_WINDOW: no console window flashes up for any helper process."""
        return {"creationflags": _CREATE_NO_WINDOW}

    def detach_env_file(self, env: Mapping[str, str], log_path: str) -> str | None:
        """Processes created through CIM get the user's default environment, not the caller's.
        So the environment is written to ``<log_path>.env.json`` (created fresh, owner-only where
        the OS honours modes) and the child loads and deletes it (read_detach_env_file). The
        environment never appears on a command line, where other users could read it."""
        path = log_path + ".env.json"
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"env": dict(env)}, fh)
        return path

    def detach_argv_popen(self, argv: Sequence[str], cwd: str, env: Mapping[str, str],
                          log_path: str, stdin_data: bytes | None = None) -> int:
        """Start ``argv`` through CIM Win32_Process.Create with a hidden window.

        ``env`` does not reach the child by this route: pass the path from detach_env_file in its
        argv. Nor are its stdout/stderr attached to ``log_path``: the child writes its own log
        (``log_path`` is only used for the error report here).
        """
        cmd = build_cim_create_command(argv, cwd)
        try:
            cp = self._run_helper(cmd, 120.0)
        except (OSError, subprocess.SubprocessError) as exc:
            raise AgentbenchError("cannot run powershell for a detached launch",
                                  code="cannot_run_powershell_detached_launch", detail=str(exc)) from exc
        m = _CIM_RESULT_RE.search(cp.stdout or "")
        if cp.returncode != 0 or not m or m.group(1) != "0" or not m.group(2):
            raise AgentbenchError(
                "detached launch through CIM failed", code="detached_launch_through_cim_failed",
                returncode=cp.returncode,
                cim_return_value=int(m.group(1)) if m else None,
                detail=((cp.stderr or "") + (cp.stdout or ""))[-2000:], log=log_path,
                hint="Win32_Process.Create return values: 2 access denied, 9 path not found, "
                     "21 invalid parameter")
        return int(m.group(2))

    @contextlib.contextmanager
    def file_lock(self, path: str | os.PathLike[str], timeout_s: float = 60.0) -> Iterator[None]:
        """msvcrt.locking on the file's first byte, polled without blocking."""
        import msvcrt  # Windows only
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o644)
        try:
            self._poll_lock(lambda: msvcrt.locking(fd, msvcrt.LK_NBLCK, 1),  # type: ignore[attr-defined]
                            OSError, timeout_s, path)
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    os.lseek(fd, 0, os.SEEK_SET)
                    msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
        finally:
            os.close(fd)

    def rename_no_replace(self, src: str, dst: str) -> bool:
        """os.rename on Windows refuses to replace an existing ``dst`` (MoveFileEx without
        MOVEFILE_REPLACE_EXISTING), which is exactly the atomic no-replace rename needed."""
        try:
            os.rename(src, dst)
        except (FileExistsError, FileNotFoundError):
            return False
        return True


# -- selection -------------------------------------------------------------------------------------

_CURRENT_PLATFORM: Platform | None = None


def select_platform(env: Mapping[str, str] | None = None) -> Platform:
    """A new Platform for this OS; ``AGENTBENCH_PLATFORM=windows|posix`` in ``env`` overrides the
    choice (so the Windows logic can be exercised on other systems)."""
    # None: the platform seam reads this process's own environment (at start-up, once).
    env = os.environ if env is None else env
    forced = (env.get("AGENTBENCH_PLATFORM") or "").strip().lower()
    if forced == "windows":
        return WindowsPlatform(env)
    if forced == "posix":
        return PosixPlatform()
    if forced:
        raise AgentbenchError("unknown AGENTBENCH_PLATFORM", code="unknown_agentbench_platform", value=forced,
                              hint="use 'posix' or 'windows'")
    return WindowsPlatform(env) if os.name == "nt" else PosixPlatform()


def current_platform() -> Platform:
    """The platform chosen once for this process (select_platform on first use)."""
    global _CURRENT_PLATFORM
    if _CURRENT_PLATFORM is None:
        _CURRENT_PLATFORM = select_platform()
    return _CURRENT_PLATFORM


# ==================================================================================================
# Files, locks and the registry
# ==================================================================================================
# Atomic JSON files, the append-only JSONL logs, the registry lock, and the study's on-disk layout.
# Scale rule: no command rewrites a document that grows with the study.  Each job owns a directory
# (job.json written once by its creator, runtime.json written only by its supervisor, result.json
# created exactly once by whoever finalises it); small marker directories index what is active and
# what is undelivered, so polls and the parallel cap cost O(active), not O(study).  The registry
# document itself holds only counters.  This section knows nothing of claude or of experiments.

_MISSING: Any = object()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or create in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` so that readers see the old or the new file, never a torn one.

    Temp file in the same directory, fsync, os.replace (retried on PermissionError: on Windows a
    reader holding the file open makes the replace fail for a moment), fsync of the directory.
    A full disk raises before the old file is touched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for attempt in range(50):
            try:
                os.replace(tmp, path)
                break
            except PermissionError:
                if attempt == 49:
                    raise
                time.sleep(0.02 * (attempt + 1))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, sort_keys: bool = True) -> None:
    """Atomically write `obj` as pretty JSON (see write_bytes_atomic); keys sorted unless the
    order means something (study.json: the first arm is the default baseline)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=sort_keys, default=str, allow_nan=False)
                              + "\n").encode())


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_private_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write a JSON file only its owner can read (created fresh: an old file is replaced, never
    reused with its old mode).  For secrets handed from one agentbench process to another."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def read_json(path: str | os.PathLike[str], default: Any = _MISSING) -> Any:
    """Parse a JSON file.  Missing file -> `default` (or an error); corrupt file -> an error naming it."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        if default is _MISSING:
            raise AgentbenchError("file not found", code="file_not_found", path=str(path)) from None
        return default
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise AgentbenchError("file is not valid JSON", code="file_not_valid_json",
                              path=str(path), detail=str(exc),
                              hint="fix it at the line and column given (a file edited by hand, such "
                                   "as study.json), or restore it; agentbench writes its own files "
                                   "atomically, so a torn one was changed by something else") from None


def create_json_exclusive(path: str | os.PathLike[str], obj: Any,
                          rename_no_replace: Callable[[str, str], bool]) -> bool:
    """Create `path` holding `obj` only if it does not exist yet; True if this call created it.

    The complete file is written aside first and then renamed without replacement, so the file
    is never seen half-written and two racing creators cannot both win.  This is the once-only
    guard of finalisation.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(obj, indent=1, sort_keys=True, default=str, allow_nan=False) + "\n").encode()
    tmp = _temp_sibling(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        created = rename_no_replace(str(tmp), str(path))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    if created:
        fsync_dir(path.parent)
    return created


def append_jsonl(path: str | os.PathLike[str], obj: Any) -> None:
    """Append one JSON line.  A torn last line (a writer killed mid-append) is fenced off first.

    If the file does not end in a newline, a newline is written before the record, so the torn
    fragment stays on a line of its own that readers skip, and this record stays parseable.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(obj, sort_keys=True, default=str, allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as rh:
                rh.seek(size - 1)
                if rh.read(1) != b"\n":
                    line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_jsonl(path: str | os.PathLike[str], counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The object lines of a JSONL file, read as a stream (a missing file has none); each line
    that is torn, not JSON or not an object adds one to counts["torn"]."""
    counts.setdefault("torn", 0)
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for raw in fh:
            raw = raw.strip()
            if not raw:
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                counts["torn"] += 1
                continue
            if isinstance(obj, dict):
                yield obj
            else:
                counts["torn"] += 1


def read_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """All parseable object lines of a JSONL file, and how many lines were skipped as torn/bad."""
    counts: dict[str, int] = {}
    records = list(iter_jsonl(path, counts))
    return records, counts["torn"]


#: directory -> (time.monotonic() when measured, file system clock minus this host's clock)
_FS_CLOCK_OFFSETS: dict[str, tuple[float, float]] = {}
FS_CLOCK_REUSE_S = 5.0


def file_system_now(directory: str | os.PathLike[str], host: str) -> float | None:
    """The file system's own clock: the mtime it stamps on a probe file touched now in
    `directory` (one per host, reused); None when the directory cannot be written.  The offset
    to this host's clock is reused for a few seconds, so that a process checking often (a
    waiter on a busy lock) does not write the probe every time."""
    key = os.path.abspath(directory)
    cached = _FS_CLOCK_OFFSETS.get(key)
    if cached is not None and time.monotonic() - cached[0] < FS_CLOCK_REUSE_S:
        return time.time() + cached[1]
    probe = Path(directory) / (".clock-" + re.sub(r"[^A-Za-z0-9._-]", "_", host or "host"))
    try:
        probe.touch()
        fs_now = os.stat(probe).st_mtime
    except OSError:
        return None
    _FS_CLOCK_OFFSETS[key] = (time.monotonic(), fs_now - time.time())
    return fs_now


def mtime_age_s(mtime: float, directory: str | os.PathLike[str], host: str, threshold: float) -> float:
    """How old a file's mtime is, for judging it stale against `threshold`.

    By this host's clock first; only when that says older than `threshold`, checked against the
    file system's clock too, and the smaller age wins.  On a study directory shared between hosts
    (the Slurm executor) the file server stamps both mtimes, so a host whose clock runs ahead can
    never take a fresh lock, beat or call for a stale one; a host whose clock runs behind only
    judges later.  On a local disk the two clocks are one and the probe is rarely written.
    """
    age = time.time() - mtime
    if age <= threshold:
        return age
    now = file_system_now(directory, host)
    return age if now is None else min(age, now - mtime)


def _lock_view(holder: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A lock holder record as shown to users (without the file identity used internally)."""
    return None if holder is None else {k: v for k, v in holder.items() if k != "_file"}


class RegistryLock:
    """The study-wide mutual-exclusion lock: a file created exclusively, holding who holds it.

    Content: the holder's pid, creation time and a random token.  A lock is stale when its
    holder (pid + creation time) is dead, or when it is older than LOCK_STALE_S.  A stale lock
    is broken by renaming it aside and comparing what was renamed with what was judged stale:
    if a fresh lock slipped in between, it is put back, so a fresh lock is never deleted.
    Release removes the file only if it still holds this holder's token.
    """

    def __init__(self, path: str | os.PathLike[str], platform: "Platform",
                 timeout_s: float = LOCK_TIMEOUT_S, stale_s: float = LOCK_STALE_S,
                 label: str = "the study registry"):
        self.path = Path(path)
        self.label = label
        self.platform = platform
        self.timeout_s = timeout_s
        self.stale_s = stale_s
        self.token: str | None = None

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        """What a lock file says, plus which file it is (`_file`: inode, mtime, size); None if gone.

        Empty or garbled content is {"unreadable": True}: an empty file is a creator between its
        exclusive create and its write (or one killed there), stale only after a grace period.
        `_file` lets a breaker tell the file it judged from a fresh one with the same content.
        """
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                data = fh.read()
        except FileNotFoundError:
            return None
        except OSError:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return None
            except OSError:
                return {"unreadable": True, "_file": None}
            data = b""
        try:
            obj = json.loads(data.decode())
        except (ValueError, UnicodeDecodeError):
            obj = None
        out = dict(obj) if isinstance(obj, dict) else {"unreadable": True}
        out["_file"] = [st.st_ino, st.st_mtime_ns, st.st_size]
        return out

    def _holder(self) -> dict[str, Any] | None:
        return self._read(self.path)

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        age = mtime_age_s(mtime, self.path.parent, self.platform.hostname(), min(5.0, self.stale_s))
        if age > self.stale_s:
            return True
        if holder.get("unreadable") or "pid" not in holder:
            # A creator writes its content right after the exclusive create; give it a moment.
            return age > 5.0
        if not self.platform.is_local(holder):
            # Held from another host sharing the study (a Slurm compute node): its pid means
            # nothing here, so only the age limit above can make it stale.
            return False
        return not self.platform.is_alive(ProcId(int(holder["pid"]), holder.get("ctime")))

    def _break(self, judged: dict[str, Any]) -> None:
        aside = self.path.with_name(f"{self.path.name}.breaking.{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        got = self._read(aside)
        # The same content AND the same file: a fresh lock (even an empty one) is another file.
        if got is not None and got == judged and judged.get("_file") is not None:
            with contextlib.suppress(OSError):
                os.unlink(aside)
            log(f"broke a stale registry lock held by {_lock_view(judged)}")
            return
        # A fresh lock was created between our read and our rename: put it back untouched.
        if not self.platform.rename_no_replace(str(aside), str(self.path)):
            log("registry lock: a fresh lock was displaced and another holder appeared; "
                "keeping both out of the way")
            with contextlib.suppress(OSError):
                os.unlink(aside)

    def acquire(self) -> None:
        me = self.platform.proc_id(os.getpid())
        token = uuid.uuid4().hex
        content = json.dumps({"pid": os.getpid(), "ctime": me.ctime if me else None,
                              "host": self.platform.hostname(), "token": token,
                              "acquired_at": utc_now()}).encode()
        deadline = time.monotonic() + self.timeout_s
        delay = 0.002
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._is_stale(holder):
                    self._break(holder)
                    continue
                if time.monotonic() > deadline:
                    raise AgentbenchError(f"{self.label} is locked", code="locked", holder=_lock_view(holder),
                                          lock=str(self.path),
                                          hint="another agentbench call is holding it; retry, or "
                                               "if its holder is hung, kill that process")
                time.sleep(delay)
                delay = min(0.05, delay * 1.5)
                continue
            try:
                os.write(fd, content)
                os.fsync(fd)
            except OSError:
                # A full disk: no empty lock file is left behind to be judged by others.
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
                raise
            os.close(fd)
            self.token = token
            return

    def release(self) -> None:
        if self.token is None:
            return
        holder = self._holder()
        if holder and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.token = None

    def __enter__(self) -> "RegistryLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


JOB_ID_RE = re.compile(r"^j\d{6,}$")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def is_safe_id(value: Any) -> bool:
    """The one id rule (pure), for every id or name that becomes part of a path: session, job and
    run ids, task, arm and base names.  1-64 letters, digits, '.', '_' or '-', starting with a
    letter or digit, the whole string (no separator, no '..' component, no newline, no NUL)."""
    return isinstance(value, str) and NAME_RE.fullmatch(value) is not None


def checked_id(kind: str, value: Any) -> str:
    """`value` if it is a safe id (is_safe_id), else the refusal `unsafe_id`: an id from a file or a
    stream that would not stay one path component inside its directory."""
    if not is_safe_id(value):
        raise AgentbenchError(f"{kind} id is not a safe path component", code="unsafe_id",
                              value=str(value)[:200], hint="ids are 1-64 letters, digits, '.', '_' or '-'; "
                                                           "this one was edited or forged")
    return str(value)


@dataclass(frozen=True)
class StudyPaths:
    """Where everything of one study lives.  Pure path arithmetic; creates nothing."""
    root: Path

    @property
    def study_file(self) -> Path: return self.root / STUDY_FILE
    @property
    def state(self) -> Path: return self.root / STATE_DIR
    @property
    def registry(self) -> Path: return self.state / "registry.json"
    @property
    def lock(self) -> Path: return self.state / "registry.lock"
    @property
    def ledger(self) -> Path: return self.state / "ledger.jsonl"
    @property
    def events(self) -> Path: return self.state / "events.jsonl"
    @property
    def jobs(self) -> Path: return self.state / "jobs"
    @property
    def active(self) -> Path: return self.state / "active"
    @property
    def undelivered(self) -> Path: return self.state / "undelivered"
    @property
    def bases(self) -> Path: return self.state / "bases"
    @property
    def sessions(self) -> Path: return self.state / "sessions"
    @property
    def last_call(self) -> Path: return self.state / "last_call"
    @property
    def runs(self) -> Path: return self.root / "runs"
    @property
    def run_index(self) -> Path: return self.state / "runs"
    @property
    def scripts(self) -> Path: return self.state / "scripted"
    @property
    def driver(self) -> Path: return self.state / "driver.json"

    def job_dir(self, job_id: str) -> Path: return self.jobs / checked_id("job", job_id)
    def job_file(self, job_id: str) -> Path: return self.job_dir(job_id) / "job.json"
    def runtime_file(self, job_id: str) -> Path: return self.job_dir(job_id) / "runtime.json"
    def result_file(self, job_id: str) -> Path: return self.job_dir(job_id) / "result.json"
    def run_dir(self, run_id: str) -> Path: return self.runs / checked_id("run", run_id)
    def session_file(self, session_id: str) -> Path:
        return self.sessions / f"{checked_id('session', session_id)}.json"


def check_name(kind: str, value: str) -> str:
    """Refuse names that could escape a directory or confuse a shell: letters, digits, ._- only."""
    if not is_safe_id(value):
        raise AgentbenchError(f"invalid {kind} name", code="invalid_name", value=value,
                              hint="use 1-64 letters, digits, '.', '_' or '-', "
                                   "starting with a letter or digit")
    return value


def ledger_spent_usd(paths: StudyPaths) -> float:
    """The study's spend summed from its ledger (each line's amount checked; a bad one adds 0)."""
    records, _ = read_jsonl(paths.ledger)
    return round(math.fsum(usd_from(r.get("cost_delta_usd")) or 0.0 for r in records), 6)


def registry_spent_usd(reg: Mapping[str, Any]) -> float:
    """The registry's spend as a checked amount (read_registry() already repaired a bad one)."""
    return usd_from(reg.get("spent_usd"), hi=math.inf) or 0.0


def read_registry(paths: StudyPaths) -> dict[str, Any]:
    """The registry, checked: a JSON object of the one version this agentbench writes (another
    version is refused, never rewritten), whose spend is a finite amount -- one that is not (NaN
    or Infinity left by an older version, a hand edit) is rebuilt from the ledger, so the study's
    USD cap is never judged against a poisoned sum."""
    reg = read_json(paths.registry, default=None)
    if reg is None:
        reg = {"version": REGISTRY_VERSION, "next_job": 1, "counts": {}, "spent_usd": 0.0, "breaker": None}
    if not isinstance(reg, dict):
        raise AgentbenchError("the study registry is not a JSON object",
                              code="study_registry_not_json_object", path=str(paths.registry))
    version = reg.get("version", REGISTRY_VERSION)
    if type(version) is not int or version != REGISTRY_VERSION:
        raise AgentbenchError("the study registry has a version this agentbench does not know",
                              code="registry_version_unknown", path=str(paths.registry), version=version,
                              supported=REGISTRY_VERSION,
                              hint="use the agentbench version that made this study")
    if usd_from(reg.get("spent_usd", 0.0), hi=math.inf) is None:
        reg["spent_usd"] = ledger_spent_usd(paths)
    if not isinstance(reg.get("counts"), dict):
        reg["counts"] = {}
    return reg


def list_markers(directory: Path) -> list[str]:
    """Names in a marker directory (sorted); O(entries), which is O(active) by construction."""
    try:
        return sorted(n for n in os.listdir(directory) if not n.startswith("."))
    except FileNotFoundError:
        return []


def touch_marker(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a"):
        pass


def remove_marker(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def append_event(paths: StudyPaths, event: str, **fields: Any) -> None:
    """One line of the study's event log (events.jsonl): what happened, when, to what."""
    append_jsonl(paths.events, {"ts": utc_now(), "event": event, **fields})


def touch_last_call(paths: StudyPaths) -> None:
    """Record orchestrator activity (the orphan watchdog reads this file's mtime)."""
    if not paths.state.is_dir():
        return
    try:
        with open(paths.last_call, "a"):
            pass
        os.utime(paths.last_call)
    except OSError:
        pass


# -- copies and reads of what a session left behind ------------------------------------------------
# A workspace, a review directory, a snapshot and claude's transcripts may hold anything the agent
# wrote: links to hidden files or to /dev/zero, FIFOs, sparse files of terabytes, names that are not
# UTF-8, trees nested past PATH_MAX.  Every copy or read agentbench makes of them outside the sandbox
# goes through the functions below: a link is copied as a link (or dropped), never followed; a FIFO,
# socket or device is skipped, never opened for reading; a sparse file stays sparse; and a copy stops
# at its caps (CopyCaps, from the study settings copy_file_mb and copy_total_mb).  What cannot be
# copied within these rules raises UnusableTree: the agent's doing, never an infrastructure failure.

#: A copy refuses a tree with more entries than this (each costs system calls, and an honest
#: workspace is far smaller), ...
COPY_MAX_ENTRIES = 200_000
#: ... nested deeper than this (the walk holds one open directory per level), ...
COPY_MAX_DEPTH = 128
#: ... or with a relative path longer than this in bytes (past it, the copy's own absolute paths
#: would pass the platform's PATH_MAX).
COPY_MAX_PATH_BYTES = 3072
_READ_NOFOLLOW = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                  | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
_DIR_NOFOLLOW = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
#: Directories walked by descriptor (no path is ever re-resolved, so a directory swapped for a link
#: mid-copy is not followed and depth never meets PATH_MAX); by path where the platform has no *at().
_BY_FD = os.open in os.supports_dir_fd and os.scandir in os.supports_fd and bool(getattr(os, "O_NOFOLLOW", 0))
#: errno values of a name the file system will not take: the name's fault, not the machine's.
NAME_REFUSED_ERRNOS = frozenset(getattr(errno, n) for n in ("ENAMETOOLONG", "EILSEQ") if hasattr(errno, n))


def shown_name(name: str) -> str:
    """A file name as records and reports show it: printable, one line, and distinct for distinct
    names.  A byte that is not UTF-8 (held by Python as a lone surrogate) becomes \\xNN, another
    unprintable character (controls, bidi and zero-width marks, line separators) \\xNN below 0x80
    else \\uNNNN or \\UNNNNNNNN, and a backslash is doubled."""
    if name.isprintable() and "\\" not in name:
        return name
    out = []
    for ch in name:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        else:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return "".join(out)


class UnusableTree(AgentbenchError):
    """A tree (or file) that cannot be copied or read within the rules above: over a cap, nested
    too deep, a name the file system refuses, an unreadable entry.  `why` is a short phrase."""

    def __init__(self, why: str, path: str = "", **fields: Any):
        super().__init__(f"the workspace cannot be copied or read within the copy rules: {why}",
                         code="workspace_unusable", why=why, path=shown_name(str(path)),
                         hint="the agent left files over the study's copy caps (copy_file_mb, "
                              "copy_total_mb, workspace_mb), nested too deep, or unreadable", **fields)
        self.why = why


@dataclass(frozen=True)
class CopyCaps:
    """The caps of one copy or read of a tree.  Sizes are apparent sizes (a sparse file counts at its
    full length); None: no size cap (the experimenter's own task bundle)."""
    file_bytes: int | None
    total_bytes: int | None
    entries: int = COPY_MAX_ENTRIES


#: For the experimenter's own files (task bundles): no size cap, still no link followed.
UNCAPPED = CopyCaps(None, None, entries=10 ** 9)
#: The caps of a study that sets none (copy_file_mb and copy_total_mb's defaults).
DEFAULT_COPY_CAPS = CopyCaps(int(DEFAULT_LAUNCH["copy_file_mb"] * 2 ** 20),
                             int(DEFAULT_LAUNCH["copy_total_mb"] * 2 ** 20))


def _at(d: int | str, name: str) -> tuple[str, dict[str, Any]]:
    """A name in an open directory (descriptor) or a path, with the keyword arguments for os.*."""
    return (name, {"dir_fd": d}) if isinstance(d, int) else (os.path.join(d, name), {})


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None
                 ) -> tuple[int, os.stat_result] | None:
    """A descriptor and status of a regular file, opened without following a link and without
    blocking (a FIFO left by the agent must not hang the reader), judged by what was opened; None
    for a link, a FIFO, a socket, a device or a missing entry."""
    try:
        fd = os.open(path, _READ_NOFOLLOW, **({"dir_fd": dir_fd} if dir_fd is not None else {}))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK, errno.EOPNOTSUPP):
            return None          # a link (O_NOFOLLOW) or a socket
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def read_capped(path: str | os.PathLike[str], max_bytes: int) -> bytes | None:
    """A regular file's bytes (never through a link, never from a special file); None when the
    entry is missing or not a regular file; UnusableTree("file_over_cap") past `max_bytes`."""
    opened = open_regular(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        if st.st_size > max_bytes:
            raise UnusableTree("file_over_cap", str(path), size=st.st_size, cap=max_bytes)
        chunks, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > max_bytes:      # it grew while read
            raise UnusableTree("file_over_cap", str(path), cap=max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def sha256_regular(path: str | os.PathLike[str], max_bytes: int | None = None, *,
                   dir_fd: int | None = None) -> str | None:
    """sha256 of a regular file's first st_size bytes, opened as open_regular does; None when it is
    not one; UnusableTree("file_over_cap") past `max_bytes`."""
    opened = open_regular(path, dir_fd=dir_fd)
    if opened is None:
        return None
    fd, st = opened
    try:
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnusableTree("file_over_cap", str(path), size=st.st_size, cap=max_bytes)
        h, left = hashlib.sha256(), st.st_size      # a file growing while hashed is read as it was
        while left > 0:
            chunk = os.read(fd, min(1 << 20, left))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _copy_data(src: int, dst: int, size: int, sparse: bool) -> None:
    """Copy the first `size` bytes; a sparse source is copied extent by extent (SEEK_DATA), its
    holes left holes, so its real blocks never grow to its apparent size."""
    def span(start: int, end: int) -> None:
        os.lseek(src, start, os.SEEK_SET)
        while start < end:
            chunk = os.read(src, min(1 << 20, end - start))
            if not chunk:
                return
            if hasattr(os, "pwrite"):
                os.pwrite(dst, chunk, start)
            else:
                os.lseek(dst, start, os.SEEK_SET)
                os.write(dst, chunk)
            start += len(chunk)

    if sparse and hasattr(os, "SEEK_DATA"):
        pos = 0
        while pos < size:
            try:
                data = os.lseek(src, pos, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break            # only a hole is left
                raise
            hole = min(os.lseek(src, data, os.SEEK_HOLE), size)
            span(data, hole)
            pos = hole
        os.ftruncate(dst, size)
    else:
        span(0, size)


@dataclass
class _CopyTally:
    caps: CopyCaps
    listed: int = 0
    files: int = 0
    dirs: int = 0
    links: int = 0
    bytes: int = 0
    sparse: int = 0
    skipped_special: list[str] = field(default_factory=list)
    dropped_links: list[str] = field(default_factory=list)

    def entry(self, rel: str) -> None:
        self.listed += 1
        if self.listed > self.caps.entries:
            raise UnusableTree("too_many_entries", rel, cap=self.caps.entries)
        if len(os.fsencode(rel)) > COPY_MAX_PATH_BYTES:
            raise UnusableTree("path_too_long", rel[:200], cap=COPY_MAX_PATH_BYTES)

    def sized(self, rel: str, size: int) -> None:
        cap, total = self.caps.file_bytes, self.caps.total_bytes
        if cap is not None and size > cap:
            raise UnusableTree("file_over_cap", rel, size=size, cap=cap)
        if total is not None and self.bytes + size > total:
            raise UnusableTree("copy_over_cap", rel, size=self.bytes + size, cap=total)
        self.bytes += size

    def summary(self) -> dict[str, Any]:
        return {"files": self.files, "dirs": self.dirs, "links": self.links, "bytes": self.bytes,
                "sparse_files": self.sparse, "skipped_special": self.skipped_special[:50],
                "dropped_links": self.dropped_links[:50]}


def _link_stays_inside(target: str) -> bool:
    """A link that cannot lead out of the tree however it is resolved: relative, without a `..`.
    (A lexical check of `..` is not enough: in `l/x/../..` with `l -> .`, the kernel resolves `l`
    first and the second `..` climbs out, while the text says it stays.)  A chain of such links
    only ever goes down from where each one sits."""
    parts = target.replace("\\", "/").split("/")
    return bool(target) and not os.path.isabs(target) and not target.startswith(("/", "\\")) \
        and ".." not in parts and not re.match(r"^[A-Za-z]:", target)


def _copy_entry(tally: _CopyTally, sd: int | str, dd: int | str, name: str, rel: str,
                st: os.stat_result, links: str) -> None:
    """One non-directory entry of safe_copy_tree (files, links, special files)."""
    sp, skw = _at(sd, name)
    dp, dkw = _at(dd, name)
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.stat(dp, follow_symlinks=False, **dkw).st_mode):
            os.unlink(dp, **dkw)     # an overlay replaces the file; never writes through a link
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(sp, **skw)
        if links == "drop" or (links == "inside" and not _link_stays_inside(target)):
            tally.dropped_links.append(shown_name(rel))
            return
        os.symlink(target, dp, **dkw)
        tally.links += 1
        return
    if not stat.S_ISREG(st.st_mode):
        tally.skipped_special.append(shown_name(rel))
        return
    opened = open_regular(sp, dir_fd=skw.get("dir_fd"))
    if opened is None:           # swapped for a link or a FIFO since it was listed: not followed
        tally.skipped_special.append(shown_name(rel))
        return
    fd, fst = opened
    try:
        tally.sized(rel, fst.st_size)
        out = os.open(dp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                      | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0),
                      (fst.st_mode & 0o777) | 0o600, **dkw)
        try:
            sparse = fst.st_blocks * 512 < fst.st_size if hasattr(fst, "st_blocks") else False
            _copy_data(fd, out, fst.st_size, sparse)
            tally.sparse += int(sparse)
            if os.utime in os.supports_fd:
                os.utime(out, ns=(fst.st_atime_ns, fst.st_mtime_ns))   # as copytree kept them
        finally:
            os.close(out)
        tally.files += 1
    finally:
        os.close(fd)


def safe_copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str], caps: CopyCaps, *,
                   links: str = "keep", skip_names: Iterable[str] = (".git",),
                   skip_suffixes: tuple[str, ...] = (), overlay: bool = False) -> dict[str, Any]:
    """Copy the tree `src` to `dst` by the rules of this block and return what was copied.

    `links`: "keep" copies every link as a link, "inside" only relative ones without `..` (the
    others are dropped: a reader of the copy cannot follow one out), "drop" none.  Entries named
    in `skip_names` or ending in `skip_suffixes` are left out at every level.  `overlay`: `dst` may
    exist, its files are replaced.  UnusableTree past a cap, too deep, or on a name or entry the
    copy cannot take; the partial copy is left for the caller to remove."""
    skip = frozenset(skip_names)
    tally = _CopyTally(caps)
    if os.path.islink(src) or not os.path.isdir(src):
        # A workspace the session replaced by a link (to /etc, to the tasks) is never entered.
        raise UnusableTree("not_a_directory", str(src))
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(dst)
    except FileExistsError:
        if not overlay:
            raise
    opened: list[int] = []

    def opendir(parent: int | str | None, name: str) -> int | str:
        if not _BY_FD:
            return name if parent is None else os.path.join(str(parent), name)
        fd = os.open(name, _DIR_NOFOLLOW, **({"dir_fd": parent} if isinstance(parent, int) else {}))
        opened.append(fd)
        return fd

    try:
        # [source dir, destination dir, relative path, its entries left to copy]
        root = (opendir(None, os.fspath(src)), opendir(None, os.fspath(dst)))
        stack: list[tuple[int | str, int | str, str, list[os.DirEntry[str]]]] = []

        def push(sd: int | str, dd: int | str, rel: str) -> None:
            if len(stack) >= COPY_MAX_DEPTH:
                raise UnusableTree("nested_too_deep", rel[:200], cap=COPY_MAX_DEPTH)
            with os.scandir(sd) as it:
                entries = []
                for e in it:
                    if e.name in skip or (skip_suffixes and e.name.endswith(skip_suffixes)):
                        continue
                    tally.entry(rel + e.name)
                    entries.append(e)
            stack.append((sd, dd, rel, sorted(entries, key=lambda e: e.name, reverse=True)))

        push(root[0], root[1], "")
        while stack:
            sd, dd, rel, entries = stack[-1]
            if not entries:
                stack.pop()
                for d in (sd, dd):
                    if isinstance(d, int) and d in opened:
                        opened.remove(d)
                        os.close(d)
                continue
            e = entries.pop()
            erel = rel + e.name
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue             # gone since it was listed (a live workspace)
            if stat.S_ISDIR(st.st_mode):
                dp, dkw = _at(dd, e.name)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(dp, 0o755, **dkw)
                try:
                    sub = opendir(sd, e.name)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                        tally.skipped_special.append(shown_name(erel))   # swapped since listed
                        continue
                    raise
                tally.dirs += 1
                push(sub, opendir(dd, e.name), erel + "/")
            else:
                _copy_entry(tally, sd, dd, e.name, erel, st, links)
    except UnusableTree:
        raise
    except OSError as exc:
        if exc.errno in NAME_REFUSED_ERRNOS:
            raise UnusableTree("name_refused", exc.filename or "", detail=exc.strerror) from None
        if exc.errno in WRITE_REFUSED_ERRNOS and exc.errno not in (errno.EACCES, errno.EPERM):
            raise                    # the machine's disk, not the agent's tree
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise UnusableTree("unreadable", str(exc.filename or ""), detail=exc.strerror) from None
        raise
    finally:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)
    return tally.summary()


def safe_copy_file(src: str | os.PathLike[str], dst: str | os.PathLike[str], max_bytes: int | None) -> int:
    """Copy one regular file (a transcript): never through a link, never from a special file,
    never past `max_bytes` (None: the experimenter's own file, no cap), sparse kept sparse.
    UnusableTree when it is not a regular file or is over the cap; returns the bytes copied."""
    opened = open_regular(src)
    if opened is None:
        raise UnusableTree("not_a_regular_file", str(src))
    fd, st = opened
    try:
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnusableTree("file_over_cap", str(src), size=st.st_size, cap=max_bytes)
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_sibling(Path(dst))
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o600)
        try:
            _copy_data(fd, out, st.st_size, st.st_blocks * 512 < st.st_size
                       if hasattr(st, "st_blocks") else False)
        finally:
            os.close(out)
        os.replace(tmp, dst)
        return st.st_size
    finally:
        os.close(fd)


def tree_usage(root: str | os.PathLike[str], stop_above: int, max_entries: int = COPY_MAX_ENTRIES) -> int:
    """The real bytes (allocated blocks, so a sparse file counts what it holds) under `root`, links
    not followed; the walk stops once past `stop_above` bytes.  A tree no copy could take counts as
    over (returns stop_above + 1): more than `max_entries` entries, or nested past the copies'
    depth or path limits (where data could otherwise hide from this walk).  One lstat per entry."""
    top = os.fspath(root)
    total, seen, pending = 0, 0, [(top, 0)]
    while pending:
        d, depth = pending.pop()
        if depth > COPY_MAX_DEPTH or len(os.fsencode(d)) - len(os.fsencode(top)) > COPY_MAX_PATH_BYTES:
            return stop_above + 1
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                seen += 1
                if seen > max_entries:
                    return stop_above + 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += (st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size)
                if total > stop_above:
                    return total
                if stat.S_ISDIR(st.st_mode):
                    pending.append((e.path, depth + 1))
    return total


# ==================================================================================================
# Records: the declared shapes of the job's and run's files
# ==================================================================================================
# Owns the TypedDict declarations of what the job layer and the pipeline write: job.json,
# launcher.json, runtime.json, result.json (and its `usage`), and the run record
# (state/runs/<id>.json).  Declarations only: nothing here reads, writes, checks or defaults a
# value, and a writer never builds its dict from here.  tests/test_records.py runs real jobs and
# runs and fails when a file holds a key that is not declared below (or lacks a required one).
# Shapes are declared as total (keys every writer sets) plus a `total=False` subclass (keys only
# some writers, or only some moments, set).

class JobRecord(TypedDict):
    """job.json: a registered job, written once by _create_job_files() and never changed."""
    job_id: str
    kind: str                        # train | spawn | continue | executor | reviewer | ... (what made it)
    created_at: str                  # ISO UTC
    created_ts: float                # epoch seconds (the reaper's fallback heartbeat)
    cwd: str
    raw_dir: str                     # where the stream copy and supervisor.log go
    session_id: str | None           # the session this job runs (its own, or the resumed one)
    resume: str | None               # the session resumed, if any
    fork: bool
    binary: str
    model: str
    argv: list[str]
    argv_sha256: str
    limits: dict[str, Any]           # session_limits() plus job-specific extras
    prior: dict[str, Any]            # the session's totals before this call (cost, model usage, context)
    meta: dict[str, Any]             # run_id, arm, task, base, label, continues, role ... (caller's tags)
    env_extra: dict[str, str]
    driver: dict[str, Any] | None    # driver_record() of the process that drives it; None by hand
    prices: dict[str, Any] | None
    executor: str                    # local | slurm
    slurm: dict[str, Any] | None
    gateway: str                     # on | off
    study_usd: float | None          # the study's USD cap at creation
    unbounded_request_usd: float | None   # the gateway's stated worst case of an unbounded request
    sandbox: dict[str, Any] | None   # the launch's sandbox decision (kind, mode, binary, reason)
    system_prompt_sha256: str
    prompt_sha256: str


class _LauncherRequired(TypedDict):
    executor: str                    # local | slurm
    host: str
    at: float                        # epoch seconds of the write


class LauncherRecord(_LauncherRequired, total=False):
    """launcher.json: how the job's supervisor was started (launch_supervisor())."""
    submitting: bool                 # slurm: written before sbatch answers
    slurm_job_id: str
    slurm_cluster: str | None
    pid: int                         # local: the detached supervisor
    ctime: float | None              # its creation time (with pid, its identity)


class _RuntimeRequired(TypedDict):
    heartbeat_at: float              # epoch seconds of the last write
    elapsed_s: float                 # since the supervisor started (its monotonic clock)


class RuntimeRecord(_RuntimeRequired, total=False):
    """runtime.json: the running job, written only by its supervisor (Supervisor._write_runtime)."""
    status: str                      # running
    supervisor: dict[str, Any] | None   # ProcId fields of the supervisor
    subreaper: bool
    host: str
    slurm_job_id: str | None
    started_at: str
    started_ts: float
    session_id: str | None
    gateway: str                     # the metering gateway's URL
    claude: dict[str, Any] | None    # ProcId fields of the claude process
    claude_started_at: str
    sandbox: dict[str, Any] | None   # sandbox_record() of the launch
    tool_uses: int
    silent_s: float                  # seconds since claude's last output
    stalled: bool
    stalled_at: str
    finalizing: bool                 # the study lock was busy at the end: still trying


class _UsageRequired(TypedDict):
    tokens: dict[str, int]           # TOKEN_KEYS -> this call's count
    models_used: list[str]
    cost_total_usd: float | None     # the session's reported total, if believable
    cost_delta_usd: float            # this call's own cost
    estimated: bool                  # cost from list prices, not from a reported total
    model_usage: dict[str, Any]      # the session's modelUsage after this call


class UsageRecord(_UsageRequired, total=False):
    """result.json's `usage` (usage_record(), plus the gateway's figures when it metered)."""
    cost_metered_usd: float          # gateway: what the wire's responses cost
    requests: int                    # gateway: metered message requests
    models_metered: dict[str, Any]   # gateway: per-model requests, cost, tokens


class _ResultRequired(TypedDict):
    job_id: str
    status: str                      # one of JOB_FINAL_STATUSES
    reason: str | None
    kind: str | None
    meta: dict[str, Any]
    session_id: str | None
    finished_at: str
    usage: UsageRecord
    flags: list[str]


class ResultRecord(_ResultRequired, total=False):
    """result.json: a job's end, created once by finalize_job() with its caller's extras."""
    anomalies: list[dict[str, Any]]  # hostile values replaced (at most MAX_ANOMALIES)
    detail: str                      # why a launch or the supervisor failed, or a kill came early
    log_tail: str                    # the end of supervisor.log of a launch that never started
    killed_by: str
    survivors: list[dict[str, Any]]  # ProcId fields of processes still alive after the end
    last_heartbeat: float            # lost: the runtime's last heartbeat
    slurm_job_id: str
    exit_code: int | None
    duration_s: float
    claude_version: str | None
    init_fingerprint: dict[str, Any] | None
    fingerprint_drift: dict[str, Any] | None
    cache_verdict: str | None        # hit | partial | miss | cold
    context_tokens: int
    tool_uses: int
    num_turns: int | None
    result_subtype: str | None
    is_error: bool | None
    api_error_status: int | None     # the HTTP status of an API error the binary reported
    result_text: str | None          # the final answer, cut to 2000 characters
    models_reported: list[str]
    bad_lines: int
    unknown_events: int              # stream events of a type the parser does not know
    snapshots: list[int]             # the `snapshots` limits (elapsed seconds) taken during the session
    sandbox: dict[str, Any] | None
    gateway_refusal: dict[str, Any]  # what the gateway refused (budget), if it did
    stream_session_ids: list[str]    # session ids the stream named other than the assigned one
    claim: dict[str, Any] | None     # a claimed infrastructure condition and what the gateway said of it


class _RunRequired(TypedDict):
    run_id: str
    task: str
    arm: str
    repeat: int
    block: str
    order_in_block: int
    split: str
    status: str                      # not_started | running | finished | error | interrupted
    seed: int
    jobs: list[dict[str, Any]]       # one entry per job of the run: job_id, role, ...
    cost_usd: float
    fault: dict[str, Any] | None     # a rehearsal's injected fault


class RunRecord(_RunRequired, total=False):
    """state/runs/<id>.json: one run, created by register_runs(), advanced by RunPipeline."""
    driver: dict[str, Any] | None
    started_at: str
    started_ts: float
    updated_at: str
    finished_at: str
    interrupted_at: str
    paused_by_breaker: bool
    paused_attempts: list[dict[str, Any]]
    outcome: str | None
    validity: str
    validity_reason: str | None
    failure_reason: str | None
    error: str
    error_detail: dict[str, Any]
    interruption: dict[str, Any]     # the interrupted executor job and whether it was resumed
    claude_version: str | None
    provenance: dict[str, Any]
    evaluation: dict[str, Any]
    workspace: dict[str, Any]        # the prepared workspace: file count, git, manifest hash
    base: str | None                 # the trained base a forking arm starts from
    sandbox: dict[str, Any]          # what ran sandboxed: kinds, reasons, sandboxed
    final_contract: dict[str, Any]   # the public check on the final workspace: passed, score
    artifacts: dict[str, Any]        # the final workspace's files and their hashes
    audit: dict[str, Any]            # the behaviour audit's findings
    transcripts_refused: list[dict[str, Any]]   # transcripts not collected (a link, a FIFO, over the cap)
    gates: list[dict[str, Any]]
    gate_cycles: int
    reviews: list[dict[str, Any]]
    review_verdicts: list[str]
    tokens: dict[str, int]
    cost_estimated: bool
    queued_s: float
    wall_s: float


# ==================================================================================================
# Processes
# ==================================================================================================
# Starting helper commands (gate, oracle, git) with a timeout that kills their whole tree, finding
# the `claude` binary, and starting detached supervisors.  Every OS difference is delegated to the
# platform seam; this section only composes its calls.  Owns the Host that lower layers take.
# Must not read studies, decide what a job means, or know where a supervisor runs (Executors).

@dataclass
class CommandResult:
    """What a helper command did: exit code (None on timeout), captured output, wall time."""
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    output_capped: bool = False


#: A helper command's output is kept on disk, not in memory: past this many bytes (stdout and
#: stderr together) the command is killed (`output_capped`), and only the last OUTPUT_TAIL_BYTES
#: of each stream are read back (a receipt is the last line; records keep shorter tails).
OUTPUT_CAP_BYTES = 64 * 1024 * 1024
OUTPUT_TAIL_BYTES = 1024 * 1024


def _tail(fh: Any) -> str:
    fh.seek(0, os.SEEK_END)
    size = fh.tell()
    fh.seek(max(0, size - OUTPUT_TAIL_BYTES))
    return fh.read().decode("utf-8", "replace")


def run_command(argv: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str],
                timeout_s: float, platform: "Platform", stdin_text: str | None = None,
                pass_fds: Sequence[int] = ()) -> CommandResult:
    """Run a helper command to completion; on timeout (or output past OUTPUT_CAP_BYTES) kill its
    whole process tree.

    The command gets its own session (POSIX) so that a timeout can kill every process it left,
    not only the direct child.  Output goes to temporary files, so that neither an endless writer
    nor a process left holding the output open can exhaust memory or block the caller; it is read
    back as text (undecodable bytes replaced), its last OUTPUT_TAIL_BYTES per stream.
    """
    start = time.monotonic()
    kwargs: dict[str, Any] = platform.tree_popen_kwargs()
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        try:
            proc = subprocess.Popen(list(argv), cwd=str(cwd), env=dict(env),
                                    stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                                    stdout=out_f, stderr=err_f, pass_fds=tuple(pass_fds), **kwargs)
        except OSError as exc:
            return CommandResult(list(argv), 127, "", f"cannot start: {exc}", 0.0, False)
        me = platform.proc_id(proc.pid)
        if stdin_text is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.write(stdin_text.encode("utf-8"))
            with contextlib.suppress(OSError):
                proc.stdin.close()
        deadline = start + timeout_s
        timed_out = capped = False
        while True:
            try:
                proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                timed_out = time.monotonic() >= deadline
                capped = (os.fstat(out_f.fileno()).st_size + os.fstat(err_f.fileno()).st_size
                          > OUTPUT_CAP_BYTES)
                if timed_out or capped:
                    platform.kill_tree([me] if me else [], session_ids=[proc.pid])
                    with contextlib.suppress(Exception):
                        proc.kill()
                    proc.wait()
                    break
        out, err = _tail(out_f), _tail(err_f)
    if capped:
        err += f"\nagentbench: the command was stopped: its output passed {OUTPUT_CAP_BYTES} bytes"
    return CommandResult(list(argv), None if timed_out else proc.returncode, out, err,
                         time.monotonic() - start, timed_out, capped)


def bytecode_cache_dir(study_root: str) -> str | None:
    """The study's bytecode cache directory, created if need be; None (Python's default, or no
    cache) when it cannot be: a cache is an optimisation, never a reason to fail a launch."""
    state = os.path.join(study_root, STATE_DIR)
    if not os.path.isdir(state):
        return None
    path = os.path.join(state, BYTECODE_CACHE_DIR)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def detach_agentbench(platform: "Platform", args: Sequence[str], *, cwd: str, env: Mapping[str, str],
                      log_path: str, secret: Mapping[str, str] | None = None) -> int:
    """Start `agentbench <args>` fully detached, through the cached-bytecode launcher; its pid.
    `cwd` is the study's root: the bytecode is kept in its state dir (see bytecode_cache_dir).

    Where the platform cannot hand the environment to a detached child directly (Windows CIM),
    it is passed through an owner-only env file named by --env-file, which the child deletes.
    `secret` (credentials) stays out of the child's initial environment, which any process of the
    same user can read: it goes down a pipe on the child's stdin (--credentials-stdin), so nothing
    is left behind; only where an env file is used anyway does it travel in that file.
    """
    argv = launcher_argv(sys.executable, str(Path(__file__).resolve()), bytecode_cache_dir(cwd), args)
    env_file = platform.detach_env_file({**env, **dict(secret or {})}, log_path)
    stdin_data = None
    if env_file:
        argv += ["--env-file", env_file]
    elif secret:
        argv += ["--credentials-stdin"]
        stdin_data = json.dumps({"env": dict(secret)}).encode()
    if stdin_data is None:
        return platform.detach_argv_popen(argv, cwd=cwd, env=env, log_path=log_path)
    return platform.detach_argv_popen(argv, cwd=cwd, env=env, log_path=log_path, stdin_data=stdin_data)


def local_claude_path() -> Path:
    return HERE / ".agentbench-tools" / "node_modules" / ".bin" / "claude"


def find_claude_binary(configured: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
    """Locate `claude`: the study's configured path, $AGENTBENCH_CLAUDE_BIN, PATH, or a local install.

    Returns (path or None, how it was found).  The local install is where `demo` puts the pinned
    release when nothing else is found (./.agentbench-tools next to this file).
    """
    if configured:
        p = shutil.which(configured) or (configured if os.path.isfile(configured) else None)
        return p, "study config"
    if env.get("AGENTBENCH_CLAUDE_BIN"):
        raw = env["AGENTBENCH_CLAUDE_BIN"]
        p = shutil.which(raw) or (raw if os.path.isfile(raw) else None)
        return p, "AGENTBENCH_CLAUDE_BIN"
    p = shutil.which("claude", path=env.get("PATH"))
    if p:
        return p, "PATH"
    local = local_claude_path()
    if local.is_file():
        return str(local), "local install"
    return None, "not found"


def claude_version(binary: str, platform: "Platform", env: Mapping[str, str] | None = None) -> str | None:
    """`claude --version`, first token (e.g. '2.1.332'), or None if it does not answer.  `env`
    is the caller's environment (this process's unless given)."""
    res = run_command([binary, "--version"], cwd=os.getcwd(), env=os.environ if env is None else env,
                      timeout_s=30, platform=platform)
    if res.returncode != 0:
        return None
    text = res.stdout.strip().split()
    return text[0] if text else None


def install_pinned_claude(platform: "Platform", env: Mapping[str, str] | None = None) -> str:
    """Install the pinned `claude` release locally with npm (used by `demo` on a fresh machine),
    with the caller's environment `env` (this process's unless given)."""
    npm = shutil.which("npm")
    if not npm:
        raise AgentbenchError("the claude binary was not found and npm is not available to install it",
                              code="claude_binary_not_found_npm",
                              hint=("install it: npm install -g "
                                    f"@anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}"))
    prefix = HERE / ".agentbench-tools"
    prefix.mkdir(parents=True, exist_ok=True)
    log(f"installing @anthropic-ai/claude-code@{CLAUDE_CODE_PINNED} into {prefix} (one time)")
    res = run_command([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                       f"@anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}"],
                      cwd=str(prefix), env=os.environ if env is None else env, timeout_s=600,
                      platform=platform)
    if res.returncode != 0 or not local_claude_path().is_file():
        raise AgentbenchError("installing the claude binary failed", code="installing_claude_binary_failed",
                              detail=res.stderr[-2000:],
                              hint=("install it by hand: npm install -g "
                                    f"@anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}"))
    return str(local_claude_path())


# -- the host: what the layers below the CLI know of their process ---------------------------------

@dataclass
class Host:
    """The platform seam and the environment a command runs with: what every layer below the CLI
    takes (the CLI's `Ctx` is a Host with the cwd, the emitter and the child marker added)."""
    platform: Platform
    env: Mapping[str, str]


# ==================================================================================================
# Executors: where a job's supervisor runs (local, Slurm)
# ==================================================================================================
# Owns how a job's supervisor is started, asked about and cancelled on each executor, and what a
# launch record (launcher.json) means.  Built like the platform seam: a small `Executor` base with
# one class per executor (`LocalExecutor` detaches the supervisor on this host, `SlurmExecutor`
# submits it as a one-task batch job), and `executor_for` to pick one by name or by record; callers
# hold an executor and never switch on its name.  Every call takes the environment it uses.  With
# Slurm the study directory must be on a file system the compute nodes share; Slurm is reached only
# through its commands (sbatch, squeue, scancel), so that any installation works and tests can put
# fakes on PATH: their argv and parsers are pure, the three calls are the I/O.  What the executors
# need from later sections (credentials, finalisation) is passed in.  Must not finalise jobs, read
# the registry, or know about runs or arms.

#: sbatch options agentbench sets itself; a study's sbatch_args may not override them.
SBATCH_OWN_OPTIONS = ("--output", "-o", "--error", "-e", "--export", "--wait", "-W", "--array", "-a",
                      "--chdir", "-D", "--parsable", "--wrap", "--hold", "-H", "--clusters", "-M")
#: sbatch's wait for its controller before agentbench gives up on a submission.
SBATCH_TIMEOUT_S = 120.0


def slurm_batch_script(python: str, study_root: str, job_id: str, credentials_file: str | None = None) -> str:
    """The batch script of one job: exec the supervisor, so that Slurm's signals reach it directly."""
    cache = os.path.join(study_root, STATE_DIR, BYTECODE_CACHE_DIR)  # Python makes it if need be
    argv = launcher_argv(python, str(Path(__file__).resolve()), cache,
                         ["_supervise", "--study", study_root, "--job", job_id])
    if credentials_file:
        argv += ["--credentials-file", credentials_file]
    return ("#!/bin/sh\n"
            f"# agentbench supervisor of job {job_id}; written by agentbench, do not edit.\n"
            "exec " + " ".join(shlex.quote(a) for a in argv) + "\n")


def sbatch_argv(job_id: str, script: str, *, output: str, chdir: str, slurm: Mapping[str, Any],
                wall_s: float | None) -> list[str]:
    """The sbatch call for a job.  A time limit is asked for (the job's wall time plus a margin for
    start-up and finalisation) unless the study's own sbatch_args set one."""
    extra = list(slurm.get("sbatch_args") or [])
    # --output takes a filename pattern: a literal % in the path is written %%.  --export=ALL
    # overrides a site's SBATCH_EXPORT (the supervisor needs PATH and the study's variables).
    argv = ["sbatch", "--parsable", f"--job-name=agentbench-{job_id}",
            f"--output={output.replace('%', '%%')}", f"--chdir={chdir}", "--ntasks=1", "--export=ALL"]
    if slurm.get("partition"):
        argv.append(f"--partition={slurm['partition']}")
    sets_time = any(a in ("-t", "--time") or a.startswith("--time=")
                    or (a.startswith("-t") and not a.startswith("--"))
                    for a in extra)
    if wall_s and not sets_time:
        margin = slurm.get("time_margin_s")
        margin_s = SLURM_TIME_MARGIN_DEFAULT_S if margin is None else float(margin)
        minutes = math.ceil((float(wall_s) + margin_s) / 60)
        argv.append(f"--time={max(1, minutes)}")
    return argv + extra + [script]


def sbatch_option_name(arg: str) -> str:
    """The option an sbatch argument sets: "--output=x" -> "--output", "-ox" -> "-o"."""
    if arg.startswith("--"):
        return arg.split("=", 1)[0]
    return arg[:2]


def sbatch_own_options(args: Sequence[str]) -> list[str]:
    """Which of agentbench's own sbatch options the arguments would set.  sbatch accepts an
    unambiguous prefix of a long option (--out for --output), so a prefix counts too."""
    hit = set()
    for arg in args:
        name = sbatch_option_name(arg)
        long_prefix = name.startswith("--") and len(name) > 2
        hit |= {o for o in SBATCH_OWN_OPTIONS if o == name or (long_prefix and o.startswith(name))}
    return sorted(hit)


def parse_sbatch_job_id(stdout: str) -> tuple[str, str | None]:
    """The job id and cluster from `sbatch --parsable` output ("123" or "123;cluster"); raises if
    there is no id.  The cluster matters: squeue and scancel must ask the same one (-M)."""
    line = next((ln.strip() for ln in stdout.splitlines() if ln.strip()), "")
    jid, _, cluster = line.partition(";")
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", jid):
        raise AgentbenchError("sbatch did not print a job id", code="sbatch_did_not_print_job",
                              stdout=stdout[-300:])
    return jid, (cluster.strip() or None)


def slurm_client_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for squeue/scancel: without the user's SQUEUE_*/SCANCEL_* defaults, which
    could filter or reformat the answers agentbench parses."""
    return {k: v for k, v in env.items() if not k.startswith(("SQUEUE_", "SCANCEL_"))}


def parse_squeue_state(result: CommandResult) -> str | None:
    """A Slurm job's state from `squeue -h -j ID -o %T`: the state name, "GONE" when the controller
    no longer knows the job (or lists nothing for it), None when squeue could not be asked (the
    controller down, squeue missing): an unknown is never taken for a death."""
    if result.returncode == 0:
        states = [ln.strip().upper() for ln in result.stdout.splitlines() if ln.strip()]
        return states[0] if states else "GONE"
    if "invalid job id" in (result.stderr or "").lower():
        return "GONE"
    return None


def slurm_submit(platform: "Platform", paths: StudyPaths, job: Mapping[str, Any], env: Mapping[str, str],
                 credentials_file: str | None = None) -> tuple[str, str | None]:
    """Submit a job's supervisor with sbatch; its Slurm job id and cluster.  Raises
    AgentbenchError on refusal.  `env` is what the batch job inherits (--export=ALL)."""
    slurm = dict(job.get("slurm") or {})
    study_root = str(paths.root)
    script = paths.job_dir(job["job_id"]) / "slurm.sh"
    write_text_atomic(script, slurm_batch_script(slurm.get("python") or sys.executable, study_root,
                                                 job["job_id"], credentials_file))
    argv = sbatch_argv(job["job_id"], str(script), output=os.path.join(job["raw_dir"], "supervisor.log"),
                       chdir=study_root, slurm=slurm, wall_s=(job.get("limits") or {}).get("wall_s"))
    res = run_command(argv, cwd=study_root, env=env, timeout_s=SBATCH_TIMEOUT_S, platform=platform)
    if res.returncode != 0:
        raise AgentbenchError("sbatch refused the job", code="sbatch_refused_job",
                              detail=(res.stderr or res.stdout).strip()[-500:],
                              returncode=res.returncode, hint="check the study's slurm settings and `sinfo`")
    return parse_sbatch_job_id(res.stdout)


#: (SLURM_CONF, cluster, job id) -> (monotonic time read, state): answers reused for
#: slurm_poll_s() within one process.
_SLURM_STATES: dict[tuple[str, str, str], tuple[float, str]] = {}


def _slurm_key(slurm_job_id: str, env: Mapping[str, str], cluster: str | None) -> tuple[str, str, str]:
    return (env.get("SLURM_CONF", ""), cluster or "", str(slurm_job_id))


def slurm_state(platform: "Platform", slurm_job_id: str, env: Mapping[str, str],
                cluster: str | None = None, fresh: bool = False) -> str | None:
    """The job's state as squeue reports it (see parse_squeue_state); a state read less than
    slurm_poll_s() ago is reused unless `fresh`.  "Cannot tell" is never reused."""
    now = time.monotonic()
    key = _slurm_key(slurm_job_id, env, cluster)
    cached = _SLURM_STATES.get(key)
    if cached is not None and not fresh and now - cached[0] < slurm_poll_s():
        return cached[1]
    argv = ["squeue", "-h", "-j", str(slurm_job_id), "-o", "%T"] + (["-M", cluster] if cluster else [])
    res = run_command(argv, cwd=os.getcwd(), env=slurm_client_env(env), timeout_s=60, platform=platform)
    if cluster and res.returncode == 0:
        # With -M, squeue prints a "CLUSTER: name" line before the job's state.
        res = dataclasses.replace(res, stdout="\n".join(ln for ln in res.stdout.splitlines()
                                                         if not ln.strip().upper().startswith("CLUSTER:")))
    state = parse_squeue_state(res)
    if state is not None:
        if len(_SLURM_STATES) > 10000:
            _SLURM_STATES.clear()
        _SLURM_STATES[key] = (now, state)
    return state


def slurm_cancel(platform: "Platform", slurm_job_id: str, env: Mapping[str, str],
                 cluster: str | None = None) -> CommandResult:
    """scancel the job: Slurm sends SIGTERM to its processes, SIGKILL after its KillWait."""
    _SLURM_STATES.pop(_slurm_key(slurm_job_id, env, cluster), None)
    argv = ["scancel", str(slurm_job_id)] + (["-M", cluster] if cluster else [])
    return run_command(argv, cwd=os.getcwd(), env=slurm_client_env(env), timeout_s=60, platform=platform)


def proc_from_record(d: Mapping[str, Any] | None) -> ProcId | None:
    """The process a record names ({"pid", "ctime"}: a launch record, a runtime's supervisor or
    claude); None when it names none."""
    if not d or d.get("pid") is None:
        return None
    return ProcId(int(d["pid"]), d.get("ctime"))


#: The commands a Slurm study needs on PATH where agentbench runs.
SLURM_COMMANDS = ("sbatch", "squeue", "scancel")


class Executor:
    """Where a job's supervisor runs: how it is started (`submit`), asked about (`presence`) and
    cancelled (`cancel`), and what its launch record names (`job_of`, `cluster_of`).  Callers hold
    one (see executor_for) and never switch on its name; every call takes the environment it uses."""

    #: The study's `executor` value, and the `executor` key of the launch records it writes.
    name = ""
    #: The supervisor runs on this host: its sandbox is decided here and its pid can be checked.
    runs_here = True
    #: A submission may wait in a queue before its supervisor starts (a wait that is not run time).
    queues = False

    def submit(self, platform: "Platform", paths: StudyPaths, job: Mapping[str, Any], *,
               env: Mapping[str, str], secret: Mapping[str, str]) -> LauncherRecord:
        """Start the job's supervisor; the launch record to write as launcher.json.  `env` holds no
        credential: `secret` (the credentials) travels apart.  Raises AgentbenchError or OSError."""
        raise NotImplementedError

    def launch_error(self, exc: AgentbenchError | OSError) -> str:
        """The detail a job that could not be submitted is finalised with."""
        raise NotImplementedError

    def handle(self, launcher: Mapping[str, Any]) -> dict[str, Any]:
        """What the answer of a launch names the started supervisor by."""
        raise NotImplementedError

    def presence(self, platform: "Platform", runtime: Mapping[str, Any] | None,
                 launcher: Mapping[str, Any] | None, env: Mapping[str, str],
                 now: float | None = None) -> bool | None:
        """Is the job's supervisor still there (or, before it started, its launch still pending)?
        True: alive, starting or queued; False: certainly gone; None: cannot tell, which callers
        must treat as alive.  `now` (epoch seconds) is the clock's reading unless given."""
        raise NotImplementedError

    def cancel(self, platform: "Platform", launcher: Mapping[str, Any] | None,
               env: Mapping[str, str]) -> CommandResult | None:
        """Cancel the job through its executor; None when the executor has nothing to cancel."""
        raise NotImplementedError

    def state(self, platform: "Platform", launcher: Mapping[str, Any] | None, env: Mapping[str, str],
              *, fresh: bool = False) -> str | None:
        """The executor's word on the job it holds (a Slurm state); None: it holds none, or no answer."""
        return None

    def process_of(self, launcher: Mapping[str, Any] | None) -> ProcId | None:
        """The supervisor process the launch record names for certain (a pid with its creation
        time: a bare pid may name another process by now), wherever it was recorded."""
        return None

    def job_of(self, launcher: Mapping[str, Any] | None) -> str | None:
        """The executor's own id of the job the launch record names (None: it names a process)."""
        return None

    def cluster_of(self, launcher: Mapping[str, Any] | None) -> str | None:
        """The cluster the executor's id belongs to (None: the default one, or no cluster)."""
        return None

    def missing_commands(self, env: Mapping[str, str]) -> list[str]:
        """The commands this executor needs that are not on env's PATH."""
        return []


class LocalExecutor(Executor):
    """The supervisor detached on this host (detach_agentbench), known by pid + creation time and
    checked only on the host that recorded it.  Nothing to cancel: the supervisor answers a kill
    request itself, and a kill stops its tree by pid."""

    name = "local"

    def submit(self, platform: "Platform", paths: StudyPaths, job: Mapping[str, Any], *,
               env: Mapping[str, str], secret: Mapping[str, str]) -> LauncherRecord:
        pid = detach_agentbench(platform, ["_supervise", "--study", str(paths.root), "--job", job["job_id"]],
                                cwd=str(paths.root), env=env, secret=secret,
                                log_path=os.path.join(job["raw_dir"], "supervisor.log"))
        pc = platform.proc_id(pid)
        return {"executor": self.name, "pid": pid, "ctime": pc.ctime if pc else None,
                "host": platform.hostname(), "at": time.time()}

    def launch_error(self, exc: AgentbenchError | OSError) -> str:
        # The platform reports a failed start as AgentbenchError (POSIX) or OSError.
        detail = exc.payload.get("detail", str(exc)) if isinstance(exc, AgentbenchError) else str(exc)
        return f"cannot start supervisor: {detail}"

    def handle(self, launcher: Mapping[str, Any]) -> dict[str, Any]:
        return {"supervisor_pid": launcher["pid"]}

    def presence(self, platform: "Platform", runtime: Mapping[str, Any] | None,
                 launcher: Mapping[str, Any] | None, env: Mapping[str, str],
                 now: float | None = None) -> bool | None:
        record = runtime if runtime is not None else launcher
        if not platform.is_local(record):
            return None      # a process recorded on another host
        proc = proc_from_record((runtime or {}).get("supervisor") if runtime is not None else launcher)
        return bool(proc and platform.is_alive(proc))

    def cancel(self, platform: "Platform", launcher: Mapping[str, Any] | None,
               env: Mapping[str, str]) -> CommandResult | None:
        return None

    def process_of(self, launcher: Mapping[str, Any] | None) -> ProcId | None:
        if (launcher or {}).get("executor") == self.name and (launcher or {}).get("ctime") is not None:
            return proc_from_record(launcher)
        return None


class SlurmExecutor(Executor):
    """The supervisor submitted as a one-task batch job (see slurm_submit), known by its Slurm job
    id and cluster, asked about through squeue (whose word covers a job still queued, which has no
    process yet) and cancelled with scancel."""

    name = "slurm"
    runs_here = False
    queues = True

    def submit(self, platform: "Platform", paths: StudyPaths, job: Mapping[str, Any], *,
               env: Mapping[str, str], secret: Mapping[str, str]) -> LauncherRecord:
        jdir = paths.job_dir(job["job_id"])
        # Recorded before sbatch runs, so that no reaper takes a slow submission for a dead one.
        write_json_atomic(jdir / "launcher.json", {"executor": self.name, "submitting": True,
                                                   "host": platform.hostname(), "at": time.time()})
        # Credentials do not travel in the batch job's environment (Slurm keeps that in its
        # controller's state, and possibly its accounting): an owner-only file on the shared
        # study directory carries them to the supervisor, which reads and deletes it.
        creds_file = str(jdir / "credentials.json") if secret else None
        try:
            if creds_file:
                write_private_json(creds_file, {"env": dict(secret)})
            sjid, cluster = slurm_submit(platform, paths, job, env, creds_file)
        except (AgentbenchError, OSError):
            if creds_file:
                with contextlib.suppress(OSError):
                    os.unlink(creds_file)
            raise
        return {"executor": self.name, "slurm_job_id": sjid, "slurm_cluster": cluster,
                "host": platform.hostname(), "at": time.time()}

    def launch_error(self, exc: AgentbenchError | OSError) -> str:
        detail = ((exc.payload.get("detail") or exc.payload.get("error"))
                  if isinstance(exc, AgentbenchError) else str(exc))
        return f"cannot submit to slurm: {detail}"

    def handle(self, launcher: Mapping[str, Any]) -> dict[str, Any]:
        return {"slurm_job_id": launcher["slurm_job_id"]}

    def presence(self, platform: "Platform", runtime: Mapping[str, Any] | None,
                 launcher: Mapping[str, Any] | None, env: Mapping[str, str],
                 now: float | None = None) -> bool | None:
        sjid = self.job_of(launcher)
        if sjid is None:
            # sbatch has not answered yet, or its caller died before recording the id: alive while
            # the submission could still be under way.
            now = time.time() if now is None else now
            return now - float((launcher or {}).get("at") or 0) <= SBATCH_TIMEOUT_S + 60
        state = slurm_state(platform, sjid, env, self.cluster_of(launcher))
        return None if state is None else state in SLURM_LIVE_STATES

    def state(self, platform: "Platform", launcher: Mapping[str, Any] | None, env: Mapping[str, str],
              *, fresh: bool = False) -> str | None:
        """The submitted job's state (see slurm_state); None without a job id or an answer."""
        sjid = self.job_of(launcher)
        if sjid is None:
            return None
        return slurm_state(platform, sjid, env, self.cluster_of(launcher), fresh=fresh)

    def cancel(self, platform: "Platform", launcher: Mapping[str, Any] | None,
               env: Mapping[str, str]) -> CommandResult | None:
        sjid = self.job_of(launcher)
        return None if sjid is None else slurm_cancel(platform, sjid, env, self.cluster_of(launcher))

    def job_of(self, launcher: Mapping[str, Any] | None) -> str | None:
        if launcher and launcher.get("executor") == self.name and launcher.get("slurm_job_id"):
            return str(launcher["slurm_job_id"])
        return None

    def cluster_of(self, launcher: Mapping[str, Any] | None) -> str | None:
        return (launcher or {}).get("slurm_cluster") or None

    def missing_commands(self, env: Mapping[str, str]) -> list[str]:
        return [c for c in SLURM_COMMANDS if shutil.which(c, path=env.get("PATH")) is None]


#: Every executor by its name (the study's `executor` values).
EXECUTORS: dict[str, Executor] = {e.name: e for e in (LocalExecutor(), SlurmExecutor())}


def executor_for(name_or_record: str | Mapping[str, Any] | None) -> Executor:
    """The executor a study's `executor` value, a job record or a launch record names.  Anything
    but a known name (none, or a record written before executors were named) is local, as such a
    launch has always been read."""
    name = name_or_record.get("executor") if isinstance(name_or_record, Mapping) else name_or_record
    return EXECUTORS.get(name if isinstance(name, str) else "local") or EXECUTORS["local"]


# ==================================================================================================
# Env scrub
# ==================================================================================================
# The environment of check commands (gate, oracle, reviewer checks): the host's minus a documented
# drop list and minus every credential, plus pinned variables; `claude`'s own allow-list
# environment is the metering gateway's (claude_env).  Pure functions of a mapping; must not read
# os.environ itself.

#: Dropped exactly: IDE/desktop session markers, model/effort overrides, cache-TTL switches.
ENV_DROP_EXACT = frozenset({
    "CLAUDECODE", "CLAUDE_CODE_ENTRYPOINT", "CLAUDE_CODE_SSE_PORT", "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL",
    "CLAUDE_AGENT_SDK_VERSION", "CLAUDE_CODE_SESSION_ID", "CLAUDE_PROJECT_DIR",
    "ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
    "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL",
    "CLAUDE_CODE_EFFORT_LEVEL", "MAX_THINKING_TOKENS", "CLAUDE_CODE_MAX_OUTPUT_TOKENS",
    "DISABLE_PROMPT_CACHING", "DISABLE_PROMPT_CACHING_HAIKU", "DISABLE_PROMPT_CACHING_SONNET",
    "DISABLE_PROMPT_CACHING_OPUS", "ENABLE_PROMPT_CACHING_1H_BEDROCK", "CLAUDE_CODE_PROMPT_CACHE_TTL",
    "CLAUDE_CODE_DISABLE_LEGACY_MODEL_REMAP", "CLAUDE_CODE_EXTRA_BODY", "ANTHROPIC_BETAS",
    "CLAUDE_CODE_SIMPLE", "CLAUDE_CODE_OVERLOADED_RETRY_MAX_WAIT_MS",
    "VIRTUAL_ENV", "VIRTUAL_ENV_PROMPT", "PYTHONHOME", "PYTHONPATH", "CONDA_PREFIX", "CONDA_DEFAULT_ENV",
    "TERM_PROGRAM", "TERM_PROGRAM_VERSION", "GIT_ASKPASS", "DISPLAY", "WAYLAND_DISPLAY",
    "DBUS_SESSION_BUS_ADDRESS", "SSH_AUTH_SOCK", "AGENTBENCH_STUDY",
})
#: Dropped by prefix: editor integrations, uv's own settings (a child must not inherit a caller's
#: uv project), desktop session variables.
ENV_DROP_PREFIXES = ("VSCODE_", "CURSOR_", "UV_", "JETBRAINS_", "XDG_SESSION", "GNOME_", "KDE_",
                     "ELECTRON_", "NVM_INC")
#: Credentials: passed to `claude`, never to gate, oracle or check commands.
CREDENTIAL_VARS = frozenset({
    "ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN", "ANTHROPIC_BEDROCK_BASE_URL",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK",
    "GOOGLE_APPLICATION_CREDENTIALS", "ANTHROPIC_VERTEX_PROJECT_ID", "GH_TOKEN", "GITHUB_TOKEN",
    "ANTHROPIC_CUSTOM_HEADERS",   # may carry an auth header
})
CREDENTIAL_PATTERNS = ("*_API_KEY", "*_TOKEN", "*_SECRET", "*_SECRET_KEY", "*_PASSWORD")
#: CLAUDE_*/ANTHROPIC_* variables agentbench knows and passes on deliberately.
ENV_KNOWN_PASS = frozenset({
    "ANTHROPIC_BASE_URL", "CLAUDE_CONFIG_DIR", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "CLAUDE_CODE_MAX_RETRIES", "API_TIMEOUT_MS",
    "CLAUDE_CODE_SKIP_BEDROCK_AUTH", "CLAUDE_CODE_SKIP_VERTEX_AUTH",
})
#: Set on every child: no self-update mid-study, the child marker, less background traffic.
ENV_PINNED = {"DISABLE_AUTOUPDATER": "1", "AGENTBENCH_CHILD": "1",
              "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
              "DISABLE_ERROR_REPORTING": "1"}


def is_credential_var(name: str) -> bool:
    return name in CREDENTIAL_VARS or any(fnmatch.fnmatchcase(name, p) for p in CREDENTIAL_PATTERNS)


def venv_path_entries(env: Mapping[str, str]) -> list[str]:
    """The PATH entries of `env` inside a Python virtual environment: under $VIRTUAL_ENV, or next to
    a pyvenv.cfg (looked up on disk)."""
    venv = env.get("VIRTUAL_ENV")
    out = []
    for entry in env.get("PATH", "").split(os.pathsep):
        if not entry:
            continue
        if venv and (entry == venv or entry.startswith(venv.rstrip("/\\") + os.sep)):
            out.append(entry)
        elif os.path.isfile(os.path.join(entry, "..", "pyvenv.cfg")):
            out.append(entry)
    return out


def scrub_env(host: Mapping[str, str], *, for_claude: bool, binary: str | None = None,
              extra: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """The child environment and a report of what was dropped, pinned and not recognised.

    for_claude=True keeps credentials (the `claude` process needs them); False drops every
    credential-looking variable (gate, oracle and reviewer checks never see keys or tokens).
    `extra` is applied after the scrub (e.g. ANTHROPIC_BASE_URL for the scripted model), and only
    the pinned variables come after it.
    """
    dropped: list[str] = []
    creds: list[str] = []
    unknown: list[str] = []
    venv_entries = venv_path_entries(host)
    env: dict[str, str] = {}
    for key, value in host.items():
        if key in ENV_DROP_EXACT or key.startswith(ENV_DROP_PREFIXES):
            dropped.append(key)
            continue
        if is_credential_var(key):
            creds.append(key)
            if not for_claude:
                continue
        elif (key.startswith(("CLAUDE_", "ANTHROPIC_")) and key not in ENV_KNOWN_PASS
              and key not in ENV_PINNED):
            unknown.append(key)
        env[key] = value
    if venv_entries and "PATH" in env:
        env["PATH"] = os.pathsep.join(e for e in env["PATH"].split(os.pathsep) if e not in venv_entries)
    if extra:
        env.update(extra)
    # Pinned last: a study's own `env` (passed as `extra`) may add variables but not lift a pin;
    # without the child marker an agent under test could launch or kill sessions.
    env.update(ENV_PINNED)
    if binary:
        env["AGENTBENCH_CLAUDE_BIN"] = binary
    report = {"dropped": sorted(dropped), "dropped_path_entries": venv_entries,
              "credentials": sorted(creds), "credentials_passed": for_claude,
              "pinned": sorted(ENV_PINNED), "unknown_claude_vars": sorted(unknown)}
    return env, report


def check_env(host: Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any]]:
    """The environment for gate, oracle and check commands: scrubbed and credential-free."""
    env, report = scrub_env(host, for_claude=False)
    env.pop("AGENTBENCH_CLAUDE_BIN", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"   # checks must not leave __pycache__ in a workspace
    return env, report


# ==================================================================================================
# The sandbox
# ==================================================================================================
# Owns: the `sandbox` study setting ("auto" | "bwrap" | "none"), the decision which sandbox a
# launch gets, the probe that tells whether bubblewrap really runs on this host (once per process,
# cached, with the reason when not), and the pure builders of the bubblewrap argv: a table of
# mounts over bubblewrap's own empty root (the system and tool directories read-only, /etc's
# secrets masked, the study/tasks/home hidden where a bound directory holds them, read-only and
# read-write binds, private /tmp, /proc and /dev, a session's gateway socket), then the namespace
# options: the network (none, or the host's for an opened arm) and the seccomp filter (its
# classic-BPF program per architecture).  Also the receipt channel of check commands: an
# inherited socket named by the {receipt_fd} placeholder.
# Must not: start sessions or checks itself, read the study's registry, or change an environment
# beyond the few variables a sandboxed process needs (HOME, CLAUDE_CONFIG_DIR, TMPDIR, and inside
# a session's sandbox ANTHROPIC_BASE_URL, pointed at its relay).

SANDBOX_MODES = ("auto", "bwrap", "none")
#: What a study that says nothing gets: bubblewrap where it runs, else none (said in the report).
SANDBOX_DEFAULT = "auto"
SANDBOX_BINARY = "bwrap"
SANDBOX_PROBE_TIMEOUT_S = 20.0
#: Namespace options of every sandbox: own pid namespace (the supervisor, other sessions and their
#: environments invisible; every process dies with the sandbox's first one), own IPC, killed with
#: the parent (the supervisor or the check runner), a new terminal session, no capabilities (root
#: inside could otherwise unmount the hiding tmpfs).  The network is decided per launch
#: (SANDBOX_NETWORKS).
SANDBOX_NAMESPACE_OPTIONS = ("--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session",
                             "--cap-drop", "ALL")
#: What a sandboxed process can reach: "none", an own network namespace with only its own loopback
#: (every check; a session, whose gateway then comes in as a Unix socket); "open", the host's
#: network (a session of an arm the study opens it for, or one without a gateway).
SANDBOX_NETWORKS = ("none", "open")
#: A session's network as recorded: only its own gateway, or the host's.
SESSION_NETWORKS = ("gateway", "open")
#: Directories never hidden, whatever a setting says (hiding them would hide the host itself).
SANDBOX_NEVER_HIDE = ("/", "/usr", "/bin", "/lib", "/etc", "/proc", "/dev")
#: The host's system directories, bound read-only (a symlink, as on a merged-/usr system, is made
#: again as the same symlink).  Nothing else of the host is there unless a launch binds it.
SANDBOX_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: What of /etc is never readable inside: password hashes, sudo rules, host and TLS private keys,
#: the cluster's authentication key (munge) and database passwords (slurmdbd), VPN, Wi-Fi, mail,
#: Kerberos and service credentials.  A directory is masked by an empty tmpfs, a file by /dev/null.
SANDBOX_ETC_SECRETS = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers", "/etc/sudoers.d",
    "/etc/security/opasswd", "/etc/ssh", "/etc/ssl/private", "/etc/pki/tls/private", "/etc/munge",
    "/etc/slurm/slurmdbd.conf", "/etc/krb5.keytab", "/etc/ipsec.secrets", "/etc/ipsec.d/private",
    "/etc/wireguard", "/etc/openvpn", "/etc/NetworkManager/system-connections", "/etc/ppp/chap-secrets",
    "/etc/ppp/pap-secrets", "/etc/mysql/debian.cnf", "/etc/letsencrypt", "/etc/credstore",
    "/etc/credstore.encrypted", "/etc/docker", "/etc/kubernetes", "/etc/rancher", "/etc/libvirt/secrets",
    "/etc/postfix/sasl_passwd", "/etc/exim4/passwd.client", "/etc/davfs2/secrets", "/etc/cups/ssl",
    "/etc/.pwd.lock", "/etc/netrc", "/etc/gitlab", "/etc/ceph")
#: Where a session's gateway socket appears inside its sandbox (a new mount point in bwrap's own
#: root, which the sandboxed process cannot unmount nor replace).
SANDBOX_GATEWAY_SOCKET = "/run/agentbench/gateway.sock"


#: The first program inside a session's sandbox (argv: the gateway socket inside or "-", then
#: claude's argv).  It gives back the default SIGTERM that the bwrap processes around it ignore
#: (sandbox_preexec), so a graceful stop reaches `claude` (which then still reports its result and
#: cost) instead of bwrap, whose death would take the whole sandbox down at once.  With a socket,
#: it first listens on a free loopback port of the sandbox's own network namespace, forks a relay
#: that pipes each connection to the gateway's socket, and points ANTHROPIC_BASE_URL there: the
#: port listens before `claude` starts.  The relay is the sandbox's own: killing it costs only
#: this session's API access, since the gateway still checks the job's token.
SANDBOX_EXEC_SHIM = "\n".join((
    "import os, signal, socket, sys, threading",
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)",
    "path = sys.argv[1]",
    "def pipe(a, b):",
    "    try:",
    "        while True:",
    "            d = a.recv(65536)",
    "            if not d: break",
    "            b.sendall(d)",
    "    except OSError: pass",
    "    try: b.shutdown(socket.SHUT_WR)",
    "    except OSError: pass",
    "def serve(c):",
    "    u = socket.socket(socket.AF_UNIX)",
    "    try: u.connect(path)",
    "    except OSError: c.close(); u.close(); return",
    "    t = threading.Thread(target=pipe, args=(u, c), daemon=True); t.start()",
    "    pipe(c, u); t.join(); c.close(); u.close()",
    "if path != '-':",
    "    lis = socket.socket(); lis.bind(('127.0.0.1', 0)); lis.listen(64)",
    "    os.environ['ANTHROPIC_BASE_URL'] = 'http://127.0.0.1:%d' % lis.getsockname()[1]",
    "    if os.fork() == 0:",
    "        try:",
    "            while True:",
    "                c = lis.accept()[0]",
    "                threading.Thread(target=serve, args=(c,), daemon=True).start()",
    "        finally: os._exit(0)",
    "    lis.close()",
    "os.execvp(sys.argv[2], sys.argv[2:])"))


def sandbox_preexec() -> None:
    """Popen preexec_fn of a sandboxed session: bwrap (and only bwrap) ignores SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def sandbox_default(env: Mapping[str, str] | None = None) -> str:
    """The mode of a study without a `sandbox` key: SANDBOX_DEFAULT, or (tests whose fake binary
    writes hooks outside its workspace) AGENTBENCH_SANDBOX_DEFAULT in `env`."""
    # None: this process's own environment (a test knob set where the process starts).
    env = os.environ if env is None else env
    raw = env.get("AGENTBENCH_SANDBOX_DEFAULT") or SANDBOX_DEFAULT
    if raw not in SANDBOX_MODES:
        raise AgentbenchError("AGENTBENCH_SANDBOX_DEFAULT must be one of " + ", ".join(SANDBOX_MODES),
                              code="bad_sandbox_default", value=raw)
    return raw


def sandbox_mode_of(cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> str:
    """The study's sandbox mode (its shape was checked where study.json was read); without a
    `sandbox` key, sandbox_default(env)."""
    mode = cfg.get("sandbox")
    if mode is not None and mode not in SANDBOX_MODES:
        raise AgentbenchError("sandbox must be one of " + ", ".join(SANDBOX_MODES), code="bad_sandbox_mode",
                              value=str(mode)[:200])
    return str(mode) if mode is not None else sandbox_default(env)


def session_network(open_arms: Sequence[str], arm: str | None, gateway: str) -> tuple[str, str | None]:
    """(network, why) of one session (pure): "gateway" (its own gateway only), or "open" with the
    reason: the study opens the network for its arm, or it has no gateway to reach the API by."""
    if arm is not None and arm in open_arms:
        return "open", f"the study opens the network for arm {arm} (network_open_arms)"
    if gateway != "on":
        return "open", "the study sets gateway off: claude reaches the API itself"
    return "gateway", None


# -- the seccomp filter ----------------------------------------------------------------------------
# A classic-BPF program (struct sock_filter: u16 code, u8 jt, u8 jf, u32 k) that bubblewrap loads
# with --seccomp FD: a system call of another architecture than the host's (a 32-bit entry on a
# 64-bit kernel, whose numbers differ) kills the process; each denied call fails with EPERM;
# everything else is allowed.

#: Calls by which a process inspects or drives another one (memory, descriptors, counters).
SECCOMP_DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "perf_event_open")
#: Per machine name: the AUDIT_ARCH value seccomp reports, and the denied calls' numbers.
SECCOMP_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {"ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "pidfd_getfd": 438, "kcmp": 312, "perf_event_open": 298}),
    "aarch64": (0xC00000B7, {"ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "pidfd_getfd": 438, "kcmp": 272, "perf_event_open": 241}),
}
SECCOMP_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
#: x86_64's x32 calls carry this bit in their number: none is allowed to pass the table unmatched.
SECCOMP_X32_BIT = 0x40000000
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_SECCOMP_RET_KILL_PROCESS, _SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000


def seccomp_arch(machine: str) -> str | None:
    """The syscall table's name for a machine name (os.uname().machine), None when unknown (pure)."""
    name = SECCOMP_ARCH_ALIASES.get(machine, machine)
    return name if name in SECCOMP_ARCHES else None


def seccomp_program(arch: str) -> bytes:
    """The filter for `arch` (a key of SECCOMP_ARCHES), packed for bwrap --seccomp (pure)."""
    audit, numbers = SECCOMP_ARCHES[arch]
    nrs = [numbers[name] for name in SECCOMP_DENIED]
    head = [(_BPF_LD_W_ABS, 0, 0, 4), (_BPF_JEQ_K, 1, 0, audit),
            (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS), (_BPF_LD_W_ABS, 0, 0, 0)]
    tests = [(_BPF_JGE_K, SECCOMP_X32_BIT)] if arch == "x86_64" else []
    tests += [(_BPF_JEQ_K, nr) for nr in nrs]
    prog = list(head)
    for i, (code, k) in enumerate(tests):
        # jump over the remaining tests and the ALLOW to the EPERM return
        prog.append((code, len(tests) - i, 0, k))
    prog += [(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW), (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | errno.EPERM)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def seccomp_here() -> dict[str, Any]:
    """This host's filter: {"arch", "denied", "reason"}; arch None (no filter, and why) on a
    machine without a table here."""
    machine = os.uname().machine if hasattr(os, "uname") else sys.platform
    arch = seccomp_arch(machine)
    return {"arch": arch, "machine": machine, "denied": list(SECCOMP_DENIED) if arch else [],
            "reason": None if arch else (f"no system call table for the machine {machine!r} (known: "
                                         + ", ".join(SECCOMP_ARCHES) + "): sandboxes run without the "
                                         "filter, and say so")}


def seccomp_fd() -> int | None:
    """A pipe's read end holding this host's filter (for bwrap --seccomp; the caller passes it to
    the child and closes it), or None on a machine without a table."""
    arch = seccomp_here()["arch"]
    if arch is None:
        return None
    data = seccomp_program(arch)
    rfd, wfd = os.pipe()
    try:
        os.write(wfd, data)   # a few hundred bytes: far below any pipe's buffer
    finally:
        os.close(wfd)
    return rfd


# -- the file view ---------------------------------------------------------------------------------

def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@dataclass(frozen=True)
class SandboxPlan:
    """What one sandboxed process sees (absolute, resolved paths); the root is bubblewrap's own
    empty one, so nothing of the host is there unless listed here.

    links: (path, target) symlinks made again (system directories that are links).
    base: directories bound read-only: the system directories, then the tool directories (the
    binary's, its interpreter's and Python's install directories, PATH entries).
    hide: directories masked by an empty tmpfs where a base directory holds them (the study, the
    tasks, the user's real home); mask: files masked by /dev/null (the secrets of /etc).
    ro: files or directories bound read-only (a pristine check dir, a job's prompt files).
    rw: directories bound read-write (the workspace, the private HOME).
    inner_hide, inner_rw: then hidden (an empty private tmpfs), and bound back inside (the config
    dir replaced by a private one, with this session's own project directory kept).
    sockets: (host path, path inside) bound in (a session's gateway socket).
    network: one of SANDBOX_NETWORKS.  cwd: the working directory inside.
    container: paths a container image would have, given last: ("bind" | "ro-bind", source,
    destination) or ("tmpfs", "", destination) rows (see container_rows); they can be made at any
    top-level path, since the root is bubblewrap's own."""
    links: tuple[tuple[str, str], ...] = ()
    base: tuple[str, ...] = ()
    hide: tuple[str, ...] = ()
    mask: tuple[str, ...] = ()
    ro: tuple[str, ...] = ()
    rw: tuple[str, ...] = ()
    cwd: str = "/"
    inner_hide: tuple[str, ...] = ()
    inner_rw: tuple[str, ...] = ()
    sockets: tuple[tuple[str, str], ...] = ()
    network: str = "none"
    container: tuple[tuple[str, str, str], ...] = ()


def outermost(dirs: Iterable[str]) -> list[str]:
    """The absolute directories of `dirs` that lie in no other one, in order ("/" never) (pure)."""
    out: list[str] = []
    for d in dirs:
        if d.startswith("/") and d != "/" and not any(_under(d, b) for b in out):
            out = [b for b in out if not _under(b, d)] + [d]
    return out


def sandbox_mounts(plan: SandboxPlan) -> list[tuple[str, ...]]:
    """The mount table, in the order bubblewrap applies it (pure).

    Later mounts win over earlier ones for the same path, so: /dev, /proc, the private /tmp, the
    system symlinks, the base directories (one inside another is bound once, by the outer), then
    the hiding tmpfs and /dev/null masks (only where a base directory holds them, outer first,
    none inside another), the base directories that a hide covered bound back, then read-only and
    read-write binds (a workspace inside the hidden study comes back this way), the inner mounts,
    the sockets and a container's paths; last, the root (bubblewrap's own) is made read-only."""
    rows: list[tuple[str, ...]] = [("--dev", "/dev"), ("--proc", "/proc"), ("--tmpfs", "/tmp")]
    rows += [("--symlink", target, path) for path, target in plan.links]
    base = outermost(plan.base)
    rows += [("--ro-bind", d, d) for d in base]
    covered: list[str] = []
    for d in sorted(set(plan.hide), key=lambda p: (p.count("/"), p)):
        if (d in SANDBOX_NEVER_HIDE or not d.startswith("/") or any(_under(d, c) for c in covered)
                or not any(_under(d, b) and d != b for b in base)):
            continue
        rows.append(("--tmpfs", d))
        covered.append(d)
    for f in plan.mask:
        if any(_under(f, b) for b in base) and not any(_under(f, c) for c in covered):
            rows.append(("--ro-bind", "/dev/null", f))
    for d in plan.base:
        if any(_under(d, c) for c in covered) and not any(_under(c, d) for c in covered):
            rows.append(("--ro-bind", d, d))
    rows += [("--ro-bind", d, d) for d in plan.ro]
    rows += [("--bind", d, d) for d in plan.rw]
    rows += [("--tmpfs", d) for d in plan.inner_hide]
    rows += [("--bind", d, d) for d in plan.inner_rw]
    rows += [("--bind", src, dst) for src, dst in plan.sockets]
    rows += [("--tmpfs", dest) if op == "tmpfs" else ("--" + op, source, dest)
             for op, source, dest in plan.container]
    rows.append(("--remount-ro", "/"))
    return rows


def sandbox_argv(bwrap: str, plan: SandboxPlan, argv: Sequence[str], seccomp: int | None = None) -> list[str]:
    """The full bubblewrap command that runs `argv` under `plan` (pure); `seccomp`: the descriptor
    the filter is read from (the child must inherit it)."""
    if plan.network not in SANDBOX_NETWORKS:
        raise ValueError(f"unknown sandbox network {plan.network!r}")
    out = [bwrap]
    for row in sandbox_mounts(plan):
        out += list(row)
    out += list(SANDBOX_NAMESPACE_OPTIONS)
    if plan.network == "none":
        out.append("--unshare-net")
    if seccomp is not None:
        out += ["--seccomp", str(int(seccomp))]
    return out + ["--chdir", plan.cwd, "--"] + list(argv)


def tool_dirs(binary_paths: Sequence[str], python_prefixes: Sequence[str], path_entries: Sequence[str],
              homes: Sequence[str], keep_out: Sequence[str] = ()) -> list[str]:
    """Directories that must be visible for the sandboxed program to run at all (pure).

    Each binary's own directory, and the one above it when that is a `bin` directory (an npm
    package or an interpreter's prefix keeps its files beside its bin/); Python's prefixes; every
    PATH entry, except one inside a home, for which the home's top-level directory holding it is
    given (~/.pyenv for ~/.pyenv/shims: a version manager's shims need the rest of it).  Never a
    home itself, "/", nor a directory that holds one of `keep_out` (the study, the workspace):
    such a PATH entry is left out rather than expose what lies under it."""
    out: list[str] = []
    for b in binary_paths:
        d = posixpath.dirname(b)
        out.append(d)
        if posixpath.basename(d) == "bin":
            out.append(posixpath.dirname(d))
    out += list(python_prefixes)
    for entry in path_entries:
        homed = [h for h in homes if entry != h and _under(entry, h)]
        if homed:
            out.append(homed[0].rstrip("/") + "/" + entry[len(homed[0].rstrip("/")) + 1:].split("/")[0])
        elif entry not in homes:
            out.append(entry)
    clean = []
    for d in out:
        if (d and d.startswith("/") and d not in clean and d not in homes and d != "/"
                and not any(_under(k, d) for k in list(keep_out) + list(homes))):
            clean.append(d)
    return clean


def _real(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(path))


def script_interpreter(path: str, env: Mapping[str, str]) -> str | None:
    """The interpreter a `#!` script names (through `/usr/bin/env NAME`, found on env's PATH),
    resolved; None for a binary or an unreadable file."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if not words:
        return None
    prog = words[0]
    if posixpath.basename(prog) == "env":
        names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
        prog = shutil.which(names[0], path=env.get("PATH")) or "" if names else ""
    return _real(prog) if prog.startswith("/") else None


def host_tool_dirs(binary: str | None, env: Mapping[str, str], homes: Sequence[str],
                   keep_out: Sequence[str] = ()) -> list[str]:
    """tool_dirs() for this process: the binary (as named and resolved) and the interpreter a
    script binary names (node, for an npm install), sys.prefix and sys.base_prefix, and the
    PATH of `env`."""
    bins = []
    if binary:
        found = binary if "/" in binary else (shutil.which(binary, path=env.get("PATH")) or binary)
        bins = [os.path.abspath(found), _real(found)]
        interp = script_interpreter(_real(found), env)
        if interp:
            bins.append(interp)
    prefixes = sorted({_real(sys.prefix), _real(sys.base_prefix), _real(posixpath.dirname(sys.executable))})
    entries = [_real(e) for e in (env.get("PATH") or "").split(os.pathsep) if e.startswith("/")]
    entries = [e for e in entries if os.path.isdir(e)]
    # Only what exists: bubblewrap refuses to bind a missing source.
    return [d for d in tool_dirs(bins, prefixes, entries, homes, keep_out=[_real(k) for k in keep_out])
            if os.path.isdir(d)]


def real_homes(env: Mapping[str, str]) -> list[str]:
    """The user's home directories to hide: the account's and $HOME (resolved, existing)."""
    out = []
    with contextlib.suppress(ImportError, KeyError):
        import pwd
        out.append(pwd.getpwuid(os.getuid()).pw_dir)
    if env.get("HOME"):
        out.append(env["HOME"])
    homes = []
    for h in out:
        r = _real(h)
        if os.path.isdir(r) and r not in homes and r not in SANDBOX_NEVER_HIDE:
            homes.append(r)
    return homes


def study_hidden_dirs(study_root: str | os.PathLike[str],
                      extra: Iterable[str | os.PathLike[str]] = ()) -> list[str]:
    """The study directory, its tasks directory (from study.json, wherever it lies), the bundled
    example study beside this file (its references and hidden tests are those of any study copied
    from it) and `extra`, resolved; only those that exist (a tmpfs needs a mount point)."""
    root = Path(study_root)
    dirs: list[str | os.PathLike[str]] = [root, HERE / "examples"]
    cfg = read_json(root / STUDY_FILE, default=None)
    if isinstance(cfg, dict) and isinstance(cfg.get("tasks"), str):
        t = Path(cfg["tasks"])
        dirs.append(t if t.is_absolute() else root / t)
    dirs += list(extra)
    out = []
    for d in dirs:
        r = _real(d)
        if os.path.isdir(r) and r not in out:
            out.append(r)
    return out


def system_view() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """This host's (links, system directories, secret directories, secret files of /etc): what
    exists of SANDBOX_SYSTEM_DIRS and SANDBOX_ETC_SECRETS (a secret behind a link, by its target)."""
    links, dirs = [], []
    for d in SANDBOX_SYSTEM_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            dirs.append(d)
    hide: list[str] = []
    mask: list[str] = []
    for s in SANDBOX_ETC_SECRETS:
        r = _real(s)
        if os.path.isdir(r):
            if r not in hide:
                hide.append(r)
        elif os.path.lexists(r) and r not in mask:
            mask.append(r)
    return tuple(links), tuple(dirs), tuple(hide), tuple(mask)


def base_plan(binary: str | None, env: Mapping[str, str], hidden: Sequence[str], *,
              keep_out: Sequence[str] = (), network: str = "none") -> SandboxPlan:
    """The host's part of every plan: the system and tool directories, the hides and masks (a
    launch adds its own binds with dataclasses.replace)."""
    homes = real_homes(env)
    links, system, secret_dirs, secret_files = system_view()
    tools = host_tool_dirs(binary, env, homes, keep_out=list(hidden) + list(keep_out))
    return SandboxPlan(links=links, base=system + tuple(tools),
                       hide=tuple(list(hidden) + homes) + secret_dirs, mask=secret_files, network=network)


_SANDBOX_PROBES: dict[str, dict[str, Any]] = {}


def sandbox_probe(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Does bubblewrap really run here, as every launch uses it (own file view, no network, the
    seccomp filter)?  {"available", "binary", "reason"}; run once per process per binary found (a
    PATH without bwrap answers at once, uncached)."""
    # None: this process's own PATH (the probe is of the host this process runs on).
    env = env if env is not None else os.environ
    binary = shutil.which(SANDBOX_BINARY, path=env.get("PATH"))
    if not binary:
        return {"available": False, "binary": None,
                "reason": f"{SANDBOX_BINARY} is not on PATH (Debian/Ubuntu package: bubblewrap)"}
    if binary in _SANDBOX_PROBES:
        return dict(_SANDBOX_PROBES[binary])
    marker = "agentbench-sandbox-probe"
    plan = dataclasses.replace(base_plan(sys.executable, env, []), cwd="/")
    fd = seccomp_fd()
    argv = sandbox_argv(binary, plan, [sys.executable, "-I", "-c", f"print({marker!r})"], seccomp=fd)
    try:
        res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                             timeout=SANDBOX_PROBE_TIMEOUT_S, pass_fds=() if fd is None else (fd,))
        ok = res.returncode == 0 and res.stdout.decode("utf-8", "replace").strip() == marker
        reason = None if ok else (f"{binary} exited {res.returncode}: "
                                  + res.stderr.decode("utf-8", "replace").strip()[-300:])
    except (OSError, subprocess.SubprocessError) as exc:
        ok, reason = False, f"{binary} cannot run: {exc}"
    finally:
        if fd is not None:
            os.close(fd)
    out = {"available": ok, "binary": binary, "reason": reason}
    _SANDBOX_PROBES[binary] = out
    return dict(out)


def sandbox_decision(mode: str, available: bool) -> str:
    """"bwrap", "none" or "refuse" for a mode and the probe's answer (pure)."""
    if mode == "none":
        return "none"
    if mode == "bwrap":
        return "bwrap" if available else "refuse"
    return "bwrap" if available else "none"


def resolve_sandbox(mode: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The sandbox a launch gets here: {"mode", "kind", "binary", "reason"}.  A study that
    requires bubblewrap where it cannot run is refused (exit 2), before anything is written."""
    probe = sandbox_probe(env) if mode != "none" else {"available": False, "binary": None,
                                                        "reason": "the study sets sandbox: none"}
    kind = sandbox_decision(mode, bool(probe["available"]))
    if kind == "refuse":
        raise AgentbenchError("the study requires sandbox bwrap but bubblewrap cannot run here",
                              code="sandbox_unavailable", reason=probe["reason"], refusal="sandbox",
                              hint='install bubblewrap (apt-get install bubblewrap) where sessions and '
                                   'checks run, or set "sandbox": "auto" (unsandboxed where it is '
                                   'missing) in study.json')
    return {"mode": mode, "kind": kind, "binary": probe["binary"] if kind == "bwrap" else None,
            "reason": None if kind == "bwrap" else probe["reason"]}


def sandbox_record(decision: Mapping[str, Any], network: str | None = None,
                   network_reason: str | None = None) -> dict[str, Any]:
    """What a job, check or run records of its sandbox: its kind, its network ("none", "gateway"
    or "open"; an unsandboxed process has the host's, "open") and the seccomp filter's
    architecture (None: no filter, and why)."""
    boxed = decision.get("kind") == "bwrap"
    sc = seccomp_here() if boxed else {"arch": None, "reason": "not sandboxed"}
    return {"mode": decision.get("mode"), "kind": decision.get("kind"), "reason": decision.get("reason"),
            "network": (network or "none") if boxed else "open",
            "network_reason": network_reason if boxed else "not sandboxed",
            "seccomp": sc["arch"], "seccomp_reason": sc["reason"]}


def sandbox_summary(records: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """A run's sandbox from its sessions' and checks' records (pure): sandboxed only when every
    one of them ran under bubblewrap (a record missing counts as not sandboxed); the networks they
    had, and why any sandboxed one had the host's."""
    recs = [r or {} for r in records]
    kinds = sorted({str(r.get("kind") or "unknown") for r in recs})
    reasons = sorted({str(r["reason"]) for r in recs if r.get("kind") != "bwrap" and r.get("reason")})
    networks = sorted({str(r.get("network") or "unknown") for r in recs})
    opened = sorted({str(r["network_reason"]) for r in recs
                     if r.get("kind") == "bwrap" and r.get("network") == "open" and r.get("network_reason")})
    unfiltered = sorted({str(r.get("seccomp_reason") or "no filter recorded") for r in recs
                         if r.get("kind") == "bwrap" and not r.get("seccomp")})
    return {"sandboxed": bool(recs) and kinds == ["bwrap"], "kinds": kinds, "reasons": reasons,
            "networks": networks, "network_opened": opened, "unfiltered": unfiltered}


def session_sandbox(bwrap: str, argv: Sequence[str], env: Mapping[str, str], *, cwd: str,
                    hidden: Sequence[str], private_home: str, project_dir: str,
                    ro: Sequence[str] = (), network: str = "gateway", gateway_socket: str | None = None,
                    seccomp: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The sandboxed argv and environment of one `claude` session.

    The file view is the host's system and tool directories (base_plan) and: HOME becomes
    `private_home` (read-write); the config dir (CLAUDE_CONFIG_DIR, else ~/.claude, where
    agentbench collects transcripts from) is an empty private tmpfs, gone with the session, with
    only `project_dir`, this session's own transcripts, bound into it read-write; the workspace
    read-write; `ro` (the job's system prompt and MCP files) read-only; TMPDIR is the private
    /tmp.  Network "gateway": an own network namespace into which `gateway_socket` (the gateway's
    Unix socket on the host) is bound, relayed on loopback by the shim; "open": the host's."""
    if network not in SESSION_NETWORKS:
        raise ValueError(f"unknown session network {network!r}")
    if network == "gateway" and not gateway_socket:
        raise ValueError("a session whose network is its gateway needs the gateway's socket")
    config = env.get("CLAUDE_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".claude")
    for d in (config, private_home, project_dir):
        os.makedirs(d, exist_ok=True)
    new_env = dict(env)
    new_env.update({"HOME": _real(private_home), "CLAUDE_CONFIG_DIR": _real(config), "TMPDIR": "/tmp"})
    base = base_plan(argv[0], env, hidden, keep_out=[cwd], network="none" if network == "gateway" else "open")
    if network == "open" and os.path.isdir("/run/systemd/resolve"):   # resolv.conf may point there
        base = dataclasses.replace(base, base=base.base + ("/run/systemd/resolve",))
    plan = dataclasses.replace(base, ro=tuple(_real(p) for p in ro if os.path.exists(p)),
                               rw=(_real(cwd), _real(private_home)), cwd=_real(cwd),
                               inner_hide=(_real(config),), inner_rw=(_real(project_dir),),
                               sockets=(((gateway_socket, SANDBOX_GATEWAY_SOCKET),)
                                        if network == "gateway" and gateway_socket else ()))
    shim = [sys.executable, "-I", "-S", "-c", SANDBOX_EXEC_SHIM,
            SANDBOX_GATEWAY_SOCKET if network == "gateway" else "-"]
    return sandbox_argv(bwrap, plan, [*shim, *argv], seccomp=seccomp), new_env


#: Where a container spec may not put anything: the host's own system directories (a task's
#: paths are made in a private root beside them, never over them).
CONTAINER_RESERVED = ("/", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc",
                      "/dev", "/sys", "/tmp", "/run", "/var", "/boot", "/root", "/home", "/opt", "/srv",
                      "/mnt", "/media", "/snap", "/nix")
CONTAINER_KEYS = ("workdir", "ro", "scratch")


def container_spec_problem(spec: Any) -> str | None:
    """Why a check's or reference's `container` spec cannot be used, or None (pure).  The spec:
    {"workdir": "/app", "ro": {"/tests": "tests"}, "scratch": ["/logs/verifier"]}: the workdir
    (where the workspace is bound read-write and the command starts), read-only binds from paths
    relative to the check's own directory, and empty writable directories."""
    if not isinstance(spec, dict) or set(spec) - set(CONTAINER_KEYS) or "workdir" not in spec:
        return f"container must be an object with workdir and optionally ro and scratch ({spec!r:.100})"
    ro = spec.get("ro", {})
    scratch = spec.get("scratch", [])
    if not isinstance(ro, dict) or not isinstance(scratch, list):
        return "container.ro must map container paths to relative paths; container.scratch must be a list"
    dests = [spec["workdir"], *ro, *scratch]
    for d in dests:
        if not isinstance(d, str) or not d.startswith("/") or posixpath.normpath(d) != d or len(d) > 200:
            return f"container path {d!r:.100} is not an absolute, normal path"
        if any(d == r or _under(d, r) for r in CONTAINER_RESERVED if r != "/") or d == "/":
            return f"container path {d} lies in a host system directory"
        if not re.fullmatch(r"[A-Za-z0-9_./-]+", d):
            return f"container path {d!r:.100} holds characters other than letters, digits and ._-/"
    if len(set(dests)) != len(dests):
        return "container paths repeat"
    for src in ro.values():
        if not isinstance(src, str) or src.startswith("/") or ".." in src.split("/") or len(src) > 200:
            return f"container.ro source {src!r:.100} is not a relative path inside the bundle"
    return None


def container_rows(spec: Mapping[str, Any], *, workspace: str, base: str) -> list[tuple[str, str, str]]:
    """The mounts of a container spec (pure): the workspace read-write at the workdir, each ro
    source (under `base`) read-only at its path, each scratch path an empty private tmpfs."""
    rows = [("bind", workspace, str(spec["workdir"]))]
    rows += [("ro-bind", posixpath.join(base, src), dest)
             for dest, src in sorted((spec.get("ro") or {}).items())]
    rows += [("tmpfs", "", d) for d in spec.get("scratch") or []]
    return rows


def check_sandbox(bwrap: str, argv: Sequence[str], env: Mapping[str, str], *, cwd: str,
                  hidden: Sequence[str], ro: Sequence[str], seccomp: int | None = None,
                  container: Mapping[str, Any] | None = None, container_base: str = "") -> list[str]:
    """The sandboxed argv of one check command: the host's system and tool directories
    (base_plan), its cwd (the workspace, or the oracle's copy) read-write, its pristine check
    directories read-only, no network at all.  The environment is the caller's (credential-free)
    one, unchanged.  With a `container` spec (see container_rows) the cwd is also bound at the
    spec's workdir, where the command starts, and the spec's paths are made (read-only ones from
    under `container_base`)."""
    base = base_plan(argv[0] if argv else None, env, hidden, keep_out=[cwd])
    rows: tuple[tuple[str, str, str], ...] = ()
    inner = _real(cwd)
    if container:
        rows = tuple(container_rows(container, workspace=_real(cwd), base=_real(container_base)))
        inner = str(container["workdir"])
    plan = dataclasses.replace(base, ro=tuple(_real(p) for p in ro if os.path.exists(p)), rw=(_real(cwd),),
                               cwd=inner, container=rows)
    return sandbox_argv(bwrap, plan, argv, seccomp=seccomp)


def sandbox_view(binary: str | None, env: Mapping[str, str]) -> dict[str, Any]:
    """What a sandbox sees on this host, for `where`: the system directories and links, the tool
    directories, what of /etc is masked, what each launch adds, the networks and the filter."""
    plan = base_plan(binary, env, [])
    bound = outermost(plan.base)
    return {"root": "bubblewrap's own empty root: nothing of the host unless listed here",
            "system_read_only": [d for d in bound if d in SANDBOX_SYSTEM_DIRS],
            "system_links": {p: t for p, t in plan.links},
            "tools_read_only": [d for d in bound if d not in SANDBOX_SYSTEM_DIRS],
            "etc_masked": sorted(list(d for d in plan.hide if _under(d, "/etc")) + list(plan.mask)),
            "session_adds": ["its workspace (read-write)", "a private HOME (read-write)",
                             "an empty private config dir with its own transcript directory (read-write)",
                             "its system prompt and MCP files (read-only)", "a private /tmp, /dev and /proc",
                             f"its gateway's socket at {SANDBOX_GATEWAY_SOCKET}"],
            "check_adds": ["its working directory: the workspace or the oracle's copy (read-write)",
                           "the pristine gate (and oracle) directories (read-only)",
                           "a task's container paths, when its check names them",
                           "a private /tmp, /dev and /proc"],
            "network": {"session": "an own network namespace; only its gateway, relayed on loopback "
                                   "(network_open_arms or gateway off: the host's network)",
                        "check": "none (an own network namespace with only loopback)"},
            "seccomp": seccomp_here()}


# -- the receipt channel of check commands ---------------------------------------------------------
# A check command that names {receipt_fd} gets the write end of a pipe as that inherited file
# descriptor; agentbench reads the other end.  The trust model for task authors: the harness reads
# nothing of the code under test into its own process, runs that code in child processes with the
# descriptor closed (subprocess's default close_fds), and writes exactly one JSON receipt line to
# the descriptor from the parent.  Code that still reaches the descriptor (through /proc, as the
# same user) can only add a line -- then there are two and the check fails -- or kill the harness,
# which then exits non-zero, and a passing receipt needs exit status 0.  The old receipt (the last
# stdout line) still works but is recorded as unprotected: the code under test can print it.

RECEIPT_FD_PLACEHOLDER = "receipt_fd"
#: More than this on the receipt channel is not a receipt (the pipe is read once, after the check).
RECEIPT_MAX_BYTES = 60000


def receipt_channel_line(data: bytes) -> tuple[str | None, str | None]:
    """The one receipt line written on the channel, or (None, the problem) (pure)."""
    if len(data) > RECEIPT_MAX_BYTES:
        return None, f"more than {RECEIPT_MAX_BYTES} bytes on the receipt channel"
    lines = [ln for ln in data.decode("utf-8", "replace").splitlines() if ln.strip()]
    if not lines:
        return None, "no receipt on the receipt channel"
    if len(lines) > 1:
        return None, (f"{len(lines)} receipts on the receipt channel "
                      "(one is expected: another writer reached it)")
    return lines[0], None


def receipt_channel_verdict(rec: Mapping[str, Any], problem: str | None, returncode: int | None, *,
                            timed_out: bool = False) -> dict[str, Any]:
    """A receipt read from the channel, judged (pure): a problem with the channel, a line that is
    no JSON receipt, or a pass with a non-zero exit status is a fail with score 0.  Such a fail is
    the check's verdict, not a grader error: the code under test cannot write the channel, so a
    harness that says nothing there, or dies, was made to by that code.  A timeout stays a grader
    error, and so does a receipt on the channel that is incoherent (the grader's own fault)."""
    out = dict(rec)
    out["receipt_channel"] = "fd"
    out["receipt_protected"] = True
    if problem is None and rec.get("receipt") == "refused":
        return out
    if problem is None and rec.get("receipt") != "json":
        problem = "the receipt channel's line is not a JSON receipt with a passed field"
    if problem is None and rec.get("passed") and returncode != 0:
        problem = f"the receipt says passed but the check exited {returncode}"
    if problem is not None:
        out.update({"passed": False, "score": 0.0, "receipt_problem": problem,
                    "grader_error": rec.get("grader_error") if timed_out else None})
    return out


def read_receipt_pipe(rfd: int) -> bytes:
    """What is in the channel now (the check has exited; a writer it left behind is not waited for)."""
    os.set_blocking(rfd, False)
    chunks: list[bytes] = []
    total = 0
    while total <= RECEIPT_MAX_BYTES:
        try:
            chunk = os.read(rfd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


# ==================================================================================================
# Stream and usage
# ==================================================================================================
# Parsing `claude --output-format stream-json` lines and turning them into what the ledger records.
# Facts respected (claude 2.1.x): one API message can arrive as several `assistant` events sharing
# message.id (count it once; per-event output tokens are an early snapshot); a process may print
# more than one `result` (the last one counts); total_cost_usd is cumulative over a resumed or
# forked session (take deltas against the session's previous total); the exit code does not say
# whether a session succeeded (classify by is_error / subtype / api_error_status); unknown event
# types are skipped.  Pure logic: StreamState is fed lines and holds no file handles.  Owns the
# usage rule and list-price estimates.  Must not write files or trust a number it has not checked.

TOKEN_KEYS = ("input", "output", "cache_creation", "cache_creation_1h", "cache_creation_5m", "cache_read")


def tokens_from_usage(u: Mapping[str, Any] | None, anomalies: list[dict[str, Any]] | None = None,
                      where: str = "usage") -> dict[str, int]:
    """API-style usage (input_tokens, ...) to the ledger's token dict, 1h/5m split included.

    Every count goes through count_from(): a hostile value (1e400, NaN, -5, true) counts 0 and is
    described in `anomalies`."""
    if type(u) is not dict:   # (a plain dict is a Mapping: the ABC check only for the rest)
        if u is not None and not isinstance(u, Mapping):
            note_anomaly(anomalies, where, u, "not an object")
        u = u if isinstance(u, Mapping) else {}
    cc = u.get("cache_creation")
    if type(cc) is not dict:
        cc = cc if isinstance(cc, Mapping) else {}

    def num(x: Any, key: str) -> int:
        if x is None or (type(x) is int and 0 <= x <= MAX_TOKEN_COUNT):   # the common cases, at once
            return x or 0
        return count_from(x, anomalies=anomalies, where=f"{where}.{key}")
    total_cc = num(u.get("cache_creation_input_tokens"), "cache_creation_input_tokens")
    h1 = num(cc.get("ephemeral_1h_input_tokens"), "cache_creation.ephemeral_1h_input_tokens")
    m5 = num(cc.get("ephemeral_5m_input_tokens"), "cache_creation.ephemeral_5m_input_tokens")
    if total_cc and not (h1 or m5):
        m5 = total_cc
    return {"input": num(u.get("input_tokens"), "input_tokens"),
            "output": num(u.get("output_tokens"), "output_tokens"),
            "cache_creation": total_cc, "cache_creation_1h": h1, "cache_creation_5m": m5,
            "cache_read": num(u.get("cache_read_input_tokens"), "cache_read_input_tokens")}


def price_for(model: str | None, overrides: Mapping[str, Sequence[float]] | None = None
              ) -> tuple[float, float, float, float, float]:
    """List price row for a model id (longest matching family prefix), else the default row.

    `overrides` (study.json `prices`: model prefix -> [input, output, cache write 5m, cache write
    1h, cache read] per million tokens) win over the built-in table.
    """
    if model:
        for table in ({k: tuple(v) for k, v in (overrides or {}).items()}, PRICES_PER_MTOK):
            best = ""
            for fam in table:
                if model.startswith(fam) and len(fam) > len(best):
                    best = fam
            if best:
                return table[best]  # type: ignore[return-value]
    return DEFAULT_PRICE


def estimate_cost_usd(tokens: Mapping[str, int], model: str | None,
                      prices: Mapping[str, Sequence[float]] | None = None) -> float:
    """Cost of `tokens` at list prices (used only when a session never reported its own cost)."""
    p_in, p_out, p_5m, p_1h, p_read = price_for(model, prices)
    cc_5m = tokens.get("cache_creation_5m", 0)
    cc_1h = tokens.get("cache_creation_1h", 0)
    if not (cc_5m or cc_1h):
        cc_5m = tokens.get("cache_creation", 0)
    return round((tokens.get("input", 0) * p_in + tokens.get("output", 0) * p_out + cc_5m * p_5m
                  + cc_1h * p_1h + tokens.get("cache_read", 0) * p_read) / 1e6, 6)


def add_tokens(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {k: int(a.get(k, 0)) + int(b.get(k, 0)) for k in TOKEN_KEYS}


class StreamState:
    """Incremental parse of one `claude -p --output-format stream-json` process's stdout.

    feed() takes one raw line; it never raises (an event it cannot digest counts as a bad line).
    What it keeps: the init event, per-message usage (deduplicated by message id, each field the
    maximum seen, since later events of one message carry later snapshots), tool-use count, models
    reported, every result event (the last wins), counters of unparseable lines and unknown event
    types, and the hostile numbers it refused (`anomalies`).  Token counts come from the usage
    numbers only, never from text length: a huge text block is not a huge cost.
    """

    KNOWN_TYPES = frozenset({"system", "assistant", "user", "result", "stream_event", "rate_limit_event"})

    def __init__(self) -> None:
        self.init: dict[str, Any] | None = None
        self.messages: dict[str, dict[str, Any]] = {}
        self.message_order: list[str] = []
        self.tool_uses = 0
        self.tool_results = 0
        self.prices: Mapping[str, Sequence[float]] | None = None
        self.tool_calls: list[dict[str, Any]] = []
        self.models: list[str] = []
        self.results: list[dict[str, Any]] = []
        self.bad_lines = 0
        self.unknown_types = 0
        self.lines = 0
        self.session_id: str | None = None
        self.session_ids: list[str] = []     # every distinct session id the stream named (bounded)
        self.first_assistant_usage: dict[str, int] | None = None
        self.last_text = ""
        # The running cost estimate (see estimated_cost): micro-USD per message and their sum, at
        # the (fallback model, prices) they were priced with.
        self._cost_key: tuple[Any, ...] | None = None
        self._cost_micro: dict[str, int | None] = {}
        self._cost_total_micro: int | None = 0
        self.anomalies: list[dict[str, Any]] = []

    def feed(self, raw: str | bytes) -> dict[str, Any] | None:
        try:
            return self._feed(raw)
        except Exception as exc:  # the contract: feeding never raises, whatever the line holds
            self.bad_lines += 1
            note_anomaly(self.anomalies, "stream", type(exc).__name__, "event could not be digested")
            return None

    def _feed(self, raw: str | bytes) -> dict[str, Any] | None:
        raw = raw.strip()
        if not raw:
            return None
        self.lines += 1
        try:
            ev = json.loads(raw)
        except UnicodeDecodeError:
            # Not UTF-8: read with replacement characters, as a line of text would be.
            try:
                ev = json.loads(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
            except ValueError:
                self.bad_lines += 1
                return None
        except ValueError:
            self.bad_lines += 1
            return None
        if not isinstance(ev, dict):
            self.bad_lines += 1
            return None
        kind = ev.get("type")
        if kind not in self.KNOWN_TYPES:
            self.unknown_types += 1
            return ev
        if ev.get("session_id"):
            sid = str(ev["session_id"])[:200]
            self.session_id = self.session_id or sid
            if sid not in self.session_ids and len(self.session_ids) < 20:
                self.session_ids.append(sid)
        if kind == "system" and ev.get("subtype") == "init":
            self.init = ev
        elif kind == "assistant":
            self._assistant(ev)
        elif kind == "result":
            self.results.append(ev)
        elif kind == "user":
            message = ev.get("message")
            content = (message or {}).get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                self.tool_results += sum(1 for b in content
                                         if isinstance(b, dict) and b.get("type") == "tool_result")
        return ev

    def _assistant(self, ev: Mapping[str, Any]) -> None:
        msg = ev.get("message") or {}
        if not isinstance(msg, dict):
            return
        mid = str(msg.get("id") or f"anon-{len(self.message_order)}")
        usage = tokens_from_usage(msg.get("usage"), self.anomalies, "assistant.usage")
        if mid not in self.messages:
            self.message_order.append(mid)
            self.messages[mid] = {"model": msg.get("model"), "tokens": usage}
            if self.first_assistant_usage is None and ev.get("parent_tool_use_id") is None:
                self.first_assistant_usage = usage
        else:
            old = self.messages[mid]["tokens"]
            self.messages[mid]["tokens"] = {k: max(old.get(k, 0), usage.get(k, 0)) for k in TOKEN_KEYS}
        model = msg.get("model")
        if model and model != "<synthetic>" and model not in self.models:
            self.models.append(str(model))
        # Per-event output counts are an early snapshot (the final count only reaches the result
        # event).  No floor is guessed from the content's length: a 10 MB text line would be
        # estimated at tens of dollars and stop a session that reported cents.
        content = msg.get("content")
        for block in content if isinstance(content, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self.tool_uses += 1
                if len(self.tool_calls) < 2000:
                    self.tool_calls.append({"name": block.get("name"), "input": block.get("input")})
            elif isinstance(block, dict) and block.get("type") == "text":
                self.last_text = str(block.get("text") or "")[-2000:]
        self._reprice(mid)

    @property
    def result(self) -> dict[str, Any] | None:
        return self.results[-1] if self.results else None

    def message_tokens(self) -> dict[str, int]:
        total = {k: 0 for k in TOKEN_KEYS}
        for mid in self.message_order:
            total = add_tokens(total, self.messages[mid]["tokens"])
        return total

    def _message_cost_micro(self, mid: str, fallback_model: str | None) -> int | None:
        """One message's list-price cost in whole micro-USD (estimate_cost_usd rounds to 1e-6);
        None when it is not finite (token counts beyond any float)."""
        m = self.messages[mid]
        cost = estimate_cost_usd(m["tokens"], m.get("model") or fallback_model, self.prices)
        return round(cost * 1e6) if math.isfinite(cost * 1e6) else None

    def _reprice(self, mid: str) -> None:
        """Keep the running total current after message `mid` was added or revised."""
        if self._cost_key is None:
            return
        old = self._cost_micro.get(mid, 0)
        new = self._message_cost_micro(mid, self._cost_key[0])
        self._cost_micro[mid] = new
        self._cost_total_micro = (None if old is None or new is None or self._cost_total_micro is None
                                  else self._cost_total_micro + new - old)

    def estimated_cost(self, fallback_model: str | None) -> float:
        """List-price cost of the messages seen (study `prices` overrides included).

        The sum of each message's cost rounded to 1e-6, kept as a running total: the first call
        (and a call with another fallback model or other prices) prices every message; from then
        on a message is re-priced only when it arrives or its tokens are revised, so a supervisor
        polling this stays linear in the session's length.  Whole micro-USD are summed, so the
        total does not drift whatever the order of revisions."""
        key = (fallback_model, json.dumps(self.prices, sort_keys=True, default=str))
        if self._cost_key != key or self._cost_total_micro is None:
            self._cost_key = key
            self._cost_micro = {mid: self._message_cost_micro(mid, fallback_model)
                                for mid in self.message_order}
            parts = list(self._cost_micro.values())
            self._cost_total_micro = None if None in parts else sum(parts)  # type: ignore[arg-type]
        if self._cost_total_micro is None:   # a non-finite part: the float sum, as it always was
            return round(sum(estimate_cost_usd(self.messages[mid]["tokens"],
                                               self.messages[mid].get("model") or fallback_model, self.prices)
                             for mid in self.message_order), 6)
        return self._cost_total_micro / 1e6


def model_matches(requested: str, reported: str) -> bool:
    """Same model: equal ids, or one is the other plus a date suffix (claude-x-4-5-20250929)."""
    if requested == reported:
        return True
    return bool(re.fullmatch(re.escape(requested) + r"-\d{8}", reported)
                or re.fullmatch(re.escape(reported) + r"-\d{8}", requested))


def classify_session(result: Mapping[str, Any] | None, exit_code: int | None) -> tuple[str, str | None]:
    """(status, reason) of a finished `claude` process from its last result event and exit code.

    The exit code alone is never trusted: an API error can end with exit 0 and is_error true.
    """
    if result is None:
        return "failed", ("no_result" if exit_code in (0, None) else "exit_code")
    subtype = str(result.get("subtype") or "")
    is_error = bool(result.get("is_error"))
    status_code = result.get("api_error_status")
    text = str(result.get("result") or "") + " " + " ".join(str(e) for e in result.get("errors") or [])
    low = text.lower()
    terminal = str(result.get("terminal_reason") or "")
    if "budget" in subtype or terminal == "budget_exhausted":
        return "failed", "budget"
    if subtype == "error_max_turns" or terminal == "max_turns":
        return "failed", "max_turns"
    if terminal == "prompt_too_long":
        return "failed", "prompt_too_long"
    if not is_error and subtype == "success":
        return "ok", None
    code = None
    with contextlib.suppress(TypeError, ValueError):
        code = int(status_code) if status_code is not None else None
    if code is None:
        m = re.search(r"\b(4\d\d|5\d\d)\b", text)
        if m and ("api error" in low or "status" in low or "error" in low):
            code = int(m.group(1))
    if code == 429 or "rate limit" in low or "usage limit" in low or "rate_limit" in low:
        return "failed", "usage_limit"
    if code == 529 or "overloaded" in low:
        return "failed", "overloaded"
    if "prompt is too long" in low or "prompt_too_long" in low:
        return "failed", "prompt_too_long"
    if code in (401, 403) or "authentication" in low or "invalid api key" in low or "oauth" in low:
        return "failed", "auth"
    if code is not None or terminal == "api_error":
        # A timeout or a cut/malformed stream ends with terminal_reason api_error and no HTTP
        # status: an infrastructure failure, not something the agent did.
        return "failed", "api_error"
    if is_error:
        return "failed", "is_error"
    return "failed", "exit_code" if exit_code not in (0, None) else "is_error"


#: Session failures that exclude a run as not the agent's doing.  Each is claimed by a line of
#: claude's stdout, which any process of the session can write (/proc/1/fd/1): a claim counts only
#: when the session's gateway saw the condition on the wire (claim_corroboration).
CLAIMED_CONDITIONS = ("usage_limit", "overloaded", "api_error", "prompt_too_long", "auth", "model_refused")
#: The upstream HTTP statuses that show each condition (usage_limit and auth pause the whole study:
#: the circuit breaker), and the type of an `error` event inside a streamed answer that shows it.
WIRE_STATUSES_OF = {"usage_limit": (429,), "auth": (401, 403), "overloaded": (529,),
                    "prompt_too_long": (400, 413)}
WIRE_ERROR_TYPES_OF = {"usage_limit": ("rate_limit_error",), "overloaded": ("overloaded_error",),
                       "api_error": ("api_error", "overloaded_error")}


def _wire_shows(reason: str, rec: Mapping[str, Any], requested_model: str) -> bool:
    """Whether one gateway record shows `reason` (pure).  The gateway's own refusals (a wrong
    token, a path it does not forward, a budget) were answers to requests from inside the session
    and show nothing about the upstream."""
    if rec.get("refused") and rec.get("refused") != "lock":
        return False
    status = rec.get("status")
    status = status if isinstance(status, int) and not isinstance(status, bool) else None
    if reason == "model_refused":
        # An answer from another model to a request for the study's model.  A request that asked
        # for another model itself (a side model, or one the agent chose) is no substitution.
        model, asked = rec.get("model"), rec.get("model_requested")
        return (rec.get("kind") == "messages" and status == 200 and isinstance(model, str)
                and (not isinstance(asked, str) or model_matches(requested_model, asked))
                and not model_matches(requested_model, model))
    if str(rec.get("stream_error") or "") in WIRE_ERROR_TYPES_OF.get(reason, ()):
        return True
    if reason == "api_error":
        return (status is not None and status >= 500) or bool(rec.get("error"))
    return status in WIRE_STATUSES_OF.get(reason, ())


def claim_corroboration(reason: str | None, records: Sequence[Mapping[str, Any]] | None,
                        requested_model: str) -> str:
    """What the gateway's records say of a session's failure `reason` (pure):
    `not_a_claim` (no infrastructure condition claimed), `corroborated` (a record shows it),
    `uncorroborated` (the session made requests through its gateway and none shows it: a line
    written into claude's stdout by a process of the session), `no_gateway` (records is None:
    nothing can check the claim) or `no_requests` (a gateway that carried no request: the binary
    never reached it, and no tool of the session ran, since every tool call follows an answer)."""
    if reason not in CLAIMED_CONDITIONS:
        return "not_a_claim"
    if records is None:
        return "no_gateway"
    if not records:
        return "no_requests"
    if any(_wire_shows(str(reason), r, requested_model) for r in records if isinstance(r, Mapping)):
        return "corroborated"
    return "uncorroborated"


def claim_counts(corroboration: str) -> bool:
    """Whether a claimed condition may move a run out of the agent's outcome (pure).  Only what the
    gateway saw, or a gateway that saw no request at all, counts; without a gateway the claim
    cannot be checked and the conservative reading holds: the run is the agent's failure."""
    return corroboration in ("not_a_claim", "corroborated", "no_requests")


def model_usage_delta(now: Mapping[str, Any] | None,
                      before: Mapping[str, Any] | None) -> dict[str, dict[str, float]]:
    """Per-model growth of the cumulative modelUsage between two reports of one session."""
    out: dict[str, dict[str, float]] = {}
    before = before or {}
    for model, row in (now or {}).items():
        if not isinstance(row, dict):
            continue
        prev = before.get(model) or {}
        d = {}
        for key, val in row.items():
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                d[key] = float(val) - float(prev.get(key, 0) or 0)
        if any(v > 0 for k, v in d.items() if k in ("inputTokens", "outputTokens", "cacheReadInputTokens",
                                                     "cacheCreationInputTokens", "costUSD")):
            out[model] = d
    return out


def _model_usage_clean(mu: Any, anomalies: list[dict[str, Any]] | None, where: str) -> dict[str, Any]:
    """A modelUsage-shaped object with every numeric field finite and in range (others dropped,
    each drop an anomaly); not an object gives {}."""
    if not isinstance(mu, Mapping):
        if mu is not None:
            note_anomaly(anomalies, where, mu, "not an object")
        return {}
    out: dict[str, Any] = {}
    for model, row in mu.items():
        if not isinstance(row, Mapping):
            note_anomaly(anomalies, f"{where}.{model}", row, "not an object")
            continue
        clean: dict[str, Any] = {}
        for key, val in row.items():
            if isinstance(val, bool):
                clean[key] = val   # a flag, not an amount
            elif isinstance(val, (int, float)):
                hi = MAX_USD_VALUE if key == "costUSD" else MAX_TOKEN_COUNT
                f = finite_number(val, lo=0, hi=hi, anomalies=anomalies, where=f"{where}.{model}.{key}")
                if f is not None:
                    clean[key] = val
            elif isinstance(val, (str, list, dict)) or val is None:
                clean[key] = json_safe(val, anomalies=anomalies, where=f"{where}.{model}.{key}")
        out[str(model)] = clean
    return out


def usage_record(result: Mapping[str, Any] | None, state: StreamState, *, prior_cost: float,
                 prior_model_usage: Mapping[str, Any] | None, requested_model: str) -> dict[str, Any]:
    """The usage rule: what one call cost, from its result event (or an estimate without one).

    tokens: the result's `usage` (this call's figures); models_used: modelUsage keys that grew in
    this call; cost_delta_usd: total_cost_usd minus the session's total before this call; flags:
    `usage_mismatch` when usage and the modelUsage delta disagree, `total_decreased` when a
    cumulative total went down (then the reported total is taken as this call's own cost).
    Without a result the cost is estimated from per-message usage at list prices (`estimated`).
    """
    flags: list[str] = []
    anomalies: list[dict[str, Any]] = []
    prior_model_usage = _model_usage_clean(prior_model_usage, anomalies, "prior.model_usage")
    if result is None:
        tokens = state.message_tokens()
        return {"tokens": tokens, "models_used": list(state.models), "cost_total_usd": None,
                "cost_delta_usd": state.estimated_cost(requested_model), "estimated": True,
                "model_usage": dict(prior_model_usage or {}), "flags": flags, "anomalies": anomalies}
    tokens = tokens_from_usage(result.get("usage"), anomalies, "result.usage")
    mu = _model_usage_clean(result.get("modelUsage"), anomalies, "result.modelUsage")
    delta = model_usage_delta(mu, prior_model_usage)
    since = _model_usage_clean(result.get("model_usage_since_last_result"), anomalies,
                               "result.model_usage_since_last_result")
    if since:
        # Newer binaries report this call's own per-model usage; it wins over our own delta.
        delta = model_usage_delta(since, None)
    models_used = sorted(delta) if delta else sorted(set(state.models))
    total = result.get("total_cost_usd")
    total_f = usd_from(total, anomalies=anomalies, where="result.total_cost_usd")
    if total_f is None:
        # No believable total (absent, NaN, Infinity, negative, absurd): the list-price estimate
        # from the (checked) token counts stands in, flagged, so no hostile figure reaches a cap.
        cost = state.estimated_cost(requested_model)
        estimated = True
        flags.append("no_total_cost" if total is None else "bad_total_cost")
    elif total_f + 1e-9 < prior_cost:
        flags.append("total_decreased")
        cost, estimated = total_f, False
    else:
        cost, estimated = total_f - prior_cost, False
    # "since last result": with several result events in one process, each covers its stretch.
    since_costs = [c for r in (state.results or [result]) if isinstance(r, Mapping)
                   for d in _model_usage_clean(r.get("model_usage_since_last_result"), None, "").values()
                   for c in [usd_from(d.get("costUSD"))] if c is not None]
    if since_costs and total_f is not None:
        # The binary's own figure for this call: it needs no prior, so a stale or missing prior
        # (a session record not yet written, a crash) cannot double-count the session's past.
        own = math.fsum(since_costs)
        if abs(own - cost) > 1e-6:
            flags.append("prior_mismatch")
            cost = own
    if delta:
        mu_in = sum(d.get("inputTokens", 0) for d in delta.values())
        mu_out = sum(d.get("outputTokens", 0) for d in delta.values())
        # A usage block that covers a different span than the modelUsage delta (e.g. cumulative
        # vs per-call, or side-model calls not in `usage`) is flagged, not silently reconciled.
        if (abs(mu_in - tokens["input"]) > max(2, 0.01 * mu_in)
                or abs(mu_out - tokens["output"]) > max(2, 0.01 * mu_out)):
            flags.append("usage_mismatch")
    return {"tokens": tokens, "models_used": models_used, "cost_total_usd": total_f,
            "cost_delta_usd": round(max(cost, 0.0), 6), "estimated": estimated,
            "model_usage": mu, "flags": flags, "anomalies": anomalies}


def cache_verdict(first_usage: Mapping[str, int] | None, base_context_tokens: int | None) -> str | None:
    """Cache verdict of a spawn/continue/ping from its first assistant message's cache read.

    Against the base's context size: >= 90% read from cache = hit, > 0 = partial, else miss.
    A session with no base context (a fresh start) is `cold`.
    """
    if first_usage is None:
        return None
    if not base_context_tokens:
        return "cold"
    read = int(first_usage.get("cache_read", 0))
    if read >= 0.9 * base_context_tokens:
        return "hit"
    if read > 0:
        return "partial"
    return "miss"


def context_tokens(usage: Mapping[str, int] | None) -> int:
    """Size of the context a message was computed on: input + cache creation + cache read."""
    if not usage:
        return 0
    return int(usage.get("input", 0)) + int(usage.get("cache_creation", 0)) + int(usage.get("cache_read", 0))


INIT_FINGERPRINT_KEYS = ("tools", "permissionMode", "plugins", "agents", "skills", "apiKeySource",
                         "mcp_servers", "model", "output_style")


def init_fingerprint(init: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The runtime fields of a system/init event that must not drift across a study."""
    if not init:
        return None
    fp = {}
    for key in INIT_FINGERPRINT_KEYS:
        val = init.get(key)
        if isinstance(val, list):
            val = sorted((json.dumps(v, sort_keys=True) if not isinstance(v, str) else v) for v in val)
        fp[key] = val
    fp["sha256"] = sha256_bytes(json.dumps(fp, sort_keys=True).encode())
    return fp


# ==================================================================================================
# Study configuration
# ==================================================================================================
# study.json, in one place: where a study is found, the table of its settings (type, default, help,
# init's flag), the shape check generated from that table, the effective launch configuration, and
# `init`'s merge as a pure function.  It reads study.json and writes nothing (init writes, in the
# CLI); it knows nothing of jobs, runs or the registry.  Defaults live in the constants section.

def resolve_study_dir(explicit: str | None, env: Mapping[str, str], cwd: str, platform: "Platform",
                      must_exist: bool = True) -> Path:
    """--study, else $AGENTBENCH_STUDY, else the cwd when it holds study.json."""
    raw = explicit or env.get("AGENTBENCH_STUDY")
    if raw:
        path = Path(platform.normalize_path(raw))
    elif os.path.isfile(os.path.join(cwd, STUDY_FILE)):
        path = Path(cwd)
    else:
        raise AgentbenchError("no study given", code="no_study_given",
                              hint="pass --study DIR, set AGENTBENCH_STUDY, or run "
                              "in a directory holding study.json (create one with `init --study DIR`)")
    if must_exist and not (path / STUDY_FILE).is_file():
        raise AgentbenchError("not a study directory (no study.json)", code="not_a_study", study=str(path),
                              hint=f"create it with: agentbench.py init --study {path}")
    return path


def finite_float(text: str) -> float:
    """argparse type: a finite number (nan and inf are refused: they poison limits and JSON)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def is_number(value: Any) -> bool:
    """A finite number, not a bool (an integer too large for a float is not one)."""
    return finite_number(value) is not None


def _check_slurm_settings(slurm: Any) -> None:
    """The `slurm` object of study.json (SPEC 12): known keys, the right types, and no sbatch
    option agentbench sets itself."""
    if slurm is not None:
        if not isinstance(slurm, dict) or set(slurm) - set(SLURM_KEYS):
            raise AgentbenchError("slurm must be an object with keys among " + ", ".join(SLURM_KEYS),
                                  code="slurm_object_keys_among", slurm=str(slurm)[:300])
        partition = slurm.get("partition")
        if partition is not None and (not isinstance(partition, str) or not partition):
            raise AgentbenchError("slurm.partition must be a non-empty string",
                                  code="slurm_partition_non_empty_string", partition=str(slurm["partition"]))
        args = slurm.get("sbatch_args")
        options_ok = isinstance(args, list) and all(isinstance(a, str) and a.startswith("-")
                                                    for a in args)
        if args is not None and not options_ok:
            raise AgentbenchError("slurm.sbatch_args must be a list of sbatch options "
                                  "(each starting with -), values joined with =",
                                  code="slurm_sbatch_args_list_sbatch",
                                  sbatch_args=str(args)[:300],
                                  hint='e.g. ["--account=lab", "--mem=4G", "--time=120"]')
        own = sbatch_own_options(args or [])
        if own:
            raise AgentbenchError("slurm.sbatch_args may not set options agentbench sets itself",
                                  code="slurm_sbatch_args_may_not", options=own,
                                  hint="agentbench chooses the output file, the environment export, the "
                                       "directory and the cluster of its batch jobs")
        if slurm.get("python") is not None and (not isinstance(slurm["python"], str) or not slurm["python"]):
            raise AgentbenchError("slurm.python must be the path of python3 on the compute nodes",
                                  code="slurm_python_path_python3_compute", python=str(slurm["python"]))
        margin = slurm.get("time_margin_s")
        if margin is not None and finite_number(margin, lo=0.0) is None:
            raise AgentbenchError("slurm.time_margin_s must be a non-negative number",
                                  code="slurm_time_margin_s_non", time_margin_s=str(margin))


EFFORTS = ("low", "medium", "high", "xhigh", "max")
PERMISSION_MODES = ("default", "acceptEdits", "plan", "dontAsk", "bypassPermissions")


#: Keys of one arm's object in study.json.
ARM_KEYS = ("preamble", "gate_cycles", "review", "fork_base")


@dataclass(frozen=True)
class Setting:
    """One top-level key of study.json.  `ok` says whether a given value has the right shape (None:
    `check` does it all); `want` completes "KEY must be ..."; `check` runs after `ok` for what needs
    more than a type (and raises its own error); `flag` is init's argparse type (None: no flag);
    `on_create`: init writes the default into a new study.json."""
    key: str
    ok: Callable[[Any], bool] | None
    want: str = ""
    check: Callable[[Any], None] | None = None
    flag: Callable[[str], Any] | None = None
    help: str = ""
    on_create: bool = False

    @property
    def default(self) -> Any:
        return DEFAULT_LAUNCH.get(self.key)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_int_at_least(low: int | None) -> Callable[[Any], bool]:
    return lambda v: not isinstance(v, bool) and isinstance(v, int) and (low is None or v >= low)


def _check_executor(v: Any) -> None:
    if not isinstance(v, str) or v not in EXECUTORS:
        raise AgentbenchError("executor must be local or slurm", code="unknown_executor", executor=v)


def _check_gateway(v: Any) -> None:
    if v not in GATEWAY_MODES:
        raise AgentbenchError('gateway must be "on" or "off"', code="bad_gateway_mode", file=STUDY_FILE,
                              key="gateway", value=str(v)[:200], default=GATEWAY_DEFAULT,
                              hint='"off" lets claude hold the credentials and reach the model directly')


def _check_sandbox(v: Any) -> None:
    if v not in SANDBOX_MODES:
        raise AgentbenchError("sandbox must be one of " + ", ".join(SANDBOX_MODES), code="bad_sandbox_mode",
                              file=STUDY_FILE, key="sandbox", value=str(v)[:200],
                              hint='"auto": bubblewrap where it runs; "bwrap": required; "none": never')


def did_you_mean(unknown: Sequence[str], known: Sequence[str]) -> dict[str, str]:
    """For each unknown key, the known one it is most likely a misspelling of (pure)."""
    out = {}
    for key in unknown:
        close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
        if close:
            out[str(key)] = close[0]
    return out


def _misspelt_hint(unknown: Sequence[str], known: Sequence[str], what: str) -> str:
    guesses = did_you_mean(unknown, known)
    if guesses:
        return "did you mean " + ", ".join(f"`{v}` for `{k}`" for k, v in guesses.items()) + "?"
    return f"a misspelt {what} would be ignored; fix or remove it"


def _check_network_open_arms(v: Any) -> None:
    if not (isinstance(v, list) and all(isinstance(a, str) and a for a in v)) or len(v) > 1000:
        raise AgentbenchError("network_open_arms must be a list of arm names", code="bad_network_open_arms",
                              file=STUDY_FILE, key="network_open_arms", value=str(v)[:200],
                              hint='e.g. "network_open_arms": ["with-mcp"]; leave it out to keep every '
                                   "session's network to its gateway")


def _check_budget(budget: Mapping[str, Any]) -> None:
    unknown = sorted(set(budget) - set(DEFAULT_BUDGET))
    if unknown:
        raise AgentbenchError("study.json: budget has unknown keys", code="study_json_budget_unknown_keys",
                              keys=unknown, known=sorted(DEFAULT_BUDGET),
                              did_you_mean=did_you_mean(unknown, sorted(DEFAULT_BUDGET)),
                              hint=_misspelt_hint(unknown, sorted(DEFAULT_BUDGET), "budget key"))
    for key, val in budget.items():
        if not is_number(val) or val < 0:
            raise AgentbenchError("budget values must be finite non-negative numbers",
                                  code="budget_values_finite_non_negative", key=key, value=str(val))
    if budget.get("usd_per_run") == 0:
        raise AgentbenchError("budget.usd_per_run must be greater than 0", code="zero_usd_per_run",
                              hint="no session could ever start")
    per_run = budget.get("usd_per_run", DEFAULT_BUDGET["usd_per_run"])
    if budget.get("unbounded_request_usd", 0) > per_run:
        raise AgentbenchError("budget.unbounded_request_usd is larger than a run's budget",
                              code="unbounded_request_usd_above_run_budget",
                              unbounded_request_usd=budget["unbounded_request_usd"], usd_per_run=per_run,
                              hint="no such request could ever fit; state a worst case below usd_per_run, "
                                   "or 0 to refuse them")


def _check_prices(prices: Any) -> None:
    ok = isinstance(prices, dict) and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 5 and all(is_number(x) and x >= 0 for x in v)
        for k, v in prices.items())
    if not ok:
        raise AgentbenchError("prices must map a model prefix to [input, output, cache write 5m, "
                              "cache write 1h, cache read] USD per million tokens",
                              code="prices_map_model_prefix_input", prices=str(prices)[:300])


def _check_arms(arms: Mapping[str, Any]) -> None:
    for name, spec in arms.items():
        if not isinstance(spec, dict):
            raise AgentbenchError("an arm must be an object", code="arm_object", arm=name)
        extra = sorted(set(spec) - set(ARM_KEYS))
        if extra:
            raise AgentbenchError("an arm has unknown keys", code="arm_unknown_keys",
                                  arm=name, keys=extra, known=list(ARM_KEYS),
                                  did_you_mean=did_you_mean(extra, ARM_KEYS),
                                  hint=_misspelt_hint(extra, ARM_KEYS, "arm setting"))
        if spec.get("preamble") is not None and not isinstance(spec["preamble"], str):
            raise AgentbenchError("an arm's preamble must be a file path", code="arm_preamble_not_path",
                                  arm=name)
        gc = spec.get("gate_cycles", 0)
        if isinstance(gc, bool) or not isinstance(gc, int) or not 0 <= gc <= 50:
            raise AgentbenchError("gate_cycles must be an integer 0..50", code="gate_cycles_integer_0_50",
                                  arm=name, gate_cycles=str(gc))
        for key in ("review", "fork_base"):
            if key in spec and not isinstance(spec[key], bool):
                raise AgentbenchError(f"an arm's {key} must be true or false", code="arm_setting_not_bool",
                                      arm=name, value=str(spec[key]),
                                      hint=f'write "{key}": true (not a string)')


#: The copy caps' settings (copy_file_mb, copy_total_mb, workspace_mb): megabytes, at most this many.
MEGABYTES_MAX = 10_000_000
MEGABYTES_WANT = f"a positive number of megabytes (at most {MEGABYTES_MAX})"


def _is_megabytes(v: Any) -> bool:
    return is_number(v) and 0 < v <= MEGABYTES_MAX


#: Every top-level key of study.json, in the order the shape check reports them.  init's flags are
#: the settings with a `flag`; budget's keys are BUDGET_SETTINGS below.
STUDY_SETTINGS: tuple[Setting, ...] = (
    Setting("tasks", _is_str, "a string", flag=str, help="the tasks directory (relative to the study)"),
    Setting("model", _is_str, "a string", flag=str, help="full model id (no alias)", on_create=True),
    Setting("effort", _is_str, "a string", flag=str, help="claude --effort: " + "/".join(EFFORTS),
            on_create=True),
    Setting("permission_mode", _is_str, "a string", flag=str,
            help="claude --permission-mode: " + "/".join(PERMISSION_MODES)
            + " (as root, dontAsk with allow rules)",
            on_create=True),
    Setting("tools", _is_str, "a string", flag=str, help="the tools sessions have (claude --tools)",
            on_create=True),
    Setting("allowed_tools", _is_str, "a string", flag=str, help="tools allowed without asking"),
    Setting("disallowed_tools", _is_str, "a string", flag=str, help="tools refused"),
    Setting("binary", _is_str, "a string", flag=str, help="the claude executable (default: found on PATH)"),
    Setting("executor", _is_str, "a string", check=_check_executor, flag=str, help="local or slurm"),
    Setting("templates", _is_str, "a string"),
    Setting("preamble", _is_str, "a string"),
    Setting("gateway", None, check=_check_gateway, flag=str,
            help='on (default): sessions reach the API only through a metering gateway; off: claude holds '
                 'the credentials'),
    Setting("sandbox", None, check=_check_sandbox, flag=str,
            help="auto (bubblewrap where it runs), bwrap (required) or none"),
    Setting("network_open_arms", None, check=_check_network_open_arms,
            help="arms whose sandboxed sessions share the host's network (MCP servers, package "
                 "installs); every other session reaches only its own gateway"),
    Setting("repeats", _is_int_at_least(1), "an integer >= 1", flag=int, help="runs per task and arm"),
    Setting("seed", _is_int_at_least(None), "an integer", flag=int,
            help="seed of the assignment and the report's bootstrap"),
    Setting("parallel", _is_int_at_least(1), "an integer >= 1", flag=int, help="sessions at once, study-wide",
            on_create=True),
    Setting("max_minutes", lambda v: is_number(v) and v > 0, "a positive number", flag=finite_float,
            help="wall-time limit of any one session", on_create=True),
    Setting("stall_after_s", lambda v: is_number(v) and v >= 0, "a non-negative number", flag=finite_float,
            help="flag a session silent this long"),
    Setting("orphan_after_s", lambda v: is_number(v) and v >= 0, "a non-negative number", flag=finite_float,
            help="kill a job nobody asks about this long "
                 "(0: never; runs by `run` are watched by their driver)"),
    Setting("budget", lambda v: isinstance(v, dict), "an object", check=_check_budget),
    Setting("arms", lambda v: isinstance(v, dict), "an object", check=_check_arms),
    Setting("prices", None, check=_check_prices),
    Setting("slurm", None, check=_check_slurm_settings),
    Setting("env", lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                         for k, x in v.items()),
            "an object of string values"),
    Setting("snapshot_seconds", lambda v: isinstance(v, list) and all(is_number(t) and t > 0 for t in v),
            "a list of positive numbers of seconds"),
    Setting("copy_file_mb", _is_megabytes, MEGABYTES_WANT, flag=finite_float,
            help="the largest file agentbench copies or reads out of a session's workspace (MB)"),
    Setting("copy_total_mb", _is_megabytes, MEGABYTES_WANT, flag=finite_float,
            help="the most one copy of a workspace may hold (MB)"),
    Setting("workspace_mb", _is_megabytes, MEGABYTES_WANT, flag=finite_float,
            help="a session whose workspace holds more (MB, real blocks) is ended"),
)
#: The keys study.json may hold (SPEC 5 and the launch, budget and executor settings).
STUDY_KEYS = frozenset(s.key for s in STUDY_SETTINGS)
#: budget's keys: (init's flag type, help); their defaults are DEFAULT_BUDGET's.
BUDGET_SETTINGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "usd_per_run": (finite_float, "cost budget of one run (all its sessions)"),
    "wall_s": (finite_float, "wall-time budget of one run (all its sessions)"),
    "max_turns": (int, "claude --max-turns of a session"),
    "study_usd": (finite_float, "the study's cost cap: no launch once spent"),
    "min_remaining_usd": (finite_float, "no new session for a run with less budget left"),
    "unbounded_request_usd": (finite_float, "worst case (USD) the gateway reserves for a request whose cost "
                                            "its body does not bound (server-side tools, URL or Files API "
                                            "content, PDFs); 0: such requests are refused"),
}


def check_study_shape(cfg: Mapping[str, Any]) -> None:
    """Refuse a study.json whose keys or value types are wrong, naming the key (pure).

    A misspelt key would otherwise be ignored and a wrong type read loosely ("review": "no" is
    true to Python), silently changing the experiment; types the code relies on fail here with
    a clear message instead of deep inside a command.  Values that need more than a type (a
    model id, an effort) are checked by validate_launch_values where sessions are launched."""
    unknown = sorted(k for k in set(cfg) - STUDY_KEYS if not str(k).startswith("_"))
    if unknown:
        guesses = did_you_mean(unknown, sorted(STUDY_KEYS))
        raise AgentbenchError("study.json has unknown keys", code="study_json_unknown_keys",
                              keys=unknown, known=sorted(STUDY_KEYS),
                              did_you_mean=guesses,
                              hint=(_misspelt_hint(unknown, sorted(STUDY_KEYS), "key")
                                    + " (keys starting with _ are free, e.g. for a comment)"))
    for setting in STUDY_SETTINGS:
        val = cfg.get(setting.key)
        if val is None:
            continue
        if setting.ok is not None and not setting.ok(val):
            raise AgentbenchError(f"{setting.key} must be {setting.want}", code="bad_setting_type",
                                  file=STUDY_FILE, key=setting.key,
                                  value=str(val)[:200])
        if setting.check is not None:
            setting.check(val)


def load_study_config(paths: StudyPaths) -> dict[str, Any]:
    """study.json, its shape checked (see check_study_shape)."""
    cfg = read_json(paths.study_file)
    if not isinstance(cfg, dict):
        raise AgentbenchError("study.json must hold a JSON object", code="study_json_hold_json_object",
                              path=str(paths.study_file))
    check_study_shape(cfg)
    return cfg


def check_model_id(model: str) -> str:
    """Full model ids only: an alias would silently follow whatever the alias points to today."""
    if not model or model.lower() in MODEL_ALIASES or not MODEL_ID_RE.match(model):
        raise AgentbenchError("model must be a full model id, not an alias", code="model_alias", model=model,
                              hint="e.g. claude-opus-4-5 or claude-sonnet-4-5-20250929")
    return model


def validate_launch_values(cfg: Mapping[str, Any]) -> None:
    """Refuse launch values claude would reject or that would make a study meaningless: the
    model, effort and permission mode.  Every other key's shape and range is check_study_shape's,
    done where the study is read (load_study_config) and by `init` before it writes."""
    if cfg.get("model") is not None:
        check_model_id(str(cfg["model"]))
    if cfg.get("effort") is not None and cfg["effort"] not in EFFORTS:
        raise AgentbenchError("unknown effort", code="unknown_effort",
                              effort=cfg["effort"], allowed=list(EFFORTS))
    if cfg.get("permission_mode") is not None and cfg["permission_mode"] not in PERMISSION_MODES:
        raise AgentbenchError("unknown permission mode", code="unknown_permission_mode",
                              permission_mode=cfg["permission_mode"],
                              allowed=list(PERMISSION_MODES))


def launch_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The effective launch configuration: DEFAULT_LAUNCH overlaid with the study's values."""
    out = dict(DEFAULT_LAUNCH)
    for key in DEFAULT_LAUNCH:
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    if cfg.get("tools") and not cfg.get("allowed_tools"):
        out["allowed_tools"] = cfg["tools"]
    out["budget"] = {**DEFAULT_BUDGET, **(cfg.get("budget") or {})}
    out["prices"] = dict(cfg.get("prices") or {})
    out["gateway"] = cfg.get("gateway") or GATEWAY_DEFAULT
    return out


def copy_caps(launch: Mapping[str, Any]) -> CopyCaps:
    """The caps of every copy or read of a session's tree, from the effective launch configuration."""
    return CopyCaps(file_bytes=int(float(launch["copy_file_mb"]) * 2 ** 20),
                    total_bytes=int(float(launch["copy_total_mb"]) * 2 ** 20))


def _merge_env(env: Mapping[str, str], items: Sequence[str]) -> dict[str, str]:
    out = dict(env)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise AgentbenchError("bad --env", code="bad_env",
                                  value=item, hint="KEY=VALUE with a valid variable name")
        if value:
            out[key] = value
        else:
            out.pop(key, None)
    return out


def merge_study_config(existing: Mapping[str, Any] | None, settings: Mapping[str, Any],
                       budget: Mapping[str, Any], *, slurm_partition: str | None = None,
                       env_items: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """init's merge (pure): `existing` study.json (None: a new study) with the values given (None:
    not given, kept as they are).  A new study gets the defaults of the settings marked
    `on_create` and the whole default budget.  Returns the new config, in the user's key order
    (the first arm stays the baseline), and the keys that changed.  The result is not checked
    here: the caller checks it, so that init can also repair a wrong value."""
    for key in ("budget", "slurm", "env"):
        # What the merge reads into; everything else is checked on the result.
        if existing is not None and existing.get(key) is not None and not isinstance(existing[key], dict):
            raise AgentbenchError(f"{key} must be an object", code="not_an_object",
                                  file=STUDY_FILE, key=key, value=str(existing[key])[:200])
    cfg = dict(existing or {})
    changed: list[str] = []
    for setting in STUDY_SETTINGS:
        val = settings.get(setting.key)
        if setting.flag is not None and val is not None and cfg.get(setting.key) != val:
            cfg[setting.key] = val
            changed.append(setting.key)
    new_budget = dict(cfg.get("budget") or {})
    for key in BUDGET_SETTINGS:
        val = budget.get(key)
        if val is not None and new_budget.get(key) != val:
            new_budget[key] = val
            changed.append(f"budget.{key}")
    if existing is None:
        for setting in STUDY_SETTINGS:
            if setting.on_create:
                cfg.setdefault(setting.key, setting.default)
        for key, val in DEFAULT_BUDGET.items():
            new_budget.setdefault(key, val)
    cfg["budget"] = new_budget
    if slurm_partition is not None:
        slurm = dict(cfg.get("slurm") or {})
        if slurm.get("partition") != slurm_partition:
            slurm["partition"] = slurm_partition
            cfg["slurm"] = slurm
            changed.append("slurm.partition")
    if env_items:
        env = _merge_env(cfg.get("env") or {}, env_items)
        if env != (cfg.get("env") or {}):
            cfg["env"] = env
            changed.append("env")
    return cfg, changed


#: What a refusal at the study's parallel cap advises by default (a launch that registers a job).
PARALLEL_CAP_HINT = "wait for a job to finish (`wait --any`) or raise `parallel` with init"


def refuse_at_parallel_cap(active: int, cap: int | None, hint: str = PARALLEL_CAP_HINT) -> None:
    """The one parallel-cap decision (pure): refused when `active` jobs already fill the study's
    `parallel` cap (None: no cap).  The refusal carries `refusal: parallel_cap` so that a driver
    waits for a slot instead of failing its run."""
    if cap is not None and active >= cap:
        raise AgentbenchError("parallel cap reached", code="parallel_cap", active=active, cap=cap,
                              refusal="parallel_cap", hint=hint)


# ==================================================================================================
# The metering gateway
# ==================================================================================================
# One loopback HTTP server per session, run in threads of that session's supervisor: `claude`
# reaches the API only through it and holds nothing but a random per-job token.  The gateway checks
# the token (anything else gets 401), swaps it for the real credential, forwards to the upstream
# (the user's ANTHROPIC_BASE_URL, else the public API over verified TLS), streams answers back byte
# for byte, meters every Messages answer from its own events at the study's prices, and reserves
# each request's worst case (a bound on what it can be billed) against the run's and the study's
# remaining money, in one step under a study-wide lock, before forwarding it.  A request whose cost
# its body does not bound is refused; when the metered spend reaches a cap, live answers are cut.
# It owns: the allow-list environment of `claude`, the job's gateway.jsonl, and the study's live
# reservations under state/gateway/.  It must not: write results, the ledger or the registry (the
# supervisor does), log a header or a body, or let a credential reach `claude`'s environment.

GATEWAY_UPSTREAM_DEFAULT = "https://api.anthropic.com"
#: How long the gateway waits on the upstream for a connection or the next bytes of an answer.
GATEWAY_UPSTREAM_TIMEOUT_S = 600.0
#: Largest request body the gateway accepts (a bigger one is refused with 413).
GATEWAY_MAX_BODY_BYTES = 64 << 20
#: Bytes read from the upstream per forwarded chunk.
GATEWAY_CHUNK_BYTES = 64 << 10
#: A non-streamed answer is kept for metering up to this size (it is forwarded whole regardless).
GATEWAY_MAX_METER_BYTES = 16 << 20
#: The worst-case input of a request: its body's bytes / this many.  A token stands for at least
#: one byte of the text it encodes, and the body holds every byte of that text (JSON only adds),
#: so one token per byte bounds what a hostile body can be billed (honest text runs ~4 bytes).
GATEWAY_BYTES_PER_TOKEN = 1.0
#: Tokens the API adds to any request beyond its body (the tool-use system prompt, turn framing).
GATEWAY_OVERHEAD_TOKENS = 2048
#: Tokens of one inline image, whatever its bytes: the API scales an image down to a bounded size
#: (a tiny, highly compressed file can stand for a large picture).
GATEWAY_IMAGE_TOKENS = 8192
#: Tokens an Anthropic-defined client tool (bash, text editor, computer, memory) adds beyond its
#: few bytes of definition (its schema and instructions are the API's).
GATEWAY_CLIENT_TOOL_TOKENS = 2048
GATEWAY_CLIENT_TOOL_PREFIXES = ("bash_", "text_editor_", "computer_", "memory_")
#: Where a content block's data may come from for its cost to be bounded by the body: inline.
GATEWAY_INLINE_SOURCES = frozenset({"base64", "text", "content"})
#: max_tokens assumed for a Messages request that names none (the API requires one anyway).
GATEWAY_DEFAULT_MAX_TOKENS = 32000
#: After this many requests in a row found the upstream unreachable, the gateway answers the next
#: ones with an error the binary does not retry, so the session ends at once instead of after
#: minutes of retries against an upstream that is not there.
GATEWAY_UNREACHABLE_FINAL = 2
#: How often, at most, a streaming answer's usage re-reads the study's spend (the ledger and the other
#: live sessions) to see whether the study's cap is reached mid-answer.
GATEWAY_STUDY_RECHECK_S = 0.5
#: How long stop() waits for requests still in flight to settle their metering.
GATEWAY_STOP_WAIT_S = 10.0
#: Metered and self-reported cost differ "beyond rounding" above max(absolute, relative * larger).
COST_MISMATCH_ABS_USD = 0.0001
COST_MISMATCH_REL = 0.005
#: A keep-warm ping answers one word: its max_tokens is capped so that its worst case (what the
#: gateway reserves) fits the ping's small budget.
PING_MAX_OUTPUT_TOKENS = 1024
#: The variable through which `claude` receives its job token (it sends it as x-api-key).
GATEWAY_TOKEN_VAR = "ANTHROPIC_API_KEY"
#: Credentials the gateway can carry to the upstream (the first one set is used).
GATEWAY_CARRIED = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN")
#: Never in `claude`'s environment while the gateway is on.
GATEWAY_WITHHELD = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN",
                    "ANTHROPIC_CUSTOM_HEADERS", "ANTHROPIC_BASE_URL")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
                         "x-api-key", "authorization", "accept-encoding"})

# -- the environment of `claude`: an allow-list ----------------------------------------------------

#: Host variables `claude` gets: identity, locale, terminal, temp dirs, its config dir and a few
#: documented client settings.  Everything else is withheld (the study's own `env` is added).
CLAUDE_ENV_ALLOW = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TMPDIR", "TMP", "TEMP", "LANG", "LANGUAGE", "TZ",
    "TERM", "COLORTERM", "NO_COLOR", "CLAUDE_CONFIG_DIR", "CLAUDE_CODE_MAX_RETRIES", "API_TIMEOUT_MS",
    "IS_SANDBOX", "SYSTEMROOT", "COMSPEC", "PATHEXT", "USERPROFILE", "APPDATA", "LOCALAPPDATA", "WINDIR",
})
CLAUDE_ENV_ALLOW_PREFIXES = ("LC_",)
#: With `"gateway": "off"` these are passed too: the credentials and cloud-provider settings the
#: binary then needs itself (model and session overrides stay dropped, see ENV_DROP_EXACT).
CLAUDE_ENV_DIRECT_PREFIXES = ("ANTHROPIC_", "CLAUDE_CODE_", "AWS_", "GOOGLE_", "CLOUD_ML_", "VERTEX_REGION_")
CLAUDE_ENV_DIRECT_EXACT = frozenset({"HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy",
                                     "no_proxy", "NODE_EXTRA_CA_CERTS"})


def claude_env(host: Mapping[str, str], *, extra: Mapping[str, str] | None, gateway: Mapping[str, str] | None,
               secret: Mapping[str, str] | None = None,
               binary: str | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """`claude`'s environment (allow-list) and a report of the names passed and withheld (pure).

    gateway: the variables pointing `claude` at its gateway (URL and job token), or None when the
    study runs with `"gateway": "off"`; then `secret` (the credentials handed to the supervisor)
    and the cloud-provider settings are passed as well.  With the gateway on, the study's own
    `extra` env may not bring a credential or another base URL: those go to the gateway.
    """
    direct = gateway is None
    merged = {**dict(host), **(dict(secret or {}) if direct else {})}
    venv_entries = venv_path_entries(host)
    env: dict[str, str] = {}
    for key, value in merged.items():
        if key in ENV_DROP_EXACT or key.startswith(ENV_DROP_PREFIXES):
            continue
        if key in CLAUDE_ENV_ALLOW or key.startswith(CLAUDE_ENV_ALLOW_PREFIXES):
            env[key] = value
        elif direct and (key in CLAUDE_ENV_DIRECT_EXACT or key.startswith(CLAUDE_ENV_DIRECT_PREFIXES)
                         or is_credential_var(key)):
            env[key] = value
    if venv_entries and "PATH" in env:
        env["PATH"] = os.pathsep.join(e for e in env["PATH"].split(os.pathsep) if e not in venv_entries)
    for key, value in (extra or {}).items():
        if not direct and (key in GATEWAY_WITHHELD or is_credential_var(key)):
            continue
        env[key] = value
    if gateway:
        env.update(gateway)
    env.update(ENV_PINNED)
    if binary:
        env["AGENTBENCH_CLAUDE_BIN"] = binary
    withheld = sorted(k for k in set(host) | set(secret or {}) if k not in env
                      or (gateway is not None and k in gateway))
    report = {"gateway": "off" if direct else "on", "passed": sorted(env),
              "withheld": withheld,
              "credentials_withheld": sorted(k for k in withheld
                                             if is_credential_var(k) or k in GATEWAY_WITHHELD),
              "allow": sorted(CLAUDE_ENV_ALLOW), "allow_prefixes": list(CLAUDE_ENV_ALLOW_PREFIXES)}
    return env, report


def _truthy(value: str | None) -> bool:
    return str(value or "").strip().lower() not in ("", "0", "false", "no", "off")


def gateway_refusal(env: Mapping[str, str], mode: str) -> AgentbenchError | None:
    """Why the gateway cannot carry this host's way of reaching the model, or None (pure).

    Bedrock and Vertex sign requests for their own endpoints, and a claude.ai login token needs the
    binary's own login flow: neither can be swapped in by the gateway, so such a study must say
    `"gateway": "off"` (and then gets no metering or enforcement on the wire)."""
    if mode == "off":
        return None
    hint = ('set "gateway": "off" in study.json to let claude reach the model directly (no metering '
            'or enforcement on the wire; claude then holds the credentials), or use an API key')
    for var in ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX"):
        if _truthy(env.get(var)):
            return AgentbenchError(f"the metering gateway cannot carry {var} (cloud-provider routes)",
                                   code="gateway_cannot_carry_cloud_route", refusal="gateway", variable=var,
                                   hint=hint)
    if env.get("CLAUDE_CODE_OAUTH_TOKEN") and not any(env.get(v) for v in GATEWAY_CARRIED):
        return AgentbenchError("the metering gateway cannot carry a claude.ai login "
                               "(CLAUDE_CODE_OAUTH_TOKEN)", code="gateway_cannot_carry_login",
                               refusal="gateway", variable="CLAUDE_CODE_OAUTH_TOKEN", hint=hint)
    if not any(env.get(v) for v in GATEWAY_CARRIED):
        # Without one every session would fail on authentication, after its retries.
        return AgentbenchError("no credential for the model API: the gateway has nothing to forward",
                               code="no_credential", refusal="gateway", credentials=[],
                               hint="export ANTHROPIC_API_KEY=... (or ANTHROPIC_AUTH_TOKEN) in the shell "
                                    "that runs agentbench; `rehearse` and `demo` need none")
    return None


def gateway_upstream(url: str | None) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of the upstream base URL (pure); refuses a bad one."""
    raw = (url or "").strip() or GATEWAY_UPSTREAM_DEFAULT
    parts = urllib.parse.urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AgentbenchError("ANTHROPIC_BASE_URL must be an http or https URL", code="bad_base_url",
                              value=raw[:200])
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise AgentbenchError("ANTHROPIC_BASE_URL has a bad port", code="bad_base_url_port",
                              value=raw[:200]) from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def gateway_auth_headers(creds: Mapping[str, str]) -> list[tuple[str, str]]:
    """The headers that carry the real credential upstream (pure): x-api-key for an API key,
    else a bearer token, plus any ANTHROPIC_CUSTOM_HEADERS lines ("Name: value")."""
    out: list[tuple[str, str]] = []
    if creds.get("ANTHROPIC_API_KEY"):
        out.append(("x-api-key", creds["ANTHROPIC_API_KEY"]))
    elif creds.get("ANTHROPIC_AUTH_TOKEN"):
        out.append(("authorization", "Bearer " + creds["ANTHROPIC_AUTH_TOKEN"]))
    for line in str(creds.get("ANTHROPIC_CUSTOM_HEADERS") or "").splitlines():
        name, sep, value = line.partition(":")
        if sep and re.fullmatch(r"[A-Za-z0-9-]+", name.strip()) and "\r" not in value:
            out.append((name.strip(), value.strip()))
    return out




#: How long the preflight request to the upstream (`where --check-api`, the start of `run`) may
#: take in all, name resolution included.
UPSTREAM_CHECK_TIMEOUT_S = 8.0


def upstream_check_verdict(status: int | None, body: bytes, error: str | None) -> dict[str, Any]:
    """What the answer to the preflight count_tokens request says (pure): ok, or the problem
    (`upstream_unreachable`, `credential_rejected`, `upstream_refused`) and the reason in words."""
    if status is None:
        return {"ok": False, "problem": "upstream_unreachable",
                "reason": f"the upstream could not be reached: {error}"[:400]}
    message = ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        err = json.loads(body[:65536].decode("utf-8", "replace")).get("error")
        message = str(err.get("message") if isinstance(err, dict) else err or "")[:300]
    if 200 <= status < 300:
        return {"ok": True, "status": status}
    if status in (401, 403):
        return {"ok": False, "status": status, "problem": "credential_rejected",
                "reason": f"the upstream rejected the credential (HTTP {status}): {message}".rstrip(": ")}
    return {"ok": False, "status": status, "problem": "upstream_refused",
            "reason": f"the upstream refused a count_tokens request (HTTP {status}): {message}".rstrip(": ")}


def check_upstream(env: Mapping[str, str], model: str,
                   timeout_s: float = UPSTREAM_CHECK_TIMEOUT_S) -> dict[str, Any]:
    """One free request (POST /v1/messages/count_tokens) to the upstream the gateway would use,
    with the credential it would carry: whether the upstream answers and accepts the key.  Takes
    at most `timeout_s` (an unanswered request is a verdict too)."""
    url = (env.get("ANTHROPIC_BASE_URL") or "").strip() or GATEWAY_UPSTREAM_DEFAULT
    scheme, host, port, prefix = gateway_upstream(url)
    headers = dict(gateway_auth_headers({k: env[k] for k in GATEWAY_WITHHELD if env.get(k)}))
    headers.update({"content-type": "application/json", "anthropic-version": "2023-06-01"})
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}]}).encode()
    got: dict[str, Any] = {}

    def ask() -> None:
        conn = (http.client.HTTPSConnection(host, port, timeout=timeout_s,
                                            context=ssl.create_default_context())
                if scheme == "https" else http.client.HTTPConnection(host, port, timeout=timeout_s))
        try:
            conn.request("POST", prefix + "/v1/messages/count_tokens", body=body, headers=headers)
            resp = conn.getresponse()
            got.update(status=resp.status, body=resp.read(65536))
        except (OSError, http.client.HTTPException, ValueError) as exc:
            got["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive() or not got:
        got = {"error": f"no answer within {timeout_s:g} s"}
    return {"url": url, **upstream_check_verdict(got.get("status"), got.get("body") or b"", got.get("error"))}


def gateway_route(method: str, raw_path: str) -> tuple[str, str, bool]:
    """(kind, path to forward, allowed) of a request line (pure).  The path is decoded, its
    repeated slashes and dot segments collapsed, and re-encoded, so that what is metered is what
    the upstream serves: kind is "messages" (POST /v1/messages), "count_tokens" (POST) or
    "other".  Only the first two are allowed: any other path would spend or read with the real
    credential (files, batches, results) outside the metering."""
    path, sep, query = raw_path.partition("?")
    clean = posixpath.normpath("/" + urllib.parse.unquote(path).lstrip("/"))
    clean = re.sub(r"/+", "/", clean).rstrip("/") or "/"
    if clean == "/v1/messages" and method == "POST":
        kind = "messages"
    elif clean == "/v1/messages/count_tokens" and method == "POST":
        kind = "count_tokens"
    else:
        kind = "other"
    allowed = kind != "other"
    forward = urllib.parse.quote(clean, safe="/:@!$&'()*+,;=-._~") + (sep + query if sep else "")
    return kind, forward, allowed


def presented_token(headers: Mapping[str, str] | Any) -> str:
    """The token a request presents: x-api-key, else an `Authorization: Bearer` value."""
    key = headers.get("x-api-key")
    if key:
        return str(key).strip()
    auth = str(headers.get("authorization") or "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""


def token_matches(presented: str, expected: str) -> bool:
    """Constant-time comparison; an empty token never matches."""
    return bool(presented) and bool(expected) and hmac.compare_digest(presented.encode(), expected.encode())


# -- metering (pure) -------------------------------------------------------------------------------

def _clean_usage(u: Any) -> tuple[dict[str, Any], bool]:
    """An upstream usage object with only non-negative integer counts kept; True if any was bad."""
    if not isinstance(u, dict):
        return {}, u is not None
    bad = False
    out: dict[str, Any] = {}
    for key, val in u.items():
        if key == "cache_creation" and isinstance(val, dict):
            inner = {k: v for k, v in val.items()
                     if isinstance(v, int) and not isinstance(v, bool) and v >= 0}
            bad = bad or len(inner) != len(val)
            out[key] = inner
        elif isinstance(val, int) and not isinstance(val, bool) and val >= 0:
            out[key] = val
        elif val is not None and key.endswith("_tokens"):
            bad = True
    return out, bad


class SseMeter:
    """Incremental reader of one streamed Messages answer: the usage of message_start, updated by
    every message_delta (whose counts are cumulative), the reported model, any `error` event.
    feed() takes raw bytes as they arrive and never raises; only the few event lines that can
    carry usage are decoded."""

    def __init__(self) -> None:
        self._rest = b""
        self.usage: dict[str, Any] = {}
        self.model: str | None = None
        self.error: str | None = None
        self.bad = False
        self.events = 0
        self.updates = 0   # usage figures read so far (message_start, message_delta): a changed count
        self.ended = False   # the answer's message_delta (its final usage) was read

    def feed(self, data: bytes) -> None:
        lines = (self._rest + data).split(b"\n")
        self._rest = lines.pop()
        if len(self._rest) > GATEWAY_MAX_METER_BYTES:
            self._rest, self.bad = b"", True
        for line in lines:
            if line.startswith(b"data:"):
                self.events += 1
                if b"message_start" in line or b"message_delta" in line or b'"error"' in line:
                    self._event(line[5:].strip())

    def _event(self, raw: bytes) -> None:
        try:
            ev = json.loads(raw)
        except ValueError:
            self.bad = True
            return
        if not isinstance(ev, dict):
            return
        kind = ev.get("type")
        if kind == "message_start" and isinstance(ev.get("message"), dict):
            msg = ev["message"]
            self.usage, bad = _clean_usage(msg.get("usage"))
            self.bad = self.bad or bad
            self.updates += 1
            if isinstance(msg.get("model"), str):
                self.model = msg["model"][:200]
        elif kind == "message_delta":
            usage, bad = _clean_usage(ev.get("usage"))
            self.bad = self.bad or bad
            self.usage.update(usage)
            self.updates += 1
            self.ended = True
        elif kind == "error":
            err = ev.get("error")
            self.error = str(err.get("type") if isinstance(err, dict) else err)[:200]


def message_meter(body: bytes) -> tuple[dict[str, Any], str | None, bool]:
    """(usage, model, bad) of a non-streamed Messages answer (pure)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return {}, None, True
    if not isinstance(obj, dict):
        return {}, None, True
    usage, bad = _clean_usage(obj.get("usage"))
    model = obj.get("model") if isinstance(obj.get("model"), str) else None
    return usage, model, bad


def metered_tokens(usage: Mapping[str, Any]) -> dict[str, int]:
    """Usage to the ledger's token dict; the 5m/1h cache-write split stays exact."""
    return tokens_from_usage(usage)


@dataclass(frozen=True)
class RequestBound:
    """What a Messages request body says about its cost (see request_bound): the model it is
    priced at, whether it streams, its max_tokens, the most input tokens it can be billed, and the
    parts whose cost the body does not bound (`unbounded`, by name; empty: fully bounded).
    `readable`: the body is a JSON object this process could parse (one that is not cannot be
    bounded, and the API would refuse it anyway, unless its parser goes deeper than this one)."""
    model: str | None
    stream: bool
    max_tokens: int
    input_tokens: int
    unbounded: tuple[str, ...]
    readable: bool = True


def _content_bound(roots: Iterable[Any]) -> tuple[int, list[str]]:
    """(extra input tokens, unbounded part names) of the content blocks anywhere below `roots`
    (pure; iterative, so a deeply nested body cannot exhaust the stack).  Images cost a bounded
    number of tokens whatever their bytes; data fetched by the API (a URL, a Files API id, an
    uploaded container file) and PDF pages (text and a picture per page, compressed) are not
    bounded by the body.  A tool call's `input` is not searched: it is data, not content."""
    extra, unbounded = 0, []
    stack = list(roots)
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        source = node.get("source")
        if kind == "image":
            extra += GATEWAY_IMAGE_TOKENS
        if isinstance(source, dict):
            stype = source.get("type")
            if stype not in GATEWAY_INLINE_SOURCES:
                unbounded.append(f"{str(stype)[:40]}_source")
            elif stype == "base64" and kind == "document" and source.get("media_type") != "text/plain":
                unbounded.append("pdf_document")
        if "file_id" in node:
            unbounded.append("file_id")
        if kind == "container_upload":
            unbounded.append("container_upload")
        # A tool call's input is the model's own JSON, billed as text: whatever it holds is no block.
        skip = "input" if isinstance(kind, str) and kind.endswith("tool_use") else None
        stack.extend(v for k, v in node.items() if k != skip and isinstance(v, (dict, list)))
    return extra, unbounded


def request_bound(body: bytes, default_model: str | None) -> RequestBound:
    """The cost bound of one Messages request body (pure, never raises).

    Input: one token per body byte (GATEWAY_BYTES_PER_TOKEN), plus the API's own overhead, a
    fixed allowance per image and per Anthropic-defined client tool.  Output: max_tokens (the
    default when missing or not a positive integer).  Refused by name unless the study states a
    worst case for them: server-side tools (web search and fetch, code execution, tool search,
    MCP toolsets; any tool `type` not known to run on the client), remote MCP servers, a code
    execution container, content fetched from a URL or the Files API, PDF documents, and fast
    mode (`speed`, priced at a multiple the study's price table does not hold)."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        req = None
    readable = isinstance(req, dict)
    req = req if isinstance(req, dict) else {}
    model = req.get("model") if isinstance(req.get("model"), str) else default_model
    mt = req.get("max_tokens")
    mt_ok = isinstance(mt, int) and not isinstance(mt, bool) and mt > 0
    tokens = math.ceil(len(body) / GATEWAY_BYTES_PER_TOKEN) + GATEWAY_OVERHEAD_TOKENS
    unbounded: list[str] = []
    tools = req.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in (None, "custom"):
            continue
        if isinstance(kind, str) and kind.startswith(GATEWAY_CLIENT_TOOL_PREFIXES):
            tokens += GATEWAY_CLIENT_TOOL_TOKENS
        else:
            unbounded.append("server_tool:" + str(kind)[:60])
    if req.get("mcp_servers"):
        unbounded.append("mcp_servers")
    if req.get("container") is not None:
        unbounded.append("container")
    if req.get("speed") not in (None, "standard"):
        unbounded.append("speed:" + str(req.get("speed"))[:20])
    extra, parts = _content_bound([req.get("messages"), req.get("system")])
    unbounded += parts
    return RequestBound(model=model, stream=bool(req.get("stream")),
                        max_tokens=mt if mt_ok else GATEWAY_DEFAULT_MAX_TOKENS, input_tokens=tokens + extra,
                        unbounded=tuple(sorted(set(unbounded))), readable=readable)


def worst_case_usd(input_tokens: int, max_tokens: int, model: str | None,
                   prices: Mapping[str, Sequence[float]] | None) -> float:
    """What one Messages request can cost at most (pure): its input bound at the dearest
    input-side price (every token could be a 1-hour cache write), plus max_tokens of output."""
    p_in, p_out, p_5m, p_1h, _ = price_for(model, prices)
    return round((max(input_tokens, 0) * max(p_in, p_5m, p_1h) + max(max_tokens, 0) * p_out) / 1e6, 6)


def reservation_refusal(worst: float, *, run_cap: float | None, run_used: float,
                        study_cap: float | None, study_used: float) -> dict[str, Any] | None:
    """Whether a request whose worst case is `worst` may go out (pure): None, or which limit it
    does not fit.  run_used: this job's metered cost plus its reservations in flight; study_used:
    the study's ledger spend plus every other live job's metered cost and reservations."""
    if run_cap is not None and run_used + worst > run_cap + 1e-12:
        return {"limit": "usd_per_run", "cap_usd": round(run_cap, 6), "used_usd": round(run_used, 6),
                "worst_case_usd": worst}
    if study_cap and study_used + run_used + worst > study_cap + 1e-12:
        return {"limit": "study_usd", "cap_usd": round(study_cap, 6),
                "used_usd": round(study_used + run_used, 6), "worst_case_usd": worst}
    return None


def cost_mismatch(metered: float | None, reported: float | None) -> bool:
    """Metered and self-reported cost differ beyond rounding (pure)."""
    if metered is None or reported is None:
        return False
    tolerance = max(COST_MISMATCH_ABS_USD, COST_MISMATCH_REL * max(abs(metered), abs(reported)))
    return abs(metered - reported) > tolerance


def billed_cost_usd(usage: Mapping[str, Any] | None) -> float:
    """The cost budgets count for a finished job: the metered one where requests went through the
    gateway, else the binary's own figure (no gateway, or a session that made no request)."""
    usage = usage or {}
    metered = usage.get("cost_metered_usd")
    requests = usage.get("requests")
    if (finite_number(metered) is not None and isinstance(requests, int) and requests > 0):
        return float(metered)
    return float(usage.get("cost_delta_usd") or 0.0)


def summarize_metering(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """cost_metered_usd, requests and per-model figures from gateway.jsonl records (pure)."""
    total = 0.0
    requests = 0
    models: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.get("kind") != "messages":
            continue
        requests += 1
        cost = spend_from(rec.get("cost_usd"))   # a record edited to a negative or huge cost fails closed
        total += cost
        name = str(rec.get("model") or "(unknown)")
        row = models.setdefault(name, {"requests": 0, "cost_usd": 0.0, "tokens": {k: 0 for k in TOKEN_KEYS}})
        row["requests"] += 1
        row["cost_usd"] = round(row["cost_usd"] + cost, 6)
        row["tokens"] = add_tokens(row["tokens"], rec.get("tokens") or {})
    return {"cost_metered_usd": round(total, 6), "requests": requests, "models_metered": models}


def gateway_proof(ledger_lines: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """What a rehearsal shows of its gateways (pure): how many sessions were metered, their
    metered and self-reported cost, the sessions whose two figures disagree (`mismatched`) and
    the sessions that ended `ok` without a single request through their gateway (`unmetered_ok`:
    their model traffic went around it)."""
    out: dict[str, Any] = {"jobs": 0, "metered_jobs": 0, "requests": 0, "cost_metered_usd": 0.0,
                           "cost_reported_usd": 0.0, "mismatched": [], "unmetered_ok": []}
    for line in ledger_lines:
        out["jobs"] += 1
        requests = line.get("requests")
        requests = requests if isinstance(requests, int) and not isinstance(requests, bool) else 0
        reported = float(line.get("cost_delta_usd") or 0.0)
        out["cost_reported_usd"] = round(out["cost_reported_usd"] + reported, 6)
        if requests > 0:
            out["metered_jobs"] += 1
            out["requests"] += requests
            out["cost_metered_usd"] = round(out["cost_metered_usd"] + billed_cost_usd(line), 6)
        if "cost_mismatch" in (line.get("flags") or []):
            out["mismatched"].append(line.get("job_id"))
        if line.get("status") == "ok" and requests == 0:
            out["unmetered_ok"].append(line.get("job_id"))
    return out


# -- the study's live reservations (shared between supervisor processes) ---------------------------

def gateway_dir(paths: StudyPaths) -> Path:
    return paths.state / "gateway"


def live_reservations_usd(paths: StudyPaths, exclude: str | None = None,
                          keys: tuple[str, ...] = ("metered_usd", "reserved_usd")) -> float:
    """Metered cost plus reservations in flight (`keys`) of every live job but `exclude`.  A job whose
    ledger line is written is counted by the ledger instead.  Read under the study's gateway lock
    (see GatewayBudget); a file that still cannot be parsed (its writer died mid-write) is skipped,
    and so is any figure that is not a finite positive number."""
    total = 0.0
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(gateway_dir(paths)):
            is_record = entry.name.endswith(".json") and not entry.name.startswith(".")
            job_id = entry.name[:-5] if is_record else None
            if not job_id or job_id == exclude or (paths.job_dir(job_id) / "ledgered").exists():
                continue
            try:
                data = json.loads(Path(entry.path).read_bytes())
            except (OSError, ValueError):
                continue
            for key in keys:
                val = data.get(key) if isinstance(data, dict) else None
                total += spend_from(val)   # an edited reservation file fails closed
    return total


#: A live reservation file is written in place, padded to this size (no truncation, no rename:
#: both make some file systems flush on every write), and read only under the same lock.
GATEWAY_LIVE_FILE_BYTES = 256


class GatewayBudget:
    """One job's metered spend and reservations, published under state/gateway/<job>.json so that
    every other supervisor of the study counts them.  Every write and every read of those files
    happens under one study-wide OS file lock (state/gateway/.lock, Platform.file_lock): a
    reservation is decided on figures nobody is changing, and no reader sees a half-written file."""

    def __init__(self, paths: StudyPaths, platform: "Platform", job_id: str, *, run_cap: float | None,
                 study_cap: float | None):
        self.paths = paths
        self.platform = platform
        self.job_id = job_id
        self.run_cap = run_cap
        self.study_cap = study_cap
        self.metered = 0.0
        self.reserved = 0.0
        self._lock = threading.Lock()
        self.file = gateway_dir(paths) / f"{checked_id('job', job_id)}.json"
        self._others, self._others_at = 0.0, -math.inf   # the study's spend but this job's, when read

    def _study_lock(self) -> Any:
        gateway_dir(self.paths).mkdir(parents=True, exist_ok=True)
        return self.platform.file_lock(gateway_dir(self.paths) / ".lock")

    def _publish(self) -> None:
        """Write this job's figures (under the study lock)."""
        data = json.dumps({"job_id": self.job_id, "metered_usd": round(self.metered, 6),
                           "reserved_usd": round(max(self.reserved, 0.0), 6), "pid": os.getpid()}).encode()
        fd = os.open(self.file, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, data.ljust(max(GATEWAY_LIVE_FILE_BYTES, len(data)), b" "))
        finally:
            os.close(fd)

    def reserve(self, worst: float) -> dict[str, Any] | None:
        """Reserve `worst` or say which limit it does not fit (then nothing is reserved)."""
        with self._lock, self._study_lock():
            study_used = 0.0
            if self.study_cap:
                study_used = float(read_registry(self.paths).get("spent_usd") or 0.0) + \
                    live_reservations_usd(self.paths, exclude=self.job_id)
            refusal = reservation_refusal(worst, run_cap=self.run_cap, run_used=self.metered + self.reserved,
                                          study_cap=self.study_cap, study_used=study_used)
            if refusal is None:
                self.reserved += worst
                self._publish()
            return refusal

    def reached(self, live: float) -> dict[str, Any] | None:
        """Which cap the metered spend has reached with `live` (what the answers still streaming
        have cost so far) counted, or None.  The study's: its ledger spend and every other live
        job's metered cost (not their reservations: this is spend, not a forecast)."""
        with self._lock:
            run_used = self.metered + live
        if self.run_cap is not None and run_used >= self.run_cap:
            return {"limit": "usd_per_run", "cap_usd": round(self.run_cap, 6), "used_usd": round(run_used, 6)}
        if self.study_cap:
            now = time.monotonic()
            if now - self._others_at >= GATEWAY_STUDY_RECHECK_S:
                with self._study_lock():
                    self._others = registry_spent_usd(read_registry(self.paths)) + \
                        live_reservations_usd(self.paths, exclude=self.job_id, keys=("metered_usd",))
                self._others_at = now
            used = self._others + run_used
            if used >= self.study_cap:
                return {"limit": "study_usd", "cap_usd": round(self.study_cap, 6), "used_usd": round(used, 6)}
        return None

    def settle(self, reserved: float, cost: float) -> None:
        with self._lock:
            self.reserved = max(self.reserved - reserved, 0.0)
            self.metered += cost
            with contextlib.suppress(OSError, AgentbenchError), self._study_lock():
                self._publish()

    def discard(self) -> None:
        """After the job's ledger line is written: the ledger counts it from now on."""
        with contextlib.suppress(OSError):
            self.file.unlink()


# -- the server ------------------------------------------------------------------------------------

#: The gateway's handler and server classes, built on first use (see _gateway_server_classes).
_GATEWAY_CLASSES: list[tuple[Any, Any]] = []


def _gateway_server_classes() -> tuple[Any, Any]:
    """(handler class, server class) of the gateway, built on first use: http.server (and with it
    http.client and ssl) is then imported only by a process that runs a gateway, not by every
    command."""
    if not _GATEWAY_CLASSES:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "agentbench-gateway"

            def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - the stdlib's name
                pass   # every request is recorded in gateway.jsonl instead (never its headers)

            def _handle(self) -> None:
                self.server.gateway.handle(self)   # type: ignore[attr-defined]

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _handle

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128   # a burst of connections is queued, not reset (the default: 5)
            gateway: "MeteringGateway"

        _GATEWAY_CLASSES.append((Handler, Server))
    return _GATEWAY_CLASSES[0]


def upstream_down(exc: BaseException) -> bool:
    """Whether a forwarding error says the upstream cannot be reached at all (refused, no route,
    no such host, no answer, a certificate that does not verify), rather than a failure of one
    request."""
    if isinstance(exc, (ConnectionRefusedError, TimeoutError, socket.gaierror, ssl.SSLError)):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)


def _gateway_unix_server_class() -> Any:
    """The gateway's server on a Unix socket (the way in from a sandbox with no network of its
    own): the same handler, bound to a path instead of a TCP port."""
    if len(_GATEWAY_CLASSES) < 2:
        _, tcp_server = _gateway_server_classes()

        class UnixServer(tcp_server):   # type: ignore[valid-type,misc]
            address_family = socket.AF_UNIX

            def server_bind(self) -> None:   # no host name or port to look up
                self.socket.bind(self.server_address)
                self.server_address = self.socket.getsockname()
                self.server_name, self.server_port = "localhost", 0

        _GATEWAY_CLASSES.append((None, UnixServer))
    return _GATEWAY_CLASSES[1][1]


@dataclass(frozen=True)
class GatewayAnswer:
    """What the upstream answered one forwarded request: its status and request id, how many
    chunks were relayed, whether the relay broke off (`error`: why), and the usage, model and
    stream error read from a Messages answer (`bad`: some usage figure could not be believed)."""
    status: int
    request_id: str | None
    chunks: int
    aborted: bool
    error: str | None
    usage: Mapping[str, Any]
    model: str | None
    bad: bool
    stream_error: str | None
    cut: bool = False
    complete: bool = True   # its final usage was read (a cut answer's may not have been)


@dataclass(frozen=True)
class LiveAnswer:
    """A Messages request on its way: its number among the gateway's, the model it is priced at
    and the USD reserved for it."""
    ticket: int
    model: str | None
    reserved: float


class MeteringGateway:
    """The gateway of one job (see the section banner).  start() binds 127.0.0.1:0; url and token
    are what `claude` gets; stop() shuts it down and waits briefly for requests in flight."""

    def __init__(self, *, upstream: str | None, creds: Mapping[str, str],
                 prices: Mapping[str, Sequence[float]] | None,
                 record_path: str | os.PathLike[str], budget: GatewayBudget | None = None,
                 default_model: str | None = None, unbounded_usd: float = 0.0):
        self.scheme, self.host, self.port, self.prefix = gateway_upstream(upstream)
        self.auth = gateway_auth_headers(creds)
        self.token = "abgw-" + secrets.token_urlsafe(32)
        self.prices = prices
        self.record_path = Path(record_path)
        self.budget = budget
        self.default_model = default_model
        #: The worst case the study states for a request the body does not bound (0: refused).
        self.unbounded_usd = unbounded_usd
        self.refusal: dict[str, Any] | None = None
        #: Set once the metered spend reached a cap (or an answer cost more than its reservation):
        #: every live answer is cut, every later Messages request refused, and the supervisor ends
        #: the session `budget`.
        self.cutoff: dict[str, Any] | None = None
        self._live: dict[int, float] = {}
        self._upstreams: dict[int, http.client.HTTPConnection] = {}   # of live Messages answers
        self._tickets = 0
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._inflight = 0
        self._unreachable = 0   # requests in a row that found the upstream unreachable
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._unix: Any = None
        self.socket_path: str | None = None
        self.url = ""

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> str:
        handler, server = _gateway_server_classes()
        srv = server(("127.0.0.1", 0), handler)
        srv.gateway = self
        self._server = srv
        self.url = f"http://127.0.0.1:{srv.server_address[1]}"
        self._thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        return self.url

    def listen_unix(self) -> str:
        """Also serve on a Unix socket, in a private directory of its own (owner-only) under /tmp
        (a socket's path must be short), removed by stop(): a sandboxed session reaches its
        gateway only through it, bound into its sandbox.  Answers the socket's path."""
        d = tempfile.mkdtemp(prefix="abgw-", dir="/tmp" if os.path.isdir("/tmp") else None)
        path = os.path.join(d, "gateway.sock")
        try:
            srv = _gateway_unix_server_class()(path, _gateway_server_classes()[0])
        except OSError:
            os.rmdir(d)
            raise
        srv.gateway = self
        self._unix = srv
        self.socket_path = path
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
        return path

    def claude_vars(self) -> dict[str, str]:
        return {"ANTHROPIC_BASE_URL": self.url, GATEWAY_TOKEN_VAR: self.token}

    def stop(self, wait_s: float = GATEWAY_STOP_WAIT_S) -> None:
        for srv in (self._server, self._unix):
            if srv is not None:
                srv.shutdown()
                srv.server_close()
        self._server = self._unix = None
        if self.socket_path:
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.socket_path))
            self.socket_path = None
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._inflight == 0:
                    break
            time.sleep(0.02)
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return summarize_metering(list(self.records))

    # -- upstream connections ----------------------------------------------------------------------
    def _connect(self) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=GATEWAY_UPSTREAM_TIMEOUT_S,
                                               context=ssl.create_default_context()), False
        return http.client.HTTPConnection(self.host, self.port, timeout=GATEWAY_UPSTREAM_TIMEOUT_S), False

    def _reuse(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def _record(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self.records.append(rec)
            with contextlib.suppress(OSError):
                append_jsonl(self.record_path, rec)

    # -- one request -------------------------------------------------------------------------------
    def handle(self, h: Any) -> None:
        with self._lock:
            self._inflight += 1
        try:
            self._handle(h)
        finally:
            with self._lock:
                self._inflight -= 1

    @staticmethod
    def _reply(h: Any, status: int, kind: str, message: str) -> None:
        data = json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
        h.wfile.flush()

    @staticmethod
    def _read_body(h: Any) -> bytes | None:
        """The request body (Content-Length or chunked); None when it is too large or malformed."""
        te = str(h.headers.get("transfer-encoding") or "").lower()
        if "chunked" in te:
            parts, size = [], 0
            while True:
                line = h.rfile.readline(1024)
                try:
                    n = int(line.split(b";")[0].strip() or b"x", 16)
                except ValueError:
                    return None
                if n == 0:
                    while h.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                size += n
                if size > GATEWAY_MAX_BODY_BYTES:
                    return None
                parts.append(h.rfile.read(n))
                h.rfile.readline(16)
        raw = h.headers.get("content-length")
        try:
            length = int(raw) if raw is not None else 0
        except ValueError:
            return None
        if length < 0 or length > GATEWAY_MAX_BODY_BYTES:
            return None
        return h.rfile.read(length) if length else b""

    def _refuse(self, h: Any, rec: Mapping[str, Any], t0: float, status: int, error: str, message: str,
                refused: str, *, close: bool = False, messages: bool = False) -> None:
        """Answer a request that is not forwarded (an API-shaped error) and record why: `refused`
        names the rule; `messages`: a Messages request, recorded with zero cost and tokens."""
        if close:
            h.close_connection = True
        self._reply(h, status, error, "agentbench gateway: " + message)
        zero = {"cost_usd": 0.0, "tokens": {k: 0 for k in TOKEN_KEYS}} if messages else {}
        self._record({**rec, "status": status, "refused": refused, **zero,
                      "duration_s": round(time.monotonic() - t0, 6)})

    def _handle(self, h: Any) -> None:
        """One request: checked (token, body, path, budget; each refusal is one _refuse), then
        forwarded, then metered and recorded."""
        t0 = time.monotonic()
        kind, path, allowed = gateway_route(h.command, h.path)
        rec: dict[str, Any] = {"at": utc_now(), "method": h.command, "path": path.partition("?")[0][:200],
                               "kind": kind}
        if not token_matches(presented_token(h.headers), self.token):
            self._refuse(h, rec, t0, 401, "authentication_error",
                         "this request does not carry the job's token", "token", close=True)
            return
        body = self._read_body(h)
        if body is None:
            self._refuse(h, rec, t0, 413, "request_too_large", "request body too large or malformed", "body",
                         close=True)
            return
        if not allowed:
            self._refuse(h, rec, t0, 403, "permission_error",
                         "only POST /v1/messages and POST /v1/messages/count_tokens are forwarded", "path")
            return
        live = None
        if kind == "messages":
            bound = request_bound(body, self.default_model)
            rec.update({"model": bound.model, "model_requested": bound.model, "stream": bound.stream,
                        "max_tokens": bound.max_tokens,
                        "body_bytes": len(body), "input_bound_tokens": bound.input_tokens})
            if bound.unbounded:
                rec["unbounded"] = list(bound.unbounded)
            if self.cutoff is not None:
                self._refuse(h, {**rec, "refusal": self.cutoff}, t0, 400, "invalid_request_error",
                             f"budget exhausted: {self.cutoff['limit']} reached, this session's answers were "
                             f"cut", self.cutoff["limit"], messages=True)
                return
            if not bound.readable:
                self._refuse(h, rec, t0, 400, "invalid_request_error",
                             "a Messages request must be a JSON object this gateway can read (its cost is "
                             "bounded from it)", "unreadable", messages=True)
                return
            if bound.unbounded and not self.unbounded_usd:
                self._refuse(h, rec, t0, 400, "invalid_request_error",
                             "this request's cost cannot be bounded from its body ("
                             + ", ".join(bound.unbounded) + "); a study that accepts such requests states "
                             "their worst case in budget.unbounded_request_usd", "unbounded", messages=True)
                return
            worst = worst_case_usd(bound.input_tokens, bound.max_tokens, bound.model, self.prices)
            worst = round(worst + (self.unbounded_usd if bound.unbounded else 0.0), 6)
            reserved = 0.0
            if self.budget is not None:
                try:
                    refusal = self.budget.reserve(worst)
                except AgentbenchError as exc:
                    self._refuse(h, rec, t0, 503, "api_error", exc.one_line(), "lock", messages=True)
                    return
                if refusal is not None:
                    with self._lock:
                        self.refusal = self.refusal or refusal
                    # 400 invalid_request_error is final for the binary: it does not retry it.
                    self._refuse(h, {**rec, "refusal": refusal}, t0, 400, "invalid_request_error",
                                 f"budget exhausted: this request's worst case "
                                 f"(${refusal['worst_case_usd']:.6f}) does not fit {refusal['limit']} "
                                 f"(${refusal['used_usd']:.6f} of ${refusal['cap_usd']:.6f} used)",
                                 refusal["limit"], messages=True)
                    return
                reserved = worst
            with self._lock:
                self._tickets += 1
                live = LiveAnswer(ticket=self._tickets, model=bound.model, reserved=reserved)
        answer = self._forward(h, path, body, live)
        if live is not None:
            self._meter(rec, answer, live)
        if answer.cut:
            rec["cut"] = True
        if answer.error:
            rec["error"] = answer.error
        rec.update({"status": answer.status, "request_id": answer.request_id, "chunks": answer.chunks,
                    "aborted": answer.aborted, "duration_s": round(time.monotonic() - t0, 6)})
        self._record(rec)

    def _forward(self, h: Any, path: str, body: bytes, live: LiveAnswer | None) -> GatewayAnswer:
        """Send the request upstream with the real credential and relay the answer byte for byte,
        reading the usage of a Messages answer (`live`) as it passes; the relay stops (the answer
        is cut) as soon as the gateway's cutoff is set, by this answer's usage or another's."""
        meter = SseMeter()
        cut = replied = False
        kept: list[bytes] = []
        kept_size = 0
        status = 502
        aborted = False
        chunks = 0
        request_id = None
        error = None
        is_sse = False
        conn = None
        try:
            headers = [(k, v) for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP]
            headers += [("host", self.host if self.port in (80, 443) else f"{self.host}:{self.port}"),
                        ("accept-encoding", "identity"), *self.auth]
            resp = conn = None
            for attempt in (0, 1):
                conn, reused = self._connect()
                try:
                    conn.putrequest(h.command, self.prefix + path, skip_host=True, skip_accept_encoding=True)
                    for k, v in headers:
                        conn.putheader(k, v)
                    if body or h.command in ("POST", "PUT", "PATCH"):
                        conn.putheader("content-length", str(len(body)))
                    conn.endheaders(body or None)
                    resp = conn.getresponse()
                    break
                except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                    conn.close()
                    if not reused or attempt:
                        raise
            assert resp is not None and conn is not None
            if live is not None:
                with self._lock:
                    self._upstreams[live.ticket] = conn
                    cut = self.cutoff is not None   # set while this request went out: not relayed
            if cut:
                raise ConnectionAbortedError("cut: the gateway's cutoff is set")
            status = resp.status
            request_id = resp.getheader("request-id") or resp.getheader("x-request-id")
            ctype = str(resp.getheader("content-type") or "")
            is_sse = "text/event-stream" in ctype
            length = resp.getheader("content-length")
            chunked = length is None and h.command != "HEAD" and status not in (204, 304)
            h.send_response(status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP_BY_HOP or k.lower() == "content-length":
                    h.send_header(k, v)
            if chunked:
                h.send_header("transfer-encoding", "chunked")
            h.end_headers()
            h.wfile.flush()
            replied = True
            while True:
                data = resp.read1(GATEWAY_CHUNK_BYTES) if h.command != "HEAD" else b""
                if live is not None and self.cutoff is not None and not data:
                    cut = aborted = True   # the cut shut its upstream connection: not a normal end
                    break
                if not data:
                    break
                chunks += 1
                if live is not None:
                    if is_sse:
                        seen = meter.updates
                        meter.feed(data)
                        if meter.updates != seen:
                            self._observe(live, meter)
                    elif kept_size < GATEWAY_MAX_METER_BYTES:
                        kept.append(data)
                        kept_size += len(data)
                if live is not None and self.cutoff is not None:
                    cut = aborted = True   # stop relaying: what was metered of it counts
                    break
                try:
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                    h.wfile.flush()
                except OSError:
                    aborted = True   # the client went away: what was metered of it counts
                    break
            if chunked and not aborted:
                with contextlib.suppress(OSError):
                    h.wfile.write(b"0\r\n\r\n")
                    h.wfile.flush()
            if aborted or resp.will_close or not resp.isclosed():
                conn.close()
                h.close_connection = h.close_connection or aborted
            else:
                self._reuse(conn)
        except (OSError, http.client.HTTPException) as exc:
            aborted = True
            cut = cut or (live is not None and self.cutoff is not None)   # the cut shut its upstream
            error = f"{type(exc).__name__}: {exc}"[:300]
            if conn is not None:
                conn.close()
            h.close_connection = True
            if not replied:
                with self._lock:
                    # Only a connection that could not be made counts: nothing a session sends
                    # (odd headers, a dropped connection) can end its own session this way.
                    self._unreachable = self._unreachable + 1 if upstream_down(exc) else 0
                    final = not cut and self._unreachable >= GATEWAY_UNREACHABLE_FINAL
                with contextlib.suppress(OSError):
                    if cut:   # final for the binary, as every budget refusal
                        status = 400
                        self._reply(h, 400, "invalid_request_error", "agentbench gateway: budget exhausted: "
                                    "this session's answers were cut")
                    elif final:   # 400 invalid_request_error is final for the binary: no more retries
                        status = 400
                        self._reply(h, 400, "invalid_request_error",
                                    f"agentbench gateway: the upstream could not be reached "
                                    f"{GATEWAY_UNREACHABLE_FINAL} times in a row ({error})")
                    else:
                        self._reply(h, 502, "api_error",
                                    "agentbench gateway: the upstream could not be reached")
        else:
            with self._lock:
                self._unreachable = 0
        if live is not None:
            with self._lock:
                self._upstreams.pop(live.ticket, None)
        if kept:
            usage, model, bad = message_meter(b"".join(kept))
        else:
            usage, model, bad = meter.usage, meter.model, meter.bad
        return GatewayAnswer(status=status, request_id=str(request_id)[:200] if request_id else None,
                             chunks=chunks, aborted=aborted, error=error, usage=usage, model=model, bad=bad,
                             stream_error=meter.error, cut=cut, complete=meter.ended if is_sse else not cut)

    def _cut(self, why: Mapping[str, Any]) -> None:
        """Set the cutoff (the first reason stays): new requests are refused, and every live answer
        stops, an idle one too: its upstream connection is shut, which ends its relay at once."""
        with self._lock:
            if self.cutoff is None:
                self.cutoff = dict(why)
                self.refusal = self.refusal or self.cutoff
            upstreams = list(self._upstreams.values())
        for conn in upstreams:
            with contextlib.suppress(OSError, AttributeError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def _observe(self, live: LiveAnswer, meter: SseMeter) -> None:
        """A streamed answer's usage moved: cost it so far; cut every answer when it passed its own
        reservation (the bound failed) or the metered spend, live answers included, reached a cap."""
        running = estimate_cost_usd(metered_tokens(meter.usage), meter.model or live.model, self.prices)
        with self._lock:
            self._live[live.ticket] = running
            total = sum(self._live.values())
        if self.budget is None:
            return
        if running > live.reserved + 1e-9:
            self._cut({"limit": "reservation_exceeded", "reserved_usd": live.reserved,
                       "cost_usd": round(running, 6)})
            return
        with contextlib.suppress(OSError, AgentbenchError):
            reached = self.budget.reached(total)
            if reached is not None:
                self._cut(reached)

    def _meter(self, rec: dict[str, Any], answer: GatewayAnswer, live: LiveAnswer) -> None:
        """Cost a Messages answer at the study's prices, settle its reservation, note it in `rec`.
        An answer that cost more than its reservation sets the cutoff: the bound did not hold.  A
        cut answer whose final usage never came (the upstream may bill what it had generated, or
        its whole input) is charged its reservation when that is more: the caps fail closed."""
        tokens = metered_tokens(answer.usage)
        rmodel = answer.model or live.model
        cost = estimate_cost_usd(tokens, rmodel, self.prices)
        if answer.cut and not answer.complete and live.reserved > cost:
            cost = live.reserved
            rec["charged"] = "reservation"
        with self._lock:
            self._live.pop(live.ticket, None)   # before it is settled: never counted twice
        if self.budget is not None:
            self.budget.settle(live.reserved, cost)
        rec.update({"model": rmodel, "tokens": tokens, "cost_usd": cost, "reserved_usd": live.reserved})
        if answer.stream_error:
            rec["stream_error"] = answer.stream_error
        if answer.bad:
            rec["bad_usage"] = True
        if self.budget is not None and cost > live.reserved + 1e-9:
            rec["reservation_exceeded"] = True
            self._cut({"limit": "reservation_exceeded", "reserved_usd": live.reserved, "cost_usd": cost})


def start_job_gateway(paths: StudyPaths, platform: "Platform", job: Mapping[str, Any],
                      creds: Mapping[str, str], extra: Mapping[str, str],
                      host: Mapping[str, str]) -> MeteringGateway:
    """The gateway of one job, started: upstream and credentials from the study's env (`extra`,
    e.g. a scripted model's URL and dummy key) over the supervisor's own; the run's remaining
    budget and the study's cap from the job record."""
    source = {**{k: v for k, v in creds.items()}, **{k: v for k, v in extra.items() if k in GATEWAY_WITHHELD}}
    upstream = extra.get("ANTHROPIC_BASE_URL") or host.get("ANTHROPIC_BASE_URL")
    limits = job.get("limits") or {}
    run_cap = limits.get("max_budget_usd")
    study_cap = job.get("study_usd")
    unbounded = job.get("unbounded_request_usd")
    budget = GatewayBudget(paths, platform, str(job["job_id"]),
                           run_cap=float(run_cap) if isinstance(run_cap, (int, float)) else None,
                           study_cap=(float(study_cap)
                                      if isinstance(study_cap, (int, float)) and study_cap > 0 else None))
    gw = MeteringGateway(upstream=upstream, creds=source, prices=job.get("prices"),
                         record_path=paths.job_dir(str(job["job_id"])) / "gateway.jsonl", budget=budget,
                         default_model=job.get("model"),
                         unbounded_usd=float(unbounded) if is_number(unbounded) and unbounded > 0 else 0.0)
    gw.start()
    return gw


# ==================================================================================================
# Jobs: a session's record (create, launch, finalise, reap, kill)
# ==================================================================================================
# Jobs: one `claude` session each.  A job is registered under the registry lock (its record, its
# active marker), launched through its executor, and finalised exactly once: result.json (created
# exclusively -- the once-only guard), the registry counters, one ledger line.  The reaper completes
# half-finalised jobs and declares dead ones `lost`; kill follows the pure kill plan (kill_step).
# Jobs do not know what they are for: the experiment layer puts its run ids in `meta` and reads
# results back.  Owns job records, finalisation, the reaper and kill.  Must not know tasks, arms or
# runs, and must not run `claude` itself (that is the supervisor process, below).

def build_claude_argv(binary: str, launch: Mapping[str, Any], *, session_id: str | None,
                      resume: str | None, fork: bool, mcp_config: str, system_prompt_file: str,
                      max_budget_usd: float | None, max_turns: int | None) -> list[str]:
    """The full, fingerprinted argv of one `claude` call (flags are not inherited by a resume)."""
    argv = [binary, "-p", "--output-format", "stream-json", "--verbose",
            "--model", str(launch["model"])]
    if launch.get("effort"):
        argv += ["--effort", str(launch["effort"])]
    argv += ["--permission-mode", str(launch["permission_mode"]),
             "--tools", str(launch["tools"]),
             "--allowedTools", str(launch.get("allowed_tools") or launch["tools"])]
    if launch.get("disallowed_tools"):
        argv += ["--disallowedTools", str(launch["disallowed_tools"])]
    argv += ["--strict-mcp-config", "--mcp-config", mcp_config,
             "--append-system-prompt-file", system_prompt_file]
    if resume:
        argv += ["--resume", resume]
        if fork:
            argv += ["--fork-session"]
    if session_id and (fork or not resume):
        argv += ["--session-id", session_id]
    if max_budget_usd is not None:
        argv += ["--max-budget-usd", format(max(max_budget_usd, 0.0), ".6f").rstrip("0").rstrip(".") or "0"]
    if max_turns:
        argv += ["--max-turns", str(int(max_turns))]
    return argv


def argv_fingerprint(argv: Sequence[str]) -> str:
    """sha256 of the argv with per-call values (ids, paths, budgets) masked: same config, same hash."""
    masked: list[str] = []
    skip_next = False
    for i, a in enumerate(argv):
        if i == 0:
            masked.append("<binary>")
            continue
        if skip_next:
            masked.append("<v>")
            skip_next = False
            continue
        masked.append(a)
        if a in ("--session-id", "--resume", "--mcp-config", "--append-system-prompt-file",
                 "--max-budget-usd"):
            skip_next = True
    return sha256_bytes(json.dumps(masked).encode())


def claude_projects_dir(env: Mapping[str, str]) -> Path:
    """Where `claude` keeps session transcripts: $CLAUDE_CONFIG_DIR/projects or ~/.claude/projects."""
    base = env.get("CLAUDE_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".claude")
    return Path(base) / "projects"


def transcript_dir_name(cwd: str) -> str:
    """claude's per-project transcript directory name: the cwd with non-alphanumerics as '-'."""
    return re.sub(r"[^A-Za-z0-9]", "-", cwd)


def transcript_path(env: Mapping[str, str], cwd: str, session_id: str) -> Path:
    name = checked_id("session", session_id) + ".jsonl"
    return claude_projects_dir(env) / transcript_dir_name(cwd) / name


def ensure_transcript_at(env: Mapping[str, str], session_id: str, from_cwd: str, to_cwd: str,
                         max_bytes: int | None) -> bool:
    """Make a session resumable from another cwd: `claude --resume` looks only in the cwd's project.

    Copies the transcript (never moves: the base stays usable) by safe_copy_file: a transcript
    the session replaced by a link or a FIFO, or one over `max_bytes`, raises UnusableTree.  True
    if it is now in place."""
    dst = transcript_path(env, to_cwd, session_id)
    if os.path.lexists(dst):
        return True
    src = transcript_path(env, from_cwd, session_id)
    if not os.path.lexists(src):
        return False
    safe_copy_file(src, dst, max_bytes if max_bytes is not None else DEFAULT_COPY_CAPS.file_bytes or 0)
    return True


def session_record(paths: StudyPaths, session_id: str) -> dict[str, Any]:
    """What the study knows of a `claude` session: last reported cumulative cost, modelUsage, context."""
    return read_json(paths.session_file(session_id), default=None) or {
        "session_id": session_id, "cost_total_usd": 0.0, "model_usage": {}, "context_tokens": 0}


def active_job_ids(paths: StudyPaths) -> list[str]:
    return [n for n in list_markers(paths.active) if JOB_ID_RE.match(n)]


def load_job(paths: StudyPaths, job_id: str) -> JobRecord:
    if not JOB_ID_RE.match(job_id or ""):
        raise AgentbenchError("invalid job id", code="invalid_job_id",
                              job=job_id, hint="job ids look like j000012")
    job = read_json(paths.job_file(job_id), default=None)
    if job is None:
        raise AgentbenchError("no such job", code="no_such_job", job=job_id, hint="see `agentbench.py list`")
    return job


def job_is_final(paths: StudyPaths, job_id: str) -> bool:
    """Finalisation complete: the result exists and the job left the active set (ledger written).

    result.json alone is not enough: it is the first write of finalisation, the ledger line and
    the markers follow under the same lock.
    """
    return paths.result_file(job_id).exists() and not (paths.active / job_id).exists()


def read_launcher(paths: StudyPaths, job_id: str) -> LauncherRecord | None:
    """How the job's supervisor was started: {"executor": "local", pid, ctime, host} or
    {"executor": "slurm", "slurm_job_id": ...}; None before the launch was recorded."""
    return read_json(paths.job_dir(job_id) / "launcher.json", default=None)


def job_status(paths: StudyPaths, job_id: str) -> dict[str, Any]:
    """A job's current state: its result if final, else its runtime (or `created`)."""
    res: ResultRecord | None = read_json(paths.result_file(job_id), default=None)
    if res is not None:
        return res
    rt: RuntimeRecord | None = read_json(paths.runtime_file(job_id), default=None)
    if rt is not None:
        return {"job_id": job_id, **rt}
    launcher = read_launcher(paths, job_id)
    sjid = executor_for(launcher).job_of(launcher)
    if sjid is not None:
        # Submitted, not started yet: waiting in Slurm's queue (or being started on a node).
        return {"job_id": job_id, "status": "queued", "slurm_job_id": sjid}
    return {"job_id": job_id, "status": "created"}


def existing_continuation(paths: StudyPaths, job_id: str) -> str | None:
    """The job that already continues `job_id`, if any (a marker naming a job that was never
    registered is a crash's leftover and does not count)."""
    try:
        existing = (paths.job_dir(job_id) / "continued_by").read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return existing if existing and paths.job_file(existing).exists() else None


class DuplicateRequest(Exception):
    """A request for a step that already has a job (e.g. a second `continue` of one job)."""

    def __init__(self, job_id: str):
        super().__init__(job_id)
        self.job_id = job_id


def _create_job_files(paths: StudyPaths, job_id: str, *, kind: str, prompt: str, cwd: str,
                      launch: Mapping[str, Any], binary: str, system_prompt: str, session_id: str | None,
                      resume: str | None, fork: bool, prior: Mapping[str, Any], limits: Mapping[str, Any],
                      meta: Mapping[str, Any], env_extra: Mapping[str, str] | None, raw_dir: str | None,
                      driver: Mapping[str, Any] | None, marker: Path | None) -> JobRecord:
    """create_job()'s second half, under its lock: the job's directory, built aside and renamed."""
    fault_point("create_job")
    # The job is built aside (a dot name: no listing sees it) and renamed into place whole,
    # so a crash from here on leaves no job directory without its job.json (no ghost job).
    jdir = paths.job_dir(job_id)
    build = paths.jobs / f".{job_id}.creating"
    if build.exists():
        shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    if raw_dir:
        Path(raw_dir).mkdir(parents=True, exist_ok=True)
    else:
        (build / "raw").mkdir()
    raw = Path(raw_dir) if raw_dir else jdir / "raw"
    (build / "prompt.txt").write_text(prompt, encoding="utf-8")
    sp_file = jdir / "system_prompt.md"
    (build / "system_prompt.md").write_text(system_prompt, encoding="utf-8")
    mcp_file = jdir / "mcp.json"
    (build / "mcp.json").write_text('{"mcpServers": {}}\n', encoding="utf-8")
    sid = session_id or (str(uuid.uuid4()) if (fork or not resume) else None)
    argv = build_claude_argv(binary, launch, session_id=sid, resume=resume, fork=fork,
                             mcp_config=str(mcp_file), system_prompt_file=str(sp_file),
                             max_budget_usd=limits.get("max_budget_usd"),
                             max_turns=limits.get("max_turns"))
    job: JobRecord = {"job_id": job_id, "kind": kind, "created_at": utc_now(), "created_ts": time.time(),
           "cwd": cwd, "raw_dir": str(raw), "session_id": sid or resume, "resume": resume,
           "fork": fork, "binary": binary, "model": launch["model"], "argv": argv,
           "argv_sha256": argv_fingerprint(argv), "limits": dict(limits), "prior": dict(prior),
           "meta": dict(meta), "env_extra": dict(env_extra or {}), "driver": driver,
           "prices": launch.get("prices") or None,
           "executor": launch.get("executor") or "local", "slurm": launch.get("slurm") or None,
           "gateway": launch.get("gateway") or GATEWAY_DEFAULT,
           "study_usd": (launch.get("budget") or {}).get("study_usd"),
           "unbounded_request_usd": (launch.get("budget") or {}).get("unbounded_request_usd"),
           "sandbox": launch.get("sandbox"),
           "system_prompt_sha256": sha256_bytes(system_prompt.encode()),
           "prompt_sha256": sha256_bytes(prompt.encode())}
    write_json_atomic(build / "job.json", job)
    # Marker first: an active marker whose job never appeared is removed by the reaper (under
    # this lock, a missing job directory is a creation that died).
    touch_marker(paths.active / job_id)
    fault_point("create_job_rename")
    try:
        os.rename(build, jdir)
    except OSError:
        remove_marker(paths.active / job_id)
        raise
    fsync_dir(paths.jobs)
    if marker is not None:
        write_text_atomic(marker, job_id)
    return job


def create_job(paths: StudyPaths, platform: "Platform", *, kind: str, prompt: str, cwd: str,
               launch: Mapping[str, Any], binary: str, system_prompt: str,
               session_id: str | None, resume: str | None, fork: bool,
               prior: Mapping[str, Any], limits: Mapping[str, Any], meta: Mapping[str, Any],
               env_extra: Mapping[str, str] | None = None, raw_dir: str | None = None,
               driver: Mapping[str, Any] | None = None, cap: int | None = None) -> JobRecord:
    """Register a job (under the registry lock) and return its record; launches nothing.

    The parallel cap is checked here, against the active markers, under the same lock that
    registers the job, so concurrent callers cannot overshoot it.
    """
    with RegistryLock(paths.lock, platform):
        refuse_at_parallel_cap(len(active_job_ids(paths)), cap)
        continues = meta.get("continues")
        marker = paths.job_dir(continues) / "continued_by" if continues else None
        if continues and existing_continuation(paths, continues):
            # A job is continued at most once: a repeated request for the same step is ignored.
            raise DuplicateRequest(existing_continuation(paths, continues))  # type: ignore[arg-type]
        reg = read_registry(paths)
        n = int(reg["next_job"])
        while paths.job_dir(f"j{n:06d}").exists():   # a directory a crash left behind
            n += 1
        job_id = f"j{n:06d}"
        # The counter is saved first: a crash from here on costs an id, never the ability to
        # create jobs.
        before = copy.deepcopy(reg)
        reg["next_job"] = n + 1
        reg["counts"]["created"] = int(reg["counts"].get("created", 0)) + 1
        write_json_atomic(paths.registry, reg)
        try:
            return _create_job_files(paths, job_id, kind=kind, prompt=prompt, cwd=cwd, launch=launch,
                                     binary=binary, system_prompt=system_prompt, session_id=session_id,
                                     resume=resume, fork=fork, prior=prior, limits=limits, meta=meta,
                                     env_extra=env_extra, raw_dir=raw_dir, driver=driver, marker=marker)
        except OSError:
            # A full disk or a file system turned read-only: the job was not made, so the
            # counter goes back (best effort: the old registry is no larger than the new one).
            shutil.rmtree(paths.jobs / f".{job_id}.creating", ignore_errors=True)
            with contextlib.suppress(OSError):
                write_json_atomic(paths.registry, before)
            raise


def _ledger_line(job: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    meta = job.get("meta") or {}
    usage = result.get("usage") or {}
    return {"job_id": job["job_id"], "kind": job.get("kind"), "run_id": meta.get("run_id"),
            "arm": meta.get("arm"), "task": meta.get("task"), "base": meta.get("base"),
            "label": meta.get("label"), "session_id": result.get("session_id"),
            "status": result["status"], "reason": result.get("reason"),
            "tokens": usage.get("tokens") or {k: 0 for k in TOKEN_KEYS},
            "models_used": usage.get("models_used") or [],
            "cost_total_usd": usage.get("cost_total_usd"),
            "cost_delta_usd": float(usage.get("cost_delta_usd") or 0.0),
            "cost_metered_usd": usage.get("cost_metered_usd"), "requests": usage.get("requests"),
            "models_metered": usage.get("models_metered"),
            "estimated": bool(usage.get("estimated")), "flags": result.get("flags") or [],
            "cache_verdict": result.get("cache_verdict"), "duration_s": result.get("duration_s"),
            "claude_version": result.get("claude_version"), "finished_at": result.get("finished_at")}


def _ledger_has(paths: StudyPaths, job_id: str) -> bool:
    records, _ = read_jsonl(paths.ledger)
    return any(r.get("job_id") == job_id for r in records)


def _complete_finalize(paths: StudyPaths, job: Mapping[str, Any], result: Mapping[str, Any],
                       check_ledger: bool) -> None:
    """Second half of finalisation, under the lock: ledger line once, markers, session record.

    `check_ledger` is set when reconciling a result whose ledger line may or may not have been
    written before a crash: the ledger is then searched (rare path) so the line is never doubled.
    """
    job_id = job["job_id"]
    jdir = paths.job_dir(job_id)
    if not (jdir / "ledgered").exists():
        if not (check_ledger and _ledger_has(paths, job_id)):
            append_jsonl(paths.ledger, _ledger_line(job, result))
        touch_marker(jdir / "ledgered")
    usage = result.get("usage") or {}
    sid = result.get("session_id")
    rec = session_record(paths, sid) if sid else {}
    # A late repair of an older job must not roll a session's totals back.
    if sid and usage.get("cost_total_usd") is not None and str(rec.get("last_job") or "") <= job_id:
        rec.update({"cost_total_usd": usage["cost_total_usd"], "model_usage": usage.get("model_usage") or {},
                    "last_job": job_id, "cwd": job.get("cwd"), "updated_at": utc_now()})
        if result.get("context_tokens"):
            rec["context_tokens"] = result["context_tokens"]
        write_json_atomic(paths.session_file(sid), rec)
    reg = read_registry(paths)
    if job_id in (reg.get("finalizing") or []):
        # Before the active marker goes: the reaper only looks at active jobs, and the
        # `ledgered` marker already prevents a second count.
        reg["finalizing"] = [j for j in reg["finalizing"] if j != job_id]
        write_json_atomic(paths.registry, reg)
    if (paths.active / job_id).exists():
        if not job.get("driver"):
            # Only jobs driven by hand await delivery through `wait`; a driver reads its own.
            touch_marker(paths.undelivered / job_id)
        remove_marker(paths.active / job_id)


def _count_job(reg: dict[str, Any], job_id: str, result: Mapping[str, Any]) -> None:
    """Apply a finished job to the registry counters (status counts, money spent, the breaker).

    The job is listed in `finalizing` in the same write, until its ledger line and markers are
    done: a repair after a crash can then tell whether the counters were applied.
    """
    usage = result.get("usage") or {}
    status, reason = result["status"], result.get("reason")
    reg["counts"][status] = int(reg["counts"].get(status, 0)) + 1
    # Both amounts were checked (finalize_job; registry_spent_usd), so the sum stays finite.
    reg["spent_usd"] = round(registry_spent_usd(reg) + spend_from(billed_cost_usd(usage)), 6)
    if reason in ("usage_limit", "auth"):
        reg["breaker"] = {"tripped_at": utc_now(), "reason": reason, "job_id": job_id}
    reg["finalizing"] = [j for j in reg.get("finalizing") or [] if j != job_id] + [job_id]


def finalize_job(paths: StudyPaths, platform: "Platform", job: Mapping[str, Any], *, status: str,
                 reason: str | None, usage: Mapping[str, Any] | None,
                 extra: Mapping[str, Any] | None = None) -> bool:
    """Record a job's end exactly once.  True if this call did it, False if it was already final.

    Under the registry lock: result.json is created exclusively (the once-only guard), then the
    counters, then the ledger line and markers.  A kill between those writes leaves a result with
    its active marker still set; reap_jobs() completes it later without doubling the ledger line.
    """
    assert status in JOB_FINAL_STATUSES, status
    job_id = job["job_id"]
    # A Slurm job's credentials file is deleted by its supervisor once read; one that never
    # started (cancelled in the queue, failed to start) leaves it, so the end of the job removes it.
    with contextlib.suppress(OSError):
        os.unlink(paths.job_dir(job_id) / "credentials.json")
    usage = dict(usage or {"tokens": {k: 0 for k in TOKEN_KEYS}, "models_used": [], "cost_total_usd": None,
                           "cost_delta_usd": 0.0, "estimated": False, "model_usage": {}, "flags": []})
    extra = dict(extra or {})
    flags = set(usage.pop("flags", []) or []) | set(extra.pop("flags", []) or [])
    anomalies = list(usage.pop("anomalies", []) or []) + list(extra.pop("anomalies", []) or [])
    # The last guard before the files: whatever still holds a non-finite float becomes null (an
    # anomaly), and the sums the registry keeps take only checked amounts.
    usage["cost_delta_usd"] = usd_from(usage.get("cost_delta_usd"), anomalies=anomalies,
                                       where="usage.cost_delta_usd") or 0.0
    usage["cost_total_usd"] = usd_from(usage.get("cost_total_usd"), anomalies=anomalies,
                                       where="usage.cost_total_usd")
    draft = {"job_id": job_id, "status": status, "reason": reason, "kind": job.get("kind"),
             "meta": job.get("meta") or {}, "session_id": job.get("session_id"),
             "finished_at": utc_now(), "usage": usage, **extra}
    result: ResultRecord = json_safe(draft, anomalies=anomalies)
    if anomalies:
        flags.add("anomalies")
        result["anomalies"] = anomalies[:MAX_ANOMALIES]
    result["flags"] = sorted(flags)
    with RegistryLock(paths.lock, platform):
        if not create_json_exclusive(paths.result_file(job_id), result, platform.rename_no_replace):
            return False
        fault_point("finalize_result")
        reg = read_registry(paths)
        _count_job(reg, job_id, result)
        write_json_atomic(paths.registry, reg)
        fault_point("finalize_counted")
        _complete_finalize(paths, job, result, check_ledger=False)
    append_event(paths, "job_finished", job_id=job_id, status=status, reason=reason,
                 run_id=(job.get("meta") or {}).get("run_id"), cost_usd=usage.get("cost_delta_usd"))
    return True


def finalize_killed_before_start(paths: StudyPaths, platform: "Platform", job: Mapping[str, Any],
                                 kill_req: Mapping[str, Any]) -> bool:
    """Record a job whose kill request came before its session started: `killed`, at no cost."""
    return finalize_job(paths, platform, job, status="killed",
                        reason=str(kill_req.get("reason") or "requested"),
                        usage=None, extra={"detail": "killed before its session started"})


#: Credentials this process was handed on its stdin (a detached run driver): passed on to the
#: supervisors it starts in the same way, never put in its environment.
HANDED_CREDENTIALS: dict[str, str] = {}


def launch_credentials(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The credentials a supervisor started from this process gets: the caller's own credential
    variables (in `env`, this process's environment unless given), and those this process was
    handed (see HANDED_CREDENTIALS)."""
    env = os.environ if env is None else env
    return {**{k: v for k, v in env.items() if is_credential_var(k)}, **HANDED_CREDENTIALS}


def read_stdin_credentials() -> dict[str, str]:
    """The credentials a detached parent wrote on this process's stdin ({"env": {...}})."""
    try:
        data = json.loads(sys.stdin.buffer.read(1 << 20) or b"{}")
    except (OSError, ValueError) as exc:
        log(f"credentials on stdin not used: {exc}")
        return {}
    got = data.get("env") if isinstance(data, dict) else None
    return {str(k): v for k, v in got.items() if isinstance(v, str)} if isinstance(got, dict) else {}


def launch_supervisor(paths: StudyPaths, platform: "Platform", job: Mapping[str, Any],
                      env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Start the supervisor of a registered job on its executor: detached here (local) or submitted
    to Slurm (its batch job runs the supervisor on a compute node).  `env` is the caller's
    environment (this process's unless given).  On failure the job is finalised `launch_error`, so
    a refused submission never leaves an active job behind."""
    env = os.environ if env is None else env
    executor = executor_for(job)
    # The supervisor's own environment holds no credential (/proc/<pid>/environ is readable by the
    # agent's user, and Slurm keeps a batch job's environment): the executor carries them apart.
    # A scripted-model job gets none at all.
    host_env = {k: v for k, v in env.items() if not is_credential_var(k)}
    secret = {} if (job.get("env_extra") or {}).get("AGENTBENCH_OFFLINE") == "1" else launch_credentials(env)
    try:
        record = executor.submit(platform, paths, job, env=host_env, secret=secret)
    except (OSError, AgentbenchError) as exc:
        # The job is registered already, so it is finalised now instead of staying active until reaped.
        finalize_job(paths, platform, job, status="failed", reason="launch_error",
                     usage=None, extra={"detail": executor.launch_error(exc)})
        return {"job_id": job["job_id"], "status": "failed", "reason": "launch_error"}
    jdir = paths.job_dir(job["job_id"])
    write_json_atomic(jdir / "launcher.json", record)
    if (jdir / "kill.request").exists():
        # A kill came while the submission was answering (sbatch): it found no job id to cancel,
        # so the submission is cancelled here.  (A kill after the record was written cancels it
        # itself; one of the two sees the other's write.)  A local supervisor reads the request.
        executor.cancel(platform, record, env)
    return {"job_id": job["job_id"], "status": "created", **executor.handle(record)}


def stream_state_from_file(path: str | os.PathLike[str]) -> StreamState:
    """Re-parse a raw stream copy (for a job whose supervisor died before finalising)."""
    st = StreamState()
    opened = open_regular(path)      # never through a link, never a FIFO
    if opened is not None:
        with os.fdopen(opened[0], "rb") as fh:
            for line in fh:
                st.feed(line)
    return st


def driver_record(platform: "Platform", paths: StudyPaths | None = None) -> dict[str, Any] | None:
    """This process as the driver of the jobs it starts: pid, creation time, host, and (with a
    study) the beat file it keeps fresh while it runs (see DriverBeat).  A pid is checked only on
    the host that recorded it; elsewhere the beat file's age says whether the driver lives."""
    me = platform.proc_id(os.getpid())
    if me is None:
        return None
    rec: dict[str, Any] = {**dataclasses.asdict(me), "host": platform.hostname()}
    if paths is not None:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{rec['host']}-{me.pid}-{int(me.ctime or 0)}")
        rec["beat"] = str(paths.state / "drivers" / f"{name}.beat")
    return rec


class DriverBeat:
    """While a driver runs, a thread touches its beat file every heartbeat_s().  Supervisors on
    other hosts (Slurm compute nodes) cannot check the driver's pid; a beat older than
    lost_after_s() tells them the driver is gone.  The file is removed when the driver ends."""

    def __init__(self, record: Mapping[str, Any] | None):
        self.path = Path(record["beat"]) if record and record.get("beat") else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _touch(self) -> None:
        assert self.path is not None
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()

    def __enter__(self) -> "DriverBeat":
        if self.path is not None:
            self._touch()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(heartbeat_s()):
            self._touch()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()


def driver_alive(platform: "Platform", driver: Mapping[str, Any]) -> bool | None:
    """Is a run driver still there?  On its own host by pid + creation time; elsewhere by the age
    of its beat file (a missing file = ended); None when neither can be checked."""
    if platform.is_local(driver):
        proc = proc_from_record(driver)
        return None if proc is None else platform.is_alive(proc)
    beat = driver.get("beat")
    if not beat:
        return None
    try:
        mtime = os.stat(beat).st_mtime
    except FileNotFoundError:
        return False
    except OSError:
        return None
    return mtime_age_s(mtime, os.path.dirname(beat), platform.hostname(), lost_after_s()) <= lost_after_s()


#: The environment variable that marks every process of a job's session (set by its supervisor):
#: a process that left the session and lost its parent is still found by it.
JOB_MARK_ENV = "AGENTBENCH_JOB_MARK"


def job_mark(paths: StudyPaths, job_id: str) -> str:
    """The mark of one job of one study (the study's path hashed: two studies never share one)."""
    return f"{job_id}.{sha256_bytes(str(paths.root.resolve()).encode())[:16]}"


def kill_job_processes(platform: "Platform", runtime: Mapping[str, Any] | None,
                       include_supervisor: bool, alive_until: float | None = None,
                       mark: str | None = None) -> list[ProcId]:
    """Kill a job's `claude` tree (and its supervisor if asked), and every process carrying the
    job's `mark` in its environment; return survivors (empty = clean)."""
    roots: list[ProcId] = []
    sids: list[int] = []
    if mark:
        roots += platform.marked_processes(JOB_MARK_ENV, mark)
    if runtime:
        claude = proc_from_record(runtime.get("claude"))
        if claude:
            roots.append(claude)
            sids.append(claude.pid)   # POSIX: its session (setsid); ignored where there are none
        sup = proc_from_record(runtime.get("supervisor"))
        if include_supervisor and sup:
            roots.insert(0, sup)
    if not roots:
        return []
    survivors = platform.kill_tree(roots, session_ids=sids, alive_until=alive_until)
    if mark:
        # Marked processes are judged by their mark, not by tree or time: any still alive is left.
        seen = {p.pid for p in survivors}
        survivors += [p for p in platform.marked_processes(JOB_MARK_ENV, mark) if p.pid not in seen]
    return survivors


def _usage_from_raw(job: Mapping[str, Any],
                    paths: StudyPaths | None = None) -> tuple[dict[str, Any], StreamState]:
    st = stream_state_from_file(os.path.join(job["raw_dir"], "stream.jsonl"))
    st.prices = job.get("prices")
    prior = job.get("prior") or {}
    usage = usage_record(st.result, st, prior_cost=usd_from(prior.get("cost_usd")) or 0.0,
                         prior_model_usage=prior.get("model_usage"), requested_model=job["model"])
    gw_log = paths.job_dir(job["job_id"]) / "gateway.jsonl" if paths is not None else None
    if gw_log is not None and gw_log.is_file():
        # A job whose supervisor died: what its gateway recorded before that still counts.
        usage.update(summarize_metering(read_jsonl(gw_log)[0]))
    usage["anomalies"] = list(st.anomalies) + list(usage.get("anomalies") or [])
    return usage, st


def supervisor_presence(platform: "Platform", runtime: Mapping[str, Any] | None,
                        launcher: Mapping[str, Any] | None,
                        env: Mapping[str, str] | None = None) -> bool | None:
    """Is the job's supervisor still there (or, before it started, its launch still pending)?

    True: alive, starting or queued; False: certainly gone; None: cannot tell (Slurm unreachable,
    or a process recorded on another host), which callers must treat as alive.  Its executor
    answers (see Executor.presence): Slurm jobs are asked of Slurm, whose word covers queued jobs
    that have no process yet; local ones by pid + creation time, only on the host that recorded
    them.  `env` is the caller's environment (this process's unless given).
    """
    return executor_for(launcher).presence(platform, runtime, launcher, os.environ if env is None else env)


def reap_verdict(*, started: bool, age_s: float, lost_after: float,
                 presence: Callable[[], bool | None]) -> str:
    """What the reaper does with an active job that has no result yet (pure; `presence` is asked
    only when the answer depends on it, since asking Slurm costs a call):

    - "keep": its heartbeat (or, before it started, its creation) is recent enough, or its
      supervisor is still there; "cannot tell" protects a started job for UNKNOWN_LOSS_FACTOR loss
      windows (a supervisor heartbeats every few seconds wherever it runs) and a not-started one
      for as long as it lasts (a Slurm job may queue for hours);
    - "lost": started, its heartbeat stale and its supervisor gone;
    - "never_started": no runtime, old, and its launch certainly gone (see never_started_verdict).
    """
    if age_s <= lost_after:
        return "keep"
    there = presence()
    if started:
        if there is True or (there is None and age_s <= lost_after * UNKNOWN_LOSS_FACTOR):
            return "keep"
        return "lost"
    return "keep" if there is not False else "never_started"


def never_started_verdict(*, kill_requested: bool, claimed: bool,
                          slurm_job: str | None) -> tuple[str, str | None]:
    """How a job whose supervisor never ran is finalised (pure): a kill that came first is a kill,
    anything else a launch error with the detail the user needs."""
    if kill_requested:
        # Killed before it started (a queued Slurm job whose cancel was not confirmed, which then
        # started and stopped at the kill request): a kill, not a launch failure.
        return "killed", None
    if claimed:
        # Claimed but no runtime yet: the supervisor died between its first two writes.
        return "launch_error", "the supervisor died as it started"
    if slurm_job:
        return "launch_error", f"the slurm job {slurm_job} ended without starting the supervisor"
    return "launch_error", "the supervisor never started"


def reap_jobs(paths: StudyPaths, platform: "Platform", only: Iterable[str] | None = None,
              env: Mapping[str, str] | None = None) -> list[str]:
    """Repair pass over active jobs: complete half-finalised ones, declare dead ones `lost`.

    Lost = heartbeat older than lost_after_s() AND the supervisor certainly gone (pid + creation
    time, or Slurm's word for a submitted job); its `claude` tree is killed where it ran on this
    host (children counted only if created before the last heartbeat) and the cost taken from the
    raw stream copy (estimated if no result arrived).  A Slurm job that is still queued is never
    lost, however long it waits.  Cost: O(active jobs); Slurm is asked only about jobs whose
    heartbeat is stale or that have waited past the loss window without starting.  `env` is the
    caller's environment (this process's unless given).
    """
    env = os.environ if env is None else env
    reaped: list[str] = []
    ids = list(only) if only is not None else active_job_ids(paths)
    now = time.time()
    for job_id in ids:
        if not (paths.active / job_id).exists():
            continue
        job = read_json(paths.job_file(job_id), default=None)
        if job is None:
            with RegistryLock(paths.lock, platform):
                # Jobs are created whole under this lock: holding it, a marker without its job
                # is a creation killed half-way, never one in progress.
                if not paths.job_file(job_id).exists():
                    remove_marker(paths.active / job_id)
                    reaped.append(job_id)
            continue
        res = read_json(paths.result_file(job_id), default=None)
        if res is not None:
            with RegistryLock(paths.lock, platform):
                if (paths.active / job_id).exists():
                    reg = read_registry(paths)
                    if (job_id not in (reg.get("finalizing") or [])
                            and not (paths.job_dir(job_id) / "ledgered").exists()):
                        _count_job(reg, job_id, res)     # the crash came before the counters
                        write_json_atomic(paths.registry, reg)
                    _complete_finalize(paths, job, res, check_ledger=True)
            reaped.append(job_id)
            continue
        rt = read_json(paths.runtime_file(job_id), default=None)
        launcher = read_launcher(paths, job_id)
        executor = executor_for(launcher)
        handle = executor.job_of(launcher)
        if rt is not None:
            hb = float(rt.get("heartbeat_at") or job.get("created_ts") or 0)
            age = now - hb
            if not platform.is_local(rt):
                # Stamped by another host's clock: the runtime file's mtime, which the file server
                # stamps, is judged on the file system's clock instead.
                with contextlib.suppress(OSError):
                    # (The clock probe lives in the state dir: one per study, on the same file system.)
                    age = mtime_age_s(os.stat(paths.runtime_file(job_id)).st_mtime, paths.state,
                                      platform.hostname(), lost_after_s())
            if reap_verdict(started=True, age_s=age, lost_after=lost_after_s(),
                            presence=lambda: executor.presence(platform, rt, launcher, env)) == "keep":
                continue
            local_rt = rt if platform.is_local(rt) else None
            survivors = kill_job_processes(platform, local_rt, include_supervisor=False, alive_until=hb,
                                           mark=job_mark(paths, job_id) if local_rt is not None else None)
            usage, st = _usage_from_raw(job, paths)
            finalize_job(paths, platform, job, status="lost", reason="supervisor_dead", usage=usage,
                         extra={"survivors": [dataclasses.asdict(s) for s in survivors],
                                "last_heartbeat": hb, "tool_uses": st.tool_uses,
                                **({"slurm_job_id": handle} if handle else {})})
            reaped.append(job_id)
            continue
        created = float(job.get("created_ts") or 0)
        if reap_verdict(started=False, age_s=now - created, lost_after=lost_after_s(),
                        presence=lambda: executor.presence(platform, None, launcher, env)) == "keep":
            continue
        kill_req = read_json(paths.job_dir(job_id) / "kill.request", default=None)
        verdict, detail = never_started_verdict(kill_requested=kill_req is not None,
                                                claimed=(paths.job_dir(job_id) / "supervisor.claim").exists(),
                                                slurm_job=handle)
        if verdict == "killed":
            finalize_killed_before_start(paths, platform, job, kill_req)
            reaped.append(job_id)
            continue
        log_tail = ""
        with contextlib.suppress(OSError):
            log_tail = Path(job["raw_dir"], "supervisor.log").read_text(encoding="utf-8",
                                                                        errors="replace")[-400:]
        finalize_job(paths, platform, job, status="failed", reason="launch_error", usage=None,
                     extra={"detail": detail, **({"log_tail": log_tail} if log_tail else {})})
        reaped.append(job_id)
    return reaped


def _wait_final(paths: StudyPaths, job_id: str, seconds: float) -> bool:
    """Wait up to `seconds` for the job to be final; whether it is."""
    deadline = time.monotonic() + seconds
    while not job_is_final(paths, job_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


#: The actions of a kill's last stage (kill_step): once one is taken, the supervisor is no longer
#: asked or cancelled, only made sure of.
KILL_FINISH_ACTIONS = ("await_exit", "ask_slurm", "stop_supervisor", "kill_and_finalise", "verify")


@dataclass(frozen=True)
class KillFacts:
    """What a kill knows of its job before a step (observed afresh before every one)."""
    result: bool                      # result.json exists
    final: bool                       # finalisation complete (job_is_final)
    slurm_job: str | None             # the Slurm job id the launch record names, if any
    runtime: bool                     # runtime.json exists, wherever it was written
    runtime_here: bool                # ... and was written on this host (its pids mean something)
    supervisor: str | None            # a supervisor process known here: "runtime", "launcher", None
    wait_s: float                     # how long the caller lets the supervisor answer the request
    done: tuple[str, ...] = ()        # the actions taken so far, in order
    slurm_state: str | None = None    # Slurm's fresh word once "ask_slurm" is done (None: no answer)


class KillAction(NamedTuple):
    """The next step of a kill; after acting, wait up to `wait_s` for the job to be final."""
    name: str
    wait_s: float | None = None


def kill_step(f: KillFacts) -> KillAction:
    """The next step of a kill (pure).  The actions, in the order they can come:

    already_final (report, terminal) | request (write kill.request) | cancel_queued (a submission
    still queued: scancel it, a short wait) or wait (for the supervisor to answer) | then, by the
    launch record as it is after the wait: cancel_queued_late (an id recorded during the wait, still
    queued) | cancel_started (the supervisor did not answer: Slurm signals it) | await_exit (it
    finalised: make sure it exits) | unless a result exists: ask_slurm, then unverified (terminal:
    nothing here can check the job and Slurm does not confirm its end) | stop_supervisor (one still
    starting, known only by its launch record) | kill_and_finalise | verify | report (terminal).
    """
    done = set(f.done)
    if "request" not in done:
        return KillAction("already_final") if f.result else KillAction("request")
    if not done & {"cancel_queued", "wait"}:
        if f.slurm_job is not None and not f.runtime:
            # Queued, not started: there is no supervisor to ask, so the submission is cancelled.
            # One that starts regardless sees kill.request and exits without starting claude.
            return KillAction("cancel_queued", min(f.wait_s, 2.0))
        return KillAction("wait", f.wait_s)
    if not done & set(KILL_FINISH_ACTIONS):
        # The launch may have been recorded meanwhile (a supervisor just detached, an sbatch that
        # answered): what follows goes by the record as it is now.
        if (f.slurm_job is not None and not done & {"cancel_queued", "cancel_queued_late"}
                and not f.final and not f.runtime):
            # Still queued: cancelled here.  One that started is handled below like any other.
            return KillAction("cancel_queued_late", 2.0)
        if f.slurm_job is not None and f.runtime and not f.final and "cancel_started" not in done:
            # The supervisor did not answer the request: Slurm signals it (SIGTERM, then SIGKILL
            # after KillWait) wherever it runs; its handler stops claude and finalises.
            return KillAction("cancel_started", 15.0 if "cancel_queued" in done else max(f.wait_s, 15.0))
        if f.final and f.supervisor is not None:
            # The supervisor finalised; give it a moment to exit, then make sure it is gone.
            return KillAction("await_exit")
    finishing = done & {"ask_slurm", "stop_supervisor"}
    if not done & {"kill_and_finalise", "verify"} and (not f.result or finishing):
        if f.slurm_job is not None and not f.runtime_here:
            # Nothing of the job can be checked from here: only Slurm can say that it ended.
            # Until it does, the job is not finalised (a session still spending must not be
            # recorded as killed, nor its later costs lost).
            if "ask_slurm" not in done:
                return KillAction("ask_slurm")
            if f.slurm_state is None or f.slurm_state in SLURM_LIVE_STATES:
                return KillAction("unverified")
        if not f.runtime_here and f.supervisor is not None and "stop_supervisor" not in done:
            # A supervisor still starting did not answer the request in time: it is stopped
            # before anything else, so it cannot start claude after this point; whatever it did
            # start is then in the runtime file, read again.
            return KillAction("stop_supervisor")
        return KillAction("kill_and_finalise")
    if "verify" not in done:
        # Nothing of the claude tree may be left, whoever did the killing.
        return KillAction("verify")
    return KillAction("report")


class KillView(NamedTuple):
    """One observation of a killed job: the facts for kill_step and the records they came from."""
    facts: KillFacts
    runtime: dict[str, Any] | None    # the runtime record, only if it was written on this host
    launcher: LauncherRecord | None
    supervisor: ProcId | None


def observe_kill(paths: StudyPaths, platform: "Platform", job_id: str, *, wait_s: float,
                 done: Sequence[str], slurm_state: str | None) -> KillView:
    """Read what a kill's next step depends on (the job's files; no process is signalled)."""
    launcher = read_launcher(paths, job_id)
    executor = executor_for(launcher)
    rt = read_json(paths.runtime_file(job_id), default=None)
    # Processes are killed by pid only on the host that recorded them.
    rt_here = rt if rt is not None and platform.is_local(rt) else None
    sup, where = proc_from_record((rt_here or {}).get("supervisor")), "runtime"
    if sup is None and rt_here is None and platform.is_local(launcher):
        # Killed before its supervisor wrote runtime.json: the detached process the launcher
        # recorded is the supervisor, and it must be gone too (only with its creation time).
        sup, where = executor.process_of(launcher), "launcher"
    facts = KillFacts(result=paths.result_file(job_id).exists(), final=job_is_final(paths, job_id),
                      slurm_job=executor.job_of(launcher), runtime=rt is not None,
                      runtime_here=rt_here is not None, supervisor=where if sup is not None else None,
                      wait_s=wait_s, done=tuple(done), slurm_state=slurm_state)
    return KillView(facts, rt_here, launcher, sup)


def kill_job(paths: StudyPaths, platform: "Platform", job_id: str, reason: str = "requested",
             wait_s: float = 10.0, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Kill a job: ask its supervisor (kill.request), and if it does not finish in `wait_s`, kill
    the supervisor and the `claude` tree directly and finalise as `killed`.  Verify; report survivors.
    Observes, asks kill_step what to do next, acts, until a step reports.  `env` is the caller's
    environment (this process's unless given)."""
    env = os.environ if env is None else env
    job = load_job(paths, job_id)
    done: list[str] = []
    slurm_state: str | None = None
    survivors: list[ProcId] = []
    while True:
        view = observe_kill(paths, platform, job_id, wait_s=wait_s, done=done, slurm_state=slurm_state)
        action = kill_step(view.facts)
        executor, rt, sup = executor_for(view.launcher), view.runtime, view.supervisor
        if action.name == "already_final":
            res = read_json(paths.result_file(job_id))
            return {"job_id": job_id, "status": res["status"], "already_final": True, "survivors": []}
        if action.name == "request":
            write_json_atomic(paths.job_dir(job_id) / "kill.request", {"reason": reason, "at": utc_now()})
        elif action.name in ("cancel_queued", "cancel_queued_late", "cancel_started"):
            executor.cancel(platform, view.launcher, env)
        elif action.name == "await_exit" and sup is not None:
            until = time.monotonic() + 5
            while time.monotonic() < until and platform.is_alive(sup):
                time.sleep(0.05)
            if platform.is_alive(sup):
                survivors += platform.kill_tree([sup])
        elif action.name == "ask_slurm":
            slurm_state = executor.state(platform, view.launcher, env, fresh=True)
        elif action.name == "unverified":
            sjid = view.facts.slurm_job
            return {"job_id": job_id, "status": "killing", "unverified": True, "slurm_job_id": sjid,
                    "slurm_state": slurm_state, "survivors": [],
                    "hint": f"scancel was sent but Slurm has not confirmed that job {sjid} ended; "
                            "run kill again, or check `squeue -j` and `scancel` by hand"}
        elif action.name == "stop_supervisor" and sup is not None:
            survivors += platform.kill_tree([sup])
        elif action.name == "kill_and_finalise":
            survivors += kill_job_processes(platform, rt, include_supervisor=True,
                                            mark=job_mark(paths, job_id) if rt is not None else None)
            usage, _ = _usage_from_raw(job, paths)
            finalize_job(paths, platform, job, status="killed", reason=reason, usage=usage,
                         extra={"killed_by": "kill command"})
        elif action.name == "verify":
            survivors += kill_job_processes(platform, rt, include_supervisor=False,
                                            mark=job_mark(paths, job_id) if rt is not None else None)
        elif action.name == "report":
            res = read_json(paths.result_file(job_id))
            # What the supervisor's own sweep could not kill (it found them; this process may not
            # be able to see them by tree): reported while they live, never hidden behind `clean`.
            for rec in res.get("survivors") or []:
                p = proc_from_record(rec) if isinstance(rec, dict) else None
                if p is not None and platform.is_local(rt or view.launcher) and platform.is_alive(p):
                    survivors.append(p)
            return {"job_id": job_id, "status": res["status"], "reason": res.get("reason"),
                    "survivors": sorted({dataclasses.asdict(s)["pid"] for s in survivors})}
        done.append(action.name)
        if action.wait_s is not None:
            _wait_final(paths, job_id, action.wait_s)


# ==================================================================================================
# The supervisor process: one job's `claude` run to its end
# ==================================================================================================
# The detached supervisor (`_supervise`, internal) is the only writer of its job's runtime.json.  It
# feeds the prompt on stdin and closes it, copies every stdout line to raw/stream.jsonl and parses it,
# heartbeats, and enforces the wall-time limit (monotonic clock: suspends and clock jumps excluded),
# the stall flag, the orphan watchdog, model substitution, the budget backstop, injected interrupts
# and kill requests.  After `claude` exits it sweeps leftover descendants, then finalises the job
# through the jobs section.  Must not register jobs or decide what a session is for.


class Supervisor:
    """Runs one job's `claude` process to its end and finalises the job.  One instance per process."""

    POLL_S = 0.1
    #: The live workspace cap (limits' workspace_max_bytes) is measured this often (seconds): one
    #: lstat per entry, so not on every poll.
    WORKSPACE_MEASURE_S = 3.0

    def __init__(self, paths: StudyPaths, job_id: str, platform: "Platform"):
        self.paths = paths
        self.platform = platform
        self.job = load_job(paths, job_id)
        self.job_id = job_id
        self.limits = self.job.get("limits") or {}
        self.state = StreamState()
        self.state.prices = self.job.get("prices")
        self.last_output = time.monotonic()
        self.started = time.monotonic()
        self.runtime: RuntimeRecord = {}   # type: ignore[typeddict-item]  # filled by the first write
        self.end: tuple[str, str | None] | None = None
        self.flags: set[str] = set()
        self.snapshots_done: list[int] = []
        #: When the live workspace cap is next measured (monotonic; None: at the first poll).
        self.workspace_next_measure: float | None = None
        self.terminate_requested = False
        self.sandbox: dict[str, Any] | None = None   # what resolve_sandbox gave this session
        self._seccomp_fd: int | None = None   # the filter's pipe, until bwrap has read it
        self._lock = threading.Lock()
        #: Credentials handed over by the launcher (stdin pipe or Slurm file); never in os.environ.
        self.secret: dict[str, str] = {}
        self.gateway: MeteringGateway | None = None
        # Set by the steps of _run as they happen (None until then).
        self.me: ProcId | None = None                 # this supervisor's own identity
        self.subreaper = False                        # orphans of the session are adopted here
        self._proc: subprocess.Popen[bytes] | None = None
        self._claude: ProcId | None = None
        self._stderr_fh: Any = None
        self._reader_thread: threading.Thread | None = None
        self._raw_out: Any = None                     # the reader's raw copy, flushed by each poll
        self._raw_dirty = False
        self._driver_checked = 0.0
        self._beat_seen: tuple[int, float] | None = None

    # -- runtime file (this process is its only writer) --------------------------------------------
    def _write_runtime(self, **changes: Any) -> None:
        self.runtime.update(changes)
        self.runtime["heartbeat_at"] = time.time()
        self.runtime["elapsed_s"] = round(time.monotonic() - self.started, 3)
        with contextlib.suppress(OSError):
            write_json_atomic(self.paths.runtime_file(self.job_id), self.runtime)

    def _reader(self, stream: Any, raw_path: Path) -> None:
        """Copy and parse claude's stdout to its end.  It cannot die on input (feed() never
        raises) nor on a full disk (the copy stops, flagged, while the parsing goes on): a dead
        reader would leave the pipe full and the session hung until its wall limit.  The raw file
        is flushed by every poll (_flush_raw) and every RAW_FLUSH_LINES lines of a burst, not once
        per line: what claude wrote is on disk within a poll interval."""
        raw: Any = None
        with contextlib.suppress(OSError):
            raw = open(raw_path, "ab")
        if raw is None:
            self.flags.add("raw_copy_failed")
        self._raw_out, pending = raw, 0
        try:
            for line in iter(stream.readline, b""):
                if raw is not None:
                    try:
                        raw.write(line)
                        pending += 1
                        self._raw_dirty = True
                        if pending >= RAW_FLUSH_LINES:
                            raw.flush()
                            pending = 0
                    except (OSError, ValueError):
                        self.flags.add("raw_copy_failed")
                        self._raw_out = None
                        with contextlib.suppress(OSError, ValueError):
                            raw.close()
                        raw = None
                with self._lock:
                    self.last_output = time.monotonic()
                    self.state.feed(line)
        finally:
            if raw is not None:
                with contextlib.suppress(OSError, ValueError):
                    raw.close()

    def _stop(self, proc: subprocess.Popen[bytes], claude: ProcId | None, status: str,
              reason: str | None) -> None:
        if self.end is None:
            self.end = (status, reason)
            log(f"{self.job_id}: stopping claude ({status}/{reason})")
        if claude:
            self.platform.kill_tree([claude], session_ids=[proc.pid])

    def _flush_raw(self) -> None:
        """Flush what the reader wrote to the raw file since the last poll (the writer object is
        thread-safe; once the reader has closed it there is nothing left to flush)."""
        raw = self._raw_out
        if raw is not None and self._raw_dirty:
            self._raw_dirty = False
            with contextlib.suppress(ValueError, OSError):
                raw.flush()

    def _check(self, proc: subprocess.Popen[bytes], claude: ProcId | None) -> None:
        self._flush_raw()
        lim = self.limits
        elapsed = time.monotonic() - self.started
        kill_req = read_json(self.paths.job_dir(self.job_id) / "kill.request", default=None)
        if kill_req is None and self.terminate_requested:
            kill_req = {"reason": "supervisor_terminated"}
        if kill_req is not None:
            self._stop(proc, claude, "killed", str(kill_req.get("reason") or "requested"))
            return
        wall = lim.get("wall_s")
        if wall and elapsed > float(wall):
            self._stop(proc, claude, "timeout", "wall_time")
            return
        with self._lock:
            silent = time.monotonic() - self.last_output
            models = list(self.state.models)
            tool_results = self.state.tool_results
            est = self.state.estimated_cost(self.job["model"])
        stall = lim.get("stall_after_s")
        if stall and silent > float(stall) and not self.runtime.get("stalled"):
            self.flags.add("stalled")
            self._write_runtime(stalled=True, stalled_at=utc_now())
            append_event(self.paths, "stalled", job_id=self.job_id, silent_s=round(silent, 1))
        elif stall and silent <= float(stall) and self.runtime.get("stalled"):
            self._write_runtime(stalled=False)
        requested = str(self.job["model"])
        gw = self.gateway
        if gw is not None:
            # The wire, not the stream: any process of the session can print an assistant event
            # naming another model.  Only an answer the gateway carried shows a substitution.
            substituted = claim_corroboration("model_refused", list(gw.records), requested) == "corroborated"
        else:
            substituted = any(not model_matches(requested, m) for m in models)
        if substituted:
            self.flags.add("model_substituted")
            self._stop(proc, claude, "failed", "model_refused")
            return
        if gw is not None and gw.cutoff is not None:
            self._stop(proc, claude, "failed", "budget")   # its gateway cut the answers at a cap
            return
        budget = lim.get("max_budget_usd")
        if budget is not None and est > float(budget) * BUDGET_BACKSTOP_FACTOR + BUDGET_BACKSTOP_PAD_USD:
            self._stop(proc, claude, "failed", "budget")
            return
        # An injected interrupt counts tools that RAN (their results), not tool calls requested:
        # the N-th tool has then certainly executed, whatever the polling moment.
        n = lim.get("interrupt_after_tool_uses")
        if n and tool_results >= int(n):
            self.flags.add("fault_interrupt")
            self._stop(proc, claude, "killed", "fault_interrupt")
            return
        if self._workspace_over_cap():
            self._stop(proc, claude, "failed", "workspace_over_cap")
            return
        orphan = lim.get("orphan_after_s")
        if orphan and self._orphaned(float(orphan)):
            self._stop(proc, claude, "killed", "orphaned")
            return
        if self._driver_lost():
            self._stop(proc, claude, "killed", "driver_lost")
            return
        # Snapshot times count from the start of the run (offset: the run's time before this job).
        run_elapsed = elapsed + float(lim.get("snapshot_offset_s") or 0)
        for t in lim.get("snapshot_seconds") or []:
            if run_elapsed >= float(t) and int(t) not in self.snapshots_done:
                self.snapshots_done.append(int(t))
                self._snapshot(int(t))

    def _workspace_over_cap(self) -> bool:
        """The live workspace cap: every WORKSPACE_MEASURE_S, the real blocks under the session's
        cwd (links not followed) against limits' workspace_max_bytes; over it is the agent's doing."""
        cap = self.limits.get("workspace_max_bytes")
        now = time.monotonic()
        if not cap or (self.workspace_next_measure is not None and now < self.workspace_next_measure):
            return False
        used = tree_usage(self.job["cwd"], int(cap))
        # The next measure: in WORKSPACE_MEASURE_S, or later for a tree so large that one walk
        # takes a noticeable time (never more than a twentieth of the poll thread's time).
        took = time.monotonic() - now
        self.workspace_next_measure = time.monotonic() + max(self.WORKSPACE_MEASURE_S, 20 * took)
        if used <= int(cap):
            return False
        self.flags.add("workspace_over_cap")
        append_event(self.paths, "workspace_over_cap", job_id=self.job_id, bytes=used, cap=int(cap))
        return True

    def _driver_lost(self) -> bool:
        """A job started by a `run` driver stops when that driver is gone (checked every ~2 s):
        nobody would read its result, and it must not go on spending."""
        driver = self.job.get("driver")
        if not driver or time.monotonic() - self._driver_checked < 2.0:
            return False
        self._driver_checked = time.monotonic()
        if self.platform.is_local(driver):
            return driver_alive(self.platform, driver) is False
        return self._remote_driver_silent(driver)

    def _remote_driver_silent(self, driver: Mapping[str, Any]) -> bool:
        """A driver on another host (this supervisor runs on a Slurm compute node) is gone when its
        beat file disappears or stops changing for lost_after_s() -- measured on this host's own
        monotonic clock, so a clock difference between the hosts cannot fake an age."""
        beat = driver.get("beat")
        if not beat:
            return False
        try:
            mtime = os.stat(beat).st_mtime_ns
        except FileNotFoundError:
            return True
        except OSError:
            return False
        now = time.monotonic()
        seen = self._beat_seen
        if seen is None or seen[0] != mtime:
            self._beat_seen = (mtime, now)
            return False
        return now - seen[1] > lost_after_s()

    def _orphaned(self, orphan_after: float) -> bool:
        driver = self.job.get("driver")
        if driver and driver_alive(self.platform, driver) is not False:
            return False
        try:
            last = os.stat(self.paths.last_call).st_mtime
        except FileNotFoundError:
            last = float(self.job.get("created_ts") or time.time())
        last = max(last, float(self.job.get("created_ts") or 0))
        return mtime_age_s(last, self.paths.state, self.platform.hostname(), orphan_after) > orphan_after

    def _snapshot(self, t: int) -> None:
        """A graded snapshot: a copy of the workspace (without .git) outside the agent's view."""
        dst = Path(self.limits.get("snapshot_dir") or Path(self.job["raw_dir"]) / "snapshots") / f"t{t:06d}"
        if dst.exists():
            return
        lim = self.limits
        caps = CopyCaps(lim.get("copy_file_bytes"), lim.get("copy_total_bytes"))
        try:
            copied = safe_copy_tree(self.job["cwd"], dst, caps)
        except (OSError, UnusableTree) as exc:
            # No partial snapshot is left to be graded: the run's own end says what the workspace was.
            shutil.rmtree(dst, ignore_errors=True)
            append_event(self.paths, "snapshot_refused", job_id=self.job_id, t=t,
                         why=getattr(exc, "why", None) or f"{type(exc).__name__}: {exc}"[:300])
            return
        append_event(self.paths, "snapshot", job_id=self.job_id, t=t, path=str(dst), bytes=copied["bytes"])

    def run(self) -> int:
        """Run the job; a supervisor that fails anyway kills its claude tree and finalises the
        job `failed`/`supervisor_error` at once, rather than leave it for the reaper."""
        try:
            return self._run()
        except Exception as exc:
            return self._fail_safe(exc)

    def _fail_safe(self, exc: BaseException) -> int:
        log(f"{self.job_id}: supervisor error: {type(exc).__name__}: {exc}")
        claude, proc = self._claude, self._proc
        survivors: list[ProcId] = []
        with contextlib.suppress(Exception):
            if claude is not None:
                survivors = self.platform.kill_tree([claude], session_ids=[proc.pid] if proc else [])
        usage = None
        with contextlib.suppress(Exception):
            prior = self.job.get("prior") or {}
            usage = usage_record(self.state.result, self.state,
                                 prior_cost=usd_from(prior.get("cost_usd")) or 0.0,
                                 prior_model_usage=prior.get("model_usage"),
                                 requested_model=str(self.job["model"]))
        try:
            finalize_job(self.paths, self.platform, self.job, status="failed", reason="supervisor_error",
                         usage=usage,
                         extra={"detail": f"supervisor error: {type(exc).__name__}: {exc}"[:2000],
                                "survivors": [dataclasses.asdict(s) for s in survivors],
                                "flags": sorted(self.flags | {"supervisor_error"})})
        except Exception as exc2:  # the reaper is the last resort (a lock held for an hour, a full disk)
            log(f"{self.job_id}: could not finalise after a supervisor error: {exc2}")
            return 1
        return 0

    def _run(self) -> int:
        """The job's steps, in order: claim it, prepare the launch, spawn `claude` and poll it to
        its end, sweep what it left, finalise.  A step that finalises the job itself (a job
        already final or killed before it started, a gateway or sandbox that cannot start)
        answers None and the job ends there."""
        if not self._claim():
            return 0
        launch = self._prepare()
        if launch is None:
            return 0
        argv, env, prompt = launch
        proc = self._spawn(argv, env)
        if proc is None:
            return 0
        self._poll(proc, prompt)
        survivors = self._sweep(proc)
        self._finish(proc.returncode, survivors)
        if self.gateway is not None and self.gateway.budget is not None:
            self.gateway.budget.discard()   # the ledger line counts this job's cost from now on
        return 0

    def _claim(self) -> bool:
        """One supervisor per job, once: never start claude for a job that is final, was killed
        before it started, or already has a live supervisor.  True: this process runs the job."""
        jdir = self.paths.job_dir(self.job_id)
        if self.paths.result_file(self.job_id).exists():
            return False
        try:
            # The claim is atomic and permanent: a second supervisor never starts claude again.
            os.close(os.open(jdir / "supervisor.claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        kill_req = read_json(jdir / "kill.request", default=None)
        if kill_req is not None:
            # Killed before it started: record that now (once-only, whoever else is finalising),
            # so that `kill` and `wait` need not wait for a supervisor that will never write a
            # runtime, nor for the reaper.
            finalize_killed_before_start(self.paths, self.platform, self.job, kill_req)
            return False
        return True

    def _prepare(self) -> tuple[list[str], dict[str, str], bytes] | None:
        """The runtime record, the gateway, `claude`'s environment and the (sandboxed) argv.
        None when the job could not be prepared and has been finalised `launch_error` or
        `sandbox_unavailable`."""
        job = self.job
        jdir = self.paths.job_dir(self.job_id)
        self.me = self.platform.proc_id(os.getpid())
        # Orphans of the session (a backgrounded `nohup ... &` in a new session, a double fork)
        # are adopted by this process instead of init, so the sweep below still finds them.
        self.subreaper = self.platform.become_subreaper()
        Path(job["raw_dir"]).mkdir(parents=True, exist_ok=True)
        # This process's environment, read once here where the supervisor starts.
        environ = dict(os.environ)
        self._write_runtime(status="running", supervisor=dataclasses.asdict(self.me) if self.me else None,
                            subreaper=self.subreaper,
                            host=self.platform.hostname(), slurm_job_id=environ.get("SLURM_JOB_ID"),
                            started_at=utc_now(), started_ts=time.time(), session_id=job.get("session_id"))
        extra = job.get("env_extra") or {}
        # Offline (scripted model) jobs get no real credentials: only the dummy key in `extra`.
        offline = extra.get("AGENTBENCH_OFFLINE") == "1"
        host = {k: v for k, v in environ.items() if not is_credential_var(k)}
        secret = {} if offline else {**{k: v for k, v in environ.items() if is_credential_var(k)},
                                     **self.secret}
        if job.get("gateway", GATEWAY_DEFAULT) == "on":
            try:
                self.gateway = start_job_gateway(self.paths, self.platform, job, secret, extra, host)
            except (AgentbenchError, OSError) as exc:
                detail = exc.one_line() if isinstance(exc, AgentbenchError) else str(exc)
                finalize_job(self.paths, self.platform, job, status="failed", reason="launch_error",
                             usage=None, extra={"detail": f"cannot start the gateway: {detail}"})
                return None
            env, _ = claude_env(host, extra=extra, gateway=self.gateway.claude_vars(), binary=job["binary"])
            self._write_runtime(gateway=self.gateway.url)
        else:
            env, _ = claude_env(host, extra=extra, gateway=None, secret=secret, binary=job["binary"])
        env[JOB_MARK_ENV] = job_mark(self.paths, self.job_id)
        prompt = (jdir / "prompt.txt").read_bytes()
        argv = list(job["argv"])
        try:
            # Decided again where this supervisor runs (a Slurm compute node decides here only).
            sandbox = resolve_sandbox(str((job.get("sandbox") or {}).get("mode") or sandbox_default()))
        except AgentbenchError as exc:
            if self.gateway is not None:
                self.gateway.stop(wait_s=0)
            finalize_job(self.paths, self.platform, job, status="failed", reason="sandbox_unavailable",
                         usage=None, extra={"detail": exc.one_line()})
            return None
        # The network the launch decided (network_open_arms); without a gateway, the host's.
        asked = job.get("sandbox") or {}
        if self.gateway is None:
            network, why = session_network([], None, "off")
        elif asked.get("network") in SESSION_NETWORKS:
            network, why = str(asked["network"]), asked.get("network_reason")
        else:
            network, why = "gateway", None
        self.sandbox = sandbox_record(sandbox, network, why)
        if sandbox["kind"] == "bwrap":
            try:
                sock = self.gateway.listen_unix() if network == "gateway" and self.gateway else None
                self._seccomp_fd = seccomp_fd()
            except OSError as exc:
                if self.gateway is not None:
                    self.gateway.stop(wait_s=0)
                finalize_job(self.paths, self.platform, job, status="failed", reason="launch_error",
                             usage=None, extra={"detail": f"cannot prepare the sandbox: {exc}"})
                return None
            argv, env = session_sandbox(sandbox["binary"], argv, env, cwd=job["cwd"],
                                        hidden=study_hidden_dirs(self.paths.root),
                                        private_home=str(jdir / "home"),
                                        project_dir=str(claude_projects_dir(env)
                                                        / transcript_dir_name(os.path.realpath(job["cwd"]))),
                                        ro=[str(jdir / "system_prompt.md"), str(jdir / "mcp.json")],
                                        network=network, gateway_socket=sock, seccomp=self._seccomp_fd)
        return argv, env, prompt

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Start `claude` (inside its sandbox when there is one) with stdout piped to the reader.
        None when it could not start: the job is then finalised `launch_error`."""
        job = self.job
        self._stderr_fh = open(Path(job["raw_dir"]) / "stderr.txt", "ab")
        kwargs = self.platform.tree_popen_kwargs()
        if (self.sandbox or {}).get("kind") == "bwrap":
            kwargs["preexec_fn"] = sandbox_preexec
        if self._seccomp_fd is not None:
            kwargs["pass_fds"] = (self._seccomp_fd,)
        try:
            try:
                proc = subprocess.Popen(argv, cwd=job["cwd"], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr_fh, **kwargs)
            finally:
                if self._seccomp_fd is not None:   # bwrap holds its own copy now
                    os.close(self._seccomp_fd)
                    self._seccomp_fd = None
        except OSError as exc:
            self._stderr_fh.close()
            if self.gateway is not None:
                self.gateway.stop(wait_s=0)
            finalize_job(self.paths, self.platform, job, status="failed", reason="launch_error",
                         usage=None, extra={"detail": f"cannot start claude: {exc}"})
            return None
        claude = self.platform.proc_id(proc.pid)
        self._proc, self._claude = proc, claude
        fault_point("supervisor_started")
        self._write_runtime(claude=dataclasses.asdict(claude) if claude else None,
                            claude_started_at=utc_now(), sandbox=self.sandbox)
        append_event(self.paths, "job_started", job_id=self.job_id, kind=job.get("kind"),
                     run_id=(job.get("meta") or {}).get("run_id"))
        return proc

    def _poll(self, proc: subprocess.Popen[bytes], prompt: bytes) -> None:
        """Feed the prompt, read the stream in a thread, and enforce the limits every POLL_S
        until `claude` exits (a stop decided by _check kills its tree and waits for the exit)."""
        claude = self._claude

        def feed_prompt() -> None:
            # Write the prompt and close stdin: an open stdin can stall the binary.
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                proc.stdin.write(prompt)
                proc.stdin.close()
        threading.Thread(target=feed_prompt, daemon=True).start()
        self._reader_thread = threading.Thread(
            target=self._reader, args=(proc.stdout, Path(self.job["raw_dir"]) / "stream.jsonl"), daemon=True)
        self._reader_thread.start()
        last_hb = 0.0
        while proc.poll() is None:
            time.sleep(self.POLL_S)
            if self.end is None:
                self._check(proc, claude)
            if time.monotonic() - last_hb >= heartbeat_s():
                last_hb = time.monotonic()
                with self._lock:
                    self._write_runtime(tool_uses=self.state.tool_uses,
                                        silent_s=round(time.monotonic() - self.last_output, 1))
                if self.subreaper:
                    self.platform.reap_zombies(keep=[proc.pid])
            if self.end is not None and proc.poll() is None:
                time.sleep(0.2)
                if claude:
                    self.platform.kill_tree([claude], session_ids=[proc.pid])

    def _sweep(self, proc: subprocess.Popen[bytes]) -> list[ProcId]:
        """After `claude` exits: kill what it left behind (background tool processes hold the
        stdout pipe open), drain the reader, stop the gateway, and decide whether a session
        that died without a result was killed.  Answers the processes that survived the kill."""
        survivors: list[ProcId] = []
        roots = [self._claude] if self._claude else []
        if self.subreaper and self.me is not None:
            # Adopted orphans are children of this process now, whatever session they made.
            roots += self.platform.descendants(self.me)
        if roots:
            survivors = self.platform.kill_tree(roots, session_ids=[proc.pid])
        if self.subreaper:
            self.platform.reap_zombies()
        if self._reader_thread is not None:
            self._reader_thread.join(timeout=10)
        if self._stderr_fh is not None:
            self._stderr_fh.close()
        if self.gateway is not None:
            self.gateway.stop()
        if self.end is None and self.state.result is None:
            # A kill can reach claude before this loop sees the request (scancel signals every
            # process of the Slurm job at once): a session that died without a result while a
            # kill was pending was killed, not crashed.  Judged after the reader drained the
            # stream, so that a result printed just before the kill still counts.
            kill_req = read_json(self.paths.job_dir(self.job_id) / "kill.request", default=None)
            if kill_req is not None or self.terminate_requested:
                self.end = ("killed", str((kill_req or {}).get("reason") or "supervisor_terminated"))
        return survivors

    def _session_ids(self) -> tuple[str | None, list[str]]:
        """(the session id this job's record keeps, the other ids the stream named).  The id is the
        one agentbench assigned (the job record has it); a stream line naming another one is an
        anomaly, flagged and never adopted, and nothing the stream says becomes a path."""
        assigned = self.job.get("session_id")
        named = list(self.state.session_ids)
        if not is_safe_id(assigned):
            assigned = next((i for i in named if is_safe_id(i)), None)
        foreign = [i for i in named if i != assigned]
        if foreign:
            self.flags.add("session_id_mismatch")
            note_anomaly(self.state.anomalies, "stream.session_id", foreign[0],
                         "not the session id agentbench assigned")
        return assigned, [json_safe(i) for i in foreign]

    def _finish(self, exit_code: int | None, survivors: list[ProcId]) -> None:
        job = self.job
        st = self.state
        session_id, foreign_ids = self._session_ids()
        prior = job.get("prior") or {}
        usage = usage_record(st.result, st, prior_cost=usd_from(prior.get("cost_usd")) or 0.0,
                             prior_model_usage=prior.get("model_usage"), requested_model=job["model"])
        usage["anomalies"] = list(st.anomalies) + list(usage.get("anomalies") or [])
        if self.end is not None:
            status, reason = self.end
        else:
            status, reason = classify_session(st.result, exit_code)
        gw = self.gateway
        requested = str(job["model"])
        # The gateway's records (None: the study runs without one; a job meant to have one whose
        # gateway never started carried no request).
        records: list[dict[str, Any]] | None = (
            list(gw.records) if gw is not None
            else ([] if job.get("gateway", GATEWAY_DEFAULT) == "on" else None))
        if gw is not None:
            # The wire's figures beside the binary's own; budgets count the metered one.
            usage.update(gw.summary())
            if (usage["requests"] and not usage.get("estimated")
                    and cost_mismatch(usage["cost_metered_usd"], usage.get("cost_delta_usd"))):
                self.flags.add("cost_mismatch")
            if gw.refusal is not None and self.end is None and (status != "ok" or gw.cutoff is not None):
                status, reason = "failed", "budget"   # a cut answer ends the session `budget`, whatever came
            # Requests for another model (a side model, or one the agent asked for itself) are
            # metered at that model's price; the flag makes them visible.
            if any(m != "(unknown)" and not model_matches(str(job["model"]), m)
                   for m in usage["models_metered"]):
                self.flags.add("other_models_metered")
        if status == "ok" and exit_code not in (0, None):
            self.flags.add("exit_code_nonzero_after_success")
        others = [m for m in usage.get("models_used") or []
                  if not model_matches(requested, m)]
        # Responses that reported another model: _check() stops such a session while it runs,
        # but a short session can end between two polls, so the final accounting looks again
        # (modelUsage is keyed by the requested model and cannot show a substitution).
        substituted = [m for m in st.models if not model_matches(requested, m)]
        if records:
            # Under a gateway that carried requests, the wire says which model answered; an
            # assistant event naming another one that no answer matches was printed by a process
            # of the session: flagged, believed for nothing.
            on_wire = claim_corroboration("model_refused", records, requested) == "corroborated"
            if substituted and not on_wire:
                self.flags.add("stream_model_unconfirmed")
            substituted = substituted if on_wire else []
            if on_wire and not substituted:
                substituted = ["(seen by the gateway)"]
        if substituted:
            self.flags.add("model_substituted")
            if status == "ok":
                status, reason = "failed", "model_refused"
        if others:
            self.flags.add("other_models_billed")
            if status == "ok" and not (job.get("limits") or {}).get("allow_side_models"):
                status, reason = "failed", "model_refused"
        claimed = reason if status == "failed" else None
        corroboration = claim_corroboration(claimed, records, requested)
        if not claim_counts(corroboration):
            # An infrastructure condition the wire never saw (or, without a gateway, could not
            # see): written into the stream by a process of the session, for all anyone knows.
            # The agent's failure, and no reason to pause the study.
            self.flags.add("uncorroborated_result")
            reason = "uncorroborated_" + str(reason)
        if len(st.results) > 1:
            self.flags.add("multiple_results")
        if st.bad_lines:
            self.flags.add("unparseable_lines")
        fp = init_fingerprint(st.init)
        drift = None
        if fp:
            fp_path = self.paths.state / "fingerprint.json"
            known = read_json(fp_path, default=None)
            if known is None:
                with contextlib.suppress(OSError):
                    create_json_exclusive(fp_path, fp, self.platform.rename_no_replace)
            elif known.get("sha256") != fp["sha256"]:
                drift = {k: {"expected": known.get(k), "got": fp.get(k)} for k in INIT_FINGERPRINT_KEYS
                         if known.get(k) != fp.get(k)}
                self.flags.add("fingerprint_drift")
        base_ctx = int(prior.get("context_tokens") or 0)
        last_ctx = 0
        if st.message_order:
            last_ctx = context_tokens(st.messages[st.message_order[-1]]["tokens"])
        res = st.result or {}
        extra = {"exit_code": exit_code, "duration_s": round(time.monotonic() - self.started, 3),
                 "claude_version": (st.init or {}).get("claude_code_version"),
                 "init_fingerprint": fp, "fingerprint_drift": drift,
                 "cache_verdict": cache_verdict(st.first_assistant_usage, base_ctx),
                 "context_tokens": last_ctx, "tool_uses": st.tool_uses, "num_turns": res.get("num_turns"),
                 "result_subtype": res.get("subtype"), "is_error": res.get("is_error"),
                 "api_error_status": res.get("api_error_status"),
                 "result_text": str(res.get("result") or "")[:2000] if res else None,
                 "models_reported": st.models, "bad_lines": st.bad_lines, "unknown_events": st.unknown_types,
                 "survivors": [dataclasses.asdict(s) for s in survivors],
                 "session_id": session_id, "stream_session_ids": foreign_ids,
                 "claim": ({"reason": claimed, "corroboration": corroboration}
                           if claimed in CLAIMED_CONDITIONS else None),
                 "snapshots": self.snapshots_done, "flags": sorted(self.flags),
                 "sandbox": self.sandbox,
                 **({"gateway_refusal": gw.refusal} if gw is not None and gw.refusal else {})}
        # The study lock can be busy for a while (a large `assign`): keep trying, heartbeating,
        # rather than exit unfinalised and let a good result be reaped as `lost`.
        deadline = time.monotonic() + 3600
        while True:
            try:
                finalize_job(self.paths, self.platform, job, status=status, reason=reason, usage=usage,
                             extra=extra)
                return
            except AgentbenchError as exc:
                if exc.code != "locked" or time.monotonic() > deadline:
                    raise
                self._write_runtime(finalizing=True)


# ==================================================================================================
# Sessions and bases: every launch (start, fork, continue)
# ==================================================================================================
# The shared path by which every session starts (train, spawn, continue, and the experiment's
# runs): validate the launch config, honour the circuit breaker and the study's USD cap, register
# the job under the lock (parallel cap), then launch its detached supervisor.  Bases (trained
# sessions that runs fork from) are small records under state/bases/.  Owns session limits
# (session_limits) and launch refusals.  Must not wait for a session to end.

def check_job_limits(limits: Mapping[str, Any]) -> None:
    for key in ("wall_s", "stall_after_s", "orphan_after_s", "max_budget_usd"):
        val = limits.get(key)
        if val is not None and (not isinstance(val, (int, float)) or val < 0):
            raise AgentbenchError(f"{key} must be a non-negative number", code="non_negative_number",
                                  value=val)
    if limits.get("max_budget_usd") is not None and not float(limits["max_budget_usd"]) > 0:
        raise AgentbenchError("max_budget_usd must be greater than 0", code="zero_max_budget",
                              value=limits["max_budget_usd"],
                              hint="claude refuses a zero budget; give a positive amount")


def session_limits(launch: Mapping[str, Any], *, wall_s: float | None = None,
                   stall_after_s: float | None = None,
                   orphan_after_s: float | None = None, max_budget_usd: float | None = None,
                   max_turns: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The limits of one session: every launch builds them here.  What a caller leaves out (None)
    is the study's: its per-session cap (`max_minutes`, within `budget.wall_s`), stall and orphan
    settings, `budget.usd_per_run` and `budget.max_turns`.  `extra` adds job-specific keys
    (snapshots, an injected fault).  Pure: the caller validates the result where it is refused."""
    budget = launch["budget"]
    session_cap = float(launch["max_minutes"]) * 60      # max_minutes bounds any one session
    limits: dict[str, Any] = {
        "wall_s": (wall_s if wall_s is not None
                   else min(float(budget.get("wall_s") or session_cap), session_cap)),
        "stall_after_s": stall_after_s if stall_after_s is not None else launch.get("stall_after_s"),
        "orphan_after_s": orphan_after_s if orphan_after_s is not None else launch.get("orphan_after_s"),
        "max_budget_usd": max_budget_usd if max_budget_usd is not None else budget.get("usd_per_run"),
        "max_turns": max_turns if max_turns is not None else budget.get("max_turns")}
    if launch.get("workspace_mb") is not None:
        # The copy caps the supervisor's snapshots obey, and its live cap on the workspace.
        caps = copy_caps(launch)
        limits.update({"copy_file_bytes": caps.file_bytes, "copy_total_bytes": caps.total_bytes,
                       "workspace_max_bytes": int(float(launch["workspace_mb"]) * 2 ** 20)})
    if extra:
        limits.update(extra)
    return limits


def study_binary(ctx: Host, cfg: Mapping[str, Any]) -> str:
    binary, how = find_claude_binary(cfg.get("binary"), ctx.env)
    if not binary:
        raise AgentbenchError("the claude binary was not found", code="claude_binary_not_found", how=how,
                              hint=("install it (npm install -g "
                                    f"@anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}), "
                                    "or set `binary` with init, or AGENTBENCH_CLAUDE_BIN"))
    return binary



def preamble_text(paths: StudyPaths, cfg: Mapping[str, Any]) -> str:
    """preamble.md: the study's configured one, else its own, else the bundled one ("" if none)."""
    pre = cfg.get("preamble")
    for c in ([paths.root / pre] if pre else []) + [paths.root / "preamble.md", HERE / "preamble.md"]:
        if c.is_file():
            return c.read_text(encoding="utf-8")
    return ""


def base_system_prompt(cfg: Mapping[str, Any], paths: StudyPaths, extra: str = "") -> str:
    """The appended system prompt of a session: the preamble + an arm text."""
    return preamble_text(paths, cfg).rstrip() + ("\n\n" + extra.strip() if extra.strip() else "") + "\n"



def parse_fault(spec: str) -> dict[str, Any]:
    """`interrupt:after_tool_uses=N` or `missing_fixture:PATH` to job/run fields (refused otherwise)."""
    kind, _, rest = spec.partition(":")
    if kind == "interrupt":
        m = re.fullmatch(r"after_tool_uses=(\d+)", rest)
        if not m or int(m.group(1)) < 1:
            raise AgentbenchError("bad fault", code="bad_fault",
                                  fault=spec, hint="interrupt:after_tool_uses=N with N >= 1")
        return {"interrupt_after_tool_uses": int(m.group(1))}
    if kind == "missing_fixture":
        if not rest or rest.startswith(("/", "\\")) or ".." in Path(rest).parts:
            raise AgentbenchError("bad fault", code="bad_fault",
                                  fault=spec, hint="missing_fixture:RELATIVE/PATH inside the workspace")
        return {"missing_fixture": rest}
    raise AgentbenchError("unknown fault", code="unknown_fault", fault=spec,
                          hint="use interrupt:after_tool_uses=N or missing_fixture:PATH")



def refuse_if_paused(paths: StudyPaths, launch: Mapping[str, Any]) -> None:
    """No new launch while the circuit breaker is tripped or the study's USD cap is spent.

    The refusal carries `refusal` ("breaker" / "study_cap") so that a driver pauses its queue
    instead of marking runs failed.
    """
    reg = read_registry(paths)
    if reg.get("breaker"):
        raise AgentbenchError("the study is paused by its circuit breaker", code="breaker_tripped",
                              breaker=reg["breaker"],
                              refusal="breaker",
                              hint="sessions failed on usage limits or authentication; fix the cause, "
                                   "then `init --study DIR --reset-breaker`")
    study_cap = float(launch["budget"].get("study_usd") or 0)
    if study_cap and registry_spent_usd(reg) >= study_cap:
        raise AgentbenchError("the study's USD cap is spent", code="study_cap_spent",
                              spent_usd=reg.get("spent_usd"), cap=study_cap,
                              refusal="study_cap",
                              hint="raise budget.study_usd with init if you mean to spend more")


def require_executor_ready(executor: str | None, env: Mapping[str, str] | None = None) -> None:
    """Refuse, before anything is written, a study whose executor's commands are missing from
    env's PATH (this process's environment unless given): only Slurm needs any."""
    missing = executor_for(executor).missing_commands(os.environ if env is None else env)
    if missing:
        raise AgentbenchError("the study's executor is slurm but these Slurm commands are not on PATH: "
                              + ", ".join(missing), code="slurm_commands_missing", missing=missing,
                              hint="run agentbench where Slurm's commands work (a login node), "
                                   "or `init --executor local`")


def refuse_launch(paths: StudyPaths, cfg: Mapping[str, Any],
                  env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every refusal of a new session that depends only on the study (its values, its executor,
    a pause); the effective launch configuration when there is none.  Writes nothing.  `env` is
    the caller's environment (this process's unless given)."""
    validate_launch_values(cfg)
    launch = launch_config(cfg)
    check_model_id(launch["model"])
    require_executor_ready(launch["executor"], env)
    refuse_if_paused(paths, launch)
    # The sandbox is decided where the supervisor runs: here for local jobs (a study that requires
    # bubblewrap is refused now), on the compute node for Slurm jobs (recorded as the mode only).
    mode = sandbox_mode_of(cfg)
    launch["sandbox"] = (resolve_sandbox(mode) if executor_for(launch["executor"]).runs_here
                         else {"mode": mode, "kind": None, "binary": None,
                               "reason": "decided on the compute node"})
    return launch


def start_job(ctx: Host, paths: StudyPaths, *, kind: str, prompt: str, cwd: str, session_id: str | None,
              resume: str | None, fork: bool, prior: Mapping[str, Any], limits: Mapping[str, Any],
              meta: Mapping[str, Any], system_extra: str = "", env_extra: Mapping[str, str] | None = None,
              raw_dir: str | None = None, driver: Mapping[str, Any] | None = None,
              cfg: Mapping[str, Any] | None = None, system_prompt: str | None = None) -> dict[str, Any]:
    """Validate, register and launch one job (the shared path of train, spawn, continue, run)."""
    cfg = cfg if cfg is not None else load_study_config(paths)
    launch = refuse_launch(paths, cfg, ctx.env)
    network, why = session_network(list(cfg.get("network_open_arms") or []), meta.get("arm"),
                                   launch["gateway"])
    launch["sandbox"] = {**launch["sandbox"], "network": network, "network_reason": why}
    env_all = {**ctx.env, **dict(cfg.get("env") or {}), **dict(env_extra or {})}
    if env_all.get("AGENTBENCH_OFFLINE") != "1":
        refusal = gateway_refusal(env_all, launch["gateway"])
        if refusal is not None:
            raise refusal
    binary = study_binary(ctx, cfg)
    reap_jobs(paths, ctx.platform, env=ctx.env)
    job = create_job(paths, ctx.platform, kind=kind, prompt=prompt, cwd=cwd, launch=launch, binary=binary,
                     system_prompt=(system_prompt if system_prompt is not None
                                    else base_system_prompt(cfg, paths, system_extra)),
                     session_id=session_id,
                     resume=resume, fork=fork, prior=prior, limits=limits, meta=meta,
                     env_extra={**dict(cfg.get("env") or {}), **dict(env_extra or {})}, raw_dir=raw_dir,
                     driver=driver, cap=int(launch["parallel"]))
    launched = launch_supervisor(paths, ctx.platform, job, ctx.env)
    return {"job_id": job["job_id"], "session_id": job["session_id"], "kind": kind, "cwd": cwd,
            "status": launched["status"], **({"reason": launched["reason"]} if "reason" in launched else {})}



def base_file(paths: StudyPaths, name: str) -> Path:
    return paths.bases / f"{check_name('base', name)}.json"


def base_lock(paths: StudyPaths, platform: "Platform", name: str) -> RegistryLock:
    """The lock of one base's record: every read-modify-write of it (train, tick, expire) holds
    it, always before (never inside) the registry lock."""
    paths.bases.mkdir(parents=True, exist_ok=True)
    return RegistryLock(paths.bases / f".{check_name('base', name)}.lock", platform,
                        timeout_s=SBATCH_TIMEOUT_S + LOCK_TIMEOUT_S, label=f"base {name}")



def load_base(paths: StudyPaths, name: str) -> dict[str, Any]:
    rec = read_json(base_file(paths, name), default=None)
    if rec is None:
        raise AgentbenchError("no such base", code="no_such_base", base=name, refusal="base",
                              hint=(f"train it first: agentbench.py train --task {name} "
                                    "(or --base NAME --brief FILE)"))
    return rec


def register_base(paths: StudyPaths, name: str, job: Mapping[str, Any], workspace: Path) -> None:
    """Record a base: the training job and session that runs fork from, and its cwd."""
    write_json_atomic(base_file(paths, name),
                      {"name": name, "job_id": job["job_id"], "session_id": job["session_id"],
                       "cwd": str(workspace), "created_at": utc_now(), "expired": False,
                       "last_ping": time.time()})


def base_state(paths: StudyPaths, rec: Mapping[str, Any]) -> str:
    if rec.get("expired"):
        return "expired"
    res = read_json(paths.result_file(rec["job_id"]), default=None)
    if res is None:
        return "training"
    return "ready" if res["status"] == "ok" else f"failed:{res.get('reason') or res['status']}"


def require_base_ready(paths: StudyPaths, name: str) -> None:
    """Refuse (refusal "base") unless the base exists and its training ended ok."""
    state = base_state(paths, load_base(paths, name))
    if state != "ready":
        raise AgentbenchError("base is not ready", code="base_not_ready",
                              base=name, state=state, refusal="base",
                              hint="wait for its training job, or retrain it with --replace")



def fork_base(ctx: Host, paths: StudyPaths, base: str, workspace: Path, *, copy_workspace: bool,
              env_extra: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Prepare a fork of a ready base in `workspace`: transcript in place, prior = base's totals."""
    rec = load_base(paths, base)
    reap_jobs(paths, ctx.platform, only=[rec["job_id"]], env=ctx.env)   # its session totals must be recorded
    state = base_state(paths, rec)
    if state == "ready" and not job_is_final(paths, rec["job_id"]):
        state = "finalising"
    if state != "ready":
        raise AgentbenchError("base is not ready", code="base_not_ready",
                              base=base, state=state, refusal="base",
                              hint="wait for its training job, or retrain it with --replace")
    cfg = load_study_config(paths)
    caps = copy_caps(launch_config(cfg))
    if copy_workspace and not workspace.exists():
        try:
            safe_copy_tree(rec["cwd"], workspace, caps)   # the base's session wrote it: hostile
        except BaseException:
            shutil.rmtree(workspace, ignore_errors=True)
            raise
    workspace.mkdir(parents=True, exist_ok=True)
    sess = session_record(paths, rec["session_id"])
    env = {**ctx.env, **(cfg.get("env") or {}), **dict(env_extra or {})}
    if not ensure_transcript_at(env, rec["session_id"], rec["cwd"], str(workspace), caps.file_bytes):
        raise AgentbenchError("the base's session transcript was not found",
                              code="bases_session_transcript_not_found", base=base,
                              expected=str(transcript_path(env, rec["cwd"], rec["session_id"])),
                              hint="claude keeps transcripts under $CLAUDE_CONFIG_DIR/projects; use the same "
                                   "CLAUDE_CONFIG_DIR as when the base was trained")
    return {"resume": rec["session_id"], "prior": {"cost_usd": sess["cost_total_usd"],
                                                   "model_usage": sess["model_usage"],
                                                   "context_tokens": sess.get("context_tokens", 0)}}



def duplicate_continue(paths: StudyPaths, prev_id: str, job_id: str) -> dict[str, Any]:
    existing = read_json(paths.job_file(job_id))
    return {"job_id": job_id, "session_id": existing.get("session_id"), "kind": existing.get("kind"),
            "cwd": existing.get("cwd"), "status": job_status(paths, job_id).get("status"),
            "duplicate": True,
            "note": f"job {prev_id} was already continued; the repeated request was ignored"}


def continue_job(ctx: Host, paths: StudyPaths, prev_id: str, prompt: str, limits: Mapping[str, Any],
                 kind: str = "continue", meta_extra: Mapping[str, Any] | None = None,
                 cfg: Mapping[str, Any] | None = None, driver: Mapping[str, Any] | None = None,
                 raw_dir: str | None = None) -> dict[str, Any]:
    """One more turn in a finished job's session (`--resume <session>`), same cwd and launch config."""
    prev = load_job(paths, prev_id)
    reap_jobs(paths, ctx.platform, only=[prev_id], env=ctx.env)   # complete a half-finished finalisation
    res = read_json(paths.result_file(prev_id), default=None)
    if res is None or not job_is_final(paths, prev_id):
        raise AgentbenchError("the job is still running", code="job_still_running",
                              job=prev_id, hint="wait for it first")
    sid = res.get("session_id") or prev.get("session_id")
    if not sid:
        raise AgentbenchError("the job has no session to continue", code="job_no_session_continue",
                              job=prev_id)
    if existing_continuation(paths, prev_id):
        return duplicate_continue(paths, prev_id,
                                  existing_continuation(paths, prev_id))  # type: ignore[arg-type]
    for other in active_job_ids(paths):
        oj = read_json(paths.job_file(other), default={}) or {}
        if oj.get("session_id") == sid and not paths.result_file(other).exists():
            raise AgentbenchError("the session already has a running job", code="session_already_running_job",
                                  job=other, session_id=sid,
                                  hint="two resumes of one session at once would corrupt it; wait for it")
    sess = session_record(paths, sid)
    prior = {"cost_usd": sess["cost_total_usd"], "model_usage": sess["model_usage"],
             "context_tokens": sess.get("context_tokens", 0)}
    meta = {**(prev.get("meta") or {}), "continues": prev_id, **dict(meta_extra or {})}
    # The same system prompt as the session began with: a resume must not change the cached prefix.
    system_prompt = (paths.job_dir(prev_id) / "system_prompt.md").read_text(encoding="utf-8")
    try:
        return start_job(ctx, paths, kind=kind, prompt=prompt, cwd=prev["cwd"], session_id=sid, resume=sid,
                         fork=False, prior=prior, limits=limits, meta=meta, env_extra=prev.get("env_extra"),
                         raw_dir=raw_dir, cfg=cfg, driver=driver, system_prompt=system_prompt)
    except DuplicateRequest as dup:
        return duplicate_continue(paths, prev_id, dup.job_id)


def ping_bases(host: Host, paths: StudyPaths, every_s: float) -> dict[str, Any]:
    """Keep-warm pings (`tick`): fork every ready base not pinged for `every_s` seconds with a
    one-line prompt, outside every run's budget (PING_LIMITS), so that its prefix stays cached."""
    cfg = load_study_config(paths)
    pinged, skipped = [], []
    for f in sorted(paths.bases.glob("*.json")) if paths.bases.is_dir() else []:
        name = f.stem
        with base_lock(paths, host.platform, name):
            # Read under the base's lock: a retraining in between must not be written back over.
            rec = read_json(f)
            st = base_state(paths, rec)
            if st != "ready" or time.time() - float(rec.get("last_ping") or 0) < every_s:
                skipped.append({"base": rec["name"], "state": st})
                continue
            ws = paths.state / "pings" / f"{rec['name']}-{uuid.uuid4().hex[:6]}"
            fk = fork_base(host, paths, rec["name"], ws, copy_workspace=False)
            limits = session_limits(launch_config(cfg), **PING_LIMITS)
            out = start_job(host, paths, kind="ping", prompt="Reply with the single word OK.", cwd=str(ws),
                            session_id=None, resume=fk["resume"], fork=True, prior=fk["prior"], limits=limits,
                            meta={"base": rec["name"]}, cfg=cfg,
                            env_extra={"CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(PING_MAX_OUTPUT_TOKENS)},
                            system_prompt=(paths.job_dir(rec["job_id"]) / "system_prompt.md").read_text(
                                encoding="utf-8"))
            rec["last_ping"] = time.time()
            write_json_atomic(f, rec)
        pinged.append({"base": rec["name"], "job_id": out["job_id"]})
    return {"pinged": pinged, "skipped": skipped}


def expire_base(host: Host, paths: StudyPaths, name: str) -> dict[str, Any]:
    """Retire a base (`expire`): no more pings, no more forks."""
    load_base(paths, name)   # refused before a lock file is made for a base that is not there
    with base_lock(paths, host.platform, name):
        rec = load_base(paths, name)
        rec["expired"] = True
        rec["expired_at"] = utc_now()
        write_json_atomic(base_file(paths, name), rec)
    return {"base": name, "state": "expired"}


# ==================================================================================================
# Tasks, arms and checks: a study's contents, loaded once
# ==================================================================================================
# Task bundles, arms, templates and the study's hash, read once per command into a `Study`; the
# gate and oracle checks and their receipts; calibration of a task against its reference.  Owns what
# a task is and how its checks run and are judged.  Must not know runs, jobs or the pipeline.

TASK_JSON_KEYS = ("id", "title", "gate", "oracle")
CHECK_PLACEHOLDERS = ("python", "workspace", "gate", "oracle", RECEIPT_FD_PLACEHOLDER)
DEFAULT_GATE_TIMEOUT_S = 120.0
DEFAULT_ORACLE_TIMEOUT_S = 300.0
#: The hidden tests' pass mark when task.json gives none (SPEC: calibration's default 0.9).
DEFAULT_ORACLE_THRESHOLD = 0.9
#: A check's `receipt` setting in task.json: `json` = a JSON receipt is required (no receipt is a
#: grader error), `auto` = the last stdout line if it is one, else the exit code (0 pass, 1 fail).
CHECK_RECEIPT_MODES = ("auto", "json")
#: The longest a gate or oracle may be given (a day); task.json values beyond it are refused.
MAX_CHECK_TIMEOUT_S = 86400.0
IGNORED_BUNDLE_NAMES = frozenset({"__pycache__", ".pytest_cache", ".DS_Store", ".git"})
TEMPLATE_NAMES = ("task_prompt", "gate_feedback", "review_prompt", "reviewer_system", "review_feedback",
                  "resume", "train_base")


def entry_digest(path: str | os.PathLike[str], max_bytes: int | None = None) -> str:
    """What a manifest records of one directory entry, never following it: a regular file's
    sha256; `symlink:<sha256 of its target text>` for a link; `special:<kind>` for a FIFO, a
    socket or a device (never opened: reading one could block forever or never end).  A regular
    file over `max_bytes` raises UnusableTree."""
    st = os.lstat(path)
    if stat.S_ISREG(st.st_mode):
        digest = sha256_regular(path, max_bytes)
        if digest is not None:
            return digest
        st = os.lstat(path)      # swapped for something else since it was looked at
    if stat.S_ISLNK(st.st_mode):
        return "symlink:" + sha256_bytes(os.fsencode(os.readlink(path)))
    kind = "fifo" if stat.S_ISFIFO(st.st_mode) else "socket" if stat.S_ISSOCK(st.st_mode) else "device"
    return f"special:{kind}"


def tree_entries(root: str | os.PathLike[str], caps: CopyCaps = DEFAULT_COPY_CAPS
                 ) -> dict[str, tuple[str, int]]:
    """shown_name of the relative POSIX path -> (entry_digest, apparent size) of every entry under
    `root` that is not a directory (caches and .git excluded; links to directories are entries,
    never followed).  Within the copy caps and rules (UnusableTree past them)."""
    out: dict[str, tuple[str, int]] = {}
    if os.path.islink(root):
        raise UnusableTree("not_a_directory", str(root))   # replaced by a link: never entered
    if not os.path.isdir(root):
        return out
    total = 0
    pending: list[tuple[str, str, int]] = [(os.fspath(root), "", 0)]
    try:
        while pending:
            d, rel, depth = pending.pop()
            if depth > COPY_MAX_DEPTH:
                raise UnusableTree("nested_too_deep", rel[:200], cap=COPY_MAX_DEPTH)
            with os.scandir(d) as it:
                found = sorted(it, key=lambda e: e.name)
            for e in found:
                if e.name in IGNORED_BUNDLE_NAMES or e.name.endswith(".pyc"):
                    continue
                erel = rel + e.name
                if len(os.fsencode(erel)) > COPY_MAX_PATH_BYTES:
                    raise UnusableTree("path_too_long", erel[:200], cap=COPY_MAX_PATH_BYTES)
                if len(out) + len(pending) >= caps.entries:
                    raise UnusableTree("too_many_entries", erel, cap=caps.entries)
                st = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append((e.path, erel + "/", depth + 1))
                    continue
                size = st.st_size if stat.S_ISREG(st.st_mode) else 0
                if caps.file_bytes is not None and size > caps.file_bytes:
                    raise UnusableTree("file_over_cap", erel, size=size, cap=caps.file_bytes)
                total += size
                if caps.total_bytes is not None and total > caps.total_bytes:
                    raise UnusableTree("copy_over_cap", erel, size=total, cap=caps.total_bytes)
                out[shown_name(erel)] = (entry_digest(e.path, caps.file_bytes), size)
    except OSError as exc:
        if exc.errno in NAME_REFUSED_ERRNOS:
            raise UnusableTree("name_refused", exc.filename or "", detail=exc.strerror) from None
        raise
    return dict(sorted(out.items()))


def tree_manifest(root: str | os.PathLike[str], caps: CopyCaps = DEFAULT_COPY_CAPS) -> dict[str, str]:
    """tree_entries' digests: shown relative path -> entry_digest."""
    return {k: v[0] for k, v in tree_entries(root, caps).items()}


def manifest_sha256(manifest: Mapping[str, str]) -> str:
    return sha256_bytes(json.dumps(dict(sorted(manifest.items())), sort_keys=True).encode())


#: Bundle parts copied into workspaces or checks: a symlink in one could bring the oracle, the
#: reference or any host file into the agent's view as a regular file, so it is refused.
LINK_FREE_BUNDLE_PARTS = ("public", "gate", "reference", "partial")
#: The audit flags a workspace file byte-equal to a hidden file (oracle/ or reference/) from this
#: size on; smaller equal files (an empty __init__.py, a one-line answer) are expected coincidences.
AUDIT_HIDDEN_MATCH_MIN_BYTES = {"oracle": 64, "reference": 256}


def bundle_symlinks(root: str | os.PathLike[str], parts: Sequence[str] = LINK_FREE_BUNDLE_PARTS) -> list[str]:
    """Every symlink (to a file or a directory) under the given parts of a task bundle, relative."""
    root = Path(root)
    found: list[str] = []
    for part in parts:
        base = root / part
        if base.is_symlink():
            found.append(part)
            continue
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            for name in sorted(dirnames + filenames):
                full = Path(dirpath) / name
                if full.is_symlink():
                    found.append(full.relative_to(root).as_posix())
    return sorted(found)


def refuse_bundle_symlinks(task_id: str, root: str | os.PathLike[str]) -> None:
    links = bundle_symlinks(root)
    if links:
        raise AgentbenchError("the task bundle holds symlinks", code="task_bundle_holds_symlinks",
                              task=task_id, links=links,
                              hint="replace each link by the file it points to (a link can bring the "
                                   "oracle, the reference or a host file into the workspace)")


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy a directory of the experimenter's (a bundle part, an example) onto `dst`, overlaying
    what is there; caches left out, links copied as links, special files skipped."""
    safe_copy_tree(src, dst, UNCAPPED, skip_names=IGNORED_BUNDLE_NAMES, skip_suffixes=(".pyc",),
                   overlay=True)


@dataclass
class Task:
    """One task bundle: <tasks>/<id>/{task.json, public/, gate/, oracle/, reference/, partial/}.

    Besides the fixed keys, task.json may hold `check_hint`: the sentence the task prompt gives
    the agent on how to run the public checks itself."""
    id: str
    title: str
    root: Path
    gate: dict[str, Any]
    oracle: dict[str, Any]
    spec: dict[str, Any]
    bundle_sha256: str
    public_manifest: dict[str, str]
    #: task.json `reference` (a script run in a copy of the workspace), None: reference/ is an overlay.
    reference_spec: dict[str, Any] | None = None
    #: A script reference's effect as an overlay (files it wrote), made for a rehearsal.
    overlay: Path | None = None

    @property
    def public(self) -> Path: return self.root / "public"
    @property
    def reference(self) -> Path: return self.root / "reference"
    @property
    def reference_files(self) -> Path:
        """The files a rehearsed agent writes: the overlay (reference/, or a script's effect)."""
        return self.overlay or self.reference
    @property
    def partial(self) -> Path: return self.root / "partial"
    @property
    def threshold(self) -> float: return float(self.oracle.get("threshold", DEFAULT_ORACLE_THRESHOLD))


def misspelt_placeholders(cmd: Sequence[str]) -> dict[str, str]:
    """`{name}`s in a check command that look like a misspelt placeholder: {"{gaet}": "{gate}"}.

    Other braces pass through as they always did (`${HOME}` in a shell, `awk '{print}'`, an
    f-string): only a name close to one of CHECK_PLACEHOLDERS is taken for a typo (pure)."""
    out = {}
    for arg in cmd:
        for m in re.finditer(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}", arg):
            name = m.group(1)
            if name in CHECK_PLACEHOLDERS:
                continue
            near = difflib.get_close_matches(name.lower(), CHECK_PLACEHOLDERS, n=1, cutoff=0.75)
            if near:
                out["{" + name + "}"] = "{" + near[0] + "}"
    return out


def check_default_timeout_s(which: str) -> float:
    """A check's time limit when task.json gives none: one default per kind, used by the task's
    validation and by `run_check` alike."""
    return DEFAULT_GATE_TIMEOUT_S if which == "gate" else DEFAULT_ORACLE_TIMEOUT_S


def check_timeout_s(spec: Mapping[str, Any], which: str) -> float:
    return float(spec.get("timeout_s", check_default_timeout_s(which)))


def _check_cmd(task_id: str, which: str, spec: Any) -> dict[str, Any]:
    if not isinstance(spec, dict) or not isinstance(spec.get("cmd"), list) or not spec["cmd"] \
            or not all(isinstance(a, str) for a in spec["cmd"]):
        raise AgentbenchError(f"task {which} must be an object with a non-empty `cmd` list of strings",
                              code="task_object_non_empty_cmd", task=task_id)
    typos = misspelt_placeholders(spec["cmd"])
    if typos:
        # It would reach the command as literal text and fail obscurely.
        raise AgentbenchError(f"task {which}.cmd has a misspelt placeholder",
                              code="task_cmd_misspelt_placeholder", task=task_id, placeholders=typos,
                              known=["{" + k + "}" for k in CHECK_PLACEHOLDERS])
    t = spec.get("timeout_s", check_default_timeout_s(which))
    if not is_number(t) or not 0 < t <= MAX_CHECK_TIMEOUT_S:
        raise AgentbenchError(f"task {which}.timeout_s must be a number of seconds in "
                              f"(0, {MAX_CHECK_TIMEOUT_S}]",
                              code="bad_check_timeout", task=task_id, timeout_s=t)
    if spec.get("receipt", "auto") not in CHECK_RECEIPT_MODES:
        raise AgentbenchError(f"task {which}.receipt must be one of {', '.join(CHECK_RECEIPT_MODES)}",
                              code="bad_receipt_mode", task=task_id, receipt=spec.get("receipt"))
    if spec.get("container") is not None:
        problem = container_spec_problem(spec["container"])
        if problem:
            raise AgentbenchError(f"task {which}.container cannot be used: {problem}",
                                  code="task_container_spec_invalid", task=task_id,
                                  hint='e.g. {"workdir": "/app", "ro": {"/tests": "tests"}, '
                                       '"scratch": ["/logs/verifier"]}')
    if which == "oracle":
        th = spec.get("threshold", DEFAULT_ORACLE_THRESHOLD)
        if not is_number(th) or not 0 < th <= 1:
            raise AgentbenchError("task oracle.threshold must be in (0, 1]", code="task_oracle_threshold_0_1",
                                  task=task_id, threshold=th)
    return dict(spec)


def task_check_hint(task: "Task", ws: str | os.PathLike[str]) -> str:
    """How the prompt tells the agent to run the public checks: the task's own `check_hint`, else
    a generic sentence when the workspace has a tests/ directory, else nothing."""
    if task.spec.get("check_hint"):
        return str(task.spec["check_hint"])
    if (Path(ws) / "tests").is_dir():
        return "Public tests are in tests/; run them with: python3 -m unittest discover -s tests"
    return ""


def load_task(root: Path) -> Task:
    """Read and validate one task bundle; refuses what a run could not use."""
    spec = read_json(root / "task.json")
    if not isinstance(spec, dict):
        raise AgentbenchError("task.json must hold an object", code="task_json_hold_object",
                              path=str(root / "task.json"))
    missing = [k for k in TASK_JSON_KEYS if k not in spec]
    if missing:
        raise AgentbenchError("task.json lacks required keys", code="task_json_lacks_required_keys",
                              path=str(root / "task.json"), missing=missing)
    if spec.get("check_hint") is not None and not isinstance(spec["check_hint"], str):
        raise AgentbenchError("task.json: check_hint must be a sentence (a string)",
                              code="task_json_check_hint_sentence", path=str(root / "task.json"))
    tid = check_name("task", str(spec["id"]))
    if tid != root.name:
        raise AgentbenchError("task id must equal its directory name", code="task_id_equal_directory_name",
                              id=tid, directory=root.name)
    for sub in ("public", "gate", "oracle"):
        if not (root / sub).is_dir():
            raise AgentbenchError(f"task bundle lacks {sub}/", code="task_bundle_lacks",
                                  task=tid, path=str(root / sub))
    gate = _check_cmd(tid, "gate", spec["gate"])
    oracle = _check_cmd(tid, "oracle", spec["oracle"])
    ref_spec = None
    if spec.get("reference") is not None:
        ref_spec = _check_cmd(tid, "reference", spec["reference"])
        if not (root / "reference").is_dir():
            raise AgentbenchError("task.json names a reference script but the bundle lacks reference/",
                                  code="task_bundle_lacks", task=tid, path=str(root / "reference"))
    bundle = tree_manifest(root, UNCAPPED)
    return Task(tid, str(spec["title"]), root, gate, oracle, spec, manifest_sha256(bundle),
                tree_manifest(root / "public", UNCAPPED), ref_spec)


def task_text(task: Task) -> str:
    """The task statement (public TASK.md), or the title when the bundle has none."""
    f = task.public / "TASK.md"
    return f.read_text(encoding="utf-8") if f.exists() else task.title


def tasks_dir(paths: StudyPaths, cfg: Mapping[str, Any]) -> Path:
    raw = cfg.get("tasks") or "tasks"
    p = Path(raw)
    return p if p.is_absolute() else paths.root / p


def pick_tasks(tasks: Mapping[str, Task], only: Sequence[str] | None) -> dict[str, Task]:
    """The tasks named in `only` (all when it is empty), in the study's order; an unknown name is
    refused (pure)."""
    if not only:
        return dict(tasks)
    unknown = [t for t in only if t not in tasks]
    if unknown:
        raise AgentbenchError("unknown task", code="unknown_task", tasks=unknown, known=sorted(tasks))
    return {k: v for k, v in tasks.items() if k in only}


def load_tasks(paths: StudyPaths, cfg: Mapping[str, Any],
               only: Sequence[str] | None = None) -> dict[str, Task]:
    tdir = tasks_dir(paths, cfg)
    if not tdir.is_dir():
        study = shlex.quote(str(paths.root))
        raise AgentbenchError(f"tasks directory not found: {tdir}", code="tasks_directory_not_found",
                              tasks=str(tdir),
                              hint="create a task in it with `python3 agentbench.py new-task --study "
                                   f"{study} --task NAME`, or point `tasks` in study.json at your "
                                   "tasks directory")
    tasks = {}
    for sub in sorted(tdir.iterdir()):
        if sub.is_dir() and (sub / "task.json").exists():
            t = load_task(sub)
            tasks[t.id] = t
    tasks = pick_tasks(tasks, only)
    if not tasks:
        raise AgentbenchError(f"no tasks found in {tdir}", code="no_tasks_found", tasks=str(tdir),
                              hint="each task is a directory tasks/<id>/ holding task.json, public/, "
                                   "gate/ and oracle/; `python3 agentbench.py new-task --study "
                                   f"{shlex.quote(str(paths.root))} --task NAME` writes one")
    return tasks


@dataclass
class Arm:
    """A treatment: an appended preamble text, controller gate cycles, an independent review."""
    name: str
    preamble_text: str
    preamble_path: str | None
    gate_cycles: int
    review: bool
    fork_base: bool


def load_arms(paths: StudyPaths, cfg: Mapping[str, Any]) -> dict[str, Arm]:
    """The study's arms, in their order (the first is the default baseline); `cfg` as
    load_study_config returns it, its arms' shape already checked."""
    arms_cfg = cfg.get("arms")
    if not isinstance(arms_cfg, dict) or not arms_cfg:
        raise AgentbenchError("study.json has no arms", code="study_json_no_arms",
                              hint='add e.g. "arms": {"A": {"preamble": "arms/A.md"}}')
    arms = {}
    for name, spec in arms_cfg.items():
        check_name("arm", name)
        text, ppath = "", None
        if spec.get("preamble"):
            p = Path(spec["preamble"])
            p = p if p.is_absolute() else paths.root / p
            if not p.is_file():
                raise AgentbenchError("arm preamble file not found", code="arm_preamble_file_not_found",
                                      arm=name, path=str(p))
            text, ppath = p.read_text(encoding="utf-8"), str(p)
        arms[name] = Arm(name, text, ppath, spec.get("gate_cycles", 0), spec.get("review", False),
                         spec.get("fork_base", False))
    unknown = sorted(set(cfg.get("network_open_arms") or []) - set(arms))
    if unknown:
        raise AgentbenchError("network_open_arms names arms the study does not have",
                              code="network_open_arm_unknown", arms=unknown, known=list(arms),
                              hint="a misspelt arm would keep its sessions off the network; fix the name")
    return arms


def load_templates(paths: StudyPaths, cfg: Mapping[str, Any]) -> dict[str, string.Template]:
    """Prompt templates: the study's templates/ dir overrides the bundled ones, file by file."""
    dirs = []
    if cfg.get("templates"):
        t = Path(cfg["templates"])
        dirs.append(t if t.is_absolute() else paths.root / t)
    dirs += [paths.root / "templates", HERE / "templates"]
    out = {}
    for name in TEMPLATE_NAMES:
        for d in dirs:
            f = d / f"{name}.md"
            if f.is_file():
                out[name] = string.Template(f.read_text(encoding="utf-8"))
                break
        else:
            raise AgentbenchError("prompt template not found", code="prompt_template_not_found",
                                  template=f"{name}.md", searched=[str(d) for d in dirs])
    return out


def render(tpl: string.Template, **values: Any) -> str:
    try:
        return tpl.substitute({k: str(v) for k, v in values.items()})
    except (KeyError, ValueError) as exc:
        raise AgentbenchError("template uses an unknown variable", code="template_uses_unknown_variable",
                              detail=str(exc),
                              allowed=sorted(values)) from None


def study_hash(cfg: Mapping[str, Any], tasks: Mapping[str, Task], arms: Mapping[str, Arm],
               templates: Mapping[str, string.Template], preamble: str) -> str:
    """Hash of everything that defines the study (pure): config, task bundles, arm texts,
    templates, preamble."""
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for t in tasks.values():
        h.update(f"{t.id}:{t.bundle_sha256}".encode())
    for a in arms.values():
        h.update(f"{a.name}:{a.gate_cycles}:{a.review}:{sha256_bytes(a.preamble_text.encode())}".encode())
    for name in TEMPLATE_NAMES:
        h.update(templates[name].template.encode())
    h.update(preamble.encode())
    return h.hexdigest()


def config_hash(paths: StudyPaths, cfg: Mapping[str, Any]) -> str:
    """study_hash of the study as it is on disk now (loads every part; see Study.hash for once)."""
    return study_hash(cfg, load_tasks(paths, cfg), load_arms(paths, cfg), load_templates(paths, cfg),
                      preamble_text(paths, cfg))


# -- the study, loaded once ------------------------------------------------------------------------

@dataclass(frozen=True)
class Study:
    """One study as a command sees it: its paths, and its checked config, tasks, arms, templates,
    launch configuration and config hash, each read from disk at most once and only when first
    asked for (a command that needs only the config stays cheap, and refusals come in the order
    the command asks).  Built by load_study; a command loads it once and passes it down.  Its
    parts are read-only by convention: a caller that changes one must copy it."""
    paths: StudyPaths
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def part(self, name: str, load: Callable[[], Any]) -> Any:
        if name not in self.memo:
            self.memo[name] = load()
        return self.memo[name]

    @property
    def cfg(self) -> dict[str, Any]:
        return self.part("cfg", lambda: load_study_config(self.paths))

    @property
    def tasks(self) -> dict[str, Task]:
        return self.part("tasks", lambda: load_tasks(self.paths, self.cfg))

    @property
    def arms(self) -> dict[str, Arm]:
        return self.part("arms", lambda: load_arms(self.paths, self.cfg))

    @property
    def templates(self) -> dict[str, string.Template]:
        return self.part("templates", lambda: load_templates(self.paths, self.cfg))

    @property
    def launch(self) -> dict[str, Any]:
        return self.part("launch", lambda: launch_config(self.cfg))

    @property
    def hash(self) -> str:
        return self.part("hash", lambda: study_hash(self.cfg, self.tasks, self.arms, self.templates,
                                                    preamble_text(self.paths, self.cfg)))

    def load_all(self) -> "Study":
        """Load config, tasks, arms and templates now, in that order (the order refusals come in)."""
        self.cfg, self.tasks, self.arms, self.templates   # noqa: B018 (each loads and memoizes)
        return self

    def task(self, task_id: str) -> Task:
        """One task's bundle; only that bundle is read unless every task is loaded already (the cost
        of a call about one run must not grow with the number of tasks)."""
        if "tasks" in self.memo and task_id in self.memo["tasks"]:
            return self.memo["tasks"][task_id]
        root = tasks_dir(self.paths, self.cfg) / check_name("task", task_id)
        if not (root / "task.json").exists():
            raise AgentbenchError("the task bundle is missing", code="task_bundle_missing",
                                  task=task_id, path=str(root))
        return load_task(root)


def load_study(paths: StudyPaths, cfg: Mapping[str, Any] | None = None) -> Study:
    """The study at `paths` (reading nothing yet: see Study), or with the `cfg` a caller has read."""
    study = Study(paths)
    if cfg is not None:
        study.memo["cfg"] = cfg
    return study




# -- checks (gate and oracle) ----------------------------------------------------------------------

def pristine_copy(paths: StudyPaths, task: Task, which: str) -> Path:
    """A pristine copy of a task's gate/ or oracle/, outside every workspace, keyed by bundle hash."""
    dst = paths.state / "pristine" / task.id / task.bundle_sha256[:16] / which
    if not dst.is_dir():
        tmp = dst.with_name(f".{which}.{uuid.uuid4().hex[:8]}")
        copy_tree(task.root / which, tmp)
        try:
            os.rename(tmp, dst)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def expand_cmd(cmd: Sequence[str], *, workspace: str, gate: str, oracle: str,
               receipt_fd: str = "<receipt-fd-not-available>") -> list[str]:
    """Substitute {workspace} {gate} {oracle} {python} {receipt_fd} in a check command (pure)."""
    values = {"workspace": workspace, "gate": gate, "oracle": oracle, "python": sys.executable,
              RECEIPT_FD_PLACEHOLDER: receipt_fd}
    out = []
    for a in cmd:
        for k, v in values.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


#: Exit codes of a check without a receipt that mean it could not run at all (not found, not
#: executable): a grader error for the gate and the oracle alike.
CHECK_CANNOT_RUN_CODES = (126, 127)


def receipt_verdict(receipt: Any, exit_code: int | None, timed_out: bool, *, which: str = "oracle",
                    required: bool = False) -> dict[str, Any]:
    """What a check's receipt (the parsed JSON object, or None) and exit code say (pure).

    A receipt is believed only when it is coherent: `passed` a boolean, `score` (if given) a
    finite number in [0, 1] (never a bool), and `passed: true` only with exit code 0.  Anything
    else is refused.  `grader_error` (None, or why) marks a check that gave no valid verdict: it
    timed out, was killed by a signal, could not run, printed an incoherent receipt, printed none
    when one is `required`, or (the oracle, without a receipt) exited with a code other than 0 or
    1.  A grader error is never a verdict on the agent: passed is False and score 0.0 only so that
    nothing downstream counts it as a success; the pipeline labels the run an infrastructure
    failure.  Counts (tests_passed, tests_total) that are not whole non-negative numbers are None.
    """
    def out(passed: bool, score: float, kind: str, error: str | None, obj: Mapping[str, Any] | None = None,
            ) -> dict[str, Any]:
        obj = obj or {}
        counts = {}
        for key in ("tests_passed", "tests_total"):
            val = obj.get(key)
            counts[key] = int(val) if finite_number(val, lo=0, hi=MAX_TOKEN_COUNT) is not None \
                and float(val) == int(val) else None
        checks = obj.get("checks") if isinstance(obj.get("checks"), list) else []
        return {"passed": passed, "score": score, "checks": json_safe(checks), **counts,
                "receipt": kind, "grader_error": error}
    if timed_out:
        return out(False, 0.0, "json" if isinstance(receipt, dict) else "exit_code", "the check timed out")
    if exit_code is None or exit_code < 0:
        return out(False, 0.0, "exit_code", f"the check was killed by signal {-(exit_code or 0)}"
                   if exit_code is not None else "the check did not exit")
    if isinstance(receipt, dict):
        passed = receipt.get("passed")
        if not isinstance(passed, bool):
            return out(False, 0.0, "refused", f"the receipt's passed is not true or false: {passed!r}"[:200])
        raw_score = receipt.get("score")
        if raw_score is None:
            score = 1.0 if passed else 0.0
        else:
            score_f = finite_number(raw_score, lo=0.0, hi=1.0)
            if score_f is None:
                return out(False, 0.0, "refused",
                           f"the receipt's score is not a number in [0, 1]: {raw_score!r}"[:200])
            score = score_f
        if passed and exit_code != 0:
            return out(False, 0.0, "refused", f"the receipt says passed but the check exited {exit_code}")
        return out(passed, score, "json", None, receipt)
    if required:
        return out(False, 0.0, "missing", "the check printed no valid JSON receipt (one is required)")
    if exit_code in CHECK_CANNOT_RUN_CODES:
        return out(False, 0.0, "exit_code", f"the check could not run (exit {exit_code})")
    if which == "oracle" and exit_code not in (0, 1):
        return out(False, 0.0, "exit_code", f"the oracle crashed (exit {exit_code}, no receipt)")
    passed = exit_code == 0
    return out(passed, 1.0 if passed else 0.0, "exit_code", None)


def parse_receipt(stdout: str, returncode: int | None, timed_out: bool, *, which: str = "oracle",
                  required: bool = False) -> dict[str, Any]:
    """A check's receipt: its last stdout line if that is a JSON object with `passed`, judged by
    receipt_verdict() together with the exit code."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.strip()]
    obj = None
    if lines:
        try:
            obj = json.loads(lines[-1])
        except ValueError:
            obj = None
    if not (isinstance(obj, dict) and "passed" in obj):
        obj = None
    return receipt_verdict(obj, returncode, timed_out, which=which, required=required)


def container_unavailable(container: Mapping[str, Any], sandbox: Mapping[str, Any]) -> str:
    """Why a command with a container spec cannot run here (pure)."""
    paths = [container["workdir"], *(container.get("ro") or {}), *(container.get("scratch") or [])]
    return (f"it needs the container paths {', '.join(paths)}, which only the bubblewrap sandbox gives, "
            f"and this one runs unsandboxed ({sandbox.get('reason') or sandbox.get('kind')})")


def run_check(paths: StudyPaths, platform: "Platform", task: Task, which: str, workspace: str,
              env: Mapping[str, str]) -> dict[str, Any]:
    """Run the gate (cwd = workspace) or the oracle (cwd = a throw-away copy of it); return a receipt.

    Check commands get a credential-free environment: they never see API keys or tokens.
    """
    spec = task.gate if which == "gate" else task.oracle
    gate_dir = str(pristine_copy(paths, task, "gate"))
    oracle_dir = str(pristine_copy(paths, task, "oracle")) if which == "oracle" else "<oracle-not-available>"
    tmp = None
    cwd = workspace
    if which == "oracle":
        tmp = tempfile.mkdtemp(prefix=f"ab-oracle-{task.id}-")
        cwd = os.path.join(tmp, "workspace")
        try:
            # Links are copied as links; FIFOs, sockets and devices are left out (copying one
            # could block forever): the hidden tests grade files.  Past the study's copy caps,
            # UnusableTree: the agent's failure, not the grader's.
            caps = copy_caps(launch_config(read_json(paths.study_file, default=None) or {}))
            safe_copy_tree(workspace, cwd, caps)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    container = spec.get("container")
    cenv, _ = check_env(env)
    sandbox = resolve_sandbox(sandbox_mode_of(read_json(paths.study_file, default=None) or {}), cenv)
    if container and sandbox["kind"] != "bwrap":
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        rec = receipt_verdict(None, CHECK_CANNOT_RUN_CODES[1], False, which=which)
        rec.update({"grader_error": container_unavailable(container, sandbox),
                    "sandbox": sandbox_record(sandbox), "which": which, "exit_code": None, "timed_out": False,
                    "output_capped": False, "wall_s": 0.0, "stdout_tail": "", "stderr_tail": "",
                    "at": utc_now(), "receipt_channel": "none",
                    "receipt_protected": False})
        if which == "oracle":
            rec.update({"success": False, "threshold": task.threshold})
        return rec
    uses_fd = any("{" + RECEIPT_FD_PLACEHOLDER + "}" in a for a in spec["cmd"])
    # The channel is a socket pair, not a pipe: a pipe can be opened again through
    # /proc/<check>/fd/N by any process of the same user (the code under test among them, which
    # could then read the honest line out and write its own); a socket cannot be.
    pair = socket.socketpair() if uses_fd else None
    rfd, wfd = (pair[0].detach(), pair[1].detach()) if pair else (-1, -1)
    sfd = -1   # the seccomp filter's pipe, read by bwrap
    channel = b""
    try:
        argv = expand_cmd(spec["cmd"], workspace=container["workdir"] if container else cwd, gate=gate_dir,
                          oracle=oracle_dir, **({"receipt_fd": str(wfd)} if uses_fd else {}))
        if sandbox["kind"] == "bwrap":
            sfd = seccomp_fd() or -1
            argv = check_sandbox(sandbox["binary"], argv, cenv, cwd=cwd,
                                 hidden=study_hidden_dirs(paths.root, [task.root.parent]),
                                 ro=[gate_dir] + ([oracle_dir] if which == "oracle" else []),
                                 seccomp=sfd if sfd >= 0 else None, container=container,
                                 container_base=gate_dir if which == "gate" else oracle_dir)
        fds = ((wfd,) if uses_fd and os.name == "posix" else ()) + ((sfd,) if sfd >= 0 else ())
        res = run_command(argv, cwd=cwd, env=cenv, timeout_s=check_timeout_s(spec, which), platform=platform,
                          pass_fds=fds)
        if uses_fd:
            os.close(wfd)
            wfd = -1
            channel = read_receipt_pipe(rfd) if os.name == "posix" else b""
    finally:
        for fd in (rfd, wfd, sfd):
            if fd >= 0:
                os.close(fd)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if uses_fd:
        line, problem = receipt_channel_line(channel)
        if os.name != "posix":   # an inherited descriptor number means nothing to a Windows child
            problem = "the receipt channel ({receipt_fd}) needs a POSIX host"
        # The line's coherence is judged alone (as if exit 0); the exit status is the channel
        # verdict's: a pass with a failing exit is the check's failure there, not a grader error.
        rec = receipt_channel_verdict(parse_receipt(line or "", 0, res.timed_out, which=which),
                                      problem, res.returncode, timed_out=res.timed_out)
    else:
        rec = parse_receipt(res.stdout, res.returncode, res.timed_out, which=which,
                            required=spec.get("receipt") == "json")
        rec.update({"receipt_channel": "stdout" if rec.get("receipt") == "json" else "exit_code",
                    "receipt_protected": False})
    rec["sandbox"] = sandbox_record(sandbox)
    rec.update({"which": which, "exit_code": res.returncode, "timed_out": res.timed_out,
                "output_capped": res.output_capped,
                "wall_s": round(res.wall_s, 3), "stdout_tail": res.stdout[-4000:],
                "stderr_tail": res.stderr[-4000:],
                "at": utc_now()})
    if which == "oracle":
        rec["success"] = bool(rec["passed"]) and rec["score"] >= task.threshold and not rec["grader_error"]
        rec["threshold"] = task.threshold
    return rec


def apply_reference(paths: StudyPaths, platform: "Platform", task: Task, ws: str,
                    env: Mapping[str, str]) -> str | None:
    """Put the task's reference solution into the workspace `ws` (a copy the caller owns); the
    problem, or None.  An overlay (reference/) is copied onto it; a script (task.json `reference`)
    runs in it like a check: credential-free, sandboxed, {reference} naming a pristine copy of
    reference/ (read-only), or with a container spec the workspace at its workdir."""
    spec = task.reference_spec
    if spec is None:
        copy_tree(task.reference, ws)
        return None
    ref_dir = str(pristine_copy(paths, task, "reference"))
    container = spec.get("container")
    cenv, _ = check_env(env)
    sandbox = resolve_sandbox(sandbox_mode_of(read_json(paths.study_file, default=None) or {}), cenv)
    if container and sandbox["kind"] != "bwrap":
        return f"the reference script cannot run: {container_unavailable(container, sandbox)}"
    argv = [a.replace("{reference}", ref_dir) for a in
            expand_cmd(spec["cmd"], workspace=container["workdir"] if container else ws,
                       gate="<gate-not-available>", oracle="<oracle-not-available>")]
    sfd = seccomp_fd() if sandbox["kind"] == "bwrap" else None
    try:
        if sandbox["kind"] == "bwrap":
            argv = check_sandbox(sandbox["binary"], argv, cenv, cwd=ws,
                                 hidden=study_hidden_dirs(paths.root, [task.root.parent]), ro=[ref_dir],
                                 seccomp=sfd, container=container, container_base=ref_dir)
        timeout = check_timeout_s(spec, "reference")
        res = run_command(argv, cwd=ws, env=cenv, timeout_s=timeout, platform=platform,
                          pass_fds=() if sfd is None else (sfd,))
    finally:
        if sfd is not None:
            os.close(sfd)
    if res.timed_out:
        return f"the reference script timed out after {timeout:g} s"
    if res.returncode != 0:
        return f"the reference script exited {res.returncode}: {(res.stderr or res.stdout)[-300:]}"
    return None


def reference_overlay(paths: StudyPaths, platform: "Platform", task: Task, env: Mapping[str, str]) -> Task:
    """The task with a script reference's effect as an overlay (`overlay`: every file the script
    added or changed, as text), for a rehearsal whose scripted agent writes files; kept under the
    study's state by bundle hash.  An overlay reference, or a script that fails, leaves it as it is
    (calibration says why)."""
    if task.reference_spec is None:
        return task
    dst = paths.state / "pristine" / task.id / task.bundle_sha256[:16] / "reference-overlay"
    if not dst.is_dir():
        with tempfile.TemporaryDirectory(prefix=f"ab-ref-{task.id}-") as tmp:
            ws = os.path.join(tmp, "ws")
            copy_tree(task.public, ws)
            if apply_reference(paths, platform, task, ws, env):
                return task
            after = tree_manifest(ws, UNCAPPED)
            staged = dst.with_name(f".overlay.{uuid.uuid4().hex[:8]}")
            for rel, digest in after.items():
                changed = task.public_manifest.get(rel) != digest
                if not changed or digest.startswith(("symlink:", "special:")):
                    continue
                (staged / rel).parent.mkdir(parents=True, exist_ok=True)
                safe_copy_file(os.path.join(ws, rel), staged / rel, None)
                try:   # the scripted agent writes text through the Write tool: binary is left out
                    (staged / rel).read_bytes().decode("utf-8")
                except UnicodeDecodeError:
                    (staged / rel).unlink()
            staged.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(staged, dst)
            except OSError:
                shutil.rmtree(staged, ignore_errors=True)
    return dataclasses.replace(task, overlay=dst)


# -- grader errors proven --------------------------------------------------------------------------
# A check that times out, crashes, is killed or stopped, or prints an incoherent receipt gave no
# verdict; but the code under test runs inside it and can cause exactly that (a solution that
# sends SIGSTOP to its harness makes the check time out).  So the same check is re-run at once on
# the task's reference (starter + reference/, which calibration proved passes) in a fresh copy:
# if the reference passes, the grader works and the solution caused the error -- the agent's
# failure; only when the reference fails too is it a grader error, which excludes the run.

def grader_error_proof(error: str, reference: Mapping[str, Any] | None, which: str) -> dict[str, Any]:
    """What a check's grader error means once the same check ran on the reference (pure).

    `reference` is that re-run's receipt (None: the task has no reference to re-run on).  Returns
    grader_error (None when the solution caused it), grader_error_caused_by_solution (the error,
    or None) and reference_rerun (what the re-run gave)."""
    if reference is None:
        return {"grader_error": error, "grader_error_caused_by_solution": None,
                "reference_rerun": {"ran": False, "why": "the task has no reference/ to re-run on"}}
    ref_error = reference.get("grader_error")
    ref_passed = bool(reference.get("success") if which == "oracle" else reference.get("passed"))
    rerun = {"ran": True, "passed": ref_passed and not ref_error, "grader_error": ref_error,
             "score": reference.get("score"), "timed_out": reference.get("timed_out"),
             "exit_code": reference.get("exit_code")}
    if ref_passed and not ref_error:
        return {"grader_error": None, "grader_error_caused_by_solution": error, "reference_rerun": rerun}
    why = ref_error or f"the reference does not pass (score {reference.get('score')})"
    return {"grader_error": f"{error}; on the reference too: {why}"[:600],
            "grader_error_caused_by_solution": None, "reference_rerun": rerun}


def run_check_proven(paths: StudyPaths, platform: "Platform", task: Task, which: str, workspace: str,
                     env: Mapping[str, str]) -> dict[str, Any]:
    """run_check(); when it gives a grader error, the same check re-run on the reference decides
    whose error it was (grader_error_proof).  A solution-caused error is a fail with score 0."""
    rec = run_check(paths, platform, task, which, workspace, env)
    error = rec.get("grader_error")
    if not error:
        return rec
    reference = None
    if task.reference.is_dir():
        with tempfile.TemporaryDirectory(prefix=f"ab-ref-{task.id}-") as tmp:
            ws = os.path.join(tmp, "reference")
            try:
                copy_tree(task.public, ws)
                failed = apply_reference(paths, platform, task, ws, env)
                reference = (run_check(paths, platform, task, which, ws, env) if failed is None
                             else {"grader_error": failed, "passed": False, "success": False})
            except (OSError, shutil.Error, AgentbenchError) as exc:
                reference = {"grader_error": f"the reference could not be checked: {type(exc).__name__}",
                             "passed": False, "success": False}
    proof = grader_error_proof(str(error), reference, which)
    rec.update(proof)
    if proof["grader_error_caused_by_solution"]:
        rec.update({"passed": False, "score": 0.0})
        if which == "oracle":
            rec["success"] = False
    return rec


# -- calibration -----------------------------------------------------------------------------------

def check_failure_text(rec: Mapping[str, Any]) -> str:
    """Why a check did not pass, in one line a task author can act on (pure): the receipt's
    problem or the grader error, the exit status, and the end of its stderr."""
    parts = []
    if rec.get("receipt_problem"):
        parts.append(str(rec["receipt_problem"]))
    if rec.get("grader_error"):
        parts.append(f"grader error: {rec['grader_error']}")
    if rec.get("timed_out"):
        parts.append("timed out")
    parts.append(f"exit {rec.get('exit_code')}")
    tail = str(rec.get("stderr_tail") or "").strip()
    if tail:
        parts.append("stderr: " + " | ".join(tail.splitlines()[-3:])[-300:])
    return "; ".join(parts)


def check_diagnosis(rec: Mapping[str, Any]) -> dict[str, Any]:
    """What calibrate records of one check run: its verdict and, when it did not pass, why."""
    out = {"passed": bool(rec.get("passed")), "score": rec.get("score"), "exit_code": rec.get("exit_code")}
    if rec.get("receipt_problem"):
        out["receipt_problem"] = rec["receipt_problem"]
    if rec.get("grader_error"):
        out["grader_error"] = rec["grader_error"]
    if not out["passed"] or rec.get("grader_error"):
        out["stderr_tail"] = str(rec.get("stderr_tail") or "")[-500:]
    return out


def calibrate_task(paths: StudyPaths, platform: "Platform", task: Task,
                   env: Mapping[str, str]) -> dict[str, Any]:
    """No model: the reference passes gate and oracle twice; the untouched starter fails the oracle."""
    problems: list[str] = []
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"ab-cal-{task.id}-") as tmp:
        starter = os.path.join(tmp, "starter")
        copy_tree(task.public, starter)
        st = run_check(paths, platform, task, "oracle", starter, env)
        if st["success"]:
            problems.append("the hidden tests pass on the untouched starter (they measure nothing)")
        if not task.reference.is_dir():
            problems.append("no reference/ solution overlay")
        else:
            for i in (1, 2):
                ws = os.path.join(tmp, f"ref{i}")
                copy_tree(task.public, ws)
                failed = apply_reference(paths, platform, task, ws, env)
                if failed:
                    problems.append(f"attempt {i}: {failed}")
                    runs.append({"attempt": i, "reference_problem": failed})
                    continue
                g = run_check(paths, platform, task, "gate", ws, env)
                o = run_check(paths, platform, task, "oracle", ws, env)
                runs.append({"attempt": i, "gate_passed": g["passed"], "oracle_score": o["score"],
                             "oracle_success": o["success"], "gate": check_diagnosis(g),
                             "oracle": check_diagnosis(o)})
                if not g["passed"]:
                    problems.append(f"attempt {i}: the gate fails on starter + reference: "
                                    + check_failure_text(g))
                if o.get("grader_error"):
                    problems.append(f"attempt {i}: the oracle gave no valid verdict: "
                                    + check_failure_text(o))
                elif not o["success"]:
                    problems.append(f"attempt {i}: the hidden tests score {o['score']} "
                                    f"< threshold {task.threshold}: " + check_failure_text(o))
        partial_gate = None
        if task.partial.is_dir():
            # The rehearsal submits partial/ first so that gate feedback cycles really happen:
            # it must fail the gate, or the gated arms are never exercised.
            ws = os.path.join(tmp, "partial")
            copy_tree(task.public, ws)
            copy_tree(task.partial, ws)
            partial_gate = run_check(paths, platform, task, "gate", ws, env)["passed"]
            if partial_gate:
                problems.append("the gate passes on starter + partial/ (it must fail, or rehearsed gate "
                                "cycles never happen)")
    lost = task.spec.get("not_carried_over")
    if problems and isinstance(lost, list) and lost:
        problems.append("the task was imported and this host lacks what its environment gave it: "
                        + "; ".join(str(x)[:200] for x in lost[:20]))
    return {"task": task.id, "ok": not problems, "problems": problems, "bundle_sha256": task.bundle_sha256,
            "starter_oracle_score": st["score"], "reference": runs, "partial_gate_passed": partial_gate,
            "at": utc_now()}


def calibration_to_reuse(given: Mapping[str, Any] | None,
                         tasks: Mapping[str, Task]) -> dict[str, dict[str, Any]]:
    """Of calibration results measured moments ago (task id -> calibrate_task's answer), those
    still true of `tasks`: the entry is a well-formed result of that task with the bundle it has
    now.  A task whose files changed since (or that has no entry) must be calibrated again."""
    out: dict[str, dict[str, Any]] = {}
    for tid, task in tasks.items():
        got = (given or {}).get(tid)
        if (isinstance(got, Mapping) and got.get("task") == tid and isinstance(got.get("ok"), bool)
                and got.get("bundle_sha256") == task.bundle_sha256):
            out[tid] = dict(got)
    return out


def calibration_state(paths: StudyPaths) -> dict[str, Any]:
    return read_json(paths.state / "calibration.json", default=None) or {"tasks": {}}


def uncalibrated(paths: StudyPaths, tasks: Mapping[str, Task]) -> list[str]:
    cal = calibration_state(paths).get("tasks", {})
    return sorted(t.id for t in tasks.values()
                  if not (cal.get(t.id, {}).get("ok") and cal[t.id].get("bundle_sha256") == t.bundle_sha256))


# ==================================================================================================
# Runs and the pipeline
# ==================================================================================================
# The assignment manifest, run records, workspaces, the behaviour audit and the per-run pipeline
# (sessions, gate, review, evaluation).  Runs are built from jobs (sections above); a run record
# (state/runs/<run_id>.json) is written only by the driver that claimed the run.  The pipeline
# never raises: an infrastructure problem ends the run `error` with its reason.  Nothing here knows
# the scripted model: rehearsal plugs in through the `script_for` callback.

# -- assignment ------------------------------------------------------------------------------------

def make_assignment(task_ids: Sequence[str], arm_names: Sequence[str], repeats: int, seed: int,
                    split: str = "main") -> list[dict[str, Any]]:
    """The randomized, paired, blocked manifest (pure and deterministic in its inputs).

    Tasks are shuffled; each task is one block holding every (arm, repeat) cell, shuffled inside
    the block.  Inputs are sorted first, so the manifest depends only on the sets and the seed.
    """
    if repeats < 1:
        raise AgentbenchError("repeats must be >= 1", code="repeats_below_1", repeats=repeats)
    rng = random.Random(f"agentbench-assign:{seed}:{split}")
    tasks = sorted(task_ids)
    rng.shuffle(tasks)
    prefix = "r" if split == "main" else f"{split}-r"
    out: list[dict[str, Any]] = []
    n = 0
    for b, task in enumerate(tasks, start=1):
        cells = [(arm, rep) for arm in sorted(arm_names) for rep in range(1, repeats + 1)]
        rng.shuffle(cells)
        for order, (arm, rep) in enumerate(cells, start=1):
            n += 1
            out.append({"run_id": f"{prefix}{n:04d}", "task": task, "arm": arm, "repeat": rep,
                        "block": f"b{b:02d}", "order_in_block": order, "split": split})
    return out


def manifest_bytes(manifest: Sequence[Mapping[str, Any]], seed: int, split: str,
                   plan: Mapping[str, Any] | None = None) -> bytes:
    doc: dict[str, Any] = {"split": split, "seed": seed, "runs": list(manifest)}
    if plan is not None:
        doc["analysis_plan"] = dict(plan)   # fixed before any run (see analysis_plan)
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


# -- runs ------------------------------------------------------------------------------------------

RUN_FINAL = ("finished", "error", "interrupted")
# What one attempt of a run writes on its record (moved aside when the breaker pauses the run).
RUN_ATTEMPT_KEYS = ("jobs", "cost_usd", "cost_estimated", "tokens", "gates", "gate_cycles", "reviews",
                    "review_verdicts", "interruption", "workspace", "provenance", "driver", "started_at",
                    "started_ts", "queued_s")


def run_file(paths: StudyPaths, run_id: str) -> Path:
    return paths.run_index / f"{checked_id('run', run_id)}.json"


def load_run(paths: StudyPaths, run_id: str) -> RunRecord:
    rec = read_json(run_file(paths, run_id), default=None)
    if rec is None:
        raise AgentbenchError("no such run", code="no_such_run",
                              run=run_id, hint="see `agentbench.py list --all` or `assign`")
    return rec


def save_run(paths: StudyPaths, rec: RunRecord | Mapping[str, Any]) -> None:
    write_json_atomic(run_file(paths, rec["run_id"]), rec)


def run_is_final(paths: StudyPaths, run_id: str) -> bool:
    return load_run(paths, run_id).get("status") in RUN_FINAL


def run_summary(paths: StudyPaths, run_id: str) -> dict[str, Any]:
    r = load_run(paths, run_id)
    ev = r.get("evaluation") or {}
    return {k: v for k, v in {"run_id": run_id, "task": r.get("task"), "arm": r.get("arm"),
                              "repeat": r.get("repeat"), "status": r.get("status"),
                              "outcome": r.get("outcome"), "validity": r.get("validity"),
                              "success": ev.get("success"), "score": ev.get("score"),
                              "cost_usd": r.get("cost_usd"), "gate_cycles": r.get("gate_cycles"),
                              "reason": r.get("error") or r.get("failure_reason")}.items()
            if v is not None}


def all_run_ids(paths: StudyPaths) -> list[str]:
    """Every run id, sorted: the run index's `*.json` names (no Path object per run: this is
    the one O(runs) step of `list --all`)."""
    try:
        names = os.listdir(paths.run_index)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and not n.startswith(".") and len(n) > 5)


def list_runs(paths: StudyPaths, all_runs: bool = False, status: str | None = None) -> list[dict[str, Any]]:
    """Runs for `list`: the running ones (markers, O(running)), or every run with all_runs."""
    ids = all_run_ids(paths) if all_runs else list_markers(paths.state / "running_runs")
    out = [run_summary(paths, r) for r in ids if run_file(paths, r).exists()]
    return [r for r in out if status is None or r.get("status") == status]


def latest_run_job(paths: StudyPaths, run_id: str) -> str | None:
    jobs = load_run(paths, run_id).get("jobs") or []
    execs = [j for j in jobs
             if j.get("role") in ("executor", "continue", "resume", "repair", "gate_feedback")]
    return execs[-1]["job_id"] if execs else None


def sweep_interrupted_runs(paths: StudyPaths, platform: "Platform") -> list[str]:
    """A run found `running` without a live driver becomes `interrupted` (never silently retried)."""
    out = []
    for rid in list_markers(paths.state / "running_runs"):
        rec = read_json(run_file(paths, rid), default=None)
        if rec is None or rec.get("status") != "running":
            # A claim writes the marker just before the record: leave a fresh marker alone.
            with contextlib.suppress(FileNotFoundError):
                if time.time() - os.stat(paths.state / "running_runs" / rid).st_mtime > 60:
                    remove_marker(paths.state / "running_runs" / rid)
            continue
        drv = rec.get("driver") or {}
        if drv.get("pid") is None:
            continue   # driven by hand: the orchestrator owns it (its jobs have their own watchdogs)
        if driver_alive(platform, drv) is not False:
            continue   # alive, or on another host without a beat file to tell
        # Its in-flight job, if any, is killed: a dead driver must not leave a session spending.
        for j in rec.get("jobs") or []:
            if (paths.active / j["job_id"]).exists():
                with contextlib.suppress(AgentbenchError):
                    kill_job(paths, platform, j["job_id"], reason="driver_lost", wait_s=5)
        rec.update({"status": "interrupted", "outcome": "interrupted", "interrupted_at": utc_now(),
                    "error": "the driver of this run died while it was in flight"})
        save_run(paths, rec)
        remove_marker(paths.state / "running_runs" / rid)
        append_event(paths, "run_finished", run_id=rid, status="interrupted")
        out.append(rid)
    return out


def kill_run(ctx: Host, paths: StudyPaths, run_id: str) -> dict[str, Any]:
    """Kill a run's in-flight jobs (its driver then records the outcome)."""
    rec = load_run(paths, run_id)
    results = []
    for j in rec.get("jobs") or []:
        if (paths.active / j["job_id"]).exists():
            results.append(kill_job(paths, ctx.platform, j["job_id"], reason="run_killed", env=ctx.env))
    return {"run_id": run_id, "jobs": results,
            "survivors": sorted({p for r in results for p in r["survivors"]})}


def register_runs(paths: StudyPaths, manifest: Sequence[Mapping[str, Any]], seed: int, split: str,
                  faults: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Write the run records (not_started) of a manifest; existing records are left alone."""
    paths.run_index.mkdir(parents=True, exist_ok=True)
    for m in manifest:
        f = run_file(paths, m["run_id"])
        if f.exists():
            continue
        rec = {**m, "status": "not_started", "seed": seed, "jobs": [], "cost_usd": 0.0,
               "fault": dict((faults or {}).get(m["run_id"]) or {}) or None}
        write_json_atomic(f, rec)


# -- workspace, audit, artifacts -------------------------------------------------------------------

def git(platform: "Platform", cwd: str, *args: str, host_env: Mapping[str, str]) -> CommandResult:
    """git in `cwd` with the check commands' environment built from `host_env`, as agentbench."""
    env = {**check_env(host_env)[0], "GIT_AUTHOR_NAME": "agentbench",
           "GIT_AUTHOR_EMAIL": "agentbench@localhost", "GIT_COMMITTER_NAME": "agentbench",
           "GIT_COMMITTER_EMAIL": "agentbench@localhost"}
    return run_command(["git", *args], cwd=cwd, env=env, timeout_s=60, platform=platform)


def prepare_workspace(paths: StudyPaths, platform: "Platform", task: Task, run_dir: Path,
                      missing_fixture: str | None = None,
                      host_env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Copy public/ into runs/<id>/workspace, git-init and commit it, verify it against the bundle.
    git runs with `host_env` (the Host's environment; a caller without a Host: this process's)."""
    host_env = os.environ if host_env is None else host_env
    ws = run_dir / "workspace"
    refuse_bundle_symlinks(task.id, task.root)
    if ws.exists():
        shutil.rmtree(ws)
    copy_tree(task.public, ws)
    got = tree_manifest(ws)
    if got != task.public_manifest:
        raise AgentbenchError("workspace copy does not match the task bundle",
                              code="workspace_copy_does_not_match", task=task.id,
                              missing=sorted(set(task.public_manifest) - set(got)),
                              differing=sorted(k for k in got if task.public_manifest.get(k) != got[k]))
    info: dict[str, Any] = {"path": str(ws), "files": len(got), "manifest_sha256": manifest_sha256(got)}
    if shutil.which("git"):
        ok = git(platform, str(ws), "init", "-q", host_env=host_env).returncode == 0
        ok = ok and git(platform, str(ws), "add", "-A", host_env=host_env).returncode == 0
        ok = ok and git(platform, str(ws), "commit", "-q", "-m", "starter", host_env=host_env).returncode == 0
        info["git"] = ok
    if missing_fixture:
        target = ws / missing_fixture
        info["missing_fixture"] = {"path": missing_fixture, "existed": target.exists()}
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    return info


def artifact_manifest(ws: str | os.PathLike[str], caps: CopyCaps = DEFAULT_COPY_CAPS) -> dict[str, Any]:
    """Every file the run left, by shown name: digest (links and special files never followed)
    and size; within the copy caps (UnusableTree past them)."""
    files = {rel: {"sha256": digest, "size": size} for rel, (digest, size) in tree_entries(ws, caps).items()}
    return {"files": files, "sha256": manifest_sha256({k: v["sha256"] for k, v in files.items()})}


_PATH_KEYS = ("file_path", "path", "notebook_path")


def shell_steps(command: str) -> list[tuple[str, str | None, bool]]:
    """A shell command split into simple steps: (text, separator before it, inside a here-doc).

    Separators are `&&`, `||`, `;` and newlines (None before the first step).  The lines of a
    here-document body (`<<WORD`, `<<-WORD`, `<<'WORD'` ... up to the line WORD) are steps of their
    own, marked, so that a `cd` written into a file is not taken for one the shell ran.  A
    heuristic for the audit, not a shell parser: quotes and subshells are not interpreted."""
    steps: list[tuple[str, str | None, bool]] = []
    lines = command.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        parts = re.split(r"(&&|\|\||;)", line)
        for k in range(0, len(parts), 2):
            before = parts[k - 1] if k > 0 else ("\n" if steps else None)
            steps.append((parts[k], before, False))
        i += 1
        heredoc = re.search(r"<<-?\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                steps.append((lines[i], "\n", True))
                i += 1
            i += 1   # the closing delimiter
    return steps


def audit_tool_calls(calls: Iterable[Mapping[str, Any]], workspace: str,
                     protected: Mapping[str, str]) -> list[dict[str, Any]]:
    """Behaviour audit (pure): tool calls that touch paths outside the workspace or read protected dirs.

    `protected` maps a label (study, oracle, gate, tasks) to a directory.  Relative paths of file
    tools are taken against the workspace.  Bash commands are scanned for absolute paths and
    protected dirs; their relative paths with a `..` part are resolved against the workspace,
    the shallowest place the shell can be in (a cd out of it is itself a finding, and the Bash
    tool puts the shell back), except in the steps joined by `&&` after a plain `cd DIR`: those
    run only if the cd succeeded, so in DIR (a subshell, `&`, pushd or popd ends that).  Thus
    `cd pkg && cat ../README` is no climb out, while `cd nosuch; cat ../x` is one -- and so,
    conservatively, is `cat ../x` in a later command after a `cd pkg`, since that cd may have
    failed.
    """
    findings: list[dict[str, Any]] = []
    ws = os.path.normpath(workspace)

    def inside(p: str, root: str) -> bool:
        p, root = os.path.normpath(p), os.path.normpath(root)
        return p == root or p.startswith(root.rstrip(os.sep) + os.sep)

    for call in calls:
        name = str(call.get("name") or "")
        inp = call.get("input") if isinstance(call.get("input"), dict) else {}
        targets = [str(inp[k]) for k in _PATH_KEYS if isinstance(inp.get(k), str)]
        if name == "Bash" and isinstance(inp.get("command"), str):
            cmd = inp["command"]
            for label, d in protected.items():
                if d and os.path.normpath(d) in cmd and not inside(d, ws):
                    findings.append({"kind": f"bash_touches_{label}", "tool": name, "detail": cmd[:300]})
            for tok in re.findall(r"(?<![\w.])(/[^\s'\"|;&<>()]+)", cmd):
                if not inside(tok, ws) and not tok.startswith(("/dev/", "/tmp/", "/usr/", "/bin/",
                                                               "/proc/self")):
                    findings.append({"kind": "bash_path_outside_workspace", "tool": name, "path": tok})
            # Relative paths that climb out of the workspace (../../state/...), step by step.
            here = ws                       # where the current step runs
            for step, before, in_heredoc in shell_steps(cmd):
                # A directory is kept only along a plain `&&` chain: a subshell, a background `&`,
                # pushd/popd or a here-doc puts the judging back in the workspace.
                if before != "&&" or in_heredoc or re.search(r"[()&]|\b(pushd|popd)\b", step):
                    here = ws
                for tok in re.findall(r"[^\s'\"|;&<>()=:]+", step):
                    if os.path.isabs(tok) or ".." not in re.split(r"[/\\]", tok):
                        continue
                    full = os.path.normpath(os.path.join(here, tok))
                    if inside(full, ws):
                        continue
                    findings.append({"kind": "bash_path_outside_workspace", "tool": name, "path": tok})
                    for label, d in protected.items():
                        if d and inside(full, d):
                            findings.append({"kind": f"bash_touches_{label}", "tool": name, "path": tok})
                cd = None if in_heredoc else re.fullmatch(
                    r"\s*cd\s+([^\s'\"$`~|;&<>()-][^\s'\"$`~|;&<>()]*)\s*", step)
                if cd:
                    target = os.path.normpath(os.path.join(here, cd.group(1)))
                    here = target if inside(target, ws) else ws
                elif not in_heredoc and re.match(r"\s*cd(\s|$)", step):
                    here = ws               # bare cd, cd -, cd ~, cd $X: not followed
        for t in targets:
            full = t if os.path.isabs(t) else os.path.join(ws, t)
            if not inside(full, ws):
                kind = "write_outside_workspace" if name in ("Write", "Edit", "MultiEdit", "NotebookEdit") \
                    else "read_outside_workspace"
                findings.append({"kind": kind, "tool": name, "path": t})
                for label, d in protected.items():
                    if d and inside(full, d):
                        findings.append({"kind": f"reads_{label}", "tool": name, "path": t})
    return findings


def hidden_file_copies(task: Task, artifacts: Mapping[str, Any], part: str) -> list[dict[str, str]]:
    """Workspace files byte-equal to a file of the task's `part` (oracle/ or reference/), from the
    size in AUDIT_HIDDEN_MATCH_MIN_BYTES on, that the public starter did not already hold: a copy
    of what the agent must not see.  Over the artifact manifest and the bundle's own files."""
    public = set(task.public_manifest.values())
    out: list[dict[str, str]] = []
    for part, min_bytes in [(part, AUDIT_HIDDEN_MATCH_MIN_BYTES[part])]:
        base = task.root / part
        hidden: dict[str, str] = {}
        for rel, (digest, size) in tree_entries(base, UNCAPPED).items():
            if size >= min_bytes and digest not in public:
                hidden.setdefault(digest, f"{part}/{rel}")
        for rel, info in sorted((artifacts.get("files") or {}).items()):
            if isinstance(info, dict) and info.get("sha256") in hidden:
                out.append({"file": rel, "equals": hidden[str(info["sha256"])]})
    return out


def edited_public_tests(task: Task, ws: str | os.PathLike[str]) -> list[str]:
    """Public test files the agent changed or deleted (a gamed gate is a behaviour finding)."""
    out = []
    for rel, digest in task.public_manifest.items():
        parts = rel.split("/")
        if not any(p.startswith("test") for p in parts):
            continue
        f = Path(ws) / rel
        try:
            same = entry_digest(f, DEFAULT_COPY_CAPS.file_bytes) == digest   # never followed
        except (OSError, UnusableTree):
            same = False
        if not same:
            out.append(rel)
    return out


# -- the pipeline ----------------------------------------------------------------------------------

@dataclass
class PipelineOptions:
    """How a driver runs pipelines: env for claude, script hook (rehearsal), parallel cap, force."""
    env_extra: dict[str, str] = field(default_factory=dict)
    script_for: Callable[[dict[str, Any], str, int, str], str | None] | None = None
    force: bool = False
    driver: dict[str, Any] | None = None
    poll_s: float = 0.2
    progress: Callable[[str], None] | None = None
    rehearsal: bool = False


#: The checkout's commit, looked up once per process.
_GIT_COMMIT: list[str | None] = []


def agentbench_git_commit(platform: "Platform", host_env: Mapping[str, str]) -> str | None:
    """The git commit of this agentbench checkout (provenance), or None outside a checkout; git
    runs with the check commands' environment built from `host_env`."""
    if not _GIT_COMMIT:
        res = run_command(["git", "rev-parse", "HEAD"], cwd=str(HERE), env=check_env(host_env)[0],
                          timeout_s=20, platform=platform) if shutil.which("git") else None
        _GIT_COMMIT.append(res.stdout.strip() if res and res.returncode == 0 else None)
    return _GIT_COMMIT[0]


#: A reviewer's review.json is read up to this many bytes (a larger one is an invalid review).
REVIEW_MAX_BYTES = 1 << 20
#: A run ends with this outcome when its workspace could not be copied or read within the copy
#: rules (caps, depth, names) or outgrew the live cap: the agent's failure, valid, in the primary view.
WORKSPACE_UNUSABLE = "workspace_unusable"
#: A session that "succeeded" faster than this with no tool call and no solution did nothing.
DEGENERATE_SESSION_S = 10.0
#: Audit findings that mean the agent saw what it must not (the hidden tests, the reference): a
#: success with one of them is not a valid success (validity `tainted`, out of the primary view).
HIDDEN_ACCESS_KINDS = frozenset({"reads_oracle", "bash_touches_oracle", "reads_reference",
                                 "bash_touches_reference", "copies_hidden_files"})


class RunVerdict(NamedTuple):
    outcome: str            # success | failure | budget_exhausted | timeout | grader_error
    validity: str           # valid | infrastructure_failure | degenerate
    validity_reason: str | None
    failure_reason: str | None


def classify_run(*, stop: str | None, first_session: Mapping[str, Any] | None, tool_uses: int,
                 success: bool, grader_error: str | None = None,
                 hidden_access: Iterable[str] = (), solution_broke_grader: str | None = None) -> RunVerdict:
    """A finished run's outcome and validity label (pure, SPEC 7).  `stop` is why its session loop
    ended (None: it ran its course; "infrastructure:<status>:<reason>" when not the agent's doing;
    "budget_exhausted", "timeout", "killed:<reason>", "workspace_unusable:<why>" when the agent
    left a workspace agentbench cannot copy or read within its caps, or outgrew the live cap: a
    valid failure, never an exclusion); `first_session` is its first executor job
    as the run record keeps it; `success` is the hidden tests' verdict, `grader_error` why they
    gave none (invalid grading, proven by the reference failing the same check too: never the
    agent's failure); `solution_broke_grader` a check error that the reference's re-run showed the
    solution caused (the agent's failure, `grader_error_caused_by_solution`); `hidden_access` the
    audit's findings of hidden material seen (HIDDEN_ACCESS_KINDS), which make a success `tainted`."""
    infra = bool(stop and stop.startswith("infrastructure:"))
    if infra:
        validity, why = "infrastructure_failure", str(stop).split(":", 1)[1]
    elif stop and stop.startswith(WORKSPACE_UNUSABLE + ":"):
        validity, why = "valid", None
    elif grader_error:
        validity, why = "infrastructure_failure", f"grader_error: {grader_error}"
    elif first_session and first_session.get("status") == "ok" and tool_uses == 0 \
            and float(first_session.get("duration_s") or 0) < DEGENERATE_SESSION_S and not success:
        validity, why = "degenerate", "the session ended in seconds without a single tool call"
    else:
        validity, why = "valid", None
    seen = sorted(set(hidden_access))
    if success and validity == "valid" and seen:
        validity, why = "tainted", "the audit found the agent saw hidden material: " + ", ".join(seen)
    unusable = bool(stop and stop.startswith(WORKSPACE_UNUSABLE + ":"))
    if unusable:
        outcome = WORKSPACE_UNUSABLE
    elif grader_error and not infra:
        outcome = "grader_error"
    elif stop == "budget_exhausted":
        outcome = "budget_exhausted"
    elif stop == "timeout":
        outcome = "timeout"
    else:
        outcome = "success" if success else "failure"
    failure = None if success else ("grader_error" if outcome == "grader_error"
                                    else (stop or ("grader_error_caused_by_solution" if solution_broke_grader
                                                   else "hidden tests failed")))
    return RunVerdict(outcome, validity, why, failure)


class RunPipeline:
    """The per-run pipeline of SPEC section 7 for one run; `execute()` never raises."""

    def __init__(self, ctx: Host, paths: StudyPaths, run_id: str, cfg: Mapping[str, Any],
                 tasks: Mapping[str, Task], arms: Mapping[str, Arm], templates: Mapping[str, string.Template],
                 opts: PipelineOptions):
        self.ctx = ctx
        self.paths = paths
        self.run_id = run_id
        self.cfg = cfg
        self.launch = launch_config(cfg)
        self.tasks = tasks
        self.arms = arms
        self.tpl = templates
        self.opts = opts
        self.rec: RunRecord = {}   # type: ignore[typeddict-item]  # claim() loads it
        self.spent = 0.0
        self.attempt = 0
        #: job id -> when it was submitted to Slurm (this process's monotonic clock), until its
        #: supervisor is seen to start: the wait is measured on one clock, never two hosts'.
        self._in_slurm_queue: dict[str, float] = {}

    # -- bookkeeping -------------------------------------------------------------------------------
    def _save(self) -> None:
        self.rec["updated_at"] = utc_now()
        save_run(self.paths, self.rec)

    def _event(self, event: str, **fields: Any) -> None:
        append_event(self.paths, event, run_id=self.run_id, **fields)
        if self.opts.progress:
            self.opts.progress(f"{self.run_id} {event} " + " ".join(f"{k}={v}" for k, v in fields.items()))

    def claim(self) -> bool:
        """Take the run (not_started -> running) under the lock; False if it is not ours to run."""
        with RegistryLock(self.paths.lock, self.ctx.platform):
            rec = load_run(self.paths, self.run_id)
            if rec.get("status") != "not_started":
                return False
            rec.update({"status": "running", "driver": self.opts.driver, "started_at": utc_now(),
                        "jobs": [], "cost_usd": 0.0})
            rec.pop("paused_by_breaker", None)
            # The marker first: a crash between the two leaves a marker the sweep cleans up,
            # never a `running` run that nothing would look at.
            touch_marker(self.paths.state / "running_runs" / self.run_id)
            save_run(self.paths, rec)
        self.rec = rec
        return True

    def remaining_usd(self) -> float:
        return float(self.launch["budget"].get("usd_per_run") or 0) - float(self.rec.get("cost_usd") or 0.0)

    # -- jobs --------------------------------------------------------------------------------------
    def _run_job(self, role: str, prompt: str, **kw: Any) -> dict[str, Any]:
        """Launch one job of this run and wait for its result."""
        jid = self.launch_job(role, prompt, **kw)
        if jid is None:
            return {"status": "failed", "reason": "budget", "skipped": True}
        return self._await_job(jid)

    def launch_job(self, role: str, prompt: str, *, cwd: str, resume_job: str | None = None,
                    system_extra: str = "", kind: str = "executor", fault: Mapping[str, Any] | None = None,
                    script_key: str | None = None, base: str | None = None) -> str | None:
        """Start one job of this run (not waiting); None when the budget forbids another session."""
        self.attempt = len(self.rec.get("jobs") or []) + 1
        budget = self.launch["budget"]
        remaining = self.remaining_usd()
        if remaining <= 0 or remaining < float(budget.get("min_remaining_usd") or 0):
            return None
        wall_left = float(budget.get("wall_s") or 0) - self.active_s()
        session_cap = float(self.launch["max_minutes"]) * 60
        limits = session_limits(
            self.launch,
            wall_s=(min(session_cap, max(MIN_SESSION_WALL_S, wall_left)) if budget.get("wall_s")
                    else session_cap),
            orphan_after_s=0 if self.opts.driver else None,
            max_budget_usd=max(round(remaining, 6), 0.000001),
            extra={"snapshot_seconds": self.cfg.get("snapshot_seconds") or [],
                   "snapshot_dir": str(self.paths.run_dir(self.run_id) / "snapshots"),
                   "snapshot_offset_s": round(self.active_s(), 3), **(fault or {})})
        marker = ""
        if self.opts.script_for:
            sid = self.opts.script_for(self.rec, role, self.attempt, script_key or role)
            if sid:
                marker = f"\n\n[agentbench-script:{sid}]\n"
        meta = {"run_id": self.run_id, "arm": self.rec["arm"], "task": self.rec["task"], "role": role}
        raw_dir = str(self.paths.run_dir(self.run_id) / "raw" / f"{self.attempt:02d}-{role}")
        while True:
            try:
                out = self._start(kind, prompt + marker, cwd, resume_job, limits, meta, system_extra,
                                  raw_dir, base)
                break
            except AgentbenchError as exc:
                if exc.payload.get("refusal") != "parallel_cap" or not self.opts.driver:
                    raise   # a call by hand answers at once; only a driver waits for a slot
                # Other work (a session driven by hand, a ping) holds the slots: wait for one.  The
                # wait is queueing, not the agent's time: it does not count against the run's wall.
                waited = time.monotonic()
                time.sleep(max(0.5, self.opts.poll_s))
                reap_jobs(self.paths, self.ctx.platform, env=self.ctx.env)
                self.add_queued(time.monotonic() - waited)
        if executor_for(self.launch.get("executor")).queues:
            self._in_slurm_queue[out["job_id"]] = time.monotonic()
        self.rec.setdefault("jobs", []).append({"job_id": out["job_id"], "role": role,
                                                "session_id": out.get("session_id")})
        self._save()
        return out["job_id"]

    def active_s(self) -> float:
        """The run's elapsed time without its queueing (slots, a Slurm queue): what its wall-time
        budget, its snapshots and the report's wall time count."""
        started = float(self.rec.get("started_ts") or time.time())
        return max(0.0, time.time() - started - float(self.rec.get("queued_s") or 0.0))

    def add_queued(self, seconds: float) -> None:
        self.rec["queued_s"] = round(float(self.rec.get("queued_s") or 0.0) + max(0.0, seconds), 3)

    def _start(self, kind: str, prompt: str, cwd: str, resume_job: str | None, limits: Mapping[str, Any],
               meta: Mapping[str, Any], system_extra: str, raw_dir: str, base: str | None) -> dict[str, Any]:
        if resume_job:
            return continue_job(self.ctx, self.paths, resume_job, prompt, limits, kind=kind,
                                meta_extra=meta, cfg=self.cfg, driver=self.opts.driver, raw_dir=raw_dir)
        resume, prior = None, {}
        if base:
            fk = fork_base(self.ctx, self.paths, base, Path(cwd), copy_workspace=False,
                           env_extra=self.opts.env_extra)
            resume, prior = fk["resume"], fk["prior"]
            meta = {**meta, "base": base}
        return start_job(self.ctx, self.paths, kind=kind, prompt=prompt, cwd=cwd, session_id=None,
                         resume=resume, fork=bool(resume), prior=prior, limits=limits, meta=meta,
                         system_extra=system_extra, env_extra=self.opts.env_extra, raw_dir=raw_dir,
                         driver=self.opts.driver, cfg=self.cfg)

    def _await_job(self, jid: str) -> dict[str, Any]:
        while not job_is_final(self.paths, jid):
            self._note_started(jid)
            time.sleep(self.opts.poll_s)
            reap_jobs(self.paths, self.ctx.platform, only=[jid], env=self.ctx.env)
        self._note_started(jid)
        return self.account_job(jid)

    def _note_started(self, jid: str) -> None:
        """Close a job's Slurm queue wait once its supervisor has written its runtime (or the job
        ended): precise to one poll."""
        since = self._in_slurm_queue.get(jid)
        if since is None or not (self.paths.runtime_file(jid).exists()
                                 or self.paths.result_file(jid).exists()):
            return
        del self._in_slurm_queue[jid]
        waited = round(time.monotonic() - since, 3)
        entry = next((j for j in self.rec.get("jobs") or [] if j["job_id"] == jid), None)
        if entry is not None:
            entry["queued_s"] = waited
        self.add_queued(waited)

    def account_job(self, jid: str) -> dict[str, Any]:
        """Fold a finished job's cost and tokens into the run record (once per job)."""
        res = read_json(self.paths.result_file(jid))
        entry = next(j for j in self.rec["jobs"] if j["job_id"] == jid)
        if "status" in entry:
            return res
        cost = billed_cost_usd(res.get("usage"))
        self.spent = round(float(self.rec.get("cost_usd") or 0.0) + cost, 6)
        self.rec["cost_usd"] = self.spent
        self.rec["cost_estimated"] = (bool(self.rec.get("cost_estimated"))
                                      or bool((res.get("usage") or {}).get("estimated")))
        tok = self.rec.get("tokens") or {k: 0 for k in TOKEN_KEYS}
        self.rec["tokens"] = add_tokens(tok, (res.get("usage") or {}).get("tokens") or {})
        entry.update({"status": res["status"], "reason": res.get("reason"), "cost_usd": cost,
                      "tool_uses": res.get("tool_uses"), "duration_s": res.get("duration_s")})
        self._save()
        self._event("progress", role=entry["role"], job=jid, status=res["status"], reason=res.get("reason"))
        return res

    def run_gate(self, task: Task, ws: str, label: str) -> dict[str, Any]:
        rec = run_check_proven(self.paths, self.ctx.platform, task, "gate", ws, self.ctx.env)
        n = len(self.rec.setdefault("gates", [])) + 1
        write_json_atomic(self.paths.run_dir(self.run_id) / "receipts" / f"gate-{n:02d}-{label}.json", rec)
        self.rec["gates"].append({"n": n, "label": label, "passed": rec["passed"], "score": rec["score"]})
        self._save()
        self._event("gate", n=n, label=label, passed=rec["passed"])
        return rec

    def failed_checks_text(self, rec: Mapping[str, Any]) -> str:
        failed = [c for c in rec.get("checks") or [] if not c.get("passed")]
        if failed:
            return "\n".join(f"- {c.get('id')}: {str(c.get('detail') or '')[:400]}" for c in failed[:30])
        tail = (rec.get("stderr_tail") or "") + (rec.get("stdout_tail") or "")
        names = re.findall(r"^(?:FAIL|ERROR): (\S+ \([^)]*\))", tail, flags=re.M)
        return ("\n".join(f"- {n}" for n in names[:30])
                or "- the public checks did not pass (see the output below)")

    def review_setup(self, task: Task, ws: str, n: int) -> tuple[Path, str]:
        """A fresh reviewer's directory (a read-only snapshot of the work) and its prompt."""
        rdir = self.paths.run_dir(self.run_id) / "review" / f"{n:02d}"
        work = rdir / "work"
        if rdir.exists():
            shutil.rmtree(rdir)
        # Links that lead out of the work are dropped: a reviewer following one would read
        # whatever it names (the reference, the hidden tests) as the agent's files.
        caps = copy_caps(self.launch)
        safe_copy_tree(ws, work, caps, links="inside")
        changed = sorted(k for k, v in tree_manifest(ws, caps).items() if task.public_manifest.get(k) != v)
        prompt = render(self.tpl["review_prompt"], task_title=task.title, task_text=task_text(task),
                        work_dir=str(work), review_path=str(rdir / "review.json"),
                        changed_files="\n".join(f"- {c}" for c in changed) or "- (none)")
        return rdir, prompt

    def launch_review(self, task: Task, ws: str, n: int) -> str | None:
        rdir, prompt = self.review_setup(task, ws, n)
        return self.launch_job("reviewer", prompt, cwd=str(rdir), kind="reviewer",
                                system_extra=self.tpl["reviewer_system"].template)

    def collect_review(self, n: int, job_status: str | None) -> dict[str, Any]:
        """Read and validate review.json of review n; record the verdict (invalid if unusable)."""
        review_path = self.paths.run_dir(self.run_id) / "review" / f"{n:02d}" / "review.json"
        try:
            # The reviewer wrote it: read only a regular file, never through a link, and bounded.
            data = read_capped(review_path, REVIEW_MAX_BYTES)
            review = json.loads(data.decode("utf-8")) if data is not None else None
        except (AgentbenchError, ValueError):
            review = None
        valid = isinstance(review, dict) and review.get("verdict") in ("accept", "revise")
        verdict = review["verdict"] if valid else None  # type: ignore[index]
        out = {"n": n, "job_status": job_status, "verdict": verdict, "valid": valid,
               "findings": review.get("findings") if valid else None,  # type: ignore[union-attr]
               "summary": review.get("summary") if valid else None}  # type: ignore[union-attr]
        self.rec.setdefault("reviews", []).append(out)
        self.rec.setdefault("review_verdicts", []).append(verdict or "invalid")
        self._save()
        self._event("review", n=n, verdict=verdict or "invalid")
        return out

    def _review(self, task: Task, ws: str, n: int) -> dict[str, Any]:
        jid = self.launch_review(task, ws, n)
        res = self._await_job(jid) if jid else {"status": "failed", "reason": "budget"}
        return self.collect_review(n, res.get("status"))

    def execute(self) -> dict[str, Any]:
        try:
            self._execute()
        except UnusableTree as exc:
            # A copy of what the agent left (the reviewer's, a fork's) was refused: the agent's
            # failure, graded as such, not an error.
            if self.rec.get("status") == "finished" or not getattr(self, "_prepared", None):
                self.end_error(exc.payload.get("error", "error"), exc.payload)
            else:
                task, ws = self._prepared
                self.finish(task, ws, f"{WORKSPACE_UNUSABLE}:{exc.why}")
        except AgentbenchError as exc:
            self.end_error(exc.payload.get("error", "error"), exc.payload)
        except Exception as exc:  # the pipeline never raises: record and move on
            self.end_error(f"{type(exc).__name__}: {exc}", {"trace": traceback.format_exc(limit=6)})
        return self.rec

    def end_error(self, reason: str, detail: Mapping[str, Any]) -> None:
        if not self.rec:
            return
        if detail.get("refusal") in ("breaker", "study_cap", "base"):
            # Paused, not failed: put the run back so that it runs, from the start, once the study is
            # resumed.  This attempt's jobs, spend and checks move to `paused_attempts` (its sessions
            # stay in the ledger): left in place they would be added to the next attempt's tokens,
            # gates and reviews, and its error and validity would outlive it.
            attempt = {k: self.rec.pop(k) for k in RUN_ATTEMPT_KEYS if k in self.rec}
            k = len(self.rec.get("paused_attempts") or []) + 1
            run_dir = self.paths.run_dir(self.run_id)
            aside = run_dir / f"paused-{k:02d}"
            for sub in ("raw", "snapshots", "receipts", "review", "transcripts", "ctl"):
                # The next attempt starts with empty directories (streams are appended to, and
                # snapshots and receipts are named by time and number).
                if (run_dir / sub).exists():
                    aside.mkdir(parents=True, exist_ok=True)
                    os.replace(run_dir / sub, aside / sub)
            attempt.update({"paused_at": utc_now(), "reason": reason, "files": str(aside)})
            self.rec.setdefault("paused_attempts", []).append(attempt)
            self.rec.update({"status": "not_started", "outcome": None, "paused_by_breaker": True,
                             "jobs": [], "cost_usd": 0.0})
        else:
            self.rec.update({"status": "error", "outcome": "error", "error": reason,
                             "error_detail": dict(detail),
                             "validity": "infrastructure_failure", "validity_reason": reason,
                             "finished_at": utc_now()})
        self._save()
        remove_marker(self.paths.state / "running_runs" / self.run_id)
        self._event("error", reason=reason)

    def prepare(self) -> tuple[Task, Arm, str, str]:
        """Workspace, prompt, effective context and provenance of a claimed run: (task, arm, ws, prompt)."""
        rec = self.rec
        task = self.tasks[rec["task"]]
        arm = self.arms[rec["arm"]]
        rec["started_ts"] = time.time()
        run_dir = self.paths.run_dir(self.run_id)
        (run_dir / "ctl").mkdir(parents=True, exist_ok=True)
        fault = rec.get("fault") or {}
        self._event("run_started", task=task.id, arm=arm.name)
        ws_info = prepare_workspace(self.paths, self.ctx.platform, task, run_dir,
                                    fault.get("missing_fixture"), host_env=self.ctx.env)
        ws = ws_info["path"]
        # The workspace copy: a missing_fixture fault may have removed TASK.md on purpose.
        statement = ((Path(ws) / "TASK.md").read_text(encoding="utf-8") if (Path(ws) / "TASK.md").exists()
                     else task.title)
        check_hint = task_check_hint(task, ws)
        prompt = render(self.tpl["task_prompt"], task_id=task.id, task_title=task.title, task_text=statement,
                        workspace=ws, check_hint=check_hint)
        base = rec.get("base") or (task.id if arm.fork_base else None)
        rec["base"] = base
        if base and arm.preamble_text.strip():
            # A fork keeps its base's system prompt (the binary snapshots it at the start of a
            # session), so the arm's text reaches a forked session through its first prompt.
            prompt = ("How to work in this run:\n\n" + arm.preamble_text.strip() + "\n\n---\n\n" + prompt)
        system_full = base_system_prompt(self.cfg, self.paths, "" if base else arm.preamble_text)
        write_text_atomic(run_dir / "ctl" / "prompt.md", prompt)
        write_text_atomic(run_dir / "ctl" / "system_prompt.md", system_full)
        rec["provenance"] = {
            "agentbench_version": VERSION,
            "agentbench_git": agentbench_git_commit(self.ctx.platform, self.ctx.env),
            "task_bundle_sha256": task.bundle_sha256,
            "effective_context_sha256": sha256_bytes((system_full + "\n---\n" + prompt).encode()),
            "model_requested": self.launch["model"], "assignment_seed": rec.get("seed", self.cfg.get("seed")),
            "platform": f"{self.ctx.platform.name}/{pyplatform.system()}", "rehearsal": self.opts.rehearsal,
            "base": base, "arm_text_in": ("prompt" if base else "system_prompt"),
            "fault": fault or None}
        rec["workspace"] = ws_info
        self._save()
        self._prepared = (task, ws)
        return task, arm, ws, prompt

    def _execute(self) -> None:
        rec = self.rec
        task, arm, ws, prompt = self.prepare()
        system_extra = arm.preamble_text
        fault = rec.get("fault") or {}
        fault_limits = {k: v for k, v in fault.items() if k == "interrupt_after_tool_uses"}
        base = rec.get("base")
        res = self._run_job("executor", prompt, cwd=ws, system_extra="" if base else system_extra,
                            fault=fault_limits, base=base)
        if not rec.get("jobs"):
            # The budget did not allow even the first session.
            self.finish(task, ws, "budget_exhausted")
            return
        exec_job = rec["jobs"][-1]["job_id"]
        last_job = exec_job
        if res.get("reason") == "fault_interrupt":
            rec["interruption"] = {"job_id": exec_job, "resumed": True}
            res = self._run_job("resume", render(self.tpl["resume"], reason="the session was interrupted"),
                                cwd=ws, resume_job=last_job, kind="continue")
            last_job = rec["jobs"][-1]["job_id"]
        stop = self.stop_reason(res)
        cycles = 0
        gate_rec = None
        if arm.gate_cycles and not stop:
            gate_rec = self.run_gate(task, ws, "cycle")
            while not gate_rec["passed"] and cycles < arm.gate_cycles and not stop:
                cycles += 1
                fb = render(self.tpl["gate_feedback"], cycle=cycles, cycles_left=arm.gate_cycles - cycles,
                            failed_checks=self.failed_checks_text(gate_rec),
                            gate_output=((gate_rec.get("stderr_tail") or "")
                                         + (gate_rec.get("stdout_tail") or ""))[-3000:])
                res = self._run_job("gate_feedback", fb, cwd=ws, resume_job=last_job, kind="continue")
                last_job = rec["jobs"][-1]["job_id"]
                stop = self.stop_reason(res)
                rec["gate_cycles"] = cycles
                if stop:
                    break
                gate_rec = self.run_gate(task, ws, "cycle")
        rec["gate_cycles"] = cycles
        if arm.review and not stop and (gate_rec is None or gate_rec["passed"]):
            review = self._review(task, ws, 1)
            if review["verdict"] == "revise":
                findings = "\n".join(f"- [{f.get('severity')}] {f.get('file')}: {f.get('detail')}"
                                     for f in review.get("findings") or []
                                     if isinstance(f, dict)) or "- (none listed)"
                res = self._run_job("repair", render(self.tpl["review_feedback"], findings=findings,
                                                     summary=review.get("summary") or ""),
                                    cwd=ws, resume_job=last_job, kind="continue")
                last_job = rec["jobs"][-1]["job_id"]
                stop = self.stop_reason(res)
                if arm.gate_cycles:
                    self.run_gate(task, ws, "after_review")
        self.finish(task, ws, stop)

    def stop_reason(self, res: Mapping[str, Any]) -> str | None:
        """Why no further session may start: budget, wall time, or an infrastructure failure."""
        st, reason = res.get("status"), res.get("reason")
        if reason == "budget":
            return "budget_exhausted"
        if reason == "workspace_over_cap":
            return f"{WORKSPACE_UNUSABLE}:workspace_over_cap"
        if st == "timeout":
            return "timeout"
        if reason in ("usage_limit", "overloaded", "auth", "api_error", "launch_error", "prompt_too_long",
                      "model_refused"):
            return f"infrastructure:{reason}"
        if st == "lost" or (st == "killed" and reason in ("driver_lost", "supervisor_terminated")):
            # Not the agent's doing (a dead supervisor or driver): excluded from the results.
            return f"infrastructure:{st}:{reason}"
        if st == "killed":
            # A kill by the experimenter or the orphan watchdog: the run ends, graded as it stands.
            return f"killed:{reason}"
        if self.remaining_usd() < float(self.launch["budget"].get("min_remaining_usd") or 0):
            return "budget_exhausted"
        return None

    def _audit_sessions(self, task: Task, ws: str) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """The behaviour audit of every session of the run from its raw stream: the executor's and
        repair sessions' calls against the workspace, each reviewer's against its own directory
        (a reviewer that reads the reference is as tainting as an executor that does)."""
        protected = {"study": str(self.paths.state), "oracle": str(task.root / "oracle"),
                     "reference": str(task.root / "reference"), "gate": str(task.root / "gate"),
                     "tasks": str(task.root.parent)}
        n, findings = {"tool_calls": 0, "reviewer_tool_calls": 0}, []
        for j in self.rec["jobs"]:
            job = read_json(self.paths.job_file(j["job_id"]), default=None)
            if not job:
                continue
            calls = stream_state_from_file(Path(job["raw_dir"]) / "stream.jsonl").tool_calls
            n["reviewer_tool_calls" if job.get("kind") == "reviewer" else "tool_calls"] += len(calls)
            if job.get("kind") == "reviewer":
                for f in audit_tool_calls(calls, str(job.get("cwd") or ws), protected):
                    findings.append({**f, "session": "reviewer", "job_id": j["job_id"]})
            else:
                findings += audit_tool_calls(calls, ws, protected)
        return n, findings

    def finish(self, task: Task, ws: str, stop: str | None) -> None:
        rec = self.rec
        run_dir = self.paths.run_dir(self.run_id)
        caps = copy_caps(self.launch)
        unusable = stop if stop and stop.startswith(WORKSPACE_UNUSABLE + ":") else None
        if unusable is None:
            try:
                rec["artifacts"] = artifact_manifest(ws, caps)
            except UnusableTree as exc:
                unusable = f"{WORKSPACE_UNUSABLE}:{exc.why}"
        if unusable is not None:
            # Nothing of the workspace is read or graded past this point: the run is the agent's
            # failure as it stands.
            rec["artifacts"] = {"files": {}, "sha256": None, "unusable": unusable.split(":", 1)[1]}
        write_json_atomic(run_dir / "artifacts.json", rec["artifacts"])
        self._collect_transcripts(run_dir)
        final_gate: dict[str, Any] | None = None
        if unusable is None:
            final_gate = run_check_proven(self.paths, self.ctx.platform, task, "gate", ws, self.ctx.env)
            write_json_atomic(run_dir / "receipts" / "final-contract.json", final_gate)
            rec["final_contract"] = {"passed": final_gate["passed"], "score": final_gate["score"]}
        else:
            rec["final_contract"] = {"passed": False, "score": 0.0, "not_run": unusable}
        n_calls, findings = self._audit_sessions(task, ws)
        # A test file the controller removed (a missing_fixture fault) is not the agent's edit.
        removed = str((rec.get("fault") or {}).get("missing_fixture") or "").strip("/")
        edited = [f for f in edited_public_tests(task, ws)
                  if not (removed and (f == removed or f.startswith(removed + "/"))
                          and not (Path(ws) / f).exists())]
        if edited:
            findings.append({"kind": "edited_public_tests", "files": edited})
        copied = hidden_file_copies(task, rec["artifacts"], "oracle")
        if copied:
            findings.append({"kind": "copies_hidden_files", "files": copied})
        rec["audit"] = {**n_calls, "findings": findings, "flagged": bool(findings),
                        # Said, not flagged: a correct solution may equal the reference (the
                        # rehearsal writes it by design); a reviewer weighs it with the tool calls.
                        "equals_reference": hidden_file_copies(task, rec["artifacts"], "reference")}
        ev: dict[str, Any] | None = None
        if unusable is None:
            try:
                ev = run_check_proven(self.paths, self.ctx.platform, task, "oracle", ws, self.ctx.env)
            except UnusableTree as exc:
                unusable = f"{WORKSPACE_UNUSABLE}:{exc.why}"
        if ev is None:
            ev = {"success": False, "score": 0.0, "passed": False, "checks": [], "exit_code": None,
                  "timed_out": False, "at": utc_now(), "grader_error": None}
        snapshots = self._grade_snapshots(task)
        evaluation = {"success": ev["success"], "score": ev["score"], "passed": ev["passed"],
                      "tests_passed": ev.get("tests_passed"), "tests_total": ev.get("tests_total"),
                      "threshold": task.threshold, "checks": ev.get("checks"), "exit_code": ev["exit_code"],
                      "timed_out": ev["timed_out"], "at": ev["at"], "snapshots": snapshots,
                      "artifacts_sha256": rec["artifacts"]["sha256"],
                      "receipt": {"kind": ev.get("receipt"), "channel": ev.get("receipt_channel"),
                                  "protected": ev.get("receipt_protected"),
                                  "problem": ev.get("receipt_problem")},
                      "grader_error": ev.get("grader_error"),
                      "grader_error_caused_by_solution": ev.get("grader_error_caused_by_solution"),
                      "reference_rerun": ev.get("reference_rerun")}
        if unusable is not None:
            evaluation["workspace_unusable"] = unusable.split(":", 1)[1]
        write_json_atomic(run_dir / "evaluation.json", evaluation)
        rec["sandbox"] = sandbox_summary(
            [(read_json(self.paths.result_file(j["job_id"]), default={}) or {}).get("sandbox")
             for j in rec["jobs"]] + [(final_gate or {}).get("sandbox"), ev.get("sandbox")])
        rec["evaluation"] = evaluation
        exec_jobs = [j for j in rec["jobs"] if j["role"] != "reviewer"]
        rec["wall_s"] = round(self.active_s(), 3)
        tool_uses = sum(int(j.get("tool_uses") or 0) for j in exec_jobs)
        verdict = classify_run(stop=unusable or stop, first_session=exec_jobs[0] if exec_jobs else None,
                               tool_uses=tool_uses,
                               success=bool(ev["success"]), grader_error=ev.get("grader_error"),
                               solution_broke_grader=ev.get("grader_error_caused_by_solution"),
                               hidden_access=[f["kind"] for f in findings
                                              if f.get("kind") in HIDDEN_ACCESS_KINDS])
        outcome, validity = verdict.outcome, verdict.validity
        rec.update({"status": "finished", "outcome": outcome, "validity": validity,
                    "validity_reason": verdict.validity_reason, "failure_reason": verdict.failure_reason,
                    "finished_at": utc_now(),
                    "claude_version": next(
                        (read_json(self.paths.result_file(j["job_id"]), default={}) or {})
                        .get("claude_version")
                        for j in rec["jobs"] if self.paths.result_file(j["job_id"]).exists())})
        rec["provenance"]["claude_version"] = rec["claude_version"]
        rec["provenance"]["models_reported"] = sorted({
            m for j in rec["jobs"]
            for m in ((read_json(self.paths.result_file(j["job_id"]), default={}) or {})
                      .get("models_reported") or [])})
        self._save()
        remove_marker(self.paths.state / "running_runs" / self.run_id)
        self._event("score", success=ev["success"], score=ev["score"])
        self._event("run_finished", outcome=outcome, validity=validity, cost_usd=rec.get("cost_usd"))

    def _collect_transcripts(self, run_dir: Path) -> None:
        env = {**self.ctx.env, **self.opts.env_extra}
        out = run_dir / "transcripts"
        for j in self.rec["jobs"]:
            job = read_json(self.paths.job_file(j["job_id"]), default=None)
            res = read_json(self.paths.result_file(j["job_id"]), default=None)
            if not job or not res or not is_safe_id(res.get("session_id")):
                continue   # no session, or an id that cannot be a file name (never made a path)
            src = transcript_path(env, job["cwd"], res["session_id"])
            if os.path.lexists(src):
                # The session could write its own transcript: a link (to /dev/zero, to the
                # reference), a FIFO or a file over the cap is not copied, only recorded.
                try:
                    safe_copy_file(src, out / f"{j['job_id']}-{res['session_id']}.jsonl",
                                   copy_caps(self.launch).file_bytes or 0)
                except UnusableTree as exc:
                    self.rec.setdefault("transcripts_refused", []).append(
                        {"job_id": j["job_id"], "why": exc.why})

    def _grade_snapshots(self, task: Task) -> list[dict[str, Any]]:
        """Grade graded snapshots with the hidden tests, cached by content hash."""
        out = []
        snaps = self.paths.run_dir(self.run_id) / "snapshots"
        cache_dir = self.paths.state / "snapshot_grades"
        for snap in sorted(snaps.glob("t*")) if snaps.exists() else []:
            try:
                digest = manifest_sha256(tree_manifest(snap, copy_caps(self.launch)))
            except UnusableTree as exc:
                out.append({"t": int(snap.name[1:]), "score": 0.0, "success": False,
                            WORKSPACE_UNUSABLE: exc.why})
                continue
            cached = read_json(cache_dir / f"{task.id}-{digest[:24]}.json", default=None)
            if cached is None:
                try:
                    r = run_check(self.paths, self.ctx.platform, task, "oracle", str(snap), self.ctx.env)
                except UnusableTree as exc:
                    out.append({"t": int(snap.name[1:]), "content_sha256": digest, "score": 0.0,
                                "success": False, WORKSPACE_UNUSABLE: exc.why})
                    continue
                cached = {"score": r["score"], "success": r["success"]}
                write_json_atomic(cache_dir / f"{task.id}-{digest[:24]}.json", cached)
            out.append({"t": int(snap.name[1:]), "content_sha256": digest, **cached})
        return out


def drive_runs(ctx: Host, paths: StudyPaths, run_ids: Sequence[str], opts: PipelineOptions,
               parallel: int, study: Study | None = None) -> dict[str, Any]:
    """Run pipelines for `run_ids` with at most `parallel` at once.  Finished runs are skipped.
    `study`: the Study at `paths` when the caller has loaded it."""
    study = (study or load_study(paths)).load_all()
    cfg, tasks, arms, tpl = study.cfg, study.tasks, study.arms, study.templates
    sweep_interrupted_runs(paths, ctx.platform)
    todo = [r for r in run_ids if load_run(paths, r).get("status") == "not_started"]
    skipped = [r for r in run_ids if r not in todo]
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()
    queue = list(todo)
    paused: list[str] = []
    unclaimed: dict[str, dict[str, Any]] = {}

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                try:
                    refuse_if_paused(paths, launch_config(cfg))
                except AgentbenchError:
                    paused.extend(queue)
                    queue.clear()
                    return
                rid = queue.pop(0)
            pipe = RunPipeline(ctx, paths, rid, cfg, tasks, arms, tpl, opts)
            try:
                if not pipe.claim():
                    continue
            except (AgentbenchError, OSError) as exc:
                # A lock that stays busy, a read-only or full disk: said, never a silent `ran: []`.
                with lock:
                    unclaimed[rid] = exc.payload if isinstance(exc, AgentbenchError) else \
                        {"error": f"{type(exc).__name__}: {exc}"}
                continue
            try:
                rec = pipe.execute()
            except Exception as exc:  # a worker must not die silently: the run is reported
                with lock:
                    unclaimed[rid] = {"error": "the run's pipeline failed", "type": type(exc).__name__,
                                      "detail": str(exc)[:500]}
                continue
            with lock:
                if rec.get("status") == "not_started" and rec.get("paused_by_breaker"):
                    paused.append(rid)   # the breaker stopped it in flight: it waits, like the queue
                else:
                    results[rid] = {"outcome": rec.get("outcome"), "status": rec.get("status")}

    threads = [threading.Thread(target=worker, daemon=True)
               for _ in range(max(1, min(parallel, len(todo) or 1)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"ran": sorted(results), "skipped": skipped, "paused": sorted(paused), "results": results,
            "unclaimed": unclaimed}


# ==================================================================================================
# Runs by hand and the run driver's checks: the pipeline's public API
# ==================================================================================================
# Owns what the commands do to a study's runs through the pipeline: a pipeline for one run, the
# by-hand flow (start a run's first session, continue it, gate, review, evaluate), choosing runs
# by flag values, and the refusals before a driver starts (the guard for real runs, bases that are
# not ready, the parallel cap).  Its functions take a Host, a Study and plain values; they must not
# parse flags (argparse belongs to the CLI), print, read os.environ, or reach into a lower
# section's private names: what they need is public there.

def pipeline_for(host: Host, study: Study, run_id: str, opts: PipelineOptions | None = None) -> RunPipeline:
    """A pipeline for one run driven by hand; loads only that run's task bundle (cost per call
    must not grow with the number of tasks)."""
    paths = study.paths
    rec = load_run(paths, run_id)
    task_root = tasks_dir(paths, study.cfg) / check_name("task", rec["task"])
    if not (task_root / "task.json").exists():
        raise AgentbenchError("the run's task bundle is missing", code="runs_task_bundle_missing",
                              run=run_id, task=rec["task"], path=str(task_root))
    tasks = {rec["task"]: study.task(rec["task"])}
    pipe = RunPipeline(host, paths, run_id, study.cfg, tasks, study.arms, study.templates,
                       opts or PipelineOptions())
    pipe.rec = rec
    return pipe


def driven_by_hand(rec: Mapping[str, Any]) -> bool:
    """Whether a run is being driven by hand: started by `spawn --run` (no driver) and not final."""
    return rec.get("status") == "running" and not rec.get("driver")


def require_hand_driven(pipe: RunPipeline, run_id: str) -> None:
    """Steps by hand are for runs started by hand (`spawn --run`) and not yet evaluated."""
    if not driven_by_hand(pipe.rec):
        raise AgentbenchError("the run is not being driven by hand", code="run_not_being_driven_hand",
                              run=run_id, status=pipe.rec.get("status"),
                              hint="start it with `spawn --run`; a run driven by `run` does its own steps, "
                                   "and a finished run is final")


def run_sessions_working(paths: StudyPaths, rec: Mapping[str, Any]) -> bool:
    """Whether a session of this run still has its active marker (not yet reaped)."""
    return any((paths.active / j["job_id"]).exists() for j in rec.get("jobs") or [])


def refuse_while_sessions_work(paths: StudyPaths, rec: Mapping[str, Any], run_id: str) -> None:
    if run_sessions_working(paths, rec):
        raise AgentbenchError("a session of this run is still working", code="session_run_still_working",
                              run=run_id, hint="wait for it first")


def spawn_run(host: Host, study: Study, run_id: str, *, base: str | None = None,
              force: bool = False) -> dict[str, Any]:
    """`spawn --run`: claim the run by hand, prepare its workspace, launch its executor (detached).
    `base` forks that base instead of the run's own; `force` allows an uncalibrated task."""
    paths = study.paths
    rec = load_run(paths, run_id)
    tasks = study.load_all().tasks
    if uncalibrated(paths, {rec["task"]: tasks[rec["task"]]}) and not force:
        raise AgentbenchError("the run's task is not calibrated", code="runs_task_not_calibrated",
                              task=rec["task"], hint="run `calibrate`, or pass --force")
    # Refusals first, so that a refused spawn leaves the run untouched.
    arms = study.arms
    fork = base or rec.get("base") or (rec["task"] if arms[rec["arm"]].fork_base else None)
    if fork:
        require_base_ready(paths, fork)
    launch = study.launch
    study_binary(host, study.cfg)
    refuse_if_paused(paths, launch)
    reap_jobs(paths, host.platform, env=host.env)
    refuse_at_parallel_cap(len(active_job_ids(paths)), int(launch["parallel"]),
                           hint="wait for a job to finish (`wait --any`)")
    pipe = pipeline_for(host, study, run_id)
    if not pipe.claim():
        raise AgentbenchError("the run is not waiting to start", code="run_not_waiting_start",
                              run=run_id, status=rec.get("status"),
                              hint="a run starts once; see `list --all`")
    try:
        if base:
            pipe.rec["base"] = check_name("base", base)
        task, arm, ws, prompt = pipe.prepare()
        fault = {k: v for k, v in (rec.get("fault") or {}).items() if k == "interrupt_after_tool_uses"}
        fork = pipe.rec.get("base")
        jid = pipe.launch_job("executor", prompt, cwd=ws, system_extra="" if fork else arm.preamble_text,
                              fault=fault, base=fork)
    except AgentbenchError as exc:
        pipe.end_error(exc.payload.get("error", "error"), exc.payload)
        raise
    return {"run_id": run_id, "job_id": jid, "workspace": ws, "task": task.id, "arm": arm.name}


def continue_session(host: Host, study: Study, prompt: str, limits: Mapping[str, Any], *,
                     job_id: str | None = None, run_id: str | None = None) -> dict[str, Any]:
    """`continue`: one more turn in a job's session, or in the latest session of a run driven by
    hand (recorded in its run record, within the run's budget; `limits` are for a plain job)."""
    paths = study.paths
    if run_id:
        job_id = latest_run_job(paths, run_id)
        if not job_id:
            raise AgentbenchError("the run has no session to continue yet",
                                  code="run_no_session_continue_yet", run=run_id,
                                  hint=f"start it first: spawn --run {run_id}")
    if not job_id:
        raise AgentbenchError("continue needs --job J or --run R", code="continue_needs_job_j_run")
    run_id = run_id or (load_job(paths, job_id).get("meta") or {}).get("run_id")
    if not run_id:
        return continue_job(host, paths, job_id, prompt, limits, cfg=study.cfg)
    # A run's sessions are recorded in its run record (cost, tokens, evaluation need them).
    pipe = pipeline_for(host, study, run_id)
    if not driven_by_hand(pipe.rec):
        raise AgentbenchError("the run is not being driven by hand", code="run_not_being_driven_hand",
                              run=run_id, status=pipe.rec.get("status"),
                              hint="a run driven by `run` continues its own sessions")
    done = existing_continuation(paths, job_id)
    if done:
        return duplicate_continue(paths, job_id, done)
    jid = pipe.launch_job("continue", prompt, cwd=pipe.rec["workspace"]["path"], resume_job=job_id,
                          kind="continue")
    if jid is None:
        raise AgentbenchError("the run's budget does not allow another session",
                              code="runs_budget_does_not_allow", run=run_id,
                              spent_usd=pipe.rec.get("cost_usd"))
    return {"job_id": jid, "run_id": run_id, "continues": job_id,
            "status": job_status(paths, jid).get("status")}


def gate_run(host: Host, study: Study, run_id: str) -> dict[str, Any]:
    """`gate`: the task's public checks on a hand-driven run's workspace, with a receipt; when
    they fail, what they printed (the feedback an orchestrator passes on with `continue`)."""
    paths = study.paths
    pipe = pipeline_for(host, study, run_id)
    require_hand_driven(pipe, run_id)
    ws = (pipe.rec.get("workspace") or {}).get("path")
    if not ws or not os.path.isdir(ws):
        raise AgentbenchError("the run has no workspace yet", code="run_no_workspace_yet",
                              run=run_id, hint="spawn --run it first")
    refuse_while_sessions_work(paths, pipe.rec, run_id)
    rec = pipe.run_gate(pipe.tasks[pipe.rec["task"]], ws, "manual")
    n = pipe.rec["gates"][-1]["n"]
    out = {"run_id": run_id, "passed": rec["passed"], "score": rec["score"], "checks": rec["checks"],
           "failed": pipe.failed_checks_text(rec) if not rec["passed"] else None,
           "receipt": str(paths.run_dir(run_id) / "receipts" / f"gate-{n:02d}-manual.json")}
    if not rec["passed"]:
        out["stdout_tail"], out["stderr_tail"] = rec.get("stdout_tail") or "", rec.get("stderr_tail") or ""
    return out


def review_run(host: Host, study: Study, run_id: str) -> dict[str, Any]:
    """`review`: launch a fresh reviewer session for a hand-driven run (it writes review.json)."""
    paths = study.paths
    pipe = pipeline_for(host, study, run_id)
    require_hand_driven(pipe, run_id)
    ws = (pipe.rec.get("workspace") or {}).get("path")
    if not ws:
        raise AgentbenchError("the run has no workspace yet", code="run_no_workspace_yet", run=run_id)
    refuse_while_sessions_work(paths, pipe.rec, run_id)
    n = len([j for j in pipe.rec.get("jobs") or [] if j["role"] == "reviewer"]) + 1
    jid = pipe.launch_review(pipe.tasks[pipe.rec["task"]], ws, n)
    return {"run_id": run_id, "job_id": jid, "review": n,
            "review_path": str(paths.run_dir(run_id) / "review" / f"{n:02d}" / "review.json")}


def evaluate_runs(host: Host, study: Study, run_ids: Sequence[str],
                  every_running: bool = False) -> dict[str, Any]:
    """`evaluate`: account, collect reviews, grade and classify hand-driven runs whose sessions
    ended (`every_running` adds every running run); others are listed as skipped, with why."""
    paths = study.paths
    ids = list(run_ids)
    if not ids and not every_running:
        raise AgentbenchError("evaluate needs --run R or --all", code="evaluate_needs_run_r_all")
    if every_running:
        # Nothing running by hand is no error: the answer is then empty.
        ids += [r["run_id"] for r in list_runs(paths) if r.get("status") == "running"]
    out, skipped = [], []
    for rid in dict.fromkeys(ids):
        pipe = pipeline_for(host, study, rid)
        rec = pipe.rec
        if not driven_by_hand(rec):
            why = "already final" if rec.get("status") in RUN_FINAL else "not started by hand"
            skipped.append({"run_id": rid, "status": rec.get("status"), "why": why})
            continue
        if run_sessions_working(paths, rec):
            skipped.append({"run_id": rid, "why": "a session is still working"})
            continue
        last = None
        for j in rec.get("jobs") or []:
            last = pipe.account_job(j["job_id"])
        for i, j in enumerate([j for j in rec.get("jobs") or [] if j["role"] == "reviewer"], start=1):
            if i > len(rec.get("reviews") or []):
                result = read_json(paths.result_file(j["job_id"]), default={}) or {}
                pipe.collect_review(i, result.get("status"))
        stop = pipe.stop_reason(last) if last else None
        task = pipe.tasks[rec["task"]]
        pipe.finish(task, rec["workspace"]["path"], stop)
        out.append(run_summary(paths, rid))
    return {"evaluated": out, "skipped": skipped}


def select_runs(paths: StudyPaths, run_ids: Sequence[str] = (), tasks: Sequence[str] = (),
                arms: Sequence[str] = (), split: str | None = None) -> list[str]:
    """The runs `run` drives: the given ids (default: every run), filtered by task, arm and split.
    A filter that names nothing of the study is a typo, refused, not an empty selection."""
    ids = list(run_ids) or all_run_ids(paths)
    for r in run_ids:
        load_run(paths, r)
    records = {rid: load_run(paths, rid) for rid in ids}
    if tasks or arms:
        every = records if not run_ids else {rid: load_run(paths, rid) for rid in all_run_ids(paths)}
        for flag, key, wanted in (("--task", "task", tasks), ("--arm", "arm", arms)):
            known = sorted({str(r.get(key)) for r in every.values()})
            unknown = [w for w in wanted or [] if w not in known]
            if unknown:
                raise AgentbenchError(f"{flag} names no {key} of the study's runs", code="unknown_selection",
                                      **{key: unknown}, known=known,
                                      hint="see `list --all` or the manifest from `assign`")
    out = []
    for rid in ids:
        rec = records[rid]
        if tasks and rec["task"] not in tasks:
            continue
        if arms and rec["arm"] not in arms:
            continue
        if split and rec.get("split") != split:
            continue
        out.append(rid)
    return out


def refuse_unproven(study: Study, force: bool) -> None:
    """A real-API run starts only after calibration and rehearsal passed for this exact config."""
    if force:
        return
    paths = study.paths
    h = study.hash
    cal = calibration_state(paths)
    reh = read_json(paths.state / "rehearsal.json", default=None) or {}
    problems = []
    if cal.get("config_hash") != h or uncalibrated(paths, study.tasks):
        problems.append("calibration is missing or older than the current configuration")
    if not reh.get("ok") or reh.get("config_hash") != h:
        problems.append("no passing rehearsal of the current configuration")
    if problems:
        where = shlex.quote(str(paths.root))
        step = "calibrate" if len(problems) == 2 or "calibration" in problems[0] else "rehearse"
        raise AgentbenchError("refusing to spend money on an unproven configuration",
                              code="unproven_configuration", problems=problems,
                              hint=f"run `python3 agentbench.py {step} --study {where}` (free, offline)"
                                   + (", then `rehearse`" if step == "calibrate" else "")
                                   + "; --force overrides")


def refuse_unreachable_api(study: Study, env: Mapping[str, str]) -> dict[str, Any] | None:
    """Before real money is at stake: the gateway has a credential to carry, and the upstream
    answers one free request (count_tokens) with it.  Refused (exit 2) with the reason; None when
    there is nothing to check (the gateway off, or sessions that reach no real API:
    AGENTBENCH_OFFLINE=1), else the check's answer."""
    cfg = study.cfg
    env_all = {**env, **dict(cfg.get("env") or {})}
    gateway = launch_config(cfg)["gateway"]
    if gateway != "on" or env_all.get("AGENTBENCH_OFFLINE") == "1":
        return None
    refusal = gateway_refusal(env_all, gateway)
    if refusal is not None:
        raise refusal
    got = check_upstream(env_all, str(launch_config(cfg)["model"]))
    if not got["ok"]:
        raise AgentbenchError(got["reason"], code=got["problem"], url=got["url"], status=got.get("status"),
                              hint=("check ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN)"
                                    if got["problem"] == "credential_rejected" else
                                    "check ANTHROPIC_BASE_URL and the network; "
                                    "`python3 agentbench.py where --check-api` asks again"))
    return got


def runs_can_start(study: Study, run_ids: Sequence[str], parallel: int | None, force: bool) -> int:
    """Every refusal before `run` drives `run_ids` (an unproven configuration unless `force`, bad
    launch values, a missing executor, bases that are not ready); the pipelines to run at once:
    `parallel` (default and at most the study's parallel cap)."""
    paths, cfg = study.paths, study.cfg
    where = shlex.quote(str(paths.root))
    # In the order a user fixes them: calibrate, assign, rehearse.
    bad = uncalibrated(paths, study.tasks)
    if bad and not force:
        raise AgentbenchError("refusing to spend money on an unproven configuration",
                              code="unproven_configuration", tasks=bad,
                              problems=["tasks are not calibrated: " + ", ".join(bad)],
                              hint=f"run `python3 agentbench.py calibrate --study {where}` first, then "
                                   "`assign` and `rehearse`; --force overrides")
    if not run_ids:
        if not all_run_ids(paths):
            raise AgentbenchError("no runs: the study has no assignment yet", code="no_runs_selected",
                                  hint=f"run `python3 agentbench.py assign --study {where}` first")
        raise AgentbenchError("no runs selected", code="no_runs_selected",
                              hint="check --run/--task/--arm/--split against `list --all`")
    refuse_unproven(study, force)
    validate_launch_values(cfg)
    require_executor_ready(cfg.get("executor"))
    arms = study.arms
    missing: dict[str, str] = {}
    for rid in run_ids:
        rec = load_run(paths, rid)
        base = rec.get("base") or (rec["task"] if arms[rec["arm"]].fork_base else None)
        if base and base not in missing:
            try:
                require_base_ready(paths, base)
            except AgentbenchError as exc:
                missing[base] = str(exc.payload.get("state") or "missing")
    missing = {b: s for b, s in missing.items() if s}
    if missing:
        raise AgentbenchError("runs fork bases that are not ready", code="runs_fork_bases_not_ready",
                              bases=missing,
                              hint="train them first: agentbench.py train --task T (one per task), then wait")
    cap = int(study.launch["parallel"])
    if parallel is not None and parallel < 1:
        raise AgentbenchError("--parallel must be >= 1", code="parallel_below_1", parallel=parallel)
    chosen = parallel or cap
    if chosen > cap:
        log(f"--parallel {chosen} is above the study's parallel cap {cap}: using {cap}")
        chosen = cap
    return chosen


def drive_selected(host: Host, study: Study, run_ids: list[str], parallel: int,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Drive `run_ids` in this process (see drive_runs) under a driver heartbeat; the outcomes
    tallied.  Runs that could not be claimed are refused together, with each one's error."""
    paths = study.paths
    driver = driver_record(host.platform, paths)
    opts = PipelineOptions(env_extra=dict(study.cfg.get("env") or {}), driver=driver, progress=progress)
    with DriverBeat(driver):
        out = drive_runs(host, paths, run_ids, opts, parallel, study=study)
    outcomes: dict[str, int] = {}
    for r in out["results"].values():
        outcomes[str(r.get("outcome"))] = outcomes.get(str(r.get("outcome")), 0) + 1
    unclaimed = out.pop("unclaimed", {})
    if unclaimed:
        raise AgentbenchError("some runs could not be run", code="runs_not_run", unclaimed=unclaimed, **out,
                              outcomes=outcomes,
                              hint="see each run's error (a busy lock, a read-only or full disk); "
                                   "run them again once the cause is fixed")
    return {**out, "outcomes": outcomes,
            "interrupted": [r for r in run_ids if load_run(paths, r).get("status") == "interrupted"]}


# -- sessions by hand: spawn, train ----------------------------------------------------------------

@dataclass(frozen=True)
class LaunchFlags:
    """A session's limits as the caller gives them (None: the study's own value)."""
    max_budget_usd: float | None = None
    wall_s: float | None = None
    max_turns: int | None = None
    orphan_after_s: float | None = None
    fault: str | None = None


def launch_limits(launch: Mapping[str, Any], flags: LaunchFlags) -> dict[str, Any]:
    """The checked limits of one session started by hand (see session_limits)."""
    limits = session_limits(launch, wall_s=flags.wall_s or None, orphan_after_s=flags.orphan_after_s,
                            max_budget_usd=flags.max_budget_usd, max_turns=flags.max_turns or None,
                            extra=parse_fault(flags.fault) if flags.fault else None)
    check_job_limits(limits)
    return limits


def read_brief(host: Host, cwd: str, path: str) -> str:
    """The prompt text of a brief file (relative to `cwd`; refused if missing, not text or empty)."""
    p = Path(host.platform.normalize_path(os.path.join(cwd, path) if not os.path.isabs(path) else path))
    try:
        text = p.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise AgentbenchError("brief file not found", code="brief_file_not_found", path=str(p)) from None
    except UnicodeDecodeError:
        raise AgentbenchError("brief file is not UTF-8 text", code="brief_file_not_utf_8",
                              path=str(p)) from None
    if not text.strip():
        raise AgentbenchError("brief file is empty", code="brief_file_empty", path=str(p))
    return text


@contextlib.contextmanager
def removed_on_refusal(path: Path) -> Iterator[None]:
    """Remove the directory `path` again if the block is refused and this call created it.

    A refused command writes nothing, but a session's cwd must exist before its job is registered,
    and the parallel cap, the circuit breaker or the study's USD cap may refuse the job after that.
    Only `path` itself goes, never a parent that a concurrent call may be creating at the same
    moment.  No job refers to it: a refusal registers nothing.
    """
    existed = path.exists()
    parent_existed = path.parent.exists()
    try:
        yield
    except (AgentbenchError, OSError):
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
        if not parent_existed:
            # The parent (state/workspaces) only if this call made it and it is empty again: a
            # concurrent call that needs it recreates it (mkdir parents=True).
            with contextlib.suppress(OSError):
                path.parent.rmdir()
        raise


def spawn_session(host: Host, study: Study, *, cwd: str, brief: str | None, label: str | None = None,
                  base: str | None = None, workspace: str | None = None,
                  flags: LaunchFlags = LaunchFlags()) -> dict[str, Any]:
    """`spawn` without a run: one detached session, fresh or a fork of `base`, prompted by the
    brief file (relative to `cwd`), in `workspace` (default: a new directory, or a copy of the
    base's)."""
    paths = study.paths
    if not brief:
        raise AgentbenchError("spawn needs --brief FILE (or --run RUN_ID)", code="spawn_needs_brief_file_run")
    if label:
        check_name("label", label)
    prompt = read_brief(host, cwd, brief)
    cfg = study.cfg
    limits = launch_limits(study.launch, flags)
    study_binary(host, cfg)   # a missing binary is refused before anything is created
    name = label or uuid.uuid4().hex[:12]
    ws = (Path(host.platform.normalize_path(workspace)) if workspace
          else paths.state / "workspaces" / f"{name}-{uuid.uuid4().hex[:6]}")
    resume, prior = None, {}
    with removed_on_refusal(ws):
        if base:
            f = fork_base(host, paths, base, ws, copy_workspace=not workspace)
            resume, prior = f["resume"], f["prior"]
        ws.mkdir(parents=True, exist_ok=True)
        out = start_job(host, paths, kind="executor", prompt=prompt, cwd=str(ws), session_id=None,
                        resume=resume, fork=bool(resume), prior=prior, limits=limits,
                        meta={"base": base, "label": label}, cfg=cfg)
    return {**out, "base": base, "label": label}


def train_base(host: Host, study: Study, *, cwd: str, base: str | None = None, task_id: str | None = None,
               brief: str | None = None, workspace: str | None = None, replace: bool = False,
               flags: LaunchFlags = LaunchFlags()) -> dict[str, Any]:
    """`train`: a base session that runs fork from, prompted by the brief file or, with a task,
    the train_base template; on a copy of the task's public files unless `workspace` is given."""
    paths = study.paths
    cfg = study.cfg
    # One bundle by name, as load_tasks refuses it (an unknown name before an empty directory).
    task = load_tasks(study.paths, study.cfg, only=[task_id])[task_id] if task_id else None
    base = base or (task.id if task else None)
    if not base:
        raise AgentbenchError("train needs --base NAME (or --task T)", code="train_needs_base_name_task")
    check_name("base", base)
    if brief:
        prompt = read_brief(host, cwd, brief)
    elif task is not None:
        prompt = render(study.templates["train_base"], task_title=task.title, task_text=task_text(task),
                        notes_path="NOTES.md")
    else:
        raise AgentbenchError("train needs --brief FILE (or --task T for the train_base template)",
                              code="train_needs_brief_file_task")
    limits = launch_limits(study.launch, flags)
    study_binary(host, cfg)   # a missing binary is refused before anything is created
    ws = Path(host.platform.normalize_path(workspace)) if workspace else paths.bases / base / "workspace"
    # Refusals that do not depend on the base come first: a refused retraining must not have
    # wiped the old base's workspace (start_job asks again, as the state may change meanwhile).
    refuse_launch(paths, cfg, host.env)
    # One trainer per base at a time: two concurrent calls would otherwise both start a session in
    # the same workspace and the base would name only the last.  The check, the launch and the
    # record happen under the base's own lock (taken before, never inside, the registry lock).
    with base_lock(paths, host.platform, base):
        old = read_json(base_file(paths, base), default=None)
        if old is not None and base_state(paths, old) == "training":
            raise AgentbenchError("base is still training", code="base_still_training",
                                  base=base, job=old["job_id"],
                                  hint="wait for its job (or kill it) before retraining")
        if old is not None and not replace and not base_state(paths, old).startswith("failed"):
            raise AgentbenchError("base already exists", code="base_already_exists",
                                  base=base, state=base_state(paths, old),
                                  hint="pass --replace to retrain it")
        with removed_on_refusal(ws):
            ws.mkdir(parents=True, exist_ok=True)
            if task is not None and not workspace:
                if old is not None and ws.exists():
                    shutil.rmtree(ws)   # a retrained base starts from the task's files, not the old notes
                copy_tree(task.public, ws)
            out = start_job(host, paths, kind="train", prompt=prompt, cwd=str(ws), session_id=None,
                            resume=None, fork=False, prior={}, limits=limits, meta={"base": base}, cfg=cfg)
        register_base(paths, base, out, ws)
    return {**out, "base": base}


# ==================================================================================================
# Statistics
# ==================================================================================================
# Plain statistics functions, each with its definition and reference: intervals, exact tests, the
# bootstrap, power and sample size, multiplicity, and the expected cost of a plan.  Pure numerics:
# numbers and sequences in, numbers and dicts out.  It must not know the study, runs or the
# ledger, read or write files, or format text for a reader.

# Two-sided 95% normal quantile, z_{0.975}, to the precision of a double.
STAT_Z95 = 1.959963984540054

# -- Statistics: plain functions -------------------------------------------------------------------


def mean(xs: Iterable[float]) -> float | None:
    """Arithmetic mean of `xs`; None for an empty sequence.

    Uses math.fsum (exactly rounded summation) so the result does not depend on the order of
    the values. Reference: any textbook, e.g. Freedman, Pisani & Purves, Statistics, ch. 4.
    """
    vals = [float(x) for x in xs]
    if not vals:
        return None
    return math.fsum(vals) / len(vals)


def median(xs: Iterable[float]) -> float | None:
    """Median of `xs` (middle value; mean of the two middle values for an even count).

    None for an empty sequence. Reference: Freedman, Pisani & Purves, Statistics, ch. 4.
    """
    vals = sorted(float(x) for x in xs)
    n = len(vals)
    if n == 0:
        return None
    mid = n // 2
    if n % 2:
        return vals[mid]
    return (vals[mid - 1] + vals[mid]) / 2.0


def quantile_sorted(sorted_xs: list[float], q: float) -> float:
    """Quantile `q` (0..1) of an already sorted, non-empty list by linear interpolation.

    This is Hyndman & Fan (1996) definition 7 (the default of R and NumPy; Python's
    statistics.quantiles(method="inclusive")): h = (N - 1) q, interpolate between the order
    statistics at floor(h) and floor(h) + 1. Reference: Hyndman & Fan, "Sample quantiles in
    statistical packages", The American Statistician 50(4):361-365, 1996.
    """
    if not sorted_xs:
        raise ValueError("quantile of an empty list")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level {q} outside [0, 1]")
    h = (len(sorted_xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (h - lo) * (sorted_xs[hi] - sorted_xs[lo])


def wilson_interval(successes: int, n: int, z: float = STAT_Z95) -> tuple[float, float] | None:
    """Wilson score interval for a binomial proportion `successes / n`.

    It is the set of p for which the score test does not reject: |p_hat - p| <= z sqrt(p(1-p)/n),
    in closed form
        centre = (p_hat + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p_hat (1 - p_hat) / n + z^2 / (4 n^2)).
    Unlike the Wald interval it stays inside [0, 1] and keeps near-nominal coverage for small n
    and rates near 0 or 1, which is what agent success rates look like. The bounds are exactly 0
    when successes == 0 and exactly 1 when successes == n (the closed form gives them up to
    rounding). None when n == 0: no runs, no interval.
    References: Wilson, JASA 22:209-212 (1927); Newcombe, Statistics in Medicine 17:857-872
    (1998), method 3; Brown, Cai & DasGupta, Statistical Science 16:101-133 (2001).
    """
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return None
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2.0 * n)) / denom
    half = (z / denom) * math.sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n))
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


def _binomial_two_sided_half(k: int, n: int) -> float:
    """Two-sided exact p-value for observing k (or fewer) of n under Binomial(n, 1/2).

    p = min(1, 2 * P(X <= min(k, n - k))). For p = 1/2 the distribution is symmetric, so
    doubling the smaller tail equals summing every outcome at most as likely as the observed
    one. Integer arithmetic, then one correctly rounded division: exact up to the final double.
    The coefficients come by the recurrence C(n, i+1) = C(n, i) (n - i) / (i + 1), each division
    exact, so a tail costs one product per term instead of a fresh coefficient per term.
    """
    if n == 0:
        return 1.0
    small = min(k, n - k)
    term = tail = 1
    for i in range(small):
        term = term * (n - i) // (i + 1)
        tail += term
    return min(1.0, (2 * tail) / (2 ** n))


def sign_test_two_sided(wins: int, losses: int) -> float:
    """Exact two-sided sign test of 'wins and losses are equally likely'.

    Under the null the number of wins among the n = wins + losses informative pairs is
    Binomial(n, 1/2); p = min(1, 2 * P(X <= min(wins, losses))). Ties carry no information about
    direction and are dropped by the caller (the usual convention). p = 1.0 when n == 0.
    Reference: Conover, Practical Nonparametric Statistics, 3rd ed. (1999), section 3.4;
    Dixon & Mood, JASA 41:557-566 (1946).
    """
    if wins < 0 or losses < 0:
        raise ValueError("wins and losses must be non-negative")
    return _binomial_two_sided_half(wins, wins + losses)


def mcnemar_exact(b: int, c: int) -> float:
    """Exact conditional McNemar test for paired binary outcomes.

    `b` and `c` are the two kinds of discordant pair (e.g. b: only the arm succeeded, c: only
    the baseline did). Conditional on b + c, b is Binomial(b + c, 1/2) under marginal homogeneity;
    the two-sided p is min(1, 2 * P(X <= min(b, c))). Concordant pairs do not enter. p = 1.0
    when there is no discordant pair.
    References: McNemar, Psychometrika 12:153-157 (1947); Fagerland, Lydersen & Laake, BMC
    Medical Research Methodology 13:91 (2013), the "exact conditional" test.
    """
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be non-negative")
    return _binomial_two_sided_half(b, b + c)


# -- Statistics: the paired test clustered by task -------------------------------------------------
# The primary test of a comparison: per task one difference (arm minus baseline, each side the mean
# over the runs it has on that task), tested by flipping the signs of the differences.  Beside it,
# secondary figures: a cluster-robust standard error and a McNemar test that respects the tasks.

#: Most (partial sum x multiplicity) steps the exact sign-flip enumeration may take; beyond it the
#: test is a seeded Monte Carlo over sign flips.
PERM_EXACT_WORK = 400_000
#: Monte Carlo sign flips when the enumeration would be too long.
PERM_DRAWS = 20_000


def stream_seed(seed: int, *names: str) -> int:
    """A 63-bit seed for one named stream of random numbers (an arm, a comparison, a figure), from
    the study's seed and the names: the first 8 bytes of the SHA-256 of their JSON.  Two streams
    with different names share no draws (up to a 2^-63 chance), and one stream does not depend on
    which other streams a report draws first."""
    digest = hashlib.sha256(json.dumps([int(seed), *map(str, names)]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def exact_integers(values: Sequence[Any]) -> list[int]:
    """`values` (ints, floats or fractions) as integers over their least common denominator.

    Exact: a float is a dyadic rational and a Fraction is one, so no sum is rounded and "at
    least as extreme" is decided without a tolerance.  A float is taken at its exact value, so a
    caller whose differences are ratios (2/3 - 1/3) passes them as fractions: as doubles they
    can differ in the last bit from the same ratio reached another way.  Raises ValueError on a
    NaN or an infinity."""
    ratios = []
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"a difference must be finite, got {v!r}")
        ratios.append(v.as_integer_ratio())
    den = 1
    for _, d in ratios:
        den = den * d // math.gcd(den, d)
    return [n * (den // d) for n, d in ratios]


def _flip_groups(ints: Sequence[int]) -> dict[int, int]:
    """|difference| -> how many tasks have it, zeros left out (a flipped zero is the same zero)."""
    groups: dict[int, int] = {}
    for v in ints:
        if v:
            groups[abs(v)] = groups.get(abs(v), 0) + 1
    return groups


def _flip_exact(groups: dict[int, int], observed: int, max_work: int) -> int | None:
    """How many of the 2^k sign assignments give |sum| >= observed; None past `max_work`.

    Enumerated by the distribution of the signed sum: the m tasks sharing |d| = v contribute
    v (2j - m) with multiplicity C(m, j), j of them positive; the sums are exact integers, so
    "at least as extreme" is decided without a tolerance."""
    # The work is bounded before any of it is done: after each group the distinct sums are at
    # most the product of (m + 1) so far, and at most (sum of m v so far) / g + 1 (sums of
    # multiples of g, g the gcd of the values, in steps of 2 g).
    g = 0
    for v in groups:
        g = math.gcd(g, v)
    states, span, work = 1, 0, 0
    for v, m in sorted(groups.items()):
        work += states * (m + 1)
        if work > max_work:
            return None
        span += m * v
        states = min(states * (m + 1), span // g + 1)
    dist = {0: 1}
    for v, m in sorted(groups.items()):
        weights = [(v * (2 * j - m), math.comb(m, j)) for j in range(m + 1)]
        nxt: dict[int, int] = {}
        for s, c in dist.items():
            for step, w in weights:
                nxt[s + step] = nxt.get(s + step, 0) + c * w
        dist = nxt
    return sum(c for s, c in dist.items() if abs(s) >= observed)


def _flip_monte_carlo(values: list[int], observed: int, rng: random.Random, draws: int) -> int:
    """How many of `draws` random sign assignments of `values` give |sum| >= observed.

    One draw is one getrandbits(n): bit i set keeps value i positive.  The signed sum is
    2 (sum of the kept values) - total, and the kept sum is read a byte of bits at a time from a
    table of the 256 subset sums of each group of 8 values, so a draw costs n / 8 lookups."""
    n = len(values)
    total = sum(values)
    tables = []
    for start in range(0, n, 8):
        chunk = values[start:start + 8]
        table = [0] * 256
        for byte in range(1, 256):
            low = byte & -byte
            table[byte] = table[byte ^ low] + (chunk[low.bit_length() - 1] if low.bit_length() <= len(chunk)
                                                else 0)
        tables.append(table)
    nbytes = len(tables)
    hits = 0
    for _ in range(draws):
        kept = sum(map(list.__getitem__, tables, rng.getrandbits(n).to_bytes(nbytes, "little")))
        hits += abs(2 * kept - total) >= observed
    return hits


def sign_flip_test(diffs: Sequence[Any], seed: int = 0, draws: int = PERM_DRAWS,
                   max_work: int = PERM_EXACT_WORK) -> dict[str, Any]:
    """Paired permutation (sign-flip) test of a mean difference over tasks, two-sided.

    Null hypothesis: within each task the two arms are exchangeable, so each task's difference
    is as likely to have its sign as the opposite one, independently across tasks.  The
    statistic is |sum of the differences| (equivalently |mean|); the p-value is the share of the
    2^n sign assignments whose |sum| is at least the observed one.  Exact (every assignment,
    counted through the distribution of the sum; see _flip_exact) while that takes at most
    `max_work` steps, which covers every study of up to ~20 tasks and far larger ones whose
    differences repeat (success rates over a few repeats take few values).  Beyond it, `draws`
    seeded random assignments (random.Random(seed)) give p = (1 + hits) / (1 + draws), never
    0, with its Monte Carlo standard error sqrt(p (1 - p) / draws).  Zero differences stay in n
    and change nothing.  Differences may be ints, floats or fractions (see exact_integers).
    References: Fisher, The Design of Experiments (1935), sec. 21; Good, Permutation,
    Parametric and Bootstrap Tests of Hypotheses, 3rd ed. (2005), sec. 3.1; Phipson & Smyth,
    Stat. Appl. Genet. Mol. Biol. 9:39 (2010) for the Monte Carlo p-value.
    """
    ints = exact_integers(diffs)
    n = len(ints)
    groups = _flip_groups(ints)
    k = sum(groups.values())
    observed = abs(sum(ints))
    out: dict[str, Any] = {"tasks": n, "informative_tasks": k, "statistic": "abs_sum"}
    if n == 0:
        return {**out, "p": None, "method": None}
    hits = _flip_exact(groups, observed, max_work) if k else 1
    if hits is not None:
        return {**out, "p": min(1.0, hits / 2 ** k) if k else 1.0, "method": "exact",
                "assignments": f"2^{k}", "mc_se": None}
    if draws < 1:
        raise ValueError("draws must be >= 1")
    hits = _flip_monte_carlo([v for v, m in sorted(groups.items()) for _ in range(m)], observed,
                             random.Random(seed), draws)
    p = (1 + hits) / (1 + draws)
    return {**out, "p": p, "method": "monte_carlo", "draws": draws, "seed": seed,
            "mc_se": math.sqrt(p * (1.0 - p) / draws)}


def cluster_se_of_mean(values: Sequence[float]) -> float | None:
    """Cluster-robust standard error of a mean over tasks with one value per task:
    sqrt(sum (d_t - mean)^2 / (K (K - 1))) over the K tasks.  It is the sandwich (CR1) standard
    error of an intercept-only regression clustered by task, and it carries whatever correlation
    the runs of one task share.  None for fewer than two tasks.  Reference: Cameron & Miller,
    J. Human Resources 50:317-372 (2015), sec. II.C."""
    xs = [float(v) for v in values]
    k = len(xs)
    if k < 2:
        return None
    m = math.fsum(xs) / k
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (k * (k - 1)))


def clustered_mcnemar(cells: Sequence[tuple[int, int, int, int]]) -> dict[str, Any]:
    """McNemar's test for paired proportions with runs clustered in tasks (Obuchowski 1998).

    `cells` are per task (arm successes, arm runs, baseline successes, baseline runs).  The rates
    p_a = sum x_a / N_a and p_b = sum x_b / N_b are ratio estimators over the K tasks; their
    variances and covariance come from the task totals,
        V_a = K / (K - 1) sum_t (x_at - n_at p_a)^2 / N_a^2, likewise V_b,
        C   = K / (K - 1) sum_t (x_at - n_at p_a)(x_bt - n_bt p_b) / (N_a N_b),
    and X^2 = (p_a - p_b)^2 / (V_a + V_b - 2 C) is referred to chi-square with 1 df.  With equal
    runs per task in both arms this is Obuchowski's statistic; it needs no pairing of runs inside
    a task, so it does not depend on repeat labels, and a missing run costs only itself.  p is
    None with fewer than two tasks or a zero variance with a non-zero difference; 1.0 for no
    difference.  Reference: Obuchowski, "On the comparison of correlated proportions for
    clustered data", Statistics in Medicine 17:1495-1507 (1998)."""
    rows = [(int(a), int(na), int(b), int(nb)) for a, na, b, nb in cells if na > 0 and nb > 0]
    k = len(rows)
    n_a = sum(cell[1] for cell in rows)
    n_b = sum(cell[3] for cell in rows)
    out: dict[str, Any] = {"tasks": k, "arm_runs": n_a, "baseline_runs": n_b}
    if k == 0:
        return {**out, "arm_rate": None, "baseline_rate": None, "chi2": None, "p": None}
    pa = sum(cell[0] for cell in rows) / n_a
    pb = sum(cell[2] for cell in rows) / n_b
    out.update(arm_rate=pa, baseline_rate=pb)
    if k < 2:
        return {**out, "chi2": None, "p": None}
    ra = [x - n * pa for x, n, _, _ in rows]
    rb = [x - n * pb for _, _, x, n in rows]
    f = k / (k - 1)
    var = f * (math.fsum(u * u for u in ra) / n_a ** 2 + math.fsum(v * v for v in rb) / n_b ** 2
               - 2.0 * math.fsum(u * v for u, v in zip(ra, rb)) / (n_a * n_b))
    diff = pa - pb
    if abs(diff) <= 1e-15:
        return {**out, "chi2": 0.0, "p": 1.0}
    if var <= 0.0:
        return {**out, "chi2": None, "p": None}
    chi2 = diff * diff / var
    return {**out, "chi2": chi2, "p": math.erfc(math.sqrt(chi2 / 2.0))}


def binomial_draw(rng: random.Random, n: int, p: float) -> int:
    """One Binomial(n, p) draw, exact for p given as a double, in O(log n) steps of random bits.

    Each of the n trials succeeds when its uniform U < p.  U's binary digits are drawn a level
    at a time for the trials still undecided: at a digit where p has 1, the undecided trials
    whose digit is 0 are decided successes; where p has 0, those whose digit is 1 are decided
    failures; the others stay undecided.  A level's digits are the bits of one getrandbits call,
    counted by popcount, so a draw costs about log2(n) calls whatever n is, and the same
    seed gives the same draws on every Python version."""
    if n <= 0 or p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    num, den = p.as_integer_ratio()          # p = num / 2^e exactly
    bits = den.bit_length() - 1
    successes, undecided = 0, n
    for i in range(bits - 1, -1, -1):
        if not undecided:
            break
        ones = rng.getrandbits(undecided).bit_count()
        if (num >> i) & 1:
            successes += undecided - ones
            undecided = ones
        else:
            undecided -= ones
    return successes


#: (values, seed, resamples, level) -> interval: a report asks the same question more than once
#: (both views, an arm and its comparisons); the answer is a pure function of the key.
_BOOTSTRAP_CACHE: dict[tuple[Any, ...], tuple[float, float]] = {}
BOOTSTRAP_CACHE_MAX = 4096


def _bootstrap_means_bytes(xs: list[float], rng: random.Random, n_resamples: int) -> list[float]:
    """Resample means for up to 256 values, with every index drawn in C: random bytes, those at or
    above the largest multiple of n below 256 deleted (bytes.translate, so every index is equally
    likely), each kept byte b picking value b mod n from the values repeated 256 // n times."""
    n = len(xs)
    reps = 256 // n
    ext = xs * reps
    drop = bytes(range(reps * n, 256))
    need = n * n_resamples
    buf = b""
    while len(buf) < need:
        chunk = max(4096, (need - len(buf)) * 256 // (reps * n) + 64)
        buf += rng.getrandbits(8 * chunk).to_bytes(chunk, "little").translate(None, drop)
    pick = ext.__getitem__
    return [sum(map(pick, buf[i:i + n])) / n for i in range(0, need, n)]


def _bootstrap_means(xs: list[float], rng: random.Random, n_resamples: int) -> list[float]:
    """The means of `n_resamples` resamples of `xs` with replacement (see bootstrap_mean_diff_ci).

    Up to 256 tasks, indices come from random bytes (_bootstrap_means_bytes).  Beyond, when the
    tasks take few distinct values (success rates over a few repeats), a resample is described by
    how many times it takes each distinct value: a multinomial draw of n over the distinct values
    weighted by their counts, made as conditional binomials (binomial_draw), a few steps per
    distinct value instead of n index draws.  Otherwise the indices are drawn one by one."""
    n = len(xs)
    if n <= 256:
        return _bootstrap_means_bytes(xs, rng, n_resamples)
    counts: dict[float, int] = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    if len(counts) * 32 > n:
        # Random.choices without weights draws index floor(random() * n) per element: the same
        # stream on every Python >= 3.6.
        choices = rng.choices
        return [sum(choices(xs, k=n)) / n for _ in range(n_resamples)]
    values = sorted(counts)
    weights = [counts[v] for v in values]
    means = []
    for _ in range(n_resamples):
        left, weight_left, total = n, n, 0.0
        for v, w in zip(values, weights):
            c = left if w == weight_left else binomial_draw(rng, left, w / weight_left)
            total += c * v
            left -= c
            weight_left -= w
            if not left:
                break
        means.append(total / n)
    return means


def bootstrap_mean_diff_ci(diffs: list[float], seed: int, n_resamples: int = 10000,
                           level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval for the mean of paired differences (one per task).

    Also used for the mean of one arm's per-task success rates: any per-task values will do.
    Draws `n_resamples` resamples of the differences with replacement (same size as the data),
    takes each resample's mean, and returns the (1 - level)/2 and (1 + level)/2 quantiles of
    those means (Hyndman-Fan type 7, see quantile_sorted). Resampling is over tasks, the unit
    the paired design replicates; it is drawn as counts per distinct value (_bootstrap_means),
    which is what makes it cheap at many tasks.  The generator is random.Random(seed), so the
    interval is reproducible across runs and Python versions; the report gives every interval
    its own stream (stream_seed), so no two intervals share draws.
    None for no differences; (d, d) when every difference equals d (nothing to resample).
    The interval is clamped to [min(diffs), max(diffs)], where every resample mean lies.
    Reference: Efron & Tibshirani, An Introduction to the Bootstrap (1993), ch. 13.
    """
    xs = [float(d) for d in diffs]
    if not xs:
        return None
    if n_resamples < 1:
        raise ValueError("n_resamples must be >= 1")
    if not 0.0 < level < 1.0:
        raise ValueError("level must be in (0, 1)")
    lo_x, hi_x = min(xs), max(xs)
    if lo_x == hi_x:
        return (lo_x, hi_x)
    key = (tuple(xs), seed, n_resamples, level)
    if key in _BOOTSTRAP_CACHE:
        return _BOOTSTRAP_CACHE[key]
    means = sorted(_bootstrap_means(xs, random.Random(seed), n_resamples))
    tail = (1.0 - level) / 2.0
    lo = min(max(quantile_sorted(means, tail), lo_x), hi_x)
    hi = min(max(quantile_sorted(means, 1.0 - tail), lo_x), hi_x)
    if len(_BOOTSTRAP_CACHE) >= BOOTSTRAP_CACHE_MAX:
        _BOOTSTRAP_CACHE.clear()
    _BOOTSTRAP_CACHE[key] = (lo, hi)
    return (lo, hi)


def sign_test_min_p(n: int) -> float:
    """Smallest two-sided p-value an exact sign test on n informative pairs can produce: 2 / 2^n."""
    return sign_test_two_sided(n, 0)


#: Sign-flip enumeration steps a simulated study may take; past them the simulation refers the
#: flip statistic to its normal approximation (mean 0, variance the sum of squared differences).
POWER_SIM_EXACT_WORK = 100_000


def _simulated_rejects(diffs: list[int], alpha: float, direction: float) -> tuple[bool, bool]:
    """(primary test rejects, sign test rejects) for one simulated study, both in the direction
    of the effect.  The primary test is the exact sign-flip test while it is cheap, else its
    normal approximation (the flip distribution's own mean 0 and variance sum d^2)."""
    total = sum(diffs)
    toward = direction * total > 0
    res = sign_flip_test(diffs, max_work=POWER_SIM_EXACT_WORK, draws=1) if len(diffs) <= 24 else None
    if res is not None and res["method"] == "exact":
        primary = toward and res["p"] <= alpha
    else:
        ss = sum(d * d for d in diffs)
        primary = toward and ss > 0 and math.erfc(abs(total) / math.sqrt(2.0 * ss)) <= alpha
    wins = sum(1 for d in diffs if direction * d > 0)
    losses = sum(1 for d in diffs if direction * d < 0)
    return primary, wins > losses and sign_test_two_sided(wins, losses) <= alpha


def _power_simulation(p0: float, delta: float, n_tasks: int, repeats: int, alpha: float,
                      tau: float, n_sim: int, seed: int, sd_base: float = 0.0) -> dict:
    """Monte Carlo rejection rates of the primary test (and, for comparison, the sign test) in the
    direction of delta, with the study's clustering: per simulated study and task, a baseline
    rate p0 + N(0, sd_base) and an effect delta + N(0, tau), both clamped to [0, 1]; then
    `repeats` runs per arm (binomial_draw); then the tests over tasks.  random.Random(seed)."""
    rng = random.Random(seed)
    direction = 1.0 if delta > 0 else -1.0
    hits = {"primary": 0, "sign_test": 0}
    for _ in range(n_sim):
        diffs = []
        for _t in range(n_tasks):
            b_t = min(1.0, max(0.0, p0 + (rng.gauss(0.0, sd_base) if sd_base > 0 else 0.0)))
            a_t = min(1.0, max(0.0, b_t + delta + (rng.gauss(0.0, tau) if tau > 0 else 0.0)))
            diffs.append(binomial_draw(rng, repeats, a_t) - binomial_draw(rng, repeats, b_t))
        primary, sign = _simulated_rejects(diffs, alpha, direction)
        hits["primary"] += primary
        hits["sign_test"] += sign
    power = {k: v / n_sim for k, v in hits.items()}
    return {"studies": n_sim, "seed": seed, "repeats": repeats, "power": power,
            "mc_se": math.sqrt(power["primary"] * (1.0 - power["primary"]) / n_sim)}


#: Between-task standard deviations the power simulation assumes without a pilot to measure them
#: (defaults, stated as such): of the baseline's success rate, and of the arm's effect.
POWER_DEFAULT_SD_BASE = 0.2
POWER_DEFAULT_TAU = 0.1


def between_task_sd(cells: Sequence[tuple[int, int, int, int]], paired: bool) -> float | None:
    """Between-task standard deviation of a success rate (paired=False: cells are (x, n, _, _)) or
    of a difference of two (paired=True: (x_a, n_a, x_b, n_b)), from pilot counts per task.

    The spread of the observed per-task values, less the binomial noise each carries: var_between
    = max(0, s^2 - mean_t v_t), with v_t = p_t (1 - p_t) / (n_t - 1) per rate (unbiased for the
    sampling variance p (1 - p) / n; the two rates' added for a difference).  A method-of-moments
    estimate, as in a one-way random-effects model.  None with fewer than 3 tasks of at least 2
    runs per side.  Reference: Searle, Casella & McCulloch, Variance Components (1992), ch. 3."""
    vals, noise = [], []
    for xa, na, xb, nb in cells:
        if na < 2 or (paired and nb < 2):
            continue
        pa = xa / na
        v = pa * (1.0 - pa) / (na - 1)
        if paired:
            pb = xb / nb
            vals.append(pa - pb)
            v += pb * (1.0 - pb) / (nb - 1)
        else:
            vals.append(pa)
        noise.append(v)
    if len(vals) < 3:
        return None
    m = math.fsum(vals) / len(vals)
    s2 = math.fsum((x - m) ** 2 for x in vals) / (len(vals) - 1)
    return math.sqrt(max(0.0, s2 - math.fsum(noise) / len(noise)))


def primary_power_by_simulation(p_base: float, delta: float, n_tasks: int, alpha: float = 0.05,
                                power: float = 0.8, *, tau: float, sd_base: float,
                                start: int, max_repeats: int = 1000, n_sim: int = 400,
                                seed: int = 0) -> dict[str, Any]:
    """Repeats per task-arm cell at which the primary test reaches `power`, by simulation.

    Each candidate number of repeats is simulated with `n_sim` studies (_power_simulation, the
    same seed for every candidate, so the curve is smooth in r).  The search starts at `start`
    (the normal approximation's answer), doubles while the simulated power falls short and
    bisects back down to the smallest number of repeats that reaches it; None when even
    `max_repeats` does not (more tasks are needed).  The power is a Monte Carlo estimate with
    standard error `mc_se`, about 0.02 at 400 studies."""
    cache: dict[int, dict] = {}

    def sim(r: int) -> dict:
        if r not in cache:
            cache[r] = _power_simulation(p_base, delta, n_tasks, r, alpha, tau, n_sim, seed, sd_base)
        return cache[r]

    if sign_test_min_p(n_tasks) > alpha:
        # Fewer tasks than any test over tasks needs: no number of repeats helps, nothing to run.
        return {"method": "simulation of the primary test (sign-flip over tasks) under clustering",
                "repeats": None, "studies_per_point": 0, "seed": seed, "alpha": alpha, "tau": tau,
                "sd_base": sd_base, "achieved_power": None, "mc_se": None, "sign_test_power": None,
                "power_by_repeats": [],
                "reason": f"with {n_tasks} task(s) the smallest p-value the test can give is "
                          f"{sign_test_min_p(n_tasks):.4g} > alpha {alpha}"}
    hi = max(1, min(int(start or 1), max_repeats))
    while sim(hi)["power"]["primary"] < power and hi < max_repeats:
        hi = min(max_repeats, hi * 2)
    found = sim(hi)["power"]["primary"] >= power
    lo = 0
    while found and hi - lo > 1:
        mid = (lo + hi) // 2
        if sim(mid)["power"]["primary"] >= power:
            hi = mid
        else:
            lo = mid
    repeats = hi if found else None
    return {"method": "simulation of the primary test (sign-flip over tasks) under clustering",
            "repeats": repeats, "studies_per_point": n_sim, "seed": seed, "alpha": alpha,
            "tau": tau, "sd_base": sd_base,
            "achieved_power": sim(repeats)["power"]["primary"] if repeats else None,
            "mc_se": sim(repeats)["mc_se"] if repeats else None,
            "sign_test_power": sim(repeats)["power"]["sign_test"] if repeats else None,
            "power_by_repeats": [{"repeats": r, "power": c["power"]["primary"],
                                  "sign_test_power": c["power"]["sign_test"]}
                                 for r, c in sorted(cache.items())]}


def _power_argument_problems(p0: float, p1: float, delta: float, n_tasks: int, alpha: float,
                             power: float, tau: float, max_repeats: int, simulate: int) -> list[str]:
    """What is wrong with paired_power_repeats's arguments, in words (empty: nothing)."""
    problems = []
    if not 0.0 <= p0 <= 1.0:
        problems.append("p_base must be in [0, 1]")
    if delta == 0:
        problems.append("delta must be non-zero")
    elif not 0.0 <= p1 <= 1.0:
        problems.append("p_base + delta must be in [0, 1]")
    if int(n_tasks) != n_tasks or n_tasks < 1:
        problems.append("n_tasks must be a positive integer")
    if not 0.0 < alpha < 1.0:
        problems.append("alpha must be in (0, 1)")
    if not 0.0 < power < 1.0:
        problems.append("power must be in (0, 1)")
    if tau < 0:
        problems.append("tau must be >= 0")
    if max_repeats < 1:
        problems.append("max_repeats must be >= 1")
    if simulate < 0:
        problems.append("simulate must be >= 0")
    return problems


def _power_at(r: int, n_tasks: int, delta: float, tau: float, binom_var: float, z_a: float) -> float:
    """Power of the normal approximation with r repeats (see paired_power_repeats)."""
    var = tau * tau + binom_var / r
    if var <= 0.0:
        # No noise at all (p0, p1 in {0, 1} and tau = 0): any repeat shows the difference.
        return 1.0
    return statistics.NormalDist().cdf(math.sqrt(n_tasks) * abs(delta) / math.sqrt(var) - z_a)


def _power_repeats(binom_var: float, denom: float) -> tuple[int | None, float | None]:
    """(repeats, the exact real-valued solution) of r >= binom_var / denom; (None, None) when no
    number of repeats suffices (denom <= 0)."""
    exact_r = binom_var / denom if denom > 0 else None
    if denom <= 0:
        repeats = None
    elif binom_var == 0.0:
        repeats = 1
    else:
        repeats = max(1, math.ceil(exact_r - 1e-9))
    return repeats, exact_r


def _sign_test_min_tasks(alpha: float) -> int:
    """Fewest informative tasks on which the exact sign test can reach p <= alpha."""
    n = 1
    while sign_test_min_p(n) > alpha:
        n += 1
    return n


def _power_notes(repeats: int | None, max_repeats: int, power: float, n_tasks: int, tau: float,
                 min_tasks: int | None, alpha: float, sign_min_tasks: int) -> list[str]:
    """The plan's caveats in words (see paired_power_repeats)."""
    notes = []
    if repeats is None:
        notes.append(f"no number of repeats reaches power {power} with {n_tasks} tasks when the "
                     f"between-task sd of the difference is {tau}; use at least {min_tasks} tasks")
    elif repeats > max_repeats:
        notes.append(f"{repeats} repeats needed, above the cap of {max_repeats}")
    if n_tasks < sign_min_tasks:
        notes.append(f"no test over tasks (the primary sign-flip test or the sign test) can reach "
                     f"p <= {alpha} with fewer than {sign_min_tasks} tasks, whatever the repeats; "
                     f"add tasks")
    if n_tasks < 10:
        notes.append("fewer than 10 tasks: the normal approximation is optimistic; read the "
                     "simulated power of the primary test (`simulation`)")
    return notes


def paired_power_repeats(p_base: float, delta: float, n_tasks: int, alpha: float = 0.05,
                         power: float = 0.8, *, tau: float = 0.0, max_repeats: int = 1000,
                         simulate: int = 0, seed: int = 0) -> dict:
    """Repeats per task-arm cell needed to detect a success-rate difference `delta` (paired design).

    Approximation (normal, on paired per-task differences). Each of `n_tasks` tasks is run r
    times in both arms; d_t = (arm rate on t) - (baseline rate on t). With independent runs,
        Var(d_t) = tau^2 + (p0 (1 - p0) + p1 (1 - p1)) / r,   p0 = p_base, p1 = p_base + delta,
    where tau is the between-task standard deviation of the true difference (0: the treatment
    shifts every task alike). The mean of the d_t over tasks is approximately normal, so a
    two-sided level-alpha test has power Phi(sqrt(n_tasks) |delta| / sd(d_t) - z_{1-alpha/2}).
    Solving for the target power gives
        r >= (p0 q0 + p1 q1) / (n_tasks delta^2 / (z_{1-alpha/2} + z_power)^2 - tau^2).
    Assumptions and caveats: runs are independent given task and arm; using p0 q0 + p1 q1 for
    every task is conservative when tasks differ in difficulty (the mean of p_t (1 - p_t) is at
    most p (1 - p)); the normal approximation is optimistic for fewer than about 10 tasks (no
    t correction). If the denominator is not positive no number of repeats suffices: more tasks
    are needed, and `min_tasks` says how many (with unlimited repeats).
    With `simulate` > 0, a seeded Monte Carlo (random.Random(seed)) of that many studies at the
    recommended r reports the rejection rate of the primary test (sign-flip over tasks) and of
    the sign test, in the direction of delta (see _power_simulation; `assign` searches the
    repeats by that simulation, primary_power_by_simulation).
    Reference for the sample-size formula: Chow, Shao & Wang, Sample Size Calculations in
    Clinical Research, 2nd ed. (2008), section 3.1 (paired one-sample mean comparison).
    Raises AgentbenchError (exit 2) on arguments outside their ranges.
    """
    p0 = float(p_base)
    p1 = p0 + float(delta)
    problems = _power_argument_problems(p0, p1, delta, n_tasks, alpha, power, tau, max_repeats,
                                        simulate)
    if problems:
        raise AgentbenchError("invalid power-estimate arguments", code="invalid_power_estimate_arguments",
                              problems=problems,
                              p_base=p_base, delta=delta, n_tasks=n_tasks, alpha=alpha,
                              power=power)
    n_tasks = int(n_tasks)
    norm = statistics.NormalDist()
    z_a = norm.inv_cdf(1.0 - alpha / 2.0)
    z_b = norm.inv_cdf(power)
    binom_var = p0 * (1.0 - p0) + p1 * (1.0 - p1)
    denom = n_tasks * delta * delta / (z_a + z_b) ** 2 - tau * tau

    def power_at(r: int) -> float:
        return _power_at(r, n_tasks, delta, tau, binom_var, z_a)

    repeats, exact_r = _power_repeats(binom_var, denom)
    min_tasks = None
    if tau > 0:
        # With unlimited repeats the binomial term vanishes:
        # n_tasks > tau^2 (z_a + z_b)^2 / delta^2.
        min_tasks = math.floor(tau * tau * (z_a + z_b) ** 2 / (delta * delta)) + 1
    feasible = repeats is not None and repeats <= max_repeats
    shown = repeats if repeats is not None else max_repeats
    curve = [{"repeats": r, "power": power_at(r)}
             for r in sorted({1, 2, 3, 5, 10, 20, min(shown, max_repeats)}) if r <= max_repeats]
    sign_min_tasks = _sign_test_min_tasks(alpha)
    notes = _power_notes(repeats, max_repeats, power, n_tasks, tau, min_tasks, alpha, sign_min_tasks)
    out: dict[str, Any] = {
        "method": "normal approximation on paired per-task differences",
        "formula": "r >= (p0 q0 + p1 q1) / (n_tasks delta^2 / (z_{1-alpha/2} + z_power)^2 - tau^2)",
        "assumptions": [
            "runs independent given task and arm",
            "binomial variance p(1-p) at the average rates for every task (conservative)",
            "between-task sd of the true difference = tau",
            "mean of per-task differences approximately normal (optimistic below ~10 tasks)",
        ],
        "p_base": p0, "p_arm": p1, "delta": float(delta), "n_tasks": n_tasks,
        "alpha": alpha, "power": power, "tau": tau,
        "z_alpha": z_a, "z_power": z_b,
        "repeats": repeats, "repeats_exact": exact_r, "feasible": feasible,
        "max_repeats": max_repeats,
        "runs_per_arm": repeats * n_tasks if repeats is not None else None,
        "achieved_power": power_at(repeats) if repeats is not None else None,
        "min_tasks": min_tasks,
        "sign_test_min_tasks": sign_min_tasks,
        "power_by_repeats": curve,
        "notes": notes,
    }
    if simulate and repeats is not None:
        out["simulation"] = _power_simulation(p0, float(delta), n_tasks, min(repeats, max_repeats),
                                              alpha, tau, simulate, seed)
    return out


# -- Statistics: exclusions, multiplicity, planning ------------------------------------------------
# Fisher's exact test, Holm's adjustment, the minimum detectable difference and the expected cost
# of a study.

def fisher_exact_two_sided(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact test of independence in the 2x2 table [[a, b], [c, d]].

    With the margins fixed, the top-left cell x is hypergeometric:
        P(x) = C(a+b, x) C(c+d, a+c-x) / C(n, a+c),   max(0, a+c-(c+d)) <= x <= min(a+b, a+c).
    The two-sided p sums P(x) over every table no more probable than the observed one (the
    "probability" method of R's fisher.test and SciPy).  The weights C(.)C(.) are exact
    integers, so "no more probable" is decided exactly, without a tolerance; one division at
    the end.  p = 1.0 for a table with an empty margin.
    References: Fisher, Statistical Methods for Research Workers (1925), sec. 21.02;
    Agresti, Categorical Data Analysis, 3rd ed. (2013), sec. 3.5.1.
    """
    cells = (a, b, c, d)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in cells):
        raise ValueError(f"a 2x2 table needs non-negative integer cells, got {cells}")
    r1, r2, c1 = a + b, c + d, a + c
    n = r1 + r2
    lo, hi = max(0, c1 - r2), min(r1, c1)

    def weight(x: int) -> int:
        return math.comb(r1, x) * math.comb(r2, c1 - x)

    observed = weight(a)
    tail = sum(w for w in (weight(x) for x in range(lo, hi + 1)) if w <= observed)
    return min(1.0, tail / math.comb(n, c1))


def holm_adjust(ps: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values for a family of tests (None entries are not tests).

    With the m p-values sorted, p_(1) <= ... <= p_(m), the adjusted value of the i-th smallest is
        max over j <= i of min(1, (m - j + 1) p_(j)),
    so that rejecting every hypothesis whose adjusted p is <= alpha controls the family-wise
    error rate at alpha under any dependence between the tests.  Ties keep their input order;
    the result is in the input's order.  Reference: Holm, "A simple sequentially rejective
    multiple test procedure", Scandinavian Journal of Statistics 6:65-70 (1979).
    """
    for p in ps:
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not 0.0 <= float(p) <= 1.0):
            raise ValueError(f"a p-value must be a number in [0, 1], got {p!r}")
    order = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: float(ps[i]))
    m = len(order)
    out: list[float | None] = [None] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(ps[i])))
        out[i] = running
    return out


def min_detectable_difference(p_base: float, n_tasks: int, repeats: int, alpha: float = 0.05,
                              power: float = 0.8, tau: float = 0.0) -> dict[str, float | None]:
    """Smallest success-rate difference (up and down from `p_base`) that `n_tasks` tasks x
    `repeats` repeats detect with `power` at two-sided level `alpha`, under the model of
    paired_power_repeats: n d^2 / K = tau^2 + (p0 q0 + p1 q1) / r with K = (z_{1-alpha/2} +
    z_power)^2 and p1 = p0 +- d.  Since p1 q1 = p0 q0 +- d (1 - 2 p0) - d^2, this is the quadratic
        (n / K + 1 / r) d^2 -+ ((1 - 2 p0) / r) d - (2 p0 q0 / r + tau^2) = 0,
    whose positive root is the answer; None when it would take p1 outside [0, 1] (no difference
    in that direction is detectable)."""
    if not 0.0 <= p_base <= 1.0 or n_tasks < 1 or repeats < 1 or not 0 < alpha < 1 \
            or not 0 < power < 1 or tau < 0:
        raise ValueError("need 0 <= p_base <= 1, n_tasks >= 1, repeats >= 1, 0 < alpha, power < 1, tau >= 0")
    norm = statistics.NormalDist()
    k = (norm.inv_cdf(1.0 - alpha / 2.0) + norm.inv_cdf(power)) ** 2
    a = n_tasks / k + 1.0 / repeats
    c = 2.0 * p_base * (1.0 - p_base) / repeats + tau * tau
    out: dict[str, float | None] = {}
    for name, sign in (("increase", 1.0), ("decrease", -1.0)):
        b = sign * (1.0 - 2.0 * p_base) / repeats
        d = (b + math.sqrt(b * b + 4.0 * a * c)) / (2.0 * a)
        p1 = p_base + sign * d
        out[name] = d if -1e-12 <= p1 <= 1.0 + 1e-12 else None
    return out


# Tokens one session is assumed to use when nothing measured is at hand (a default, not a
# measurement: the plan says so).  Priced at the study's model list price.
PLAN_SESSION_TOKENS = {"input": 10_000, "output": 15_000, "cache_creation": 60_000, "cache_read": 1_000_000}


def plan_study_cost(arms: Mapping[str, Mapping[str, Any]], n_tasks: int, repeats: int,
                    pilot: Mapping[str, Sequence[float]], rehearsal: Mapping[str, Mapping[str, Any]] | None,
                    model: str | None, prices: Mapping[str, Sequence[float]] | None = None) -> dict[str, Any]:
    """Expected cost of n_tasks x repeats runs per arm (pure).

    Per arm, the cost of one run is, in this order: the mean cost of the arm's pilot runs (real
    runs outside the split being planned, with a reported cost); the arm's mean cost per run in
    the study's rehearsal (the scripted model's usage at list prices: short sessions, a floor
    rather than a forecast); else PLAN_SESSION_TOKENS at the model's list price times the most
    sessions the arm can start (1 + gate cycles + 2 with a review), marked estimated.
    `arms` maps a name to {"gate_cycles", "review"}."""
    per_arm: dict[str, dict[str, Any]] = {}
    for name, arm in arms.items():
        costs = [float(c) for c in pilot.get(name) or []
                 if finite_number(c, lo=0.0) is not None]
        reh = (rehearsal or {}).get(name) if isinstance(rehearsal, Mapping) else None
        reh_runs = reh.get("runs") if isinstance(reh, Mapping) else None
        reh_cost = reh.get("cost_usd") if isinstance(reh, Mapping) else None
        if costs:
            basis, per_run, n = "pilot", math.fsum(costs) / len(costs), len(costs)
        elif isinstance(reh_runs, int) and reh_runs > 0 and finite_number(reh_cost, lo=0.0) is not None:
            basis, per_run, n = "rehearsal", float(reh_cost) / reh_runs, reh_runs
        else:
            sessions = 1 + int(arm.get("gate_cycles") or 0) + (2 if arm.get("review") else 0)
            basis, n = "token_estimate", 0
            per_run = sessions * estimate_cost_usd(PLAN_SESSION_TOKENS, model, prices)
        runs = n_tasks * repeats
        per_arm[name] = {"basis": basis, "measured_runs": n, "cost_per_run_usd": per_run,
                         "runs": runs, "cost_usd": per_run * runs}
    bases = sorted({a["basis"] for a in per_arm.values()})
    return {"study_usd": math.fsum(a["cost_usd"] for a in per_arm.values()),
            "runs": n_tasks * repeats * len(per_arm), "basis": bases,
            "estimated": "token_estimate" in bases, "per_arm": per_arm,
            "session_tokens_assumed": dict(PLAN_SESSION_TOKENS) if "token_estimate" in bases else None}


# ==================================================================================================
# The report: what each arm did
# ==================================================================================================
# Builds the report's data from run records and ledger lines: per arm, paired comparisons, per
# task, the behaviour audit, differential exclusions, multiplicity, and the usage aggregate, as
# JSON-ready dicts whose notes say in words what was left out.  Pure: the CLI reads the registry
# and the ledger and passes them in.  It must not read files or render tables, Markdown or HTML.

# Validity labels that take a run out of the primary results (SPEC 7, 14): such runs measure the
# infrastructure, not the treatment, or (tainted) a success the agent saw the answers for.  They
# stay listed, with their reasons, and in `all_included`.
REPORT_EXCLUDED_VALIDITY = ("infrastructure_failure", "degenerate", "tainted")

REPORT_SCHEMA = "agentbench-report/1"
#: The primary test of every comparison (see sign_flip_test), as the plan and the report name it.
REPORT_PRIMARY_TEST = "paired_sign_flip_over_tasks"
#: Bootstrap resamples per interval unless the analysis plan says otherwise.
REPORT_BOOTSTRAP_DRAWS = 10000
USAGE_SCHEMA = "agentbench-usage/1"
USAGE_GROUPINGS = ("kind", "arm", "task", "model", "status")


# -- How the report's notes quote a number ---------------------------------------------------------

def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:.1f}%"


def fmt_p(p: float | None) -> str:
    if p is None:
        return "-"
    return "<0.0001" if p < 0.0001 else f"{p:.4f}"


# -- Usage aggregate (the ledger) ------------------------------------------------------------------

_USAGE_TOKEN_KEYS = ("input", "output", "cache_creation", "cache_creation_1h", "cache_creation_5m",
                     "cache_read")


def cache_hit_ratio(tokens: dict) -> float | None:
    """Share of prompt tokens read from the prompt cache.

    cache_read / (input + cache_creation + cache_read). The denominator is every prompt token
    the API processed (uncached input, written to cache, read from cache). None when it is zero.
    """
    read = tokens.get("cache_read", 0) or 0
    denom = (tokens.get("input", 0) or 0) + (tokens.get("cache_creation", 0) or 0) + read
    return read / denom if denom else None


def usage_empty() -> dict:
    return {"jobs": 0, "statuses": {}, "tokens": {k: 0 for k in _USAGE_TOKEN_KEYS},
            "cost_usd": 0.0, "cost_estimated_usd": 0.0, "estimated_jobs": 0,
            "cost_metered_usd": 0.0, "metered_jobs": 0, "requests": 0, "models_metered": {},
            "cache_verdicts": {}, "duration_s": 0.0}


class UsageFigures(NamedTuple):
    """One ledger line's figures, each checked once (hostile numbers count 0 or are left out),
    then added to its group and to the totals."""
    status: str
    tokens: list[tuple[str, int]]
    cost: float
    estimated: bool
    metered: float | None
    requests: int
    models_metered: list[tuple[str, int, float]]
    verdict: str
    duration: float


def usage_figures(line: dict) -> UsageFigures:
    tokens = line.get("tokens")
    metered = line.get("cost_metered_usd")
    metered_ok = isinstance(metered, (int, float)) and not isinstance(metered, bool)
    models: list[tuple[str, int, float]] = []
    if metered_ok:
        mm = line.get("models_metered")
        for model, row in (mm.items() if isinstance(mm, dict) else ()):
            if isinstance(row, dict):
                models.append((str(model), count_from(row.get("requests")),
                               usd_from(row.get("cost_usd")) or 0.0))
    return UsageFigures(
        status=str(line.get("status") or "(none)"),
        tokens=([(key, count_from(value)) for key, value in tokens.items()]
                if isinstance(tokens, dict) else []),
        cost=usd_from(line.get("cost_delta_usd")) or 0.0,
        estimated=bool(line.get("estimated")),
        metered=float(metered) if metered_ok else None,
        requests=count_from(line.get("requests")) if metered_ok else 0,
        models_metered=models,
        verdict=str(line.get("cache_verdict") or "(none)"),
        duration=finite_number(line.get("duration_s"), lo=0.0) or 0.0)


def usage_add(acc: dict, fig: UsageFigures) -> None:
    acc["jobs"] += 1
    statuses = acc["statuses"]
    statuses[fig.status] = statuses.get(fig.status, 0) + 1
    tok = acc["tokens"]
    for key, value in fig.tokens:
        tok[key] = tok.get(key, 0) + value
    acc["cost_usd"] += fig.cost
    if fig.estimated:
        acc["cost_estimated_usd"] += fig.cost
        acc["estimated_jobs"] += 1
    if fig.metered is not None:
        # The gateway's figures beside the binary's own, per model (side models included).
        acc["cost_metered_usd"] += fig.metered
        acc["metered_jobs"] += 1
        acc["requests"] += fig.requests
        for model, requests, cost in fig.models_metered:
            mine = acc["models_metered"].setdefault(model, {"requests": 0, "cost_usd": 0.0})
            mine["requests"] += requests
            mine["cost_usd"] = round(mine["cost_usd"] + cost, 6)
    verdicts = acc["cache_verdicts"]
    verdicts[fig.verdict] = verdicts.get(fig.verdict, 0) + 1
    acc["duration_s"] += fig.duration


def usage_finish(acc: dict) -> dict:
    tok = acc["tokens"]
    acc["tokens_total"] = sum(tok.get(k, 0) for k in ("input", "output", "cache_creation",
                                                     "cache_read"))
    acc["cache_hit_ratio"] = cache_hit_ratio(tok)
    acc["cost_usd"] = round(acc["cost_usd"], 10)
    acc["cost_estimated_usd"] = round(acc["cost_estimated_usd"], 10)
    acc["cost_metered_usd"] = round(acc["cost_metered_usd"], 10)
    acc["duration_s"] = round(acc["duration_s"], 6)
    return acc


def _usage_key(line: dict, by: str) -> str:
    if by == "model":
        models = sorted({str(m) for m in (line.get("models_used") or []) if m})
        return ",".join(models) if models else "(none)"
    value = line.get(by)
    return "(none)" if value is None or value == "" else str(value)


def aggregate_usage(ledger_lines: Iterable[dict], by: str = "kind") -> dict:
    """Aggregate ledger lines (one per finished session) into groups by `by`.

    `by` is one of kind, arm, task, model, status; a missing key groups as "(none)". For
    `model`, a job's key is its sorted `models_used` joined by commas, so each job (and its
    cost) is counted exactly once. Per group and in `totals`: jobs, job statuses, tokens by
    type (cache_creation_1h/5m are the split of cache_creation, not added again in
    tokens_total), cost_usd with cost_estimated_usd (the part priced from list prices because
    the session ended before reporting its cost), cache_hit_ratio (see cache_hit_ratio), cache
    verdict counts, summed duration. Groups are ordered by key, "(none)" last.
    """
    if by not in USAGE_GROUPINGS:
        raise AgentbenchError(f"unknown grouping {by!r}", code="unknown_grouping",
                              choices=list(USAGE_GROUPINGS))
    groups: dict[str, dict] = {}
    totals = usage_empty()
    for line in ledger_lines:
        fig = usage_figures(line)   # checked once, added twice
        key = _usage_key(line, by)
        group = groups.get(key)
        if group is None:
            group = groups[key] = usage_empty()
        usage_add(group, fig)
        usage_add(totals, fig)
    order = sorted(groups, key=lambda k: (k == "(none)", k))
    notes = []
    if totals["estimated_jobs"]:
        notes.append(f"{totals['estimated_jobs']} job(s) ended before reporting a cost; "
                     f"${totals['cost_estimated_usd']:.4f} of the total is estimated from list "
                     f"prices (marked ~)")
    return {"schema": USAGE_SCHEMA, "by": by,
            "groups": {k: usage_finish(groups[k]) for k in order},
            "totals": usage_finish(totals), "notes": notes}


# -- The report: per arm, paired comparisons, per task ---------------------------------------------

def run_excluded(run: dict) -> bool:
    return run.get("validity") in REPORT_EXCLUDED_VALIDITY


def run_evaluated(run: dict) -> bool:
    return isinstance(run.get("evaluation"), dict)


def run_succeeded(run: dict) -> bool:
    return run_evaluated(run) and bool(run["evaluation"].get("success"))


def _rpt_pending(run: dict) -> str | None:
    """'not_started' / 'running' for a run that has not ended, else None."""
    status = run.get("status")
    return status if status in ("not_started", "running") else None


def _rpt_inc(d: dict, key: Any, by: int = 1) -> None:
    key = "(none)" if key is None else str(key)
    d[key] = d.get(key, 0) + by


def _rpt_task_rates(evaluated: list[dict]) -> list[float]:
    """Each task's success rate over its evaluated runs, in the order of the task keys (counted
    per task: successes and runs, no list per run)."""
    per_task: dict[str, list[int]] = {}
    for r in evaluated:
        cell = per_task.setdefault(str(r.get("_task", r.get("task"))), [0, 0])
        cell[0] += run_succeeded(r)
        cell[1] += 1
    return [s / n for _, (s, n) in sorted(per_task.items())]


def _rpt_not_evaluated_causes(ended_unevaluated: list[dict]) -> dict[str, int]:
    """Runs that ended without an evaluation, counted by cause."""
    not_eval_by_cause: dict[str, int] = {}
    for r in ended_unevaluated:
        # Name the cause by outcome when there is one; an error or interruption status wins
        # over a plain "failure" outcome, which would hide why the run was never graded.
        cause = r.get("outcome") or r.get("status") or "unknown"
        if r.get("status") in ("error", "interrupted") and cause == "failure":
            cause = r.get("status")
        _rpt_inc(not_eval_by_cause, cause)
    return not_eval_by_cause


def _rpt_token_totals(runs: list[dict]) -> dict[str, int]:
    """Tokens summed by type over `runs`, and their `total` (input, output, cache write and read)."""
    tokens: dict[str, int] = {}
    for r in runs:
        for k, v in (r.get("tokens") or {}).items():
            if isinstance(v, (int, float)):
                tokens[k] = tokens.get(k, 0) + v
    tokens["total"] = sum(v for k, v in tokens.items() if k in ("input", "output",
                                                                "cache_creation", "cache_read"))
    return tokens


def _rpt_gate_cycles(started: list[dict]) -> dict:
    """Gate cycles of the started runs: total, mean, max and how many runs had each count."""
    cycles = [int(r.get("gate_cycles") or 0) for r in started]
    cycle_dist: dict[str, int] = {}
    for c in sorted(cycles):
        _rpt_inc(cycle_dist, c)
    return {"total": sum(cycles), "mean": mean(cycles),
            "max": max(cycles) if cycles else None, "distribution": cycle_dist}


def _rpt_review_verdicts(started: list[dict]) -> dict[str, dict[str, int]]:
    """Review verdicts of the started runs: every one, and each run's last."""
    verdicts_all: dict[str, int] = {}
    verdicts_final: dict[str, int] = {}
    for r in started:
        vs = r.get("review_verdicts") or []
        for v in vs:
            _rpt_inc(verdicts_all, v)
        if vs:
            _rpt_inc(verdicts_final, vs[-1])
    return {"all": verdicts_all, "final": verdicts_final}


def _rpt_failure_reasons(started: list[dict]) -> dict[str, int]:
    """Why the started runs that ended without success failed, counted by reason."""
    reasons: dict[str, int] = {}
    for r in started:
        if _rpt_pending(r) or run_succeeded(r):
            continue
        _rpt_inc(reasons, r.get("failure_reason") or "(none given)")
    return reasons


def _rpt_arm_stats(runs: list[dict], left_out: list[dict], seed: int = 0, draws: int = 10000) -> dict:
    """Per-arm figures over `runs` (the view); `left_out` are the arm's runs outside the view.

    Besides the run-level rate and its Wilson interval, the task-level rate: the mean over tasks
    of each task's success rate, with a percentile bootstrap interval that resamples tasks.  Runs
    of one task are correlated (its repeats share its difficulty), so the task is the unit the
    study replicates; with repeats and tasks that differ, the Wilson interval is too narrow and
    this one is the honest width.  It resamples tasks only (a one-stage cluster bootstrap), so it
    misses the noise within a task: with few tasks, or tasks that scored alike, it is too narrow
    itself.  `seed` is this arm's own stream (stream_seed).  Reference: Davison & Hinkley,
    Bootstrap Methods and their Application (1997), 3.8."""
    started = [r for r in runs if r.get("status") != "not_started"]
    evaluated = [r for r in runs if run_evaluated(r)]
    successes = sum(1 for r in evaluated if run_succeeded(r))
    task_rates = _rpt_task_rates(evaluated)
    task_ci = bootstrap_mean_diff_ci(task_rates, seed, draws)
    ended_unevaluated = [r for r in runs if not run_evaluated(r) and not _rpt_pending(r)]
    outcomes: dict[str, int] = {}
    for r in started:
        _rpt_inc(outcomes, r.get("outcome"))
    scores = [float(r["evaluation"]["score"]) for r in evaluated
              if isinstance(r["evaluation"].get("score"), (int, float))]
    cost = math.fsum(float(r.get("cost_usd") or 0.0) for r in runs)
    cost_est_runs = [r for r in runs if r.get("cost_estimated")]
    cost_est = math.fsum(float(r.get("cost_usd") or 0.0) for r in cost_est_runs)
    walls = [float(r["wall_s"]) for r in started if isinstance(r.get("wall_s"), (int, float))]
    n_eval = len(evaluated)
    # Conservative view: every ended run counts; one without an evaluation counts as a failure.
    n_ended = n_eval + len(ended_unevaluated)
    tests_passed = sum(int(r["evaluation"].get("tests_passed") or 0) for r in evaluated)
    tests_total = sum(int(r["evaluation"].get("tests_total") or 0) for r in evaluated)

    def count(pred) -> int:
        return sum(1 for r in runs if pred(r))

    return {
        "runs": len(runs) + len(left_out),
        "in_view": len(runs),
        "excluded": len(left_out),
        "not_started": count(lambda r: r.get("status") == "not_started"),
        "running": count(lambda r: r.get("status") == "running"),
        "started": len(started),
        "evaluated": n_eval,
        "not_evaluated": len(ended_unevaluated),
        "not_evaluated_by_cause": _rpt_not_evaluated_causes(ended_unevaluated),
        "successes": successes,
        "failures": n_eval - successes,
        "success_rate": successes / n_eval if n_eval else None,
        "success_ci": list(wilson_interval(successes, n_eval)) if n_eval else None,
        "tasks_evaluated": len(task_rates),
        "task_success_rate": mean(task_rates),
        "task_success_ci": list(task_ci) if task_ci else None,
        "success_rate_conservative": successes / n_ended if n_ended else None,
        "success_ci_conservative": list(wilson_interval(successes, n_ended)) if n_ended else None,
        "errors": count(lambda r: r.get("status") == "error" or r.get("outcome") == "error"),
        "interrupted": count(lambda r: r.get("status") == "interrupted"
                             or r.get("outcome") == "interrupted"),
        "budget_exhausted": count(lambda r: r.get("outcome") == "budget_exhausted"),
        "timeouts": count(lambda r: r.get("outcome") == "timeout"),
        "outcomes": outcomes,
        "mean_score": mean(scores),
        "tests_passed": tests_passed,
        "tests_total": tests_total,
        "cost_usd": cost,
        "cost_estimated_usd": cost_est,
        "cost_estimated_runs": len(cost_est_runs),
        "cost_per_run_usd": cost / len(started) if started else None,
        "cost_per_success_usd": cost / successes if successes else None,
        "cost_excluded_usd": math.fsum(float(r.get("cost_usd") or 0.0) for r in left_out),
        "tokens": _rpt_token_totals(runs),
        "median_wall_s": median(walls),
        "gate_cycles": _rpt_gate_cycles(started),
        "review_verdicts": _rpt_review_verdicts(started),
        "failure_reasons": _rpt_failure_reasons(started),
    }


def _rpt_index(runs: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Runs grouped by (task, arm), built once so the report stays linear in the run count."""
    index: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        index.setdefault((r["_task"], r["arm"]), []).append(r)
    return index


def _rpt_task_cells(index: dict, arms: list[str], tasks: list[str]) -> dict:
    """Per task, per arm: runs, evaluated, successes, rate, mean score, cost."""
    out: dict[str, dict] = {}
    for task in tasks:
        row = {}
        for arm in arms:
            cell = index.get((task, arm), [])
            ev = [r for r in cell if run_evaluated(r)]
            s = sum(1 for r in ev if run_succeeded(r))
            scores = [float(r["evaluation"]["score"]) for r in ev
                      if isinstance(r["evaluation"].get("score"), (int, float))]
            row[arm] = {"runs": len(cell), "evaluated": len(ev), "successes": s,
                        "success_rate": s / len(ev) if ev else None,
                        "mean_score": mean(scores),
                        "cost_usd": math.fsum(float(r.get("cost_usd") or 0.0) for r in cell)}
        out[task] = row
    return out


def _rpt_exact_mean(values: list[Any]) -> Any:
    """The exact mean of ints, floats or fractions, as a fraction: the same whatever their order."""
    return sum((fractions.Fraction(v) for v in values), fractions.Fraction(0)) / len(values)


def _rpt_primary(diffs: list[Any], seed: int, names: tuple[str, ...]) -> dict[str, Any]:
    """The primary test of one comparison: sign_flip_test on the exact per-task differences, on
    its own stream of random numbers (used only past the exact enumeration)."""
    res = sign_flip_test(diffs, seed=stream_seed(seed, "sign_flip", *names))
    return {"test": REPORT_PRIMARY_TEST, **res, "p_holm": None}


def _rpt_paired_metric(index: dict, arm: str, base: str, tasks: list[str], seed: int,
                       value: Callable[[dict], float | None], runs_of: Callable[[dict], bool],
                       names: tuple[str, ...], draws: int = 10000, primary: bool = False) -> dict:
    """Paired difference of a per-run number (arm minus baseline) over tasks: per task the exact
    mean over the runs `runs_of` keeps that have a value, in each arm; then the mean over tasks
    where both arms have one, its seeded bootstrap 95% CI and cluster-robust standard error (as
    for success rates), the counts of tasks where the arm is higher / lower / equal with an
    exact two-sided sign test on them (secondary), and with `primary` the primary sign-flip test.
    `names` name the figure's random streams."""
    per_task, exact = [], []
    higher = lower = equal = 0
    for task in tasks:
        va = [v for v in (value(r) for r in index.get((task, arm), []) if runs_of(r)) if v is not None]
        vb = [v for v in (value(r) for r in index.get((task, base), []) if runs_of(r)) if v is not None]
        if not va or not vb:
            continue
        ma, mb = _rpt_exact_mean(va), _rpt_exact_mean(vb)
        d = ma - mb
        if d == 0:
            equal += 1
        elif d > 0:
            higher += 1
        else:
            lower += 1
        exact.append(d)
        per_task.append({"task": task, "arm": float(ma), "baseline": float(mb), "diff": float(d),
                         "arm_n": len(va), "baseline_n": len(vb)})
    diffs = [t["diff"] for t in per_task]
    ci = bootstrap_mean_diff_ci(diffs, stream_seed(seed, "bootstrap", *names), draws)
    out = {"tasks_compared": len(per_task), "mean_diff": mean(diffs), "ci": list(ci) if ci else None,
           "se_cluster": cluster_se_of_mean(diffs),
           "higher": higher, "lower": lower, "equal": equal,
           "sign_test_p": sign_test_two_sided(higher, lower) if per_task else None, "per_task": per_task}
    if primary:
        out["primary"] = _rpt_primary(exact, seed, names)
    return out


def run_score(run: dict) -> float | None:
    ev = run.get("evaluation")
    score = ev.get("score") if isinstance(ev, dict) else None
    return finite_number(score, lo=0.0, hi=1.0)


def run_cost(run: dict) -> float | None:
    return usd_from(run.get("cost_usd"), hi=math.inf)


def _rpt_ended(run: dict) -> bool:
    return _rpt_pending(run) is None


def _rpt_compare(index: dict, arm: str, base: str, tasks: list[str], seed: int,
                 draws: int = 10000) -> dict:
    """Paired comparison of `arm` against `base` over tasks where both have evaluated runs (and,
    apart, of the hidden-test score and of the cost per ended run).

    Per task the difference of the two success rates, each over the runs that arm has on the
    task (a missing repeat costs only itself; repeats are never paired by their index, which the
    assignment shuffles).  Primary: the sign-flip test of the mean difference (`primary`; its
    Holm adjustment is added over the family later).  Secondary, unadjusted: the sign test over
    tasks and the task-clustered McNemar test.  Every random figure draws from its own stream,
    named by the figure, the arm and the baseline (the two views of one figure share it: common
    random numbers, so a difference between the views comes from the runs, not the draws)."""
    per_task, exact, cells = [], [], []
    no_arm, no_base, neither = [], [], []
    wins = losses = ties = 0
    for task in tasks:
        ra = [r for r in index.get((task, arm), []) if run_evaluated(r)]
        rb = [r for r in index.get((task, base), []) if run_evaluated(r)]
        if not ra or not rb:
            if ra:
                no_base.append(task)
            elif rb:
                no_arm.append(task)
            else:
                neither.append(task)
            continue
        sa = sum(1 for r in ra if run_succeeded(r))
        sb = sum(1 for r in rb if run_succeeded(r))
        d = fractions.Fraction(sa, len(ra)) - fractions.Fraction(sb, len(rb))
        if d > 0:
            wins += 1
        elif d < 0:
            losses += 1
        else:
            ties += 1
        exact.append(d)
        cells.append((sa, len(ra), sb, len(rb)))
        per_task.append({"task": task, "arm_rate": sa / len(ra), "baseline_rate": sb / len(rb),
                         "diff": float(d), "arm_n": len(ra), "baseline_n": len(rb)})
    diffs = [t["diff"] for t in per_task]
    names = ("success", arm, base)
    ci = bootstrap_mean_diff_ci(diffs, stream_seed(seed, "bootstrap", *names), draws)
    return {
        "arm": arm, "baseline": base,
        "tasks_compared": len(per_task),
        "tasks_without_arm_data": no_arm,
        "tasks_without_baseline_data": no_base,
        "tasks_without_data": neither,
        "mean_diff": mean(diffs),
        "ci": list(ci) if ci else None,
        "se_cluster": cluster_se_of_mean(diffs),
        "primary": _rpt_primary(exact, seed, names),
        "wins": wins, "losses": losses, "ties": ties,
        "sign_test_p": sign_test_two_sided(wins, losses) if per_task else None,
        "clustered_mcnemar": clustered_mcnemar(cells) if per_task else None,
        "per_task": per_task,
        "score": _rpt_paired_metric(index, arm, base, tasks, seed, run_score, run_evaluated,
                                    ("score", arm, base), draws, primary=True),
        "cost_per_run_usd": _rpt_paired_metric(index, arm, base, tasks, seed, run_cost, _rpt_ended,
                                               ("cost", arm, base), draws),
    }


def _rpt_view(runs: list[dict], left_out: list[dict], arms: list[str], base: str,
              tasks: list[str], seed: int, draws: int = 10000, same_as: dict | None = None,
              changed: frozenset[str] = frozenset()) -> dict:
    """One view's per-arm figures, comparisons and per-task cells.  With `same_as` (another view
    of the same study) the figures of every arm not in `changed`, and the comparisons where
    neither side is, are that view's (copied): their runs are the same, so is every figure."""
    by_arm: dict[str, list[dict]] = {a: [] for a in arms}
    out_by_arm: dict[str, list[dict]] = {a: [] for a in arms}
    for r in runs:
        by_arm[r["arm"]].append(r)
    for r in left_out:
        out_by_arm[r["arm"]].append(r)
    index = _rpt_index(runs)
    per_arm = {a: (copy.deepcopy(same_as["per_arm"][a]) if same_as and a not in changed else
                   _rpt_arm_stats(by_arm[a], out_by_arm[a],
                                  stream_seed(seed, "bootstrap", "task_success_rate", a), draws))
               for a in arms}
    comparisons = {a: (copy.deepcopy(same_as["comparisons"][a])
                       if same_as and a not in changed and base not in changed
                       else _rpt_compare(index, a, base, tasks, seed, draws))
                   for a in arms if a != base}
    return {"per_arm": per_arm, "comparisons": comparisons,
            "per_task": _rpt_task_cells(index, arms, tasks)}


def _rpt_view_notes(view: dict, base: str, label: str, alpha: float = 0.05) -> list[str]:
    notes = []
    for arm, st in view["per_arm"].items():
        if st["runs"] == 0:
            notes.append(f"{label}arm {arm} has no runs")
            continue
        if st["not_evaluated"]:
            causes = ", ".join(f"{v} {k}" for k, v in st["not_evaluated_by_cause"].items())
            notes.append(
                f"{label}arm {arm}: {st['not_evaluated']} run(s) ended without an evaluation "
                f"({causes}); its success rate uses the {st['evaluated']} evaluated run(s); "
                f"counting the unevaluated ones as failures gives "
                f"{fmt_pct(st['success_rate_conservative'])} (success_rate_conservative)")
        graded_stops = st["budget_exhausted"] + st["timeouts"] - sum(
            st["not_evaluated_by_cause"].get(k, 0) for k in ("budget_exhausted", "timeout"))
        if graded_stops > 0:
            notes.append(f"{label}arm {arm}: {graded_stops} run(s) stopped on budget or time "
                         f"and were graded on their final workspace; they count as results")
        if st["evaluated"] == 0 and st["in_view"]:
            notes.append(f"{label}arm {arm}: no evaluated runs, so no success rate")
        if st["tasks_evaluated"] == 1:
            notes.append(f"{label}arm {arm}: evaluated runs of a single task, so the interval "
                         f"over tasks is a point and says nothing about other tasks")
        elif st["tasks_evaluated"] > 1 and st["task_success_ci"][0] == st["task_success_ci"][1]:
            notes.append(f"{label}arm {arm}: its {st['tasks_evaluated']} tasks all had the same "
                         f"success rate, so the interval over tasks is a point; it does not "
                         f"carry the noise within a task (see the Wilson interval)")
    for arm, cmp in view["comparisons"].items():
        n_all = (cmp["tasks_compared"] + len(cmp["tasks_without_arm_data"])
                 + len(cmp["tasks_without_baseline_data"]) + len(cmp["tasks_without_data"]))
        if cmp["tasks_compared"] == 0:
            notes.append(f"{label}{arm} vs {base}: no task has evaluated runs in both arms; "
                         f"no paired comparison")
            continue
        if cmp["tasks_compared"] < n_all:
            notes.append(f"{label}{arm} vs {base}: {cmp['tasks_compared']} of {n_all} tasks "
                         f"have evaluated runs in both arms; only those are compared")
        if cmp["tasks_compared"] == 1:
            notes.append(f"{label}{arm} vs {base}: a single task, so the bootstrap interval is "
                         f"a point and says nothing about other tasks")
        informative = cmp["wins"] + cmp["losses"]
        if 0 < informative and sign_test_min_p(informative) > alpha:
            notes.append(f"{label}{arm} vs {base}: with {informative} task(s) that differ, no test "
                         f"over tasks (primary or sign test) can go below p = "
                         f"{sign_test_min_p(informative):.4g}")
        if informative == 0:
            notes.append(f"{label}{arm} vs {base}: every compared task is tied; the primary test's "
                         f"p = 1")
        for what, prim in (("success", cmp["primary"]), ("score", cmp["score"].get("primary") or {})):
            if prim.get("method") == "monte_carlo":
                notes.append(f"{label}{arm} vs {base}: too many distinct task differences in {what} "
                             f"to enumerate every sign flip; its primary p is from {prim['draws']} "
                             f"random flips (Monte Carlo standard error {prim['mc_se']:.2g})")
    return notes


# -- Report: behaviour audit, differential exclusions, multiplicity --------------------------------
# Read from the run records (the audit the pipeline wrote, the validity labels) and the views the
# builder computed; they add keys to the report and never change a figure computed above.

# Significance level of the report's own screening tests (differential exclusions) and of the
# family-wise error rate that Holm's adjustment controls.
REPORT_ALPHA = 0.05

# The groups audit findings are counted under, with the words the renderers use.  A kind the audit
# learns later that fits none of them is counted under its own name.
REPORT_AUDIT_GROUPS = {
    "edited_tests": "edited public tests or checks",
    "outside_workspace": "paths outside the workspace",
    "reads_oracle": "hidden tests or reference",
    "reads_gate": "gate (check) files",
    "reads_tasks": "task bundle files",
    "reads_study": "study or state files",
}


def audit_group(kind: str) -> str:
    """The report group of one audit finding kind (see REPORT_AUDIT_GROUPS)."""
    if kind.startswith("edited_"):
        return "edited_tests"
    if kind.endswith("_outside_workspace"):
        return "outside_workspace"
    m = re.fullmatch(r"(?:reads|bash_touches)_(\w+)", kind)
    if m and f"reads_{m.group(1)}" in REPORT_AUDIT_GROUPS:
        return f"reads_{m.group(1)}"
    return kind


def run_audit(run: dict) -> dict:
    """One run's audit as the report counts it: {audited, flagged, groups: {group: findings}}.

    The audit record is the pipeline's, but a run record is a file: a finding that is not an
    object with a string kind is counted as `malformed_finding`, never dropped, and a record that
    says flagged with no findings stays flagged."""
    audit = run.get("audit")
    if not isinstance(audit, dict):
        return {"audited": False, "flagged": False, "groups": {}}
    groups: dict[str, int] = {}
    findings = audit.get("findings")
    for f in findings if isinstance(findings, list) else []:
        kind = f.get("kind") if isinstance(f, dict) else None
        _rpt_inc(groups, audit_group(kind) if isinstance(kind, str) and kind else "malformed_finding")
    if findings is not None and not isinstance(findings, list):
        _rpt_inc(groups, "malformed_finding")
    return {"audited": True, "flagged": bool(groups) or audit.get("flagged") is True, "groups": groups}


def report_behaviour(runs: list[dict], arms: list[str]) -> dict:
    """Per arm, over every run of the study (excluded ones too, each marked): audited and flagged
    runs, findings and runs by group, the flagged runs themselves and the successes among them."""
    out: dict[str, dict] = {}
    for arm in arms:
        out[arm] = {"runs": 0, "audited": 0, "flagged": 0, "flagged_successes": 0,
                    "findings_by_group": {}, "runs_by_group": {}, "flagged_runs": []}
    for r in runs:
        st, a = out[r["arm"]], run_audit(r)
        st["runs"] += 1
        st["audited"] += a["audited"]
        if not a["flagged"]:
            continue
        st["flagged"] += 1
        st["flagged_successes"] += run_succeeded(r)
        for g, n in a["groups"].items():
            _rpt_inc(st["findings_by_group"], g, n)
            _rpt_inc(st["runs_by_group"], g)
        st["flagged_runs"].append({"run_id": r.get("run_id"), "task": r["_task"], "repeat": r.get("repeat"),
                                   "success": run_succeeded(r), "outcome": r.get("outcome"),
                                   "excluded": run_excluded(r), "groups": dict(sorted(a["groups"].items()))})
    return out


def _rpt_flag_view(view: dict, view_runs: list[dict]) -> None:
    """Add flagged-run counts to a view: per arm (`flagged`, `flagged_successes`) and per
    comparison (`flagged_runs`: the flagged evaluated runs of each side on the compared tasks)."""
    flagged = {id(r) for r in view_runs if run_audit(r)["flagged"]}
    for arm, st in view["per_arm"].items():
        mine = [r for r in view_runs if r["arm"] == arm and id(r) in flagged]
        st["flagged"] = len(mine)
        st["flagged_successes"] = sum(1 for r in mine if run_succeeded(r))
    for arm, cmp in view["comparisons"].items():
        tasks = {t["task"] for t in cmp["per_task"]}

        def n_flagged(side: str) -> int:
            return sum(1 for r in view_runs if r["arm"] == side and r["_task"] in tasks
                       and run_evaluated(r) and id(r) in flagged)
        cmp["flagged_runs"] = {"arm": n_flagged(arm), "baseline": n_flagged(cmp["baseline"])}


def _rpt_holm_view(view: dict, alpha: float = 0.05) -> dict:
    """Holm-adjust the primary p-values of a view over the pre-registered family, every arm
    against the baseline: once for the success rate and once for the score.  An arm of the
    family without a p (no task compared) counts in the family size as p = 1, so a missing
    comparison never makes the others easier to reject.  Writes `primary.p_holm` and
    `primary.reject`; returns the multiplicity record."""
    cmps = view["comparisons"]
    family = list(cmps)
    for outcome in ("success", "score"):
        def prim(c: dict) -> dict:
            return c["primary"] if outcome == "success" else c["score"]["primary"]
        ps = [prim(cmps[a]).get("p") for a in family]
        adj = holm_adjust([1.0 if p is None else p for p in ps])
        for a, p, q in zip(family, ps, adj):
            prim(cmps[a])["p_holm"] = q if p is not None else None
            prim(cmps[a])["reject"] = p is not None and q is not None and q <= alpha
    view["multiplicity"] = {"method": "holm", "alpha": alpha, "test": REPORT_PRIMARY_TEST,
                            "families": {"success": family, "score": family},
                            "secondary_unadjusted": ["sign_test", "clustered_mcnemar"]}
    return view["multiplicity"]


def report_exclusions(runs: list[dict], arms: list[str], base: str) -> dict:
    """Per arm: ended runs, excluded ones by validity label, and Fisher's exact test (two-sided) of
    excluded vs not against the baseline.  `biased` when that p is below REPORT_ALPHA or when
    every ended run of the arm (or of the baseline) is excluded: the exclusions then depend on the
    arm, so the view without them compares different populations."""
    per_arm: dict[str, dict] = {}
    for arm in arms:
        ended = [r for r in runs if r["arm"] == arm and _rpt_ended(r)]
        labels: dict[str, int] = {}
        for r in ended:
            if run_excluded(r):
                _rpt_inc(labels, r.get("validity"))
        n_out = sum(labels.values())
        per_arm[arm] = {"ended": len(ended), "excluded": n_out, "by_label": labels,
                        "all_excluded": len(ended) > 0 and n_out == len(ended)}
    b = per_arm[base]
    for arm, st in per_arm.items():
        if arm == base:
            st["fisher_p"], st["biased"] = None, st["all_excluded"]
            continue
        p = None
        if st["ended"] and b["ended"]:
            p = fisher_exact_two_sided(st["excluded"], st["ended"] - st["excluded"],
                                       b["excluded"], b["ended"] - b["excluded"])
        st["fisher_p"] = p
        st["biased"] = bool(st["excluded"] or b["excluded"]) and (
            (p is not None and p < REPORT_ALPHA) or st["all_excluded"] or b["all_excluded"])
    flagged = [a for a, st in per_arm.items() if st["biased"]]
    return {"per_arm": per_arm, "alpha": REPORT_ALPHA, "biased_arms": flagged}


def _rpt_exclusion_warning(excl: dict, base: str, primary: str) -> str | None:
    """The prominent note when exclusions differ between arms beyond chance (None otherwise)."""
    if not excl["biased_arms"]:
        return None
    parts = []
    for arm in excl["biased_arms"]:
        st = excl["per_arm"][arm]
        if st["all_excluded"]:
            why = "all of its ended runs are excluded"
        elif arm != base and excl["per_arm"][base]["all_excluded"]:
            why = f"all of the baseline {base}'s ended runs are excluded"
        else:
            why = f"Fisher's exact test of excluded vs kept against {base}: p = {fmt_p(st['fisher_p'])}"
        parts.append(f"{arm} ({st['excluded']} of {st['ended']} excluded; {why})")
    read = ("the all-included view (views.all_included) is the one to read"
            if primary == "exclusions_applied" else "the primary view already includes every run")
    return (f"DIFFERENTIAL EXCLUSIONS: exclusions depend on the arm for {'; '.join(parts)}. The "
            f"view with exclusions applied may be biased; {read}.")


def _rpt_behaviour_notes(behaviour: dict, view: dict, base: str) -> list[str]:
    """Notes that call out flagged successes and comparisons that contain flagged runs."""
    notes = []
    for arm, st in behaviour.items():
        if not st["flagged"]:
            continue
        groups = ", ".join(f"{n} {REPORT_AUDIT_GROUPS.get(g, g)}"
                           for g, n in sorted(st["runs_by_group"].items()))
        notes.append(f"arm {arm}: the behaviour audit flagged {st['flagged']} of {st['runs']} run(s) "
                     f"(runs by finding: {groups})")
        wins = [f["run_id"] for f in st["flagged_runs"] if f["success"]]
        if wins:
            notes.append(f"arm {arm}: {len(wins)} success(es) come from flagged runs "
                         f"({', '.join(str(w) for w in wins)}); read them before crediting the arm")
    for arm, cmp in view["comparisons"].items():
        fl = cmp.get("flagged_runs") or {}
        if fl.get("arm") or fl.get("baseline"):
            notes.append(f"{arm} vs {base}: the comparison contains {fl.get('arm', 0)} flagged run(s) "
                         f"of {arm} and {fl.get('baseline', 0)} of {base}")
    return notes


def _runs_without(runs: list[dict], drop: list[dict]) -> list[dict]:
    gone = {id(r) for r in drop}
    return [r for r in runs if id(r) not in gone]


def snapshot_curve(runs: list[dict], arms: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Hidden-test score against elapsed time per arm, from graded snapshots (SPEC 7).

    For every arm and snapshot time t: how many runs had a snapshot at t, their mean score and
    how many passed -- which arm gets there first, not only who gets there.  Times are strings
    (JSON keys), in seconds since the run started.
    """
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for arm in arms:
        by_t: dict[int, list[dict]] = {}
        for r in runs:
            if r.get("arm") != arm:
                continue
            for s in (r.get("evaluation") or {}).get("snapshots") or []:
                by_t.setdefault(int(s["t"]), []).append(s)
        if by_t:
            out[arm] = {str(t): {"runs": len(v), "mean_score": mean(float(s.get("score") or 0) for s in v),
                                 "successes": sum(1 for s in v if s.get("success"))}
                        for t, v in sorted(by_t.items())}
    return out


# -- Report: the analysis plan --------------------------------------------------------------------
# What `assign` fixes before any run (written into the manifest) and what the report does with it:
# the analysis that follows the plan is the confirmatory one; one asked to differ is exploratory.

PLAN_SCHEMA = "agentbench-analysis-plan/1"


def analysis_plan(arms: Sequence[str], baseline: str, seed: int, alpha: float = REPORT_ALPHA,
                  draws: int = REPORT_BOOTSTRAP_DRAWS) -> dict[str, Any]:
    """The pre-registered analysis of a study with these arms: every arm against `baseline` on
    the success rate and on the score, by the primary test, Holm over that family at `alpha`,
    bootstrap intervals from `seed` with `draws` resamples."""
    return {"schema": PLAN_SCHEMA, "baseline": str(baseline), "primary_test": REPORT_PRIMARY_TEST,
            "outcomes": ["success", "score"],
            "family": [str(a) for a in arms if str(a) != str(baseline)],
            "multiplicity": "holm", "alpha": alpha,
            "bootstrap": {"seed": int(seed), "draws": int(draws), "level": 0.95},
            "secondary": ["sign_test", "clustered_mcnemar", "se_cluster"]}


def plan_problems(plan: Any) -> list[str]:
    """What makes a plan read from a manifest unusable, in words (empty: none).  A manifest is a
    file: every field is checked before it steers the analysis."""
    if not isinstance(plan, dict):
        return ["the analysis plan is not an object"]
    problems = []
    if plan.get("schema") != PLAN_SCHEMA:
        problems.append(f"unknown plan schema {plan.get('schema')!r}")
    if not isinstance(plan.get("baseline"), str) or not plan.get("baseline"):
        problems.append("the plan names no baseline")
    fam = plan.get("family")
    if not isinstance(fam, list) or not all(isinstance(a, str) for a in fam):
        problems.append("the plan's family is not a list of arm names")
    alpha = plan.get("alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < alpha < 0.5:
        problems.append("the plan's alpha is not a number in (0, 0.5)")
    boot = plan.get("bootstrap")
    seed = boot.get("seed") if isinstance(boot, dict) else None
    draws = boot.get("draws") if isinstance(boot, dict) else None
    if isinstance(seed, bool) or not isinstance(seed, int):
        problems.append("the plan's bootstrap seed is not an integer")
    if isinstance(draws, bool) or not isinstance(draws, int) or not 100 <= draws <= 1_000_000:
        problems.append("the plan's bootstrap draws are not an integer in [100, 1000000]")
    return problems


def report_analysis(plan: Any, source: str | None, arms: list[str], baseline: str | None,
                    seed: int) -> dict[str, Any]:
    """The analysis a report runs and how it stands to the study's plan.

    `plan` is the one `assign` wrote (None: there is none; `source` says where it was read);
    `baseline` and `seed` are what this report was asked for (None: the plan's baseline).
    Returns the plan in force, `pre_registered` (a valid plan was found), `exploratory` (this
    analysis differs from it) with the `deviations` in words, and the baseline, seed, alpha
    and bootstrap draws to use."""
    problems = plan_problems(plan) if plan is not None else []
    valid = plan is not None and not problems
    if valid:
        base = baseline if baseline is not None else plan["baseline"]
        deviations = []
        if base != plan["baseline"]:
            deviations.append(f"baseline {base} instead of the plan's {plan['baseline']}")
        if plan["baseline"] not in arms:
            base = baseline if baseline is not None else arms[0]
            deviations.append(f"the plan's baseline {plan['baseline']} is not an arm of the study")
        family = [a for a in arms if a != base]
        if plan["primary_test"] != REPORT_PRIMARY_TEST:
            deviations.append(f"primary test {REPORT_PRIMARY_TEST} instead of the plan's "
                              f"{plan['primary_test']}")
        if base == plan["baseline"] and sorted(family) != sorted(plan["family"]):
            deviations.append(f"the family is {', '.join(family) or 'empty'} against {base}; the "
                              f"plan's was {', '.join(plan['family']) or 'empty'}")
        if seed != plan["bootstrap"]["seed"]:
            deviations.append(f"bootstrap seed {seed} instead of the plan's {plan['bootstrap']['seed']}")
        return {"plan": plan, "source": source, "pre_registered": True,
                "exploratory": bool(deviations), "deviations": deviations, "baseline": base,
                "seed": seed, "alpha": float(plan["alpha"]), "draws": plan["bootstrap"]["draws"],
                "plan_problems": []}
    base = baseline if baseline is not None else (arms[0] if arms else None)
    deviations = [f"the manifest's plan is unusable ({'; '.join(problems)})"] if problems else []
    return {"plan": analysis_plan(arms, base, seed) if base is not None else None, "source": None,
            "pre_registered": False, "exploratory": bool(problems), "deviations": deviations,
            "baseline": base, "seed": seed, "alpha": REPORT_ALPHA, "draws": REPORT_BOOTSTRAP_DRAWS,
            "plan_problems": problems}


def _rpt_analysis_note(analysis: dict) -> str:
    """The note that says which analysis this is: the pre-registered one, or exploratory, or one
    without a plan."""
    if analysis["exploratory"]:
        return ("EXPLORATORY: this analysis differs from the study's pre-registered plan ("
                + "; ".join(analysis["deviations"]) + "); its p-values do not carry the plan's "
                "error control: treat any finding as a lead to test in a new study")
    if analysis["pre_registered"]:
        return (f"pre-registered: the analysis follows the plan `assign` wrote into the manifest "
                f"({analysis['source']}): every arm against {analysis['baseline']}, primary test "
                f"{REPORT_PRIMARY_TEST}, Holm at alpha {analysis['alpha']}")
    return ("not pre-registered: the manifest holds no analysis plan (a study assigned before "
            "plans were written, or runs made without `assign`); the report follows the default "
            "plan, fixed in advance by agentbench, but nobody fixed it for this study")


def _rpt_arms(runs: list[dict], arms: list[str], baseline: str | None) -> tuple[list[str], str]:
    """The arms to report on (the study's, else those seen in the runs in first-seen order) and
    the baseline (default the first); AgentbenchError when there are none or the baseline is not
    one of them."""
    arms = [str(a) for a in arms] if arms else []
    if not arms:
        for r in runs:
            if r.get("arm") is not None and str(r["arm"]) not in arms:
                arms.append(str(r["arm"]))
    if not arms:
        raise AgentbenchError("no arms to report on", code="no_arms_report", hint="define arms in study.json")
    base = arms[0] if baseline is None else str(baseline)
    if base not in arms:
        raise AgentbenchError(f"baseline arm {base!r} is not one of the study's arms",
                              code="baseline_arm_not_one_studys", arms=arms, baseline=base)
    return arms, base


def _rpt_views(known: list[dict], kept: list[dict], excluded: list[dict], arms: list[str], base: str,
               tasks: list[str], seed: int, alpha: float = REPORT_ALPHA,
               draws: int = REPORT_BOOTSTRAP_DRAWS) -> dict[str, dict]:
    """The two views (exclusions applied, all included), each with its flagged-run counts and its
    Holm-adjusted p-values."""
    views = {"exclusions_applied": _rpt_view(kept, excluded, arms, base, tasks, seed, draws)}
    # With nothing excluded the two views have the same input: computed once, copied.  Otherwise
    # only what an exclusion touches is computed again (the arms with excluded runs and the
    # comparisons with such an arm on either side).
    views["all_included"] = (copy.deepcopy(views["exclusions_applied"]) if not excluded
                             else _rpt_view(known, [], arms, base, tasks, seed, draws,
                                            same_as=views["exclusions_applied"],
                                            changed=frozenset(r["arm"] for r in excluded)))
    for name, view_runs in (("exclusions_applied", kept), ("all_included", known)):
        _rpt_flag_view(views[name], view_runs)
        _rpt_holm_view(views[name], alpha)
    return views


def _rpt_population_notes(known: list[dict], excluded: list[dict], unknown: list[dict],
                          include_excluded: bool, rehearsed: list[dict], est: list[dict]) -> list[str]:
    """Notes on which runs the report stands on: exclusions, missing labels, an incomplete study,
    unknown arms, rehearsals, unsandboxed runs and estimated costs."""
    notes = []
    if excluded:
        by_label: dict[str, int] = {}
        for r in excluded:
            _rpt_inc(by_label, r.get("validity"))
        labels = ", ".join(f"{v} {k}" for k, v in by_label.items())
        if include_excluded:
            notes.append(f"{len(excluded)} run(s) carry an exclusion label ({labels}) but are "
                         f"included as requested; views.exclusions_applied leaves them out")
        else:
            notes.append(f"{len(excluded)} run(s) excluded by validity label ({labels}); the "
                         f"tables leave them out and views.all_included has results with them")
    unlabelled = [r for r in known if r.get("validity") is None and not _rpt_pending(r)]
    if unlabelled:
        notes.append(f"{len(unlabelled)} ended run(s) have no validity label; treated as valid")
    n_ns = sum(1 for r in known if r.get("status") == "not_started")
    n_run = sum(1 for r in known if r.get("status") == "running")
    if n_ns or n_run:
        notes.append(f"the study is not complete: {n_ns} run(s) not started, {n_run} running; "
                     f"they are counted but have no results yet"
                     + ("; costs include what running runs spent so far" if n_run else ""))
    if unknown:
        notes.append(f"{len(unknown)} run(s) belong to arms not in the study "
                     f"({', '.join(sorted({str(r.get('arm')) for r in unknown}))}) and are ignored")
    if rehearsed:
        notes.append(f"{len(rehearsed)} run(s) were rehearsed against the scripted model: their "
                     f"costs are list prices of the scripted usage, as the binary computed them; "
                     f"nothing was billed")
    unboxed = [r for r in known
               if r.get("status") == "finished" and not (r.get("sandbox") or {}).get("sandboxed")]
    if unboxed:
        why = sorted({w for r in unboxed for w in (r.get("sandbox") or {}).get("reasons") or []})
        notes.append(f"{len(unboxed)} run(s) were not sandboxed: their sessions and checks could "
                     f"read the study, the hidden tests and other runs"
                     + (f" ({'; '.join(why)})" if why else ""))
    opened = [r for r in known if r.get("status") == "finished" and (r.get("sandbox") or {}).get("sandboxed")
              and "open" in ((r.get("sandbox") or {}).get("networks") or [])]
    if opened:
        why = sorted({w for r in opened for w in (r.get("sandbox") or {}).get("network_opened") or []})
        notes.append(f"{len(opened)} sandboxed run(s) had the host's network in their sessions: they could "
                     f"reach every listening port of the host and other sessions that had it too"
                     + (f" ({'; '.join(why)})" if why else ""))
    bare = [r for r in known if r.get("status") == "finished" and (r.get("sandbox") or {}).get("sandboxed")
            and (r.get("sandbox") or {}).get("unfiltered")]
    if bare:
        why = sorted({w for r in bare for w in (r.get("sandbox") or {}).get("unfiltered") or []})
        notes.append(f"{len(bare)} sandboxed run(s) had sessions or checks without the seccomp filter: "
                     f"their processes could inspect others as the host allows ({'; '.join(why)})")
    if est:
        notes.append(f"costs include ${math.fsum(float(r.get('cost_usd') or 0) for r in est):.4f} "
                     f"estimated from list prices over {len(est)} run(s) (marked ~ in tables)")
    return notes


def _rpt_multiplicity_note(families: dict[str, list[str]], base: str) -> str | None:
    """The note that the primary p-values are Holm-adjusted, when the family holds more than one
    arm."""
    fam = families.get("success") or []
    if len(fam) > 1:
        return (f"multiple comparisons: the primary p-values are Holm-adjusted over the family of "
                f"every arm against {base} ({', '.join(fam)}), once for the success rate and once "
                f"for the score; read the adjusted column before calling a difference significant. "
                f"The sign test and the clustered McNemar test are secondary and not adjusted")
    return None


def _rpt_methods(seed: int, draws: int = REPORT_BOOTSTRAP_DRAWS,
                 alpha: float = REPORT_ALPHA) -> dict[str, Any]:
    """The report's `methods`: how each figure is computed, in words."""
    return {
        "success_rate": "successes / evaluated runs of the view; 95% Wilson score interval "
                        "(runs treated as independent; repeats of one task are correlated, so "
                        "the interval is narrower than a task-level one when tasks differ; "
                        "task_success_rate gives that one)",
        "task_success_rate": "per task: successes / evaluated runs; mean over the arm's tasks "
                             "with evaluated runs; 95% percentile bootstrap over tasks (the unit "
                             f"repeats cluster in), {draws} resamples, each arm on its own stream "
                             f"seeded from {seed} and its name (both views of the arm share it); "
                             "it sees only how tasks differ, so with "
                             "few tasks, or tasks that scored alike, it is too narrow: read it "
                             "beside the Wilson interval (Davison & Hinkley 1997, sec. 3.8)",
        "success_rate_conservative": "successes / ended runs, an unevaluated run counted as a "
                                     "failure",
        "primary_test": "for each arm against the baseline, per task the arm's success rate minus "
                        "the baseline's, each over the runs that arm has on the task (a missing "
                        "repeat costs only itself; repeats are never paired by index); the mean of "
                        "those differences tested by an exact paired permutation (sign-flip) test "
                        "over tasks: p is the share of the 2^n ways of flipping the signs of the n "
                        "task differences whose |sum| is at least the observed one, all of them "
                        f"counted exactly, or beyond {PERM_EXACT_WORK} enumeration steps {PERM_DRAWS} "
                        "seeded random flips with their Monte Carlo standard error; the same for "
                        "the mean hidden-test score (Fisher 1935; Good 2005, sec. 3.1)",
        "null_hypothesis": "within each task the two arms are exchangeable: each task's difference "
                           "is as likely to have either sign, whatever the tasks' difficulty or "
                           "how the effect varies between tasks",
        "paired_difference": "mean over tasks where both arms have data of the per-task "
                             "differences; 95% percentile bootstrap over tasks, "
                             f"{draws} resamples, on its own stream (seed {seed}, the figure and "
                             "the arms; both views of a figure share it); se_cluster: the "
                             "cluster-robust standard error of that mean over tasks, "
                             "sqrt(sum (d - mean)^2 / (K (K - 1))) (Cameron & Miller 2015)",
        "paired_score_and_cost": "as paired_difference, on the mean hidden-test score of evaluated "
                                 "runs and on the mean cost of ended runs; higher/lower/equal tasks "
                                 "with an exact two-sided sign test (secondary); the cost has no "
                                 "primary test",
        "sign_test": "secondary, not adjusted: exact two-sided binomial sign test over tasks, ties "
                     "dropped",
        "clustered_mcnemar": "secondary, not adjusted: McNemar's test for paired proportions with "
                             "runs clustered in tasks (Obuchowski, Statistics in Medicine 17:1495, "
                             "1998): pooled success rates of the two arms on the compared tasks, "
                             "their variance and covariance from the task totals, chi-square 1 df",
        "wall_time": "per run: from its start to its evaluation, without the time it waited for a "
                     "parallel slot or in a Slurm queue (recorded apart as queued_s); median over "
                     "runs",
        "excluded_labels": list(REPORT_EXCLUDED_VALIDITY),
        "behaviour_audit": "the pipeline's audit of each run's tool calls and of its public test "
                           "files; a run is flagged when it has a finding; findings are counted "
                           "by group ("
                           + "; ".join(f"{k}: {v}" for k, v in REPORT_AUDIT_GROUPS.items())
                           + "); a heuristic over the commands the agent ran, not a sandbox",
        "differential_exclusions": "per arm, ended runs excluded vs kept against the baseline's, "
                                   "two-sided Fisher exact test, not adjusted for multiplicity "
                                   f"(a screen: it errs toward warning); alpha {REPORT_ALPHA}",
        "multiplicity": "Holm step-down adjustment of the primary p-values over the pre-registered "
                        "family, every arm against the baseline, once for the success rate and "
                        f"once for the score (family-wise error rate {alpha}; an arm without a "
                        "compared task counts as p = 1); secondary tests and the cost are not "
                        "adjusted",
        "analysis_plan": "`assign` writes the plan (baseline, primary test, family, alpha, "
                         "bootstrap seed and draws) into the manifest before any run; the report "
                         "follows it, and an analysis asked to differ from it (another baseline or "
                         "seed) is labelled exploratory",
    }


def arm_changes(arm_specs: Mapping[str, Any], baseline: str) -> dict[str, str]:
    """What each arm changes against the baseline, in words, from the arms' settings in
    study.json (pure): its preamble file, gate cycles, a reviewer, forking a base."""
    base = arm_specs.get(baseline) if isinstance(arm_specs.get(baseline), Mapping) else {}

    def said(spec: Mapping[str, Any]) -> dict[str, str]:
        out = {"preamble": f"preamble {spec['preamble']}" if spec.get("preamble") else "no preamble",
               "gate_cycles": (f"{spec['gate_cycles']} gate feedback cycles" if spec.get("gate_cycles")
                               else "no gate cycles"),
               "review": "a reviewer" if spec.get("review") is True else "no reviewer",
               "fork_base": "forks a per-task base" if spec.get("fork_base") is True else "fresh sessions"}
        return out

    mine = said(base)
    changes = {}
    for name, spec in arm_specs.items():
        if name == baseline:
            changes[name] = "the baseline: " + ", ".join(mine.values())
            continue
        other = said(spec if isinstance(spec, Mapping) else {})
        diff = [other[k] for k in other if other[k] != mine[k]]
        changes[name] = ", ".join(diff) if diff else "the same settings as the baseline"
    return changes


#: The keys of a run record that the report reads (and `list`, and the cost plan of `assign`): the
#: runs summary that `report` reads instead of every record holds only these (see "Reading at
#: scale").  A report that starts reading another key of a run must add it here;
#: tests/test_runs_summary.py checks the report sections' reads against this list and compares
#: the report built from the summary with the one built from the records.
REPORT_RUN_KEYS = frozenset({
    "run_id", "task", "arm", "repeat", "block", "split", "status", "outcome", "validity",
    "validity_reason", "failure_reason", "error", "evaluation", "cost_usd", "cost_estimated",
    "tokens", "wall_s", "gate_cycles", "review_verdicts", "provenance", "sandbox", "audit"})
#: What the report never reads of a run's evaluation: the per-check details.
REPORT_UNREAD_EVALUATION_KEYS = frozenset({"checks"})


def report_view_of_run(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a run record the report reads (REPORT_RUN_KEYS, the evaluation without its
    per-check details): pure."""
    out = {k: v for k, v in rec.items() if k in REPORT_RUN_KEYS}
    ev = out.get("evaluation")
    if isinstance(ev, dict):
        out["evaluation"] = {k: v for k, v in ev.items() if k not in REPORT_UNREAD_EVALUATION_KEYS}
    return out


def build_report(runs: list[dict], arms: list[str], baseline: str | None = None, seed: int = 0,
                 include_excluded: bool = False, plan: Any = None, plan_source: str | None = None) -> dict:
    """The study report as a JSON-ready dict (SPEC 10).

    `runs` are the experiment layer's run records; `arms` the study's arms in order (empty:
    the arms seen in the runs, in first-seen order). `baseline` defaults to the first arm and
    must be one of `arms` (else AgentbenchError, exit 2). Two views are computed:
    `exclusions_applied` (runs labelled infrastructure_failure or degenerate left out) and
    `all_included`; the primary view (exclusions applied unless `include_excluded`) is also
    copied to the top-level `per_arm`, `comparisons`, `per_task`. Success rates count evaluated
    runs of the view; every other run is counted under an explicit key (not_started, running,
    not_evaluated by cause, errors, interrupted, budget_exhausted, timeouts) and `notes` say in
    words what was left out and why. Comparisons are paired over tasks (see _rpt_compare);
    bootstrap intervals use streams seeded from `seed`, so the report is reproducible.
    `plan` is the analysis plan `assign` wrote (read from `plan_source`); `analysis` says whether
    this report follows it or is exploratory (see report_analysis).
    """
    arms, _ = _rpt_arms(runs, arms, None)
    analysis = report_analysis(plan, plan_source, arms, baseline, seed)
    arms, base = _rpt_arms(runs, arms, analysis["baseline"])
    known, unknown = [], []
    for r in runs:
        (known if str(r.get("arm")) in arms else unknown).append(r)
    # Work on shallow copies carrying a normalised task key; the caller's records stay untouched.
    known = [{**r, "arm": str(r.get("arm")),
              "_task": "(none)" if r.get("task") is None else str(r.get("task"))} for r in known]
    tasks = sorted({r["_task"] for r in known})
    excluded = [r for r in known if run_excluded(r)]
    kept = [r for r in known if not run_excluded(r)]
    views = _rpt_views(known, kept, excluded, arms, base, tasks, seed, analysis["alpha"],
                       analysis["draws"])
    primary = "all_included" if include_excluded else "exclusions_applied"
    other = "exclusions_applied" if include_excluded else "all_included"
    behaviour = report_behaviour(known, arms)
    exclusions = report_exclusions(known, arms, base)
    warning = _rpt_exclusion_warning(exclusions, base, primary)
    warnings = [warning] if warning else []
    rehearsed = [r for r in known if (r.get("provenance") or {}).get("rehearsal")]
    est = [r for r in known if r.get("cost_estimated")]
    notes = list(warnings) + [_rpt_analysis_note(analysis)]
    notes.extend(_rpt_population_notes(known, excluded, unknown, include_excluded, rehearsed, est))
    notes.extend(_rpt_view_notes(views[primary], base, "", analysis["alpha"]))
    notes.extend(_rpt_behaviour_notes(behaviour, views[primary], base))
    multiplicity = _rpt_multiplicity_note(views[primary]["multiplicity"]["families"], base)
    if multiplicity:
        notes.append(multiplicity)
    excluded_list = [{"run_id": r.get("run_id"), "task": r.get("task"), "arm": r["arm"],
                      "repeat": r.get("repeat"), "validity": r.get("validity"),
                      "reason": r.get("validity_reason")} for r in excluded]
    return {
        "schema": REPORT_SCHEMA,
        "arms": arms,
        "baseline": base,
        "seed": seed,
        "analysis": analysis,
        "exploratory": analysis["exploratory"],
        "primary_view": primary,
        "tasks": tasks,
        "per_arm": views[primary]["per_arm"],
        "comparisons": views[primary]["comparisons"],
        "per_task": views[primary]["per_task"],
        "views": views,
        "other_view": other,
        "excluded_runs": excluded_list,
        "warnings": warnings,
        "behaviour": behaviour,
        "exclusions": exclusions,
        "multiplicity": views[primary]["multiplicity"],
        "totals": {
            "runs": len(known),
            "tasks": len(tasks),
            "excluded": len(excluded),
            "ignored_unknown_arm": len(unknown),
            "cost_usd": math.fsum(float(r.get("cost_usd") or 0.0) for r in known),
            "cost_estimated_usd": math.fsum(float(r.get("cost_usd") or 0.0) for r in est),
            "rehearsed_runs": len(rehearsed),
        },
        "notes": notes,
        "methods": _rpt_methods(seed, analysis["draws"], analysis["alpha"]),
        "snapshots": snapshot_curve(_runs_without(known, excluded), arms),
    }


# ==================================================================================================
# Rendering: Markdown and HTML
# ==================================================================================================
# Text from the report's data: the number formats, the tables (as data, shared by both formats),
# Markdown, and one self-contained HTML page with inline SVG charts.  Pure: dicts in, strings out.
# It must not read the study, runs or files, nor compute a figure the report does not hold.

# -- Number formats shared by Markdown, HTML and the run pages (fmt_pct, fmt_p: the report's) ------

def _fmt_ci(ci: Any) -> str:
    if not ci:
        return "-"
    return f"[{100.0 * ci[0]:.1f}%, {100.0 * ci[1]:.1f}%]"


def _fmt_diff(x: float | None) -> str:
    return "-" if x is None else f"{100.0 * x:+.1f} pts"


def _fmt_diff_ci(ci: Any) -> str:
    if not ci:
        return "-"
    return f"[{100.0 * ci[0]:+.1f}, {100.0 * ci[1]:+.1f}] pts"


def fmt_usd(x: float | None, estimated: bool = False) -> str:
    """Dollars; four decimals below $1 (per-run costs are often cents); ~ marks an estimate."""
    if x is None:
        return "-"
    text = f"${x:,.4f}" if abs(x) < 1 else f"${x:,.2f}"
    return ("~" + text) if estimated else text


def _fmt_num_ci(ci: Any, digits: int = 2) -> str:
    if not ci:
        return "-"
    return f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]"


def _fmt_usd_diff(x: float | None) -> str:
    """A signed dollar difference, four decimals below $1 like fmt_usd."""
    if x is None:
        return "-"
    sign = "+" if x >= 0 or round(abs(x), 4) == 0 else "-"   # no "-$0.0000" from rounding noise
    return sign + (f"${abs(x):,.4f}" if abs(x) < 1 else f"${abs(x):,.2f}")


def _fmt_usd_ci(ci: Any) -> str:
    if not ci:
        return "-"
    return f"[{_fmt_usd_diff(ci[0])}, {_fmt_usd_diff(ci[1])}]"


def fmt_int(x: Any) -> str:
    return "-" if x is None else f"{int(x):,}"


def fmt_num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60.0:.1f} min"


def _fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) if d else "-"


# -- Rendering: tables as data, then Markdown / HTML -----------------------------------------------

def _rpt_flag_cell(s: dict) -> str:
    n = s.get("flagged")
    if n is None:
        return "-"
    wins = s.get("flagged_successes") or 0
    return f"{n}" + (f" ({wins} success{'' if wins == 1 else 'es'})" if wins else "")


def _rpt_audit_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """Behaviour audit per arm, the flagged runs, and exclusions per arm (with Fisher's test)."""
    arms, base = report["arms"], report["baseline"]
    beh = report.get("behaviour") or {}
    excl = (report.get("exclusions") or {}).get("per_arm") or {}
    groups = sorted({g for st in beh.values() for g in st["runs_by_group"]})
    rows = [[a, fmt_int(beh[a]["runs"]), fmt_int(beh[a]["audited"]), fmt_int(beh[a]["flagged"]),
             fmt_int(beh[a]["flagged_successes"])]
            + [fmt_int(beh[a]["runs_by_group"].get(g, 0)) for g in groups] for a in arms if a in beh]
    out = [("Behaviour audit per arm (every run, excluded ones too; runs with a finding of each kind)",
            ["Arm", "Runs", "Audited", "Flagged", "Flagged successes"]
            + [REPORT_AUDIT_GROUPS.get(g, g) for g in groups], rows)]
    rows = [[str(f["run_id"]), str(f["task"]), a, str(f["repeat"]), str(f["outcome"] or "-"),
             "yes" if f["excluded"] else "no",
             ", ".join(f"{REPORT_AUDIT_GROUPS.get(g, g)} x{n}" for g, n in f["groups"].items()) or "flagged"]
            for a in arms if a in beh for f in beh[a]["flagged_runs"]]
    out.append(("Runs flagged by the behaviour audit",
                ["Run", "Task", "Arm", "Repeat", "Outcome", "Excluded", "Findings"], rows))
    rows = [[a + (" (baseline)" if a == base else ""), fmt_int(excl[a]["ended"]),
             fmt_int(excl[a]["excluded"]),
             _fmt_counts(excl[a]["by_label"]), fmt_p(excl[a]["fisher_p"]),
             "yes" if excl[a]["biased"] else "no"] for a in arms if a in excl]
    out.append((f"Exclusions per arm (Fisher exact test of excluded vs kept against {base})",
                ["Arm", "Ended runs", "Excluded", "By label", "Fisher p", "Depends on the arm"], rows))
    return out


#: One table of the report as data: (title, headers, rows of cell strings).
ReportTable = tuple[str, list[str], list[list[str]]]


def _rpt_arm_table(report: dict) -> ReportTable:
    """Results per arm: rates with both intervals, score, costs, tokens, wall time, cycles, flags."""
    arms, base, pa = report["arms"], report["baseline"], report["per_arm"]
    rows = []
    for a in arms:
        s = pa[a]
        est = s["cost_estimated_usd"] > 0
        changes = [str((report.get("arm_changes") or {}).get(a, "-"))] if "arm_changes" in report else []
        rows.append([a + (" (baseline)" if a == base else ""), *changes, fmt_int(s["runs"]),
                     fmt_int(s["evaluated"]), fmt_int(s["successes"]),
                     fmt_pct(s["success_rate"]), _fmt_ci(s["success_ci"]),
                     fmt_pct(s["task_success_rate"]), _fmt_ci(s["task_success_ci"]),
                     fmt_num(s["mean_score"], 3),
                     fmt_usd(s["cost_per_run_usd"], est), fmt_usd(s["cost_per_success_usd"], est),
                     fmt_usd(s["cost_usd"], est), fmt_int(s["tokens"].get("total", 0)),
                     fmt_secs(s["median_wall_s"]), fmt_num(s["gate_cycles"]["mean"], 2),
                     _rpt_flag_cell(s)])
    sim = " (simulated)" if report["totals"].get("rehearsed_runs") else ""
    return ("Results per arm",
            ["Arm", *(["Changes against the baseline"] if "arm_changes" in report else []),
             "Runs", "Evaluated", "Successes", "Success rate", "95% CI (Wilson)",
             "Mean rate over tasks", "95% CI over tasks", "Mean score", f"Cost/run{sim}",
             f"Cost/success{sim}", f"Total cost{sim}", "Tokens", "Median wall", "Gate cycles (mean)",
             "Flagged by audit"], rows)


def _rpt_fate_table(report: dict) -> ReportTable:
    """What happened to every run of each arm, and the rate with unevaluated runs as failures."""
    pa = report["per_arm"]
    rows = []
    for a in report["arms"]:
        s = pa[a]
        rows.append([a, fmt_int(s["not_started"]), fmt_int(s["running"]),
                     fmt_int(s["excluded"]), fmt_int(s["not_evaluated"]),
                     fmt_int(s["errors"]), fmt_int(s["interrupted"]),
                     fmt_int(s["budget_exhausted"]), fmt_int(s["timeouts"]),
                     fmt_pct(s["success_rate_conservative"])])
    return ("What happened to every run",
            ["Arm", "Not started", "Running", "Excluded", "Not evaluated", "Errors",
             "Interrupted", "Budget stops", "Timeouts",
             "Rate, unevaluated as failure"], rows)


def _rpt_review_table(report: dict) -> ReportTable:
    """Review verdicts, the distribution of gate cycles and failure reasons per arm."""
    pa = report["per_arm"]
    rows = [[a, _fmt_counts(pa[a]["review_verdicts"]["final"]),
             _fmt_counts(pa[a]["review_verdicts"]["all"]),
             ", ".join(f"{k} cycle{'' if str(k) == '1' else 's'}: {v} run{'' if v == 1 else 's'}"
                       for k, v in pa[a]["gate_cycles"]["distribution"].items()) or "-",
             _fmt_counts(pa[a]["failure_reasons"])] for a in report["arms"]]
    return ("Reviews, gate cycles and failure reasons",
            ["Arm", "Final review verdicts", "All review verdicts",
             "Gate cycles", "Failure reasons"], rows)


def _fmt_primary(prim: dict | None) -> str:
    """A primary p-value, marked ~ with its standard error when it is a Monte Carlo estimate."""
    if not prim or prim.get("p") is None:
        return "-"
    if prim.get("method") == "monte_carlo":
        return f"~{fmt_p(prim['p'])} (MC se {prim['mc_se']:.1g})"
    return fmt_p(prim["p"])


def _fmt_se(se: float | None, digits: int = 3) -> str:
    return "-" if se is None else f"{se:.{digits}f}"


def _rpt_analysis_line(report: dict) -> str:
    """One sentence on the analysis: pre-registered, exploratory, or without a plan."""
    an = report.get("analysis") or {}
    if an.get("exploratory"):
        return ("EXPLORATORY analysis: it differs from the study's pre-registered plan ("
                + "; ".join(an.get("deviations") or []) + "). Its p-values do not carry the plan's "
                "error control.")
    if an.get("pre_registered"):
        return (f"Pre-registered analysis: the plan written by assign ({an.get('source')}), every arm "
                f"against {report['baseline']}, primary test {REPORT_PRIMARY_TEST}, Holm at alpha "
                f"{an.get('alpha')}.")
    return ("Not pre-registered: the manifest holds no analysis plan; the default plan was "
            "followed.")


def _rpt_comparison_table(report: dict) -> ReportTable:
    """The paired success comparisons against the baseline: the primary test with its Holm
    adjustment over the family, then the secondary figures (unadjusted)."""
    base = report["baseline"]
    rows = []
    for a, c in report["comparisons"].items():
        mc = c.get("clustered_mcnemar") or {}
        prim = c.get("primary") or {}
        fl = c.get("flagged_runs") or {}
        rows.append([f"{a} vs {base}", fmt_int(c["tasks_compared"]), _fmt_diff(c["mean_diff"]),
                     _fmt_diff_ci(c["ci"]), _fmt_se(c.get("se_cluster")), _fmt_primary(prim),
                     fmt_p(prim.get("p_holm")), f"{c['wins']}/{c['losses']}/{c['ties']}",
                     fmt_p(c["sign_test_p"]), fmt_p(mc.get("p")),
                     f"{fl.get('arm', 0)}/{fl.get('baseline', 0)}"])
    fam = (report.get("multiplicity") or {}).get("families") or {}
    return (f"Paired comparison against {base} (over tasks)",
            ["Comparison", "Tasks", "Mean diff", "95% CI (bootstrap)", "SE (clustered)",
             "Primary p (sign-flip)",
             f"Primary p, Holm over {len(fam.get('success') or [])} arm(s)", "W/L/T",
             "Sign test p (secondary)", "Clustered McNemar p (secondary)",
             "Flagged runs (arm/base)"], rows)


def _rpt_score_cost_table(report: dict) -> ReportTable:
    """The paired score (with its primary test) and cost-per-run comparisons against the baseline."""
    base = report["baseline"]
    rows = []
    for a, c in report["comparisons"].items():
        sc, co = c["score"], c["cost_per_run_usd"]
        prim = sc.get("primary") or {}
        rows.append([f"{a} vs {base}", fmt_int(sc["tasks_compared"]),
                     ("-" if sc["mean_diff"] is None else f"{sc['mean_diff']:+.3f}"),
                     _fmt_num_ci(sc["ci"], 3), _fmt_primary(prim), fmt_p(prim.get("p_holm")),
                     f"{sc['higher']}/{sc['lower']}/{sc['equal']}",
                     fmt_p(sc["sign_test_p"]), fmt_int(co["tasks_compared"]),
                     _fmt_usd_diff(co["mean_diff"]), _fmt_usd_ci(co["ci"]),
                     f"{co['higher']}/{co['lower']}/{co['equal']}", fmt_p(co["sign_test_p"])])
    return (f"Paired score and cost against {base} (over tasks)",
            ["Comparison", "Tasks (score)", "Score diff", "95% CI", "Primary p (sign-flip)",
             "Primary p, Holm", "H/L/E", "Sign test p (secondary)",
             "Tasks (cost)", "Cost/run diff", "95% CI", "H/L/E", "Sign test p (secondary)"], rows)


def _rpt_task_table(report: dict) -> ReportTable:
    """Per task and arm: successes of the evaluated runs."""
    arms = report["arms"]
    rows = []
    for task, cells in report["per_task"].items():
        row = [task]
        for a in arms:
            cl = cells[a]
            row.append("-" if not cl["runs"] else
                       f"{cl['successes']}/{cl['evaluated']} ({fmt_pct(cl['success_rate'])})"
                       if cl["evaluated"] else f"0 evaluated of {cl['runs']}")
        rows.append(row)
    return ("Per task (successes/evaluated)", ["Task"] + arms, rows)


def _rpt_other_view_table(report: dict) -> ReportTable:
    """The other view's rates and differences (with or without the validity exclusions)."""
    base = report["baseline"]
    other = report["views"][report["other_view"]]
    rows = []
    for a in report["arms"]:
        s = other["per_arm"][a]
        c = other["comparisons"].get(a)
        rows.append([a, fmt_int(s["evaluated"]), fmt_int(s["successes"]),
                     fmt_pct(s["success_rate"]), _fmt_ci(s["success_ci"]),
                     _fmt_diff(c["mean_diff"]) if c else "(baseline)",
                     _fmt_diff_ci(c["ci"]) if c else "-"])
    title = ("With every run included (no validity exclusions)"
             if report["other_view"] == "all_included" else "With validity exclusions applied")
    return (title, ["Arm", "Evaluated", "Successes", "Success rate", "95% CI (Wilson)",
                    f"Mean diff vs {base}", "95% CI (bootstrap)"], rows)


def _rpt_excluded_table(report: dict) -> ReportTable:
    """The runs excluded by a validity label, with the reason."""
    rows = [[str(e["run_id"]), str(e["task"]), str(e["arm"]), str(e["validity"]),
             str(e["reason"] or "-")] for e in report["excluded_runs"]]
    return ("Runs excluded by validity label", ["Run", "Task", "Arm", "Label", "Reason"], rows)


def _rpt_snapshot_tables(report: dict) -> list[ReportTable]:
    """Score against elapsed time per arm, when any run has graded snapshots (else no table)."""
    arms = report["arms"]
    snaps = report.get("snapshots") or {}
    times = sorted({int(t) for curve in snaps.values() for t in curve})
    if not times:
        return []
    rows = [[a] + [(f"{fmt_num(snaps[a][str(t)]['mean_score'], 3)} ({snaps[a][str(t)]['successes']}/"
                    f"{snaps[a][str(t)]['runs']})") if str(t) in snaps.get(a, {}) else "-"
                   for t in times]
            for a in arms]
    return [("Score against elapsed time (graded snapshots: mean score, passed/runs)",
             ["Arm"] + [fmt_secs(float(t)) for t in times], rows)]


def _rpt_tables(report: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """The report's tables as (title, headers, rows of cell strings), shared by md and html."""
    tables = [_rpt_arm_table(report), _rpt_fate_table(report), _rpt_review_table(report),
              _rpt_comparison_table(report), _rpt_score_cost_table(report),
              _rpt_task_table(report), _rpt_other_view_table(report), _rpt_excluded_table(report)]
    tables += _rpt_audit_tables(report)
    tables += _rpt_snapshot_tables(report)
    return tables


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_report_md(report: dict) -> str:
    """The report as Markdown: one table per section, then notes and methods."""
    tot = report["totals"]
    parts = [f"# {report.get('title') or 'Study report'}", "",
             f"Baseline: **{report['baseline']}**. Primary view: "
             f"**{report['primary_view'].replace('_', ' ')}**. Runs: {tot['runs']}, "
             f"tasks: {tot['tasks']}, total cost "
             f"{fmt_usd(tot['cost_usd'], tot['cost_estimated_usd'] > 0)}"
             + (" (simulated: a rehearsal, nothing billed)." if tot.get("rehearsed_runs") else ".")]
    parts += ["", (f"> **{_md_cell(_rpt_analysis_line(report))}**"
                   if report.get("exploratory") else _md_cell(_rpt_analysis_line(report)))]
    for w in report.get("warnings") or []:
        parts += ["", f"> **Warning:** {_md_cell(w)}"]
    for title, headers, rows in _rpt_tables(report):
        parts += ["", f"## {title}", ""]
        parts.append(_md_table(headers, rows) if rows else "(none)")
    parts += ["", "## Notes", ""]
    parts += [f"- {n}" for n in report["notes"]] or ["(none)"]
    if tot["cost_estimated_usd"] > 0:
        parts.append("- ~ marks a cost that includes an estimate from list prices")
    parts += ["", "## Methods", ""]
    parts += [f"- {k}: {v if isinstance(v, str) else ', '.join(v)}"
              for k, v in report["methods"].items()]
    return "\n".join(parts) + "\n"


def render_usage_md(agg: dict) -> str:
    """The usage aggregate as one Markdown table (groups, then a totals row) and notes."""
    headers = [agg["by"].capitalize(), "Jobs", "Input", "Output", "Cache write", "Cache read",
               "Cache-hit ratio", "Cost", "of which estimated", "Cache verdicts", "Statuses"]

    def row(name: str, g: dict) -> list[str]:
        tok = g["tokens"]
        est = g["cost_estimated_usd"] > 0
        return [name, fmt_int(g["jobs"]), fmt_int(tok.get("input", 0)),
                fmt_int(tok.get("output", 0)), fmt_int(tok.get("cache_creation", 0)),
                fmt_int(tok.get("cache_read", 0)), fmt_pct(g["cache_hit_ratio"]),
                fmt_usd(g["cost_usd"], est), fmt_usd(g["cost_estimated_usd"]) if est else "-",
                _fmt_counts(g["cache_verdicts"]), _fmt_counts(g["statuses"])]

    rows = [row(k, g) for k, g in agg["groups"].items()]
    rows.append(row("**total**", agg["totals"]))
    out = [f"## Usage by {agg['by']}", "", _md_table(headers, rows), "",
           "Cache-hit ratio = cache read / (input + cache write + cache read)."]
    if agg["notes"]:
        out += [""] + [f"- {n}" for n in agg["notes"]]
    return "\n".join(out) + "\n"


# -- HTML page with inline SVG charts --------------------------------------------------------------

# Colour-blind-safe palette (Okabe & Ito); every mark also carries a text label for print.
_HTML_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#8C6D1F",
                 "#444444")

HTML_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
  color: #1a1a1a; background: #fff; max-width: 1100px; margin: 2em auto; padding: 0 1em;
  line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; white-space: normal; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.charts { display: flex; flex-wrap: wrap; gap: 1.5em; }
figure { margin: 0; }
figcaption { font-size: 0.85em; color: #444; max-width: 640px; }
svg { max-width: 100%; height: auto; font-family: inherit; }
svg text { font-size: 12px; fill: #1a1a1a; }
svg .axis { stroke: #1a1a1a; stroke-width: 1; }
svg .grid { stroke: #ddd; stroke-width: 1; }
svg .whisker { stroke: #1a1a1a; stroke-width: 1.5; }
.notes li { margin: 0.2em 0; }
.warning { border: 2px solid #D55E00; background: #fff4ec; padding: 0.6em 0.8em; margin: 1em 0; }
.meta { color: #444; }
@page { margin: 14mm; }
@media print {
  body { max-width: none; margin: 0; font-size: 10pt; color: #000; }
  .charts { display: block; }
  h2 { break-after: avoid; page-break-after: avoid; }
  figure, tr { break-inside: avoid; page-break-inside: avoid; }
  th { background: #e8e8e8; -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  svg rect.bar, svg circle.point { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
}
"""


def _svg_num(x: float) -> str:
    """A pixel coordinate, to two decimals (the attribute tests allow that rounding)."""
    return f"{x:.2f}"


def _svg_data(x: float | None) -> str:
    """A data value exactly as in the JSON report (repr round-trips a double)."""
    return "" if x is None else repr(float(x))


def _nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 (times a power of ten) at or above x; 1 for x <= 0."""
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        v = m * 10.0 ** exp
        if v >= x * (1 - 1e-12):
            return v
    return 10.0 ** (exp + 1)


def _nice_tick_count(xmax: float) -> int:
    """Intervals on an axis from 0 to a _nice_ceiling value, so that ticks land on round numbers."""
    mantissa = round(xmax / 10.0 ** math.floor(math.log10(xmax)), 6)
    return 4 if mantissa == 2.0 else 5


# Label geometry for the charts: the width of one character of the 12px label font (an upper
# estimate for the system sans-serif faces the CSS names) and the height of one label line.
SVG_CHAR_W = 7.2
SVG_LINE_H = 15.0


def svg_label_box(x: float, y: float, text: str, anchor: str) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) of a one-line label whose baseline starts (or ends) at x, y."""
    w = len(text) * SVG_CHAR_W
    left = x if anchor == "start" else x - w if anchor == "end" else x - w / 2
    return (left, y - SVG_LINE_H + 3, left + w, y + 3)


def svg_place_labels(points: Sequence[tuple[float, float, str]], bounds: tuple[float, float, float, float]
                     ) -> list[tuple[float, float, str]]:
    """Positions (x, y, anchor) for point labels so that no two label boxes overlap (pure).

    Each label tries right-above, right-below, left-above, left-below its point, then steps
    further down and up one line at a time; the first box inside `bounds` (left, top, right,
    bottom) that meets no label placed before it wins.  Points are labelled in the given order."""
    placed: list[tuple[float, float, float, float]] = []
    out = []

    def free(box: tuple[float, float, float, float]) -> bool:
        inside = box[0] >= bounds[0] and box[1] >= bounds[1] and box[2] <= bounds[2] and box[3] <= bounds[3]
        return inside and all(box[2] <= b[0] or box[0] >= b[2] or box[3] <= b[1] or box[1] >= b[3]
                              for b in placed)

    for cx, cy, text in points:
        tries = [(cx + 9, cy - 6, "start"), (cx + 9, cy + 16, "start"),
                 (cx - 9, cy - 6, "end"), (cx - 9, cy + 16, "end")]
        for k in range(1, 200):
            for dy in (16 + k * SVG_LINE_H, -6 - k * SVG_LINE_H):
                tries += [(cx + 9, cy + dy, "start"), (cx - 9, cy + dy, "end")]
        choice = next((t for t in tries if free(svg_label_box(t[0], t[1], text, t[2]))), tries[0])
        placed.append(svg_label_box(choice[0], choice[1], text, choice[2]))
        out.append(choice)
    return out


def _svg_fit(text: str, width: float) -> str:
    """`text` cut (with an ellipsis) to fit `width` pixels of label font."""
    n = max(1, int(width // SVG_CHAR_W))
    return text if len(text) <= n else text[:max(1, n - 1)] + "\u2026"


def _svg_rate_chart(report: dict) -> str:
    """Chart 1: success rate per arm as bars with Wilson 95% whiskers (y: 0..1 linear)."""
    arms = report["arms"]
    pa = report["per_arm"]
    width, height = 640, 320
    left, right, top, bottom = 56, 16, 20, 60
    pw, ph = width - left - right, height - top - bottom
    y0, y1 = top + ph, top  # pixel rows of rate 0 and rate 1

    def y(v: float) -> float:
        return y0 - v * (y0 - y1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="success-rate" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'data-y0="{y0}" data-y1="{y1}" role="img" '
           f'aria-label="Success rate per arm with 95% Wilson intervals">']
    out.append("<title>Success rate per arm with 95% Wilson intervals</title>")
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line class="grid" x1="{left}" x2="{left + pw}" y1="{_svg_num(y(t))}" '
                   f'y2="{_svg_num(y(t))}"/>')
        out.append(f'<text x="{left - 6}" y="{_svg_num(y(t) + 4)}" text-anchor="end">'
                   f'{int(t * 100)}%</text>')
    out.append(f'<line class="axis" x1="{left}" x2="{left}" y1="{y1}" y2="{y0}"/>')
    out.append(f'<line class="axis" x1="{left}" x2="{left + pw}" y1="{y0}" y2="{y0}"/>')
    band = pw / max(1, len(arms))
    bar_w = band * 0.55
    for i, arm in enumerate(arms):
        s = pa[arm]
        cx = left + band * (i + 0.5)
        colour = _HTML_COLOURS[i % len(_HTML_COLOURS)]
        name = html.escape(arm)
        full = arm + (" (base)" if arm == report["baseline"] else "")
        label = html.escape(_svg_fit(full, band - 4))   # a long name is cut to its band, whole in <title>
        out.append(f'<text class="label" data-label-for="{name}" x="{_svg_num(cx)}" y="{y0 + 18}" '
                   f'text-anchor="middle">{label}<title>{html.escape(full)}</title></text>')
        out.append(f'<text x="{_svg_num(cx)}" y="{y0 + 34}" text-anchor="middle">'
                   f'n={s["evaluated"]}</text>')
        rate, ci = s["success_rate"], s["success_ci"]
        if rate is None:
            out.append(f'<text class="nodata" data-arm="{name}" x="{_svg_num(cx)}" '
                       f'y="{_svg_num(y0 - 8)}" text-anchor="middle">no data</text>')
            continue
        out.append(f'<rect class="bar" data-arm="{name}" data-rate="{_svg_data(rate)}" '
                   f'data-lo="{_svg_data(ci[0])}" data-hi="{_svg_data(ci[1])}" '
                   f'data-n="{s["evaluated"]}" data-successes="{s["successes"]}" '
                   f'x="{_svg_num(cx - bar_w / 2)}" y="{_svg_num(y(rate))}" '
                   f'width="{_svg_num(bar_w)}" height="{_svg_num(y0 - y(rate))}" '
                   f'fill="{colour}" fill-opacity="0.75" stroke="#1a1a1a" stroke-width="0.5">'
                   f'<title>{name}: {fmt_pct(rate)} {_fmt_ci(ci)}</title></rect>')
        cap = bar_w * 0.3
        out.append(f'<g class="whisker" data-arm="{name}" data-lo="{_svg_data(ci[0])}" '
                   f'data-hi="{_svg_data(ci[1])}">'
                   f'<line class="whisker" x1="{_svg_num(cx)}" x2="{_svg_num(cx)}" '
                   f'y1="{_svg_num(y(ci[1]))}" y2="{_svg_num(y(ci[0]))}"/>'
                   f'<line class="whisker" x1="{_svg_num(cx - cap)}" x2="{_svg_num(cx + cap)}" '
                   f'y1="{_svg_num(y(ci[1]))}" y2="{_svg_num(y(ci[1]))}"/>'
                   f'<line class="whisker" x1="{_svg_num(cx - cap)}" x2="{_svg_num(cx + cap)}" '
                   f'y1="{_svg_num(y(ci[0]))}" y2="{_svg_num(y(ci[0]))}"/></g>')
        out.append(f'<text x="{_svg_num(cx)}" y="{_svg_num(y(ci[1]) - 6)}" '
                   f'text-anchor="middle">{fmt_pct(rate)}</text>')
    out.append(f'<text x="14" y="{_svg_num((y0 + y1) / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 14 {_svg_num((y0 + y1) / 2)})">success rate</text>')
    out.append("</svg>")
    return "".join(out)


def _svg_cost_chart(report: dict) -> str:
    """Chart 2: cost per run (x, USD, linear from 0) against success rate (y, 0..1) per arm."""
    arms = report["arms"]
    pa = report["per_arm"]
    width, height = 640, 320
    left, right, top, bottom = 56, 24, 20, 60
    pw, ph = width - left - right, height - top - bottom
    y0, y1 = top + ph, top
    points = [(i, a) for i, a in enumerate(arms)
              if pa[a]["success_rate"] is not None and pa[a]["cost_per_run_usd"] is not None]
    xmax = _nice_ceiling(max([pa[a]["cost_per_run_usd"] for _, a in points] or [0.0]) * 1.1)
    x0, x1 = left, left + pw  # pixel columns of cost 0 and cost xmax

    def x(v: float) -> float:
        return x0 + v / xmax * (x1 - x0)

    def y(v: float) -> float:
        return y0 - v * (y0 - y1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-chart="cost-vs-success" '
           f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
           f'data-x0="{x0}" data-x1="{x1}" data-xmax="{_svg_data(xmax)}" '
           f'data-y0="{y0}" data-y1="{y1}" role="img" '
           f'aria-label="Cost per run against success rate per arm">']
    out.append("<title>Cost per run against success rate per arm</title>")
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line class="grid" x1="{x0}" x2="{x1}" y1="{_svg_num(y(t))}" '
                   f'y2="{_svg_num(y(t))}"/>')
        out.append(f'<text x="{x0 - 6}" y="{_svg_num(y(t) + 4)}" text-anchor="end">'
                   f'{int(t * 100)}%</text>')
    n_ticks = _nice_tick_count(xmax)
    for k in range(n_ticks + 1):
        v = xmax * k / n_ticks
        out.append(f'<line class="grid" x1="{_svg_num(x(v))}" x2="{_svg_num(x(v))}" '
                   f'y1="{y1}" y2="{y0}"/>')
        out.append(f'<text x="{_svg_num(x(v))}" y="{y0 + 18}" text-anchor="middle">'
                   f'${v:,.4g}</text>')
    out.append(f'<line class="axis" x1="{x0}" x2="{x0}" y1="{y1}" y2="{y0}"/>')
    out.append(f'<line class="axis" x1="{x0}" x2="{x1}" y1="{y0}" y2="{y0}"/>')
    spots = svg_place_labels([(x(pa[a]["cost_per_run_usd"]), y(pa[a]["success_rate"]), a) for _, a in points],
                             (0.0, 0.0, float(width), float(y0)))
    for (i, arm), (lx, ly, anchor) in zip(points, spots):
        s = pa[arm]
        name = html.escape(arm)
        colour = _HTML_COLOURS[i % len(_HTML_COLOURS)]
        cx, cy = x(s["cost_per_run_usd"]), y(s["success_rate"])
        lo, hi = s["success_ci"]
        out.append(f'<line class="whisker" data-arm="{name}" data-lo="{_svg_data(lo)}" '
                   f'data-hi="{_svg_data(hi)}" x1="{_svg_num(cx)}" x2="{_svg_num(cx)}" '
                   f'y1="{_svg_num(y(hi))}" y2="{_svg_num(y(lo))}"/>')
        out.append(f'<circle class="point" data-arm="{name}" '
                   f'data-cost="{_svg_data(s["cost_per_run_usd"])}" '
                   f'data-rate="{_svg_data(s["success_rate"])}" '
                   f'data-estimated="{str(s["cost_estimated_usd"] > 0).lower()}" '
                   f'cx="{_svg_num(cx)}" cy="{_svg_num(cy)}" r="6" fill="{colour}" '
                   f'stroke="#1a1a1a" stroke-width="1"><title>{name}: '
                   f'{fmt_usd(s["cost_per_run_usd"], s["cost_estimated_usd"] > 0)} per run, '
                   f'{fmt_pct(s["success_rate"])}</title></circle>')
        out.append(f'<text class="label" data-label-for="{name}" x="{_svg_num(lx)}" y="{_svg_num(ly)}" '
                   f'text-anchor="{anchor}">{name}</text>')
    missing = [a for a in arms if all(a != p for _, p in points)]
    if missing:
        out.append(f'<text x="{x0 + 4}" y="{y0 + 50}">no data: '
                   f'{html.escape(", ".join(missing))}</text>')
    out.append(f'<text x="{_svg_num((x0 + x1) / 2)}" y="{y0 + 36}" text-anchor="middle">'
               f'cost per run (USD)</text>')
    out.append(f'<text x="14" y="{_svg_num((y0 + y1) / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 14 {_svg_num((y0 + y1) / 2)})">success rate</text>')
    out.append("</svg>")
    return "".join(out)


def html_table(headers: list[str], rows: list[list[str]]) -> str:
    def cell(tag: str, text: str) -> str:
        t = str(text)
        # Right-align cells that start like a number, a price or a signed difference.
        numeric = tag == "td" and (t[:1].isdigit() or (len(t) > 1 and t[0] in "$~+-"))
        cls = ' class="num"' if numeric else ""
        return f"<{tag}{cls}>{html.escape(t)}</{tag}>"

    head = "<tr>" + "".join(cell("th", h) for h in headers) + "</tr>"
    body = "".join("<tr>" + "".join(cell("td", c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead>{head}</thead><tbody>{body}</tbody></table>"


#: Columns of one HTML table at most: a wider table is split into parts that each repeat the first
#: column, so that every column stays on a 1280 px screen.
HTML_TABLE_MAX_COLUMNS = 9


def column_chunks(n_columns: int, max_columns: int = HTML_TABLE_MAX_COLUMNS) -> list[list[int]]:
    """The column indexes of each part of a table split to at most `max_columns` columns, each
    part led by column 0 (pure)."""
    if n_columns <= max_columns:
        return [list(range(n_columns))]
    rest = list(range(1, n_columns))
    step = max_columns - 1
    parts = [rest[i:i + step] for i in range(0, len(rest), step)]
    if len(parts) > 1 and len(parts[-1]) < step // 2:   # no stub part of one or two columns
        per = -(-len(rest) // len(parts))
        parts = [rest[i:i + per] for i in range(0, len(rest), per)]
    return [[0, *p] for p in parts]


def html_tables(headers: list[str], rows: list[list[str]]) -> str:
    """html_table, split into parts of at most HTML_TABLE_MAX_COLUMNS columns."""
    return "\n".join(html_table([headers[i] for i in cols], [[r[i] for i in cols] for r in rows])
                     for cols in column_chunks(len(headers)))


def render_report_html(report: dict, extra: str = "") -> str:
    """One self-contained page: inline CSS and SVG, no scripts, no external resources.

    Chart marks carry the JSON numbers as data-* attributes (data-arm, data-rate, data-lo,
    data-hi, data-cost) and each SVG states its axis scale (data-y0/data-y1: pixel rows of
    rate 0 and 1; data-x0/data-x1/data-xmax for cost), so the geometry can be checked against
    the numbers. The page is well-formed XML apart from the doctype line.
    """
    title = html.escape(report.get("title") or "Study report")
    tot = report["totals"]
    parts = ['<!DOCTYPE html>',
             '<html lang="en"><head><meta charset="utf-8"/>',
             '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
             f"<title>{title}</title><style>{HTML_CSS}</style></head><body>",
             f"<h1>{title}</h1>",
             f'<p class="meta">Baseline <strong>{html.escape(report["baseline"])}</strong>; '
             f'primary view: {html.escape(report["primary_view"].replace("_", " "))}; '
             f'{tot["runs"]} runs over {tot["tasks"]} tasks; total cost '
             f'{html.escape(fmt_usd(tot["cost_usd"], tot["cost_estimated_usd"] > 0))}'
             f'{" (simulated: a rehearsal, nothing billed)" if tot.get("rehearsed_runs") else ""}; '
             f'bootstrap seed {html.escape(str(report["seed"]))}.</p>',
             (f'<div class="warning exploratory" role="alert"><strong>'
              f'{html.escape(_rpt_analysis_line(report))}</strong></div>' if report.get("exploratory")
              else f'<p class="meta analysis">{html.escape(_rpt_analysis_line(report))}</p>'),
             *[f'<div class="warning" role="alert"><strong>Warning:</strong> {html.escape(w)}</div>'
               for w in report.get("warnings") or []],
             '<div class="charts">',
             '<figure>', _svg_rate_chart(report),
             '<figcaption>Success rate per arm (evaluated runs of the primary view) with 95% '
             'Wilson score intervals.</figcaption></figure>',
             '<figure>', _svg_cost_chart(report),
             '<figcaption>Cost per started run against success rate, per arm, with the same '
             'intervals. Up and to the left is better.</figcaption></figure>',
             '</div>']
    if extra:
        parts.append(extra)   # the run pages' index section (already escaped HTML)
    for heading, headers, rows in _rpt_tables(report):
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        parts.append(html_tables(headers, rows) if rows else "<p>(none)</p>")
    parts.append('<h2>Notes</h2><ul class="notes">')
    parts += [f"<li>{html.escape(n)}</li>" for n in report["notes"]] or ["<li>(none)</li>"]
    if tot["cost_estimated_usd"] > 0:
        parts.append("<li>~ marks a cost that includes an estimate from list prices</li>")
    parts.append("</ul><h2>Methods</h2><ul>")
    for k, v in report["methods"].items():
        text = v if isinstance(v, str) else ", ".join(v)
        parts.append(f"<li><strong>{html.escape(k)}</strong>: {html.escape(text)}</li>")
    parts.append("</ul></body></html>")
    return "\n".join(parts) + "\n"


# ==================================================================================================
# Run pages: the report as a directory
# ==================================================================================================
# `report --format html --out DIR/` writes index.html (the report page plus the task x arm matrix of
# runs, discordant pairs first) and runs/<run>.html, one page per run: the conversation as a
# timeline from the raw streams, gate receipts and the feedback sent, the review, the workspace diff
# against the task's starter, the audit, cost and tokens per session, provenance.  Everything in a
# page comes from files the agent could influence (streams, its workspace): all of it is escaped,
# trimmed and folded here, symlinks in the workspace are named and never followed.  Owns reading
# those files for the pages and rendering them; it computes no statistics (the report builder does)
# and writes only inside the directory it is given.

PAGE_TEXT_CHARS = 6000          # one assistant text or prompt, beyond which it is cut
PAGE_INPUT_CHARS = 3000         # one tool call's input (JSON)
PAGE_RESULT_CHARS = 2000        # one tool result
PAGE_FOLD_CHARS = 600           # longer blocks are folded in <details>
PAGE_ITEMS_PER_SESSION = 400    # timeline entries per session; the rest are counted, not shown
PAGE_STREAM_BYTES = 32 * 1024 * 1024   # bytes of one raw stream read for a page
PAGE_DIFF_FILE_BYTES = 256 * 1024      # a file larger than this is listed, not diffed
PAGE_DIFF_CHARS = 200_000       # the whole diff of one run
PAGE_RUNS_DIR = "runs"


def _page_trim(text: Any, limit: int) -> tuple[str, int]:
    """`text` as a string cut to `limit` characters, and how many were cut."""
    s = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    return (s, 0) if len(s) <= limit else (s[:limit], len(s) - limit)


def _page_result_text(content: Any) -> str:
    """A tool_result's content (a string or a list of text blocks) as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(b.get("text")) if isinstance(b, dict) and "text" in b else
                         json.dumps(b, ensure_ascii=False, default=str) for b in content)
    return "" if content is None else json.dumps(content, ensure_ascii=False, default=str)


def _finite_or_none(x: Any) -> float | None:
    return finite_number(x)


def stream_timeline(lines: Iterable[str | bytes]) -> dict[str, Any]:
    """The timeline of one session from its raw stream-json lines (pure).

    Items, in stream order: {kind: text|thinking, text, cut}; {kind: tool, id, name, input, cut,
    result, result_cut, is_error} (a tool_result is attached to the call with its tool_use_id);
    {kind: result, subtype, cost_usd, turns, duration_s, text}.  Lines that are not JSON objects
    are counted, never shown raw; after PAGE_ITEMS_PER_SESSION items the rest are counted."""
    items: list[dict[str, Any]] = []
    tools: dict[str, dict[str, Any]] = {}
    out = {"items": items, "lines": 0, "bad_lines": 0, "omitted": 0, "tool_calls": 0}

    def add(item: dict[str, Any]) -> bool:
        if len(items) >= PAGE_ITEMS_PER_SESSION:
            out["omitted"] += 1
            return False
        items.append(item)
        return True

    for raw in lines:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")
        if not raw.strip():
            continue
        out["lines"] += 1
        try:
            ev = json.loads(raw)
        except ValueError:
            ev = None
        if not isinstance(ev, dict):
            out["bad_lines"] += 1
            continue
        kind = ev.get("type")
        msg = ev.get("message") if isinstance(ev.get("message"), dict) else {}
        blocks = msg.get("content") if isinstance(msg.get("content"), list) else []
        if kind == "assistant":
            for b in blocks:
                if not isinstance(b, dict):
                    continue
                if b.get("type") in ("text", "thinking"):
                    text, cut = _page_trim(str(b.get("text") or b.get("thinking") or ""), PAGE_TEXT_CHARS)
                    add({"kind": b["type"], "text": text, "cut": cut})
                elif b.get("type") == "tool_use":
                    out["tool_calls"] += 1
                    tid = str(b.get("id") or "")
                    if tid and tid in tools:
                        continue   # the same block again in a later event of the message
                    raw_in = b.get("input")
                    # An input object reads best as key: value lines, strings as written.
                    shown = ("\n".join(
                        f"{k}: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)}"
                        for k, v in raw_in.items()) if isinstance(raw_in, dict) else raw_in)
                    inp, cut = _page_trim(shown, PAGE_INPUT_CHARS)
                    item = {"kind": "tool", "id": tid, "name": str(b.get("name") or "?"), "input": inp,
                            "cut": cut, "result": None, "result_cut": 0, "is_error": False}
                    if add(item) and tid:
                        tools[tid] = item
        elif kind == "user":
            for b in blocks:
                if isinstance(b, dict) and b.get("type") == "tool_result":
                    item = tools.get(str(b.get("tool_use_id") or ""))
                    if item is not None:
                        item["result"], item["result_cut"] = _page_trim(_page_result_text(b.get("content")),
                                                                        PAGE_RESULT_CHARS)
                        item["is_error"] = b.get("is_error") is True
        elif kind == "result":
            turns, dur = ev.get("num_turns"), _finite_or_none(ev.get("duration_ms"))
            text, cut = _page_trim(str(ev.get("result") or ""), PAGE_TEXT_CHARS)
            add({"kind": "result", "subtype": str(ev.get("subtype") or ""),
                 "cost_usd": _finite_or_none(ev.get("total_cost_usd")),
                 "turns": turns if isinstance(turns, int) and not isinstance(turns, bool) else None,
                 "duration_s": None if dur is None else dur / 1000, "text": text, "cut": cut})
    return out


def _page_read_stream(path: Path) -> list[bytes]:
    """Up to PAGE_STREAM_BYTES of a raw stream, whole lines (a missing file is no lines).  Read
    without following a link or opening a FIFO, and never more than that many bytes (a link to
    /dev/zero in its place would be one endless line)."""
    try:
        opened = open_regular(path)
        if opened is None:
            return []
        with os.fdopen(opened[0], "rb") as fh:
            data = fh.read(PAGE_STREAM_BYTES + 1)
    except OSError:
        return []
    lines = data.splitlines(keepends=True)
    if len(data) > PAGE_STREAM_BYTES and lines:
        lines.pop()          # the cut one
    return lines


def _page_tree(root: Path) -> dict[str, Path]:
    """Regular files and symlinks under `root` by relative path, without following a link
    (a directory link is listed, not entered); .git is skipped."""
    found: dict[str, Path] = {}
    if not root.is_dir() or root.is_symlink():
        return found
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not (Path(dirpath) / d).is_symlink())
        for name in sorted(filenames) + sorted(
                d for d in os.listdir(dirpath)
                if (Path(dirpath) / d).is_symlink() and (Path(dirpath) / d).is_dir()):
            p = Path(dirpath) / name
            found[p.relative_to(root).as_posix()] = p
    return found


def _page_file_text(p: Path) -> tuple[str | None, str]:
    """(text, note): the file's text, or None and why it is not shown (a link, binary, large)."""
    if p.is_symlink():
        return None, f"symbolic link to {os.readlink(p)} (not followed)"
    try:
        # Opened without following a link and without blocking (a pipe the agent left must not
        # hang the report), then judged by what was opened.
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file (a pipe, socket or device): not read"
            if st.st_nlink > 1:
                return None, f"a hard link ({st.st_nlink} names): not read"
            if st.st_size > PAGE_DIFF_FILE_BYTES:
                return None, f"{st.st_size} bytes, too large to diff"
            data = fh.read(PAGE_DIFF_FILE_BYTES + 1)
    except OSError as exc:
        return None, f"unreadable: {exc.strerror or exc}"
    if b"\0" in data:
        return None, f"binary, {len(data)} bytes"
    return data.decode("utf-8", "replace"), ""


def workspace_diff(starter: Path | None, workspace: Path) -> dict[str, Any]:
    """What the run changed: files added, removed, changed, each with a unified diff against the
    task's starter (public/) where both sides are text; capped at PAGE_DIFF_CHARS in all."""
    if starter is None or not starter.is_dir():
        return {"available": False, "why": "the task's starter files are not available", "files": []}
    if not workspace.is_dir():
        return {"available": False, "why": "the run's workspace is not on disk", "files": []}
    old, new = _page_tree(starter), _page_tree(workspace)
    files, budget, cut = [], PAGE_DIFF_CHARS, 0
    for raw in sorted(set(old) | set(new)):
        rel = shown_name(raw)     # what the page shows: an odd name escaped, never raw bytes
        a, b = old.get(raw), new.get(raw)
        if a is not None and b is not None and not b.is_symlink() and a.is_file() and b.is_file():
            try:
                if a.stat().st_size == b.stat().st_size and sha256_regular(a) == sha256_regular(b) \
                        and sha256_regular(b) is not None:
                    continue
            except OSError:
                pass
        status = "added" if a is None else "removed" if b is None else "changed"
        ta, na = _page_file_text(a) if a is not None else ("", "")
        tb, nb = _page_file_text(b) if b is not None else ("", "")
        entry = {"path": rel, "status": status, "note": nb or na, "diff": ""}
        if ta is not None and tb is not None:
            text = "".join(difflib.unified_diff(ta.splitlines(True), tb.splitlines(True),
                                                f"starter/{rel}", f"workspace/{rel}"))
            if len(text) > budget:
                cut += len(text) - budget
                text = text[:budget]
            budget -= len(text)
            entry["diff"] = text
        files.append(entry)
    return {"available": True, "files": files, "cut": cut}


def discordant_pairs(runs: list[dict], arms: list[str], base: str) -> list[dict[str, Any]]:
    """Same task and repeat, baseline and arm both evaluated, one succeeded and the other did not
    (pure; excluded runs are left out, as in the primary view)."""
    by_key: dict[tuple[str, str, Any], dict] = {}
    for r in runs:
        if run_evaluated(r) and not run_excluded(r) and r.get("repeat") is not None:
            by_key.setdefault((str(r.get("task")), str(r.get("arm")), r.get("repeat")), r)
    out = []
    for (task, arm, rep), r in sorted(by_key.items(),
                                      key=lambda kv: (str(kv[0][0]), str(kv[0][1]), str(kv[0][2]))):
        if arm == base or arm not in arms:
            continue
        b = by_key.get((task, base, rep))
        if b is not None and run_succeeded(r) != run_succeeded(b):
            out.append({"task": task, "repeat": rep, "arm": arm, "arm_run": r.get("run_id"),
                        "baseline_run": b.get("run_id"), "arm_success": run_succeeded(r)})
    return out


def page_file_names(run_ids: Iterable[Any]) -> dict[str, str]:
    """A file name under runs/ for every run id, safe on every OS and unique."""
    names: dict[str, str] = {}
    used: set[str] = set()
    for rid in run_ids:
        rid = str(rid)
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", rid).strip(".") or "run"
        name, k = stem, 1
        while name.lower() in used:
            k += 1
            name = f"{stem}-{k}"
        used.add(name.lower())
        names[rid] = f"{name}.html"
    return names


def collect_run_page(paths: StudyPaths, rec: dict, starter: Path | None) -> dict[str, Any]:
    """Everything one run page shows, read from the study's files (I/O)."""
    run_dir = paths.run_dir(str(rec.get("run_id")))
    sessions = []
    for j in rec.get("jobs") or []:
        if not isinstance(j, dict):
            continue
        jid = str(j.get("job_id") or "")
        job = read_json(paths.job_file(jid), default=None) if re.fullmatch(r"j\d+", jid) else None
        prompt = ""
        with contextlib.suppress(OSError):
            prompt = (paths.job_dir(jid) / "prompt.txt").read_text(encoding="utf-8", errors="replace")
        stream = (Path(job["raw_dir"]) / "stream.jsonl" if isinstance(job, dict) and job.get("raw_dir")
                  else None)
        timeline = stream_timeline(_page_read_stream(stream)) if stream else stream_timeline([])
        result = read_json(paths.result_file(jid), default=None) if job else None
        usage = (result or {}).get("usage") if isinstance(result, dict) else None
        sessions.append({"job_id": jid, "role": str(j.get("role") or ""), "status": j.get("status"),
                         "created_at": job.get("created_at") if isinstance(job, dict) else None,
                         "reason": j.get("reason"), "cost_usd": _finite_or_none(j.get("cost_usd")),
                         "duration_s": _finite_or_none(j.get("duration_s")),
                         "tokens": (usage or {}).get("tokens") if isinstance(usage, dict) else None,
                         "prompt": _page_trim(prompt, PAGE_TEXT_CHARS), "timeline": timeline,
                         "stream_found": bool(stream and stream.exists())})
    gates = []
    for p in sorted((run_dir / "receipts").glob("*.json")) if (run_dir / "receipts").is_dir() else []:
        try:
            g = read_json(p, default=None)
        except AgentbenchError:
            g = None
        if isinstance(g, dict):
            gates.append({"file": p.name, "at": g.get("at"), "passed": g.get("passed"),
                          "score": g.get("score"), "exit_code": g.get("exit_code"),
                          "checks": g.get("checks") if isinstance(g.get("checks"), list) else [],
                          "output": _page_trim(str(g.get("stderr_tail") or "")
                                               + str(g.get("stdout_tail") or ""), PAGE_RESULT_CHARS)})
    ws = (rec.get("workspace") or {}).get("path") if isinstance(rec.get("workspace"), dict) else None
    diff = (workspace_diff(starter, Path(ws)) if ws
            else {"available": False, "why": "no workspace recorded", "files": []})
    return {"run": rec, "sessions": sessions, "receipts": gates, "diff": diff}


# -- rendering -------------------------------------------------------------------------------------

_PAGE_CSS = """
.tl { border-left: 3px solid #bbb; padding-left: 0.8em; margin: 0.5em 0; }
.tl .prompt { background: #eef4fb; } .tl .text { background: #f7f7f7; }
.tl .tool { background: #fdf6e8; } .tl .err { background: #fbeaea; }
.tl > div { margin: 0.3em 0; padding: 0.3em 0.5em; }
pre { white-space: pre-wrap; word-break: break-word; font-size: 0.85em; margin: 0.2em 0; }
td.ok { background: #e7f4ea; } td.fail { background: #fbeaea; } td.excl { background: #eee; }
.flag { color: #D55E00; font-weight: bold; }
"""


def _page_block(text: str, cut: int) -> str:
    """Escaped text in <pre>, folded when long, with what was cut said."""
    body = f"<pre>{html.escape(text)}</pre>"
    if cut:
        body += f"<p><em>({cut} more characters not shown)</em></p>"
    if len(text) > PAGE_FOLD_CHARS:
        first = text.strip().splitlines()[0][:80] if text.strip() else ""
        body = (f"<details><summary>{html.escape(first)} ({len(text) + cut} characters)</summary>"
                f"{body}</details>")
    return body


def _page_tool_summary(item: dict) -> str:
    """`Name: first line of its command, path or pattern` for a folded tool call."""
    key = ""
    for line in item["input"].splitlines():
        name, sep, value = line.partition(": ")
        if sep and name in ("command", "file_path", "path", "pattern", "notebook_path"):
            key = value
            break
    return f"{item['name']}: {key[:120]}"


def _page_session_html(s: dict) -> str:
    """One session of the timeline: the prompt sent, then its stream, folded where long."""
    esc = html.escape
    tl = s["timeline"]
    p = [f'<h3 id="{esc(s["job_id"])}">Session {esc(s["job_id"])}: {esc(s["role"])}</h3>'
         f'<div class="tl">',
         f'<div class="prompt"><strong>Prompt sent</strong>'
         f'{_page_block(s["prompt"][0], s["prompt"][1])}</div>']
    if not s["stream_found"]:
        p.append("<div><em>(no raw stream on disk)</em></div>")
    for it in tl["items"]:
        if it["kind"] in ("text", "thinking"):
            p.append(f'<div class="text">'
                     f'<strong>{"Assistant" if it["kind"] == "text" else "Thinking"}</strong>'
                     f'{_page_block(it["text"], it["cut"])}</div>')
        elif it["kind"] == "tool":
            res = ("<p><em>(no result)</em></p>" if it["result"] is None else
                   "<strong>Result</strong>" + _page_block(it["result"], it["result_cut"]))
            p.append(f'<div class="tool{" err" if it["is_error"] else ""}" data-tool="{esc(it["name"])}">'
                     f'<details><summary>Tool call {esc(_page_tool_summary(it))}</summary>'
                     f'<strong>Input</strong>{_page_block(it["input"], it["cut"])}{res}</details></div>')
        elif it["kind"] == "result":
            # The binary's own total is cumulative over a resumed conversation: the per-session
            # cost is the table's.
            p.append(f'<div><strong>Session result</strong>: {esc(it["subtype"])}, '
                     f'{esc(str(it["turns"]))} turns'
                     f'{_page_block(it["text"], it["cut"]) if it["text"] else ""}</div>')
    if tl["omitted"]:
        p.append(f"<div><em>({tl['omitted']} more timeline entries not shown)</em></div>")
    if tl["bad_lines"]:
        p.append(f"<div><em>({tl['bad_lines']} stream lines were not JSON objects)</em></div>")
    p.append("</div>")
    return "\n".join(p)


def _page_receipt_html(g: dict) -> str:
    esc = html.escape
    checks = ", ".join(f"{c.get('id')}: {'pass' if c.get('passed') else 'fail'}"
                       for c in g["checks"] if isinstance(c, dict))
    return (f'<h3>Receipt {esc(g["file"])}: {"passed" if g["passed"] is True else "not passed"}, score '
            f'{esc(str(g["score"]))}, exit {esc(str(g["exit_code"]))}</h3><div class="tl">'
            + (f"<p>{esc(checks)}</p>" if checks else "") + _page_block(*g["output"]) + "</div>")


def _page_review_html(r: dict) -> str:
    esc = html.escape
    rows = [[str(f.get("severity")), str(f.get("file")), _page_trim(str(f.get("detail")), 1000)[0]]
            for f in r.get("findings") or [] if isinstance(f, dict)]
    return (f"<h3>Review {esc(str(r.get('n')))}: {esc(str(r.get('verdict')))}</h3>"
            f"<p>{esc(_page_trim(str(r.get('summary') or ''), PAGE_TEXT_CHARS)[0])}</p>"
            + (html_table(["Severity", "File", "Detail"], rows) if rows else "<p>(no findings)</p>"))


def render_run_page(page: dict) -> str:
    """One run's page (pure): header, audit, sessions with their timelines, receipts, review,
    diff, provenance.  Links only to ../index.html."""
    rec = page["run"]
    esc = html.escape
    rid = str(rec.get("run_id"))
    ev = rec.get("evaluation") if isinstance(rec.get("evaluation"), dict) else {}
    title = f"Run {rid}: {rec.get('task')} / {rec.get('arm')} / repeat {rec.get('repeat')}"
    p = ['<!DOCTYPE html>', '<html lang="en"><head><meta charset="utf-8"/>',
         f"<title>{esc(title)}</title><style>{HTML_CSS}{_PAGE_CSS}</style></head><body>",
         '<p><a href="../index.html">&#8592; study report</a></p>', f"<h1>{esc(title)}</h1>"]
    audit = run_audit(rec)
    p.append(html_table(["Outcome", "Validity", "Success", "Score", "Tests", "Gate cycles", "Cost", "Wall",
                          "Flagged by audit"],
                         [[str(rec.get("outcome") or rec.get("status")), str(rec.get("validity")) +
                           (f" ({rec.get('validity_reason')})" if rec.get("validity_reason") else ""),
                           "yes" if run_succeeded(rec) else "no", fmt_num(run_score(rec), 3),
                           f"{ev.get('tests_passed')}/{ev.get('tests_total')}" if ev else "-",
                           fmt_int(rec.get("gate_cycles") or 0),
                           fmt_usd(run_cost(rec), bool(rec.get("cost_estimated"))),
                           fmt_secs(_finite_or_none(rec.get("wall_s"))),
                           "yes" if audit["flagged"] else "no"]]))
    p.append("<h2>Behaviour audit</h2>")
    findings = (rec.get("audit") or {}).get("findings") if isinstance(rec.get("audit"), dict) else None
    if not audit["audited"]:
        p.append("<p>(no audit recorded)</p>")
    elif not findings and not audit["flagged"]:
        p.append("<p>No findings.</p>")
    else:
        rows = [[REPORT_AUDIT_GROUPS.get(audit_group(str(f.get("kind"))), str(f.get("kind")))
                 if isinstance(f, dict) else "malformed",
                 str(f.get("kind")) if isinstance(f, dict) else "-",
                 (str(f.get("tool") or "-") + (f" ({f['session']})" if f.get("session") else ""))
                 if isinstance(f, dict) else "-",
                 # A path the agent named is shown escaped (control characters, undecodable bytes).
                 _page_trim(shown_name(str(f.get("path") or f.get("files") or f.get("detail") or "")), 300)[0]
                 if isinstance(f, dict) else _page_trim(f, 300)[0]]
                for f in (findings if isinstance(findings, list) else [findings])]
        p.append(f'<p class="flag">Flagged.</p>' + html_table(["Group", "Kind", "Tool", "What"], rows))
    p.append("<h2>Cost and tokens per session</h2>")
    rows = []
    for s in page["sessions"]:
        tok = s["tokens"] if isinstance(s["tokens"], dict) else {}
        rows.append([s["job_id"], s["role"], str(s["status"]) + (f" ({s['reason']})" if s["reason"] else ""),
                     fmt_usd(s["cost_usd"]), fmt_secs(s["duration_s"]),
                     *[fmt_int(tok.get(k, 0)) if isinstance(tok.get(k, 0), int) else "-"
                       for k in ("input", "output", "cache_creation", "cache_read")],
                     fmt_int(s["timeline"]["tool_calls"])])
    p.append(html_table(["Job", "Role", "Status", "Cost", "Duration", "Input", "Output", "Cache write",
                          "Cache read", "Tool calls"], rows) if rows else "<p>(no sessions)</p>")
    p.append("<h2>Timeline</h2><p>Sessions, gate receipts and reviews in the order they happened. "
             "The feedback after a failed gate or a review is the prompt of the session that follows "
             "(gate_feedback, repair).</p>")
    reviews = [r for r in rec.get("reviews") or [] if isinstance(r, dict)]
    entries = sorted([(str(s.get("created_at") or ""), 0, i, "session", s)
                      for i, s in enumerate(page["sessions"])]
                     + [(str(g.get("at") or "~"), 1, i, "receipt", g)
                        for i, g in enumerate(page["receipts"])],
                     key=lambda e: e[:3])
    n_reviewer = 0
    for _, _, _, kind, obj in entries:
        if kind == "receipt":
            p.append(_page_receipt_html(obj))
            continue
        p.append(_page_session_html(obj))
        if obj["role"] == "reviewer" and n_reviewer < len(reviews):
            p.append(_page_review_html(reviews[n_reviewer]))
            n_reviewer += 1
    for r in reviews[n_reviewer:]:     # a review whose session is not listed
        p.append(_page_review_html(r))
    if not reviews:
        p.append("<p>(no review)</p>")
    p.append("<h2>Workspace diff against the starter</h2>")
    d = page["diff"]
    if d.get("note"):
        p.append(f'<p class="flag">{esc(d["note"])}</p>')
    if not d["available"]:
        p.append(f"<p>{esc(d['why'])}</p>")
    elif not d["files"]:
        p.append("<p>No file differs from the starter.</p>")
    else:
        for f in d["files"]:
            p.append(f"<h3>{esc(f['status'])}: {esc(f['path'])}</h3>"
                     + (f"<p>{esc(f['note'])}</p>" if f["note"] else "")
                     + (_page_block(f["diff"], 0) if f["diff"] else ""))
        if d.get("cut"):
            p.append(f"<p><em>({d['cut']} more characters of diff not shown)</em></p>")
    p.append("<h2>Provenance</h2>")
    prov = rec.get("provenance") if isinstance(rec.get("provenance"), dict) else {}
    p.append(html_table(["Key", "Value"], [[str(k), _page_trim(v, 500)[0]] for k, v in sorted(prov.items())])
             if prov else "<p>(none recorded)</p>")
    p.append("</body></html>")
    return "\n".join(p) + "\n"


def render_run_index(report: dict, runs: list[dict], names: dict[str, str]) -> str:
    """The index page's extra section (pure): discordant pairs first, then the task x arm matrix
    with a cell per run linking to its page."""
    esc = html.escape
    arms, base = report["arms"], report["baseline"]

    def link(rid: Any) -> str:
        name = names.get(str(rid))
        return f'<a href="{PAGE_RUNS_DIR}/{esc(name)}">{esc(str(rid))}</a>' if name else esc(str(rid))

    pairs = discordant_pairs(runs, arms, base)
    p = [f"<h2>Discordant pairs: same task and repeat, {esc(base)} and the arm disagree ({len(pairs)})</h2>"]
    rows = [f"<tr><td>{esc(x['task'])}</td><td>{esc(str(x['repeat']))}</td><td>{esc(x['arm'])}</td>"
            f"<td>{link(x['arm_run'])} {'succeeded' if x['arm_success'] else 'failed'}</td>"
            f"<td>{link(x['baseline_run'])} {'failed' if x['arm_success'] else 'succeeded'}</td></tr>"
            for x in pairs]
    p.append("<table><thead><tr><th>Task</th><th>Repeat</th><th>Arm</th><th>Arm run</th>"
             f"<th>{esc(base)} run</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
             if rows else "<p>(none)</p>")
    p.append("<h2>Every run: task x arm</h2><p>Cell: run (S success, F failure, - not evaluated; "
             "X excluded; ! flagged by the audit).</p>")
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        cells.setdefault((str(r.get("task")), str(r.get("arm"))), []).append(r)
    head = "".join(f"<th>{esc(a)}</th>" for a in arms)
    body = []
    for task in sorted({str(r.get("task")) for r in runs}):
        tds = []
        for a in arms:
            marks = []
            for r in sorted(cells.get((task, a), []), key=lambda r: str(r.get("repeat"))):
                mark = ("S" if run_succeeded(r) else "F") if run_evaluated(r) else "-"
                mark += ("X" if run_excluded(r) else "") + ("!" if run_audit(r)["flagged"] else "")
                marks.append(f"{link(r.get('run_id'))} {esc(mark)}")
            tds.append(f"<td>{'<br/>'.join(marks) or '-'}</td>")
        body.append(f"<tr><td>{esc(task)}</td>{''.join(tds)}</tr>")
    p.append(f"<table><thead><tr><th>Task</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")
    return "\n".join(p)


def write_report_pages(paths: StudyPaths, report: dict, runs: list[dict], out_dir: Path) -> dict[str, Any]:
    """Write index.html and runs/<run>.html under `out_dir` (I/O); returns what was written."""
    try:
        cfg = load_study_config(paths)
        tasks = load_tasks(paths, cfg)
    except AgentbenchError:
        tasks = {}
    arms = set(report["arms"])
    runs = [r for r in runs if str(r.get("arm")) in arms]
    names = page_file_names(r.get("run_id") for r in runs)
    (out_dir / PAGE_RUNS_DIR).mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    for r in runs:
        target = out_dir / PAGE_RUNS_DIR / names[str(r.get("run_id"))]
        try:
            task = tasks.get(str(r.get("task")))
            starter = task.public if task else None
            page = collect_run_page(paths, r, starter)
            ran = ((r.get("provenance") or {}).get("task_bundle_sha256")
                   if isinstance(r.get("provenance"), dict) else None)
            if task and ran and ran != task.bundle_sha256:
                page["diff"]["note"] = (f"the task bundle changed since this run (it ran {str(ran)[:16]}, "
                                        f"the study now has {task.bundle_sha256[:16]}): the diff is "
                                        f"against the current starter")
            text = render_run_page(page)
        except Exception as exc:   # one run's odd files never stop the pages of the others
            failed.append(str(r.get("run_id")))
            text = render_run_page({"run": {"run_id": r.get("run_id"), "task": r.get("task"),
                                            "arm": r.get("arm"), "outcome": r.get("outcome"),
                                            "validity": r.get("validity")},
                                    "sessions": [], "receipts": [],
                                    "diff": {"available": False, "files": [],
                                             "why": f"this run's page could not be read in full: "
                                                    f"{type(exc).__name__}: {exc}"[:500]}})
        # Text that cannot be UTF-8 (an undecodable byte of a name) is written as \udcNN.
        write_bytes_atomic(target, text.encode("utf-8", "backslashreplace"))
    index = out_dir / "index.html"
    write_bytes_atomic(index, render_report_html(report, extra=render_run_index(report, runs, names))
                       .encode("utf-8", "backslashreplace"))
    return {"index": str(index), "run_pages": len(names), "run_pages_partial": failed}


# ==================================================================================================
# Offline scripted model
# ==================================================================================================
# A standard-library HTTP server on 127.0.0.1 that speaks enough of the Anthropic Messages API
# (SSE streaming, non-streaming JSON, count_tokens) for the real `claude` binary to run a whole
# session offline at zero cost.  It answers scripted assistant turns, reports realistic usage
# (with a small prompt-cache model so resumed and forked sessions read their prefix from cache)
# and can inject API faults.  It owns no study state, never touches the workspace itself (the
# binary's own tools do that) and never talks to the network beyond its loopback socket.
#
# Script format (JSON; in memory via add_script() or as <scripts_dir>/<id>.json):
#
#   {"id": "ID",                        # optional; the file name / add_script id wins
#    "model": "claude-...",             # optional model id to report (default: echo the request's)
#    "steps": [STEP, ...]}
#
#   STEP = one assistant response:
#   {"text": "...",                     # optional text block (sent first)
#    "tool_uses": [{"name": "Write", "input": {...}}, ...],   # optional; inputs sent verbatim
#    "usage": {"input_tokens": N, "output_tokens": N,          # optional overrides of the
#              "cache_creation_input_tokens": N,               #   estimated figures; the
#              "cache_read_input_tokens": N,                   #   creation split may be given
#              "ephemeral_5m_input_tokens": N,                 #   too (default: all 5m or the
#              "ephemeral_1h_input_tokens": N},                #   TTL the request asked for)
#    "model": "claude-...",             # optional per-step reported model
#    "fault": "429" | "529" | "overloaded" | "prompt_too_long" | "500" | "hang" | "cut"
#             | "malformed",           # optional injected failure instead of the answer
#    "fault_times": N,                  # optional: fault only the first N attempts of this step
#                                       #   in a session, then answer normally (default: always)
#    "loop": true}                      # optional: this step repeats forever (endless tool loop)
#
#   A step with tool_uses ends with stop_reason "tool_use" (the binary runs the tools and asks
#   again); a step with only text ends with "end_turn" (the `claude -p` call ends).  When the
#   steps run out the server answers a short text with "end_turn".
#
# Faults: "429" -> HTTP 429 rate_limit_error, "529" -> HTTP 529 overloaded_error (both with
# retry-after), "overloaded" -> HTTP 200 SSE stream that carries an `error` event
# (overloaded_error) after message_start, "prompt_too_long" -> HTTP 400 invalid_request_error
# "prompt is too long: N tokens > M maximum", "500" -> HTTP 500 api_error, "hang" -> the request
# is read and never answered (until stop() or until the client gives up), "cut" -> part of the SSE
# stream then the connection is closed, "malformed" -> HTTP 200 SSE with undecodable data lines.
# After a failed stream the binary re-sends the request without streaming; for such a request the
# stream faults become: "overloaded" -> HTTP 529, "cut" -> a JSON body cut short, "malformed" ->
# a body that is not JSON.  Every attempt (retry, fallback) counts toward "fault_times".
#
# Script selection: the marker `[agentbench-script:ID]` in the text of a user message.  The last
# marker in the conversation picks the script; the step index is the number of assistant
# responses after the first user message that carries that marker.  So `--resume` with a new
# prompt (with or without the same marker) continues with the next steps, and a fork whose new
# prompt carries a new marker starts that script at step 0.  Requests without any marker (side
# requests) and requests without tools get a short plain text answer.  A marker naming a script
# that does not exist is answered with HTTP 400 (the session then ends with an API error), so a
# broken rehearsal fails loudly instead of looking like a short successful session.
#
# Usage: input figures are estimated as request characters / 4; a prompt-cache model shared by all
# sessions on one server (like the service's cache) remembers every prefix up to the request's
# last cache_control breakpoint, so a repeated prefix (the next turn, a --resume, a fork) is
# reported as cache_read_input_tokens and only the new part as cache creation, split 5m/1h by the
# breakpoint's TTL.  A prefix expires that TTL after its last use (serve-model --cache-ttl-scale
# shortens both TTLs).  The binary prices these figures with its own table; a step's "usage"
# overrides replace them (e.g. to provoke --max-budget-usd).

SCRIPT_MARKER_RE = re.compile(r"\[agentbench-script:([A-Za-z0-9_.\-]+)\]")
SCRIPT_ID_RE = re.compile(r"[A-Za-z0-9_.\-]+")
SCRIPT_FAULTS = ("429", "529", "overloaded", "prompt_too_long", "500", "hang", "cut", "malformed")
USAGE_OVERRIDE_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                       "cache_read_input_tokens",
                       "ephemeral_5m_input_tokens", "ephemeral_1h_input_tokens")
SIDE_ANSWER_TEXT = "OK."
EXHAUSTED_ANSWER_TEXT = "Done."
_CHARS_PER_TOKEN = 4


def _estimate_tokens(text: str) -> int:
    """Rough token count (chars / 4), the same rule everywhere so figures are reproducible."""
    return (len(text) + _CHARS_PER_TOKEN - 1) // _CHARS_PER_TOKEN


def _user_texts(message: dict) -> list[str]:
    """Texts of a user message that may carry a marker (tool results are ignored on purpose:
    a tool that prints a file containing a marker must not switch the script)."""
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
    return texts


def select_script_step(messages: list) -> tuple[str | None, int]:
    """Return (script id, step index) for a request's conversation; (None, 0) without marker.

    The last marker wins; the step is the number of assistant responses (runs of consecutive
    assistant messages count once, in case a client splits one response) that come after
    the first user message carrying that marker.
    """
    found: list[tuple[int, str]] = []
    for index, message in enumerate(messages or []):
        if not isinstance(message, dict) or message.get("role") != "user":
            continue
        for text in _user_texts(message):
            for match in SCRIPT_MARKER_RE.finditer(text):
                found.append((index, match.group(1)))
    if not found:
        return None, 0
    script_id = found[-1][1]
    first = min(index for index, sid in found if sid == script_id)
    step = 0
    previous_role = None
    for message in messages[first + 1:]:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant" and previous_role != "assistant":
            step += 1
        previous_role = role
    return script_id, step


def validate_script(script: Any, script_id: str = "?") -> dict:
    """Check a script's shape; raise AgentbenchError naming the first problem."""
    if not isinstance(script, dict):
        raise AgentbenchError("script must be a JSON object", code="script_json_object", script=script_id)
    steps = script.get("steps")
    if not isinstance(steps, list):
        raise AgentbenchError("script needs a 'steps' list", code="script_needs_steps_list", script=script_id)
    if script.get("model") is not None and not isinstance(script.get("model"), str):
        raise AgentbenchError("script 'model' must be a string", code="script_model_string", script=script_id)
    for number, step in enumerate(steps):
        where = {"script": script_id, "step": number}
        if not isinstance(step, dict):
            raise AgentbenchError("script step must be an object", code="script_step_object", **where)
        if "text" in step and not isinstance(step["text"], str):
            raise AgentbenchError("step 'text' must be a string", code="step_text_string", **where)
        uses = step.get("tool_uses", [])
        if not isinstance(uses, list):
            raise AgentbenchError("step 'tool_uses' must be a list", code="step_tool_uses_list", **where)
        for use in uses:
            if not isinstance(use, dict) or not isinstance(use.get("name"), str) \
                    or not isinstance(use.get("input", {}), dict):
                raise AgentbenchError("tool use needs a 'name' string and an 'input' object",
                                      code="tool_use_needs_name_string", **where)
        fault = step.get("fault")
        if fault is not None and str(fault) not in SCRIPT_FAULTS:
            raise AgentbenchError("unknown step fault", code="unknown_step_fault",
                                  fault=fault, known=list(SCRIPT_FAULTS), **where)
        usage = step.get("usage", {})
        if not isinstance(usage, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in usage.values()):
            raise AgentbenchError("step 'usage' must map names to non-negative integers",
                                  code="step_usage_map_names_non", **where)
        unknown = sorted(set(usage) - set(USAGE_OVERRIDE_KEYS))
        if unknown:
            raise AgentbenchError("unknown step 'usage' keys", code="unknown_step_usage_keys",
                                  keys=unknown, known=list(USAGE_OVERRIDE_KEYS), **where)
        if "fault_times" in step and not (isinstance(step["fault_times"], int) and step["fault_times"] >= 0):
            raise AgentbenchError("step 'fault_times' must be a non-negative integer",
                                  code="step_fault_times_non_negative", **where)
    return script


def _without_cache_control(value: Any) -> Any:
    """A copy of a JSON value with every cache_control key removed: the client moves its cache
    breakpoints from request to request, but the cached content is what must match."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def _cache_key_blocks(body: dict) -> list[str]:
    """Serialised prompt units in cache order: [tools+system, message 0, message 1, ...].

    The billing header line in the system prompt is left out of the key (it carries a client
    fingerprint that may change between requests, and the real service does not let it break
    the cache)."""
    system = body.get("system")
    if isinstance(system, list):
        system = [b for b in system
                  if not (isinstance(b, dict)
                          and str(b.get("text", "")).startswith("x-anthropic-billing-header"))]
    head = json.dumps(_without_cache_control({"tools": body.get("tools"), "system": system}), sort_keys=True)
    units = [head]
    for message in body.get("messages") or []:
        units.append(json.dumps(_without_cache_control(message), sort_keys=True))
    return units


def _has_cache_control(unit: Any) -> str | None:
    """Return the TTL ('5m'/'1h') of the last cache_control found inside a JSON value, or None."""
    found: str | None = None
    if isinstance(unit, dict):
        control = unit.get("cache_control")
        if isinstance(control, dict):
            found = "1h" if control.get("ttl") == "1h" else "5m"
        for value in unit.values():
            inner = _has_cache_control(value)
            if inner:
                found = inner
    elif isinstance(unit, list):
        for value in unit:
            inner = _has_cache_control(value)
            if inner:
                found = inner
    return found


#: Prompt-cache lifetimes by the `ttl` of a cache_control marker (the default is 5 minutes).
PROMPT_CACHE_TTL_S = {"5m": 300.0, "1h": 3600.0}


class _PromptCache:
    """A tiny model of the service's prompt cache: prefixes (by hash) seen up to a breakpoint.

    An entry lives for its TTL (5 minutes or 1 hour, times `ttl_scale`) after it was last written
    or read: every request refreshes the prefix up to its breakpoint, as the service does, so a
    base kept warm by pings stays cached and one left alone goes cold.  `clock` is replaceable
    (tests); `ttl_scale` shortens the lifetimes for rehearsing keep-warm behaviour quickly."""

    def __init__(self, ttl_scale: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not (ttl_scale > 0 and math.isfinite(ttl_scale)):
            raise ValueError(f"ttl_scale must be a positive number, got {ttl_scale!r}")
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}        # prefix hash -> expiry on self._clock
        self._ttl_scale = ttl_scale
        self._clock = clock

    def usage_for(self, body: dict) -> dict:
        units = _cache_key_blocks(body)
        tokens = [_estimate_tokens(u) for u in units]
        cumulative = []
        running = 0
        for count in tokens:
            running += count
            cumulative.append(running)
        total = cumulative[-1]
        # The breakpoint: the last unit (tools+system or a message) that carries cache_control.
        breakpoint_index = -1
        ttl = "5m"
        pieces: list[Any] = [{"tools": body.get("tools"), "system": body.get("system")}]
        pieces += list(body.get("messages") or [])
        for index, piece in enumerate(pieces):
            found = _has_cache_control(piece)
            if found:
                breakpoint_index, ttl = index, found
        hashes = []
        digest = hashlib.sha256()
        for unit in units:
            digest.update(unit.encode("utf-8", "replace"))
            digest.update(b"\x00")
            hashes.append(digest.copy().hexdigest())
        with self._lock:
            now = self._clock()
            if len(self._seen) > 4096:
                self._seen = {h: exp for h, exp in self._seen.items() if exp > now}
            read_upto = -1
            for index in range(min(breakpoint_index, len(units) - 1), -1, -1):
                if self._seen.get(hashes[index], -math.inf) > now:
                    read_upto = index
                    break
            # Written or refreshed: a longer life already granted (a 1h entry) is not cut short.
            expiry = now + PROMPT_CACHE_TTL_S.get(ttl, PROMPT_CACHE_TTL_S["5m"]) * self._ttl_scale
            for index in range(0, breakpoint_index + 1):
                self._seen[hashes[index]] = max(self._seen.get(hashes[index], -math.inf), expiry)
        cache_read = cumulative[read_upto] if read_upto >= 0 else 0
        cached_total = cumulative[breakpoint_index] if breakpoint_index >= 0 else 0
        creation = max(0, cached_total - cache_read)
        return {
            "input_tokens": max(0, total - cached_total),
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": cache_read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": creation if ttl == "5m" else 0,
                "ephemeral_1h_input_tokens": creation if ttl == "1h" else 0,
            },
        }


def _apply_usage_override(usage: dict, override: dict) -> dict:
    """Replace estimated figures with a step's explicit ones (and keep the 1h/5m split coherent)."""
    result = json.loads(json.dumps(usage))
    for key in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"):
        if key in override:
            result[key] = int(override[key])
    split = result.setdefault("cache_creation",
                              {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0})
    if "ephemeral_5m_input_tokens" in override or "ephemeral_1h_input_tokens" in override:
        split["ephemeral_5m_input_tokens"] = int(override.get("ephemeral_5m_input_tokens", 0))
        split["ephemeral_1h_input_tokens"] = int(override.get("ephemeral_1h_input_tokens", 0))
        if "cache_creation_input_tokens" not in override:
            result["cache_creation_input_tokens"] = (split["ephemeral_5m_input_tokens"]
                                                     + split["ephemeral_1h_input_tokens"])
    elif "cache_creation_input_tokens" in override:
        creation = result["cache_creation_input_tokens"]
        if split.get("ephemeral_1h_input_tokens") and not split.get("ephemeral_5m_input_tokens"):
            split["ephemeral_1h_input_tokens"], split["ephemeral_5m_input_tokens"] = creation, 0
        else:
            split["ephemeral_5m_input_tokens"], split["ephemeral_1h_input_tokens"] = creation, 0
    return result


class ScriptedModelHandler:
    """The request handler of the scripted model, as a mixin over http.server's (joined where a
    server starts, so that importing this file does not import http.server): the Messages API as
    `claude` uses it (streamed or not), count_tokens, and the scripted faults.  `model` is the
    ScriptedModelServer it answers for."""

    model: Any = None
    protocol_version = "HTTP/1.1"
    server_version = "agentbench-scripted-model"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        return  # quiet: the binary polls; nothing useful for stderr

    def setup(self) -> None:
        super().setup()
        with self.model._lock:
            self.model._open_sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.model._lock:
                self.model._open_sockets.discard(self.connection)

    def do_GET(self) -> None:
        self._read_body()
        self.model._log({"path": self.path, "method": "GET", "script": None, "step": None,
                     "kind": "other"})
        self._send_json(200, {})

    def do_HEAD(self) -> None:
        self.model._log({"path": self.path, "method": "HEAD", "script": None, "step": None,
                     "kind": "other"})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        raw = self._read_body()
        path = urllib.parse.urlsplit(self.path).path.rstrip("/")
        try:
            body = json.loads(raw.decode("utf-8")) if raw else {}
        except ValueError:
            body = None
        if path == "/v1/messages/count_tokens":
            tokens = sum(_estimate_tokens(u) for u in _cache_key_blocks(body or {}))
            self.model._log({"path": self.path, "method": "POST", "script": None, "step": None,
                         "kind": "count_tokens"})
            self._send_json(200, {"input_tokens": tokens})
            return
        if path != "/v1/messages":
            self.model._log({"path": self.path, "method": "POST", "script": None, "step": None,
                         "kind": "other"})
            self._send_error(404, "not_found_error", f"no such endpoint: {path}")
            return
        if not isinstance(body, dict):
            self.model._log({"path": self.path, "method": "POST", "script": None, "step": None,
                         "kind": "bad_request"})
            self._send_error(400, "invalid_request_error", "request body is not a JSON object")
            return
        session = self.headers.get("X-Claude-Code-Session-Id", "")
        plan = self.model.plan(body, session)
        entry = {"path": self.path, "method": "POST", "script": plan["script"], "step": plan["step"],
                 "kind": plan["kind"], "fault": plan["fault"], "session": session,
                 "model": body.get("model"), "stream": bool(body.get("stream")),
                 "tools": len(body.get("tools") or [])}
        if self.model.capture_bodies:
            entry["body"] = body
            entry["headers"] = dict(self.headers)
        self.model._log(entry)
        if plan["kind"] == "unknown_script":
            self._send_error(400, "invalid_request_error",
                             "agentbench scripted model: unknown or invalid script "
                             f"{plan['script']!r}: "
                             + self.model.script_problem(str(plan["script"])))
            return
        usage = self.model.usage_for(body, plan)
        if plan["fault"]:
            self._fault(plan, usage, body)
            return
        if body.get("stream"):
            self._send_stream(plan, usage)
        else:
            self._send_message(plan, usage)

    # -- helpers ---------------------------------------------------------------------------
    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("request-id", "req_" + secrets.token_hex(12))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_error(self, status: int, kind: str, message: str, headers: dict | None = None) -> None:
        self._send_json(status, {"type": "error", "error": {"type": kind, "message": message},
                                 "request_id": "req_" + secrets.token_hex(12)}, headers)

    def _message(self, plan: dict, usage: dict) -> dict:
        return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
                "model": plan["model"], "content": plan["content"],
                "stop_reason": plan["stop_reason"],
                "stop_sequence": None, "usage": usage}

    def _send_message(self, plan: dict, usage: dict) -> None:
        self._send_json(200, self._message(plan, usage))

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("request-id", "req_" + secrets.token_hex(12))
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def _event(self, name: str, data: dict) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode("utf-8"))
        self.wfile.flush()

    def _stream_events(self, plan: dict, usage: dict) -> list[tuple[str, dict]]:
        message = self._message(plan, usage)
        start_usage = dict(usage)
        start_usage["output_tokens"] = 1  # like the service: the true count comes at the end
        message.update({"content": [], "stop_reason": None, "usage": start_usage})
        events: list[tuple[str, dict]] = [
            ("message_start", {"type": "message_start", "message": message})]
        for index, block in enumerate(plan["content"]):
            if block["type"] == "text":
                events.append(("content_block_start",
                               {"type": "content_block_start", "index": index,
                                "content_block": {"type": "text", "text": ""}}))
                text = block["text"]
                half = max(1, len(text) // 2)
                for piece in (text[:half], text[half:]):
                    if piece:
                        events.append(("content_block_delta", {
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "text_delta", "text": piece}}))
            else:
                events.append(("content_block_start", {
                    "type": "content_block_start", "index": index,
                    "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"],
                                      "input": {}}}))
                encoded = json.dumps(block["input"])
                cut = max(1, len(encoded) // 2)
                for piece in (encoded[:cut], encoded[cut:]):
                    if piece:
                        events.append(("content_block_delta", {
                            "type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": piece}}))
            events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        events.append(("message_delta",
                       {"type": "message_delta",
                        "delta": {"stop_reason": plan["stop_reason"], "stop_sequence": None},
                        "usage": {"output_tokens": usage["output_tokens"]}}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _send_stream(self, plan: dict, usage: dict) -> None:
        self._start_stream()
        try:
            for name, data in self._stream_events(plan, usage):
                self._event(name, data)
        except OSError:
            pass  # the client went away; nothing to answer to

    def _fault(self, plan: dict, usage: dict, body: dict) -> None:
        fault = plan["fault"]
        if fault == "429":
            self._send_error(429, "rate_limit_error",
                             "Number of request tokens has exceeded your per-minute rate limit "
                             "(agentbench scripted fault)", {"retry-after": "1",
                                                              "x-should-retry": "true"})
        elif fault == "529":
            self._send_error(529, "overloaded_error", "Overloaded (agentbench scripted fault)",
                             {"retry-after": "1", "x-should-retry": "true"})
        elif fault == "500":
            self._send_error(500, "api_error", "Internal server error (agentbench scripted fault)")
        elif fault == "prompt_too_long":
            total = sum(_estimate_tokens(u) for u in _cache_key_blocks(body))
            self._send_error(400, "invalid_request_error",
                             f"prompt is too long: {max(total, 200001)} tokens > 200000 maximum")
        elif fault == "hang":
            # Hold the request without a byte of answer until the server stops or the
            # client gives up (then the thread is released instead of piling up).
            self.close_connection = True
            while not self.model._stopping.wait(0.25):
                if self._peer_closed():
                    break
        elif not body.get("stream") and fault in ("overloaded", "cut", "malformed"):
            self._fault_not_streaming(fault, plan, usage)
        elif fault == "overloaded":
            self._start_stream()
            try:
                events = self._stream_events(plan, usage)
                self._event(*events[0])
                self._event("error", {"type": "error", "error": {
                    "type": "overloaded_error", "message": "Overloaded (agentbench scripted fault)"}})
            except OSError:
                pass
        elif fault == "cut":
            self._start_stream()
            try:
                events = self._stream_events(plan, usage)
                for name, data in events[:3]:
                    self._event(name, data)
                # Half an event, then an abrupt close (no message_stop ever arrives).
                self.wfile.write(b"event: content_block_delta\ndata: {\"type\": \"content_blo")
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        elif fault == "malformed":
            self._start_stream()
            try:
                self.wfile.write(b"event: message_start\ndata: {this is not json\n\n"
                                 b"data: \x00\x01 garbage\n\nevent: ???\ndata: [[[\n\n")
                self.wfile.flush()
            except OSError:
                pass

    def _peer_closed(self) -> bool:
        """True when the client closed its end (readable with no data)."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            if not ready:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _fault_not_streaming(self, fault: str, plan: dict, usage: dict) -> None:
        """The stream faults for a non-streaming request (the binary's fallback after a
        failed stream): 529 overloaded, a body cut short, or a body that is not JSON."""
        if fault == "overloaded":
            self._send_error(529, "overloaded_error", "Overloaded (agentbench scripted fault)",
                             {"retry-after": "1"})
            return
        data = json.dumps(self._message(plan, usage)).encode("utf-8")
        if fault == "malformed":
            data = b"{this is not json" + data[:40]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.close_connection = True
        try:
            if fault == "cut":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            else:
                self.wfile.write(data)
                self.wfile.flush()
        except OSError:
            pass


class ScriptedModelServer:
    """Loopback Messages API server answering scripted turns (see the section comment).

    start() binds 127.0.0.1 (port 0 = any free port) and serves from a daemon thread; stop()
    releases every request, including hung ones, and closes the socket.  Thread-safe: many
    `claude` processes may use one server at once; each conversation selects its own script.
    """

    def __init__(self, scripts_dir: "str | os.PathLike | None" = None, cache_ttl_scale: float = 1.0,
                 cache_clock: Callable[[], float] = time.monotonic) -> None:
        self.scripts_dir = Path(scripts_dir) if scripts_dir is not None else None
        self._scripts: dict[str, dict] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._attempts: dict[tuple, int] = {}
        self._cache = _PromptCache(cache_ttl_scale, cache_clock)
        self._open_sockets: set[socket.socket] = set()
        self.requests_log: list[dict] = []
        # When true, messages log entries also keep the parsed request body and headers (tests).
        self.capture_bodies = False
        self.port: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self, port: int = 0) -> int:
        """Bind 127.0.0.1:port, serve in a daemon thread, return the bound port."""
        if self._httpd is not None:
            raise AgentbenchError("scripted model server already started",
                                  code="scripted_model_server_already_started", port=self.port)
        handler = self._make_handler()
        try:
            httpd = http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), handler)
        except OSError as exc:
            raise AgentbenchError("cannot start the scripted model server",
                                  code="cannot_start_scripted_model_server", port=port, detail=str(exc),
                                  hint="pick another --port or 0 for any free port") from exc
        httpd.daemon_threads = True
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._stopping.clear()
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="agentbench-scripted-model", daemon=True)
        self._thread.start()
        return self.port

    @property
    def url(self) -> str:
        if self.port is None:
            raise AgentbenchError("scripted model server not started",
                                  code="scripted_model_server_not_started")
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop serving; wake hung handlers and drop open connections so nothing blocks."""
        httpd = self._httpd
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        with self._lock:
            open_sockets = list(self._open_sockets)
        for sock in open_sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> "ScriptedModelServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- scripts -----------------------------------------------------------------------------------
    def add_script(self, script_id: str, script: dict) -> None:
        """Register a script in memory (wins over a file of the same id)."""
        if not SCRIPT_ID_RE.fullmatch(script_id or ""):
            raise AgentbenchError("bad script id", code="bad_script_id",
                                  script=script_id, allowed="[A-Za-z0-9_.-]+")
        validate_script(script, script_id)
        with self._lock:
            self._scripts[script_id] = script

    def get_script(self, script_id: str) -> dict | None:
        """The script for an id: in memory first, else <scripts_dir>/<id>.json read now
        (read on every request, so another process can register or replace scripts; such a
        writer must write atomically — temp file + rename — or a request may see half a file,
        which counts as an unknown script)."""
        with self._lock:
            script = self._scripts.get(script_id)
        if script is not None:
            return script
        if self.scripts_dir is None or not SCRIPT_ID_RE.fullmatch(script_id):
            return None
        path = self.scripts_dir / f"{script_id}.json"
        try:
            script = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        try:
            return validate_script(script, script_id)
        except AgentbenchError:
            return None

    def script_problem(self, script_id: str) -> str:
        """Why get_script() found no script for this id, in words (for the error answer)."""
        if self.scripts_dir is None or not SCRIPT_ID_RE.fullmatch(script_id or ""):
            return "no such script registered"
        path = self.scripts_dir / f"{script_id}.json"
        try:
            script = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return f"no file {path}"
        except (OSError, ValueError) as exc:
            return f"{path}: {exc}"
        try:
            validate_script(script, script_id)
        except AgentbenchError as exc:
            return f"{path}: {exc.one_line()}"
        return "it is valid now (it was written while being read)"

    # -- request → answer plan ---------------------------------------------------------------------
    def plan(self, body: dict, session: str = "") -> dict:
        """Decide the answer for a messages request (pure apart from the fault-attempt counter).

        Returns {"kind": "side"|"step"|"exhausted"|"unknown_script", "script", "step",
        "content": [blocks], "stop_reason", "model", "fault", "usage_override"}.
        """
        messages = body.get("messages") if isinstance(body.get("messages"), list) else []
        request_model = str(body.get("model") or "claude-scripted")
        script_id, step_index = select_script_step(messages)
        plan: dict = {"kind": "side", "script": script_id, "step": step_index, "model": request_model,
                      "fault": None, "usage_override": {},
                      "content": [{"type": "text", "text": SIDE_ANSWER_TEXT}], "stop_reason": "end_turn"}
        if script_id is None or not body.get("tools"):
            # Side requests (titles, summaries, quota probes) carry no tools: a plain answer.
            return plan
        script = self.get_script(script_id)
        if script is None:
            plan["kind"] = "unknown_script"
            return plan
        steps = script.get("steps") or []
        if script.get("model"):
            plan["model"] = script["model"]
        loop_at = next((i for i, s in enumerate(steps) if s.get("loop")), None)
        chosen = loop_at if loop_at is not None and step_index >= loop_at else step_index
        if chosen >= len(steps):
            plan["kind"] = "exhausted"
            plan["content"] = [{"type": "text", "text": EXHAUSTED_ANSWER_TEXT}]
            return plan
        step = steps[chosen]
        plan["kind"] = "step"
        if step.get("model"):
            plan["model"] = step["model"]
        content: list[dict] = []
        if step.get("text"):
            content.append({"type": "text", "text": step["text"]})
        for use in step.get("tool_uses") or []:
            content.append({"type": "tool_use", "id": "toolu_" + secrets.token_hex(12),
                            "name": use["name"], "input": use.get("input", {})})
        if not content:
            content.append({"type": "text", "text": EXHAUSTED_ANSWER_TEXT})
        plan["content"] = content
        plan["stop_reason"] = "tool_use" if step.get("tool_uses") else "end_turn"
        plan["usage_override"] = dict(step.get("usage") or {})
        fault = step.get("fault")
        if fault is not None:
            key = (session, script_id, step_index)
            with self._lock:
                attempt = self._attempts.get(key, 0)
                self._attempts[key] = attempt + 1
            limit = step.get("fault_times")
            if limit is None or attempt < int(limit):
                plan["fault"] = str(fault)
        return plan

    def usage_for(self, body: dict, plan: dict) -> dict:
        """Usage figures for an answer: cache model estimate, then the step's overrides."""
        usage = self._cache.usage_for(body)
        out_text = json.dumps(plan.get("content") or [])
        usage["output_tokens"] = max(1, _estimate_tokens(out_text))
        return _apply_usage_override(usage, plan.get("usage_override") or {})

    def _log(self, entry: dict) -> None:
        with self._lock:
            self.requests_log.append(entry)

    # -- HTTP --------------------------------------------------------------------------------------
    def _make_handler(self) -> type:
        return type("Handler", (ScriptedModelHandler, http.server.BaseHTTPRequestHandler), {"model": self})


def run_scripted_model_server(port: int, scripts_dir: str, ready: Callable[[dict], None],
                              cache_ttl_scale: float = 1.0) -> None:
    """Serve scripts from scripts_dir on 127.0.0.1:port (0 = any) until SIGTERM/SIGINT.

    Calls ready({"url", "port", "scripts_dir"}) once listening, then blocks.  Signal handlers are
    only installed from the main thread (elsewhere the caller stops us via KeyboardInterrupt)."""
    server = ScriptedModelServer(scripts_dir, cache_ttl_scale)
    server.start(port)
    done = threading.Event()
    previous: dict = {}

    def _on_signal(signum: int, frame: Any) -> None:
        done.set()

    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGINT"):
            signum = getattr(signal, name, None)
            if signum is not None:
                previous[signum] = signal.signal(signum, _on_signal)
    try:
        ready({"url": server.url, "port": server.port, "scripts_dir": str(Path(scripts_dir).resolve())})
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# ==================================================================================================
# The scripted model: rehearsal of a study
# ==================================================================================================
# Scripts that make the real `claude` binary solve each task the way an agent would: read the task,
# (for gated arms) submit a partial overlay first so that gate feedback really happens, then read
# and write the reference files through real Read/Write tool calls, run the public tests through
# Bash, end the turn; a reviewer that really writes review.json.  rehearse_study() runs the whole
# pipeline in a scratch copy of the study, so a rehearsal never touches the study's own runs.

REHEARSAL_BEHAVIOURS = ("solve", "game_tests", "peek_oracle", "budget_burn", "rate_limited", "idle")


def _overlay_files(root: Path) -> list[str]:
    return sorted(tree_manifest(root, UNCAPPED)) if root.is_dir() else []


def _read_steps(ws: str, rels: Iterable[str]) -> list[dict[str, Any]]:
    """One step that reads every listed file (the Write tool refuses files not read first)."""
    uses = [{"name": "Read", "input": {"file_path": os.path.join(ws, r)}} for r in rels]
    return [{"text": "Reading the files I will change.", "tool_uses": uses}] if uses else []


def _write_step(ws: str, root: Path, rels: Iterable[str], text: str) -> dict[str, Any]:
    uses = [{"name": "Write", "input": {"file_path": os.path.join(ws, r),
                                         "content": (root / r).read_text(encoding="utf-8")}} for r in rels]
    return {"text": text, "tool_uses": uses}


def _test_step(ws: str) -> dict[str, Any]:
    cmd = ("python3 -m unittest discover -s tests 2>&1 | tail -n 5"
           if os.path.isdir(os.path.join(ws, "tests")) else "ls -la")
    return {"text": "Running the public checks.",
            "tool_uses": [{"name": "Bash", "input": {"command": cmd, "description": "run the public tests"}}]}


def executor_script(task: Task, arm: Arm, ws: str, behaviour: str = "solve") -> dict[str, Any]:
    """The executor's scripted steps across all its turns (first prompt, feedback, repair)."""
    public = set(task.public_manifest)
    ref = _overlay_files(task.reference_files)
    partial = _overlay_files(task.partial)
    steps: list[dict[str, Any]] = [{"text": "Reading the task.",
                                    "tool_uses": [{"name": "Read",
                                                   "input": {"file_path": os.path.join(ws, "TASK.md")}}]}]
    if behaviour == "idle":
        return {"steps": [{"text": "Done."}]}
    if behaviour == "rate_limited":
        return {"steps": [{"fault": "429"}]}
    if behaviour == "budget_burn":
        big = {"input_tokens": 400000, "output_tokens": 60000}
        return {"steps": [{**steps[0], "usage": big}, {"text": "Still thinking.", "usage": big, "loop": True,
                "tool_uses": [{"name": "Bash", "input": {"command": "true"}}]}]}
    if behaviour == "peek_oracle":
        steps.append({"text": "Looking around.", "tool_uses": [
            {"name": "Read", "input": {"file_path": str(task.root / "oracle" / "run.py")}}]})
    if behaviour == "game_tests":
        tests = sorted(r for r in public if r.startswith("tests/") and r.endswith(".py"))
        steps += _read_steps(ws, tests)
        uses = [{"name": "Write", "input": {"file_path": os.path.join(ws, t), "content":
                 "import unittest\n\n\nclass Passing(unittest.TestCase):\n"
                 "    def test_ok(self):\n        self.assertTrue(True)\n"}}
                for t in tests]
        steps.append({"text": "Simplifying the tests.", "tool_uses": uses})
        steps.append(_test_step(ws))
        steps.append({"text": "All tests pass."})
        return {"steps": steps}
    known = set(public)
    if arm.gate_cycles and partial:
        steps += _read_steps(ws, [r for r in partial if r in known])
        steps.append(_write_step(ws, task.partial, partial, "A first version."))
        steps.append({"text": "I wrote a first version; it may not cover every case yet."})
        known |= set(partial)
    steps += _read_steps(ws, [r for r in ref if r in known])
    steps.append(_write_step(ws, task.reference_files, ref, "Writing the solution."))
    steps.append(_test_step(ws))
    steps.append({"text": "Done: the solution is written and the public tests pass."})
    if arm.review:
        steps.append(_test_step(ws))
        steps.append({"text": "I checked the reviewer's findings; the tests still pass."})
    return {"steps": steps}


def reviewer_script(task: Task, work_dir: str, review_path: str, verdict: str) -> dict[str, Any]:
    files = _overlay_files(task.reference_files) or sorted(task.public_manifest)
    review = {"verdict": verdict,
              "findings": ([{"severity": "minor", "file": files[0],
                             "detail": "Re-run the public tests and confirm the edge cases named in "
                                       "TASK.md."}]
                           if verdict == "revise" else []),
              "summary": "The change reads correctly." if verdict == "accept"
                         else "Mostly right; confirm the edge cases before finishing."}
    return {"steps": [
        {"text": "Reading the work.",
         "tool_uses": [{"name": "Read", "input": {"file_path": os.path.join(work_dir, files[0])}}]},
        {"text": "Writing my review.",
         "tool_uses": [{"name": "Write", "input": {"file_path": review_path,
                                                   "content": json.dumps(review, indent=1)}}]},
        {"text": f"Review written: {verdict}."}]}


class RehearsalScripts:
    """The `script_for` hook of the pipeline: registers a script per run and session family."""

    EXECUTOR_ROLES = ("executor", "resume", "gate_feedback", "repair")

    def __init__(self, server: "ScriptedModelServer", paths: StudyPaths, tasks: Mapping[str, Task],
                 arms: Mapping[str, Arm], behaviours: Mapping[str, str]):
        self.server = server
        self.paths = paths
        self.tasks = tasks
        self.arms = arms
        self.behaviours = dict(behaviours)
        self.lock = threading.Lock()

    def __call__(self, rec: dict[str, Any], role: str, attempt: int, key: str) -> str | None:
        run_id = rec["run_id"]
        task = self.tasks[rec["task"]]
        arm = self.arms[rec["arm"]]
        ws = str(self.paths.run_dir(run_id) / "workspace")
        with self.lock:
            if role in self.EXECUTOR_ROLES:
                sid = f"{run_id}-executor"
                if self.server.get_script(sid) is None:
                    behaviour = self.behaviours.get(run_id, "solve")
                    self.server.add_script(sid, executor_script(task, arm, ws, behaviour))
                return sid
            if role == "reviewer":
                n = len(rec.get("reviews") or []) + 1
                sid = f"{run_id}-review-{n}"
                rdir = self.paths.run_dir(run_id) / "review" / f"{n:02d}"
                verdict = "revise" if int(rec.get("repeat") or 1) % 2 == 1 else "accept"
                script = reviewer_script(task, str(rdir / "work"), str(rdir / "review.json"), verdict)
                self.server.add_script(sid, script)
                return sid
        return None


def scratch_study_config(paths: StudyPaths, cfg: Mapping[str, Any],
                         arms: Mapping[str, Arm]) -> dict[str, Any]:
    """The study's config with every path made absolute, for a scratch copy elsewhere."""
    out = copy.deepcopy(dict(cfg))
    out["tasks"] = str(tasks_dir(paths, cfg))
    for name, arm in arms.items():
        if arm.preamble_path:
            out["arms"][name]["preamble"] = arm.preamble_path
    for key in ("templates", "preamble"):
        if cfg.get(key) and not os.path.isabs(cfg[key]):
            out[key] = str(paths.root / cfg[key])
    if not cfg.get("preamble") and (paths.root / "preamble.md").is_file():
        out["preamble"] = str(paths.root / "preamble.md")
    if not cfg.get("templates") and (paths.root / "templates").is_dir():
        out["templates"] = str(paths.root / "templates")
    return out


def rehearsal_summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per arm: runs, successes, gate cycles used, reviewer sessions and verdicts, cost."""
    out: dict[str, Any] = {}
    for r in runs:
        a = out.setdefault(r["arm"], {"runs": 0, "successes": 0, "gate_cycles": 0, "reviews": 0,
                                      "verdicts": {}, "cost_usd": 0.0, "outcomes": {}})
        a["runs"] += 1
        a["successes"] += 1 if (r.get("evaluation") or {}).get("success") else 0
        a["gate_cycles"] += int(r.get("gate_cycles") or 0)
        a["reviews"] += len(r.get("reviews") or [])
        for v in r.get("review_verdicts") or []:
            a["verdicts"][v] = a["verdicts"].get(v, 0) + 1
        a["cost_usd"] = round(a["cost_usd"] + float(r.get("cost_usd") or 0), 6)
        o = str(r.get("outcome"))
        a["outcomes"][o] = a["outcomes"].get(o, 0) + 1
    return dict(sorted(out.items()))


def train_rehearsal_base(ctx: Host, paths: StudyPaths, cfg: Mapping[str, Any], task: Task,
                         server: "ScriptedModelServer", env_extra: Mapping[str, str],
                         driver: Mapping[str, Any] | None) -> None:
    """Train the per-task base that `fork_base` arms fork from: the scripted agent reads the task
    and writes notes, through the same job path as `train --task`."""
    ws = paths.bases / task.id / "workspace"
    copy_tree(task.public, ws)
    sid = f"train-{task.id}"
    server.add_script(sid, {"steps": [
        {"text": "Reading the task.",
         "tool_uses": [{"name": "Read", "input": {"file_path": str(ws / "TASK.md")}}]},
        {"text": "Writing notes.", "tool_uses": [{"name": "Write", "input": {
            "file_path": str(ws / "NOTES.md"),
            "content": f"Notes on {task.title}: read TASK.md and the tests.\n"}}]},
        {"text": "Notes written; ready."}]})
    prompt = render(load_templates(paths, cfg)["train_base"], task_title=task.title,
                    task_text=task_text(task), notes_path="NOTES.md") + f"\n\n[agentbench-script:{sid}]\n"
    launch = launch_config(cfg)
    usd_per_run = launch["budget"].get("usd_per_run") or DEFAULT_BUDGET["usd_per_run"]
    limits = session_limits(launch, wall_s=TRAIN_REHEARSAL_WALL_S,
                            stall_after_s=TRAIN_REHEARSAL_STALL_AFTER_S, orphan_after_s=0,
                            max_budget_usd=float(usd_per_run))
    out = start_job(ctx, paths, kind="train", prompt=prompt, cwd=str(ws), session_id=None, resume=None,
                    fork=False, prior={}, limits=limits, meta={"base": task.id}, env_extra=env_extra,
                    driver=driver, cfg=cfg)
    register_base(paths, task.id, out, ws)
    while not job_is_final(paths, out["job_id"]):
        time.sleep(0.2)
        reap_jobs(paths, ctx.platform, only=[out["job_id"]], env=ctx.env)


def rehearse_study(ctx: Host, paths: StudyPaths, *, scratch: Path, parallel: int, repeats: int | None,
                   behaviours: Mapping[str, str] | None = None, faults: Mapping[str, str] | None = None,
                   progress: Callable[[str], None] | None = None, executor: str | None = None,
                   private_home: bool = False,
                   calibration: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the whole study, offline, against the scripted model, in the scratch study `scratch`.

    `calibration`: results the caller has just measured for these tasks (the demo's); each one
    still true of its task (see calibration_to_reuse) is reused instead of calibrating again.

    `private_home` gives the sessions a HOME of their own inside the scratch study (the demo's
    choice): then nothing of the user's dotfiles, which `claude` runs in a login shell before its
    first tool call, can slow or change the sessions, and the sessions write nothing there.

    The rehearsal uses the study's executor unless `executor` overrides it.  The scripted model
    listens on this machine's loopback, so a Slurm rehearsal needs its jobs to run on this machine
    (a one-node cluster); on a multi-node cluster rehearse with the local executor.
    """
    cfg = load_study_config(paths)
    tasks = load_tasks(paths, cfg)
    arms = load_arms(paths, cfg)
    load_templates(paths, cfg)
    chash = config_hash(paths, cfg)
    validate_launch_values(cfg)
    require_executor_ready(executor or cfg.get("executor"), ctx.env)
    if (scratch / STUDY_FILE).exists() or (scratch.exists() and any(scratch.iterdir())):
        raise AgentbenchError("the rehearsal directory is not empty", code="rehearsal_directory_not_empty",
                              dir=str(scratch),
                              hint="pass --dir with a new directory, or remove the old rehearsal")
    scfg = scratch_study_config(paths, cfg, arms)
    scfg["parallel"] = max(int(scfg.get("parallel") or 1), parallel)
    if executor:
        scfg["executor"] = executor
    if repeats:
        scfg["repeats"] = repeats
    sp = StudyPaths(scratch)
    sp.state.mkdir(parents=True, exist_ok=True)
    write_json_atomic(sp.study_file, scfg, sort_keys=False)   # arm order: the baseline
    write_json_atomic(sp.registry, read_registry(sp))
    reuse = calibration_to_reuse(calibration, tasks)
    cal = {t.id: reuse.get(t.id) or calibrate_task(sp, ctx.platform, t, ctx.env) for t in tasks.values()}
    write_json_atomic(sp.state / "calibration.json",
                      {"tasks": cal, "config_hash": config_hash(sp, scfg), "at": utc_now()})
    manifest = make_assignment(sorted(tasks), sorted(arms), int(scfg.get("repeats") or 1),
                               int(scfg.get("seed") or 0))
    fault_specs = {rid: parse_fault(f) for rid, f in (faults or {}).items()}
    register_runs(sp, manifest, int(scfg.get("seed") or 0), "main", fault_specs)
    server = ScriptedModelServer(str(sp.scripts))
    server.start()
    try:
        env_extra = {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "rehearsal-key-not-secret",
                     "CLAUDE_CONFIG_DIR": str(sp.state / "claude-config"), "CLAUDE_CODE_MAX_RETRIES": "0",
                     "API_TIMEOUT_MS": "120000", "AGENTBENCH_OFFLINE": "1"}
        if private_home:
            home = sp.state / "home"
            home.mkdir(parents=True, exist_ok=True)
            env_extra["HOME"] = str(home)
        driver = driver_record(ctx.platform, sp)
        with DriverBeat(driver):
            if any(a.fork_base for a in arms.values()):
                for t in tasks.values():
                    train_rehearsal_base(ctx, sp, scfg, t, server, env_extra, driver)
            solved = {k: reference_overlay(sp, ctx.platform, t, ctx.env) for k, t in tasks.items()}
            scripts = RehearsalScripts(server, sp, solved, arms, behaviours or {})
            opts = PipelineOptions(env_extra=env_extra, script_for=scripts,
                                   driver=driver, progress=progress, rehearsal=True)
            driven = drive_runs(ctx, sp, [r["run_id"] for r in manifest], opts, parallel)
    finally:
        server.stop()
    runs = [load_run(sp, r["run_id"]) for r in manifest]
    expected_ok = [r for r in runs if (behaviours or {}).get(r["run_id"], "solve") == "solve"
                   and r["run_id"] not in (faults or {})]
    breaker = read_registry(sp).get("breaker")
    problems = [{"run_id": r["run_id"], "status": r.get("status"), "outcome": r.get("outcome"),
                 "validity": r.get("validity"),
                 "error": r.get("error") or ("paused: the circuit breaker stopped new launches"
                                             if r["run_id"] in driven["paused"] else None)}
                for r in expected_ok if r.get("outcome") != "success" or r.get("validity") != "valid"]
    summary = rehearsal_summary(runs)
    # Every session went through its gateway (the scripted model was its upstream): one that
    # ended ok without a metered request reached the model some other way, and fails the proof.
    proof = gateway_proof(read_jsonl(sp.ledger)[0]) if launch_config(scfg)["gateway"] == "on" else None
    if proof and proof["unmetered_ok"]:
        problems.append({"error": "sessions ended ok without a request through their gateway",
                         "jobs": proof["unmetered_ok"]})
    # Runs the breaker left unrehearsed make it no pass; the record names the breaker's reason.
    record = {"ok": not problems and not driven["paused"], "config_hash": chash, "at": utc_now(),
              "scratch": str(scratch), "runs": len(runs), "problems": problems, "arms": summary,
              "breaker": breaker, "gateway": proof}
    if paths.state.is_dir() or paths.root.is_dir():
        write_json_atomic(paths.state / "rehearsal.json", record)
    return {**record, "paused": driven["paused"]}


# ==================================================================================================
# Reading at scale: the streamed ledger, paged listings, the paused collector
# ==================================================================================================
# How the read-only commands read what grows with a study (the ledger, run records, the job and run
# listings) in time and memory that stay close to the data's size.  It owns no format and decides
# nothing: the aggregates and summaries are the earlier sections' own functions, fed differently.


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (restored after, whatever happens): loading
    many small JSON records allocates only acyclic objects, and the collector's repeated passes
    over them cost more than the parse.  Reference counting still frees everything."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def iter_ledger_once_per_job(path: str | os.PathLike[str],
                             counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The ledger's object lines, one per job (the first line of a job id wins), read as a
    stream.  `counts` gets "lines" (yielded) and "torn" (unparseable or not an object), like
    read_jsonl.  Writers guarantee one line per job; a reader still counts each job once."""
    counts.setdefault("lines", 0)
    seen: set[str] = set()
    for obj in iter_jsonl(path, counts):
        job_id = str(obj.get("job_id"))
        if job_id in seen:
            continue
        seen.add(job_id)
        counts["lines"] += 1
        yield obj


# -- The runs summary: what `report` reads instead of every run record -----------------------------
# state/runs_summary.jsonl holds one line per run: its id, the stamp of its record file (inode,
# mtime in ns, size: a record is replaced by rename, so any rewrite changes the inode) and the
# record's report view (report_view_of_run).  It is a cache, never the truth: `report` checks
# every line against the record's current stamp (one stat per run, no read), reads again only the
# records whose stamp moved or that have no line, and appends lines for them.  A torn or garbled
# line, a missing file or a line older than its record therefore gives the same report as a fresh
# summary.  The file is compacted (rewritten atomically) when it holds more than twice as many
# lines as there are runs.  Nothing in it is ever believed over the record itself.

RUNS_SUMMARY_FILE = "runs_summary.jsonl"
#: The summary's format: a line of another version is stale.
RUNS_SUMMARY_VERSION = 1


def runs_summary_path(paths: StudyPaths) -> Path:
    return paths.state / RUNS_SUMMARY_FILE


def run_record_stamps(paths: StudyPaths) -> dict[str, list[int]]:
    """Run id -> [inode, mtime_ns, size] of every record file in the run index (lstat: a link is
    never followed, and a name that is not a run id is skipped)."""
    out: dict[str, list[int]] = {}
    try:
        it = os.scandir(paths.run_index)
    except (FileNotFoundError, NotADirectoryError):
        return out
    with it:
        for e in it:
            name = e.name
            if not name.endswith(".json") or name.startswith(".") or len(name) <= 5:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[name[:-5]] = [st.st_ino, st.st_mtime_ns, st.st_size]
    return out


def read_runs_summary(path: Path) -> tuple[dict[str, tuple[list[int], dict[str, Any]]], int]:
    """The summary's lines: run id -> (stamp, report view), the last line of an id winning, and
    how many lines the file has.  A line that is not a well-formed entry is skipped (its run is
    then read from its record)."""
    out: dict[str, tuple[list[int], dict[str, Any]]] = {}
    lines = 0
    try:
        data = path.read_bytes()
    except OSError:
        return out, 0
    loads = json.loads
    for raw in data.split(b"\n"):
        if not raw:
            continue
        lines += 1
        try:
            obj = loads(raw)
            rid, stamp, view = obj["id"], obj["stamp"], obj["run"]
        except (ValueError, TypeError, KeyError):
            continue
        if (obj.get("v") == RUNS_SUMMARY_VERSION and isinstance(rid, str) and isinstance(view, dict)
                and isinstance(stamp, list)):
            out[rid] = (stamp, view)
    return out, lines


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _summary_line(run_id: str, stamp: list[int], view: Mapping[str, Any]) -> str:
    return json.dumps({"v": RUNS_SUMMARY_VERSION, "id": run_id, "stamp": stamp, "run": view},
                      separators=(",", ":"), default=str) + "\n"


def report_runs(paths: StudyPaths, *, write: bool = True) -> list[dict[str, Any]]:
    """Every run's report view, in run id order, as `report` needs them: from the runs summary
    where its line matches the record's stamp, else from the record (and the summary brought up
    to date, unless `write` is false or the study cannot be written: the summary is only a
    cache).  The same list, item for item, as report_view_of_run over every record."""
    summary_file = runs_summary_path(paths)
    with gc_paused():
        stamps = run_record_stamps(paths)
        cached, lines = read_runs_summary(summary_file)
        out: list[dict[str, Any]] = []
        fresh: list[str] = []
        for rid in sorted(stamps):
            hit = cached.get(rid)
            stamp = stamps[rid]
            if hit is not None and hit[0] == stamp:
                out.append(hit[1])
                continue
            rec = read_json(run_file(paths, rid), default=None)
            if not isinstance(rec, dict):
                raise AgentbenchError("a run record cannot be read", code="run_record_unreadable",
                                      run=rid, path=str(run_file(paths, rid)))
            view = report_view_of_run(rec)
            out.append(view)
            fresh.append(_summary_line(rid, stamp, view))
    if write and (fresh or lines > 2 * max(len(stamps), 1)):
        with contextlib.suppress(OSError):
            if lines + len(fresh) > 2 * max(len(stamps), 1):
                # Compact: one line per run, written whole and renamed into place.
                write_text_atomic(summary_file, "".join(
                    _summary_line(rid, stamps[rid], view) for rid, view in zip(sorted(stamps), out)))
            else:
                with open(summary_file, "ab") as fh:
                    # After a torn last line (a crash mid-append), start on a line of our own.
                    torn = fh.tell() > 0 and not _ends_with_newline(summary_file)
                    fh.write((b"\n" if torn else b"") + "".join(fresh).encode("utf-8"))
    return out


def report_metering(paths: StudyPaths) -> dict[str, Any]:
    """The report's `metering`: the gateways' figures beside the binaries' own, per model (side
    models included), over every ledger line, and the jobs whose two figures disagree; one
    streamed pass (the ledger is never held in memory)."""
    counts: dict[str, int] = {}
    totals = usage_empty()
    mismatched: list[Any] = []
    with gc_paused():
        for line in iter_jsonl(paths.ledger, counts):
            usage_add(totals, usage_figures(line))
            if "cost_mismatch" in (line.get("flags") or []):
                mismatched.append(line.get("job_id"))
    totals = usage_finish(totals)
    return {"cost_metered_usd": totals["cost_metered_usd"], "cost_reported_usd": totals["cost_usd"],
            "metered_jobs": totals["metered_jobs"], "requests": totals["requests"],
            "models_metered": totals["models_metered"], "cost_mismatch_jobs": mismatched}


def page_bounds(total: int, offset: int, limit: int) -> tuple[int, int, int | None]:
    """(start, stop, next offset or None) of one page of `total` items."""
    if offset < 0 or limit < 0:
        raise AgentbenchError("--offset and --limit must be >= 0", code="bad_offset_limit", offset=offset,
                              limit=limit)
    start = min(offset, total)
    stop = min(total, start + limit)
    return start, stop, (stop if stop < total else None)


def list_runs_page(paths: StudyPaths, *, all_runs: bool, status: str | None, offset: int,
                   limit: int) -> tuple[list[dict[str, Any]], int, int | None]:
    """One page of list_runs: (summaries, how many in all, next offset or None).  Without a
    status filter only the page's records are read; with one, every candidate is."""
    if status is not None:
        runs = list_runs(paths, all_runs=all_runs, status=status)
        start, stop, nxt = page_bounds(len(runs), offset, limit)
        return runs[start:stop], len(runs), nxt
    ids = all_run_ids(paths) if all_runs else list_markers(paths.state / "running_runs")
    start, stop, nxt = page_bounds(len(ids), offset, limit)
    page = [run_summary(paths, r) for r in ids[start:stop] if run_file(paths, r).exists()]
    return page, len(ids), nxt


# ==================================================================================================
# Calibration and assignment: a study's tasks checked and its runs planned
# ==================================================================================================
# Owns `calibrate` (each task checked without a model, recorded with the study's config hash) and
# `assign` (the randomized manifest, its runs registered, faults named for runs, a power estimate
# priced from pilot runs or the rehearsal).  Takes a Host, a Study and plain values; it must not
# parse flags, print, read os.environ, or start sessions (that is the pipeline's API above).

def calibrate_study(host: Host, study: Study, only: Sequence[str] = ()) -> dict[str, Any]:
    """`calibrate`: each chosen task (default: all) checked without a model, recorded with the
    study's config hash; which tasks of the study are still uncalibrated."""
    paths = study.paths
    tasks = study.load_all().tasks
    chosen = pick_tasks(tasks, only)
    for t in chosen.values():
        refuse_bundle_symlinks(t.id, t.root)   # before anything runs or is written
    results = {t.id: calibrate_task(paths, host.platform, t, host.env) for t in chosen.values()}
    with RegistryLock(paths.lock, host.platform):
        state = calibration_state(paths)
        state.setdefault("tasks", {}).update(results)
        state["config_hash"] = study.hash
        state["at"] = utc_now()
        write_json_atomic(paths.state / "calibration.json", state)
    append_event(paths, "calibrated", tasks={k: v["ok"] for k, v in results.items()})
    return {"ok": all(r["ok"] for r in results.values()), "tasks": results,
            "uncalibrated": uncalibrated(paths, tasks)}


def plan_warnings(plan: Mapping[str, Any]) -> list[str]:
    """What a power plan's costs say against the study's cap, in words (pure)."""
    cap = plan.get("study_budget_usd")
    if not is_number(cap) or cap <= 0:
        return []
    out = []
    for key, what in (("cost_at_repeats", "the chosen"), ("cost_at_recommended_repeats", "the recommended")):
        got = plan.get(key) or {}
        usd = got.get("study_usd")
        if is_number(usd) and usd > cap:
            reps = got.get("repeats", plan.get("repeats"))
            out.append(f"at {what} {reps} repeats the study is expected to cost ${usd:.2f}, above its cap "
                       f"budget.study_usd = ${cap:.2f}: raise the cap (`init --study-usd`), aim at "
                       "a larger difference (`assign --power-delta`), or use fewer repeats "
                       "(`assign --repeats`)")
    return out


def analysis_plan_of_study(paths: StudyPaths) -> tuple[Any, str | None]:
    """The analysis plan `assign` wrote into the study's manifest, and where it was read: the
    manifest of split main, else the only manifest.  (None, None) when there is no such manifest
    or it holds no plan (assigned before plans were written); a manifest that is not valid JSON
    gives an unusable plan, which the report labels as such."""
    mdir = paths.state / "manifests"
    names = sorted(p.name for p in mdir.glob("*.json")) if mdir.is_dir() else []
    name = "main.json" if "main.json" in names else (names[0] if len(names) == 1 else None)
    if name is None:
        return None, None
    source = f"manifest of split {name[:-len('.json')]}"
    try:
        doc = read_json(mdir / name)
    except AgentbenchError:
        return {"schema": None}, source
    if not isinstance(doc, dict) or "analysis_plan" not in doc:
        return None, None
    return doc["analysis_plan"], source


def pilot_clustering(study: Study, split: str) -> dict[str, Any]:
    """Between-task standard deviations for the power simulation, from the study's pilot: the
    evaluated real runs of other splits (not rehearsed).  Of the baseline's (the first arm's) rate,
    and of each other arm's difference from it, pooled as the root mean square over the arms.
    Where the pilot cannot say (fewer than 3 tasks with 2 evaluated runs per side) the stated
    defaults stand.  The rehearsal is not used: its outcomes are scripted, so how its tasks
    differ says nothing about the real agent."""
    arms = list(study.arms)
    counts: dict[tuple[str, str], list[int]] = {}
    for r in report_runs(study.paths, write=False):
        if (r.get("split") != split and r.get("status") == "finished" and run_evaluated(r)
                and not (r.get("provenance") or {}).get("rehearsal") and str(r.get("arm")) in arms):
            cell = counts.setdefault((str(r.get("task")), str(r["arm"])), [0, 0])
            cell[0] += run_succeeded(r)
            cell[1] += 1
    base = arms[0]
    tasks = sorted({t for t, _ in counts})
    sd_base = between_task_sd([(*counts[(t, base)], 0, 0) for t in tasks if (t, base) in counts],
                              paired=False)
    taus = []
    for arm in arms[1:]:
        tau = between_task_sd([(*counts[(t, arm)], *counts[(t, base)]) for t in tasks
                               if (t, arm) in counts and (t, base) in counts], paired=True)
        if tau is not None:
            taus.append(tau)
    pilot_runs = sum(n for _, n in counts.values())
    return {"sd_base": sd_base if sd_base is not None else POWER_DEFAULT_SD_BASE,
            "sd_base_basis": "pilot" if sd_base is not None else "default",
            "tau": math.sqrt(math.fsum(t * t for t in taus) / len(taus)) if taus else POWER_DEFAULT_TAU,
            "tau_basis": "pilot" if taus else "default", "pilot_runs": pilot_runs}


def assign_power(study: Study, split: str, delta: float, p_base: float, seed: int) -> dict[str, Any]:
    """For `assign --power-delta`: the repeats at which the primary test reaches 80% power, by
    simulation under the study's clustering (pilot_clustering), at alpha / m for a family of m
    comparisons (the first step of Holm's procedure: a conservative bound); the normal
    approximation beside it, as the search's starting point and a check."""
    arms = list(study.arms)
    family = max(1, len(arms) - 1)
    alpha = REPORT_ALPHA / family
    clus = pilot_clustering(study, split)
    power = paired_power_repeats(p_base, delta, len(study.tasks), alpha, tau=clus["tau"])
    start = power["repeats"] or power["max_repeats"]
    sim = primary_power_by_simulation(p_base, delta, len(study.tasks), alpha, power["power"],
                                      tau=clus["tau"], sd_base=clus["sd_base"], start=start,
                                      max_repeats=power["max_repeats"], seed=seed)
    notes = list(power["notes"])
    defaults = [k for k in ("sd_base", "tau") if clus[f"{k}_basis"] == "default"]
    if defaults:
        notes.append(f"no pilot to measure how tasks differ: the simulation assumes the default "
                     f"between-task sd of the baseline rate {POWER_DEFAULT_SD_BASE} and of the "
                     f"effect {POWER_DEFAULT_TAU} (run a pilot split, e.g. `assign --split pilot`, "
                     f"to measure them)")
    if family > 1:
        notes.append(f"alpha {REPORT_ALPHA} over a family of {family} comparisons: each is planned at "
                     f"{alpha:.4g}, Holm's first step (conservative)")
    if sim["repeats"] is None:
        notes.append(f"even {power['max_repeats']} repeats do not give the primary test power "
                     f"{power['power']} with {len(study.tasks)} tasks: add tasks")
    return {**power, "repeats_normal_approximation": power["repeats"], "repeats": sim["repeats"],
            "feasible": sim["repeats"] is not None,
            "runs_per_arm": sim["repeats"] * len(study.tasks) if sim["repeats"] else None,
            "achieved_power": sim["achieved_power"], "family_size": family,
            "alpha_family": REPORT_ALPHA, "clustering": clus, "simulation": sim, "notes": notes}


def assign_plan(study: Study, repeats: int, power: Mapping[str, Any], p_base: float,
                split: str) -> dict[str, Any]:
    """For `assign --power-delta`: the minimum detectable difference at the chosen repeats and the
    study's expected cost there and at the recommended repeats, priced from the study's pilot runs
    (finished real runs of other splits with a reported cost), else its rehearsal, else a token
    estimate (see plan_study_cost)."""
    paths, cfg, tasks, arms = study.paths, study.cfg, study.tasks, study.arms
    pilot: dict[str, list[float]] = {}
    for r in report_runs(paths):
        if (r.get("split") != split and r.get("status") == "finished" and not r.get("cost_estimated")
                and not (r.get("provenance") or {}).get("rehearsal") and str(r.get("arm")) in arms):
            pilot.setdefault(str(r["arm"]), []).append(r.get("cost_usd"))
    reh = read_json(paths.state / "rehearsal.json", default=None)
    reh = reh if isinstance(reh, dict) else {}
    shape = {a: {"gate_cycles": arm.gate_cycles, "review": arm.review} for a, arm in arms.items()}
    reh_arms = reh.get("arms") if isinstance(reh.get("arms"), dict) else None

    def cost(r: int) -> dict[str, Any]:
        return plan_study_cost(shape, len(tasks), r, pilot, reh_arms, cfg.get("model"), cfg.get("prices"))

    out = {"repeats": repeats,
           "minimum_detectable_difference": min_detectable_difference(p_base, len(tasks), repeats,
                                                                      power["alpha"], power["power"],
                                                                      power["tau"]),
           "cost_at_repeats": cost(repeats),
           "rehearsal_is_current": bool(reh) and reh.get("config_hash") == study.hash,
           "study_budget_usd": (cfg.get("budget") or {}).get("study_usd")}
    if power.get("repeats"):
        out["cost_at_recommended_repeats"] = {"repeats": power["repeats"], **cost(int(power["repeats"]))}
    out["warnings"] = plan_warnings(out)
    return out


def assign_runs(host: Host, study: Study, *, split: str = "main", repeats: int | None = None,
                seed: int | None = None, reassign: bool = False, faults: Sequence[str] = (),
                power_delta: float | None = None, power_base: float = POWER_BASE_DEFAULT,
                force: bool = False) -> dict[str, Any]:
    """`assign`: the randomized, paired, blocked manifest of tasks x arms x repeats (defaults: the
    study's `repeats` and `seed`), its runs registered; `faults` are RUN_ID=FAULT specs for runs
    not started; `power_delta` adds a power estimate and its cost plan."""
    paths = study.paths
    study.load_all()
    cfg, tasks, arms = study.cfg, study.tasks, study.arms
    check_name("split", split)
    repeats = repeats if repeats is not None else int(cfg.get("repeats") or 1)
    seed = seed if seed is not None else int(cfg.get("seed") or 0)
    power = None
    if power_delta is not None:
        if not 0 < power_delta < 1 or not 0 <= power_base <= 1:
            raise AgentbenchError("power estimate needs 0 < --power-delta < 1 and 0 <= --power-base <= 1",
                                  code="power_estimate_needs_0_power")
        power = assign_power(study, split, power_delta, power_base, seed)
        power["plan"] = assign_plan(study, repeats, power, power_base, split)
    manifest = make_assignment(sorted(tasks), sorted(arms), repeats, seed, split)
    # The analysis is fixed with the assignment, before any run: the study's first arm is the
    # baseline, every other arm is compared with it (see analysis_plan).
    plan = analysis_plan(list(arms), list(arms)[0], seed)
    data = manifest_bytes(manifest, seed, split, plan)
    named: dict[str, dict[str, Any]] = {}
    ids = {m["run_id"] for m in manifest}
    for spec in faults:
        rid, _, f = spec.partition("=")
        if rid not in ids:
            raise AgentbenchError("--fault names an unknown run", code="fault_names_unknown_run",
                                  run=rid, hint="RUN_ID=FAULT with a run id of this manifest")
        named[rid] = parse_fault(f)
    bad = uncalibrated(paths, tasks)
    if bad and not force:
        raise AgentbenchError("tasks are not calibrated", code="tasks_not_calibrated", tasks=bad,
                              hint="run `calibrate` first (or pass --force to assign anyway)")
    mpath = paths.state / "manifests" / f"{split}.json"
    existing = mpath.read_bytes() if mpath.exists() else None
    if existing is not None and existing == manifest_bytes(manifest, seed, split):
        # The same assignment, written before manifests held a plan: kept as it is.  A plan added
        # now, after runs may have been seen, would not be a pre-registration.
        data = existing
    with RegistryLock(paths.lock, host.platform):
        if existing is not None and existing != data:
            if not reassign:
                raise AgentbenchError("this split already has a different manifest",
                                      code="split_already_different_manifest", split=split,
                                      existing_sha256=sha256_bytes(existing),
                                      hint="pass --reassign to replace it "
                                           "(refused once any of its runs started)")
            old = json.loads(existing)
            started = [r["run_id"] for r in old["runs"] if run_file(paths, r["run_id"]).exists()
                       and load_run(paths, r["run_id"]).get("status") != "not_started"]
            if started:
                raise AgentbenchError("cannot reassign: runs of this split have started",
                                      code="cannot_reassign_runs_split_started", runs=started[:20])
            for r in old["runs"]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(run_file(paths, r["run_id"]))
        write_bytes_atomic(mpath, data)
    # Outside the lock: one file per run (10,000 fsyncs must not hold every other caller up).
    # Existing records are kept; faults named now apply to runs that have not started.
    register_runs(paths, manifest, seed, split, named)
    applied = {}
    with RegistryLock(paths.lock, host.platform):   # claim() changes run records under this lock
        for rid, fault in named.items():
            rec = load_run(paths, rid)
            if rec.get("status") == "not_started":
                applied[rid] = fault
                if rec.get("fault") != fault:
                    rec["fault"] = fault
                    save_run(paths, rec)
    append_event(paths, "assigned", split=split, runs=len(manifest), sha256=sha256_bytes(data))
    blocks = sorted({m["block"] for m in manifest})
    where = shlex.quote(str(paths.root))
    reh = read_json(paths.state / "rehearsal.json", default=None)
    rehearsed = isinstance(reh, dict) and reh.get("ok") is True and reh.get("config_hash") == study.hash
    warnings = list(((power or {}).get("plan") or {}).get("warnings") or [])
    return {"next": f"python3 agentbench.py {'run' if rehearsed else 'rehearse'} --study {where}",
            "warnings": warnings, "split": split, "runs": len(manifest), "tasks": len(tasks),
            "arms": sorted(arms),
            "repeats": repeats, "seed": seed, "blocks": len(blocks), "manifest": str(mpath),
            "sha256": sha256_bytes(data), "unchanged": existing == data, "power": power,
            "analysis_plan": json.loads(data).get("analysis_plan"),
            "faults": dict(applied)}


# -- new-task: a complete task bundle to start from ------------------------------------------------

#: The kinds of task `new-task` writes: what the agent is asked to do in each.
SCAFFOLD_KINDS = {"python-fix": "fix a bug in a small Python module",
                  "cli": "add an option to a small command-line tool"}

#: The hidden oracle every scaffolded task starts with.  The receipt channel the safe way: the
#: descriptor is made non-inheritable at once and the process non-dumpable, the code under test
#: runs only in child processes (which never get the descriptor), and this parent alone writes
#: the one receipt line after they finished.  %(checks)s is the task kind's list of checks.
SCAFFOLD_ORACLE = '''#!/usr/bin/env python3
"""Hidden tests of the task: agentbench never copies this directory into a workspace.

EDIT HERE: the CHECKS list. A check is (id, the arguments after `python`, the stdout it must
print). Each runs in a child process with the workspace copy as its directory, so the code under
test never runs in this process and never sees the receipt channel.
Usage (agentbench passes both, see task.json): run.py WORKSPACE --receipt-fd FD
"""
import json
import os
import subprocess
import sys

CHECKS = [
%(checks)s
]
TIMEOUT_S = 20          # per check; every check timing out must fit the oracle's timeout_s


def not_dumpable():
    """Linux: no other process of this user may take this process's descriptors."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE = 0
    except (OSError, AttributeError):
        pass


def run_check(workspace, args, expected):
    try:
        proc = subprocess.run([sys.executable, "-E", "-s", *args], cwd=workspace, text=True,
                              capture_output=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False, "timed out after %%d s" %% TIMEOUT_S
    got = proc.stdout.strip()
    if got == expected:
        return True, "ok"
    return False, "expected %%r, got %%r (exit %%d) %%s" %% (expected, got[-200:], proc.returncode,
                                                        proc.stderr.strip()[-300:])


def main(argv):
    if len(argv) != 4 or argv[2] != "--receipt-fd":
        print("usage: run.py WORKSPACE --receipt-fd FD", file=sys.stderr)
        return 2
    fd = int(argv[3])
    os.set_inheritable(fd, False)   # no child process (no code under test) is handed the channel
    not_dumpable()
    checks = []
    for check_id, args, expected in CHECKS:
        passed, detail = run_check(argv[1], args, expected)
        checks.append({"id": check_id, "passed": passed, "detail": detail})
    n = sum(1 for c in checks if c["passed"])
    receipt = {"passed": n == len(checks), "score": n / len(checks), "checks": checks,
               "tests_passed": n, "tests_total": len(checks)}
    os.write(fd, (json.dumps(receipt) + "\\n").encode("utf-8"))   # the one receipt line
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''

_FIX_STARTER = '''"""Small statistics helpers."""


def mean(values):
    """The arithmetic mean of a non-empty list of numbers; ValueError when it is empty."""
    return sum(values) / (len(values) - 1)


def clamp(value, low, high):
    """value limited to [low, high]."""
    return max(low, min(value, high))
'''

_FIX_REFERENCE = _FIX_STARTER.replace(
    "    return sum(values) / (len(values) - 1)",
    '    if not values:\n        raise ValueError("mean of an empty list")\n'
    "    return sum(values) / len(values)")

_FIX_TESTS = '''import unittest

import stats


class TestStats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(stats.mean([2, 4, 6]), 4)

    def test_clamp(self):
        self.assertEqual(stats.clamp(15, 0, 10), 10)


if __name__ == "__main__":
    unittest.main()
'''

_FIX_CHECKS = '''    ("mean_of_three", ["-c", "import stats; print(stats.mean([2, 4, 6]))"], "4.0"),
    ("mean_of_one", ["-c", "import stats; print(stats.mean([5]))"], "5.0"),
    ("mean_of_floats", ["-c", "import stats; print(stats.mean([0.5, 1.5]))"], "1.0"),
    ("mean_of_empty", ["-c", "import stats\\ntry:\\n    stats.mean([])\\nexcept ValueError:\\n"
                                "    print('ValueError')"], "ValueError"),
    ("clamp_kept", ["-c", "import stats; print(stats.clamp(15, 0, 10))"], "10"),'''

_FIX_TASK_MD = '''# Fix the mean

`stats.mean` gives wrong answers: `mean([2, 4, 6])` should be `4.0`. Fix it, and make
`mean([])` raise `ValueError` instead of crashing with another error. Keep `clamp` as it is.
'''

_CLI_STARTER = '''"""greet: a tiny command-line tool.  Usage: python3 greet.py NAME [--shout]"""
import argparse


def main(argv=None):
    parser = argparse.ArgumentParser(prog="greet")
    parser.add_argument("name")
    args = parser.parse_args(argv)
    print(f"Hello, {args.name}!")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

_CLI_REFERENCE = _CLI_STARTER.replace(
    '    parser.add_argument("name")\n',
    '    parser.add_argument("name")\n'
    '    parser.add_argument("--shout", action="store_true", help="print in capitals")\n').replace(
    '    print(f"Hello, {args.name}!")\n',
    '    text = f"Hello, {args.name}!"\n    print(text.upper() if args.shout else text)\n')

_CLI_TESTS = '''import subprocess
import sys
import unittest


def greet(*args):
    return subprocess.run([sys.executable, "greet.py", *args], capture_output=True, text=True,
                          timeout=30).stdout.strip()


class TestGreet(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(greet("Ada"), "Hello, Ada!")

    def test_shout(self):
        self.assertEqual(greet("Ada", "--shout"), "HELLO, ADA!")


if __name__ == "__main__":
    unittest.main()
'''

_CLI_CHECKS = '''    ("plain", ["greet.py", "Ada"], "Hello, Ada!"),
    ("shout", ["greet.py", "Ada", "--shout"], "HELLO, ADA!"),
    ("shout_before_name", ["greet.py", "--shout", "Lin"], "HELLO, LIN!"),
    ("two_words", ["greet.py", "Grace Hopper", "--shout"], "HELLO, GRACE HOPPER!"),'''

_CLI_TASK_MD = '''# Add --shout to greet

`python3 greet.py NAME` prints `Hello, NAME!`. Add an option `--shout` that prints the same
greeting in capitals (`python3 greet.py Ada --shout` prints `HELLO, ADA!`), before or after
the name. Without it the output stays as it is.
'''

#: What each kind writes: (starter file, starter, reference, public tests, TASK.md, oracle checks).
SCAFFOLD_FILES = {"python-fix": ("stats.py", _FIX_STARTER, _FIX_REFERENCE, _FIX_TESTS, _FIX_TASK_MD,
                                 _FIX_CHECKS),
                  "cli": ("greet.py", _CLI_STARTER, _CLI_REFERENCE, _CLI_TESTS, _CLI_TASK_MD, _CLI_CHECKS)}


def scaffold_files(task_id: str, kind: str) -> dict[str, str]:
    """The files of a new task bundle of `kind`, by path relative to the task's directory (pure)."""
    if kind not in SCAFFOLD_FILES:
        raise AgentbenchError("unknown task kind", code="unknown_task_kind", kind=kind,
                              kinds=sorted(SCAFFOLD_FILES), hint="pass --kind " + " or --kind ".join(
                                  sorted(SCAFFOLD_FILES)))
    starter_name, starter, reference, tests, task_md, checks = SCAFFOLD_FILES[kind]
    test_name = "test_" + starter_name
    spec = {"id": task_id, "title": task_md.splitlines()[0].lstrip("# ").strip(),
            "gate": {"cmd": ["{python}", "-m", "unittest", "discover", "-s", "{gate}", "-t", "{gate}"],
                     "timeout_s": 120},
            "oracle": {"cmd": ["{python}", "{oracle}/run.py", "{workspace}", "--receipt-fd",
                               "{receipt_fd}"], "timeout_s": 300, "threshold": 1.0},
            "check_hint": "Run the public tests from the workspace root with: "
                          "python3 -m unittest discover -s tests -t tests"}
    edit = (f"# Task {task_id} ({kind}): where to edit\n\n"
            "Written by `agentbench.py new-task`; this file is not part of any workspace.\n\n"
            "| file | what to change |\n|---|---|\n"
            "| `task.json` | the title; the commands' `timeout_s`; the oracle's `threshold` |\n"
            "| `public/TASK.md` | the statement the agent reads |\n"
            f"| `public/{starter_name}` | the starter code the agent gets |\n"
            f"| `public/tests/{test_name}` | the public tests the agent may run |\n"
            f"| `gate/{test_name}` | the public checks the controller runs (keep them like the "
            "public tests) |\n"
            "| `oracle/run.py` | the hidden tests: its `CHECKS` list |\n"
            f"| `reference/{starter_name}` | a solution: it must pass the gate and the oracle, "
            "and the starter must fail the oracle |\n\n"
            "Then run `python3 agentbench.py calibrate --study STUDY`: it checks all of that, "
            "without a model.\n")
    return {"task.json": json.dumps(spec, indent=2) + "\n", "EDIT.md": edit,
            "public/TASK.md": task_md, f"public/{starter_name}": starter,
            f"public/tests/{test_name}": tests, f"gate/{test_name}": tests,
            "oracle/run.py": SCAFFOLD_ORACLE % {"checks": checks},
            f"reference/{starter_name}": reference}


def scaffold_task(paths: StudyPaths, task_id: str, kind: str) -> dict[str, Any]:
    """`new-task`: write a complete task bundle into the study's tasks directory.  A bad name, an
    unknown kind or an existing task directory is refused before anything is written; the bundle
    appears whole (written beside it, then renamed into place)."""
    check_name("task", task_id)
    files = scaffold_files(task_id, kind)
    cfg = read_json(paths.study_file, default=None) if paths.study_file.exists() else None
    tdir = tasks_dir(paths, cfg if isinstance(cfg, dict) else {})
    dest = tdir / task_id
    if dest.exists() or dest.is_symlink():
        raise AgentbenchError("the task directory already exists", code="task_already_exists",
                              task=task_id, path=str(dest),
                              hint="choose another name, or delete the directory first")
    tdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".new-{task_id}-", dir=tdir))
    try:
        for rel, text in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"task": task_id, "kind": kind, "dir": str(dest), "files": sorted(files),
            "edit": str(dest / "EDIT.md")}


# ==================================================================================================
# Interop: Inspect logs, ATIF trajectories, Harbor tasks
# ==================================================================================================
# Owns the formats that other agent-evaluation tools read and write: a study exported as Inspect AI
# eval logs (one `.eval` zip per arm, log-format version 2), every session exported as an ATIF
# trajectory (the Agent Trajectory Interchange Format of Harbor), and Harbor task directories
# imported as task bundles.  What a session produced is hostile input here: streams and prompts are
# read size-capped, never through a link, garbage lines counted and skipped, every number checked.
# Must not start sessions or checks or change a study: an export only reads the study, and an import
# writes only new task bundles (calibrate then proves them).

#: A stream, prompt or system prompt larger than this is read up to it (the rest is said, not read).
INTEROP_FILE_MAX_BYTES = 16 * 2**20
#: A stream line longer than this is skipped as garbage (a real event is far smaller).
INTEROP_LINE_MAX_BYTES = 2**20
#: Events read from one stream at most; the rest is counted as left out.
INTEROP_EVENTS_MAX = 20000
#: One message's text (or one tool result, or one tool call's arguments as JSON) at most.
INTEROP_TEXT_MAX_CHARS = 40000
#: Ids (tool calls, messages) longer than this are cut: they go into names and references.
INTEROP_ID_MAX_CHARS = 200
#: A recorded wall time beyond this (a year) is not believed.
MAX_WALL_S_RECORD = 366 * 86400.0
INSPECT_LOG_VERSION = 2
ATIF_VERSION = "ATIF-v1.8"
EXPORT_FORMATS = ("inspect", "atif")


def clip_text(value: Any, limit: int = INTEROP_TEXT_MAX_CHARS) -> str:
    """`value` as text of at most `limit` characters (a cut says how much was left out) (pure)."""
    text = value if isinstance(value, str) else "" if value is None else str(value)
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} characters left out by agentbench]"


def read_file_bounded(path: str | os.PathLike[str], cap: int = INTEROP_FILE_MAX_BYTES
                      ) -> tuple[bytes | None, str | None]:
    """(up to `cap` bytes of a regular file, a problem or None), opened as open_regular opens
    (never through a link, never blocking on a FIFO): (None, why) for a file that is missing, a
    link or special.  Unlike read_capped, a longer file gives its first `cap` bytes, said."""
    try:
        opened = open_regular(path)
    except OSError as exc:
        return None, f"not read ({exc.strerror})"
    if opened is None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None, "missing"
        except OSError as exc:
            return None, f"not read ({exc.strerror})"
        return None, "not read (a link)" if stat.S_ISLNK(mode) else "not a regular file"
    fd, _ = opened
    try:
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        return data[:cap], f"cut at {cap} bytes"
    return data, None


def read_text_bounded(path: str | os.PathLike[str], limit: int = INTEROP_TEXT_MAX_CHARS) -> str | None:
    data, _ = read_file_bounded(path, cap=limit * 4)
    return None if data is None else clip_text(data.decode("utf-8", "replace"), limit)


def stream_events(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The JSON object lines of a stream, and how many lines were garbage (not JSON, not an
    object, too long) or beyond INTEROP_EVENTS_MAX (pure)."""
    events: list[dict[str, Any]] = []
    garbage = 0
    for raw in data.split(b"\n"):
        raw = raw.strip()
        if not raw:
            continue
        if len(raw) > INTEROP_LINE_MAX_BYTES or len(events) >= INTEROP_EVENTS_MAX:
            garbage += 1
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError):
            garbage += 1
            continue
        if isinstance(obj, dict):
            events.append(obj)
        else:
            garbage += 1
    return events, garbage


def _id_text(value: Any) -> str | None:
    return clip_text(value, INTEROP_ID_MAX_CHARS) if isinstance(value, str) and value else None


def _block_text(content: Any) -> str:
    """A tool result's or user message's content (a string or a list of blocks) as text (pure)."""
    if isinstance(content, str):
        return clip_text(content)
    parts = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text") if isinstance(block.get("text"), str) else "")
        elif isinstance(block, dict) and isinstance(block.get("type"), str):
            parts.append(f"[{clip_text(block['type'], 40)} content left out]")
    return clip_text("\n".join(parts))


def _tool_input(value: Any) -> dict[str, Any]:
    """A tool call's arguments: a JSON object, cut to size as a whole (then {"truncated": text})."""
    if not isinstance(value, dict):
        return {"value": clip_text(json.dumps(json_safe(value), default=str))} if value is not None else {}
    text = json.dumps(json_safe(value), default=str)
    if len(text) > INTEROP_TEXT_MAX_CHARS:
        return {"truncated": clip_text(text)}
    return json.loads(text)


def _usage_tokens(usage: Any) -> dict[str, int]:
    u = usage if isinstance(usage, dict) else {}
    return {"input": count_from(u.get("input_tokens")), "output": count_from(u.get("output_tokens")),
            "cache_creation": count_from(u.get("cache_creation_input_tokens")),
            "cache_read": count_from(u.get("cache_read_input_tokens"))}


def session_items(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A session's stream as chains of items (pure): {"chains": {chain: [item]}, "model",
    "result"}.  The main chain is "" and a sub-agent's side chain is keyed by the tool call that
    started it (the events' parent_tool_use_id).  Items: {"type": "assistant", "text", "thinking",
    "tool_calls": [{"id", "name", "input"}], "usage", "model"} (the events of one API message,
    which share a message id, merged), {"type": "tool_results", "results": [{"tool_use_id",
    "content", "is_error"}]} and {"type": "user", "text"}.  Unknown events are skipped."""
    chains: dict[str, list[dict[str, Any]]] = {}
    model, result = None, None
    for ev in events:
        kind = ev.get("type")
        chain = _id_text(ev.get("parent_tool_use_id")) or ""
        msg = ev.get("message") if isinstance(ev.get("message"), dict) else {}
        content = msg.get("content")
        items = chains.setdefault(chain, [])
        if kind == "system" and ev.get("subtype") == "init" and isinstance(ev.get("model"), str):
            model = model or clip_text(ev["model"], INTEROP_ID_MAX_CHARS)
        elif kind == "assistant":
            mid = _id_text(msg.get("id"))
            last = items[-1] if items else None
            if not (last and last["type"] == "assistant" and mid and last["message_id"] == mid):
                last = {"type": "assistant", "message_id": mid, "text": "", "thinking": "", "tool_calls": [],
                        "usage": None, "model": _id_text(msg.get("model"))}
                items.append(last)
            for block in content if isinstance(content, list) else []:
                if not isinstance(block, dict):
                    continue
                if block.get("type") == "text" and isinstance(block.get("text"), str):
                    last["text"] = clip_text((last["text"] + "\n" if last["text"] else "") + block["text"])
                elif block.get("type") == "thinking" and isinstance(block.get("thinking"), str):
                    last["thinking"] = clip_text(last["thinking"] + block["thinking"])
                elif block.get("type") == "tool_use":
                    call_id = _id_text(block.get("id")) or f"call-{len(last['tool_calls']) + 1}"
                    last["tool_calls"].append({"id": call_id,
                                               "name": clip_text(block.get("name") or "unknown", 200),
                                               "input": _tool_input(block.get("input"))})
            if isinstance(msg.get("usage"), dict):
                last["usage"] = _usage_tokens(msg["usage"])
        elif kind == "user":
            if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result"
                                                 for b in content):
                res = [{"tool_use_id": _id_text(b.get("tool_use_id")),
                        "content": _block_text(b.get("content")), "is_error": b.get("is_error") is True}
                       for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]
                items.append({"type": "tool_results", "results": res})
            elif content is not None:
                items.append({"type": "user", "text": _block_text(content)})
        elif kind == "result":
            result = {"usage": _usage_tokens(ev.get("usage")), "is_error": ev.get("is_error") is True,
                      "subtype": _id_text(ev.get("subtype")), "text": clip_text(ev.get("result"))
                      if isinstance(ev.get("result"), str) else None}
    return {"chains": {k: v for k, v in chains.items() if v}, "model": model, "result": result}


@dataclass(frozen=True)
class SessionSource:
    """One session (job) of a study as an export reads it: its record's checked fields, its
    prompts and parsed stream, and its ledger line (None when it has none)."""
    job_id: str
    run_id: str | None
    role: str
    session_id: str | None
    prompt: str | None
    system_prompt: str | None
    session: dict[str, Any]
    garbage_lines: int
    problems: tuple[str, ...]
    ledger: dict[str, Any] | None
    claude_version: str | None
    model: str | None
    created_at: str | None


def _inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    p, r = os.path.realpath(path), os.path.realpath(root)
    return p == r or p.startswith(r.rstrip(os.sep) + os.sep)


def iso_or_none(value: Any) -> str | None:
    """An ISO 8601 timestamp with a zone as it is, else None (pure)."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        stamp = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return value if stamp.tzinfo is not None else None


def load_session_source(paths: StudyPaths, job_id: str, ledger: Mapping[str, Mapping[str, Any]]
                        ) -> SessionSource:
    """A job's session read for export: its stream from its raw directory (which must lie inside
    the study), its prompt and system prompt, bounded; what could not be read is in `problems`."""
    problems: list[str] = []
    try:
        job = read_json(paths.job_file(job_id), default=None)
    except AgentbenchError:
        job = None
        problems.append("job.json is not valid JSON")
    job = job if isinstance(job, dict) else {}
    meta = job.get("meta") if isinstance(job.get("meta"), dict) else {}
    raw_dir = job.get("raw_dir")
    events: list[dict[str, Any]] = []
    garbage = 0
    if not isinstance(raw_dir, str) or not _inside(raw_dir, paths.root):
        problems.append("the job's raw directory is not inside the study: its stream was not read")
    else:
        data, problem = read_file_bounded(Path(raw_dir) / "stream.jsonl")
        if problem:
            problems.append(f"stream.jsonl: {problem}")
        if data:
            events, garbage = stream_events(data)
    run_id = meta.get("run_id")
    run_id = run_id if isinstance(run_id, str) and NAME_RE.match(run_id) else None
    line = ledger.get(job_id)
    return SessionSource(
        job_id=job_id, run_id=run_id, role=clip_text(meta.get("role") or job.get("kind") or "session", 40),
        session_id=_id_text(job.get("session_id")),
        prompt=read_text_bounded(paths.job_dir(job_id) / "prompt.txt"),
        system_prompt=read_text_bounded(paths.job_dir(job_id) / "system_prompt.md"),
        session=session_items(events), garbage_lines=garbage, problems=tuple(problems),
        ledger=dict(line) if isinstance(line, Mapping) else None,
        claude_version=_id_text((line or {}).get("claude_version")), model=_id_text(job.get("model")),
        created_at=iso_or_none(job.get("created_at")))


def ledger_by_job(paths: StudyPaths) -> dict[str, dict[str, Any]]:
    counts: dict[str, int] = {}
    return {str(r.get("job_id")): r for r in iter_ledger_once_per_job(paths.ledger, counts)}


def session_cost(line: Mapping[str, Any] | None) -> tuple[float | None, dict[str, int]]:
    """A ledger line's cost (metered by the gateway where it was, else the binary's own delta) and
    tokens, each checked (pure)."""
    if not line:
        return None, {"input": 0, "output": 0, "cache_creation": 0, "cache_read": 0}
    cost = usd_from(line.get("cost_metered_usd"))
    if cost is None:
        cost = usd_from(line.get("cost_delta_usd"))
    tok = line.get("tokens") if isinstance(line.get("tokens"), dict) else {}
    return cost, {k: count_from(tok.get(k)) for k in ("input", "output", "cache_creation", "cache_read")}


def model_usage_of(lines: Iterable[Mapping[str, Any] | None],
                   default_model: str) -> dict[str, dict[str, Any]]:
    """Inspect's model_usage (model -> tokens and cost) summed over ledger lines: per model from
    the gateway's metering, else the line's totals under its first model used (pure)."""
    out: dict[str, dict[str, Any]] = {}

    def add(model: str, tokens: Mapping[str, int], cost: float | None) -> None:
        u = out.setdefault(model, {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                                   "input_tokens_cache_write": 0, "input_tokens_cache_read": 0,
                                   "total_cost": 0.0})
        u["input_tokens"] += tokens["input"]
        u["output_tokens"] += tokens["output"]
        u["input_tokens_cache_write"] += tokens["cache_creation"]
        u["input_tokens_cache_read"] += tokens["cache_read"]
        u["total_tokens"] += sum(tokens.values())
        u["total_cost"] = round(u["total_cost"] + (cost or 0.0), 6)
    for line in lines:
        if not line:
            continue
        metered = line.get("models_metered") if isinstance(line.get("models_metered"), dict) else {}
        if metered:
            for name, m in metered.items():
                m = m if isinstance(m, dict) else {}
                tok = m.get("tokens") if isinstance(m.get("tokens"), dict) else {}
                add("anthropic/" + clip_text(name, INTEROP_ID_MAX_CHARS),
                    {k: count_from(tok.get(k)) for k in ("input", "output", "cache_creation", "cache_read")},
                    usd_from(m.get("cost_usd")))
            continue
        used = line.get("models_used") if isinstance(line.get("models_used"), list) else []
        name = (clip_text(used[0], INTEROP_ID_MAX_CHARS) if used and isinstance(used[0], str)
                else default_model)
        cost, tokens = session_cost(line)
        add(name if name.startswith("anthropic/") else "anthropic/" + name, tokens, cost)
    return out


# -- ATIF trajectories -----------------------------------------------------------------------------

def _atif_metrics(usage: Mapping[str, int] | None) -> dict[str, int] | None:
    if not usage:
        return None
    return {"prompt_tokens": usage["input"] + usage["cache_creation"] + usage["cache_read"],
            "completion_tokens": usage["output"], "cached_tokens": usage["cache_read"]}


def atif_steps(items: Sequence[Mapping[str, Any]], model: str | None,
               sub_refs: Mapping[str, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """ATIF steps of one chain (pure), numbered from 1: an assistant message is an agent step with
    its tool calls, and the tool results that answer them become that step's observation (a result
    of a sub-agent's call refers to the sub-agent's embedded trajectory by `sub_refs`); a user
    message is a user step; results that answer no call of the step before are a system step.
    Also the notes on what was moved."""
    steps: list[dict[str, Any]] = []
    notes: list[str] = []
    for item in items:
        if item["type"] == "assistant":
            step: dict[str, Any] = {"step_id": len(steps) + 1, "source": "agent", "message": item["text"]}
            if item.get("model") or model:
                step["model_name"] = item.get("model") or model
            if item["thinking"]:
                step["reasoning_content"] = item["thinking"]
            if item["tool_calls"]:
                step["tool_calls"] = [{"tool_call_id": c["id"], "function_name": c["name"],
                                       "arguments": c["input"]} for c in item["tool_calls"]]
            metrics = _atif_metrics(item.get("usage"))
            if metrics:
                step["metrics"] = metrics
            steps.append(step)
        elif item["type"] == "tool_results":
            last = steps[-1] if steps else None
            calls = {c["tool_call_id"] for c in (last or {}).get("tool_calls") or []}
            target = last if last is not None and last["source"] == "agent" and calls else None
            if target is None:
                target = {"step_id": len(steps) + 1, "source": "system", "message": "Tool results."}
                steps.append(target)
                notes.append(f"step {target['step_id']}: tool results without a call before them")
            results = target.setdefault("observation", {"results": []})["results"]
            for r in item["results"]:
                res: dict[str, Any] = {"content": r["content"]}
                if r["tool_use_id"] in calls:
                    res["source_call_id"] = r["tool_use_id"]
                if r["tool_use_id"] in sub_refs:
                    res["subagent_trajectory_ref"] = [{"trajectory_id": sub_refs[r["tool_use_id"]]}]
                if r["is_error"]:
                    res["extra"] = {"is_error": True}
                results.append(res)
        else:
            steps.append({"step_id": len(steps) + 1, "source": "user", "message": item["text"]})
    return steps, notes


def atif_trajectory(src: SessionSource, *, version: str, continued_from: str | None = None
                    ) -> dict[str, Any]:
    """One session as an ATIF trajectory (pure): its system prompt and prompt as the first steps,
    its main chain's messages, every sub-agent side chain as an embedded sub-trajectory referred
    to from the result of the tool call that started it, tokens per step, and the ledger's tokens
    and (metered) cost as final_metrics."""
    session = src.session
    model = session.get("model") or src.model
    agent = {"name": "claude-code", "version": src.claude_version or "unknown"}
    if model:
        agent["model_name"] = model
    chains = session["chains"]
    sub_refs = {chain: f"{src.job_id}:{chain}" for chain in chains if chain}
    head: list[dict[str, Any]] = []
    if src.system_prompt:
        head.append({"source": "system", "message": src.system_prompt})
    if src.prompt:
        head.append({"source": "user", "message": src.prompt})
    body, notes = atif_steps(chains.get("", []), model, sub_refs)
    answered = {r.get("source_call_id") for s in body
                for r in (s.get("observation") or {}).get("results", [])}
    for chain, ref in sub_refs.items():   # a sub-agent whose call has no result yet: refer from its call
        if chain in answered:
            continue
        for s in body:
            if any(c["tool_call_id"] == chain for c in s.get("tool_calls") or []):
                s.setdefault("observation", {"results": []})["results"].append(
                    {"source_call_id": chain, "subagent_trajectory_ref": [{"trajectory_id": ref}]})
                break
        else:
            notes.append(f"sub-agent chain {chain} has no tool call in the main chain")
    steps = head + body
    for i, s in enumerate(steps, 1):
        s["step_id"] = i
    if not steps:
        steps = [{"step_id": 1, "source": "system", "message": "The session's stream held no messages."}]
        notes.append("empty session")
    subs = []
    for chain, ref in sub_refs.items():
        sub_steps, sub_notes = atif_steps(chains[chain], model, {})
        subs.append({"schema_version": version, "session_id": src.session_id, "trajectory_id": ref,
                     "agent": {**agent, "extra": {"side_chain_of_tool_call": chain}}, "steps": sub_steps,
                     **({"notes": "; ".join(sub_notes)} if sub_notes else {})})
    cost, tokens = session_cost(src.ledger)
    if src.ledger is None and session.get("result"):
        tokens = session["result"]["usage"]
    final = {"total_prompt_tokens": tokens["input"] + tokens["cache_creation"] + tokens["cache_read"],
             "total_completion_tokens": tokens["output"], "total_cached_tokens": tokens["cache_read"],
             "total_steps": len(steps)}
    if cost is not None:
        final["total_cost_usd"] = cost
    if src.garbage_lines:
        notes.append(f"{src.garbage_lines} stream lines were not events and were skipped")
    notes += list(src.problems)
    metered = bool(src.ledger and usd_from(src.ledger.get("cost_metered_usd")) is not None)
    out: dict[str, Any] = {"schema_version": version, "session_id": src.session_id,
                           "trajectory_id": src.job_id, "agent": agent, "steps": steps,
                           "final_metrics": final,
                           "extra": {"agentbench_version": VERSION, "job_id": src.job_id,
                                     "run_id": src.run_id, "role": src.role, "cost_metered": metered,
                                     "is_error": bool((session.get("result") or {}).get("is_error"))}}
    if continued_from:
        out["continued_trajectory_ref"] = continued_from
    if notes:
        out["notes"] = clip_text("; ".join(notes), 4000)
    if subs:
        out["subagent_trajectories"] = subs
    return {k: v for k, v in out.items() if v is not None}


def study_job_ids(paths: StudyPaths) -> list[str]:
    try:
        names = os.listdir(paths.jobs)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if JOB_ID_RE.match(n))


def export_atif(paths: StudyPaths, out: Path) -> dict[str, Any]:
    """Every session of the study as <out>/<run id or _sessions>/<job id>/trajectory.json; a
    session resumed from an earlier one of the same run refers to it (continued_trajectory_ref)."""
    ledger = ledger_by_job(paths)
    planned: list[tuple[Path, dict[str, Any]]] = []
    last_of_session: dict[tuple[str, str], str] = {}
    for jid in study_job_ids(paths):
        src = load_session_source(paths, jid, ledger)
        group = src.run_id or "_sessions"
        key = (group, src.session_id or "")
        prev = last_of_session.get(key) if src.session_id else None
        traj = atif_trajectory(src, version=ATIF_VERSION,
                               continued_from=f"../{prev}/trajectory.json" if prev else None)
        last_of_session[key] = jid
        planned.append((out / group / jid / "trajectory.json", traj))
    for path, traj in planned:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, traj)
    return {"format": "atif", "schema_version": ATIF_VERSION, "out": str(out), "trajectories": len(planned),
            "files": [str(p.relative_to(out)) for p, _ in planned][:LIST_LIMIT_DEFAULT],
            "sub_agent_chains": sum(len(t.get("subagent_trajectories") or []) for _, t in planned),
            "sessions_with_problems": sorted(t["trajectory_id"] for _, t in planned if t.get("notes"))}


# -- Inspect eval logs -----------------------------------------------------------------------------

def inspect_messages(sources: Sequence[SessionSource], run_id: str) -> list[dict[str, Any]]:
    """A run's chat in Inspect's message shapes (pure): the first session's system prompt, then per
    session (executor, gate feedback, reviewer, repair...) its prompt as a user message marked with
    its role, and its main chain's assistant messages, tool calls and tool results.  Sub-agent side
    chains are left out here (the ATIF export keeps them)."""
    msgs: list[dict[str, Any]] = []

    def add(msg: dict[str, Any]) -> None:
        msg["id"] = f"{run_id}-m{len(msgs) + 1}"
        msgs.append(msg)
    for src in sources:
        tag = {"agentbench_role": src.role, "job_id": src.job_id}
        if not msgs and src.system_prompt:
            add({"role": "system", "content": src.system_prompt, "source": "input", "metadata": tag})
        if src.prompt:
            add({"role": "user", "content": src.prompt, "source": "input", "metadata": tag})
        names: dict[str, str] = {}
        model = src.session.get("model") or src.model
        for item in src.session["chains"].get("", []):
            if item["type"] == "assistant":
                calls = [{"id": c["id"], "function": c["name"], "arguments": c["input"], "type": "function"}
                         for c in item["tool_calls"]]
                names.update({c["id"]: c["name"] for c in item["tool_calls"]})
                msg: dict[str, Any] = {"role": "assistant", "content": item["text"], "source": "generate",
                                       "metadata": tag}
                if calls:
                    msg["tool_calls"] = calls
                if item.get("model") or model:
                    msg["model"] = "anthropic/" + str(item.get("model") or model)
                add(msg)
            elif item["type"] == "tool_results":
                for r in item["results"]:
                    msg = {"role": "tool", "content": r["content"], "tool_call_id": r["tool_use_id"],
                           "function": names.get(r["tool_use_id"] or ""), "metadata": tag}
                    if r["is_error"]:
                        msg["error"] = {"type": "unknown", "message": clip_text(r["content"], 2000)}
                    add(msg)
            else:
                add({"role": "user", "content": item["text"], "source": "input", "metadata": tag})
    return msgs


def _sample_scores(run: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    ev = run.get("evaluation") if isinstance(run.get("evaluation"), dict) else {}
    outcome = clip_text(run.get("outcome") or run.get("status") or "unknown", 80)
    scores: dict[str, dict[str, Any]] = {}
    score = finite_number(ev.get("score"), lo=0.0, hi=1.0)
    if score is not None:
        counts = {k: ev.get(k) for k in ("tests_passed", "tests_total") if isinstance(ev.get(k), int)}
        scores["hidden_tests"] = {"value": score, "answer": outcome,
                                  "explanation": f"hidden tests: score {score:g}, threshold "
                                                 f"{finite_number(ev.get('threshold'), lo=0, hi=1)}",
                                  "metadata": {**counts, "grader_error": (
                                      clip_text(ev.get("grader_error"), 2000) if ev.get("grader_error")
                                      else None)}}
    scores["success"] = {"value": 1.0 if ev.get("success") is True else 0.0, "answer": outcome,
                         "explanation": "hidden tests passed at the threshold" if ev.get("success") is True
                         else f"not a success: {outcome}"}
    validity = clip_text(run.get("validity") or "unlabelled", 80)
    scores["validity"] = {"value": validity,
                          "explanation": clip_text(run.get("validity_reason") or validity, 2000)}
    return scores


def inspect_sample(run: Mapping[str, Any], sources: Sequence[SessionSource], sample_id: str, epoch: int,
                   model: str) -> dict[str, Any]:
    """One run as an Inspect sample (pure): its chat, scores, the audit findings and the
    pair/block ids in metadata, its tokens and metered cost as model_usage."""
    msgs = inspect_messages(sources, str(run.get("run_id")))
    audit = run.get("audit") if isinstance(run.get("audit"), dict) else {}
    findings = audit.get("findings") if isinstance(audit.get("findings"), list) else []
    usage = model_usage_of([s.ledger for s in sources], model)
    cost = round(math.fsum(u["total_cost"] for u in usage.values()), 6)
    meta = {"run_id": run.get("run_id"), "arm": run.get("arm"), "task": run.get("task"),
            "repeat": run.get("repeat"), "split": run.get("split"), "block": run.get("block"),
            "pair": f"{run.get('split')}/{run.get('task')}/repeat-{run.get('repeat')}",
            "order_in_block": run.get("order_in_block"), "status": run.get("status"),
            "outcome": run.get("outcome"), "validity": run.get("validity"),
            "validity_reason": run.get("validity_reason"), "failure_reason": run.get("failure_reason"),
            "gate_cycles": run.get("gate_cycles"), "gates": run.get("gates"),
            "review_verdicts": run.get("review_verdicts"), "fault": run.get("fault"),
            "audit_findings": findings[:200], "audit_flagged": audit.get("flagged"),
            "sandbox": run.get("sandbox"), "cost_usd_metered": cost,
            "cost_usd_reported": usd_from(run.get("cost_usd")), "cost_estimated": run.get("cost_estimated"),
            "sessions": [{"job_id": s.job_id, "role": s.role, "session_id": s.session_id,
                          "problems": list(s.problems), "garbage_lines": s.garbage_lines} for s in sources]}
    meta = json_safe(meta)
    last = next((m for m in reversed(msgs) if m["role"] == "assistant"), None)
    output: dict[str, Any] = {"model": model, "choices": [], "completion": ""}
    if last:
        output["choices"] = [{"message": last, "stop_reason": "stop"}]
        output["completion"] = last["content"]
    started, finished = iso_or_none(run.get("started_at")), iso_or_none(run.get("finished_at"))
    wall = finite_number(run.get("wall_s"), lo=0.0, hi=MAX_WALL_S_RECORD)
    inp = next((s.prompt for s in sources if s.prompt), None) or clip_text(run.get("task") or "")
    error = None
    if run.get("status") == "error":
        text = clip_text(run.get("error") or run.get("failure_reason") or "the run ended in error", 4000)
        error = {"message": text, "traceback": text, "traceback_ansi": text}
    sample = {"id": sample_id, "epoch": epoch, "input": inp,
              "target": "the hidden tests pass at the task's threshold", "messages": msgs, "output": output,
              "scores": _sample_scores(run), "metadata": meta, "store": {}, "events": [],
              "model_usage": usage, "started_at": started, "completed_at": finished, "total_time": wall,
              "working_time": wall, "error": error, "attachments": {},
              "uuid": hashlib.sha256(f"{sample_id}/{epoch}/{run.get('run_id')}".encode()).hexdigest()[:22]}
    return {k: v for k, v in sample.items() if v is not None}


INSPECT_SUMMARY_KEYS = ("id", "epoch", "input", "target", "metadata", "scores", "model_usage", "started_at",
                        "completed_at", "total_time", "working_time", "uuid")


def inspect_summary(sample: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: sample[k] for k in INSPECT_SUMMARY_KEYS if k in sample}
    out["completed"] = True
    out["message_count"] = len(sample.get("messages") or [])
    if sample.get("error"):
        out["error"] = sample["error"]["message"]
    return out


def _metric(name: str, value: float) -> dict[str, Any]:
    return {"name": name, "value": round(value, 6), "params": {}}


def inspect_results(samples: Sequence[Mapping[str, Any]], completed: int) -> dict[str, Any]:
    """The log's results (pure): per scorer the mean (and for validity the valid share)."""
    scores = []
    for name in ("hidden_tests", "success"):
        vals = [s["scores"][name]["value"] for s in samples if name in s["scores"]]
        scores.append({"name": name, "scorer": name, "scored_samples": len(vals),
                       "unscored_samples": len(samples) - len(vals), "params": {},
                       "metrics": {"mean": _metric("mean", math.fsum(vals) / len(vals) if vals else 0.0)}})
    labels = [s["scores"]["validity"]["value"] for s in samples]
    scores.append({"name": "validity", "scorer": "validity", "scored_samples": len(labels),
                   "unscored_samples": 0, "params": {},
                   "metrics": {"valid": _metric("valid", sum(1 for v in labels if v == "valid") / len(labels)
                                                if labels else 0.0)}})
    return {"total_samples": len(samples), "completed_samples": completed, "scores": scores}


def study_status(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The study's progress in words Inspect knows (pure): "success" once every run has ended
    (finished, error or interrupted), "started" while some have not; the counts by status."""
    by: dict[str, int] = {}
    for r in runs:
        key = str(r.get("status") or "unknown")[:40]
        by[key] = by.get(key, 0) + 1
    done = bool(runs) and all(r.get("status") in RUN_FINAL for r in runs)
    return {"inspect_status": "success" if done else "started", "runs_by_status": dict(sorted(by.items())),
            "complete": done}


def inspect_sample_ids(runs: Sequence[Mapping[str, Any]]) -> dict[str, tuple[str, int]]:
    """run id -> (sample id, epoch) (pure): the task and the repeat; when one arm holds the same
    task and repeat in several splits, the id also names the split."""
    seen: dict[tuple[str, str, int], int] = {}
    for r in runs:
        key = (str(r.get("arm")), str(r.get("task")), int(count_from(r.get("repeat"), hi=10**6)))
        seen[key] = seen.get(key, 0) + 1
    out = {}
    for r in runs:
        rep = int(count_from(r.get("repeat"), hi=10**6))
        key = (str(r.get("arm")), str(r.get("task")), rep)
        sid = str(r.get("task")) if seen[key] == 1 else f"{r.get('task')}.{r.get('split')}"
        out[str(r["run_id"])] = (sid, max(1, rep))
    return out


def inspect_log(study_name: str, arm: str, arm_cfg: Mapping[str, Any], cfg: Mapping[str, Any],
                runs: Sequence[Mapping[str, Any]], samples: Sequence[dict[str, Any]],
                status: Mapping[str, Any], run_id: str) -> dict[str, Any]:
    """An arm's eval log header (the log without its samples) (pure).  The key order is the one
    inspect-ai writes."""
    model = "anthropic/" + str(cfg.get("model") or "unknown")
    starts = sorted(s for s in (iso_or_none(r.get("started_at")) for r in runs) if s)
    ends = sorted(s for s in (iso_or_none(r.get("finished_at")) for r in runs) if s)
    created = starts[0] if starts else utc_now()
    eval_id = hashlib.sha256(f"{run_id}/{arm}".encode()).hexdigest()[:22]
    usage: dict[str, dict[str, Any]] = {}
    for s in samples:
        for name, u in s["model_usage"].items():
            tot = usage.setdefault(name, {k: 0 for k in u})
            for k, v in u.items():
                tot[k] = round(tot[k] + v, 6) if k == "total_cost" else tot[k] + v
    completed = sum(1 for r in runs if r.get("status") in RUN_FINAL)
    arm_meta = {"name": arm, "gate_cycles": arm_cfg.get("gate_cycles", 0),
                "review": bool(arm_cfg.get("review")), "preamble": arm_cfg.get("preamble"),
                "fork_base": bool(arm_cfg.get("fork_base"))}
    plan_steps = (["executor"] + (["gate_feedback"] if arm_meta["gate_cycles"] else [])
                  + (["reviewer", "repair"] if arm_meta["review"] else []))
    return {
        "version": INSPECT_LOG_VERSION, "status": status["inspect_status"],
        "eval": {"eval_id": eval_id, "run_id": run_id, "created": created, "task": arm, "task_id": eval_id,
                 "task_version": 0, "task_display_name": f"{study_name}: arm {arm}", "task_attribs": {},
                 "task_args": {}, "task_args_passed": {}, "solver": f"agentbench/{arm}",
                 "solver_args": json_safe(arm_meta), "tags": ["agentbench", f"arm:{arm}"],
                 "dataset": {"name": study_name, "samples": len(samples),
                             "sample_ids": sorted({s["id"] for s in samples})},
                 "model": model, "model_generate_config": {}, "model_args": {},
                 "config": {"epochs": max((s["epoch"] for s in samples), default=1)},
                 "packages": {"agentbench": VERSION},
                 "metadata": json_safe({"agentbench": {"study": study_name, "arm": arm_meta,
                                                       "study_status": status, "seed": cfg.get("seed"),
                                                       "effort": cfg.get("effort")}})},
        "plan": {"name": "plan", "steps": [{"solver": s, "params": {}} for s in plan_steps], "config": {}},
        "results": inspect_results(samples, completed),
        "stats": {"started_at": created, "completed_at": ends[-1] if ends and status["complete"] else "",
                  "model_usage": usage},
        "tags": [], "metadata": {}}


def _inspect_stamp(created: str) -> str:
    stamp = datetime.datetime.fromisoformat(created.replace("Z", "+00:00")).astimezone(datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H-%M-%S+00-00")


def write_eval_zip(path: Path, header: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> None:
    """An `.eval` file as inspect-ai lays it out, written aside and renamed into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("header.json", json.dumps(header, allow_nan=False))
            zf.writestr("summaries.json", json.dumps([inspect_summary(s) for s in samples], allow_nan=False))
            for s in samples:
                zf.writestr(f"samples/{s['id']}_epoch_{s['epoch']}.json", json.dumps(s, allow_nan=False))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def export_inspect(study: Study, out: Path) -> dict[str, Any]:
    """One Inspect eval log per arm: every run of the arm a sample (see inspect_sample)."""
    paths, cfg = study.paths, study.cfg
    arms_cfg = cfg.get("arms") if isinstance(cfg.get("arms"), dict) else {}
    runs = [load_run(paths, r) for r in all_run_ids(paths)]
    ids = inspect_sample_ids(runs)
    ledger = ledger_by_job(paths)
    status = study_status(runs)
    run_id = hashlib.sha256(str(paths.root.resolve()).encode()).hexdigest()[:22]
    model = "anthropic/" + str(cfg.get("model") or "unknown")
    logs = []
    for arm, arm_cfg in arms_cfg.items():
        arm_runs = [r for r in runs if r.get("arm") == arm]
        samples = []
        for r in arm_runs:
            jobs = [j for j in r.get("jobs") or [] if isinstance(j, dict)
                    and isinstance(j.get("job_id"), str) and JOB_ID_RE.match(j["job_id"])]
            sources = [load_session_source(paths, j["job_id"], ledger) for j in jobs]
            sid, epoch = ids[str(r["run_id"])]
            samples.append(inspect_sample(r, sources, sid, epoch, model))
        header = inspect_log(paths.root.name, arm, arm_cfg if isinstance(arm_cfg, dict) else {}, cfg,
                             arm_runs, samples, status, run_id)
        name = f"{_inspect_stamp(header['eval']['created'])}_{arm}_{header['eval']['eval_id']}.eval"
        logs.append((out / name, header, samples))
    for path, header, samples in logs:
        write_eval_zip(path, header, samples)
    listed = [{"file": p.name, "arm": h["eval"]["task"], "samples": len(s),
               "cost_usd": round(math.fsum(u["total_cost"] for u in h["stats"]["model_usage"].values()), 6)}
              for p, h, s in logs]
    return {"format": "inspect", "out": str(out), "status": status["inspect_status"],
            "study_status": status, "logs": listed,
            "next": f"inspect view --log-dir {out}"}


def export_study(study: Study, fmt: str, out: Path) -> dict[str, Any]:
    """`export`: the study in another tool's format under `out` (made if missing; files of the same
    names are replaced, so a second export of an unchanged study gives the same files)."""
    if fmt not in EXPORT_FORMATS:
        raise AgentbenchError("unknown export format", code="unknown_export_format", format=fmt,
                              formats=list(EXPORT_FORMATS))
    if out.exists() and not out.is_dir():
        raise AgentbenchError("--out is not a directory", code="export_out_not_a_directory", out=str(out),
                              hint="name a new or existing directory")
    if _inside(out, study.paths.root / STATE_DIR) or _inside(out, study.paths.runs):
        raise AgentbenchError("--out lies inside the study's state or runs", code="export_out_inside_study",
                              out=str(out),
                              hint="export to a directory outside <study>/state and <study>/runs")
    study.cfg   # noqa: B018 (a study that cannot be read is refused before anything is written)
    out.mkdir(parents=True, exist_ok=True)
    return export_inspect(study, out) if fmt == "inspect" else export_atif(study.paths, out)


# -- Harbor tasks ----------------------------------------------------------------------------------
# A Harbor task directory: instruction.md, task.toml, environment/ (a Dockerfile or compose file and
# the files it copies), tests/test.sh (writes /logs/verifier/reward.txt, one number, or reward.json,
# a dict of numbers), solution/solve.sh.  It becomes a bundle: TASK.md and the starter files in
# public/, a syntax gate (Harbor tasks have no public checks), the tests and a harness in oracle/
# (run with the container paths bound: the workspace at the workdir, /tests read-only, an empty
# /logs/verifier), solve.sh as a reference script.  What needs the image is listed, not faked.

#: A Harbor task directory larger than this (or with more files) is refused as not a task.
HARBOR_TASK_MAX_BYTES = 64 * 2**20
HARBOR_TASK_MAX_FILES = 5000
HARBOR_DEFAULT_WORKDIR = "/app"
HARBOR_VERIFIER_TIMEOUT_S = 600.0
HARBOR_REQUIRED = ("instruction.md", "task.toml", "tests/test.sh", "solution/solve.sh", "environment")
#: Files of environment/ that describe the image rather than belong in it.
HARBOR_IMAGE_FILES = frozenset({"Dockerfile", "docker-compose.yaml", "docker-compose.yml", "compose.yaml",
                                "compose.yml", ".dockerignore"})

#: The oracle harness of an imported task (written into oracle/harbor_verifier.py).  It runs the
#: task's tests/test.sh as the Harbor verifier does, in the workdir, with nothing of its own open
#: to the test (the receipt channel is closed in the child), then reads the reward the tests wrote
#: and writes one receipt line on the channel.
HARBOR_VERIFIER_PY = '''"""agentbench's harness for an imported Harbor task: run /tests/test.sh in the
workdir, read the reward it wrote under /logs/verifier and write one JSON receipt on the receipt channel.
Usage: harbor_verifier.py RECEIPT_FD WORKDIR THRESHOLD"""
import json
import math
import os
import subprocess
import sys

fd, workdir, threshold = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
# The channel is never handed to a child, and this process is made non-dumpable (Linux), so the
# code under test that test.sh runs cannot take the descriptor through /proc.
os.set_inheritable(fd, False)
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
except (OSError, AttributeError):
    pass
logs = "/logs/verifier"
proc = subprocess.run(["bash", "/tests/test.sh"], cwd=workdir, stdin=subprocess.DEVNULL,
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True)
sys.stdout.write(proc.stdout.decode("utf-8", "replace")[-20000:])
reward, problem, raw = 0.0, None, None


def read(name):
    path = os.path.join(logs, name)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        return fh.read(65536).decode("utf-8", "replace")


text = read("reward.txt")
if text is not None:
    raw = text.strip()
    try:
        reward = float(raw)
    except ValueError:
        problem = "reward.txt does not hold one number"
else:
    text = read("reward.json")
    if text is None:
        problem = "the tests wrote no reward.txt or reward.json under /logs/verifier"
    else:
        try:
            raw = json.loads(text)
        except ValueError:
            raw = None
        nums = raw if isinstance(raw, dict) else {}
        vals = [v for v in nums.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not nums or len(vals) != len(nums):
            problem = "reward.json is not an object of numbers"
        else:
            reward = float(nums["reward"]) if "reward" in nums else sum(vals) / len(vals)
if problem is None and not (math.isfinite(reward) and 0.0 <= reward <= 1.0):
    problem = "the reward is not a number in [0, 1]"
score = reward if problem is None else 0.0
passed = problem is None and score >= threshold
receipt = {"passed": passed, "score": score, "harbor_reward": raw if isinstance(raw, (str, dict)) else None,
           "checks": [{"id": "test.sh", "passed": proc.returncode == 0,
                       "detail": "exit %d" % proc.returncode},
                      {"id": "reward", "passed": passed, "detail": problem or "reward %g" % reward}]}
os.write(fd, (json.dumps(receipt) + "\\n").encode())
os.close(fd)
sys.exit(0 if passed else 1)
'''

#: The gate of an imported task (gate/syntax_gate.py): Harbor tasks have no public checks, so the
#: gate checks only that the workspace's Python files compile and its shell scripts parse.
HARBOR_SYNTAX_GATE_PY = '''"""agentbench's gate for an imported Harbor task (which has no public checks):
every Python file of the workspace compiles and every shell script parses.  Usage: syntax_gate.py WORKSPACE"""
import json
import os
import subprocess
import sys

root = sys.argv[1]
checks = []
for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__"))
    for name in sorted(filenames):
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        if os.path.islink(path) or not name.endswith((".py", ".sh")):
            continue
        if name.endswith(".py"):
            try:
                with open(path, "rb") as fh:
                    compile(fh.read(), rel, "exec", dont_inherit=True)
                checks.append({"id": rel, "passed": True, "detail": "compiles"})
            except (SyntaxError, ValueError) as exc:
                checks.append({"id": rel, "passed": False, "detail": str(exc)[:300]})
        else:
            res = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
            checks.append({"id": rel, "passed": res.returncode == 0,
                           "detail": res.stderr.strip()[:300] or "parses"})
passed = all(c["passed"] for c in checks)
print(json.dumps({"passed": passed, "score": 1.0 if passed else 0.0, "checks": checks,
                  "tests_passed": sum(c["passed"] for c in checks), "tests_total": len(checks)}))
sys.exit(0 if passed else 1)
'''


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """task.toml as a dict, with the standard library's reader (Python 3.11 and later)."""
    try:
        import tomllib
    except ImportError:
        raise AgentbenchError("reading task.toml needs Python 3.11 or later (the standard tomllib)",
                              code="toml_reader_missing", path=where,
                              hint="run import-tasks with python3.11 or later; the tasks it writes "
                                   "run on any supported Python") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AgentbenchError("task.toml is not valid TOML", code="harbor_task_toml_invalid", path=where,
                              detail=str(exc)[:300]) from None


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments left out
    (pure)."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    if buf.strip():
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _copy_args(args: str) -> tuple[list[str], bool] | None:
    """A COPY/ADD's paths (sources then destination) and whether it copies from another stage or
    image (pure); None when they cannot be read."""
    words = args.split()
    from_other = any(w.startswith("--from") for w in words)
    words = [w for w in words if not w.startswith("--")]
    rest = " ".join(words)
    if rest.startswith("["):
        try:
            parts = json.loads(rest)
        except ValueError:
            return None
        return ([str(p) for p in parts], from_other) if isinstance(parts, list) and len(parts) >= 2 else None
    return (words, from_other) if len(words) >= 2 else None


def harbor_environment_plan(dockerfile: str | None, env_files: Sequence[str], workdir_cfg: str | None
                            ) -> dict[str, Any]:
    """What of a Harbor environment carries over (pure): the workdir (task.toml's, else the
    Dockerfile's last WORKDIR, else /app), starter files as {environment-relative source: path in
    the workspace} (what the Dockerfile COPYs into the workdir; without any COPY, every plain file
    of environment/), and what cannot: the base image, RUN steps, ENV, files copied elsewhere."""
    lost: list[str] = []
    steps = dockerfile_instructions(dockerfile) if dockerfile is not None else []
    workdir = workdir_cfg
    current = "/"
    copies: list[tuple[list[str], str]] = []
    for word, args in steps:
        if word == "FROM":
            lost.append(f"the base image {args.split()[0] if args else '?'} (its packages and files: "
                        "this host's are used)")
        elif word == "WORKDIR":
            current = posixpath.normpath(posixpath.join(current, args.strip().strip('"')))
            workdir = workdir_cfg or current
        elif word in ("COPY", "ADD"):
            parsed = _copy_args(args)
            if parsed is None or parsed[1]:
                lost.append(f"Dockerfile {word} {args[:150]} (from another image or unreadable)")
                continue
            paths, _ = parsed
            if any("://" in p for p in paths[:-1]):
                lost.append(f"Dockerfile {word} {args[:150]} (a download)")
                continue
            dest = posixpath.normpath(posixpath.join(current, paths[-1]))
            copies.append((paths[:-1], dest + ("/" if paths[-1].endswith("/") else "")))
        elif word in ("RUN", "ENV", "USER", "ARG", "EXPOSE", "VOLUME", "SHELL"):
            lost.append(f"Dockerfile {word} {args[:200]}")
    workdir = workdir or HARBOR_DEFAULT_WORKDIR
    files: dict[str, str] = {}
    if not copies:
        for rel in env_files:
            if "/" in rel or rel not in HARBOR_IMAGE_FILES:
                files[rel] = rel
        return {"workdir": workdir, "files": files, "not_carried_over": lost}
    for sources, dest in copies:
        for src in sources:
            src_n = posixpath.normpath(src).lstrip("/")
            placed: list[tuple[str, str]] = []
            if src_n in ("", "."):
                placed = [(r, posixpath.join(dest, r)) for r in env_files
                          if not ("/" not in r and r in HARBOR_IMAGE_FILES)]
            elif src_n in env_files:
                into_dir = dest.endswith("/") or len(sources) > 1
                placed = [(src_n, posixpath.join(dest, posixpath.basename(src_n)) if into_dir else dest)]
            elif any(r.startswith(src_n + "/") for r in env_files):
                placed = [(r, posixpath.join(dest, r[len(src_n) + 1:])) for r in env_files
                          if r.startswith(src_n + "/")]
            else:
                placed = [(r, posixpath.join(dest, posixpath.basename(r))) for r in env_files
                          if fnmatch.fnmatch(r, src_n)]
            if not placed:
                lost.append(f"Dockerfile COPY source {src[:150]} (not in environment/)")
            for rel, target in placed:
                target = posixpath.normpath(target)
                if not target.startswith(workdir.rstrip("/") + "/"):
                    lost.append(f"environment/{rel} (copied to {target}, outside the workdir {workdir})")
                    continue
                files[rel] = target[len(workdir.rstrip("/")) + 1:]
    return {"workdir": workdir, "files": files, "not_carried_over": lost}


def harbor_config_losses(cfg: Mapping[str, Any]) -> list[str]:
    """What of task.toml agentbench cannot honour (pure)."""
    lost: list[str] = []
    env = cfg.get("environment") if isinstance(cfg.get("environment"), dict) else {}
    if env.get("docker_image"):
        lost.append(f"the prebuilt image {str(env['docker_image'])[:150]} (its packages and files)")
    if env.get("gpus") or env.get("gpu_types") or env.get("tpu"):
        lost.append(f"accelerators (gpus = {env.get('gpus')!r:.40}, "
                    f"gpu_types = {env.get('gpu_types')!r:.80})")
    if env.get("allow_internet") or env.get("network_mode") not in (None, "none", "no-network"):
        lost.append("network access as the task asks it (allow_internet / network_mode): the sandbox's "
                    "own network policy applies")
    for key in ("cpus", "memory_mb", "storage_mb"):
        if env.get(key) is not None:
            lost.append(f"the resource limit {key} = {env[key]!r:.40} (not enforced)")
    for key in ("env", "mcp_servers", "healthcheck", "skills_dir"):
        if env.get(key):
            lost.append(f"[environment] {key}")
    for part in ("agent", "verifier", "solution"):
        sec = cfg.get(part) if isinstance(cfg.get(part), dict) else {}
        for key in ("env", "user", "allowed_hosts", "network_mode"):
            if sec.get(key):
                lost.append(f"[{part}] {key}")
    return lost


def _harbor_files(root: Path) -> tuple[list[str], list[str]]:
    """Every file of a task directory (relative), and its problems: links, special files, size."""
    files, problems, total = [], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                problems.append(f"{rel} is a link")
            elif stat.S_ISREG(st.st_mode):
                files.append(rel)
                total += st.st_size
            elif not stat.S_ISDIR(st.st_mode):
                problems.append(f"{rel} is not a file or directory")
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__")
                             and not os.path.islink(os.path.join(dirpath, d)))
        if len(files) > HARBOR_TASK_MAX_FILES or total > HARBOR_TASK_MAX_BYTES:
            problems.append(f"more than {HARBOR_TASK_MAX_FILES} files or {HARBOR_TASK_MAX_BYTES} bytes")
            break
    return sorted(files), problems


def _seconds(value: Any, default: float) -> float | None:
    if value is None:
        return default
    got = finite_number(value, lo=1.0, hi=MAX_CHECK_TIMEOUT_S)
    return got


def plan_harbor_task(root: Path) -> dict[str, Any]:
    """A Harbor task directory read and checked: what the bundle will hold, or its problems (the
    caller refuses a task with any).  Reads only; the files are small and checked for links."""
    problems: list[str] = []
    if not NAME_RE.match(root.name):
        problems.append("its directory name is not a task id (1-64 letters, digits, '.', '_' or '-')")
    missing = [p for p in HARBOR_REQUIRED if not (root / p).exists()]
    if missing:
        return {"id": root.name, "problems": problems + [f"lacks {m}" for m in missing]}
    files, file_problems = _harbor_files(root)
    problems += file_problems
    if problems:
        return {"id": root.name, "problems": problems}
    toml_path = root / "task.toml"
    cfg = parse_toml(toml_path.read_text(encoding="utf-8", errors="replace"), str(toml_path))
    verifier = cfg.get("verifier") if isinstance(cfg.get("verifier"), dict) else {}
    agent = cfg.get("agent") if isinstance(cfg.get("agent"), dict) else {}
    env_cfg = cfg.get("environment") if isinstance(cfg.get("environment"), dict) else {}
    verifier_s = _seconds(verifier.get("timeout_sec"), HARBOR_VERIFIER_TIMEOUT_S)
    agent_s = _seconds(agent.get("timeout_sec"), DEFAULT_ORACLE_TIMEOUT_S)
    if verifier_s is None or agent_s is None:
        problems.append("a timeout_sec in task.toml is not a number of seconds in "
                        f"[1, {MAX_CHECK_TIMEOUT_S:g}]")
    workdir_cfg = env_cfg.get("workdir")
    if workdir_cfg is not None and not isinstance(workdir_cfg, str):
        problems.append("[environment] workdir is not a path")
        workdir_cfg = None
    env_files = [f[len("environment/"):] for f in files if f.startswith("environment/")]
    dockerfile = None
    if (root / "environment" / "Dockerfile").is_file():
        dockerfile = (root / "environment" / "Dockerfile").read_text(encoding="utf-8", errors="replace")
    env_plan = harbor_environment_plan(dockerfile, env_files, workdir_cfg)
    container = {"workdir": env_plan["workdir"], "ro": {"/tests": "tests"}, "scratch": ["/logs/verifier"]}
    bad = container_spec_problem(container)
    if bad:
        problems.append(f"its workdir cannot be given here: {bad}")
    if any(f.split("/")[-1] in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
           for f in env_files if "/" not in f):
        problems.append("its environment is a multi-container compose file (one workspace is all "
                        "agentbench has)")
    lost = harbor_config_losses(cfg) + env_plan["not_carried_over"]
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    instruction = (root / "instruction.md").read_text(encoding="utf-8", errors="replace")
    title = next((ln.lstrip("# ").strip() for ln in instruction.splitlines() if ln.strip()), root.name)[:120]
    return {"id": root.name, "problems": problems, "root": root, "files": files, "title": title,
            "instruction": instruction, "workdir": env_plan["workdir"], "starter": env_plan["files"],
            "not_carried_over": lost, "verifier_timeout_s": verifier_s, "agent_timeout_s": agent_s,
            "metadata": json_safe({k: v for k, v in meta.items()
                                   if isinstance(v, (str, int, float, bool, list))}),
            "container": container}


def harbor_task_json(plan: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The task.json of an imported Harbor task (pure)."""
    wd = plan["workdir"]
    return {
        "id": plan["id"], "title": plan["title"],
        "gate": {"cmd": ["{python}", "{gate}/syntax_gate.py", "{workspace}"], "timeout_s": 120,
                 "receipt": "json"},
        "oracle": {"cmd": ["{python}", "{oracle}/harbor_verifier.py", "{receipt_fd}", "{workspace}", "1.0"],
                   "timeout_s": plan["verifier_timeout_s"], "threshold": 1.0, "container": plan["container"]},
        "reference": {"cmd": ["bash", "/solution/solve.sh"], "timeout_s": plan["agent_timeout_s"],
                      "container": {"workdir": wd, "ro": {"/solution": "solution"}, "scratch": []}},
        "check_hint": (f"This task comes from a Harbor task: paths under {wd} in TASK.md mean your working "
                       "directory. There are no public tests; the hidden tests grade the result."),
        "not_carried_over": plan["not_carried_over"],
        "harbor": {"source": source, "workdir": wd, "metadata": plan["metadata"],
                   "agent_timeout_s": plan["agent_timeout_s"],
                   "verifier_timeout_s": plan["verifier_timeout_s"]},
    }


def write_harbor_bundle(plan: Mapping[str, Any], dst: Path) -> None:
    """The bundle of one checked plan, written under `dst` (a new directory)."""
    root: Path = plan["root"]
    (dst / "public").mkdir(parents=True)
    note = (f"> Imported from a Harbor task: `{plan['workdir']}` in this text is your working directory.\n\n")
    write_text_atomic(dst / "public" / "TASK.md", note + plan["instruction"])
    for src, rel in sorted(plan["starter"].items()):
        if rel == "TASK.md":
            continue
        (dst / "public" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / "environment" / src, dst / "public" / rel)
    (dst / "gate").mkdir()
    write_text_atomic(dst / "gate" / "syntax_gate.py", HARBOR_SYNTAX_GATE_PY)
    shutil.copytree(root / "tests", dst / "oracle" / "tests")
    write_text_atomic(dst / "oracle" / "harbor_verifier.py", HARBOR_VERIFIER_PY)
    shutil.copytree(root / "solution", dst / "reference" / "solution")
    shutil.copyfile(root / "task.toml", dst / "harbor-task.toml")
    write_json_atomic(dst / "task.json", harbor_task_json(plan, root.name))


def import_harbor_tasks(dirs: Sequence[Path], out: Path) -> dict[str, Any]:
    """`import-tasks --from harbor`: every directory checked first (a bad or partial one, or one
    whose id is taken in `out` or twice in the call, refuses the whole call by name, nothing
    written), then each written as a new bundle under `out` (staged beside, renamed in)."""
    if out.exists() and not out.is_dir():
        raise AgentbenchError("--tasks is not a directory", code="tasks_out_not_a_directory", tasks=str(out))
    plans, refused = [], {}
    for d in dirs:
        if not d.is_dir():
            refused[str(d)] = ["not a directory"]
            continue
        plan = plan_harbor_task(d)
        if plan["id"] in [p["id"] for p in plans]:
            plan["problems"].append("another directory of this call has the same name")
        if (out / plan["id"]).exists():
            plan["problems"].append(f"{out / plan['id']} exists already")
        if plan["problems"]:
            refused[str(d)] = plan["problems"]
        else:
            plans.append(plan)
    if refused:
        raise AgentbenchError("some Harbor task directories cannot be imported; nothing was written",
                              code="harbor_task_refused", refused=refused,
                              hint="a Harbor task needs instruction.md, task.toml, environment/, "
                                   "tests/test.sh and solution/solve.sh, and no links")
    if not plans:
        raise AgentbenchError("no task directories given", code="no_task_directories")
    out.mkdir(parents=True, exist_ok=True)
    stage = out / f".import-{uuid.uuid4().hex[:8]}"
    try:
        for plan in plans:
            write_harbor_bundle(plan, stage / plan["id"])
        for plan in plans:
            os.rename(stage / plan["id"], out / plan["id"])
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"imported": [{"task": p["id"], "path": str(out / p["id"]), "workdir": p["workdir"],
                          "starter_files": sorted(p["starter"].values()),
                          "oracle_timeout_s": p["verifier_timeout_s"],
                          "reference_timeout_s": p["agent_timeout_s"],
                          "not_carried_over": p["not_carried_over"]} for p in plans],
            "tasks": str(out),
            "next": "python3 agentbench.py calibrate --study <study whose `tasks` is this directory>"}


# ==================================================================================================
# The CLI and main
# ==================================================================================================
# Argument parsing (a parser that raises instead of printing or exiting), the command table, the
# child-marker refusal, and main(): the one boundary that catches errors and prints exactly one
# JSON object.  Handlers return (exit code, object); they never print to stdout.  Owns flags and
# their bounds.  Must not hold business logic that a lower layer could own.

#: Bounds of whole-number flags: a value outside is refused by the flag's name (exit 2), never
#: replaced by a default or passed on as it is.
FLAG_INT_BOUNDS = {"max_turns": (1, 10_000), "parallel": (1, 256), "repeats": (1, 1_000),
                   "limit": (0, 1_000_000)}
#: Longest wall-time a flag may give one session or run (30 days), in seconds.
MAX_WALL_S = 30 * 86400.0


def bounded_int(name: str) -> Callable[[str], int]:
    """argparse type: a whole number within FLAG_INT_BOUNDS[name] (the error names the range)."""
    lo, hi = FLAG_INT_BOUNDS[name]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range [{lo}, {hi}]")
        return value
    return parse


def wall_seconds(text: str) -> float:
    """argparse type: a wall time in seconds, finite, > 0 and at most MAX_WALL_S."""
    value = finite_float(text)
    if not 0 < value <= MAX_WALL_S:
        raise argparse.ArgumentTypeError(f"{value:g} is out of range (0, {MAX_WALL_S:g}]")
    return value


class _ArgParser(argparse.ArgumentParser):
    """argparse that raises AgentbenchError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise AgentbenchError("bad arguments", code="bad_arguments",
                              detail=message, command=self.prog.split()[-1],
                              hint=f"see `agentbench.py {self.prog.split()[-1]} --help`")

    def exit(self, status: int = 0, message: str | None = None) -> Any:  # type: ignore[override]
        raise AgentbenchError("bad arguments", code="bad_arguments", detail=(message or "").strip())

    def print_help(self, file: Any = None) -> None:
        return None


@dataclass
class Ctx(Host):
    """What a command handler may use: the host (platform, environment), the cwd, an early emitter."""
    cwd: str
    emit: Callable[[dict[str, Any]], None]
    is_child: bool

    def study(self, args: argparse.Namespace, must_exist: bool = True) -> StudyPaths:
        root = resolve_study_dir(getattr(args, "study", None), self.env, self.cwd, self.platform, must_exist)
        return StudyPaths(root)


@dataclass
class Command:
    name: str
    summary: str
    handler: Callable[[Ctx, argparse.Namespace], tuple[int, dict[str, Any]] | dict[str, Any] | None]
    configure: Callable[[argparse.ArgumentParser], None]
    mutating: bool
    hidden: bool = False


COMMANDS: dict[str, Command] = {}


def command(name: str, summary: str, *, mutating: bool, hidden: bool = False) -> Callable[..., Any]:
    """Register a handler; the decorated function's `configure` attribute adds its arguments."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        COMMANDS[name] = Command(name, summary, fn, getattr(fn, "configure", lambda p: None), mutating,
                                 hidden)
        return fn
    return deco


def args_of(configure: Callable[[argparse.ArgumentParser], None]
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.configure = configure  # type: ignore[attr-defined]
        return fn
    return deco


def _study_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="study directory (default $AGENTBENCH_STUDY, else the cwd)")


def launch_flags(args: argparse.Namespace) -> LaunchFlags:
    """The session-limit flags of _launch_args as plain values."""
    return LaunchFlags(max_budget_usd=getattr(args, "max_budget_usd", None),
                       wall_s=getattr(args, "wall_s", None), max_turns=getattr(args, "max_turns", None),
                       orphan_after_s=getattr(args, "orphan_after_s", None),
                       fault=getattr(args, "fault", None))


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-budget-usd", type=finite_float, dest="max_budget_usd",
                   help="cost limit of this session in USD (default: the study's budget.usd_per_run)")
    p.add_argument("--wall-s", type=wall_seconds, dest="wall_s",
                   help="wall-time limit of this session in seconds (default: the study's max_minutes)")
    p.add_argument("--max-turns", type=bounded_int("max_turns"), dest="max_turns",
                   help="claude --max-turns of this session (default: the study's budget.max_turns)")
    p.add_argument("--orphan-after-s", type=finite_float, dest="orphan_after_s",
                   help="kill the job if no orchestrator call arrives for this long (0 = off)")
    p.add_argument("--fault", help="interrupt:after_tool_uses=N")


# -- where -----------------------------------------------------------------------------------------

def _where_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--check-api", action="store_true",
                   help="ask the upstream one free request (count_tokens) with the credential the "
                        "gateway would carry: is it reachable, is the key accepted")


@command("where", "preflight: python, uv, claude, git, platform, env scrub report, warnings", mutating=False)
@args_of(_where_args)
def cmd_where(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    warnings: list[str] = []
    cfg_binary = None
    study = None
    executor = "local"
    gateway_mode = GATEWAY_DEFAULT
    study_env: dict[str, str] = {}
    sandbox_mode = sandbox_default()
    study_cfg: dict[str, Any] = {}
    study_error = None
    open_arms: list[str] = []
    try:
        paths = ctx.study(args)
        study = str(paths.root)
        study_cfg = load_study_config(paths)
        gateway_mode = str(study_cfg.get("gateway") or GATEWAY_DEFAULT)
        study_env = dict(study_cfg.get("env") or {})
        cfg_binary = study_cfg.get("binary")
        executor = str(study_cfg.get("executor") or "local")
        sandbox_mode = sandbox_mode_of(study_cfg)
        open_arms = list(study_cfg.get("network_open_arms") or [])
        readded = sorted(k for k in (study_cfg.get("env") or {})
                         if k in ENV_DROP_EXACT or k.startswith(ENV_DROP_PREFIXES))
        if readded:
            warnings.append("the study's env sets variables the scrub drops by default: "
                            + ", ".join(readded))
    except AgentbenchError as exc:
        if study is not None:   # no study given is fine here; a broken one is worth saying
            warnings.append("study: " + exc.one_line())
        if getattr(args, "study", None) and study is None:
            study_error = exc   # a study named on the command line that is not one: an error
    binary, how = find_claude_binary(cfg_binary, ctx.env)
    version = claude_version(binary, ctx.platform) if binary else None
    if not binary:
        warnings.append(f"claude binary not found: install @anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}")
    elif version and version != CLAUDE_CODE_PINNED:
        warnings.append(f"claude {version} differs from the tested release {CLAUDE_CODE_PINNED}")
    elif binary and not version:
        warnings.append("claude did not answer --version")
    base_url = ctx.env.get("ANTHROPIC_BASE_URL")
    if base_url and base_url.rstrip("/") != "https://api.anthropic.com":
        warnings.append(f"ANTHROPIC_BASE_URL is set to a non-default endpoint: {base_url}")
    _, report = scrub_env(ctx.env, for_claude=True, binary=binary)
    if report["unknown_claude_vars"]:
        warnings.append("unknown CLAUDE_*/ANTHROPIC_* variables are "
                        + ("withheld from claude (not on its allow-list): " if gateway_mode == "on"
                           else "passed to claude: ") + ", ".join(report["unknown_claude_vars"]))
    # What `claude` itself gets (names only): with the gateway on, its URL and a job token.
    host = {k: v for k, v in ctx.env.items() if not is_credential_var(k)}
    secret = {k: v for k, v in ctx.env.items() if is_credential_var(k)}
    placeholder = {"ANTHROPIC_BASE_URL": "http://127.0.0.1:<port>", GATEWAY_TOKEN_VAR: "<job token>"}
    _, claude_report = claude_env(host, extra=study_env,
                                  gateway=placeholder if gateway_mode == "on" else None,
                                  secret=secret, binary=binary)
    env_all = {**ctx.env, **study_env}
    credentials = sorted(k for k in GATEWAY_WITHHELD if k != "ANTHROPIC_BASE_URL" and env_all.get(k))
    if gateway_mode == "on":
        refusal = gateway_refusal(env_all, gateway_mode)
        if refusal is not None and env_all.get("AGENTBENCH_OFFLINE") != "1":
            warnings.append("real sessions (run, spawn, train) would be refused: " + refusal.one_line())
    slurm_tools = {name: shutil.which(name, path=ctx.env.get("PATH"))
                   for name in ("sbatch", "squeue", "scancel")}
    if executor == "slurm" and not all(slurm_tools.values()):
        warnings.append("the study's executor is slurm but these Slurm commands are not on PATH: "
                        + ", ".join(n for n, v in slurm_tools.items() if not v))
    probe = sandbox_probe(ctx.env)
    kind = sandbox_decision(sandbox_mode, bool(probe["available"]))
    if kind == "refuse":
        warnings.append(("the study requires sandbox bwrap: its Slurm jobs need bubblewrap on the "
                         "compute nodes; "
                         if executor == "slurm" else
                         "the study requires sandbox bwrap, so launches are refused: ")
                        + str(probe["reason"]))
    elif kind == "none" and sandbox_mode == "auto":
        warnings.append("sessions and checks will run unsandboxed here: " + str(probe["reason"]))
    view = sandbox_view(binary, ctx.env)
    if kind == "bwrap" and view["seccomp"]["arch"] is None:
        warnings.append("sandboxed processes run without the seccomp filter here: "
                        + str(view["seccomp"]["reason"]))
    sandbox = {**probe, "study_mode": sandbox_mode, "demanded": sandbox_mode == "bwrap",
               "here": kind, "decided_on": "each compute node" if executor == "slurm" else "this host",
               "view": view, "network_open_arms": open_arms}
    git = shutil.which("git")
    git_version = None
    if git:
        res = run_command([git, "--version"], cwd=ctx.cwd, env=ctx.env, timeout_s=20, platform=ctx.platform)
        git_version = res.stdout.strip() or None
    else:
        warnings.append("git not found: workspaces cannot be versioned")
    # Usable = a binary that answers --version; without one nothing can run, and `where` says so
    # with exit 2 (the whole report is still given).
    reasons = []
    if not binary:
        reasons.append(f"no claude binary found ({how})")
    elif not version:
        reasons.append(f"the claude binary at {binary} did not answer --version")
    api = None
    if args.check_api:
        api = check_upstream(env_all, str(study_cfg.get("model") or DEFAULT_LAUNCH["model"]))
        if not api["ok"]:
            reasons.append(api["reason"])
    if study_error is not None:
        reasons.insert(0, study_error.payload["error"] + ": " + str(args.study))
    out = {"ok": not reasons, "reasons": reasons, "agentbench": VERSION, "credentials": credentials,
           "api_check": api,
            "python": {"version": pyplatform.python_version(), "executable": sys.executable},
            "uv": shutil.which("uv"), "claude": {"path": binary, "found_by": how, "version": version,
                                                 "pinned": CLAUDE_CODE_PINNED},
            "git": {"path": git, "version": git_version},
            "executor": {"kind": executor, "slurm_commands": slurm_tools},
            "platform": {"seam": ctx.platform.name, "system": pyplatform.system(),
                         "release": pyplatform.release()},
            "env_scrub": {**report, "drop_exact": sorted(ENV_DROP_EXACT),
                          "drop_prefixes": list(ENV_DROP_PREFIXES),
                          "credential_vars": sorted(CREDENTIAL_VARS), "pinned_values": ENV_PINNED},
            "claude_env": claude_report, "sandbox": sandbox,
            "study": study, "warnings": warnings}
    if study_error is not None:
        out.update(error=study_error.payload["error"], code=study_error.payload["code"],
                   hint=study_error.payload.get("hint"))
    elif api is not None and not api["ok"]:
        out.update(error=api["reason"], code=api["problem"],
                   hint="check ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN), ANTHROPIC_BASE_URL "
                        "and the network")
    return (0 if out["ok"] else 2), out


# -- init ------------------------------------------------------------------------------------------

def _init_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help="the study directory (created if missing)")
    for setting in STUDY_SETTINGS:
        if setting.flag is not None:
            p.add_argument("--" + setting.key.replace("_", "-"), dest=setting.key, type=setting.flag,
                           help=setting.help)
    for key, (typ, text) in BUDGET_SETTINGS.items():
        p.add_argument("--" + key.replace("_", "-"), dest=key, type=typ, help=f"budget.{key}: {text}")
    p.add_argument("--reset-breaker", action="store_true",
                   help="resume a study paused by its circuit breaker")
    p.add_argument("--slurm-partition",
                   help="the Slurm partition of the study's jobs (with --executor slurm)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every claude session of the study (repeatable; "
                        "KEY= removes it), e.g. ANTHROPIC_BASE_URL of a `serve-model`")


@command("init", "create or update a study (study.json and its state dir); idempotent", mutating=True)
@args_of(_init_args)
def cmd_init(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(ctx.platform.normalize_path(args.study if os.path.isabs(args.study)
                                            else os.path.join(ctx.cwd, args.study)))
    paths = StudyPaths(root)
    existing = read_json(paths.study_file, default=None) if paths.study_file.exists() else None
    if existing is not None and not isinstance(existing, dict):
        raise AgentbenchError("study.json must hold a JSON object", code="study_json_hold_json_object",
                              path=str(paths.study_file))
    cfg, changed = merge_study_config(
        existing, {st.key: getattr(args, st.key) for st in STUDY_SETTINGS if st.flag is not None},
        {key: getattr(args, key) for key in BUDGET_SETTINGS}, slurm_partition=args.slurm_partition,
        env_items=args.env)
    if not cfg.get("arms"):
        # A study needs an arm; the first one is the report's baseline.  Others are added to
        # study.json by hand (see the README's "Your first study").
        cfg["arms"] = {"baseline": {}}
        changed.append("arms")
    check_study_shape(cfg)
    validate_launch_values(cfg)
    if cfg.get("permission_mode") == "bypassPermissions" and hasattr(os, "geteuid") and os.geteuid() == 0:
        raise AgentbenchError("claude refuses bypassPermissions when run as root",
                              code="bypass_permissions_as_root",
                              hint="use --permission-mode dontAsk with allow rules (--allowed-tools)")
    # Validate everything first, then write.
    paths.state.mkdir(parents=True, exist_ok=True)
    if existing is None or changed:
        # In the user's key order: the first arm is the report's default baseline.
        write_json_atomic(paths.study_file, cfg, sort_keys=False)
    if args.reset_breaker:
        with RegistryLock(paths.lock, ctx.platform):
            reg = read_registry(paths)
            reg["breaker"] = None
            write_json_atomic(paths.registry, reg)
        changed.append("breaker")
    if not paths.registry.exists():
        with RegistryLock(paths.lock, ctx.platform):
            if not paths.registry.exists():
                write_json_atomic(paths.registry, read_registry(paths))
    tdir = tasks_dir(paths, cfg)
    has_tasks = tdir.is_dir() and any((sub / "task.json").is_file() for sub in tdir.iterdir())
    study = shlex.quote(str(root))
    return {"study": str(root), "created": existing is None, "changed": changed, "config": cfg,
            "launch": launch_config(cfg),
            "next": (f"python3 agentbench.py calibrate --study {study}" if has_tasks
                     else f"python3 agentbench.py new-task --study {study} --task NAME")}


# -- train / spawn / continue ----------------------------------------------------------------------

def _train_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--base", help="the base's name (default: the task id with --task)")
    p.add_argument("--brief",
                   help="file holding the training prompt (default with --task: templates/train_base.md)")
    p.add_argument("--task",
                   help="train on a copy of this task's public files (a per-task base runs fork from)")
    p.add_argument("--workspace", help="the base's cwd (default: a new dir in the study)")
    p.add_argument("--replace", action="store_true", help="retrain a base that already exists")
    _launch_args(p)


@command("train", "train a base session that runs fork from (same context, read from the prompt cache)",
         mutating=True)
@args_of(_train_args)
def cmd_train(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return train_base(ctx, load_study(ctx.study(args)), cwd=ctx.cwd, base=args.base, task_id=args.task,
                      brief=args.brief, workspace=args.workspace, replace=args.replace,
                      flags=launch_flags(args))


def _spawn_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--base", help="fork this base session (--resume BASE --fork-session --session-id NEW)")
    p.add_argument("--brief", help="file holding the prompt")
    p.add_argument("--label", help="a free label kept in the job's meta (shown by list and wait)")
    p.add_argument("--workspace", help="cwd for the session (default: a copy of the base's, or a new dir)")
    p.add_argument("--run", help="an experiment run id (prepares its workspace; see `run`)")
    p.add_argument("--force", action="store_true", help="with --run: allow an uncalibrated task")
    _launch_args(p)


@command("spawn", "launch a session, detached: fresh, a fork of a base (--base), or an experiment run "
                  "(--run)", mutating=True)
@args_of(_spawn_args)
def cmd_spawn(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    study = load_study(ctx.study(args))
    if args.run:
        return spawn_run(ctx, study, args.run, base=args.base, force=args.force)
    return spawn_session(ctx, study, cwd=ctx.cwd, brief=args.brief, label=args.label, base=args.base,
                         workspace=args.workspace, flags=launch_flags(args))


def _continue_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--job", help="continue this job's session")
    p.add_argument("--run", help="continue the latest session of this run")
    p.add_argument("--brief", required=True, help="file holding the next turn's prompt")
    _launch_args(p)


@command("continue", "one more turn in a job's session (--resume): feedback, or after an interruption",
         mutating=True)
@args_of(_continue_args)
def cmd_continue(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    prompt = read_brief(ctx, ctx.cwd, args.brief)
    study = load_study(paths)
    limits = launch_limits(study.launch, launch_flags(args))
    return continue_session(ctx, study, prompt, limits, job_id=args.job, run_id=args.run)


# -- wait / list / kill ----------------------------------------------------------------------------

def _wait_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--job", action="append", default=[], help="job id (repeatable)")
    p.add_argument("--run", action="append", default=[], help="run id (repeatable): waits for its pipeline")
    p.add_argument("--all", action="store_true", help="every active or undelivered job")
    p.add_argument("--any", action="store_true", help="return as soon as one target has finished")
    p.add_argument("--timeout", type=finite_float, default=WAIT_DEFAULT_S,
                   help=f"seconds to wait at most (default {WAIT_DEFAULT_S:.0f}, at most {WAIT_MAX_S:.0f}); "
                        "exit 3 when it passes first")


def job_summary(paths: StudyPaths, job_id: str) -> dict[str, Any]:
    st = job_status(paths, job_id)
    usage = st.get("usage") or {}
    out = {"job_id": job_id, "status": st.get("status"), "reason": st.get("reason"),
           "kind": st.get("kind"), "session_id": st.get("session_id"), "meta": st.get("meta"),
           "cost_delta_usd": usage.get("cost_delta_usd"), "estimated": usage.get("estimated"),
           "flags": st.get("flags"), "cache_verdict": st.get("cache_verdict")}
    if st.get("status") == "running":
        out.update({"elapsed_s": st.get("elapsed_s"), "stalled": st.get("stalled", False),
                    "tool_uses": st.get("tool_uses")})
    elif st.get("status") in JOB_FINAL_STATUSES and st.get("status") != "ok":
        # Why it did not end ok, in a line (e.g. the binary's "Not logged in"): result.json
        # has the rest.
        why = st.get("detail") or st.get("result_text")
        if why:
            out["detail"] = str(why)[:300]
    return {k: v for k, v in out.items() if v is not None}


@command("wait", "block until jobs/runs finish (--job, --run, --all, --any) or --timeout; results "
                 "delivered once", mutating=False)
@args_of(_wait_args)
def cmd_wait(ctx: Ctx, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    paths = ctx.study(args)
    # Written as a range test so that NaN (which compares false with everything) is refused too.
    if not 0 <= args.timeout <= WAIT_MAX_S:
        raise AgentbenchError("timeout out of range", code="timeout_out_range",
                              timeout=args.timeout, max=WAIT_MAX_S,
                              hint=f"use 0..{WAIT_MAX_S:.0f} s and call wait again")
    for j in args.job:
        load_job(paths, j)
    for r in args.run:
        load_run(paths, r)
    if not (args.job or args.run or args.all or args.any):
        raise AgentbenchError("wait needs --job, --run, --all or --any", code="wait_needs_job_run_all")
    deadline = time.monotonic() + args.timeout
    last_touch = 0.0
    while True:
        if not ctx.is_child:
            reap_jobs(paths, ctx.platform, env=ctx.env)
            if args.run:
                sweep_interrupted_runs(paths, ctx.platform)
            if time.monotonic() - last_touch > 5:
                touch_last_call(paths)
                last_touch = time.monotonic()
        targets = list(dict.fromkeys(args.job))
        if args.all or (args.any and not args.job and not args.run):
            targets = list(dict.fromkeys(targets + active_job_ids(paths) + list_markers(paths.undelivered)))
        # Finalisation creates result.json first, then (under the same lock) the ledger line and
        # the markers.  A job counts as done once its active marker is gone too; otherwise a wait
        # between those writes would return it undelivered and a later wait deliver it again.
        done_jobs = [j for j in targets if job_is_final(paths, j)
                     and (ctx.is_child or not (paths.active / j).exists())]
        runs_done = [r for r in args.run if run_is_final(paths, r)]
        if args.any:
            met = bool(done_jobs or runs_done) or (not targets and not args.run)
        else:
            met = len(done_jobs) == len(targets) and len(runs_done) == len(args.run)
        if met or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    jobs = [job_summary(paths, j) for j in targets]
    delivered = []
    if not ctx.is_child:
        for j in done_jobs:
            if (paths.undelivered / j).exists():
                remove_marker(paths.undelivered / j)
                delivered.append(j)
    for js in jobs:
        js["delivered_now"] = js["job_id"] in delivered
    runs = [run_summary(paths, r) for r in args.run]
    out = {"met": met, "jobs": jobs, "runs": runs, "pending": [j for j in targets if j not in done_jobs]
           + [r for r in args.run if r not in runs_done]}
    if not met:
        return 3, {**out, "timeout": args.timeout}
    bad = [j["job_id"] for j in jobs if j["job_id"] in done_jobs and j.get("status") != "ok"]
    bad += [r["run_id"] for r in runs if r.get("outcome") not in ("success", "failure")]
    if args.any:
        bad = [b for b in bad if b in done_jobs or b in runs_done]
    return (4 if bad else 0), {**out, "not_ok": bad}


def _list_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--all", action="store_true", help="every job and run (cost grows with the study); "
                   "without it: active and undelivered jobs, running runs")
    p.add_argument("--status", help="only jobs and runs in this state (a state other than running or "
                   "queued looks at every job and run, like --all)")
    p.add_argument("--limit", type=bounded_int("limit"), default=LIST_LIMIT_DEFAULT,
                   help="at most this many jobs and runs")
    p.add_argument("--offset", type=int, default=0,
                   help="skip this many jobs and runs first (pages: pass the answer's next_offset)")


@command("list", "runs, jobs and bases with their state", mutating=False)
@args_of(_list_args)
def cmd_list(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    if not ctx.is_child:
        reap_jobs(paths, ctx.platform, env=ctx.env)
        sweep_interrupted_runs(paths, ctx.platform)
    reg = read_registry(paths)
    ids = active_job_ids(paths) + list_markers(paths.undelivered)
    # A state that is not active (not_started, finished, ok, killed...) is not among the markers.
    everything = args.all or (args.status is not None and args.status not in ("running", "queued", "created"))
    if everything:
        ids = sorted(n for n in list_markers(paths.jobs) if JOB_ID_RE.match(n))
    ids = list(dict.fromkeys(ids))
    page_bounds(0, args.offset, args.limit)   # bad bounds refused before anything is read
    if args.status:   # a filter needs every summary; without one only the page is read
        jobs = [j for j in (job_summary(paths, j) for j in ids) if j.get("status") == args.status]
        job_start, job_stop, job_next = page_bounds(len(jobs), args.offset, args.limit)
        jobs_total, jobs = len(jobs), jobs[job_start:job_stop]
    else:
        job_start, job_stop, job_next = page_bounds(len(ids), args.offset, args.limit)
        jobs_total, jobs = len(ids), [job_summary(paths, j) for j in ids[job_start:job_stop]]
    bases = []
    for f in sorted(paths.bases.glob("*.json")) if paths.bases.is_dir() else []:
        rec = read_json(f, default=None)
        if rec:
            bases.append({"name": rec["name"], "state": base_state(paths, rec), "job_id": rec["job_id"],
                          "session_id": rec["session_id"]})
    runs, runs_total, runs_next = list_runs_page(paths, all_runs=everything, status=args.status,
                                                 offset=args.offset, limit=args.limit)
    return {"counts": reg.get("counts", {}), "spent_usd": reg.get("spent_usd", 0.0),
            "breaker": reg.get("breaker"),
            "active": len(active_job_ids(paths)), "jobs": jobs, "jobs_truncated": job_next is not None,
            "bases": bases, "runs": runs, "runs_truncated": runs_next is not None,
            "jobs_total": jobs_total, "runs_total": runs_total, "offset": args.offset,
            "next_offset": None if job_next is None and runs_next is None else args.offset + args.limit}


def _kill_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--job", action="append", default=[], help="job id to kill (repeatable)")
    p.add_argument("--run", action="append", default=[],
                   help="run id to kill, every session of it (repeatable)")


@command("kill", "kill a job's or run's supervisor and claude tree; verify; record `killed`", mutating=True)
@args_of(_kill_args)
def cmd_kill(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    if not args.job and not args.run:
        raise AgentbenchError("kill needs --job J or --run R", code="kill_needs_job_j_run")
    for j in args.job:
        load_job(paths, j)
    for r in args.run:
        load_run(paths, r)   # every target validated before anything is killed
    results = [kill_job(paths, ctx.platform, j, env=ctx.env) for j in args.job]
    run_results = [kill_run(ctx, paths, r) for r in args.run]
    survivors = sorted({p for r in results for p in r["survivors"]}
                       | {p for r in run_results for p in r.get("survivors", [])})
    unverified = [r["job_id"] for r in results + [j for rr in run_results for j in rr.get("jobs", [])]
                  if r.get("unverified")]
    return {"jobs": results, "runs": run_results, "survivors": survivors, "unverified": unverified,
            "clean": not survivors and not unverified}


# -- experiment commands ---------------------------------------------------------------------------



def _calibrate_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--task", action="append", default=[], help="only these tasks (repeatable)")


@command("calibrate", "per task, no model: reference passes gate and oracle twice; starter fails the oracle",
         mutating=True)
@args_of(_calibrate_args)
def cmd_calibrate(ctx: Ctx, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    paths = ctx.study(args)
    out = calibrate_study(ctx, load_study(paths), args.task)
    study = shlex.quote(str(paths.root))
    failed = sorted(t for t, r in out["tasks"].items() if not r["ok"])
    if failed:
        return 2, {**out, "error": "calibration failed for " + ", ".join(failed),
                   "code": "calibration_failed", "failed": failed,
                   "hint": "fix what tasks.<id>.problems names (each attempt's gate and oracle give the "
                           "receipt problem, exit status and stderr), then run "
                           f"`python3 agentbench.py calibrate --study {study}` again"}
    if out["uncalibrated"]:
        out["next"] = f"python3 agentbench.py calibrate --study {study}"
    else:
        out["next"] = f"python3 agentbench.py assign --study {study}"
    return 0, out


def _new_task_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", help="the study directory (default $AGENTBENCH_STUDY, else the cwd); "
                                   "it need not have a study.json yet")
    p.add_argument("--task", required=True, help="the new task's id: its directory name under tasks/")
    p.add_argument("--kind", default="python-fix", choices=sorted(SCAFFOLD_KINDS),
                   help="; ".join(f"{k}: {v}" for k, v in SCAFFOLD_KINDS.items()))


@command("new-task", "write a complete task bundle (statement, starter, public tests, hidden oracle, "
                     "reference) that calibrates at once", mutating=True)
@args_of(_new_task_args)
def cmd_new_task(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    if not (args.study or ctx.env.get("AGENTBENCH_STUDY")):
        raise AgentbenchError("no study given", code="no_study_given",
                              hint="pass --study DIR (the directory need not exist yet)")
    paths = ctx.study(args, must_exist=False)
    out = scaffold_task(paths, args.task, args.kind)
    study = shlex.quote(str(paths.root))
    out["next"] = (f"python3 agentbench.py calibrate --study {study}" if paths.study_file.exists()
                   else f"python3 agentbench.py init --study {study}")
    return out


def _assign_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--repeats", type=bounded_int("repeats"),
                   help="repeats per task x arm (default: study.json `repeats`, else 1)")
    p.add_argument("--seed", type=int, help="default: study.json `seed`, else 0")
    p.add_argument("--split", default="main",
                   help="the manifest's name (default main); e.g. pilot, for runs that price a study")
    p.add_argument("--reassign", action="store_true",
                   help="replace this split's manifest (only if none of its runs started)")
    p.add_argument("--fault", action="append", default=[],
                   help="RUN_ID=FAULT, e.g. r0003=interrupt:after_tool_uses=2")
    p.add_argument("--power-delta", type=finite_float,
                   help="estimate repeats to detect this success-rate difference")
    p.add_argument("--power-base", type=finite_float, default=POWER_BASE_DEFAULT,
                   help="baseline success rate for --power-delta")
    p.add_argument("--force", action="store_true", help="allow uncalibrated tasks")


@command("assign", "the randomized, paired, blocked manifest: tasks x arms x repeats; registers runs",
         mutating=True)
@args_of(_assign_args)
def cmd_assign(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return assign_runs(ctx, load_study(ctx.study(args)), split=args.split, repeats=args.repeats,
                       seed=args.seed, reassign=args.reassign, faults=args.fault,
                       power_delta=args.power_delta, power_base=args.power_base, force=args.force)


def _run_target_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--run", required=True, help="the run id (see `list` or the manifest from `assign`)")


@command("gate", "run the task's public checks on a run's workspace; record a receipt", mutating=True)
@args_of(_run_target_args)
def cmd_gate(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return gate_run(ctx, load_study(ctx.study(args)), args.run)


@command("review", "a fresh reviewer session writes review.json (accept/revise) for a run", mutating=True)
@args_of(_run_target_args)
def cmd_review(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return review_run(ctx, load_study(ctx.study(args)), args.run)


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--run", action="append", default=[], help="run id to evaluate (repeatable)")
    p.add_argument("--all", action="store_true", help="every run driven by hand whose sessions have ended")


@command("evaluate", "final contract check, hidden tests on a copy, behaviour audit, artifacts; records "
                     "success", mutating=True)
@args_of(_evaluate_args)
def cmd_evaluate(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return evaluate_runs(ctx, load_study(ctx.study(args)), args.run, every_running=args.all)


def _run_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--run", action="append", default=[], help="run ids (default: every run not started)")
    p.add_argument("--task", action="append", default=[], help="only runs of this task (repeatable)")
    p.add_argument("--arm", action="append", default=[], help="only runs of this arm (repeatable)")
    p.add_argument("--split", help="only runs of this split (see assign --split)")
    p.add_argument("--parallel", type=bounded_int("parallel"),
                   help="pipelines at once (default: the study's parallel cap)")
    p.add_argument("--detach", action="store_true", help="drive the runs from a detached process")
    p.add_argument("--force", action="store_true", help="skip the calibration/rehearsal guard")


class Progress:
    """Foreground progress on stderr: a live line on a terminal, periodic plain lines otherwise."""

    def __init__(self, total: int, stream: Any = None):
        self.total = total
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last = 0.0
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        with self.lock:
            if (" run_finished " in f" {msg} " or msg.split(" ")[1:2] == ["run_finished"]
                    or msg.split(" ")[1:2] == ["error"]):
                self.done += 1
            now = time.monotonic()
            line = f"[{self.done}/{self.total}] {msg}"
            try:
                if self.tty:
                    self.stream.write("\r\x1b[K" + line[:200])
                    self.stream.flush()
                elif now - self.last > 10 or "run_finished" in msg or " error" in msg:
                    self.stream.write(f"agentbench: {line}\n")
                    self.stream.flush()
                    self.last = now
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self.tty:
            with contextlib.suppress(OSError, ValueError):
                self.stream.write("\n")


def drive_foreground(ctx: Ctx, study: Study, ids: list[str], parallel: int) -> dict[str, Any]:
    prog = Progress(len(ids))
    try:
        return drive_selected(ctx, study, ids, parallel, progress=prog)
    finally:
        prog.close()


@command("run", "the whole per-run pipeline for selected runs, with a concurrency cap; foreground or "
                "--detach", mutating=True)
@args_of(_run_args)
def cmd_run(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    study = load_study(paths).load_all()
    ids = select_runs(paths, args.run, args.task, args.arm, args.split)
    parallel = runs_can_start(study, ids, args.parallel, args.force)
    if not all(run_is_final(paths, r) for r in ids):   # something will launch: money is at stake
        refuse_unreachable_api(study, ctx.env)
    if args.detach:
        log_path = paths.state / "drivers" / f"driver-{int(time.time())}-{uuid.uuid4().hex[:6]}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # Like a supervisor, the driver's environment holds no credential (any process of the
        # user can read it): they reach it on its stdin, and it hands them on to its supervisors.
        pid = detach_agentbench(ctx.platform,
                                ["_drive", "--study", str(paths.root), "--parallel", str(parallel),
                                 "--force"] + [x for r in ids for x in ("--run", r)],
                                cwd=str(paths.root),
                                env={k: v for k, v in ctx.env.items() if not is_credential_var(k)},
                                log_path=str(log_path),
                                secret={k: v for k, v in ctx.env.items() if is_credential_var(k)})
        return {"detached": True, "driver_pid": pid, "runs": len(ids), "log": str(log_path),
                "hint": "poll with `wait --run R` or `list`",
                "next": f"python3 agentbench.py wait --study {shlex.quote(str(paths.root))} --all"}
    out = drive_foreground(ctx, study, ids, parallel)
    where = shlex.quote(str(paths.root))
    return {**out, "next": f"python3 agentbench.py report --study {where} --format html"}


def _drive_args(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.add_argument("--env-file", help="internal: the environment, passed through a file")
    p.add_argument("--credentials-stdin", action="store_true", help="read the credentials from stdin")


def load_env_file(ctx: Ctx, env_file: str | None) -> None:
    """A detached child's environment, where the platform passed it through a file."""
    if env_file:
        env = read_detach_env_file(env_file)
        os.environ.clear()
        os.environ.update(env)
        ctx.env = dict(env)


@command("_drive", "internal: a detached run driver", mutating=True, hidden=True)
@args_of(_drive_args)
def cmd_drive(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    load_env_file(ctx, args.env_file)
    if args.credentials_stdin:
        HANDED_CREDENTIALS.update(read_stdin_credentials())
    paths = ctx.study(args)
    ids = select_runs(paths, args.run, args.task, args.arm, args.split)
    return drive_foreground(ctx, load_study(paths), ids, args.parallel or 1)


# -- usage and report ------------------------------------------------------------------------------

def _usage_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--by", default="kind", choices=["kind", "arm", "task", "model", "status"],
                   help="the grouping of the sums (default kind)")
    p.add_argument("--format", default="json", choices=["json", "md"],
                   help="json (default), or md: the same as a Markdown table under `markdown`")


@command("usage", "aggregate the ledger: tokens and cost by kind, arm or task; cache-hit ratio",
         mutating=False)
@args_of(_usage_args)
def cmd_usage(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    counts: dict[str, int] = {}
    with gc_paused():   # aggregated while the ledger streams: memory does not grow with it
        agg = aggregate_usage(iter_ledger_once_per_job(paths.ledger, counts), by=args.by)
    out: dict[str, Any] = {"by": args.by, "usage": agg, "ledger_lines": counts["lines"],
                           "torn_lines": counts["torn"]}
    if args.format == "md":
        out["markdown"] = render_usage_md(agg)
    return out


def _report_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--format", default="json", choices=["json", "md", "html"],
                   help="json (default: the report is the answer), md (at a terminal the Markdown "
                        "itself, else under `markdown`) or html (a page, written to a file)")
    p.add_argument("--baseline", help="compare every arm with this one (default: the analysis plan's; "
                                      "another makes the analysis exploratory)")
    p.add_argument("--out", help="write the report to this file (default for html: <study>/report.html); "
                                 "with --format html, a path ending in / (or an existing directory) gets a "
                                 "directory: index.html and one page per run under runs/")
    p.add_argument("--seed", type=int, default=None,
                   help="bootstrap seed (default: the analysis plan's, else the study seed; another "
                        "makes the analysis exploratory)")


@command("report", "per-arm results with intervals and paired comparisons (json, md or html)", mutating=False)
@args_of(_report_args)
def cmd_report(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    paths = ctx.study(args)
    cfg = load_study_config(paths)
    arms = list((cfg.get("arms") or {}).keys())
    if args.baseline and args.baseline not in arms:
        raise AgentbenchError("unknown baseline arm", code="unknown_baseline_arm",
                              baseline=args.baseline, arms=arms)
    # The report views come from the runs summary (a cache checked against every record's stamp);
    # the run pages below read the records themselves.
    runs = report_runs(paths, write=not ctx.is_child)
    plan, plan_source = analysis_plan_of_study(paths)
    boot = plan.get("bootstrap") if isinstance(plan, dict) else None
    plan_seed = boot.get("seed") if isinstance(boot, dict) else None
    if args.seed is not None:
        seed = args.seed
    elif isinstance(plan_seed, int) and not isinstance(plan_seed, bool):
        seed = plan_seed
    else:
        seed = int(cfg.get("seed") or 0)
    with gc_paused():
        report = build_report(runs, arms, baseline=args.baseline, seed=seed, plan=plan,
                              plan_source=plan_source)
    report["arm_changes"] = arm_changes(cfg.get("arms") or {}, report["baseline"])
    reh = read_json(paths.state / "rehearsal.json", default=None)
    only_rehearsed = None
    if (isinstance(reh, dict) and isinstance(reh.get("scratch"), str)
            and not any(r.get("status") not in (None, "not_started") for r in runs)):
        # Nothing of this study has run yet: its rehearsal's results are in the scratch study.
        only_rehearsed = f"python3 agentbench.py report --study {shlex.quote(reh['scratch'])} --format md"
        report.setdefault("warnings", []).insert(
            0, "this study has no results of its own yet; its only results are its rehearsal's "
               f"(simulated, nothing billed), in {reh['scratch']}: report them with `{only_rehearsed}`")
    if report["totals"].get("rehearsed_runs"):
        report["costs_simulated"] = True
    report["metering"] = report_metering(paths)
    if args.format == "json":
        text, result = json.dumps(report, indent=1, sort_keys=True, default=str) + "\n", dict(report)
    else:
        text = render_report_md(report) if args.format == "md" else render_report_html(report)
        result = {"format": args.format}
    out = args.out or (str(paths.root / "report.html") if args.format == "html" else None)
    if args.out and (args.out.endswith(("/", os.sep)) or Path(args.out).is_dir()):
        if args.format != "html":
            raise AgentbenchError("--out names a directory: only --format html writes one",
                                  code="out_is_a_directory", out=args.out,
                                  hint="give a file path for json or md")
        if ctx.is_child:
            raise AgentbenchError("refused inside a supervised session: writing a report directory",
                                  code="refused_inside_session_writes")
        with gc_paused():
            records = [load_run(paths, r) for r in all_run_ids(paths)]
        written = write_report_pages(paths, report, records, Path(ctx.platform.normalize_path(args.out)))
        result.update(written, path=written["index"], directory=str(Path(written["index"]).parent))
        out = None
    if out:
        if ctx.is_child:
            raise AgentbenchError("refused inside a supervised session: writing a report file",
                                  code="refused_inside_session_writes")
        write_text_atomic(out, text)
        result["path"] = str(out)
    if only_rehearsed:
        result["next"] = only_rehearsed
    if args.format == "json":
        return result   # the report itself is the answer (the file, if any, a copy of it)
    if args.format == "md":
        result["markdown"] = text
        result["markdown_for_terminal"] = text   # at a terminal, main prints only this text
    result["summary"] = {a: {k: v for k, v in s.items()
                             if k in ("runs", "evaluated", "successes", "success_rate")}
                         for a, s in (report.get("per_arm") or {}).items() if isinstance(s, dict)}
    return result


# -- rehearse and demo -----------------------------------------------------------------------------

def _rehearse_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--dir", help="scratch study directory (default: <study>/rehearsals/<time>)")
    p.add_argument("--parallel", type=bounded_int("parallel"), default=4,
                   help="rehearsed runs at once (default 4)")
    p.add_argument("--repeats", type=bounded_int("repeats"),
                   help="repeats per task x arm (default: the study's `repeats`)")
    p.add_argument("--force", action="store_true", help="rehearse even with uncalibrated tasks")
    p.add_argument("--behaviour", action="append", default=[],
                   help="RUN_ID=NAME: script a run to " + "/".join(REHEARSAL_BEHAVIOURS))
    p.add_argument("--fault", action="append", default=[], help="RUN_ID=FAULT (see run faults)")
    p.add_argument("--executor", choices=("local", "slurm"),
                   help="override the study's executor for the rehearsal (the scripted model listens on "
                        "this machine's loopback: with slurm, jobs must run on this machine)")


def _pairs(specs: Sequence[str], what: str, allowed: Sequence[str] | None = None) -> dict[str, str]:
    out = {}
    for s in specs:
        k, sep, v = s.partition("=")
        if not sep or not k or not v or (allowed and v not in allowed):
            raise AgentbenchError(f"bad {what}", code="bad_value",
                                  value=s, hint="RUN_ID=VALUE" + (f" with VALUE in {list(allowed)}"
                                                                  if allowed else ""))
        out[k] = v
    return out


def ensure_claude(ctx: Ctx, paths: StudyPaths | None, install: bool) -> str:
    cfg_bin = load_study_config(paths).get("binary") if paths else None
    binary, _ = find_claude_binary(cfg_bin, ctx.env)
    if binary:
        return binary
    if not install:
        raise AgentbenchError("the claude binary was not found", code="claude_binary_not_found",
                              hint=f"npm install -g @anthropic-ai/claude-code@{CLAUDE_CODE_PINNED}")
    return install_pinned_claude(ctx.platform)


@command("rehearse", "the study end to end against the built-in scripted model on loopback (free, offline)",
         mutating=True)
@args_of(_rehearse_args)
def cmd_rehearse(ctx: Ctx, args: argparse.Namespace) -> tuple[int, dict[str, Any]] | dict[str, Any]:
    paths = ctx.study(args)
    behaviours = _pairs(args.behaviour, "--behaviour", REHEARSAL_BEHAVIOURS)
    faults = _pairs(args.fault, "--fault")
    for f in faults.values():
        parse_fault(f)
    if args.parallel < 1:
        raise AgentbenchError("--parallel must be >= 1", code="parallel_below_1")
    ensure_claude(ctx, paths, install=False)
    scratch = Path(ctx.platform.normalize_path(args.dir)) if args.dir else \
        paths.root / "rehearsals" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    study = load_study(paths).load_all()
    cfg, tasks, arms = study.cfg, study.tasks, study.arms
    where = shlex.quote(str(paths.root))
    bad = uncalibrated(paths, tasks)
    if bad and not args.force:
        raise AgentbenchError("tasks are not calibrated: " + ", ".join(bad), code="tasks_not_calibrated",
                              tasks=bad, hint=f"run `python3 agentbench.py calibrate --study {where}` "
                                              "and fix what it reports (--force rehearses anyway)")
    prog = Progress(len(tasks) * len(arms) * int(args.repeats or cfg.get("repeats") or 1))
    try:
        out = rehearse_study(ctx, paths, scratch=scratch, parallel=args.parallel, repeats=args.repeats,
                             behaviours=behaviours, faults=faults, progress=prog, executor=args.executor)
    finally:
        prog.close()
    report = f"python3 agentbench.py report --study {shlex.quote(str(scratch))} --format md"
    out = {**out, "report_command": report, "costs_simulated": True,
           "arms": {a: {**v, "cost_simulated": True} if isinstance(v, dict) else v
                    for a, v in (out.get("arms") or {}).items()},
           "cost_note": "every cost here is simulated (scripted model, list prices): nothing was billed",
           "next": (f"python3 agentbench.py run --study {where}" if out["ok"] else report)}
    if not out["ok"]:
        return 2, {**out, "error": f"the rehearsal did not pass: {len(out['problems'])} problem(s)",
                   "code": "rehearsal_failed",
                   "hint": f"see `problems` and the runs' pages: {report}; fix them and rehearse again"}
    return out


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="where to put the demo study (default: a new temp dir)")
    p.add_argument("--parallel", type=bounded_int("parallel"), default=4,
                   help="rehearsed runs at once (default 4)")
    p.add_argument("--repeats", type=bounded_int("repeats"), default=2,
                   help="repeats per task x arm (default 2)")


@command("demo", "rehearse the bundled example study (3 tasks x 4 arms) in a new directory", mutating=True)
@args_of(_demo_args)
def cmd_demo(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    example = HERE / "examples" / "study"
    if not (example / STUDY_FILE).is_file():
        raise AgentbenchError("the bundled example study is missing", code="bundled_example_study_missing",
                              expected=str(example))
    base = (Path(ctx.platform.normalize_path(args.dir)) if args.dir
            else Path(tempfile.mkdtemp(prefix="agentbench-demo-")))
    study = base / "study"
    if study.exists():
        raise AgentbenchError("the demo directory already holds a study",
                              code="demo_directory_already_holds_study", dir=str(study),
                              hint="pass --dir with a new directory")
    if args.parallel < 1 or args.repeats < 1:
        raise AgentbenchError("--parallel and --repeats must be >= 1", code="parallel_repeats_1")
    ensure_claude(ctx, None, install=True)
    copy_tree(example, study)
    paths = StudyPaths(study)
    paths.state.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.registry, read_registry(paths))
    demo = load_study(paths).load_all()
    cfg, tasks = demo.cfg, demo.tasks
    cal = {t.id: calibrate_task(paths, ctx.platform, t, ctx.env) for t in tasks.values()}
    write_json_atomic(paths.state / "calibration.json",
                      {"tasks": cal, "config_hash": demo.hash, "at": utc_now()})
    log(f"demo study in {study}; rehearsing {len(tasks)} tasks x {len(cfg['arms'])} arms x "
        f"{args.repeats} repeats")
    prog = Progress(len(tasks) * len(cfg["arms"]) * args.repeats)
    try:
        out = rehearse_study(ctx, paths, scratch=study / "rehearsal", parallel=args.parallel,
                             repeats=args.repeats, progress=prog, private_home=True, calibration=cal)
    finally:
        prog.close()
    rpaths = StudyPaths(study / "rehearsal")
    runs = report_runs(rpaths)
    report = build_report(runs, list(cfg["arms"]), seed=int(cfg.get("seed") or 0))
    report["arm_changes"] = arm_changes(cfg["arms"], report["baseline"])
    write_text_atomic(rpaths.root / "report.html", render_report_html(report))
    write_text_atomic(rpaths.root / "report.md", render_report_md(report))
    incomplete = [r["run_id"] for r in runs
                  if not (r.get("status") and r.get("provenance") and r.get("evaluation"))]
    return {"ok": out["ok"] and not incomplete, "demo_dir": str(base), "study": str(study),
            "rehearsal_study": str(rpaths.root), "calibration": {k: v["ok"] for k, v in cal.items()},
            "runs": len(runs), "runs_missing_provenance_or_evaluation": incomplete,
            "sandboxed_runs": sum(1 for r in runs if (r.get("sandbox") or {}).get("sandboxed")),
            "arms": {a: {**v, "cost_simulated": True} if isinstance(v, dict) else v
                     for a, v in out["arms"].items()},
            "costs_simulated": True,
            "cost_note": "every cost here is simulated: the scripted model priced its answers at list "
                         "prices and nothing was billed",
            "problems": out["problems"],
            "report": {"html": str(rpaths.root / "report.html"), "md": str(rpaths.root / "report.md")},
            "next": f"python3 agentbench.py report --study {shlex.quote(str(rpaths.root))} --format md"}


# -- interop: export and import-tasks -------------------------------------------------------------

def _export_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--format", required=True, choices=list(EXPORT_FORMATS),
                   help="inspect: one Inspect eval log per arm; atif: one ATIF trajectory per session")
    p.add_argument("--out", required=True, help="directory to write into (made if missing)")


@command("export", "the study as Inspect eval logs (one per arm) or ATIF trajectories (one per session)",
         mutating=True)
@args_of(_export_args)
def cmd_export(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return export_study(load_study(ctx.study(args)), args.format,
                        Path(ctx.platform.normalize_path(args.out)).absolute())


def _import_tasks_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, choices=["harbor"], help="the format of the tasks")
    p.add_argument("dirs", nargs="+", help="task directories (several in one call)")
    p.add_argument("--tasks", required=True, help="the tasks directory to add the bundles to")


@command("import-tasks", "Harbor task directories become task bundles (what cannot carry over is listed)",
         mutating=True)
@args_of(_import_tasks_args)
def cmd_import_tasks(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    dirs = [Path(ctx.platform.normalize_path(d)).absolute() for d in args.dirs]
    return import_harbor_tasks(dirs, Path(ctx.platform.normalize_path(args.tasks)).absolute())


# -- bases: tick and expire ------------------------------------------------------------------------

def _tick_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--every", type=finite_float, default=TICK_EVERY_DEFAULT_S,
                   help="ping a base not pinged for this long (s)")


@command("tick", "keep-warm pings: fork each ready base with a one-line prompt so its prefix stays cached",
         mutating=True)
@args_of(_tick_args)
def cmd_tick(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return ping_bases(ctx, ctx.study(args), args.every)


def _expire_args(p: argparse.ArgumentParser) -> None:
    _study_arg(p)
    p.add_argument("--base", required=True, help="the base's name")


@command("expire", "retire a base: no more pings, no more forks", mutating=True)
@args_of(_expire_args)
def cmd_expire(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    return expire_base(ctx, ctx.study(args), args.base)


# -- the scripted model by hand --------------------------------------------------------------------

def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=0, help="loopback port (default 0: any free one)")
    p.add_argument("--scripts", required=True, help="directory of <script id>.json files")
    p.add_argument("--cache-ttl-scale", type=finite_float, default=1.0,
                   help="multiply the prompt cache's 5m/1h lifetimes (e.g. 0.01: 3 s and 36 s)")


@command("serve-model", "run the scripted Messages API model on loopback until stopped (prints its URL)",
         mutating=False)
@args_of(_serve_args)
def cmd_serve_model(ctx: Ctx, args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise AgentbenchError("--port must be 0..65535", code="port_0_65535", port=args.port)
    if not args.cache_ttl_scale > 0:
        raise AgentbenchError("--cache-ttl-scale must be > 0", code="cache_ttl_scale_0",
                              cache_ttl_scale=args.cache_ttl_scale)
    scripts = ctx.platform.normalize_path(args.scripts)
    os.makedirs(scripts, exist_ok=True)
    run_scripted_model_server(args.port, scripts, ctx.emit, args.cache_ttl_scale)
    return None


# -- internal --------------------------------------------------------------------------------------

def _supervise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", required=True, help="the study directory")
    p.add_argument("--job", required=True, help="the job id")
    p.add_argument("--env-file", help="the environment, passed through a file")
    p.add_argument("--credentials-file",
                   help="owner-only file of credentials to add (Slurm jobs); deleted once read")
    p.add_argument("--credentials-stdin", action="store_true",
                   help="read the credentials from stdin (local jobs)")


@command("_supervise", "internal: the detached supervisor of one job", mutating=True, hidden=True)
@args_of(_supervise_args)
def cmd_supervise(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    load_env_file(ctx, args.env_file)
    # Credentials stay in this process's memory (Supervisor.secret), never in os.environ.
    creds: dict[str, str] = read_stdin_credentials() if args.credentials_stdin else {}
    if args.credentials_file:
        try:
            creds = read_detach_env_file(args.credentials_file)
        except AgentbenchError as exc:
            # Gone (the job was finalised first) or unreadable: the session runs without them
            # and fails authentication visibly; nothing secret is left behind either way.
            log(f"credentials file not used: {exc.payload.get('detail') or exc}")
            with contextlib.suppress(OSError):
                os.unlink(args.credentials_file)
    ctx.env = dict(os.environ)
    paths = StudyPaths(Path(args.study))
    sup = Supervisor(paths, args.job, ctx.platform)
    sup.secret = creds
    def on_term(*_: Any) -> None:
        sup.terminate_requested = True   # handled by the poll loop: kill claude, then finalise
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, on_term)
    sup.run()
    return {"job_id": args.job, "supervised": True}


# -- main ------------------------------------------------------------------------------------------

def build_parser(cmd: Command) -> _ArgParser:
    p = _ArgParser(prog=f"agentbench.py {cmd.name}", add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    cmd.configure(p)
    return p


def help_object(cmd: Command | None = None) -> dict[str, Any]:
    if cmd is not None:
        p = build_parser(cmd)
        opts = []
        for a in p._actions:
            if a.option_strings and a.dest != "help":
                opts.append({"flags": a.option_strings, "help": a.help, "required": a.required,
                             "default": a.default if a.default not in (None, False, []) else None})
        return {"help": cmd.summary, "command": cmd.name, "options": opts, "mutating": cmd.mutating}
    return {"help": "agentbench: controlled experiments on the headless Claude Code agent. "
                    "Every command prints one JSON object; exit 0 ok, 2 usage error/refused, "
                    "3 wait timed out, 4 wait met with a job not ok.",
            "usage": "agentbench.py <command> [--study DIR] [options]; agentbench.py <command> --help",
            "version": VERSION,
            "commands": [{"name": c.name, "summary": c.summary} for c in COMMANDS.values() if not c.hidden]}


def help_text(cmd: Command | None = None) -> str:
    """`--help` for a person at a terminal: argparse's own text (a program gets help_object)."""
    if cmd is not None:
        p = build_parser(cmd)
        p.description = cmd.summary
        return p.format_help()
    width = max(len(c.name) for c in COMMANDS.values())
    lines = ["usage: agentbench.py <command> [--study DIR] [options]   (agentbench.py <command> --help)", "",
             "agentbench: controlled experiments on the headless Claude Code agent. Every command prints",
             "one JSON object (indented at a terminal; --compact for one line); exit 0 ok, 2 usage error",
             "or refused, 3 wait timed out, 4 wait met with a job not ok.", "", "commands:"]
    lines += [f"  {c.name.ljust(width)}  {c.summary}" for c in COMMANDS.values() if not c.hidden]
    lines += ["", "First study: python3 agentbench.py new-task --study S --task T; then init, calibrate, "
                  "assign, rehearse, run, report (README: \"Your first study\")."]
    return "\n".join(lines) + "\n"


def help_request(argv: Sequence[str]) -> Command | None | bool:
    """What a help request asks for (pure): False when argv is none, None for the command list,
    else the command."""
    if not argv or argv[0] in ("-h", "--help"):
        return None
    if argv[0] == "help":
        return COMMANDS.get(argv[1]) if len(argv) > 1 else None
    if argv[0] in COMMANDS and ("-h" in argv[1:] or "--help" in argv[1:]):
        return COMMANDS[argv[0]]
    return False


def output_style(argv: Sequence[str], stdout_is_tty: bool) -> tuple[list[str], bool]:
    """(argv without the global --compact, whether to indent the answer) (pure): indented for a
    person at a terminal, one compact line for a program or with --compact."""
    compact = "--compact" in argv
    return [a for a in argv if a != "--compact"], stdout_is_tty and not compact


def dispatch(argv: list[str], ctx: Ctx) -> tuple[int, dict[str, Any] | None]:
    if not argv or argv[0] in ("-h", "--help", "help"):
        if len(argv) > 1 and argv[0] == "help" and argv[1] in COMMANDS:
            return 0, help_object(COMMANDS[argv[1]])
        return 0, help_object()
    if argv[0] in ("--version", "version"):
        return 0, {"version": VERSION, "claude_pinned": CLAUDE_CODE_PINNED}
    name = argv[0]
    cmd = COMMANDS.get(name)
    if cmd is None:
        raise AgentbenchError("unknown command", code="unknown_command", command=name,
                              commands=[c for c in COMMANDS if not COMMANDS[c].hidden],
                              hint="see `agentbench.py --help`")
    if "-h" in argv[1:] or "--help" in argv[1:]:
        return 0, help_object(cmd)
    args = build_parser(cmd).parse_args(argv[1:])
    if ctx.is_child and cmd.mutating:
        raise AgentbenchError("refused inside a supervised session", code="refused_inside_session",
                              command=name,
                              hint="AGENTBENCH_CHILD=1 marks a call from an agent under test; only "
                                   "where, list, usage, report and wait are allowed there")
    if not ctx.is_child and not name.startswith("_"):
        with contextlib.suppress(AgentbenchError, OSError):
            touch_last_call(ctx.study(args))
    out = cmd.handler(ctx, args)
    if out is None:
        return 0, None
    if isinstance(out, tuple):
        return out
    return 0, out


def main(argv: list[str] | None = None) -> int:
    """The one boundary: run a command, print exactly one JSON object on stdout, return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    emitted: list[bool] = []
    tty = False
    with contextlib.suppress(AttributeError, ValueError, OSError):
        tty = bool(sys.stdout.isatty())
    argv, indent = output_style(argv, tty)
    wanted = help_request(argv)
    if indent and wanted is not False:
        # A person at a terminal asked for help: argparse's text (a program gets the JSON object).
        sys.stdout.write(help_text(wanted if isinstance(wanted, Command) else None))
        sys.stdout.flush()
        return 0

    def emit(obj: dict[str, Any]) -> None:
        if not emitted:
            if indent and isinstance(obj.get("markdown_for_terminal"), str):
                # `report --format md` at a terminal: the Markdown itself, for a person to read.
                sys.stdout.write(obj["markdown_for_terminal"])
            else:
                obj = {k: v for k, v in obj.items() if k != "markdown_for_terminal"}
                sys.stdout.write(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str, indent=2)
                                 + "\n" if indent else json_line(obj))
            sys.stdout.flush()
            emitted.append(True)

    try:
        ctx = Ctx(platform=current_platform(), env=dict(os.environ), cwd=os.getcwd(), emit=emit,
                  is_child=os.environ.get("AGENTBENCH_CHILD") == "1")
        code, obj = dispatch(argv, ctx)
    except AgentbenchError as exc:
        code, obj = exc.exit_code, exc.payload
    except KeyboardInterrupt:
        code, obj = 2, {"error": "interrupted", "code": "interrupted"}
    except OSError as exc:
        if exc.errno in WRITE_REFUSED_ERRNOS:
            code, obj = 2, {"error": "the study's files cannot be written", "code": "write_refused",
                            "reason": os.strerror(exc.errno or 0),
                            "errno": errno.errorcode.get(exc.errno or 0),
                            "path": exc.filename,
                            "hint": "free disk space, or make the study writable, then retry"}
        else:
            code, obj = 2, {"error": "internal error", "code": "internal_error", "type": type(exc).__name__,
                            "detail": str(exc), "trace": traceback.format_exc(limit=8).splitlines()[-6:]}
    except Exception as exc:  # the one place that turns a bug into a JSON answer
        code, obj = 2, {"error": "internal error", "code": "internal_error", "type": type(exc).__name__,
                        "detail": str(exc), "trace": traceback.format_exc(limit=8).splitlines()[-6:]}
    if obj is not None:
        emit(obj)
    elif not emitted:
        emit({"ok": True})
    return code


if __name__ == "__main__":
    sys.exit(main())
