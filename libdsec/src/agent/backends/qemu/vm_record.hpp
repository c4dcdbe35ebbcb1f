// What a QEMU tier's sandbox record keeps for a restarted agent (BackendState): its QEMU's identity, cgroup, uid and
// how it was started, so that the next run can take it over or wake it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/backends/qemu/qemu_command.hpp"
#include "agent/images/layers/layer_image.hpp"

namespace dsec::agent::qemu {

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
// Full VMs only: the image's kernel and initramfs in the agent's cache, the screen ("vga 1280x800", "none").
constexpr const char* kKernel = "kernel";
constexpr const char* kInitrd = "initrd";
constexpr const char* kDisplay = "display";
}  // namespace record_key

// The readers' errors name the record by its tier, `kind` ("microvm record: no uid").

std::string encode_layers(const std::vector<layers::LayerImage>& images);
// INVALID_ARGUMENT for a malformed list.
std::vector<layers::LayerImage> decode_layers(std::string_view kind, const std::string& text);

// A screen as the record keeps it: "none", or "<device> <width>x<height>" (device: vga, virtio-gpu).
std::string encode_display(const DisplaySpec& display);
// INVALID_ARGUMENT for a malformed one.
DisplaySpec decode_display(std::string_view kind, const std::string& text);

// A value of the record; INVALID_ARGUMENT when it is missing (or, for a number, not one).
const std::string& state_value(std::string_view kind, const BackendState& state, const char* name);
std::uint64_t state_number(std::string_view kind, const BackendState& state, const char* name);

}  // namespace dsec::agent::qemu
