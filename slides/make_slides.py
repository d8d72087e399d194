"""Slides for the workshop, built from the lesson READMEs, so they say what the lessons say:

    python slides/make_slides.py                       # every lesson, in the reading order
    python slides/make_slides.py --lessons 00 02 04 05 07   # the 3-hour workshop (WORKSHOP.md)
    python slides/make_slides.py --out-dir /tmp/deck

Per lesson, a column of slides (right arrow: next lesson, down arrow: next slide): what you will
learn; the idea's diagram; the diff from the parent lesson; the lab's command and its real output
(PROOF PASSED); the proof failing; the exercise. Written to slides/build/: workshop.ipynb (a
notebook with slide metadata), workshop.slides.html (reveal.js, by `nbconvert --to slides`; the
browser fetches reveal.js from unpkg.com: offline, see WORKSHOP.md) and workshop.html (one page
that needs no network).
"""
import argparse
import os
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:<!--\s*(?P<mark>[^\n]*?)\s*-->[ \t]*\n)?^```(?P<lang>[\w+-]*)[ \t]*\n"
                   r"(?P<body>.*?)^```", re.S | re.M)
# A slide's code block at 1280 x 720 (reveal.js scales the 1400 x 900 slide by 0.8), measured in a
# Chromium screenshot: 22 lines under a title and a command fit; a line of 107 characters of text
# fits (106 in a diff). MAX_LINES counts lines as shown: a line wider than WIDTH is wrapped first.
MAX_LINES = 22  # the rest: the next slide
WIDTH = 105  # the lessons' code is 100 wide (101 in a diff); the labs' PROOF lines are wrapped
# Pygments' classes for diff lines, which the exported page leaves uncoloured; bigger code.
STYLE = ("<style>.gi { color: #116329; background: #dafbe1; } .gd { color: #82071e; "
         "background: #ffebe9; } .reveal pre, .jp-RenderedHTMLCommon pre { font-size: 1.05em; }"
         "</style>")


def reading_order():
    """The lesson numbers in the order the top README states (one place, a test checks it)."""
    found = re.search(r"Reading order: ((?:\d\d(?: → )?)+)", (REPO / "README.md").read_text())
    return found.group(1).split(" → ")


def sections(readme):
    """{'': the part before the first '## ', 'The idea': ..., ...} of a README."""
    parts = re.split(r"^## (.+)$", readme, flags=re.M)
    return {"": parts[0], **{parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}}


def plain(markdown):
    """Links to their text (the slides have no neighbouring files), HTML comments out."""
    markdown = re.sub(r"<!--.*?-->\n?", "", markdown, flags=re.S)
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", markdown)


def wrapped(line):
    """A line wider than WIDTH as several, at spaces, each continuation 4 deeper than the line."""
    if len(line) <= WIDTH:
        return [line]
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def code_slides(title, lang, body, note=""):
    """One or more slides showing a code block: MAX_LINES lines each as shown, none wider than
    WIDTH; a wrapped line stays whole on one slide."""
    chunks = [[]]
    for pieces in (wrapped(line) for line in body.rstrip("\n").split("\n")):
        if chunks[-1] and len(chunks[-1]) + len(pieces) > MAX_LINES:
            chunks.append([])
        chunks[-1] += pieces
    return [f"### {title}{f' ({n + 1}/{len(chunks)})' if len(chunks) > 1 else ''}\n\n{note}"
            f"```{lang}\n" + "\n".join(chunk) + "\n```" for n, chunk in enumerate(chunks)]


def first_block(text, lang=None, mark=None):
    for m in BLOCK.finditer(text):
        if (lang is None or m.group("lang") == lang) and (
                mark is None or (m.group("mark") or "").startswith(mark)):
            return m
    return None


