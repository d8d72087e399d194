"""Lesson 06, part 3: ZeRO-1 by hand, the step between DDP and FSDP: each rank keeps the optimizer
state of 1/N of the parameters, steps that shard only, and the ranks all-gather the result.

    python 06_collectives/zero1.py                      # 2 ranks: half the optimizer state each
    python 06_collectives/zero1.py --world-size 4       # a quarter each
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


def flat_padded(tensors, size):
    flat = torch.cat([t.flatten() for t in tensors])
    return torch.cat([flat, flat.new_zeros(size - len(flat))])


def zero1_shard(params, world_size, rank):
    """The trainable parameters as one flat vector padded to N*k; this rank owns [rank*k, rank*k+k).
    `params`: tensors (model.parameters()), not an optimizer's parameter groups (dicts): the shard
    is one tensor with one lr, so per-group settings (weight decay, lr) have no place here.
    Returns (params, k, shard): the optimizer sees the shard only, so only it gets state. The
    shard is a COPY: call this after loading a checkpoint into the model and moving it."""
    params = [p for p in params if p.requires_grad]
    k = -(-sum(p.numel() for p in params) // world_size)  # ceil
    shard = flat_padded([p.detach() for p in params], k * world_size)[rank * k:(rank + 1) * k]
    return params, k, shard.clone().requires_grad_()


def zero1_step(params, k, shard, optimizer, world_size):
    """Reduce-scatter the gradients (each rank receives the sum of ITS shard only), divide by N,
    step the shard, all-gather every rank's updated shard and copy it back into the model."""
    if any(p.grad is None for p in params):  # torch's optimizers skip those; a flat shard cannot
        raise RuntimeError("a trainable parameter got no gradient: freeze it, or give it one")
    shard.grad = torch.empty_like(shard)
    dist.reduce_scatter_tensor(shard.grad, flat_padded([p.grad for p in params], k * world_size))
    shard.grad /= world_size
    optimizer.step()  # momentum exists for these k elements only: 1/N of the state
    flat = torch.empty(k * world_size, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(flat, shard.detach())
    sizes = [p.numel() for p in params]
    with torch.no_grad():  # the padding at the end stays behind
        for p, piece in zip(params, flat[:sum(sizes)].split(sizes)):
            p.copy_(piece.view_as(p))


def worker(rank, world_size, port, backend, epochs, batch_size, lr=0.05, timeout=60):
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
        params, k, shard = zero1_shard(model.parameters(), world_size, rank)
        optimizer = torch.optim.SGD([shard], lr=lr, momentum=0.9)  # sees this rank's shard only
        losses = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                model.zero_grad()
                loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()  # this rank's gradients, whole: ZeRO-1 shards only the state
                zero1_step(params, k, shard, optimizer, world_size)
                losses.append(loss.item())
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
        if rank == 0:
            print(f"trained {len(losses)} steps, final loss {losses[-1]:.4f} on rank 0; optimizer "
                  f"state on rank 0: {state:,} bytes", flush=True)
        return model, losses, state
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
    args = parser.parse_args()
    gpus = torch.cuda.device_count()  # NCCL with one process per GPU when there are enough
    backend = "nccl" if gpus >= args.world_size else "gloo"
    print(f"backend: {backend} ({gpus} GPU(s) for {args.world_size} ranks); global batch "
          f"{args.world_size} x {args.batch_size}", flush=True)
    mp.spawn(worker, args=(args.world_size, find_free_port(), backend, args.epochs,
                           args.batch_size), nprocs=args.world_size, join=True)
