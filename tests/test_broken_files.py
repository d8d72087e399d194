"""Issue 31: every lab, given a broken file of a learner's, ends with its own one-line sentence,
never a traceback in prove.py or course.py. Three broken files per lab, each made from the
lesson by a plain edit, as a learner's slip would:
- a function the lab calls is missing: one line, exit 2, before any rank starts;
- the learner's code raises (1 / 0 in a function the lab calls): `LIKELY CAUSE: ... raised
  ZeroDivisionError ... (my_lesson.py line N ...)`, naming their line;
- a collective only rank 0 calls (a barrier before a function every rank runs): the lab ends
  the hang within seconds and names where each rank waits.
Hangs use COURSE_STALL_SECONDS=4 (the labs' default, 10 s, is what a learner meets)."""
import re
import sys
import time
import uuid

import pytest

from conftest import REPO, kill_leftovers, load_script, run_lesson

# lab: (the lesson's file, a function the lab needs, the function that raises, the function
# rank 0 runs a barrier before, or None where no rank waits for another: one process, or RPC)
PLANTS = {
    "00_single_process": ("single_process.py", "make_model", "make_model", None),
    "01_dataparallel": ("dataparallel.py", "replicate", "make_model", None),
    "02_ddp_spawn": ("ddp_spawn.py", "worker", "make_model", "train"),
    "03_model_parallel": ("model_parallel.py", "train_pipeline", "make_model", "make_dataset"),
    "04_sampler_checkpoint": ("sampler_checkpoint.py", "evaluate", "make_model", "train"),
    "05_torchrun_elastic": ("torchrun_elastic.py", "find_checkpoint", "train", "train"),
    "06_collectives": ("collectives.py", "ring_step", "average_gradients", "average_gradients"),
    "07_fsdp_dcp": ("fsdp_dcp.py", "save_checkpoint", "make_model", "train"),
    "08_rpc": ("rpc.py", "worker", "make_model", None),
    "09_training_loop": ("training_loop.py", "train_step", "make_model", "train_step"),
    "10_tensor_parallel": ("tensor_parallel.py", "parallelize", "make_model", "train"),
    "11_train_gpt": ("train_gpt.py", "micro_batches", "make_model", "evaluate"),
    "12_debugging": ("debugging.py", "trace_step", "make_model", "train"),
    # replica groups of one rank each: no rank waits in a collective a peer skips (torchft's
    # quorum and its timeouts stand between replicas)
    "14_fault_tolerance": ("fault_tolerance.py", "newest_complete", "make_model", None),
}

CRASH = '''

@__import__("functools").wraps({name})  # the same signature, which a lab may read
def {name}(*args, **kwargs):  # planted: the learner's code raises
    return 1 / 0
'''

HANG = '''

_planted_{name} = {name}


@__import__("functools").wraps({name})  # the same signature, which a lab may read
def {name}(*args, **kwargs):  # planted: a collective only rank 0 calls
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() == 0:  # in the ranks, not the lab's reference
        dist.barrier()
    return _planted_{name}(*args, **kwargs)
'''


def broken_copy(tmp_path, lab, edit):
    """The lesson copied to tmp_path/my_lesson.py (the capstone: with its model.py and
    checkpoint.py beside it), then edited."""
    name, missing, raises, waits = PLANTS[lab]
    folder = tmp_path / "mine"
    folder.mkdir()
    for sibling in ("model.py", "checkpoint.py") if lab == "11_train_gpt" else ():
        (folder / sibling).write_text((REPO / lab / sibling).read_text())
    text = (REPO / lab / name).read_text()
    if edit == "missing":
        assert text.count(f"\ndef {missing}(") == 1
        text = text.replace(f"\ndef {missing}(", f"\ndef {missing}_renamed(")
    else:
        text += (CRASH if edit == "crash" else HANG).format(name=raises if edit == "crash"
                                                               else waits)
    (folder / "my_lesson.py").write_text(text)
    return folder / "my_lesson.py"


def run_lab(lab, path, timeout=180):
    marker = uuid.uuid4().hex
    start = time.monotonic()
    result = run_lesson(f"{lab}/prove.py", "--lesson", path, timeout=timeout, marker=marker)
    assert not kill_leftovers(marker), "the lab left processes running"
    out = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    for text in (result.stdout, result.stderr):  # no traceback ending in the lab or the harness
        frames = re.findall(r'File "([^"]+)", line \d+', text)
        assert not frames or not re.search(r"(prove|course)\.py$", frames[-1]), text[-2000:]
    return result, out, time.monotonic() - start


def last_line(result):
    """The last line of stderr if the failure was told there, else of stdout."""
    err = [line for line in result.stderr.splitlines() if line.strip()]
    out = [line for line in result.stdout.splitlines() if line.strip()]
    return (err or out)[-1] if err and (err[-1].startswith(("LIKELY CAUSE", "cause unknown"))
                                        or not out) else out[-1]


@pytest.mark.parametrize("lab", sorted(PLANTS))
def test_a_missing_function_is_one_line_before_any_rank_starts(lab, tmp_path, monkeypatch,
                                                                capsys):
    """In this process (no rank starts before the check): the lab imported with --lesson, as
    `python NN/prove.py --lesson my_lesson.py` imports it."""
    path = broken_copy(tmp_path, lab, "missing")
    monkeypatch.setenv("COURSE_LESSON", "")  # import_lesson sets it: restored after the test
    for name in (PLANTS[lab][0][:-3], "model", "checkpoint"):  # the broken file registers as the
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))  # lesson's module: undone
        if sys.modules[name] is None:  # after the test, so the next test here imports the real one
            del sys.modules[name]
    monkeypatch.setattr(sys, "argv", [f"{lab}/prove.py", "--lesson", str(path)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as stopped:
        lab_module = load_script(f"{lab}/prove.py")
        lab_module.main(["--lesson", str(path)])  # the capstone's lab imports the file in main
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1, err
    assert f"has no {PLANTS[lab][1]}" in err, err


@pytest.mark.parametrize("lab", sorted(PLANTS))
def test_a_crash_in_the_learners_code_names_their_line(lab, tmp_path):
    path = broken_copy(tmp_path, lab, "crash")
    result, out, seconds = run_lab(lab, path)
    line = last_line(result)
    assert result.returncode not in (0, 2), result.stdout[-1500:] + result.stderr[-1500:]
    number = len(path.read_text().splitlines())  # the planted `return 1 / 0`, the file's last
    assert re.match(r"LIKELY CAUSE: .*ZeroDivisionError.*my_lesson\.py line " + str(number),
                    line), line
    print(f"{lab} crash: {seconds:.1f} s: {line[:160]}")


@pytest.mark.parametrize("lab", sorted(lab for lab, plant in PLANTS.items() if plant[3]))
def test_a_collective_only_rank_0_calls_ends_within_seconds_naming_the_wait(lab, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("COURSE_STALL_SECONDS", "4")
    result, out, seconds = run_lab(lab, broken_copy(tmp_path, lab, "hang"))
    line = last_line(result)
    assert result.returncode == 1, result.stdout[-1500:] + result.stderr[-1500:]
    assert "the run hung: no rank used the CPU for 4 s" in result.stdout + result.stderr, out[-5:]
    assert "rank 0 waits in barrier() at my_lesson.py line" in result.stdout + result.stderr, \
        out[-5:]
    assert line.startswith("LIKELY CAUSE: "), line
    print(f"{lab} hang: {seconds:.1f} s: {line[:160]}")
