"""`python -m marljax.train [--config FILE] [--print-config] [key=value ...]`: GRPO on a multi-agent workflow.

The base config: `--config FILE` if given; with no arguments at all, configs/default.yaml (the CPU
demo); with only key=value overrides, the paper's settings (the dataclass defaults of marljax.config).
The first lines printed (stderr) name the base and every key that departs from the paper's settings.

Build (`marljax.build`, shared with `marljax.evaluate` and `marljax.aot`), resume, then loop per step:
rollout (batched workflow engine over the policy sets) → rewards → group advantages → one jitted update
per mini-batch (per-role grads, diagnostics, per-set AdamW) → metrics (`TrainRecord`, flattened for the
log at the end). Evaluation (workflow pass@1 on held-out problems) before step 1 and every `eval.every`
steps; Orbax checkpoints every `checkpoint.every` steps; re-running on a run_dir with a checkpoint resumes
it exactly, on one without a checkpoint starts afresh (`clear_earlier_attempt`). The state of the best eval
so far is kept apart (RUN_DIR/peak); with `diagnostics.rollback_on_cliff` the trainer restores it when the
terminal-cliff detector fires, then stops or continues at a scaled learning rate. SIGTERM (preemption) ends
the run at the end of the current step with a checkpoint of it and exit status 0 (`Preemption`).
"""
from __future__ import annotations

if __name__ == "__main__":  # the CLI keeps freed host memory: before anything imports jax
    from marljax.core import host_memory
    host_memory.opt_in("marljax.train")

import argparse
import json
import shlex
import signal
import sys
import threading
import time

import jax
import numpy as np
import yaml
from etils import epath
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from marljax.build import EngineSampler, build_policy, build_problems, build_trainer, build_workflow, init_state
from marljax.config import Config, ConfigError, cli_config, describe, leaves, load_config, resolve, to_dict
from marljax.core import compile_cache, sharding, storage
from marljax.core.checkpoint import Checkpointer
from marljax.core.metrics import MetricsLogger
from marljax.core.peer_watch import PeerWatch
from marljax.rl.advantages import compute_advantages, permuted_within_roles
from marljax.rl.diagnostics import AccuracyTracker, DominanceTracker, LengthDrift
from marljax.rl.state import TrainState
from marljax.rl.step import Sample, train_batch
from marljax.rl.step_metrics import BatchMetrics, StepTimes, TrainRecord
from marljax.tasks.data import DataError
from marljax.workflows import Rollout, rollout
from marljax.workflows.evaluation import evaluate_workflow
from marljax.workflows.metrics import rollout_metrics


def minibatch_seed(seed: int, step: int) -> int:
    """The mini-batch shuffle's seed of training step `step`: a function of (run seed, step) only, so a
    resumed run cuts the same mini-batches (the constant keeps it apart from the rollout's seed)."""
    return int(np.random.SeedSequence([seed, step, 0x6D62]).generate_state(1)[0])


