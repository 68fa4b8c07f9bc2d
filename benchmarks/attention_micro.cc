// The blocked attention kernel alone (paddletune/kernels/attention_core.h), no paddle: forward and
// backward seconds and GFLOP/s on [1, N, S, D] causal, best of --reps. Build and run:
//   g++ -O3 -march=native -fopenmp -I paddletune/kernels benchmarks/attention_micro.cc -o /tmp/attn_micro
//   OMP_NUM_THREADS=2 /tmp/attn_micro [S=4096] [N=8] [D=32] [reps=5]
// FLOPs counted as cpu_ceiling.py counts attention: 4 * S(S+1)/2 * N * D forward (causal = half of
// the [S, S] products), twice that backward (what the backward needs, not the kernel's recomputation).
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "attention_core.h"

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? atol(argv[1]) : 4096, N = argc > 2 ? atol(argv[2]) : 8;
  const int64_t D = argc > 3 ? atol(argv[3]) : 32, reps = argc > 4 ? atol(argv[4]) : 5;
  ptattn::Problem P;
  P.B = 1, P.N = N, P.K = N, P.S = S, P.T = S, P.D = D, P.g = 1, P.past = 0;
  P.scale = 1.f / std::sqrt(static_cast<float>(D)), P.causal = true;
  std::mt19937 gen(0);
  std::normal_distribution<float> nd;
  const size_t n = N * S * D;
  std::vector<float> q(n), k(n), v(n), o(n), go(n), dq(n), dk(n), dv(n), lse(N * S);
  for (auto* x : {&q, &k, &v, &go})
    for (auto& e : *x) e = nd(gen);
  // wall seconds, or with CPU=1 in the environment process CPU seconds (all threads: with one
  // thread, the time on a core, which other processes on a shared machine do not inflate)
  const bool cpu = getenv("CPU") && atoi(getenv("CPU"));
  auto now = [cpu]() {
    if (!cpu) return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
  };
  double bf = 1e9, bb = 1e9;
  for (int64_t r = 0; r < reps; ++r) {
    const double t0 = now();
    ptattn::forward(P, q.data(), k.data(), v.data(), o.data(), lse.data());
    const double t1 = now();
    ptattn::backward(P, q.data(), k.data(), v.data(), o.data(), lse.data(), go.data(), dq.data(), dk.data(),
                     dv.data());
    const double t2 = now();
    bf = std::min(bf, t1 - t0);
    bb = std::min(bb, t2 - t1);
  }
  const double ff = 4.0 * (S * (S + 1) / 2) * N * D;
  printf("S=%ld N=%ld D=%ld: fwd %.1f ms (%.1f GFLOP/s), bwd %.1f ms (%.1f GFLOP/s), fwd+bwd %.1f ms (%.1f GFLOP/s)"
         " checksum %.4f\n", (long)S, (long)N, (long)D, bf * 1e3, ff / bf / 1e9, bb * 1e3, 2 * ff / bb / 1e9,
         (bf + bb) * 1e3, 3 * ff / (bf + bb) / 1e9, (double)(o[7] + dq[11] + dk[13] + dv[17]));
  return 0;
}
