# Exercise 13: turn lesson 10's script into lesson 13's
# The TODOs say what to add. Solution: 13_pipeline_3d/pipeline_3d.py.
# Grade your copy: python 13_pipeline_3d/prove.py --lesson YOUR_COPY.py
"""Lesson 13: lesson 10's transformer cut into pipeline stages, with FSDP2 and TP in each stage.
    python 13_pipeline_3d/pipeline_3d.py --world-size 8 --pp 2 --tp 2   # pp 2 x dp 2 x tp 2
    python 13_pipeline_3d/pipeline_3d.py --world-size 8 --pp 2 --tp 1 --replicas 2  # pp x HSDP"""
import argparse
import datetime
import gc
# TODO(lesson 13): no os: one thread a rank
import os
import random
import socket
# TODO(lesson 13): no warnings to silence
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
# TODO(lesson 13): import pipelining from torch.distributed (PipelineStage, the schedules)
from torch.distributed.fsdp import fully_shard
# TODO(lesson 13): no SP: Replicate alone
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               # TODO(lesson 13): no SequenceParallel, no
                                               #     checkpoint, no DataLoader: batches by hand
                                               SequenceParallel, parallelize_module)
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

# TODO(lesson 13): no make_dataset: make_batches, below, makes lesson 10's sequences

def make_dataset(samples=64, length=16, vocab=32, seed=0):  # counting from seeded starts:
    x = torch.randint(vocab, (samples, 1), generator=torch.Generator().manual_seed(seed))
    x = (x + torch.arange(length + 1)) % vocab  # the same bytes in every process
    return TensorDataset(x[:, :-1], x[:, 1:])  # inputs, and each one's next token


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):  # -1, not self.heads: under TP a rank has heads / tp whole heads
        q, k, v = (f(x).unflatten(2, (-1, self.head_dim)).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


# TODO(lesson 13): Block(dim, heads): no activation checkpointing
class Block(nn.Module):
    def __init__(self, dim, heads, act_ckpt):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.act_ckpt = Attention(dim, heads), act_ckpt
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    # TODO(lesson 13): forward(x) runs the layers directly
    def forward(self, x):  # checkpointed: keeps its input only, reruns the layers in backward
        return checkpoint(self.layers, x, use_reentrant=False) if self.act_ckpt else self.layers(x)

    def layers(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


# TODO(lesson 13): make_model(vocab=32, dim=32, heads=4, layers=4, seed=0): 4 blocks
def make_model(act_ckpt=False, vocab=32, dim=32, heads=4, layers=2, seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Embedding(vocab, dim), *(Block(dim, heads, act_ckpt) for _ in
                         range(layers)), nn.LayerNorm(dim), nn.Linear(dim, vocab))


# TODO(lesson 13): split_model(model, stages): the blocks shared out evenly, a list of
#     nn.Sequential; the embedding joins the first, the last norm and the head the last (one stage:
#     both)
# TODO(lesson 13): parallelize_stage(stage, tp_mesh, dp_mesh): lesson 10's TP plan (Replicate
#     between layers) on each Block, the embedding RowwiseParallel, the head ColwiseParallel to
#     Replicate(), when tp_mesh has more than one rank; then fully_shard each Block and the stage
#     over dp_mesh with reshard_after_forward=False (zero-bubble schedules lose the blocks' weight
#     gradients otherwise: NOTES.md)
def parallelize(model, tp_mesh, dp_mesh, sp):
    """The linears split over tp_mesh (SP: the norms over the sequence), then FSDP2 over dp_mesh."""
    between = Shard(1) if sp else Replicate()  # between layers: whole, or 1/tp of the sequence
    whole = PrepareModuleInput(input_layouts=between, desired_input_layouts=Replicate())
    for block in model[1:-2]:
        parallelize_module(block, tp_mesh, {
            "attn": whole, "mlp": whole,  # q, k, v share ONE input: one all-gather (SP) or, in
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),  # backward, all-reduce (TP)
            "attn.v": ColwiseParallel(), "mlp.0": ColwiseParallel(),  # outputs split (heads)
            "attn.out": RowwiseParallel(output_layouts=between),  # inputs split: partial sums,
            "mlp.2": RowwiseParallel(output_layouts=between),  # all-reduced (SP: reduce-scattered)
            **({"norm1": SequenceParallel(), "norm2": SequenceParallel()} if sp else {})})
    parallelize_module(model, tp_mesh, {  # the embedding's rows split, and the head's columns
        "0": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        str(len(model) - 1): ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
        **({str(len(model) - 2): SequenceParallel()} if sp else {})})  # the last norm
    for module in [*model[1:-2], model] if dp_mesh is not None else []:  # the root last
        fully_shard(module, mesh=dp_mesh)  # TP's DTensors sharded once more, over dp
    return model


# TODO(lesson 13): build(mesh, schedule_name, microbatches, device): the schedule class from
#     pipelining; two stages a rank for a PipelineScheduleMulti (r and r+p looped, r and 2p-1-r for
#     a V: ZBV, DualPipeV), else one; split a fresh model, parallelize each stage over mesh['tp']
#     and the data-parallel mesh (mesh['rep', 'shard'] for HSDP, else mesh['shard']), a
#     PipelineStage each with the pp group; the schedule with a cross-entropy loss_fn; return
#     (schedule, stages)
# TODO(lesson 13): train(schedule, stages, batches, say, lr=0.05): SGD over every stage's
#     parameters; each batch: zero_grad, schedule.step with x on the first stage's rank, target and
#     a losses list on the last's; step; the mean micro-batch loss, printed when say
def train(model, loader, optimizer, epochs, device):
    losses = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)).transpose(1, 2), y.to(device))
            loss.backward()  # TP/SP: the blocks' collectives again; FSDP: reduce-scatters
            optimizer.step()
            losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"epoch {epoch}  loss {losses[-1]:.4f} on rank 0", flush=True)
    return losses


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


