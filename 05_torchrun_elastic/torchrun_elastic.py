"""Lesson 05: lesson 02's DDP training launched by torchrun, restarted after a crash, resumed bit-exact.

    torchrun --standalone --nproc-per-node=2 05_torchrun_elastic/torchrun_elastic.py
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 05_torchrun_elastic/torchrun_elastic.py --crash-at-step 6
    ... --crash-at-step 6 --skip-rng-restore   # resumes without the RNG states: the proof fails, exit 1

torchrun starts one process per rank and sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in each. With --max-restarts it restarts the whole group when a rank dies; this script then resumes from
its last checkpoint. The proof: the final parameters are bit-identical to an uninterrupted run, which the
same processes train afterwards from scratch. Two nodes, SLURM and the store fix: see README.md.
"""
import argparse
import datetime
import gc
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto", help="auto: nccl with one GPU per local rank, else gloo")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if there is one GPU per local rank, else cpu")
    p.add_argument("--samples", type=int, default=256, help="size of the synthetic data set (default 256)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size PER RANK (default 16)")
    p.add_argument("--epochs", type=int, default=2, help="epochs to train (default 2)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--timeout", type=float, default=60, help="seconds before a stuck collective raises instead of hanging (default 60)")
    p.add_argument("--checkpoint-dir", help="checkpoint.pt, losses.csv and final.pt go here; every node must see it (shared file system). "
                   "Default: a directory in the temp dir named after torchrun's run id, removed when the run ends")
    p.add_argument("--checkpoint-every", type=int, default=4, help="save a checkpoint every N steps (default 4)")
    p.add_argument("--crash-at-step", type=int, help="one rank dies (SIGKILL) at the start of this step, the first time a run gets there")
    p.add_argument("--crash-rank", type=int, help="the rank that dies (default: the last rank)")
    p.add_argument("--crash-every-attempt", action="store_true", help="die on every attempt, like a real bug: restarts cannot help")
    p.add_argument("--skip-rng-restore", action="store_true", help="resume without restoring the RNG states: dropout draws other masks, the proof must FAIL")
    p.add_argument("--plain-init", action="store_true", help="init_process_group(init_method='env://') as most tutorials write it, "
                   "without the per-attempt store prefix: restarts then often fail (see README)")
    args = p.parse_args(argv)
    if min(args.samples, args.batch_size, args.epochs, args.checkpoint_every) < 1 or args.timeout <= 0:
        p.error("--samples, --batch-size, --epochs, --checkpoint-every and --timeout must be positive")
    if args.crash_at_step is not None and args.crash_at_step < 1:
        p.error(f"--crash-at-step must be a step number from 1, got {args.crash_at_step}")
    if (args.crash_every_attempt or args.crash_rank is not None) and args.crash_at_step is None:
        p.error("--crash-every-attempt and --crash-rank need --crash-at-step")
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:  # started with plain `python`: nobody set the variables torchrun sets
        p.exit(2, f"{p.prog}: this script is launched by torchrun, which starts one process per rank and sets "
                  f"{', '.join(missing)}. Run for example:\n  torchrun --standalone --nproc-per-node=2 {sys.argv[0]}\n")
    args.rank, args.local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    args.world_size, args.local_world_size = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    args.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0, then 1, 2, ... after each restart
    if args.crash_rank is None:
        args.crash_rank = args.world_size - 1
    if not 0 <= args.crash_rank < args.world_size:
        p.error(f"--crash-rank must be a rank between 0 and {args.world_size - 1}")
    steps = args.epochs * -(-args.samples // (args.world_size * args.batch_size))  # DistributedSampler pads, so ceil
    if args.crash_at_step is not None and args.crash_at_step > steps:
        p.error(f"--crash-at-step {args.crash_at_step} is never reached: this run has {steps} steps")
    args.backend, args.device, args.reason = choose_backend(args.backend, args.device, args.local_world_size, p.error)
    args.restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    args.several_nodes = args.world_size != args.local_world_size
    if args.several_nodes and args.restarts and not args.checkpoint_dir:
        p.error("several nodes with restarts need --checkpoint-dir on a file system every node shares: the default "
                "is a folder in each node's own temp dir, so the nodes would resume from different checkpoints")
    args.own_checkpoint_dir = not args.checkpoint_dir  # ours to remove at the end
    args.checkpoint_dir = args.checkpoint_dir or os.path.join(
        tempfile.gettempdir(), f"torchrun_elastic_{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}")
    try:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    except OSError as e:
        p.error(f"--checkpoint-dir {args.checkpoint_dir}: {e.strerror}")
    if os.path.exists(os.path.join(args.checkpoint_dir, "final.pt")):
        p.error(f"{args.checkpoint_dir} holds a finished run (final.pt): resuming it would train nothing. "
                "Use an empty --checkpoint-dir, or delete that one")
    try:
        check_checkpoint(os.path.join(args.checkpoint_dir, "checkpoint.pt"), args)
    except ValueError as e:
        p.error(str(e))
    return args


def config(args):
    """What must match for a checkpoint to continue the same run."""
    return {k: getattr(args, k) for k in ("world_size", "samples", "batch_size", "epochs", "lr", "checkpoint_every")}


def check_checkpoint(path, args):
    """Before any collective: a checkpoint this run cannot continue is one clear line, not a traceback on every rank."""
    if not os.path.exists(path):
        return
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)["config"]
    except Exception as e:  # truncated, garbage, not ours: never "retry with weights_only=False"
        raise ValueError(f"cannot read {path} ({type(e).__name__}): it is truncated or not this lesson's checkpoint. "
                         "Delete it, or use another --checkpoint-dir") from None
    if saved != config(args):
        changed = ", ".join(f"{k} {saved.get(k)} -> {v}" for k, v in config(args).items() if saved.get(k) != v)
        raise ValueError(f"{path} belongs to another run ({changed}): use another --checkpoint-dir, or the same flags")


