// SMP steps of an nn.Sequential network for every chain, fused per chain (CPU).
//
// Each chain has its own parameter row theta_b and its own input x_b. The forward pass and the
// backward pass of one chain run on one thread, start to end, with the chain's activations in a
// small per-chain buffer: no kernel per layer, no (B, C*kh*kw, L) patch tensor, no (B, d) score.
// The backward pass steps each layer's parameters as soon as the layer's input gradient has been
// pulled back through its current weights (the order of smp_core.models.SequentialChainModel), so
// every weight and every preconditioner entry is read and written once per step. An MLP (Linear
// layers and element-wise activations) runs its chains kVL<T> at a time in the lanes of a vector
// instead (struct Lanes), each lane one chain, with the same operations summed in the lanes' own order.
// The build uses -march=native, so the compiler may fuse a multiply and an add into one rounding (FMA),
// differently in scalar and in vector code: the two paths agree to rounding, not bit for bit.
// A convolution runs as two small matrix products over its patch matrix (im2col), or, where its output rows
// are whole vectors (stride 1, no padding or dilation: LeNet-5's two), straight from its input (direct_conv):
// the same products summed in the same order, so the two give the same numbers bit for bit (a test checks it).
//
// The network is described by `spec`, a flat int64 list built by smp_core/fused.py: one record per
// layer, [kind, fields...], with the offsets of its parameters in theta and of its input and output
// in the activation buffer. See fused.py for the record layouts.
//
// Update modes of the backward pass (g = J_b^T cotangent_b, the chain's score; eq. 2.14):
//   0  write g into grad (B, d)                      (vjp)
//   1  theta += gamma * g                            (SMP-none)
//   2  theta += gamma * scale * g                    (a stored diagonal P^{-1}: fixed, periodic)
//   3  theta += gamma * g / (stat + ridge);          (EMA diagonal: the step uses the statistic
//      stat = beta * stat + (1 - beta) * g^2          before g is folded in)
// `scale` and `stat` are (1, d) (shared, mode 2 only) or (B, d).
// The whole steps (`steps`) have two more modes, for the block and dense structures: P^{-1} stored as
// matrices (fixed and periodic), and the EMA:
//   4  theta[o:o+n] += gamma * g[o:o+n] M_b  for each block b = (o, n), M_b = factors[b] (1 or B, n, n),
//      symmetric, once the whole score g has been formed (the backward pass reads the weights of theta_k).
//   5  the EMA of the block and dense structures: for each block, with M_b = factors[b] (B, n, n) this
//      chain's statistic, theta[o:o+n] += gamma * (M_b + ridge I)^{-1} g_b (Cholesky), then
//      M_b = beta * M_b + (1 - beta) * g_b g_b^T. Where the factorisation fails (rounding made M_b + ridge I
//      indefinite, or M_b is not finite) the solve is redone in double from M_b's eigendecomposition with
//      its negative eigenvalues set to 0, as smp_core.preconditioners does; the call returns how many such
//      solves of a finite statistic gave a finite result in float (the caller warns).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

enum Kind : int64_t {
  LINEAR = 0, CONV = 1, RELU = 2, TANH = 3, SIGMOID = 4, IDENTITY = 5, MAXPOOL = 6, GELU_TANH = 7, GELU_ERF = 8
};

// GELU as smp_core.models._gelu computes it (the same operations in the same order)
constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;

// record lengths (kind included)
constexpr int64_t kLinearLen = 7;   // kind, in, out, w_off, b_off, in_act, out_act
constexpr int64_t kConvLen = 19;    // kind, C, H, W, O, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw, w_off, b_off, in_act, out_act
constexpr int64_t kActLen = 4;      // kind, n, in_act, out_act
constexpr int64_t kGeluLen = 5;     // kind, n, in_act, out_act, slope_act (GELU's derivative, kept for the backward pass)
constexpr int64_t kPoolLen = 17;    // kind, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, dh, dw, in_act, out_act, arg_off

int64_t record_length(int64_t kind) {
  switch (kind) {
    case LINEAR: return kLinearLen;
    case CONV: return kConvLen;
    case MAXPOOL: return kPoolLen;
    case RELU: case TANH: case SIGMOID: case IDENTITY: return kActLen;
    case GELU_TANH: case GELU_ERF: return kGeluLen;
    default: TORCH_CHECK(false, "fused_sequential: unknown layer kind ", kind);
  }
}

std::vector<int64_t> record_starts(const std::vector<int64_t>& spec) {
  std::vector<int64_t> starts;
  for (size_t i = 0; i < spec.size(); i += record_length(spec[i])) starts.push_back(static_cast<int64_t>(i));
  return starts;
}

// Register-blocked small matrix products (the per-chain GEMMs of a convolution), written with GCC
// vector extensions so that the blocking does not depend on the auto-vectorizer: a vector V is 32
// bytes (one AVX2 register; emulated where there is none), a row block of C is NR = 2 vectors.
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
};
template <typename T>
using V = typename Vec<T>::type;
template <typename T>
constexpr int64_t kVL = 32 / sizeof(T);
// kernel_nn's vectors: 64 bytes where the processor has AVX-512 (each entry of C is the same sum over k in the
// same order at any width, so the width changes no number), else V
#if defined(__AVX512F__)
constexpr int64_t kWideBytes = 64;
#else
constexpr int64_t kWideBytes = 32;
#endif
template <typename T>
struct WideVec {
  typedef T type __attribute__((vector_size(kWideBytes)));
};
template <typename T>
using VW = typename WideVec<T>::type;
template <typename T>
constexpr int64_t kWL = kWideBytes / sizeof(T);
template <typename T>
constexpr int64_t kNR = 2 * kWL<T>;

template <typename T, typename VT = V<T>>
inline VT load(const T* p) {
  VT v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T, typename VT>
inline void store(T* p, VT v) {
  __builtin_memcpy(p, &v, sizeof(v));
}
template <typename T>
inline T hsum(V<T> v) {
  T s = T(0);
  for (int64_t i = 0; i < kVL<T>; ++i) s += v[i];
  return s;
}

// hsum of eight vectors of eight lanes at once: out[e] = ((0 + r[e][0]) + r[e][1]) + ... + r[e][7], the same
// additions in the same order as hsum, made lane by lane on the transposed vectors (three rounds of shuffles).
template <typename VT>
inline VT hsum8(const VT* r) {
  typedef int32_t I8 __attribute__((vector_size(32)));
  static_assert(sizeof(VT) == 32 && sizeof(r[0][0]) == 4, "eight lanes of four bytes");
  VT a[8], b[8], col[8];
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = __builtin_shuffle(r[2 * k], r[2 * k + 1], I8{0, 8, 2, 10, 4, 12, 6, 14});
    a[2 * k + 1] = __builtin_shuffle(r[2 * k], r[2 * k + 1], I8{1, 9, 3, 11, 5, 13, 7, 15});
  }
  // rows 4h .. 4h + 3, lanes {0, 4}, {2, 6}, {1, 5}, {3, 7}
  for (int h = 0; h < 2; ++h) {
    const VT* x = a + 4 * h;
    b[4 * h] = __builtin_shuffle(x[0], x[2], I8{0, 1, 8, 9, 4, 5, 12, 13});
    b[4 * h + 1] = __builtin_shuffle(x[0], x[2], I8{2, 3, 10, 11, 6, 7, 14, 15});
    b[4 * h + 2] = __builtin_shuffle(x[1], x[3], I8{0, 1, 8, 9, 4, 5, 12, 13});
    b[4 * h + 3] = __builtin_shuffle(x[1], x[3], I8{2, 3, 10, 11, 6, 7, 14, 15});
  }
  constexpr int lane[4] = {0, 2, 1, 3};  // the first lane of b[m] (the second is 4 more)
  for (int m = 0; m < 4; ++m) {
    col[lane[m]] = __builtin_shuffle(b[m], b[m + 4], I8{0, 1, 2, 3, 8, 9, 10, 11});
    col[lane[m] + 4] = __builtin_shuffle(b[m], b[m + 4], I8{4, 5, 6, 7, 12, 13, 14, 15});
  }
  VT s = VT{};
  for (int i = 0; i < 8; ++i) s += col[i];
  return s;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// scratch_sizes pads rows for every scalar type at once
constexpr int64_t kMaxNR = 2 * kWideBytes / sizeof(float);
static_assert(kNR<float> <= kMaxNR && kMaxNR % kNR<float> == 0 && kMaxNR % kNR<double> == 0, "row padding");

// C[i, 0:NR] = sum_k A[i * a_rs + k * a_cs] * B[k * ldb + 0:NR] for MR rows.
template <typename T, int MR>
inline void kernel_nn(int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t ldb, T* C,
                      int64_t ldc) {
  constexpr int64_t VL = kWL<T>;
  using VT = VW<T>;
  VT acc0[MR], acc1[MR];
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = VT{};
  for (int64_t k = 0; k < K; ++k) {
    const VT b0 = load<T, VT>(B + k * ldb), b1 = load<T, VT>(B + k * ldb + VL);
    for (int i = 0; i < MR; ++i) {
      const T a = A[i * a_rs + k * a_cs];
      acc0[i] += a * b0;
      acc1[i] += a * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    store(C + i * ldc, acc0[i]);
    store(C + i * ldc + VL, acc1[i]);
  }
}

template <typename T>
void gemm_nn(int64_t M, int64_t Npad, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t ldb,
             T* C, int64_t ldc) {
  for (int64_t n0 = 0; n0 < Npad; n0 += kNR<T>)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const T* a = A + m0 * a_rs;
      T* c = C + m0 * ldc + n0;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: kernel_nn<T, 4>(K, a, a_rs, a_cs, B + n0, ldb, c, ldc); break;
        case 3: kernel_nn<T, 3>(K, a, a_rs, a_cs, B + n0, ldb, c, ldc); break;
        case 2: kernel_nn<T, 2>(K, a, a_rs, a_cs, B + n0, ldb, c, ldc); break;
        default: kernel_nn<T, 1>(K, a, a_rs, a_cs, B + n0, ldb, c, ldc);
      }
    }
}

// out[i][j] = hsum(acc[i][j]); eight at once by hsum8 where there are eight of eight lanes (the same numbers)
template <typename T, int MR, int NR2>
inline void lane_sums(const V<T> (&acc)[MR][NR2], T (&out)[MR][NR2]) {
  if constexpr (kVL<T> == 8 && MR * NR2 % 8 == 0) {
    for (int e0 = 0; e0 < MR * NR2; e0 += 8) {
      V<T> rows[8];
      for (int e = 0; e < 8; ++e) rows[e] = acc[(e0 + e) / NR2][(e0 + e) % NR2];
      const V<T> sums = hsum8(rows);
      for (int e = 0; e < 8; ++e) out[(e0 + e) / NR2][(e0 + e) % NR2] = sums[e];
    }
  } else {
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR2; ++j) out[i][j] = hsum<T>(acc[i][j]);
  }
}

