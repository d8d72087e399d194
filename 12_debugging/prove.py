"""The lab of lesson 12: plants three hangs and three bugs in the lesson's run, and proves that the
lesson's tools name each one.

    python 12_debugging/prove.py                              # hangs named, divergences located
    python 12_debugging/prove.py --break analyser-unpatched   # torchfrtrace on raw gloo dumps: FAILS
    python 12_debugging/prove.py --break no-stack-dump        # no stacks taken while hung: FAILS
    python 12_debugging/prove.py --break float32-tolerance    # no float64 reference: FAILS
    python 12_debugging/prove.py --crash-rank 1               # rank 1 raises at step 2: the run stops

The hangs (each a pair of ranks running the lesson's worker, all three pairs at once, the group's
timeout --timeout s): rank 1 reads one batch fewer (it skips the last step's all-reduce); rank 0
alone all-reduces after training; the ranks all-reduce tensors of 4 and 3 elements. Each must be
named from the files the lesson writes and the stacks taken while it hangs: the rank missing
(flight recorder), the collective and its sequence number, each rank's line (py-spy, else
faulthandler), within 30 s. The divergences (two ranks, step 1 against one process, the lesson's
compare): the correct run in float32 and float64, and three bugs the course taught: gradients
summed, not averaged; the norm's gradient never all-reduced (the sequence-parallel mistake); a
sampler seeded per rank. Each bug must be named at its layer; the correct run, nowhere.
"""
import argparse
import contextlib
import io
import logging
import os
import pickle
import re
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("debugging", needs=(  # or the file given with --lesson PATH
    "dump_flight_recorder", "trace_step", "train", "worker", "compare"))

LESSON_FILE = "12_debugging/debugging.py"
# torchfrtrace's analyser reads gloo's dumps from torch 2.15 (checked); 2.11's asserts on their op
# names ("name formatting error? gloo != 'nccl' or 'xccl'"): the lab's own reading names the hang
ANALYSER_READS_GLOO = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15)
WITHIN = 30  # seconds: a hang must be named and over by then
BATCH, LR = 16, 0.05
HANGS = {
    "skip": "rank 1 reads one batch fewer, so it skips the last step's all-reduce",
    "rank0-only": "rank 0 alone all-reduces after training (a collective inside `if rank == 0`)",
    "shape": "rank 0 all-reduces 4 elements, rank 1 only 3",
}
BUGS = {
    "no-average": "DDP's gradients summed over the ranks, not averaged",
    "norm-not-reduced": "the norm's gradient never all-reduced (sequence parallelism's mistake, "
                        "planted in DDP: the norm left out of its all-reduce)",
    "sampler": "a sampler seeded per rank: the ranks read other samples than one process",
}
# what the tools must name: (the rank missing, the op, rank 0's line, rank 1's line); a line is
# a text of the lesson's file (lesson_line finds it)
EXPECTED = {"skip": ({1}, "all_reduce", "loss.backward()", "dist.monitored_barrier("),
            "rank0-only": ({1}, "all_reduce", "losses = train(", "dist.monitored_barrier("),
            "shape": (set(), "all_reduce", "losses = train(", "dist.monitored_barrier(")}
# what compare must name first, rank by rank: the sampler seeded seed + rank is right on rank 0 by
# chance, which sees the bug first in the averaged gradient; rank 1 at its input
FIRST_APART = {None: [None, None], "no-average": ["gradient of 3.bias"] * 2,
               "norm-not-reduced": ["gradient of 1.bias"] * 2,
               "sampler": ["gradient of 3.bias", "input"]}
BREAKS = {
    "analyser-unpatched": "torchfrtrace's analyser reads the gloo dumps as they are: its KeyError "
                          "('0', 0) ends it, and it names nothing",
    "no-stack-dump": "no stack is taken while the ranks hang (neither py-spy nor SIGUSR1): no "
                     "rank's line is named",
    "float32-tolerance": "compare's reference is never computed in float64 (its trace_step "
                         "runs in float32): the tolerance is float32 against itself, zero",
}


# --- the plants: the lesson's functions wrapped inside the spawned ranks, never edited ---------

