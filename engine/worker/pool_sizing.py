"""How big the KV pool and the CPU swap pool are when `--kv-cache-memory` / `--swap-space` do
not say: from the model and the machine, never a fixed size.

The rule (`size_pools`, a pure function of its inputs; `read_memory` reads the machine):

* one sequence = the blocks of `max_model_len` tokens; want = `max_num_seqs` such sequences,
  the most the scheduler can ever hold at once (more would only keep prefix-cache entries);
* spare = the memory available once the weights are loaded (MemAvailable, or the cgroup's room
  under memory.max when that is less: containers), less `HEADROOM`, shared by the ranks;
* KV pool = min(want, `KV_SHARE` x spare), but at least one sequence (the scheduler's liveness
  rests on it) when that fits in spare; start-up fails with what is missing when it does not;
* swap pool = the larger of `SWAP_RATIO` x the KV pool and one sequence, but at most
  `KV_SHARE` x what spare leaves after the KV pool; none under `--preemption-mode recompute`,
  which never swaps.

A size given by its flag is used as given (the KV pool still must hold one sequence: the engine
checks that), and the other pool follows the rule around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3
MiB = 1024**2
# NOTE: what the process still needs besides its pools: activations (a 256-token prefill chunk
# or 64 decode rows through the MLP and the LM head: tens of MB for SmolLM2, ~0.2 GB for an 8B
# model), the server, the tokenizer, the compiled ops. The same 512 MiB the GPU budget keeps.
HEADROOM = 512 * MiB
# NOTE: the KV pool takes at most a quarter of the spare memory, so that a default start leaves
# most of the machine to the page cache, the process's own growth and other processes (a second
# replica started after it takes a quarter of what the first left); a dedicated server that
# wants more says so with --kv-cache-memory.
KV_SHARE = 0.25
# NOTE: on a CPU both pools are the same RAM, and a byte of swap pool serves only a preempted
# request while a byte of KV pool would have avoided the preemption; the swap pool needs only
# the newest requests preempted in a burst, so a quarter of the KV pool, but room for one
# sequence of max_model_len (with less, a long request preempted could not swap: it recomputes).
SWAP_RATIO = 0.25


@dataclass(frozen=True)
class MemoryReading:
    """What the machine has to give, in bytes; None where unknown."""

    mem_available: int | None  # /proc/meminfo MemAvailable
    cgroup_room: int | None = None  # the tightest memory.max - (memory.current - inactive_file) up the cgroup tree
    cgroup_path: str = ""

    @property
    def available(self) -> int:
        known = [v for v in (self.mem_available, self.cgroup_room) if v is not None]
        return max(0, min(known)) if known else 0

    def describe(self) -> str:
        parts = []
        if self.mem_available is not None:
            parts.append(f"MemAvailable {human_bytes(self.mem_available)}")
        if self.cgroup_room is not None:
            parts.append(f"cgroup {self.cgroup_path or '/'} room {human_bytes(self.cgroup_room)}")
        return ", ".join(parts) or "memory unknown"


@dataclass(frozen=True)
class PoolSizes:
    """The pools' sizes in blocks, and how they were reached (for the start-up log)."""

    kv_blocks: int
    swap_blocks: int
    bytes_per_block: int
    why: str

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.bytes_per_block

    @property
    def swap_bytes(self) -> int:
        return self.swap_blocks * self.bytes_per_block


