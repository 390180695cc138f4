// An independent, deliberately naive attention written from the header comment of flashport.h:
// it materialises the whole [Lq, Lk] score, mask, probability and dropout matrices per
// (sequence, head) and multiplies matrices. It shares no code with src/reference; only the
// Philox4x32-10 block function is taken from philox.hpp (checked by its own known-answer test),
// with the counter layout written out here from the documented rule.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "core/philox.hpp"

namespace refdense {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> a;
  Mat() = default;
  Mat(int64_t r, int64_t c, double fill = 0.0) : rows(r), cols(c), a(r * c, fill) {}
  double& operator()(int64_t i, int64_t j) { return a[i * cols + j]; }
  double operator()(int64_t i, int64_t j) const { return a[i * cols + j]; }
};

// A [m, k] times B [k, n].
inline Mat matmul(const Mat& A, const Mat& B) {
  Mat C(A.rows, B.cols);
  for (int64_t i = 0; i < A.rows; ++i)
    for (int64_t t = 0; t < A.cols; ++t)
      for (int64_t j = 0; j < B.cols; ++j) C(i, j) += A(i, t) * B(t, j);
  return C;
}

inline Mat transpose(const Mat& A) {
  Mat T(A.cols, A.rows);
  for (int64_t i = 0; i < A.rows; ++i)
    for (int64_t j = 0; j < A.cols; ++j) T(j, i) = A(i, j);
  return T;
}

// Logical element (sequence b, row within the sequence, head, dim).
using Getter = std::function<double(int64_t b, int64_t row, int64_t head, int64_t d)>;

struct Spec {
  int64_t batch = 1, hq = 1, hkv = 1, d = 1, dv = 1;
  std::vector<int64_t> lq, lk;  // per sequence
  double scale = 1.0;
  double softcap = 0.0;
  bool causal = false;
  bool top_left = false;
  int64_t window_left = -1, window_right = -1;
  std::vector<double> alibi;     // [hq] or [batch * hq]
  bool alibi_per_batch = false;
  std::vector<double> sinks;     // [hq] or empty
  float dropout_p = 0.0f;
  uint64_t seed = 0, offset = 0;
};

// The documented dropout rule, spelled out: threshold t = round(p * 256) clamped to [1, 255];
// counter {j/16, i, lo32(offset + b*Hq + h), hi32(offset + b*Hq + h)}, key = seed; key j's
// byte is byte j%4 of word (j/4)%4, kept iff byte >= t; kept values scaled by 256 / (256 - t).
inline uint32_t keep_threshold(float p) {
  if (p <= 0.0f) return 0;
  return static_cast<uint32_t>(std::min(255.0, std::max(1.0, std::floor(static_cast<double>(p) * 256.0 + 0.5))));
}
inline double keep_rate(float p) { return (256.0 - keep_threshold(p)) / 256.0; }
inline bool kept(const Spec& s, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (s.dropout_p <= 0.0f) return true;
  const uint64_t stream = s.offset + static_cast<uint64_t>(b) * s.hq + h;
  flashport::Philox4 ctr{{static_cast<uint32_t>(j / 16), static_cast<uint32_t>(i),
                          static_cast<uint32_t>(stream & 0xFFFFFFFFu),
                          static_cast<uint32_t>(stream >> 32)}};
  const flashport::Philox4 w = flashport::philox4x32_10(
      ctr, static_cast<uint32_t>(s.seed & 0xFFFFFFFFu), static_cast<uint32_t>(s.seed >> 32));
  return ((w.x[(j / 4) % 4] >> (8 * (j % 4))) & 0xFFu) >= keep_threshold(s.dropout_p);
}

// Visibility matrix of one sequence, straight from the header's inequalities.
inline std::vector<std::vector<bool>> visibility(const Spec& s, int64_t lq, int64_t lk) {
  const int64_t shift = s.top_left ? 0 : lk - lq;
  const int64_t wr = s.causal ? 0 : s.window_right;
  std::vector<std::vector<bool>> m(lq, std::vector<bool>(lk, true));
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t j = 0; j < lk; ++j) {
      if (s.window_left >= 0 && j < i + shift - s.window_left) m[i][j] = false;
      if (wr >= 0 && j > i + shift + wr) m[i][j] = false;
    }
  return m;
}

