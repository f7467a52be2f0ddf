"""What runs each step: the `Scheduler` (waiting / running / swapped queues,
continuous batching under token and sequence budgets, preemption by swap or recompute), the
`StepPlan` it builds a step with, the admission order of waiting requests and the step-cost
model behind the step-time target. It hands the engine a `SchedulerOutput` (engine.core.step)
and never touches tensors. Imports `engine.core` and `engine.kv`, never `engine.worker`.
"""
