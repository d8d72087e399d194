"""--lesson PATH: every lab grades a learner's own file (issue 24, part 2). The file's ranks are
the learner's too: the path travels to them in COURSE_LESSON (forkserver, spawn, torchrun)."""
import sys

import pytest

from conftest import REPO, load_script, run_lesson

LABS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("0[0-9]_*/prove.py"))


@pytest.mark.parametrize("lab", LABS)
def test_every_lab_offers_lesson(lab, capsys):
    with pytest.raises(SystemExit) as stopped:
        load_script(lab).parse_args(["--help"])
    assert stopped.value.code == 0 and "--lesson PATH" in capsys.readouterr().out


@pytest.fixture
def course(monkeypatch):
    monkeypatch.setenv("COURSE_LESSON", "")  # import_lesson sets it: restored after the test
    sys.path.insert(0, str(REPO))
    import course
    return course


@pytest.mark.parametrize("text, message", [
    (None, "no such file"),
    ("def worker(:\n", "does not import: SyntaxError"),
    ("raise ImportError('no module named foo')\n", "does not import: ImportError: no module named foo (line 1)"),
    ("def make_dataset():\n    pass\n", "has no worker: the lab calls it as ddp_spawn.py defines it"),
])
def test_a_file_the_lab_cannot_use_is_one_line(course, tmp_path, capsys, text, message):
    path = tmp_path / "mine.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as stopped:
        course.import_lesson("ddp_spawn", needs=("make_dataset", "worker"),
                             argv=["--lesson", str(path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_the_lesson_copied_under_another_name_passes(tmp_path):
    """Lesson 02 copied as a learner would: the lab proves that file (its mistakes: test_exercises)."""
    (tmp_path / "my_ddp.py").write_text((REPO / "02_ddp_spawn" / "ddp_spawn.py").read_text())
    good = run_lesson("02_ddp_spawn/prove.py", "--lesson", tmp_path / "my_ddp.py")
    assert good.returncode == 0 and "PROOF PASSED" in good.stdout, good.stderr[-2000:]
