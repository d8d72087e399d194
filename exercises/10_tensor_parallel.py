# Exercise 10: turn lesson 07's script into lesson 10's
# The TODOs say what to add. Solution: 10_tensor_parallel/tensor_parallel.py.
# Grade your copy: python 10_tensor_parallel/prove.py --lesson YOUR_COPY.py
"""Lesson 10: lesson 07's FSDP2 with tensor, sequence and 2-D parallelism, on a transformer.
    python 10_tensor_parallel/tensor_parallel.py --world-size 2 --tp 2         # TP alone
    python 10_tensor_parallel/tensor_parallel.py --world-size 4 --tp 2 --sp    # FSDP x (TP + SP)"""
import argparse
import datetime
import gc
# TODO(lesson 10): no checkpoints here: no glob, no shutil
import glob
import os
import random
import shutil
import socket
# TODO(lesson 10): import warnings (one FSDP2 warning is silenced, below)

import torch
import torch.distributed as dist
# TODO(lesson 10): no DCP: no torch.distributed.checkpoint, no get_state_dict or set_state_dict
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
# TODO(lesson 10): import Replicate and Shard from torch.distributed.tensor; ColwiseParallel,
#     PrepareModuleInput, RowwiseParallel, SequenceParallel and parallelize_module from
#     torch.distributed.tensor.parallel; checkpoint from torch.utils.checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


# TODO(lesson 10): make_dataset(samples=64, length=16, vocab=32, seed=0): counting sequences: a
#     start token per sample from its own seeded generator, then start + 0, 1, ..., length, modulo
#     vocab; inputs the first `length` tokens, targets each one's next token, in a TensorDataset
def make_dataset(samples=256, seed=0):
    """A learnable 4-class problem from its own seeded generator, never the global RNG: every
    process that builds it gets the same bytes, whatever that process did before."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


# TODO(lesson 10): class Attention(nn.Module), Attention(dim, heads): q, k, v and out, four
#     nn.Linear(dim, dim, bias=False) (q, k, v APART: a fused qkv splits wrongly under TP); keep
#     heads and head_dim; forward(x): q, k, v as (B, heads, T, head_dim), writing -1 for the heads
#     (a TP rank holds heads / tp of them), causal scaled_dot_product_attention, back to (B, T,
#     -1), then out
def make_model(seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


# TODO(lesson 10): class Block(nn.Module), Block(dim, heads, act_ckpt): norm1, norm2 (LayerNorm),
#     attn, mlp = Sequential(Linear(dim, 4 dim), GELU, Linear(4 dim, dim)); layers(x): x +
#     attn(norm1(x)), then + mlp(norm2(x)); forward(x): layers(x), or with act_ckpt
#     checkpoint(self.layers, x, use_reentrant=False)
# TODO(lesson 10): make_model(act_ckpt=False, vocab=32, dim=32, heads=4, layers=2, seed=0): seeded;
#     nn.Sequential(Embedding, the blocks, LayerNorm, Linear(dim, vocab))
# TODO(lesson 10): parallelize(model, tp_mesh, dp_mesh, sp): each block (model[1:-2]) with
#     parallelize_module over tp_mesh: q, k, v and mlp.0 ColwiseParallel, attn.out and mlp.2
#     RowwiseParallel with output_layouts Shard(1) under SP, else Replicate(); 'attn' and 'mlp' a
#     PrepareModuleInput from that layout to Replicate() (one input for q, k, v); under SP, norm1
#     and norm2 SequenceParallel. The embedding (model[0]) RowwiseParallel from Replicate() to that
#     layout, the head ColwiseParallel from it to Replicate(), the last norm SequenceParallel under
#     SP. Then, if dp_mesh is not None, fully_shard each block and the root over dp_mesh; return
#     the model
# TODO(lesson 10): train(model, loader, optimizer, epochs, device): lesson 07's, without
#     checkpoints
def train(model, loader, optimizer, epochs, device, first_epoch, folder):
    losses = []
    # TODO(lesson 10): every epoch from 0: nothing to resume
    for epoch in range(first_epoch, epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            # TODO(lesson 10): the loss: logits (B, T, vocab) against targets (B, T); cross_entropy
            #     wants the classes on dim 1
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # FSDP reduce-scatters: each rank gets the average of its shard
            optimizer.step()
            losses.append(loss.item())
        # TODO(lesson 10): no checkpoint after an epoch; print the epoch's loss
        path = save_checkpoint(folder, model, optimizer, epoch + 1)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {losses[-1]:.4f} on rank 0; saved {path}", flush=True)
    return losses
# TODO(lesson 10): delete save_checkpoint, load_checkpoint and find_checkpoint (no DCP here), and
#     choose_backend (main picks the backend)


def save_checkpoint(folder, model, optimizer, epoch):
    """EVERY rank writes its shards, then rank 0 `.metadata` and the rename: one disk for all."""
    path = os.path.join(folder, f"epoch{epoch:04d}")
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this rank's shards: no gather
    dcp.save({"model": model_sd, "optim": optim_sd, "epoch": epoch}, checkpoint_id=path + ".tmp")
    if dist.get_rank() == 0:
        os.replace(path + ".tmp", path)
    dist.barrier()  # every rank: when it returns, the checkpoint exists for everyone
    return path


def load_checkpoint(path, model, optimizer):
    """Each rank reads the pieces of ITS shards, whatever the world size that saved them."""
    model_sd, optim_sd = get_state_dict(model, optimizer)  # the shapes to fill in
    ckpt = {"model": model_sd, "optim": optim_sd, "epoch": 0}
    dcp.load(ckpt, checkpoint_id=path)  # in place, into these tensors
    set_state_dict(model, optimizer, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])
    return ckpt["epoch"]


def find_checkpoint(folder):
    """The newest checkpoint in `folder`, or None; one that DCP cannot read stops with one line."""
    for path in sorted(glob.glob(os.path.join(folder, "epoch[0-9][0-9][0-9][0-9]")))[-1:]:
        try:  # .metadata is written last; the files it names must be there, as long as it says
            for info in dcp.FileSystemReader(path).read_metadata().storage_data.values():
                file = os.path.join(path, info.relative_path)
                if os.path.getsize(file) < info.offset + info.length:
                    raise ValueError(f"{info.relative_path} is truncated")
        except Exception as error:
            raise SystemExit(f"{path} is not a complete DCP checkpoint ({error}); move it away")
        return path


def choose_backend(world_size):
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


# TODO(lesson 10): worker(rank, world_size, port, backend, tp, sp, act_ckpt, epochs, timeout=60):
#     no folder, resume, batch size or learning rate
def worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, resume, timeout=60):
    """Holds 1/N of all. mp.spawn: ONE machine, so rank = GPU (several nodes: LOCAL_RANK, 05)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        # TODO(lesson 10): silence FSDP2's warning that the model returned a view (the logits;
        #     nothing edits them in place); a 2-D mesh (world_size // tp, tp) named ('dp', 'tp');
        #     the sampler from the DATA-parallel dimension: mesh['dp'].size() replicas, this rank
        #     mesh['dp'].get_local_rank() (a TP group shares one batch); batches of 8
        dataset = make_dataset()
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        # TODO(lesson 10): the model: make_model(act_ckpt) on the device, parallelized over
        #     mesh['tp'], with FSDP over mesh['dp'] when world_size > tp; SGD (lr 0.05, momentum
        #     0.9) after; return train's losses
        model = make_model().to(device)  # whole and equal on every rank; fully_shard keeps 1/N
        mesh = dist.init_device_mesh(device.type, (world_size,))  # 1-D: shard over all ranks
        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:  # the root last
            fully_shard(layer, mesh=mesh)  # a layer is all-gathered just when it runs
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # after sharding
        first_epoch = load_checkpoint(resume, model, optimizer) if resume else 0
        return train(model, loader, optimizer, epochs, device, first_epoch, folder)
    finally:
        model = optimizer = None  # FSDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 10): main(world_size=4, tp=2, sp=False, act_ckpt=False, epochs=2): refuse in one line
