#include "image/registry/oci_image.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "image/store/digest.hpp"

namespace dsec::image::registry {
namespace {

using nlohmann::json;

constexpr std::size_t kMaxEntries = 1000;
// No layer or manifest of a real image comes near this; a larger size is a lie meant to make dsec reserve space.
constexpr std::uint64_t kMaxDescriptorSize = 1ull << 40;

constexpr std::string_view kOciIndex = "application/vnd.oci.image.index.v1+json";
constexpr std::string_view kDockerList = "application/vnd.docker.distribution.manifest.list.v2+json";
constexpr std::string_view kOciManifest = "application/vnd.oci.image.manifest.v1+json";
constexpr std::string_view kDockerManifest = "application/vnd.docker.distribution.manifest.v2+json";
constexpr std::string_view kDockerSchema1 = "application/vnd.docker.distribution.manifest.v1";

[[noreturn]] void bad(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("registry manifest: {}: {}", field, why));
}

[[noreturn]] void bad_config(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("image configuration: {}: {}", field, why));
}

std::string string_member(const json& j, const char* key, std::string_view path, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) bad(fmt::format("{}{}", path, key), "missing");
    return {};
  }
  if (!it->is_string()) bad(fmt::format("{}{}", path, key), "must be a string");
  return it->get<std::string>();
}

Descriptor descriptor(const json& j, std::string_view path) {
  if (!j.is_object()) bad(path, "must be an object");
  Descriptor d;
  d.media_type = string_member(j, "mediaType", fmt::format("{}.", path), true);
  d.digest = string_member(j, "digest", fmt::format("{}.", path), true);
  if (!is_digest(d.digest))
    bad(fmt::format("{}.digest", path),
        fmt::format("'{}' is not a sha256 digest (dsec verifies sha256 only)", d.digest.substr(0, 80)));
  auto size = j.find("size");
  if (size == j.end() || !size->is_number_unsigned())
    bad(fmt::format("{}.size", path), "must be a non-negative integer");
  d.size = size->get<std::uint64_t>();
  if (d.size > kMaxDescriptorSize)
    bad(fmt::format("{}.size", path), fmt::format("{} bytes is beyond any image's size", d.size));
  return d;
}

LayerCompression layer_compression(std::string_view media_type, std::string_view path) {
  static const std::pair<std::string_view, LayerCompression> kTypes[] = {
      {"application/vnd.oci.image.layer.v1.tar", LayerCompression::kNone},
      {"application/vnd.oci.image.layer.v1.tar+gzip", LayerCompression::kGzip},
      {"application/vnd.oci.image.layer.v1.tar+zstd", LayerCompression::kZstd},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar", LayerCompression::kNone},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar+gzip", LayerCompression::kGzip},
      {"application/vnd.oci.image.layer.nondistributable.v1.tar+zstd", LayerCompression::kZstd},
      {"application/vnd.docker.image.rootfs.diff.tar", LayerCompression::kNone},
      {"application/vnd.docker.image.rootfs.diff.tar.gzip", LayerCompression::kGzip},
      {"application/vnd.docker.image.rootfs.diff.tar.zstd", LayerCompression::kZstd},
      {"application/vnd.docker.image.rootfs.foreign.diff.tar.gzip", LayerCompression::kGzip},
  };
  for (const auto& [type, compression] : kTypes)
    if (media_type == type) return compression;
  bad(path, fmt::format("layer media type '{}' is not a tar, tar+gzip or tar+zstd layer", media_type.substr(0, 120)));
}

std::optional<Platform> platform_member(const json& j, std::string_view path) {
  auto it = j.find("platform");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) bad(fmt::format("{}.platform", path), "must be an object");
  Platform p;
  p.os = string_member(*it, "os", fmt::format("{}.platform.", path), true);
  p.architecture = string_member(*it, "architecture", fmt::format("{}.platform.", path), true);
  p.variant = string_member(*it, "variant", fmt::format("{}.platform.", path), false);
  return p;
}

