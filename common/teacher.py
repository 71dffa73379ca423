"""distill.py's teacher: where it runs (TeacherArgs: in the trainer, a vLLM engine, or Ray
actors), its checks before any model loads (the student's vocabulary; what an engine can serve), and
start_teacher. Only distill.py loads it.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from common.errors import UsageError
from common.flags import flag
from common.model import FROZEN_KNOBS, check_source, load_frozen

REMOTE = (lambda a: a.teacher_placement == "remote", "add --teacher-placement remote")  # when the remote knobs are read


@dataclass
class TeacherArgs:
    """Where a teacher that scores the student's samples runs (distill.py, whose --teacher-model it is)."""

    teacher_engine: Literal["hf", "vllm"] = "hf"
    """hf: transformers forward passes; vllm: vLLM's prompt logprobs (of the sampled tokens only, at --temperature 1)"""
    teacher_placement: Literal["colocated", "remote"] = "colocated"
    """colocated: in the trainer's processes (hf: micro-batched and sharded under FSDP2, as the reference);
    remote: --teacher-num-engines Ray actors serving its logprobs (--ray-address, --engine-timeout apply)"""
    teacher_num_engines: int = flag(1, ge=1, only_with=REMOTE)
    """remote: teacher engine processes (Ray actors)"""
    teacher_engine_num_cpus: float = flag(1.0, gt=0, only_with=REMOTE)
    """remote: CPUs Ray reserves for each teacher engine (its torch threads)"""
    teacher_engine_num_gpus: float = flag(0.0, ge=0, only_with=REMOTE)
    """remote: GPUs Ray reserves for each teacher engine"""
    teacher_gpu_memory_utilization: float = flag(
        0.3, gt=0, le=1, only_with=(lambda a: a.teacher_engine == "vllm", "add --teacher-engine vllm")
    )
    """vllm: fraction of GPU memory the teacher's engine may take (beside --gpu-memory-utilization's)"""

    def teacher_kwargs(self) -> dict:
        """The keyword arguments of start_teacher: the placement's, the frozen model's
        (FROZEN_KNOBS of the policy's), and the engines' (the vLLM group, args.vllm, with the teacher's memory
        share, one more token of room for vLLM's one generated token; remote: micro_batch_size_per_gpu
        sequences per forward, and a local Ray counts the rollout engines' CPUs too)."""
        vllm = dict(vllm=dataclasses.replace(self.vllm, gpu_memory_utilization=self.teacher_gpu_memory_utilization),
                    max_model_len=self.max_prompt_length + self.max_response_length + 1, seed=self.seed)  # fmt: skip
        common = dict(dtype=self.dtype, trust_remote_code=self.trust_remote_code)
        p = self.placement  # the rollout engines'
        rollout_cpus = p.num_rollout_engines * p.engine_num_cpus if p.rollout_placement == "remote" else 0
        remote = dict(
            num_engines=self.teacher_num_engines, engine_num_cpus=self.teacher_engine_num_cpus,
            engine_num_gpus=self.teacher_engine_num_gpus, ray_address=p.ray_address, max_staleness=0,
            timeout=p.engine_timeout, seed=self.seed, batch_size=self.micro_batch_size_per_gpu, **common,
            ray_num_cpus=math.ceil(self.teacher_num_engines * self.teacher_engine_num_cpus + rollout_cpus),
        )  # fmt: skip
        frozen = {**{k: self.policy_kwargs()[k] for k in FROZEN_KNOBS}, "strategy": self.strategy}
        return dict(engine=self.teacher_engine, placement=self.teacher_placement, frozen=frozen,
                    vllm={**vllm, **(common if self.teacher_placement == "colocated" else {})},
                    remote=remote)  # fmt: skip

    def __post_init__(self):  # the teacher's own rules, after every shared flag's (common.config.check_flags)
        super().__post_init__()
        check_teacher_engine(self)


def check_teacher_engine(args) -> None:
    """A teacher served by an engine (TeacherArgs) gives only its logprobs of the sampled tokens,
    and vLLM's at temperature 1."""
    if args.teacher_engine == "hf" and args.teacher_placement == "colocated":
        return
    served = f"--teacher-engine {args.teacher_engine} --teacher-placement {args.teacher_placement}"
    if getattr(args, "loss", None) == "gkd":
        raise UsageError(f"--loss gkd with {served}: GKD's divergence takes the teacher's whole next-token "
                         f"distribution, which only its forward passes in the trainer give; an engine serves the "
                         f"logprobs of the sampled tokens. Use --loss reverse_kl, or drop the two teacher flags")  # fmt: skip
    if args.teacher_engine == "vllm":
        if args.temperature != 1:
            raise UsageError(f"--teacher-engine vllm with --temperature {args.temperature:g}: vLLM's prompt logprobs "
                             f"are the teacher's at temperature 1 (it runs no sampling processor on prompt tokens), "
                             f"while the student's are at the sampling temperature; sample at --temperature 1, or "
                             f"use --teacher-engine hf, which divides the teacher's logits as the student's")  # fmt: skip
        from common.vllm_engine import check_vllm

        check_vllm(args, "--teacher-engine vllm")


def check_teacher(path: str, tokenizer, trust_remote_code: bool = False) -> None:
    """A teacher scores the student's tokens by id, so it must read them as the student does: the
    same vocabulary (token -> id) in its tokenizer, else a UsageError naming the first difference.
    Reads only the tokenizer files: it runs before any model loads."""
    from transformers import AutoTokenizer

    source = check_source(path, "teacher model")
    theirs = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs != ours:
        moved = sorted(t for t in ours.keys() & theirs.keys() if ours[t] != theirs[t])
        only = sorted(ours.keys() ^ theirs.keys())
        example = (f"{moved[0]!r} is id {ours[moved[0]]} for the student, {theirs[moved[0]]} for the teacher"
                   if moved else f"{only[0]!r} is in one vocabulary only")  # fmt: skip
        raise UsageError(
            f"--teacher-model {path}: its tokenizer differs from the student's ({len(moved)} tokens with other ids, "
            f"{len(only)} in one vocabulary only; {example}); distillation compares the two models token by token, "
            f"so give a teacher of the student's family"
        )


def start_teacher(path: str, dist, tokenizer, *, engine: str = "hf", placement: str = "colocated",
                  frozen: dict | None = None, vllm: dict | None = None, remote: dict | None = None):  # fmt: skip
    """distill.py's teacher as --teacher-engine and --teacher-placement ask (TeacherArgs
    gives the keyword arguments): hf colocated is the model itself (common.model.load_frozen: forward
    passes in the trainer, sharded under FSDP2); the others are engines that serve its logprobs of
    the sampled tokens (engine_logprobs), holding path's weights as they are: a VLLMEngine in this
    process (vLLM's prompt logprobs), or common.remote.RemoteEngines, HF or vLLM engines in Ray actors."""
    if placement == "colocated" and engine == "hf":
        return load_frozen(path, dist, **frozen)
    if placement == "colocated":
        from common.vllm_engine import VLLMEngine

        return VLLMEngine(None, model_path=path, eos_ids=[tokenizer.eos_token_id], dist=dist, **vllm)
    from common.remote import RemoteEngines

    return RemoteEngines(None, dist, 0, model_path=path, pad_id=tokenizer.pad_token_id, eos_ids=[tokenizer.eos_token_id],
                         vllm=vllm if engine == "vllm" else None, role="teacher engine", **remote)  # fmt: skip
