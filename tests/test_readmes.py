"""What the READMEs show is what really happens.

Markers, written as an HTML comment on the line just before a fenced block:
  ```python            (no marker)  runnable: copied to a file, run with python, must exit 0
  <!-- fragment -->    ```python    an excerpt, not meant to run alone (the README says so)
  <!-- mistake: TEXT --> ```python  deliberately wrong: must exit non-zero and print TEXT
  <!-- output: CMD --> ```text      the output CMD prints (run from the repo root), numbers included;
                                    a number written ~N varies from run to run (any number matches:
                                    the README says why); a line holding only '...' stands for any
                                    number of lines
  <!-- diff: A B -->   ```diff      exactly `python tests/lesson_diff.py A B`: the real diff between
                                    two lesson scripts, so the README's diff cannot go stale
  <!-- excerpt: FILE --> ```python  lines of FILE, in its order (lines left out between them, and
                                    '...' lines, are fine): an excerpt cannot go stale either
"""
import re
import subprocess
import sys

import pytest

from conftest import REPO, lesson_env, run_readme_command
from lesson_diff import lesson_diff, split_hunks

READMES = [REPO / "README.md", REPO / "SETUP.md", *sorted(REPO.glob("[0-9][0-9]_*/README.md"))]
BLOCK = re.compile(r"(?:<!--\s*(?P<mark>[^\n]*?)\s*-->[ \t]*\n)?^```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^```", re.S | re.M)
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"


def blocks():
    for readme in READMES:
        text = readme.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("body"))
            yield pytest.param(m.group("mark") or "", m.group("lang"), m.group("body"),
                               id=f"{readme.relative_to(REPO)}:{line}")


ALL_BLOCKS = list(blocks())
PYTHON = [b for b in ALL_BLOCKS if b.values[1] == "python" and b.values[0] != "fragment"
          and not b.values[0].startswith("excerpt:")]
EXCERPTS = [b for b in ALL_BLOCKS if b.values[0].startswith("excerpt:")]
OUTPUTS = [b for b in ALL_BLOCKS if b.values[0].startswith("output:")]
DIFFS = [b for b in ALL_BLOCKS if b.values[0].startswith("diff:")]


def test_every_marker_is_known():
    for mark, lang, _ in (b.values for b in ALL_BLOCKS):
        assert mark in ("", "fragment") or mark.startswith(("mistake:", "output:", "diff:", "excerpt:")), \
            f"unknown marker {mark!r}"
        if mark.startswith("output:"):
            assert lang == "text", "an output block is a ```text block"
        if mark.startswith("diff:"):
            assert lang == "diff", "a diff block is a ```diff block"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mark, lang, code", PYTHON)
def test_python_block(mark, lang, code, tmp_path, lesson):
    (tmp_path / "snippet.py").write_text(code)
    result = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=lesson_env(lesson.tag),
                            capture_output=True, text=True, timeout=200)
    if mark.startswith("mistake:"):
        expected = mark.split(":", 1)[1].strip()
        assert result.returncode != 0, f"the mistake ran without error:\n{result.stdout}"
        assert expected in result.stdout + result.stderr, f"expected {expected!r} in:\n{result.stderr[-3000:]}"
    else:
        assert result.returncode == 0, f"a runnable README block failed:\n{result.stderr[-3000:]}"


VARYING = re.compile(r"~(" + NUMBER + ")")


def output_pattern(expected):
    """The block as a pattern: every character as written, but ~N (any number) and '...' lines."""
    parts = []
    for line in expected.splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            pieces = VARYING.split(line)[::2]  # the text around each ~N
            parts.append(NUMBER.join(re.escape(piece) for piece in pieces) + r"[ \t]*\n")
    return re.compile("".join(parts))


