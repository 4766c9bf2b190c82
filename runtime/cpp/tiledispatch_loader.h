// tiledispatch C++ loader: load a bundle directory (as `scons` writes it, or a bundle of an extracted pack),
// verify it, list its kernels, select one by name or first fit, and run it. No Python.
//
//   tiledispatch::Bundle bundle = tiledispatch::Bundle::open("build/fp32_rcr_essential");
//   td_args args = tiledispatch::gemm_args("rcr", TD_FP32, TD_FP32, 1, m, n, k, a, b, nullptr, d);
//   tiledispatch::Kernel* kernel = bundle.first_fit(args, "gemm");   // nullptr: none fits (see `why`)
//   kernel->run(args);                                                 // throws tiledispatch::Error
//
//   tiledispatch::Pack pack = tiledispatch::Pack::open(extracted_dir, "signing.pub");  // an extracted pack
//   tiledispatch::Bundle cpu = pack.bundle_for("cpu");
//
// Checks, as the Python runtime makes them (README, "Trust model"): the manifest's structure (schema, each
// kernel's file is kernels/<name>.so, sha256 is 64 hex digits, backend / arch are the bundle's, no name
// twice); when a kernel is first opened (Bundle::open opens none): its file read once without following
// links, its sha256 the manifest's, the key in its ELF section .td_key the manifest's, then dlopen of a
// sealed in-memory copy of exactly those bytes (memfd), td_abi_version() and td_kernel_key() compared.
// Anything that fails is a tiledispatch::Error naming the file and what is wrong.
//
// The tensor slots of every op are documented in tiledispatch_abi.h. Pointers are host pointers on the cpu
// backend and device pointers (args.stream: a cudaStream_t) on GPU backends; this library allocates nothing.
#ifndef TILEDISPATCH_LOADER_H
#define TILEDISPATCH_LOADER_H

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tiledispatch_abi.h"

namespace tiledispatch {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What the manifest says about one kernel.
struct KernelInfo {
  std::string name;       // the kernel name (derived from its key)
  std::string file;       // kernels/<name>.so, relative to the bundle directory
  std::string sha256;     // of the file
  std::string key_json;   // the key as canonical JSON (what td_kernel_key() returns)
  std::string op;         // signature.op: "gemm" or "conv"
  std::string direction;  // signature.direction: "none" (gemm), "fwd", "bwd_data", "bwd_weight"
  std::string layout;     // signature.layout, e.g. "rcr" or "nhwgc"
  std::string dtype_a, dtype_b, dtype_c;  // e.g. "fp16"
  bool bias = false;      // signature.epilogue.bias (gemm)
  int residuals = 0;      // signature.epilogue.residuals (gemm)
};

class Kernel {
 public:
  Kernel(std::string bundle_dir, KernelInfo info);
  ~Kernel();
  Kernel(const Kernel&) = delete;
  Kernel& operator=(const Kernel&) = delete;

  const KernelInfo& info() const { return info_; }
  const std::string& name() const { return info_.name; }
  bool opened() const { return handle_ != nullptr; }

  // td_can_run: TD_OK, or the status with the kernel's reason in *reason. Opens the library on first use.
  int32_t can_run(const td_args& args, std::string* reason = nullptr);
  uint64_t workspace_bytes(const td_args& args);
  // td_run: launches once; throws Error with the kernel's reason when it refuses or fails.
  void run(const td_args& args);

 private:
  void open();
  std::string bundle_dir_;
  KernelInfo info_;
  void* handle_ = nullptr;
  int memfd_ = -1;
  int32_t (*can_run_)(const td_args*, char*, uint64_t) = nullptr;
  uint64_t (*workspace_bytes_)(const td_args*) = nullptr;
  int32_t (*run_)(const td_args*, char*, uint64_t) = nullptr;
};

class Bundle {
 public:
  // Reads and checks manifest.json; opens no kernel library. expected_manifest_sha256: when not empty, the
  // manifest's bytes must have this sha256 (Pack::bundle passes the pack manifest's).
  static Bundle open(const std::string& dir, const std::string& expected_manifest_sha256 = "");

  const std::string& dir() const { return dir_; }
  const std::string& backend() const { return backend_; }
  const std::string& arch() const { return arch_; }
  const std::vector<std::unique_ptr<Kernel>>& kernels() const { return kernels_; }

  // The kernel of that name; throws Error when the bundle has none.
  Kernel& kernel(const std::string& name) const;
  // The first kernel, in manifest order, of the op ("" = any) and direction ("" = any) whose td_can_run
  // accepts args (Python's ranker="first_fit"); nullptr when none does, with each kernel's reason in *why.
  Kernel* first_fit(const td_args& args, const std::string& op = "", const std::string& direction = "",
                    std::string* why = nullptr) const;

 private:
  std::string dir_, backend_, arch_;
  std::vector<std::unique_ptr<Kernel>> kernels_;
};

// One bundle of a pack.
struct PackBundle {
  std::string name, backend, arch;
  std::string dir;      // the bundle directory inside the extracted pack
  size_t kernels = 0;
};

// An extracted pack: the directory `python -m tiledispatch extract NAME.tdpack` prints as "cache" (it holds
// tdpack.json and bundles/). Extraction, with its checks of every archive member, is the Python runtime's;
// this reads the result and checks the chain of digests from the pack manifest down: tdpack.json (and, with
// a trusted key, its ed25519 signature tdpack.sig) -> each bundle's manifest.json (its sha256 in tdpack.json)
// -> each kernel library (its sha256, checked when it is opened).
class Pack {
 public:
  // trusted_public_key: a PEM file of the ed25519 key the pack must be signed with ("" = no signature check).
  static Pack open(const std::string& extracted_dir, const std::string& trusted_public_key = "");

  const std::string& dir() const { return dir_; }
  const std::vector<PackBundle>& bundles() const { return bundles_; }
  // The bundle of that name, its manifest.json checked against tdpack.json; throws Error.
  Bundle bundle(const std::string& name) const;
  // The first bundle for backend (and arch, "" = any), as bundle() opens it; throws Error when there is none.
  Bundle bundle_for(const std::string& backend, const std::string& arch = "") const;

 private:
  std::string dir_;
  std::vector<PackBundle> bundles_;
  std::vector<std::string> manifest_sha256_;  // of each bundle's manifest.json, as tdpack.json lists it
};

// A tensor slot: shape and strides in elements, outermost first.
td_tensor tensor(const void* data, int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides);

// The td_args of a dense GEMM D = alpha * A@B + beta * C (+ bias): A [batch, M, K], B [batch, K, N],
// C and D [batch, M, N], each row- or column-major as layout's letters say ("rcr": A row-, B column-,
// C/D row-major). Slot 4 (bias, [batch, N] shared over the batch) is always present, NULL without bias:
// a kernel counts 5 + residuals slots whether or not its key has a bias.
td_args gemm_args(const std::string& layout, int32_t dtype_ab, int32_t dtype_cd, int64_t batch, int64_t m,
                  int64_t n, int64_t k, const void* a, const void* b, const void* c, void* d,
                  const void* bias = nullptr, double alpha = 1.0, double beta = 0.0);

// The sha256 of bytes, as 64 lower-case hex digits.
std::string sha256_hex(const void* data, size_t size);

}  // namespace tiledispatch

#endif  // TILEDISPATCH_LOADER_H
