"""Lesson 01: what nn.DataParallel really does, on 2+ GPUs and, honestly, on a CPU.

    python 01_dataparallel/dataparallel.py                # nn.DataParallel with 2+ GPUs, else a hand-written step on CPU
    python 01_dataparallel/dataparallel.py --replicas 3   # 3 replicas (GPUs, or threads on CPU): chunks of 11, 11 and 10 rows
    python 01_dataparallel/dataparallel.py --detach-demo  # replicas 1.. are detached copies: the proof fails, exit 1

nn.DataParallel is ONE process. At every step it scatters the batch in chunks, replicates the module onto each GPU,
runs the replicas in threads, gathers their outputs on device_ids[0], and in backward() SUMS the replicas' gradients
into the original module. Without a GPU it does none of this: device_ids is [] and forward() just calls the module.
On CPU this script therefore runs a hand-written step that does the same five things.
The proof: outputs and gradients equal the unwrapped model's on the full batch, at every step.
"""
import argparse
import copy
import functools
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.parallel import gather as dp_gather, parallel_apply as dp_parallel_apply, replicate as dp_replicate, scatter as dp_scatter

# The step differs from the unwrapped model only in how rows are grouped and sums are ordered. Measured on CPU (float32):
# outputs 0 to 6e-8, gradients ~1e-8; a replica whose gradient is lost gives ~1e-1. On GPUs NOT measured (no GPU machine
# was available); the looser bound allows for cuBLAS picking other kernels for a chunk than for the whole batch.
TOLERANCE = {"cpu": 1e-6, "cuda": 1e-5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: nn.DataParallel on cuda with 2+ GPUs, else the hand-written step on cpu")
    p.add_argument("--replicas", type=int, default=2, help="replicas: GPUs for nn.DataParallel (cuda:0..N-1), threads on CPU (default 2)")
    p.add_argument("--batch-size", type=int, default=32, help="the WHOLE batch, scattered in --replicas chunks (default 32)")
    p.add_argument("--steps", type=int, default=5, help="SGD steps, each one checked against the unwrapped model (default 5)")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP's two hidden layers (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--save", help="file to save model.module.state_dict() to (default: a temporary file)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per variant, the median is printed; 0 skips the timing (default 20)")
    p.add_argument("--bench-hidden", type=int, default=1024, help="hidden width of the MLP that is timed (default 1024)")
    p.add_argument("--bench-batch", type=int, default=512, help="batch size of the timed steps (default 512)")
    p.add_argument("--detach-demo", action="store_true", help="replicas 1.. get detached copies of the parameters, so their gradients never reach the model: the proof must FAIL")
    args = p.parse_args(argv)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, got {args.replicas}")
    if min(args.batch_size, args.steps, args.hidden, args.bench_hidden, args.bench_batch) < 1 or args.lr <= 0 or args.repeats < 0:
        p.error("--batch-size, --steps, --hidden, --bench-hidden, --bench-batch and --lr must be positive, --repeats at least 0")
    if min(args.batch_size, args.bench_batch) < args.replicas:
        p.error(f"--batch-size and --bench-batch must be at least --replicas ({args.replicas}): every replica needs rows")
    if args.detach_demo and args.replicas < 2:
        p.error("--detach-demo needs at least 2 replicas")
    if args.save and (os.path.isdir(args.save) or not os.path.isdir(os.path.dirname(os.path.abspath(args.save)))):
        p.error(f"--save needs a file name in an existing directory, got {args.save}")
    args.device, args.reason = choose_device(args.device, args.replicas, p.error)
    return args


def choose_device(device, replicas, error):
    """nn.DataParallel on cuda with 2+ GPUs, one per replica; else the hand-written step on cpu. Says why."""
    gpus, needed = torch.cuda.device_count(), max(2, replicas)
    if device == "auto":
        device = "cuda" if gpus >= needed else "cpu"
    if device == "cuda" and gpus < needed:
        error(f"--device cuda runs nn.DataParallel on one GPU per replica, at least 2: {needed} needed, {gpus} GPU(s) visible")
    if device == "cuda":
        return device, f"{gpus} GPU(s) visible, one per replica"
    if gpus == 0:
        return device, "no GPU visible, so nn.DataParallel would just call the module"
    return device, f"{gpus} GPU(s) visible for {replicas} replicas, or CPU requested"


class Net(nn.Module):
    """An MLP that can say, from inside forward(), how many rows it got, on which device and in which thread."""
    report = False  # a class attribute: switching it on makes every copy print, replicas included

    def __init__(self, hidden):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x):
        if Net.report:  # one write per line: replicas print from several threads at once
            sys.stdout.write(f"  inside forward: {x.shape[0]} rows on {x.device} ({threading.current_thread().name})\n")
        return self.layers(x)