// C[i, j] = sum_l A[i * lda + l] B[j * ldb + l] for MR x NR2 entries (dot products, several at once
// so that no single chain of additions waits on the previous one).
template <typename T, int MR, int NR2>
inline void kernel_nt(int64_t L, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  constexpr int64_t VL = kVL<T>;
  V<T> acc[MR][NR2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR2; ++j) acc[i][j] = V<T>{};
  const int64_t main = L - L % VL;
  for (int64_t l = 0; l < main; l += VL) {
    V<T> a[MR], b[NR2];
    for (int i = 0; i < MR; ++i) a[i] = load(A + i * lda + l);
    for (int j = 0; j < NR2; ++j) b[j] = load(B + j * ldb + l);
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR2; ++j) acc[i][j] += a[i] * b[j];
  }
  T sums[MR][NR2];
  lane_sums<T, MR, NR2>(acc, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR2; ++j) {
      T sum = sums[i][j];
      for (int64_t l = main; l < L; ++l) sum += A[i * lda + l] * B[j * ldb + l];
      C[i * ldc + j] = sum;
    }
}

template <typename T, int MR>
inline void nt_row_block(int64_t N, int64_t L, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  int64_t n0 = 0;
  if constexpr (MR == 1)
    for (; n0 + 8 <= N; n0 += 8) kernel_nt<T, 1, 8>(L, A, lda, B + n0 * ldb, ldb, C + n0, ldc);
  for (; n0 + 4 <= N; n0 += 4) kernel_nt<T, MR, 4>(L, A, lda, B + n0 * ldb, ldb, C + n0, ldc);
  switch (N - n0) {
    case 3: kernel_nt<T, MR, 3>(L, A, lda, B + n0 * ldb, ldb, C + n0, ldc); break;
    case 2: kernel_nt<T, MR, 2>(L, A, lda, B + n0 * ldb, ldb, C + n0, ldc); break;
    case 1: kernel_nt<T, MR, 1>(L, A, lda, B + n0 * ldb, ldb, C + n0, ldc); break;
    default: break;
  }
}

// C (M x N) = A (M x L) B^T (B: N x L), rows contiguous along L.
template <typename T>
void gemm_nt(int64_t M, int64_t N, int64_t L, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc) {
  int64_t m0 = 0;
  for (; m0 + 2 <= M; m0 += 2) nt_row_block<T, 2>(N, L, A + m0 * lda, lda, B, ldb, C + m0 * ldc, ldc);
  if (m0 < M) nt_row_block<T, 1>(N, L, A + m0 * lda, lda, B, ldb, C + m0 * ldc, ldc);
}

// out[q] = a[q * L] + a[q * L + 1] + ... + a[q * L + L - 1], each sum in that order from 0, for NQ rows side by
// side: the rows' additions are independent, so none waits on the latency of another's.
template <typename T, int NQ>
inline void row_sums_block(const T* a, int64_t L, T* out) {
  T acc[NQ];
  for (int i = 0; i < NQ; ++i) acc[i] = T(0);
  for (int64_t l = 0; l < L; ++l)
    for (int i = 0; i < NQ; ++i) acc[i] += a[i * L + l];
  for (int i = 0; i < NQ; ++i) out[i] = acc[i];
}

template <typename T>
void row_sums(const T* a, int64_t rows, int64_t L, T* out) {
  int64_t q = 0;
  for (; q + 8 <= rows; q += 8) row_sums_block<T, 8>(a + q * L, L, out + q);
  switch (rows - q) {
    case 7: row_sums_block<T, 7>(a + q * L, L, out + q); break;
    case 6: row_sums_block<T, 6>(a + q * L, L, out + q); break;
    case 5: row_sums_block<T, 5>(a + q * L, L, out + q); break;
    case 4: row_sums_block<T, 4>(a + q * L, L, out + q); break;
    case 3: row_sums_block<T, 3>(a + q * L, L, out + q); break;
    case 2: row_sums_block<T, 2>(a + q * L, L, out + q); break;
    case 1: row_sums_block<T, 1>(a + q * L, L, out + q); break;
    default: break;
  }
}

// The parameter step of n consecutive entries from offset `at`, by mode, from their score g.
template <typename T>
struct Update {
  int64_t mode;
  T gamma, beta, fold, ridge;  // fold = 1 - beta, computed in double (beta near 1 loses digits in float)
  T* theta;          // this chain's row
  T* grad;           // mode 0: this chain's row of the result
  const T* scale;    // mode 2: this chain's (or the shared) row
  T* stat;           // mode 3: this chain's row

  void apply(int64_t at, const T* g, int64_t n) const {
    T* th = theta + at;
    switch (mode) {
      case 0: {
        T* out = grad + at;
        for (int64_t j = 0; j < n; ++j) out[j] = g[j];
        break;
      }
      case 1: {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) th[j] += gamma * g[j];
        break;
      }
      case 2: {
        const T* sc = scale + at;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) th[j] += gamma * g[j] * sc[j];
        break;
      }
      default: {
        T* st = stat + at;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          th[j] += gamma * g[j] / (st[j] + ridge);
          st[j] = beta * st[j] + fold * g[j] * g[j];
        }
      }
    }
  }
};

// Per-thread scratch, sized for the largest layer.
template <typename T>
struct Scratch {
  std::vector<T> cols, work, wide, delta, next, grad;
  std::vector<int64_t> koff;  // a direct convolution's patch offsets (K)
  std::vector<T> bias;        // and its biases (O)
  // the whole step keeps every convolution's patch matrix from the forward pass for the backward
  // pass (the chain's own, still in cache), at col_off[record]; empty: the backward pass rebuilds it
  std::vector<T> saved;
  std::vector<int64_t> col_off;

  T* patches(size_t record) { return saved.empty() ? cols.data() : saved.data() + col_off[record]; }
};

// A convolution of stride 1, no padding and no dilation whose output rows are whole vectors (OW a multiple of
// kVL<T>) runs without a patch matrix: row k = (c, i, j) of the patch matrix, at the kVL<T> output positions
// l .. l + kVL<T> - 1 of output row oy (columns ox ..), is the input's run at koff[k] + oy * W + ox, with
// koff[k] = (c * H + i) * W + j. The kernels below load those runs where gemm_nn and gemm_nt load the patch
// matrix's, and sum the same products in the same order: the same numbers, without im2col.
// Vectors of a forward block and rows of a weight-gradient block (registers: 16 accumulators where there are 32)
constexpr int kDirectBlock = kWideBytes == 64 ? 4 : 2;

inline bool direct_conv(const int64_t* r, int64_t VL) {
  return r[9] == 1 && r[10] == 1 && r[11] == 0 && r[12] == 0 && r[13] == 1 && r[14] == 1 && r[6] % VL == 0;
}

inline void patch_offsets(const int64_t* r, int64_t* koff) {
  const int64_t C = r[1], H = r[2], W = r[3], kh = r[7], kw = r[8];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j) koff[(c * kh + i) * kw + j] = (c * H + i) * W + j;
}

// out[i * L + v * VL ..] = sum_k A[i * K + k] * in[base[v] + koff[k] ..] + bias[i], for MR rows and NV vectors
// (gemm_nn's kernel_nn, then forward_chain's bias)
template <typename T, int MR, int NV>
inline void direct_nn(int64_t K, const T* A, const int64_t* koff, const T* const* base, const T* bias, T* out,
                      int64_t L) {
  constexpr int64_t VL = kVL<T>;
  V<T> acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = V<T>{};
  for (int64_t k = 0; k < K; ++k) {
    V<T> b[NV];
    for (int v = 0; v < NV; ++v) b[v] = load(base[v] + koff[k]);
    for (int i = 0; i < MR; ++i) {
      const T a = A[i * K + k];
      for (int v = 0; v < NV; ++v) acc[i][v] += a * b[v];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) store(out + i * L + v * VL, acc[i][v] + bias[i]);
}

template <typename T, int NV>
inline void direct_nn_rows(int64_t O, int64_t K, const T* A, const int64_t* koff, const T* const* base,
                           const T* bias, T* out, int64_t L) {
  for (int64_t m0 = 0; m0 < O; m0 += 4) {
    const T* a = A + m0 * K;
    T* o = out + m0 * L;
    switch (std::min<int64_t>(4, O - m0)) {
      case 4: direct_nn<T, 4, NV>(K, a, koff, base, bias + m0, o, L); break;
      case 3: direct_nn<T, 3, NV>(K, a, koff, base, bias + m0, o, L); break;
      case 2: direct_nn<T, 2, NV>(K, a, koff, base, bias + m0, o, L); break;
      default: direct_nn<T, 1, NV>(K, a, koff, base, bias + m0, o, L);
    }
  }
}

// The forward pass of a direct convolution: out (O, L) from the input `in`, biases added (zero without).
template <typename T>
void direct_forward(const int64_t* r, const T* theta, const T* in, T* out, int64_t* koff, T* bias) {
  constexpr int64_t VL = kVL<T>, NV = kDirectBlock;
  const int64_t W = r[3], O = r[4], OW = r[6], L = r[5] * OW, K = r[1] * r[7] * r[8];
  patch_offsets(r, koff);
  for (int64_t q = 0; q < O; ++q) bias[q] = r[16] >= 0 ? theta[r[16] + q] : T(0);
  const int64_t nvec = L / VL;
  for (int64_t v0 = 0; v0 < nvec; v0 += NV) {
    const int64_t nv = std::min<int64_t>(NV, nvec - v0);
    const T* base[NV];
    for (int64_t t = 0; t < nv; ++t) {
      const int64_t l = (v0 + t) * VL;
      base[t] = in + l / OW * W + l % OW;
    }
    if (nv == NV)
      direct_nn_rows<T, NV>(O, K, theta + r[15], koff, base, bias, out + v0 * VL, L);
    else
      direct_nn_rows<T, 1>(O, K, theta + r[15], koff, base, bias, out + v0 * VL, L);
  }
}

// C[i * ldc + j] = sum_l A[i * L + l] * patch[j][l] for MR x NR2 entries, patch row j at koff[j]: kernel_nt over
// the output positions in order, a vector at a time, then the same lane sums
template <typename T, int MR, int NR2>
inline void direct_nt(const int64_t* r, const T* A, const T* in, const int64_t* koff, T* C, int64_t ldc) {
  constexpr int64_t VL = kVL<T>;
  const int64_t W = r[3], OH = r[5], OW = r[6], L = OH * OW;
  V<T> acc[MR][NR2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR2; ++j) acc[i][j] = V<T>{};
  const T* b0[NR2];
  for (int j = 0; j < NR2; ++j) b0[j] = in + koff[j];
  for (int64_t oy = 0; oy < OH; ++oy)
    for (int64_t ox = 0; ox < OW; ox += VL) {
      const int64_t l = oy * OW + ox, at = oy * W + ox;
      V<T> a[MR], b[NR2];
      for (int i = 0; i < MR; ++i) a[i] = load(A + i * L + l);
      for (int j = 0; j < NR2; ++j) b[j] = load(b0[j] + at);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR2; ++j) acc[i][j] += a[i] * b[j];
    }
  T sums[MR][NR2];
  lane_sums<T, MR, NR2>(acc, sums);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR2; ++j) C[i * ldc + j] = sums[i][j];
}

template <typename T, int MR>
inline void direct_nt_rows(const int64_t* r, int64_t K, const T* A, const T* in, const int64_t* koff, T* C) {
  int64_t k0 = 0;
  for (; k0 + 4 <= K; k0 += 4) direct_nt<T, MR, 4>(r, A, in, koff + k0, C + k0, K);
  switch (K - k0) {
    case 3: direct_nt<T, MR, 3>(r, A, in, koff + k0, C + k0, K); break;
    case 2: direct_nt<T, MR, 2>(r, A, in, koff + k0, C + k0, K); break;
    case 1: direct_nt<T, MR, 1>(r, A, in, koff + k0, C + k0, K); break;
    default: break;
  }
}

