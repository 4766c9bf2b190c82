// tiledispatch C++ loader (see tiledispatch_loader.h). Linux: dlopen of sealed memfds, ELF parsing, sha256
// from OpenSSL's libcrypto.
#include "tiledispatch_loader.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <set>
#include <utility>

namespace tiledispatch {
namespace {

constexpr uint64_t kMaxManifestBytes = 64ull << 20;  // as bundle.MAX_MANIFEST_BYTES
constexpr uint64_t kMaxKernelBytes = 1ull << 30;     // as bundle.MAX_KERNEL_BYTES
constexpr int kManifestSchema = 1;

// ---- JSON: just what a manifest needs ------------------------------------------------------------------
struct Json {
  enum Type { Null, Bool, Number, String, Array, Object } type = Null;
  std::string text;  // a number's literal text, a string's decoded value
  bool boolean = false;
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> fields;

  const Json* get(const std::string& key) const {
    for (const auto& f : fields)
      if (f.first == key) return &f.second;
    return nullptr;
  }
};

class Parser {
 public:
  Parser(const std::string& text, std::string where) : s_(text), where_(std::move(where)) {}
  Json parse() {
    Json v = value(0);
    skip();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* why) {
    throw Error(where_ + ": not valid JSON: " + why + " at offset " + std::to_string(i_));
  }
  void skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  Json value(int depth) {
    if (depth > 64) fail("nested too deeply");
    skip();
    if (i_ >= s_.size()) fail("unexpected end");
    Json v;
    const char c = s_[i_];
    if (c == '{') {
      v.type = Json::Object;
      ++i_;
      if (eat('}')) return v;
      do {
        skip();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string key");
        std::string key = string();
        if (!eat(':')) fail("expected ':'");
        v.fields.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      if (!eat('}')) fail("expected '}'");
    } else if (c == '[') {
      v.type = Json::Array;
      ++i_;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      if (!eat(']')) fail("expected ']'");
    } else if (c == '"') {
      v.type = Json::String;
      v.text = string();
    } else if (s_.compare(i_, 4, "true") == 0 || s_.compare(i_, 5, "false") == 0) {
      v.type = Json::Bool;
      v.boolean = s_[i_] == 't';
      i_ += v.boolean ? 4 : 5;
    } else if (s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type = Json::Number;
      const size_t start = i_;
      while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_])) ++i_;
      v.text = s_.substr(start, i_ - start);
    } else {
      fail("unexpected character");
    }
    return v;
  }
  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unexpected end");
      c = s_[i_++];
      switch (c) {
        case '"': case '\\': case '/': out += c; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          unsigned code = 0;
          for (int j = 0; j < 4; ++j) {
            const char h = s_[i_++];
            const int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                          : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (v < 0) fail("bad \\u escape");
            code = code * 16 + static_cast<unsigned>(v);
          }
          if (code >= 0x80) fail("non-ASCII \\u escape (a kernel manifest is ASCII)");
          out += static_cast<char>(code);
          break;
        }
        default: fail("bad escape");
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  const std::string& s_;
  std::string where_;
  size_t i_ = 0;
};

// The canonical JSON Python writes with json.dumps(sort_keys=True, separators=(",", ":")): the form of a
// key that td_kernel_key() returns and the .td_key section holds.
void canonical(const Json& v, std::string& out) {
  switch (v.type) {
    case Json::Null: out += "null"; break;
    case Json::Bool: out += v.boolean ? "true" : "false"; break;
    case Json::Number: out += v.text; break;
    case Json::String: {
      out += '"';
      for (const char c : v.text) {
        if (c == '"' || c == '\\') {
          out += '\\';
          out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
          out += buf;
        } else {
          out += c;
        }
      }
      out += '"';
      break;
    }
    case Json::Array:
      out += '[';
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i) out += ',';
        canonical(v.items[i], out);
      }
      out += ']';
      break;
    case Json::Object: {
      std::vector<const std::pair<std::string, Json>*> sorted;
      for (const auto& f : v.fields) sorted.push_back(&f);
      std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t i = 0; i < sorted.size(); ++i) {
        if (i) out += ',';
        Json name;
        name.type = Json::String;
        name.text = sorted[i]->first;
        canonical(name, out);
        out += ':';
        canonical(sorted[i]->second, out);
      }
      out += '}';
      break;
    }
  }
}

