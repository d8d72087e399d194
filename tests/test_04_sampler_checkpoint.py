"""Lesson 04: the lab (prove.py) as a user runs it, the checkpoint functions in this process, and
the lesson script copied alone into an empty folder.

In-process: find_checkpoint on real, then damaged, files; checkpoint() in a world-of-one gloo
group; the lab's argument checks. Launches: the default lab run (shared with the README test),
the three --break runs (one shared with the README, two at once), --crash-rank, --help, one bad
input, and the lesson alone three times."""
import contextlib
import datetime
import hashlib
import io
import os
import re
import shutil
import signal
import sys
import types

import pytest
import torch
import torch.distributed as dist

import course
from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process, assert_refused_in_process,
                      last_line_matching, load_script, number_after, run_readme_command)

LAB, SCRIPT = "04_sampler_checkpoint/prove.py", "04_sampler_checkpoint/sampler_checkpoint.py"
pytestmark = pytest.mark.timeout(180)
CONFIG = {"world_size": 1, "batch_size": 16, "lr": 0.05}


sampler_checkpoint = load_script(SCRIPT, "sampler_checkpoint")


@pytest.fixture
def world_of_one():
    """A gloo group of one rank in this process: checkpoint()'s collectives run for real."""
    port = course.find_free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def write_checkpoints(folder, steps):
    """checkpoint() as train() calls it, at each of `steps`; returns the files, oldest first."""
    torch.manual_seed(0)
    model = types.SimpleNamespace(module=torch.nn.Linear(4, 2))  # checkpoint() saves model.module
    optimizer = torch.optim.SGD(model.module.parameters(), lr=0.05, momentum=0.9)
    for step in steps:
        model.module.weight.data += 1  # each checkpoint holds other bytes
        with contextlib.redirect_stdout(io.StringIO()):
            sampler_checkpoint.checkpoint(str(folder), model, optimizer, step, CONFIG, torch.device("cpu"))
    return sorted(folder.glob("step*.pt"))


@pytest.fixture
def two_checkpoints(tmp_path, world_of_one):
    return write_checkpoints(tmp_path, [5, 10, 15])


def test_checkpoint_names_each_file_by_its_sha256_and_keeps_the_two_newest(two_checkpoints, tmp_path):
    assert [p.name[:11] for p in two_checkpoints] == ["step0000010", "step0000015"]
    for path in two_checkpoints:
        assert path.name[12:28] == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        state = torch.load(path, weights_only=True)
        assert sorted(state) == ["config", "model", "optimizer", "rng", "step"]
        assert list(state["model"]) == ["weight", "bias"], "model.module.state_dict(): no module. prefix"
    assert sorted(os.listdir(tmp_path)) == [p.name for p in two_checkpoints], "no .tmp file left"


def test_a_run_resumed_past_a_damaged_file_replaces_it_and_keeps_the_one_before(two_checkpoints, tmp_path):
    older, newest = two_checkpoints
    newest.write_bytes(newest.read_bytes()[:1000])  # damaged: the run resumes from `older`...
    rewritten = write_checkpoints(tmp_path, [15])  # ...and saves step 15 again, under another name
    assert newest not in rewritten, "two saves of one state differ (torch.save's serialization_id)"
    assert [p.name[:11] for p in rewritten] == ["step0000010", "step0000015"] and older in rewritten
    assert sampler_checkpoint.find_checkpoint(str(tmp_path), CONFIG) == str(rewritten[-1])


def test_find_checkpoint_returns_the_newest_good_file(two_checkpoints, tmp_path):
    assert sampler_checkpoint.find_checkpoint(str(tmp_path), CONFIG) == str(two_checkpoints[-1])
    assert sampler_checkpoint.find_checkpoint(str(tmp_path / "empty"), CONFIG) is None


@pytest.mark.parametrize("damage", ["zeroed", "truncated"])
def test_a_damaged_newest_file_is_named_and_the_previous_one_is_used(two_checkpoints, tmp_path, capsys,
                                                                      damage):
    older, newest = two_checkpoints
    data = newest.read_bytes()
    half = len(data) // 2
    newest.write_bytes(data[:half] + bytes(50) + data[half + 50:] if damage == "zeroed" else data[:half])
    assert sampler_checkpoint.find_checkpoint(str(tmp_path), CONFIG) == str(older)
    assert f"WARNING: {newest} is damaged; using {older}" in capsys.readouterr().err


def test_every_file_damaged_or_another_config_stops_and_changes_nothing(two_checkpoints, tmp_path):
    older, newest = two_checkpoints
    good = older.read_bytes()
    with pytest.raises(SystemExit, match="belongs to another run") as refused:
        sampler_checkpoint.find_checkpoint(str(tmp_path), dict(CONFIG, lr=0.1))
    assert str(newest) in str(refused.value) and "\n" not in str(refused.value)
    truncated = newest.read_bytes()[:1000]
    newest.write_bytes(truncated)
    older.write_bytes(good[:-1] + b"x")
    with pytest.raises(SystemExit, match="every checkpoint in .* is damaged") as refused:
        sampler_checkpoint.find_checkpoint(str(tmp_path), CONFIG)
    assert str(older) in str(refused.value) and str(newest) in str(refused.value)
    assert older.read_bytes() == good[:-1] + b"x"  # looked at, never rewritten
    assert newest.read_bytes() == truncated


