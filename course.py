"""The harness every lab (NN_name/prove.py) shares. Lessons never import this file: each lesson
script stays self-contained, so a reader can copy it alone.

    backend_for(world_size, device)   NCCL with one GPU per rank, else gloo on CPU, and why
    find_free_port()                  a port nobody uses now (never a fixed 12355/29500)
    spawn_or_fail(fn, args, nprocs)   mp.spawn; a failed rank prints RUN FAILED and exits 1
    report_proof(...)                 the PROOF PASSED/FAILED line; returns the exit code
    refuse(message)                   one line on stderr, exit 2: a guard rail, no traceback
    add_break_flag, add_device_flag, add_timeout_flag: the flags every lab spells the same way
    crash_at_step(rank, step)         --crash-rank: this rank raises after its step-th optimizer step
    refuse_bad_crash_rank(r, ranks)   --crash-rank's guard rails: a rank that exists, a step 2 to reach
    hardware()                        the CPU/GPU, cores and torch version that timings ran on
    hard_kill(pid), hard_killed()     kill at once (SIGKILL; TerminateProcess on Windows), in words
    platform_name()                   Linux, macOS or Windows, for a line that refuses
    load_lesson(path)                 another lesson's script as a module: a lab's reference
    quiet_logger(name)                only errors from a logger while inside: a known, harmless line
    report_cause(cause) / report_unknown(measured) / diagnose(candidates, measured)
                                      the line a failure ends with: LIKELY CAUSE: ..., or cause
                                      unknown: what was measured
    lesson_line(path, text)           "name.py line N": the course's line a learner compares with
    run_lab(main)                     a lab's entry point: never a traceback in the lab's own code
                                      because of a learner's file (one line instead)
    exit_now(code)                    sys.exit(code) without the 2 to 4 s of torch's teardown
"""
import atexit
import contextlib
import faulthandler
import importlib.util
import inspect
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import platform
import random
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch.optim.optimizer import register_optimizer_step_post_hook


def refuse(message):
    """A guard rail: bad input ends the run with one clear line and exit code 2, before any rank starts."""
    print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def add_break_flag(parser, breaks, several=False):
    """--break NAME: the lab's ways to break its claim on purpose, {name: what it does}; several:
    --break NAME [NAME ...], a list (a lab whose breaks each fail a claim of their own)."""
    parser.add_argument("--break", dest="broken", choices=sorted(breaks), nargs="+" if several else None,
                        help="break the claim on purpose" + (" (one or several)" if several else "")
                        + ": " + "; ".join(f"{k}: {v}" for k, v in breaks.items()))


def add_device_flag(parser):
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda with NCCL when there is one GPU per rank, else cpu with gloo")


def add_timeout_flag(parser):
    parser.add_argument("--timeout", type=float, default=60, help="process group timeout in seconds: "
                        "a stuck collective raises on gloo; on NCCL the watchdog aborts the process "
                        "(default 60)")


def backend_for(world_size, device="auto"):
    """(backend, device type, reason): NCCL with one process per GPU when there are enough GPUs, else gloo."""
    gpus = torch.cuda.device_count()
    if device == "cuda" and gpus < world_size:
        refuse(f"--device cuda needs one GPU per rank: world size {world_size}, {gpus} GPU(s) visible")
    if device == "cuda" or (device == "auto" and gpus >= world_size):
        return "nccl", "cuda", f"{gpus} GPU(s) visible, one per rank"
    if device == "cpu":
        return "gloo", "cpu", "CPU requested"
    return "gloo", "cpu", "no GPU visible" if gpus == 0 else f"{gpus} GPU(s) for {world_size} ranks"


def load_lesson(path):
    """Another lesson's script (a path under the repository root, e.g. "00_single_process/
    single_process.py") imported as a module, for the reference a lab trains."""
    full = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_lesson(name, needs, argv=None):
    """The lesson a lab proves: `import name` (the file beside the lab), or the learner's file
    given with --lesson PATH, registered as sys.modules[name], its path kept in COURSE_LESSON,
    which the ranks inherit: a rank that imports the lab (forkserver, spawn, torchrun) proves the
    same file. A file that does not import, or lacks a function the lab calls, is one line and
    exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == "--lesson" and i + 1 < len(argv) or arg.startswith("--lesson="):
            given = arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
            os.environ["COURSE_LESSON"] = os.path.abspath(given)
    path = os.environ.get("COURSE_LESSON")
    if not path:  # the lab's own lesson, as `import name` (a notebook that imported it shares it)
        return importlib.import_module(name)
    if not os.path.isfile(path):
        refuse(f"--lesson {path}: no such file")
    return load_lesson_file(path, name, needs, f"{name}.py")


def load_lesson_file(path, name, needs, defined_in, register=True, hint=lambda error: ""):
    """The learner's file at `path`, run as module `name` (registered in sys.modules, so that its
    functions pickle): one line and exit 2 if it does not import (hint(error) may add where to
    look) or lacks a function of `needs`, which the lab calls as `defined_in` defines them."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the learner's file: one line, where and what
        where = traceback.extract_tb(error.__traceback__)[-1]
        line = f" (line {where.lineno})" if where.filename == path else ""
        refuse(f"--lesson {path} does not import: {type(error).__name__}: {error}{line}"
               f"{hint(error)}")
    missing = [n for n in needs if not callable(getattr(module, n, None))]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        refuse(f"--lesson {path} has no {', '.join(missing)}: the lab calls {them} as {defined_in} "
               f"defines {them}")
    return module


