// Bearer tokens (http/tokens): the file's format and its refusals, hashing, and who a header names.
#include <gtest/gtest.h>

#include "dsec/error.hpp"
#include "http/tokens.hpp"

namespace dsec::agent::auth {
namespace {

std::string line(const std::string& tenant, const std::string& role, const std::string& token) {
  return tenant + " " + role + " " + hex(hash_token(token)) + "\n";
}

TEST(AuthTokens, HashIsSha256InHex) {
  // sha256("abc")
  EXPECT_EQ(hex(hash_token("abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(AuthTokens, NewTokensAreLongAndDistinct) {
  std::string a = new_token(), b = new_token();
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind("dsec_", 0), 0u);
  EXPECT_EQ(a.size(), 5u + 43u);
  for (char c : a.substr(5)) EXPECT_TRUE(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') << a;
}

TEST(AuthTokens, AHeaderNamesItsTenantOrAdmin) {
  TokenTable t =
      TokenTable::parse("# a comment\n\n" + line("team-a", "tenant", "tok-a") + line("-", "admin", "tok-ops") +
                        "  team-b   tenant   " + hex(hash_token("tok-b")) + "   # trailing\n");
  EXPECT_EQ(t.size(), 3u);
  auto a = t.authenticate("Bearer tok-a");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->tenant, "team-a");
  EXPECT_FALSE(a->admin);
  EXPECT_TRUE(a->may_see("team-a"));
  EXPECT_FALSE(a->may_see("team-b"));
  EXPECT_FALSE(a->may_see(""));
  auto ops = t.authenticate("bearer   tok-ops ");
  ASSERT_TRUE(ops);
  EXPECT_TRUE(ops->admin);
  EXPECT_TRUE(ops->may_see("anyone"));
  EXPECT_EQ(t.authenticate("Bearer tok-b")->tenant, "team-b");
  for (const char* bad : {"", "Bearer", "Bearer ", "Basic dG9rLWE=", "tok-a", "Bearer tok-a-", "Bearer TOK-A"})
    EXPECT_FALSE(t.authenticate(bad)) << bad;
}

TEST(AuthTokens, MalformedLinesAreRefusedWithTheirNumber) {
  const std::string h = hex(hash_token("x"));
  struct Case {
    std::string text, says;
  } cases[] = {
      {"team-a tenant\n", "line 1: 2 fields"},
      {"ok tenant " + h + "\nteam-a boss " + h.substr(1) + "0\n", "line 2: role 'boss'"},
      {"team-a tenant " + h.substr(0, 63) + "\n", "64 hex digits"},
      {"team-a tenant " + h.substr(0, 63) + "g\n", "64 hex digits"},
      {"team/a tenant " + h + "\n", "not allowed"},
      {"-a tenant " + h + "\n", "start with a letter or a digit"},
      {"- tenant " + h + "\n", "start with a letter"},
      {std::string(64, 'a') + " tenant " + h + "\n", "1 to 63"},
      {"a tenant " + h + "\nb tenant " + h + "\n", "line 2: the same token hash twice"},
  };
  for (const auto& c : cases) {
    try {
      (void)TokenTable::parse(c.text, "tokens");
      ADD_FAILURE() << "accepted: " << c.text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << e.what() << " / wanted: " << c.says;
    }
  }
}

TEST(AuthTokens, TenantNames) {
  EXPECT_NO_THROW(check_tenant_name("team-a.eu_1"));
  for (const char* bad : {"", "a b", "a\x01", "../x", "x/y", ".hidden", "\xc3\xa9t\xc3\xa9"})
    EXPECT_THROW(check_tenant_name(bad), Error) << bad;
}

}  // namespace
}  // namespace dsec::agent::auth
