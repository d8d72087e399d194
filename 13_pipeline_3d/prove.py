"""Lab 13: proves pipeline_3d.py's claims in ONE launch of 4 ranks (2 CPU cores: each launch of
ranks costs seconds of imports, so every claim shares it):
  1. every schedule (GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
     DualPipeV) on pp 2 x FSDP 2 ends 2 SGD steps at the weights of one process on the global batch;
     so does pp 2 x TP 2 (1F1B);
  2. the bubble, from each rank's actions in the order the run ran them (replayed at unit cost),
     against (p-1)/(m+p-1) (GPipe, 1F1B) and (p-1)/(v m+p-1) (interleaved, v stages a rank);
  3. the activations a rank holds at its peak (saved-tensor bytes, lesson 10's counting): GPipe m
     micro-batches, 1F1B p - r on pipeline rank r;
  4. HSDP, 2 replicas x 2 shards: equal to one process, with half the parameters a rank.
--plot PNG draws each schedule's timeline, per rank, from the run (the README's picture)."""
import argparse
import datetime
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import course  # noqa: E402

lesson = course.import_lesson("pipeline_3d", needs=("make_model", "split_model", "build", "train",
                                                    "make_batches"))
from torch.distributed.fsdp import fully_shard  # noqa: E402

PLAIN = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"]
ZERO_BUBBLE = ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
# torch 2.11 (the floor): a V-shaped schedule's start-up p2p sends a rank's stage to its own other
# stage, which gloo refuses ("Pair is not connected"); 2.15 runs them (NOTES.md)
OLD = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15)
SKIPPED = ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"] if OLD else []
ZERO_BUBBLE = [s for s in ZERO_BUBBLE if s not in SKIPPED]
# (name, schedule, mesh (pp, replicas, shards, tp)): one launch of 4 ranks runs them in turn
RUNS = [*((s, s, (2, 1, 2, 1)) for s in PLAIN + ZERO_BUBBLE), ("tp", "Schedule1F1B", (2, 1, 1, 2)),
        ("hsdp", "ScheduleGPipe", (1, 2, 2, 1))]
STEPS, MICRO, BATCH, LR = 2, 4, 16, 0.05
BREAKS = {"nested-reshard": "fully_shard each block with reshard_after_forward=True (what FSDP2 "
          "does to a non-root module by default) under the zero-bubble schedules",
          "hsdp-no-replicate": "HSDP's fully_shard over the shard dimension only: replicas drift"}


class Held:
    """A saved tensor, counted while autograd keeps it (lesson 10's counting, with a peak)."""
    now = peak = packed = 0

    def __init__(self, tensor):
        self.tensor, self.bytes = tensor, getattr(tensor, "_local_tensor", tensor).nbytes
        Held.now, Held.packed = Held.now + self.bytes, Held.packed + self.bytes
        Held.peak = max(Held.peak, Held.now)

    def __del__(self):
        Held.now -= self.bytes


def timed(events, stage, kind, method):
    def wrapper(*args, **kwargs):
        start, what = time.perf_counter(), "I" if kind == "B" and not kwargs.get(
            "full_backward", True) else kind  # I: the input gradients only, W later
        chunk = args[0] if args else next(iter(kwargs.values()))
        try:
            return method(*args, **kwargs)
        finally:
            events.append((stage.stage_index, what, chunk, start, time.perf_counter()))
    return wrapper