class Run:
    """A training run built from a Config (resolved: `None`s take the paper's values): the shared parts,
    the trainer, its `TrainState` and the trackers the loop feeds."""

    def __init__(self, cfg: Config):
        self.cfg = cfg = resolve(cfg)
        self.run_dir = epath.Path(cfg.run_dir)
        self.problems = build_problems(cfg)  # before the model: a sandbox that cannot grade fails fast
        self.policy = build_policy(cfg)
        self.workflow, self.policy_map = build_workflow(cfg)
        self.route = dict(self.policy_map.route)
        self.adv_cfg = cfg.rl.advantages()
        params = self.policy.init_params(cfg, self.policy_map.sets)
        self.trainer, shardings = build_trainer(cfg, self.policy, self.workflow, self.policy_map, params)
        self.state = init_state(self.trainer, params, shardings)
        d = cfg.diagnostics
        self.accuracy = AccuracyTracker(total_steps=cfg.steps, cliff=d.cliff())
        self.dominance = DominanceTracker(window=d.dominant_window)
        self.lengths = LengthDrift()
        self.nonfinite_streak = 0
        self.lr_scale = 1.0  # product of the `rollback_lr_scale`s of the rollbacks so far
        self.stopped: str | None = None  # why a rollback ended the run (a re-run then trains no further)

    def rollout_sampler(self, temperature: float) -> EngineSampler:
        """The workflows' sampler over the current parameters."""
        return self.policy.rollout_sampler(self.cfg, self.state.params, temperature)

    def evaluate(self, seed: int, problems: list | None = None):
        """pass@1 and the transcripts of the current parameters on `problems` (default: the test set)."""
        sampler = self.rollout_sampler(self.cfg.eval.temperature)
        problems = self.problems.eval if problems is None else problems
        try:
            return evaluate_workflow(self.workflow, problems, sampler, self.policy.codec, self.route,
                                     seed=seed, k=self.cfg.eval.k, progress=False,
                                     max_prompt_tokens=self.cfg.sampling.max_prompt_tokens)
        finally:
            sampler.close()

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self, step: int) -> TrainRecord:
        """Rollout, advantages and the update of training step `step`, and the trackers they feed."""
        cfg = self.cfg
        t0 = time.perf_counter()
        problems = self.problems.batch(step, cfg.rl.problems_per_step, cfg.seed)
        sampler = self.rollout_sampler(cfg.sampling.temperature)
        try:
            ro = rollout(self.workflow, problems, sampler, self.policy.codec, self.route, n_rollouts=cfg.rl.rollouts,
                         seed=int(np.random.SeedSequence([cfg.seed, step]).generate_state(1)[0]),
                         max_prompt_tokens=cfg.sampling.max_prompt_tokens)
        finally:
            sampler.close()  # the pools are freed before the update
        t_rollout = time.perf_counter() - t0
        c = ro.columns()
        adv = compute_advantages(problem_id=c.problem_id, rollout=c.rollout, role=c.role, slot=c.slot,
                                 turn=c.turn, episode_reward=c.reward, role_reward=c.correct,
                                 cfg=self.adv_cfg, split_slots=ro.slot_grouped_roles)
        samples = self.samples(step, c, adv.advantage)
        t1 = time.perf_counter()
        lr = cfg.optim.lr_at(step, cfg.steps) * self.lr_scale
        with sharding.use_mesh(self.policy.mesh, self.policy.rules):
            self.state, m = train_batch(self.trainer, self.state, samples, lr, seed=minibatch_seed(cfg.seed, step),
                                        ranks=sharding.batch_ranks(self.policy.mesh, self.policy.rules))
        times = StepTimes(t_rollout, time.perf_counter() - t1, time.perf_counter() - t0)
        shared_roles = [r for r in self.workflow.roles if len(self.policy_map.roles_of(self.route[r])) > 1]
        if shared_roles:  # dominance is defined among roles that share a set
            self.dominance.update({r: m.roles[r].grad_share if r in m.roles else 0.0 for r in shared_roles})
        dom_role, dom_share = self.dominance.index()
        return TrainRecord(
            step=step, lr=lr, rollout=rollout_metrics(ro), advantages=adv.metrics(), update=m,
            n_samples={role: int(np.sum(c.role == role)) for role in self.workflow.roles},
            response_tokens=sum(len(s.response) for s in samples), times=times, dominant_share=dom_share,
            dominant_role=dom_role, length_drift=self.lengths.update(step, mean_lengths(ro, self.workflow.roles)))

    def samples(self, step: int, c, advantage) -> list[Sample]:
        """The update's samples of step `step`'s rollout columns `c` (calls with a response) and their
        `advantage`s (shuffled within roles under `rl.null_advantages`; process 0's on many hosts)."""
        if self.cfg.rl.null_advantages:
            advantage = permuted_within_roles(advantage, c.role, seed=[self.cfg.seed, step, 0x6E75])
        if jax.process_count() > 1:  # rewards can differ across hosts (test timeouts): use process 0's
            advantage = multihost_utils.broadcast_one_to_all(np.asarray(advantage))
        return [Sample(str(c.role[i]), list(c.prompt_ids[i]), list(c.response_ids[i]), float(advantage[i]),
                       sampler_logprobs=list(c.logprobs[i]), agent=int(c.slot[i]))
                for i in range(len(c.role)) if len(c.response_ids[i])]

    # ---- checkpoint meta -----------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        return {"step": step, "accuracy": self.accuracy.state_dict(),
                "dominance": self.dominance.state_dict(), "lengths": self.lengths.state_dict(),
                "nonfinite_streak": self.nonfinite_streak, "lr_scale": self.lr_scale, "stopped": self.stopped}

    def load(self, state: TrainState, meta: dict) -> None:
        """Resume: the restored state and the trackers and counters of `meta`."""
        self.state = state
        self.accuracy = AccuracyTracker.from_state_dict(meta["accuracy"])
        self.dominance = DominanceTracker.from_state_dict(meta["dominance"])
        self.lengths = LengthDrift.from_state_dict(meta["lengths"])
        self.nonfinite_streak = meta["nonfinite_streak"]
        self.lr_scale, self.stopped = meta.get("lr_scale", 1.0), meta.get("stopped")  # absent in older checkpoints


