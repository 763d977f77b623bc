"""Model loading shows a progress bar on a terminal (a real pseudo-terminal here) and writes
nothing when stderr is a pipe or a file, as under a supervisor or in a log pipeline."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios

import torch

from kvserve.engine.distributed.parallel import ParallelContext
from kvserve.engine.layers.attention.backend import create_attention_backend
from kvserve.engine.model_loader.loader import load_hf_config, load_weights, loading_progress
from kvserve.engine.model_loader.source import resolve_model
from kvserve.engine.models import build_model


def open_terminal() -> tuple[int, int]:
    """A pseudo-terminal 120 columns wide (a new one is 0 x 0, where tqdm draws nothing)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # a pty's master raises once the slave side is closed and drained
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode(errors="replace")


def test_loading_a_model_on_a_terminal_shows_its_progress(tiny_qwen2_dir, monkeypatch):
    src = resolve_model(str(tiny_qwen2_dir))
    device = torch.device("cpu")
    model = build_model(load_hf_config(src), torch.float32, device, ParallelContext(),
                        create_attention_backend("torch", device, 16))
    master, slave = open_terminal()
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        load_weights(model, src)
    out = read_all(master)
    os.close(master)
    assert f"loading {src.name}" in out and "100%" in out


def test_no_progress_output_when_stderr_is_not_a_terminal(monkeypatch):
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        monkeypatch.setattr(sys, "stderr", pipe)
        assert list(loading_progress(range(7), 7, "model")) == list(range(7))
    with os.fdopen(read) as r:
        assert r.read() == ""