// The weight gradient of a direct convolution: g (O, K) from delta (O, L) and the input `in` (gemm_nt's numbers).
template <typename T>
void direct_weight_grad(const int64_t* r, const T* delta, const T* in, int64_t* koff, T* g) {
  const int64_t O = r[4], L = r[5] * r[6], K = r[1] * r[7] * r[8];
  patch_offsets(r, koff);
  int64_t m0 = 0;
  if constexpr (kDirectBlock == 4)
    for (; m0 + 4 <= O; m0 += 4) direct_nt_rows<T, 4>(r, K, delta + m0 * L, in, koff, g + m0 * K);
  for (; m0 + 2 <= O; m0 += 2) direct_nt_rows<T, 2>(r, K, delta + m0 * L, in, koff, g + m0 * K);
  if (m0 < O) direct_nt_rows<T, 1>(r, K, delta + m0 * L, in, koff, g + m0 * K);
}

// dst[0:n] = src[0:n] and dst[0:n] += src[0:n] (distinct arrays): whole vectors, then one by one
template <typename T>
inline void copy_run(T* __restrict dst, const T* __restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + kVL<T> <= n; i += kVL<T>) store(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}
template <typename T>
inline void add_run(T* __restrict dst, const T* __restrict src, int64_t n) {
  int64_t i = 0;
  for (; i + kVL<T> <= n; i += kVL<T>) store(dst + i, load(dst + i) + load(src + i));
  for (; i < n; ++i) dst[i] += src[i];
}

// The patch matrix (C*kh*kw, L) of one chain's input, in F.unfold's order (zero padding), rows of
// stride ld >= L (the columns past L are zero).
template <typename T>
void im2col(const T* in, T* cols, int64_t ld, const int64_t* r) {
  const int64_t C = r[1], H = r[2], W = r[3], OH = r[5], OW = r[6], kh = r[7], kw = r[8];
  const int64_t sh = r[9], sw = r[10], ph = r[11], pw = r[12], dh = r[13], dw = r[14];
  const int64_t L = OH * OW;
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j) {
        T* row = cols + ((c * kh + i) * kw + j) * ld;
        for (int64_t oy = 0; oy < OH; ++oy) {
          const int64_t y = oy * sh + i * dh - ph;
          T* dst = row + oy * OW;
          if (y < 0 || y >= H) {
            for (int64_t ox = 0; ox < OW; ++ox) dst[ox] = T(0);
            continue;
          }
          const T* src = in + (c * H + y) * W;
          const int64_t x0 = j * dw - pw;
          if (sw == 1 && x0 >= 0 && x0 + OW <= W) {
            copy_run(dst, src + x0, OW);
          } else {
            for (int64_t ox = 0; ox < OW; ++ox) {
              const int64_t x = ox * sw + x0;
              dst[ox] = (x >= 0 && x < W) ? src[x] : T(0);
            }
          }
        }
        for (int64_t l = L; l < ld; ++l) row[l] = T(0);
      }
}

// Whether every pooling window lies inside the input (no padding, no ceil_mode overhang).
inline bool pool_inside(const int64_t* r) {
  const int64_t H = r[2], W = r[3], OH = r[4], OW = r[5], kh = r[6], kw = r[7];
  const int64_t sh = r[8], sw = r[9], ph = r[10], pw = r[11], dh = r[12], dw = r[13];
  return ph == 0 && pw == 0 && (OH - 1) * sh + (kh - 1) * dh < H && (OW - 1) * sw + (kw - 1) * dw < W;
}

// The max-pooling window of output (c, oy, ox): its value and the flat input index of its first
// maximum, or of its last NaN (ATen's rule: a NaN always replaces; a NaN must stay visible).
template <typename T>
inline int64_t pool_argmax(const T* a, const int64_t* r, int64_t c, int64_t oy, int64_t ox, T& best) {
  const int64_t H = r[2], W = r[3], kh = r[6], kw = r[7];
  const int64_t sh = r[8], sw = r[9], ph = r[10], pw = r[11], dh = r[12], dw = r[13];
  best = -std::numeric_limits<T>::infinity();
  int64_t arg = -1;
  for (int64_t i = 0; i < kh; ++i) {
    const int64_t y = oy * sh + i * dh - ph;
    if (y < 0 || y >= H) continue;
    for (int64_t j = 0; j < kw; ++j) {
      const int64_t x = ox * sw + j * dw - pw;
      if (x < 0 || x >= W) continue;
      const int64_t at = (c * H + y) * W + x;
      const T v = a[at];
      if (arg < 0 || v > best || std::isnan(v)) {
        best = v;
        arg = at;
      }
    }
  }
  return arg;
}

// N (8 or 4) 2x2 windows of stride 2 side by side (the windows at a[at + 2 t], t < N, rows W apart): the first
// maximum of each, or its last NaN, taken in forward_chain's order (0, 0), (0, 1), (1, 0), (1, 1) with its rule.
template <int N>
struct PoolLanes;
template <>
struct PoolLanes<8> {
  typedef float VT __attribute__((vector_size(32)));
  typedef int32_t IT __attribute__((vector_size(32)));
};
template <>
struct PoolLanes<4> {
  typedef float VT __attribute__((vector_size(16)));
  typedef int32_t IT __attribute__((vector_size(16)));
};

template <int N>
inline void pool2x2_lanes(const float* a, int64_t at, int64_t W, float* out, int32_t* arg) {
  using VT = typename PoolLanes<N>::VT;
  using IT = typename PoolLanes<N>::IT;
  IT even;
  for (int t = 0; t < N; ++t) even[t] = 2 * t;
  const IT odd = even + 1, pos = even + static_cast<int32_t>(at);
  const VT u0 = load<float, VT>(a + at), u1 = load<float, VT>(a + at + N);
  const VT w0 = load<float, VT>(a + at + W), w1 = load<float, VT>(a + at + W + N);
  VT best = __builtin_shuffle(u0, u1, even);
  IT idx = pos;
  auto take = [&](VT v, IT where) {
    const IT t = (v > best) | (v != v);
    best = t ? v : best;
    idx = t ? where : idx;
  };
  take(__builtin_shuffle(u0, u1, odd), pos + 1);
  take(__builtin_shuffle(w0, w1, even), pos + static_cast<int32_t>(W));
  take(__builtin_shuffle(w0, w1, odd), pos + static_cast<int32_t>(W + 1));
  store(out, best);
  __builtin_memcpy(arg, &idx, sizeof(idx));
}

template <typename T>
void forward_chain(const std::vector<int64_t>& spec, const std::vector<int64_t>& starts, const T* theta, T* acts,
                   int32_t* args, Scratch<T>& z) {
  for (size_t n = 0; n < starts.size(); ++n) {
    const int64_t* r = spec.data() + starts[n];
    switch (r[0]) {
      case LINEAR: {
        const int64_t in = r[1], out = r[2];
        T* o = acts + r[6];
        gemm_nt<T>(1, out, in, acts + r[5], in, theta + r[3], in, o, out);
        if (r[4] >= 0) {
          const T* b = theta + r[4];
          for (int64_t q = 0; q < out; ++q) o[q] += b[q];
        }
        break;
      }
      case CONV: {
        if (direct_conv(r, kVL<T>)) {
          direct_forward(r, theta, acts + r[17], acts + r[18], z.koff.data(), z.bias.data());
          break;
        }
        const int64_t C = r[1], O = r[4], L = r[5] * r[6], K = C * r[7] * r[8], ld = round_up(L, kNR<T>);
        T* cols = z.patches(n);
        im2col(acts + r[17], cols, ld, r);
        gemm_nn<T>(O, ld, K, theta + r[15], K, 1, cols, ld, z.work.data(), ld);
        T* o = acts + r[18];
        for (int64_t q = 0; q < O; ++q) {
          const T bias = r[16] >= 0 ? theta[r[16] + q] : T(0);
          const T* w = z.work.data() + q * ld;
          for (int64_t l = 0; l < L; ++l) o[q * L + l] = w[l] + bias;
        }
        break;
      }
      case RELU: case TANH: case SIGMOID: case IDENTITY: case GELU_TANH: case GELU_ERF: {
        const int64_t n = r[1];
        const T* a = acts + r[2];
        T* o = acts + r[3];
        if (r[0] == GELU_TANH) {
          // h cdf, and the derivative (3 a h^2 + 1) h (C / 2) (1 - t^2) + cdf with cdf = (t + 1) / 2
          T* slope = acts + r[4];
          for (int64_t i = 0; i < n; ++i) {
            const T h = a[i], h2 = h * h, t = std::tanh((h2 * T(kGeluA) + T(1)) * h * T(kGeluC));
            const T cdf = (t + T(1)) * T(0.5);
            o[i] = h * cdf;
            slope[i] = (h2 * T(3 * kGeluA) + T(1)) * h * T(0.5 * kGeluC) * (-(t * t) + T(1)) + cdf;
          }
        } else if (r[0] == GELU_ERF) {
          T* slope = acts + r[4];
          for (int64_t i = 0; i < n; ++i) {
            const T h = a[i], cdf = (std::erf(h * T(std::sqrt(0.5))) + T(1)) * T(0.5);
            o[i] = h * cdf;
            slope[i] = std::exp(h * h * T(-0.5)) * h * T(0.3989422804014327) + cdf;  // 1 / sqrt(2 pi)
          }
        } else if (r[0] == RELU) {
          // max(a, 0) that keeps a NaN (as torch.relu does)
          for (int64_t i = 0; i < n; ++i) o[i] = a[i] <= T(0) ? T(0) : a[i];
        } else if (r[0] == TANH) {
          for (int64_t i = 0; i < n; ++i) o[i] = std::tanh(a[i]);
        } else if (r[0] == SIGMOID) {
          for (int64_t i = 0; i < n; ++i) o[i] = T(1) / (T(1) + std::exp(-a[i]));
        } else {
          for (int64_t i = 0; i < n; ++i) o[i] = a[i];
        }
        break;
      }
      case MAXPOOL: {
        const int64_t C = r[1], H = r[2], W = r[3], OH = r[4], OW = r[5], kh = r[6], kw = r[7];
        const int64_t sh = r[8], sw = r[9], dh = r[12], dw = r[13];
        const T* a = acts + r[14];
        T* o = acts + r[15];
        int32_t* arg = args + r[16];
        const bool inside = pool_inside(r);
        for (int64_t c = 0; c < C; ++c)
          for (int64_t oy = 0; oy < OH; ++oy) {
            T* orow = o + (c * OH + oy) * OW;
            int32_t* grow = arg + (c * OH + oy) * OW;
            if (inside) {
              // the first maximum of each window, or its last NaN (ATen's rule), by selects along the
              // row of windows
              const int64_t first = (c * H + oy * sh) * W;
              int64_t done = 0;
              if constexpr (std::is_same_v<T, float>)
                if (kh == 2 && kw == 2 && sh == 2 && sw == 2 && dh == 1 && dw == 1) {
                  for (; done + 8 <= OW; done += 8) pool2x2_lanes<8>(a, first + 2 * done, W, orow + done, grow + done);
                  if (done + 4 <= OW) {
                    pool2x2_lanes<4>(a, first + 2 * done, W, orow + done, grow + done);
                    done += 4;
                  }
                }
              for (int64_t ox = done; ox < OW; ++ox) {
                orow[ox] = a[first + ox * sw];
                grow[ox] = static_cast<int32_t>(first + ox * sw);
              }
              for (int64_t i = 0; i < kh; ++i)
                for (int64_t j = 0; j < kw; ++j) {
                  const int64_t shift = first + i * dh * W + j * dw;
                  const T* arow = a + shift;
                  for (int64_t ox = done; ox < OW; ++ox) {
                    const T v = arow[ox * sw], b = orow[ox];
                    const bool take = (v > b) | (v != v);
                    orow[ox] = take ? v : b;
                    grow[ox] = take ? static_cast<int32_t>(shift + ox * sw) : grow[ox];
                  }
                }
            } else {
              for (int64_t ox = 0; ox < OW; ++ox) {
                T best;
                grow[ox] = static_cast<int32_t>(pool_argmax(a, r, c, oy, ox, best));
                orow[ox] = best;
              }
            }
          }
        break;
      }
    }
  }
}