def plant_hang(plant, rank):
    if plant == "skip" and rank == 1:
        make_loader = lesson.DataLoader
        lesson.DataLoader = lambda *a, **k: FewerBatches(make_loader(*a, **k))
    elif plant in ("rank0-only", "shape"):
        train = lesson.train

        def train_then_all_reduce(*args):
            losses = train(*args)
            if plant == "rank0-only" and rank == 0:
                dist.all_reduce(torch.ones(1))  # rank 0 averages its accuracy, alone
            elif plant == "shape":
                dist.all_reduce(torch.ones(4 if rank == 0 else 3))  # counts of 4 or 3 classes
            return losses
        lesson.train = train_then_all_reduce


class FewerBatches:
    """A loader that yields one batch fewer than the one it wraps (and has its sampler)."""

    def __init__(self, loader):
        self.loader, self.sampler = loader, loader.sampler

    def __iter__(self):
        return iter(list(self.loader)[:-1])


def plant_bug(bug, rank):
    """Wraps the lesson's functions in this rank (the comparison is the lesson's own)."""
    if bug == "no-average":
        make_ddp = lesson.DDP

        def summing_ddp(module, **kwargs):
            model = make_ddp(module, **kwargs)
            model.register_comm_hook(None, lambda state, bucket: dist.all_reduce(
                bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0]))
            return model
        lesson.DDP = summing_ddp
    elif bug == "norm-not-reduced":
        make_model = lesson.make_model

        def norm_left_out(**kwargs):
            model = make_model(**kwargs)
            lesson.DDP._set_params_and_buffers_to_ignore_for_model(model, ["1.weight", "1.bias"])
            return model
        lesson.make_model = norm_left_out
    elif bug == "sampler":
        sampler = lesson.DistributedSampler
        lesson.DistributedSampler = lambda dataset, num_replicas, rank, seed: sampler(
            dataset, num_replicas=num_replicas, rank=rank, seed=seed + rank)


# --- what the ranks run -------------------------------------------------------------------------

def hang_child(index, plants, ports, folder, timeout):
    """Process `index` of the hangs: rank index % 2 of the pair index // 2, which runs the
    lesson's worker with its plant. The group's timeout ends it; what it raised is saved."""
    plant, rank = plants[index // 2], index % 2
    plant_hang(plant, rank)
    with course.quiet_logger("torch.distributed"):
        try:
            lesson.worker(rank, 2, ports[index // 2], "gloo", 1, BATCH, LR,
                          os.path.join(folder, plant), "float32", timeout)
            error = ""
        except Exception as e:  # the timeout the lab waits for
            error = f"{type(e).__name__}: {e}"
    with open(os.path.join(folder, plant, f"error-rank{rank}.txt"), "w") as f:
        f.write(error)


def divergence_child(rank, configs, ports, folder, crash_rank):
    """Each configuration in turn, a process group of its own: the lesson's worker, its step 1
    traced to folder/NAME; the bug planted for that run only."""
    if crash_rank == rank:
        course.crash_at_step(rank, 2)
    for (name, bug, dtype), port in zip(configs, ports):
        saved = {k: getattr(lesson, k) for k in ("DDP", "make_model", "DistributedSampler")}
        plant_bug(bug, rank)
        try:
            lesson.worker(rank, 2, port, "gloo", 1, BATCH, LR, os.path.join(folder, name), dtype)
        finally:
            for k, v in saved.items():
                setattr(lesson, k, v)


# --- the hangs, watched from here -------------------------------------------------------------

def run_hangs(folder, timeout, broken):
    """Starts the three pairs; when every rank has idled 1.5 s, takes each rank's stacks (py-spy,
    else SIGUSR1 and faulthandler); then waits for the group's timeout to end them. Returns
    {plant: {"seconds", "stacks": {rank: (collective, line, tool)}, "errors": {rank: text}}}."""
    plants = list(HANGS)
    for plant in plants:
        os.makedirs(os.path.join(folder, plant))
    if course.START_METHOD == "forkserver":
        mp.set_forkserver_preload(["__main__", "torch._dynamo"])
    start = time.monotonic()
    context = mp.start_processes(course.as_a_fresh_process, nprocs=2 * len(plants), join=False,
                                 args=(hang_child, folder, plants, course.find_free_ports(3),
                                       folder, timeout), start_method=course.START_METHOD)
    watch, stacks, ended, named_at = course.HangWatch(folder, stall=1.5), {}, {}, None
    try:
        while not context.join(timeout=0.2):
            alive = {i: p.pid for i, p in enumerate(context.processes) if p.is_alive()}
            for k in range(len(plants)):
                if k not in ended and not {2 * k, 2 * k + 1} & set(alive):
                    ended[k] = (time.monotonic() - start, time.time())
            if named_at is None and len(alive) == len(context.processes) and all(
                    os.path.exists(os.path.join(folder, plant, f"trace-rank{r}.pt"))
                    for plant in plants for r in (0, 1)) and watch.stalled(alive):  # trained, idle
                stacks = {plant: take_stacks(alive, folder, k, plant, broken)
                          for k, plant in enumerate(plants)}
                named_at = time.monotonic() - start
                if any(w[0] == "a wait outside torch.distributed" for found in stacks.values()
                       for w in found.values()):  # a rank starved of CPU, not hung: look again
                    named_at, watch.seen = None, {}
            if time.monotonic() - start > timeout + 60:
                raise SystemExit("the hangs did not end at the group's timeout")
    finally:
        for p in context.processes:
            if p.is_alive():
                course.hard_kill(p.pid)
    ended = {**{k: (time.monotonic() - start, time.time()) for k in range(len(plants))}, **ended}
    return {plant: {"seconds": ended[k][0], "ended": ended[k][1], "named_at": named_at,
                    "stacks": stacks.get(plant, {}),
                    "errors": {
        r: open(os.path.join(folder, plant, f"error-rank{r}.txt")).read() for r in (0, 1)}}
        for k, plant in enumerate(plants)}


def take_stacks(alive, folder, pair, plant, broken):
    """{rank: (collective, line, tool)} for the pair's two ranks, read while they hang."""
    pids = {r: alive[2 * pair + r] for r in (0, 1)}
    if broken == "no-stack-dump":
        return {}
    found = {r: (text, "py-spy") for r, text in course.py_spy_stacks(pids).items()}
    left = {r: pid for r, pid in pids.items() if r not in found}
    found.update({r: (text, "faulthandler") for r, text in
                  course.faulthandler_stacks(left, os.path.join(folder, plant)).items()})
    return {r: (*course.where_it_waits(text), tool) for r, (text, tool) in found.items()}


# --- the flight recorder's dumps ----------------------------------------------------------------

def read_dumps(folder):
    """{rank: the flight recorder's dump (a dict)} from the fr-rank* files the lesson wrote."""
    dumps = {}
    for rank in (0, 1):
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"fr-rank{rank}"), "rb") as f:
                dumps[rank] = pickle.load(f)
    return dumps


