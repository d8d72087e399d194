r"""Lesson 14: lesson 05's training by replica groups that go on when one dies (torchft), and a
checkpoint that does not stop the step (dcp.async_save). Its lab, prove.py, kills a replica.
"""
import argparse
import datetime
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("RUST_LOG", "warn")  # read when torchft loads: else each quorum at INFO
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.utils.data import TensorDataset
from torchft import DistributedDataParallel as DDP, Manager, Optimizer
from torchft import ProcessGroupGloo, ProcessGroupNCCL
from torchft.coordination import LighthouseServer


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
def accuracy(model, dataset):
    model.eval()
    return (model(dataset.tensors[0]).argmax(1) == dataset.tensors[1]).sum().item()


def batch(dataset, replica, step, batch_size):
    """Replica `replica`'s samples at step `step`: the same in any process that asks."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    return dataset[torch.randint(len(dataset), (batch_size,), generator=g)]


def start_lighthouse(min_replicas, join_timeout_ms):
    """A quorum once min_replicas have joined, and join_timeout_ms if one it heard from is not."""
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                            join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=2000)


def train_replica(replica, lighthouse, steps, folder, batch_size=16, lr=0.05, timeout=60,
                  backend="gloo"):
    """A replica group of one rank (nccl: on GPU `replica`); a step a line of replica{N}.jsonl."""
    device = torch.device("cuda", replica) if backend == "nccl" else torch.device("cpu")
    torch.cuda.set_device(device) if backend == "nccl" else torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    model = make_model().to(device)  # the group's own store, above: its ranks' rendezvous
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    pg = (ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo)(timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=1, use_async_quorum=False, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout, load_state_dict=lambda state: (
            model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])),
        state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
        replica_id=f"replica_{replica}", lighthouse_addr=lighthouse, rank=0, world_size=1,
        store_addr="localhost", store_port=store.port)
    model = DDP(manager, model)  # its all-reduce goes through the Manager
    optimizer = Optimizer(manager, optimizer)  # steps only when the replicas vote to commit
    dataset, losses = make_dataset(), []
    with open(os.path.join(folder, f"replica{replica}.jsonl"), "a", buffering=1) as log:
        model.train()
        while manager.current_step() < steps:
            start = time.monotonic()
            optimizer.zero_grad()  # the quorum: who is in; a heal from a peer if behind
            x, y = batch(dataset, replica, step := manager.current_step(), batch_size)
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
            log.write(json.dumps({"step": step, "committed": manager.current_step() == step + 1,
                                  "participants": manager.num_participants(), "loss": losses[-1],
                                  "seconds": time.monotonic() - start, "pid": os.getpid()}) + "\n")
    torch.save(model.module.state_dict(), os.path.join(folder, f"replica{replica}.pt"))
    manager.shutdown(wait=False), pg.shutdown()  # pg before `store` goes: NCCL's heartbeat reads it
    return losses


def choose_backend(world_size):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


def save_async(state, folder, pg):
    """The step waits for the copy to CPU only; a thread writes, on `pg`, a group of its own."""
    return dcp.async_save(state, checkpoint_id=folder, process_group=pg)


def newest_complete(root):
    """The newest step-N folder with DCP's .metadata (written last): never a save cut short."""
    done = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, ".metadata"))]
    return max(done, key=lambda d: int(d.split("-")[-1]), default=None)


def main(replicas=3, steps=40, batch_size=16, lr=0.05, timeout=60):
    lighthouse, (backend, reason) = start_lighthouse(replicas, 1000), choose_backend(replicas)
    print(f"backend: {backend} ({reason}); lighthouse at {lighthouse.address()}", flush=True)
    context, folder = multiprocessing.get_context("spawn"), tempfile.mkdtemp(prefix="lesson14_")
    procs = [context.Process(target=train_replica, args=(r, lighthouse.address(), steps, folder,
             batch_size, lr, timeout, backend)) for r in range(replicas)]
    try:
        [p.start() for p in procs]
        [p.join(timeout=10 * timeout) for p in procs]
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"a replica failed: exit codes {[p.exitcode for p in procs]}")
        weights = [torch.load(os.path.join(folder, f"replica{r}.pt"), map_location="cpu",
                              weights_only=True) for r in range(replicas)]
        rows = [json.loads(line) for line in open(os.path.join(folder, "replica0.jsonl"))]
    finally:
        [p.kill() for p in procs if p.is_alive()]
        lighthouse.shutdown()
        shutil.rmtree(folder)
    print("\n".join(f"step {row['step']:3d}  loss {row['loss']:.4f}  replicas {row['participants']}"
                    for row in rows[::10] + rows[-1:]))
    apart = max((w[k] - weights[0][k]).abs().max().item() for w in weights for k in w)
    (model := make_model()).load_state_dict(weights[0])
    print(f"{replicas} replicas, {sum(r['committed'] for r in rows)} steps committed, accuracy "
          f"{accuracy(model, make_dataset())}/256; weights apart between replicas: {apart}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="steps to commit (default 40)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds before a stuck rendezvous or collective raises (default 60)")
    main(**vars(parser.parse_args()))
