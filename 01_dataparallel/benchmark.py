"""Lesson 01's CPU timing, repeated: how much do threads buy, and how much does that vary from run to run?

    python 01_dataparallel/benchmark.py                      # three sizes, 5 runs each (minutes on 2 cores)
    python 01_dataparallel/benchmark.py --sizes 1024x512 --runs 3
    python 01_dataparallel/benchmark.py --plot-only                # redraw benchmark.png from benchmark.json

Each run times one training step three ways, under torch.set_num_threads(1) and (cores): the unwrapped MLP, and a
hand-written DataParallel step with its replicas one after another (1 thread) or in N threads (median of the
repeats per variant). Results are merged into benchmark.json (one entry per size) and plotted in benchmark.png,
next to this file. A benchmark, not a test; NOTES.md reads the committed benchmark.json.

This file is standalone: it carries its own copy of the timed step (the one commit 445f873's dataparallel.py
timed, which measured the committed benchmark.json), so the lesson stays short and the numbers stay reproducible.
The lesson's own hand-written step (dataparallel.py) does the same five things; it makes its module shells at
every step, where this one makes them once.
"""
import argparse
import copy
import functools
import json
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn as nn
from torch.func import functional_call

HERE = os.path.dirname(os.path.abspath(__file__))
REPEATS = {"64x32": 200, "1024x512": 30, "2048x2048": 10}  # timed steps per run: more for the fast sizes
REPLICAS = 2


class Net(nn.Module):
    """An MLP that can say, from inside forward(), how many rows it got, on which device and in which thread."""
    report = False  # a class attribute: switching it on makes every copy print, replicas included

    def __init__(self, hidden):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x):
        if Net.report:  # one write per line: replicas print from several threads at once
            sys.stdout.write(f"  inside forward: {x.shape[0]} rows on {x.device} ({threading.current_thread().name})\n")
        return self.layers(x)


def make_model(hidden):
    torch.manual_seed(0)
    return Net(hidden)


def make_batch(batch_size, step=0):
    x = torch.randn(batch_size, 20, generator=torch.Generator().manual_seed(step))
    return x, (x @ torch.randn(20, 4, generator=torch.Generator().manual_seed(1234))).argmax(dim=1)  # a learnable rule


def scatter(inputs, n):
    """1. scatter: chunk every input along dim 0 (on GPUs each chunk is also copied to its device)."""
    return list(zip(*(t.chunk(n) for t in inputs)))  # fewer than n chunks when the batch is small, as in DataParallel


def replicate(module, shells, detach=False):
    """2. replicate, at EVERY step: a differentiable copy of each parameter for each replica (on GPUs, one per device).
    A copy's backward hands its gradient to the original parameter, where autograd sums the replicas' gradients.
    functional_call swaps the copies into the module it is given, so each replica gets its own shell: two threads
    must never swap tensors in the same module."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    replicas = []
    for i, shell in enumerate(shells):
        cut_off = detach and i > 0  # --detach-demo: like a copy.deepcopy(model), unconnected to the original
        copies = {name: t.detach().clone() if cut_off else t.clone() for name, t in tensors.items()}
        replicas.append(functools.partial(functional_call, shell, copies))
    return replicas


def parallel_apply(replicas, chunks, threaded=True):
    """3. parallel_apply: each replica on its chunk, each in its own thread (threaded=False: one after another)."""
    results, grad_enabled = [None] * len(replicas), torch.is_grad_enabled()  # grad mode is per thread: hand it on

    def work(i):
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replicas[i](chunks[i])
        except Exception as e:  # re-raised in the calling thread below, as nn.DataParallel does
            results[i] = e

    if threaded:
        threads = [threading.Thread(target=work, args=(i,), name=f"replica {i}") for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(replicas)):
            work(i)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def gather(outputs):
    """4. gather: concatenate the outputs on one device (nn.DataParallel: output_device, default device_ids[0]).
    0-dim outputs (a loss) become a vector with one entry per replica, as in nn.DataParallel."""
    return torch.stack(outputs) if outputs[0].dim() == 0 else torch.cat(outputs)


def hand_written_data_parallel(module, shells, *inputs, threaded=True, detach=False):
    """Steps 1 to 4. Step 5, backward, is autograd's: loss.backward() on the gathered output flows back through each
    replica's copies and is summed into module's .grad (on GPUs, nn.DataParallel sums them onto device_ids[0])."""
    chunks = scatter(inputs, len(shells))
    return gather(parallel_apply(replicate(module, shells[:len(chunks)], detach), chunks, threaded))


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def time_variants(variants, x, y, repeats, sync=lambda: None):
    """Median seconds of the forward and of the backward of one step, per variant. The variants take turns, so that
    drift in the machine's speed hits them all alike; the first 2 rounds warm up."""
    times = {name: ([], []) for name in variants}
    for round_ in range(repeats + 2):
        for name, forward in variants.items():
            start = time.perf_counter()
            out = forward(x)
            sync()
            middle = time.perf_counter()
            nn.functional.cross_entropy(out, y).backward()
            sync()
            if round_ >= 2:
                times[name][0].append(middle - start)
                times[name][1].append(time.perf_counter() - middle)
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


def time_on_cpu(hidden, batch, repeats, replicas=REPLICAS, quiet=False):
    """The unwrapped model, and the hand-written step with its replicas one after another (1 thread) and in N threads,
    under torch.set_num_threads(1) and (cores). Returns {intra-op threads: {variant: (forward s, backward s)}}."""
    model, (x, y) = make_model(hidden), make_batch(batch)
    shells, n = [copy.deepcopy(model) for _ in range(replicas)], replicas
    variants = {"unwrapped": model,
                "1 thread": lambda x: hand_written_data_parallel(model, shells, x, threaded=False),
                f"{n} threads": lambda x: hand_written_data_parallel(model, shells, x, threaded=True)}
    before, cores, results = torch.get_num_threads(), os.cpu_count() or 1, {}
    try:
        for intra in sorted({1, cores}):
            torch.set_num_threads(intra)  # intra-op threads per calling thread: N replica threads use up to N x intra cores
            results[intra] = time_variants(variants, x, y, repeats)
    finally:
        torch.set_num_threads(before)
    if quiet:
        return results
    print(f"timing on {cpu_name()} ({cores} cores), torch {torch.__version__}: mlp 20-{hidden}-{hidden}-4, "
          f"batch {batch}, median of {repeats} steps, forward | backward in ms")
    for intra, t in results.items():
        (f1, b1), (fn, bn) = t["1 thread"], t[f"{n} threads"]
        print(f"  torch.set_num_threads({intra}): " + "; ".join(f"{k} {f * 1e3:.2f} | {b * 1e3:.2f}" for k, (f, b) in t.items())
              + f"; {n} threads vs 1: forward {f1 / fn:.2f}x, whole step {(f1 + b1) / (fn + bn):.2f}x as fast")
    return results


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
        runs = []
        for run in range(args.runs):
            t = time_on_cpu(int(hidden), int(batch), repeats, quiet=True)  # summarised below
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
