"""Lesson 09 and its lab: gradient accumulation with no_sync equals one big batch and skips K-1
of K all-reduces; bf16 stays close to fp32; every rank clips with the same norm; uneven ranks hang
without Join and finish with it; rank 0's TensorBoard file holds the scalars.

Command-line runs are what a user sees (the lab's proof, a break, a crashed rank, the lesson copied
alone with --log-dir, whose event file is read back); the rest runs the lesson's worker in this
process, in a world of one rank."""
import re
import shutil
import uuid

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process,
                      assert_refused_in_process, kill_leftovers, last_line_matching, load_script,
                      number_after, run_lesson, run_once_per_session, run_readme_command)

LAB = "09_training_loop/prove.py"
LESSON = "09_training_loop/training_loop.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(300)  # the lesson alone: 13 s quiet, 83 s in a loaded suite


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


def proof(stdout):
    """(passed, against one process, clip norms between ranks) from the PROOF line."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    return (line.startswith("PROOF PASSED"), number_after("max |dw| against one process", line),
            number_after("clip norms", line))


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_every_part_of_the_loop_is_proved():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, vs_single, between = proof(result.stdout)
    assert passed and vs_single <= TOLERANCE and between == 0.0
    counts = last_line_matching(r"^1\. all-reduces per micro-batch", result.stdout)
    assert "8 steps" in counts and counts.endswith("[0, 1] (the same every step)")
    bf16 = number_after("max |dw|", last_line_matching(r"^2\. bf16", result.stdout))
    assert 0 < bf16 < 0.05, "bf16 rounds (so it differs), but only a little after 8 steps"
    clip = last_line_matching(r"^3\. gradient norm", result.stdout)
    assert number_after("against one process", clip) <= TOLERANCE
    join = last_line_matching(r"^4\. with Join", result.stdout)
    assert "steps per rank 8, 6" in join and number_after("between ranks", join) == 0.0
    # without Join, every rank raises, none before the group timeout, and a rank timed out (its
    # peer may see "Connection closed by peer" once the first closes its connections)
    line = last_line_matching(r"^   without Join \(group timeout 3 s\): ", result.stdout)
    assert "every rank raised, after " in line
    assert re.search(r"s; [12] of 2 with Timed out waiting 3000ms$", line), line
    times = re.search(r"after ([\d., ]+) s;", line).group(1).split(", ")
    assert len(times) == 2 and all(float(t) >= 3.0 for t in times), line
    assert "gives 128, 128 samples (padded with repeats), with drop_last=True 127, 127" in result.stdout


def test_accumulating_without_scaling_the_loss_fails_the_proof():
    result = run_readme_command(f"python {LAB} --break no-loss-scaling")  # the README's block
    assert result.returncode == 1, result.stderr[-3000:]
    passed, vs_single, between = proof(result.stdout)
    assert not passed and vs_single > 1e-3
    assert between == 0.0, "the ranks still agree with each other: all took the same wrong step"
    assert result.stdout.splitlines()[-1] == (
        "LIKELY CAUSE: the loss is not divided by the K = 2 micro-batches: the first step's "
        "gradient norm is 2.00 times one process's; backpropagate loss / K (training_loop.py "
        "line 51)")


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson copied alone, and its TensorBoard file read back -----------------------------------

@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The lesson copied alone into an empty folder, run as a user runs it, with --log-dir."""
    run_once_per_session("test_09_training_loop.alone")
    folder = tmp_path_factory.mktemp("alone")
    shutil.copy(REPO / LESSON, folder / "training_loop.py")
    marker = uuid.uuid4().hex
    result = run_lesson(folder / "training_loop.py", "--log-dir", "tb", cwd=folder, timeout=240,
                        marker=marker)
    assert not kill_leftovers(marker), "the lesson left processes running"
    return result, folder / "tb"


