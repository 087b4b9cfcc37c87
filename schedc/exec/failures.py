"""A rank that fails, or that torchrun terminates, says where it was and ends the job.

A rank that fails (a dead peer, a peer that stops answering within --timeout or stops
beating, an error in an instruction) writes where it was to the rendezvous store, reads
what the others wrote, names the ranks that said nothing, and exits 1 (`fail`); torchrun
then ends the job. A rank that torchrun terminates reports in one line where it was
(`terminated`). `phase` is where the run is, for both reports; the training loop keeps it.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist

from schedc.exec.executor import Executor
from schedc.exec.heartbeat import STALE_S, Heartbeat, LocalPeer
from schedc.exec.launcher import launcher_gone, leave, tell_launcher
from schedc.exec.options import Comm
from schedc.ir.plan import Action, Plan

FAILURE_GRACE_S = 3.0  # how long a failing rank waits to hear from the others
TERM_STORE_S = 1.0  # how long a rank terminated by torchrun asks the store who failed
TERM_EXIT = 143  # 128 + SIGTERM: ended by the launcher (1: this rank failed by itself)


@dataclass
class Phase:
    """Where this rank is, as the reports name it (read by the SIGTERM and heartbeat
    threads while the main thread runs)."""

    where: str = "start-up"  # the phase of the run between instructions
    ex: Executor | None = None  # once built: the instruction it is at
    failing: str = ""  # what fail() is reporting, once it is


phase = Phase()
_report = threading.Lock()  # one report per rank: fail()'s or the SIGTERM one, never both


def join(backend: str, timeout_s: float) -> tuple[Comm, Heartbeat]:
    """Start beating, so that this rank is watched from here on, then the job's rendezvous
    (Comm.from_env): a rank stopped or lost at start-up is named as one lost later is."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    comm = Comm(rank, world, timeout=datetime.timedelta(seconds=timeout_s))
    beats = Heartbeat(
        rank,
        world,
        min(STALE_S, timeout_s),
        lambda: plan_position(phase.ex),
        lambda what: fail(comm, what, phase.where),
    )
    beats.start()
    comm = Comm.from_env(backend, timeout_s)
    beats.joined()
    return comm, beats


def fail(comm: Comm, what: str, where: str, cause: BaseException | None = None) -> NoReturn:
    """Tell the others where this rank stopped, name those that say nothing, and exit 1.

    Exits with os._exit: after a collective failed, gloo and NCCL threads may be blocked
    for good, and a normal interpreter exit could wait on them. No hang, ever. Under
    torchrun the SIGTERM that ends the job may arrive during the grace below: then
    `terminated` reports instead, in one line, with this failure in it.
    """
    if launcher_gone():  # a peer left for that reason first, and broke this rank's collective
        leave()
    # the SIGTERM line names the instruction already: of a PlanError it needs the cause only
    phase.failing = (
        (f"{type(cause).__name__}: {cause}" if cause else what).strip().split("\n")[0][:200]
    )
    silent, heard, woken = _hear_from_others(comm, f"{where}: {what.splitlines()[0][:300]}")
    lines = [f"schedc: error on rank {comm.rank} ({where}): {what}"]
    if silent:
        who = ", ".join(str(r) for r in silent)
        lines.append(
            f"schedc: rank {comm.rank}: rank{'s' if len(silent) > 1 else ''} {who} "
            f"stopped answering (dead, stopped, or stuck past --timeout "
            f"{comm.timeout.total_seconds():.0f}s); nothing from "
            f"{'them' if len(silent) > 1 else 'it'} in {FAILURE_GRACE_S:.0f}s"
        )
    if woken:
        lines.append(
            f"schedc: rank {comm.rank}: rank{'s' if len(woken) > 1 else ''} "
            f"{', '.join(map(str, woken))} {'were' if len(woken) > 1 else 'was'} "
            "stopped (SIGSTOP); sent SIGCONT so that the launcher's SIGTERM can end "
            f"{'them' if len(woken) > 1 else 'it'} now"
        )
    for r, text in sorted(heard.items()):
        lines.append(f"schedc: rank {comm.rank}: rank {r} failed too, at {text}")
    with _report:  # the SIGTERM report, if it came first, exits the process in here
        print("\n".join(lines), file=sys.stderr, flush=True)
        if not silent:  # else a silent peer is the likelier root cause: torchrun names it
            tell_launcher("\n".join(lines))  # under torchrun: shown in its report
        sys.stdout.flush()
        os._exit(1)


def _hear_from_others(comm: Comm, mine: str) -> tuple[list[int], dict[int, str], list[int]]:
    """Write where this rank failed to the store, and wait up to FAILURE_GRACE_S for the
    others' words: (the ranks that said nothing, what the others said, the silent ranks
    woken from a stop)."""
    others = [r for r in range(comm.world) if r != comm.rank]
    heard: dict[int, str] = {}
    if not dist.is_initialized():  # failing at start-up, before the job's rendezvous
        return [], {}, wake_stopped(others)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"schedc/failed/{comm.rank}", mine)
        # polled in short checks, not one long store.wait: the store client serves one
        # call at a time, and the SIGTERM report (`terminated`) must get a word in
        deadline = time.monotonic() + FAILURE_GRACE_S
        silent = list(others)
        while silent:
            for r in list(silent):
                if store.check([f"schedc/failed/{r}"]):
                    heard[r] = store.get(f"schedc/failed/{r}").decode()
                    silent.remove(r)
            if not silent or time.monotonic() > deadline:
                break  # a rank that never wrote is the answer
            time.sleep(0.05)
        return silent, heard, wake_stopped(silent)
    except Exception:  # noqa: BLE001 - the store is gone too (its host died)
        return others, {}, wake_stopped(others)


