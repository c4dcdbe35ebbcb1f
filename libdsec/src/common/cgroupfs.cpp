#include "common/cgroupfs.hpp"

#include <fstream>
#include <sstream>

namespace dsec {

std::map<std::string, std::string> cgroup_v1_mounts() {
  std::map<std::string, std::string> out;
  std::ifstream in("/proc/self/mounts");
  std::string dev, dir, type, opts, rest;
  while (in >> dev >> dir >> type >> opts) {
    std::getline(in, rest);
    if (type != "cgroup") continue;
    std::istringstream os(opts);
    for (std::string opt; std::getline(os, opt, ',');) out.emplace(opt, dir);  // emplace keeps the first
  }
  return out;
}

}  // namespace dsec
