// kvcdemo: what a disaggregated prefill/decode pair does with kvcd, on a real (small) model.
//
//   prefill: run the model over a prompt, push every layer's post-RoPE K/V (and the last W queries
//            as the observation window) to kvcd with PutCache, asking for Keyformer eviction +
//            ThinK key-channel pruning;
//   decode:  fetch the compact cache with GetCache (PACKED), continue decoding on it with attention
//            computed directly on the packed bytes, and compare with decoding on the full cache.
//
// The decode comparison is teacher-forced: both caches are fed the same sampled continuation, so
// every step compares the next-token distributions on equal footing.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "kvc/client.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"
#include "kvc/status_macros.h"

ABSL_FLAG(std::string, model, "",
          "llama2.c checkpoint file (e.g. stories260K.bin) or Hugging Face Llama directory "
          "(config.json + safetensors, e.g. SmolLM2-135M-Instruct); required");
ABSL_FLAG(std::string, tokens_file, "",
          "token ids (whitespace-separated) of the text to use instead of sampling one from the "
          "model's BOS token: the first prompt_len are the prompt, the next new_tokens the "
          "continuation (tokenize in Python; nothing is prepended)");
ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvcd address");
ABSL_FLAG(int, prompt_len, 384, "prompt tokens pushed by the prefill client");
ABSL_FLAG(int, new_tokens, 96, "tokens decoded on the compact cache");
ABSL_FLAG(int, obs_window, 32, "observation queries sent per layer (the last W prompt positions)");
ABSL_FLAG(std::string, policy, "keyformer", "token eviction policy");
ABSL_FLAG(double, keep_ratio, 0.5, "fraction of prompt tokens kept per KV head");
ABSL_FLAG(std::string, channel_policy, "think", "key channel pruning policy");
ABSL_FLAG(double, lambda, 0.125, "fraction of key channels pruned");
ABSL_FLAG(int, quant_bits, 0, "quantization bits for the old tokens (0, 2, 4, 8)");
ABSL_FLAG(int, quant_group, 8, "quantization group size (must divide head_dim)");
ABSL_FLAG(uint64_t, seed, 7, "prompt sampling and Keyformer noise seed");

