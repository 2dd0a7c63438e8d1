// DeltaNet's conv and gates, the arithmetic shared by fused.cu gdn_conv and mma_matmul.cu's chain conv
// phase (MM_CHAIN_CONV), which must give the same bits. The includer includes tc_common.cuh first.
#pragma once

// Block b of a conv launch: q heads, k heads, v heads (the gates block is b = 2 nk + nv).
__device__ __forceinline__ void gdn_conv_channels(int b, int nk, int dk, int dv, int& ch0, int& width, bool& normed) {
    if (b < nk) { ch0 = b * dk; width = dk; normed = true; }
    else if (b < 2 * nk) { ch0 = nk * dk + (b - nk) * dk; width = dk; normed = true; }
    else { ch0 = 2 * nk * dk + (b - 2 * nk) * dv; width = dv; normed = false; }
}

// Head h's gates from the alpha / beta projections' fixed-point sums pa[0], pa[nv] (read past L1 with CG: a
// chain's earlier phase wrote them): g = ssm_a * softplus(alpha + dt_bias) into *g, sigmoid(beta) into *beta.
template <bool CG>
__device__ __forceinline__ void gdn_gates(const long long* pa, int nv, const float* dt_bias, const float* ssm_a, int h,
                                          float* g, float* beta) {
    const float a = fixed_to_float(CG ? ldcg_s64(pa) : pa[0]) + dt_bias[h];
    const float bl = fixed_to_float(CG ? ldcg_s64(pa + nv) : pa[nv]);
    const float sp = a > 20.0f ? a : log1pf(expf(fminf(a, 20.0f)));
    *g = ssm_a[h] * sp;
    *beta = 1.0f / (1.0f + expf(-bl));
}
