"""The lab of lesson 01: runs dataparallel.py in this process and proves its claim.

    python 01_dataparallel/prove.py                             # the proof, 2 replicas
    python 01_dataparallel/prove.py --replicas 3                # chunks of 11, 11 and 10 rows
    python 01_dataparallel/prove.py --break detached-replicas   # replicas 1.. lose their gradient
    python 01_dataparallel/prove.py --break averaged-gradients  # the replicas' gradients averaged

The claim: at every step, the lesson's DataParallel (by hand on CPU; nn.DataParallel with 2 or more
GPUs) gives the unwrapped model's outputs and gradients on the whole batch, at the same weights,
and ends with the weights of lesson 00 trained in one process on the same batches. Also checked:
what nn.DataParallel itself does on this machine (without a GPU it just calls the module).
One process and its threads: no ranks, no process group, so no --crash-rank and no --timeout (an
error in a replica's thread is raised again in the caller; the tests check that).
"""
import argparse
import contextlib
import copy
import io
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("dataparallel", needs=(  # or the file given with --lesson PATH
    "choose_path", "main", "make_dataset", "make_model", "replicate"))

# Only the grouping of rows and the order of sums differ from the unwrapped model. Measured here
# (CPU, float32): outputs 0.0 with 2 replicas, up to 2e-07 with 3; gradients up to 1.5e-08 at each step, final weights
# after 16 momentum-SGD steps up to 6e-08; a break gives 1e-2 or more. On GPUs not measured (no GPU
# was available): the looser bound allows for cuBLAS picking other kernels for a chunk.
TOLERANCE = {"cpu": 1e-6, "cuda": 1e-5}
BREAKS = {
    "detached-replicas": "replicas 1.. get detached copies of the parameters, as copy.deepcopy "
                         "per device would: their gradients never reach the model",
    "averaged-gradients": "each replica's gradient is divided by the number of replicas, as if "
                          "DataParallel averaged them across devices (it sums them)",
}


def load_single_process():
    """Lesson 00's script, the reference every proof trains."""
    return course.load_lesson("00_single_process/single_process.py")


def detached_replicate(module, replicas):
    """--break detached-replicas: the lesson's replicate, but replicas 1.. get p.detach().clone()."""
    return [(copy.deepcopy(module), {name: p.clone() if i == 0 else p.detach().clone()
                                     for name, p in module.named_parameters()})
            for i in range(replicas)]


def averaging(replicate):
    """--break averaged-gradients: each clone divides the gradient it passes back by N."""
    def replicate_and_average(module, replicas):
        built = replicate(module, replicas)
        for _, tensors in built:
            for tensor in tensors.values():
                tensor.register_hook(lambda grad: grad / replicas)
        return built
    return replicate_and_average


def run_lesson(replicas=2, epochs=2, batch_size=32, lr=0.05, device="auto", broken=None):
    """Runs the lesson's main() unchanged (but for --break) in this process and watches it from
    outside: a forward hook on its model (the replicas inherit it) keeps each call's thread, rows
    and output; a global optimizer pre-step hook keeps the weights and gradients of every step.
    Returns (steps, the trained model, the losses, seconds); the lesson module is left as it was."""
    calls, steps = [], []

    def on_forward(module, args, output):
        calls.append((threading.current_thread().name, len(args[0]), output.detach().cpu().clone(),
                      output.device))

    def before_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        steps.append({"calls": list(calls), "weights": [p.detach().cpu().clone() for p in params],
                      "grads": [p.grad.detach().cpu().clone() for p in params]})
        calls.clear()

    original = {"make_model": lesson.make_model, "replicate": lesson.replicate}

    def make_watched_model(seed=0):
        model = original["make_model"](seed)
        model.register_forward_hook(on_forward)
        return model

    lesson.make_model = make_watched_model
    if broken == "detached-replicas":
        lesson.replicate = detached_replicate
    if broken == "averaged-gradients":
        lesson.replicate = averaging(original["replicate"])
    hook, threads = register_optimizer_step_pre_hook(before_step), torch.get_num_threads()
    start = time.perf_counter()
    try:
        model, losses = lesson.main(replicas, epochs, batch_size, lr, device)
    finally:
        hook.remove()
        torch.set_num_threads(threads)
        for name, function in original.items():
            setattr(lesson, name, function)
    return steps, model, losses, time.perf_counter() - start


def replica_index(call):
    """Which chunk a call ran: its GPU on cuda, its thread's name ("replica i") on CPU."""
    thread, _, _, device = call
    if device.type == "cuda":
        return device.index
    return int(thread.rsplit(" ", 1)[-1]) if thread.startswith("replica ") else 0


def gathered(calls):
    """The step's output as the lesson's gather built it: the replicas' outputs in chunk order."""
    return torch.cat([output for _, _, output, _ in sorted(calls, key=replica_index)])


