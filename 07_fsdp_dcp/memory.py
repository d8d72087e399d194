"""Lesson 07's memory benchmark: what one rank holds under DDP and under FSDP2, for N = 1, 2, 4.

    python 07_fsdp_dcp/memory.py                          # N = 1, 2, 4; writes memory.json
    python 07_fsdp_dcp/memory.py --plot                   # and memory.png
    python 07_fsdp_dcp/memory.py --world-sizes 1,2,3 --out-dir .   # memory.json here

Every rank builds the same MLP (blocks of Linear(width, width) + ReLU, then a Linear(width, 10)
head), wraps it in DDP or in `fully_shard` (each block, then the root) over
`init_device_mesh("cpu", (N,))`, takes one AdamW step on gloo, and counts the bytes it holds:

- params, grads: the distinct storages behind this rank's parameters and gradients (for FSDP2, the
  local shards of the DTensors: `p.to_local()`), so FSDP2's padding is counted;
- optim: AdamW's exp_avg, exp_avg_sq and step tensors;
- RSS: the growth of the whole process's resident memory (/proc/self/status) from before the
  model to after the step, labelled as such: it holds the allocator's caches, DDP's gradient
  buckets and FSDP2's freed all-gather buffers; "trimmed" is read after glibc's malloc_trim(0).
  Linux only: without /proc (macOS, Windows) the RSS columns read n/a, and the run says so.

Three wrappers: ddp, fsdp2 (every rank builds the whole model, then shards it) and fsdp2_meta
(built on the meta device: no rank ever holds the whole model; its weights are not the seeded
ones). The target for FSDP2 is 1/N of DDP's bytes; NOTES.md explains the deviations.

Imports course.py (the repository's lab helpers), never the lesson, so the lesson can change
without this benchmark changing.
"""
import argparse
import ctypes
import datetime
import gc
import json
import os
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import course  # noqa: E402

MIB = 2 ** 20
WRAPPERS = ("ddp", "fsdp2", "fsdp2_meta")
STATUS = "/proc/self/status"  # VmRSS, VmHWM: Linux only


def make_model(width, depth, classes=10, seed=0):
    """Blocks of Linear + ReLU (each block is one FSDP2 unit) and a 10-way head (in the root unit:
    10 rows do not split evenly over 4 ranks, which shows FSDP2's padding)."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def local(tensor):
    """This rank's own tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors):
    """Bytes of the distinct storages behind these tensors: views into one flat buffer (FSDP2's
    gradients) count once, and the padding at the end of a padded shard is included."""
    storages = {}
    for t in tensors:
        s = local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def shard_bytes(tensors):
    """Bytes of the elements this rank owns, without padding."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def rss_mib():
    """(current, peak) resident set size of this process in MiB, from /proc/self/status; (None,
    None) without /proc (macOS, Windows): the standard library reads no current RSS there."""
    if not os.path.exists(STATUS):
        return None, None
    fields = {}
    with open(STATUS) as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields["VmHWM"]


def rss_fields(before, after, peak, trimmed):
    """memory.json's RSS entries (MiB), each None where rss_mib() had no /proc to read."""
    if before is None:
        return dict.fromkeys(["rss_mib", "rss_growth_mib", "peak_rss_mib",
                              "rss_growth_trimmed_mib"])
    return {"rss_mib": round(after, 1), "rss_growth_mib": round(after - before, 1),
            "peak_rss_mib": round(peak, 1), "rss_growth_trimmed_mib": round(trimmed - before, 1)}


