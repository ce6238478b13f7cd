// One-row fp8 GEMVs (per-channel scales, bf16 x and out) that stream their weight through shared
// memory with the bulk copy engine and issue their first copies before the PDL wait: a probe of
// whether a chain of one-row GEMVs can keep HBM busy across launches (prefetch_gemv_probe.py).
//
// prefetch_gemv_kernel: one program per SM (a persistent grid) of CWARPS computing warps and one
// copying warp; program b owns rows [b N / G, (b + 1) N / G) of the row-major [N, K] weight, taken
// GROUP rows at a time and read as GROUP x KC-byte chunks (one bulk copy per row) into a ring of
// stages with full / empty mbarriers. Each computing lane keeps 16-byte K segments of GROUP /
// CWARPS rows and x (copied into shared memory after the wait, a KC-wide piece a K step); a warp's
// sums meet by shuffles once per group. MODE bit 0: let the next kernel launch as this one starts
// (launch_dependents); bit 1: issue the ring's first copies before the PDL wait; bit 2: copies only
// (a diagnostic: the ring's own rate, wrong outputs). prefetch_gemv_mma_kernel: the same ring with
// its arithmetic on the tensor cores; chain_gemv_kernel: that one over a whole chain of GEMVs in
// one persistent launch. Built by the probe with nvcc -arch=sm_90, loaded through ctypes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void barrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_addr(bar)), "r"(parity)
        : "memory");
  }
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_addr(dst)),
      "l"(src), "r"(bytes), "r"(shared_addr(bar))
      : "memory");
}

__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_addr(bar)) : "memory");
}

// 16 e4m3 weights times 16 float x, two chains.
__device__ __forceinline__ float dot16(uint4 w, const float* x) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float a = 0.f, b = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 wf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      a = fmaf(wf.x, x[4 * i + 2 * h], a);
      b = fmaf(wf.y, x[4 * i + 2 * h + 1], b);
    }
  }
  return a + b;
}

// The ring holds chunks in order (group g, K step kc) -> c = g * (K / KC) + kc. The copying warp
// waits for a stage to be emptied (by all CWARPS consumer warps) before refilling it; consumers
// wait for it to be full. Each consumer lane keeps one 16-byte K segment of RPW rows.
// By thread 0: a ring's full (one arrival: the copy's) and empty (`consumers` arrivals) barriers,
// and one barrier for each of `xsteps` pieces of x.
__device__ __forceinline__ void init_ring_barriers(uint64_t* full, uint64_t* empty, int stages, int consumers,
                                                   uint64_t* xbar, int xsteps) {
  for (int s = 0; s < stages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_addr(full + s)) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_addr(empty + s)), "r"(consumers) : "memory");
  }
  for (int i = 0; i < xsteps; ++i)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_addr(xbar + i)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The copying warp of one GEMV launch: rows first .. last of w in chunks of GROUP rows x CB bytes
// (rows `pitch` apart in a stage of `stage` bytes), in order (group g, K step kc), and x in CB-wide
// pieces into xs. Stage s of round r (r = c / stages, kept as counters: a run-time division per
// chunk cost more than the arithmetic) is full at parity r & 1 and was emptied for its refill at
// parity (r - 1) & 1. mode & 2: the ring's first round is issued before the PDL wait.
template <int GROUP, int CB>
__device__ __forceinline__ void copy_ring(uint8_t* ring, uint32_t stage, int pitch, const uint8_t* w, int k,
                                          int first, int last, int stages, uint64_t* full, uint64_t* empty,
                                          void* xs, const __nv_bfloat16* x, uint64_t* xbar, int mode, int lane) {
  const int steps = k / CB, chunks = (last - first + GROUP - 1) / GROUP * steps;
  int s = 0, round = 0, g = 0, kc = 0;
  auto produce = [&]() {
    const int row0 = first + g * GROUP, rows = min(GROUP, last - row0);
    if (round > 0) barrier_wait(empty + s, (round - 1) & 1);
    if (lane == 0) expect_bytes(full + s, static_cast<uint32_t>(rows) * CB);
    __syncwarp();
    if (lane < rows)
      bulk_copy(ring + s * stage + lane * pitch,
                w + static_cast<long long>(row0 + lane) * k + static_cast<long long>(kc) * CB, CB, full + s);
    if (++kc == steps) kc = 0, ++g;
    if (++s == stages) s = 0, ++round;
  };
  const int ahead = min(stages, chunks);
  if (mode & 2)
    for (int c = 0; c < ahead; ++c) produce();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int i = lane; i < steps; i += 32) {
    expect_bytes(xbar + i, 2u * CB);
    bulk_copy(static_cast<uint8_t*>(xs) + 2 * i * CB, x + i * CB, 2u * CB, xbar + i);
  }
  if (!(mode & 2))
    for (int c = 0; c < ahead; ++c) produce();
  for (int c = ahead; c < chunks; ++c) produce();
}