// R rows q of a Linear layer's weight (from offset `at`, `in` entries each) in one pass: the input gradient
// next += W[q] delta[q] through the current weights, each entry's terms added in the order of q (as row after
// row would), then each row's step by mode from its score g = delta[q] h (entry_step(r, i): row r, entry i).
template <typename T, int R, typename Step>
inline void rows_pass(int64_t in, T* const* w, const T* d, T* next, Step entry_step) {
#pragma omp simd
  for (int64_t i = 0; i < in; ++i) {
    T nx = next[i];
    for (int r = 0; r < R; ++r) {
      nx += w[r][i] * d[r];
      entry_step(r, i);
    }
    next[i] = nx;
  }
}

template <typename T, int R>
inline void linear_rows(const Update<T>& up, int64_t at, int64_t in, const T* delta, const T* h, T* next) {
  T *w[R], *out[R];  // the weight rows, and (modes 0 and 3) their rows of grad or stat
  const T* sc[R];     // (mode 2) their rows of scale
  T d[R], gd[R];
  for (int r = 0; r < R; ++r) {
    w[r] = up.theta + at + r * in;
    out[r] = up.mode == 0 ? up.grad + at + r * in : up.mode == 3 ? up.stat + at + r * in : nullptr;
    sc[r] = up.mode == 2 ? up.scale + at + r * in : nullptr;
    d[r] = delta[r];
    gd[r] = up.gamma * d[r];
  }
  switch (up.mode) {
    case 0:
      rows_pass<T, R>(in, w, d, next, [&](int r, int64_t i) { out[r][i] = d[r] * h[i]; });
      break;
    case 1:
      rows_pass<T, R>(in, w, d, next, [&](int r, int64_t i) { w[r][i] += gd[r] * h[i]; });
      break;
    case 2:
      rows_pass<T, R>(in, w, d, next, [&](int r, int64_t i) { w[r][i] += gd[r] * h[i] * sc[r][i]; });
      break;
    default:
      rows_pass<T, R>(in, w, d, next, [&](int r, int64_t i) {
        const T gi = d[r] * h[i];
        w[r][i] += up.gamma * gi / (out[r][i] + up.ridge);
        out[r][i] = up.beta * out[r][i] + up.fold * gi * gi;
      });
  }
}

// Backward pass of one chain: z.delta holds the gradient with respect to the network's output on entry.
template <typename T>
void backward_chain(const std::vector<int64_t>& spec, const std::vector<int64_t>& starts, int64_t first_param,
                    const T* acts, const int32_t* args, Scratch<T>& z, const Update<T>& up) {
  const T* theta = up.theta;
  T* delta = z.delta.data();
  T* next = z.next.data();
  T* g = z.grad.data();
  for (int64_t n = static_cast<int64_t>(starts.size()) - 1; n >= first_param; --n) {
    const int64_t* r = spec.data() + starts[n];
    const bool need_input = n > first_param;
    switch (r[0]) {
      case LINEAR: {
        const int64_t in = r[1], out = r[2];
        const T* h = acts + r[5];
        if (need_input) {
          for (int64_t i = 0; i < in; ++i) next[i] = T(0);
          int64_t q = 0;
          for (; q + 4 <= out; q += 4) linear_rows<T, 4>(up, r[3] + q * in, in, delta + q, h, next);
          switch (out - q) {
            case 3: linear_rows<T, 3>(up, r[3] + q * in, in, delta + q, h, next); break;
            case 2: linear_rows<T, 2>(up, r[3] + q * in, in, delta + q, h, next); break;
            case 1: linear_rows<T, 1>(up, r[3] + q * in, in, delta + q, h, next); break;
            default: break;
          }
        } else {
          for (int64_t q = 0; q < out; ++q) {
            const T d = delta[q];
#pragma omp simd
            for (int64_t i = 0; i < in; ++i) g[i] = d * h[i];
            up.apply(r[3] + q * in, g, in);
          }
        }
        if (r[4] >= 0) up.apply(r[4], delta, out);
        if (need_input) std::swap(delta, next);
        break;
      }
      case CONV: {
        const int64_t C = r[1], H = r[2], W = r[3], O = r[4], OH = r[5], OW = r[6], kh = r[7], kw = r[8];
        const int64_t sh = r[9], sw = r[10], ph = r[11], pw = r[12], dh = r[13], dw = r[14];
        const int64_t L = OH * OW, K = C * kh * kw, ld = round_up(L, kNR<T>);
        // delta with rows of stride ld (zero past L)
        const T* wide = delta;
        if (ld != L) {
          T* w = z.wide.data();
          for (int64_t q = 0; q < O; ++q) {
            for (int64_t l = 0; l < L; ++l) w[q * ld + l] = delta[q * L + l];
            for (int64_t l = L; l < ld; ++l) w[q * ld + l] = T(0);
          }
          wide = w;
        }
        if (need_input) {
          // col2im of W^T delta, through the current weights
          T* dcols = z.work.data();
          gemm_nn<T>(K, ld, O, theta + r[15], 1, K, wide, ld, dcols, ld);
          for (int64_t i = 0; i < C * H * W; ++i) next[i] = T(0);
          for (int64_t c = 0; c < C; ++c)
            for (int64_t i = 0; i < kh; ++i)
              for (int64_t j = 0; j < kw; ++j) {
                const T* row = dcols + ((c * kh + i) * kw + j) * ld;
                const int64_t x0 = j * dw - pw;
                for (int64_t oy = 0; oy < OH; ++oy) {
                  const int64_t y = oy * sh + i * dh - ph;
                  if (y < 0 || y >= H) continue;
                  T* dst = next + (c * H + y) * W;
                  const T* src = row + oy * OW;
                  if (sw == 1 && x0 >= 0 && x0 + OW <= W) {
                    add_run(dst + x0, src, OW);
                  } else {
                    for (int64_t ox = 0; ox < OW; ++ox) {
                      const int64_t x = ox * sw + x0;
                      if (x >= 0 && x < W) dst[x] += src[ox];
                    }
                  }
                }
              }
        }
        if (direct_conv(r, kVL<T>)) {
          direct_weight_grad(r, delta, acts + r[17], z.koff.data(), g);
        } else {
          T* cols = z.patches(static_cast<size_t>(n));
          if (z.saved.empty()) im2col(acts + r[17], cols, ld, r);
          gemm_nt<T>(O, K, ld, wide, ld, cols, ld, g, K);
        }
        up.apply(r[15], g, O * K);
        if (r[16] >= 0) {
          row_sums(delta, O, L, g);
          up.apply(r[16], g, O);
        }
        if (need_input) std::swap(delta, next);
        break;
      }
      case RELU: case TANH: case SIGMOID: case IDENTITY: case GELU_TANH: case GELU_ERF: {
        const int64_t m = r[1];
        const T* post = acts + r[3];
        if (r[0] == GELU_TANH || r[0] == GELU_ERF) {
          const T* slope = acts + r[4];
          for (int64_t i = 0; i < m; ++i) delta[i] *= slope[i];
        } else if (r[0] == RELU) {
          // threshold_backward's rule: zero where the output is <= 0 (a NaN output passes the gradient)
          for (int64_t i = 0; i < m; ++i) delta[i] = post[i] <= T(0) ? T(0) : delta[i];
        } else if (r[0] == TANH) {
          for (int64_t i = 0; i < m; ++i) delta[i] *= T(1) - post[i] * post[i];
        } else if (r[0] == SIGMOID) {
          for (int64_t i = 0; i < m; ++i) delta[i] *= post[i] * (T(1) - post[i]);
        }
        break;
      }
      case MAXPOOL: {
        const int64_t n_in = r[1] * r[2] * r[3], n_out = r[1] * r[4] * r[5];
        const int32_t* arg = args + r[16];
        for (int64_t i = 0; i < n_in; ++i) next[i] = T(0);
        for (int64_t i = 0; i < n_out; ++i)
          if (arg[i] >= 0) next[arg[i]] += delta[i];
        std::swap(delta, next);
        break;
      }
    }
  }
}

struct Sizes {
  int64_t cols = 1, work = 1, wide = 1, act = 1, grad = 1, first_param = -1, n_in = 0, n_out = 0, saved = 0;
  int64_t conv_k = 1, conv_o = 1;  // the largest convolution's patch rows and channels
  std::vector<int64_t> col_off;  // per record: where its patch matrix sits in Scratch::saved

  template <typename T>
  Scratch<T> scratch(bool keep_patches = false) const {
    Scratch<T> z{std::vector<T>(cols), std::vector<T>(work),    std::vector<T>(wide),   std::vector<T>(act),
                 std::vector<T>(act),  std::vector<T>(grad),    std::vector<int64_t>(conv_k),
                 std::vector<T>(conv_o)};
    if (keep_patches && saved > 0) {
      z.saved.resize(saved);
      z.col_off = col_off;
    }
    return z;
  }
};

Sizes scratch_sizes(const std::vector<int64_t>& spec, const std::vector<int64_t>& starts) {
  Sizes z;
  for (size_t n = 0; n < starts.size(); ++n) {
    const int64_t* r = spec.data() + starts[n];
    int64_t in_n = 0, out_n = 0;
    switch (r[0]) {
      case LINEAR:
        in_n = r[1];
        out_n = r[2];
        z.grad = std::max({z.grad, r[1], r[2]});
        break;
      case CONV: {
        // rows padded for either scalar type
        const int64_t L = r[5] * r[6], ld = round_up(L, kMaxNR), K = r[1] * r[7] * r[8], O = r[4];
        z.cols = std::max(z.cols, K * ld);
        z.col_off.resize(starts.size(), -1);
        z.col_off[n] = z.saved;
        z.saved += K * ld;
        z.work = std::max({z.work, K * ld, O * ld});
        z.wide = std::max(z.wide, O * ld);
        z.grad = std::max(z.grad, O * K);
        z.conv_k = std::max(z.conv_k, K);
        z.conv_o = std::max(z.conv_o, O);
        in_n = r[1] * r[2] * r[3];
        out_n = O * L;
        break;
      }
      case MAXPOOL: in_n = r[1] * r[2] * r[3]; out_n = r[1] * r[4] * r[5]; break;
      default: in_n = out_n = r[1];
    }
    z.act = std::max({z.act, in_n, out_n});
    if (n == 0) z.n_in = in_n;
    z.n_out = out_n;
    if (z.first_param < 0 && (r[0] == LINEAR || r[0] == CONV)) z.first_param = static_cast<int64_t>(n);
  }
  return z;
}

