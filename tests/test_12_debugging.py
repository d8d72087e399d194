"""Lesson 12 and its lab: three planted hangs named (the missing rank, the collective and its
sequence number, each rank's line) within 30 s, and three planted bugs located layer by layer,
the correct run nowhere.

Command-line runs are what a user sees (the lab's proof, a --break, a crashed rank, the lesson
copied alone); the lab's pieces (the flight recorder's reading, torchfrtrace's workaround, the
stack tools) are tested in-process on a world-of-one group and on small processes that wait."""
import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process,
                      assert_refused_in_process, last_line_matching, load_script,
                      run_readme_command)

LAB = "12_debugging/prove.py"
LESSON = "12_debugging/debugging.py"
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


def line_of(text):
    """debugging.py's line number of the first line holding `text`."""
    lines = (REPO / LESSON).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_the_default_run_names_every_hang_and_locates_every_bug():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert last_line_matching(r"^PROOF ", out).startswith("PROOF PASSED")
    backward, barrier = line_of("loss.backward()"), line_of("dist.monitored_barrier(")
    blocks = {m[1]: m[2] for m in re.finditer(r"^  (skip|rank0-only|shape): hung (.*?)(?=^  \S|^on )",
                                                out, re.M | re.S)}
    assert sorted(blocks) == ["rank0-only", "shape", "skip"]
    for plant, block in blocks.items():
        hung = float(block.split()[0])
        assert hung <= 30, f"{plant}: hung {hung} s"
        seq = int(re.search(r"flight recorder: #(\d+) all_reduce", block)[1])
        assert f"(torchfrtrace: #{seq})" in block, "the patched analyser names the same collective"
        assert f"rank 1 waits in monitored_barrier() at debugging.py line {barrier}" in block
        assert "monitored_barrier: RuntimeError: Rank 1 successfully reached monitoredBarrier" in block
    assert "rank(s) [1] never called it; rank 0: all_reduce [[1732]] at debugging.py line " \
           f"{backward}" in blocks["skip"], "1732: the model's parameters, DDP's one bucket"
    assert f"rank 0 waits in backward() (where DDP all-reduces the gradients) at debugging.py " \
           f"line {backward}" in blocks["skip"]
    assert "rank(s) [1] never called it; rank 0: all_reduce [[1]]" in blocks["rank0-only"]
    assert "sizes differ; rank 0: all_reduce [[4]]" in blocks["shape"] and \
           "rank 1: all_reduce [[3]]" in blocks["shape"]
    seqs = {p: int(re.search(r"#(\d+)", b)[1]) for p, b in blocks.items()}
    assert seqs["rank0-only"] == seqs["shape"] == seqs["skip"] + 1, \
        "skip hangs in the last step's all-reduce; the others in one more collective after it"
    found = dict(re.findall(r"^  (\S+-float(?:32|64)) +(rank 0: .*?) +largest gap", out, re.M))
    assert found == {
        "correct-float32": "rank 0: nothing, rank 1: nothing",
        "correct-float64": "rank 0: nothing, rank 1: nothing",
        "no-average-float32": "rank 0: gradient of 3.bias, rank 1: gradient of 3.bias",
        "no-average-float64": "rank 0: gradient of 3.bias, rank 1: gradient of 3.bias",
        "norm-not-reduced-float32": "rank 0: gradient of 1.bias, rank 1: gradient of 1.bias",
        "norm-not-reduced-float64": "rank 0: gradient of 1.bias, rank 1: gradient of 1.bias",
        "sampler-float32": "rank 0: gradient of 3.bias, rank 1: input",
        "sampler-float64": "rank 0: gradient of 3.bias, rank 1: input"}
    noise = re.search(r"noise: (\S+) in float32, (\S+) in float64", out)
    assert 0 < float(noise[2]) < 1e-6 * float(noise[1]) < 1e-12


