"""The lab of lesson 03: runs model_parallel.py and proves its three claims.

    python 03_model_parallel/prove.py                                # the proofs
    python 03_model_parallel/prove.py --world-size 3 --microbatches 8
    python 03_model_parallel/prove.py --break no-grad-scale          # the pipeline proof FAILS
    python 03_model_parallel/prove.py --break detached-activations   # the split proof FAILS
    python 03_model_parallel/prove.py --crash-rank 1                 # rank 1 raises at step 2

The claims: (1) the split model's outputs and gradients equal the unsplit model's; (2) N ranks of
the split model under DDP end identical, and equal to one process trained on the global batch;
(3) the pipeline, GPipe and 1F1B, ends equal to one process trained on the same whole batches.
"""
import argparse
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("model_parallel", needs=(  # or the file given with --lesson PATH
    "TwoDeviceModel", "choose_backend", "make_dataset", "make_model", "train_pipeline",
    "train_split_model_with_ddp"))

# Measured on CPU (float32): the split 0.0 (same operations in the same order); DDP and the
# pipelines ~1e-8 (sums in another order: ranks, micro-batches). A real bug gives 1e-2 or more.
TOLERANCE = 1e-5
SCHEDULES = ["gpipe", "1f1b"]
SAMPLES = 256  # lesson.make_dataset()'s default size
BREAKS = {
    "no-grad-scale": "the pipeline schedules are built with scale_grads=False while the loss is a "
                     "mean: each step's gradient is the SUM of the micro-batches' mean gradients",
    "detached-activations": "the split model detaches the activations between its stages "
                            "(h.detach().to(dev1)): no gradient ever reaches stage 0",
}


class TwoDeviceModelDetached(lesson.TwoDeviceModel):
    """--break detached-activations: stage 1 gets a copy of h that autograd does not connect."""

    def forward(self, x):
        h = self.stage0(x.to(self.dev0))
        return self.stage1(h.detach().to(self.dev1))


def without_grad_scale(schedule_class):
    """--break no-grad-scale: the lesson's schedule class, always built with scale_grads=False."""
    def build(*args, **kwargs):
        return schedule_class(*args, **{**kwargs, "scale_grads": False})
    return build


def params(module):
    return [p.detach().cpu() for p in module.parameters()]


def max_diff(tensors_a, tensors_b):
    return max((a.double() - b.double()).abs().max().item() for a, b in zip(tensors_a, tensors_b))


def compare_split_with_unsplit(dev0, dev1):
    """Claim 1, in this process: the lesson's TwoDeviceModel against make_model() on the whole
    data set; returns max |dy| of the outputs and max |dg| of the gradients."""
    x, y = lesson.make_dataset().tensors
    unsplit, split = lesson.make_model().to(dev0), lesson.TwoDeviceModel(lesson.make_model(), dev0, dev1)
    outputs = []
    for model in (unsplit, split):
        out = model(x.to(dev0))
        nn.functional.cross_entropy(out, y.to(out.device)).backward()
        outputs.append(out.detach().cpu())
    grads = [[torch.zeros_like(p) if p.grad is None else p.grad.cpu() for p in m.parameters()]
             for m in (unsplit, split)]
    return max_diff(outputs[:1], outputs[1:]), max_diff(*grads)


