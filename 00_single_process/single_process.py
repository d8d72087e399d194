"""Lesson 00: one process trains a small classifier. Lessons 02, 04 and 05 are diffs on this file.

    python 00_single_process/single_process.py
    python 00_single_process/single_process.py --epochs 5 --batch-size 64
"""
import argparse
import time

import torch
import torch.nn as nn
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
    """Forward, loss, backward, step; returns the loss of every step."""
    losses = []
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        print(f"epoch {epoch}  loss {losses[-1]:.4f}", flush=True)
    return losses


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
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = parser.parse_args()
    main(args.epochs, args.batch_size, args.lr)
