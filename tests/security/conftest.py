"""Fixtures of the security tests: a second local user, a folder both users can reach."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.security.second_user import make_second_user, remove_second_user
from tests.workload.conftest import home, store  # noqa: F401 - the workload tests' private store


@pytest.fixture(scope="session")
def second_user():
    user = make_second_user()
    yield user
    remove_second_user(user)


@pytest.fixture
def shared_tmp():
    """A folder like /tmp (root's, 1777) that the second user can reach (tmp_path's parents are root's alone)."""
    path = tempfile.mkdtemp(prefix="gpufleet-shared-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)

