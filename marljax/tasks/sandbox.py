"""Run untrusted (model-written) Python programs with a wall-clock limit, rlimits and no host access.

Two isolation modes (`MODES`); the caller names one (code grading: `task.sandbox`, default "bwrap"), and
nothing falls back on its own: asking for "bwrap" where it does not work raises `SandboxUnavailable`.
- "bwrap": bubblewrap with every namespace unshared (network = loopback only, new pid namespace), no
  nested user namespaces, killed with its parent. The program sees a read-only root that holds only what
  the interpreter needs: /usr, /bin, /sbin, /lib* (the system's), the interpreter's install dirs (its
  prefix and, for a venv, the venv; not the dirs around them), /etc/ld.so.cache and /etc/localtime;
  plus a fresh /proc, a minimal read-only /dev and private size-capped tmpfs on /tmp (its working dir)
  and /dev/shm. The trainer's home, the checkout, run dirs, /var, /srv, /opt, /mnt and mounted data do
  not exist there.
- "rlimits": only where asked for explicitly; resource limits, a fresh working dir and a process group.
  It has no filesystem or network isolation, and as a non-root user the program can signal the
  trainer's processes and escape the group kill with setsid(), and its RLIMIT_NPROC counts every
  process and thread of the trainer's uid. Use bwrap for anything but a laptop.
In both modes the program runs with a clean environment under rlimits (CPU seconds, address space, file
size, process count, open files), in its own process group that is SIGKILLed at the wall-clock limit, and
its output is read incrementally and capped (the program is killed when it exceeds the cap), so the
trainer never buffers more than the cap. A run returns only when its processes are gone: bwrap's pid
namespace has exited, the process group is empty. A root trainer runs each program under its own
unprivileged uid: root ignores RLIMIT_NPROC, so only an unprivileged uid contains a fork bomb, and a
per-run uid lets the cleanup kill every process the run left (even ones that left the process group) and
nothing else.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger(__name__)

MODES = ("bwrap", "rlimits")
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
# What a bwrap sandbox shows of the host besides the interpreter's own dirs (read-only): the system's
# programs and libraries (as the symlinks they are on merged-/usr systems), the dynamic loader's cache
# and the time zone.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_NAMESPACE_EXIT_S = 10.0  # the kernel empties a pid namespace in milliseconds; this only bounds a hang
# Runs first inside the sandbox: set the limits (soft = hard, so the program cannot raise them), then run
# the program file as __main__, as `python main.py` would. `-I` keeps PYTHON* variables and user site out.
_PRELUDE = """\
import resource, runpy, sys
for name, value in {limits!r}:
    resource.setrlimit(getattr(resource, name), (value, value))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
_PREFIXES = ("import json, sys; "
             "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))")


class SandboxUnavailable(RuntimeError):
    """The isolation asked for does not work on this host; the message names the fix."""


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


@dataclasses.dataclass(frozen=True)
class Interpreter:
    """The Python that runs sandboxed programs, and the install dirs a bwrap sandbox must show for it
    (sys.prefix, sys.base_prefix and the exec prefixes: a venv and the Python it was made from)."""

    path: str
    prefixes: tuple[str, ...]


def _run_uid() -> int | None:
    """A fresh unprivileged uid for one run when the trainer is root, else None (keep the trainer's)."""
    if os.geteuid() != 0:
        return None
    return _UID_BASE + ((os.getpid() & 0xFFFF) << 12) + (next(_run_counter) & 0xFFF)


def _as_user(uid: int | None) -> dict:
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _read_only_binds(python: Interpreter) -> list[str]:
    """bwrap arguments that show, read-only, the system dirs, the interpreter (its install dirs only, not
    the dirs around them: a Python under /root/.pyenv shows that version's dir, not /root) and the /etc
    files Python reads; nothing else of the host exists in the sandbox."""
    args, shown = [], []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
        else:
            continue
        shown.append(path)
    for path in sorted({*python.prefixes, python.path}):  # a parent sorts before its children
        if not any(_under(path, d) for d in shown):
            args += ["--ro-bind", path, path]
            shown.append(path)
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def _argv(mode: str, program: str, limits: Limits, info_fd: int | None) -> list[str]:
    python = interpreter()
    command = [python.path, "-I", "-c", _PRELUDE.format(limits=limits.rlimits())]
    if mode == "rlimits":
        return command + [program]
    tmpfs = str(limits.tmpfs_mb << 20)
    return ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--info-fd", str(info_fd), *_read_only_binds(python),
            "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc",
            "--size", tmpfs, "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/dev/shm",
            "--ro-bind", program, "/tmp/main.py", "--remount-ro", "/",  # last: the mount points exist now
            "--chdir", "/tmp", "--", *command, "/tmp/main.py"]


