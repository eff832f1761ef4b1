// Fuzzes the safetensors reader (kvc/safetensors.h) with arbitrary file bytes. Properties: the
// parser never crashes or reads out of bounds; an accepted file is self-consistent
// (ValidateStFile) and survives a serialize/parse round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/types/span.h"
#include "kvc/safetensors.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "safetensors_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<kvc::StFile> file = kvc::ParseSafetensors(absl::MakeConstSpan(data, size));
  if (!file.ok()) {
    Check(file.status().code() == absl::StatusCode::kInvalidArgument, "error is not INVALID_ARG");
    return 0;
  }
  Check(kvc::ValidateStFile(*file).ok(), "accepted file fails ValidateStFile");
  const std::vector<uint8_t> bytes = kvc::SerializeSafetensors(*file);
  absl::StatusOr<kvc::StFile> back = kvc::ParseSafetensors(bytes);
  Check(back.ok(), "serialized file does not parse");
  Check(back->metadata == file->metadata, "metadata changed in the round trip");
  Check(back->tensors.size() == file->tensors.size(), "tensor count changed");
  for (size_t i = 0; i < file->tensors.size(); ++i) {
    const kvc::StTensor& a = file->tensors[i];
    const kvc::StTensor& b = back->tensors[i];
    Check(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.data == b.data,
          "tensor changed in the round trip");
  }
  return 0;
}
