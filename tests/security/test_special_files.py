"""Item: `-f` (and a secret's file) on /dev/zero, a FIFO or a huge file: a clear error at once, nothing read without end."""

from __future__ import annotations

import os
import secrets as _secrets
from pathlib import Path

import pytest

from gpufleet.secrets import SecretError, read_secrets
from tests.workload.helpers import cli_process


@pytest.mark.parametrize("what", ["/dev/zero", "fifo", "huge"])
def test_validate_refuses_what_is_no_small_regular_file(what, tmp_path: Path):
    if what == "fifo":
        path = tmp_path / "workload.yaml"
        os.mkfifo(path)  # nobody writes to it: reading it would block forever
        expected = "is a FIFO (named pipe), not a regular file"
    elif what == "huge":
        path = tmp_path / "workload.yaml"
        with open(path, "wb") as f:
            f.truncate(64 << 20)  # sparse: 64 MiB of zeros
        expected = "is larger than 4,194,304 bytes"
    else:
        path = Path(what)
        expected = "is a character device, not a regular file"
    for argv in (["validate", "-f", str(path)], ["run", "-f", str(path), "--dry-run"]):
        done = cli_process(*argv, timeout=60)  # /dev/zero filled memory until the OOM killer came, a FIFO hung
        assert done.returncode == 2, done.stdout + done.stderr
        text = done.stdout + done.stderr
        assert expected in text and "Traceback" not in text, text


def test_a_secret_file_that_is_a_fifo_is_refused(tmp_path: Path):
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    with pytest.raises(SecretError, match="is a FIFO"):
        read_secrets({"TOKEN": {"file": str(fifo)}})
    plain = tmp_path / "plain"
    value = _secrets.token_hex(8)
    plain.write_text(value + "\n")
    assert read_secrets({"TOKEN": {"file": str(plain)}}) == {"TOKEN": value}
