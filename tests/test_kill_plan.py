"""The kill plan as tables: `kill_step` (pure) decides a kill's next action from what is known of
the job; `kill_job` only observes, asks it and acts (its I/O is tested in test_supervisor.py,
test_slurm_executor.py and the real-process tests)."""
from __future__ import annotations

import pytest

from conftest import ab


def facts(**kw) -> ab.KillFacts:
    base = {"result": False, "final": False, "slurm_job": None, "runtime": False, "runtime_here": False,
            "supervisor": None, "wait_s": 10.0, "done": (), "slurm_state": None}
    base.update(kw)
    if isinstance(base["done"], str):
        base["done"] = tuple(base["done"].split())
    return ab.KillFacts(**base)


HERE_RT = {"runtime": True, "runtime_here": True, "supervisor": "runtime"}   # a local, started job
SLURM_Q = {"slurm_job": "42"}                                               # submitted, queued
SLURM_RUN = {"slurm_job": "42", "runtime": True}                            # started on a compute node


@pytest.mark.parametrize("case, known, action", [
    # -- before anything is written --
    ("the job is final already", {"result": True, "final": True}, ("already_final", None)),
    ("a result without its ledger line is final too", {"result": True}, ("already_final", None)),
    ("anything else first asks the supervisor", HERE_RT, ("request", None)),
    ("a queued Slurm job is asked too", SLURM_Q, ("request", None)),
    # -- after the request --
    ("a local job: wait for its supervisor", {**HERE_RT, "done": "request"}, ("wait", 10.0)),
    ("the caller's wait is used", {**HERE_RT, "wait_s": 0.3, "done": "request"}, ("wait", 0.3)),
    ("a launch not recorded yet: wait", {"done": "request"}, ("wait", 10.0)),
    ("queued in Slurm: cancel the submission, wait briefly", {**SLURM_Q, "done": "request"},
     ("cancel_queued", 2.0)),
    ("... never longer than the caller's wait", {**SLURM_Q, "wait_s": 0.2, "done": "request"},
     ("cancel_queued", 0.2)),
    ("started in Slurm: the supervisor is asked first", {**SLURM_RUN, "done": "request"}, ("wait", 10.0)),
    # -- after the wait, by the launch record as it is now --
    ("a kill racing sbatch: the id came during the wait", {**SLURM_Q, "done": "request wait"},
     ("cancel_queued_late", 2.0)),
    ("a queued job cancelled once is not cancelled again", {**SLURM_Q, "done": "request cancel_queued"},
     ("ask_slurm", None)),
    ("the started job did not answer: scancel it", {**SLURM_RUN, "done": "request wait"},
     ("cancel_started", 15.0)),
    ("... waiting at least the caller's wait", {**SLURM_RUN, "wait_s": 40.0, "done": "request wait"},
     ("cancel_started", 40.0)),
    ("queued, then started during the short wait",
     {**SLURM_RUN, "wait_s": 40.0, "done": "request cancel_queued"}, ("cancel_started", 15.0)),
    ("started during the late cancel's wait", {**SLURM_RUN, "done": "request wait cancel_queued_late"},
     ("cancel_started", 15.0)),
    ("the supervisor finalised: make sure it exits", {**HERE_RT, "result": True, "final": True,
                                                      "done": "request wait"}, ("await_exit", None)),
    ("final after scancel, no process known here", {**SLURM_RUN, "result": True, "final": True,
                                                    "done": "request wait cancel_started"}, ("verify", None)),
    ("a result still finalising: only verified", {**HERE_RT, "result": True, "done": "request wait"},
     ("verify", None)),
    # -- the supervisor did not finish the job --
    ("a local job that did not answer: kill and finalise", {**HERE_RT, "done": "request wait"},
     ("kill_and_finalise", None)),
    ("a supervisor still starting (launcher pid with ctime) is stopped first",
     {"supervisor": "launcher", "done": "request wait"}, ("stop_supervisor", None)),
    ("... then the job is killed and finalised",
     {"supervisor": "launcher", "done": "request wait stop_supervisor"}, ("kill_and_finalise", None)),
    ("... even if the supervisor wrote its runtime meanwhile",
     {**HERE_RT, "done": "request wait stop_supervisor"}, ("kill_and_finalise", None)),
    ("... or its result meanwhile", {"result": True, "supervisor": "launcher",
                                     "done": "request wait stop_supervisor"}, ("kill_and_finalise", None)),
    ("a launcher pid without ctime names nobody: no supervisor to stop", {"done": "request wait"},
     ("kill_and_finalise", None)),
    ("a Slurm job nothing here can check: ask Slurm", {**SLURM_RUN, "done": "request wait cancel_started"},
     ("ask_slurm", None)),
    ("Slurm does not answer: unverified", {**SLURM_RUN, "done": "request wait cancel_started ask_slurm"},
     ("unverified", None)),
    ("Slurm says it still runs: unverified", {**SLURM_RUN, "slurm_state": "RUNNING",
                                              "done": "request wait cancel_started ask_slurm"},
     ("unverified", None)),
    ("Slurm says it is still being cleaned up: unverified", {**SLURM_Q, "slurm_state": "COMPLETING",
                                                             "done": "request cancel_queued ask_slurm"},
     ("unverified", None)),
    ("Slurm confirms its end: killed", {**SLURM_RUN, "slurm_state": "CANCELLED",
                                        "done": "request wait cancel_started ask_slurm"},
     ("kill_and_finalise", None)),
    ("Slurm no longer knows it: killed", {**SLURM_Q, "slurm_state": "GONE",
                                          "done": "request cancel_queued ask_slurm"},
     ("kill_and_finalise", None)),
    ("a Slurm job running on this host is killed here", {**SLURM_RUN, "runtime_here": True,
                                                         "done": "request wait cancel_started"},
     ("kill_and_finalise", None)),
    # -- the end --
    ("after finalising: verify", {**HERE_RT, "result": True, "final": True,
                                  "done": "request wait kill_and_finalise"}, ("verify", None)),
    ("after the supervisor exited: verify", {**HERE_RT, "result": True, "final": True,
                                             "done": "request wait await_exit"}, ("verify", None)),
    ("verified: report", {**HERE_RT, "result": True, "final": True,
                          "done": "request wait kill_and_finalise verify"}, ("report", None)),
])
def test_kill_step(case, known, action):
    got = ab.kill_step(facts(**known))
    assert (got.name, got.wait_s) == action, case


