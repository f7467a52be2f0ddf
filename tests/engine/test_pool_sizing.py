"""The default sizes of the KV and swap pools (engine/worker/pool_sizing.py): the rule as a pure
function over table cases, the machine's memory as read from /proc and the cgroup tree (fake
ones here), and an engine started without the flags getting its pools from the rule."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.worker.pool_sizing import HEADROOM, MemoryReading, read_memory, size_pools

GiB, MiB = 1024**3, 1024**2
# SmolLM2-135M in bf16: 2 x 30 layers x 3 KV heads x 64 x 16 tokens x 2 bytes
SMOLLM2_BF16 = 2 * 30 * 3 * 64 * 16 * 2
# Llama-3-8B in bf16: 2 x 32 x 8 x 128 x 16 x 2 = 2 MiB a block, 1 GiB for 8,192 tokens
LLAMA8B_BF16 = 2 * 32 * 8 * 128 * 16 * 2


def sizes(per_block, max_model_len, max_num_seqs, available, **kw):
    return size_pools(bytes_per_block=per_block, block_size=16, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, available=available, memory="test", **kw)


# (case, per block, max_model_len, max_num_seqs, available, flags, KV blocks, swap blocks)
CASES = [
    # a few streams of a small model on a large machine: exactly what they can hold, whatever is free
    ("small model, large machine", SMOLLM2_BF16, 4096, 4, 24 * GiB, {}, 4 * 256, 256),
    # the defaults (64 x 8,192) on the same machine: a quarter of the spare memory, not 11.25 GiB
    ("small model, defaults", SMOLLM2_BF16, 8192, 64, 24 * GiB, {},
     int(0.25 * (24 * GiB - HEADROOM)) // SMOLLM2_BF16, int(0.25 * (int(0.25 * (24 * GiB - HEADROOM)) // SMOLLM2_BF16) * SMOLLM2_BF16) // SMOLLM2_BF16),
    # a big model with 6 GiB left: a quarter of 5.5 GiB (704 blocks = 1.375 GiB); swap: one
    # sequence (1 GiB, more than a quarter of the KV pool), under a quarter of the 4.125 GiB left
    ("big model, small machine", LLAMA8B_BF16, 8192, 64, 6 * GiB, {}, 704, 512),
    # 3 GiB left: a quarter is less than one 8,192-token sequence, which still fits: raised to it
    # (swap: one sequence would be 1 GiB, but a quarter of the 1.5 GiB spare left is 384 MiB)
    ("big model, one sequence", LLAMA8B_BF16, 8192, 64, 3 * GiB, {}, 512, 192),
    # flags win, even beyond what the rule would give
    ("both flags", LLAMA8B_BF16, 8192, 64, 3 * GiB, {"kv_cache_memory": 4 * GiB, "swap_space": 0}, 2048, 0),
    # a small given KV pool: its quarter (182 blocks) holds less than one sequence (256 blocks)
    ("KV flag, swap by the rule", SMOLLM2_BF16, 4096, 4, 24 * GiB, {"kv_cache_memory": 256 * MiB}, 728, 256),
    ("swap flag, KV by the rule", SMOLLM2_BF16, 4096, 4, 24 * GiB, {"swap_space": GiB}, 1024, 2912),
    ("recompute: no swap pool", SMOLLM2_BF16, 4096, 4, 24 * GiB, {"swap": False}, 1024, 0),
    # three tensor-parallel ranks on one machine share its spare memory
    # (swap: one 512 MiB sequence, capped at a quarter of the 1.5 GiB left: 384 MiB)
    ("3 ranks", LLAMA8B_BF16 // 2, 8192, 64, 6 * GiB + HEADROOM, {"ranks": 3}, 512, 384),
]


@pytest.mark.parametrize("case, per_block, max_len, seqs, available, flags, kv, swap", CASES, ids=[c[0] for c in CASES])
def test_the_rule(case, per_block, max_len, seqs, available, flags, kv, swap):
    got = sizes(per_block, max_len, seqs, available, **flags)
    assert (got.kv_blocks, got.swap_blocks) == (kv, swap), got.why
    assert got.kv_bytes == kv * per_block and got.swap_bytes == swap * per_block


def test_the_reason_gives_the_rule_and_its_inputs():
    why = sizes(SMOLLM2_BF16, 8192, 64, 24 * GiB).why
    assert "min(64 sequences x 8192 tokens = 11.25 GiB, 25% of 23.50 GiB spare (test, less 512 MiB headroom))" in why
    assert "swap pool" in why and "max(25% of the KV pool, one sequence)" in why
    assert "from --kv-cache-memory" in sizes(SMOLLM2_BF16, 8192, 64, 24 * GiB, kv_cache_memory=GiB).why


def test_too_little_memory_for_one_sequence_fails_clearly():
    with pytest.raises(ValueError) as e:
        sizes(LLAMA8B_BF16, 8192, 64, GiB + 256 * MiB)
    message = str(e.value)
    assert "one sequence of max_model_len=8192 tokens needs 1.00 GiB" in message
    assert "768 MiB this machine has to spare" in message and "--max-model-len" in message
    # the same machine serves shorter sequences, and a given size is taken as given
    assert sizes(LLAMA8B_BF16, 1024, 64, GiB + 256 * MiB).kv_blocks == int(0.25 * 768 * MiB) // LLAMA8B_BF16
    assert sizes(LLAMA8B_BF16, 8192, 64, GiB, kv_cache_memory=2 * GiB).kv_blocks == 1024


def test_a_cgroup_limit_tighter_than_the_machine_bounds_the_pools():
    reading = MemoryReading(mem_available=24 * GiB, cgroup_room=2 * GiB, cgroup_path="/docker/x")
    assert reading.available == 2 * GiB and "cgroup /docker/x room 2.00 GiB" in reading.describe()
    got = sizes(SMOLLM2_BF16, 8192, 64, reading.available)
    assert got.kv_bytes <= 0.25 * (2 * GiB - HEADROOM) < got.kv_bytes + SMOLLM2_BF16
    assert MemoryReading(mem_available=GiB, cgroup_room=4 * GiB).available == GiB
    assert MemoryReading(None).available == 0


def fake_machine(tmp_path, own: str, limits: dict[str, tuple[str, int, int]], mem_available_kb: int = 24 * 1024**2):
    """A /proc (meminfo, self/cgroup) and a cgroup v2 tree: limits[path] = (memory.max,
    memory.current, inactive_file)."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 25000000 kB\nMemFree: 1000 kB\nMemAvailable: {mem_available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(f"0::{own}\n")
    for path, (limit, current, inactive) in limits.items():
        d = root / path.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{current}\n")
        (d / "memory.stat").write_text(f"anon 123\nfile 456\ninactive_file {inactive}\nactive_file 7\n")
    return proc, root