def lesson_slides(folder):
    """[(slide type, markdown)] for one lesson: its title slide, then the slides below it."""
    readme = (folder / "README.md").read_text()
    parts = sections(readme)
    title = re.search(r"^# (.+)$", readme, flags=re.M).group(1)
    learn = re.search(r"\*\*What you will learn\*\*\n(.*?)(?:\n\n|\Z)", parts[""], flags=re.S)
    slides = [("slide", f"# {plain(title)}\n\n" + (f"**What you will learn**\n\n{plain(learn.group(1))}"
                                                   if learn else ""))]
    idea = first_block(parts.get("The idea", ""), lang="text")
    if idea:
        slides += [("subslide", s) for s in code_slides("The idea", "text", idea.group("body"))]
    diff_section = next((v for k, v in parts.items() if k.startswith(("The diff", "Where each"))), "")
    diff = first_block(diff_section, lang="diff")
    if diff:
        slides += [("subslide", s) for s in code_slides(
            "The diff", "diff", diff.group("body"), f"`{diff.group('mark').split(':', 1)[1].strip()}`\n\n")]
    elif diff_section:  # the capstone: a table of where each part comes from
        slides.append(("subslide", f"### Where each part comes from\n\n{plain(diff_section).strip()}"))
    for excerpt in BLOCK.finditer(diff_section):  # the lesson's code the README shows whole
        if (excerpt.group("mark") or "").startswith("excerpt:"):
            path = excerpt.group("mark").split(":", 1)[1].strip()
            slides += [("subslide", s) for s in code_slides(
                "The code", "python", excerpt.group("body"), f"from `{path}`\n\n")]
    for name in ("Run it", "See the proof fail"):
        run = first_block(parts.get(name, ""), mark="output:")
        if run:
            command = run.group("mark").split(":", 1)[1].strip()
            slides += [("subslide", s) for s in code_slides(
                name, "text", run.group("body"), f"```bash\n{command}\n```\n\n")]
    starter = REPO / "exercises" / f"{folder.name}.py"
    if starter.exists():
        script = ("train_gpt.py" if (folder / "train_gpt.py").exists()
                  else f"{folder.name.split('_', 1)[1]}.py")
        slides.append(("subslide", f"### Exercise\n\n```bash\ncp exercises/{folder.name}.py my_{script}\n"
                       f"# do the TODOs, then:\npython {folder.name}/prove.py --lesson my_{script}\n```"
                       f"\n\n`PROOF PASSED` when it is right. The solution: `{folder.name}/{script}`."))
    return slides


def notebook(lessons):
    import nbformat
    cells = [nbformat.v4.new_markdown_cell(
        "# PyTorch distributed training, lesson by lesson\n\nRunnable, tested, honest. Every "
        "number on these slides is what a lab printed on a 2-core CPU; the lessons say how to "
        "get yours.\n\n`python preflight.py` first: it says READY.", metadata={"slideshow": {
            "slide_type": "slide"}})]
    for number in lessons:
        folder = next(REPO.glob(f"{number}_*/"))
        for kind, text in lesson_slides(folder):
            cells.append(nbformat.v4.new_markdown_cell(text, metadata={"slideshow": {"slide_type": kind}}))
    return nbformat.v4.new_notebook(cells=cells, metadata={"title": "PyTorch distributed training"})


def build(lessons, out_dir):
    """Writes the notebook, the reveal.js slides and the offline page; returns their paths."""
    import nbformat
    from nbconvert import HTMLExporter, SlidesExporter
    nb = notebook(lessons)
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in
             ("workshop.ipynb", "workshop.slides.html", "workshop.html")]
    nbformat.write(nb, paths[0])
    slides, _ = SlidesExporter(reveal_scroll=True, reveal_width="1400",  # 100-column code fits
                               reveal_height="900").from_notebook_node(nb)
    page, _ = HTMLExporter().from_notebook_node(nb)
    for path, text in zip(paths[1:], (slides, page)):
        Path(path).write_text(text.replace("</head>", STYLE + "</head>", 1), encoding="utf-8")
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", nargs="+", metavar="NN", help="these lessons, in this order "
                        "(default: every lesson, in the reading order)")
    parser.add_argument("--out-dir", default=str(REPO / "slides" / "build"),
                        help="where to write (default slides/build)")
    args = parser.parse_args(argv)
    known = reading_order()
    lessons = args.lessons or known
    unknown = [n for n in lessons if n not in known]
    if unknown:
        parser.error(f"no lesson {', '.join(unknown)}: the lessons are {' '.join(known)}")
    try:
        import nbconvert  # noqa: F401 (in requirements.txt, with jupyter)
    except ImportError:
        parser.error("nbconvert is missing: python -m pip install -r requirements.txt")
    for path in build(lessons, args.out_dir):
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
