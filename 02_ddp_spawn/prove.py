"""The lab of lesson 02: runs ddp_spawn.py and proves its claim.

    python 02_ddp_spawn/prove.py                        # the proof, 2 ranks
    python 02_ddp_spawn/prove.py --world-size 3
    python 02_ddp_spawn/prove.py --break no-sync        # gradients never averaged: the proof FAILS
    python 02_ddp_spawn/prove.py --break unseeded-data  # each rank builds other data: FAILS
    python 02_ddp_spawn/prove.py --crash-rank 1         # rank 1 raises at step 2: the run stops

The claim: N ranks end with bit-identical weights, and those equal lesson 00's single process
trained on the global batch (at every step, the union of the N ranks' batches).
"""
import argparse
import contextlib
import hashlib
import io
import math
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("ddp_spawn", needs=(  # or the file given with --lesson PATH
    "make_dataset", "worker"))

TOLERANCE = 1e-5  # DDP and one process differ only in summation order: measured ~5e-8 (float32)
BREAKS = {
    "no-sync": "every forward runs under DDP's no_sync(): gradients are never averaged",
    "unseeded-data": "the data is drawn from the global RNG before any seed, as lesson 02's "
                     "README once did: each spawned process starts from its own random seed",
}


def load_single_process():
    """Lesson 00's script, the reference every proof trains."""
    return course.load_lesson("00_single_process/single_process.py")


class DDPWithoutSync(DistributedDataParallel):
    """--break no-sync: each forward under no_sync(), so backward() all-reduces nothing."""

    def forward(self, *inputs, **kwargs):
        with self.no_sync():
            return super().forward(*inputs, **kwargs)


def make_dataset_from_global_rng(samples=256, seed=0):
    """--break unseeded-data: torch.randn before any manual_seed (the bug this lab catches)."""
    x = torch.randn(samples, 20)
    return TensorDataset(x, (x @ torch.randn(20, 4)).argmax(dim=1))


def fingerprint(dataset):
    """A short digest of a data set's bytes: equal on every rank, or the ranks trained on other data."""
    digest = hashlib.sha256()
    for tensor in dataset.tensors:
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:12]


def keep_what_it_returns(function, kept, traces=None):
    """Wraps a lesson function so that the lab sees what it built; the lesson's code is unchanged.
    traces: the data set made, a StepTrace of its samples starts (what each step reads and does)."""
    def wrapper(*args, **kwargs):
        kept.append(function(*args, **kwargs))
        if traces is not None and not traces:
            traces.append(course.StepTrace(kept[-1]).install())
        return kept[-1]
    return wrapper


def lab_worker(rank, world_size, port, backend, epochs, batch_size, lr, out_dir, broken, crash_rank,
               timeout):
    """Runs the lesson's worker unchanged (but for --break), then keeps what it returns in a file:
    this rank's final weights, its losses, and a fingerprint of the data set it built."""
    if broken == "no-sync":
        lesson.DDP = DDPWithoutSync
    if broken == "unseeded-data":
        lesson.make_dataset = make_dataset_from_global_rng
    datasets, traces = [], []
    lesson.make_dataset = keep_what_it_returns(lesson.make_dataset, datasets, traces)
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    try:
        model, losses = lesson.worker(rank, world_size, port, backend, epochs, batch_size, lr,
                                      timeout)
    except BaseException:  # print this rank's own error first: mp.spawn may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    trace = traces[0].state() if traces else {"indices": [], "weights": torch.zeros(0)}
    torch.save({"state": state, "losses": losses, "data": fingerprint(datasets[0]), **trace},
               os.path.join(out_dir, f"rank{rank}.pt"))


