"""Run every lesson's lab in order, exactly as its README shows, and print a summary.

    python run_lessons.py              # all lessons
    python run_lessons.py --only 02 04 # some of them
    python run_lessons.py --list       # just print the commands
    python run_lessons.py --gpu        # every lab on this machine's GPU(s): lab_results.json
    python run_lessons.py --gpu --list # the plan: each lab's command on this machine's GPUs, and why
    python run_lessons.py --gpu-plan-on-cpu --gpus 2  # the plan for 2 GPUs, rehearsed on the CPU

Each lesson's command is the first `<!-- output: COMMAND -->` block of its README (the lab,
`python NN_name/prove.py`), the same one the tests check, so the README, this runner and the tests
cannot drift apart.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent


def command_argv(command):
    """A README command line as this interpreter runs it: `python` is sys.executable, and `torchrun` is the same
    program from this interpreter's torch (python -m torch.distributed.run), even if its bin/ is not on PATH."""
    argv = shlex.split(command)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return argv


def lesson_commands():
    for folder in sorted(REPO.glob("[0-9][0-9]_*/")):
        readme = folder / "README.md"
        found = re.search(r"<!--\s*output:\s*(.+?)\s*-->", readme.read_text()) if readme.exists() else None
        if found:
            yield folder.name, found.group(1)


