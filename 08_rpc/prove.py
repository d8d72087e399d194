"""The lab of lesson 08: runs rpc.py and proves its claim.

    python 08_rpc/prove.py                           # the proof, and 2 asynchronous trainers
    python 08_rpc/prove.py --async-trainers 0        # the proof only
    python 08_rpc/prove.py --break local-backward    # loss.backward(): the trainer stops
    python 08_rpc/prove.py --break plain-optimizer   # torch.optim.SGD on RRefs: stops
    python 08_rpc/prove.py --crash-rank 1            # trainer 1 raises at step 2: the run stops

The claim: a parameter server driven by ONE trainer over RPC ends with the weights of a local
loop (lesson 00's model and step) on the same batches, within float32 rounding; the gradients of
a step live in its distributed autograd context on the server, never in the parameters' .grad.
Beside it, a server with several trainers runs too: asynchronous, it matches no fixed order.
"""
import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed.autograd as dist_autograd  # noqa: E402
import torch.distributed.rpc as torch_rpc  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import course  # noqa: E402

if not torch_rpc.is_available():  # before the lesson's import, which would exit on it
    course.refuse(f"lesson 08 needs torch.distributed.rpc, which this torch build on "
                  f"{course.platform_name()} lacks (PyTorch builds none for Windows)")
lesson = course.import_lesson("rpc", needs=(  # or the file given with --lesson PATH
    "worker",))

TOLERANCE = 1e-5  # float32 rounding: the server's forward and a local one add in other orders
BREAKS = {
    "local-backward": "the trainer calls loss.backward() instead of dist_autograd.backward()",
    "plain-optimizer": "the trainer builds torch.optim.SGD on the parameters' RRefs instead of "
                       "DistributedOptimizer",
}


class LocalBackward:
    """--break local-backward: the lesson's dist_autograd, whose backward is loss.backward()."""
    context = staticmethod(dist_autograd.context)

    @staticmethod
    def backward(context_id, roots):
        roots[0].backward()


def plain_optimizer(optimizer_class, params, **kwargs):
    """--break plain-optimizer: a local optimizer handed the RRefs, as if they were tensors."""
    return optimizer_class(params, **kwargs)


def gradients_on_server(context_id):
    """Runs on "ps" (called through RPC): what the context holds for each parameter, and
    whether any parameter's .grad was set."""
    grads = dist_autograd.get_gradients(context_id)
    with lesson.FORWARD_LOCK:  # not during another trainer's forward, which swaps the weights
        params = list(lesson.SERVER["model"].parameters())
    return [grads[p].clone() for p in params], [p.grad is None for p in params]


def observed(optimizer_class, kept, crash_rank=None):
    """The lesson's DistributedOptimizer, which before its first step asks the server for the
    step's gradients (and on --crash-rank raises after its 2nd step)."""
    class Observed(optimizer_class):
        steps = 0

        def step(self, context_id):
            if self.steps == 0:
                kept["first_grads"], kept["grad_none"] = torch_rpc.rpc_sync(
                    "ps", gradients_on_server, args=(context_id,))
                kept["trainer_grads"] = len(dist_autograd.get_gradients(context_id))
            super().step(context_id)
            self.steps += 1
            if self.steps == 2 and crash_rank is not None:
                raise RuntimeError(f"rank {crash_rank} crashed on purpose (--crash-rank)")
    return Observed


def lab_worker(index, jobs, epochs, batch_size, lr, out_dir, broken, crash_rank, timeout):
    """Process `index` runs jobs[index], one rank of one run of the lesson's worker, unchanged
    but for --break, and saves what it returns: the server's weights, a trainer's losses."""
    job, kept = jobs[index], {}
    if job["rank"] > 0:
        if broken == "local-backward":
            lesson.dist_autograd = LocalBackward
        if broken == "plain-optimizer":
            lesson.DistributedOptimizer = plain_optimizer
        else:
            crashes = crash_rank if job["rank"] == crash_rank else None
            lesson.DistributedOptimizer = observed(lesson.DistributedOptimizer, kept, crashes)
    quiet = contextlib.redirect_stdout(io.StringIO())  # runs side by side would mix their lines
    try:
        with quiet if job["run"] != "proof" else contextlib.nullcontext():
            built = lesson.worker(job["rank"], job["world_size"], job["port"], epochs, batch_size,
                                  lr, timeout)
    except BaseException:  # print this rank's own error first: the spawner may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    if job["rank"] == 0:
        kept["state"] = {k: v.detach().clone() for k, v in built.state_dict().items()}
        kept["grad_none_at_end"] = [p.grad is None for p in built.parameters()]
    else:
        kept["losses"] = built
    torch.save(kept, os.path.join(out_dir, f"{job['run']}_rank{job['rank']}.pt"))


