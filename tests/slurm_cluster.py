"""A private one-node Slurm cluster for end-to-end tests (stdlib only).

The cluster is a slurmctld and a slurmd started from a slurm.conf written into a scratch
directory: every state, spool, pid and log file lives there, and both daemons listen on free TCP
ports, so it neither touches nor clashes with a site's Slurm (or another private cluster).
Clients reach it through ``SLURM_CONF`` (see ``PrivateSlurmCluster.env``).

Authentication goes through the machine's munged, as Slurm's does: a running munged is reused;
when none answers it is started, and its key is created first if there is none.  Those two (the
key and munge's run directory) are the only things written outside the scratch directory.
munged is left running afterwards: other clusters, or the machine's own Slurm, may share it.

Needs root (slurmd must be root to start jobs as their submitter) and the Debian packages
``slurm-wlm`` and ``munge``; ``slurm_available()`` says why a machine cannot run it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

# Client and daemon binaries the cluster and its tests call.
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo", "scontrol", "munge", "unmunge")

MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN_DIR = Path("/run/munge")

# Node states (sinfo %T) in which the node can run jobs.  A trailing flag character ("*" not
# responding, "~" powered off, "#" powering up, ...) means it cannot yet.
_READY_STATES = {"idle", "mixed", "allocated", "completing"}
_RESUMABLE_STATES = {"down", "drained", "draining", "drain", "fail", "failing"}


def _which(name: str) -> str | None:
    """The binary's path; sbin directories are searched too (a non-login root PATH may lack them)."""
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/local/sbin", "/sbin"):
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def slurm_available() -> str | None:
    """None when this machine can run a private cluster, else the reason it cannot."""
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts jobs as their submitter)"
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if missing:
        return ("Slurm or munge is not installed (missing: " + ", ".join(missing)
                + "; apt-get install slurm-wlm munge)")
    return None


def short_hostname() -> str:
    """The name slurmd registers under: the host name up to its first dot."""
    return socket.gethostname().split(".")[0]


