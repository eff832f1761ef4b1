// kvcctl end to end against the real kvcd: put a generated safetensors file, get it back DENSE
// (bit-exact without compression) and PACKED, stat/ls/rm, bench, and exit codes 0/1/2.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvc/compact.h"
#include "kvc/safetensors.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using testing::KvcdProcess;

struct CtlRun {
  int code = -1;
  std::string out;  // stdout and stderr together
};

class KvcctlTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    KvcdProcess::Options o;
    o.binary = KVCD_PATH;
    auto p = KvcdProcess::Start(o);
    ASSERT_TRUE(p.ok()) << p.status();
    kvcd_ = p->release();
    char tmpl[] = "/tmp/kvcctl_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = new std::string(tmpl);
  }
  static void TearDownTestSuite() {
    delete kvcd_;
    if (dir_ != nullptr) std::system(("rm -rf '" + *dir_ + "'").c_str());
    delete dir_;
  }

  static CtlRun Kvcctl(const std::string& args, bool with_target = true) {
    const std::string cmd = absl::StrCat(
        KVCCTL_PATH, " ", args, with_target ? " --target=" + kvcd_->address() : "", " 2>&1");
    CtlRun r;
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) return r;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) r.out.append(buf, n);
    const int status = pclose(f);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
  }

  // 2 layers, fp16, K/V [2, 256, 64], Q_obs [4, 8, 64], written as kvcctl put expects.
  static std::string WriteInput(const std::string& name, testing::TestCache* cache) {
    *cache = testing::MakeTestCache(name, testing::Shape(2, 2, 4, 64, 256, 8), pb::DTYPE_F16,
                                    pb::LAYOUT_HND, 42);
    StFile f;
    for (int l = 0; l < 2; ++l) {
      const std::string p = absl::StrCat("layer.", l, ".");
      f.tensors.push_back({p + "k", StDType::kF16, {2, 256, 64}, cache->k[l]});
      f.tensors.push_back({p + "v", StDType::kF16, {2, 256, 64}, cache->v[l]});
      f.tensors.push_back({p + "q_obs", StDType::kF16, {4, 8, 64}, cache->q[l]});
    }
    const std::string path = *dir_ + "/" + name + ".safetensors";
    EXPECT_TRUE(WriteSafetensors(path, f).ok());
    return path;
  }

  static KvcdProcess* kvcd_;
  static std::string* dir_;
};
KvcdProcess* KvcctlTest::kvcd_ = nullptr;
std::string* KvcctlTest::dir_ = nullptr;

TEST_F(KvcctlTest, PutGetDenseIsBitExactThenStatLsRm) {
  testing::TestCache cache;
  const std::string in = WriteInput("ctl1", &cache);
  CtlRun r = Kvcctl("put " + in);  // id defaults to the file name
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("put ctl1"), std::string::npos) << r.out;

  const std::string dense = *dir_ + "/dense.safetensors";
  r = Kvcctl("get ctl1 " + dense + " --format=dense");
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = ReadSafetensors(dense);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata["format"], "kvc-dense-v1");
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("layer.", l, ".");
    const StTensor* k = f->Find(p + "k");
    const StTensor* v = f->Find(p + "v");
    const StTensor* pos = f->Find(p + "positions");
    ASSERT_TRUE(k && v && pos);
    EXPECT_EQ(k->shape, (std::vector<int64_t>{2, 256, 64}));
    EXPECT_EQ(k->dtype, StDType::kF16);
    EXPECT_TRUE(k->data == cache.k[l]);
    EXPECT_TRUE(v->data == cache.v[l]);
    EXPECT_EQ(pos->dtype, StDType::kI32);
    EXPECT_EQ(pos->shape, (std::vector<int64_t>{2, 256}));
    for (int i = 0; i < 512; ++i) {
      int32_t x;
      std::memcpy(&x, pos->data.data() + 4 * i, 4);
      ASSERT_EQ(x, i % 256);
    }
  }

  r = Kvcctl("stat ctl1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("seq_len=256"), std::string::npos) << r.out;
  r = Kvcctl("ls --prefix=ctl");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("ctl1"), std::string::npos) << r.out;
  r = Kvcctl("put " + in);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("ALREADY_EXISTS"), std::string::npos) << r.out;
  EXPECT_EQ(Kvcctl("put " + in + " --overwrite").code, 0);
  r = Kvcctl("rm ctl1");
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvcctl("stat ctl1");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("NOT_FOUND"), std::string::npos) << r.out;
  r = Kvcctl("rm ctl1");
  EXPECT_EQ(r.code, 1) << r.out;
}

