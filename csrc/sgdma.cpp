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
//   memcpy_2d_moves_async(device, host, device_offsets, host_offsets, to_host, device_pitch,
//                         host_pitch, width, height, stream)
//     one such copy per i between byte device_offsets[i] / host_offsets[i] after the tensors'
//     data_ptr() (int64 CPU tensors), to the host where to_host[i]: a step's block moves in one
//     call, in order
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

void check_shape(int64_t dpitch, int64_t spitch, int64_t width, int64_t height) {
  if (width <= 0) throw std::invalid_argument(cat("sgdma: width must be > 0 bytes, got ", width));
  if (height <= 0) throw std::invalid_argument(cat("sgdma: height must be > 0 rows, got ", height));
  if (dpitch < width)
    throw std::invalid_argument(cat("sgdma: width ", width, " bytes exceeds dpitch ", dpitch, " bytes"));
  if (spitch < width)
    throw std::invalid_argument(cat("sgdma: width ", width, " bytes exceeds spitch ", spitch, " bytes"));
}

// The cudaMemcpyKind of `kind` after checking the tensors' devices (and that the host tensor of a
// host<->device copy is pinned at its data_ptr()).
cudaMemcpyKind resolve_kind(const torch::Tensor& dst, const torch::Tensor& src, const std::string& kind) {
  if (kind == "h2d") {
    check_device(dst, "dst", true, kind);
    check_device(src, "src", false, kind);
    check_pinned(src, "src", kind);
    return cudaMemcpyHostToDevice;
  }
  if (kind == "d2h") {
    check_device(dst, "dst", false, kind);
    check_device(src, "src", true, kind);
    check_pinned(dst, "dst", kind);
    return cudaMemcpyDeviceToHost;
  }
  if (kind == "d2d") {
    check_device(dst, "dst", true, kind);
    check_device(src, "src", true, kind);
    return cudaMemcpyDeviceToDevice;
  }
  if (kind == "h2h") {
    check_device(dst, "dst", false, kind);
    check_device(src, "src", false, kind);
    return cudaMemcpyHostToHost;
  }
  if (kind == "default") {
    for (const auto* t : {&dst, &src}) {
      if (!t->is_cuda() && !t->is_cpu())
        throw std::invalid_argument(cat("sgdma: tensors must be on the CPU or a CUDA device, got ",
                                        t->device().str()));
    }
    if (dst.is_cuda() != src.is_cuda()) {
      const torch::Tensor& host = dst.is_cuda() ? src : dst;
      check_pinned(host, dst.is_cuda() ? "src" : "dst", kind);
    }
    return cudaMemcpyDefault;
  }
  throw std::invalid_argument(cat("sgdma: kind must be one of 'h2d', 'd2h', 'd2d', 'h2h', "
                                  "'default', got '", kind, "'"));
}

// The stream to copy on: `stream`, or for 0 the current torch stream of the CUDA tensor's device.
cudaStream_t resolve_stream(const torch::Tensor* dev_tensor, int64_t stream) {
  if (stream != 0) return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream));
  return dev_tensor != nullptr ? c10::cuda::getCurrentCUDAStream(dev_tensor->device().index()).stream()
                               : c10::cuda::getCurrentCUDAStream().stream();
}

