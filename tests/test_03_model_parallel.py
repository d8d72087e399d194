"""Lesson 03 run as a user runs it: python 03_model_parallel/model_parallel.py [flags], and its benchmark script."""
import json
import re
import sys
import time

import pytest
import torch

from conftest import REPO, assert_clear_usage_error, assert_crashed_rank_stops_the_run, assert_help_lists, run_readme_command

SCRIPT = "03_model_parallel/model_parallel.py"
BENCH = "03_model_parallel/bench_pipeline.py"
pytestmark = pytest.mark.timeout(180)
NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def proof(part, stdout):
    """(PASSED or FAILED, the whole line) of one part's proof line."""
    m = re.search(rf"^PROOF (PASSED|FAILED): part {part}: .*$", stdout, re.M)
    assert m, f"no proof line for part {part} in:\n{stdout}"
    return m.group(1), m.group(0)


def numbers(pattern, line):
    m = re.search(pattern, line)
    assert m, f"{pattern!r} not found in: {line}"
    return [float(g) for g in m.groups()]


def pipeline_errors(line):
    """{'naive m=1': 2.8e-09, 'GPipe m=4': ..., '1F1B m=4': ...} from part 3's proof line."""
    found = dict(re.findall(rf"(\w+ m=\d+) max \|dg\| {NUM}", line))
    assert set(found) == {"naive m=1", "GPipe m=4", "1F1B m=4"}, line
    return {k: float(v) for k, v in found.items()}


def order(events):
    return [f"{kind}{mb}" for kind, mb, _, _ in sorted(events, key=lambda e: e[2])]


