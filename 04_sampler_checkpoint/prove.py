"""The lab of lesson 04: runs sampler_checkpoint.py, kills a rank mid-epoch, resumes, proves it.

    python 04_sampler_checkpoint/prove.py                             # the proof, 2 ranks
    python 04_sampler_checkpoint/prove.py --break no-rng-restore      # the proof FAILS
    python 04_sampler_checkpoint/prove.py --break loader-global-rng   # FAILS
    python 04_sampler_checkpoint/prove.py --break padded-eval         # FAILS: 102 counted
    python 04_sampler_checkpoint/prove.py --crash-rank 1              # rank 1 raises at step 2

The claim: a run whose rank is SIGKILLed in the middle of an epoch (after a mid-epoch checkpoint
and after an evaluation that lies between two checkpoints), resumed from its checkpoint folder by
the lesson's own code, ends with final weights and post-resume losses bit-identical to a run that
never stopped; and its evaluation counts each of the 101 held-out samples exactly once, as one
process counting them all does.

Three spawns, one per run: uninterrupted (a fresh folder), crashed (a fresh folder; one rank
SIGKILLs itself right after an optimizer step), resumed (the crashed run's folder, chosen by the
lesson's find_checkpoint, as the lesson's main() does).
"""
import argparse
import contextlib
import inspect
import logging
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("sampler_checkpoint", needs=(  # or the file given with --lesson PATH
    "evaluate", "find_checkpoint", "main", "make_dataset", "make_model", "train", "worker"))

# forkserver (Linux): one server process imports torch (and DDP's torch._dynamo) once; every rank
# of the three runs is forked from it, fresh, in a fraction of a second (spawn: ~4 s a run on 2
# cores; macOS and Windows use spawn: course.start_method says why).
START = course.START_METHOD
TRAIN, HELD_OUT = 256, 101  # what lesson.worker builds: make_dataset(256 + 101), split 256 | 101
DEFAULTS = {k: p.default for k, p in inspect.signature(lesson.main).parameters.items()}
EVERY = course.default_of(lesson.train, "every", "sampler_checkpoint.py")  # steps between checkpoints
BREAKS = {
    "no-rng-restore": "the resumed ranks do not restore their RNG state (torch.set_rng_state is a "
                      "no-op): dropout draws other masks after the resume",
    "loader-global-rng": "every DataLoader of the lesson loses its own generator: each iterator "
                         "draws its seed from the global RNG, the one dropout uses and checkpoints save",
    "padded-eval": "evaluate() over a DistributedSampler, which pads 101 samples to 102",
    "rank0-rng-only": "the checkpoint as if it kept rank 0's RNG state only (a common shortcut): "
                      "every resumed rank restores rank 0's state, so rank 1 draws rank 0's masks",
}


def with_rank0_rng_only(load):
    """--break rank0-rng-only: torch.load as the lesson calls it on resume, but every rank gets rank
    0's RNG state, as if rank 0 had saved only its own."""
    def load_rank0_rng(*args, **kwargs):
        state = load(*args, **kwargs)
        if isinstance(state, dict) and "rng" in state:  # the checkpoint, not all_gather_object's
            state["rng"] = [state["rng"][0]] * len(state["rng"])
        return state
    return load_rank0_rng


# ---------------------------------------------------------------- the sampler, no process group
def shards(n, world_size, seed=0, epoch=None, **kw):
    """The indices each rank's DistributedSampler yields; `seed` may be a list, one per rank."""
    seeds = seed if isinstance(seed, list) else [seed] * world_size
    result = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seeds[rank], **kw)
        if epoch is not None:
            sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def epoch_orders(n, world_size, epochs, call_set_epoch):
    """Rank 0's order in each epoch, from ONE sampler reused across epochs, as in a training loop."""
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=0, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def show_sampler():
    """What DistributedSampler does, printed (num_replicas and rank explicit: no process group)."""
    padded, dropped = shards(10, 3, shuffle=False), shards(10, 3, shuffle=False, drop_last=True)
    twice = sorted({i for i in range(10) if sum(s.count(i) for s in padded) > 1})
    lost = sorted(set(range(10)) - {i for s in dropped for i in s})
    print("the sampler, 10 samples over 3 ranks (no process group: num_replicas and rank given)")
    print(f"  shuffle=False:  {'  '.join(f'rank {r}: {s}' for r, s in enumerate(padded))}  "
          f"(padded to {sum(map(len, padded))}: {twice} twice)")
    print(f"  drop_last=True: {'  '.join(f'rank {r}: {s}' for r, s in enumerate(dropped))}  "
          f"(never seen: {lost})")
    for call in (False, True):
        orders = epoch_orders(10, 2, 3, call)
        same = all(o == orders[0] for o in orders)
        print(f"  2 ranks, rank 0 in epochs 0-2, {'with' if call else 'without'} set_epoch: "
              f"{'  '.join(map(str, orders))}  ({'the SAME order' if same else 'a new order each epoch'})")
    for label, seed in (("seed=0 on every rank", 0), ("seed=rank (wrong)", [0, 1])):
        seen = [i for s in shards(10, 2, seed=seed, shuffle=True) for i in s]
        print(f"  {label}: {len(set(seen))} of 10 samples seen, {len(seen) - len(set(seen))} twice")


