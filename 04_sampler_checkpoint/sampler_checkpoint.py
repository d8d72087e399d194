"""Lesson 04: DistributedSampler made visible, evaluation that counts every sample once, and
checkpoints that let a crashed run resume bit-exact.

    python 04_sampler_checkpoint/sampler_checkpoint.py                     # all three parts and the proof
    python 04_sampler_checkpoint/sampler_checkpoint.py --crash-at-epoch 2 --ckpt-dir ck   # a rank is killed in epoch 2
    python 04_sampler_checkpoint/sampler_checkpoint.py --resume ck/checkpoint.pt          # resume it, then prove
    python 04_sampler_checkpoint/sampler_checkpoint.py --no-rng-restore    # resume without RNG state: the proof FAILS

The proof: a run killed mid-epoch and resumed from its last checkpoint ends with losses and
parameters bit-identical (torch.equal) to a run that never stopped.
"""
import argparse
import datetime
import gc
import os
import random
import signal
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

CHECKPOINT = "checkpoint.pt"
CONFIG_KEYS = ["world_size", "samples", "batch_size", "lr", "dropout"]  # what must match to continue the same run


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="number of processes (ranks) to spawn (default 2)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with one GPU per rank, else gloo")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if there is one GPU per rank, else cpu")
    p.add_argument("--samples", type=int, default=96, help="training samples (default 96)")
    p.add_argument("--val-samples", type=int, default=101, help="evaluation samples; 101 divides by no world size from 2 to 100 (default 101)")
    p.add_argument("--batch-size", type=int, default=8, help="batch size PER RANK (default 8)")
    p.add_argument("--epochs", type=int, default=4, help="epochs to train (default 4)")
    p.add_argument("--lr", type=float, default=0.01, help="AdamW learning rate (default 0.01)")
    p.add_argument("--dropout", type=float, default=0.2, help="dropout probability; dropout draws from each rank's RNG (default 0.2)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a stuck collective raises instead of hanging (default 60)")
    p.add_argument("--ckpt-dir", help=f"where rank 0 writes {CHECKPOINT} after every epoch; default: a temporary directory, "
                   "or the folder of --resume")
    p.add_argument("--resume", metavar="PATH", help="continue training from this checkpoint, then prove the result equals an uninterrupted run")
    p.add_argument("--crash-at-epoch", type=int, metavar="K", help="kill the last rank in the middle of epoch K and stop "
                   "(exit 1), leaving the checkpoint of epoch K in --ckpt-dir")
    p.add_argument("--no-rng-restore", action="store_true", help="resume WITHOUT restoring each rank's RNG state: the proof must FAIL")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size must be at least 1, got {args.world_size}")
    if min(args.samples, args.batch_size, args.epochs) < 1 or args.timeout <= 0 or args.lr <= 0:
        p.error("--samples, --batch-size, --epochs, --lr and --timeout must be positive")
    if args.val_samples < args.world_size:
        p.error(f"--val-samples must be at least --world-size ({args.world_size}): every rank evaluates at least one sample")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.crash_at_epoch is not None:
        if args.resume:
            p.error("use --crash-at-epoch and --resume one at a time: first crash, then resume")
        if not 0 <= args.crash_at_epoch < args.epochs:
            p.error(f"--crash-at-epoch must be an epoch between 0 and {args.epochs - 1}")
        if not args.ckpt_dir:
            p.error("--crash-at-epoch leaves a checkpoint to resume from: name its folder with --ckpt-dir DIR")
    if not args.resume and args.crash_at_epoch is None and args.epochs < 2:
        p.error("the demonstration crashes in epoch --epochs // 2 and resumes, so it needs --epochs 2 or more")
    if args.ckpt_dir:
        try:
            os.makedirs(args.ckpt_dir, exist_ok=True)
        except OSError as e:
            p.error(f"--ckpt-dir {args.ckpt_dir}: {e.strerror}")
    args.backend, args.device, args.reason = choose_backend(args.backend, args.device, args.world_size, p.error)
    if args.resume:
        try:
            args.resume_info = read_checkpoint(args.resume, args)
        except CheckpointError as e:
            p.error(str(e))
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
        error(f"--backend nccl needs --device cuda and one GPU per rank (world size {world_size}, "
              f"{gpus} GPU(s) visible); use --backend gloo")
    if device == "cuda":
        reason = f"{gpus} GPU(s) visible, one per rank"
    elif gpus >= world_size:
        reason = "CPU requested"
    else:
        reason = "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"
    return backend, device, reason