# -- a rank that torchrun terminates ------------------------------------------------------------
#
# When one rank dies, torchrun SIGTERMs the others within ~0.1 s, before their own failure
# report (above) is out; Python's default would end them silently. `schedc run` instead
# answers SIGTERM with one line: where this rank was in its plan, and which ranks it had
# heard from, then exits 143. The Python-level handler would run only between bytecodes of
# the main thread, which is usually blocked in C++ (a gloo/NCCL wait, the store), where it
# cannot run; so the signal only writes a byte to a wakeup fd (signal.set_wakeup_fd) and a
# daemon thread, which needs nothing but the GIL the blocked main thread released, reports
# and exits. Every store call in it is bounded (TERM_STORE_S): the store's host may be gone.


def watch_sigterm(comm: Comm) -> None:
    """Answer SIGTERM with `terminated()`."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread (schedc's CLI is the main thread)
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread below reports
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while os.read(r, 1) != bytes([signal.SIGTERM]):  # SIGINT writes its number too
            pass
        terminated(comm)

    threading.Thread(target=watch, name="schedc-sigterm", daemon=True).start()


def plan_position(ex: Executor | None) -> str:
    """`step 3, instruction 17 (allreduce[b1]@mb1 on stream comm)`: the plan instruction the
    executor is at, in the plan's own text, or the phase of the run between instructions."""
    if ex is None or ex.at is None:
        return phase.where
    k, ins, plan = ex.at, ex.plan.instrs[ex.at], ex.plan
    if ins.kind is Action.RUN:
        text = f"{ins.op} on stream {ins.stream}"
    elif ins.kind is Action.WAIT:
        text = f"wait on stream {ins.stream} for e{ins.event} = {_producer(plan, ins.event)}"
    else:
        text = f"record e{ins.event} on stream {ins.stream} after {_producer(plan, ins.event)}"
    return f"step {ex.step_index}, instruction {k} ({text})"


def _producer(plan: Plan, event: int | None) -> object:
    """The op an event follows, or the step start (the event no op produces)."""
    return plan.producers.get(event, "the step start") if event is not None else "the step start"


def terminated(comm: Comm) -> NoReturn:
    """SIGTERM (torchrun ending the job): one line naming where this rank was and which
    ranks it had heard from, written to the store as well; then exit TERM_EXIT."""
    where = plan_position(phase.ex)
    mine = f"{where}: terminated by SIGTERM"
    others = [r for r in range(comm.world) if r != comm.rank]
    heard: dict[int, str] = {}
    answered: list[bool] = []
    woken: list[int] = []

    def ask() -> None:  # in a thread of its own: a store whose host died blocks, not fails
        store = dist.distributed_c10d._get_default_store()
        store.set(f"schedc/failed/{comm.rank}", mine)  # a failing peer hears from us
        for r in others:
            if store.check([f"schedc/failed/{r}"]):
                heard[r] = store.get(f"schedc/failed/{r}").decode()
        answered.append(True)
        woken.extend(wake_stopped([r for r in others if r not in heard]))

    asker = threading.Thread(target=ask, name="schedc-sigterm-store", daemon=True)
    asker.start()
    asker.join(TERM_STORE_S)
    got = dict(heard)
    told = _heard(others, got, bool(answered), woken) if others else ""  # world 1: no one
    failing = f", while failing: {phase.failing}" if phase.failing else ""
    line = f"schedc: rank {comm.rank} terminated by SIGTERM at {where}{failing}{told}\n"
    with _report:
        os.write(2, line.encode(errors="replace"))  # unbuffered: no lock the main thread holds
        os._exit(TERM_EXIT)


def _heard(others: list[int], got: dict[int, str], answered: bool, woken: list[int]) -> str:
    """The SIGTERM line's account of the others: whom it heard from, who said nothing, whom
    it woke, or that the store did not answer."""
    if got:
        news = "; ".join(f"rank {r} at {t[:120]}" for r, t in sorted(got.items()))
        told = f"heard from {news}"
    else:
        told = "heard from no rank"
    silent = [r for r in others if r not in got]
    if silent and answered:
        told += f"; nothing from rank{'s' if len(silent) > 1 else ''} " + ", ".join(
            map(str, silent)
        )
    elif not answered:
        told += f" (the rendezvous store did not answer within {TERM_STORE_S:.0f}s)"
    if woken:
        told += "; sent SIGCONT to stopped rank " + ", ".join(map(str, woken))
    return f"; {told}"


def wake_stopped(silent: list[int]) -> list[int]:
    """SIGCONT the silent ranks that are stopped (SIGSTOP, ^Z) processes beside this one
    (exec/heartbeat.py `LocalPeer`: a sibling under the same launcher, of the same job).
    torchrun ends a job by SIGTERM, then waits 30 s (its --shutdown-timeout) before SIGKILL;
    a stopped process cannot act on SIGTERM, so one stopped rank made every such job take
    30 s more. Returns the ranks woken."""
    return [r for r in silent if LocalPeer(r).wake()]
