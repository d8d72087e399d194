"""Lesson 01 and its lab: the hand-written DataParallel step (nn.DataParallel with 2+ GPUs) gives the
unwrapped model's outputs and gradients at every step, and ends with lesson 00's weights.

Command-line runs are what a user sees (the lab's proof, a break, the lesson copied alone); the rest
runs in-process: there are no ranks here, only threads of one process."""
import ast
import inspect
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

from conftest import (REPO, assert_clear_usage_error, assert_help_lists, last_line_matching, load_script,
                      number_after, run_readme_command)

LAB = "01_dataparallel/prove.py"
LESSON = "01_dataparallel/dataparallel.py"
TOLERANCE = 1e-6
NO_GPU = torch.cuda.device_count() == 0
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(REPO / LAB)


@pytest.fixture(scope="module")
def lesson_module():
    return load_script(REPO / LESSON)


def proof(stdout):
    """(passed, steps seen, steps, max |dy|, max |dgrad|, final max |dw|) from the PROOF line."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    seen = re.search(r"\((\d+) of (\d+) steps seen", line)
    assert seen, line
    return (line.startswith("PROOF PASSED"), int(seen.group(1)), int(seen.group(2)), number_after("max |dy|", line),
            number_after("max |dgrad|", line), number_after("final max |dw|", line))


def as_result(exit_, capsys):
    """What parse_args did in-process, shaped like a finished command for the conftest helpers."""
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["prove.py"], exit_.value.code, captured.out, captured.err)


# --- the lab, run as the README runs it ---------------------------------------------------------

@pytest.mark.skipif(not NO_GPU, reason="the CPU path's output; with 2+ GPUs the lab runs nn.DataParallel")
def test_the_hand_written_step_gives_the_unwrapped_model_at_every_step():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, seen, steps, d_out, d_grad, d_end = proof(result.stdout)
    assert passed and seen == steps == 16 and max(d_out, d_grad, d_end) <= TOLERANCE
    assert "16 rows in thread 'replica 0', 16 rows in thread 'replica 1'" in result.stdout
    here = last_line_matching(r"^nn\.DataParallel\(model\) here: ", result.stdout)
    assert "device_ids []" in here and "1 time(s): 32 rows in MainThread" in here, "the pass-through"
    assert number_after("output max |dy|", here) == 0.0


@pytest.mark.skipif(not NO_GPU, reason="the CPU path's output")
def test_detached_replicas_fail_the_proof_on_gradients_not_outputs():
    result = run_readme_command(f"python {LAB} --break detached-replicas")  # shared with the README
    assert result.returncode == 1, result.stderr[-3000:]
    passed, seen, steps, d_out, d_grad, d_end = proof(result.stdout)
    assert not passed and seen == steps
    assert d_out <= TOLERANCE, "the forward is still right: only replica 1's gradient is lost"
    assert d_grad > 1e-3 and d_end > 1e-3
    assert re.fullmatch(r"LIKELY CAUSE: only replica 0's gradient reaches the model: at step 1 the "
                        r"gradient equals that of its 16 rows alone \(max \|dg\| \S+\), \S+ times the "
                        r"whole batch's; .* \(dataparallel\.py line \d+\)", result.stdout.strip().splitlines()[-1])


def test_averaged_gradients_are_half_the_real_gradient(prove, capsys):
    """--break averaged-gradients, in-process: at step 1 (the same start) each gradient is the
    true one divided by 2, and the lab's verdict fails."""
    steps, model, _, _ = prove.run_lesson(2, 1, 32, 0.05, "cpu", "averaged-gradients")
    batches = prove.reference_batches(1, 32)
    reference = prove.load_single_process().make_model()
    x, y = batches[0]
    nn.functional.cross_entropy(reference(x), y).backward()
    for p, g in zip(reference.parameters(), steps[0]["grads"]):
        assert torch.allclose(g, p.grad / 2, atol=1e-7)
    d_out, d_grad = prove.compare_steps(steps, batches)
    assert d_out <= TOLERANCE and d_grad > 1e-3
    assert not prove.verdict(steps, batches, d_out, d_grad, 0.0, 0.0, TOLERANCE)[0]
    capsys.readouterr()
    prove.likely_cause(steps, batches, 2, TOLERANCE, 8)  # the line the lab ends with
    assert re.fullmatch(r"LIKELY CAUSE: the replicas' gradients are averaged, not summed: at step 1 the "
                        r"gradient is 0\.50 times the whole batch's \(1/2, .* \(dataparallel\.py line \d+\)\n",
                        capsys.readouterr().out)


