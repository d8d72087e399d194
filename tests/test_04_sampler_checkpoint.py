"""Lesson 04 run as a user runs it: python 04_sampler_checkpoint/sampler_checkpoint.py [flags].

The sampler and the atomic save are checked in this process (no process group needed). Everything
else runs the script as a subprocess: the default run, a crash, resumes from the crash's checkpoint,
and every kind of bad checkpoint, each time checking that the good checkpoint is still intact."""
import argparse
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import time
import uuid

import pytest
import torch

from conftest import REPO, number_after, processes_with_marker, run_lesson

SCRIPT = "04_sampler_checkpoint/sampler_checkpoint.py"
pytestmark = pytest.mark.timeout(180)

PROOF_LINE = re.compile(r"^PROOF (PASSED|FAILED): .*$", re.M)


@functools.cache
def lesson_module():
    spec = importlib.util.spec_from_file_location("sampler_checkpoint", REPO / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def proof(stdout):
    m = PROOF_LINE.search(stdout)
    assert m, f"no proof line in:\n{stdout}"
    line = m.group(0)
    return line, number_after("max |dloss|", line), number_after("max |dw|", line)


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- the sampler, in this process
def test_the_sampler_is_strided_and_padded():
    sc = lesson_module()
    assert sc.shards(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    assert sc.shards(10, 3, shuffle=False, drop_last=True) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert sc.shards(9, 3, shuffle=False) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]  # divisible: no padding


def test_without_set_epoch_every_epoch_has_the_same_order():
    sc = lesson_module()
    without = sc.epoch_orders(10, 2, 3, call_set_epoch=False)
    with_ = sc.epoch_orders(10, 2, 3, call_set_epoch=True)
    assert without[0] == without[1] == without[2]
    assert with_[0] == without[0] and with_[1] != with_[0] and with_[2] != with_[1]


def test_the_seed_must_match_on_every_rank():
    sc = lesson_module()
    same = sc.shards(10, 2, seed=0, shuffle=True)
    assert sorted(same[0] + same[1]) == list(range(10)), "same seed: a partition of the data"
    mixed = sc.shards(10, 2, seed=[0, 1], shuffle=True)
    assert len(set(mixed[0] + mixed[1])) < 10, "different seeds: some samples are never seen"


def test_save_atomically_keeps_the_last_good_file_when_a_save_fails(tmp_path):
    sc = lesson_module()
    path = tmp_path / "checkpoint.pt"
    sc.save_atomically({"w": torch.zeros(1000)}, str(path))
    good = path.read_bytes()
    with open(path, "rb") as handle, pytest.raises(Exception):
        sc.save_atomically({"w": torch.ones(1000), "log": handle}, str(path))  # cannot be pickled: fails half-way
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["checkpoint.pt"], "the temporary file was not removed"
    # The same failure with a plain torch.save destroys the file: the check above can tell the difference.
    with open(path, "rb") as handle, pytest.raises(Exception):
        torch.save({"w": torch.ones(1000), "log": handle}, path)
    assert path.read_bytes() != good


# ---------------------------------------------------------------- the script
def test_default_run_passes_every_part_and_the_proof(lesson, tmp_path):
    start = time.monotonic()
    result = lesson.run(SCRIPT, cwd=tmp_path)
    elapsed = time.monotonic() - start
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "backend: gloo on cpu (no GPU visible); world size 2" in out
    assert "  rank 1: [1, 4, 7, 0]" in out and "indices [0, 1] appear twice" in out
    assert "(the SAME order every epoch)" in out and "(a new order each epoch)" in out
    assert re.search(r"seed=rank \(wrong\)\s*: 10 samples over 2 ranks, [0-9] distinct seen", out)
    # Evaluation: the padded sampler counts 102 of 101; the right aggregation equals rank 0 alone.
    padded = re.search(r"padded DistributedSampler, sums all-reduced:\s+(\d+)/(\d+)", out)
    right = re.search(r"unpadded shards, correct and total all-reduced:\s+(\d+)/(\d+)", out)
    alone = re.search(r"rank 0 alone with model.module, every sample:\s+(\d+)/(\d+)", out)
    assert padded and right and alone, out
    assert int(padded.group(2)) == 102 and int(right.group(2)) == 101
    assert right.groups() == alone.groups()
    # Checkpoints: bit-identical with the RNG states, measurably different without.
    assert "crash run: killed in the middle of epoch 2 (process 1 terminated with signal SIGKILL)" in out
    line, dloss, dw = proof(out)
    assert line.startswith("PROOF PASSED") and "bit-identical to an uninterrupted run: yes" in line
    assert dloss == 0.0 and dw == 0.0
    assert "evaluation counted 101 of 101 samples once each, as rank 0 alone: yes" in line
    unrestored = re.search(r"WITHOUT restoring the RNG states: max \|dloss\| (\S+), max \|dw\| (\S+) ", out)
    assert unrestored and float(unrestored.group(1)) > 1e-3 and float(unrestored.group(2)) > 1e-3
    assert elapsed < 90, f"default run took {elapsed:.0f} s"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run --crash-at-epoch 2 once; yield (the completed process, seconds, the checkpoint, its sha256)."""
    folder = tmp_path_factory.mktemp("crashed")
    marker = uuid.uuid4().hex
    start = time.monotonic()
    result = run_lesson(SCRIPT, "--crash-at-epoch", 2, "--ckpt-dir", folder, "--timeout", 300, marker=marker)
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_with_marker(marker), "processes left running after the crash run"
    checkpoint = folder / "checkpoint.pt"
    yield result, elapsed, checkpoint, sha256(checkpoint) if checkpoint.exists() else None


def test_a_killed_rank_stops_the_run_quickly_and_leaves_the_last_checkpoint(crashed):
    result, elapsed, checkpoint, _ = crashed
    assert result.returncode == 1
    assert "rank 1: killed in the middle of epoch 2, before step 16 (--crash-at-epoch)" in result.stderr
    assert "RUN FAILED" in result.stderr and "process 1 terminated with signal SIGKILL" in result.stderr
    assert f"the last good checkpoint is intact: {checkpoint} (epoch 2, step 12)" in result.stderr
    assert "PROOF" not in result.stdout
    assert elapsed < 60, f"took {elapsed:.0f} s with --timeout 300: the surviving rank waited instead of being stopped"
    assert os.listdir(checkpoint.parent) == ["checkpoint.pt"], "a temporary file was left behind"


def test_the_checkpoint_holds_plain_types_every_rank_rng_and_no_module_prefix(crashed):
    _, _, checkpoint, _ = crashed
    ck = torch.load(checkpoint, map_location="cpu", weights_only=True)  # plain types and tensors only
    assert ck["epoch"] == 2 and ck["step"] == 12
    assert ck["model"] and not any(k.startswith("module.") for k in ck["model"])
    assert ck["optimizer"]["state"], "AdamW's moments are saved"
    assert len(ck["rng"]) == 2 and not torch.equal(ck["rng"][0]["torch"], ck["rng"][1]["torch"])
    assert [len(losses) for losses in ck["losses"]] == [12, 12]
    assert ck["config"]["world_size"] == 2


def test_resuming_the_crashed_run_is_bit_identical(crashed, lesson, tmp_path):
    _, _, checkpoint, good = crashed
    copy = tmp_path / "checkpoint.pt"
    shutil.copy(checkpoint, copy)  # the resume writes its own checkpoints next to the one it resumes from
    result = lesson.run(SCRIPT, "--resume", copy)
    assert result.returncode == 0, result.stderr
    line, dloss, dw = proof(result.stdout)
    assert line.startswith("PROOF PASSED") and f"resumed from {copy} (epoch 2, step 12)" in line
    assert dloss == 0.0 and dw == 0.0
    assert torch.load(copy, weights_only=True)["epoch"] == 4, "the resumed run went on checkpointing"
    assert sha256(checkpoint) == good


def test_resuming_without_the_rng_states_fails_the_proof(crashed, lesson, tmp_path):
    _, _, checkpoint, _ = crashed
    copy = tmp_path / "checkpoint.pt"
    shutil.copy(checkpoint, copy)
    result = lesson.run(SCRIPT, "--resume", copy, "--no-rng-restore")
    assert result.returncode == 1
    line, dloss, dw = proof(result.stdout)
    assert line.startswith("PROOF FAILED") and dloss > 1e-3 and dw > 1e-3


def bad_copy(kind, good, folder):
    """A bad checkpoint of the given kind, written next to nothing else; returns its path."""
    path = folder / f"{kind}.pt"
    if kind == "missing":
        return path
    if kind == "folder":
        return folder
    data = good.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif kind == "garbage":
        path.write_bytes(b"this is not a checkpoint\n" * 10)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "namespace":
        torch.save({"args": argparse.Namespace(lr=0.01)}, path)
    elif kind == "weights_only":
        torch.save({"weights": torch.zeros(3)}, path)
    return path


BAD_CHECKPOINTS = [
    ("missing", [], "checkpoint not found: "),
    ("truncated", [], "the file is truncated or corrupt ("),
    ("good", ["--world-size", "3"], "was saved by 2 ranks but this run has 3: refused, because"),
    ("garbage", [], "the file is truncated or corrupt ("),
    ("empty", [], "the file is truncated or corrupt (EOFError"),
    ("namespace", [], "refuses to unpickle (argparse.Namespace); store only tensors and plain Python types"),
    ("weights_only", [], "is not a checkpoint of this lesson: it lacks ['config', 'epoch'"),
    ("good", ["--batch-size", "16"], "was trained with --batch-size 8, this run has 16"),
    ("good", ["--epochs", "2"], "already holds 2 epochs, nothing to resume with --epochs 2"),
    ("folder", [], "is a folder; pass the checkpoint file in it, e.g. "),
]


def check_refusal(crashed, kind, extra, message, attempt):
    """Make a bad checkpoint next to the good one, resume from it with attempt(argv) -> (exit code, stderr);
    check the one-line error, and that the good checkpoint and its folder are exactly as before."""
    _, _, checkpoint, good = crashed
    before = sorted(os.listdir(checkpoint.parent))
    path = checkpoint if kind == "good" else bad_copy(kind, checkpoint, checkpoint.parent)
    try:
        code, stderr = attempt(["--resume", str(path), *extra])
    finally:
        if path not in (checkpoint, checkpoint.parent) and path.exists():
            path.unlink()
    assert code == 2, stderr
    assert message in stderr
    assert "Traceback" not in stderr
    assert sha256(checkpoint) == good, "the last good checkpoint was modified"
    assert sorted(os.listdir(checkpoint.parent)) == before, "the refused run wrote files"


@pytest.mark.parametrize("kind, extra, message", BAD_CHECKPOINTS[:3])
def test_a_bad_checkpoint_is_a_clear_error_and_the_good_one_stays_intact(crashed, lesson, kind, extra, message):
    def command_line(argv):
        result = lesson.run(SCRIPT, *argv, timeout=60)
        assert "PROOF" not in result.stdout
        return result.returncode, result.stderr
    check_refusal(crashed, kind, extra, message, command_line)


@pytest.mark.parametrize("kind, extra, message", BAD_CHECKPOINTS[3:])
def test_more_bad_checkpoints_are_refused_before_any_rank_starts(crashed, capsys, kind, extra, message):
    sc = lesson_module()

    def in_this_process(argv):  # main() checks the checkpoint while parsing the flags, before it spawns anything
        with pytest.raises(SystemExit) as exit_info:
            sc.main(argv)
        return exit_info.value.code, capsys.readouterr().err
    check_refusal(crashed, kind, extra, message, in_this_process)


def test_a_crash_before_the_first_checkpoint_does_not_pass_off_an_old_one_as_its_own(crashed, lesson, tmp_path):
    _, _, checkpoint, good = crashed
    shutil.copy(checkpoint, tmp_path / "checkpoint.pt")  # left there by an earlier run
    result = lesson.run(SCRIPT, "--crash-at-epoch", 0, "--ckpt-dir", tmp_path, "--timeout", 300)
    assert result.returncode == 1
    assert "this run wrote no checkpoint: the crash came before the end of its first epoch" in result.stderr
    assert "is from an earlier run" in result.stderr and "intact" not in result.stderr
    assert sha256(tmp_path / "checkpoint.pt") == good


def test_an_impossible_choice_is_a_clear_error_on_the_command_line(lesson, tmp_path):
    result = lesson.run(SCRIPT, "--world-size", "0", timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert "--world-size must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--crash-at-epoch", "2"], "--crash-at-epoch leaves a checkpoint to resume from: name its folder with --ckpt-dir DIR"),
    (["--crash-at-epoch", "4", "--ckpt-dir", "x"], "--crash-at-epoch must be an epoch between 0 and 3"),
    (["--crash-at-epoch", "1", "--ckpt-dir", "x", "--resume", "y"], "use --crash-at-epoch and --resume one at a time"),
    (["--val-samples", "1"], "--val-samples must be at least --world-size (2)"),
    (["--epochs", "1"], "the demonstration crashes in epoch --epochs // 2 and resumes, so it needs --epochs 2 or more"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--crash-at-epoch", "1", "--ckpt-dir", __file__ + "/x"], "--ckpt-dir " + __file__ + "/x: Not a directory"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
])
def test_impossible_choices_are_clear_errors(capsys, args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        lesson_module().parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_help_lists_every_flag(lesson):
    result = lesson.run(SCRIPT, "--help", timeout=60)
    assert result.returncode == 0
    for flag in ["--world-size", "--backend", "--device", "--samples", "--val-samples", "--batch-size", "--epochs",
                 "--lr", "--dropout", "--timeout", "--ckpt-dir", "--resume", "--crash-at-epoch", "--no-rng-restore"]:
        assert flag in result.stdout