#     a --tp that does not divide the world size, the model's heads or the sequence's length; NCCL
#     when there is a GPU per rank, else gloo; print it and the mesh; mp.spawn the workers
def main(world_size=2, epochs=2, batch_size=16, lr=0.05, folder="ckpt_fsdp"):
    backend, reason = choose_backend(world_size)
    print(f"backend: {backend} ({reason}); world size {world_size}; "
          f"global batch {world_size} x {batch_size} = {world_size * batch_size}", flush=True)
    for unfinished in glob.glob(os.path.join(folder, "epoch*.tmp")):  # from a save that crashed:
        shutil.rmtree(unfinished)  # the next save must not rename its stray files in with its own
    resume = find_checkpoint(folder)
    print(f"resuming from {resume}" if resume else f"no checkpoint in {folder}: from epoch 0")
    mp.spawn(worker, args=(world_size, find_free_port(), backend, epochs, batch_size, lr,
                           folder, resume), nprocs=world_size, join=True)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # TODO(lesson 10): flags --world-size (default 4), --tp (2), --sp, --act-ckpt;
    #     main(**vars(parser.parse_args()))
    parser.add_argument("--world-size", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument("--epochs", type=int, default=2, help="in all, resumed too (default 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step PER RANK")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--out-dir", default="ckpt_fsdp", help="checkpoints (resumes from them)")
    args = parser.parse_args()
    main(args.world_size, args.epochs, args.batch_size, args.lr, args.out_dir)
