// Fuzzes the llama2.c checkpoint loader (kvc/model/checkpoint.h) with arbitrary file bytes. The
// loader reads a path, so each input is written to a private temporary file first. Properties:
// no crash or out-of-bounds read; errors are INVALID_ARGUMENT; an accepted checkpoint's tensors
// all lie inside the loaded weights, and one decode step of the model over it stays in bounds.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvc/model/checkpoint.h"
#include "kvc/model/transformer.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "checkpoint_fuzz: %s\n", what);
    std::abort();
  }
}

const std::string& InputPath() {
  static const std::string* path = [] {
    const char* dir = std::getenv("TMPDIR");
    return new std::string(std::string(dir != nullptr ? dir : "/tmp") + "/kvc_checkpoint_fuzz." +
                           std::to_string(getpid()) + ".bin");
  }();
  return *path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = InputPath();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  Check(f != nullptr, "cannot create the temporary input file");
  Check(std::fwrite(data, 1, size, f) == size && std::fclose(f) == 0, "cannot write it");
  absl::StatusOr<kvc::model::Transformer> model = kvc::model::Transformer::Load(path);
  std::remove(path.c_str());
  if (!model.ok()) {
    Check(model.status().code() == absl::StatusCode::kInvalidArgument, "error is not INVALID_ARG");
    return 0;
  }
  const kvc::model::LlamaConfig& c = model->config();
  Check(kvc::model::ValidateConfig(c).ok(), "accepted an invalid config");
  // The forward pass reads every tensor the header announced: ASan flags any that run past the
  // weights. One token keeps the work proportional to the (small) file.
  const int32_t token = static_cast<int32_t>(size % static_cast<size_t>(c.vocab_size));
  absl::StatusOr<kvc::model::ForwardOutput> out = model->Forward({&token, 1});
  Check(out.ok(), "forward pass failed on an accepted checkpoint");
  return 0;
}