def lab_worker(rank, world_size, ports, backends, microbatches, epochs, batch_size, lr, out_dir,
               broken, crash_rank, timeout):
    """Runs the lesson's two workers unchanged (but for --break) and saves what they return.
    Ranks 0 .. world_size-1 train the split model under DDP; ranks 0 and 1 then run the pipeline,
    once per schedule, each in a process group of its own."""
    if broken == "no-grad-scale":  # the lesson imports them from here when its pipeline starts
        import torch.distributed.pipelining as pipelining
        pipelining.ScheduleGPipe = without_grad_scale(pipelining.ScheduleGPipe)
        pipelining.Schedule1F1B = without_grad_scale(pipelining.Schedule1F1B)
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    seconds = {}
    try:
        if rank < world_size:
            start = time.perf_counter()
            model, losses = lesson.train_split_model_with_ddp(
                rank, world_size, ports[0], backends[0][0], epochs, batch_size, lr, timeout)
            seconds["ddp"] = time.perf_counter() - start
            torch.save({"params": params(model), "losses": losses}, os.path.join(out_dir, f"ddp{rank}.pt"))
        for schedule, port in zip(SCHEDULES, ports[1:]) if rank < 2 else ():
            start = time.perf_counter()
            module, losses = lesson.train_pipeline(rank, port, backends[1][0], schedule, microbatches,
                                                   epochs, 2 * batch_size, lr, timeout)
            seconds[schedule] = time.perf_counter() - start
            torch.save({"params": params(module), "losses": losses},
                       os.path.join(out_dir, f"{schedule}{rank}.pt"))
    except BaseException:  # print this rank's own error first: mp.spawn may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    torch.save(seconds, os.path.join(out_dir, f"seconds{rank}.pt"))


def train_unsplit(batches, lr):
    """One process, the unsplit make_model(), the lesson's optimizer; returns its parameters."""
    model = lesson.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return params(model)


