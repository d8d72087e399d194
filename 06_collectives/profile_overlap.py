"""Measures what overlap.py claims, with torch.profiler: when each bucket's all-reduce runs against
the backward pass, for three ways of averaging the gradients on 2 ranks, and the time of a step.

    python 06_collectives/prove_overlap_zero1.py --profile prof06    # runs this; writes prof06/

The ways: after backward (collectives.py's average_gradients: each bucket after backward returns),
overlapping (overlap.py's hooks), and torch's DDP. The model is larger than the lessons' (6 layers
of 512 x 512, 6.3 MB of gradients in buckets of 1.5 MB) so that there is something to overlap. gloo
runs the all-reduces on a pool of worker threads (2 by default: ProcessGroupGloo's options), which
the CPU trace shows as `gloo:all_reduce`.
Writes one Chrome trace per way and rank (chrome://tracing or https://ui.perfetto.dev), times.json
and overlap.png (the run in NOTES.md: overlap_times.json and overlap_timeline.png here). A CPU shares its 2 cores between computing and sending: what it shows is WHEN the
all-reduces run; how much time overlap saves depends on the machine (on GPUs, NCCL uses its own
streams and the network, and the backward keeps the cores).
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import collectives  # noqa: E402
import course  # noqa: E402
import overlap  # noqa: E402

WAYS = ["after backward", "overlapping", "DDP"]
CAP_MB, LAYERS, WIDTH, BATCH, TIMED = 1.5, 6, 512, 256, 20


def big_model():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())])


def setup(way, world_size):
    """(model, what to call after backward) for one way of averaging."""
    model = big_model()
    if way == "DDP":
        return DDP(model, bucket_cap_mb=CAP_MB), lambda: None
    buckets = overlap.make_buckets(model.parameters(), int(CAP_MB * 2**20))
    if way == "overlapping":
        return model, overlap.overlap_gradients(buckets, world_size)
    return model, lambda: collectives.average_gradients(buckets, world_size, dist.all_reduce)


def spans(prof, origin):
    """(backward start, end), [(all-reduce start, end)], step end, [launch times]: ms from
    `origin`, the profile's first event (µs). An all-reduce is launched by `c10d::allreduce_` on
    the training thread and runs as `gloo:all_reduce` on gloo's: when it runs also depends on
    the other rank and on free cores, when it is launched does not."""
    events = list(prof.events())
    backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    reduces = [e for e in events if e.name == "gloo:all_reduce"]
    launches = [e for e in events if e.name == "c10d::allreduce_"]
    ms = lambda us: (us - origin) / 1000  # noqa: E731
    return ((ms(min(e.time_range.start for e in backward)), ms(max(e.time_range.end for e in backward))),
            sorted((ms(e.time_range.start), ms(e.time_range.end)) for e in reduces),
            ms(max(e.time_range.end for e in events)),
            sorted(ms(e.time_range.start) for e in launches))


def worker(rank, world_size, port, out_dir):
    torch.set_num_threads(1)  # the 2 ranks share 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
        results = {}
        for way in WAYS:
            model, after_backward = setup(way, world_size)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step():
                optimizer.zero_grad()
                model(x).square().mean().backward()
                after_backward()
                optimizer.step()
            for _ in range(3):  # warm-up: DDP rebuilds its buckets after its first step
                step()
            times = []
            for _ in range(TIMED):
                dist.barrier()  # both ranks start each timed step together
                start = time.perf_counter()
                step()
                times.append(time.perf_counter() - start)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            prof.export_chrome_trace(os.path.join(out_dir, f"{way.replace(' ', '_')}-rank{rank}.json"))
            first = min(e.time_range.start for e in prof.events())
            results[way] = {"step_ms": 1000 * statistics.median(times), "spans": spans(prof, first)}
            model = optimizer = None  # DDP holds the group: released before the next way
        if rank == 0:
            with open(os.path.join(out_dir, "times.json"), "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


def draw(results, path=None):
    """The timeline of each way; saved to `path`, or shown (the notebook) when path is None."""
    import matplotlib
    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for row, way in enumerate(WAYS):
        (b0, b1), reduces, end = results[way]["spans"][:3]
        y = len(WAYS) - 1 - row
        ax.barh(y + 0.18, b1 - b0, left=b0, height=0.3, color="tab:blue",
                label="backward" if row == 0 else None)
        for i, (r0, r1) in enumerate(reduces):
            ax.barh(y - 0.18, r1 - r0, left=r0, height=0.3, color="tab:orange", edgecolor="black",
                    linewidth=0.5, label="all-reduce (gloo thread)" if row == 0 and i == 0 else None)
        ax.plot([end, end], [y - 0.4, y + 0.4], color="black")
        ax.text(end, y, f"  {results[way]['step_ms']:.1f} ms/step", va="center", fontsize=8)
    ax.set_yticks(range(len(WAYS)), WAYS[::-1])
    ax.set_xlabel("ms from the start of the profiled step (rank 0); | = the step's end")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"When each bucket's all-reduce runs (2 ranks, gloo; {course.hardware()})",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110) if path else plt.show()


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    course.spawn_or_fail(worker, (2, course.find_free_port(), out_dir), 2)
    with open(os.path.join(out_dir, "times.json")) as f:
        results = json.load(f)
    base = results["after backward"]["step_ms"]
    for way in WAYS:
        (b0, b1), reduces, end, launches = results[way]["spans"]
        inside = sum(1 for r0, _ in reduces if r0 < b1)
        launched = (f"; launched during backward: {sum(t < b1 for t in launches)} of {len(launches)}"
                    if launches else "")
        print(f"{way:15s} {results[way]['step_ms']:6.1f} ms a step (x{results[way]['step_ms'] / base:.2f} "
              f"of after-backward); {len(reduces)} all-reduces, {inside} of them started before "
              f"backward ended{launched}")
    draw(results, os.path.join(out_dir, "overlap.png"))
    print(f"wrote {out_dir}/overlap.png, times.json and one Chrome trace per way and rank; "
          f"{course.hardware()}")
    return 0
