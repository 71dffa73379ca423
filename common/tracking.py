"""Metrics: metrics.jsonl always, a console progress bar, wandb / tensorboard on request, PNG curves."""

import fnmatch
import json
import logging
import math
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from common import watchdog
from common.errors import RunStopped
from common.model import HEADS, LAYOUTS
from common.parallel import all_reduce_sum, barrier, gather_objects
from common.parallel import setup_logging as setup_logging  # re-exported for older forks
from common.perf import PHASES, device_peak, needed_tokens, phase_seconds, update_flops, verdict
from common.scoring import hit

log = logging.getLogger(__name__)


# Quantities that must stay finite: a step where one is not stops the run there, naming it.
MUST_BE_FINITE = (
    "reward/mean", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "train/loss", "train/grad_norm", "critic/vf_loss", "critic/grad_norm",
)  # fmt: skip
ZERO_GRAD_STEPS = 3  # steps in a row without a gradient before the run says it cannot learn
# The flags common.perf.verdict's advice depends on.
VERDICT_FLAGS = (
    "rollout_name", "rollout_placement", "max_staleness", "reward_workers", "use_remove_padding",
    "micro_batch_size_per_gpu", "gradient_checkpointing", "mixed_precision", "dtype", "lora_rank", "use_torch_compile",
)  # fmt: skip


class NonFiniteError(RunStopped):
    """A loss, gradient norm or reward that is NaN or infinite: training cannot go on from it."""


