"""Repeat lesson 05's crash-and-restart run many times and count how often the restart ends in PROOF PASSED.

    python 05_torchrun_elastic/elastic_reliability.py                  # 20 trials of the script as it is (one node)
    python 05_torchrun_elastic/elastic_reliability.py --lock /tmp/cpu.lock --trial-timeout 90 \\
        --out 05_torchrun_elastic/reliability.json \\
        --variants plain:10 prefix plain+env c10d2+env:10 static2:10 c10d2:10   # as committed (NAME:N = N trials)

Each trial: torchrun --max-restarts=1 ... torchrun_elastic.py --crash-at-step 6; rank 1 dies (SIGKILL) at step 6, torchrun
restarts the group, the script resumes from its checkpoint. A trial passes when every torchrun exits 0 and the
script prints PROOF PASSED. The variants differ in how torchrun is launched and how the script creates its process group.
"""
import argparse
import fcntl
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_elastic.py")
DISABLE_SHARING = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# name: (what it is, nodes, rendezvous, script flags, extra environment, recommended by the README)
VARIANTS = {
    "plain": ("1 node (--standalone), init_process_group(init_method='env://') as tutorials write it", 1, "c10d", ["--plain-init"], {}, False),
    "plain+env": ("1 node, the same plain init, torchrun started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", 1, "c10d", ["--plain-init"], DISABLE_SHARING, True),
    "prefix": ("1 node, the script as it is: a per-attempt PrefixStore on torchrun's store", 1, "c10d", [], {}, True),
    "static2": ("2 nodes on this machine, static rendezvous (--node-rank, --master-port), the script as it is", 2, "static", [], {}, True),
    "c10d2": ("2 nodes on this machine, c10d rendezvous, the script as it is (torchrun's shared store)", 2, "c10d", [], {}, False),
    "c10d2+env": ("2 nodes, c10d rendezvous, torchrun started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", 2, "c10d", [], DISABLE_SHARING, True),
}
FAILURE_KINDS = [  # (pattern in stderr, what it means), first match wins
    (r"connectFullMesh|Connection refused", "gloo could not connect: it dialled a previous attempt's address"),
    (r"DistStoreError|wait timeout", "store wait timed out: ranks waited for keys no one wrote"),
    (r"terminate called", "a rank aborted at exit"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="crash-and-restart runs per variant (default 20)")
    p.add_argument("--variants", nargs="+", default=["prefix"], help=f"some of {', '.join(VARIANTS)}, or all (default: prefix); "
                   "NAME:N runs N trials of that variant instead of --trials")
    p.add_argument("--crash-at-step", type=int, default=6, help="the step at which rank 1 dies (default 6)")
    p.add_argument("--timeout", type=float, default=20, help="the script's --timeout, so a hang fails within seconds (default 20)")
    p.add_argument("--trial-timeout", type=float, default=150, help="kill a trial that runs longer than this (default 150 s)")
    p.add_argument("--lock", help="hold this file's flock during each trial, so that trials never overlap other CPU work")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.variants == ["all"]:
        args.variants = list(VARIANTS)
    try:
        args.variants = {v.partition(":")[0]: int(v.partition(":")[2] or args.trials) for v in args.variants}
    except ValueError:
        p.error("--variants takes NAME or NAME:N with N a number of trials")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)} or all")
    if min(args.trials, *args.variants.values()) < 1 or args.timeout <= 0 or args.trial_timeout <= 0:
        p.error("--trials, --timeout and --trial-timeout must be positive")
    return args


def find_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_commands(nodes, rendezvous, port):
    """One torchrun command line per node, all on this machine."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--max-restarts=1"]
    if nodes == 1:
        return [torchrun + ["--standalone", "--nproc-per-node=2"]]
    if rendezvous == "static":
        return [torchrun + ["--nnodes=2", f"--node-rank={n}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                            f"--master-port={port}"] for n in range(nodes)]
    return [torchrun + ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                        "--rdzv-id=reliability"]] * nodes


def run_trial(variant, args):
    """Returns (passed, failure kind or None, seconds)."""
    _, nodes, rendezvous, flags, extra_env, _ = VARIANTS[variant]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra_env)
    with tempfile.TemporaryDirectory(prefix="elastic_reliability_") as scratch:
        script_args = [SCRIPT, "--crash-at-step", str(args.crash_at_step), "--timeout", str(args.timeout),
                       "--checkpoint-dir", scratch, *flags]
        logs = [open(os.path.join(scratch, f"node{n}.log"), "w+") for n in range(nodes)]
        start = time.perf_counter()
        procs = [subprocess.Popen(cmd + script_args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                 for cmd, log in zip(torchrun_commands(nodes, rendezvous, find_free_port()), logs)]
        hung = False
        for proc in procs:
            try:
                proc.wait(timeout=max(1, args.trial_timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                hung = True
        for proc in procs:  # whatever is left: the whole process group, torchrun and its workers
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        seconds = time.perf_counter() - start
        output = ""
        for log in logs:
            log.seek(0)
            output += log.read()
            log.close()
    if not hung and all(p.returncode == 0 for p in procs) and "PROOF PASSED" in output:
        return True, None, seconds
    kind = next((what for pattern, what in FAILURE_KINDS if re.search(pattern, output)), "other")
    return False, ("hung: killed after --trial-timeout; " if hung else "") + kind, seconds


def hardware():
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor() or "unknown CPU") if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv=None):
    args = parse_args(argv)
    lock = open(args.lock, "a") if args.lock else None
    print(f"crash-and-restart trials ({', '.join(f'{v} x{n}' for v, n in args.variants.items())}) on {hardware()}", flush=True)
    results = {}
    for variant, trials in args.variants.items():
        outcomes = []
        for trial in range(1, trials + 1):
            if lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                passed, kind, seconds = run_trial(variant, args)
            finally:
                if lock:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            outcomes.append((passed, kind, seconds))
            print(f"{variant:10s} trial {trial:2d}/{trials}: {'passed' if passed else 'FAILED: ' + kind} ({seconds:.1f} s)", flush=True)
        failures = {}
        for _, kind, _ in outcomes:
            if kind:
                failures[kind] = failures.get(kind, 0) + 1
        results[variant] = {"what": VARIANTS[variant][0], "recommended": VARIANTS[variant][5], "trials": trials,
                            "passed": sum(p for p, _, _ in outcomes), "failures": failures,
                            "median_seconds_passed": statistics.median([s for p, _, s in outcomes if p] or [0.0]),
                            "seconds": [round(s, 1) for _, _, s in outcomes]}
        if args.out:  # after each variant, so that a long measurement keeps what it has
            with open(args.out, "w") as f:
                json.dump({"hardware": hardware(), "date": time.strftime("%Y-%m-%d"), "crash_at_step": args.crash_at_step,
                           "script_timeout_s": args.timeout, "trial_timeout_s": args.trial_timeout, "results": results}, f, indent=1)
    print("\nvariant     passed   what")
    for variant, r in results.items():
        print(f"{variant:10s} {r['passed']:3d}/{r['trials']:<3d}  {r['what']}" +
              "".join(f"\n{'':20s}{n} x {kind}" for kind, n in r["failures"].items()))
    if args.out:
        print(f"results written to {args.out}")
    broken = [v for v, r in results.items() if r["recommended"] and r["passed"] < r["trials"]]
    if broken:
        print(f"RELIABILITY FAILED: {', '.join(broken)} did not pass every trial", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
