"The environment `make venv` builds: requirements.lock pins what pyproject.toml asks for, the tests run on exactly those pins, and uv is pointed at pip's own indexes."
import platform, sys, tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from pip_indexes import uv_options  # noqa: E402


def pins() -> dict[str, str]:
    "requirements.lock as {canonical name: pinned version}."
    out = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            r = Requirement(line)
            (spec,) = r.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(r.name)] = spec.version
    return out


def test_the_lock_pins_every_declared_dependency_within_its_range():
    "Each dependency pyproject.toml declares (the test extra too) is pinned, at a version its range admits: `make lock` was run after the ranges last changed."
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    locked = pins()
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        r = Requirement(line)
        name = canonicalize_name(r.name)
        assert name in locked, f"{r.name} is not in requirements.lock: run `make lock`"
        assert r.specifier.contains(locked[name], prereleases=True), f"requirements.lock pins {r.name} {locked[name]}, outside {r.specifier}: run `make lock`"


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"), reason="the lock is resolved for Linux on x86-64")
def test_the_tests_run_on_the_locked_versions():
    "Every package of the lock is installed here at its pinned version: the numbers the tests check come from the environment the lock describes."
    wrong = {}
    for name, v in pins().items():
        try: have = version(name)
        except PackageNotFoundError: have = None
        if have != v: wrong[name] = (have, v)
    assert not wrong, f"installed, locked: {wrong}"


def test_uv_is_given_the_indexes_pip_is_configured_with():
    config = ("global.constraint='/etc/xdg/pip/constraints.txt'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/opt/wheels'\n"
              ":env:.find-links='/opt/wheels'\n"
              "install.index-url='https://mirror.example/simple'\n"
              ":env:.default-timeout='180'\n")
    assert uv_options(config) == ["--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
                                  "--find-links", "/opt/wheels", "--index-url", "https://mirror.example/simple"]
    assert uv_options("") == []
