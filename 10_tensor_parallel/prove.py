"""The lab of lesson 10: runs tensor_parallel.py and proves its four claims, in one launch of 4 ranks.

    python 10_tensor_parallel/prove.py
    python 10_tensor_parallel/prove.py --break sampler-defaults   # TP peers see other batches: FAILS
    python 10_tensor_parallel/prove.py --break gather-per-linear  # extra collectives: FAILS claim 2
    python 10_tensor_parallel/prove.py --break no-checkpoint      # nothing saved: FAILS claim 3
    python 10_tensor_parallel/prove.py --break old-all-gather     # wrong gradients: FAILS claim 4
    python 10_tensor_parallel/prove.py --break sampler-defaults no-checkpoint  # claims 1 and 3 fail
    python 10_tensor_parallel/prove.py --crash-rank 1             # rank 1 raises at step 2: stops

Claim 1: the lesson's TP on 2 ranks ends with the weights of one process trained on the same
batches; with SP too; and 2-D (FSDP over 2 x TP over 2, with SP and activation checkpointing) on 4
ranks ends with the weights of one process trained on the global batches. Tolerance 1e-5.
Claim 2: the collectives of one training step of TP and of SP, counted with their sizes, are the
README's: TP all-reduces, SP all-gathers and reduce-scatters the same bytes.
Claim 3: the bytes of parameters each rank holds are the README's (TP: 1/2 of the split layers;
2-D: half of that again); activation checkpointing keeps fewer activation bytes for backward
(measured) and changes no weight (claim 1).
Claim 4: context parallelism by hand: attention over a sequence split across 4 ranks, K and V
all-gathered with an autograd all-gather, equals full attention, forward and gradients.
"""
import argparse
import collections
import contextlib
import datetime
import functools
import inspect
import io
import math
import os
import sys
import tempfile
import time
import traceback
import warnings

if __name__ == "__main__" and sys.platform.startswith("linux"):  # course.start_method()'s rule
    import multiprocessing.forkserver  # start the ranks' forkserver now: it imports torch as we do
    multiprocessing.set_forkserver_preload(["__main__", "torch._dynamo"])  # as course.py's
    multiprocessing.forkserver.ensure_running()

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as old_functional  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed import _functional_collectives as funcol  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import SequenceParallel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("tensor_parallel", needs=(  # or the file given with --lesson PATH
    "make_dataset", "make_model", "parallelize", "train", "worker"))

TOLERANCE = 1e-5  # float32 sums in other orders: measured up to ~1e-7 here
BREAKS = {
    "sampler-defaults": "the 2-D runs build the sampler as lesson 07 did, DistributedSampler("
                        "dataset): 4 replicas by global rank, so the 2 ranks of a TP group "
                        "compute on different batches",
    "gather-per-linear": "the plan without its 'attn' and 'mlp' entries: q, k and v each gather "
                         "(SP) or all-reduce (TP) their input themselves",
    "no-checkpoint": "torch.utils.checkpoint.checkpoint replaced by a plain call: the blocks keep "
                     "every activation",
    "old-all-gather": "context parallelism gathers K and V with torch.distributed.nn.functional."
                      "all_gather, whose backward gives wrong gradients on gloo here",
    "sp-norm-not-reduced": "the plan without its SequenceParallel() entries: each tp rank "
                           "normalizes its piece of the sequence with plain parameters, whose "
                           "gradient is never all-reduced over the tp ranks",
}
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
JOBS = {  # name: (world size, tp, sp, act_ckpt); tp and sp run side by side on ranks 0-1, 2-3
    "tp": (2, 2, False, False), "sp": (2, 2, True, False), "2d-sp-ckpt": (4, 2, True, True)}


