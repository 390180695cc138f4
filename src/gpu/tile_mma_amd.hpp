// AMD tile-MMA layer: 16x16x16 products with fp16/bf16 inputs and fp32 accumulation on
//   - gfx90a, gfx94x (CDNA2/3, wave64): __builtin_amdgcn_mfma_f32_16x16x16{f16,bf16_1k}
//   - gfx11xx (RDNA3, wave32): __builtin_amdgcn_wmma_f32_16x16x16_{f16,bf16}_w32
//   - gfx12xx (RDNA4, wave32): __builtin_amdgcn_wmma_f32_16x16x16_{f16,bf16}_w32_gfx12
//   - any other gfx: a plain path (cross-lane shuffles + FMA) in the same register layout,
// with the register layouts of amd_layouts.hpp (one source of truth, CPU-tested in tests/amd).
//
// The attention main loop sees one operation set, whatever the target:
//   Frag16 (a 16x16 fp16/bf16 operand), Acc16 (a 16x16 fp32 accumulator),
//   load_rows / load_cols from shared-memory tiles, mma(), acc_to_operand() (an accumulator as
//   the B operand of the next product), acc_col / acc_row (which element a lane holds) and
//   query_max / query_sum (reduce over the lanes that share an accumulator column).
// Products are taken transposed on AMD (S^T = K Q^T, O^T = V^T P^T): a lane then owns one query
// (accumulator column) and S^T's accumulator is P^T's operand register for register (see
// amd_layouts.hpp). Nothing here is NVIDIA's mma.sync layout; tile_mma.hpp remains that one.
#pragma once
#include <cstdint>

#include "amd_layouts.hpp"
#if !defined(FP_AMD_EMULATION)
#include "vendor.hpp"
#endif

namespace flashport::gpu {

// ---- the target this pass compiles for --------------------------------------------------------
#if defined(__gfx90a__)
#define FP_AMD_GFX 0x90a
#elif defined(__gfx940__)
#define FP_AMD_GFX 0x940
#elif defined(__gfx941__)
#define FP_AMD_GFX 0x941
#elif defined(__gfx942__)
#define FP_AMD_GFX 0x942
#elif defined(__gfx1100__)
#define FP_AMD_GFX 0x1100
#elif defined(__gfx1101__)
#define FP_AMD_GFX 0x1101
#elif defined(__gfx1102__)
#define FP_AMD_GFX 0x1102
#elif defined(__gfx1200__)
#define FP_AMD_GFX 0x1200
#elif defined(__gfx1201__)
#define FP_AMD_GFX 0x1201
#else
#define FP_AMD_GFX 0  // host pass, or a gfx without a matrix unit here: the plain path
#endif

#if defined(FP_AMD_EMULATION)  // CPU emulation of one target's layout (tests/amd), never a build
#define FP_AMD_EMULATED 1
using AmdLayout = FP_AMD_EMULATION_LAYOUT;
#elif defined(__HIP_DEVICE_COMPILE__) && (FP_AMD_GFX == 0x90a || (FP_AMD_GFX >= 0x940 && FP_AMD_GFX <= 0x942))
#define FP_AMD_MFMA 1
using AmdLayout = amd::Mfma16x16x16;
#elif defined(__HIP_DEVICE_COMPILE__) && defined(__GFX11__)
#define FP_AMD_WMMA_GFX11 1
using AmdLayout = amd::WmmaGfx11;
#elif defined(__HIP_DEVICE_COMPILE__) && defined(__GFX12__)
#define FP_AMD_WMMA_GFX12 1
using AmdLayout = amd::WmmaGfx12;
#else
#define FP_AMD_PLAIN 1
using AmdLayout = amd::ColumnLanes<kWarpSize>;
#endif
static_assert(AmdLayout::kWaveSize == kWarpSize, "tile layout and wave size disagree");

// Device-side gate: a kernel whose shape this target can't run (e.g. more LDS than a workgroup
// may use) is compiled as a trap that names the target and the built list, never as garbage.
#define FP_AMD_TRAP(what)                                                                   \
  do {                                                                                      \
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0)          \
      printf("flashport: %s is not built for gfx%x (built archs: %s)\n", what, FP_AMD_GFX,  \
             FLASHPORT_GPU_ARCHS);                                                          \
    __builtin_trap();                                                                       \
  } while (0)

