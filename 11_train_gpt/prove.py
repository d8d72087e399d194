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
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset  # noqa: E402

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
    and a capture of the full final weights and of the evaluations' counts into `kept`. Returns
    the function that undoes it all."""
    saved = {name: getattr(lesson, name) for name in ("make_model", "evaluate", "sample",
             "micro_batches", "F", "SummaryWriter", "torch", "train_step", "make_dataset")}
    saved_rng = torch.set_rng_state
    dtype = torch.float64 if float64 else torch.float32
    lesson.make_model = lambda *a, **k: without_tp(saved["make_model"](*a, **k).to(dtype), broken)
    lesson.make_dataset = lambda *a, **k: in_dtype(saved["make_dataset"](*a, **k), dtype)

    def counting_evaluate(model, dataset, batch_size, device, autocast, group=None):
        if broken == "padded-evaluation":  # DistributedSampler's padding: equal shares, repeats
            extra = -len(dataset) % lesson.dist.get_world_size(group)
            dataset = ConcatDataset([dataset, Subset(dataset, range(extra))])
        loss, counted = saved["evaluate"](model, dataset, batch_size, device, autocast, group)
        kept.setdefault("counted", []).append(counted)
        return loss, counted

    def save_and_capture(folder, model, optimizer, scheduler, step, config, *args):
        path = saved_save(folder, model, optimizer, scheduler, step, config, *args)
        if step == config["steps"]:  # every rank: the full weights need the ranks' shards
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
            kept["state"] = {k: v.detach().clone() for k, v in state.items()}
            kept["split"] = [name for name, p in model.named_parameters() if split_over_tp(p)]
            kept["tensors"] = len(list(model.parameters()))
            if kept.get("tp", 1) > 1:  # what a copy's ranks both hold whole must stay equal
                kept["copies_apart"] = copies_apart(model, kept["split"], kept["tp"])
        return path
    saved_save = lesson.checkpoint.save
    lesson.checkpoint.save = save_and_capture
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
        result = saved["train_step"](*args, **kwargs)
        kept["seconds"].append(time.perf_counter() - start)
        if kept.get("profiler") and number == 5:
            kept["profiler"].stop()
            kept.pop("profiler").export_chrome_trace(kept["profile"])
        return result
    lesson.train_step = timed_step
    if broken == "loss-not-divided":  # the loss K times larger: loss / K is the undivided loss
        lesson.F = SimpleNamespace(cross_entropy=lambda *a, **k: torch.nn.functional.cross_entropy(
            *a, **k) * (accumulate if k.get("reduction", "mean") == "mean" else 1))
    if broken == "no-rng-restore":
        torch.set_rng_state = lambda *a, **k: None
    if broken == "rank-seeded-data":
        lesson.micro_batches = rank_seeded_micro_batches
    if broken == "data-by-global-rank":  # the lesson's rank and world size of the data ignored
        lesson.micro_batches = lambda dataset, step, rank, world_size, *rest: saved[
            "micro_batches"](dataset, step, lesson.dist.get_rank(), lesson.dist.get_world_size(),
                             *rest)
    if broken == "no-purge":
        lesson.SummaryWriter = lambda log_dir, purge_step=None: saved["SummaryWriter"](log_dir)
    if broken == "autocast-on-cuda":
        lesson.torch = SimpleNamespace(**{**vars(torch), "autocast": lambda device_type, dtype:
                                          torch.autocast("cuda", dtype=dtype)})

    def undo():
        for name, value in saved.items():
            setattr(lesson, name, value)
        torch.set_rng_state, lesson.checkpoint.save = saved_rng, saved_save
    return undo


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
    """Claim 2, one rank of one torchrun attempt: the DDP run, then the FSDP run; rank 1 kills
    itself (SIGKILL) after step 5 of a run that started from step 0, once per run."""
    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    use_lesson(settings["lesson"])
    torch.set_num_threads(1)
    for parallel in ("ddp", "fsdp"):
        # two runs in one process: each needs its own key prefix on torchrun's store
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


def in_this_process(name, job, broken, out_dir):
    """A world of one, here: what `python train_gpt.py` runs."""
    forget_world()
    try:
        run_one(name, job, broken, out_dir)
    finally:
        forget_world()
    return torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)


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
    use_lesson(args.lesson)
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="lab11-")
    os.makedirs(out_dir, exist_ok=True)
    if os.listdir(out_dir):
        course.refuse(f"--out-dir {out_dir} is not empty")
    try:
        if args.scaling:
            return scaling(args.scaling, out_dir)
        return prove(args.broken, out_dir, set(args.claims or CLAIMS_OF.get(args.broken, CLAIM)))
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


def prove(broken, out_dir, wanted):
    """Runs what the wanted claims need (with --break: the claims it breaks), then reports."""
    print(f"claim(s) {', '.join(map(str, sorted(wanted)))} of {len(CLAIM)}"
          + (f"; --break {broken}: {BREAKS[broken]}" if broken else ""), flush=True)
    clock, two, three, four = time.perf_counter(), {}, {}, {}
    if wanted & {1, 3, 4, 6}:
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
        if 2 in wanted:
            jobs.update({f"{p}-uninterrupted": dict(RESTART, parallel=p,
                                                   out_dir=os.path.join(out_dir, f"u-{p}"))
                         for p in ("ddp", "fsdp")})
        two = spawn(2, jobs, broken, out_dir)
    elif 2 in wanted:
        two = spawn(2, {f"{p}-uninterrupted": dict(RESTART, parallel=p, out_dir=os.path.join(
            out_dir, f"u-{p}")) for p in ("ddp", "fsdp")}, broken, out_dir)
    one = on_one = tp_on_one = None
    if 7 in wanted:  # FSDP x TP: 2 copies of 12 windows, each on 2 ranks; saved at step 2
        four = spawn(4, {"fsdp-tp": job("fsdp-tp", out_dir, parallel="fsdp", tp=2, batch_size=12,
                                        every=2),
                         "tp-dropout": job("tp-dropout", out_dir, parallel="fsdp", tp=2,
                                           batch_size=12, dropout=0.1)}, broken, out_dir)
        shutil.copytree(os.path.join(out_dir, "fsdp-tp", "step0000002"),
                        os.path.join(out_dir, "tp-on-1", "step0000002"))
        tp_on_one = in_this_process("tp-on-1", job("tp-on-1", out_dir, parallel="fsdp",
                                                   batch_size=GLOBAL), broken, out_dir)
    if wanted & {1, 4, 7}:
        one = in_this_process("one", job("one", out_dir, batch_size=GLOBAL), broken, out_dir)
    if wanted & {3, 4}:  # the FSDP run's checkpoint of step 2, resumed on 1 and on 3 ranks
        for world in (1, 3):
            shutil.copytree(os.path.join(out_dir, "fsdp", "step0000002"),
                            os.path.join(out_dir, f"fsdp-on-{world}", "step0000002"))
        three = spawn(3, {"fsdp-on-3": job("fsdp-on-3", out_dir, parallel="fsdp", batch_size=8),
                          "ddp-3": job("ddp-3", out_dir, batch_size=8, steps=1)}, broken, out_dir)
        on_one = in_this_process("fsdp-on-1", job("fsdp-on-1", out_dir, parallel="fsdp",
                                                  batch_size=GLOBAL), broken, out_dir)
    ones = sum(r is not None for r in (one, on_one, tp_on_one))
    worlds = [str(w) for w, runs in ((1, ones), (2, len(two)), (3, len(three)), (4, len(four)))
              if runs]
    print(f"{ones + len(two) + len(three) + len(four)} runs of main() on "
          f"{' and '.join([', '.join(worlds[:-1]), worlds[-1]] if len(worlds) > 1 else worlds)} "
          f"rank{'' if worlds == ['1'] else 's'} took {time.perf_counter() - clock:.1f} s on "
          f"{course.hardware()}", flush=True)
    killed = restart(broken, out_dir) if wanted & {2, 5} else None
    return report(wanted, two, one, three, on_one, killed, out_dir, four, tp_on_one)


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
    """Claim 2: one torchrun launch, --max-restarts 2: the DDP run is killed at step 5 and
    restarted; then the FSDP run, the same. Returns (exit code, seconds, each run's result)."""
    settings = json.dumps({"out_dir": out_dir, "broken": broken, "lesson": lesson.__file__})
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
               os.path.abspath(__file__), "--as-torchrun-worker", settings]
    clock = time.perf_counter()
    with open(os.path.join(out_dir, "torchrun.err"), "w") as err:
        try:
            code = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=err, timeout=240,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - clock
    runs = {p: torch.load(os.path.join(out_dir, f"killed-{p}.pt"), weights_only=True)
            for p in ("ddp", "fsdp") if os.path.exists(os.path.join(out_dir, f"killed-{p}.pt"))}
    print(f"torchrun, rank 1 SIGKILLed after step 5 of the DDP run, then of the FSDP run: exit "
          f"{code} in {seconds:.1f} s", flush=True)
    return code, runs


