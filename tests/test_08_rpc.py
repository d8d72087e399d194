"""Lesson 08 and its lab: a parameter server over RPC, driven by one trainer, ends with a local
loop's weights; its gradients live in the distributed autograd context, not in .grad.

Command-line runs are what a user sees (the lab's proof beside a second server at the same time,
a break, a crashed trainer, the lesson copied alone); the claims about gradients and optimizers are tested in-process, in an
RPC world of one ("ps" calling itself), where no process has to start."""
import math
import re
import shutil

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.utils.data import DataLoader, DistributedSampler

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process, assert_refused_in_process,
                      last_line_matching, load_script, number_after, run_readme_command)

LAB = "08_rpc/prove.py"
LESSON = "08_rpc/rpc.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(REPO / LAB)


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_one_trainer_ends_equal_to_a_local_loop_and_grads_live_in_the_context():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", result.stdout)
    assert line.startswith("PROOF PASSED")
    assert number_after("max |dw|", line) <= TOLERANCE
    assert number_after("first gradients max |dg|", line) <= TOLERANCE
    grads = last_line_matching(r"^step 1 on the server: ", result.stdout)
    assert ".grad is None on all 4 parameters: True" in grads
    assert "get_gradients holds 4 gradients there (the trainer's context: 0)" in grads
    # the second server, run at the same time as the proof's, on a free port of its own:
    asynchronous = last_line_matching(r"^2 asynchronous trainers: ", result.stdout)
    finals = asynchronous.split("final losses ")[1].split(";")[0].split(", ")
    # each is one batch's loss after steps interleaved at random: 1.0554 once, under load. Below
    # ln 4 = 1.386, a uniform guess over the 4 classes, the server has learned.
    assert len(finals) == 2 and max(map(float, finals)) < math.log(4), "the server learns"


def test_local_backward_stops_the_run_with_the_real_error():
    result = run_readme_command(f"python {LAB} --break local-backward --async-trainers 0")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "RUN FAILED" in result.stderr and "PROOF" not in result.stdout
    assert "graphTask_ INTERNAL ASSERT FAILED" in result.stderr
    assert "context.cpp" in result.stderr
    # the last line names the cause, from what the trainer measured (not from the source text)
    assert re.fullmatch(r"LIKELY CAUSE: loss\.backward\(\) inside a distributed autograd context: "
                        r"trainer 1 ran a local backward 1 time\(s\) in a dist_autograd context and "
                        r"dist_autograd\.backward none, then raised RuntimeError: graphTask_ INTERNAL "
                        r"ASSERT FAILED; .* \(rpc\.py line \d+\)", result.stderr.strip().splitlines()[-1])


def test_a_plain_optimizer_and_a_crash_in_the_learners_file_end_with_their_causes(lesson, tmp_path):
    """--break plain-optimizer, and a learner's file (--lesson) that raises in its own code: both
    stop the run, at once, each ending stderr with its LIKELY CAUSE line."""
    mine = (REPO / LESSON).read_text().replace("    dataset = make_dataset()\n    sampler",
                                               "    dataset = make_dataset()[5.5]\n    sampler")
    (tmp_path / "my_crash.py").write_text(mine)
    runs = [lesson.start(LAB, "--async-trainers", 0, *args) for args in (
        ["--break", "plain-optimizer"], ["--lesson", tmp_path / "my_crash.py"])]
    (_, plain), (_, crash) = [run.communicate(timeout=100) for run in runs]
    assert [run.returncode for run in runs] == [1, 1] and "RUN FAILED" in plain + crash
    assert re.fullmatch(r"LIKELY CAUSE: a local optimizer built on the parameters' RRefs: trainer 1 "
                        r"built torch\.optim SGD on 4 RRef\(s\) and raised TypeError: optimizer can "
                        r"only optimize Tensors; .* \(rpc\.py line \d+\)", plain.strip().splitlines()[-1])
    assert re.fullmatch(r"LIKELY CAUSE: rank 1 raised IndexError: .* in your file \(my_crash\.py line "
                        r"\d+, in run_trainer\): fix it there", crash.strip().splitlines()[-1])


def test_a_crashed_trainer_stops_the_run_without_waiting_for_the_others(lesson):
    """Trainer 2 of the asynchronous run raises after step 2 while trainer 1 has 16,000 steps to go
    (about a minute here): a graceful shutdown in the crashed trainer would wait for them."""
    assert_crashed_rank_stops_the_run(lesson, LAB, "--epochs", 2000, rank=2, within=30)


