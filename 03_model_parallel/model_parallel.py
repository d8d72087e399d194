"""Lesson 03: model parallelism: split a model across two devices, combine it with DDP, and pipeline it.

    python 03_model_parallel/model_parallel.py                       # all three parts, in seconds on CPU
    python 03_model_parallel/model_parallel.py --part pipeline --microbatches 8 --plot timeline.png
    python 03_model_parallel/model_parallel.py --no-grad-scale-demo  # part 3's proof fails, exit 1

Part 1: one process, half the model on dev0, half on dev1; proof: output and gradients equal the unsplit model's.
Part 2: 2 ranks, each a two-device model in DDP(model, device_ids=None); proof: equal to one process on the global batch.
Part 3: stage r on rank r, by hand with send/recv, then PipelineStage + ScheduleGPipe / Schedule1F1B with
micro-batches; proof: gradients equal the unsplit model's. bench_pipeline.py measures the speed-ups.
"""
import argparse
import contextlib
import copy
import datetime
import gc
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

CLASSES = 10
# Measured on CPU: part 1 and send/recv differ by 0.0, GPipe/1F1B by ~1e-8 (micro-batch sums), DDP by ~1e-8.
# A real bug (a missing gradient scale, an unsynchronised rank) gives ~1e-2 or more.
TOLERANCE = {"split": 1e-6, "ddp": 1e-5, "pipeline": 1e-6}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["all", "split", "ddp", "pipeline"], default="all", help="which part to run (default all)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: GPUs where a part has enough of them, else cpu")
    p.add_argument("--width", type=int, default=64, help="width of every hidden Linear layer (default 64)")
    p.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="batch of one step; in part 2 per rank (default 32)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step in part 3 (default 4)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps in part 2 (default 5)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant in part 3, after one warm-up step (default 5)")
    p.add_argument("--world-size", type=int, default=2, help="ranks in part 2; with GPUs each rank needs two (default 2)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a stuck collective or send/recv raises (default 60)")
    p.add_argument("--plot", help="save part 3's timeline (a Gantt chart per stage) to this PNG file")
    p.add_argument("--out-dir", help="keep each rank's results (*.pt) here; default: a temporary directory")
    p.add_argument("--no-grad-scale-demo", action="store_true",
                   help="build the schedules with scale_grads=False while the loss is a mean: part 3's proof must FAIL")
    p.add_argument("--crash-rank", type=int, default=None, help="make this rank raise in parts 2 and 3, to see the run stop with the real error")
    args = p.parse_args(argv)
    if min(args.width, args.layers, args.batch_size, args.steps, args.repeats) < 1 or args.timeout <= 0:
        p.error("--width, --layers, --batch-size, --steps, --repeats and --timeout must be positive")
    if args.world_size < 1:
        p.error(f"--world-size must be at least 1, got {args.world_size}")
    pipeline = args.part in ("all", "pipeline")
    if pipeline and args.microbatches < 2:
        p.error(f"--microbatches must be at least 2 (Schedule1F1B needs one per stage), got {args.microbatches}")
    if pipeline and args.batch_size % args.microbatches:
        p.error(f"--batch-size {args.batch_size} must be divisible by --microbatches {args.microbatches}: with unequal "
                "micro-batches the mean of per-micro-batch mean losses is not the mean over the batch")
    ranks = max(args.world_size if args.part in ("all", "ddp") else 0, 2 if pipeline else 0)  # part 1 has no ranks
    if args.crash_rank is not None and not 0 <= args.crash_rank < ranks:
        p.error(f"--crash-rank must be a rank of part 2 or 3 (0 to {ranks - 1})" if ranks else "--crash-rank needs part 2 or 3")
    if args.plot and (os.path.splitext(args.plot)[1].lower() != ".png" or not os.path.isdir(os.path.dirname(args.plot) or ".")):
        p.error(f"--plot needs a .png file name in an existing folder, got {args.plot}")
    if args.out_dir:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--out-dir {args.out_dir}: {e.strerror}")
    args.devices = choose_devices(args.device, args.world_size, args.part, p.error)
    return args


