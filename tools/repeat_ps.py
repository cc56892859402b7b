"""Runs one parameter-server training script many times and counts failures.

An intermittent failure is a reliability bug, and one run says nothing about
it. This starts `keras-dist-run --workers 2 --ps 1` on
tests/scripts/ps_shuffled.py (a shuffled input, chief + 2 workers + 1 ps)
`--runs` times per variant, one run at a time, keeps every failing run's log
under `--log-dir`, and prints one line per run and a summary. A line says
`PARSE` when the log holds gRPC's "Unable to parse request" (issue 16).

Usage:

    python tools/repeat_ps.py --runs 20 --variants fn,ds
    python tools/repeat_ps.py --runs 5 --variants arrays --log-dir /tmp/ps-runs

Exits non-zero if any run failed.
"""

import argparse
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "ps_shuffled.py")
VARIANTS = ("fn", "ds", "arrays")


def run_once(variant, timeout):
    """(exit code or "timeout", seconds, output) of one cluster run."""
    cmd = [sys.executable, "-m", "keras_dist.cluster.launch", "--workers", "2", "--ps", "1",
           "--", sys.executable, SCRIPT, variant]
    start = time.monotonic()
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.terminate()  # the launcher stops its tasks on SIGTERM
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
            rc = "timeout"
    return rc, time.monotonic() - start, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per variant")
    parser.add_argument("--variants", default="fn,ds",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--log-dir", default="ps-runs", help="failing runs' logs")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or args.runs < 1:
        parser.error(f"--variants must name some of {VARIANTS} and --runs be >= 1; "
                     f"received --variants={args.variants!r} --runs={args.runs}")
    failures = 0
    for variant in variants:
        failed = 0
        for i in range(1, args.runs + 1):
            rc, seconds, out = run_once(variant, args.timeout)
            ok = rc == 0 and f"RESULT {variant}" in out
            parse = "PARSE" if "Unable to parse request" in out else ""
            print(f"{variant} run {i}/{args.runs}: {'ok' if ok else 'FAILED'} "
                  f"(exit {rc}, {seconds:.0f} s) {parse}".rstrip(), flush=True)
            if not ok:
                failed += 1
                os.makedirs(args.log_dir, exist_ok=True)
                path = os.path.join(args.log_dir, f"{variant}-{i}.log")
                with open(path, "w") as f:
                    f.write(out)
                print(f"  log: {path}", flush=True)
        print(f"{variant}: {failed} of {args.runs} runs failed", flush=True)
        failures += failed
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
