// NCCL communicators, loaded with dlopen. Groups are non-blocking (ncclConfig_t.blocking = 0) so
// that joins and transfers can time out: every wait polls ncclCommGetAsyncError / the stream and
// aborts the communicator at the deadline instead of hanging a server thread forever.
#include <dlfcn.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kvc/communicator.h"

#ifdef KVC_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace kvc::transfer {
namespace {

#ifdef KVC_HAVE_CUDA

// The NCCL entry points used, resolved once per process.
struct NcclApi {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) get_async_error = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  std::string load_error;  // empty when loaded
};

const NcclApi& Api() {
  static const NcclApi* api = [] {
    auto* a = new NcclApi();
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      a->load_error = absl::StrCat("cannot load libnccl.so.2: ", e ? e : "unknown error");
      return a;
    }
    auto sym = [&](const char* name, auto* fn) {
      *fn = reinterpret_cast<std::remove_reference_t<decltype(*fn)>>(dlsym(h, name));
      if (*fn == nullptr && a->load_error.empty()) {
        a->load_error = absl::StrCat("libnccl.so.2 has no ", name, " (NCCL >= 2.14 needed)");
      }
    };
    sym("ncclGetUniqueId", &a->get_unique_id);
    sym("ncclCommInitRankConfig", &a->init_rank_config);
    sym("ncclCommGetAsyncError", &a->get_async_error);
    sym("ncclCommAbort", &a->abort);
    sym("ncclCommDestroy", &a->destroy);
    sym("ncclSend", &a->send);
    sym("ncclRecv", &a->recv);
    sym("ncclGetErrorString", &a->error_string);
    return a;
  }();
  return *api;
}

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::InternalError(absl::StrCat("nccl: ", what, ": ", Api().error_string(r)));
}

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat("cuda: ", what, ": ", cudaGetErrorString(e)));
}

// Polls until the communicator's pending operation leaves ncclInProgress, or the deadline, or
// `cancel` (may be null) is notified.
absl::Status WaitComm(ncclComm_t comm, absl::Time deadline, const char* what,
                      const absl::Notification* cancel = nullptr) {
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = Api().get_async_error(comm, &state);
    if (r != ncclSuccess) return NcclError(r, what);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(state, what);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("nccl: ", what, ": timed out"));
    }
    if (cancel != nullptr && cancel->HasBeenNotified()) {
      return absl::CancelledError(absl::StrCat("nccl: ", what, ": cancelled"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int device, int rank, ncclComm_t comm, cudaStream_t stream)
      : device_(device), peer_(1 - rank), comm_(comm), stream_(stream) {}
  ~NcclCommunicator() override {
    Close();
    if (staging_ != nullptr) cudaFree(staging_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Send(const void* src, size_t bytes, absl::Duration timeout) override {
    return Transfer(const_cast<void*>(src), bytes, timeout, /*send=*/true);
  }
  absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout) override {
    return Transfer(dst, bytes, timeout, /*send=*/false);
  }

  // A transfer in flight holds mu_ while it polls; it sees close_requested_ and aborts itself.
  void Close() override {
    close_requested_.store(true);
    if (!mu_.TryLock()) return;
    if (comm_ != nullptr) Api().abort(comm_);  // abort, not destroy: never waits for the peer
    comm_ = nullptr;
    mu_.Unlock();
  }

  std::string_view kind() const override { return "nccl"; }

 private:
  absl::Status Transfer(void* buf, size_t bytes, absl::Duration timeout, bool send) {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr || close_requested_.load()) {
      return Fail(absl::CancelledError("nccl: communicator closed"));
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError(e, "set device");
    cudaPointerAttributes attr = {};
    const bool on_device =
        cudaPointerGetAttributes(&attr, buf) == cudaSuccess && attr.type == cudaMemoryTypeDevice;
    cudaGetLastError();
    void* dev = buf;
    if (!on_device) {
      if (bytes > staging_bytes_) {
        if (staging_ != nullptr) cudaFree(staging_);
        staging_ = nullptr;
        staging_bytes_ = 0;
        if (cudaError_t e = cudaMalloc(&staging_, bytes); e != cudaSuccess) {
          return CudaError(e, "staging buffer");
        }
        staging_bytes_ = bytes;
      }
      dev = staging_;
      if (send) {
        if (cudaError_t e = cudaMemcpyAsync(dev, buf, bytes, cudaMemcpyHostToDevice, stream_);
            e != cudaSuccess) {
          return CudaError(e, "stage send buffer");
        }
      }
    }
    const absl::Time deadline = absl::Now() + timeout;
    const ncclResult_t r = send ? Api().send(dev, bytes, ncclChar, peer_, comm_, stream_)
                                : Api().recv(dev, bytes, ncclChar, peer_, comm_, stream_);
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(r, "post"));
    if (absl::Status s = WaitComm(comm_, deadline, send ? "send" : "recv"); !s.ok()) return Fail(s);
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return Fail(CudaError(q, "transfer"));
      if (absl::Status s = WaitComm(comm_, deadline, "transfer"); !s.ok()) return Fail(s);
      if (absl::Now() > deadline) {
        return Fail(absl::DeadlineExceededError("nccl: transfer: peer did not match in time"));
      }
      if (close_requested_.load()) return Fail(absl::CancelledError("nccl: communicator closed"));
      absl::SleepFor(absl::Microseconds(20));
    }
    if (!on_device && !send) {
      if (cudaError_t e = cudaMemcpy(buf, dev, bytes, cudaMemcpyDeviceToHost); e != cudaSuccess) {
        return CudaError(e, "copy received bytes to host");
      }
    }
    return absl::OkStatus();
  }

  // A failed or timed-out operation leaves the group in an unknown state: abort it.
  absl::Status Fail(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ != nullptr) Api().abort(comm_);
    comm_ = nullptr;
    return s;
  }

  const int device_;
  const int peer_;
  std::atomic<bool> close_requested_{false};
  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);
  cudaStream_t stream_;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

