"""Checkpoints that lose nothing, for train_gpt.py (lessons 04, 05 and 07 together). DDP: one
file, stepNNNNNNN-<sha256>.pt; FSDP: a folder stepNNNNNNN/ of DCP's shards, train_state.pt (step,
config, scheduler, RNG states) and sha256.txt, every file's checksum, written last. Both are written
as .tmp and renamed when whole: a crash leaves the older ones whole."""
import glob
import hashlib
import io
import os
import shutil
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class BadCheckpoint(Exception):
    """A checkpoint that must not be resumed: the message names the file and says why."""


def lock(folder):
    """Rank 0 holds `folder` for its job: a second live job there would mix their checkpoints. A
    lock of an earlier attempt of this torchrun launch (a restart, maybe on another node), or of
    a process gone from this host, is stale and taken over. Returns the lock's path."""
    path, host = os.path.join(folder, "LOCK"), socket.gethostname()
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "none")  # the same across restarts
    os.makedirs(folder, exist_ok=True)
    while True:
        try:
            with open(path, "x") as f:  # "x": create, or FileExistsError; atomic
                f.write(f"{host} {os.getpid()} {launch}\n")
            return path
        except FileExistsError:
            owner, pid, run = (open(path).read().split() + ["?", "0", "none"])[:3]
        mine = launch != "none" and run == launch or owner == host and pid == str(os.getpid())
        if not mine and (owner != host or running(int(pid))):
            raise BadCheckpoint(f"{folder} is in use by another job (host {owner}, pid {pid}): "
                                f"use another --out-dir, or remove {path} if that job is gone")
        os.remove(path)  # stale: its job died without removing it (SIGKILL, a lost node)


def running(pid):
    if os.name != "posix":  # Windows' os.kill(pid, 0) would END the process: take it as alive
        return True
    try:
        os.kill(pid, 0)  # signal 0: nothing is sent, the process is only looked up
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # in chunks: checkpoints are large


def rng_states(device, group):
    """The data-parallel ranks' RNG states (--tp: a copy's ranks hold the same): for dropout."""
    mine = {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, mine, group=group)
    return states


def fsync_rename(tmp, path):
    """The bytes are on disk before the rename makes them visible, and the rename is on disk."""
    for file in [tmp] if os.path.isfile(tmp) else glob.glob(os.path.join(tmp, "*")):
        with open(file, "rb+") as f:
            os.fsync(f.fileno())
    shutil.rmtree(path, ignore_errors=True)  # a damaged folder of this step, which find passed over
    os.replace(tmp, path)
    if os.name == "posix":
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        os.fsync(fd), os.close(fd)


def save(folder, model, optimizer, scheduler, step, config, parallel, device, group=None):
    """EVERY rank calls it. Keeps this checkpoint and the one before it."""
    train_state = {"step": step, "config": config, "scheduler": scheduler.state_dict(),
                   "rng": rng_states(device, group)}
    rank = dist.get_rank()
    name = path = os.path.join(folder, f"step{step:07d}")
    if parallel == "ddp":
        if rank == 0:
            buffer = io.BytesIO()
            torch.save({**train_state, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, buffer)
            path = f"{name}-{hashlib.sha256(buffer.getvalue()).hexdigest()[:16]}.pt"
            with open(path + ".tmp", "wb") as f:
                f.write(buffer.getvalue())
            fsync_rename(path + ".tmp", path)
    else:
        model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards only
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=name + ".tmp")
        if rank == 0:  # DCP's save ends with rank 0's .metadata: every shard is on disk
            torch.save(train_state, os.path.join(name + ".tmp", "train_state.pt"))
            files = sorted(os.listdir(name + ".tmp"))
            with open(os.path.join(name + ".tmp", "sha256.txt"), "w") as f:
                f.writelines(f"{sha256(os.path.join(name + '.tmp', n))}  {n}\n" for n in files)
            fsync_rename(name + ".tmp", name)
    if rank == 0:
        for old in sorted(glob.glob(os.path.join(folder, "step[0-9]*[0-9t]")))[:-2]:
            shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    dist.barrier()  # every rank: when it returns, the checkpoint exists for everyone
    return path


