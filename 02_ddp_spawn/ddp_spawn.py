"""Lesson 02: DistributedDataParallel started with mp.spawn, proved equal to single-process training.

    python 02_ddp_spawn/ddp_spawn.py                  # 2 ranks: NCCL with 2+ GPUs, else gloo on CPU
    python 02_ddp_spawn/ddp_spawn.py --world-size 3 --model resnet18
    python 02_ddp_spawn/ddp_spawn.py --no-sync-demo   # breaks gradient sync: the proof fails, exit 1

The proof: after training, every rank holds the same parameters, and they equal what ONE process
gets by training the same initial model on the concatenated global batches.
"""
import argparse
import copy
import datetime
import gc
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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# DDP vs one process differ only by summation order. Measured: ~5e-8 (float32 MLP), ~1e-13 (float64 resnet18);
# a real sync bug gives ~1e-1. Float32 resnet18 is NOT comparable: reordering one batch's rows alone moves it by 0.17.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="number of processes (ranks) to spawn (default 2)")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with one GPU per rank, else gloo")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if there is one GPU per rank, else cpu")
    p.add_argument("--model", choices=["mlp", "resnet18"], default="mlp", help="mlp (default, fast) or torchvision resnet18 with GroupNorm on FakeData 32x32")
    p.add_argument("--dtype", choices=["auto", "float32", "float64"], default="auto", help="auto: float64 for resnet18 (a deep net amplifies float32 rounding), float32 for mlp")
    p.add_argument("--samples", type=int, default=256, help="size of the synthetic data set (default 256)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size PER RANK; the global batch is world-size times this (default 16)")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train (default 2)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a stuck collective raises instead of hanging (default 60)")
    p.add_argument("--out-dir", help="keep each rank's results (rank<r>.pt) here; default: a temporary directory")
    p.add_argument("--no-sync-demo", action="store_true", help="train under ddp.no_sync() so gradients are never averaged: the proof must FAIL")
    p.add_argument("--crash-rank", type=int, default=None, help="make this rank raise at step 2, to see the whole run stop with the real error")
    args = p.parse_args(argv)
    if args.world_size < 1:
        p.error(f"--world-size must be at least 1, got {args.world_size}")
    if min(args.samples, args.batch_size, args.epochs) < 1 or args.timeout <= 0 or args.lr <= 0:
        p.error("--samples, --batch-size, --epochs, --lr and --timeout must be positive")
    if args.crash_rank is not None and not 0 <= args.crash_rank < args.world_size:
        p.error(f"--crash-rank must be a rank between 0 and {args.world_size - 1}")
    steps = args.epochs * -(-args.samples // (args.world_size * args.batch_size))  # DistributedSampler pads: ceil
    if args.crash_rank is not None and steps < 2:
        p.error(f"--crash-rank crashes at step 2, but this run has {steps} step(s): use more --samples or --epochs")
    if args.no_sync_demo and args.world_size < 2:
        p.error("--no-sync-demo needs --world-size 2 or more: one rank has nothing to synchronise, so nothing can fail")
    args.backend, args.device, args.reason = choose_backend(args.backend, args.device, args.world_size, p.error)
    if args.dtype == "auto":
        args.dtype = "float64" if args.model == "resnet18" else "float32"
    args.dtype = getattr(torch, args.dtype)
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


def make_dataset(args):
    if args.model == "resnet18":
        from torchvision.datasets import FakeData
        from torchvision.transforms import ToTensor
        return FakeData(size=args.samples, image_size=(3, 32, 32), num_classes=10, transform=ToTensor())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)  # a learnable 4-class problem
    return TensorDataset(x, y)


def make_model(args):
    torch.manual_seed(0)  # every rank, and the reference, start from the same weights
    if args.model == "resnet18":
        from torchvision.models import resnet18
        # BatchNorm statistics are per rank, so BatchNorm would break the equality; GroupNorm is per sample.
        return resnet18(num_classes=10, norm_layer=lambda channels: nn.GroupNorm(32, channels))
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def spread_across_ranks(t):
    """Largest element-wise difference of t between any two ranks (0.0 means identical everywhere)."""
    high, low = t.detach().clone(), t.detach().clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return (high - low).abs().max().item()


def gradient_sync_report(ddp_model, x, y, loss, world_size):
    """Right after backward(): are gradients already averaged? Is the loss? (only the gradients are)"""
    alone = copy.deepcopy(ddp_model.module)  # what this rank would compute on its own, without DDP
    alone.zero_grad(set_to_none=True)  # deepcopy also copied the (already averaged) .grad
    nn.functional.cross_entropy(alone(x), y).backward()
    mean_of_local = flat_grad(alone)
    dist.all_reduce(mean_of_local)
    mean_of_local /= world_size
    return {"loss_spread": spread_across_ranks(loss), "grad_spread": spread_across_ranks(flat_grad(ddp_model)),
            "ddp_vs_mean_of_local": (flat_grad(ddp_model) - mean_of_local).abs().max().item()}


