# Exercise 11: write the three functions where each lesson meets the others; keep this file beside model.py and checkpoint.py (in 11_train_gpt/)
# The TODOs say what to add. Solution: 11_train_gpt/train_gpt.py.
# Grade your copy: python 11_train_gpt/prove.py --lesson YOUR_COPY.py
r"""Lesson 11, the capstone: a small GPT on real text, with lessons 04, 05, 07, 09 and 10 together.

    python 11_train_gpt/train_gpt.py                                     # one process
    torchrun --standalone --nproc-per-node=2 11_train_gpt/train_gpt.py --out-dir out_ddp2
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 11_train_gpt/train_gpt.py \
        --parallel fsdp --accumulate 2 --precision bf16 --out-dir out_fsdp  # restarts resume
    torchrun --standalone --nproc-per-node=4 11_train_gpt/train_gpt.py --parallel fsdp --tp 2 \
        --out-dir out_2d  # 2-D: FSDP over 2 copies of the model, each split over 2 ranks (TP)
    python 11_train_gpt/train_gpt.py --model gpt2-124m --precision bf16 --compile  # a GPU: MFU

Your own project: replace make_dataset and make_model; nothing else needs to change.
"""
import argparse
import contextlib
import datetime
import functools
import gc
import glob
import hashlib
import inspect
import math
import os
import shutil
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, default_collate
from torch.utils.tensorboard import SummaryWriter

import checkpoint
from model import GPT, SIZES, sample, unigram_entropy

# Real text every Python has: its standard library, split by file. Bytes: 256 tokens, no tokenizer
TRAIN_FILES = ["argparse.py", "calendar.py", "contextlib.py", "dataclasses.py", "difflib.py",
               "functools.py", "heapq.py", "textwrap.py"]
VAL_FILES = ["bisect.py", "colorsys.py", "fnmatch.py", "queue.py", "sched.py"]
# bf16 dense peak TFLOP/s of a GPU, the datasheets' (the first key in its name), for MFU: add yours
PEAK_TFLOPS = {"H100 PCIe": 756, "H100 NVL": 835, "H100": 989, "H200": 989, "A100": 312}


class Windows(Dataset):
    """Non-overlapping windows of tokens, and the next tokens (the targets): each counted once."""

    def __init__(self, tokens, context):
        self.tokens, self.context = tokens, context

    def __len__(self):
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i):
        chunk = self.tokens[i * self.context: (i + 1) * self.context + 1].long()
        return chunk[:-1], chunk[1:]


def make_dataset(data, context):
    """(train set, validation set, what they are). A set yields (input, target) pairs."""
    if data:  # your own text file: the first 90% trains, the last 10% validates
        tokens = torch.frombuffer(bytearray(open(data, "rb").read()), dtype=torch.uint8)
        cut, what = int(0.9 * len(tokens)), f"{data}, bytes"
        return Windows(tokens[:cut], context), Windows(tokens[cut:], context), what
    def read(name):  # a module that is a package in a later Python (difflib): its __init__.py
        path = os.path.join(sysconfig.get_paths()["stdlib"], name)
        return open(path if os.path.exists(path) else path[:-3] + "/__init__.py", "rb").read()
    sets = [Windows(torch.frombuffer(bytearray(b"".join(map(read, names))), dtype=torch.uint8),
                    context) for names in (TRAIN_FILES, VAL_FILES)]
    return (*sets, f"Python {sys.version.split()[0]}'s standard library, bytes")


def make_model(context, dropout, seed, size="tiny"):
    torch.manual_seed(seed)  # the same initial weights in every process that builds it
    return GPT(context=context, dropout=dropout, **SIZES[size][0])


def step_windows(length, step, global_batch, seed):
    """The windows of one optimizer step: the next `global_batch` of one endless stream, a new
    permutation every epoch. It does not depend on the world size, so a run resumes exactly on
    any number of ranks, and nothing is dropped or repeated at the end of an epoch."""
    windows, start = [], step * global_batch
    while len(windows) < global_batch:
        epoch, offset = divmod(start + len(windows), length)
        windows += epoch_order(length, seed + epoch)[offset: offset + global_batch - len(windows)]
    return windows


