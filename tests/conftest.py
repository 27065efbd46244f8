"Shared fixtures: one temporary capbook home per test session, with the smoke-profile data prepared once."
import os, sys
from pathlib import Path
import pytest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def home(tmp_path_factory):
    "A CAPBOOK_HOME for the session (data/, runs/, figures/ go there, never into the checkout)."
    d = tmp_path_factory.mktemp("capbook-home")
    old = os.environ.get("CAPBOOK_HOME")
    os.environ["CAPBOOK_HOME"] = str(d)
    yield d
    if old is None: os.environ.pop("CAPBOOK_HOME", None)
    else: os.environ["CAPBOOK_HOME"] = old


@pytest.fixture(scope="session")
def smoke(home):
    "The smoke-profile shapes data (dataset, frozen encoder, features), prepared once."
    from capbook.prepare import prepare
    return prepare("shapes", "smoke")