def test_read_memory_takes_the_tightest_cgroup_up_the_tree_counting_droppable_page_cache_as_room(tmp_path):
    proc, root = fake_machine(tmp_path, "/a/b", {
        "/": ("max", 10 * GiB, 0),
        "/a": (str(4 * GiB), 3 * GiB, GiB),  # 4 GiB limit, 3 GiB used of which 1 GiB drops: 2 GiB room
        "/a/b": ("max", 3 * GiB, GiB),
    })
    reading = read_memory(proc, root)
    assert reading.mem_available == 24 * GiB and reading.cgroup_room == 2 * GiB and reading.cgroup_path == "/a"
    assert reading.available == 2 * GiB


def test_read_memory_in_a_container_and_without_any_limit(tmp_path):
    # a container with its own cgroup namespace: its cgroup is the root of what it sees
    proc, root = fake_machine(tmp_path / "container", "/", {"/": (str(2 * GiB), GiB, 0)})
    assert read_memory(proc, root).cgroup_room == GiB and read_memory(proc, root).available == GiB
    proc, root = fake_machine(tmp_path / "host", "/user.slice", {"/user.slice": ("max", GiB, 0)}, 8 * 1024**2)
    reading = read_memory(proc, root)
    assert reading.cgroup_room is None and reading.available == 8 * GiB
    assert read_memory(tmp_path / "nowhere", tmp_path / "nothing") == MemoryReading(None, None, "")


def test_an_engine_started_without_the_flags_gets_its_pools_from_the_rule(caplog):
    from engine.loop.engine_args import EngineArgs
    from engine.loop.llm_engine import LLMEngine
    from engine.worker.cache_engine import bytes_per_block

    args = EngineArgs(model="tiny-4kv", load_format="dummy", device="cpu", dtype="float32", linear_kernel="torch",
                      max_model_len=512, max_num_seqs=8, seed=0)
    assert args.kv_cache_memory is None and args.swap_space is None
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_engine_args(args)
    per_block = bytes_per_block(engine.model_config, 16)
    want = size_pools(bytes_per_block=per_block, block_size=16, max_model_len=512, max_num_seqs=8,
                      available=read_memory().available)
    # 8 sequences of 512 tokens (16 MiB in fp32) are far less than a quarter of any test machine's memory
    assert engine.block_manager.device.num_blocks == want.kv_blocks == 8 * 32
    assert engine.block_manager.cpu.num_blocks == want.swap_blocks == 8 * 32 // 4
    assert engine.cache.device_kv.dtype == torch.float32
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: weights"))
    assert "KV pool 16 MiB (256 blocks), swap pool 4 MiB (64 blocks)" in line and "MemAvailable" in line
    assert "swap blocks (0.00 GiB)" in caplog.text  # the engine's summary gives both pools' bytes

    recompute = LLMEngine.from_engine_args(EngineArgs(**{**args.__dict__, "preemption_mode": "recompute"}))
    assert recompute.block_manager.cpu.num_blocks == 0
    given = LLMEngine.from_engine_args(EngineArgs(**{**args.__dict__, "kv_cache_memory": "8MiB", "swap_space": 0.004}))
    assert given.block_manager.device.num_blocks == 8 * MiB // per_block
    assert given.block_manager.cpu.num_blocks == int(0.004 * GiB) // per_block
