#include "agent/backends/qemu/initramfs.hpp"

#include <archive.h>
#include <archive_entry.h>
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <system_error>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {
namespace {

namespace fs = std::filesystem;

// The whole of a (small) file.
std::string read_whole(const fs::path& path, std::size_t max_bytes) {
  UniqueFd fd(retry_eintr([&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); }));
  if (!fd) throw_errno_fmt(errno, "open {}", path.string());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", path.string());
  if (!S_ISREG(st.st_mode)) throw Error(Code::kInvalidArgument, fmt::format("{}: not a regular file", path.string()));
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
    throw Error(Code::kInvalidArgument,
                fmt::format("{}: {} bytes, more than the {} expected", path.string(), st.st_size, max_bytes));
  std::string out(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < out.size()) {
    ssize_t n = retry_eintr([&] { return ::read(fd.get(), out.data() + got, out.size() - got); });
    if (n < 0) throw_errno_fmt(errno, "read {}", path.string());
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  return out;
}

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

template <typename T>
T load(std::string_view bytes, std::size_t offset) {
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof v);
  return v;
}

bool is_elf(std::string_view head) {
  return head.size() >= 4 && head.substr(0, 4) ==
                                 "\x7f"
                                 "ELF";
}

std::string normalize_module_name(std::string_view name) {
  std::string s(name);
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

// "virtio_blk.ko" -> "virtio_blk"; names of other files unchanged.
std::string module_stem(const fs::path& p) {
  std::string name = p.filename().string();
  if (name.size() > 3 && name.ends_with(".ko")) name.resize(name.size() - 3);
  return name;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (const auto& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

// Resolves module names to files in a flat directory, dependencies first.
class ModuleResolver {
 public:
  ModuleResolver(const fs::path& dir, const std::vector<std::string>& optional, std::string_view remedy)
      : dir_(dir), remedy_(remedy.empty() ? std::string() : fmt::format("; {}", remedy)) {
    std::error_code ec;
    fs::directory_iterator it(dir, ec);
    if (ec)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("guest kernel modules directory {}: {}{}", dir.string(), ec.message(), remedy_));
    for (const auto& entry : it) {
      const fs::path& p = entry.path();
      if (p.extension() != ".ko" || !entry.is_regular_file(ec)) continue;
      files_.emplace(normalize_module_name(module_stem(p)), p);
    }
    fs::path builtin = dir / "modules.builtin";
    if (is_file(builtin)) {
      std::string text = read_whole(builtin, 16 << 20);
      std::size_t pos = 0;
      while (pos < text.size()) {
        std::size_t nl = text.find('\n', pos);
        if (nl == std::string::npos) nl = text.size();
        std::string_view line(text.data() + pos, nl - pos);
        pos = nl + 1;
        if (line.empty()) continue;
        builtin_.insert(normalize_module_name(module_stem(fs::path(std::string(line)))));
      }
    }
    for (const auto& o : optional) optional_.insert(normalize_module_name(o));
  }

  bool is_optional(const std::string& name) const { return optional_.contains(name); }

  // The first module in `name`'s dependency closure that is neither here nor built in, or "" (cycles are left to
  // visit to report).
  std::string first_missing(const std::string& name, std::set<std::string>& seen) {
    if (!seen.insert(name).second || builtin_.contains(name)) return {};
    auto it = files_.find(name);
    if (it == files_.end()) return name;
    for (const auto& dep : info(it->first).depends) {
      auto missing = first_missing(normalize_module_name(dep), seen);
      if (!missing.empty()) return missing;
    }
    return {};
  }

  void visit(const std::string& name, std::vector<std::string>& chain) {
    auto st = state_.find(name);
    if (st != state_.end()) {
      if (st->second == State::kDone) return;
      chain.push_back(name);
      auto from = std::find(chain.begin(), chain.end(), name);
      throw Error(Code::kInvalidArgument,
                  fmt::format("guest kernel modules in {} depend on each other in a cycle: {}", dir_.string(),
                              join(std::vector<std::string>(from, chain.end()), " -> ")));
    }
    if (builtin_.contains(name)) {
      state_[name] = State::kDone;
      return;
    }
    auto it = files_.find(name);
    if (it == files_.end()) {
      if (is_optional(name)) {
        state_[name] = State::kDone;
        return;
      }
      std::string needed_by = chain.empty() ? std::string() : fmt::format(" (needed by {})", join(chain, " <- "));
      throw Error(Code::kFailedPrecondition,
                  fmt::format("guest kernel module {}{} is not in {}{}", name, needed_by, dir_.string(), remedy_));
    }
    state_[name] = State::kVisiting;
    chain.push_back(name);
    for (const auto& dep : info(name).depends) visit(normalize_module_name(dep), chain);
    chain.pop_back();
    state_[name] = State::kDone;
    order_.push_back(it->second);
  }

  std::vector<fs::path> take_order() { return std::move(order_); }

 private:
  enum class State { kVisiting, kDone };

  const ModuleInfo& info(const std::string& name) {
    auto it = infos_.find(name);
    if (it == infos_.end()) it = infos_.emplace(name, read_module_info(files_.at(name))).first;
    return it->second;
  }

  fs::path dir_;
  std::string remedy_;  // "; <how to get the modules>", or ""
  std::map<std::string, fs::path> files_;
  std::set<std::string> builtin_;
  std::set<std::string> optional_;
  std::map<std::string, ModuleInfo> infos_;
  std::map<std::string, State> state_;
  std::vector<fs::path> order_;
};

struct ArchiveWriteDeleter {
  void operator()(archive* a) const { archive_write_free(a); }
};
struct EntryDeleter {
  void operator()(archive_entry* e) const { archive_entry_free(e); }
};

void archive_check(archive* a, int rc, std::string_view what, const fs::path& out) {
  if (rc >= ARCHIVE_WARN) return;
  const char* msg = archive_error_string(a);
  throw Error(Code::kInternal, fmt::format("write initramfs {}: {}: {}", out.string(), what, msg ? msg : "failed"));
}

#if defined(__x86_64__)
std::uint64_t clock_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_RAW, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + static_cast<std::uint64_t>(ts.tv_nsec);
}

// A (nanoseconds, TSC) pair read as close together as a few tries allow: the TSC read bracketed by the two clock
// reads that were nearest each other.
std::pair<std::uint64_t, std::uint64_t> clock_and_tsc() {
  std::uint64_t best_gap = UINT64_MAX, ns = 0, tsc = 0;
  for (int i = 0; i < 5; ++i) {
    std::uint64_t before = clock_ns();
    std::uint64_t t = __rdtsc();
    std::uint64_t after = clock_ns();
    if (after - before < best_gap) {
      best_gap = after - before;
      ns = before + (after - before) / 2;
      tsc = t;
    }
  }
  return {ns, tsc};
}

std::uint64_t measure_tsc_khz() {
  std::array<std::uint64_t, 3> samples{};
  for (auto& khz : samples) {
    auto [ns0, tsc0] = clock_and_tsc();
    timespec delay{0, 20'000'000};
    while (::clock_nanosleep(CLOCK_MONOTONIC, 0, &delay, &delay) == EINTR) {
    }
    auto [ns1, tsc1] = clock_and_tsc();
    // kHz = cycles per millisecond = cycles * 1e6 / ns (no overflow below ~30 minutes of 10 GHz cycles).
    std::uint64_t cycles = tsc1 - tsc0;
    khz = ns1 > ns0 ? cycles * 1'000'000u / (ns1 - ns0) : 0;
  }
  std::sort(samples.begin(), samples.end());
  return samples[1];
}
#endif

}  // namespace

ModuleInfo read_module_info(const fs::path& ko) {
  // Kernel modules are well under this; a bigger file is not one.
  constexpr std::size_t kMaxModuleBytes = 256u << 20;
  std::string bytes = read_whole(ko, kMaxModuleBytes);
  auto invalid = [&](std::string_view why) {
    return Error(Code::kInvalidArgument, fmt::format("kernel module {}: {}", ko.string(), why));
  };
  std::string_view data(bytes);
  if (data.size() < sizeof(Elf64_Ehdr) || !is_elf(data)) {
    if (data.starts_with("\xfd"
                         "7zXZ") ||
        data.starts_with("\x28\xb5\x2f\xfd") || data.starts_with("\x1f\x8b"))
      throw invalid("compressed; decompress it to a plain .ko first");
    throw invalid("not an ELF file");
  }
  auto eh = load<Elf64_Ehdr>(data, 0);
  constexpr unsigned char kNativeData = std::endian::native == std::endian::little ? ELFDATA2LSB : ELFDATA2MSB;
  if (eh.e_ident[EI_CLASS] != ELFCLASS64) throw invalid("not a 64-bit ELF file");
  if (eh.e_ident[EI_DATA] != kNativeData) throw invalid("ELF file of the other byte order");
  if (eh.e_type != ET_REL) throw invalid("not a relocatable ELF file (a module is ET_REL)");
  if (eh.e_shoff == 0 || eh.e_shentsize != sizeof(Elf64_Shdr)) throw invalid("no ELF64 section headers");
  if (eh.e_shoff > data.size() || data.size() - eh.e_shoff < sizeof(Elf64_Shdr))
    throw invalid("section headers past the end");
  // Section 0 holds the real count and string table index when they do not fit the ELF header's fields.
  auto sh0 = load<Elf64_Shdr>(data, eh.e_shoff);
  std::uint64_t shnum = eh.e_shnum != 0 ? eh.e_shnum : sh0.sh_size;
  std::uint64_t shstrndx = eh.e_shstrndx != SHN_XINDEX ? eh.e_shstrndx : sh0.sh_link;
  if ((data.size() - eh.e_shoff) / sizeof(Elf64_Shdr) < shnum) throw invalid("section headers past the end");
  if (shstrndx == SHN_UNDEF || shstrndx >= shnum) throw invalid("no section name table");
  auto section = [&](std::uint64_t i) { return load<Elf64_Shdr>(data, eh.e_shoff + i * sizeof(Elf64_Shdr)); };
  auto contents = [&](const Elf64_Shdr& sh) -> std::string_view {
    if (sh.sh_type == SHT_NOBITS || sh.sh_offset > data.size() || data.size() - sh.sh_offset < sh.sh_size)
      throw invalid("a section lies past the end of the file");
    return data.substr(sh.sh_offset, sh.sh_size);
  };
  std::string_view names = contents(section(shstrndx));
  std::string_view modinfo;
  bool found = false;
  for (std::uint64_t i = 1; i < shnum && !found; ++i) {
    auto sh = section(i);
    if (sh.sh_name >= names.size()) continue;
    std::string_view rest = names.substr(sh.sh_name);
    if (rest.substr(0, rest.find('\0')) != ".modinfo") continue;
    modinfo = contents(sh);
    found = true;
  }
  if (!found) throw invalid("no .modinfo section (not a kernel module)");

  ModuleInfo info;
  // NUL-separated key=value strings, with NUL padding between them.
  while (!modinfo.empty()) {
    std::size_t end = modinfo.find('\0');
    std::string_view entry = modinfo.substr(0, end);
    modinfo.remove_prefix(end == std::string_view::npos ? modinfo.size() : end + 1);
    if (entry.starts_with("name=") && info.name.empty()) {
      info.name = std::string(entry.substr(5));
    } else if (entry.starts_with("depends=")) {
      std::string_view list = entry.substr(8);
      while (!list.empty()) {
        std::size_t comma = list.find(',');
        std::string_view dep = list.substr(0, comma);
        if (!dep.empty()) info.depends.emplace_back(dep);
        list.remove_prefix(comma == std::string_view::npos ? list.size() : comma + 1);
      }
    }
  }
  if (info.name.empty()) info.name = module_stem(ko);
  return info;
}

std::vector<fs::path> module_load_order(const fs::path& modules_dir, const std::vector<std::string>& wanted,
                                        const std::vector<std::string>& optional, std::string_view remedy) {
  ModuleResolver resolver(modules_dir, optional, remedy);
  std::vector<std::string> chain;
  for (const auto& w : wanted) resolver.visit(normalize_module_name(w), chain);
  // Optional modules not asked for by name come last, and only when all they need is here.
  for (const auto& o : optional) {
    std::string name = normalize_module_name(o);
    std::set<std::string> seen;
    if (resolver.first_missing(name, seen).empty()) resolver.visit(name, chain);
  }
  return resolver.take_order();
}

namespace {

// A newc cpio archive written to a descriptor, entry by entry. Everything but the path, type and mode is the same
// for all entries, so the bytes depend only on the inputs.
class CpioWriter {
 public:
  CpioWriter(int fd, const fs::path& out) : a_(archive_write_new()), out_(out) {
    if (!a_) throw Error(Code::kResourceExhausted, "archive_write_new: out of memory");
    archive_check(a_.get(), archive_write_set_format_cpio_newc(a_.get()), "cpio newc format", out_);
    archive_check(a_.get(), archive_write_add_filter_none(a_.get()), "no compression", out_);
    archive_check(a_.get(), archive_write_set_bytes_in_last_block(a_.get(), 1), "last block", out_);
    archive_check(a_.get(), archive_write_open_fd(a_.get(), fd), "open", out_);
    e_.reset(archive_entry_new());
    if (!e_) throw Error(Code::kResourceExhausted, "archive_entry_new: out of memory");
  }

  void add_dir(const std::string& name) {
    begin_entry(name, AE_IFDIR, 0755);
    archive_check(a_.get(), archive_write_header(a_.get(), e_.get()), name, out_);
  }

  void add_chardev(const std::string& name, mode_t perm, unsigned major_nr, unsigned minor_nr) {
    begin_entry(name, AE_IFCHR, perm);
    archive_entry_set_rdev(e_.get(), makedev(major_nr, minor_nr));
    archive_check(a_.get(), archive_write_header(a_.get(), e_.get()), name, out_);
  }

  void add_file(const std::string& name, const fs::path& src, mode_t perm) {
    UniqueFd in(retry_eintr([&] { return ::open(src.c_str(), O_RDONLY | O_CLOEXEC); }));
    if (!in) throw_errno_fmt(errno, "open {}", src.string());
    struct stat st {};
    if (::fstat(in.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", src.string());
    if (!S_ISREG(st.st_mode))
      throw Error(Code::kInvalidArgument, fmt::format("initramfs {}: {} is not a regular file", name, src.string()));
    begin_entry(name, AE_IFREG, perm);
    archive_entry_set_size(e_.get(), st.st_size);
    archive_check(a_.get(), archive_write_header(a_.get(), e_.get()), name, out_);
    std::array<char, 1 << 16> buf;
    std::int64_t left = st.st_size;
    while (left > 0) {
      ssize_t n = retry_eintr([&] { return ::read(in.get(), buf.data(), buf.size()); });
      if (n < 0) throw_errno_fmt(errno, "read {}", src.string());
      if (n == 0) throw Error(Code::kAborted, fmt::format("initramfs: {} shrank while it was read", src.string()));
      std::size_t len = static_cast<std::size_t>(std::min<std::int64_t>(n, left));
      if (archive_write_data(a_.get(), buf.data(), len) < 0) archive_check(a_.get(), ARCHIVE_FATAL, name, out_);
      left -= static_cast<std::int64_t>(len);
    }
  }

  void close() { archive_check(a_.get(), archive_write_close(a_.get()), "close", out_); }

 private:
  void begin_entry(const std::string& name, mode_t type, mode_t perm) {
    archive_entry_clear(e_.get());
    archive_entry_set_pathname(e_.get(), name.c_str());
    archive_entry_set_filetype(e_.get(), type);
    archive_entry_set_perm(e_.get(), perm);
    archive_entry_set_uid(e_.get(), 0);
    archive_entry_set_gid(e_.get(), 0);
    archive_entry_set_mtime(e_.get(), 0, 0);
    archive_entry_set_ino64(e_.get(), ++ino_);
    archive_entry_set_dev(e_.get(), 0);
    archive_entry_set_nlink(e_.get(), type == AE_IFDIR ? 2 : 1);
    archive_entry_set_size(e_.get(), 0);
  }

  std::unique_ptr<archive, ArchiveWriteDeleter> a_;
  std::unique_ptr<archive_entry, EntryDeleter> e_;
  const fs::path& out_;
  std::int64_t ino_ = 0;
};

}  // namespace

void write_initramfs(const fs::path& out, const fs::path& init_binary, const std::vector<fs::path>& modules) {
  fs::path tmp = out;
  tmp += ".tmp";
  UniqueFd fd(retry_eintr([&] { return ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644); }));
  if (!fd) throw_errno_fmt(errno, "create {}", tmp.string());
  struct TmpRemover {
    const fs::path* path;
    ~TmpRemover() {
      if (path) ::unlink(path->c_str());
    }
  } remover{&tmp};

  CpioWriter cpio(fd.get(), out);
  for (const char* dir : {"dev", "proc", "sys", "tmp", "run", "mnt", "newroot", "lib", "lib/dsec", "lib/dsec/modules"})
    cpio.add_dir(dir);
  cpio.add_chardev("dev/console", 0600, 5, 1);
  cpio.add_chardev("dev/null", 0666, 1, 3);
  cpio.add_file("init", init_binary, 0755);
  int width = std::max<int>(2, static_cast<int>(std::to_string(modules.empty() ? 0 : modules.size() - 1).size()));
  for (std::size_t i = 0; i < modules.size(); ++i) {
    std::string name =
        fmt::format("lib/dsec/modules/{:0{}}-{}.ko", i, width, normalize_module_name(module_stem(modules[i])));
    cpio.add_file(name, modules[i], 0644);
  }
  cpio.close();
  if (::fsync(fd.get()) != 0) throw_errno_fmt(errno, "fsync {}", tmp.string());
  if (::close(fd.release()) != 0) throw_errno_fmt(errno, "close {}", tmp.string());
  if (::rename(tmp.c_str(), out.c_str()) != 0) throw_errno_fmt(errno, "rename {} to {}", tmp.string(), out.string());
  remover.path = nullptr;
}

std::uint64_t host_tsc_khz() {
#if defined(__x86_64__)
  static const std::uint64_t khz = measure_tsc_khz();
  return khz;
#else
  throw Error(Code::kUnimplemented, "host_tsc_khz: the host is not x86-64");
#endif
}

}  // namespace dsec::agent::qemu
