"""Where the launcher makes its temporary folder (the in-process link's socket lives there)."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

from gemini_trainer.supervisor import socket_tmp_root


def test_tmpdir_is_used_when_a_socket_path_in_it_fits(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert socket_tmp_root() == str(tmp_path)


def test_a_tmpdir_too_long_for_a_socket_path_falls_back_to_tmp(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert socket_tmp_root() == "/tmp"


def test_the_fallback_threshold_is_where_binding_starts_to_fail(monkeypatch, tmp_path):
    # The longest root accepted still binds; one byte more would not fit.
    root = tmp_path / "r"
    room = 107 - len("/gemini-launch-xxxxxxxx/inprocess.sock") - len(str(root))
    root = Path(str(root) + "x" * room)
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    assert socket_tmp_root() == str(root)
    with (tempfile.TemporaryDirectory(prefix="gemini-launch-") as made,
          socket.socket(socket.AF_UNIX) as sock):
        sock.bind(str(Path(made) / "inprocess.sock"))
    longer = Path(str(root) + "y")
    longer.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(longer))
    assert socket_tmp_root() == "/tmp"
