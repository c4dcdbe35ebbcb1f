#include "http/tokens.hpp"

#include <sys/random.h>
#include <sys/stat.h>

#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "common/hex.hpp"
#include "common/syscall.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::auth {

TokenHash hash_token(std::string_view token) {
  TokenHash out{};
  unsigned int len = 0;
  if (EVP_Digest(token.data(), token.size(), out.data(), &len, EVP_sha256(), nullptr) != 1 || len != out.size())
    throw Error(Code::kInternal, "sha256 of a token failed");
  return out;
}

std::string hex(const TokenHash& h) {
  std::string out;
  out.reserve(64);
  for (unsigned char c : h) out += fmt::format("{:02x}", c);
  return out;
}

std::string new_token() {
  unsigned char raw[32];
  if (::getrandom(raw, sizeof raw, 0) != static_cast<ssize_t>(sizeof raw)) throw_errno(errno, "getrandom");
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out = "dsec_";
  std::uint32_t acc = 0;
  int bits = 0;
  for (unsigned char c : raw) {
    acc = (acc << 8) | c;
    bits += 8;
    while (bits >= 6) {
      out += kAlphabet[(acc >> (bits - 6)) & 63];
      bits -= 6;
    }
  }
  if (bits > 0) out += kAlphabet[(acc << (6 - bits)) & 63];
  return out;
}

void check_tenant_name(std::string_view name) {
  auto plain = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); };
  if (name.empty() || name.size() > 63)
    throw Error(Code::kInvalidArgument, fmt::format("tenant: must be 1 to 63 characters (got {})", name.size()));
  if (!plain(name.front())) throw Error(Code::kInvalidArgument, "tenant: must start with a letter or a digit");
  for (char c : name)
    if (!plain(c) && c != '.' && c != '_' && c != '-')
      throw Error(Code::kInvalidArgument,
                  fmt::format("tenant: character 0x{:02x} is not allowed (letters, digits, '.', '_', '-')",
                              static_cast<unsigned char>(c)));
}

TokenTable TokenTable::parse(std::string_view text, std::string_view source) {
  TokenTable table;
  std::istringstream in{std::string(text)};
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    auto bad = [&](const std::string& why) {
      return Error(Code::kInvalidArgument, fmt::format("{} line {}: {}", source, n, why));
    };
    if (auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream fields(line);
    std::vector<std::string> f;
    for (std::string w; fields >> w;) f.push_back(w);
    if (f.empty()) continue;
    if (f.size() != 3) throw bad(fmt::format("{} fields; a line is: tenant role sha256-hex", f.size()));
    Entry e;
    if (f[1] == "admin") {
      e.admin = true;
    } else if (f[1] != "tenant") {
      throw bad(fmt::format("role '{}' is not tenant or admin", f[1].substr(0, 32)));
    }
    if (!(e.admin && f[0] == "-")) {
      try {
        check_tenant_name(f[0]);
      } catch (const Error& err) {
        throw bad(err.what());
      }
      e.tenant = f[0];
    }
    if (f[2].size() != 64) throw bad("the hash must be the token's sha256 as 64 hex digits (dsec token new)");
    for (std::size_t i = 0; i < 32; ++i) {
      int hi = hex_value(f[2][2 * i]), lo = hex_value(f[2][2 * i + 1]);
      if (hi < 0 || lo < 0) throw bad("the hash must be the token's sha256 as 64 hex digits (dsec token new)");
      e.hash[i] = static_cast<unsigned char>(hi << 4 | lo);
    }
    for (const Entry& other : table.entries_)
      if (other.hash == e.hash) throw bad("the same token hash twice");
    table.entries_.push_back(std::move(e));
  }
  return table;
}

TokenTable TokenTable::load(const std::filesystem::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0)
    throw Error(Code::kFailedPrecondition, fmt::format("--tokens {}: {}", file.string(), std::strerror(errno)));
  if (!S_ISREG(st.st_mode))
    throw Error(Code::kFailedPrecondition, fmt::format("--tokens {}: not a regular file", file.string()));
  if (st.st_mode & (S_IRWXG | S_IRWXO))
    throw Error(Code::kFailedPrecondition,
                fmt::format("--tokens {}: mode {:04o} lets others read or change who controls this node; chmod 600",
                            file.string(), st.st_mode & 07777));
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof())
    throw Error(Code::kFailedPrecondition, fmt::format("--tokens {}: cannot read it", file.string()));
  return parse(text.str(), file.string());
}

std::optional<Principal> TokenTable::authenticate(std::string_view authorization) const {
  constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() <= kBearer.size()) return std::nullopt;
  for (std::size_t i = 0; i < kBearer.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(authorization[i])) !=
        std::tolower(static_cast<unsigned char>(kBearer[i])))
      return std::nullopt;
  std::string_view token = authorization.substr(kBearer.size());
  while (!token.empty() && token.front() == ' ') token.remove_prefix(1);
  while (!token.empty() && token.back() == ' ') token.remove_suffix(1);
  if (token.empty() || token.size() > 4096) return std::nullopt;
  const TokenHash presented = hash_token(token);
  // Every entry is compared, each in constant time: how long it takes says nothing of which one (or none) matched.
  const Entry* found = nullptr;
  for (const Entry& e : entries_)
    if (CRYPTO_memcmp(e.hash.data(), presented.data(), presented.size()) == 0) found = &e;
  if (!found) return std::nullopt;
  return Principal{found->tenant, found->admin};
}

}  // namespace dsec::agent::auth
