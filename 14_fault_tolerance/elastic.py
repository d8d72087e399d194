r"""Lesson 14, part 2: elastic torchrun. Nodes join and leave (--nnodes=1:2); at each change
torchrun stops every worker and starts them again on the new world size, and they resume from
the newest checkpoint. A step takes the same global batch on any world size: no step is lost or
taken twice, and the weights are those of one process on the same batches.

  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1   # else a node that joins deadlocks (NOTES.md)
  torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d \
      --rdzv-endpoint=NODE_A:29400 --rdzv-id=job1 \
      --rdzv-conf=last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5 \
      14_fault_tolerance/elastic.py --ckpt-dir /shared/ckpt   # each node; one folder they share
  python 14_fault_tolerance/elastic.py   # plain python: a world of one (again, larger --steps)
"""
import argparse
import datetime
import gc
import glob
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset


def make_dataset(samples=256, seed=0):
    """A learnable 4-class problem from a seeded generator of its own: the same in any process."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    # No Dropout (fault_tolerance.py has one): a rank's own masks, which one process never draws
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def step_windows(length, step, global_batch, seed):
    """A step's samples (lesson 11's): the next global_batch of a stream, on any world size."""
    windows, start = [], step * global_batch
    while len(windows) < global_batch:
        epoch, offset = divmod(start + len(windows), length)
        order = torch.randperm(length, generator=torch.Generator().manual_seed(seed + epoch))
        windows += order.tolist()[offset: offset + global_batch - len(windows)]
    return windows


def newest_checkpoint(folder):
    done = sorted(glob.glob(os.path.join(folder, "step*.pt")))  # zero-padded: by name is by step
    return done[-1] if done else None


def save_checkpoint(folder, state):
    """Temp file, fsync, rename (lesson 05): a kill mid-write leaves the previous one whole."""
    path = os.path.join(folder, f"step{state['step']:07d}.pt")
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush(), os.fsync(f.fileno())  # the bytes are on disk before the rename shows them
    os.replace(path + ".tmp", path)
    if os.name == "posix":  # and the rename itself is on disk
        os.fsync(fd := os.open(folder, os.O_RDONLY)), os.close(fd)
    for old in sorted(glob.glob(os.path.join(folder, "step*.pt")))[:-2]:
        os.remove(old)  # keep this one and the one before it


def log_step(path, row, resumed=False):
    """A line per step, once its checkpoint is on disk. On resume, the checkpoint's own row goes
    in only if a kill came between its rename and its line: every step is in the log once."""
    lines = open(path).read().splitlines() if resumed and os.path.exists(path) else []
    if not lines or json.loads(lines[-1])["step"] < row["step"]:  # not in the log already
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def train(model, optimizer, step, steps, global_batch, folder, device):
    rank, world_size, dataset = dist.get_rank(), dist.get_world_size(), make_dataset()
    while step < steps:
        mine = step_windows(len(dataset), step, global_batch, seed=0)[rank::world_size]
        x, y = (t.to(device) for t in dataset[mine])  # this rank's share of the global batch
        # summed, then scaled: DDP's average over ranks is the global batch's mean on any world size
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") * world_size / global_batch
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients across ranks here
        optimizer.step()
        dist.all_reduce(mean := loss.detach() / world_size)  # the global batch's mean loss, to log
        step += 1
        if rank == 0:  # one writer, on a file system every node shares
            row = {"step": step - 1, "world_size": world_size, "loss": mean.item()}
            save_checkpoint(folder, {"step": step, "row": row, "model": model.module.state_dict(),
                                     "optimizer": optimizer.state_dict(),
                                     "settings": [global_batch, optimizer.defaults["lr"]]})
            log_step(os.path.join(folder, "steps.jsonl"), row)
            if row["step"] % 10 == 0 or step == steps:
                print(f"step {row['step']:3d}  world size {world_size}  loss {row['loss']:.4f}")


def main(steps=60, global_batch=32, lr=0.05, folder="elastic_checkpoints", timeout=60):
    if "RANK" not in os.environ:  # plain `python`: a world of one, as lesson 05
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",  # port
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # 0: alone, no peer needs it
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus, local_ranks = torch.cuda.device_count(), int(os.environ["LOCAL_WORLD_SIZE"])
    backend = "nccl" if gpus >= local_ranks else "gloo"  # a GPU per rank of this node, else CPU
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if backend == "nccl" else "cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else None
    os.makedirs(folder, exist_ok=True)
    resume = newest_checkpoint(folder)  # any world size: the state holds nothing per rank
    if rank == 0:
        print(f"backend: {backend} ({gpus} GPU(s) for {local_ranks} rank(s) on this node); "
              f"world size {world_size}; resuming from {resume}", flush=True)
    # env://: what torchrun set; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a new store each round
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        chosen = [None] * world_size  # one folder every node shares, or a rank that loaded
        dist.all_gather_object(chosen, resume)  # another checkpoint trains on, unseen by DDP
        if len(set(chosen)) > 1:
            raise RuntimeError(f"the ranks found different checkpoints in {folder}: {chosen}")
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer, step = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), 0
        if resume:  # every rank loads, onto its own device, tensors and plain types only
            state = torch.load(resume, map_location=device, weights_only=True)
            if (saved := state.get("settings")) != [global_batch, lr]:  # another run's windows
                raise SystemExit(f"{resume}: saved with --global-batch, --lr {saved}, not "
                                 f"{[global_batch, lr]}: resume only the same run")
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
            if rank == 0:
                log_step(os.path.join(folder, "steps.jsonl"), state["row"], resumed=True)
        train(model, optimizer, step, steps, global_batch, folder, device)
        if rank == 0:
            print(f"{max(steps - step, 0)} steps from step {step} on world size {world_size}")
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":  # torchrun runs this file once per rank
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="steps in all (default 60)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples a step (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--ckpt-dir", default="elastic_checkpoints", dest="folder", help="shared")
    parser.add_argument("--timeout", type=float, default=60, help="collectives' (default 60 s)")
    main(**vars(parser.parse_args()))
