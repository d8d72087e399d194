"""Lesson 07: lesson 02 with FSDP2 (fully_shard) instead of DDP, and distributed checkpoints.
    python 07_fsdp_dcp/fsdp_dcp.py --world-size 2 --epochs 1    # saves ckpt_fsdp/epoch0001
    python 07_fsdp_dcp/fsdp_dcp.py --world-size 3 --epochs 2    # loads it on 3 ranks, goes on
"""
import argparse
import datetime
import gc
import glob
import os
import random
import shutil
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
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


def train(model, loader, optimizer, epochs, device, first_epoch, folder):
    losses = []
    for epoch in range(first_epoch, epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # FSDP reduce-scatters: each rank gets the average of its shard
            optimizer.step()
            losses.append(loss.item())
        path = save_checkpoint(folder, model, optimizer, epoch + 1)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {losses[-1]:.4f} on rank 0; saved {path}", flush=True)
    return losses


def save_checkpoint(folder, model, optimizer, epoch):
    """EVERY rank writes its shards, then rank 0 `.metadata` and the rename: one disk for all."""
    path = os.path.join(folder, f"epoch{epoch:04d}")
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards: no gather
    dcp.save({"model": model_sd, "optim": optim_sd, "epoch": epoch}, checkpoint_id=path + ".tmp")
    if dist.get_rank() == 0:
        os.replace(path + ".tmp", path)
    dist.barrier()  # every rank: when it returns, the checkpoint exists for everyone
    return path


def load_checkpoint(path, model, optimizer):
    """Each rank reads the pieces of ITS shards, whatever the world size that saved them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the shapes to fill in
    ckpt = {"model": model_sd, "optim": optim_sd, "epoch": 0}
    dcp.load(ckpt, checkpoint_id=path)  # in place, into these tensors
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])
    return ckpt["epoch"]


def find_checkpoint(folder):
    """The newest checkpoint in `folder`, or None; one that DCP cannot read stops with one line."""
    for path in sorted(glob.glob(os.path.join(folder, "epoch[0-9][0-9][0-9][0-9]")))[-1:]:
        try:  # .metadata is written last; the files it names must be there, as long as it says
            for info in dcp.FileSystemReader(path).read_metadata().storage_data.values():
                file = os.path.join(path, info.relative_path)
                if os.path.getsize(file) < info.offset + info.length:
                    raise ValueError(f"{info.relative_path} is truncated")
        except Exception as error:
            raise SystemExit(f"{path} is not a complete DCP checkpoint ({error}); move it away")
        return path


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


def worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, resume, timeout=60):
    """Holds 1/N of all. mp.spawn: ONE machine, so rank = GPU (several nodes: LOCAL_RANK, 05)."""
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
        model = make_model().to(device)  # whole and equal on every rank; fully_shard keeps 1/N
        mesh = dist.init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks
        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:  # the root last
            fully_shard(layer, mesh=mesh)  # a layer is all-gathered just when it runs
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # after sharding
        first_epoch = load_checkpoint(resume, model, optimizer) if resume else 0
        return train(model, loader, optimizer, epochs, device, first_epoch, folder)
    finally:
        model = optimizer = None  # FSDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


def main(world_size=2, epochs=2, batch_size=16, lr=0.05, folder="ckpt_fsdp"):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    for unfinished in glob.glob(os.path.join(folder, "epoch*.tmp")):  # from a save that crashed:
        shutil.rmtree(unfinished)  # the next save must not rename its stray files in with its own
    resume = find_checkpoint(folder)
    print(f"resuming from {resume}" if resume else f"no checkpoint in {folder}: from epoch 0")
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr,
                           folder, resume), nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="in all, resumed too (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step PER RANK")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--out-dir", default="ckpt_fsdp", help="checkpoints (resumes from them)")
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr, args.out_dir)