def default_of(function, name, defined_in):
    """The default of `function`'s parameter `name`, which the lab reads from the lesson; a file
    whose function has no such parameter (with a default) is one line, exit 2, not a KeyError in
    the lab."""
    parameter = inspect.signature(function).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        refuse(f"{getattr(function, '__name__', 'a function')}() in your file has no parameter "
               f"{name!r} with a default: the lab reads it there, as {defined_in} defines it")
    return parameter.default


def add_lesson_flag(parser, name):
    """--lesson PATH: prove a learner's own file instead of `name`.py (import_lesson reads it)."""
    parser.add_argument("--lesson", metavar="PATH", help=f"prove this file instead of {name}.py "
                        "(your own version of the lesson; the lab grades it)")


def find_free_port():
    return find_free_ports(1)[0]


def find_free_ports(count):
    """`count` different ports, free now, outside the range the OS hands out by itself. Not
    bind-to-0's: the OS hands ports from its own range to every bind to 0 and every outgoing
    connection, so a port it gave us and we closed can go to another process in the seconds before
    rank 0 binds it (CI saw it: EADDRINUSE). Outside that range nobody gets ours by chance. Linux
    says its range in ip_local_port_range (32768-60999 by default; servers often widen it, to
    1024-65535 say): we draw from the 12,768 ports below it, else above it; when it spans every
    port, from 20000-32767, with the race. Elsewhere (macOS, Windows: 49152 and up by default) and
    where the file cannot be read, below 32768."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 65535
    pool = range(max(1024, low - 12768), low) or range(high + 1, 65536) or range(20000, 32768)
    ports = []
    while len(ports) < count:
        port = random.choice(pool)
        with contextlib.suppress(OSError), socket.socket() as s:  # OSError: in use, try another
            s.bind(("", port))
            if port not in ports:
                ports.append(port)
    return ports


def start_method():
    """A forkserver imports torch (and DDP's torch._dynamo) once and forks every rank from it: N
    ranks cost one import instead of N (about 4 s each on 2 cores). Linux only: Windows has no
    fork, and on macOS Python calls fork unsafe (system libraries may start threads) and starts
    with spawn, as mp.spawn does everywhere. The lessons keep mp.spawn's default."""
    linux = sys.platform.startswith("linux")
    return "forkserver" if linux and "forkserver" in multiprocessing.get_all_start_methods() \
        else "spawn"


START_METHOD = start_method()


def as_a_fresh_process(rank, fn, stack_folder, *args):
    """Forked ranks would all inherit the server's RNG state; a process that mp.spawn starts seeds
    torch and `random` afresh (each rank differently). Do the same, or the labs would hide the bug
    of data drawn from the global RNG before any seed. And SIGUSR1 dumps this rank's stacks (a
    hang's report)."""
    dump_stacks_on_signal(stack_folder, rank)
    torch.seed()
    random.seed()
    return fn(rank, *args)


def spawn_or_fail(fn, args, nprocs):
    """mp.spawn's job, through the forkserver (Linux), each rank seeded as a fresh process; a
    failed rank is RUN FAILED (stderr) and exit 1, and the other ranks have been stopped; a hang
    (every live rank idle for STALL_SECONDS) is named, rank by rank, and stopped the same way."""
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(["__main__", "torch._dynamo"])
    with tempfile.TemporaryDirectory(prefix="course-stacks-") as stacks:
        context = mp.start_processes(as_a_fresh_process, args=(fn, stacks, *args), nprocs=nprocs,
                                     join=False, start_method=START_METHOD)
        try:
            join_watching(context, stacks)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"\nRUN FAILED: a rank stopped with an error, so every rank was stopped.\n{e}",
                  file=sys.stderr, flush=True)
            cause = cause_of_rank_error(str(e))
            if cause:
                report_cause(cause, sys.stderr)
            raise SystemExit(1) from None


