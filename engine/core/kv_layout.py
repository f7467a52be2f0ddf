"""`KvLayout`: how a model's layers share the KV pool, computed once from the layers' sliding
windows (vLLM v1's hybrid KV cache groups, adapted).

Layers with the same window (None: full attention) form groups of `slots` layers each; every
group has its own block table per sequence, and a block of the one shared pool holds K/V for
`slots` layers, so every group's blocks are the same size in bytes. A windowed group's blocks that
fall wholly out of its window are given back to the pool (engine/kv/block_manager.py), which is
where a hybrid model (Gemma 2/3: a few full layers, many windowed ones) saves memory: at 8k
context a window of 512 keeps ~33 of 512 blocks of 16 tokens per windowed group.

- No window anywhere: ONE group of all layers, window None: today's layout, block for block.
- The same window on every layer (Mistral): one group with that window.
- A hybrid: the full group(s) first (group 0, the one the prefix cache hashes and the
  attention metadata's default table), then the windowed ones. `slots` is the smallest layer
  count of a window; the last group of a window with more layers is padded (its unused slots
  are memory that holds nothing: Gemma-3's 4 full + 22 windowed layers take 7 groups of 4,
  28 slots for 26 layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KvGroup:
    window: int | None  # tokens a query sees (HF's sliding_window), None: the whole context
    layers: tuple[int, ...]  # the model layers in its slots, in slot order (at most `slots`)


@dataclass(frozen=True)
class KvLayout:
    groups: tuple[KvGroup, ...]
    slots: int  # layers per group: the K/V of one block are [2, slots, kv_heads, block_size, head_size]

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window, in group order (what the block manager takes)."""
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of model layer `layer`."""
        for k, g in enumerate(self.groups):
            if layer in g.layers:
                return k, g.layers.index(layer)
        raise KeyError(layer)


def kv_layout(windows: Sequence[int | None], free_windows: bool = True) -> KvLayout:
    """The layout of a model whose layer i has window `windows[i]`. `free_windows=False`: one
    group of all layers with no window, the layout that keeps every layer's blocks (the
    baseline, and an engine that does not free windowed blocks)."""
    if not free_windows or all(w is None for w in windows) or len(set(windows)) == 1:
        window = windows[0] if free_windows and windows else None
        return KvLayout((KvGroup(window, tuple(range(len(windows)))),), len(windows))
    by_window: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        by_window.setdefault(w, []).append(i)
    # NOTE: full attention first, then windows from the smallest: group 0 is a full group.
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    slots = min(len(v) for v in by_window.values())
    groups = tuple(KvGroup(w, tuple(by_window[w][a:a + slots]))
                   for w in order for a in range(0, len(by_window[w]), slots))
    return KvLayout(groups, slots)


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first block of a sequence's table that a future query can still see once
    `num_computed` tokens are computed (0 without a window): the next query is at position
    >= num_computed and sees keys > its position - window, so blocks before this one are dead.
    NOTE: the same rule as engine/worker/window_attention.first_block (tested equal), which
    decides the first block the attention reads: it never reads a block given back here."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size