TEST_F(KvcctlTest, PackedWithCompressionParses) {
  testing::TestCache cache;
  const std::string in = WriteInput("ctl2", &cache);
  CtlRun r = Kvcctl("put " + in + " --id=ctl2 --policy=snapkv --ratio=0.5 --lambda=0.25");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string packed = *dir_ + "/packed.safetensors";
  r = Kvcctl("get ctl2 " + packed);
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = ReadSafetensors(packed);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata["format"], "kvc-compact-v1");
  for (int l = 0; l < 2; ++l) {
    const StTensor* t = f->Find(absl::StrCat("layer.", l, ".packed"));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->dtype, StDType::kU8);
    auto view = CompactLayerView::Parse(t->data);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->desc(0).n_kept, 128);
    EXPECT_EQ(view->desc(0).key_channels, 48);
  }
}

// --ada asks for head-adaptive budgets: the layer keeps H * B tokens, heads differently many, and
// the dense file pads the shorter heads with position -1.
TEST_F(KvcctlTest, AdaptiveBudgetsPadDensePositions) {
  testing::TestCache cache;
  const std::string in = WriteInput("ctl3", &cache);
  CtlRun r = Kvcctl("put " + in + " --id=ctl3 --policy=h2o --ratio=0.5 --ada=0");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string dense = *dir_ + "/ada.safetensors";
  r = Kvcctl("get ctl3 " + dense + " --format=dense");
  ASSERT_EQ(r.code, 0) << r.out;
  auto f = ReadSafetensors(dense);
  ASSERT_TRUE(f.ok()) << f.status();
  const int heads = static_cast<int>(cache.header.shape().num_kv_heads());
  const int budget = static_cast<int>(cache.header.shape().seq_len()) / 2;
  for (int l = 0; l < 2; ++l) {
    const StTensor* t = f->Find(absl::StrCat("layer.", l, ".positions"));
    ASSERT_NE(t, nullptr);
    ASSERT_EQ(t->shape.size(), 2u);
    const int kept = static_cast<int>(t->shape[1]);
    int real = 0;
    for (int i = 0; i < heads * kept; ++i) {
      int32_t p;
      std::memcpy(&p, t->data.data() + 4 * i, 4);
      real += p >= 0;
    }
    EXPECT_EQ(real, heads * budget);
  }
  EXPECT_EQ(Kvcctl("put " + in + " --id=ctl4 --policy=h2o --ada=1.5").code, 2);

  // --xlayer: one budget over both layers (the request keeps layers * heads * budget tokens);
  // without --ada kvcd refuses it, naming the field.
  r = Kvcctl("put " + in + " --id=ctl5 --policy=h2o --ratio=0.5 --ada=0 --xlayer");
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvcctl("get ctl5 " + dense + " --format=dense");
  ASSERT_EQ(r.code, 0) << r.out;
  f = ReadSafetensors(dense);
  ASSERT_TRUE(f.ok()) << f.status();
  int real = 0;
  for (int l = 0; l < 2; ++l) {
    const StTensor* t = f->Find(absl::StrCat("layer.", l, ".positions"));
    ASSERT_NE(t, nullptr);
    for (size_t i = 0; i < t->data.size() / 4; ++i) {
      int32_t p;
      std::memcpy(&p, t->data.data() + 4 * i, 4);
      real += p >= 0;
    }
  }
  EXPECT_EQ(real, 2 * heads * budget);
  r = Kvcctl("put " + in + " --id=ctl6 --policy=h2o --ratio=0.5 --xlayer");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("layer_adaptive"), std::string::npos) << r.out;
}

