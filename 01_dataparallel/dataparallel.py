"""Lesson 01, an aside to read once: what nn.DataParallel does, and its five steps written by hand.

    python 01_dataparallel/dataparallel.py [--replicas 3] [--epochs 1]

nn.DataParallel is ONE process: scatter, replicate, threads, gather; backward() SUMS the gradients.
With one GPU or none it just calls the module: here lesson 00's model trains through them by hand.
"""
import argparse
import copy
import os
import threading
import time

import torch
import torch.nn as nn
from torch.func import functional_call
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
            loss = nn.functional.cross_entropy(model(x), y)  # ONE loss, on the gathered output
            loss.backward()  # 5. each replica's gradient flows back and is SUMMED into the module
            optimizer.step()
            losses.append(loss.item())
        print(f"epoch {epoch}  loss {losses[-1]:.4f}", flush=True)
    return losses


def scatter(inputs, replicas):
    """1. scatter: each input in chunks along dim 0 (fewer chunks than replicas for a small batch).
    nn.DataParallel also copies chunk i to cuda:i."""
    return list(zip(*(t.chunk(replicas) for t in inputs)))


def replicate(module, replicas):
    """2. replicate, at EVERY step: per replica, a copy of the module's structure (a shell) and a
    differentiable copy (clone) of each parameter. In backward, a clone hands its gradient to the
    original parameter, where autograd ADDS up what the replicas send: that is step 5. Replica 0
    runs on the module's own buffers, so BatchNorm's running stats update, as nn.DataParallel's."""
    return [(copy.deepcopy(module), {**(dict(module.named_buffers()) if i == 0 else {}),
                                     **{name: p.clone() for name, p in module.named_parameters()}})
            for i in range(replicas)]


def parallel_apply(replicas, chunks):
    """3. parallel_apply: replica i runs on chunk i in a thread of its own (in its own shell:
    functional_call swaps tensors into the module it runs). A thread's error is raised here."""
    outputs, grad_enabled = [None] * len(chunks), torch.is_grad_enabled()
    def run(i):
        shell, tensors = replicas[i]
        try:
            with torch.set_grad_enabled(grad_enabled):  # grad mode is per thread: hand it on
                outputs[i] = functional_call(shell, tensors, chunks[i])
        except Exception as error:
            outputs[i] = error

    threads = [threading.Thread(target=run, args=(i,), name=f"replica {i}")
               for i in range(len(chunks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in (output for output in outputs if isinstance(output, Exception)):
        raise error
    return outputs


def gather(outputs):
    """4. gather: the outputs in one tensor on one device (nn.DataParallel: device_ids[0]). 0-dim
    outputs (a loss each replica returns) become a vector, one per replica, as nn.DataParallel's."""
    return torch.stack(outputs) if outputs[0].dim() == 0 else torch.cat(outputs)


class HandWrittenDataParallel(nn.Module):
    """nn.DataParallel's forward by hand on CPU: steps 1 to 4 (5 is autograd's, in backward)."""

    def __init__(self, module, replicas):
        super().__init__()
        self.module, self.replicas = module, replicas  # .module: its state_dict keys get "module."

    def forward(self, *inputs):
        chunks = scatter(inputs, self.replicas)
        return gather(parallel_apply(replicate(self.module, len(chunks)), chunks))


def choose_path(replicas, device="auto"):
    """nn.DataParallel where it splits the batch (a GPU per replica, 2+), else by hand; and why."""
    gpus = torch.cuda.device_count()
    if device != "cpu" and 2 <= replicas <= gpus:
        return "cuda", f"{gpus} GPUs: nn.DataParallel splits each batch over cuda:0..{replicas - 1}"
    if device == "cpu" or gpus > 1:
        return "cpu", "CPU requested" if device == "cpu" else f"{gpus} GPUs, {replicas} replica(s)"
    return "cpu", ("no GPU visible: nn.DataParallel would just call the module, device_ids []"
                   if gpus == 0 else "1 GPU: nn.DataParallel would just call the module on cuda:0")


def main(replicas=2, epochs=2, batch_size=32, lr=0.05, device="auto"):
    device, why = choose_path(replicas, device)
    print(f"{'nn.DataParallel' if device == 'cuda' else 'hand-written DataParallel on cpu'} "
          f"({why}); {replicas} replica(s), threads of one process", flush=True)
    if device == "cpu":  # the replica threads share the cores (NOTES.md 3: right for a small model)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // replicas))
    dataset = make_dataset()
    # The loader's own generator: the shuffle, and the seed each epoch's iterator draws, never
    # touch the global RNG (lesson 04 saves and restores that one in its checkpoints).
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model = (nn.DataParallel(make_model().to("cuda:0"), device_ids=list(range(replicas)))
             if device == "cuda" else HandWrittenDataParallel(make_model(), replicas))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    start = time.perf_counter()
    losses = train(model, loader, optimizer, epochs, device)
    print(f"trained {len(losses)} steps in {time.perf_counter() - start:.1f} s; "
          f"final loss {losses[-1]:.4f}")
    return model.module, losses  # save model.module.state_dict(): no "module." prefix


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="GPUs or CPU threads (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto",
                        help="auto: nn.DataParallel on cuda with 2+ GPUs, else cpu (default auto)")
    args = parser.parse_args()
    if min(args.replicas, args.epochs, args.batch_size) < 1 or args.lr <= 0:
        parser.error("--replicas, --epochs, --batch-size and --lr must be positive")
    main(args.replicas, args.epochs, args.batch_size, args.lr, args.device)