def refuse_bad_crash_rank(crash_rank, ranks, steps=None):
    """--crash-rank's guard rails: a rank that exists, and (when `steps` is given) a run long enough
    to reach step 2, where crash_at_step raises. Nothing to check without --crash-rank."""
    if crash_rank is None:
        return
    if not 0 <= crash_rank < ranks:
        refuse(f"--crash-rank must be a rank from 0 to {ranks - 1}")
    if steps is not None and steps < 2:
        refuse(f"--crash-rank crashes at step 2, but this run has {steps} step(s)")


def crash_at_step(rank, step):
    """--crash-rank: this rank raises after its `step`-th optimizer step (a global post-step hook,
    so the lesson runs unchanged)."""
    count = [0]

    def hook(optimizer, args, kwargs):
        count[0] += 1
        if count[0] == step:
            raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")
    register_optimizer_step_post_hook(hook)


def platform_name():
    """The operating system as a reader knows it: Linux, macOS, Windows (else sys.platform)."""
    return {"linux": "Linux", "darwin": "macOS", "win32": "Windows"}.get(sys.platform, sys.platform)


def hard_kill(pid):
    """Kills the process at once: no exception, no `finally`, no handler, as the OOM killer does.
    SIGKILL on Linux and macOS. Windows has no SIGKILL; there os.kill with any other signal is
    TerminateProcess, just as immediate (the exit code is the signal's number, 15)."""
    os.kill(pid, getattr(signal, "SIGKILL", signal.SIGTERM))


def hard_killed():
    """hard_kill in words: "SIGKILLed" (Linux, macOS) or "killed by TerminateProcess" (Windows)."""
    return "SIGKILLed" if hasattr(signal, "SIGKILL") else "killed by TerminateProcess"


@contextlib.contextmanager
def quiet_logger(name):
    """Only errors from logger `name` inside the block: a line torch logs on every rank that the
    lab knows is harmless. setLevel, not `.level =`: it also clears the logger's cached levels."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def max_abs_diff(state_a, state_b):
    """Largest element-wise difference between two state dicts (0.0: bit-identical)."""
    if state_a.keys() != state_b.keys():  # a learner's file (--lesson) returned something else
        wrapped = any(k.startswith("module.") for k in list(state_a) + list(state_b))
        raise SystemExit("the lesson returned a model whose weights are named "
                         f"{sorted(state_a)[:2]}, not {sorted(state_b)[:2]}" + (
                             ": return model.module, the model DDP wraps, not the DDP wrapper"
                             if wrapped else ""))
    return max((state_a[k].double() - state_b[k].double()).abs().max().item() for k in state_a)


def report_proof(passed, claim, measured, tolerance):
    """Prints `PROOF PASSED: claim (measured, tolerance T)` and returns the exit code: 0, or 1 on failure."""
    print(f"PROOF {'PASSED' if passed else 'FAILED'}: {claim} ({measured}, tolerance {tolerance})", flush=True)
    return 0 if passed else 1


def hardware():
    """What a timing was measured on; CPU timings say nothing about GPU interconnects."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores{', ' + ', '.join(gpus) if gpus else ', no GPU'}, torch {torch.__version__}"


# ------------------------------------------------------------------------------- diagnosis
def report_cause(cause, file=None):
    """The line a failure ends with, when the measurements fit a known mistake: `LIKELY CAUSE:
    what the mistake is: what was measured that shows it; the fix (the lesson's line to compare)`.
    'Likely': it is read from what the run did, never from the learner's source text."""
    print(f"LIKELY CAUSE: {cause}", file=file or sys.stdout, flush=True)
    return f"LIKELY CAUSE: {cause}"


def report_unknown(measured, file=None):
    """The line a failure ends with when no known mistake fits: what was measured, so that the
    learner starts from facts (`cause unknown: the ranks agree; they leave one process at step 3,
    first in layer 0.weight`)."""
    print(f"cause unknown: {measured}", file=file or sys.stdout, flush=True)
    return f"cause unknown: {measured}"


def diagnose(candidates, measured, file=None):
    """candidates: (fits, cause) pairs, the most specific first; prints the first cause that fits
    (report_cause), else report_unknown(measured). Returns the line printed."""
    for fits, cause in candidates:
        if fits:
            return report_cause(cause, file)
    return report_unknown(measured, file)


def lesson_line(path, text):
    """`name.py line N`: the first line of the course's own file at `path` (from the repository
    root) that contains `text`, the line a learner compares theirs with. The course's file, not
    the learner's: a diagnosis never reads the learner's source."""
    full = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    with open(full) as f:
        number = next((n for n, line in enumerate(f, 1) if text in line), None)
    return f"{os.path.basename(path)} line {number}" if number else os.path.basename(path)


