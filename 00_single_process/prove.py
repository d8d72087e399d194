"""The lab of lesson 00: runs single_process.py in two fresh processes and proves its claim.

    python 00_single_process/prove.py                         # the proof
    python 00_single_process/prove.py --epochs 5 --batch-size 64
    python 00_single_process/prove.py --break unseeded-data   # data from the global RNG: FAILS
    python 00_single_process/prove.py --break unseeded-model  # weights from the global RNG: FAILS

The claim, which every later proof relies on: two fresh processes that each run the lesson's
main() build byte-identical data sets, start from identical weights, end with bit-identical
weights (tolerance 0), and the loss falls (the last epoch's mean loss is below the first's).
There are no ranks and no process group here, so there is no --crash-rank (lessons 02, 04, 05).
"""
import argparse
import contextlib
import hashlib
import io
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("single_process", needs=(  # or the file given with --lesson PATH
    "main", "make_dataset", "make_model"))

PROCESSES = 2
TOLERANCE = 0.0  # the same program on the same bytes: every bit must agree
BREAKS = {
    "unseeded-data": "the data is drawn from the global RNG before any seed, as lesson 02's "
                     "README once did: each fresh process starts from its own random seed",
    "unseeded-model": "make_model without torch.manual_seed: each process starts from its own weights",
}


def make_dataset_from_global_rng(samples=256, seed=0):
    """--break unseeded-data: torch.randn before any manual_seed (the bug this lab catches)."""
    x = torch.randn(samples, 20)
    return TensorDataset(x, (x @ torch.randn(20, 4)).argmax(dim=1))


def make_model_unseeded(seed=0):
    """--break unseeded-model: the lesson's model, without torch.manual_seed."""
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def fingerprint(dataset):
    """A short digest of a data set's bytes: equal in every process, or they trained on other data."""
    digest = hashlib.sha256()
    for tensor in dataset.tensors:
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:12]


def weights(model):
    """A copy of the model's weights as they are now, on the CPU."""
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def keep_what_it_returns(function, kept, copy=lambda built: built):
    """Wraps a lesson function so that the lab sees what it built (a copy of it: the model's weights
    before training changes them); the lesson's code is unchanged."""
    def wrapper(*args, **kwargs):
        built = function(*args, **kwargs)
        kept.append(copy(built))
        return built
    return wrapper


def lab_worker(index, epochs, batch_size, lr, out_dir, broken):
    """Runs the lesson's main() unchanged (but for --break) in this fresh process, then keeps in a
    file: the data set's fingerprint, the weights at the start and at the end, the losses."""
    seed_at_start = torch.initial_seed()  # before anything seeds: this interpreter's own
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))  # the processes share the cores
    if broken == "unseeded-data":
        lesson.make_dataset = make_dataset_from_global_rng
    if broken == "unseeded-model":
        lesson.make_model = make_model_unseeded
    datasets, start_weights = [], []
    lesson.make_dataset = keep_what_it_returns(lesson.make_dataset, datasets)
    lesson.make_model = keep_what_it_returns(lesson.make_model, start_weights, weights)
    quiet = contextlib.redirect_stdout(io.StringIO()) if index else contextlib.nullcontext()
    try:  # process 0 prints the lesson's log; process 1's would repeat it
        with quiet:
            model, losses = lesson.main(epochs, batch_size, lr)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    torch.save({"seed": seed_at_start, "data": fingerprint(datasets[0]), "start": start_weights[0],
                "end": weights(model), "losses": losses},
               os.path.join(out_dir, f"process{index}.pt"))


def spawn_fresh_or_fail(fn, args, nprocs):
    """mp.spawn, whose start method is always "spawn": each child is a fresh interpreter with a
    global seed of its own, as every rank is in lesson 02. (The labs' course.spawn_or_fail forks
    each child of a forkserver and re-seeds it; this lab shows the real thing: fresh processes.)
    A failed child prints RUN FAILED and exits 1, like course.spawn_or_fail."""
    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"\nRUN FAILED: a process stopped with an error, so both were stopped.\n{e}", file=sys.stderr)
        cause = course.cause_of_rank_error(str(e))  # where a learner's file (--lesson) raised
        if cause:
            course.report_cause(cause, sys.stderr)
        raise SystemExit(1) from None


def run_processes(epochs=2, batch_size=32, lr=0.05, broken=None):
    """Spawns PROCESSES fresh interpreters running lab_worker; returns (what each kept, seconds)."""
    with tempfile.TemporaryDirectory(prefix="prove00_") as out_dir:
        start = time.perf_counter()
        spawn_fresh_or_fail(lab_worker, (epochs, batch_size, lr, out_dir, broken), PROCESSES)
        seconds = time.perf_counter() - start
        return [torch.load(os.path.join(out_dir, f"process{i}.pt"), weights_only=True)
                for i in range(PROCESSES)], seconds


