# Exercise 02: turn lesson 00's script into lesson 02's
# The TODOs say what to add. Solution: 02_ddp_spawn/ddp_spawn.py.
# Grade your copy: python 02_ddp_spawn/prove.py --lesson YOUR_COPY.py
"""Lesson 02: lesson 00's training on N processes with DistributedDataParallel, started by mp.spawn.

    python 02_ddp_spawn/ddp_spawn.py
    python 02_ddp_spawn/ddp_spawn.py --world-size 3 --epochs 3

Each process (rank) holds a replica and trains on its own share of every batch. DDP averages the
gradients inside backward(), so every replica takes the same step and stays identical.
"""
import argparse
# TODO(lesson 02): import what a process group with a timeout and a free port need
import time

import torch
# TODO(lesson 02): import torch.distributed and torch.multiprocessing
import torch.nn as nn
# TODO(lesson 02): import DDP and DistributedSampler
from torch.utils.data import DataLoader, TensorDataset


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


def train(model, loader, optimizer, epochs, device):
    """Forward, loss, backward, step; returns the loss of every step on this rank."""
    losses = []
    for epoch in range(epochs):
        model.train()
        # TODO(lesson 02): each epoch, tell the sampler which epoch it is (else every epoch
        #     shuffles alike)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
        # TODO(lesson 02): log the loss averaged over the ranks (all-reduce a copy), from rank 0
        #     only
        print(f"epoch {epoch}  loss {losses[-1]:.4f}", flush=True)
    return losses


# TODO(lesson 02): choose_backend(world_size): ('nccl', why) when torch.cuda.device_count() gives a
#     GPU for every rank, else ('gloo', why)
# TODO(lesson 02): find_free_port(): a random port from 20000 to 32767 that nobody listens on now
#     (connect_ex is refused); not a fixed one, which collides with other jobs, nor one from
#     binding port 0, which the OS may hand to another process first (NOTES.md)
# TODO(lesson 02): worker(rank, world_size, port, backend, epochs, batch_size, lr, timeout=60):
#     this rank's device (on CPU, its share of the cores: torch.set_num_threads);
#     init_process_group at tcp://127.0.0.1:port with a timeout (and device_id on a GPU); a
#     DistributedSampler; the model wrapped in DDP; train; return (model.module, the losses): the
#     model DDP wraps, not the wrapper; destroy the process group in a finally
# TODO(lesson 02): main(world_size=2, epochs=2, batch_size=16, lr=0.05): print the backend and why,
#     then mp.spawn the workers
def main(epochs=2, batch_size=32, lr=0.05):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {device} ({'a GPU is visible' if device.type == 'cuda' else 'no GPU visible'})")
    dataset = make_dataset()
    # The loader's own generator: the shuffle, and the seed each epoch's iterator draws, never
    # touch the global RNG (lesson 04 saves and restores that one in its checkpoints).
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    start = time.perf_counter()
    losses = train(model, loader, optimizer, epochs, device)
    print(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
          f"final loss {losses[-1]:.4f}")
    return model, losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # TODO(lesson 02): a --world-size flag (default 2); the batch size is per rank now (default
    #     16); pass the world size to main
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.lr)
