"""A fresh machine behaves like the one the suite last passed on: the install command installs
exactly the tested versions, CI builds its own virtual environment, a notebook's cells run in one
kernel whatever pytest-xdist does with node ids, and no committed output names a machine's path."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import REPO, load_script

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)(?:\s*;\s*[^#]+)?$")  # ; a marker


def pins(path):
    """{normalized name: version} of a requirements or constraints file; every line a `==` pin."""
    found = {}
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith(("-c ", "-r ")):
            continue
        match = PIN.match(line)
        assert match, f"{path}: {line!r} is not an exact pin (name==version)"
        found[re.sub(r"[-_.]+", "-", match.group(1)).lower()] = match.group(2)
    return found


def test_the_install_command_installs_exact_versions():
    requirements, constraints = pins("requirements.txt"), pins("constraints.txt")
    assert "-c constraints.txt" in (REPO / "requirements.txt").read_text().splitlines(), \
        "requirements.txt must read the constraints (pip install -r requirements.txt then pins all)"
    assert {"torch", "torchvision", "pytest", "pytest-xdist", "nbval"} <= set(requirements)
    for name, version in requirements.items():
        assert constraints.get(name) == version, f"{name}: {version} in requirements.txt, " \
                                                 f"{constraints.get(name)} in constraints.txt"
    local = [f"{n}=={v}" for n, v in {**requirements, **constraints}.items() if "+" in v]
    assert not local, f"no build tags such as +cpu (torchvision then fails at import): {local}"


@pytest.mark.skipif(os.environ.get("COURSE_UNPINNED") == "1",
                    reason="COURSE_UNPINNED=1: trying versions newer than the tested set")
def test_this_environment_has_the_tested_versions():
    """The suite runs on the pinned set; on other versions a failure may be theirs, not the
    course's (SETUP.md: trying the newest versions)."""
    wrong = []
    for name, version in pins("constraints.txt").items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a package of another platform's set (CUDA libraries, triton)
        if installed.split("+")[0] != version:
            wrong.append(f"{name} {installed} (pinned {version})")
    assert not wrong, "not the tested versions: " + ", ".join(wrong) + \
        ". Install with `python -m pip install -r requirements.txt` in a new virtual environment"


def test_ci_builds_a_new_virtual_environment_and_runs_the_readmes_commands():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    install = "python -m pip install -r requirements.txt"
    assert re.search(r"^python -m venv \S+", ci, re.M), "CI makes a virtual environment"
    assert re.search(r"^\. \S+/bin/activate", ci, re.M), "and runs in it"
    assert f"{install} && python -m pytest" in ci.splitlines()
    assert f"{install} && python -m pytest" in readme.splitlines()
    assert readme.index("python -m venv") < readme.index(install), \
        "the README makes the virtual environment before the install"


# --- the units of work pytest-xdist gets (conftest.py at the repository root) -----------------------

@pytest.fixture(scope="module")
def root_conftest():
    return load_script("conftest.py")


def test_a_notebook_and_a_test_class_are_each_one_unit_and_every_other_test_its_own(root_conftest):
    unit = root_conftest.unit_of_work
    assert unit("notebooks/02_ddp_spawn.ipynb::Cell 0") == unit("notebooks/02_ddp_spawn.ipynb::Cell 9")
    assert unit("notebooks/02_ddp_spawn.ipynb::Cell 0") != unit("notebooks/03_model_parallel.ipynb::Cell 0")
    alone = "tests/test_07_fsdp_dcp.py::TestTheLessonCopiedAlone::"
    assert unit(alone + "test_a[x-1]") == unit(alone + "test_b") == alone[:-2]
    assert unit("tests/test_07_fsdp_dcp.py::test_a") != unit("tests/test_07_fsdp_dcp.py::test_b")
    assert unit("tests/test_x.py::test_a[a::b]") == "tests/test_x.py::test_a[a::b]"


def test_pytest_ini_asks_for_a_distribution_the_scheduler_takes(root_conftest):
    ini = (REPO / "pytest.ini").read_text()
    dist = re.search(r"--dist[ =](\w+)", ini).group(1)
    config = types.SimpleNamespace(getvalue=lambda name: dist)
    scheduler = root_conftest.pytest_xdist_make_scheduler(config, log=None)
    assert isinstance(scheduler, root_conftest.KeepTogetherScheduling)


