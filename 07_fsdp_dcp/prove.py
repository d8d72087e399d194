"""The lab of lesson 07: runs fsdp_dcp.py and proves its two claims.

    python 07_fsdp_dcp/prove.py                                # 2 ranks, then resumed on 1 and 3
    python 07_fsdp_dcp/prove.py --world-size 3 --resume-on 2 4
    python 07_fsdp_dcp/prove.py --break skip-step              # one rank skips a step: FAILS
    python 07_fsdp_dcp/prove.py --break model-only-checkpoint  # momentum not restored: FAILS
    python 07_fsdp_dcp/prove.py --crash-rank 1                 # rank 1 raises at step 2: stops
    python 07_fsdp_dcp/prove.py --out-dir ckpt_lab07           # keep the checkpoints to look at

Claim 1: FSDP2 on N ranks ends with the weights of DDP (lesson 02's worker, in the same ranks)
and of one process (lesson 00) trained on the same global batches, within float32 rounding.
Claim 2: the checkpoint that N ranks saved before the last epoch loads on other numbers of ranks
with every parameter and momentum value exactly as saved, and the resumed run ends where one
process trained on the same batches ends.
"""
import argparse
import contextlib
import functools
import importlib.util
import inspect
import io
import os
import shutil
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: E402
                                                     get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict)
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("fsdp_dcp", needs=(  # or the file given with --lesson PATH
    "load_checkpoint", "make_dataset", "make_model", "save_checkpoint", "train", "worker"))

# FSDP2, DDP and one process add the same numbers in other orders (float32): measured up to
# ~5e-08 here; a missed step or a lost momentum buffer shows at 1e-3 and more.
TOLERANCE = 1e-5
BREAKS = {
    "skip-step": "the last rank skips its 2nd optimizer step: its shard of every parameter "
                 "misses one update",
    "model-only-checkpoint": "the resumed ranks load the model only, as from a checkpoint of "
                             "model.state_dict(): SGD's momentum restarts from zero",
}


