// dsec's one error model, shared by the client, the agent and the Python binding.
//
// Codes are the gRPC/abseil set. Every agent error travels as {"code": "NOT_FOUND", "message": "...",
// "retryable": false} with a fitting HTTP status; the client rebuilds the same dsec::Error from it, and the Python
// binding maps each code to an exception class (dsec.NotFound, dsec.Unavailable, ...).
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace dsec {

enum class Code {
  kOk = 0,
  kCancelled,
  kUnknown,
  kInvalidArgument,
  kDeadlineExceeded,
  kNotFound,
  kAlreadyExists,
  kPermissionDenied,
  kResourceExhausted,
  kFailedPrecondition,
  kAborted,
  kOutOfRange,
  kUnimplemented,
  kInternal,
  kUnavailable,
  kDataLoss,
  kUnauthenticated,
};

// "NOT_FOUND" for Code::kNotFound, and back. Unknown names map to kUnknown.
std::string_view code_name(Code code) noexcept;
Code code_from_name(std::string_view name) noexcept;

// The HTTP status an agent answers with for a code.
int http_status(Code code) noexcept;

// Whether a caller may retry an operation that failed with this code without changing anything: the transient
// failures (UNAVAILABLE, ABORTED, RESOURCE_EXHAUSTED). DEADLINE_EXCEEDED is not: the overall deadline is gone.
bool is_retryable(Code code) noexcept;

// Whose failure an error is, for a trainer deciding what a failed rollout means (docs/errors.md): the
// infrastructure's (a node lost, an agent unavailable, a sandbox that vanished, dsec's own fault: mask the rollout's
// loss, or run it again elsewhere) or the request's (what the caller asked for is wrong, unknown or not allowed:
// fix the call). What the task's command did is never an error: it is the ExecResult. Each code has its usual
// fault (fault_of); an agent may say otherwise for one error (a call on a sandbox whose init died is
// FAILED_PRECONDITION and the infrastructure's).
enum class Fault { kRequest, kInfrastructure };
Fault fault_of(Code code) noexcept;
std::string_view fault_name(Fault fault) noexcept;  // "request", "infrastructure"

class Error : public std::runtime_error {
 public:
  // std::runtime_error keeps its own copy of the message (it has no constructor that takes one over).
  Error(Code code, const std::string& message)
      : std::runtime_error(message), code_(code), retryable_(is_retryable(code)), fault_(fault_of(code)) {}
  Error(Code code, const std::string& message, bool retryable)
      : std::runtime_error(message), code_(code), retryable_(retryable), fault_(fault_of(code)) {}
  Error(Code code, const std::string& message, bool retryable, Fault fault)
      : std::runtime_error(message), code_(code), retryable_(retryable), fault_(fault) {}
  // `outcome_unknown`: see outcome_unknown().
  Error(Code code, const std::string& message, bool retryable, Fault fault, bool outcome_unknown)
      : std::runtime_error(message),
        code_(code),
        retryable_(retryable),
        outcome_unknown_(outcome_unknown),
        fault_(fault) {}

  Code code() const noexcept { return code_; }
  bool retryable() const noexcept { return retryable_; }
  Fault fault() const noexcept { return fault_; }
  bool infrastructure() const noexcept { return fault_ == Fault::kInfrastructure; }
  // Whether what failed is a request whose outcome cannot be known: an exactly-once request (an exec, a session's
  // run) that was under way when its agent stopped, so it may or may not have been carried out, and never is again.
  // The agent says so in its error's "outcome_unknown" field; OutcomeUnknown is the client's error for it.
  bool outcome_unknown() const noexcept { return outcome_unknown_; }
  std::string_view code_name() const noexcept { return dsec::code_name(code_); }

 private:
  Code code_;
  bool retryable_;
  bool outcome_unknown_ = false;
  Fault fault_;
};

// A call about a sandbox whose node is gone: it left the cluster (its registration lapsed) or stopped answering and
// is ejected. Raised at once, without retries: the sandbox's state lives on that node. UNAVAILABLE, not retryable;
// Python raises dsec.NodeLost (a dsec.Unavailable).
class NodeLost : public Error {
 public:
  NodeLost(std::string node, const std::string& message)
      : Error(Code::kUnavailable, message, false), node_(std::move(node)) {}
  const std::string& node() const noexcept { return node_; }

 private:
  std::string node_;
};

// An exec (or a session's run) whose outcome cannot be known: it carried request id `request_id`, its answer was
// lost, and no retry could learn what became of it (its agent restarted while the command ran, so the command was
// killed part way; or its node stopped answering). The command is never run a second time for it. DATA_LOSS, the
// infrastructure's, not retryable: a trainer masks the rollout. Python raises dsec.OutcomeUnknown.
class OutcomeUnknown : public Error {
 public:
  OutcomeUnknown(std::string request_id, const std::string& message)
      : Error(Code::kDataLoss, message, false, Fault::kInfrastructure, true), request_id_(std::move(request_id)) {}
  const std::string& request_id() const noexcept { return request_id_; }

 private:
  std::string request_id_;
};

}  // namespace dsec
