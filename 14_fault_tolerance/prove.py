"""The lab of lesson 14: kills a replica group with a real SIGKILL while the others train
(torchft), fails an all-reduce from inside, checkpoints with dcp.async_save while training, and
runs elastic.py under two torchrun agents (--nnodes=1:2) while a node joins, then is lost.

    python 14_fault_tolerance/prove.py                          # every claim, real kills
    python 14_fault_tolerance/prove.py --break commit-anyway    # the discarded step applied: FAILS
    python 14_fault_tolerance/prove.py --break no-heal          # no weights from a peer: FAILS
    python 14_fault_tolerance/prove.py --break load-newest      # loads a half-written save: FAILS
    python 14_fault_tolerance/prove.py --break shared-store     # the join deadlocks 10 s: FAILS
    python 14_fault_tolerance/prove.py --break commit-anyway load-newest shared-store  # together
    python 14_fault_tolerance/prove.py --crash-rank 1           # replica 1 raises: the run stops

torchft: 3 replica groups (one rank each) and the lesson's Lighthouse in this process. Replica 2
SIGKILLs itself after its backward at step --kill-step (its all-reduce done, its vote not cast);
the lab starts it again at once, as a cluster's scheduler would. Replica 1's all-reduce fails
from inside at step --kill-step + 10 (torchft's FakeProcessGroupWrapper, as its own tests do).
Checkpoints: 2 ranks, DDP on gloo, a model of 2 M parameters; rank 0 times save_async against
dcp.save, compares the checkpoint with the weights at the call, then dies with a save in flight.
Elastic torchrun: node A's agent alone; node B's agent once A has trained 20 steps; B's agent and
its worker SIGKILLed after step 34; A ends alone. Its workers run elastic.main() in float64 (this
file, --as-elastic-worker), compared with one process on the same global batches.
"""
import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust half logs every quorum at INFO
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import course  # noqa: E402
import elastic  # noqa: E402  the second lesson (elastic torchrun), the lab's third claim
# A rank of the elastic run (torchrun starts this file with --as-elastic-worker) needs neither DCP
# nor torchft: each of its 4 starts takes 1.6 s less (measured on 2 loaded cores)
if "--as-elastic-worker" not in sys.argv:
    import torch.distributed.checkpoint as dcp  # noqa: E402
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
    lesson = course.import_lesson("fault_tolerance", needs=(  # or the file given with --lesson
        "start_lighthouse", "make_model", "batch", "train_replica", "save_async",
        "newest_complete"))

LESSON_FILE = "14_fault_tolerance/fault_tolerance.py"
REPLICAS, JOIN_MS = 3, 1000
TORCHFT_BREAKS = {"commit-anyway", "no-heal"}  # the --breaks of the replicas' part
PACE = 0.1  # seconds a step of a replica takes while the quorum is short
BREAKS = {
    "commit-anyway": "the optimizer steps whatever should_commit() says: replica 1 applies the "
                     "step whose all-reduce failed",
    "no-heal": "the Manager's load_state_dict does nothing: a replica that heals keeps its own "
               "weights",
    "load-newest": "the resume loads the newest checkpoint folder, not the newest complete one "
                   "(with DCP's .metadata)",
    "shared-store": "the elastic run without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torchrun's "
                    "agents share their rendezvous store with the workers, and node B's join "
                    "deadlocks",
}


# --- the plants: the lesson's names wrapped inside a replica's process, never edited ----------

def plant(replica, folder, kill_at, fail_at, broken, crash):
    """In a replica: counts each real optimizer step (a line in applied{replica}-{pid}), and
    wraps the lesson's Optimizer and process group for this replica's plan."""
    applied = open(os.path.join(folder, f"applied{replica}-{os.getpid()}"), "a")
    register_optimizer_step_post_hook(lambda *_: (applied.write("1\n"), applied.flush()))
    if crash:
        course.crash_at_step(replica, 2)
    groups, armed, Optimizer = [], [], lesson.Optimizer
    make_group, make_manager = lesson.ProcessGroupGloo, lesson.Manager

    class Planted(Optimizer):
        def zero_grad(self, set_to_none=True):
            super().zero_grad(set_to_none)  # the quorum (it may reconfigure the group)
            if self.manager.current_step() == fail_at:  # this step's all-reduce will fail
                logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)  # its traceback
                armed.append(True)

        def step(self, closure=None):
            if self.manager.num_participants() < REPLICAS:
                time.sleep(PACE)  # a real model's step: time for the returning replica to join
            if kill_at is not None and self.manager.current_step() >= kill_at and \
                    self.manager.num_participants() == REPLICAS:  # after backward, before the vote
                course.hard_kill(os.getpid())
            if "commit-anyway" in broken:
                self.manager.should_commit()
                return self.optim.step()
            return super().step(closure)
    lesson.Optimizer = Planted
    if fail_at is not None:
        def failing_group(**kwargs):  # the all-reduce runs; this replica's result is an error
            group = make_group(**kwargs)
            groups.append(group)
            real = group.allreduce

            def allreduce(tensors, opts):
                work = real(tensors, opts)
                if not armed:
                    return work
                armed.clear()
                return FailedWork(work)
            group.allreduce = allreduce
            return group
        lesson.ProcessGroupGloo = failing_group
    if "no-heal" in broken:
        lesson.Manager = lambda **kw: make_manager(**{**kw, "load_state_dict": lambda s: None})


