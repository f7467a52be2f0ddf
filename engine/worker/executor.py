"""Executors run each step's `StepInput` on the model, on one process or on N.

- `LocalExecutor` (tensor_parallel_size and pipeline_parallel_size 1): the `ModelRunner` lives
  in this process.
- `MultiProcessExecutor` (N = P x T > 1 ranks): this process is the driver, rank 0 of a
  torch.distributed group (pipeline stage 0, tensor-parallel rank 0), and computes its own
  shard; ranks 1..N-1 are workers
  (engine/worker/tp_worker.py), started here with torch.multiprocessing or joining from other machines
  through the env:// rendezvous. Each call is broadcast to the workers as a small pickled
  message on a gloo group, then run by every rank; the layers' collectives and the pipeline
  stages' sends (engine/worker/pipeline_stage.py) do the rest. A step
  carries no block tables: each worker keeps its own copy and the step brings what changed
  (engine/worker/persistent_batch.py), so its size does not grow with the context.

Failure model: a dead worker is fatal. Locally started workers are watched before every step
and once a second while idle; any collective that fails or times out (`PAGED_SERVE_TP_TIMEOUT`,
default 120 s) also marks the executor failed. Then the other workers are stopped, the group is
left, and every call raises `WorkerDiedError` at once: nothing ever waits again in a collective.
"""

from __future__ import annotations

import abc
import logging
import os
import signal
import socket
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection

from engine.core.config import EngineConfig
from engine.core.step import StepInput, StepOutput
from engine.worker import parallel, persistent_batch, tp_worker as worker
from engine.worker.cache_engine import CacheEngine
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_WATCH_INTERVAL_S = 1.0  # how often the watchdog looks at the worker processes
_JOIN_TIMEOUT_S = 10.0  # how long shutdown waits for a worker before killing it


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the executor cannot go on."""

    fatal = True  # NOTE: tells a caller that retrying the step is pointless

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        # NOTE: what /health may show: written by us, never an exception's own text
        self.public_reason = public if public is not None else message


class Executor(abc.ABC):
    """Runs steps on the model. `weights_bytes` is this rank's share of the weights."""

    weights_bytes: int

    @abc.abstractmethod
    def num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that every rank's budget allows for its KV heads."""

    @abc.abstractmethod
    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        """Allocate the KV pools on every rank; returns the driver's (for its sizes)."""

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every rank; the driver's `StepOutput` (see `ModelRunner.execute`),
        its logits on the driver's device."""

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if the executor cannot run steps any more."""

    def shutdown(self) -> None:
        """Stop the workers (if any); idempotent."""


def create_executor(config: EngineConfig) -> Executor:
    """The executor for `config.tensor_parallel_size` x `config.pipeline_parallel_size`; raises
    ValueError at once when those sizes cannot split the model (before any process is started)."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    parallel.check_divides(config.model.hf_config, tp)
    parallel.check_stages(config.model.hf_config, pp)
    if tp > 1 and config.model.quantized:
        kind = "GGUF weights" if config.model.path.endswith(".gguf") else "weights"
        raise ValueError(f"tensor_parallel_size={tp}: quantized {kind} are not sharded across ranks yet; "
                         "use --quantization none")
    return LocalExecutor(config) if tp * pp == 1 else MultiProcessExecutor(config)


class LocalExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config.model, config.device, config.cache.block_size)
        self.weights_bytes = self.runner.weights_bytes

    def num_blocks(self) -> tuple[int, int]:
        return self.runner.num_blocks(self.config.cache, self.config.scheduler)

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        return self.runner.init_cache(num_device_blocks, num_cpu_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        return self.runner.execute(step)


class MultiProcessExecutor(Executor):
    """Driver of a group of P x T ranks; see the module docstring.

    Where the workers come from: with MASTER_ADDR unset, all N-1 are started here and meet on a
    free loopback port (ranks 1..T-1 are stage 0's other tensor-parallel ranks, T..2T-1 stage 1's...). With MASTER_ADDR/MASTER_PORT set, the group meets there; this process
    starts $PAGED_SERVE_TP_LOCAL_WORKERS of them (default N-1, ranks 1..k) and the others join
    with `python -m engine.worker.tp_worker` (RANK k+1..N-1) from other machines.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.world_size = tp = config.tensor_parallel_size * config.pipeline_parallel_size
        self._lock = threading.Lock()  # one message (and its collectives) at a time
        self._failure: WorkerDiedError | None = None
        self._closed = False
        self._last_sent = time.monotonic()
        self._procs: dict[int, mp.Process] = {}
        # NOTE: table changes of steps not sent (nothing to run): the workers need every change once
        self._unsent_changes: list[tuple] = []

        init_method, local = self._rendezvous()
        device = worker.rank_device(config.device, 0)
        if device.type == "cuda" and torch.cuda.device_count() < local + 1:
            raise ValueError(
                f"{tp} ranks (tensor x pipeline parallel) start {local + 1} on this machine, one GPU each, but it "
                f"has {torch.cuda.device_count()} GPU(s); see docs/tensor_parallel.md for several machines"
            )
        worker.set_cpu_threads(device, local + 1)
        ctx = mp.get_context("spawn")
        for rank in range(1, local + 1):
            p = ctx.Process(
                target=worker.spawned_main,
                args=(rank, tp, init_method, config.device.type, local + 1, logging.getLogger().getEffectiveLevel()),
                name=f"tp-worker-{rank}",
                daemon=True,
            )
            p.start()
            self._procs[rank] = p
        # Exiting without shutdown() still ends the workers.
        self._finalizer = weakref.finalize(self, _stop_processes, list(self._procs.values()))
        t0 = time.perf_counter()
        try:
            self._group = self._join_group(init_method, device)
            parallel.broadcast_object(config, self._group)
            worker.check_same_model(config, self._group)
            parallel.init_grid(config.pipeline_parallel_size, config.tensor_parallel_size)
            self.runner = ModelRunner(config.model, device, config.cache.block_size, config.pipeline_micro_batches)
            parallel.wait_for_all(self._group, parallel.start_timeout_s())  # every rank loaded
        except BaseException as e:
            self._teardown()
            if self._dead_worker() is None and not _is_distributed_error(e):
                raise  # e.g. the model failed to load here: the error says it best
            raise self._explain(e, "while starting") from e
        self.weights_bytes = self.runner.weights_bytes
        kind = ("tensor parallelism:" if config.pipeline_parallel_size == 1 else
                f"pipeline parallelism: {config.pipeline_parallel_size} stages x {config.tensor_parallel_size} "
                "tensor-parallel ranks,")
        logger.info("%s %d ranks (%d started here), %s, ready in %.1f s", kind, tp, local + 1,
                    parallel.backend_for(device), time.perf_counter() - t0)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _rendezvous(self) -> tuple[str, int]:
        """(init method, number of workers to start here)."""
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if addr is None:
            return f"tcp://127.0.0.1:{_free_port()}", self.world_size - 1
        local = int(os.environ.get("PAGED_SERVE_TP_LOCAL_WORKERS", self.world_size - 1))
        if not 0 <= local < self.world_size:
            raise ValueError(f"PAGED_SERVE_TP_LOCAL_WORKERS must be in 0..{self.world_size - 1}, got {local}")
        return f"tcp://{addr}:{port or 29500}", local

    def _join_group(self, init_method: str, device: torch.device):
        """parallel.init() for rank 0, but give up as soon as a worker started here dies
        (a worker that fails on import would otherwise leave us waiting for the timeout)."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        result: dict = {}

        def join() -> None:
            try:
                result["group"] = parallel.init(0, self.world_size, init_method, device)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                result["error"] = e

        t = threading.Thread(target=join, name="tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.2)
            dead = self._dead_worker()
            if dead is not None and t.is_alive():
                # NOTE: the thread stays blocked until the rendezvous times out; it cannot
                # complete without the dead rank, so it never initialises the group.
                raise dead
        if "error" in result:
            raise result["error"]
        return result["group"]

    # ------------------------------------------------------------------ the executor interface
    def num_blocks(self) -> tuple[int, int]:
        return self._call("num_blocks", self.config.cache, self.config.scheduler)

    def init_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> CacheEngine:
        return self._call("init_cache", num_device_blocks, num_cpu_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        if not (step.seqs or step.blocks_to_swap_in or step.blocks_to_swap_out or step.blocks_to_copy):
            self.check_health()
            self._unsent_changes.extend(step.table_changes)
            return StepOutput(torch.empty(0, self.config.model.hf_config.vocab_size))
        sent = persistent_batch.for_workers(step, self._unsent_changes)
        self._unsent_changes = []
        return self._call("execute", step, sent=(sent,))

    def check_health(self) -> None:
        if self._failure is None:
            dead = self._dead_worker()
            if dead is not None:
                self._failure = dead
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerDiedError("the tensor-parallel executor was shut down")

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            clean = self._failure is None and self._dead_worker() is None
            if clean:
                try:  # workers wait for this message, so they leave on their own
                    parallel.broadcast_object((worker.STOP, ()), self._group)
                except Exception:  # noqa: BLE001 - stopping anyway
                    logger.warning("could not tell the tensor-parallel workers to stop", exc_info=True)
                    clean = False
            self._teardown(_JOIN_TIMEOUT_S if clean else 0.0)
        logger.info("tensor-parallel executor shut down")

    def _teardown(self, grace_s: float = 0.0) -> None:
        """End the workers and leave the group (once)."""
        if not self._closed:
            self._closed = True
            self._finalizer.detach()
            _stop_processes(list(self._procs.values()), grace_s)
            self._group = None
            parallel.destroy()

    # ------------------------------------------------------------------ internals
    def _call(self, method: str, *args, sent: tuple | None = None):
        """Run `method(*args)` on every rank; the workers are sent `sent` in place of `args`
        when given (a step without its block tables)."""
        with self._lock:
            try:
                self.check_health()
            except WorkerDiedError:
                self._teardown()  # the watchdog only flagged it
                raise
            try:
                self._last_sent = time.monotonic()
                parallel.broadcast_object((method, args if sent is None else sent), self._group)
                return worker.run_method(self.runner, method, args, self._group)
            except Exception as e:
                # NOTE: whatever failed, the ranks may now disagree on where they are in the
                # message sequence (a worker may wait in a collective the driver left), so the
                # group is unusable: fail now rather than hang in the next step.
                self._failure = self._explain(e, f"during {method}")
                logger.error("%s", self._failure)
                self._teardown()
                raise self._failure from e

    def _watch(self) -> None:
        """Watchdog: notice dead local workers while idle; keep idle workers' waits short of
        the collective timeout with a ping."""
        ping_every = parallel.timeout_s() / 4
        while not self._closed and self._failure is None:
            time.sleep(_WATCH_INTERVAL_S)
            dead = self._dead_worker()
            if dead is not None:
                # NOTE: only flag it: the engine thread may be inside a collective right now,
                # which fails on its own (the peer is gone) and then tears the group down.
                self._failure = dead
                logger.error("%s", dead)
                return
            if time.monotonic() - self._last_sent < ping_every or not self._lock.acquire(blocking=False):
                continue
            try:
                if not self._closed and self._failure is None:
                    self._last_sent = time.monotonic()
                    parallel.broadcast_object((worker.PING, ()), self._group)
            except Exception as e:  # noqa: BLE001
                self._failure = self._explain(e, "while idle")
                logger.error("%s", self._failure)
                self._teardown()
            finally:
                self._lock.release()

    def _dead_worker(self, wait_s: float = 0.0) -> WorkerDiedError | None:
        """The first local worker found dead, waiting up to `wait_s` for one to end."""
        if wait_s and self._procs:
            ended = mp_connection.wait([p.sentinel for p in self._procs.values()], timeout=wait_s)
            for p in self._procs.values():
                if p.sentinel in ended:
                    # NOTE: the sentinel closes while the process exits; join() waits until
                    # it has, so that its exit code is known
                    p.join(1.0)
        for rank, p in self._procs.items():
            if not p.is_alive():
                return WorkerDiedError(
                    f"{self._role(rank)} (pid {p.pid}) {_describe_exit(p.exitcode)}; "
                    "the engine cannot continue without it: restart the server"
                )
        return None

    def _role(self, rank: int) -> str:
        """How the logs name worker `rank`."""
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if pp == 1:
            return f"tensor-parallel worker rank {rank}"
        return f"worker rank {rank} (pipeline stage {rank // tp}" + (f", tensor-parallel rank {rank % tp})" if tp > 1 else ")")

    def _explain(self, e: BaseException, when: str) -> WorkerDiedError:
        # NOTE: a peer's connection may reset a moment before its process is seen to end.
        dead = self._dead_worker(wait_s=1.0 if _is_distributed_error(e) else 0.0)
        if dead is not None:
            return dead
        detail = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if _is_distributed_error(e):
            advice = ("a worker died, hung past PAGED_SERVE_TP_TIMEOUT, or could not join: "
                      "restart the server")
            return WorkerDiedError(f"the tensor-parallel group failed {when} ({detail}); {advice}",
                                   public=f"the tensor-parallel group failed {when}; {advice}")
        advice = "the tensor-parallel workers are out of step with it: restart the server"
        return WorkerDiedError(
            f"rank 0 failed {when} ({detail}) and {advice}",
            public=f"rank 0 failed {when} and {advice}"
        )


def _is_distributed_error(e: BaseException) -> bool:
    """A failed or timed-out collective or rendezvous (gloo raises plain RuntimeErrors)."""
    text = str(e).lower()
    return isinstance(e, torch.distributed.DistError) or any(w in text for w in ("gloo", "nccl", "timed out"))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_processes(procs: list, grace_s: float = 0.0) -> None:
    """Wait up to `grace_s` for the workers to leave, then terminate and kill the stragglers."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
