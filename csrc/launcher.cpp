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
#include <stdexcept>
#include <string>
#include <vector>

#ifdef MOE_EXT_WITH_KERNELS
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

struct Modules {
  std::once_flag once;
  moe_routing_Kernel_Module_t routing{};
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
    if (m.routing.module == nullptr) throw std::runtime_error("moe_ext: loading the moe_routing cubin failed");
  });
}

void check_i32_vector(const char* name, std::uintptr_t ptr, std::int64_t size) {
  if (size < 0 || size > INT32_MAX) throw std::invalid_argument(std::string(name) + ": size out of int32 range");
  if (size > 0 && ptr == 0) throw std::invalid_argument(std::string(name) + ": null pointer");
  check_pointer(name, ptr, 4);
}

// Routing maps of semantics 5.1. Every buffer is a contiguous int32 vector; the Python caller has checked dtype,
// device and contiguity, this checks what the exported entry point would otherwise trust blindly.
void routing(std::uintptr_t ids, std::int64_t num_slots, int num_experts, int offset, int tile,
             std::uintptr_t expert_counts, std::uintptr_t expert_offsets, std::uintptr_t expanded_to_permuted,
             std::uintptr_t permuted_to_expanded, std::int64_t num_rows, std::uintptr_t tile_to_expert,
             std::uintptr_t tile_to_mn_limit, std::int64_t num_tiles, std::uintptr_t num_live_tiles, bool pdl,
             std::uintptr_t stream) {
  if (num_experts < 1 || num_experts > kRoutingMaxExperts) {
    throw std::invalid_argument("routing: num_experts must be in [1, " + std::to_string(kRoutingMaxExperts) + "]");
  }
  if (offset < 0) throw std::invalid_argument("routing: offset must be >= 0");
  if (tile < 1) throw std::invalid_argument("routing: tile must be >= 1");
  if (num_rows != num_tiles * tile) throw std::invalid_argument("routing: num_rows must equal num_tiles * tile");
  check_i32_vector("ids", ids, num_slots);
  check_i32_vector("expert_counts", expert_counts, num_experts);
  check_i32_vector("expert_offsets", expert_offsets, num_experts + 1);
  check_i32_vector("expanded_to_permuted", expanded_to_permuted, num_slots);
  check_i32_vector("permuted_to_expanded", permuted_to_expanded, num_rows);
  check_i32_vector("tile_to_expert", tile_to_expert, num_tiles);
  check_i32_vector("tile_to_mn_limit", tile_to_mn_limit, num_tiles);
  check_i32_vector("num_live_tiles", num_live_tiles, 1);
  load_kernels();
  const auto slots = static_cast<int32_t>(num_slots);
  const auto rows = static_cast<int32_t>(num_rows);
  const auto tiles = static_cast<int32_t>(num_tiles);
  auto ptr = [](std::uintptr_t p) { return reinterpret_cast<void*>(p); };
  moe_routing_Tensor_ids_t t_ids{ptr(ids), {slots}};
  moe_routing_Tensor_expert_counts_t t_counts{ptr(expert_counts), {num_experts}};
  moe_routing_Tensor_expert_offsets_t t_offsets{ptr(expert_offsets), {num_experts + 1}};
  moe_routing_Tensor_expanded_to_permuted_t t_e2p{ptr(expanded_to_permuted), {slots}};
  moe_routing_Tensor_permuted_to_expanded_t t_p2e{ptr(permuted_to_expanded), {rows}};
  moe_routing_Tensor_tile_to_expert_t t_te{ptr(tile_to_expert), {tiles}};
  moe_routing_Tensor_tile_to_mn_limit_t t_tl{ptr(tile_to_mn_limit), {tiles}};
  moe_routing_Tensor_num_live_tiles_t t_live{ptr(num_live_tiles), {1}};
  int32_t ret = cute_dsl_moe_routing_wrapper(&modules().routing, &t_ids, num_experts, offset, tile, &t_counts,
                                             &t_offsets, &t_e2p, &t_p2e, &t_te, &t_tl, &t_live,
                                             static_cast<uint8_t>(pdl), reinterpret_cast<cudaStream_t>(stream));
  if (ret != 0) throw std::runtime_error("routing: launch failed with code " + std::to_string(ret));
  check_cuda(cudaGetLastError(), "routing launch");
}

std::vector<std::string> kernels() { return {"moe_routing"}; }
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
#endif
  m.def("cuda_runtime_version", &moe_ext::cuda_runtime_version);
}
