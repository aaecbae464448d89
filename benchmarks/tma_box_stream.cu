// How fast can TMA boxes of narrow rows stream a weight matrix from HBM? The wgmma GEMMs load each 64-K stage of
// the 4-bit weights as one box of 128-256 rows x 32 bytes (rows K / 2 bytes apart); the streaming kernels take
// 128 rows x 64 bytes. This streams a [rows, row_bytes] byte matrix the way those kernels walk it (one CTA per SM,
// each work item a block of `box_rows` consecutive rows, its K boxes one after another through a ring of
// mbarrier-guarded shared slots) and reports the bandwidth for each box width, with the same bytes in flight.
// No computation: the consumer warp only waits for each slot and frees it, so the number is the copy path's own.
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/tma_box_stream benchmarks/tma_box_stream.cu
//   /tmp/tma_box_stream            # prints one line per (row_bytes, box width, bytes in flight)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    auto e = (x);                                                                             \
    if (e != 0) {                                                                             \
      std::fprintf(stderr, "%s failed: %d (line %d)\n", #x, static_cast<int>(e), __LINE__); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ inline void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
               "r"(count));
}

__device__ inline void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(bar))),
               "r"(bytes));
}

__device__ inline void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))));
}

__device__ inline void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n LAB_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra LAB_WAIT;\n}" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(bar))),
      "r"(parity));
}

__device__ inline void tma_load_2d(void* dst, const CUtensorMap* map, int x, int y, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))),
      "l"(map), "r"(x), "r"(y), "r"(static_cast<unsigned>(__cvta_generic_to_shared(bar)))
      : "memory");
}

// Warp 0 lane 0: producer; warp 1: consumer (lane 0 waits and frees). Items: row blocks, CTAs gridDim.x apart.
__global__ void __launch_bounds__(64, 1)
    stream_boxes(const __grid_constant__ CUtensorMap map, int items, int boxes_per_item, int box_rows, int box_bytes,
                 int stages, unsigned long long* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint64_t* empty = full + stages;
  unsigned char* slots = smem + 1024;
  const unsigned slot_bytes = box_rows * box_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  long long n = 0;
  unsigned phase_sum = 0;
  if (lane == 0) {
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      for (int k = 0; k < boxes_per_item; ++k, ++n) {
        const int s = static_cast<int>(n % stages);
        const unsigned parity = static_cast<unsigned>((n / stages) & 1);
        if (warp == 0) {
          if (n >= stages) mbar_wait(&empty[s], parity ^ 1);
          mbar_expect_tx(&full[s], slot_bytes);
          tma_load_2d(slots + s * slot_bytes, &map, k * box_bytes, item * box_rows, &full[s]);
        } else {
          mbar_wait(&full[s], parity);
          phase_sum += slots[s * slot_bytes + (k & 63)];
          mbar_arrive(&empty[s]);
        }
      }
    }
    if (warp == 1) atomicAdd(sink, phase_sum);
  }
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t total = size_t(2) << 30;  // 2 GiB streamed per run: far past L2
  unsigned char* buf = nullptr;
  CHECK(cudaMalloc(&buf, total));
  CHECK(cudaMemset(buf, 1, total));
  unsigned long long* sink = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(unsigned long long)));
  // the driver's encoder through the runtime, so nothing links libcuda
  CUresult (*encode)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                     const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                     CUtensorMapL2promotion, CUtensorMapFloatOOBfill) = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                         cudaEnableDefault, &found));
  CHECK(found != cudaDriverEntryPointSuccess);
  std::printf("sms %d, %zu MiB streamed per run; median of 9 runs\n", sms, total >> 20);
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  const int row_bytes_list[] = {2048, 3584, 7168};  // Mixtral GEMM1 (K 4096), DeepSeek-V3 GEMM1, Mixtral GEMM2
  const int box_bytes_list[] = {32, 64, 128, 256};
  const int in_flight_list[] = {40 << 10, 80 << 10, 160 << 10};
  const CUtensorMapL2promotion promos[] = {CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
  const char* promo_names[] = {"none", "64B", "128B", "256B"};
  for (int row_bytes : row_bytes_list) {
    const int box_rows = 256;
    const size_t rows = total / row_bytes / box_rows * box_rows;
    for (int box_bytes : box_bytes_list) {
      for (int in_flight : in_flight_list) {
        for (auto promo : promos) {
          const int stages = in_flight / (box_rows * box_bytes);
          if (stages < 2) continue;
          CUtensorMap map;
          cuuint64_t dims[2] = {cuuint64_t(row_bytes), cuuint64_t(rows)};
          cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
          cuuint32_t box[2] = {cuuint32_t(box_bytes), cuuint32_t(box_rows)};
          cuuint32_t estr[2] = {1, 1};
          CHECK(encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, buf, dims, strides, box, estr,
                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, promo,
                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
          const int items = static_cast<int>(rows / box_rows), boxes = row_bytes / box_bytes;
          const int smem = 1024 + stages * box_rows * box_bytes;
          CHECK(cudaFuncSetAttribute(stream_boxes, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
          std::vector<float> ms;
          for (int run = 0; run < 10; ++run) {
            CHECK(cudaEventRecord(t0));
            stream_boxes<<<sms, 64, smem>>>(map, items, boxes, box_rows, box_bytes, stages, sink);
            CHECK(cudaEventRecord(t1));
            CHECK(cudaEventSynchronize(t1));
            float t = 0;
            CHECK(cudaEventElapsedTime(&t, t0, t1));
            if (run > 0) ms.push_back(t);  // run 0: warm-up
          }
          std::sort(ms.begin(), ms.end());
          const double med = ms[ms.size() / 2];
          std::printf("row_bytes %5d box %3d B x %d rows, %3d KB in flight (%2d stages), l2_promotion %s: %7.3f ms "
                      "%6.2f TB/s\n",
                      row_bytes, box_bytes, box_rows, in_flight >> 10, stages,
                      promo_names[promo], med,
                      double(size_t(items) * box_rows * row_bytes) / (med * 1e-3) / 1e12);
        }
      }
    }
  }
  CHECK(cudaGetLastError());
  return 0;
}
