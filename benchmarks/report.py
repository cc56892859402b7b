"""Writes docs/benchmarks.md from the JSON every benchmark left in benchmarks/results/.

    python benchmarks/report.py

Run by `make bench` after the benchmarks. A benchmark whose JSON is missing
is listed as not run, never filled in. Plots are copied to docs/benchmarks/.
"""

import datetime
import json
import os
import platform
import shutil
import statistics

RESULTS = "benchmarks/results"
DOCS = "docs"


def load(name):
    path = os.path.join(RESULTS, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def section(lines, name, heading):
    """Appends the section's heading; returns the benchmark's results, or
    `None` (and says "Not run.") when its JSON is missing."""
    lines.append(heading + "\n")
    data = load(name)
    if data is None:
        lines.append("Not run.\n")
    return data


def plot(lines, name, alt):
    """Copies a benchmark's plot into docs/benchmarks/ and shows it, if it was made."""
    png = os.path.join(RESULTS, name)
    if os.path.exists(png):
        os.makedirs(os.path.join(DOCS, "benchmarks"), exist_ok=True)
        shutil.copy(png, os.path.join(DOCS, "benchmarks", name))
        lines.append(f"![{alt}](benchmarks/{name})\n")


def machine():
    import keras
    import tensorflow as tf

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        with open("/proc/meminfo") as f:
            mem_gib = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem_gib = float("nan")
    return (f"{os.cpu_count()} CPU cores ({cpu}), {mem_gib:.0f} GiB memory, no GPU; "
            f"Python {platform.python_version()}, TensorFlow {tf.__version__}, "
            f"Keras {keras.__version__}")


def fit_overhead(lines):
    data = section(lines, "fit_overhead", "## `keras_dist.fit` overhead on one device (`fit_overhead.py`)")
    if data is None:
        return
    med, mins = data["median_seconds"], data["min_seconds"]
    lines += [
        f"Digits MLP, {data['config']['epochs']} epochs, batch "
        f"{data['config']['batch_size']}, {data['config']['repeats']} interleaved repeats.\n",
        "| | median s | min s |", "|---|---|---|",
        *(f"| {name} | {med[name]:.3f} | {mins[name]:.3f} |" for name in med),
        "",
        f"Ratio kd/plain: **{data['ratio_median']:.3f}** (medians), "
        f"{data['ratio_min']:.3f} (minima), {data['ratio_paired_median']:.3f} (paired); "
        f"target <= {data['target']}.\n",
    ]


def iterator_release(lines):
    data = section(lines, "iterator_release",
                   "## Letting go of input iterators under MultiWorkerMirrored "
                   "(`iterator_release.py`)")
    if data is None:
        return
    med, cpu, cfg = data["median_seconds"], data["median_cpu_seconds"], data["config"]
    slowest = data["slowest_fit_seconds"]
    process = {side: statistics.median(r["process_seconds"] for r in runs)
               for side, runs in data["runs"].items()}
    lines += [
        f"{cfg['fits']} short `kd.fit` calls in a row (digits MLP, {cfg['samples']} "
        f"digits, {cfg['epochs']} epochs with validation) on {cfg['workers']} "
        f"MultiWorkerMirrored workers, each side in its own cluster, {cfg['repeats']} "
        "run(s) each. `arrays`: keras_dist's own dataset (tf.data autotuning off); "
        "`autotuned`: the same dataset with autotuning on, as keras_dist built it "
        "before. Deleting an autotuned iterator waits for its autotuning thread's next "
        "wake-up, which grows to a minute; `fit` lets go of one per epoch and per "
        "validation, and garbage iterators are deleted whenever the collector runs.\n",
        "| | fits, median wall s | CPU s | slowest fit s | whole run s (exit included) |",
        "|---|---|---|---|---|",
        *(f"| {side} | {med[side]:.1f} | {cpu[side]:.1f} | {slowest[side]:.1f} | "
          f"{process[side]:.1f} |" for side in med),
        "",
        f"Ratio autotuned/arrays: **{data['ratio']:.2f}** (wall, fits); the same CPU "
        "time, so the difference is idle waiting; the same weights (largest difference "
        f"{data['largest_weight_difference']:.1e}).\n",
    ]


def ps_throughput(lines):
    data = section(lines, "ps_throughput", "## Parameter-server throughput (`ps_throughput.py`)")
    if data is None:
        return
    summary = data["summary"]
    names = list(next(iter(summary.values()))["median_updates_per_s"])
    ratio_names = ["(a)/(b)", "(a')/(b)", "(a)/(c)"][:len(next(iter(summary.values()))["ratios"])]
    lines += [
        f"Chief + 2 workers + 1 ps on this machine, {data['steps']} updates per epoch, "
        f"first of {data['epochs']} epochs dropped; updates per second, median of runs "
        "(min-max in brackets).\n",
        "| steps_per_execution | " + " | ".join(names) + " | " + " | ".join(ratio_names) + " |",
        "|---" * (1 + len(names) + len(ratio_names)) + "|",
    ]
    for key, row in summary.items():
        ranges = row.get("range_updates_per_s", {})
        lines.append(f"| {key[3:]} | " + " | ".join(
            f"{row['median_updates_per_s'][n]:.1f}"
            + (f" [{ranges[n][0]:.0f}-{ranges[n][1]:.0f}]" if n in ranges else "")
            for n in names) + " | " + " | ".join(f"{r:.3f}" for r in row["ratios"]) + " |")
    lines.append("\nTargets: (a)/(b) >= 1.0, (a)/(c) >= 1.3. (a') is keras_dist with "
                 "`nonfinite_updates=\"raise\"`.\n")


def _ms(value):
    return "-" if value != value else f"{value:.2f}"  # NaN: not a round of local steps


def _share(data, k, spe):
    """The share of the limit setting `k x spe` reached (`-` if not run)."""
    rows = [r for r in data["rows"] if (r["k"], r["spe"]) == (k, spe)]
    return f"{rows[0]['share_of_limit']:.3f}" if rows else "-"


def local_steps(lines):
    data = section(lines, "local_steps", "## Local steps against one process (`local_steps.py`)")
    if data is None:
        return
    long_steps, short_steps = data["long_steps"], data["short_steps"]
    lines += [
        f"`AsyncModel.fit(local_steps=k)` compiled with `steps_per_execution=spe` (a "
        "multiple of k chains spe/k rounds per execution; k = 1 is plain asynchronous "
        "training), digits MLP 64-64-10, SGD(0.05), batch 32, chief + 2 workers + 1 ps. "
        f"Examples/s on epochs of {long_steps} steps, against the one-process limit "
        f"measured in the same run ({data['limit_examples_per_s']:.0f} examples/s: Keras' "
        f"own `fit`, steps_per_execution 50, {long_steps}-step epochs), and on epochs of "
        f"{short_steps} steps; test accuracy after {data['total_steps'] * data['batch']} "
        f"examples (mean of {data['repeats']} seeds). Pull, steps and push are "
        "measured for rounds of local steps only.\n",
        f"| k x spe | examples/s ({long_steps}-step epochs) | ÷ limit | test accuracy | "
        f"examples/s ({short_steps}-step) | {short_steps} ÷ {long_steps} |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        short = (f"{r['short_examples_per_s']:.0f} | {r['short_over_long']:.3f}"
                 if "short_examples_per_s" in r else "- | -")
        lines.append(f"| {r['k']}x{r['spe']} | {r['examples_per_s']:.0f} | "
                     f"{r['share_of_limit']:.3f} | {100 * r['accuracy']:.2f}% | {short} |")
    lines += [
        "",
        "Where the time goes, per execution on the long epochs (medians; a worker "
        "measures its pull, its steps and its push; *busy*: the share of the epoch the "
        "workers spend in executions, the rest being the round trip to the chief):\n",
        "| k x spe | rounds | execution ms | pull ms | steps ms | push ms | workers busy | "
        "chief CPU ms |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r['k']}x{r['spe']} | {r['rounds_per_execution']} | {r['execution_ms']:.2f} | "
          f"{_ms(r['pull_ms'])} | {_ms(r['compute_ms'])} | {_ms(r['push_ms'])} | "
          f"{r['busy_share']:.2f} | {r['chief_cpu_ms_per_execution']:.2f} |"
          for r in data["rows"]),
        "",
        "Targets: 16x64 >= 1.0 and 64x256 >= 1.5 of the limit; the short/long ratio "
        ">= 0.9 at 1x1, 1x10 and 16x1; accuracy within one point of 1x1.\n",
    ]
    if "cpu_bound" in data:
        cores = statistics.median(data["limit_cores"])
        lines.append(
            f"The CPU bound: the one process keeps {cores:.2f} of the machine's "
            f"{data['cpu_count']} cores busy, so at its examples per CPU-second the whole "
            f"machine gives at most {data['cpu_bound']:.2f}x its examples/s; 64x256 reached "
            f"{_share(data, 64, 256)} of the limit.\n")
    plot(lines, "local_steps.png", "Local steps: throughput against one process, and accuracy")