@functools.cache
def interpreter() -> Interpreter:
    """The interpreter for sandboxed programs: $MARLJAX_SANDBOX_PYTHON, else the trainer's own, else
    python3 on the clean PATH, the first one an unprivileged uid can run (a venv whose interpreter lies
    under /root is not; programs then see only that interpreter's packages)."""
    forced = os.environ.get("MARLJAX_SANDBOX_PYTHON")
    candidates = [forced] if forced else [sys.executable, shutil.which("python3", path=_CLEAN_ENV["PATH"])]
    for python in filter(None, candidates):
        try:
            probe = subprocess.run([python, "-I", "-c", _PREFIXES], env=_CLEAN_ENV, capture_output=True,
                                   text=True, timeout=30, **_as_user(_run_uid()))
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            # A prefix of "/" keeps its files in /usr and /lib, which are shown anyway: never bind "/".
            prefixes = tuple(p for p in dict.fromkeys(json.loads(probe.stdout)) if p != "/")
            log.info("sandbox interpreter: %s (install dirs %s)", python, ", ".join(prefixes))
            return Interpreter(python, prefixes)
    raise RuntimeError(f"No Python interpreter among {candidates} can be run by an unprivileged user; set "
                       "MARLJAX_SANDBOX_PYTHON to one outside private dirs such as /root (e.g. /usr/bin/"
                       "python3).")


@functools.cache
def bwrap_problem() -> str | None:
    """Why bwrap isolation does not work on this host, or None when it does; probed once per process."""
    if not shutil.which("bwrap", path=_CLEAN_ENV["PATH"]):
        return "bwrap is not installed"
    probe = _run("print('ok')", "", Limits(timeout_s=30), "bwrap")
    if probe.returncode == 0 and probe.stdout == "ok\n":
        log.info("sandbox isolation: bwrap (namespaces, read-only interpreter-only root, no network) "
                 "+ rlimits")
        return None
    return f"bwrap fails here (exit {probe.returncode}): {probe.stderr.strip()[-500:]}"


def isolation_mode() -> str:
    """The strongest isolation that works on this host: "bwrap", else "rlimits" (for benchmarks and CI
    checks). Grading never picks a mode by itself: it runs the one it is given or refuses (`require`)."""
    return "rlimits" if bwrap_problem() else "bwrap"


@functools.cache
def _warn_unisolated() -> None:
    log.warning("sandbox isolation: rlimits + process group only (task.sandbox=rlimits): model-written "
                "programs run with NO filesystem or network isolation")


def require(mode: str) -> str:
    """`mode` if this host can run it. Fails closed: "bwrap" where bwrap is missing or broken raises
    `SandboxUnavailable` naming the fix; "rlimits" is logged (once) as unisolated."""
    if mode not in MODES:
        raise ValueError(f"sandbox isolation {mode!r}; choose 'bwrap' (isolated) or 'rlimits' (no "
                         "filesystem or network isolation), e.g. task.sandbox=bwrap.")
    if mode == "bwrap" and (problem := bwrap_problem()):
        raise SandboxUnavailable(
            f"code grading runs model-written programs only inside the bwrap sandbox, and {problem}. "
            "Install bubblewrap (apt-get install bubblewrap), or set task.sandbox=rlimits to accept running "
            "them with rlimits only (no filesystem or network isolation).")
    if mode == "rlimits":
        _warn_unisolated()
    return mode


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


def _matches(pid: int, uid: int | None, pgid: int | None) -> bool:
    """Whether `pid` is live (not a zombie: it holds nothing but a pid until reaped), owned by `uid` and
    in process group `pgid` (None: any)."""
    try:
        if uid is not None and os.stat(f"/proc/{pid}").st_uid != uid:
            return False
        with open(f"/proc/{pid}/stat") as f:
            state, _, group = f.read().rpartition(")")[2].split()[:3]
    except OSError:
        return False  # exited meanwhile
    return state != "Z" and (pgid is None or int(group) == pgid)


def _kill_all(uid: int | None = None, pgid: int | None = None) -> None:
    """SIGKILL every live process owned by `uid` / in process group `pgid` until none is left (a run's
    uid or group holds nothing else). pidfds make it safe against pid reuse; a fork bomb converges
    because killed processes cannot fork."""
    while pids := [int(n) for n in os.listdir("/proc") if n.isdigit() and _matches(int(n), uid, pgid)]:
        if uid is not None:
            _kill_as(uid)
        for pid in pids:
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if _matches(pid, uid, pgid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        time.sleep(0.001)


def _kill_as(uid: int) -> None:
    """kill(-1, SIGKILL) sent as `uid` (a run's own uid, `/bin/kill` run as it): the kernel signals every
    process of the uid in one pass, where the /proc sweep of `_kill_all` trails a fork bomb whose
    children leave the group (a loaded host took 3-7 s that way). The sweep still checks after it.
    Behind util-linux's `setpriv` where there is one, so that Popen can vfork: Popen's own `user=` forks
    the whole trainer (~1 s for a 3 GB one beside busy processes, while the run's processes spin)."""
    kill = shutil.which("kill", path="/bin:/usr/bin")
    if kill is None:
        return
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin")
    command = [kill, "-KILL", "-1"]
    argv, as_user = (([setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *command], {}) if setpriv
                     else (command, _as_user(uid)))
    try:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=5, **as_user)
    except (OSError, subprocess.SubprocessError):
        pass  # the sweep kills them one by one


