"""Run directories anywhere `etils.epath` reaches: a local path, or a bucket (`gs://bucket/path`, `s3://…`).

Every run file goes through `epath.Path`, whose bucket backend is fsspec (gcsfs for gs://); Orbax writes
the checkpoints' arrays with tensorstore, which has its own GCS client. Buckets cannot append to an object
or rename a folder: metrics.jsonl is rewritten whole on each record (`MetricsLogger`), TensorBoard writes
into a local temporary folder that `mirror` copies up on each flush, plots are rendered to bytes
(`save_figure`), and Orbax marks a finished gs:// checkpoint with a commit_success.txt file instead of
renaming it.

`connect` runs before a run touches its bucket: with `STORAGE_EMULATOR_HOST` set (the variable Google's
clients and gcsfs read) it points tensorstore at the same emulator, then it lists the run dir once, within
`PROBE_TIMEOUT_S`, so that unreachable storage fails at start in one line rather than after minutes of
retries.
"""
from __future__ import annotations

import io
import os
import threading

from etils import epath

PROBE_TIMEOUT_S = 10.0


class StorageError(Exception):
    """A run dir's storage cannot be reached; the message is one line naming the problem and the fix."""


def is_remote(path: epath.PathLike) -> bool:
    """Whether `path` is a URI (`gs://…`) rather than a local path."""
    return "://" in os.fspath(path)


def absolute(path: epath.PathLike) -> epath.Path:
    """`path` as an absolute `epath.Path` (a URI is one already; `Path.absolute` would prefix it with the cwd)."""
    path = epath.Path(path)
    return path if is_remote(path) else path.absolute()


def connect(run_dir: epath.Path) -> None:
    """Check that a remote run dir's storage answers (a local one needs nothing); raises StorageError."""
    if not is_remote(run_dir):
        return
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        use_emulator(emulator)
    problem = _probe(run_dir)
    if problem is None:
        return
    if os.fspath(run_dir).startswith("gs://") and emulator:
        where = f"the GCS emulator at {emulator} (STORAGE_EMULATOR_HOST)"
        fix = "check that the emulator runs there and has the bucket, or unset STORAGE_EMULATOR_HOST for real GCS"
    elif os.fspath(run_dir).startswith("gs://"):
        where = "Google Cloud Storage"
        fix = ("check that the bucket exists and the credentials (gcloud auth application-default login), or set "
               "STORAGE_EMULATOR_HOST=http://HOST:PORT for an emulator")
    else:
        where, fix = "its storage", "check that the bucket exists and the credentials of its fsspec backend"
    raise StorageError(f"run_dir {run_dir}: cannot reach {where} ({problem}); {fix}.")


def use_emulator(host: str) -> None:
    """Send tensorstore's GCS requests (Orbax's arrays) to the emulator that gcsfs and Google's clients reach
    through STORAGE_EMULATOR_HOST; settings already in the environment win."""
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host if "://" in host else f"http://{host}")
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # a bearer token emulators accept
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # its bucket-type lookup needs gRPC


def _probe(run_dir: epath.Path) -> str | None:
    """List `run_dir` once (one level) in a daemon thread: None when it answered, else what went wrong."""
    outcome: list[str | None] = []

    def list_once():
        import fsspec
        try:
            fs, path = fsspec.core.url_to_fs(os.fspath(run_dir))
            fs.find(path, maxdepth=1)
            fs.invalidate_cache(path)  # later writes (tensorstore's among them) bypass this listing
            outcome.append(None)
        except FileNotFoundError:  # a missing prefix lists as empty: only a missing bucket gets here
            outcome.append("the bucket does not exist")
        except Exception as e:  # noqa: BLE001 (credentials, network, a missing backend: all end the same way)
            outcome.append(f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}")

    worker = threading.Thread(target=list_once, name="marljax-storage-probe", daemon=True)
    worker.start()
    worker.join(PROBE_TIMEOUT_S)
    return outcome[0] if outcome else f"no answer within {PROBE_TIMEOUT_S:g} s"


def mirror(local_dir: str, remote_dir: epath.Path) -> None:
    """Copy every file of `local_dir` over its namesake in `remote_dir` (an object is rewritten whole)."""
    for name in sorted(os.listdir(local_dir)):
        with open(os.path.join(local_dir, name), "rb") as f:
            (remote_dir / name).write_bytes(f.read())


def save_figure(fig, path: epath.Path, dpi: int = 110) -> epath.Path:
    """Lay out `fig`, write it to `path` as PNG (local or remote alike: rendered to bytes first) and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    path.write_bytes(buf.getvalue())
    return path