template <int GROUP, int KC, int CWARPS>  // a chunk: GROUP rows x KC bytes; CWARPS computing warps
__global__ void __launch_bounds__(32 * (CWARPS + 1), 1)
    prefetch_gemv_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale,
                         const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, int n,
                         int k, int stages, int mode) {
  constexpr uint32_t STAGE = GROUP * KC;
  constexpr int SEGS = KC / 512;  // 16-byte segments per lane per row
  constexpr int RPW = GROUP / CWARPS;  // rows per consumer warp
  extern __shared__ __align__(128) uint8_t smem[];
  if (mode & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  uint8_t* ring = smem;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + stages * STAGE);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * STAGE + ((2 * k + 127) / 128) * 128);
  uint64_t* empty = full + stages;
  uint64_t* xbar = empty + stages;  // one a K step: x arrives in KC-wide pieces
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int first = static_cast<int>((static_cast<long long>(blockIdx.x) * n) / gridDim.x);
  const int last = static_cast<int>((static_cast<long long>(blockIdx.x + 1) * n) / gridDim.x);
  const int steps = k / KC;
  const int groups = (last - first + GROUP - 1) / GROUP;
  if (tid == 0) init_ring_barriers(full, empty, stages, CWARPS, xbar, steps);
  __syncthreads();

  if (warp == CWARPS) {  // the copying warp
    copy_ring<GROUP, KC>(ring, STAGE, KC, w, k, first, last, stages, full, empty, xs, x, xbar, mode, lane);
    return;
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint4* x4 = reinterpret_cast<const uint4*>(xs);
  int s = 0, parity = 0;
  for (int g = 0; g < groups; ++g) {
    const int row0 = first + g * GROUP, rows = min(GROUP, last - row0);
    float acc[RPW];
#pragma unroll
    for (int i = 0; i < RPW; ++i) acc[i] = 0.f;
    for (int kc = 0; kc < steps; ++kc) {
      if (g == 0) barrier_wait(xbar + kc, 0);
      barrier_wait(full + s, parity);
      if (!(mode & 4)) {  // mode 4: copies only (the ring's own rate; wrong outputs)
        const uint8_t* stage = ring + s * STAGE + lane * 16;
#pragma unroll
        for (int j = 0; j < SEGS; ++j) {
          const int seg = kc * (KC / 16) + j * 32 + lane;  // x's 16-value segment
          const uint4 lo = x4[2 * seg], hi = x4[2 * seg + 1];
          const uint32_t xw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          float xf[16];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
            xf[2 * i] = v.x;
            xf[2 * i + 1] = v.y;
          }
          if (rows == GROUP) {  // no branch between the rows' loads
#pragma unroll
            for (int i = 0; i < RPW; ++i)
              acc[i] += dot16(*reinterpret_cast<const uint4*>(stage + (warp + CWARPS * i) * KC + j * 512), xf);
          } else {
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
              const int r = warp + CWARPS * i;
              if (r < rows) acc[i] += dot16(*reinterpret_cast<const uint4*>(stage + r * KC + j * 512), xf);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) arrive(empty + s);
      if (++s == stages) s = 0, parity ^= 1;
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
    }
    if (lane < RPW) {
      float v = acc[0];
#pragma unroll
      for (int i = 1; i < RPW; ++i) v = lane == i ? acc[i] : v;
      const int r = warp + CWARPS * lane;
      if (r < rows) out[row0 + r] = __float2bfloat16(v * scale[row0 + r]);
    }
  }
}

// The same ring with its arithmetic on the tensor cores: chunks of MT x 16 rows x 1024 bytes
// (rows MPITCH apart in shared memory, so a warp's 16-byte loads of 8 rows hit distinct banks);
// each of the 8 or 16 computing warps takes 128 or 64 of a chunk's 1024 K columns, as mma.sync
// m16n8k16 (f16 in, f32 accumulate) with the weight's e4m3 converted to f16 (one cvt a pair) and x
// in f16 as B (all 8 columns alike); a warp issues all its shared-memory loads of a chunk before
// converting. x goes to f16 in place, in group 0, by the warp that reads it, under a power-of-two
// scale per (K step, warp) that maps its largest |x| into [2^14, 2^15) (bf16 activations can
// exceed f16's range); each K step's product is scaled back into the f32 sums. The K order inside
// a 64-column block is permuted (a thread's 4 bytes at 4i..4i+3 of its 16 are mma i's slots 2t,
// 2t+1, 2t+8, 2t+9), the same for the weight and x, so the sums are unchanged.
constexpr int MKC = 1024;
constexpr int MPITCH = MKC + 64;

__device__ __forceinline__ void e4m3x4_to_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four values of x (two when raw.y is 0) to f16 under the power-of-two scale that maps the warp's
// largest |x| into [2^14, 2^15) (bf16 activations can exceed f16's range); *inv: the scale back.
__device__ __forceinline__ uint2 x_to_scaled_f16(uint2 raw, float* inv) {
  const float2 v0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 v1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  float m = fmaxf(fmaxf(fabsf(v0.x), fabsf(v0.y)), fmaxf(fabsf(v1.x), fabsf(v1.y)));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int e = m > 0.f ? static_cast<int>((__float_as_uint(m) >> 23) & 0xff) - 127 : 0;
  const int up = max(-100, min(100, 14 - e));  // x * 2^up in f16; sums * 2^-up
  const float sc = __uint_as_float(static_cast<uint32_t>(127 + up) << 23);
  const __half2 h0 = __floats2half2_rn(v0.x * sc, v0.y * sc);
  const __half2 h1 = __floats2half2_rn(v1.x * sc, v1.y * sc);
  *inv = __uint_as_float(static_cast<uint32_t>(127 - up) << 23);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&h0), *reinterpret_cast<const uint32_t*>(&h1));
}