// No observation queries: keydiff from K alone, expected attention from layer.{l}.q_stats with
// the RoPE given by flags, and the value-aware flags; bad values are usage errors (exit 2).
TEST_F(KvcctlTest, PutWithoutQueriesKeyDiffAndExpectedFromStatistics) {
  testing::TestCache cache = testing::MakeTestCache("ctl-w0", testing::Shape(2, 2, 4, 64, 256, 0),
                                                    pb::DTYPE_F16, pb::LAYOUT_HND, 7);
  StFile kv, stats;
  std::vector<uint8_t> st(4 * (64 + 64 * 64) * sizeof(float), 0);
  for (int h = 0; h < 4; ++h) {  // mean e_h, identity covariance
    float* p = reinterpret_cast<float*>(st.data()) + h * (64 + 64 * 64);
    p[h] = 1.0f;
    for (int c = 0; c < 64; ++c) p[64 + c * 64 + c] = 1.0f;
  }
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("layer.", l, ".");
    for (StFile* f : {&kv, &stats}) {
      f->tensors.push_back({p + "k", StDType::kF16, {2, 256, 64}, cache.k[l]});
      f->tensors.push_back({p + "v", StDType::kF16, {2, 256, 64}, cache.v[l]});
    }
    stats.tensors.push_back({p + "q_stats", StDType::kF32, {4, 64 + 64 * 64}, st});
  }
  const std::string kv_path = *dir_ + "/w0.safetensors", st_path = *dir_ + "/w0s.safetensors";
  ASSERT_TRUE(WriteSafetensors(kv_path, kv).ok());
  ASSERT_TRUE(WriteSafetensors(st_path, stats).ok());
  CtlRun r = Kvcctl("put " + kv_path + " --id=w0-keydiff --policy=keydiff --ratio=0.25");
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvcctl("stat w0-keydiff");
  EXPECT_NE(r.out.find("kept_tokens:  64,64\n"), std::string::npos) << r.out;
  r = Kvcctl("put " + st_path +
             " --id=w0-exp --policy=expected --ratio=0.5 --rope_pairs=interleaved"
             " --value_weight=add --value_eps=0.1 --horizon=4");
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvcctl("stat w0-exp");
  EXPECT_NE(r.out.find("kept_tokens:  128,128\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("query_stats: true"), std::string::npos) << r.out;
  // Without the RoPE the server refuses expected attention, naming header.rope.
  r = Kvcctl("put " + st_path + " --id=w0-norope --policy=expected --ratio=0.5");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("header.rope"), std::string::npos) << r.out;
  EXPECT_EQ(Kvcctl("put " + kv_path + " --id=x --policy=h2o --value_eps=-2").code, 2);
  EXPECT_EQ(Kvcctl("put " + kv_path + " --id=x --policy=h2o --horizon=-1").code, 2);
  EXPECT_EQ(Kvcctl("put " + kv_path + " --id=x --policy=expected --rope_pairs=diagonal").code, 2);
}

// kvzip's q_stats are its query rows' log-masses, F32 [Hq, W]; the moments' shape is refused.
TEST_F(KvcctlTest, PutKVzipWithRowLogMasses) {
  testing::TestCache cache = testing::MakeTestCache("ctl-kvzip", testing::Shape(2, 2, 4, 64, 96, 96),
                                                    pb::DTYPE_F16, pb::LAYOUT_HND, 9);
  StFile good, bad;
  std::vector<uint8_t> masses(4 * 96 * sizeof(float), 0), moments(4 * (64 + 64 * 64) * 4, 0);
  for (int l = 0; l < 2; ++l) {
    const std::string p = absl::StrCat("layer.", l, ".");
    for (StFile* f : {&good, &bad}) {
      f->tensors.push_back({p + "k", StDType::kF16, {2, 96, 64}, cache.k[l]});
      f->tensors.push_back({p + "v", StDType::kF16, {2, 96, 64}, cache.v[l]});
      f->tensors.push_back({p + "q_obs", StDType::kF16, {4, 96, 64}, cache.q[l]});
    }
    good.tensors.push_back({p + "q_stats", StDType::kF32, {4, 96}, masses});
    bad.tensors.push_back({p + "q_stats", StDType::kF32, {4, 64 + 64 * 64}, moments});
  }
  const std::string good_path = *dir_ + "/kz.safetensors", bad_path = *dir_ + "/kzb.safetensors";
  ASSERT_TRUE(WriteSafetensors(good_path, good).ok());
  ASSERT_TRUE(WriteSafetensors(bad_path, bad).ok());
  CtlRun r = Kvcctl("put " + good_path + " --id=kz --policy=kvzip --ratio=0.25 --ada=0 --xlayer");
  ASSERT_EQ(r.code, 0) << r.out;
  r = Kvcctl("stat kz");
  EXPECT_NE(r.out.find("query_stats: true"), std::string::npos) << r.out;
  r = Kvcctl("put " + bad_path + " --id=kzb --policy=kvzip --ratio=0.25");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("[Hq, W]"), std::string::npos) << r.out;
}