# --- python run_lessons.py --gpu: every lab on this machine's GPUs, one command ---------------------
# THE PLAN: each lab's flags on a machine with g GPUs (g >= 1), and why, read from the lab's own
# checks of --device and --world-size. Run once on one H200 (gpu_runs/); the plans for 2 GPUs or
# more never ran. The rehearsal (--gpu-plan-on-cpu) runs the same flags with cpu in place of cuda.
MOST_RANKS = 8  # the labs' 256 samples: 8 ranks take 2 steps an epoch, 16 would take 1
GPU_PLAN = {
    "00_single_process": (lambda g: [], "no flag: the lesson takes cuda when a GPU is visible; "
                          "its 2 processes (no process group) share cuda:0"),
    "01_dataparallel": (lambda g: ["--device", "cuda", "--replicas", g] if g >= 2 else [],
                        "nn.DataParallel, one replica per GPU; 1 GPU: --device cuda is refused (it "
                        "would not split), so the hand-written step on CPU, and nn.DataParallel on cuda:0"),
    "02_ddp_spawn": (lambda g: ["--device", "cuda", "--world-size", min(g, MOST_RANKS)],
                     "NCCL, one rank per GPU; 1 GPU: a world of one"),
    "03_model_parallel": (lambda g: ["--device", "cuda", "--world-size", min(g // 2, MOST_RANKS)]
                          if g >= 2 else [],
                          "two GPUs per DDP rank, a pipeline of 2 ranks; 1 GPU: no cuda path, gloo on CPU"),
    "04_sampler_checkpoint": (lambda g: ["--device", "cuda", "--world-size", min(g, 2)],
                              "NCCL, 2 ranks on 2 GPUs (1 GPU: a world of one, its rank 0 killed); "
                              "not more: 3 ranks resume 1e-08 off, not bit-exact (its NOTES.md)"),
    "05_torchrun_elastic": (lambda g: [], "no flag: torchrun starts 2 ranks and the lab kills rank 1; "
                            "NCCL with 2 GPUs or more, else gloo on CPU"),
    "06_collectives": (lambda g: ["--device", "cuda", "--world-size", min(g, MOST_RANKS),
                                  "--ring-world-sizes", *([n for n in (2, 3, 4) if n <= g] or [1])],
                       "NCCL, one rank per GPU, for training, the tour and the rings of 2 to 4 "
                       "ranks that fit; 1 GPU: a world of one, a ring of one"),
    "07_fsdp_dcp": (lambda g: ["--device", "cuda", "--world-size", min(g, MOST_RANKS), "--resume-on",
                               *([1, 3] if g >= 3 else [1])],
                    "NCCL, one rank per GPU, resumed on 1 and 3 ranks (1 or 2 GPUs: on 1 only; "
                    "1 GPU: saved by a world of one)"),
    "08_rpc": (lambda g: [], "no GPU path: RPC over TensorPipe on CPU, as the lab says"),
    "09_training_loop": (lambda g: ["--device", "cuda", "--world-size", min(g, 4)] if g >= 2 else [],
                         "NCCL, one rank per GPU, at most 4 (5 leave under 2 steps an epoch with "
                         "--accumulate 2); 1 GPU: the lab needs 2 ranks, so gloo on CPU"),
    "10_tensor_parallel": (lambda g: ["--device", "cuda"] if g >= 4 else [],
                           "NCCL with 4 GPUs or more (its one launch of 4 ranks; round 1's two "
                           "2-rank runs share GPUs 0-1, each on its own communicator); fewer: gloo on CPU"),
    "11_train_gpt": (lambda g: [], "no flag: its runs at 1, 2, 3 and 4 ranks each take NCCL where there "
                     "is a GPU per rank, else gloo on CPU; it prints no backend line"),
    "12_debugging": (lambda g: [], "no flag: the lab plants its hangs and bugs on gloo (CPU): gloo's "
                     "timeout, monitored_barrier and the flight recorder's dump are what it proves; "
                     "the NCCL paths are in its NOTES.md, untested"),
    "13_pipeline_3d": (lambda g: ["--device", "cuda"] if g >= 4 else [],
                       "NCCL with 4 GPUs or more (its one launch of 4 ranks: 7 schedules on pp 2 x "
                       "FSDP 2, pp 2 x TP 2, HSDP 2 x 2); fewer: gloo on CPU"),
    "14_fault_tolerance": (lambda g: [], "no flag: the lab runs its replica groups on torchft's gloo "
                           "group (CPU), where it plants its failed all-reduce; the lesson's NCCL "
                           "path (a GPU per replica group) is in its NOTES.md, untested"),
}


# The capstone at GPT-2 size (--gpu, when lesson 11 is among the lessons; before the labs, which may
# take the minutes left): tokens/s and MFU, eager then compiled. The rehearsal on the CPU runs the
# tiny model a few steps: the 124M one takes minutes a step on a CPU, and compiling it longer.
LIMIT_S = {"cuda": 240, "cpu": 900}  # a run's most seconds: on a lent GPU, minutes are few


def capstone_runs(device, out_dir):
    size, steps = ("gpt2-124m", 200) if device == "cuda" else ("tiny", 20)
    command = f"python 11_train_gpt/train_gpt.py --model {size} --precision bf16 --steps {steps}"
    return [f"{command} --out-dir {out_dir}/eager", f"{command} --compile --out-dir {out_dir}/compiled"]


def capstone_numbers(output):
    """What the capstone printed: its parameters and GFLOP per token, and its last report's tokens/s
    per rank and MFU (None where it printed none: MFU needs a GPU in train_gpt.PEAK_TFLOPS)."""
    model = re.search(r"([\d,]+) parameters, ([\d.e+-]+) GFLOP per token", output)
    steps = re.findall(r"^step (\d+)/\d+ .*?  ([\d,]+) tokens/s per rank(?: \(MFU ([\d.]+)%\))?",
                       output, re.M)
    step, rate, mfu = steps[-1] if steps else (None, None, None)
    return {"parameters": model and int(model.group(1).replace(",", "")),
            "gflop_per_token": model and float(model.group(2)), "last_report_step": step and int(step),
            "tokens_per_s_per_rank": rate and int(rate.replace(",", "")),
            "mfu": round(float(mfu) / 100, 4) if mfu else None}


def planned(name, command, gpus, device="cuda"):
    """(the lab's command on a machine with `gpus` GPUs, why); device "cpu": the CPU rehearsal."""
    if name not in GPU_PLAN:
        raise KeyError(f"{name} has no entry in run_lessons.GPU_PLAN: add one")
    flags, why = GPU_PLAN[name]
    return command + "".join(f" {device if arg == 'cuda' else arg}" for arg in flags(gpus)), why


def proof_of(output):
    """(passed, measured, tolerance) from a lab's last `PROOF PASSED/FAILED: claim (measured,
    tolerance T)` line; None if it printed none."""
    found = re.findall(r"^PROOF (PASSED|FAILED): .*\(([^()]*), tolerance ([^()]*)\)\s*$", output, re.M)
    return (found[-1][0] == "PASSED", found[-1][1], found[-1][2]) if found else None


def first_seen(pattern, text):
    """The distinct values that `pattern`'s groups take, in the order the text shows them."""
    seen = [next(g for g in m.groups() if g) for m in re.finditer(pattern, text, re.M)]
    return list(dict.fromkeys(seen))


WORLD_SIZES = (r"world size (\d+)", r"\b(\d+) ranks?\b", r"--nproc-per-node (\d+)", r"\b(\d+) replica\(s\)",
               r"\b(\d+) fresh processes", r"on ((?:\d+, )*\d+ and \d+) ranks", r"\b(\d+ server \+ \d+) trainer")


def what_ran(output):
    """(backend, device, world size) as the lab's lines say (None where they say nothing): its
    backend lines (`backend: nccl (reason)`, `split under DDP: gloo (reason)`, `rpc backend:
    TensorPipe on CPU`), lesson 00's `device: cuda`, lesson 01's nn.DataParallel or hand-written
    step; the first world size it names (a list where it names several: lab 11's 1, 2 and 3)."""
    backends = first_seen(r"\b(nccl|gloo) \(|^rpc backend: (\w+)", output)
    devices = first_seen(r"^device: (cuda|cpu)\b|^(nn\.DataParallel) \(|^hand-written DataParallel on "
                         r"(cpu)|\b(nccl|gloo) \(|^rpc backend: \w+ on (CPU)", output)
    devices = list(dict.fromkeys({"nn.DataParallel": "cuda", "nccl": "cuda", "gloo": "cpu",
                                  "CPU": "cpu"}.get(d, d) for d in devices))
    said = re.sub(r"\b(nccl|gloo) \((?:[^()]|\([^()]*\))*\)", r"\1", output)
    worlds = sorted((m.start(), m.group(1)) for p in WORLD_SIZES for m in re.finditer(p, said))
    first = worlds[0][1] if worlds else ""  # the reasons left out: "(2 GPU(s) for 4 ranks)"
    numbers = [int(n) for n in re.findall(r"\d+", first)]
    world = sum(numbers) if "server" in first else numbers[0] if len(numbers) == 1 else numbers or None
    return "+".join(backends) or None, "+".join(devices) or None, world


def run_and_show(argv, limit=None):
    """Runs a lab with its output (stdout and stderr, in order) shown as it comes and kept; after
    `limit` seconds its whole process group is killed (exit -9), so one stuck lab ends no run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace", start_new_session=True) as process:
        timer = threading.Timer(limit or 1e9, os.killpg, (process.pid, signal.SIGKILL))
        timer.start()
        lines = []
        try:
            for line in process.stdout:
                print(line, end="", flush=True)
                lines.append(line)
        finally:
            timer.cancel()
    if process.returncode == -signal.SIGKILL:
        lines.append(f"run_lessons.py: killed after {limit} s\n")
    return process.returncode, "".join(lines)


def run_gpu_plan(lessons, gpus, device, results_path):
    """Every lab as GPU_PLAN says for `gpus` GPUs on `device` (cpu: the rehearsal); one row per lab
    in `results_path`; 0 if every lab exited 0."""
    import tempfile

    rows, capstone = [], []
    scratch = tempfile.mkdtemp(prefix="capstone-")  # checkpoints of 124M: 1.5 GB each, removed
    for command in capstone_runs(device, scratch) if "11_train_gpt" in dict(lessons) else []:
        print(f"\n{'=' * 100}\ncapstone: {command}\n{'=' * 100}", flush=True)
        start = time.perf_counter()
        code, output = run_and_show(command_argv(command), limit=LIMIT_S[device])
        capstone.append({"command": command.replace(scratch, "OUT"), "exit": code,
                         "seconds": round(time.perf_counter() - start, 1), **capstone_numbers(output)}
                        | ({"last_lines": output.splitlines()[-12:]} if code else {}))
        save_results(results_path, gpus, device, rows, capstone)
    shutil.rmtree(scratch, ignore_errors=True)
    for name, command in lessons:
        command, why = planned(name, command, gpus, device)
        print(f"\n{'=' * 100}\n{name}: {command}\n  ({why})\n{'=' * 100}", flush=True)
        start = time.perf_counter()
        code, output = run_and_show(command_argv(command), limit=LIMIT_S[device])
        seconds = time.perf_counter() - start
        proof, (backend, ran_on, world) = proof_of(output), what_ran(output)
        rows.append({"lab": name, "backend": backend, "device": ran_on, "world_size": world,
                     "difference": proof and proof[1], "tolerance": proof and proof[2],
                     "proof": proof and ("PASSED" if proof[0] else "FAILED"),
                     "seconds": round(seconds, 1), "exit": code, "command": command, "plan": why}
                    | ({"last_lines": output.splitlines()[-12:]} if code else {}))
        save_results(results_path, gpus, device, rows, capstone)  # after each: a timeout keeps them
    machine = save_results(results_path, gpus, device, rows, capstone, ask_cuda=True)
    print(f"\n{'lab':<24}{'exit':<6}{'backend':<11}{'device':<10}{'ranks':<9}{'seconds':<9}difference")
    for row in rows:
        ranks = ",".join(map(str, row["world_size"])) if isinstance(row["world_size"], list) else \
            row["world_size"] or "-"
        print(f"{row['lab']:<24}{row['exit']:<6}{row['backend'] or '-':<11}{row['device'] or '-':<10}"
              f"{ranks:<9}{row['seconds']:<9}{row['difference']}")  # 1,2,3,4: 7 wide
    for run in capstone:
        print(f"capstone: exit {run['exit']}, {run['tokens_per_s_per_rank']} tokens/s per rank, MFU "
              f"{run['mfu']}, {run['seconds']} s: {run['command']}")
    print(f"results: {results_path} ({machine})")
    return 0 if all(row["exit"] == 0 for row in rows + capstone) else 1


def save_results(results_path, gpus, device, rows, capstone, ask_cuda=False):
    """Writes the results file; ask_cuda (at the end): the hardware, NCCL's version and the GPUs
    visible, which initialize CUDA in this process. Returns the hardware's line."""
    import torch

    from course import hardware
    machine = hardware() if ask_cuda else None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if ask_cuda and \
            torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):  # a build without NCCL (Windows)
        nccl = None
    Path(results_path).write_text(json.dumps(
        {"hardware": machine, "cuda": torch.version.cuda, "nccl": nccl,
         "gpus_visible": torch.cuda.device_count() if ask_cuda else None, "plan_for_gpus": gpus,
         "run_on": "cuda" if device == "cuda" else "cpu: a rehearsal of the GPU plan "
         "(--gpu-plan-on-cpu)", "capstone": capstone, "labs": rows}, indent=1) + "\n")
    return machine


def gpu_main(args, lessons):
    """--gpu or --gpu-plan-on-cpu: refuse in one line (exit 2) what cannot run, else run the plan
    (or with --list, print it)."""
    import torch
    visible = torch.cuda.device_count()
    error = None
    if args.gpus is not None and args.gpus < 1:
        error = f"--gpus {args.gpus}: the plan is for 1 GPU or more"
    elif args.gpu and not args.list and visible == 0:
        error = ("--gpu needs a GPU and none is visible (torch.cuda.device_count() is 0); "
                 "--gpu-plan-on-cpu runs the same plan on the CPU")
    elif args.gpu and not args.list and (args.gpus or 0) > visible:
        error = f"--gpus {args.gpus}: {visible} GPU(s) visible"
    if error:
        print(f"run_lessons.py: error: {error}", file=sys.stderr)
        return 2
    gpus = args.gpus or (max(visible, 1) if args.gpu else 1)
    device = "cuda" if args.gpu else "cpu"
    if args.list:
        for name, command in lessons:
            command, why = planned(name, command, gpus, device)
            print(f"{name}: {command}\n    {why}")
        return 0
    return run_gpu_plan(lessons, gpus, device, args.results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers to run, e.g. 01 02")
    parser.add_argument("--list", action="store_true", help="print each lesson's command and exit")
    on_gpu = parser.add_mutually_exclusive_group()
    on_gpu.add_argument("--gpu", action="store_true", help="run every lab on this machine's GPU(s) "
                        "as GPU_PLAN says (NCCL, one GPU per rank, where a lab can) and write --results; "
                        "with --list, print the plan")
    on_gpu.add_argument("--gpu-plan-on-cpu", action="store_true", help="the same plan, cpu in place "
                        "of cuda, and the same results file: a rehearsal on a machine without a GPU")
    parser.add_argument("--gpus", type=int, metavar="N", help="the plan for N GPUs (default: the GPUs "
                        "visible; with --gpu-plan-on-cpu, 1)")
    parser.add_argument("--results", default="lab_results.json", help="where --gpu writes one row "
                        "per lab: backend, device, world size, proof difference and tolerance, seconds, "
                        "exit code, command, with the hardware (default lab_results.json)")
    args = parser.parse_args()
    lessons = [(name, cmd) for name, cmd in lesson_commands() if not args.only or name[:2] in args.only]
    if not lessons:
        parser.error(f"no lesson matches --only {' '.join(args.only or [])}")
    if args.gpu or args.gpu_plan_on_cpu:
        return gpu_main(args, lessons)
    if args.gpus is not None:
        parser.error("--gpus is the plan's: use it with --gpu or --gpu-plan-on-cpu")
    summary = []
    for name, command in lessons:
        if args.list:
            print(f"{name}: {command}")
            continue
        print(f"\n{'=' * 100}\n{name}: {command}\n{'=' * 100}", flush=True)
        start = time.perf_counter()
        code = subprocess.run(command_argv(command), cwd=REPO).returncode
        summary.append((name, code, time.perf_counter() - start))
    if args.list:
        return 0
    print(f"\n{'lesson':<24}{'result':<10}seconds")
    for name, code, seconds in summary:
        print(f"{name:<24}{'ok' if code == 0 else f'FAILED ({code})':<10}{seconds:.0f}")
    return 0 if all(code == 0 for _, code, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
