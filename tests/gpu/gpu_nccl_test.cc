// The NCCL data path of the transfer service on real GPUs: two ranks in one process (device 0 is
// kvcd's rank 0, device 1 the client's rank 1) join one group and move host and device buffers;
// the fetch direction (rank 0's host blobs into rank 1's host and device buffers); growing
// staging; a send ordered after its producer's event; Close aborting a receive in flight; a peer
// that dies mid-transfer; a receive without a sender times out instead of hanging. Needs two
// visible GPUs and libnccl.so.2; otherwise main() prints the reason and exits 77 (skipped).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "gpu_util.h"
#include "gtest/gtest.h"
#include "kvc/communicator.h"
#include "nccl_test_kernels.h"

namespace kvc::transfer {
namespace {

struct Pair {
  std::unique_ptr<Communicator> rank0, rank1;
};

Pair JoinPair() {
  auto f0 = CreateNcclCommunicatorFactory(0);
  auto f1 = CreateNcclCommunicatorFactory(1);
  const std::string id = f0->NewUniqueId().value();
  absl::StatusOr<std::unique_ptr<Communicator>> c1;
  std::thread t([&] { c1 = f1->Join(id, 1, absl::Seconds(30), nullptr); });
  absl::StatusOr<std::unique_ptr<Communicator>> c0 = f0->Join(id, 0, absl::Seconds(30), nullptr);
  t.join();
  EXPECT_TRUE(c0.ok()) << c0.status();
  EXPECT_TRUE(c1.ok()) << c1.status();
  Pair p;
  if (c0.ok()) p.rank0 = *std::move(c0);
  if (c1.ok()) p.rank1 = *std::move(c1);
  return p;
}

TEST(NcclDataPath, HostAndDeviceBuffersArriveIntact) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  ASSERT_NE(p.rank1, nullptr);
  EXPECT_EQ(p.rank0->kind(), "nccl");
  const size_t n = size_t{48} << 20;
  std::vector<uint8_t> src(n), dst(n, 0);
  for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  // Host -> host (both sides staged through device memory).
  absl::Status send_status;
  std::thread sender([&] { send_status = p.rank1->Send(src.data(), n, absl::Seconds(30)); });
  ASSERT_TRUE(p.rank0->Recv(dst.data(), n, absl::Seconds(30)).ok());
  sender.join();
  ASSERT_TRUE(send_status.ok()) << send_status;
  EXPECT_EQ(dst, src);
  // Device (GPU 1) -> device (GPU 0), timed.
  void *dsrc = nullptr, *ddst = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dsrc, n), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dsrc, src.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&ddst, n), cudaSuccess);
  ASSERT_EQ(cudaMemset(ddst, 0, n), cudaSuccess);
  const absl::Time t0 = absl::Now();
  std::thread dsender([&] { send_status = p.rank1->Send(dsrc, n, absl::Seconds(30)); });
  ASSERT_TRUE(p.rank0->Recv(ddst, n, absl::Seconds(30)).ok());
  dsender.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  ASSERT_TRUE(send_status.ok()) << send_status;
  std::vector<uint8_t> back(n, 0);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(back.data(), ddst, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, src);
  std::printf("nccl device->device: %zu MiB in %.3f ms (%.1f GB/s, includes the first-use setup)\n",
              n >> 20, secs * 1e3, n / secs / 1e9);
  cudaFree(ddst);
  cudaSetDevice(1);
  cudaFree(dsrc);
}

// The fetch direction (kvcd's rank 0 sends a stored blob, host memory, to the client's rank 1):
// into a host buffer as TransferClient::Fetch receives it, and into a device buffer on GPU 1,
// several layers in a row on one group, as a fetch sends them.
TEST(NcclDataPath, FetchDirectionHostBlobsArriveOnHostAndDevice) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  ASSERT_NE(p.rank1, nullptr);
  const size_t sizes[] = {size_t{3} << 20, 12345, size_t{1} << 20};
  for (size_t n : sizes) {
    std::vector<uint8_t> blob(n), host(n, 0);
    for (size_t i = 0; i < n; ++i) blob[i] = static_cast<uint8_t>(i * 17 + n);
    absl::Status send_status;
    std::thread sender([&] { send_status = p.rank0->Send(blob.data(), n, absl::Seconds(30)); });
    ASSERT_TRUE(p.rank1->Recv(host.data(), n, absl::Seconds(30)).ok());
    sender.join();
    ASSERT_TRUE(send_status.ok()) << send_status;
    EXPECT_EQ(host, blob) << n << " bytes to host";

    void* dev = nullptr;
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dev, n), cudaSuccess);
    ASSERT_EQ(cudaMemset(dev, 0, n), cudaSuccess);
    std::thread dsender([&] { send_status = p.rank0->Send(blob.data(), n, absl::Seconds(30)); });
    ASSERT_TRUE(p.rank1->Recv(dev, n, absl::Seconds(30)).ok());
    dsender.join();
    ASSERT_TRUE(send_status.ok()) << send_status;
    std::vector<uint8_t> back(n, 0);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(back.data(), dev, n, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, blob) << n << " bytes to device";
    cudaFree(dev);
  }
}

