"""The lab of lesson 09: runs training_loop.py and proves each part of its loop, in one launch.

    python 09_training_loop/prove.py                            # every part, 2 ranks
    python 09_training_loop/prove.py --world-size 3             # or --accumulate 4
    python 09_training_loop/prove.py --break no-loss-scaling    # K micro-batches not divided by K
    python 09_training_loop/prove.py --break sync-every-micro-batch  # no no_sync(): K all-reduces
    python 09_training_loop/prove.py --crash-rank 1             # rank 1 raises at step 2: stops
    python 09_training_loop/prove.py --out-dir runs/lab09       # keep the TensorBoard event file
    python 09_training_loop/prove.py --debugging                # DETAIL, monitored_barrier

1. Accumulation: N ranks x K micro-batches of B end with the weights of one process trained on
   N*K*B samples a step, and a counting DDP comm hook sees 0 all-reduces in the first K-1
   backward passes of every step.
2. Mixed precision: bf16 autocast against fp32, measured and timed (printed, never asserted).
3. Clipping: every rank computes the same gradient norm, that of the one-process full batch.
4. Uneven inputs: one rank with a step less hangs its peer until the group timeout without
   Join, and finishes with Join.
5. Monitoring: rank 0's SummaryWriter received the lesson's scalars (the tests read the file).
"""
import argparse
import contextlib
import datetime
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

if __name__ == "__main__" and sys.platform.startswith("linux"):  # course.start_method()'s rule
    import multiprocessing.forkserver  # start the ranks' forkserver now: it imports torch as we do
    multiprocessing.set_forkserver_preload(["__main__", "torch._dynamo"])  # as course.py's
    multiprocessing.forkserver.ensure_running()

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("training_loop", needs=(  # or the file given with --lesson PATH
    "make_dataset", "make_model", "train", "train_step", "worker"))

# DDP and one process add the same float32 numbers in other orders: measured ~1e-8 here; a
# missing 1/K moves the weights by 1e-2 and more.
TOLERANCE = 1e-5
HANG_TIMEOUT = 3  # seconds: the group timeout of part 4's run without Join
BATCH, LR, MAX_NORM, SAMPLES = 16, 0.05, 1.0, 256  # the lesson worker's defaults
BREAKS = {
    "no-loss-scaling": "train_step backpropagates each micro-batch's loss, not loss / K: "
                       "the gradient is K times too large",
    "sync-every-micro-batch": "train_step without no_sync(): every micro-batch all-reduces "
                              "(the weights stay right; the count catches it)",
}
EDITS = {  # each break is the lesson's own train_step with one line changed
    "no-loss-scaling": ("(loss / k).backward()", "loss.backward()"),
    "sync-every-micro-batch": ("model.no_sync() if i < k - 1 else contextlib.nullcontext()",
                               "contextlib.nullcontext()"),
}


def broken_train_step(name):
    """The lesson's train_step with the one edit that --break NAME makes, compiled in the
    lesson's namespace (so it stays in step with the lesson)."""
    old, new = EDITS[name]
    source = inspect.getsource(lesson.train_step)
    assert old in source, f"the lesson's train_step no longer contains {old!r}"
    namespace = dict(vars(lesson))
    exec(source.replace(old, new), namespace)
    return namespace["train_step"]


class Counter:
    """Counts, per optimizer step, the all-reduces (DDP comm hook calls) of each micro-batch."""

    def __init__(self):
        self.current, self.steps, self.weights = [], [], []
        self.handle = register_optimizer_step_post_hook(lambda optimizer, *_: self.close_step(
            optimizer))

    def make_ddp(self, module, **kwargs):
        """Stands in for the lesson's DDP: the same wrapper, with a counting comm hook."""
        model = DistributedDataParallel(module, **kwargs)
        module.register_forward_pre_hook(lambda *_: self.current.append(0))  # a micro-batch

        def counting_hook(process_group, bucket):  # one call per gradient bucket all-reduced
            self.current[-1] += 1
            return allreduce_hook(process_group, bucket)
        model.register_comm_hook(None, counting_hook)
        return model

    def close_step(self, optimizer):
        """Keeps the step's all-reduce counts and the weights it ended with (for the diagnosis)."""
        self.steps.append(self.current)
        self.current = []
        self.weights.append([p.detach().clone() for group in optimizer.param_groups
                             for p in group["params"]])


