"""Is this machine ready for the course? Run it before a workshop (about 10 s on 2 cores):

    python preflight.py

Checks, each on one line: Python (which interpreter, and whether a virtual environment is active),
the pinned packages (requirements.txt, constraints.txt), a free port, a 2-rank gloo all-reduce
through mp.spawn (what every lesson does), a Jupyter kernel that runs code (the notebooks), free
disk, CPU cores. Prints READY and exits 0, or says line by line what to fix and exits 1. A warning
(WARN) does not stop the course; a failure (FAIL) does. What only the notebooks or the tests need
(jupyter, ipykernel, nbval, pytest) is a WARN when it is missing: the labs and exercises run
without it (WORKSHOP.md).
"""
import argparse
import datetime
import importlib.metadata
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# Packages only the notebooks or the test suite need: missing, a WARN (the labs run without them).
NOT_FOR_THE_LABS = {"jupyter": "the notebooks", "ipykernel": "the notebooks", "nbval": "the tests",
                    "pytest": "the tests", "pytest-timeout": "the tests", "pytest-xdist": "the tests"}
PYTHONS = ((3, 11), (3, 14))  # tested on 3.11; pip resolves the pinned set up to 3.14 (SETUP.md)


def pins():
    """{package: version} from requirements.txt's `name==version` lines."""
    found = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;#]+)", line.strip())
        if match:
            found[match[1].lower()] = match[2]
    return found


def in_a_venv():
    return sys.prefix != sys.base_prefix


def inactive_venv():
    """A virtual environment in the course's folder that holds torch while this Python is another:
    the usual cause of "not installed" is a new terminal where it was not activated."""
    if in_a_venv():
        return None
    for name in (".venv", "venv", "env"):
        folder = ROOT / name
        if (folder / "pyvenv.cfg").is_file() and (list(folder.glob("lib/python3*/site-packages/torch"))
                                                 or (folder / "Lib" / "site-packages" / "torch").is_dir()):
            return folder
    return None


def activate_hint(folder):
    unix = f". {folder.name}/bin/activate"
    return f"`{unix}` (Windows: `{folder.name}\\Scripts\\activate`)"


def check_python():
    version = sys.version_info[:2]
    where = f"virtual environment {sys.prefix}" if in_a_venv() else "no virtual environment active"
    text = f"Python {sys.version.split()[0]} at {sys.executable} ({where})"
    if not PYTHONS[0] <= version <= PYTHONS[1]:
        return "FAIL", f"{text}: the course needs 3.11 to 3.14 (torch 2.15 has no wheel for 3.10)"
    return "ok", text


def check_packages():
    missing, other = [], []
    for name, wanted in pins().items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if have != wanted:
            other.append(f"{name} {have} (pinned {wanted})")
    venv = inactive_venv()
    if missing and venv:
        return "FAIL", (f"not installed in this Python ({sys.executable}): {', '.join(missing)}; they are "
                        f"in {venv.name}, which is not active: activate {venv.name} with "
                        f"{activate_hint(venv)} and run this again (no need to reinstall)")
    needed = [name for name in missing if name not in NOT_FOR_THE_LABS]
    install = "`python -m pip install -r requirements.txt` in your virtual environment"
    if needed:
        return "FAIL", f"not installed: {', '.join(missing)}: run {install}"
    if missing:
        return "WARN", (f"not installed: {', '.join(f'{n} ({NOT_FOR_THE_LABS[n]})' for n in missing)}: "
                        f"the labs and exercises run without them; run {install}")
    if other:
        return "WARN", f"other versions than the pins: {', '.join(other)}; the outputs may differ"
    return "ok", f"{len(pins())} pinned packages at their pinned versions"


def free_port():
    """Free now, below 32768: with the default range the OS hands out none there itself
    (02_ddp_spawn/NOTES.md)."""
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port := random.randint(20000, 32767))) != 0:
                return port


