"""Benchmark for lesson 03: the naive split vs GPipe vs 1F1B, m = 1, 2, 4, 8 micro-batches, 2 processes.

    python 03_model_parallel/bench_pipeline.py                  # the committed results, idle machine
    python 03_model_parallel/bench_pipeline.py --out-dir bench_out --repeats 5
    python 03_model_parallel/bench_pipeline.py --width 32 --layers 1 --batch-size 64 --repeats 1 --out-dir bench_small

Not a test: run it on an otherwise idle machine and commit what it writes: bench_results.json,
bench_results.csv and timeline.png (naive, GPipe m=4 and 1F1B m=4 on one chart). NOTES.md says
where and with which version the committed numbers were measured.

The ideal comes from the bubble formula. A p-stage pipeline with m micro-batches takes (m + p - 1)/m
of one stage's full-batch time T; the naive split takes p*T (one stage works while the other waits).
So the ideal speed-up over the naive split is p*m/(m + p - 1): 1.33x for m=2, 1.6x for m=4, 1.78x
for m=8 with p = 2.

Timing: the step time is perf_counter() around the whole step, with ONE torch.cuda.synchronize()
at its end on a GPU. The timeline's boxes are CUDA events recorded on the stream on a GPU, read after
that one synchronize; on the CPU, perf_counter() (the CPU's work is done when the call returns).
A synchronize per micro-batch would stall the very pipeline it measures.
"""
import argparse
import csv
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

import course  # noqa: E402

try:
    import resource  # getrusage: Linux and macOS
except ImportError:  # Windows: os.times() instead
    resource = None

STAGES = 2
CLASSES = 10


def make_model(width, layers, seed=0):
    """Two stages of equal work: [Linear(w, w) + ReLU] x layers each, and a small classifier at the end."""
    torch.manual_seed(seed)  # both ranks, and the reference, start from the same weights
    block = lambda: [nn.Linear(width, width), nn.ReLU()]  # noqa: E731
    stage0 = nn.Sequential(*[m for _ in range(layers) for m in block()])
    stage1 = nn.Sequential(*[m for _ in range(layers) for m in block()], nn.Linear(width, CLASSES))
    return nn.Sequential(stage0, stage1)


def make_batch(width, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def timed(events, kind, mb, fn, *a, **kw):
    """fn(*a, **kw), appending a timeline box (kind F or B, micro-batch, start, end). On a GPU start
    and end are CUDA events recorded on the stream, resolved after the step's one synchronize
    (see resolve); on the CPU they are perf_counter() seconds."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*a, **kw)
        end.record()
    else:
        start = time.perf_counter()
        out = fn(*a, **kw)
        end = time.perf_counter()
    events.append((kind, mb, start, end))
    return out


def resolve(events, origin):
    """GPU boxes to perf_counter() seconds: `origin` is (a CUDA event, the perf_counter() when it
    was recorded on an idle GPU); call after torch.cuda.synchronize()."""
    if origin is None:
        return events
    event, wall = origin
    return [(k, mb, wall + event.elapsed_time(s) / 1e3, wall + event.elapsed_time(e) / 1e3)
            for k, mb, s, e in events]


def naive_step(rank, module, x, y, events):
    """The split across two processes, by hand: activations go forward, their gradients come back.
    One P2POp per batch_isend_irecv call: plain send/recv would work as well, on NCCL as on gloo.
    A batch matters when a rank posts several ops at once (a send and a recv that would each block:
    lesson 06's ring); their order then cannot deadlock, and NCCL runs them as one group."""
    if rank == 0:
        h = timed(events, "F", 0, module, x)
        grad_h = torch.empty_like(h)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, h.detach(), 1)]):
            work.wait()
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, grad_h, 1)]):
            work.wait()
        timed(events, "B", 0, h.backward, grad_h)  # continue the backward pass that rank 1 started
    else:
        h = torch.empty(x.shape[0], module[0].in_features, device=x.device)  # on this rank's device
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, h, 0)]):
            work.wait()
        h.requires_grad_()  # so that backward() computes d loss / d h, the gradient rank 0 needs
        loss = timed(events, "F", 0, lambda: nn.functional.cross_entropy(module(h), y))
        timed(events, "B", 0, loss.backward)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, h.grad, 0)]):
            work.wait()


