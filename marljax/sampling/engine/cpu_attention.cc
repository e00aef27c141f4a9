// Decode attention on a CPU: one query per row over the first `length[b]` columns of its keys and values,
// streamed once (an XLA FFI handler; built and registered by marljax/sampling/engine/cpu_attention.py).
//
//   q      f32 [B, K, G, D]   the row's G query heads of each KV head (scaled by `scale` here)
//   k      T   [B, K, D, S]   keys, position along the last axis (the decoder's dense cache layout)
//   v      T   [B, K, S, D]   values
//   length s32 [B]            real columns of each row (clamped to [0, S]); the rest is never read
// -> o     f32 [B, K, G, D]   softmax(q k / sqrt) v over those columns (0 for an empty row)
//    lse   f32 [B, K, G]      the log-sum-exp of the scaled scores (float32 lowest for an empty row), so
//                             that segments of one row's keys combine into one softmax
// T is float32 or bfloat16 (as its bits). Scores, softmax and sums are float32. Work items are the
// B × K (row, KV head) pairs, pulled by the calling thread and the helpers it schedules on XLA's
// intra-op pool; a helper that starts after the items ran out returns at once.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

inline f32x16 load16(const float* p) {
  f32x16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
inline f32x16 load16(const uint16_t* p) {  // bfloat16 bits -> float32: the high half of the word
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  return (f32x16)(__builtin_convertvector(h, u32x16) << 16);
}
inline float load1(float x) { return x; }
inline float load1(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store16(float* p, f32x16 x) { std::memcpy(p, &x, sizeof x); }

// sc[g, s] = scale · Σ_d q[g, d] k[d, s] for the first 16·nv columns. Keys are read R rows of d at a
// time, each row along s (R streams the prefetcher follows), the sums kept in `sc` between row blocks.
template <typename T, int G>
void scores_by_rows(const float* q, const T* k, int64_t nv, int64_t S, int64_t D, float scale, float* sc) {
  constexpr int R = 8;
  for (int64_t d0 = 0; d0 < D; d0 += R) {
    const int r_end = int(std::min<int64_t>(R, D - d0));
    float qs[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < r_end; ++r) qs[g][r] = q[g * D + d0 + r] * scale;
    for (int64_t j = 0; j < nv; ++j) {
      f32x16 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = d0 ? load16(sc + g * S + 16 * j) : f32x16{};
      for (int r = 0; r < r_end; ++r) {
        const f32x16 kv = load16(k + (d0 + r) * S + 16 * j);
        for (int g = 0; g < G; ++g) acc[g] += qs[g][r] * kv;
      }
      for (int g = 0; g < G; ++g) store16(sc + g * S + 16 * j, acc[g]);
    }
  }
}

// o[g, e] = Σ_{s < n} p[g, s] v[s, e] for e in [e0, e0 + 16·V): value rows read in order.
template <typename T, int G, int V>
void values_tile(const float* p, const T* v, int64_t n, int64_t S, int64_t D, int64_t e0, float* o) {
  f32x16 acc[G][V] = {};
  for (int64_t s = 0; s < n; ++s) {
    const T* vs = v + s * D + e0;
    f32x16 vv[V];
    for (int j = 0; j < V; ++j) vv[j] = load16(vs + 16 * j);
    for (int g = 0; g < G; ++g) {
      const float pg = p[g * S + s];
      for (int j = 0; j < V; ++j) acc[g][j] += pg * vv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < V; ++j) store16(o + g * D + e0 + 16 * j, acc[g][j]);
}

// One (row, KV head): its G queries over its first n columns (`sc`: a [G, S] scratch).
template <typename T, int G>
void attend(const float* q, const T* k, const T* v, int64_t n, int64_t S, int64_t D, float scale, float* sc,
            float* o, float* lse) {
  if (n <= 0) {
    std::fill(o, o + G * D, 0.0f);
    std::fill(lse, lse + G, std::numeric_limits<float>::lowest());
    return;
  }
  const int64_t nv = std::min((n + 15) / 16, S / 16);  // whole vectors (may read past n, never past S)
  scores_by_rows<T, G>(q, k, nv, S, D, scale, sc);
  for (int64_t s = 16 * nv; s < n; ++s)
    for (int g = 0; g < G; ++g) {
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d) a += q[g * D + d] * load1(k[d * S + s]);
      sc[g * S + s] = a * scale;
    }
  for (int g = 0; g < G; ++g) {
    float* sg = sc + g * S;
    float m = sg[0];
    for (int64_t s = 1; s < n; ++s) m = std::max(m, sg[s]);
    float l = 0.0f;
    for (int64_t s = 0; s < n; ++s) {
      sg[s] = std::exp(sg[s] - m);
      l += sg[s];
    }
    lse[g] = m + std::log(l);
    const float inv = 1.0f / l;
    for (int64_t s = 0; s < n; ++s) sg[s] *= inv;
  }
  constexpr int V = G <= 3 ? 4 : (G <= 6 ? 2 : 1);  // accumulators G·V ≤ 12 vectors
  int64_t e0 = 0;
  for (; e0 + 16 * V <= D; e0 += 16 * V) values_tile<T, G, V>(sc, v, n, S, D, e0, o);
  for (; e0 + 16 <= D; e0 += 16) values_tile<T, G, 1>(sc, v, n, S, D, e0, o);
  for (; e0 < D; ++e0)
    for (int g = 0; g < G; ++g) {
      float a = 0.0f;
      for (int64_t s = 0; s < n; ++s) a += sc[g * S + s] * load1(v[s * D + e0]);
      o[g * D + e0] = a;
    }
}

struct Items {
  std::atomic<int64_t> next{0}, done{0};
  int64_t total = 0;
  std::mutex mu;
  std::condition_variable all_done;
};

template <typename T, int G>
ffi::Error Run(ffi::ThreadPool pool, const float* q, const T* k, const T* v, const int32_t* length, int64_t B,
               int64_t K, int64_t D, int64_t S, float scale, float* o, float* lse) {
  auto items = std::make_shared<Items>();
  items->total = B * K;
  auto work = [=]() {
    thread_local std::vector<float> scratch;
    scratch.resize(G * S);
    for (;;) {
      const int64_t i = items->next.fetch_add(1);
      if (i >= items->total) return;
      const int64_t n = std::clamp<int64_t>(length[i / K], 0, S);
      attend<T, G>(q + i * G * D, k + i * D * S, v + i * S * D, n, S, D, scale, scratch.data(), o + i * G * D,
                   lse + i * G);
      if (items->done.fetch_add(1) + 1 == items->total) {
        std::lock_guard<std::mutex> lock(items->mu);
        items->all_done.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items->total) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  std::unique_lock<std::mutex> lock(items->mu);
  items->all_done.wait(lock, [&] { return items->done.load() == items->total; });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error ByGroup(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> length, float scale, float* o, float* lse) {
  const auto kd = k.dimensions();
  const int64_t B = kd[0], K = kd[1], D = kd[2], S = kd[3];
  const T* kp = reinterpret_cast<const T*>(k.untyped_data());
  const T* vp = reinterpret_cast<const T*>(v.untyped_data());
  switch (q.dimensions()[2]) {
#define MARLJAX_GROUP(g) \
  case g:                \
    return Run<T, g>(pool, q.typed_data(), kp, vp, length.typed_data(), B, K, D, S, scale, o, lse);
    MARLJAX_GROUP(1) MARLJAX_GROUP(2) MARLJAX_GROUP(3) MARLJAX_GROUP(4)
    MARLJAX_GROUP(5) MARLJAX_GROUP(6) MARLJAX_GROUP(7) MARLJAX_GROUP(8)
#undef MARLJAX_GROUP
  }
  return ffi::Error::InvalidArgument("cpu decode attention: 1 to 8 query heads per KV head");
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> length, float scale, ffi::ResultBuffer<ffi::F32> o,
                           ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] ||
      qd[3] != kd[2] || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[3] || vd[3] != kd[2] ||
      length.dimensions()[0] != kd[0] || k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("cpu decode attention: expects q [B,K,G,D], k [B,K,D,S], v [B,K,S,D] "
                                       "of one dtype, length [B]");
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return ByGroup<float>(pool, q, k, v, length, scale, o->typed_data(), lse->typed_data());
    case ffi::DataType::BF16:
      return ByGroup<uint16_t>(pool, q, k, v, length, scale, o->typed_data(), lse->typed_data());
    default:
      return ffi::Error::InvalidArgument("cpu decode attention: keys and values must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MarljaxCpuDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
