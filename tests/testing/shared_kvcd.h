// One real kvcd for every test of a suite. Derive the suite's fixture from SharedKvcdTest<Suite>
// and give it the flags:
//
//   class MyTest : public kvc::testing::SharedKvcdTest<MyTest> {
//    public:
//     static std::vector<std::string> KvcdFlags() { return {"--store_bytes=64MiB"}; }
//   };
//
// kvcd_ (the test target's KVCD_PATH, on ephemeral loopback ports) starts before the suite's first
// test and stops after its last. A fixture that overrides SetUp calls SharedKvcdTest::SetUp()
// first and returns on HasFatalFailure(): it fails the test when kvcd did not start.
// Header-only, for test binaries that define KVCD_PATH and link GoogleTest.
#ifndef KVC_TESTS_TESTING_SHARED_KVCD_H_
#define KVC_TESTS_TESTING_SHARED_KVCD_H_

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/kvcd_process.h"

#ifndef KVCD_PATH
#error "shared_kvcd.h needs KVCD_PATH, the kvcd binary the test runs"
#endif

namespace kvc::testing {

template <class Suite>
class SharedKvcdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    KvcdProcess::Options opts;
    opts.binary = KVCD_PATH;
    opts.flags = Suite::KvcdFlags();
    auto p = KvcdProcess::Start(opts);
    ASSERT_TRUE(p.ok()) << p.status();
    kvcd_ = p->release();
  }
  static void TearDownTestSuite() {
    delete kvcd_;
    kvcd_ = nullptr;
  }
  void SetUp() override { ASSERT_NE(kvcd_, nullptr) << "kvcd did not start"; }

  inline static KvcdProcess* kvcd_ = nullptr;
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_SHARED_KVCD_H_