def mean_lengths(ro: Rollout, roles: tuple[str, ...]) -> dict[str, float]:
    """Per role of `roles` that made calls in `ro`: the mean response tokens of its calls (what
    `rollout_metrics` logs as `role/<r>/length_mean`)."""
    lengths = {r: [len(c.response_ids) for c in ro.calls if c.role == r] for r in roles}
    return {r: float(np.mean(n)) for r, n in lengths.items() if n}


def track_eval(run: Run, ckpt: Checkpointer, step: int, metrics: dict) -> bool:
    """Feed one eval to the accuracy tracker and save the state as the peak when it sets a new best.
    Returns True when the cliff detector fires."""
    fired = run.accuracy.update(step, metrics["pass@1"])
    if run.accuracy.best_step == step:
        ckpt.save_peak(step, run.state, run.meta(step))
    return fired


def run_evals(run: Run, ckpt: Checkpointer, step: int, seed: int) -> tuple[dict, bool]:
    """The evals of `step`: the test set (`eval/…`, eval_step{step}.jsonl) and, with `task.val_n`, the
    validation set (`val/…`, val_step{step}.jsonl), which alone then feeds the tracker: the peak checkpoint,
    the cliff and the rollback never see the test set. Returns (their record, whether the cliff fired)."""
    record, selecting = {}, None
    for prefix, problems in (("eval", run.problems.eval), ("val", run.problems.val)):
        if not problems:
            continue
        ev = run.evaluate(seed, problems)
        if sharding.is_primary():
            write_eval_transcripts(run.run_dir, step, ev, prefix)
        record.update({f"{prefix}/{k}": v for k, v in ev.metrics.items()})
        selecting = ev.metrics
    return record, track_eval(run, ckpt, step, selecting)


def rollback(run: Run, ckpt: Checkpointer, step: int, record: dict) -> None:
    """The cliff fired at `step`: restore the peak checkpoint's parameters, optimizer states and damping EMA,
    then stop (`rollback_lr_scale` None) or go on with the learning rate × the scale (cumulative).

    The dominance and length trackers keep their windows (they describe updates that happened); the
    accuracy tracker keeps peak and history but clears the drop, so a new drop fires again. Training data
    keep following the step counter: the steps between the peak and the cliff are not replayed.
    """
    peak_step, run.state, _ = ckpt.restore(run.state, step=run.accuracy.best_step, which="peak")
    run.accuracy.rolled_back()
    scale = run.cfg.diagnostics.rollback_lr_scale
    if scale is None:
        run.stopped = f"cliff at step {step}: rolled back to the peak of step {peak_step} and stopped"
    else:
        run.lr_scale *= scale
    record.update({"diag/rollback": 1, "diag/rollback_from": step, "diag/rollback_to": peak_step,
                   "diag/lr_scale": run.lr_scale})
    then = "stopping" if scale is None else f"continuing with lr × {run.lr_scale:g}"
    on = "validation " if run.problems.val else ""
    print(f"step {step}: terminal cliff ({on}pass@1 {run.accuracy.final:.3f}, peak {run.accuracy.peak:.3f}); "
          f"rolled back to step {peak_step}'s parameters and optimizer state; {then}", file=sys.stderr)


