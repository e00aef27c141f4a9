"""`python -m marljax.train [--config FILE] [--print-config] [key=value ...]`: GRPO on a multi-agent workflow.

The base config: `--config FILE` if given; with no arguments at all, configs/default.yaml (the CPU
demo); with only key=value overrides, the paper's settings (the dataclass defaults of marljax.config).
The first lines printed (stderr) name the base and every key that departs from the paper's settings.

Loop per step: rollout (batched workflow engine over the policy sets) → rewards → group advantages →
one jitted update per mini-batch (per-role grads, diagnostics, per-set AdamW) → metrics. Evaluation
(workflow pass@1 on held-out problems) before step 1 and every `eval.every` steps; Orbax checkpoints
every `checkpoint.every` steps; re-running on a run_dir with a checkpoint resumes it exactly, on one without
a checkpoint starts afresh (`clear_earlier_attempt`). The state of the best eval so far is kept apart
(RUN_DIR/peak); with `diagnostics.rollback_on_cliff` the trainer restores it when the terminal-cliff
detector fires, then stops or continues at a scaled learning rate.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from marljax import compile_cache, sharding
from marljax.checkpoint import Checkpointer
from marljax.config import Config, ConfigError, cli_config, describe, leaves, load_config, resolve, to_dict
from marljax.metrics import MetricsLogger
from marljax.models import load_model, load_tokenizer
from marljax.models.decoder import trainable_params
from marljax.models.tokenizer import ChatCodec
from marljax.rl import policy_map as pm
from marljax.rl.advantages import AdvantageConfig, compute_advantages
from marljax.rl.diagnostics import AccuracyTracker, CliffConfig, DominanceTracker, LengthDrift
from marljax.rl.lora import ALL_LINEAR, LoRAConfig, init_lora
from marljax.rl.losses import LossConfig
from marljax.rl.step import Sample, StepConfig, Trainer, make_optimizer, train_batch
from marljax.sampling import SamplingParams, bucket, generate, layer_weights
from marljax.tasks.data import load_task
from marljax.tasks.sandbox import MODES as SANDBOX_MODES
from marljax.tasks.sandbox import require as require_sandbox
from marljax.workflows import Sample as WorkflowSample
from marljax.workflows import get_workflow, rollout
from marljax.workflows.evaluation import evaluate_workflow
from marljax.workflows.metrics import rollout_metrics


def lr_at(cfg: Config, step: int) -> float:
    """Linear warm-up then cosine to 0 (or constant), indexed by training step (1-based)."""
    o = cfg.optim
    if o.warmup_steps > 0 and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule != "cosine":
        raise ConfigError(f"optim.schedule={o.schedule!r}; choose 'cosine' or 'constant'.")
    span = max(cfg.steps - o.warmup_steps, 1)
    return o.lr * 0.5 * (1 + math.cos(math.pi * min(step - o.warmup_steps, span) / span))


def minibatch_seed(seed: int, step: int) -> int:
    """The mini-batch shuffle's seed of training step `step`: a function of (run seed, step) only, so a
    resumed run cuts the same mini-batches (the constant keeps it apart from the rollout's seed)."""
    return int(np.random.SeedSequence([seed, step, 0x6D62]).generate_state(1)[0])


def workflow_options(cfg: Config) -> dict:
    w = cfg.workflow
    own = {"voting": {"n_votes": w.n_votes}, "eval_opt": {"max_iterations": w.max_iterations},
           "orch_workers": {"max_subtasks": w.max_subtasks}}.get(w.name, {})
    return {"worked_example": w.worked_example, **own}


def same_role_counts(workflow) -> dict[str, int]:
    """N parallel same-role agents per role (voters, workers), for `rl.same_role_scale`."""
    return {"voting": {"generator": getattr(workflow, "n_votes", 1)},
            "orch_workers": {"worker": getattr(workflow, "max_subtasks", 1)}}.get(workflow.name, {})


class Run:
    """Everything a training run holds; built from a Config (resolved: `None`s take the paper's values)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg = resolve(cfg)
        self.run_dir = pathlib.Path(cfg.run_dir)
        if cfg.mesh.lora not in ("sharded", "replicated"):
            raise ConfigError(f"mesh.lora={cfg.mesh.lora!r}; choose 'sharded' or 'replicated'.")
        check_rollback(cfg.diagnostics)
        if cfg.task.sandbox not in SANDBOX_MODES:
            raise ConfigError(f"task.sandbox={cfg.task.sandbox!r}; choose 'bwrap' (isolated, needs bubblewrap) "
                              "or 'rlimits' (no filesystem or network isolation).")
        self.mesh = sharding.make_mesh(cfg.mesh)
        self.rules = sharding.get_rules(cfg.mesh, self.mesh)
        self.model = load_model(cfg.model, dtype=cfg.dtype, seed=cfg.seed, param_dtype=cfg.param_dtype,
                                shardings=sharding.variable_sharding(self.mesh, self.rules))
        self.codec = ChatCodec(load_tokenizer(cfg.model))
        opts = dict(cfg.task.options)
        self.train_problems = load_task(cfg.task.name, path=cfg.task.path, split="train", seed=cfg.task.split_seed,
                                        limit=cfg.task.train_size, sandbox=cfg.task.sandbox, **opts)
        self.eval_problems = load_task(cfg.task.name, path=cfg.task.path, split="test", seed=cfg.task.split_seed,
                                       limit=cfg.task.eval_n, sandbox=cfg.task.sandbox, **opts)
        # Code grading fails closed here, before any rollout: bwrap must work unless rlimits is asked for.
        code = any(p.kind == "code" for p in self.train_problems + self.eval_problems)
        self.run_info = {"sandbox/mode": require_sandbox(cfg.task.sandbox)} if code else {}  # step-0 record
        if not self.train_problems:
            raise ConfigError(f"task {cfg.task.name!r} gave no training problems.")
        self.workflow = get_workflow(cfg.workflow.name, **workflow_options(cfg))
        self.policy = pm.from_config(cfg.policy, self.workflow.roles)
        self.route = dict(self.policy.route)
        rl = cfg.rl
        counts = same_role_counts(self.workflow)
        temp = rl.logprob_temperature or cfg.sampling.temperature or 1.0
        self.lora_cfg = None
        if cfg.lora.enabled:
            targets = ALL_LINEAR if cfg.lora.targets in (["all-linear"], "all-linear") else tuple(cfg.lora.targets)
            self.lora_cfg = LoRAConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=targets,
                                       layers=cfg.lora.layers)
        unknown_kl = sorted(set(rl.kl_beta) - set(self.workflow.roles))
        if unknown_kl:
            raise ConfigError(f"rl.kl_beta names roles {unknown_kl} not in workflow "
                              f"{self.workflow.name!r} (roles: {list(self.workflow.roles)}).")
        self.step_cfg = StepConfig(
            route=tuple(self.route.items()),
            loss=LossConfig(clip_low=rl.clip_low, clip_high=rl.clip_high, dual_clip=rl.dual_clip, agg=rl.agg),
            role_weighting=rl.role_weighting,
            role_scale=tuple((r, 1.0 / n) for r, n in counts.items()) if rl.same_role_scale else (),
            kl_beta=tuple((r, float(b)) for r, b in rl.kl_beta.items()),
            damping_lambda=rl.damping_lambda, damping_ema=rl.damping_ema, logprob_temperature=temp,
            lora_scale=self.lora_cfg.scale if self.lora_cfg else None,
            minibatch=rl.minibatch, minibatch_size=rl.minibatch_size, remat=rl.remat,
            attention=rl.attention)
        self.adv_cfg = AdvantageConfig(group_key=rl.group_preset, reward_routing=rl.reward_routing,
                                       estimator=rl.estimator)
        o = cfg.optim
        self.optimizer = make_optimizer(weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, grad_clip=o.grad_clip)
        params = self.init_params()
        p_sh = {s: sharding.trainable_shardings(p, self.model, self.mesh, self.rules,
                                                replicate_lora=cfg.mesh.lora == "replicated")
                for s, p in params.items()}
        o_sh = {s: sharding.optimizer_shardings(self.optimizer, p, p_sh[s], self.mesh)
                for s, p in params.items()}
        e_sh = {r: p_sh[s] for r, s in self.route.items()} if rl.damping_lambda > 0 else {}
        self.params = jax.device_put(params, p_sh)
        self.opt_states = jax.device_put({s: self.optimizer.init(p) for s, p in self.params.items()}, o_sh)
        self.ema = jax.device_put({r: jax.tree.map(jnp.zeros_like, self.params[self.route[r]])
                                   for r in e_sh}, e_sh)
        self.trainer = Trainer(self.model, self.step_cfg, self.optimizer,
                               out_shardings=(p_sh, o_sh, e_sh, sharding.replicated(self.mesh)))
        d = cfg.diagnostics
        self.accuracy = AccuracyTracker(total_steps=cfg.steps,
                                        cliff=CliffConfig(min_drop=d.cliff_drop, window_frac=d.cliff_window))
        self.dominance = DominanceTracker(window=d.dominant_window)
        self.lengths = LengthDrift()
        self.nonfinite_streak = 0
        self.lr_scale = 1.0  # product of the `rollback_lr_scale`s of the rollbacks so far
        self.stopped: str | None = None  # why a rollback ended the run (a re-run then trains no further)

    def init_params(self) -> dict:
        key = jax.random.key(self.cfg.seed)
        if self.lora_cfg is not None:
            return {s: init_lora(self.model.config, self.lora_cfg, jax.random.fold_in(key, i))
                    for i, s in enumerate(self.policy.sets)}
        return {s: trainable_params(self.model) for s in self.policy.sets}  # float32 master weights

    # ---- sampling ------------------------------------------------------------------------------
    def sample_fn(self, temperature: float):
        cfg = self.cfg

        def fn(set_name: str, prompts: list[list[int]], seed: int) -> list[WorkflowSample]:
            samples = []
            # One per-layer copy of the weights per call, LoRA folded in, serves every chunk: decoding
            # then costs the base's matmuls only, and the sampler's jit does not recompile per set.
            with sharding.use_mesh(self.mesh, self.rules):
                if self.lora_cfg is not None:
                    model = self.model
                    layers = layer_weights(model, self.params[set_name], self.lora_cfg.scale)
                else:
                    model = nnx.merge(self.trainer.graphdef, self.params[set_name])
                    layers = layer_weights(model)
            for k, chunk in enumerate(self.chunks(prompts)):
                chunk_seed = seed if k == 0 else int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
                sp = SamplingParams(max_new_tokens=cfg.sampling.max_new_tokens, temperature=temperature,
                                    top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                                    stop_token_ids=tuple(self.codec.stop_token_ids), seed=chunk_seed)
                with sharding.use_mesh(self.mesh, self.rules):
                    out = generate(model, chunk, sp, layers=layers)
                samples += [WorkflowSample(t, lp, not fin)
                            for t, lp, fin in zip(out.tokens, out.logprobs, out.finished)]
            return samples
        return fn

    def chunks(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Prompts cut into sampler calls of at most `sampling.max_cache_tokens` batch × KV length
        (a power-of-two number of rows, a fixed point of the sampler's `bucket_rows`); one call when it is 0."""
        cap = self.cfg.sampling.max_cache_tokens
        if cap <= 0 or not prompts:
            return [prompts]
        length = bucket(max(len(p) for p in prompts), 16) + self.cfg.sampling.max_new_tokens
        rows = max(1, cap // length)
        rows = 1 << (rows.bit_length() - 1)
        return [prompts[i: i + rows] for i in range(0, len(prompts), rows)]

    def evaluate(self, seed: int) -> dict:
        ev = evaluate_workflow(self.workflow, self.eval_problems, self.sample_fn(self.cfg.eval.temperature),
                               self.codec, self.route, seed=seed, k=self.cfg.eval.k, progress=False,
                               max_prompt_tokens=self.cfg.sampling.max_prompt_tokens)
        return ev

    # ---- data ----------------------------------------------------------------------------------
    def batch_problems(self, step: int):
        """Problems of training step `step` (1-based): a seeded permutation per epoch, deterministic."""
        n, per = len(self.train_problems), self.cfg.rl.problems_per_step
        start = (step - 1) * per
        out = []
        for i in range(start, start + per):
            epoch, pos = divmod(i, n)
            perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
            out.append(self.train_problems[perm[pos]])
        return out

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self, step: int) -> dict:
        cfg = self.cfg
        t0 = time.perf_counter()
        problems = self.batch_problems(step)
        ro = rollout(self.workflow, problems, self.sample_fn(cfg.sampling.temperature), self.codec,
                     self.route, n_rollouts=cfg.rl.rollouts, seed=int(np.random.SeedSequence(
                         [cfg.seed, step]).generate_state(1)[0]),
                     max_prompt_tokens=cfg.sampling.max_prompt_tokens)
        t_rollout = time.perf_counter() - t0
        c = ro.columns()
        adv = compute_advantages(problem_id=c.problem_id, rollout=c.rollout, role=c.role, slot=c.slot,
                                 turn=c.turn, episode_reward=c.reward, role_reward=c.correct,
                                 cfg=self.adv_cfg, split_slots=ro.slot_grouped_roles)
        advantage = adv.advantage
        if jax.process_count() > 1:  # rewards can differ across hosts (test timeouts): use process 0's
            advantage = multihost_utils.broadcast_one_to_all(np.asarray(advantage))
        samples = [Sample(str(c.role[i]), list(c.prompt_ids[i]), list(c.response_ids[i]), float(advantage[i]),
                          sampler_logprobs=list(c.logprobs[i]))
                   for i in range(len(c.role)) if len(c.response_ids[i])]
        t1 = time.perf_counter()
        lr = lr_at(cfg, step) * self.lr_scale
        with sharding.use_mesh(self.mesh, self.rules):
            self.params, self.opt_states, self.ema, m = train_batch(
                self.trainer, self.params, self.opt_states, self.ema, samples, lr,
                seed=minibatch_seed(cfg.seed, step))
        t_update = time.perf_counter() - t1
        record = {"step": step, "lr": lr, **rollout_metrics(ro), **adv.metrics(), **m}
        for role in self.workflow.roles:
            record[f"role/{role}/n_samples"] = int(np.sum(c.role == role))
        set_losses = [m[f"set/{s}/loss"] for s in self.policy.sets if f"set/{s}/loss" in m]
        record["loss"] = float(np.mean(set_losses)) if set_losses else float("nan")
        record["grad_norm"] = float(np.sqrt(sum(m.get(f"set/{s}/grad_norm", 0.0) ** 2
                                                for s in self.policy.sets)))
        n_tokens = sum(len(s.response) for s in samples)
        record.update({"time/rollout_s": t_rollout, "time/update_s": t_update,
                       "time/step_s": time.perf_counter() - t0, "throughput/response_tok_s":
                       n_tokens / max(time.perf_counter() - t0, 1e-9)})
        shared_roles = [r for r in self.workflow.roles if len(self.policy.roles_of(self.route[r])) > 1]
        if shared_roles:  # dominance is defined among roles that share a set
            self.dominance.update({r: m.get(f"role/{r}/grad_share", 0.0) for r in shared_roles})
        dom_role, dom_share = self.dominance.index()
        record["diag/dominant_share"] = dom_share
        if dom_role is not None:
            record["diag/dominant_role"] = dom_role
        drift = self.lengths.update(step, {r: record[f"role/{r}/length_mean"] for r in self.workflow.roles
                                           if f"role/{r}/length_mean" in record})
        record.update({f"role/{r}/length_drift": v for r, v in drift.items()})
        return record

    # ---- checkpoint state ----------------------------------------------------------------------
    def state(self):
        return {"params": self.params, "opt": self.opt_states, "ema": self.ema}

    def meta(self, step: int) -> dict:
        return {"step": step, "accuracy": self.accuracy.state_dict(),
                "dominance": self.dominance.state_dict(), "lengths": self.lengths.state_dict(),
                "nonfinite_streak": self.nonfinite_streak, "lr_scale": self.lr_scale, "stopped": self.stopped}

    def load_state(self, state):
        """Parameters, optimizer states and damping EMA from a restored `state()`."""
        self.params, self.opt_states, self.ema = state["params"], state["opt"], state["ema"]

    def load(self, state, meta):
        self.load_state(state)
        self.accuracy = AccuracyTracker.from_state_dict(meta["accuracy"])
        self.dominance = DominanceTracker.from_state_dict(meta["dominance"])
        self.lengths = LengthDrift.from_state_dict(meta["lengths"])
        self.nonfinite_streak = meta["nonfinite_streak"]
        self.lr_scale, self.stopped = meta.get("lr_scale", 1.0), meta.get("stopped")  # absent in older checkpoints


def check_rollback(d) -> None:
    """`diagnostics.rollback_lr_scale` needs `rollback_on_cliff` and must be > 0 (None: stop after rolling back)."""
    scale = d.rollback_lr_scale
    if scale is not None and not d.rollback_on_cliff:
        raise ConfigError(f"diagnostics.rollback_lr_scale={scale} has no effect without "
                          "diagnostics.rollback_on_cliff=true; set both, or drop the scale.")
    if scale is not None and not scale > 0:
        raise ConfigError(f"diagnostics.rollback_lr_scale={scale} must be > 0 (e.g. 0.5), or null to stop the run "
                          "after rolling back.")


def track_eval(run: Run, ckpt: Checkpointer, step: int, metrics: dict) -> bool:
    """Feed one eval to the accuracy tracker and save the state as the peak when it sets a new best.
    Returns True when the cliff detector fires."""
    fired = run.accuracy.update(step, metrics["pass@1"])
    if run.accuracy.best_step == step:
        ckpt.save_peak(step, run.state(), run.meta(step))
    return fired


def rollback(run: Run, ckpt: Checkpointer, step: int, record: dict) -> None:
    """The cliff fired at `step`: restore the peak checkpoint's parameters, optimizer states and damping EMA,
    then stop (`rollback_lr_scale` None) or go on with the learning rate × the scale (cumulative).

    The dominance and length trackers keep their windows (they describe updates that happened); the
    accuracy tracker keeps peak and history but clears the drop, so a new drop fires again. Training data
    keep following the step counter: the steps between the peak and the cliff are not replayed.
    """
    peak_step, state, _ = ckpt.restore(run.state(), step=run.accuracy.best_step, which="peak")
    run.load_state(state)
    run.accuracy.rolled_back()
    scale = run.cfg.diagnostics.rollback_lr_scale
    if scale is None:
        run.stopped = f"cliff at step {step}: rolled back to the peak of step {peak_step} and stopped"
    else:
        run.lr_scale *= scale
    record.update({"diag/rollback": 1, "diag/rollback_from": step, "diag/rollback_to": peak_step,
                   "diag/lr_scale": run.lr_scale})
    then = "stopping" if scale is None else f"continuing with lr × {run.lr_scale:g}"
    print(f"step {step}: terminal cliff (pass@1 {run.accuracy.final:.3f}, peak {run.accuracy.peak:.3f}); "
          f"rolled back to step {peak_step}'s parameters and optimizer state; {then}", file=sys.stderr)


def check_run_dir_config(run_dir: pathlib.Path, cfg: Config) -> None:
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


def clear_earlier_attempt(run_dir: pathlib.Path) -> list[str]:
    """Remove what an attempt that left no checkpoint wrote in run_dir (records, TensorBoard events, eval
    transcripts, report), so that starting afresh never logs a step twice; returns the names removed."""
    removed = []
    for path in [run_dir / "metrics.jsonl", run_dir / "tb", run_dir / "report.md",
                 *run_dir.glob("eval_step*.jsonl"), *run_dir.glob(f"{run_dir.name}_*.png")]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path.name)
    return removed