def _free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports nothing listens on right now (held open together, so distinct)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path.name}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path.name} is empty)"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state letter follows the parenthesised command name, which may itself hold spaces.
    return stat.rpartition(")")[2].split()[0] != "Z"


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _terminate(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM the processes, then SIGKILL the ones still alive after `grace` seconds."""
    pids = [p for p in pids if p != os.getpid() and _alive(p)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def munge_works() -> bool:
    """True when a munged answers: a credential made by `munge -n` decodes with `unmunge`."""
    munge, unmunge = _which("munge"), _which("unmunge")
    if munge is None or unmunge is None:
        return False
    try:
        cred = subprocess.run([munge, "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        check = subprocess.run([unmunge], input=cred.stdout, capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return check.returncode == 0


def ensure_munged(timeout: float = 15) -> None:
    """Make sure a munged answers; start one (and create its key) if none does.  Needs root."""
    if munge_works():
        return
    if os.geteuid() != 0:
        raise RuntimeError("munged is not running and only root can start it")
    munged = _which("munged")
    if munged is None:
        raise RuntimeError("munged is not installed (apt-get install munge)")
    if not MUNGE_KEY.exists():
        if not MUNGE_KEY.parent.is_dir():
            MUNGE_KEY.parent.mkdir(mode=0o700, parents=True)
            shutil.chown(MUNGE_KEY.parent, "munge", "munge")
        # Created with the final mode, so the key is never readable by anyone else.
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            os.write(fd, os.urandom(1024))
        finally:
            os.close(fd)
        shutil.chown(MUNGE_KEY, "munge", "munge")
    if not MUNGE_RUN_DIR.is_dir():  # /run is a tmpfs: gone after every boot
        MUNGE_RUN_DIR.mkdir(mode=0o755, parents=True)
        shutil.chown(MUNGE_RUN_DIR, "munge", "munge")
    errors = []
    # munged replaces a socket a crashed munged left behind by itself; --force, tried second,
    # also overrides its refusals over a socket it thinks in use or lax permissions.
    for args in ([munged], [munged, "--force"]):
        # The command returns once the daemon is up (or has refused to start).
        proc = subprocess.run(args, user="munge", group="munge", extra_groups=[],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
        deadline = time.monotonic() + (timeout if proc.returncode == 0 else 0)
        while True:
            if munge_works():
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        errors.append(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    raise RuntimeError("munged did not come up: " + "; ".join(errors))


class PrivateSlurmCluster:
    """One slurmctld and one slurmd (this host as node, all its CPUs, partition `debug`).

    Use as a context manager, or call ``start()`` and ``stop()``.  Point clients at it with
    ``env()``: ``subprocess.run(["sbatch", ...], env={**os.environ, **cluster.env()})``.
    """

    PARTITION = "debug"

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir).resolve()
        self.conf = self.workdir / "slurm.conf"
        self.node = short_hostname()
        self.ctld_log = self.workdir / "slurmctld.log"
        self.slurmd_log = self.workdir / "slurmd.log"
        self.ctld_pidfile = self.workdir / "slurmctld.pid"
        self.slurmd_pidfile = self.workdir / "slurmd.pid"
        self.ctld_port: int | None = None
        self.slurmd_port: int | None = None
        self.startup_seconds: float | None = None

    # ---- public API ------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What a client's environment needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> None:
        """Start both daemons and wait until the node can take jobs; RuntimeError if it does not."""
        reason = slurm_available()
        if reason:
            raise RuntimeError(reason)
        began = time.monotonic()
        deadline = began + timeout
        # slurmstepd listens on "<spool>/<node>_<job id>.<step id>", a Unix socket, whose path
        # cannot exceed 107 bytes; ids take up to 10 digits each.
        longest = len(os.fsencode(self.workdir / "spool")) + len(self.node.encode()) + 23
        if longest > 107:
            raise RuntimeError(f"workdir {self.workdir} is too long for Slurm's step sockets "
                               f"({longest} > 107 bytes); use a shorter one")
        self.workdir.mkdir(parents=True, exist_ok=True)
        # A crashed earlier run over the same directory may have left its daemons behind.
        self._kill_daemons()
        ensure_munged(timeout=max(5.0, min(15.0, deadline - time.monotonic())))
        self._write_conf()
        try:
            self._launch("slurmctld", self.ctld_log)
            self._launch("slurmd", self.slurmd_log)
            self._wait_ready(deadline)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        """Stop both daemons (SIGTERM, then SIGKILL), then whatever job steps they left running."""
        self._kill_daemons()
        # slurmstepd outlives slurmd by design (a restarted slurmd re-attaches to its steps), so a
        # job still running when the cluster stops would be orphaned: end its steps and processes.
        _terminate(self._job_pids(), grace=3.0)

    def __enter__(self) -> PrivateSlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- helpers ---------------------------------------------------------------------------------

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env.update(self.env())
        return env

    def _write_conf(self) -> None:
        state = self.workdir / "state"
        spool = self.workdir / "spool"
        for d in (state, spool):
            d.mkdir(exist_ok=True)
        plugstack = self.workdir / "plugstack.conf"
        plugstack.write_text("")  # no SPANK plugins, whatever the machine's own Slurm loads
        self.ctld_port, self.slurmd_port = _free_ports(2)
        cpus = os.cpu_count() or 1
        lines = [
            "ClusterName=private",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # No cgroups, no systemd: plain /proc process tracking, no task confinement.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            # Batch jobs go to the next scheduler pass (about a second), not up to 3 s later (the
            # default).  The very first pass still comes about 3 s after slurmctld starts.
            "SchedulerParameters=batch_sched_delay=0",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            # A node that was down comes back by itself once it registers with a valid config.
            "ReturnToService=2",
            # Ended jobs stay known for 5 minutes: to scontrol, and to squeue given --states=all.
            "MinJobAge=300",
            # Between scancel's SIGTERM and its SIGKILL the supervisor finalises its job: room
            # for that on a loaded machine.
            "KillWait=15",
            "SlurmdTimeout=300",
            "SlurmctldTimeout=120",
            "InactiveLimit=0",
            "MailProg=/bin/true",  # the default mail client is rarely installed; no job mails
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={spool}",
            f"SlurmctldPidFile={self.ctld_pidfile}",
            f"SlurmdPidFile={self.slurmd_pidfile}",
            f"SlurmctldLogFile={self.ctld_log}",
            f"SlurmdLogFile={self.slurmd_log}",
            f"PlugStackConfig={plugstack}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # RealMemory is left at its default: a configured size above the machine's would
            # drain the node, and CR_Core does not schedule memory anyway.
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName={self.PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _launch(self, name: str, log: Path) -> None:
        binary = _which(name)
        assert binary is not None  # slurm_available() checked
        # slurmctld starts from a clean state: jobs a crashed earlier run left in this directory
        # would otherwise be recovered, and requeued onto the new node.
        args = [binary, "-f", str(self.conf)] + (["-c"] if name == "slurmctld" else [])
        # The daemon forks into the background; a non-zero exit means it refused to start.
        proc = subprocess.run(args, env=self._daemon_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30, cwd=self.workdir)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} exited {proc.returncode} at start-up: "
                               f"{(proc.stdout + proc.stderr).strip()}\n"
                               f"--- {log.name} ---\n{_tail(log)}")

    def _client(self, name: str, *args: str, timeout: float = 15) -> subprocess.CompletedProcess:
        binary = _which(name)
        assert binary is not None
        return subprocess.run([binary, *args], env=self._daemon_env(), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def node_state(self) -> str:
        """The node's state as sinfo prints it ('' while the controller does not answer)."""
        try:
            proc = self._client("sinfo", "-h", "-n", self.node, "-o", "%T")
        except subprocess.TimeoutExpired:
            return ""
        if proc.returncode != 0:
            return ""
        states = proc.stdout.split()
        return states[0] if states else ""

    def _wait_ready(self, deadline: float) -> None:
        state = ""
        last_resume = 0.0
        while True:
            state = self.node_state()
            if state in _READY_STATES:
                return
            # A node the controller marked down or drained (it answers, so no "*" flag) is put
            # back; ReturnToService=2 usually does that on registration already.
            if state.rstrip("*~#%!@^-$") in _RESUMABLE_STATES and not state.endswith("*") \
                    and time.monotonic() - last_resume > 3:
                last_resume = time.monotonic()
                self._client("scontrol", "update", f"nodename={self.node}", "state=resume")
            for pidfile, name in ((self.ctld_pidfile, "slurmctld"), (self.slurmd_pidfile, "slurmd")):
                if pidfile.exists() and not self._daemon_pids(name):
                    raise RuntimeError(self._failure(f"{name} exited during start-up", state))
            if time.monotonic() >= deadline:
                raise RuntimeError(self._failure("the node did not become idle in time", state))
            time.sleep(0.3)

    def _failure(self, what: str, state: str) -> str:
        try:  # the controller's view of the node, with the reason when it is down or drained
            node = self._client("scontrol", "show", "node", self.node, timeout=5).stdout.strip()
        except subprocess.TimeoutExpired:
            node = ""
        return (f"private Slurm cluster in {self.workdir}: {what} "
                f"(last sinfo state: {state or 'no answer'})\n"
                f"--- scontrol show node ---\n{node or '(no answer)'}\n"
                f"--- slurmctld.log ---\n{_tail(self.ctld_log)}\n"
                f"--- slurmd.log ---\n{_tail(self.slurmd_log)}")

    def _daemon_pids(self, name: str) -> list[int]:
        """Live processes of daemon `name` started with this cluster's slurm.conf.

        The pid file names the daemon; processes are also matched by command line, since the pid
        file is written a moment after the fork (and a crashed run may have left a stale one).
        """
        conf = str(self.conf)
        pids = set()
        pidfile = self.ctld_pidfile if name == "slurmctld" else self.slurmd_pidfile
        try:
            pids.add(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
        for pid in _all_pids():
            argv = _cmdline(pid)
            if len(argv) >= 3 and Path(argv[0]).name == name and conf in argv:
                pids.add(pid)
        # A recycled pid from a stale pid file is someone else's process: keep only ours.
        return sorted(p for p in pids if _alive(p) and Path((_cmdline(p) or [""])[0]).name == name
                      and conf in _cmdline(p))

    def _kill_daemons(self) -> None:
        # slurmd first, so it does not spend its grace period failing to reach the controller.
        _terminate(self._daemon_pids("slurmd"))
        _terminate(self._daemon_pids("slurmctld"))

    def _job_pids(self) -> list[int]:
        """This cluster's job steps still running, and the processes of its jobs.

        A slurmstepd carries the SLURM_CONF of the slurmd that forked it; a job's process is a
        descendant of its step, or (if it detached) carries both that SLURM_CONF (jobs inherit
        the submitter's environment) and a SLURM_JOB_ID.  Other processes that merely have this
        cluster's SLURM_CONF, such as the tests submitting jobs, are left alone.
        """
        marker = f"SLURM_CONF={self.conf}".encode()
        parents: dict[int, int] = {}
        chosen: set[int] = set()
        for pid in _all_pids():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            name, _, rest = stat.partition("(")[2].rpartition(")")
            try:
                parents[pid] = int(rest.split()[1])
            except (IndexError, ValueError):
                continue
            environ = _environ(pid)
            if marker not in environ:
                continue
            if name == "slurmstepd" or any(v.startswith(b"SLURM_JOB_ID=") for v in environ):
                chosen.add(pid)
        # Descendants of the chosen processes, to any depth.
        grew = True
        while grew:
            grew = False
            for pid, ppid in parents.items():
                if ppid in chosen and pid not in chosen:
                    chosen.add(pid)
                    grew = True
        chosen.discard(os.getpid())
        return sorted(chosen)
