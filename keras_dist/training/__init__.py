"""How a model trains once the strategy is chosen.

Read in this order:

- `api`: `fit`, `evaluate`, `predict`, the public entry points, and `train`,
  the one place that acts on a plan's route;
- `plan`: `RunPlan`, everything `fit` decides, once, before training;
- `driver`: the epoch loop with Keras' semantics (callbacks, History,
  validation, resuming), the same for every strategy, and `Executor`, the
  abstract base class of what it runs;
- `steps`: `StepPlanner`, how an epoch splits into executions;
  `compiled`: the compiled-function cache, one per model, emptied by
  `compile()`;
- the executors: `sync_executor` (one or several replicas in lockstep) and
  `async_executor` (parameter servers: the chief's schedule / collect /
  recover loop, with `inflight`), whose traced worker step is
  `worker_step` and whose metrics `chief_metrics` sums;
- `update`, `nonfinite`, `gradients`: applying an update (the update's
  information for staleness-aware optimizers, the non-finite policy,
  global-gradient semantics and gradient shipping);
- `local_steps`, `stateless`: several local steps per round;
- `data`, `step_report`, `staleness`, `stall`, `sharded`: the pieces the
  executors share;
- `async_model`: `AsyncModel`.
"""