class NetWithLoss(nn.Module):
    """The pattern that trips people up: forward() returns the loss, a 0-dim tensor."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.net(x), y)


def make_model(hidden):
    torch.manual_seed(0)
    return Net(hidden)


def make_batch(batch_size, step=0):
    x = torch.randn(batch_size, 20, generator=torch.Generator().manual_seed(step))
    return x, (x @ torch.randn(20, 4, generator=torch.Generator().manual_seed(1234))).argmax(dim=1)  # a learnable rule


# ---- DataParallel by hand: the five things nn.DataParallel does at every step --------------------------------------

def scatter(inputs, n):
    """1. scatter: chunk every input along dim 0 (on GPUs each chunk is also copied to its device)."""
    return list(zip(*(t.chunk(n) for t in inputs)))  # fewer than n chunks when the batch is small, as in DataParallel


def replicate(module, shells, detach=False):
    """2. replicate, at EVERY step: a differentiable copy of each parameter for each replica (on GPUs, one per device).
    A copy's backward hands its gradient to the original parameter, where autograd sums the replicas' gradients.
    functional_call swaps the copies into the module it is given, so each replica gets its own shell: two threads
    must never swap tensors in the same module."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    replicas = []
    for i, shell in enumerate(shells):
        cut_off = detach and i > 0  # --detach-demo: like a copy.deepcopy(model), unconnected to the original
        copies = {name: t.detach().clone() if cut_off else t.clone() for name, t in tensors.items()}
        replicas.append(functools.partial(functional_call, shell, copies))
    return replicas


def parallel_apply(replicas, chunks, threaded=True):
    """3. parallel_apply: each replica on its chunk, each in its own thread (threaded=False: one after another)."""
    results, grad_enabled = [None] * len(replicas), torch.is_grad_enabled()  # grad mode is per thread: hand it on

    def work(i):
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replicas[i](chunks[i])
        except Exception as e:  # re-raised in the calling thread below, as nn.DataParallel does
            results[i] = e

    if threaded:
        threads = [threading.Thread(target=work, args=(i,), name=f"replica {i}") for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(replicas)):
            work(i)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def gather(outputs):
    """4. gather: concatenate the outputs on one device (nn.DataParallel: output_device, default device_ids[0]).
    0-dim outputs (a loss) become a vector with one entry per replica, as in nn.DataParallel."""
    return torch.stack(outputs) if outputs[0].dim() == 0 else torch.cat(outputs)


def hand_written_data_parallel(module, shells, *inputs, threaded=True, detach=False):
    """Steps 1 to 4. Step 5, backward, is autograd's: loss.backward() on the gathered output flows back through each
    replica's copies and is summed into module's .grad (on GPUs, nn.DataParallel sums them onto device_ids[0])."""
    chunks = scatter(inputs, len(shells))
    return gather(parallel_apply(replicate(module, shells[:len(chunks)], detach), chunks, threaded))


class DetachedReplicasDataParallel(nn.DataParallel):
    """--detach-demo on GPUs: replicas 1.. come from torch's replicate(detach=True), the same break as on CPU."""

    def replicate(self, module, device_ids):
        return super().replicate(module, device_ids)[:1] + dp_replicate(module, device_ids, detach=True)[1:]