# ---------------------------------------------------------------- --break, --crash-rank, the kill
class LoaderOnGlobalRNG(DataLoader):
    """--break loader-global-rng: the lesson's DataLoader without its own generator."""

    def __init__(self, *args, generator=None, **kwargs):
        super().__init__(*args, **kwargs)


@torch.no_grad()
def padded_evaluate(model, dataset, device):
    """--break padded-eval: the lesson's evaluate() over a DistributedSampler, which pads."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    sampler = DistributedSampler(dataset, shuffle=False)  # rank and world size from the group
    for x, y in DataLoader(dataset, batch_size=256, sampler=sampler, generator=torch.Generator()):
        counts[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += len(y)
    torch.distributed.all_reduce(counts)
    return counts.tolist()


def at_step(step, action):
    """Calls action() right after this process's `step`-th optimizer step (a global hook)."""
    count = [0]

    def hook(optimizer, args, kwargs):
        count[0] += 1
        if count[0] == step:
            action()
    register_optimizer_step_post_hook(hook)


def kill_self():
    """The kill: SIGKILL (TerminateProcess on Windows, which has no SIGKILL), no finally runs."""
    course.hard_kill(os.getpid())


def crash(rank):
    raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")


def recording(evaluate, log, steps):
    """The lesson's evaluate, unchanged, with what it returned and after which step kept in `log`."""
    def evaluate_and_record(model, dataset, device):
        counts = evaluate(model, dataset, device)
        log.append((steps[0], counts))
        return counts
    return evaluate_and_record


def tracing(make_dataset, traces):
    """The lesson's make_dataset, unchanged; the set it makes starts a course.StepTrace: which
    samples each step reads, and the RNG state each step's dropout starts from."""
    def make_and_trace(*args, **kwargs):
        dataset = make_dataset(*args, **kwargs)
        if not traces:
            traces.append(course.StepTrace(dataset, keep=0).install())
        return dataset
    return make_and_trace


def recording_rename(rename, renamed):
    """os.replace or os.rename, recording each destination's file name: a checkpoint that never
    was one was written in place (a crash mid-write leaves it damaged under its final name)."""
    def rename_and_record(src, dst, *args, **kwargs):
        result = rename(src, dst, *args, **kwargs)
        renamed.append(os.path.basename(dst))
        return result
    return rename_and_record


def lab_worker(rank, world_size, port, backend, epochs, folder, resume, out_dir, run, broken,
               kill_step, kill_rank, crash_rank, timeout):
    """Runs the lesson's worker unchanged (but for --break) and keeps what it returns in a file."""
    course.dump_stacks_on_signal(out_dir, rank)  # a hang's report: where this rank waits
    if broken == "loader-global-rng":
        lesson.DataLoader = LoaderOnGlobalRNG
    if broken == "padded-eval":
        lesson.evaluate = padded_evaluate
    if broken == "no-rng-restore" and resume:
        torch.set_rng_state = lambda state: None
    if broken == "rank0-rng-only" and resume:  # only this child's torch.load: the lab's are unchanged
        torch.load = with_rank0_rng_only(torch.load)
    steps, evaluations, traces, restored, renamed = [0], [], [], [], []
    lesson.evaluate = recording(lesson.evaluate, evaluations, steps)
    lesson.make_dataset = tracing(lesson.make_dataset, traces)
    torch.set_rng_state = course.noting_rng_restores(torch.set_rng_state, restored.append)
    if rank == 0:
        os.replace, os.rename = (recording_rename(f, renamed) for f in (os.replace, os.rename))
    register_optimizer_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    if kill_step and rank == kill_rank:
        at_step(kill_step, kill_self)
    if rank == crash_rank:
        at_step(2, lambda: crash(rank))
    batch_size, lr = DEFAULTS["batch_size"], DEFAULTS["lr"]
    try:  # the lesson's own lines (saved ..., epoch ...) go to a log; the lab prints a summary
        with open(os.path.join(out_dir, f"{run}-rank{rank}.log"), "w") as log, \
                contextlib.redirect_stdout(log):
            model, losses, start = lesson.worker(rank, world_size, port, backend, epochs, batch_size,
                                                 lr, folder, resume, timeout)
    except BaseException:  # print this rank's own error first: mp.spawn may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    evaluations = [(start + step, counts) for step, counts in evaluations]
    trace = traces[0].state() if traces else {"indices": [], "rng": []}
    torch.save({"state": state, "losses": losses, "start": start, "evaluations": evaluations,
                "indices": trace["indices"], "rng": trace["rng"], "restored": restored,
                "renamed": renamed}, os.path.join(out_dir, f"{run}-rank{rank}.pt"))


