"""Lesson 06 and its lab: gradients averaged by hand equal DDP, and the ring equals dist.all_reduce.

Command-line runs are what a user sees (the lab's proof, its breaks, a crashed rank, the lesson
copied alone); the lesson's and the lab's pieces are tested in-process, where no rank has to start.
The benchmark is not run: its committed results are checked, and NOTES.md must quote them."""
import json
import re
import shutil

import pytest
import torch

from conftest import (assert_help_in_process, assert_refused_in_process,
                      REPO, assert_crashed_rank_stops_the_run, last_line_matching, load_script,
                      number_after, run_readme_command)

LAB = "06_collectives/prove.py"
LESSON = "06_collectives/collectives.py"
BENCH = "06_collectives/bench.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


@pytest.fixture(scope="module")
def lesson_module():
    return load_script(LESSON)


def proof(stdout):
    """(passed, max |dw| between ranks, against DDP, max |ring - all_reduce|) from the PROOF line."""
    line = last_line_matching(r"^PROOF (PASSED|FAILED): ", stdout)
    return (line.startswith("PROOF PASSED"), number_after("max |dw| between ranks", line),
            number_after("against DDP", line), number_after("max |ring - all_reduce|", line))


def chunk_sizes(numel, n):
    """torch.tensor_split's sizes, worked out independently: the first numel % n chunks get one more."""
    return [numel // n + (1 if i < numel % n else 0) for i in range(n)]


def ring_rows(stdout):
    """{(N, elements): (bytes sent by each rank, max |ring - all_reduce|)} from the ring table."""
    rows = {}
    for line in stdout.splitlines():
        tokens = line.split()
        if len(tokens) > 4 and tokens[0].isdigit() and tokens[1].isdigit() and "e" in tokens[-1]:
            n = int(tokens[0])
            rows[n, int(tokens[1])] = ([int(t) for t in tokens[2:2 + n]], float(tokens[-1]))
    return rows


# What each rank must print at 2 ranks, worked out by hand from the inputs [0, 1, 2, 3] + 10 * rank.
TOUR_AT_TWO_RANKS = [
    "broadcast(src=0) rank 0: [0, 1, 2, 3] -> [0, 1, 2, 3]",
    "rank 1: [10, 11, 12, 13] -> [0, 1, 2, 3]",
    "reduce(SUM, dst=0) rank 0: [0, 1, 2, 3] -> [10, 12, 14, 16]",
    "all_reduce(SUM) rank 0: [0, 1, 2, 3] -> [10, 12, 14, 16]",
    "rank 1: [10, 11, 12, 13] -> [10, 12, 14, 16]",
    "all_reduce(MAX) rank 0: [0, 1, 2, 3] -> [10, 11, 12, 13]",
    "all_gather rank 0: [0, 1, 2, 3] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "rank 1: [10, 11, 12, 13] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "gather(dst=0) rank 0: [0, 1, 2, 3] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "rank 1: [10, 11, 12, 13] -> -",
    "scatter(src=0) rank 0: [[0, 1], [2, 3]] -> [0, 1]",
    "rank 1: - -> [2, 3]",
    "reduce_scatter(SUM) rank 0: [0, 1, 2, 3] -> [10, 12]",
    "rank 1: [10, 11, 12, 13] -> [14, 16]",
    "all_to_all rank 0: [0, 1] -> [0, 10]",
    "rank 1: [10, 11] -> [1, 11]",
]


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_the_default_run_proves_every_claim():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    passed, between, vs_ddp, ring = proof(result.stdout)
    # 2 ranks: dividing by 2 is exact, so the hand-made averages equal DDP's to the bit
    assert passed and between == 0.0 and vs_ddp == 0.0 and ring <= TOLERANCE
    out = result.stdout
    # The model is Linear(20, 64), ReLU, Linear(64, 4) in float32, last layer first:
    # 2.bias 4 x 4 B, 2.weight 256 x 4 B, 0.bias 64 x 4 B, 0.weight 1280 x 4 B; a 4 KiB cap
    # takes the first three (1296 B) and leaves 0.weight (5120 B) alone.
    assert "(4 all-reduces per step, of 16, 1024, 256, 5120 bytes)" in out
    assert out.count("(2 all-reduces per step, of 1296, 5120 bytes)") == 2
    for n in (3, 4):
        if torch.cuda.device_count() < n:
            assert f"ring at {n} ranks: backend gloo" in out, "each part says which backend it uses"
    lines = [" ".join(line.split()) for line in out.splitlines()]
    for expected in TOUR_AT_TWO_RANKS:
        assert any(line.endswith(expected) for line in lines), f"missing: {expected}"
    arrive, leave = zip(*[map(float, m.groups()) for m in
                          re.finditer(r"arrives \+(\S+) s, leaves \+(\S+) s", out)])
    assert arrive[1] - arrive[0] >= 0.15, "rank 1 sleeps 0.2 s before the barrier"
    assert min(leave) >= max(arrive) - 0.01, "nobody leaves a barrier before the last rank arrives"
    rows = ring_rows(out)
    assert sorted(rows) == [(n, s) for n in (2, 3, 4) for s in (1, 3, 10, 1000, 1001, 65537)]
    for (n, numel), (sent, diff) in rows.items():
        sizes = chunk_sizes(numel, n)  # rank r sends every chunk but r+1's, and r+2's... once each:
        # 2(N-1) steps, chunk (r - t) mod N at step t
        assert sent == [4 * sum(sizes[(r - t) % n] for t in range(2 * (n - 1))) for r in range(n)]
        assert sum(sent) == 2 * (n - 1) * 4 * numel  # on average 2(N-1)/N * S per rank
        assert diff <= TOLERANCE
    assert rows[4, 1000][0] == [6000] * 4, "2(N-1)/N * S = 1.5 x 4000 bytes at N = 4"


@pytest.mark.parametrize("command, ranks_identical, ring_fails, cause", [
    (f"python {LAB} --break no-divide --ring-world-sizes 2", True, False,
     "LIKELY CAUSE: the gradients are summed, never divided by N = 2: average_gradients gives 2.00 "
     "times the mean of the ranks' gradients; divide the all-reduced sum by the world size "
     "(collectives.py line 51)"),
    (f"python {LAB} --break forget-last-bucket --ring-world-sizes 2", False, False,
     "LIKELY CAUSE: a bucket is never all-reduced: no bucket holds 0.weight, where each rank keeps "
     "its own gradient, so the ranks drift apart ("),
    (f"python {LAB} --break ring-skips-a-step --ring-world-sizes 3", True, True,  # the README's
     "LIKELY CAUSE: the ring loses ranks' parts: on x = 2**rank at N = 3, its elements hold 1 to 1 "
     "of the 3 ranks' parts; every one of its 2(N-1) steps must send a chunk and add "
     "(reduce-scatter) or keep (all-gather) what arrives (collectives.py line 72)"),
])
def test_each_break_fails_the_proof_and_names_its_cause(command, ranks_identical, ring_fails, cause):
    result = run_readme_command(command)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith(cause), result.stdout[-1000:]
    passed, between, vs_ddp, ring = proof(result.stdout)
    assert not passed
    assert vs_ddp > 1e-3, "a broken run must be far from DDP, not at rounding level"
    # no-divide: every rank takes the same (doubled) step, so the ranks agree, on the wrong
    # weights; the forgotten bucket leaves the first layer to each rank's own gradient.
    assert (between == 0.0) == ranks_identical
    assert (ring > 0.1) == ring_fails
    if ring_fails:
        assert "each rank sending NOT 2(N-1)/N * S bytes" in result.stdout


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB, "--ring-world-sizes", 2)


