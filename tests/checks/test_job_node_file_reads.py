"""How a node reads the files of its launch (preflight.node.launchfiles.read_file): only regular files, checked on
the opened descriptor, and bounded, even when a symlink is pointed elsewhere between the stat and the open."""
import os
import threading
import time

import pytest

from preflight.node import launchfiles


def read_in_time(path, cwd, seconds=20.0, **kwargs):
    """read_file's answer, or a failure when it does not come back within `seconds` (a read without bound)."""
    answer = []
    worker = threading.Thread(target=lambda: answer.append(launchfiles.read_file(path, cwd, **kwargs)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"read_file({path!r}) did not return within {seconds:g} s"
    return answer[0]


@pytest.fixture
def flipped(tmp_path, monkeypatch):
    """A symlink `config.yaml` to a regular file; flipped(target) points it at `target` right after read_file's
    stat of it, before the open."""
    regular = tmp_path / "real.yaml"
    regular.write_text("num_machines: 2\n")
    link = tmp_path / "config.yaml"
    link.symlink_to(regular)
    real_stat = os.stat

    def flip(target):
        def stat_then_flip(path, *args, **kwargs):
            result = real_stat(path, *args, **kwargs)
            if str(path) == str(link):
                swapped = tmp_path / "swapped"
                swapped.symlink_to(target)
                os.replace(swapped, link)
            return result
        monkeypatch.setattr(launchfiles.os, "stat", stat_then_flip)
        return link
    return flip


def test_a_symlink_flipped_to_dev_zero_after_its_stat_is_not_read(flipped, tmp_path):
    link = flipped("/dev/zero")
    entry = read_in_time(str(link), str(tmp_path), text=True)
    assert entry == {"path": str(link), "size": 16, "error": "not a regular file"}


def test_a_symlink_flipped_to_a_fifo_after_its_stat_is_not_read_as_an_empty_file(flipped, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = flipped(str(fifo))
    entry = read_in_time(str(link), str(tmp_path), text=True)
    assert entry.get("error") == "not a regular file" and "sha256" not in entry, entry


def test_a_symlink_flipped_to_a_bigger_file_after_its_stat_is_held_to_the_limit(flipped, tmp_path, monkeypatch):
    monkeypatch.setattr(launchfiles, "DIGEST_LIMIT", 1 << 20)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (2 << 20))
    link = flipped(str(big))
    entry = read_in_time(str(link), str(tmp_path))
    assert entry.get("error") == "larger than 1 MiB: not read" and "sha256" not in entry, entry


def test_the_descriptor_guard_refuses_dev_zero_and_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        with pytest.raises(launchfiles.NotRegular, match="not a regular file"):
            launchfiles.open_regular(path)  # O_NONBLOCK: opening the FIFO without a writer returns at once
    regular = tmp_path / "t.py"
    regular.write_text("print(1)\n")
    fd = launchfiles.open_regular(str(regular))
    try:
        assert os.read(fd, 100) == b"print(1)\n"
    finally:
        os.close(fd)


def test_a_read_past_its_deadline_stops_and_says_so(tmp_path):
    data = tmp_path / "data.json"
    data.write_bytes(b"{}" * (2 << 20))
    entry = read_in_time(str(data), str(tmp_path), until=time.monotonic() - 1)
    assert "out of time" in entry.get("error", "") and "sha256" not in entry, entry


def test_a_regular_file_and_a_symlink_to_one_are_read_whole(tmp_path):
    target = tmp_path / "train.py"
    target.write_text("print('training')\n")
    (tmp_path / "link.py").symlink_to(target)
    plain = launchfiles.read_file("train.py", str(tmp_path), True)
    linked = launchfiles.read_file("link.py", str(tmp_path), True)
    assert plain["text"] == linked["text"] == "print('training')\n" and plain["sha256"] == linked["sha256"]
    assert plain["size"] == 18 and "error" not in plain
