# Exercise 05: turn lesson 04's script into lesson 05's
# The TODOs say what to add. Solution: 05_torchrun_elastic/torchrun_elastic.py.
# Grade your copy: python 05_torchrun_elastic/prove.py --lesson YOUR_COPY.py
r"""Lesson 05: lesson 04 launched by torchrun, which restarts the ranks after a crash (with
--max-restarts); they resume from the last checkpoint.

  torchrun --standalone --nproc-per-node=2 --max-restarts=1 05_torchrun_elastic/torchrun_elastic.py
    python 05_torchrun_elastic/torchrun_elastic.py    # plain python: a world of one process
"""
import argparse
import datetime
import gc
import glob
import hashlib
import io
import itertools
import os
# TODO(lesson 05): torchrun gives the port: no random, no socket needed
import random
import socket
import sys

import torch
import torch.distributed as dist
# TODO(lesson 05): torchrun starts the processes: no torch.multiprocessing
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def make_dataset(samples=256, seed=0):
    """A learnable 4-class problem from its own seeded generator, never the global RNG: every
    process that builds it gets the same bytes, whatever that process did before."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    # Dropout draws from the global RNG: from here on, the RNG state is part of the training state.
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))


@torch.no_grad()
def evaluate(model, dataset, device):
    """(correct, total), each sample once: unpadded shards, COUNTS summed; a plain module."""
    model.eval()
    shard = Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for x, y in DataLoader(shard, batch_size=256, generator=torch.Generator()):
        counts[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    return counts.tolist()


def find_checkpoint(folder, config):
    """The newest checkpoint in `folder` whose bytes match their checksum, or None. Damage, or a
    checkpoint whose config (what must match; epochs may grow) differs, stops with one line."""
    damaged = []
    for path in sorted(glob.glob(os.path.join(folder, "step*.pt")), reverse=True):
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest()[:16] != os.path.basename(path)[-19:-3]:
            damaged.append(path)
            continue
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["config"]
        if saved != config:
            raise SystemExit(f"{path} belongs to another run ({saved} here, {config} now): "
                             "use another checkpoint folder, or the same settings")
        if damaged:
            print(f"WARNING: {damaged[0]} is damaged; using {path}", file=sys.stderr, flush=True)
        return path
    if damaged:
        raise SystemExit(f"every checkpoint in {folder} is damaged: {', '.join(damaged)}")


def checkpoint(folder, model, optimizer, step, config, device):
    """EVERY rank calls it; rank 0 writes. The name carries the bytes' sha256, so damage is found
    on load; temp file, fsync, rename: a crash mid-write leaves earlier checkpoints whole."""
    rng = [None] * dist.get_world_size()
    cuda = torch.cuda.get_rng_state() if device.type == "cuda" else None
    dist.all_gather_object(rng, {"cpu": torch.get_rng_state(), "cuda": cuda})  # every rank
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save({"step": step, "config": config, "rng": rng, "optimizer": optimizer.state_dict(),
                    "model": model.module.state_dict()}, buffer)  # .module: no "module." prefix
        data = buffer.getvalue()
        path = os.path.join(folder, f"step{step:07d}-{hashlib.sha256(data).hexdigest()[:16]}.pt")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(path + ".tmp", path)
        if os.name == "posix":  # and the rename itself is on disk
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd), os.close(fd)
        others = [p for p in glob.glob(os.path.join(folder, "step*.pt")) if p != path]
        for old in sorted(others, key=lambda p: (f"step{step:07d}-" not in p, p))[:-1]:
            os.remove(old)  # keep this one and the one before it (not a damaged one of this step)
        print(f"saved {path}", flush=True)
    dist.barrier()  # every rank: when it returns, the checkpoint exists for everyone


def train(model, loader, optimizer, epochs, device, step, val_set, folder, config, every=5):
    """From `step` on, with a checkpoint every `every` steps and at the end; returns the losses."""
    losses = []
    for epoch in range(step // len(loader), epochs):
        model.train()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in itertools.islice(loader, step % len(loader), None):  # skip what is done
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step % every == 0 or step == epochs * len(loader):
                checkpoint(folder, model, optimizer, step, config, device)
        mean = torch.tensor(losses[-1], device=device)
        dist.all_reduce(mean)  # for the log only: training never needs the loss reduced
        correct, total = evaluate(model.module, val_set, device)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {mean.item() / dist.get_world_size():.4f} "
                  f"(mean over ranks)  accuracy {correct}/{total}", flush=True)
    return losses


def choose_backend(world_size):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


# TODO(lesson 05): instead of find_free_port, init_distributed(backend, device, timeout): the
#     store, rank and world size from dist.rendezvous('env://'); when TORCHELASTIC_USE_AGENT_STORE
#     is 'True' (torchrun's own store, which outlives a restart), wrap it in a PrefixStore named
#     after TORCHELASTIC_RESTART_COUNT; init_process_group with that store, the timeout, and
#     device_id on a GPU
def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


# TODO(lesson 05): instead of worker, main(epochs=2, batch_size=16, lr=0.05, folder='checkpoints',
#     timeout=60): ONE rank. Under plain python (no RANK in the environment) set what torchrun
#     would for a world of one (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
#     MASTER_PORT=0); the backend from LOCAL_WORLD_SIZE, the device from LOCAL_RANK; find the
#     checkpoint BEFORE any collective (a bad folder is one line); rank 0 says the backend, world
#     size and attempt; then init_distributed and the worker's training
def worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, resume, timeout=60):
    """One rank; mp.spawn starts ranks 0 .. world_size-1 on ONE machine, so the rank is the GPU
    (several nodes: LOCAL_RANK, lesson 05). Returns the model, losses and the first step."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        dataset = make_dataset(256 + 101)  # 101 held out: no world size from 2 to 100 divides it
        train_set, val_set = Subset(dataset, range(256)), Subset(dataset, range(256, 357))
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
        # The loader's own generator: its seeds never touch the global RNG (saved for dropout).
        loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        torch.manual_seed(1 + rank)  # each rank its own dropout masks, its own RNG state to save
        step, config = 0, {"world_size": world_size, "batch_size": batch_size, "lr": lr}
        if resume:  # every rank loads, onto its own device, tensors and plain types only
            state = torch.load(resume, map_location=device, weights_only=True)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"][rank]["cpu"].cpu())  # this rank's own stream
            if device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"][rank]["cuda"].cpu(), device)
            step = state["step"]
        losses = train(model, loader, optimizer, epochs, device, step, val_set, folder, config)
        if rank == 0:
            print(f"trained {len(losses)} steps after step {step}", flush=True)
        return model.module, losses, step
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 05): no mp.spawn main: torchrun runs this file once per rank
def main(world_size=2, epochs=2, batch_size=16, lr=0.05, folder="checkpoints"):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    os.makedirs(folder, exist_ok=True)
    resume = find_checkpoint(folder, {"world_size": world_size, "batch_size": batch_size, "lr": lr})
    print(f"resuming from {resume}" if resume else f"no checkpoint in {folder}: from step 0")
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr,
                           folder, resume), nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # TODO(lesson 05): flags: no --world-size (torchrun's --nproc-per-node); --ckpt-dir with
    #     dest='folder'; a --timeout; main(**vars(parser.parse_args()))
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--ckpt-dir", default="checkpoints", help="folder (default checkpoints)")
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr, args.ckpt_dir)
