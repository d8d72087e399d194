"""The labs' shared diagnosis (issue 31), in this process: the cause line, a learner's error in
one line instead of a traceback in the lab, a hang's stacks read, and the data-parallel rules on
traces whose mistake is known. The labs' own runs (tests/test_0N_*.py) hold each break to its line."""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO))
import course  # noqa: E402


@pytest.fixture
def learner(tmp_path, monkeypatch):
    """A learner's file, graded as --lesson does (COURSE_LESSON names it)."""
    path = tmp_path / "my_lesson.py"
    path.write_text("def train(batches):\n    return sum(batches) / len(batches)\n")
    monkeypatch.setenv("COURSE_LESSON", str(path))
    return course.load_lesson_file(str(path), "my_lesson", ("train",), "lesson.py", register=False)


def test_an_error_in_the_learners_code_is_one_line_naming_their_line(learner, capsys):
    def main(argv):
        return learner.train([])  # ZeroDivisionError inside the learner's file
    assert course.run_lab(main) == 1
    assert capsys.readouterr().err == (
        "LIKELY CAUSE: your file raised ZeroDivisionError: division by zero (my_lesson.py line 2, "
        "in train): fix it there\n")


def test_an_answer_the_lab_cannot_use_is_one_line_naming_the_lab_step(learner, capsys):
    def main(argv):
        loss, count = learner.train([1.0, 2.0])  # a float where the lab wants two values
        return 0
    assert course.run_lab(main) == 1
    err = capsys.readouterr().err
    assert err.startswith("LIKELY CAUSE: the lab could not use what your file's functions "
                          "returned: TypeError: cannot unpack") and "(in the lab's main)" in err


def test_the_courses_own_lesson_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv("COURSE_LESSON", raising=False)
    with pytest.raises(ZeroDivisionError):
        course.run_lab(lambda argv: 1 / 0)


def test_a_failed_ranks_traceback_names_the_learners_line(learner):
    text = textwrap.dedent(f"""
        -- Process 1 terminated with the following error:
        Traceback (most recent call last):
          File "{course.__file__}", line 10, in as_a_fresh_process
            return fn(rank, *args)
          File "{learner.__file__}", line 2, in train
            return sum(batches) / len(batches)
        ZeroDivisionError: division by zero
        """)
    assert course.cause_of_rank_error(text) == (
        "rank 1 raised ZeroDivisionError: division by zero in your file (my_lesson.py line 2, in "
        "train): fix it there")
    assert course.cause_of_rank_error(text.replace("division by zero", "rank 1 crashed on "
                                                   "purpose (--crash-rank)")) is None


def test_where_a_rank_waits_is_read_from_its_stacks(learner):
    torch_c10d = os.path.join(course.TORCH_DIR, "distributed", "distributed_c10d.py")
    stacks = textwrap.dedent(f"""
        Thread 0x00007f01 (most recent call first):
          File "/usr/lib/python3.11/threading.py", line 320 in wait

        Current thread 0x00007f00 (most recent call first):
          File "{torch_c10d}", line 4700 in _barrier_inner
          File "{torch_c10d}", line 4750 in barrier
          File "{learner.__file__}", line 2 in train
          File "{course.__file__}", line 10 in as_a_fresh_process
        """)
    assert course.where_it_waits(stacks) == ("barrier()", "my_lesson.py line 2 (train)")


def test_a_hang_is_every_process_idle_and_a_slow_run_is_not(tmp_path):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # past the interpreters' start
        for pids, expected in (({0: idle.pid, 1: busy.pid}, False), ({0: idle.pid}, True)):
            watch, deadline = course.HangWatch(str(tmp_path), stall=1.5), time.monotonic() + 6
            while not watch.stalled(pids) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert watch.stalled(pids) == expected, pids
    finally:
        busy.kill(), idle.kill()


def trace(indices, weights):
    return {"indices": indices, "weights": torch.tensor(weights, dtype=torch.float64)}


LINES = {k: "lesson.py line 1" for k in ("sampler", "set_epoch", "ddp", "loss", "data", "model")}
EXPECTED = [[[0, 1], [2, 3], [2, 0], [1, 3]], [[4, 5], [6, 7], [6, 4], [5, 7]]]  # 2 epochs of 2
REFERENCE = trace([[0, 1, 4, 5], [2, 3, 6, 7], [2, 0, 6, 4], [1, 3, 5, 7]],
                  [[0.0], [1.0], [2.0], [3.0], [4.0]])


@pytest.mark.parametrize("ranks, cause", [
    ([trace([[0, 1], [2, 3], [0, 1], [2, 3]], [[0.0], [1.0], [2.0], [3.0], [5.0]]),
      trace([[4, 5], [6, 7], [4, 5], [6, 7]], [[0.0], [1.0], [2.0], [3.0], [5.0]])],
     "the sampler is not told the epoch (set_epoch)"),
    ([trace([[0, 1], [2, 3]], [[0.0], [1.5], [3.0]]),
      trace([[0, 1], [2, 3]], [[0.0], [1.5], [3.0]])], "every rank reads the same samples"),
    ([trace([[0, 1], [2, 6]], [[0.0], [1.5], [3.0]]),
      trace([[4, 1], [6, 7]], [[0.0], [1.5], [3.0]])], "the ranks' samplers shuffle differently"),
    ([trace(EXPECTED[0], [[0.0], [2.0], [4.0]]), trace(EXPECTED[1], [[0.0], [2.0], [4.0]])],
     "the gradient is 2 times too large: the first update is 2.00 times one process's"),
    ([trace(EXPECTED[0], [[0.0], [1.0], [2.5]]), trace(EXPECTED[1], [[0.0], [1.0], [2.6]])],
     "the gradients are not averaged across ranks: each rank read its right samples, but the "
     "ranks part at step 2"),
    ([trace(EXPECTED[0], [[0.0], [1.0], [2.5]]), trace(EXPECTED[1], [[0.0], [1.0], [2.5]])],
     "cause unknown: the ranks agree; they leave one process at step 2, first in w"),
])
def test_the_data_parallel_rules_name_each_known_mistake(ranks, cause, capsys):
    line = course.data_parallel_cause(ranks, REFERENCE, EXPECTED, 2, LINES, 1e-5, [("w", 1)])
    assert cause in line and capsys.readouterr().out == line + "\n", line


def test_a_lab_ends_at_its_last_line_with_its_atexit_handlers_run(tmp_path):
    """course.exit_now: without it, the lab and the forkserver that started its ranks (which holds
    the lab's stdout) each spent 2 to 4 s on torch's teardown after the last line, in every lab
    run; a reader of the output waited for both. The atexit handlers still run."""
    script, marker = tmp_path / "lab.py", tmp_path / "atexit.txt"
    script.write_text(textwrap.dedent(f"""\
        import atexit, sys, time
        sys.path.insert(0, {str(REPO)!r})
        import course

        def rank(r):
            print(f"rank {{r}}", flush=True)

        if __name__ == "__main__":
            atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
            course.spawn_or_fail(rank, (), 2)
            print(f"last line at {{time.time()}}", flush=True)
            course.exit_now(3)
        """))
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    lab = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                           env=env)
    out, _ = lab.communicate(timeout=120)  # returns at the end of the output: every holder gone
    after = time.time() - float(re.search(r"^last line at (\S+)$", out, re.M)[1])
    assert lab.returncode == 3 and sorted(out.split("\n")[:2]) == ["rank 0", "rank 1"], out
    assert marker.read_text() == "ran"
    assert after < 1.5, f"the output ended {after:.1f} s after the last line (teardown: 2 to 4 s)"
