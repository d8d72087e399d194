# Exercise 14: turn lesson 05's script into lesson 14's
# The TODOs say what to add. Solution: 14_fault_tolerance/fault_tolerance.py.
# Grade your copy: python 14_fault_tolerance/prove.py --lesson YOUR_COPY.py
r"""Lesson 14: lesson 05's training by replica groups that go on when one dies (torchft), and a
checkpoint that does not stop the step (dcp.async_save). Its lab, prove.py, kills a replica.
"""
import argparse
import datetime
# TODO(lesson 14): import what the step log and the replicas' processes need
import gc
import glob
import hashlib
import io
import itertools
import os
import sys

# TODO(lesson 14): before torch and torchft are imported, RUST_LOG=warn unless it is set (torchft
#     reads it when it loads; else every quorum logs at INFO)
import torch
import torch.distributed as dist
# TODO(lesson 14): import torch.distributed.checkpoint (as dcp)
import torch.nn as nn
# TODO(lesson 14): import torchft's DistributedDataParallel (as DDP), Manager, Optimizer,
#     ProcessGroupGloo and ProcessGroupNCCL, and LighthouseServer from torchft.coordination; from
#     torch.utils.data only TensorDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


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
# TODO(lesson 14): instead of evaluate: accuracy(model, dataset), the samples of dataset.tensors
#     the model classifies right, in one forward (no process group here)
def evaluate(model, dataset, device):
    """(correct, total), each sample once: unpadded shards, COUNTS summed; a plain module."""
    model.eval()
    shard = Subset(dataset, range(dist.get_rank(), len(dataset), dist.get_world_size()))
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    for x, y in DataLoader(shard, batch_size=256, generator=torch.Generator()):
        counts[0] += (model(x.to(device)).argmax(1) == y.to(device)).sum()
        counts[1] += len(y)
    dist.all_reduce(counts)
    return counts.tolist()


# TODO(lesson 14): instead of find_checkpoint (a replica that joins heals from a live peer):
#     batch(dataset, replica, step, batch_size), batch_size samples drawn by a generator seeded by
#     1000 * step + replica
def find_checkpoint(folder, config):
    """The newest checkpoint in `folder` whose bytes match their checksum, or None. Damage, or a
    checkpoint whose config (what must match; epochs may grow) differs, stops with one line."""
    damaged = []
    for path in sorted(glob.glob(os.path.join(folder, "step*.pt")), reverse=True):
        with open(path, "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest()[:16] != os.path.basename(path)[-19:-3]:
            damaged.append(path)
            continue
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["config"]
        if saved != config:
            raise SystemExit(f"{path} belongs to another run ({saved} here, {config} now): "
                             "use another checkpoint folder, or the same settings")
        if damaged:
            print(f"WARNING: {damaged[0]} is damaged; using {path}", file=sys.stderr, flush=True)
        return path
    if damaged:
        raise SystemExit(f"every checkpoint in {folder} is damaged: {', '.join(damaged)}")


# TODO(lesson 14): instead of checkpoint: start_lighthouse(min_replicas, join_timeout_ms), a
#     LighthouseServer on [::]:0 with a heartbeat timeout of 2000 ms
def checkpoint(folder, model, optimizer, step, config, device):
    """EVERY rank calls it; rank 0 writes. The name carries the bytes' sha256, so damage is found
    on load; temp file, fsync, rename: a crash mid-write leaves earlier checkpoints whole."""
    rng = [None] * dist.get_world_size()
    cuda = torch.cuda.get_rng_state() if device.type == "cuda" else None
    dist.all_gather_object(rng, {"cpu": torch.get_rng_state(), "cuda": cuda})  # every rank
    if dist.get_rank() == 0:
        buffer = io.BytesIO()
        torch.save({"step": step, "config": config, "rng": rng, "optimizer": optimizer.state_dict(),
                    "model": model.module.state_dict()}, buffer)  # .module: no "module." prefix
        data = buffer.getvalue()
        path = os.path.join(folder, f"step{step:07d}-{hashlib.sha256(data).hexdigest()[:16]}.pt")
        with open(path + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(path + ".tmp", path)
        if os.name == "posix":  # and the rename itself is on disk
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd), os.close(fd)
        others = [p for p in glob.glob(os.path.join(folder, "step*.pt")) if p != path]
        for old in sorted(others, key=lambda p: (f"step{step:07d}-" not in p, p))[:-1]:
            os.remove(old)  # keep this one and the one before it (not a damaged one of this step)
        print(f"saved {path}", flush=True)
    dist.barrier()  # every rank: when it returns, the checkpoint exists for everyone


# TODO(lesson 14): train_replica(replica, lighthouse, steps, folder, batch_size=16, lr=0.05,
#     timeout=60, backend='gloo'): one replica group of one rank: GPU `replica` with nccl, else CPU
#     with one thread; the group's own TCPStore (port 0, master); lesson 05's model and SGD; a
#     Manager (torchft's NCCL or gloo group; min_replica_size=1, use_async_quorum=False, every
#     timeout, a load_state_dict and a state_dict of the model AND the optimizer, replica_id, the
#     lighthouse, rank 0 of 1, the store's address); torchft's DDP and Optimizer around the model
#     and SGD
def train(model, loader, optimizer, epochs, device, step, val_set, folder, config, every=5):
    """From `step` on, with a checkpoint every `every` steps and at the end; returns the losses."""
    losses = []
    for epoch in range(step // len(loader), epochs):
        model.train()
        # TODO(lesson 14): until the Manager has committed `steps`: optimizer.zero_grad() FIRST
        #     (the quorum, and a heal), then the batch of (replica, the Manager's current step)
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in itertools.islice(loader, step % len(loader), None):  # skip what is done
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients across ranks here, bucket by bucket
            optimizer.step()
            losses.append(loss.item())
            # TODO(lesson 14): after each step a JSON line in folder/replica{replica}.jsonl
            #     (line-buffered): step, committed (the Manager's step moved on), participants,
            #     loss, seconds, pid; at the end the module's weights in
            #     folder/replica{replica}.pt, and manager.shutdown(wait=False)
            step += 1
            if step % every == 0 or step == epochs * len(loader):
                checkpoint(folder, model, optimizer, step, config, device)
        mean = torch.tensor(losses[-1], device=device)
        dist.all_reduce(mean)  # for the log only: training never needs the loss reduced
        correct, total = evaluate(model.module, val_set, device)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {mean.item() / dist.get_world_size():.4f} "
                  f"(mean over ranks)  accuracy {correct}/{total}", flush=True)
    return losses


def choose_backend(world_size):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


# TODO(lesson 14): instead of init_distributed: save_async(state, folder, pg), dcp.async_save on
#     the process group pg; return its future
def init_distributed(backend, device, timeout):
    """env:// reads what torchrun set. Its store outlives a restart, keys included: a fresh key
    prefix per attempt keeps restarted ranks from reading the dead attempt's keys."""
    timeout = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's own store
        store = dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)


