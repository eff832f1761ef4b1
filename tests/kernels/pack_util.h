// Test helpers for the compact-format tests (pack, parse, export, packed attention): random layers
// in any dtype/layout with their dtype-rounded float values, random selections, the dense rows a
// compact layer should hold, and a naive double-precision attention reference.
#ifndef KVC_TESTS_KERNELS_PACK_UTIL_H_
#define KVC_TESTS_KERNELS_PACK_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/selection.h"
#include "kvc/spec.h"

namespace kvc::testing_pack {

// Owns K and V of one layer. kf/vf hold the exact (dtype-rounded) values in HND order.
struct PackLayerData {
  LayerShape shape;
  DType dtype = DType::kF32;
  Layout layout = Layout::kHND;
  std::vector<uint8_t> k, v;
  std::vector<float> kf, vf;
  LayerInput input() const;
  float K(int h, int t, int c) const;
  float V(int h, int t, int c) const;
};

// Uniform values in [-amp, amp] rounded to dtype, stored in `layout`.
PackLayerData MakePackLayer(int hkv, int seq_len, int head_dim, DType dtype, Layout layout,
                            uint32_t seed, float amp = 2.0f);

// `budget` random distinct positions per head, ascending.
TokenSelection RandomTokens(int hkv, int seq_len, int budget, std::mt19937* rng);
// tk key and tv value channels per head, random and ascending (all channels when t == D).
ChannelSelection RandomChannels(int hkv, int head_dim, int tk, int tv, std::mt19937* rng);

// What a compact head should hold, as floats [n_kept, D]: kept rows in position order; rows
// before n_kept - r keep only the selected channels (others zero), the last r rows are full.
void ExpectedHeadRows(const PackLayerData& layer, const TokenSelection& tokens,
                      const ChannelSelection& channels, int h, int n_recent,
                      std::vector<float>* keys, std::vector<float>* values);

// Naive attention in double. keys/values: per KV head [n_h, D] dense rows (n_h may differ by
// head); q [Hq, n_q, D]; k_new/v_new [Hkv, n_new, D]; query i sees new tokens
// [0, n_new - n_q + i]. Returns [Hq, n_q, D].
std::vector<float> ReferenceAttention(const std::vector<std::vector<float>>& keys,
                                      const std::vector<std::vector<float>>& values, int head_dim,
                                      int num_q_heads, int n_q, const std::vector<float>& q,
                                      int n_new, const std::vector<float>& k_new,
                                      const std::vector<float>& v_new);

std::vector<float> UniformFloats(size_t n, float amp, std::mt19937* rng);

// How many of the n elements of dtype dt at a and b differ in their bytes, two NaNs counting as
// equal (a NaN's payload may differ between two paths that both keep it NaN).
size_t ElementsDiffering(const uint8_t* a, const uint8_t* b, DType dt, size_t n);

// Joins single-head blobs (same header fields otherwise) into one multi-head blob, so tests can
// build layers whose heads keep different counts, which PackLayer never produces.
std::vector<uint8_t> ConcatHeads(const std::vector<std::vector<uint8_t>>& single_head_blobs);

}  // namespace kvc::testing_pack

#endif  // KVC_TESTS_KERNELS_PACK_UTIL_H_
