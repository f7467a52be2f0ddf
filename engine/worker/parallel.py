"""The ranks' grid: world size 1 unless torch.distributed was initialised by the multi-process
executor (engine/worker/executor.py) or a worker (engine/worker/tp_worker.py). Layers ask here
instead of reading globals of their own.

The P x T ranks form a grid (`init_grid`): pipeline stage `rank // T`, tensor-parallel rank
`rank % T`. `world_size()` and `rank()` are the *tensor-parallel* group's (what a layer shards
by); `pipeline_size()` and `stage()` the pipeline's. Without pipeline parallelism the
tensor-parallel group is the whole world.

Groups once initialised: the default group (NCCL on CUDA, gloo on CPU) carries the stages'
point-to-point activations; one tensor-parallel group per stage (the default group itself when
P = 1) the layers' all-reduces and all-gathers; a gloo "control" group the driver's small
pickled messages (step inputs), so that they never touch the GPU.
"""

from __future__ import annotations

import datetime
import gc
import os

from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0  # one collective waits at most this long
DEFAULT_START_TIMEOUT_S = 600.0  # all ranks have met, and loaded their shards, within this long



@dataclass(frozen=True)
class Grid:
    """This rank's place in the P x T grid."""

    pipeline_size: int
    tensor_size: int
    stage: int
    tp_rank: int
    tp_group: object  # the stage's tensor-parallel group (None: the default group)

    def global_rank(self, stage: int) -> int:
        """The rank of this rank's tensor-parallel peer in `stage`."""
        return stage * self.tensor_size + self.tp_rank


_grid: Grid | None = None  # set by init_grid(); None: no pipeline, TP group = world


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The tensor-parallel group's size (what the layers shard by)."""
    if _grid is not None:
        return _grid.tensor_size
    return dist.get_world_size() if _initialized() else 1


def rank() -> int:
    """This rank's index in its tensor-parallel group."""
    if _grid is not None:
        return _grid.tp_rank
    return dist.get_rank() if _initialized() else 0


def pipeline_size() -> int:
    return _grid.pipeline_size if _grid is not None else 1


def stage() -> int:
    return _grid.stage if _grid is not None else 0


def all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t, group=_grid.tp_group if _grid is not None else None)


def all_gather_last_dim(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t.contiguous(), group=_grid.tp_group if _grid is not None else None)
    return torch.cat(parts, dim=-1)