std::string string_field(const Json& obj, const char* field, const std::string& where) {
  const Json* v = obj.get(field);
  if (!v) throw Error(where + ": missing field '" + field + "'");
  if (v->type != Json::String) throw Error(where + ": field '" + field + "' must be a string");
  return v->text;
}

const Json& object_field(const Json& obj, const char* field, const std::string& where) {
  const Json* v = obj.get(field);
  if (!v || v->type != Json::Object) throw Error(where + ": field '" + field + "' must be an object");
  return *v;
}

bool plain_name(const std::string& name) {
  if (name.empty() || !(std::isalnum(static_cast<unsigned char>(name[0])) || name[0] == '_')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '+' || c == '-';
  });
}

// ---- files: read once, confined to the bundle ----------------------------------------------------------
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The bytes of dir/rel, each component opened relative to its parent with O_NOFOLLOW: a symbolic link
// below the bundle directory, or a file that is not a regular file, is refused.
std::string read_confined(const std::string& dir, const std::string& rel, uint64_t limit) {
  const std::string where = dir + "/" + rel;
  Fd parent(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (parent.fd < 0) throw Error(dir + ": cannot be opened: " + std::strerror(errno));
  size_t start = 0;
  for (;;) {
    const size_t slash = rel.find('/', start);
    const std::string part = rel.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    const bool last = slash == std::string::npos;
    const int flags = O_RDONLY | O_NOFOLLOW | O_CLOEXEC | (last ? O_NONBLOCK : O_DIRECTORY);
    const int fd = ::openat(parent.fd, part.c_str(), flags);
    if (fd < 0) {
      if (errno == ELOOP || errno == ENOTDIR)
        throw Error(where + ": a symbolic link or not a directory on the way: nothing in a bundle is followed "
                            "through a link");
      if (errno == ENOENT) throw Error(where + " is missing");
      throw Error(where + ": cannot be opened: " + std::strerror(errno));
    }
    ::close(parent.fd);
    parent.fd = fd;
    if (last) break;
    start = slash + 1;
  }
  struct stat st;
  if (::fstat(parent.fd, &st) != 0) throw Error(where + ": cannot be read: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw Error(where + " is not a regular file");
  if (static_cast<uint64_t>(st.st_size) > limit)
    throw Error(where + " is " + std::to_string(st.st_size) + " bytes, larger than the limit of " +
                std::to_string(limit));
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < data.size()) {
    const ssize_t r = ::read(parent.fd, &data[got], data.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) throw Error(where + ": changed size while it was read");
    got += static_cast<size_t>(r);
  }
  return data;
}

// ---- ELF: the embedded key (section .td_key), every offset checked against the buffer ---------------------
template <typename T>
T load(const std::string& d, uint64_t off, bool little) {
  T v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    const uint64_t byte = static_cast<unsigned char>(d[off + (little ? i : sizeof(T) - 1 - i)]);
    v |= static_cast<T>(byte << (8 * i));
  }
  return v;
}

