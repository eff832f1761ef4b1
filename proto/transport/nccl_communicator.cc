// NCCL communicators, loaded with dlopen. Groups are non-blocking (ncclConfig_t.blocking = 0) so
// that joins and transfers can time out: every wait polls ncclCommGetAsyncError / the stream and
// aborts the communicator at the deadline (or on Close, or when NCCL reports the peer gone)
// instead of hanging a server thread forever.
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <vector>

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
// `cancel` (may be null) is notified, or `closing` (may be null) is set.
absl::Status WaitComm(ncclComm_t comm, absl::Time deadline, const char* what,
                      const absl::Notification* cancel = nullptr,
                      const std::atomic<bool>* closing = nullptr) {
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
    if (closing != nullptr && closing->load()) {
      return absl::CancelledError(absl::StrCat("nccl: ", what, ": communicator closed"));
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int device, int rank, ncclComm_t comm, cudaStream_t stream, cudaMemPool_t pool)
      : device_(device), peer_(1 - rank), comm_(comm), stream_(stream), pool_(pool) {}

  // Closes (an operation in flight sees it within ~50 us and aborts the group), waits for that
  // operation to return, then releases the staging buffer, the stream and the pool.
  ~NcclCommunicator() override {
    Close();
    absl::MutexLock lock(&mu_);
    AbortLocked();
    cudaSetDevice(device_);
    if (staging_ != nullptr) cudaFreeAsync(staging_, stream_);
    cudaStreamSynchronize(stream_);  // the aborted group's kernels have ended
    cudaStreamDestroy(stream_);
    cudaMemPoolDestroy(pool_);
  }

  absl::Status Send(const void* src, size_t bytes, absl::Duration timeout) override {
    return Transfer(const_cast<void*>(src), bytes, nullptr, timeout, /*send=*/true);
  }
  absl::Status SendAfter(const void* src, size_t bytes, const void* ready_event,
                         absl::Duration timeout) override {
    return Transfer(const_cast<void*>(src), bytes, ready_event, timeout, /*send=*/true);
  }
  absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout) override {
    return Transfer(dst, bytes, nullptr, timeout, /*send=*/false);
  }

  // An operation in flight holds mu_ and polls close_requested_: it aborts the group itself
  // (NCCL calls on one communicator must not run concurrently). Otherwise the group is aborted
  // here.
  void Close() override {
    close_requested_.store(true);
    if (!mu_.TryLock()) return;
    AbortLocked();
    mu_.Unlock();
  }

  std::string_view kind() const override { return "nccl"; }

 private:
  absl::Status Transfer(void* buf, size_t bytes, const void* ready_event, absl::Duration timeout,
                        bool send) {
    absl::MutexLock lock(&mu_);
    absl::Status s = TransferLocked(buf, bytes, ready_event, timeout, send);
    // A Close that arrived as the operation completed: abort now, not at the next call.
    if (close_requested_.load()) AbortLocked();
    return s;
  }

  absl::Status TransferLocked(void* buf, size_t bytes, const void* ready_event,
                              absl::Duration timeout, bool send)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ == nullptr || close_requested_.load()) {
      return Fail(absl::CancelledError("nccl: communicator closed"));
    }
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) return CudaError(e, "set device");
    const absl::Time deadline = absl::Now() + timeout;
    cudaPointerAttributes attr = {};
    const bool known = cudaPointerGetAttributes(&attr, buf) == cudaSuccess;
    cudaGetLastError();
    const bool on_device =
        known && (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
    if (on_device && attr.type == cudaMemoryTypeDevice && attr.device != device_) {
      return absl::InvalidArgumentError(absl::StrCat("nccl: buffer is memory of CUDA device ",
                                                     attr.device, ", the group's is ", device_));
    }
    void* dev = buf;
    if (on_device) {
      if (ready_event != nullptr) {
        // The producer's work, on whatever stream, before the data plane reads the buffer.
        if (cudaError_t e = cudaStreamWaitEvent(
                stream_, static_cast<cudaEvent_t>(const_cast<void*>(ready_event)), 0);
            e != cudaSuccess) {
          return CudaError(e, "wait for the producer's event");
        }
      }
    } else {
      if (absl::Status st = ReserveStaging(bytes); !st.ok()) return st;
      dev = staging_;
      if (send) {
        if (cudaError_t e = cudaMemcpyAsync(dev, buf, bytes, cudaMemcpyHostToDevice, stream_);
            e != cudaSuccess) {
          return Fail(CudaError(e, "stage send buffer"));
        }
      }
    }
    const ncclResult_t r = send ? Api().send(dev, bytes, ncclChar, peer_, comm_, stream_)
                                : Api().recv(dev, bytes, ncclChar, peer_, comm_, stream_);
    if (r != ncclSuccess && r != ncclInProgress) return Fail(NcclError(r, "post"));
    if (absl::Status st =
            WaitComm(comm_, deadline, send ? "send" : "recv", nullptr, &close_requested_);
        !st.ok()) {
      return Fail(st);
    }
    if (absl::Status st = WaitStream(deadline, "transfer"); !st.ok()) return Fail(st);
    if (!on_device && !send) {
      if (cudaError_t e = cudaMemcpyAsync(buf, dev, bytes, cudaMemcpyDeviceToHost, stream_);
          e != cudaSuccess) {
        return Fail(CudaError(e, "copy received bytes to host"));
      }
      if (absl::Status st = WaitStream(deadline, "copy to host"); !st.ok()) return Fail(st);
    }
    return absl::OkStatus();
  }

  // Grows the staging buffer to `bytes` in stream order: the old buffer is freed and the new one
  // allocated on the communicator's stream (its pool keeps nothing cached), without waiting for
  // other streams.
  absl::Status ReserveStaging(size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (bytes <= staging_bytes_) return absl::OkStatus();
    if (staging_ != nullptr) {
      if (cudaError_t e = cudaFreeAsync(staging_, stream_); e != cudaSuccess) {
        return Fail(CudaError(e, "free staging buffer"));
      }
      staging_ = nullptr;
      staging_bytes_ = 0;
    }
    void* p = nullptr;
    if (cudaError_t e = cudaMallocFromPoolAsync(&p, bytes, pool_, stream_); e != cudaSuccess) {
      cudaGetLastError();
      const absl::Status st = CudaError(e, "staging buffer");
      return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(st.message()) : st;
    }
    staging_ = p;
    staging_bytes_ = bytes;
    return absl::OkStatus();
  }

  // Waits for the work queued on the stream, watching the group's asynchronous error (a peer
  // that died), the deadline and Close.
  absl::Status WaitStream(absl::Time deadline, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return CudaError(q, what);
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = Api().get_async_error(comm_, &state);
      if (r != ncclSuccess) return NcclError(r, what);
      if (state != ncclSuccess && state != ncclInProgress) return NcclError(state, what);
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("nccl: ", what, ": the peer did not complete it in time"));
      }
      if (close_requested_.load()) return absl::CancelledError("nccl: communicator closed");
      absl::SleepFor(absl::Microseconds(20));
    }
  }

  void AbortLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ != nullptr) Api().abort(comm_);  // abort, not destroy: never waits for the peer
    comm_ = nullptr;
  }

  // A failed or timed-out operation leaves the group in an unknown state: abort it.
  absl::Status Fail(absl::Status s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    AbortLocked();
    return s;
  }

  const int device_;
  const int peer_;
  std::atomic<bool> close_requested_{false};
  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_);
  const cudaStream_t stream_;
  const cudaMemPool_t pool_;
  void* staging_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t staging_bytes_ ABSL_GUARDED_BY(mu_) = 0;
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
    // The staging buffer's own pool: stream-ordered growth, and nothing cached once freed.
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device_;
    cudaMemPool_t pool = nullptr;
    if (cudaError_t e = cudaMemPoolCreate(&pool, &props); e != cudaSuccess) {
      cudaStreamDestroy(stream);
      return CudaError(e, "create staging pool");
    }
    // With both ranks in one process NCCL may read or write the peer's buffer directly over P2P
    // ("P2P/direct pointer"); pool memory, unlike cudaMalloc's, is not made accessible to peer
    // devices by cudaDeviceEnablePeerAccess, so grant it here to every device that can reach this
    // one (a no-op across processes, where NCCL uses its own buffers).
    if (absl::Status a = GrantPeerAccess(pool); !a.ok()) {
      cudaMemPoolDestroy(pool);
      cudaStreamDestroy(stream);
      return a;
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
      cudaMemPoolDestroy(pool);
      return st;
    }
    return std::unique_ptr<Communicator>(new NcclCommunicator(device_, rank, comm, stream, pool));
  }

 private:
  absl::Status GrantPeerAccess(cudaMemPool_t pool) const {
    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
      return CudaError(e, "count devices");
    }
    std::vector<cudaMemAccessDesc> access;
    for (int d = 0; d < count; ++d) {
      int can = 0;
      if (d == device_ || cudaDeviceCanAccessPeer(&can, d, device_) != cudaSuccess || !can) {
        continue;
      }
      cudaMemAccessDesc desc = {};
      desc.location.type = cudaMemLocationTypeDevice;
      desc.location.id = d;
      desc.flags = cudaMemAccessFlagsProtReadWrite;
      access.push_back(desc);
    }
    cudaGetLastError();
    if (access.empty()) return absl::OkStatus();
    if (cudaError_t e = cudaMemPoolSetAccess(pool, access.data(), access.size());
        e != cudaSuccess) {
      return CudaError(e, "grant peer devices access to the staging pool");
    }
    return absl::OkStatus();
  }

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
