// Bearer tokens (dsecd --tokens FILE): who a request comes from. The file holds one token per line, hashed:
//
//     # tenant  role    sha256 of the token, hex
//     team-a    tenant  3f1c...e9
//     ops       admin   a0b4...17
//
// A `tenant` token sees and touches only its tenant's sandboxes; an `admin` token sees every tenant's. Tokens are
// kept only as their SHA-256 (a leaked file gives no token), and a presented token is compared against every line
// in constant time. Tenant names are 1-63 of [A-Za-z0-9._-], starting with a letter or digit.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::agent::auth {

// Who sent a request: a tenant, an admin, or (on a listener that asks for no token) the node's operator, who is an
// admin too.
struct Principal {
  std::string tenant;  // empty for an admin
  bool admin = false;
  // Whether `tenant` may see a sandbox of `owner`.
  bool may_see(std::string_view owner) const { return admin || owner == tenant; }
};

inline Principal operator_principal() { return Principal{"", true}; }

using TokenHash = std::array<unsigned char, 32>;

TokenHash hash_token(std::string_view token);
std::string hex(const TokenHash& h);
// A fresh token: "dsec_" and 43 characters of base64url (32 random bytes).
std::string new_token();
// INVALID_ARGUMENT naming what is wrong unless `name` is a tenant name as the file allows.
void check_tenant_name(std::string_view name);

class TokenTable {
 public:
  struct Entry {
    std::string tenant;  // empty for an admin token without a tenant ("-" in the file)
    bool admin = false;
    TokenHash hash{};
  };

  // Reads the file; INVALID_ARGUMENT naming the line of anything malformed (a wrong field count, an unknown role, a
  // hash that is not 64 hex digits, a hostile tenant name, a hash twice). A file anyone but its owner can read or
  // write is refused too (FAILED_PRECONDITION): it decides who controls the node.
  static TokenTable load(const std::filesystem::path& file);
  static TokenTable parse(std::string_view text, std::string_view source = "tokens");

  // The principal of an Authorization header's value ("Bearer <token>"); nullopt when it names no token of the
  // table (or is not a bearer header at all).
  std::optional<Principal> authenticate(std::string_view authorization) const;
  std::size_t size() const noexcept { return entries_.size(); }

 private:
  std::vector<Entry> entries_;
};

}  // namespace dsec::agent::auth
