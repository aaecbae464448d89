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

void memset_on(std::uintptr_t ptr, std::int64_t bytes, cudaStream_t stream) {
  check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(ptr), 0, static_cast<std::size_t>(bytes), stream),
             "cudaMemsetAsync");
}

void check_memset(std::uintptr_t ptr, std::int64_t bytes) {
  if (bytes < 0) throw std::invalid_argument("memset: negative size");
  if (bytes > 0 && ptr == 0) throw std::invalid_argument("memset: null pointer");
}

#ifdef MOE_EXT_WITH_KERNELS
// A flat device buffer as Python hands it over: address and element count.
struct Buf {
  std::uintptr_t ptr;
  std::int64_t size;
};

struct KernelEntry {
  const char* name;
  int num_tensors;
  int num_scalars;
  int32_t (*launch)(const Buf* tensors, const double* scalars, bool pdl, cudaStream_t stream);
  void (*load)();
};

}  // namespace moe_ext

// Generated at build time from the exported headers: includes them and defines moe_ext_kernel_table.
#include "kernel_table.inc"

namespace moe_ext {
const auto& kKernelTable = moe_ext_kernel_table;

// Loads every embedded cubin into every device. Call once outside graph capture (the backend does before its
// first launch); launching also loads lazily.
void load_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const KernelEntry& entry : kKernelTable) entry.load();
  });
}

const KernelEntry& find_kernel(const std::string& name) {
  for (const KernelEntry& entry : kKernelTable) {
    if (name == entry.name) return entry;
  }
  throw std::invalid_argument("moe_ext: no kernel named " + name);
}

using TensorArgs = std::vector<std::pair<std::uintptr_t, std::int64_t>>;

// The exported entry points trust their arguments blindly, so everything they cannot get wrong silently is checked
// here, once per launch or once per recorded plan step: argument counts, int32 extents, null and misaligned
// pointers. Shape relations between the buffers are checked by the Python caller (moe_ext/launcher.py).
std::vector<Buf> checked_buffers(const std::string& name, const KernelEntry& entry, const TensorArgs& tensors,
                                 const std::vector<double>& scalars) {
  if (static_cast<int>(tensors.size()) != entry.num_tensors || static_cast<int>(scalars.size()) != entry.num_scalars) {
    throw std::invalid_argument(name + ": expected " + std::to_string(entry.num_tensors) + " tensors and " +
                                std::to_string(entry.num_scalars) + " scalars");
  }
  std::vector<Buf> bufs;
  bufs.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto [ptr, size] = tensors[i];
    const std::string what = name + " tensor " + std::to_string(i);
    if (size < 0 || size > INT32_MAX) {
      throw std::invalid_argument(what + ": " + std::to_string(size) + " elements is outside the int32 range");
    }
    if (size > 0 && ptr == 0) throw std::invalid_argument(what + ": null pointer");
    check_pointer(what, ptr, 4);
    bufs.push_back(Buf{ptr, size});
  }
  return bufs;
}

void launch_entry(const KernelEntry& entry, const std::vector<Buf>& bufs, const std::vector<double>& scalars, bool pdl,
                  cudaStream_t stream) {
  const int32_t ret = entry.launch(bufs.data(), scalars.data(), pdl, stream);
  if (ret != 0) throw std::runtime_error(std::string(entry.name) + ": launch failed with code " + std::to_string(ret));
  check_cuda(cudaGetLastError(), entry.name);
}

// Launches kernel `name` on `stream`.
void launch(const std::string& name, const TensorArgs& tensors, const std::vector<double>& scalars, bool pdl,
            std::uintptr_t stream) {
  const KernelEntry& entry = find_kernel(name);
  const std::vector<Buf> bufs = checked_buffers(name, entry, tensors, scalars);
  load_kernels();
  launch_entry(entry, bufs, scalars, pdl, reinterpret_cast<cudaStream_t>(stream));
}