def choose_devices(device, world_size, part, error):
    """For each part: ('cuda' or 'cpu', why). A part uses GPUs only when it has one per model half."""
    gpus, devices = torch.cuda.device_count(), {}
    for name, needed in [("split", 2), ("ddp", 2 * world_size), ("pipeline", 2)]:
        if part not in ("all", name):
            continue
        if device == "cuda" and gpus < needed:
            error(f"--device cuda: part {name} needs {needed} GPUs, but {gpus} GPU(s) visible")
        if device == "cuda" or (device == "auto" and gpus >= needed):
            devices[name] = ("cuda", f"{gpus} GPU(s) visible, {needed} needed")
        else:
            devices[name] = ("cpu", "cpu requested" if device == "cpu" else "no GPU visible" if gpus == 0
                             else f"{needed} GPUs needed, {gpus} visible")
    return devices


def find_free_port():
    """Ask the OS for a port nobody uses now; a fixed port (12355, 29500) collides between jobs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(args):
    """Two stages of equal work: [Linear(w, w) + ReLU] x layers each, and a small classifier at the end."""
    torch.manual_seed(0)  # every rank, and the reference, start from the same weights
    def block():
        return [nn.Linear(args.width, args.width), nn.ReLU()]
    stage0 = nn.Sequential(*[m for _ in range(args.layers) for m in block()])
    stage1 = nn.Sequential(*[m for _ in range(args.layers) for m in block()], nn.Linear(args.width, CLASSES))
    return nn.Sequential(stage0, stage1)


def make_batch(args, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, args.width, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


class TwoDeviceModel(nn.Module):
    """The model-parallel pattern: each half lives on its own device, forward() moves the activations."""

    def __init__(self, stage0, stage1, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.stage0, self.stage1 = stage0.to(dev0), stage1.to(dev1)

    def forward(self, x):
        h = self.stage0(x.to(self.dev0))
        return self.stage1(h.to(self.dev1))  # the only line that differs from an unsplit model


def max_diff(tensors_a, tensors_b):
    return max((a.detach().cpu().double() - b.detach().cpu().double()).abs().max().item() for a, b in zip(tensors_a, tensors_b))


def grads(module):
    return [p.grad for p in module.parameters()]


def part_split(args):
    kind, reason = args.devices["split"]
    dev0, dev1 = (torch.device("cuda", 0), torch.device("cuda", 1)) if kind == "cuda" else (torch.device("cpu"),) * 2
    print(f"\npart 1: the model split across two devices in one process: dev0 = {dev0}, dev1 = {dev1} ({reason})")
    if dev0 == dev1:
        print("  both halves share one device here, so this shows correctness, not speed")
    x, y = make_batch(args, args.batch_size, seed=1)
    reference = make_model(args).to(dev0)
    split = TwoDeviceModel(copy.deepcopy(reference[0]), copy.deepcopy(reference[1]), dev0, dev1)  # identical weights
    outputs = []
    for model, out_device in [(reference, dev0), (split, dev1)]:
        out = model(x.to(dev0))
        nn.functional.cross_entropy(out, y.to(out_device)).backward()
        outputs.append(out)
    d_out, d_grad = max_diff(outputs[:1], outputs[1:]), max_diff(grads(reference), grads(split))
    passed = max(d_out, d_grad) <= TOLERANCE["split"]
    return passed, (f"PROOF {'PASSED' if passed else 'FAILED'}: part 1: the split model equals the unsplit one: "
                    f"{'yes' if passed else 'NO'} (outputs max |dy| {d_out:.1e}, gradients max |dg| {d_grad:.1e}; "
                    f"tolerance {TOLERANCE['split']:.0e})")


@contextlib.contextmanager
def process_group(rank, world_size, port, args, device, bind_device=True):
    """One rank's process group, with a timeout; destroyed on the way out. A failure is printed at once: mp.spawn
    reports whichever rank exits first, which may be a peer that lost its connection, so the first traceback is the cause."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" and bind_device else None)
    try:
        yield
    except BaseException:
        print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()