// One chunk of a warp's columns on the tensor cores, scaled by inv into acc: `stage` is this
// thread's 16-byte column (16 t) of the chunk's row 0, rows `pitch` apart; `xk` this warp's x.
// Every shared-memory load is issued before the first conversion.
template <int MT, int BLKS>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][4], const uint8_t* stage, int pitch, const __half* xk,
                                          int gid, int t, float inv) {
  float c[MT][4] = {};
  uint4 xv[BLKS][2], wv[BLKS][MT][2];
#pragma unroll
  for (int blk = 0; blk < BLKS; ++blk) {
    xv[blk][0] = *reinterpret_cast<const uint4*>(xk + blk * 64 + 16 * t);
    xv[blk][1] = *reinterpret_cast<const uint4*>(xk + blk * 64 + 16 * t + 8);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint8_t* rowp = stage + (mt * 16 + gid) * pitch + blk * 64;
      wv[blk][mt][0] = *reinterpret_cast<const uint4*>(rowp);
      wv[blk][mt][1] = *reinterpret_cast<const uint4*>(rowp + 8 * pitch);
    }
  }
#pragma unroll
  for (int blk = 0; blk < BLKS; ++blk) {
    const uint32_t xw[8] = {xv[blk][0].x, xv[blk][0].y, xv[blk][0].z, xv[blk][0].w,
                            xv[blk][1].x, xv[blk][1].y, xv[blk][1].z, xv[blk][1].w};
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4 ra = wv[blk][mt][0], rb = wv[blk][mt][1];
      const uint32_t wa[4] = {ra.x, ra.y, ra.z, ra.w}, wb[4] = {rb.x, rb.y, rb.z, rb.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t a0, a2, a1, a3;
        e4m3x4_to_f16(wa[i], a0, a2);
        e4m3x4_to_f16(wb[i], a1, a3);
        mma16816(c[mt], a0, a1, a2, a3, xw[2 * i], xw[2 * i + 1]);
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[mt][i] = fmaf(c[mt][i], inv, acc[mt][i]);
}

// A group's end, before the barrier: every column of the product is the same, so thread (gid, t)
// holds row gid in [0] and gid + 8 in [2]; lane t == 0 writes them to this warp's row of `red`.
template <int MT>
__device__ __forceinline__ void publish_rows(const float (&acc)[MT][4], float* red_warp, int gid, int t) {
  if (t == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      red_warp[mt * 16 + gid] = acc[mt][0];
      red_warp[mt * 16 + gid + 8] = acc[mt][2];
    }
  }
}

// After the barrier: row `row` of the group, the warps' sums in a fixed order, scaled and stored.
template <int WARPS, int GROUP>
__device__ __forceinline__ void store_row(const float* red, int row, const float* scale, __nv_bfloat16* out) {
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < WARPS; ++i) sum += red[i * GROUP + row];
  out[row] = __float2bfloat16(sum * scale[row]);
}

// This warp's x slices of one GEMV (WK = 128 columns a K step, 4 values a lane), from L2 eight K
// steps at a time, to f16 in shared memory with their scales back.
template <int CW>
__device__ __forceinline__ void load_x_slices(const __nv_bfloat16* x, int steps, __half* xh, float* xinv, int warp,
                                              int lane) {
  constexpr int WK = MKC / CW;
  for (int k0 = 0; k0 < steps; k0 += 8) {
    uint2 raw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (k0 + i < steps) raw[i] = __ldcg(reinterpret_cast<const uint2*>(x + (k0 + i) * MKC + warp * WK) + lane);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (k0 + i >= steps) break;
      float inv;
      *reinterpret_cast<uint2*>(xh + (k0 + i) * MKC + warp * WK + 4 * lane) = x_to_scaled_f16(raw[i], &inv);
      if (lane == 0) xinv[(k0 + i) * CW + warp] = inv;
    }
  }
  __syncwarp();
}

