from model_worker.runner.cpu_features import cpu_flags, has_native_bf16

EPYC_AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
EPYC_ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx512f amx_bf16 amx_tile\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert not has_native_bf16(EPYC_AVX2)
    assert has_native_bf16(EPYC_ZEN4) and has_native_bf16(SAPPHIRE) and has_native_bf16(GRAVITON3)
    assert not has_native_bf16("")
    assert "avx2" in cpu_flags(EPYC_AVX2)
