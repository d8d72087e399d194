"""pytest settings for the whole repository (tests/ and notebooks/). The test helpers are in
tests/conftest.py.

How pytest-xdist shares the tests between workers (pytest.ini: `-n auto --dist loadscope`):
a notebook's cells share one kernel, so a notebook is one unit of work, run in order on one worker;
a test class is one unit (the tests of `TestTheLessonCopiedAlone` share one run of the lesson);
every other test is a unit of its own, placed wherever a worker is free. The units are made here,
from the node ids as pytest writes them: nothing depends on pytest-xdist rewriting node ids, which
pytest 9.2 ignores (pytest-dev/pytest-xdist issue 1386). And a notebook cell refuses to run in a
kernel that did not run the cells before it, so a split notebook fails with one clear message."""
import pytest

try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest -p no:xdist, or xdist not installed: everything runs in one process
    LoadScopeScheduling = object


def unit_of_work(nodeid):
    """The unit of work a test belongs to: its notebook, its class, or itself.

        notebooks/02_ddp_spawn.ipynb::Cell 3              -> notebooks/02_ddp_spawn.ipynb
        tests/test_07_fsdp_dcp.py::TestTheLessonCopiedAlone::test_x[a] -> ...::TestTheLessonCopiedAlone
        tests/test_07_fsdp_dcp.py::test_y[1-2]            -> tests/test_07_fsdp_dcp.py::test_y[1-2]
    """
    path, _, rest = nodeid.partition("::")
    if path.endswith(".ipynb"):
        return path
    parts = rest.split("[", 1)[0].split("::")  # a parameter's id may hold "::" too
    return f"{path}::{parts[0]}" if len(parts) > 1 else nodeid


class KeepTogetherScheduling(LoadScopeScheduling):
    """pytest-xdist's loadscope, with unit_of_work as the scope; the units go out in collection
    order, notebooks first (pytest.ini's testpaths): they are the longest, and the short tests
    fill the tail (measured: 4:42 instead of 5:04 on 2 cores)."""

    def _split_scope(self, nodeid):
        return unit_of_work(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") in ("load", "loadscope", "loadgroup", "loadfile"):
        return KeepTogetherScheduling(config, log)
    return None


_cells_run = {}  # (notebook path, id of a kernel) -> how many of the notebook's cells ran in it, in order


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item):
    """A notebook's cell N runs only in the kernel that ran its cells 0 to N-1, in order."""
    if item.path.suffix != ".ipynb" or not hasattr(item.parent, "kernel"):
        return
    cells = [i.nodeid for i in item.session.items if i.path == item.path]
    position = cells.index(item.nodeid)
    kernel = id(item.parent.kernel)
    ran = 0 if position == 0 else _cells_run.get((item.path, kernel), 0)
    if ran != position:
        pytest.fail(f"{item.nodeid} would run in a kernel that ran {ran} of the {position} cells "
                    f"before it: the notebook's cells were split between test workers or reordered "
                    f"(see conftest.py)", pytrace=False)
    _cells_run[item.path, kernel] = position + 1
