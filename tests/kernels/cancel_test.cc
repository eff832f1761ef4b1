// Cancellation (kvc/cancel.h): the token's semantics, and engine work that stops at its next row
// block or key chunk once the token reads as cancelled, for every policy and both backends'
// entry points on the CPU.
#include "kvc/cancel.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/selection.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

TEST(CancelTokenTest, FirstReasonWins) {
  CancelToken t;
  EXPECT_FALSE(t.cancelled());
  EXPECT_TRUE(t.status().ok());
  EXPECT_FALSE(Cancelled(nullptr));
  t.Cancel(absl::AbortedError("deleted"));
  t.Cancel(absl::UnavailableError("shutting down"));
  EXPECT_TRUE(t.cancelled());
  EXPECT_TRUE(Cancelled(&t));
  EXPECT_EQ(t.status(), absl::AbortedError("deleted"));
  CancelToken ok;
  ok.Cancel(absl::OkStatus());
  EXPECT_EQ(ok.status().code(), absl::StatusCode::kCancelled);
}

TEST(CancelTokenTest, DeadlineReadsAsDeadlineExceeded) {
  CancelToken t;
  t.SetDeadline(absl::Now() + absl::Hours(1), "not yet");
  EXPECT_FALSE(t.cancelled());
  t.SetDeadline(absl::Now() - absl::Seconds(1), "ran past --compress_timeout_seconds=1");
  EXPECT_TRUE(t.cancelled());
  EXPECT_EQ(t.status(), absl::DeadlineExceededError("ran past --compress_timeout_seconds=1"));
  // A reason already set is kept.
  CancelToken u;
  u.Cancel(absl::CancelledError("client gone"));
  u.SetDeadline(absl::Now() - absl::Seconds(1), "late");
  EXPECT_EQ(u.status(), absl::CancelledError("client gone"));
}

// One layer with random contents, float32 HND.
struct Layer {
  std::vector<float> k, v, q;
  RopeParams rope;
  LayerInput in;
  Layer(int hkv, int hq, int s, int d, int w) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    k.resize(static_cast<size_t>(hkv) * s * d);
    v.resize(k.size());
    q.resize(static_cast<size_t>(hq) * w * d);
    for (auto* x : {&k, &v, &q}) {
      for (float& f : *x) f = normal(rng);
    }
    in.shape.num_kv_heads = hkv;
    in.shape.num_q_heads = hq;
    in.shape.seq_len = s;
    in.shape.head_dim = d;
    in.shape.obs_window = w;
    in.dtype = DType::kF32;
    in.k = k.data();
    in.v = v.data();
    in.q_obs = w > 0 ? q.data() : nullptr;
    in.rope = &rope;
  }
};

CompressionSpec Spec(const std::string& text) {
  absl::StatusOr<CompressionSpec> s = ParseSpecString(text);
  EXPECT_TRUE(s.ok()) << text;
  return *s;
}

std::unique_ptr<Backend> Cpu() {
  BackendOptions bo;
  bo.num_threads = 2;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCpuBackend(bo);
  EXPECT_TRUE(b.ok());
  return *std::move(b);
}

TEST(CancelTest, ACancelledTokenStopsEveryPolicyBeforeItsWork) {
  std::unique_ptr<Backend> backend = Cpu();
  Layer l(2, 4, 512, 32, 16);
  CancelToken token;
  token.Cancel(absl::AbortedError("cache deleted"));
  l.in.cancel = &token;
  for (const std::string& name : EvictionPolicyNames()) {
    const std::string spec = name == "none" ? "full" : name + ":0.5";
    absl::StatusOr<CompactLayer> out = backend->Compress(l.in, Spec(spec), nullptr);
    EXPECT_EQ(out.status(), absl::AbortedError("cache deleted")) << spec;
  }
  for (const char* spec : {"snapkv:0.5+think:0.5", "h2o:0.5+vthink:0.5+q4"}) {
    EXPECT_EQ(backend->Compress(l.in, Spec(spec), nullptr).status().code(),
              absl::StatusCode::kAborted)
        << spec;
  }
  EXPECT_EQ(ScoreTokens(l.in, Spec("h2o:0.5").eviction).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(SelectTokens(l.in, Spec("expected:0.5")).status().code(), absl::StatusCode::kAborted);
  // Without the token the same input compresses.
  l.in.cancel = nullptr;
  EXPECT_TRUE(backend->Compress(l.in, Spec("h2o:0.5"), nullptr).ok());
}

// Heavy layers stop within a block once their deadline passes: the cancelled call takes a small
// part of what the whole call takes (both measured here, on the same machine). Timed in this
// process's CPU time, which other processes' load does not stretch, and tried up to three times:
// the deadline itself is wall-clock, so a burst of load between the two calls can still move it.
TEST(CancelTest, RunningWorkStopsWithinABlock) {
  std::unique_ptr<Backend> backend = Cpu();
  struct Heavy {
    std::string spec;
    int hkv, hq, s, d, w;
  };
  auto cpu_seconds = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  };
  for (const Heavy& h :
       {Heavy{"keyformer:0.5", 2, 8, 4096, 64, 4096}, Heavy{"expected:0.5", 2, 32, 8192, 128, 64},
        Heavy{"knorm:0.5+vthink:0.5", 2, 8, 4096, 64, 4096}}) {
    Layer l(h.hkv, h.hq, h.s, h.d, h.w);
    const CompressionSpec spec = Spec(h.spec);
    double full = 0, cut = 0;
    for (int attempt = 1; attempt <= 3; ++attempt) {
      l.in.cancel = nullptr;
      const auto w0 = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      ASSERT_TRUE(backend->Compress(l.in, spec, nullptr).ok()) << h.spec;
      full = cpu_seconds() - c0;
      const double full_wall =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      CancelToken token;
      token.SetDeadline(absl::Now() + absl::Seconds(full_wall / 10), "stopped");
      l.in.cancel = &token;
      const double c1 = cpu_seconds();
      absl::StatusOr<CompactLayer> out = backend->Compress(l.in, spec, nullptr);
      cut = cpu_seconds() - c1;
      EXPECT_EQ(out.status(), absl::DeadlineExceededError("stopped")) << h.spec;
      std::printf("%s, try %d: whole %.3f s of CPU, cancelled at %.3f s (wall) took %.3f s\n",
                  h.spec.c_str(), attempt, full, full_wall / 10, cut);
      if (cut < full / 2) break;
    }
    EXPECT_LT(cut, full / 2) << h.spec << ": whole " << full << " s of CPU, cancelled took " << cut
                             << " s (3 tries)";
  }
}

}  // namespace
}  // namespace kvc