def ddp_worker(rank, args, port, out_dir):
    """Part 2: this rank's two-device model, wrapped in DDP. Rank r uses cuda:2r and cuda:2r+1 (or cpu, cpu)."""
    on_gpu = args.devices["ddp"][0] == "cuda"
    dev0, dev1 = (torch.device("cuda", 2 * rank), torch.device("cuda", 2 * rank + 1)) if on_gpu else (torch.device("cpu"),) * 2
    # device_id binds an NCCL group to ONE device; this process also runs collectives on dev1, so it stays unbound
    with process_group(rank, args.world_size, port, args, dev0, bind_device=dev0 == dev1):
        model = make_model(args)
        ddp_model = DDP(TwoDeviceModel(model[0], model[1], dev0, dev1), device_ids=None)  # multi-device: device_ids=None
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
        for step in range(args.steps):
            if step == 1 and rank == args.crash_rank:
                raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")
            x, y = make_batch(args, args.batch_size * args.world_size, seed=100 + step)
            shard = slice(rank * args.batch_size, (rank + 1) * args.batch_size)  # this rank's part of the global batch
            optimizer.zero_grad()
            outputs = ddp_model(x[shard])  # call the wrapper, so that DDP's hooks average the gradients
            nn.functional.cross_entropy(outputs, y[shard].to(dev1)).backward()
            optimizer.step()
        torch.save({"params": [p.detach().cpu() for p in ddp_model.parameters()], "devices": [str(dev0), str(dev1)]},
                   os.path.join(out_dir, f"ddp_rank{rank}.pt"))
        del ddp_model, optimizer  # DDP holds the process group: release it before destroying the group (lesson 02)
        gc.collect()


def part_ddp(args, out_dir):
    kind, reason = args.devices["ddp"]
    print(f"\npart 2: model parallel + DDP: {args.world_size} {'nccl' if kind == 'cuda' else 'gloo'} ranks, each owns a "
          f"two-device model in DDP(model, device_ids=None) ({reason})")
    if not spawn(ddp_worker, args.world_size, args, out_dir):
        return None, ""
    results = [torch.load(os.path.join(out_dir, f"ddp_rank{r}.pt"), map_location="cpu", weights_only=True) for r in range(args.world_size)]
    print("  " + "; ".join(f"rank {r}: {d[0]} + {d[1]}" for r, d in enumerate(r["devices"] for r in results)))
    reference = make_model(args)  # one process, unsplit, the whole global batch
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(args.steps):
        x, y = make_batch(args, args.batch_size * args.world_size, seed=100 + step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    between = max(max_diff(results[0]["params"], r["params"]) for r in results)
    vs_single = max_diff(results[0]["params"], list(reference.parameters()))
    passed = between == 0.0 and vs_single <= TOLERANCE["ddp"]
    return passed, (f"PROOF {'PASSED' if passed else 'FAILED'}: part 2: {args.world_size} ranks hold identical parameters: "
                    f"{'yes' if between == 0.0 else 'NO'} (max |dw| between ranks {between:.1e}); after {args.steps} steps they "
                    f"match one process trained on the global batch of {args.world_size * args.batch_size}: max |dw| "
                    f"{vs_single:.1e} (tolerance {TOLERANCE['ddp']:.0e})")


def timed(events, kind, mb, fn, *a, **kw):
    """fn(*a, **kw), appending (kind F or B, micro-batch, start, end) to events: the timeline's boxes."""
    start = time.perf_counter()
    out = fn(*a, **kw)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # so that the timeline shows the GPU work, not only its launch
    events.append((kind, mb, start, time.perf_counter()))
    return out


def naive_step(rank, module, x, y, events):
    """The split across two processes, by hand: activations go forward with send, their gradients come back."""
    if rank == 0:
        h = timed(events, "F", 0, module, x)
        dist.send(h.detach(), dst=1)
        grad_h = torch.empty_like(h)
        dist.recv(grad_h, src=1)
        timed(events, "B", 0, h.backward, grad_h)  # continue the backward pass that rank 1 started
    else:
        h = torch.empty(x.shape, device=x.device)
        dist.recv(h, src=0)
        h.requires_grad_()  # so that backward() computes d loss / d h, the gradient rank 0 needs
        loss = timed(events, "F", 0, lambda: nn.functional.cross_entropy(module(h), y))
        timed(events, "B", 0, loss.backward)
        dist.send(h.grad, dst=0)


def record_into(stage, log):
    """Wrap a PipelineStage's per-micro-batch forward and backward, so that they log their timeline boxes."""
    for method, kind in [("forward_one_chunk", "F"), ("backward_one_chunk", "B")]:
        original = getattr(stage, method)
        setattr(stage, method, lambda mb, *a, _f=original, _k=kind, **kw: timed(log["events"], _k, mb, _f, mb, *a, **kw))


def make_runner(name, m, rank, module, device, args):
    """A function (x, y, events) -> None that runs one training step of variant `name` on this rank."""
    if name == "naive":
        return lambda x, y, events: naive_step(rank, module, x, y, events)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # here: the import takes 1.4 s
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=device)
    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[name](stage, n_microbatches=m, loss_fn=nn.functional.cross_entropy,
                               scale_grads=not args.no_grad_scale_demo)  # True: divide by m, because the loss is a mean
    log = {"events": []}
    record_into(stage, log)
    def run(x, y, events):
        log["events"] = events
        if rank == 0:
            schedule.step(x)  # the first stage gets the input; it splits it into m micro-batches
        else:
            schedule.step(target=y)  # the last stage gets the target and computes loss_fn per micro-batch
    return run