def write_eval_transcripts(run_dir: pathlib.Path, step: int, ev) -> None:
    """`eval_step{step}.jsonl`: one episode per line (problem id, run, reward, calls); the report pairs
    two evals' problems by them for the noise of the lift."""
    (run_dir / f"eval_step{step}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in ev.transcripts))


def train(cfg: Config) -> pathlib.Path:
    if cfg.task.sandbox == "rlimits":
        print("task.sandbox=rlimits: model-written code runs with rlimits and a process group only, NO "
              "filesystem or network isolation", file=sys.stderr)
    run_dir = pathlib.Path(cfg.run_dir)
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
    log = MetricsLogger(run_dir) if primary else _SilentLogger()
    ckpt.discard_peaks_after(ckpt.latest_step())
    start = 0
    if ckpt.latest_step() is not None:
        start, state, meta = ckpt.restore(run.state())
        run.load(state, meta)
        log.truncate_after(start)
        print(f"resumed {run_dir} from step {start}", file=sys.stderr)
    elif cfg.eval.at_start:
        ev = run.evaluate(seed=cfg.seed)
        track_eval(run, ckpt, 0, ev.metrics)
        log.log({"step": 0, **run.run_info, **{f"eval/{k}": v for k, v in ev.metrics.items()}})
        if primary:
            write_eval_transcripts(run_dir, 0, ev)
    elif run.run_info:
        log.log({"step": 0, **run.run_info})
    if run.stopped:
        print(f"{run_dir}: {run.stopped}; nothing left to train", file=sys.stderr)
    last = start if run.stopped else cfg.steps
    bar = tqdm(range(start + 1, last + 1), initial=start, total=cfg.steps, desc="train", unit="step",
               disable=not primary)
    for step in bar:
        record = run.train_step(step)
        nonfinite = not math.isfinite(record["loss"]) or any(
            record.get(f"set/{s}/nonfinite", 0) for s in run.policy.sets)
        run.nonfinite_streak = run.nonfinite_streak + 1 if nonfinite else 0
        if nonfinite:
            print(f"step {step}: non-finite loss/gradient; update skipped "
                  f"({run.nonfinite_streak} in a row)", file=sys.stderr)
        if cfg.eval.every > 0 and (step % cfg.eval.every == 0 or step == cfg.steps):
            ev = run.evaluate(seed=cfg.seed + step)
            if primary:
                write_eval_transcripts(run_dir, step, ev)
            record.update({f"eval/{k}": v for k, v in ev.metrics.items()})
            if track_eval(run, ckpt, step, ev.metrics):
                record["diag/cliff"] = 1
                if cfg.diagnostics.rollback_on_cliff:
                    rollback(run, ckpt, step, record)
        record.update({f"diag/{k}": v for k, v in run.accuracy.summary().items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)})
        log.log(record)
        bar.set_postfix({"reward": f"{record['reward/mean']:.3f}", "loss": f"{record['loss']:.3f}",
                         **({"pass@1": f"{record['eval/pass@1']:.3f}"} if "eval/pass@1" in record else {})})
        ckpt.save(step, run.state(), run.meta(step), force=step == cfg.steps or run.stopped is not None)
        if run.stopped:
            break
        if run.nonfinite_streak >= cfg.diagnostics.max_nonfinite:
            ckpt.close()
            log.close()
            raise FloatingPointError(
                f"{run.nonfinite_streak} non-finite losses in a row up to step {step}; stopping. The last "
                f"good state is the newest checkpoint in {ckpt.dir}. Lower optim.lr or check the data.")
    ckpt.close()
    log.close()
    if not primary:
        return run_dir
    from marljax.report import write_report
    return write_report([run_dir])


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
    report = train(cfg)
    from marljax.report import summarize
    s = summarize(report.parent) if sharding.is_primary() else {}
    if "final" in s:
        noise = f" ± {s['noise']:.3f} ({s['noise_kind']})" if "noise" in s else ""
        print(f"held-out pass@1: base {s['base']:.3f} → final {s['final']:.3f}, "
              f"Δ {s['final'] - s['base']:+.3f}{noise}")
    print(f"report: {report}")


if __name__ == "__main__":
    main()