class FailedWork(dist._Work):
    """An all-reduce that completed on every replica, whose future here holds an error (what
    torchft's FakeProcessGroupWrapper means to do: its error lands on a future that 0.2.0's Manager
    never waits on)."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self, timeout=None):
        return self.work.wait()

    def get_future(self):
        def fail(future):
            future.wait()
            raise RuntimeError("all-reduce failed on purpose (its future holds the error)")
        return self.work.get_future().then(fail)


def replica_child(replica, address, steps, folder, kill_at, fail_at, broken, crash):
    torch.seed()  # a forked process starts with the server's RNG: reseed, as a fresh one would
    plant(replica, folder, kill_at, fail_at, broken, crash)
    try:
        lesson.train_replica(replica, address, steps, folder)
    except BaseException:  # kept for the parent, which names the learner's line from it
        with open(os.path.join(folder, f"error-replica{replica}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def learner_cause(folder, failed):
    """A failed replica's error in one line, where it rose in the learner's file (--lesson), or
    None (a planned --crash-rank, or the course's own lesson): course.cause_of_rank_error reads
    the traceback each replica kept."""
    for r in sorted(failed):
        path = os.path.join(folder, f"error-replica{r}.txt")
        cause = course.cause_of_rank_error(open(path).read() if os.path.exists(path) else "",
                                           who=f"replica {r}")
        if cause:
            return cause
    return None


def run_replicas(folder, args):
    """The 3 replica groups; replica 2 is started again when it dies of SIGKILL. Returns
    (seconds, the kill's time, the restart's time); a replica that fails otherwise is RUN FAILED."""
    context = mp.get_context(course.START_METHOD)
    if course.START_METHOD == "forkserver":  # one import of torch for every replica
        context.set_forkserver_preload(["__main__", "torch.distributed.checkpoint", "torchft"])
    lighthouse = lesson.start_lighthouse(REPLICAS - 1, JOIN_MS)
    print(f"lighthouse at {lighthouse.address()} (a Rust server in torchft's wheel, in the lab's "
          f"process): min {REPLICAS - 1} replicas, join timeout {JOIN_MS} ms", flush=True)
    plans = {0: (None, None), 1: (None, args.kill_step + 10), 2: (args.kill_step, None)}

    def start(r, kill_at, fail_at):
        p = context.Process(target=replica_child, args=(
            r, lighthouse.address(), args.steps, folder, kill_at, fail_at, args.broken,
            args.crash_rank == r), daemon=True)
        p.start()
        return p
    start_time, killed_at, procs = time.monotonic(), None, {}
    watch = course.HangWatch(folder)
    try:
        procs = {r: start(r, *plans[r]) for r in range(REPLICAS)}
        while any(p.is_alive() for p in procs.values()):
            time.sleep(0.05)
            if procs[2].exitcode == -signal.SIGKILL and killed_at is None:
                killed_at = time.monotonic()
                procs[2] = start(2, None, None)  # the scheduler starts it again
            if all(procs[r].exitcode == 0 for r in (0, 1)) and procs[2].is_alive():
                procs[2].join(timeout=10)  # the survivors are done: it has no quorum to join
                break
            failed = {r: p.exitcode for r, p in procs.items() if p.exitcode not in (None, 0)
                      and not (r == 2 and killed_at is None)}
            if failed or time.monotonic() - start_time > args.timeout:
                print(f"\nRUN FAILED: replica(s) {sorted(failed)} stopped with an error (above), "
                      "so every replica was stopped", file=sys.stderr, flush=True)
                raise SystemExit(course.report_cause(learner_cause(folder, failed) or (
                    f"a replica failed (exit codes {failed}) or the run passed {args.timeout} s: "
                    "torchft tolerates a replica that dies, but this lab's replicas must end "
                    "with 0"), sys.stderr) and 1)
            if watch.stalled({r: p.pid for r, p in procs.items() if p.is_alive()}):
                raise SystemExit("RUN FAILED: every replica idle for 10 s: a hang")
    finally:
        for p in procs.values():
            if p.is_alive():
                course.hard_kill(p.pid)
        lighthouse.shutdown()
    return time.monotonic() - start_time, killed_at and killed_at - start_time


def prove_torchft(folder, args):
    seconds, killed_at = run_replicas(folder, args)
    logs = {r: [json.loads(line) for line in open(os.path.join(folder, f"replica{r}.jsonl"))]
            for r in range(REPLICAS)}
    applied = {name.split("-")[0][7:] + "-" + name.split("-")[1]: len(open(
        os.path.join(folder, name)).read().split()) for name in os.listdir(folder)
        if name.startswith("applied")}
    files = [os.path.join(folder, f"replica{r}.pt") for r in range(REPLICAS)]
    weights = [torch.load(f, map_location="cpu", weights_only=True)  # NCCL: saved on GPU r
               for f in files if os.path.exists(f)]
    each = [course.max_abs_diff(weights[0], w) for w in weights] \
        if len(weights) == REPLICAS else [float("inf")] * REPLICAS  # one never finished
    apart = max(each)  # replica 1 is the one whose all-reduce fails; 2 the one that heals
    # participants per step, as the survivor replica 0 saw them: runs of equal counts
    runs = []
    for row in logs[0]:
        if runs and runs[-1][0] == row["participants"]:
            runs[-1][1] += 1
        else:
            runs.append([row["participants"], 1])
    per_life = {}
    for r, rows in logs.items():
        for row in rows:
            per_life.setdefault(f"{r}-{row['pid']}", []).append(row)
    lives = {life: ([row["step"] for row in rows if row["committed"]],
                    sum(not row["committed"] for row in rows)) for life, rows in per_life.items()}
    survivors_pids = {r: {row["pid"] for row in logs[r]} for r in (0, 1)}
    no_restart = all(len(p) == 1 for p in survivors_pids.values())
    once = all(steps == sorted(set(steps)) for steps, _ in lives.values())  # none twice
    counts_match = all(applied.get(life, 0) == len(steps) for life, (steps, _) in lives.items())
    committed0 = lives[f"0-{logs[0][0]['pid']}"][0]
    every_step = sorted({s for steps, _ in lives.values() for s in steps}) == \
        list(range(args.steps))
    discarded = {life: d for life, (_, d) in lives.items() if d}
    first_life = [rows for life, rows in per_life.items() if life.startswith("2-")][0]
    kill_step = first_life[-1]["step"] + 1  # the step it died in, never logged
    usual = sorted(row["seconds"] for row in logs[0][1:])[len(logs[0]) // 2]
    stall = max(row["seconds"] for row in logs[0]  # by step: replica 0 may join late, at step 2
                if kill_step <= row["step"] < kill_step + 3) - PACE
    returning = [rows for life, rows in per_life.items() if life.startswith("2-")][-1]
    print(f"\n{REPLICAS} replica groups, {args.steps} steps, {seconds:.1f} s; replica 2 "
          f"{course.hard_killed()} after its backward at step {kill_step} "
          f"({killed_at or 0:.1f} s), started again at once; replica 1's all-reduce failed at "
          f"step {args.kill_step + 10}", flush=True)
    print(f"  first quorum (step 0, with the step-0 sync): {logs[0][0]['seconds']:.2f} s; a "
          f"usual step {usual:.3f} s ({PACE} s more while fewer than {REPLICAS} replicas are in: "
          "the returning replica needs time to join)", flush=True)
    print("  participants per step (replica 0): "
          + ", ".join(f"{n} x {count}" for n, count in runs), flush=True)
    print(f"  survivors' processes: replica 0 {len(survivors_pids[0])}, replica 1 "
          f"{len(survivors_pids[1])} (no restart); replica 0 committed steps "
          f"{committed0[0]}..{committed0[-1]} ({len(committed0)}), none twice", flush=True)
    print("  per process: steps committed / real optimizer steps / discarded: " + ", ".join(
        f"replica {life.split('-')[0]} {len(s)}/{applied.get(life, 0)}/{d}"
        for life, (s, d) in lives.items()), flush=True)
    print(f"  the stall after the kill (its step less {PACE} s): {stall:.2f} s (join timeout "
          f"{JOIN_MS / 1000:.1f} s)", flush=True)
    print(f"  the returning replica healed from a peer: its first step is {returning[0]['step']}"
          f" (not 0); largest weight difference between the 3 replicas at the end: {apart} "
          f"(against replica 0: replica 1 {each[1]}, replica 2 {each[2]})", flush=True)
    stall_ok = JOIN_MS / 1000 * 0.8 <= stall <= JOIN_MS / 1000 + 2.0
    one_discard = list(discarded.values()) == [1] and next(iter(discarded)).startswith("1-")
    healed = returning[0]["step"] > kill_step and len(per_life) == REPLICAS + 1
    ok = (no_restart and once and counts_match and every_step
          and stall_ok and one_discard and healed and apart == 0.0)
    measured = (f"survivors restarted {sum(len(p) - 1 for p in survivors_pids.values())} times, "
                f"every step committed, none twice: {once and every_step}, "
                f"optimizer steps = commits: {counts_match}, discarded {sum(discarded.values())},"
                f" stall {stall:.2f} s, returning replica starts at step {returning[0]['step']}, "
                f"difference {apart}")
    causes = [
        (not counts_match, "an optimizer step outside should_commit(): a replica applied a step "
         "the quorum discarded (real optimizer steps > commits above); step through torchft's "
         "Optimizer, which asks should_commit() "
         f"({course.lesson_line(LESSON_FILE, 'Optimizer(')})"),
        (len(weights) < REPLICAS, f"{REPLICAS - len(weights)} replica(s) never saved final "
         "weights: a replica that returns must find a quorum before the survivors finish"),
        (0.0 < each[2] < float("inf"), "a replica that healed did not load its peer's weights: "
         "the Manager's "
         "load_state_dict must load the model and the optimizer "
         f"({course.lesson_line(LESSON_FILE, 'load_state_dict=lambda')})"),
        (not stall_ok, f"the survivors stalled {stall:.2f} s, not the join timeout: the "
         f"Lighthouse's join_timeout_ms ({course.lesson_line(LESSON_FILE, 'join_timeout_ms=')})"),
    ]
    fitting = [cause for fits, cause in causes if fits]  # several breaks: each its own cause
    causes = [(bool(fitting), "; and ".join(fitting))]
    return ok, ("the survivors train on without a restart; every step committed, none twice, "
                "none applied outside a commit; the stall is the join timeout; the failed "
                "all-reduce's step discarded; the returning replica heals and all end "
                "bit-identical"), \
        measured, causes, "0.0 and exact counts; the stall 0.8 x to the join timeout + 2 s"


# --- asynchronous checkpoints: 2 ranks, DDP on gloo, the lesson's save_async and resume -------

WIDTH = 1024  # two layers of 1024 x 1024: 2.1 M parameters, 8.4 MB a copy


def checkpoint_rank(rank, world_size, port, folder):
    """Times dcp.save against save_async, checks the async checkpoint against the weights at the
    call while training goes on, then starts a save and dies with it in flight: each rank
    SIGKILLs itself once its own data file is being written, before DCP's .metadata can be."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # the checkpoint's own
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(step):
        x = torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        sgd.zero_grad()
        model(x).square().mean().backward()
        sgd.step()
    root = os.path.join(folder, "checkpoints")
    train_step(0)
    start = time.perf_counter()
    dcp.save({"model": model.module.state_dict()}, checkpoint_id=f"{root}/step-1",
             process_group=group)
    sync_s = time.perf_counter() - start
    train_step(1)
    at_call = {k: v.clone() for k, v in model.module.state_dict().items()}
    start = time.perf_counter()
    future = lesson.save_async({"model": model.module.state_dict()}, f"{root}/step-2", group)
    blocked_s = time.perf_counter() - start
    for step in range(2, 5):  # the weights change while the thread writes
        train_step(step)
    future.result()
    total_s = time.perf_counter() - start
    changed = course.max_abs_diff(at_call, model.module.state_dict())
    loaded = {"model": {k: torch.empty_like(v) for k, v in at_call.items()}}
    dcp.load(loaded, checkpoint_id=f"{root}/step-2", process_group=group)
    equal = course.max_abs_diff(at_call, loaded["model"])
    if rank == 0:
        torch.save(at_call, os.path.join(folder, "step-2-weights.pt"))
        json.dump({"sync_s": sync_s, "blocked_s": blocked_s, "total_s": total_s,
                   "changed": changed, "equal": equal},
                  open(os.path.join(folder, "ckpt.json"), "w"))
    dist.barrier()
    train_step(5)
    lesson.save_async({"model": model.module.state_dict()}, f"{root}/step-5", group)
    data = os.path.join(root, "step-5", f"__{rank}_0.distcp")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            os.path.exists(data) and os.path.getsize(data) > 0):
        time.sleep(0.001)
    course.hard_kill(os.getpid())  # no finally, no flush: the save's thread dies with it


