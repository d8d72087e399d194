"""Run every lesson's lab in order, exactly as its README shows, and print a summary.

    python run_lessons.py              # all lessons
    python run_lessons.py --only 02 04 # some of them
    python run_lessons.py --list       # just print the commands
    python run_lessons.py --gpu        # every lab on this machine's GPU(s): lab_results.json

Each lesson's command is the first `<!-- output: COMMAND -->` block of its README (the lab,
`python NN_name/prove.py`), the same one the tests check, so the README, this runner and the tests
cannot drift apart.
"""
import argparse
import json
import re
import shlex
import subprocess
import sys
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


def on_device(name, command, device, gpus):
    """The lab's command on `device`: `--device cuda` (or cpu) where the lab has the flag, and
    `--world-size` (01: `--replicas`) = the GPUs where it has that flag and there are 2 or more.
    Labs without a device flag pick the GPU themselves (00, 05, 11: NCCL with one GPU per rank)
    or have none to use (08: RPC on CPU)."""
    lab = (REPO / name / "prove.py").read_text()
    extra = []
    if "add_device_flag" in lab:
        extra += ["--device", device]
    if gpus >= 2 and '"--world-size"' in lab:
        extra += ["--world-size", str(gpus)]
    elif gpus >= 1 and '"--replicas"' in lab:
        extra += ["--replicas", str(gpus)]
    return command + "".join(f" {arg}" for arg in extra)


def proof_of(stdout):
    """(passed, measured, tolerance) from a lab's `PROOF PASSED/FAILED: claim (measured,
    tolerance T)` line; None if it printed none."""
    found = re.findall(r"^PROOF (PASSED|FAILED): .*\(([^()]*), tolerance ([^()]*)\)\s*$", stdout, re.M)
    return (found[-1][0] == "PASSED", found[-1][1], found[-1][2]) if found else None


def what_ran(stdout):
    """(backend, device, world size) as the lab printed them (None where it did not say)."""
    backend = re.search(r"\b(nccl|gloo|TensorPipe)\b", stdout)
    world = re.search(r"world size (\d+)|(\d+) ranks?\b|(\d+) replica", stdout)
    device = "cuda" if re.search(r"\bnccl\b|\bcuda\b", stdout.split("PROOF")[0]) else "cpu"
    return (backend.group(1) if backend else None, device,
            int(next(g for g in world.groups() if g)) if world else None)


def run_on_devices(lessons, device, results_path):
    """Every lab on `device` (cuda: this machine's GPUs), one row each in `results_path`."""
    import torch  # only here: the plain runner starts no torch
    gpus = torch.cuda.device_count()
    if device == "cuda" and gpus == 0:
        print("run_lessons.py: error: --gpu needs a GPU and none is visible (torch.cuda."
              "device_count() is 0); --gpu-plan-on-cpu runs the same plan on the CPU",
              file=sys.stderr)
        return 2
    rows = []
    for name, command in lessons:
        command = on_device(name, command, device, gpus if device == "cuda" else 0)
        print(f"\n{'=' * 100}\n{name}: {command}\n{'=' * 100}", flush=True)
        start = time.perf_counter()
        result = subprocess.run(command_argv(command), cwd=REPO, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        print(result.stdout[-3000:], result.stderr[-1500:] if result.returncode else "", flush=True)
        proof, (backend, ran_on, world) = proof_of(result.stdout), what_ran(result.stdout)
        rows.append({"lab": name, "command": command, "exit": result.returncode,
                     "backend": backend, "device": ran_on, "world_size": world,
                     "proof": proof and ("PASSED" if proof[0] else "FAILED"),
                     "difference": proof and proof[1], "tolerance": proof and proof[2],
                     "seconds": round(seconds, 1)})
    from course import hardware  # the CPU's and GPUs' names, cores, torch
    Path(results_path).write_text(json.dumps({"hardware": hardware(), "labs": rows}, indent=1))
    print(f"\n{'lab':<24}{'exit':<6}{'backend':<12}{'device':<8}{'ranks':<7}{'seconds':<9}difference")
    for row in rows:
        print(f"{row['lab']:<24}{row['exit']:<6}{row['backend'] or '-':<12}{row['device']:<8}"
              f"{row['world_size'] or '-':<7}{row['seconds']:<9}{row['difference']}")
    print(f"results: {results_path}")
    return 0 if all(row["exit"] == 0 for row in rows) else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers to run, e.g. 01 02")
    parser.add_argument("--list", action="store_true", help="print each lesson's command and exit")
    parser.add_argument("--gpu", action="store_true", help="run every lab on this machine's GPU(s) "
                        "(NCCL, one GPU per rank, where a lab can) and write --results")
    parser.add_argument("--gpu-plan-on-cpu", action="store_true", help="the same plan and "
                        "results file with --device cpu: a rehearsal on a machine without a GPU")
    parser.add_argument("--results", default="lab_results.json", help="where --gpu writes one row "
                        "per lab: command, exit code, backend, device, ranks, proof difference, "
                        "seconds (default lab_results.json)")
    args = parser.parse_args()
    lessons = [(name, cmd) for name, cmd in lesson_commands() if not args.only or name[:2] in args.only]
    if not lessons:
        parser.error(f"no lesson matches --only {' '.join(args.only or [])}")
    if args.gpu or args.gpu_plan_on_cpu:
        return run_on_devices(lessons, "cuda" if args.gpu else "cpu", args.results)
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