std::string embedded_key(const std::string& d, const std::string& what) {
  auto bad = [&](const std::string& why) { return Error(what + ": not a loadable kernel library: " + why); };
  if (d.size() < 64 || d.compare(0, 4, "\x7f" "ELF") != 0) throw bad("not an ELF file");
  if (d[4] != 2) throw bad("not a 64-bit ELF file");
  if ((d[5] != 1 && d[5] != 2) || d[6] != 1) throw bad("unknown ELF byte order or version");
  const bool le = d[5] == 1;
  const uint16_t type = load<uint16_t>(d, 16, le);
  const uint64_t phoff = load<uint64_t>(d, 32, le), shoff = load<uint64_t>(d, 40, le);
  const uint16_t phentsize = load<uint16_t>(d, 54, le), phnum = load<uint16_t>(d, 56, le);
  const uint16_t shentsize = load<uint16_t>(d, 58, le), shnum = load<uint16_t>(d, 60, le);
  const uint16_t shstrndx = load<uint16_t>(d, 62, le);
  const uint64_t size = d.size();
  if (type != 3) throw bad("not a shared library");
  if (phentsize != 56 || phoff > size || phnum * 56ull > size - phoff) throw bad("program headers outside the file");
  for (uint16_t i = 0; i < phnum; ++i) {
    const uint64_t p = phoff + i * 56ull;
    const uint64_t offset = load<uint64_t>(d, p + 8, le), filesz = load<uint64_t>(d, p + 32, le);
    if (load<uint32_t>(d, p, le) == 1 && (offset > size || filesz > size - offset))
      throw bad("a loadable segment extends past the end of the file (truncated?)");
  }
  if (shnum == 0 || shentsize != 64 || shoff > size || shnum * 64ull > size - shoff || shstrndx >= shnum)
    throw bad("section headers missing or outside the file (truncated?)");
  auto section = [&](uint16_t i, uint64_t* off, uint64_t* len) {
    const uint64_t s = shoff + i * 64ull;
    *off = load<uint64_t>(d, s + 24, le);
    *len = load<uint64_t>(d, s + 32, le);
    if (load<uint32_t>(d, s + 4, le) == 8 || *off > size || *len > size - *off) throw bad("a section outside the file");
  };
  uint64_t names_off, names_len;
  section(shstrndx, &names_off, &names_len);
  const std::string names = d.substr(names_off, names_len);
  int found = 0;
  std::string key;
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint32_t name = load<uint32_t>(d, shoff + i * 64ull, le);
    const size_t end = names.find('\0', name);
    if (name >= names.size() || end == std::string::npos) throw bad("a section name outside the section-name table");
    if (names.compare(name, end - name, ".td_key") != 0) continue;
    uint64_t off, len;
    section(i, &off, &len);
    key = d.substr(off, len);
    ++found;
  }
  if (found != 1) throw bad(found ? "several sections .td_key" : "no embedded key (ELF section .td_key)");
  while (!key.empty() && key.back() == '\0') key.pop_back();
  if (key.find('\0') != std::string::npos) throw bad("section .td_key holds more than one string");
  return key;
}

std::string kernel_label(const std::string& key_json) {
  return key_json.size() > 80 ? key_json.substr(0, 80) + "..." : key_json;
}

}  // namespace

std::string sha256_hex(const void* data, size_t size) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_Digest(data, size, md, &len, EVP_sha256(), nullptr) != 1) throw Error("sha256: libcrypto failed");
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < len; ++i) {
    out += hex[md[i] >> 4];
    out += hex[md[i] & 15];
  }
  return out;
}

// ---- Kernel ---------------------------------------------------------------------------------------------
Kernel::Kernel(std::string bundle_dir, KernelInfo info) : bundle_dir_(std::move(bundle_dir)), info_(std::move(info)) {}

Kernel::~Kernel() {
  if (handle_) ::dlclose(handle_);
  if (memfd_ >= 0) ::close(memfd_);
}

