"""The lab of lesson 05: torchrun restarts a killed rank's group, and the lesson resumes bit-exact.

    python 05_torchrun_elastic/prove.py                                # the proof
    python 05_torchrun_elastic/prove.py --break no-rng-restore         # the proof FAILS
    python 05_torchrun_elastic/prove.py --break crash-every-attempt    # torchrun gives up: FAILS
    python 05_torchrun_elastic/prove.py --break plain-init --timeout 20  # a study: usually FAILS
    python 05_torchrun_elastic/prove.py --crash-rank 1                 # rank 1 raises at step 2
    python 05_torchrun_elastic/prove.py --out-dir lab05                # keep logs, checkpoints, weights

The claim: under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`, a run whose rank 1 is
SIGKILLed at step 12 of attempt 0 is restarted by torchrun, resumes from its last checkpoint (step
10) by the lesson's own code, and ends with final weights and post-resume losses bit-identical
(torch.equal, tolerance 0) to an uninterrupted run of the same lesson. That reference never
restarts, so the lab starts its ranks itself (forked, with the variables torchrun sets) instead of
paying for a second torchrun launch.

torchrun is launched as `python -m torch.distributed.run` (no `torchrun` needed on PATH). Its entry
point is this file in a worker role that --help does not list: it imports the lesson, installs the
crash (a global optimizer post-step hook), calls lesson.main() unchanged and saves what it returns,
one file per rank; the launching process compares the files.
"""
import argparse
import contextlib
import datetime
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("torchrun_elastic", needs=(  # or the file given with --lesson PATH
    "choose_backend", "find_checkpoint", "init_distributed", "main", "train"))

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # = the `torchrun` console script
WORLD, KILLED_RANK, TRAIN = 2, 1, 256  # 2 ranks on this node; lesson.main trains on 256 samples
DEFAULTS = {k: p.default for k, p in inspect.signature(lesson.main).parameters.items()}
EVERY = course.default_of(lesson.train, "every", "torchrun_elastic.py")  # steps between checkpoints
BREAKS = {
    "no-rng-restore": "the resumed ranks do not restore their RNG states (torch.set_rng_state is a "
                      "no-op): dropout draws other masks after the restart",
    "plain-init": "lesson.init_distributed becomes the tutorials' plain init_process_group("
                  "init_method='env://') on torchrun's shared store: a study, it failed 9 restarts "
                  "in 10 here (NOTES.md) but can pass by luck",
    "crash-every-attempt": "rank 1 dies at the same step in every attempt, as a real bug does: "
                           "torchrun restarts the group once, then gives up",
}


# ---------------------------------------------------------------- the worker role (under torchrun)
def plain_init(backend, device, timeout):
    """--break plain-init: the line tutorials write, on torchrun's store with no per-attempt prefix."""
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)


def note_where_it_starts(lesson_module, record):
    """Wraps lesson.find_checkpoint and lesson.train (their code unchanged) to note, before the
    first step, which checkpoint this attempt resumed and from which step; returns [step]."""
    find_checkpoint, train, chosen, first = lesson_module.find_checkpoint, lesson_module.train, [], []

    def find_and_keep(*args, **kwargs):
        chosen.append(find_checkpoint(*args, **kwargs))
        if chosen[-1]:  # the RNG states it holds, rank by rank, to check what the resume restores
            saved = torch.load(chosen[-1], map_location="cpu", weights_only=True).get("rng", [])
            note(record, saved_rng=[course.rng_digest(r["cpu"]) for r in saved
                                    if isinstance(r, dict) and "cpu" in r])
        return chosen[-1]

    def train_and_note(*args, **kwargs):
        first.append(inspect.signature(train).bind(*args, **kwargs).arguments["step"])
        note(record, resumed_from=chosen[0] if chosen else "never called", start=first[0])
        return train(*args, **kwargs)
    lesson_module.find_checkpoint, lesson_module.train = find_and_keep, train_and_note
    return first


