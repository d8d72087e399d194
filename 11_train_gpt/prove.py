"""The lab of lesson 11: the capstone's parts proved together, on the lesson's GPT and real text.

    python 11_train_gpt/prove.py                       # the proof
    python 11_train_gpt/prove.py --break NAME          # each break fails the claim it names

The claims, each against the lesson's own main() run unchanged (the lab only wraps its functions):
1. 2 ranks (DDP, and FSDP) equal one process on the 2-times batch; K=2 micro-batches too; in
   float64, where float32's rounding would hide a small bug.
2. A rank SIGKILLed under torchrun resumes bit-identical to an uninterrupted run: DDP, then FSDP,
   with dropout, 2 micro-batches, and an evaluation between the checkpoint and the kill.
3. An FSDP checkpoint saved on 2 ranks resumes on 1 and on 3 and ends as the 2-rank run does.
4. Evaluation counts every validation token once, at 1, 2 and 3 ranks, DDP and FSDP.
5. TensorBoard's steps run 1, 2, ... once each across the restart.
6. bf16 (DDP: autocast; FSDP: a mixed-precision policy) stays within 5e-2 of fp32.
7. --tp 2 on 4 ranks (FSDP over 2 copies of the model, each split over 2 ranks) equals one process,
   in float64, and its checkpoint resumes on 1 rank without tensor parallelism; with dropout, a
   copy's ranks keep the weights they both hold whole equal.
"""
import argparse
import hashlib
import inspect
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from contextlib import redirect_stdout
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.data import (ConcatDataset, DataLoader, Dataset, Subset,  # noqa: E402
                              default_collate)

import course  # noqa: E402

lesson = None  # the lesson's module: train_gpt.py, or the file given with --lesson


def use_lesson(path):
    """Imports the training script at `path` as `lesson`, with the model.py and checkpoint.py of
    ITS folder: the lab proves your copy as it proves the course's."""
    global lesson
    if lesson is not None and os.path.abspath(lesson.__file__) == os.path.abspath(path):
        return  # already imported (a forked rank inherits the parent's import)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    for sibling in ("model", "checkpoint"):
        sys.modules.pop(sibling, None)
    lesson = course.load_lesson_file(
        path, os.path.splitext(os.path.basename(path))[0], NEEDS, "train_gpt.py", register=False,
        hint=lambda error: " (keep it beside model.py and checkpoint.py)" if isinstance(
            error, ModuleNotFoundError) and error.name in ("model", "checkpoint") else "")
    ORIGINAL["train_step"] = lesson.train_step


ORIGINAL = {}
LESSON = os.path.join(HERE, "train_gpt.py")
NEEDS = ("main", "init_distributed", "make_dataset", "make_model", "step_windows", "micro_batches",
         "train_step", "evaluate", "wrap", "sample")  # what the lab calls, and main's parts

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEPS, GLOBAL = 4, 24  # claims 1, 3, 6: 4 steps of 24 windows (2 x 12, 3 x 8, 1 x 24)
FLOAT64_TOL, BF16_AT_LEAST, BF16_TOL = 1e-10, 1e-4, 5e-2  # bf16: really on, and close
EVAL_TOL = 1e-8  # claim 4: the mean loss of runs within 1e-10 of one process (relative)
CLAIM = {1: "DDP and FSDP equal one process", 2: "a SIGKILLed rank resumes bit-exact",
         3: "FSDP resumes on 1 and 3 ranks", 4: "evaluation counts every token once",
         5: "TensorBoard logs each step once", 6: "bf16 is on and stays close",
         7: "FSDP x TP equals one process"}
RESTART = dict(steps=6, every=3, dropout=0.1, accumulate=2, batch_size=6)  # claim 2: kill at 5
BREAKS = {
    "loss-not-divided": "train_step backpropagates each micro-batch's loss, not loss / K (claim 1)",
    "no-rng-restore": "resumed ranks do not restore their RNG states: dropout draws other masks "
                      "(claim 2)",
    "rank-seeded-data": "each rank shuffles with seed + rank, as a sampler seeded per rank does: "
                        "the ranks' windows overlap and miss some (claims 1 and 3)",
    "padded-evaluation": "evaluation pads every rank to the same number of windows, as "
                         "DistributedSampler does: some tokens count twice (claim 4)",
    "no-purge": "TensorBoard's writer forgets purge_step: a restart logs its steps again (claim 5)",
    "autocast-on-cuda": "autocast names the cuda device on a CPU run: torch warns and runs fp32 "
                        "(claim 6)",
    "no-tensor-parallel": "--tp: the model's tensor_parallel() does nothing: each rank of a copy "
                          "holds and computes it whole, equal to one process and split over "
                          "nothing (claim 7)",
    "dropout-by-global-rank": "--tp: each rank seeds dropout with its global rank, as under DDP: a "
                              "copy's ranks drop different activations, and the weights they both "
                              "hold whole drift apart (claim 7)",
    "data-by-global-rank": "--tp: each rank reads the windows of its global rank, as under DDP, "
                           "not those of its model's copy: a copy's ranks split different batches "
                           "(claim 7)",
}


