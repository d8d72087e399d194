"""Writes the exercises' starter files from the lesson files, so that they cannot drift:

    python exercises/make_exercises.py            # rewrites exercises/NN_name.py
    python exercises/make_exercises.py --check    # exit 1 if a starter is not what it would write

A starter is the parent lesson's script with this lesson's diff cut out: every hunk of the diff
(as the README shows it) goes back to the parent's lines, with TODO comments there that say what
to add, not the code. A few hunks are given whole (the docstring, a comment): they teach nothing
to type. The lesson's script is the solution. Lesson 11 has no single parent: its starter is the
script with three functions cut out, each replaced by a TODO.

Each hint is tied to its hunk by a text that must appear in the hunk: when a lesson changes, the
hints that no longer fit stop this script with the hunk to write a hint for (a test runs --check).
"""
import argparse
import ast
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
GIVEN, SAME = "given", "same"  # see DIFF_EXERCISES

# lesson folder: (parent script, [(text in the change, hint), one per change of the diff, in
# order]). A hint is the TODO lines to write there, GIVEN (the starter keeps the lesson's lines),
# or SAME (part of the change before it: reverted, and no second TODO).
DIFF_EXERCISES = {
    "02_ddp_spawn": ("00_single_process/single_process.py", [
        ("Lesson 02", GIVEN), ("--world-size 3", GIVEN),
        ("import socket", ["import what a process group with a timeout and a free port need"]),
        ("torch.distributed", ["import torch.distributed and torch.multiprocessing"]),
        ("DistributedSampler", ["import DDP and DistributedSampler"]),
        ("on this rank", GIVEN),
        ("set_epoch", ["each epoch, tell the sampler which epoch it is (else every epoch "
                       "shuffles alike)"]),
        ("DDP averages", GIVEN),
        ("all_reduce", ["log the loss averaged over the ranks (all-reduce a copy), from rank 0 "
                        "only"]),
        ("def choose_backend", [
            "choose_backend(world_size): ('nccl', why) when torch.cuda.device_count() gives a "
            "GPU for every rank, else ('gloo', why)",
            "find_free_port(): a random port from 20000 to 32767 that nobody listens on now "
            "(connect_ex is refused); not a fixed one, which collides with other jobs, nor one "
            "from binding port 0, which the OS may hand to another process first (NOTES.md)",
            "worker(rank, world_size, port, backend, epochs, batch_size, lr, timeout=60): this "
            "rank's device (on CPU, its share of the cores: torch.set_num_threads); "
            "init_process_group at tcp://127.0.0.1:port with a timeout (and device_id on a GPU); "
            "a DistributedSampler; the model wrapped in DDP; train; return (model.module, the "
            "losses): the model DDP wraps, not the wrapper; destroy the process group in a "
            "finally",
            "main(world_size=2, epochs=2, batch_size=16, lr=0.05): print the backend and why, "
            "then mp.spawn the workers",
        ]),
        ("def find_free_port", SAME),
        ("--world-size", ["a --world-size flag (default 2); the batch size is per rank now "
                          "(default 16); pass the world size to main"]),
        ("--batch-size", SAME), ("args.world_size", SAME),
    ]),
    "04_sampler_checkpoint": ("02_ddp_spawn/ddp_spawn.py", [
        ("Lesson 04", GIVEN),
        ("import hashlib", ["import what the checkpoints need: finding files, hashing, a byte "
                            "buffer, skipping the steps already done, stderr"]),
        ("import sys", SAME),
        ("Subset", ["import Subset: the last 101 samples become a validation set"]),
        ("Dropout", ["add a Dropout(0.1): the RNG state becomes part of the training state"]),
        ("def evaluate", [
            "evaluate(model, dataset, device): each rank counts (correct, total) on an UNPADDED "
            "share (not a DistributedSampler: it pads), then all-reduce the counts",
            "find_checkpoint(folder, config): the newest step*.pt whose bytes match the checksum "
            "in its name; a config that differs, or only damaged files, stop with one line",
            "checkpoint(folder, model, optimizer, step, config, device): every rank gathers its "
            "RNG state; rank 0 writes model, optimizer, step, config and the RNG states to a temp "
            "file, fsyncs, renames it step<step in 7 digits>-<first 16 hex of its sha256>.pt "
            "(step0000010-52213e6d78397421.pt: names sort by step), keeps the two newest; then "
            "a barrier",
            "train(model, loader, optimizer, epochs, device, step, val_set, folder, config, "
            "every=5): the step to start from, and where to save",
        ]),
        ("step // len(loader)", ["start at the epoch of `step`, and skip the batches of that "
                                 "epoch already done"]),
        ("itertools.islice", SAME),
        ("step += 1", ["count the steps; checkpoint every `every` steps and at the very end"]),
        ("evaluate(model.module", ["each epoch, evaluate on val_set and log the accuracy"]),
        ("accuracy", SAME),
        ("def worker", ["worker also takes folder and resume; it returns the first step too"]),
        ("Subset(dataset", ["256 samples to train on and 101 held out; the sampler and the "
                            "loader on the training part only"]),
        ("weights_only=True", ["seed each rank's RNG differently (dropout); when resuming, "
                               "every rank loads the checkpoint (weights_only=True, onto its "
                               "device): model, optimizer, step and ITS OWN RNG state; train "
                               "from there"]),
        ("after step", ["return (model, losses, first step)"]),
        ('folder="checkpoints"', ["main takes the checkpoint folder"]),
        ("find_checkpoint(folder", ["main: create the folder, find the checkpoint to resume "
                                    "from, say which, and pass folder and resume to the workers"]),
        ("--batch-size", GIVEN),
        ("--ckpt-dir", ["a --ckpt-dir flag (default checkpoints), passed to main"]),
        ("args.ckpt_dir", SAME),
    ]),
    "05_torchrun_elastic": ("04_sampler_checkpoint/sampler_checkpoint.py", [
        ("Lesson 05", GIVEN),
        ("import socket", ["torchrun gives the port: no random, no socket needed"]),
        ("torch.multiprocessing", ["torchrun starts the processes: no torch.multiprocessing"]),
        ("def init_distributed", [
            "instead of find_free_port, init_distributed(backend, device, timeout): the store, "
            "rank and world size from dist.rendezvous('env://'); when TORCHELASTIC_USE_AGENT_STORE "
            "is 'True' (torchrun's own store, which outlives a restart), wrap it in a PrefixStore "
            "named after TORCHELASTIC_RESTART_COUNT; init_process_group with that store, the "
            "timeout, and device_id on a GPU",
        ]),
        ("def main(epochs", [
            "instead of worker, main(epochs=2, batch_size=16, lr=0.05, folder='checkpoints', "
            "timeout=60): ONE rank. Under plain python (no RANK in the environment) set what "
            "torchrun would for a world of one (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT=0); the backend from LOCAL_WORLD_SIZE, the device from "
            "LOCAL_RANK; find the checkpoint BEFORE any collective (a bad folder is one line); "
            "rank 0 says the backend, world size and attempt; then init_distributed and the "
            "worker's training"]),
        ("os.makedirs(folder", SAME),
        ("step, config = 0", SAME),
        ("def main(world_size", ["no mp.spawn main: torchrun runs this file once per rank"]),
        ("--world-size", ["flags: no --world-size (torchrun's --nproc-per-node); --ckpt-dir "
                          "with dest='folder'; a --timeout; main(**vars(parser.parse_args()))"]),
        ("--timeout", SAME),
    ]),
    "07_fsdp_dcp": ("02_ddp_spawn/ddp_spawn.py", [
        ("Lesson 07", GIVEN),
        ("import glob", ["import what finding and removing checkpoint folders needs"]),
        ("import shutil", SAME), ("import time", SAME),
        ("torch.distributed.checkpoint", ["import torch.distributed.checkpoint (as dcp)"]),
        ("fully_shard", ["import get_state_dict and set_state_dict from "
                         "torch.distributed.checkpoint.state_dict, fully_shard from "
                         "torch.distributed.fsdp (and no DDP)"]),
        ("first_epoch", ["train(model, loader, optimizer, epochs, device, first_epoch, folder)"]),
        ("range(first_epoch", ["start at first_epoch"]),
        ("reduce-scatters", GIVEN),
        ("save_checkpoint(folder", ["after each epoch, every rank saves a checkpoint; rank 0 "
                                    "says where"]),
        ("on rank 0; saved", SAME),
        ("def save_checkpoint", [
            "save_checkpoint(folder, model, optimizer, epoch): get_state_dict (this rank's "
            "shards), dcp.save to epochNNNN.tmp, then rank 0 renames it; barriers around",
            "load_checkpoint(path, model, optimizer): dcp.load into this rank's state dicts, "
            "then set_state_dict; return the epoch",
            "find_checkpoint(folder): the newest finished epoch* folder, or None",
        ]),
        ("NCCL with one process", GIVEN),
        ("def worker", ["worker also takes folder and resume"]),
        ("The loader's own generator", GIVEN),
        ("init_device_mesh", ["instead of DDP: a 1-D device mesh; fully_shard each Linear, then "
                              "the root; the optimizer AFTER sharding; load the checkpoint when "
                              "resuming; train from its epoch"]),
        ("FSDP holds", GIVEN),
        ('folder="ckpt_fsdp"', ["main takes the checkpoint folder"]),
        ("epoch*.tmp", ["main: remove unfinished epoch*.tmp folders, find the checkpoint, pass "
                        "folder and resume to the workers"]),
        ("--epochs", GIVEN),
        ("--out-dir", ["an --out-dir flag (default ckpt_fsdp), passed to main"]),
        ("args.out_dir", SAME),
    ]),
    "10_tensor_parallel": ("07_fsdp_dcp/fsdp_dcp.py", [
        ("Lesson 10", GIVEN),
        ("import glob", ["no checkpoints here: no glob, no shutil"]),
        ("import shutil", SAME),
        ("import warnings", ["import warnings (one FSDP2 warning is silenced, below)"]),
        ("torch.distributed.checkpoint", ["no DCP: no torch.distributed.checkpoint, no "
                                          "get_state_dict or set_state_dict"]),
        ("get_state_dict", SAME),
        ("Replicate, Shard", ["import Replicate and Shard from torch.distributed.tensor; "
                              "ColwiseParallel, PrepareModuleInput, RowwiseParallel, "
                              "SequenceParallel and parallelize_module from "
                              "torch.distributed.tensor.parallel; checkpoint from "
                              "torch.utils.checkpoint"]),
        ("def make_dataset", [
            "make_dataset(samples=64, length=16, vocab=32, seed=0): counting sequences: a start "
            "token per sample from its own seeded generator, then start + 0, 1, ..., length, "
            "modulo vocab; inputs the first `length` tokens, targets each one's next token, in a "
            "TensorDataset"]),
        ("class Attention", [
            "class Attention(nn.Module), Attention(dim, heads): q, k, v and out, four "
            "nn.Linear(dim, dim, bias=False) (q, k, v APART: a fused qkv splits wrongly under "
            "TP); keep heads and head_dim; forward(x): q, k, v as (B, heads, T, head_dim), "
            "writing -1 for the heads (a TP rank holds heads / tp of them), causal "
            "scaled_dot_product_attention, back to (B, T, -1), then out"]),
        ("class Block", [
            "class Block(nn.Module), Block(dim, heads, act_ckpt): norm1, norm2 (LayerNorm), attn, "
            "mlp = Sequential(Linear(dim, 4 dim), GELU, Linear(4 dim, dim)); layers(x): x + "
            "attn(norm1(x)), then + mlp(norm2(x)); forward(x): layers(x), or with act_ckpt "
            "checkpoint(self.layers, x, use_reentrant=False)",
            "make_model(act_ckpt=False, vocab=32, dim=32, heads=4, layers=2, seed=0): seeded; "
            "nn.Sequential(Embedding, the blocks, LayerNorm, Linear(dim, vocab))",
            "parallelize(model, tp_mesh, dp_mesh, sp): each block (model[1:-2]) with "
            "parallelize_module over tp_mesh: q, k, v and mlp.0 ColwiseParallel, attn.out and "
            "mlp.2 RowwiseParallel with output_layouts Shard(1) under SP, else Replicate(); 'attn' "
            "and 'mlp' a PrepareModuleInput from that layout to Replicate() (one input for q, k, v); "
            "under SP, norm1 and norm2 SequenceParallel. The embedding (model[0]) "
            "RowwiseParallel from Replicate() to that layout, the head ColwiseParallel from it to "
            "Replicate(), the last norm SequenceParallel under SP. Then, if dp_mesh is not None, "
            "fully_shard each block and the root over dp_mesh; return the model",
            "train(model, loader, optimizer, epochs, device): lesson 07's, without checkpoints",
        ]),
        ("range(epochs)", ["every epoch from 0: nothing to resume"]),
        ("x, y = x.to(device)", SAME),
        ("transpose(1, 2)", ["the loss: logits (B, T, vocab) against targets (B, T); "
                             "cross_entropy wants the classes on dim 1"]),
        ("save_checkpoint(folder", ["no checkpoint after an epoch; print the epoch's loss"]),
        ("on rank 0", SAME),
        ("def save_checkpoint", ["delete save_checkpoint, load_checkpoint and find_checkpoint "
                                 "(no DCP here), and choose_backend (main picks the backend)"]),
        ("def worker", ["worker(rank, world_size, port, backend, tp, sp, act_ckpt, epochs, "
                        "timeout=60): no folder, resume, batch size or learning rate"]),
        ("init_device_mesh", [
            "silence FSDP2's warning that the model returned a view (the logits; nothing edits "
            "them in place); a 2-D mesh (world_size // tp, tp) named ('dp', 'tp'); the sampler "
            "from the DATA-parallel dimension: mesh['dp'].size() replicas, this rank "
            "mesh['dp'].get_local_rank() (a TP group shares one batch); batches of 8"]),
        ("parallelize(make_model", [
            "the model: make_model(act_ckpt) on the device, parallelized over mesh['tp'], with "
            "FSDP over mesh['dp'] when world_size > tp; SGD (lr 0.05, momentum 0.9) after; "
            "return train's losses"]),
        ("def main(world_size=4", [
            "main(world_size=4, tp=2, sp=False, act_ckpt=False, epochs=2): refuse in one line a "
            "--tp that does not divide the world size, the model's heads or the sequence's "
            "length; NCCL when there is a GPU per rank, else gloo; print it and the mesh; "
            "mp.spawn the workers"]),
        ("--tp", ["flags --world-size (default 4), --tp (2), --sp, --act-ckpt; "
                  "main(**vars(parser.parse_args()))"]),
    ]),
    "09_training_loop": ("02_ddp_spawn/ddp_spawn.py", [
        ("Lesson 09", GIVEN),
        ("import contextlib", ["import contextlib (a context that does nothing)"]),
        ("Join", ["import Join"]),
        ("SummaryWriter", ["import TensorBoard's SummaryWriter"]),
        ("def train_step", [
            "train_step(model, micro_batches, optimizer, precision, max_norm, device): K "
            "micro-batches, all but the last under no_sync(); backward of loss / K; bf16 autocast "
            "when asked; clip the grad norm; step; return [loss sum, correct, samples] and the "
            "norm",
            "train(model, loader, optimizer, epochs, accumulate, precision, max_norm, writer, "
            "device): returns the grad norms",
        ]),
        ("model.train()", SAME),
        ("with Join([model])", ["K batches at a time under Join([model]); sum each rank's "
                                "totals; log loss, accuracy, grad norm and lr to the writer"]),
        ("each ", ["print the loss and accuracy over all ranks, and each rank's own loss"]),
        ("NCCL with one process", GIVEN),
        ("def worker", ["worker(rank, world_size, port, backend, epochs, accumulate, precision, "
                        "log_dir, batch_size=16, lr=0.05, max_norm=1.0, timeout=60)"]),
        ("writer = None", ["writer = None before the try (the finally closes it)"]),
        ("SummaryWriter(log_dir)", ["rank 0 opens a SummaryWriter when given log_dir"]),
        ("The loader's own generator", GIVEN),
        ("drop_last=True", ["drop_last=True: every rank the same number of batches"]),
        ("norms = train(", ["call train with accumulate, precision, max_norm and the writer"]),
        ("return model.module, norms", ["return the norms"]),
        ("writer.close()", ["close the writer"]),
        ("def main(world_size", ["main(world_size=2, epochs=2, accumulate=2, precision='fp32', "
                                 "log_dir=None): say what one step holds; spawn with them"]),
        ("micro-batches x 16", SAME),
        ("--accumulate", ["flags --accumulate (2), --precision (fp32 or bf16), --log-dir; "
                          "main(**vars(parser.parse_args())): the flags are main's parameters"]),
    ]),
    "13_pipeline_3d": ("10_tensor_parallel/tensor_parallel.py", [
        ("Lesson 13", GIVEN),
        ("import os", ["no os: one thread a rank"]),
        ("import warnings", ["no warnings to silence"]),
        ("pipelining", ["import pipelining from torch.distributed (PipelineStage, the schedules)"]),
        ("Replicate, Shard", ["no SP: Replicate alone"]),
        ("SequenceParallel", ["no SequenceParallel, no checkpoint, no DataLoader: batches by hand"]),
        ("class Attention", ["no make_dataset: make_batches, below, makes lesson 10's sequences"]),
        ("self.heads, self.head_dim", GIVEN),
        ("class Block", ["Block(dim, heads): no activation checkpointing"]),
        ("self.attn", SAME),
        ("def forward(self, x):  # checkpointed", ["forward(x) runs the layers directly"]),
        ("def make_model", ["make_model(vocab=32, dim=32, heads=4, layers=4, seed=0): 4 blocks"]),
        ("Block(dim, heads", SAME),
        ("def split_model", [
            "split_model(model, stages): the blocks shared out evenly, a list of nn.Sequential; "
            "the embedding joins the first, the last norm and the head the last (one stage: both)",
            "parallelize_stage(stage, tp_mesh, dp_mesh): lesson 10's TP plan (Replicate between "
            "layers) on each Block, the embedding RowwiseParallel, the head ColwiseParallel to "
            "Replicate(), when tp_mesh has more than one rank; then fully_shard each Block and "
            "the stage over dp_mesh with reshard_after_forward=False (zero-bubble schedules lose "
            "the blocks' weight gradients otherwise: NOTES.md)"]),
        ("def parallelize_stage", [
            "build(mesh, schedule_name, microbatches, device): the schedule class from "
            "pipelining; two stages a rank for a PipelineScheduleMulti (r and r+p looped, r and "
            "2p-1-r for a V: ZBV, DualPipeV), else one; split a fresh model, parallelize each "
            "stage over mesh['tp'] and the data-parallel mesh (mesh['rep', 'shard'] for HSDP, "
            "else mesh['shard']), a PipelineStage each with the pp group; the schedule with a "
            "cross-entropy loss_fn; return (schedule, stages)",
            "train(schedule, stages, batches, say, lr=0.05): SGD over every stage's parameters; "
            "each batch: zero_grad, schedule.step with x on the first stage's rank, target and a "
            "losses list on the last's; step; the mean micro-batch loss, printed when say"]),
        ("def make_batches", [
            "make_batches(steps, dp=1, d=0, batch_size=16, length=16, vocab=32): lesson 10's "
            "counting sequences, steps batches; data-parallel rank d's slice (every dp-th row "
            "from d), contiguous; worker(rank, world_size, port, backend, pp, replicas, tp, "
            "schedule_name, steps=3, timeout=60)"]),
        ("torch.cuda.set_device(device)", ["one thread a rank on CPU"]),
        ("try:", ["a (pp, replicas, dp / replicas, tp) mesh named pp, rep, shard, tp; build with "
                  "4 micro-batches; this rank's batches (its dp index: rank // tp % dp); train, "
                  "printing from one rank a stage"]),
        ("schedule = stages = None", ["release the schedule and stages before destroying"]),
        ("def main(world_size", ["main(world_size=8, pp=2, tp=2, replicas=1, "
                                 "schedule='Schedule1F1B'): pp x replicas x tp divides the world, "
                                 "4 micro-batches a dp rank divide the batch of 16"]),
        ("print(f\"backend", ["print the mesh and the schedule; spawn with them"]),
        ("--world-size", ["--world-size defaults to 8; a --pp flag"]),
        ("--sp", ["--replicas (HSDP) and --schedule flags, no --sp or --act-ckpt"]),
    ]),
    "12_debugging": ("02_ddp_spawn/ddp_spawn.py", [
        ("Lesson 12", GIVEN),
        ("import faulthandler", ["import faulthandler: a rank's stacks on a signal"]),
        ("import signal", ["import signal"]),
        ("import time", ["no timings here: no time"]),
        ("A learnable 4-class problem", GIVEN),
        ("dtype=torch.float32", ["make_model(seed=0, dtype=torch.float32)"]),
        ("LayerNorm", ["a LayerNorm(64) after the first Linear; the model in `dtype`"]),
        ("def dump_flight_recorder", [
            "dump_flight_recorder(folder, rank, backend): the flight recorder's bytes "
            "(torch._C._distributed_c10d._dump_fr_trace(); _dump_nccl_trace() on NCCL) to "
            "folder/fr-rank{rank}",
            "trace_step(model, x, y): forward hooks on every leaf module record its output "
            "('output of NAME', 'module.' dropped), after the input ('input'); cross-entropy, "
            "backward, hooks removed; then each parameter's gradient, last first ('gradient of "
            "NAME'); return (loss, trace): a dict in the order things happened",
            "train(model, loader, optimizer, epochs, device, folder)",
        ]),
        ("next(model.parameters()).dtype", ["the inputs in the model's dtype"]),
        ("trace_step(model, x, y)", ["each step through trace_step; step 1's trace saved to "
                                     "folder/trace-rank{rank}.pt"]),
        ("dist.all_reduce(mean)", ["no loss log (no all-reduce of the loss)"]),
        ("def choose_backend", ["no choose_backend: main picks the backend"]),
        ("def worker", ["worker(rank, world_size, port, backend, epochs, batch_size, lr, folder, "
                        "dtype, timeout=60)"]),
        ("SIGUSR1", ["one thread per rank on CPU; where SIGUSR1 exists, faulthandler.register it "
                     "to write every thread's stack to folder/stack-rank{rank}.txt (the file "
                     "kept open)"]),
        ("The loader's own generator", GIVEN),
        ("getattr(torch, dtype)", ["the model made in the run's dtype"]),
        ("monitored_barrier", ["train with the folder; then, on gloo, a monitored_barrier with "
                               "the timeout, waiting for every rank"]),
        ("dump_flight_recorder(folder", ["on an exception (the group's timeout), dump the flight "
                                         "recorder, then raise it again"]),
        ("def compare", [
            "compare(folder, world_size, batch_size, dtype): one process on the ranks' step-1 "
            "batch (each rank's first DistributedSampler(seed=0) batch, in turn), traced in "
            "float32 and float64; each entry's tolerance 10 x |float32 - float64|, scaled by "
            "eps(dtype) / eps(float32), + 1e-300; for each rank, the first entry of its saved "
            "trace (its rows of the activations, every gradient) beyond it: print it and return "
            "the list, (name, gap) or None per rank",
            "main(world_size=2, epochs=1, dtype='float32', debug_dir='debug', timeout=30, "
            "batch_size=16): NCCL when there is a GPU per rank, else gloo; print it; make the "
            "folder; mp.spawn the workers (lr 0.05); then compare",
        ]),
        ("--dtype", ["flags --world-size, --epochs (default 1), --dtype (float32 or float64), "
                     "--debug-dir, --timeout; main(**vars(parser.parse_args()))"]),
    ]),
    "14_fault_tolerance": ("05_torchrun_elastic/torchrun_elastic.py", [
        ("Lesson 14", GIVEN),
        ("import json", ["import what the step log and the replicas' processes need"]),
        ("import shutil", SAME), ("import tempfile", SAME),
        ("RUST_LOG", ["before torch and torchft are imported, RUST_LOG=warn unless it is set "
                      "(torchft reads it when it loads; else every quorum logs at INFO)"]),
        ("torch.distributed.checkpoint", ["import torch.distributed.checkpoint (as dcp)"]),
        ("torchft", ["import torchft's DistributedDataParallel (as DDP), Manager, Optimizer, "
                     "ProcessGroupGloo and ProcessGroupNCCL, and LighthouseServer from "
                     "torchft.coordination; from torch.utils.data only TensorDataset"]),
        ("def accuracy", ["instead of evaluate: accuracy(model, dataset), the samples of "
                          "dataset.tensors the model classifies right, in one forward (no "
                          "process group here)"]),
        ("dataset.tensors", SAME),
        ("def batch", ["instead of find_checkpoint (a replica that joins heals from a live peer): "
                       "batch(dataset, replica, step, batch_size), batch_size samples drawn by a "
                       "generator seeded by 1000 * step + replica"]),
        ("def start_lighthouse", ["instead of checkpoint: start_lighthouse(min_replicas, "
                                  "join_timeout_ms), a LighthouseServer on [::]:0 with a "
                                  "heartbeat timeout of 2000 ms"]),
        ("def train_replica", [
            "train_replica(replica, lighthouse, steps, folder, batch_size=16, lr=0.05, "
            "timeout=60, backend='gloo'): one replica group of one rank: GPU `replica` with "
            "nccl, else CPU with one thread; the group's own TCPStore (port 0, master); lesson "
            "05's model and SGD; a Manager (torchft's NCCL or gloo group; min_replica_size=1, "
            "use_async_quorum=False, every timeout, a load_state_dict and a state_dict of the "
            "model AND the optimizer, replica_id, the lighthouse, rank 0 of 1, the store's "
            "address); torchft's DDP and Optimizer around the model and SGD"]),
        ("manager.current_step() < steps", [
            "until the Manager has committed `steps`: optimizer.zero_grad() FIRST (the quorum, "
            "and a heal), then the batch of (replica, the Manager's current step)"]),
        ("optimizer.zero_grad()", SAME),
        ("log.write", ["after each step a JSON line in folder/replica{replica}.jsonl "
                       "(line-buffered): step, committed (the Manager's step moved on), "
                       "participants, loss, seconds, pid; at the end the module's weights in "
                       "folder/replica{replica}.pt, and manager.shutdown(wait=False)"]),
        ("def save_async", ["instead of init_distributed: save_async(state, folder, pg), "
                            "dcp.async_save on the process group pg; return its future"]),
        ("def newest_complete", ["instead of this main: newest_complete(root), the step-N folder "
                                 "with the largest N that holds DCP's .metadata, or None"]),
        ("def main(replicas", [
            "main(replicas=3, steps=40, batch_size=16, lr=0.05, timeout=60): a Lighthouse "
            "(min_replicas=replicas, join timeout 1 s); the backend for `replicas` GPUs "
            "(choose_backend); print it and the Lighthouse's "
            "address; a spawn process per replica running train_replica into a temporary folder; "
            "then every 10th step's loss and replicas, the steps committed, replica 0's accuracy "
            "and the largest difference between the replicas' weights; kill what is left, shut "
            "the Lighthouse down, remove the folder"]),
        ("--replicas", ["flags: --replicas (default 3) and --steps (default 40) instead of "
                        "--epochs; no --ckpt-dir"]),
        ("--ckpt-dir", SAME),
    ]),
}

