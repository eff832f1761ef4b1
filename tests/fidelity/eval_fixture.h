// A test fixture holding what every fidelity test on the real model needs: the model, a CPU
// backend and a FidelityEval over sampled sequences.
#ifndef KVC_TESTS_FIDELITY_EVAL_FIXTURE_H_
#define KVC_TESTS_FIDELITY_EVAL_FIXTURE_H_

#include <cstdint>
#include <memory>

#include "fidelity/model_util.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/transformer.h"

namespace kvc::fidelity {

class EvalFixture : public ::testing::Test {
 protected:
  // Loads the model ($KVC_MODEL) and a CPU backend and builds eval_ with `options`. Skips when the
  // model is absent; callers check IsSkipped() || HasFatalFailure() before going on.
  void SetUpEval(const RunOptions& options) {
    KVC_REQUIRE_MODEL(path);
    auto model = model::Transformer::Load(path);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<model::Transformer>(*std::move(model));
    auto backend = CreateCpuBackend({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    auto eval = FidelityEval::Create(model_.get(), options, backend_.get());
    ASSERT_TRUE(eval.ok()) << eval.status();
    eval_ = *std::move(eval);
  }

  // The small run most tests use: 2 sequences, P = 96, C = 16, W = 16, sampling seed `seed`.
  static RunOptions SmallRun(uint64_t seed) {
    RunOptions o;
    o.num_sequences = 2;
    o.prefix_len = 96;
    o.continuation = 16;
    o.obs_window = 16;
    o.seed = seed;
    return o;
  }

  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<FidelityEval> eval_;
};

}  // namespace kvc::fidelity

#endif  // KVC_TESTS_FIDELITY_EVAL_FIXTURE_H_
