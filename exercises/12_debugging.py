# Exercise 12: turn lesson 02's script into lesson 12's
# The TODOs say what to add. Solution: 12_debugging/debugging.py.
# Grade your copy: python 12_debugging/prove.py --lesson YOUR_COPY.py
"""Lesson 12: lesson 02's DDP, armed to name a hang and to find where two runs part.
    python 12_debugging/debugging.py                   # DDP on 2 ranks against one process
    python 12_debugging/debugging.py --dtype float64   # in float64 rounding noise vanishes
"""
import argparse
import datetime
# TODO(lesson 12): import faulthandler: a rank's stacks on a signal
import gc
import os
import random
# TODO(lesson 12): import signal
import socket
# TODO(lesson 12): no timings here: no time
import time

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


# TODO(lesson 12): make_model(seed=0, dtype=torch.float32)
def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    # TODO(lesson 12): a LayerNorm(64) after the first Linear; the model in `dtype`
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


# TODO(lesson 12): dump_flight_recorder(folder, rank, backend): the flight recorder's bytes
#     (torch._C._distributed_c10d._dump_fr_trace(); _dump_nccl_trace() on NCCL) to
#     folder/fr-rank{rank}
# TODO(lesson 12): trace_step(model, x, y): forward hooks on every leaf module record its output
#     ('output of NAME', 'module.' dropped), after the input ('input'); cross-entropy, backward,
#     hooks removed; then each parameter's gradient, last first ('gradient of NAME'); return (loss,
#     trace): a dict in the order things happened
# TODO(lesson 12): train(model, loader, optimizer, epochs, device, folder)
def train(model, loader, optimizer, epochs, device):
    """Forward, loss, backward, step; returns the loss of every step on this rank."""
    losses = []
    for epoch in range(epochs):
        model.train()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            # TODO(lesson 12): the inputs in the model's dtype
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            # TODO(lesson 12): each step through trace_step; step 1's trace saved to
            #     folder/trace-rank{rank}.pt
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
        # TODO(lesson 12): no loss log (no all-reduce of the loss)
        mean = torch.tensor(losses[-1], device=device)
        dist.all_reduce(mean)  # for the log only: training never needs the loss reduced
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {mean.item() / dist.get_world_size():.4f} "
                  "(mean over ranks)", flush=True)
    return losses
# TODO(lesson 12): no choose_backend: main picks the backend


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


# TODO(lesson 12): worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, dtype,
#     timeout=60)
def worker(rank, world_size, port, backend, epochs, batch_size, lr, timeout=60):
    """One process = one rank = one replica; mp.spawn calls it with rank 0 .. world_size-1.
    Returns the trained model and this rank's losses (prove.py keeps them; mp.spawn does not)."""
    # mp.spawn starts every rank on this one machine, so the rank is the GPU's index. On several
    # nodes, the GPU's index on its node: int(os.environ["LOCAL_RANK"]) under torchrun (lesson 05).
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # TODO(lesson 12): one thread per rank on CPU; where SIGUSR1 exists, faulthandler.register it
    #     to write every thread's stack to folder/stack-rank{rank}.txt (the file kept open)
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
        # TODO(lesson 12): the model made in the run's dtype
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        # TODO(lesson 12): train with the folder; then, on gloo, a monitored_barrier with the
        #     timeout, waiting for every rank
        start = time.perf_counter()
        losses = train(model, loader, optimizer, epochs, device)
        if rank == 0:
            print(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
                  f"final loss {losses[-1]:.4f} on rank 0", flush=True)
        return model.module, losses
    # TODO(lesson 12): on an exception (the group's timeout), dump the flight recorder, then raise
    #     it again
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 12): compare(folder, world_size, batch_size, dtype): one process on the ranks' step-1
#     batch (each rank's first DistributedSampler(seed=0) batch, in turn), traced in float32 and
#     float64; each entry's tolerance 10 x |float32 - float64|, scaled by eps(dtype) /
#     eps(float32), + 1e-300; for each rank, the first entry of its saved trace (its rows of the
#     activations, every gradient) beyond it: print it and return the list, (name, gap) or None per
#     rank
# TODO(lesson 12): main(world_size=2, epochs=1, dtype='float32', debug_dir='debug', timeout=30,
#     batch_size=16): NCCL when there is a GPU per rank, else gloo; print it; make the folder;
#     mp.spawn the workers (lr 0.05); then compare
def main(world_size=2, epochs=2, batch_size=16, lr=0.05):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr),
             nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    # TODO(lesson 12): flags --world-size, --epochs (default 1), --dtype (float32 or float64),
    #     --debug-dir, --timeout; main(**vars(parser.parse_args()))
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step PER RANK "
                        "(default 16; the global batch is world size times this)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr)