def prove_checkpoints(folder, args):
    context, port = mp.get_context(course.START_METHOD), course.find_free_port()
    procs = [context.Process(target=checkpoint_rank, args=(r, 2, port, folder), daemon=True)
             for r in range(2)]
    try:
        [p.start() for p in procs]
        [p.join(timeout=args.timeout) for p in procs]
    finally:
        [course.hard_kill(p.pid) for p in procs if p.is_alive()]
    codes = [p.exitcode for p in procs]
    if not os.path.exists(os.path.join(folder, "ckpt.json")):
        raise SystemExit(course.report_cause(f"the checkpoint ranks failed (exit codes {codes}) "
                                             "before their first checkpoints", sys.stderr) and 1)
    measured = json.load(open(os.path.join(folder, "ckpt.json")))
    root = os.path.join(folder, "checkpoints")
    if "load-newest" in args.broken:
        lesson.newest_complete = lambda root: max(os.listdir(root), key=lambda d: int(d[5:]))
    flight = os.path.join(root, "step-5")
    files = sorted(os.listdir(flight)) if os.path.isdir(flight) else []
    size = sum(os.path.getsize(os.path.join(flight, f)) for f in files)
    chosen = lesson.newest_complete(root)
    state = {"model": {k: torch.empty_like(v) for k, v in torch.load(
        os.path.join(folder, "step-2-weights.pt"), weights_only=True).items()}}
    try:
        dcp.load(state, checkpoint_id=os.path.join(root, chosen))
        resumed = course.max_abs_diff(state["model"], torch.load(
            os.path.join(folder, "step-2-weights.pt"), weights_only=True))
        error = None
    except (Exception, CheckpointException) as e:  # a BaseException: a half-written checkpoint
        resumed, error = float("inf"), type(e).__name__ + (
            " (no .metadata to read)" if ".metadata" in str(e) else f": {str(e)[:80]}")
    print(f"\nasynchronous checkpoints: 2 ranks, DDP on gloo, {2 * WIDTH * (WIDTH + 1):,} "
          "parameters; the checkpoint's own gloo group", flush=True)
    print(f"  timed on {course.hardware()}", flush=True)
    print(f"  dcp.save blocked the step {measured['sync_s']:.3f} s; save_async blocked it "
          f"{measured['blocked_s']:.3f} s (the copy to CPU), then wrote for "
          f"{measured['total_s']:.3f} s while 3 steps ran", flush=True)
    print(f"  the async checkpoint against the weights at the call: {measured['equal']} (the "
          f"weights had moved {measured['changed']:.1e} by the time it was written)", flush=True)
    print(f"  a save in flight when both ranks died (exit codes {codes}): step-5 holds "
          f"{', '.join(files) or 'nothing'} ({size} bytes), no .metadata", flush=True)
    print(f"  the resume chose {chosen}" + (f": loading it raised {error}" if error else
                                            f"; its weights against step 2's: {resumed}"),
          flush=True)
    ok = (measured["equal"] == 0.0 and measured["changed"] > 0 and codes == [-9, -9]
          and ".metadata" not in files and resumed == 0.0)
    causes = [(error is not None, "the resume loaded a checkpoint that was never finished: "
               f"{error}; load the newest folder with DCP's .metadata "
               f"({course.lesson_line(LESSON_FILE, 'def newest_complete')})")]
    return ok, ("the async checkpoint equals the weights at the call; a save cut short by a "
                "death is never loaded"), (f"checkpoint against the weights at the call "
                                           f"{measured['equal']}, resumed from {chosen}: "
                                           f"{resumed}"), causes, "0.0"


