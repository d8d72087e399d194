"""The lab of lesson 06: runs collectives.py and proves its claims.

    python 06_collectives/prove.py                               # the proof: 2 ranks; the ring at 2, 3, 4
    python 06_collectives/prove.py --break no-divide             # gradients summed, not averaged: FAILS
    python 06_collectives/prove.py --break forget-last-bucket    # the last bucket never travels: FAILS
    python 06_collectives/prove.py --break ring-skips-a-step --ring-world-sizes 3   # FAILS
    python 06_collectives/prove.py --crash-rank 1                # rank 1 raises at step 2: the run stops

The claims: the lesson's worker, which averages the gradients by hand (one all_reduce per parameter;
in buckets; the buckets all-reduced by the lesson's ring), ends with bit-identical ranks equal to
DDP (lesson 02's worker on the same data); the ring equals dist.all_reduce at N = 2, 3 and 4 ranks,
on sizes that N does not divide, and each rank sends 2(N-1)/N * S bytes on average. The default run
also shows every collective on 2 ranks, each output checked against the value worked out by hand.
"""
import argparse
import contextlib
import datetime
import io
import math
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import course  # noqa: E402
lesson = course.import_lesson("collectives", needs=(  # or the file given with --lesson PATH
    "average_gradients", "make_buckets", "ring_all_reduce", "ring_step", "worker"))

TOLERANCE = 1e-5  # float32: another summation order moves a value by ~1e-7, a sync bug by ~1e-1
RING_SIZES = (1, 3, 10, 1000, 1001, 65537)  # floats; most do not divide by 2, 3 or 4; 1 and 3 leave
# some ranks an empty chunk
BREAKS = {
    "no-divide": "average_gradients sums the gradients and never divides by N: every step is N "
                 "times DDP's, as if the learning rate grew with the number of ranks",
    "forget-last-bucket": "make_buckets never returns its last bucket (the first layer's): those "
                          "gradients are never all-reduced, each rank steps on its own",
    "ring-skips-a-step": "the ring skips its last reduce-scatter step: each summed chunk misses one "
                         "rank's part",
}


def load_ddp_lesson():
    """Lesson 02's script: its worker, with DDP, is the reference the hand-made averaging must equal."""
    return course.load_lesson("02_ddp_spawn/ddp_spawn.py")


ddp_lesson = load_ddp_lesson()


def modes(bucket_kb):
    """(name, bucket_kb, ring): the three ways the lab runs the lesson's worker."""
    return [("one all_reduce per parameter", 0, False),
            (f"buckets of at most {bucket_kb:g} KiB, dist.all_reduce", bucket_kb, False),
            ("the same buckets, all-reduced by the lesson's ring", bucket_kb, True)]


# --- the breaks: alternatives to the lesson's functions, installed inside the spawned ranks only --

def sum_gradients(buckets, world_size, all_reduce):
    """--break no-divide: the lesson's average_gradients without its `flat /= world_size`."""
    for bucket in buckets:
        flat = torch.cat([p.grad.flatten() for p in bucket])
        all_reduce(flat)
        for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p))


def forgetting_the_last_bucket(make_buckets):
    """--break forget-last-bucket: the classic bucketing bug, the last partly filled bucket dropped."""
    return lambda params, cap_bytes: make_buckets(params, cap_bytes)[:-1]


def skipping_a_step(ring_step):
    """--break ring-skips-a-step: every ring all-reduce makes 2(N-1) steps; its N-1-th (the last
    of the reduce-scatter) sends nothing and receives zeros."""
    calls = [0]

    def step(send, recv, right, left):
        n = dist.get_world_size()
        calls[0] += 1
        if calls[0] % (2 * (n - 1)) == n - 1:
            recv.zero_()
            return 0
        return ring_step(send, recv, right, left)
    return step


def install_break(broken):
    if broken == "no-divide":
        lesson.average_gradients = sum_gradients
    elif broken == "forget-last-bucket":
        lesson.make_buckets = forgetting_the_last_bucket(lesson.make_buckets)
    elif broken == "ring-skips-a-step":
        lesson.ring_step = skipping_a_step(lesson.ring_step)


# --- what the ranks run -----------------------------------------------------------------------------

def device_for(rank, backend):
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