def note(path, **fields):
    """Adds fields to this rank's JSON record of this attempt (the parent tells the story from it)."""
    record = json.load(open(path)) if os.path.exists(path) else {}
    record.update(fields)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def steps_on_disk(folder):
    return [int(name[4:11]) for name in sorted(os.listdir(folder)) if re.fullmatch(r"step\d{7}-\w+\.pt", name)]


def torchrun_worker(settings):
    """One rank of one attempt: the lesson's main(), unchanged but for --break and the crash."""
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    out_dir, run, broken = settings["out_dir"], settings["run"], settings["broken"]
    record = os.path.join(out_dir, f"{run}-attempt{attempt}-rank{rank}.json")
    note(record, pid=os.getpid())  # lets the parent stop this process if torchrun hangs
    stacks = os.path.join(out_dir, f"{run}-stacks-attempt{attempt}")
    os.makedirs(stacks, exist_ok=True)
    course.dump_stacks_on_signal(stacks, rank)  # a hang's report: where this rank waits
    if broken == "no-rng-restore":  # the lesson calls them only when it resumes
        torch.set_rng_state = torch.cuda.set_rng_state = lambda *args, **kwargs: None
    if broken == "plain-init":
        lesson.init_distributed = plain_init
    # which saved state took effect, for the diagnosis
    torch.set_rng_state = course.noting_rng_restores(
        torch.set_rng_state, lambda digest: note(record, restored=digest))
    first, done = note_where_it_starts(lesson, record), [0]

    def after_each_step(optimizer, args, kwargs):
        done[0] += 1
        step = first[0] + done[0]
        if rank == settings["crash_rank"] and done[0] == 2:
            raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")
        # Once: on attempt 0, and (TORCHELASTIC_RESTART_COUNT is counted per node, and a c10d node
        # restarted by another's failure keeps 0) only if no rank has died yet: a marker file says so.
        killed = os.path.join(out_dir, f"{run}-killed")
        if rank == KILLED_RANK and step == settings["kill_step"] and (
                broken == "crash-every-attempt" or attempt == 0 and not os.path.exists(killed)):
            open(killed, "w").close()
            note(record, killed_after_step=step, on_disk=steps_on_disk(settings["folder"]))
            course.hard_kill(os.getpid())  # SIGKILL: no exception, no finally, as the OOM killer
    register_optimizer_step_post_hook(after_each_step)
    try:
        model, losses, start = lesson.main(settings["epochs"], DEFAULTS["batch_size"],
                                           DEFAULTS["lr"], settings["folder"], settings["timeout"])
    except BaseException as e:  # noted for the story; torchrun's log has the whole traceback
        note(record, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    note(record, steps=len(losses))
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"state": state, "losses": losses, "start": start, "attempt": attempt},
               os.path.join(out_dir, f"{run}-rank{rank}.pt"))


