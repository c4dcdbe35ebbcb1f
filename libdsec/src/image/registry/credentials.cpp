#include "image/registry/credentials.hpp"

#include <openssl/evp.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"

namespace dsec::image::registry {
namespace {

constexpr std::size_t kMaxConfigBytes = 1u << 20;

// Base64 as Docker writes it (standard alphabet, padded). nullopt when it is not.
std::optional<std::string> decode_base64(std::string_view text) {
  if (text.empty() || text.size() % 4 != 0 || text.size() > std::size_t{64} * 1024) return std::nullopt;
  std::string out(text.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) return std::nullopt;
  // EVP_DecodeBlock counts the padding's zero bytes in.
  std::size_t padding = text.ends_with("==") ? 2 : text.ends_with("=") ? 1 : 0;
  out.resize(static_cast<std::size_t>(n) - padding);
  return out;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

}  // namespace

std::string credential_host(std::string_view key) {
  if (auto scheme = key.find("://"); scheme != std::string_view::npos) key.remove_prefix(scheme + 3);
  key = key.substr(0, key.find('/'));
  std::string host = lower(key);
  if (host == "index.docker.io" || host == "registry-1.docker.io" || host == "registry.hub.docker.com")
    return "docker.io";
  return host;
}

void Credentials::add(std::string_view host, Credential credential) {
  std::string key = credential_host(host);
  by_host_[key] = std::move(credential);
  given_[key] = true;
}

void Credentials::add_flag(std::string_view text) {
  auto eq = text.find('=');
  if (eq == std::string_view::npos || eq == 0)
    throw Error(Code::kInvalidArgument, "registry credentials: expected HOST=USER:PASSWORD");
  std::string_view host = text.substr(0, eq);
  std::string_view rest = text.substr(eq + 1);
  auto colon = rest.find(':');
  if (colon == std::string_view::npos || colon == 0)
    throw Error(Code::kInvalidArgument,
                fmt::format("registry credentials for {}: expected HOST=USER:PASSWORD", host.substr(0, 200)));
  add(host, Credential{std::string(rest.substr(0, colon)), std::string(rest.substr(colon + 1))});
}

void Credentials::load_docker_config(const std::filesystem::path& file) {
  std::error_code ec;
  if (file.empty() || !std::filesystem::exists(file, ec)) return;
  auto size = std::filesystem::file_size(file, ec);
  if (ec || size > kMaxConfigBytes)
    throw Error(Code::kInvalidArgument,
                fmt::format("registry credentials: {}: {}", file.string(),
                            ec ? ec.message() : fmt::format("larger than {} bytes", kMaxConfigBytes)));
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) throw Error(Code::kInvalidArgument, fmt::format("registry credentials: cannot read {}", file.string()));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(Code::kInvalidArgument,
                fmt::format("registry credentials: {} is not JSON: {}", file.string(), e.what()));
  }
  auto auths = j.find("auths");
  if (!j.is_object() || auths == j.end() || !auths->is_object()) return;
  for (const auto& [key, entry] : auths->items()) {
    if (!entry.is_object()) continue;
    std::string host = credential_host(key);
    if (given_.count(host)) continue;
    Credential c;
    if (auto auth = entry.find("auth"); auth != entry.end() && auth->is_string() && !auth->get<std::string>().empty()) {
      auto decoded = decode_base64(auth->get<std::string>());
      auto colon = decoded ? decoded->find(':') : std::string::npos;
      if (!decoded || colon == std::string::npos)
        throw Error(Code::kInvalidArgument, fmt::format("registry credentials: {}: auths[\"{}\"].auth is not base64 "
                                                        "of USER:PASSWORD",
                                                        file.string(), key.substr(0, 200)));
      c.username = decoded->substr(0, colon);
      c.password = decoded->substr(colon + 1);
    } else if (entry.contains("username") && entry.contains("password") && entry["username"].is_string() &&
               entry["password"].is_string()) {
      c.username = entry["username"].get<std::string>();
      c.password = entry["password"].get<std::string>();
    } else {
      continue;
    }
    by_host_[host] = std::move(c);
  }
}

std::filesystem::path Credentials::default_docker_config() {
  if (const char* dir = std::getenv("DOCKER_CONFIG"); dir && *dir) return std::filesystem::path(dir) / "config.json";
  if (const char* home = std::getenv("HOME"); home && *home)
    return std::filesystem::path(home) / ".docker" / "config.json";
  return {};
}

std::optional<Credential> Credentials::find(std::string_view host) const {
  auto it = by_host_.find(credential_host(host));
  if (it == by_host_.end()) return std::nullopt;
  return it->second;
}

}  // namespace dsec::image::registry