def test_no_cancel_or_wait_comes_back_once_the_kill_is_making_sure():
    """Facts that change late (a runtime or a Slurm id that appears after the last stage began)
    never send the kill back to waiting for the supervisor or cancelling through Slurm."""
    for done in ("request wait await_exit", "request wait stop_supervisor", "request wait ask_slurm"):
        for known in (SLURM_RUN, SLURM_Q, HERE_RT, {}):
            got = ab.kill_step(facts(**known, done=done, slurm_state="CANCELLED"))
            assert got.wait_s is None and not got.name.startswith(("cancel", "wait")), (done, known, got)


def play(states: list[dict], wait_s: float = 10.0) -> list[str]:
    """The actions a kill takes when the job looks like states[i] before its i-th step (the last
    state repeats), until a terminal action."""
    done: list[str] = []
    for i in range(20):
        known = states[min(i, len(states) - 1)]
        action = ab.kill_step(facts(**known, wait_s=wait_s, done=tuple(done)))
        done.append(action.name)
        if action.name in ("already_final", "unverified", "report"):
            return done
    raise AssertionError(f"the kill does not end: {done}")


@pytest.mark.parametrize("case, states, actions", [
    ("a supervisor that answers the request", [HERE_RT, HERE_RT, {**HERE_RT, "result": True, "final": True}],
     "request wait await_exit verify report"),
    ("a supervisor that does not answer", [HERE_RT], "request wait kill_and_finalise verify report"),
    ("a supervisor still starting", [{"supervisor": "launcher"}] * 3 + [HERE_RT],
     "request wait stop_supervisor kill_and_finalise verify report"),
    ("a queued Slurm job that Slurm confirms cancelled",
     [SLURM_Q, SLURM_Q, SLURM_Q, {**SLURM_Q, "slurm_state": "CANCELLED"}],
     "request cancel_queued ask_slurm kill_and_finalise verify report"),
    ("a kill racing sbatch", [{}, {}, SLURM_Q, {**SLURM_Q, "result": True, "final": True}],
     "request wait cancel_queued_late verify report"),
    ("a started Slurm job Slurm does not confirm", [SLURM_RUN],
     "request wait cancel_started ask_slurm unverified"),
    ("a started Slurm job that finalises on scancel",
     [SLURM_RUN, SLURM_RUN, SLURM_RUN, {**SLURM_RUN, "result": True, "final": True}],
     "request wait cancel_started verify report"),
    ("a job that was final before the kill", [{"result": True, "final": True}], "already_final"),
])
def test_kill_sequences(case, states, actions):
    assert play(states) == actions.split(), case
