"""The workshop's exercises (issue 24, part 1): each starter is what exercises/make_exercises.py
writes from today's lessons; its lab refuses it with one line naming what is missing; a typical
mistake in the solution fails its lab; the solution (the lesson's own script) passes. Launches:
one lab run per mistake (the solutions' runs are the README's, shared); the starters in-process."""
import ast
import re
import sys

import pytest

from conftest import REPO, load_script, run_lesson, run_readme_command

MAKER = REPO / "exercises" / "make_exercises.py"
EXERCISES = ["02_ddp_spawn", "04_sampler_checkpoint", "05_torchrun_elastic", "07_fsdp_dcp",
             "09_training_loop", "10_tensor_parallel", "11_train_gpt", "12_debugging",
             "13_pipeline_3d"]
EXERCISES.append("14_fault_tolerance")  # issue 36
# A typical mistake per exercise: the solution with these edits, the lab's extra arguments, and
# what the lab must say. Each edit must match the solution exactly once.
MISTAKES = {
    "02_ddp_spawn": ([("        loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same "
                       "one on every rank\n", "")], [], "PROOF FAILED",
                     "LIKELY CAUSE: the sampler is not told the epoch (set_epoch): epoch 0 equals "
                     "one process, epoch 1 repeats epoch 0's shuffle"),
    "04_sampler_checkpoint": ([('torch.set_rng_state(state["rng"][rank]["cpu"].cpu())', "pass")], [],
                              "PROOF FAILED", "LIKELY CAUSE: the resumed ranks do not restore their "
                              "RNG state (no set_rng_state with the saved state took effect)"),
    "05_torchrun_elastic": ([('torch.set_rng_state(state["rng"][rank]["cpu"].cpu())', "pass")], [],
                            "PROOF FAILED", "LIKELY CAUSE: the resumed ranks do not restore their RNG "
                            "state (rank(s) 0, 1: no set_rng_state with the saved state took effect)"),
    "07_fsdp_dcp": ([("        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:"
                      "  # the root last\n            fully_shard(layer, mesh=mesh)  # a layer is "
                      "all-gathered just when it runs\n        optimizer = torch.optim.SGD(model."
                      "parameters(), lr=lr, momentum=0.9)  # after sharding\n",
                      "        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)\n"
                      "        for layer in [m for m in model if isinstance(m, nn.Linear)] + [model]:\n"
                      "            fully_shard(layer, mesh=mesh)\n")], [],
                    "PROOF FAILED", "LIKELY CAUSE: the optimizer does not hold the model's "
                                    "parameters: it was made before fully_shard"),
    "09_training_loop": ([("(loss / k).backward()", "loss.backward()")], [], "PROOF FAILED",
                         "LIKELY CAUSE: the loss is not divided by the K = 2 micro-batches"),
    "10_tensor_parallel": ([('DistributedSampler(dataset, mesh["dp"].size(), mesh["dp"].get_local_rank())',
                             "DistributedSampler(dataset)")], [], "PROOF FAILED",
                           "LIKELY CAUSE: the ranks of a TP group compute on different batches"),
    "11_train_gpt": ([("(loss / len(batches)).backward()", "loss.backward()")], ["--claims", "1"],
                     "PROOF FAILED", "claim 1 fails"),
    "12_debugging": ([("        dump_flight_recorder(folder, rank, backend)\n", "")],
                     ["--part", "hangs"], "PROOF FAILED",
                     "LIKELY CAUSE: no rank wrote its flight recorder when its collective raised"),
    "13_pipeline_3d": ([("reshard_after_forward=False)", "reshard_after_forward=True)")], [],
                       "PROOF FAILED", "LIKELY CAUSE: a block resharded after forward under a "
                       "split backward"),
}
MISTAKES["14_fault_tolerance"] = (  # a heal that loads nothing: the replicas end apart
    [('model.load_state_dict(state["model"]), optimizer.load_state_dict(state["optimizer"])),',
      "None, None),")], [], "PROOF FAILED",
    "LIKELY CAUSE: a replica that healed did not load its peer's weights")


@pytest.fixture(scope="module")
def maker():
    return load_script(MAKER)


def solution(lesson):
    return REPO / lesson / ("train_gpt.py" if lesson == "11_train_gpt" else f"{lesson.split('_', 1)[1]}.py")


def test_the_committed_starters_are_what_the_lessons_make_today(maker):
    made = maker.starters()
    assert sorted(made) == [f"{lesson}.py" for lesson in EXERCISES]
    for name, text in made.items():
        assert (REPO / "exercises" / name).read_text() == text, \
            f"exercises/{name} is stale: run python exercises/make_exercises.py"


def test_a_starter_is_the_parent_with_todos_where_the_diff_was():
    """Lesson 02's starter without its header and TODO lines: lesson 00's script, but for the
    changes given whole (the docstring, two comments), none of lesson 02's code. Every starter
    parses, carries TODOs for its lesson and names the command that grades it."""
    for lesson in EXERCISES:
        text = (REPO / "exercises" / f"{lesson}.py").read_text()
        ast.parse(text)
        assert f"# TODO(lesson {lesson[:2]}):" in text and f"python {lesson}/prove.py --lesson" in text
    starter = (REPO / "exercises" / "02_ddp_spawn.py").read_text().splitlines()[3:]
    code = [line for line in starter if not re.match(r"\s*# (TODO|    )", line)]
    parent = (REPO / "00_single_process" / "single_process.py").read_text().splitlines()
    lesson = solution("02_ddp_spawn").read_text().splitlines()
    added = [line for line in code if line not in parent]
    assert added and all(line in lesson for line in added)
    given = set(lesson[:lesson.index("import argparse")]) | {  # the docstring and two comments
        line for line in lesson if "loss of every step on this rank" in line or "DDP averages" in line}
    assert set(added) <= given, set(added) - given
    assert [line for line in parent if line not in code] == [
        line for line in parent if line.strip().startswith(('"""', "python", "loss.backward()"))
        and line not in code]  # only docstring and comment lines of lesson 00 gave way