// ---- storage element types ---------------------------------------------------------------------
// 16-bit storage; packed conversions from float pairs (low element in the low half).
struct Half {
  using T = _Float16;
  static constexpr bool kIsBf16 = false;
  __device__ __forceinline__ static uint32_t bits(float v) {
    return __builtin_bit_cast(uint16_t, static_cast<_Float16>(v));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return bits(lo) | (bits(hi) << 16); }
  __device__ __forceinline__ static float to_float(T v) { return static_cast<float>(v); }
  __device__ __forceinline__ static float bits_to_float(uint32_t b) {
    return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(b)));
  }
  __device__ __forceinline__ static T from_float(float v) { return static_cast<_Float16>(v); }
};
struct BFloat16 {
  using T = uint16_t;  // bf16 bits (Debian's HIP 5.2 headers have no __hip_bfloat16 intrinsics)
  static constexpr bool kIsBf16 = true;
  __device__ __forceinline__ static uint32_t bits(float v) {  // round to nearest even, NaN kept quiet
    const uint32_t u = __builtin_bit_cast(uint32_t, v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return bits(lo) | (bits(hi) << 16); }
  __device__ __forceinline__ static float bits_to_float(uint32_t b) {
    return __builtin_bit_cast(float, (b & 0xffffu) << 16);
  }
  __device__ __forceinline__ static float to_float(T v) { return bits_to_float(v); }
  __device__ __forceinline__ static T from_float(float v) { return static_cast<T>(bits(v)); }
};

// ---- fragments ---------------------------------------------------------------------------------
// A 16x16 operand (A or B role): kAElems 16-bit elements a lane, two per 32-bit word.
struct Frag16 {
  uint32_t r[AmdLayout::kAElems / 2];
};
// A 16x16 fp32 accumulator: element e of this lane is (acc_row(lane, e), acc_col(lane)).
struct Acc16 {
  float r[AmdLayout::kCElems];
};
constexpr int kAccElems = AmdLayout::kCElems;

__device__ __forceinline__ constexpr int acc_row(int lane, int e) { return AmdLayout::c_row(lane, e); }
__device__ __forceinline__ constexpr int acc_col(int lane) { return AmdLayout::c_col(lane, 0); }

// Reductions over the lanes that share an accumulator column (one query): XOR 16 (and 32).
__device__ __forceinline__ float query_max(float x) {
#pragma unroll
  for (int i = 0; i < amd::column_group_masks<kWarpSize>(); ++i)
    x = fmaxf(x, shfl_xor(x, amd::column_group_mask(i)));
  return x;
}
__device__ __forceinline__ float query_sum(float x) {
#pragma unroll
  for (int i = 0; i < amd::column_group_masks<kWarpSize>(); ++i) x += shfl_xor(x, amd::column_group_mask(i));
  return x;
}
// One lane per column group writes per-query results.
__device__ __forceinline__ bool query_leader(int lane) { return lane < 16; }

// ---- shared-memory tiles -----------------------------------------------------------------------
// Row-major tile of kCols 16-bit elements, rows padded by 16 bytes so the 16 rows one operand
// load touches start in different banks.
template <int kCols>
struct LdsTile {
  static_assert(kCols % 16 == 0, "whole 16-column operand blocks");
  static constexpr int kStride = kCols + 8;
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  __device__ __forceinline__ static int offset(int row, int col) { return row * kStride + col; }
  static constexpr int bytes(int rows) { return rows * kStride * 2; }
};

// Operand whose 16 "outer" indices (A rows / B columns) are tile rows [row0, row0+16) and whose k
// is tile columns [col0, col0+16): K as A of S^T = K Q^T, Q as B (Q^T) of the same product.
// a_k(l, e) is contiguous in e in every layout, so this is one vector read per lane.
template <int kCols>
__device__ __forceinline__ void load_rows(Frag16& f, const uint16_t* tile, int row0, int col0, int lane) {
  const uint16_t* p = tile + LdsTile<kCols>::offset(row0 + AmdLayout::a_row(lane, 0), col0 + AmdLayout::a_k(lane, 0));
  constexpr int kWords = AmdLayout::kAElems / 2;
  if constexpr (kWords == 2) {
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    f.r[0] = w.x, f.r[1] = w.y;
  } else {
#pragma unroll
    for (int i = 0; i < kWords; i += 4) {
      const uint4 w = *reinterpret_cast<const uint4*>(p + 2 * i);
      f.r[i] = w.x, f.r[i + 1] = w.y, f.r[i + 2] = w.z, f.r[i + 3] = w.w;
    }
  }
}

// Operand whose outer index is tile column col0 + i and whose k is tile row row0 + k: V^T as A of
// O^T = V^T P^T (V stored [key][dim]). A gather down a column (no transposing load before gfx950).
template <int kCols>
__device__ __forceinline__ void load_cols(Frag16& f, const uint16_t* tile, int row0, int col0, int lane) {
#pragma unroll
  for (int w = 0; w < AmdLayout::kAElems / 2; ++w) {
    const int col = col0 + AmdLayout::a_row(lane, 2 * w);
    const uint32_t lo = tile[LdsTile<kCols>::offset(row0 + AmdLayout::a_k(lane, 2 * w), col)];
    const uint32_t hi = tile[LdsTile<kCols>::offset(row0 + AmdLayout::a_k(lane, 2 * w + 1), col)];
    f.r[w] = lo | (hi << 16);
  }
}

// ---- multiply-accumulate: c += a * b -----------------------------------------------------------
#if !defined(FP_AMD_EMULATED)  // clang vector types of the builtins
typedef _Float16 fp_v4h __attribute__((ext_vector_type(4)));
typedef _Float16 fp_v8h __attribute__((ext_vector_type(8)));
typedef _Float16 fp_v16h __attribute__((ext_vector_type(16)));
typedef short fp_v4s __attribute__((ext_vector_type(4)));
typedef short fp_v8s __attribute__((ext_vector_type(8)));
typedef short fp_v16s __attribute__((ext_vector_type(16)));
typedef float fp_v4f __attribute__((ext_vector_type(4)));
typedef float fp_v8f __attribute__((ext_vector_type(8)));
#endif

template <typename Elem>
__device__ __forceinline__ void mma(Acc16& c, const Frag16& a, const Frag16& b) {
#if defined(FP_AMD_EMULATED) && !defined(FP_AMD_EMULATION_PLAIN)
  emulated_mma<AmdLayout, Elem>(c.r, a.r, b.r);  // the instruction, from the layout (tests/amd)
#elif defined(FP_AMD_MFMA)
  const fp_v4f acc = __builtin_bit_cast(fp_v4f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(
                                      __builtin_bit_cast(fp_v4s, a), __builtin_bit_cast(fp_v4s, b), acc, 0, 0, 0));
  else
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_mfma_f32_16x16x16f16(
                                      __builtin_bit_cast(fp_v4h, a), __builtin_bit_cast(fp_v4h, b), acc, 0, 0, 0));
#elif defined(FP_AMD_WMMA_GFX11)
  const fp_v8f acc = __builtin_bit_cast(fp_v8f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(
                                      __builtin_bit_cast(fp_v16s, a), __builtin_bit_cast(fp_v16s, b), acc));
  else
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(
                                      __builtin_bit_cast(fp_v16h, a), __builtin_bit_cast(fp_v16h, b), acc));
