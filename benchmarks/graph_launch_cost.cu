// What a one-node CUDA graph costs around its kernel, for the launch attributes the one-launch decode uses
// (decode_fused.py: a cooperative grid of two 256-thread CTAs an SM, ~100 KB of shared memory each, PDL). The
// whole-forward benchmark times a graph replay between two events: at Qwen3-30B-A3B T=1 the replay is ~21.0 us on
// an H100 while the kernel's own span (first CTA start to last CTA end, its timeline build) is ~18.4 us. This
// replays a kernel that only stamps each CTA's start and end (global timer) under each attribute set and prints,
// per set: the median replay between events (as moe_ext.bench times it), the median kernel span inside it, and
// what is left (launch and completion overhead a forward cannot avoid), plus back-to-back replays per graph and
// the smallest step seen between CTA stamps (the global timer's resolution bounds the span's).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a -o /tmp/graph_launch_cost benchmarks/graph_launch_cost.cu
//   /tmp/graph_launch_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                \
  do {                                                                                          \
    auto err = (x);                                                                             \
    if (err != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s failed: %s (line %d)\n", #x, cudaGetErrorString(err), __LINE__); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

__device__ inline uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Each CTA: thread 0 stamps its start, waits for the previous grid (PDL; a no-op without the attribute), and after
// a CTA barrier stamps its end. The launch's dynamic shared memory sets the occupancy, as the decode kernel's does.
__global__ void __launch_bounds__(256, 2) stamp(uint64_t* starts, uint64_t* ends) {
  uint64_t start = global_ns();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __syncthreads();
  if (threadIdx.x == 0) {
    starts[blockIdx.x] = start;
    ends[blockIdx.x] = global_ns();
  }
  asm volatile("griddepcontrol.launch_dependents;");
}

// Keeps the GPU busy while the host enqueues the timed replays behind it, so no sample holds host launch latency.
__global__ void spin(uint64_t ns) {
  uint64_t start = global_ns();
  while (global_ns() - start < ns) {
  }
}

struct Variant {
  const char* name;
  int ctas_per_sm;
  int smem_bytes;
  bool cooperative;
  bool pdl;
};

static cudaGraphExec_t capture(const Variant& v, int ctas, uint64_t* starts, uint64_t* ends, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(256);
  config.dynamicSmemBytes = v.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  int n = 0;
  if (v.cooperative) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n++].val.cooperative = 1;
  }
  if (v.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  CHECK(cudaLaunchKernelEx(&config, stamp, starts, ends));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CHECK(cudaGraphDestroy(graph));
  return exec;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  const int iters = 200;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(stamp, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
  const Variant variants[] = {
      {"one CTA an SM, no shared memory", 1, 0, false, false},
      {"two CTAs an SM, 100 KB each", 2, 100 * 1024, false, false},
      {"  + cooperative", 2, 100 * 1024, true, false},
      {"  + PDL", 2, 100 * 1024, false, true},
      {"  + cooperative + PDL (the decode kernel's launch)", 2, 100 * 1024, true, true},
  };
  uint64_t *starts, *ends;
  CHECK(cudaMalloc(&starts, 2 * sms * sizeof(uint64_t)));
  CHECK(cudaMalloc(&ends, 2 * sms * sizeof(uint64_t)));
  std::vector<uint64_t> host_starts(2 * sms), host_ends(2 * sms);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t before, after;
  CHECK(cudaEventCreate(&before));
  CHECK(cudaEventCreate(&after));
  std::printf("%d SMs; us: replay between events (median of %d), kernel span in it, replay - span, "
              "back-to-back replays per graph\n", sms, iters);
  for (const Variant& v : variants) {
    const int ctas = v.ctas_per_sm * sms;
    cudaGraphExec_t exec = capture(v, ctas, starts, ends, stream);
    for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaStreamSynchronize(stream));
    std::vector<double> replays, spans;
    uint64_t tick = ~0ull;  // the global timer's resolution as seen here: the smallest step between CTA stamps
    for (int i = 0; i < iters; ++i) {  // one replay at a time: its span is read back after it
      spin<<<1, 1, 0, stream>>>(20000);  // 20 us ahead of the host
      CHECK(cudaEventRecord(before, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(after, stream));
      CHECK(cudaStreamSynchronize(stream));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, before, after));
      replays.push_back(ms * 1e3);
      CHECK(cudaMemcpy(host_starts.data(), starts, ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(host_ends.data(), ends, ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      uint64_t first = *std::min_element(host_starts.begin(), host_starts.begin() + ctas);
      uint64_t last = *std::max_element(host_ends.begin(), host_ends.begin() + ctas);
      spans.push_back((last - first) * 1e-3);
      std::vector<uint64_t> stamps(host_starts.begin(), host_starts.begin() + ctas);
      std::sort(stamps.begin(), stamps.end());
      for (int c = 1; c < ctas; ++c)
        if (stamps[c] > stamps[c - 1]) tick = std::min(tick, stamps[c] - stamps[c - 1]);
    }
    spin<<<1, 1, 0, stream>>>(iters * 10000ull);
    CHECK(cudaEventRecord(before, stream));
    for (int i = 0; i < iters; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(after, stream));
    CHECK(cudaStreamSynchronize(stream));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, before, after));
    const double replay = median(replays), span = median(spans);
    std::printf("%-52s %6.2f %6.2f %6.2f %6.2f  (timer step %llu ns)\n", v.name, replay, span, replay - span,
                ms * 1e3 / iters, static_cast<unsigned long long>(tick));
    CHECK(cudaGraphExecDestroy(exec));
  }
  return 0;
}
