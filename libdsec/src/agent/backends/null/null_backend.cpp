#include "agent/backends/null/null_backend.hpp"

#include <archive.h>
#include <archive_entry.h>

#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

constexpr std::string_view kNoExec = "the null backend runs nothing; it simulates the control plane";

// A libarchive handle, freed on scope exit.
struct ArchiveReader {
  archive* a = archive_read_new();
  ~ArchiveReader() { archive_read_free(a); }
};
struct ArchiveWriter {
  archive* a = archive_write_new();
  ~ArchiveWriter() { archive_write_free(a); }
};
struct EntryPtr {
  archive_entry* e = archive_entry_new();
  ~EntryPtr() { archive_entry_free(e); }
};

// "/a/./b/../c/" -> "/a/c". Paths are resolved inside the sandbox's root: ".." never climbs above "/".
std::string normalize(std::string_view path) {
  if (path.empty() || path.front() != '/')
    throw Error(Code::kInvalidArgument, fmt::format("path '{}' is not absolute", path));
  std::string out = std::filesystem::path(std::string(path)).lexically_normal().string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

std::string parent_of(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == 0 ? "/" : path.substr(0, slash);
}

class NullSandbox final : public BackendSandbox {
 public:
  explicit NullSandbox(std::uint64_t disk_bytes) : disk_bytes_(disk_bytes) {
    files_["/"] = Node{true, {}, 0755, std::time(nullptr)};
  }

  ExecResult exec(const ExecRequest&, const OutputSink&) override {
    std::lock_guard lock(mutex_);
    check_live();
    throw Error(Code::kUnimplemented, std::string(kNoExec));
  }

  FilesCapture capture_files(const std::filesystem::path&, const image::UpperTreeLimits&) override {
    std::lock_guard lock(mutex_);
    check_live();
    throw Error(Code::kUnimplemented,
                "the null backend cannot snapshot: it simulates the control plane and has no file system to capture");
  }

  void write_file(std::string_view path, std::string_view data, unsigned mode) override {
    std::lock_guard lock(mutex_);
    check_live();
    put_file(normalize(path), data, mode);
  }

  std::string read_file(std::string_view path) override {
    std::lock_guard lock(mutex_);
    check_live();
    std::string p = normalize(path);
    const Node& node = find(p);
    if (node.dir) throw Error(Code::kInvalidArgument, fmt::format("{} is a directory", p));
    return node.data;
  }

  void put_archive(std::string_view dir, std::string_view tar_bytes) override {
    std::lock_guard lock(mutex_);
    check_live();
    std::string base = normalize(dir);
    make_dirs(base);
    ArchiveReader r;
    archive_read_support_format_tar(r.a);
    archive_read_support_format_gnutar(r.a);
    archive_read_support_filter_all(r.a);
    if (archive_read_open_memory(r.a, tar_bytes.data(), tar_bytes.size()) != ARCHIVE_OK)
      throw Error(Code::kInvalidArgument, fmt::format("not a tar stream: {}", archive_error_string(r.a)));
    archive_entry* entry = nullptr;
    for (;;) {
      int rc = archive_read_next_header(r.a, &entry);
      if (rc == ARCHIVE_EOF) break;
      if (rc < ARCHIVE_WARN)
        throw Error(Code::kInvalidArgument, fmt::format("malformed tar stream: {}", archive_error_string(r.a)));
      const char* raw = archive_entry_pathname(entry);
      std::string name = raw ? raw : "";
      std::string target = normalize(fmt::format("{}/{}", base == "/" ? "" : base, name));
      if (target != base && target.rfind(base == "/" ? "/" : base + "/", 0) != 0)
        throw Error(Code::kInvalidArgument, fmt::format("tar entry '{}' leaves the directory {}", name, base));
      unsigned mode = archive_entry_perm(entry) & 07777;
      switch (archive_entry_filetype(entry)) {
        case AE_IFDIR:
          make_dirs(target);
          files_[target].mode = mode;
          break;
        case AE_IFREG: {
          std::string data;
          la_int64_t size = archive_entry_size(entry);
          if (size > 0) data.reserve(static_cast<std::size_t>(size));
          char buf[65536];
          for (;;) {
            la_ssize_t n = archive_read_data(r.a, buf, sizeof buf);
            if (n < 0)
              throw Error(Code::kInvalidArgument, fmt::format("tar entry '{}': {}", name, archive_error_string(r.a)));
            if (n == 0) break;
            data.append(buf, static_cast<std::size_t>(n));
          }
          put_file(target, data, mode);
          break;
        }
        default:
          throw Error(Code::kInvalidArgument,
                      fmt::format("tar entry '{}': the null backend keeps regular files and directories only", name));
      }
    }
  }

  std::string get_archive(std::string_view dir) override {
    std::lock_guard lock(mutex_);
    check_live();
    std::string base = normalize(dir);
    if (!find(base).dir) throw Error(Code::kInvalidArgument, fmt::format("{} is not a directory", base));
    std::string out;
    ArchiveWriter w;
    archive_write_set_format_pax_restricted(w.a);
    archive_write_set_bytes_in_last_block(w.a, 1);
    auto append = [](archive*, void* ctx, const void* buf, size_t n) -> la_ssize_t {
      static_cast<std::string*>(ctx)->append(static_cast<const char*>(buf), n);
      return static_cast<la_ssize_t>(n);
    };
    if (archive_write_open(w.a, &out, nullptr, append, nullptr) != ARCHIVE_OK)
      throw Error(Code::kInternal, fmt::format("tar writer: {}", archive_error_string(w.a)));
    std::string prefix = base == "/" ? "/" : base + "/";
    for (auto it = files_.lower_bound(prefix); it != files_.end() && it->first.rfind(prefix, 0) == 0; ++it) {
      const auto& [path, node] = *it;
      EntryPtr e;
      std::string name = path.substr(prefix.size());
      archive_entry_set_pathname(e.e, node.dir ? (name + "/").c_str() : name.c_str());
      archive_entry_set_filetype(e.e, node.dir ? AE_IFDIR : AE_IFREG);
      archive_entry_set_perm(e.e, node.mode);
      archive_entry_set_size(e.e, node.dir ? 0 : static_cast<la_int64_t>(node.data.size()));
      archive_entry_set_mtime(e.e, node.mtime, 0);
      if (archive_write_header(w.a, e.e) != ARCHIVE_OK)
        throw Error(Code::kInternal, fmt::format("tar writer: {}: {}", path, archive_error_string(w.a)));
      if (!node.dir && !node.data.empty() &&
          archive_write_data(w.a, node.data.data(), node.data.size()) != static_cast<la_ssize_t>(node.data.size()))
        throw Error(Code::kInternal, fmt::format("tar writer: {}: {}", path, archive_error_string(w.a)));
    }
    if (archive_write_close(w.a) != ARCHIVE_OK)
      throw Error(Code::kInternal, fmt::format("tar writer: {}", archive_error_string(w.a)));
    return out;
  }

  bool is_directory(std::string_view path) override {
    std::lock_guard lock(mutex_);
    check_live();
    auto it = files_.find(normalize(path));
    return it != files_.end() && it->second.dir;
  }

  bool alive() override {
    std::lock_guard lock(mutex_);
    return !destroyed_;
  }

  void destroy() override {
    std::lock_guard lock(mutex_);
    destroyed_ = true;
    files_.clear();
    used_bytes_ = 0;
  }

 private:
  struct Node {
    bool dir = false;
    std::string data;
    unsigned mode = 0644;
    std::time_t mtime = 0;
  };

  void check_live() const {
    if (destroyed_) throw Error(Code::kNotFound, "the sandbox was destroyed");
  }

  const Node& find(const std::string& path) const {
    auto it = files_.find(path);
    if (it == files_.end()) throw Error(Code::kNotFound, fmt::format("{}: no such file or directory", path));
    return it->second;
  }

  // Creates `path` and its missing parents as directories, like mkdir -p.
  void make_dirs(const std::string& path) {
    if (path != "/") make_dirs(parent_of(path));
    auto it = files_.find(path);
    if (it == files_.end()) {
      files_[path] = Node{true, {}, 0755, std::time(nullptr)};
    } else if (!it->second.dir) {
      throw Error(Code::kInvalidArgument, fmt::format("{} is not a directory", path));
    }
  }

  void put_file(const std::string& path, std::string_view data, unsigned mode) {
    if (path == "/") throw Error(Code::kInvalidArgument, "/ is a directory");
    make_dirs(parent_of(path));
    auto it = files_.find(path);
    std::uint64_t old_size = 0;
    if (it != files_.end()) {
      if (it->second.dir) throw Error(Code::kInvalidArgument, fmt::format("{} is a directory", path));
      old_size = it->second.data.size();
    }
    std::uint64_t used = used_bytes_ - old_size + data.size();
    if (used > disk_bytes_)
      throw Error(Code::kResourceExhausted,
                  fmt::format("{}: no space left: {} bytes would exceed the sandbox's disk of {} bytes", path, used,
                              disk_bytes_),
                  false);
    used_bytes_ = used;
    files_[path] = Node{false, std::string(data), mode & 07777, std::time(nullptr)};
  }

  std::mutex mutex_;
  std::map<std::string, Node> files_;
  std::uint64_t disk_bytes_;
  std::uint64_t used_bytes_ = 0;
  bool destroyed_ = false;
};

class NullBackend final : public Backend {
 public:
  std::string_view kind() const override { return "null"; }
  std::unique_ptr<BackendSandbox> create(const CreateParams& params) override {
    return std::make_unique<NullSandbox>(params.spec.resources.disk_bytes);
  }
  // A simulated sandbox has nothing outside the agent that could have died with it: it is taken over as it was
  // recorded. Its files lived in the old agent's memory, so it comes back with an empty root.
  std::unique_ptr<BackendSandbox> adopt(const AdoptParams& params) override {
    return std::make_unique<NullSandbox>(params.spec.resources.disk_bytes);
  }
};

}  // namespace

std::unique_ptr<Backend> make_null_backend() { return std::make_unique<NullBackend>(); }

}  // namespace dsec::agent