def find_free_port():
    """Ask the OS for a port nobody uses now; a fixed port (12355, 29500) collides between jobs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- part 1: the sampler, no process group needed
def shards(n, world_size, seed=0, epoch=None, **kw):
    """The indices each rank's DistributedSampler yields. `seed` may be a list, one per rank, to show that mistake."""
    seeds = seed if isinstance(seed, list) else [seed] * world_size
    result = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seeds[rank], **kw)
        if epoch is not None:
            sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def epoch_orders(n, world_size, epochs, call_set_epoch):
    """Rank 0's order in each epoch, from ONE sampler reused across epochs, as in a training loop."""
    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=0, shuffle=True, seed=0)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def show_sampler():
    print("\nPART 1: the sampler (no process group needed: num_replicas and rank are passed explicitly)")
    padded = shards(10, 3, shuffle=False)
    print("10 samples over 3 ranks, shuffle=False: each rank takes every 3rd index (rank::3), not a block")
    for rank, indices in enumerate(padded):
        print(f"  rank {rank}: {indices}")
    repeated = sorted({i for i in range(10) if sum(s.count(i) for s in padded) > 1})
    print(f"  padded from 10 to {sum(map(len, padded))} so every rank gets {len(padded[0])}: indices {repeated} appear twice")
    dropped = shards(10, 3, shuffle=False, drop_last=True)
    print(f"drop_last=True: {'  '.join(f'rank {r}: {s}' for r, s in enumerate(dropped))}; "
          f"never seen: {sorted(set(range(10)) - {i for s in dropped for i in s})}")
    for call in (False, True):
        orders = epoch_orders(10, 2, 3, call)
        same = all(o == orders[0] for o in orders)
        print(f"shuffle=True, {'with' if call else 'without'} set_epoch(epoch), rank 0 per epoch: "
              f"{'  '.join(str(o) for o in orders)} ({'the SAME order every epoch' if same else 'a new order each epoch'})")
    for label, seed in (("seed=0 on every rank", 0), ("seed=rank (wrong)   ", [0, 1])):
        seen = [i for s in shards(10, 2, seed=seed, shuffle=True) for i in s]
        print(f"{label}: 10 samples over 2 ranks, {len(set(seen))} distinct seen, {10 - len(set(seen))} never seen, "
              f"{len(seen) - len(set(seen))} seen twice")


