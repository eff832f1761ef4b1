// The integer paths of the decode attention (the arithmetic is in attention_int.h): query
// quantization, the query layouts the vector kernels read, the portable kernels (the reference
// the vector ones equal), and the choice among them.
#include "cpu/attention_int.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/quantize.h"
#include "cpu/attention_int_rows.h"
#include "kvc/cpu_isa.h"

namespace kvc::cpu::attn {
namespace {

// Weights or queries whose largest magnitude is below this count as zero (their reciprocal
// scale would overflow).
constexpr float kTiny = 0x1p-100f;

// The fixed pairwise sum of 16 partial sums (attention_int.h).
float Tree16(const float* p) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

// round(clamp(x, lo, hi)) with the vector kernels' semantics: NaN becomes lo.
inline int RoundClamp(float x, float lo, float hi) {
  x = x > lo ? x : lo;
  x = x < hi ? x : hi;
  return static_cast<int>(std::nearbyint(x));
}

// The portable preparation of one token group's queries (the arithmetic of attention_int.h step by
// step): qi [nq, n], alpha [nq, blocks] and the centred qz [nq].
void PrepareKeysPortable(const float* qm, const float* scale, const float* zero, int nq, int n,
                         int bits, int8_t* qi, float* alpha, float* qz) {
  const int B = 32 / bits, blocks = (n + B - 1) / B;
  const float mid = static_cast<float>((1 << bits) - 1) / 2.0f;
  std::vector<float> qs(n);
  for (int a = 0; a < nq; ++a) {
    const float* q = qm + static_cast<size_t>(a) * n;
    float zp[16] = {}, cp[16] = {};
    for (int c = 0; c < n; ++c) {
      qs[c] = q[c] * scale[c];
      zp[c % 16] = std::fma(q[c], zero[c], zp[c % 16]);
    }
    int8_t* qa = qi + static_cast<size_t>(a) * n;
    for (int b = 0; b < blocks; ++b) {
      const int c0 = b * B, c1 = std::min(n, c0 + B);
      float amax = 0.0f;
      for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(qs[c]));
      const bool live = amax >= kTiny;
      const float inv = live ? 127.0f / amax : 0.0f;
      const float al = live ? amax / 127.0f : 0.0f;
      alpha[static_cast<size_t>(a) * blocks + b] = al;
      for (int c = c0; c < c1; ++c) {
        qa[c] = static_cast<int8_t>(RoundClamp(qs[c] * inv, -127, 127));
        cp[c % 16] += std::fma(-al, static_cast<float>(qa[c]), qs[c]);
      }
    }
    qz[a] = std::fma(mid, Tree16(cp), Tree16(zp));
  }
}

}  // namespace

void ScoreKeyCodesInt(const Rows& K, int j0, int j1, const float* qm, int nq, float* s, int ss) {
  if (j1 <= j0 || nq <= 0) return;
  isa::KeyChunkArgs a;
  a.codes = K.base;
  a.row_bytes = K.row_bytes;
  a.bits = K.bits;
  a.n = K.n;
  a.group = K.group;
  a.scale = K.scale;
  a.zero = K.zero;
  a.j0 = j0;
  a.j1 = j1;
  a.qm = qm;
  a.nq = nq;
  a.s = s;
  a.ss = ss;
  if (K.n <= isa::kMaxKeyChannels) {
    if (CpuIsaAtLeast(CpuIsa::kAvx512Vnni)) return isa::ScoreKeysVnni(a);
    if (CpuIsaAtLeast(CpuIsa::kAvx2) && K.row_bytes % 16 == 0) return isa::ScoreKeysAvx2(a);
  }
  const int n = K.n, B = 32 / K.bits, blocks = (n + B - 1) / B;
  const int64_t G = K.group;  // 64-bit: G may be near INT_MAX
  std::vector<int8_t> qi(static_cast<size_t>(nq) * n);
  std::vector<float> alpha(static_cast<size_t>(nq) * blocks), qz(nq);
  std::vector<int32_t> codes(n);
  for (int64_t g0 = j0 / G * G; g0 < j1; g0 += G) {
    const size_t gi = static_cast<size_t>(g0 / G);
    PrepareKeysPortable(qm, K.scale + gi * n, K.zero + gi * n, nq, n, K.bits, qi.data(),
                        alpha.data(), qz.data());
    const int r1 = static_cast<int>(std::min<int64_t>(j1, g0 + G));
    for (int j = static_cast<int>(std::max<int64_t>(j0, g0)); j < r1; ++j) {
      const uint8_t* row = K.base + static_cast<size_t>(j) * K.row_bytes;
      for (int c = 0; c < n; ++c) codes[c] = static_cast<int32_t>(quant::CodeAt(row, c, K.bits));
      for (int q = 0; q < nq; ++q) {
        const int8_t* qa = &qi[static_cast<size_t>(q) * n];
        float score = 0.0f;
        for (int b = 0; b < blocks; ++b) {
          int32_t sum = 0;
          for (int c = b * B; c < std::min(n, (b + 1) * B); ++c) sum += qa[c] * codes[c];
          score =
              std::fma(alpha[static_cast<size_t>(q) * blocks + b], static_cast<float>(sum), score);
        }
        s[static_cast<size_t>(q) * ss + (j - j0)] = score + qz[q];
      }
    }
  }
}

