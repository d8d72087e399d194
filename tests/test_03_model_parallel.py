"""Lesson 03 and its lab: the split model equals the unsplit one, under DDP it equals one process on
the global batch, and the pipeline (GPipe, 1F1B) equals one process on the same batches.

Command-line runs are what a user sees (the lab's proof, its breaks, a crashed rank, the lesson
copied alone); the lesson's and the lab's pieces are tested in-process, where no rank has to start."""
import itertools
import json
import re
import shutil
import sys

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from conftest import (assert_help_in_process, assert_refused_in_process,
                      REPO, assert_crashed_rank_stops_the_run, last_line_matching, load_script, number_after,
                      run_readme_command)

LAB = "03_model_parallel/prove.py"
LESSON = "03_model_parallel/model_parallel.py"
TOLERANCE = 1e-5
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def prove():
    return load_script(REPO / LAB)


def measured(stdout):
    """The numbers the lab prints: split |dy| and |dg|, DDP between ranks and against one process,
    each pipeline schedule against one process, and whether the proof passed."""
    split = last_line_matching(r"^split model, one process", stdout)
    ddp = last_line_matching(r"^split under DDP: max \|dw\| between ranks", stdout)
    pipe = last_line_matching(r"^pipeline against one process", stdout)
    return {"dy": number_after("max |dy|", split), "dg": number_after("max |dg|", split),
            "between": number_after("between ranks", ddp), "ddp": number_after("against one process", ddp),
            "gpipe": number_after("gpipe max |dw|", pipe), "1f1b": number_after("1f1b max |dw|", pipe),
            "passed": last_line_matching(r"^PROOF (PASSED|FAILED)", stdout).startswith("PROOF PASSED")}


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_the_lab_proves_the_three_claims():
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stderr[-3000:]
    m = measured(result.stdout)
    assert m["passed"]
    assert m["dy"] == 0.0 and m["dg"] == 0.0, "on one CPU the split runs the same operations: bit-identical"
    assert m["between"] == 0.0 and m["ddp"] <= TOLERANCE
    assert m["gpipe"] <= TOLERANCE and m["1f1b"] <= TOLERANCE
    assert "split under DDP: 16 steps" in result.stdout, "the lesson's own line, from rank 0"
    assert result.stdout.count("pipeline: 16 steps") == 2, "one line per schedule, from the last stage"


def test_break_no_grad_scale_fails_the_pipeline_proof_only():
    result = run_readme_command(f"python {LAB} --break no-grad-scale")  # shared with the README's block
    assert result.returncode == 1, result.stderr[-3000:]
    m = measured(result.stdout)
    assert not m["passed"]
    assert m["gpipe"] > 1e-2 and m["1f1b"] > 1e-2, "4 micro-batches: gradients 4 times too large"
    assert m["dg"] == 0.0 and m["between"] == 0.0 and m["ddp"] <= TOLERANCE, "the other parts are unchanged"
    assert re.fullmatch(r"LIKELY CAUSE: the pipeline sums the 4 micro-batches' mean gradients: its weights "
                        r"equal one process trained with lr x 4 \(max \|dw\| \S+\); .* "
                        r"\(model_parallel\.py line \d+\)", result.stdout.strip().splitlines()[-1])


def test_break_detached_activations_fails_the_split_proof_only():
    result = run_readme_command(f"python {LAB} --break detached-activations")
    assert result.returncode == 1, result.stderr[-3000:]
    m = measured(result.stdout)
    assert not m["passed"]
    assert m["dy"] == 0.0 and m["dg"] > 1e-3, "the outputs are right, stage 0's gradients are missing"
    assert m["ddp"] <= TOLERANCE and m["gpipe"] <= TOLERANCE, "the ranks run the lesson unchanged"
    assert re.fullmatch(r"LIKELY CAUSE: the activations are detached between the stages: the outputs equal "
                        r"the unsplit model's \(max \|dy\| 0\.0e\+00\) but stage0\.0\.weight, stage0\.0\.bias "
                        r"get no gradient; .* \(model_parallel\.py line \d+\)", result.stdout.strip().splitlines()[-1])