namespace {

using kvc::model::ForwardOutput;
using kvc::model::KvCache;
using kvc::model::Transformer;

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

// log-softmax of logits into out.
void LogSoftmax(const std::vector<float>& logits, std::vector<double>& out) {
  double mx = logits[0];
  for (float x : logits) mx = std::max<double>(mx, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(x - mx);
  const double lse = mx + std::log(sum);
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - lse;
}

int Argmax(const std::vector<float>& v) {
  int best = 0;
  for (int i = 1; i < static_cast<int>(v.size()); ++i) {
    if (v[i] > v[best]) best = i;
  }
  return best;
}

absl::Status Run() {
  const std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) return absl::InvalidArgumentError("--model: required");
  ASSIGN_OR_RETURN(Transformer model, Transformer::Load(model_path));
  const auto& cfg = model.config();
  const int prompt_len = absl::GetFlag(FLAGS_prompt_len);
  const int new_tokens = absl::GetFlag(FLAGS_new_tokens);
  const int window = absl::GetFlag(FLAGS_obs_window);
  if (prompt_len < 2 || prompt_len + new_tokens > cfg.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompt_len + --new_tokens: must fit the ", cfg.seq_len, "-token context"));
  }
  if (window < 0 || window > prompt_len) {
    return absl::InvalidArgumentError("--obs_window: must be in [0, prompt_len]");
  }
  const int hd = cfg.head_dim();
  std::printf("model    %s: %d layers, %d query heads, %d KV heads, head_dim %d, vocab %d\n",
              model_path.c_str(), cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, hd, cfg.vocab_size);

  // ---- Prefill node ----------------------------------------------------------------------------
  // One text (sampled, or from --tokens_file): the first prompt_len tokens are the prompt, the
  // rest is the continuation the decode node is fed (teacher forcing), so both caches are scored
  // on the same real tokens.
  std::vector<int32_t> text;
  if (const std::string path = absl::GetFlag(FLAGS_tokens_file); !path.empty()) {
    std::ifstream in(path);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("--tokens_file: cannot read ", path));
    std::string word;
    while (in >> word && static_cast<int>(text.size()) < prompt_len + new_tokens) {
      int32_t id;
      if (!absl::SimpleAtoi(word, &id) || id < 0 || id >= cfg.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--tokens_file: '", word, "' is not a token id in [0, ", cfg.vocab_size, ")"));
      }
      text.push_back(id);
    }
    if (static_cast<int>(text.size()) < prompt_len + new_tokens) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens_file: ", text.size(),
                                                     " tokens, --prompt_len + --new_tokens needs ",
                                                     prompt_len + new_tokens));
    }
  } else {
    const int32_t bos = cfg.bos_token;
    if (bos < 0) {
      return absl::InvalidArgumentError(
          "the model declares no BOS token to sample a text from; give --tokens_file");
    }
    kvc::model::Sampler sampler(1.0f, absl::GetFlag(FLAGS_seed));
    ASSIGN_OR_RETURN(
        text, model.Generate(absl::MakeConstSpan(&bos, 1), prompt_len + new_tokens - 1, &sampler));
  }
  const std::vector<int32_t> prompt(text.begin(), text.begin() + prompt_len);
  kvc::model::ForwardOptions forward;
  forward.last_logits = 1;  // decoding starts from the prompt's last position
  absl::Time t0 = absl::Now();
  ASSIGN_OR_RETURN(ForwardOutput prefill, model.Forward(prompt, forward));
  const absl::Duration prefill_time = absl::Now() - t0;

  // Observation queries: the last W rows of each query head, [n_heads, W, head_dim].
  std::vector<std::vector<float>> q_obs(cfg.n_layers);
  std::vector<kvc::LayerTensors> tensors(cfg.n_layers);
  for (int l = 0; l < cfg.n_layers; ++l) {
    const auto& p = prefill.layers[l];
    q_obs[l].resize(static_cast<size_t>(cfg.n_heads) * window * hd);
    for (int h = 0; h < cfg.n_heads; ++h) {
      const float* src =
          p.q.data() + (static_cast<size_t>(h) * prompt_len + prompt_len - window) * hd;
      std::copy(src, src + static_cast<size_t>(window) * hd,
                q_obs[l].begin() + static_cast<size_t>(h) * window * hd);
    }
    tensors[l] = {p.k.data(), p.v.data(), window > 0 ? q_obs[l].data() : nullptr};
  }

  kvc::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  ASSIGN_OR_RETURN(auto client, kvc::Client::Create(options));
  ASSIGN_OR_RETURN(kvc::ServerInfo info, client->GetServerInfo());
  std::printf("kvcd     %s at %s, backend %s\n", info.version().c_str(), options.target.c_str(),
              info.backend().c_str());

  kvc::PutHeader header;
  const std::string cache_id = absl::StrCat("demo/seed-", absl::GetFlag(FLAGS_seed));
  header.set_cache_id(cache_id);
  header.set_overwrite(true);
  auto* shape = header.mutable_shape();
  shape->set_num_layers(cfg.n_layers);
  shape->set_num_kv_heads(cfg.n_kv_heads);
  shape->set_num_q_heads(cfg.n_heads);
  shape->set_head_dim(hd);
  shape->set_seq_len(prompt_len);
  shape->set_obs_window(window);
  header.set_dtype(kvcache::v1::DTYPE_F32);
  header.set_layout(kvcache::v1::LAYOUT_HND);
  auto* comp = header.mutable_compression();
  comp->mutable_eviction()->set_policy(absl::GetFlag(FLAGS_policy));
  comp->mutable_eviction()->set_keep_ratio(absl::GetFlag(FLAGS_keep_ratio));
  comp->mutable_eviction()->set_seed(absl::GetFlag(FLAGS_seed));
  comp->mutable_channels()->set_key_policy(absl::GetFlag(FLAGS_channel_policy));
  comp->mutable_channels()->set_key_lambda(absl::GetFlag(FLAGS_lambda));
  comp->mutable_quant()->set_bits(absl::GetFlag(FLAGS_quant_bits));
  comp->mutable_quant()->set_group_size(absl::GetFlag(FLAGS_quant_group));

  t0 = absl::Now();
  ASSIGN_OR_RETURN(kvc::PutResult put, client->PutCache(header, tensors));
  const absl::Duration put_time = absl::Now() - t0;

  // ---- Decode node -----------------------------------------------------------------------------
  t0 = absl::Now();
  ASSIGN_OR_RETURN(kvc::CacheData fetched, client->GetCache(cache_id));
  const absl::Duration get_time = absl::Now() - t0;
  uint64_t fetched_bytes = 0;
  std::vector<kvc::CompactLayer> blobs;
  for (auto& layer : fetched.layers) {
    fetched_bytes += layer.packed.size();
    blobs.push_back(kvc::CompactLayer{kvc::ToByteVector(layer.packed)});
  }
  ASSIGN_OR_RETURN(auto compact,
                   kvc::model::CompactKvCache::Create(cfg, std::move(blobs), nullptr, new_tokens));
  ASSIGN_OR_RETURN(auto full,
                   kvc::model::FullKvCache::FromPrefix(cfg, prefill.layers, prompt_len, prompt_len,
                                                       prompt_len + new_tokens));

  // Teacher-forced decoding of the continuation on both caches. Step t scores the prediction of
  // text[prompt_len + t]; step 0's logits come from the prefill pass for both caches.
  std::vector<float> logits_full(prefill.logits_at(prompt_len - 1),
                                 prefill.logits_at(prompt_len - 1) + cfg.vocab_size);
  std::vector<float> logits_compact = logits_full;
  std::vector<double> lp_full, lp_compact;
  int agree = 0, steps = 0;
  double kl_sum = 0, nll_full = 0, nll_compact = 0;
  absl::Duration decode_time;
  for (int t = 0; t < new_tokens; ++t) {
    const int32_t target = text[prompt_len + t];
    if (t > 0) {
      ++steps;
      agree += Argmax(logits_full) == Argmax(logits_compact);
      LogSoftmax(logits_full, lp_full);
      LogSoftmax(logits_compact, lp_compact);
      double kl = 0;
      for (size_t i = 0; i < lp_full.size(); ++i) {
        kl += std::exp(lp_full[i]) * (lp_full[i] - lp_compact[i]);
      }
      kl_sum += kl;
      nll_full -= lp_full[target];
      nll_compact -= lp_compact[target];
    }
    if (t + 1 == new_tokens) break;
    RETURN_IF_ERROR(model.DecodeStep(target, full.get(), absl::MakeSpan(logits_full)));
    const absl::Time d0 = absl::Now();
    RETURN_IF_ERROR(model.DecodeStep(target, compact.get(), absl::MakeSpan(logits_compact)));
    decode_time += absl::Now() - d0;
  }

  const auto& ev = comp->eviction();
  std::printf(
      "policy   %s keep %.2f + %s lambda %.2f%s\n", ev.policy().c_str(), ev.keep_ratio(),
      comp->channels().key_policy().c_str(), comp->channels().key_lambda(),
      comp->quant().bits() ? absl::StrFormat(" + %d-bit", comp->quant().bits()).c_str() : "");
  std::printf("prefill  %d tokens, forward %.1f ms\n", prompt_len, Ms(prefill_time));
  std::printf("bytes    in %llu (K+V)  stored %llu  fetched %llu  ratio %.2fx\n",
              static_cast<unsigned long long>(put.input_bytes()),
              static_cast<unsigned long long>(put.stored_bytes()),
              static_cast<unsigned long long>(fetched_bytes), put.compression_ratio());
  std::printf("kept     %u of %d tokens per KV head in layer 0\n",
              fetched.info.kept_tokens_size() ? fetched.info.kept_tokens(0) : 0u, prompt_len);
  std::printf(
      "times    PutCache %.2f ms (compress %.2f ms)  GetCache %.2f ms  decode %.2f ms/token\n",
      Ms(put_time), put.compress().total_seconds() * 1e3, Ms(get_time),
      steps ? Ms(decode_time) / steps : 0.0);
  std::printf("fidelity teacher-forced over %d steps: top-1 agreement %.1f%%, mean KL %.4f nats\n",
              steps, steps ? 100.0 * agree / steps : 100.0, steps ? kl_sum / steps : 0.0);
  std::printf(
      "         continuation perplexity %.2f on the full cache, %.2f on the compact cache\n",
      steps ? std::exp(nll_full / steps) : 0.0, steps ? std::exp(nll_compact / steps) : 0.0);
  RETURN_IF_ERROR(client->DeleteCache(cache_id).status());
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "kvcdemo --model FILE_OR_DIR [--target ADDR] [--tokens_file IDS]: prefill -> kvcd -> "
      "decode on the compact cache");
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = Run();
  if (!status.ok()) {
    std::fprintf(stderr, "kvcdemo: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