def ps_startup(lines):
    data = section(lines, "ps_startup", "## Whole-process time under parameter servers (`ps_startup.py`)")
    if data is None:
        return
    med = data["median_seconds"]
    lines += [
        f"A fresh local cluster (chief, 2 workers, 1 ps) per run, from launching it to the "
        f"end of `fit` ({data['epochs']} epochs of {data['steps']} updates, "
        f"steps_per_execution {data['spe']}, digits MLP): imports, cluster start, model, "
        "tracing and training. Median of interleaved runs.\n",
        "| | keras_dist `AsyncModel.fit` | tf-keras `model.fit` | speed ratio |",
        "|---|---|---|---|",
        f"| seconds | {med['keras_dist']:.1f} | {med['tf_keras']:.1f} | "
        f"{data['speed_ratio']:.3f} |",
        "",
        "Target: speed ratio (tf-keras seconds / keras_dist seconds) >= 1.0.\n",
    ]


def flags_startup(lines):
    data = section(lines, "flags_startup", "## A flags script's `--help` (`flags_startup.py`)")
    if data is None:
        return
    base = data["medians"]["import tensorflow"]
    lines += [f"Median of {data['repeats']} interleaved runs, each a fresh process.\n",
              "| command | seconds | x `import tensorflow` |", "|---|---|---|",
              f"| `python -c \"import tensorflow\"` | {base:.3f} | 1 |"]
    for name, ratio in data["ratios"].items():
        lines.append(f"| {name} | {data['medians'][name]:.3f} | {ratio:.3f} |")
    lines += ["", f"Target: every ratio <= {data['target']}: "
              f"{'met' if data['met'] else 'not met'}.\n"]