def first_mismatch(dumps):
    """The first collective sequence number the ranks do not agree on: (seq, {rank: (op, sizes,
    line)}, the ranks that never called it), or None. The line: the innermost frame outside torch
    and the standard library (the lesson's, or the lab's for a plant)."""
    by_rank = {r: {e["collective_seq_id"]: e for e in d.get("entries", [])
                   if not e.get("is_p2p")} for r, d in dumps.items()}
    for seq in sorted(set().union(*map(set, by_rank.values()))):
        calls = {r: entries[seq] for r, entries in by_rank.items() if seq in entries}
        kinds = {(e["profiling_name"], str(e["input_sizes"])) for e in calls.values()}
        if len(calls) < len(by_rank) or len(kinds) > 1:
            return seq, {r: (e["profiling_name"].split(":")[-1], e["input_sizes"], frame_line(e),
                             e["time_created_ns"]) for r, e in calls.items()}, \
                set(by_rank) - set(calls)
    return None


def frame_line(entry):
    for f in entry.get("frames", []):
        if not f["filename"].startswith(course.TORCH_DIR) and "/lib/python" not in f["filename"] \
                and "multiprocessing" not in f["filename"]:
            return f"{os.path.basename(f['filename'])} line {f['line']} ({f['name']})"
    return None


def analyse(folder, broken):
    """torchfrtrace's analyser (torch.distributed.flight_recorder) on the dumps, in-process: (the
    sequence numbers it says have errors, its first lines, or the error that stopped it).
    Gloo's dumps key their group '' in pg_config, where their entries say '0' (default_pg), and
    build_collectives looks the group up by the entries' key: KeyError ('0', 0). The rewrite below
    gives pg_config the entries' key; --break analyser-unpatched leaves it out."""
    lines, collect = [], logging.Handler()
    collect.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("Flight Recorder")
    saved = logger.handlers[:]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:  # its import warns, on the logger, that tabulate is not installed
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
            from torch.distributed.flight_recorder.components.loader import read_dir
            saved = saved or logger.handlers[:]
            args = JobConfig().parse_args([folder, "--prefix", "fr-rank"])
            details, version = read_dir(args)
            logger.handlers = [collect]
            if broken != "analyser-unpatched":
                for dump in details.values():  # the workaround: '' -> the entries' group name
                    names = {e["process_group"][0] for e in dump["entries"]}
                    if "" in dump["pg_config"] and len(names) == 1:
                        dump["pg_config"][names.pop()] = dump["pg_config"].pop("")
            build_db(details, args, version)
            error = None
        except Exception as e:  # noqa: BLE001 (what stopped the analyser is the measurement)
            error = f"{type(e).__name__}: {e}"
        finally:
            logger.handlers = saved
    seqs = [int(m[1]) for m in (re.search(r"sequence number: (\d+)", ln) for ln in lines) if m]
    return seqs, lines, error