std::vector<std::string> string_list(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_array()) bad_config(fmt::format("config.{}", key), "must be a list of strings");
  std::vector<std::string> out;
  for (const auto& item : *it) {
    if (!item.is_string()) bad_config(fmt::format("config.{}", key), "must be a list of strings");
    out.push_back(item.get<std::string>());
  }
  return out;
}

std::string config_string(const json& j, const char* key, std::string_view path) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_string()) bad_config(fmt::format("{}{}", path, key), "must be a string");
  return it->get<std::string>();
}

}  // namespace

const char* const kManifestAccept =
    "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, "
    "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

std::string Platform::to_string() const {
  return variant.empty() ? fmt::format("{}/{}", os, architecture) : fmt::format("{}/{}/{}", os, architecture, variant);
}

Platform parse_platform(std::string_view text) {
  Platform p;
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= text.size(); ++i)
    if (i == text.size() || text[i] == '/') {
      parts.emplace_back(text.substr(start, i - start));
      start = i + 1;
    }
  if (parts.size() < 2 || parts.size() > 3 ||
      std::any_of(parts.begin(), parts.end(), [](auto& s) { return s.empty(); }))
    throw Error(Code::kInvalidArgument,
                fmt::format("platform '{}' is not OS/ARCHITECTURE[/VARIANT] (linux/amd64)", text.substr(0, 80)));
  p.os = parts[0];
  p.architecture = parts[1];
  if (parts.size() == 3) p.variant = parts[2];
  return p;
}

std::string_view to_string(LayerCompression compression) {
  switch (compression) {
    case LayerCompression::kGzip:
      return "gzip";
    case LayerCompression::kZstd:
      return "zstd";
    case LayerCompression::kNone:
      break;
  }
  return "uncompressed";
}

ManifestDocument parse_manifest(std::string_view body, std::string_view content_type) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("registry manifest: not JSON: {}", e.what()));
  }
  if (!j.is_object()) bad("(top)", "must be an object");
  ManifestDocument doc;
  doc.media_type = string_member(j, "mediaType", "", false);
  if (doc.media_type.empty()) {
    // Content-Type may carry parameters ("; charset=utf-8").
    doc.media_type = std::string(content_type.substr(0, content_type.find(';')));
    while (!doc.media_type.empty() && doc.media_type.back() == ' ') doc.media_type.pop_back();
  }
  auto schema = j.find("schemaVersion");
  if (schema != j.end() && schema->is_number_integer() && schema->get<std::int64_t>() == 1)
    bad("schemaVersion", "Docker's schema 1 manifests are not supported (push the image again with a current client)");
  if (doc.media_type.starts_with(kDockerSchema1))
    bad("mediaType", "Docker's schema 1 manifests are not supported (push the image again with a current client)");
  if (schema == j.end() || !schema->is_number_integer() || schema->get<std::int64_t>() != 2)
    bad("schemaVersion", "must be 2");
  const bool has_manifests = j.contains("manifests");
  if (doc.media_type == kOciIndex || doc.media_type == kDockerList || (doc.media_type.empty() && has_manifests)) {
    doc.is_index = true;
    auto list = j.find("manifests");
    if (list == j.end() || !list->is_array()) bad("manifests", "must be a list");
    if (list->size() > kMaxEntries) bad("manifests", fmt::format("more than {} entries", kMaxEntries));
    for (std::size_t i = 0; i < list->size(); ++i) {
      std::string path = fmt::format("manifests[{}]", i);
      Descriptor d = descriptor((*list)[i], path);
      d.platform = platform_member((*list)[i], path);
      doc.manifests.push_back(std::move(d));
    }
    return doc;
  }
  if (!doc.media_type.empty() && doc.media_type != kOciManifest && doc.media_type != kDockerManifest)
    bad("mediaType", fmt::format("'{}' is not an image manifest or index dsec reads", doc.media_type.substr(0, 120)));
  auto config = j.find("config");
  if (config == j.end()) bad("config", "missing");
  doc.config = descriptor(*config, "config");
  if (doc.config.media_type != "application/vnd.oci.image.config.v1+json" &&
      doc.config.media_type != "application/vnd.docker.container.image.v1+json")
    bad("config.mediaType",
        fmt::format("'{}': not a container image (an artifact of another kind)", doc.config.media_type.substr(0, 120)));
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_array()) bad("layers", "must be a list");
  if (layers->empty()) bad("layers", "an image with no layers has no files to run");
  if (layers->size() > kMaxEntries) bad("layers", fmt::format("more than {} layers", kMaxEntries));
  for (std::size_t i = 0; i < layers->size(); ++i) {
    std::string path = fmt::format("layers[{}]", i);
    Descriptor d = descriptor((*layers)[i], path);
    d.compression = layer_compression(d.media_type, path + ".mediaType");
    doc.layers.push_back(std::move(d));
  }
  return doc;
}