# Lesson 11: (functions cut out of the script, {function: hint lines})
CUT_EXERCISES = {
    "11_train_gpt": ("train_gpt.py", {
        "micro_batches": [
            "micro_batches(dataset, step, rank, world_size, accumulate, batch_size, seed): this "
            "rank's share of the step's windows (step_windows), as a DataLoader of `accumulate` "
            "micro-batches, with its own generator (rank and world_size: main passes the "
            "data-parallel ones: with --tp, a copy's ranks read the same windows)",
        ],
        "train_step": [
            "train_step(model, batches, optimizer, parallel, autocast, clip): one optimizer step "
            "over K micro-batches; gradients reduced once, on the last (DDP: no_sync(); FSDP: "
            "set_requires_gradient_sync); backward of loss / K; clip (clip_grad_norm, below); "
            "step; zero the grads; "
            "return (this rank's mean loss, the grad norm before clipping)",
        ],
        "wrap": [
            "wrap(model, parallel, device, precision, mesh): 'ddp': DDP; 'fsdp': with --tp "
            "(mesh['tp'] of more than 1 rank) model.tensor_parallel(mesh['tp']) first; then "
            "fully_shard each block, then the root, over mesh['dp'], with a MixedPrecisionPolicy "
            "for bf16",
        ],
    }),
}


