"""Lesson 06: lesson 02's training without DDP: gradients averaged by hand, and a ring all-reduce.
    python 06_collectives/collectives.py                  # buckets of 4 KiB, dist.all_reduce
    python 06_collectives/collectives.py --bucket-kb 0    # one all_reduce per parameter
    python 06_collectives/collectives.py --ring --world-size 3  # this file's ring all-reduces them
"""
import argparse
import datetime
import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
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
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def make_buckets(params, cap_bytes):
    """Parameters in buckets of at most cap_bytes (a larger one gets a bucket alone), last layer
    first: backward() produces the gradients in that order, so DDP buckets them that way."""
    buckets = [[]]
    for p in reversed([p for p in params if p.requires_grad]):  # frozen ones have no gradient
        if buckets[-1] and sum(q.numel() * q.element_size() for q in buckets[-1] + [p]) > cap_bytes:
            buckets.append([])
        buckets[-1].append(p)
    return buckets


def average_gradients(buckets, world_size, all_reduce):
    """What DDP does in backward(), by hand: all-reduce each bucket of flattened gradients (the sum
    over the ranks), divide by N (the mean, which is DDP's), copy back into each .grad. Every
    parameter in a bucket needs a gradient on every rank: as DDP by default, no unused ones."""
    for bucket in buckets:
        flat = torch.cat([p.grad.flatten() for p in bucket])  # one message, not len(bucket)
        all_reduce(flat)
        flat /= world_size
        for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
            p.grad.copy_(piece.view_as(p))


def ring_step(send, recv, right, left):
    """Sends one chunk right while receiving one from the left; returns the bytes sent. Blocking
    send/recv facing each other wait forever; isend and irecv posted apart work on gloo, but NCCL
    does not promise it for large messages: one batch of both is what torch's pipelining uses."""
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return send.numel() * send.element_size()


def ring_all_reduce(tensor):
    """Sums a contiguous tensor over the ranks, in place, and returns the bytes this rank sent:
    N chunks, 2(N-1) steps, each sending one chunk: 2(N-1)/N * S per rank on average."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks, right, left = tensor.view(-1).tensor_split(n), (rank + 1) % n, (rank - 1) % n  # views
    received, sent = torch.empty_like(chunks[0]), 0  # chunk 0 is the largest (sizes differ by 1)
    for step in range(2 * (n - 1)):  # the same rotation twice: N-1 steps of each phase
        outgoing, incoming = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        if step < n - 1:  # reduce-scatter: add what arrives; at the end chunk r+1 is summed here
            sent += ring_step(outgoing, received[:incoming.numel()], right, left)
            incoming += received[:incoming.numel()]
        else:  # all-gather: a summed chunk arrives and overwrites; each goes once around the ring
            sent += ring_step(outgoing, incoming, right, left)
    return sent


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


def worker(rank, world_size, port, backend, epochs, batch_size, bucket_kb, ring, lr=0.05,
           timeout=60):
    """One rank, without DDP: it averages the gradients itself. Returns the model and the losses.
    mp.spawn: ranks on ONE machine, so rank = GPU index (several nodes: LOCAL_RANK, lesson 05)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = make_model().to(device)  # the same seed on every rank (DDP broadcasts rank 0's)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        buckets = make_buckets(model.parameters(), bucket_kb * 1024)  # 0 KiB: one per parameter
        all_reduce = ring_all_reduce if ring else dist.all_reduce
        losses = []
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()  # this rank's gradient only: nothing is averaged yet
                average_gradients(buckets, world_size, all_reduce)  # now every rank holds the mean
                optimizer.step()
                losses.append(loss.item())
        if rank == 0:
            print(f"trained {len(losses)} steps, {len(buckets)} bucket(s) all-reduced by "
                  f"{all_reduce.__name__}; final loss {losses[-1]:.4f} on rank 0", flush=True)
        return model, losses
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step per rank")
    parser.add_argument("--bucket-kb", type=float, default=4, help="bucket KiB; 0: one per tensor")
    parser.add_argument("--ring", action="store_true", help="all-reduce by this file's ring")
    args = parser.parse_args()
    world_size, batch_size = args.world_size, args.batch_size
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    mp.spawn(worker, args=(world_size, find_free_port(), backend, args.epochs, batch_size,
                           args.bucket_kb, args.ring), nprocs=world_size, join=True)