def trim_heap():
    """Hands freed heap memory back to the OS (glibc's malloc_trim), so that RSS shows what is
    live rather than what the allocator keeps cached. Returns False where there is no glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def build(wrapper, width, depth, world_size):
    """The model as this rank holds it: DDP, FSDP2 built in full then sharded (every rank first
    allocates the whole model), or FSDP2 built on the meta device (no memory), sharded, and only
    then given storage for its own shard and initialised."""
    if wrapper == "ddp":
        return DDP(make_model(width, depth))
    mesh = init_device_mesh("cpu", (world_size,))
    if wrapper == "fsdp2_meta":
        with torch.device("meta"):
            model = make_model(width, depth)
    else:
        model = make_model(width, depth)
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: the head's parameters
    if wrapper == "fsdp2_meta":
        model.to_empty(device="cpu")  # storage for this rank's shards only
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()  # random, NOT equal to make_model's seeded weights
    return model


def measure(rank, world_size, port, wrapper, width, depth, out_dir, timeout=60):
    """One rank: build, wrap, one AdamW step, count; writes <wrapper>_<N>_<rank>.json."""
    torch.set_num_threads(1)  # N ranks share 2 cores
    warnings.filterwarnings("ignore", "DTensor random operators")  # fsdp2_meta's init, on CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    model = optimizer = None
    try:
        gc.collect()
        trim_heap()
        rss_before, _ = rss_mib()
        model = build(wrapper, width, depth, world_size)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(8, width, generator=g), torch.randint(0, 10, (8,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()  # the gradients stay: this is the moment a rank holds all three
        params = list(model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        rss, peak = rss_mib()
        trim_heap()
        rss_trimmed, _ = rss_mib()
        result = {
            "params": storage_bytes(params), "grads": storage_bytes(grads),
            "optim": storage_bytes(states),
            "params_unpadded": shard_bytes(params), "grads_unpadded": shard_bytes(grads),
            "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
            **rss_fields(rss_before, rss, peak, rss_trimmed),
        }
        result["total"] = result["params"] + result["grads"] + result["optim"]
        with open(os.path.join(out_dir, f"{wrapper}_{world_size}_{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        model = optimizer = None  # DDP and FSDP2 hold the process group: release them first
        gc.collect()
        dist.destroy_process_group()


def run_all(world_sizes, width, depth):
    """Every (N, wrapper) in its own set of ranks; returns the rows of memory.json."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in world_sizes:
            row = {"N": n}
            for wrapper in WRAPPERS:
                course.spawn_or_fail(measure, (n, course.find_free_port(), wrapper, width, depth,
                                               tmp), nprocs=n)
                ranks = []
                for r in range(n):
                    with open(os.path.join(tmp, f"{wrapper}_{n}_{r}.json")) as f:
                        ranks.append(json.load(f))
                # rank 0 holds the largest shard (torch.chunk gives the first ranks the extra rows)
                entry = dict(ranks[0])
                entry["per_rank_total"] = [r["total"] for r in ranks]
                entry["per_rank_rss_mib"] = [r["rss_mib"] for r in ranks]
                entry["per_rank_padding"] = [r["params"] + r["grads"] - r["params_unpadded"]
                                             - r["grads_unpadded"] for r in ranks]
                row[wrapper] = entry
            row["ratio"] = max(row["fsdp2"]["per_rank_total"]) / max(row["ddp"]["per_rank_total"])
            row["target"] = 1 / n
            rows.append(row)
    return rows


def mib(value, width):
    """An RSS column: the whole MiB, or n/a where there was no /proc to read."""
    return f"{value:{width}.0f}" if value is not None else f"{'n/a':>{width}}"


