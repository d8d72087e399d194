"""Lesson 08: a parameter server over torch.distributed.rpc, with RRef, distributed autograd and
DistributedOptimizer.

    python 08_rpc/rpc.py
    python 08_rpc/rpc.py --trainers 2 --epochs 3

Rank 0 ("ps") owns the model; trainers 1..T hold only an RRef to it. Each step, a trainer sends
its batch to the server (forward runs there), computes the loss, runs distributed autograd
backward across the RPC boundary, and asks the server to step. RPC is in maintenance mode in
torch 2.15 (README.md): learn it to read old code, not to start new systems on it.
"""
import argparse
import os
import random
import socket
import sys
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if not rpc.is_available():  # PyTorch's Windows builds have no RPC: one line, not an ImportError
    raise SystemExit(f"torch.distributed.rpc is not in this torch build (platform {sys.platform})")
from torch.distributed.optim import DistributedOptimizer  # noqa: E402 (needs RPC)

SERVER = {}  # what the parameter server's process owns; trainers reach it only through RPC
FORWARD_LOCK = threading.Lock()  # the server answers RPCs in a pool of threads, at once


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


def server_model():
    """Runs on "ps" (called through rpc.remote): the model that the server owns."""
    return SERVER["model"]


def forward_on_server(model_rref, x):
    """Runs on "ps": the forward, on a copy of the weights as they are now. Another trainer's
    step may change the weights in place before this step's backward: autograd would refuse."""
    model = model_rref.local_value()
    with FORWARD_LOCK:  # functional_call swaps the module's weights: one forward at a time
        weights = {name: p.clone() for name, p in model.named_parameters()}  # grads flow to p
        return torch.func.functional_call(model, weights, (x,))


def parameter_rrefs(model_rref):
    """Runs on "ps": one RRef per parameter of the model, for DistributedOptimizer."""
    return [rpc.RRef(p) for p in model_rref.local_value().parameters()]


def train(model_rref, loader, optimizer, epochs, name):
    """Forward on the server, loss here, distributed backward, remote step; returns the losses."""
    losses = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every trainer
        for x, y in loader:
            with dist_autograd.context() as context_id:  # one context per step: its gradients
                output = rpc.rpc_sync("ps", forward_on_server, args=(model_rref, x))
                loss = nn.functional.cross_entropy(output, y)
                dist_autograd.backward(context_id, [loss])  # across RPC, into the context
                optimizer.step(context_id)  # "ps" steps with the gradients of this context
            losses.append(loss.item())
        print(f"{name}: epoch {epoch}  loss {losses[-1]:.4f}", flush=True)
    return losses


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def run_trainer(rank, trainers, epochs, batch_size, lr, name):
    """A trainer: its share of the data, an RRef to the server's model, a DistributedOptimizer."""
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, num_replicas=trainers, rank=rank - 1, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                        generator=torch.Generator().manual_seed(0))
    model_rref = rpc.remote("ps", server_model)  # a reference: the weights stay on "ps"
    params = rpc.rpc_sync("ps", parameter_rrefs, args=(model_rref,))
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=lr, momentum=0.9)
    start = time.perf_counter()
    losses = train(model_rref, loader, optimizer, epochs, name)
    print(f"{name}: trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
          f"final loss {losses[-1]:.4f}", flush=True)
    return losses


def worker(rank, world_size, port, epochs, batch_size, lr, timeout=60):
    """Rank 0 = "ps", the parameter server; ranks 1.. = "trainer1", ... Returns, on "ps", the
    trained model; on a trainer, its losses (prove.py keeps them; mp.spawn does not)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    name = "ps" if rank == 0 else f"trainer{rank}"
    if rank == 0:
        SERVER["model"] = make_model()  # before init_rpc: no RPC can arrive before it exists
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                              rpc_timeout=timeout)  # each RPC raises after this
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    try:  # the server has nothing to call: it answers the trainers' RPCs until shutdown below
        result = SERVER["model"] if rank == 0 else run_trainer(rank, world_size - 1, epochs,
                                                               batch_size, lr, name)
    except BaseException:  # a failed rank ends now, and mp.spawn (or torchrun) stops the others:
        rpc.shutdown(graceful=False)  # a graceful shutdown would wait for them to finish
        raise
    rpc.shutdown()  # graceful: waits until every rank gets here; the server serves until then
    return result  # on "ps": the model, trained by now


def main(trainers=1, epochs=2, batch_size=16, lr=0.05):
    print(f"rpc backend: TensorPipe on CPU (the only RPC backend in torch 2.15); 1 server + "
          f"{trainers} trainer(s), batch {batch_size} per trainer step", flush=True)
    mp.spawn(worker, args=(trainers + 1, find_free_port(), epochs, batch_size, lr),
             nprocs=trainers + 1, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=1, help="trainer processes beside the "
                        "server (default 1; 2 or more update it asynchronously)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step PER "
                        "TRAINER (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    main(args.trainers, args.epochs, args.batch_size, args.lr)
