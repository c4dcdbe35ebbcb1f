// What a microVM sandbox's record keeps for a restarted agent (BackendState): its QEMU's identity, cgroup, uid and
// how it was started, so that the next run can take it over or wake it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "agent/backend.hpp"
#include "agent/layers/layer_image.hpp"

namespace dsec::agent::microvm {

namespace record_key {
constexpr const char* kBootId = "boot_id";
constexpr const char* kQemuPid = "qemu_pid";
constexpr const char* kQemuStart = "qemu_start_time";
constexpr const char* kUid = "uid";
constexpr const char* kCgroup = "cgroup";
constexpr const char* kMemory = "memory";
constexpr const char* kVcpus = "vcpus";
constexpr const char* kHostname = "hostname";
constexpr const char* kLayers = "layer_images";  // "file\tdata file" per line
constexpr const char* kRam = "ram";              // "own" (a memfd), "clone" (of a template), "anonymous"
constexpr const char* kAccelerator = "accelerator";
}  // namespace record_key

std::string encode_layers(const std::vector<layers::LayerImage>& images);
// INVALID_ARGUMENT for a malformed list.
std::vector<layers::LayerImage> decode_layers(const std::string& text);

// A value of the record; INVALID_ARGUMENT when it is missing (or, for a number, not one).
const std::string& state_value(const BackendState& state, const char* name);
std::uint64_t state_number(const BackendState& state, const char* name);

}  // namespace dsec::agent::microvm
