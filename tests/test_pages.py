"""Every command the pages name runs, and every link lands (issue 32, item 2): a `python x.py ...`
in a README, NOTES, WORKSHOP, SETUP, the glossary, the exercises' README or the slides' maker.

Each script is run in its cheapest faithful form: as `__main__` with `--help`, which must exit 0
and print usage naming every flag the pages give it (and every `--break` name, every subcommand).
A script with no `if __name__ == "__main__":` prints nothing and fails. The commands' full runs are
the lessons' own tests (an output block's command runs once per session: test_readmes.py). All the
`--help` runs share one process, which imports torch once (about 3 s on 2 cores)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

PAGES = sorted({REPO / "README.md", REPO / "SETUP.md", REPO / "WORKSHOP.md", REPO / "GLOSSARY.md",
                REPO / "CONTRIBUTING.md", REPO / "exercises" / "README.md", REPO / "slides" / "make_slides.py",
                *REPO.glob("[0-9][0-9]_*/README.md"), *REPO.glob("[0-9][0-9]_*/NOTES.md")})
COMMAND = re.compile(r"(?<![\w/.-])python3? ((?:[\w.-]+/)*[\w.-]+\.py)((?:[ \t]+(?!#|-->|\\\n)[^\s`|;&<>()\\]+)*)")
# The reader's own files, which a page tells them to write (a starter's copy, an old version).
OWN = re.compile(r"^(my_|old_)|/my_|^my_project/")
PATTERN = re.compile(r"\b(NN|MM)_")  # CONTRIBUTING.md's NN_name/prove.py, MM_a/a.py: a pattern, not a file


def named_commands():
    found = {}
    for page in PAGES:  # inline code broken over two lines is one command
        text = re.sub(r"(?<!`)`[^`\n]+(?:\n[^`\n]+)?`(?!`)", lambda m: m.group(0).replace("\n", " "),
                      page.read_text())
        for m in COMMAND.finditer(text):
            script, args = m.group(1), m.group(2).split()
            if not OWN.search(script) and not PATTERN.search(m.group(0)):
                found.setdefault(script, {}).setdefault(" ".join(args), page.relative_to(REPO))
    return found


def resolve(script):
    """A path from the repository's root, or a lesson file named alone (`python torchrun_elastic.py`
    in a lesson's folder)."""
    if (REPO / script).is_file():
        return REPO / script
    matches = [p for p in REPO.glob(f"[0-9][0-9]_*/{script}")]
    return matches[0] if len(matches) == 1 else None


COMMANDS = named_commands()
# Scripts without --help, run as the pages give them instead: cheap, no torch.
AS_GIVEN = {"tests/lesson_diff.py"}

RUNNER = r"""
import contextlib, io, json, os, runpy, sys
results = {}
for path in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = [path, "--help"]
    code = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        code = done.code or 0
    except BaseException as error:
        code = f"{type(error).__name__}: {error}"
    results[path] = [code, out.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps():
    scripts = sorted({str(resolve(s)) for s in COMMANDS if resolve(s) and s not in AS_GIVEN})
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(scripts)], cwd=REPO, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_pages_name_the_commands_we_expect():
    assert len(COMMANDS) >= 30 and "02_ddp_spawn/prove.py" in COMMANDS and "preflight.py" in COMMANDS
    assert "my_ddp_spawn.py" not in COMMANDS  # the reader's own copy


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_every_named_script_exists_and_answers_help_with_the_flags_the_pages_give(script, helps):
    path = resolve(script)
    where = sorted({str(page) for page in COMMANDS[script].values()})
    assert path, f"{where} name `python {script}`, which is no file of the course"
    if script in AS_GIVEN:
        return
    code, text = helps[str(path)]
    assert code == 0 and "usage:" in text, (
        f"`python {script} --help` ({where}) exited {code!r} and printed {text[:300]!r}: "
        "a script without `if __name__ == '__main__':` does nothing")
    source = path.read_text()
    for args, page in COMMANDS[script].items():
        words = args.split()
        for i, word in enumerate(words):
            flag = word.split("=")[0]
            if flag.startswith("--"):
                assert flag in text, f"{page}: `python {script} {args}`: {flag} is not a flag of it"
            if i and words[i - 1] == "--break":
                assert f'"{word}"' in source, f"{page}: `python {script} {args}`: no --break {word}"
        choices = re.search(r"^usage: \S+ (?:\[[^\]]*\] )*\{([\w,-]+)\}", text, re.M)
        if choices and words and not words[0].startswith("-"):
            assert words[0] in choices.group(1).split(","), f"{page}: `python {script} {args}`"


@pytest.mark.parametrize("args", sorted(COMMANDS.get("tests/lesson_diff.py", {})))
def test_lesson_diff_runs_as_the_pages_give_it(args):
    argv = args.split() or ["00_single_process/single_process.py", "02_ddp_spawn/ddp_spawn.py"]
    if argv[0] == "--refresh":
        pytest.skip("rewrites a README: the README tests check its blocks")
    done = subprocess.run([sys.executable, "tests/lesson_diff.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("--- "), done.stderr


def test_a_script_without_main_fails_the_check(tmp_path, helps):
    """profile_overlap.py, as WORKSHOP.md named it: it defines functions and exits 0 doing nothing."""
    (tmp_path / "no_main.py").write_text("import argparse\ndef main():\n    argparse.ArgumentParser().parse_args()\n")
    done = subprocess.run([sys.executable, "-c", RUNNER, json.dumps([str(tmp_path / "no_main.py")])],
                          capture_output=True, text=True, timeout=60)
    code, text = json.loads(done.stdout)[str(tmp_path / "no_main.py")]
    assert code is None and "usage:" not in text


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page):
    return {re.sub(r"[^\w -]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


@pytest.mark.parametrize("page", [p for p in PAGES if p.suffix == ".md"], ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_lands_on_a_file_and_heading(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"^(https?:|mailto:)", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target} is no file"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: {target}: no heading #{anchor} in {file.name}"


# The front page reads in 5 minutes (issue 32, item 15): what the course is, the two commands, the
# lessons, where to go next. Install variants, versions, platforms and troubleshooting: SETUP.md.
FRONT_PAGE_WORDS = 1100


def test_the_front_page_reads_in_five_minutes_and_links_the_rest():
    readme = (REPO / "README.md").read_text()
    assert len(readme.split()) <= FRONT_PAGE_WORDS, f"{len(readme.split())} words: move the rest to SETUP.md"
    assert "](SETUP.md" in readme
    for heading in ("Platforms", "Troubleshooting", "The tested versions", "Trying the newest versions"):
        assert f"## {heading}" in (REPO / "SETUP.md").read_text() and f"## {heading}" not in readme