def test_a_crash_in_the_learners_file_is_one_line_naming_it(monkeypatch, tmp_path, capsys):
    """--lesson my_crash.py, in this process: the learner's replicate raises, and the lab ends with
    one LIKELY CAUSE line on stderr (course.run_lab), not a traceback through the lab's code."""
    mine = (REPO / LESSON).read_text().replace("    return [(copy.deepcopy(module)",
                                               "    return [(copy.deepcopy(module[5])")
    (tmp_path / "my_crash.py").write_text(mine)
    monkeypatch.setenv("COURSE_LESSON", str(tmp_path / "my_crash.py"))
    # the crash registers as "dataparallel": after the test, the module as it was, or none (a
    # later test's fresh `prove` fixture on this worker would otherwise import the crash)
    monkeypatch.setitem(sys.modules, "dataparallel", sys.modules.get("dataparallel"))
    del sys.modules["dataparallel"]
    lab = load_script(REPO / LAB)
    assert lab.course.run_lab(lab.main, ["--epochs", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"LIKELY CAUSE: your file raised IndexError: .* \(my_crash\.py "
                                          r"line \d+, in \S+\): fix it there", err[0]), err


def test_three_replicas_get_uneven_chunks_and_the_proof_holds(prove):
    steps, model, losses, _ = prove.run_lesson(3, 1, 32, 0.05, "cpu")
    assert sorted((thread, rows) for thread, rows, _, _ in steps[0]["calls"]) == [
        ("replica 0", 11), ("replica 1", 11), ("replica 2", 10)]
    d_out, d_grad = prove.compare_steps(steps, prove.reference_batches(1, 32))
    assert len(steps) == len(losses) == 8 and max(d_out, d_grad) <= TOLERANCE


def test_run_lesson_leaves_the_lesson_module_as_it_was(prove):
    before = (prove.lesson.make_model, prove.lesson.replicate, torch.get_num_threads())
    prove.run_lesson(2, 1, 128, 0.05, "cpu", "detached-replicas")
    assert (prove.lesson.make_model, prove.lesson.replicate, torch.get_num_threads()) == before


# --- the lesson alone ----------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs_and_refuses_bad_input(lesson, tmp_path):
    shutil.copy(REPO / LESSON, tmp_path / "dataparallel.py")
    bad = lesson.start(tmp_path / "dataparallel.py", "--replicas", 0, cwd=tmp_path)  # at once: ~2 s each
    result = lesson.run(tmp_path / "dataparallel.py", "--replicas", 3, "--epochs", 1, cwd=tmp_path)
    _, bad_err = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "must be positive" in bad_err and "Traceback" not in bad_err, bad_err
    assert result.returncode == 0, result.stderr[-3000:]
    assert "3 replica(s), threads of one process" in result.stdout and "epoch 0  loss" in result.stdout
    assert re.search(r"^trained 8 steps in [\d.]+ s; final loss [\d.]+$", result.stdout, re.M), result.stdout


# --- the lesson's pieces, in-process -------------------------------------------------------------

def test_the_hand_written_step_sums_the_replicas_gradients(lesson_module):
    model = lesson_module.make_model()
    wrapped = lesson_module.HandWrittenDataParallel(model, 3)
    x, y = lesson_module.make_dataset(samples=10).tensors
    expected = model(x)
    nn.functional.cross_entropy(expected, y).backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = wrapped(x)
    nn.functional.cross_entropy(out, y).backward()
    assert out.shape == expected.shape and (out - expected).abs().max() <= TOLERANCE
    for p, g in zip(model.parameters(), expected_grads):
        assert (p.grad - g).abs().max() <= TOLERANCE


def test_replica_0_updates_the_modules_own_buffers_as_nn_dataparallel_does(lesson_module):
    """BatchNorm's running stats: replica 0 runs on the module's buffers, the others on copies."""
    model = nn.Sequential(nn.Linear(20, 8), nn.BatchNorm1d(8))
    lesson_module.HandWrittenDataParallel(model, 2)(lesson_module.make_dataset(samples=10).tensors[0])
    assert model[1].num_batches_tracked.item() == 1 and model[1].running_mean.abs().sum() > 0


def test_each_replica_runs_in_a_thread_of_its_own(lesson_module):
    model, seen = lesson_module.make_model(), []
    model.register_forward_hook(lambda m, args, out: seen.append((threading.current_thread().name, len(args[0]))))
    x = lesson_module.make_dataset(samples=10).tensors[0]
    lesson_module.HandWrittenDataParallel(model, 2)(x)
    assert sorted(seen) == [("replica 0", 5), ("replica 1", 5)]


def test_an_error_in_a_replica_thread_reaches_the_caller(lesson_module):
    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError(f"replica failed in {threading.current_thread().name}")
    replicas = [(nn.Identity(), {}), (Fails(), {})]
    with pytest.raises(ValueError, match="replica failed in replica 1"):
        lesson_module.parallel_apply(replicas, [(torch.zeros(1),), (torch.zeros(1),)])


def test_a_forward_that_returns_the_loss_gathers_a_vector_that_backward_refuses(lesson_module):
    class WithLoss(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.net(x), y)

    x, y = lesson_module.make_dataset(samples=8).tensors
    losses = lesson_module.HandWrittenDataParallel(WithLoss(lesson_module.make_model()), 2)(x, y)
    assert losses.shape == (2,)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        losses.backward()


def test_choose_path_says_what_nn_dataparallel_does_with_0_1_and_2_gpus(lesson_module, monkeypatch):
    """The correction: with ONE GPU nn.DataParallel takes its single-device branch (it calls the
    module); it only splits the batch, and gathers one loss per replica, with 2 or more."""
    for gpus, expected in [(0, ("cpu", "device_ids []")), (1, ("cpu", "just call the module on cuda:0")),
                           (2, ("cuda", "splits each batch over cuda:0..1"))]:
        monkeypatch.setattr(lesson_module.torch.cuda, "device_count", lambda: gpus)
        device, why = lesson_module.choose_path(2)
        assert device == expected[0] and expected[1] in why, (gpus, why)
    assert lesson_module.choose_path(2, "cpu") == ("cpu", "CPU requested")


def test_the_installed_torch_calls_the_module_directly_with_one_device():
    """The source the correction quotes: forward() returns self.module(...) without a GPU, and
    again when device_ids has one entry, before any replicate or gather."""
    source = inspect.getsource(nn.DataParallel.forward)
    assert re.search(r"if not self\.device_ids:\s+return self\.module\(", source)
    single = re.search(r"if len\(self\.device_ids\) == 1:\s+return self\.module\(", source)
    assert single and single.start() < source.index("self.replicate(") < source.index("self.gather(")


@pytest.mark.skipif(not NO_GPU, reason="what nn.DataParallel does WITHOUT a GPU")
def test_nn_dataparallel_without_a_gpu_just_calls_the_module(prove):
    device_ids, calls, diff = prove.dataparallel_here(32)
    assert device_ids == [] and calls == [("MainThread", 32)] and diff == 0.0
    assert nn.DataParallel(nn.Linear(2, 2), device_ids=[0, 1]).device_ids == [], "explicit ids are ignored too"


def test_the_wrapper_state_dict_has_the_module_prefix_and_main_returns_the_module(lesson_module):
    wrapped = lesson_module.HandWrittenDataParallel(lesson_module.make_model(), 2)
    assert list(wrapped.state_dict())[0] == "module.0.weight"
    assert list(nn.DataParallel(lesson_module.make_model()).state_dict())[0] == "module.0.weight"


# --- the lab's pieces and guard rails, in-process ------------------------------------------------

def test_the_verdict_fails_on_each_broken_part(prove):
    steps, batches = [{}] * 4, [None] * 4
    assert prove.verdict(steps, batches, 0.0, 1e-8, 4e-8, 0.0, TOLERANCE)[0]
    assert not prove.verdict([{}] * 3, batches, 0.0, 0.0, 0.0, 0.0, TOLERANCE)[0], "a missing step"
    for d in ((1e-3, 0, 0, 0), (0, 1e-3, 0, 0), (0, 0, 1e-3, 0), (0, 0, 0, 1e-3)):
        assert not prove.verdict(steps, batches, *d, TOLERANCE)[0], d


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas, --epochs, --batch-size and --lr must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--break", "detached-replicas", "--replicas", "1"], "--break detached-replicas needs --replicas 2 or more"),
    (["--device", "cuda"], "--device cuda runs nn.DataParallel with one GPU per replica, 2 or more"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused_before_anything_runs(prove, capsys, args, message):
    if "cuda" in args and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs, so the choice is possible here")
    with pytest.raises(SystemExit) as exit_:
        prove.parse_args(args)
    assert_clear_usage_error(as_result(exit_, capsys), message)


def test_help_names_every_flag_and_break_and_why_there_is_no_crash_rank(prove, capsys):
    with pytest.raises(SystemExit) as exit_:
        prove.parse_args(["--help"])
    result = as_result(exit_, capsys)
    assert_help_lists(result, ["--replicas", "--epochs", "--batch-size", "--lr", "--device", "--break",
                               *prove.BREAKS])
    assert "no --crash-rank" in result.stdout


def test_the_benchmark_times_a_tiny_step_without_the_lesson():
    path = REPO / "01_dataparallel" / "benchmark.py"
    imported = {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                for alias in node.names} | {node.module for node in ast.walk(ast.parse(path.read_text()))
                                            if isinstance(node, ast.ImportFrom)}
    assert "dataparallel" not in imported, "benchmark.py keeps its own copy of the timed step"
    benchmark = load_script(path)
    run = benchmark.time_on_cpu(8, 4, 1, quiet=True)
    runs = [{str(intra): {v: list(fb) for v, fb in variants.items()} for intra, variants in run.items()}]
    summary = benchmark.summarise(runs)
    assert set(summary) == {str(i) for i in run} and all(f > 0 for s in summary.values()
                                                         for f, _ in s["median_ms"].values())