def train_reference(trainers, epochs, batch_size, lr):
    """Lesson 00's model and step, in this process: each trainer's batches in turn (trainer 1's
    first batch, trainer 2's first, ...), each trainer with its own SGD and momentum, as
    DistributedOptimizer gives each trainer its own optimizer on the server. Returns the final
    weights, the losses and the gradients of the first step."""
    single = course.load_lesson("00_single_process/single_process.py")
    dataset, model = single.make_dataset(), single.make_model()
    samplers = [DistributedSampler(dataset, num_replicas=trainers, rank=r, seed=0)
                for r in range(trainers)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s) for s in samplers]
    optimizers = [torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) for _ in loaders]
    losses, first_grads = [], None
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for batches in zip(*loaders):
            for (x, y), optimizer in zip(batches, optimizers):
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                first_grads = first_grads or [p.grad.clone() for p in model.parameters()]
                optimizer.step()
                losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses, first_grads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'rpc')
    p.add_argument("--async-trainers", type=int, default=2, help="trainers of the second server, "
                   "run beside the proof (default 2; 0: none)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per trainer step "
                   "(default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this trainer (rank 1 or more) of each run "
                   "raises after its 2nd step: the whole run must stop within seconds")
    p.add_argument("--timeout", type=float, default=60, help="rpc_timeout in seconds: an RPC "
                   "that gets no answer raises after it (default 60)")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size) < 1 or args.lr <= 0 or args.timeout <= 0:
        course.refuse("--epochs, --batch-size, --lr and --timeout must be positive")
    if args.async_trainers < 0 or args.async_trainers == 1:
        course.refuse("--async-trainers must be 0 (none) or 2 or more: the proof run has one")
    if args.crash_rank is not None:
        if args.crash_rank == 0:
            course.refuse("--crash-rank 0 is the parameter server, which takes no step: name a "
                          "trainer, rank 1 or more")
        if not 1 <= args.crash_rank <= max(1, args.async_trainers):
            course.refuse(f"--crash-rank must be a trainer, 1 to {max(1, args.async_trainers)}")
        if args.epochs * -(-256 // max(1, args.async_trainers) // args.batch_size) < 2:
            course.refuse("--crash-rank crashes after step 2, but this run has fewer steps")
    return args


def main(argv=None):
    args = parse_args(argv)
    print("rpc backend: TensorPipe on CPU (the only RPC backend in torch 2.15); 1 server + 1 "
          "trainer (the proof)" + (f", beside it 1 server + {args.async_trainers} trainers"
                                    if args.async_trainers else "")
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    runs = [("proof", 1)] + ([("async", args.async_trainers)] if args.async_trainers else [])
    jobs = []
    for run, trainers in runs:  # each run its own port, all ranks in one launch
        port = course.find_free_port()
        jobs += [dict(run=run, rank=r, world_size=trainers + 1, port=port)
                 for r in range(trainers + 1)]
    with tempfile.TemporaryDirectory(prefix="prove08_") as out_dir:
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (jobs, args.epochs, args.batch_size, args.lr, out_dir,
                                          args.broken, args.crash_rank, args.timeout), len(jobs))
        seconds = time.perf_counter() - start
        kept = {f"{j['run']}{j['rank']}": torch.load(os.path.join(
            out_dir, f"{j['run']}_rank{j['rank']}.pt"), weights_only=True) for j in jobs}
    print(f"training took {seconds:.1f} s ({len(jobs)} processes) on {course.hardware()}")
    server, trainer = kept["proof0"], kept["proof1"]
    reference, losses, first_grads = train_reference(1, args.epochs, args.batch_size, args.lr)
    vs_local = course.max_abs_diff(server["state"], reference)
    grads = max((a - b).abs().max().item() for a, b in zip(trainer["first_grads"], first_grads))
    grad_none = all(trainer["grad_none"]) and all(server["grad_none_at_end"])
    print(f"step 1 on the server: .grad is None on all {len(trainer['grad_none'])} parameters: "
          f"{grad_none}; get_gradients holds {len(trainer['first_grads'])} gradients there (the "
          f"trainer's context: {trainer['trainer_grads']}), against loss.backward() locally "
          f"max |dg| {grads:.1e}")
    print(f"final loss: server {trainer['losses'][-1]:.4f}, local loop {losses[-1]:.4f}")
    if args.async_trainers:
        turns, _, _ = train_reference(args.async_trainers, args.epochs, args.batch_size, args.lr)
        finals = [kept[f"async{r}"]["losses"][-1] for r in range(1, args.async_trainers + 1)]
        print(f"{args.async_trainers} asynchronous trainers: final losses "
              + ", ".join(f"{x:.4f}" for x in finals) + "; server weights against the trainers "
              f"taking turns: max |dw| {course.max_abs_diff(kept['async0']['state'], turns):.1e} "
              "(no fixed order: not a proof)")
    passed = vs_local <= TOLERANCE and grads <= TOLERANCE and grad_none
    return course.report_proof(
        passed, "the server driven by one trainer over RPC ends "
        f"{'equal' if vs_local <= TOLERANCE else 'NOT equal'} to a local loop on the same batches, "
        f"its gradients {'in the context, not in .grad' if grad_none else 'in .grad'}",
        f"max |dw| {vs_local:.1e}, first gradients max |dg| {grads:.1e}", f"{TOLERANCE:.0e}")


if __name__ == "__main__":
    sys.exit(course.run_lab(main))