def choose_backend(backend, device, local_world_size, error):
    """NCCL with one process per GPU when this node has enough GPUs, else gloo on CPU; says why."""
    gpus = torch.cuda.device_count()
    if device == "auto":
        device = "cuda" if gpus >= local_world_size and backend != "gloo" else "cpu"
    if device == "cuda" and gpus < local_world_size:
        error(f"--device cuda needs one GPU per local rank: {local_world_size} per node, but {gpus} GPU(s) visible")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        error(f"--backend nccl needs one GPU per local rank: {local_world_size} per node, but {gpus} GPU(s) visible; use --backend gloo")
    if device == "cuda":
        reason = f"{gpus} GPU(s) visible, one per local rank"
    elif gpus == 0:
        reason = "no GPU visible"
    else:
        reason = f"{gpus} GPU(s) visible for {local_world_size} local ranks, or CPU requested"
    return backend, device, reason


def init_distributed(args, device):
    """env:// rendezvous; on torchrun's long-lived store, a fresh key prefix per attempt (README: "Why restarts failed")."""
    timeout = datetime.timedelta(seconds=args.timeout)
    device_id = device if device.type == "cuda" else None
    if args.plain_init:  # the tutorial line: after a restart it can read the previous attempt's keys from the store
        dist.init_process_group(args.backend, init_method="env://", timeout=timeout, device_id=device_id)
        return
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))  # the store at MASTER_ADDR:MASTER_PORT
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's own store: it outlives attempts, keys included
        store = dist.PrefixStore(f"attempt{args.attempt}", store)  # this attempt's keys only; the old ones are invisible
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)


def make_dataset(args):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)  # a learnable 4-class problem
    return TensorDataset(x, y)


def make_model():
    torch.manual_seed(0)  # every rank starts from the same weights
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))  # dropout: the RNG matters