struct Result {
  // out[b] is [lq * hq, dv] with row i * hq + h; lse[b] is [hq * lq] with index h * lq + i.
  std::vector<Mat> out;
  std::vector<std::vector<double>> lse;
  // Flattened like the batched tensors out [B, Sq, Hq, Dv] and lse [B, Hq, Sq] (equal lq).
  std::vector<double> out_flat() const {
    std::vector<double> r;
    for (const Mat& m : out) r.insert(r.end(), m.a.begin(), m.a.end());
    return r;
  }
  std::vector<double> lse_flat() const {
    std::vector<double> r;
    for (const auto& l : lse) r.insert(r.end(), l.begin(), l.end());
    return r;
  }
};

// Undropped probabilities P [lq, lk] of (sequence b, query head h) and their LSE per row.
inline Mat head_probs(const Spec& s, int64_t b, int64_t h, const Getter& q, const Getter& k,
                      std::vector<double>* lse) {
  const int64_t lq = s.lq[b], lk = s.lk[b];
  const int64_t shift = s.top_left ? 0 : lk - lq;
  const int64_t hk = h / (s.hq / s.hkv);
  const auto vis = visibility(s, lq, lk);
  Mat Q(lq, s.d), K(lk, s.d);
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t t = 0; t < s.d; ++t) Q(i, t) = q(b, i, h, t);
  for (int64_t j = 0; j < lk; ++j)
    for (int64_t t = 0; t < s.d; ++t) K(j, t) = k(b, j, hk, t);
  Mat S = matmul(Q, transpose(K));
  for (double& x : S.a) x *= s.scale;
  if (s.softcap > 0)
    for (double& x : S.a) x = s.softcap * std::tanh(x / s.softcap);
  if (!s.alibi.empty()) {
    const double slope = s.alibi[(s.alibi_per_batch ? b * s.hq : 0) + h];
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j) S(i, j) += -slope * std::fabs(double(i + shift - j));
  }
  const bool has_sink = !s.sinks.empty();
  Mat P(lq, lk);
  lse->assign(lq, kNegInf);
  for (int64_t i = 0; i < lq; ++i) {
    double mx = has_sink ? s.sinks[h] : kNegInf;
    for (int64_t j = 0; j < lk; ++j)
      if (vis[i][j]) mx = std::max(mx, S(i, j));
    if (mx == kNegInf) continue;  // empty row: P = 0, lse = -inf
    double z = has_sink ? std::exp(s.sinks[h] - mx) : 0.0;
    for (int64_t j = 0; j < lk; ++j)
      if (vis[i][j]) z += std::exp(S(i, j) - mx);
    for (int64_t j = 0; j < lk; ++j) P(i, j) = vis[i][j] ? std::exp(S(i, j) - mx) / z : 0.0;
    (*lse)[i] = mx + std::log(z);
  }
  return P;
}

inline Result forward(const Spec& s, const Getter& q, const Getter& k, const Getter& v) {
  Result res;
  const int64_t group = s.hq / s.hkv;
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t lq = s.lq[b], lk = s.lk[b];
    Mat out_b(lq * s.hq, s.dv);
    std::vector<double> lse_b(s.hq * lq, kNegInf);
    for (int64_t h = 0; h < s.hq; ++h) {
      const int64_t hk = h / group;
      std::vector<double> lse_h;
      Mat P = head_probs(s, b, h, q, k, &lse_h);
      for (int64_t i = 0; i < lq; ++i) lse_b[h * lq + i] = lse_h[i];
      Mat V(lk, s.dv);
      for (int64_t j = 0; j < lk; ++j)
        for (int64_t t = 0; t < s.dv; ++t) V(j, t) = v(b, j, hk, t);
      // Dropout matrix (entries 0 or 1 / keep rate) applied elementwise.
      const double inv_keep = 1.0 / keep_rate(s.dropout_p);
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j)
          if (s.dropout_p > 0.0f) P(i, j) *= kept(s, b, h, i, j) ? inv_keep : 0.0;
      const Mat O = matmul(P, V);
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t t = 0; t < s.dv; ++t) out_b(i * s.hq + h, t) = O(i, t);
    }
    res.out.push_back(std::move(out_b));
    res.lse.push_back(std::move(lse_b));
  }
  return res;
}

}  // namespace refdense