// The preconditioner tensors of update modes 2 (scale: (1, d) or (B, d)) and 3 (stat: (B, d)).
void check_state(int64_t mode, int64_t B, int64_t d, const torch::Tensor& scale, const torch::Tensor& stat) {
  if (mode == 2)
    TORCH_CHECK(scale.device().is_cpu() && scale.is_contiguous() && scale.dim() == 2 && scale.size(1) == d &&
                    (scale.size(0) == 1 || scale.size(0) == B),
                "fused_sequential: the scale must be a contiguous CPU tensor of shape (1, ", d, ") or (", B, ", ", d,
                ")");
  if (mode == 3)
    TORCH_CHECK(stat.device().is_cpu() && stat.is_contiguous() && stat.dim() == 2 && stat.size(0) == B &&
                    stat.size(1) == d,
                "fused_sequential: the EMA statistic must be a contiguous CPU tensor of shape (", B, ", ", d, ")");
}

// An element-wise activation of one value, as forward_chain computes it; GELU's derivative into `slope`.
template <typename T>
inline T activate(int64_t kind, T a, T& slope) {
  switch (kind) {
    case RELU: return a <= T(0) ? T(0) : a;
    case TANH: return std::tanh(a);
    case SIGMOID: return T(1) / (T(1) + std::exp(-a));
    case GELU_TANH: {
      const T h2 = a * a, t = std::tanh((h2 * T(kGeluA) + T(1)) * a * T(kGeluC));
      const T cdf = (t + T(1)) * T(0.5);
      slope = (h2 * T(3 * kGeluA) + T(1)) * a * T(0.5 * kGeluC) * (-(t * t) + T(1)) + cdf;
      return a * cdf;
    }
    case GELU_ERF: {
      const T cdf = (std::erf(a * T(std::sqrt(0.5))) + T(1)) * T(0.5);
      slope = std::exp(a * a * T(-0.5)) * a * T(0.3989422804014327) + cdf;
      return a * cdf;
    }
    default: return a;
  }
}

// tanh of each lane. float: the rational approximation of Eigen's generic_fast_tanh_float (the one XLA, and so
// JAX on a CPU, uses), within a few units in the last place of std::tanh (a test checks it), on the whole
// vector at once; double: std::tanh lane by lane. A NaN stays NaN.
inline V<float> tanh_lanes(V<float> a) {
  constexpr int64_t W = kVL<float>;
  V<float> x = a;
  for (int64_t l = 0; l < W; ++l) x[l] = x[l] > 7.90531110763549805f ? 7.90531110763549805f
                                       : (x[l] < -7.90531110763549805f ? -7.90531110763549805f : x[l]);
  const V<float> x2 = x * x;
  V<float> p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = x2 * p + -8.60467152213735e-11f;
  p = x2 * p + 5.12229709037114e-08f;
  p = x2 * p + 1.48572235717979e-05f;
  p = x2 * p + 6.37261928875436e-04f;
  p = x2 * p + 4.89352455891786e-03f;
  p = x * p;
  V<float> q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = x2 * q + 2.26843463243900e-03f;
  q = x2 * q + 4.89352518554385e-03f;
  V<float> t = p / q;
  for (int64_t l = 0; l < W; ++l) t[l] = std::fabs(a[l]) < 0.0004f ? a[l] : t[l];
  return t;
}
inline V<double> tanh_lanes(V<double> a) {
  for (int64_t l = 0; l < kVL<double>; ++l) a[l] = std::tanh(a[l]);
  return a;
}

// Whether the network is an MLP: Linear layers and element-wise activations only.
inline bool is_mlp(const std::vector<int64_t>& spec, const std::vector<int64_t>& starts) {
  for (int64_t at : starts)
    if (spec[at] == CONV || spec[at] == MAXPOOL) return false;
  return true;
}

// An MLP (Linear layers and element-wise activations) run with the chains (or rows) in the lanes of a
// vector: kVL<T> of them at a time run the same operations side by side. Each lane is one chain, so its
// numbers do not depend on its neighbours or on its place: a last, partial group fills its spare lanes
// with copies of its last chain and keeps them out of the results. The operations are those of
// forward_chain / backward_chain, but each dot product is summed term by term (not in register blocks) and
// the float32 tanh is tanh_lanes; the element-wise activations, the response and its residual are taken
// lane by lane.
template <typename T>
struct Lanes {
  static constexpr int64_t W = kVL<T>;
  using VT = V<T>;
  const std::vector<int64_t>& spec;
  const std::vector<int64_t>& starts;
  const Sizes& z;
  int64_t d, mode;
  T beta, fold, ridge;
  const T* sc;       // mode 2: the shared scale (SC empty) 
  std::vector<VT> P, A, D, N, SC, ST, G;

  Lanes(const std::vector<int64_t>& spec_, const std::vector<int64_t>& starts_, const Sizes& z_, int64_t d_,
        int64_t n_acts, int64_t mode_, T beta_, T fold_, T ridge_, const T* shared_scale, bool per_chain_scale)
      : spec(spec_), starts(starts_), z(z_), d(d_), mode(mode_), beta(beta_), fold(fold_), ridge(ridge_),
        sc(shared_scale), P(d_), A(n_acts), D(z_.act), N(z_.act), SC(mode_ == 2 && per_chain_scale ? d_ : 0),
        ST(mode_ == 3 ? d_ : 0), G(mode_ == 0 || mode_ >= 4 ? d_ : 0) {}

  // rows[l] of a (rows, width) array into v[k][l] for k < n (and back)
  static void load(std::vector<VT>& v, const T* a, int64_t width, const int64_t* rows, int64_t n) {
    for (int64_t k = 0; k < n; ++k)
      for (int64_t l = 0; l < W; ++l) v[k][l] = a[rows[l] * width + k];
  }
  static void store(const std::vector<VT>& v, T* a, int64_t width, const int64_t* rows, int64_t nb, int64_t n) {
    for (int64_t k = 0; k < n; ++k)
      for (int64_t l = 0; l < nb; ++l) a[rows[l] * width + k] = v[k][l];
  }

  void forward() {
    for (int64_t at : starts) {
      const int64_t* r = spec.data() + at;
      if (r[0] == LINEAR) {
        const int64_t in = r[1], out = r[2];
        const VT* h = A.data() + r[5];
        for (int64_t q = 0; q < out; ++q) {
          VT acc = VT{};
          const VT* w = P.data() + r[3] + q * in;
          for (int64_t i = 0; i < in; ++i) acc += w[i] * h[i];
          A[r[6] + q] = r[4] >= 0 ? acc + P[r[4] + q] : acc;
        }
      } else if (r[0] == TANH) {
        for (int64_t i = 0; i < r[1]; ++i) A[r[3] + i] = tanh_lanes(A[r[2] + i]);
      } else if (r[0] == GELU_TANH) {  // activate's GELU, on whole vectors
        for (int64_t i = 0; i < r[1]; ++i) {
          const VT h = A[r[2] + i], h2 = h * h, t = tanh_lanes((h2 * T(kGeluA) + T(1)) * h * T(kGeluC));
          const VT cdf = (t + T(1)) * T(0.5);
          A[r[3] + i] = h * cdf;
          A[r[4] + i] = (h2 * T(3 * kGeluA) + T(1)) * h * T(0.5 * kGeluC) * (-(t * t) + T(1)) + cdf;
        }
      } else {
        const int64_t n = r[1];
        const bool gelu = r[0] == GELU_ERF;
        for (int64_t i = 0; i < n; ++i)
          for (int64_t l = 0; l < W; ++l) {
            T slope = T(0);
            A[r[3] + i][l] = activate<T>(r[0], A[r[2] + i][l], slope);
            if (gelu) A[r[4] + i][l] = slope;
          }
      }
    }
  }

  VT scale(int64_t k) const { return SC.empty() ? VT{} + sc[k] : SC[k]; }

  void apply(int64_t k, VT g, T gamma) {
    switch (mode) {
      case 1: P[k] += gamma * g; break;
      case 2: P[k] += gamma * g * scale(k); break;
      case 3:
        P[k] += gamma * g / (ST[k] + ridge);
        ST[k] = beta * ST[k] + fold * g * g;
        break;
      default: G[k] = g;  // modes 0, 4 and 5: the score
    }
  }

  // D holds the gradient with respect to the network's output on entry
  void backward(T gamma) {
    VT* delta = D.data();
    VT* next = N.data();
    for (int64_t n = static_cast<int64_t>(starts.size()) - 1; n >= z.first_param; --n) {
      const int64_t* r = spec.data() + starts[n];
      if (r[0] == LINEAR) {
        const int64_t in = r[1], out = r[2];
        const bool need_input = n > z.first_param;
        const VT* h = A.data() + r[5];
        if (need_input)
          for (int64_t i = 0; i < in; ++i) next[i] = VT{};
        for (int64_t q = 0; q < out; ++q) {
          const VT dq = delta[q];
          const int64_t base = r[3] + q * in;
          VT* wq = P.data() + base;
          if (need_input && (mode == 1 || mode == 2)) {
            // the input gradient through the current weight, then its step (backward_chain's order)
            const VT gd = gamma * dq;
            for (int64_t i = 0; i < in; ++i) {
              next[i] += wq[i] * dq;
              wq[i] += mode == 1 ? gd * h[i] : gd * h[i] * scale(base + i);
            }
            continue;
          }
          if (need_input)
            for (int64_t i = 0; i < in; ++i) next[i] += wq[i] * dq;
          for (int64_t i = 0; i < in; ++i) apply(base + i, dq * h[i], gamma);
        }
        if (r[4] >= 0)
          for (int64_t q = 0; q < out; ++q) apply(r[4] + q, delta[q], gamma);
        if (need_input) std::swap(delta, next);
      } else {
        const VT* post = A.data() + r[3];
        for (int64_t i = 0; i < r[1]; ++i) {
          if (r[0] == RELU) {
            for (int64_t l = 0; l < W; ++l) delta[i][l] = post[i][l] <= T(0) ? T(0) : delta[i][l];
          } else if (r[0] == TANH) {
            delta[i] *= T(1) - post[i] * post[i];
          } else if (r[0] == SIGMOID) {
            delta[i] *= post[i] * (T(1) - post[i]);
          } else if (r[0] == GELU_TANH || r[0] == GELU_ERF) {
            delta[i] *= A[r[4] + i];
          }
        }
      }
    }
  }
};

// The groups of kVL<T> rows of B: rows[l] of group g, its last row repeated in the spare lanes; returns nb.
template <typename T>
inline int64_t group_rows(int64_t g, int64_t B, int64_t* rows) {
  const int64_t W = kVL<T>, b0 = g * W, nb = std::min(W, B - b0);
  for (int64_t l = 0; l < W; ++l) rows[l] = b0 + std::min(l, nb - 1);
  return nb;
}

}  // namespace

