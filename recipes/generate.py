"""Generate: sample n responses per prompt from a model into a parquet (verl's main_generation).

The output holds every row of the input file, every column kept, plus three columns:
    responses       n strings: the decoded responses (special tokens dropped)
    response_ids    n token-id lists, for training on them (best-of-n, rejection-sampled SFT)
    finish_reasons  n of "stop" (an eos token) or "length" (--max-response-length reached)
Rows with agent_name tool_agent run through the agent loop (common.agents.agent) with --tool-config and
--interaction-config, as in training: their response is the whole conversation after the prompt,
tool results included. Then a fourth column, response_extra_info, holds n JSON strings of what
the conversation adds to the row's extra_info for the reward (verl's num_turns and
rollout_reward_scores; "null" for other rows), and recipes/evaluate.py scores with it.
With --env-config there is no input file: it plays --env-val-seeds held-out seeds of every tag
(the seeds training validates on), each row a tag (data_source), its env_seed and its prompt (the
first observation), and response_extra_info holds each trajectory's return, success and counts
(common.agents.env_manager), which recipes/evaluate.py reports per tag.
Prompts go through the model's chat template and --max-prompt-length exactly as in training
(--truncation; rows dropped by --filter-overlong-prompts are counted and left out of the output).

How it runs:
1. The prompts are cut into chunks of --batch-size in file order. Process p of N generates the
   chunks c with c mod N = p, its sampler seeded by (--seed, c), so with the HF engine one process
   and N processes write the same responses (vLLM: the same for greedy decoding; sampled ones
   differ, its CPU build takes no per-request seed).
2. Each finished chunk is written at once under <output>.parts/ (written to a temporary name, then
   renamed, so a chunk is either whole or absent). Started again with the same flags, a killed run
   generates only the chunks that are missing; with other flags it refuses to mix the two.
3. When every chunk exists, process 0 merges them in input order into --output-path and removes the
   parts folder. recipes/evaluate.py scores the result.

Run:
    python recipes/generate.py --n-samples 8                       # bundled test split, shipped checkpoint
    torchrun --nproc_per_node 2 recipes/generate.py --n-samples 8  # 2 processes, the same output
    python recipes/generate.py --model runs/grpo/checkpoints/step_80/hf --temperature 0 \
        --data-path ~/data/gsm8k/test.parquet --output-path ~/gen/gsm8k_step80.parquet --rollout-name vllm
    python recipes/generate.py --model bundled/tiny-qwen2-games --env-config bundled/envs/games.yaml \
        --max-response-length 448 --max-env-steps 8 --n-samples 4    # then evaluate.py on its output
"""

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Literal

import torch
from tyro.conf import OmitArgPrefixes, arg

from common.config import BUNDLED, AgentArgs, EngineArgs, EnvPlayArgs, WaitArgs, check_flags, cli, group
from common.errors import UsageError, usage_errors
from common.flags import flag, flag_values
from common.parallel import barrier, init_distributed
from common.runlock import claim_output

RECIPE = Path(__file__).stem
# The flags that decide what a chunk holds: a parts folder made with other values is not reused.
OUTPUT_FLAGS = ("data_path", "prompt_key", "n_samples", "batch_size", "model", "tokenizer", "dtype", "do_sample",
                "temperature", "top_p", "top_k", "min_p", "max_prompt_length", "max_response_length", "truncation",
                "filter_overlong_prompts", "seed", "rollout_name", "tool_config", "interaction_config",
                "max_assistant_turns", "max_user_turns", "env_config", "env_tags", "env_val_seeds", "max_env_steps",
                "format_penalty", "env_manager", "env_gamma")  # fmt: skip