def epoch_means(losses, epochs):
    """The mean loss of each epoch (every epoch has the same number of steps)."""
    steps = len(losses) // epochs
    return [sum(losses[e * steps:(e + 1) * steps]) / steps for e in range(epochs)]


def verdict(processes, epochs):
    """(passed, claim, measured) for what the processes kept."""
    same_data = len({p["data"] for p in processes}) == 1
    at_start = max(course.max_abs_diff(processes[0]["start"], p["start"]) for p in processes)
    at_end = max(course.max_abs_diff(processes[0]["end"], p["end"]) for p in processes)
    means = [epoch_means(p["losses"], epochs) for p in processes]
    falls = all(m[-1] < m[0] for m in means)
    passed = same_data and at_start <= TOLERANCE and at_end <= TOLERANCE and falls
    same = {True: "identical", False: "DIFFERENT"}
    claim = (f"{len(processes)} fresh processes built {same[same_data]} data sets, started from "
             f"{same[at_start <= TOLERANCE]} weights, ended with {same[at_end <= TOLERANCE]} weights, "
             f"and the loss {'fell' if falls else 'did NOT fall'}")
    measured = (f"max |dw| at the start {at_start:.1e}, at the end {at_end:.1e}; mean loss "
                f"epoch 0 {means[0][0]:.4f} -> epoch {epochs - 1} {means[0][-1]:.4f}")
    return passed, claim, measured


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'single_process')
    p.add_argument("--epochs", type=int, default=2, help="passes over the data, 2 or more: the "
                   "proof compares the first epoch's mean loss with the last's (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    course.add_break_flag(p, BREAKS)
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.lr <= 0:
        course.refuse("--batch-size and --lr must be positive")
    if args.epochs < 2:
        course.refuse("--epochs must be 2 or more: the proof compares the first epoch's mean loss "
                      "with the last's")
    return args


def main(argv=None):
    args = parse_args(argv)
    print(f"{PROCESSES} fresh processes (mp.spawn, no process group) each run the lesson's "
          f"main(epochs={args.epochs}, batch_size={args.batch_size}, lr={args.lr})"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    processes, seconds = run_processes(args.epochs, args.batch_size, args.lr, args.broken)
    print(f"{PROCESSES} processes took {seconds:.1f} s (most of it importing torch) on {course.hardware()}")
    print("global seed each process started with: " + ", ".join(str(p["seed"]) for p in processes)
          + " (torch.initial_seed())")
    print("data set sha256: " + ", ".join(p["data"] for p in processes))
    passed, claim, measured = verdict(processes, args.epochs)
    code = course.report_proof(passed, claim, measured, f"{TOLERANCE:g}")
    if code:
        likely_cause(processes, args.epochs)
    return code


def likely_cause(processes, epochs):
    """The last line of a failed proof: which typical mistake the measurements fit (never read
    from the learner's source), else what was measured."""
    where = lambda text: course.lesson_line("00_single_process/single_process.py", text)  # noqa
    first, second = processes[0], processes[-1]
    at_start = course.max_abs_diff(first["start"], second["start"])
    at_end = course.max_abs_diff(first["end"], second["end"])
    moved = course.max_abs_diff(first["start"], first["end"])
    apart = next((i for i, (a, b) in enumerate(zip(first["losses"], second["losses"]), 1)
                  if a != b), None)
    means = epoch_means(first["losses"], epochs)
    measured = (f"data sets {'equal' if first['data'] == second['data'] else 'different'}; "
                f"start weights {at_start:.1e} apart, end weights {at_end:.1e} apart; "
                + (f"the losses part at step {apart}" if apart else "the losses agree at every step")
                + f"; the weights moved {moved:.1e}; mean loss {means[0]:.4f} -> {means[-1]:.4f}")
    course.diagnose([
        (first["data"] != second["data"],
         f"the data set is drawn from the global RNG, seeded differently in each fresh process: "
         f"the {len(processes)} processes built different data sets (their sha256 above); draw "
         f"it from its own generator, "
         f"torch.Generator().manual_seed(seed) ({where('torch.Generator().manual_seed(seed)')})"),
        (at_start > TOLERANCE,
         f"the model is built without torch.manual_seed: the same data, but the {len(processes)} "
         f"processes start {at_start:.1e} apart; seed right before building it "
         f"({where('torch.manual_seed(seed)')})"),
        (at_end > TOLERANCE and apart is not None,
         f"training draws from the global RNG: the same data and start weights, but the losses "
         f"part at step {apart} (a DataLoader without its own generator, dropout from an unseeded "
         f"RNG); give the loader generator=torch.Generator().manual_seed(0) "
         f"({where('generator=torch.Generator().manual_seed(0)')})"),
        (moved == 0.0,
         f"the weights never moved: {len(first['losses'])} losses but max |dw| 0 from the start; "
         f"optimizer.step() after loss.backward(), each step ({where('optimizer.step()')})"),
    ], measured)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    course.exit_now(course.run_lab(main))
