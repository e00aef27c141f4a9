"""Containment and visibility probes of the sandbox, for tests/test_sandbox.py.

The test process (a root trainer) calls these functions with `marljax.tasks.sandbox`; for a non-root
trainer the test copies this file and marljax/tasks/sandbox.py into a world-readable dir and runs
    python sandbox_probe.py CANARY_PATH...
under an unprivileged uid, which prints one JSON object: each hostile program's containment in each mode,
what a bwrap-sandboxed program sees of the canaries, and which canaries the trainer itself can read.
Only the standard library: the unprivileged interpreter is the sandbox's, which may lack marljax's deps.
"""
from __future__ import annotations

import json
import os
import sys
import time

# In the command line of every sandboxed process (the sandbox's prelude): how a non-root trainer's
# leftovers are recognised (a root trainer's are its per-run uids).
MARKER = "runpy.run_path(sys.argv[0]"
# Bound on a run's wall time beyond its timeout: the kill and the namespace teardown. 5 s: on the 2-core CI,
# the other test worker compiling beside it, killing a fork bomb that escapes the group took 3.0, 7.2 and
# 18.8 s, its 64 spinning processes starving the killing thread, before that thread took nice -20 (with 8
# busy processes beside it here: 3.8-5.3 s before, 1.2-1.8 s after), and 12.2 s once more in a fresh-clone CI
# run after that: the kill as the run's uid forked the whole test worker (Popen's `user=`), now a vfork of
# `setpriv` (a 3 GB process with 2 busy ones beside it: the cleanup 0.9-1.2 s before, 0.02-0.19 s after); an
# uncontained run still fails by far
# (the orphan's child sleeps 60 s, the loops never end).
WALL_SLACK_S = 5.0
OUTPUT_CAP = 1 << 16
# name: (program, timeout_s). Each prints first, so that its output proves it ran. Fork bombs come last:
# in rlimits mode as a non-root trainer, their killed processes stay zombies, counted against the
# trainer's RLIMIT_NPROC, until the host's init reaps them (a bwrap pid namespace reaps its own).
HOSTILE = {
    "orphan_child": ("import os, time\nif os.fork() == 0:\n    print('child', flush=True)\n    time.sleep(60)\n"
                     "else:\n    time.sleep(0.3)\n    print('parent exits')", 5.0),
    "print_100MB": ("import sys\nprint('started', flush=True)\nsys.stdout.write('x' * 10**8)", 5.0),
    "while_true": ("print('started', flush=True)\nwhile True:\n    pass", 1.0),
    "fork_bomb": ("import os\nprint('started', flush=True)\nwhile True:\n    try:\n        os.fork()\n"
                  "    except OSError:\n        pass", 1.0),
    "fork_bomb_escaping_the_group": ("import os\nprint('started', flush=True)\nwhile True:\n    try:\n"
                                     "        if os.fork() == 0:\n            os.setsid()\n"
                                     "    except OSError:\n        pass", 1.0),
}
# rlimits mode as a non-root trainer cannot stop a process that leaves the group with setsid() (the
# module docstring of marljax.tasks.sandbox says so); running it would leave a fork bomb on the host.
UNCONTAINABLE = {("rlimits", False): {"fork_bomb_escaping_the_group"}}


def _live(pid: str) -> tuple[int, str] | None:
    """(owner uid, command line) of a live process, None for a zombie or a process gone meanwhile."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return uid, f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def survivors(sandbox) -> list[str]:
    """Live processes of this trainer's sandbox runs: a root trainer's per-run uids (this pid's range),
    else the trainer's own processes that run the sandbox prelude."""
    first = sandbox._UID_BASE + ((os.getpid() & 0xFFFF) << 12)
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        live = _live(pid)
        if live is None:
            continue
        uid, cmdline = live
        ours = first <= uid < first + 4096 if os.geteuid() == 0 else uid == os.getuid() and MARKER in cmdline
        if ours:
            found.append(f"{pid} uid={uid}: {cmdline[:80]}")
    return found


def contain(sandbox, name: str, mode: str) -> dict:
    """Run hostile program `name`; what came back, how long it took, and what of it is still alive."""
    program, timeout_s = HOSTILE[name]
    start = time.monotonic()
    r = sandbox.run_python(program, timeout_s=timeout_s, max_output_bytes=OUTPUT_CAP, isolation=mode)
    wall_s = time.monotonic() - start
    return {"stdout_head": r.stdout[:40], "stdout_bytes": len(r.stdout.encode()),
            "stderr_bytes": len(r.stderr.encode()), "timed_out": r.timed_out, "truncated": r.output_truncated,
            "wall_s": wall_s, "timeout_s": timeout_s, "survivors": survivors(sandbox)}


_LOOK = """\
import json, os, sys
seen = {}
for path in %r:
    what = []
    try:
        os.stat(path)
        what.append("stat")
        with open(path) as f:
            f.read()
        what.append("read")
    except OSError:
        pass
    try:
        if os.path.basename(path) in os.listdir(os.path.dirname(path)):
            what.append("listed")
    except OSError:
        pass
    seen[path] = what
print(json.dumps({"seen": seen, "root": sorted(os.listdir("/")), "etc": sorted(os.listdir("/etc")),
                  "prefix": sys.prefix}))
"""


def look(sandbox, paths: list[str], mode: str = "bwrap") -> dict:
    """What a sandboxed program can do with each of `paths` (stat, read, find it listed in its dir), and
    what it sees at / and /etc."""
    r = sandbox.run_python(_LOOK % (paths,), timeout_s=30, isolation=mode)
    if r.returncode != 0:
        raise RuntimeError(f"the probe program failed: {r.stderr}")
    return json.loads(r.stdout)


def readable(paths: list[str]) -> list[str]:
    """The paths this process itself can read (outside the sandbox)."""
    out = []
    for path in paths:
        try:
            with open(path) as f:
                f.read()
            out.append(path)
        except OSError:
            pass
    return out


def probe_all(sandbox, canaries: list[str]) -> dict:
    """Every hostile program in both modes, and the canaries' visibility, as this trainer."""
    root = os.geteuid() == 0
    containment = {f"{mode}/{name}": contain(sandbox, name, mode) for mode in sandbox.MODES for name in HOSTILE
                   if name not in UNCONTAINABLE.get((mode, root), ())}
    return {"uid": os.geteuid(), "containment": containment, "look": look(sandbox, canaries),
            "readable_outside": readable(canaries)}


if __name__ == "__main__":
    import sandbox as sandbox_module  # the copy beside this file

    print(json.dumps(probe_all(sandbox_module, sys.argv[1:])))
