"""vllm/native_build.py: an interrupted build's lock does not hang later starts, a live build's
lock is waited on, and a shared header is part of every kernel's build key."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from vllm import native_build


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    native_build._clear_stale_lock(str(tmp_path))
    assert lock.exists(), "a build that started a moment ago holds its lock"
    old = time.time() - native_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native_build._clear_stale_lock(str(tmp_path))
    assert not lock.exists()
    native_build._clear_stale_lock(str(tmp_path))  # no lock: nothing to do


def test_a_start_after_an_interrupted_build_loads_instead_of_waiting():
    """The lock a killed build leaves in the kernel's build folder (a real one) used to make
    every later start wait forever inside torch's extension builder."""
    from torch.utils import cpp_extension

    assert native_build.unavailable_reason("rotary_kv.cpp", "CPU rotary and KV-store kernels") is None  # built
    build_dir = cpp_extension._get_build_directory(native_build.build_name("rotary_kv.cpp"), verbose=False)
    lock = os.path.join(build_dir, "lock")
    with open(lock, "w"):
        pass
    old = time.time() - native_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    code = "from vllm import native_build; native_build.build_and_load('rotary_kv.cpp', 'CPU rotary and KV-store kernels')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stale build lock" in proc.stdout + proc.stderr
    assert not os.path.exists(lock)


def test_headers_are_part_of_the_build_key(monkeypatch, tmp_path):
    source = "rotary_kv.cpp"
    before = native_build.build_name(source)
    for name in os.listdir(native_build.CSRC_CPU):
        (tmp_path / name).write_bytes((open(os.path.join(native_build.CSRC_CPU, name), "rb").read()))
    monkeypatch.setattr(native_build, "CSRC_CPU", str(tmp_path))
    assert native_build.build_name(source) == before
    with open(tmp_path / "bf16_bits.h", "a") as f:
        f.write("\n// changed\n")
    assert native_build.build_name(source) != before
