// Who dsec is to a registry: user names and passwords by registry host, given by the operator or the caller
// (`--registry-auth HOST=USER:PASSWORD`, `dsec.Client(registry_auth={HOST: (USER, PASSWORD)})`) or read from
// Docker's own file (`~/.docker/config.json`, or `$DOCKER_CONFIG/config.json`: its "auths" with a base64 "auth" or a
// "username" and "password"). Given credentials win over the file's. Credential helpers ("credsStore") are not run.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace dsec::image::registry {

struct Credential {
  std::string username;
  std::string password;
};

class Credentials {
 public:
  void add(std::string_view host, Credential credential);
  // "HOST=USER:PASSWORD" (the flags' form). INVALID_ARGUMENT naming what is missing, never echoing the password.
  void add_flag(std::string_view text);
  // Docker's config.json. A missing file adds nothing; an unreadable or malformed one is INVALID_ARGUMENT naming it.
  // Entries of hosts given with add() are not replaced.
  void load_docker_config(const std::filesystem::path& file);
  // $DOCKER_CONFIG/config.json, else $HOME/.docker/config.json (empty when neither variable is set).
  static std::filesystem::path default_docker_config();

  // The credential for a registry host ("127.0.0.1:5000", "docker.io"), or none: anonymous.
  std::optional<Credential> find(std::string_view host) const;
  bool empty() const noexcept { return by_host_.empty(); }

 private:
  std::map<std::string, Credential, std::less<>> by_host_;
  std::map<std::string, bool, std::less<>> given_;  // hosts added by add(): the file does not replace them
};

// The host a credential key names: "https://index.docker.io/v1/" -> "docker.io", "http://h:5000/v2/" -> "h:5000".
std::string credential_host(std::string_view key);

}  // namespace dsec::image::registry