# --- elastic torchrun: two agents on this machine, a node joins then leaves ---------------------

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # = the `torchrun` console script
E_STEPS, JOIN, LEAVE = 60, 20, 35  # node B joins after step JOIN - 1, dies after LEAVE - 1
# The c10d rendezvous's keys (torch's dynamic_rendezvous.create_handler and
# c10d_rendezvous_backend), whole seconds: a round with fewer than --nnodes' max starts after 1 s
# (default 30); a node whose heartbeat (every 1 s, default 5) is 5 s old is dead (default 5 s x 3:
# 15; x 2 is too few: a heartbeat can be 2 intervals old, and node A removed itself from its own
# round, NOTES.md); a store read waits 10 s (default 60): what ends --break shared-store
RDZV = {"last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 5,
        "read_timeout": 10}
RDZV_CONF = ",".join(f"{key}={value}" for key, value in RDZV.items())
DEAD = RDZV["keep_alive_interval"] * RDZV["keep_alive_max_attempt"]  # seconds


def elastic_worker(settings):
    """Under torchrun, one rank: elastic.main() unchanged, in float64 (the lab compares it with
    one process), pausing after the step where the lab changes the membership: on world size 1
    after step JOIN - 1 until its agent stops it (node B joins meanwhile); on world size 2 after
    step LEAVE - 1 until the lab has SIGKILLed node B."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    folder, log_step = settings["folder"], elastic.log_step
    deadline = time.monotonic() + settings["timeout"]

    def log_and_pause(path, row, resumed=False):
        log_step(path, row, resumed)
        done, world = row["step"] + 1, dist.get_world_size()
        for marker, (size, step), until in (("join", (1, JOIN), None), ("leave", (2, LEAVE), "go")):
            if not resumed and (world, done) == (size, step):
                open(os.path.join(folder, marker), "w").close()  # the lab acts on it
                while time.monotonic() < deadline and not (
                        until and os.path.exists(os.path.join(folder, until))):
                    time.sleep(0.02)
    elastic.log_step = log_and_pause
    elastic.main(E_STEPS, settings["global_batch"], settings["lr"],
                 os.path.join(folder, "ckpt"), settings["timeout"])


def start_node(name, folder, port, shared_store):
    """One torchrun agent (a node) for 1 worker, --nnodes=1:2, its output to node{name}.log (its
    log folder in the lab's: by default each agent leaves a /tmp/torchelastic_* behind)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", LOGLEVEL="INFO")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not shared_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    settings = {"folder": folder, "global_batch": 32, "lr": 0.05, "timeout": 60}
    command = [*TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=lab14",
               f"--rdzv-conf={RDZV_CONF}", f"--log-dir={os.path.join(folder, 'torchelastic')}",
               os.path.abspath(__file__), "--as-elastic-worker", json.dumps(settings)]
    with open(os.path.join(folder, f"node{name}.log"), "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), settings


def said(folder, node, text):
    """Whether node's log (its agent's lines and its workers') holds `text`."""
    path = os.path.join(folder, f"node{node}.log")
    return os.path.exists(path) and text in open(path, errors="replace").read()


def alive(pid):
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_elastic(folder, args):
    """Node A's agent; node B's when A pauses at step JOIN; B's agent and worker SIGKILLed when
    the world of 2 pauses at step LEAVE. Returns (A's exit code, the rows of the lesson's log,
    {event: seconds}, the pids seen, the settings); progress lines as it goes."""
    shared, port, start = "shared-store" in args.broken, course.find_free_port(), time.monotonic()
    log, nodes, seen, at = os.path.join(folder, "ckpt", "steps.jsonl"), {}, set(), {}
    rows = []
    try:
        nodes["A"], settings = start_node("A", folder, port, shared)
        print(f"\nelastic torchrun: node A's agent started: --nnodes=1:2 --nproc-per-node=1 "
              f"--max-restarts=1 --rdzv-backend=c10d, --rdzv-conf={RDZV_CONF}; "
              f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE={'unset' if shared else '1'}", flush=True)
        while any(p.poll() is None for p in nodes.values()) and \
                time.monotonic() - start < args.timeout:
            time.sleep(0.05)
            now = time.monotonic() - start
            for proc in nodes.values():
                seen |= {proc.pid} | {p for ranks in course.torchrun_workers(proc.pid).values()
                                      for p in ranks.values()}
            rows = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
            if "B" not in nodes and os.path.exists(os.path.join(folder, "join")):
                nodes["B"], at["join"] = start_node("B", folder, port, shared)[0], now
                print(f"  {now:.1f} s: node A alone did steps 0-{JOIN - 1} and waits; node B's "
                      "agent starts", flush=True)
            if "join" in at and "joined" not in at and any(r["world_size"] == 2 for r in rows):
                at["joined"] = now
                seen_b = said(folder, "A", "Detected 1 new nodes")
                print(f"  {now:.1f} s: world size 2 from step {JOIN}, {now - at['join']:.1f} s "
                      "after B's start (A's agent " + ("saw B waiting and stopped its worker"
                                                       if seen_b else "never said it saw B")
                      + "; a round of 2)", flush=True)
            if "leave" not in at and os.path.exists(os.path.join(folder, "leave")):
                workers = {r: p for ranks in course.torchrun_workers(nodes["B"].pid).values()
                           for r, p in ranks.items()}
                course.stop_torchrun(nodes["B"], workers)  # the agent AND its worker: SIGKILL
                open(os.path.join(folder, "go"), "w").close()
                at["leave"] = now
                print(f"  {now:.1f} s: node B {course.hard_killed()} after step {LEAVE - 1}: its "
                      f"agent and its worker (pid {nodes['B'].pid}, "
                      f"{', '.join(map(str, workers.values())) or 'none'})", flush=True)
            if "leave" in at and "alone" not in at and rows and rows[-1]["step"] >= LEAVE:
                at["alone"] = now
                peer = any(said(folder, "A", f"Connection {how} by peer")  # 2.15's gloo: either;
                           for how in ("closed", "reset"))  # 2.11's: reset
                restart = said(folder, "A", "Worker group FAILED. 1/1 attempts left")
                print(f"  {now:.1f} s: world size {rows[-1]['world_size']} from step {LEAVE}, "
                      f"{now - at['leave']:.1f} s after the kill (A's worker: "
                      + ("all-reduce failed" if peer else "no error") + "; its agent: "
                      + ("restart 1 of 1" if restart else "no restart")
                      + f"; a round of 1 once B's heartbeat was {DEAD} s old)", flush=True)
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                course.stop_torchrun(proc, {p: p for ranks in course.torchrun_workers(
                    proc.pid).values() for p in ranks.values()})
    at["end"] = time.monotonic() - start
    rows = [json.loads(line) for line in open(log)] if os.path.exists(log) else []
    return nodes["A"].returncode, rows, at, seen, settings


def one_process(steps, global_batch, lr):
    """The reference: one process, no DDP, the same global batches, float64; (weights, losses)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        dataset, model = elastic.make_dataset(), elastic.make_model()
        sgd, losses = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), []
        for step in range(steps):
            x, y = dataset[elastic.step_windows(len(dataset), step, global_batch, seed=0)]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            sgd.zero_grad()
            loss.backward()
            sgd.step()
            losses.append(loss.item())
        return model.state_dict(), losses
    finally:
        torch.set_default_dtype(dtype)


def agent_waits(folder):
    """{node: (the keys it waited for, where)}: an agent's store timeout, read in the traceback
    its log ends with: the keys' names and its innermost frame in torch."""
    found = {}
    for name in ("A", "B"):
        path = os.path.join(folder, f"node{name}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        error = re.search(r"^\S*DistStoreError: wait timeout.*keys: (.*)$", text, re.M)
        frames = [(path.split("/", 1)[1], n, fn) for path, n, fn in re.findall(
            r'File "[^"]*/torch/(distributed/[^"]+)", line (\d+), in (\w+)', text)
            if fn != "wrapper"]
        if error and frames:
            keys = sorted({re.sub(r"^/torch\.rendezvous\.[^/]+/(torchelastic/)?|/\d+$", "", k)
                           for k in error[1].split(", ")})
            found[name] = (" and ".join(keys), "{} line {} ({})".format(*frames[-1]))
    return found


ELASTIC_FILE = "14_fault_tolerance/elastic.py"


def prove_elastic(folder, args):
    os.makedirs(os.path.join(folder, "ckpt"))
    code, rows, at, seen, settings = run_elastic(folder, args)
    left = sorted(pid for pid in seen if alive(pid))
    runs = []
    for row in rows:
        if runs and runs[-1][0] == row["world_size"]:
            runs[-1][1] += 1
        else:
            runs.append([row["world_size"], 1])
    steps = [row["step"] for row in rows]
    once = steps == list(range(E_STEPS))
    per_step = ", ".join(f"{n} x {count}" for n, count in runs) or "none"
    reference, losses = one_process(E_STEPS, settings["global_batch"], settings["lr"])
    newest = elastic.newest_checkpoint(os.path.join(folder, "ckpt"))
    final = torch.load(newest, weights_only=True) if newest else {"step": 0}
    apart = course.max_abs_diff(final["model"], reference) if final["step"] == E_STEPS \
        else float("inf")
    loss_gap = max((abs(r["loss"] - losses[r["step"]]) for r in rows
                    if r["step"] < E_STEPS), default=float("inf"))
    print(f"  {at['end']:.1f} s: node A's agent exit code {code}; processes left running: "
          f"{len(left)}", flush=True)
    print(f"  world size per step: {per_step}; steps logged: {len(steps)}, "
          + ("0.." + str(E_STEPS - 1) + " each once" if once else
             f"not 0..{E_STEPS - 1} once: {steps[:8]}..."), flush=True)
    print(f"  final weights against one process on the same {E_STEPS} global batches (float64): "
          f"{apart:.1e}; logged losses: {loss_gap:.1e}", flush=True)
    tolerance = 1e-9
    sizes = [n for n, _ in runs]
    ok = (code == 0 and once and not left and apart <= tolerance and loss_gap <= tolerance
          and sizes == [1, 2, 1])
    waits = agent_waits(folder)
    for name, (keys, where) in waits.items():
        print(f"  node {name}'s agent raised DistStoreError: it waited {RDZV['read_timeout']} s "
              f"for {keys} in {where}", flush=True)
    (a_keys, a_where), (b_keys, b_where) = waits.get("A", ("?", "?")), waits.get("B", ("?", "?"))
    causes = [
        (2 not in sizes and set(waits) == {"A", "B"},
         f"node B joined and the two agents waited for each other: A for {a_keys} in {a_where}, "
         f"B for {b_keys} in {b_where}, until the store's read_timeout; with the store shared "
         "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset) A, rank 0 again, keeps round 1's address "
         "and never writes it for round 2; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every "
         f"agent ({course.lesson_line(ELASTIC_FILE, 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1')})"),
        (not once, "a step logged twice or never: the log's line is written once the step's "
         "checkpoint is on disk, and on resume only if it is missing "
         f"({course.lesson_line(ELASTIC_FILE, 'def log_step')})"),
        (apart > tolerance, "the weights are not one process's on the same global batches: a "
         "step's samples must not depend on the world size, and the resume must load the "
         f"optimizer too ({course.lesson_line(ELASTIC_FILE, 'def step_windows')})"),
        (bool(left), f"{len(left)} process(es) left running: a lost node is its agent AND its "
         "workers (torchrun starts them in their own session)"),
    ]
    claim = "elastic torchrun: a node joins, then is lost; each step once, one process's weights"
    return ok, claim, \
        (f"world size per step {per_step}, each step once: {once}, weights {apart:.1e}, losses "
         f"{loss_gap:.1e}, left running {len(left)}"), causes, f"{tolerance:g}"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    course.add_lesson_flag(parser, "fault_tolerance")
    course.add_break_flag(parser, BREAKS, several=True)  # each breaks its own part
    parser.add_argument("--crash-rank", type=int, metavar="R",
                        help="replica R raises at step 2: the run must stop with its error")
    parser.add_argument("--steps", type=int, default=60, help="steps to commit (default 60)")
    parser.add_argument("--kill-step", type=int, default=10,
                        help="the step whose backward replica 2 dies after (default 10)")
    parser.add_argument("--timeout", type=float, default=240,
                        help="seconds before the lab gives up on the run (default 240)")
    parser.add_argument("--as-elastic-worker", metavar="SETTINGS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.broken = args.broken or []
    if args.as_elastic_worker:
        return args
    course.refuse_bad_crash_rank(args.crash_rank, REPLICAS, args.steps)
    if args.crash_rank is not None and args.broken and not set(args.broken) & TORCHFT_BREAKS:
        course.refuse("--crash-rank crashes a replica: give it alone or with a --break of the "
                      f"replicas ({', '.join(sorted(TORCHFT_BREAKS))})")
    if os.environ.get("COURSE_LESSON") and args.broken == ["shared-store"]:
        course.refuse("--break shared-store breaks elastic.py, which --lesson does not run")
    if not 1 <= args.kill_step or args.kill_step + 12 > args.steps:
        course.refuse(f"--kill-step must be from 1 to --steps - 12 ({args.steps - 12}): the "
                      "all-reduce fails 10 steps after the kill, and the heal needs a step")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.as_elastic_worker:  # under torchrun: one rank of the elastic run
        elastic_worker(json.loads(args.as_elastic_worker))
        return 0
    broken = set(args.broken)  # a --break runs the part it breaks; the default, every part
    torchft = not broken or bool(broken & TORCHFT_BREAKS)
    checkpoints = (not broken or "load-newest" in broken) and args.crash_rank is None
    elastic_run = (not broken or "shared-store" in broken) and args.crash_rank is None
    print(("backend: gloo (torchft's ProcessGroupGloo on CPU, where the lab plants its failure), "
           f"{REPLICAS} replica(s) of 1 rank each" if torchft or checkpoints else
           "backend: gloo (CPU: the elastic run's 2 nodes share this machine), 1 rank a node")
          + "".join(f"; --break {name}: {BREAKS[name]}" for name in args.broken), flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="prove14_") as folder:
        if torchft:
            os.makedirs(os.path.join(folder, "ft"))
            results.append(prove_torchft(os.path.join(folder, "ft"), args))
        if checkpoints:
            results.append(prove_checkpoints(folder, args))
        if elastic_run:
            if os.environ.get("COURSE_LESSON"):  # --lesson grades fault_tolerance.py only
                print("\nelastic torchrun: not run with --lesson (it grades fault_tolerance.py; "
                      "the elastic claim runs elastic.py)", flush=True)
            else:
                results.append(prove_elastic(os.path.join(folder, "elastic"), args))
    passed = all(r[0] for r in results)
    code = course.report_proof(passed, "; ".join(r[1] for r in results),
                               "; ".join(r[2] for r in results), "; ".join(r[4] for r in results))
    causes = [next((cause for fits, cause in r[3] if fits), None) for r in results if not r[0]]
    unknown = [r[2] for r in results if not r[0] and not any(fits for fits, _ in r[3])]
    if code and any(causes):  # a failed part's first cause that fits, every part in one line
        course.report_cause("; and ".join([cause for cause in causes if cause] + [
            f"cause unknown: {measured}" for measured in unknown]))
    elif code:
        course.report_unknown("; ".join(unknown))
    return code


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
