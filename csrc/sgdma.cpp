// sgdma: strided ("scatter/gather") host<->device copies through cudaMemcpy2DAsync.
//
// The offload engine keeps the KV cache in pinned host memory, layer-major
// [num_layers, num_blocks, block_bytes]. Moving one block of every layer is a 2D copy: `height`
// rows (layers) of `width` bytes, rows `spitch` bytes apart in the source and `dpitch` bytes apart
// in the destination. A strided torch copy of that runs at 1-3 GB/s on the H200; one
// cudaMemcpy2DAsync runs at the pinned-memory bandwidth (~55 GB/s).
//
// Python binding (nanovllm/kvcache/memcpy2d.py wraps it; use that):
//   memcpy_2d_async(dst, src, dpitch, spitch, width, height, kind, stream)
//     dst, src  tensors whose data_ptr() is the first byte of the 2D region
//     dpitch, spitch, width  bytes; height  rows
//     kind      "h2d" | "d2h" | "d2d" | "h2h" | "default" (cudaMemcpyDefault, inferred by UVA)
//     stream    raw cudaStream_t as an int (torch.cuda.Stream.cuda_stream); 0 = the current torch
//               stream of the CUDA tensor's device
// Bad arguments raise ValueError (std::invalid_argument); CUDA failures raise RuntimeError with
// cudaGetErrorString. A pitch above cudaDevAttrMaxPitch (2^31 - 1 bytes), which cudaMemcpy2D*
// rejects, is served by one cudaMemcpyAsync per row on the same stream (same bytes). The copy is asynchronous with respect to the host: the caller keeps both
// tensors alive and synchronizes the stream (or records an event) before reading the result.

#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace {

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    // Reset the (non-sticky) last error so that later, unrelated checks do not report it.
    (void)cudaGetLastError();
    throw std::runtime_error(cat("sgdma: ", what, " failed: ", cudaGetErrorString(err), " (",
                                 cudaGetErrorName(err), ", code ", static_cast<int>(err), ")"));
  }
}

// The 2D region starts at t.data_ptr(), spans (height - 1) * pitch + width bytes, and must lie
// inside t's storage.
void check_region(const torch::Tensor& t, const char* name, int64_t pitch, int64_t width,
                  int64_t height) {
  if (!t.defined()) throw std::invalid_argument(cat("sgdma: ", name, " is an undefined tensor"));
  if (!t.has_storage()) throw std::invalid_argument(cat("sgdma: ", name, " has no storage"));
  const int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
  const int64_t offset = t.storage_offset() * static_cast<int64_t>(t.element_size());
  const int64_t span = (height - 1) * pitch + width;
  if (offset < 0 || offset + span > nbytes) {
    throw std::invalid_argument(cat("sgdma: the 2D region of ", name, " (byte offset ", offset,
                                    " + (height ", height, " - 1) * pitch ", pitch, " + width ",
                                    width, " = ", offset + span,
                                    " bytes) goes beyond its storage of ", nbytes, " bytes"));
  }
}

bool host_ptr_is_pinned(const void* ptr) {
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // older runtimes report unregistered memory as an error
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

void check_pinned(const torch::Tensor& t, const char* name, const std::string& kind) {
  if (!host_ptr_is_pinned(t.data_ptr())) {
    throw std::invalid_argument(cat("sgdma: ", name, " is a host tensor of a '", kind,
                                    "' copy but is not in pinned (page-locked) memory; allocate "
                                    "it with pin_memory=True"));
  }
}

void check_device(const torch::Tensor& t, const char* name, bool want_cuda,
                  const std::string& kind) {
  if (t.is_cuda() != want_cuda || (!want_cuda && !t.is_cpu())) {
    throw std::invalid_argument(cat("sgdma: kind '", kind, "' needs ", name, " on ",
                                    want_cuda ? "a CUDA device" : "the CPU", ", got ",
                                    t.device().str()));
  }
}

int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// cudaDevAttrMaxPitch per device, queried once (the attribute query is cheap but not free).
int64_t max_pitch_cached(int device) {
  static std::mutex mu;
  static std::unordered_map<int, int64_t> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, cudaDevAttrMaxPitch, device),
             "cudaDeviceGetAttribute(cudaDevAttrMaxPitch)");
  cache.emplace(device, static_cast<int64_t>(value));
  return static_cast<int64_t>(value);
}