# --- the lesson alone ----------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs(lesson, tmp_path):
    """One rank (a process group of its own, at half the start-up cost of two): the lab runs the
    same worker at 2, 3 and 4 ranks."""
    shutil.copy(REPO / LESSON, tmp_path / "collectives.py")
    result = lesson.run(tmp_path / "collectives.py", "--world-size", 1, "--epochs", 1, "--ring",
                        "--bucket-kb", 1, cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 1" in result.stdout
    # 256 samples in batches of 16; a 1 KiB cap: 16 + 1024 bytes do not fit, so one per parameter
    assert "trained 16 steps, 4 bucket(s) all-reduced by ring_all_reduce" in result.stdout


# --- the lesson's pieces, in-process: no rank needed -----------------------------------------------

def names_of(model, buckets):
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in bucket] for bucket in buckets]


def test_buckets_follow_backward_order_and_never_lose_a_parameter(lesson_module):
    model = lesson_module.make_model()
    make = lambda cap: names_of(model, lesson_module.make_buckets(model.parameters(), cap))  # noqa
    assert make(4096) == [["2.bias", "2.weight", "0.bias"], ["0.weight"]]
    assert make(0) == [["2.bias"], ["2.weight"], ["0.bias"], ["0.weight"]], "0: one per parameter"
    assert make(1040) == [["2.bias", "2.weight"], ["0.bias"], ["0.weight"]], "a cap is inclusive"
    assert make(10 ** 9) == [["2.bias", "2.weight", "0.bias", "0.weight"]]


