"""A worker: rank 1..N-1 of the group whose rank 0 is the daemon (the driver).

With N = P x T ranks a worker is pipeline stage `rank // T` and tensor-parallel rank `rank % T`
(engine/worker/parallel.py): it holds its stage's layers (engine/worker/pipeline_stage.py) and
1/T of their weights and of every KV block (its KV heads). It never schedules:
after joining the group it receives the `EngineConfig` from the driver, builds its
`ModelRunner`, then obeys the driver's messages, one `(method, args)` pair at a time, in the
same order as the driver runs them itself (see `run_method`). A step comes without its block
tables: the worker keeps its own copy, updated from each step's changes (`PersistentBatch`).

Started two ways:
- by the daemon, on the same machine (`MultiProcessExecutor`, torch.multiprocessing);
- by hand or by a cluster launcher on another machine, joining through torch.distributed's
  env:// rendezvous:

      MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 WORLD_SIZE=4 RANK=2 LOCAL_RANK=0 python -m engine.worker.tp_worker

  (docs/tensor_parallel.md). The model must be at the same path on every machine.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from engine.worker import parallel

logger = logging.getLogger(__name__)

# Messages the driver broadcasts besides runner methods.
PING = "ping"  # keep-alive while the engine is idle (collectives time out otherwise)
STOP = "stop"  # leave the loop and exit


def run_method(runner, method: str, args: tuple, group) -> object:
    """Run one driver message on this rank (the driver calls it too, after broadcasting)."""
    if method == "num_blocks":  # every rank must fit the same pool: take the smallest
        return tuple(parallel.min_over_ranks(list(runner.num_blocks(*args)), group))
    if method in ("init_cache", "execute"):
        return getattr(runner, method)(*args)
    raise ValueError(f"unknown worker method {method!r}")


def model_fingerprint(model_config) -> tuple:
    """What every rank must agree on about the model it loads: its name, shape and, unless its
    weights are dummy, the sizes of the files at its path on this machine."""
    hf = model_config.hf_config
    files: list[tuple[str, int]] = []
    if model_config.load_format != "dummy":
        path = Path(model_config.path)
        found = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
        files = [(f.name, f.stat().st_size) for f in found]
    return (model_config.served_model_name, hf.num_hidden_layers, hf.hidden_size, hf.vocab_size, tuple(files))


def check_same_model(config, group) -> None:
    """Raise RuntimeError on every rank unless all ranks see the same model files (a different
    checkpoint at the same path on another machine), before any of them loads weights."""
    # NOTE: the ranks arrive here only once they have unpickled the config (importing transformers
    # on the way), which may take longer than one collective's timeout: meet first, then gather.
    parallel.wait_for_all(group, parallel.start_timeout_s())
    mine = model_fingerprint(config.model)
    everyone = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise RuntimeError(
            f"rank(s) {', '.join(map(str, differ))} disagree with rank 0 on the model at {config.model.path}: "
            f"rank 0 has {everyone[0]}, rank {differ[0]} {everyone[differ[0]]}; every machine needs the same files"
        )


def rank_device(config_device: torch.device, local_rank: int) -> torch.device:
    """CUDA ranks on one machine take one GPU each; CPU ranks share the CPU."""
    return torch.device("cuda", local_rank) if config_device.type == "cuda" else config_device


def set_cpu_threads(device: torch.device, ranks_on_this_machine: int) -> None:
    """On CPU, share the cores among the ranks unless OMP_NUM_THREADS says otherwise."""
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_on_this_machine))


def run_worker(rank: int, world_size: int, init_method: str, device_type: str, local_rank: int,
               local_world_size: int) -> None:
    """Join the group, build this rank's shard, serve the driver until STOP. Raises on any
    failure (the process then exits non-zero and the driver reports the worker dead)."""
    from engine.worker.model_runner import ModelRunner
    from engine.worker.persistent_batch import PersistentBatch

    device = rank_device(torch.device(device_type), local_rank)
    set_cpu_threads(device, local_world_size)
    group = parallel.init(rank, world_size, init_method, device)
    try:
        config = parallel.broadcast_object(None, group)
        if config.device.type != device.type:
            raise RuntimeError(
                f"the driver runs on {config.device.type} but this worker on {device.type}: "
                "set PAGED_SERVE_DEVICE on the worker to match"
            )
        check_same_model(config, group)
        parallel.init_grid(config.pipeline_parallel_size, config.tensor_parallel_size)
        logger.info("worker %d/%d on %s (pipeline stage %d, tensor-parallel rank %d)", rank, world_size, device,
                    parallel.stage(), parallel.rank())
        runner = ModelRunner(config.model, device, config.cache.block_size, config.pipeline_micro_batches)
        batch = PersistentBatch()
        parallel.wait_for_all(group, parallel.start_timeout_s())
        while True:
            method, args = parallel.broadcast_object(None, group)
            if method == STOP:
                break
            if method == "execute":
                args = (batch.restore(args[0]),)
            if method != PING:
                run_method(runner, method, args, group)
    finally:
        del group
        parallel.destroy()


def spawned_main(rank: int, world_size: int, init_method: str, device_type: str, local_world_size: int,
                 log_level: int = logging.INFO) -> None:
    """Entry point of a worker process that the daemon (local rank 0) started on its machine;
    it logs at the daemon's level."""
    _setup_logging(log_level)
    try:
        run_worker(rank, world_size, init_method, device_type, local_rank=rank, local_world_size=local_world_size)
    except BaseException:
        logger.exception("tensor-parallel worker %d failed", rank)
        sys.exit(1)


def _setup_logging(level: int | str | None = None) -> None:
    logging.basicConfig(level=level or os.environ.get("PAGED_SERVE_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s [tp-worker pid {os.getpid()}] %(name)s: %(message)s")


def main() -> None:
    """`python -m engine.worker.tp_worker`: join a daemon's group through env:// (MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE, RANK; LOCAL_RANK picks the GPU; LOCAL_WORLD_SIZE shares CPUs)."""
    _setup_logging()
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if k not in os.environ]
    if missing:
        sys.exit(f"engine.worker.tp_worker: set {', '.join(missing)} (torch.distributed env:// rendezvous)")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < world_size:
        sys.exit(f"engine.worker.tp_worker: RANK must be in 1..{world_size - 1} (rank 0 is the daemon), got {rank}")
    device_type = os.environ.get("PAGED_SERVE_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        run_worker(rank, world_size, "env://", device_type, int(os.environ.get("LOCAL_RANK", 0)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    except BaseException:
        logger.exception("tensor-parallel worker %d failed", rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