def fake_cell(notebook, number, kernel, all_cells):
    item = types.SimpleNamespace(path=Path(notebook), nodeid=f"{notebook}::Cell {number}",
                                 parent=types.SimpleNamespace(kernel=kernel))
    item.session = types.SimpleNamespace(items=all_cells)
    all_cells.append(item)
    return item


def test_a_cell_refuses_a_kernel_that_did_not_run_the_cells_before_it(root_conftest, monkeypatch):
    monkeypatch.setattr(root_conftest, "_cells_run", {})
    kernel_a, kernel_b, items = object(), object(), []
    cells = [fake_cell("notebooks/x.ipynb", n, kernel_a, items) for n in range(3)]
    for cell in cells[:2]:
        root_conftest.pytest_runtest_setup(cell)  # in order, in one kernel: fine
    cells[2].parent.kernel = kernel_b  # cell 2 on another worker's kernel
    with pytest.raises(pytest.fail.Exception, match="ran 0 of the 2 cells before it"):
        root_conftest.pytest_runtest_setup(cells[2])
    other = [fake_cell("notebooks/y.ipynb", n, kernel_a, items) for n in range(2)]
    with pytest.raises(pytest.fail.Exception, match="ran 0 of the 1 cells before it"):
        root_conftest.pytest_runtest_setup(other[1])  # cell 1 first: cell 0 went elsewhere


@pytest.mark.timeout(120)
def test_two_workers_keep_a_notebook_and_a_class_together(tmp_path):
    """A real pytest-xdist run with the repository's conftest.py on two workers: every cell of the
    notebook on one worker, in one kernel, and the class's tests on one worker."""
    (tmp_path / "conftest.py").write_text((REPO / "conftest.py").read_text())
    cells = [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
              "source": "x = 0" if n == 0 else f"assert x == {n - 1}\nx += 1"} for n in range(8)]
    notebook = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "story.ipynb").write_text(json.dumps(notebook))
    (tmp_path / "test_units.py").write_text(
        "import os\n"
        "class TestShared:\n" + "".join(f"    def test_{n}(self): pass\n" for n in range(3)) +
        "".join(f"def test_loose_{n}(): pass\n" for n in range(6)))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadscope", "--nbval-lax", "-v",
         "-p", "no:cacheprovider", "story.ipynb", "test_units.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=110,
        env=dict(os.environ, PYTEST_ADDOPTS=""))
    assert result.returncode == 0, result.stdout[-3000:]
    ran = re.findall(r"^\[(gw\d)\] .*?PASSED (\S+?)(?:::ipynb)?::(.+?)\s*$", result.stdout, re.M)
    workers = {}
    for worker, path, test in ran:
        unit = "notebook" if "story" in path else "class" if test.startswith("TestShared") else test
        workers.setdefault(unit, set()).add(worker)
    assert len(ran) == 8 + 3 + 6, result.stdout
    assert len(workers["notebook"]) == 1 and len(workers["class"]) == 1, workers
    assert set().union(*workers.values()) == {"gw0", "gw1"}, "both workers were used"


# --- committed outputs: nothing of the machine that ran them ---------------------------------------

MACHINE_PATH = re.compile(r"(/root/|/home/|/Users/|/tmp/|/private/var/|/opt/|/usr/|/work/|"
                          r"site-packages|[A-Za-z]:\\\\)")


def notebook_outputs(path):
    for number, cell in enumerate(c for c in json.loads(path.read_text())["cells"]
                                  if c["cell_type"] == "code"):
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain") or ""
            yield number, "".join(text) + "".join(output.get("traceback", []))


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebook_outputs_name_no_path_of_the_machine_that_ran_them(notebook):
    found = [(n, text[max(0, m.start() - 60):m.end() + 40]) for n, text in notebook_outputs(notebook)
             for m in MACHINE_PATH.finditer(text)]
    assert not found, f"cell outputs with a machine's path (nbval fails them elsewhere): {found}"


def test_the_path_check_can_fail(tmp_path):
    cell = {"cell_type": "code", "source": "", "metadata": {}, "outputs": [
        {"output_type": "stream", "name": "stderr",
         "text": ["/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/torch/x.py:72: Warn"]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(AssertionError, match="a machine's path"):
        test_committed_notebook_outputs_name_no_path_of_the_machine_that_ran_them(tmp_path / "x.ipynb")