void memcpy_2d_async(torch::Tensor dst, torch::Tensor src, int64_t dpitch, int64_t spitch,
                     int64_t width, int64_t height, const std::string& kind, int64_t stream) {
  if (width <= 0) throw std::invalid_argument(cat("sgdma: width must be > 0 bytes, got ", width));
  if (height <= 0) throw std::invalid_argument(cat("sgdma: height must be > 0 rows, got ", height));
  if (dpitch < width)
    throw std::invalid_argument(cat("sgdma: width ", width, " bytes exceeds dpitch ", dpitch, " bytes"));
  if (spitch < width)
    throw std::invalid_argument(cat("sgdma: width ", width, " bytes exceeds spitch ", spitch, " bytes"));

  check_region(dst, "dst", dpitch, width, height);
  check_region(src, "src", spitch, width, height);

  cudaMemcpyKind ckind;
  if (kind == "h2d") {
    ckind = cudaMemcpyHostToDevice;
    check_device(dst, "dst", true, kind);
    check_device(src, "src", false, kind);
    check_pinned(src, "src", kind);
  } else if (kind == "d2h") {
    ckind = cudaMemcpyDeviceToHost;
    check_device(dst, "dst", false, kind);
    check_device(src, "src", true, kind);
    check_pinned(dst, "dst", kind);
  } else if (kind == "d2d") {
    ckind = cudaMemcpyDeviceToDevice;
    check_device(dst, "dst", true, kind);
    check_device(src, "src", true, kind);
  } else if (kind == "h2h") {
    ckind = cudaMemcpyHostToHost;
    check_device(dst, "dst", false, kind);
    check_device(src, "src", false, kind);
  } else if (kind == "default") {
    ckind = cudaMemcpyDefault;
    for (const auto* t : {&dst, &src}) {
      if (!t->is_cuda() && !t->is_cpu())
        throw std::invalid_argument(cat("sgdma: tensors must be on the CPU or a CUDA device, got ",
                                        t->device().str()));
    }
    if (dst.is_cuda() != src.is_cuda()) {
      const torch::Tensor& host = dst.is_cuda() ? src : dst;
      check_pinned(host, dst.is_cuda() ? "src" : "dst", kind);
    }
  } else {
    throw std::invalid_argument(cat("sgdma: kind must be one of 'h2d', 'd2h', 'd2d', 'h2h', "
                                    "'default', got '", kind, "'"));
  }

  // Run on the CUDA tensor's device (dst first); a host-to-host copy uses the current device.
  const torch::Tensor* dev_tensor = dst.is_cuda() ? &dst : (src.is_cuda() ? &src : nullptr);
  c10::cuda::OptionalCUDAGuard guard;
  if (dev_tensor != nullptr) guard.set_device(dev_tensor->device());

  cudaStream_t s;
  if (stream == 0) {
    s = dev_tensor != nullptr
            ? c10::cuda::getCurrentCUDAStream(dev_tensor->device().index()).stream()
            : c10::cuda::getCurrentCUDAStream().stream();
  } else {
    s = reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
  }

  char* dp = static_cast<char*>(dst.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  const int device = dev_tensor != nullptr ? dev_tensor->device().index() : current_device();
  const int64_t limit = max_pitch_cached(device);
  if (height == 1) dpitch = spitch = width;  // one row: the pitches are irrelevant
  if (dpitch <= limit && spitch <= limit) {
    check_cuda(cudaMemcpy2DAsync(dp, static_cast<size_t>(dpitch), sp, static_cast<size_t>(spitch),
                                 static_cast<size_t>(width), static_cast<size_t>(height), ckind, s),
               "cudaMemcpy2DAsync");
  } else {
    // cudaMemcpy2D* rejects pitches above cudaDevAttrMaxPitch (2^31 - 1 bytes on current GPUs),
    // which a large layer-major host cache exceeds (num_blocks * block_bytes). Same bytes, one
    // contiguous cudaMemcpyAsync per row, all queued on the same stream.
    for (int64_t r = 0; r < height; ++r) {
      check_cuda(cudaMemcpyAsync(dp + r * dpitch, sp + r * spitch, static_cast<size_t>(width), ckind, s),
                 "cudaMemcpyAsync (row of a 2D copy whose pitch exceeds cudaDevAttrMaxPitch)");
    }
  }
}

// The largest pitch cudaMemcpy2D* accepts on `device` (cudaDevAttrMaxPitch), in bytes; copies
// with a larger pitch are issued row by row.
int64_t max_pitch(int64_t device) { return max_pitch_cached(static_cast<int>(device)); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cudaMemcpy2DAsync for strided host<->device copies (nanovllm.kvcache.memcpy2d wraps it)";
  m.def("memcpy_2d_async", &memcpy_2d_async, py::arg("dst"), py::arg("src"), py::arg("dpitch"),
        py::arg("spitch"), py::arg("width"), py::arg("height"), py::arg("kind"),
        py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
        "cudaMemcpy2DAsync(dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, height, kind, "
        "stream): pitches and width in bytes, height in rows; stream is a raw cudaStream_t "
        "(0 = current stream). Raises ValueError on bad arguments, RuntimeError on CUDA errors.");
  m.def("max_pitch", &max_pitch, py::arg("device") = 0,
        "cudaDevAttrMaxPitch of the device: the largest dpitch/spitch cudaMemcpy2DAsync accepts.");
}