// acts (B, A) receives every layer's input and the network's output; x (B, n_in) is copied to its
// first n_in entries by the caller.
void forward(const torch::Tensor& theta, torch::Tensor& acts, torch::Tensor& args, const std::vector<int64_t>& spec) {
  TORCH_CHECK(theta.is_contiguous() && acts.is_contiguous() && args.is_contiguous(),
              "fused_sequential: contiguous tensors expected");
  TORCH_CHECK(args.scalar_type() == torch::kInt32 && args.size(0) == theta.size(0), "fused_sequential: bad args");
  TORCH_CHECK(theta.device().is_cpu() && acts.device().is_cpu() && args.device().is_cpu(),
              "fused_sequential: CPU tensors expected");
  TORCH_CHECK(theta.size(0) == acts.size(0), "fused_sequential: theta and acts rows differ");
  const auto starts = record_starts(spec);
  const Sizes z = scratch_sizes(spec, starts);
  const int64_t B = theta.size(0), d = theta.size(1), A = acts.size(1), P = args.size(1);
  AT_DISPATCH_FLOATING_TYPES(theta.scalar_type(), "fused_sequential_forward", [&] {
    const scalar_t* th = theta.data_ptr<scalar_t>();
    scalar_t* ac = acts.data_ptr<scalar_t>();
    int32_t* ar = args.data_ptr<int32_t>();
    if (is_mlp(spec, starts)) {  // rows in the lanes of a vector
      constexpr int64_t W = kVL<scalar_t>;
      at::parallel_for(0, (B + W - 1) / W, 1, [&](int64_t gbegin, int64_t gend) {
        Lanes<scalar_t> ln(spec, starts, z, d, A, 0, 0, 0, 0, nullptr, false);
        for (int64_t grp = gbegin; grp < gend; ++grp) {
          int64_t rows[W];
          const int64_t nb = group_rows<scalar_t>(grp, B, rows);
          Lanes<scalar_t>::load(ln.P, th, d, rows, d);
          Lanes<scalar_t>::load(ln.A, ac, A, rows, z.n_in);
          ln.forward();
          Lanes<scalar_t>::store(ln.A, ac, A, rows, nb, A);
        }
      });
      return;
    }
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      auto scratch = z.scratch<scalar_t>();
      for (int64_t b = begin; b < end; ++b) forward_chain(spec, starts, th + b * d, ac + b * A, ar + b * P, scratch);
    });
  });
}

void backward(torch::Tensor& theta, const torch::Tensor& acts, const torch::Tensor& args, const torch::Tensor& cotangent,
              const std::vector<int64_t>& spec, int64_t mode, double gamma,
              torch::Tensor& grad, const torch::Tensor& scale, torch::Tensor& stat, double beta, double ridge) {
  TORCH_CHECK(theta.is_contiguous() && acts.is_contiguous() && cotangent.is_contiguous(),
              "fused_sequential: contiguous tensors expected");
  TORCH_CHECK(theta.device().is_cpu() && acts.device().is_cpu() && cotangent.device().is_cpu() &&
                  (mode != 0 || grad.device().is_cpu()),
              "fused_sequential: CPU tensors expected");
  const auto starts = record_starts(spec);
  const Sizes z = scratch_sizes(spec, starts);
  const int64_t B = theta.size(0), d = theta.size(1), A = acts.size(1), P = args.size(1), n_out = cotangent.size(1);
  TORCH_CHECK(args.scalar_type() == torch::kInt32 && args.is_contiguous() && args.size(0) == B,
              "fused_sequential: bad args");
  TORCH_CHECK(mode >= 0 && mode <= 3, "fused_sequential: unknown mode ", mode);
  TORCH_CHECK(cotangent.size(0) == B && n_out == z.n_out, "fused_sequential: the cotangent must be (", B, ", ",
              z.n_out, ")");
  TORCH_CHECK(acts.size(0) == B && args.size(1) >= 1, "fused_sequential: bad acts or args");
  if (mode == 0) TORCH_CHECK(grad.is_contiguous() && grad.size(0) == B && grad.size(1) == d, "bad grad");
  check_state(mode, B, d, scale, stat);
  AT_DISPATCH_FLOATING_TYPES(theta.scalar_type(), "fused_sequential_backward", [&] {
    scalar_t* th = theta.data_ptr<scalar_t>();
    const scalar_t* ac = acts.data_ptr<scalar_t>();
    const scalar_t* ct = cotangent.data_ptr<scalar_t>();
    const int32_t* ar = args.data_ptr<int32_t>();
    scalar_t* gr = mode == 0 ? grad.data_ptr<scalar_t>() : nullptr;
    const scalar_t* sc = mode == 2 ? scale.data_ptr<scalar_t>() : nullptr;
    const int64_t sc_stride = mode == 2 && scale.size(0) == B ? d : 0;
    scalar_t* st = mode == 3 ? stat.data_ptr<scalar_t>() : nullptr;
    if (is_mlp(spec, starts)) {  // rows in the lanes of a vector
      constexpr int64_t W = kVL<scalar_t>;
      at::parallel_for(0, (B + W - 1) / W, 1, [&](int64_t gbegin, int64_t gend) {
        Lanes<scalar_t> ln(spec, starts, z, d, A, mode, static_cast<scalar_t>(beta), static_cast<scalar_t>(1.0 - beta),
                           static_cast<scalar_t>(ridge), sc, sc_stride != 0);
        for (int64_t grp = gbegin; grp < gend; ++grp) {
          int64_t rows[W];
          const int64_t nb = group_rows<scalar_t>(grp, B, rows);
          Lanes<scalar_t>::load(ln.P, th, d, rows, d);
          Lanes<scalar_t>::load(ln.A, ac, A, rows, A);
          Lanes<scalar_t>::load(ln.D, ct, n_out, rows, n_out);
          if (!ln.SC.empty()) Lanes<scalar_t>::load(ln.SC, sc, sc_stride, rows, d);
          if (mode == 3) Lanes<scalar_t>::load(ln.ST, st, d, rows, d);
          ln.backward(static_cast<scalar_t>(gamma));
          if (mode == 0) Lanes<scalar_t>::store(ln.G, gr, d, rows, nb, d);
          if (mode != 0) Lanes<scalar_t>::store(ln.P, th, d, rows, nb, d);
          if (mode == 3) Lanes<scalar_t>::store(ln.ST, st, d, rows, nb, d);
        }
      });
      return;
    }
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      auto scratch = z.scratch<scalar_t>();
      for (int64_t b = begin; b < end; ++b) {
        Update<scalar_t> up{mode, static_cast<scalar_t>(gamma), static_cast<scalar_t>(beta),
                            static_cast<scalar_t>(1.0 - beta), static_cast<scalar_t>(ridge), th + b * d, gr ? gr + b * d : nullptr,
                            sc ? sc + b * sc_stride : nullptr, st ? st + b * d : nullptr};
        for (int64_t i = 0; i < n_out; ++i) scratch.delta[i] = ct[b * n_out + i];
        backward_chain(spec, starts, z.first_param, ac + b * A, ar + b * P, scratch, up);
      }
    });
  });
}

namespace {

// The residual d log f(y | x) / d out of one chain's response drawn from its noise, as
// smp_core.likelihoods computes it (sample_from_noise, then residual):
//   0 Bernoulli:   y = 1{u < sigmoid(g)},                       r = y - sigmoid(g)
//   1 categorical: y = #{c : cdf_c < u} (clamped to C - 1),     r = e_y - softmax(g)
//   2 Gaussian:    y = g + sigma z,                              r = (y - g) / sigma^2
template <typename T>
void residual_from_noise(int64_t likelihood, const T* out, const T* noise, int64_t m, T sigma, T* r) {
  if (likelihood == 0) {
    const T p = T(1) / (T(1) + std::exp(-out[0]));
    r[0] = (noise[0] < p ? T(1) : T(0)) - p;
  } else if (likelihood == 1) {
    T top = out[0];
    for (int64_t c = 1; c < m; ++c) top = out[c] > top ? out[c] : top;
    T total = T(0);
    for (int64_t c = 0; c < m; ++c) {
      r[c] = std::exp(out[c] - top);
      total += r[c];
    }
    int64_t y = 0;
    T cdf = T(0);
    for (int64_t c = 0; c < m; ++c) {
      r[c] = -(r[c] / total);
      cdf -= r[c];
      y += cdf < noise[0] ? 1 : 0;
    }
    r[std::min<int64_t>(y, m - 1)] += T(1);
  } else {
    for (int64_t c = 0; c < m; ++c) r[c] = ((out[c] + sigma * noise[c]) - out[c]) / (sigma * sigma);
  }
}

}  // namespace

namespace {

// Steps of every chain: for step j, chain b's input is row rows(j, b) of x, its noise
// noise[(j * B + b) * width ...] and its step size gammas[j]; each chain runs all its steps on one thread
// (chains are independent within a block: each reads only its own row of theta and of an EMA statistic,
// and a shared scale is read-only), with its activations in per-thread scratch; an MLP's chains run in the
// lanes of a vector instead (run_steps_lanes, modes 1 to 5).
// The matrices of modes 4 and 5: block b covers theta[offsets[b] : offsets[b] + sizes[b]]; data[b] points at its
// (1 or B, n, n) matrices, stride[b] = n * n when each chain has its own, 0 when they are shared.
template <typename T>
struct Matrices {
  std::vector<int64_t> offsets, sizes, strides;
  std::vector<const T*> data;
};

// theta[o + j] += gamma * sum_i g[o + i] M[i, j] for every block (M symmetric: g M = (M g)^T)
template <typename T>
void matrix_step(const Matrices<T>& m, int64_t b, const T* g, T gamma, T* theta, T* y) {
  for (size_t k = 0; k < m.sizes.size(); ++k) {
    const int64_t o = m.offsets[k], n = m.sizes[k];
    const T* M = m.data[k] + b * m.strides[k];
    for (int64_t j = 0; j < n; ++j) y[j] = T(0);
    for (int64_t i = 0; i < n; ++i) {
      const T gi = g[o + i];
      const T* Mi = M + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) y[j] += gi * Mi[j];
    }
    T* th = theta + o;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) th[j] += gamma * y[j];
  }
}

// The eigendecomposition of a symmetric n x n matrix a (overwritten) by cyclic Jacobi rotations, in double:
// the eigenvalues on a's diagonal, the eigenvectors in the columns of v.
inline void jacobi_eigen(std::vector<double>& a, std::vector<double>& v, int64_t n) {
  for (int64_t i = 0; i < n * n; ++i) v[i] = 0.0;
  for (int64_t i = 0; i < n; ++i) v[i * n + i] = 1.0;
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) (i == j ? scale : off) += a[i * n + j] * a[i * n + j];
    if (off <= 1e-30 * scale || off == 0.0) return;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a[p * n + q];
        if (apq == 0.0) continue;
        const double theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), sn = t * c;
        for (int64_t k = 0; k < n; ++k) {  // columns p, q of a
          const double akp = a[k * n + p], akq = a[k * n + q];
          a[k * n + p] = c * akp - sn * akq;
          a[k * n + q] = sn * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[p * n + k], aqk = a[q * n + k];
          a[p * n + k] = c * apk - sn * aqk;
          a[q * n + k] = sn * apk + c * aqk;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double vkp = v[k * n + p], vkq = v[k * n + q];
          v[k * n + p] = c * vkp - sn * vkq;
          v[k * n + q] = sn * vkp + c * vkq;
        }
      }
  }
}

// The square root of a positive pivot, and whether it is one: of a number, or of each lane of a vector
// (bad[l] set where lane l's is not).
template <typename T>
inline T pivot_root(T s, bool* bad) {
  bad[0] = bad[0] || !(s > T(0));
  return std::sqrt(s);
}
template <typename T>
inline V<T> pivot_root(V<T> s, bool* bad) {
  V<T> r;
  for (int64_t l = 0; l < kVL<T>; ++l) {
    bad[l] = bad[l] || !(s[l] > T(0));
    r[l] = std::sqrt(s[l]);
  }
  return r;
}

