"""A second local user for the permission tests (a teammate in a shared group), made with ``useradd``."""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class SecondUser:
    """Another local user, and a group both of us are in (the team)."""

    name: str
    uid: int
    team_gid: int

    def run(self, *argv: str, **kwargs) -> subprocess.Popen:
        """Start ``argv`` as this user (``runuser``), with a plain environment."""
        env = {"PATH": "/usr/bin:/bin", "HOME": "/", "LANG": "C.UTF-8"}
        return subprocess.Popen([shutil.which("runuser") or "runuser", "-u", self.name, "--", *argv], env=env, **kwargs)


def make_second_user() -> SecondUser:
    """Create the user and its team (once per test process); skip when that cannot be done here."""
    if os.geteuid() != 0:
        pytest.skip("the second-user cases need root (useradd, runuser) to create the teammate")
    if not (shutil.which("useradd") and shutil.which("groupadd") and shutil.which("runuser")):
        pytest.skip("the second-user cases need useradd, groupadd and runuser")
    name = f"gpft{os.getpid() % 100000}"
    team = f"{name}t"
    try:
        pwd.getpwnam(name)
    except KeyError:
        done = subprocess.run(["groupadd", team], capture_output=True, text=True)
        if done.returncode not in (0, 9):  # 9: exists already
            pytest.skip(f"groupadd cannot create a group here: {done.stderr.strip()}")
        done = subprocess.run(["useradd", "-M", "-N", "-g", team, "-s", "/bin/sh", name], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"useradd cannot create a user here: {done.stderr.strip()}")
    return SecondUser(name, pwd.getpwnam(name).pw_uid, grp.getgrnam(team).gr_gid)


def remove_second_user(user: SecondUser) -> None:
    subprocess.run(["userdel", user.name], capture_output=True)
    subprocess.run(["groupdel", f"{user.name}t"], capture_output=True)