bool ValueCodesIntSupported(const Rows& V) {
  return V.kind == Rows::kValueCodes && (V.bits == 2 || V.bits == 4);
}

void AccumulateValueCodesInt(const Rows& V, int j0, int j1, const float* p, int ps, int nq,
                             float* acc) {
  if (j1 <= j0) return;
  const int n = V.n, G = V.group, ng = quant::NumGroups(n, G);
  isa::ValueArgs a;
  a.codes = V.base + static_cast<size_t>(j0) * V.row_bytes;
  a.row_bytes = V.row_bytes;
  a.rows = j1 - j0;
  a.bits = V.bits;
  a.n = n;
  a.group = G;
  a.groups = ng;
  a.scale = V.scale + static_cast<size_t>(j0) * ng;
  a.zero = V.zero + static_cast<size_t>(j0) * ng;
  a.p = p;
  a.ps = ps;
  a.nq = nq;
  a.acc = acc;
  if (CpuIsaAtLeast(CpuIsa::kAvx512Vnni) && ng <= isa::kMaxValueGroups) {
    return isa::AccumulateValuesVnni(a);
  }
  if (CpuIsaAtLeast(CpuIsa::kAvx2) && (ng == 1 || ng == 2 || ng == 4 || ng == 8) &&
      V.row_bytes % 16 == 0) {
    return isa::AccumulateValuesAvx2(a);
  }
  // The portable reference: the same operations, lane by lane, in the same order.
  const int rows = j1 - j0;
  const float mid = static_cast<float>((1 << V.bits) - 1) / 2.0f;
  std::vector<float> accf(static_cast<size_t>(nq) * n, 0.0f), zacc(static_cast<size_t>(nq) * ng);
  std::vector<float> w(isa::kValueBlock);
  std::vector<int32_t> wi(isa::kValueBlock);
  std::vector<int32_t> codes(static_cast<size_t>(isa::kValueBlock) * n);
  for (int b0 = 0; b0 < rows; b0 += isa::kValueBlock) {
    const int nb = std::min(isa::kValueBlock, rows - b0);
    for (int j = 0; j < nb; ++j) {
      const uint8_t* row = a.codes + static_cast<size_t>(b0 + j) * V.row_bytes;
      for (int c = 0; c < n; ++c) {
        codes[static_cast<size_t>(j) * n + c] = static_cast<int32_t>(quant::CodeAt(row, c, V.bits));
      }
    }
    for (int q = 0; q < nq; ++q) {
      for (int g = 0; g < ng; ++g) {
        float wmax = 0.0f, wsum = 0.0f;
        float& z = zacc[static_cast<size_t>(q) * ng + g];
        for (int j = 0; j < nb; ++j) {
          const size_t row = static_cast<size_t>(b0 + j);
          const float pj = p[static_cast<size_t>(q) * ps + row];
          w[j] = pj * a.scale[row * ng + g];
          wmax = wmax > w[j] ? wmax : w[j];
          wsum += w[j];
          z = std::fma(pj, a.zero[row * ng + g], z);
        }
        const bool live = wmax >= kTiny;
        const float beta = live ? wmax / 255.0f : 0.0f;
        const float inv = live ? 255.0f / wmax : 0.0f;
        int32_t wisum = 0;
        for (int j = 0; j < nb; ++j) {
          wi[j] = RoundClamp(w[j] * inv, 0.0f, 255.0f);
          wisum += wi[j];
        }
        z = std::fma(mid, std::fma(-beta, static_cast<float>(wisum), wsum), z);
        const int c1 = std::min(n, (g + 1) * G);
        for (int c = g * G; c < c1; ++c) {
          int32_t sum = 0;
          for (int j = 0; j < nb; ++j) sum += wi[j] * codes[static_cast<size_t>(j) * n + c];
          float& f = accf[static_cast<size_t>(q) * n + c];
          f = std::fma(static_cast<float>(sum), beta, f);
        }
      }
    }
  }
  for (int q = 0; q < nq; ++q) {
    for (int c = 0; c < n; ++c) {
      float& o = acc[static_cast<size_t>(q) * n + c];
      o += accf[static_cast<size_t>(q) * n + c];
      o += zacc[static_cast<size_t>(q) * ng + c / G];
    }
  }
}

}  // namespace kvc::cpu::attn