# ---------------------------------------------------------------- the parent
def steps_per_epoch(world_size, batch_size=DEFAULTS["batch_size"]):
    return -(-(-(-TRAIN // world_size)) // batch_size)  # the sampler pads to ceil(256 / N) a rank


def kill_schedule(world_size, epochs):
    """(resume step, kill step): the first checkpoint after the first evaluation that falls in
    the middle of an epoch; the kill comes 2 steps later. None if the run is too short."""
    per_epoch, total = steps_per_epoch(world_size), epochs * steps_per_epoch(world_size)
    for resume in range(EVERY, total, EVERY):
        if resume > per_epoch and resume % per_epoch:
            return resume, min(resume + 2, total)
    return None


def spawn(run, args, backend, out_dir, folder, resume=None, kill=None, crash_rank=None):
    """One run, one start of the ranks; returns what each rank saved (the crashed run: the exit
    codes). A failed rank stops the others and prints RUN FAILED, as course.spawn_or_fail does."""
    kill_rank = args.world_size - 1
    fn_args = (args.world_size, course.find_free_port(), backend, args.epochs, folder, resume, out_dir,
               run, args.broken, kill, kill_rank, crash_rank, args.timeout)
    context = mp.start_processes(lab_worker, fn_args, args.world_size, join=False, start_method=START)
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    if kill is not None:  # join() stopping the surviving rank is the plan: no warning about it
        spawn_log.setLevel(logging.ERROR)
    try:
        course.join_watching(context, out_dir)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        if kill is None:
            print(f"\nRUN FAILED: a rank stopped with an error, so every rank was stopped.\n{e}",
                  file=sys.stderr)
            cause = course.cause_of_rank_error(str(e))
            if cause:
                course.report_cause(cause, sys.stderr)
            raise SystemExit(1) from None
    finally:
        spawn_log.setLevel(level)
    if kill is not None:  # expected: the killed rank, then join() stopping the others
        return [p.exitcode for p in context.processes]
    return [torch.load(os.path.join(out_dir, f"{run}-rank{r}.pt"), weights_only=True)
            for r in range(args.world_size)]


def steps_in(folder):
    """The steps of the checkpoints in `folder`, from their names (step0000010-<16 hex>.pt)."""
    names = sorted(name for name in os.listdir(folder) if name.endswith(".pt"))
    wrong = [name for name in names if not re.fullmatch(r"step\d{7}-[0-9a-f]{16}\.pt", name)]
    if wrong:  # the lesson's find_checkpoint sorts names: the step must be zero-padded
        course.refuse(f"checkpoint {wrong[0]} is not named step<7-digit step>-<16 hex of sha256>.pt "
                      "(as step0000010-52213e6d78397421.pt): the lab reads the step from the name")
    return [int(name[4:11]) for name in names]


def evaluate_alone(state):
    """One process, the plain model, every held-out sample: the reference count."""
    held_out = Subset(lesson.make_dataset(TRAIN + HELD_OUT), range(TRAIN, TRAIN + HELD_OUT))
    model = lesson.make_model()
    model.load_state_dict(state)
    model.eval()
    x, y = (torch.stack(t) for t in zip(*held_out))
    with torch.no_grad():
        return [int((model(x).argmax(1) == y).sum()), len(y)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'sampler_checkpoint')
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2 of the uninterrupted run: "
                   "the whole run must stop within seconds with that rank's own error")
    course.add_timeout_flag(p)
    args = p.parse_args(argv)
    if min(args.world_size, args.epochs) < 1 or args.timeout <= 0:
        course.refuse("--world-size, --epochs and --timeout must be positive")
    if args.world_size > TRAIN:
        course.refuse(f"--world-size {args.world_size}: more ranks than the {TRAIN} training samples")
    if kill_schedule(args.world_size, args.epochs) is None:
        course.refuse(f"{args.epochs} epoch(s) of {steps_per_epoch(args.world_size)} steps leave no "
                      f"checkpoint (every {EVERY} steps) after the first evaluation in the middle of "
                      "an epoch to resume from: use more --epochs")
    course.refuse_bad_crash_rank(args.crash_rank, args.world_size)
    return args


def main(argv=None):
    args = parse_args(argv)
    if START == "forkserver":
        multiprocessing.set_forkserver_preload(["__main__", "torch._dynamo"])
    backend, _, reason = course.backend_for(args.world_size, args.device)
    _, kill_step = kill_schedule(args.world_size, args.epochs)
    per_epoch = steps_per_epoch(args.world_size)
    print(f"backend: {backend} ({reason}); world size {args.world_size}; global batch "
          f"{args.world_size} x {DEFAULTS['batch_size']}; {args.epochs} epochs of {per_epoch} steps; "
          f"a checkpoint every {EVERY} steps and at the end"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    show_sampler()
    config = {"world_size": args.world_size, "batch_size": DEFAULTS["batch_size"], "lr": DEFAULTS["lr"]}
    with tempfile.TemporaryDirectory(prefix="prove04_") as out_dir:
        straight, crashed = os.path.join(out_dir, "uninterrupted"), os.path.join(out_dir, "crashed")
        os.makedirs(straight), os.makedirs(crashed)
        start = time.perf_counter()
        ranks = spawn("uninterrupted", args, backend, out_dir, straight, crash_rank=args.crash_rank)
        print(f"uninterrupted run: {len(ranks[0]['losses'])} steps; evaluated after steps "
              f"{', '.join(str(s) for s, _ in ranks[0]['evaluations'])}; left checkpoints of steps "
              f"{', '.join(map(str, steps_in(straight)))}", flush=True)
        codes = spawn("crashed", args, backend, out_dir, crashed, kill=kill_step)
        killed = args.world_size - 1
        how = (f"signal {signal.Signals(-codes[killed]).name}" if codes[killed] and codes[killed] < 0
               else f"exit code {codes[killed]}")
        print(f"crashed run: rank {killed} killed after step {kill_step} with {how}; the other ranks "
              f"were stopped; left checkpoints of steps {', '.join(map(str, steps_in(crashed)))}")
        path = lesson.find_checkpoint(crashed, config)  # as lesson.main() does, before spawning
        if path is None:
            return course.report_proof(False, "the crashed run left a checkpoint", "none", "one")
        saved_rng = [course.rng_digest(r["cpu"]) for r in torch.load(
            path, map_location="cpu", weights_only=True)["rng"]]
        in_place = sorted(set(n for n in os.listdir(straight) if n.endswith(".pt"))
                          - set(ranks[0]["renamed"]))
        resumed = spawn("resumed", args, backend, out_dir, crashed, resume=path)
        seconds = time.perf_counter() - start
    begin = resumed[0]["start"]
    print(f"resumed run: find_checkpoint chose the checkpoint of step {begin} (its sha256 matches "
          f"its name); trained steps {begin + 1}-{begin + len(resumed[0]['losses'])}")
    dloss = max((abs(a - b) for s, r in zip(ranks, resumed)
                 for a, b in zip(s["losses"][begin:], r["losses"])), default=0.0)
    same_losses = all(s["losses"][begin:] == r["losses"] for s, r in zip(ranks, resumed))
    dw = max(course.max_abs_diff(s["state"], r["state"]) for s, r in zip(ranks, resumed))
    same_weights = all(torch.equal(s["state"][k], r["state"][k]) for s, r in zip(ranks, resumed)
                       for k in s["state"])
    # list(): a learner's evaluate() may return (correct, total) as a tuple, as its docstring says
    counted = [list(ranks[0]["evaluations"][-1][1]), list(resumed[0]["evaluations"][-1][1])]
    alone = [evaluate_alone(ranks[0]["state"]), evaluate_alone(resumed[0]["state"])]
    exact_eval = counted == alone  # each run's count, against one process on that run's weights
    print(f"losses after the resume, {len(resumed[0]['losses'])} steps x {args.world_size} ranks: "
          f"{'identical' if same_losses else 'DIFFERENT'} (max |dloss| {dloss:.1e})")
    print(f"final weights, every rank: {'identical' if same_weights else 'DIFFERENT'} "
          f"(max |dw| {dw:.1e})")
    print("final evaluation, correct of counted: " + "; ".join(
        f"{run} {c[0]} of {c[1]} (one process on its weights: {a[0]} of {a[1]})"
        for run, c, a in zip(("uninterrupted", "resumed"), counted, alone)))
    print(f"training took {seconds:.1f} s (3 runs of {args.world_size} ranks) on {course.hardware()}")
    if args.world_size >= 3 and not same_weights and dw < 1e-6:
        print("note: with 3 or more ranks, the resumed DDP object sums its first step's gradients in "
              "another order (its buckets are not rebuilt yet): see NOTES.md")
    if in_place:
        print(f"checkpoints written in place under their final name (never renamed into place): "
              f"{', '.join(in_place)}")
    passed = same_losses and same_weights and exact_eval and not in_place
    code = course.report_proof(
        passed, f"rank {killed} {course.hard_killed()} after step {kill_step}, resumed from step "
        f"{begin}: losses and weights "
        f"{'bit-identical' if same_losses and same_weights else 'NOT identical'} to an "
        f"uninterrupted run; evaluation counted {counted[0][1]} of {HELD_OUT} samples, "
        f"{'as' if exact_eval else 'NOT as'} one process does",
        f"torch.equal; max |dloss| {dloss:.1e}, max |dw| {dw:.1e}", "0")
    if code:
        likely_cause(ranks, resumed, begin, counted, alone, in_place, saved_rng)
    return code


LINES = {"eval": "shard = Subset(dataset, range(dist.get_rank()", "epoch": "for epoch in range(step",
         "skip": "itertools.islice(loader", "restore": "torch.set_rng_state(state[\"rng\"][rank]",
         "generator": "generator=torch.Generator().manual_seed(0))", "gather": "all_gather_object(rng",
         "tmp": "with open(path + \".tmp\", \"wb\")"}


def likely_cause(ranks, resumed, begin, counted, alone, in_place, saved_rng):
    """The failure's likely cause, from what the three runs measurably did."""
    lines = {k: course.lesson_line("04_sampler_checkpoint/sampler_checkpoint.py", v)
             for k, v in LINES.items()}
    data = [(r, t) for r, (s, m) in enumerate(zip(ranks, resumed))
            for t in range(len(m["indices"])) if t + begin < len(s["indices"])
            and sorted(s["indices"][t + begin]) != sorted(m["indices"][t])] or [None]
    first_rng = [m["rng"][0] if m["rng"] else None for m in resumed]
    expected_rng = [s["rng"][begin] if len(s["rng"]) > begin else None for s in ranks]
    restored = [m["restored"] for m in resumed]
    world = len(ranks)
    return course.diagnose([
        (counted[0][1] != HELD_OUT,
         f"the evaluation counts {counted[0][1]} samples, not the {HELD_OUT} held out: shards "
         f"padded to equal sizes (DistributedSampler pads) count some twice; evaluate unpadded "
         f"shards and all-reduce the counts ({lines['eval']})"),
        (bool(in_place),
         f"checkpoints are written in place under their final name ({(in_place or [''])[0]} was never "
         f"renamed into place): a crash mid-write leaves the newest one damaged; write to a .tmp "
         f"file, fsync, then os.replace ({lines['tmp']})"),
        (data[0] is not None,
         f"the resume reads other samples than the uninterrupted run, from step "
         f"{begin + 1 + (data[0] or (0, 0))[1]} (rank {(data[0] or (0, 0))[0]}): the epoch or the "
         f"position in it is off; resume at epoch step // len(loader) and skip step % "
         f"len(loader) batches ({lines['epoch']}; {lines['skip']})"),
        (world > 1 and any(saved_rng[0] in r and saved_rng[0] != saved_rng[k]
                           for k, r in enumerate(restored) if k > 0),
         f"every resumed rank restores rank 0's RNG state (rank 1 set rank 0's): dropout on "
         f"rank 1 repeats rank 0's masks; save every rank's state (all_gather_object) and "
         f"restore rng[rank] ({lines['gather']}; {lines['restore']})"),
        (any(saved_rng[k] not in r for k, r in enumerate(restored)),
         f"the resumed ranks do not restore their RNG state (no set_rng_state with the saved "
         f"state took effect): dropout draws other masks after the resume; "
         f"torch.set_rng_state(state['rng'][rank]['cpu']) ({lines['restore']})"),
        (first_rng != expected_rng,
         f"the RNG state was restored, then drawn from before the first resumed step (its "
         f"state there differs from the uninterrupted run's): a DataLoader without its own "
         f"generator draws its seed from the global RNG when an epoch starts; give it one "
         f"({lines['generator']})"),
        (counted != alone,
         f"the evaluation's counts differ from one process's on the same weights ({counted} "
         f"against {alone}): compare evaluate() ({lines['eval']})"),
    ], "the resumed run reads the same samples and starts each step from the same RNG state, "
       "yet its losses or weights differ: compare what the checkpoint saves and loads")


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
