"""The lab of lesson 06, parts 2 and 3: overlap.py and zero1.py against DDP, bit for bit.

    python 06_collectives/prove_overlap_zero1.py                          # the proofs, 2 ranks
    python 06_collectives/prove_overlap_zero1.py --break step-before-wait  # FAILS
    python 06_collectives/prove_overlap_zero1.py --break no-gather         # FAILS
    python 06_collectives/prove_overlap_zero1.py --profile prof06          # timelines and step times

The claims, on 2 ranks, each rank's model built from ANOTHER seed (the lesson broadcasts rank 0's,
as DDP's constructor does): (1) overlap.py, one all-reduce per parameter and in 4 KiB buckets, ends
with weights bit-identical to torch's DDP, also on a model with a frozen parameter and tied weights;
(2) zero1.py ends bit-identical to DDP (both models) and within 1e-5 of one process on the global
batch, with optimizer state of 1/N of DDP's per rank at N = 1, 2 and 4 ranks.
"""
import argparse
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import course  # noqa: E402
import overlap  # noqa: E402
import zero1  # noqa: E402

WORLD, EPOCHS, BATCH, LR = 2, 2, 16, 0.05
TOLERANCE = 1e-5  # against one process: another summation order moves a value by ~1e-7
BREAKS = {
    "step-before-wait": "overlap.py's finish() runs after optimizer.step(), not before: the step "
                        "uses this rank's own gradient, the average arrives too late",
    "no-gather": "zero1.py never all-gathers: each rank copies back only its own updated shard, "
                 "so every other part of its model stays where it was",
}


def tied_and_frozen_model(seed=0):
    """Two layers share one weight (a tied parameter: one tensor, two uses) and the first bias is
    frozen (no gradient, in no bucket): the cases a hand-written DDP gets wrong."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    model[4].weight = model[2].weight
    model[0].bias.requires_grad_(False)
    return model


MODELS = {"plain": overlap.make_model, "tied": tied_and_frozen_model}


def ddp_worker(rank, world_size, port, model_name, zero=False):
    """The reference: torch's DDP on the lessons' data and loop, each rank's model from its own
    seed (DDP's constructor broadcasts rank 0's); zero=True: with torch's ZeroRedundancyOptimizer.
    Returns the model and this rank's optimizer-state bytes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        sampler = dist_sampler(rank, world_size)
        loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler,
                                             generator=torch.Generator().manual_seed(0))
        model = DDP(MODELS[model_name](seed=rank))
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR, momentum=0.9) \
            if zero else torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in loader:
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        local = optimizer.optim if zero else optimizer  # ZeRO's own optimizer: this rank's part
        return model.module, sum(t.numel() * t.element_size() for s in local.state.values()
                                 for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    finally:
        model = optimizer = None
        dist.destroy_process_group()


def dist_sampler(rank, world_size):
    return torch.utils.data.DistributedSampler(overlap.make_dataset(), num_replicas=world_size,
                                               rank=rank, seed=0)


def install_break(broken, lesson):
    """Patches this process's copy of the lesson it breaks; returns what undoes it."""
    if broken == "step-before-wait" and lesson is overlap:
        real = overlap.overlap_gradients

        hooks = []

        def late(buckets, world_size):
            finish = real(buckets, world_size)
            hooks.append(register_optimizer_step_post_hook(
                lambda optimizer, args, kwargs: finish()))  # waits only after the step
            return lambda: None
        overlap.overlap_gradients = late
        return lambda: (setattr(overlap, "overlap_gradients", real), [h.remove() for h in hooks])
    if broken == "no-gather" and lesson is zero1:
        real_dist = zero1.dist

        class OwnShardOnly:  # zero1.py's `dist`, but all_gather_into_tensor gathers nothing
            def __getattr__(self, name):
                return getattr(real_dist, name)

            @staticmethod
            def all_gather_into_tensor(flat, shard):
                params = [p for p in OwnShardOnly.model.parameters() if p.requires_grad]
                flat.copy_(zero1.flat_padded([p.detach() for p in params], len(flat)))
                rank = real_dist.get_rank()
                flat[rank * len(shard):(rank + 1) * len(shard)] = shard
        zero1.dist = OwnShardOnly()
        real_shard = zero1.zero1_shard

        def remember(params, world_size, rank):
            params = list(params)
            OwnShardOnly.model = nn.ParameterList(params)
            return real_shard(params, world_size, rank)
        zero1.zero1_shard = remember
        return lambda: (setattr(zero1, "dist", real_dist), setattr(zero1, "zero1_shard", real_shard))
    return lambda: None


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lab_worker(rank, world_size, ports, out_dir, broken, runs):
    """Every run of this rank in one process, one after the other, each with its own group."""
    torch.set_num_threads(1)
    results = {}
    for (name, model_name, bucket_kb), port in zip(runs, ports):
        if name.startswith(("ddp", "torch-zero")):
            model, state_bytes = ddp_worker(rank, world_size, port, model_name, name == "torch-zero")
            results[name] = (state(model), state_bytes)
            continue
        lesson = overlap if name.startswith("overlap") else zero1
        lesson.make_model, saved = MODELS[model_name], lesson.make_model
        undo = install_break(broken, lesson)
        try:
            if lesson is overlap:
                model, _ = overlap.worker(rank, world_size, port, "gloo", EPOCHS, BATCH, bucket_kb)
                results[name] = (state(model), None)
            else:
                model, _, state_bytes = zero1.worker(rank, world_size, port, "gloo", EPOCHS, BATCH)
                results[name] = (state(model), state_bytes)
        finally:
            undo()
            lesson.make_model = saved
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def one_process(model_name="plain", lr=LR, ranks=range(WORLD)):
    """The same 16 steps in one process on the global batch: each step, both ranks' batches
    (`ranks`: only those ranks' batches; `lr`: another learning rate, for the diagnosis)."""
    model = MODELS[model_name](seed=0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                                momentum=0.9)
    for epoch in range(EPOCHS):
        batches = []
        for rank in ranks:
            sampler = dist_sampler(rank, WORLD)
            sampler.set_epoch(epoch)
            loader = torch.utils.data.DataLoader(sampler.dataset, batch_size=BATCH, sampler=sampler,
                                                 generator=torch.Generator().manual_seed(0))
            batches.append(list(loader))
        for parts in zip(*batches):
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return state(model)


RUNS = [("ddp", "plain", None), ("ddp-tied", "tied", None), ("overlap-per-parameter", "plain", 0),
        ("overlap-buckets", "plain", 4), ("overlap-tied", "tied", 4), ("zero1", "plain", None),
        ("zero1-tied", "tied", None), ("torch-zero", "plain", None)]


def run(world_size, runs, out_dir, broken=None):
    ports = [course.find_free_port() for _ in runs]
    course.spawn_or_fail(lab_worker, (world_size, ports, out_dir, broken, runs), world_size)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
            for r in range(world_size)]