# ---- what is checked and shown ----------------------------------------------------------------------------------------

def flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def dataparallel_here(batch_size):
    """nn.DataParallel on THIS machine. Without a GPU, device_ids == [] and forward() calls the module: prints what it
    and its building blocks do. Returns (the check holds or does not apply, nn.DataParallel is a pass-through here)."""
    net, x = make_model(8), make_batch(batch_size)[0]
    dp = nn.DataParallel(net)
    if dp.device_ids:
        print(f"nn.DataParallel(net) here: device_ids {dp.device_ids}, so it is no pass-through on this machine")
        return True, False
    print("nn.DataParallel(net) here: device_ids [] (no GPU), so forward() just calls net:")
    Net.report = True
    out = dp(x)
    Net.report = False
    diff = (out - net(x)).abs().max().item()
    print(f"  output identical to net(x): {'yes' if diff == 0 else 'NO'} (max |dy| {diff:.1e}); its building blocks refuse CPU tensors:")
    for name, call in [("scatter", lambda: dp_scatter(x, [0, 1])), ("replicate", lambda: dp_replicate(net, [0, 1])),
                       ("parallel_apply", lambda: dp_parallel_apply([net, net], list(x.chunk(2)))),
                       ("gather", lambda: dp_gather(list(x.chunk(2)), 0))]:
        try:
            call()
            print(f"  {name}: no error")
        except Exception as e:
            print(f"  {name}: {type(e).__name__}: {str(e).split('. ')[0].splitlines()[0]}")
    return diff == 0, True


def compare_step(forward, model, x, y, report=False):
    """One step through `forward` (nn.DataParallel or the hand-written one) and through the unwrapped model on the
    whole batch. Leaves forward's gradients in model's .grad; returns the loss and max |difference| of outputs, gradients."""
    model.zero_grad(set_to_none=True)
    expected = model(x)
    nn.functional.cross_entropy(expected, y).backward()
    expected_grad = flat_grad(model)
    model.zero_grad(set_to_none=True)
    Net.report = report
    out = forward(x)
    Net.report = False
    loss = nn.functional.cross_entropy(out, y)  # ONE loss, on the gathered output
    loss.backward()  # 5. backward: the replicas' gradients are summed into model's .grad
    return loss.item(), (out - expected).abs().max().item(), (flat_grad(model) - expected_grad).abs().max().item()


def train_and_check(args, forward, model, device):
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    worst_out = worst_grad = 0.0
    print(f"step 1: the batch of {args.batch_size} is scattered; each replica reports from inside forward():")
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in make_batch(args.batch_size, step))
        loss, d_out, d_grad = compare_step(forward, model, x, y, report=step == 1)
        optimizer.step()
        worst_out, worst_grad = max(worst_out, d_out), max(worst_grad, d_grad)
        print(f"step {step}  loss {loss:.4f}  vs the unwrapped model: max |dy| {d_out:.1e}, max |dgrad| {d_grad:.1e}")
    return worst_out, worst_grad