class UnevenSampler(DistributedSampler):
    """The last rank gets K*B samples less each epoch: one optimizer step less than its peers."""

    def __init__(self, *args, short_by=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.short_by = short_by if self.rank == self.num_replicas - 1 else 0

    def __iter__(self):
        return iter(list(super().__iter__())[:len(self) - self.short_by])


def timed(function, seconds):
    """Wraps a lesson function: appends the seconds each call took."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result
    return wrapper


def timed_run(run, *args, **kwargs):
    """(what lesson.worker returned or the error it raised, seconds)."""
    start = time.perf_counter()
    try:
        return run(*args, **kwargs), time.perf_counter() - start
    except RuntimeError as e:
        return e, time.perf_counter() - start


def lab_worker(rank, world_size, ports, backend, epochs, accumulate, out_dir, broken, crash_rank,
               timeout):
    """Every part in the same ranks: lesson.worker unchanged (but for --break) 4 times, each
    with its own process group; saves what this rank saw for the lab's main process. A --break
    changes the accumulation step only: it runs the first (parts 1, 3 and 5)."""
    counter = Counter()
    if broken:
        lesson.train_step = broken_train_step(broken)
    tags = []
    add_scalar = lesson.SummaryWriter.add_scalar
    lesson.SummaryWriter.add_scalar = lambda w, tag, *a, **k: tags.append(tag) or add_scalar(
        w, tag, *a, **k)
    train_seconds = []
    lesson.train = timed(lesson.train, train_seconds)
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    job = (backend, epochs, accumulate)
    kept = {}
    try:
        for i, precision in enumerate(("fp32",) if broken else ("fp32", "bf16")):
            lesson.DDP = counter.make_ddp if precision == "fp32" else DistributedDataParallel
            log_dir = os.path.join(out_dir, "tensorboard") if precision == "fp32" else None
            model, norms = lesson.worker(rank, world_size, ports[i], *job, precision, log_dir,
                                         timeout=timeout)
            kept[precision] = {"state": {k: v.detach().clone() for k, v in
                                         model.state_dict().items()}, "norms": norms,
                               "seconds": train_seconds[-1]}
            kept.setdefault("counts", list(counter.steps))
            kept.setdefault("steps", list(counter.weights))
        if broken:
            raise StopIteration
        lesson.DistributedSampler = lambda *a, **k: UnevenSampler(*a, short_by=accumulate * BATCH,
                                                                  **k)
        joined, kept["join seconds"] = timed_run(lesson.worker, rank, world_size, ports[2], *job,
                                                 "fp32", None, timeout=timeout)
        kept["join"] = {"state": dict(joined[0].state_dict()), "steps": len(joined[1])} \
            if isinstance(joined, tuple) else repr(joined)
        lesson.Join = lambda joinables: contextlib.nullcontext()  # the same loop without Join
        hung, kept["no join seconds"] = timed_run(lesson.worker, rank, world_size, ports[3], *job,
                                                  "fp32", None, timeout=HANG_TIMEOUT)
        kept["no join"] = re.sub(r"^\[[^]]*\] ", "", str(hung).splitlines()[0])[:200] \
            if isinstance(hung, Exception) else "finished"  # less gloo's source file
    except StopIteration:
        pass
    except BaseException:  # print this rank's own error first: mp.spawn may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    kept["tags"] = sorted(set(tags))
    torch.save(kept, os.path.join(out_dir, f"rank{rank}.pt"))


DDP_UNDER_DETAIL = """
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=10))
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
print("DDP built under DETAIL")
dist.destroy_process_group()
"""


def debugging_worker(rank, world_size, port, out_dir):
    """--debugging: two mistakes on raw collectives, what TORCH_DISTRIBUTED_DEBUG=DETAIL and
    monitored_barrier say about them (gloo)."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read when torch.distributed is imported:
    dist.set_debug_level_from_env()  # this forked rank imported it before; read it again
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=HANG_TIMEOUT))
    said = {}
    try:
        tensor = torch.ones(3)
        try:  # case 1: rank 0 all-reduces while the others broadcast
            dist.all_reduce(tensor) if rank == 0 else dist.broadcast(tensor, src=0)
            said["mismatch"] = "no error"
        except RuntimeError as e:
            said["mismatch"] = str(e)
        try:  # case 2: the last rank never reaches the barrier
            if rank < world_size - 1:
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
                said["barrier"] = "no error"
            else:
                time.sleep(2.5)
        except RuntimeError as e:
            said["barrier"] = str(e)
    finally:
        dist.destroy_process_group()
    torch.save(said, os.path.join(out_dir, f"debug{rank}.pt"))