def stalled_worker(lines):
    data = section(lines, "stalled_worker",
                   "## A stopped worker under parameter servers (`stalled_worker.py`)")
    if data is None:
        return
    runs = [data] + [d for d in [load("stalled_worker_spe10")] if d is not None]
    lines += [
        f"Digits MLP, {data['epochs']} epochs; after {data['warmup']} epochs worker 1 of 2 "
        "is stopped (SIGSTOP) until `fit` ends, against one worker alone; examples/s over "
        "the epochs after the warm-up, median of interleaved fresh clusters "
        "(`python benchmarks/stalled_worker.py`, with `--spe` and `--steps` as in the "
        "table).\n",
        "| steps_per_execution | updates per epoch | stopped for | one of two workers "
        "stopped | one worker alone | ratio | step counts of the stopped runs |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        med = run["median_examples_per_second"]
        counts = "; ".join(f"{c['speculative']} speculative, {c['late']} late, "
                           f"{c['lost']} lost" for c in
                           (r["counts"] for r in run["runs"]["frozen"]))
        lines.append(f"| {run['spe']} | {run['steps']} | {run['stopped_seconds']:.0f} s | "
                     f"{med['frozen']:.0f} | {med['alone']:.0f} | {run['ratio']:.3f} | "
                     f"{counts} |")
    lines += ["", "Target: ratio >= 0.9 (before issue 30: about 0.1, the job waited "
              "for the stopped worker's step).\n"]


def preemption(lines):
    data = section(lines, "preemption",
                   "## Failures and restarts: goodput (`preemption.py`)")
    if data is None:
        return
    lines += [
        f"Digits MLP, {data['epochs']} epochs of {data['steps']} steps on a local "
        "`keras-dist-run --workers 2 [--ps 1] --max-restarts 100` job; a random training "
        "task (a worker; with parameter servers also the chief or the ps) SIGKILLed every "
        f"T seconds; backups every {data['save_freq']} steps. Goodput: the job's steps per "
        "second of wall time, launch to exit, restarts included, against the same job "
        "uninterrupted with backups (`steady`) and without (`plain`). Lost work per "
        "failure: steps between the backup resumed from and where the job stood, and "
        "seconds until training was back there (`python benchmarks/preemption.py`).\n",
        "| strategy | side | wall | goodput vs steady | vs plain | failures | job "
        "restarts | worker restarts | lost steps (median, max) | back after (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for strategy, result in data["strategies"].items():
        for side, row in result["summary"].items():
            lost = ("-" if row["lost_steps_median"] is None else
                    f"{row['lost_steps_median']:g}, {row['lost_steps_max']:g}")
            back = ("-" if row["lost_seconds_median"] is None
                    else f"{row['lost_seconds_median']:.1f} s")
            lines.append(f"| {strategy} | {side} | {row['wall_s']:.0f} s | "
                         f"{row['goodput_vs_steady']:.3f} | {row['goodput_vs_plain']:.3f} | "
                         f"{row['failures']} | {row['job_restarts']} | "
                         f"{row['worker_restarts']} | {lost} | {back} |")
    lines += ["", "Targets: goodput >= 0.8 at T = 60 s; lost work <= one backup interval "
              f"({data['save_freq']} steps) per failure.\n"]


def staleness_convergence(lines):
    data = section(lines, "staleness_convergence", "## Accuracy under simulated staleness (`staleness_convergence.py`)")
    if data is None:
        return
    if "tasks" not in data:
        lines.append("Results from an older version of the benchmark: re-run it.\n")
        return
    counts = [str(n) for n in data["workers"]]
    lines.append(f"{data['epochs']} epochs of batch {data['batch']} for every method; each "
                 "method at the learning rate of its grid that is best on a validation split "
                 f"({data['sweep_seeds']} seeds averaged), then test accuracy (%) over seeds "
                 f"{data['seeds']}: mean [min-max], and the rate (* on the grid's edge). "
                 f"The study took {data['seconds'] / 60:.0f} minutes.\n")
    for task, result in data["tasks"].items():
        lines += [f"### {task}\n", "| method | " + " | ".join(f"N={n}" for n in counts) + " |",
                  "|---" * (1 + len(counts)) + "|"]
        for name, by_n in result["results"].items():
            cells = []
            for n in counts:
                acc = [100 * a for a in by_n[n]["test"]]
                cells.append(f"{sum(acc) / len(acc):.1f} [{min(acc):.1f}-{max(acc):.1f}] "
                             f"lr {by_n[n]['learning_rate']:g}"
                             f"{'*' if by_n[n]['on_grid_edge'] else ''}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        for n, v in result["verdict"].items():
            lines.append(f"- N={n}: best asynchronous method {v['best_async']}, "
                         f"{100 * v['accuracy']:.1f}%, {100 * v['gap_to_sequential']:.1f} points "
                         f"below tuned sequential SGD ({100 * result['sequential']:.1f}%); "
                         f"sync SGD with momentum {100 * v['sync_momentum']:.1f}%.")
        lines.append("")
        timed = result.get("timed")
        if timed:
            workers = [str(n) for n in timed["workers"]]
            lines += [
                "Workers of Pareto-drawn speeds (shape 2.5), each method at the rate chosen "
                "above: test accuracy (%); simulated time of the run; time to "
                f"{100 * timed['target']:.1f}% on validation; time to synchronous SGD with "
                "momentum's final validation accuracy (one-batch step units; -: never):\n",
                "| method | " + " | ".join(f"N={n}" for n in workers) + " |",
                "|---" * (1 + len(workers)) + "|"]
            for name, by_n in timed["methods"].items():
                cells = []
                for n in workers:
                    r = by_n[n]
                    reach = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.0f}"
                    sync = "-" if r.get("time_to_sync") is None else f"{r['time_to_sync']:.0f}"
                    cells.append(f"{100 * sum(r['test']) / len(r['test']):.1f}; "
                                 f"{r['time']:.0f}; {reach}; {sync}")
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
    plot(lines, "staleness_convergence.png", "accuracy against simulated workers and time")


def simulator_validation(lines, name="simulator_validation", heading=""):
    data = section(lines, name,
                   f"## The simulator against real clusters (`simulator_validation.py`{heading})")
    if data is None:
        return
    optimizer = data.get("optimizer", f"SGD({data['learning_rate']})")
    lines += [
        f"Digits MLP, {optimizer}, {data['epochs']} epochs, steps_per_execution "
        f"1, on local clusters (chief, N workers, 1 ps), {data['repeats']} runs per setting; "
        f"`simulate.fit` with the profile measured in them, {data['sim_seeds']} seeds. Staleness "
        "after the first epoch; accuracy on the test digits.\n",
        "| setting | profile (slowdowns; gaps; sigma; cores) | tau mean real / simulated "
        "(gap only; no gap) | tau p95 real / simulated | test accuracy real / simulated "
        "| agrees on |",
        "|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        real, sim, no_gap = row["real"], row["simulated"], row["simulated_without_gap"]
        gap_only = row.get("simulated_gap_only", sim)
        cores = f"; {row['concurrency']}" if row.get("concurrency") else "; -"
        setting = f"N={row['workers']}" + (f", worker 0 x{data['factor']:g}" if row["slowed"]
                                          else ", equal")
        slow = ", ".join(f"w{w} x{f:.2f}" for w, f in row["stragglers"].items()) or "equal"
        gaps = " ".join(f"{g:.1f}" for g in row["gaps"].values())
        lines.append(
            f"| {setting} | {slow}; {gaps}; {row['sigma']:.2f}{cores} | {real['tau_mean']:.2f} / "
            f"{sim['tau_mean']:.2f} ({gap_only['tau_mean']:.2f}; {no_gap['tau_mean']:.2f}) | "
            f"{real['tau_p95']:.1f} / "
            f"{sim['tau_p95']:.1f} | {100 * real['accuracy_mean']:.1f} / "
            f"{100 * sim['accuracy_mean']:.1f} | "
            + (", ".join(k for k, ok in row["agrees"].items() if ok) or "none") + " |")
    lines.append("")
    plot(lines, f"{name}.png", "staleness, real against simulated")


def straggler(lines):
    data = section(lines, "straggler", "## Synchronous vs asynchronous under a straggler (`straggler.py`)")
    if data is None:
        return
    target = data["target_accuracy"]
    lines += [
        f"Digits MLP 64-256-256-10, {data['epochs']} passes over the training digits, "
        f"batch {data['batch_per_worker']} per worker per step; sync = 2 "
        "MultiWorkerMirrored workers, async = chief + 2 workers + 1 ps. Worker 1 "
        f"slowed {data['factor']:g}x with `KERAS_DIST_SLOW_WORKER`, or nobody. "
        f"Median of {data['repeats']} interleaved runs; rates after the first epoch.\n",
        f"| run | examples/s | updates/s | training s to test acc {target:.2f} | "
        "final test acc | flagged by StragglerDetector |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in data["summary"].items():
        to_target = ("not reached" if row["seconds_to_target"] is None
                     else f"{row['seconds_to_target']:.2f} ({row['reached_target']} runs)")
        lines.append(
            f"| {key} | {row['examples_per_s']:.0f} | {row['updates_per_s']:.1f} | "
            f"{to_target} | {row['final_test_accuracy']:.3f} | "
            f"{', '.join(row['flagged']) or '-'} |")
    lines += [
        "",
        f"async / sync examples per second with the straggler: "
        f"**{data['ratio_async_sync_slowed']:.2f}** (target >= 2.0); without it: "
        f"{data['ratio_async_sync_none']:.2f}.\n",
        "On 2 cores the four tasks compete for the CPU: a slowed worker sleeps, which "
        "frees CPU for the others, so asynchronous throughput barely drops while "
        "synchronous training waits for the straggler at every all-reduce. On "
        "machines where workers do not share cores the asynchronous side loses the "
        "straggler's share (at 4x, 3/8 of two workers' throughput).\n",
    ]
    plot(lines, "straggler.png",
         "accuracy against time and throughput, with and without a straggler")


def ps_sharded(lines):
    data = section(lines, "ps_sharded", "## Sharded embedding table on parameter servers (`ps_sharded.py`)")
    if data is None:
        return
    cfg = data["config"]
    lines += [
        f"Chief + {cfg['workers']} workers + {cfg['ps']} ps. `Embedding({cfg['vocab']:,} x "
        f"{cfg['dim']})` ({cfg['vocab'] * cfg['dim'] * 4 / 1e6:.1f} MB), "
        f"{cfg['ids_per_example']} Zipf-like ids per example, pooled, Dense(64), a sigmoid "
        f"click; batch {cfg['batch']}; median of {cfg['repeats']} interleaved runs of "
        f"{cfg['steps']} updates (min-max in brackets). Bytes: the cluster's own network "
        "namespace's loopback counter, per update.\n",
        "| optimizer | table | updates/s | MB per update | test accuracy |",
        "|---|---|---|---|---|",
    ]
    labels = {"sharded": "sharded over 2 ps", "unsharded": "whole on 1 ps",
              "unsharded_keras_lookup": "whole on 1 ps, Keras' own lookup"}
    for name, result in data["results"].items():
        for side, label in labels.items():
            row = result[side]
            lines.append(
                f"| {name} | {label} | {row['updates_per_s']:.1f} "
                f"[{row['range'][0]:.0f}-{row['range'][1]:.0f}] | "
                f"{row['bytes_per_update'] / 1e6:.3f} | {100 * row['test_accuracy']:.1f}% |")
    lines.append("")
    for name, result in data["results"].items():
        lines.append(
            f"- {name}: sharded / whole: speed x{result['sharded_vs_unsharded']['speed']:.2f}, "
            f"bytes x{result['sharded_vs_unsharded']['bytes']:.3f}; sharded / Keras' own "
            f"lookup: speed x{result['sharded_vs_unsharded_keras_lookup']['speed']:.2f}, "
            f"bytes x{result['sharded_vs_unsharded_keras_lookup']['bytes']:.3f}.")
    lines.append("")


def main():
    lines = [
        "# Benchmarks\n",
        "Written by `make bench` (`benchmarks/report.py`) on "
        f"{datetime.date.today().isoformat()}. Machine: {machine()}.\n",
        "Every ratio compares runs made side by side in one process or one cluster: "
        "the machine is shared and noisy, so absolute numbers move between runs and "
        "only the ratios are meant to be read. How each benchmark works: "
        "`benchmarks/README.md`.\n",
    ]
    fit_overhead(lines)
    iterator_release(lines)
    ps_throughput(lines)
    local_steps(lines)
    ps_startup(lines)
    flags_startup(lines)
    stalled_worker(lines)
    preemption(lines)
    ps_sharded(lines)
    staleness_convergence(lines)
    simulator_validation(lines)
    simulator_validation(lines, "simulator_validation_ringmaster", ", `--optimizer ringmaster`")
    straggler(lines)
    with open(os.path.join(DOCS, "benchmarks.md"), "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.join(DOCS, 'benchmarks.md')}")


if __name__ == "__main__":
    main()