TEST_F(KvcctlTest, ExitCodes) {
  EXPECT_EQ(Kvcctl("", false).code, 2);
  EXPECT_EQ(Kvcctl("frobnicate", false).code, 2);
  EXPECT_EQ(Kvcctl("--help", false).code, 0);
  EXPECT_EQ(Kvcctl("put --help", false).code, 0);
  CtlRun r = Kvcctl("stat x --bogus=1");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--bogus"), std::string::npos) << r.out;
  // Values are parsed by the flags' own (Abseil) parsers; a flag another command takes is unknown.
  r = Kvcctl("stat x --timeout=abc");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("Illegal value 'abc' specified for flag 'timeout'"), std::string::npos)
      << r.out;
  r = Kvcctl("stat x --concurrency=3");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("unknown flag --concurrency"), std::string::npos) << r.out;
  EXPECT_EQ(Kvcctl("put a.safetensors --ratio=2").code, 2);
  EXPECT_EQ(Kvcctl("put a.safetensors --bits=3").code, 2);
  EXPECT_EQ(Kvcctl("get onlyone").code, 2);
  EXPECT_EQ(Kvcctl("get a b --format=sparse").code, 2);
  r = Kvcctl("get a b --format=contiguous");  // the RoPE convention is not guessed
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--rope_pairs"), std::string::npos) << r.out;
  EXPECT_EQ(Kvcctl("stat x --chunk_mib=9").code, 1);  // rejected by the client options
  EXPECT_EQ(Kvcctl("bench").code, 2);                 // neither --requests nor --duration
  r = Kvcctl("stat x --target=127.0.0.1:1", false);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("UNAVAILABLE"), std::string::npos) << r.out;
  r = Kvcctl("put " + *dir_ + "/missing.safetensors");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("NOT_FOUND"), std::string::npos) << r.out;
  // A file whose tensors are not named layer.{l}.k/.v/.q_obs.
  StFile bad;
  bad.tensors.push_back({"weights", StDType::kF16, {2, 2}, std::vector<uint8_t>(8)});
  const std::string bad_path = *dir_ + "/bad.safetensors";
  ASSERT_TRUE(WriteSafetensors(bad_path, bad).ok());
  r = Kvcctl("put " + bad_path);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("INVALID_ARGUMENT"), std::string::npos) << r.out;
}

TEST_F(KvcctlTest, BenchReportsThroughputAndLatency) {
  CtlRun r = Kvcctl(
      "bench --concurrency=2 --requests=4 --layers=2 --tokens=256 --kv_heads=2 "
      "--q_heads=4 --head_dim=64 --window=8");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("put         4 ok"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("get         4 ok"), std::string::npos) << r.out;
  // Percentiles are ordered (a regression: max was once read before the sort).
  for (const char* op : {"put ", "get "}) {
    const size_t line = r.out.find(op);
    ASSERT_NE(line, std::string::npos) << r.out;
    const size_t lat = r.out.find("latency ms", line);
    ASSERT_NE(lat, std::string::npos) << r.out;
    double p50 = -1, p90 = -1, p99 = -1, max = -1;
    ASSERT_EQ(std::sscanf(r.out.c_str() + lat, "latency ms p50 %lf p90 %lf p99 %lf max %lf", &p50,
                          &p90, &p99, &max),
              4)
        << r.out;
    EXPECT_GT(p50, 0);
    EXPECT_LE(p50, p90);
    EXPECT_LE(p90, p99);
    EXPECT_LE(p99, max);
  }
  // Nothing left behind.
  r = Kvcctl("ls --prefix=bench-");
  ASSERT_EQ(r.code, 0);
  EXPECT_EQ(r.out.find("bench-"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace kvc
