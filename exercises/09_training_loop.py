# Exercise 09: turn lesson 02's script into lesson 09's
# The TODOs say what to add. Solution: 09_training_loop/training_loop.py.
# Grade your copy: python 09_training_loop/prove.py --lesson YOUR_COPY.py
"""Lesson 09: lesson 02's DDP loop as people run it: gradient accumulation with no_sync(), bf16
autocast, gradient clipping, uneven inputs under Join, and TensorBoard logs:
    python 09_training_loop/training_loop.py
    python 09_training_loop/training_loop.py --accumulate 4 --precision bf16 --log-dir runs/09
    tensorboard --logdir runs/09      # loss, accuracy, grad norm, lr; every rank's own loss
"""
import argparse
# TODO(lesson 09): import contextlib (a context that does nothing)
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
# TODO(lesson 09): import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
# TODO(lesson 09): import TensorBoard's SummaryWriter


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


# TODO(lesson 09): train_step(model, micro_batches, optimizer, precision, max_norm, device): K
#     micro-batches, all but the last under no_sync(); backward of loss / K; bf16 autocast when
#     asked; clip the grad norm; step; return [loss sum, correct, samples] and the norm
# TODO(lesson 09): train(model, loader, optimizer, epochs, accumulate, precision, max_norm, writer,
#     device): returns the grad norms
def train(model, loader, optimizer, epochs, device):
    """Forward, loss, backward, step; returns the loss of every step on this rank."""
    losses = []
    for epoch in range(epochs):
        model.train()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        # TODO(lesson 09): K batches at a time under Join([model]); sum each rank's totals; log
        #     loss, accuracy, grad norm and lr to the writer
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
        mean = torch.tensor(losses[-1], device=device)
        dist.all_reduce(mean)  # for the log only: training never needs the loss reduced
        if dist.get_rank() == 0:
            # TODO(lesson 09): print the loss and accuracy over all ranks, and each rank's own loss
            print(f"epoch {epoch}  loss {mean.item() / dist.get_world_size():.4f} "
                  "(mean over ranks)", flush=True)
    return losses


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


# TODO(lesson 09): worker(rank, world_size, port, backend, epochs, accumulate, precision, log_dir,
#     batch_size=16, lr=0.05, max_norm=1.0, timeout=60)
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
    # TODO(lesson 09): writer = None before the try (the finally closes it)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        # TODO(lesson 09): rank 0 opens a SummaryWriter when given log_dir
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            # TODO(lesson 09): drop_last=True: every rank the same number of
                            #     batches
                            generator=torch.Generator().manual_seed(0))
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        start = time.perf_counter()
        # TODO(lesson 09): call train with accumulate, precision, max_norm and the writer
        losses = train(model, loader, optimizer, epochs, device)
        if rank == 0:
            # TODO(lesson 09): return the norms
            print(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
                  f"final loss {losses[-1]:.4f} on rank 0", flush=True)
        return model.module, losses
    finally:
        # TODO(lesson 09): close the writer
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 09): main(world_size=2, epochs=2, accumulate=2, precision='fp32', log_dir=None): say
#     what one step holds; spawn with them
def main(world_size=2, epochs=2, batch_size=16, lr=0.05):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr),
             nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    # TODO(lesson 09): flags --accumulate (2), --precision (fp32 or bf16), --log-dir;
    #     main(**vars(parser.parse_args())): the flags are main's parameters
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step PER RANK "
                        "(default 16; the global batch is world size times this)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr)