def print_table(result):
    m = result["model"]
    print(f"model: {m['description']}: {m['parameters']:,} parameters "
          f"({m['param_bytes'] / MIB:.2f} MiB float32); one AdamW step; gloo on CPU", flush=True)
    print(f"hardware: {result['hardware']}")
    print("tensor bytes one rank holds after the step (the largest rank), MiB; "
          "RSS growth of rank 0:")
    print(f"{'N':>2} {'wrapper':<10} {'params':>7} {'grads':>7} {'optim':>7} {'total':>7} "
          f"{'/DDP':>7} {'1/N':>6} {'RSS+':>6} {'trimmed':>7}")
    for row in result["rows"]:
        ddp = max(row["ddp"]["per_rank_total"])
        for wrapper in WRAPPERS:
            e = row[wrapper]
            total = max(e["per_rank_total"])
            ratio = f"{total / ddp:7.4f} {row['target']:6.4f}" if wrapper != "ddp" else " " * 14
            print(f"{row['N']:>2} {wrapper:<10} {e['params'] / MIB:7.2f} {e['grads'] / MIB:7.2f} "
                  f"{e['optim'] / MIB:7.2f} {total / MIB:7.2f} {ratio} "
                  f"{mib(e['rss_growth_mib'], 6)} {mib(e['rss_growth_trimmed_mib'], 7)}")
    print("params/grads/optim: the tensors' storages, counted exactly, padding included.\n"
          "RSS+: resident memory grown from before the model to after the step (the whole\n"
          "process: allocator caches, DDP's buckets, FSDP2's freed all-gather buffers); trimmed:\n"
          "the same after glibc's malloc_trim(0) returned the freed heap. Noisy: a rough size.")
    print("FSDP2 above 1/N of DDP (rows split as ceil(rows / N), replicated step counters and\n"
          "buffers; padding on the last ranks; NOTES.md explains):")
    for row in result["rows"]:
        e, n = row["fsdp2"], row["N"]
        over = max(e["per_rank_total"]) - max(row["ddp"]["per_rank_total"]) / n
        padding = ", ".join(f"{p:,}" for p in e["per_rank_padding"])
        print(f"  N={n}: largest rank {over:,.0f} bytes over DDP/N; padding per rank: {padding} "
              f"bytes; unsharded buffers: {e['buffers']:,} bytes")


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [row["N"] for row in result["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for wrapper, style in (("ddp", "o-"), ("fsdp2", "s-")):
        ax.plot(ns, [max(r[wrapper]["per_rank_total"]) / MIB for r in result["rows"]], style,
                label=f"{wrapper}: params + grads + AdamW state")
    ddp1 = max(result["rows"][0]["ddp"]["per_rank_total"]) / MIB * result["rows"][0]["N"]
    ax.plot(ns, [ddp1 / n for n in ns], "k:", label="DDP / N (the target)")
    for wrapper, style in (("ddp", "o--"), ("fsdp2", "s--")):
        rss = [r[wrapper]["rss_growth_trimmed_mib"] for r in result["rows"]]
        if None not in rss:  # None: no /proc to read (macOS, Windows)
            ax.plot(ns, rss, style, alpha=0.4, label=f"{wrapper}: RSS growth, trimmed (noisy)")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MiB per rank")
    ax.set_xticks(ns)
    top = max(max(line.get_ydata()) for line in ax.get_lines())
    ax.set_ylim(0, top * 1.75)  # room for the legend above the lines
    ax.set_title("What one rank holds after one AdamW step", fontsize=10)
    ax.legend(fontsize=6.5, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="1,2,4",
                        help="comma-separated rank counts to measure (default 1,2,4)")
    parser.add_argument("--width", type=int, default=1024,
                        help="hidden width of the MLP (default 1024: 16 MiB of parameters)")
    parser.add_argument("--out-dir", default=HERE,
                        help="where memory.json (and memory.png) go (default: this folder)")
    parser.add_argument("--plot", action="store_true", help="also write memory.png")
    args = parser.parse_args()
    try:
        world_sizes = [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        course.refuse(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    if not world_sizes or min(world_sizes) < 1 or max(world_sizes) > 16:
        course.refuse(f"--world-sizes must be between 1 and 16, got {args.world_sizes!r}")
    if args.width < 1:
        course.refuse(f"--width must be at least 1, got {args.width}")
    if not os.path.isdir(args.out_dir):
        course.refuse(f"--out-dir {args.out_dir!r} is not a folder")
    if not os.path.exists(STATUS):
        print(f"RSS: not measured on {course.platform_name()} (/proc/self/status is Linux only); "
              "the tensor bytes are counted exactly anywhere", flush=True)
    depth = 4
    model = make_model(args.width, depth)
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "hardware": course.hardware(), "torch": torch.__version__,
        "script": "07_fsdp_dcp/memory.py",
        "model": {"description": f"{depth} x [Linear({args.width}, {args.width}) + ReLU] + "
                                 f"Linear({args.width}, 10)",
                  "width": args.width, "depth": depth, "parameters": n_params,
                  "param_bytes": n_params * 4},
        "rows": [],
    }
    start = time.perf_counter()
    result["rows"] = run_all(world_sizes, args.width, depth)
    result["seconds"] = round(time.perf_counter() - start, 1)
    print_table(result)
    path = os.path.join(args.out_dir, "memory.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path} ({result['seconds']} s on {course.hardware()})")
    if args.plot:
        plot(result, os.path.join(args.out_dir, "memory.png"))
        print(f"wrote {os.path.join(args.out_dir, 'memory.png')}")


if __name__ == "__main__":
    main()
