#include "agent/backends/container/cgroup.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mount.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/syscall.hpp"

namespace dsec::agent::container {

void write_cgroup_file(const std::string& path, const std::string& value) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) != static_cast<ssize_t>(value.size()))
    throw_errno_fmt(errno, "write '{}' to {}", value, path);
}

std::string read_cgroup_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf); });
    if (n < 0) throw_errno_fmt(errno, "read {}", path);
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

void check_adoptable_path(const std::string& path) {
  auto bad = [&] { return Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox's cgroup path", path)); };
  if (path.size() < 4 || path[0] != '/') throw bad();
  auto slash = path.find('/', 1);
  if (slash == std::string::npos || slash == 1 || slash + 1 >= path.size()) throw bad();
  const std::string_view view(path);
  for (std::string_view part : {view.substr(1, slash - 1), view.substr(slash + 1)})
    if (part == "." || part == ".." || part.find_first_of(std::string_view("/\n\0", 3)) != std::string_view::npos)
      throw bad();
}

std::vector<int> read_pids(const std::string& procs_path) {
  std::vector<int> pids;
  std::string text;
  try {
    text = read_cgroup_file(procs_path);
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) return pids;
    throw;
  }
  std::istringstream in(text);
  int pid;
  while (in >> pid) pids.push_back(pid);
  return pids;
}

std::vector<std::string> child_groups(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    if (entry.is_directory(ec)) out.push_back(entry.path().filename().string());
  return out;
}

void release_ended_groups(const std::string& parent, const std::string& name, std::set<std::string>& exec_groups,
                          std::set<std::string>& ended_groups) {
  if (exec_groups.count(name)) ended_groups.insert(name);
  for (auto it = ended_groups.begin(); it != ended_groups.end();) {
    std::string dir = parent + "/" + *it;
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) {
      exec_groups.erase(*it);
      it = ended_groups.erase(it);
    } else {
      ++it;
    }
  }
}

std::string enable_cgroup_favordynmods() {
  std::string features;
  try {
    features = read_cgroup_file("/sys/kernel/cgroup/features");
  } catch (const Error&) {
  }
  if (features.find("favordynmods") == std::string::npos)
    throw Error(Code::kFailedPrecondition, "this kernel has no cgroup favordynmods option (Linux 6.0 or later)");
  // The option is global: setting it on any cgroup hierarchy switches the kernel's one threadgroup lock. Prefer a
  // cgroup2 mount, else a v1 hierarchy; keep the mount's other options as they are.
  std::ifstream in("/proc/self/mountinfo");
  std::string line, v1_point, v1_opts;
  while (std::getline(in, line)) {
    auto sep = line.find(" - ");
    if (sep == std::string::npos) continue;
    std::istringstream head(line.substr(0, sep)), tail(line.substr(sep + 3));
    std::string id, parent, devno, root, point, type, source, opts;
    head >> id >> parent >> devno >> root >> point;
    tail >> type >> source >> opts;
    if (type != "cgroup2" && type != "cgroup") continue;
    if (opts.find("favordynmods") != std::string::npos)
      return fmt::format("cgroup favordynmods already on ({})", point);
    std::string kept;
    std::istringstream os(opts);
    for (std::string o; std::getline(os, o, ',');)
      if (o != "rw" && o != "ro") kept += (kept.empty() ? "" : ",") + o;
    kept += (kept.empty() ? "" : ",") + std::string("favordynmods");
    if (type == "cgroup2") {
      if (::mount(nullptr, point.c_str(), nullptr, MS_REMOUNT, kept.c_str()) != 0)
        throw_errno_fmt(errno, "remount {} with {}", point, kept);
      return fmt::format("cgroup favordynmods on (remounted {} with {})", point, kept);
    }
    if (v1_point.empty()) {
      v1_point = point;
      v1_opts = kept;
    }
  }
  if (v1_point.empty()) throw Error(Code::kFailedPrecondition, "no cgroup hierarchy is mounted");
  if (::mount(nullptr, v1_point.c_str(), nullptr, MS_REMOUNT, v1_opts.c_str()) != 0)
    throw_errno_fmt(errno, "remount {} with {}", v1_point, v1_opts);
  return fmt::format("cgroup favordynmods on (remounted {} with {})", v1_point, v1_opts);
}

std::unique_ptr<CgroupDriver> make_cgroup_driver(const std::string& name, bool cpu_accounting) {
  struct statfs st {};
  if (::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC) {
    return make_cgroup_v2_driver("/sys/fs/cgroup", name);
  }
  return make_cgroup_v1_driver("/sys/fs/cgroup", name, cpu_accounting);
}

}  // namespace dsec::agent::container
