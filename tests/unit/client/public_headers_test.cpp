// The public headers a trainer includes pull in none of the heavy dependencies behind them (curl, nlohmann-json,
// Boost, OpenSSL, fmt) and leak none of their macros. Included first, before anything else can bring those in.
#include "dsec/dsec.hpp"
#include "dsec/process.hpp"
#include "dsec/session.hpp"

#if defined(CURLINC_CURL_H) || defined(__CURL_CURL_H)
#error "a public dsec header includes curl"
#endif
#if defined(NLOHMANN_JSON_VERSION_MAJOR) || defined(INCLUDE_NLOHMANN_JSON_HPP_)
#error "a public dsec header includes nlohmann/json"
#endif
#if defined(BOOST_VERSION) || defined(BOOST_CONFIG_HPP)
#error "a public dsec header includes Boost"
#endif
#if defined(OPENSSL_VERSION_NUMBER) || defined(HEADER_OPENSSLV_H)
#error "a public dsec header includes OpenSSL"
#endif
#if defined(FMT_VERSION)
#error "a public dsec header includes fmt"
#endif

#include <gtest/gtest.h>

#include <type_traits>

namespace {

TEST(PublicHeaders, HandlesAreMoveOnlyAndClientIsMovable) {
  static_assert(std::is_move_constructible_v<dsec::Sandbox> && !std::is_copy_constructible_v<dsec::Sandbox>);
  static_assert(std::is_move_constructible_v<dsec::Client> && !std::is_copy_constructible_v<dsec::Client>);
  dsec::Sandbox empty;
  EXPECT_FALSE(static_cast<bool>(empty));
  EXPECT_THROW(empty.info(), dsec::Error);
}

TEST(PublicHeaders, ProcessAndSessionHandlesAreCopyableAndEmptyOnesRefuse) {
  static_assert(std::is_copy_constructible_v<dsec::Process> && std::is_copy_constructible_v<dsec::Session>);
  dsec::Sandbox empty;
  EXPECT_THROW(empty.spawn({}), dsec::Error);
  EXPECT_THROW(empty.process(1), dsec::Error);
  EXPECT_THROW(empty.session("main"), dsec::Error);
  dsec::Process process;
  EXPECT_FALSE(static_cast<bool>(process));
  EXPECT_THROW(process.info(), dsec::Error);
  dsec::Session session;
  EXPECT_FALSE(static_cast<bool>(session));
  EXPECT_THROW(session.run("true"), dsec::Error);
}

}  // namespace
