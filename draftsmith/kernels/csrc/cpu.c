/* What every kernel in this directory needs of the CPU; checked once by kernels/native.py before any is used. */
int draftsmith_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* fp16 weight panels (small_gemm_f16) also need F16C's conversion. */
int draftsmith_has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c");
}
