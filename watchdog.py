"""Where every rank is, and a watchdog that ends a hang with an answer instead of a collective timeout.

    progress = watchdog.start(out_dir, rank, world_size, hang_timeout_s)  # every rank, after init_process_group
    progress.enter(step, "generate")  # at each phase, every rank, the same phases in the same order
    progress.stop()                   # after the loop

Files under <out_dir>/logs/ (all ranks must see one directory: across nodes a shared file system,
which checkpoints need anyway):

    rank<r>.progress   a line per phase entered: `step 3 phase generate t=1764620000.123 wall=... n=14`
    rank<r>.heartbeat  rewritten by the rank's watchdog thread every poll: alive, pid, host, phase
    rank<r>.stacks     every thread's Python stack: on a hang, and on `kill -USR1 <pid>` at any time
    hang_report.txt    the ranks behind, their step, phase and seconds in it (the first detector's)

A rank advances when it enters a phase. In a split job (trainer.v1.trainer_mode=separate_async) the trainers
and the rollout pool enter different phases, so counts would not compare: each role gives its phases a place
in the step (`order`, placement.PHASE_ORDER) and a rank's position is (step, place), the places chosen so that
a rank waiting for the other role stands ahead of the one it waits for; the report names each rank's role.
Time counts from a rank's first `enter`, so engine start-up
and model loading are never timed. The job is hung when a rank that no other rank is behind has
spent longer in its phase than the phase's budget (hang_timeout_s, or enter's timeout_s): ranks
ahead of the slowest are waiting for it at a collective, not hung. Then every live rank dumps its
stacks, the report names the ranks behind (a stopped rank cannot dump, so it is named from its last
progress line and its silent heartbeat), and every live rank exits with HANG_EXIT_CODE, long before
actor_rollout_ref.nccl_timeout.

Why files, not the process group or torchrun's TCPStore: a hung rank hangs the group. The store keeps
answering while a collective hangs (tried: set/get from a thread while the main thread waited in a
gloo all_reduce on a SIGSTOPped peer), but without torchrun's agent it is served from rank 0's
process, which may be the one that stopped. Files have no server that can stop, read the same under
torchrun, SLURM and plain spawn, and stay behind for the post-mortem. On NFS a rank's appended lines
may reach other nodes up to ~30 s late (write-back); the heartbeat (rename + close) is not cached
that way, and hang_timeout_s is minutes.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

HANG_EXIT_CODE = 124  # as timeout(1): the job ended because a phase took too long
REPORT = "hang_report.txt"
_HOST = socket.gethostname()


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Phase:
    """A rank's position: its seq-th phase (0: none yet; with an order, the phase's place in the job), entered
    at wall time t (monotonic mono)."""

    seq: int
    step: int
    name: str
    t: float
    mono: float = 0.0
    timeout_s: float | None = None  # this phase's budget; None: the watchdog's hang_timeout_s


class Progress:
    """One rank's phase records (out_dir None: records nothing). enter() costs a few microseconds."""

    def __init__(self, out_dir: str | Path | None, rank: int = 0, role: str | None = None,
                 order: dict[str, int] | None = None) -> None:
        """role: this rank's role in a split job (named in the reports); order: its phases' places in a step
        (a rank's position is then (step, place) rather than a count: the roles enter different phases)."""
        self.rank, self.role, self.order = rank, role, order
        self.current = Phase(0, -1, "start", time.time(), time.monotonic())
        self.done = False
        self.log_dir = None if out_dir is None else Path(out_dir) / "logs"
        self._file: TextIO | None = None
        self.stacks: TextIO | None = None  # logs/rank<r>.stacks, open for faulthandler (start())
        self.watchdog: Watchdog | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # line-buffered: each line is one write(2), in the kernel before the next instruction runs,
            # so a rank stopped right after enter() still shows the phase it entered
            self._file = open(self.log_dir / f"rank{rank}.progress", "a", buffering=1)
            role = "" if role is None else f" role={role}"
            self._file.write(f"# start pid={os.getpid()} host={_HOST}{role} wall={_iso(time.time())}\n")

    def enter(self, step: int, phase: str, timeout_s: float | None = None) -> None:
        """This rank now runs `phase` of `step` (a name without spaces); timeout_s: its own budget
        (a phase known to be long, e.g. a large checkpoint save); 0: never times out."""
        if " " in phase:
            raise ValueError(f"phase names have no spaces: {phase!r}")
        now = time.time()
        self.current = Phase(self.position(step, phase), step, phase, now, time.monotonic(), timeout_s)
        if self._file is not None:
            budget = "" if timeout_s is None else f" timeout={timeout_s:g}"
            self._file.write(f"step {step} phase {phase} t={now:.3f} wall={_iso(now)} "
                             f"n={self.current.seq}{budget}\n")

    def position(self, step: int, phase: str) -> int:
        """The seq of entering `phase` of `step` now: the next count, or with an order the phase's place."""
        if self.order is None:
            return self.current.seq + 1
        if phase not in self.order:
            raise ValueError(f"phase {phase!r} has no place in the {self.role} order {self.order}")
        return (step + 1) * (max(self.order.values()) + 1) + self.order[phase]

    def stop(self) -> None:
        """The loop is over: peers no longer wait for this rank, and the watchdog thread ends."""
        self.done = True
        if self._file is not None:
            self._file.write(f"# stop wall={_iso(time.time())}\n")
        if self.watchdog is not None:
            self.watchdog.stop()


