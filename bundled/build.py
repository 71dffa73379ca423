"""Rebuild the bundled offline assets: tiny chat tokenizer, random-init tiny Qwen2 (and a tiny Llama
for the tests), addition task.

    python bundled/build.py            # writes bundled/tiny-qwen2, bundled/tiny-llama, bundled/addition,
                                       # calculator's and the games' data

Deterministic: the same torch version gives the same weights, and any Python gives the same data.
The shipped SFT checkpoints (bundled/tiny-qwen2-sft, bundled/tiny-qwen2-tools, bundled/tiny-qwen2-games)
are made from these by recipes/sft.py; the commands are in bundled/README.md.
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import AddedToken
from tokenizers.pre_tokenizers import ByteLevel
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

HERE = Path(__file__).resolve().parent
DATA_SOURCE = "bundled/addition"
N_TEST = 500
SEED = 0
TOOL_SOURCE = "bundled/calculator"
N_TOOL_SFT, N_TOOL_RL = 4000, 8000  # (3-digit, 2-digit) pairs: tool-use conversations for SFT, prompts for RL
N_DIRECT_SFT = 4000  # and SFT conversations that answer without the tool, drawn after the rest

# Qwen's chat template, trimmed to what the bundled tasks need, same markers and layout. Given
# tools, it lists them in a system turn first, one line each (name: description) where Qwen's
# writes each whole JSON schema: the tiny model reads a tenth of the tokens.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- tool['function']['name'] + ': ' + tool['function']['description'] + '\\n' }}"
    "{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Like Qwen3's <think>/</think>: ordinary (non-special) added tokens, so decoded text keeps them.
ADDED = ["<answer>", "</answer>"]


def build_tokenizer() -> Qwen2Tokenizer:
    # Byte-level BPE with no merges: every byte is a token, so any text round-trips exactly.
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    for tok in SPECIAL + ADDED:
        vocab[tok] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def build_model(tokenizer) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(config)


def build_llama(tokenizer) -> LlamaForCausalLM:
    """A second architecture for the tests that must hold for more than one model family (the
    padding-free forward's equality): Llama's layout, with what differs from the Qwen2 above: grouped
    key-value heads (4 query heads share 2), no attention bias, untied embeddings."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def question(a: int, b: int, op: str = "+") -> str:
    return f"{a}{op}{b}=? Answer in <answer></answer>."


def row(source: str, split: str, i: int, a: int, b: int, op: str = "+") -> dict:
    """A verl-format row asking a+b (or a*b)."""
    q, result = question(a, b, op), OPS[op](a, b)
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": q}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(result)},
        # verl keeps the worked answer in extra_info; sft.py trains on it (--response-key).
        "extra_info": {"split": split, "index": i, "question": q, "answer": f"<answer>{result}</answer>"},
    }


def build_task(out: Path) -> None:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(SEED).shuffle(pairs)
    splits = {"test": pairs[:N_TEST], "train": pairs[N_TEST:]}
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        records = [row(DATA_SOURCE, split, i, a, b) for i, (a, b) in enumerate(rows)]
        pq.write_table(pa.Table.from_pylist(records), out / f"{split}.parquet")


PLAIN_SOURCE = "bundled/plain_addition"
N_PLAIN_TEST = 200


