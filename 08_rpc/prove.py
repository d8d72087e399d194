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
import re
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


FAILURE_KEYS = ("local_backward", "dist_backward", "rref_optimizer", "error")


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


def in_a_context():
    """True inside a `with dist_autograd.context()` block of this thread."""
    try:
        dist_autograd._current_context()
        return True
    except RuntimeError:
        return False


def watch_trainer(kept):
    """Measures, in a trainer, what its loop did (global patches: the lesson runs unchanged):
    local backward() calls made inside a distributed autograd context, dist_autograd.backward
    calls, and optimizers built on RRefs instead of tensors. For the diagnosis of a failure."""
    from torch._C._distributed_rpc import PyRRef  # the class of every RRef (needs RPC)
    kept.update(local_backward=0, dist_backward=0, rref_optimizer=None)
    real_backward, real_dist_backward = torch.autograd.backward, dist_autograd.backward
    real_init = torch.optim.Optimizer.__init__

    def backward(*args, **kwargs):  # Tensor.backward calls torch.autograd.backward
        kept["local_backward"] += in_a_context()
        return real_backward(*args, **kwargs)

    def dist_backward(*args, **kwargs):
        kept["dist_backward"] += 1
        return real_dist_backward(*args, **kwargs)

    def init(self, params, *args, **kwargs):
        params = list(params)
        flat = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        rrefs = sum(isinstance(p, PyRRef) for p in flat)
        if rrefs:
            kept["rref_optimizer"] = (f"{type(self).__module__.split('.')[0]}.optim "
                                      f"{type(self).__name__}", rrefs)
        return real_init(self, params, *args, **kwargs)
    torch.autograd.backward, dist_autograd.backward = backward, dist_backward
    torch.optim.Optimizer.__init__ = init


def lab_worker(index, jobs, epochs, batch_size, lr, out_dir, broken, crash_rank, timeout):
    """Process `index` runs jobs[index], one rank of one run of the lesson's worker, unchanged
    but for --break, and saves what it returns: the server's weights, a trainer's losses. A
    trainer that fails saves what watch_trainer measured, then raises."""
    job, kept = jobs[index], {}
    if job["rank"] > 0:
        watch_trainer(kept)
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
    except BaseException as error:  # print this rank's own error first: the spawner may report
        traceback.print_exc()  # a peer's
        sys.stderr.flush()
        if job["rank"] > 0:
            said = re.split(r' at "|, but ', (str(error).strip() or "?").splitlines()[0])[0]
            kept["error"] = f"{type(error).__name__}: {said[:80]}"
            torch.save({k: v for k, v in kept.items() if k in FAILURE_KEYS},
                       os.path.join(out_dir, f"{job['run']}_rank{job['rank']}_failed.pt"))
        raise
    if job["rank"] == 0:
        kept["state"] = {k: v.detach().clone() for k, v in built.state_dict().items()}
        kept["grad_none_at_end"] = [p.grad is None for p in built.parameters()]
    else:
        kept["losses"] = built
    torch.save(kept, os.path.join(out_dir, f"{job['run']}_rank{job['rank']}.pt"))


def where(text):
    """The lesson's line that a learner compares theirs with."""
    return course.lesson_line("08_rpc/rpc.py", text)


def cause_of_failed_trainer(out_dir, jobs):
    """The likely cause of a trainer's error, from what watch_trainer measured there, or None."""
    for job in jobs:
        path = os.path.join(out_dir, f"{job['run']}_rank{job['rank']}_failed.pt")
        if not os.path.exists(path):
            continue
        seen = torch.load(path, weights_only=True)
        who = f"trainer {job['rank']}"
        if seen["rref_optimizer"]:
            kind, count = seen["rref_optimizer"]
            return (f"a local optimizer built on the parameters' RRefs: {who} built {kind} on "
                    f"{count} RRef(s) and raised {seen['error']}; the parameters live on the "
                    f"server, and only DistributedOptimizer(torch.optim.SGD, params, ...) steps "
                    f"them there ({where('DistributedOptimizer(torch.optim.SGD')})")
        if seen["local_backward"] and not seen["dist_backward"]:
            return (f"loss.backward() inside a distributed autograd context: {who} ran a local "
                    f"backward {seen['local_backward']} time(s) in a dist_autograd context and "
                    f"dist_autograd.backward none, then raised {seen['error']}; a local backward "
                    f"never reaches the server's parameters: dist_autograd.backward(context_id, "
                    f"[loss]) ({where('dist_autograd.backward(context_id')})")
    return None