void Kernel::open() {
  static std::mutex lock;  // one opening at a time: each kernel is opened once
  std::lock_guard<std::mutex> guard(lock);
  if (handle_) return;
  const std::string where = bundle_dir_ + "/" + info_.file;
  const std::string data = read_confined(bundle_dir_, info_.file, kMaxKernelBytes);
  const std::string digest = sha256_hex(data.data(), data.size());
  if (digest != info_.sha256)
    throw Error(where + " has sha256 " + digest.substr(0, 16) + "..., the manifest says " + info_.sha256.substr(0, 16) +
                "...: the file was changed after the build");
  const std::string embedded = embedded_key(data, where);
  if (embedded != info_.key_json)
    throw Error(where + ": the library reports key " + kernel_label(embedded) +
                " (its embedded key, section .td_key), the manifest says " + info_.name);
  // dlopen reads a sealed copy of exactly the checked bytes: the file can change after the check, the copy not
  const int fd = ::memfd_create("tiledispatch-kernel", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) throw Error(where + ": memfd_create failed: " + std::strerror(errno));
  size_t put = 0;
  while (put < data.size()) {
    const ssize_t w = ::write(fd, data.data() + put, data.size() - put);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      ::close(fd);
      throw Error(where + ": cannot copy into memory: " + std::strerror(errno));
    }
    put += static_cast<size_t>(w);
  }
  if (::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    ::close(fd);
    throw Error(where + ": cannot seal the in-memory copy: " + std::strerror(errno));
  }
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  void* handle = ::dlopen(proc.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    ::close(fd);
    throw Error(where + ": cannot be loaded: " + ::dlerror());
  }
  auto abi_version = reinterpret_cast<uint32_t (*)()>(::dlsym(handle, "td_abi_version"));
  auto kernel_key = reinterpret_cast<const char* (*)()>(::dlsym(handle, "td_kernel_key"));
  auto can_run = reinterpret_cast<int32_t (*)(const td_args*, char*, uint64_t)>(::dlsym(handle, "td_can_run"));
  auto workspace = reinterpret_cast<uint64_t (*)(const td_args*)>(::dlsym(handle, "td_workspace_bytes"));
  auto run = reinterpret_cast<int32_t (*)(const td_args*, char*, uint64_t)>(::dlsym(handle, "td_run"));
  std::string problem;
  if (!abi_version || !kernel_key || !can_run || !workspace || !run)
    problem = "not a tiledispatch kernel library (a td_ function is missing)";
  else if (abi_version() != TD_ABI_VERSION)
    problem = "ABI version " + std::to_string(abi_version()) + ", this loader has " + std::to_string(TD_ABI_VERSION);
  else if (!kernel_key() || info_.key_json != kernel_key())
    problem = "the library reports key " + kernel_label(kernel_key() ? kernel_key() : "") + ", the manifest says " +
              info_.name;
  if (!problem.empty()) {
    ::dlclose(handle);
    ::close(fd);
    throw Error(where + ": " + problem);
  }
  can_run_ = can_run;
  workspace_bytes_ = workspace;
  run_ = run;
  memfd_ = fd;  // kept open while the library is loaded: the loader knows it by this name
  handle_ = handle;
}

int32_t Kernel::can_run(const td_args& args, std::string* reason) {
  open();
  char buf[512] = {0};
  const int32_t status = can_run_(&args, buf, sizeof buf);
  if (reason) *reason = status == TD_OK ? std::string() : std::string(buf);
  return status;
}

uint64_t Kernel::workspace_bytes(const td_args& args) {
  open();
  return workspace_bytes_(&args);
}

void Kernel::run(const td_args& args) {
  open();
  char buf[512] = {0};
  const int32_t status = run_(&args, buf, sizeof buf);
  if (status != TD_OK) throw Error(info_.name + ": td_run returned " + std::to_string(status) + ": " + buf);
}

