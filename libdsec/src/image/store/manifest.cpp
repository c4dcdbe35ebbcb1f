#include "image/store/manifest.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "image/store/digest.hpp"

namespace dsec::image {
namespace {

using nlohmann::json;

constexpr std::size_t kMaxRepositoryLength = 255;
constexpr std::size_t kMaxTagLength = 128;

bool is_alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
bool is_name_char(char c) { return is_alnum(c) || c == '-' || c == '_' || c == '.'; }

std::string describe_char(char c) {
  if (c == ' ') return "a space";
  if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
    return fmt::format("byte 0x{:02x}", static_cast<unsigned char>(c));
  return fmt::format("'{}'", c);
}

[[noreturn]] void bad_reference(std::string_view text, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("invalid image name '{}': {}", text.substr(0, 300), why));
}

[[noreturn]] void bad_field(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("manifest: {}: {}", field, why));
}

void check_repository(std::string_view text, std::string_view repo) {
  if (repo.empty()) bad_reference(text, "no name before the tag");
  if (repo.size() > kMaxRepositoryLength)
    bad_reference(text, fmt::format("the name is longer than {} characters", kMaxRepositoryLength));
  std::size_t part_start = 0;
  for (std::size_t i = 0; i <= repo.size(); ++i) {
    if (i == repo.size() || repo[i] == '/') {
      if (i == part_start) bad_reference(text, "an empty part between '/'");
      if (!is_alnum(repo[part_start]))
        bad_reference(text,
                      fmt::format("'{}' must start with a letter or digit", repo.substr(part_start, i - part_start)));
      part_start = i + 1;
      continue;
    }
    if (!is_name_char(repo[i])) bad_reference(text, fmt::format("{} is not allowed", describe_char(repo[i])));
  }
}

void check_tag(std::string_view text, std::string_view tag) {
  if (tag.empty()) bad_reference(text, "an empty tag after ':'");
  if (tag.size() > kMaxTagLength)
    bad_reference(text, fmt::format("the tag is longer than {} characters", kMaxTagLength));
  if (!is_alnum(tag[0]) && tag[0] != '_') bad_reference(text, "the tag must start with a letter, digit or '_'");
  for (char c : tag)
    if (!is_name_char(c)) bad_reference(text, fmt::format("{} is not allowed in the tag", describe_char(c)));
}

template <typename T>
T field(const json& j, const char* key, std::string_view path) {
  auto it = j.find(key);
  if (it == j.end()) bad_field(fmt::format("{}{}", path, key), "missing");
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    bad_field(fmt::format("{}{}", path, key), "wrong type");
  }
}

// A member that may be absent (then `fallback`), but that has the right type when present.
template <typename T>
T optional_field(const json& j, const char* key, std::string_view path, T fallback) {
  auto it = j.find(key);
  if (it == j.end()) return fallback;
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    bad_field(fmt::format("{}{}", path, key), "wrong type");
  }
}

// A byte count: a non-negative integer (a negative one would wrap around to a huge size).
std::uint64_t size_field(const json& j, const char* key, std::string_view path, bool required) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) bad_field(fmt::format("{}{}", path, key), "missing");
    return 0;
  }
  if (!it->is_number_unsigned()) bad_field(fmt::format("{}{}", path, key), "must be a non-negative integer");
  return it->get<std::uint64_t>();
}

std::string digest_field(const json& j, const char* key, std::string_view path) {
  auto d = field<std::string>(j, key, path);
  if (!is_digest(d))
    bad_field(fmt::format("{}{}", path, key), fmt::format("'{}' is not a sha256 digest", d.substr(0, 80)));
  return d;
}

json config_to_json(const ImageConfig& c) {
  return {{"env", c.env},   {"entrypoint", c.entrypoint},       {"cmd", c.cmd},       {"working_dir", c.working_dir},
          {"user", c.user}, {"exposed_ports", c.exposed_ports}, {"labels", c.labels}, {"stop_signal", c.stop_signal}};
}

std::vector<std::string> string_list(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_array()) bad_field(fmt::format("config.{}", key), "must be a list of strings");
  std::vector<std::string> out;
  for (const auto& item : *it) {
    if (!item.is_string()) bad_field(fmt::format("config.{}", key), "must be a list of strings");
    out.push_back(item.get<std::string>());
  }
  return out;
}

ImageConfig config_from_json(const json& j) {
  if (!j.is_object()) bad_field("config", "must be an object");
  ImageConfig c;
  c.env = string_list(j, "env");
  for (const auto& e : c.env)
    if (e.find('=') == std::string::npos || e.front() == '=')
      bad_field("config.env", fmt::format("'{}' is not KEY=value", e.substr(0, 80)));
  c.entrypoint = string_list(j, "entrypoint");
  c.cmd = string_list(j, "cmd");
  c.working_dir = optional_field<std::string>(j, "working_dir", "config.", "");
  if (!c.working_dir.empty() && c.working_dir.front() != '/')
    bad_field("config.working_dir", fmt::format("'{}' is not an absolute path", c.working_dir.substr(0, 80)));
  c.user = optional_field<std::string>(j, "user", "config.", "");
  c.exposed_ports = string_list(j, "exposed_ports");
  c.labels = optional_field<std::map<std::string, std::string>>(j, "labels", "config.", {});
  c.stop_signal = optional_field<std::string>(j, "stop_signal", "config.", "");
  return c;
}

}  // namespace