def scalars(folder):
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class TestTheLessonCopiedAlone:
    """The tests that read the one run of the lesson copied alone (the `alone` fixture): a
    class, so that pytest-xdist keeps them on one worker (conftest.py) and the lesson runs once."""

    def test_the_lesson_copied_alone_runs(self, alone):
        result, _ = alone
        assert result.returncode == 0, result.stderr[-3000:]
        assert "backend: gloo" in result.stdout and "trained 8 steps" in result.stdout

    def test_rank_0_logs_loss_accuracy_grad_norm_lr_and_every_ranks_loss(self, prove, alone):
        found = scalars(alone[1])
        assert set(found) == {"step/grad_norm", "step/lr", "epoch/loss", "epoch/accuracy",
                              "epoch/loss_rank0", "epoch/loss_rank1"}
        assert [s for s, _ in found["step/grad_norm"]] == list(range(1, 9))
        assert all(v == pytest.approx(0.05) for _, v in found["step/lr"])
        _, reference_norms = prove.train_reference(2, 2, 2)  # one process, computed here
        assert [v for _, v in found["step/grad_norm"]] == pytest.approx(reference_norms, abs=1e-5)
        for epoch in (0, 1):  # equal shares: the mean loss is the mean of the ranks' losses
            ranks = [found[f"epoch/loss_rank{r}"][epoch][1] for r in (0, 1)]
            assert found["epoch/loss"][epoch][1] == pytest.approx(sum(ranks) / 2, abs=1e-6)
            assert ranks[0] != ranks[1], "each rank's own loss, not the mean copied twice"
        printed = last_line_matching(r"^epoch 1 ", alone[0].stdout)
        assert number_after("accuracy", printed) == pytest.approx(found["epoch/accuracy"][1][1], abs=1e-3)
        assert found["epoch/accuracy"][1][1] > found["epoch/accuracy"][0][1], "it learns"


# --- in this process: the lesson's worker in a world of one rank ---------------------------------

def run_worker(prove, accumulate=2, precision="fp32", epochs=1, train_step=None, sampler=None,
               kept=None):
    """lesson.worker as rank 0 of 1 here, with the lab's counting DDP; (model, norms, counts);
    `kept`, a dict, gets what lab_worker keeps for the diagnosis."""
    lesson, threads = prove.lesson, torch.get_num_threads()
    counter = prove.Counter()
    saved = lesson.DDP, lesson.train_step, lesson.DistributedSampler
    lesson.DDP, lesson.train_step = counter.make_ddp, train_step or lesson.train_step
    lesson.DistributedSampler = sampler or lesson.DistributedSampler
    try:
        model, norms = lesson.worker(0, 1, prove.course.find_free_port(), "gloo", epochs,
                                     accumulate, precision, None, timeout=30)
    finally:
        lesson.DDP, lesson.train_step, lesson.DistributedSampler = saved
        counter.handle.remove()
        torch.set_num_threads(threads)
    assert not dist.is_initialized(), "the worker destroys its process group"
    if kept is not None:
        kept.update(fp32={"state": model.state_dict(), "norms": norms}, join={},
                    counts=counter.steps[:len(norms)], steps=counter.weights[:len(norms)],
                    tags=["epoch/accuracy", "epoch/loss", "step/grad_norm", "step/lr"])
    return model.state_dict(), norms, counter.steps[:len(norms)]


def cause_of(prove, capsys, kept, accumulate, epochs=1, broken=None):
    """The lab's last line for what run_worker kept (a world of one against one process)."""
    steps = []
    _, norms = prove.train_reference(1, epochs, accumulate, steps)
    capsys.readouterr()
    prove.likely_cause([kept], steps, norms, 1, accumulate, epochs, broken, True)
    return capsys.readouterr().out.strip()


def test_k_micro_batches_equal_one_batch_of_k_and_all_reduce_once(prove):
    state, norms, counts = run_worker(prove, accumulate=4)
    reference, reference_norms = prove.train_reference(1, 1, 4)
    assert prove.course.max_abs_diff(state, reference) <= TOLERANCE
    assert norms == pytest.approx(reference_norms, abs=TOLERANCE)
    assert counts == [[0, 0, 0, 1]] * 4, "256 samples = 4 steps of 4 micro-batches of 16"