def scalar_loss_pitfall(loss_forward, model, x, y, tolerance):
    """forward() returns the loss: DataParallel gathers one loss per replica, a vector, so .mean() is needed."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    expected = flat_grad(model)
    model.zero_grad(set_to_none=True)
    losses = loss_forward(x, y)
    try:
        losses.backward()
        error = "no error"
    except RuntimeError as e:
        error = f"RuntimeError: {str(e).splitlines()[0]}"
    grads = {}
    for how in ("mean", "sum"):
        model.zero_grad(set_to_none=True)
        getattr(loss_forward(x, y), how)().backward()
        grads[how] = flat_grad(model)
    model.zero_grad(set_to_none=True)
    d_mean, ratio, n = (grads["mean"] - expected).abs().max().item(), (grads["sum"].norm() / expected.norm()).item(), len(losses)
    print(f"  loss.backward()        -> {error}")
    print(f"  loss.mean().backward() -> gradient max |dgrad| {d_mean:.1e} from the full batch's: "
          f"{'correct' if d_mean <= tolerance else 'NOT equal (chunks of unequal size: their rows weigh unequally)'}")
    print(f"  loss.sum().backward()  -> gradient {ratio:.2f}x the full batch's{f': wrong, about {n} times too large' if n > 1 else ''}")
    return tuple(losses.shape), error, d_mean, ratio


def save_and_reload(wrapper, args):
    """The wrapper's state_dict() carries a "module." prefix; save wrapper.module.state_dict() instead."""
    keys, inner = list(wrapper.state_dict()), list(wrapper.module.state_dict())
    print(f"state_dict keys: model.state_dict() {keys[0]!r}, ...; model.module.state_dict() {inner[0]!r}, ...")
    with tempfile.TemporaryDirectory(prefix="dataparallel_") as scratch:
        path = args.save or os.path.join(scratch, "model.pt")
        torch.save(wrapper.module.state_dict(), path)
        Net(args.hidden).load_state_dict(torch.load(path, map_location="cpu", weights_only=True))  # strict: all keys match
    try:
        Net(args.hidden).load_state_dict(wrapper.state_dict())
        wrong = "loads too (unexpected)"
    except RuntimeError as e:
        wrong = "fails: " + str(e).splitlines()[1].strip().split(", ")[0] + ", ..."
    print(f"saved model.module.state_dict() to {args.save or 'a temporary file'}: it loads into a plain Net; "
          f"loading model.state_dict() instead {wrong}")
    return keys, inner


# ---- timing --------------------------------------------------------------------------------------------------------

def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def time_variants(variants, x, y, repeats, sync=lambda: None):
    """Median seconds of the forward and of the backward of one step, per variant. The variants take turns, so that
    drift in the machine's speed hits them all alike; the first 2 rounds warm up."""
    times = {name: ([], []) for name in variants}
    for round_ in range(repeats + 2):
        for name, forward in variants.items():
            start = time.perf_counter()
            out = forward(x)
            sync()
            middle = time.perf_counter()
            nn.functional.cross_entropy(out, y).backward()
            sync()
            if round_ >= 2:
                times[name][0].append(middle - start)
                times[name][1].append(time.perf_counter() - middle)
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


def time_on_cpu(args):
    """The unwrapped model, and the hand-written step with its replicas one after another (1 thread) and in N threads,
    under torch.set_num_threads(1) and (cores). Returns {intra-op threads: {variant: (forward s, backward s)}}."""
    model, (x, y) = make_model(args.bench_hidden), make_batch(args.bench_batch)
    shells, n = [copy.deepcopy(model) for _ in range(args.replicas)], args.replicas
    variants = {"unwrapped": model,
                "1 thread": lambda x: hand_written_data_parallel(model, shells, x, threaded=False),
                f"{n} threads": lambda x: hand_written_data_parallel(model, shells, x, threaded=True)}
    before, cores, results = torch.get_num_threads(), os.cpu_count() or 1, {}
    try:
        for intra in sorted({1, cores}):
            torch.set_num_threads(intra)  # intra-op threads per calling thread: N replica threads use up to N x intra cores
            results[intra] = time_variants(variants, x, y, args.repeats)
    finally:
        torch.set_num_threads(before)
    print(f"timing on {cpu_name()} ({cores} cores), torch {torch.__version__}: mlp 20-{args.bench_hidden}-{args.bench_hidden}-4, "
          f"batch {args.bench_batch}, median of {args.repeats} steps, forward | backward in ms")
    for intra, t in results.items():
        (f1, b1), (fn, bn) = t["1 thread"], t[f"{n} threads"]
        print(f"  torch.set_num_threads({intra}): " + "; ".join(f"{k} {f * 1e3:.2f} | {b * 1e3:.2f}" for k, (f, b) in t.items())
              + f"; {n} threads vs 1: forward {f1 / fn:.2f}x, whole step {(f1 + b1) / (fn + bn):.2f}x as fast")
    return results