# ------------------------------------------------------------------------ inside every rank
def install(broken, float64, accumulate, kept):
    """Wraps the lesson's functions (its code unchanged) for one run: float64 weights, the break,
    and what the lab measures into `kept`: the full final weights, each evaluation's value and
    count, each step's gradient norm, the reductions of each micro-batch, the windows each rank
    reads, RNG states at each save and after a load, the files each save creates and the renames
    that made them, and torch's warnings. Returns the function that undoes it all."""
    saved = {name: getattr(lesson, name) for name in ("make_model", "evaluate", "sample",
             "micro_batches", "SummaryWriter", "torch", "train_step", "make_dataset", "wrap")}
    saved_rng, saved_fn = torch.set_rng_state, {n: getattr(F, n) for n in LOSSES}
    dtype = torch.float64 if float64 else torch.float32
    lesson.make_model = lambda *a, **k: watch_evaluation(without_tp(
        saved["make_model"](*a, **k).to(dtype), broken), kept)
    lesson.make_dataset = lambda *a, **k: in_dtype(saved["make_dataset"](*a, **k), dtype)

    def counting_evaluate(model, dataset, batch_size, device, autocast, group=None):
        if broken == "padded-evaluation":  # DistributedSampler's padding: equal shares, repeats
            extra = -len(dataset) % lesson.dist.get_world_size(group)
            dataset = ConcatDataset([dataset, Subset(dataset, range(extra))])
        kept["forwards"] = 0  # this rank's forwards in this evaluation
        result = saved["evaluate"](model, dataset, batch_size, device, autocast, group)
        kept.setdefault("counted", []).append(int(result[1]))  # (loss, count, anything else)
        kept.setdefault("evaluated", []).append((float(result[0]), kept["forwards"]))
        return result

    def save_and_capture(folder, model, optimizer, scheduler, step, config, *args):
        kept.setdefault("rng_at_save", {})[step] = rng_digest()
        before, renamed = set(os.listdir(folder)) if os.path.isdir(folder) else set(), []
        moves = {"replace": os.replace, "rename": os.rename}
        for name, move in moves.items():  # what the save renames: a .tmp made whole, or nothing
            setattr(os, name, lambda a, b, *r, move=move, **k: (renamed.append(os.path.abspath(
                b)) if os.path.abspath(a) != os.path.abspath(b) else None, move(a, b, *r, **k))[1])
        try:
            path = saved_save(folder, model, optimizer, scheduler, step, config, *args)
        finally:
            os.replace, os.rename = moves["replace"], moves["rename"]
        new = sorted(set(os.listdir(folder)) - before)
        kept.setdefault("saves", []).append((step, new, [n for n in new if os.path.join(
            os.path.abspath(folder), n) in renamed]))
        if step == config["steps"]:  # every rank: the full weights need the ranks' shards
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
            kept["state"] = {k: v.detach().clone() for k, v in state.items()}
            kept["split"] = [name for name, p in model.named_parameters() if split_over_tp(p)]
            kept["tensors"] = len(list(model.parameters()))
            if kept.get("tp", 1) > 1:  # what a copy's ranks both hold whole must stay equal
                kept["copies_apart"] = copies_apart(model, kept["split"], kept["tp"])
            kept["ranks"] = [None] * lesson.dist.get_world_size()  # each rank's windows and RNG
            lesson.dist.all_gather_object(kept["ranks"], {"read": kept.get("read", []),
                                                          "rng": rng_digest()})
        return path
    saved_save, saved_load = lesson.checkpoint.save, lesson.checkpoint.load

    def load_and_measure(*args, **kwargs):
        step = saved_load(*args, **kwargs)
        kept["rng_after_load"] = (int(step), rng_digest())
        return step
    lesson.checkpoint.save, lesson.checkpoint.load = save_and_capture, load_and_measure
    lesson.evaluate = counting_evaluate
    lesson.sample = lambda model: saved["sample"](model, new_tokens=8)  # faster, same code

    def timed_step(*args, **kwargs):  # --scaling: each step's seconds, and steps 3-5 profiled
        start, number = time.perf_counter(), len(kept.setdefault("seconds", [])) + 1
        if broken == "dropout-by-global-rank" and number == 1:  # as seed + 1 + rank in main()
            torch.manual_seed(kept.get("seed", 0) + 1 + lesson.dist.get_rank())
        if kept.get("profile") and number == 3:
            kept["profiler"] = torch.profiler.profile(activities=[
                torch.profiler.ProfilerActivity.CPU])
            kept["profiler"].start()
        kept["micro"], kept["reductions"] = [], [0]  # reductions so far, at each forward
        result = saved["train_step"](*args, **kwargs)
        kept["seconds"].append(time.perf_counter() - start)
        micro = kept.pop("micro") + [kept["reductions"][0]]
        kept.setdefault("syncs", []).append([b - a for a, b in zip(micro, micro[1:])])
        norm = result[1] if isinstance(result, (tuple, list)) and len(result) > 1 else None
        kept.setdefault("norms", []).append(float(norm) if norm is not None else None)
        if kept.get("profiler") and number == 5:
            kept["profiler"].stop()
            kept.pop("profiler").export_chrome_trace(kept["profile"])
        return result
    lesson.train_step = timed_step

    def reading_micro_batches(*args, **kwargs):  # the windows this rank's loader draws
        loader = inner(*args, **kwargs)
        sampler = getattr(loader, "sampler", None)
        kept.setdefault("read", []).append(list(sampler) if sampler is not None else None)
        return loader

    def counting_wrap(*args, **kwargs):  # each reduction of the gradients (lab 09's count)
        model = saved["wrap"](*args, **kwargs)
        count_reductions(model, kept)
        return model
    lesson.wrap = counting_wrap
    if broken == "loss-not-divided":  # the loss K times larger: loss / K is the undivided loss
        for name in LOSSES:  # torch's own functions, patched: every name of F stays
            setattr(F, name, lambda *a, fn=saved_fn[name], **k: fn(*a, **k) * (
                accumulate if k.get("reduction", "mean") == "mean" else 1))
    if broken == "no-rng-restore":
        torch.set_rng_state = lambda *a, **k: None
    if broken == "rank-seeded-data":
        lesson.micro_batches = rank_seeded_micro_batches
    if broken == "data-by-global-rank":  # the lesson's rank and world size of the data ignored
        lesson.micro_batches = lambda dataset, step, rank, world_size, *rest: saved[
            "micro_batches"](dataset, step, lesson.dist.get_rank(), lesson.dist.get_world_size(),
                             *rest)
    inner, lesson.micro_batches = lesson.micro_batches, reading_micro_batches
    if broken == "no-purge":
        lesson.SummaryWriter = lambda log_dir, purge_step=None: saved["SummaryWriter"](log_dir)
    if broken == "autocast-on-cuda":
        lesson.torch = SimpleNamespace(**{**vars(torch), "autocast": lambda device_type, dtype:
                                          torch.autocast("cuda", dtype=dtype)})
    shown = warnings.showwarning

    def record_warning(message, *args, **kwargs):  # torch's warnings: measurements too
        kept.setdefault("warnings", []).append(str(message).splitlines()[0][:300])
        return shown(message, *args, **kwargs)
    warnings.showwarning = record_warning

    def undo():
        for name, value in saved.items():
            setattr(lesson, name, value)
        for name, value in saved_fn.items():
            setattr(F, name, value)
        torch.set_rng_state, lesson.checkpoint.save = saved_rng, saved_save
        lesson.checkpoint.load, warnings.showwarning = saved_load, shown
        for name in ("reductions", "micro", "forwards"):
            kept.pop(name, None)
    return undo


LOSSES = ("cross_entropy", "mse_loss", "l1_loss", "nll_loss", "binary_cross_entropy_with_logits")


def rng_digest():
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def count_reductions(model, kept):
    """Counts the gradient reductions: DDP's all-reduces (a comm hook, as lab 09's), FSDP's
    reduce-scatters (the hook FSDP calls after each); each training forward notes the count."""
    if hasattr(model, "register_comm_hook"):
        def all_reduce(state, bucket):
            kept["reductions"][0] += 1
            return allreduce_hook(state, bucket)
        model.register_comm_hook(None, all_reduce)
    else:
        for module in model.modules():  # FSDP calls it after each reduce-scatter
            if hasattr(module, "set_all_reduce_hook"):
                module.set_all_reduce_hook(lambda output: kept["reductions"].__setitem__(
                    0, kept["reductions"][0] + 1))

    def before_forward(module, args):
        if module.training and "micro" in kept:
            kept["micro"].append(kept["reductions"][0])
    model.register_forward_pre_hook(before_forward)


def watch_evaluation(model, kept):
    """Counts the model's forwards in evaluation (eval mode): a mean per forward, summed, would
    be the loss times the forwards per target."""
    def before_forward(module, args):
        if not module.training and "forwards" in kept:
            kept["forwards"] += 1
    model.register_forward_pre_hook(before_forward)
    return model


def split_over_tp(parameter):
    """Whether a parameter is a DTensor sharded along its mesh's dimension named "tp"."""
    names = getattr(getattr(parameter, "device_mesh", None), "mesh_dim_names", None) or ()
    return any(name == "tp" and placement.is_shard()
               for name, placement in zip(names, getattr(parameter, "placements", ())))


