"""The allocator setting of smp_core.memory: applied once, switchable off, harmless without glibc."""

import ctypes

import pytest

from smp_core import memory


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(memory, "_applied", None)
    return memory


def _has_glibc():
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv("SMP_RETAIN_FREED_MEMORY", "0")
    assert fresh.retain_freed_memory() is False
    monkeypatch.delenv("SMP_RETAIN_FREED_MEMORY")
    assert fresh.retain_freed_memory() is False  # decided once per process


@pytest.mark.skipif(not _has_glibc(), reason="glibc only")
def test_applied_once_with_glibc(fresh, monkeypatch):
    monkeypatch.delenv("SMP_RETAIN_FREED_MEMORY", raising=False)
    assert fresh.retain_freed_memory() is True
    assert fresh.retain_freed_memory() is True


def test_without_glibc_it_does_nothing(fresh, monkeypatch):
    def no_libc(name):
        raise OSError(f"{name}: not found")

    monkeypatch.delenv("SMP_RETAIN_FREED_MEMORY", raising=False)
    monkeypatch.setattr(memory.ctypes, "CDLL", no_libc)
    assert fresh.retain_freed_memory() is False
