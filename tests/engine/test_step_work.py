"""Per-step engine work grows with what is new, not with how long a sequence already is: a
2,000-token stream on the tiny dummy model, counting the work (block hashes computed, tokens
reported, block tables copied or held as Python lists), never timing it."""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path

import torch

from engine.core.outputs import OutputKind
from engine.core.sampling_params import SamplingParams
from engine.loop.engine_args import EngineArgs
from engine.loop.llm_engine import LLMEngine

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 2000


def tiny_engine(tmp_path: Path) -> LLMEngine:
    config = json.loads((REPO / "configs/models/tiny-4kv.json").read_text())
    config["max_position_embeddings"] = 4096
    path = tmp_path / "tiny-4kv-4k.json"
    path.write_text(json.dumps(config))
    args = EngineArgs(model=str(path), load_format="dummy", max_model_len=2200, kv_cache_memory="64MiB",
                      enable_prefix_caching=True)
    return LLMEngine(args.create_engine_config())


def test_a_long_stream_costs_the_same_per_step_at_its_end_as_at_its_start(tmp_path):
    engine = tiny_engine(tmp_path)
    bm = engine.block_manager
    prompt = [(7 * k) % 1000 + 3 for k in range(100)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.8, max_tokens=NEW_TOKENS, ignore_eos=True, seed=1),
                       output_kind=OutputKind.DELTA)
    group = engine.requests["long"]
    seq = group.seqs[0]
    hashes, reported, copied_tables, list_tables = [], [], 0, 0
    schedule = engine.scheduler.schedule

    def checked_schedule():
        nonlocal copied_tables, list_tables
        out = schedule()
        copied_tables += sum(s.block_table is not bm.tables[s.seq.seq_id] for s in out.scheduled)
        # C arrays: the attention metadata copies each with one memcpy, not a conversion per block
        list_tables += sum(not (isinstance(s.block_table, array) and s.block_table.typecode == "i")
                           for s in out.scheduled)
        return out

    engine.scheduler.schedule = checked_schedule
    while engine.has_unfinished_requests():
        before = bm.prefix.num_hashes
        outputs = engine.step()
        hashes.append(bm.prefix.num_hashes - before)
        reported.append(sum(len(c.token_ids) for o in outputs for c in o.outputs))
    assert len(seq.output_token_ids) == NEW_TOKENS
    # Every token is reported once, in the step that made it: deltas, never the whole so far.
    assert sum(reported) == NEW_TOKENS and max(reported) == 1
    # A block's hash is computed once, when it fills: at most one per step, and as many in all
    # as the sequence has full blocks (its prompt's at admission, then one every 16 tokens).
    full_blocks = (len(prompt) + NEW_TOKENS - 1) // bm.block_size
    assert sum(hashes) == full_blocks and max(hashes[1:]) <= 1
    late, early = hashes[-400:], hashes[1:401]
    assert sum(late) <= sum(early) + 1  # no more work at 1,600+ tokens than at 1+
    assert copied_tables == 0  # the runner reads the block manager's tables as they are
    assert list_tables == 0
    bm.check_integrity()
    assert not bm.tables


def test_a_long_streamed_text_is_sliced_per_step_never_joined_whole(tokenizer):
    """With the real tokenizer, 2,000 streamed tokens (stop strings among them): each step's
    delta joins only the new pieces of text, never the whole text so far, and the deltas add up
    to the final text."""
    from engine.core.sequence import SequenceGroup
    from engine.core.step import SampleResult
    from engine.loop.output_processor import OutputProcessor

    processor = OutputProcessor(tokenizer, tokenizer.eos_token_id, 4096)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, stop=["never appears \u2603"])
    group = SequenceGroup("long", None, [(7 * k) % 1000 + 3 for k in range(50)], params)
    group.output_kind = OutputKind.DELTA
    seq = group.seqs[0]
    processor.attach_detokenizer(seq, group)
    rng, deltas = random.Random(0), []
    while not group.is_finished:
        processor.append(seq, group, SampleResult(rng.randrange(100, 20000), None, None, None))
        out = processor.output(group)
        if out is not None:
            deltas.extend(c.text for c in out.outputs)
    assert len(seq.output_token_ids) == NEW_TOKENS and seq.text_len > 2 * NEW_TOKENS
    assert seq.text_joins == 0  # no step built the whole text
    assert "".join(deltas) == seq.output_text


def test_past_the_last_attention_a_prefill_carries_only_the_rows_it_samples(tmp_path):
    """One step prefills two prompts (40 and 25 tokens) beside a decode. Every layer's
    attention sees all 66 tokens, but the last layer's o_proj and MLP get only the 3 rows whose
    logits are wanted (the other layers' MLPs all 66; counted, not timed), and those logits are
    the same floats as a pass that carries every row to the end. A step of decodes keeps all."""
    engine = tiny_engine(tmp_path)
    model = engine.executor.runner.model
    # NOTE: the layers in Python, whose modules can be counted; the compiled stack makes the same
    # cut (tests/engine/test_decoder_stack.py compares the two, rows included).
    model.model.compiled_stack = None
    layers = model.model.layers
    rows_in: dict[int, list[int]] = {0: [], len(layers) - 1: []}
    counting = [True]
    for i in rows_in:
        layers[i].mlp.register_forward_pre_hook(
            lambda m, args, i=i: rows_in[i].append(args[0].shape[0]) if counting[0] else None)
    logits_seen = []
    compute_logits = model.compute_logits

    def recording(hidden):
        logits = compute_logits(hidden)
        logits_seen.append(logits)
        return logits

    model.compute_logits = recording
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    engine.add_request("first", [5, 6, 7], greedy)
    engine.step()  # its prefill; it decodes in the next step
    engine.add_request("a", [(7 * k) % 1000 + 3 for k in range(40)], greedy)
    engine.add_request("b", [(11 * k) % 1000 + 3 for k in range(25)], greedy)
    schedule = engine.scheduler.schedule
    tokens = []

    def counted_schedule():
        out = schedule()
        tokens.append(out.num_batched_tokens)
        return out

    engine.scheduler.schedule = counted_schedule
    for counts in rows_in.values():
        counts.clear()
    forward = model.forward
    full = []

    def both(input_ids, positions, meta, kv_caches, rows=None):
        if rows is not None:  # NOTE: the same K/V is written twice to the same slots
            counting[0] = False
            full.append(forward(input_ids, positions, meta, kv_caches).index_select(0, rows))
            counting[0] = True
        return forward(input_ids, positions, meta, kv_caches, rows)

    model.forward = both
    engine.step()
    assert tokens == [66] and rows_in == {0: [66], len(layers) - 1: [3]}
    assert len(full) == 1 and torch.equal(logits_seen[-1], compute_logits(full[0]).float())
    for counts in rows_in.values():
        counts.clear()
    engine.step()  # three decodes
    assert rows_in == {0: [3], len(layers) - 1: [3]}