# TODO(lesson 14): instead of this main: newest_complete(root), the step-N folder with the largest
#     N that holds DCP's .metadata, or None
def main(epochs=2, batch_size=16, lr=0.05, folder="checkpoints", timeout=60):
    """One process = one rank; returns the model, this run's losses and its first step."""
    if "RANK" not in os.environ:  # plain `python`: a world of one, as nanoGPT's train.py does
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",  # port
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # 0: alone, no peer needs it
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this node's GPU, if any
    backend, reason = choose_backend(int(os.environ["LOCAL_WORLD_SIZE"]))  # GPUs on this node
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":  # on CPU, torchrun has set OMP_NUM_THREADS=1 for each process
        torch.cuda.set_device(device)
    os.makedirs(folder, exist_ok=True)  # on a file system every node shares
    step, config = 0, {"world_size": world_size, "batch_size": batch_size, "lr": lr}
    resume = find_checkpoint(folder, config)  # before any collective: a bad folder is one line
    if rank == 0:  # attempt: 0, then 1 after torchrun's first restart, ...
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        print(f"backend: {backend} ({reason}); world size {world_size}; attempt {attempt}; "
              f"resuming from {resume}", flush=True)
    init_distributed(backend, device, timeout)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        dataset = make_dataset(256 + 101)  # 101 held out: no world size from 2 to 100 divides it
        train_set, val_set = Subset(dataset, range(256)), Subset(dataset, range(256, 357))
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=0)
        # The loader's own generator: its seeds never touch the global RNG (saved for dropout).
        loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = DDP(make_model().to(device), device_ids=[device] if device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        torch.manual_seed(1 + rank)  # each rank its own dropout masks, its own RNG state to save
        if resume:  # every rank loads, onto its own device, tensors and plain types only
            state = torch.load(resume, map_location=device, weights_only=True)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"][rank]["cpu"].cpu())  # this rank's own stream
            if device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"][rank]["cuda"].cpu(), device)
            step = state["step"]
        losses = train(model, loader, optimizer, epochs, device, step, val_set, folder, config)
        if rank == 0:
            print(f"trained {len(losses)} steps after step {step}", flush=True)
        return model.module, losses, step
    finally:
        model = optimizer = None  # DDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 14): main(replicas=3, steps=40, batch_size=16, lr=0.05, timeout=60): a Lighthouse
#     (min_replicas=replicas, join timeout 1 s); the backend for `replicas` GPUs (choose_backend);
#     print it and the Lighthouse's address; a spawn process per replica running train_replica into
#     a temporary folder; then every 10th step's loss and replicas, the steps committed, replica
#     0's accuracy and the largest difference between the replicas' weights; kill what is left,
#     shut the Lighthouse down, remove the folder
if __name__ == "__main__":  # torchrun runs this file once per rank
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # TODO(lesson 14): flags: --replicas (default 3) and --steps (default 40) instead of --epochs;
    #     no --ckpt-dir
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank (default 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--ckpt-dir", default="checkpoints", dest="folder", help="every node sees")
    parser.add_argument("--timeout", type=float, default=60,
                        help="seconds before a stuck rendezvous or collective raises (default 60)")
    main(**vars(parser.parse_args()))