def test_output_pattern_can_fail():
    pattern = output_pattern("PROOF PASSED: max 4.5e-08\n...\ndone in ~3 s, 69 of 101\n")
    assert pattern.fullmatch("PROOF PASSED: max 4.5e-08\nanything\nelse\ndone in 12.5 s, 69 of 101\n")
    assert not pattern.fullmatch("PROOF FAILED: max 4.5e-08\ndone in 3 s, 69 of 101\n")
    assert not pattern.fullmatch("PROOF PASSED: max 4.5e-08\ndone in 3 s, 69 of 101\nan extra line\n")
    assert not pattern.fullmatch("PROOF PASSED: max 6.0e-08\ndone in 3 s, 69 of 101\n"), "a number"
    assert not pattern.fullmatch("PROOF PASSED: max 4.5e-08\ndone in 3 s, 67 of 101\n"), "a count"


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_readme_with_varying_numbers_says_why(readme):
    text = readme.read_text()
    shown = [m.group("body") for m in BLOCK.finditer(text) if (m.group("mark") or "").startswith("output:")]
    if any(VARYING.search(body) for body in shown):
        assert "`~`" in text, "output blocks mark varying numbers with ~: say what varies and why"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mark, lang, expected", OUTPUTS)
def test_expected_output_is_what_the_command_prints(mark, lang, expected):
    result = run_readme_command(mark.split(":", 1)[1].strip())  # shared with the lesson's tests
    assert output_pattern(expected).fullmatch(result.stdout), (
        f"README output block does not match what `{mark}` prints now:\n{result.stdout}\n{result.stderr[-2000:]}")


@pytest.mark.parametrize("mark, lang, shown", DIFFS)
def test_diff_block_is_the_real_diff(mark, lang, shown):
    before, after = mark.split(":", 1)[1].split()
    assert_shows_real_hunks(shown, lesson_diff(REPO / before, REPO / after),
                            f"python tests/lesson_diff.py {before} {after}")


def assert_shows_real_hunks(shown, real, command):
    """The block's header and hunks, each exactly as in the real diff and in its order."""
    shown_header, shown_hunks = split_hunks(shown)
    real_header, real_hunks = split_hunks(real)
    assert shown_header == real_header and shown_hunks, f"the diff block must start with:\n{real_header}"
    positions = []
    for hunk in shown_hunks:
        assert hunk in real_hunks, f"this hunk is not in the real diff (stale? see `{command}`):\n{hunk}"
        positions.append(real_hunks.index(hunk))
    assert positions == sorted(positions), "the hunks are out of order"


def test_diff_check_can_fail(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\ny = 2\nz = 3\n\n\n\nw = 4\n")
    (tmp_path / "b.py").write_text("x = 1\ny = 5\nz = 3\n\n\n\nw = 6\n")
    real = lesson_diff(tmp_path / "a.py", tmp_path / "b.py")
    header, hunks = split_hunks(real)
    assert len(hunks) == 2
    assert_shows_real_hunks(header + hunks[1], real, "")  # a hunk left out is fine
    for stale in (header + hunks[0].replace("y = 5", "y = 7"), header + hunks[1] + hunks[0], hunks[0]):
        with pytest.raises(AssertionError):
            assert_shows_real_hunks(stale, real, "")


def missing_from(excerpt, source):
    """The excerpt's lines (stripped, end-of-line comments dropped, blank and '...' lines aside)
    that are not, in this order, lines of the source: [] when it is a true excerpt."""
    code = lambda line: line.split("  # ")[0].strip()  # noqa: E731
    lines, at = iter(code(line) for line in source.splitlines()), []
    for line in (code(x) for x in excerpt.splitlines()):
        if line and line != "..." and line not in lines:  # `in` consumes: the order is kept
            at.append(line)
    return at


@pytest.mark.parametrize("mark, lang, shown", EXCERPTS)
def test_excerpt_is_lines_of_its_file_in_order(mark, lang, shown):
    path = REPO / mark.split(":", 1)[1].strip()
    assert not missing_from(shown, path.read_text()), f"not in {path.name}, in this order: {missing_from(shown, path.read_text())}"


def test_excerpt_check_can_fail():
    source = "a = 1\n    b = 2\nc = 3\n"
    assert missing_from("a = 1\n...\nc = 3\n", source) == []
    assert missing_from("c = 3\na = 1\n", source) == ["a = 1"]
    assert missing_from("a = 1\nb = 3\n", source) == ["b = 3"]
    assert missing_from("a = 1  # a comment the file lacks\n", source) == []

