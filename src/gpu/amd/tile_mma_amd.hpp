// AMD tile-MMA layer: 16x16x16 products with fp16/bf16 inputs and fp32 accumulation on
//   - gfx90a, gfx94x (CDNA2/3, wave64): __builtin_amdgcn_mfma_f32_16x16x16{f16,bf16_1k}
//   - gfx11xx (RDNA3, wave32): __builtin_amdgcn_wmma_f32_16x16x16_{f16,bf16}_w32
//   - gfx12xx (RDNA4, wave32): __builtin_amdgcn_wmma_f32_16x16x16_{f16,bf16}_w32_gfx12
//   - any other gfx: a plain path (cross-lane shuffles + FMA) in the same register layout,
// with the register layouts of amd_layouts.hpp (one source of truth, CPU-tested in tests/amd).
//
// It ends with the same main-loop view as the NVIDIA layer (tile_mma.hpp): AccLayout (which
// accumulator elements a lane holds), SmemTile (the shared tile: padded rows here, XOR-swizzled
// on NVIDIA), QFrag/KFrag/PFrag/VFrag with load_q/load_k/load_v, mma_qk/mma_pv, mma_fence,
// p_frag (P from the score accumulators), query_max/query_sum/query_leader (reductions over the
// lanes that share a query), cp_async_* (plain copies here) and LoopScalar, so the shared forward
// main loop (fwd_kernel.cuh) compiles for every target unchanged.
// Products are taken transposed on AMD (S^T = K Q^T, O^T = V^T P^T): a lane then owns one query
// (accumulator column) and S^T's accumulator is P^T's operand register for register (see
// amd_layouts.hpp). Nothing here is NVIDIA's mma.sync layout.
#pragma once
#include <cstdint>

#include "gpu/amd/amd_layouts.hpp"
#include "gpu/common/gpu_target.hpp"
#include "gpu/common/vendor.hpp"  // empty under the CPU emulation, which provides the same names