class Tracker:
    """Writes every metric record to <run_dir>/metrics.jsonl (rank 0 only). On resume from step k, the records
    the interrupted run logged after step k are dropped, so the file reads like one uninterrupted run."""

    def __init__(
        self,
        run_dir,
        start_step: int,
        total_steps: int,
        is_main: bool,
        trainer,
        recipe: str,
        flags: dict,
        run_info: dict,
        plan=None,
        bar_keys=("train/loss", "reward/mean", "val/accuracy"),
    ):
        """trainer: the trainer group (--logger, --project-name, --experiment-name, --log-interval,
        --stop-on-nonfinite-reward); flags: every flag by name, which config.json (and wandb) record with the recipe
        and run_info (common.model.load_trained_model's); plan (an RL run's common.data.BatchPlan): its update is
        measured (perf/mfu), and the closing verdict advises on the flags it names (VERDICT_FLAGS)."""
        loggers, experiment = trainer.logger, trainer.experiment_name or recipe
        self.is_main, self.stop_on_nonfinite_reward = is_main, trainer.stop_on_nonfinite_reward
        self.total_steps, self.start_step, self.log_interval = total_steps, start_step, trainer.log_interval
        self.t_start, self.last_step = time.time(), start_step
        self.run_dir, self.bar_keys = Path(run_dir), bar_keys
        self.path = self.run_dir / "metrics.jsonl"
        self.loggers = self.bar = None
        self.val_first, self.val_last = {}, {}  # before training (step 0), and the latest
        self.zero_grad_steps, self.warned_zero_grad, self.no_signal_steps = 0, False, 0
        measured = plan is not None and run_info.get("flops")
        self.perf = _perf_context({**run_info, "epochs": flags.get("ppo_epochs", 1)}) if measured else None
        self.run_facts = None  # the flags the closing block's advice depends on
        if plan is not None:
            facts = {k: flags.get(k) for k in VERDICT_FLAGS}
            self.run_facts = {**facts, "device": run_info["device"], "micro_batches": plan.grad_accum}
        self.totals: Counter = Counter()  # every perf/*_s summed over the run, and the work behind the rates
        config = {**flags, "recipe": recipe, "run": run_info}
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.generations_path = self.run_dir / "val_generations.jsonl"
        _keep_until(self.path, start_step)
        if self.generations_path.exists():
            _keep_until(self.generations_path, start_step)
        (self.run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
        if {"wandb", "tensorboard"} & set(loggers):  # a feature: loaded where --logger asks for it
            from common.formats.loggers import Loggers

            extra = getattr(trainer, "tracker_kwargs", None)
            self.loggers = Loggers(loggers, self.run_dir, trainer.project_name, experiment, config, extra)
        if "console" in loggers:
            self.bar = tqdm(total=total_steps, initial=start_step, desc=experiment, dynamic_ncols=True, file=sys.stderr)

    def log(self, metrics: dict, step: int) -> None:
        """Append a record for `step` (none when metrics is empty), move the bar to it, and keep (every rank) the
        val/ metrics for the closing summary. Generations (val/generations: common.rollout.evaluate) go to
        val_generations.jsonl and to wandb as a table. step_metrics' _sequence_tokens and perf/update_s give
        perf/train_tokens_per_s, perf/update_tflop and perf/mfu."""
        watchdog.progress()
        metrics = dict(metrics)
        sums = metrics.pop("_sequence_tokens", None)
        if sums and self.perf and metrics.get("perf/update_s"):
            metrics.update(update_metrics(self.perf, *sums, metrics["perf/update_s"]))
        self._add_up(metrics)
        self.last_step = max(self.last_step, step)
        generations = metrics.pop("val/generations", None)
        if generations and self.is_main:
            with self.generations_path.open("a") as f:
                f.writelines(json.dumps({"step": step, **g}) + "\n" for g in generations)
        self._check(metrics, step)
        val = {k: v for k, v in metrics.items() if k.startswith("val/")}
        if val:
            self.val_last = val
            self.val_first = val if step == 0 else self.val_first
        if not self.is_main or not metrics:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.loggers is not None:
            self.loggers.log(metrics, step, generations if self.is_main else None)
        if self.log_interval > 0 and step > 0 and (step % self.log_interval == 0 or step == self.total_steps):
            self.write(console_line(record, self.total_steps))
        if self.bar is not None:
            # "reward/mean" shows as reward, "train/loss" as loss, "val/accuracy" as val_accuracy
            label = lambda k: k.removeprefix("train/").removesuffix("/mean").replace("/", "_")  # noqa: E731
            shown = {label(k): f"{record[k]:.4g}" for k in self.bar_keys if isinstance(record.get(k), float | int)}
            if shown:
                self.bar.set_postfix(shown, refresh=False)
            self.bar.update(max(0, step - self.bar.n))

    def _add_up(self, metrics: dict) -> None:
        """Sum what the closing block reports: phase seconds, tokens generated and trained, update FLOPs and seconds."""
        t = self.totals
        for key, value in metrics.items():
            if key.startswith("perf/") and key.endswith("_s") and key not in ("perf/step_s", "perf/engine_generate_s"):
                t[key] += float(_plain(value))
        if "perf/generate_tokens_per_s" in metrics:
            t["generated"] += metrics["perf/generate_tokens_per_s"] * metrics["perf/generate_s"]
        if "perf/train_tokens_per_s" in metrics:
            t["trained"] += metrics["perf/train_tokens_per_s"] * metrics["perf/update_s"]
            t["update_tflop"] += metrics["perf/update_tflop"]
            t["update_seconds"] += metrics["perf/update_s"]
        if "perf/padding_share" in metrics:
            t["steps"] += 1
            t["padding"] += metrics["perf/padding_share"]

    def time_report(self, wall: float) -> str:
        """The closing "where the time went" block: each phase's share of the wall time, tokens generated and
        trained a second, the update's MFU, and common.perf.verdict's bound and advice."""
        seconds = phase_seconds({**self.totals, "perf/save_s": self.totals["perf/save_s"] + PHASES.pop("save", 0.0)})
        seconds["other"] = max(0.0, wall - sum(seconds.values()))
        shares = "  ".join(f"{name} {s / wall:.0%}" for name, s in seconds.items() if s > 0 and wall > 0)
        lines = [f"where the time went ({wall:.0f} s): {shares}"]
        t = self.totals
        rates = []
        if t.get("perf/generate_s") and "generated" in t:
            rates.append(f"generated {t['generated'] / t['perf/generate_s']:,.0f} tokens/s")
        if t.get("update_seconds"):
            rates.append(f"trained {t['trained'] / t['update_seconds']:,.0f} tokens/s")
            if self.perf:
                mfu = t["update_tflop"] * 1e12 / t["update_seconds"] / self.perf["peak"]
                rates.append(f"update MFU {mfu:.1%} (of {self.perf['peak_source']})")
        if rates:
            lines.append("  " + ", ".join(rates))
        if self.run_facts is not None and t.get("steps"):
            bound, advice = verdict(seconds, wall, {**self.run_facts, "padding": t["padding"] / t["steps"]})
            lines.append(f"  {bound}: would help: {advice}")
        return "\n".join(lines)

    def _check(self, metrics: dict, step: int) -> None:
        """On every rank (the values are global, so ranks agree): stop at a non-finite quantity (or, when asked
        to, a NaN reward the reward pool zeroed), and say once when ZERO_GRAD_STEPS steps in a row had no gradient."""
        bad = {k: _plain(metrics[k]) for k in MUST_BE_FINITE if k in metrics and not math.isfinite(_plain(metrics[k]))}
        counts = ("reward/nonfinite", "val/reward/nonfinite") if self.stop_on_nonfinite_reward else ()
        nonfinite = {k: _plain(metrics[k]) for k in counts if metrics.get(k)}
        if nonfinite:
            raise NonFiniteError(
                f"step {step}: {', '.join(f'{k} = {v:g}' for k, v in nonfinite.items())} (rewards that were NaN or "
                f"infinite; --stop-on-nonfinite-reward stops on them). The reward function's first such result is "
                f"in the warning above"
            )
        if bad:
            raise NonFiniteError(
                f"step {step}: {', '.join(f'{k} = {v}' for k, v in bad.items())}, so training cannot go on. Likely "
                f"causes: rewards far larger than the others (a reward function's scale), a learning rate too high, "
                f"float16 overflow. Resume from the last checkpoint with a lower --lr, or check the reward function"
            )
        self.no_signal_steps += metrics.get("reward/equal_groups") == 1
        if "train/grad_norm" not in metrics:
            return
        self.zero_grad_steps = self.zero_grad_steps + 1 if _plain(metrics["train/grad_norm"]) == 0 else 0
        if self.zero_grad_steps >= ZERO_GRAD_STEPS and not self.warned_zero_grad and self.is_main:
            self.warned_zero_grad = True
            log.warning(
                "steps %d-%d had no gradient at all (train/grad_norm 0; reward/mean %s): every group's responses "
                "got the same reward, so every advantage is 0 and the policy cannot learn. Likely causes: the "
                "model never produces the answer format the reward function expects, or the reward function "
                "returns the same value for everything. Read a few responses and their rewards (--reward-fn), or "
                "start from a model that gets some answers right",
                step - ZERO_GRAD_STEPS + 1,
                step,
                metrics.get("reward/mean"),
            )

    def write(self, message: str) -> None:
        """Print above the progress bar (rank 0)."""
        if self.is_main:
            (self.bar.write if self.bar is not None else print)(message)

    def finish(self, plot_keys: tuple[str, ...] = (), stopped: bool = False, failure: str | None = None) -> dict:
        """Collective. Close the loggers, draw the curves and print the closing summary: val accuracy before
        (step 0) -> after (the latest val/ metrics), steps, time, run folder and the exported model if saved.
        A run a signal stopped (common.parallel.StopSignal) says where its checkpoint is and how to go on; one
        a failure stopped (StopSignal.fail) raises it as RunStopped (exit status 1). Returns the summary."""
        barrier()
        summary = {"steps": self.last_step - self.start_step, "seconds": time.time() - self.t_start, **self.val_last}
        summary["no_signal_steps"] = self.no_signal_steps
        png = self.close(plot_keys)
        if "val/accuracy" in summary:
            before = f"{self.val_first['val/accuracy']:.1%} -> " if "val/accuracy" in self.val_first else ""
            loss = f", val loss {summary['val/loss']:.4f}" if "val/loss" in summary else ""
            self.write(f"val accuracy {before}{summary['val/accuracy']:.1%}{loss}")
        curves = f"; curves {png}" if png else ""
        self.write(f"{summary['steps']} steps in {summary['seconds']:.0f}s; run folder {self.run_dir}{curves}")
        if self.no_signal_steps:
            self.write(
                f"{self.no_signal_steps} of {summary['steps']} steps had no reward signal: every group's rewards were "
                f"equal (reward/equal_groups 1), so every advantage was 0"
            )
        if self.totals:
            self.write(self.time_report(summary["seconds"]))
        checkpoint = self.run_dir / "checkpoints" / f"step_{self.last_step}"
        where = f"after step {self.last_step} of {self.total_steps}; checkpoint {checkpoint}"
        if failure:
            raise RunStopped(f"{failure}\nstopped {where}")
        if stopped:
            self.write(f"stopped by a signal {where}; the same command (--resume auto) continues")
        elif (final := self.run_dir / "checkpoints" / f"step_{self.total_steps}" / "hf").is_dir():
            self.write(f"final model: {final} (a Hugging Face folder: from_pretrained loads it)")
        return {**summary, "stopped": stopped}

    def close(self, plot_keys: tuple[str, ...] = ()) -> Path | None:
        if not self.is_main:
            return None
        if self.bar is not None:
            self.bar.close()
        if self.loggers is not None:
            self.loggers.close()
        return plot_curves(self.path, self.run_dir / "curves.png", plot_keys) if plot_keys else None


# The console line every --log-interval steps: (metric, label, format), shown when present.
CONSOLE_KEYS = (
    ("train/loss", "loss", ".4g"),
    ("reward/mean", "reward", ".3f"),
    ("reward/accuracy", "acc", ".3f"),
    ("policy/kl_ref", "kl_ref", ".3g"),
    ("policy/approx_kl", "approx_kl", ".3g"),
    ("policy/entropy", "entropy", ".3f"),
    ("policy/clipfrac", "clipfrac", ".3f"),
    ("critic/vf_loss", "vf_loss", ".4g"),
    ("train/grad_norm", "grad_norm", ".3g"),
    ("response/length_mean", "len", ".1f"),
    ("val/accuracy", "val_acc", ".3f"),
    ("val/loss", "val_loss", ".4f"),
    ("perf/step_s", "s/step", ".2f"),
)


def console_line(record: dict, total_steps: int) -> str:
    shown = [f"{label} {record[k]:{fmt}}" for k, label, fmt in CONSOLE_KEYS if isinstance(record.get(k), int | float)]
    return f"step {record['step']}/{total_steps}  " + "  ".join(shown)


def step_metrics(batch: dict, rewards, advantages, old_logprobs=None) -> dict:
    """Step 7's shared metrics of a common.rollout.generate_and_score batch, over every rank: reward/*, response/*,
    verl's critic/advantages/* over response tokens, the phase timings, train/epoch, perf/step_s, perf/tokens_per_s,
    rollout/weight_version and staleness_*, and the engine's counters (common.serving.remote.RemoteEngines.stats).
    `rewards` (B,) are final, after any shaping; `advantages` (B,) or (B, T). With the trainer's `old_logprobs`
    (B, T), also rollout/logprob_diff_mean and _max: |trainer - engine| over response tokens (none in --bypass-mode)."""
    rows = batch["rows"]
    truncated = [c.finish_reason == "length" for _, c in rows]
    sources = [p["data_source"] for p, _ in rows]
    lengths = batch["response_mask"].sum(-1).tolist()
    metrics = rollout_metrics(rewards.tolist(), lengths, truncated, sources, batch["scored"])
    metrics.update(advantage_metrics(advantages, batch["response_mask"]))
    metrics["rollout/weight_version"] = batch["weight_version"]
    # How many versions older the weights that sampled each response are: 0 but for remote engines sampling ahead.
    staleness = [batch["weight_version"] - c.version if c.version is not None else 0 for _, c in rows]
    parts = gather_objects((sum(staleness), len(staleness), max(staleness, default=0)))
    metrics["rollout/staleness_mean"] = sum(p[0] for p in parts) / max(1, sum(p[1] for p in parts))
    metrics["rollout/staleness_max"] = max(p[2] for p in parts)
    metrics.update(batch.get("engine_stats", {}))
    if rows and (rows[0][1].extra_info or {}).get("env"):  # an --env-config run: every rank plays environments
        from common.agents.envs import env_metrics

        metrics.update(env_metrics(rows))
    if old_logprobs is not None and old_logprobs is not batch["rollout_logprobs"]:  # bypass: nothing to compare
        metrics.update(logprob_diff_metrics(old_logprobs, batch["rollout_logprobs"], batch["response_mask"]))
    lengths = batch["attention_mask"].sum(-1).double()  # each sequence's real tokens, prompt and response
    needed = needed_tokens(lengths, lengths - batch["response_mask"].sum(-1), batch["group_ids"])
    width = lengths.new_tensor(float(batch["attention_mask"].numel()))  # tokens with padding
    by_group: dict = {}
    for group, reward in zip(batch["group_ids"].tolist(), batch["rewards"].tolist()):  # the scores, before shaping
        by_group.setdefault(group, set()).add(reward)
    counts = lengths.new_tensor([sum(len(v) == 1 for v in by_group.values()), len(by_group), len(rows)])
    sums = [lengths.sum(), *needed, batch["response_mask"].sum().double(), width, *counts]
    tokens, needed, needed_sq, generated, width, equal, groups, samples = all_reduce_sum(torch.stack(sums)).tolist()
    if samples > groups:  # groups of several: the share whose rewards are all equal (their advantages are 0)
        metrics["reward/equal_groups"] = equal / groups
    metrics.update(batch.get("conditioning", {}))  # common.shaping.conditioning's, when a knob is on
    metrics.update(batch["timing"])
    metrics["perf/sync_s"] = PHASES.pop("sync", 0.0)  # the engine's weight sync after this step's update
    metrics["perf/padding_share"] = 1 - tokens / width
    seconds = time.time() - batch["started"]  # the step so far: since its generation began
    metrics.update(
        {
            "train/epoch": batch["epoch"],
            "perf/step_s": seconds,
            "perf/tokens_per_s": tokens / seconds,
            "perf/total_num_tokens": tokens,
            "_sequence_tokens": (tokens, needed, needed_sq),
        }
    )
    if batch["timing"].get("perf/generate_s"):
        metrics["perf/generate_tokens_per_s"] = generated / batch["timing"]["perf/generate_s"]
    counts = [LAYOUTS["packed"], LAYOUTS.total(), HEADS["fused"], HEADS.total()]  # one all-reduce for both
    packed, layouts, fused, heads = all_reduce_sum(lengths.new_tensor(counts)).tolist()
    LAYOUTS.clear(), HEADS.clear()
    if layouts:  # a model that can run padding-free (--use-remove-padding auto or True): the share that did
        metrics["perf/packed_share"] = packed / layouts
    if heads:  # the share of the step's passes whose LM head was fused with the logprob (response_logprobs)
        metrics["perf/fused_head_share"] = fused / heads
    return metrics


def _perf_context(perf: dict) -> dict:
    """What perf/mfu needs from a run (common.model.load_trained_model's run_info and the passes
    over each step, ppo_epochs): the FLOP terms, the summed peak of its devices and its source."""
    index = torch.cuda.current_device() if perf["device"] == "cuda" else 0
    peak, source = device_peak(perf["device"], getattr(torch, perf["compute_dtype"]), index)
    return {
        "flops": perf["flops"],
        "epochs": perf.get("epochs", 1),
        "peak": peak * perf["world_size"],
        "peak_source": f"{perf['world_size']} x {peak / 1e12:.4g} TFLOP/s ({source})",
    }


def update_metrics(perf: dict, tokens: float, needed: float, needed_sq: float, update_s: float) -> dict:
    """perf/train_tokens_per_s (sequence tokens through the update, every pass and rank, a second), perf/update_tflop
    (model FLOPs of the work common.perf.needed_tokens counts) and perf/mfu (those a second over all devices' peak)."""
    flops = perf["epochs"] * update_flops(perf["flops"], needed, needed_sq)
    return {
        "perf/train_tokens_per_s": perf["epochs"] * tokens / update_s,
        "perf/update_tflop": flops / 1e12,
        "perf/mfu": flops / update_s / perf["peak"],
    }


def advantage_metrics(advantages, response_mask) -> dict:
    """critic/advantages/mean, min and max over the response tokens of every rank. torch's
    reductions keep a NaN (Python's min and max may drop it), so a NaN advantage shows."""
    mask = response_mask.bool()
    adv = (advantages.unsqueeze(-1).expand(mask.shape) if advantages.dim() == 1 else advantages)[mask].float()
    local = (adv.sum().item(), len(adv), adv.min().item(), adv.max().item()) if len(adv) else None
    parts = torch.tensor([p for p in gather_objects(local) if p is not None], dtype=torch.float64)
    if not len(parts):
        return {}
    return {
        "critic/advantages/mean": (parts[:, 0].sum() / parts[:, 1].sum()).item(),
        "critic/advantages/max": parts[:, 3].max().item(),
        "critic/advantages/min": parts[:, 2].min().item(),
    }


def logprob_diff_metrics(trainer, engine, response_mask) -> dict:
    """rollout/logprob_diff_mean and _max: |trainer - engine| logprob over the response tokens of every rank."""
    diff = (trainer.float() - engine.float()).abs()[response_mask.bool()]
    parts = gather_objects((diff.sum().item(), len(diff), diff.max().item() if len(diff) else 0.0))
    count = sum(p[1] for p in parts)
    if not count:
        return {}
    return {
        "rollout/logprob_diff_mean": sum(p[0] for p in parts) / count,
        "rollout/logprob_diff_max": max(p[2] for p in parts),
    }


def _keep_until(path: Path, step: int) -> None:
    """A resumed run's jsonl log keeps the lines of steps up to its checkpoint (a fresh run: none);
    a torn line, left by a kill while writing, is dropped with a warning."""
    kept = []
    if step > 0 and path.is_file():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                record = json.loads(line) if line else None
            except json.JSONDecodeError:
                log.warning("%s line %d is torn (%r...): dropped", path, number, line[:40])
                continue
            if record is not None and record.get("step", 0) <= step:
                kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def plot_curves(metrics_path, out_path, patterns: tuple[str, ...]) -> Path | None:
    """One panel per metric whose name matches a pattern (fnmatch) and that changes, against step;
    after them, where each training step's time went (its phases' seconds, stacked)."""
    records = read_metrics(metrics_path)
    steps = [r for r in records if "perf/update_s" in r]

    def rank(name):  # panels in the order of the patterns, then by name
        return next(i for i, p in enumerate(patterns) if fnmatch.fnmatch(name, p)), name

    matching = {k for r in records for k in r if k != "step" and any(fnmatch.fnmatch(k, p) for p in patterns)}
    # A metric that never moved (e.g. clipfrac with one update per batch) gets no panel.
    names = sorted((k for k in matching if len({r[k] for r in records if k in r}) > 1), key=rank)
    if not names and not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = len(names) + bool(steps)
    cols = min(3, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), int | float)]
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(name, fontsize=10)
    if steps:
        ax = axes.flat[len(names)]
        phases = [phase_seconds(r) for r in steps]
        shown = [name for name in phases[0] if any(p[name] for p in phases)]
        ax.stackplot([r["step"] for r in steps], *[[p[name] for p in phases] for name in shown], labels=shown)
        ax.set_title("where the time went (s per step)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    for ax in list(axes.flat)[:panels]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.locator_params(nbins=4)  # fewer ticks read as well on a small panel and draw in 3/4 of the time
        ax.locator_params(axis="x", integer=True)  # steps
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    # Margins in inches, as tight_layout would leave them: measuring every label costs half the plot.
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=0.65 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.35 / height, wspace=0.3, hspace=0.55
    )
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return Path(out_path)