# --- the divergences --------------------------------------------------------------------------

def configurations():
    """(name, bug, dtype): the correct run in float32 and float64, each bug in both."""
    return [("correct-float32", None, "float32"), ("correct-float64", None, "float64")] + [
        (f"{bug}-{dtype}", bug, dtype) for bug in BUGS for dtype in ("float32", "float64")]


def largest_gap(folder, dtype):
    """The largest difference, over every entry and rank, between a run's step 1 and one process
    in the same dtype: what compare tests against its tolerances, for the report."""
    dataset = lesson.make_dataset()
    rows = sum([list(lesson.DistributedSampler(dataset, 2, r, seed=0))[:BATCH] for r in (0, 1)],
               [])
    x, y = dataset[rows]
    d = getattr(torch, dtype)
    ref = lesson.trace_step(lesson.make_model(dtype=d), x.to(d), y)[1]
    gap = 0.0
    for r in (0, 1):
        trace = torch.load(os.path.join(folder, f"trace-rank{r}.pt"), map_location="cpu",
                           weights_only=True)
        for k, v in trace.items():
            want = ref[k] if k.startswith("gradient") else ref[k][r * BATCH:(r + 1) * BATCH]
            gap = max(gap, (v.double() - want.double()).abs().max().item())
    return gap


def run_divergences(folder, broken, crash_rank):
    configs = configurations()
    for name, _, _ in configs:
        os.makedirs(os.path.join(folder, name))
    start = time.monotonic()
    course.spawn_or_fail(divergence_child, (configs, course.find_free_ports(len(configs)), folder,
                                            crash_rank), 2)
    ranks_seconds = time.monotonic() - start
    results = {}
    trace_step = lesson.trace_step
    if broken == "float32-tolerance":  # the reference never in float64: a tolerance of zero
        lesson.trace_step = lambda model, x, y: in_float32(trace_step, model, x, y)
    try:
        for name, bug, dtype in configs:
            with contextlib.redirect_stdout(io.StringIO()) as said:
                found = lesson.compare(os.path.join(folder, name), 2, BATCH, dtype)
            results[name] = {"bug": bug, "dtype": dtype, "found": found, "said": said.getvalue(),
                             "gap": largest_gap(os.path.join(folder, name), dtype)}
    finally:
        lesson.trace_step = trace_step
    return results, ranks_seconds


def in_float32(trace_step, model, x, y):
    """--break float32-tolerance: a step traced in float32 whatever its dtype, returned in it."""
    loss, trace = trace_step(model.float(), x.float(), y)
    return loss.to(x.dtype), {k: v.to(x.dtype) for k, v in trace.items()}


# --- the report ---------------------------------------------------------------------------------