def parse_progress_line(line: str) -> Phase | None:
    """The Phase of a `step S phase P t=T wall=W n=N [timeout=X]` line; None for other lines."""
    parts = line.split()
    if len(parts) < 7 or parts[0] != "step" or parts[2] != "phase":
        return None
    fields = dict(p.split("=", 1) for p in parts[4:] if "=" in p)
    try:
        timeout = float(fields["timeout"]) if "timeout" in fields else None
        return Phase(int(fields["n"]), int(parts[1]), parts[3], float(fields["t"]), timeout_s=timeout)
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class RankView:
    """What one rank's watchdog knows of a rank (itself included) at one poll."""

    rank: int
    phase: Phase
    age_s: float  # seconds this observer has seen it in this phase (its own clock: no skew)
    budget_s: float  # the phase's budget (<= 0: none)
    heartbeat_age_s: float  # seconds since its heartbeat last changed (0 for the observer itself)
    done: bool = False
    pid: int | None = None
    host: str = "?"
    role: str | None = None  # a split job's: trainer / rollout

    @property
    def who(self) -> str:
        return str(self.rank) if self.role is None else f"{self.rank} ({self.role})"


def find_hang(views: list[RankView], stale_after_s: float) -> str | None:
    """Why the job is hung, or None. Hung: the ranks that no rank is behind (the lowest phase count
    among the ranks still in the loop) have spent longer in their phase than its budget, the largest
    any of them gave it (the others wait for that one: a save that rank 0 finishes alone)."""
    live = [v for v in views if not v.done]
    lowest = [v for v in live if v.phase.seq == min(w.phase.seq for w in live)]
    budgets = [v.budget_s if v.budget_s > 0 else float("inf") for v in lowest]  # 0: never times out
    v = max(lowest, key=lambda v: v.age_s, default=None)
    if v is None or v.phase.seq == 0 or v.age_s <= max(budgets):
        return None
    why = (f"step {v.phase.step} phase {v.phase.name} has not ended after {v.age_s:.1f} s on rank(s) "
           f"{', '.join(w.who for w in lowest)} (budget {max(budgets):g} s, trainer.hang_timeout_s), and "
           f"no rank is behind them")
    silent = [w for w in live if w.heartbeat_age_s > stale_after_s]
    if silent:
        why += "; " + ", ".join(f"rank {w.who} has had no heartbeat for {w.heartbeat_age_s:.1f} s"
                                for w in silent)
    return why


def format_report(views: list[RankView], why: str, observer: int, stale_after_s: float) -> str:
    """The hang report: the cause, the ranks behind, and every rank's phase and heartbeat."""
    now = time.time()
    live = [v for v in views if not v.done]
    lowest = min((v.phase.seq for v in live), default=0)
    silent = {v.rank for v in live if v.heartbeat_age_s > stale_after_s}
    ahead = any(v.phase.seq > lowest for v in live)
    behind = [v for v in live if v.rank in silent or (v.phase.seq == lowest and ahead)]
    lines = [f"watchdog (rank {observer}, {_iso(now)}): the job is hung: {why}."]
    if behind:
        lines.append("ranks behind:")
    for v in behind:
        where = f"step {v.phase.step} phase {v.phase.name}" if v.phase.seq else "not in the loop yet"
        role = "" if v.role is None else f"{v.role}, "
        line = f"  rank {v.rank} ({role}pid {v.pid} on {v.host}): {where}, entered {now - v.phase.t:.1f} s ago"
        if v.rank in silent:
            line += (f"; no heartbeat for {v.heartbeat_age_s:.1f} s: the process is stopped, dead, or in native "
                     f"code that holds the GIL (its stacks cannot be dumped; look at it with py-spy dump --pid)")
        lines.append(line)
    if not behind:
        lines.append("no rank is behind: every rank is in the same phase; a collective in it never completed, or "
                     "the phase needs longer than trainer.hang_timeout_s. The stacks show where each rank waits.")
    width = max([5, *(len(v.who) + 1 for v in views)])  # "3 (rollout)" in a split job
    lines.append(f"every rank:  {'rank':<{width}} step  phase            in phase  heartbeat")
    for v in sorted(views, key=lambda v: v.rank):
        mark = "  done" if v.done else ("  <- behind" if v in behind else "")
        lines.append(f"             {v.who:<{width}} {v.phase.step:<5} {v.phase.name:<16} {now - v.phase.t:>6.1f} s  "
                     f"{v.heartbeat_age_s:>6.1f} s{mark}")
    return "\n".join(lines) + "\n"