def todo(lines, indent, lesson):
    width = 100 - len(indent) - 2
    out = []
    for line in lines:
        words, current = line.split(), ""
        prefix = f"TODO(lesson {lesson[:2]}): "
        for word in words:
            if current and len(prefix + current + word) >= width:
                out.append(f"{indent}# {prefix}{current.rstrip()}")
                prefix, current = "    ", ""
            current += word + " "
        out.append(f"{indent}# {prefix}{current.rstrip()}")
    return out


def header(lesson, solution, note):
    return [f"# Exercise {lesson[:2]}: {note}",
            f"# The TODOs say what to add. Solution: {solution}.",
            f"# Grade your copy: python {lesson}/prove.py --lesson YOUR_COPY.py"]


def diff_starter(lesson):
    parent_path, hints = DIFF_EXERCISES[lesson]
    parent = (REPO / parent_path).read_text().splitlines()
    solution = REPO / lesson / f"{lesson.split('_', 1)[1]}.py"
    current = solution.read_text().splitlines()
    opcodes = difflib.SequenceMatcher(None, parent, current, autojunk=False).get_opcodes()
    changes = [op for op in opcodes if op[0] != "equal"]
    command = f"python tests/lesson_diff.py {parent_path} {solution.relative_to(REPO)}"
    if len(changes) != len(hints):
        raise SystemExit(f"{lesson}: the diff from {parent_path} has {len(changes)} changes, the "
                         f"hints {len(hints)}: write one per change ({command})")
    for number, ((tag, i1, i2, j1, j2), (key, _)) in enumerate(zip(changes, hints)):
        lines = parent[i1:i2] + current[j1:j2]
        if not any(key in line for line in lines):
            raise SystemExit(f"{lesson}: change {number} no longer contains {key!r}: its hint is "
                             f"stale ({command}):\n" + "\n".join(lines[:8]))
    out = header(lesson, f"{solution.relative_to(REPO)}",
                 f"turn lesson {parent_path[:2]}'s script into lesson {lesson[:2]}'s")
    hint_of_next_change = iter(hint for _, hint in hints)
    for tag, i1, i2, j1, j2 in opcodes:
        hint = None if tag == "equal" else next(hint_of_next_change)
        if tag == "equal" or hint == GIVEN:
            out += current[j1:j2]
            continue
        if hint != SAME:
            first = (parent[i1:i2] or current[j1:j2])[0]
            out += todo(hint, first[:len(first) - len(first.lstrip())], lesson)
        out += parent[i1:i2]
    return "\n".join(out) + "\n"