def check_hang(plant, run, folder, broken):
    """(named correctly?, the report line, what failed)."""
    missing, op, line0, line1 = EXPECTED[plant]
    dumps = read_dumps(os.path.join(folder, plant))
    mismatch = first_mismatch(dumps)
    seqs, lines, error = analyse(os.path.join(folder, plant), broken)
    want_lines = {0: course.lesson_line(LESSON_FILE, line0), 1: course.lesson_line(LESSON_FILE, line1)}
    stacks = run["stacks"]
    wrong = []
    if not dumps:
        wrong.append("no flight recorder dump was written (no fr-rank file)")
    elif mismatch is None:
        wrong.append("the flight recorder shows no collective apart")
    else:
        seq, calls, absent = mismatch
        if absent != missing or any(c[0] != op for c in calls.values()):
            wrong.append(f"the flight recorder names {absent or 'no'} missing rank at #{seq}")
        if seq not in seqs and ANALYSER_READS_GLOO:
            wrong.append("torchfrtrace names " + (f"#{seqs}" if seqs else f"nothing ({error})"))
    for r in (0, 1):
        got = stacks.get(r, (None, None, None))[1] or ""
        if not got.startswith(want_lines[r]):
            wrong.append(f"rank {r}'s line is {got or 'unnamed'}, not {want_lines[r]}")
    hung = None
    if mismatch:
        seq, calls, absent = mismatch
        hung = run["ended"] - min(c[3] for c in calls.values()) / 1e9
        what = "; ".join(f"rank {r}: {c[0]} {c[1]} at {c[2]}" for r, c in sorted(calls.items()))
        named = (f"#{seq} {op}: " + (f"rank(s) {sorted(absent)} never called it; " if absent
                                     else "sizes differ; ") + what
                 + (f" (torchfrtrace: #{', #'.join(map(str, seqs))})" if seqs else
                    f" (torchfrtrace: {error})" if ANALYSER_READS_GLOO else
                    f" (torchfrtrace not checked: torch {torch.__version__}'s reads only NCCL and XCCL "
                    "dumps; 2.15's reads gloo's)"))
    else:
        named = "nothing"
    if hung is None or hung > WITHIN:
        wrong.append(f"the hang lasted {hung or float('nan'):.0f} s")
    run["hung"] = hung
    where = "; ".join(f"rank {r} waits in {c} at {ln} ({tool})" for r, (c, ln, tool)
                      in sorted(stacks.items())) or "no stacks"
    return not wrong, named, where, wrong


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, "debugging")
    p.add_argument("--part", choices=["both", "hangs", "divergences"], default="both",
                   help="what to prove (default both; a --break runs the part it breaks)")
    p.add_argument("--timeout", type=float, default=8, help="the hangs' process group timeout in "
                   "seconds (default 8; at most 25, for the 30 s a hang may take)")
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2 of the divergence "
                   "runs: the whole run must stop within seconds with that rank's own error")
    args = p.parse_args(argv)
    course.refuse_bad_crash_rank(args.crash_rank, 2)
    if args.broken == "analyser-unpatched" and not ANALYSER_READS_GLOO:
        course.refuse(f"--break analyser-unpatched needs torch 2.15 (checked there): torch "
                      f"{torch.__version__}'s torchfrtrace reads no gloo dump, patched or not")
    if args.broken:
        args.part = "divergences" if args.broken == "float32-tolerance" else "hangs"
    if args.crash_rank is not None:
        args.part = "divergences"
    if args.part != "divergences" and not 2 <= args.timeout <= 25:
        course.refuse("--timeout must be from 2 to 25 seconds: the stacks are taken after 1.5 s "
                      "of quiet, and a hang must be over within 30 s")
    return args


def main(argv=None):
    args = parse_args(argv)
    backend, _, reason = course.backend_for(2, "cpu")
    print(f"backend: {backend} ({reason}: the hangs use gloo's timeout and monitored_barrier); "
          f"2 ranks per run" + (f"; --break {args.broken}: {BREAKS[args.broken]}"
                                if args.broken else ""), flush=True)
    results, tolerances = [], []
    with tempfile.TemporaryDirectory(prefix="prove12_") as folder:
        hangs = None
        if args.part in ("both", "hangs"):  # the pairs hang, idle, while the divergences run
            os.makedirs(os.path.join(folder, "h"))
            hangs = Background(run_hangs, os.path.join(folder, "h"), args.timeout, args.broken)
            tolerances.append(f"{WITHIN} s a hang")
        try:
            if args.part in ("both", "divergences"):
                results.append(prove_divergences(os.path.join(folder, "d"), args))
                tolerances.append("float64 sets each entry's, x 10")
        finally:
            runs = hangs.result() if hangs else None
        if runs:
            results.append(prove_hangs(runs, os.path.join(folder, "h"), args))
    passed = all(r[0] for r in results)
    code = course.report_proof(passed, "; ".join(r[1] for r in results),
                               "; ".join(r[2] for r in results), " and ".join(tolerances))
    if code:
        course.diagnose([c for r in results for c in r[3]], "; ".join(r[2] for r in results))
    return code


class Background(threading.Thread):
    """fn(*args) in a thread; result() joins it and returns what it returned, or raises what it
    raised (the hangs are watched while the divergences run)."""

    def __init__(self, fn, *args):
        super().__init__(daemon=True)
        self.fn, self.args, self.value, self.error = fn, args, None, None
        self.start()

    def run(self):
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # noqa: BLE001 (raised again in result())
            self.error = e

    def result(self):
        self.join()
        if self.error:
            raise self.error
        return self.value


