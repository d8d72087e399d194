"""The supported torch range that SETUP.md states is the one the pins hold: its floor is
constraints-floor.txt's torch (which CI's floor run installs), its top constraints.txt's."""
import re

import pytest

from conftest import REPO
from test_fresh_machine import pins

RANGE = re.compile(r"\*\*Supported: torch (\d+\.\d+) to (\d+\.\d+)\.\*\*")


def stated_range(text):
    """(floor, top) of SETUP.md's `**Supported: torch A.B to C.D.**` line."""
    found = RANGE.findall(text)
    assert len(found) == 1, "SETUP.md states the supported range once: **Supported: torch A.B to C.D.**"
    return found[0]


def minor(version):
    return ".".join(version.split("+")[0].split(".")[:2])


def range_problems(setup_text, floor_pins, top_pins):
    """What disagrees between SETUP.md's range and the pins, one line each."""
    floor, top = stated_range(setup_text)
    problems = []
    if minor(floor_pins["torch"]) != floor:
        problems.append(f"SETUP.md's floor is torch {floor}, constraints-floor.txt pins "
                        f"{floor_pins['torch']}")
    if minor(top_pins["torch"]) != top:
        problems.append(f"SETUP.md's top is torch {top}, constraints.txt pins {top_pins['torch']}")
    if f"torch=={floor_pins['torch']}" not in setup_text.replace(" ", ""):
        problems.append(f"SETUP.md does not name the floor's exact version torch=={floor_pins['torch']}")
    return problems


def test_setup_states_the_floor_and_the_top_that_the_pins_hold():
    problems = range_problems((REPO / "SETUP.md").read_text(), pins("constraints-floor.txt"),
                              pins("constraints.txt"))
    assert not problems, "; ".join(problems)


def test_the_range_check_can_fail():
    text = "**Supported: torch 2.11 to 2.15.** The floor: torch==2.11.0."
    assert range_problems(text, {"torch": "2.11.0"}, {"torch": "2.15.0"}) == []
    assert len(range_problems(text, {"torch": "2.12.0"}, {"torch": "2.15.0"})) == 2
    assert len(range_problems(text, {"torch": "2.11.0"}, {"torch": "2.16.0"})) == 1
    with pytest.raises(AssertionError):
        stated_range("torch 2.11 to 2.15, said without the marker")


def test_the_floor_requirements_read_the_floor_constraints_and_agree_with_them():
    lines = (REPO / "requirements-floor.txt").read_text().splitlines()
    assert "-c constraints-floor.txt" in lines
    requirements, constraints = pins("requirements-floor.txt"), pins("constraints-floor.txt")
    assert {"torch", "torchvision"} <= set(requirements)
    for name, version in requirements.items():
        assert constraints.get(name) == version, f"{name}: {version} in requirements-floor.txt, " \
                                                 f"{constraints.get(name)} in constraints-floor.txt"


def test_ci_runs_every_lab_on_the_floor_after_the_suite():
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    suite = lines.index("python -m pip install -r requirements.txt && python -m pytest")
    floor = next(n for n, line in enumerate(lines)
                 if line.startswith("python -m pip install -r requirements-floor.txt"))
    assert suite < floor < lines.index("python run_lessons.py"), \
        "CI installs the floor after the suite, then runs every lab there"
