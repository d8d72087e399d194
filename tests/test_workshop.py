"""WORKSHOP.md (issue 24, part 4) is built from the course's files: its minutes per lesson are
recomputed here from today's READMEs and exercises, every command it gives names a file and a
--break that exist, and its agendas add up. In-process; nothing is launched."""
import difflib
import re

import pytest

from conftest import REPO

WORKSHOP = (REPO / "WORKSHOP.md").read_text()
ROWS = re.findall(r"^\| (\d\d) [^|]+\| (\d+) min \| (\d+) s \| (\d+|-) \| (?:(\d+) min|-) \|$", WORKSHOP, re.M)


def reading_minutes(readme):
    """Words outside code blocks at 200 a minute, inside at 150 (WORKSHOP.md says so)."""
    code = sum(len(m.group(0).split()) for m in re.finditer(r"^```.*?^```", readme, re.S | re.M))
    return round((len(readme.split()) - code) / 200 + code / 150)


def lines_to_write(lesson):
    """Code lines of the solution (no comment, docstring or blank line) that its starter, without
    its header and TODO comments, lacks."""
    starter = [line for line in (REPO / "exercises" / f"{lesson}.py").read_text().splitlines()[3:]
               if not re.match(r"\s*# (TODO|    )", line)]
    script = "train_gpt.py" if lesson == "11_train_gpt" else f"{lesson.split('_', 1)[1]}.py"
    solution = (REPO / lesson / script).read_text().splitlines()
    added = [line for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, starter, solution, autojunk=False)
             .get_opcodes() if tag != "equal" for line in solution[j1:j2]]
    return sum(1 for line in added if line.strip() and not line.strip().startswith(("#", '"""')))


def test_the_table_has_every_lesson():
    assert [row[0] for row in ROWS] == sorted(p.name[:2] for p in REPO.glob("[0-9][0-9]_*/"))


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row[0])
def test_the_minutes_per_lesson_are_todays(row):
    number, read, _, lines, minutes = row
    folder = next(REPO.glob(f"{number}_*/"))
    assert int(read) == reading_minutes((folder / "README.md").read_text()), "read minutes are stale"
    exercise = REPO / "exercises" / f"{folder.name}.py"
    assert (lines != "-") == exercise.exists()
    if exercise.exists():
        assert int(lines) == lines_to_write(folder.name), f"{lines_to_write(folder.name)} lines now"
        assert int(minutes) == round(int(lines) / 3), "the estimate is lines at 3 a minute"


def test_the_reading_minutes_count_code_slower():
    assert reading_minutes("word " * 400) == 2
    assert reading_minutes("```\n" + "word " * 300 + "\n```\n") == 2


def test_every_command_names_a_file_and_a_break_that_exist():
    commands = re.findall(r"python ([\w/]+\.py)((?: --?[\w-]+(?: [\w.]+)?)*)", WORKSHOP)
    assert len(commands) >= 8
    for script, args in commands:
        if script.startswith("my_"):  # the attendee's own copy of a starter
            assert (REPO / "exercises" / f"{script[3:]}").exists() or any(
                (REPO / "exercises").glob(f"*_{script[3:]}")), script
            continue
        assert (REPO / script).is_file(), script
        for name in re.findall(r"--break ([\w-]+)", args):
            assert f'"{name}"' in (REPO / script).read_text(), f"{script} has no --break {name}"
    for path in re.findall(r"`((?:\d\d_\w+|exercises|slides)/[\w./]+\.(?:py|png|md))`", WORKSHOP):
        assert (REPO / path).exists(), path


def test_the_three_hour_agenda_adds_up():
    part = WORKSHOP.split("## The 3-hour workshop")[1].split("## The 1-day")[0]
    times = [int(h) * 60 + int(m) for h, m in re.findall(r"^\| (\d):(\d\d) \|", part, re.M)]
    assert times == sorted(times) and times[0] == 0 and times[-1] == 180, times


def test_the_exercises_readme_counts_the_same_lines():
    rows = re.findall(r"^\| \[(\d\d_\w+)\.py\]\([^)]+\) \| [^|]+ \| (\d+) \|", (REPO / "exercises" / "README.md")
                      .read_text(), re.M)
    assert len(rows) == len(list((REPO / "exercises").glob("[0-9][0-9]_*.py")))
    for lesson, lines in rows:
        assert int(lines) == lines_to_write(lesson), lesson
