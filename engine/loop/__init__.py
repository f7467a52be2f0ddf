"""The step loop and the engine's public faces: `LLMEngine` (add a request, then
`step()`: schedule, execute, sample, process outputs), the output processor (detokenization,
stops, `RequestOutput`s) and the tokenizer, request checks against the pool, stats and
metrics, the `AsyncEngine` that runs the loop on its own thread for the server (with its
watchdog and request streams), the offline `LLM` and `EngineArgs`, which builds the configs.
The top of engine/: it may import every other package, and nothing in engine/ imports it.
"""
