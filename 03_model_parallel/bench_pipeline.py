"""Benchmark for lesson 03: the naive split vs GPipe vs 1F1B, m = 1, 2, 4, 8 micro-batches, 2 processes.

    python 03_model_parallel/bench_pipeline.py                 # about 2 minutes on 2 CPU cores
    python 03_model_parallel/bench_pipeline.py --out-dir /tmp/bench --repeats 5

Not a test: run it on an otherwise idle machine (here: under `flock /tmp/cpu.lock`) and commit what it writes:
bench_results.json, bench_results.csv and timeline.png (naive, GPipe m=4 and 1F1B m=4 on one chart).

The ideal comes from the bubble formula. A p-stage pipeline with m micro-batches takes (m + p - 1)/m of one
stage's full-batch time T; the naive split takes p*T (one stage works while the other waits). So the ideal
speed-up over the naive split is p*m/(m + p - 1): 1.33x for m=2, 1.6x for m=4, 1.78x for m=8 with p = 2.
"""
import argparse
import csv
import json
import os
import resource
import sys
import tempfile
import time

import torch

import model_parallel as lesson

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = 2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="hidden width (default 512: one weight matrix is 1 MiB, it fits the 2 MiB L2 cache)")
    p.add_argument("--layers", type=int, default=4, help="Linear+ReLU layers per stage (default 4)")
    p.add_argument("--batch-size", type=int, default=2048, help="batch of one step, split into m micro-batches (default 2048)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8], help="values of m to measure (default 1 2 4 8)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per variant, interleaved, after one warm-up step (default 10)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="as in model_parallel.py (default auto)")
    p.add_argument("--target", type=float, default=0.85, help="fraction of the ideal speed-up GPipe m=4 should reach (default 0.85)")
    p.add_argument("--out-dir", default=HERE, help="where to write the JSON, CSV and PNG (default: next to this script)")
    args = p.parse_args(argv)
    bad = [m for m in args.microbatches if m < 1 or args.batch_size % m]
    if bad:
        p.error(f"every --microbatches value must be at least 1 and divide --batch-size {args.batch_size}; bad: {bad}")
    lesson_args = lesson.parse_args(["--part", "pipeline", "--width", str(args.width), "--layers", str(args.layers),
                                     "--batch-size", str(args.batch_size), "--microbatches", str(STAGES),
                                     "--repeats", str(args.repeats), "--device", args.device, "--timeout", "300"])
    return args, lesson_args


