"""tools/cpu_isa: which oneDNN ISA a CPU has, and the lower one make test reruns the CPU figures under."""
from mgpu_helpers.tools.cpu_isa import cpu_flags, lower, main, native

XEON_AMX = "flags\t\t: fpu sse4_1 avx avx2 avx512f avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor : 0\nflags : sse4_1 avx avx2 avx512f avx512bw avx512vl avx512_bf16\n"
EPYC_AVX2 = "flags : sse4_1 avx avx2 fma\n"


def test_native_and_lower_per_machine_kind():
    assert (native(cpu_flags(XEON_AMX)), lower(cpu_flags(XEON_AMX))) == ("AVX512_CORE_AMX", "AVX2")
    assert (native(cpu_flags(ZEN4)), lower(cpu_flags(ZEN4))) == ("AVX512_CORE_BF16", "AVX2")
    assert (native(cpu_flags(EPYC_AVX2)), lower(cpu_flags(EPYC_AVX2))) == ("AVX2", "SSE41")
    assert (native(cpu_flags("")), lower(cpu_flags(""))) == (None, None)   # Apple silicon, Arm: no rerun


def test_the_command_prints_one_line(capsys):
    assert main(["--lower"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
    main([])
    assert capsys.readouterr().out.startswith("native ")