std::string_view to_string(LayerRole role) {
  switch (role) {
    case LayerRole::kBase:
      return "base";
    case LayerRole::kToolchain:
      return "toolchain";
    case LayerRole::kTask:
      return "task";
    case LayerRole::kSnapshot:
      return "snapshot";
  }
  return "base";
}

LayerRole parse_layer_role(std::string_view text) {
  if (text == "base") return LayerRole::kBase;
  if (text == "toolchain") return LayerRole::kToolchain;
  if (text == "task") return LayerRole::kTask;
  if (text == "snapshot") return LayerRole::kSnapshot;
  throw Error(Code::kInvalidArgument,
              fmt::format("unknown layer role '{}' (base, toolchain, task or snapshot)", text.substr(0, 40)));
}

std::uint64_t Manifest::size() const {
  std::uint64_t total = 0;
  for (const auto& l : layers) total += l.size;
  return total;
}

std::uint64_t Manifest::stored_size() const {
  std::uint64_t total = 0;
  for (const auto& l : layers) total += l.stored_size;
  return total;
}

std::string manifest_to_json(const Manifest& m) {
  json layers = json::array();
  for (const auto& l : m.layers)
    layers.push_back({{"role", to_string(l.role)},
                      {"digest", l.digest},
                      {"size", l.size},
                      {"index", l.index},
                      {"data", l.data},
                      {"stored_size", l.stored_size},
                      {"files_size", l.files_size}});
  json j = {{"schema", m.config ? Manifest::kSchemaVersion : 1},
            {"name", m.name},
            {"tag", m.tag},
            {"layers", std::move(layers)},
            {"created_at", m.created_at},
            {"source", m.source},
            {"parent", m.parent},
            {"notes", m.notes}};
  if (m.config) j["config"] = config_to_json(*m.config);
  // nlohmann's object is a sorted map: the dump is canonical.
  return j.dump();
}