# --- config ---------------------------------------------------------------------------------------
@dataclass
class Args(WaitArgs):  # generate.py's own knobs; the engine's, the agent loop's and the environments' are groups
    data_path: str = str(BUNDLED / "addition" / "test.parquet")
    """input in verl's format (a prompt column; other columns are copied to the output): parquet, JSON / JSONL, CSV,
    Arrow, a save_to_disk folder or a dataset's name, as --train-files takes them"""
    prompt_key: Annotated[str, arg(aliases=("--input-key",))] = "prompt"
    """column holding the prompt: a chat list of {role, content} or a plain string (OpenRLHF's --input-key)"""
    output_path: str = ""
    """output parquet (default: runs/generate/<input name>_n<n_samples>.parquet)"""
    force_unlock: bool = False
    """take the lock of the run folder (or output file) even when a run on another host holds it: only when that
    run is known to be gone (its job ended, its node died); two live runs on one folder corrupt each other's files"""
    n_samples: int = flag(1, ge=1)
    """responses sampled per prompt"""
    batch_size: int = flag(128, ge=1)
    """prompts per chunk: one generate call, one resumable part file"""
    model: str = str(BUNDLED / "tiny-qwen2-sft")
    """policy: a local Hugging Face folder or a hub name"""
    tokenizer: str | None = None
    """tokenizer folder or hub name (default: the model's)"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the weights are loaded and run in"""
    trust_remote_code: bool = False
    """allow model code from the model folder / hub (off: only transformers' own architectures)"""
    do_sample: bool = True
    """sample (off: greedy decoding, as --temperature 0; --top-p / --top-k are then unused)"""
    temperature: float = flag(
        1.0,
        ge=0,
        note="0 is greedy decoding",
        only_with=(lambda a: a.do_sample, "drop --no-do-sample (greedy decoding)"),
    )
    """sampling temperature; 0 is greedy decoding, as --val-temperature 0 is in training"""
    top_p: float = flag(1.0, gt=0, le=1, only_with=(lambda a: a.do_sample, "drop --no-do-sample (greedy decoding)"))
    """nucleus sampling: keep the smallest token set with this much probability (1.0: off)"""
    top_k: int = flag(
        -1,
        rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
        only_with=(lambda a: a.do_sample, "drop --no-do-sample (greedy decoding)"),
    )
    """sample among the k most likely tokens (-1: off)"""
    min_p: float = flag(0.0, ge=0, lt=1, only_with=(lambda a: a.do_sample, "drop --no-do-sample (greedy decoding)"))
    """keep only the tokens at least this fraction as likely as the most likely one (vLLM's min_p; 0.0: off)"""
    max_prompt_length: int = flag(64, ge=1)
    """prompt tokens after the chat template (longer ones follow --truncation)"""
    max_response_length: int = flag(16, ge=1)
    """generated tokens per response"""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """too-long input: error, or keep the end (left), the start (right), or both ends (middle)"""
    filter_overlong_prompts: bool = False
    """drop (and count) prompts longer than max_prompt_length instead of truncating / failing"""
    seed: int = flag(1, ge=0)
    """seed for sampling (chunk c is sampled from seed and c)"""
    engine: Annotated[EngineArgs, OmitArgPrefixes] = group(EngineArgs)
    """the engine that samples: transformers' generate or vLLM (common.rollout.local_engine)"""
    agent: Annotated[AgentArgs, OmitArgPrefixes] = group(AgentArgs)
    """multi-turn conversations: tools and interactions (common.agents.agent), off without --tool-config"""
    env: Annotated[EnvPlayArgs, OmitArgPrefixes] = group(EnvPlayArgs)
    """Gymnasium environments played instead of --data-path's prompts (common.agents.envs), off without --env-config"""

    def __post_init__(self):  # checked as the flags are parsed, before anything loads
        check_flags(self)
        from common.formats.sources import KINDS, NAME  # a file, a save_to_disk folder or a dataset's name

        if not Path(self.data_path).expanduser().exists() and not NAME.match(self.data_path):
            raise UsageError(f"--data-path {self.data_path}: no such file or folder; pass {KINDS}, or a dataset's name")
        out = self.output()
        if out.suffix != ".parquet":
            raise UsageError(f"--output-path {out}: must end in .parquet")
        if out.resolve() == Path(self.data_path).expanduser().resolve():
            raise UsageError(f"--output-path {out}: is the input file; write the responses to a new file")
        blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UsageError(f"--output-path {out}: {blocking} is a file, so the folder cannot be created")

    def output(self) -> Path:
        name = Path(self.env.env_config or self.data_path).stem
        return Path(self.output_path or f"runs/generate/{name}_n{self.n_samples}.parquet")