// ---- Bundle ---------------------------------------------------------------------------------------------
Bundle Bundle::open(const std::string& dir_in, const std::string& expected_manifest_sha256) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string where = dir + "/manifest.json";
  const std::string text = read_confined(dir, "manifest.json", kMaxManifestBytes);
  if (!expected_manifest_sha256.empty() && sha256_hex(text.data(), text.size()) != expected_manifest_sha256)
    throw Error(where + ": its sha256 is not the one the pack manifest lists: changed after extraction");
  const Json m = Parser(text, where).parse();
  if (m.type != Json::Object) throw Error(where + ": expected a JSON object");
  const Json* schema = m.get("schema");
  if (!schema || schema->type != Json::Number || schema->text != std::to_string(kManifestSchema))
    throw Error(where + ": manifest schema " + (schema ? schema->text : "missing") + ", expected " +
                std::to_string(kManifestSchema));
  Bundle b;
  b.dir_ = dir;
  b.backend_ = string_field(m, "backend", where);
  b.arch_ = string_field(m, "arch", where);
  const Json* kernels = m.get("kernels");
  if (!kernels || kernels->type != Json::Array) throw Error(where + ": field 'kernels' must be a list");
  std::set<std::string> seen;
  for (size_t i = 0; i < kernels->items.size(); ++i) {
    const Json& e = kernels->items[i];
    const std::string at = where + ": kernels[" + std::to_string(i) + "]";
    if (e.type != Json::Object) throw Error(at + ": expected an object");
    KernelInfo info;
    info.name = string_field(e, "name", at);
    info.file = string_field(e, "file", at);
    info.sha256 = string_field(e, "sha256", at);
    if (!plain_name(info.name)) throw Error(at + ": " + info.name.substr(0, 80) + " is not a kernel name");
    if (!seen.insert(info.name).second) throw Error(at + ": kernel " + info.name + " is listed twice");
    if (info.file != "kernels/" + info.name + ".so")
      throw Error(at + ": file '" + info.file.substr(0, 200) + "': the file must be kernels/" + info.name +
                  ".so, the path its name derives");
    const auto lower_hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
    if (info.sha256.size() != 64 || !std::all_of(info.sha256.begin(), info.sha256.end(), lower_hex))
      throw Error(at + ": sha256 is not 64 lower-case hex digits");
    const Json& key = object_field(e, "key", at);
    canonical(key, info.key_json);
    if (string_field(key, "backend", at + ".key") != b.backend_ || string_field(key, "arch", at + ".key") != b.arch_)
      throw Error(at + ": kernel " + info.name + " is not for the bundle's " + b.backend_ + "/" + b.arch_);
    const Json& sig = object_field(key, "signature", at + ".key");
    info.op = string_field(sig, "op", at + ".key.signature");
    info.direction = string_field(sig, "direction", at + ".key.signature");
    info.layout = string_field(sig, "layout", at + ".key.signature");
    info.dtype_a = string_field(sig, "dtype_a", at + ".key.signature");
    info.dtype_b = string_field(sig, "dtype_b", at + ".key.signature");
    info.dtype_c = string_field(sig, "dtype_c", at + ".key.signature");
    if (const Json* epi = sig.get("epilogue")) {
      if (const Json* bias = epi->get("bias")) info.bias = bias->type == Json::Bool && bias->boolean;
      if (const Json* res = epi->get("residuals")) {
        const char* text = res->text.c_str();
        char* end = nullptr;
        const long count = std::strtol(text, &end, 10);
        if (res->type != Json::Number || *end || count < 0 || count > TD_MAX_TENSORS - 5)
          throw Error(at + ": key.signature.epilogue.residuals must be 0 to " + std::to_string(TD_MAX_TENSORS - 5));
        info.residuals = static_cast<int>(count);
      }
    }
    b.kernels_.push_back(std::make_unique<Kernel>(dir, std::move(info)));
  }
  if (b.kernels_.empty()) throw Error(dir + ": the bundle has no kernels");
  return b;
}

Kernel& Bundle::kernel(const std::string& name) const {
  for (const auto& k : kernels_)
    if (k->name() == name) return *k;
  throw Error("no kernel named " + name + " in the bundle " + dir_);
}

Kernel* Bundle::first_fit(const td_args& args, const std::string& op, const std::string& direction,
                          std::string* why) const {
  std::string reasons;
  for (const auto& k : kernels_) {
    if ((!op.empty() && k->info().op != op) || (!direction.empty() && k->info().direction != direction)) continue;
    std::string reason;
    if (k->can_run(args, &reason) == TD_OK) return k.get();
    reasons += "  " + k->name() + ": " + reason + "\n";
  }
  if (why) *why = reasons.empty() ? "no kernel of op " + op + " in the bundle" : reasons;
  return nullptr;
}

// ---- Pack (extracted) ----------------------------------------------------------------------------------
namespace {

constexpr int kPackFormatVersion = 1;  // as pack.FORMAT_VERSION

std::string from_hex(const std::string& hex, const std::string& what) {
  if (hex.size() % 2) throw Error(what + ": not hex");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int byte = 0;
    for (int j = 0; j < 2; ++j) {
      const char c = hex[i + j];
      const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (v < 0) throw Error(what + ": not hex");
      byte = byte * 16 + v;
    }
    out += static_cast<char>(byte);
  }
  return out;
}

