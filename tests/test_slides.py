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
        maker.main(["--lessons", "12", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "no lesson 12: the lessons are 00 01" in err
