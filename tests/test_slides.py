"""The workshop's slides (issue 24, part 5) are built from the lesson READMEs with nbconvert: every
lesson in the reading order, each with what it teaches, its diagram, its diff, the lab's command and
real output, the proof failing, and its exercise. Built in-process (about 2 s)."""
import html
import re

import nbformat
import pytest

from conftest import REPO, load_script

MAKER = REPO / "slides" / "make_slides.py"


@pytest.fixture(scope="module")
def deck(tmp_path_factory):
    maker = load_script(MAKER)
    out = tmp_path_factory.mktemp("deck")
    assert maker.main(["--out-dir", str(out)]) == 0
    return maker, out


def test_every_lesson_has_its_column_of_slides(deck):
    maker, out = deck
    nb = nbformat.read(out / "workshop.ipynb", as_version=4)
    titles = [c.source.splitlines()[0] for c in nb.cells if c.metadata.slideshow.slide_type == "slide"]
    order = maker.reading_order()
    assert len(titles) == 1 + len(order)
    for number, title in zip(order, titles[1:]):
        readme = next(REPO.glob(f"{number}_*/README.md")).read_text()
        assert title == "# " + maker.plain(readme.splitlines()[0][2:]), (number, title)


def test_the_slides_carry_each_lessons_diagram_diff_and_proof(deck):
    maker, out = deck
    page = html.unescape(re.sub(r"<[^>]+>", "", (out / "workshop.slides.html").read_text()))
    for number in maker.reading_order():
        folder = next(REPO.glob(f"{number}_*/"))
        readme = (folder / "README.md").read_text()
        diagram = maker.first_block(maker.sections(readme)["The idea"], lang="text")
        assert diagram.group("body").splitlines()[1].strip() in page, f"{number}: the diagram"
        diff = re.search(r"<!-- diff: (\S+) (\S+) -->", readme)
        if diff:
            assert f"--- {diff.group(1)}" in page and f"+++ {diff.group(2)}" in page, number
        assert f"python {folder.name}/prove.py" in page
        exercise = REPO / "exercises" / f"{folder.name}.py"
        assert (f"cp exercises/{folder.name}.py" in page) == exercise.exists(), number
    runs = len(maker.reading_order())
    assert page.count("PROOF PASSED") >= runs and page.count("PROOF FAILED") >= runs - 1
    assert "reveal" in (out / "workshop.slides.html").read_text()  # a reveal.js deck
    assert "reveal.js" not in (out / "workshop.html").read_text()  # the page needs no network


def test_a_chosen_set_of_lessons_and_an_unknown_lesson(deck, tmp_path, capsys):
    maker, _ = deck
    maker.main(["--lessons", "00", "02", "--out-dir", str(tmp_path)])
    nb = nbformat.read(tmp_path / "workshop.ipynb", as_version=4)
    assert sum(c.metadata.slideshow.slide_type == "slide" for c in nb.cells) == 3
    with pytest.raises(SystemExit) as refused:
        maker.main(["--lessons", "99", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "no lesson 99: the lessons are 00 01" in err


def test_every_code_slide_fits_1280_by_720(deck):
    """Issue 32: the labs' PROOF lines were 197 to 338 characters wide, and a code slide was held
    to 22 lines by count only. Now no line is wider than WIDTH, 105 characters (107 fit in a
    Chromium screenshot at 1280 x 720), and no slide shows more than MAX_LINES lines of its block
    (22 fit under a title and a command), wrapped lines counted."""
    maker, out = deck
    nb = nbformat.read(out / "workshop.ipynb", as_version=4)
    blocks = 0
    for cell in nb.cells:
        shown = re.findall(r"^```(\w*)\n(.*?)^```", cell.source, re.S | re.M)
        for lang, body in shown:
            lines = body.rstrip("\n").split("\n")
            assert max(map(len, lines)) <= maker.WIDTH, (cell.source.splitlines()[0], max(lines, key=len))
        if shown:
            blocks += 1
            assert len(shown[-1][1].rstrip("\n").split("\n")) <= maker.MAX_LINES, cell.source.splitlines()[0]
    assert blocks > 30
    assert maker.wrapped("x") == ["x"]
    long = "PROOF PASSED: " + "word " * 60
    assert [len(piece) <= maker.WIDTH for piece in maker.wrapped(long)] == [True] * 4  # 314 wide
    assert " ".join(piece.strip() for piece in maker.wrapped(long)).split() == long.split()


def test_the_three_hour_workshops_lessons_are_in_one_order():
    """make_slides.py's docstring and WORKSHOP.md give the same command, in the agenda's order."""
    find = lambda text: re.findall(r"python slides/make_slides\.py --lessons ([\d ]+?)\s+#", text)  # noqa: E731
    workshop, maker = find((REPO / "WORKSHOP.md").read_text()), find(MAKER.read_text())
    assert workshop == maker == ["00 02 04 05 07"], (workshop, maker)
    agenda = (REPO / "WORKSHOP.md").read_text().split("## The 3-hour workshop")[1].split("## The 1-day")[0]
    assert re.findall(r"\*\*(\d\d)\*\*", agenda) == workshop[0].split()
