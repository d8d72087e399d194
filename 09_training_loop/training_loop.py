"""Lesson 09: lesson 02's DDP loop as people run it: gradient accumulation with no_sync(), bf16
autocast, gradient clipping, uneven inputs under Join, and TensorBoard logs:
    python 09_training_loop/training_loop.py
    python 09_training_loop/training_loop.py --accumulate 4 --precision bf16 --log-dir runs/09
    tensorboard --logdir runs/09      # loss, accuracy, grad norm, lr; every rank's own loss
"""
import argparse
import contextlib
import datetime
import gc
import os
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torch.utils.tensorboard import SummaryWriter


def make_dataset(samples=256, seed=0):
    """A learnable 4-class problem from its own seeded generator, never the global RNG: every
    process that builds it gets the same bytes, whatever that process did before."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def train_step(model, micro_batches, optimizer, precision, max_norm, device):
    """One optimizer step on K micro-batches, all-reduced after the last one only. Returns this
    rank's [loss sum, correct, samples] and the grad norm before clipping (equal on all ranks)."""
    optimizer.zero_grad()
    totals, k = torch.zeros(3), len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(device), y.to(device)
        with model.no_sync() if i < k - 1 else contextlib.nullcontext():
            with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
            (loss / k).backward()  # under no_sync: adds into .grad; else: adds, then all-reduces
        totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return totals, norm.item()


def train(model, loader, optimizer, epochs, accumulate, precision, max_norm, writer, device):
    """Epochs of K-micro-batch steps; rank 0 logs to TensorBoard. Returns the gradient norms."""
    norms = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        totals = torch.zeros(3)
        with Join([model]):  # a rank out of batches answers the others' all-reduces with zeros
            for batches in zip(*[iter(loader)] * accumulate):  # K at a time; a tail is dropped
                sums, norm = train_step(model, batches, optimizer, precision, max_norm, device)
                totals += sums
                norms.append(norm)
                if writer:  # the norm and the lr are the same on every rank
                    writer.add_scalar("step/grad_norm", norm, len(norms))
                    writer.add_scalar("step/lr", optimizer.param_groups[0]["lr"], len(norms))
        everyone = [torch.zeros(3, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, totals.to(device))  # after Join: every rank is here, no wait
        loss, correct, seen = torch.stack(everyone).sum(0).tolist()
        if writer:  # every rank's own loss, and the whole run's loss and accuracy
            for r, (rank_loss, _, rank_seen) in enumerate(everyone):
                writer.add_scalar(f"epoch/loss_rank{r}", rank_loss / rank_seen, epoch)
            writer.add_scalar("epoch/loss", loss / seen, epoch)
            writer.add_scalar("epoch/accuracy", correct / seen, epoch)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {loss / seen:.4f}  accuracy {correct / seen:.3f}  each "
                  "rank's loss " + " ".join(f"{t[0] / t[2]:.4f}" for t in everyone), flush=True)
    return norms


def choose_backend(world_size):
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def worker(rank, world_size, port, backend, epochs, accumulate, precision, log_dir,
           batch_size=16, lr=0.05, max_norm=1.0, timeout=60):
    """One rank; mp.spawn starts ranks 0 .. world_size-1 on ONE machine, so the rank is the GPU
    (several nodes: LOCAL_RANK, lesson 05). Returns the trained model and the gradient norms."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    writer = None
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        writer = SummaryWriter(log_dir) if rank == 0 and log_dir else None
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0), drop_last=True)  # B each
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        start = time.perf_counter()
        norms = train(model, loader, optimizer, epochs, accumulate, precision, max_norm,
                      writer, device)
        if rank == 0:
            print(f"trained {len(norms)} steps in {time.perf_counter() - start:.1f} s", flush=True)
        return model.module, norms
    finally:
        if writer:
            writer.close()
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


def main(world_size=2, epochs=2, accumulate=2, precision="fp32", log_dir=None):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; each step {world_size} "
          f"ranks x {accumulate} micro-batches x 16 = {world_size * accumulate * 16}", flush=True)
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, accumulate, precision,
                           log_dir), nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step (2)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="(fp32)")
    parser.add_argument("--log-dir", help="TensorBoard folder (rank 0 writes; default: no log)")
    main(**vars(parser.parse_args()))
