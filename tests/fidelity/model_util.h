// Helpers for the fidelity tests: locating the real model, writing synthetic checkpoints.
#ifndef KVC_TESTS_FIDELITY_MODEL_UTIL_H_
#define KVC_TESTS_FIDELITY_MODEL_UTIL_H_

#include <unistd.h>

#include "gtest/gtest.h"

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace kvc::testing {

// Path of the real model from $KVC_MODEL, or "" when unset or the file is missing.
inline std::string ModelPath() {
  const char* env = std::getenv("KVC_MODEL");
  if (env == nullptr || *env == '\0') return "";
  std::ifstream f(env, std::ios::binary);
  return f ? std::string(env) : std::string();
}

#define KVC_REQUIRE_MODEL(path_var)                                                        \
  const std::string path_var = ::kvc::testing::ModelPath();                                \
  if (path_var.empty()) {                                                                  \
    GTEST_SKIP() << "model not found: set KVC_MODEL to a llama2.c checkpoint (ctest sets " \
                    "it to shared/models/stories260K.bin beside the source tree)";         \
  }

// Writes a llama2.c checkpoint: the header, then `floats` deterministic values in [-scale, scale],
// then `extra_bytes` zero bytes, into the test's temporary directory. Returns the path.
inline std::string WriteCheckpoint(const std::string& name, const std::vector<int32_t>& header,
                                   size_t floats, size_t extra_bytes = 0, float scale = 0.1f) {
  const std::string path =
      ::testing::TempDir() + "kvc_" + name + "_" + std::to_string(::getpid()) + ".bin";
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(header.data()),
            static_cast<std::streamsize>(header.size() * sizeof(int32_t)));
  for (size_t i = 0; i < floats; ++i) {
    // Deterministic, varied weights: a cheap LCG mapped to [-scale, scale].
    const uint32_t r = static_cast<uint32_t>(i * 2654435761u + 12345u);
    const float f = scale * (static_cast<float>(r % 2001u) / 1000.0f - 1.0f);
    out.write(reinterpret_cast<const char*>(&f), sizeof(f));
  }
  const std::vector<char> zeros(extra_bytes, 0);
  out.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  return path;
}

}  // namespace kvc::testing

#endif  // KVC_TESTS_FIDELITY_MODEL_UTIL_H_