TEST(NcclDataPath, ReceiveWithoutSenderTimesOut) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  std::vector<uint8_t> buf(1024);
  const absl::Status s = p.rank0->Recv(buf.data(), buf.size(), absl::Milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // The group was aborted: later operations fail fast.
  EXPECT_FALSE(p.rank0->Recv(buf.data(), buf.size(), absl::Milliseconds(100)).ok());
  p.rank1->Close();
}

// Host sends of growing sizes: the staging buffer grows in stream order between them.
TEST(NcclDataPath, StagingGrowsBetweenTransfers) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  ASSERT_NE(p.rank1, nullptr);
  for (size_t n : {size_t{1000}, size_t{1} << 20, size_t{5000}, size_t{24} << 20}) {
    std::vector<uint8_t> src(n), dst(n, 0);
    for (size_t i = 0; i < n; ++i) src[i] = static_cast<uint8_t>(i * 7 + n);
    absl::Status send_status;
    std::thread sender([&] { send_status = p.rank1->Send(src.data(), n, absl::Seconds(30)); });
    const absl::Status r = p.rank0->Recv(dst.data(), n, absl::Seconds(30));
    sender.join();
    ASSERT_TRUE(r.ok()) << r;
    ASSERT_TRUE(send_status.ok()) << send_status;
    EXPECT_EQ(dst, src) << n;
  }
}

// A device buffer still being written by a kernel on another stream: SendAfter with the event
// recorded after that kernel sends the final bytes (a send not ordered after it would read the
// zeros it starts from: the kernel spins for 300 ms before it writes).
TEST(NcclDataPath, SendAfterWaitsForTheProducersEvent) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  ASSERT_NE(p.rank1, nullptr);
  const size_t n = size_t{8} << 20;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  uint8_t* src = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&src), n), cudaSuccess);
  ASSERT_EQ(cudaMemset(src, 0, n), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t producer = nullptr;
  cudaEvent_t done = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), cudaSuccess);
  ASSERT_EQ(gpu_testing::LaunchSlowFill(src, n, 300, producer), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(done, producer), cudaSuccess);
  std::vector<uint8_t> got(n, 0);
  absl::Status send_status;
  std::thread sender([&] {
    send_status = p.rank1->SendAfter(src, n, static_cast<void*>(done), absl::Seconds(30));
  });
  const absl::Status r = p.rank0->Recv(got.data(), n, absl::Seconds(30));
  sender.join();
  ASSERT_TRUE(r.ok()) << r;
  ASSERT_TRUE(send_status.ok()) << send_status;
  size_t wrong = 0;
  for (size_t i = 0; i < n; ++i) wrong += got[i] != static_cast<uint8_t>(i * 131 + 7);
  EXPECT_EQ(wrong, 0u) << "bytes sent before the producer wrote them";
  cudaSetDevice(1);
  cudaStreamSynchronize(producer);
  cudaEventDestroy(done);
  cudaStreamDestroy(producer);
  cudaFree(src);
}

// Close from another thread aborts a receive in flight (ncclCommAbort): it returns CANCELLED long
// before its timeout, and destroying the communicator afterwards does not hang.
TEST(NcclDataPath, CloseAbortsAReceiveInFlight) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  std::vector<uint8_t> buf(size_t{1} << 20);
  absl::Status recv_status;
  const absl::Time t0 = absl::Now();
  std::thread receiver(
      [&] { recv_status = p.rank0->Recv(buf.data(), buf.size(), absl::Seconds(60)); });
  absl::SleepFor(absl::Milliseconds(200));  // let it post (a Close before the post also cancels)
  p.rank0->Close();
  receiver.join();
  EXPECT_EQ(recv_status.code(), absl::StatusCode::kCancelled) << recv_status;
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
  p.rank0.reset();  // the destructor waits for nothing now, and frees the staging
  p.rank1->Close();
}

// The peer's group is aborted (its process died) while this rank waits for its bytes: the
// receive ends with an error status within its timeout instead of hanging.
TEST(NcclDataPath, PeerThatDiesMidTransferEndsItWithinTheTimeout) {
  Pair p = JoinPair();
  ASSERT_NE(p.rank0, nullptr);
  ASSERT_NE(p.rank1, nullptr);
  std::vector<uint8_t> buf(size_t{16} << 20);
  absl::Status recv_status;
  const absl::Time t0 = absl::Now();
  std::thread receiver(
      [&] { recv_status = p.rank0->Recv(buf.data(), buf.size(), absl::Seconds(3)); });
  absl::SleepFor(absl::Milliseconds(100));
  p.rank1.reset();  // closes and aborts rank 1's side without sending
  receiver.join();
  EXPECT_FALSE(recv_status.ok());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
}

}  // namespace
}  // namespace kvc::transfer

int main(int argc, char** argv) {
  return kvc::gpu_testing::RunGpuTests(argc, argv, [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    if (count < 2) {
      std::printf("SKIPPED: the NCCL data path needs two GPUs; %d visible\n", count);
      return false;
    }
    const absl::Status a = kvc::transfer::CreateNcclCommunicatorFactory(0)->Available();
    if (!a.ok()) {
      std::printf("SKIPPED: %s\n", std::string(a.message()).c_str());
      return false;
    }
    return true;
  });
}