def global_batches(world_size, epochs, batch_size):
    """At every step, the N ranks' batches (the lesson's DistributedSampler) concatenated."""
    dataset = lesson.make_dataset()
    samplers = [DistributedSampler(dataset, world_size, r, seed=0) for r in range(world_size)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s, generator=torch.Generator().manual_seed(0))
               for s in samplers]
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for batches in zip(*loaders):
            yield torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def pipeline_batches(epochs, batch_size):
    """The whole batches the pipeline's ranks iterate (the same loader as the lesson's)."""
    loader = DataLoader(lesson.make_dataset(), batch_size=batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    for _ in range(epochs):
        yield from loader


def choose_backends(world_size, device):
    """[(backend, reason)] for the split under DDP (two GPUs per rank) and the pipeline (two)."""
    gpus = torch.cuda.device_count()
    if device == "cuda" and gpus < 2 * world_size:
        course.refuse(f"--device cuda needs two GPUs per rank for the split under DDP: "
                      f"world size {world_size}, {gpus} GPU(s) visible")
    if device == "cpu":
        return [("gloo", "CPU requested")] * 2
    return [lesson.choose_backend(2 * world_size), lesson.choose_backend(2)]


def steps_per_rank(world_size, epochs, batch_size):
    """Optimizer steps a rank takes in the split under DDP (the padded shard) and the pipeline."""
    shard = -(-SAMPLES // world_size)
    return epochs * -(-shard // batch_size), epochs * (SAMPLES // (2 * batch_size))  # drop_last


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'model_parallel')
    p.add_argument("--world-size", type=int, default=2, help="ranks of the split under DDP (default 2)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline step (default 4)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step per DDP rank; the "
                   "pipeline's batch is twice this (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2: the whole run must stop "
                   "within seconds with that rank's own error")
    course.add_timeout_flag(p)
    args = p.parse_args(argv)
    if min(args.world_size, args.epochs, args.batch_size) < 1 or args.lr <= 0 or args.timeout <= 0:
        course.refuse("--world-size, --epochs, --batch-size, --lr and --timeout must be positive")
    batch = 2 * args.batch_size  # the lesson's pipeline drops a short last batch (drop_last=True)
    if batch > SAMPLES:
        course.refuse(f"--batch-size {args.batch_size}: the pipeline's batch of {batch} is more than "
                      f"the {SAMPLES} samples, so it would take no step")
    if args.microbatches < 2 or batch % args.microbatches:
        course.refuse(f"--microbatches must be at least 2 (Schedule1F1B needs one per stage) and split "
                      f"the pipeline's batch of {batch} into equal micro-batches")
    course.refuse_bad_crash_rank(args.crash_rank, max(args.world_size, 2))
    if args.crash_rank is not None:
        ddp, pipeline = steps_per_rank(args.world_size, args.epochs, args.batch_size)
        steps = (ddp if args.crash_rank < args.world_size else 0) + 2 * pipeline * (args.crash_rank < 2)
        if steps < 2:
            course.refuse(f"--crash-rank crashes at step 2, but rank {args.crash_rank} takes {steps}")
    return args


def main(argv=None):
    args = parse_args(argv)
    backends = choose_backends(args.world_size, args.device)
    gpus = torch.cuda.device_count() >= 2 and backends[1][0] == "nccl"
    dev0, dev1 = (torch.device("cuda", 0), torch.device("cuda", 1)) if gpus else (torch.device("cpu"),) * 2
    if args.broken == "detached-activations":
        lesson.TwoDeviceModel = TwoDeviceModelDetached
    if args.broken:
        print(f"--break {args.broken}: {BREAKS[args.broken]}", flush=True)
    d_out, d_grad = compare_split_with_unsplit(dev0, dev1)
    print(f"split model, one process, {dev0} + {dev1}: against the unsplit model max |dy| "
          f"{d_out:.1e}, max |dg| {d_grad:.1e}", flush=True)
    print(f"split under DDP: {backends[0][0]} ({backends[0][1]}); {args.world_size} ranks x 2 devices; "
          f"global batch {args.world_size} x {args.batch_size} = {args.world_size * args.batch_size}",
          flush=True)
    print(f"pipeline: {backends[1][0]} ({backends[1][1]}); 2 ranks, one stage each; GPipe, then 1F1B; "
          f"batch {2 * args.batch_size} in {args.microbatches} micro-batches", flush=True)
    ranks = max(args.world_size, 2)
    with tempfile.TemporaryDirectory(prefix="prove03_") as out_dir:
        ports = [course.find_free_port() for _ in range(1 + len(SCHEDULES))]
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (args.world_size, ports, backends, args.microbatches, args.epochs,
                                          args.batch_size, args.lr, out_dir, args.broken, args.crash_rank,
                                          args.timeout), ranks)
        seconds = time.perf_counter() - start
        load = lambda name: torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)  # noqa: E731
        ddp = [load(f"ddp{r}") for r in range(args.world_size)]
        pipes = {s: [load(f"{s}{r}") for r in (0, 1)] for s in SCHEDULES}
        timings = [load(f"seconds{r}") for r in (0, 1)]
    between = max(max_diff(ddp[0]["params"], r["params"]) for r in ddp)
    vs_global = max_diff(ddp[0]["params"], train_unsplit(
        global_batches(args.world_size, args.epochs, args.batch_size), args.lr))
    reference = train_unsplit(pipeline_batches(args.epochs, 2 * args.batch_size), args.lr)
    vs_pipe = {s: max_diff(r[0]["params"] + r[1]["params"], reference) for s, r in pipes.items()}
    print(f"split under DDP: max |dw| between ranks {between:.1e}, against one process {vs_global:.1e}")
    print("pipeline against one process on the same batches: "
          + ", ".join(f"{s} max |dw| {d:.1e}" for s, d in vs_pipe.items()))
    print(f"ranks ran {seconds:.1f} s (DDP {timings[0]['ddp']:.1f} s on rank 0; "
          + ", ".join(f"{s} {timings[1][s]:.1f} s" for s in SCHEDULES)
          + f" on rank 1; each with its group's setup) on {course.hardware()}")
    split_ok = max(d_out, d_grad) <= TOLERANCE
    ddp_ok = vs_global <= TOLERANCE
    pipe_ok = max(vs_pipe.values()) <= TOLERANCE
    code = course.report_proof(
        split_ok and between == 0.0 and ddp_ok and pipe_ok,
        f"the split model {'equals' if split_ok else 'does NOT equal'} the unsplit one; under DDP "
        f"its {args.world_size} ranks end {'identical' if between == 0.0 else 'DIFFERENT'} and "
        f"{'equal' if ddp_ok else 'NOT equal'} to one process on the global batch; the pipeline "
        f"(GPipe, 1F1B) {'equals' if pipe_ok else 'does NOT equal'} one process on the same batches",
        f"max differences: split {max(d_out, d_grad):.1e}, DDP {vs_global:.1e}, pipeline "
        f"{max(vs_pipe.values()):.1e}", f"{TOLERANCE:.0e}")
    if code:
        likely_cause(args, dev0, dev1, ddp, pipes, between, vs_global, vs_pipe, d_out)
    return code