// L L^T = M + ridge I (the lower triangle, as LAPACK reads M), then y = (L L^T)^{-1} g, on numbers (E = T)
// or side by side on the lanes of vectors (E = V<T>, each lane one chain's matrix): the same operations in
// the same order. bad[l] is set where a pivot was not positive (that lane's y is then meaningless).
template <typename E, typename T>
void cholesky_solve(const E* M, const E* g, E* y, E* L, int64_t n, T ridge, bool* bad) {
  for (int64_t j = 0; j < n; ++j) {
    E s = M[j * n + j] + ridge;
    for (int64_t k = 0; k < j; ++k) s -= L[j * n + k] * L[j * n + k];
    const E ljj = pivot_root<T>(s, bad);
    L[j * n + j] = ljj;
    for (int64_t i = j + 1; i < n; ++i) {
      E t = M[i * n + j];
      for (int64_t k = 0; k < j; ++k) t -= L[i * n + k] * L[j * n + k];
      L[i * n + j] = t / ljj;
    }
  }
  for (int64_t i = 0; i < n; ++i) {  // L z = g, then L^T y = z
    E t = g[i];
    for (int64_t k = 0; k < i; ++k) t -= L[i * n + k] * y[k];
    y[i] = t / L[i * n + i];
  }
  for (int64_t i = n - 1; i >= 0; --i) {
    E t = y[i];
    for (int64_t k = i + 1; k < n; ++k) t -= L[k * n + i] * y[k];
    y[i] = t / L[i * n + i];
  }
}

// y = (M + ridge I)^{-1} g for one chain's n x n statistic M, by Cholesky in T (cholesky_solve); where it
// fails, in double from the eigendecomposition of (M + M^T) / 2 with the negative eigenvalues set to 0 (NaN
// for a non-finite M). Returns whether the double-precision redo was taken.
template <typename T>
bool ema_solve(const T* M, const T* g, T* y, int64_t n, T ridge, std::vector<T>& L, std::vector<double>& work) {
  bool bad = false;
  cholesky_solve(M, g, y, L.data(), n, ridge, &bad);
  if (!bad) return false;
  bool finite = true;
  for (int64_t i = 0; i < n * n; ++i) finite = finite && std::isfinite(static_cast<double>(M[i]));
  if (!finite) {
    for (int64_t i = 0; i < n; ++i) y[i] = std::numeric_limits<T>::quiet_NaN();
    return true;
  }
  double* a = work.data();
  std::vector<double> v(n * n);
  std::vector<double> aa(n * n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) aa[i * n + j] = 0.5 * (static_cast<double>(M[i * n + j]) + M[j * n + i]);
  jacobi_eigen(aa, v, n);
  // y = V diag(1 / (max(lambda, 0) + ridge)) V^T g
  for (int64_t k = 0; k < n; ++k) {
    double proj = 0.0;
    for (int64_t i = 0; i < n; ++i) proj += v[i * n + k] * static_cast<double>(g[i]);
    a[k] = proj / (std::max(aa[k * n + k], 0.0) + static_cast<double>(ridge));
  }
  for (int64_t i = 0; i < n; ++i) {
    double t = 0.0;
    for (int64_t k = 0; k < n; ++k) t += v[i * n + k] * a[k];
    y[i] = static_cast<T>(t);
  }
  return true;
}

// mode 5 for one chain: solve with each block's statistic, step theta, fold g g^T into the statistic.
// Returns the number of solves redone in double whose result is finite.
template <typename T>
int64_t ema_matrix_step(const Matrices<T>& m, int64_t b, const T* g, T gamma, T beta, T fold, T ridge, T* theta,
                        T* y, std::vector<T>& L, std::vector<double>& work) {
  int64_t redone = 0;
  for (size_t k = 0; k < m.sizes.size(); ++k) {
    const int64_t o = m.offsets[k], n = m.sizes[k];
    T* M = const_cast<T*>(m.data[k]) + b * m.strides[k];
    const T* gb = g + o;
    if (ema_solve(M, gb, y, n, ridge, L, work)) {
      bool finite = true;
      for (int64_t j = 0; j < n; ++j) finite = finite && std::isfinite(static_cast<double>(y[j]));
      redone += finite ? 1 : 0;
    }
    T* th = theta + o;
    for (int64_t j = 0; j < n; ++j) th[j] += gamma * y[j];
    for (int64_t i = 0; i < n; ++i) {
      const T gi = gb[i];
      T* Mi = M + i * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) Mi[j] = beta * Mi[j] + fold * (gi * gb[j]);
    }
  }
  return redone;
}

// mode 5 for the kVL<T> chains of an MLP's lanes (ema_matrix_step side by side): each block's statistic MS[k]
// (n * n vectors, lane l chain l's entries), the score in G. The Cholesky solve of every lane is ema_solve's
// (cholesky_solve on vectors; up to the fusion of multiply-adds, see the top of this file); a lane whose
// factorisation fails is solved again alone by ema_solve (in double, from the eigendecomposition), the spare
// lanes of a partial group taking their chain's result. Returns the number of such solves among the first nb
// lanes (the real chains) whose result is finite. Per thread it holds 2 n^2 vectors for the largest block
// (for a dense d = 1,000 in float32, 64 MB), against n^2 numbers per chain for the statistics themselves.
template <typename T>
struct EmaLanes {
  using VT = V<T>;
  static constexpr int64_t W = kVL<T>;
  std::vector<std::vector<VT>> MS;
  std::vector<VT> L, Y;
  std::vector<T> m1, g1, y1, l1;  // one lane's block, for ema_solve
  std::vector<double> work;

  explicit EmaLanes(const Matrices<T>& m) : MS(m.sizes.size()) {
    int64_t largest = 1;
    for (size_t k = 0; k < m.sizes.size(); ++k) {
      MS[k].resize(m.sizes[k] * m.sizes[k]);
      largest = std::max(largest, m.sizes[k]);
    }
    L.resize(largest * largest);
    Y.resize(largest);
    m1.resize(largest * largest);
    l1.resize(largest * largest);
    g1.resize(largest);
    y1.resize(largest);
    work.resize(largest);
  }

  // the group's statistics from the (B, n, n) tensors, and back (the first nb lanes)
  void load(const Matrices<T>& m, const int64_t* chain) {
    for (size_t k = 0; k < MS.size(); ++k)
      for (int64_t i = 0; i < static_cast<int64_t>(MS[k].size()); ++i)
        for (int64_t l = 0; l < W; ++l) MS[k][i][l] = m.data[k][chain[l] * m.strides[k] + i];
  }
  void store(const Matrices<T>& m, const int64_t* chain, int64_t nb) const {
    for (size_t k = 0; k < MS.size(); ++k)
      for (int64_t i = 0; i < static_cast<int64_t>(MS[k].size()); ++i)
        for (int64_t l = 0; l < nb; ++l) const_cast<T*>(m.data[k])[chain[l] * m.strides[k] + i] = MS[k][i][l];
  }

  int64_t step(const Matrices<T>& m, const std::vector<VT>& G, std::vector<VT>& P, T gamma, T beta, T fold, T ridge,
               int64_t nb) {
    int64_t redone = 0;
    for (size_t k = 0; k < MS.size(); ++k) {
      const int64_t o = m.offsets[k], n = m.sizes[k];
      VT* M = MS[k].data();
      const VT* g = G.data() + o;
      bool bad[W] = {};
      cholesky_solve(static_cast<const VT*>(M), g, Y.data(), L.data(), n, ridge, bad);
      bool any = false;
      for (int64_t l = 0; l < W; ++l) any = any || bad[l];
      for (int64_t l = 0; any && l < nb; ++l) {
        if (!bad[l]) continue;
        for (int64_t i = 0; i < n * n; ++i) m1[i] = M[i][l];
        for (int64_t i = 0; i < n; ++i) g1[i] = g[i][l];
        bool finite = ema_solve(m1.data(), g1.data(), y1.data(), n, ridge, l1, work);
        for (int64_t i = 0; i < n; ++i) {
          finite = finite && std::isfinite(static_cast<double>(y1[i]));
          Y[i][l] = y1[i];
        }
        redone += finite ? 1 : 0;
      }
      for (int64_t l = nb; any && l < W; ++l)  // the spare lanes: copies of chain nb - 1
        for (int64_t i = 0; i < n; ++i) Y[i][l] = Y[i][nb - 1];
      for (int64_t j = 0; j < n; ++j) P[o + j] += gamma * Y[j];
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) M[i * n + j] = beta * M[i * n + j] + fold * (g[i] * g[j]);
    }
    return redone;
  }
};

// The whole steps of an MLP, lanes of chains (modes 1 to 5). Returns the solves of mode 5 redone in double.
template <typename T, typename Rows>
int64_t run_steps_lanes(T* th, int64_t B, int64_t d, const T* xs, int64_t n_in, Rows rows, const T* ns, int64_t width,
                     const T* gammas, int64_t n_steps, const std::vector<int64_t>& spec,
                     const std::vector<int64_t>& starts, const Sizes& z, int64_t n_acts, int64_t out_offset,
                     int64_t n_out, int64_t likelihood, double sigma, int64_t mode, const T* sc, int64_t sc_stride,
                     T* st, double beta, double ridge, const Matrices<T>* matrices) {
  constexpr int64_t W = kVL<T>;
  using VT = V<T>;
  const int64_t groups = (B + W - 1) / W;
  std::atomic<int64_t> redone{0};
  at::parallel_for(0, groups, 1, [&](int64_t gbegin, int64_t gend) {
    Lanes<T> ln(spec, starts, z, d, n_acts, mode, static_cast<T>(beta), static_cast<T>(1.0 - beta),
                static_cast<T>(ridge), sc, sc_stride != 0);
    std::optional<EmaLanes<T>> ema;
    if (mode == 5) ema.emplace(*matrices);
    int64_t mine = 0;
    std::vector<T> out_l(n_out), r_l(n_out);
    std::vector<VT> Y;
    if (mode == 4) {
      int64_t largest = 1;
      for (int64_t n : matrices->sizes) largest = std::max(largest, n);
      Y.resize(largest);
    }
    for (int64_t grp = gbegin; grp < gend; ++grp) {
      int64_t chain[W];
      const int64_t nb = group_rows<T>(grp, B, chain);
      Lanes<T>::load(ln.P, th, d, chain, d);
      if (!ln.SC.empty()) Lanes<T>::load(ln.SC, sc, sc_stride, chain, d);
      if (mode == 3) Lanes<T>::load(ln.ST, st, d, chain, d);
      if (mode == 5) ema->load(*matrices, chain);
      for (int64_t j = 0; j < n_steps; ++j) {
        const T gamma = gammas[j];
        for (int64_t l = 0; l < W; ++l) {
          const T* x = xs + rows(j, chain[l]) * n_in;
          for (int64_t i = 0; i < n_in; ++i) ln.A[i][l] = x[i];
        }
        ln.forward();
        for (int64_t l = 0; l < W; ++l) {  // the response from the noise and its residual, chain by chain
          for (int64_t c = 0; c < n_out; ++c) out_l[c] = ln.A[out_offset + c][l];
          residual_from_noise<T>(likelihood, out_l.data(), ns + (j * B + chain[l]) * width, n_out,
                                 static_cast<T>(sigma), r_l.data());
          for (int64_t c = 0; c < n_out; ++c) ln.D[c][l] = r_l[c];
        }
        ln.backward(gamma);
        if (mode == 4) {  // theta[o + j] += gamma * sum_i g[o + i] M[i, j], block by block (matrix_step)
          for (size_t k = 0; k < matrices->sizes.size(); ++k) {
            const int64_t o = matrices->offsets[k], n = matrices->sizes[k], stride = matrices->strides[k];
            const T* M = matrices->data[k];
            for (int64_t jj = 0; jj < n; ++jj) Y[jj] = VT{};
            for (int64_t i = 0; i < n; ++i) {
              const VT gi = ln.G[o + i];
              for (int64_t jj = 0; jj < n; ++jj) {
                VT mij;
                for (int64_t l = 0; l < W; ++l) mij[l] = M[chain[l] * stride + i * n + jj];
                Y[jj] += gi * mij;
              }
            }
            for (int64_t jj = 0; jj < n; ++jj) ln.P[o + jj] += gamma * Y[jj];
          }
        }
        if (mode == 5) mine += ema->step(*matrices, ln.G, ln.P, gamma, ln.beta, ln.fold, ln.ridge, nb);
      }
      Lanes<T>::store(ln.P, th, d, chain, nb, d);
      if (mode == 3) Lanes<T>::store(ln.ST, st, d, chain, nb, d);
      if (mode == 5) ema->store(*matrices, chain, nb);
    }
    redone += mine;
  });
  return redone.load();
}

