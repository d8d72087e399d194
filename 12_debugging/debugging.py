"""Lesson 12: lesson 02's DDP, armed to name a hang and to find where two runs part.
    python 12_debugging/debugging.py                   # DDP on 2 ranks against one process
    python 12_debugging/debugging.py --dtype float64   # in float64 rounding noise vanishes
"""
import argparse
import datetime
import faulthandler
import gc
import os
import random
import signal
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


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Linear(20, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)


def dump_flight_recorder(folder, rank, backend):
    """This rank's flight recorder (its last collectives) for torchfrtrace; a private API."""
    from torch._C import _distributed_c10d as c10d
    dump = c10d._dump_nccl_trace if backend == "nccl" else c10d._dump_fr_trace  # gloo's
    open(os.path.join(folder, f"fr-rank{rank}"), "wb").write(dump())  # closed when written


def trace_step(model, x, y):
    """One step's (loss, {input, each layer's output, each gradient}), in the order they happen."""
    trace = {"input": x.detach().clone()}
    hooks = [m.register_forward_hook(lambda m, i, out, name=name: trace.__setitem__(
        f"output of {name.removeprefix('module.')}", out.detach().clone()))
        for name, m in model.named_modules() if not [*m.children()]]  # Linear, LayerNorm, ReLU
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    [hook.remove() for hook in hooks]
    for name, p in reversed(list(model.named_parameters())):
        trace[f"gradient of {name.removeprefix('module.')}"] = p.grad.detach().clone()
    return loss, trace


def train(model, loader, optimizer, epochs, device, folder):
    """Forward, loss, backward, step; step 1 traced, to folder/trace-rank{rank}.pt."""
    losses = []
    for epoch in range(epochs):
        model.train()
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            x, y = x.to(device, next(model.parameters()).dtype), y.to(device)
            optimizer.zero_grad()
            loss, trace = trace_step(model, x, y)  # DDP averages the gradients in backward()
            if not losses:  # step 1, every layer's output and gradient, for the comparison
                torch.save(trace, os.path.join(folder, f"trace-rank{dist.get_rank()}.pt"))
            optimizer.step()
            losses.append(loss.item())
    return losses


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, dtype, timeout=60):
    """Lesson 02's rank, armed: its stacks on SIGUSR1, its flight recorder on an error."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else torch.set_num_threads(1)
    if hasattr(signal, "SIGUSR1"):  # kill -USR1 PID: every thread's Python stack, written even
        stacks = open(os.path.join(folder, f"stack-rank{rank}.txt"), "w")  # while the rank waits
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)  # in C++ code
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = DDP(make_model(dtype=getattr(torch, dtype)).to(device),
                    device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        losses = train(model, loader, optimizer, epochs, device, folder)
        if backend == "gloo":  # every rank gets here, or those that do name who did not
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
        return model.module, losses
    except Exception:  # the group's timeout (gloo): what each rank called last, to compare
        dump_flight_recorder(folder, rank, backend)
        raise
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


def compare(folder, world_size, batch_size, dtype):
    """Each rank's step 1 against one process on the same batch. An entry's tolerance: 10 x its
    float32 rounding (one process, float32 against float64), in a float64 run scaled by eps."""
    dataset, b, mine = make_dataset(), batch_size, getattr(torch, dtype)
    rows = sum([list(DistributedSampler(dataset, world_size, r, seed=0))[:b]
                for r in range(world_size)], [])  # the global batch: each rank's, in turn
    ref = {d: trace_step(make_model(dtype=d), dataset[rows][0].to(d), dataset[rows][1])[1]
           for d in (torch.float32, torch.float64)}
    scale = 10 * torch.finfo(mine).eps / torch.finfo(torch.float32).eps
    tolerance = {k: scale * (ref[torch.float32][k].double() - v).abs().max().item() + 1e-300
                 for k, v in ref[torch.float64].items()}  # 1e-300: an exact entry needs 0
    found = []
    for r in range(world_size):  # rank r's rows, every gradient; on CPU (NCCL saves on GPU)
        trace = torch.load(f"{folder}/trace-rank{r}.pt", map_location="cpu", weights_only=True)
        gaps = ((k, (v.double() - ref[mine][k].double()
                     [slice(None) if k.startswith("gradient") else slice(r * b, (r + 1) * b)])
                 .abs().max().item()) for k, v in trace.items())  # in the order they happened
        found.append(next(((k, gap) for k, gap in gaps if gap > tolerance[k]), None))
        print(f"rank {r}, step 1: " + (f"first apart from one process at {found[-1][0]} ("
              f"{found[-1][1]:.1e}, tolerance {tolerance[found[-1][0]]:.1e})" if found[-1] else
              f"every layer within float64's tolerance of one process ({dtype})"), flush=True)
    return found  # per rank: (the first entry apart, its difference), or None


def main(world_size=2, epochs=1, dtype="float32", debug_dir="debug", timeout=30, batch_size=16):
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"
    print(f"backend: {backend} ({torch.cuda.device_count()} GPU(s), {world_size} ranks); {dtype}")
    os.makedirs(debug_dir, exist_ok=True)
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, 0.05,
                           debug_dir, dtype, timeout), nprocs=world_size, join=True)
    compare(debug_dir, world_size, batch_size, dtype)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--debug-dir", default="debug", help="the ranks' files (default debug)")
    parser.add_argument("--timeout", type=float, default=30, help="group timeout in s (default 30)")
    main(**vars(parser.parse_args()))