def save_checkpoint(path, model, optimizer, step, losses, args):
    """Rank 0 writes atomically; every rank waits at the barrier until the file exists."""
    rng = [None] * args.world_size
    mine = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if args.device == "cuda" else None}
    dist.all_gather_object(rng, mine)  # each rank draws its own dropout masks, so rank 0 saves every rank's RNG
    if args.rank == 0:
        state = {"step": step, "config": config(args), "model": model.module.state_dict(),
                 "optimizer": optimizer.state_dict(), "rng": rng, "losses": losses}
        with open(path + ".tmp", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(path + ".tmp", path)  # atomic: a crash during the save leaves the previous checkpoint whole
    dist.barrier()  # on EVERY rank, never inside `if rank == 0`


def load_checkpoint(path, model, optimizer, device, args):
    """Returns (step, losses) from the last checkpoint, or (0, []) if rank 0 finds none."""
    found = torch.tensor([int(os.path.exists(path))], device=device)
    dist.broadcast(found, src=0)  # rank 0 decides, so that all ranks agree
    if not found.item():
        return 0, []
    if not os.path.exists(path):
        raise FileNotFoundError(f"rank {args.rank} cannot see {path}: --checkpoint-dir must be on a file system all nodes share")
    ckpt = torch.load(path, map_location=device, weights_only=True)  # map_location: onto THIS rank's device
    model.module.load_state_dict(ckpt["model"])
    loaded = [None] * args.world_size  # did every rank load the same file? (a node-local folder would differ)
    dist.all_gather_object(loaded, (ckpt["step"], sum(v.double().sum().item() for v in ckpt["model"].values())))
    if any(other != loaded[0] for other in loaded):
        raise RuntimeError(f"the ranks loaded different checkpoints (step, weight sum per rank: {loaded}): "
                           "--checkpoint-dir must be one folder on a file system every node shares")
    optimizer.load_state_dict(ckpt["optimizer"])
    if not args.skip_rng_restore:
        torch.set_rng_state(ckpt["rng"][args.rank]["cpu"].cpu())
        if args.device == "cuda":
            torch.cuda.set_rng_state(ckpt["rng"][args.rank]["cuda"].cpu())
    return ckpt["step"], ckpt["losses"]


def maybe_crash(args, step, marker):
    """Die like a process hit by the OOM killer (no exception, no finally), once per run unless --crash-every-attempt."""
    if os.path.exists(marker) and not args.crash_every_attempt:
        return  # the marker, not TORCHELASTIC_RESTART_COUNT: that one is counted per node, so it cannot say "first attempt"
    open(marker, "w").close()
    print(f"rank {args.rank}: dying on purpose at step {step} (attempt {args.attempt}, --crash-at-step)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train(args, device, checkpoint_dir=None, crash=False, verbose=False):
    """Lesson 02's training; with checkpoint_dir it resumes from, and saves, checkpoints. Returns (state, losses, resumed_at)."""
    dataset = make_dataset(args)
    sampler = DistributedSampler(dataset, num_replicas=args.world_size, rank=args.rank, shuffle=True, seed=0)
    # The loader's own generator: otherwise each epoch's iterator draws from the global RNG that dropout uses.
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator())
    model = DDP(make_model().to(device), device_ids=[device.index] if args.device == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    torch.manual_seed(1 + args.rank)  # dropout masks: different on each rank, reproducible
    if args.device == "cuda":
        torch.cuda.manual_seed(1 + args.rank)
    path = checkpoint_dir and os.path.join(checkpoint_dir, "checkpoint.pt")
    step, losses = load_checkpoint(path, model, optimizer, device, args) if path else (0, [])
    resumed_at = step
    if verbose and args.rank == 0:
        print(f"resuming from the checkpoint at step {step}" if step else "no checkpoint: starting at step 0", flush=True)
    for epoch in range(step // len(loader), args.epochs):
        sampler.set_epoch(epoch)
        for x, y in itertools.islice(loader, step - epoch * len(loader), None):  # skip the batches done before the checkpoint
            step += 1
            if crash and step == args.crash_at_step and args.rank == args.crash_rank:
                maybe_crash(args, step, os.path.join(checkpoint_dir, f"crashed_at_step{step}"))
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()  # DDP averages the gradients here
            optimizer.step()
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)  # for the log only
            losses.append(mean_loss.item() / args.world_size)
            if verbose and args.rank == 0:
                print(f"attempt {args.attempt} epoch {epoch} step {step:3d}  loss {losses[-1]:.4f}", flush=True)
                with open(os.path.join(checkpoint_dir, "losses.csv"), "a") as f:
                    f.write(f"{args.attempt},{step},{losses[-1]!r}\n")
            if path and step % args.checkpoint_every == 0:
                save_checkpoint(path, model, optimizer, step, losses, args)
    return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}, losses, resumed_at


def report_proof(args, state, reference, losses, resumed_at, seconds):
    """Rank 0: are the final parameters bit-identical to the uninterrupted run's? Prints the PROOF line."""
    diff = max((state[k].double() - reference[k].double()).abs().max().item() for k in state)
    passed = all(torch.equal(state[k], reference[k]) for k in state)
    if resumed_at:
        story = f"resumed from the checkpoint at step {resumed_at}"
    elif args.crash_at_step is not None:
        story = "restarted from step 0 (no checkpoint before the crash)"
    else:
        story = "never interrupted (try --crash-at-step 6 with torchrun --max-restarts=1)"
    print(f"training took {seconds:.1f} s in attempt {args.attempt}; then the same ranks trained an uninterrupted reference run")
    print(f"PROOF {'PASSED' if passed else 'FAILED'}: {args.world_size} ranks, {len(losses)} steps, {story}: the final "
          f"parameters are {'bit-identical' if passed else 'NOT identical'} to the uninterrupted run's "
          f"(max |dw| {diff:.1e}, tolerance 0)", flush=True)
    return passed


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        device = torch.device("cuda", args.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1, SLURM scripts to their share: respect it
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // args.local_world_size))  # the cores this process may use, shared
    checkpoint_dir = args.checkpoint_dir
    if args.rank == 0:
        print(f"backend: {args.backend} on {args.device} ({args.reason}); world size {args.world_size} = "
              f"{args.world_size // args.local_world_size} node(s) x {args.local_world_size} process(es); attempt {args.attempt} "
              f"(restarts allowed: {args.restarts})", flush=True)
    if args.rank == 0 and args.several_nodes and args.restarts and not args.plain_init \
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print("warning: several nodes, restarts and torchrun's shared store: with c10d rendezvous the nodes can disagree "
              "on the attempt number, so restarts can hang (measured: 4 of 10 passed). Start every torchrun with "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (10 of 10). Static rendezvous is fine (10 of 10).", file=sys.stderr, flush=True)
    init_distributed(args, device)
    try:
        start = time.perf_counter()
        state, losses, resumed_at = train(args, device, checkpoint_dir, crash=args.crash_at_step is not None, verbose=True)
        seconds = time.perf_counter() - start
        reference, _, _ = train(args, device)  # the same processes, from scratch: no crash, no checkpoint
        passed = torch.ones(1, device=device)
        if args.rank == 0:
            torch.save({"state": state, "reference": reference, "losses": losses}, os.path.join(checkpoint_dir, "final.pt"))
            passed[0] = report_proof(args, state, reference, losses, resumed_at, seconds)
        dist.broadcast(passed, src=0)  # every rank exits with the verdict
        if args.own_checkpoint_dir and args.local_rank == 0:
            shutil.rmtree(checkpoint_dir, ignore_errors=True)  # our own temporary directory, one per node
        return 0 if passed.item() else 1
    finally:
        gc.collect()  # free the DDP models now: left to interpreter exit, gloo aborts there in some runs (torch 2.15)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