@contextlib.contextmanager
def process_group(rank, world_size, port, backend, timeout):
    """The lab's own group, for the ring checks and the tour (the lesson's worker makes its own)."""
    device = device_for(rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def check_ring(device, sizes=RING_SIZES):
    """The lesson's ring_all_reduce against dist.all_reduce on random data; rows for the report."""
    rank, rows = dist.get_rank(), []
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(device)
        ring, reference = x.clone(), x.clone()
        sent = lesson.ring_all_reduce(ring)
        dist.all_reduce(reference)
        rows.append({"numel": numel, "sent": sent, "diff": (ring - reference).abs().max().item()})
    return rows


def probe_averaging(device, bucket_kb):
    """The lesson's make_buckets and average_gradients on the lesson's model, every gradient set to
    rank + 1: {parameter: what came back, as a multiple of the mean (n + 1) / 2}, and the names of
    the parameters that no bucket holds."""
    rank, n = dist.get_rank(), dist.get_world_size()
    model = lesson.make_model().to(device)
    for p in model.parameters():
        p.grad = torch.full_like(p, rank + 1.0)
    buckets = lesson.make_buckets(list(model.parameters()), bucket_kb * 1024)
    held = {id(p) for bucket in buckets for p in bucket}
    lesson.average_gradients(buckets, n, dist.all_reduce)
    return {"ratio": {name: p.grad.mean().item() / ((n + 1) / 2) for name, p in
                      model.named_parameters()},
            "unbucketed": [name for name, p in model.named_parameters() if id(p) not in held]}


def probe_ring(device, numel=7):
    """The lesson's ring on x = 2**rank everywhere: how many ranks' parts each element holds
    (the bits of the sum), fewest and most."""
    x = torch.full((numel,), 2.0 ** dist.get_rank(), device=device)
    lesson.ring_all_reduce(x)
    parts = [bin(int(v)).count("1") if 0 < v < 2 ** dist.get_world_size() and v == int(v) else 0
             for v in x.tolist()]
    return min(parts), max(parts)


def tour(device):
    """Every collective on tiny tensors: {name: (this rank's input, its output)}, on the CPU."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = lambda: torch.arange(4.0, device=device) + 10 * rank  # noqa: E731  rank 1: [10, 11, 12, 13]
    blank = lambda *shape: torch.full(shape, -1.0, device=device)  # noqa: E731  -1: never written
    seen = {}
    t = x(); dist.broadcast(t, src=0); seen["broadcast(src=0)"] = (x(), t)  # noqa: E702
    t = x(); dist.reduce(t, dst=0); seen["reduce(SUM, dst=0)"] = (x(), t)  # noqa: E702
    t = x(); dist.all_reduce(t); seen["all_reduce(SUM)"] = (x(), t)  # noqa: E702
    t = x(); dist.all_reduce(t, op=dist.ReduceOp.MAX); seen["all_reduce(MAX)"] = (x(), t)  # noqa: E702
    ts = [blank(4) for _ in range(n)]
    dist.all_gather(ts, x())
    seen["all_gather"] = (x(), ts)
    ts = [blank(4) for _ in range(n)] if rank == 0 else None
    dist.gather(x(), ts, dst=0)
    seen["gather(dst=0)"] = (x(), ts)
    pieces = list(torch.arange(2.0 * n, device=device).chunk(n)) if rank == 0 else None
    t = blank(2)
    dist.scatter(t, pieces, src=0)
    seen["scatter(src=0)"] = (pieces, t)
    big = torch.arange(2.0 * n, device=device) + 10 * rank
    t = blank(2)
    dist.reduce_scatter_tensor(t, big)
    seen["reduce_scatter(SUM)"] = (big, t)
    mine = torch.arange(float(n), device=device) + 10 * rank  # element j goes to rank j
    t = blank(n)
    dist.all_to_all_single(t, mine)
    seen["all_to_all"] = (mine, t)
    time.sleep(0.2 * rank)  # the ranks reach the barrier at different times ...
    arrived = time.time()
    dist.barrier()  # ... and leave it together, once the last one has arrived
    seen["barrier"] = (torch.tensor([arrived], dtype=torch.float64),
                       torch.tensor([time.time()], dtype=torch.float64))
    cpu = lambda v: [u.cpu() for u in v] if isinstance(v, list) else None if v is None else v.cpu()  # noqa
    return {name: (cpu(given), cpu(got)) for name, (given, got) in seen.items()}


def state_of(model):
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def lab_worker(rank, world_size, ports, backend, epochs, batch_size, lr, bucket_kb, out_dir, broken,
               crash_rank, timeout):
    """Runs the lesson's worker unchanged (but for --break) in its three modes, lesson 02's DDP
    worker on the same data, then the ring checks and the tour; saves what it got to rank<r>.pt."""
    install_break(broken)
    if rank == crash_rank:
        course.crash_at_step(rank, 2)
    try:
        states, buckets = [], []
        for (_, kb, ring), port in zip(modes(bucket_kb), ports):
            model, _ = lesson.worker(rank, world_size, port, backend, epochs, batch_size, kb, ring,
                                     lr, timeout)
            states.append(state_of(model))
            built = lesson.make_buckets(model.parameters(), kb * 1024)
            buckets.append([sum(p.numel() * p.element_size() for p in b) for b in built])
        with contextlib.redirect_stdout(io.StringIO()):  # its lines would repeat the lesson's
            ddp_model, _ = ddp_lesson.worker(rank, world_size, ports[3], backend, epochs, batch_size,
                                             lr, timeout)
        with process_group(rank, world_size, ports[4], backend, timeout) as device:
            ring, seen = check_ring(device), tour(device)
            probe = {**probe_averaging(device, bucket_kb), "ring": probe_ring(device)}
    except BaseException:  # print this rank's own error first: mp.spawn may report a peer's
        traceback.print_exc()
        sys.stderr.flush()
        raise
    torch.save({"states": states, "buckets": buckets, "ddp": state_of(ddp_model), "ring": ring,
                "tour": seen, "probe": probe}, os.path.join(out_dir, f"rank{rank}.pt"))


def ring_worker(rank, world_size, port, backend, out_dir, broken, timeout):
    """The ring checks alone, at another world size."""
    install_break(broken)
    with process_group(rank, world_size, port, backend, timeout) as device:
        rows = check_ring(device)
        parts = probe_ring(device)
    torch.save(rows, os.path.join(out_dir, f"ring{world_size}_rank{rank}.pt"))
    torch.save(parts, os.path.join(out_dir, f"ring{world_size}_parts{rank}.pt"))


def trace_worker(rank, world_size, port, out_dir):
    """The lesson's ring on a tiny tensor, [1, 2, ..., N] * 10**rank, every step recorded (the
    notebook prints them): (step, chunk sent, values sent, values received)."""
    steps, original = [], lesson.ring_step

    def recording(send, recv, right, left):
        sent = original(send, recv, right, left)
        steps.append((len(steps) + 1, send.tolist(), recv.tolist()))
        return sent
    lesson.ring_step = recording
    with process_group(rank, world_size, port, "gloo", 60):
        x = torch.arange(1.0, world_size + 1) * 10 ** rank
        given, sent = x.tolist(), lesson.ring_all_reduce(x)
    torch.save({"given": given, "steps": steps, "result": x.tolist(), "sent": sent},
               os.path.join(out_dir, f"trace_rank{rank}.pt"))


def trace_ring(world_size=3):
    with tempfile.TemporaryDirectory(prefix="prove06_") as out_dir:
        course.spawn_or_fail(trace_worker, (world_size, course.find_free_port(), out_dir), world_size)
        return [torch.load(os.path.join(out_dir, f"trace_rank{r}.pt"), weights_only=True)
                for r in range(world_size)]


def run_training(world_size=2, epochs=2, batch_size=16, lr=0.05, bucket_kb=4, backend="gloo",
                 broken=None, crash_rank=None, timeout=60):
    """Spawns the training ranks; returns what each saved (the notebook calls this too)."""
    with tempfile.TemporaryDirectory(prefix="prove06_") as out_dir:
        ports = [course.find_free_port() for _ in range(5)]
        course.spawn_or_fail(lab_worker, (world_size, ports, backend, epochs, batch_size, lr, bucket_kb,
                                          out_dir, broken, crash_rank, timeout), world_size)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True)
                for r in range(world_size)]


def run_ring(world_size, backend="gloo", broken=None, timeout=60, parts=None):
    """The ring checks at world_size; `parts`, a dict, gets {world_size: each rank's probe_ring}."""
    with tempfile.TemporaryDirectory(prefix="prove06_") as out_dir:
        course.spawn_or_fail(ring_worker, (world_size, course.find_free_port(), backend, out_dir,
                                           broken, timeout), world_size)
        if parts is not None:
            parts[world_size] = [torch.load(os.path.join(out_dir, f"ring{world_size}_parts{r}.pt"))
                                 for r in range(world_size)]
        return [torch.load(os.path.join(out_dir, f"ring{world_size}_rank{r}.pt"), weights_only=True)
                for r in range(world_size)]


# --- the checks, in the parent ------------------------------------------------------------------

def chunk_sizes(numel, n):
    """torch.tensor_split's sizes: the first numel % n chunks one element more."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def bytes_each_rank_sends(numel, n, element_size=4):
    """Rank r sends chunk (r - step) mod N at each of the 2(N-1) steps."""
    sizes = chunk_sizes(numel, n)
    return [element_size * sum(sizes[(r - step) % n] for step in range(2 * (n - 1))) for r in range(n)]


def expected_tour(name, inputs, n):
    """What each rank must hold after a collective, worked out from the inputs alone (None: no
    output on that rank; "undefined": not the destination, not checked)."""
    if name == "scatter(src=0)":
        return list(inputs[0])  # rank r receives piece r of the source's list
    x = torch.stack(inputs)  # row r = rank r's input
    return {"broadcast(src=0)": [x[0]] * n, "reduce(SUM, dst=0)": [x.sum(0)] + ["undefined"] * (n - 1),
            "all_reduce(SUM)": [x.sum(0)] * n, "all_reduce(MAX)": [x.max(0).values] * n,
            "all_gather": [list(x)] * n, "gather(dst=0)": [list(x)] + [None] * (n - 1),
            "reduce_scatter(SUM)": list(x.sum(0).chunk(n)),
            "all_to_all": list(x.t())}[name]  # rank r gets element r of every rank's input


def matches(got, want):
    if isinstance(want, str):
        return True
    if want is None or got is None:
        return want is None and got is None
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(matches, got, want))
    return torch.equal(got.double(), want.double())


def show(v):
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(map(show, v)) + "]"
    return "[" + ", ".join(f"{a:g}" for a in v.tolist()) + "]"


def report_tour(ranks):
    """Prints each collective, rank by rank; returns the number of outputs that do not match."""
    n, bad = len(ranks), 0
    print(f"\nevery collective on {n} ranks, input [0, 1, 2, 3] + 10 * rank (each output checked "
          "against the value worked out from the inputs):")
    for name in ranks[0]["tour"]:
        inputs, outputs = zip(*(r["tour"][name] for r in ranks))
        if name == "barrier":
            start = min(t.item() for t in inputs)
            ok = min(t.item() for t in outputs) >= max(t.item() for t in inputs) - 1e-3
            bad += not ok
            for r in range(n):
                print(f"{name if r == 0 else '':<20}rank {r}: arrives +{inputs[r].item() - start:.2f} s,"
                      f" leaves +{outputs[r].item() - start:.2f} s{'' if ok else '  MISMATCH'}")
            continue
        want = expected_tour(name, list(inputs), n)
        for r in range(n):
            ok = matches(outputs[r], want[r])
            bad += not ok
            note = "   (not dst: undefined)" if want[r] == "undefined" else "" if ok else "  MISMATCH"
            print(f"{name if r == 0 else '':<20}rank {r}: {show(inputs[r]):<18} -> "
                  f"{show(outputs[r])}{note}")
    return bad


def report_training(ranks, bucket_kb, epochs):
    """Each mode against DDP: returns (largest |dw| between ranks, largest |dw| against DDP)."""
    print(f"\nthe lesson's worker against DDP (lesson 02's worker, same data, {epochs} epochs):")
    worst_between, worst_vs_ddp = 0.0, 0.0
    for i, (name, _, _) in enumerate(modes(bucket_kb)):
        between = max(course.max_abs_diff(ranks[0]["states"][i], r["states"][i]) for r in ranks)
        vs_ddp = max(course.max_abs_diff(r["states"][i], r["ddp"]) for r in ranks)
        worst_between, worst_vs_ddp = max(worst_between, between), max(worst_vs_ddp, vs_ddp)
        sizes = ", ".join(map(str, ranks[0]["buckets"][i]))
        print(f"  {name} ({len(ranks[0]['buckets'][i])} all-reduces per step, of {sizes} "
              f"bytes): max |dw| between ranks {between:.1e}, against DDP {vs_ddp:.1e}")
    return worst_between, worst_vs_ddp


def report_ring(by_world):
    """The ring's rows at each world size: returns (largest |ring - all_reduce|, bytes as predicted)."""
    print("\nthe lesson's ring against dist.all_reduce, and the bytes each rank sent (S = 4 x elements):")
    print(f"{'N':>2} {'elements':>8}  {'sent by each rank':<28} {'mean':>9} {'2(N-1)/N*S':>10}  "
          "max |ring - all_reduce|")
    worst, bytes_ok = 0.0, True
    for n, ranks in sorted(by_world.items()):
        for i, numel in enumerate(RING_SIZES):
            sent, diff = [r[i]["sent"] for r in ranks], max(r[i]["diff"] for r in ranks)
            worst = max(worst, diff)
            bytes_ok &= sent == bytes_each_rank_sends(numel, n) and sum(sent) == 2 * (n - 1) * 4 * numel
            print(f"{n:>2} {numel:>8}  {' '.join(map(str, sent)):<28} {sum(sent) / n:>9.6g} "
                  f"{2 * (n - 1) / n * 4 * numel:>10.6g}  {diff:.1e}")
    return worst, bytes_ok


def steps_per_rank(world_size, epochs, batch_size, samples=256):
    return epochs * math.ceil(math.ceil(samples / world_size) / batch_size)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    course.add_lesson_flag(p, 'collectives')
    p.add_argument("--world-size", type=int, default=2, help="ranks that train (default 2)")
    p.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step per rank (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--bucket-kb", type=float, default=4, help="bucket capacity in KiB (default 4)")
    p.add_argument("--ring-world-sizes", type=int, nargs="+", default=[2, 3, 4], metavar="N",
                   help="world sizes the ring is checked at (default 2 3 4); each picks its backend")
    course.add_device_flag(p)
    course.add_break_flag(p, BREAKS)
    p.add_argument("--crash-rank", type=int, help="this rank raises at step 2: the whole run must stop "
                   "within seconds with that rank's own error")
    course.add_timeout_flag(p)
    args = p.parse_args(argv)
    if min(args.world_size, args.epochs, args.batch_size, *args.ring_world_sizes) < 1 or \
            min(args.lr, args.bucket_kb, args.timeout) <= 0:
        course.refuse("--world-size, --epochs, --batch-size, --lr, --bucket-kb, --ring-world-sizes "
                      "and --timeout must be positive")
    if args.broken in ("no-divide", "forget-last-bucket") and args.world_size < 2:
        course.refuse(f"--break {args.broken} needs --world-size 2 or more: one rank has nothing to "
                      "average")
    if args.broken == "ring-skips-a-step" and max(args.ring_world_sizes) < 2:
        course.refuse("--break ring-skips-a-step needs a ring of 2 ranks or more")
    course.refuse_bad_crash_rank(args.crash_rank, args.world_size,
                                 steps_per_rank(args.world_size, args.epochs, args.batch_size))
    return args


def main(argv=None):
    args = parse_args(argv)
    sizes = sorted(set(args.ring_world_sizes) - {args.world_size})  # the training ranks check theirs
    backends = {n: course.backend_for(n, args.device) for n in sorted({args.world_size, *sizes})}
    backend, _, reason = backends[args.world_size]
    print(f"backend: {backend} ({reason}); world size {args.world_size}; global batch "
          f"{args.world_size} x {args.batch_size} = {args.world_size * args.batch_size}"
          + (f"; --break {args.broken}: {BREAKS[args.broken]}" if args.broken else ""), flush=True)
    start = time.perf_counter()
    ranks = run_training(args.world_size, args.epochs, args.batch_size, args.lr, args.bucket_kb,
                         backend, args.broken, args.crash_rank, args.timeout)
    by_world = {args.world_size: [r["ring"] for r in ranks]} if args.world_size in \
        args.ring_world_sizes else {}
    parts = {args.world_size: [r["probe"]["ring"] for r in ranks]}
    for n in sizes:
        print(f"ring at {n} ranks: backend {backends[n][0]} ({backends[n][2]})", flush=True)
        by_world[n] = run_ring(n, backends[n][0], args.broken, args.timeout, parts)
    print(f"the ranks ran in {time.perf_counter() - start:.1f} s on {course.hardware()}")
    mismatches = report_tour(ranks)
    between, vs_ddp = report_training(ranks, args.bucket_kb, args.epochs)
    worst, bytes_ok = report_ring(by_world)
    trained_ok, ring_ok = between == 0.0 and vs_ddp <= TOLERANCE, worst <= TOLERANCE and bytes_ok
    ns = ", ".join(map(str, sorted(by_world)))
    code = course.report_proof(
        trained_ok and ring_ok and mismatches == 0,
        f"gradients averaged by hand give {'identical' if between == 0.0 else 'DIFFERENT'} ranks, "
        f"{'equal' if vs_ddp <= TOLERANCE else 'NOT equal'} to DDP; the ring "
        f"{'equals' if worst <= TOLERANCE else 'does NOT equal'} dist.all_reduce at N = {ns}, each "
        f"rank sending {'' if bytes_ok else 'NOT '}2(N-1)/N * S bytes on average; "
        f"{mismatches} collective output(s) unexpected",
        f"max |dw| between ranks {between:.1e}, against DDP {vs_ddp:.1e}, max |ring - all_reduce| "
        f"{worst:.1e}", f"{TOLERANCE:.0e}")
    if code:
        likely_cause(ranks, parts, between, vs_ddp, worst, mismatches)
    return code


def likely_cause(ranks, parts, between, vs_ddp, worst, mismatches):
    """The last line of a failure: which typical mistake the measurements (the probes of the
    lesson's functions, the runs) fit, never read from the learner's source; else what was
    measured."""
    where = lambda text: course.lesson_line("06_collectives/collectives.py", text)  # noqa
    n = len(ranks)
    probe = ranks[0]["probe"]
    ratios = probe["ratio"]
    own = [k for k, r in ratios.items() if abs(r - 1 / ((n + 1) / 2)) < 1e-6]  # rank 0's own
    summed = n > 1 and all(abs(r - n) < 1e-4 for r in ratios.values())
    short = {m: (min(p[0] for p in ps), max(p[1] for p in ps)) for m, ps in parts.items()
             if min(p[0] for p in ps) < m}
    measured = (f"the ranks {'agree' if between == 0.0 else f'differ by {between:.1e}'}, "
                f"{vs_ddp:.1e} from DDP; average_gradients gives "
                + ", ".join(f"{k} {r:.2f}" for k, r in list(ratios.items())[:2])
                + " times the mean; the ring " + ("equals dist.all_reduce" if worst <= TOLERANCE
                                                   else f"is {worst:.1e} off")
                + f"; {mismatches} collective output(s) unexpected")
    ring_cause = ""
    if short:
        m, (few, most) = max(short.items())  # the largest ring checked
        ring_cause = (f"the ring loses ranks' parts: on x = 2**rank at N = {m}, its elements "
                      f"hold {few} to {most} of the {m} ranks' parts; every one of its 2(N-1) "
                      f"steps must send a chunk and add (reduce-scatter) or keep (all-gather) what "
                      f"arrives ({where('for step in range(2 * (n - 1))')})")
    course.diagnose([
        (bool(ring_cause), ring_cause),
        (summed, f"the gradients are summed, never divided by N = {n}: average_gradients gives "
                 f"{ratios[next(iter(ratios))]:.2f} times the mean of the ranks' gradients; "
                 f"divide the all-reduced sum by the world size ({where('flat /= world_size')})"),
        (n > 1 and bool(probe["unbucketed"] or own),
         f"a bucket is never all-reduced: no bucket holds {', '.join(probe['unbucketed'] or own)}, "
         f"where each rank keeps its own gradient, so the ranks drift apart ({between:.1e}); "
         f"make_buckets must return every parameter with a gradient ({where('return buckets')})"),
    ], measured)


if __name__ == "__main__":
    course.exit_now(course.run_lab(main))
