// tiledispatch_example [--trust KEY.pub] SOURCE M N K OUT [KERNEL]: load a bundle directory, or the cpu bundle
// of an extracted pack (a directory holding tdpack.json; with --trust its signature is checked), run an fp32
// GEMM D = A @ B on host memory with the named kernel or the first that fits, and write A, B and D (float32,
// in that order) to OUT. Prints one JSON line.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tiledispatch_loader.h"

int main(int argc, char** argv) {
  std::string trust;
  if (argc > 2 && std::string(argv[1]) == "--trust") {
    trust = argv[2];
    argc -= 2;
    argv += 2;
  }
  if (argc < 6 || argc > 7) {
    std::fprintf(stderr, "usage: tiledispatch_example [--trust KEY.pub] SOURCE M N K OUT [KERNEL]\n");
    return 2;
  }
  try {
    const bool is_pack = std::ifstream(std::string(argv[1]) + "/tdpack.json").good();
    if (!trust.empty() && !is_pack) throw tiledispatch::Error("--trust needs an extracted pack");
    const tiledispatch::Bundle bundle = is_pack ? tiledispatch::Pack::open(argv[1], trust).bundle_for("cpu")
                                                : tiledispatch::Bundle::open(argv[1]);
    const int64_t m = std::atoll(argv[2]), n = std::atoll(argv[3]), k = std::atoll(argv[4]);
    std::string layout;
    for (const auto& kern : bundle.kernels())  // the layout of the bundle's fp32 GEMMs
      if (kern->info().op == "gemm" && kern->info().dtype_a == "fp32") layout = kern->info().layout;
    if (layout.empty()) throw tiledispatch::Error("the bundle has no fp32 GEMM kernel");

    // inputs from a fixed linear congruential sequence in [-1, 1): the Python side reads them back from OUT
    std::vector<float> a(m * k), b(k * n), d(m * n, -12345.0f);
    uint64_t state = 42;
    auto next = [&state] {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      return static_cast<float>(static_cast<double>(state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    };
    for (float& x : a) x = next();
    for (float& x : b) x = next();
    const td_args args = tiledispatch::gemm_args(layout, TD_FP32, TD_FP32, 1, m, n, k, a.data(), b.data(), nullptr,
                                                 d.data());
    tiledispatch::Kernel* kernel = nullptr;
    if (argc == 7) {
      kernel = &bundle.kernel(argv[6]);
    } else {
      std::string why;
      kernel = bundle.first_fit(args, "gemm", "", &why);
      if (!kernel) throw tiledispatch::Error("no kernel fits:\n" + why);
    }
    kernel->run(args);
    std::ofstream out(argv[5], std::ios::binary);
    for (const auto* v : {&a, &b, &d}) out.write(reinterpret_cast<const char*>(v->data()), v->size() * sizeof(float));
    int opened = 0;
    for (const auto& kern : bundle.kernels()) opened += kern->opened();
    std::printf("{\"backend\": \"%s\", \"arch\": \"%s\", \"kernels\": %zu, \"opened\": %d, \"layout\": \"%s\", "
                "\"kernel\": \"%s\"}\n", bundle.backend().c_str(), bundle.arch().c_str(), bundle.kernels().size(),
                opened, layout.c_str(), kernel->name().c_str());
    return out ? 0 : 1;
  } catch (const tiledispatch::Error& e) {
    std::fprintf(stderr, "tiledispatch: error: %s\n", e.what());
    return 1;
  }
}