def init_grid(pipeline_size: int, tensor_size: int) -> None:
    """Arrange the ranks in `pipeline_size` stages of `tensor_size` ranks. Every rank calls it,
    after init() and before building its model (new_group is collective). Raises RuntimeError
    when the world does not hold P x T ranks."""
    global _grid
    world, me = dist.get_world_size(), dist.get_rank()
    if world != pipeline_size * tensor_size:
        raise RuntimeError(f"{world} ranks joined, but pipeline_parallel_size={pipeline_size} x "
                           f"tensor_parallel_size={tensor_size} needs {pipeline_size * tensor_size}: "
                           "set WORLD_SIZE to their product on every machine")
    if pipeline_size == 1:
        return  # NOTE: the TP group stays the default group, as before pipelines existed
    tp_group = None
    for s in range(pipeline_size):
        # NOTE: every rank creates every stage's group, in the same order (new_group's contract)
        g = dist.new_group(list(range(s * tensor_size, (s + 1) * tensor_size)))
        if s == me // tensor_size:
            tp_group = g
    _grid = Grid(pipeline_size, tensor_size, me // tensor_size, me % tensor_size, tp_group)


def send_to_stage(t: torch.Tensor, stage_: int):
    """Start sending `t` to this rank's peer in `stage_`; returns the work to wait() on."""
    return dist.isend(t.contiguous(), dst=_grid.global_rank(stage_))


def recv_from_stage(t: torch.Tensor, stage_: int) -> torch.Tensor:
    """Fill `t` from this rank's peer in `stage_` (blocks; the collective timeout applies)."""
    dist.recv(t, src=_grid.global_rank(stage_))
    return t


def timeout_s() -> float:
    """Seconds before a stuck collective fails: $PAGED_SERVE_TP_TIMEOUT or the default."""
    return float(os.environ.get("PAGED_SERVE_TP_TIMEOUT", DEFAULT_TIMEOUT_S))


def start_timeout_s() -> float:
    """Seconds for all ranks to load their shards: $PAGED_SERVE_TP_START_TIMEOUT or the default."""
    return float(os.environ.get("PAGED_SERVE_TP_START_TIMEOUT", DEFAULT_START_TIMEOUT_S))


def wait_for_all(group: dist.ProcessGroup, timeout: float) -> None:
    """A barrier with its own timeout (loading a shard may take longer than one collective);
    on rank 0 a failure names the ranks that did not arrive."""
    dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(rank: int, world_size: int, init_method: str, device: torch.device) -> dist.ProcessGroup:
    """Join the tensor-parallel group (blocks until all `world_size` ranks have joined, at most
    `start_timeout_s()`); returns the gloo control group."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    timeout = datetime.timedelta(seconds=timeout_s())
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(device)
    # NOTE: our own store, so that meeting (workers still starting up) may take the start-up
    # limit while every collective afterwards keeps the short one.
    host, port = _address(init_method)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, wait_for_workers=True,
                          timeout=datetime.timedelta(seconds=start_timeout_s()))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    del store  # NOTE: the group alone holds it now, so destroy() can release it (see there)
    if backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def _address(init_method: str) -> tuple[str, int]:
    """(host, port) of the rendezvous: "tcp://host:port", or "env://" (MASTER_ADDR, MASTER_PORT)."""
    if init_method == "env://":
        return os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", 29500))
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


def destroy() -> None:
    """Leave the group and release it now. Callers drop their own references to the groups
    that init() returned before calling this."""
    global _grid
    _grid = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # NOTE: a process group that outlives destroy_process_group() keeps its TCPStore (and that
    # store's threads) until interpreter exit, where tearing it down aborted about one exit in
    # two ("terminate called without an active exception", SIGABRT; a bare two-rank gloo script
    # shows it, torch 2.13). Collecting the last references here, while the interpreter is
    # whole, leaves nothing for exit to destroy.
    gc.collect()


def broadcast_object(obj: object, group: dist.ProcessGroup, src: int = 0) -> object:
    """Rank `src` sends `obj` (picklable) to every rank of `group`; each rank returns it."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def min_over_ranks(values: list[int], group: dist.ProcessGroup) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return t.tolist()


def check_divides(hf_config, tp_size: int) -> None:
    """Raise ValueError unless `tp_size` ranks can split the model's heads and MLP evenly."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    # a mixture of experts shards each expert's intermediate dimension too (moe.py)
    expert_inter = getattr(hf_config, "moe_intermediate_size", None) or inter
    if tp_size == 1:
        return
    if kv_heads % tp_size or heads % tp_size or inter % tp_size or expert_inter % tp_size:
        ok = [n for n in range(1, kv_heads + 1)
              if kv_heads % n == 0 and heads % n == 0 and inter % n == 0 and expert_inter % n == 0]
        experts = f", expert intermediate size {expert_inter}" if expert_inter != inter else ""
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide this model's {kv_heads} KV heads "
            f"({heads} attention heads, intermediate size {inter}{experts}): each rank must hold whole KV "
            f"heads. Valid sizes for this model: {', '.join(map(str, ok))}."
        )


def stage_layers(num_layers: int, pipeline_size: int, stage_: int) -> range:
    """The decoder layers of `stage_`: contiguous, as even as they go, the remainder on the last
    stages (the first also holds the embedding and the LM head)."""
    base, extra = divmod(num_layers, pipeline_size)
    start = stage_ * base + max(0, stage_ - (pipeline_size - extra))
    return range(start, start + base + (stage_ >= pipeline_size - extra))


def check_stages(hf_config, pipeline_size: int) -> None:
    """Raise ValueError unless every one of `pipeline_size` stages gets at least one layer."""
    layers = hf_config.num_hidden_layers
    if pipeline_size < 1:
        raise ValueError("pipeline_parallel_size must be at least 1")
    if pipeline_size > layers:
        raise ValueError(f"pipeline_parallel_size={pipeline_size} leaves a stage without a decoder layer: "
                         f"this model has {layers}. Valid sizes for this model: 1..{layers}.")