def check_run_dir_config(run_dir: epath.Path, cfg: Config) -> None:
    """A resumed run must use the config it started with (except `steps`, which may grow, and `mesh`).

    The saved config is read back through `load_config`, so keys that marljax gained since the run began
    take their defaults rather than counting as a difference; both are compared resolved (`None` = the
    paper's value, as the run used it).
    """
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return
    try:
        old_cfg = load_config(str(saved))
    except ConfigError as e:
        raise ConfigError(f"{saved} (the config this run started with) no longer loads: {e} Resume with the "
                          "marljax version that wrote it, or pick a new run_dir.") from e
    old, new = dict(leaves(to_dict(resolve(old_cfg)))), dict(leaves(to_dict(resolve(cfg))))
    diff = [f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in sorted(set(old) | set(new))
            if k.split(".")[0] not in ("steps", "mesh") and old.get(k) != new.get(k)]
    if diff:
        raise ConfigError(f"{run_dir} holds a run with a different config (differs in: {', '.join(diff)}). "
                          "Resume with the same config, or pick a new run_dir.")


def clear_earlier_attempt(run_dir: epath.Path) -> list[str]:
    """Remove what an attempt that left no checkpoint wrote in run_dir (records, TensorBoard events, eval
    transcripts, report), so that starting afresh never logs a step twice; returns the names removed."""
    removed = []
    for path in [run_dir / "metrics.jsonl", run_dir / "tb", run_dir / "report.md",
                 *run_dir.glob("eval_step*.jsonl"), *run_dir.glob("val_step*.jsonl"),
                 *run_dir.glob(f"{run_dir.name}_*.png")]:
        if path.is_dir():
            path.rmtree()
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path.name)
    return removed


