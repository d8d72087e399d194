"""Lesson 06, part 2: DDP's real trick by hand: each bucket's all-reduce starts DURING backward,
while earlier layers still compute, and the step waits for them only before the optimizer.

    python 06_collectives/overlap.py                    # buckets of 4 KiB, 2 ranks
    python 06_collectives/overlap.py --bucket-kb 0      # one all-reduce per parameter
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


def make_dataset(samples=256, seed=0):  # lesson 06's data and model
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    return TensorDataset(x, (x @ torch.randn(20, 4, generator=g)).argmax(dim=1))


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def make_buckets(params, cap_bytes):  # lesson 06's: last layer first, frozen ones left out
    buckets = [[]]
    for p in reversed([p for p in params if p.requires_grad]):
        if buckets[-1] and sum(q.numel() * q.element_size() for q in buckets[-1] + [p]) > cap_bytes:
            buckets.append([])
        buckets[-1].append(p)
    return buckets


def overlap_gradients(buckets, world_size):
    """Hooks that start a bucket's all-reduce (async) once its last gradient is ready, while
    backward goes on with earlier layers. Returns finish(): wait for all, divide by N, copy back
    into each .grad. Call it after EACH backward and BEFORE optimizer.step(); finish.handles
    removes the hooks. Gradient accumulation needs DDP's no_sync(): a second backward raises."""
    bucket_of = {p: i for i, bucket in enumerate(buckets) for p in bucket}
    ready, in_flight = [0] * len(buckets), []

    def on_gradient(p):  # runs inside backward, once p.grad holds this step's gradient
        i = bucket_of[p]
        ready[i] += 1
        if ready[i] > len(buckets[i]):  # silently, it would average the first micro-batch only
            raise RuntimeError("a second backward before finish(): the bucket is already sent")
        if ready[i] == len(buckets[i]):  # the bucket is full: send it now, do not wait
            flat = torch.cat([q.grad.flatten() for q in buckets[i]])
            in_flight.append((buckets[i], flat, dist.all_reduce(flat, async_op=True)))

    # a tied parameter is one tensor: one hook, called once per backward
    handles = [p.register_post_accumulate_grad_hook(on_gradient) for p in bucket_of]

    def finish():  # a missing bucket would hang the other ranks: say so, even under python -O
        if len(in_flight) != len(buckets):
            raise RuntimeError(f"a bucket never filled: {len(in_flight)} of {len(buckets)} sent "
                               "since the last finish(); finish() twice, or before backward? a "
                               "parameter without a gradient?")
        for bucket, flat, work in in_flight:
            work.wait()  # the only place this rank waits for the network
            flat /= world_size
            for p, piece in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(piece.view_as(p))
        in_flight.clear()
        ready[:] = [0] * len(buckets)
    finish.handles = handles
    return finish


def worker(rank, world_size, port, backend, epochs, batch_size, bucket_kb, lr=0.05, timeout=60):
    """One rank (mp.spawn: ONE machine, so rank = GPU; several nodes: LOCAL_RANK, lesson 05)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        sampler = DistributedSampler(make_dataset(), num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(sampler.dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = make_model(seed=rank).to(device)  # other weights on every rank, on purpose:
        for tensor in [*model.parameters(), *model.buffers()]:  # as DDP's constructor does,
            dist.broadcast(tensor.detach(), src=0)  # rank 0's weights and buffers everywhere
        buckets = make_buckets(model.parameters(), bucket_kb * 1024)  # 0 KiB: one per tensor
        finish = overlap_gradients(buckets, world_size)  # hooks: before the first backward
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                model.zero_grad()
                loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()  # the buckets' all-reduces start in here, one by one
                finish()  # wait for them: every rank now holds the mean gradient
                optimizer.step()
                losses.append(loss.item())
        if rank == 0:
            print(f"trained {len(losses)} steps, {len(buckets)} bucket(s) all-reduced during "
                  f"backward; final loss {losses[-1]:.4f} on rank 0", flush=True)
        return model, losses
    finally:
        dist.destroy_process_group()


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step per rank")
    parser.add_argument("--bucket-kb", type=float, default=4, help="bucket KiB; 0: one per tensor")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()  # NCCL with one process per GPU when there are enough
    backend = "nccl" if gpus >= args.world_size else "gloo"
    print(f"backend: {backend} ({gpus} GPU(s) for {args.world_size} ranks); global batch "
          f"{args.world_size} x {args.batch_size}", flush=True)
    mp.spawn(worker, args=(args.world_size, find_free_port(), backend, args.epochs,
                           args.batch_size, args.bucket_kb), nprocs=args.world_size, join=True)
