// What unit tests share to check which error a call throws:
//
//   EXPECT_CODE(registry.get("nope"), Code::kNotFound);
//   EXPECT_CODE_MSG(parse("x"), Code::kInvalidArgument, "field 'x'");   // and its message holds this text
//   EXPECT_CODE(fine(), Code::kOk);                                     // throws nothing
//
// The statement is an expression (a call, a temporary's construction); its value is dropped. A failure names the
// statement, the code it threw (or that it threw none, or something that is not a dsec::Error) and the message; more
// context streams after the macro like after any EXPECT (`EXPECT_CODE(f(x), Code::kNotFound) << x;`). ASSERT_CODE and
// ASSERT_CODE_MSG stop the test instead. A test that checks more of the error than a part of its message (a prefix,
// its retryability) takes it with thrown().
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "dsec/error.hpp"

namespace dsec::test {

// What a call threw: the dsec::Error (as a plain Error, whatever subclass it was), or nothing (nullopt). Anything
// else it throws goes on up. thrown<E> catches another exception type the same way (the gateway's RpcError).
template <typename E = Error>
std::optional<E> thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e;
  }
  return std::nullopt;
}

// The code of the dsec::Error fn() throws; Code::kOk when it throws none.
inline Code code_of(const std::function<void()>& fn) {
  std::optional<Error> e = thrown(fn);
  return e ? e->code() : Code::kOk;
}

// The predicate behind EXPECT_CODE. gtest passes the text of each argument, then the arguments; the first argument
// is the statement's own text (the text gtest gives for it, and for the lambda around the statement, is not shown).
// Code::kOk means "throws nothing": a dsec::Error that says OK fails it too, and so does a message part asked of a
// call that throws nothing.
inline ::testing::AssertionResult throws_code(const char*, const char*, const char* code_text, const char*,
                                              const char* statement, const std::function<void()>& fn, Code expected,
                                              std::string_view message_part) {
  std::optional<Error> e;
  try {
    e = thrown(fn);
  } catch (const std::exception& other) {
    return ::testing::AssertionFailure() << statement << " threw a non-dsec exception: " << other.what()
                                         << " (expected " << code_text << ")";
  }
  if (!e && expected != Code::kOk)
    return ::testing::AssertionFailure() << statement << " threw nothing (expected " << code_text << ")";
  if (!e && !message_part.empty())
    return ::testing::AssertionFailure() << statement << " threw nothing, so no message holds \"" << message_part
                                         << "\"";
  if (!e) return ::testing::AssertionSuccess();
  if (e->code() != expected || expected == Code::kOk)
    return ::testing::AssertionFailure() << statement << " threw " << e->code_name() << ": " << e->what()
                                         << " (expected " << code_text << ")";
  if (std::string_view(e->what()).find(message_part) == std::string_view::npos)
    return ::testing::AssertionFailure() << statement << " threw " << e->code_name() << " with the message \""
                                         << e->what() << "\", which does not hold \"" << message_part << "\"";
  return ::testing::AssertionSuccess();
}

}  // namespace dsec::test

#define DSEC_TEST_CODE_(check, statement, code, part) \
  check(                                              \
      ::dsec::test::throws_code, #statement, [&] { (void)(statement); }, code, part)
#define EXPECT_CODE(statement, code) DSEC_TEST_CODE_(EXPECT_PRED_FORMAT4, statement, code, "")
#define ASSERT_CODE(statement, code) DSEC_TEST_CODE_(ASSERT_PRED_FORMAT4, statement, code, "")
#define EXPECT_CODE_MSG(statement, code, part) DSEC_TEST_CODE_(EXPECT_PRED_FORMAT4, statement, code, part)
#define ASSERT_CODE_MSG(statement, code, part) DSEC_TEST_CODE_(ASSERT_PRED_FORMAT4, statement, code, part)
