// hivemesh's device kernels, compiled at run time by NVRTC (see src/cuda.rs).
//
// No headers (NVRTC ships none of the CUDA toolkit's): 16-bit floats are handled as their bit
// patterns, converted with inline PTX (f16) or integer arithmetic (bf16), each exactly as the
// host code converts them (src/compression/elements.rs, the `half` crate), so a device round
// and a host round produce the same bits. Every kernel is a grid-stride loop over `n`
// elements; arithmetic uses explicit round-to-nearest operations so that no fused
// multiply-add makes the device disagree with the host.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even; what `half::f16::from_f32` does.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The Float16 codec's conversion: round to nearest even, then ±infinity becomes ±65504
// (NaN stays NaN).
__device__ __forceinline__ u16 f32_to_f16_saturating(float f) {
    u16 h = f32_to_f16(f);
    if ((h & 0x7FFFu) == 0x7C00u) {
        h = (u16)(h - (0x7C00u - 0x7BFFu));
    }
    return h;
}

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

// Round to nearest even, NaN kept quiet: `f32_to_bf16_bits` and `half::bf16::from_f32`.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u16)((b >> 16) | 0x0040u);
    }
    return (u16)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load_f32(float x) { return x; }
__device__ __forceinline__ float store_f32(float x) { return x; }

#define GRID_STRIDE(n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Snapshot casts for the 16-bit codecs: an f32 tensor leaves the device as the codec's words.
extern "C" __global__ void hm_cast_f32_f16(const float* __restrict__ x, u16* __restrict__ y, u64 n) {
    GRID_STRIDE(n) { y[i] = f32_to_f16_saturating(x[i]); }
}

extern "C" __global__ void hm_cast_f32_bf16(const float* __restrict__ x, u16* __restrict__ y, u64 n) {
    GRID_STRIDE(n) { y[i] = f32_to_bf16(x[i]); }
}

// The delta rule's device half: t[i] = round(t[i] + alpha * d[i]), computed in f32 and rounded
// once to the tensor's dtype. `d` is `average - snapshot`, computed on the host.
#define APPLY(NAME, T, LOAD_T, STORE_T, D, LOAD_D)                                               \
    extern "C" __global__ void NAME(T* __restrict__ t, const D* __restrict__ d, float alpha, u64 n) { \
        GRID_STRIDE(n) { t[i] = STORE_T(__fadd_rn(LOAD_T(t[i]), __fmul_rn(alpha, LOAD_D(d[i])))); } \
    }

APPLY(hm_apply_f32_f32, float, load_f32, store_f32, float, load_f32)
APPLY(hm_apply_f32_f16, float, load_f32, store_f32, u16, f16_to_f32)
APPLY(hm_apply_f32_bf16, float, load_f32, store_f32, u16, bf16_to_f32)
APPLY(hm_apply_f16_f32, u16, f16_to_f32, f32_to_f16, float, load_f32)
APPLY(hm_apply_f16_f16, u16, f16_to_f32, f32_to_f16, u16, f16_to_f32)
APPLY(hm_apply_f16_bf16, u16, f16_to_f32, f32_to_f16, u16, bf16_to_f32)
APPLY(hm_apply_bf16_f32, u16, bf16_to_f32, f32_to_bf16, float, load_f32)
APPLY(hm_apply_bf16_f16, u16, bf16_to_f32, f32_to_bf16, u16, f16_to_f32)
APPLY(hm_apply_bf16_bf16, u16, bf16_to_f32, f32_to_bf16, u16, bf16_to_f32)
