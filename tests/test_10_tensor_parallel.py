"""Lesson 10 and its lab: TP, SP and 2-D equal one process; each step's collectives and the bytes of
parameters per rank are the README's formula; activation checkpointing keeps fewer bytes; context
parallelism by hand equals full attention.

The expected numbers here are worked out by hand from the model's shape (2 blocks, d = 32, 4
heads, vocabulary 32, 8 sequences of 16 per TP group, float32), not taken from the lab: a lab that
counted wrong, or a lesson whose plan changed, fails them. One run of the lab per break: each is
one launch of 4 ranks (about 10 s on 2 cores)."""
import re
import shutil
import subprocess
import sys

import pytest

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_refused_in_process,
                      last_line_matching, lesson_env, load_script, number_after, run_lesson,
                      run_readme_command)

LAB = "10_tensor_parallel/prove.py"
LESSON = "10_tensor_parallel/tensor_parallel.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(150)

# By hand. M: one activation, whole: 8 x 16 x 32 floats. Per block, TP all-reduces twice forward and
# twice backward, plus once each way for the embedding (forward) and the head's input (backward);
# the logits' all-gather sends this rank's 16 of 32 columns. SP: the same layers, reduce-scatter
# and all-gather; its 5 LayerNorms' weight and bias gradients (32 floats) all-reduced at the step.
M = 8 * 16 * 32 * 4
HALF_LOGITS = 8 * 16 * 16 * 4
COLLECTIVES = {
    "tp forward": f"1 all_gather_into_tensor x {HALF_LOGITS:,}, 5 all_reduce x {M:,}",
    "tp backward": f"5 all_reduce x {M:,}",
    "tp step": "none",
    "sp forward": f"6 all_gather_into_tensor x {M // 2:,}, 5 reduce_scatter_tensor x {M:,}",
    "sp backward": f"5 all_gather_into_tensor x {M // 2:,}, 5 reduce_scatter_tensor x {M:,}",
    "sp step": "10 all_reduce x 128",
}
# Parameters, in floats: embedding 32 x 32; per block q, k, v, out 4 x 32 x 32, 2 norms x 64, MLP
# 32 x 128 + 128 + 128 x 32 + 32; the last norm 64; the head 32 x 32 + 32. Whole on every TP rank:
# the 5 norms and the 2 row-split biases (mlp.2.bias).
ALL = 32 * 32 + 2 * (4 * 32 * 32 + 2 * 64 + 32 * 128 + 128 + 128 * 32 + 32) + 64 + 32 * 32 + 32
WHOLE = 5 * 64 + 2 * 32
PER_TP_RANK = ((ALL - WHOLE) // 2 + WHOLE) * 4


def claims(stdout):
    """The PROOF line's five verdicts, as the lab words them."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    return {"equal": "2-D equal one process" in line, "collectives": "collectives are the" in line,
            "params": "parameters per rank are" in line, "checkpointing": "checkpointing keeps" in line,
            "context": "attention equals full" in line, "passed": line.startswith("PROOF PASSED")}


def test_every_claim_holds_and_the_numbers_are_the_hand_worked_ones():
    result = run_readme_command(f"python {LAB}")  # the run the README's output block shows
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(claims(result.stdout).values())
    for name in ("tp", "sp", "2d-sp-ckpt"):
        line = last_line_matching(rf"^{name} +\d ranks, against one process", result.stdout)
        assert number_after("max |dw|", line) <= TOLERANCE
    for label, expected in COLLECTIVES.items():
        line = last_line_matching(rf"^  {label} ", result.stdout)
        assert line.split(None, 2)[2].startswith(expected + "  == formula"), line
    sent = last_line_matching(r"bytes each rank sends", result.stdout)
    tp, sp = (int(n.replace(",", "")) for n in re.findall(r"(?:TP|SP) ([\d,]+)", sent))
    assert tp == 10 * M + HALF_LOGITS and sp - tp == 10 * 128, sent  # a ring of 2 (NOTES.md, 3)
    assert ALL * 4 == 109_184 and PER_TP_RANK == 55_360
    assert f"one process: parameters {ALL * 4:,} B" in result.stdout
    for name, per_rank in (("tp", PER_TP_RANK), ("sp", PER_TP_RANK), ("2d-sp-ckpt", PER_TP_RANK // 2)):
        line = last_line_matching(rf"^{name} +per rank: parameters", result.stdout)
        assert number_after("parameters", line.replace(",", "")) == per_rank, line
        kept = number_after("for backward", line.replace(",", ""))
        assert number_after("with checkpointing", line.replace(",", "")) < kept / 2
    one = number_after("activations kept for backward", last_line_matching(
        r"^one process:", result.stdout).replace(",", ""))
    tp_kept, sp_kept = (number_after("for backward", last_line_matching(
        rf"^{n} +per rank", result.stdout).replace(",", "")) for n in ("tp", "sp"))
    assert sp_kept < tp_kept < one, "TP keeps less than one process, SP less than TP"
    context = last_line_matching(r"^context parallel by hand", result.stdout)
    assert number_after("forward", context) == 0.0 and number_after("gradients", context) <= TOLERANCE
    assert re.search(r"^torch's own context_parallel on cpu: (ran|\w+Error: .+)$", result.stdout, re.M)


def test_gather_per_linear_fails_the_collectives_only_and_the_weights_still_equal():
    result = run_readme_command(f"python {LAB} --break gather-per-linear")  # the README's
    assert result.returncode == 1, result.stderr[-3000:]
    verdicts = claims(result.stdout)
    assert not verdicts.pop("passed") and not verdicts.pop("collectives") and all(verdicts.values())
    assert f"tp backward 9 all_reduce x {M:,}  DIFFERS" in result.stdout  # q, k, v: 3 each block
    assert last_line_matching(r"^  sp forward", result.stdout).startswith(
        f"  sp forward  10 all_gather_into_tensor x {M // 2:,}")
    assert result.stdout.splitlines()[-1] == (
        "LIKELY CAUSE: each of q, k and v gathers (SP) or all-reduces (TP) its input itself: tp "
        "backward +4, sp forward +4, sp backward +8 collectives against the formula; keep the "
        "plan's entries that prepare the input of attention and of the MLP once "
        "(tensor_parallel.py line 70)")


def test_the_four_other_breaks_each_fail_their_own_claim_in_one_launch():
    """Each break touches its own claims (the lab runs them together to save launches): the
    sampler only the 2-D run, checkpointing only the kept bytes, the old all-gather only the
    gradients, the norms left out of SP the sp runs' weights and sp's optimizer step."""
    result = run_lesson(LAB, "--break", "sampler-defaults", "no-checkpoint", "old-all-gather",
                        "sp-norm-not-reduced", timeout=140)
    assert result.returncode == 1, result.stderr[-3000:]
    verdicts = claims(result.stdout)
    assert verdicts == {"equal": False, "collectives": False, "params": True,
                        "checkpointing": False, "context": False, "passed": False}
    against = {name: number_after("max |dw|", last_line_matching(rf"^{name} +\d ranks, against",
                                                                 result.stdout))
               for name in ("tp", "sp", "2d-sp-ckpt")}
    assert against["tp"] <= TOLERANCE and against["sp"] > 1e-2 and against["2d-sp-ckpt"] > 1e-2
    for phase in ("forward", "backward"):  # SP's collectives move the same activations
        assert "== formula" in last_line_matching(rf"^  sp {phase}", result.stdout)
    assert "  sp step     none  DIFFERS from formula (10 all_reduce x 128)" in result.stdout
    for name in ("tp", "sp", "2d-sp-ckpt"):  # checkpointing asked for, and nothing saved
        line = last_line_matching(rf"^{name} +per rank", result.stdout).replace(",", "")
        assert number_after("with checkpointing", line) == number_after("for backward", line)
    context = last_line_matching(r"^context parallel by hand", result.stdout)
    assert number_after("forward", context) == 0.0 and number_after("gradients", context) > 0.1
    causes = result.stdout.splitlines()[-1]  # each break's own cause, in one line
    assert causes.startswith("LIKELY CAUSE: the ranks of a TP group compute on different batches: "
                             "in the 2d-sp-ckpt run the 4 ranks' first batches are 4 different "
                             "ones, where 2 (one per TP group) are right; "), causes
    assert "; and activation checkpointing did not run: " in causes
    assert "; and the all-gather's backward gives wrong gradients: " in causes
    assert ("; and a sequence-parallel norm's gradient is never all-reduced over the tp ranks: "
            "the sp run's 2 ranks end with 10 whole parameter(s) of LayerNorm apart") in causes
    assert "runs 10 all-reduce(s) fewer than the formula" in causes


def test_a_crashed_rank_stops_the_launch_with_its_own_error(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB, rank=1, within=40)


def test_bad_flags_are_one_line(capsys):
    prove = load_script(LAB)
    assert_refused_in_process(prove.parse_args, ["--crash-rank", "4"], capsys, "from 0 to 3")
    assert_refused_in_process(prove.parse_args, ["--epochs", "0"], capsys, "must be positive")
    lesson = load_script(LESSON)
    for world_size, tp in ((3, 2), (3, 3)):  # refused before any process starts
        with pytest.raises(SystemExit, match=f"--tp {tp} must divide --world-size"):
            lesson.main(world_size=world_size, tp=tp)


def test_the_lesson_copied_alone_trains_tp_with_sp_and_checkpointing(tmp_path):
    shutil.copy(REPO / LESSON, tmp_path / "tensor_parallel.py")
    done = subprocess.run([sys.executable, "tensor_parallel.py", "--world-size", "2", "--tp", "2",
                           "--sp", "--act-ckpt"], cwd=tmp_path, env=lesson_env("10"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "backend: gloo (0 GPU(s)); mesh FSDP 1 x TP 2"
    losses = [float(m) for m in re.findall(r"^epoch \d  loss (\S+) on rank 0$", done.stdout, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0] / 2, done.stdout  # it learns to count
    assert "Warning" not in done.stderr, done.stderr[-2000:]