# --- parts: one parquet per chunk, so a killed run resumes --------------------------------------------
def open_parts(parts: Path, flags: dict, n_chunks: int, dist) -> set[int]:
    """The chunks already written under `parts` by a run with the same flags (process 0 creates
    the folder and its flags.json; a folder from other flags is an error, never mixed in)."""
    manifest = parts / "flags.json"
    if dist.is_main:
        if manifest.is_file() and json.loads(manifest.read_text()) != flags:
            old = json.loads(manifest.read_text())
            changed = sorted(k for k in flags if old.get(k) != flags[k])
            raise UsageError(
                f"{parts} holds chunks generated with other flags ({', '.join(changed)}); delete that folder to "
                f"start over, or pass another --output-path"
            )
        parts.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps(flags, indent=1))
    barrier()
    done = {c for c in range(n_chunks) if (parts / f"chunk_{c:06d}.parquet").is_file()}
    import pyarrow.parquet as pq

    if any("response_extra_info" not in pq.read_schema(parts / f"chunk_{c:06d}.parquet").names for c in done):
        raise UsageError(
            f"{parts} holds chunks from an older generate.py (without the response_extra_info column); delete "
            f"that folder to start over, or pass another --output-path"
        )
    return done


def write_chunk(parts: Path, c: int, rows: list[dict], groups, tokenizer) -> None:
    """Chunk c's responses, keyed by input row, written whole or not at all."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    own = {}  # an environment's rows come from no file: they carry what they are
    if rows and rows[0].get("agent_name") == "env":
        own = {
            "data_source": [r["data_source"] for r in rows],
            "env_seed": [r["env_seed"] for r in rows],
            "prompt": [r["messages"] for r in rows],
        }
    table = pa.table(
        {
            "row": [r["row"] for r in rows],
            **own,
            "responses": [tokenizer.batch_decode([x.token_ids for x in g], skip_special_tokens=True) for g in groups],
            "response_ids": [[x.token_ids for x in g] for g in groups],
            "finish_reasons": [[x.finish_reason for x in g] for g in groups],
            "response_extra_info": [[json.dumps(x.extra_info) for x in g] for g in groups],
        }
    )
    tmp = parts / f"chunk_{c:06d}.parquet.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, parts / f"chunk_{c:06d}.parquet")


def merge_parts(parts: Path, n_chunks: int, data_path: str | None, out: Path) -> dict:
    """Process 0: the input's rows that were generated for, in input order, with the new columns
    (response_extra_info only when a row went through the agent loop), written to `out` (through
    a temporary name); the parts folder is removed after. data_path None: the rows played
    environments and carry their own columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = pa.concat_tables([pq.read_table(parts / f"chunk_{c:06d}.parquet") for c in range(n_chunks)])
    if data_path is None:
        table = done.select(["data_source", "env_seed", "prompt"])
    elif Path(data_path).suffix == ".parquet":
        table = pq.read_table(Path(data_path).expanduser()).take(done.column("row"))
    else:  # JSON / JSONL, CSV, Arrow, a save_to_disk folder, a dataset's name: as datasets holds it
        from common.formats.sources import open_source

        table = open_source(data_path, "data_path").data.table.take(done.column("row"))
    agent = any(x != "null" for group in done.column("response_extra_info").to_pylist() for x in group)
    for name in ("responses", "response_ids", "finish_reasons", "response_extra_info"):
        if name in table.column_names:  # an earlier generation's column: this run's replaces it (the input keeps it)
            table = table.drop_columns([name])
        if name != "response_extra_info" or agent:
            table = table.append_column(name, done.column(name))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    shutil.rmtree(parts)
    lengths = [len(ids) for group in done.column("response_ids").to_pylist() for ids in group]
    reasons = [r for group in done.column("finish_reasons").to_pylist() for r in group]
    return {
        "rows": table.num_rows,
        "responses": len(lengths),
        "length_mean": sum(lengths) / max(len(lengths), 1),
        "truncated": reasons.count("length") / max(len(reasons), 1),
    }


def read_rows(args: Args, tokenizer) -> tuple[list[dict], str]:
    """The rows to generate for, and a line saying what they are: the prompts of --data-path (checked
    and templated as training does), or with --env-config every tag's held-out seeds, as training
    validates on (common.agents.envs.env_rows)."""
    from common.agents.envs import env_rows, env_tags
    from common.agents.tools import check_rows, read_tool_config
    from common.formats.prompt_cache import load_prompts  # a small parquet file in process; a large input kept on disk

    if (env := args.env).env_config:
        tags = env_tags(env)
        rows = env_rows(env.env_config, tags, [1] * len(tags), len(tags), env.env_val_seeds)[2]
        return rows, f"env_config: {env.env_val_seeds} held-out seeds of each of {', '.join(tags)}"
    tools = read_tool_config(args.agent.tool_config).schemas if args.agent.tool_config else None
    rows, stats = load_prompts(
        [args.data_path],
        tokenizer,
        prompt_key=args.prompt_key,
        what="data_path",
        max_prompt_length=args.max_prompt_length,
        truncation=args.truncation,
        filter_overlong_prompts=args.filter_overlong_prompts,
        tools=tools,
    )
    if stats.agent_rows or args.agent.on:
        rows = list(rows)  # check_rows fills in each row's interaction_kwargs
        check_rows(rows, args.agent)
    return rows, stats.summary("data_path")


