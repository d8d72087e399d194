"""The course's own promises: each lesson is complete and self-contained, CI runs the README's test
command, and the quickstart runner finds and runs every lesson."""
import ast
import re
import subprocess
import sys

import pytest

from conftest import REPO, lesson_env

LESSONS = sorted(p for p in REPO.glob("[0-9][0-9]_*") if p.is_dir())
ALLOWED = set(sys.stdlib_module_names) | {"torch", "torchvision", "matplotlib"}


def test_there_are_lessons():
    assert len(LESSONS) >= 1


@pytest.mark.parametrize("folder", LESSONS, ids=lambda p: p.name)
def test_lesson_has_script_readme_and_notebook(folder):
    name = folder.name.split("_", 1)[1]
    assert (folder / f"{name}.py").is_file()
    assert (folder / "README.md").is_file()
    assert (REPO / "notebooks" / f"{folder.name}.ipynb").is_file()


@pytest.mark.parametrize("script", [p for d in LESSONS for p in d.glob("*.py")], ids=lambda p: p.name)
def test_lesson_code_imports_only_stdlib_torch_torchvision_matplotlib(script):
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in ALLOWED or (script.parent / f"{top}.py").exists(), f"{script.name} imports {name}"


@pytest.mark.parametrize("script", [p for d in LESSONS for p in d.glob("*.py")], ids=lambda p: p.name)
def test_no_hard_coded_port(script):
    text = script.read_text()
    assert not re.search(r"(?i)port\s*[=:,]\s*['\"]?(12355|29500)\b", text)
    assert "MASTER_PORT" not in text or "find_free_port" in text or "torchrun" in text


def readme_test_command():
    readme = (REPO / "README.md").read_text()
    found = re.search(r"^(python -m pip install -r requirements\.txt && python -m pytest)$", readme, re.M)
    assert found, "the README's quickstart test command was not found"
    return found.group(1)


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert readme_test_command() in ci.splitlines()


def test_runner_finds_every_lesson():
    result = subprocess.run([sys.executable, "run_lessons.py", "--list"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    listed = [line.split(":")[0] for line in result.stdout.splitlines()]
    assert listed == [d.name for d in LESSONS]


@pytest.mark.timeout(120)
def test_runner_runs_a_lesson_and_reports_it(lesson):
    """Lesson 05's command starts with `torchrun`: the runner must launch it from this interpreter's torch
    (python -m torch.distributed.run), so it works even where the venv's bin/ is not on PATH."""
    env = dict(lesson_env(lesson.tag), PATH="/nonexistent")  # no torchrun (nor python) to find on PATH
    result = subprocess.run([sys.executable, "run_lessons.py", "--only", "05"], cwd=REPO, capture_output=True,
                            text=True, timeout=110, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PROOF PASSED" in result.stdout
    assert re.search(r"^05_torchrun_elastic\s+ok\s+\d+$", result.stdout, re.M)


def test_runner_rejects_an_unknown_lesson():
    result = subprocess.run([sys.executable, "run_lessons.py", "--only", "99"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "no lesson matches" in result.stderr
