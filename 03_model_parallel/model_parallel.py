"""Lesson 03: lesson 02's model split in two: across two devices, under DDP, then pipelined.
    python 03_model_parallel/model_parallel.py
    python 03_model_parallel/model_parallel.py --schedule 1f1b --microbatches 8 --world-size 3
"""
import argparse
import datetime
import gc
import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_dataset(samples=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


class TwoDeviceModel(nn.Module):  # make_model() cut in two: stage 0 on dev0, stage 1 on dev1
    def __init__(self, model, dev0, dev1):
        super().__init__()
        self.dev0, self.dev1 = dev0, dev1
        self.stage0, self.stage1 = model[:2].to(dev0), model[2:].to(dev1)

    def forward(self, x):
        h = self.stage0(x.to(self.dev0))
        return self.stage1(h.to(self.dev1))  # the one line an unsplit model does not have


def choose_backend(gpus_needed):
    """NCCL with one GPU per model half when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= gpus_needed:
        return "nccl", f"{gpus} GPU(s) visible, {gpus_needed} needed"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s), {gpus_needed} needed"


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def join_group(rank, world_size, port, backend, timeout, gpus_per_rank):
    # mp.spawn: ONE machine, so rank r owns GPUs r*k .. r*k+k-1 (several nodes: LOCAL_RANK * k)
    devices = ([torch.device("cuda", gpus_per_rank * rank + i) for i in range(gpus_per_rank)]
               if backend == "nccl" else [torch.device("cpu")] * gpus_per_rank)
    if backend == "nccl":
        torch.cuda.set_device(devices[0])
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    bind = backend == "nccl" and gpus_per_rank == 1  # device_id binds NCCL to ONE device: not 2
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=devices[0] if bind else None)
    return devices


def train_split_model_with_ddp(rank, world_size, port, backend, epochs, batch_size, lr, timeout=60):
    """Lesson 02's worker with a two-device model; returns it and this rank's losses."""
    dev0, dev1 = join_group(rank, world_size, port, backend, timeout, gpus_per_rank=2)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = DDP(TwoDeviceModel(make_model(), dev0, dev1), device_ids=None)  # two devices: None
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y.to(dev1))  # labels by the output
                loss.backward()  # DDP averages the gradients of BOTH halves across ranks here
                optimizer.step()
                losses.append(loss.item())
        if rank == 0:
            print(f"split under DDP: {len(losses)} steps, rank 0 loss {losses[-1]:.4f}", flush=True)
        return model.module, losses
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


def train_pipeline(rank, port, backend, schedule, microbatches, epochs, batch_size, lr, timeout=60):
    """Stage `rank` of make_model() on rank 0 or 1; returns it and the last stage's losses."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # 1.3 s CPU
    device, = join_group(rank, 2, port, backend, timeout, gpus_per_rank=1)
    try:
        module = (make_model()[:2] if rank == 0 else make_model()[2:]).to(device)
        stage = PipelineStage(module, stage_index=rank, num_stages=2, device=device)
        pipe = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](  # gradients / microbatches
            stage, microbatches, loss_fn=nn.functional.cross_entropy, scale_grads=True)  # mean loss
        loader = DataLoader(make_dataset(), batch_size=batch_size, shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(0))  # same on both ranks
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
        losses = []
        for epoch in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()  # the schedule ACCUMULATES the micro-batches' gradients
                if rank == 0:  # the first stage feeds x, cut into micro-batches
                    pipe.step(x.to(device))
                else:  # the last stage computes the loss of each micro-batch
                    pipe.step(target=y.to(device), losses=(per_microbatch := []))
                    losses.append(torch.stack(per_microbatch).mean().item())
                optimizer.step()  # each rank steps its own stage
        if rank == 1:
            print(f"pipeline: {len(losses)} steps, final loss {losses[-1]:.4f}", flush=True)
        return module, losses
    finally:  # the stage and the schedule refer to the group and keep its receive buffers:
        stage = pipe = optimizer = None  # release them before destroying the group
        gc.collect()
        dist.destroy_process_group()


def main(world_size=2, schedule="gpipe", microbatches=4, epochs=2, batch_size=16, lr=0.05):
    backend, reason = choose_backend(2 * world_size)
    print(f"split under DDP: {backend} ({reason}); {world_size} ranks x 2 devices", flush=True)
    mp.spawn(train_split_model_with_ddp, args=(world_size, find_free_port(), backend, epochs,
                                               batch_size, lr), nprocs=world_size, join=True)
    backend, reason = choose_backend(2)
    print(f"pipeline: {backend} ({reason}); {schedule}, {microbatches} micro-batches", flush=True)
    mp.spawn(train_pipeline, args=(find_free_port(), backend, schedule, microbatches, epochs,
                                   2 * batch_size, lr), nprocs=2, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="DDP ranks (default 2)")
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--microbatches", type=int, default=4, help="per pipeline step (default 4)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="per DDP rank (default 16)")
    main(**vars(parser.parse_args()))