def _namespace_init(info_fd: int, deadline: float) -> int | None:
    """A pidfd of the init of the sandbox's pid namespace, whose pid bwrap writes to `info_fd` (JSON) as
    soon as it started it; None when bwrap failed first. Opened at once: bwrap exits without reaping its
    init (which then tears the namespace down on its own), so only then is the pid surely still its."""
    data = b""
    while select.select([info_fd], [], [], max(0.0, deadline - time.monotonic()))[0] and \
            (chunk := os.read(info_fd, 4096)):
        data += chunk
        try:
            pid = json.loads(data)["child-pid"]
        except (ValueError, KeyError):
            continue  # not all of it yet
        try:
            return os.pidfd_open(pid)
        except OSError:
            return None  # gone already
    return None


def _kill_namespace(pidfd: int) -> None:
    """SIGKILL the pid namespace's init and wait for it to exit: the kernel kills every other process of
    the namespace and waits for them to go before the init exits, so then none is left."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll(_NAMESPACE_EXIT_S * 1000):
        log.warning("sandbox: a pid namespace was still alive %.0f s after its init was killed",
                    _NAMESPACE_EXIT_S)
    os.close(pidfd)


def _start(mode: str, program: str, limits: Limits, deadline: float, uid: int | None,
           **popen) -> tuple[subprocess.Popen, int | None]:
    """Start the program; for bwrap, also a pidfd of its pid namespace's init (see `_namespace_init`)."""
    if mode == "rlimits":
        return subprocess.Popen(_argv(mode, program, limits, None), **popen, **_as_user(uid)), None
    info_r, info_w = os.pipe()
    try:
        proc = subprocess.Popen(_argv(mode, program, limits, info_w), pass_fds=(info_w,), **popen,
                                **_as_user(uid))
    finally:
        os.close(info_w)
    try:
        return proc, _namespace_init(info_r, deadline)
    finally:
        os.close(info_r)


@contextlib.contextmanager
def _outranking():
    """Run the block at nice -20 where this thread may take it (a root trainer; nice is per thread on
    Linux, and inherited by what the thread starts: the kill as a run's uid), then restore its nice.
    A fork bomb keeps RLIMIT_NPROC processes spinning at nice 0; at equal weight they starved the kill
    of a 2-core CI's test worker for up to 18.8 s."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, -20)
    except PermissionError:
        before = None  # an unprivileged trainer cannot lower its nice; its runs' processes share its uid
    try:
        yield
    finally:
        if before is not None:
            os.setpriority(os.PRIO_PROCESS, tid, before)


def _cleanup(proc: subprocess.Popen, init: int | None, uid: int | None, grace_s: float) -> None:
    """Kill what the run left, and return once it is gone: bwrap's pid namespace (every process in it;
    `init`: a pidfd of its init), the process group, and, for a root trainer, every live process of the
    run's uid (first all at once, kill(-1) as that uid, then a check). A program that finished gets
    `grace_s` to exit on its own first (bwrap then exits with the program's status)."""
    deadline = time.monotonic() + grace_s
    while not _exited(proc) and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is not None:
        _kill_as(uid)  # what left the group too, before the sweeps below look for it one by one
    if init is not None:
        _kill_namespace(init)
    else:  # rlimits (or a bwrap that failed early); before reaping the leader, whose pid is the group id
        _kill_all(pgid=proc.pid)
    proc.wait()
    if uid is not None:
        _kill_all(uid=uid)


def run_python(source: str, stdin: str = "", timeout_s: float = 3.0, memory_mb: int = 4096,
               max_output_bytes: int = MAX_OUTPUT_BYTES, isolation: str = "bwrap") -> RunResult:
    """Run `source` as a Python program in the sandbox with `stdin`; never raises for program failures.

    `isolation`: "bwrap" (raises `SandboxUnavailable` where it does not work) or "rlimits" (no filesystem
    or network isolation; see the module docstring)."""
    limits = Limits(timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    return _run(source, stdin, limits, require(isolation))


def _run(source: str, stdin: str, limits: Limits, mode: str) -> RunResult:
    uid = _run_uid()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmpdir, tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        program = _prepare(tmpdir, source, uid)
        proc, init = _start(mode, program, limits, start + limits.timeout_s, uid, stdin=stdin_file,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmpdir, env=_CLEAN_ENV,
                            start_new_session=True)
        out, err, timed_out, truncated = b"", b"", True, False
        with _outranking():  # from here on: the program (at the nice it started with) cannot starve this
            try:
                out, err, timed_out, truncated = _collect(proc, start + limits.timeout_s,
                                                          limits.max_output_bytes)
            finally:
                _cleanup(proc, init, uid, grace_s=0.0 if timed_out or truncated else 1.0)
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

