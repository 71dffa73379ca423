"""distill.py's teacher: where it runs (TeacherArgs: in the trainer, a vLLM engine, or Ray
actors), its checks before any model loads (the student's vocabulary; what an engine can serve),
start_teacher, and GKD's divergence to it (jsd_from_logits). Only distill.py loads it.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from common.errors import UsageError
from common.flags import BUNDLED, flag
from common.model import check_source, load_frozen
from common.ops import rowwise


def _jsd_rows(logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    s, t = torch.log_softmax(logits.float(), dim=-1), torch.log_softmax(teacher_logits.float(), dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), dim=0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


def jsd_from_logits(logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, arXiv:2306.13649) between the teacher's
    p = softmax(teacher_logits) and the student's q = softmax(logits) at each position, (..., V) -> (...), float32:
        JSD_beta = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q,
    beta 0 the forward KL(p || q), beta 1 the reverse KL(q || p), as TRL's GKD. Chunked, gradient to the student."""
    if not 0 <= beta <= 1:
        raise ValueError(f"jsd beta {beta} is outside [0, 1]")
    return rowwise(_jsd_rows, logits, teacher_logits, beta)


REMOTE = (lambda a: a.teacher_placement == "remote", "add --teacher-placement remote")  # when the remote knobs are read


@dataclass
class TeacherArgs:
    """distill.py's teacher, which scores the student's samples: the model and where it runs."""

    teacher_model: str = str(BUNDLED / "tiny-qwen2-teacher")
    """the teacher: a local Hugging Face folder or a hub name, with the student's tokenizer"""
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


def check_teacher_engine(teacher: TeacherArgs, loss: str, rollout) -> None:
    """A teacher served by an engine (the teacher group) gives only its logprobs of the sampled tokens, and vLLM's
    at temperature 1 (the rollout group's --temperature); vLLM must be able to run as the rollout group's vLLM
    knobs ask."""
    if teacher.teacher_engine == "hf" and teacher.teacher_placement == "colocated":
        return
    served = f"--teacher-engine {teacher.teacher_engine} --teacher-placement {teacher.teacher_placement}"
    if loss == "gkd":
        raise UsageError(
            f"--loss gkd with {served}: GKD's divergence takes the teacher's whole next-token distribution, which "
            f"only its forward passes in the trainer give; an engine serves the logprobs of the sampled tokens. Use "
            f"--loss reverse_kl, or drop the two teacher flags"
        )
    if teacher.teacher_engine == "vllm":
        if rollout.temperature != 1:
            raise UsageError(
                f"--teacher-engine vllm with --temperature {rollout.temperature:g}: vLLM's prompt logprobs are the "
                f"teacher's at temperature 1 (it runs no sampling processor on prompt tokens), while the student's "
                f"are at the sampling temperature; sample at --temperature 1, or use --teacher-engine hf, which "
                f"divides the teacher's logits as the student's"
            )
        from common.serving.vllm_engine import check_vllm

        check_vllm(rollout.vllm, "--teacher-engine vllm")


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
        example = (
            f"{moved[0]!r} is id {ours[moved[0]]} for the student, {theirs[moved[0]]} for the teacher"
            if moved
            else f"{only[0]!r} is in one vocabulary only"
        )
        raise UsageError(
            f"--teacher-model {path}: its tokenizer differs from the student's ({len(moved)} tokens with other ids, "
            f"{len(only)} in one vocabulary only; {example}); distillation compares the two models token by token, "
            f"so give a teacher of the student's family"
        )


def start_teacher(teacher: TeacherArgs, policy, data, rollout, actor, placement, dist, tokenizer):
    """distill.py's teacher (--teacher-model), as the teacher group's --teacher-engine and --teacher-placement ask:
    hf colocated is the model itself (common.model.load_frozen with the policy group's dtype and layout: forward
    passes in the trainer, sharded under FSDP2); the others are engines that serve its logprobs of the sampled
    tokens (engine_logprobs), holding its weights as they are: a VLLMEngine in this process (vLLM's prompt
    logprobs, the rollout group's vLLM knobs at the teacher's memory share, room for a prompt of the data group's
    --max-prompt-length, a response and the one token vLLM generates), or common.serving.remote.RemoteEngines, HF
    or vLLM engines in Ray actors (the placement group's Ray and timeout; the actor group's micro-batch a forward)."""
    path = teacher.teacher_model
    if teacher.teacher_placement == "colocated" and teacher.teacher_engine == "hf":
        return load_frozen(path, dist, policy)
    vllm = dataclasses.replace(rollout.vllm, gpu_memory_utilization=teacher.teacher_gpu_memory_utilization)
    max_model_len = data.max_prompt_length + rollout.max_response_length + 1
    common = dict(dtype=policy.dtype, trust_remote_code=policy.trust_remote_code)
    if teacher.teacher_placement == "colocated":
        from common.serving.vllm_engine import VLLMEngine

        eos = [tokenizer.eos_token_id]
        return VLLMEngine(
            None,
            model_path=path,
            eos_ids=eos,
            dist=dist,
            vllm=vllm,
            max_model_len=max_model_len,
            seed=dist.seed,
            **common,
        )
    from common.serving.remote import RemoteEngines

    rollout_cpus = placement.num_rollout_engines * placement.engine_num_cpus if placement.remote else 0
    return RemoteEngines(
        None,
        dist,
        0,
        model_path=path,
        pad_id=tokenizer.pad_token_id,
        eos_ids=[tokenizer.eos_token_id],
        vllm=dict(vllm=vllm, max_model_len=max_model_len, seed=dist.seed) if teacher.teacher_engine == "vllm" else None,
        role="teacher engine",
        num_engines=teacher.teacher_num_engines,
        engine_num_cpus=teacher.teacher_engine_num_cpus,
        engine_num_gpus=teacher.teacher_engine_num_gpus,
        ray_address=placement.ray_address,
        max_staleness=0,
        timeout=placement.engine_timeout,
        seed=dist.seed,
        batch_size=actor.micro_batch_size_per_gpu,
        ray_num_cpus=math.ceil(teacher.teacher_num_engines * teacher.teacher_engine_num_cpus + rollout_cpus),
        **common,
    )