@pytest.mark.parametrize("broken", ["no-loss-scaling", "sync-every-micro-batch"])
def test_each_break_changes_what_it_claims_to_and_is_named(prove, capsys, broken):
    kept = {}
    state, _, counts = run_worker(prove, accumulate=4, train_step=prove.broken_train_step(broken),
                                  kept=kept)
    reference, _ = prove.train_reference(1, 1, 4)
    cause = cause_of(prove, capsys, kept, 4, broken=broken)
    if broken == "no-loss-scaling":
        assert prove.course.max_abs_diff(state, reference) > 1e-3 and counts == [[0, 0, 0, 1]] * 4
        assert cause.startswith("LIKELY CAUSE: the loss is not divided by the K = 4 micro-batches: "
                                "the first step's gradient norm is 4.00 times"), cause
    else:  # the same weights (an all-reduce is linear), but 4 all-reduces a step
        assert prove.course.max_abs_diff(state, reference) <= TOLERANCE
        assert counts == [[1, 1, 1, 1]] * 4
        assert cause == (
            "LIKELY CAUSE: every micro-batch all-reduces: [1, 1, 1, 1] all-reduces per "
            "micro-batch, where no_sync gives [0, 0, 0, 1]; run the forward and backward of the "
            "first K-1 micro-batches under model.no_sync() (training_loop.py line 47)")


class NoSetEpoch(DistributedSampler):
    def set_epoch(self, epoch):  # the mistake: every epoch the first shuffle
        pass


def test_a_loop_without_set_epoch_is_named_and_a_good_run_is_unknown(prove, capsys):
    kept = {}
    run_worker(prove, accumulate=4, epochs=2, sampler=NoSetEpoch, kept=kept)
    assert cause_of(prove, capsys, kept, 4, epochs=2) == (
        "LIKELY CAUSE: every epoch repeats the first shuffle: the weights equal one process's "
        "through epoch 0 and leave it at step 5, the first of epoch 1; call "
        "loader.sampler.set_epoch(epoch) (training_loop.py line 62)")
    run_worker(prove, accumulate=4, kept=kept)  # no known mistake: what was measured, no cause
    assert cause_of(prove, capsys, kept, 4) == (
        "cause unknown: the ranks agree; their weights equal one process's at every step; the "
        "first step's gradient norm is 1.00 times one process's; all-reduces per micro-batch "
        "[0, 0, 0, 1]")


def test_no_sync_around_backward_only_still_all_reduces(prove):
    """README mistake 1: DDP reads no_sync's flag in forward(), so it must wrap the forward."""
    x, y = prove.lesson.make_dataset().tensors
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{prove.course.find_free_port()}",
                            rank=0, world_size=1)
    counter = prove.Counter()
    try:
        model = counter.make_ddp(prove.lesson.make_model())
        loss = torch.nn.functional.cross_entropy(model(x[:16]), y[:16])
        with model.no_sync():  # too late: the forward ran outside
            loss.backward()
        with model.no_sync():  # right: forward and backward inside
            torch.nn.functional.cross_entropy(model(x[16:32]), y[16:32]).backward()
        assert counter.current == [1, 0], "all-reduces of each backward"
    finally:
        counter.handle.remove()
        model = None
        dist.destroy_process_group()


def test_bf16_autocast_rounds_but_stays_close_to_fp32(prove):
    fp32, _, _ = run_worker(prove, precision="fp32", epochs=2)
    bf16, _, _ = run_worker(prove, precision="bf16", epochs=2)
    assert 1e-5 < prove.course.max_abs_diff(fp32, bf16) < 0.05
    assert all(v.dtype == torch.float32 for v in bf16.values()), "autocast keeps fp32 weights"


def test_fp16_loses_a_small_gradient_that_bf16_keeps(prove):
    line = prove.precision_facts()
    assert "1e-08 is 0.0e+00 in fp16" in line and "scale 65536" in line
    assert re.search(r"1\.0e-08 in bf16", line)


# --- the command line -----------------------------------------------------------------------------

def test_help_lists_every_flag(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--world-size", "--epochs", "--accumulate", "--device", "--break",
                                              "no-loss-scaling", "sync-every-micro-batch", "--crash-rank",
                                              "--timeout", "--debugging", "--out-dir"], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "1"], "--world-size must be 2 or more"),
    (["--accumulate", "5"], "leaves under 2 steps an epoch"),
    (["--epochs", "0"], "must be positive"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
])
def test_bad_input_is_refused_before_any_rank_starts(prove, capsys, argv, message):
    assert_refused_in_process(prove.main, argv, capsys, message)
