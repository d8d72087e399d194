"""Lesson 01 run as a user runs it (python 01_dataparallel/dataparallel.py [flags]), plus its building blocks in-process."""
import re
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

from conftest import (REPO, assert_clear_usage_error, assert_help_lists, last_line_matching, number_after,
                      run_readme_command)

SCRIPT = "01_dataparallel/dataparallel.py"
pytestmark = pytest.mark.timeout(120)
NO_GPU = torch.cuda.device_count() == 0

sys.path.insert(0, str(REPO / "01_dataparallel"))
import dataparallel as dp  # noqa: E402  (the lesson script, imported for its building blocks)

PROOF_LINE = re.compile(r"^PROOF (PASSED|FAILED): .* full batch of (\d+), at each of (\d+) steps: outputs max \|dy\| (\S+), "
                        r"gradients max \|dgrad\| (\S+) \(float32, tolerance (\S+)\)$", re.M)


def proof_numbers(stdout):
    """(PASSED or FAILED, batch, steps, max |dy|, max |dgrad|, tolerance) from the proof line."""
    m = PROOF_LINE.search(stdout)
    assert m, f"no proof line in:\n{stdout}"
    return m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5)), float(m.group(6))


# ---- the script, as a subprocess -------------------------------------------------------------------------------------

@pytest.mark.skipif(not NO_GPU, reason="the CPU path's output; a GPU machine runs nn.DataParallel instead")
def test_default_run_from_another_directory_shows_the_pass_through_and_passes_the_proof(lesson, tmp_path):
    start = time.monotonic()
    result = lesson.run(SCRIPT, "--save", tmp_path / "model.pt", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0].startswith("backend: hand-written DataParallel on cpu (no GPU visible, so nn.DataParallel would just call the module)")
    # nn.DataParallel without a GPU: one call with all 32 rows in the main thread, the same output, refusing helpers.
    assert "nn.DataParallel(net) here: device_ids [] (no GPU), so forward() just calls net:" in out
    assert "  inside forward: 32 rows on cpu (MainThread)" in out
    assert number_after("max |dy|", last_line_matching(r"output identical to net\(x\): yes", out)) == 0.0
    for name in ("scatter", "replicate", "parallel_apply", "gather"):
        assert re.search(rf"^  {name}: \w+(Error|Exception): ", out, re.M), f"{name} should refuse CPU tensors"
    assert "  replicate: AssertionError: Broadcast function not implemented for CPU tensors" in out
    assert "  gather: AssertionError: Gather function not implemented for CPU tensors" in out
    # The hand-written step: the scatter is visible from inside forward, 16 rows per replica, each in its own thread.
    assert "  inside forward: 16 rows on cpu (replica 0)" in out and "  inside forward: 16 rows on cpu (replica 1)" in out
    assert len(re.findall(r"^step \d+  loss ", out, re.M)) == 5
    verdict, batch, steps, d_out, d_grad, tolerance = proof_numbers(out)
    assert (verdict, batch, steps, tolerance) == ("PASSED", 32, 5, 1e-6)
    assert d_out <= 1e-6 and d_grad <= 1e-6
    # The scalar-loss pitfall: a vector of 2 losses; backward() refuses it; .mean() is right; .sum() doubles the gradient.
    assert "returns shape (2,), one loss per replica (nn.DataParallel without GPU returns shape ()" in out
    assert "loss.backward()        -> RuntimeError: grad can be implicitly created only for scalar outputs" in out
    mean_line = last_line_matching(r"loss\.mean\(\)\.backward\(\)", out)
    assert number_after("max |dgrad|", mean_line) <= 1e-6 and mean_line.endswith("correct")
    assert number_after("gradient", last_line_matching(r"loss\.sum\(\)\.backward\(\)", out)) == pytest.approx(2.0, abs=1e-4)
    # The "module." prefix, and the file saved without it.
    assert "model.state_dict() 'module.layers.0.weight', ...; model.module.state_dict() 'layers.0.weight'" in out
    assert 'loading model.state_dict() instead fails: Missing key(s) in state_dict: "layers.0.weight"' in out
    saved = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)
    assert set(saved) == set(dp.Net(64).state_dict()), "saved model.module.state_dict(): no 'module.' prefix"
    # Independent check: plain full-batch SGD, written here, ends at the weights the script trained and saved.
    reference = dp.make_model(64)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(1, 6):
        x, y = dp.make_batch(32, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
    assert max((saved[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-6
    # Timing: measured and printed with the hardware, never asserted as a speed.
    assert re.search(r"^timing on .+ \(\d+ cores\), torch \S+: mlp 20-1024-1024-4, batch 512, median of 20 steps", out, re.M)
    timing = last_line_matching(r"^  torch\.set_num_threads\(1\): ", out)
    assert re.search(r"unwrapped [\d.]+ \| [\d.]+; 1 thread [\d.]+ \| [\d.]+; 2 threads [\d.]+ \| [\d.]+; 2 threads vs 1: "
                     r"forward [\d.]+x, whole step [\d.]+x as fast$", timing)
    assert elapsed < 60, f"default run took {elapsed:.0f} s"


@pytest.mark.skipif(not NO_GPU, reason="the CPU path's output")
def test_detached_replicas_fail_the_proof():
    result = run_readme_command(f"python {SCRIPT} --detach-demo --repeats 0")  # the README's run
    assert result.returncode == 1
    assert "--detach-demo: replicas 1.. are detached copies" in result.stdout.splitlines()[0]
    verdict, _, _, d_out, d_grad, tolerance = proof_numbers(result.stdout)
    assert verdict == "FAILED" and "does NOT give" in result.stdout
    assert d_out <= tolerance, "the forward is still right: only replica 1's gradient is lost"
    assert d_grad > 1e-3


@pytest.mark.skipif(not NO_GPU, reason="the CPU path's output")
def test_three_replicas_get_uneven_chunks_and_still_pass(lesson):
    result = lesson.run(SCRIPT, "--replicas", 3, "--repeats", 0)
    assert result.returncode == 0, result.stderr
    for i, rows in enumerate((11, 11, 10)):
        assert f"  inside forward: {rows} rows on cpu (replica {i})" in result.stdout
    verdict, _, _, d_out, d_grad, _ = proof_numbers(result.stdout)
    assert verdict == "PASSED" and d_out <= 1e-6 and d_grad <= 1e-6
    # Loss per replica with chunks of 11, 11 and 10 rows: the mean of the 3 means is NOT the mean over 32 rows.
    mean_line = last_line_matching(r"loss\.mean\(\)\.backward\(\)", result.stdout)
    assert number_after("max |dgrad|", mean_line) > 1e-5 and "NOT equal" in mean_line
    assert number_after("gradient", last_line_matching(r"loss\.sum\(\)\.backward\(\)", result.stdout)) == pytest.approx(3, rel=0.1)


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "--replicas must be at least 1, got 0"),
    (["--device", "cuda"], "--device cuda runs nn.DataParallel on one GPU per replica, at least 2"),
    (["--batch-size", "1"], "--batch-size and --bench-batch must be at least --replicas (2)"),
    (["--steps", "0"], "must be positive"),
    (["--detach-demo", "--replicas", "1"], "--detach-demo needs at least 2 replicas"),
    (["--save", "/no/such/directory/model.pt"], "--save needs a file name in an existing directory"),
])
def test_impossible_choices_are_clear_errors(lesson, args, message):
    if torch.cuda.device_count() >= 2 and "cuda" in args:
        pytest.skip("this machine has the GPUs, so the choice is possible here")
    assert_clear_usage_error(lesson.run(SCRIPT, *args, timeout=60), message)


def test_help_lists_every_flag(lesson):
    assert_help_lists(lesson.run(SCRIPT, "--help", timeout=60),
                      ["--device", "--replicas", "--batch-size", "--steps", "--hidden", "--lr", "--save", "--repeats",
                 "--bench-hidden", "--bench-batch", "--detach-demo"])


# ---- the building blocks, in-process ---------------------------------------------------------------------------------

@pytest.mark.parametrize("threaded", [True, False])
def test_hand_written_step_gives_the_unwrapped_outputs_and_summed_gradients(threaded):
    model, (x, y) = dp.make_model(16), dp.make_batch(12)
    shells = [dp.Net(16) for _ in range(3)]
    expected = model(x)
    nn.functional.cross_entropy(expected, y).backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = dp.hand_written_data_parallel(model, shells, x, threaded=threaded)
    nn.functional.cross_entropy(out, y).backward()
    assert out.shape == expected.shape and (out - expected).abs().max() <= 1e-6
    for p, g in zip(model.parameters(), expected_grads):
        assert (p.grad - g).abs().max() <= 1e-6
    assert all(s.layers[0].weight.grad is None for s in shells), "the shells only lend their structure"


def test_replicas_run_in_their_own_threads_on_their_own_chunks(capsys):
    model, x = dp.make_model(8), dp.make_batch(10)[0]
    seen = []
    replicas = [lambda chunk, i=i: seen.append((i, len(chunk), threading.current_thread().name)) or chunk for i in range(2)]
    dp.parallel_apply(replicas, [c for (c,) in dp.scatter((x,), 2)])
    assert sorted(seen) == [(0, 5, "replica 0"), (1, 5, "replica 1")]
    dp.Net.report = True
    try:
        dp.hand_written_data_parallel(model, [dp.Net(8), dp.Net(8)], x)
    finally:
        dp.Net.report = False
    printed = capsys.readouterr().out
    assert "inside forward: 5 rows on cpu (replica 0)" in printed and "inside forward: 5 rows on cpu (replica 1)" in printed


def test_an_error_in_a_replica_thread_reaches_the_caller():
    def broken(chunk):
        raise ValueError("replica failed")
    with pytest.raises(ValueError, match="replica failed"):
        dp.parallel_apply([lambda c: c, broken], [torch.zeros(1), torch.zeros(1)])


def test_detached_replicas_lose_their_gradient():
    model, (x, y) = dp.make_model(8), dp.make_batch(8)
    nn.functional.cross_entropy(model(x[:4]), y[:4], reduction="sum").backward()
    only_first_half = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    out = dp.hand_written_data_parallel(model, [dp.Net(8), dp.Net(8)], x, detach=True)
    nn.functional.cross_entropy(out, y, reduction="sum").backward()
    for p, g in zip(model.parameters(), only_first_half):
        assert (p.grad - g).abs().max() <= 1e-5, "with replica 1 detached, only replica 0's rows reach the gradient"


def test_gathered_scalar_losses_are_a_vector_that_backward_refuses():
    model, (x, y) = dp.make_model(8), dp.make_batch(8)
    loss_model = dp.NetWithLoss(model)
    losses = dp.hand_written_data_parallel(loss_model, [dp.NetWithLoss(dp.Net(8)) for _ in range(2)], x, y)
    assert losses.shape == (2,)
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        losses.backward()


@pytest.mark.skipif(not NO_GPU, reason="what nn.DataParallel does WITHOUT a GPU")
def test_nn_dataparallel_without_gpu_just_calls_the_module():
    net, x = dp.make_model(8), dp.make_batch(6)[0]
    wrapped = nn.DataParallel(net)
    assert wrapped.device_ids == []
    assert torch.equal(wrapped(x), net(x))
    assert nn.DataParallel(net, device_ids=[0, 1]).device_ids == [], "explicit device_ids are ignored too"
    with pytest.raises(AssertionError, match="not implemented for CPU tensors"):
        torch.nn.parallel.replicate(net, [0, 1])
    with pytest.raises(AssertionError, match="not implemented for CPU tensors"):
        torch.nn.parallel.gather(list(x.chunk(2)), 0)
    for call in (lambda: torch.nn.parallel.scatter(x, [0, 1]), lambda: torch.nn.parallel.parallel_apply([net, net], list(x.chunk(2)))):
        with pytest.raises(Exception):
            call()
    assert list(wrapped.state_dict())[0] == "module.layers.0.weight"