@functools.lru_cache(maxsize=2)  # one permutation per epoch, not one per step
def epoch_order(length, seed):
    return torch.randperm(length, generator=torch.Generator().manual_seed(seed)).tolist()


# TODO(lesson 11): micro_batches(dataset, step, rank, world_size, accumulate, batch_size, seed):
#     this rank's share of the step's windows (step_windows), as a DataLoader of `accumulate`
#     micro-batches, with its own generator (rank and world_size: main passes the data-parallel
#     ones: with --tp, a copy's ranks read the same windows)


def loss_fn(output, target, reduction="mean"):
    """Cross-entropy over the last dimension for class targets (integers); squared error for real
    ones (regression), the output viewed as the target (never broadcast). bf16 counts in fp32."""
    output = output.to(torch.promote_types(output.dtype, torch.float32))
    if target.is_floating_point():
        return F.mse_loss(output.view(target.shape), target.to(output.dtype), reduction=reduction)
    return F.cross_entropy(output.flatten(0, -2), target.flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(model, dataset, batch_size, device, autocast, group=None):
    """(mean loss per target, targets counted): every one once, on any number of data-parallel
    ranks (`group`), each running as many forwards (FSDP's is a collective), counting its share."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = list(range(rank, len(dataset), world_size))
    batches = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    for b in range(batches):
        chunk = mine[b * batch_size: (b + 1) * batch_size]
        x, y = default_collate([dataset[i] for i in chunk or [0]])
        with autocast:
            logits = model(x.to(device))
        loss = loss_fn(logits, y.to(device), reduction="sum")  # summed: a mean per batch is wrong
        if chunk:
            total += torch.stack([loss.double(), torch.tensor(y.numel(), device=device)])
    model.train()
    dist.all_reduce(total, group=group)
    return (total[0] / total[1]).item(), int(total[1].item())


# TODO(lesson 11): train_step(model, batches, optimizer, parallel, autocast, clip): one optimizer
#     step over K micro-batches; gradients reduced once, on the last (DDP: no_sync(); FSDP:
#     set_requires_gradient_sync); backward of loss / K; clip (clip_grad_norm, below); step; zero
#     the grads; return (this rank's mean loss, the grad norm before clipping)


def clip_grad_norm(parameters, clip):
    """torch's clip_grad_norm_ (FSDP: the global norm), also for parameters on two meshes, which
    it cannot stack (--tp: the blocks' on dp x tp, the rest on dp): a norm per mesh, then theirs."""
    meshes = {}
    for p in (p for p in parameters if p.grad is not None):
        meshes.setdefault(getattr(p, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in meshes.values()]
    norm = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
    for group in meshes.values():
        torch.nn.utils.clip_grads_with_norm_(group, clip, norm)
    return norm


def digest(thing):  # 12 hex digits of the sha256 of its repr
    return hashlib.sha256(repr(thing).encode()).hexdigest()[:12]


def warmup_cosine(warmup, steps):
    """The learning rate's factor at each step: linear warmup, then a cosine down to 10%."""
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


# TODO(lesson 11): wrap(model, parallel, device, precision, mesh): 'ddp': DDP; 'fsdp': with --tp
#     (mesh['tp'] of more than 1 rank) model.tensor_parallel(mesh['tp']) first; then fully_shard
#     each block, then the root, over mesh['dp'], with a MixedPrecisionPolicy for bf16


def choose_backend(world_size):
    """NCCL with one process per GPU when there are enough GPUs, else gloo on CPU; and why."""
    gpus = torch.cuda.device_count()
    if gpus >= world_size:
        return "nccl", f"{gpus} GPU(s) visible, one per rank"
    return "gloo", "no GPU visible" if gpus == 0 else f"only {gpus} GPU(s) for {world_size} ranks"


def init_distributed(backend, device, timeout):
    """env:// reads what torchrun set; a fresh key prefix per restart (lesson 05)."""
    timeout = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.PrefixStore(f"attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)


def main(data=None, parallel="ddp", steps=600, accumulate=1, batch_size=16, precision="fp32",
         out_dir="out_gpt", tp=1, size="tiny", compile=False, lr=3e-3, dropout=0.0, context=64,
         seed=0, every=100, timeout=600):
    """One process = one rank. Returns (the model, unwrapped from DDP, this run's losses, the
    step it started from). timeout: a save hashes the whole checkpoint while the others wait."""
    if "RANK" not in os.environ:  # plain `python`: a world of one, as nanoGPT's train.py does
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # 0: alone, no peer needs it
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, reason = choose_backend(int(os.environ["LOCAL_WORLD_SIZE"]))
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    train_set, val_set, what = make_dataset(data, context)
    dp_size = world_size // max(tp, 1)  # copies of the model, each split over tp ranks (1: whole)
    shape = {} if size == "tiny" else {"size": size}  # your make_model needs no size parameter
    net, global_batch = make_model(context, dropout, seed, **shape), dp_size * accumulate * \
        batch_size
    parameters = sum(p.numel() for p in net.parameters())
    flops = net.flops_per_token() if hasattr(net, "flops_per_token") else \
        6 * parameters  # your model: 6N, no attention term
    # Every setting that changes the numbers (world size, tp, K, batch size only split the work),
    # and a hash of the code's (parameters' names, shapes, dtypes; the sets' ends; the loss)
    named = [type(net).__name__] + [(n, p.shape, p.dtype) for n, p in net.named_parameters()]
    ends = [torch.as_tensor(t).tolist() for s in (train_set, val_set) for t in s[0] + s[len(s) - 1]]
    config = dict(data=f"{what}: {len(train_set)} + {len(val_set)} samples {digest(ends)}", lr=lr,
                  model=digest(named), loss=digest(inspect.getsource(loss_fn)),
                  parallel=parallel, steps=steps, global_batch=global_batch, precision=precision,
                  dropout=dropout, context=context, seed=seed, clip=1.0,
                  weight_decay="0.1, 2-D weights only")
    try:  # before any rank starts collectives
        for wrong, why in [(tp < 1 or world_size % tp, f"must divide the {world_size} ranks"),
                           (tp > 1 and parallel != "fsdp", "needs --parallel fsdp"),
                           (tp > 1 and not hasattr(net, "tensor_parallel"), "needs a method "
                            f"{type(net).__name__}.tensor_parallel(tp_mesh), as model.py's GPT"),
                           (tp > 1 and getattr(net, "n_head", tp) % tp, "must divide the heads")]:
            if wrong:  # each rank of a copy computes whole heads
                raise ValueError(f"--tp {tp} {why}")
        resume = checkpoint.find(out_dir, config, parallel, rank)
        held = checkpoint.lock(out_dir) if rank == 0 else None  # one job per folder
    except (ValueError, checkpoint.BadCheckpoint) as error:  # one line, from rank 0 only,
        if rank == 0:  # and nothing overwritten
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    init_distributed(backend, device, timeout)
    writer = model = optimizer = scheduler = None
    try:  # timeout: gloo raises in a stuck collective; NCCL's watchdog aborts the process
        chosen = [None] * world_size
        dist.all_gather_object(chosen, resume)  # every rank must read one folder: a shared disk
        if len(set(chosen)) > 1:
            raise RuntimeError(f"the ranks found different checkpoints in {out_dir}: {chosen}")
        mesh = init_device_mesh(device.type, (dp_size, tp), mesh_dim_names=("dp", "tp"))
        dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
        if rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            for unfinished in glob.glob(os.path.join(out_dir, "*.tmp")):  # a save that crashed
                shutil.rmtree(unfinished) if os.path.isdir(unfinished) else os.remove(unfinished)
            print(f"backend: {backend} ({reason}); {parallel} on {world_size} rank(s)"
                  f"{f', tensor parallel over {tp}' if tp > 1 else ''}; global batch "
                  f"{dp_size} x {accumulate} x {batch_size} = {global_batch}; "
                  f"{precision}; data: {what}; {parameters:,} "
                  f"parameters, {flops / 1e9:.3g} GFLOP per token; resuming from {resume}",
                  flush=True)
        dist.barrier()
        dtype = torch.bfloat16 if precision == "bf16" and parallel == "ddp" else None
        autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        model, net = wrap(net.to(device), parallel, device, precision, mesh, compile), None
        optimizer = torch.optim.AdamW([  # 2-D weights decayed; biases and norms not (nanoGPT's)
            {"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}], lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps // 10, steps))
        # each copy its own dropout masks; its tp ranks the same (they hold the same activations)
        torch.manual_seed(seed + 1 + dp_rank)  # saved and restored with every checkpoint
        start = checkpoint.load(resume, model, optimizer, scheduler, parallel, device, dp_group) \
            if resume else 0
        if rank == 0:  # purge_step: what a crashed attempt logged after the checkpoint is hidden
            writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=start + 1)
        plain = model.module if parallel == "ddp" else model  # DDP's forward is for training
        unit = "tokens" if isinstance(train_set, Windows) else "targets"  # what a sample predicts
        tokens = global_batch * torch.as_tensor(train_set[0][1]).numel()  # per step, all ranks
        peak = next((tf * 1e12 for name, tf in PEAK_TFLOPS.items() if device.type == "cuda"
                     and name in torch.cuda.get_device_name(device)), None)
        losses, clock, timed = [], time.perf_counter(), start
        for step in range(start, steps):
            batches = micro_batches(train_set, step, dp_rank, dp_size, accumulate, batch_size, seed)
            lr_now = scheduler.get_last_lr()[0]  # this step's learning rate
            loss, norm = train_step(model, batches, optimizer, parallel, autocast, clip=1.0)
            scheduler.step()
            mean = torch.tensor([loss / dp_size], dtype=torch.float64, device=device)
            dist.all_reduce(mean, group=dp_group)  # TensorBoard's loss: every rank's, not rank 0's
            losses.append(loss)
            done = step + 1
            if done % every == 0 or done == steps:  # saved first: the evaluation is not in it
                rate = tokens * (done - timed) / (time.perf_counter() - clock) / world_size
                path = checkpoint.save(out_dir, model, optimizer, scheduler, done, config, parallel,
                                       device, dp_group)
                val_loss, counted = evaluate(plain, val_set, 4 * batch_size, device, autocast,
                                             dp_group)
                if rank == 0:  # MFU: the model's FLOPs done per second over the GPU's peak
                    mfu = f" (MFU {rate * flops / peak:.1%})" if peak and unit == "tokens" else ""
                    print(f"step {done}/{steps}  loss {loss:.4f} (rank 0)  val {val_loss:.4f} "
                          f"({counted} {unit})  lr {lr_now:.1e}  {rate:,.0f} {unit}/s per rank"
                          f"{mfu}  {(steps - done) * tokens / rate / world_size:.0f} s left; saved "
                          f"{path}", flush=True)
                    writer.add_scalar("val/loss", val_loss, done)
                clock, timed = time.perf_counter(), done  # the next rate: training steps only
            if writer:
                for tag, value in (("loss", mean.item()), ("grad_norm", norm), ("lr", lr_now)):
                    writer.add_scalar(f"train/{tag}", value, done)
        if unit == "tokens" and hasattr(plain, "generate"):  # what a context-free model scores,
            text = sample(plain)  # and a sample (every rank: an FSDP forward is a collective)
            if rank == 0 and start < steps:
                print(f"validation loss {val_loss:.3f} nats per token; a model that ignores the "
                      f"context: {unigram_entropy(val_set):.3f} (the unigram entropy)\n"
                      f"sample: {text!r}", flush=True)
        return plain, losses, start
    finally:
        if writer:
            writer.close()
        if held:  # the folder is free for the next job (a killed job's lock is found stale)
            os.remove(held)
        model = optimizer = scheduler = plain = None  # DDP and FSDP hold the process group:
        gc.collect()  # release it before destroying it (left to interpreter exit, gloo may abort)
        dist.destroy_process_group()


if __name__ == "__main__":  # torchrun runs this file once per rank
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a text file of your own (default: Python's stdlib)")
    parser.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps in all")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per micro-batch")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out-dir", default="out_gpt", help="checkpoints and TensorBoard")
    parser.add_argument("--tp", type=int, default=1, help="ranks per copy (--parallel fsdp: 2-D)")
    parser.add_argument("--model", dest="size", choices=SIZES, default="tiny", help="GPT's size")
    parser.add_argument("--compile", action="store_true", help="torch.compile each block")
    args = parser.parse_args()
    _, context, lr = SIZES[args.size]
    main(**vars(args), context=context, lr=lr, dropout=0.0)  # your dropout: make_model gets it