def copies_apart(model, split, tp):
    """EVERY rank calls it. The largest difference between a copy's ranks (rank = dp_rank x tp +
    tp_rank) in the parameters not split over tp: 0.0 unless their dropout masks differed."""
    mine = {name: p.to_local().detach().cpu() if hasattr(p, "to_local") else p.detach().cpu()
            for name, p in model.named_parameters() if name not in split}
    everyone = [None] * lesson.dist.get_world_size()
    lesson.dist.all_gather_object(everyone, mine)
    return max(course.max_abs_diff(everyone[r], everyone[r - r % tp]) for r in range(len(everyone)))


def without_tp(model, broken):
    """--break no-tensor-parallel: the model's plan does nothing; each rank holds whole blocks."""
    if broken == "no-tensor-parallel":
        model.tensor_parallel = lambda tp_mesh: None
    return model


class InDtype(Dataset):
    """A dataset whose float inputs come in the lab's dtype, for a model the lab cast to it."""

    def __init__(self, dataset, dtype):
        self.dataset, self.dtype = dataset, dtype

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        x, y = self.dataset[i]
        return x.to(self.dtype), y


def in_dtype(sets, dtype):
    """make_dataset's (train, validation, name), float inputs in `dtype`; token ids unchanged."""
    x = sets[0][0][0]
    if not (torch.is_tensor(x) and x.is_floating_point()):
        return sets
    return InDtype(sets[0], dtype), InDtype(sets[1], dtype), sets[2]


def rank_seeded_micro_batches(dataset, step, rank, world_size, accumulate, batch_size, seed):
    """--break rank-seeded-data: the lesson's stream, shuffled with seed + rank on each rank."""
    share = accumulate * batch_size
    windows = lesson.step_windows(len(dataset), step, world_size * share, seed + rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=windows[rank * share:][:share])


def run_jobs(rank, world_size, ports, jobs, broken, out_dir, path):
    """A rank the lab starts with torchrun's variables: main() once per job, in turn."""
    use_lesson(path)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
    torch.set_num_threads(1)
    for number, (name, job) in enumerate(jobs.items()):
        os.environ["MASTER_PORT"] = str(ports[number])  # each its own: a group's store outlives it
        run_one(name, job, broken, out_dir, rank)


def run_one(name, job, broken, out_dir, rank=0):
    job = dict(job)
    kept, float64 = {"tp": job.get("tp", 1), "seed": job.get("seed", 0)}, job.pop("float64", False)
    if job.pop("profile", False):
        kept["profile"] = os.path.join(out_dir, f"trace-rank{rank}.json")
    undo = install(broken, float64, job.get("accumulate", 1), kept)
    # --tp: the lesson's 2-D gradient norm, and the lab's gather of the weights, take 2
    # collectives, and torch says so on every rank
    quiet = course.quiet_logger("torch.distributed.tensor._redistribute")
    try:
        with open(os.path.join(out_dir, f"{name}.log"), "a") as log, redirect_stdout(log), quiet:
            lesson.main(**job)
    finally:
        undo()
    if rank == 0 and "state" in kept:  # a run resumed at its last step trains and saves nothing
        torch.save(kept, os.path.join(out_dir, f"{name}.pt"))


def torchrun_worker(settings):
    """Claim 2, one rank of one torchrun attempt: the uninterrupted DDP and FSDP runs (an attempt
    after the first finds them done), then the DDP run, then the FSDP run; rank 1 kills itself
    (SIGKILL) after step 5 of a run that started from step 0, once per run."""
    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    course.dump_stacks_on_signal(course.stacks_of(os.path.join(settings["out_dir"], "stacks"),
                                                  attempt), rank)  # a hang's report
    use_lesson(settings["lesson"])
    torch.set_num_threads(1)
    for parallel in ("ddp", "fsdp"):
        # several runs in one process: each needs its own key prefix on torchrun's store
        lesson.init_distributed = init_with_prefix(f"attempt{attempt}-u-{parallel}")
        run_one(f"{parallel}-uninterrupted", dict(RESTART, parallel=parallel, out_dir=os.path.join(
            settings["out_dir"], f"u-{parallel}")), settings["broken"], settings["out_dir"], rank)
    for parallel in ("ddp", "fsdp"):
        lesson.init_distributed = init_with_prefix(f"attempt{attempt}-{parallel}")
        out = os.path.join(settings["out_dir"], f"killed-{parallel}")
        marker, done = out + ".killed", [0]

        def kill_at_step_5(*args, **kwargs):
            result = ORIGINAL["train_step"](*args, **kwargs)
            done[0] += 1
            if rank == 1 and done[0] == 5 and not os.path.exists(marker):
                open(marker, "w").close()
                course.hard_kill(os.getpid())  # no exception, no finally: as the OOM killer
            return result
        lesson.train_step = kill_at_step_5
        job = dict(RESTART, parallel=parallel, out_dir=out)
        run_one(f"killed-{parallel}", job, settings["broken"], settings["out_dir"], rank)
        lesson.train_step = ORIGINAL["train_step"]


def init_with_prefix(prefix):
    """The lesson's init_distributed with another key prefix on torchrun's store."""
    def init_distributed(backend, device, timeout):
        timeout = lesson.datetime.timedelta(seconds=timeout)
        store, rank, world_size = next(lesson.dist.rendezvous("env://", timeout=timeout))
        lesson.dist.init_process_group(backend, store=lesson.dist.PrefixStore(prefix, store),
                                       rank=rank, world_size=world_size, timeout=timeout)
    return init_distributed


# ------------------------------------------------------------------------ the parent
def spawn(world_size, jobs, broken, out_dir):
    # One free port per job, from the OS (port + 1 was once taken by another process's connection:
    # EADDRINUSE in CI).
    course.spawn_or_fail(run_jobs, args=(world_size, course.find_free_ports(len(jobs)), jobs,
                                         broken, out_dir, lesson.__file__), nprocs=world_size)
    return {name: torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)
            for name in jobs}


def forget_world():
    """Removes torchrun's variables, which main() sets for a world of one: the next run in this
    process must not take them for torchrun's."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        os.environ.pop(key, None)


class Diagnosed(Exception):
    """A run that cannot go on, and why: (what failed, the LIKELY CAUSE line's text)."""


def in_this_process(name, job, broken, out_dir):
    """A world of one, here: what `python train_gpt.py` runs, with no torchrun variables set."""
    forget_world()
    try:
        run_one(name, job, broken, out_dir)
    except KeyError as error:  # a torchrun variable read, never set: no world of one
        if error.args and error.args[0] in WORLD_VARIABLES:
            what = f"KeyError: {error.args[0]!r}"
            line = course.lesson_line(LESSON_PATH, 'if "RANK" not in os.environ')
            raise Diagnosed(
                f"main() does not run under plain python, as a world of one ({what})",
                "no world-of-one set-up for plain python: main(), run with no torchrun variable "
                f"in the environment, raised {what} (so does `python your_file.py`); when RANK is "
                f"missing, set torchrun's variables for a world of one, as {line} does") from None
        raise
    finally:
        forget_world()
    return torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)