def test_average_gradients_divides_and_copies_every_gradient_back(lesson_module, prove):
    """A stand-in all_reduce that doubles (two ranks with equal gradients) and N = 2: every gradient
    must come back unchanged, in its own parameter; the lab's no-divide break doubles them."""
    model = lesson_module.make_model()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    before = [p.grad.clone() for p in model.parameters()]
    calls = []

    def doubling(t):
        calls.append(t.numel())
        t.mul_(2)
    buckets = lesson_module.make_buckets(model.parameters(), 4096)
    lesson_module.average_gradients(buckets, 2, doubling)
    assert calls == [4 + 256 + 64, 1280], "one message per bucket, last layer first"
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    prove.sum_gradients(buckets, 2, doubling)
    assert all(torch.equal(p.grad, 2 * g) for p, g in zip(model.parameters(), before))


def test_the_labs_byte_count_is_2_n_minus_1_chunks_per_rank(prove):
    for n in range(1, 6):
        for numel in (1, 3, 10, 1001):
            sent = prove.bytes_each_rank_sends(numel, n)
            assert sum(sent) == 2 * (n - 1) * 4 * numel
            assert max(sent) - min(sent) <= 4 * 2, "chunks differ by one element at most"


# --- guard rails and help, in-process ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "must be positive"),
    (["--ring-world-sizes", "2", "0"], "must be positive"),
    (["--bucket-kb", "0"], "must be positive"),
    (["--timeout", "0"], "must be positive"),
    (["--break", "no-divide", "--world-size", "1"], "--break no-divide needs --world-size 2 or more"),
    (["--break", "ring-skips-a-step", "--ring-world-sizes", "1"], "needs a ring of 2 ranks or more"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
    (["--crash-rank", "0", "--epochs", "1", "--batch-size", "128"], "but this run has 1 step(s)"),
    (["--break", "ddp"], "invalid choice: 'ddp'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_cuda_without_a_gpu_per_rank_is_refused(prove, capsys):
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has one GPU per rank for every part")
    with pytest.raises(SystemExit) as exit_:
        prove.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda needs one GPU per rank" in capsys.readouterr().err


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--world-size", "--epochs", "--batch-size", "--lr", "--bucket-kb",
                                              "--ring-world-sizes", "--device", "--break", "--crash-rank",
                                              "--timeout", *prove.BREAKS], capsys)


# --- the benchmark: not run here; its committed results must be complete and NOTES must quote them --

@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH)


def committed_results():
    return json.loads((REPO / "06_collectives" / "bench_results.json").read_text())


def test_committed_benchmark_results_are_complete():
    results = committed_results()
    assert {"cpu", "cores", "torch"} <= set(results["machine"])
    assert len(results["allreduce"]) >= 2, "repeat the all-reduce sweep to show its spread"
    for run in results["allreduce"]:
        assert run["bytes"][0] == 1024 and run["bytes"][-1] == 64 * 2 ** 20
        assert set(run["seconds"]) == {"dist.all_reduce", "ring (this lesson)", "tutorial ring (unchunked)"}
    assert len(results["scaling"]) >= 2
    for run in results["scaling"]:
        assert {8, 16, 32, 64, 128} <= set(run["batches"])
        assert all(len(samples) >= 10 for samples in run["step"])
    assert len(results["buckets"]) >= 2 and results["buckets"][0]["caps"][:4] == ["1", "5", "25", "100"]
    for png in ["bench_allreduce.png", "bench_ddp_split.png", "bench_scaling.png", "bench_buckets.png"]:
        assert (REPO / "06_collectives" / png).stat().st_size > 10_000


def test_notes_quote_the_benchmarks_verdicts(bench):
    verdicts = bench.targets(committed_results())
    assert len(verdicts) == 3
    notes = (REPO / "06_collectives" / "NOTES.md").read_text()
    for name, measured, _, met in verdicts:
        row = next((line for line in notes.splitlines() if line.startswith("|") and name in line), None)
        assert row, f"NOTES.md's targets table has no row for {name!r}"
        figure = measured.split()[0]
        assert f"**{'met' if met else 'not met'}**" in row and figure in row, f"out of date: {row}"


def test_the_benchmark_needs_a_part(bench, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench.main([])
    assert exit_.value.code == 2 and "say what to run" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--plot", "--results", str(tmp_path / "missing.json")])
    assert exit_.value.code == 2 and "no results to plot" in capsys.readouterr().err