def show_debugging(world_size):
    """--debugging: the two raw-collective mistakes in ranks, then DDP built under DETAIL in a
    fresh process (it segfaults on gloo in torch 2.15: a separate process, with a timeout)."""
    with tempfile.TemporaryDirectory(prefix="prove09_debug_") as out_dir:
        course.spawn_or_fail(debugging_worker, (world_size, course.find_free_port(), out_dir),
                             world_size)
        said = [torch.load(os.path.join(out_dir, f"debug{r}.pt"), weights_only=True)
                for r in range(world_size)]
    mismatch = said[0]["mismatch"]
    print("case 1, rank 0 all_reduce vs the others' broadcast, under DETAIL, rank 0 says:\n  "
          + mismatch.split(" Rank 0 is running")[0] + "\n  ... "
          + mismatch[mismatch.find("Collectives differ"):].strip())
    print(f"case 2, rank {world_size - 1} never reaches monitored_barrier, rank 0 says:\n  "
          + said[0]["barrier"].splitlines()[0])
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL")
    ddp = subprocess.run([sys.executable, "-c", DDP_UNDER_DETAIL % course.find_free_port()],
                         env=env, capture_output=True, text=True, timeout=120)
    print(f"case 3, DDP built under TORCH_DISTRIBUTED_DEBUG=DETAIL on gloo: exit code "
          f"{ddp.returncode}" + (" (SIGSEGV: a segmentation fault)" if ddp.returncode == -11 else
                                 f", {ddp.stdout.strip()}"))
    named = "Op type: ALLREDUCE" in mismatch and f"Rank {world_size - 1} failed to pass " \
        "monitoredBarrier" in said[0]["barrier"]
    return course.report_proof(named, f"DETAIL names the mismatched collectives and "
                               f"monitored_barrier names rank {world_size - 1}"
                               if named else "the debugging tools did NOT name the culprits",
                               f"DDP under DETAIL exit code {ddp.returncode}", "exact text")