def cut_starter(lesson):
    script, hints = CUT_EXERCISES[lesson]
    path = REPO / lesson / script
    lines = path.read_text().splitlines()
    cuts = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in hints:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            cuts[start] = (node.end_lineno, node.name)
    missing = set(hints) - {name for _, name in cuts.values()}
    if missing:
        raise SystemExit(f"{lesson}/{script} no longer defines {sorted(missing)}: the hints are stale")
    out = header(lesson, f"{lesson}/{script}", "write the three functions where each lesson meets "
                 "the others; keep this file beside model.py and checkpoint.py (in 11_train_gpt/)")
    number = 0
    while number < len(lines):
        if number in cuts:
            end, name = cuts[number]
            out += todo(hints[name], "", lesson)
            number = end
            continue
        out.append(lines[number])
        number += 1
    return "\n".join(out) + "\n"


def starters():
    """{file name: text} for every exercise."""
    made = {f"{lesson}.py": diff_starter(lesson) for lesson in DIFF_EXERCISES}
    made.update({f"{lesson}.py": cut_starter(lesson) for lesson in CUT_EXERCISES})
    return made


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = []
    for name, text in starters().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote exercises/{name} ({len(text.splitlines())} lines)")
    if stale:
        print(f"stale: {', '.join(stale)}: run python exercises/make_exercises.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
