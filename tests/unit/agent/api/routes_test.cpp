// Request targets of protocol v1: routes, sandbox ids, query decoding, and the checks on files parameters.
#include <gtest/gtest.h>

#include <functional>

#include "agent/api/routes.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"

namespace dsec::agent {
namespace {

TEST(AgentRoutes, MatchesEveryRouteOfProtocolV1) {
  EXPECT_EQ(parse_target("/healthz").route, Route::kHealthz);
  EXPECT_EQ(parse_target("/metrics").route, Route::kMetrics);
  EXPECT_EQ(parse_target("/v1/node").route, Route::kNode);
  EXPECT_EQ(parse_target("/v1/sandboxes").route, Route::kSandboxes);
  EXPECT_EQ(parse_target("/v1/sandboxes/").route, Route::kSandboxes);
  auto t = parse_target("/v1/sandboxes/n1-0123456789ab");
  EXPECT_EQ(t.route, Route::kSandbox);
  EXPECT_EQ(t.sandbox_id, "n1-0123456789ab");
  t = parse_target("/v1/sandboxes/n1-0123456789ab/exec");
  EXPECT_EQ(t.route, Route::kSandboxExec);
  EXPECT_EQ(t.sandbox_id, "n1-0123456789ab");
  t = parse_target("/v1/sandboxes/n1-x/files?path=%2Fetc%2Fhosts");
  EXPECT_EQ(t.route, Route::kSandboxFiles);
  EXPECT_EQ(t.sandbox_id, "n1-x");
  EXPECT_EQ(t.query.get("path"), "/etc/hosts");
  t = parse_target("/v1/sandboxes/n1-x/sleep");
  EXPECT_EQ(t.route, Route::kSandboxSleep);
  EXPECT_EQ(t.sandbox_id, "n1-x");
  EXPECT_EQ(route_template(t.route), "/v1/sandboxes/{id}/sleep");
  t = parse_target("/v1/sandboxes/n1-x/wake");
  EXPECT_EQ(t.route, Route::kSandboxWake);
  EXPECT_EQ(route_template(t.route), "/v1/sandboxes/{id}/wake");
  t = parse_target("/v1/sandboxes/n1-x/snapshot");
  EXPECT_EQ(t.route, Route::kSandboxSnapshot);
  EXPECT_EQ(t.sandbox_id, "n1-x");
  EXPECT_EQ(route_template(t.route), "/v1/sandboxes/{id}/snapshot");
  EXPECT_EQ(parse_target("/v1/sandboxes/n1-x/sleep/more").route, Route::kUnknown);
}

TEST(AgentRoutes, UnknownPathsAreUnknownNotErrors) {
  for (const char* target : {"/", "/v1", "/v2/node", "/v1/nodes", "/v1/sandboxes/x/y", "/v1/sandboxes/x/exec/more",
                             "/v1/sandboxes//exec", "/healthz/x", "/V1/node"}) {
    EXPECT_EQ(parse_target(target).route, Route::kUnknown) << target;
  }
}

TEST(AgentRoutes, AnEscapedSlashInAnIdDoesNotForgeARoute) {
  auto t = parse_target("/v1/sandboxes/a%2Fexec");
  EXPECT_EQ(t.route, Route::kSandbox);
  EXPECT_EQ(t.sandbox_id, "a/exec");
}

TEST(AgentRoutes, TargetsThatAreNotPathsAreInvalid) {
  EXPECT_CODE(parse_target("*"), Code::kInvalidArgument);
  EXPECT_CODE(parse_target("http://host/v1/node"), Code::kInvalidArgument);
  EXPECT_CODE(parse_target(""), Code::kInvalidArgument);
}

TEST(AgentRoutes, QueryValuesArePercentDecodedAndKeysRepeat) {
  auto q = parse_query("label=team%3Drl&label=size=big&tenant=a%20b&path=/x+y&flag&&empty=");
  EXPECT_EQ(q.get_all("label"), (std::vector<std::string>{"team=rl", "size=big"}));
  EXPECT_EQ(q.get("tenant"), "a b");
  EXPECT_EQ(q.get("path"), "/x+y");  // '+' is a literal plus
  EXPECT_EQ(q.get("flag"), "");
  EXPECT_EQ(q.get("empty"), "");
  EXPECT_FALSE(q.get("missing").has_value());
  EXPECT_EQ(percent_decode("%e2%9C%93", "x"), "\xe2\x9c\x93");
  EXPECT_EQ(percent_decode("a%00b", "x"), std::string("a\0b", 3));
}

TEST(AgentRoutes, MalformedEscapesAreInvalidArguments) {
  for (const char* q : {"path=%", "path=%4", "path=%zz", "path=%4g"}) {
    try {
      parse_query(q);
      FAIL() << q;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("query path"), std::string::npos) << e.what();
    }
  }
  EXPECT_CODE(parse_target("/v1/sandboxes/%zz"), Code::kInvalidArgument);
}

TEST(AgentRoutes, LabelFilters) {
  auto labels = parse_label_filters({"team=rl", "note=a=b", "empty="});
  EXPECT_EQ(labels.at("team"), "rl");
  EXPECT_EQ(labels.at("note"), "a=b");
  EXPECT_EQ(labels.at("empty"), "");
  EXPECT_CODE(parse_label_filters({"novalue"}), Code::kInvalidArgument);
  EXPECT_CODE(parse_label_filters({"=v"}), Code::kInvalidArgument);
}

TEST(AgentRoutes, SandboxPathsMustBeAbsoluteWithoutNul) {
  EXPECT_NO_THROW(check_sandbox_path("/etc/hosts", "path"));
  EXPECT_CODE(check_sandbox_path("etc/hosts", "path"), Code::kInvalidArgument);
  EXPECT_CODE(check_sandbox_path("", "path"), Code::kInvalidArgument);
  EXPECT_CODE(check_sandbox_path(std::string("/a\0b", 4), "path"), Code::kInvalidArgument);
  try {
    check_sandbox_path("relative", "path");
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("path: ", 0), 0u) << e.what();
  }
}

TEST(AgentRoutes, FileModesAreOctal) {
  EXPECT_EQ(parse_file_mode("0644"), 0644u);
  EXPECT_EQ(parse_file_mode("755"), 0755u);
  EXPECT_EQ(parse_file_mode("04755"), 04755u);
  EXPECT_CODE(parse_file_mode("0800"), Code::kInvalidArgument);
  EXPECT_CODE(parse_file_mode("rwx"), Code::kInvalidArgument);
  EXPECT_CODE(parse_file_mode("17777"), Code::kInvalidArgument);
  EXPECT_CODE(parse_file_mode(""), Code::kInvalidArgument);
}

TEST(AgentRoutes, RouteTemplatesNameMetricsLabels) {
  EXPECT_EQ(route_template(Route::kSandboxExec), "/v1/sandboxes/{id}/exec");
  EXPECT_EQ(route_template(Route::kUnknown), "unknown");
}

}  // namespace
}  // namespace dsec::agent
