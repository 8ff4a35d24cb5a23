"""Item: no code runs from a run folder a teammate swapped under its path (every parent checked)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet import distributed
from gpufleet.private import UnsafeStateError
from gpufleet.runs.store import RunStore

CPU = {"gpus": 2, "gpu_type": "cpu", "tracking": False, "stream_logs": False}
ATTACK = Path(__file__).with_name("swap_attack.py")


def _slow_rank(started: str = "") -> int:
    import os

    if started and os.environ["RANK"] == "0":
        open(started, "w").close()
    time.sleep(4)  # the teammate's outcome files are there before ours
    return 7


def _team_folder(shared_tmp: str, user) -> Path:
    """A team folder (root's, setgid, group-writable: 2775) with a private runs folder of ours inside."""
    team = Path(shared_tmp) / "team"
    team.mkdir()
    os.chown(team, 0, user.team_gid)
    os.chmod(team, 0o2775)
    mine = team / "mine"
    mine.mkdir(mode=0o700)
    return mine


def test_a_runs_folder_a_teammate_can_swap_is_refused_and_no_payload_runs(second_user, shared_tmp):
    mine = _team_folder(shared_tmp, second_user)
    marker, started = Path(shared_tmp) / "payload-ran", Path(shared_tmp) / "started"
    attack = second_user.run("/usr/bin/python3", str(ATTACK), str(mine), str(marker), "30", str(started),
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    refused = None
    try:
        distributed(_slow_rank, runs_dir=str(mine), timeout=60, **CPU).distributed(str(started))
    except UnsafeStateError as e:
        refused = e
    finally:
        attack.kill()
        attack.wait()
    assert not marker.exists(), "the teammate's pickled payload ran as the caller"
    assert refused is not None, "the call ran in a folder a teammate could swap"
    text = str(refused)
    assert f"inside {mine.parent}, which its group may write to (mode 2775)" in text
    assert "chmod +t" in text and "runs_dir" in text
    assert list(mine.iterdir()) == []  # no run folder, no worker for the teammate to find


def test_the_same_call_in_a_sticky_team_folder_runs(second_user, shared_tmp):
    # sticky (as /tmp): the teammate may not rename our folder, so the call runs and the payload cannot land
    mine = _team_folder(shared_tmp, second_user)
    os.chmod(mine.parent, 0o3775)
    marker = Path(shared_tmp) / "payload-ran"
    attack = second_user.run("/usr/bin/python3", str(ATTACK), str(mine), str(marker), "20",
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert distributed(_slow_rank, runs_dir=str(mine), timeout=60, **CPU).distributed() == [7, 7]
    finally:
        attack.kill()
        _, err = attack.communicate()
    assert "PermissionError" in err  # its rename was refused
    assert not marker.exists()


def test_a_state_folder_in_a_group_writable_folder_is_refused(second_user, shared_tmp, monkeypatch):
    home = _team_folder(shared_tmp, second_user) / "home"
    monkeypatch.setenv("GPUFLEET_HOME", str(home))
    with pytest.raises(UnsafeStateError, match="which its group may write to"):
        distributed(_slow_rank, **CPU).distributed()
    with pytest.raises(UnsafeStateError, match="which its group may write to"):
        RunStore(home)
    assert not home.exists()


def test_a_link_into_a_folder_others_may_write_is_followed_and_refused(tmp_path):
    team = tmp_path / "open"
    team.mkdir()
    os.chmod(team, 0o777)
    (team / "mine").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(team / "mine")
    with pytest.raises(UnsafeStateError, match=rf"inside {team}, which others may write to \(mode 0777\)"):
        distributed(_slow_rank, runs_dir=str(tmp_path / "link"), **CPU).distributed()


def test_a_folder_owned_by_another_user_on_the_way_is_refused(second_user, shared_tmp):
    theirs = Path(shared_tmp) / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, second_user.uid, second_user.team_gid)
    mine = theirs / "mine"
    mine.mkdir(mode=0o700)
    with pytest.raises(UnsafeStateError, match=rf"inside {theirs}, which is owned by {second_user.name}"):
        distributed(_slow_rank, runs_dir=str(mine), **CPU).distributed()


def test_a_folder_the_user_may_not_enter_on_the_way_is_a_clear_error(second_user, shared_tmp):
    closed = Path(shared_tmp) / "closed"
    closed.mkdir(mode=0o700)  # root's: the second user may not look inside
    script = ("from gpufleet.private import private_dir, UnsafeStateError\n"
              f"try:\n    private_dir({str(closed / 'x' / 'runs')!r})\n"
              "except UnsafeStateError as e:\n    print('refused:', e)\n")  # fmt: skip
    src = str(Path(__file__).resolve().parents[2] / "src")
    proc = second_user.run("/usr/bin/env", f"PYTHONPATH={src}", "/usr/bin/python3", "-c", script,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert f"refused: gpufleet's state folder {closed / 'x' / 'runs'} cannot be reached: {closed / 'x'}: Permission denied" in out, out + err  # was: a raw PermissionError
