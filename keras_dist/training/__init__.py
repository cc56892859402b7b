"""How a model trains once the strategy is chosen.

Read in this order:

- `api`: `fit`, `evaluate`, `predict`, the public entry points;
- `plan`: `RunPlan`, everything `fit` decides, once, before training;
- `driver`: the epoch loop with Keras' semantics (callbacks, History,
  validation), the same for every strategy;
- `steps`: `StepPlanner`, how an epoch splits into executions;
- `executor`: the `Executor` protocol the driver runs, and its two
  implementations, `sync_executor` (one or several replicas in lockstep)
  and `async_executor` (parameter servers: the chief's schedule / collect /
  recover loop), whose traced worker step is `worker_step`;
- `update`, `nonfinite`, `gradients`: applying an update (the update's
  staleness information, the non-finite policy, clipping and gradient
  shipping);
- `local_steps`, `stateless`: several local steps per round;
- `data`, `step_report`, `staleness`, `inflight`, `stall`, `sharded`: the
  pieces the executors share;
- `async_model`: `AsyncModel`.
"""