# ---------------------------------------------------------------- data, model, evaluation
def make_data(args):
    """A learnable 4-class problem: the training set does not depend on --val-samples, nor the reverse."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 4, generator=g)
    x_train, x_val = torch.randn(args.samples, 20, generator=g), torch.randn(args.val_samples, 20, generator=g)
    return TensorDataset(x_train, (x_train @ w).argmax(1)), TensorDataset(x_val, (x_val @ w).argmax(1))


def make_model(args):
    torch.manual_seed(0)  # every rank starts from the same weights
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(64, 4))


@torch.no_grad()
def count_correct(model, data, device):
    """tensor([correct, total]) over `data` (a DataLoader or a Dataset)."""
    loader = data if isinstance(data, DataLoader) else DataLoader(data, batch_size=64)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for x, y in loader:
        counts[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += len(y)
    return counts


def evaluate(plain_model, val_set, rank, world_size, device):
    """Three ways to aggregate accuracy across ranks, and the reference: rank 0 alone on every sample."""
    plain_model.eval()  # the unwrapped model.module: DDP's forward may run collectives, uneven shards would hang them
    padded = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, world_size, rank, shuffle=False))
    padded_sums = count_correct(plain_model, padded, device)
    dist.all_reduce(padded_sums)  # sums of correct and total, but over padded shards: duplicates counted
    shard = count_correct(plain_model, Subset(val_set, range(rank, len(val_set), world_size)), device)  # no padding
    mean_of_means = (shard[0] / shard[1]).double()
    dist.all_reduce(mean_of_means)  # per-rank accuracies averaged: unequal shards weigh alike
    sums = shard.clone()
    dist.all_reduce(sums)  # the right way: sum correct and total over unpadded shards, divide once
    reference = count_correct(plain_model, val_set, device) if rank == 0 else None
    return {"padded": padded_sums.tolist(), "mean_of_means": mean_of_means.item() / world_size, "sums": sums.tolist(),
            "shard_sizes": [len(range(r, len(val_set), world_size)) for r in range(world_size)],
            "reference": reference.tolist() if reference is not None else None}


# ---------------------------------------------------------------- checkpoints
class CheckpointError(Exception):
    pass


def rng_state(device):
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state, device):
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU byte tensors, wherever map_location put them
    random.setstate(state["python"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save_atomically(obj, path):
    """Write a temporary file in the same folder, then os.replace it over `path`: whoever reads `path`
    sees the old complete file or the new complete one, never half of one, even if this process dies mid-write."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)  # atomic on one file system, which is why tmp sits in the same folder
    except BaseException:
        os.unlink(tmp)
        raise


def save_checkpoint(path, model, optimizer, epoch, step, history, args, device):
    """Called by EVERY rank: all ranks contribute their RNG state and losses, rank 0 writes, all ranks wait."""
    everyone = [None] * args.world_size
    dist.all_gather_object(everyone, {"rng": rng_state(device), "losses": history})  # a collective: every rank
    if dist.get_rank() == 0:
        save_atomically({"model": {k: v.cpu() for k, v in model.state_dict().items()},  # model = ddp.module: no "module."
                         "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
                         "rng": [e["rng"] for e in everyone], "losses": [e["losses"] for e in everyone],
                         "config": {k: getattr(args, k) for k in CONFIG_KEYS}}, path)
    dist.barrier()  # every rank, outside the if: when it returns, the checkpoint of this epoch exists for everyone


def read_checkpoint(path, args):
    """Load and check a checkpoint in the parent, before any rank starts; raises CheckpointError with one clear line."""
    if os.path.isdir(path):
        raise CheckpointError(f"{path} is a folder; pass the checkpoint file in it, e.g. {os.path.join(path, CHECKPOINT)}")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated: OSError/RuntimeError/EOFError; garbage: KeyError, UnpicklingError
        first = (str(e).strip().splitlines() or ["(no message)"])[0][:160]
        if "Weights only load failed" in str(e):
            culprit = str(e).split("Unsupported global: GLOBAL ")[-1].split()[0] if "GLOBAL " in str(e) else "?"
            raise CheckpointError(f"{path} holds objects that torch.load(weights_only=True) refuses to unpickle "
                                  f"({culprit}); store only tensors and plain Python types") from None
        raise CheckpointError(f"cannot read checkpoint {path}: the file is truncated or corrupt "
                              f"({type(e).__name__}: {first})") from None
    needed = {"model", "optimizer", "epoch", "step", "rng", "losses", "config"}
    if not isinstance(ck, dict):
        raise CheckpointError(f"{path} is not a checkpoint of this lesson: it holds a {type(ck).__name__}, not a dict")
    if not needed <= ck.keys():
        raise CheckpointError(f"{path} is not a checkpoint of this lesson: it lacks {sorted(needed - ck.keys())}")
    saved = ck["config"]
    if not isinstance(saved, dict) or not set(CONFIG_KEYS) <= saved.keys():
        raise CheckpointError(f"{path} is not a checkpoint of this lesson: its config lacks {CONFIG_KEYS}")
    if saved["world_size"] != args.world_size:
        raise CheckpointError(
            f"{path} was saved by {saved['world_size']} ranks but this run has {args.world_size}: refused, because a "
            f"different world size changes the global batch ({saved['world_size']}x{saved['batch_size']} -> "
            f"{args.world_size}x{args.batch_size}), every rank's shard and the per-rank RNG streams, so the run could not "
            f"continue as it was. Resume with --world-size {saved['world_size']}")
    for key in CONFIG_KEYS[1:]:
        if saved[key] != getattr(args, key):
            raise CheckpointError(f"{path} was trained with --{key.replace('_', '-')} {saved[key]}, this run has "
                                  f"{getattr(args, key)}: pass the same value to continue the same run")
    if ck["epoch"] >= args.epochs:
        raise CheckpointError(f"{path} already holds {ck['epoch']} epochs, nothing to resume with --epochs {args.epochs}")
    return {"epoch": ck["epoch"], "step": ck["step"]}


