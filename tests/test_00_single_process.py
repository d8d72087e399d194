"""Lesson 00 and its lab: two fresh processes running the lesson end with bit-identical weights.

Command-line runs are what a user sees (the lab's proof, a break, a refused input, the lesson
copied alone); the lesson's functions and the lab's verdict are tested in-process."""
import contextlib
import io
import re
import shutil

import pytest
import torch
from torch.utils.data import DataLoader

from conftest import (assert_help_in_process, assert_refused_in_process,
                      load_script, REPO, last_line_matching, number_after, run_readme_command)

LAB = "00_single_process/prove.py"
LESSON = "00_single_process/single_process.py"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lesson_module():
    return load_script(REPO / LESSON)


@pytest.fixture(scope="module")
def prove():
    return load_script(REPO / LAB)


def proof(stdout):
    """(passed, the PROOF line, max |dw| at the start, at the end, first and last epoch's mean loss)."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    losses = re.search(r"mean loss epoch 0 (\S+) -> epoch \d+ (\S+),", line)
    assert losses, line
    return (line.startswith("PROOF PASSED"), line, number_after("at the start", line),
            number_after("at the end", line), float(losses.group(1)), float(losses.group(2)))


def printed_pair(label, stdout):
    """The two values the lab prints after `label`, one per process."""
    line = last_line_matching("^" + re.escape(label), stdout)
    return re.findall(r"\w+", line[len(label):].split("(")[0])


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_two_fresh_processes_end_bit_identical_and_the_loss_falls():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, line, at_start, at_end, first, last = proof(result.stdout)
    assert passed and at_start == 0.0 and at_end == 0.0 and last < first, line
    data = printed_pair("data set sha256:", result.stdout)
    assert len(data) == 2 and data[0] == data[1]
    seeds = printed_pair("global seed each process started with:", result.stdout)
    assert len(seeds) == 2 and seeds[0] != seeds[1], "the processes were not fresh interpreters"
    assert "trained 16 steps" in result.stdout


def test_data_from_the_global_rng_fails_the_proof():
    result = run_readme_command(f"python {LAB} --break unseeded-data")  # shared with the README
    assert result.returncode == 1, result.stderr[-3000:]
    passed, line, at_start, at_end, _, _ = proof(result.stdout)
    assert not passed and "DIFFERENT data sets" in line
    assert at_start == 0.0, "the model is still seeded: both processes start equal"
    assert at_end > 1e-3, "other data must end far apart, not at rounding level"
    data = printed_pair("data set sha256:", result.stdout)
    assert len(data) == 2 and data[0] != data[1]
    assert re.fullmatch(r"LIKELY CAUSE: the data set is drawn from the global RNG, seeded differently "
                        r"in each fresh process: the 2 processes built different data sets \(their "
                        r"sha256 above\); .* "
                        r"\(single_process\.py line \d+\)", result.stdout.strip().splitlines()[-1])


def test_an_unseeded_model_and_a_crash_in_the_learners_file_name_their_causes(lesson, tmp_path):
    """--break unseeded-model, and beside it a learner's file (--lesson) that raises in its own
    make_model: each ends with its LIKELY CAUSE line (stdout after PROOF FAILED; stderr after RUN
    FAILED)."""
    mine = (REPO / LESSON).read_text().replace("torch.manual_seed(seed)  #", "torch.manual_seed(seed / 0)  #")
    (tmp_path / "my_crash.py").write_text(mine)
    runs = [lesson.start(LAB, *args) for args in (["--break", "unseeded-model"],
                                                  ["--lesson", tmp_path / "my_crash.py"])]
    (out, err), (_, crashed) = [run.communicate(timeout=100) for run in runs]
    assert [run.returncode for run in runs] == [1, 1], err[-3000:]
    passed, line, at_start, at_end, _, _ = proof(out)
    assert not passed and at_start > 1e-3 and at_end > 1e-3, line
    assert re.fullmatch(r"LIKELY CAUSE: the model is built without torch\.manual_seed: the same data, "
                        r"but the 2 processes start \S+ apart; .* \(single_process\.py line \d+\)",
                        out.strip().splitlines()[-1])
    assert "RUN FAILED" in crashed and re.fullmatch(
        r"LIKELY CAUSE: rank \d raised ZeroDivisionError: division by zero in your file \(my_crash\.py "
        r"line \d+, in make_model\): fix it there", crashed.strip().splitlines()[-1])


def test_impossible_input_is_refused_before_any_process_starts(prove, capsys):
    assert_refused_in_process(prove.main, ["--epochs", "1"], capsys, "--epochs must be 2 or more")


# --- the lesson alone ----------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs(lesson, tmp_path):
    shutil.copy(REPO / LESSON, tmp_path / "single_process.py")
    result = lesson.run(tmp_path / "single_process.py", "--epochs", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 0  loss" in result.stdout
    assert re.search(r"^trained 8 steps in [\d.]+ s; final loss [\d.]+$", result.stdout, re.M), result.stdout


# --- the lesson's functions, in-process ----------------------------------------------------------

def test_make_dataset_never_touches_the_global_rng(lesson_module):
    torch.manual_seed(1)
    first = lesson_module.make_dataset()
    torch.manual_seed(123)  # another process, another global seed
    after = torch.get_rng_state()
    second = lesson_module.make_dataset()
    assert torch.equal(first.tensors[0], second.tensors[0]) and torch.equal(first.tensors[1], second.tensors[1])
    assert torch.equal(torch.get_rng_state(), after), "make_dataset drew from the global RNG"
    assert len(first.tensors[1].unique()) == 4, "all four classes are present"


def test_make_model_gives_the_same_weights_whatever_came_before(lesson_module):
    torch.manual_seed(1)
    first = lesson_module.make_model().state_dict()
    torch.randn(1000)  # moves the global RNG
    second = lesson_module.make_model().state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_train_lowers_the_loss_on_a_tiny_loader(lesson_module):
    dataset = lesson_module.make_dataset(samples=64)
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = lesson_module.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with contextlib.redirect_stdout(io.StringIO()) as log:
        losses = lesson_module.train(model, loader, optimizer, 5, torch.device("cpu"))
    assert len(losses) == 5 * 4 and log.getvalue().count("epoch ") == 5
    assert sum(losses[-4:]) < sum(losses[:4]), losses


def test_main_twice_in_one_process_gives_the_same_weights(lesson_module):
    with contextlib.redirect_stdout(io.StringIO()):
        first, first_losses = lesson_module.main()
        torch.manual_seed(7)  # whatever ran before must not matter
        torch.rand(10)
        second, second_losses = lesson_module.main()
    assert first_losses == second_losses and len(first_losses) == 16
    first, second = first.state_dict(), second.state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


# --- the lab's pieces, in-process ----------------------------------------------------------------

def test_the_breaks_draw_from_the_global_rng(prove, lesson_module):
    torch.manual_seed(1)
    data, model = prove.make_dataset_from_global_rng(), prove.make_model_unseeded().state_dict()
    torch.manual_seed(2)  # another fresh process, another seed
    assert prove.fingerprint(prove.make_dataset_from_global_rng()) != prove.fingerprint(data)
    other = prove.make_model_unseeded().state_dict()
    assert not all(torch.equal(model[k], other[k]) for k in model)
    assert prove.fingerprint(lesson_module.make_dataset()) == prove.fingerprint(lesson_module.make_dataset())


def test_the_verdict_fails_on_each_broken_part(prove, lesson_module):
    weights = prove.weights(lesson_module.make_model())
    moved = {k: v + 1e-7 for k, v in weights.items()}
    good = {"data": "abc", "start": weights, "end": weights, "losses": [2.0, 2.0, 1.0, 1.0]}
    assert prove.verdict([good, dict(good)], 2)[0]
    for bad, word in [({"data": "xyz"}, "DIFFERENT data sets"), ({"start": moved}, "from DIFFERENT weights"),
                      ({"end": moved}, "with DIFFERENT weights"), ({"losses": [1.0, 1.0, 1.0, 1.0]}, "did NOT fall")]:
        passed, claim, _ = prove.verdict([good, {**good, **bad}], 2)
        assert not passed and word in claim, claim


@pytest.mark.parametrize("args, message", [
    (["--epochs", "1"], "--epochs must be 2 or more"),
    (["--batch-size", "0"], "--batch-size and --lr must be positive"),
    (["--lr", "-0.1"], "--batch-size and --lr must be positive"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_help_names_every_flag_and_break_and_why_there_is_no_crash_rank(prove, capsys):
    shown = assert_help_in_process(prove.parse_args, ["--epochs", "--batch-size", "--lr", "--break",
                                                      *prove.BREAKS], capsys)
    assert "no --crash-rank" in shown