WORLD_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT")
LESSON_PATH = "11_train_gpt/train_gpt.py"
CHECKPOINT_PATH = "11_train_gpt/checkpoint.py"
SUMMED = 'reduction="sum")'  # the lesson's summed evaluation loss, for lesson_line


def gap(a, b):
    return course.max_abs_diff(a["state"], b["state"])


def scalar_steps(folder, tag="train/loss"):
    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # not its note on the purged steps
    events = EventAccumulator(folder)
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    course.add_break_flag(parser, BREAKS)
    parser.add_argument("--lesson", default=LESSON, help="the training script to prove, beside "
                        "its model.py and checkpoint.py (default: this folder's train_gpt.py)")
    parser.add_argument("--claims", type=int, nargs="+", choices=range(1, 8), metavar="N",
                        help="prove only these claims (default: all seven)")
    parser.add_argument("--scaling", type=int, metavar="STEPS", help="instead of the proof: "
                        "tokens/s per rank on 1 and on 2 ranks (16 windows each), STEPS steps")
    parser.add_argument("--out-dir", help="keep every file here (default: a temporary folder)")
    parser.add_argument("--as-torchrun-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_torchrun_worker:
        return torchrun_worker(json.loads(args.as_torchrun_worker))
    if not os.path.isfile(args.lesson):
        course.refuse(f"--lesson {args.lesson}: no such file")
    if args.broken and args.claims:
        course.refuse("--break proves the claims it breaks: leave out --claims")
    if args.scaling is not None and (args.scaling < 5 or args.broken or args.claims):
        course.refuse("--scaling STEPS measures, alone: 5 steps or more, no --break or --claims")
    if os.path.abspath(args.lesson) != os.path.abspath(LESSON):  # a learner's file: its errors
        os.environ["COURSE_LESSON"] = os.path.abspath(args.lesson)  # are one line (run_lab)
    use_lesson(args.lesson)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="lab11-")
    os.makedirs(out_dir, exist_ok=True)
    if os.listdir(out_dir):
        course.refuse(f"--out-dir {out_dir} is not empty")
    facts = model_facts()
    if args.broken and CLAIMS_OF[args.broken] == {7} and not facts["tp"]:
        course.refuse(f"--break {args.broken} breaks claim 7, and the model has no "
                      "tensor_parallel(): claim 7 is skipped")
    try:
        if args.scaling:
            return scaling(args.scaling, out_dir)
        return prove(args.broken, out_dir, set(args.claims or CLAIMS_OF.get(args.broken, CLAIM)),
                     facts)
    except Diagnosed as failure:
        course.report_proof(False, failure.args[0], "no claim measured", "none")
        course.report_cause(failure.args[1])
        return 1
    finally:
        if not args.out_dir:
            shutil.rmtree(out_dir, ignore_errors=True)


CLAIMS_OF = {"loss-not-divided": {1}, "no-rng-restore": {2}, "rank-seeded-data": {1, 3},
             "padded-evaluation": {4}, "no-purge": {5}, "autocast-on-cuda": {6},
             "data-by-global-rank": {7}, "no-tensor-parallel": {7},
             "dropout-by-global-rank": {7}}


def job(name, out_dir, steps=STEPS, every=STEPS, **settings):
    """main()'s settings for one run of claims 1, 3, 4 or 6: float64 unless bf16 is the point."""
    return dict(steps=steps, every=every, out_dir=os.path.join(out_dir, name),
                float64=settings.get("precision") != "bf16", **settings)


def model_facts():
    """What the lab measures on make_model's model before any run: whether it has a plan for
    --tp, and whether it is random in training with dropout 0 (dropout the lab cannot set)."""
    context = course.default_of(lesson.main, "context", "train_gpt.py")
    seed = course.default_of(lesson.main, "seed", "train_gpt.py")
    model = lesson.make_model(context, 0.0, seed)
    facts = {"tp": hasattr(model, "tensor_parallel"), "random": None}
    try:  # the same two samples, twice, in training mode
        x = default_collate([lesson.make_dataset(None, context)[0][i] for i in range(2)])[0]
        with torch.no_grad():
            facts["random"] = (model(x).double() - model(x).double()).abs().max().item()
    except Exception:  # a model the lab cannot feed this way: no measurement
        pass
    return facts


def prove(broken, out_dir, wanted, facts):
    """Runs what the wanted claims need (with --break: the claims it breaks), then reports. The
    cheap launches come first, and a claim they already show failing stops the lab there: a
    mistake is named in seconds, not after every launch."""
    print(f"claim(s) {', '.join(map(str, sorted(wanted)))} of {len(CLAIM)}"
          + (f"; --break {broken}: {BREAKS[broken]}" if broken else ""), flush=True)
    clock, runs = time.perf_counter(), {"one": None, "on_one": None, "tp_on_one": None}
    if wanted & {1, 4, 7}:  # first: a file that cannot run as a world of one stops here
        runs["one"] = in_this_process("one", job("one", out_dir, batch_size=GLOBAL), broken,
                                      out_dir)
    if wanted & {1, 3, 4, 6}:  # 2 ranks: claims 1 and 6 whole, claim 4 at 1 and 2 ranks
        jobs = {"ddp": job("ddp", out_dir, batch_size=12),
                "fsdp": job("fsdp", out_dir, parallel="fsdp", batch_size=12, every=2)}
        if 1 in wanted:
            jobs.update({"ddp-k2": job("ddp-k2", out_dir, batch_size=6, accumulate=2),
                         "fsdp-k2": job("fsdp-k2", out_dir, parallel="fsdp", batch_size=6,
                                        accumulate=2)})
        if 6 in wanted:
            jobs.update({"ddp-bf16": job("ddp-bf16", out_dir, batch_size=12, precision="bf16"),
                         "fsdp-bf16": job("fsdp-bf16", out_dir, parallel="fsdp", batch_size=12,
                                          precision="bf16")})
        runs.update(spawn(2, jobs, broken, out_dir))
        early = wanted & ({1, 4, 6} | ({2} if in_place_saves(runs) else set()))  # 2: its cause
        if stopped_early(wanted, early, runs, out_dir, facts, clock):  # is seen in any save
            return 1
    if 7 in wanted and facts["tp"]:  # FSDP x TP: 2 copies of 12 windows, each on 2 ranks
        runs.update(spawn(4, {"fsdp-tp": job("fsdp-tp", out_dir, parallel="fsdp", tp=2,
                                             batch_size=12, every=2),
                              "tp-dropout": job("tp-dropout", out_dir, parallel="fsdp", tp=2,
                                                batch_size=12, dropout=0.1)}, broken, out_dir))
        shutil.copytree(os.path.join(out_dir, "fsdp-tp", "step0000002"),
                        os.path.join(out_dir, "tp-on-1", "step0000002"))
        runs["tp_on_one"] = in_this_process("tp-on-1", job("tp-on-1", out_dir, parallel="fsdp",
                                                           batch_size=GLOBAL), broken, out_dir)
    if wanted & {3, 4}:  # the FSDP run's checkpoint of step 2, resumed on 1 and on 3 ranks
        for world in (1, 3):
            shutil.copytree(os.path.join(out_dir, "fsdp", "step0000002"),
                            os.path.join(out_dir, f"fsdp-on-{world}", "step0000002"))
        runs.update(spawn(3, {"fsdp-on-3": job("fsdp-on-3", out_dir, parallel="fsdp",
                                               batch_size=8),
                              "ddp-3": job("ddp-3", out_dir, batch_size=8)}, broken, out_dir))
        runs["on_one"] = in_this_process("fsdp-on-1", job("fsdp-on-1", out_dir, parallel="fsdp",
                                                          batch_size=GLOBAL), broken, out_dir)
    if wanted & {2, 5} and stopped_early(wanted, wanted - {2, 5}, runs, out_dir, facts, clock):
        return 1
    tell_runs(runs, clock)
    killed = None
    if wanted & {2, 5}:
        code, killed_runs, uninterrupted = restart(broken, out_dir)
        runs.update(uninterrupted)
        killed = code, killed_runs
    return report(wanted, runs, killed, out_dir, facts)


