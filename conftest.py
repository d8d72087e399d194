"""pytest settings for the whole repository (tests/ and notebooks/). The test helpers are in
tests/conftest.py."""
import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Under pytest-xdist (--dist loadgroup), a notebook's cells share one kernel: keep them on one
    worker, in order. Every other test is placed wherever a worker is free."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
