"""Lesson 02 run as a user runs it: python 02_ddp_spawn/ddp_spawn.py [flags]."""
import re
import time

import pytest
import torch

from conftest import assert_clear_usage_error, assert_crashed_rank_stops_the_run, assert_help_lists


SCRIPT = "02_ddp_spawn/ddp_spawn.py"
pytestmark = pytest.mark.timeout(180)


PROOF_LINE = re.compile(r"^PROOF (PASSED|FAILED): .* \(max \|dw\| between ranks (\S+)\); .* global batch of (\d+): "
                        r"max \|dw\| (\S+) \(", re.M)


def proof_numbers(stdout):
    """(line, max |dw| between ranks, global batch, max |dw| against the single process) from the proof line."""
    m = PROOF_LINE.search(stdout)
    assert m, f"no proof line in:\n{stdout}"
    return m.group(0), float(m.group(2)), int(m.group(3)), float(m.group(4))


def test_default_run_from_another_directory_passes_the_proof(lesson, tmp_path):
    start = time.monotonic()
    result = lesson.run(SCRIPT, "--out-dir", tmp_path / "out", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert "backend: gloo on cpu (no GPU visible); world size 2" in result.stdout
    line, between, global_batch, vs_single = proof_numbers(result.stdout)
    assert line.startswith("PROOF PASSED")
    assert between == 0.0 and vs_single <= 1e-5 and global_batch == 32
    assert "loss averaged over ranks" in result.stdout
    assert "DDP averaged the gradients inside backward()" in result.stdout
    assert elapsed < 60, f"default run took {elapsed:.0f} s"
    # The files the user asked to keep: one per rank, loadable with weights_only=True, identical weights.
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["local_losses"] != ranks[1]["local_losses"], "each rank's local loss should differ"
    assert ranks[0]["mean_losses"] == ranks[1]["mean_losses"], "the logged average is the same everywhere"
    assert all(torch.equal(ranks[0]["state"][k], ranks[1]["state"][k]) for k in ranks[0]["state"])
    assert not any(k.startswith("module.") for k in ranks[0]["state"]), "saved model.module.state_dict()"


def test_three_ranks_pass(lesson):
    result = lesson.run(SCRIPT, "--world-size", 3)
    assert result.returncode == 0, result.stderr
    _, between, global_batch, vs_single = proof_numbers(result.stdout)
    assert between == 0.0 and vs_single <= 1e-5 and global_batch == 48


def test_resnet18_with_groupnorm_passes_in_float64(lesson):
    result = lesson.run(SCRIPT, "--model", "resnet18", "--samples", 32, "--batch-size", 8, "--epochs", 1)  # 2 steps: enough
    assert result.returncode == 0, result.stderr
    assert "model resnet18 in float64" in result.stdout
    _, between, _, vs_single = proof_numbers(result.stdout)
    assert between == 0.0 and vs_single <= 1e-10


def test_breaking_gradient_sync_fails_the_proof(lesson):
    result = lesson.run(SCRIPT, "--no-sync-demo")
    assert result.returncode == 1
    line, between, _, vs_single = proof_numbers(result.stdout)
    assert line.startswith("PROOF FAILED") and "identical parameters: NO" in line
    assert between > 1e-3 and vs_single > 1e-3
    assert "gradients were NOT synchronised" in result.stdout


def test_two_concurrent_runs_do_not_collide(lesson):
    runs = [lesson.start(SCRIPT, "--samples", 64, "--epochs", 1) for _ in range(2)]
    outputs = [run.communicate(timeout=150) for run in runs]
    for run, (stdout, stderr) in zip(runs, outputs):
        assert run.returncode == 0, stderr
        assert "PROOF PASSED" in stdout


def test_a_crashed_rank_stops_the_whole_run_quickly_with_the_real_error(lesson):
    assert_crashed_rank_stops_the_run(lesson, SCRIPT)


@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--samples, --batch-size, --epochs, --lr and --timeout must be positive"),
    (["--crash-rank", "0", "--samples", "16", "--epochs", "1"], "--crash-rank crashes at step 2, but this run has 1 step(s)"),
    (["--no-sync-demo", "--world-size", "1"], "--no-sync-demo needs --world-size 2 or more"),
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--backend", "nccl"], "--backend nccl needs --device cuda and one GPU per rank"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
    (["--device", "cuda"], "--device cuda needs one GPU per rank"),
    (["--crash-rank", "5"], "--crash-rank must be a rank between 0 and 1"),
    (["--batch-size", "0"], "must be positive"),
])
def test_impossible_choices_are_clear_errors(lesson, args, message):
    if torch.cuda.device_count() >= 2 and args[-1] != "cpu" and ("cuda" in args or "nccl" in args):
        pytest.skip("this machine has the GPUs, so the choice is possible here")
    assert_clear_usage_error(lesson.run(SCRIPT, *args, timeout=60), message)


def test_help_lists_every_flag(lesson):
    assert_help_lists(lesson.run(SCRIPT, "--help", timeout=60),
                      ["--world-size", "--backend", "--device", "--model", "--dtype", "--samples", "--batch-size", "--epochs",
                 "--lr", "--timeout", "--out-dir", "--no-sync-demo", "--crash-rank"])