def report(wanted, two, one, three, on_one, killed, out_dir, four, tp_on_one):
    """Prints each wanted claim's numbers; the PROOF line covers the wanted claims only."""
    passed, measured = {}, []
    if 1 in wanted:
        gaps = [gap(two["ddp"], one), gap(two["ddp-k2"], one), gap(two["fsdp"], two["ddp"]),
                gap(two["fsdp-k2"], one)]
        print("1. float64, 2 ranks against one process on the 2-times batch: DDP {:.1e}, DDP with "
              "2 micro-batches {:.1e}; FSDP against DDP {:.1e}, FSDP with 2 micro-batches "
              "{:.1e}".format(*gaps))
        passed[1], measured = max(gaps) <= FLOAT64_TOL, measured + [f"float64 {max(gaps):.1e}"]
    if 2 in wanted:
        code, runs = killed
        resumed = [gap(runs[p], two[f"{p}-uninterrupted"]) if p in runs else float("inf")
                   for p in ("ddp", "fsdp")]
        print(f"2. killed at step 5, resumed from step 3, against uninterrupted (dropout 0.1, 2 "
              f"micro-batches, an evaluation after the checkpoint): DDP {resumed[0]:.1e}, FSDP "
              f"{resumed[1]:.1e}")
        passed[2], measured = code == 0 and max(resumed) == 0.0, measured + [
            f"resumed {max(resumed):.1e}"]
    if 3 in wanted:
        moved = [gap(on_one, two["fsdp"]), gap(three["fsdp-on-3"], two["fsdp"])]
        print(f"3. FSDP saved on 2 ranks at step 2, resumed to step {STEPS} on 1 rank: "
              f"{moved[0]:.1e} from the 2-rank run; on 3 ranks: {moved[1]:.1e}")
        passed[3], measured = max(moved) <= FLOAT64_TOL, measured + [f"moved {max(moved):.1e}"]
    if 4 in wanted:
        context = inspect.signature(lesson.main).parameters["context"].default
        val_set = lesson.make_dataset(None, context)[1]
        tokens = len(val_set) * torch.as_tensor(val_set[0][1]).numel()  # a window, or a label
        counts = {"1 rank": one, "2 ranks DDP": two["ddp"], "2 ranks FSDP": two["fsdp"],
                  "3 ranks DDP": three["ddp-3"], "3 ranks FSDP": three["fsdp-on-3"],
                  **({"4 ranks FSDP x TP 2": four["fsdp-tp"]} if four else {})}
        counts = {k: v["counted"] for k, v in counts.items()}
        print(f"4. validation targets counted, of {len(val_set)} samples: {tokens} (uneven "
              f"shards at 2 and 3 ranks): "
              + ", ".join(f"{k} {', '.join(map(str, v))}" for k, v in counts.items()))
        passed[4] = all(c == tokens for v in counts.values() for c in v)
    if 5 in wanted:
        expected = list(range(1, RESTART["steps"] + 1))
        steps = {p: scalar_steps(os.path.join(out_dir, f"killed-{p}", "tensorboard"))
                 for p in ("ddp", "fsdp")}
        print(f"5. TensorBoard's steps of train/loss across the restart: DDP {steps['ddp']}, "
              f"FSDP {steps['fsdp']}")
        passed[5] = steps["ddp"] == expected and steps["fsdp"] == expected
    if 6 in wanted:
        bf16 = [gap(two["ddp-bf16"], two["ddp"]), gap(two["fsdp-bf16"], two["ddp"])]
        print(f"6. bf16 against float64 after {STEPS} steps: DDP autocast {bf16[0]:.1e}, FSDP "
              f"mixed-precision policy {bf16[1]:.1e}")
        passed[6] = BF16_AT_LEAST <= min(bf16) and max(bf16) <= BF16_TOL
        measured.append(f"bf16 {min(bf16):.1e} to {max(bf16):.1e}")
    if 7 in wanted:
        tp, split = [gap(four["fsdp-tp"], one), gap(tp_on_one, four["fsdp-tp"])], four["fsdp-tp"]
        apart = four["tp-dropout"]["copies_apart"]
        print(f"7. float64, --tp 2 on 4 ranks ({len(split['split'])} of {split['tensors']} "
              f"parameter tensors split over the tp ranks) against one process: {tp[0]:.1e}; its "
              f"step-2 checkpoint resumed on 1 rank without TP: {tp[1]:.1e}; with dropout 0.1, a "
              f"copy's 2 ranks' whole weights {apart:.1e} apart")
        passed[7] = max(tp) <= FLOAT64_TOL and len(split["split"]) > 0 and apart == 0.0
        measured.append(f"FSDP x TP {max(tp):.1e}")
    failed = [str(n) for n, ok in passed.items() if not ok]
    claim = ", ".join(CLAIM[n] for n in sorted(wanted))
    return course.report_proof(not failed, claim if not failed else
                               f"NOT every claim holds (claim {', '.join(failed)} fails): {claim}",
                               "; ".join(measured) or "counts and steps exact",
                               f"{FLOAT64_TOL:g} float64, 0 resumed, bf16 {BF16_AT_LEAST:g} to "
                               f"{BF16_TOL:g}")


if __name__ == "__main__":
    sys.exit(main())
else:  # imported by a test, or by mp.spawn's forkserver: the course's lesson until told otherwise
    use_lesson(LESSON)
