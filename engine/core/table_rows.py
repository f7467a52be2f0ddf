"""The device block tables mirrored as the rows of one int32 matrix (vLLM V1's persistent
`BlockTable`): the attention metadata selects the decodes' rows with one `index_select` instead
of copying every sequence's table into a new tensor at every step.

Why: the per-step copy touched every block of every decoding sequence's table, each table a
separate heap object, so on a CPU whose caches the forward pass has just flushed it cost a cache
miss per 16 table entries: O(batch x context) host work per step (benchmarks/step_overhead.py).
One matrix is read in a single sequential pass.

The block manager owns it and keeps it equal to `BlockManager.tables` (`check_integrity`
asserts so): a row per sequence holding a device table, its first `len(table)` entries the
table's block ids, zeros past them. It writes a row when a table is created or moved in, one
entry when a table gains or replaces a block, and zeroes the row when the table goes. Growth (more
rows or a wider table) reallocates and copies: amortised O(1) per entry. Pure Python, no tensors.
"""

from __future__ import annotations

from array import array

# NOTE: a C array, not a list: the attention metadata copies every decode's table into one
# tensor at every step, which is a memcpy per table for an array and a Python-int conversion per
# block for a list (~45 ns a block: 1.5 ms a step at 256 sequences of 2,048 tokens).
BlockTable = array

# A table entry whose block was given back to the pool: it fell out of the sliding window of
# every query still to come (engine/core/kv_layout.py, first_live_block). Never read: the attention
# reads a windowed table from its first live block on (engine/worker/window_attention.first_block).
RELEASED = -1


def new_table(ids=()) -> BlockTable:
    """A block table (int32 block ids) holding `ids`."""
    return array("i", ids)


class TableRows:
    def __init__(self, num_rows: int = 16, width: int = 16):
        self.num_rows, self.width = num_rows, width
        # row-major [num_rows, width] int32; replaced (never resized in place) when it grows
        self.data = array("i", bytes(4 * num_rows * width))
        self.row_of: dict[int, int] = {}  # seq_id -> its row
        self._free = list(range(num_rows - 1, -1, -1))
        self.changes: list[tuple] = []  # the writes since `take_changes` (see the module docstring)

    def assign(self, seq_id: int, ids: array) -> None:
        """Give `seq_id` (which has no row) a row holding `ids` (an array('i'), as the tables are)."""
        assert seq_id not in self.row_of
        if not self._free:
            self._reshape(2 * self.num_rows, self.width)
        row = self._free.pop()
        self.row_of[seq_id] = row
        n = len(ids)
        if n > self.width:
            self._reshape(self.num_rows, _grown(self.width, n))
        start = row * self.width
        self.data[start : start + n] = ids
        self.changes.append((seq_id, ids[:]))  # NOTE: a copy: the table may change again before it is sent

    def set(self, seq_id: int, i: int, block_id: int) -> None:
        """Entry `i` of `seq_id`'s row (an append when i is the table's old length)."""
        if i >= self.width:
            self._reshape(self.num_rows, _grown(self.width, i + 1))
        self.data[self.row_of[seq_id] * self.width + i] = block_id
        self.changes.append((seq_id, i, block_id))

    def release(self, seq_id: int, n: int) -> None:
        """`seq_id`'s table (of `n` blocks) is gone: zero its row and free it; a no-op without one."""
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        start = row * self.width
        self.data[start : start + n] = array("i", bytes(4 * n))
        self._free.append(row)
        self.changes.append((seq_id,))

    def take_changes(self) -> list[tuple]:
        """The writes logged since the last call, oldest first; the log starts empty again."""
        changes, self.changes = self.changes, []
        return changes

    def row(self, seq_id: int) -> array:
        """A copy of `seq_id`'s whole row (tests and checks)."""
        start = self.row_of[seq_id] * self.width
        return self.data[start : start + self.width]

    def check(self, tables: dict[int, array]) -> None:
        """Assert the mirror: a row per table, equal to it, zeros past it (and no other rows)."""
        assert self.row_of.keys() == tables.keys(), "a table without its row, or a row without its table"
        assert len(set(self.row_of.values())) == len(self.row_of), "two tables share a row"
        assert not set(self.row_of.values()) & set(self._free), "a row in use is free"
        for seq_id, table in tables.items():
            row = self.row(seq_id)
            assert row[: len(table)] == table and not any(row[len(table) :]), f"the row of {seq_id} != its table"

    def _reshape(self, num_rows: int, width: int) -> None:
        old, old_width = self.data, self.width
        self.data = array("i", bytes(4 * num_rows * width))
        for row in self.row_of.values():
            self.data[row * width : row * width + old_width] = old[row * old_width : (row + 1) * old_width]
        self._free = list(range(num_rows - 1, self.num_rows - 1, -1)) + self._free
        self.num_rows, self.width = num_rows, width

    def __reduce__(self):
        # NOTE: a step sent to tensor-parallel workers carries no matrix (it would copy the whole
        # pool's tables per step); their metadata copies the tables the step carries instead.
        return _absent, ()


def _absent() -> None:
    return None


def _grown(width: int, needed: int) -> int:
    while width < needed:
        width *= 2
    return width