def rollout_metrics(rewards, lengths, truncated, sources, scored) -> dict:
    """reward/* and response/* over the samples of every rank (gathered; rank order). `rewards` are the final
    per-sample rewards; accuracy and the extra keys of dict results come from `scored`, the reward pool's output."""
    hits = [hit(s, e) for s, e in zip(scored.scores, scored.extras)]
    mine = list(zip(rewards, lengths, truncated, sources, hits, scored.extras))
    rows = [r for part in gather_objects(mine) for r in part]
    values = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    lens = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    metrics = {
        "reward/mean": values.mean().item(),
        "reward/std": values.std().item() if len(rows) > 1 else 0.0,
        "reward/accuracy": sum(r[4] for r in rows) / len(rows),
        "reward/errors": all_reduce_sum(torch.tensor(float(scored.errors))).item(),
        "reward/timeouts": all_reduce_sum(torch.tensor(float(scored.timeouts))).item(),
        "reward/nonfinite": all_reduce_sum(torch.tensor(float(scored.nonfinite))).item(),
        "response/length_mean": lens.mean().item(),
        "response/length_max": lens.max().item(),
        "response/clip_ratio": sum(r[2] for r in rows) / len(rows),
    }
    for source in sorted({r[3] for r in rows}):
        mine = [r[0] for r in rows if r[3] == source]
        metrics[f"reward/{source}"] = sum(mine) / len(mine)
    for key in sorted({k for r in rows for k in r[5]}):  # other keys of dict results, e.g. "formatted"
        values_k = [r[5][key] for r in rows if key in r[5]]
        metrics[f"reward/extra/{key}"] = sum(values_k) / len(values_k)
    return metrics


def describe_run(data_summary: str, total_steps: int, resume_from, model_name: str, run_info: dict, plan) -> str:
    """The two lines a run prints before its first step: data, steps, resume; model and layout
    (run_info from common.parallel.sharding_report)."""
    n_params, n_trainable = run_info["params_full"], run_info["params_trainable"]
    return (
        f"{data_summary}; {total_steps} steps"
        + (f"; resumed from {resume_from}" if resume_from else "")
        + f"\nmodel {model_name}: {n_params / 1e6:.2f}M params ({n_trainable / 1e6:.2f}M trainable), "
        f"{run_info['strategy']} on {run_info['world_size']} x {run_info['device']}; per process and step "
        f"{plan.local_sequences_per_step} sequences, {plan.mini_batches_per_step} optimizer step(s) of "
        + (f"{plan.grad_accum} micro-batch(es)" if plan.grad_accum else "micro-batches packed by a token budget")
    )


def rollout_is_metrics(weights, response_mask, threshold: float | str) -> dict:
    """common.shaping.correction.rollout_is_metrics, still importable from here for forks of earlier recipes."""
    from common.shaping.correction import rollout_is_metrics as metrics

    return metrics(weights, response_mask, threshold)