// tdpack.sig ({"algorithm": "ed25519", "key_id": ..., "signature": hex}) over the manifest's bytes, by the
// key in the PEM file; throws Error saying what is wrong.
void verify_signature(const std::string& dir, const std::string& manifest, const std::string& key_file) {
  const std::string what = dir + "/tdpack.sig";
  std::string sig_text;
  try {
    sig_text = read_confined(dir, "tdpack.sig", 4096);
  } catch (const Error&) {
    throw Error(dir + ": the pack is not signed, and a trusted key was given");
  }
  const Json sig = Parser(sig_text, what).parse();
  if (sig.type != Json::Object || string_field(sig, "algorithm", what) != "ed25519")
    throw Error(what + ": the signature member is malformed (expected ed25519 JSON)");
  const std::string raw = from_hex(string_field(sig, "signature", what), what);
  FILE* f = std::fopen(key_file.c_str(), "rb");
  if (!f) throw Error("trusted key " + key_file + ": cannot be read: " + std::strerror(errno));
  EVP_PKEY* key = PEM_read_PUBKEY(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  if (!key || EVP_PKEY_id(key) != EVP_PKEY_ED25519) {
    EVP_PKEY_free(key);
    throw Error("trusted key " + key_file + ": not an ed25519 public key (PEM)");
  }
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  const bool ok = ctx && EVP_DigestVerifyInit(ctx, nullptr, nullptr, nullptr, key) == 1 &&
                  EVP_DigestVerify(ctx, reinterpret_cast<const unsigned char*>(raw.data()), raw.size(),
                                   reinterpret_cast<const unsigned char*>(manifest.data()), manifest.size()) == 1;
  EVP_MD_CTX_free(ctx);
  EVP_PKEY_free(key);
  if (!ok) {
    const Json* signer = sig.get("key_id");
    throw Error(what + ": not a valid signature of tdpack.json by the trusted key (signed by key " +
                (signer && signer->type == Json::String ? signer->text.substr(0, 64) : std::string("?")) +
                ", or the manifest changed after signing)");
  }
}

}  // namespace

Pack Pack::open(const std::string& dir_in, const std::string& trusted_public_key) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string where = dir + "/tdpack.json";
  const std::string text = read_confined(dir, "tdpack.json", kMaxManifestBytes);
  if (!trusted_public_key.empty()) verify_signature(dir, text, trusted_public_key);
  const Json m = Parser(text, where).parse();
  if (m.type != Json::Object) throw Error(where + ": expected a JSON object");
  if (string_field(m, "format", where) != "tiledispatch-pack") throw Error(where + ": not a tiledispatch pack");
  const Json* version = m.get("format_version");
  if (!version || version->text != std::to_string(kPackFormatVersion))
    throw Error(where + ": pack format version " + (version ? version->text : "missing") + "; this loader reads " +
                std::to_string(kPackFormatVersion));
  const Json* abi = m.get("abi_version");
  if (!abi || abi->text != std::to_string(TD_ABI_VERSION))
    throw Error(where + ": its kernels use ABI version " + (abi ? abi->text : "missing") + ", this loader " +
                std::to_string(TD_ABI_VERSION));
  const Json& files = object_field(m, "files", where);
  const Json* bundles = m.get("bundles");
  if (!bundles || bundles->type != Json::Array || bundles->items.empty())
    throw Error(where + ": 'bundles' must be a non-empty list");
  Pack p;
  p.dir_ = dir;
  for (size_t i = 0; i < bundles->items.size(); ++i) {
    const Json& b = bundles->items[i];
    const std::string at = where + ": bundles[" + std::to_string(i) + "]";
    if (b.type != Json::Object) throw Error(at + ": expected an object");
    PackBundle info;
    info.name = string_field(b, "name", at);
    info.backend = string_field(b, "backend", at);
    info.arch = string_field(b, "arch", at);
    if (!plain_name(info.name)) throw Error(at + ": '" + info.name.substr(0, 80) + "' is not a plain name");
    const std::string manifest = "bundles/" + info.name + "/manifest.json";
    const Json* listed = files.get(manifest);
    if (!listed || listed->type != Json::Object) throw Error(at + ": " + manifest + " is not listed in 'files'");
    const Json* kernels = b.get("kernels");
    info.kernels = kernels && kernels->type == Json::Array ? kernels->items.size() : 0;
    info.dir = dir + "/bundles/" + info.name;
    p.manifest_sha256_.push_back(string_field(*listed, "sha256", at + " (files)"));
    p.bundles_.push_back(std::move(info));
  }
  return p;
}

