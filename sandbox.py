"""A sandbox for running untrusted Python: one fresh interpreter per call, limited and killed cleanly.

    from sandbox import run_python_sandboxed, sandbox_plan
    run_python_sandboxed("print(2**10)", timeout_s=5)    # SandboxResult(text='1024\n', exit_code=0, ...)
    run_python_sandboxed("print(int(input()) * 2)", stdin="21\n").stdout    # '42\n'
    sandbox_plan().describe()                           # what this machine lets it guarantee

agent.PythonTool is the tool built on it, and code_reward runs programs against test cases with it. Linux only (rlimits, /proc, namespaces).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# What the sandbox guarantees depends on what the machine allows, probed once (sandbox_plan):
#   full  (root, and `unshare` of the network, mount and PID namespaces works):
#         - network: a namespace of its own with no interface up;
#         - files: the code runs as a uid of its own (no file, directory or process belongs to it), so
#           it can write only its scratch directory and the world-writable directories (/tmp, /var/tmp,
#           /dev/shm, ...), which are fresh size-limited tmpfs in its private mount namespace and
#           vanish with it. Directories the interpreter needs behind a private ancestor (a pyenv
#           Python under /root, mode 700) are bind-mounted read-only over an empty tmpfs that hides
#           the rest of that ancestor;
#         - processes: RLIMIT_NPROC on that uid (root ignores the limit; this uid does not); its PID 1
#           reaps orphans, and afterwards every process of the uid is killed, even one that left the
#           process group, so nothing is left, not even a zombie.
#   basic (anything else): the caller's user, its own session, killed by process group (a process
#         that calls setsid() escapes); sockets blocked by replacing socket.socket before the code runs
#         (best effort: ctypes or a subprocess get around it) unless `unshare --user --net` works for
#         this user; for root, process creation blocked the same way (RLIMIT_NPROC does not bind
#         root); for others RLIMIT_NPROC, which counts all the user's processes, set above today's
#         count. Writes outside the scratch directory are NOT prevented.
# Both: -I (isolated: no PYTHON* variables, no user site, no cwd on sys.path), an environment of
# PATH/HOME/TMPDIR/LANG only, RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE (which also caps what the code
# prints: its output goes to files), RLIMIT_NOFILE, no core files, a wall-clock timeout that kills
# the whole process group, and a fresh scratch directory as cwd, deleted after. Reading what the
# code's user may read (world-readable files such as /etc/passwd, the repository) is allowed.

_SANDBOX_SETUP_FAILED = 121  # the prelude's exit code when it could not set the sandbox up

_PRELUDE = r'''
import json, os, resource, sys
cfg, code = json.loads(sys.argv[1]), sys.argv[2]
try:
    if cfg["mount"]:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        def mount(src, dst, fstype=None, flags=0, data=None):
            enc = lambda s: None if s is None else s.encode()
            if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
                raise OSError(ctypes.get_errno(), "mount " + dst)
        MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
        mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the host
        keep = [(p, os.open(p, os.O_PATH)) for p in cfg["expose"]]  # handles to dirs about to be covered
        for d in cfg["hide"]:
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for d in cfg["writable"]:
            mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=%dm" % cfg["tmpfs_mb"])
        for p, fd in keep:
            os.makedirs(p, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            mount("none", p, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.close(fd)
    scratch = cfg["scratch"]
    os.makedirs(scratch, exist_ok=True)
    if cfg["uid"] is not None:
        os.chown(scratch, cfg["uid"], cfg["uid"])
    os.chdir(scratch)
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if cfg["uid"] is not None:  # for good: real, effective and saved ids
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
except BaseException as e:
    print("sandbox setup failed: %s: %s" % (type(e).__name__, e), file=sys.stderr)
    os._exit(121)
if cfg["pid_namespace"]:  # this process is PID 1 there: run the code in a child, reap every orphan
    child = os.fork()
    if child:
        while True:
            pid, status = os.wait()
            if pid == child:  # PID 1 cannot die of a signal from inside: 128 + signal, as a shell says it
                os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
def _deny(what):
    def deny(*args, **kwargs):
        raise PermissionError(what + " is disabled in this sandbox")
    return deny
if cfg["block_network"]:
    import socket, _socket
    class _NoSocket:
        def __init__(self, *args, **kwargs):
            raise PermissionError("network access is disabled in this sandbox")
    socket.socket = _socket.socket = socket.SocketType = _NoSocket
    socket.create_connection = socket.socketpair = socket.fromfd = _deny("network access")
if cfg["block_processes"]:
    import _posixsubprocess
    _posixsubprocess.fork_exec = _deny("starting processes")
    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp", "popen"):
        if hasattr(os, name):
            setattr(os, name, _deny("starting processes"))
del json, resource, cfg
sys.argv = ["main.py"]
try:
    exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this prelude's frame
    sys.exit(1)
'''


@dataclass(frozen=True)
class SandboxPlan:
    mode: str  # full | basic
    command: tuple[str, ...]  # run before the interpreter (unshare ...), or nothing
    per_call_uid: bool
    pid_namespace: bool
    mount: bool
    block_network: bool
    block_processes: bool
    expose: tuple[str, ...] = ()  # interpreter dirs behind private ancestors
    hide: tuple[str, ...] = ()  # those ancestors (covered by an empty tmpfs)
    writable: tuple[str, ...] = ()  # world-writable dirs (covered by a fresh tmpfs)

    def describe(self) -> dict[str, str]:
        return {
            "network": "network namespace" if not self.block_network else "socket.socket replaced (best effort)",
            "user": "a uid of its own per call" if self.per_call_uid else "the caller's user",
            "files": ("writes only to its scratch dir and private tmpfs" if self.mount and self.per_call_uid else
                      "writes outside the scratch dir not prevented"),
            "processes": ("RLIMIT_NPROC on its own uid, a PID namespace" if self.per_call_uid else
                          "process creation blocked in-process (best effort)" if self.block_processes else
                          "RLIMIT_NPROC over the user's processes (approximate)"),
        }


_PLANS: dict[str, SandboxPlan] = {}
_plan_lock = threading.Lock()  # many threads may run code at once: one probe per setting


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _blocked_ancestor(path: str) -> str | None:
    """The highest directory above `path` that other users cannot traverse."""
    parts = Path(path).parts
    for i in range(2, len(parts) + 1):
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def sandbox_plan(isolation: str = "auto") -> SandboxPlan:
    """How PythonTool isolates code on this machine (probed once per setting): 'auto' takes the full
    sandbox when root can unshare network and mount namespaces, else basic; 'basic' forces basic."""
    with _plan_lock:
        if isolation not in _PLANS:
            _PLANS[isolation] = _probe_plan(isolation)
        return _PLANS[isolation]


def _probe_plan(isolation: str) -> SandboxPlan:
    if isolation not in ("auto", "basic"):
        raise ValueError(f"PythonTool isolation={isolation!r}; valid: auto, basic")
    root, unshare = os.geteuid() == 0, shutil.which("unshare")
    namespaces = (unshare, "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--")
    if isolation == "auto" and root and unshare and _works([*namespaces, "true"]):
        out = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps([sys.prefix, sys.base_prefix, "
                              "sys.exec_prefix, sys.base_exec_prefix] + sys.path))"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        writable = tuple(d for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")
                         if os.path.isdir(d) and not os.path.islink(d) and os.stat(d).st_mode & 0o002)
        dirs = sorted({os.path.realpath(p) for p in json.loads(out) if p and os.path.isdir(p)})
        dirs = [d for d in dirs if not any(d.startswith(o + os.sep) for o in dirs)]  # the outermost ones
        hide = {a for d in dirs if (a := _blocked_ancestor(d))}
        hide |= {w for w in writable for d in dirs if d.startswith(w + os.sep)}  # an interpreter under /tmp
        expose = [d for d in dirs if any(d.startswith(h + os.sep) for h in hide)]
        plan = SandboxPlan("full", namespaces, per_call_uid=True, pid_namespace=True, mount=True,
                           block_network=False, block_processes=False, expose=tuple(expose),
                           hide=tuple(sorted(hide - set(writable))), writable=writable)
    else:
        userns = (not root and isolation == "auto" and unshare
                  and _works([unshare, "--user", "--map-root-user", "--net", "--", "true"]))
        plan = SandboxPlan("basic", (unshare, "--user", "--map-root-user", "--net", "--") if userns else (),
                           per_call_uid=False, pid_namespace=False, mount=False, block_network=not userns,
                           block_processes=root)
    return plan


# Each trainer process draws from its own block of uids (by pid), in turn, so a uid comes back only after
# thousands of calls; one with any process left (even a zombie nobody reaped) is skipped.
_UID_BASE, _UIDS_PER_PROCESS = 1_000_000, 4096
_uids_in_use: set[int] = set()
_uid_lock = threading.Lock()
_uid_turn = [0]


def _processes() -> list[tuple[int, int, int, int, str]]:
    """(pid, real uid, pgid, session, state) of every process, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue  # exited meanwhile
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        out.append((int(entry), uid, int(fields[2]), int(fields[3]), fields[0]))
    return out