def learner_frame(frames, path=None):
    """The innermost of `frames` (traceback.FrameSummary or (file, line, function) triples) in the
    learner's file (COURSE_LESSON, or `path`): (file name, line, function), or None."""
    path = os.path.abspath(path or os.environ.get("COURSE_LESSON") or "")
    found = None
    for frame in frames:
        name, line, function = (frame.filename, frame.lineno, frame.name) if hasattr(
            frame, "filename") else frame
        if path and os.path.abspath(name) == path:
            found = (os.path.basename(name), line, function)
    return found


def run_lab(main, argv=None):
    """A lab's entry point: `course.exit_now(course.run_lab(main))`. An exception that escapes the
    lab while it grades a learner's file (--lesson) is one line, not a traceback in the lab's
    code: where the learner's file raised, or which of its answers the lab could not use. Grading
    the course's own lesson, a traceback is a bug of the course and is shown whole."""
    try:
        return main(argv)
    except Exception as error:
        if not os.environ.get("COURSE_LESSON"):
            raise
        frames = traceback.extract_tb(error.__traceback__)
        mine = learner_frame(frames)
        what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if mine:
            cause = (f"your file raised {what} ({mine[0]} line {mine[1]}, in {mine[2]}): fix it "
                     f"there")
        else:
            lab = frames[-1]
            cause = (f"the lab could not use what your file's functions returned: {what} (in the "
                     f"lab's {lab.name}); compare their return values with the lesson's")
        report_cause(cause, sys.stderr)
        return 1