def build_plain_task(out: Path) -> None:
    """The real model's task (bundled/real_model.py): sums of two numbers from 10 to 49 asked in plain words,
    answered as the instruct model answers ("36 + 46 = 82"), the reward reading the last number."""
    pairs = [(a, b) for a in range(10, 50) for b in range(10, 50)]
    random.Random(SEED).shuffle(pairs)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in {"test": pairs[:N_PLAIN_TEST], "train": pairs[N_PLAIN_TEST:]}.items():
        records = []
        for i, (a, b) in enumerate(rows):
            q = f"Compute {a} + {b}. Reply with the number only."
            records.append(
                {
                    "data_source": PLAIN_SOURCE,
                    "prompt": [{"role": "user", "content": q}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                    "extra_info": {"split": split, "index": i, "question": q, "answer": str(a + b)},
                }
            )
        pq.write_table(pa.Table.from_pylist(records), out / f"{split}.parquet")


def tool_call(a: int, b: int) -> str:
    call = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def build_tool_task(out: Path) -> None:
    """A 3-digit number times a 2-digit one, with the calculator of calculator/tools.yaml: RL
    prompts (tool_agent rows) and conversations for SFT (messages, with the tool schemas in a
    tools column). Multiplication, not addition: the tiny model learns 3-digit addition by itself
    in minutes of SFT, and this product it does not."""
    import yaml

    schemas = [t["tool_schema"] for t in yaml.safe_load((out / "tools.yaml").read_text())["tools"]]
    rng = random.Random(SEED)
    n = N_TEST + N_TOOL_SFT + N_TOOL_RL
    # One draw for all: a longer draw begins with the shorter one's pairs (set-based sampling), so
    # the direct-answer pairs came after test, sft and train without changing them.
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], n + N_DIRECT_SFT)
    tool, direct = pairs[N_TEST : N_TEST + N_TOOL_SFT], pairs[n:]
    splits = {
        "test": pairs[:N_TEST],
        # Half the SFT conversations call the calculator, half answer at once, interleaved: the SFT
        # model calls its tool on some prompts only, and RL has the choice to learn.
        "sft": [x for pair in zip(tool, direct) for x in pair],
        "train": pairs[N_TEST + N_TOOL_SFT : n],
    }
    for split, rows in splits.items():
        records = []
        for i, (a, b) in enumerate(rows):
            record = {**row(TOOL_SOURCE, split, i, a, b, "*"), "agent_name": "tool_agent"}
            if split == "sft":  # even rows call, read the result, then answer; odd rows answer at once
                call = [{"role": "assistant", "content": tool_call(a, b)}, {"role": "tool", "content": str(a * b)}]
                record["messages"] = [
                    {"role": "user", "content": question(a, b, "*")},
                    *(call if i % 2 == 0 else []),
                    {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
                ]
                record["tools"] = json.dumps(schemas)  # listed in odd rows too: the same prompt either way
            records.append(record)
        pq.write_table(pa.Table.from_pylist(records), out / f"{split}.parquet")


GAME_SFT_SEEDS = range(2 * 10**8, 2 * 10**8 + 4000)  # lakes for SFT: apart from RL's 0.. and validation's 10^9..


def _load_env(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def lake_plan(desc: list[str], start: int, actions: tuple[str, ...]) -> list[str]:
    """A shortest path from cell `start` to G avoiding holes (breadth-first, trying actions in
    order), as action names; FrozenLake's (row, col) moves: left, down, right, up."""
    size = len(desc)
    moves = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    previous, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for cell in frontier:
            if desc[cell // size][cell % size] == "G":
                path = []
                while previous[cell] is not None:
                    cell, action = previous[cell]
                    path.append(action)
                return path[::-1]
            for action in actions:
                dr, dc = moves[action]
                r, c = cell // size + dr, cell % size + dc
                if 0 <= r < size and 0 <= c < size and desc[r][c] != "H" and r * size + c not in previous:
                    previous[r * size + c] = (cell, action)
                    nxt.append(r * size + c)
        frontier = nxt
    raise ValueError(f"no path to G in {desc}")


def play(env, seed: int, actions: list[str]) -> list[dict]:
    """The SFT conversation of `actions` played from seed, as the text environment shows it: the
    observation, then <answer>action</answer>, turn by turn (the last observation left out)."""
    observation, _ = env.reset(seed=seed)
    messages = [{"role": "user", "content": observation}]
    for action in actions:
        observation, *_ = env.step(action)
        messages += [
            {"role": "assistant", "content": f"<answer>{action}</answer>"},
            {"role": "user", "content": observation},
        ]
    return messages[:-1]


def build_games(out: Path) -> None:
    """SFT conversations for the bundled games, played by shortest-path players: FrozenLake
    (breadth-first over the lake) and Sokoban (breadth-first over the player's and box's cells),
    the latter three times: as games.yaml draws the room, with the room described as well, and as
    sokoban.yaml plays it (described, the whole solution in one reply)."""
    lake = _load_env(out / "frozen_lake.py", "TextFrozenLake")(size=4, p=0.8, is_slippery=False)
    sokoban = _load_env(out / "sokoban.py", "SimpleSokoban")
    solve = _load_env(out / "sokoban.py", "solve")
    for name, tag, env, plan in [
        ("frozen_lake", "FrozenLake", lake, lambda env: lake_plan(env.desc, 0, ("down", "right", "left", "up"))),
        ("sokoban", "SimpleSokoban", sokoban(), lambda env: solve(env.walls, env.target, env.box, env.player)),
        (
            "sokoban_described",
            "SimpleSokoban",
            sokoban(describe=True),
            lambda env: solve(env.walls, env.target, env.box, env.player),
        ),
        (
            "sokoban_plan",
            "SimpleSokoban",
            sokoban(describe=True, moves_per_turn=6),
            lambda env: [" ".join(solve(env.walls, env.target, env.box, env.player))],
        ),
    ]:
        records = []
        for seed in GAME_SFT_SEEDS:
            env.reset(seed=seed)
            records.append({"data_source": tag, "messages": play(env, seed, plan(env)), "extra_info": {"seed": seed}})
        pq.write_table(pa.Table.from_pylist(records), out / f"{name}_sft.parquet")


def main() -> None:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model_dir = HERE / "tiny-qwen2"
    model.to(torch.bfloat16).save_pretrained(model_dir)  # bf16 on disk keeps the bundle small
    tokenizer.save_pretrained(model_dir)
    llama_dir = HERE / "tiny-llama"
    build_llama(tokenizer).to(torch.bfloat16).save_pretrained(llama_dir)
    tokenizer.save_pretrained(llama_dir)
    build_task(HERE / "addition")
    build_tool_task(HERE / "calculator")
    build_plain_task(HERE / "plain-addition")
    build_games(HERE / "envs")
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"model": str(model_dir), "params": n, "vocab": len(tokenizer)}))


if __name__ == "__main__":
    main()
