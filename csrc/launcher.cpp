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
#include <stdexcept>
#include <string>
#include <vector>

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

std::vector<std::string> kernels() { return {}; }

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
  m.def("cuda_runtime_version", &moe_ext::cuda_runtime_version);
}
