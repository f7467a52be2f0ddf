"""From a step's logits to tokens: the `Sampler` (logits processors, then greedy or
the random draw of `random_draw`: temperature, top-k, top-p, min-p), token scores and
logprobs, beam search (which beams live; the scheduler applies their block operations),
structured outputs (llguidance grammar masks) and prompt logprobs. Imports only `engine.core`.
"""
