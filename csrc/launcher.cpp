// moe_ext._C: the C++ launcher of the Hopper kernels.
//
// The CuTe-DSL kernels are compiled ahead of time for sm_90a and exported with export_to_c; their entry points
// check nothing, so this launcher owns every check on shapes, strides, dtypes and alignment, launches on the
// caller's stream and sets Programmatic Dependent Launch. This file holds the device queries and the checks the
// kernel entry points build on; the kernel table is filled as kernels are exported.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <mutex>
#include <tuple>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef MOE_EXT_WITH_KERNELS
#include "moe_finalize.h"
#include "moe_gemm1_geglu_tanh.h"
#include "moe_gemm1_relu2.h"
#include "moe_gemm1_situ.h"
#include "moe_gemm1_swiglu.h"
#include "moe_gemm2_w4a16.h"
#include "moe_routing.h"
#endif

namespace py = pybind11;

namespace moe_ext {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

struct DeviceInfo {
  int index;
  int major;
  int minor;
  int sm_count;
  int max_smem_per_block_optin;
  bool supports_pdl;  // griddepcontrol and programmatic stream serialization need sm_90+
};

DeviceInfo device_info(int device) {
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  return DeviceInfo{device, prop.major, prop.minor, prop.multiProcessorCount,
                    static_cast<int>(prop.sharedMemPerBlockOptin), prop.major >= 9};
}

int device_count() {
  int count = 0;
  // No driver or no device is a normal state on CPU machines: report zero instead of raising.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// The exported entry points take raw pointers: a misaligned pointer or an odd extent would be read silently.
void check_pointer(const std::string& name, std::uintptr_t ptr, std::int64_t alignment) {
  if (alignment <= 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("alignment must be a positive power of two");
  }
  if (ptr % static_cast<std::uintptr_t>(alignment) != 0) {
    throw std::invalid_argument(name + ": pointer is not " + std::to_string(alignment) + "-byte aligned");
  }
}

void check_divisible(const std::string& name, std::int64_t extent, std::int64_t divisor) {
  if (divisor <= 0 || extent % divisor != 0) {
    throw std::invalid_argument(name + ": extent " + std::to_string(extent) + " is not a multiple of " +
                                std::to_string(divisor));
  }
}

#ifdef MOE_EXT_WITH_KERNELS
constexpr int kRoutingMaxExperts = 2048;  // RoutingConfig.max_experts in moe_ext/kernels/sm90/routing.py
constexpr int kTileM = 64, kTileN = 128, kTileK = 64;  // TileConfig in moe_ext/kernels/sm90/mainloop.py

struct Modules {
  std::once_flag once;
  moe_routing_Kernel_Module_t routing{};
  moe_gemm1_swiglu_Kernel_Module_t gemm1_swiglu{};
  moe_gemm1_situ_Kernel_Module_t gemm1_situ{};
  moe_gemm1_geglu_tanh_Kernel_Module_t gemm1_geglu_tanh{};
  moe_gemm1_relu2_Kernel_Module_t gemm1_relu2{};
  moe_gemm2_w4a16_Kernel_Module_t gemm2_w4a16{};
  moe_finalize_Kernel_Module_t finalize{};
};

Modules& modules() {
  static Modules m;
  return m;
}

// Loads the embedded cubins into every device. Call once outside graph capture (the backend does it before the
// first launch); launching also loads lazily.
void load_kernels() {
  Modules& m = modules();
  std::call_once(m.once, [&] {
    moe_routing_Kernel_Module_Load(&m.routing);
    moe_gemm1_swiglu_Kernel_Module_Load(&m.gemm1_swiglu);
    moe_gemm1_situ_Kernel_Module_Load(&m.gemm1_situ);
    moe_gemm1_geglu_tanh_Kernel_Module_Load(&m.gemm1_geglu_tanh);
    moe_gemm1_relu2_Kernel_Module_Load(&m.gemm1_relu2);
    moe_gemm2_w4a16_Kernel_Module_Load(&m.gemm2_w4a16);
    moe_finalize_Kernel_Module_Load(&m.finalize);
    for (cudaLibrary_t lib : {m.routing.module, m.gemm1_swiglu.module, m.gemm1_situ.module,
                              m.gemm1_geglu_tanh.module, m.gemm1_relu2.module, m.gemm2_w4a16.module,
                              m.finalize.module}) {
      if (lib == nullptr) throw std::runtime_error("moe_ext: loading an embedded cubin failed");
    }
  });
}

// A flat device buffer as Python hands it over: address and element count.
struct Buf {
  std::uintptr_t ptr;
  std::int64_t size;
};

Buf checked(const char* name, std::uintptr_t ptr, std::int64_t size, std::int64_t alignment) {
  if (size < 0 || size > INT32_MAX) throw std::invalid_argument(std::string(name) + ": size out of int32 range");
  if (size > 0 && ptr == 0) throw std::invalid_argument(std::string(name) + ": null pointer");
  check_pointer(name, ptr, alignment);
  return Buf{ptr, size};
}

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

// The exported tensor arguments are all {data, one dynamic extent} for these flat kernels.
template <class T>
T* as(T& slot, Buf b) {
  slot.data = reinterpret_cast<void*>(b.ptr);
  slot.dynamic_shapes[0] = static_cast<int32_t>(b.size);
  return &slot;
}

void finish(int32_t ret, const char* what) {
  if (ret != 0) throw std::runtime_error(std::string(what) + ": launch failed with code " + std::to_string(ret));
  check_cuda(cudaGetLastError(), what);
}

// Routing maps of semantics 5.1. Every buffer is a contiguous int32 vector; the Python caller has checked dtype,
// device and contiguity, this checks what the exported entry point would otherwise trust blindly.
void routing(std::uintptr_t ids, std::int64_t num_slots, int num_experts, int offset, int tile,
             std::uintptr_t expert_counts, std::uintptr_t expert_offsets, std::uintptr_t expanded_to_permuted,
             std::uintptr_t permuted_to_expanded, std::int64_t num_rows, std::uintptr_t tile_to_expert,
             std::uintptr_t tile_to_mn_limit, std::int64_t num_tiles, std::uintptr_t num_live_tiles, bool pdl,
             std::uintptr_t stream) {
  expect(num_experts >= 1 && num_experts <= kRoutingMaxExperts,
         "routing: num_experts must be in [1, " + std::to_string(kRoutingMaxExperts) + "]");
  expect(offset >= 0, "routing: offset must be >= 0");
  expect(tile >= 1, "routing: tile must be >= 1");
  expect(num_rows == num_tiles * tile, "routing: num_rows must equal num_tiles * tile");
  Buf b_ids = checked("ids", ids, num_slots, 4);
  Buf b_counts = checked("expert_counts", expert_counts, num_experts, 4);
  Buf b_offsets = checked("expert_offsets", expert_offsets, num_experts + 1, 4);
  Buf b_e2p = checked("expanded_to_permuted", expanded_to_permuted, num_slots, 4);
  Buf b_p2e = checked("permuted_to_expanded", permuted_to_expanded, num_rows, 4);
  Buf b_te = checked("tile_to_expert", tile_to_expert, num_tiles, 4);
  Buf b_tl = checked("tile_to_mn_limit", tile_to_mn_limit, num_tiles, 4);
  Buf b_live = checked("num_live_tiles", num_live_tiles, 1, 4);
  load_kernels();
  moe_routing_Tensor_ids_t t_ids;
  moe_routing_Tensor_expert_counts_t t_counts;
  moe_routing_Tensor_expert_offsets_t t_offsets;
  moe_routing_Tensor_expanded_to_permuted_t t_e2p;
  moe_routing_Tensor_permuted_to_expanded_t t_p2e;
  moe_routing_Tensor_tile_to_expert_t t_te;
  moe_routing_Tensor_tile_to_mn_limit_t t_tl;
  moe_routing_Tensor_num_live_tiles_t t_live;
  finish(cute_dsl_moe_routing_wrapper(&modules().routing, as(t_ids, b_ids), num_experts, offset, tile,
                                      as(t_counts, b_counts), as(t_offsets, b_offsets), as(t_e2p, b_e2p),
                                      as(t_p2e, b_p2e), as(t_te, b_te), as(t_tl, b_tl), as(t_live, b_live),
                                      static_cast<uint8_t>(pdl), reinterpret_cast<cudaStream_t>(stream)),
         "routing");
}

std::int64_t swizzled_bytes(std::int64_t groups, std::int64_t rows, std::int64_t blocks) {
  return groups * ((rows + 127) / 128) * ((blocks + 3) / 4) * 512;
}

// GEMM1 of w4a16: x [T, H] bf16, w1 [E, N1, H/2] NVFP4 with swizzled e4m3 scales -> intermediate [rows, I] bf16.
// kind: 0 swiglu, 1 situ, 2 geglu_tanh, 3 relu2 (non-gated: N1 = I).
void gemm1_w4a16(int kind, std::uintptr_t x, std::int64_t x_size, std::uintptr_t w1, std::int64_t w1_size,
                 std::uintptr_t w1_sf, std::int64_t w1_sf_size, std::uintptr_t w1_alpha, std::int64_t num_experts,
                 std::uintptr_t permuted_to_expanded, std::int64_t num_rows, std::uintptr_t tile_to_expert,
                 std::uintptr_t tile_to_mn_limit, std::int64_t num_tiles, std::uintptr_t num_live_tiles,
                 std::uintptr_t intermediate, std::int64_t intermediate_size, int hidden, int n1, int top_k,
                 float p0, float p1, float p2, float p3, bool pdl, std::uintptr_t stream) {
  expect(kind >= 0 && kind <= 3, "gemm1: kind must be 0..3");
  const bool gated = kind != 3;
  expect(hidden > 0 && hidden % kTileK == 0, "gemm1: hidden must be a multiple of " + std::to_string(kTileK));
  expect(n1 > 0 && n1 % kTileN == 0, "gemm1: N1 must be a multiple of " + std::to_string(kTileN));
  expect(top_k >= 1, "gemm1: top_k must be >= 1");
  expect(num_rows == num_tiles * kTileM, "gemm1: routing rows must be num_tiles * " + std::to_string(kTileM));
  expect(x_size % hidden == 0, "gemm1: x must hold whole rows of H");
  const std::int64_t inter_cols = gated ? n1 / 2 : n1;
  Buf b_x = checked("x", x, x_size, 16);
  Buf b_w1 = checked("w1_weight", w1, w1_size, 16);
  expect(w1_size == num_experts * n1 * (hidden / 2), "gemm1: w1_weight must be [E, N1, H/2]");
  Buf b_sf = checked("w1_weight_sf", w1_sf, w1_sf_size, 16);
  expect(w1_sf_size == swizzled_bytes(num_experts, n1, hidden / 16), "gemm1: w1_weight_sf has the wrong size");
  Buf b_alpha = checked("w1_alpha", w1_alpha, num_experts, 4);
  Buf b_p2e = checked("permuted_to_expanded", permuted_to_expanded, num_rows, 4);
  Buf b_te = checked("tile_to_expert", tile_to_expert, num_tiles, 4);
  Buf b_tl = checked("tile_to_mn_limit", tile_to_mn_limit, num_tiles, 4);
  Buf b_live = checked("num_live_tiles", num_live_tiles, 1, 4);
  Buf b_inter = checked("intermediate", intermediate, intermediate_size, 16);
  expect(intermediate_size == num_rows * inter_cols, "gemm1: intermediate must be [rows, I]");
  load_kernels();
  auto s = reinterpret_cast<cudaStream_t>(stream);
  auto run = [&](auto wrapper, auto* module, auto tensors) {
    auto& [t_x, t_w1, t_sf, t_alpha, t_p2e, t_te, t_tl, t_live, t_inter] = tensors;
    finish(wrapper(module, as(t_x, b_x), as(t_w1, b_w1), as(t_sf, b_sf), as(t_alpha, b_alpha), as(t_p2e, b_p2e),
                   as(t_te, b_te), as(t_tl, b_tl), as(t_live, b_live), as(t_inter, b_inter), hidden, n1, top_k,
                   p0, p1, p2, p3, static_cast<uint8_t>(pdl), s),
           "gemm1");
  };
#define MOE_EXT_GEMM1_TENSORS(K)                                                                               \
  std::tuple<moe_gemm1_##K##_Tensor_x_t, moe_gemm1_##K##_Tensor_w1_t, moe_gemm1_##K##_Tensor_w1_sf_t,          \
             moe_gemm1_##K##_Tensor_w1_alpha_t, moe_gemm1_##K##_Tensor_permuted_to_expanded_t,                 \
             moe_gemm1_##K##_Tensor_tile_to_expert_t, moe_gemm1_##K##_Tensor_tile_to_mn_limit_t,               \
             moe_gemm1_##K##_Tensor_num_live_tiles_t, moe_gemm1_##K##_Tensor_intermediate_t>{}
  switch (kind) {
    case 0: run(cute_dsl_moe_gemm1_swiglu_wrapper, &modules().gemm1_swiglu, MOE_EXT_GEMM1_TENSORS(swiglu)); break;
    case 1: run(cute_dsl_moe_gemm1_situ_wrapper, &modules().gemm1_situ, MOE_EXT_GEMM1_TENSORS(situ)); break;
    case 2:
      run(cute_dsl_moe_gemm1_geglu_tanh_wrapper, &modules().gemm1_geglu_tanh, MOE_EXT_GEMM1_TENSORS(geglu_tanh));
      break;
    default: run(cute_dsl_moe_gemm1_relu2_wrapper, &modules().gemm1_relu2, MOE_EXT_GEMM1_TENSORS(relu2)); break;
  }
#undef MOE_EXT_GEMM1_TENSORS
}

// GEMM2 of w4a16: intermediate [rows, I] bf16 x w2 [E, H, I/2] NVFP4 -> slot_output [T*K, H] bf16.
void gemm2_w4a16(std::uintptr_t intermediate, std::int64_t intermediate_size, std::uintptr_t w2,
                 std::int64_t w2_size, std::uintptr_t w2_sf, std::int64_t w2_sf_size, std::uintptr_t w2_alpha,
                 std::int64_t num_experts, std::uintptr_t token_final_scales, std::int64_t num_slots,
                 std::uintptr_t permuted_to_expanded, std::int64_t num_rows, std::uintptr_t tile_to_expert,
                 std::uintptr_t tile_to_mn_limit, std::int64_t num_tiles, std::uintptr_t num_live_tiles,
                 std::uintptr_t slot_output, std::int64_t slot_output_size, int hidden, int inter,
                 bool router_weight_in_scale, bool pdl, std::uintptr_t stream) {
  expect(hidden > 0 && hidden % kTileN == 0, "gemm2: hidden must be a multiple of " + std::to_string(kTileN));
  expect(inter > 0 && inter % kTileK == 0, "gemm2: I must be a multiple of " + std::to_string(kTileK));
  expect(num_rows == num_tiles * kTileM, "gemm2: routing rows must be num_tiles * " + std::to_string(kTileM));
  Buf b_inter = checked("intermediate", intermediate, intermediate_size, 16);
  expect(intermediate_size == num_rows * inter, "gemm2: intermediate must be [rows, I]");
  Buf b_w2 = checked("w2_weight", w2, w2_size, 16);
  expect(w2_size == num_experts * hidden * (inter / 2), "gemm2: w2_weight must be [E, H, I/2]");
  Buf b_sf = checked("w2_weight_sf", w2_sf, w2_sf_size, 16);
  expect(w2_sf_size == swizzled_bytes(num_experts, hidden, inter / 16), "gemm2: w2_weight_sf has the wrong size");
  Buf b_alpha = checked("w2_alpha", w2_alpha, num_experts, 4);
  Buf b_scales = checked("token_final_scales", token_final_scales, num_slots, 4);
  Buf b_p2e = checked("permuted_to_expanded", permuted_to_expanded, num_rows, 4);
  Buf b_te = checked("tile_to_expert", tile_to_expert, num_tiles, 4);
  Buf b_tl = checked("tile_to_mn_limit", tile_to_mn_limit, num_tiles, 4);
  Buf b_live = checked("num_live_tiles", num_live_tiles, 1, 4);
  Buf b_out = checked("slot_output", slot_output, slot_output_size, 16);
  expect(slot_output_size == num_slots * hidden, "gemm2: slot_output must be [T*K, H]");
  load_kernels();
  moe_gemm2_w4a16_Tensor_intermediate_t t_inter;
  moe_gemm2_w4a16_Tensor_w2_t t_w2;
  moe_gemm2_w4a16_Tensor_w2_sf_t t_sf;
  moe_gemm2_w4a16_Tensor_w2_alpha_t t_alpha;
  moe_gemm2_w4a16_Tensor_token_final_scales_t t_scales;
  moe_gemm2_w4a16_Tensor_permuted_to_expanded_t t_p2e;
  moe_gemm2_w4a16_Tensor_tile_to_expert_t t_te;
  moe_gemm2_w4a16_Tensor_tile_to_mn_limit_t t_tl;
  moe_gemm2_w4a16_Tensor_num_live_tiles_t t_live;
  moe_gemm2_w4a16_Tensor_slot_output_t t_out;
  finish(cute_dsl_moe_gemm2_w4a16_wrapper(&modules().gemm2_w4a16, as(t_inter, b_inter), as(t_w2, b_w2),
                                          as(t_sf, b_sf), as(t_alpha, b_alpha), as(t_scales, b_scales),
                                          as(t_p2e, b_p2e), as(t_te, b_te), as(t_tl, b_tl), as(t_live, b_live),
                                          as(t_out, b_out), hidden, inter, static_cast<uint8_t>(router_weight_in_scale),
                                          static_cast<uint8_t>(pdl), reinterpret_cast<cudaStream_t>(stream)),
         "gemm2");
}

// Finalize: slot_output [T*K, H] bf16 -> output [T, H] bf16 (fused: bf16 running sum; else fp32 weighted sum).
void finalize(std::uintptr_t slot_output, std::int64_t slot_output_size, std::uintptr_t expanded_to_permuted,
              std::int64_t num_slots, std::uintptr_t token_final_scales, std::uintptr_t output,
              std::int64_t output_size, int hidden, int top_k, bool fused, bool pdl, std::uintptr_t stream) {
  expect(hidden > 0 && top_k >= 1 && num_slots % top_k == 0, "finalize: bad hidden/top_k");
  expect(num_slots > 0, "finalize: needs at least one token");
  Buf b_slots = checked("slot_output", slot_output, slot_output_size, 16);
  expect(slot_output_size == num_slots * hidden, "finalize: slot_output must be [T*K, H]");
  Buf b_e2p = checked("expanded_to_permuted", expanded_to_permuted, num_slots, 4);
  Buf b_scales = checked("token_final_scales", token_final_scales, num_slots, 4);
  Buf b_out = checked("output", output, output_size, 16);
  expect(output_size == (num_slots / top_k) * hidden, "finalize: output must be [T, H]");
  load_kernels();
  moe_finalize_Tensor_slot_output_t t_slots;
  moe_finalize_Tensor_expanded_to_permuted_t t_e2p;
  moe_finalize_Tensor_token_final_scales_t t_scales;
  moe_finalize_Tensor_output_t t_out;
  finish(cute_dsl_moe_finalize_wrapper(&modules().finalize, as(t_slots, b_slots), as(t_e2p, b_e2p),
                                       as(t_scales, b_scales), as(t_out, b_out), hidden, top_k,
                                       static_cast<uint8_t>(fused), static_cast<uint8_t>(pdl),
                                       reinterpret_cast<cudaStream_t>(stream)),
         "finalize");
}

std::vector<std::string> kernels() {
  return {"moe_routing", "moe_gemm1_swiglu", "moe_gemm1_situ", "moe_gemm1_geglu_tanh", "moe_gemm1_relu2",
          "moe_gemm2_w4a16", "moe_finalize"};
}
#else
std::vector<std::string> kernels() { return {}; }
#endif

int cuda_runtime_version() {
  int version = 0;
  check_cuda(cudaRuntimeGetVersion(&version), "cudaRuntimeGetVersion");
  return version;
}

}  // namespace moe_ext

PYBIND11_MODULE(_C, m) {
  m.doc() = "moe_ext C++ launcher: device queries, argument checks and the exported Hopper kernels";
  py::class_<moe_ext::DeviceInfo>(m, "DeviceInfo")
      .def_readonly("index", &moe_ext::DeviceInfo::index)
      .def_readonly("major", &moe_ext::DeviceInfo::major)
      .def_readonly("minor", &moe_ext::DeviceInfo::minor)
      .def_readonly("sm_count", &moe_ext::DeviceInfo::sm_count)
      .def_readonly("max_smem_per_block_optin", &moe_ext::DeviceInfo::max_smem_per_block_optin)
      .def_readonly("supports_pdl", &moe_ext::DeviceInfo::supports_pdl);
  m.def("device_count", &moe_ext::device_count, "CUDA devices visible (0 without a driver)");
  m.def("device_info", &moe_ext::device_info, py::arg("device") = 0);
  m.def("check_pointer", &moe_ext::check_pointer, py::arg("name"), py::arg("ptr"), py::arg("alignment"));
  m.def("check_divisible", &moe_ext::check_divisible, py::arg("name"), py::arg("extent"), py::arg("divisor"));
  m.def("kernels", &moe_ext::kernels, "names of the exported kernel specialisations linked in");
#ifdef MOE_EXT_WITH_KERNELS
  m.def("load_kernels", &moe_ext::load_kernels, "load the embedded cubins (call outside graph capture)");
  m.def("routing", &moe_ext::routing, py::arg("ids"), py::arg("num_slots"), py::arg("num_experts"),
        py::arg("offset"), py::arg("tile"), py::arg("expert_counts"), py::arg("expert_offsets"),
        py::arg("expanded_to_permuted"), py::arg("permuted_to_expanded"), py::arg("num_rows"),
        py::arg("tile_to_expert"), py::arg("tile_to_mn_limit"), py::arg("num_tiles"), py::arg("num_live_tiles"),
        py::arg("pdl"), py::arg("stream"));
  m.def("gemm1_w4a16", &moe_ext::gemm1_w4a16);
  m.def("gemm2_w4a16", &moe_ext::gemm2_w4a16);
  m.def("finalize", &moe_ext::finalize);
#endif
  m.def("cuda_runtime_version", &moe_ext::cuda_runtime_version);
}