def test_a_crash_in_the_learners_file_is_one_line_naming_it(monkeypatch, tmp_path, capsys):
    """--lesson my_crash.py, in this process: the learner's make_dataset raises before any rank
    starts, and the lab ends with one LIKELY CAUSE line on stderr (course.run_lab)."""
    mine = (REPO / LESSON).read_text().replace("    return TensorDataset(x, y)", "    return TensorDataset(x, y[:-1])")
    (tmp_path / "my_crash.py").write_text(mine)
    monkeypatch.setenv("COURSE_LESSON", str(tmp_path / "my_crash.py"))
    saved = sys.modules.pop("model_parallel", None)  # the learner's file takes its name
    try:
        lab = load_script(REPO / LAB)
        assert lab.course.run_lab(lab.main, []) == 1
    finally:  # the crashing file must not stay the module the other tests import
        sys.modules.pop("model_parallel", None)
        if saved is not None:
            sys.modules["model_parallel"] = saved
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"LIKELY CAUSE: your file raised AssertionError: .* \(my_crash\.py "
                                          r"line \d+, in make_dataset\): fix it there", err[0]), err


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone ----------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs(lesson, tmp_path):
    shutil.copy(REPO / LESSON, tmp_path / "model_parallel.py")
    # batch 10: the pipeline's 256 / 20 leaves a short last batch, which a stage (its shapes fixed
    # at the first step) cannot take: the lesson's loader drops it
    result = lesson.run(tmp_path / "model_parallel.py", "--world-size", 1, "--epochs", 1, "--batch-size", 10,
                        "--schedule", "1f1b", cwd=tmp_path, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "split under DDP: gloo (no GPU visible); 1 ranks x 2 devices" in result.stdout or \
        torch.cuda.device_count() >= 2
    assert "split under DDP: 26 steps" in result.stdout  # one rank, batch 10: 256 / 10, rounded up
    assert "pipeline: 12 steps" in result.stdout  # the pipeline's batch is 20: 256 // 20 whole ones


# --- the lesson's pieces, in-process -------------------------------------------------------------

def test_the_split_model_holds_the_unsplit_models_weights():
    lesson = load_script(REPO / LESSON)
    unsplit = lesson.make_model()
    split = lesson.TwoDeviceModel(lesson.make_model(), torch.device("cpu"), torch.device("cpu"))
    pairs = list(zip(unsplit.parameters(), split.parameters()))
    assert len(pairs) == 4 and all(torch.equal(a, b) for a, b in pairs)


def test_the_split_under_ddp_on_one_rank_equals_one_process(prove):
    """The lesson's DDP worker, in this process (a world of one): it returns the model it trained."""
    lesson, threads = prove.lesson, torch.get_num_threads()
    try:  # the worker sets this process's thread count, as a rank does
        model, losses = lesson.train_split_model_with_ddp(0, 1, lesson.find_free_port(), "gloo", 1, 32, 0.05)
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == 8
    reference = prove.train_unsplit(prove.global_batches(1, 1, 32), 0.05)
    assert prove.max_diff(prove.params(model), reference) <= TOLERANCE


def test_the_detached_split_loses_stage_0s_gradients(prove, monkeypatch):
    d_out, d_grad = prove.compare_split_with_unsplit(torch.device("cpu"), torch.device("cpu"))
    assert d_out == 0.0 and d_grad == 0.0
    monkeypatch.setattr(prove.lesson, "TwoDeviceModel", prove.TwoDeviceModelDetached)
    d_out, d_grad = prove.compare_split_with_unsplit(torch.device("cpu"), torch.device("cpu"))
    assert d_out == 0.0 and d_grad > 1e-3


def test_without_grad_scale_overrides_the_lessons_scale_grads(prove):
    seen = {}
    build = prove.without_grad_scale(lambda *args, **kwargs: seen.update(kwargs))
    build("stage", 4, loss_fn=None, scale_grads=True)  # what the lesson passes
    assert seen["scale_grads"] is False


@pytest.mark.parametrize("world_size, batch_size", [(1, 16), (2, 16), (3, 7)])
def test_global_batches_are_the_ranks_batches_concatenated(prove, world_size, batch_size):
    dataset = prove.lesson.make_dataset()
    samplers = [DistributedSampler(dataset, world_size, r, seed=0) for r in range(world_size)]
    loaders = [DataLoader(dataset, batch_size=batch_size, sampler=s) for s in samplers]
    steps = 0
    for epoch in range(2):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for per_rank in zip(*loaders):
            steps += 1
    batches = list(prove.global_batches(world_size, 2, batch_size))
    assert len(batches) == steps == prove.steps_per_rank(world_size, 2, batch_size)[0]
    assert batches[0][0].shape[0] == world_size * batch_size


def test_steps_per_rank_counts_the_pipeline_batches(prove):
    for epochs, batch_size in itertools.product((1, 2), (1, 16, 37, 300)):
        assert prove.steps_per_rank(2, epochs, batch_size)[1] == len(list(prove.pipeline_batches(epochs, 2 * batch_size)))


# --- guard rails and help, in-process ------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "--world-size, --epochs, --batch-size, --lr and --timeout must be positive"),
    (["--timeout", "0"], "must be positive"),
    (["--microbatches", "1"], "--microbatches must be at least 2"),
    (["--batch-size", "15"], "split the pipeline's batch of 30 into equal micro-batches"),
    (["--batch-size", "200"], "the pipeline's batch of 400 is more than the 256 samples"),
    (["--crash-rank", "2"], "--crash-rank must be a rank from 0 to 1"),
    (["--break", "nothing"], "invalid choice: 'nothing'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_a_crash_rank_with_too_few_steps_is_refused(prove, capsys):
    """Rank 2 only trains the DDP part: with a batch of 128 it takes 1 step, and never reaches step 2."""
    with pytest.raises(SystemExit) as exit_:
        prove.parse_args(["--world-size", "3", "--crash-rank", "2", "--epochs", "1", "--batch-size", "128"])
    assert exit_.value.code == 2
    assert "but rank 2 takes 1" in capsys.readouterr().err


def test_cuda_without_gpus_is_refused(prove, capsys):
    if torch.cuda.device_count() >= 4:
        pytest.skip("this machine has two GPUs per rank, so --device cuda is possible here")
    with pytest.raises(SystemExit) as exit_:
        prove.main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device cuda needs two GPUs per rank" in capsys.readouterr().err


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--world-size", "--microbatches", "--epochs", "--batch-size", "--lr",
                                              "--device", "--break", "--crash-rank", "--timeout", *prove.BREAKS],
                           capsys)