def cpu_seconds():
    """(seconds all CPUs were busy, seconds our finished child processes used), from /proc/stat and getrusage."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError):
        busy = float("nan")  # not Linux: the check is skipped
    return busy, children.ru_utime + children.ru_stime


def main(argv=None):
    args, lesson_args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    # Schedule1F1B refuses m < p ("Number of microbatches (1) must be greater than or equal to the number of stages (2)").
    variants = [("naive", 1)] + [("GPipe", m) for m in args.microbatches] + [("1F1B", m) for m in args.microbatches if m >= STAGES]
    kind, reason = lesson_args.devices["pipeline"]
    hardware = {"cpu": lesson.cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "device": kind,
                "backend": "nccl" if kind == "cuda" else "gloo", "threads_per_rank": max(1, (os.cpu_count() or 1) // STAGES)}
    print(f"pipeline benchmark: {STAGES} processes, {hardware['backend']} on {kind} ({reason}); {hardware['cpu']}, "
          f"{hardware['cores']} cores, {hardware['threads_per_rank']} thread(s) per rank, torch {hardware['torch']}")
    print(f"model: 2 stages of {args.layers} x [Linear({args.width}, {args.width}) + ReLU] (+ Linear({args.width}, 10)); "
          f"batch {args.batch_size}; {args.repeats} timed steps per variant, interleaved")
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as scratch:
        (busy0, ours0), start = cpu_seconds(), time.perf_counter()
        if not lesson.spawn(lesson.pipeline_worker, STAGES, lesson_args, scratch, variants):
            return 1
        (busy1, ours1), wall = cpu_seconds(), time.perf_counter() - start
        results = lesson.load_pipeline_results(scratch)
    # Timings are only meaningful on an otherwise idle machine: how much CPU did other processes use meanwhile?
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (wall * os.cpu_count())
    hardware["other_processes_cpu_share"] = round(others, 3)
    times = lesson.step_times(results)
    errors = lesson.pipeline_gradient_errors(lesson_args, results)
    naive = times["naive m=1"]
    busy = {k: [sum(e - s for _, _, s, e in r["events"][k]) for r in results] for k in times}
    rows = []
    for key, t in times.items():
        name, m = key.split(" m=")[0], int(key.split("=")[1])
        ideal = 1.0 if name == "naive" else STAGES * m / (m + STAGES - 1)
        per_step = [max(a, b) for a, b in zip(results[0]["times"][key], results[1]["times"][key])]
        rows.append({"variant": name, "m": m, "step_ms_median": round(t * 1e3, 2), "step_ms_min": round(min(per_step) * 1e3, 2),
                     "step_ms_max": round(max(per_step) * 1e3, 2), "speedup": round(naive / t, 3), "ideal_speedup": round(ideal, 3),
                     "fraction_of_ideal": round(naive / t / ideal, 3), "busy_ms_stage0": round(busy[key][0] * 1e3, 2),
                     "busy_ms_stage1": round(busy[key][1] * 1e3, 2), "max_grad_diff": errors[key]})
    print(f"\n{'variant':<8}{'m':>3}{'step ms (min-max)':>24}{'speed-up':>10}{'ideal':>8}{'of ideal':>10}{'busy ms stage 0 / 1':>22}")
    for r in rows:
        print(f"{r['variant']:<8}{r['m']:>3}{r['step_ms_median']:>9.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}){'':>1}"
              f"{r['speedup']:>9.2f}x{r['ideal_speedup']:>7.2f}x{r['fraction_of_ideal'] * 100:>9.0f}%"
              f"{r['busy_ms_stage0']:>12.1f} / {r['busy_ms_stage1']:.1f}")
    gpipe4 = next((r for r in rows if r["variant"] == "GPipe" and r["m"] == 4), None)
    verdict = None
    if gpipe4:
        verdict = gpipe4["fraction_of_ideal"] >= args.target
        print(f"\nGPipe m=4: {gpipe4['speedup']:.2f}x over the naive split; ideal (bubble formula) {gpipe4['ideal_speedup']:.2f}x; "
              f"{gpipe4['fraction_of_ideal'] * 100:.0f}% of ideal; target {args.target * 100:.0f}%: {'MET' if verdict else 'NOT MET'}")
    print(f"gradients vs the unsplit model: max |dg| {max(errors.values()):.1e} over all variants")
    print(f"other processes used {others * 100:.0f}% of the {os.cpu_count()} cores during the measurement"
          + (" (more than 5%: the timings above are disturbed, run it again on an idle machine)" if others > 0.05 else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_results.json"), "w") as f:
        json.dump({"hardware": hardware, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
                   "rows": rows, "target_met": verdict,
                   "step_ms_all": {k: [round(max(a, b) * 1e3, 2) for a, b in zip(results[0]["times"][k], results[1]["times"][k])]
                                   for k in times}}, f, indent=1)
    with open(os.path.join(args.out_dir, "bench_results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    shown = [k for k in ("naive m=1", "GPipe m=4", "1F1B m=4") if k in times]
    fig = lesson.plot_timeline({k: results[0]["events"][k] for k in shown}, {k: results[1]["events"][k] for k in shown}, times,
                               title=f"{hardware['cpu']}, {hardware['cores']} cores, 1 process per stage, {hardware['backend']}; "
                                     f"batch {args.batch_size}, width {args.width}, {args.layers} layers per stage")
    fig.savefig(os.path.join(args.out_dir, "timeline.png"), dpi=110)
    print(f"wrote bench_results.json, bench_results.csv and timeline.png to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
