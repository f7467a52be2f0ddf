"""Tensors and devices: the executor (one process, or tensor-parallel worker
processes fed a picklable `StepInput`), the tensor-parallel worker process (`tp_worker`), its
persistent batch (`persistent_batch`: each step sends the tables' changes, not whole tables)
and its collectives (`parallel`), the model runner (a `StepInput` into batch tensors, the forward
pass, logits), the KV cache tensors and their sizing (`cache_engine`, `pool_sizing`), the
paged attention layer and backend, and `models/` (the model families, their layers and linear
kernels, GGUF and safetensors loading). Imports `engine.core` and `engine.sample`, never
`engine.sched` or `engine.kv`: it receives block ids and carries them out.
"""