// A recorded forward (moe_ext/plan.py): its launches and memsets with every argument checked once, replayed with
// the per-call pointers (activations, routing, router weights) patched in. One call from Python per run instead
// of one per kernel: the plan's host cost is what a decode step pays when it is not graph-captured.
class LaunchPlan {
 public:
  // patches: (buffer position, role index); side_stream: 0 = the stream run() is given.
  void add_launch(const std::string& name, const TensorArgs& tensors, const std::vector<double>& scalars, bool pdl,
                  std::uintptr_t side_stream, const std::vector<std::pair<int, int>>& patches) {
    const KernelEntry& entry = find_kernel(name);
    for (const auto& [pos, role] : patches) {
      if (pos < 0 || pos >= entry.num_tensors || role < 0) throw std::invalid_argument(name + ": bad patch");
    }
    steps_.push_back(Step{&entry, checked_buffers(name, entry, tensors, scalars), scalars, pdl, side_stream, patches,
                          0, 0});
  }

  void add_memset(std::uintptr_t ptr, std::int64_t bytes, std::uintptr_t side_stream) {
    check_memset(ptr, bytes);
    steps_.push_back(Step{nullptr, {}, {}, false, side_stream, {}, ptr, bytes});
  }

  void run(const std::vector<std::uintptr_t>& role_pointers, std::uintptr_t stream) {
    load_kernels();
    std::vector<Buf> bufs;
    for (const Step& step : steps_) {
      const auto s = reinterpret_cast<cudaStream_t>(step.side_stream ? step.side_stream : stream);
      if (step.entry == nullptr) {
        memset_on(step.memset_ptr, step.memset_bytes, s);
        continue;
      }
      bufs = step.bufs;
      for (const auto& [pos, role] : step.patches) {
        if (role >= static_cast<int>(role_pointers.size()) || role_pointers[role] == 0 ||
            role_pointers[role] % 4 != 0) {
          throw std::invalid_argument(std::string(step.entry->name) + ": per-call pointer missing or misaligned");
        }
        bufs[pos].ptr = role_pointers[role];
      }
      launch_entry(*step.entry, bufs, step.scalars, step.pdl, s);
    }
  }

  std::size_t size() const { return steps_.size(); }

 private:
  struct Step {
    const KernelEntry* entry;  // nullptr: a memset
    std::vector<Buf> bufs;
    std::vector<double> scalars;
    bool pdl;
    std::uintptr_t side_stream;
    std::vector<std::pair<int, int>> patches;
    std::uintptr_t memset_ptr;
    std::int64_t memset_bytes;
  };
  std::vector<Step> steps_;
};

std::vector<std::string> kernels() {
  std::vector<std::string> names;
  for (const KernelEntry& entry : kKernelTable) names.emplace_back(entry.name);
  return names;
}
#else
std::vector<std::string> kernels() { return {}; }
#endif

// Zeroes `bytes` at `ptr` on `stream` (the fused finalize's output, overlapping GEMM1 on an aux stream): a memset
// node, not a kernel, when captured.
void memset_async(std::uintptr_t ptr, std::int64_t bytes, std::uintptr_t stream) {
  check_memset(ptr, bytes);
  memset_on(ptr, bytes, reinterpret_cast<cudaStream_t>(stream));
}

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
  m.def("launch", &moe_ext::launch, py::arg("name"), py::arg("tensors"), py::arg("scalars"), py::arg("pdl"),
        py::arg("stream"), "launch an exported kernel: tensors are (address, numel) in declaration order");
  py::class_<moe_ext::LaunchPlan>(m, "LaunchPlan")
      .def(py::init<>())
      .def("add_launch", &moe_ext::LaunchPlan::add_launch, py::arg("name"), py::arg("tensors"), py::arg("scalars"),
           py::arg("pdl"), py::arg("side_stream"), py::arg("patches"))
      .def("add_memset", &moe_ext::LaunchPlan::add_memset, py::arg("ptr"), py::arg("bytes"), py::arg("side_stream"))
      .def("run", &moe_ext::LaunchPlan::run, py::arg("role_pointers"), py::arg("stream"))
      .def("__len__", &moe_ext::LaunchPlan::size);
#endif
  m.def("memset_async", &moe_ext::memset_async, py::arg("ptr"), py::arg("bytes"), py::arg("stream"),
        "cudaMemsetAsync(ptr, 0, bytes, stream)");
  m.def("cuda_runtime_version", &moe_ext::cuda_runtime_version);
}