# ---------------------------------------------------------------- the parent
def steps_per_epoch(batch_size=DEFAULTS["batch_size"]):
    return -(-(-(-TRAIN // WORLD)) // batch_size)  # the sampler gives each rank ceil(256 / 2)


def kill_schedule(epochs):
    """(resume step, kill step): the last checkpoint that leaves 2 steps to train after it; the
    kill comes 2 steps later (10 and 12 for 2 epochs of 8 steps). None if there is none."""
    total = epochs * steps_per_epoch()
    resumes = [s for s in range(EVERY, total - 1, EVERY)]
    return (resumes[-1], resumes[-1] + 2) if resumes else None


def stop(proc, out_dir, run):
    """A launch that ran past its limit: torchrun stops its workers on SIGTERM; any left get SIGKILL
    (torchrun starts each worker in a session of its own, so the pids come from their records).
    On Windows, terminate() and course.hard_kill are both TerminateProcess."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for name in os.listdir(out_dir):
        if name.startswith(f"{run}-attempt") and name.endswith(".json"):
            try:
                course.hard_kill(json.load(open(os.path.join(out_dir, name)))["pid"])
            except (OSError, KeyError, ValueError):
                pass


def refuse_without_torchrun():
    """torchrun's rendezvous (torch 2.15) creates its TCPStore with libuv, which PyTorch's Windows
    builds lack (pytorch/pytorch#178600): one line now, rather than torchrun's traceback later."""
    try:
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    except RuntimeError as e:
        if "libuv" not in str(e):
            raise
        course.refuse(f"torchrun cannot start here ({course.platform_name()}: this torch has no "
                      "libuv, which torchrun's rendezvous asks for); run this lab on Linux or WSL2")


def settings_for(run, args, out_dir, kill_step=None, crash_rank=None):
    """What a worker of one run needs; its checkpoint folder is made here, empty."""
    folder = os.path.join(out_dir, f"{run}-checkpoints")
    os.makedirs(folder)
    return {"run": run, "out_dir": out_dir, "folder": folder, "epochs": args.epochs,
            "timeout": args.timeout, "broken": args.broken if run == "crashed" else None,
            "kill_step": kill_step, "crash_rank": crash_rank}


def uninterrupted_rank(rank, port, settings):
    """A rank of the reference run, forked by course.spawn_or_fail: the variables torchrun would
    set (one thread per process, as torchrun sets too), then the same worker role."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RESTART_COUNT="0")
    torch.set_num_threads(1)
    log = os.path.join(settings["out_dir"], f"{settings['run']}.log")
    with open(log, "a") as out, contextlib.redirect_stdout(out):  # as torchrun's launch: to a file
        torchrun_worker(settings)


def launch(run, args, out_dir, max_restarts, kill_step, crash_rank=None):
    """One torchrun launch of this file's worker role; returns (exit code or None if it hung,
    seconds, torchrun's stderr). The lesson's own lines are in {run}.log in the out dir."""
    settings = settings_for(run, args, out_dir, kill_step, crash_rank)
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", str(WORLD), "--max-restarts",
               str(max_restarts), os.path.abspath(__file__), "--as-torchrun-worker", json.dumps(settings)]
    start = time.perf_counter()
    with open(os.path.join(out_dir, f"{run}.log"), "w") as log, \
            open(os.path.join(out_dir, f"{run}.err"), "w+") as err:
        proc = subprocess.Popen(command, stdout=log, stderr=err, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            code = wait_watching(proc, out_dir, run, 2 * args.timeout + 60)
        except subprocess.TimeoutExpired:
            stop(proc, out_dir, run)
            code = None
        except BaseException:  # Ctrl-C: torchrun got it too and stops its workers
            stop(proc, out_dir, run)
            raise
        err.seek(0)
        return code, time.perf_counter() - start, err.read()


HANGS = {}  # run: (the hang's report, its likely cause), when the lab stopped a hung launch


def wait_watching(proc, out_dir, run, limit):
    """proc.wait(limit), watching the workers of the newest attempt (pids from their records): all
    of them idle for course.STALL_SECONDS is a hang, named (course.HangWatch) and stopped."""
    deadline, watches = time.monotonic() + limit, {}
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, limit)
        found = attempts(out_dir, run)
        if found:
            attempt = max(found)
            pids = {r: rec["pid"] for r, rec in found[attempt].items() if "pid" in rec}
            live = {r: p for r, p in pids.items() if course.cpu_seconds(p) is not None}
            stacks = os.path.join(out_dir, f"{run}-stacks-attempt{attempt}")
            watch = watches.setdefault(attempt, course.HangWatch(stacks))
            if len(pids) == WORLD and live and watch.stalled(live):
                HANGS[run] = watch.name_the_hang(live, {r: "?" for r in pids if r not in live})
                stop(proc, out_dir, run)
                return None
        time.sleep(0.5)
    return proc.returncode


def attempts(out_dir, run):
    """{attempt: {rank: record}} from the workers' JSON records."""
    found = {}
    for name in sorted(os.listdir(out_dir)):
        m = re.fullmatch(re.escape(run) + r"-attempt(\d+)-rank(\d+)\.json", name)
        if m:
            found.setdefault(int(m[1]), {})[int(m[2])] = json.load(open(os.path.join(out_dir, name)))
    return found


def tell_attempts(out_dir, run, stderr):
    """One line per attempt (who died where, what it resumed from), and torchrun's reaction."""
    failures = re.findall(r"exitcode\s*:\s*(-?\d+)\)\s*local_rank\s*:\s*(\d+)", stderr)  # its log
    found = attempts(out_dir, run)
    for attempt, ranks in sorted(found.items()):
        record = ranks.get(0, {})
        start = record.get("start")
        parts = [f"{run} run, attempt {attempt}:"]
        if record.get("resumed_from"):
            parts.append(f"find_checkpoint chose the checkpoint of step {start};")
        elif "start" in record:
            parts.append("no checkpoint, from step 0;")
        killed = any("killed_after_step" in r for r in ranks.values())
        for rank, r in sorted(ranks.items()):
            # A peer of a SIGKILLed rank may raise "Connection closed by peer" before torchrun
            # stops it, or not: a race, and only the consequence, so the story leaves it out.
            if "error" in r and not killed:
                parts.append(f"rank {rank} failed{'' if 'start' in r else ' before training'}: "
                             f"{r['error'][:160]};")
            if "killed_after_step" in r:
                on_disk = ", ".join(map(str, r["on_disk"])) or "none"
                parts.append(f"rank {rank} {course.hard_killed()} after step "
                             f"{r['killed_after_step']} (checkpoints on disk: steps {on_disk});")
        if "steps" in record:
            parts.append(f"trained steps {start + 1}-{start + record['steps']}")
        if len(parts) == 1:
            parts.append("the ranks started but never reached their first step")
        print(" ".join(parts).rstrip(";"))
        if attempt < len(failures):
            code, rank = failures[attempt]
            name = f" = {signal.Signals(-int(code)).name}" if int(code) < 0 else ""
            print(f"  torchrun saw local rank {rank} fail (exitcode {code}{name}), stopped the other "
                  + ("rank and restarted the group" if attempt + 1 in found else "rank and gave up"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'torchrun_elastic')
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2: 16 steps)")
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2 of one launch with no "
                   "restarts: the whole run must stop within seconds with that rank's own error")
    p.add_argument("--timeout", type=float, default=60, help="process group timeout in seconds: a stuck "
                   "collective raises on gloo; on NCCL the watchdog aborts the process (default 60); "
                   "a launch is stopped after 2 x this + 60 s")
    p.add_argument("--out-dir", help="keep every file here (a new or empty folder): torchrun's logs, "
                   "both runs' checkpoint folders, each rank's final weights (default: a temporary folder)")
    p.add_argument("--as-torchrun-worker", metavar="SETTINGS", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_torchrun_worker:
        return args
    if args.epochs < 1 or args.timeout <= 0:
        course.refuse("--epochs and --timeout must be positive")
    course.refuse_bad_crash_rank(args.crash_rank, WORLD)
    if args.crash_rank is not None and args.broken:
        course.refuse("--crash-rank runs one launch that must stop; it takes no --break")
    if args.out_dir and os.path.exists(args.out_dir) and (
            not os.path.isdir(args.out_dir) or os.listdir(args.out_dir)):
        course.refuse(f"--out-dir {args.out_dir} is not a new or empty folder: the runs there would "
                      "resume from its checkpoints")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.as_torchrun_worker:
        return torchrun_worker(json.loads(args.as_torchrun_worker))
    refuse_without_torchrun()
    alone = None if args.crash_rank is not None else plain_python(args.timeout)
    if alone:
        course.report_proof(False, "the lesson runs under plain python, as a world of one", alone,
                            "no error")
        course.report_cause(
            f"main() needs torchrun's variables: under plain `python` it raised {alone}; when RANK "
            f"is not set, set a world of one (RANK=0, WORLD_SIZE=1, ...) before reading them "
            f"({lesson_lines()['alone']})")
        return 1
    resume_step, kill_step = kill_schedule(args.epochs)
    backend, reason = lesson.choose_backend(WORLD)
    print(f"backend: {backend} ({reason}); torchrun --standalone --nproc-per-node {WORLD} "
          f"--max-restarts {0 if args.crash_rank is not None else 1}; {args.epochs} epochs of "
          f"{steps_per_epoch()} steps, a checkpoint every {EVERY} steps and at the end"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="prove05_") as scratch:
        out_dir = os.path.abspath(args.out_dir or scratch)
        if args.crash_rank is not None:
            code, _, stderr = launch("uninterrupted", args, out_dir, 0, None, args.crash_rank)
            print(stderr, file=sys.stderr, end="")
            print(f"\nRUN FAILED: torchrun exit {code}: a rank stopped with an error, so torchrun "
                  "stopped every rank (no restarts allowed)", file=sys.stderr)
            return 1
        start = time.perf_counter()
        if args.broken != "crash-every-attempt":  # else no run finishes: nothing to compare with
            course.spawn_or_fail(uninterrupted_rank, (course.find_free_port(),
                                                      settings_for("uninterrupted", args, out_dir)), WORLD)
            print(f"uninterrupted run: {steps_per_epoch() * args.epochs} steps, {WORLD} ranks started "
                  f"by the lab with torchrun's variables ({time.perf_counter() - start:.1f} s)", flush=True)
        reference_s = time.perf_counter() - start
        code, crashed_s, stderr = launch("crashed", args, out_dir, 1, kill_step)
        tell_attempts(out_dir, "crashed", stderr)
        print(f"crashed run: {'hung, stopped' if code is None else f'torchrun exit {code}'} "
              f"({crashed_s:.1f} s)")
        print(f"the {'crashed run' if args.broken == 'crash-every-attempt' else 'two runs'} took "
              f"{reference_s + crashed_s:.1f} s on {course.hardware()}")
        claim = (f"rank {KILLED_RANK} {course.hard_killed()} at step {kill_step}, "
                 "torchrun --max-restarts 1")
        if code != 0:
            print(stderr, file=sys.stderr, end="")
            if "crashed" in HANGS:
                print(f"\nRUN FAILED: {HANGS['crashed'][0]}", file=sys.stderr)
            why = "the launch hung and was stopped" if code is None else f"torchrun gave up (exit {code})"
            course.report_proof(False, f"{claim}: {why}, the run never finished",
                                "no final weights to compare", "0")
            failed_launch_cause(out_dir, stderr)
            return 1
        straight, resumed = ([torch.load(os.path.join(out_dir, f"{run}-rank{r}.pt"), weights_only=True)
                              for r in range(WORLD)] for run in ("uninterrupted", "crashed"))
        found = attempts(out_dir, "crashed")
    start = resumed[0]["start"]
    dloss = max(abs(a - b) for s, r in zip(straight, resumed) for a, b in zip(s["losses"][start:], r["losses"]))
    same_losses = all(s["losses"][start:] == r["losses"] for s, r in zip(straight, resumed))
    dw = max(course.max_abs_diff(s["state"], r["state"]) for s, r in zip(straight, resumed))
    same_weights = all(torch.equal(s["state"][k], r["state"][k]) for s, r in zip(straight, resumed)
                       for k in s["state"])
    print(f"losses of steps {start + 1}-{start + len(resumed[0]['losses'])}, both ranks: "
          f"{'identical' if same_losses else 'DIFFERENT'} (max |dloss| {dloss:.1e})")
    print(f"final weights, both ranks: {'identical' if same_weights else 'DIFFERENT'} (max |dw| {dw:.1e})")
    restarted = resumed[0]["attempt"] >= 1 and start == resume_step
    code = course.report_proof(
        restarted and same_losses and same_weights,
        f"{claim} restarted the group, the lesson resumed from step {start}"
        + ("" if restarted else f" (expected a restart from step {resume_step})")
        + f": final weights {'bit-identical' if same_weights else 'NOT identical'} to an "
        "uninterrupted run", f"torch.equal; max |dw| {dw:.1e}", "0")
    if code:
        resumed_cause(found, start, resume_step, straight, resumed)
    return code


LINES = {"restore": 'torch.set_rng_state(state["rng"][rank]["cpu"]', "prefix": "dist.PrefixStore(",
         "find": "resume = find_checkpoint(folder, config)", "alone": 'if "RANK" not in os.environ'}


def lesson_lines():
    return {k: course.lesson_line("05_torchrun_elastic/torchrun_elastic.py", v)
            for k, v in LINES.items()}


def plain_python(timeout):
    """The lesson's main() in this process, as `python torchrun_elastic.py` runs it (no torchrun
    variables), for one epoch: None, or the error it raised, in one line."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK") or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    try:
        with tempfile.TemporaryDirectory(prefix="alone05_") as folder, \
                contextlib.redirect_stdout(open(os.devnull, "w")):
            lesson.main(1, DEFAULTS["batch_size"], DEFAULTS["lr"], folder, timeout)
        return None
    except (KeyError, TypeError, ValueError) as error:  # a variable read that is not set, before
        if dist.is_initialized():  # the group: measured, not read from the file's text
            raise  # the group was up: another error of the learner's (run_lab names its line)
        return f"{type(error).__name__}: {error}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def failed_launch_cause(out_dir, stderr):
    """Why the crashed run's launch never finished, from the workers' records and torchrun's log."""
    lines, found = lesson_lines(), attempts(out_dir, "crashed")
    killed = [a for a, ranks in found.items() if any("killed_after_step" in r for r in ranks.values())]
    connect = [a for a, ranks in found.items() if a > 0 and any(
        "connect" in r.get("error", "") and "start" not in r for r in ranks.values())]
    never = [(a, r) for a, ranks in found.items() for r, rec in ranks.items()
             if rec.get("resumed_from") == "never called"]
    learner = course.cause_of_rank_error(stderr)
    return course.diagnose([
        (bool(never), f"rank {never[0][1] if never else 0} never called find_checkpoint (attempt "
                      f"{never[0][0] if never else 0}): every rank must find and load the "
                      f"checkpoint before training ({lines['find']})"),
        ("crashed" in HANGS, HANGS.get("crashed", ("", ""))[1]),
        (bool(connect), f"the restarted group could not connect (attempt {(connect or [0])[0]}: "
                        f"a rank failed in init before training) while attempt 0 did: restarted "
                        f"ranks read the dead attempt's addresses from torchrun's store, which "
                        f"outlives a restart; give each attempt its own key prefix "
                        f"({lines['prefix']})"),
        (len(killed) == len(found) > 1,
         f"a rank died at the same step in every attempt ({len(killed)} of {len(found)}): a "
         f"failure that repeats is a bug in the code or the data, which no restart fixes; "
         f"torchrun gave up after --max-restarts"),
        (learner is not None, learner or ""),
    ], f"torchrun gave up; attempts {sorted(found)}: see torchrun's log above")


def resumed_cause(found, start, resume_step, straight, resumed):
    """Why a resumed run that finished is not the uninterrupted one, from the workers' records."""
    lines = lesson_lines()
    last = found.get(max(found), {}) if found else {}
    saved = {r: rec.get("saved_rng") for r, rec in last.items()}
    not_restored = [r for r, rec in last.items() if saved[r] and r < len(saved[r])
                    and rec.get("restored") != saved[r][r]]
    rank0 = [r for r in not_restored if r > 0 and last[r].get("restored") == saved[r][0]]
    step = next((i for i, (a, b) in enumerate(zip(straight[0]["losses"][start:],
                                                  resumed[0]["losses"])) if a != b), None)
    return course.diagnose([
        (start != resume_step, f"the restarted attempt resumed from step {start}, not from the "
                               f"last checkpoint (step {resume_step}): compare find_checkpoint "
                               f"({lines['find']})"),
        (bool(rank0), f"rank(s) {', '.join(map(str, rank0))} restored rank 0's RNG state: "
                      f"restore rng[rank] ({lines['restore']})"),
        (bool(not_restored),
         f"the resumed ranks do not restore their RNG state (rank(s) "
         f"{', '.join(map(str, not_restored))}: no set_rng_state with the saved state took "
         f"effect): dropout draws other masks after the restart ({lines['restore']})"),
    ], f"the resumed run restored every rank's RNG state, yet its losses part from the "
       f"uninterrupted run's at step {start + 1 + (step or 0)}")


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