def zero1_state_bytes(world_size, out_dir):
    folder = tempfile.mkdtemp(dir=out_dir)
    return [r["zero1"][1] for r in run(world_size, [("zero1", "plain", None)], folder)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    course.add_break_flag(parser, BREAKS)
    parser.add_argument("--profile", metavar="DIR", help="time and trace the three ways instead "
                        "(after backward, overlapping, DDP) and draw DIR/overlap.png")
    args = parser.parse_args(argv)
    if args.profile:
        import profile_overlap
        return profile_overlap.main(args.profile)
    print(f"2 ranks on gloo, each model from its own seed; {EPOCHS} epochs of {256 // (WORLD * BATCH)}"
          f" steps" + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""),
          flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prove06b_") as out_dir:
        ranks = run(WORLD, RUNS, out_dir, args.broken)
        state_bytes = {1: zero1_state_bytes(1, out_dir), 2: [r["zero1"][1] for r in ranks],
                       4: zero1_state_bytes(4, out_dir)}
    reference = one_process()
    passed = []
    for name, model_name, _ in RUNS[2:]:
        ddp = "ddp-tied" if model_name == "tied" else "ddp"
        same = all(torch.equal(r[name][0][k], r[ddp][0][k]) for r in ranks for k in r[ddp][0])
        dw = max(course.max_abs_diff(r[name][0], r[ddp][0]) for r in ranks)
        print(f"{name:22s} vs DDP, both ranks: {'bit-identical' if same else 'DIFFERENT'} "
              f"(max |dw| {dw:.1e})")
        passed.append(same)
    d_one = max(course.max_abs_diff(r["zero1"][0], reference) for r in ranks)
    ddp_bytes = 4 * sum(p.numel() for p in overlap.make_model().parameters())
    print(f"zero1 vs one process on the global batch: max |dw| {d_one:.1e}")
    for n, per_rank in state_bytes.items():
        print(f"zero1 optimizer state at {n} rank(s): {per_rank} bytes per rank "
              f"(DDP: {ddp_bytes} on every rank; 1/{n} = {ddp_bytes / n:.0f})")
    fair = all(max(b) <= -(-ddp_bytes // 4 // n) * 4 for n, b in state_bytes.items())
    print(f"torch's ZeroRedundancyOptimizer at 2 ranks: {[r['torch-zero'][1] for r in ranks]} bytes "
          "per rank: it shards whole parameters, so the largest sets the balance")
    print(f"{time.perf_counter() - start:.1f} s on {course.hardware()}")
    code = course.report_proof(
        all(passed) and d_one <= TOLERANCE and fair,
        "overlapping all-reduces (per parameter, in buckets, tied and frozen) and ZeRO-1 end "
        "bit-identical to DDP; ZeRO-1 equals one process and keeps 1/N of the optimizer state",
        f"torch.equal on {sum(passed)} of {len(passed)} runs; one process {d_one:.1e}",
        f"0 against DDP, {TOLERANCE:.0e} against one process")
    if code:
        likely_cause(ranks, reference, state_bytes, ddp_bytes)
    return code


def flat_trainable(model_name, state_dict=None):
    """The trainable parameters of MODELS[model_name] (seed 0: the start every rank broadcasts),
    or of `state_dict` loaded into it, as one flat vector in zero1_shard's order."""
    model = MODELS[model_name](seed=0)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


def never_moved(ranks, name, model_name):
    """For each rank of a ZeRO-1 run: (elements at their start value outside its own shard, the
    elements outside it, those at their start inside it)."""
    start, counts = flat_trainable(model_name), []
    k = -(-len(start) // WORLD)
    for r, result in enumerate(ranks):
        still = flat_trainable(model_name, result[name][0]) == start
        own = torch.zeros_like(still)
        own[r * k:(r + 1) * k] = True
        counts.append((int((still & ~own).sum()), int((~own).sum()), int((still & own).sum())))
    return counts


def likely_cause(ranks, reference, state_bytes, ddp_bytes):
    """The last line of a failed proof: which typical mistake the measurements fit (never read
    from the lessons' source), else what was measured."""
    overlap_line = lambda text: course.lesson_line("06_collectives/overlap.py", text)  # noqa
    zero1_line = lambda text: course.lesson_line("06_collectives/zero1.py", text)  # noqa
    apart = {name: course.max_abs_diff(ranks[0][name][0], ranks[1][name][0]) for name, _, _ in RUNS}
    vs_ddp = {name: max(course.max_abs_diff(r[name][0], r["ddp-tied" if m == "tied" else "ddp"][0])
                        for r in ranks) for name, m, _ in RUNS[2:]}
    own = [course.max_abs_diff(r["overlap-buckets"][0], one_process(ranks=[i]))
           for i, r in enumerate(ranks)]
    stuck = never_moved(ranks, "zero1", "plain")
    summed = {name: course.max_abs_diff(ranks[0][name][0], one_process(lr=LR * WORLD))
              for name in ("overlap-buckets", "zero1")}
    halved = {name: course.max_abs_diff(ranks[0][name][0], one_process(lr=LR / WORLD))
              for name in ("overlap-buckets", "zero1")}
    failed = [name for name, d in vs_ddp.items() if d > 0 and name != "torch-zero"]
    broadcast_line = (overlap_line if failed and "overlap" in failed[0] else zero1_line)(
        "dist.broadcast(")
    measured = (f"{', '.join(failed) or 'no run'} differ from DDP; between the ranks: "
                + ", ".join(f"{n} {apart[n]:.1e}" for n in failed or ["ddp"])
                + f"; ZeRO-1 rank 0 left {stuck[0][0]} of {stuck[0][1]} elements outside its "
                f"shard at their start; optimizer state per rank {state_bytes}")
    rows = lambda counts: ", ".join(f"rank {r} {c[0]} of {c[1]}" for r, c in  # noqa: E731
                                    enumerate(counts))
    course.diagnose([
        (apart["overlap-buckets"] > 0 and apart["ddp"] == 0 and max(own) <= TOLERANCE,
         f"optimizer.step() before finish(): the overlap ranks disagree (max |dw| "
         f"{apart['overlap-buckets']:.1e}, DDP's 0) and each rank's weights equal one process "
         f"trained on that rank's batches alone (max |dw| {max(own):.1e}): the step used this "
         f"rank's own gradient; wait for the all-reduces first ({overlap_line('finish()  #')})"),
        (all(c[0] == c[1] and c[2] < c[1] for c in stuck),
         f"the updated shards are never all-gathered: the parameters outside each rank's shard "
         f"are still at their start values ({rows(stuck)} elements), its own shard moved; "
         f"all_gather_into_tensor, then copy back into the model "
         f"({zero1_line('dist.all_gather_into_tensor(')})"),
        (any(d <= TOLERANCE for d in summed.values()),
         "the gradients are summed over the ranks, not averaged: "
         + ", ".join(f"{n} equals one process with lr x {WORLD} (max |dw| {d:.1e})"
                     for n, d in summed.items() if d <= TOLERANCE)
         + f"; divide by the world size ({overlap_line('/= world_size')}, "
         f"{zero1_line('/= world_size')})"),
        (any(d <= TOLERANCE for d in halved.values()),
         "the gradients are divided by the world size twice: "
         + ", ".join(f"{n} equals one process with lr / {WORLD} (max |dw| {d:.1e})"
                     for n, d in halved.items() if d <= TOLERANCE)
         + f"; divide once ({overlap_line('/= world_size')}, {zero1_line('/= world_size')})"),
        (any(apart[n] > 0 for n in failed),
         f"the ranks disagree after {', '.join(n for n in failed if apart[n] > 0)} (DDP's "
         f"agree): each rank starts from rank 0's weights, broadcast, and steps with the same "
         f"averaged gradient ({broadcast_line})"),
        (max(max(b) for b in state_bytes.values()) >= ddp_bytes and len(state_bytes) > 1,
         f"ZeRO-1 keeps the whole optimizer state on each rank: {state_bytes} bytes per rank, "
         f"DDP {ddp_bytes}; the optimizer sees only this rank's shard "
         f"({zero1_line('torch.optim.SGD([shard]')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