def pipeline_worker(rank, args, port, out_dir, variants=None):
    """Part 3: rank r holds stage r. Runs each variant (name, m) once to warm up, then `repeats` timed steps."""
    variants = variants or [("naive", 1), ("GPipe", args.microbatches), ("1F1B", args.microbatches)]
    device = torch.device("cuda", rank) if args.devices["pipeline"][0] == "cuda" else torch.device("cpu")
    with process_group(rank, 2, port, args, device):
        module = make_model(args)[rank].to(device)  # the same initial weights as the unsplit model, our half only
        x, y = (t.to(device) for t in make_batch(args, args.batch_size, seed=1))
        runners = {f"{name} m={m}": make_runner(name, m, rank, module, device, args) for name, m in variants}
        result = {"times": {k: [] for k in runners}, "events": {}, "grads": {}}
        for repeat in range(args.repeats + 1):
            if repeat == 1 and rank == args.crash_rank:
                raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")
            for key, run in runners.items():  # interleaved, so that a slow moment hits every variant alike
                module.zero_grad(set_to_none=True)  # the schedules accumulate into .grad, like backward()
                events = []
                dist.barrier()
                start = time.perf_counter()
                run(x, y, events)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if repeat > 0:
                    result["times"][key].append(time.perf_counter() - start)
                result["events"][key] = events  # perf_counter() times: one clock for all processes on a machine
                result["grads"][key] = [g.cpu() for g in grads(module)]
        torch.save(result, os.path.join(out_dir, f"pipeline_rank{rank}.pt"))
        del runners  # the stages and schedules refer to the process group: release them first
        gc.collect()


def load_pipeline_results(out_dir):
    return [torch.load(os.path.join(out_dir, f"pipeline_rank{r}.pt"), map_location="cpu", weights_only=True) for r in (0, 1)]


def step_times(results):
    """Per variant: the median over repeats of the slower rank's step time, in seconds."""
    return {k: statistics.median([max(a, b) for a, b in zip(results[0]["times"][k], results[1]["times"][k])]) for k in results[0]["times"]}


def pipeline_gradient_errors(args, results):
    """Per variant: max |dg| between the two ranks' gradients and the unsplit model's."""
    reference = make_model(args)
    x, y = make_batch(args, args.batch_size, seed=1)
    nn.functional.cross_entropy(reference(x), y).backward()
    expected = grads(reference[0]) + grads(reference[1])
    return {k: max_diff(results[0]["grads"][k] + results[1]["grads"][k], expected) for k in results[0]["grads"]}