def make_runner(name, m, rank, module, device):
    """(run(x, y, events), stage or None): one training step of variant `name` on this rank."""
    if name == "naive":
        return (lambda x, y, events: naive_step(rank, module, x, y, events)), None
    stage = PipelineStage(module, stage_index=rank, num_stages=STAGES, device=device)
    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[name](
        stage, n_microbatches=m, loss_fn=nn.functional.cross_entropy)
    log = {"events": []}
    for method, kind in [("forward_one_chunk", "F"), ("backward_one_chunk", "B")]:
        original = getattr(stage, method)  # wrapped, so that each micro-batch logs its box
        setattr(stage, method, lambda mb, *a, _f=original, _k=kind, **kw:
                timed(log["events"], _k, mb, _f, mb, *a, **kw))

    def run(x, y, events):
        log["events"] = events
        if rank == 0:
            schedule.step(x)  # the first stage gets the input; it splits it into m micro-batches
        else:
            schedule.step(target=y)  # the last stage gets the target, one loss per micro-batch
    return run, (stage, schedule)


def pipeline_worker(rank, port, device_type, width, layers, batch_size, repeats, variants, out_dir,
                    timeout=300):
    """Rank r holds stage r. Runs each variant (name, m) once to warm up, then `repeats` timed
    steps, interleaved; saves the step times, the last step's boxes and the gradients."""
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // STAGES))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=STAGES,
                            init_method=f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        module = make_model(width, layers)[rank].to(device)  # the unsplit model's weights, our half
        x, y = (t.to(device) for t in make_batch(width, batch_size))
        runners = {f"{name} m={m}": make_runner(name, m, rank, module, device) for name, m in variants}
        result = {"times": {k: [] for k in runners}, "events": {}, "grads": {}}
        dist.barrier()
        before = cpu_seconds()  # the measurement window, the same on both ranks (barriers)
        for repeat in range(repeats + 1):
            for key, (run, _) in runners.items():  # interleaved: a slow moment hits every variant
                module.zero_grad(set_to_none=True)  # the schedules accumulate into .grad
                events, origin = [], None
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    origin = (torch.cuda.Event(enable_timing=True), time.perf_counter())
                    origin[0].record()
                start = time.perf_counter()
                run(x, y, events)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # once per step, never per micro-batch
                if repeat > 0:
                    result["times"][key].append(time.perf_counter() - start)
                result["events"][key] = resolve(events, origin)
                result["grads"][key] = [p.grad.detach().cpu() for p in module.parameters()]
        dist.barrier()
        result["cpu"] = [b - a for a, b in zip(before, cpu_seconds())]  # busy, ours, wall
        torch.save(result, os.path.join(out_dir, f"pipeline_rank{rank}.pt"))
    finally:
        runners = None  # the stages and schedules keep the group's peers and buffers: release
        gc.collect()  # them before destroying the group
        dist.destroy_process_group()


def step_times(results):
    """Per variant: the median over repeats of the slower rank's step time, in seconds."""
    return {k: statistics.median([max(a, b) for a, b in zip(results[0]["times"][k], results[1]["times"][k])])
            for k in results[0]["times"]}


def gradient_errors(width, layers, batch_size, results):
    """Per variant: max |dg| between the two ranks' gradients and the unsplit model's."""
    reference = make_model(width, layers)
    x, y = make_batch(width, batch_size)
    nn.functional.cross_entropy(reference(x), y).backward()
    expected = [p.grad for p in reference.parameters()]
    return {k: max((a.double() - b.double()).abs().max().item()
                   for a, b in zip(results[0]["grads"][k] + results[1]["grads"][k], expected))
            for k in results[0]["grads"]}