def load_lesson(folder, name):
    """Lesson 00 (the one-process reference) or lesson 02 (DDP), by path."""
    path = os.path.join(os.path.dirname(HERE), folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


single = load_lesson("00_single_process", "single_process")
ddp = load_lesson("02_ddp_spawn", "ddp_spawn")


def full_state(model, optimizer):
    """Every parameter and momentum buffer, whole (all-gathered: EVERY rank calls it); rank 0
    gets them, on the CPU, the other ranks get empty dicts."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = dict(get_model_state_dict(model, options=options))
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    state.update({f"{k}.momentum": v["momentum_buffer"] for k, v in optim.get("state", {}).items()})
    return {k: v.clone() for k, v in state.items()}  # on 1 rank they ARE the live tensors


def keep_full_state(function, kept, label):
    """Wraps a lesson function that takes (model, optimizer): after it returns, keeps the full
    state under `label` (its {epoch}, say, filled in from the call's arguments)."""
    @functools.wraps(function)  # inspect.signature(wrapper) is the lesson function's
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        arguments = inspect.signature(function).bind(*args, **kwargs).arguments
        kept[label.format(**arguments)] = full_state(arguments["model"], arguments["optimizer"])
        return result
    return wrapper


def reshard_trade(device):
    """What `reshard_after_forward` trades, on the lesson's model and first batch in these ranks:
    all-gathers in one forward + backward, and what layer 0 holds between the two."""
    # what FSDP2 calls: dist.all_gather_single in torch 2.15, dist.all_gather_into_tensor in 2.11
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    found, all_gather = {}, getattr(dist, name)
    for reshard in (True, False):
        calls = []
        model = lesson.make_model().to(device)
        mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:
            lesson.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        x, y = next(iter(DataLoader(lesson.make_dataset(), batch_size=16)))
        setattr(dist, name, lambda *args, **kwargs: calls.append(1) or all_gather(*args, **kwargs))
        try:
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            held = model[0].weight  # between forward and backward
            shape = (held.to_local() if isinstance(held, DTensor) else held).shape
            loss.backward()
        finally:
            setattr(dist, name, all_gather)
        found[reshard] = (len(calls), "x".join(map(str, shape)))
    return found


LESSON = "07_fsdp_dcp/fsdp_dcp.py"


class KnownMistake(RuntimeError):
    """A mistake the lab measured before training (the same on every rank): the lab_worker keeps
    its cause, and the lab ends with PROOF FAILED and that LIKELY CAUSE line."""


def checking_the_optimizer(train):
    """Wraps the lesson's train, for two mistakes that train equal and say nothing. An optimizer
    made before fully_shard holds the old tensors, which fully_shard replaced with DTensors; it
    would step nothing the model uses, and DCP fails later with a bare KeyError. fully_shard on the
    root only makes the model one unit, whole on every rank from forward through backward: the
    memory FSDP is for is never saved. Each said here in one line instead."""
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        arguments = inspect.signature(train).bind(*args, **kwargs).arguments
        held = {id(p) for group in arguments["optimizer"].param_groups for p in group["params"]}
        params = {id(p) for p in arguments["model"].parameters()}
        if held != params:
            raise KnownMistake(
                f"the optimizer does not hold the model's parameters: it was made before "
                f"fully_shard, which replaces them (it holds {len(held & params)} of the model's "
                f"{len(params)}); make it after fully_shard "
                f"({course.lesson_line(LESSON, 'optimizer = torch.optim.SGD')})")
        unsharded = [name for name, m in arguments["model"].named_children()
                     if any(True for _ in m.parameters()) and not isinstance(m, FSDPModule)]
        if unsharded:
            raise KnownMistake(
                f"layer(s) {', '.join(unsharded)} are not fully_shard units of their own: they "
                f"stay whole on every rank through forward and backward, as with fully_shard on "
                f"the root only; shard each layer, then the root "
                f"({course.lesson_line(LESSON, 'fully_shard(layer, mesh=mesh)')})")
        return train(*args, **kwargs)
    return wrapper


def counting_steps(train, kept):
    """Wraps the lesson's train: counts this rank's optimizer steps (a global post-step hook) and,
    once it returns (the group still up), keeps every rank's count under "steps"."""
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        count = [0]
        handle = register_optimizer_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        try:
            losses = train(*args, **kwargs)
        finally:
            handle.remove()
        kept["steps"] = [None] * dist.get_world_size()
        dist.all_gather_object(kept["steps"], count[0])
        return losses
    return wrapper


def then_measure_resharding(train, kept):
    """Wraps the lesson's train: once it returns (the group still up), runs reshard_trade."""
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        losses = train(*args, **kwargs)
        arguments = inspect.signature(train).bind(*args, **kwargs).arguments
        kept["reshard"] = reshard_trade(arguments["device"])
        return losses
    return wrapper


def train_skipping_a_step(train, skipped=2):
    """--break skip-step: the lesson's train, with this rank's `skipped`-th optimizer step left out."""
    @functools.wraps(train)
    def wrapper(model, loader, optimizer, *rest):
        step, count = optimizer.step, [0]

        def step_or_skip(*args, **kwargs):
            count[0] += 1
            return None if count[0] == skipped else step(*args, **kwargs)
        optimizer.step = step_or_skip
        return train(model, loader, optimizer, *rest)
    return wrapper


def load_model_only(path, model, optimizer):
    """--break model-only-checkpoint: what a checkpoint of the weights alone gives back."""
    state = {"model": get_model_state_dict(model), "epoch": 0}
    lesson.dcp.load(state, checkpoint_id=path)  # a subset of the saved keys is fine for DCP
    set_model_state_dict(model, state["model"])
    return state["epoch"]


def lab_worker(index, jobs, backend, epochs, batch_size, lr, out_dir, broken, crash_rank, timeout):
    """Process `index` runs jobs[index]: one rank of one run of the lesson's worker, unchanged
    but for --break; rank 0 of each run saves what the wrappers kept to <run>.pt."""
    job = jobs[index]
    os.chdir(out_dir)  # the lesson prints its checkpoint paths relative to the lab's folder
    kept = {}
    if broken == "skip-step" and job["resume"] is None and job["rank"] == job["world_size"] - 1:
        lesson.train = train_skipping_a_step(lesson.train)
    if broken == "model-only-checkpoint" and job["resume"]:
        lesson.load_checkpoint = load_model_only
    lesson.train = keep_full_state(counting_steps(checking_the_optimizer(lesson.train), kept),
                                   kept, "trained")
    if job["ddp_port"]:
        lesson.train = then_measure_resharding(lesson.train, kept)
    lesson.save_checkpoint = keep_full_state(lesson.save_checkpoint, kept, "saved at {epoch}")
    lesson.load_checkpoint = keep_full_state(lesson.load_checkpoint, kept, "loaded")
    if job["rank"] == crash_rank and job["resume"] is None:
        course.crash_at_step(job["rank"], 2)
    quiet = contextlib.redirect_stdout(io.StringIO())  # runs side by side would mix their lines
    try:
        with quiet if job["resume"] else contextlib.nullcontext():
            lesson.worker(job["rank"], job["world_size"], job["port"], backend, epochs,
                          batch_size, lr, job["folder"], job["resume"], timeout)
        if job["ddp_port"]:  # lesson 02's worker, in the same ranks, on the same batches
            with quiet:
                model, _ = ddp.worker(job["rank"], job["world_size"], job["ddp_port"], backend,
                                      epochs, batch_size, lr, timeout)
            kept["ddp"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    except KnownMistake as mistake:  # every rank measured it, before any collective of train
        kept = {"mistake": str(mistake)}
    except BaseException:  # print this rank's own error first: the spawner may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    if job["rank"] == 0:
        torch.save(kept, f"{job['folder']}.pt")


class GlobalBatches:
    """A batch_sampler for lesson 00: at every step, the union of what the ranks' samplers give;
    epoch e has world_sizes[e] ranks (a resumed run may have another number of ranks)."""

    def __init__(self, dataset, world_sizes, batch_size):
        self.dataset, self.world_sizes, self.batch_size, self.epoch = dataset, world_sizes, batch_size, 0

    def __iter__(self):
        n = self.world_sizes[self.epoch]
        samplers = [DistributedSampler(self.dataset, n, r, seed=0) for r in range(n)]
        for sampler in samplers:
            sampler.set_epoch(self.epoch)
        orders, self.epoch = [list(s) for s in samplers], self.epoch + 1
        for start in range(0, len(orders[0]), self.batch_size):
            yield [i for order in orders for i in order[start:start + self.batch_size]]


def train_reference(world_sizes, batch_size, lr):
    """Lesson 00's loop, one process, epoch e on the global batches of world_sizes[e] ranks."""
    dataset = single.make_dataset()
    loader = DataLoader(dataset, batch_sampler=GlobalBatches(dataset, world_sizes, batch_size))
    model = single.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    with contextlib.redirect_stdout(io.StringIO()):  # its epoch lines would repeat the lesson's
        single.train(model, loader, optimizer, len(world_sizes), torch.device("cpu"))
    return {k: v.detach() for k, v in model.state_dict().items()}


def weights(state):
    return {k: v for k, v in state.items() if not k.endswith(".momentum")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'fsdp_dcp')
    p.add_argument("--world-size", type=int, default=2, help="ranks that train and save (default 2)")
    p.add_argument("--resume-on", type=int, nargs="+", default=[1, 3], metavar="N",
                   help="world sizes that load the checkpoint and train the last epoch (default 1 3)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data, at least 2: the last "
                   "one is trained again from the checkpoint of the one before (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step per rank (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank of the first run raises at step 2: the "
                   "whole run must stop within seconds with that rank's own error")
    course.add_timeout_flag(p)
    p.add_argument("--out-dir", help="an empty or new folder to keep the checkpoints in (default: a "
                   "temporary folder, removed)")
    args = p.parse_args(argv)
    if min(args.world_size, args.batch_size, *args.resume_on) < 1 or args.lr <= 0 or args.timeout <= 0:
        course.refuse("--world-size, --resume-on, --batch-size, --lr and --timeout must be positive")
    if len(set(args.resume_on)) < len(args.resume_on):
        course.refuse("--resume-on: name each world size once")
    if args.epochs < 2:
        course.refuse("--epochs must be 2 or more: the last epoch is resumed from the one before")
    if args.out_dir and os.path.exists(args.out_dir) and (not os.path.isdir(args.out_dir)
                                                          or os.listdir(args.out_dir)):
        course.refuse(f"--out-dir {args.out_dir} is not an empty folder: the lesson would resume "
                      "from what is in it")
    course.refuse_bad_crash_rank(args.crash_rank, args.world_size)
    return args


def checkpoint_files(path):
    return ", ".join(f"{name} ({os.path.getsize(os.path.join(path, name))} B)"
                     for name in sorted(os.listdir(path)))


def main(argv=None):
    args = parse_args(argv)
    n, last = args.world_size, args.epochs - 1
    backend, device, reason = course.backend_for(max(n, *args.resume_on), args.device)
    print(f"backend: {backend} ({reason}); world size {n}; global batch {n} x {args.batch_size} = "
          f"{n * args.batch_size}; then the checkpoint of epoch {last} resumed on "
          + " and ".join(map(str, args.resume_on)) + " rank(s)"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    with contextlib.ExitStack() as stack:
        out_dir = args.out_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="prove07_"))
        os.makedirs(out_dir, exist_ok=True)
        common = (backend, args.epochs, args.batch_size, args.lr, out_dir, args.broken,
                  args.crash_rank, args.timeout)
        start = time.perf_counter()
        port, ddp_port = course.find_free_port(), course.find_free_port()
        jobs = [dict(rank=r, world_size=n, port=port, folder="fsdp", resume=None, ddp_port=ddp_port)
                for r in range(n)]
        course.spawn_or_fail(lab_worker, (jobs, *common), n)
        first = time.perf_counter() - start
        mistake = torch.load(os.path.join(out_dir, "fsdp.pt"), weights_only=True).get("mistake")
        if mistake:  # measured before training: nothing to compare, the cause is known
            course.report_proof(False, f"FSDP2 on {n} ranks was not trained: the lab found a "
                                "mistake before the first step", "0 steps", "none")
            course.report_cause(mistake)
            return 1
        name = f"epoch{last:04d}"
        saved, jobs = os.path.join("fsdp", name), []
        for m in args.resume_on:  # each run its own copy of the checkpoint, its own port
            shutil.copytree(os.path.join(out_dir, saved), os.path.join(out_dir, f"on{m}", name))
            port = course.find_free_port()
            jobs += [dict(rank=r, world_size=m, port=port, folder=f"on{m}",
                          resume=os.path.join(f"on{m}", name), ddp_port=None) for r in range(m)]
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (jobs, *common), len(jobs))
        second = time.perf_counter() - start
        files = checkpoint_files(os.path.join(out_dir, saved))
        runs = {run: torch.load(os.path.join(out_dir, f"{run}.pt"), map_location="cpu",
                                weights_only=True)
                for run in ["fsdp"] + [f"on{m}" for m in args.resume_on]}
    fsdp = runs["fsdp"]
    reference = train_reference([n] * args.epochs, args.batch_size, args.lr)
    vs_ddp = course.max_abs_diff(weights(fsdp["trained"]), fsdp["ddp"])
    vs_single = course.max_abs_diff(weights(fsdp["trained"]), reference)
    print(f"training took {first:.1f} s ({n} ranks, FSDP2 then DDP) + {second:.1f} s (resumed "
          f"runs, side by side) on {course.hardware()}")
    print(f"FSDP2 on {n} ranks against DDP: max |dw| {vs_ddp:.1e}; against one process: "
          f"{vs_single:.1e}")
    (gathers, shard), (gathers_kept, whole) = fsdp["reshard"][True], fsdp["reshard"][False]
    print(f"reshard_after_forward=True: {gathers} all-gathers in a forward and backward, layer 0 "
          f"holds its {shard} shard in between; False: {gathers_kept}, it holds all {whole}")
    print(f"{saved} holds {files}")
    worst_load, worst_resumed = 0.0, 0.0
    for m in args.resume_on:
        run = runs[f"on{m}"]
        load = course.max_abs_diff(run["loaded"], fsdp[f"saved at {last}"])
        resumed = course.max_abs_diff(weights(run["trained"]), train_reference(
            [n] * last + [m], args.batch_size, args.lr))
        worst_load, worst_resumed = max(worst_load, load), max(worst_resumed, resumed)
        print(f"loaded on {m} rank(s): weights and momentum against the saved ones: max |d| "
              f"{load:.1e}; after epoch {last}, against one process on the same batches: "
              f"max |dw| {resumed:.1e}")
    trains_alike = max(vs_ddp, vs_single) <= TOLERANCE
    loads_exactly, resumes_alike = worst_load == 0.0, worst_resumed <= TOLERANCE
    sizes = " and ".join(map(str, args.resume_on))
    code = course.report_proof(
        trains_alike and loads_exactly and resumes_alike,
        f"FSDP2 on {n} ranks {'equals' if trains_alike else 'does NOT equal'} DDP and one process, "
        f"and its checkpoint {'loads' if loads_exactly else 'does NOT load'} exactly on {sizes} "
        f"rank(s) and {'continues' if resumes_alike else 'does NOT continue'} as one process would",
        f"max |dw| against DDP {vs_ddp:.1e}, against one process {vs_single:.1e}, after loading "
        f"{worst_load:.1e}, resumed {worst_resumed:.1e}", f"{TOLERANCE:.0e}")
    if code:
        likely_cause(runs, n, last, args.resume_on)
    return code


def shard_owners(trained, reference, n):
    """The ranks whose FSDP2 shards (rows of dim 0, torch.chunk's split) hold a value more than
    TOLERANCE from the reference, and the first parameter that does."""
    owners, first = set(), None
    for name, value in trained.items():
        bad = ((value.double() - reference[name].double()).abs() > TOLERANCE)
        rows = bad.reshape(len(bad), -1).any(dim=1).nonzero().flatten().tolist() if bad.dim() \
            else ([0] if bad else [])
        if rows:
            first = first or name
            owners |= {row // -(-len(value) // n) for row in rows}
    return sorted(owners), first


def likely_cause(runs, n, last, resume_on):
    """The last line of a failure: which typical mistake the measurements fit (never read from
    the learner's source), or what was measured."""
    fsdp = runs["fsdp"]
    owners, first = shard_owners(weights(fsdp["trained"]), fsdp["ddp"], n)
    saved = fsdp[f"saved at {last}"]
    momentum = [k for k in saved if k.endswith(".momentum")]
    load_w = max(course.max_abs_diff(weights(runs[f"on{m}"]["loaded"]), weights(saved))
                 for m in resume_on)
    loaded_m = [runs[f"on{m}"]["loaded"].get(k, torch.zeros(())) for m in resume_on for k in momentum]
    zero_m = bool(momentum) and all(not t.any() for t in loaded_m)
    saved_m = max((saved[k].abs().max().item() for k in momentum), default=0.0)
    shards = ", ".join(map(str, owners))
    steps = fsdp.get("steps", [])
    fewest = [r for r, c in enumerate(steps) if c == min(steps)] if steps else []
    measured = (f"optimizer steps per rank {', '.join(map(str, steps))}; against DDP, {'the shards of rank(s) ' + shards + ' differ, first in ' + first if first else 'every shard is equal'}; "
                f"loaded weights max |d| {load_w:.1e}; loaded momentum "
                f"{'all zero' if zero_m else 'not zero'}")
    course.diagnose([
        (len(set(steps)) > 1,
         f"a rank skipped an optimizer step: rank(s) {', '.join(map(str, fewest))} ran "
         f"{min(steps)} optimizer steps, the others {max(steps)}, so their shards missed an "
         f"update (against DDP, first in {first}); every rank must run every optimizer.step() "
         f"({course.lesson_line(LESSON, 'optimizer.step()')})"),
        (not first and load_w == 0.0 and zero_m and saved_m > 0,
         f"the checkpoint holds the model only: the weights load exactly, but every momentum "
         f"buffer comes back 0 (saved: up to {saved_m:.1e}); save and load the optimizer's state "
         f"with the model's ({course.lesson_line(LESSON, 'get_state_dict(model, optimizer)')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