class CountCollectives(TorchDispatchMode):
    """Every collective the step runs, with its input's bytes: DTensor's own (a layer's input
    redistributed, a gradient made whole) included. Returning NotImplemented for DTensor lets
    DTensor run first and desugar into collectives this mode then sees (as CommDebugMode does)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func._overloadpacket.__name__ in COLLECTIVES:
            self.calls.append((func._overloadpacket.__name__, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


def local(tensor):
    """The bytes this rank holds: a DTensor's local shard (an async collective's result, waited)."""
    tensor = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return getattr(tensor, "elem", tensor)


def forward_keeping(model, x):
    """The model's output and the bytes of the tensors autograd keeps for backward, parameters left
    out (FSDP's whole ones too: they are the module's parameters while it runs); a storage shared
    by views counts once."""
    kept = {}

    def pack(tensor):
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in {local(p).untyped_storage().data_ptr() for p in model.parameters()}:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x)
    return out, sum(kept.values())


def measure_step(model, loader, device):
    """On the first batch of this rank: one forward and backward counted (collectives, kept bytes)
    and an optimizer step with lr 0 (SP's norm gradients are made whole there); then the same
    forward and backward with activation checkpointing switched the other way. No weight moves."""
    indices = list(loader.sampler)[:loader.batch_size]  # what the first step will train on
    x, y = (t.to(device) for t in loader.dataset[indices])
    blocks = [m for m in model.modules() if hasattr(m, "act_ckpt")]
    found = {"params": sum(local(p).nbytes for p in model.parameters())}
    counter = CountCollectives()
    with counter:
        out, found[f"kept ckpt={blocks[0].act_ckpt}"] = forward_keeping(model, x)
        forward = len(counter.calls)
        nn.functional.cross_entropy(out.transpose(1, 2), y).backward()
        backward = len(counter.calls)
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    found["collectives"] = {"forward": counter.calls[:forward],
                            "backward": counter.calls[forward:backward],
                            "step": counter.calls[backward:]}
    model.zero_grad()
    for block in blocks:
        block.act_ckpt = not block.act_ckpt
    out, found[f"kept ckpt={blocks[0].act_ckpt}"] = forward_keeping(model, x)
    nn.functional.cross_entropy(out.transpose(1, 2), y).backward()
    for block in blocks:
        block.act_ckpt = not block.act_ckpt
    model.zero_grad()
    return found


def whole(model):
    """Every parameter whole, on the CPU (EVERY rank calls it: DTensors are gathered)."""
    # a 2-D DTensor is gathered one dimension after the other, and torch says so on every rank:
    with course.quiet_logger("torch.distributed.tensor._redistribute"):  # for the check: fine
        return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
                for n, p in model.named_parameters()}


def measuring(train, kept):
    """Wraps the lesson's train: measures the first step (measure_step), trains, keeps the weights,
    the batch size and the learning rate the lesson used."""
    @functools.wraps(train)
    def wrapper(*args, **kwargs):
        arguments = inspect.signature(train).bind(*args, **kwargs).arguments
        model, loader, optimizer = arguments["model"], arguments["loader"], arguments["optimizer"]
        kept.update(measure_step(model, loader, arguments["device"]))
        kept["batches"] = [None] * dist.get_world_size()  # each rank's first batch, for the cause
        dist.all_gather_object(kept["batches"], list(loader.sampler)[:loader.batch_size])
        losses = train(*args, **kwargs)
        kept.update(weights=whole(model), losses=losses, batch_size=loader.batch_size,
                    lr=optimizer.param_groups[0]["lr"])
        everyone = [None] * dist.get_world_size()  # every rank's whole weights: all alike?
        dist.all_gather_object(everyone, kept["weights"])
        kept["ranks_apart"] = {n: max((w[n] - p).abs().max().item() for w in everyone)
                               for n, p in kept["weights"].items()}
        return losses
    return wrapper


def without_block_inputs(parallelize_module):
    """--break gather-per-linear: the lesson's plans less the entries that prepare the input of
    attention and of the MLP once."""
    @functools.wraps(parallelize_module)
    def wrapper(module, mesh, plan):
        if isinstance(plan, dict):
            plan = {k: v for k, v in plan.items() if k not in ("attn", "mlp")}
        return parallelize_module(module, mesh, plan)
    return wrapper


def without_sequence_parallel(parallelize_module):
    """--break sp-norm-not-reduced: the plans less their SequenceParallel() entries. The norms'
    inputs are still pieces of the sequence (the layers before them reduce-scatter), so each tp
    rank's norm sees its piece alone, with parameters outside DTensor: nothing sums their
    gradients over the tp ranks, as SequenceParallel's Replicate() parameters make DTensor do."""
    @functools.wraps(parallelize_module)
    def wrapper(module, mesh, plan):
        if isinstance(plan, dict):
            plan = {k: v for k, v in plan.items() if not isinstance(v, SequenceParallel)}
        return parallelize_module(module, mesh, plan)
    return wrapper


def context_parallel_attention(q, k, v, group, gather):
    """Causal attention for this rank's piece of the sequence (dim 2 of q, k, v: B, H, T/c, hd):
    K and V all-gathered, each query masked to the keys at or before its place in the whole."""
    rank, pieces, t = dist.get_rank(group), dist.get_world_size(group), q.shape[2]
    k_all, v_all = gather(k, group), gather(v, group)
    mask = torch.arange(rank * t, (rank + 1) * t)[:, None] >= torch.arange(pieces * t)[None, :]
    return nn.functional.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask.to(q.device))