def reference_batches(epochs, batch_size):
    """Lesson 00's batches: the same data set, the same loader with its own seeded generator."""
    single = load_single_process()
    loader = DataLoader(single.make_dataset(), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    return [batch for _ in range(epochs) for batch in loader]


def compare_steps(steps, batches):
    """At each step, lesson 00's unwrapped model at the lesson's weights on the whole batch:
    returns (max |dy| of the outputs, max |dgrad| of the gradients) over all steps."""
    model, d_out, d_grad = load_single_process().make_model(), 0.0, 0.0
    for (x, y), step in zip(batches, steps):
        with torch.no_grad():
            for p, w in zip(model.parameters(), step["weights"]):
                p.copy_(w)
        model.zero_grad(set_to_none=True)
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
        d_out = max(d_out, (out.detach() - gathered(step["calls"])).abs().max().item())
        d_grad = max(d_grad, *((p.grad - g).abs().max().item()
                               for p, g in zip(model.parameters(), step["grads"])))
    return d_out, d_grad


def train_lesson_00(epochs, batch_size, lr):
    """Lesson 00's main(), unchanged: one process, no wrapper; returns its weights and seconds."""
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its epoch lines would repeat the lesson's
        model, _ = load_single_process().main(epochs, batch_size, lr)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, time.perf_counter() - start


def dataparallel_here(batch_size):
    """nn.DataParallel(model) on this machine: (device_ids, [(thread, rows)] of the module's calls,
    max |dy| from the module's own output). Without a GPU: [], one call of all rows, 0.0."""
    model, calls = lesson.make_model(), []
    x = lesson.make_dataset().tensors[0][:batch_size]
    expected = model(x).detach()
    model.register_forward_hook(lambda m, args, out: calls.append(
        (threading.current_thread().name, len(args[0]))))
    wrapped = nn.DataParallel(model)  # with one GPU, this moves model to cuda:0
    if wrapped.device_ids:
        model.to(f"cuda:{wrapped.device_ids[0]}")
    out = wrapped(x).detach().cpu()
    return wrapped.device_ids, calls, (out - expected).abs().max().item()


def verdict(steps, batches, d_out, d_grad, d_end, here_diff, tolerance):
    """(passed, measured) for the lesson's steps against the references."""
    every_step = len(steps) == len(batches)
    passed = every_step and max(d_out, d_grad, d_end, here_diff) <= tolerance
    measured = (f"{len(steps)} of {len(batches)} steps seen; max |dy| {d_out:.1e}, "
                f"max |dgrad| {d_grad:.1e}, final max |dw| {d_end:.1e}")
    return passed, measured


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'dataparallel')
    p.add_argument("--replicas", type=int, default=2, help="GPUs for nn.DataParallel, or threads of "
                   "the hand-written step on CPU (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="the WHOLE batch, scattered in "
                   "--replicas chunks (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    args = p.parse_args(argv)
    if min(args.replicas, args.epochs, args.batch_size) < 1 or args.lr <= 0:
        course.refuse("--replicas, --epochs, --batch-size and --lr must be positive")
    if args.broken and args.replicas < 2:
        course.refuse(f"--break {args.broken} needs --replicas 2 or more: one replica has no "
                      "other to lose or to average with")
    gpus = torch.cuda.device_count()
    if args.device == "cuda" and not 2 <= args.replicas <= gpus:
        course.refuse(f"--device cuda runs nn.DataParallel with one GPU per replica, 2 or more: "
                      f"--replicas {args.replicas}, {gpus} GPU(s) visible")
    if args.device == "cuda" and args.broken:
        course.refuse("--break changes the hand-written step: use --device cpu or auto")
    return args


def main(argv=None):
    args = parse_args(argv)
    by_hand = args.device == "cpu" or (args.broken and lesson.choose_path(args.replicas)[0] == "cuda")
    device = "cpu" if by_hand else "auto"  # the breaks replace the hand-written step's replicate
    if args.broken:
        print(f"--break {args.broken}: {BREAKS[args.broken]}", flush=True)
    steps, model, _, seconds = run_lesson(args.replicas, args.epochs, args.batch_size, args.lr,
                                          device, args.broken)
    on_gpus = any(device.type == "cuda" for step in steps for _, _, _, device in step["calls"])
    print("inside the module at step 1: " + ", ".join(
        f"{rows} rows in thread '{thread}'" for thread, rows, _, _ in
        sorted(steps[0]["calls"], key=replica_index)) if steps else "no step was taken")
    device_ids, calls, here_diff = dataparallel_here(args.batch_size)
    print(f"nn.DataParallel(model) here: device_ids {device_ids}; the module ran {len(calls)} time(s): "
          + ", ".join(f"{rows} rows in {thread}" for thread, rows in calls)
          + f"; output max |dy| {here_diff:.1e} from the module's own")
    batches = reference_batches(args.epochs, args.batch_size)
    d_out, d_grad = compare_steps(steps, batches)
    reference, reference_seconds = train_lesson_00(args.epochs, args.batch_size, args.lr)
    d_end = course.max_abs_diff({k: v.detach().cpu() for k, v in model.state_dict().items()},
                                reference)
    print(f"the lesson's main() took {seconds:.1f} s in all, lesson 00's {reference_seconds:.1f} s, "
          f"on {course.hardware()}")
    tolerance = TOLERANCE["cuda" if on_gpus or device_ids else "cpu"]
    passed, measured = verdict(steps, batches, d_out, d_grad, d_end, here_diff, tolerance)
    what = f"nn.DataParallel on {args.replicas} GPUs" if on_gpus else \
        f"the hand-written DataParallel ({args.replicas} replica threads)"
    code = course.report_proof(
        passed, f"at each step {what} {'gives' if passed else 'does NOT give'} the unwrapped "
        f"model's outputs and gradients on the whole batch of {args.batch_size}, and "
        f"{'ends' if d_end <= tolerance else 'does NOT end'} with lesson 00's weights", measured,
        f"{tolerance:.0e}")
    if code:
        likely_cause(steps, batches, args.replicas, tolerance, len(batches) // args.epochs)
    return code


def likely_cause(steps, batches, replicas, tolerance, per_epoch):
    """The last line of a failed proof: which typical mistake the measurements fit (never read
    from the learner's source), else what was measured. At step 1, the lesson's gradient against
    the unwrapped model's on the whole batch and on replica 0's rows alone."""
    where = lambda text: course.lesson_line("01_dataparallel/dataparallel.py", text)  # noqa
    if not steps:
        return course.report_unknown("no optimizer step was taken")
    model = load_single_process().make_model()
    (x, y), step = batches[0], steps[0]
    with torch.no_grad():
        for p, w in zip(model.parameters(), step["weights"]):
            p.copy_(w)
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    out = model(x)
    whole = flat(torch.autograd.grad(nn.functional.cross_entropy(out, y), list(model.parameters())))
    rows = sorted(step["calls"], key=replica_index)[0][1] if step["calls"] else len(x)
    first_rows = flat(torch.autograd.grad(nn.functional.cross_entropy(
        model(x[:rows]), y[:rows], reduction="sum") / len(x), list(model.parameters())))
    mine = flat(step["grads"])
    ratio = (mine.norm() / whole.norm()).item()
    only_first = (mine - first_rows).abs().max().item()
    scaled = (mine - whole / replicas).abs().max().item()
    d_out = [(out.detach() - gathered(step["calls"])).abs().max().item() if step["calls"] else 0.0]
    for (xb, _), later in zip(batches[1:], steps[1:]):  # each step's outputs at its own weights
        with torch.no_grad():
            for p, w in zip(model.parameters(), later["weights"]):
                p.copy_(w)
            d_out.append((model(xb) - gathered(later["calls"])).abs().max().item())
    bad = next((i for i, d in enumerate(d_out, 1) if d > tolerance), None)
    measured = (f"step 1: the gradient is {ratio:.2f} times the whole batch's (max |dg| "
                f"{(mine - whole).abs().max().item():.1e}), {only_first:.1e} from replica 0's "
                f"{rows} rows alone; " + (f"the outputs part from the unwrapped model's at step "
                                          f"{bad}" if bad else "the outputs agree at every step"))
    course.diagnose([
        (bad == 1,
         f"the gathered output is not the unwrapped model's on the whole batch: step 1's outputs "
         f"differ by {d_out[0]:.1e}; scatter in chunks along dim 0 and gather them in chunk order "
         f"({where('torch.cat(outputs)')})"),
        (bad is not None and bad > 1,
         f"the replicas run on stale weights: the outputs equal the unwrapped model's at step 1 "
         f"and part at step {bad}; replicate the module at every forward "
         f"({where('replicate(self.module')})"),
        (replicas > 1 and only_first <= tolerance and (mine - whole).abs().max() > tolerance,
         f"only replica 0's gradient reaches the model: at step 1 the gradient equals that of its "
         f"{rows} rows alone (max |dg| {only_first:.1e}), {ratio:.2f} times the whole batch's; the "
         f"replicas' parameters must be differentiable copies, p.clone(), not detached "
         f"({where('name: p.clone() for name, p in module.named_parameters()')})"),
        (replicas > 1 and scaled <= tolerance,
         f"the replicas' gradients are averaged, not summed: at step 1 the gradient is {ratio:.2f} "
         f"times the whole batch's (1/{replicas}, max |dg| {scaled:.1e} from it); the mean loss "
         f"over the whole batch already averages, and backward sums the replicas' parts "
         f"({where('SUMMED into the module')})"),
        (abs(ratio - replicas) < 0.01 * replicas and replicas > 1,
         f"the gradient is {ratio:.2f} times the whole batch's ({replicas} replicas): each replica's "
         f"loss is a mean over its chunk and the replicas' gradients add up; one loss, on the "
         f"gathered output ({where('ONE loss, on the gathered output')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