template <int MT, int MWARPS>  // MWARPS computing warps take MKC / MWARPS columns each
__global__ void __launch_bounds__(32 * (MWARPS + 1), 1)
    prefetch_gemv_mma_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale,
                             const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, int n,
                             int k, int stages, int mode) {
  constexpr int GROUP = 16 * MT;
  constexpr uint32_t STAGE = GROUP * MPITCH;
  constexpr int WK = MKC / MWARPS;  // a warp's columns of a chunk
  constexpr int BLKS = WK / 64;  // its 64-column blocks
  extern __shared__ __align__(128) uint8_t smem[];
  if (mode & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int steps = k / MKC;
  uint8_t* ring = smem;
  __half* xh = reinterpret_cast<__half*>(smem + stages * STAGE);  // bf16 in, f16 after conversion
  float* xinv = reinterpret_cast<float*>(smem + stages * STAGE + ((2 * k + 127) / 128) * 128);
  float* red = xinv + steps * MWARPS;  // [2][MWARPS][GROUP]
  uint64_t* full = reinterpret_cast<uint64_t*>(red + 2 * MWARPS * GROUP);
  uint64_t* empty = full + stages;
  uint64_t* xbar = empty + stages;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int first = static_cast<int>((static_cast<long long>(blockIdx.x) * n) / gridDim.x);
  const int last = static_cast<int>((static_cast<long long>(blockIdx.x + 1) * n) / gridDim.x);
  const int groups = (last - first + GROUP - 1) / GROUP;
  if (tid == 0) init_ring_barriers(full, empty, stages, MWARPS, xbar, steps);
  __syncthreads();

  if (warp == MWARPS) {  // the copying warp, as in prefetch_gemv_kernel
    copy_ring<GROUP, MKC>(ring, STAGE, MPITCH, w, k, first, last, stages, full, empty, xh, x, xbar, mode, lane);
    return;
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int gid = lane >> 2, t = lane & 3;
  int s = 0, parity = 0;
  for (int g = 0; g < groups; ++g) {
    const int row0 = first + g * GROUP, rows = min(GROUP, last - row0);
    float acc[MT][4] = {};
    for (int kc = 0; kc < steps; ++kc) {
      const int kx = kc * MKC + warp * WK;  // this warp's columns of x
      if (g == 0) {  // x: bf16 -> f16 under this (K step, warp)'s power-of-two scale, in place
        barrier_wait(xbar + kc, 0);
        static_assert(WK == 128 || WK == 64, "4 or 2 values of x a lane");
        uint2 raw = make_uint2(0, 0);
        if (WK == 128)
          raw = *reinterpret_cast<const uint2*>(xh + kx + 4 * lane);
        else
          raw.x = *reinterpret_cast<const uint32_t*>(xh + kx + 2 * lane);
        float inv;
        raw = x_to_scaled_f16(raw, &inv);
        if (WK == 128)
          *reinterpret_cast<uint2*>(xh + kx + 4 * lane) = raw;
        else
          *reinterpret_cast<uint32_t*>(xh + kx + 2 * lane) = raw.x;
        if (lane == 0) xinv[kc * MWARPS + warp] = inv;
        __syncwarp();
      }
      barrier_wait(full + s, parity);
      if (!(mode & 4)) {
        const uint8_t* stage = ring + s * STAGE + warp * WK + 16 * t;
        mma_chunk<MT, BLKS>(acc, stage, MPITCH, xh + kx, gid, t, xinv[kc * MWARPS + warp]);
      }
      __syncwarp();
      if (lane == 0) arrive(empty + s);
      if (++s == stages) s = 0, parity ^= 1;
    }
    publish_rows<MT>(acc, red + (g & 1) * MWARPS * GROUP + warp * GROUP, gid, t);
    asm volatile("bar.sync 1, %0;" ::"r"(32 * MWARPS) : "memory");
    if (tid < rows) store_row<MWARPS, GROUP>(red + (g & 1) * MWARPS * GROUP, tid, scale + row0, out + row0);
  }
}

// A chain of one-row GEMVs in one persistent launch: the copying warp streams every GEMV's rows
// (this program's share of each) without ever waiting for the others, so HBM keeps reading across
// the GEMVs' boundaries as long as the ring has room; the computing warps (the tensor-core form
// above) wait at each boundary until every program has stored the previous GEMV's rows (a counter
// per GEMV in global memory, release / acquire), then read their x slices from L2. The bound, for
// the GEMV part, of a persistent kernel per decode step.
struct GemvDesc {
  const uint8_t* w;
  const float* scale;
  const __nv_bfloat16* x;
  __nv_bfloat16* out;
  int n, k;
};

struct Cursor {  // a chunk: GEMV j, rows row0 .. row0 + rows of this program's share, K step kc
  int j, row0, kc;
};

// This program's chunks of a chain, in order: per GEMV its contiguous share of the rows, or
// (dealt) chunks dealt round the grid; `rows` rows x 1024 bytes a chunk.
struct ChunkWalk {
  const GemvDesc* descs;
  int count;
  bool dealt;
  int rows;
  __device__ int step() const { return dealt ? static_cast<int>(gridDim.x) * rows : rows; }
  __device__ int first(int j) const {
    return dealt ? static_cast<int>(blockIdx.x) * rows
                 : static_cast<int>((static_cast<long long>(blockIdx.x) * descs[j].n) / gridDim.x);
  }
  __device__ int last(int j) const {
    return dealt ? descs[j].n
                 : static_cast<int>((static_cast<long long>(blockIdx.x + 1) * descs[j].n) / gridDim.x);
  }
  __device__ void settle(Cursor& c) const {  // past GEMVs where this program has no rows
    while (c.j < count && c.row0 >= last(c.j)) {
      ++c.j;
      c.row0 = c.j < count ? first(c.j) : 0;
      c.kc = 0;
    }
  }
  __device__ void advance(Cursor& c) const {
    if (++c.kc == descs[c.j].k / MKC) {
      c.kc = 0;
      c.row0 += step();
      settle(c);
    }
  }
  __device__ Cursor start() const {
    Cursor c{0, count > 0 ? first(0) : 0, 0};
    settle(c);
    return c;
  }
};

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

template <int MT>
__global__ void __launch_bounds__(32 * 9, 1)
    chain_gemv_kernel(const GemvDesc* __restrict__ descs, int count, unsigned* done, int kmax, int stages,
                      int mode) {
  constexpr int CW = 8, GROUP = 16 * MT, WK = MKC / CW;
  constexpr uint32_t STAGE = GROUP * MPITCH;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  __half* xh = reinterpret_cast<__half*>(smem + stages * STAGE);  // each warp's own slices, in f16
  float* xinv = reinterpret_cast<float*>(xh + kmax);  // [kmax / MKC][CW]
  float* red = xinv + (kmax / MKC) * CW;  // [2][CW][GROUP]
  uint64_t* full = reinterpret_cast<uint64_t*>(red + 2 * CW * GROUP);
  uint64_t* empty = full + stages;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) init_ring_barriers(full, empty, stages, CW, nullptr, 0);
  __syncthreads();
  const ChunkWalk walk{descs, count, (mode & 8) != 0, GROUP};  // 8: chunks dealt round the grid
  const int step = walk.step();

  if (warp == CW) {  // the copying warp: every GEMV's chunks, in order, never waiting on the grid
    int s = 0, round = 0;
    for (Cursor c = walk.start(); c.j < count; walk.advance(c)) {
      const GemvDesc d = descs[c.j];
      const int rows = min(GROUP, walk.last(c.j) - c.row0);
      if (round > 0) barrier_wait(empty + s, (round - 1) & 1);
      if (lane == 0) expect_bytes(full + s, static_cast<uint32_t>(rows) * MKC);
      __syncwarp();
      if (lane < rows)
        bulk_copy(ring + s * STAGE + lane * MPITCH,
                  d.w + static_cast<long long>(c.row0 + lane) * d.k + static_cast<long long>(c.kc) * MKC, MKC,
                  full + s);
      if (++s == stages) s = 0, ++round;
    }
    return;
  }

  const int gid = lane >> 2, t = lane & 3;
  int s = 0, parity = 0, gc = 0;
  for (int j = 0; j < count; ++j) {
    const GemvDesc d = descs[j];
    const int first = walk.first(j), last = walk.last(j);
    const int steps = d.k / MKC;
    if (j > 0 && !(mode & 16)) {  // GEMV j - 1 stored everywhere: its outputs are this x (16: no wait)
      if (tid == 0)
        while (load_acquire(done + j - 1) < gridDim.x) {
        }
      asm volatile("bar.sync 1, %0;" ::"r"(32 * CW) : "memory");
    }
    if (first < last) load_x_slices<CW>(d.x, steps, xh, xinv, warp, lane);  // this warp's x slices
    for (int row0 = first; row0 < last; row0 += step, ++gc) {
      const int rows = min(GROUP, last - row0);
      float acc[MT][4] = {};
      for (int kc = 0; kc < steps; ++kc) {
        const int kx = kc * MKC + warp * WK;
        barrier_wait(full + s, parity);
        if (!(mode & 4)) {
          mma_chunk<MT, 2>(acc, ring + s * STAGE + warp * WK + 16 * t, MPITCH, xh + kx, gid, t, xinv[kc * CW + warp]);
        }
        __syncwarp();
        if (lane == 0) arrive(empty + s);
        if (++s == stages) s = 0, parity ^= 1;
      }
      publish_rows<MT>(acc, red + (gc & 1) * CW * GROUP + warp * GROUP, gid, t);
      asm volatile("bar.sync 1, %0;" ::"r"(32 * CW) : "memory");
      if (tid < rows) store_row<CW, GROUP>(red + (gc & 1) * CW * GROUP, tid, d.scale + row0, d.out + row0);
    }
    asm volatile("bar.sync 1, %0;" ::"r"(32 * CW) : "memory");  // this program's rows of GEMV j stored
    if (tid == 0) {
      __threadfence();
      atomicAdd(done + j, 1u);
    }
  }
}

// The same chain with no copying warp: each of the 8 computing warps copies its own 128-column
// slices of each 32-row chunk into a private ring with cp.async, 16 bytes a lane, DEPTH chunks
// ahead. A second cursor walks the chunk sequence across GEMV boundaries, so a warp's next weights
// are in flight while it waits at one. Correct, but its copies alone read slower than the bulk-copy
// ring's (run EK, H100: 8.94-9.11 against 8.46 ms for the 27B chain).
constexpr int LROWS = 32;   // rows a chunk (two m-tiles)
constexpr int LPITCH = 192;  // a private row: 128 bytes + 64, so rows g and g + 1 use distinct banks

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
}

