// Test tool for hf_logits_test.py: runs kvc's reference transformer on a checkpoint (Hugging
// Face directory or llama2.c file) and writes its logits as raw little-endian float32.
//
//   hf_logits_dump MODEL TOKENS OUT [DECODE_TOKENS]
//
// TOKENS is a text file of token ids (whitespace-separated). OUT receives Forward's logits
// [S, vocab], then, when DECODE_TOKENS = N > 0, DecodeStep's logits [N, vocab] for the first N
// tokens decoded one by one on a full cache. Prints "vocab S N" on success.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s MODEL TOKENS OUT [DECODE_TOKENS]\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[2]);
  std::vector<int32_t> tokens{std::istream_iterator<int32_t>(in), {}};
  const int decode = argc == 5 ? std::atoi(argv[4]) : 0;
  absl::StatusOr<kvc::model::Transformer> model = kvc::model::Transformer::Load(argv[1]);
  if (!model.ok()) {
    std::fprintf(stderr, "load: %s\n", model.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<kvc::model::ForwardOutput> fwd = model->Forward(tokens);
  if (!fwd.ok()) {
    std::fprintf(stderr, "forward: %s\n", fwd.status().ToString().c_str());
    return 1;
  }
  const int vocab = model->config().vocab_size;
  if (decode < 0 || decode > static_cast<int>(tokens.size())) {
    std::fprintf(stderr, "DECODE_TOKENS: %d is outside [0, %zu]\n", decode, tokens.size());
    return 2;
  }
  std::vector<float> decoded(static_cast<size_t>(decode) * vocab);
  if (decode > 0) {
    auto cache = kvc::model::FullKvCache::Create(model->config(), decode);
    if (!cache.ok()) return 1;
    for (int t = 0; t < decode; ++t) {
      absl::Status s = model->DecodeStep(
          tokens[t], cache->get(), absl::MakeSpan(&decoded[static_cast<size_t>(t) * vocab], vocab));
      if (!s.ok()) {
        std::fprintf(stderr, "decode: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  std::ofstream out(argv[3], std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(fwd->logits.data()),
            static_cast<std::streamsize>(fwd->logits.size() * sizeof(float)));
  out.write(reinterpret_cast<const char*>(decoded.data()),
            static_cast<std::streamsize>(decoded.size() * sizeof(float)));
  if (!out.flush()) {
    std::fprintf(stderr, "cannot write %s\n", argv[3]);
    return 1;
  }
  std::printf("%d %zu %d\n", vocab, tokens.size(), decode);
  return 0;
}
