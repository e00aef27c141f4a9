"""Run untrusted (model-written) Python programs with a wall-clock limit, rlimits and no host access.

Two isolation modes, chosen once per process and logged once:
- "bwrap": bubblewrap with every namespace unshared (network = loopback only, new pid namespace), a
  read-only root and /dev, private size-capped tmpfs on /tmp (the program's fresh working dir) and
  /dev/shm, no nested user namespaces, killed with its parent.
- "rlimits": where bwrap is missing or unusable; resource limits, a fresh working dir and a process group
  only. It has no filesystem or network isolation, and as a non-root user the program can signal the
  trainer's processes and escape the group kill with setsid(). Use bwrap for anything but a laptop.
In both modes the program runs with a clean environment under rlimits (CPU seconds, address space, file
size, process count, open files), in its own process group that is SIGKILLed at the wall-clock limit, and
its output is read incrementally and capped (the program is killed when it exceeds the cap), so the
trainer never buffers more than the cap. A root trainer runs each program under its own unprivileged
uid: root ignores RLIMIT_NPROC, so only an unprivileged uid contains a fork bomb, and a per-run uid lets
the cleanup kill every process the run left (even ones that left the process group) and nothing else.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterable

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 1 << 20
# Per-run uids for a root trainer: [base, base + 2**28), 4096 per trainer pid (mod 2**16). Far above
# any real or subordinate uid range, so a run's uid owns only that run's processes and files.
_UID_BASE = 0x70000000
_run_counter = itertools.count()
_CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "OMP_NUM_THREADS": "1",  # numeric libraries would otherwise start one thread per host core
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# Runs first inside the sandbox: set the limits (soft = hard, so the program cannot raise them), then run
# the program file as __main__, as `python main.py` would. `-I` keeps PYTHON* variables and user site out.
_PRELUDE = """\
import resource, runpy, sys
for name, value in {limits!r}:
    resource.setrlimit(getattr(resource, name), (value, value))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclasses.dataclass(frozen=True)
class RunResult:
    """Outcome of one run. A program killed by a signal has returncode -signal ("rlimits") or
    128 + signal ("bwrap" reports its child's death that way); `timed_out` means the wall-clock kill."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str  # "bwrap" | "rlimits"
    output_truncated: bool = False
    wall_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one run; `tmpfs_mb` caps each private tmpfs of the bwrap sandbox."""

    timeout_s: float = 3.0
    memory_mb: int = 4096
    file_mb: int = 32
    nproc: int = 64
    nofile: int = 256
    tmpfs_mb: int = 64
    max_output_bytes: int = MAX_OUTPUT_BYTES

    def rlimits(self) -> tuple[tuple[str, int], ...]:
        mb = 1 << 20
        return (("RLIMIT_CPU", math.ceil(self.timeout_s) + 1), ("RLIMIT_AS", self.memory_mb * mb),
                ("RLIMIT_FSIZE", self.file_mb * mb), ("RLIMIT_NPROC", self.nproc),
                ("RLIMIT_NOFILE", self.nofile), ("RLIMIT_CORE", 0))