# TODO(lesson 13): make_batches(steps, dp=1, d=0, batch_size=16, length=16, vocab=32): lesson 10's
#     counting sequences, steps batches; data-parallel rank d's slice (every dp-th row from d),
#     contiguous; worker(rank, world_size, port, backend, pp, replicas, tp, schedule_name, steps=3,
#     timeout=60)
def worker(rank, world_size, port, backend, tp, sp, act_ckpt, epochs, timeout=60):
    """One rank of a (world_size / tp) x tp mesh. mp.spawn: ONE machine, so rank = GPU."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    # TODO(lesson 13): one thread a rank on CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    # TODO(lesson 13): a (pp, replicas, dp / replicas, tp) mesh named pp, rep, shard, tp; build
    #     with 4 micro-batches; this rank's batches (its dp index: rank // tp % dp); train,
    #     printing from one rank a stage
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        warnings.filterwarnings("ignore", "FSDP2-wrapped module")  # logits: never edit in place
        mesh = dist.init_device_mesh(device.type, (world_size // tp, tp),
                                     mesh_dim_names=("dp", "tp"))  # rank = dp index * tp + tp index
        dataset = make_dataset()  # the DATA-parallel rank picks the batch: a TP group shares one
        sampler = DistributedSampler(dataset, mesh["dp"].size(), mesh["dp"].get_local_rank())
        loader = DataLoader(dataset, batch_size=8, sampler=sampler,
                            generator=torch.Generator().manual_seed(0))
        model = parallelize(make_model(act_ckpt).to(device), mesh["tp"],  # whole, then split
                            mesh["dp"] if world_size > tp else None, sp)  # dp 1: no FSDP
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # after sharding
        return train(model, loader, optimizer, epochs, device)
    finally:
        # TODO(lesson 13): release the schedule and stages before destroying
        model = optimizer = None  # FSDP holds the process group: release it before destroying
        gc.collect()  # the group (measured: left to interpreter exit, some gloo runs abort)
        dist.destroy_process_group()


# TODO(lesson 13): main(world_size=8, pp=2, tp=2, replicas=1, schedule='Schedule1F1B'): pp x
#     replicas x tp divides the world, 4 micro-batches a dp rank divide the batch of 16
def main(world_size=4, tp=2, sp=False, act_ckpt=False, epochs=2):
    heads, positions = make_model()[1].attn.heads, len(make_dataset()[0][0])  # each rank whole
    if world_size % tp or heads % tp or positions % tp:  # TP groups, heads, SP's pieces of T
        raise SystemExit(f"--tp {tp} must divide --world-size, {heads} heads, {positions} tokens")
    backend = "nccl" if (gpus := torch.cuda.device_count()) >= world_size else "gloo"  # GPU each?
    # TODO(lesson 13): print the mesh and the schedule; spawn with them
    print(f"backend: {backend} ({gpus} GPU(s)); mesh FSDP {world_size // tp} x TP {tp}", flush=True)
    mp.spawn(worker, (world_size, find_free_port(), backend, tp, sp, act_ckpt, epochs), world_size)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # TODO(lesson 13): --world-size defaults to 8; a --pp flag
    parser.add_argument("--world-size", type=int, default=4, help="processes to start (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    # TODO(lesson 13): --replicas (HSDP) and --schedule flags, no --sp or --act-ckpt
    parser.add_argument("--sp", action="store_true", help="sequence parallel on the norms")
    parser.add_argument("--act-ckpt", action="store_true", help="activation checkpointing")
    main(**vars(parser.parse_args()))