def likely_cause(args, dev0, dev1, ddp, pipes, between, vs_global, vs_pipe, d_out):
    """The last line of a failed proof: which typical mistake the measurements fit (never read
    from the learner's source), else what was measured: which stage gets a gradient in the split,
    and which learning rate's one-process run the DDP and pipeline weights equal (a gradient K
    times too large is, with SGD and momentum, the same run as an lr K times larger)."""
    where = lambda text: course.lesson_line("03_model_parallel/model_parallel.py", text)  # noqa
    x, y = lesson.make_dataset().tensors
    split = lesson.TwoDeviceModel(lesson.make_model(), dev0, dev1)
    out = split(x.to(dev0))
    nn.functional.cross_entropy(out, y.to(out.device)).backward()
    silent = [name for name, p in split.named_parameters() if p.grad is None or not p.grad.any()]
    n, m = args.world_size, args.microbatches
    pipe = lambda lr: max(max_diff(r[0]["params"] + r[1]["params"], train_unsplit(  # noqa: E731
        pipeline_batches(args.epochs, 2 * args.batch_size), lr)) for r in pipes.values())
    ddp_at = lambda lr: max_diff(ddp[0]["params"], train_unsplit(  # noqa: E731
        global_batches(n, args.epochs, args.batch_size), lr))
    pipe_failed, ddp_failed = max(vs_pipe.values()) > TOLERANCE, vs_global > TOLERANCE
    pipe_m = pipe(args.lr * m) if pipe_failed else float("inf")  # inf: not measured
    ddp_n = ddp_at(args.lr * n) if ddp_failed and between == 0.0 and n > 1 else float("inf")
    measured = (f"split: {len(silent)} parameter(s) without a gradient, outputs {d_out:.1e} from "
                f"the unsplit model's; DDP ranks {between:.1e} apart, {vs_global:.1e} from one "
                f"process; pipeline {max(vs_pipe.values()):.1e} from one process"
                + (f", {pipe_m:.1e} from one with lr x {m}" if pipe_failed else ""))
    course.diagnose([
        (bool(silent) and d_out <= TOLERANCE,
         f"the activations are detached between the stages: the outputs equal the unsplit "
         f"model's (max |dy| {d_out:.1e}) but {', '.join(silent)} get no gradient; h.to(dev1) "
         f"keeps h in the graph ({where('h.to(self.dev1)')})"),
        (pipe_m <= TOLERANCE,
         f"the pipeline sums the {m} micro-batches' mean gradients: its weights equal one process "
         f"trained with lr x {m} (max |dw| {pipe_m:.1e}); build the schedule with "
         f"scale_grads=True ({where('scale_grads=True')})"),
        (ddp_n <= TOLERANCE,
         f"the DDP gradient is {n} times too large: the ranks agree and equal one process trained "
         f"with lr x {n} (max |dw| {ddp_n:.1e}); the plain mean loss, DDP averages "
         f"({where('DDP averages the gradients')})"),
        (between > 0.0,
         f"the gradients are not averaged across ranks: the {n} ranks end {between:.1e} apart; "
         f"wrap the split model in DDP ({where('model = DDP(')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