def _run_uid() -> int | None:
    """A fresh unprivileged uid for one run when the trainer is root, else None (keep the trainer's)."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + ((os.getpid() & 0xFFFF) << 12) + (next(_run_counter) & 0xFFF)


def _as_user(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _argv(mode: str, program: str, limits: Limits) -> list[str]:
    python = [sandbox_python(), "-I", "-c", _PRELUDE.format(limits=limits.rlimits())]
    if mode == "rlimits":
        return python + [program]
    tmpfs = str(limits.tmpfs_mb << 20)
    return ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--ro-bind", "/", "/", "--dev", "/dev", "--remount-ro", "/dev",
            "--proc", "/proc", "--size", tmpfs, "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/dev/shm",
            "--ro-bind", program, "/tmp/main.py", "--chdir", "/tmp", "--", *python, "/tmp/main.py"]


@functools.cache
def sandbox_python() -> str:
    """The interpreter for sandboxed programs: $MARLJAX_SANDBOX_PYTHON, else the trainer's own, else
    python3 on the clean PATH, the first one an unprivileged uid can run (a venv whose interpreter lies
    under /root is not; programs then see only that interpreter's packages)."""
    forced = os.environ.get("MARLJAX_SANDBOX_PYTHON")
    candidates = [forced] if forced else [sys.executable, shutil.which("python3", path=_CLEAN_ENV["PATH"])]
    for python in filter(None, candidates):
        try:
            ok = subprocess.run([python, "-I", "-c", "pass"], env=_CLEAN_ENV, capture_output=True,
                                timeout=30, **_as_user(_run_uid())).returncode == 0
        except OSError:
            ok = False
        if ok:
            log.info("sandbox interpreter: %s", python)
            return python
    raise RuntimeError(f"No Python interpreter among {candidates} can be run by an unprivileged user; set "
                       "MARLJAX_SANDBOX_PYTHON to one outside private dirs such as /root (e.g. /usr/bin/"
                       "python3).")


@functools.cache
def isolation_mode() -> str:
    """The isolation this process uses ("bwrap" or "rlimits"), probed once and logged once; for metrics."""
    if not shutil.which("bwrap"):
        reason = "bwrap is not installed (apt-get install bubblewrap)"
    else:
        probe = run_python("print('ok')", timeout_s=30, isolation="bwrap")
        if probe.returncode == 0 and probe.stdout == "ok\n":
            log.info("sandbox isolation: bwrap (namespaces, read-only root, no network) + rlimits")
            return "bwrap"
        reason = f"bwrap failed (exit {probe.returncode}): {probe.stderr.strip()}"
    log.warning("sandbox isolation: rlimits + process group only, no filesystem/network isolation; %s",
                reason)
    return "rlimits"


def _prepare(tmpdir: str, source: str, uid: int | None) -> str:
    """Write the program into a fresh host dir: readable by the run's uid, which owns the dir (the working
    dir in "rlimits" mode)."""
    os.chmod(tmpdir, 0o755)
    program = os.path.join(tmpdir, "main.py")
    with open(program, "w") as f:
        f.write(source)
    os.chmod(program, 0o444)
    if uid is not None:
        os.chown(tmpdir, uid, uid)
    return program


def _exited(proc: subprocess.Popen) -> bool:
    """Whether the program exited, without reaping it (its pid must stay valid as a process-group id)."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until EOF, the deadline, or more than `cap` bytes on either; returns (out, err,
    timed_out, truncated). Stops early when the program has exited but a leftover child holds the pipes."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    timed_out = truncated = False
    with selectors.DefaultSelector() as sel:
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map() and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            exited = _exited(proc)  # checked before select: what it wrote before exiting is readable now
            events = sel.select(0 if exited else min(remaining, 0.05))
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fd)
                buf = bufs[key.fd]
                truncated |= len(buf) + len(chunk) > cap
                buf += chunk[: cap - len(buf)]
            if exited and not events:
                break
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), timed_out, truncated


def _live_pids(uid: int) -> list[int]:
    """Pids owned by `uid`, zombies excluded (they hold nothing but a pid until their reaper runs)."""
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] != "Z":
                        pids.append(int(name))
        except OSError:
            pass  # exited meanwhile
    return pids


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process owned by `uid` until none is left (the run's uid owns nothing else).
    pidfds make it safe against pid reuse; a fork bomb converges because killed processes cannot fork."""
    while pids := _live_pids(uid):
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.001)


def _cleanup(proc: subprocess.Popen, uid: int | None, grace_s: float) -> None:
    """Kill what the run left: its process group (in "bwrap" mode that tears down its pid namespace),
    then, for a root trainer, every live process of the run's uid, until all are gone. A program that
    finished gets `grace_s` to exit on its own first, so bwrap reaps its child instead of leaving a
    zombie for init."""
    deadline = time.monotonic() + grace_s
    while not _exited(proc) and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if uid is not None:
        _kill_uid(uid)


def run_python(source: str, stdin: str = "", timeout_s: float = 3.0, memory_mb: int = 4096,
               max_output_bytes: int = MAX_OUTPUT_BYTES, isolation: str | None = None) -> RunResult:
    """Run `source` as a Python program in the sandbox with `stdin`; never raises for program failures.

    `isolation` forces "bwrap" or "rlimits" (tests, benchmarks); None uses `isolation_mode()`."""
    mode = isolation or isolation_mode()
    if mode not in ("bwrap", "rlimits"):
        raise ValueError(f"isolation={mode!r}; expected 'bwrap', 'rlimits' or None (auto).")
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    uid = _run_uid()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmpdir, tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        program = _prepare(tmpdir, source, uid)
        proc = subprocess.Popen(_argv(mode, program, limits), stdin=stdin_file, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=tmpdir, env=_CLEAN_ENV,
                                start_new_session=True, **_as_user(uid))
        out, err, timed_out, truncated = b"", b"", True, False
        try:
            out, err, timed_out, truncated = _collect(proc, start + timeout_s, max_output_bytes)
        finally:
            _cleanup(proc, uid, grace_s=0.0 if timed_out or truncated else 1.0)
            proc.stdout.close()
            proc.stderr.close()
    return RunResult(returncode=proc.returncode, stdout=out.decode(errors="replace"),
                     stderr=err.decode(errors="replace"), timed_out=timed_out, isolation=mode,
                     output_truncated=truncated, wall_s=time.monotonic() - start)


@functools.cache
def executor() -> concurrent.futures.ThreadPoolExecutor:
    """Shared pool for sandbox work: each thread only waits on a child process, so one per core keeps the
    CPUs busy while the trainer's thread continues (`executor().submit(grade_code, text, tests)`)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                 thread_name_prefix="sandbox")


def run_many(sources: Iterable[str], stdins: Iterable[str] | None = None, **kwargs) -> list[RunResult]:
    """Run many programs in parallel on `executor()`; results in input order. kwargs go to `run_python`."""
    sources = list(sources)
    stdins = [""] * len(sources) if stdins is None else list(stdins)
    futures = [executor().submit(run_python, s, i, **kwargs) for s, i in zip(sources, stdins, strict=True)]
    return [f.result() for f in futures]