def time_on_gpus(args):
    """nn.DataParallel on N GPUs against the unwrapped model on one GPU, on the same whole batch."""
    model = make_model(args.bench_hidden).cuda(0)
    dp = nn.DataParallel(model, device_ids=list(range(args.replicas)))
    x, y = (t.cuda(0) for t in make_batch(args.bench_batch))
    t = time_variants({"one GPU": model, "nn.DataParallel": dp}, x, y, args.repeats, torch.cuda.synchronize)
    one, many = sum(t["one GPU"]), sum(t["nn.DataParallel"])
    print(f"timing on {args.replicas}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}: mlp 20-{args.bench_hidden}-"
          f"{args.bench_hidden}-4, batch {args.bench_batch}, median of {args.repeats} steps: one GPU {one * 1e3:.2f} ms, "
          f"nn.DataParallel on {args.replicas} GPUs {many * 1e3:.2f} ms: {one / many:.2f}x as fast (the ceiling is {args.replicas}x)")
    return t


def main(argv=None):
    args = parse_args(argv)
    n, cuda = args.replicas, args.device == "cuda"
    print(f"backend: {f'nn.DataParallel on cuda:0..{n - 1}' if cuda else 'hand-written DataParallel on cpu'} ({args.reason}); "
          f"{n} replica(s) in threads of this one process; mlp 20-{args.hidden}-{args.hidden}-4 in float32"
          f"{'; --detach-demo: replicas 1.. are detached copies' if args.detach_demo else ''}", flush=True)
    model = make_model(args.hidden)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would change the numbers the proof compares
        model = model.cuda(0)
        wrapper = (DetachedReplicasDataParallel if args.detach_demo else nn.DataParallel)(model, device_ids=list(range(n)))
        forward, here_ok, passthrough, what = wrapper, True, False, f"nn.DataParallel on {n} GPUs"
        loss_forward = nn.DataParallel(NetWithLoss(model), device_ids=list(range(n)))  # shares model's parameters
    else:
        here_ok, passthrough = dataparallel_here(args.batch_size)
        shells = [copy.deepcopy(model) for _ in range(n)]
        forward = lambda x: hand_written_data_parallel(model, shells, x, detach=args.detach_demo)
        loss_model = NetWithLoss(model)  # shares model's parameters
        loss_shells = [copy.deepcopy(loss_model) for _ in range(n)]
        loss_forward = lambda x, y: hand_written_data_parallel(loss_model, loss_shells, x, y)
        what = f"hand-written DataParallel ({n} replica(s) in threads)"
    device = "cuda" if cuda else "cpu"
    tolerance = TOLERANCE[device]
    d_out, d_grad = train_and_check(args, forward, model, device)
    x, y = (t.to(device) for t in make_batch(args.batch_size))
    print(f"scalar-loss pitfall: with a forward() that returns the loss, {what.split(' (')[0]} returns shape "
          f"{tuple(loss_forward(x, y).shape)}, one loss per replica" + ("" if cuda or not passthrough else
          f" (nn.DataParallel without GPU returns shape {tuple(nn.DataParallel(NetWithLoss(model))(x, y).shape)}, so code that works here breaks on GPUs)"))
    scalar_loss_pitfall(loss_forward, model, x, y, tolerance)
    if not cuda:  # a pass-through without GPU, but its state_dict() has the "module." prefix too. (With exactly one GPU
        # its constructor would move the module there: hence a copy in that case.)
        wrapper = nn.DataParallel(model if passthrough else copy.deepcopy(model))
    save_and_reload(wrapper, args)
    if args.repeats:
        time_on_gpus(args) if cuda else time_on_cpu(args)
    passed = here_ok and d_out <= tolerance and d_grad <= tolerance
    print(f"PROOF {'PASSED' if passed else 'FAILED'}: {what} {'gives' if passed else 'does NOT give'} the unwrapped model's "
          f"outputs and gradients on the full batch of {args.batch_size}, at each of {args.steps} steps: outputs max |dy| {d_out:.1e}, "
          f"gradients max |dgrad| {d_grad:.1e} (float32, tolerance {tolerance:.0e})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