template <typename T, typename Rows>
int64_t run_steps(T* th, int64_t B, int64_t d, const T* xs, int64_t n_in, Rows rows, const T* ns, int64_t width,
               const T* gammas, int64_t n_steps, const std::vector<int64_t>& spec, const std::vector<int64_t>& starts,
               const Sizes& z, int64_t n_acts, int64_t n_args, int64_t out_offset, int64_t n_out, int64_t likelihood,
               double sigma, int64_t mode, const T* sc, int64_t sc_stride, T* st, double beta, double ridge,
               const Matrices<T>* matrices) {
  if (is_mlp(spec, starts))
    return run_steps_lanes(th, B, d, xs, n_in, rows, ns, width, gammas, n_steps, spec, starts, z, n_acts, out_offset,
                           n_out, likelihood, sigma, mode, sc, sc_stride, st, beta, ridge, matrices);
  std::atomic<int64_t> redone{0};
  const bool matrices_mode = mode == 4 || mode == 5;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    auto scratch = z.scratch<T>(/*keep_patches=*/true);
    std::vector<T> acts(n_acts);
    std::vector<int32_t> args(std::max<int64_t>(n_args, 1));
    // modes 4 and 5: the backward pass writes the score (mode 0), then the matrices step theta
    std::vector<T> score(matrices_mode ? d : 0), y(matrices_mode ? d : 0), L;
    std::vector<double> work;
    if (mode == 5) {
      int64_t largest = 1;
      for (int64_t n : matrices->sizes) largest = std::max(largest, n);
      L.resize(largest * largest);
      work.resize(largest);
    }
    int64_t mine = 0;
    const T b_beta = static_cast<T>(beta), b_fold = static_cast<T>(1.0 - beta), b_ridge = static_cast<T>(ridge);
    for (int64_t b = begin; b < end; ++b) {
      T* row = th + b * d;
      Update<T> up{matrices_mode ? 0 : mode, T(0), b_beta, b_fold, b_ridge, row, matrices_mode ? score.data() : nullptr,
                   sc ? sc + b * sc_stride : nullptr, st ? st + b * d : nullptr};
      for (int64_t j = 0; j < n_steps; ++j) {
        const T* x = xs + rows(j, b) * n_in;
        std::copy(x, x + n_in, acts.begin());
        forward_chain(spec, starts, static_cast<const T*>(row), acts.data(), args.data(), scratch);
        residual_from_noise<T>(likelihood, acts.data() + out_offset, ns + (j * B + b) * width, n_out,
                               static_cast<T>(sigma), scratch.delta.data());
        up.gamma = gammas[j];
        backward_chain(spec, starts, z.first_param, static_cast<const T*>(acts.data()), args.data(), scratch, up);
        if (mode == 4) matrix_step(*matrices, b, static_cast<const T*>(score.data()), gammas[j], row, y.data());
        if (mode == 5)
          mine += ema_matrix_step(*matrices, b, static_cast<const T*>(score.data()), gammas[j], b_beta, b_fold, b_ridge,
                                  row, y.data(), L, work);
      }
    }
    redone += mine;
  });
  return redone.load();
}

// The matrices of modes 4 and 5, checked: blocks = [offset, size, ...] tiling theta's d entries in order, one
// contiguous (1 or B, n, n) tensor of theta's dtype per block.
template <typename T>
Matrices<T> matrices_of(const std::vector<int64_t>& blocks, const std::vector<torch::Tensor>& factors, int64_t B,
                        int64_t d, at::ScalarType dtype, bool per_chain) {
  Matrices<T> m;
  TORCH_CHECK(blocks.size() == 2 * factors.size() && !factors.empty(),
              "fused_sequential: modes 4 and 5 need one (offset, size) pair per matrix");
  int64_t at = 0;
  for (size_t k = 0; k < factors.size(); ++k) {
    const int64_t o = blocks[2 * k], n = blocks[2 * k + 1];
    const torch::Tensor& f = factors[k];
    TORCH_CHECK(o == at && n >= 1 && o + n <= d, "fused_sequential: the blocks must tile theta's entries in order");
    TORCH_CHECK(f.device().is_cpu() && f.is_contiguous() && f.scalar_type() == dtype && f.dim() == 3 &&
                    ((f.size(0) == 1 && !per_chain) || f.size(0) == B) && f.size(1) == n && f.size(2) == n,
                "fused_sequential: the matrix of block ", k, " must be a contiguous CPU tensor of theta's dtype of "
                "shape (", per_chain ? "" : "1 or ", B, ", ", n, ", ", n, ")");
    m.offsets.push_back(o);
    m.sizes.push_back(n);
    m.strides.push_back(f.size(0) == B && B > 1 ? n * n : 0);
    m.data.push_back(f.data_ptr<T>());
    at = o + n;
  }
  TORCH_CHECK(at == d, "fused_sequential: the blocks must cover theta's ", d, " entries");
  return m;
}

void check_step(const torch::Tensor& theta, const torch::Tensor& x, const torch::Tensor& noise, const Sizes& z,
                int64_t n_rows, int64_t n_acts, int64_t out_offset, int64_t n_out, int64_t likelihood, int64_t mode) {
  TORCH_CHECK(theta.is_contiguous() && x.is_contiguous() && noise.is_contiguous(),
              "fused_sequential: contiguous tensors expected");
  TORCH_CHECK(theta.device().is_cpu() && x.device().is_cpu() && noise.device().is_cpu(),
              "fused_sequential: CPU tensors expected");
  const int64_t B = theta.size(0);
  TORCH_CHECK(noise.numel() == n_rows * B * (likelihood == 2 ? n_out : 1),
              "fused_sequential: the noise must have one value per response");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == z.n_in && n_out == z.n_out, "fused_sequential: x must have ", z.n_in,
              " features and the network ", z.n_out, " outputs");
  TORCH_CHECK(n_acts >= 1 && out_offset + n_out <= n_acts, "fused_sequential: bad activation sizes");
  TORCH_CHECK(likelihood != 0 || n_out == 1, "fused_sequential: a Bernoulli likelihood needs one output");
  TORCH_CHECK(x.scalar_type() == theta.scalar_type() && noise.scalar_type() == theta.scalar_type(),
              "fused_sequential: x, noise and theta must have one dtype");
  TORCH_CHECK(mode >= 1 && mode <= 5, "fused_sequential: step mode must be 1 to 5, got ", mode);
}

}  // namespace

// A block of n whole SMP steps of every chain: forward pass, response drawn from its noise, residual,
// backward pass with the parameter step (modes 1-5). Step j of chain b takes row draws[j, b] of x_train,
// the noise noise[j, b] and the step size gammas[j] (theta's dtype); each chain runs its steps back to
// back (run_steps, run_steps_lanes), so a block gives the numbers of its steps taken one by one.
int64_t steps(torch::Tensor& theta, const torch::Tensor& x_train, const torch::Tensor& draws, const torch::Tensor& noise,
           const torch::Tensor& gammas, const std::vector<int64_t>& spec, int64_t n_acts, int64_t n_args,
           int64_t out_offset, int64_t n_out, int64_t likelihood, double sigma, int64_t mode,
           const torch::Tensor& scale, torch::Tensor& stat, double beta, double ridge,
           const std::vector<int64_t>& blocks, const std::vector<torch::Tensor>& factors) {
  const auto starts = record_starts(spec);
  const Sizes z = scratch_sizes(spec, starts);
  const int64_t n = draws.dim() == 2 ? draws.size(0) : -1, B = theta.size(0), d = theta.size(1);
  TORCH_CHECK(n >= 0 && draws.size(1) == B && draws.scalar_type() == torch::kInt64 && draws.is_contiguous() &&
                  draws.device().is_cpu(),
              "fused_sequential: draws must be a contiguous CPU int64 tensor of shape (steps, ", B, ")");
  TORCH_CHECK(gammas.dim() == 1 && gammas.size(0) == n && gammas.scalar_type() == theta.scalar_type() &&
                  gammas.is_contiguous() && gammas.device().is_cpu(),
              "fused_sequential: gammas must be a contiguous CPU tensor of theta's dtype, one per step");
  check_step(theta, x_train, noise, z, n, n_acts, out_offset, n_out, likelihood, mode);
  check_state(mode, B, d, scale, stat);
  const int64_t N = x_train.size(0);
  const int64_t* rows = draws.data_ptr<int64_t>();
  for (int64_t i = 0; i < n * B; ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < N, "fused_sequential: a draw indexes row ", rows[i], " of ", N);
  int64_t redone = 0;
  AT_DISPATCH_FLOATING_TYPES(theta.scalar_type(), "fused_sequential_steps", [&] {
    Matrices<scalar_t> matrices;
    if (mode >= 4) matrices = matrices_of<scalar_t>(blocks, factors, B, d, theta.scalar_type(), mode == 5);
    redone = run_steps<scalar_t>(theta.data_ptr<scalar_t>(), B, d, x_train.data_ptr<scalar_t>(), x_train.size(1),
                        [rows, B](int64_t j, int64_t b) { return rows[j * B + b]; }, noise.data_ptr<scalar_t>(),
                        n * B > 0 ? noise.numel() / (n * B) : 1, gammas.data_ptr<scalar_t>(), n, spec, starts, z, n_acts,
                        n_args, out_offset, n_out, likelihood, sigma, mode,
                        mode == 2 ? scale.data_ptr<scalar_t>() : nullptr, mode == 2 && scale.size(0) == B ? d : 0,
                        mode == 3 ? stat.data_ptr<scalar_t>() : nullptr, beta, ridge, &matrices);
  });
  return redone;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while the chains run (on other threads, Python may go on)
  m.def("forward", &forward, "forward pass of every chain", py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward, "backward pass of every chain, with the parameter step",
        py::call_guard<py::gil_scoped_release>());
  m.def("steps", &steps, "a block of SMP steps of every chain, each chain's steps on one thread",
        py::call_guard<py::gil_scoped_release>());
}
