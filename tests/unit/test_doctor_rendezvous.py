"""`gpufleet doctor` says where torch's rendezvous store listens, and what to do about it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet import doctor
from gpufleet.cli import main


def _listening_ports(address_hex: set[str]) -> set[int]:
    """Ports of this machine's listening TCP sockets bound to the given /proc/net addresses."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.split(":")
            if state == "0A" and address in address_hex:
                ports.add(int(port, 16))
    return ports


def test_the_report_matches_where_the_store_really_listens(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    info = report["rendezvous"]
    line = next(c for c in report["checks"] if c["message"].startswith("rendezvous: "))
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to compare with")
    # an independent look at the same behaviour: a store started the way rank 0 starts it
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    wildcard = store.port in _listening_ports({"00000000", "00000000000000000000000000000000"})
    del store
    assert info["loopback_only"] is (not wildcard)
    if wildcard:  # torch 2.13: it ignores the host name and binds every interface
        assert line["status"] == "warn"
        assert "listens on all interfaces" in line["message"] and "not only on MASTER_ADDR=127.0.0.1" in line["message"]
        assert "firewall" in line["message"] and "network namespace" in line["message"]
    else:
        assert line["status"] == "ok"


def test_the_text_report_has_one_rendezvous_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "rendezvous:" in ln]
    assert len(lines) == 1 and lines[0].startswith(("[warn] rendezvous: ", "[ok]   rendezvous: "))
    assert "docs/multinode.md" in lines[0] or lines[0].startswith("[ok]")


def test_a_loopback_only_store_is_ok(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor, "_listen_address", lambda port: "127.0.0.1")
    assert main(["doctor"]) == 0
    assert "[ok]   rendezvous: torch's TCPStore listens on 127.0.0.1 only (this machine)" in capsys.readouterr().out


def test_a_failed_probe_still_gives_the_advice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor, "_listen_address", lambda port: None)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "[warn] rendezvous: could not check where torch's TCPStore listens" in out
    assert "firewall this host or run in a network namespace" in out


def test_no_line_without_torch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: None if dist == "torch" else real(dist))
    assert main(["doctor"]) == 0
    assert "rendezvous" not in capsys.readouterr().out
