"""Lesson 06 benchmark: what gradient communication costs on this machine, measured, modelled and plotted.

    python 06_collectives/bench.py --part allreduce   # all-reduce time and bus bandwidth, 1 KiB to 64 MiB, 2 ranks
    python 06_collectives/bench.py --part scaling     # resnet18: DDP step = compute + communication; weak scaling + model
    python 06_collectives/bench.py --part buckets     # DDP bucket_cap_mb sweep
    python 06_collectives/bench.py --plot             # only redraw the PNGs from the JSON

Not a test. Each run of a part is appended to bench_results.json next to this file (so repeated runs show the
spread), and the PNGs are redrawn. Run it when nothing else uses the CPU (the course uses `flock /tmp/cpu.lock`).
"""
import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = [2 ** k for k in range(10, 27)]  # 1 KiB ... 64 MiB
BATCHES = [8, 16, 32, 64, 128]  # the range the targets were set for
EXTRA_BATCHES = [256]  # beyond it: to test where the model says efficiency reaches 0.90
CAPS = [1, 5, 25, 100, None]  # bucket_cap_mb; None = DDP's default (25 MiB, and 1 MiB for the first bucket)
DDP_TIMERS = ("forward_compute_time", "backward_compute_time", "backward_comm_time", "backward_compute_comm_overlap_time")


# The ring this benchmark measured (bench_results.json): lesson 06's ring as of commit 445f873, with
# isend/irecv posted apart and a reusable receive buffer. The lesson's ring now posts each step as one
# batch_isend_irecv and allocates its buffer per call: it was not timed here.

def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def exchange(send, recv, right, left):
    """Send to the right neighbour while receiving from the left one. Both are posted before either waits:
    two blocking dist.send calls facing each other wait forever (gloo's send waits for the matching recv)."""
    requests = [dist.isend(send, right), dist.irecv(recv, left)]
    for request in requests:
        request.wait()