def test_the_labs_guard_rails_refuse_before_any_rank_starts(capsys):
    prove = load_script(LAB, "prove04")
    for argv, message in [(["--epochs", "1"], "leave no checkpoint"), (["--world-size", "0"], "must be positive"),
                          (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1")]:
        with pytest.raises(SystemExit) as refused:
            prove.parse_args(argv)
        assert refused.value.code == 2 and message in capsys.readouterr().err
    assert prove.kill_schedule(2, 2) == (10, 12), "the default: resume from 10 of 16, mid-epoch 2"
    assert prove.kill_schedule(1, 2) == (20, 22)


def test_the_default_lab_run_kills_a_rank_resumes_it_and_passes():
    result = run_readme_command(f"python {LAB}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", "a passing run prints nothing on stderr (the planned kill included)"
    assert "rank 1 killed after step 12 with signal SIGKILL" in result.stdout
    assert "left checkpoints of steps 5, 10" in result.stdout
    assert "chose the checkpoint of step 10" in result.stdout and "trained steps 11-16" in result.stdout
    line = last_line_matching(r"^PROOF", result.stdout)
    assert line.startswith("PROOF PASSED") and "counted 101 of 101 samples" in line
    assert number_after("max |dloss|", line) == 0.0 and number_after("max |dw|", line) == 0.0
    assert "evaluated after steps 8, 16" in result.stdout, "the evaluation must lie between checkpoints"


CAUSES = {"no-rng-restore": "LIKELY CAUSE: the resumed ranks do not restore their RNG state",
          "loader-global-rng": "LIKELY CAUSE: the RNG state was restored, then drawn from before "
                               "the first resumed step",
          "padded-eval": "LIKELY CAUSE: the evaluation counts 102 samples, not the 101 held out",
          "rank0-rng-only": "LIKELY CAUSE: every resumed rank restores rank 0's RNG state"}


@pytest.mark.timeout(400)
def test_every_break_fails_the_proof_and_names_its_cause(lesson):
    others = {name: lesson.start(LAB, "--break", name)
              for name in ("loader-global-rng", "padded-eval", "rank0-rng-only")}
    results = {name: run.communicate(timeout=360) + (run.returncode,) for name, run in others.items()}
    shared = run_readme_command(f"python {LAB} --break no-rng-restore")
    results["no-rng-restore"] = (shared.stdout, shared.stderr, shared.returncode)
    for name, (stdout, stderr, code) in results.items():
        assert code == 1, f"--break {name}: exit {code}\n{stderr[-2000:]}"
        line = last_line_matching(r"^PROOF", stdout)
        assert line.startswith("PROOF FAILED"), f"--break {name}: {line}"
        if name == "padded-eval":  # training is exact; only the count is wrong
            assert "counted 102 of 101" in line and number_after("max |dw|", line) == 0.0
        else:
            assert number_after("max |dw|", line) > 1e-4, f"--break {name}: {line}"
        assert stdout.splitlines()[-1].startswith(CAUSES[name]), stdout[-1500:]


# A learner's mistakes that used to pass (a checkpoint written in place) or hang for minutes (a
# barrier on rank 0 only: 69 s and gloo's text), each made in the lesson and given to the lab.
MISTAKES = {
    "in_place": ([('with open(path + ".tmp", "wb") as f:', 'with open(path, "wb") as f:'),
                  ('        os.replace(path + ".tmp", path)\n', "")],
                 r"^LIKELY CAUSE: checkpoints are written in place under their final name \(step"),
    "epoch_off": ([("range(step // len(loader), epochs)",
                    "range(max(0, step // len(loader) - 1), epochs)")],
                  r"^LIKELY CAUSE: the resume reads other samples than the uninterrupted run, "
                  r"from step 11 \(rank 0\)"),
    "barrier_on_rank_0": ([('        print(f"saved {path}", flush=True)\n    dist.barrier()',
                            '        print(f"saved {path}", flush=True)\n        dist.barrier()')],
                          r"^LIKELY CAUSE: the ranks wait in different collectives \(rank 0: "
                          r"barrier\(\), rank 1: backward\(\)"),
}


@pytest.mark.timeout(480)
def test_a_learners_mistake_is_named_in_one_line_and_a_hang_in_seconds(lesson, tmp_path):
    text = (REPO / SCRIPT).read_text()
    started = {}
    for name, (edits, _) in MISTAKES.items():
        mine = text
        for old, new in edits:
            assert mine.count(old) == 1, old
            mine = mine.replace(old, new)
        (tmp_path / f"my_{name}.py").write_text(mine)
        started[name] = lesson.start(LAB, "--lesson", tmp_path / f"my_{name}.py")
    outputs = {}
    for name, run in started.items():
        outputs[name] = stdout, stderr = run.communicate(timeout=450)
        assert run.returncode == 1, (name, stdout[-1500:], stderr[-1500:])
        last = (stderr if name == "barrier_on_rank_0" else stdout).strip().splitlines()[-1]
        assert re.search(MISTAKES[name][1], last), (name, last)
    hang = [line for line in outputs["barrier_on_rank_0"][1].splitlines()
            if line.startswith("RUN FAILED")]
    assert re.search(r"the run hung: no rank used the CPU for 10 s, and was stopped; rank 0 "
                     r"waits in barrier\(\) at my_barrier_on_rank_0.py line \d+ \(checkpoint\); "
                     r"rank 1 waits in backward\(\)", hang[0]), hang


def test_a_crashed_rank_stops_the_whole_run_quickly_with_the_real_error(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


def test_help_lists_every_flag_and_bad_input_is_one_line(capsys):
    """In-process: the lab's own parser (a subprocess would only add an interpreter's start-up)."""
    prove = load_script(LAB, "prove04")
    assert_help_in_process(prove.parse_args, ["--world-size", "--epochs", "--device", "--break", "--crash-rank",
                                              "--timeout", "no-rng-restore", "loader-global-rng", "padded-eval",
                                              "rank0-rng-only"], capsys)
    assert_refused_in_process(prove.parse_args, ["--break", "nothing"], capsys, "invalid choice: 'nothing'")


def test_the_lesson_alone_trains_resumes_nothing_and_refuses_another_run(lesson, tmp_path):
    shutil.copy(REPO / SCRIPT, tmp_path)
    script, folder = tmp_path / "sampler_checkpoint.py", tmp_path / "ckpt"
    first = lesson.run(script, "--world-size", 1, "--epochs", 1, "--ckpt-dir", "ckpt", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    files = sorted(folder.glob("step*.pt"))
    assert [p.name[:11] for p in files] == ["step0000015", "step0000016"]
    saved = {p: p.read_bytes() for p in files}
    # Both only read the folder (nothing is left to train; the other is refused), so they run at once.
    runs = [lesson.start(script, "--world-size", 1, "--epochs", 1, "--ckpt-dir", "ckpt", *more, cwd=tmp_path)
            for more in ([], ["--lr", 0.1])]
    (again, again_err), (_, refused_err) = (run.communicate(timeout=120) for run in runs)
    assert runs[0].returncode == 0, again_err[-3000:]
    assert "trained 0 steps after step 16" in again
    assert runs[1].returncode != 0 and "belongs to another run" in refused_err
    assert len(refused_err.strip().splitlines()) == 1 and "Traceback" not in refused_err
    assert {p: p.read_bytes() for p in sorted(folder.glob("step*.pt"))} == saved


# --- other platforms: nothing here runs macOS or Windows, so these check the lab's choices in-process

def test_the_kill_is_sigkill_and_terminateprocess_where_there_is_no_sigkill(monkeypatch):
    """Windows has no signal.SIGKILL; there os.kill(pid, SIGTERM) is TerminateProcess, as immediate
    (exit code 15). The proof line says which."""
    prove = load_script(LAB, "prove04")
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))  # nothing is killed
    prove.kill_self()
    assert sent == [(os.getpid(), signal.SIGKILL)] and course.hard_killed() == "SIGKILLed"
    monkeypatch.delattr(signal, "SIGKILL")  # as on Windows
    prove.kill_self()
    assert sent[-1] == (os.getpid(), signal.SIGTERM)
    assert course.hard_killed() == "killed by TerminateProcess"


@pytest.mark.parametrize("platform, method", [("linux", "forkserver"), ("darwin", "spawn"), ("win32", "spawn")])
def test_ranks_are_forked_from_a_forkserver_on_linux_only(monkeypatch, platform, method):
    """Windows has no fork; on macOS Python calls fork unsafe and starts with spawn."""
    monkeypatch.setattr(sys, "platform", platform)
    assert course.start_method() == method
    monkeypatch.undo()
    here = "forkserver" if sys.platform.startswith("linux") else "spawn"
    assert load_script(LAB, "prove04").START == course.START_METHOD == here


def test_the_lab_reads_steps_from_the_lessons_names_and_refuses_others_in_one_line(tmp_path, capsys):
    """A learner's checkpoint() that names files step16-<hash>.pt (not zero-padded, so they do not
    sort by step) gets one line from the lab, not int()'s traceback."""
    prove = load_script(LAB, "prove04")
    for name in ("step0000005-0123456789abcdef.pt", "step0000010-52213e6d78397421.pt"):
        (tmp_path / name).write_bytes(b"")
    assert prove.steps_in(str(tmp_path)) == [5, 10]
    (tmp_path / "step16-2e9d0123456789ab.pt").write_bytes(b"")
    assert_refused_in_process(prove.steps_in, str(tmp_path), capsys,
                              "checkpoint step16-2e9d0123456789ab.pt is not named step<7-digit step>")