class NcclFactory final : public CommunicatorFactory {
 public:
  explicit NcclFactory(int device) : device_(device) {}

  absl::Status Available() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      return absl::UnavailableError("nccl transport unavailable: no CUDA device is visible");
    }
    if (device_ < 0 || device_ >= count) {
      return absl::FailedPreconditionError(absl::StrCat("nccl transport unavailable: device ",
                                                        device_, " is not in [0, ", count, ")"));
    }
    if (!Api().load_error.empty()) {
      return absl::UnavailableError(absl::StrCat("nccl transport unavailable: ", Api().load_error));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> NewUniqueId() override {
    if (absl::Status s = Available(); !s.ok()) return s;
    ncclUniqueId id;
    if (ncclResult_t r = Api().get_unique_id(&id); r != ncclSuccess) {
      return NcclError(r, "ncclGetUniqueId");
    }
    return std::string(id.internal, sizeof(id.internal));
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Join(const std::string& unique_id, int rank,
                                                     absl::Duration timeout,
                                                     const absl::Notification* cancel) override {
    if (absl::Status s = Available(); !s.ok()) return s;
    ncclUniqueId id;
    if (unique_id.size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(absl::StrCat("nccl_unique_id: ", unique_id.size(),
                                                     " bytes, expected ", sizeof(id.internal)));
    }
    if (rank != 0 && rank != 1) {
      return absl::InvalidArgumentError(absl::StrCat("rank: ", rank, " is not 0 or 1"));
    }
    std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError(e, "set device");
    cudaStream_t stream = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "create stream");
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    const ncclResult_t r = Api().init_rank_config(&comm, 2, id, rank, &config);
    absl::Status st = (r == ncclSuccess || r == ncclInProgress)
                          ? WaitComm(comm, absl::Now() + timeout, "join", cancel)
                          : NcclError(r, "ncclCommInitRankConfig");
    if (!st.ok()) {
      if (comm != nullptr) Api().abort(comm);
      cudaStreamDestroy(stream);
      return st;
    }
    return std::unique_ptr<Communicator>(new NcclCommunicator(device_, rank, comm, stream));
  }

 private:
  const int device_;
};

#else  // !KVC_HAVE_CUDA

class NcclFactory final : public CommunicatorFactory {
 public:
  explicit NcclFactory(int) {}
  absl::Status Available() override {
    return absl::UnavailableError("nccl transport unavailable: kvc was built without CUDA");
  }
  absl::StatusOr<std::string> NewUniqueId() override { return Available(); }
  absl::StatusOr<std::unique_ptr<Communicator>> Join(const std::string&, int, absl::Duration,
                                                     const absl::Notification*) override {
    return Available();
  }
};

#endif  // KVC_HAVE_CUDA

}  // namespace

std::unique_ptr<CommunicatorFactory> CreateNcclCommunicatorFactory(int device) {
  return std::make_unique<NcclFactory>(device);
}

}  // namespace kvc::transfer