template <int DEPTH>
__global__ void __launch_bounds__(256, 1)
    chain_ldg_kernel(const GemvDesc* __restrict__ descs, int count, unsigned* done, int kmax, int mode) {
  constexpr int CW = 8, WK = MKC / CW, MT = LROWS / 16;
  constexpr int SLOT = LROWS * LPITCH;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  uint8_t* ring = smem + warp * DEPTH * SLOT;  // this warp's own
  __half* xh = reinterpret_cast<__half*>(smem + CW * DEPTH * SLOT);
  float* xinv = reinterpret_cast<float*>(xh + kmax);
  float* red = xinv + (kmax / MKC) * CW;  // [2][CW][LROWS]
  const ChunkWalk walk{descs, count, false, LROWS};
  auto issue = [&](const Cursor& c, int slot) {  // one commit group a chunk, empty past the end
    if (c.j < count) {
      const GemvDesc d = descs[c.j];
      const int rows = min(LROWS, walk.last(c.j) - c.row0);
      const uint8_t* src = d.w + static_cast<long long>(c.row0) * d.k + c.kc * MKC + warp * WK;
      uint8_t* dst = ring + slot * SLOT;
      for (int i = lane; i < rows * (WK / 16); i += 32) {
        const int r = i / (WK / 16), q = i % (WK / 16);
        cp_async16(dst + r * LPITCH + q * 16, src + static_cast<long long>(r) * d.k + q * 16);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  Cursor ahead = walk.start();
  for (int slot = 0; slot < DEPTH; ++slot) {
    issue(ahead, slot);
    if (ahead.j < count) walk.advance(ahead);
  }

  const int gid = lane >> 2, t = lane & 3;
  int slot = 0, gc = 0;
  for (int j = 0; j < count; ++j) {
    const GemvDesc d = descs[j];
    const int first = walk.first(j), last = walk.last(j), steps = d.k / MKC;
    if (j > 0 && !(mode & 16)) {  // GEMV j - 1 stored everywhere: its outputs are this x (16: no wait)
      if (tid == 0)
        while (load_acquire(done + j - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    if (first < last) load_x_slices<CW>(d.x, steps, xh, xinv, warp, lane);  // this warp's x slices
    for (int row0 = first; row0 < last; row0 += LROWS, ++gc) {
      const int rows = min(LROWS, last - row0);
      float acc[MT][4] = {};
      for (int kc = 0; kc < steps; ++kc) {
        asm volatile("cp.async.wait_group %0;" ::"n"(DEPTH - 1) : "memory");
        __syncwarp();  // every lane's copies of this slot have landed
        if (!(mode & 4)) {
          const int kx = kc * MKC + warp * WK;
          mma_chunk<MT, 2>(acc, ring + slot * SLOT + 16 * t, LPITCH, xh + kx, gid, t, xinv[kc * CW + warp]);
        }
        __syncwarp();  // the slot is read: refill it, DEPTH chunks ahead
        issue(ahead, slot);
        if (ahead.j < count) walk.advance(ahead);
        if (++slot == DEPTH) slot = 0;
      }
      publish_rows<MT>(acc, red + (gc & 1) * CW * LROWS + warp * LROWS, gid, t);
      __syncthreads();
      if (tid < rows) store_row<CW, LROWS>(red + (gc & 1) * CW * LROWS, tid, d.scale + row0, d.out + row0);
    }
    __syncthreads();  // this program's rows of GEMV j stored
    if (tid == 0) {
      __threadfence();
      atomicAdd(done + j, 1u);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// The same chain fed by the whole program (not the warps apart): DEPTH stages of 32 rows x 1024
// bytes, each filled by all 256 threads with cp.async, a warp's 32 lanes 512 contiguous bytes of
// one row, as the served GEMV's tile reads its rows. One barrier a chunk: every copy of the stage
// about to be read has landed, and the stage read last is free to refill. The cursor `ahead` walks
// DEPTH - 1 chunks ahead across GEMV boundaries. Its copies alone read one long GEMV at the floor
// but the 27B chain at 1.15x (runs EL-EN, H100): the grid-wide wait at each boundary stalls them.
template <int DEPTH>
__global__ void __launch_bounds__(256, 1)
    chain_cta_kernel(const GemvDesc* __restrict__ descs, int count, unsigned* done, int kmax, int mode) {
  constexpr int CW = 8, WK = MKC / CW, MT = LROWS / 16;
  constexpr int STAGE = LROWS * MPITCH;
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __half* xh = reinterpret_cast<__half*>(smem + DEPTH * STAGE);
  float* xinv = reinterpret_cast<float*>(xh + kmax);
  float* red = xinv + (kmax / MKC) * CW;  // [2][CW][LROWS]
  const ChunkWalk walk{descs, count, (mode & 8) != 0, LROWS};  // 8: chunks dealt round the grid
  const int step = walk.step();
  auto issue = [&](const Cursor& c, int slot) {  // one commit group a chunk, empty past the end
    if (c.j < count) {
      const GemvDesc d = descs[c.j];
      const int pieces = min(LROWS, walk.last(c.j) - c.row0) * (MKC / 16);
      const uint8_t* src = d.w + static_cast<long long>(c.row0) * d.k + c.kc * MKC;
      uint8_t* dst = smem + slot * STAGE;
      for (int i = tid; i < pieces; i += 256) {
        const int r = i / (MKC / 16), q = i % (MKC / 16);
        cp_async16(dst + r * MPITCH + q * 16, src + static_cast<long long>(r) * d.k + q * 16);
      }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  Cursor ahead = walk.start();
  for (int slot = 0; slot < DEPTH - 1; ++slot) {
    issue(ahead, slot);
    if (ahead.j < count) walk.advance(ahead);
  }

  const int gid = lane >> 2, t = lane & 3;
  int slot = 0, gc = 0;
  for (int j = 0; j < count; ++j) {
    const GemvDesc d = descs[j];
    const int first = walk.first(j), last = walk.last(j), steps = d.k / MKC;
    if (j > 0 && !(mode & 16)) {  // GEMV j - 1 stored everywhere: its outputs are this x (16: no wait)
      if (tid == 0)
        while (load_acquire(done + j - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    if (first < last) load_x_slices<CW>(d.x, steps, xh, xinv, warp, lane);
    for (int row0 = first; row0 < last; row0 += step, ++gc) {
      const int rows = min(LROWS, last - row0);
      float acc[MT][4] = {};
      for (int kc = 0; kc < steps; ++kc) {
        asm volatile("cp.async.wait_group %0;" ::"n"(DEPTH - 2) : "memory");
        __syncthreads();  // this stage landed everywhere; the one read last is free
        issue(ahead, slot == 0 ? DEPTH - 1 : slot - 1);
        if (ahead.j < count) walk.advance(ahead);
        if (!(mode & 4)) {
          const int kx = kc * MKC + warp * WK;
          mma_chunk<MT, 2>(acc, smem + slot * STAGE + warp * WK + 16 * t, MPITCH, xh + kx, gid, t,
                           xinv[kc * CW + warp]);
        }
        if (++slot == DEPTH) slot = 0;
      }
      publish_rows<MT>(acc, red + (gc & 1) * CW * LROWS + warp * LROWS, gid, t);
      __syncthreads();
      if (tid < rows) store_row<CW, LROWS>(red + (gc & 1) * CW * LROWS, tid, d.scale + row0, d.out + row0);
    }
    __syncthreads();  // this program's rows of GEMV j stored
    if (tid == 0) {
      __threadfence();
      atomicAdd(done + j, 1u);
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// A stand-in for the small kernels between two GEMVs (the GDN recurrence and its gated norm,
// attention): lets the next kernel launch as it starts, waits for the previous one, then spins for
// `ns` nanoseconds with no memory traffic, as the decode step's small kernels leave HBM idle.
__global__ void spin_kernel(long long ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

using Kernel = void (*)(const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, int, int, int, int);

struct Instance {
  int group, kc, cwarps;
  Kernel fn;
};

const Instance INSTANCES[] = {
    {16, 1024, 8, prefetch_gemv_kernel<16, 1024, 8>},  {16, 1024, 16, prefetch_gemv_kernel<16, 1024, 16>},
    {32, 1024, 8, prefetch_gemv_kernel<32, 1024, 8>},  {32, 1024, 16, prefetch_gemv_kernel<32, 1024, 16>},
    {32, 512, 8, prefetch_gemv_kernel<32, 512, 8>},    {8, 2048, 8, prefetch_gemv_kernel<8, 2048, 8>},
    {16, 2048, 16, prefetch_gemv_kernel<16, 2048, 16>}, {16, 512, 16, prefetch_gemv_kernel<16, 512, 16>},
};

// Returns a cudaError_t (0: launched) or -1 where no instance takes (group, kc, cwarps) or K % kc != 0.
// ring_bytes: the shared memory given to the ring of group x kc stages (at least 2).
extern "C" int prefetch_gemv_launch(const void* w, const void* scale, const void* x, void* out, int n, int k,
                                    int ring_bytes, int grid, int mode, int group, int kc, int cwarps,
                                    void* stream) {
  Kernel fn = nullptr;
  for (const Instance& i : INSTANCES)
    if (i.group == group && i.kc == kc && i.cwarps == cwarps) fn = i.fn;
  if (fn == nullptr || k % kc != 0 || n <= 0) return -1;
  const int stage = group * kc;
  const int stages = max(2, ring_bytes / stage);
  const size_t smem = static_cast<size_t>(stages) * stage + ((2 * k + 127) / 128) * 128 + 8 * (2 * stages + k / kc);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(32 * (cwarps + 1));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const uint8_t*>(w), static_cast<const float*>(scale),
                         static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), n, k, stages,
                         mode);
  return static_cast<int>(e);
}

// The tensor-core form: chunks of mtiles x 16 rows x 1024 bytes, 8 or 16 computing warps. Returns a
// cudaError_t, -1 where K % 1024 != 0 or mtiles / warps are not 1-2 / 8 or 16.
extern "C" int prefetch_gemv_mma_launch(const void* w, const void* scale, const void* x, void* out, int n,
                                        int k, int ring_bytes, int grid, int mode, int mtiles, int warps,
                                        void* stream) {
  if (k % MKC != 0 || n <= 0 || (mtiles != 1 && mtiles != 2) || (warps != 8 && warps != 16)) return -1;
  const int MWARPS = warps;
  Kernel fn = mtiles == 1 ? (warps == 8 ? prefetch_gemv_mma_kernel<1, 8> : prefetch_gemv_mma_kernel<1, 16>)
                          : (warps == 8 ? prefetch_gemv_mma_kernel<2, 8> : prefetch_gemv_mma_kernel<2, 16>);
  const int group = 16 * mtiles, stage = group * MPITCH, steps = k / MKC;
  const int stages = max(2, ring_bytes / stage);
  const size_t smem = static_cast<size_t>(stages) * stage + ((2 * k + 127) / 128) * 128 +
                      4 * (steps * MWARPS + 2 * MWARPS * group) + 8 * (2 * stages + steps);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(32 * (MWARPS + 1));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const uint8_t*>(w), static_cast<const float*>(scale),
                         static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), n, k, stages,
                         mode);
  return static_cast<int>(e);
}

// The chain in one launch: `count` GemvDesc (device memory), `done` count zeroed counters. Every
// K a multiple of 1024 and at most kmax. Returns a cudaError_t, or -1 for mtiles not 1 or 2.
extern "C" int chain_gemv_launch(const void* descs, int count, void* done, int kmax, int ring_bytes, int grid,
                                 int mode, int mtiles, void* stream) {
  if ((mtiles != 1 && mtiles != 2) || kmax % MKC != 0) return -1;
  using ChainKernel = void (*)(const GemvDesc*, int, unsigned*, int, int, int);
  ChainKernel fn = mtiles == 1 ? chain_gemv_kernel<1> : chain_gemv_kernel<2>;
  const int group = 16 * mtiles, stage = group * MPITCH;
  const int stages = max(2, ring_bytes / stage);
  const size_t smem = static_cast<size_t>(stages) * stage + 2 * kmax + 4 * ((kmax / MKC) * 8 + 2 * 8 * group) +
                      8 * (2 * stages) + 16;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(32 * 9);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const GemvDesc*>(descs), count, static_cast<unsigned*>(done), kmax,
                         stages, mode);
  return static_cast<int>(e);
}

// chain_ldg_kernel: as chain_gemv_launch, each warp's private ring `depth`
// (2-4) chunks of 32 rows x 128 bytes deep.
extern "C" int chain_ldg_launch(const void* descs, int count, void* done, int kmax, int depth, int grid, int mode,
                                void* stream) {
  if (depth < 2 || depth > 4 || kmax % MKC != 0) return -1;
  using LdgKernel = void (*)(const GemvDesc*, int, unsigned*, int, int);
  LdgKernel fn = depth == 2 ? chain_ldg_kernel<2> : depth == 3 ? chain_ldg_kernel<3> : chain_ldg_kernel<4>;
  const size_t smem = static_cast<size_t>(8) * depth * LROWS * LPITCH + 2 * kmax +
                      4 * ((kmax / MKC) * 8 + 2 * 8 * LROWS);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const GemvDesc*>(descs), count, static_cast<unsigned*>(done), kmax,
                         mode);
  return static_cast<int>(e);
}

// chain_cta_kernel: as chain_gemv_launch, `depth` (3-5) stages of 32 rows x 1024 bytes.
extern "C" int chain_cta_launch(const void* descs, int count, void* done, int kmax, int depth, int grid, int mode,
                                void* stream) {
  if (depth < 3 || depth > 5 || kmax % MKC != 0) return -1;
  using CtaKernel = void (*)(const GemvDesc*, int, unsigned*, int, int);
  CtaKernel fn = depth == 3 ? chain_cta_kernel<3> : depth == 4 ? chain_cta_kernel<4> : chain_cta_kernel<5>;
  const size_t smem = static_cast<size_t>(depth) * LROWS * MPITCH + 2 * kmax + 4 * ((kmax / MKC) * 8 + 2 * 8 * LROWS);
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(256);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = static_cast<cudaStream_t>(stream);
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const GemvDesc*>(descs), count, static_cast<unsigned*>(done), kmax,
                         mode);
  return static_cast<int>(e);
}

// The stand-in small kernel: `programs` programs of 128 threads spinning `ns` ns after their wait.
extern "C" int spin_launch(long long ns, int programs, void* stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(programs);
  cfg.blockDim = dim3(128);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, spin_kernel, ns));
}
