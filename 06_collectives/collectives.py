"""Lesson 06: every collective on tiny tensors, DDP by hand, and a ring all-reduce from scratch.

    python 06_collectives/collectives.py                  # collectives and DDP at 2 ranks; the ring at 2, 3 and 4 ranks
    python 06_collectives/collectives.py --only ring --ring-world-sizes 3 5
    python 06_collectives/collectives.py --break ring     # the ring skips a step: its proof fails, exit 1

The proofs: each collective gives the expected output on every rank; averaging gradients by hand (one
all_reduce per parameter, or one per bucket) equals DDP; the ring equals dist.all_reduce, and each rank
sends 2(N-1)/N * S bytes on average, where the unchunked ring of the official tutorial sends (N-1) * S.
"""
import argparse
import copy
import datetime
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

TOLERANCE = 1e-5  # float32; summing N numbers in another order moves the result by ~1e-7 here, a missing rank by ~1
RING_SIZES = (1, 3, 10, 1000, 1001, 65537)  # elements; most do not divide by 2, 3 or 4, and 1 and 3 leave empty chunks
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR")
PARTS = ("collectives", "ddp", "ring")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks for the collectives and DDP parts (default 2)")
    p.add_argument("--ring-world-sizes", type=int, nargs="+", default=[2, 3, 4], help="world sizes the ring is checked at (default 2 3 4)")
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts (default: all three)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with one GPU per rank, else gloo")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if there is one GPU per rank, else cpu")
    p.add_argument("--bucket-kb", type=float, default=8, help="capacity of the hand-made gradient buckets in KiB (default 8)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps of the DDP-by-hand comparison (default 3)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a stuck collective raises instead of hanging (default 60)")
    p.add_argument("--out-dir", help="keep each rank's results (world<N>_rank<r>.pt) here; default: a temporary directory")
    p.add_argument("--break", dest="break_", choices=["ddp", "buckets", "ring"],
                   help="break one proof on purpose: ddp forgets to divide by the world size, buckets forgets the "
                        "last bucket, ring skips a reduce-scatter step; the run must then exit 1")
    args = p.parse_args(argv)
    if args.world_size < 2 or min(args.ring_world_sizes) < 2:
        p.error(f"world sizes must be at least 2 (a collective needs company), got {args.world_size} and {args.ring_world_sizes}")
    if args.bucket_kb <= 0 or args.steps < 1 or args.timeout <= 0:
        p.error("--bucket-kb, --steps and --timeout must be positive")
    sizes = set(args.ring_world_sizes) if "ring" in args.only else set()
    args.world_sizes = sorted(sizes | ({args.world_size} if {"collectives", "ddp"} & set(args.only) else set()))
    args.backend, args.device, args.reason = choose_backend(args.backend, args.device, max(args.world_sizes), p.error)
    return args


def choose_backend(backend, device, world_size, error):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; says why."""
    gpus = torch.cuda.device_count()
    if device == "auto":
        device = "cuda" if gpus >= world_size and backend != "gloo" else "cpu"
    if device == "cuda" and gpus < world_size:
        error(f"--device cuda needs one GPU per rank: world size {world_size}, but {gpus} GPU(s) visible")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        error(f"--backend nccl needs one GPU per rank: world size {world_size}, but {gpus} GPU(s) visible; use --backend gloo")
    if device == "cuda":
        reason = f"{gpus} GPU(s) visible, one per rank"
    elif gpus == 0:
        reason = "no GPU visible"
    else:
        reason = f"{gpus} GPU(s) visible for {world_size} ranks, or CPU requested"
    return backend, device, reason


def find_free_port():
    """Ask the OS for a port nobody uses now; a fixed port (12355, 29500) collides between jobs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exchange(send, recv, right, left):
    """Send to the right neighbour while receiving from the left one. Both are posted before either waits:
    two blocking dist.send calls facing each other wait forever (gloo's send waits for the matching recv)."""
    requests = [dist.isend(send, right), dist.irecv(recv, left)]
    for request in requests:
        request.wait()