def test_a_stale_hint_stops_the_maker_with_the_change_to_write_one_for(maker, monkeypatch):
    parent, hints = maker.DIFF_EXERCISES["02_ddp_spawn"]
    monkeypatch.setitem(maker.DIFF_EXERCISES, "02_ddp_spawn",
                        (parent, [("no such text", hints[0][1])] + hints[1:]))
    with pytest.raises(SystemExit, match="change 0 no longer contains 'no such text'"):
        maker.diff_starter("02_ddp_spawn")
    monkeypatch.setitem(maker.DIFF_EXERCISES, "02_ddp_spawn", (parent, hints[:-1]))
    with pytest.raises(SystemExit, match="14 changes, the hints 13"):
        maker.diff_starter("02_ddp_spawn")
    monkeypatch.setitem(maker.CUT_EXERCISES, "11_train_gpt", ("train_gpt.py", {"no_such_function": []}))
    with pytest.raises(SystemExit, match="no longer defines"):
        maker.cut_starter("11_train_gpt")


def test_the_maker_check_fails_on_an_edited_starter(maker, monkeypatch, tmp_path):
    for name, text in maker.starters().items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(maker, "HERE", tmp_path)
    assert maker.main(["--check"]) == 0
    (tmp_path / "04_sampler_checkpoint.py").write_text("# edited by hand\n")
    assert maker.main(["--check"]) == 1


@pytest.mark.parametrize("lesson", EXERCISES)
def test_the_lab_refuses_the_starter_in_one_line_naming_what_is_missing(lesson, monkeypatch, capsys):
    """In-process (no interpreter to start): labs 02-09 import the file given in COURSE_LESSON
    when loaded; lab 11 in main(). The lesson's module name, model and checkpoint are restored."""
    starter = REPO / "exercises" / f"{lesson}.py"
    names = [solution(lesson).stem, "model", "checkpoint"]
    saved = {name: sys.modules.get(name) for name in names}
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("COURSE_LESSON", str(starter))
    try:
        with pytest.raises(SystemExit) as refused:
            lab = load_script(f"{lesson}/prove.py")
            lab.main(["--lesson", str(starter)])  # only lab 11 gets here
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None) if module is None else sys.modules.__setitem__(name, module)
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(rf"--lesson {re.escape(str(starter))} has no \w+", err), err


def test_a_starter_given_on_the_command_line_is_refused_the_same_way():
    """Once as a learner types it (the in-process test above does the others)."""
    result = run_lesson("02_ddp_spawn/prove.py", "--lesson", "exercises/02_ddp_spawn.py")
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == ("prove.py: error: --lesson exercises/02_ddp_spawn.py has no worker: "
                             "the lab calls it as ddp_spawn.py defines it\n").replace(
        "exercises/", str(REPO / "exercises") + "/")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lesson", EXERCISES)
def test_a_typical_mistake_fails_its_lab(lesson, tmp_path):
    edits, extra, verdict, message = MISTAKES[lesson]
    text = solution(lesson).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the solution no longer contains {old!r} once"
        text = text.replace(old, new)
    mine = tmp_path / f"my_{solution(lesson).name}"
    mine.write_text(text)
    result = run_lesson(f"{lesson}/prove.py", "--lesson", mine, *extra, timeout=200)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and verdict in out and message in out, out[-3000:]
    if message.startswith("LIKELY CAUSE"):  # the lab's diagnosis is its last word
        assert result.stdout.strip().splitlines()[-1].startswith(message), result.stdout[-1500:]


@pytest.mark.parametrize("lesson", EXERCISES)
def test_the_solution_passes_its_lab(lesson):
    """The solution is the lesson's script, and the lab's README run proves it (a shared run)."""
    result = run_readme_command(f"python {lesson}/prove.py")
    assert result.returncode == 0 and "PROOF PASSED" in result.stdout, result.stderr[-2000:]
    assert f"Solution: {solution(lesson).relative_to(REPO)}" in (REPO / "exercises" / f"{lesson}.py").read_text()


@pytest.mark.parametrize("lesson", [lesson for lesson in EXERCISES if lesson != "11_train_gpt"])
def test_a_starter_keeps_every_import_its_parents_code_needs(maker, lesson):
    """A starter runs the parent's code until the TODOs are done: a change given whole that drops
    an import (07 once dropped `import time`, and its untouched starter died on a NameError)
    must not reach it."""
    parent = (REPO / maker.DIFF_EXERCISES[lesson][0]).read_text().splitlines()
    starter = (REPO / "exercises" / f"{lesson}.py").read_text().splitlines()
    imports = [line for line in parent if line.startswith(("import ", "from "))]
    assert [line for line in imports if line not in starter] == []


def test_a_learner_who_returns_the_ddp_wrapper_is_told_in_one_line():
    sys.path.insert(0, str(REPO))
    import course
    ok = {"0.weight": __import__("torch").ones(2)}
    assert course.max_abs_diff(ok, ok) == 0.0
    with pytest.raises(SystemExit, match="return model.module, the model DDP wraps, not the DDP wrapper"):
        course.max_abs_diff({"module.0.weight": ok["0.weight"]}, ok)
