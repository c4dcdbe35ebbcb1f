// Whose failure an error is: every code's usual fault, and an agent's word on one error travelling over the wire.
#include <gtest/gtest.h>

#include <string>

#include "common/protocol.hpp"
#include "dsec/error.hpp"

namespace dsec {
namespace {

TEST(ErrorFault, EveryCodeIsTheInfrastructuresOrTheRequests) {
  for (Code c :
       {Code::kUnknown, Code::kDeadlineExceeded, Code::kAborted, Code::kInternal, Code::kUnavailable, Code::kDataLoss})
    EXPECT_EQ(fault_of(c), Fault::kInfrastructure) << code_name(c);
  for (Code c : {Code::kCancelled, Code::kInvalidArgument, Code::kNotFound, Code::kAlreadyExists,
                 Code::kPermissionDenied, Code::kResourceExhausted, Code::kFailedPrecondition, Code::kOutOfRange,
                 Code::kUnimplemented, Code::kUnauthenticated})
    EXPECT_EQ(fault_of(c), Fault::kRequest) << code_name(c);
  EXPECT_TRUE(Error(Code::kUnavailable, "x").infrastructure());
  EXPECT_FALSE(Error(Code::kNotFound, "x").infrastructure());
  EXPECT_TRUE(NodeLost("n1", "gone").infrastructure());
}

TEST(ErrorFault, AnAgentsWordOnOneErrorCrossesTheWire) {
  Error lost(Code::kFailedPrecondition, "sandbox s is not running: its init process has exited", false,
             Fault::kInfrastructure);
  auto j = protocol::encode_error(lost);
  EXPECT_EQ(j["fault"], "infrastructure");
  Error back = protocol::decode_error(j, 412);
  EXPECT_EQ(back.code(), Code::kFailedPrecondition);
  EXPECT_TRUE(back.infrastructure());
  EXPECT_FALSE(back.retryable());
  // An agent that says nothing of the fault (an older one): the code's usual one.
  j.erase("fault");
  EXPECT_FALSE(protocol::decode_error(j, 412).infrastructure());
  EXPECT_TRUE(protocol::decode_error(protocol::json{{"code", "UNAVAILABLE"}, {"message", "m"}}, 503).infrastructure());
}

// "Outcome unknown" is a field of the error: written by the agent, read back by the client, ignored by nobody.
TEST(ErrorFault, OutcomeUnknownTravelsAsAField) {
  Error journal(Code::kDataLoss, "outcome unknown: request 'r' of sandbox s was under way", false,
                Fault::kInfrastructure, true);
  protocol::json j = protocol::encode_error(journal);
  EXPECT_EQ(j["outcome_unknown"], true);
  Error back = protocol::decode_error(j, 500);
  EXPECT_TRUE(back.outcome_unknown());
  EXPECT_EQ(std::string(back.what()), journal.what());
  EXPECT_EQ(back.code(), Code::kDataLoss);
  EXPECT_TRUE(OutcomeUnknown("r", "m").outcome_unknown());

  // Written only when set; other errors and unknown members decode as before.
  EXPECT_FALSE(protocol::encode_error(Error(Code::kDataLoss, "checksum")).contains("outcome_unknown"));
  Error other = protocol::decode_error(
      protocol::json{{"code", "DATA_LOSS"}, {"message", "checksum"}, {"later_field", {1, 2}}}, 500);
  EXPECT_FALSE(other.outcome_unknown());
  EXPECT_EQ(std::string(other.what()), "checksum");
  // An agent older than the field says so only in its message; the field, when present, decides.
  EXPECT_TRUE(protocol::decode_error(protocol::json{{"code", "DATA_LOSS"}, {"message", "outcome unknown: x"}}, 500)
                  .outcome_unknown());
  EXPECT_FALSE(
      protocol::decode_error(
          protocol::json{{"code", "DATA_LOSS"}, {"message", "outcome unknown: x"}, {"outcome_unknown", false}}, 500)
          .outcome_unknown());
}

}  // namespace
}  // namespace dsec