namespace flashport::gpu {
FP_TARGET_NS_BEGIN

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
// A 16x16 fp32 accumulator: element e of lane l is (AmdLayout::c_row(l, e), AmdLayout::c_col(l, 0)).
struct FragC {
  float r[AmdLayout::kCElems];
};
constexpr int kAccElems = AmdLayout::kCElems;

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

// ---- shared-memory (LDS) tiles -----------------------------------------------------------------
// Row-major tile of kCols 16-bit elements, rows padded by 16 bytes so the 16 rows one operand load
// touches start in different banks. Every address is then a per-lane base plus a constant (the
// ds_read offset field); NVIDIA's XOR swizzle costs one VGPR per distinct address pattern here
// and spilled on wave32. The loaders of the main loop fill it through offset(row, chunk); the tile
// rows carry the padding (tile_config.hpp: smem_row_pad 8).
template <int kCols>
struct SmemTile {
  static_assert(kCols % 16 == 0, "whole 16-column operand blocks");
  static constexpr int kChunks = kCols / 8;  // 16-byte chunks per row
  static constexpr int kRowElems = kCols + 8;
  __device__ __forceinline__ static int offset(int row, int chunk) { return row * kRowElems + chunk * 8; }
  __device__ __forceinline__ static int element(int row, int col) { return row * kRowElems + col; }
};

// Operand whose 16 "outer" indices (A rows / B columns) are tile rows [row0, row0+16) and whose k
// is tile columns [col0, col0+16): K as A of S^T = K Q^T, Q as B (Q^T) of the same product.
// a_k(l, e) is contiguous in e in every layout, so this is one vector read per lane (two on gfx11).
template <int kCols>
__device__ __forceinline__ void load_rows(Frag16& f, const uint16_t* tile, int row0, int col0, int lane) {
  const uint16_t* p = tile + SmemTile<kCols>::element(row0 + AmdLayout::a_row(lane, 0), col0 + AmdLayout::a_k(lane, 0));
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
    const uint32_t lo = tile[SmemTile<kCols>::element(row0 + AmdLayout::a_k(lane, 2 * w), col)];
    const uint32_t hi = tile[SmemTile<kCols>::element(row0 + AmdLayout::a_k(lane, 2 * w + 1), col)];
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
__device__ __forceinline__ void mma(FragC& c, const Frag16& a, const Frag16& b) {
#if defined(FP_AMD_EMULATED) && !defined(FP_AMD_EMULATION_PLAIN)
  emulated_mma<AmdLayout, Elem>(c.r, a.r, b.r);  // the instruction, from the layout (tests/amd)
#elif defined(FP_AMD_MFMA)
  const fp_v4f acc = __builtin_bit_cast(fp_v4f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(
                                      __builtin_bit_cast(fp_v4s, a), __builtin_bit_cast(fp_v4s, b), acc, 0, 0, 0));
  else
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_mfma_f32_16x16x16f16(
                                      __builtin_bit_cast(fp_v4h, a), __builtin_bit_cast(fp_v4h, b), acc, 0, 0, 0));
#elif defined(FP_AMD_WMMA_GFX11)
  const fp_v8f acc = __builtin_bit_cast(fp_v8f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(
                                      __builtin_bit_cast(fp_v16s, a), __builtin_bit_cast(fp_v16s, b), acc));
  else
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_wmma_f32_16x16x16_f16_w32(
                                      __builtin_bit_cast(fp_v16h, a), __builtin_bit_cast(fp_v16h, b), acc));
#elif defined(FP_AMD_WMMA_GFX12)
  const fp_v8f acc = __builtin_bit_cast(fp_v8f, c);
  if constexpr (Elem::kIsBf16)
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12(
                                      __builtin_bit_cast(fp_v8s, a), __builtin_bit_cast(fp_v8s, b), acc));
  else
    c = __builtin_bit_cast(FragC, __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12(
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
__device__ __forceinline__ Frag16 acc_to_operand(const FragC& c, int lane) {
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
// AMD has no asynchronous global -> LDS copy before gfx950: the NVIDIA layer's calls, done as plain
// 16-byte moves (commit and wait are empty), so the loaders and schedules of the main loop are
// shared. src_bytes 0 writes zeros (rows past the end).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (src_bytes > 0) v = *reinterpret_cast<const uint4*>(gmem);
  *reinterpret_cast<uint4*>(smem) = v;
}
__device__ __forceinline__ void cp_async_commit() {}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {}

// ---- the main-loop view (shared with tile_mma.hpp) ---------------------------------------------
// Accumulator ownership (amd_layouts.hpp, AttentionView): one query row per lane and m-tile,
// 16-column tiles, kCElems columns of that row per tile.
using AccLayout = amd::AttentionView<AmdLayout>;
static_assert(AccLayout::kRowSlots * AccLayout::kSlotElems == kAccElems, "accumulator view");

// Every operand is a 16x16 fragment; the transposed products take K and V^T as A, Q^T and P^T as B.
using QFrag = Frag16;
using KFrag = Frag16;
using PFrag = Frag16;
using VFrag = Frag16;

template <int kCols>
__device__ __forceinline__ void load_q(QFrag& q, const uint16_t* tile, int row0, int k0, int lane) {
  load_rows<kCols>(q, tile, row0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_k(KFrag& k, const uint16_t* tile, int key0, int k0, int lane) {
  load_rows<kCols>(k, tile, key0, k0, lane);
}
template <int kCols>
__device__ __forceinline__ void load_v(VFrag& v, const uint16_t* tile, int key0, int col0, int lane) {
  load_cols<kCols>(v, tile, key0, col0, lane);
}

// The products on a row of accumulator tiles (one m-tile of S^T or O^T), 16 columns (one tile)
// at a time. s: scores, tile key16 of 16 keys (S^T = K Q^T).
template <typename Elem, int N>
__device__ __forceinline__ void mma_qk(FragC (&s)[N], int key16, const QFrag& q, const KFrag& k) {
  mma<Elem>(s[key16], k, q);
}
// P^T (the exponentiated scores of keys [16 key16, 16 key16 + 16)) as the B operand of
// O^T += V^T P^T.
template <typename Elem, int N>
__device__ __forceinline__ PFrag p_frag(const FragC (&s)[N], int key16, int lane) {
  return acc_to_operand<Elem>(s[key16], lane);
}
// o: output, tile col16 of 16 output columns.
template <typename Elem, int N>
__device__ __forceinline__ void mma_pv(FragC (&o)[N], int col16, const PFrag& p, const VFrag& v) {
  mma<Elem>(o[col16], v, p);
}

// Head dims below the bucket run every GEMM step, on the zero-filled columns, instead of a guarded
// copy of the GEMM: the matrix instructions are convergent, so LLVM keeps a loop with an early
// exit rolled (accumulators in scratch), and a per-step test spilled hundreds of VGPRs on wave32.
constexpr bool kSkipTailSteps = false;

// End of a group of products on a row of accumulators (all tiles, or tile col16): the results are
// pinned here and no later shared-memory load may be issued before this point. Without it the
// instruction selector issues every fragment load of the straight-line GEMM (D/16 x BN/16 of them)
// ahead of the first product and wave32 WMMA runs out of VGPRs (hundreds spilled).
__device__ __forceinline__ void pin(FragC& t) {
#if !defined(FP_AMD_EMULATED)
#pragma unroll
  for (int e = 0; e < kAccElems; ++e) asm volatile("" : "+v"(t.r[e])::"memory");
#else
  (void)t;
#endif
}
template <int N>
__device__ __forceinline__ void mma_fence(FragC (&row)[N]) {
#pragma unroll
  for (int t = 0; t < N; ++t) pin(row[t]);
}
template <int N>
__device__ __forceinline__ void mma_fence(FragC (&row)[N], int col16) {
  pin(row[col16]);
}

// A kernel-argument float the main loop tests per element (the softcap switch of the score). On
// MFMA targets it gets a scalar register of its own: clang loads the arguments in 8- and 16-dword
// SGPR tuples, and the forward keeps 100+ SGPRs live there, so the allocator spills tuples to VGPR
// lanes and reloads a whole tuple (8 v_readlane) in every element's branch that reads one member
// (gfx90a forward tile 0 fp16: +618 v_readlane, +13.8% instructions). Elsewhere it is read in
// place: on the wave32 WMMA targets the copy made tile 1 longer (+7-10% instructions).
struct LoopScalar {
#if defined(FP_AMD_MFMA)
  float value;
  __device__ __forceinline__ explicit LoopScalar(const float& arg) : value(arg) {
    asm volatile("" : "+s"(value));  // an SGPR of its own, not a member of the arguments' tuple
  }
#else
  const float& value;
  __device__ __forceinline__ explicit LoopScalar(const float& arg) : value(arg) {}
#endif
};

FP_TARGET_NS_END
}  // namespace flashport::gpu
