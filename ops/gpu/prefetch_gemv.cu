// A one-row fp8 GEMV (per-channel scales, bf16 x and out) that streams its weight through shared
// memory with the bulk copy engine and issues its first copies before its PDL wait: a probe of
// whether a chain of one-row GEMVs can keep HBM busy across launches (ops/gpu/prefetch_gemv_probe.py).
//
// One program per SM (a persistent grid); program b owns rows [b N / G, (b + 1) N / G), a
// contiguous run of the row-major [N, K] weight, read as chunks of whole rows (rows_per_chunk x K
// bytes) into a ring of `stages` buffers, each completed on its own mbarrier. Thread t multiplies
// the 16-byte segments t, t + T, ... of every row of a chunk by x (loaded into registers once,
// after the wait), each warp reduces its sums and the warps' sums meet in shared memory, summed in
// a fixed order (no atomics). MODE bit 0: let the next kernel launch as this one starts
// (griddepcontrol.launch_dependents); bit 1: issue the ring's first copies before the wait.
// Built by the probe with nvcc -arch=sm_90; loaded through ctypes (prefetch_gemv_launch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t shared_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void barrier_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_addr(bar)) : "memory");
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

__device__ __forceinline__ float dot16(uint4 w, const __nv_bfloat162* x) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float a = 0.f, b = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(words[i] >> (16 * h));
      const float2 wf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      const float2 xf = __bfloat1622float2(x[2 * i + h]);
      a = fmaf(wf.x, xf.x, a);
      b = fmaf(wf.y, xf.y, b);
    }
  }
  return a + b;
}

struct Chunk {
  int row0;  // the chunk's first row (global)
  int rows;  // rows in it
};

template <int THREADS, int SEGS>
__global__ void __launch_bounds__(THREADS, 2)
    prefetch_gemv_kernel(const uint8_t* __restrict__ w, const float* __restrict__ scale,
                         const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ out, int n,
                         int k, int rows_per_chunk, int stages, uint32_t stage_bytes, int mode) {
  constexpr int WARPS = THREADS / 32;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + stages * stage_bytes);
  float* partial = reinterpret_cast<float*>(full + stages);  // [2][rows_per_chunk][WARPS]

  if (mode & 1) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int first = static_cast<int>((static_cast<long long>(blockIdx.x) * n) / gridDim.x);
  const int last = static_cast<int>((static_cast<long long>(blockIdx.x + 1) * n) / gridDim.x);
  const int chunks = (last - first + rows_per_chunk - 1) / rows_per_chunk;
  auto chunk = [&](int c) {
    const int r0 = first + c * rows_per_chunk;
    return Chunk{r0, min(rows_per_chunk, last - r0)};
  };
  auto issue = [&](int c) {  // one thread: chunk c into its stage
    const Chunk ch = chunk(c);
    uint64_t* bar = full + c % stages;
    const uint32_t bytes = static_cast<uint32_t>(ch.rows) * static_cast<uint32_t>(k);
    expect_bytes(bar, bytes);
    bulk_copy(ring + (c % stages) * stage_bytes, w + static_cast<long long>(ch.row0) * k, bytes, bar);
  };
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) barrier_init(full + s);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int ahead = min(stages, chunks);
  if ((mode & 2) && tid == 0)
    for (int c = 0; c < ahead; ++c) issue(c);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (!(mode & 2) && tid == 0)
    for (int c = 0; c < ahead; ++c) issue(c);

  const int segs = k / 16;  // k % 16 == 0 (checked by the launcher)
  __nv_bfloat162 xr[SEGS][8];
