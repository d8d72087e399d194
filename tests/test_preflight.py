"""preflight.py: READY on a machine set up as the README says, and one clear line per problem."""
import pytest

from conftest import load_script, run_lesson


def test_a_machine_set_up_as_the_readme_says_is_ready():
    done = run_lesson("preflight.py", timeout=90)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines[-1].startswith("READY"), done.stdout + done.stderr
    assert [line.split()[0] for line in lines[:-1]] == ["ok"] * 7, done.stdout
    assert "2 ranks all-reduced on gloo through mp.spawn" in done.stdout
    assert float(lines[-1].split("(")[1].split()[0]) <= 30  # the budget, on 2 cores


@pytest.fixture
def preflight():
    return load_script("preflight.py")


def test_a_missing_package_fails_and_says_how_to_install(preflight, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "pins", lambda: {"torch": "2.15.0", "no-such-package": "1.0"})
    assert preflight.main() == 1
    out = capsys.readouterr().out
    assert "FAIL  not installed: no-such-package: run `python -m pip install -r requirements.txt`" in out
    assert "all-reduced" not in out  # the checks that need the packages are not attempted
    assert out.strip().splitlines()[-1].startswith("NOT READY")


def test_a_full_disk_and_one_core_are_named_line_by_line(preflight, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "CHECKS", [preflight.check_disk, preflight.check_cores])
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: type("U", (), {"free": 2e8})())
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert preflight.main() == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("FAIL  0.2 GB free") and lines[1].startswith("WARN  1 core")
    assert lines[2].startswith("NOT READY")


def test_an_unsupported_python_fails(preflight, monkeypatch):
    monkeypatch.setattr(preflight.sys, "version_info", (3, 10, 12))
    status, text = preflight.check_python()
    assert status == "FAIL" and "3.11 to 3.14" in text


def test_the_python_line_names_the_interpreter_and_its_environment(preflight, monkeypatch):
    status, text = preflight.check_python()
    assert status == "ok" and f"at {preflight.sys.executable} (" in text
    assert ("virtual environment " in text) == (preflight.sys.prefix != preflight.sys.base_prefix)
    monkeypatch.setattr(preflight.sys, "prefix", preflight.sys.base_prefix)
    assert preflight.check_python()[1].endswith("(no virtual environment active)")


def test_packages_in_a_venv_that_is_not_active_are_not_reinstalled(preflight, monkeypatch, tmp_path, capsys):
    """The issue's dry run: a new terminal, the venv not activated, told to reinstall 3 GB."""
    venv = tmp_path / ".venv"
    (venv / "lib" / "python3.11" / "site-packages" / "torch").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.setattr(preflight, "ROOT", tmp_path)
    monkeypatch.setattr(preflight.sys, "prefix", preflight.sys.base_prefix)  # no venv active
    monkeypatch.setattr(preflight, "pins", lambda: {"no-such-package": "1.0"})
    assert preflight.main() == 1
    out = capsys.readouterr().out
    assert "(no virtual environment active)" in out.splitlines()[0]
    assert "which is not active: activate .venv with `. .venv/bin/activate`" in out
    assert "pip install" not in out


def test_a_missing_notebook_package_warns_and_the_machine_is_ready(preflight, monkeypatch, capsys):
    """WORKSHOP.md: a missing Jupyter kernel is a WARN, only the notebooks need one."""
    real = preflight.importlib.metadata.version

    def version(name):
        if name == "ipykernel":
            raise preflight.importlib.metadata.PackageNotFoundError(name)
        return real(name)
    monkeypatch.setattr(preflight.importlib.metadata, "version", version)
    monkeypatch.setattr(preflight, "pins", lambda: {"ipykernel": "7.4.0"})
    monkeypatch.setitem(preflight.sys.modules, "jupyter_client.manager", None)  # its import fails
    monkeypatch.setattr(preflight, "CHECKS", [preflight.check_packages, preflight.check_kernel])
    assert preflight.main() == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("WARN  not installed: ipykernel (the notebooks)")
    assert lines[1].startswith("WARN  jupyter is not installed") and lines[2].startswith("READY")