void issue(char* dp, const char* sp, int64_t dpitch, int64_t spitch, int64_t width, int64_t height,
           cudaMemcpyKind ckind, cudaStream_t s, int64_t limit) {
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

void memcpy_2d_async(torch::Tensor dst, torch::Tensor src, int64_t dpitch, int64_t spitch,
                     int64_t width, int64_t height, const std::string& kind, int64_t stream) {
  check_shape(dpitch, spitch, width, height);
  check_region(dst, "dst", dpitch, width, height);
  check_region(src, "src", spitch, width, height);
  const cudaMemcpyKind ckind = resolve_kind(dst, src, kind);

  // Run on the CUDA tensor's device (dst first); a host-to-host copy uses the current device.
  const torch::Tensor* dev_tensor = dst.is_cuda() ? &dst : (src.is_cuda() ? &src : nullptr);
  c10::cuda::OptionalCUDAGuard guard;
  if (dev_tensor != nullptr) guard.set_device(dev_tensor->device());
  const cudaStream_t s = resolve_stream(dev_tensor, stream);
  const int device = dev_tensor != nullptr ? dev_tensor->device().index() : current_device();
  issue(static_cast<char*>(dst.data_ptr()), static_cast<const char*>(src.data_ptr()), dpitch, spitch, width,
        height, ckind, s, max_pitch_cached(device));
}

// Block moves between a CUDA tensor and a pinned host tensor, in order on one stream: copy i moves
// `height` rows of `width` bytes between byte device_offsets[i] after device.data_ptr() (rows
// device_pitch apart) and byte host_offsets[i] after host.data_ptr() (rows host_pitch apart), to
// the host when to_host[i], else to the device. The caller checks that every region lies inside its
// tensor's storage (memcpy2d.py); here each host region's first byte must be pinned.
void memcpy_2d_moves_async(torch::Tensor device, torch::Tensor host, torch::Tensor device_offsets,
                           torch::Tensor host_offsets, torch::Tensor to_host, int64_t device_pitch,
                           int64_t host_pitch, int64_t width, int64_t height, int64_t stream) {
  check_shape(device_pitch, host_pitch, width, height);
  if (!device.is_cuda()) throw std::invalid_argument(cat("sgdma: device must be a CUDA tensor, got ", device.device().str()));
  if (!host.is_cpu()) throw std::invalid_argument(cat("sgdma: host must be a CPU tensor, got ", host.device().str()));
  for (const auto* t : {&device_offsets, &host_offsets}) {
    if (!t->is_cpu() || t->scalar_type() != torch::kInt64 || t->dim() != 1 || !t->is_contiguous())
      throw std::invalid_argument("sgdma: device_offsets and host_offsets must be contiguous 1-D int64 CPU tensors");
  }
  if (!to_host.is_cpu() || to_host.scalar_type() != torch::kBool || to_host.dim() != 1 || !to_host.is_contiguous())
    throw std::invalid_argument("sgdma: to_host must be a contiguous 1-D bool CPU tensor");
  const int64_t n = device_offsets.numel();
  if (host_offsets.numel() != n || to_host.numel() != n)
    throw std::invalid_argument(cat("sgdma: ", n, " device_offsets, ", host_offsets.numel(), " host_offsets and ",
                                    to_host.numel(), " to_host flags"));
  const int64_t* doff = device_offsets.data_ptr<int64_t>();
  const int64_t* hoff = host_offsets.data_ptr<int64_t>();
  const bool* up = to_host.data_ptr<bool>();
  char* dbase = static_cast<char*>(device.data_ptr());
  char* hbase = static_cast<char*>(host.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    if (!host_ptr_is_pinned(hbase + hoff[i]))
      throw std::invalid_argument(cat("sgdma: copy ", i, ": host byte offset ", hoff[i], " is not in pinned "
                                      "(registered) memory; register or pin the host tensor before copying"));
  }
  c10::cuda::CUDAGuard guard(device.device());
  const cudaStream_t s = resolve_stream(&device, stream);
  const int64_t limit = max_pitch_cached(device.device().index());
  for (int64_t i = 0; i < n; ++i) {
    if (up[i])
      issue(hbase + hoff[i], dbase + doff[i], host_pitch, device_pitch, width, height, cudaMemcpyDeviceToHost, s, limit);
    else
      issue(dbase + doff[i], hbase + hoff[i], device_pitch, host_pitch, width, height, cudaMemcpyHostToDevice, s, limit);
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
  m.def("memcpy_2d_moves_async", &memcpy_2d_moves_async, py::arg("device"), py::arg("host"),
        py::arg("device_offsets"), py::arg("host_offsets"), py::arg("to_host"), py::arg("device_pitch"),
        py::arg("host_pitch"), py::arg("width"), py::arg("height"), py::arg("stream") = 0,
        py::call_guard<py::gil_scoped_release>(),
        "2D copies between device.data_ptr() + device_offsets[i] and host.data_ptr() + host_offsets[i] "
        "(int64 CPU tensors of byte offsets), to the host where to_host[i] (bool CPU tensor), in order "
        "on one stream.");
  m.def("max_pitch", &max_pitch, py::arg("device") = 0,
        "cudaDevAttrMaxPitch of the device: the largest dpitch/spitch cudaMemcpy2DAsync accepts.");
}
