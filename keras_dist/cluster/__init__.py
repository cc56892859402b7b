"""Where the processes come from and how they find each other.

- `config`: `ClusterConfig`, the one reading of `TF_CONFIG`, a Kubernetes
  Indexed Job's pod and a SLURM job step;
- `slurm`: SLURM's variables turned into tasks; `k8s`: the plain Kubernetes
  Job (`--emit k8s`) and what its pods read;
- `strategy`: which `tf.distribute` strategy a cluster and its devices get
  (`choose_strategy`, `build_strategy`, `resolve_strategy`);
- `serving`: the worker and ps tasks' `tf.distribute.Server`, the waits for
  peers, gRPC settings; `ports`: is a task's port free for its server;
- `launch`: the `keras-dist-run` launcher; `isolation`: its private
  network namespace; `recipes`: the TFJob and SLURM files it emits;
- `jobs`: a job restarted as a whole after a failure a restart can mend;
- `ray_tasks`: the tasks as Ray actors (`keras_dist.ray`), `ray_call`: a
  pickled function run as a task;
- `plain_fit`: Keras' own `model.fit` refused on parameter-server tasks.

Nothing here imports TensorFlow at import time except `strategy` and
`serving`, nor Ray, so the launcher and the recipes start instantly.
"""