def prove_hangs(runs, folder, args):
    print(f"\nthree hangs, each a pair of ranks (group timeout {args.timeout:g} s), all at once "
          f"(the stacks taken at {next(iter(runs.values()))['named_at'] or 0:.1f} s):\n" + "\n".join(
              f"  {plant}: {what}" for plant, what in HANGS.items()), flush=True)
    ok_all, slowest, causes = True, 0.0, []
    for plant, run in runs.items():
        ok, named, where, wrong = check_hang(plant, run, folder, args.broken)
        ok_all &= ok
        slowest = max(slowest, run["hung"] or float("inf"))
        barrier = next((e for e in run["errors"].values() if "monitoredBarrier" in e), "")
        print(f"  {plant}: hung {run['hung'] or float('nan'):.1f} s (its collective to the "
              f"timeout); the ranks over at {run['seconds']:.1f} s\n"
              f"    flight recorder: {named}\n    stacks: {where}" + (
                  f"\n    monitored_barrier: {barrier.splitlines()[0].split('. Please')[0]}" if barrier
                  else "")
              + (f"\n    WRONG: {'; '.join(wrong)}" if wrong else ""), flush=True)
        for w in wrong:
            if "no flight recorder dump" in w:
                causes.append((True, "no rank wrote its flight recorder when its collective "
                                     "raised (the group's timeout): dump it in an except around "
                                     "the training, then raise again "
                                     f"({course.lesson_line(LESSON_FILE, 'except Exception:')})"))
            if "torchfrtrace" in w and "KeyError" in w:
                causes.append((True, f"torchfrtrace's analyser stops on gloo's dumps ({w}): their "
                                     "pg_config keys the group '' where the entries say '0'; "
                                     "rewrite the key before build_db (prove.py's analyse)"))
            if "unnamed" in w:
                causes.append((True, "no rank's line is named: take the stacks while the ranks "
                                     "hang, py-spy dump --pid, or SIGUSR1 to faulthandler "
                                     f"({course.lesson_line(LESSON_FILE, 'faulthandler.register')})"))
    print(f"on {course.hardware()}")
    claim = (f"each planted hang {'named' if ok_all else 'NOT named'} (missing rank, collective, "
             f"sequence number, each rank's line) within {WITHIN} s")
    return ok_all, claim, f"longest hang {slowest:.1f} s", causes


def prove_divergences(folder, args):
    os.makedirs(folder)
    print("\nstep 1 of two ranks against one process: what the lesson's compare names first",
          flush=True)
    results, seconds = run_divergences(folder, args.broken, args.crash_rank)
    ok_all, causes = True, []
    for name, r in results.items():
        want, got = FIRST_APART[r["bug"]], [f[0] if f else None for f in r["found"]]
        ok = got == want
        ok_all &= ok
        shown = ", ".join(f"rank {k}: {g or 'nothing'}" for k, g in enumerate(got))
        print(f"  {name:<25} {shown:<46} largest gap {r['gap']:.1e}"
              + ("" if ok else f"   WRONG: expected {want}"), flush=True)
    noise32 = results["correct-float32"]["gap"]
    noise64 = results["correct-float64"]["gap"]
    stays = min(results[f"{b}-float64"]["gap"] / results[f"{b}-float32"]["gap"] for b in BUGS)
    vanishes = noise64 < 1e-6 * noise32 if noise32 > 0 else noise64 == 0
    print(f"  reduction-order noise: {noise32:.1e} in float32, {noise64:.1e} in float64 "
          f"({'vanishes' if vanishes else 'STAYS'}); each bug keeps at least {stays:.2f} of its "
          f"float32 gap in float64 ({'stays' if stays > 0.5 else 'VANISHES'})")
    print(f"the ranks ran {len(results)} configurations in {seconds:.1f} s on {course.hardware()}")
    ok_all &= vanishes and stays > 0.5
    if results["correct-float32"]["found"] != [None, None]:
        causes.append((True, "a correct run is named apart: its tolerance is not float64's (one "
                             "process in float32 against float64) but float32 against itself; "
                             f"compute the reference in both ({course.lesson_line(LESSON_FILE, 'for d in (torch.float32')})"))
    claim = (f"each planted bug {'located' if ok_all else 'NOT located'} at its layer, the correct "
             "run nowhere, noise gone in float64")
    return ok_all, claim, f"noise {noise32:.1e} in float32, {noise64:.1e} in float64", causes


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