def test_default_run_passes_all_three_proofs_and_records_each_schedule(lesson, tmp_path):
    start = time.monotonic()
    result = lesson.run(SCRIPT, "--out-dir", tmp_path / "out", "--plot", tmp_path / "timeline.png", cwd=tmp_path)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0].startswith("devices: part 1 (split) on cpu (no GPU visible)")
    assert "both halves share one device here, so this shows correctness, not speed" in out
    assert "rank 0: cpu + cpu; rank 1: cpu + cpu" in out
    assert "3 of 3 proofs passed" in out
    assert elapsed < 60, f"default run took {elapsed:.0f} s"

    status, line = proof(1, out)
    d_out, d_grad = numbers(rf"outputs max \|dy\| {NUM}, gradients max \|dg\| {NUM}", line)
    assert status == "PASSED" and d_out == 0.0 and d_grad == 0.0  # same ops, same device, same order: bit-identical

    status, line = proof(2, out)
    between, global_batch, vs_single = numbers(rf"between ranks {NUM}\); after 5 steps .* global batch of {NUM}: max \|dw\| {NUM}", line)
    assert status == "PASSED" and between == 0.0 and global_batch == 64 and vs_single <= 1e-5

    status, line = proof(3, out)
    errors = pipeline_errors(line)
    assert status == "PASSED" and max(errors.values()) <= 1e-6

    # The files the user asked to keep: loadable with weights_only=True.
    ddp = [torch.load(tmp_path / "out" / f"ddp_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(a, b) for a, b in zip(ddp[0]["params"], ddp[1]["params"]))
    assert ddp[0]["devices"] == ["cpu", "cpu"]
    ranks = [torch.load(tmp_path / "out" / f"pipeline_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(len(t) == 5 and min(t) > 0 for r in ranks for t in r["times"].values())
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # The recorded timeline follows each schedule (m = 4).
    stage0, stage1 = (r["events"] for r in ranks)
    assert order(stage0["naive m=1"]) == ["F0", "B0"] and order(stage1["naive m=1"]) == ["F0", "B0"]
    # GPipe: all forwards, then all backwards, on both stages.
    for stage in (stage0, stage1):
        assert order(stage["GPipe m=4"]) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    # 1F1B: stage 0 warms up with p = 2 forwards, then alternates; the last stage alternates from the start.
    assert order(stage0["1F1B m=4"]) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert order(stage1["1F1B m=4"]) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # Causality across processes (one clock): stage 1 starts micro-batch i after stage 0 finished it, and back for backward.
    for key in ("GPipe m=4", "1F1B m=4"):
        ends0 = {(k, mb): e for k, mb, _, e in stage0[key]}
        starts0 = {(k, mb): s for k, mb, s, _ in stage0[key]}
        for kind, mb, start, end in stage1[key]:
            if kind == "F":
                assert start >= ends0[("F", mb)], f"{key}: stage 1 started F{mb} before stage 0 finished it"
            else:
                assert end <= starts0[("B", mb)], f"{key}: stage 0 started B{mb} before stage 1 finished it"


def test_no_grad_scale_demo_fails_the_pipeline_proof():
    result = run_readme_command(f"python {SCRIPT} --part pipeline --no-grad-scale-demo")  # the README's run
    assert result.returncode == 1
    out = result.stdout
    status, line = proof(3, out)
    errors = pipeline_errors(line)
    assert status == "FAILED" and "0 of 1 proofs passed" in out
    assert errors["naive m=1"] <= 1e-6, "the hand-written split does not use the schedules, it must still pass"
    assert errors["GPipe m=4"] > 1e-3 and errors["1F1B m=4"] > 1e-3
    assert "--no-grad-scale-demo: scale_grads=False" in out


def test_a_crashed_rank_stops_the_run_quickly_with_the_real_error(lesson):
    assert_crashed_rank_stops_the_run(lesson, SCRIPT, "--part", "pipeline")


BAD_INPUT = [
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--microbatches", "1"], "--microbatches must be at least 2"),
    (["--microbatches", "0"], "--microbatches must be at least 2"),
    (["--batch-size", "30"], "--batch-size 30 must be divisible by --microbatches 4"),
    (["--width", "0"], "must be positive"),
    (["--crash-rank", "5"], "--crash-rank must be a rank of part 2 or 3 (0 to 1)"),
    (["--part", "ddp", "--world-size", "1", "--crash-rank", "1"], "--crash-rank must be a rank of part 2 or 3 (0 to 0)"),
    (["--part", "split", "--crash-rank", "0"], "--crash-rank needs part 2 or 3"),
    (["--device", "cuda"], "--device cuda: part split needs 2 GPUs"),
    (["--plot", "no_such_folder/timeline.png"], "--plot needs a .png file name in an existing folder"),
    (["--plot", "."], "--plot needs a .png file name in an existing folder"),
    (["--out-dir", __file__ + "/sub"], "--out-dir"),
]


def test_part_2_alone_does_not_check_micro_batches():
    """Part 2 has no micro-batches: a batch of 30 with the default 4 micro-batches is fine there."""
    sys.path.insert(0, str(REPO / "03_model_parallel"))
    import model_parallel
    args = model_parallel.parse_args(["--part", "ddp", "--batch-size", "30"])
    assert args.batch_size == 30


def test_impossible_choices_are_clear_errors_from_the_command_line(lesson):
    """Two runs as a user runs them: exit 2, the message, no traceback."""
    assert_clear_usage_error(lesson.run(SCRIPT, "--world-size", 0, timeout=60), "--world-size must be at least 1, got 0")
    assert_clear_usage_error(lesson.run(SCRIPT, "--batch-size", 30, timeout=60), "must be divisible by --microbatches 4")


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_impossible_choices_are_refused_by_parse_args(args, message, capsys):
    """Every refused choice, in-process (each subprocess costs 2 s of `import torch`)."""
    if torch.cuda.device_count() >= 4 and "cuda" in message:
        pytest.skip("this machine has the GPUs, so the choice is possible here")
    sys.path.insert(0, str(REPO / "03_model_parallel"))
    import model_parallel
    with pytest.raises(SystemExit) as exit_info:
        model_parallel.parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_help_lists_every_flag(lesson):
    assert_help_lists(lesson.run(SCRIPT, "--help", timeout=60),
                      ["--part", "--device", "--width", "--layers", "--batch-size", "--microbatches", "--steps", "--repeats",
                       "--world-size", "--timeout", "--plot", "--out-dir", "--no-grad-scale-demo", "--crash-rank"])


def test_benchmark_script_runs_and_reports_measured_and_ideal(lesson, tmp_path):
    """A tiny run: the benchmark works end to end. Its numbers at this size mean nothing and are not checked."""
    result = lesson.run(BENCH, "--width", 32, "--layers", 1, "--batch-size", 64, "--repeats", 1, "--out-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(rf"GPipe m=4: {NUM}x over the naive split; ideal \(bubble formula\) 1\.60x; {NUM}% of ideal; target 85%: "
                     r"(MET|NOT MET)", result.stdout), result.stdout
    data = json.loads((tmp_path / "bench_results.json").read_text())
    variants = [(r["variant"], r["m"]) for r in data["rows"]]
    assert variants == [("naive", 1), ("GPipe", 1), ("GPipe", 2), ("GPipe", 4), ("GPipe", 8), ("1F1B", 2), ("1F1B", 4), ("1F1B", 8)]
    assert max(r["max_grad_diff"] for r in data["rows"]) <= 1e-6
    assert (tmp_path / "bench_results.csv").read_text().startswith("variant,m,step_ms_median")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_committed_benchmark_results_are_complete_and_consistent():
    """The committed results (from a real run on an idle machine) hold what the README quotes from them."""
    folder = REPO / "03_model_parallel"
    data = json.loads((folder / "bench_results.json").read_text())
    assert data["hardware"]["threads_per_rank"] == 1 and data["settings"]["microbatches"] == [1, 2, 4, 8]
    rows = {(r["variant"], r["m"]): r for r in data["rows"]}
    naive = rows[("naive", 1)]["step_ms_median"]
    for (variant, m), r in rows.items():
        ideal = 1.0 if variant == "naive" else 2 * m / (m + 1)
        assert r["ideal_speedup"] == pytest.approx(ideal, abs=1e-3)
        assert r["speedup"] == pytest.approx(naive / r["step_ms_median"], rel=1e-2)
        assert r["fraction_of_ideal"] == pytest.approx(r["speedup"] / ideal, abs=2e-3)
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
    gpipe4 = rows[("GPipe", 4)]
    assert data["target_met"] == (gpipe4["fraction_of_ideal"] >= 0.85)
    readme = (folder / "README.md").read_text()
    assert f"{gpipe4['speedup']:.2f}x" in readme and f"{gpipe4['fraction_of_ideal'] * 100:.0f}%" in readme
    assert (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"