def ring_all_reduce(tensor, scratch=None):
    """Sum `tensor` over all ranks, in place, the way NCCL and gloo do: cut it into N chunks, then
    N-1 reduce-scatter steps and N-1 all-gather steps around the ring. Returns the bytes this rank sent.
    tensor must be contiguous (the chunks are views into it). scratch: a receive buffer of at least ceil(numel / N) elements to reuse across calls (fresh memory costs page faults)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views into `tensor`; sizes differ by at most one element
    scratch = torch.empty_like(chunks[0]) if scratch is None else scratch  # chunk 0 is the largest
    sent = 0
    for step in range(world - 1):  # reduce-scatter: afterwards rank r holds the full sum of chunk r+1
        outgoing, incoming = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        exchange(outgoing, scratch[:incoming.numel()], right, left)
        incoming += scratch[:incoming.numel()]
        sent += outgoing.numel() * outgoing.element_size()
    for step in range(world - 1):  # all-gather: pass each finished chunk once around the ring
        outgoing, incoming = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        exchange(outgoing, incoming, right, left)
        sent += outgoing.numel() * outgoing.element_size()
    return sent


def tutorial_ring_all_reduce(tensor):
    """The official tutorial's ring ("Writing Distributed Applications with PyTorch"): correct, but it passes
    the WHOLE tensor N-1 times around the ring, so each rank sends (N-1) * S bytes instead of 2(N-1)/N * S."""
    world, rank = dist.get_world_size(), dist.get_rank()
    outgoing, incoming, sent = tensor.clone(), torch.empty_like(tensor), 0
    for _ in range(world - 1):
        exchange(outgoing, incoming, (rank + 1) % world, (rank - 1) % world)
        tensor += incoming
        outgoing, incoming = incoming, outgoing  # forward what just arrived
        sent += tensor.numel() * tensor.element_size()
    return sent


def machine():
    cpu = platform.processor() or "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), cpu)
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def spawn(task, world, *task_args):
    """Run task(rank, world, *task_args) on `world` gloo ranks with 1 thread each; returns what rank 0 returned."""
    with tempfile.TemporaryDirectory(prefix="bench_") as scratch:
        mp.spawn(_entry, args=(world, find_free_port(), scratch, task, task_args), nprocs=world, join=True)
        return torch.load(os.path.join(scratch, "result.pt"), weights_only=True)


def _entry(rank, world, port, scratch, task, task_args):
    torch.set_num_threads(1)  # 1 thread per rank: 2 ranks fill the 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = task(rank, world, *task_args)
        if rank == 0:
            torch.save(result, os.path.join(scratch, "result.pt"))
    finally:
        dist.destroy_process_group()


def slowest(seconds):
    """The slowest rank's time: a collective is finished when its last rank is."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_collective(fn, numel, repeats, budget_bytes=2 ** 24):
    """`repeats` samples of the seconds per call of fn(x), x a float32 tensor of numel elements."""
    x = torch.zeros(numel)  # zeros: repeated in-place sums never overflow
    iters = max(1, min(50, budget_bytes // (4 * numel)))
    fn(x)  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn(x)
        samples.append(slowest((time.perf_counter() - start) / iters))
    return samples


def implementations(largest_numel):
    scratch = torch.empty(largest_numel // 2 + 1)  # the ring's receive buffer, allocated once, as gloo and NCCL do
    return {"dist.all_reduce": dist.all_reduce, "ring (this lesson)": lambda x: ring_all_reduce(x, scratch=scratch),
            "tutorial ring (unchunked)": tutorial_ring_all_reduce}


def allreduce_task(rank, world, sizes, repeats):
    todo = implementations(max(sizes) // 4)
    for fn in todo.values():  # warm every path up, so the first size measured pays no start-up cost
        time_collective(fn, 2 ** 18, 3)
    return {name: [time_collective(fn, nbytes // 4, repeats) for nbytes in sizes] for name, fn in todo.items()}


def quick_point(nbytes=2 ** 20, repeats=5):
    """One small point of part 1 (the notebook reruns it): median seconds per call for each implementation."""
    timings = spawn(allreduce_task, 2, [nbytes], repeats)
    return {name: statistics.median(samples[0]) for name, samples in timings.items()}


def make_resnet():
    from torchvision.models import resnet18
    torch.manual_seed(0)
    return resnet18(num_classes=10)


def time_steps(model, batch, steps, warmup=3, no_sync=False, alone=False):
    """Seconds per training step (forward, backward, SGD step) on a fixed random batch of 32x32 images.
    alone=True: only this rank is training (no collective at all, not even to compare times)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    samples = []
    for i in range(warmup + steps):  # DDP rebuilds its buckets after the first step: the warm-up covers that
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with model.no_sync() if no_sync else contextlib.nullcontext():  # no_sync: no communication at all
            nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if i >= warmup:
            samples.append(time.perf_counter() - start)
    return samples if alone else [slowest(t) for t in samples]


def make_ddp(**kwargs):
    model = DDP(make_resnet(), **kwargs)
    model._set_ddp_runtime_logging_sample_rate(1)  # a prototype API: let DDP's logger time every step
    return model


def ddp_timers(model):
    """DDP's own logger, last step: forward, backward, communication (first bucket sent to last one done) and the
    part of that communication window that overlapped backward, in ms; and the bucket sizes in bytes."""
    data = model._get_ddp_logging_data()  # a prototype API; we only read it
    return {key: data.get(key, 0) / 1e6 for key in DDP_TIMERS} | {"buckets": data.get("rebuilt_bucket_sizes", "")}


def scaling_task(rank, world, batches, steps, rounds):
    """Interleaved, batch by batch and round after round, so that slow drift of the machine hits everything alike:
    alone: rank 0 trains a plain resnet18 while rank 1 waits (the 1-rank baseline, one core idle);
    compute: both ranks train DDP under no_sync() (no communication); step: both train DDP normally;
    then the all-reduce of all the gradients alone, and at batch 128 DDP variants that cut the communication."""
    plain, ddp = make_resnet(), make_ddp()
    grad_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    variants = {"default": make_ddp(), "gradient_as_bucket_view=True": make_ddp(gradient_as_bucket_view=True),
                "bf16_compress_hook": make_ddp(), "bf16_compress_hook + gradient_as_bucket_view": make_ddp(gradient_as_bucket_view=True)}
    for name, model in variants.items():
        if name.startswith("bf16"):
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)  # all-reduce in bfloat16: half the bytes
    out = {key: [[] for _ in batches] for key in ("alone", "compute", "step")}
    out |= {"allreduce_grads": [], "grad_bytes": grad_bytes, "timers": [None] * len(batches),
            "variants_at_128": {name: [] for name in variants}, "alone_at_128": []}
    for _ in range(rounds):
        for i, batch in enumerate(batches):
            if rank == 0:
                out["alone"][i] += time_steps(plain, batch, steps, alone=True)
            dist.barrier()  # rank 1 waits here meanwhile
            out["compute"][i] += time_steps(ddp, batch, steps, no_sync=True)
            out["step"][i] += time_steps(ddp, batch, steps)
            out["timers"][i] = ddp_timers(ddp)
        out["allreduce_grads"] += time_collective(dist.all_reduce, grad_bytes // 4, 10)
        for name, model in variants.items():
            out["variants_at_128"][name] += time_steps(model, 128, steps)
        if rank == 0:
            out["alone_at_128"] += time_steps(plain, 128, steps, alone=True)
        dist.barrier()
    return out


def separate_world1_task(rank, world, batches, steps):
    return [time_steps(make_resnet(), batch, steps, alone=True) for batch in batches]


def run_scaling(results, steps=10, rounds=3):
    batches = BATCHES + EXTRA_BATCHES
    run = spawn(scaling_task, 2, batches, steps, rounds) | {"batches": batches, "steps": steps, "rounds": rounds}
    run["world1_separate"] = spawn(separate_world1_task, 1, batches, steps)  # a cross-check of the "alone" baseline
    results.setdefault("scaling", []).append(run)
    for line in scaling_lines(run):
        print(line)


def scaling_numbers(run):
    """Per batch: t1 (1 rank), c2 (2 ranks, compute only), t2 (DDP step); measured and modelled efficiency."""
    a = statistics.median(run["allreduce_grads"])
    rows = []
    for b, t1, c2, t2, sep in zip(run["batches"], run["alone"], run["compute"], run["step"], run["world1_separate"]):
        t1, c2, t2, sep = map(statistics.median, (t1, c2, t2, sep))
        rows.append({"batch": b, "t1": t1, "c2": c2, "t2": t2, "t1_separate": sep, "efficiency": t1 / t2,
                     "model": t1 / (c2 + a), "naive_model": t1 / (t1 + a), "ceiling": t1 / c2})
    return a, rows


def scaling_lines(run):
    a, rows = scaling_numbers(run)
    yield (f"gradients {run['grad_bytes'] / 2 ** 20:.1f} MiB; their all-reduce alone: {a * 1e3:.0f} ms "
           f"(median of {len(run['allreduce_grads'])}, {min(run['allreduce_grads']) * 1e3:.0f} to {max(run['allreduce_grads']) * 1e3:.0f})")
    for r in rows:
        yield (f"batch {r['batch']:4d}: 1 rank {r['t1'] * 1e3:5.0f} ms (separate run {r['t1_separate'] * 1e3:5.0f}); 2 ranks: compute "
               f"{r['c2'] * 1e3:5.0f} ms, DDP step {r['t2'] * 1e3:5.0f} ms; efficiency {r['efficiency']:.2f}, "
               f"model {r['model']:.2f} ({r['model'] / r['efficiency'] - 1:+.0%}), naive model {r['naive_model']:.2f}")
    t1 = statistics.median(run["alone_at_128"])
    for name, samples in run["variants_at_128"].items():
        yield f"batch 128, DDP {name}: step {statistics.median(samples) * 1e3:.0f} ms, efficiency {t1 / statistics.median(samples):.2f} (1 rank: {t1 * 1e3:.0f} ms)"


def buckets_task(rank, world, batch, steps, caps):
    out = {"compute": [], "step": {str(c): [] for c in caps}, "timers": {}}
    for order in (caps, caps[::-1]):  # each cap twice, in both orders, so that slow drift cancels
        for cap in order:
            model = make_ddp(bucket_cap_mb=cap)
            out["step"][str(cap)] += time_steps(model, batch, steps)
            out["timers"][str(cap)] = ddp_timers(model)
        out["compute"] += time_steps(model, batch, steps, no_sync=True)
    return out


def run_buckets(results, batch=32, steps=10):
    run = spawn(buckets_task, 2, batch, steps, CAPS) | {"batch": batch, "steps": steps, "caps": [str(c) for c in CAPS]}
    results.setdefault("buckets", []).append(run)
    print(f"bucket_cap_mb sweep, resnet18, batch {batch} per rank, 2 ranks; compute alone {statistics.median(run['compute']) * 1e3:.0f} ms")
    for cap in run["caps"]:
        n = len(run["timers"][cap]["buckets"].split(","))
        print(f"bucket_cap_mb={cap:>4}: step {statistics.median(run['step'][cap]) * 1e3:5.0f} ms, {n} buckets")


def pooled(runs):
    """All runs of the scaling part merged into one: every sample of every run, per batch."""
    merged = dict(runs[0])
    for key in ("alone", "compute", "step", "world1_separate"):
        merged[key] = [sum((run[key][i] for run in runs), []) for i in range(len(runs[0]["batches"]))]
    for key in ("allreduce_grads", "alone_at_128"):
        merged[key] = sum((run[key] for run in runs), [])
    merged["variants_at_128"] = {name: sum((run["variants_at_128"][name] for run in runs), []) for name in runs[0]["variants_at_128"]}
    return merged


def allreduce_medians(results):
    """Per implementation, the median seconds per size over all samples of all runs; and the per-run 64 MiB ratios."""
    runs = results["allreduce"]
    sizes = runs[0]["bytes"]
    samples = {name: [sum((run["seconds"][name][i] for run in runs), []) for i in range(len(sizes))] for name in runs[0]["seconds"]}
    ratios = [statistics.median(r["seconds"]["ring (this lesson)"][-1]) / statistics.median(r["seconds"]["dist.all_reduce"][-1]) for r in runs]
    return sizes, samples, ratios


def targets(results):
    """The targets set when the lesson was planned, each with its measured figure and a verdict: (name, measured, target, met)."""
    out = []
    if "allreduce" in results:
        sizes, samples, ratios = allreduce_medians(results)
        ratio = statistics.median(samples["ring (this lesson)"][-1]) / statistics.median(samples["dist.all_reduce"][-1])
        out.append(("ring / dist.all_reduce time at 64 MiB, 2 ranks", f"{ratio:.2f} (runs: {', '.join(f'{r:.2f}' for r in ratios)})",
                    "<= 1.25", ratio <= 1.25))
    if "scaling" in results:
        _, rows = scaling_numbers(pooled(results["scaling"]))
        in_range = [r for r in rows if r["batch"] in BATCHES]
        worst = max(in_range, key=lambda r: abs(r["model"] / r["efficiency"] - 1))
        error = abs(worst["model"] / worst["efficiency"] - 1)
        out.append(("performance model vs measured efficiency, batch 8 to 128",
                    f"{error:.0%} at most (batch {worst['batch']}: model {worst['model']:.2f}, measured {worst['efficiency']:.2f}); "
                    + ", ".join(f"{r['batch']}: {r['model'] / r['efficiency'] - 1:+.0%}" for r in in_range), "within 10%", error <= 0.10))
        at128 = rows[BATCHES.index(128)]
        per_run = [scaling_numbers(run)[1][BATCHES.index(128)]["efficiency"] for run in results["scaling"]]
        out.append(("weak-scaling efficiency at batch 128, 2 ranks vs 1",
                    f"{at128['efficiency']:.2f} (runs: {', '.join(f'{e:.2f}' for e in per_run)})", ">= 0.90", at128["efficiency"] >= 0.90))
    return out


def _where(results):
    m = results["machine"]
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, gloo, 1 thread per rank"


def fig_allreduce(results):
    import matplotlib.pyplot as plt
    sizes, samples, _ = allreduce_medians(results)
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, per_size in samples.items():
        med = [statistics.median(s) for s in per_size]
        err = [[m - min(s) for m, s in zip(med, per_size)], [max(s) - m for m, s in zip(med, per_size)]]
        ax_t.errorbar(sizes, [t * 1e3 for t in med], yerr=[[e * 1e3 for e in side] for side in err], marker="o", ms=3, capsize=2, label=name)
        ax_b.plot(sizes, [b / t / 1e9 for b, t in zip(sizes, med)], marker="o", ms=3, label=name)  # busbw = algbw * 2(N-1)/N = algbw at N = 2
    ax_t.set(xscale="log", yscale="log", xlabel="message size S", ylabel="time per all-reduce (ms)",
             title=f"time (median of {len(results['allreduce'])} runs x 7; bars: min to max)")
    ax_b.set(xscale="log", xlabel="message size S", ylabel="bus bandwidth (GB/s)", title="bus bandwidth = S/t * 2(N-1)/N (= S/t at N = 2)")
    for ax in (ax_t, ax_b):
        ax.set_xticks([2 ** k for k in range(10, 27, 4)], ["1 KiB", "16 KiB", "256 KiB", "4 MiB", "64 MiB"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"All-reduce, 2 ranks on {_where(results)}")
    fig.tight_layout()
    return fig


def fig_split(results):
    import matplotlib.pyplot as plt
    a, rows = scaling_numbers(pooled(results["scaling"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = range(len(rows))
    per = lambda key: [r[key] / r["batch"] * 1e3 for r in rows]  # ms per sample: comparable across batch sizes
    c2, exposed = per("c2"), [(r["t2"] - r["c2"]) / r["batch"] * 1e3 for r in rows]
    ax.bar([i - 0.2 for i in x], per("t1"), 0.4, color="tab:gray", label="1 rank: step (all compute)")
    ax.bar([i + 0.2 for i in x], c2, 0.4, color="tab:blue", label="2 ranks: compute (the DDP step under no_sync)")
    ax.bar([i + 0.2 for i in x], exposed, 0.4, bottom=c2, color="tab:red", label="2 ranks: communication (DDP step - compute)")
    for i, r in enumerate(rows):
        ax.annotate(f"{(r['t2'] - r['c2']) * 1e3:.0f} ms\n{(r['t2'] - r['c2']) / r['t2']:.0%}", (i + 0.2, r["t2"] / r["batch"] * 1e3),
                    ha="center", va="bottom", fontsize=8)
    ax.text(0.98, 0.6, f"all-reduce of the {results['scaling'][-1]['grad_bytes'] / 2 ** 20:.1f} MiB\nof gradients alone: {a * 1e3:.0f} ms",
            transform=ax.transAxes, ha="right", fontsize=9)
    ax.set(xticks=list(x), xticklabels=[r["batch"] for r in rows], xlabel="batch per rank", ylabel="ms per sample (step time / batch)",
           ylim=(0, max(r["t2"] / r["batch"] for r in rows) * 1e3 * 1.2),
           title="resnet18 32x32: one training step, compute and communication (medians)\n(labels: communication per step, and its share of the step)")
    ax.legend(fontsize=8)
    fig.suptitle(_where(results), fontsize=9)
    fig.tight_layout()
    return fig


def fig_scaling(results):
    import matplotlib.pyplot as plt
    merged = pooled(results["scaling"])
    _, rows = scaling_numbers(merged)
    batches = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for k, run in enumerate(results["scaling"]):
        ax.plot(batches, [r["efficiency"] for r in scaling_numbers(run)[1]], "o", color="black", alpha=0.4, ms=4,
                label="measured, each run" if k == 0 else None)
    ax.plot(batches, [r["efficiency"] for r in rows], "o-", color="black", label="measured, all runs pooled")
    ax.plot(batches, [r["model"] for r in rows], "s--", color="tab:blue", label="model: compute at 2 ranks + all-reduce alone")
    ax.plot(batches, [r["naive_model"] for r in rows], "^:", color="tab:orange", label="naive model: compute at 1 rank + all-reduce alone")
    ax.plot(batches, [r["ceiling"] for r in rows], "-", color="tab:gray", alpha=0.6, label="ceiling: compute at 2 ranks, no communication")
    alone = statistics.median(merged["alone_at_128"])
    for name, marker in (("default", "o"), ("bf16_compress_hook", "D"), ("bf16_compress_hook + gradient_as_bucket_view", "*")):
        ax.plot([128 * 1.08], [alone / statistics.median(merged["variants_at_128"][name])], marker, ms=8, mfc="none" if name == "default" else None,
                label=f"batch 128, DDP {'default (again)' if name == 'default' else 'with ' + name}")
    ax.axhline(0.9, color="tab:green", ls="--", alpha=0.7, label="target 0.90")
    ax.axvspan(BATCHES[-1] * 1.25, batches[-1] * 1.2, color="0.93", label="beyond the planned range")
    ax.set(xscale="log", xticks=batches, xticklabels=batches, ylim=(0, 1.02), xlabel="batch per rank",
           ylabel="efficiency = throughput(2) / (2 x throughput(1))", title="Weak scaling of resnet18 32x32, 1 -> 2 ranks")
    ax.minorticks_off()
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(_where(results), fontsize=9)
    fig.tight_layout()
    return fig


def fig_buckets(results):
    import matplotlib.pyplot as plt
    runs = results["buckets"]
    caps = runs[0]["caps"]
    step = {c: statistics.median(sum((r["step"][c] for r in runs), [])) * 1e3 for c in caps}
    compute = statistics.median(sum((r["compute"] for r in runs), [])) * 1e3
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.bar(range(len(caps)), [step[c] for c in caps], color="tab:red", alpha=0.5, label="DDP step, median of all runs")
    for k, r in enumerate(runs):
        ax.plot(range(len(caps)), [statistics.median(r["step"][c]) * 1e3 for c in caps], "o", color="black", ms=4,
                label="median of each run" if k == 0 else None)
    ax.axhline(compute, color="tab:blue", label="compute alone (no_sync)")
    for i, c in enumerate(caps):
        t = runs[-1]["timers"][c]
        n = len(t["buckets"].split(","))
        ax.annotate(f"{n} bucket{'s' if n > 1 else ''}\n{t['backward_compute_comm_overlap_time'] / max(t['backward_comm_time'], 1e-9):.0%} of the\n"
                    f"comm window\ninside backward", (i, compute * 0.5), ha="center", va="center", fontsize=8)
    ax.set(xticks=range(len(caps)), xticklabels=[f"{c} MiB" if c != "None" else "default\n(25, first 1)" for c in caps],
           xlabel="bucket_cap_mb", ylabel="ms per step", ylim=(0, max(step.values()) * 1.3),
           title=f"DDP bucket size sweep, resnet18 32x32, batch {runs[0]['batch']} per rank, 2 ranks")
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.suptitle(_where(results), fontsize=9)
    fig.tight_layout()
    return fig


def plot(results, folder=HERE):
    """Redraw the PNGs from the results; every figure names the machine it ran on."""
    import matplotlib.pyplot as plt
    for part, name, draw in (("allreduce", "allreduce", fig_allreduce), ("scaling", "ddp_split", fig_split),
                             ("scaling", "scaling", fig_scaling), ("buckets", "buckets", fig_buckets)):
        if part in results:
            fig = draw(results)
            fig.savefig(os.path.join(folder, f"bench_{name}.png"), dpi=90)
            plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", choices=["allreduce", "scaling", "buckets"], default=[], help="which measurements to run")
    p.add_argument("--plot", action="store_true", help="only redraw the PNGs from the JSON")
    p.add_argument("--results", default=os.path.join(HERE, "bench_results.json"), help="the JSON file runs are appended to")
    p.add_argument("--fresh", action="store_true", help="drop earlier runs of the parts being run")
    args = p.parse_args(argv)
    if not args.part and not args.plot:
        p.error("say what to run: --part allreduce scaling buckets, or --plot")
    if args.plot and not os.path.exists(args.results):
        p.error(f"no results to plot: {args.results} does not exist")
    results = json.load(open(args.results)) if os.path.exists(args.results) else {}
    for part in args.part:
        if args.fresh:
            results.pop(part, None)
        start = time.perf_counter()
        if part == "allreduce":
            timings = spawn(allreduce_task, 2, SIZES, 7)
            results.setdefault("allreduce", []).append({"world": 2, "bytes": SIZES, "seconds": timings})
            ar, ring = (statistics.median(timings[k][-1]) for k in ("dist.all_reduce", "ring (this lesson)"))
            print(f"at 64 MiB: dist.all_reduce {ar * 1e3:.1f} ms, ring {ring * 1e3:.1f} ms; ring / all_reduce = {ring / ar:.2f}")
        elif part == "scaling":
            run_scaling(results)
        else:
            run_buckets(results)
        print(f"part {part} took {time.perf_counter() - start:.0f} s")
        results["machine"] = machine()
        with open(args.results, "w") as f:
            json.dump(results, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")  # files only, no window
    plot(results, os.path.dirname(os.path.abspath(args.results)))
    for name, measured, target, met in targets(results):
        print(f"target {'MET' if met else 'NOT MET'}: {name}: {measured} (target {target})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