def verify(path):
    """Raises BadCheckpoint unless every byte of the checkpoint at `path` matches its checksum."""
    if os.path.isfile(path):
        if sha256(path)[:16] != os.path.basename(path)[-19:-3]:
            raise BadCheckpoint(f"{path} is damaged: its bytes do not match the sha256 in its name")
        return
    manifest = os.path.join(path, "sha256.txt")
    if not os.path.isfile(manifest):
        raise BadCheckpoint(f"{manifest} is missing: {path} is not a whole checkpoint")
    with open(manifest) as f:
        listed = dict(line.rstrip("\n").split("  ", 1)[::-1] for line in f if line.strip())
    if set(listed) != set(os.listdir(path)) - {"sha256.txt"} or "train_state.pt" not in listed:
        raise BadCheckpoint(f"{manifest} does not list every file of {path}: damaged")
    for name, digest in listed.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or sha256(file) != digest:
            raise BadCheckpoint(f"{file} is damaged or missing: its sha256 is not sha256.txt's")


def find(folder, config, parallel, rank=0):
    """The newest intact checkpoint of this run in `folder`, or None; a damaged one is passed over
    with a WARNING. BadCheckpoint if none is intact, or for another kind (DDP, FSDP) or settings."""
    damaged = []
    for path in sorted(glob.glob(os.path.join(folder, "step[0-9]*[0-9t]")), reverse=True):
        kind = "ddp" if os.path.isfile(path) else "fsdp"
        if kind != parallel:
            raise BadCheckpoint(f"{path} was saved by --parallel {kind}, not {parallel}")
        try:
            verify(path)
            saved = torch.load(path if kind == "ddp" else os.path.join(path, "train_state.pt"),
                               map_location="cpu", weights_only=True)["config"]
        except Exception as error:  # BadCheckpoint, or bytes that were never a checkpoint
            damaged.append(error if isinstance(error, BadCheckpoint) else
                           f"{path} cannot be read ({type(error).__name__})")
            continue
        changed = {k: (saved.get(k), v) for k, v in config.items() if saved.get(k) != v}
        if changed:
            raise BadCheckpoint(f"{path} was saved with other settings (saved, now: {changed}): "
                                "resume with the same ones (global_batch: ranks x --accumulate x "
                                "--batch-size), or use another --out-dir")
        if damaged and rank == 0:  # the one before is whole: two are kept
            print(f"WARNING: {damaged[0]}; resuming from {path}", file=sys.stderr, flush=True)
        return path
    if damaged:
        raise BadCheckpoint(f"{damaged[0]}; no intact checkpoint before it")
    return None


def load(path, model, optimizer, scheduler, parallel, device, group=None):
    """Every rank loads onto its own device; returns the step to continue from. On as many
    data-parallel ranks (`group`) as saved it, each takes back its RNG state; else it reseeds."""
    if parallel == "ddp":
        state = torch.load(path, map_location="cpu", weights_only=True)  # no GPU memory peak
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    else:
        model_state, optim_state = get_state_dict(model, optimizer)  # the shapes to fill in
        shards = {"model": model_state, "optim": optim_state}
        dcp.load(shards, checkpoint_id=path)  # each rank reads the pieces of ITS shards
        set_state_dict(model, optimizer, model_state_dict=shards["model"],
                       optim_state_dict=shards["optim"])
        state = torch.load(os.path.join(path, "train_state.pt"), map_location="cpu",
                           weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    rank, rng = dist.get_rank(group), state["rng"]
    if len(rng) == dist.get_world_size(group):
        torch.set_rng_state(rng[rank]["cpu"].cpu())
        if device.type == "cuda" and rng[rank]["cuda"] is not None:  # saved on a GPU
            torch.cuda.set_rng_state(rng[rank]["cuda"].cpu(), device)
    else:
        torch.manual_seed(state["config"]["seed"] + 1000 * state["step"] + rank)
    return state["step"]