# ---------------------------------------------------------------- one rank
def worker(rank, args, port, jobs):
    """One process = one rank. It runs the jobs (see `job`) one after another, in one process group."""
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))  # ranks share the cores
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout), device_id=device if args.device == "cuda" else None)
    try:
        for job in jobs:
            train_rank(rank, args, job, device)
    finally:
        gc.collect()  # free the DDP models now: left to interpreter exit, gloo aborts there in some runs (torch 2.15)
        dist.destroy_process_group()


def train_rank(rank, args, job, device):
    train_set, val_set = make_data(args)
    sampler = DistributedSampler(train_set, num_replicas=args.world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = make_model(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    torch.manual_seed(1 + rank)  # each rank draws its own dropout masks
    random.seed(1 + rank)
    start_epoch, step, history = 0, 0, []
    if job["resume"]:  # every rank loads, onto its own device, tensors and plain types only
        ck = torch.load(job["resume"], map_location=device, weights_only=True)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        start_epoch, step, history = ck["epoch"], ck["step"], ck["losses"][rank]
        if job["restore_rng"]:
            restore_rng(ck["rng"][rank], device)  # each rank its own: the RNG streams differ per rank
    ddp = DDP(model, device_ids=[rank] if args.device == "cuda" else None)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        ddp.train()
        for i, (x, y) in enumerate(loader):
            if epoch == job["crash_at_epoch"] and rank == args.world_size - 1 and i == len(loader) // 2:
                print(f"rank {rank}: killed in the middle of epoch {epoch}, before step {step + 1} (--crash-at-epoch)",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # no cleanup, like an OOM kill
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            step += 1
            history.append(loss.item())
        path = os.path.join(job["ckpt_dir"], CHECKPOINT)
        save_checkpoint(path, ddp.module, optimizer, epoch + 1, step, history, args, device)
        if job["verbose"] and rank == 0:
            print(f"epoch {epoch}  steps {step - len(loader) + 1:3d}-{step:3d}  rank 0 mean loss "
                  f"{sum(history[-len(loader):]) / len(loader):.4f}  saved {path} (epoch {epoch + 1}, step {step})", flush=True)
    result = {"evaluation": evaluate(ddp.module, val_set, rank, args.world_size, device)}
    everyone = [None] * args.world_size
    dist.all_gather_object(everyone, history)
    if rank == 0:
        result.update(losses=everyone, state={k: v.cpu() for k, v in ddp.module.state_dict().items()})
        torch.save(result, job["out"])


# ---------------------------------------------------------------- the parent
def job(folder, resume=None, restore_rng=True, crash_at_epoch=None, verbose=False):
    """One training run: checkpoints go to `folder`, rank 0 saves its result there as result.pt."""
    return {"out": os.path.join(folder, "result.pt"), "ckpt_dir": folder, "resume": resume, "restore_rng": restore_rng,
            "crash_at_epoch": crash_at_epoch, "verbose": verbose}


def run(args, jobs):
    """Spawn the ranks once to run the jobs in turn; return rank 0's result of each (every rank's losses, the
    final weights, the evaluation). Raises mp.ProcessExitedException/ProcessRaisedException if a rank fails."""
    for j in jobs:
        os.makedirs(j["ckpt_dir"], exist_ok=True)
    mp.spawn(worker, args=(args, find_free_port(), jobs), nprocs=args.world_size, join=True)
    return [torch.load(j["out"], map_location="cpu", weights_only=True) for j in jobs]


def compare(a, b):
    """(bit-identical?, number of losses, max |dloss|, max |dw|) between two results."""
    la, lb = torch.tensor(a["losses"]), torch.tensor(b["losses"])
    same_losses = la.shape == lb.shape and torch.equal(la, lb)
    dloss = (la - lb).abs().max().item() if la.shape == lb.shape else float("inf")
    same_params = all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
    dw = max((a["state"][k] - b["state"][k]).abs().max().item() for k in a["state"])
    return same_losses and same_params, la.numel(), dloss, dw


def epoch_means(result, steps_per_epoch):
    losses = torch.tensor(result["losses"]).mean(0)  # the mean over ranks of each step's local loss
    return losses.view(-1, steps_per_epoch).mean(1).tolist()


def show_evaluation(ev, args):
    padding, sizes = ev["padded"][1] - args.val_samples, sorted(set(ev["shard_sizes"]), reverse=True)
    print(f"\nPART 2: evaluation on {args.val_samples} samples over {args.world_size} ranks "
          f"({'not divisible, so the sampler pads' if padding else 'divisible: no padding'})")
    c, t = ev["padded"]
    print(f"  padded DistributedSampler, sums all-reduced:   {c:3d}/{t} = {c / t:.4f}  "
          f"{f'WRONG: {padding} sample(s) counted twice' if padding else 'right here: nothing padded'}")
    print(f"  per-rank accuracies averaged (unpadded):         = {ev['mean_of_means']:.4f}  "
          f"{'WRONG: shards of ' + ' and '.join(map(str, sizes)) + ' weigh alike' if len(sizes) > 1 else 'right here: equal shards'}")
    c, t = ev["sums"]
    print(f"  unpadded shards, correct and total all-reduced: {c:3d}/{t} = {c / t:.4f}")
    c, t = ev["reference"]
    print(f"  rank 0 alone with model.module, every sample:   {c:3d}/{t} = {c / t:.4f}  (the reference)")
    return ev["sums"] == ev["reference"]


def proof_line(args, same, n, dloss, dw, eval_ok, ev, what):
    passed = same and eval_ok
    return passed, (f"PROOF {'PASSED' if passed else 'FAILED'}: {what}: {n} losses and the final parameters bit-identical to "
                    f"an uninterrupted run: {'yes' if same else 'NO'} (torch.equal; max |dloss| {dloss:.1e}, max |dw| {dw:.1e}); "
                    f"evaluation counted {ev['sums'][1]} of {args.val_samples} samples once each, as rank 0 alone: "
                    f"{'yes' if eval_ok else 'NO'}")


def error_line(e):
    """The line that says what happened: 'process 1 terminated with signal SIGKILL', or a traceback's last line."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1] if isinstance(e, mp.ProcessRaisedException) else lines[0]


def crash_run(args):
    """--crash-at-epoch K: train until the last rank is killed in epoch K; always exit 1."""
    path = os.path.join(args.ckpt_dir, CHECKPOINT)
    before = os.stat(path).st_mtime_ns if os.path.isfile(path) else None  # a checkpoint left by an earlier run
    start = time.perf_counter()
    try:
        run(args, [job(args.ckpt_dir, crash_at_epoch=args.crash_at_epoch, verbose=True)])
        print("the run finished without a crash", file=sys.stderr)
        return 1
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"\nRUN FAILED after {time.perf_counter() - start:.1f} s: a rank stopped, so every rank was stopped.\n{e}",
              file=sys.stderr)
    if not os.path.isfile(path) or os.stat(path).st_mtime_ns == before:
        print(f"this run wrote no checkpoint: the crash came before the end of its first epoch"
              f"{f' ({path} is from an earlier run)' if before is not None else ''}", file=sys.stderr)
        return 1
    try:
        info = read_checkpoint(path, args)  # read back, as a resume would, to show it is intact
    except CheckpointError as e:
        print(f"the checkpoint cannot be resumed: {e}", file=sys.stderr)
        return 1
    print(f"the last good checkpoint is intact: {path} (epoch {info['epoch']}, step {info['step']}); "
          f"continue with --resume {path}", file=sys.stderr)
    return 1


def main(argv=None):
    args = parse_args(argv)
    print(f"backend: {args.backend} on {args.device} ({args.reason}); world size {args.world_size}; AdamW, dropout "
          f"{args.dropout}, {args.epochs} epochs{'; --no-rng-restore: RNG state will NOT be restored' if args.no_rng_restore else ''}",
          flush=True)
    if args.crash_at_epoch is not None:
        return crash_run(args)
    if not args.resume:
        show_sampler()
    restore, unrestored, crash_report = not args.no_rng_restore, None, []
    with tempfile.TemporaryDirectory(prefix="sampler_checkpoint_") as scratch:
        start = time.perf_counter()
        try:
            if args.resume:
                print(f"\nresuming from {args.resume}:", flush=True)
                what = f"resumed from {args.resume} (epoch {args.resume_info['epoch']}, step {args.resume_info['step']})"
                folder = args.ckpt_dir or os.path.dirname(os.path.abspath(args.resume))
                resumed, straight = run(args, [job(folder, resume=args.resume, restore_rng=restore, verbose=True),
                                               job(os.path.join(scratch, "straight"))])
            else:
                crash_epoch, crashed = args.epochs // 2, os.path.join(scratch, "crashed")
                path = os.path.join(crashed, CHECKPOINT)
                try:
                    run(args, [job(crashed, crash_at_epoch=crash_epoch)])
                    raise SystemExit("the crash run did not crash")
                except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
                    info = read_checkpoint(path, args)
                    crash_report.append(f"crash run: killed in the middle of epoch {crash_epoch} ({error_line(e)}); its "
                                        f"last checkpoint reads back intact: epoch {info['epoch']}, step {info['step']}")
                what = f"killed in epoch {crash_epoch}, resumed from its checkpoint"
                jobs = [job(os.path.join(scratch, "straight")), job(os.path.join(scratch, "resumed"), resume=path,
                                                                    restore_rng=restore)]
                if restore:  # and once more without the RNG states, to show what they are for
                    jobs.append(job(os.path.join(scratch, "no_rng"), resume=path, restore_rng=False))
                straight, resumed, *unrestored = run(args, jobs)
                unrestored = unrestored[0] if unrestored else None
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            print(f"\nRUN FAILED: a rank stopped, so every rank was stopped.\n{e}", file=sys.stderr)
            return 1
        elapsed = time.perf_counter() - start
    eval_ok = show_evaluation(straight["evaluation"], args)
    steps = len(straight["losses"][0]) // args.epochs
    print(f"\nPART 3: checkpoints ({args.world_size} ranks x batch {args.batch_size}, {args.samples} samples, "
          f"{steps} steps per epoch)")
    print("\n".join(crash_report + ["mean loss per epoch (over ranks and steps):"]))
    for label, result in [("uninterrupted", straight), ("resumed", resumed), ("resumed, RNG not restored", unrestored)]:
        if result is not None:
            print(f"  {label:<27}" + "  ".join(f"{v:.6f}" for v in epoch_means(result, steps)))
    if unrestored is not None:
        _, _, dloss, dw = compare(straight, unrestored)
        print(f"the same resume WITHOUT restoring the RNG states: max |dloss| {dloss:.3f}, max |dw| {dw:.1e} "
              f"(dropout drew other masks after the resume)")
    print(f"training runs took {elapsed:.1f} s")
    if not restore:
        what += " WITHOUT restoring the RNG states"
    passed, message = proof_line(args, *compare(straight, resumed), eval_ok, straight["evaluation"], what)
    print(message)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
