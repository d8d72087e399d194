"""Lesson 13 and its lab: every schedule, TP and HSDP inside pipeline stages equal to one process,
the bubble and the activations against their formulas, each --break failing its own claim.

The lab's two README runs (the proof and the breaks) are the command-line tests' runs, one launch
of 4 ranks each; the pieces (the stage split, the bubble's replay, the timeline, the guard rails) are tested in-process."""
import re
import shutil

import pytest

from conftest import (REPO, assert_crashed_rank_stops_the_run, assert_help_in_process,
                      assert_refused_in_process, last_line_matching, load_script,
                      run_readme_command)

LAB = "13_pipeline_3d/prove.py"
LESSON = "13_pipeline_3d/pipeline_3d.py"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def prove():
    return load_script(LAB)


def differences(out):
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) +max \|w - one process\| (\S+)", out,
                                                   re.M)}


# --- the lab, run as the README runs it ---------------------------------------------------------

def test_the_default_run_proves_every_claim(prove):
    result = run_readme_command(f"python {LAB}")  # the same run the README output test reads
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count("PROOF PASSED") == 5 and "PROOF FAILED" not in out
    found = differences(out)
    assert set(found) == {*prove.PLAIN, *prove.ZERO_BUBBLE, "tp", "hsdp"}
    assert max(found.values()) < 1e-6, found
    bubbles = dict(re.findall(r"^bubble (\S+) +(\S+)", out, re.M))
    assert bubbles["ScheduleGPipe"] == bubbles["Schedule1F1B"] == "0.200"  # (p-1)/(m+p-1)
    assert bubbles["ScheduleInterleaved1F1B"] == "0.111"  # (p-1)/(v m+p-1)
    assert float(bubbles["ScheduleInterleavedZeroBubble"]) < 0.111
    held = re.findall(r"(ScheduleGPipe|Schedule1F1B) pipeline rank (\d): (\S+) micro", out)
    assert sorted(held) == [("Schedule1F1B", "0", "2.00"), ("Schedule1F1B", "1", "1.00"),
                            ("ScheduleGPipe", "0", "4.00"), ("ScheduleGPipe", "1", "4.00")]
    assert "parameters a rank [104896, 104896, 104896, 104896] bytes of 209792" in out


def test_each_break_fails_only_its_own_claim():
    result = run_readme_command(f"python {LAB} --break nested-reshard hsdp-no-replicate")
    assert result.returncode == 1, result.stderr[-3000:]
    out = result.stdout
    failed = re.findall(r"^PROOF FAILED: (.{20})", out, re.M)
    assert failed == ["the zero-bubble sche", "HSDP (2 replicas x 2"], failed
    assert out.count("PROOF PASSED") == 3
    found = differences(out)
    assert all(found[n] > 1e-4 for n in ("ScheduleInterleavedZeroBubble", "hsdp")), found
    assert max(found[n] for n in ("ScheduleGPipe", "Schedule1F1B", "tp")) < 1e-6
    assert last_line_matching("LIKELY CAUSE", out).startswith(
        "LIKELY CAUSE: a block resharded after forward under a split backward")


def test_a_crashed_rank_stops_the_run(lesson):
    assert_crashed_rank_stops_the_run(lesson, LAB)


# --- the lesson alone ------------------------------------------------------------------------------

def test_the_lesson_copied_alone_runs(lesson, tmp_path):
    """One rank, one stage (each rank started costs seconds of imports; the lab runs 4)."""
    shutil.copy(REPO / LESSON, tmp_path / "pipeline_3d.py")
    result = lesson.run(tmp_path / "pipeline_3d.py", "--world-size", 1, "--pp", 1, "--tp", 1,
                        "--schedule", "ScheduleGPipe", cwd=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh pp 1 x dp 1 (replicas 1) x tp 1; ScheduleGPipe" in result.stdout
    assert len(re.findall(r"^step \d  loss \d\.\d{4} \(last stage, rank 0\)", result.stdout,
                          re.M)) == 3


# --- the pieces, in-process ------------------------------------------------------------------------

def test_the_stages_hold_every_layer_once_in_order(prove):
    model = prove.lesson.make_model()
    for n in (1, 2, 4):
        stages = prove.lesson.split_model(model, n)
        assert [m for s in stages for m in s] == list(model)
        assert stages[0][0] is model[0] and stages[-1][-1] is model[-1]


def test_the_replay_gives_the_formulas_and_can_fail(prove):
    p, m = 2, 4
    gpipe = {r: [(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in (0, 1)}
    assert prove.simulate(gpipe) == pytest.approx({0: 0.2, 1: 0.2})
    one_f_one_b = {0: [(0, "F", 0), (0, "F", 1), (0, "B", 0), (0, "F", 2), (0, "B", 1),
                       (0, "F", 3), (0, "B", 2), (0, "B", 3)],
                   1: [a for i in range(m) for a in [(1, "F", i), (1, "B", i)]]}
    assert max(prove.simulate(one_f_one_b).values()) == pytest.approx((p - 1) / (m + p - 1))
    with pytest.raises(RuntimeError, match="wait on each other"):  # B before its F: a deadlock
        prove.simulate({0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]})


def test_the_timeline_draws_every_rank(prove, tmp_path):
    events = [(0, "F", 0, 0.0, 1.0), (0, "I", 0, 2.0, 3.0), (0, "W", 0, 3.0, 4.0)]
    runs = {n: [{"events": events}] * 4 for n in ("ScheduleGPipe", "ScheduleZBVZeroBubble")}
    fig = prove.plot_timeline(runs, path=str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0 and len(fig.axes) == 2


# --- guard rails and help, in-process ----------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--timeout", "0"], "--timeout must be positive"),
    (["--crash-rank", "4"], "--crash-rank must be a rank from 0 to 3"),
    (["--break", "bogus"], "invalid choice: 'bogus'"),
])
def test_impossible_choices_are_refused_before_any_rank_starts(prove, capsys, args, message):
    assert_refused_in_process(prove.parse_args, args, capsys, message)


def test_help_names_every_flag_and_break(prove, capsys):
    assert_help_in_process(prove.parse_args, ["--break", "--crash-rank", "--lesson", "--timeout",
                                              "--plot", "--device", *prove.BREAKS], capsys)


def test_the_lesson_refuses_a_mesh_that_does_not_divide(prove):
    with pytest.raises(SystemExit, match="must divide --world-size"):
        prove.lesson.main(world_size=6, pp=2, tp=2)