@dataclass
class _Seen:
    """A peer as this observer last read it, and since when (monotonic) its phase / heartbeat held."""

    seq: int = -1
    seq_since: float = 0.0
    beat: int = -1
    beat_since: float = 0.0


class Watchdog:
    """A daemon thread per rank: writes this rank's heartbeat, reads every rank's, and on a hang
    (find_hang, or another rank's report) calls on_hang(why, views); the default dumps the stacks,
    writes the report and exits the process with HANG_EXIT_CODE."""

    def __init__(self, progress: Progress, hang_timeout_s: float, world_size: int, stacks: TextIO | None = None,
                 poll_s: float | None = None,
                 on_hang: Callable[[str, list[RankView]], None] | None = None) -> None:
        if progress.log_dir is None:
            raise ValueError("the watchdog needs a Progress that writes files (out_dir given)")
        self.progress, self.rank, self.world_size = progress, progress.rank, world_size
        self.hang_timeout_s = hang_timeout_s
        # often enough that ranks agree within a few polls, rarely enough to cost nothing
        self.poll_s = poll_s if poll_s is not None else min(5.0, max(0.1, hang_timeout_s / 20))
        self.stale_after_s = 3 * self.poll_s + 1.0
        self.log_dir: Path = progress.log_dir
        self.stacks = stacks
        self.on_hang = on_hang or self.end_job
        self._beat = 0
        self._state = "running"
        self._seen: dict[int, _Seen] = {}
        self._write_lock = threading.Lock()  # stop() (main thread) and the polls both write the heartbeat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)  # never blocks exit
        self._complained = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._state = "done"
        self._stop.set()
        self.write_heartbeat()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as e:  # a bug or a flaky read here must never end a healthy run
                if not self._complained:
                    print(f"[rank {self.rank}] watchdog: poll failed ({type(e).__name__}: {e}); retrying",
                          file=sys.stderr, flush=True)
                    self._complained = True

    def poll(self) -> str | None:
        """One round: heartbeat out, every rank's state in, the verdict (and on_hang when hung)."""
        self.write_heartbeat()
        views = self.views()
        why = self._reported_hang() or find_hang(views, self.stale_after_s)
        if why is not None and self._state != "done":
            self.on_hang(why, views)
        return why

    # --- files

    def write_heartbeat(self) -> None:
        with self._write_lock:
            self._beat += 1
            p = self.progress.current
            record = {"beat": self._beat, "state": self._state, "pid": os.getpid(), "host": _HOST,
                      "role": self.progress.role,
                      "seq": p.seq, "step": p.step, "phase": p.name, "t": p.t, "timeout_s": p.timeout_s}
            path = self.log_dir / f"rank{self.rank}.heartbeat"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)  # atomic: a reader never sees half a record

    def _read_peer(self, rank: int) -> tuple[dict, Phase] | None:
        """(heartbeat record, phase) of a peer; its phase from the progress file's last line when that
        is newer than the heartbeat (a rank stopped right after enter() wrote no heartbeat since)."""
        try:
            record = json.loads((self.log_dir / f"rank{rank}.heartbeat").read_text())
        except (OSError, ValueError):
            return None  # not written yet (another node without this directory), or mid-replace
        phase = Phase(record["seq"], record["step"], record["phase"], record["t"], timeout_s=record["timeout_s"])
        try:
            with open(self.log_dir / f"rank{rank}.progress", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 512))
                last = f.read().decode(errors="replace").splitlines()
        except OSError:
            last = []
        if last and last[-1].startswith("# stop"):
            record["state"] = "done"
        tail = parse_progress_line(last[-1]) if last else None
        if tail is not None and tail.seq > phase.seq:
            phase = tail
        return record, phase

    def views(self) -> list[RankView]:
        """Every visible rank's state as of now, this rank's own from memory."""
        now = time.monotonic()
        own = self.progress.current
        views = [RankView(self.rank, own, now - own.mono, self._budget(own), 0.0, self.progress.done, os.getpid(),
                          _HOST, self.progress.role)]
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            read = self._read_peer(rank)
            if read is None:
                continue
            record, phase = read
            seen = self._seen.setdefault(rank, _Seen())
            if phase.seq != seen.seq:
                seen.seq, seen.seq_since = phase.seq, now
            if record["beat"] != seen.beat:
                seen.beat, seen.beat_since = record["beat"], now
            views.append(RankView(rank, phase, now - seen.seq_since, self._budget(phase), now - seen.beat_since,
                                  record["state"] == "done", record["pid"], record["host"], record.get("role")))
        return views

    def _budget(self, phase: Phase) -> float:
        return self.hang_timeout_s if phase.timeout_s is None else phase.timeout_s

    def _reported_hang(self) -> str | None:
        try:
            first = (self.log_dir / REPORT).read_text().split("\n", 1)[0]
        except OSError:
            return None
        return f"another rank reported a hang ({first})"

    # --- the end

    def end_job(self, why: str, views: list[RankView]) -> None:
        """Dump this rank's stacks, report, wait briefly for the other live ranks to dump theirs
        (torchrun kills the rest when the first exits), and exit with HANG_EXIT_CODE."""
        report = format_report(views, why, self.rank, self.stale_after_s)
        try:  # the first detector's report stays (O_EXCL), later ones go to their stderr only
            fd = os.open(self.log_dir / REPORT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write(report)
        except FileExistsError:
            pass
        live = [v.rank for v in views if not v.done and v.heartbeat_age_s <= self.stale_after_s]
        text = self.dump_stacks(f"watchdog: {why}")
        pointer = f"[rank {self.rank}] watchdog: hung; the report: {self.log_dir / REPORT}\n"
        text += report if self.rank == min(live) else pointer
        text += (f"[rank {self.rank}] watchdog: stacks in {self.log_dir}/rank{self.rank}.stacks; exiting with code "
                 f"{HANG_EXIT_CODE} rather than waiting for the collective timeout\n")
        sys.stdout.flush()
        _write_stderr(text)  # one write per rank: the ranks' dumps do not interleave
        self._state = "dumped"
        self.write_heartbeat()
        deadline = time.monotonic() + 2 * self.poll_s + 1.0
        while time.monotonic() < deadline and not all(self._peer_state(r) in ("dumped", None) for r in live):
            time.sleep(min(0.1, self.poll_s))
        os._exit(HANG_EXIT_CODE)

    def dump_stacks(self, why: str) -> str:
        """Every thread's Python stack, appended to logs/rank<r>.stacks under a header; returns the text."""
        path = self.log_dir / f"rank{self.rank}.stacks"
        with contextlib.ExitStack() as stack:
            out = self.stacks if self.stacks is not None else stack.enter_context(open(path, "a"))
            out.flush()
            start = path.stat().st_size
            out.write(f"--- rank {self.rank} pid {os.getpid()}, {_iso(time.time())}: {why}\n")
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def _peer_state(self, rank: int) -> str | None:
        if rank == self.rank:
            return "dumped"
        read = self._read_peer(rank)
        return None if read is None else read[0]["state"]


def _write_stderr(text: str) -> None:
    data = text.encode()
    while data:
        data = data[os.write(2, data):]


def start(out_dir: str | Path, rank: int, world_size: int, hang_timeout_s: float,
          poll_s: float | None = None, role: str | None = None, order: dict[str, int] | None = None) -> Progress:
    """This rank's Progress (role, order: a split job's, Progress), `kill -USR1 <pid>` stack dumps into
    logs/rank<r>.stacks, and (for hang_timeout_s > 0) its watchdog thread. One barrier when a process group
    exists, so that no rank reads a file an earlier run left: call it on every rank, after init_process_group."""
    progress = Progress(out_dir, rank, role, order)
    assert progress.log_dir is not None
    stacks = progress.stacks = open(progress.log_dir / f"rank{rank}.stacks", "a")  # faulthandler writes to its fd
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if not faulthandler.is_enabled():  # a segfault or abort leaves the Python stacks too
        faulthandler.enable(file=stacks, all_threads=True)
    if rank == 0 and (progress.log_dir / REPORT).exists():  # an earlier run's: kept, but not this run's
        os.replace(progress.log_dir / REPORT, progress.log_dir / f"{REPORT}.prev")
    dog = Watchdog(progress, hang_timeout_s, world_size, stacks, poll_s) if hang_timeout_s > 0 else None
    if dog is not None:
        dog.write_heartbeat()
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank's files are this run's from here on
    if dog is not None:
        progress.watchdog = dog
        dog.start()
    return progress
