"""Hostile programs against the sandbox, each checked from outside: what it tried, and whether it was held.

    python tests/sandbox_battery.py --isolation full    # one JSON line per probe: {"probe", "held", "seen"}

Standard library only (like sandbox.py), so that tests/test_sandbox.py can run it as root and as an
ordinary user (uid 65534, from a copy in a directory that user may read). Each probe plants something the
program must not reach (a secret in $HOME, in this process's environment and memory, a signal handler, a
listening socket, files outside its scratch dir) and looks afterwards whether it was reached.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import sandbox  # noqa: E402


def _processes_with(marker: str) -> list[int]:
    """The pids of `sleep MARKER`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"sleep\0" + marker.encode()):  # the program, not its caller
                    found.append(int(entry))
        except OSError:
            pass
    return found


def _gone(marker: str, wait_s: float = 3.0) -> bool:
    deadline = time.monotonic() + wait_s
    while _processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def battery(isolation: str, work: Path) -> list[dict]:
    """Run every probe once; `work` is a directory this user owns (home, targets)."""
    token = uuid.uuid4().hex
    run = lambda code, **kw: sandbox.run_python_sandboxed(code, isolation=isolation, **{  # noqa: E731
        "timeout_s": 4.0, "cpu_s": 2, "memory_mb": 512, **kw})
    results = []

    def report(probe: str, held: bool, seen: str) -> None:
        results.append({"probe": probe, "held": bool(held), "seen": seen.strip()[-160:]})

    # secrets in the caller's home
    home = work / "home"
    home.mkdir(mode=0o700)
    (home / ".netrc").write_text(f"machine api.example.com login me password {token}\n")
    (home / ".netrc").chmod(0o600)
    os.environ["HOME"] = str(home)
    r = run(f"print(open({str(home / '.netrc')!r}).read())")
    report("read ~/.netrc", token not in r.text, r.text)
    # the caller's environment and memory, through /proc
    os.environ["FAKE_API_KEY"] = "env-" + token
    r = run(f"print(open('/proc/{os.getpid()}/environ', 'rb').read())")
    report("read the caller's environment", "env-" + token not in r.text, r.text)
    secret = ctypes.create_string_buffer(("mem-" + token).encode())
    r = run(f"f = open('/proc/{os.getpid()}/mem', 'rb'); f.seek({ctypes.addressof(secret)}); print(f.read(36))")
    report("read the caller's memory", "mem-" + token not in r.text, r.text)
    # signals to the caller
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    r = run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)")
    time.sleep(0.2)
    signal.signal(signal.SIGUSR1, old)
    report("signal the caller", not got, r.text)
    # writes outside the scratch dir, directly and through a symlink
    outside, target = work / f"written-{token}", work / "target.txt"
    work.chmod(0o777)
    target.write_text("untouched")
    target.chmod(0o666)
    r = run(f"open({str(outside)!r}, 'w').write('x')")
    report("write outside the scratch dir", not outside.exists(), r.text)
    r = run(f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'a').write('x')")
    report("write through a symlink", target.read_text() == "untouched", r.text)
    # a daemon that leaves the session, and one exec'd program
    marker = f"{time.time() % 1000:.6f}{os.getpid() % 1000}"
    r = run(f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('parent done')")
    report("leave a daemon running", _gone(marker), r.text)
    for pid in _processes_with(marker):  # where it was not held: end it here
        os.kill(pid, signal.SIGKILL)
    # the network: a listener on 127.0.0.1, reached directly and from a program exec'd past any in-process block
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.3)
        port = server.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')"
        for probe, code in [("connect to 127.0.0.1", connect),
                            ("connect via os.execv", f"import os, sys\nos.execv(sys.executable, "
                                                     f"[sys.executable, '-c', {connect!r}])")]:
            r = run(code)
            try:
                server.accept()[0].close()
                reached = True
            except TimeoutError:
                reached = False
            report(probe, not reached, r.text)
    # a fork bomb, and memory
    start = time.monotonic()
    # (it stops by itself after 8 s, so that one that escapes a broken sandbox does not run on)
    r = run("import os, time\nend = time.time() + 8\nwhile time.time() < end:\n    try:\n        os.fork()\n"
            "    except Exception:\n        pass", timeout_s=2.0)
    report("fork bomb", time.monotonic() - start < 6 and r.exit_code != 0, r.text)
    r = run("x = bytearray(2 * 1024**3)")
    report("2 GB in one process (memory_mb=512)", r.exit_code != 0, r.text)
    r = run("print([line.split()[1] for line in open('/proc/self/status') if line.startswith('Cap')])")
    caps = r.stdout.strip("[]'\n").split("', '")  # inheritable, permitted, effective, bounding, ambient
    report("hold capabilities", len(caps) == 5 and {caps[i] for i in (0, 1, 2, 4)} == {"0" * 16}, r.text)
    r = run("print(open('/proc/self/oom_score_adj').read())")
    report("the OOM killer's first choice", r.stdout.strip() == "1000", r.text)
    # the caller dies (SIGKILL) in the middle of a call: the program must not outlive it
    marker = f"{time.time() % 1000:.6f}{os.getpid() % 1000 + 1000}"
    caller = subprocess.Popen([sys.executable, "-I", __file__, "--isolation", isolation, "--sleep", marker],
                              stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = bool(_processes_with(marker))
    caller.kill()
    caller.wait()
    report("outlive its caller", started and _gone(marker), f"started={started}")
    for pid in _processes_with(marker):
        os.kill(pid, signal.SIGKILL)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--isolation", default="full")
    parser.add_argument("--sleep", help="only run `sleep SLEEP` in the sandbox (a caller to kill mid-call)")
    args = parser.parse_args()
    if args.isolation == "basic" and os.geteuid() == 0:  # the code would run as root, unconfined
        sys.exit("the battery does not run the basic sandbox as root: its programs would act as root on this machine")
    if args.sleep:
        sandbox.run_python_sandboxed(f"import os; os.execv('/bin/sleep', ['sleep', {args.sleep!r}])",
                                     isolation=args.isolation, timeout_s=120)
        return
    with tempfile.TemporaryDirectory(prefix="sandbox-battery-") as work:
        for row in battery(args.isolation, Path(work)):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