def check_port():
    try:  # rank 0 listens on a port: can this machine open one?
        with socket.socket() as s:
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            return "ok", f"a free port on 127.0.0.1 ({s.getsockname()[1]})"
    except OSError as error:
        return "FAIL", f"cannot open a port on 127.0.0.1 ({error}): the ranks meet there"


def all_reduce_rank(rank, port, out):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    try:
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)
        if rank == 0:
            Path(out).write_text(str(x.item()))
    finally:
        dist.destroy_process_group()


def check_all_reduce():
    try:
        import torch.multiprocessing as mp
    except ImportError as error:
        return "FAIL", f"torch does not import: {error}"
    start, out = time.perf_counter(), ROOT / f".preflight-{os.getpid()}"
    try:
        mp.start_processes(all_reduce_rank, args=(free_port(), str(out)), nprocs=2, join=True,
                           start_method="spawn")
        total = float(out.read_text())
    except Exception as error:  # one line: the first line of what the ranks raised
        return "FAIL", (f"2 ranks could not all-reduce on gloo: {str(error).strip().splitlines()[-1]}"
                        " (a firewall or VPN blocking 127.0.0.1? SETUP.md, Troubleshooting)")
    finally:
        out.unlink(missing_ok=True)
    if total != 3.0:
        return "FAIL", f"2 ranks all-reduced 1 + 2 into {total}, not 3"
    return "ok", f"2 ranks all-reduced on gloo through mp.spawn ({time.perf_counter() - start:.1f} s)"


def check_kernel():
    try:
        from jupyter_client.manager import start_new_kernel
    except ImportError:
        return "WARN", "jupyter is not installed: the notebooks need it, the labs and exercises do not"
    try:  # the kernel's own warnings (TCP without encryption) are not the attendee's business
        manager, client = start_new_kernel(kernel_name="python3", startup_timeout=60,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except Exception as error:
        return "WARN", f"no Jupyter kernel starts ({type(error).__name__}: {error}): the " \
                       "notebooks need one, the labs and exercises do not; " \
                       "`python -m ipykernel install --user` in your virtual environment"
    try:
        printed = []
        reply = client.execute_interactive(
            "import sys; print(sys.executable)", timeout=30,
            output_hook=lambda m: printed.append(m["content"].get("text", "")))
        if reply["content"]["status"] != "ok":
            return "WARN", "a Jupyter kernel started but could not run `import sys`: the " \
                           "notebooks need one, the labs and exercises do not"
        kernel_python = "".join(printed).strip()
        if kernel_python and Path(kernel_python).resolve() != Path(sys.executable).resolve():
            return "WARN", (f"the python3 Jupyter kernel runs {kernel_python}, not this Python: "
                            "in the notebooks' own menu pick this environment, or run "
                            "`python -m ipykernel install --user --name course` here")
        return "ok", "a Jupyter kernel (python3) starts and runs code, in this Python"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def check_disk(needed_gb=1.0):
    free = shutil.disk_usage(ROOT).free / 1e9
    if free < needed_gb:
        return "FAIL", f"{free:.1f} GB free here: the labs and checkpoints need about {needed_gb:g} GB"
    return "ok", f"{free:.0f} GB free"


def check_cores():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if (cores or 1) < 2:
        return "WARN", f"{cores} core: the labs start 2 to 4 ranks; they run, slowly"
    return "ok", f"{cores} CPU cores"


CHECKS = [check_python, check_packages, check_port, check_all_reduce, check_kernel, check_disk,
          check_cores]


def main():
    start, failed = time.perf_counter(), 0
    for check in CHECKS:
        status, text = check()
        failed += status == "FAIL"
        print(f"{status:4s}  {text}", flush=True)
        if check is check_packages and status == "FAIL":
            print("FAIL  the remaining checks need the packages: install them first", flush=True)
            break
    print(f"{'READY' if not failed else 'NOT READY: fix the FAIL lines above'} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args()
    sys.exit(main())