def exit_now(code):
    """A lab's last call: `course.exit_now(course.run_lab(main))`. sys.exit would spend 2 to 4 s
    after the lab's last line on the interpreter's teardown, mostly a garbage collection of the
    object graph torch imports (py-spy: gc_collect_main), and so would the forkserver that started
    the ranks, which holds the lab's stdout: whoever reads it (a terminal's pipe, the suite) waits
    for both, in every lab run that returns (a RUN FAILED or a refusal raises SystemExit: the
    usual exit). Its ranks have ended: the forkserver is stopped (SIGTERM, no teardown). The atexit
    handlers still run (multiprocessing's, tempfile's, logging's). This is sys.exit with a thread
    still running (Python would wait for it), a message for a code, or in a rank under torchrun
    (RANK set: a lab's worker role runs a learner's code, whose unclosed files the teardown
    flushes)."""
    if not isinstance(code, (int, type(None))) or "RANK" in os.environ or any(
            t is not threading.main_thread() and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    for child in multiprocessing.active_children():  # a rank SIGKILLed a moment ago
        child.join(0.5)
    server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    with contextlib.suppress(OSError, IndexError, ValueError):  # still ours: pids are reused
        if server and not multiprocessing.active_children() and int(open(
                f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid():
            os.kill(server, signal.SIGTERM)
    atexit._run_exitfuncs()
    with contextlib.suppress(OSError, ValueError):  # a reader that has gone: nothing to lose
        sys.stdout.flush(), sys.stderr.flush()
    os._exit(code or 0)


# ------------------------------------------------------------------------------- hangs
def join_watching(context, stacks):
    """context.join() (mp.start_processes, join=False) until every rank is done, raising as join()
    does on a failed rank; a hang (HangWatch) kills the ranks, prints RUN FAILED naming where each
    one waits and the likely cause, and exits 1. `stacks`: the folder the ranks dump stacks to."""
    watch = HangWatch(stacks)
    while not context.join(timeout=0.5):
        pids = {r: p.pid for r, p in enumerate(context.processes) if p.is_alive()}
        if watch.stalled(pids):
            exited = {r: p.exitcode for r, p in enumerate(context.processes) if r not in pids}
            report, cause = watch.name_the_hang(pids, exited)
            for p in context.processes:
                if p.is_alive():
                    hard_kill(p.pid)
            print(f"\nRUN FAILED: {report}", file=sys.stderr, flush=True)
            report_cause(cause, sys.stderr)
            raise SystemExit(1)


# every live rank this long without using the CPU: a hang, not a slow run. COURSE_STALL_SECONDS
# shortens it for the tests that plant hangs (tests/test_broken_files.py)
STALL_SECONDS = float(os.environ.get("COURSE_STALL_SECONDS", 10))


def dump_stacks_on_signal(folder, rank):
    """In a rank: SIGUSR1 writes every thread's Python stack to folder/stack-rank{rank}.txt
    (faulthandler: it works while the rank is blocked inside a collective's C++ wait). Linux and
    macOS; Windows has no SIGUSR1 (there a hang ends at the group's timeout, unnamed)."""
    if folder and hasattr(signal, "SIGUSR1") and not _STACK_FILES:  # the first stays: the
        # watcher that forked this rank reads its folder, not one the lab's worker asks for later
        stream = open(os.path.join(folder, f"stack-rank{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
        _STACK_FILES.append(stream)  # kept open as long as the process lives


_STACK_FILES = []


def cpu_seconds(pid):
    """User + system CPU seconds a process (all its threads) has used; None if it is gone or the
    system has no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class HangWatch:
    """A hang, measured: every live rank has used (almost) no CPU for `stall` seconds, so each one
    waits, and none for another that is working. A slow run always has a rank that computes.
    Then name_the_hang() asks each rank for its stacks and says where each one waits."""

    def __init__(self, stack_folder, stall=None):
        self.folder, self.stall, self.seen = stack_folder, stall or STALL_SECONDS, {}

    def stalled(self, pids):
        now = time.monotonic()
        used = {rank: cpu_seconds(pid) for rank, pid in pids.items()}
        if not pids or any(v is None for v in used.values()):
            self.seen = {}
            return False
        if set(self.seen) != set(used) or any(used[r] - self.seen[r][1] > 0.02 * self.stall
                                             for r in used):
            self.seen = {r: (now, used[r]) for r in used}  # someone works: start again
            return False
        return now - min(t for t, _ in self.seen.values()) >= self.stall

    def name_the_hang(self, pids, exited):
        """(the report, the likely cause): each rank's collective and line, from its stacks."""
        stacks = faulthandler_stacks(pids, self.folder)
        # a rank whose file stays empty (its own code took SIGUSR1, as lesson 12's does): py-spy
        stacks.update(py_spy_stacks({r: p for r, p in pids.items() if r not in stacks}))
        waits = {rank: where_it_waits(text) for rank, text in stacks.items()}
        parts = []
        for rank in sorted(set(pids) | set(exited)):
            if rank in exited:
                parts.append(f"rank {rank} had exited" + (
                    f" (exit code {exited[rank]})" if exited[rank] != "?" else ""))
            elif rank in waits:
                collective, line = waits[rank]
                parts.append(f"rank {rank} waits in {collective}" + (f" at {line}" if line else ""))
            else:
                parts.append(f"rank {rank} waits (its stack could not be read)")
        report = (f"the run hung: no rank used the CPU for {self.stall:g} s, and was stopped; "
                  + "; ".join(parts))
        named = {waits[r][0] for r in waits}
        if exited and pids:
            cause = (f"rank(s) {', '.join(map(str, sorted(pids)))} wait in a collective that "
                     f"rank(s) {', '.join(map(str, sorted(exited)))} never called: every rank must "
                     "call every collective (one inside `if rank == 0` is the usual slip)")
        elif len(named) > 1:
            cause = ("the ranks wait in different collectives ("
                     + ", ".join(f"rank {r}: {waits[r][0]}" for r in sorted(waits))
                     + "): every rank must call the same collectives in the same order (one "
                       "inside `if rank == 0` is the usual slip)")
        elif named and not named - {"init_process_group()"}:
            cause = ("every rank waits to join the process group: a rank that never connects, "
                     "or ranks told different addresses, ports or world sizes")
        elif not named:
            cause = ("every rank stopped using the CPU, and no stack could be read to say where "
                     "(py-spy dump --pid PID reads one: lesson 12)")
        else:
            cause = None
        return report, cause or (f"every rank waits in {', '.join(sorted(named)) or 'a wait'}: "
                                 "a rank called it once more than the others, or with another "
                                 "size or group")


def torchrun_workers(agent_pid):
    """{attempt: {rank: pid}} of the workers a torchrun agent runs now: its child processes, each
    read for the RANK and TORCHELASTIC_RESTART_COUNT torchrun gave it (Linux's /proc; elsewhere
    {}, and a hang ends at the caller's time limit instead)."""
    found = {}
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{agent_pid}/task"):
            with contextlib.suppress(OSError):
                for pid in open(f"/proc/{agent_pid}/task/{task}/children").read().split():
                    with contextlib.suppress(OSError, ValueError, KeyError):
                        env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read()
                                   .split("\0") if "=" in v)
                        found.setdefault(int(env["TORCHELASTIC_RESTART_COUNT"]), {})[
                            int(env["RANK"])] = int(pid)
    return found


def wait_for_torchrun(proc, world, stacks, limit):
    """proc.wait() for a torchrun launch (its agent: proc), watching the newest attempt's workers:
    all of them idle for STALL_SECONDS is a hang, named from their stacks (each worker calls
    dump_stacks_on_signal(stacks_of(stacks, attempt), rank)). Returns (exit code, None), or
    (None, (the hang's report, its likely cause)) after killing the workers and the agent; past
    `limit` seconds, (None, None), killed too."""
    deadline, watches, workers = time.monotonic() + limit, {}, {}
    while proc.poll() is None:
        found = torchrun_workers(proc.pid)
        if found:
            attempt = max(found)
            workers = found[attempt]
            watch = watches.setdefault(attempt, HangWatch(stacks_of(stacks, attempt)))
            if len(workers) == world and watch.stalled(workers):
                hang = watch.name_the_hang(workers, {})
                stop_torchrun(proc, workers)
                return None, hang
        if time.monotonic() > deadline:
            stop_torchrun(proc, workers)
            return None, None
        time.sleep(0.5)
    return proc.returncode, None


def stacks_of(stacks, attempt):
    """The folder a torchrun attempt's workers dump their stacks to (made here, by the first)."""
    folder = os.path.join(stacks, f"attempt{attempt}")
    os.makedirs(folder, exist_ok=True)
    return folder


def stop_torchrun(proc, workers):
    """Kills a torchrun agent and its workers: they live in their own sessions, so killing the
    agent alone would leave them running."""
    for pid in list(workers.values()) + [proc.pid]:
        with contextlib.suppress(OSError):  # gone already
            hard_kill(pid)
    proc.wait()


def faulthandler_stacks(pids, folder, wait=5):
    """{rank: its stacks as text}: SIGUSR1 to each rank of {rank: pid}, whose faulthandler
    (dump_stacks_on_signal) writes folder/stack-rank{rank}.txt; the ranks that answer within
    `wait` seconds."""
    for pid in pids.values():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGUSR1)
    stacks = {}
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and len(stacks) < len(pids):
        time.sleep(0.2)
        for rank in pids:
            with contextlib.suppress(OSError):
                text = open(os.path.join(folder, f"stack-rank{rank}.txt")).read()
                if text.strip():
                    stacks[rank] = text
    return stacks


def py_spy():
    """The py-spy command (requirements.txt pins it) beside this interpreter or on PATH, or None."""
    import shutil
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.path.isfile(beside) else shutil.which("py-spy")


def py_spy_stacks(pids, timeout=10):
    """{rank: its stacks as text}, read from outside by `py-spy dump` (no signal, no handler in
    the rank), written as faulthandler writes them, so that where_it_waits reads both; the ranks
    py-spy could not read are missing (no py-spy, or no permission to attach: ptrace)."""
    import json
    import subprocess
    command, stacks = py_spy(), {}
    for rank, pid in pids.items() if command else ():
        try:
            done = subprocess.run([command, "dump", "--json", "--pid", str(pid)],
                                  capture_output=True, text=True, timeout=timeout)
            threads = json.loads(done.stdout) if done.returncode == 0 else []
        except (OSError, ValueError, subprocess.TimeoutExpired):
            continue
        if threads:  # none: a process py-spy could not read
            stacks[rank] = "\n\n".join(
                f"Thread {t.get('thread_id')} ({t.get('thread_name') or ''}):\n" + "\n".join(
                    f'  File "{f["filename"]}", line {f["line"]} in {f["name"]}'
                    for f in t.get("frames", [])) for t in threads)
    return stacks


TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
COURSE_FILES = {os.path.abspath(__file__)}


def where_it_waits(stacks):
    """(the collective, "file line N (function)" of the innermost frame of the lesson or the
    learner's file) from a faulthandler dump: the thread that runs the rank's function."""
    threads = [block for block in stacks.split("\n\n") if "File " in block]
    main = next((b for b in threads if "as_a_fresh_process" in b or "_wrap" in b),
                threads[-1] if threads else "")
    frames = [(m[0], int(m[1]), m[2]) for m in
              __import__("re").findall(r'File "([^"]+)", line (\d+) in (\S+)', main)]
    # faulthandler lists the most recent call first; the collective is the outermost call into
    # torch.distributed: the one the lesson made (all_gather_object, not what it calls inside)
    names = {name for _, _, name in frames}
    collective = "init_process_group()" if names & {"init_process_group", "rendezvous"} else None
    collective = collective or next((f"{name}()" for path, _, name in reversed(frames)
                       if path.startswith(TORCH_DIR) and "distributed" in path
                       and not name.startswith("_") and name not in ("wrapper",)), None)
    if collective is None and any(path.startswith(TORCH_DIR) and "autograd" in path
                                  for path, _, _ in frames):
        collective = "backward() (where DDP all-reduces the gradients)"
    theirs = learner_frame(list(reversed(frames)))
    if theirs is None:  # the course's own lesson: the innermost frame outside torch and the lab
        theirs = next(((os.path.basename(p), n, f) for p, n, f in frames
                       if not p.startswith(TORCH_DIR) and p not in COURSE_FILES
                       and "/lib/python" not in p and not os.path.basename(p).startswith("prove")),
                      None)
    line = f"{theirs[0]} line {theirs[1]} ({theirs[2]})" if theirs else None
    return collective or "a wait outside torch.distributed", line


def cause_of_rank_error(text, who=None):
    """A failed rank's traceback (mp.spawn's text, or a file a process wrote) in one line: where
    the learner's file raised (grading --lesson), or None. A planned --crash-rank needs no cause.
    who: the process's name in the line (default: the rank mp.spawn's text names)."""
    if "crashed on purpose" in text or not os.environ.get("COURSE_LESSON"):
        return None
    import re
    rank = re.search(r"Process (\d+) terminated", text)
    frames = [(m[0], int(m[1]), m[2]) for m in
              re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)]
    error = [line for line in text.strip().splitlines() if line and not line.startswith(" ")]
    what = error[-1] if error else "an error"
    mine = learner_frame(frames)
    who = who or (f"rank {rank[1]}" if rank else "a rank")
    if "Timed out" in what or "Connection closed by peer" in what:
        where = f" at {mine[0]} line {mine[1]} ({mine[2]})" if mine else ""
        return (f"{who} waited in a collective{where} that another rank never joined, until the "
                "process group's timeout: every rank must call the same collectives in order")
    if mine:
        return f"{who} raised {what} in your file ({mine[0]} line {mine[1]}, in {mine[2]}): fix it there"
    return None


# ------------------------------------------------------------------------- what a step did
class StepTrace:
    """What each optimizer step of a run saw and did, measured from outside the lesson (global
    hooks: the lesson's code runs unchanged): the samples of the step's batch, as indices into
    `dataset`, and the weights before the first step and after each (the first `keep` steps).
    install() in the process (rank) that trains, state() after, for the lab's diagnosis."""

    def __init__(self, dataset, keep=64):
        first = dataset[0][0]
        self.shape, self.dtype, self.keep = tuple(first.shape), first.dtype, keep
        self.index = {}
        for i in range(len(dataset)):
            self.index.setdefault(self.key(dataset[i][0]), i)
        self.steps, self.weights, self.seen, self.handles, self.rng = [[]], [], set(), [], []

    @staticmethod
    def key(row):
        return row.detach().to("cpu", torch.float64).numpy().tobytes()

    def install(self):
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self.handles = [register_module_forward_pre_hook(self.on_forward),
                        register_optimizer_step_pre_hook(self.before_step),
                        register_optimizer_step_post_hook(self.after_step)]
        return self

    def remove(self):
        for handle in self.handles:
            handle.remove()

    def on_forward(self, module, args):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (not module.training or x is None or id(x) in self.seen or x.dim() < 2
                or tuple(x.shape[1:]) != self.shape):
            return
        indices = [self.index.get(self.key(row)) for row in x]
        if all(i is not None for i in indices):
            if not self.steps[-1]:  # the step's first batch: the RNG state dropout starts from
                self.rng.append(rng_digest())
            self.seen.add(id(x))
            self.steps[-1].extend(indices)

    @staticmethod
    def flat(optimizer):
        return torch.cat([p.detach().to("cpu", torch.float64).flatten()
                          for group in optimizer.param_groups for p in group["params"]])

    def before_step(self, optimizer, args, kwargs):
        if not self.weights:
            self.weights.append(self.flat(optimizer))

    def after_step(self, optimizer, args, kwargs):
        if len(self.weights) <= self.keep:
            self.weights.append(self.flat(optimizer))
        self.steps.append([])
        self.seen = set()

    def state(self):
        """{"indices": each step's sample indices, "weights": [before step 1, after 1, ...],
        "rng": the RNG state's digest at each step's first forward}."""
        return {"indices": [s for s in self.steps if s],
                "weights": torch.stack(self.weights) if self.weights else torch.zeros(0),
                "rng": self.rng}


def rng_digest(state=None):
    """A short digest of torch's global (CPU) RNG state, or of `state`: equal digests, equal
    dropout masks to come."""
    import hashlib
    state = torch.get_rng_state() if state is None else state
    return hashlib.sha256(state.cpu().numpy().tobytes()).hexdigest()[:12]


def noting_rng_restores(set_rng_state, noted):
    """torch.set_rng_state, calling noted(digest) for each state it set that took effect: which
    saved state a resumed rank restored (labs 04 and 05 compare it with the one saved)."""
    def set_and_note(state, *args, **kwargs):
        set_rng_state(state, *args, **kwargs)
        if rng_digest() == rng_digest(state):
            noted(rng_digest(state))
    return set_and_note


def first_apart(a, b, tolerance, names_and_sizes=()):
    """(step, parameter name) where two weight traces first differ by more than `tolerance`
    (step 0: the initial weights), or None."""
    for step in range(min(len(a), len(b))):
        gap = (a[step] - b[step]).abs()
        if gap.max() > tolerance:
            where, start = int(gap.argmax()), 0
            for name, size in names_and_sizes:
                if where < start + size:
                    return step, name
                start += size
            return step, f"element {where}"
    return None


def data_parallel_cause(ranks, reference, expected, per_epoch, lines, tolerance,
                        names_and_sizes=(), file=None):
    """The likely cause of a data-parallel run that does not equal one process, from the runs'
    StepTrace states: `ranks` (one per rank), `reference` (one process on the global batch),
    `expected` (each rank's sample indices per step, as a correct DistributedSampler gives them),
    `per_epoch` steps per epoch, and `lines` {"sampler", "set_epoch", "ddp", "loss", "data",
    "model"}: where the lesson does each right (lesson_line). Prints and returns the line."""
    world = len(ranks)
    seen = [r["indices"] for r in ranks]
    steps = min(len(s) for s in seen) if seen else 0
    measured = []
    if steps == 0:
        return report_unknown("the lab saw no training step's batch (no forward of the data set's "
                              "samples in training mode, or no optimizer step)", file)
    same_everywhere = all(s[0] == seen[0][0] for s in seen)
    right = [all(sorted(seen[r][t]) == sorted(expected[r][t]) for r in range(world))
             for t in range(min(steps, len(expected[0])))]
    epoch0 = slice(0, min(per_epoch, steps))
    in_epoch0 = [i for s in seen for step in s[epoch0] for i in step]
    repeats = len(in_epoch0) - len(set(in_epoch0))
    first_wrong = right.index(False) if False in right else None
    epoch1_repeats = steps > per_epoch and all(
        sorted(seen[r][per_epoch + t]) == sorted(seen[r][t]) for r in range(world)
        for t in range(min(per_epoch, steps - per_epoch)))
    w = [r["weights"] for r in ranks]
    ref = reference["weights"]
    ranks_apart = max((first_apart(w[0], x, 0.0, names_and_sizes) or (None,))[0] or 0
                      for x in w[1:]) if world > 1 else 0
    ranks_agree = all(first_apart(w[0], x, 0.0) is None for x in w[1:])
    leaves = first_apart(w[0], ref, tolerance, names_and_sizes)
    ratio = None
    if len(w[0]) > 1 and len(ref) > 1:
        mine, theirs = (w[0][1] - w[0][0]).norm(), (ref[1] - ref[0]).norm()
        ratio = float(mine / theirs) if theirs > 0 else None
    measured.append("the ranks agree" if ranks_agree else f"the ranks part at step {ranks_apart}")
    if leaves:
        measured.append(f"they leave one process at step {leaves[0]}, first in {leaves[1]}")
    if ratio is not None:
        measured.append(f"the first update is {ratio:.2f} times one process's")
    near = lambda value, target: value is not None and abs(value / target - 1) < 0.05  # noqa: E731
    candidates = [
        (world > 1 and same_everywhere,
         f"every rank reads the same samples (step 1: {world} ranks, one batch): no "
         f"DistributedSampler, or one not told num_replicas and rank; give the loader one "
         f"({lines['sampler']})"),
        (first_wrong is not None and repeats > 0 and first_wrong < per_epoch,
         f"the ranks' samplers shuffle differently (a seed per rank?): in epoch 0, {repeats} "
         f"sample(s) reach two ranks and as many none; the same seed on every rank "
         f"({lines['sampler']})"),
        (first_wrong is not None and first_wrong >= per_epoch and epoch1_repeats,
         f"the sampler is not told the epoch (set_epoch): epoch 0 equals one process, epoch 1 "
         f"repeats epoch 0's shuffle; call sampler.set_epoch(epoch) ({lines['set_epoch']})"),
        (first_wrong is not None,
         f"the ranks read other samples than DistributedSampler(seed=0) gives them, from step "
         f"{(first_wrong or 0) + 1} on; compare the sampler and the loader ({lines['sampler']})"),
        (leaves is not None and leaves[0] == 0,
         f"the model starts from other weights than one process (step 0, {leaves[1]}): seed "
         f"the model before building it ({lines['model']})"),
        (not ranks_agree,
         f"the gradients are not averaged across ranks: each rank read its right samples, but the "
         f"ranks part at step {ranks_apart}; wrap the model in DDP and step outside no_sync "
         f"({lines['ddp']})"),
        (leaves is not None and near(ratio, world),
         f"the gradient is {world} times too large: the first update is {ratio:.2f} times one "
         f"process's (a loss multiplied by the world size, or gradients summed, not averaged); "
         f"the plain mean loss, DDP averages ({lines['loss']})"),
        (leaves is not None and ratio is not None and near(ratio, 1 / world),
         f"the gradient is divided by {world} once too often: the first update is {ratio:.2f} "
         f"times one process's; DDP already averages ({lines['loss']})"),
    ]
    return diagnose(candidates, "; ".join(measured), file)
