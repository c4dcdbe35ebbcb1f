// What an image's configuration (Env, WorkingDir, User: kept from registry images) makes of a sandbox's spec. Every
// tier runs its execs, sessions, processes and function calls from the spec, so applying it once, at create, is
// what makes the image's shell behave as `docker run` of it would.
#pragma once

#include "dsec/spec.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent {

// The spec with the image's defaults under it: the image's Env below the spec's env (the spec's value wins for a
// name both set), the image's WorkingDir when the spec names none (else "/"), the image's User when the spec names
// none. Without a config, only the working directory's default is filled in.
SandboxSpec apply_image_config(SandboxSpec spec, const image::ImageConfig* config);

}  // namespace dsec::agent