def run_one(rank, mesh, name, schedule_name, broken, out_dir):
    device = torch.device("cpu") if mesh.device_type == "cpu" else torch.device("cuda", rank)
    schedule, stages = lesson.build(mesh, schedule_name, MICRO, device)
    events = []
    for stage in stages:  # timestamps of what each stage runs: the timeline
        stage.forward_one_chunk = timed(events, stage, "F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed(events, stage, "B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed(events, stage, "W", stage.backward_weight_one_chunk)
    step, peaks = schedule.step, []

    def measured_step(*args, **kwargs):
        events.clear()
        Held.peak, Held.packed = Held.now, 0
        with torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor):
            out = step(*args, **kwargs)
        peaks.append((Held.peak - Held.now, Held.packed))
        return out
    schedule.step = measured_step
    dp, tp = mesh["rep"].size() * mesh["shard"].size(), mesh["tp"].size()
    batches = [(x.to(device), y.to(device)) for x, y in
               lesson.make_batches(STEPS, dp, rank // tp % dp, BATCH)]
    losses = lesson.train(schedule, stages, batches, say=False, lr=LR)
    weights = {s.stage_index: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
                               .cpu() for k, v in s.submod.state_dict().items()} for s in stages}
    order = getattr(schedule, "pipeline_order", None) or {}
    found = {"weights": weights, "losses": losses, "peak": peaks[-1][0], "packed": peaks[-1][1],
             "events": list(events), "pp_rank": mesh.get_local_rank(0),
             "order": {r: [None if a is None else str(a) for a in acts] for r, acts in order.items()},
             "local_bytes": sum(getattr(p, "_local_tensor", p).nbytes for s in stages
                                for p in s.submod.parameters())}
    torch.save(found, os.path.join(out_dir, f"{name}_{rank}.pt"))


def lab_worker(rank, port, backend, broken, crash_rank, timeout, out_dir):
    warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # the stages' outputs: never in place
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else torch.set_num_threads(1)
    shard = fully_shard
    if "nested-reshard" in broken:  # FSDP2's default on the blocks (the stage's root keeps False)
        shard = lambda m, shard=shard, **kw: shard(m, **{**kw, "reshard_after_forward": not
                                                         isinstance(m, nn.Sequential)})
    if "hsdp-no-replicate" in broken:  # the 2-D (replicate, shard) mesh's shard dimension only
        shard = lambda m, shard=shard, mesh=None, **kw: shard(m, mesh=mesh["shard"] if mesh.ndim
                                                              == 2 else mesh, **kw)
    lesson.fully_shard = shard
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        meshes = {}
        for name, schedule_name, shape in RUNS:
            if shape not in meshes:
                meshes[shape] = dist.init_device_mesh(device.type, shape, mesh_dim_names=(
                    "pp", "rep", "shard", "tp"))
            run_one(rank, meshes[shape], name, schedule_name, broken, out_dir)
    except BaseException:  # print this rank's own error first: the spawner may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        dist.destroy_process_group()


def train_reference():
    """One process, plain PyTorch: the whole model on each whole batch, the same SGD."""
    model = lesson.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in lesson.make_batches(STEPS, 1, 0, BATCH):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x).transpose(1, 2), y).backward()
        optimizer.step()
    return model


def reference_stages(model, stages):
    return {i: piece.state_dict() for i, piece in enumerate(lesson.split_model(model, stages))}


def max_difference(found, reference):
    got = {i: w for rank in found for i, w in rank["weights"].items()}
    return max((got[i][k] - v).abs().max().item() for i, sd in reference.items()
               for k, v in sd.items())


COST = {"F": 1, "B": 2, "I": 1, "W": 1}  # a backward costs two forwards; B = I + W


def simulate(orders):
    """Each rank runs its actions in the order the run ran them, each as soon as its inputs are
    ready, at COST units: the idle fraction of each rank until the last action ends (bubble)."""
    last, done, free, busy = max(s for o in orders.values() for s, _, _ in o), {}, {}, {}
    todo = {r: list(o) for r, o in orders.items()}
    while any(todo.values()):
        moved = False
        for r, actions in todo.items():
            while actions:
                s, kind, i = actions[0]
                needs = [(s - 1, "F", i)] if kind == "F" and s else []
                needs += [(s, "F", i)] if kind in "BI" else [(s, "I", i)] if kind == "W" else []
                needs += [next((k for k in [(s + 1, "B", i), (s + 1, "I", i)] if k in done),
                               (s + 1, "B", i))] if kind in "BI" and s < last else []
                if not all(k in done for k in needs):
                    break
                start = max([free.get(r, 0)] + [done[k] for k in needs])
                done[s, kind, i] = free[r] = start + COST[kind]
                busy[r], moved = busy.get(r, 0) + COST[kind], True
                actions.pop(0)
        if not moved:
            raise RuntimeError(f"the action lists wait on each other: {todo}")
    end = max(done.values())
    return {r: 1 - busy[r] / end for r in orders}