#pragma unroll
  for (int j = 0; j < SEGS; ++j) {
    const int s = tid + j * THREADS;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = lo;
    if (s < segs) {
      lo = reinterpret_cast<const uint4*>(x)[2 * s];
      hi = reinterpret_cast<const uint4*>(x)[2 * s + 1];
    }
    const uint32_t v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) xr[j][i] = *reinterpret_cast<const __nv_bfloat162*>(&v[i]);
  }

  for (int c = 0; c < chunks; ++c) {
    const Chunk ch = chunk(c);
    barrier_wait(full + c % stages, (c / stages) & 1);
    const uint8_t* stage = ring + (c % stages) * stage_bytes;
    float* part = partial + (c & 1) * rows_per_chunk * WARPS;
    for (int r = 0; r < ch.rows; ++r) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < SEGS; ++j) {
        const int s = tid + j * THREADS;
        if (s < segs) {
          const uint4 wv = *reinterpret_cast<const uint4*>(stage + static_cast<long long>(r) * k + 16 * s);
          acc += dot16(wv, xr[j]);
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      if (lane == 0) part[r * WARPS + warp] = acc;
    }
    __syncthreads();  // the stage is read and the warps' sums are in `part`
    if (tid == 0 && c + stages < chunks) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(c + stages);
    }
    if (tid < ch.rows) {
      float sum = 0.f;
      for (int i = 0; i < WARPS; ++i) sum += part[tid * WARPS + i];
      const int row = ch.row0 + tid;
      out[row] = __float2bfloat16(sum * scale[row]);
    }
  }
}

template <int THREADS, int SEGS>
int launch(const void* w, const void* scale, const void* x, void* out, int n, int k, int rows_per_chunk,
           int stages, uint32_t stage_bytes, size_t smem, int grid, int mode, cudaStream_t stream) {
  auto fn = prefetch_gemv_kernel<THREADS, SEGS>;
  cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, fn, static_cast<const uint8_t*>(w), static_cast<const float*>(scale),
                         static_cast<const __nv_bfloat16*>(x), static_cast<__nv_bfloat16*>(out), n, k,
                         rows_per_chunk, stages, stage_bytes, mode);
  return static_cast<int>(e);
}

template <int THREADS>
int dispatch(int segs_per_thread, const void* w, const void* scale, const void* x, void* out, int n, int k,
             int rows_per_chunk, int stages, uint32_t stage_bytes, size_t smem, int grid, int mode,
             cudaStream_t stream) {
  switch (segs_per_thread) {
    case 1: return launch<THREADS, 1>(w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, stream);
    case 2: return launch<THREADS, 2>(w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, stream);
    case 3: return launch<THREADS, 3>(w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, stream);
    case 4: return launch<THREADS, 4>(w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, stream);
    case 5: return launch<THREADS, 5>(w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, stream);
    default: return -1;
  }
}

}  // namespace

// Returns a cudaError_t (0: launched), -1 for a shape it does not take, -2 for threads not 256 / 384.
// ring_bytes: the shared memory given to the ring (its stages are whole rows, at least 2 of them).
extern "C" int prefetch_gemv_launch(const void* w, const void* scale, const void* x, void* out, int n, int k,
                                    int threads, int ring_bytes, int grid, int mode, void* stream) {
  if (k % 16 != 0 || n <= 0 || k <= 0) return -1;
  int rows_per_chunk = (ring_bytes / 4) / k;  // at least four stages of whole rows where they fit
  if (rows_per_chunk < 1) rows_per_chunk = 1;
  if (rows_per_chunk > threads) rows_per_chunk = threads;  // one thread sums each row of a chunk
  const uint32_t stage_bytes = ((static_cast<uint32_t>(rows_per_chunk) * k + 127) / 128) * 128;
  int stages = ring_bytes / static_cast<int>(stage_bytes);
  if (stages < 2) stages = 2;
  const int segs_per_thread = (k / 16 + threads - 1) / threads;
  const size_t smem = static_cast<size_t>(stages) * stage_bytes + 8 * stages +
                      2 * sizeof(float) * rows_per_chunk * (threads / 32);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (threads == 256)
    return dispatch<256>(segs_per_thread, w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, s);
  if (threads == 384)
    return dispatch<384>(segs_per_thread, w, scale, x, out, n, k, rows_per_chunk, stages, stage_bytes, smem, grid, mode, s);
  return -2;
}
