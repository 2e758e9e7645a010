"""What the CPU computes natively, from /proc/cpuinfo. Pure: standard library only.

bfloat16 pays on a CPU only with native bf16 instructions: AVX-512 BF16 (AMD Zen 4 and later,
Intel Cooper Lake and later) or AMX (Intel Sapphire Rapids and later) on x86, the BF16 extension
on Arm. Without them oneDNN emulates bf16 through float32 and a bf16 matmul is slower than a
float32 one: the conversions cost more than the weights' half size saves (docs/benchmarks.md,
'Step speed per dtype'); with them it roughly halves the bytes a decode step reads.
"""

from __future__ import annotations

_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (`flags` on x86, `Features` on Arm);
    empty where there is no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def has_native_bf16(cpuinfo: str | None = None) -> bool:
    return any(flag in cpu_flags(cpuinfo) for flag in _BF16_FLAGS)