def size_pools(*, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
               available: int, kv_cache_memory: int | None = None, swap_space: int | None = None,
               swap: bool = True, ranks: int = 1, memory: str = "", kv_from: str = "--kv-cache-memory",
               swap_from: str = "--swap-space", tables_per_seq: int = 1) -> PoolSizes:
    """The KV and swap pools' blocks by the module's rule. `available`: bytes free after the
    weights (`MemoryReading.available`); `kv_cache_memory` / `swap_space`: the flags' bytes
    (None: the rule); `swap`: whether preemption may swap; `ranks`: processes sharing this
    machine's memory, each with `bytes_per_block` of its own KV heads; `memory` describes
    `available`, `kv_from` / `swap_from` where given sizes came from, in the reason;
    `tables_per_seq`: KV layer groups, each a table of blocks per sequence (engine/core/kv_layout.py).
    Raises ValueError when the rule cannot give one sequence."""
    per_seq_blocks = tables_per_seq * -(-max_model_len // block_size)
    per_seq = per_seq_blocks * bytes_per_block
    want = max_num_seqs * per_seq
    spare = max(0, available - HEADROOM) // max(ranks, 1)
    if ranks > 1:
        spare_txt = f"{human_bytes(spare)} spare per rank ({memory}, less {human_bytes(HEADROOM)} headroom, / {ranks} ranks)"
    else:
        spare_txt = f"{human_bytes(spare)} spare ({memory}, less {human_bytes(HEADROOM)} headroom)"
    if kv_cache_memory is not None:
        kv_blocks = kv_cache_memory // bytes_per_block
        why = f"KV pool {human_bytes(kv_blocks * bytes_per_block)} from {kv_from}"
    else:
        cap_blocks = int(KV_SHARE * spare) // bytes_per_block
        kv_blocks = min(max_num_seqs * per_seq_blocks, cap_blocks)
        why = (f"KV pool {human_bytes(kv_blocks * bytes_per_block)} = min({max_num_seqs} sequences x {max_model_len} tokens = "
               f"{human_bytes(want)}, {KV_SHARE:.0%} of {spare_txt})")
        if kv_blocks < per_seq_blocks:
            if per_seq > spare:
                raise ValueError(
                    f"the KV cache for one sequence of max_model_len={max_model_len} tokens needs {human_bytes(per_seq)}, "
                    f"more than the {human_bytes(spare)} this machine has to spare once the weights are loaded "
                    f"({memory}, less {human_bytes(HEADROOM)} headroom"
                    + (f", / {ranks} ranks" if ranks > 1 else "")
                    + "): lower --max-model-len, or free memory, or set --kv-cache-memory to try anyway")
            kv_blocks = per_seq_blocks
            why += f", raised to one sequence of max_model_len ({human_bytes(per_seq)})"
    kv_bytes = kv_blocks * bytes_per_block
    if swap_space is not None:
        swap_blocks = swap_space // bytes_per_block
        why += f"; swap pool {human_bytes(swap_blocks * bytes_per_block)} from {swap_from}"
    elif not swap:
        swap_blocks = 0
        why += "; no swap pool (--preemption-mode recompute never swaps)"
    else:
        left = max(0, spare - kv_bytes)
        swap_blocks = int(min(max(SWAP_RATIO * kv_bytes, per_seq), KV_SHARE * left)) // bytes_per_block
        why += (f"; swap pool {human_bytes(swap_blocks * bytes_per_block)} = min(max({SWAP_RATIO:.0%} of the KV pool, "
                f"one sequence), {KV_SHARE:.0%} of the {human_bytes(left)} spare left)")
    return PoolSizes(kv_blocks, swap_blocks, bytes_per_block, why)


def read_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> MemoryReading:
    """MemAvailable, and the room left under the tightest cgroup v2 memory.max from this
    process's cgroup up to the root (page cache it could drop, inactive_file, counts as room)."""
    return MemoryReading(_meminfo_available(proc), *_cgroup_room(proc, cgroup_root))


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(proc: Path, root: Path) -> tuple[int | None, str]:
    """(room, cgroup path) of the tightest limited cgroup holding this process; (None, "")
    without a limit (or cgroup v2)."""
    own = "/"
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = line[3:] or "/"
    except OSError:
        pass
    best: tuple[int | None, str] = (None, "")
    rel = Path(own.lstrip("/"))
    # NOTE: a container with its own cgroup namespace sees its cgroup as / (at `root`); on a host
    # the process's path is below it. Every level's limit applies, so each is read.
    for level in [rel, *rel.parents]:
        room = _room(root / level)
        if room is not None and (best[0] is None or room < best[0]):
            best = (room, "/" + ("" if str(level) == "." else str(level)))
    return best


def _room(cgroup: Path) -> int | None:
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        usage = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    inactive_file = 0
    try:
        for line in (cgroup / "memory.stat").read_text().splitlines():
            if line.startswith("inactive_file "):
                inactive_file = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return int(limit) - max(0, usage - inactive_file)


def human_bytes(n: float) -> str:
    if not math.isfinite(n):
        return str(n)
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"
