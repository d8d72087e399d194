"""Lesson 01's CPU timing, repeated: how much do threads buy, and how much does that vary from run to run?

    python 01_dataparallel/benchmark.py                      # the README's three sizes, 5 runs each (about 5 minutes on 2 cores)
    python 01_dataparallel/benchmark.py --sizes 1024x512 --runs 3
    python 01_dataparallel/benchmark.py --plot-only                # redraw benchmark.png from benchmark.json

Each run is one call of dataparallel.time_on_cpu (median of --repeats steps per variant). Results are merged into
benchmark.json (one entry per size) and plotted in benchmark.png, next to this file. A benchmark, not a test.
"""
import argparse
import contextlib
import io
import json
import os
import statistics
import sys

import torch

from dataparallel import cpu_name, parse_args as lesson_args, time_on_cpu

HERE = os.path.dirname(os.path.abspath(__file__))
REPEATS = {"64x32": 200, "1024x512": 30, "2048x2048": 10}  # timed steps per run: more for the fast sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(REPEATS), help="HIDDENxBATCH of the timed MLP (default: 64x32 1024x512 2048x2048)")
    p.add_argument("--runs", type=int, default=5, help="runs per size (default 5)")
    p.add_argument("--plot-only", action="store_true", help="only redraw the .png from the JSON file")
    p.add_argument("--out", default=os.path.join(HERE, "benchmark.json"), help="JSON file to merge the results into (default: benchmark.json here)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    for size in args.sizes:
        parts = size.split("x")
        if len(parts) != 2 or not all(s.isdigit() and int(s) >= 2 for s in parts):
            p.error(f"--sizes takes HIDDENxBATCH with numbers of at least 2, got {size}")
    return args


def summarise(runs):
    """Per set_num_threads: the median time of each variant over the runs, and the range of the 2-vs-1-thread ratios."""
    out = {}
    for intra in runs[0]:
        variants = runs[0][intra]
        forward = [r[intra]["1 thread"][0] / r[intra]["2 threads"][0] for r in runs]
        step = [sum(r[intra]["1 thread"]) / sum(r[intra]["2 threads"]) for r in runs]
        out[intra] = {"median_ms": {v: [statistics.median(r[intra][v][i] for r in runs) * 1e3 for i in (0, 1)] for v in variants},
                      "threads_speedup_forward": [min(forward), statistics.median(forward), max(forward)],
                      "threads_speedup_step": [min(step), statistics.median(step), max(step)]}
    return out


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = list(results["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.0), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        summary, ticks, labels = results["sizes"][size]["summary"], [], []
        for k, (intra, s) in enumerate(summary.items()):
            names = list(s["median_ms"])
            xs = [k * (len(names) + 1) + i for i in range(len(names))]
            fwd = [s["median_ms"][n][0] for n in names]
            bwd = [s["median_ms"][n][1] for n in names]
            ax.bar(xs, fwd, color="tab:blue", label="forward" if k == 0 else None)
            ax.bar(xs, bwd, bottom=fwd, color="tab:orange", label="backward" if k == 0 else None)
            ticks += xs
            labels += ["unwrapped" if n == "unwrapped" else "by hand\n" + n for n in names]
            ax.text(xs[len(xs) // 2], -0.2, f"set_num_threads({intra})", transform=ax.get_xaxis_transform(), ha="center", fontsize=8)
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.set_title(f"mlp 20-{size.split('x')[0]}-{size.split('x')[0]}-4, batch {size.split('x')[1]}", fontsize=10)
        ax.set_ylabel("ms per step (median of runs)")
        ax.legend(fontsize=8)
    hw = results["hardware"]
    fig.suptitle(f"hand-written DataParallel vs unwrapped, {hw['cpu']} ({hw['cores']} cores), torch {hw['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    args = parse_args(argv)
    results = {"sizes": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    if args.plot_only:
        plot(results, os.path.splitext(args.out)[0] + ".png")
        return 0
    results["hardware"] = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__}
    for size in args.sizes:
        hidden, batch = size.split("x")
        repeats = REPEATS.get(size, 20)
        lesson = lesson_args(["--repeats", str(repeats), "--bench-hidden", hidden, "--bench-batch", batch, "--device", "cpu"])
        runs = []
        for run in range(args.runs):
            with contextlib.redirect_stdout(io.StringIO()):  # time_on_cpu prints its own table; we summarise below
                t = time_on_cpu(lesson)
            runs.append({str(intra): {v: list(fb) for v, fb in variants.items()} for intra, variants in t.items()})
            print(f"{size} run {run + 1}/{args.runs} done", flush=True)
        results["sizes"][size] = {"repeats": repeats, "runs": runs, "summary": summarise(runs)}
        for intra, s in results["sizes"][size]["summary"].items():
            cells = "; ".join(f"{v} {f:.2f} + {b:.2f} ms" for v, (f, b) in s["median_ms"].items())
            lo_f, mid_f, hi_f = s["threads_speedup_forward"]
            lo_s, mid_s, hi_s = s["threads_speedup_step"]
            print(f"{size} set_num_threads({intra}): {cells}; 2 threads vs 1: forward {mid_f:.2f}x ({lo_f:.2f}-{hi_f:.2f}), "
                  f"step {mid_s:.2f}x ({lo_s:.2f}-{hi_s:.2f})")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and its .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
