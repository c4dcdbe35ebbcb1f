#include "agent/images/image_config.hpp"

namespace dsec::agent {

SandboxSpec apply_image_config(SandboxSpec spec, const image::ImageConfig* config) {
  if (config) {
    for (const std::string& entry : config->env) {
      const std::size_t eq = entry.find('=');
      if (eq == std::string::npos || eq == 0) continue;
      spec.env.try_emplace(entry.substr(0, eq), entry.substr(eq + 1));  // the spec's own value stays
    }
    if (spec.workdir.empty()) spec.workdir = config->working_dir;
    if (spec.user.empty()) spec.user = config->user;
  }
  if (spec.workdir.empty()) spec.workdir.push_back('/');
  return spec;
}

}  // namespace dsec::agent
