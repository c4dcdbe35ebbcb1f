#include "agent/backends/container/cgroup.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "common/syscall.hpp"

namespace dsec::agent::container {

void write_cgroup_file(const std::string& path, const std::string& value) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) !=
      static_cast<ssize_t>(value.size()))
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

std::unique_ptr<CgroupDriver> make_cgroup_driver(const std::string& name) {
  struct statfs st {};
  if (::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC) {
    return make_cgroup_v2_driver("/sys/fs/cgroup", name);
  }
  return make_cgroup_v1_driver("/sys/fs/cgroup", name);
}

}  // namespace dsec::agent::container
