# Sourced by the benchmark scripts (from the project root): the machine a figure was
# measured on. cpu_flags: the instruction-set flags that choose our kernels; native_dtype:
# bfloat16 where the CPU computes it natively (avx512_bf16 or amx_bf16), else float32;
# machine_line: the line printed before the figures (UTC date, CPU model, cores, flags).
cpu_flags() {
    grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_vnni|amx_bf16|amx_int8' /proc/cpuinfo \
        | sort -u | tr '\n' ' '
}

native_dtype() {
    case " $(cpu_flags) " in
        *" avx512_bf16 "*|*" amx_bf16 "*) echo bfloat16 ;;
        *) echo float32 ;;
    esac
}

machine_line() {
    echo "date $(date -u +%FT%TZ); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-);" \
         "$(nproc) cores; flags: $(cpu_flags)"
}