def test_the_float32_tolerance_break_names_a_correct_run_and_fails():
    result = run_readme_command(f"python {LAB} --break float32-tolerance")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"^  correct-float32 +rank 0: (output|input|gradient)", result.stdout, re.M)
    assert "three hangs" not in result.stdout, "a --break runs the part it breaks"
    assert result.stdout.splitlines()[-1].startswith(
        "LIKELY CAUSE: a correct run is named apart: its tolerance is not float64's")


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone ------------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs_and_writes_its_files(lesson, tmp_path):
    """One rank (the lab runs the worker at two): the comparison with one process, the stacks'
    file; no flight recorder, since nothing raised."""
    shutil.copy(REPO / LESSON, tmp_path / "debugging.py")
    result = lesson.run(tmp_path / "debugging.py", "--world-size", 1, "--timeout", 20,
                        cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0, step 1: every layer within float64's tolerance of one process (float32)" \
        in result.stdout
    assert sorted(os.listdir(tmp_path / "debug")) == ["stack-rank0.txt", "trace-rank0.pt"]


# --- the pieces, in-process ------------------------------------------------------------------------

@pytest.fixture
def group(prove):
    """A world-of-one gloo group in this process (the flight recorder records its collectives)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{prove.course.find_free_port()}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def two_ranks_of_dumps(prove, folder, drop_last=True, resize_last=False):
    """fr-rank0 from this process's flight recorder after three all-reduces (the lesson's dump),
    and fr-rank1 made from it: its last entry dropped (a rank that skipped it) or resized."""
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    prove.lesson.dump_flight_recorder(str(folder), 0, "gloo")
    dump = pickle.loads((folder / "fr-rank0").read_bytes())
    assert [e["profiling_name"] for e in dump["entries"]][-3:] == ["gloo:all_reduce"] * 3
    # the recorder is one buffer per process: the groups of tests run earlier in this process (a
    # pytest worker's) are in it too, and their sequence numbers start at 1 again: keep this one's
    dump["entries"] = dump["entries"][-3:]
    for config in dump["pg_config"].values():  # a group of two ranks, as the lab's pairs
        config["ranks"] = "[0, 1]"
    (folder / "fr-rank0").write_bytes(pickle.dumps(dump))
    if resize_last:
        dump["entries"][-1]["input_sizes"] = [[3]]
    elif drop_last:
        dump["entries"] = dump["entries"][:-1]
    (folder / "fr-rank1").write_bytes(pickle.dumps(dump))
    return dump["entries"][-1]["collective_seq_id"] + (1 if drop_last and not resize_last else 0)


def test_the_flight_recorder_names_the_missing_rank_and_torchfrtrace_needs_the_workaround(
        prove, group, tmp_path):
    seq = two_ranks_of_dumps(prove, tmp_path)
    found, calls, missing = prove.first_mismatch(prove.read_dumps(str(tmp_path)))
    assert (found, missing, calls[0][:2]) == (seq, {1}, ("all_reduce", [[4]]))
    assert calls[0][2].startswith("test_12_debugging.py line "), "the caller's line, not torch's"
    seqs, lines, error = prove.analyse(str(tmp_path), None)
    assert error is None and seqs == [seq] and "missing ranks: {1}" in lines
    seqs, lines, error = prove.analyse(str(tmp_path), "analyser-unpatched")  # gloo's '' key
    assert seqs == [] and error == "KeyError: ('0', 0)"


def test_a_mismatched_size_is_named_without_a_missing_rank(prove, group, tmp_path):
    seq = two_ranks_of_dumps(prove, tmp_path, resize_last=True)
    found, calls, missing = prove.first_mismatch(prove.read_dumps(str(tmp_path)))
    assert (found, missing, calls[0][1], calls[1][1]) == (seq, set(), [[4]], [[3]])
    assert prove.analyse(str(tmp_path), None)[0] == [seq]


def test_without_stacks_no_line_is_named_and_the_hang_fails(prove, group, tmp_path):
    (tmp_path / "skip").mkdir()
    two_ranks_of_dumps(prove, tmp_path / "skip")
    run = {"seconds": 5.0, "ended": time.time(), "stacks": {}, "errors": {}}
    ok, named, where, wrong = prove.check_hang("skip", run, str(tmp_path), None)
    assert not ok and where == "no stacks"
    assert any("rank 0's line is unnamed" in w for w in wrong)
    assert prove.take_stacks({0: 1, 1: 2}, str(tmp_path), 0, "skip", "no-stack-dump") == {}


@pytest.fixture
def waiting(tmp_path, lesson):
    """A small Python process (no torch) that registers faulthandler on SIGUSR1, as the lesson's
    worker does, then waits in time.sleep: a stand-in for a hung rank."""
    code = ("import faulthandler, signal, time\n"
            f"faulthandler.register(signal.SIGUSR1, file=open({str(tmp_path / 'stack-rank0.txt')!r},"
            " 'w'), all_threads=True)\n"
            "open(__import__('sys').argv[1], 'w').close()\n"
            "def wait_here():\n    time.sleep(60)\nwait_here()\n")
    (tmp_path / "waits.py").write_text(code)
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, str(tmp_path / "waits.py"), str(ready)],
                               env=dict(os.environ, COURSE_TEST_PROCESS=lesson.tag))
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    yield process
    process.kill()
    process.wait()


def test_both_stack_tools_name_the_waiting_line(prove, waiting, tmp_path):
    course = prove.course
    by_signal = course.faulthandler_stacks({0: waiting.pid}, str(tmp_path))
    assert 'waits.py", line 5 in wait_here' in by_signal[0]
    if course.py_spy() is None:
        pytest.skip("py-spy is not installed (requirements.txt pins it): faulthandler checked")
    by_py_spy = course.py_spy_stacks({0: waiting.pid})
    assert 'waits.py", line 5 in wait_here' in by_py_spy[0], by_py_spy
    assert course.py_spy_stacks({0: 2 ** 22 + 7}) == {}, "a process py-spy cannot read: missing"


def test_the_lessons_trace_is_in_the_order_things_happen(prove):
    lesson = prove.lesson
    x, y = lesson.make_dataset()[:8]
    loss, trace = lesson.trace_step(lesson.make_model(), x, y)
    assert list(trace) == ["input", "output of 0", "output of 1", "output of 2", "output of 3",
                           "gradient of 3.bias", "gradient of 3.weight", "gradient of 1.bias",
                           "gradient of 1.weight", "gradient of 0.bias", "gradient of 0.weight"]
    assert trace["output of 3"].shape == (8, 4) and loss.dim() == 0


def test_traces_saved_on_a_gpu_are_read_onto_the_cpu(prove, tmp_path, monkeypatch):
    """On an H200 (NCCL, gpu_runs/2026-11-28-h200-torch2.11/) compare() raised 'Expected all
    tensors to be on the same device': a rank's trace loads back onto its GPU, one process's
    reference is on the CPU. Both readers (the lesson's compare, the lab's largest_gap) must map
    what they load to the CPU; a CPU run cannot show the failure, so the call is what is checked."""
    lesson, dataset, loads = prove.lesson, prove.lesson.make_dataset(), []
    for r, world in ((0, 1), (0, 2), (1, 2)):  # one process's traces, as a rank saves them
        rows = list(lesson.DistributedSampler(dataset, world, r, seed=0))[:16]
        trace = lesson.trace_step(lesson.make_model(), *dataset[rows])[1]
        os.makedirs(tmp_path / f"world{world}", exist_ok=True)
        torch.save(trace, tmp_path / f"world{world}" / f"trace-rank{r}.pt")
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: loads.append(kw) or real_load(*a, **kw))
    assert lesson.compare(str(tmp_path / "world1"), 1, 16, "float32") == [None]
    prove.largest_gap(str(tmp_path / "world2"), "float32")
    assert len(loads) == 3 and all(kw.get("map_location") == "cpu" for kw in loads), loads


# --- guard rails and help, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--timeout", "1"], "--timeout must be from 2 to 25 seconds"),
    (["--timeout", "26", "--part", "hangs"], "--timeout must be from 2 to 25 seconds"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
    (["--break", "ddp"], "invalid choice: 'ddp'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--part", "--timeout", "--break", "--crash-rank",
                                              "--lesson", *prove.BREAKS], capsys)