def worker(rank, args, port, out_dir, verbose=True):
    """One process = one rank = one model replica. mp.spawn calls this with rank 0..world_size-1."""
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False  # TF32 would change the numbers the proof compares
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))  # ranks share the cores
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout), device_id=device if args.device == "cuda" else None)
    try:
        dataset = make_dataset(args)
        sampler = DistributedSampler(dataset, num_replicas=args.world_size, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        model = DDP(make_model(args).to(device, args.dtype), device_ids=[rank] if args.device == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        local_losses, mean_losses, sync_report, step = [], [], None, 0
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
            for x, y in loader:
                step += 1
                if step == 2 and rank == args.crash_rank:
                    raise RuntimeError(f"rank {rank} crashed on purpose (--crash-rank)")
                x, y = x.to(device, args.dtype), y.to(device)
                optimizer.zero_grad()
                if args.no_sync_demo:
                    with model.no_sync():  # skips the all-reduce: each rank keeps its own gradient
                        loss = nn.functional.cross_entropy(model(x), y)
                        loss.backward()
                else:
                    loss = nn.functional.cross_entropy(model(x), y)
                    loss.backward()  # DDP all-reduces (averages) the gradients HERE, bucket by bucket
                if sync_report is None:
                    sync_report = gradient_sync_report(model, x, y, loss, args.world_size)
                optimizer.step()
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)  # for the log only: training never needs the loss reduced
                mean_losses.append(mean_loss.item() / args.world_size)
                local_losses.append(loss.item())
                if verbose and rank == 0:
                    print(f"epoch {epoch} step {step:3d}  loss averaged over ranks {mean_losses[-1]:.4f}", flush=True)
        state = {k: v.cpu() for k, v in model.module.state_dict().items()}  # .module: no "module." prefix
        torch.save({"state": state, "local_losses": local_losses, "mean_losses": mean_losses, "sync_report": sync_report},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        del model, optimizer  # DDP holds the process group: release it now, not during interpreter shutdown
        gc.collect()          # (measured: without this, ~5-30% of gloo runs aborted at exit with SIGABRT)
    finally:
        dist.destroy_process_group()


def train_single_process(args, device="cpu"):
    """The reference: one process, the same initial model, and at each step the union of all ranks' batches."""
    dataset = make_dataset(args)
    model = make_model(args).to(device, args.dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    samplers = [DistributedSampler(dataset, num_replicas=args.world_size, rank=r, shuffle=True, seed=0)
                for r in range(args.world_size)]
    for epoch in range(args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        for start in range(0, len(per_rank[0]), args.batch_size):
            batch = [dataset[i] for indices in per_rank for i in indices[start:start + args.batch_size]]
            x = torch.stack([b[0] for b in batch]).to(device, args.dtype)
            y = torch.as_tensor([int(b[1]) for b in batch]).to(device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def max_abs_diff(state_a, state_b):
    return max((state_a[k].double() - state_b[k].double()).abs().max().item() for k in state_a)


def check_proof(args, out_dir):
    """Returns (passed, message, per-rank results)."""
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), map_location="cpu", weights_only=True)
               for r in range(args.world_size)]
    between_ranks = max(max_abs_diff(results[0]["state"], r["state"]) for r in results)
    reference = train_single_process(args, device="cuda:0" if args.device == "cuda" else "cpu")
    vs_single = max_abs_diff(results[0]["state"], reference)
    tolerance = TOLERANCE[args.dtype]
    passed = between_ranks == 0.0 and vs_single <= tolerance
    message = (f"PROOF {'PASSED' if passed else 'FAILED'}: {args.world_size} ranks hold identical parameters: "
               f"{'yes' if between_ranks == 0.0 else 'NO'} (max |dw| between ranks {between_ranks:.1e}); they match one process "
               f"trained on the global batch of {args.world_size * args.batch_size}: max |dw| {vs_single:.1e} "
               f"({str(args.dtype)[6:]}, tolerance {tolerance:.0e})")
    return passed, message, results


def main(argv=None):
    args = parse_args(argv)
    print(f"backend: {args.backend} on {args.device} ({args.reason}); world size {args.world_size}; "
          f"model {args.model} in {str(args.dtype)[6:]}{'; --no-sync-demo: gradients will NOT be synchronised' if args.no_sync_demo else ''}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ddp_spawn_") as scratch:
        out_dir = args.out_dir or scratch
        os.makedirs(out_dir, exist_ok=True)
        start = time.perf_counter()
        try:
            mp.spawn(worker, args=(args, find_free_port(), out_dir), nprocs=args.world_size, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # one rank failed: spawn has already stopped the others
            print(f"\nRUN FAILED: a rank stopped with an error, so every rank was stopped.\n{e}", file=sys.stderr)
            return 1
        print(f"training took {time.perf_counter() - start:.1f} s")
        passed, message, results = check_proof(args, out_dir)
    report = results[0]["sync_report"]
    synced = report["grad_spread"] == 0.0 and report["ddp_vs_mean_of_local"] <= TOLERANCE[args.dtype]
    print(f"after the first backward(), before step(): the loss differs across ranks by {report['loss_spread']:.3f} "
          f"(the loss is never reduced); the gradient differs by {report['grad_spread']:.1e} and is "
          f"{report['ddp_vs_mean_of_local']:.1e} from the mean of the per-rank gradients "
          f"({'DDP averaged the gradients inside backward()' if synced else 'gradients were NOT synchronised'})")
    print(message)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