def plot_timeline(events0, events1, times, title=None):
    """Gantt chart: one panel per variant, one row per stage, a box per micro-batch forward (F) and backward (B)."""
    import matplotlib.pyplot as plt
    keys = list(events0)
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.5 + 1.1 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        t0 = min(e[2] for e in events0[key] + events1[key])  # stage 0 starts F0: time 0
        for row, events in [(1, events0[key]), (0, events1[key])]:
            for kind, mb, start, end in events:
                ax.broken_barh([((start - t0) * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8),
                               facecolors="tab:blue" if kind == "F" else "tab:orange", edgecolor="white")
                ax.text((start + end - 2 * t0) / 2 * 1e3, row, f"{kind}{mb}", ha="center", va="center",
                        fontsize=8, color="white")
        ax.set_yticks([1, 0], ["stage 0", "stage 1"])
        ax.set_title(f"{key}: median step {times[key] * 1e3:.1f} ms; drawn: the last timed step", fontsize=10,
                     loc="left")
    axes[-1, 0].set_xlabel("ms since stage 0 started F0  (blue: forward, orange: backward, gaps: waiting)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def cpu_seconds():
    """(seconds all CPUs were busy, seconds this process used, perf_counter()), from /proc/stat and getrusage."""
    if resource:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime
    else:
        own = os.times().user + os.times().system
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError):
        busy = float("nan")  # not Linux: the check is skipped
    return busy, own, time.perf_counter()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="hidden width (default 512: one weight matrix is "
                   "1 MiB, it fits the 2 MiB L2 cache)")
    p.add_argument("--layers", type=int, default=4, help="Linear+ReLU layers per stage (default 4)")
    p.add_argument("--batch-size", type=int, default=2048, help="batch of one step, split into m micro-batches "
                   "(default 2048)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="values of m to measure (default 1 2 4 8)")
    p.add_argument("--repeats", type=int, default=10, help="timed steps per variant, interleaved, after one "
                   "warm-up step (default 10)")
    course.add_device_flag(p)
    p.add_argument("--target", type=float, default=0.85, help="fraction of the ideal speed-up GPipe m=4 should "
                   "reach (default 0.85)")
    p.add_argument("--out-dir", default=HERE, help="where to write the JSON, CSV and PNG (default: next to "
                   "this script)")
    args = p.parse_args(argv)
    if min(args.width, args.layers, args.batch_size, args.repeats) < 1:
        course.refuse("--width, --layers, --batch-size and --repeats must be positive")
    bad = [m for m in args.microbatches if m < 1 or args.batch_size % m]
    if bad:
        course.refuse(f"every --microbatches value must be at least 1 and divide --batch-size "
                      f"{args.batch_size}; bad: {bad}")
    return args


def main(argv=None):
    args = parse_args(argv)
    backend, device, reason = course.backend_for(STAGES, args.device)
    # Schedule1F1B refuses m < p ("Number of microbatches (1) must be greater than or equal to the number of stages (2)").
    variants = ([("naive", 1)] + [("GPipe", m) for m in args.microbatches]
                + [("1F1B", m) for m in args.microbatches if m >= STAGES])
    cores = os.cpu_count()
    hardware = {"hardware": course.hardware(), "cores": cores, "torch": torch.__version__, "device": device,
                "backend": backend, "threads_per_rank": max(1, (cores or 1) // STAGES)}
    print(f"pipeline benchmark: {STAGES} processes, {backend} on {device} ({reason}); {hardware['hardware']}; "
          f"{hardware['threads_per_rank']} thread(s) per rank", flush=True)
    print(f"model: 2 stages of {args.layers} x [Linear({args.width}, {args.width}) + ReLU] (+ Linear({args.width}, "
          f"{CLASSES})); batch {args.batch_size}; {args.repeats} timed steps per variant, interleaved", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as scratch:
        course.spawn_or_fail(pipeline_worker, (course.find_free_port(), device, args.width, args.layers,
                                               args.batch_size, args.repeats, variants, scratch), STAGES)
        results = [torch.load(os.path.join(scratch, f"pipeline_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    # Timings are only meaningful on an otherwise idle machine: how much CPU did other processes use meanwhile?
    busy, _, wall = results[0]["cpu"]  # rank 0's window; both ranks' own CPU seconds in it
    others = max(0.0, busy - results[0]["cpu"][1] - results[1]["cpu"][1]) / (wall * (cores or 1))
    hardware["other_processes_cpu_share"] = round(others, 3)
    times = step_times(results)
    errors = gradient_errors(args.width, args.layers, args.batch_size, results)
    naive = times["naive m=1"]
    busy = {k: [sum(e - s for _, _, s, e in r["events"][k]) for r in results] for k in times}
    rows = []
    for key, t in times.items():
        name, m = key.split(" m=")[0], int(key.split("=")[1])
        ideal = 1.0 if name == "naive" else STAGES * m / (m + STAGES - 1)
        per_step = [max(a, b) for a, b in zip(results[0]["times"][key], results[1]["times"][key])]
        rows.append({"variant": name, "m": m, "step_ms_median": round(t * 1e3, 2),
                     "step_ms_min": round(min(per_step) * 1e3, 2), "step_ms_max": round(max(per_step) * 1e3, 2),
                     "speedup": round(naive / t, 3), "ideal_speedup": round(ideal, 3),
                     "fraction_of_ideal": round(naive / t / ideal, 3), "busy_ms_stage0": round(busy[key][0] * 1e3, 2),
                     "busy_ms_stage1": round(busy[key][1] * 1e3, 2), "max_grad_diff": errors[key]})
    print(f"\n{'variant':<8}{'m':>3}{'step ms (min-max)':>24}{'speed-up':>10}{'ideal':>8}{'of ideal':>10}"
          f"{'busy ms stage 0 / 1':>22}")
    for r in rows:
        print(f"{r['variant']:<8}{r['m']:>3}{r['step_ms_median']:>9.1f} ({r['step_ms_min']:.1f}-{r['step_ms_max']:.1f})"
              f"{'':>1}{r['speedup']:>9.2f}x{r['ideal_speedup']:>7.2f}x{r['fraction_of_ideal'] * 100:>9.0f}%"
              f"{r['busy_ms_stage0']:>12.1f} / {r['busy_ms_stage1']:.1f}")
    gpipe4 = next((r for r in rows if r["variant"] == "GPipe" and r["m"] == 4), None)
    verdict = None
    if gpipe4:
        verdict = gpipe4["fraction_of_ideal"] >= args.target
        print(f"\nGPipe m=4: {gpipe4['speedup']:.2f}x over the naive split; ideal (bubble formula) "
              f"{gpipe4['ideal_speedup']:.2f}x; {gpipe4['fraction_of_ideal'] * 100:.0f}% of ideal; target "
              f"{args.target * 100:.0f}%: {'MET' if verdict else 'NOT MET'}")
    print(f"gradients vs the unsplit model: max |dg| {max(errors.values()):.1e} over all variants")
    print(f"other processes used {others * 100:.0f}% of the {cores} cores during the measurement"
          + (" (more than 5%: the timings above are disturbed, run it again on an idle machine)" if others > 0.05 else ""))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_results.json"), "w") as f:
        json.dump({"hardware": hardware, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
                   "rows": rows, "target_met": verdict,
                   "step_ms_all": {k: [round(max(a, b) * 1e3, 2) for a, b in zip(results[0]["times"][k],
                                                                               results[1]["times"][k])]
                                   for k in times}}, f, indent=1)
    with open(os.path.join(args.out_dir, "bench_results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib
    matplotlib.use("Agg")  # a file only: no window
    shown = [k for k in ("naive m=1", "GPipe m=4", "1F1B m=4") if k in times]
    fig = plot_timeline({k: results[0]["events"][k] for k in shown}, {k: results[1]["events"][k] for k in shown},
                        times, title=f"{hardware['hardware']}, 1 process per stage, {backend}; batch "
                                     f"{args.batch_size}, width {args.width}, {args.layers} layers per stage")
    fig.savefig(os.path.join(args.out_dir, "timeline.png"), dpi=80)
    print(f"wrote bench_results.json, bench_results.csv and timeline.png to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