def test_the_lesson_copied_alone_runs(lesson, tmp_path):
    """Copied alone into an empty folder, the lesson runs: 1 server + 1 trainer. (Two RPC worlds
    at once, each on its own free port, run in every default lab run: the proof's server and
    the asynchronous one, side by side; the first test checks both finished.)"""
    shutil.copy(REPO / LESSON, tmp_path / "rpc.py")
    result = lesson.run(tmp_path / "rpc.py", "--epochs", 1, cwd=tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rpc backend: TensorPipe on CPU" in result.stdout
    assert "trainer1: trained 16 steps" in result.stdout
    assert "trainer1: epoch 0  loss" in result.stdout


# --- in-process: an RPC world of one, "ps" calling itself ---------------------------------------

@pytest.fixture(scope="module")
def world_of_one(prove):
    lesson, threads = prove.lesson, torch.get_num_threads()
    lesson.SERVER["model"] = lesson.make_model()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{prove.course.find_free_port()}", rpc_timeout=30)
    rpc.init_rpc("ps", rank=0, world_size=1, rpc_backend_options=options)
    try:
        yield lesson
    finally:
        rpc.shutdown()
        lesson.SERVER.clear()
        torch.set_num_threads(threads)


def test_gradients_live_in_the_context_and_equal_local_backward(world_of_one, prove):
    lesson = world_of_one
    model_rref = rpc.remote("ps", lesson.server_model)
    x, y = next(iter(DataLoader(lesson.make_dataset(), batch_size=16)))
    with dist_autograd.context() as context_id:
        output = rpc.rpc_sync("ps", lesson.forward_on_server, args=(model_rref, x))
        dist_autograd.backward(context_id, [torch.nn.functional.cross_entropy(output, y)])
        grads, grad_none = prove.gradients_on_server(context_id)
    assert grad_none == [True] * 4, ".grad stays None: backward wrote into the context"
    local = lesson.make_model()
    torch.nn.functional.cross_entropy(local(x), y).backward()
    for got, expected in zip(grads, (p.grad for p in local.parameters())):
        assert torch.allclose(got, expected, atol=TOLERANCE)


def test_the_lessons_train_over_self_rpc_equals_the_labs_reference(world_of_one, prove):
    """The lesson's own train() and DistributedOptimizer, over RPC to this process: the weights
    end where the lab's local loop (lesson 00's model and step) ends."""
    lesson = world_of_one
    lesson.SERVER["model"] = lesson.make_model()
    dataset = lesson.make_dataset()
    loader = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset, 1, 0, seed=0))
    model_rref = rpc.remote("ps", lesson.server_model)
    params = rpc.rpc_sync("ps", lesson.parameter_rrefs, args=(model_rref,))
    optimizer = lesson.DistributedOptimizer(torch.optim.SGD, params, lr=0.05, momentum=0.9)
    losses = lesson.train(model_rref, loader, optimizer, 2, "trainer")
    reference, reference_losses, _ = prove.train_reference(1, 2, 16, 0.05)
    assert prove.course.max_abs_diff(lesson.SERVER["model"].state_dict(), reference) <= TOLERANCE
    assert losses == pytest.approx(reference_losses, abs=TOLERANCE) and losses[-1] < losses[0]


def test_a_plain_optimizer_refuses_rrefs(world_of_one, prove):
    params = rpc.rpc_sync("ps", world_of_one.parameter_rrefs,
                          args=(rpc.remote("ps", world_of_one.server_model),))
    with pytest.raises(TypeError, match="optimizer can only optimize Tensors, but one of the "
                                        "params is torch._C._distributed_rpc.PyRRef"):
        prove.plain_optimizer(torch.optim.SGD, params, lr=0.05)


def test_the_tutorials_optimizer_path_does_not_exist():
    import torch.distributed.optim as real
    import torch.nn.parallel as wrong
    assert not hasattr(wrong, "DistributedOptimizer") and hasattr(real, "DistributedOptimizer")


# --- guard rails and help, in-process ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "--epochs, --batch-size, --lr and --timeout must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--async-trainers", "1"], "--async-trainers must be 0 (none) or 2 or more"),
    (["--crash-rank", "0"], "--crash-rank 0 is the parameter server"),
    (["--crash-rank", "3"], "--crash-rank must be a trainer, 1 to 2"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--async-trainers", "--epochs", "--batch-size", "--lr", "--break",
                                              "--crash-rank", "--timeout", *prove.BREAKS], capsys)


def test_without_rpc_the_lesson_and_the_lab_say_so_in_one_line(monkeypatch, capsys):
    """PyTorch builds no torch.distributed.rpc for Windows (rpc.is_available() is False there): the
    lesson exits with one line instead of an ImportError, the lab refuses (exit 2) before any rank."""
    monkeypatch.setattr(rpc, "is_available", lambda: False)  # as on Windows
    with pytest.raises(SystemExit) as stopped:
        load_script(LESSON)
    assert str(stopped.value.code).startswith("torch.distributed.rpc is not in this torch build (platform ")
    with pytest.raises(SystemExit) as refused:
        load_script(LAB)
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "lesson 08 needs torch.distributed.rpc, which this torch build on " in err
    assert err.endswith("lacks (PyTorch builds none for Windows)")
