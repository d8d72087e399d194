"""Lesson 02 and its lab: N ranks under DDP train exactly like lesson 00 on the global batch.

Command-line runs are what a user sees (the lab's proof, its breaks, a crashed rank, the lesson
copied alone); the lab's pieces are tested in-process, where no rank has to start."""
import itertools
import re
import shutil

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from conftest import (assert_help_in_process, assert_refused_in_process,
                      load_script, REPO, assert_crashed_rank_stops_the_run, last_line_matching, number_after,
                      run_readme_command, start_lesson)

LAB = "02_ddp_spawn/prove.py"
LESSON = "02_ddp_spawn/ddp_spawn.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(REPO / LAB)


def proof(stdout):
    """(passed, max |dw| between ranks, max |dw| against one process) from the PROOF line."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    return (line.startswith("PROOF PASSED"), number_after("max |dw| between ranks", line),
            number_after("against one process", line))


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_two_ranks_end_identical_and_equal_to_one_process():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, between, vs_single = proof(result.stdout)
    assert passed and between == 0.0 and vs_single <= TOLERANCE
    assert "world size 2; global batch 2 x 16 = 32" in result.stdout
    losses = last_line_matching(r"^each rank's own loss at the last step: ", result.stdout)
    rank0, rank1 = (float(x) for x in losses.split(": ")[1].split(" (")[0].split(", "))
    assert rank0 != rank1, "each rank's loss is on its own batch: DDP averages gradients, not losses"


def test_three_ranks_in_one_launch(lesson):
    result = lesson.run(LAB, "--world-size", 3)
    assert result.returncode == 0, result.stderr[-3000:]
    passed, between, vs_single = proof(result.stdout)
    assert passed and between == 0.0 and vs_single <= TOLERANCE
    assert "global batch of 48" in result.stdout


@pytest.mark.parametrize("name, ranks_identical, cause", [
    ("no-sync", False, "LIKELY CAUSE: the gradients are not averaged across ranks"),
    ("unseeded-data", True, "LIKELY CAUSE: each rank built other data")])
def test_each_break_fails_the_proof_and_names_its_cause(name, ranks_identical, cause):
    result = run_readme_command(f"python {LAB} --break {name}")  # shared with the README's block
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith(cause), result.stdout[-2000:]
    passed, between, vs_single = proof(result.stdout)
    assert not passed
    assert vs_single > 1e-3, "a broken run must be far from one process, not at rounding level"
    # no-sync: each rank steps on its own gradient, so the replicas drift apart. unseeded-data:
    # DDP still averages the gradients, so the replicas agree, on the wrong (mixed) data.
    assert (between == 0.0) == ranks_identical


# A learner's typical mistakes (issue 31), each made in the lesson and given to the lab with
# --lesson, all at once (about 20 s on 2 cores); the lab names each from what the run did.
MISTAKES = {
    "seed=rank": (("rank=rank, seed=0)", "rank=rank, seed=rank)"),),
    "loss x N": (("cross_entropy(model(x), y)", "cross_entropy(model(x), y) * dist.get_world_size()"),),
    "no sampler": (("sampler=sampler,", "shuffle=True,"),
                   ("loader.sampler.set_epoch(epoch)", "pass  # set_epoch(epoch)")),
    "crash": (("losses.append(loss.item())", "losses.append(loss.item() / 0 if epoch else 0)"),),
}
CAUSES = {
    "seed=rank": r"^LIKELY CAUSE: the ranks' samplers shuffle differently \(a seed per rank\?\): "
                 r"in epoch 0, \d+ sample\(s\) reach two ranks .* \(ddp_spawn.py line \d+\)$",
    "loss x N": r"^LIKELY CAUSE: the gradient is 2 times too large: the first update is 2.00 times",
    "no sampler": r"^LIKELY CAUSE: every rank reads the same samples \(step 1: 2 ranks, one batch\)",
    "crash": r"^LIKELY CAUSE: rank \d raised ZeroDivisionError: .* in your file \(my_crash.py line "
             r"\d+, in train\): fix it there$",
}


@pytest.mark.timeout(480)
def test_each_typical_mistake_is_named_in_one_line(tmp_path):
    text = (REPO / LESSON).read_text()
    started = {}
    for name, edits in MISTAKES.items():
        mine = text
        for old, new in edits:
            assert mine.count(old) == 1, old
            mine = mine.replace(old, new)
        path = tmp_path / f"my_{name.split()[0].replace('=', '_')}.py"
        path.write_text(mine)
        started[name] = start_lesson(LAB, "--lesson", path)
    outputs = {}
    for name, proc in started.items():
        outputs[name] = out, err = proc.communicate(timeout=450)
        assert proc.returncode == 1, (name, out[-2000:], err[-2000:])
        last = (err if name == "crash" else out).strip().splitlines()[-1]
        assert re.search(CAUSES[name], last), (name, last)
    assert "(the ranks saw the SAME samples at step 1)" in outputs["no sampler"][0]
    assert "(each rank saw other samples)" in outputs["seed=rank"][0]


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone ----------------------------------------------------------------------------

def test_two_copies_of_the_lesson_alone_run_at_once(lesson, tmp_path):
    """Copied alone into empty folders, the lesson runs; started together, the two runs pick
    their own free ports, so neither fails with EADDRINUSE."""
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copy(REPO / LESSON, tmp_path / name / "ddp_spawn.py")
        # one rank each: still a process group on a port of its own, at a third of the start-up cost
        runs.append(lesson.start(tmp_path / name / "ddp_spawn.py", "--epochs", 1, "--world-size", 1,
                                 cwd=tmp_path / name))
    for run in runs:
        stdout, stderr = run.communicate(timeout=90)
        assert run.returncode == 0, stderr[-3000:]
        assert "world size 1" in stdout and "trained 16 steps" in stdout and "epoch 0  loss" in stdout


# --- the lab's pieces, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("samples, world_size, batch_size", [(256, 2, 16), (50, 3, 7), (10, 4, 1)])
def test_global_batches_are_the_ranks_batches_concatenated(prove, samples, world_size, batch_size):
    """At every step, the reference's batch is rank 0's batch, then rank 1's, ... exactly as the
    lesson's DataLoaders give them, including the sampler's padding and a short last batch."""
    dataset = TensorDataset(torch.arange(samples))
    global_batches = DataLoader(dataset, batch_sampler=prove.GlobalBatches(dataset, world_size, batch_size))
    samplers = [DistributedSampler(dataset, num_replicas=world_size, rank=r, seed=0)
                for r in range(world_size)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s,
                          generator=torch.Generator().manual_seed(0)) for s in samplers]
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        steps = 0
        for global_batch, *per_rank in itertools.zip_longest(global_batches, *loaders):
            assert global_batch is not None and None not in per_rank, "step counts differ"
            assert torch.equal(global_batch[0], torch.cat([batch[0] for batch in per_rank]))
            steps += 1
        assert steps == len(global_batches) == len(loaders[0])


def test_steps_per_rank_counts_the_padded_shard(prove):
    for world_size, epochs, batch_size in itertools.product((1, 2, 3, 7), (1, 2), (1, 16, 37, 300)):
        dataset = TensorDataset(torch.arange(256))
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=0)
        expected = epochs * len(DataLoader(dataset, batch_size=batch_size, sampler=sampler))
        assert prove.steps_per_rank(world_size, epochs, batch_size) == expected


def test_the_lesson_builds_its_data_from_its_own_generator_and_the_break_does_not(prove):
    lesson = load_script(REPO / LESSON)
    torch.manual_seed(1)
    first, broken_first = prove.fingerprint(lesson.make_dataset()), prove.make_dataset_from_global_rng()
    torch.manual_seed(2)  # another process, another global seed
    assert prove.fingerprint(lesson.make_dataset()) == first
    assert prove.fingerprint(prove.make_dataset_from_global_rng()) != prove.fingerprint(broken_first)
    assert first == prove.fingerprint(prove.load_single_process().make_dataset()), "00 and 02 share the data"


# --- guard rails and help, in-process ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "--world-size, --epochs, --batch-size, --lr and --timeout must be positive"),
    (["--lr", "-1"], "must be positive"),
    (["--timeout", "0"], "must be positive"),
    (["--break", "no-sync", "--world-size", "1"], "--break no-sync needs --world-size 2 or more"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
    (["--crash-rank", "0", "--epochs", "1", "--batch-size", "128"], "but this run has 1 step(s)"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_cuda_without_gpus_is_refused(prove, capsys):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has one GPU per rank, so --device cuda is possible here")
    with pytest.raises(SystemExit) as exit_:
        prove.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda needs one GPU per rank" in capsys.readouterr().err


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--world-size", "--epochs", "--batch-size", "--lr", "--device",
                                              "--break", "--crash-rank", "--timeout", *prove.BREAKS], capsys)
