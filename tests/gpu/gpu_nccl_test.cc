// The NCCL data path of the transfer service on real GPUs: two ranks in one process (device 0 is
// kvcd's rank 0, device 1 the client's rank 1) join one group and move host and device buffers;
// the fetch direction (rank 0's host blobs into rank 1's host and device buffers); a receive
// without a sender times out instead of hanging. Needs two visible GPUs and
// libnccl.so.2; otherwise main() prints the reason and exits 77 (skipped).
#include <cuda_runtime_api.h>

#include <cstdio>
#include <thread>
#include <vector>

#include "gpu_util.h"
#include "gtest/gtest.h"
#include "kvc/communicator.h"

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

}  // namespace
}  // namespace kvc::transfer

int main(int argc, char** argv) {
  if (!kvc::gpu_testing::DeviceOrSkipMessage()) return kvc::gpu_testing::kSkipExitCode;
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) {
    std::printf("SKIPPED: the NCCL data path needs two GPUs; %d visible\n", count);
    return kvc::gpu_testing::kSkipExitCode;
  }
  const absl::Status a = kvc::transfer::CreateNcclCommunicatorFactory(0)->Available();
  if (!a.ok()) {
    std::printf("SKIPPED: %s\n", std::string(a.message()).c_str());
    return kvc::gpu_testing::kSkipExitCode;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