def ring_all_reduce(tensor, skip_step=False, scratch=None):
    """Sum `tensor` over all ranks, in place, the way NCCL and gloo do: cut it into N chunks, then
    N-1 reduce-scatter steps and N-1 all-gather steps around the ring. Returns the bytes this rank sent.
    tensor must be contiguous (the chunks are views into it). scratch: a receive buffer of at least ceil(numel / N) elements to reuse across calls (fresh memory costs page faults)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % world, (rank - 1) % world
    chunks = tensor.view(-1).tensor_split(world)  # views into `tensor`; sizes differ by at most one element
    scratch = torch.empty_like(chunks[0]) if scratch is None else scratch  # chunk 0 is the largest
    sent = 0
    for step in range(world - 1 - skip_step):  # reduce-scatter: afterwards rank r holds the full sum of chunk r+1
        outgoing, incoming = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        exchange(outgoing, scratch[:incoming.numel()], right, left)
        incoming += scratch[:incoming.numel()]
        sent += outgoing.numel() * outgoing.element_size()
    for step in range(world - 1):  # all-gather: pass each finished chunk once around the ring
        outgoing, incoming = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        exchange(outgoing, incoming, right, left)
        sent += outgoing.numel() * outgoing.element_size()
    return sent


def tutorial_ring_all_reduce(tensor):
    """The official tutorial's ring ("Writing Distributed Applications with PyTorch"): correct, but it passes
    the WHOLE tensor N-1 times around the ring, so each rank sends (N-1) * S bytes instead of 2(N-1)/N * S."""
    world, rank = dist.get_world_size(), dist.get_rank()
    outgoing, incoming, sent = tensor.clone(), torch.empty_like(tensor), 0
    for _ in range(world - 1):
        exchange(outgoing, incoming, (rank + 1) % world, (rank - 1) % world)
        tensor += incoming
        outgoing, incoming = incoming, outgoing  # forward what just arrived
        sent += tensor.numel() * tensor.element_size()
    return sent


def demo_collectives(rank, world, device):
    """Each collective on tiny tensors: returns {name: (this rank's input, its output)}, on the CPU."""
    x = lambda: torch.arange(4.0, device=device) + 10 * rank  # rank 0: [0, 1, 2, 3], rank 1: [10, 11, 12, 13], ...
    cpu = lambda v: [u.cpu() for u in v] if isinstance(v, list) else None if v is None else v.cpu()
    seen, right, left = {}, (rank + 1) % world, (rank - 1) % world

    def out(shape):
        return torch.full(shape, -1.0, device=device)  # -1 = never written

    for op in ("SUM", "MAX"):
        t = x(); dist.all_reduce(t, op=getattr(dist.ReduceOp, op)); seen[f"all_reduce({op})"] = (x(), t)
    t = x(); dist.broadcast(t, src=0); seen["broadcast(src=0)"] = (x(), t)
    t = x(); dist.reduce(t, dst=0); seen["reduce(SUM, dst=0)"] = (x(), t)
    ts = [out((4,)) for _ in range(world)]; dist.all_gather(ts, x()); seen["all_gather"] = (x(), ts)
    t = out((4 * world,)); dist.all_gather_into_tensor(t, x()); seen["all_gather_into_tensor"] = (x(), t)
    ts = [out((4,)) for _ in range(world)] if rank == 0 else None; dist.gather(x(), ts, dst=0); seen["gather(dst=0)"] = (x(), ts)
    pieces = list(torch.arange(2.0 * world, device=device).chunk(world)) if rank == 0 else None  # only src's list is read
    t = out((2,)); dist.scatter(t, pieces, src=0); seen["scatter(src=0)"] = (pieces, t)
    big = torch.arange(2.0 * world, device=device) + 10 * rank
    t = out((2,)); dist.reduce_scatter_tensor(t, big); seen["reduce_scatter_tensor(SUM)"] = (big, t)
    mine = torch.arange(float(world), device=device) + 10 * rank  # element j goes to rank j
    t = out((world,)); dist.all_to_all_single(t, mine); seen["all_to_all_single"] = (mine, t)
    t = out((4,))
    if rank % 2 == 0:  # blocking calls need an order: if every rank sent first, all would wait forever
        dist.send(x(), right); dist.recv(t, left)
    else:
        dist.recv(t, left); dist.send(x(), right)
    seen["send/recv (to rank+1)"] = (x(), t)
    t, mine = out((4,)), x()
    exchange(mine, t, right, left)  # isend and irecv, both posted, then waited on
    seen["isend/irecv (to rank+1)"] = (mine, t)
    time.sleep(0.2 * rank)  # ranks reach the barrier at different times ...
    arrived = time.time()
    dist.barrier()  # ... and all leave it together, once the last one has arrived
    seen["barrier"] = (torch.tensor([arrived], dtype=torch.float64), torch.tensor([time.time()], dtype=torch.float64))
    seen = {name: (cpu(given), cpu(got)) for name, (given, got) in seen.items()}
    ops = {}
    for op in REDUCE_OPS:  # every ReduceOp but PREMUL_SUM (NCCL's, see the README); the bitwise ones need integers
        t = torch.arange(4, device=device) + 10 * rank
        t = t if op.startswith("B") else t.float()
        try:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            ops[op] = t.cpu()
        except (RuntimeError, ValueError) as e:
            ops[op] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"seen": seen, "ops": ops}


def make_model(device):
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


def spread_across_ranks(t):
    """Largest element-wise difference of t between any two ranks (0.0 means identical everywhere)."""
    high, low = t.detach().clone(), t.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def average_gradients(model, world, divide=True):
    """DDP by hand, plainest form: one all_reduce per parameter, then divide by the world size."""
    for p in model.parameters():
        dist.all_reduce(p.grad)  # sum over ranks
        if divide:
            p.grad /= world  # the mean, which is what DDP gives


def make_buckets(params, cap_bytes, forget_last=False):
    """Group parameters into buckets of at most cap_bytes (one parameter may exceed it alone), last layer first:
    backward() produces gradients in that order, which is why DDP buckets them that way."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return buckets if forget_last else buckets + [current]  # the classic bug: never flushing the last bucket


def average_gradients_bucketed(buckets, world):
    """DDP by hand, bucketed: one all_reduce per bucket of flattened gradients, then copy the pieces back."""
    for bucket in buckets:
        message = flat(p.grad for p in bucket)  # one message instead of len(bucket)
        dist.all_reduce(message)
        message /= world
        for p, piece in zip(bucket, message.split([p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p))


def ddp_by_hand(rank, world, device, args):
    """Train three copies side by side on this rank's data: DDP, per-parameter all_reduce, bucketed all_reduce."""
    torch.manual_seed(rank)  # different initial weights on every rank, on purpose ...
    model = make_model(device)
    before = spread_across_ranks(flat(model.parameters()))
    for p in model.parameters():
        dist.broadcast(p.data, src=0)  # ... so that we must do what DDP's constructor does: broadcast rank 0's
    after = spread_across_ranks(flat(model.parameters()))
    by_param, by_bucket = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DDP(copy.deepcopy(model), device_ids=[rank] if device.type == "cuda" else None)
    buckets = make_buckets(by_bucket.parameters(), args.bucket_kb * 1024, forget_last=args.break_ == "buckets")
    models = (ddp, by_param, by_bucket)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    data = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    grad_diff, unsynced = {"param": 0.0, "bucket": 0.0}, None
    for _ in range(args.steps):
        x, y = torch.randn(16, 20, generator=data).to(device), torch.randint(0, 4, (16,), generator=data).to(device)
        for m, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()  # DDP averages inside backward(); the copies do not
        if unsynced is None:
            unsynced = spread_across_ranks(flat(p.grad for p in by_param.parameters()))
        average_gradients(by_param, world, divide=args.break_ != "ddp")
        average_gradients_bucketed(buckets, world)
        reference = flat(p.grad for p in ddp.module.parameters())
        for name, m in (("param", by_param), ("bucket", by_bucket)):
            grad_diff[name] = max(grad_diff[name], (flat(p.grad for p in m.parameters()) - reference).abs().max().item())
        for optimizer in optimizers:
            optimizer.step()
    weights = flat(ddp.module.parameters())
    return {"before": before, "after": after, "unsynced": unsynced, "grad_diff": grad_diff,
            "dw": {name: (flat(m.parameters()) - weights).abs().max().item() for name, m in (("param", by_param), ("bucket", by_bucket))},
            "params": sum(1 for _ in model.parameters()), "numel": weights.numel(), "steps": args.steps,
            "buckets": [sum(p.numel() * p.element_size() for p in b) for b in buckets]}


def ring_checks(rank, world, device, broken):
    """The ring and the tutorial's ring against dist.all_reduce, on random data of awkward sizes."""
    rows = []
    for numel in RING_SIZES:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(device)
        reference, ring, tutorial = x.clone(), x.clone(), x.clone()
        dist.all_reduce(reference)
        sent = ring_all_reduce(ring, skip_step=broken)
        sent_tutorial = tutorial_ring_all_reduce(tutorial)
        rows.append({"numel": numel, "bytes": numel * x.element_size(), "sent": sent, "sent_tutorial": sent_tutorial,
                     "diff": (ring - reference).abs().max().item(), "diff_tutorial": (tutorial - reference).abs().max().item()})
    return rows


def worker(rank, args, world, parts, port, out_dir):
    """One rank: runs the parts asked for and saves what it saw to world<N>_rank<r>.pt; prints nothing."""
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout), device_id=device if args.device == "cuda" else None)
    try:
        results = {}
        if "collectives" in parts:
            results["collectives"] = demo_collectives(rank, world, device)
        if "ddp" in parts:
            results["ddp"] = ddp_by_hand(rank, world, device, args)
        if "ring" in parts:
            results["ring"] = ring_checks(rank, world, device, args.break_ == "ring")
        torch.save(results, os.path.join(out_dir, f"world{world}_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


UNDEFINED = "undefined"


def expected(name, inputs, world):
    """What each rank must hold afterwards, worked out from the inputs alone (None: nothing; UNDEFINED: not checked)."""
    if name == "scatter(src=0)":
        return list(inputs[0])  # rank r receives piece r of the source's list
    x = torch.stack(inputs)  # row r = rank r's input
    shifted = [x[(r - 1) % world] for r in range(world)]  # what rank r gets from its left neighbour
    return {"all_reduce(SUM)": lambda: [x.sum(0)] * world, "all_reduce(MAX)": lambda: [x.max(0).values] * world,
            "broadcast(src=0)": lambda: [x[0]] * world, "reduce(SUM, dst=0)": lambda: [x.sum(0)] + [UNDEFINED] * (world - 1),
            "all_gather": lambda: [list(x)] * world, "all_gather_into_tensor": lambda: [x.flatten()] * world,
            "gather(dst=0)": lambda: [list(x)] + [None] * (world - 1),
            "reduce_scatter_tensor(SUM)": lambda: list(x.sum(0).chunk(world)),
            "all_to_all_single": lambda: list(x.t()),  # rank r gets element r of every rank's input
            "send/recv (to rank+1)": lambda: shifted, "isend/irecv (to rank+1)": lambda: shifted}[name]()


def matches(got, want):
    if isinstance(want, str):
        return True
    if want is None or got is None:
        return want is None and got is None
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(matches(g, w) for g, w in zip(got, want))
    return torch.equal(got.double(), want.double())


def show(v):
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(map(show, v)) + "]"
    return "[" + ", ".join(f"{a:g}" for a in v.tolist()) + "]"


def report_collectives(results, world, backend):
    print(f"\n== every collective, world size {world}: each rank's input -> its output, checked against the expected values")
    bad, checked = 0, 0
    for name in results[0]["collectives"]["seen"]:
        inputs, outputs = zip(*(r["collectives"]["seen"][name] for r in results))
        if name == "barrier":
            start = min(t.item() for t in inputs)
            ok = min(t.item() for t in outputs) >= max(t.item() for t in inputs) - 1e-3  # nobody left before the last arrived
            for rank in range(world):
                print(f"{name if rank == 0 else '':<28}rank {rank}: arrives at +{inputs[rank].item() - start:.2f} s "
                      f"-> leaves at +{outputs[rank].item() - start:.2f} s{'' if ok else '   MISMATCH: left before the last arrival'}")
            bad, checked = bad + (not ok), checked + 1
            continue
        want = expected(name, list(inputs), world)
        for rank in range(world):
            ok = matches(outputs[rank], want[rank])
            note = "   (not the destination: undefined, not checked)" if want[rank] == UNDEFINED else "" if ok else f"   MISMATCH, expected {show(want[rank])}"
            print(f"{name if rank == 0 else '':<28}rank {rank}: {show(inputs[rank]):<18} -> {show(outputs[rank])}{note}")
            bad += not ok
        checked += 1
    ints = torch.stack([torch.arange(4) + 10 * r for r in range(world)])
    want = {"SUM": ints.sum(0), "PRODUCT": ints.prod(0), "MIN": ints.min(0).values, "MAX": ints.max(0).values,
            "AVG": ints.double().mean(0), "BAND": ints[0], "BOR": ints[0], "BXOR": ints[0]}
    for r in range(1, world):
        want["BAND"], want["BOR"], want["BXOR"] = want["BAND"] & ints[r], want["BOR"] | ints[r], want["BXOR"] ^ ints[r]
    print(f"all_reduce with every ReduceOp, input [0, 1, 2, 3] + 10 * rank (int64 for the bitwise ones, else float32):")
    refused = []
    for op in REDUCE_OPS:
        got = [r["collectives"]["ops"][op] for r in results]
        if isinstance(got[0], str):
            refused.append(op)
            print(f"    {op:<8} refused: {got[0]}")
            continue
        ok = all(matches(g, want[op]) for g in got)
        bad += not ok
        print(f"    {op:<8} -> {show(got[0])} on every rank{'' if ok else f'   MISMATCH, expected {show(want[op])}'}")
    passed = bad == 0
    print(f"PROOF {'PASSED' if passed else 'FAILED'}: {checked} collectives and {len(REDUCE_OPS) - len(refused)} ReduceOps gave the "
          f"expected output on all {world} ranks ({bad} mismatches; refused by {backend}: "
          f"{', '.join(refused) or 'none'})")
    return passed


def report_ddp(results, world, args):
    d = results[0]["ddp"]
    worst = lambda key, name: max(r["ddp"][key][name] for r in results)
    print(f"\n== DDP by hand, world size {world}: MLP 20-64-64-4 ({d['params']} parameters, {d['numel']:,} values), float32, "
          f"{d['steps']} SGD steps, each rank its own data")
    print(f"initial weights differ across ranks by {d['before']:.1e} (seeded per rank); after dist.broadcast from rank 0: {d['after']:.1e}")
    print(f"right after backward() on a plain model, gradients differ across ranks by {d['unsynced']:.1e}: "
          f"backward() alone synchronises nothing")
    passed = True
    for name, how, calls in (("param", f"one all_reduce per parameter{'' if args.break_ == 'ddp' else f', divided by {world},'}", d["params"]),
                             ("bucket", f"{len(d['buckets'])} buckets of {', '.join(map(str, d['buckets']))} bytes (cap {args.bucket_kb:g} KiB)", len(d["buckets"]))):
        ok = worst("grad_diff", name) <= TOLERANCE and worst("dw", name) <= TOLERANCE and d["after"] == 0.0
        passed &= ok
        print(f"PROOF {'PASSED' if ok else 'FAILED'}: {how} {'equals' if ok else 'does NOT equal'} DDP: max |grad diff| "
              f"{worst('grad_diff', name):.1e}, max |dw| {worst('dw', name):.1e} after {d['steps']} steps "
              f"({calls} all_reduce calls per step; tolerance {TOLERANCE:.0e})")
    return passed


def report_ring(by_world):
    print("\n== ring all-reduce from scratch: N chunks, N-1 reduce-scatter steps, then N-1 all-gather steps, isend/irecv to rank+1")
    print(f"{'N':>2} {'elements':>8} {'S bytes':>8}  {'sent by each rank':<26} {'mean':>8} {'2(N-1)/N*S':>10}  "
          f"{'tutorial (N-1)*S':>16}  max |ring - all_reduce|, tutorial's")
    worst, ok_bytes, uneven = 0.0, True, 0
    for world, results in sorted(by_world.items()):
        for i, row in enumerate(results[0]["ring"]):
            rows = [r["ring"][i] for r in results]
            s, sent = row["bytes"], [r["sent"] for r in rows]
            ok_bytes &= sum(sent) == 2 * (world - 1) * s and all(r["sent_tutorial"] == (world - 1) * s for r in rows)
            diff, diff_tutorial = max(r["diff"] for r in rows), max(r["diff_tutorial"] for r in rows)
            worst, uneven = max(worst, diff, diff_tutorial), uneven + (row["numel"] % world != 0)
            print(f"{world:>2} {row['numel']:>8} {s:>8}  {' '.join(map(str, sent)):<26} {sum(sent) / world:>8g} "
                  f"{2 * (world - 1) / world * s:>10g}  {rows[0]['sent_tutorial']:>16}  {diff:.1e}, {diff_tutorial:.1e}")
    passed = worst <= TOLERANCE and ok_bytes
    sizes = sorted(by_world)
    print(f"PROOF {'PASSED' if passed else 'FAILED'}: the ring {'equals' if worst <= TOLERANCE else 'does NOT equal'} dist.all_reduce "
          f"at N = {', '.join(map(str, sizes))} for {len(RING_SIZES)} sizes each ({uneven} cases not divisible by N): max |diff| "
          f"{worst:.1e} (tolerance {TOLERANCE:.0e}); each rank sent 2(N-1)/N * S bytes on average: "
          f"{'yes' if ok_bytes else 'NO'}; the tutorial's unchunked ring sends (N-1) * S, "
          f"{', '.join(f'{n / 2:g}x' for n in sizes)} as much at N = {', '.join(map(str, sizes))}")
    return passed


def main(argv=None):
    args = parse_args(argv)
    print(f"backend: {args.backend} on {args.device} ({args.reason}); world size {args.world_size}; "
          f"parts: {', '.join(args.only)}"
          f"{'; ring checked at world sizes ' + ', '.join(map(str, args.ring_world_sizes)) if 'ring' in args.only else ''}"
          f"{f'; --break {args.break_}: a proof must FAIL' if args.break_ else ''}", flush=True)
    with tempfile.TemporaryDirectory(prefix="collectives_") as scratch:
        out_dir = args.out_dir or scratch
        os.makedirs(out_dir, exist_ok=True)
        start = time.perf_counter()
        for world in args.world_sizes:
            parts = [p for p in args.only if p == "ring" and world in args.ring_world_sizes or p != "ring" and world == args.world_size]
            try:
                mp.spawn(worker, args=(args, world, parts, find_free_port(), out_dir), nprocs=world, join=True)
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # spawn has already stopped the other ranks
                print(f"\nRUN FAILED: a rank stopped with an error, so every rank was stopped.\n{e}", file=sys.stderr)
                return 1
        results = {w: [torch.load(os.path.join(out_dir, f"world{w}_rank{r}.pt"), map_location="cpu", weights_only=True)
                       for r in range(w)] for w in args.world_sizes}
    print(f"{len(args.world_sizes)} process group(s) of {', '.join(map(str, args.world_sizes))} ranks ran in {time.perf_counter() - start:.1f} s")
    passed = []
    if "collectives" in args.only:
        passed.append(report_collectives(results[args.world_size], args.world_size, args.backend))
    if "ddp" in args.only:
        passed.append(report_ddp(results[args.world_size], args.world_size, args))
    if "ring" in args.only:
        passed.append(report_ring({w: results[w] for w in args.ring_world_sizes}))
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())
