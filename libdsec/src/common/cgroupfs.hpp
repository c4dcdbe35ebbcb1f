// What the host's cgroup filesystems look like, read from /proc/self/mounts. Shared by the container runtime's
// cgroup drivers and the benchmarks that probe the same hierarchies.
#pragma once

#include <map>
#include <string>

namespace dsec {

// Controller name -> mount point of the first cgroup v1 hierarchy that carries it ("cpu" -> "/sys/fs/cgroup/cpu").
// Controllers the host does not mount as v1 are absent.
std::map<std::string, std::string> cgroup_v1_mounts();

}  // namespace dsec
