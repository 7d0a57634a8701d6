"""The KV cache's memory budget (``EngineConfig.kv_cache_memory``, ``--kv-cache-memory``):
a byte count, or a fraction of the memory available when the engine loads (as vLLM's
``gpu_memory_utilization``).

    "2GiB", "512MiB", "64KiB"        bytes, binary units (Ki / Mi / Gi / Ti: powers of 1024)
    "1.5GB", "800M", "800MB"         bytes, decimal units (K / M / G / T: powers of 1000)
    "123456", "123456B"              bytes
    "0.3", "30%"                     that fraction of the available memory, 0 < f <= 1

A bare number is bytes when it is an integer and a fraction when it has a decimal point
("1" is one byte, "1.0" all available memory). Units ignore case.

Available memory is what the cache's device can still take at load, weights already
placed: for a CPU artifact the host's ``MemAvailable`` (/proc/meminfo: free memory plus
what the kernel can reclaim, page cache included), or free pages from ``os.sysconf``
where that file is missing; for a GPU artifact the GPU's free memory.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from .errors import ConfigError

OPTION = "kv_cache_memory"
FORMS = ("a byte count such as 2GiB, 512MiB, 1.5GB, 800M or 123456, or a fraction of the available "
         "memory such as 0.3 or 30%")

_UNITS = {"": 1, "b": 1, **{f"{p}{b}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")},
          **{f"{p}i{b}": 1024 ** (i + 1) for i, p in enumerate("kmgt") for b in ("", "b")}}
_AMOUNT = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-z]*|%)")


@dataclass(frozen=True)
class AvailableMemory:
    bytes: int
    source: str  # where the number comes from, for messages ("MemAvailable in /proc/meminfo"...)


@dataclass(frozen=True)
class KVCacheMemory:
    """A KV-cache budget: ``bytes``, or ``fraction`` of the available memory; exactly one.
    ``text``: what the user wrote (messages only)."""

    bytes: int | None = None
    fraction: float | None = None
    text: str = field(default="", compare=False)

    def __post_init__(self):
        problem = _problem(self.bytes, self.fraction)
        if problem:
            raise ConfigError(OPTION, f"{problem}, got bytes={self.bytes!r}, fraction={self.fraction!r}")

    @classmethod
    def parse(cls, value, option: str = OPTION) -> "KVCacheMemory":
        """From a string (the forms above), an int (bytes), a float (a fraction) or a
        KVCacheMemory. ``option`` names the setting in errors ("--kv-cache-memory")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls._from_text(value.strip(), option)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(option, f"expected {FORMS}, got {value!r}")
        # An int is bytes, a float a fraction (as the strings "123456" and "0.3").
        amount = {"bytes": value} if isinstance(value, int) else {"fraction": value}
        return cls._checked(option, value, **amount)

    @classmethod
    def _checked(cls, option: str, given, **amount) -> "KVCacheMemory":
        problem = _problem(amount.get("bytes"), amount.get("fraction"))
        if problem:
            raise ConfigError(option, f"{problem}, got {given!r}; expected {FORMS}")
        return cls(**amount, text=str(given))

    @classmethod
    def _from_text(cls, text: str, option: str) -> "KVCacheMemory":
        match = _AMOUNT.fullmatch(text.lower())
        if match is None or match["unit"] not in (*_UNITS, "%"):
            raise ConfigError(option, f"expected {FORMS}, got {text!r}")
        number, unit = match["number"], match["unit"]
        if unit == "%":
            return cls._checked(option, text, fraction=float(number) / 100)
        if unit == "" and "." in number:
            return cls._checked(option, text, fraction=float(number))
        # Decimal strings times the unit, exactly ("1.5GB" is 1,500,000,000 bytes, not a float's rounding).
        whole, _, decimals = number.partition(".")
        scale = 10 ** len(decimals)
        amount = int(whole or "0") * _UNITS[unit] + int(decimals or "0") * _UNITS[unit] // scale
        return cls._checked(option, text, bytes=amount)

    def __str__(self) -> str:
        if self.text:
            return self.text
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction:g} of available memory"

    def resolve(self, available: AvailableMemory) -> int:
        """The budget in bytes, checked against ``available``: a byte count above it is
        refused (a fraction never is)."""
        if self.fraction is not None:
            return int(available.bytes * self.fraction)
        if self.bytes > available.bytes:
            raise ConfigError(OPTION, f"{self} asks for {self.bytes:,} bytes of KV cache, but only "
                                      f"{available.bytes:,} bytes are available ({available.source}); give a "
                                      f"smaller budget or a fraction such as 0.5")
        return self.bytes


def _problem(nbytes, fraction) -> str | None:
    """What is wrong with a budget of ``nbytes`` or ``fraction``, or None."""
    if (nbytes is None) == (fraction is None):
        return "give bytes or a fraction, exactly one"
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 1):
        return "a byte count must be a positive integer"
    if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                                 or not math.isfinite(fraction) or not 0 < fraction <= 1):
        return "a fraction of the available memory must be in (0, 1] (a bare decimal is a fraction)"
    return None


def available_memory(device=None) -> AvailableMemory:
    """What the KV cache can take now: a GPU ``device``'s free memory (a TVM device), else
    the host's (also when the GPU does not say: the host's is then the only bound known)."""
    if device is not None:
        free = device.available_global_memory  # cudaMemGetInfo's free bytes on CUDA; None if unsupported
        if free:
            return AvailableMemory(int(free), f"free memory of {device}")
    return host_available_memory()


def host_available_memory(meminfo: str = "/proc/meminfo") -> AvailableMemory:
    """MemAvailable counts page cache the kernel would drop for us (MemFree does not)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return AvailableMemory(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")  # kB
    except (OSError, ValueError, IndexError):
        pass
    return AvailableMemory(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages from os.sysconf")