#elif defined(FP_AMD_WMMA_GFX12)
  const fp_v8f acc = __builtin_bit_cast(fp_v8f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(
                                      __builtin_bit_cast(fp_v8s, a), __builtin_bit_cast(fp_v8s, b), acc));
  else
    c = __builtin_bit_cast(Acc16, __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(
                                      __builtin_bit_cast(fp_v8h, a), __builtin_bit_cast(fp_v8h, b), acc));
#else
  // Plain path, ColumnLanes layout: A[r][k] and B[k][j] are fetched from the lanes that hold them.
  // For one k the source element index is the same in every lane, so each fetch is one shuffle.
  constexpr int P = AmdLayout::kPerLane;
  const int lane = threadIdx.x % kWarpSize;
  const int j = AmdLayout::c_col(lane, 0);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int word = (k % P) / 2, shift = ((k % P) & 1) * 16;
    const float bkj = Elem::bits_to_float(uint32_t(__shfl(int(b.r[word]), j + 16 * (k / P))) >> shift);
#pragma unroll
    for (int e = 0; e < AmdLayout::kCElems; ++e) {
      const int r = AmdLayout::c_row(lane, e);
      const float ark = Elem::bits_to_float(uint32_t(__shfl(int(a.r[word]), r + 16 * (k / P))) >> shift);
      c.r[e] = fmaf(ark, bkj, c.r[e]);
    }
  }
#endif
}

// The accumulator of one product as the B operand of the next (P^T from S^T), converted to Elem.
// Register for register on ColumnLanes; on gfx11 every other key comes from the partner half-wave.
template <typename Elem>
__device__ __forceinline__ Frag16 acc_to_operand(const Acc16& c, int lane) {
  Frag16 f;
  if constexpr (!AmdLayout::kReplicatedAB) {
#pragma unroll
    for (int w = 0; w < AmdLayout::kBElems / 2; ++w) f.r[w] = Elem::pack(c.r[2 * w], c.r[2 * w + 1]);
  } else {
    const bool upper = lane >= 16;  // holds the odd keys 2v + 1
#pragma unroll
    for (int v = 0; v < AmdLayout::kCElems; ++v) {
      const float mine = c.r[v], other = shfl_xor(c.r[v], 16);
      f.r[v] = upper ? Elem::pack(other, mine) : Elem::pack(mine, other);  // keys 2v, 2v + 1
    }
  }
  return f;
}

// ---- global -> shared copies -------------------------------------------------------------------
// AMD has no asynchronous copy before gfx950: the same calls, done as plain 16-byte moves, so the
// loader code is shared. src_bytes 0 writes zeros (rows past the end).
__device__ __forceinline__ void copy_16(void* smem, const void* gmem, int src_bytes) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (src_bytes > 0) v = *reinterpret_cast<const uint4*>(gmem);
  *reinterpret_cast<uint4*>(smem) = v;
}
__device__ __forceinline__ void copy_commit() {}
template <int kPending>
__device__ __forceinline__ void copy_wait() {}

}  // namespace flashport::gpu
