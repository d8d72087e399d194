"""Run every lesson's lab in order, exactly as its README shows, and print a summary.

    python run_lessons.py              # all lessons
    python run_lessons.py --only 02 04 # some of them
    python run_lessons.py --list       # just print the commands

Each lesson's command is the first `<!-- output: COMMAND -->` block of its README (the lab,
`python NN_name/prove.py`), the same one the tests check, so the README, this runner and the tests
cannot drift apart.
"""
import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NN", help="lesson numbers to run, e.g. 01 02")
    parser.add_argument("--list", action="store_true", help="print each lesson's command and exit")
    args = parser.parse_args()
    lessons = [(name, cmd) for name, cmd in lesson_commands() if not args.only or name[:2] in args.only]
    if not lessons:
        parser.error(f"no lesson matches --only {' '.join(args.only or [])}")
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
