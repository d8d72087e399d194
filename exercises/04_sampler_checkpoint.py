# Exercise 04: turn lesson 02's script into lesson 04's
# The TODOs say what to add. Solution: 04_sampler_checkpoint/sampler_checkpoint.py.
# Grade your copy: python 04_sampler_checkpoint/prove.py --lesson YOUR_COPY.py
"""Lesson 04: lesson 02 plus exact evaluation, and checkpoints that resume a crashed run bit-exact.
    python 04_sampler_checkpoint/sampler_checkpoint.py --ckpt-dir ckpt
    python 04_sampler_checkpoint/sampler_checkpoint.py --ckpt-dir ckpt --epochs 4   # 2 more epochs
"""
import argparse
import datetime
import gc
# TODO(lesson 04): import what the checkpoints need: finding files, hashing, a byte buffer,
#     skipping the steps already done, stderr
import os
import random
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
# TODO(lesson 04): import Subset: the last 101 samples become a validation set
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(samples=256, seed=0):
    """A learnable 4-class problem from its own seeded generator, never the global RNG: every
    process that builds it gets the same bytes, whatever that process did before."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    # TODO(lesson 04): add a Dropout(0.1): the RNG state becomes part of the training state
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


# TODO(lesson 04): evaluate(model, dataset, device): each rank counts (correct, total) on an
#     UNPADDED share (not a DistributedSampler: it pads), then all-reduce the counts
# TODO(lesson 04): find_checkpoint(folder, config): the newest step*.pt whose bytes match the
#     checksum in its name; a config that differs, or only damaged files, stop with one line
# TODO(lesson 04): checkpoint(folder, model, optimizer, step, config, device): every rank gathers
#     its RNG state; rank 0 writes model, optimizer, step, config and the RNG states to a temp
#     file, fsyncs, renames it step<step in 7 digits>-<first 16 hex of its sha256>.pt
#     (step0000010-52213e6d78397421.pt: names sort by step), keeps the two newest; then a barrier
# TODO(lesson 04): train(model, loader, optimizer, epochs, device, step, val_set, folder, config,
#     every=5): the step to start from, and where to save
def train(model, loader, optimizer, epochs, device):
    """Forward, loss, backward, step; returns the loss of every step on this rank."""
    losses = []
    # TODO(lesson 04): start at the epoch of `step`, and skip the batches of that epoch already
    #     done
    for epoch in range(epochs):
        model.train()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
            # TODO(lesson 04): count the steps; checkpoint every `every` steps and at the very end
        mean = torch.tensor(losses[-1], device=device)
        dist.all_reduce(mean)  # for the log only: training never needs the loss reduced
        # TODO(lesson 04): each epoch, evaluate on val_set and log the accuracy
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {mean.item() / dist.get_world_size():.4f} "
                  "(mean over ranks)", flush=True)
    return losses


def choose_backend(world_size):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


# TODO(lesson 04): worker also takes folder and resume; it returns the first step too
def worker(rank, world_size, port, backend, epochs, batch_size, lr, timeout=60):
    """One process = one rank = one replica; mp.spawn calls it with rank 0 .. world_size-1.
    Returns the trained model and this rank's losses (prove.py keeps them; mp.spawn does not)."""
    # mp.spawn starts every rank on this one machine, so the rank is the GPU's index. On several
    # nodes, the GPU's index on its node: int(os.environ["LOCAL_RANK"]) under torchrun (lesson 05).
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        # TODO(lesson 04): 256 samples to train on and 101 held out; the sampler and the loader on
        #     the training part only
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        # The loader's own generator: the seed each epoch's iterator draws never touches the
        # global RNG (lesson 04 saves and restores that one in its checkpoints).
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        # TODO(lesson 04): seed each rank's RNG differently (dropout); when resuming, every rank
        #     loads the checkpoint (weights_only=True, onto its device): model, optimizer, step and
        #     ITS OWN RNG state; train from there
        start = time.perf_counter()
        losses = train(model, loader, optimizer, epochs, device)
        if rank == 0:
            # TODO(lesson 04): return (model, losses, first step)
            print(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
                  f"final loss {losses[-1]:.4f} on rank 0", flush=True)
        return model.module, losses
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 04): main takes the checkpoint folder
def main(world_size=2, epochs=2, batch_size=16, lr=0.05):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    # TODO(lesson 04): main: create the folder, find the checkpoint to resume from, say which, and
    #     pass folder and resume to the workers
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr),
             nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    # TODO(lesson 04): a --ckpt-dir flag (default checkpoints), passed to main
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr)
