"""Repeat lab 05's crash-and-restart launch many times and count how often the restart ends bit-exact.

    python 05_torchrun_elastic/elastic_reliability.py                  # 20 trials of the lesson as it is
    python 05_torchrun_elastic/elastic_reliability.py --lock /tmp/cpu.lock --trial-timeout 90 \\
        --out 05_torchrun_elastic/reliability.json \\
        --variants plain:10 prefix plain+env c10d2+env:10 static2:10 c10d2:10   # NAME:N = N trials

First one uninterrupted `torchrun --standalone` launch of the lab (prove.py) gives the reference
weights. Each trial then starts torchrun --max-restarts=1 (one per "node", all on this machine) with
prove.py's worker role as the entry point: it runs the lesson's main() unchanged; rank 1 SIGKILLs
itself at step 12, torchrun restarts the group, the lesson resumes from its checkpoint of step 10. A
trial passes when every torchrun exits 0 and every rank ends with the reference's weights (torch.equal).
The variants differ in how torchrun is launched and how the lesson creates its process group
(`plain`: the lab's --break plain-init). The committed reliability.json was measured with the
previous version of the lesson and of this script (commit 445f873): see NOTES.md.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # course.py
import course  # noqa: E402
import prove  # noqa: E402

try:
    import fcntl  # --lock's flock: Linux and macOS
except ImportError:  # Windows
    fcntl = None

DISABLE_SHARING = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# name: (what it is, nodes, rendezvous, the lab's --break, extra environment, recommended by NOTES.md)
VARIANTS = {
    "plain": ("1 node (--standalone), init_process_group(init_method='env://') as tutorials write it",
              1, "c10d", "plain-init", {}, False),
    "plain+env": ("1 node, the same plain init, torchrun started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  1, "c10d", "plain-init", DISABLE_SHARING, True),
    "prefix": ("1 node, the lesson as it is: a per-attempt PrefixStore on torchrun's store",
               1, "c10d", None, {}, True),
    "static2": ("2 nodes on this machine, static rendezvous (--node-rank, --master-port), the lesson as it is",
                2, "static", None, {}, True),
    "c10d2": ("2 nodes on this machine, c10d rendezvous, the lesson as it is (torchrun's shared store)",
              2, "c10d", None, {}, False),
    "c10d2+env": ("2 nodes, c10d rendezvous, torchrun started with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                  2, "c10d", None, DISABLE_SHARING, True),
}
FAILURE_KINDS = [  # (pattern in stderr, what it means), first match wins
    (r"connectFullMesh|Connection refused", "gloo could not connect: it dialled a previous attempt's address"),
    (r"DistStoreError|wait timeout", "store wait timed out: ranks waited for keys no one wrote"),
    (r"terminate called", "a rank aborted at exit"),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="crash-and-restart runs per variant (default 20)")
    p.add_argument("--variants", nargs="+", default=["prefix"], help=f"some of {', '.join(VARIANTS)}, or "
                   "all (default: prefix); NAME:N runs N trials of that variant instead of --trials")
    p.add_argument("--timeout", type=float, default=20, help="the lesson's process group timeout, so a "
                   "hang fails within seconds (default 20)")
    p.add_argument("--trial-timeout", type=float, default=150, help="kill a trial that runs longer than "
                   "this (default 150 s)")
    p.add_argument("--lock", help="hold this file's flock during each trial, so that trials never overlap "
                   "other CPU work")
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
    if args.lock and fcntl is None:
        course.refuse(f"--lock holds an flock, which {course.platform_name()} does not have: "
                      "run without --lock")
    return args


def torchrun_commands(nodes, rendezvous, port):
    """The torchrun part of one command line per node, all on this machine."""
    torchrun = [*prove.TORCHRUN, "--max-restarts=1"]
    if nodes == 1:
        return [torchrun + ["--standalone", f"--nproc-per-node={prove.WORLD}"]]
    if rendezvous == "static":
        return [torchrun + ["--nnodes=2", f"--node-rank={n}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                            f"--master-port={port}"] for n in range(nodes)]
    return [torchrun + ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=reliability"]] * nodes


def reference_weights(args):
    """One uninterrupted `torchrun --standalone` launch of the lab's worker role: every rank's weights."""
    lab_args = argparse.Namespace(epochs=2, timeout=args.timeout, broken=None)
    with tempfile.TemporaryDirectory(prefix="elastic_reference_") as out_dir:
        code, _, stderr = prove.launch("uninterrupted", lab_args, out_dir, 1, None)
        if code != 0:
            sys.exit(f"the uninterrupted reference launch failed (exit {code}):\n{stderr}")
        return [torch.load(os.path.join(out_dir, f"uninterrupted-rank{r}.pt"), weights_only=True)["state"]
                for r in range(prove.WORLD)]


def run_trial(variant, args, reference):
    """Returns (passed, failure kind or None, seconds)."""
    _, nodes, rendezvous, broken, extra_env, _ = VARIANTS[variant]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra_env)
    with tempfile.TemporaryDirectory(prefix="elastic_reliability_") as out_dir:
        folder = os.path.join(out_dir, "crashed-checkpoints")
        os.makedirs(folder)
        settings = {"run": "crashed", "out_dir": out_dir, "folder": folder, "epochs": 2,
                    "timeout": args.timeout, "broken": broken, "kill_step": prove.kill_schedule(2)[1],
                    "crash_rank": None}
        worker = [os.path.abspath(prove.__file__), "--as-torchrun-worker", json.dumps(settings)]
        logs = [open(os.path.join(out_dir, f"node{n}.log"), "w+") for n in range(nodes)]
        start = time.perf_counter()
        procs = [subprocess.Popen(cmd + worker, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
                 for cmd, log in zip(torchrun_commands(nodes, rendezvous, course.find_free_port()), logs)]
        hung = False
        for proc in procs:
            try:
                proc.wait(timeout=max(1, args.trial_timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                hung = True
        for proc in procs:  # whatever is left: torchrun, then its workers (each in a session of its own)
            if proc.poll() is None:
                prove.stop(proc, out_dir, "crashed")
        seconds = time.perf_counter() - start
        output = ""
        for log in logs:
            log.seek(0)
            output += log.read()
            log.close()
        finals = [os.path.join(out_dir, f"crashed-rank{r}.pt") for r in range(prove.WORLD)]
        same = all(os.path.exists(f) for f in finals) and all(
            torch.equal(torch.load(f, weights_only=True)["state"][k], ref[k])
            for f, ref in zip(finals, reference) for k in ref)
        restarted = os.path.exists(os.path.join(out_dir, "crashed-killed"))
    if not hung and all(p.returncode == 0 for p in procs) and restarted and same:
        return True, None, seconds
    kind = next((what for pattern, what in FAILURE_KINDS if re.search(pattern, output)),
                "other" if not all(p.returncode == 0 for p in procs) or hung else "weights differ")
    return False, ("hung: killed after --trial-timeout; " if hung else "") + kind, seconds


def main(argv=None):
    args = parse_args(argv)
    prove.refuse_without_torchrun()
    lock = open(args.lock, "a") if args.lock else None
    print(f"crash-and-restart trials ({', '.join(f'{v} x{n}' for v, n in args.variants.items())}) on "
          f"{course.hardware()}", flush=True)
    reference = reference_weights(args)
    results = {}
    for variant, trials in args.variants.items():
        outcomes = []
        for trial in range(1, trials + 1):
            if lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                passed, kind, seconds = run_trial(variant, args, reference)
            finally:
                if lock:
                    fcntl.flock(lock, fcntl.LOCK_UN)
            outcomes.append((passed, kind, seconds))
            print(f"{variant:10s} trial {trial:2d}/{trials}: {'passed' if passed else 'FAILED: ' + kind} "
                  f"({seconds:.1f} s)", flush=True)
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
                json.dump({"hardware": course.hardware(), "date": time.strftime("%Y-%m-%d"),
                           "kill_step": prove.kill_schedule(2)[1], "script_timeout_s": args.timeout,
                           "trial_timeout_s": args.trial_timeout, "results": results}, f, indent=1)
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