class GlobalBatches:
    """A batch_sampler for lesson 00: at every step, the union of what the N ranks' samplers give."""

    def __init__(self, dataset, world_size, batch_size):
        self.samplers = [DistributedSampler(dataset, world_size, r, seed=0) for r in range(world_size)]
        self.batch_size, self.epoch = batch_size, 0

    def __iter__(self):
        for sampler in self.samplers:
            sampler.set_epoch(self.epoch)
        orders, self.epoch = [list(s) for s in self.samplers], self.epoch + 1
        for start in range(0, len(orders[0]), self.batch_size):
            yield [i for order in orders for i in order[start:start + self.batch_size]]

    def __len__(self):
        return -(-len(self.samplers[0]) // self.batch_size)


def train_reference(world_size, epochs, batch_size, lr, device):
    """Lesson 00's loop, one process, the global batch; returns its final weights."""
    return train_reference_traced(world_size, epochs, batch_size, lr, device)[0]


def train_reference_traced(world_size, epochs, batch_size, lr, device):
    """train_reference, and what each of its steps read and did (course.StepTrace's state), and
    the parameters' names and sizes: (weights, trace, names)."""
    single = load_single_process()
    dataset = single.make_dataset()
    loader = DataLoader(dataset, batch_sampler=GlobalBatches(dataset, world_size, batch_size))
    model = single.make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trace = course.StepTrace(dataset).install()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its epoch lines would repeat the lesson's
            single.train(model, loader, optimizer, epochs, device)
    finally:
        trace.remove()
    names = [(name, p.numel()) for name, p in model.named_parameters()]
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, trace.state(), names


def expected_samples(world_size, epochs, batch_size, samples=256):
    """Each rank's sample indices per step, as DistributedSampler(seed=0) with set_epoch gives."""
    dataset = range(samples)
    per_rank = []
    for rank in range(world_size):
        sampler, steps = DistributedSampler(dataset, world_size, rank, seed=0), []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            order = list(sampler)
            steps += [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        per_rank.append(steps)
    return per_rank


LINES = {"sampler": "DistributedSampler(dataset, num_replicas", "set_epoch": "set_epoch(epoch)",
         "ddp": "model = DDP(", "loss": "cross_entropy(model(x), y)",
         "model": "torch.manual_seed(seed)", "data": "torch.Generator().manual_seed(seed)"}


def likely_cause(ranks, reference, names, args):
    """The failure's likely cause, from what the ranks and one process measurably did."""
    lines = {k: course.lesson_line("02_ddp_spawn/ddp_spawn.py", v) for k, v in LINES.items()}
    if len({r["data"] for r in ranks}) > 1:
        return course.report_cause(
            "each rank built other data (the data sets' bytes differ between ranks): make_dataset "
            f"draws from the global RNG, which every spawned process seeds its own way; draw from "
            f"a seeded torch.Generator ({lines['data']})")
    return course.data_parallel_cause(
        ranks, reference, expected_samples(args.world_size, args.epochs, args.batch_size),
        steps_per_rank(args.world_size, 1, args.batch_size), lines, TOLERANCE, names)


def steps_per_rank(world_size, epochs, batch_size, samples=256):
    """Optimizer steps each rank takes: DistributedSampler pads the data to a multiple of the world
    size, and the last batch of an epoch may be short (the lesson's data set has 256 samples)."""
    return epochs * math.ceil(math.ceil(samples / world_size) / batch_size)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'ddp_spawn')
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step per rank (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2: the whole run must stop "
                   "within seconds with that rank's own error")
    course.add_timeout_flag(p)
    args = p.parse_args(argv)
    if min(args.world_size, args.epochs, args.batch_size) < 1 or args.lr <= 0 or args.timeout <= 0:
        course.refuse("--world-size, --epochs, --batch-size, --lr and --timeout must be positive")
    if args.broken == "no-sync" and args.world_size < 2:
        course.refuse("--break no-sync needs --world-size 2 or more: one rank has nothing to average")
    course.refuse_bad_crash_rank(args.crash_rank, args.world_size,
                                 steps_per_rank(args.world_size, args.epochs, args.batch_size))
    return args


def main(argv=None):
    args = parse_args(argv)
    backend, device, reason = course.backend_for(args.world_size, args.device)
    print(f"backend: {backend} ({reason}); world size {args.world_size}; global batch "
          f"{args.world_size} x {args.batch_size} = {args.world_size * args.batch_size}"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    with tempfile.TemporaryDirectory(prefix="prove02_") as out_dir:
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (args.world_size, course.find_free_port(), backend, args.epochs,
                                          args.batch_size, args.lr, out_dir, args.broken,
                                          args.crash_rank, args.timeout), args.world_size)
        seconds = time.perf_counter() - start
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), map_location="cpu", weights_only=True)
                 for r in range(args.world_size)]
    reference, traced, names = train_reference_traced(
        args.world_size, args.epochs, args.batch_size, args.lr,
        torch.device("cuda:0" if device == "cuda" else "cpu"))
    between = max(course.max_abs_diff(ranks[0]["state"], r["state"]) for r in ranks)
    vs_single = course.max_abs_diff(ranks[0]["state"], reference)
    print(f"training took {seconds:.1f} s on {course.hardware()}")
    first = [sorted(r["indices"][0]) if r["indices"] else None for r in ranks]
    print("each rank's own loss at the last step: "
          + ", ".join(f"{r['losses'][-1]:.4f}" for r in ranks) + (
              " (each rank saw other samples)" if len({str(f) for f in first}) == len(first)
              else " (the ranks saw the SAME samples at step 1)"))
    passed = between == 0.0 and vs_single <= TOLERANCE
    code = course.report_proof(
        passed, f"{args.world_size} ranks end with {'identical' if between == 0.0 else 'DIFFERENT'} "
        f"weights, {'equal' if vs_single <= TOLERANCE else 'NOT equal'} to lesson 00 trained in one "
        f"process on the global batch of {args.world_size * args.batch_size}",
        f"max |dw| between ranks {between:.1e}, against one process {vs_single:.1e}", f"{TOLERANCE:.0e}")
    if code:
        likely_cause(ranks, traced, names, args)
    return code


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