std::optional<Descriptor> pick_platform(const ManifestDocument& index, const Platform& wanted) {
  for (const auto& d : index.manifests) {
    if (!d.platform || d.platform->os != wanted.os || d.platform->architecture != wanted.architecture) continue;
    if (!wanted.variant.empty() && !d.platform->variant.empty() && wanted.variant != d.platform->variant) continue;
    return d;
  }
  return std::nullopt;
}

std::string platforms_of(const ManifestDocument& index) {
  std::set<std::string> names;
  for (const auto& d : index.manifests)
    if (d.platform && d.platform->os != "unknown") names.insert(d.platform->to_string());
  if (names.empty()) return "none named";
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

ImageConfigDocument parse_image_config(std::string_view body) {
  json j;
  try {
    j = json::parse(body);
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("image configuration: not JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_config("(top)", "must be an object");
  ImageConfigDocument doc;
  doc.platform.os = config_string(j, "os", "");
  doc.platform.architecture = config_string(j, "architecture", "");
  doc.platform.variant = config_string(j, "variant", "");
  if (auto c = j.find("config"); c != j.end() && !c->is_null()) {
    if (!c->is_object()) bad_config("config", "must be an object");
    ImageConfig& out = doc.config;
    out.env = string_list(*c, "Env");
    for (const auto& e : out.env)
      if (e.empty() || e.front() == '=' || e.find('=') == std::string::npos)
        bad_config("config.Env", fmt::format("'{}' is not KEY=value", e.substr(0, 80)));
    out.entrypoint = string_list(*c, "Entrypoint");
    out.cmd = string_list(*c, "Cmd");
    out.working_dir = config_string(*c, "WorkingDir", "config.");
    if (!out.working_dir.empty() && out.working_dir.front() != '/')
      bad_config("config.WorkingDir", fmt::format("'{}' is not an absolute path", out.working_dir.substr(0, 80)));
    out.user = config_string(*c, "User", "config.");
    out.stop_signal = config_string(*c, "StopSignal", "config.");
    if (auto ports = c->find("ExposedPorts"); ports != c->end() && !ports->is_null()) {
      if (!ports->is_object()) bad_config("config.ExposedPorts", "must be an object");
      for (const auto& [port, _] : ports->items()) out.exposed_ports.push_back(port);
      std::sort(out.exposed_ports.begin(), out.exposed_ports.end());
    }
    if (auto labels = c->find("Labels"); labels != c->end() && !labels->is_null()) {
      if (!labels->is_object()) bad_config("config.Labels", "must be an object");
      for (const auto& [key, value] : labels->items()) {
        if (!value.is_string()) bad_config(fmt::format("config.Labels.{}", key.substr(0, 80)), "must be a string");
        out.labels[key] = value.get<std::string>();
      }
    }
  }
  if (auto rootfs = j.find("rootfs"); rootfs != j.end() && rootfs->is_object()) {
    auto ids = rootfs->find("diff_ids");
    if (ids != rootfs->end() && ids->is_array())
      for (const auto& id : *ids) {
        if (!id.is_string() || !is_digest(id.get<std::string>()))
          bad_config("rootfs.diff_ids", "every entry must be a sha256 digest");
        doc.diff_ids.push_back(id.get<std::string>());
      }
  }
  return doc;
}

}  // namespace dsec::image::registry