def write_eval_transcripts(run_dir: epath.Path, step: int, ev, prefix: str = "eval") -> None:
    """`{prefix}_step{step}.jsonl`: one episode per line (problem id, run, reward, calls); the report pairs
    two evals' problems by them for the noise of the lift."""
    (run_dir / f"{prefix}_step{step}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ev.transcripts))


def open_run(cfg: Config) -> tuple[Run, Checkpointer, MetricsLogger | _SilentLogger]:
    """Build the run, record its config in run_dir (a local path or a bucket: `storage.connect` checks that
    it answers, before anything is built) and open its checkpoints and metrics log (an attempt that left no
    checkpoint is cleared first)."""
    if cfg.task.sandbox == "rlimits":
        print("task.sandbox=rlimits: model-written code runs with rlimits and a process group only, NO "
              "filesystem or network isolation", file=sys.stderr)
    run_dir = epath.Path(cfg.run_dir)
    storage.connect(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_run_dir_config(run_dir, cfg)
    run = Run(cfg)
    primary = sharding.is_primary()  # on many hosts, only process 0 writes run files
    if primary:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    ckpt = Checkpointer(run_dir, cfg.checkpoint.every, cfg.checkpoint.keep)
    if primary and ckpt.latest_step() is None and (removed := clear_earlier_attempt(run_dir)):
        print(f"{run_dir} has no checkpoint: starting afresh, removed what an earlier attempt left "
              f"({', '.join(removed)})", file=sys.stderr)
    return run, ckpt, MetricsLogger(run_dir) if primary else _SilentLogger()


def resume(run: Run, ckpt: Checkpointer, log) -> int:
    """The step to continue after: the newest checkpoint's (state and trackers restored, later records
    dropped), or 0 after logging the step-0 record (the eval before training, when asked for)."""
    cfg = run.cfg
    ckpt.discard_peaks_after(ckpt.latest_step())
    if ckpt.latest_step() is not None:
        start, state, meta = ckpt.restore(run.state)
        run.load(state, meta)
        log.truncate_after(start)
        print(f"resumed {run.run_dir} from step {start}", file=sys.stderr)
        return start
    if cfg.eval.at_start:
        log.log({"step": 0, **run.problems.run_info, **run_evals(run, ckpt, 0, seed=cfg.seed)[0]})
    elif run.problems.run_info:
        log.log({"step": 0, **run.problems.run_info})
    return 0


def count_nonfinite(run: Run, step: int, m: BatchMetrics) -> None:
    """Track the streak of steps whose update was skipped for a non-finite loss or gradient."""
    run.nonfinite_streak = run.nonfinite_streak + 1 if m.nonfinite else 0
    if m.nonfinite:
        print(f"step {step}: non-finite loss/gradient; update skipped "
              f"({run.nonfinite_streak} in a row)", file=sys.stderr)


def eval_step(run: Run, ckpt: Checkpointer, step: int, record: dict) -> None:
    """The evals of `step` into `record` (`run_evals`); a new best is saved as the peak, a cliff may roll back."""
    evals, fired = run_evals(run, ckpt, step, seed=run.cfg.seed + step)
    record.update(evals)
    if fired:
        record["diag/cliff"] = 1
        if run.cfg.diagnostics.rollback_on_cliff:
            rollback(run, ckpt, step, record)


class Preemption:
    """SIGTERM (what a preempted TPU VM and Kubernetes send) as a request to stop at the end of a step.

    A context manager: while entered (in `main` only, so importing marljax installs nothing) SIGTERM sets a
    flag and nothing else; the previous handler is restored on exit. `train` reads the flag after each
    step's record is logged: a SIGTERM during a rollout, an eval or the update lets that step finish (at
    most one step late; one during start-up stops after the first step). A second SIGTERM is ignored, so it
    cannot interrupt the save; a SIGKILL during it leaves the previous checkpoint the newest (Orbax writes
    a step to a temporary directory and renames it when complete).
    """

    def __init__(self):
        self.requested = False
        self.installed = False
        self.previous = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # only there can Python take signals
            self.previous, self.installed = signal.signal(signal.SIGTERM, self._handle), True
        return self

    def __exit__(self, *exc) -> None:
        if self.installed:  # None: the handler before was not Python's and cannot be put back
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self.previous is None else self.previous)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Whether to stop now: on many hosts every process takes the same answer (stop when any of them
        was sent SIGTERM), so all save the same step and leave the loop together."""
        return bool(multihost_utils.process_allgather(np.int32(self.requested)).any())


class Preempted(Exception):
    """`train` stopped on SIGTERM after saving the checkpoint of `step` in `where`."""

    def __init__(self, step: int, where: epath.Path):
        super().__init__(step, where)
        self.step, self.where = step, where


def train(cfg: Config, preemption: Preemption | None = None) -> epath.Path:
    """Build, resume, then per step: rollout and update, eval on its cadence, log, checkpoint. On a
    `preemption` request, the step just logged is saved and `Preempted` raised, the writers closed."""
    preemption = preemption or Preemption()
    run, ckpt, log = open_run(cfg)
    start = resume(run, ckpt, log)
    if run.stopped:
        print(f"{run.run_dir}: {run.stopped}; nothing left to train", file=sys.stderr)
    last = start if run.stopped else cfg.steps
    bar = tqdm(range(start + 1, last + 1), initial=start, total=cfg.steps, desc="train", unit="step",
               disable=not sharding.is_primary())
    for step in bar:
        done = run.train_step(step)
        count_nonfinite(run, step, done.update)
        record = done.record()
        if cfg.eval.every > 0 and (step % cfg.eval.every == 0 or step == cfg.steps):
            eval_step(run, ckpt, step, record)
        record.update({f"diag/{k}": v for k, v in run.accuracy.summary().items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        log.log(record)
        bar.set_postfix({"reward": f"{done.rollout['reward/mean']:.3f}", "loss": f"{done.update.loss:.3f}",
                         **({"pass@1": f"{record['eval/pass@1']:.3f}"} if "eval/pass@1" in record else {})})
        preempted = step < last and preemption.agreed()  # a collective on many hosts: every step calls it
        ckpt.save(step, run.state, run.meta(step), force=step == cfg.steps or run.stopped is not None or preempted)
        if run.stopped:
            break
        if run.nonfinite_streak >= cfg.diagnostics.max_nonfinite:
            ckpt.close()
            log.close()
            raise FloatingPointError(
                f"{run.nonfinite_streak} non-finite losses in a row up to step {step}; stopping. The last "
                f"good state is the newest checkpoint in {ckpt.dir}. Lower optim.lr or check the data.")
        if preempted:  # the bar's line ends before the caller's message
            bar.close()
            ckpt.close()
            log.close()
            raise Preempted(step, ckpt.dir)
    ckpt.close()
    log.close()
    if not sharding.is_primary():
        return run.run_dir
    from marljax.analysis.report import write_report
    return write_report([run.run_dir])


class _SilentLogger:
    """The metrics logger of a process other than 0: writes nothing."""

    def truncate_after(self, step: int) -> None:
        pass

    def log(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m marljax.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML config (without it: no arguments at all run configs/default.yaml, "
                                         "the CPU demo; key=value overrides start from the paper's settings)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit (loads no model or data)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rl.clip_high=0.28")
    args = parser.parse_args(argv)
    try:
        cfg, base = cli_config(args.config, args.overrides)
        resolved = resolve(cfg)
    except ConfigError as e:
        parser.exit(2, f"config error: {e}\n")
    print(describe(cfg, base), file=sys.stderr, flush=True)
    if args.print_config:
        print(yaml.safe_dump(to_dict(resolved), sort_keys=False), end="")
        return
    sharding.initialize_distributed()
    compile_cache.enable()
    command = shlex.join(["python", "-m", "marljax.train", *(sys.argv[1:] if argv is None else argv)])
    try:
        with (PeerWatch(lambda reason: sharding.exit_now(reason, cfg.run_dir, command), normal=(Preempted,)),
              Preemption() as preemption):
            report = train(cfg, preemption)
    except DataError as e:  # a dataset missing or malformed: say which, without a traceback
        parser.exit(2, f"data error: {e}\n")
    except storage.StorageError as e:  # a bucket run_dir that does not answer: one line, before any work
        parser.exit(2, f"storage error: {e}\n")
    except Preempted as e:  # exit status 0: the run is not broken, and the same command resumes it
        print(f"preempted (SIGTERM): stopped after step {e.step}, its checkpoint saved in {e.where}; "
              f"resume with the same command: {command}", file=sys.stderr)
        return
    except Exception as e:  # on several processes: most often a peer that died; exit now, not after 100 s
        if jax.process_count() > 1:
            sharding.exit_on_failure(e, cfg.run_dir, command)
        raise
    if not sharding.is_primary():  # process 0 writes and reports
        return
    from marljax.analysis.report import summarize
    s = summarize(report.parent)
    if "final" in s:
        noise = f" ± {s['noise']:.3f} ({s['noise_kind']})" if "noise" in s else ""
        print(f"held-out pass@1: base {s['base']:.3f} → final {s['final']:.3f}, "
              f"Δ {s['final'] - s['base']:+.3f}{noise}")
    print(f"report: {report}")


if __name__ == "__main__":
    main()