# --- the benchmark: its committed results, and its pieces in-process ----------------------------

def test_committed_benchmark_results_are_complete_and_consistent():
    """The committed results (from a real run on an idle machine) hold what NOTES.md quotes from them."""
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
        assert r["max_grad_diff"] <= 1e-6
    gpipe4 = rows[("GPipe", 4)]
    assert data["target_met"] == (gpipe4["fraction_of_ideal"] >= 0.85)
    notes = (folder / "NOTES.md").read_text()
    assert f"{gpipe4['speedup']:.2f}x" in notes and f"{gpipe4['fraction_of_ideal'] * 100:.0f}%" in notes
    assert (folder / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_benchmark_pieces(tmp_path):
    """The benchmark's reference gradients and its chart, without starting ranks (the notebook runs
    the benchmark itself at a tiny size)."""
    bench = load_script(REPO / "03_model_parallel" / "bench_pipeline.py")
    model = bench.make_model(8, 1)
    assert [type(m).__name__ for m in model[1]] == ["Linear", "ReLU", "Linear"]
    events = {"GPipe m=2": [("F", 0, 0.0, 0.001), ("F", 1, 0.001, 0.002), ("B", 0, 0.003, 0.004)]}
    times = bench.step_times([{"times": {"GPipe m=2": [0.01, 0.03, 0.02]}}, {"times": {"GPipe m=2": [0.02, 0.01, 0.04]}}])
    assert times == {"GPipe m=2": pytest.approx(0.03)}  # median of the slower rank: 0.02, 0.03, 0.04
    bench.plot_timeline(events, events, times).savefig(tmp_path / "t.png", dpi=40)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert bench.resolve(events["GPipe m=2"], None) == events["GPipe m=2"]  # CPU: perf_counter() already


def test_benchmark_counts_its_cpu_seconds_without_the_resource_module(monkeypatch):
    """Windows has no `resource`: os.times() gives the same user + system seconds (10 ms ticks)."""
    bench = load_script(REPO / "03_model_parallel" / "bench_pipeline.py")
    _, with_getrusage, _ = bench.cpu_seconds()
    monkeypatch.setattr(bench, "resource", None)  # as on Windows
    _, with_times, _ = bench.cpu_seconds()
    assert with_getrusage > 0 and abs(with_times - with_getrusage) < 0.1
