"""The plain data every layer shares, importing no other engine package: the frozen
settings (`config`), a request's sampling settings and guided-decoding constraint
(`sampling_params`, `guided_decoding`), its sequences and their status (`sequence`, with a beam
search's `beam_state` and the `stop_strings` matcher), what a request reports (`outputs`), a
block table and the tables as matrix rows (`table_rows`), the step's plain objects
(`step`: `SchedulerOutput`, `StepInput`, `StepOutput`), which the scheduler side and the worker
side both import so that neither imports the other, and admission (`admission`: a request's
fields to a validated `EngineRequest` with its final max_tokens, refusals as a `RequestError`
carrying OpenAI's param and code, `request_error`), which the server's routes and the offline
`LLM` call alike.
"""
