"""Shared test helpers: run a lesson exactly as a user does, and make sure no process outlives a test."""
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from run_lessons import command_argv  # noqa: E402
MARKER = "COURSE_TEST_PROCESS"  # every process a test starts inherits this variable, so leftovers can be found


def load_script(path, name=None):
    """Imports a lesson or lab script from its path (relative to the repository, or absolute),
    by default under a name of its own, so that no test shares its module state."""
    path = REPO / path
    spec = importlib.util.spec_from_file_location(name or f"{path.stem}_{uuid.uuid4().hex}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lesson_env(marker):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **{MARKER: marker})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_lesson(script, *args, cwd=None, timeout=120, marker="", launcher=(sys.executable,)):
    """Run `python <repo>/<script> args...` as a subprocess; return the CompletedProcess (stdout, stderr, returncode)."""
    cmd = [*launcher, str(REPO / script), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd or REPO, env=lesson_env(marker), capture_output=True, text=True, timeout=timeout)


def start_lesson(script, *args, cwd=None, marker=""):
    """Like run_lesson, but returns the running Popen (for concurrent runs)."""
    cmd = [sys.executable, str(REPO / script), *map(str, args)]
    return subprocess.Popen(cmd, cwd=cwd or REPO, env=lesson_env(marker), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def processes_with_marker(marker):
    """PIDs of live processes whose environment carries this test's marker (Linux /proc only)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if f"{MARKER}={marker}".encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            pass
    return found


def kill_leftovers(marker, wait=10):
    """Waits up to `wait` s for processes carrying `marker` to end, kills the rest; returns their PIDs."""
    if not Path("/proc/self/environ").exists():
        return []
    deadline = time.monotonic() + wait
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return left


def shared_cache_dir(pid=None):
    """One folder per test session, named after the pytest process that xdist's workers share as
    their parent; removed when the session ends (pytest_sessionfinish)."""
    if pid is None:
        pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
    folder = Path(tempfile.gettempdir()) / f"course-readme-runs-{pid}"  # $TMPDIR, /tmp, %TEMP%
    folder.mkdir(exist_ok=True)
    return folder


def pytest_sessionfinish(session):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the main pytest process, after every worker
        shutil.rmtree(shared_cache_dir(os.getpid()), ignore_errors=True)


def run_once_per_session(name):
    """Fails the test if `name` (an expensive module fixture, such as the lesson copied alone) has
    already run in this test session: its tests were split between xdist workers, so it ran twice
    (conftest.py at the repository root keeps a test class on one worker)."""
    mark = shared_cache_dir() / f"once-{name}"
    try:
        mark.open("x").close()
    except FileExistsError:
        pytest.fail(f"{name} ran a second time in this session: the tests that share it were split "
                    "between test workers (keep them in one class)", pytrace=False)


@functools.lru_cache(maxsize=None)
def run_readme_command(command):
    """A README command (`python NN_x/prove.py ...`, `torchrun ...`), run ONCE per test session from
    the repository root, exactly as run_lessons.py runs it. The README output test and the lesson's
    own tests read the same run, also from different xdist workers (a file lock makes the second
    one wait for the first): each rank costs seconds to start, so nothing runs twice."""
    cache = shared_cache_dir() / hashlib.sha256(command.encode()).hexdigest()[:20]
    try:
        import fcntl
    except ImportError:  # no flock (Windows): each worker runs the command itself
        fcntl = None
    with open(f"{cache}.lock", "w") as lock:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.with_suffix(".json").exists():
            saved = json.loads(cache.with_suffix(".json").read_text())
            return subprocess.CompletedProcess(saved["args"], saved["returncode"], saved["stdout"],
                                               saved["stderr"])
        marker = uuid.uuid4().hex
        result = subprocess.run(command_argv(command), cwd=REPO, env=lesson_env(marker), capture_output=True,
                                text=True, timeout=480)  # lab 11: ~105 s alone on 2 cores
        left = kill_leftovers(marker)
        assert not left, f"`{command}` left processes running: {left}"
        cache.with_suffix(".json").write_text(json.dumps(
            {"args": result.args, "returncode": result.returncode, "stdout": result.stdout,
             "stderr": result.stderr}))
        return result


@pytest.fixture
def lesson(request):
    """Runs lessons for a test, then checks that none of the processes they started is still alive."""
    marker = uuid.uuid4().hex

    class Runner:
        tag = marker

        def run(self, script, *args, **kw):
            return run_lesson(script, *args, marker=marker, **kw)

        def start(self, script, *args, **kw):
            return start_lesson(script, *args, marker=marker, **kw)

    yield Runner()
    left = kill_leftovers(marker)
    assert not left, f"processes left running after the test: {left}"


def last_line_matching(pattern, text):
    lines = [line for line in text.splitlines() if re.search(pattern, line)]
    assert lines, f"no line matching {pattern!r} in output:\n{text}"
    return lines[-1]


def number_after(label, line):
    """The float that follows `label` in a printed line, e.g. number_after('max |dw|', line)."""
    m = re.search(re.escape(label) + r"\s*:?\s*([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)", line)
    assert m, f"no number after {label!r} in: {line}"
    return float(m.group(1))


def assert_clear_usage_error(result, message):
    """A refused choice: exit code 2 (argparse), the message on stderr, and no traceback."""
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def assert_help_in_process(parse_args, flags, capsys):
    """parse_args(["--help"]) (a lab's parser) exits 0 and its text names every flag; in-process, so
    no interpreter has to start. Returns the help text."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    shown = capsys.readouterr().out
    missing = [flag for flag in flags if flag not in shown]
    assert not missing, f"--help does not mention {missing}"
    return shown


def assert_refused_in_process(function, argv, capsys, message):
    """function(argv) (a lab's parse_args or main) refuses: SystemExit 2, the message on stderr, no
    traceback; in-process, so no interpreter has to start. Returns stderr."""
    with pytest.raises(SystemExit) as refused:
        function(argv)
    assert refused.value.code == 2
    stderr = capsys.readouterr().err
    assert message in stderr and "Traceback" not in stderr
    return stderr


def assert_crashed_rank_stops_the_run(lesson, script, *args, rank=1, within=90):
    """`--crash-rank RANK --timeout 300`: the run must stop long before the 300 s timeout (spawn stops the waiting
    ranks), exit 1, say RUN FAILED, show that rank's own error and print no proof. Returns the result.
    within: about 12 s on a quiet machine, 37 s seen under another session's load; 90 for one 3 times slower."""
    start = time.monotonic()
    result = lesson.run(script, *args, "--crash-rank", rank, "--timeout", 300)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-2000:]
    assert "RUN FAILED" in result.stderr
    assert f"RuntimeError: rank {rank} crashed on purpose (--crash-rank)" in result.stderr, result.stderr[-2000:]
    assert "PROOF" not in result.stdout
    assert elapsed < within, f"took {elapsed:.0f} s: the surviving ranks waited instead of being stopped"
    return result


def assert_help_lists(result, flags):
    assert result.returncode == 0, result.stderr
    missing = [flag for flag in flags if flag not in result.stdout]
    assert not missing, f"--help does not list {missing}"
