"""`TableRows`, the device block tables as matrix rows: a seeded random walk of table changes
(create, append, replace, drop) against plain arrays, through growth in rows and in width; the
mirror holds after every change (`check`)."""

from __future__ import annotations

import random
from array import array

import pytest

from engine.core.table_rows import TableRows


@pytest.mark.parametrize("seed", range(5))
def test_rows_mirror_the_tables_through_a_random_walk(seed):
    rng = random.Random(seed)
    rows, tables, next_id = TableRows(num_rows=2, width=2), {}, 0
    for _ in range(600):
        op = rng.random()
        if op < 0.25 or not tables:
            tables[next_id] = array("i", (rng.randrange(1000) for _ in range(rng.randrange(0, 9))))
            rows.assign(next_id, tables[next_id])
            next_id += 1
        elif op < 0.6:  # a block appended
            seq_id = rng.choice(list(tables))
            tables[seq_id].append(rng.randrange(1000))
            rows.set(seq_id, len(tables[seq_id]) - 1, tables[seq_id][-1])
        elif op < 0.75:  # a block replaced (copy-on-write)
            seq_id = rng.choice(list(tables))
            if tables[seq_id]:
                i = rng.randrange(len(tables[seq_id]))
                tables[seq_id][i] = rng.randrange(1000)
                rows.set(seq_id, i, tables[seq_id][i])
        else:
            seq_id = rng.choice(list(tables))
            rows.release(seq_id, len(tables.pop(seq_id)))
        rows.check(tables)
    assert rows.width >= max((len(t) for t in tables.values()), default=0)
    for seq_id in list(tables):
        rows.release(seq_id, len(tables.pop(seq_id)))
    rows.check(tables)
    assert not any(rows.data) and len(rows._free) == rows.num_rows  # every row back, zeroed


def test_check_catches_a_row_out_of_step_with_its_table():
    rows, tables = TableRows(), {7: array("i", [3, 4])}
    rows.assign(7, tables[7])
    tables[7].append(5)  # changed without telling the rows
    with pytest.raises(AssertionError):
        rows.check(tables)
