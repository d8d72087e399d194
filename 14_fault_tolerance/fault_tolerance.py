"""Lesson 14: replicas that keep training when one dies (torchft), and a checkpoint that does not
stop the step (dcp.async_save).
    python 14_fault_tolerance/fault_tolerance.py                 # 3 replica groups, 40 steps
    python 14_fault_tolerance/fault_tolerance.py --replicas 2    # fewer replicas, same steps
"""
import argparse
import json
import multiprocessing
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.coordination import LighthouseServer


def start_lighthouse(min_replicas, join_timeout_ms):
    """The Lighthouse: one small server (Rust, in torchft's wheel) that every replica group's
    Manager asks for a quorum; it answers when min_replicas have joined and no more are expected
    within join_timeout_ms. bind [::]:0 is a free port on every interface."""
    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                            join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=2000)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every replica
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(replica, step, size=32):
    """Replica `replica`'s batch at step `step`: the same numbers in any process that asks."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(size, 8, generator=g)
    return x, x.sin().sum(dim=1, keepdim=True)


def train_replica(replica, lighthouse, steps, folder, timeout_s=30.0):
    """One replica group of one rank: a Manager (its quorum, its commit vote), torchft's process
    group and DDP. Each step is a line of folder/replica{N}.jsonl; the weights end in .pt."""
    torch.set_num_threads(1)
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timedelta(
        seconds=timeout_s))  # this group's own store (its ranks' rendezvous, here rank 0 only)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    timeout = timedelta(seconds=timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, use_async_quorum=False,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       sgd.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": sgd.state_dict()},
        replica_id=f"replica_{replica}", lighthouse_addr=lighthouse, rank=0, world_size=1,
        store_addr="localhost", store_port=store.port, timeout=timeout, quorum_timeout=timeout,
        connect_timeout=timeout)
    ddp = DistributedDataParallel(manager, model)  # its all-reduce goes through the Manager
    optimizer = Optimizer(manager, sgd)  # steps sgd only when the replicas vote to commit
    log = open(os.path.join(folder, f"replica{replica}.jsonl"), "a")
    try:
        while manager.current_step() < steps:
            start = time.monotonic()
            optimizer.zero_grad()  # the quorum: who is in, and a heal from a peer if behind
            step = manager.current_step()
            x, y = batch(replica, step)
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()  # the gradients averaged over the replicas in the quorum
            optimizer.step()  # should_commit(): every replica's vote; sgd.step() if all agree
            log.write(json.dumps({
                "step": step, "committed": manager.current_step() == step + 1,
                "participants": manager.num_participants(), "loss": loss.item(),
                "seconds": time.monotonic() - start, "pid": os.getpid()}) + "\n")
            log.flush()
        torch.save(model.state_dict(), os.path.join(folder, f"replica{replica}.pt"))
        return model
    finally:
        log.close()
        manager.shutdown(wait=False)


def save_async(state, folder, pg):
    """dcp.async_save: copies `state` to CPU memory (the only part the step waits for), then writes
    it from a thread, its collectives on `pg` (a group of its own, never the training group).
    Returns a Future: call .result() before the next save."""
    return dcp.async_save(state, checkpoint_id=folder, process_group=pg)


def newest_complete(root):
    """The newest step-N folder holding DCP's .metadata, written last (by rank 0, once every rank
    has written its data): a save cut short by a death is never the one a resume loads."""
    done = [d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, ".metadata"))]
    return max(done, key=lambda d: int(d.split("-")[-1]), default=None)


def run(replicas, steps, folder, join_timeout_ms=1000):
    lighthouse = start_lighthouse(replicas, join_timeout_ms)
    print(f"lighthouse at {lighthouse.address()}, quorum of {replicas} replica groups "
          f"(join timeout {join_timeout_ms} ms); gloo on CPU, one rank per group", flush=True)
    context = multiprocessing.get_context("forkserver")  # each replica forked from one process
    context.set_forkserver_preload(["torch", "torchft"])  # that imported torch once
    procs = [context.Process(target=train_replica, args=(r, lighthouse.address(), steps, folder))
             for r in range(replicas)]
    try:
        [p.start() for p in procs]
        [p.join(timeout=120) for p in procs]
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit(f"a replica failed: exit codes {[p.exitcode for p in procs]}")
    finally:
        [p.kill() for p in procs if p.is_alive()]
        lighthouse.shutdown()
    weights = [torch.load(os.path.join(folder, f"replica{r}.pt"), weights_only=True)
               for r in range(replicas)]
    rows = [json.loads(line) for line in open(os.path.join(folder, "replica0.jsonl"))]
    for row in rows[::10] + rows[-1:]:
        print(f"step {row['step']:3d}  loss {row['loss']:.4f}  participants {row['participants']}")
    apart = max((w[k] - weights[0][k]).abs().max().item() for w in weights for k in w)
    print(f"{replicas} replicas, {sum(r['committed'] for r in rows)} steps committed; "
          f"largest weight difference between replicas: {apart}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3, help="replica groups (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="steps to commit (default 40)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lesson14_") as folder:
        run(args.replicas, args.steps, folder)


if __name__ == "__main__":
    main()