def autograd_all_gather(x, group):  # its backward reduce-scatters: each rank gets its gradient
    """All-gathers dim 2 (the sequence). The function's docstring promises dim 0 only (its code,
    torch 2.15, does the others too): the sequence goes to dim 0 and back. A private module:
    torch's public all-gathers have no autograd, or the old one below. Its name: torch 2.15's
    all_gather_single_autograd; before, all_gather_tensor_autograd (2.15 deprecates that name)."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or \
        funcol.all_gather_tensor_autograd
    gathered = gather(x.movedim(2, 0).contiguous(), 0, group)
    if gathered.requires_grad:  # 2.11's backward reduce-scatters the gradient as it comes, and
        gathered.register_hook(torch.Tensor.contiguous)  # refuses it non-contiguous (movedim's)
    return gathered.movedim(0, 2)


def old_all_gather(x, group):
    """--break old-all-gather. Its backward makes its buffers with empty_like of the incoming
    gradient, non-contiguous here (the CPU attention's), and gloo scatters into non-contiguous
    buffers wrongly: pytorch/pytorch issues 192920 and 24836, open. Contiguous, it is exact."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, too
        return torch.cat(old_functional.all_gather(x, group=group), dim=2)


def prove_context_parallel(rank, device, broken):
    """Full causal attention on every rank (the same seeded q, k, v), then this rank's piece by
    context_parallel_attention; forward and gradients compared on this rank's piece. Then torch's
    own context_parallel is tried, and what it says is kept."""
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(2, 4, 16, 8, generator=g).to(device) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    (out * w).sum().backward()
    piece = slice(rank * 16 // dist.get_world_size(), (rank + 1) * 16 // dist.get_world_size())
    mine = [t[:, :, piece].clone().requires_grad_() for t in (q, k, v)]
    gather = old_all_gather if "old-all-gather" in broken else autograd_all_gather
    part = context_parallel_attention(*mine, dist.group.WORLD, gather)
    (part * w[:, :, piece]).sum().backward()
    found = {"forward": (part - out[:, :, piece]).abs().max().item(),
             "gradients": max((m.grad - f.grad[:, :, piece]).abs().max().item()
                              for m, f in zip(mine, full))}
    try:
        from torch.distributed.tensor.experimental import context_parallel
        mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
        buffers = [t.clone() for t in (q, k, v)]
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
            nn.functional.scaled_dot_product_attention(*buffers, is_causal=True)
        found["torch"] = "ran"
    except Exception as error:  # what torch says on this device, kept for the report
        found["torch"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return found


def lab_worker(rank, ports, backend, epochs, broken, crash_rank, timeout, out_dir):
    """Rank `rank` of the launch: round 1, ranks 0-1 run job tp and ranks 2-3 job sp (each the
    lesson's worker on 2 ranks); round 2, all four run 2d-sp-ckpt; round 3, context parallelism.
    Rank 0 of each job saves what it kept to <job>.pt."""
    if "gather-per-linear" in broken:
        lesson.parallelize_module = without_block_inputs(lesson.parallelize_module)
    if "no-checkpoint" in broken:
        lesson.checkpoint = lambda function, *args, **kwargs: function(*args)
    if "sp-norm-not-reduced" in broken:
        lesson.parallelize_module = without_sequence_parallel(lesson.parallelize_module)
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    train, quiet = lesson.train, contextlib.redirect_stdout(io.StringIO())  # jobs side by side
    try:
        for name in ["tp" if rank < 2 else "sp", "2d-sp-ckpt"]:
            world_size, tp, sp, act_ckpt = JOBS[name]
            job_rank = rank % world_size
            lesson.DistributedSampler = DistributedSampler  # as lesson 07 built it, on 2-D:
            if "sampler-defaults" in broken and world_size == 4:
                lesson.DistributedSampler = lambda dataset, *args, **kwargs: DistributedSampler(dataset)
            kept = {}
            lesson.train = measuring(train, kept)
            with quiet:
                lesson.worker(job_rank, world_size, ports[name], backend, tp, sp, act_ckpt, epochs,
                              timeout)
            if job_rank == 0:
                torch.save(kept, os.path.join(out_dir, f"{name}.pt"))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ports['cp']}", rank=rank,
                                world_size=4, timeout=datetime.timedelta(seconds=timeout),
                                device_id=device if device.type == "cuda" else None)
        try:
            found = prove_context_parallel(rank, device, broken)
            everyone = [None] * 4
            dist.all_gather_object(everyone, found)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            torch.save(everyone, os.path.join(out_dir, "context_parallel.pt"))
    except BaseException:  # print this rank's own error first: the spawner may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise


def train_reference(dp, epochs, batch_size, lr):
    """One process, plain PyTorch: the lesson's model on the union of what the dp ranks'
    samplers give at each step (dp = 1: the same batches as one TP group)."""
    dataset, model = lesson.make_dataset(), lesson.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        samplers = [DistributedSampler(dataset, dp, r, seed=0) for r in range(dp)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        orders = [list(s) for s in samplers]
        for start in range(0, len(orders[0]), batch_size):
            x, y = dataset[[i for order in orders for i in order[start:start + batch_size]]]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x).transpose(1, 2), y).backward()
            optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def theory_of_collectives(model, batch_size, tp, sp):
    """What one step must run, {(collective, input bytes): count}. M: one activation, whole."""
    x, _ = lesson.make_dataset()[:batch_size]
    blocks, dim, vocab = sum(hasattr(m, "attn") for m in model), model[0].embedding_dim, \
        model[-1].out_features
    M = batch_size * x.shape[1] * dim * 4  # float32
    logits = batch_size * x.shape[1] * vocab // tp * 4  # the head's columns, this rank's
    if not sp:  # 2 per block, the embedding's output; backward: 2 per block, the head's input
        return {"forward": {("all_reduce", M): 2 * blocks + 1, ("all_gather_into_tensor", logits): 1},
                "backward": {("all_reduce", M): 2 * blocks + 1}, "step": {}}
    gathers = collections.Counter({("all_gather_into_tensor", M // tp): 2 * blocks + 1})
    gathers[("all_gather_into_tensor", logits)] += 1  # before attention, the MLP, the head; logits
    norms = 2 * blocks + 1  # each norm's weight and bias: gradients summed over the sequence
    return {"forward": {**gathers, ("reduce_scatter_tensor", M): 2 * blocks + 1},
            "backward": {("reduce_scatter_tensor", M): 2 * blocks + 1,
                         ("all_gather_into_tensor", M // tp): 2 * blocks + 1},
            "step": {("all_reduce", dim * 4): 2 * norms}}


def bytes_sent(calls, ranks):
    """Per rank, by a ring: all-reduce 2(N-1)/N of the tensor, all-gather (N-1) x its input,
    reduce-scatter (N-1)/N of its input."""
    share = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather_into_tensor": ranks - 1,
             "reduce_scatter_tensor": (ranks - 1) / ranks}
    return round(sum(share[name] * size for name, size in calls))


def theory_of_params(model, tp, dp):
    """Bytes of parameters on rank 0, as the lesson's plan splits them: dim 1 of a row-split
    weight, dim 0 of the other split weights and biases (the embedding's too); the norms and the
    row-split biases whole on every TP rank. FSDP then keeps rows of each over dp. Rank 0 holds
    the first share, rounded up where a size does not divide."""
    row_split = ("attn.out.weight", "mlp.2.weight")
    total = 0
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if not (isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.LayerNorm)
                or name.endswith(("attn.out.bias", "mlp.2.bias"))):
            dim = 1 if name.endswith(row_split) else 0
            shape[dim] = -(-shape[dim] // tp)
        shape[0] = -(-shape[0] // dp)
        total += math.prod(shape) * p.element_size()
    return total


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, "tensor_parallel")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS, several=True)  # each fails a claim of its own
    p.add_argument("--crash-rank", type=int, help="this rank raises at its 2nd optimizer step: the "
                   "whole run must stop within seconds with that rank's own error")
    course.add_timeout_flag(p)
    args = p.parse_args(argv)
    args.broken = args.broken or []
    if args.epochs < 1 or args.timeout <= 0:
        course.refuse("--epochs and --timeout must be positive")
    course.refuse_bad_crash_rank(args.crash_rank, 4)
    return args


def report(runs, cp, args, device):
    """The four claims from what the ranks kept; returns the exit code."""
    one = lesson.make_model()
    worst = {}
    for name, (world_size, tp, sp, act_ckpt) in JOBS.items():
        run = runs[name]
        reference = train_reference(world_size // tp, args.epochs, run["batch_size"], run["lr"])
        worst[name] = course.max_abs_diff(run["weights"], reference)
        print(f"{name:<11} {world_size} ranks, against one process: max |dw| {worst[name]:.1e}")
    print("one step's collectives per rank (count x bytes each), measured == README's formula:")
    collectives_agree, sent = True, {}
    for name in ("tp", "sp"):
        expected = theory_of_collectives(one, runs[name]["batch_size"], 2, name == "sp")
        for phase, calls in runs[name]["collectives"].items():
            measured = collections.Counter(calls)
            agree = measured == collections.Counter(expected[phase])
            collectives_agree &= agree
            shown = ", ".join(f"{n} {c} x {s:,}" for (c, s), n in sorted(measured.items())) or "none"
            formula = ", ".join(f"{n} {c} x {s:,}" for (c, s), n in sorted(expected[phase].items()))
            print(f"  {name} {phase:<8} {shown}  " + ("== formula" if agree else
                                                     f"DIFFERS from formula ({formula or 'none'})"))
        sent[name] = bytes_sent([c for calls in runs[name]["collectives"].values() for c in calls], 2)
    print(f"  bytes each rank sends (ring): TP {sent['tp']:,}, SP {sent['sp']:,}")
    params_agree = True
    for name, (world_size, tp, _, _) in JOBS.items():
        expected = theory_of_params(one, tp, world_size // tp)
        params_agree &= runs[name]["params"] == expected
        print(f"{name:<11} per rank: parameters {runs[name]['params']:,} B (formula {expected:,}); "
              f"activations kept for backward {runs[name]['kept ckpt=False']:,} B, with "
              f"checkpointing {runs[name]['kept ckpt=True']:,} B")
    x, _ = lesson.make_dataset()[:runs["tp"]["batch_size"]]
    print(f"one process: parameters {sum(p.nbytes for p in one.parameters()):,} B; activations "
          f"kept for backward {forward_keeping(one, x)[1]:,} B (the same {len(x)} sequences)")
    off, on = runs["2d-sp-ckpt"]["kept ckpt=False"], runs["2d-sp-ckpt"]["kept ckpt=True"]
    checkpointing_saves = on < off / 2
    cp_forward = max(r["forward"] for r in cp)
    cp_gradients = max(r["gradients"] for r in cp)
    print(f"context parallel by hand, 4 ranks x 4 of 16 positions: max |d| forward {cp_forward:.1e}, "
          f"gradients {cp_gradients:.1e}")
    print(f"torch's own context_parallel on {device}: {cp[0]['torch']}")
    equal = max(worst.values()) <= TOLERANCE
    cp_equal = max(cp_forward, cp_gradients) <= TOLERANCE
    passed = equal and collectives_agree and params_agree and checkpointing_saves and cp_equal
    code = course.report_proof(
        passed,
        f"TP, SP and 2-D {'equal' if equal else 'do NOT equal'} one process; their collectives "
        f"{'are' if collectives_agree else 'are NOT'} the formula's; parameters per rank "
        f"{'are' if params_agree else 'are NOT'} the formula's; checkpointing "
        f"{'keeps' if checkpointing_saves else 'does NOT keep'} under half the activations; "
        f"context parallel attention {'equals' if cp_equal else 'does NOT equal'} full attention",
        f"max |dw| {max(worst.values()):.1e}; activations {on:,} B against {off:,} B; "
        f"context parallel {max(cp_forward, cp_gradients):.1e}", f"{TOLERANCE:.0e}, and half")
    if not passed:
        likely_cause(runs, worst, one, (cp_forward, cp_gradients), (on, off))
    return code


def likely_cause(runs, worst, one, cp, kept_bytes):
    """The last line of a failure: the typical mistakes the measurements fit (several breaks can
    run at once: each cause, in one line), never read from the learner's source; else what was
    measured."""
    where = lambda text: course.lesson_line("10_tensor_parallel/tensor_parallel.py", text)  # noqa
    causes, measured = [], []
    for name, (world_size, tp, sp, _) in JOBS.items():
        distinct = len({tuple(b) for b in runs[name]["batches"]})
        if worst[name] > TOLERANCE:
            measured.append(f"{name} leaves one process by {worst[name]:.1e}, its {world_size} "
                            f"ranks on {distinct} different first batches")
            if distinct > world_size // tp:
                causes.append(
                    f"the ranks of a TP group compute on different batches: in the {name} run the "
                    f"{world_size} ranks' first batches are {distinct} different ones, where "
                    f"{world_size // tp} (one per TP group) are right; build the sampler over the "
                    f"mesh's dp dimension ({where('DistributedSampler(dataset, mesh')})")
                break
    extra = {}
    for name in ("tp", "sp"):
        expected = theory_of_collectives(one, runs[name]["batch_size"], 2, name == "sp")
        for phase, calls in runs[name]["collectives"].items():
            more = len(calls) - sum(expected[phase].values())
            if more:
                extra[f"{name} {phase}"] = more
    if extra:
        said = ", ".join(f"{k} {v:+d}" for k, v in extra.items())
        measured.append(f"collectives against the formula: {said}")
        attn_line = where('"attn": whole')
        if all(v > 0 for v in extra.values()):
            causes.append(
                f"each of q, k and v gathers (SP) or all-reduces (TP) its input itself: "
                f"{said} collectives against the formula; keep the plan's entries that prepare the "
                f"input of attention and of the MLP once ({attn_line})")
    apart = {n: gap for n, gap in runs["sp"]["ranks_apart"].items() if gap > TOLERANCE}
    if apart and worst["sp"] > TOLERANCE and worst["tp"] <= TOLERANCE:
        name = max(apart, key=apart.get)
        fewer = -extra.get("sp step", 0)
        kinds = " and ".join(sorted({type(one.get_submodule(n.rpartition(".")[0])).__name__
                                     for n in apart}))
        measured.append(f"the sp run's ranks hold {len(apart)} whole parameter(s) apart")
        causes.append(
            f"a sequence-parallel norm's gradient is never all-reduced over the tp ranks: the sp "
            f"run's 2 ranks end with {len(apart)} whole parameter(s) of {kinds} apart, the largest "
            f"{name} ({apart[name]:.1e}), where every rank must hold the same; its optimizer step "
            f"runs {fewer} all-reduce(s) fewer than the formula (the norms' gradients made "
            f"whole); the tp run equals one process; give the norms SequenceParallel() in the "
            f"plan ({where('SequenceParallel(), ')})")
    on, off = kept_bytes
    if not on < off / 2:
        measured.append(f"activations kept {on:,} B with checkpointing, {off:,} B without")
        causes.append(f"activation checkpointing did not run: the blocks keep {on:,} B for "
                      f"backward with it asked for, {off:,} B without; call checkpoint(...) in "
                      f"the block's forward ({where('return checkpoint(')})")
    forward, gradients = cp
    if max(cp) > TOLERANCE:
        measured.append(f"context parallel forward {forward:.1e}, gradients {gradients:.1e}")
        if forward <= TOLERANCE:
            causes.append(
                f"the all-gather's backward gives wrong gradients: context parallel attention's "
                f"forward equals full attention ({forward:.1e}), its gradients are {gradients:.1e} "
                f"off; gather K and V with an autograd all-gather whose backward reduce-scatters "
                f"({course.lesson_line('10_tensor_parallel/prove.py', 'def autograd_all_gather')})")
    if causes:
        course.report_cause("; and ".join(causes))
    else:
        course.report_unknown("; ".join(measured) or "every claim's number is in tolerance")


def main(argv=None):
    args = parse_args(argv)
    backend, device, reason = course.backend_for(4, args.device)
    print(f"backend: {backend} ({reason}); 4 ranks: TP on 2 beside SP on 2, then 2-D 2 x 2 with SP "
          f"and activation checkpointing, then context parallelism" + "".join(
              f"; --break {name}: {BREAKS[name]}" for name in args.broken), flush=True)
    with tempfile.TemporaryDirectory(prefix="prove10_") as out_dir:
        start = time.perf_counter()
        ports = dict(zip([*JOBS, "cp"], course.find_free_ports(len(JOBS) + 1)))
        course.spawn_or_fail(lab_worker, (ports, backend, args.epochs,
                                          args.broken, args.crash_rank, args.timeout, out_dir), 4)
        took = time.perf_counter() - start
        runs = {name: torch.load(os.path.join(out_dir, f"{name}.pt"), weights_only=True)
                for name in JOBS}
        cp = torch.load(os.path.join(out_dir, "context_parallel.pt"), weights_only=True)
    print(f"the launch took {took:.1f} s on {course.hardware()}")
    return report(runs, cp, args, device)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
