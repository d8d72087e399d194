"""Lesson 06 run as a user runs it: python 06_collectives/collectives.py [flags], and bench.py's committed results."""
import json
import re
import shutil

import pytest
import torch

from conftest import REPO, assert_crashed_rank_stops_the_run, run_readme_command

SCRIPT = "06_collectives/collectives.py"
BENCH = "06_collectives/bench.py"
pytestmark = pytest.mark.timeout(180)


def normalized(stdout):
    """The printed lines with runs of spaces collapsed, so the checks do not depend on column widths."""
    return [" ".join(line.split()) for line in stdout.splitlines()]


def proof_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("PROOF ")]


# What every rank must print at world size 2, worked out by hand from the inputs [0, 1, 2, 3] + 10 * rank.
TWO_RANKS = [
    "all_reduce(SUM) rank 0: [0, 1, 2, 3] -> [10, 12, 14, 16]",
    "rank 1: [10, 11, 12, 13] -> [10, 12, 14, 16]",
    "all_reduce(MAX) rank 0: [0, 1, 2, 3] -> [10, 11, 12, 13]",
    "broadcast(src=0) rank 0: [0, 1, 2, 3] -> [0, 1, 2, 3]",
    "rank 1: [10, 11, 12, 13] -> [0, 1, 2, 3]",
    "reduce(SUM, dst=0) rank 0: [0, 1, 2, 3] -> [10, 12, 14, 16]",
    "all_gather rank 0: [0, 1, 2, 3] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "rank 1: [10, 11, 12, 13] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "all_gather_into_tensor rank 0: [0, 1, 2, 3] -> [0, 1, 2, 3, 10, 11, 12, 13]",
    "gather(dst=0) rank 0: [0, 1, 2, 3] -> [[0, 1, 2, 3], [10, 11, 12, 13]]",
    "rank 1: [10, 11, 12, 13] -> -",
    "scatter(src=0) rank 0: [[0, 1], [2, 3]] -> [0, 1]",
    "rank 1: - -> [2, 3]",
    "reduce_scatter_tensor(SUM) rank 0: [0, 1, 2, 3] -> [10, 12]",
    "rank 1: [10, 11, 12, 13] -> [14, 16]",
    "all_to_all_single rank 0: [0, 1] -> [0, 10]",
    "rank 1: [10, 11] -> [1, 11]",
    "send/recv (to rank+1) rank 0: [0, 1, 2, 3] -> [10, 11, 12, 13]",
    "isend/irecv (to rank+1) rank 0: [0, 1, 2, 3] -> [10, 11, 12, 13]",
    "SUM -> [10, 12, 14, 16] on every rank",
    "PRODUCT -> [0, 11, 24, 39] on every rank",
    "MIN -> [0, 1, 2, 3] on every rank",
    "AVG -> [5, 6, 7, 8] on every rank",
    "BAND -> [0, 1, 0, 1] on every rank",
    "BOR -> [10, 11, 14, 15] on every rank",
    "BXOR -> [10, 10, 14, 14] on every rank",
]