def plot_timeline(runs, names=("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                                "ScheduleZBVZeroBubble"), path=None):
    """Each schedule's last step as the run timed it: a row per pipeline rank, a box per action."""
    import matplotlib
    matplotlib.use("Agg") if path else None
    import matplotlib.pyplot as plt
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
    names = [n for n in names if n in runs]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.3 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        rows = {r: runs[name][2 * r]["events"] for r in (0, 1)}  # pipeline ranks 0, 1: ranks 0, 2
        t0 = min(e[3] for events in rows.values() for e in events)
        for r, events in rows.items():
            for stage, kind, chunk, start, end in events:
                ax.barh(r, (end - start) * 1e3, left=(start - t0) * 1e3, color=colors[kind],
                        edgecolor="black", linewidth=0.4)
                ax.text((start + end - 2 * t0) * 500, r, f"{chunk}", ha="center", va="center",
                        fontsize=6)
        ax.set_yticks([0, 1], ["pp 0", "pp 1"])
        ax.invert_yaxis()
        ax.set_title(f"{name[8:]} (white: idle)", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms since the step began (F forward, B backward, I input grads, "
                           "W weight grads)")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
    fig.legend(handles=handles, ncol=4, fontsize=7, loc="upper right")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    if path:
        fig.savefig(path, dpi=80)
    return fig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, "pipeline_3d")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS, several=True)
    p.add_argument("--crash-rank", type=int, help="this rank raises at its 2nd optimizer step: the "
                   "whole run must stop within seconds with that rank's own error")
    course.add_timeout_flag(p)
    p.add_argument("--plot", metavar="PNG", help="draw each schedule's timeline, per rank, there")
    args = p.parse_args(argv)
    args.broken = args.broken or []
    if args.timeout <= 0:
        course.refuse("--timeout must be positive")
    course.refuse_bad_crash_rank(args.crash_rank, 4)
    return args


def main(argv=None):
    args = parse_args(argv)
    backend, device, reason = course.backend_for(4, args.device)
    print(f"backend: {backend} ({reason}); 4 ranks, one launch: 7 schedules on pp 2 x FSDP 2, "
          f"1F1B on pp 2 x TP 2, HSDP 2 x 2" + "".join(
              f"; --break {name}: {BREAKS[name]}" for name in args.broken), flush=True)
    with tempfile.TemporaryDirectory(prefix="prove13_") as out_dir:
        start = time.perf_counter()
        course.spawn_or_fail(lab_worker, (course.find_free_port(), backend, args.broken,
                                          args.crash_rank, args.timeout, out_dir), 4)
        took = time.perf_counter() - start
        runs = {name: [torch.load(os.path.join(out_dir, f"{name}_{r}.pt"), map_location="cpu",
                                  weights_only=False)
                       for r in range(4)] for name, _, _ in RUNS}
    print(f"the launch took {took:.1f} s on {course.hardware()}")
    if args.plot:
        plot_timeline(runs, path=args.plot)
    return report(runs, args)


def report(runs, args):
    model = train_reference()
    diffs = {}
    for name, schedule_name, shape in RUNS:
        stages = max(i for r in runs[name] for i in r["weights"]) + 1
        diffs[name] = max_difference(runs[name], reference_stages(model, stages))
    for name in PLAIN + ZERO_BUBBLE + ["tp", "hsdp"]:
        print(f"{name:30s} max |w - one process| {diffs[name]:.2e}")
    for name in SKIPPED:
        print(f"{name:30s} not run on torch {torch.__version__} with gloo (NOTES.md)")
    tol = 1e-5
    code = course.report_proof(max(diffs[n] for n in PLAIN + ["tp"]) < tol,
                               "GPipe, 1F1B, Interleaved1F1B, LoopedBFS (pp 2 x FSDP 2) and 1F1B "
                               "(pp 2 x TP 2) end at one process's weights",
                               f"max |dw| {max(diffs[n] for n in PLAIN + ['tp']):.1e}", tol)
    code |= course.report_proof(max(diffs[n] for n in ZERO_BUBBLE) < tol,
                                f"the zero-bubble schedules ({', '.join(n[8:] for n in ZERO_BUBBLE)})"
                                " end at one process's weights",
                                f"max |dw| {max(diffs[n] for n in ZERO_BUBBLE):.1e}", tol)
    p, m = 2, MICRO
    rows = []
    for name in PLAIN + ZERO_BUBBLE:  # pipeline ranks 0 and 1: ranks 0 and 2
        orders = {r: [(s, k, i) for s, k, i, _, _ in runs[name][2 * r]["events"]] for r in (0, 1)}
        measured = max(simulate(orders).values())
        v = 1 if name in ("ScheduleGPipe", "Schedule1F1B") else 2
        rows.append((name, measured, (p - 1) / (v * m + p - 1)))
        print(f"bubble {name:30s} {measured:.3f} (formula (p-1)/(v m+p-1), v {v}: "
              f"{(p - 1) / (v * m + p - 1):.3f})")
    worst = max(abs(b - f) for n, b, f in rows if n in PLAIN[:3])
    code |= course.report_proof(worst < 1e-9, "the bubble of GPipe, 1F1B and Interleaved1F1B from "
                                "their action lists equals (p-1)/(v m+p-1)", f"worst {worst:.3f}",
                                "1e-9")
    held = {}
    for name in ("ScheduleGPipe", "Schedule1F1B"):
        for r in runs[name]:
            per_micro = r["packed"] / m
            held[name, r["pp_rank"]] = r["peak"] / per_micro
    for (name, pp_rank), n in sorted(held.items()):
        print(f"activations held at the peak, {name} pipeline rank {pp_rank}: {n:.2f} "
              f"micro-batches (formula {m if name == 'ScheduleGPipe' else min(m, p - pp_rank)})")
    worst = max(abs(n - (m if name == "ScheduleGPipe" else min(m, p - r)))
                for (name, r), n in held.items())
    code |= course.report_proof(worst < 0.05, "GPipe holds m micro-batches' activations, 1F1B "
                                "p - r on pipeline rank r", f"worst {worst:.2f} micro-batches",
                                "0.05")
    whole = sum(t.nbytes for t in model.state_dict().values())
    local = [r["local_bytes"] for r in runs["hsdp"]]
    print(f"HSDP 2 x 2: parameters a rank {local} bytes of {whole}")
    code |= course.report_proof(diffs["hsdp"] < tol and max(local) <= whole // 2 + 64,
                                "HSDP (2 replicas x 2 shards) ends at one process's weights "
                                "with half the parameters a rank", f"max |dw| {diffs['hsdp']:.1e}, "
                                f"{max(local) / whole:.2f} of the bytes", tol)
    if code:
        zb, plain = max(diffs[n] for n in ZERO_BUBBLE), max(diffs[n] for n in PLAIN)
        hsdp_line = course.lesson_line("13_pipeline_3d/pipeline_3d.py", 'mesh["rep", "shard"]')
        course.diagnose([
            (zb >= tol > plain, "a block resharded after forward under a split backward: only "
             f"the zero-bubble schedules leave one process ({zb:.1e}); their input-gradient pass "
             "collects the stage's parameters after the block swapped its shards back in, so the "
             "block's weight gradients are never computed; fully_shard the blocks with "
             "reshard_after_forward=False ("
             f"{course.lesson_line('13_pipeline_3d/pipeline_3d.py', 'reshard_after_forward')})"),
            (diffs["hsdp"] >= tol > max(zb, plain), "HSDP's replicas do not average: every "
             f"schedule is one process's but HSDP is {diffs['hsdp']:.1e} away; fully_shard over the "
             "2-D (replicate, shard) mesh, not its shard dimension alone ("
             f"{hsdp_line})")],
            f"the largest differences: zero bubble {zb:.1e}, others {plain:.1e}, HSDP "
            f"{diffs['hsdp']:.1e}")
    return code


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
