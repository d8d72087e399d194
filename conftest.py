"""pytest settings for the whole repository (tests/ and notebooks/). The test helpers are in
tests/conftest.py."""
import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (--dist loadgroup), a notebook's cells share one kernel: keep them on one
    worker, in order. So do the tests that share a module's `alone` fixture (the lesson copied
    alone and run once): on two workers it would run twice (measured: 10 s more for lesson 07).
    Every other test is placed wherever a worker is free."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        elif "alone" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}-alone"))