def _tasks_of(uid: int) -> int:
    """Threads of all processes of `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    for p in _processes():
        if p[1] == uid:
            try:
                total += len(os.listdir(f"/proc/{p[0]}/task"))
            except OSError:
                pass
    return total


def _kill_matching(match: Callable[[tuple[int, int, int, int, str]], bool]) -> None:
    """SIGKILL every live process `match` selects until none is left (a fork bomb refills the table)."""
    for _ in range(200):
        pids = [p[0] for p in _processes() if p[4] != "Z" and p[0] != os.getpid() and match(p)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)


def _allocate_uid() -> int:
    """A uid no process has, for one call."""
    with _uid_lock:
        taken = {p[1] for p in _processes()} | _uids_in_use
        base = _UID_BASE + (os.getpid() % (1 << 19)) * _UIDS_PER_PROCESS  # < 2**31
        for _ in range(_UIDS_PER_PROCESS):
            uid = base + _uid_turn[0] % _UIDS_PER_PROCESS
            _uid_turn[0] += 1
            if uid not in taken:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError(f"all {_UIDS_PER_PROCESS} sandbox uids of this process are in use")


@dataclass(frozen=True)
class SandboxResult:
    text: str  # stdout, then stderr, then a line on why it was stopped (if it was)
    exit_code: int  # negative: killed by that signal
    timed_out: bool
    wall_s: float
    pid: int  # the child's pid (its process group and session id)
    uid: int | None  # the uid it ran as, when it had its own
    stdout: str = ""  # stdout alone (up to max_output_chars), for comparing it with an expected output


def run_python_sandboxed(code: str, timeout_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 1024,
                         max_processes: int = 32, max_file_mb: int = 16, max_output_chars: int = 4096,
                         tmpfs_mb: int = 64, isolation: str = "auto", stdin: str = "") -> SandboxResult:
    """Run `code` in a fresh interpreter under the limits, `stdin` as its standard input; never raises for
    what the code does. Safe to call from many threads at once."""
    plan = sandbox_plan(isolation)
    uid = _allocate_uid() if plan.per_call_uid else None
    host_dir = Path(tempfile.mkdtemp(prefix="python-tool-"))  # outputs; and the scratch dir in basic mode
    scratch = "/tmp/work" if plan.mount else str(host_dir / "work")
    mb = 1 << 20
    rlimits = {"RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_AS": (memory_mb * mb,) * 2,
               "RLIMIT_FSIZE": (max_file_mb * mb,) * 2, "RLIMIT_NOFILE": (256, 256), "RLIMIT_CORE": (0, 0)}
    if uid is not None:
        rlimits["RLIMIT_NPROC"] = (max_processes,) * 2
    elif os.geteuid() != 0:  # it counts all this user's tasks, threads too: allow max_processes more than now
        rlimits["RLIMIT_NPROC"] = (_tasks_of(os.getuid()) + max_processes,) * 2
    cfg = {"mount": plan.mount, "expose": plan.expose, "hide": plan.hide, "writable": plan.writable,
           "tmpfs_mb": tmpfs_mb, "scratch": scratch, "uid": uid, "rlimits": rlimits,
           "block_network": plan.block_network, "block_processes": plan.block_processes,
           "pid_namespace": plan.pid_namespace}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [*plan.command, sys.executable, "-I", "-B", "-u", "-c", _PRELUDE, json.dumps(cfg), code]
    start, timed_out = time.monotonic(), False
    try:
        (host_dir / "stdin").write_text(stdin, encoding="utf-8")
        with (open(host_dir / "stdin", "rb") as inp, open(host_dir / "stdout", "wb") as out,
              open(host_dir / "stderr", "wb") as err):
            proc = subprocess.Popen(argv, stdin=inp, stdout=out, stderr=err, env=env, cwd="/",
                                    start_new_session=True)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if uid is not None:  # every process of its uid, the namespace's PID 1 among them, which
                    _kill_matching(lambda p: p[1] == uid)  # unshare then reaps (no zombie for the host's init)
                    try:
                        proc.wait(5)
                    except subprocess.TimeoutExpired:
                        pass
                try:  # the whole process group
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if uid is None:  # what is left of its session (a process that called setsid() is not found)
                    _kill_matching(lambda p: proc.pid in (p[2], p[3]))
        wall_s = time.monotonic() - start

        def read(name: str) -> str:
            with open(host_dir / name, "rb") as f:
                return f.read(max_output_chars * 4).decode("utf-8", "replace")[:max_output_chars]

        stdout, stderr = read("stdout"), read("stderr")
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)
    rc = proc.returncode
    if plan.pid_namespace and 128 < rc < 160:  # the namespace's PID 1 relays a signal as 128 + N
        rc = 128 - rc
    if rc == _SANDBOX_SETUP_FAILED and stderr.startswith("sandbox setup failed"):
        raise RuntimeError(stderr.strip())
    text = stdout + ("\n" if stdout and stderr and not stdout.endswith("\n") else "") + stderr
    why = (f"the code ran longer than {timeout_s:g} s (wall clock) and was killed" if timed_out else
           f"the code used more than {cpu_s} s of CPU time and was killed" if rc == -signal.SIGXCPU else
           "the code was killed (SIGKILL: the CPU-time hard limit, or out of memory)" if rc == -signal.SIGKILL else
           f"the code wrote a file larger than {max_file_mb} MB and was killed" if rc == -signal.SIGXFSZ else
           f"the code was killed by signal {-rc}" if rc < 0 else
           f"the code exited with status {rc}" if rc > 0 and not stderr else "")
    if why:
        text += ("\n" if text and not text.endswith("\n") else "") + f"Error: {why}."
    return SandboxResult(text, rc, timed_out, wall_s, proc.pid, uid, stdout)