def in_place_saves(runs):
    """[(run, files)]: the saves that made their files under the final name, not by renaming a
    whole temporary (a crash mid-write would leave the newest checkpoint damaged)."""
    return [(name, [n for n in new if n not in renamed]) for name, run in runs.items() if run
            for _, new, renamed in run.get("saves", []) if set(new) - set(renamed)]


def tell_runs(runs, clock):
    """One line: how many runs of main() on which world sizes, and how long they took."""
    worlds = sorted({1 if name in ("one", "on_one", "tp_on_one") else WORLD_OF.get(name, 2)
                     for name, run in runs.items() if run})
    if not worlds:
        return
    count = sum(bool(run) for run in runs.values())
    sizes = ([", ".join(map(str, worlds[:-1])), str(worlds[-1])] if len(worlds) > 1 else
             [str(worlds[0])])
    print(f"{count} runs of main() on {' and '.join(sizes)} rank"
          f"{'' if worlds == [1] else 's'} took {time.perf_counter() - clock:.1f} s on "
          f"{course.hardware()}", flush=True)


WORLD_OF = {"fsdp-tp": 4, "tp-dropout": 4, "fsdp-on-3": 3, "ddp-3": 3}


def stopped_early(wanted, checked, runs, out_dir, facts, clock):
    """After a launch: the claims its runs can already judge, judged quietly. If one fails, the
    lab reports them (and skips the costlier launches: the mistake is what to fix first)."""
    if not checked or checked == wanted:
        return False
    with redirect_stdout(io.StringIO()) as judged:
        failed = report(checked, runs, None, out_dir, facts)
    if not failed:
        return False
    tell_runs(runs, clock)
    print(f"claim(s) {', '.join(map(str, sorted(wanted - checked)))} not run: claim(s) already "
          f"fail, and their cause is what to fix first", flush=True)
    print(judged.getvalue(), end="", flush=True)
    return True