def global_batches(world_size, accumulate, epoch):
    """At each step of an epoch, the sample indices that the N ranks' K micro-batches hold."""
    orders = []
    for r in range(world_size):
        sampler = DistributedSampler(range(SAMPLES), world_size, r, seed=0)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    step = accumulate * BATCH
    for start in range(0, len(orders[0]) // step * step, step):
        yield [i for order in orders for i in order[start:start + step]]


def train_reference(world_size, epochs, accumulate, steps=None):
    """One process, one batch of N*K*B a step, the same clipping and SGD: (weights, norms);
    `steps`, a list, gets the parameters after each step."""
    x, y = lesson.make_dataset().tensors
    model = lesson.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    norms = []
    for epoch in range(epochs):
        for batch in global_batches(world_size, accumulate, epoch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            optimizer.step()
            if steps is not None:
                steps.append([p.detach().clone() for p in model.parameters()])
    return model.state_dict(), norms


def precision_facts():
    """Why fp16 needs a GradScaler and bf16 does not: a small gradient value in each format."""
    small = torch.tensor(1e-8)
    scaler = torch.amp.GradScaler("cpu")  # exists in torch 2.15; its default scale is 65536
    return (f"a gradient of 1e-08 is {small.half().item():.1e} in fp16 (flushed to zero: fp16 "
            f"needs GradScaler, torch.amp.GradScaler('cpu') scale {scaler.get_scale():.0f}) and "
            f"{small.bfloat16().item():.1e} in bf16 (fp32's exponent range: no scaler)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'training_loop')
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--accumulate", type=int, default=2,
                   help="micro-batches of 16 per optimizer step per rank (default 2)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2: the whole run "
                   "must stop within seconds with that rank's own error")
    course.add_timeout_flag(p)
    p.add_argument("--debugging", action="store_true", help="instead of the proof: two "
                   "collective mistakes named by TORCH_DISTRIBUTED_DEBUG=DETAIL and "
                   "monitored_barrier, and DDP under DETAIL (it segfaults on gloo, torch 2.15)")
    p.add_argument("--out-dir", help="keep the TensorBoard event file and each rank's results "
                   "here (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    if min(args.epochs, args.accumulate) < 1 or args.timeout <= 0:
        course.refuse("--epochs, --accumulate and --timeout must be positive")
    if args.world_size < 2:
        course.refuse("--world-size must be 2 or more: parts 1, 3 and 4 compare ranks")
    per_rank = -(-SAMPLES // args.world_size) // BATCH  # micro-batches a rank has each epoch
    if per_rank // args.accumulate < 2:
        course.refuse(f"--accumulate {args.accumulate} leaves under 2 steps an epoch on "
                      f"{args.world_size} ranks ({per_rank} micro-batches of {BATCH} each)")
    course.refuse_bad_crash_rank(args.crash_rank, args.world_size)
    return args


def sampled(samples, world_size, drop_last):
    """How many samples each rank's DistributedSampler yields: 'a, b, ...'."""
    return ", ".join(str(len(list(DistributedSampler(range(samples), world_size, r,
                                                     drop_last=drop_last))))
                     for r in range(world_size))


def free_ports(count):
    ports = set()
    while len(ports) < count:
        ports.add(course.find_free_port())
    return sorted(ports)


def report_precision(ranks, steps):
    """Part 2: bf16 against fp32 (printed, never asserted), and where GradScaler is needed."""
    fp32, bf16 = ranks[0]["fp32"], ranks[0]["bf16"]
    print(f"2. bf16 autocast ends max |dw| {course.max_abs_diff(bf16['state'], fp32['state']):.1e} "
          f"from fp32 after {steps} steps; train() took {fp32['seconds'] * 1000:.0f} ms in fp32, "
          f"{bf16['seconds'] * 1000:.0f} ms in bf16 (rank 0; a model this small gains nothing)")
    print(f"   {precision_facts()}")


def report_uneven_inputs(ranks):
    """Part 4: True if every rank finished with Join, with equal weights, and every rank stopped
    at the group timeout without it."""
    joined = [r["join"] for r in ranks]
    join_ok = all(isinstance(j, dict) for j in joined)
    join_diff = max(course.max_abs_diff(joined[0]["state"], j["state"]) for j in joined) \
        if join_ok else float("inf")
    steps = ", ".join(str(j["steps"]) if isinstance(j, dict) else "failed" for j in joined)
    print(f"4. with Join: steps per rank {steps}; finished in {ranks[0]['join seconds']:.1f} s, "
          f"max |dw| between ranks {join_diff:.1e}")
    # The first rank to time out closes its connections: a peer still waiting may then report
    # "Connection closed by peer" instead of its own timeout, and the ranks' clocks cannot say
    # which raised first. So: every rank's time, and the timeout that at least one rank reports.
    times = [r["no join seconds"] for r in ranks]
    errors = [r["no join"].split(" for ")[0] for r in ranks]  # less "for send/recv ..."
    timeouts = [e for e in errors if e.startswith("Timed out")]
    raised = all(r["no join"] != "finished" for r in ranks)
    print(f"   without Join (group timeout {HANG_TIMEOUT} s): "
          f"{'every rank raised' if raised else 'a rank FINISHED'}, after "
          + ", ".join(f"{t:.1f}" for t in times) + " s; "
          + (f"{len(timeouts)} of {len(ranks)} with {timeouts[0]}" if timeouts else
             f"none timed out: {errors}"))
    n = len(ranks)
    print("   the alternative, even ranks: DistributedSampler of 255 samples on "
          f"{n} ranks gives {sampled(255, n, False)} samples (padded with repeats), with "
          f"drop_last=True {sampled(255, n, True)}")
    hung = raised and min(times) >= HANG_TIMEOUT and bool(timeouts)
    return join_ok and join_diff == 0.0 and hung


def main(argv=None):
    args = parse_args(argv)
    if args.debugging:
        return show_debugging(args.world_size)
    backend, device, reason = course.backend_for(args.world_size, args.device)
    n, k = args.world_size, args.accumulate
    print(f"backend: {backend} ({reason}); {n} ranks x {k} micro-batches x {BATCH} = "
          f"{n * k * BATCH} samples a step"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    with contextlib.ExitStack() as stack:
        out_dir = args.out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="lab09_"))
        os.makedirs(out_dir, exist_ok=True)
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (n, free_ports(4), backend, args.epochs, k, out_dir,
                                          args.broken, args.crash_rank, args.timeout), n)
        seconds = time.perf_counter() - start
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
                 for r in range(n)]
        events = sorted(os.listdir(os.path.join(out_dir, "tensorboard")))
    reference_steps = []
    reference, reference_norms = train_reference(n, args.epochs, k, reference_steps)
    print(f"all parts took {seconds:.1f} s on {course.hardware()}")

    # 1. accumulation
    vs_single = course.max_abs_diff(ranks[0]["fp32"]["state"], reference)
    counts = ranks[0]["counts"]
    skipped = all(c[:-1] == [0] * (k - 1) and c[-1] > 0 for c in counts)
    print(f"1. all-reduces per micro-batch, each of {len(counts)} steps on rank 0: "
          f"{counts[0]}{' (the same every step)' if all(c == counts[0] for c in counts) else ''}")
    if not args.broken:
        report_precision(ranks, len(counts))
    # 3. clipping
    norms = [r["fp32"]["norms"] for r in ranks]
    between = max(abs(a - b) for other in norms for a, b in zip(other, norms[0]))
    vs_norms = max(abs(a - b) for a, b in zip(norms[0], reference_norms))
    print(f"3. gradient norm before clipping to {MAX_NORM}: step 1 on each rank "
          + ", ".join(f"{x[0]:.6f}" for x in norms) + f"; max |d| between ranks {between:.1e}, "
          f"against one process {vs_norms:.1e}")
    uneven = args.broken or report_uneven_inputs(ranks)  # a --break skips parts 2 and 4
    # 5. monitoring
    print(f"5. rank 0 logged {', '.join(ranks[0]['tags'])} to tensorboard/{events[0][:20]}...")
    logged = {"step/grad_norm", "step/lr", "epoch/loss", "epoch/accuracy"} <= set(ranks[0]["tags"])
    passed = (vs_single <= TOLERANCE and skipped and between <= TOLERANCE and vs_norms <= TOLERANCE
              and uneven and logged)
    equal, clip_equal = vs_single <= TOLERANCE, between <= TOLERANCE
    claim = (f"{n} ranks x {k} micro-batches {'equal' if equal else 'do NOT equal'} one process "
             f"on {n * k * BATCH} a step, {'skipping' if skipped else 'NOT skipping'} {k - 1} of "
             f"{k} all-reduces; clip norms {'equal' if clip_equal else 'DIFFER'}; ")
    if not args.broken:
        claim += "uneven ranks " + ("hang without Join, finish with it; " if uneven else
                                    "NOT handled as expected; ")
    claim += f"{'all' if logged else 'NOT all'} scalars logged"
    code = course.report_proof(passed, claim, f"max |dw| against one process {vs_single:.1e}, "
                               f"clip norms {between:.1e}", f"{TOLERANCE:.0e}")
    if not passed:
        likely_cause(ranks, reference_steps, reference_norms, n, k, args.epochs, args.broken,
                     logged)
    return code


def where_it_leaves(steps, reference_steps, names):
    """(first step, 1-based, whose weights leave the reference by more than TOLERANCE, and the
    first parameter there), or (None, None)."""
    for s, (mine, theirs) in enumerate(zip(steps, reference_steps), 1):
        for name, a, b in zip(names, mine, theirs):
            if (a.double() - b.double()).abs().max().item() > TOLERANCE:
                return s, name
    return None, None


def likely_cause(ranks, reference_steps, reference_norms, n, k, epochs, broken, logged):
    """The last line of a failure: which typical mistake the measurements fit (never read from
    the learner's source), or what was measured."""
    where = lambda text: course.lesson_line("09_training_loop/training_loop.py", text)  # noqa
    fp32, counts = ranks[0]["fp32"], ranks[0]["counts"]
    names = list(fp32["state"])
    ratio = fp32["norms"][0] / reference_norms[0]
    agree = max(course.max_abs_diff(fp32["state"], r["fp32"]["state"]) for r in ranks)
    step, name = where_it_leaves(ranks[0]["steps"], reference_steps, names)
    per_epoch = len(reference_steps) // epochs
    every = any(any(c[:-1]) for c in counts)
    joined = [r.get("join") for r in ranks]
    join_failed = not broken and not all(isinstance(j, dict) for j in joined)
    said = next((j for j in joined if isinstance(j, str)), "")
    measured = (f"the ranks {'agree' if agree == 0.0 else f'differ by {agree:.1e}'}; "
                + (f"they leave one process at step {step}, first in {name}" if step else
                   "their weights equal one process's at every step")
                + f"; the first step's gradient norm is {ratio:.2f} times one process's; "
                f"all-reduces per micro-batch {counts[0] if counts else 'none counted'}")
    course.diagnose([
        (k > 1 and abs(ratio - k) < 0.02 * k,
         f"the loss is not divided by the K = {k} micro-batches: the first step's gradient norm "
         f"is {ratio:.2f} times one process's; backpropagate loss / K ({where('(loss / k).backward()')})"),
        (abs(ratio * n - 1) < 0.02 and n > 1,
         f"the loss is divided by the world size too: the first step's gradient norm is "
         f"{ratio:.2f} times one process's (1/{n}); DDP already averages over the ranks: "
         f"backpropagate loss / K only ({where('(loss / k).backward()')})"),
        (k > 1 and every,
         f"every micro-batch all-reduces: {counts[0]} all-reduces per micro-batch, where no_sync "
         f"gives {[0] * (k - 1) + [max(counts[0])]}; run the forward and backward of the first "
         f"K-1 micro-batches under model.no_sync() ({where('model.no_sync()')})"),
        (step is not None and step == per_epoch + 1 and abs(ratio - 1) < 1e-4,
         f"every epoch repeats the first shuffle: the weights equal one process's through epoch "
         f"0 and leave it at step {step}, the first of epoch 1; call "
         f"loader.sampler.set_epoch(epoch) ({where('set_epoch(epoch)')})"),
        (join_failed and step is None,
         f"a rank one step short stopped the run with Join: {said[:120]}; wrap the loop in "
         f"Join([model]) ({where('with Join([model])')})"),
        (not logged and step is None,
         f"rank 0 logged {', '.join(ranks[0]['tags']) or 'no scalar'}: not step/grad_norm, "
         f"step/lr, epoch/loss and epoch/accuracy ({where('writer.add_scalar(')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