Bundle Pack::bundle(const std::string& name) const {
  for (size_t i = 0; i < bundles_.size(); ++i) {
    if (bundles_[i].name != name) continue;
    Bundle b = Bundle::open(bundles_[i].dir, manifest_sha256_[i]);
    if (b.backend() != bundles_[i].backend || b.arch() != bundles_[i].arch)
      throw Error(bundles_[i].dir + ": the bundle is for " + b.backend() + "/" + b.arch() + ", the pack says " +
                  bundles_[i].backend + "/" + bundles_[i].arch);
    return b;
  }
  throw Error(dir_ + ": the pack has no bundle named " + name);
}

Bundle Pack::bundle_for(const std::string& backend, const std::string& arch) const {
  for (const auto& b : bundles_)
    if (b.backend == backend && (arch.empty() || b.arch == arch)) return bundle(b.name);
  throw Error(dir_ + ": the pack has no " + backend + (arch.empty() ? "" : "/" + arch) + " bundle");
}

// ---- argument helpers -----------------------------------------------------------------------------------
td_tensor tensor(const void* data, int32_t dtype, std::vector<int64_t> shape, std::vector<int64_t> strides) {
  if (shape.size() != strides.size() || shape.size() > TD_MAX_RANK)
    throw Error("tensor: shape and strides must have the same rank, at most " + std::to_string(TD_MAX_RANK));
  td_tensor t;
  std::memset(&t, 0, sizeof t);
  t.data = const_cast<void*>(data);
  t.dtype = dtype;
  t.rank = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.stride[i] = strides[i];
  }
  return t;
}

td_args gemm_args(const std::string& layout, int32_t dtype_ab, int32_t dtype_cd, int64_t batch, int64_t m,
                  int64_t n, int64_t k, const void* a, const void* b, const void* c, void* d, const void* bias,
                  double alpha, double beta) {
  if (layout.size() != 3 || layout.find_first_not_of("rc") != std::string::npos)
    throw Error("gemm_args: layout must be three letters r / c (A, B, C/D), got '" + layout + "'");
  auto dense = [](int64_t rows, int64_t cols, char letter) {
    return letter == 'r' ? std::vector<int64_t>{rows * cols, cols, 1} : std::vector<int64_t>{rows * cols, 1, rows};
  };
  td_args args;
  std::memset(&args, 0, sizeof args);
  args.abi_version = TD_ABI_VERSION;
  args.num_tensors = 5;  // A, B, C, D and the bias slot, also without a bias
  args.tensors[0] = tensor(a, dtype_ab, {batch, m, k}, dense(m, k, layout[0]));
  args.tensors[1] = tensor(b, dtype_ab, {batch, k, n}, dense(k, n, layout[1]));
  args.tensors[2] = tensor(c, dtype_cd, {batch, m, n}, dense(m, n, layout[2]));
  args.tensors[3] = tensor(d, dtype_cd, {batch, m, n}, dense(m, n, layout[2]));
  args.tensors[4] = tensor(bias, dtype_cd, {batch, n}, {0, 1});
  args.scalars[0] = alpha;
  args.scalars[1] = beta;
  args.scalars[2] = -std::numeric_limits<double>::infinity();  // clamp bounds: only clamp kernels read them
  args.scalars[3] = std::numeric_limits<double>::infinity();
  return args;
}

}  // namespace tiledispatch