# --- main ---------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    from tqdm.auto import tqdm

    from common.engines import Sampling
    from common.model import load_policy, load_tokenizer
    from common.rewards import start_agent_pools, start_env_pool
    from common.rollout import local_engine, sample, with_agents

    dist = init_distributed(args.wait_timeout, args.seed)
    out = claim_output(args.output(), dist, args.force_unlock)  # one live run per output file
    parts = out.with_name(out.name + ".parts")

    # The rows (prompts, or environment seeds), the chunks already done, then the model.
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    rows, described = read_rows(args, tokenizer)
    chunks = [range(i, min(i + args.batch_size, len(rows))) for i in range(0, len(rows), args.batch_size)]
    flags = json.loads(json.dumps({k: v for k, v in flag_values(args).items() if k in OUTPUT_FLAGS}))  # as saved
    done = open_parts(parts, flags, len(chunks), dist)
    todo = [c for c in range(dist.rank, len(chunks), dist.world_size) if c not in done]
    if dist.is_main:
        print(described)
        if done:
            print(f"resuming: {len(done)} of {len(chunks)} chunks already in {parts}")
    checkpoint, model = (args.model, args.dtype, args.trust_remote_code), None  # vLLM loads the checkpoint itself
    if args.engine.rollout_name == "hf":
        model = load_policy(args.model, dtype=args.dtype, trust_remote_code=args.trust_remote_code).to(dist.device)
    env, max_model_len = args.env, args.max_prompt_length + args.max_response_length
    pools = SimpleNamespace(envs=None)  # the tools' and interactions' workers; the environments' (on these rows)
    pools.tools, pools.interactions = start_agent_pools(args.agent, workers=2)
    if env.env_config:
        pools.envs = start_env_pool(env, args.max_prompt_length, rows, tokenizer)
    engine = local_engine(model, tokenizer, dist, args.engine, *checkpoint, max_model_len, args.batch_size)
    engine = with_agents(engine, tokenizer, pools, args.agent, env, args.max_prompt_length, lockstep=False)  # alone
    temperature = args.temperature if args.do_sample else 0.0  # 0 is greedy, however it was asked for
    sampling = Sampling(args.n_samples, temperature, args.top_p, args.top_k, args.max_response_length, min_p=args.min_p)

    # Generate this process's missing chunks, each written as soon as it is done.
    t0 = time.time()
    mine = sum(len(chunks[c]) for c in todo)
    who = f" (process 0 of {dist.world_size})" if dist.world_size > 1 else ""
    with tqdm(total=mine, unit="prompt", desc=f"generate{who}", disable=not dist.is_main) as bar:
        for c in todo:
            torch.manual_seed(args.seed * 1_000_003 + c)  # the same samples whichever process takes chunk c
            batch = [rows[i] for i in chunks[c]]  # made when their chunk comes: a large input stays on disk
            groups = sample(engine, batch, sampling)  # tool_agent rows through the agent loop
            write_chunk(parts, c, batch, groups, tokenizer)
            bar.update(len(chunks[c]))
    barrier()
    for pool in (pools.tools, pools.interactions, pools.envs):
        if pool is not None:
            pool.close()
    summary = {"prompts_per_s": mine * dist.world_size / max(time.time() - t0, 1e-9)}
    if dist.is_main:
        summary.update(merge_parts(parts, len(chunks), None if env.env_config else args.data_path, out))
        print(
            f"{summary['rows']} prompts x {args.n_samples} responses -> {out}; response length mean "
            f"{summary['length_mean']:.1f} tokens, {summary['truncated']:.1%} cut at --max-response-length"
        )
    barrier()
    return summary


if __name__ == "__main__":
    with usage_errors():  # a bad flag, path or file: one line naming it, exit status 2
        main(cli(Args, RECIPE))  # verl's main_generation keys work too