def spawn_naming_the_cause(args, jobs, out_dir):  # args: lab_worker's
    """course.spawn_or_fail, whose RUN FAILED ends with the cause that the failed trainer's
    measurements fit (else the course's own: where the learner's file raised)."""
    course_cause = course.cause_of_rank_error
    course.cause_of_rank_error = lambda text: (
        None if "crashed on purpose" in text else cause_of_failed_trainer(out_dir, jobs)
    ) or course_cause(text)
    try:
        course.spawn_or_fail(lab_worker, args, len(jobs))
    finally:
        course.cause_of_rank_error = course_cause


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
        spawn_naming_the_cause((jobs, args.epochs, args.batch_size, args.lr, out_dir, args.broken,
                                args.crash_rank, args.timeout), jobs, out_dir)
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
    code = course.report_proof(
        passed, "the server driven by one trainer over RPC ends "
        f"{'equal' if vs_local <= TOLERANCE else 'NOT equal'} to a local loop on the same batches, "
        f"its gradients {'in the context, not in .grad' if grad_none else 'in .grad'}",
        f"max |dw| {vs_local:.1e}, first gradients max |dg| {grads:.1e}", f"{TOLERANCE:.0e}")
    if not passed:
        likely_cause(server, trainer, losses, first_grads, grads, grad_none,
                     len(losses) // args.epochs)
    return code


def likely_cause(server, trainer, losses, first_grads, d_grads, grad_none, per_epoch):
    """The last line of a failed proof: the typical mistake the measurements fit (never read from
    the learner's source), else what was measured."""
    start = {k: v.detach() for k, v in course.load_lesson(
        "00_single_process/single_process.py").make_model().state_dict().items()}
    moved = course.max_abs_diff(server["state"], start)
    mine = trainer["losses"]
    apart = next((i for i, (a, b) in enumerate(zip(mine, losses), 1)
                  if abs(a - b) > TOLERANCE), None)
    norm = lambda grads: torch.cat([g.flatten() for g in grads]).norm().item()  # noqa: E731
    ratio = norm(trainer["first_grads"]) / norm(first_grads)
    measured = (f"the server's weights moved {moved:.1e} from make_model()'s in {len(mine)} "
                f"trainer steps; the first step's gradients are {ratio:.2f} times a local loop's "
                f"(max |dg| {d_grads:.1e}); " + (f"the losses part from the local loop's at step "
                                                 f"{apart}" if apart else "the losses agree"))
    course.diagnose([
        (moved == 0.0 and len(mine) > 0,
         f"the server's weights never moved: max |dw| from make_model()'s {moved:.1e} after "
         f"{len(mine)} trainer steps (the gradients in the context: {ratio:.2f} times a local "
         f"loop's); step in the context of the backward: optimizer.step(context_id) "
         f"({where('optimizer.step(context_id)')})"),
        (not grad_none,
         f"the server's gradients landed in .grad: after step 1, .grad is set on "
         f"{trainer['grad_none'].count(False)} of {len(trainer['grad_none'])} parameters; "
         f"distributed autograd keeps them in the context: dist_autograd.backward(context_id, "
         f"[loss]) ({where('dist_autograd.backward(context_id')})"),
        (d_grads > TOLERANCE and abs(mine[0] - losses[0]) > TOLERANCE,
         f"the trainer's first batch or model differs from the local loop's: the first loss "
         f"{mine[0]:.4f} against {losses[0]:.4f}; its batches from DistributedSampler(seed=0), "
         f"the model from make_model() ({where('DistributedSampler(dataset')})"),
        (apart is not None and apart == per_epoch + 1 and d_grads <= TOLERANCE,
         f"every epoch repeats the first shuffle: the losses equal the local loop's through epoch "
         f"0 and part at step {apart}, the first of epoch 1; call loader.sampler.set_epoch(epoch) "
         f"({where('set_epoch(epoch)')})"),
        (apart is not None and apart > 1 and d_grads <= TOLERANCE,
         f"the step differs from SGD(lr, momentum=0.9): the first gradients equal a local loop's "
         f"(max |dg| {d_grads:.1e}) and the losses part at step {apart}; DistributedOptimizer("
         f"torch.optim.SGD, params, lr=lr, momentum=0.9) "
         f"({where('DistributedOptimizer(torch.optim.SGD')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