def chunk_sizes(numel, world):
    """torch.tensor_split's sizes, worked out independently: the first numel % world chunks get one more."""
    return [numel // world + (1 if i < numel % world else 0) for i in range(world)]


def ring_rows(stdout):
    rows = []
    for line in stdout.splitlines():
        tokens = line.replace(",", " ").split()
        if len(tokens) > 3 and all(t.isdigit() for t in tokens[:3]) and int(tokens[0]) in (2, 3, 4, 5):
            n = int(tokens[0])
            rows.append({"n": n, "numel": int(tokens[1]), "bytes": int(tokens[2]), "sent": [int(t) for t in tokens[3:3 + n]],
                         "mean": float(tokens[3 + n]), "tutorial": int(tokens[5 + n]),
                         "diff": float(tokens[6 + n]), "diff_tutorial": float(tokens[7 + n])})
    return rows


def test_default_run_shows_every_collective_and_passes_every_proof():
    result = run_readme_command(f"python {SCRIPT}")  # the README's run: each command runs once
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("backend: gloo on cpu (no GPU visible); world size 2;")
    lines = normalized(result.stdout)
    for expected in TWO_RANKS:
        assert any(line.endswith(expected) for line in lines), f"missing: {expected}"
    assert any("rank 1:" in line and "(not the destination: undefined, not checked)" in line for line in lines)
    arrive, leave = zip(*[map(float, m.groups()) for m in re.finditer(r"arrives at \+(\S+) s -> leaves at \+(\S+) s", result.stdout)])
    assert arrive[1] - arrive[0] >= 0.15, "rank 1 sleeps 0.2 s before the barrier"
    assert min(leave) >= max(arrive) - 0.01, "nobody leaves a barrier before the last rank arrives"
    proofs = proof_lines(result.stdout)
    assert len(proofs) == 4 and all(p.startswith("PROOF PASSED") for p in proofs), proofs
    assert "13 collectives and 8 ReduceOps gave the expected output on all 2 ranks (0 mismatches; refused by gloo: none)" in proofs[0]
    assert "backward() alone synchronises nothing" in result.stdout
    grads_before_sync = float(re.search(r"gradients differ across ranks by (\S+):", result.stdout).group(1))
    assert grads_before_sync > 1e-3
    for proof in proofs[1:3]:  # 2 ranks: dividing by 2 is exact, so hand-made averaging equals DDP bit for bit
        assert "max |grad diff| 0.0e+00, max |dw| 0.0e+00 after 3 steps" in proof
    assert "6 all_reduce calls per step" in proofs[1] and "3 all_reduce calls per step" in proofs[2]
    # The ring: every world size, every size, values equal to dist.all_reduce, bytes as the formulas say.
    rows = ring_rows(result.stdout)
    assert sorted({(r["n"], r["numel"]) for r in rows}) == sorted((n, s) for n in (2, 3, 4) for s in (1, 3, 10, 1000, 1001, 65537))
    for r in rows:
        n, s = r["n"], r["bytes"]
        assert s == 4 * r["numel"]
        assert sum(r["sent"]) == 2 * (n - 1) * s, r  # on average 2(N-1)/N * S per rank
        sizes = chunk_sizes(r["numel"], n)
        assert r["sent"] == [2 * s - 4 * (sizes[(k + 1) % n] + sizes[(k + 2) % n]) for k in range(n)], r
        assert r["tutorial"] == (n - 1) * s
        assert r["diff"] <= 1e-5 and r["diff_tutorial"] <= 1e-5
    assert any(r["n"] == 4 and r["numel"] == 1000 and r["sent"] == [6000] * 4 and r["tutorial"] == 12000 for r in rows)
    assert "the ring equals dist.all_reduce at N = 2, 3, 4" in proofs[3] and "1x, 1.5x, 2x as much" in proofs[3]


def test_three_ranks(lesson):
    result = lesson.run(SCRIPT, "--world-size", 3, "--only", "collectives", "ddp")
    assert result.returncode == 0, result.stderr
    lines = normalized(result.stdout)
    for expected in ["all_to_all_single rank 0: [0, 1, 2] -> [0, 10, 20]", "rank 2: [20, 21, 22] -> [2, 12, 22]",
                     "rank 2: [20, 21, 22, 23, 24, 25] -> [42, 45]", "rank 0: [0, 1, 2, 3] -> [20, 21, 22, 23]",
                     "scatter(src=0) rank 0: [[0, 1], [2, 3], [4, 5]] -> [0, 1]", "AVG -> [10, 11, 12, 13] on every rank"]:
        assert any(line.endswith(expected) for line in lines), f"missing: {expected}"
    proofs = proof_lines(result.stdout)
    assert len(proofs) == 3 and all(p.startswith("PROOF PASSED") for p in proofs), proofs
    for proof in proofs[1:]:
        grad = float(re.search(r"max \|grad diff\| (\S+),", proof).group(1))
        assert grad <= 1e-6, "dividing by 3 rounds differently from DDP, but only in the last bits"


def test_breaking_ddp_by_hand_fails_its_proof(lesson):
    """--break ddp forgets to divide by the world size. (--break buckets drops the last bucket: make_buckets's
    forget_last, checked below without starting processes.)"""
    result = lesson.run(SCRIPT, "--only", "ddp", "--break", "ddp")
    assert result.returncode == 1, result.stderr
    proofs = proof_lines(result.stdout)
    failed = [p for p in proofs if p.startswith("PROOF FAILED")]
    assert len(failed) == 1 and "one all_reduce per parameter does NOT equal DDP" in failed[0], proofs
    assert any(p.startswith("PROOF PASSED") and "buckets of" in p for p in proofs), proofs
    assert float(re.search(r"max \|grad diff\| (\S+),", failed[0]).group(1)) > 1e-3


def test_breaking_the_ring_fails_its_proof():
    result = run_readme_command(f"python {SCRIPT} --only ring --ring-world-sizes 3 --break ring")  # the README's run
    assert result.returncode == 1, result.stderr
    proofs = proof_lines(result.stdout)
    assert len(proofs) == 1 and proofs[0].startswith("PROOF FAILED: the ring does NOT equal dist.all_reduce"), proofs
    assert max(r["diff"] for r in ring_rows(result.stdout)) > 0.1


def test_a_crashed_rank_stops_the_run_within_seconds_and_its_own_error_comes_first(lesson):
    """The peer waiting in a collective fails too ("Connection reset by peer"), and mp.spawn may report either
    rank; the crashed rank's own error must be on stderr, before the peer's."""
    result = assert_crashed_rank_stops_the_run(lesson, SCRIPT, "--only", "collectives", "ddp")
    real, peer = "RuntimeError: rank 1 crashed on purpose (--crash-rank)", result.stderr.find("rank 0 failed:")
    assert peer == -1 or result.stderr.find(real) < peer, result.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--world-size", "1"], "world sizes must be at least 2"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1, got 2"),
    (["--ring-world-sizes", "2", "1"], "world sizes must be at least 2"),
    (["--steps", "0"], "must be positive"),
    (["--backend", "nccl"], "--backend nccl needs one GPU per rank"),
])
def test_impossible_choices_are_clear_errors(lesson, args, message):
    if torch.cuda.device_count() >= 4 and "cuda" in " ".join(args + [message]).lower():
        pytest.skip("this machine has the GPUs, so the choice is possible here")
    result = lesson.run(SCRIPT, *args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_help_lists_every_flag(lesson):
    result = lesson.run(SCRIPT, "--help", timeout=60)
    assert result.returncode == 0
    for flag in ["--world-size", "--ring-world-sizes", "--only", "--backend", "--device", "--bucket-kb", "--steps",
                 "--timeout", "--out-dir", "--break", "--crash-rank"]:
        assert flag in result.stdout


def test_bucketing_follows_backward_order():
    """make_buckets on a model whose sizes we know: last layer first, a new bucket when the cap would be passed."""
    import sys
    sys.path.insert(0, str(REPO / "06_collectives"))
    try:
        from collectives import make_buckets, make_model
    finally:
        sys.path.pop(0)
    model = make_model("cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    params = list(model.parameters())
    buckets = [[names[id(p)] for p in b] for b in make_buckets(params, 8 * 1024)]
    # sizes in bytes: 4.bias 16, 4.weight 1024, 2.bias 256, 2.weight 16384, 0.bias 256, 0.weight 5120
    assert buckets == [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    assert [[names[id(p)] for p in b] for b in make_buckets(params, 8 * 1024, forget_last=True)] == buckets[:2]
    assert len(make_buckets(params, 10 ** 9)) == 1


# --- the benchmark: not timed here; its committed results must be complete and the README must quote them ---

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


def test_bench_redraws_plots_and_the_readme_quotes_its_verdicts(lesson, tmp_path):
    shutil.copy(REPO / "06_collectives" / "bench_results.json", tmp_path / "results.json")
    result = lesson.run(BENCH, "--plot", "--results", tmp_path / "results.json", timeout=120)
    assert result.returncode == 0, result.stderr
    for png in ["bench_allreduce.png", "bench_ddp_split.png", "bench_scaling.png", "bench_buckets.png"]:
        assert (tmp_path / png).stat().st_size > 10_000
    verdicts = re.findall(r"^target (MET|NOT MET): (.*?): (\S+)", result.stdout, re.M)
    assert len(verdicts) == 3, result.stdout
    readme = (REPO / "06_collectives" / "README.md").read_text()
    for met, name, figure in verdicts:
        row = next((line for line in readme.splitlines() if line.startswith("|") and name in line), None)
        assert row, f"the README's targets table has no row for {name!r}"
        assert f"**{'met' if met == 'MET' else 'not met'}**" in row and figure in row, f"README row out of date: {row} vs {met} {figure}"


def test_bench_needs_a_part(lesson, tmp_path):
    result = lesson.run(BENCH, timeout=60)
    assert result.returncode == 2 and "say what to run" in result.stderr
    result = lesson.run(BENCH, "--plot", "--results", tmp_path / "missing.json", timeout=60)
    assert result.returncode == 2 and "no results to plot" in result.stderr