def scaling(steps, out_dir):
    """Weak scaling, measured and printed, never asserted: the same 16 windows per rank on 1 rank
    (here) and on 2 (2 processes); the median step of each (the first is left out: warm-up)."""
    settings = dict(steps=steps, every=steps, batch_size=16)
    one = in_this_process("scale-1", dict(settings, out_dir=os.path.join(out_dir, "s1")), None,
                          out_dir)
    two = spawn(2, {"scale-2": dict(settings, out_dir=os.path.join(out_dir, "s2"),
                                    profile=True)}, None, out_dir)["scale-2"]
    tokens = 16 * inspect.signature(lesson.main).parameters["context"].default
    medians = [sorted(run["seconds"][1:])[(steps - 1) // 2] for run in (one, two)]
    rates = [tokens / seconds for seconds in medians]
    print(f"tokens/s per rank, median of {steps - 1} steps of 16 windows each: 1 rank "
          f"{rates[0]:,.0f}, 2 ranks {rates[1]:,.0f}; weak-scaling efficiency "
          f"{rates[1] / rates[0]:.2f} on {course.hardware()} (measured, not a proof)", flush=True)
    picture = draw_profile(out_dir)
    print(f"steps 3-5 of the 2 ranks, profiled: {out_dir}/trace-rank0.json and rank1 (open them in "
          f"chrome://tracing or Perfetto); drawn in {picture}", flush=True)
    return 0


KINDS = {"forward": ("DistributedDataParallel.forward",), "backward": ("autograd::engine",),
         "all-reduce": ("gloo:all_reduce", "allreduce", "all_reduce"),
         "optimizer": ("Optimizer.step",)}


def draw_profile(out_dir):
    """One lane per kind of work and rank, from the profiler's traces: where a step's time goes,
    and whether the all-reduces overlap the backward pass."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 3.2), dpi=90)
    start, lanes = None, []
    for rank in (0, 1):
        events = [e for e in json.load(open(os.path.join(out_dir, f"trace-rank{rank}.json")))[
            "traceEvents"] if e.get("ph") == "X"]
        start = start or min(e["ts"] for e in events)
        for colour, (kind, names) in zip("C0 C1 C3 C2".split(), KINDS.items()):
            spans = [((e["ts"] - start) / 1e3, e["dur"] / 1e3) for e in events
                     if any(n in e["name"] for n in names)]
            ax.broken_barh(spans, (len(lanes) - 0.4, 0.8), color=colour)
            lanes.append(f"rank {rank} {kind}")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("milliseconds (3 steps; each rank's clock from rank 0's first event)")
    fig.tight_layout()
    path = os.path.join(out_dir, "profile.png")
    fig.savefig(path)
    return path


def restart(broken, out_dir):
    """Claim 2: one torchrun launch, --max-restarts 2: the uninterrupted DDP and FSDP runs, then
    the DDP run killed at step 5 and restarted; then the FSDP run, the same. A hang is named
    within seconds (course.wait_for_torchrun). Returns (exit code, the killed runs' results, the
    uninterrupted runs' results)."""
    settings = json.dumps({"out_dir": out_dir, "broken": broken, "lesson": lesson.__file__})
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
               os.path.abspath(__file__), "--as-torchrun-worker", settings]
    clock = time.perf_counter()
    with open(os.path.join(out_dir, "torchrun.err"), "w") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            code, hang = course.wait_for_torchrun(proc, 2, os.path.join(out_dir, "stacks"), 240)
        except BaseException:  # Ctrl-C: no worker left behind
            course.stop_torchrun(proc, course.torchrun_workers(proc.pid).get(0, {}))
            raise
    seconds = time.perf_counter() - clock
    if hang:
        print(f"\nRUN FAILED: torchrun's launch: {hang[0]}", flush=True)
        raise Diagnosed("a SIGKILLed rank resumes bit-exact (the torchrun launch hung)", hang[1])
    loaded = {name: torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)
              for name in ("killed-ddp", "killed-fsdp", "ddp-uninterrupted", "fsdp-uninterrupted")
              if os.path.exists(os.path.join(out_dir, f"{name}.pt"))}
    print(f"torchrun: the uninterrupted runs, then rank 1 SIGKILLed after step 5 of the DDP run, "
          f"then of the FSDP run: exit {code} in {seconds:.1f} s"
          + ("" if code is not None else " (stopped at the time limit)"), flush=True)
    return (code, {p: loaded[f"killed-{p}"] for p in ("ddp", "fsdp") if f"killed-{p}" in loaded},
            {n: loaded[n] for n in ("ddp-uninterrupted", "fsdp-uninterrupted") if n in loaded})


def report(wanted, runs, killed, out_dir, facts):
    """Prints each wanted claim's numbers; the PROOF line covers the wanted claims only; a failure
    ends with its likely cause, read from what the runs measured (never from the file's text)."""
    passed, measured, causes, unknown, one = {}, [], [], [], runs["one"]
    code, kruns = killed or (None, {})
    every = [r for r in list(runs.values()) + list(kruns.values()) if r]
    warned = [w for r in every for w in r.get("warnings", [])]
    causes.append(broadcast_cause(warned))
    random = facts.get("random") or 0.0
    causes.append((random > 0, f"dropout the lab cannot switch off: make_model(context, dropout="
                   f"0.0, seed)'s model gives the same samples {random:.1e} apart in two training "
                   f"forwards (the lab compares with one process at dropout 0, and resumes at "
                   f"0.1); build it with make_model's dropout parameter, as "
                   f"{course.lesson_line(LESSON_PATH, 'dropout=dropout)')} does, and set yours "
                   f"in main's call ({course.lesson_line(LESSON_PATH, 'main(**vars(')})"))
    if 1 in wanted:
        names = ("ddp", "ddp-k2", "fsdp", "fsdp-k2")
        gaps = [gap(runs["ddp"], one), gap(runs["ddp-k2"], one), gap(runs["fsdp"], runs["ddp"]),
                gap(runs["fsdp-k2"], one)]
        first = {n: norm_ratios(runs[n], one) for n in names}
        norms = max((abs(r - 1) for ratios in first.values() for r in ratios), default=0.0)
        syncs = {n: (runs[f"{n}-k2"].get("syncs") or [[]])[0] for n in ("ddp", "fsdp")}
        once = all(len(s) == 2 and s[0] == 0 and s[1] > 0 for s in syncs.values())
        print("1. float64, 2 ranks against one process on the 2-times batch: DDP {:.1e}, DDP with "
              "2 micro-batches {:.1e}; FSDP against DDP {:.1e}, FSDP with 2 micro-batches "
              "{:.1e}".format(*gaps) + f"; every step's gradient norm {norms:.1e} from one "
              f"process's (relative); step 1's gradient reductions in micro-batches 1 and 2: "
              f"DDP {syncs['ddp']}, FSDP {syncs['fsdp']}")
        passed[1] = max(gaps) <= FLOAT64_TOL and norms <= FLOAT64_TOL and once
        measured += [f"float64 {max(gaps):.1e}", f"gradient norms {norms:.1e}"]
        data = next(filter(None, (data_mismatch(runs[n], one) for n in names)), None)
        causes.append(data_cause(data))
        ratio = {n: (first[n] or [None])[0] for n in names}
        causes.append((all(ratio.values()) and all(abs(ratio[n] - 1) < 1e-6 for n in (
            "ddp", "fsdp")) and all(abs(ratio[n] - 2) < 2e-2 for n in ("ddp-k2", "fsdp-k2")),
            f"the loss is not divided by the micro-batches: with 2, the first step's gradient "
            f"norm is {ratio['ddp-k2'] or 0:.2f} times one process's (FSDP "
            f"{ratio['fsdp-k2'] or 0:.2f}; with 1: {ratio['ddp'] or 0:.2f}); backpropagate "
            f"loss / len(batches), as "
            f"{course.lesson_line(LESSON_PATH, '(loss / len(batches)).backward()')} does"))
        causes.append((any(len(s) > 1 and sum(s[:-1]) > 0 for s in syncs.values()),
                       f"the gradients are reduced after every micro-batch: step 1's reductions "
                       f"per micro-batch DDP {syncs['ddp']}, FSDP {syncs['fsdp']}, 0 expected "
                       f"before the last; model.no_sync() (FSDP: set_requires_gradient_sync), as "
                       f"{course.lesson_line(LESSON_PATH, 'model.no_sync()')} does"))
        unknown.append(f"claim 1: final weights {max(gaps):.1e} from one process, largest in "
                       f"{largest(runs['ddp'], one)}; gradient norms {norms:.1e} apart, first at "
                       f"step {first_step_apart(first)}; step 1's reductions DDP {syncs['ddp']}, "
                       f"FSDP {syncs['fsdp']}")
    if 2 in wanted:
        resumed = [gap(kruns[p], runs[f"{p}-uninterrupted"]) if p in kruns and runs.get(
            f"{p}-uninterrupted") else float("inf") for p in ("ddp", "fsdp")]
        saves = [(p, new, renamed) for p in ("ddp", "fsdp") for r in (
            kruns.get(p), runs.get(f"{p}-uninterrupted")) if r for _, new, renamed in r["saves"]]
        whole = {p: sum(bool(new) and new == renamed for q, new, renamed in saves if q == p)
                 for p in ("ddp", "fsdp")}
        in_place = in_place_saves({**runs, **{f"{p} killed": r for p, r in kruns.items()}})
        if killed:
            print(f"2. killed at step 5, resumed from step 3, against uninterrupted (dropout 0.1, "
                  f"2 micro-batches, an evaluation after the checkpoint): DDP {resumed[0]:.1e}, "
                  f"FSDP {resumed[1]:.1e}; saves that made their files by renaming a whole "
                  f"temporary: " + ", ".join(f"{p.upper()} {whole[p]} of "
                                             f"{sum(q == p for q, *_ in saves)}"
                                             for p in ("ddp", "fsdp")))
        else:  # judged before the torchrun launch: the earlier runs' saves already fail it
            print(f"2. judged from the saves of the runs so far (torchrun's kill not run): "
                  f"{len(in_place)} save(s) of {len({n for n, _ in in_place})} run(s) made "
                  f"their checkpoint files in place")
        passed[2] = code == 0 and max(resumed) == 0.0 and not in_place
        measured.append(f"resumed {max(resumed):.1e}" if killed else "saves in place")
        loads = {p: (kruns[p].get("rng_after_load"), (runs.get(f"{p}-uninterrupted") or {}).get(
            "rng_at_save", {})) for p in kruns}
        lost = [p for p, (load, at_save) in loads.items()
                if load and load[0] in at_save and load[1] != at_save[load[0]]]
        causes.append((lost, f"the resumed ranks do not restore their RNG states: after loading "
                       f"step {RESTART['every']}, rank 0's differs from the one it saved there "
                       f"({' and '.join(p.upper() for p in lost)}), so dropout draws other masks; "
                       f"set each data-parallel rank's back, as "
                       f"{course.lesson_line(CHECKPOINT_PATH, 'torch.set_rng_state(')} does"))
        made = f"{', '.join(in_place[0][1])} (the {in_place[0][0]} run)" if in_place else ""
        causes.append((in_place, f"the checkpoint is written in place: the save made {made} "
                       f"with no os.replace or os.rename, so a crash mid-save damages the newest; "
                       f"write NAME.tmp, then os.replace it, as "
                       f"{course.lesson_line(CHECKPOINT_PATH, 'os.replace(tmp, path)')} does"))
        unknown.append(f"claim 2: torchrun exit {code}; resumed DDP {resumed[0]:.1e}, FSDP "
                       f"{resumed[1]:.1e}; RNG states restored: {'no' if lost else 'yes'}")
    if 3 in wanted:
        moved = [gap(runs["on_one"], runs["fsdp"]), gap(runs["fsdp-on-3"], runs["fsdp"])]
        print(f"3. FSDP saved on 2 ranks at step 2, resumed to step {STEPS} on 1 rank: "
              f"{moved[0]:.1e} from the 2-rank run; on 3 ranks: {moved[1]:.1e}")
        passed[3], measured = max(moved) <= FLOAT64_TOL, measured + [f"moved {max(moved):.1e}"]
        data = next(filter(None, (data_mismatch(runs[n], one) for n in ("fsdp", "fsdp-on-3")
                                  if one)), None)
        causes.append(data_cause(data))
        unknown.append(f"claim 3: resumed on 1 rank {moved[0]:.1e}, on 3 {moved[1]:.1e}, largest "
                       f"in {largest(runs['fsdp-on-3'], runs['fsdp'])}")
    if 4 in wanted:
        context = inspect.signature(lesson.main).parameters["context"].default
        val_set = lesson.make_dataset(None, context)[1]
        tokens = len(val_set) * torch.as_tensor(val_set[0][1]).numel()  # a window, or a label
        named = {"1 rank": "one", "2 ranks DDP": "ddp", "2 ranks FSDP": "fsdp",
                 "3 ranks DDP": "ddp-3", "3 ranks FSDP": "fsdp-on-3",
                 "4 ranks FSDP x TP 2": "fsdp-tp"}
        named = {k: v for k, v in named.items() if runs.get(v)}  # judged early: 1 and 2 ranks
        counts = {k: runs[v]["counted"] for k, v in named.items()}
        exact = exact_evaluation(one, val_set, context)
        values = {k: runs[v]["evaluated"][-1][0] for k, v in named.items()}
        apart = max(abs(v / exact - 1) if exact else abs(v) for v in values.values())
        print(f"4. validation targets counted, of {len(val_set)} samples: {tokens} (uneven "
              f"shards at 2 and 3 ranks): "
              + ", ".join(f"{k} {', '.join(map(str, v))}" for k, v in counts.items())
              + f"; the mean loss at step {STEPS} {apart:.1e} from the lab's own sum over every "
              f"target in one process ({exact:.4f}, relative)")
        passed[4] = all(c == tokens for v in counts.values() for c in v) and apart <= EVAL_TOL
        twice = [(k, c) for k, v in counts.items() for c in v if c > tokens]
        where = twice[0][0] if twice else ""
        causes.append((twice, f"evaluation counts some targets twice: {where}"
                       f" counted {twice[0][1] if twice else 0} of {tokens} (each rank padded to "
                       f"an equal share, as DistributedSampler does); give rank r every "
                       f"world-size-th sample from r, counting nothing past its share, as "
                       f"{course.lesson_line(LESSON_PATH, 'mine = list(range(rank, len(dataset)')}"
                       f" does"))
        value, forwards = one["evaluated"][-1]
        causes.append(mean_reduction_cause(value, forwards, exact, tokens))
        unknown.append(f"claim 4: targets counted {sorted({c for v in counts.values() for c in v})}"
                       f" of {tokens}; mean loss one process {value:.4f}, the lab's own sum "
                       f"{exact:.4f}, runs {apart:.1e} apart")
    if 5 in wanted:
        expected = list(range(1, RESTART["steps"] + 1))
        steps = {p: scalar_steps(os.path.join(out_dir, f"killed-{p}", "tensorboard"))
                 for p in ("ddp", "fsdp")}
        print(f"5. TensorBoard's steps of train/loss across the restart: DDP {steps['ddp']}, "
              f"FSDP {steps['fsdp']}")
        passed[5] = steps["ddp"] == expected and steps["fsdp"] == expected
        again = sorted({s for p in steps.values() for s in p if p.count(s) > 1})
        causes.append((again, f"TensorBoard logs a restart's steps again: steps {again} appear "
                       f"twice after the resume from step {RESTART['every']} (DDP {steps['ddp']});"
                       f" open the writer with purge_step=start + 1, which hides what a crashed "
                       f"attempt logged after its checkpoint, as "
                       f"{course.lesson_line(LESSON_PATH, 'purge_step=start + 1')} does"))
        unknown.append(f"claim 5: steps DDP {steps['ddp']}, FSDP {steps['fsdp']}")
    if 6 in wanted:
        bf16 = [gap(runs["ddp-bf16"], runs["ddp"]), gap(runs["fsdp-bf16"], runs["ddp"])]
        print(f"6. bf16 against float64 after {STEPS} steps: DDP autocast {bf16[0]:.1e}, FSDP "
              f"mixed-precision policy {bf16[1]:.1e}")
        passed[6] = BF16_AT_LEAST <= min(bf16) and max(bf16) <= BF16_TOL
        measured.append(f"bf16 {min(bf16):.1e} to {max(bf16):.1e}")
        said = next((w for w in runs["ddp-bf16"].get("warnings", []) if "autocast" in w.lower()
                     or "not available" in w), None)
        causes.append((bf16[0] < BF16_AT_LEAST, f"autocast is off in DDP's bf16 run: it ends "
                       f"{bf16[0]:.1e} from float64, where bf16's rounding moves it at least "
                       f"{BF16_AT_LEAST:g}" + (f" (torch warned \"{said}\")" if said else "")
                       + f"; autocast the device the run is on, torch.autocast(device.type, ...), "
                       f"as {course.lesson_line(LESSON_PATH, 'torch.autocast(device.type')} does"))
        causes.append((bf16[1] < BF16_AT_LEAST, f"FSDP's bf16 run computes in float64: it ends "
                       f"{bf16[1]:.1e} from it; give fully_shard a MixedPrecisionPolicy with "
                       f"param_dtype=torch.bfloat16, as "
                       f"{course.lesson_line(LESSON_PATH, 'param_dtype=torch.bfloat16')} does"))
        unknown.append(f"claim 6: bf16 DDP {bf16[0]:.1e}, FSDP {bf16[1]:.1e} from float64")
    if 7 in wanted and "fsdp-tp" not in runs:
        print("7. skipped: the model has no tensor_parallel()")
    elif 7 in wanted:
        tp, split = [gap(runs["fsdp-tp"], one), gap(runs["tp_on_one"], runs["fsdp-tp"])], runs[
            "fsdp-tp"]
        apart = runs["tp-dropout"]["copies_apart"]
        print(f"7. float64, --tp 2 on 4 ranks ({len(split['split'])} of {split['tensors']} "
              f"parameter tensors split over the tp ranks) against one process: {tp[0]:.1e}; its "
              f"step-2 checkpoint resumed on 1 rank without TP: {tp[1]:.1e}; with dropout 0.1, a "
              f"copy's 2 ranks' whole weights {apart:.1e} apart")
        passed[7] = max(tp) <= FLOAT64_TOL and len(split["split"]) > 0 and apart == 0.0
        measured.append(f"FSDP x TP {max(tp):.1e}")
        causes.append(data_cause(data_mismatch(runs["fsdp-tp"], one, tp=2)))
        rngs = [r["rng"] for r in runs["tp-dropout"]["ranks"]]
        causes.append((apart > 0 and any(rngs[r] != rngs[r - r % 2] for r in range(len(rngs))),
                       f"a copy's tp ranks draw different dropout masks: they end with different "
                       f"RNG states, and the weights both hold whole drift {apart:.1e} apart; seed "
                       f"by the data-parallel rank, as "
                       f"{course.lesson_line(LESSON_PATH, 'torch.manual_seed(seed + 1 + dp_rank)')}"
                       f" does"))
        causes.append((not split["split"], f"the model's tensor_parallel() splits nothing: 0 of "
                       f"{split['tensors']} parameter tensors are sharded over the tp ranks; "
                       f"parallelize_module the blocks (model.py's plan), called by wrap as "
                       f"{course.lesson_line(LESSON_PATH, 'model.tensor_parallel(mesh')} does"))
        unknown.append(f"claim 7: --tp 2 {tp[0]:.1e} from one process, resumed {tp[1]:.1e}, "
                       f"{len(split['split'])} tensors split, a copy's ranks {apart:.1e} apart")
    failed = [str(n) for n, ok in passed.items() if not ok]
    claim = ", ".join(CLAIM[n] for n in sorted(passed))
    code = course.report_proof(not failed, claim if not failed else
                               f"NOT every claim holds (claim {', '.join(failed)} fails): {claim}",
                               "; ".join(measured) or "counts and steps exact",
                               f"{FLOAT64_TOL:g} float64, 0 resumed, bf16 {BF16_AT_LEAST:g} to "
                               f"{BF16_TOL:g}")
    if failed:
        course.diagnose(causes, "; ".join(u for u in unknown if u[6] in failed))
    return code


def broadcast_cause(warned):
    """(fits, cause): torch's warning that a loss broadcast its output against its target."""
    said = next((w.split(". ")[0] for w in warned if "different to the input size" in w), None)
    return said, (f"the loss broadcasts the output against the target: torch warned \"{said}\": "
                  f"a (B, B) loss, every output against every target; view the output as the "
                  f"target, as {course.lesson_line(LESSON_PATH, 'output.view(target.shape)')} does")


def mean_reduction_cause(value, forwards, exact, targets):
    """(fits, cause): an evaluation that sums each forward's mean and divides by the targets
    reports the exact mean times forwards / targets."""
    share = value / exact if exact else 0.0
    return bool(exact and share < 0.5 and 0.5 < share / (forwards / targets) < 2), (
        f"evaluation adds up a mean per forward: one process reports {value:.4f}, the mean over "
        f"the targets is {exact:.4f} ({share:.4f} of it = {forwards} forward(s) / {targets} "
        f"targets); sum the loss (reduction=\"sum\"), as "
        f"{course.lesson_line(LESSON_PATH, SUMMED)} does")


def norm_ratios(run, one):
    """Each step's gradient norm over one process's (train_step's second value), or []."""
    mine, theirs = run.get("norms") or [], one.get("norms") or []
    if not mine or None in mine or None in theirs or len(theirs) < len(mine):
        return []
    return [a / b if b else float("inf") for a, b in zip(mine, theirs[len(theirs) - len(mine):])]


def first_step_apart(ratios):
    steps = [i + 1 for r in ratios.values() for i, x in enumerate(r) if abs(x - 1) > FLOAT64_TOL]
    return min(steps) if steps else "none"


def largest(a, b):
    """The parameter of the largest difference between two runs' final weights."""
    diffs = {k: (a["state"][k].double() - b["state"][k].double()).abs().max().item()
             for k in a["state"] if k in b["state"]}
    return max(diffs, key=diffs.get) if diffs else "none"


def data_mismatch(run, one, tp=1):
    """The first step whose windows, read by the run's ranks, are not one process's: ("copy",
    step, rank, rank) when a copy's tp ranks read different ones, else ("step", step, ranks,
    windows read beyond the step's, windows of the step missed, the step's count); or None."""
    ranks, ref = run.get("ranks") or [], (one.get("ranks") or [{}])[0].get("read") or []
    reads = [r["read"] for r in ranks]
    if not reads or not ref or any(None in r for r in reads + [ref]):
        return None
    for j in range(len(reads[0])):
        step, i = STEPS - len(reads[0]) + j + 1, len(ref) - len(reads[0]) + j
        for r in range(len(reads)):
            if reads[r][j] != reads[r - r % tp][j]:
                return ("copy", step, r - r % tp, r)
        together = Counter(w for r in range(0, len(reads), tp) for w in reads[r][j])
        expected = Counter(ref[i])
        if together != expected:
            return ("step", step, len(reads) // tp, sum((together - expected).values()),
                    sum((expected - together).values()), len(ref[i]))
    return None


def data_cause(data):
    """A (fits, cause) pair from data_mismatch's answer."""
    if data and data[0] == "copy":
        return True, (f"a copy's tp ranks read different windows: at step {data[1]}, ranks "
                      f"{data[2]} and {data[3]} (one copy of the model) read different ones, as "
                      f"data split by the global rank does; split the data by the data-parallel "
                      f"rank (the copy), as "
                      f"{course.lesson_line(LESSON_PATH, 'micro_batches(train_set, step, dp_rank')}"
                      f" does")
    return bool(data), (f"the ranks do not split one stream of windows: at step "
                        f"{data[1] if data else 0}, {data[2] if data else 0} ranks read "
                        f"{data[3] if data else 0} window(s) that one process does not (or read "
                        f"them twice) and miss {data[4] if data else 0} of its "
                        f"{data[5] if data else 0} (each rank drew its own order, as a sampler "
                        f"seeded per rank does); give each rank its share of the step's windows, "
                        f"as {course.lesson_line(LESSON_PATH, 'mine = windows[rank')} does")


def exact_evaluation(run, val_set, context):
    """The mean loss per target of `run`'s final weights, by the lab itself in this process:
    cross-entropy (class targets) or squared error (real ones) summed over every target once."""
    model = lesson.make_model(context, 0.0, 0).double()
    model.load_state_dict(run["state"])
    model.eval()
    data, total, count = in_dtype((val_set, val_set, ""), torch.float64)[0], 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), 256):
            x, y = default_collate([data[i] for i in range(start, min(start + 256, len(data)))])
            out = model(x).double()
            if y.is_floating_point():
                total += F.mse_loss(out.reshape(y.shape), y.double(), reduction="sum").item()
            else:
                total += F.cross_entropy(out.flatten(0, -2), y.flatten(), reduction="sum").item()
            count += y.numel()
    return total / count


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
else:  # imported by a test, or by mp.spawn's forkserver: the course's lesson until told otherwise
    use_lesson(LESSON)