Manifest manifest_from_json(std::string_view text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("manifest: not JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_field("(top)", "must be an object");
  // An integer (get<int>() of 1e30 would be undefined behaviour).
  auto schema_it = j.find("schema");
  if (schema_it == j.end()) bad_field("schema", "missing");
  if (!schema_it->is_number_integer()) bad_field("schema", "wrong type");
  std::int64_t schema = schema_it->get<std::int64_t>();
  if (schema < 1 || schema > Manifest::kSchemaVersion)
    bad_field("schema",
              fmt::format("version {} is not supported (this dsec reads 1 to {})", schema, Manifest::kSchemaVersion));
  Manifest m;
  m.name = field<std::string>(j, "name", "");
  m.tag = field<std::string>(j, "tag", "");
  // The name and the tag each on their own, so the message says which one is wrong.
  try {
    ImageReference ref = parse_reference(m.name);
    if (ref.name != m.name || ref.tag != "latest" || !ref.digest.empty())
      bad_reference(m.name, "not a normalised name");
  } catch (const Error& e) {
    bad_field("name", e.what());
  }
  try {
    ImageReference ref = parse_reference("x:" + m.tag);
    if (ref.tag != m.tag || !ref.digest.empty()) bad_reference(m.tag, "not a plain tag");
  } catch (const Error& e) {
    bad_field("tag", e.what());
  }
  m.created_at = optional_field<double>(j, "created_at", "", 0.0);
  m.source = optional_field<std::string>(j, "source", "", "");
  m.parent = optional_field<std::string>(j, "parent", "", "");
  try {
    m.notes = j.value("notes", std::vector<std::string>{});
  } catch (const json::exception&) {
    bad_field("notes", "must be a list of strings");
  }
  if (auto config = j.find("config"); config != j.end()) {
    if (schema < 2) bad_field("config", "comes with schema version 2 only");
    m.config = config_from_json(*config);
  }
  auto layers = j.find("layers");
  if (layers == j.end() || !layers->is_array() || layers->empty()) bad_field("layers", "must be a non-empty list");
  if (layers->size() > 64) bad_field("layers", "more than 64 layers");
  for (std::size_t i = 0; i < layers->size(); ++i) {
    const json& l = (*layers)[i];
    std::string path = fmt::format("layers[{}].", i);
    if (!l.is_object()) bad_field(fmt::format("layers[{}]", i), "must be an object");
    LayerDescriptor d;
    try {
      d.role = parse_layer_role(field<std::string>(l, "role", path));
    } catch (const Error& e) {
      bad_field(path + "role", e.what());
    }
    d.digest = digest_field(l, "digest", path);
    d.size = size_field(l, "size", path, true);
    d.index = digest_field(l, "index", path);
    d.data = digest_field(l, "data", path);
    d.stored_size = size_field(l, "stored_size", path, true);
    d.files_size = size_field(l, "files_size", path, false);
    if (d.size == 0) bad_field(path + "size", "must be positive");
    m.layers.push_back(std::move(d));
  }
  return m;
}

namespace {

// The first '/'-part of a name names a registry host when it has a '.' or a ':' or is "localhost" (Docker's rule),
// and starts as a host name does (so "../etc" is a bad repository, not a bad host).
bool names_host(std::string_view first_part) {
  if (first_part.empty() || !is_alnum(first_part.front())) return false;
  return first_part.find_first_of(".:") != std::string_view::npos || first_part == "localhost";
}

void check_host(std::string_view text, std::string_view host) {
  std::string_view port;
  if (std::size_t colon = host.find(':'); colon != std::string_view::npos) {
    port = host.substr(colon + 1);
    host = host.substr(0, colon);
    if (port.empty() || port.size() > 5 ||
        !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        std::stoul(std::string(port)) == 0 || std::stoul(std::string(port)) > 65535)
      bad_reference(text, fmt::format("the registry's port '{}' is not a number from 1 to 65535", port.substr(0, 20)));
  }
  if (host.empty()) bad_reference(text, "no registry host before the port");
  if (host.size() > 253) bad_reference(text, "the registry host is longer than 253 characters");
  std::size_t start = 0;
  for (std::size_t i = 0; i <= host.size(); ++i) {
    if (i < host.size() && host[i] != '.') {
      if (!is_alnum(host[i]) && host[i] != '-')
        bad_reference(text, fmt::format("{} is not allowed in the registry host", describe_char(host[i])));
      continue;
    }
    std::string_view label = host.substr(start, i - start);
    if (label.empty()) bad_reference(text, "an empty label in the registry host");
    if (label.front() == '-' || label.back() == '-')
      bad_reference(text, fmt::format("the registry host's label '{}' starts or ends with '-'", label));
    start = i + 1;
  }
}

}  // namespace

std::string_view ImageReference::registry() const {
  std::size_t slash = name.find('/');
  if (slash == std::string::npos) return {};
  std::string_view first = std::string_view(name).substr(0, slash);
  return names_host(first) ? first : std::string_view{};
}

std::string_view ImageReference::repository() const {
  std::string_view host = registry();
  return host.empty() ? std::string_view(name) : std::string_view(name).substr(host.size() + 1);
}

ImageReference parse_reference(std::string_view text) {
  if (text.empty()) bad_reference(text, "it is empty");
  ImageReference ref;
  std::string_view rest = text;
  if (std::size_t at = rest.find('@'); at != std::string_view::npos) {
    ref.digest = std::string(rest.substr(at + 1));
    if (!is_digest(ref.digest)) bad_reference(text, "what follows '@' must be a sha256 digest");
    rest = rest.substr(0, at);
  }
  std::string host;
  if (std::size_t slash = rest.find('/'); slash != std::string_view::npos && names_host(rest.substr(0, slash))) {
    check_host(text, rest.substr(0, slash));
    for (char c : rest.substr(0, slash)) host.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c);
    rest = rest.substr(slash + 1);
  }
  std::size_t colon = rest.find(':');
  if (colon != std::string_view::npos && rest.find(':', colon + 1) != std::string_view::npos)
    bad_reference(text, "more than one ':'");
  std::string_view repo = rest.substr(0, colon);
  std::string_view tag = colon == std::string_view::npos ? std::string_view("latest") : rest.substr(colon + 1);
  if (!host.empty() && repo.empty()) bad_reference(text, "no repository after the registry host");
  check_repository(text, repo);
  if (!host.empty() && host.size() + 1 + repo.size() > kMaxRepositoryLength)
    bad_reference(text, fmt::format("the name is longer than {} characters", kMaxRepositoryLength));
  check_tag(text, tag);
  ref.name = host.empty() ? std::string(repo) : host + "/" + std::string(repo);
  ref.tag = std::string(tag);
  return ref;
}

std::string escape_reference(std::string_view tagged) {
  std::string out;
  out.reserve(tagged.size() + 8);
  for (char c : tagged) {
    switch (c) {
      case '%':
        out += "%25";
        break;
      case '/':
        out += "%2F";
        break;
      case ':':
        out += "%3A";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

std::string unescape_reference(std::string_view escaped) {
  std::string out;
  for (std::size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] == '%' && i + 2 < escaped.size()) {
      std::string_view code = escaped.substr(i + 1, 2);
      char c = 0;
      if (code == "25") c = '%';
      else if (code == "2F" || code == "2f") c = '/';
      else if (code == "3A" || code == "3a") c = ':';
      if (c) {
        out.push_back(c);
        i += 2;
        continue;
      }
    }
    out.push_back(escaped[i]);
  }
  return out;
}

}  // namespace dsec::image
