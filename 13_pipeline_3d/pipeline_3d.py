"""Lesson 13: lesson 10's transformer cut into pipeline stages, with FSDP2 and TP in each stage.
    python 13_pipeline_3d/pipeline_3d.py --world-size 8 --pp 2 --tp 2   # pp 2 x dp 2 x tp 2
    python 13_pipeline_3d/pipeline_3d.py --world-size 8 --pp 2 --tp 1 --replicas 2  # pp x HSDP"""
import argparse
import datetime
import gc
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed import pipelining
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)

class Attention(nn.Module):  # lesson 10's
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):  # -1, not self.heads: under TP a rank has heads / tp whole heads
        q, k, v = (f(x).unflatten(2, (-1, self.head_dim)).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).flatten(2))


class Block(nn.Module):  # lesson 10's, without activation checkpointing
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):  # lesson 10's layers()
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def make_model(vocab=32, dim=32, heads=4, layers=4, seed=0):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return nn.Sequential(nn.Embedding(vocab, dim), *(Block(dim, heads) for _ in range(layers)),
                         nn.LayerNorm(dim), nn.Linear(dim, vocab))


def split_model(model, stages):  # blocks shared out; the embedding first, the norm and head last
    blocks, per = list(model[1:-2]), (len(model) - 3) // stages
    parts = [blocks[i * per:(i + 1) * per] for i in range(stages)]
    parts[0].insert(0, model[0]), parts[-1].extend(model[-2:])  # one stage: the same list
    return [nn.Sequential(*part) for part in parts]


def parallelize_stage(stage, tp_mesh, dp_mesh):  # lesson 10's TP plan, then FSDP2 (HSDP: 2-D)
    whole = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Replicate())
    plan = {"attn": whole, "mlp": whole, "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "mlp.0": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "mlp.2": RowwiseParallel()}
    ends = {nn.Embedding: RowwiseParallel(input_layouts=Replicate()),  # the embedding's rows
            nn.Linear: ColwiseParallel(output_layouts=Replicate())}  # the head's columns
    for layer in stage if tp_mesh.size() > 1 else []:
        parallelize_module(layer, tp_mesh, plan if isinstance(layer, Block) else ends.get(
            type(layer), {}))  # the norm between: whole on every rank
    for module in [*(layer for layer in stage if isinstance(layer, Block)), stage]:  # root last
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)  # NOTES: zero bubble
    return stage


def build(mesh, schedule_name, microbatches, device):  # this rank's stages (1 or 2), the schedule
    Schedule, pp, r = getattr(pipelining, schedule_name), mesh["pp"].size(), mesh.get_local_rank(0)
    two = issubclass(Schedule, pipelining.schedules.PipelineScheduleMulti)  # looped or V-shaped
    v = "V" in schedule_name[8:]  # ZBVZeroBubble, DualPipeV: a V, rank r holds r and 2p-1-r
    ids = ([r, 2 * pp - 1 - r] if v else [r, r + pp]) if two else [r]  # looped: r and r+p
    pieces = split_model(make_model().to(device), pp * len(ids))
    dp_mesh = mesh["rep", "shard"] if mesh["rep"].size() > 1 else mesh["shard"]  # HSDP: 2-D
    stages = [pipelining.PipelineStage(parallelize_stage(pieces[i], mesh["tp"], dp_mesh), i, len(
        pieces), device, group=mesh["pp"].get_group()) for i in ids]  # p2p within the pp group
    loss_fn = lambda logits, y: nn.functional.cross_entropy(logits.transpose(1, 2), y)  # last stage
    return Schedule(stages if two else stages[0], microbatches, loss_fn), stages  # grads / micro


def train(schedule, stages, batches, say, lr=0.05):  # a step: every micro-batch, then one update
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=lr)
    first, last, losses = any(s.is_first for s in stages), any(s.is_last for s in stages), []
    for step, (x, y) in enumerate(batches):
        optimizer.zero_grad(), (micro := [])  # the last stage fills micro; the first feeds x
        schedule.step(*([x] if first else []), target=y if last else None,
                      losses=micro if last else None)
        optimizer.step()
        losses += [torch.stack(micro).mean().item()] if last else []
        if last and say:
            print(f"step {step}  loss {losses[-1]:.4f} (last stage, rank {dist.get_rank()})")
    return losses


def find_free_port():  # free now; below 32768 the OS hands none out by default (02's NOTES.md)
    while True:
        with socket.socket() as s:  # connecting refused: nobody listens there
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def make_batches(steps, dp=1, d=0, batch_size=16, length=16, vocab=32):  # lesson 10's counting:
    x = torch.randint(vocab, (steps * batch_size, 1), generator=torch.Generator().manual_seed(0))
    x = ((x + torch.arange(length + 1)) % vocab).split(batch_size)  # the same in every process
    return [(b[d::dp, :-1].contiguous(), b[d::dp, 1:].contiguous()) for b in x]  # rank d's slice


def worker(rank, world_size, port, backend, pp, replicas, tp, schedule_name, steps=3, timeout=60):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    torch.cuda.set_device(device) if device.type == "cuda" else torch.set_num_threads(1)  # 1 core
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if device.type == "cuda" else None)
    try:
        dp = world_size // (pp * tp)  # HSDP: dp = replicas x shards, the last dim varies fastest
        mesh = dist.init_device_mesh(device.type, (pp, replicas, dp // replicas, tp),
                                     mesh_dim_names=("pp", "rep", "shard", "tp"))
        schedule, stages = build(mesh, schedule_name, 4, device)  # 4 micro-batches per dp rank
        batches = [(x.to(device), y.to(device)) for x, y in
                    make_batches(steps, dp, rank // tp % dp)]
        return train(schedule, stages, batches, say=rank % (dp * tp) == 0)  # 1 rank a stage says
    finally:
        schedule = stages = None  # FSDP holds the process group: release it first (lesson 10)
        gc.collect()
        dist.destroy_process_group()


def main(world_size=8, pp=2, tp=2, replicas=1, schedule="Schedule1F1B"):
    if world_size % (pp * replicas * tp) or 16 % (world_size // (pp * tp) * 4):  # micro-batches
        raise SystemExit("pp x replicas x tp must divide --world-size, and 4 x dp divide 16")
    backend = "nccl" if (gpus := torch.cuda.device_count()) >= world_size else "gloo"  # GPU each?
    print(f"backend: {backend} ({gpus} GPU(s)); mesh pp {pp} x dp {world_size // (pp * tp)} "
          f"(replicas {replicas}) x tp {tp}; {schedule}", flush=True)
    mp.spawn(worker, (world_size, find_free_port(), backend, pp, replicas, tp, schedule),
             world_size)


if __name__ == "__main__":  # required: mp.spawn re-imports this file in every child
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8, help="processes to start (default 8)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (default 2)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    parser.add_argument("--replicas", type=int, default=1, help="HSDP replicas of the shards")
    parser.add_argument("--schedule", default="Schedule1F1B", help="ScheduleGPipe, 1F1B, ...")
    main(**vars(parser.parse_args()))