def part_pipeline(args, out_dir):
    kind, reason = args.devices["pipeline"]
    m, mb = args.microbatches, args.batch_size // args.microbatches
    print(f"\npart 3: the model split across 2 processes, stage 0 on rank 0 and stage 1 on rank 1, "
          f"{'nccl on cuda' if kind == 'cuda' else 'gloo on cpu'} ({reason})")
    print(f"  naive: send/recv by hand, the whole batch of {args.batch_size}; GPipe and 1F1B: PipelineStage with "
          f"{m} micro-batches of {mb}{'; --no-grad-scale-demo: scale_grads=False' if args.no_grad_scale_demo else ''}")
    if not spawn(pipeline_worker, 2, args, out_dir):
        return None, ""
    results = load_pipeline_results(out_dir)
    times = step_times(results)
    naive = times["naive m=1"]
    print(f"  step time, median of {args.repeats}: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in times.items()))
    print(f"  speed-up over the naive split: " + ", ".join(f"{k} {naive / t:.2f}x" for k, t in times.items() if k != "naive m=1")
          + f"; the bubble formula's ideal is {2 * m / (m + 1):.2f}x")
    print(f"  timed on {torch.cuda.get_device_name(0) if kind == 'cuda' else cpu_name()} ({os.cpu_count()} cores), "
          f"torch {torch.__version__}")
    print("  each micro-batch adds fixed costs (Python, a message each way), so a tiny model gets slower, not faster; "
          "bench_pipeline.py measures where compute dominates")
    if args.plot:
        plot_timeline(results[0]["events"], results[1]["events"], times, path=args.plot)
        print(f"  timeline saved to {args.plot}")
    errors = pipeline_gradient_errors(args, results)
    passed = max(errors.values()) <= TOLERANCE["pipeline"]
    return passed, (f"PROOF {'PASSED' if passed else 'FAILED'}: part 3: the two processes' gradients equal the unsplit "
                    f"model's: {'yes' if passed else 'NO'} (" + ", ".join(f"{k} max |dg| {e:.1e}" for k, e in errors.items())
                    + f"; tolerance {TOLERANCE['pipeline']:.0e})")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def plot_timeline(events0, events1, times, path=None, title=None):
    """Gantt chart: one panel per variant, one row per stage, a box per micro-batch forward (F) and backward (B)."""
    import matplotlib
    if path:
        matplotlib.use("Agg")  # a file only: no window
    import matplotlib.pyplot as plt
    keys = list(events0)
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.5 + 1.1 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        t0 = min(e[2] for e in events0[key] + events1[key])  # stage 0 starts F0: time 0
        for row, events in [(1, events0[key]), (0, events1[key])]:
            for kind, mb, start, end in events:
                ax.broken_barh([((start - t0) * 1e3, (end - start) * 1e3)], (row - 0.4, 0.8),
                               facecolors="tab:blue" if kind == "F" else "tab:orange", edgecolor="white")
                ax.text((start + end - 2 * t0) / 2 * 1e3, row, f"{kind}{mb}", ha="center", va="center", fontsize=8, color="white")
        ax.set_yticks([1, 0], ["stage 0", "stage 1"])
        ax.set_title(f"{key}: median step {times[key] * 1e3:.1f} ms; drawn: the last timed step", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms since stage 0 started F0  (blue: forward, orange: backward, gaps: waiting)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


def spawn(worker, nprocs, *args):
    """mp.spawn, and a clear message if a rank fails (spawn has then already stopped the others)."""
    try:
        mp.spawn(worker, args=(*args[:1], find_free_port(), *args[1:]), nprocs=nprocs, join=True)
        return True
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"\nRUN FAILED: a rank stopped with an error, so every rank was stopped (the first traceback above is the "
              f"cause; its peers then lose their connection).\n{e}", file=sys.stderr)
        return False


def main(argv=None):
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # our lines before the ranks' lines, even through a pipe
    print("devices: " + "; ".join(f"part {['split', 'ddp', 'pipeline'].index(k) + 1} ({k}) on {v[0]} ({v[1]})"
                                  for k, v in args.devices.items()))
    print(f"model: 2 stages of {args.layers} x [Linear({args.width}, {args.width}) + ReLU], then Linear({args.width}, {CLASSES}); "
          f"batch {args.batch_size}; float32")
    start, outcomes = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="model_parallel_") as scratch:
        out_dir = args.out_dir or scratch
        os.makedirs(out_dir, exist_ok=True)
        for name, part in [("split", lambda: part_split(args)), ("ddp", lambda: part_ddp(args, out_dir)),
                           ("pipeline", lambda: part_pipeline(args, out_dir))]:
            if args.part in ("all", name):
                passed, message = part()
                if passed is None:
                    return 1
                print(message, flush=True)
                outcomes.append(passed)
    print(f"\n{sum(outcomes)} of {len(outcomes)} proofs passed in {time.perf_counter() - start:.1f} s")
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
